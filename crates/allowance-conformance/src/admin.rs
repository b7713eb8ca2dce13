//! Admin changes at run time: plans, per-scope overrides, credits and debits.

use allowance_core::{
    AdminError, CalendarUnit, CatalogChange, DenialKind, Dimension, Limit, Override, OverrunPolicy,
    Plan, StoreError, Window, WindowKind, Zone,
};

use crate::Harness;
use crate::catalogs::{HOUR_MS, MINUTE_MS};
use crate::support::{cost, key, tokens, usage};

fn limit(dimension: Dimension, capacity: u64, window: Window) -> Limit {
    Limit::new(dimension, capacity, window).expect("a valid limit")
}

fn hour() -> Window {
    Window::Sliding {
        period_ms: HOUR_MS,
        slices: 60,
    }
}

/// A plan of `n` requests a minute, in a bucket.
fn requests_per_minute(name: &str, n: u64) -> std::sync::Arc<Plan> {
    let bucket = Window::Bucket {
        period_ms: MINUTE_MS,
    };
    Plan::new(
        name,
        vec![limit(Dimension::REQUESTS, n, bucket)],
        OverrunPolicy::ChargeActual,
    )
    .expect("a valid plan")
}

async fn change(h: &Harness, c: CatalogChange) {
    h.store
        .change_catalog(&c)
        .await
        .unwrap_or_else(|e| panic!("{c:?} should apply, got {e:?}"));
}

/// A plan change is effective for the next operation of every scope on it;
/// usage history is kept where (dimension, window, period) is unchanged and
/// starts empty where it changed; holds count in full across the change.
pub(crate) async fn plan_change_keeps_history(h: Harness) {
    h.spend(
        "acme",
        &[],
        tokens(60_000).with(Dimension::COST_MICROS, 500_000),
    )
    .await;
    let live = h.hold("acme", &[], tokens(10_000)).await;

    let day = Window::Calendar {
        unit: CalendarUnit::Day,
        zone: Zone::utc(),
    };
    let smaller = Plan::new(
        "tenant",
        vec![
            limit(Dimension::TOKENS, 70_000, hour()),
            limit(Dimension::COST_MICROS, 1_000_000, day),
            limit(Dimension::CONCURRENT, 8, Window::Concurrent),
        ],
        OverrunPolicy::ChargeActual,
    )
    .expect("a valid plan");
    change(&h, CatalogChange::SetPlan(smaller)).await;

    let tok = h.limit("tenant:acme", "tokens", WindowKind::Sliding).await;
    assert_eq!(
        (tok.capacity, tok.used, tok.held, tok.remaining),
        (70_000, 60_000, 10_000, 0),
        "same dimension and window: history kept, the hold still counts"
    );
    let spent = h
        .limit("tenant:acme", "cost_micros", WindowKind::Calendar)
        .await;
    assert_eq!(
        (spent.capacity, spent.used, spent.remaining),
        (1_000_000, 0, 1_000_000),
        "a new window starts empty"
    );
    let d = h.deny(&h.request("acme", &[], tokens(1)).await).await;
    assert_eq!(
        (d.scope.as_str(), d.capacity, d.remaining),
        ("tenant:acme", 70_000, 0),
        "the next reserve sees the new plan"
    );
    assert_eq!(
        h.limit("tenant:beta", "tokens", WindowKind::Sliding)
            .await
            .capacity,
        70_000,
        "every scope on the plan moves"
    );

    // Another period is another window: its history starts empty, but the
    // live hold still counts in full.
    let longer = Window::Sliding {
        period_ms: 2 * HOUR_MS,
        slices: 120,
    };
    let plan = Plan::new(
        "tenant",
        vec![limit(Dimension::TOKENS, 70_000, longer)],
        OverrunPolicy::ChargeActual,
    )
    .expect("a valid plan");
    change(&h, CatalogChange::SetPlan(plan)).await;
    assert_eq!(
        h.figures("tenant:acme", "tokens", WindowKind::Sliding)
            .await,
        (0, 10_000, 60_000)
    );
    h.set_ms(MINUTE_MS);
    let s = h.settle(live, &usage(tokens(9_000))).await;
    assert_eq!(
        s.charged,
        Some(tokens(9_000)),
        "a reservation outlives a plan change"
    );
    assert_eq!(
        h.figures("tenant:acme", "tokens", WindowKind::Sliding)
            .await,
        (9_000, 0, 61_000),
        "its usage lands in the new window"
    );
}

