"""Every method of the sync client against a real server, and every error
type with its fields."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import httpx
import pytest
from client_harness import Server, unique

from allowance import (
    BudgetExhausted,
    Client,
    Conflict,
    ConnectionFailed,
    ExceedsLimit,
    Forbidden,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    Unauthorized,
    UnsupportedMediaType,
)
from allowance._api import error_from

AMOUNTS = {"input_tokens": 3000, "output_tokens": 500}


def test_reserve_answers_the_reservation_and_the_room_left(acme: Client) -> None:
    user = unique("bob")
    with acme.reserve(
        "acme",
        AMOUNTS,
        scopes={"user": user, "agent": "planner-7"},
        model="gpt-4o",
        ttl_ms=30_000,
        labels={"task": "summarise"},
        priority=3,
    ) as r:
        info = r.info
        assert info.id is not None and info.id.startswith("rsv_")
        assert r.id == info.id
        assert info.status == "held" and r.status == "held"
        assert info.tenant == "acme"
        assert info.scopes == (
            "tenant:acme",
            f"tenant:acme/user:{user}",
            "tenant:acme/agent:planner-7",
        )
        assert info.model == "gpt-4o"
        assert info.labels == {"task": "summarise"}
        # gpt-4o at 2.50/10.00 per million: 3000 × 2.5 + 500 × 10 = 12 500 µ.
        assert info.held == {
            "requests": 1,
            "concurrent": 1,
            "input_tokens": 3000,
            "output_tokens": 500,
            "tokens": 3500,
            "cost_micros": 12_500,
        }
        assert info.replayed is False
        ttl = (info.expires_at - info.created_at).total_seconds()
        assert 29.9 <= ttl <= 30.1
        assert info.created_at.tzinfo is not None
        assert abs((info.created_at - datetime.now(UTC)).total_seconds()) < 60
        user_tokens = next(x for x in info.remaining if x.scope.endswith(user))
        assert (user_tokens.dimension, user_tokens.window) == ("tokens", "sliding")
        assert (user_tokens.capacity, user_tokens.remaining) == (1_000_000, 996_500)
        r.settle({"input_tokens": 2950, "output_tokens": 400})
    assert acme.get(r.id).status == "settled"


def test_get_settle_refund_extend(acme: Client) -> None:
    user = unique("u")
    r = acme.reserve("acme", AMOUNTS, scopes={"user": user}, ttl_ms=10_000)
    got = acme.get(r.id)
    assert (got.id, got.status, got.held) == (r.id, "held", r.held)

    extended = acme.extend(r.id, {"output_tokens": 250}, ttl_ms=120_000)
    assert extended.held["output_tokens"] == 750
    assert extended.held["tokens"] == 3750
    assert (extended.expires_at - datetime.now(UTC)).total_seconds() > 100
    ttl_only = acme.extend(r.id, ttl_ms=5_000)
    assert ttl_only.held["output_tokens"] == 750
    assert (ttl_only.expires_at - datetime.now(UTC)).total_seconds() < 10
    with pytest.raises(ValueError, match="amounts"):
        acme.extend(r.id)

    settled = acme.settle(
        r.id,
        {"input_tokens": 2900, "output_tokens": 700},
        charges=[{"name": "search", "cost_micros": 5000}],
    )
    assert settled.status == "settled"
    assert settled.charged is not None
    assert settled.charged["tokens"] == 3600
    assert settled.charged["cost_micros"] == 5000
    assert settled.late is False and settled.ended_at is not None
    assert acme.settle(r.id, {"input_tokens": 1}) == settled, "a repeat answers the same"
    assert acme.status(f"tenant:acme/user:{user}").limit("tokens").used == 3600

    other = acme.reserve("acme", AMOUNTS, scopes={"user": user})
    refunded = acme.refund(other.id)
    assert refunded.status == "refunded" and refunded.charged is None
    assert acme.refund(other.id) == refunded
    st = acme.status(f"tenant:acme/user:{user}")
    assert (st.limit("tokens").used, st.limit("tokens").held) == (3600, 0)


def test_status_of_a_fresh_scope_is_its_plan_with_zero_use(acme: Client) -> None:
    scope = f"tenant:acme/task:{unique('t')}"
    st = acme.status(scope)
    assert (st.scope, st.plan, st.held_reservations) == (scope, "task-default", 0)
    (lim,) = st.limits
    assert (lim.dimension, lim.window, lim.capacity, lim.used, lim.held, lim.remaining) == (
        "tokens",
        "total",
        10_000,
        0,
        0,
        10_000,
    )
    assert lim.resets_at is None and lim.period_ms is None
    bucket = acme.status("tenant:acme/agent:a1").limit("requests")
    assert (bucket.window, bucket.period_ms) == ("bucket", 60_000)
    with pytest.raises(KeyError, match="no 'cost_micros' limit"):
        st.limit("cost_micros")


def test_dry_run_holds_nothing_and_denies_like_a_reserve(acme: Client) -> None:
    task = unique("t")
    dry = acme.dry_run("acme", {"tokens": 4000}, scopes={"task": task})
    assert (dry.status, dry.id) == ("dry_run", None)
    assert dry.held["tokens"] == 4000
    assert acme.status(f"tenant:acme/task:{task}").limits[0].held == 0
    with pytest.raises(ExceedsLimit) as e:
        acme.dry_run("acme", {"tokens": 10_001}, scopes={"task": task})
    assert e.value.scope == f"tenant:acme/task:{task}"


def test_usage_log_pages_with_a_cursor(admin: Client, acme: Client) -> None:
    first = admin.usage()
    cursor = first.next_cursor
    r = acme.reserve("acme", {"tokens": 10}, labels={"job": "usage-test"})
    r.settle({"tokens": 7})
    page = admin.usage(since=cursor, limit=1000)
    mine = [x for x in page.records if x.reservation == r.id]
    assert len(mine) == 1
    rec = mine[0]
    assert (rec.kind, rec.tenant, rec.charged["tokens"], rec.labels) == (
        "settled",
        "acme",
        7,
        {"job": "usage-test"},
    )
    assert page.next_cursor is not None and page.next_cursor != cursor
    again = admin.usage(since=page.next_cursor)
    assert again.records == () and again.next_cursor == page.next_cursor
    own = acme.usage(since=cursor)
    assert all(x.tenant == "acme" for x in own.records) and own.records


def test_health_and_readiness(acme: Client, server: Server) -> None:
    assert acme.healthz() is True
    assert acme.readyz() is True
    with Client(server.base_url) as anonymous:
        assert anonymous.healthz() is True


def test_admin_plans_overrides_and_adjustments(admin: Client, acme: Client) -> None:
    name = unique("tier")
    plan = admin.put_plan(
        name,
        [{"dimension": "tokens", "capacity": 2000, "window": "total"}],
        overrun="cap_at_estimate",
    )
    assert plan.name == name
    assert plan.limits == ({"dimension": "tokens", "capacity": 2000, "window": "total"},)
    assert plan.raw["overrun"] == "cap_at_estimate"
    assert name in {p.name for p in admin.plans()}

    scope = f"tenant:acme/task:{unique('t')}"
    moved = admin.set_scope(scope, plan=name)
    assert (moved.plan, moved.limits[0].capacity) == (name, 2000)
    own = admin.set_scope(
        scope, limits=[{"dimension": "tokens", "capacity": 3000, "window": "total"}]
    )
    # HTTP-API.md says `override`; the server answers `override:<scope>`.
    assert own.plan.startswith("override") and own.limits[0].capacity == 3000
    with pytest.raises(ValueError, match="exactly one"):
        admin.set_scope(scope)

    r = acme.reserve("acme", {"tokens": 1000}, scopes={"task": scope.rsplit(":", 1)[1]})
    r.settle({"tokens": 1000})
    debited = admin.adjust(scope, "tokens", -500, "test debit")
    assert debited.limits[0].used == 1500
    credited = admin.adjust(scope, "tokens", 1500, "test credit")
    assert credited.limits[0].used == 0
    back = admin.delete_override(scope)
    assert (back.plan, back.limits[0].capacity) == ("task-default", 10_000)

    adjusted = [x for x in admin.usage().records if x.kind == "adjusted" and scope in x.scopes]
    assert [(x.credit, x.reason) for x in adjusted] == [(-500, "test debit"), (1500, "test credit")]


# Errors -------------------------------------------------------------------


def test_invalid_request_names_the_field(acme: Client) -> None:
    with pytest.raises(InvalidRequest) as e:
        acme.reserve("acme", {"input_tokens": -1})
    err = e.value
    assert (err.status_code, err.type, err.field) == (
        400,
        "invalid_request",
        "amounts.input_tokens",
    )
    assert "negative" in err.message
    with pytest.raises(InvalidRequest) as e:
        acme.reserve("acme", AMOUNTS, ttl_ms=0)
    assert e.value.field == "ttl_ms"
    with pytest.raises(InvalidRequest) as e:
        acme.reserve("acme", AMOUNTS, scopes={"nosuchkind": "x"})
    assert e.value.field == "scopes.nosuchkind"
    with pytest.raises(TypeError, match="unknown option"):
        acme.reserve("acme", AMOUNTS, tll_ms=5)  # type: ignore[call-arg]


def test_unauthorized_and_forbidden_are_distinct(server: Server, acme: Client) -> None:
    with Client(server.base_url, "alw_not-a-token") as stranger, pytest.raises(Unauthorized) as e:
        stranger.reserve("acme", AMOUNTS)
    assert (e.value.status_code, e.value.type) == (401, "unauthorized")
    with Client(server.base_url) as anonymous, pytest.raises(Unauthorized):
        anonymous.status("tenant:acme")

    with pytest.raises(Forbidden) as f:
        acme.reserve("beta", AMOUNTS)
    assert (f.value.status_code, f.value.type) == (403, "forbidden")
    with pytest.raises(Forbidden):
        acme.plans()
    with pytest.raises(Forbidden):
        acme.put_plan("x", [{"dimension": "tokens", "capacity": 1, "window": "total"}])


def test_not_found_for_unknown_ids_and_other_tenants(acme: Client, beta: Client) -> None:
    with pytest.raises(NotFound) as e:
        acme.get("rsv_00000000000000000000000000000000")
    assert (e.value.status_code, e.value.type) == (404, "not_found")
    theirs = beta.reserve("beta", AMOUNTS)
    for call in (
        lambda: acme.get(theirs.id),
        lambda: acme.settle(theirs.id, AMOUNTS),
        lambda: acme.refund(theirs.id),
        lambda: acme.extend(theirs.id, ttl_ms=1000),
        lambda: acme.status("tenant:beta"),
    ):
        with pytest.raises(NotFound):
            call()
    theirs.settle(AMOUNTS)


def test_conflicts(acme: Client) -> None:
    r = acme.reserve("acme", AMOUNTS)
    r.refund()
    with pytest.raises(Conflict) as e:
        r.settle(AMOUNTS)
    assert (e.value.status_code, e.value.type) == (409, "conflict")
    with pytest.raises(Conflict):
        r.extend({"output_tokens": 1})
    s = acme.reserve("acme", AMOUNTS)
    s.settle(AMOUNTS)
    with pytest.raises(Conflict):
        s.refund()


def test_rate_limited_carries_every_field(admin: Client, acme: Client) -> None:
    agent = unique("a")
    scope = f"tenant:acme/agent:{agent}"
    admin.set_scope(
        scope,
        limits=[{"dimension": "requests", "capacity": 1, "window": "bucket", "period_ms": 60_000}],
    )
    acme.reserve("acme", {}, scopes={"agent": agent}).settle({})
    with pytest.raises(RateLimited) as e:
        acme.reserve("acme", {}, scopes={"agent": agent})
    err = e.value
    assert (err.status_code, err.type) == (429, "rate_limited")
    assert (err.scope, err.dimension, err.window) == (scope, "requests", "bucket")
    assert (err.capacity, err.remaining, err.requested) == (1, 0, 1)
    assert err.retry_after_ms is not None and 55_000 <= err.retry_after_ms <= 60_000
    assert err.retry_after == pytest.approx(err.retry_after_ms / 1000)
    assert err.resets_at is not None and err.resets_at > datetime.now(UTC)
    assert err.queue_full is False
    assert err.headers["retry-after"] == "60"
    assert err.headers["x-budget-scope"] == scope
    assert err.body["dimension"] == "requests"
    # The server's message starts with its type; the text says it once.
    assert str(err).startswith("429 rate_limited: ")
    assert "rate_limited: rate_limited" not in str(err), str(err)
    assert err.message == err.body["message"], "the server's message is kept as sent"


def test_budget_exhausted_is_a_hard_stop(acme: Client) -> None:
    task = unique("t")
    acme.reserve("acme", {"tokens": 8000}, scopes={"task": task}).settle({"tokens": 8000})
    with pytest.raises(BudgetExhausted) as e:
        acme.reserve("acme", {"tokens": 2001}, scopes={"task": task})
    err = e.value
    assert (err.status_code, err.type, err.window) == (402, "budget_exhausted", "total")
    assert (err.scope, err.dimension) == (f"tenant:acme/task:{task}", "tokens")
    assert (err.capacity, err.remaining, err.requested) == (10_000, 2000, 2001)
    assert err.retry_after_ms is None and err.retry_after is None and err.resets_at is None


def test_exceeds_limit_can_never_pass(acme: Client) -> None:
    task = unique("t")
    with pytest.raises(ExceedsLimit) as e:
        acme.reserve("acme", {"tokens": 10_001}, scopes={"task": task})
    err = e.value
    assert (err.status_code, err.type) == (422, "exceeds_limit")
    assert (err.capacity, err.requested, err.retry_after_ms) == (10_000, 10_001, None)


def test_payload_too_large(acme: Client) -> None:
    with pytest.raises(PayloadTooLarge) as e:
        acme.reserve("acme", AMOUNTS, labels={"big": "x" * 70_000})
    assert (e.value.status_code, e.value.type) == (413, "payload_too_large")


def test_unsupported_media_type_maps_to_its_type(server: Server) -> None:
    # The client always sends JSON; send text by hand to see the mapping.
    r = httpx.post(
        f"{server.base_url}/v1/reservations",
        content=b"tenant=acme",
        headers={"content-type": "text/plain", "authorization": f"Bearer {server.tokens.acme}"},
    )
    err = error_from(r)
    assert isinstance(err, UnsupportedMediaType)
    assert (err.status_code, err.type) == (415, "unsupported_media_type")


def test_connection_failed_when_nothing_listens() -> None:
    from client_harness import free_port

    with Client(f"http://127.0.0.1:{free_port()}", "t", timeout_s=2) as c:
        t = time.monotonic()
        with pytest.raises(ConnectionFailed):
            c.healthz()
        assert time.monotonic() - t < 5
