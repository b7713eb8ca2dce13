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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from .errors import (
    AllowanceError,
    ConnectionFailed,
    Denied,
    InvalidRequest,
    RateLimited,
    StoreUnavailable,
)
from .types import ReservationInfo

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

    It was settled at the estimate (its held amounts): a forgotten settle
    must never make a call free. Settle with the real usage to silence it.
    """


ExitAction = Literal["none", "refund", "settle_observed", "settle_estimate"]


@dataclass
class GuardState:
    """What a reservation guard knows, whichever client drives it."""

    info: ReservationInfo
    observed_output_tokens: int = 0
    """Output tokens a streaming meter has seen arrive."""
    cut: Denied | None = None
    """The denial that stopped a metered stream, if one did."""

    def exit_action(self, failed: bool) -> tuple[ExitAction, dict[str, int] | None]:
        """What leaving the ``with`` block does.

        - already ended (settled, refunded, expired, or a replay of an
          ended reservation): nothing;
        - an exception, nothing streamed: refund (the call failed);
        - an exception after tokens streamed: settle what was seen, because
          the provider counted those tokens (a refund would make them free);
        - a normal exit with no settle: settle at the estimate, and warn.
        """
        if self.info.status != "held":
            return "none", None
        if failed:
            if self.observed_output_tokens > 0:
                return "settle_observed", self.observed_usage()
            return "refund", None
        return "settle_estimate", self.info.usage_estimate()

    def observed_usage(self) -> dict[str, int]:
        """Usage as seen by the meter: the prompt as estimated (it was sent)
        and the output tokens that arrived."""
        return {
            "input_tokens": self.info.held.get("input_tokens", 0),
            "output_tokens": self.observed_output_tokens,
        }

    def warn_unsettled(self, usage: Mapping[str, int], stacklevel: int) -> None:
        """Warns that the block ended without a settle; ``stacklevel`` points
        the warning at the caller's ``with``."""
        warnings.warn(
            f"reservation {self.info.id} left its `with` block without settle() or "
            f"refund(): settled at the estimate {dict(usage)}",
            UnsettledReservationWarning,
            stacklevel=stacklevel,
        )


def add_note(exc: BaseException, action: str, error: BaseException) -> None:
    """Notes on the caller's exception that cleaning up failed too (the TTL
    will release the hold)."""
    note = f"allowance: {action} after this exception failed: {error!r}; the hold expires by TTL"
    if hasattr(exc, "add_note"):
        exc.add_note(note)


@dataclass
class MeterCore:
    """Counts streamed output tokens and says when to top up the hold."""

    held_output_tokens: int
    tranche_tokens: int
    ttl_ms: int | None
    seen_output_tokens: int = 0

    def __post_init__(self) -> None:
        if self.tranche_tokens < 1:
            raise ValueError(f"tranche_tokens: must be ≥ 1, got {self.tranche_tokens}")

    def top_up(self, tokens: int) -> int:
        """Records ``tokens`` more output; the amount to add to the hold
        (0 when the hold still covers what was seen)."""
        if tokens < 0:
            raise ValueError(f"tokens: must be ≥ 0, got {tokens}")
        self.seen_output_tokens += tokens
        if self.seen_output_tokens < self.held_output_tokens:
            return 0
        # Whole tranches, enough to cover what was seen plus one more token:
        # the hold stays ahead of the stream.
        missing = self.seen_output_tokens - self.held_output_tokens + 1
        tranches = -(-missing // self.tranche_tokens)
        return tranches * self.tranche_tokens

    def extended(self, info: ReservationInfo) -> None:
        """Takes the hold the server answered after a top-up."""
        self.held_output_tokens = info.held.get("output_tokens", 0)


@dataclass
class WaitPolicy:
    """How ``reserve_or_wait`` spaces its attempts.

    A ``rate_limited`` answer is retried after its ``retry_after`` (capped at
    ``max_backoff_s``) plus up to ``jitter`` of it again, so callers denied
    together do not return together; never before the server said. A 503 or
    a broken connection is retried with exponential backoff, but only with
    an ``idempotency_key`` (without one a retry could hold twice). Budget
    and size denials are final. Nothing is retried past ``timeout_s``.
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
            base = error.retry_after if error.retry_after is not None else _MIN_RETRY_S
        elif isinstance(error, (StoreUnavailable, ConnectionFailed)) and self.idempotent:
            base = _TRANSIENT_BASE_S * 2 ** min(self.attempts - 1, 10)
        else:
            return None
        base = max(_MIN_RETRY_S, min(base, self.max_backoff_s))
        return min(left, base * (1.0 + self.rng.uniform(0.0, self.jitter)))
