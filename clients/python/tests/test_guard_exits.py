"""How the guard ends a block in the cases the review fixes left open: a
refused settle followed by an exception, warnings as errors while an
exception propagates, a generator closed early with warnings as errors, and
a meter held to the call's bound."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Generator

import pytest
from client_harness import unique

from allowance import Client, InvalidRequest, UnsettledReservationWarning
from allowance._shared import MeterCore

AMOUNTS = {"input_tokens": 3000, "output_tokens": 500}


class Boom(Exception):
    """The code after the model call failed."""


def used(client: Client, scope: str, dimension: str = "tokens") -> tuple[int, int]:
    lim = client.status(scope).limit(dimension)
    return lim.used, lim.held


def test_a_refused_settle_then_an_exception_settles_the_estimate(acme: Client) -> None:
    # The call ran, its settle was refused (bad accounting), then the code
    # after it failed: the estimate is charged, never a refund, and the
    # caller's exception is the one that propagates.
    user = unique("u")
    ids: list[str] = []

    def call() -> None:
        with acme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
            ids.append(r.id)
            with contextlib.suppress(InvalidRequest):
                r.settle({"input_tokens": 3000, "output_tokens": -1})
            raise Boom

    with pytest.warns(UnsettledReservationWarning, match="settle refused"), pytest.raises(Boom):
        call()
    info = acme.get(ids[0])
    assert info.status == "settled" and info.charged is not None
    assert info.charged["tokens"] == 3500
    assert used(acme, f"tenant:acme/user:{user}") == (3500, 0)


def test_warnings_as_errors_never_hide_the_callers_exception(acme: Client) -> None:
    user = unique("u")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsettledReservationWarning)
        with pytest.raises(Boom) as e, acme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
            with contextlib.suppress(InvalidRequest):
                r.settle({"input_tokens": 3000, "output_tokens": -1})
            raise Boom
    notes = getattr(e.value, "__notes__", [])
    assert any("settled at the estimate" in n for n in notes), notes
    assert acme.get(r.id).status == "settled"


def test_a_generator_closed_with_warnings_as_errors_is_settled_and_says_so(
    acme: Client,
) -> None:
    # A closed generator is a normal end for its caller: the warning is
    # raised from close(), after the settle.
    user = unique("u")
    ids: list[str] = []

    def answers() -> Generator[str, None, None]:
        with acme.reserve("acme", AMOUNTS, scopes={"user": user}) as r:
            ids.append(r.id)
            yield "the model's answer"

    gen = answers()
    next(gen)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsettledReservationWarning)
        with pytest.raises(UnsettledReservationWarning, match="GeneratorExit"):
            gen.close()
    assert acme.get(ids[0]).status == "settled"
    assert used(acme, f"tenant:acme/user:{user}") == (3500, 0)


def test_a_meter_never_holds_past_the_calls_bound(acme: Client) -> None:
    user = unique("u")
    with acme.reserve("acme", {"output_tokens": 10}, scopes={"user": user}) as r:
        meter = r.meter(tranche_tokens=10, max_output_tokens=12)
        for _ in range(15):  # an estimate of the chunks may run past the bound
            meter.add(1)
        assert r.held["output_tokens"] == 12, "10, then the 2 left to the bound"
        assert r.cut is None
        r.settle({"output_tokens": 12})
    assert used(acme, f"tenant:acme/user:{user}") == (12, 0)


def test_meter_core_tops_up_ahead_and_stops_at_the_bound() -> None:
    core = MeterCore(held_output_tokens=8, tranche_tokens=8, ttl_ms=None, bound_output_tokens=30)
    assert core.top_up(7) == 0
    assert core.top_up(1) == 8, "the hold is reached: one tranche ahead"
    assert not core.over_hold(), "a refusal here is no cut: the hold covers what arrived"
    core.held_output_tokens = 24
    assert core.top_up(16) == 6, "capped at the bound"
    core.held_output_tokens = 30
    assert core.top_up(7) == 0 and core.over_hold(), "past the bound: nothing to ask"
    with pytest.raises(ValueError, match="max_output_tokens"):
        MeterCore(held_output_tokens=1, tranche_tokens=1, ttl_ms=None, bound_output_tokens=-1)
