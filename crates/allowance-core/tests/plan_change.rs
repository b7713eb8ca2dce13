//! A plan change moves a scope to its new plan at the scope's next
//! journaled operation (a granted reserve, a growing extend, a settle, an
//! adjustment), and the plan it was on governs until then; reads, denials
//! and dry runs look at a copy. So what a scope remembers is a function of
//! the journaled operations alone, the same in a store rebuilt from its
//! log and in the Redis store (whose reads write nothing).
//!
//! These were found by `allowance-redis/tests/differential.rs`: a read
//! used to move the scope, so it decided
//! - where a bucket whose capacity changed gave up its old refill rate, and
//! - whether a limit whose window changed and changed back kept its usage.

use std::sync::Arc;

use allowance_core::{
    Amounts, Catalog, CatalogChange, Dimension, EmbeddedStore, Limit, ManualClock, OverrunPolicy,
    Plan, ReserveRequest, SeededIds, Settings, Store, Timestamp, Usage, Window,
};

const T0_MS: u64 = 1_767_225_600_000;
const MINUTE_MS: u64 = 60_000;

fn user_plan(requests_per_minute: u64) -> Arc<Plan> {
    let limit = Limit::new(
        Dimension::REQUESTS,
        requests_per_minute,
        Window::Bucket {
            period_ms: MINUTE_MS,
        },
    )
    .expect("valid limit");
    Plan::new("user", vec![limit], OverrunPolicy::ChargeActual).expect("valid plan")
}

fn catalog() -> Catalog {
    let mut c = Catalog::new(Settings::default()).expect("valid settings");
    let tenant = Limit::new(Dimension::TOKENS, 1_000_000, Window::Total).expect("valid limit");
    c.set_plan(Plan::new("tenant", vec![tenant], OverrunPolicy::ChargeActual).expect("valid plan"));
    c.set_plan(user_plan(60));
    c.set_kind("tenant", Some("tenant"), false)
        .expect("plan exists");
    c.set_kind("user", Some("user"), false)
        .expect("plan exists");
    c
}

/// What happens to the user scope around its plan's change.
#[derive(Clone, Copy, Debug)]
enum Between {
    Nothing,
    /// A read at 500 ms, before the change.
    ReadBefore,
    /// At 550 ms, after the change: a read, a denied reserve, a dry run.
    ReadAfter,
    Denial,
    DryRun,
    /// At 550 ms: a granted reserve, settled (journaled: the scope moves).
    Write,
}

/// Two requests at 0 ms under 60 a minute; at 500 ms the plan becomes 5 a
/// minute; the bucket's `used` and reset read at 600 ms (ms from start).
async fn bucket_after_change(between: Between) -> (i64, Option<u64>) {
    let c = catalog();
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(T0_MS)));
    let store = EmbeddedStore::new(c.clone(), 4, clock.clone(), Arc::new(SeededIds::new(1)));
    let scopes = c.scope_set("acme", &[("user", "bob")]).expect("valid");
    let user = scopes.as_slice()[1].clone();
    let req = ReserveRequest::new(scopes.clone(), Amounts::new().with(Dimension::TOKENS, 10));
    let call = async |req: &ReserveRequest| {
        let granted = store.reserve(req).await.expect("granted");
        store
            .settle(granted.id, &Usage::default())
            .await
            .expect("settled");
    };
    call(&req).await;
    call(&req).await;
    clock.advance_ms(500);
    if let Between::ReadBefore = between {
        store.status(&user).await.expect("status");
    }
    store
        .change_catalog(&CatalogChange::SetPlan(user_plan(5)))
        .await
        .expect("plan changed");
    clock.advance_ms(50);
    match between {
        Between::Nothing | Between::ReadBefore => {}
        Between::ReadAfter => {
            store.status(&user).await.expect("status");
        }
        Between::Denial => {
            // More than the tenant's whole budget: refused, after every
            // scope was checked.
            let huge = ReserveRequest::new(
                scopes.clone(),
                Amounts::new().with(Dimension::TOKENS, 2_000_000),
            );
            store.reserve(&huge).await.expect_err("denied");
        }
        Between::DryRun => {
            let mut dry = req.clone();
            dry.dry_run = true;
            assert!(store.reserve(&dry).await.expect("fits").dry_run);
        }
        Between::Write => call(&req).await,
    }
    clock.advance_ms(50);
    let status = store.status(&user).await.expect("status");
    let limit = &status.limits[0];
    (limit.used, limit.resets_at.map(|t| t.as_millis() - T0_MS))
}

