"""The one request-building core shared by :class:`Client` and :class:`AsyncClient`.

Each API call is described by a :class:`Call` (method, path, JSON body and
a parser of the answer); the sync and async clients only differ in how they
send it. So the wire format lives here once, and the two clients cannot
drift apart.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx

from .errors import ERROR_TYPES, ApiError, UnexpectedResponse
from .types import (
    Charge,
    LimitSpec,
    Plan,
    ReservationInfo,
    ReserveOptions,
    ScopeStatus,
    UsagePage,
    UsageRecord,
)

T = TypeVar("T")

USER_AGENT = "allowance-python/0.1.0"
"""Sent with every request."""

_RESERVE_OPTION_KEYS = frozenset(ReserveOptions.__annotations__)


@dataclass(frozen=True)
class Call(Generic[T]):
    """One HTTP exchange: what to send and how to read the answer."""

    method: str
    path: str
    body: Mapping[str, Any] | None
    parse: Callable[[httpx.Response], T]
    query: Mapping[str, str] | None = None
    extra_timeout_s: float = 0.0
    """Added to the client's timeout: a reserve with ``wait_ms`` may be
    answered only after that long."""

    def finish(self, response: httpx.Response) -> T:
        """The parsed result of a 2xx answer; otherwise the typed error."""
        if response.is_success:
            try:
                return self.parse(response)
            except (ValueError, KeyError, TypeError) as e:
                raise _unexpected(response, f"cannot read the answer: {e}") from e
        raise error_from(response)


def error_from(response: httpx.Response) -> ApiError:
    """The typed exception for a non-2xx answer."""
    headers = {k.lower(): v for k, v in response.headers.items()}
    try:
        body = response.json()
    except ValueError:
        return _unexpected(response, "the error body is not JSON")
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return _unexpected(response, "the error body has no `error` object")
    cls = ERROR_TYPES.get(str(error.get("type")), UnexpectedResponse)
    return cls(response.status_code, error, headers)


def _unexpected(response: httpx.Response, why: str) -> UnexpectedResponse:
    text = response.text[:500]
    return UnexpectedResponse(
        response.status_code,
        {"type": "unexpected_response", "message": f"{why}: {text!r}"},
        {k.lower(): v for k, v in response.headers.items()},
    )


def _reservation(response: httpx.Response) -> ReservationInfo:
    return ReservationInfo.from_json(response.json())


def _scope_status(response: httpx.Response) -> ScopeStatus:
    return ScopeStatus.from_json(response.json())


def _plan(response: httpx.Response) -> Plan:
    return Plan.from_json(response.json())


def _plans(response: httpx.Response) -> list[Plan]:
    return [Plan.from_json(p) for p in response.json()["plans"]]


def _usage(response: httpx.Response) -> UsagePage:
    records = tuple(
        UsageRecord.from_json(json.loads(line)) for line in response.text.splitlines() if line
    )
    return UsagePage(records=records, next_cursor=response.headers.get("x-next-cursor"))


def _ok(response: httpx.Response) -> bool:
    return True


def _path_id(reservation_id: str) -> str:
    if not reservation_id:
        raise ValueError("reservation_id: must not be empty")
    return quote(reservation_id, safe="")


def _path_scope(scope: str) -> str:
    if not scope:
        raise ValueError("scope: must not be empty")
    # The slash between the tenant and the scope stays raw (HTTP-API.md 6).
    return quote(scope, safe="/:@")


def reserve_body(
    tenant: str, amounts: Mapping[str, int], opts: ReserveOptions, *, dry_run: bool = False
) -> dict[str, Any]:
    """The JSON body of a reserve. Unknown options are a ``TypeError``
    naming them (the server would refuse them as a 400 anyway)."""
    unknown = set(opts) - _RESERVE_OPTION_KEYS
    if unknown:
        raise TypeError(f"reserve: unknown option(s) {sorted(unknown)}")
    body: dict[str, Any] = {"tenant": tenant, "amounts": dict(amounts)}
    for key, value in opts.items():
        if value is None:
            continue
        body[key] = dict(value) if isinstance(value, Mapping) else value
    if dry_run:
        body["dry_run"] = True
    return body


def reserve(tenant: str, amounts: Mapping[str, int], opts: ReserveOptions) -> Call[ReservationInfo]:
    """``POST /v1/reservations``."""
    wait_ms = opts.get("wait_ms") or 0
    return Call(
        "POST",
        "/v1/reservations",
        reserve_body(tenant, amounts, opts),
        _reservation,
        extra_timeout_s=wait_ms / 1000.0,
    )


def dry_run(tenant: str, amounts: Mapping[str, int], opts: ReserveOptions) -> Call[ReservationInfo]:
    """``POST /v1/reservations`` with ``dry_run: true``."""
    return Call(
        "POST", "/v1/reservations", reserve_body(tenant, amounts, opts, dry_run=True), _reservation
    )


def get(reservation_id: str) -> Call[ReservationInfo]:
    """``GET /v1/reservations/{id}``."""
    return Call("GET", f"/v1/reservations/{_path_id(reservation_id)}", None, _reservation)


def settle(
    reservation_id: str, usage: Mapping[str, int], charges: Sequence[Charge] | None
) -> Call[ReservationInfo]:
    """``POST /v1/reservations/{id}/settle``."""
    body: dict[str, Any] = {"usage": dict(usage)}
    if charges:
        body["charges"] = [dict(c) for c in charges]
    return Call("POST", f"/v1/reservations/{_path_id(reservation_id)}/settle", body, _reservation)


def refund(reservation_id: str) -> Call[ReservationInfo]:
    """``POST /v1/reservations/{id}/refund``."""
    return Call("POST", f"/v1/reservations/{_path_id(reservation_id)}/refund", {}, _reservation)


def extend(
    reservation_id: str, amounts: Mapping[str, int] | None, ttl_ms: int | None
) -> Call[ReservationInfo]:
    """``POST /v1/reservations/{id}/extend``; at least one of the two."""
    if amounts is None and ttl_ms is None:
        raise ValueError("extend: give `amounts`, `ttl_ms` or both")
    body: dict[str, Any] = {}
    if amounts is not None:
        body["amounts"] = dict(amounts)
    if ttl_ms is not None:
        body["ttl_ms"] = ttl_ms
    return Call("POST", f"/v1/reservations/{_path_id(reservation_id)}/extend", body, _reservation)


def status(scope: str) -> Call[ScopeStatus]:
    """``GET /v1/scopes/{scope}``."""
    return Call("GET", f"/v1/scopes/{_path_scope(scope)}", None, _scope_status)


def plans() -> Call[list[Plan]]:
    """``GET /v1/plans`` (admin)."""
    return Call("GET", "/v1/plans", None, _plans)


def put_plan(
    name: str,
    limits: Sequence[LimitSpec],
    *,
    overrun: str | None,
    overrun_percent: int | None,
    queue_weight: int | None,
) -> Call[Plan]:
    """``PUT /v1/plans/{name}`` (admin)."""
    body: dict[str, Any] = {"limits": [dict(x) for x in limits]}
    if overrun is not None:
        body["overrun"] = overrun
    if overrun_percent is not None:
        body["overrun_percent"] = overrun_percent
    if queue_weight is not None:
        body["queue_weight"] = queue_weight
    return Call("PUT", f"/v1/plans/{quote(name, safe='')}", body, _plan)


def put_scope(
    scope: str, *, plan: str | None, limits: Sequence[LimitSpec] | None
) -> Call[ScopeStatus]:
    """``PUT /v1/scopes/{scope}`` (admin): a plan, or the scope's own limits."""
    if (plan is None) == (limits is None):
        raise ValueError("set_scope: give exactly one of `plan` and `limits`")
    body: dict[str, Any] = (
        {"plan": plan} if plan is not None else {"limits": [dict(x) for x in limits or []]}
    )
    return Call("PUT", f"/v1/scopes/{_path_scope(scope)}", body, _scope_status)


