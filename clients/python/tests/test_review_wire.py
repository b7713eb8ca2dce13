"""Review: the client on an imperfect network, with a real HTTP proxy.

A small threaded proxy on 127.0.0.1 sits between the client and a real
`allowance serve` and can be told, per request, to answer like a broken
load balancer (an HTML 502), to answer 503 *after* the server already
acted (the outcome-unknown case), or to hold an answer back. Nothing is
mocked: the server, the client and the sockets are real.
"""

from __future__ import annotations

import asyncio
import pickle
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
import httpx
import pytest
import pytest_asyncio
from client_harness import Server, unique

from allowance import (
    ApiError,
    AsyncClient,
    BudgetExhausted,
    Client,
    ExceedsLimit,
    RateLimited,
    StoreUnavailable,
    UnexpectedResponse,
)

AMOUNTS = {"input_tokens": 3000, "output_tokens": 500}

HTML_502 = b"<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>"
STORE_503 = (
    b'{"error": {"type": "store_unavailable", "message": "the store did not answer in time"}}'
)


@dataclass
class Rule:
    """What the proxy does with the next ``times`` requests matching
    ``method`` and the ``path`` pattern."""

    method: str
    path: str
    times: int = 1
    forward: bool = True
    """Send the request on to the server (so it acts on it) before answering."""
    status: int | None = None
    """Answer this status and ``body`` instead of the server's answer."""
    body: bytes = b""
    content_type: str = "application/json"
    delay_before_s: float = 0.0
    delay_after_s: float = 0.0
    arrived: threading.Event = field(default_factory=threading.Event)
    """Set when a matching request arrives."""
    forwarded: threading.Event = field(default_factory=threading.Event)
    """Set once the server has answered a forwarded request."""


class Proxy:
    """A scriptable HTTP/1.1 proxy on a free 127.0.0.1 port."""

    def __init__(self, upstream: str) -> None:
        self.rules: list[Rule] = []
        self.log: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._http = httpx.Client(base_url=upstream, timeout=30)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_POST = do_PUT = do_DELETE = _any

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def script(self, rule: Rule) -> None:
        """Applies ``rule`` to the next matching requests."""
        with self._lock:
            self.rules.append(rule)

    def reset(self) -> None:
        """Forgets every rule and the log."""
        with self._lock:
            self.rules.clear()
            self.log.clear()

    def count(self, method: str, path: str) -> int:
        """Requests seen so far matching ``method`` and the ``path`` pattern."""
        with self._lock:
            return sum(1 for m, p in self.log if m == method and re.search(path, p))

    def _take(self, method: str, path: str) -> Rule | None:
        with self._lock:
            self.log.append((method, path))
            for rule in self.rules:
                if rule.times > 0 and rule.method == method and re.search(rule.path, path):
                    rule.times -= 1
                    return rule
        return None

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("content-length") or 0)
        body = h.rfile.read(length) if length else b""
        rule = self._take(h.command, h.path)
        if rule is not None:
            rule.arrived.set()
        if rule is not None and rule.delay_before_s:
            time.sleep(rule.delay_before_s)
        status, content, content_type = 502, HTML_502, "text/html"
        if rule is None or rule.forward:
            headers = {
                k: v
                for k, v in h.headers.items()
                if k.lower() not in ("host", "content-length", "connection")
            }
            answer = self._http.request(h.command, h.path, content=body, headers=headers)
            status, content = answer.status_code, answer.content
            content_type = answer.headers.get("content-type", "application/json")
            if rule is not None:
                rule.forwarded.set()
        if rule is not None and rule.delay_after_s:
            time.sleep(rule.delay_after_s)
        if rule is not None and rule.status is not None:
            status, content, content_type = rule.status, rule.body, rule.content_type
        try:
            h.send_response(status)
            h.send_header("content-type", content_type)
            h.send_header("content-length", str(len(content)))
            h.end_headers()
            h.wfile.write(content)
        except OSError:
            pass  # the client went away (a cancelled request): nothing to answer

    def close(self) -> None:
        """Stops serving and closes the upstream connections."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._http.close()


@pytest.fixture(scope="module")
def proxy_process(server: Server) -> Iterator[Proxy]:
    p = Proxy(server.base_url)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def proxy(proxy_process: Proxy) -> Proxy:
    """The module's proxy, with no rules and an empty log."""
    proxy_process.reset()
    return proxy_process


@pytest.fixture(scope="module")
def pacme(server: Server, proxy_process: Proxy) -> Iterator[Client]:
    """The `acme` client, through the proxy."""
    with Client(proxy_process.base_url, server.tokens.acme, timeout_s=10) as c:
        yield c


