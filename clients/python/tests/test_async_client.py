"""Every method of the async client against a real server, and its errors."""

from __future__ import annotations

import pytest
from client_harness import Server, unique

from allowance import (
    AsyncClient,
    BudgetExhausted,
    Conflict,
    ExceedsLimit,
    Forbidden,
    InvalidRequest,
    NotFound,
    RateLimited,
    Unauthorized,
)

AMOUNTS = {"input_tokens": 3000, "output_tokens": 500}


async def test_data_plane(aacme: AsyncClient, aadmin: AsyncClient) -> None:
    user = unique("u")
    scope = f"tenant:acme/user:{user}"
    cursor = (await aadmin.usage()).next_cursor

    dry = await aacme.dry_run("acme", AMOUNTS, scopes={"user": user})
    assert (dry.status, dry.id, dry.held["tokens"]) == ("dry_run", None, 3500)

    r = await aacme.reserve("acme", AMOUNTS, scopes={"user": user}, model="gpt-4o", ttl_ms=9000)
    assert r.status == "held" and r.held["cost_micros"] == 12_500
    assert r.info.scopes == ("tenant:acme", scope)
    assert (await aacme.get(r.id)).status == "held"
    ext = await aacme.extend(r.id, {"output_tokens": 100})
    assert ext.held["output_tokens"] == 600
    st = await aacme.status(scope)
    assert (st.held_reservations, st.limit("tokens").held) == (1, 3600)
    settled = await aacme.settle(r.id, {"input_tokens": 3000, "output_tokens": 321})
    assert settled.charged is not None and settled.charged["output_tokens"] == 321

    r2 = await aacme.reserve("acme", AMOUNTS, scopes={"user": user})
    assert (await aacme.refund(r2.id)).status == "refunded"
    assert (await aacme.status(scope)).limit("tokens").used == 3321

    page = await aadmin.usage(since=cursor, limit=100)
    kinds = {x.reservation: x.kind for x in page.records}
    assert (kinds[r.id], kinds[r2.id]) == ("settled", "refunded")
    assert await aacme.healthz() is True and await aacme.readyz() is True


async def test_admin_plane(aadmin: AsyncClient, aacme: AsyncClient) -> None:
    name = unique("tier")
    plan = await aadmin.put_plan(
        name,
        [{"dimension": "requests", "capacity": 5, "window": "bucket", "period_ms": 1000}],
        queue_weight=2,
    )
    assert plan.name == name and plan.raw["queue_weight"] == 2
    assert name in {p.name for p in await aadmin.plans()}
    scope = f"tenant:acme/task:{unique('t')}"
    assert (await aadmin.set_scope(scope, plan=name)).plan == name
    own = await aadmin.set_scope(
        scope, limits=[{"dimension": "tokens", "capacity": 7, "window": "total"}]
    )
    assert own.limits[0].capacity == 7
    assert (await aadmin.adjust(scope, "tokens", -3, "async debit")).limits[0].used == 3
    assert (await aadmin.delete_override(scope)).plan == "task-default"


async def test_errors(server: Server, aacme: AsyncClient, aadmin: AsyncClient) -> None:
    with pytest.raises(InvalidRequest) as e:
        await aacme.reserve("acme", {"input_tokens": 1.5})  # type: ignore[dict-item]
    assert e.value.field == "amounts.input_tokens"
    async with AsyncClient(server.base_url, "wrong") as stranger:
        with pytest.raises(Unauthorized):
            await stranger.get("rsv_x")
    with pytest.raises(Forbidden):
        await aacme.reserve("beta", AMOUNTS)
    with pytest.raises(Forbidden):
        await aacme.delete_override("tenant:acme")
    with pytest.raises(NotFound):
        await aacme.refund("rsv_00000000000000000000000000000000")
    r = await aacme.reserve("acme", AMOUNTS)
    await r.settle(AMOUNTS)
    with pytest.raises(Conflict):
        await r.refund()

    task = unique("t")
    with pytest.raises(ExceedsLimit) as x:
        await aacme.reserve("acme", {"tokens": 10_001}, scopes={"task": task})
    assert x.value.requested == 10_001
    await (await aacme.reserve("acme", {"tokens": 10_000}, scopes={"task": task})).settle(
        {"tokens": 10_000}
    )
    with pytest.raises(BudgetExhausted) as b:
        await aacme.reserve("acme", {"tokens": 1}, scopes={"task": task})
    assert (b.value.remaining, b.value.retry_after) == (0, None)

    agent = unique("a")
    await aadmin.set_scope(
        f"tenant:acme/agent:{agent}", limits=[{"dimension": "concurrent", "capacity": 1}]
    )
    held = await aacme.reserve("acme", {}, scopes={"agent": agent}, ttl_ms=20_000)
    with pytest.raises(RateLimited) as rl:
        await aacme.reserve("acme", {}, scopes={"agent": agent})
    assert rl.value.dimension == "concurrent" and rl.value.window == "concurrent"
    assert rl.value.retry_after is not None and 15 < rl.value.retry_after <= 20
    await held.refund()