def delete_override(scope: str) -> Call[ScopeStatus]:
    """``DELETE /v1/scopes/{scope}/override`` (admin)."""
    return Call("DELETE", f"/v1/scopes/{_path_scope(scope)}/override", None, _scope_status)


def adjust(scope: str, dimension: str, amount: int, reason: str) -> Call[ScopeStatus]:
    """``POST /v1/scopes/{scope}/adjust`` (admin)."""
    body = {"dimension": dimension, "amount": amount, "reason": reason}
    return Call("POST", f"/v1/scopes/{_path_scope(scope)}/adjust", body, _scope_status)


def usage(since: str | None, limit: int | None) -> Call[UsagePage]:
    """``GET /v1/usage``."""
    query: dict[str, str] = {}
    if since is not None:
        query["since"] = since
    if limit is not None:
        query["limit"] = str(limit)
    return Call("GET", "/v1/usage", None, _usage, query=query)


def healthz() -> Call[bool]:
    """``GET /healthz``."""
    return Call("GET", "/healthz", None, _ok)


def readyz() -> Call[bool]:
    """``GET /readyz``."""
    return Call("GET", "/readyz", None, _ok)


def headers(token: str | None, extra: Mapping[str, str] | None) -> dict[str, str]:
    """Default headers of every request."""
    out = {"user-agent": USER_AGENT, "accept": "application/json"}
    if token:
        out["authorization"] = f"Bearer {token}"
    out.update(extra or {})
    return out


def request_kwargs(call: Call[Any], timeout_s: float | None) -> dict[str, Any]:
    """Keyword arguments of ``httpx.Client.request`` for ``call``."""
    kwargs: dict[str, Any] = {"method": call.method, "url": call.path}
    if call.body is not None:
        kwargs["json"] = call.body
    if call.query:
        kwargs["params"] = dict(call.query)
    if timeout_s is not None:
        kwargs["timeout"] = timeout_s + call.extra_timeout_s
    return kwargs
