"""Review: the reservation guard (sync and async) in the ways a block really
ends — a settle that fails, warnings turned into errors, a generator closed
early, Ctrl-C, cancellation, nesting, reuse after the block — and the
streaming helper at its edges (a cut stream, a stream that fits its hold
exactly, a source that breaks)."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator

import pytest
from client_harness import unique

from allowance import (
    AsyncClient,
    AsyncReservation,
    Client,
    Conflict,
    InvalidRequest,
    Reservation,
    UnsettledReservationWarning,
)

AMOUNTS = {"input_tokens": 3000, "output_tokens": 500}


class Boom(Exception):
    """The model call failed."""


def use(client: Client, scope: str, dimension: str = "tokens") -> tuple[int, int]:
    lim = client.status(scope).limit(dimension)
    return lim.used, lim.held


def output_cap(admin: Client, capacity: int) -> tuple[str, str]:
    """A fresh task scope with a total ``output_tokens`` budget."""
    task = unique("t")
    scope = f"tenant:acme/task:{task}"
    admin.set_scope(
        scope, limits=[{"dimension": "output_tokens", "capacity": capacity, "window": "total"}]
    )
    return task, scope


# A settle that fails inside the block -------------------------------------------


def test_a_settle_refused_as_invalid_is_not_turned_into_a_refund(acme: Client) -> None:
    # The call ran; the usage handed to settle was bad (a bug in the
    # caller's accounting). The 400 leaves the block and the guard refunds:
    # the call that ran costs nothing.
    user = unique("u")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsettledReservationWarning)
        with (
            pytest.raises(InvalidRequest),
            acme.reserve("acme", AMOUNTS, scopes={"user": user}) as r,
        ):
            r.settle({"input_tokens": 3000, "output_tokens": -1})
    assert acme.get(r.id).status == "settled", "a call that ran was made free"
    assert use(acme, f"tenant:acme/user:{user}")[0] >= 3000


async def test_async_a_settle_refused_as_invalid_is_not_turned_into_a_refund(
    aacme: AsyncClient, acme: Client
) -> None:
    user = unique("u")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsettledReservationWarning)
        with pytest.raises(InvalidRequest):
            async with aacme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
                await r.settle({"input_tokens": 3000, "output_tokens": -1})
    assert acme.get(r.id).status == "settled", "a call that ran was made free"


# Warnings as errors (`python -W error`, pytest's filterwarnings) ------------------


def test_a_forgotten_settle_is_settled_even_when_warnings_are_errors(acme: Client) -> None:
    # The warning is emitted before the settle: when warnings are errors the
    # settle never runs, the hold expires, and the call is free.
    user = unique("u")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsettledReservationWarning)
        with (
            pytest.raises(UnsettledReservationWarning),
            acme.reserve("acme", AMOUNTS, scopes={"user": user}) as r,
        ):
            pass
    assert acme.get(r.id).status == "settled", "a forgotten settle made the call free"
    assert use(acme, f"tenant:acme/user:{user}") == (3500, 0)


async def test_async_a_forgotten_settle_is_settled_even_when_warnings_are_errors(
    aacme: AsyncClient, acme: Client
) -> None:
    user = unique("u")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsettledReservationWarning)
        with pytest.raises(UnsettledReservationWarning):
            async with aacme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
                pass
    assert (await aacme.get(r.id)).status == "settled", "a forgotten settle made the call free"


# A generator closed early ---------------------------------------------------------


def test_a_generator_closed_after_the_call_does_not_make_it_free(acme: Client) -> None:
    # A generator yields the answer of a call it made inside the guard; the
    # consumer takes it and stops (break, close, garbage collection). That
    # is GeneratorExit at the yield: the caller stopped reading, the call
    # did not fail — yet the guard refunds it.
    user = unique("u")

    def answers() -> Generator[str, None, None]:
        with acme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
            ids.append(r.id)
            yield "the model's answer"
            r.settle({"input_tokens": 3000, "output_tokens": 42})

    ids: list[str] = []
    gen = answers()
    assert next(gen) == "the model's answer"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsettledReservationWarning)
        gen.close()
    assert acme.get(ids[0]).status == "settled", "an answer that was delivered cost nothing"


async def test_async_a_generator_closed_after_the_call_does_not_make_it_free(
    aacme: AsyncClient, acme: Client
) -> None:
    user = unique("u")
    ids: list[str] = []

    async def answers() -> AsyncGenerator[str, None]:
        async with aacme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
            ids.append(r.id)
            yield "the model's answer"
            await r.settle({"input_tokens": 3000, "output_tokens": 42})

    gen = answers()
    assert await gen.__anext__() == "the model's answer"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsettledReservationWarning)
        await gen.aclose()
    assert acme.get(ids[0]).status == "settled", "an answer that was delivered cost nothing"


# Ctrl-C and cancellation -------------------------------------------------------------


def test_keyboard_interrupt_refunds_and_propagates(acme: Client) -> None:
    user = unique("u")
    with (
        pytest.raises(KeyboardInterrupt),
        acme.reserve("acme", AMOUNTS, scopes={"user": user}) as r,
    ):
        raise KeyboardInterrupt
    assert r.status == "refunded"
    assert use(acme, f"tenant:acme/user:{user}") == (0, 0)


async def test_async_cancel_mid_stream_settles_what_arrived(
    aacme: AsyncClient, acme: Client
) -> None:
    # Cancelled after 7 tokens streamed: the provider counted them, so the
    # guard settles them (never free) and leaks no hold.
    user = unique("u")
    streamed = asyncio.Event()
    ids: list[str] = []

    async def call() -> None:
        async with aacme.reserve(
            "acme", {"input_tokens": 100, "output_tokens": 5}, scopes={"user": user}
        ) as r:
            ids.append(r.id)
            meter = r.meter(tranche_tokens=5)
            for _ in range(7):
                await meter.add(1)
            streamed.set()
            await asyncio.sleep(30)

    task = asyncio.create_task(call())
    await streamed.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    info = acme.get(ids[0])
    assert info.status == "settled" and info.charged is not None
    assert (info.charged["input_tokens"], info.charged["output_tokens"]) == (100, 7)
    assert use(acme, f"tenant:acme/user:{user}") == (107, 0)


# Settle twice, refund after settle, nesting, reuse after the block -----------------


def test_settle_twice_then_refund_inside_the_block(acme: Client) -> None:
    user = unique("u")
    with pytest.raises(Conflict), acme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
        first = r.settle({"input_tokens": 3000, "output_tokens": 100})
        again = r.settle({"input_tokens": 3000, "output_tokens": 400})
        assert again.charged == first.charged, "a repeat answers the first settle"
        r.refund()
    assert r.status == "settled"
    assert use(acme, f"tenant:acme/user:{user}") == (3100, 0), "charged once, never refunded"


def test_nested_reservations_end_independently(acme: Client) -> None:
    outer_user, inner_user = unique("u"), unique("u")
    with (
        pytest.raises(Boom),
        acme.reserve("acme", AMOUNTS, scopes={"user": outer_user}) as outer,
        acme.reserve("acme", AMOUNTS, scopes={"user": inner_user}) as inner,
    ):
        raise Boom
    assert (outer.status, inner.status) == ("refunded", "refunded")

    with pytest.raises(Boom), acme.reserve("acme", AMOUNTS, scopes={"user": outer_user}) as outer:
        with acme.reserve("acme", AMOUNTS, scopes={"user": inner_user}) as inner:
            inner.settle({"input_tokens": 10, "output_tokens": 5})
        raise Boom
    assert (acme.get(outer.id).status, acme.get(inner.id).status) == ("refunded", "settled")
    assert use(acme, f"tenant:acme/user:{inner_user}") == (15, 0)
    assert use(acme, f"tenant:acme/user:{outer_user}") == (0, 0)


def test_the_reservation_after_its_block(acme: Client) -> None:
    user = unique("u")
    with pytest.raises(Boom), acme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
        raise Boom
    with pytest.raises(Conflict):
        r.settle(AMOUNTS)
    assert r.status == "refunded"
    # Entering an ended reservation again is harmless: nothing to do.
    with r:
        pass
    assert use(acme, f"tenant:acme/user:{user}") == (0, 0)


async def test_awaiting_a_pending_reservation_twice_holds_once(
    aacme: AsyncClient, acme: Client
) -> None:
    # `await` of a coroutine twice is an error; a PendingReservation instead
    # reserves again, silently: the first hold is orphaned until its TTL.
    user = unique("u")
    pending = aacme.reserve("acme", AMOUNTS, scopes={"user": user})
    first = await pending
    try:
        second = await pending
    except RuntimeError:
        second = first
    held = acme.status(f"tenant:acme/user:{user}").held_reservations
    for r in {first.id: first, second.id: second}.values():
        await r.refund()
    assert (held, second.id) == (1, first.id), "one reserve call, two holds"


# The streaming helper -------------------------------------------------------------


def chunks_of(n: int) -> Iterator[str]:
    for i in range(n):
        yield f"c{i}"


def test_a_cut_stream_left_without_settle_charges_what_arrived(admin: Client, acme: Client) -> None:
    # Chunks of 8 tokens, a hold of 10, tranches of 10 and 25 output tokens
    # of budget: holds 10 → 20, the top-up to 30 is refused at 24 tokens
    # read and the stream is cut there. The block then ends without a
    # settle: "settle at the estimate" records the hold (20), not the 24
    # tokens that arrived from the provider.
    task, _ = output_cap(admin, 25)
    pulled: list[str] = []

    def source() -> Iterator[str]:
        for c in chunks_of(10):
            pulled.append(c)
            yield c

    def stream_and_leave() -> Reservation:
        with acme.reserve("acme", {"output_tokens": 10}, scopes={"task": task}) as r:
            for _ in r.stream(source(), count=lambda _: 8, tranche_tokens=10):
                pass
            return r

    with pytest.warns(UnsettledReservationWarning):
        r = stream_and_leave()
    assert r.cut is not None and len(pulled) == 3
    info = acme.get(r.id)
    assert info.status == "settled" and info.charged is not None
    assert info.charged["output_tokens"] >= 8 * len(pulled), "tokens that arrived went free"


def test_a_stream_that_fits_its_hold_exactly_is_not_cut(admin: Client, acme: Client) -> None:
    # Ten tokens into a hold of ten, with no room for more: the answer fit.
    # The meter asks for a top-up when the tokens seen *reach* the hold; it
    # is refused and the stream reports a cut (and `meter.add` raises) for
    # an answer that was within its hold.
    task, scope = output_cap(admin, 10)
    with acme.reserve("acme", {"output_tokens": 10}, scopes={"task": task}) as r:
        seen = list(r.stream(chunks_of(10), count=lambda _: 1, tranche_tokens=10))
        assert len(seen) == 10
        cut = r.cut
        r.settle({"output_tokens": 10})
    assert cut is None, f"an answer that fit its hold was reported cut: {cut}"
    assert use(acme, scope, "output_tokens") == (10, 0)


def test_a_source_that_breaks_mid_stream_settles_what_arrived(acme: Client) -> None:
    user = unique("u")

    def broken() -> Iterator[str]:
        yield from chunks_of(13)
        raise Boom

    with (
        pytest.raises(Boom),
        acme.reserve("acme", {"input_tokens": 100, "output_tokens": 5}, scopes={"user": user}) as r,
    ):
        for _ in r.stream(broken(), count=lambda _: 1, tranche_tokens=5):
            pass
    info = acme.get(r.id)
    assert info.status == "settled" and info.charged is not None
    assert (info.charged["input_tokens"], info.charged["output_tokens"]) == (100, 13)
    assert use(acme, f"tenant:acme/user:{user}") == (113, 0)


async def test_async_a_source_that_breaks_mid_stream_settles_what_arrived(
    aacme: AsyncClient, acme: Client
) -> None:
    user = unique("u")

    async def broken() -> AsyncIterator[str]:
        for c in chunks_of(13):
            await asyncio.sleep(0)
            yield c
        raise Boom

    with pytest.raises(Boom):
        async with aacme.reserve(
            "acme", {"input_tokens": 100, "output_tokens": 5}, scopes={"user": user}
        ) as r:
            async for _ in r.stream(broken(), count=lambda _: 1, tranche_tokens=5):
                pass
    info = acme.get(r.id)
    assert info.status == "settled" and info.charged is not None
    assert info.charged["output_tokens"] == 13
    assert use(acme, f"tenant:acme/user:{user}") == (113, 0)


async def test_async_a_cut_stream_left_without_settle_charges_what_arrived(
    admin: Client, aacme: AsyncClient, acme: Client
) -> None:
    task, _ = output_cap(admin, 25)
    pulled: list[str] = []

    async def source() -> AsyncIterator[str]:
        for c in chunks_of(10):
            pulled.append(c)
            yield c

    async def stream_and_leave() -> AsyncReservation:
        async with aacme.reserve("acme", {"output_tokens": 10}, scopes={"task": task}) as r:
            async for _ in r.stream(source(), count=lambda _: 8, tranche_tokens=10):
                pass
            return r

    with pytest.warns(UnsettledReservationWarning):
        r = await stream_and_leave()
    assert r.cut is not None and len(pulled) == 3
    info = acme.get(r.id)
    assert info.charged is not None
    assert info.charged["output_tokens"] >= 8 * len(pulled), "tokens that arrived went free"
