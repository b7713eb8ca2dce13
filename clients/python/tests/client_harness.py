"""Real processes for the tests: `allowance serve`, the stub upstream and a
private redis-server, each on a free 127.0.0.1 port, each killed at the end.

Nothing here is mocked: the tests talk HTTP to the binaries the workspace
builds (`cargo build -p allowance-cli -p allowance-stub`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
"""The workspace root (clients/python/tests → ../../..)."""

START_TIMEOUT_S = 60.0
"""A cold debug binary on a loaded 2-core machine can take a while."""


def binary(name: str, env_var: str, package: str) -> Path:
    """``$env_var`` if set, else ``target/debug/<name>``; fails the test
    (never skips it) when the binary is not built."""
    path = Path(os.environ.get(env_var) or REPO / "target" / "debug" / name)
    if not path.exists():
        pytest.fail(f"{path} does not exist: run `cargo build -p {package}`")
    return path


def sha256_hex(token: str) -> str:
    """The hash a token is configured by (`allowance token` prints the same)."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Tokens:
    """Fresh random credentials for one server: admin, and tenant tokens
    for ``acme`` and ``beta``."""

    admin: str = field(default_factory=lambda: "alw_" + secrets.token_hex(32))
    acme: str = field(default_factory=lambda: "alw_" + secrets.token_hex(32))
    beta: str = field(default_factory=lambda: "alw_" + secrets.token_hex(32))

    def toml(self) -> str:
        """The ``[[tokens]]`` entries of a configuration."""
        return "\n".join(
            [
                f'[[tokens]]\nsha256 = "{sha256_hex(self.admin)}"\nrole = "admin"\n',
                f'[[tokens]]\nsha256 = "{sha256_hex(self.acme)}"\nrole = "tenant"\n'
                'tenant = "acme"\n',
                f'[[tokens]]\nsha256 = "{sha256_hex(self.beta)}"\nrole = "tenant"\n'
                'tenant = "beta"\n',
            ]
        )


BASE_CONFIG = """
currency = "USD"

[reservations]
default_ttl_ms = 60_000
max_ttl_ms = 600_000

[queue]
max_wait_ms = 10_000

[kinds.tenant]
plan = "tenant-default"
[kinds.user]
plan = "user-default"
[kinds.agent]
plan = "agent-default"
[kinds.task]
plan = "task-default"
[kinds.upstream]
shared = true
plan = "upstream-default"

[plans.tenant-default]
overrun = "charge_actual"
limits = [
  { dimension = "concurrent",  capacity = 200 },
  { dimension = "cost_micros", capacity = 1_000_000_000, window = "total" },
]
[plans.user-default]
limits = [
  { dimension = "tokens", capacity = 1_000_000, window = "sliding", period = "1h", slices = 60 },
]
[plans.agent-default]
limits = [
  { dimension = "requests", capacity = 10_000, window = "bucket", period = "1m" },
]
[plans.task-default]
limits = [
  { dimension = "tokens", capacity = 10_000, window = "total" },
]
[plans.upstream-default]
limits = [
  { dimension = "requests", capacity = 10_000, window = "bucket", period = "1m" },
]
[plans.small]
limits = [
  { dimension = "tokens", capacity = 5_000, window = "total" },
]

[models."gpt-4o"]
input_per_million = "2.50"
output_per_million = "10.00"
max_output_tokens = 16_384
"""
"""Kinds, plans and a priced model most tests use; per-test limits are set
through the admin API on scopes with fresh ids."""


PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal a child gets when its parent dies."""

# Looked up before any fork: the child must not load libraries (a lock
# another thread held at fork time would never be released there).
_PRCTL = ctypes.CDLL(None).prctl if sys.platform == "linux" else None


def _kill_with_parent() -> None:
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child SIGKILLed when the test process
    dies (Linux), so a crashed or killed pytest leaves no server behind.

    Only from the main thread: the signal fires when the *thread* that
    forked exits, which for a helper thread is right away.
    """
    return _kill_with_parent if threading.current_thread() is threading.main_thread() else None


