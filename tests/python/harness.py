"""The gateway's test harness: the real `allowance-stub` and `allowance serve`
processes, and thin clients for what the tests read back (the stub's control
endpoints, the server's native API and its metrics).

Everything talks plain HTTP on 127.0.0.1; nothing is mocked. The official SDKs
are the clients under test, so nothing here wraps them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

# The SDKs' own HTTP library: `httpx` before their 2026 releases, `httpx2`
# since. A stream that breaks surfaces as its transport error when the SDK
# does not wrap it (Anthropic's stream iterator does not).
try:
    import httpx2

    TRANSPORT_ERRORS: tuple[type[Exception], ...] = (httpx.TransportError, httpx2.TransportError)
except ImportError:  # pragma: no cover - older SDKs
    TRANSPORT_ERRORS = (httpx.TransportError,)

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "crates" / "allowance-estimate" / "fixtures"

TENANT = "acme"
USER = "bob"
UPSTREAM = "stub"
# The gateway's own retries of an upstream 429/5xx (stated in the config, so
# the tests do not lean on the default).
GATEWAY_MAX_RETRIES = 2
# Small on purpose: a stream of a few dozen tokens crosses several top-ups.
TRANCHE_TOKENS = 8
# Generous: the task scopes are where a test puts its own tight limits.
TASK_TOKENS = 1_000_000
USER_TOKENS = 50_000_000

# The model table, in micro-units per million tokens: written into the
# server's config and used by the tests to price what was settled.
PRICES_MICROS_PER_MILLION: dict[str, tuple[int, int]] = {
    "gpt-4o": (2_500_000, 10_000_000),
    "claude-sonnet-4-6": (3_000_000, 15_000_000),
    "gpt-4o-mini": (150_000, 600_000),
}
MAX_OUTPUT_TOKENS = 16_384
# A model whose configured output bound is small: a call that names no bound
# of its own outgrows it in a few dozen events.
SMALL_BOUND_MODEL = "gpt-4o-mini"
SMALL_BOUND_MAX_OUTPUT = 40
MAX_OUTPUT_TOKENS_OF: dict[str, int] = {SMALL_BOUND_MODEL: SMALL_BOUND_MAX_OUTPUT}

# How long a process may take to print its address, and a settle to show up.
START_TIMEOUT_S = 30.0
SETTLE_TIMEOUT_S = 10.0

LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")
METRIC_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
METRIC_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

Json = dict[str, Any]
T = TypeVar("T")


class HarnessError(AssertionError):
    """A process or endpoint the tests rely on misbehaved (a test failure)."""


def binary(env_var: str, name: str) -> Path:
    """The binary named by `env_var`, else `<repo>/target/debug/<name>`."""
    given = os.environ.get(env_var)
    path = Path(given) if given else REPO / "target" / "debug" / name
    if not path.is_file():
        raise HarnessError(
            f"{path} does not exist: build it (`cargo build -p allowance-cli -p allowance-stub`)"
            f" or point {env_var} at it"
        )
    return path


def price_micros(model: str, input_tokens: int, output_tokens: int) -> int:
    """The cost the ledger derives from the model table (rounded up once)."""
    input_price, output_price = PRICES_MICROS_PER_MILLION[model]
    total = input_tokens * input_price + output_tokens * output_price
    return -(-total // 1_000_000)


def wait_for(produce: Callable[[], T | None], what: str, timeout_s: float = SETTLE_TIMEOUT_S) -> T:
    """Polls `produce` until it returns something other than None."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = produce()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


@dataclass
class Process:
    """A child process whose output goes to files (never a pipe that could
    fill up and stall it)."""

    name: str
    popen: subprocess.Popen[bytes]
    log_paths: list[Path]

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.log_paths if p.exists())

    def wait_for_address(self) -> str:
        """The `http://127.0.0.1:PORT` the process prints once it listens."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            found = LISTENING.search(self.logs())
            if found:
                return found.group(1)
            if self.popen.poll() is not None:
                raise HarnessError(
                    f"{self.name} exited with {self.popen.returncode}:\n{self.logs()}"
                )
            time.sleep(0.02)
        raise HarnessError(f"{self.name} printed no address in {START_TIMEOUT_S} s:\n{self.logs()}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)


def spawn(name: str, argv: list[str], log_dir: Path) -> Process:
    out = log_dir / f"{name}.stdout"
    err = log_dir / f"{name}.stderr"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        popen = subprocess.Popen(argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    return Process(name=name, popen=popen, log_paths=[out, err])


class Stub:
    """The stub upstream's control endpoints."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.http = httpx.Client(base_url=base_url, timeout=10.0)

    def _post(self, path: str, body: Any) -> Any:
        r = self.http.post(path, json=body)
        if r.status_code != 200:
            raise HarnessError(f"stub {path} answered {r.status_code}: {r.text}")
        return r.json() if r.content else None

    def reset(self) -> None:
        self._post("/_stub/reset", {})

    def behave(self, **patch: Any) -> None:
        """`output_tokens`, `token_delay_ms`, `first_byte_delay_ms`, `concurrency_limit`."""
        self._post("/_stub/behavior", patch)

    def enqueue(self, *answers: Json) -> None:
        self._post("/_stub/enqueue", list(answers))

    def requests(self) -> list[Json]:
        r = self.http.get("/_stub/requests")
        r.raise_for_status()
        records: list[Json] = r.json()
        return records

    def model_requests(self) -> list[Json]:
        """The model calls received since the last reset (not the controls)."""
        return [r for r in self.requests() if not r["path"].startswith("/_stub/")]

    def stats(self) -> Json:
        r = self.http.get("/_stub/stats")
        r.raise_for_status()
        stats: Json = r.json()
        return stats

    def close(self) -> None:
        self.http.close()