@pytest_asyncio.fixture
async def apacme(server: Server, proxy: Proxy) -> AsyncIterator[AsyncClient]:
    """The async `acme` client, through the proxy."""
    async with AsyncClient(proxy.base_url, server.tokens.acme, timeout_s=10) as c:
        yield c


def held_reservations(client: Client, scope: str) -> int:
    return client.status(scope).held_reservations


def no_holds_within(client: Client, scope: str, timeout_s: float) -> bool:
    """Polls ``scope`` until it holds nothing (True) or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while held_reservations(client, scope):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# A proxy's HTML error page --------------------------------------------------


def test_an_html_502_is_a_typed_error_not_a_json_decode_error(proxy: Proxy, pacme: Client) -> None:
    proxy.script(Rule("POST", r"^/v1/reservations$", forward=False, status=502, body=HTML_502))
    with pytest.raises(UnexpectedResponse) as e:
        pacme.reserve("acme", AMOUNTS)
    err = e.value
    assert isinstance(err, ApiError) and err.status_code == 502
    assert "not JSON" in err.message and "502 Bad Gateway" in err.message
    # A 200 whose body is not the API's (a captive portal): typed too.
    proxy.script(
        Rule("GET", r"^/v1/scopes/", forward=False, status=200, body=HTML_502, content_type="x")
    )
    with pytest.raises(UnexpectedResponse) as e:
        pacme.status("tenant:acme")
    assert e.value.status_code == 200


# A settle that fails inside the block must not become a refund ---------------


def test_a_settle_lost_to_a_502_is_not_turned_into_a_refund(
    proxy: Proxy, pacme: Client, acme: Client
) -> None:
    # The model call happened; only the settle's answer was lost (the load
    # balancer failed). Leaving the block with that error must not refund:
    # that makes a call that really ran free.
    user = unique("u")
    with (
        pytest.raises(UnexpectedResponse),
        pacme.reserve("acme", AMOUNTS, scopes={"user": user}) as r,
    ):
        proxy.script(Rule("POST", r"/settle$", forward=False, status=502, body=HTML_502))
        r.settle({"input_tokens": 3000, "output_tokens": 120})
    info = acme.get(r.id)
    assert info.status == "settled", f"a call that ran was {info.status}: it cost nothing"
    assert info.charged is not None and info.charged["tokens"] >= 3120


async def test_async_a_settle_lost_to_a_502_is_not_turned_into_a_refund(
    proxy: Proxy, apacme: AsyncClient, acme: Client
) -> None:
    user = unique("u")
    with pytest.raises(UnexpectedResponse):
        async with apacme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
            proxy.script(Rule("POST", r"/settle$", forward=False, status=502, body=HTML_502))
            await r.settle({"input_tokens": 3000, "output_tokens": 120})
    info = acme.get(r.id)
    assert info.status == "settled", f"a call that ran was {info.status}: it cost nothing"


async def test_async_a_settle_cancelled_in_flight_is_not_turned_into_a_refund(
    proxy: Proxy, apacme: AsyncClient, acme: Client
) -> None:
    # A timeout (asyncio.timeout, wait_for, a TaskGroup sibling failing)
    # cancels the task while its settle is on the wire: the call ran.
    user = unique("u")
    slow_settle = Rule("POST", r"/settle$", delay_before_s=0.6)
    proxy.script(slow_settle)
    ids: list[str] = []

    async def call() -> None:
        async with apacme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
            ids.append(r.id)
            await r.settle({"input_tokens": 3000, "output_tokens": 120})

    task = asyncio.create_task(call())
    assert await asyncio.to_thread(slow_settle.arrived.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.8)  # the delayed settle reaches the server too
    info = acme.get(ids[0])
    assert info.status == "settled", f"a call that ran was {info.status}: it cost nothing"


class SlowSettles(httpx.AsyncBaseTransport):
    """Delays every settle before it leaves the client: a settle cut off
    by a cancellation then never reaches the server by itself."""

    def __init__(self, delay_s: float) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self._delay_s = delay_s

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/settle"):
            await asyncio.sleep(self._delay_s)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def test_async_a_settle_under_a_level_triggered_deadline_still_lands(
    server: Server, acme: Client
) -> None:
    # An anyio deadline (httpx's own library) cancels every await past it,
    # the guard's settle again included: the settle must run to its end
    # anyway, or the call that ran is left to expire, free. (An audit found
    # the reservation held, then expired with nothing used.)
    user = unique("u")
    ids: list[str] = []
    async with AsyncClient(
        server.base_url, server.tokens.acme, transport=SlowSettles(0.3)
    ) as client:
        with anyio.move_on_after(0.15):
            async with client.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
                ids.append(r.id)
                await r.settle({"input_tokens": 3000, "output_tokens": 120})
        # Leaving the client waits for what it still sends.
    info = acme.get(ids[0])
    assert info.status == "settled", f"a call that ran was {info.status}: it cost nothing"


async def test_reserve_or_wait_cancelled_after_an_unknown_outcome_leaks_no_hold(
    proxy: Proxy, apacme: AsyncClient, acme: Client
) -> None:
    # The first attempt held but its answer was lost (a 503); the retry,
    # with the same key, replays that hold, and the task is cancelled while
    # the replay's answer is on its way. The replayed hold is this call's
    # own: it must be refunded, not left to its TTL (an audit found it held).
    user = unique("u")
    scope = f"tenant:acme/user:{user}"
    proxy.script(Rule("POST", r"^/v1/reservations$", forward=True, status=503, body=STORE_503))
    slow_replay = Rule("POST", r"^/v1/reservations$", delay_after_s=0.5)
    proxy.script(slow_replay)
    task = asyncio.ensure_future(
        apacme.reserve_or_wait(
            "acme",
            AMOUNTS,
            scopes={"user": user},
            idempotency_key=unique("k"),
            ttl_ms=120_000,
            max_queue_ms=0,
            timeout_s=10,
        )
    )
    assert await asyncio.to_thread(slow_replay.forwarded.wait, 5), "the retry reached the server"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    released = await asyncio.to_thread(no_holds_within, acme, scope, 3.0)
    assert released, "a cancelled reserve_or_wait left its replayed hold behind"


# reserve_or_wait ----------------------------------------------------------------


def test_reserve_or_wait_with_a_none_key_does_not_retry_a_503(
    proxy: Proxy, pacme: Client, acme: Client
) -> None:
    # `idempotency_key=None` sends no key (the body builder drops None), yet
    # the retry policy sees the option and believes the retry is safe: the
    # server held the first attempt, its answer was a 503, and the retry
    # holds a second time.
    user = unique("u")
    proxy.script(Rule("POST", r"^/v1/reservations$", forward=True, status=503, body=STORE_503))
    options: dict[str, Any] = {"scopes": {"user": user}, "idempotency_key": None}
    with pytest.raises(StoreUnavailable):
        pacme.reserve_or_wait("acme", AMOUNTS, timeout_s=3, max_queue_ms=0, **options)
    assert proxy.count("POST", r"^/v1/reservations$") == 1, "retried without a key"
    assert held_reservations(acme, f"tenant:acme/user:{user}") <= 1, "two holds for one call"


async def test_async_reserve_or_wait_with_a_none_key_does_not_retry_a_503(
    proxy: Proxy, apacme: AsyncClient, acme: Client
) -> None:
    user = unique("u")
    proxy.script(Rule("POST", r"^/v1/reservations$", forward=True, status=503, body=STORE_503))
    options: dict[str, Any] = {"scopes": {"user": user}, "idempotency_key": None}
    with pytest.raises(StoreUnavailable):
        await apacme.reserve_or_wait("acme", AMOUNTS, timeout_s=3, max_queue_ms=0, **options)
    assert proxy.count("POST", r"^/v1/reservations$") == 1, "retried without a key"
    assert held_reservations(acme, f"tenant:acme/user:{user}") <= 1, "two holds for one call"


async def test_async_reserve_or_wait_without_a_key_does_not_retry_a_503(
    proxy: Proxy, apacme: AsyncClient, acme: Client
) -> None:
    user = unique("u")
    proxy.script(Rule("POST", r"^/v1/reservations$", forward=True, status=503, body=STORE_503))
    with pytest.raises(StoreUnavailable):
        await apacme.reserve_or_wait(
            "acme", AMOUNTS, scopes={"user": user}, timeout_s=3, max_queue_ms=0
        )
    assert proxy.count("POST", r"^/v1/reservations$") == 1
    assert held_reservations(acme, f"tenant:acme/user:{user}") == 1, "the hidden hold only"


def test_reserve_or_wait_retries_a_503_with_a_key_and_holds_once(
    proxy: Proxy, pacme: Client, acme: Client
) -> None:
    user = unique("u")
    proxy.script(Rule("POST", r"^/v1/reservations$", forward=True, status=503, body=STORE_503))
    r = pacme.reserve_or_wait(
        "acme",
        AMOUNTS,
        scopes={"user": user},
        idempotency_key=f"v1:{unique('run')}:t:p:x",
        timeout_s=5,
        max_queue_ms=0,
    )
    assert r.replayed is True, "the retry found the first attempt's hold"
    assert held_reservations(acme, f"tenant:acme/user:{user}") == 1
    r.settle(AMOUNTS)


def test_reserve_or_wait_never_retries_before_retry_after(
    admin: Client, proxy: Proxy, pacme: Client
) -> None:
    # A bucket of 1 request a minute: the server says "retry in ~60 s",
    # exactly (a bucket's deficit / rate). With 0.8 s to wait, there is no
    # retry that can pass; the README promises "never earlier than the
    # server said", yet the policy sleeps what is left and asks again.
    agent = unique("a")
    admin.set_scope(
        f"tenant:acme/agent:{agent}",
        limits=[{"dimension": "requests", "capacity": 1, "window": "bucket", "period_ms": 60_000}],
    )
    pacme.reserve("acme", {}, scopes={"agent": agent}).settle({})
    with pytest.raises(RateLimited) as e:
        pacme.reserve_or_wait("acme", {}, scopes={"agent": agent}, timeout_s=0.8, max_queue_ms=0)
    assert e.value.retry_after is not None and e.value.retry_after > 30
    attempts = proxy.count("POST", r"^/v1/reservations$") - 1
    assert attempts == 1, f"{attempts} attempts within 0.8 s of a 60 s retry_after"


def test_reserve_or_wait_raises_hard_denials_at_once(proxy: Proxy, pacme: Client) -> None:
    task = unique("t")
    pacme.reserve("acme", {"tokens": 10_000}, scopes={"task": task}).settle({"tokens": 10_000})
    before = proxy.count("POST", r"^/v1/reservations$")
    with pytest.raises(BudgetExhausted):
        pacme.reserve_or_wait("acme", {"tokens": 1}, scopes={"task": task}, timeout_s=10)
    with pytest.raises(ExceedsLimit):
        pacme.reserve_or_wait("acme", {"tokens": 10_001}, scopes={"task": task}, timeout_s=10)
    assert proxy.count("POST", r"^/v1/reservations$") - before == 2, "one attempt each"


# Cancellation of a reserve in flight -------------------------------------------


async def test_a_reserve_cancelled_in_flight_leaks_no_hold(
    proxy: Proxy, apacme: AsyncClient, acme: Client
) -> None:
    # The server granted the hold; the answer is on its way when the task is
    # cancelled (a timeout around "reserve and call"). Nobody refunds it: the
    # hold blocks the scope until its TTL (60 s here).
    user = unique("u")
    scope = f"tenant:acme/user:{user}"
    slow_answer = Rule("POST", r"^/v1/reservations$", delay_after_s=0.5)
    proxy.script(slow_answer)

    async def call() -> None:
        async with apacme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
            await r.settle(AMOUNTS)

    task = asyncio.create_task(call())
    assert await asyncio.to_thread(slow_answer.forwarded.wait, 5), "the server holds it"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    released = await asyncio.to_thread(no_holds_within, acme, scope, 2.0)
    assert released, "a cancelled reserve left its hold behind"


# Errors as values ------------------------------------------------------------------


def test_a_denial_survives_pickling(admin: Client, acme: Client) -> None:
    # concurrent.futures.ProcessPoolExecutor and multiprocessing pickle a
    # worker's exception to hand it to the parent.
    agent = unique("a")
    admin.set_scope(
        f"tenant:acme/agent:{agent}",
        limits=[{"dimension": "requests", "capacity": 1, "window": "bucket", "period_ms": 60_000}],
    )
    acme.reserve("acme", {}, scopes={"agent": agent}).settle({})
    with pytest.raises(RateLimited) as e:
        acme.reserve("acme", {}, scopes={"agent": agent})
    clone = pickle.loads(pickle.dumps(e.value))
    assert type(clone) is RateLimited
    assert (clone.scope, clone.dimension, clone.retry_after_ms) == (
        e.value.scope,
        e.value.dimension,
        e.value.retry_after_ms,
    )
    assert clone.status_code == 429 and str(clone) == str(e.value)


# One client, many threads ------------------------------------------------------------


def test_one_client_is_safe_across_threads(acme: Client) -> None:
    user = unique("u")
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(8):
                with acme.reserve("acme", {"tokens": 10}, scopes={"user": user}) as r:
                    r.settle({"tokens": 7})
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    st = acme.status(f"tenant:acme/user:{user}")
    assert (st.limit("tokens").used, st.limit("tokens").held, st.held_reservations) == (
        8 * 8 * 7,
        0,
        0,
    )
