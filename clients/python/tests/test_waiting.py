"""``wait_ms`` (the server's admission queue) and ``reserve_or_wait``
(retry after ``retry_after``, with jitter and a cap)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from client_harness import unique

from allowance import AsyncClient, BudgetExhausted, Client, ExceedsLimit, RateLimited
from allowance._shared import WaitPolicy


def bucket(admin: Client, capacity: int, period_ms: int) -> str:
    """A fresh agent scope limited to ``capacity`` requests per ``period_ms``."""
    agent = unique("a")
    admin.set_scope(
        f"tenant:acme/agent:{agent}",
        limits=[
            {
                "dimension": "requests",
                "capacity": capacity,
                "window": "bucket",
                "period_ms": period_ms,
            }
        ],
    )
    return agent


def concurrency(admin: Client, capacity: int) -> str:
    """A fresh agent scope allowing ``capacity`` reservations at once."""
    agent = unique("a")
    admin.set_scope(
        f"tenant:acme/agent:{agent}", limits=[{"dimension": "concurrent", "capacity": capacity}]
    )
    return agent


def test_wait_ms_queues_until_room_frees(admin: Client, acme: Client) -> None:
    agent = concurrency(admin, 1)
    first = acme.reserve("acme", {}, scopes={"agent": agent}, ttl_ms=60_000)
    with pytest.raises(RateLimited) as e:
        acme.reserve("acme", {}, scopes={"agent": agent})
    assert e.value.dimension == "concurrent"
    # The hold would block for its whole TTL; a settle frees it at once, and
    # the waiter is admitted right then.
    timer = threading.Timer(0.3, lambda: first.settle({}))
    timer.start()
    t = time.monotonic()
    second = acme.reserve("acme", {}, scopes={"agent": agent}, wait_ms=5_000)
    waited = time.monotonic() - t
    timer.join()
    assert second.status == "held"
    assert 0.25 <= waited < 3, waited
    second.settle({})


def test_wait_ms_runs_out_with_the_usual_429(admin: Client, acme: Client) -> None:
    agent = concurrency(admin, 1)
    held = acme.reserve("acme", {}, scopes={"agent": agent})
    t = time.monotonic()
    with pytest.raises(RateLimited):
        acme.reserve("acme", {}, scopes={"agent": agent}, wait_ms=300)
    assert 0.25 <= time.monotonic() - t < 3
    held.refund()


def test_reserve_or_wait_honours_retry_after(admin: Client, acme: Client) -> None:
    agent = bucket(admin, 2, 2_000)  # refills one request every second
    for _ in range(2):
        acme.reserve("acme", {}, scopes={"agent": agent}).settle({})
    with pytest.raises(RateLimited) as e:
        acme.reserve("acme", {}, scopes={"agent": agent})
    retry_after = e.value.retry_after
    assert retry_after is not None and 0.5 < retry_after <= 1.0
    t = time.monotonic()
    # max_queue_ms=0: the client waits (not the server's queue).
    r = acme.reserve_or_wait("acme", {}, scopes={"agent": agent}, max_queue_ms=0, timeout_s=5)
    waited = time.monotonic() - t
    assert r.status == "held"
    # It slept until the refill (what was left of retry_after), no more than
    # the jitter's quarter beyond it.
    assert 0.4 <= waited < retry_after * 1.25 + 1.0, (waited, retry_after)
    r.settle({})


def test_reserve_or_wait_gives_up_at_its_timeout(admin: Client, acme: Client) -> None:
    agent = bucket(admin, 1, 60_000)
    acme.reserve("acme", {}, scopes={"agent": agent}).settle({})
    t = time.monotonic()
    with pytest.raises(RateLimited):
        acme.reserve_or_wait("acme", {}, scopes={"agent": agent}, timeout_s=0.5, max_backoff_s=0.2)
    assert 0.4 <= time.monotonic() - t < 3


def test_reserve_or_wait_stops_at_once_on_hard_denials(acme: Client) -> None:
    task = unique("t")
    acme.reserve("acme", {"tokens": 10_000}, scopes={"task": task}).settle({"tokens": 10_000})
    t = time.monotonic()
    with pytest.raises(BudgetExhausted):
        acme.reserve_or_wait("acme", {"tokens": 1}, scopes={"task": task}, timeout_s=30)
    with pytest.raises(ExceedsLimit):
        acme.reserve_or_wait("acme", {"tokens": 10_001}, scopes={"task": unique("t")}, timeout_s=30)
    assert time.monotonic() - t < 2


def test_reserve_or_wait_uses_the_server_queue(admin: Client, acme: Client) -> None:
    agent = concurrency(admin, 1)
    first = acme.reserve("acme", {}, scopes={"agent": agent})
    timer = threading.Timer(0.3, first.refund)
    timer.start()
    t = time.monotonic()
    r = acme.reserve_or_wait("acme", {}, scopes={"agent": agent}, timeout_s=10)
    timer.join()
    # Admitted on the refund, not after the hold's 60 s retry_after.
    assert time.monotonic() - t < 3
    r.settle({})


async def test_async_reserve_or_wait(admin: Client, aacme: AsyncClient) -> None:
    agent = bucket(admin, 1, 400)
    await (await aacme.reserve("acme", {}, scopes={"agent": agent})).settle({})
    t = time.monotonic()
    async with aacme.reserve_or_wait(
        "acme", {}, scopes={"agent": agent}, max_queue_ms=0, timeout_s=5
    ) as r:
        await r.settle({})
    assert 0.1 <= time.monotonic() - t < 3
    # Many waiters at once: each is admitted as the bucket refills (each
    # settles at once, or its held request would block the others).
    agent = bucket(admin, 1, 200)

    async def one() -> str:
        async with aacme.reserve_or_wait("acme", {}, scopes={"agent": agent}, timeout_s=10) as r:
            await r.settle({})
            return r.id

    t = time.monotonic()
    ids = await asyncio.gather(*[one() for _ in range(4)])
    assert len(set(ids)) == 4
    assert 0.5 <= time.monotonic() - t < 5, "three refills of 200 ms"


def test_wait_policy_caps_and_jitters() -> None:
    def denial(retry_after_ms: int) -> RateLimited:
        return RateLimited(
            429, {"type": "rate_limited", "retry_after_ms": retry_after_ms}, {"retry-after": "1"}
        )

    p = WaitPolicy(
        timeout_s=100,
        max_backoff_s=2.0,
        jitter=0.5,
        max_queue_ms=0,
        idempotent=False,
        rng=random.Random(7),
    )
    delays = [p.delay_s(denial(1000)) for _ in range(200)]
    assert all(d is not None and 1.0 <= d <= 1.5 for d in delays), "never before retry_after"
    assert len({round(d or 0, 6) for d in delays}) > 100, (
        "spread, so waiters do not return together"
    )
    longer = [p.delay_s(denial(5_000)) for _ in range(200)]
    assert all(d is not None and 5.0 <= d <= 7.0 for d in longer), (
        "a retry_after over max_backoff_s is never shortened; the cap bounds the jitter"
    )
    assert p.delay_s(denial(3_600_000)) is None, (
        "a retry_after past the time left gives up at once: no retry would pass"
    )
    with pytest.raises(ValueError, match="jitter"):
        WaitPolicy(timeout_s=1, max_backoff_s=1, jitter=2, max_queue_ms=0, idempotent=False)
