"""Typed errors: one class per error ``type`` of the HTTP API.

Every answer that is not 2xx becomes an :class:`ApiError` subclass carrying
every field of the server's error body, plus ``status_code`` and the raw
``body``. Denials (``rate_limited``, ``budget_exhausted``, ``exceeds_limit``)
share :class:`Denied`, which carries what said no (``scope``, ``dimension``,
``window``…) so a caller can choose what to do: wait, stop, or shrink the
request.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ._time import parse_time
from .types import ReservationInfo

__all__ = [
    "AllowanceError",
    "ApiError",
    "BudgetExhausted",
    "Conflict",
    "ConnectionFailed",
    "Denied",
    "ExceedsLimit",
    "Forbidden",
    "HeldElsewhere",
    "InvalidRequest",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "StoreUnavailable",
    "Unauthorized",
    "UnexpectedResponse",
    "UnsupportedMediaType",
]


class AllowanceError(Exception):
    """Base of every error this package raises."""


class ConnectionFailed(AllowanceError):
    """The server could not be reached, or the connection broke mid-answer.

    Like a 503, the outcome is unknown: retry a reserve with the same
    ``idempotency_key``, and a settle or refund as is (both are idempotent).
    """


class HeldElsewhere(AllowanceError):
    """The reserve was a replay (same ``idempotency_key``) of a reservation
    another caller holds and has not ended: its work is in progress
    elsewhere (a redelivered task, a second worker).

    Raised when such a reservation is entered as a guard (``with`` /
    ``async with``), before the block runs, so the duplicate call is not
    made; the guard never settles or refunds a hold it does not own (its
    owner's settle would then find it refunded, and its call go free).
    ``info`` is the reservation as the replay answered it. A hold that is
    the caller's own (an earlier attempt with the same key had an unknown
    outcome) is recognised by ``reserve_or_wait``; after a retry of your
    own, settle or refund it by id (``client.settle(e.info.id, …)``).
    """

    def __init__(self, info: ReservationInfo) -> None:
        self.info = info
        super().__init__(
            f"reservation {info.id} (idempotency key replayed) is held by another caller: "
            "its work is in progress elsewhere"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.info,), self.__dict__)


class ApiError(AllowanceError):
    """The server answered with an error body (any non-2xx status)."""

    status_code: int
    """The HTTP status."""
    type: str
    """The error's ``type`` (``invalid_request``, ``rate_limited``…)."""
    message: str
    """The server's human-readable message."""
    body: Mapping[str, Any]
    """The whole ``error`` object as the server sent it."""
    headers: Mapping[str, str]
    """The answer's headers (lower-case names)."""

    def __init__(
        self,
        status_code: int,
        error: Mapping[str, Any],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status_code = status_code
        self.type = str(error.get("type", ""))
        self.message = str(error.get("message", ""))
        self.body = error
        self.headers = dict(headers or {})
        # The server's message may already start with its type
        # ("rate_limited: …"); say it once.
        text = self.message
        if self.type and text.startswith(f"{self.type}:"):
            text = text[len(self.type) + 1 :].lstrip()
        super().__init__(f"{status_code} {self.type}: {text}")

    def __reduce__(self) -> tuple[Any, ...]:
        # The default rebuilds an exception from `args` (the one message),
        # which is not this constructor's signature: multiprocessing and
        # concurrent.futures could not hand a denial back to the parent.
        return (type(self), (self.status_code, dict(self.body), dict(self.headers)), self.__dict__)


class InvalidRequest(ApiError):
    """400: the request is malformed; ``field`` names the offending field."""

    field: str | None
    """Dotted path of the offending field (``amounts.input_tokens``), or
    ``None`` when the body was not JSON at all."""

    def __init__(
        self,
        status_code: int,
        error: Mapping[str, Any],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(status_code, error, headers)
        field = error.get("field")
        self.field = field if isinstance(field, str) else None


class Unauthorized(ApiError):
    """401: no credentials, or credentials the server does not know."""


class Forbidden(ApiError):
    """403: the credentials are valid but may not do this (a tenant token
    reserving for another tenant, or calling the admin plane)."""


class NotFound(ApiError):
    """404: no such reservation or route (another tenant's reservation
    answers 404 too, exactly as if it did not exist)."""


class Conflict(ApiError):
    """409: settle after refund, refund after settle, extend of an ended
    reservation, or an idempotency key reused for a different request."""


class PayloadTooLarge(ApiError):
    """413: the body is over the server's limit (64 KiB)."""


class UnsupportedMediaType(ApiError):
    """415: the body was not ``application/json``."""


class StoreUnavailable(ApiError):
    """503: the server's store cannot answer; the outcome is unknown.

    Retry a reserve with the same ``idempotency_key``; retry settle and
    refund as they are (both are idempotent).
    """


class UnexpectedResponse(ApiError):
    """An answer this client does not understand (an unknown error type, or
    a body that is not the documented JSON)."""


class Denied(ApiError):
    """A denial: a limit said no. Carries which limit, and how far off."""

    scope: str
    """Canonical scope that refused (``tenant:acme/user:bob``)."""
    dimension: str
    """Dimension that lacked room (``tokens``, ``requests``…)."""
    window: str
    """Window kind of the refusing limit (``sliding``, ``bucket``, ``total``…)."""
    capacity: int
    """The refusing limit's capacity."""
    remaining: int
    """Room left in it (may be negative after an overrun)."""
    requested: int
    """What the request asked of that dimension."""
    retry_after_ms: int | None
    """When a retry may pass (ms); ``None`` when no retry will help."""
    resets_at: datetime | None
    """When the window next frees room, where an instant applies."""
    queue_full: bool
    """True when a ``wait_ms`` request was refused because the admission
    queue was full."""

    def __init__(
        self,
        status_code: int,
        error: Mapping[str, Any],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(status_code, error, headers)
        self.scope = str(error.get("scope", ""))
        self.dimension = str(error.get("dimension", ""))
        self.window = str(error.get("window", ""))
        self.capacity = _int(error.get("capacity"))
        self.remaining = _int(error.get("remaining"))
        self.requested = _int(error.get("requested"))
        retry = error.get("retry_after_ms")
        self.retry_after_ms = retry if isinstance(retry, int) else None
        resets = error.get("resets_at")
        self.resets_at = parse_time(resets) if isinstance(resets, str) else None
        self.queue_full = error.get("queue_full") is True

    @property
    def retry_after(self) -> float | None:
        """``retry_after_ms`` in seconds, or ``None`` for a hard stop."""
        return None if self.retry_after_ms is None else self.retry_after_ms / 1000.0


class RateLimited(Denied):
    """429: no room now, but room will come by itself; ``retry_after``
    says when (a finite ``retry_after_ms`` ≥ 1 is always present)."""


class BudgetExhausted(Denied):
    """402: a ``total`` budget is used up; a hard stop until an admin acts."""


class ExceedsLimit(Denied):
    """422: the request is larger than the limit's whole capacity; it can
    never pass."""


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


ERROR_TYPES: Mapping[str, type[ApiError]] = {
    "invalid_request": InvalidRequest,
    "unauthorized": Unauthorized,
    "forbidden": Forbidden,
    "not_found": NotFound,
    "conflict": Conflict,
    "rate_limited": RateLimited,
    "budget_exhausted": BudgetExhausted,
    "exceeds_limit": ExceedsLimit,
    "payload_too_large": PayloadTooLarge,
    "unsupported_media_type": UnsupportedMediaType,
    "store_unavailable": StoreUnavailable,
}
"""Error ``type`` → exception class."""