class Process:
    """A child process whose first line naming ``listening on http://…``
    (on stdout or in the JSON log on stderr) gives its address."""

    def __init__(self, argv: list[str], *, stream: str, env: dict[str, str] | None = None):
        self.lines: list[str] = []
        self._addresses: queue.Queue[str] = queue.Queue()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stream == "stdout" else subprocess.DEVNULL,
            stderr=subprocess.PIPE if stream == "stderr" else subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
            preexec_fn=_die_with_parent(),
        )
        pipe = self.proc.stdout if stream == "stdout" else self.proc.stderr
        assert pipe is not None
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()
        try:
            address = self._addresses.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            self.stop()
            raise RuntimeError(
                f"{argv[0]} did not say where it listens; output:\n" + "\n".join(self.lines)
            ) from None
        self.base_url = address if address.startswith("http") else f"http://{address}"

    def _read(self, pipe: object) -> None:
        for line in pipe:  # type: ignore[attr-defined]
            line = line.rstrip("\n")
            self.lines.append(line)
            if line.startswith("listening on "):
                self._addresses.put(line.removeprefix("listening on ").strip())
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            address = (record.get("fields") or {}).get("address")
            if isinstance(address, str):
                self._addresses.put(address)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers; always reaped."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


class Server(Process):
    """``allowance serve`` with ``config`` (TOML text) in a temp dir, the
    ledger in memory unless the config names a redis store."""

    def __init__(self, config: str, *, tokens: Tokens | None = None):
        self.tokens = tokens or Tokens()
        self.dir = tempfile.mkdtemp(prefix="allowance-py-")
        path = Path(self.dir) / "allowance.toml"
        path.write_text(config + "\n" + self.tokens.toml())
        argv = [
            str(binary("allowance", "ALLOWANCE_BIN", "allowance-cli")),
            "--log-format",
            "json",
            "serve",
        ]
        argv += ["--config", str(path), "--listen", "127.0.0.1:0"]
        if 'kind = "redis"' not in config:
            argv += ["--data-dir", ""]
        super().__init__(argv, stream="stderr", env={"RUST_LOG": "info"})

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Stub(Process):
    """The stub upstream (`allowance-stub`): OpenAI/Anthropic shapes on 127.0.0.1."""

    def __init__(self, *extra: str):
        argv = [
            str(binary("allowance-stub", "ALLOWANCE_STUB_BIN", "allowance-stub")),
            "--listen",
            "127.0.0.1:0",
        ]
        super().__init__([*argv, *extra], stream="stdout")


def free_port() -> int:
    """A port free right now on 127.0.0.1 (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Redis:
    """A private redis-server on a free port, in its own temp dir (never the
    one on 6379), with an append-only file fsynced on every write so a
    restart keeps what it had."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed (apt-get install redis-server)")
        self.exe = exe
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="allowance-py-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Starts (or restarts) it on the same port and directory; a no-op
        while it runs."""
        if self.proc is not None and self.proc.poll() is None:
            return
        argv = [self.exe, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", self.dir]
        argv += ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        argv += ["--protected-mode", "no", "--daemonize", "no"]
        argv += ["--logfile", str(Path(self.dir) / "redis.log")]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent()
        )
        deadline = time.monotonic() + 20
        while not self._ping():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.kill()
                raise RuntimeError("redis-server did not answer PING")
            time.sleep(0.05)

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def pause(self) -> None:
        """SIGSTOP: the store stops answering but keeps its connections;
        what the server sent meanwhile runs when it resumes (after the
        server answered 503: an outcome the client could not know)."""
        assert self.proc is not None and self.proc.poll() is None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the store vanishes without warning."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def close(self) -> None:
        """Kills it and removes its directory."""
        self.resume()
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def unique(prefix: str) -> str:
    """A fresh scope id, so tests sharing a server never share a scope."""
    return f"{prefix}-{secrets.token_hex(4)}"
