"""Decisions shared by the sync and async reservation guards and retry loops.

Only the I/O differs between :mod:`allowance.client` and
:mod:`allowance.aio`; what to do at the end of a ``with`` block, when to top
up a streaming hold, and how long to wait before retrying a reserve are
decided here once.
"""

from __future__ import annotations

import random
import re
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .errors import (
    AllowanceError,
    Conflict,
    ConnectionFailed,
    Denied,
    HeldElsewhere,
    InvalidRequest,
    NotFound,
    RateLimited,
    StoreUnavailable,
)
from .types import Charge, ReservationInfo

DEFAULT_TRANCHE_TOKENS = 1024
"""Output tokens a streaming hold grows by when the tokens seen reach it
(the gateway's ``stream_tranche_tokens`` default)."""

DEFAULT_MAX_QUEUE_MS = 30_000
"""Longest one attempt of ``reserve_or_wait`` waits in the server's queue;
must not exceed the server's ``queue.max_wait_ms`` (60 000 by default)."""

_MIN_RETRY_S = 0.01
"""Floor of a retry delay, so a zero ``retry_after`` cannot spin."""

_TRANSIENT_BASE_S = 0.1
"""First delay after a 503 or a broken connection; doubles per attempt."""


class UnsettledReservationWarning(UserWarning):
    """A reservation left its ``with`` block without a settle or refund.

    It was settled anyway (at the estimate, or at what a stream meter saw):
    a forgotten settle must never make a call free. Settle with the real
    usage to silence it. The settle happens first, so turning warnings into
    errors (``python -W error``) still charges the call.
    """


class SettleFailedWarning(UserWarning):
    """A call ran (and was paid for) but its settle could not reach the
    server, even after retries: the reply is returned all the same, and the
    hold stays until its TTL, which frees the room but records nothing, so
    the call goes uncharged. The message names the reservation and the
    usage to record (an admin ``adjust`` can debit it)."""


@dataclass
class SettleAttempt:
    """A settle sent from inside the block, kept until the server confirms
    it: if it fails, leaving the block sends it again rather than refund a
    call that ran."""

    usage: dict[str, int]
    charges: list[Charge] | None
    error: BaseException | None = None
    """What the attempt raised (``None`` while in flight)."""


@dataclass(frozen=True)
class ExitPlan:
    """What leaving the ``with`` block does."""

    action: Literal["none", "refund", "settle"]
    usage: dict[str, int] | None = None
    charges: list[Charge] | None = None
    why: str = ""
    """Names the cleanup in a note on the caller's exception if it fails."""
    warning: str | None = None
    """Emitted (:class:`UnsettledReservationWarning`) after the cleanup ran."""


_NOTHING = ExitPlan("none")


