//! Concurrency: racing reserves admit exactly what fits, and racing
//! settles and refunds add up.
//!
//! Each case repeats its race for a few rounds (3 by default; set
//! `ALLOWANCE_CONFORMANCE_ROUNDS` for a longer soak).

use std::sync::Arc;

use allowance_core::{
    CatalogChange, DenialKind, Limit, Override, OverrunPolicy, Plan, ReserveError, ReserveRequest,
    Status, StoreError, Window, WindowKind,
};
use tokio::sync::Barrier;

use crate::Harness;
use crate::support::{cost, key, tokens, usage};

fn rounds() -> usize {
    std::env::var("ALLOWANCE_CONFORMANCE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
}

/// Seed 002: a user's €20 daily cap with €10 spent, and 40 tasks of €4.45
/// starting at once. Check-then-act would admit all 40; the ledger admits
/// exactly the 2 that fit and refuses 38.
pub(crate) async fn seed_002_race(h: Harness) {
    const TASKS: usize = 40;
    for round in 0..rounds() {
        let tenant = format!("t{round}");
        let user = format!("tenant:{tenant}/user:u1");
        h.spend(&tenant, &[("user", "u1")], cost(10_000_000)).await;
        let req = Arc::new(h.request(&tenant, &[("user", "u1")], cost(4_450_000)).await);
        let start = Arc::new(Barrier::new(TASKS));
        let racers: Vec<_> = (0..TASKS)
            .map(|_| {
                let (store, req, start) = (h.store.clone(), req.clone(), start.clone());
                tokio::spawn(async move {
                    start.wait().await;
                    store.reserve(&req).await
                })
            })
            .collect();
        let (mut granted, mut denied) = (0, 0);
        for racer in racers {
            match racer.await.expect("a racing task ran to the end") {
                Ok(g) => {
                    assert_eq!(g.status, Status::Held);
                    granted += 1;
                }
                Err(StoreError::Rejected(ReserveError::Denied(d))) => {
                    assert_eq!(
                        (d.kind, d.scope.as_str(), d.dimension.as_str()),
                        (DenialKind::RateLimited, user.as_str(), "cost_micros"),
                        "round {round}: refused by the user's daily cap"
                    );
                    denied += 1;
                }
                Err(e) => panic!("round {round}: a racing reserve failed: {e:?}"),
            }
        }
        assert_eq!(
            (granted, denied),
            (2, 38),
            "round {round}: exactly the two that fit"
        );
        assert_eq!(
            h.figures(&user, "cost_micros", WindowKind::Calendar).await,
            (10_000_000, 8_900_000, 1_100_000),
            "round {round}: €10 spent, 2 × €4.45 held"
        );
        assert_eq!(h.status(&user).await.held_reservations, 2);
    }
}

/// Many tenants race reserves, extends, settles and refunds through one
/// shared scope: every hold is released exactly once and every settle
/// recorded exactly once.
pub(crate) async fn racing_settles_add_up(h: Harness) {
    const TENANTS: usize = 16;
    // At most the tenant's concurrency limit, so no racer is refused.
    const TASKS_PER_TENANT: usize = 8;
    let catalog = h.store.catalog().await.expect("catalog");
    let search_calls = catalog.dimension("search_calls").expect("configured");
    let roomy = Plan::new(
        "search-roomy",
        vec![Limit::new(search_calls, 1_000_000, Window::Total).expect("a valid limit")],
        OverrunPolicy::ChargeActual,
    )
    .expect("a valid plan");
    let change = CatalogChange::SetOverride(key("tool:search"), Override::Limits(roomy));
    h.store.change_catalog(&change).await.expect("override");

    let settled_per_tenant = TASKS_PER_TENANT.div_ceil(2) as i64;
    for round in 0..rounds() {
        let tenants: Vec<String> = (0..TENANTS).map(|i| format!("r{round}-t{i}")).collect();
        let start = Arc::new(Barrier::new(TENANTS * TASKS_PER_TENANT));
        let mut racers = Vec::new();
        for tenant in &tenants {
            for j in 0..TASKS_PER_TENANT {
                let agent = format!("a{j}");
                let scopes = h
                    .scopes(tenant, &[("agent", agent.as_str()), ("tool", "search")])
                    .await;
                let (store, start) = (h.store.clone(), start.clone());
                racers.push(tokio::spawn(async move {
                    let amounts = tokens(100).with(search_calls, 1);
                    let req = ReserveRequest::new(scopes, amounts);
                    start.wait().await;
                    let id = store
                        .reserve(&req)
                        .await
                        .map_err(|e| format!("reserve: {e:?}"))?
                        .id;
                    if j % 3 == 0 {
                        store
                            .extend(id, Some(&tokens(50)), None)
                            .await
                            .map_err(|e| format!("extend: {e:?}"))?;
                    }
                    if j % 2 == 0 {
                        let u = usage(tokens(70).with(search_calls, 1));
                        store
                            .settle(id, &u)
                            .await
                            .map_err(|e| format!("settle: {e:?}"))?;
                    } else {
                        store
                            .refund(id)
                            .await
                            .map_err(|e| format!("refund: {e:?}"))?;
                    }
                    Ok::<(), String>(())
                }));
            }
        }
        for racer in racers {
            if let Err(e) = racer.await.expect("a racing task ran to the end") {
                panic!("round {round}: no racer may be refused here: {e}");
            }
        }
        for tenant in &tenants {
            let scope = format!("tenant:{tenant}");
            assert_eq!(
                h.figures(&scope, "tokens", WindowKind::Sliding).await,
                (
                    70 * settled_per_tenant,
                    0,
                    100_000 - 70 * settled_per_tenant
                ),
                "round {round}: {scope} recorded each settle once, released each hold once"
            );
            assert_eq!(h.status(&scope).await.held_reservations, 0);
        }
        let used = (TENANTS as i64) * settled_per_tenant * (round as i64 + 1);
        assert_eq!(
            h.figures("tool:search", "search_calls", WindowKind::Total)
                .await,
            (used, 0, 1_000_000 - used),
            "round {round}: the shared scope counted every tenant's settles once"
        );
        assert_eq!(h.status("tool:search").await.held_reservations, 0);
    }
}
