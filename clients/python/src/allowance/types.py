"""Typed results and request options, as the HTTP API answers and reads them.

Results are frozen dataclasses parsed from the server's JSON; each keeps the
JSON it came from in ``raw`` so a field added by a newer server is not lost.
Amounts are ``dict[str, int]`` by dimension name (``input_tokens``,
``cost_micros``, custom dimensions…).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, TypedDict

from ._time import parse_time

__all__ = [
    "Charge",
    "LimitSpec",
    "LimitStatus",
    "Plan",
    "Remaining",
    "ReservationInfo",
    "ReservationStatus",
    "ReserveOptions",
    "ScopeStatus",
    "UsagePage",
    "UsageRecord",
]

ReservationStatus = Literal["held", "settled", "refunded", "expired", "dry_run"]
"""A reservation's state (``dry_run`` only on a dry-run answer)."""


class ReserveOptions(TypedDict, total=False):
    """Optional fields of a reserve (HTTP-API.md, ``POST /v1/reservations``)."""

    scopes: Mapping[str, str]
    """Other scopes by kind: ``{"user": "bob", "agent": "planner-7"}``; the
    tenant scope is always included."""
    model: str
    """A model of the server's model table: prices ``cost_micros``."""
    ttl_ms: int
    """Time to live of the hold (server default when absent)."""
    idempotency_key: str
    """Same key and same request → the same reservation (see
    :func:`allowance.idempotency_key`)."""
    wait_ms: int
    """Queue up to this long for room instead of failing at once."""
    priority: int
    """Order among one tenant's waiters (higher first)."""
    labels: Mapping[str, str]
    """Free-form labels, copied to the usage log."""


class Charge(TypedDict, total=False):
    """A non-token cost recorded at settle (a tool call, a vendor)."""

    name: str
    """What it was for (``search``)."""
    cost_micros: int
    """Its cost in millionths of the deployment's currency."""
    amounts: Mapping[str, int]
    """Custom dimensions it counts (``{"search_calls": 1}``)."""


class LimitSpec(TypedDict, total=False):
    """A limit as the admin API reads it, e.g.
    ``{"dimension": "requests", "capacity": 60, "window": "bucket", "period_ms": 60000}``."""

    dimension: str
    capacity: int
    window: str
    period_ms: int
    slices: int
    unit: str
    zone: str
    guaranteed: int


def _amounts(value: object) -> dict[str, int]:
    if not isinstance(value, Mapping):
        return {}
    return {str(k): int(v) for k, v in value.items()}


def _opt_time(value: object) -> datetime | None:
    return parse_time(value) if isinstance(value, str) else None


def _opt_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Remaining:
    """One limit's room after a reserve."""

    scope: str
    dimension: str
    window: str
    capacity: int
    remaining: int
    resets_at: datetime | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Remaining:
        """Parses one entry of a reserve answer's ``remaining`` list."""
        return cls(
            scope=str(data["scope"]),
            dimension=str(data["dimension"]),
            window=str(data["window"]),
            capacity=int(data["capacity"]),
            remaining=int(data["remaining"]),
            resets_at=_opt_time(data.get("resets_at")),
        )


