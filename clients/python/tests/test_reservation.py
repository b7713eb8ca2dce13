"""The reservation as a context manager (sync and async): an exception
refunds, a forgotten settle charges the estimate and warns, a stream tops
up its hold as tokens arrive and is cut cleanly when a top-up is refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from client_harness import unique

from allowance import (
    AsyncClient,
    Client,
    ExceedsLimit,
    UnsettledReservationWarning,
)

AMOUNTS = {"input_tokens": 3000, "output_tokens": 500}


class Boom(Exception):
    """The model call failed."""


def scope_use(client: Client, scope: str) -> tuple[int, int]:
    lim = client.status(scope).limit("tokens")
    return lim.used, lim.held


def test_exception_refunds_then_reraises(acme: Client) -> None:
    user = unique("u")
    scope = f"tenant:acme/user:{user}"
    with pytest.raises(Boom), acme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
        assert scope_use(acme, scope) == (0, 3500)
        raise Boom
    assert r.status == "refunded"
    assert acme.get(r.id).status == "refunded"
    assert scope_use(acme, scope) == (0, 0), "a failed call costs nothing"


def test_forgotten_settle_charges_the_estimate_and_warns(acme: Client) -> None:
    user = unique("u")
    with (
        pytest.warns(UnsettledReservationWarning, match="settled at the estimate") as warned,
        acme.reserve("acme", AMOUNTS, scopes={"user": user}, model="gpt-4o") as r,
    ):
        pass
    assert warned[0].filename == __file__, "the warning points at the caller's `with`"
    info = acme.get(r.id)
    assert info.status == "settled"
    assert info.charged is not None
    assert info.charged["tokens"] == 3500 and info.charged["cost_micros"] == 12_500
    assert scope_use(acme, f"tenant:acme/user:{user}") == (3500, 0), "never free"


def test_settled_block_neither_warns_nor_settles_twice(acme: Client) -> None:
    user = unique("u")
    with acme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
        r.settle({"input_tokens": 3000, "output_tokens": 100})
    assert scope_use(acme, f"tenant:acme/user:{user}") == (3100, 0)
    with acme.reserve("acme", AMOUNTS, scopes={"user": user}) as r2:
        r2.refund()
    assert r2.status == "refunded"
    assert scope_use(acme, f"tenant:acme/user:{user}") == (3100, 0)


def test_exception_after_settle_keeps_the_settle(acme: Client) -> None:
    user = unique("u")
    with pytest.raises(Boom), acme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
        r.settle({"input_tokens": 3000, "output_tokens": 10})
        raise Boom
    assert acme.get(r.id).status == "settled"


async def test_async_exception_refunds_then_reraises(aacme: AsyncClient, acme: Client) -> None:
    user = unique("u")
    scope = f"tenant:acme/user:{user}"
    with pytest.raises(Boom):
        async with aacme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
            assert (await aacme.status(scope)).limit("tokens").held == 3500
            raise Boom
    assert r.status == "refunded"
    assert (await aacme.get(r.id)).status == "refunded"
    assert scope_use(acme, scope) == (0, 0)


async def test_async_awaited_reservation_is_a_guard_too(aacme: AsyncClient, acme: Client) -> None:
    user = unique("u")
    r = await aacme.reserve("acme", AMOUNTS, scopes={"user": user})
    with pytest.raises(Boom):
        async with r:
            raise Boom
    assert (await aacme.get(r.id)).status == "refunded"


async def test_async_cancellation_refunds(aacme: AsyncClient, acme: Client) -> None:
    user = unique("u")
    scope = f"tenant:acme/user:{user}"
    started = asyncio.Event()

    async def call() -> None:
        async with aacme.reserve("acme", AMOUNTS, scopes={"user": user}):
            started.set()
            await asyncio.sleep(30)

    task = asyncio.create_task(call())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert scope_use(acme, scope) == (0, 0)


async def test_async_forgotten_settle_charges_the_estimate(
    aacme: AsyncClient, acme: Client
) -> None:
    user = unique("u")
    with pytest.warns(UnsettledReservationWarning) as warned:
        async with aacme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
            pass
    assert warned[0].filename == __file__
    assert (await aacme.get(r.id)).status == "settled"
    assert scope_use(acme, f"tenant:acme/user:{user}") == (3500, 0)
    with pytest.warns(UnsettledReservationWarning) as warned:
        async with await aacme.reserve("acme", AMOUNTS, scopes={"user": user}):
            pass
    assert warned[0].filename == __file__
    assert scope_use(acme, f"tenant:acme/user:{user}") == (7000, 0)


async def test_async_settle_refund_extend(aacme: AsyncClient) -> None:
    async with aacme.reserve("acme", AMOUNTS, ttl_ms=10_000) as r:
        info = await r.extend({"output_tokens": 100}, ttl_ms=20_000)
        assert info.held["output_tokens"] == 600
        assert (await r.refresh()).held["output_tokens"] == 600
        settled = await r.settle({"input_tokens": 3000, "output_tokens": 550})
        assert settled.charged is not None and settled.charged["tokens"] == 3550
    r2 = await aacme.reserve("acme", AMOUNTS)
    assert (await r2.refund()).status == "refunded"


# Streaming --------------------------------------------------------------


def words(n: int) -> Iterator[str]:
    """A streamed answer: one token per chunk."""
    for i in range(n):
        yield f"w{i} "


def test_stream_tops_up_the_hold_as_tokens_arrive(acme: Client) -> None:
    user = unique("u")
    scope = f"tenant:acme/user:{user}"
    with acme.reserve(
        "acme", {"input_tokens": 100, "output_tokens": 10}, scopes={"user": user}
    ) as r:
        seen = list(r.stream(words(35), count=lambda _: 1, tranche_tokens=10, ttl_ms=30_000))
        assert len(seen) == 35 and r.cut is None
        # 35 tokens seen with tranches of 10: the hold stayed ahead of them.
        assert r.held["output_tokens"] == 40
        assert scope_use(acme, scope) == (0, 140)
        r.settle({"input_tokens": 100, "output_tokens": 35})
    assert scope_use(acme, scope) == (135, 0)


def test_stream_is_cut_cleanly_when_a_top_up_is_refused(admin: Client, acme: Client) -> None:
    task = unique("t")
    scope = f"tenant:acme/task:{task}"
    admin.set_scope(
        scope, limits=[{"dimension": "output_tokens", "capacity": 25, "window": "total"}]
    )
    with acme.reserve("acme", {"output_tokens": 10}, scopes={"task": task}) as r:
        seen = list(r.stream(words(100), count=lambda _: 1, tranche_tokens=10))
        # With its own 20 the hold would be 30 of 25: it never can be, so
        # the ledger says exceeds_limit (not a retry at its own expiry).
        assert isinstance(r.cut, ExceedsLimit)
        assert r.cut.scope == scope and r.cut.dimension == "output_tokens"
        assert r.cut.requested == 30
        # Holds of 10, then 20; the top-up to 30 is refused at the 20th
        # token, which the hold still covers (no cut yet), and again at the
        # 21st, which exceeds it: the cut. The 21st chunk is yielded (its
        # token arrived), then the stream stops.
        assert len(seen) == 21
        assert r.held["output_tokens"] == 20
        r.settle({"output_tokens": len(seen)})
    lim = acme.status(scope).limit("output_tokens")
    assert (lim.used, lim.held) == (21, 0)


def test_exception_mid_stream_settles_what_arrived(acme: Client) -> None:
    user = unique("u")
    with pytest.raises(Boom), acme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
        meter = r.meter(tranche_tokens=100)
        for _ in range(42):
            meter.add(1)
        assert meter.output_tokens == 42
        raise Boom
    info = acme.get(r.id)
    assert info.status == "settled", "tokens that arrived were consumed: never free"
    assert info.charged is not None and info.charged["output_tokens"] == 42
    assert info.charged["input_tokens"] == 3000


async def test_async_stream_tops_up_and_settles(aacme: AsyncClient, acme: Client) -> None:
    user = unique("u")

    async def chunks() -> AsyncIterator[str]:
        for w in words(25):
            await asyncio.sleep(0)
            yield w

    async with aacme.reserve(
        "acme", {"input_tokens": 50, "output_tokens": 5}, scopes={"user": user}
    ) as r:
        seen = [c async for c in r.stream(chunks(), count=lambda _: 1, tranche_tokens=5)]
        assert len(seen) == 25 and r.held["output_tokens"] == 30
        meter = r.meter()
        await meter.add(0)
        await r.settle({"input_tokens": 50, "output_tokens": len(seen)})
    assert scope_use(acme, f"tenant:acme/user:{user}") == (75, 0)


async def test_async_exception_mid_stream_settles_what_arrived(aacme: AsyncClient) -> None:
    with pytest.raises(Boom):
        async with aacme.reserve("acme", {"input_tokens": 10, "output_tokens": 5}) as r:
            meter = r.meter(tranche_tokens=5)
            for _ in range(12):
                await meter.add(1)
            assert meter.usage() == {"input_tokens": 10, "output_tokens": 12}
            raise Boom
    info = await aacme.get(r.id)
    assert info.status == "settled" and info.charged is not None
    assert info.charged["output_tokens"] == 12


def test_meter_refuses_nonsense(acme: Client) -> None:
    with acme.reserve("acme", {"output_tokens": 5}) as r:
        with pytest.raises(ValueError, match="tranche_tokens"):
            r.meter(tranche_tokens=0)
        with pytest.raises(ValueError, match="tokens"):
            r.meter().add(-1)
        r.refund()