/// A sliding limit whose slices alone change keeps its history (SEMANTICS:
/// the dimension, window and period are unchanged), cut into the new
/// slices: each old slice's usage counts as if used at the last instant
/// that slice could have held it (at most now), then leaves as the new
/// window lets it. (Found by an audit: the history was dropped, so a scope
/// could spend its capacity again within the period.)
pub(crate) async fn plan_change_reslices_a_sliding_window(h: Harness) {
    let sliding = |slices| {
        let plan = Plan::new(
            "tenant",
            vec![limit(
                Dimension::TOKENS,
                100_000,
                Window::Sliding {
                    period_ms: HOUR_MS,
                    slices,
                },
            )],
            OverrunPolicy::ChargeActual,
        )
        .expect("a valid plan");
        CatalogChange::SetPlan(plan)
    };
    let figures = async || {
        h.figures("tenant:acme", "tokens", WindowKind::Sliding)
            .await
    };
    change(&h, sliding(60)).await;
    h.spend("acme", &[], tokens(30_000)).await;
    h.set_ms(25 * MINUTE_MS);
    h.spend("acme", &[], tokens(20_000)).await;

    // Coarser: 6 slices of 10 minutes.
    // A plan change reaches the scope's history at its next write (see the
    // next case): a granted reserve at minute 30.
    h.set_ms(30 * MINUTE_MS);
    change(&h, sliding(6)).await;
    let moved = h.hold("acme", &[], tokens(1)).await;
    h.refund(moved).await;
    assert_eq!(figures().await, (50_000, 0, 50_000), "the history is kept");
    let d = h.deny(&h.request("acme", &[], tokens(50_001)).await).await;
    assert_eq!((d.kind, d.remaining), (DenialKind::RateLimited, 50_000));
    // 30,000 (minute 0) in the slice of minutes 0–10, 20,000 (minute 25)
    // in that of minutes 20–30: they leave at minutes 60 and 80.
    h.set_ms(60 * MINUTE_MS - 1);
    assert_eq!(figures().await.0, 50_000);
    h.set_ms(60 * MINUTE_MS);
    assert_eq!(figures().await.0, 20_000);
    h.set_ms(80 * MINUTE_MS);
    assert_eq!(figures().await.0, 0);

    // Finer: 60 slices again. 10,000 used at minute 85 (in the slice of
    // minutes 80–90, the current one at minute 86) count as used at minute
    // 86, so they stay a whole period after they were used.
    h.set_ms(85 * MINUTE_MS);
    h.spend("acme", &[], tokens(10_000)).await;
    h.set_ms(86 * MINUTE_MS);
    change(&h, sliding(60)).await;
    let moved = h.hold("acme", &[], tokens(1)).await;
    h.refund(moved).await;
    assert_eq!(figures().await, (10_000, 0, 90_000));
    h.set_ms(146 * MINUTE_MS - 1);
    assert_eq!(figures().await.0, 10_000);
    h.set_ms(146 * MINUTE_MS);
    assert_eq!(figures().await.0, 0);
}

/// A plan change reaches a scope's history at the scope's next write (a
/// granted reserve, a settle, a growing extend, an adjustment): until then
/// the plan it was on governs, so a bucket whose capacity falls refills at
/// its old rate up to that write. Reads, denials, dry runs, refunds and
/// extends that only move an expiry show the new plan but move nothing:
/// a store rebuilt from its log, or one whose reads write nothing, answers
/// the same whatever was read in between.
pub(crate) async fn plan_change_reaches_a_scope_at_its_next_write(h: Harness) {
    let bob = [("user", "bob")];
    let user = "tenant:acme/user:bob";
    // Two requests of 60 a minute: back at one a second.
    h.spend("acme", &bob, tokens(10)).await;
    h.spend("acme", &bob, tokens(10)).await;
    let held = h.hold("acme", &bob, tokens(10)).await;
    h.set_ms(500);
    h.status(user).await;
    let five = requests_per_minute("user", 5);
    change(&h, CatalogChange::SetPlan(five)).await;
    h.set_ms(550);
    assert_eq!(
        h.limit(user, "requests", WindowKind::Bucket).await.capacity,
        5,
        "a read shows the new plan at once"
    );
    // More than the tenant's whole hourly budget: refused after every
    // scope was checked.
    h.deny(&h.request("acme", &bob, tokens(1_000_000)).await)
        .await;
    let mut dry = h.request("acme", &bob, tokens(10)).await;
    dry.dry_run = true;
    assert!(h.reserve(&dry).await.dry_run);
    h.extend(held, None, Some(60_000)).await;
    h.refund(held).await;
    h.set_ms(600);
    // 0.6 of a request back at the old rate: 2 still used (rounded up);
    // the other 1.4 at 5 a minute, 16.8 s.
    let l = h.limit(user, "requests", WindowKind::Bucket).await;
    assert_eq!(
        (l.used, l.resets_at),
        (2, Some(crate::support::at(600 + 16_800))),
        "nothing but a write moves the scope to its new rate"
    );
    // A write at 600 ms: 2 − 0.6 + 1 = 2.4 requests, back at 5 a minute.
    h.spend("acme", &bob, tokens(10)).await;
    h.set_ms(1_600);
    let l = h.limit(user, "requests", WindowKind::Bucket).await;
    assert_eq!(
        (l.used, l.resets_at),
        (3, Some(crate::support::at(600 + 28_800))),
        "a write moves the scope: the new rate from there"
    );
}

