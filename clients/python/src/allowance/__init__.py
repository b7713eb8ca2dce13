"""allowance: reserve budget and rate-limit capacity before an AI call.

- **reserve** an estimate against scopes (tenant, user, agent, task, a shared
  ``upstream:openai``…); a limit that says no raises a typed denial naming it;
- **settle** the actual usage when the call returns, or **refund** a call
  that failed; **extend** a hold as a stream grows.

>>> from allowance import Client                                   # doctest: +SKIP
>>> client = Client("http://127.0.0.1:8787", token="alw_…")
>>> with client.reserve("acme", {"input_tokens": 3000, "output_tokens": 500},
...                     scopes={"user": "bob"}) as r:
...     reply = call_model()
...     r.settle({"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens})

An exception in the block refunds (but a settle that failed inside it is
sent again, never turned into a refund); leaving it without a settle settles
at the estimate, then warns (:class:`UnsettledReservationWarning`).
"""

from ._shared import SettleFailedWarning, UnsettledReservationWarning
from .aio import AsyncClient, AsyncReservation, AsyncStreamMeter, PendingReservation
from .client import Client, Reservation, StreamMeter
from .errors import (
    AllowanceError,
    ApiError,
    BudgetExhausted,
    Conflict,
    ConnectionFailed,
    Denied,
    ExceedsLimit,
    Forbidden,
    HeldElsewhere,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    StoreUnavailable,
    Unauthorized,
    UnexpectedResponse,
    UnsupportedMediaType,
)
from .keys import canonical_json, idempotency_key
from .types import (
    Charge,
    LimitSpec,
    LimitStatus,
    Plan,
    Remaining,
    ReservationInfo,
    ReservationStatus,
    ReserveOptions,
    ScopeStatus,
    UsagePage,
    UsageRecord,
)

__version__ = "0.1.0"

__all__ = [
    "AllowanceError",
    "ApiError",
    "AsyncClient",
    "AsyncReservation",
    "AsyncStreamMeter",
    "BudgetExhausted",
    "Charge",
    "Client",
    "Conflict",
    "ConnectionFailed",
    "Denied",
    "ExceedsLimit",
    "Forbidden",
    "HeldElsewhere",
    "InvalidRequest",
    "LimitSpec",
    "LimitStatus",
    "NotFound",
    "PayloadTooLarge",
    "PendingReservation",
    "Plan",
    "RateLimited",
    "Remaining",
    "Reservation",
    "ReservationInfo",
    "ReservationStatus",
    "ReserveOptions",
    "ScopeStatus",
    "SettleFailedWarning",
    "StoreUnavailable",
    "StreamMeter",
    "Unauthorized",
    "UnexpectedResponse",
    "UnsettledReservationWarning",
    "UnsupportedMediaType",
    "UsagePage",
    "UsageRecord",
    "canonical_json",
    "idempotency_key",
]