class Ledger:
    """The server's native API (open: the test config has no `[[tokens]]`)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.http = httpx.Client(base_url=base_url, timeout=10.0)

    def usage(self, since: str | None) -> tuple[list[Json], str | None]:
        """Every usage-log record after `since`, and the cursor after them."""
        records: list[Json] = []
        cursor = since
        while True:
            params = {"limit": "1000"} | ({"since": cursor} if cursor is not None else {})
            r = self.http.get("/v1/usage", params=params)
            if r.status_code != 200:
                raise HarnessError(f"GET /v1/usage answered {r.status_code}: {r.text}")
            page = [json.loads(line) for line in r.text.splitlines() if line.strip()]
            records.extend(page)
            cursor = r.headers.get("x-next-cursor", cursor)
            if len(page) < 1000:
                return records, cursor

    def scope(self, scope: str) -> Json:
        r = self.http.get(f"/v1/scopes/{quote(scope, safe='')}")
        if r.status_code != 200:
            raise HarnessError(f"GET /v1/scopes/{scope} answered {r.status_code}: {r.text}")
        status: Json = r.json()
        return status

    def set_limits(self, scope: str, limits: list[Json]) -> None:
        r = self.http.put(f"/v1/scopes/{quote(scope, safe='')}", json={"limits": limits})
        if r.status_code != 200:
            raise HarnessError(f"PUT /v1/scopes/{scope} answered {r.status_code}: {r.text}")

    def adjust(self, scope: str, dimension: str, amount: int) -> None:
        """`amount` < 0 is a debit (usage rises)."""
        r = self.http.post(
            f"/v1/scopes/{quote(scope, safe='')}/adjust",
            json={"dimension": dimension, "amount": amount, "reason": "gateway SDK test"},
        )
        if r.status_code != 200:
            raise HarnessError(f"adjust {scope} answered {r.status_code}: {r.text}")

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        r = self.http.get("/metrics")
        r.raise_for_status()
        out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for line in r.text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = METRIC_LINE.match(line)
            if m is None:
                continue
            labels = frozenset(METRIC_LABEL.findall(m.group(2) or ""))
            out[(m.group(1), labels)] = float(m.group(3))
        return out

    def metric(self, name: str, **labels: str) -> float:
        """One series' value; 0 when the series does not exist yet."""
        return self.metrics().get((name, frozenset(labels.items())), 0.0)

    def calls(self, api: str, outcome: str) -> float:
        return self.metric("allowance_gateway_calls_total", api=api, outcome=outcome)

    def close(self) -> None:
        self.http.close()


def token_sha256(token: str) -> str:
    """The hex SHA-256 a configuration names a token or gateway key by."""
    return hashlib.sha256(token.encode()).hexdigest()


def spawn_server(config: Path, data_dir: str, log_dir: Path) -> Process:
    """`allowance serve --config CONFIG` on a free loopback port; `data_dir`
    "" keeps the ledger in memory."""
    argv = [str(binary("ALLOWANCE_BIN", "allowance")), "serve", "--config", str(config)]
    argv += ["--listen", "127.0.0.1:0", "--data-dir", data_dir]
    return spawn("allowance-serve", argv, log_dir)


@dataclass
class Stack:
    """One stub and one gateway in front of it (one per test module)."""

    gateway_url: str
    key: str
    stub: Stub
    ledger: Ledger
    processes: list[Process] = field(default_factory=list)

    def stop(self) -> None:
        self.stub.close()
        self.ledger.close()
        for p in reversed(self.processes):
            p.stop()