@dataclass
class GuardState:
    """What a reservation guard knows, whichever client drives it."""

    info: ReservationInfo
    owned: bool = True
    """False for a replay (same idempotency key) of a reservation that is
    another caller's: the guard never settles or refunds it."""
    observed_output_tokens: int = 0
    """Output tokens a streaming meter has seen arrive."""
    cut: Denied | None = None
    """The denial that stopped a metered stream, if one did."""
    settle_attempt: SettleAttempt | None = None
    """The last settle sent from the block and not yet confirmed."""

    @classmethod
    def of(cls, info: ReservationInfo, *, replay_is_ours: bool = False) -> GuardState:
        """The guard of a reserve's answer: a fresh reservation is the
        caller's; a replayed one only when ``replay_is_ours`` (an earlier
        attempt of the same call, with the same key, had an unknown
        outcome)."""
        return cls(info, owned=not info.replayed or replay_is_ours)

    def enter(self) -> None:
        """Entering the guard: a replay of a reservation another caller
        still holds raises :class:`~allowance.HeldElsewhere` before the
        block runs, so the duplicate call is not made."""
        if not self.owned and self.info.status == "held":
            raise HeldElsewhere(self.info)

    def begin_settle(
        self, usage: Mapping[str, int], charges: Sequence[Charge] | None
    ) -> SettleAttempt:
        """Records a settle about to be sent (copies, so a caller mutating
        its dict cannot change what a resend sends)."""
        attempt = SettleAttempt(dict(usage), list(charges) if charges is not None else None)
        self.settle_attempt = attempt
        return attempt

    def settled(self, info: ReservationInfo) -> None:
        """The server confirmed a settle."""
        self.info = info
        self.settle_attempt = None

    def exit_plan(self, exc: BaseException | None) -> ExitPlan:
        """What leaving the ``with`` block does.

        - already ended (settled, refunded, expired, or a replay of an
          ended reservation), or another caller's (a replay of a hold it
          did not make): nothing;
        - a settle from the block failed (an error, a lost answer, a
          cancellation mid-flight): the call ran, so never a refund. The
          same settle is sent again (settle is idempotent); if the server
          refused it as invalid, the estimate is settled instead, with a
          warning; if the reservation ended elsewhere (409/404), nothing;
        - a normal exit with no settle: settle at the estimate (output
          raised to what a meter saw, if more), then warn;
        - ``GeneratorExit`` (a generator holding the block was closed: the
          consumer stopped reading, the call did not fail): settle what a
          meter saw, else the estimate, then warn;
        - any other exception, nothing streamed: refund (the call failed);
        - any other exception after tokens streamed: settle what was seen,
          because the provider counted those tokens.
        """
        if self.info.status != "held" or not self.owned:
            return _NOTHING
        attempt = self.settle_attempt
        if attempt is not None:
            if isinstance(attempt.error, InvalidRequest):
                usage = self.unsettled_usage()
                return ExitPlan(
                    "settle",
                    usage,
                    why="settle at the estimate",
                    warning=f"{self._name()} had its settle refused ({attempt.error}): "
                    f"settled at the estimate {usage}",
                )
            if isinstance(attempt.error, (Conflict, NotFound)):
                return _NOTHING  # it ended elsewhere: nothing left to charge here
            return ExitPlan("settle", attempt.usage, attempt.charges, why="resending the settle")
        if exc is None:
            usage = self.unsettled_usage()
            return ExitPlan(
                "settle",
                usage,
                why="settle at the estimate",
                warning=f"{self._name()} left its `with` block without settle() or "
                f"refund(): settled at the estimate {usage}",
            )
        if isinstance(exc, GeneratorExit):
            if self.observed_output_tokens > 0:
                usage, what = self.observed_usage(), "what the meter saw"
            else:
                usage, what = self.unsettled_usage(), "the estimate"
            return ExitPlan(
                "settle",
                usage,
                why="settle",
                warning=f"{self._name()} was closed (GeneratorExit) without settle() or "
                f"refund(): settled at {what} {usage}",
            )
        if self.observed_output_tokens > 0:
            return ExitPlan("settle", self.observed_usage(), why="settle of what arrived")
        return ExitPlan("refund", why="refund")

    def _name(self) -> str:
        return f"reservation {self.info.id}"

    def observed_usage(self) -> dict[str, int]:
        """Usage as seen by the meter: the prompt as estimated (it was sent)
        and the output tokens that arrived."""
        return {
            "input_tokens": self.info.held.get("input_tokens", 0),
            "output_tokens": self.observed_output_tokens,
        }

    def unsettled_usage(self) -> dict[str, int]:
        """What "settle at the estimate" records: the held amounts, with the output
        raised to what a meter saw when more arrived than was held (a cut
        stream ends past its hold), so tokens that arrived are never free."""
        usage = self.info.usage_estimate()
        extra = self.observed_output_tokens - usage.get("output_tokens", 0)
        if extra > 0:
            usage["output_tokens"] = self.observed_output_tokens
            if "tokens" in usage:
                usage["tokens"] += extra
            if self.info.model is not None:
                # Priced from the token amounts again by the server.
                usage.pop("cost_micros", None)
        return usage

    def warn(self, message: str, stacklevel: int, in_flight: BaseException | None) -> None:
        """Warns that the block ended without a settle; ``stacklevel``
        points the warning at the caller's ``with``. When warnings are
        errors and an exception is already propagating, the warning becomes
        a note on it rather than hide it."""
        try:
            warnings.warn(message, UnsettledReservationWarning, stacklevel=stacklevel)
        except UnsettledReservationWarning as w:
            if in_flight is None:
                raise
            if hasattr(in_flight, "add_note"):
                in_flight.add_note(f"allowance: {w}")


def caller_exception(exc: BaseException | None) -> BaseException | None:
    """The caller's exception a warning must not hide. ``GeneratorExit``
    is not one: a generator closed early is a normal end for the caller,
    so with warnings as errors its warning is raised (from ``close()``)."""
    return None if isinstance(exc, GeneratorExit) else exc


def add_note(exc: BaseException, action: str, error: BaseException) -> None:
    """Notes on the caller's exception that cleaning up failed too (the TTL
    will release the hold, recording nothing)."""
    note = (
        f"allowance: {action} after this exception failed: {error!r}; "
        "the hold expires by TTL, recording nothing"
    )
    if hasattr(exc, "add_note"):
        exc.add_note(note)


