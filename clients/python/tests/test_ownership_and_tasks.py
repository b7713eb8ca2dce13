"""A guard acts only on the hold it owns (a replay of another worker's
live reservation is not its own); `aclose` right after a cancelled reserve
leaks nothing; a pending reserve is a coroutine a task can run."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest
from client_harness import Server, unique

from allowance import (
    AllowanceError,
    AsyncClient,
    AsyncReservation,
    Client,
    HeldElsewhere,
    idempotency_key,
)

AMOUNTS = {"input_tokens": 1000, "output_tokens": 500}
USAGE = {"input_tokens": 1000, "output_tokens": 480}


class Boom(Exception):
    """The model call failed."""


def fresh_key() -> str:
    return idempotency_key(unique("run"), "t1", "openai", {"doc": "report.pdf"})


# A replay of another worker's live hold (finding 2) -------------------------------


def test_a_guard_never_ends_another_workers_hold(acme: Client) -> None:
    # Worker A reserved with key K and is calling the model. Worker B (a
    # redelivered task) reserves with K: the replay answers A's hold. B's
    # guard must not run the duplicate call, and must not refund A's hold
    # (A's settle would then be a 409, and A's call free).
    user = unique("u")
    key = fresh_key()
    a = acme.reserve("acme", AMOUNTS, scopes={"user": user}, idempotency_key=key)
    b = acme.reserve("acme", AMOUNTS, scopes={"user": user}, idempotency_key=key)
    assert (b.replayed, b.status, b.id, b.owned) == (True, "held", a.id, False)
    assert a.owned
    ran = False
    with pytest.raises(HeldElsewhere) as e, b:
        ran = True
        raise Boom
    assert not ran, "the duplicate call was made"
    assert e.value.info.id == a.id
    assert isinstance(e.value, AllowanceError)
    assert acme.get(a.id).status == "held", "B's guard ended A's hold"
    with a:
        a.settle(USAGE)
    info = acme.get(a.id)
    assert info.status == "settled"
    assert info.charged is not None and info.charged["output_tokens"] == 480


def test_a_guard_left_without_entering_does_not_end_another_workers_hold(
    acme: Client,
) -> None:
    # The exit path alone (as the openai wrapper uses it when the SDK call
    # raises) leaves a hold that is not the guard's alone.
    key = fresh_key()
    a = acme.reserve("acme", AMOUNTS, idempotency_key=key)
    b = acme.reserve("acme", AMOUNTS, idempotency_key=key)
    err = Boom()
    b.__exit__(Boom, err, None)
    assert acme.get(a.id).status == "held"
    a.refund()


def test_a_replay_of_an_ended_reservation_still_enters(acme: Client) -> None:
    key = fresh_key()
    with acme.reserve("acme", AMOUNTS, idempotency_key=key) as a:
        a.settle(USAGE)
    with acme.reserve("acme", AMOUNTS, idempotency_key=key) as again:
        assert (again.replayed, again.status) == (True, "settled")
    assert acme.get(a.id).status == "settled"


def test_held_elsewhere_pickles(acme: Client) -> None:
    key = fresh_key()
    a = acme.reserve("acme", AMOUNTS, idempotency_key=key)
    b = acme.reserve("acme", AMOUNTS, idempotency_key=key)
    with pytest.raises(HeldElsewhere) as e, b:
        pass
    copy = pickle.loads(pickle.dumps(e.value))
    assert isinstance(copy, HeldElsewhere)
    assert copy.info.id == a.id
    assert str(copy) == str(e.value)
    a.refund()


async def test_async_a_guard_never_ends_another_workers_hold(
    aacme: AsyncClient, acme: Client
) -> None:
    key = fresh_key()
    a = await aacme.reserve("acme", AMOUNTS, idempotency_key=key)
    ran = False
    with pytest.raises(HeldElsewhere):
        async with aacme.reserve("acme", AMOUNTS, idempotency_key=key):
            ran = True
            raise Boom
    b = await aacme.reserve("acme", AMOUNTS, idempotency_key=key)
    assert not b.owned
    with pytest.raises(HeldElsewhere):
        async with b:
            ran = True
    assert not ran, "the duplicate call was made"
    await b.__aexit__(Boom, Boom(), None)
    assert acme.get(a.id).status == "held", "a guard ended another worker's hold"
    async with a:
        await a.settle(USAGE)
    assert acme.get(a.id).status == "settled"


async def test_async_reserve_or_wait_does_not_own_another_workers_hold(
    aacme: AsyncClient, acme: Client
) -> None:
    # No attempt of this call had an unknown outcome: the replay is not its.
    key = fresh_key()
    a = acme.reserve("acme", AMOUNTS, idempotency_key=key)
    with pytest.raises(HeldElsewhere):
        async with aacme.reserve_or_wait("acme", AMOUNTS, idempotency_key=key, timeout_s=5):
            pass
    with (
        pytest.raises(HeldElsewhere),
        acme.reserve_or_wait("acme", AMOUNTS, idempotency_key=key, timeout_s=5),
    ):
        pass
    assert acme.get(a.id).status == "held"
    a.refund()


# aclose right after a cancelled reserve (finding 1) ------------------------------


async def test_aclose_right_after_a_cancelled_reserve_leaks_no_hold(
    server: Server, acme: Client
) -> None:
    # The audit's reproduction: cancel a reserve on the wire, close the
    # client at once. The request must run to its answer and what it held
    # be refunded before the pool closes — for every timing of the cancel.
    leaked: list[str] = []
    for trial, pause in enumerate([0, 0, 0.0002, 0.0005, 0.0005, 0.001, 0.002, 0.005] * 2):
        agent = unique(f"ac{trial}")
        c = AsyncClient(server.base_url, server.tokens.acme)
        await c.healthz()  # a warm connection, so the reserve goes out at once
        task = asyncio.ensure_future(c.reserve("acme", {"tokens": 1}, scopes={"agent": agent}))
        await asyncio.sleep(pause)
        task.cancel()
        try:
            r = await task
        except asyncio.CancelledError:
            await c.aclose()
        else:  # answered before the cancel landed: nothing abandoned
            await r.refund()
            await c.aclose()
        # No grace period: aclose has returned, the refund is done.
        if acme.status(f"tenant:acme/agent:{agent}").held_reservations:
            leaked.append(f"trial {trial} (pause {pause})")
    assert not leaked, f"holds leaked after aclose: {leaked}"


async def test_aclose_waits_for_a_queued_reserve_that_was_cancelled(
    server: Server, admin: Client, acme: Client
) -> None:
    # The reserve waits in the server's queue (wait_ms) when it is
    # cancelled; the client is closed; room frees, the server admits it.
    agent = unique("aq")
    scope = f"tenant:acme/agent:{agent}"
    admin.set_scope(scope, limits=[{"dimension": "concurrent", "capacity": 1}])
    blocker = acme.reserve("acme", {"tokens": 1}, scopes={"agent": agent})
    c = AsyncClient(server.base_url, server.tokens.acme)
    task = asyncio.ensure_future(
        c.reserve("acme", {"tokens": 1}, scopes={"agent": agent}, wait_ms=5000)
    )
    await asyncio.sleep(0.3)  # queued in the server
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    closing = asyncio.ensure_future(c.aclose())
    await asyncio.sleep(0.2)
    assert not closing.done(), "aclose closed the pool under a reserve still on the wire"
    await asyncio.to_thread(blocker.refund)
    await asyncio.wait_for(closing, 10)
    assert acme.status(scope).held_reservations == 0


# A pending reserve is a coroutine (finding 6) -------------------------------------


async def test_a_pending_reserve_runs_as_a_task(aacme: AsyncClient, acme: Client) -> None:
    user = unique("u")
    pending = aacme.reserve("acme", {"tokens": 5}, scopes={"user": user})
    assert asyncio.iscoroutine(pending)
    r = await asyncio.create_task(pending)
    assert isinstance(r, AsyncReservation)
    assert await pending is r, "awaiting again answers the same reservation"
    async with asyncio.TaskGroup() as tg:
        tasks = [
            tg.create_task(aacme.reserve("acme", {"tokens": 5}, scopes={"user": user}))
            for _ in range(3)
        ]
        waited = tg.create_task(
            aacme.reserve_or_wait("acme", {"tokens": 5}, scopes={"user": user}, timeout_s=5)
        )
    held = [t.result() for t in tasks] + [waited.result(), r]
    assert len({h.id for h in held}) == 5
    assert acme.status(f"tenant:acme/user:{user}").held_reservations == 5
    for h in held:
        await h.refund()


async def test_a_reserve_task_cancelled_on_the_wire_leaks_no_hold(
    server: Server, acme: Client
) -> None:
    for pause in (0, 0.0005, 0.001, 0.003):
        agent = unique("tk")
        c = AsyncClient(server.base_url, server.tokens.acme)
        await c.healthz()
        task: asyncio.Task[Any] = asyncio.create_task(
            c.reserve("acme", {"tokens": 1}, scopes={"agent": agent})
        )
        await asyncio.sleep(pause)
        task.cancel()
        try:
            r = await task
        except asyncio.CancelledError:
            pass
        else:
            await r.refund()
        await c.aclose()
        assert acme.status(f"tenant:acme/agent:{agent}").held_reservations == 0, pause