def gateway_config(stub_url: str, key: str) -> str:
    """The server's TOML: the stub as the only upstream (every model), one key."""
    key_sha256 = token_sha256(key)
    models = "\n".join(
        f'[models."{name}"]\n'
        f'input_per_million = "{inp / 1_000_000:.6f}"\n'
        f'output_per_million = "{out / 1_000_000:.6f}"\n'
        f"max_output_tokens = {MAX_OUTPUT_TOKENS_OF.get(name, MAX_OUTPUT_TOKENS)}\n"
        for name, (inp, out) in PRICES_MICROS_PER_MILLION.items()
    )
    return f"""
[kinds.user]
plan = "user"
[kinds.agent]
plan = "user"
[kinds.task]
plan = "task"
[plans.user]
limits = [{{ dimension = "tokens", capacity = {USER_TOKENS}, window = "total" }}]
[plans.task]
limits = [{{ dimension = "tokens", capacity = {TASK_TOKENS}, window = "total" }}]

{models}
[gateway]
stream_tranche_tokens = {TRANCHE_TOKENS}

[[gateway.upstreams]]
name = "{UPSTREAM}"
base_url = "{stub_url}"
models = ["*"]
requests_per_minute = 100000
max_retries = {GATEWAY_MAX_RETRIES}

[[gateway.keys]]
sha256 = "{key_sha256}"
tenant = "{TENANT}"
user = "{USER}"
client_scopes = ["agent", "task"]
"""


def start_stack(work_dir: Path) -> Stack:
    """Starts the stub, then `allowance serve` in front of it."""
    processes: list[Process] = []
    try:
        stub_proc = spawn(
            "allowance-stub",
            [str(binary("ALLOWANCE_STUB_BIN", "allowance-stub")), "--listen", "127.0.0.1:0"],
            work_dir,
        )
        processes.append(stub_proc)
        stub_url = stub_proc.wait_for_address()
        key = "sk-gw-test-" + secrets.token_hex(8)
        config = work_dir / "gateway.toml"
        config.write_text(gateway_config(stub_url, key))
        server = spawn_server(config, "", work_dir)
        processes.append(server)
        gateway_url = server.wait_for_address()
    except BaseException:
        for p in reversed(processes):
            p.stop()
        raise
    return Stack(
        gateway_url=gateway_url,
        key=key,
        stub=Stub(stub_url),
        ledger=Ledger(gateway_url),
        processes=processes,
    )


@dataclass
class Task:
    """One test's own scope (`X-Allowance-Task`) and its view of the ledger
    from the moment the test began."""

    id: str
    stack: Stack
    since: str | None

    @property
    def scope(self) -> str:
        return f"tenant:{TENANT}/task:{self.id}"

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Allowance-Task": self.id}

    def records(self) -> list[Json]:
        """The usage-log records of this test's calls (the caller's side)."""
        records, _ = self.stack.ledger.usage(self.since)
        return [r for r in records if self.scope in r["scopes"] and r["kind"] != "adjusted"]

    def attempts(self) -> list[Json]:
        """The upstream attempts recorded since the test began."""
        records, _ = self.stack.ledger.usage(self.since)
        return [r for r in records if f"upstream:{UPSTREAM}" in r["scopes"]]

    def wait_records(self, count: int) -> list[Json]:
        """Waits until this test's calls have `count` records (streams settle
        after their last byte); more than `count` is a failure."""

        def enough() -> list[Json] | None:
            got = self.records()
            return got if len(got) >= count else None

        got = wait_for(enough, f"{count} usage record(s) for {self.scope}")
        if len(got) != count:
            raise HarnessError(f"expected {count} record(s) for {self.scope}, got {got}")
        return got

    def only_settled(self) -> Json:
        (record,) = self.wait_records(1)
        if record["kind"] != "settled":
            raise HarnessError(f"expected a settled record, got {record}")
        return record

    def assert_nothing_held(self) -> None:
        """No hold left anywhere this test's calls touched."""
        for scope in (self.scope, f"upstream:{UPSTREAM}"):
            status = self.stack.ledger.scope(scope)
            assert status["held_reservations"] == 0, status
            assert all(limit["held"] == 0 for limit in status["limits"]), status


def new_task(stack: Stack, name: str) -> Task:
    stack.stub.reset()
    _, cursor = stack.ledger.usage(None)
    safe = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:24]
    return Task(id=f"{safe}-{secrets.token_hex(3)}", stack=stack, since=cursor)


def fixture(name: str) -> Json:
    """`crates/allowance-estimate/fixtures/<name>.json`."""
    body: Json = json.loads((FIXTURES / f"{name}.json").read_text())
    return body


def as_whole(body: Json) -> Json:
    """A fixture as a non-streaming call (so the SDK's answer carries usage)."""
    return {k: v for k, v in body.items() if k not in ("stream", "stream_options")}


def gaps_ms(records: list[Json]) -> Iterator[int]:
    """Milliseconds between consecutive stub requests."""
    times = [int(r["received_at_ms"]) for r in records]
    return (b - a for a, b in itertools.pairwise(times))