@dataclass
class MeterCore:
    """Counts streamed output tokens and says when to top up the hold.

    The hold is topped up ahead of the stream: when the tokens seen reach
    it, by whole tranches, never past ``bound_output_tokens`` (the call's
    own bound: a provider stops there, so holding more only blocks others).
    A refused top-up is a cut only once the tokens seen exceed the hold;
    an answer that fits its hold exactly is not cut.
    """

    held_output_tokens: int
    tranche_tokens: int
    ttl_ms: int | None
    bound_output_tokens: int | None = None
    seen_output_tokens: int = 0

    def __post_init__(self) -> None:
        if self.tranche_tokens < 1:
            raise ValueError(f"tranche_tokens: must be ≥ 1, got {self.tranche_tokens}")
        if self.bound_output_tokens is not None and self.bound_output_tokens < 0:
            raise ValueError(f"max_output_tokens: must be ≥ 0, got {self.bound_output_tokens}")

    def top_up(self, tokens: int) -> int:
        """Records ``tokens`` more output; the amount to add to the hold
        (0 when the hold still covers what was seen, or is at the bound)."""
        if tokens < 0:
            raise ValueError(f"tokens: must be ≥ 0, got {tokens}")
        self.seen_output_tokens += tokens
        if self.seen_output_tokens < self.held_output_tokens:
            return 0
        # Whole tranches, enough to cover what was seen plus one more token:
        # the hold stays ahead of the stream.
        missing = self.seen_output_tokens - self.held_output_tokens + 1
        tranches = -(-missing // self.tranche_tokens)
        extra = tranches * self.tranche_tokens
        if self.bound_output_tokens is not None:
            extra = min(extra, max(0, self.bound_output_tokens - self.held_output_tokens))
        return extra

    def over_hold(self) -> bool:
        """True when more output arrived than is held: a refused top-up
        then cuts the stream."""
        return self.seen_output_tokens > self.held_output_tokens

    def extended(self, info: ReservationInfo) -> None:
        """Takes the hold the server answered after a top-up."""
        self.held_output_tokens = info.held.get("output_tokens", 0)


@dataclass
class WaitPolicy:
    """How ``reserve_or_wait`` spaces its attempts.

    A ``rate_limited`` answer is retried after its ``retry_after`` plus up to
    ``jitter`` of it again (that extra capped at ``max_backoff_s``), so
    callers denied together do not return together; never before the
    server said: a retry sooner than told only adds load (a holds-based
    ``retry_after`` is an upper bound, and the server's queue, ``wait_ms``,
    is what admits a caller the moment room frees). When ``retry_after``
    is longer than the time left, the denial is raised at once. A 503 or a
    broken connection is retried with exponential backoff (capped at
    ``max_backoff_s``), but only with an ``idempotency_key`` (without one a
    retry could hold twice). Budget and size denials are final. Nothing is
    retried past ``timeout_s``.
    """

    timeout_s: float
    max_backoff_s: float
    jitter: float
    max_queue_ms: int
    idempotent: bool
    rng: random.Random = field(default_factory=random.Random)
    deadline: float = 0.0
    attempts: int = 0

    def __post_init__(self) -> None:
        if self.timeout_s < 0:
            raise ValueError(f"timeout_s: must be ≥ 0, got {self.timeout_s}")
        if self.max_backoff_s <= 0:
            raise ValueError(f"max_backoff_s: must be > 0, got {self.max_backoff_s}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter: must be within [0, 1], got {self.jitter}")
        if self.max_queue_ms < 0:
            raise ValueError(f"max_queue_ms: must be ≥ 0, got {self.max_queue_ms}")
        self.deadline = time.monotonic() + self.timeout_s

    def remaining_s(self) -> float:
        """Time left before the deadline."""
        return max(0.0, self.deadline - time.monotonic())

    def wait_ms(self) -> int:
        """``wait_ms`` for the next attempt: queue in the server while time is left."""
        self.attempts += 1
        return min(self.max_queue_ms, int(self.remaining_s() * 1000))

    def adapt(self, error: AllowanceError) -> bool:
        """True when ``error`` refused only this ``wait_ms`` (over the
        server's ``queue.max_wait_ms``): the bound is lowered to the one the
        server named (or the server's queue is no longer used) and the
        attempt is repeated at once."""
        if not (isinstance(error, InvalidRequest) and error.field == "wait_ms"):
            return False
        if self.max_queue_ms == 0:
            return False
        bound = re.search(r"at most (\d+) ms", error.message)
        lowered = int(bound.group(1)) if bound else 0
        self.max_queue_ms = lowered if lowered < self.max_queue_ms else 0
        return True

    def delay_s(self, error: AllowanceError) -> float | None:
        """Seconds to sleep before the next attempt, or ``None`` to give up
        and raise ``error``."""
        left = self.remaining_s()
        if left <= 0:
            return None
        if isinstance(error, RateLimited):
            told = error.retry_after if error.retry_after is not None else 0.0
            base = max(_MIN_RETRY_S, told)
            if base > left:
                return None  # no retry the server would admit fits in the time left
            extra = min(base * self.rng.uniform(0.0, self.jitter), self.max_backoff_s)
            return min(left, base + extra)
        if isinstance(error, (StoreUnavailable, ConnectionFailed)) and self.idempotent:
            backoff: float = _TRANSIENT_BASE_S * 2 ** min(self.attempts - 1, 10)
            backoff = max(_MIN_RETRY_S, min(backoff, self.max_backoff_s))
            return min(left, backoff * (1.0 + self.rng.uniform(0.0, self.jitter)))
        return None
