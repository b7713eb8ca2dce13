"""The streaming agent example against the stub upstream and a real server
configured with examples/allowance.toml."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from client_harness import Server, Stub, unique

from allowance import Client
from allowance.openai import estimate_chat_input_tokens

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import streaming_agent  # noqa: E402


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server((EXAMPLES / "allowance.toml").read_text())
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def stub() -> Iterator[Stub]:
    s = Stub("--output-tokens", "200")
    try:
        yield s
    finally:
        s.stop()


def test_the_agent_streams_tops_up_and_stops_at_its_budget(server: Server, stub: Stub) -> None:
    cfg = streaming_agent.AgentConfig(
        url=server.base_url,
        token=server.tokens.acme,
        admin_token=server.tokens.admin,
        upstream=f"{stub.base_url}/v1",
        agent=unique("agent"),
        steps=20,
        quiet=True,
    )
    report = streaming_agent.run(cfg)
    print(report.text())

    full = [s for s in report.steps if s.from_usage_chunk]
    assert len(full) >= 2, "some steps completed before the budget ran out"
    for s in full:
        assert s.usage["output_tokens"] == 200
        # 200 tokens in tranches of 64, never past max_tokens: the hold grew
        # 64, 128, 192, then 200 as they arrived.
        assert s.held_output_tokens == 200
    inputs = [s.estimated_input_tokens for s in report.steps]
    assert inputs == sorted(inputs) and inputs[-1] > inputs[0], "the context grows every step"

    # The loop stopped because the agent's budget said no, and said where.
    assert report.stopped_by is not None
    assert report.stopped_by.scope == cfg.scope
    assert report.stopped_by.dimension == "tokens"
    tokens = report.status.limit("tokens", "total")
    assert tokens.held == 0
    assert tokens.used <= tokens.capacity == 2_500, "zero overspend"
    assert tokens.used == sum(
        s.usage["input_tokens"] + s.usage["output_tokens"] for s in report.steps
    )

    # Every step went upstream once, asking for the usage chunk.
    sent = httpx.get(f"{stub.base_url}/_stub/requests").json()
    mine = sent[-len(report.steps) :]
    assert all(r["body"]["stream_options"] == {"include_usage": True} for r in mine)

    with Client(server.base_url, server.tokens.admin) as admin:
        records = [
            r for r in admin.usage(limit=10_000).records if r.labels.get("agent") == cfg.agent
        ]
    assert [r.kind for r in records] == ["settled"] * len(report.steps)


def test_a_refused_top_up_cuts_the_stream_mid_answer(server: Server, stub: Stub) -> None:
    # Room for the first prompt and one tranche and a half: the top-up is
    # refused 64 tokens into the answer (the hold still covers them), and
    # again at the 65th, which exceeds the hold: the cut. That token
    # arrived, so it is shown and settled.
    first_prompt = estimate_chat_input_tokens(streaming_agent.FIRST_MESSAGES)
    cfg = streaming_agent.AgentConfig(
        url=server.base_url,
        token=server.tokens.acme,
        admin_token=server.tokens.admin,
        upstream=f"{stub.base_url}/v1",
        agent=unique("agent"),
        budget_tokens=first_prompt + 64 + 32,
        quiet=True,
    )
    report = streaming_agent.run(cfg)
    (step,) = report.steps
    assert step.from_usage_chunk is False
    assert step.cut_by is not None and step.cut_by.scope == cfg.scope
    assert report.stopped_by is step.cut_by
    assert step.usage == {"input_tokens": first_prompt, "output_tokens": 65}
    assert step.held_output_tokens == 64
    tokens = report.status.limit("tokens", "total")
    assert (tokens.used, tokens.held) == (first_prompt + 65, 0)


def test_the_agent_command_line(server: Server, stub: Stub) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "streaming_agent.py"),
            "--url",
            server.base_url,
            "--token",
            server.tokens.acme,
            "--admin-token",
            server.tokens.admin,
            "--upstream",
            f"{stub.base_url}/v1",
            "--steps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("hello") == 200
    assert "step 1: input ~" in out.stdout and "settled 200 (usage chunk)" in out.stdout