#[tokio::test]
async fn a_bucket_refills_at_its_old_rate_until_the_scope_is_next_written() {
    // 2 requests back at 1 a second: 0.6 of one by 600 ms, so 2 are still
    // used (rounded up); the rest, 1.4 requests at 5 a minute, 16.8 s more.
    let expected = (2, Some(600 + 16_800));
    for between in [
        Between::Nothing,
        Between::ReadBefore,
        Between::ReadAfter,
        Between::Denial,
        Between::DryRun,
    ] {
        assert_eq!(
            bucket_after_change(between).await,
            expected,
            "{between:?} must not move the scope to its new plan"
        );
    }
}

#[tokio::test]
async fn a_write_moves_the_scope_to_its_new_plan() {
    // At 550 ms: 2 − 0.55 back at the old rate, plus the new request =
    // 2.45; then 5 a minute: 0.00417 back by 600 ms, 2.4458 left, back in
    // 29.35 s.
    assert_eq!(
        bucket_after_change(Between::Write).await,
        (3, Some(600 + 29_350))
    );
}

fn agent_plan(window: Window) -> Arc<Plan> {
    let limit = Limit::new(Dimension::TOKENS, 20_000, window).expect("valid limit");
    Plan::new("agent", vec![limit], OverrunPolicy::ChargeActual).expect("valid plan")
}

/// 500 tokens used under a calendar day; the plan becomes a bucket, then
/// the calendar day again (a read in between, or not). Returns the day's
/// `used`.
async fn used_after_round_trip(read_between: bool) -> i64 {
    let day = Window::Calendar {
        unit: allowance_core::CalendarUnit::Day,
        zone: allowance_core::Zone::utc(),
    };
    let mut c = catalog();
    c.set_plan(agent_plan(day.clone()));
    c.set_kind("agent", Some("agent"), false)
        .expect("plan exists");
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(T0_MS)));
    let store = EmbeddedStore::new(c.clone(), 4, clock.clone(), Arc::new(SeededIds::new(1)));
    let scopes = c.scope_set("acme", &[("agent", "a1")]).expect("valid");
    let agent = scopes.as_slice()[1].clone();
    let req = ReserveRequest::new(scopes, Amounts::new().with(Dimension::TOKENS, 10));
    let granted = store.reserve(&req).await.expect("granted");
    let usage = Usage {
        amounts: Amounts::new().with(Dimension::TOKENS, 500),
        ..Usage::default()
    };
    store.settle(granted.id, &usage).await.expect("settled");
    let bucket = Window::Bucket {
        period_ms: 60 * MINUTE_MS,
    };
    store
        .change_catalog(&CatalogChange::SetPlan(agent_plan(bucket)))
        .await
        .expect("plan changed");
    if read_between {
        store.status(&agent).await.expect("status");
    }
    store
        .change_catalog(&CatalogChange::SetPlan(agent_plan(day)))
        .await
        .expect("plan changed back");
    store.status(&agent).await.expect("status").limits[0].used
}

#[tokio::test]
async fn a_plan_changed_and_changed_back_before_a_write_keeps_the_history() {
    // Never written under the bucket, the scope never left the day.
    assert_eq!(used_after_round_trip(false).await, 500);
    assert_eq!(
        used_after_round_trip(true).await,
        500,
        "a read between the changes must not decide what is kept"
    );
}

/// A scope the configuration gives an override of its own (the gateway's
/// `upstream:<name>` with the provider's limits) returns to that override
/// when an admin override is cleared, not to its kind's plan (found by an
/// audit: the provider's limits were gone until a restart).
#[tokio::test]
async fn clearing_an_override_returns_to_the_file_s_own() {
    let mut c = catalog();
    let user = c
        .scope_set("acme", &[("user", "bob")])
        .expect("valid")
        .as_slice()[1]
        .clone();
    let configured = allowance_core::Override::Limits(user_plan(7));
    c.set_override(user.clone(), configured.clone())
        .expect("an override");
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(T0_MS)));
    let store = EmbeddedStore::new(c, 4, clock, Arc::new(SeededIds::new(1)));
    let capacity = async || store.status(&user).await.expect("status").limits[0].capacity;
    assert_eq!(capacity().await, 7);
    store
        .change_catalog(&CatalogChange::SetOverride(
            user.clone(),
            allowance_core::Override::Limits(user_plan(3)),
        ))
        .await
        .expect("an admin override");
    assert_eq!(capacity().await, 3);
    store
        .change_catalog(&CatalogChange::ClearOverride(user.clone()))
        .await
        .expect("cleared");
    assert_eq!(capacity().await, 7, "back to the file's override");
}