/// The overrun policy is fixed at reserve: a plan change does not alter a
/// live reservation's promise, and governs the next one.
pub(crate) async fn plan_change_keeps_live_promises(h: Harness) {
    let before = h.hold("acme", &[], tokens(1000)).await;
    let capped = Plan::new(
        "tenant",
        vec![
            limit(Dimension::TOKENS, 100_000, hour()),
            limit(Dimension::COST_MICROS, 10_000_000, Window::Total),
            limit(Dimension::CONCURRENT, 8, Window::Concurrent),
        ],
        OverrunPolicy::CapAtEstimate,
    )
    .expect("a valid plan");
    change(&h, CatalogChange::SetPlan(capped)).await;
    let after = h.hold("acme", &[], tokens(1000)).await;

    let s = h.settle(before, &usage(tokens(1500))).await;
    assert_eq!(
        (s.overrun, s.charged),
        (OverrunPolicy::ChargeActual, Some(tokens(1500))),
        "reserved under charge_actual"
    );
    let s = h.settle(after, &usage(tokens(1500))).await;
    assert_eq!(
        (s.overrun, s.charged),
        (OverrunPolicy::CapAtEstimate, Some(tokens(1000))),
        "reserved under cap_at_estimate"
    );
}

/// One scope can be given its own limits or another plan, and returned to
/// its kind's default; history is kept across both where the limit is the
/// same.
/// A plan set through the admin API and then reverted is the catalog's
/// own again (the configuration file's: what the store was made with), for
/// the next operation of every scope on it; a plan the configuration does
/// not have has nothing to return to.
pub(crate) async fn revert_plan_returns_to_the_configuration(h: Harness) {
    let configured = h
        .store
        .catalog()
        .await
        .expect("catalog")
        .plan("user")
        .expect("the standard catalog's user plan")
        .clone();
    change(&h, CatalogChange::SetPlan(requests_per_minute("user", 2))).await;
    let st = h.status("tenant:acme/user:bob").await;
    assert_eq!((st.plan.as_str(), st.limits.len()), ("user", 1));
    change(&h, CatalogChange::RevertPlan("user".into())).await;
    let catalog = h.store.catalog().await.expect("catalog");
    assert_eq!(
        catalog.plan("user").map(|p| p.limits().to_vec()),
        Some(configured.limits().to_vec()),
        "the configuration's plan again"
    );
    let st = h.status("tenant:acme/user:bob").await;
    assert_eq!(st.limits.len(), configured.limits().len());
    // Reverting again changes nothing.
    change(&h, CatalogChange::RevertPlan("user".into())).await;
    match h
        .store
        .change_catalog(&CatalogChange::RevertPlan("api-only".into()))
        .await
    {
        Err(StoreError::Rejected(AdminError::NotFound(_))) => {}
        other => panic!("a plan the configuration lacks: {other:?}"),
    }
}

