"""The fan-out example (seed 003) against a real server configured with
examples/allowance.toml: 100 admitted, 20 refused by the run's budget, zero
overspend; run again with the same run id, nothing is paid twice."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_harness import Server, unique

from allowance import Client

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import fanout  # noqa: E402

TIME_SCALE = 0.02
"""60 requests per 1.2 s instead of per minute: the same shape, 50× faster."""


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server((EXAMPLES / "allowance.toml").read_text())
    try:
        yield s
    finally:
        s.stop()


def test_fanout_finishes_within_budget_with_zero_overspend(server: Server) -> None:
    cfg = fanout.FanoutConfig(
        url=server.base_url,
        token=server.tokens.acme,
        admin_token=server.tokens.admin,
        run=unique("run"),
        time_scale=TIME_SCALE,
    )
    assert (cfg.tasks, cfg.input_tokens, cfg.output_tokens) == (120, 3000, 500), "seed 003"
    assert (cfg.budget_tokens, cfg.requests_per_minute) == (350_000, 60), "seed 003"
    report = asyncio.run(fanout.run(cfg))
    print(report.text())

    assert report.count("admitted") == 100
    assert report.count("refused") == 20
    assert report.count("already_done") == 0
    assert report.refusals == {("budget_exhausted", cfg.run_scope, "tokens"): 20}
    tokens = report.run_status.limit("tokens", "total")
    assert (tokens.used, tokens.held, tokens.capacity) == (350_000, 0, 350_000)
    assert report.overspend_tokens == 0
    # Seed 003's transient failures were retried inside their holds.
    assert any(o.attempts == 2 for o in report.outcomes)
    # The rate made the sub-tasks past the first 60 wait for refills (40 at
    # one per 20 ms), rather than fail.
    assert report.wall_s >= 40 * 60_000 * TIME_SCALE / 60 / 1000 * 0.9

    # Billing agrees: 100 settled records for the run, one request each,
    # no refund, whatever retried inside a hold.
    with Client(server.base_url, server.tokens.admin) as admin:
        records = [r for r in admin.usage(limit=10_000).records if r.labels.get("run") == cfg.run]
    assert len(records) == 100
    assert {r.kind for r in records} == {"settled"}
    assert sum(r.charged["requests"] for r in records) == 100
    assert sum(r.charged["tokens"] for r in records) == 350_000

    # The coordinator crashed and is run again with the same run id: every
    # finished sub-task replays by its key and is skipped; nothing is paid twice.
    again = asyncio.run(fanout.run(cfg))
    assert again.count("already_done") == 100
    assert again.count("refused") == 20
    assert again.count("admitted") == 0
    assert again.run_status.limit("tokens", "total").used == 350_000


def test_fanout_command_line_prints_the_report(server: Server) -> None:
    run = unique("run")
    out = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "fanout.py"),
            "--url",
            server.base_url,
            "--token",
            server.tokens.acme,
            "--admin-token",
            server.tokens.admin,
            "--run",
            run,
            "--tasks",
            "12",
            "--budget-tokens",
            "35000",
            "--time-scale",
            "0.01",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "admitted        10" in out.stdout
    assert f"2 budget_exhausted by tenant:acme/run:{run} (tokens)" in out.stdout
    assert "used 35000 of 35000 tokens, held 0, overspend 0" in out.stdout