@dataclass(frozen=True)
class ReservationInfo:
    """A reservation as the server reports it (every reservation route)."""

    id: str | None
    """``rsv_…``; ``None`` on a dry run."""
    status: ReservationStatus
    tenant: str
    scopes: tuple[str, ...]
    """Canonical scopes, the tenant first, then in the request's order."""
    model: str | None
    labels: dict[str, str]
    held: dict[str, int]
    """Amounts held (or last held, once ended), ``requests`` and
    ``concurrent`` included."""
    created_at: datetime
    expires_at: datetime
    ended_at: datetime | None
    charged: dict[str, int] | None
    """What a settle recorded after the overrun policy."""
    late: bool | None
    """Whether it was settled after it expired (once ended)."""
    replayed: bool
    """True when a reserve was an idempotent repeat of an earlier one."""
    remaining: tuple[Remaining, ...]
    """Every limit's room after a reserve (reserve answers only)."""
    raw: Mapping[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ReservationInfo:
        """Parses a reservation object."""
        late = data.get("late")
        labels = data.get("labels") or {}
        return cls(
            id=_opt_str(data.get("id")),
            status=data["status"],
            tenant=str(data["tenant"]),
            scopes=tuple(str(s) for s in data.get("scopes", [])),
            model=_opt_str(data.get("model")),
            labels={str(k): str(v) for k, v in labels.items()},
            held=_amounts(data.get("held")),
            created_at=parse_time(data["created_at"]),
            expires_at=parse_time(data["expires_at"]),
            ended_at=_opt_time(data.get("ended_at")),
            charged=_amounts(data["charged"]) if data.get("charged") is not None else None,
            late=late if isinstance(late, bool) else None,
            replayed=data.get("replayed") is True,
            remaining=tuple(Remaining.from_json(r) for r in data.get("remaining") or []),
            raw=data,
        )

    def usage_estimate(self) -> dict[str, int]:
        """The held amounts as settle usage: what "settle at the estimate"
        records (``requests`` and ``concurrent`` are implied, not usage)."""
        return {k: v for k, v in self.held.items() if k not in ("requests", "concurrent")}


@dataclass(frozen=True)
class LimitStatus:
    """One limit of a scope's status."""

    dimension: str
    window: str
    capacity: int
    used: int
    held: int
    remaining: int
    """``capacity − used − held``; negative after an overrun."""
    resets_at: datetime | None
    period_ms: int | None
    slices: int | None
    unit: str | None
    zone: str | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LimitStatus:
        """Parses one entry of a status's ``limits``."""
        return cls(
            dimension=str(data["dimension"]),
            window=str(data["window"]),
            capacity=int(data["capacity"]),
            used=int(data["used"]),
            held=int(data["held"]),
            remaining=int(data["remaining"]),
            resets_at=_opt_time(data.get("resets_at")),
            period_ms=_opt_int(data.get("period_ms")),
            slices=_opt_int(data.get("slices")),
            unit=_opt_str(data.get("unit")),
            zone=_opt_str(data.get("zone")),
        )


@dataclass(frozen=True)
class ScopeStatus:
    """``GET /v1/scopes/{scope}``: a scope's limits with their use."""

    scope: str
    plan: str
    """Its plan (``override…`` when it has its own limits)."""
    held_reservations: int
    limits: tuple[LimitStatus, ...]
    raw: Mapping[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScopeStatus:
        """Parses a scope status."""
        return cls(
            scope=str(data["scope"]),
            plan=str(data["plan"]),
            held_reservations=int(data["held_reservations"]),
            limits=tuple(LimitStatus.from_json(x) for x in data.get("limits", [])),
            raw=data,
        )

    def limit(self, dimension: str, window: str | None = None) -> LimitStatus:
        """The first limit of ``dimension`` (and ``window``, if given).

        Raises ``KeyError`` naming what was asked when there is none.
        """
        for lim in self.limits:
            if lim.dimension == dimension and (window is None or lim.window == window):
                return lim
        raise KeyError(
            f"{self.scope} has no {dimension!r} limit" + (f" ({window})" if window else "")
        )


@dataclass(frozen=True)
class Plan:
    """A plan: a named list of limits and its policies."""

    name: str
    limits: tuple[dict[str, Any], ...]
    raw: Mapping[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        """Parses a plan object."""
        return cls(
            name=str(data["name"]),
            limits=tuple(dict(x) for x in data.get("limits", [])),
            raw=data,
        )


@dataclass(frozen=True)
class UsageRecord:
    """One record of the usage log (an ended reservation or an adjustment)."""

    cursor: str
    at: datetime
    kind: str
    """``settled``, ``refunded``, ``expired`` or ``adjusted``."""
    reservation: str | None
    tenant: str | None
    """``None`` for an adjustment of a shared scope."""
    scopes: tuple[str, ...]
    model: str | None
    labels: dict[str, str]
    held: dict[str, int]
    charged: dict[str, int]
    late: bool
    dimension: str | None
    """Adjustments: the adjusted dimension."""
    credit: int | None
    """Adjustments: the amount (> 0 a credit, < 0 a debit)."""
    reason: str | None
    """Adjustments: why, as the admin said."""
    raw: Mapping[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> UsageRecord:
        """Parses one JSON line of ``GET /v1/usage``."""
        labels = data.get("labels") or {}
        return cls(
            cursor=str(data["cursor"]),
            at=parse_time(data["at"]),
            kind=str(data["kind"]),
            reservation=_opt_str(data.get("reservation")),
            tenant=_opt_str(data.get("tenant")),
            scopes=tuple(str(s) for s in data.get("scopes") or []),
            model=_opt_str(data.get("model")),
            labels={str(k): str(v) for k, v in labels.items()},
            held=_amounts(data.get("held")),
            charged=_amounts(data.get("charged")),
            late=data.get("late") is True,
            dimension=_opt_str(data.get("dimension")),
            credit=_opt_int(data.get("credit")),
            reason=_opt_str(data.get("reason")),
            raw=data,
        )


@dataclass(frozen=True)
class UsagePage:
    """A page of the usage log and the cursor to ask for the next one."""

    records: tuple[UsageRecord, ...]
    next_cursor: str | None