pub(crate) async fn override_and_clear(h: Harness) {
    let bob = key("tenant:acme/user:bob");
    let two_a_minute = requests_per_minute("bob-special", 2);
    change(
        &h,
        CatalogChange::SetOverride(bob.clone(), Override::Limits(two_a_minute)),
    )
    .await;
    let st = h.status("tenant:acme/user:bob").await;
    assert_eq!(
        (st.plan.as_str(), st.limits[0].capacity),
        ("bob-special", 2)
    );

    h.spend("acme", &[("user", "bob")], tokens(10)).await;
    h.spend("acme", &[("user", "bob")], tokens(10)).await;
    let d = h
        .deny(&h.request("acme", &[("user", "bob")], tokens(10)).await)
        .await;
    assert_eq!(
        (d.kind, d.scope.as_str(), d.capacity),
        (DenialKind::RateLimited, "tenant:acme/user:bob", 2),
        "bob's own limits apply"
    );
    h.spend("acme", &[("user", "carol")], tokens(10)).await; // carol keeps the default

    change(&h, CatalogChange::ClearOverride(bob.clone())).await;
    let st = h.status("tenant:acme/user:bob").await;
    assert_eq!(st.plan, "user", "back on the kind's default plan");
    assert_eq!(
        h.figures("tenant:acme/user:bob", "requests", WindowKind::Bucket)
            .await,
        (2, 0, 58),
        "the same bucket: history kept"
    );
    h.spend("acme", &[("user", "bob")], tokens(10)).await;

    // A tenant moved to another plan by name.
    change(
        &h,
        CatalogChange::SetOverride(key("tenant:acme"), Override::Plan("plus".into())),
    )
    .await;
    let st = h.status("tenant:acme").await;
    assert_eq!(st.plan, "plus");
    let big = h.hold("acme", &[], tokens(150_000)).await;
    assert_eq!(
        h.figures("tenant:acme", "tokens", WindowKind::Sliding)
            .await,
        (40, 150_000, 49_960),
        "usage kept across the move"
    );
    h.refund(big).await;
    change(&h, CatalogChange::ClearOverride(key("tenant:acme"))).await;
    assert_eq!(h.status("tenant:acme").await.plan, "tenant");

    // Errors name what is wrong and change nothing.
    match h
        .store
        .change_catalog(&CatalogChange::ClearOverride(bob.clone()))
        .await
    {
        Err(StoreError::Rejected(AdminError::NotFound(_))) => {}
        other => panic!("clearing an absent override should be not found, got {other:?}"),
    }
    let missing = CatalogChange::SetOverride(bob.clone(), Override::Plan("no-such-plan".into()));
    match h.store.change_catalog(&missing).await {
        Err(StoreError::Rejected(AdminError::NotFound(_))) => {}
        other => panic!("an override to a missing plan should be not found, got {other:?}"),
    }
    for bad in ["tenant:acme/team:x", "tenant:acme/tool:search", "user:bob"] {
        let c = CatalogChange::SetOverride(key(bad), Override::Plan("plus".into()));
        match h.store.change_catalog(&c).await {
            Err(StoreError::Rejected(AdminError::Invalid(_))) => {}
            other => panic!("an override on {bad} should be invalid, got {other:?}"),
        }
    }
    assert_eq!(h.status("tenant:acme/user:bob").await.plan, "user");
}

/// `adjust` on a total: a credit gives room back (usage falls, even below
/// zero), a debit takes it (remaining may go negative).
pub(crate) async fn adjust_total(h: Harness) {
    let t = key("tenant:acme");
    h.spend("acme", &[], cost(9_500_000)).await;
    let d = h.deny(&h.request("acme", &[], cost(1_000_000)).await).await;
    assert_eq!(
        (d.kind, d.remaining),
        (DenialKind::BudgetExhausted, 500_000)
    );

    let st = h
        .store
        .adjust(&t, Dimension::COST_MICROS, 1_000_000, "conformance")
        .await
        .expect("a credit");
    assert_eq!(
        st,
        h.status("tenant:acme").await,
        "adjust answers the scope's status"
    );
    assert_eq!(
        h.figures("tenant:acme", "cost_micros", WindowKind::Total)
            .await,
        (8_500_000, 0, 1_500_000),
        "a credit: usage falls"
    );
    h.hold("acme", &[], cost(1_000_000)).await;

    h.store
        .adjust(&t, Dimension::COST_MICROS, -2_000_000, "conformance")
        .await
        .expect("a debit");
    assert_eq!(
        h.figures("tenant:acme", "cost_micros", WindowKind::Total)
            .await,
        (10_500_000, 1_000_000, -1_500_000),
        "a debit: usage rises, room may go negative"
    );
    let d = h.deny(&h.request("acme", &[], cost(1)).await).await;
    assert_eq!(
        (d.kind, d.remaining),
        (DenialKind::BudgetExhausted, -1_500_000)
    );

    // A prepaid top-up on an unused budget: room beyond the capacity,
    // though no single request above the capacity.
    h.store
        .adjust(
            &key("tenant:beta/task:t1"),
            Dimension::COST_MICROS,
            500_000,
            "conformance",
        )
        .await
        .expect("a credit");
    assert_eq!(
        h.figures("tenant:beta/task:t1", "cost_micros", WindowKind::Total)
            .await,
        (-500_000, 0, 1_500_000)
    );
    h.hold("beta", &[("task", "t1")], cost(1_000_000)).await;
    h.hold("beta", &[("task", "t1")], cost(400_000)).await;
    let d = h
        .deny(&h.request("beta", &[("task", "t1")], cost(1_000_001)).await)
        .await;
    assert_eq!(d.kind, DenialKind::ExceedsLimit);

    // Only a total limit takes an adjustment.
    match h
        .store
        .adjust(&t, Dimension::TOKENS, 1_000, "conformance")
        .await
    {
        Err(StoreError::Rejected(AdminError::NotFound(_))) => {}
        other => panic!("tokens have no total limit on {t}: expected not found, got {other:?}"),
    }
}
