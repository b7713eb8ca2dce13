"""Outcomes the client cannot know: the server runs on a private
redis-server that the test pauses (SIGSTOP), so the server answers 503
while what it sent to the store still runs when the store resumes — a hold
granted after its reserve was answered 503, a settle that may or may not
have landed. The client must neither leak such a hold nor throw away a
reply that was paid for."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from client_harness import BASE_CONFIG, Redis, Server, Stub, unique

import allowance.openai as budgeted
from allowance import (
    AsyncClient,
    Client,
    Reservation,
    SettleFailedWarning,
    StoreUnavailable,
    idempotency_key,
)
from allowance.openai import AsyncBudgetedOpenAI, BudgetedOpenAI

MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "Summarise the report."}]


@pytest.fixture(scope="module")
def redis() -> Iterator[Redis]:
    r = Redis()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="module")
def server(redis: Redis) -> Iterator[Server]:
    store = f'kind = "redis"\nurl = "{redis.url}"\ntimeout_ms = 300\non_error = "fail_closed"'
    s = Server(f"{BASE_CONFIG}\n[store]\n{store}\n")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def stub() -> Iterator[Stub]:
    s = Stub("--output-tokens", "40")
    try:
        yield s
    finally:
        s.stop()


TIMERS: list[threading.Timer] = []
"""Resumes a test scheduled: joined at its end, so none fires in the next."""


def resume_later(redis: Redis, delay_s: float) -> None:
    timer = threading.Timer(delay_s, redis.resume)
    TIMERS.append(timer)
    timer.start()


@pytest.fixture(autouse=True)
def store_answers(redis: Redis, server: Server) -> Iterator[None]:
    """Every test starts and ends with the store answering."""
    yield
    while TIMERS:
        TIMERS.pop().join()
    redis.resume()
    with Client(server.base_url, server.tokens.acme) as c:
        wait_until_ready(c)


def wait_until_ready(client: Client) -> None:
    deadline = time.monotonic() + 15
    while True:
        try:
            client.status("tenant:acme")
            return
        except StoreUnavailable:
            assert time.monotonic() < deadline, "the server did not recover"
            time.sleep(0.1)


def held(client: Client, user: str) -> int:
    return client.status(f"tenant:acme/user:{user}").held_reservations


def upstream_pausing_the_store(
    stub: Stub, redis: Redis, resume_after_s: float | None
) -> openai.OpenAI:
    """The stub upstream through an httpx client whose response hook
    pauses the store the moment the model's answer arrives (and resumes it
    ``resume_after_s`` later, if given): the call ran, its settle meets an
    outage."""

    def on_response(response: Any) -> None:
        if response.request.url.path.endswith("/chat/completions"):
            redis.pause()
            if resume_after_s is not None:
                resume_later(redis, resume_after_s)

    httpx.post(f"{stub.base_url}/_stub/reset").raise_for_status()
    http = openai.DefaultHttpxClient(event_hooks={"response": [on_response]})
    return openai.OpenAI(
        base_url=f"{stub.base_url}/v1", api_key="sk-stub", max_retries=0, http_client=http
    )


def model_calls(stub: Stub) -> int:
    return len(httpx.get(f"{stub.base_url}/_stub/requests").json())


# The openai wrapper: a paid reply is never thrown away (finding 3) --------------


def test_a_paid_reply_is_returned_and_settled_when_the_store_comes_back(
    stub: Stub, redis: Redis, acme: Client
) -> None:
    user = unique("u")
    ai = BudgetedOpenAI(
        upstream_pausing_the_store(stub, redis, resume_after_s=1.0),
        acme,
        tenant="acme",
        scopes={"user": user},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", SettleFailedWarning)
        reply = ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=100)
    assert reply.usage is not None
    assert model_calls(stub) == 1
    redis.resume()
    wait_until_ready(acme)
    record = acme.status(f"tenant:acme/user:{user}")
    assert record.held_reservations == 0, "the settle was retried until it landed"
    assert record.limit("tokens").used == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_a_paid_reply_is_returned_with_a_warning_when_the_settle_never_lands(
    stub: Stub, redis: Redis, acme: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: create() raised StoreUnavailable although the model answered;
    # the app retries and pays twice, and the hold expires uncharged.
    monkeypatch.setattr(budgeted, "SETTLE_RETRY_DELAYS_S", (0.05, 0.05))
    user = unique("u")
    ai = BudgetedOpenAI(
        upstream_pausing_the_store(stub, redis, resume_after_s=None),
        acme,
        tenant="acme",
        scopes={"user": user},
    )
    try:
        with pytest.warns(SettleFailedWarning, match="the reply is returned") as caught:
            reply = ai.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=100)
    finally:
        redis.resume()
    assert reply.choices[0].message.content
    assert model_calls(stub) == 1
    # pytest.warns records every warning meanwhile (a ResourceWarning from
    # a collected file may come first): look at the wrapper's own.
    settle_failures = [str(w.message) for w in caught if w.category is SettleFailedWarning]
    assert any("StoreUnavailable" in m for m in settle_failures), settle_failures


async def test_async_a_paid_reply_is_returned_when_the_settle_fails(
    stub: Stub, redis: Redis, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(budgeted, "SETTLE_RETRY_DELAYS_S", (0.05, 0.05))
    user = unique("u")

    async def on_response(response: Any) -> None:
        if response.request.url.path.endswith("/chat/completions"):
            redis.pause()

    async with (
        openai.DefaultAsyncHttpxClient(event_hooks={"response": [on_response]}) as http,
        AsyncClient(server.base_url, server.tokens.acme) as client,
    ):
        (await http.post(f"{stub.base_url}/_stub/reset")).raise_for_status()
        upstream = openai.AsyncOpenAI(
            base_url=f"{stub.base_url}/v1", api_key="sk-stub", max_retries=0, http_client=http
        )
        ai = AsyncBudgetedOpenAI(upstream, client, tenant="acme", scopes={"user": user})
        try:
            with pytest.warns(SettleFailedWarning):
                reply = await ai.chat.completions.create(
                    model="gpt-4o", messages=MESSAGES, max_tokens=100
                )
        finally:
            redis.resume()
    assert reply.usage is not None
    assert model_calls(stub) == 1


# reserve_or_wait: a replay after its own 503 is its own hold ---------------------


def test_sync_reserve_or_wait_guards_the_replay_of_its_own_503(redis: Redis, acme: Client) -> None:
    # Attempt 1 is answered 503 but runs when the store resumes; the retry
    # is answered by the replay of that hold. It is this call's own: the
    # guard refunds it when the block fails (it must not take it for
    # another worker's and refuse to enter).
    user = unique("u")
    key = idempotency_key(unique("run"), "t1", "openai", {"n": 1})
    redis.pause()
    resume_later(redis, 0.5)
    r = acme.reserve_or_wait(
        "acme", {"tokens": 10}, scopes={"user": user}, idempotency_key=key, timeout_s=20
    )
    assert isinstance(r, Reservation)
    assert (r.replayed, r.status, r.owned) == (True, "held", True)
    with pytest.raises(RuntimeError), r:
        raise RuntimeError("the model call failed")
    assert acme.get(r.id).status == "refunded"
    assert held(acme, user) == 0


# AsyncClient.reserve_or_wait cancelled between attempts (finding 4) --------------


class Probe(httpx.AsyncBaseTransport):
    """Real HTTP, with an event set when a reserve is answered 503."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.answered_503 = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        if request.url.path == "/v1/reservations" and response.status_code == 503:
            self.answered_503.set()
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


async def test_cancelling_reserve_or_wait_in_its_backoff_leaks_no_hold(
    redis: Redis, server: Server, acme: Client
) -> None:
    user = unique("u")
    key = idempotency_key(unique("run"), "t1", "openai", {"n": 1})
    probe = Probe()
    redis.pause()
    try:
        async with AsyncClient(server.base_url, server.tokens.acme, transport=probe) as c:
            task = asyncio.ensure_future(
                c.reserve_or_wait(
                    "acme", {"tokens": 10}, scopes={"user": user}, idempotency_key=key, timeout_s=30
                )
            )
            await asyncio.wait_for(probe.answered_503.wait(), 10)
            await asyncio.sleep(0.03)  # the answer is read; the backoff (≥ 0.1 s) runs
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The first attempt runs as the store resumes: it holds, for nobody.
            redis.resume()
        # `aclose` waited for the replay of the key and its refund.
        assert held(acme, user) == 0, "the hold of the cancelled call leaked"
        wait_until_ready(acme)
        # The key's reservation was released (refunded), not left to its TTL.
        replay = acme.reserve("acme", {"tokens": 10}, scopes={"user": user}, idempotency_key=key)
        assert (replay.replayed, replay.status) == (True, "refunded")
    finally:
        redis.resume()
