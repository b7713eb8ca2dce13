//! # allowance-conformance — one suite every ledger store runs
//!
//! SEMANTICS.md is the contract of every store (the embedded ledger today,
//! Redis tomorrow). This crate states it as executable cases that drive a
//! store through the [`Store`] trait only, on a [`ManualClock`], so the same
//! scripts hold every store to the same figures.
//!
//! - **case** — a plain `async fn(Harness)` that panics with a message naming
//!   the step that went wrong; [`cases`] lists them all by name.
//! - **catalog** — each case brings its own (see [`catalogs`]): plans with
//!   every window kind, the kinds `tenant`, `user`, `agent`, `task` and the
//!   shared kind `tool`. A case never depends on another's state.
//! - **harness** — the store under test and the clock it reads; the clock
//!   starts at [`START_MS`] and moves only when a case moves it.
//! - **factory** — what a store provides: a fresh, empty store configured by
//!   a catalog and reading `now` from the given clock.
//!
//! Cases never look at ids' values or at a store's internals: they compare
//! reservations, grants, denials and scope statuses by their public fields.
//!
//! ## Plugging a store in
//!
//! Implement [`StoreFactory`]: build an *empty* store from the catalog (a
//! Redis store flushes or prefixes its keys per call so cases stay
//! independent) whose clock is the given [`ManualClock`]. Then run every
//! case, or one test per case so a failure names it:
//!
//! ```rust,no_run
//! use std::sync::Arc;
//!
//! use allowance_conformance::{StoreFactory, cases, run_all, run_case};
//! use allowance_core::{Catalog, EmbeddedStore, ManualClock, SeededIds};
//!
//! struct Embedded;
//!
//! impl StoreFactory for Embedded {
//!     type S = EmbeddedStore;
//!     async fn make(&self, catalog: Catalog, clock: Arc<ManualClock>) -> EmbeddedStore {
//!         EmbeddedStore::new(catalog, 16, clock, Arc::new(SeededIds::new(7)))
//!     }
//! }
//!
//! #[tokio::main]
//! async fn main() {
//!     // Everything at once…
//!     run_all(&Embedded).await;
//!     // …or one case by name (what a `#[tokio::test]` per case calls).
//!     assert!(cases().iter().any(|c| c.name == "seed_000_walkthrough"));
//!     run_case(&Embedded, "seed_000_walkthrough").await;
//! }
//! ```
//!
//! Cases spawn tasks (the race cases) and [`run_case`] runs each case in its
//! own task, so they need a Tokio runtime; a multi-threaded one makes the
//! races real.

#![forbid(unsafe_code)]

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use allowance_core::{Catalog, ManualClock, Store, Timestamp};

mod admin;
mod basics;
pub mod catalogs;
mod denials;
mod idempotency;
mod invalid;
mod lifecycle;
mod race;
mod scopes;
mod support;
mod usage;

pub use catalogs::START_MS;

/// What a store under test provides: a fresh, empty store.
pub trait StoreFactory: Sync {
    /// The store.
    type S: Store;
    /// An empty store configured by `catalog`, reading `now` from `clock`
    /// (and nothing else: the cases move time by moving the clock).
    fn make(
        &self,
        catalog: Catalog,
        clock: Arc<ManualClock>,
    ) -> impl Future<Output = Self::S> + Send;
}

/// The store a case drives, and the clock it reads.
#[derive(Clone)]
pub struct Harness {
    /// The store under test.
    pub store: Arc<dyn Store>,
    /// The store's clock; it starts at [`START_MS`].
    pub clock: Arc<ManualClock>,
}

/// A case's future.
pub type CaseFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// One case of the suite.
#[derive(Clone, Copy)]
pub struct Case {
    /// Its name (a valid Rust identifier, so a test function can bear it).
    pub name: &'static str,
    /// The catalog its store is configured with.
    pub catalog: fn() -> Catalog,
    /// The script; panics with a message naming the failed step.
    pub run: fn(Harness) -> CaseFuture,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Case").field("name", &self.name).finish()
    }
}

/// Builds a [`Case`] from an `async fn(Harness)` and a catalog function.
macro_rules! case {
    ($module:ident :: $name:ident, $catalog:path) => {
        Case {
            name: stringify!($name),
            catalog: $catalog,
            run: |h| Box::pin($module::$name(h)),
        }
    };
}

/// Calls `$m!(case, case, …)` with the name of every case, so a store's
/// test file can make one `#[test]` per case (a failure then names it)
/// without keeping its own copy of the list. `cases()` is the same list at
/// run time; a test comparing the two keeps them in step:
///
/// ```text
/// macro_rules! conformance { ($($case:ident),* $(,)?) => { $( #[tokio::test] async fn $case() { /* run_case(…, stringify!($case)) */ } )* } }
/// allowance_conformance::every_case!(conformance);
/// ```
#[macro_export]
macro_rules! every_case {
    ($m:ident) => {
        $m!(
            reserve_settle_happy_path,
            refund_happy_path,
            settle_with_model_and_charges,
            overrun_policies,
            all_or_nothing,
            seed_000_walkthrough,
            rate_limited_sliding_usage,
            rate_limited_by_holds,
            rate_limited_bucket,
            rate_limited_calendar,
            rate_limited_concurrent,
            rate_limited_total_holds,
            budget_exhausted,
            exceeds_limit,
            denial_precedence,
            retry_waits_for_a_hold_of_the_refused_dimension,
            retry_waits_for_usage_behind_holds,
            budget_exhausted_when_usage_alone_blocks,
            rate_limited_when_holds_alone_block_a_total,
            extend_does_not_wait_for_its_own_hold,
            hold_walk_is_bounded,
            settle_is_idempotent,
            refund_is_idempotent,
            refund_after_settle_conflicts,
            settle_after_refund_conflicts,
            refund_after_expiry_succeeds,
            unknown_reservation,
            late_settle_after_expiry,
            ended_reservations_are_forgotten_after_retention,
            extend_amounts_all_or_nothing,
            extend_ttl,
            extend_not_held,
            decided_settle_answers_as_the_plain_one,
            expiry_observed_by_reads,
            stats_count_held_and_expired,
            usage_log_records_every_end,
            expiry_reported_after_a_long_silence,
            idempotency_key_replays,
            idempotency_key_conflicts,
            denied_attempt_binds_no_key,
            dry_run_changes_nothing,
            dry_run_answers_like_reserve,
            plan_change_keeps_history,
            plan_change_reslices_a_sliding_window,
            plan_change_reaches_a_scope_at_its_next_write,
            plan_change_keeps_live_promises,
            revert_plan_returns_to_the_configuration,
            override_and_clear,
            adjust_total,
            shared_scope_counts_everybody,
            unused_scope_answers_its_plan,
            invalid_reserve_changes_nothing,
            invalid_settle_changes_nothing,
            invalid_extend_and_adjust,
            seed_002_race,
            racing_settles_add_up,
        );
    };
}

/// Every case, in a stable order.
pub fn cases() -> Vec<Case> {
    use catalogs::{race as race_catalog, seed_000, standard};
    vec![
        case!(basics::reserve_settle_happy_path, standard),
        case!(basics::refund_happy_path, standard),
        case!(basics::settle_with_model_and_charges, standard),
        case!(basics::overrun_policies, standard),
        case!(basics::all_or_nothing, standard),
        case!(basics::seed_000_walkthrough, seed_000),
        case!(denials::rate_limited_sliding_usage, standard),
        case!(denials::rate_limited_by_holds, standard),
        case!(denials::rate_limited_bucket, standard),
        case!(denials::rate_limited_calendar, standard),
        case!(denials::rate_limited_concurrent, standard),
        case!(denials::rate_limited_total_holds, standard),
        case!(denials::budget_exhausted, standard),
        case!(denials::exceeds_limit, standard),
        case!(denials::denial_precedence, standard),
        case!(
            denials::retry_waits_for_a_hold_of_the_refused_dimension,
            standard
        ),
        case!(denials::retry_waits_for_usage_behind_holds, standard),
        case!(denials::budget_exhausted_when_usage_alone_blocks, standard),
        case!(
            denials::rate_limited_when_holds_alone_block_a_total,
            standard
        ),
        case!(denials::extend_does_not_wait_for_its_own_hold, standard),
        case!(denials::hold_walk_is_bounded, standard),
        case!(lifecycle::settle_is_idempotent, standard),
        case!(lifecycle::refund_is_idempotent, standard),
        case!(lifecycle::refund_after_settle_conflicts, standard),
        case!(lifecycle::settle_after_refund_conflicts, standard),
        case!(lifecycle::refund_after_expiry_succeeds, standard),
        case!(lifecycle::unknown_reservation, standard),
        case!(lifecycle::late_settle_after_expiry, standard),
        case!(
            lifecycle::ended_reservations_are_forgotten_after_retention,
            standard
        ),
        case!(lifecycle::extend_amounts_all_or_nothing, standard),
        case!(lifecycle::extend_ttl, standard),
        case!(lifecycle::extend_not_held, standard),
        case!(lifecycle::decided_settle_answers_as_the_plain_one, standard),
        case!(lifecycle::expiry_observed_by_reads, standard),
        case!(lifecycle::stats_count_held_and_expired, standard),
        case!(usage::usage_log_records_every_end, standard),
        case!(usage::expiry_reported_after_a_long_silence, standard),
        case!(idempotency::idempotency_key_replays, standard),
        case!(idempotency::idempotency_key_conflicts, standard),
        case!(idempotency::denied_attempt_binds_no_key, standard),
        case!(idempotency::dry_run_changes_nothing, standard),
        case!(idempotency::dry_run_answers_like_reserve, standard),
        case!(admin::plan_change_keeps_history, standard),
        case!(admin::plan_change_reslices_a_sliding_window, standard),
        case!(
            admin::plan_change_reaches_a_scope_at_its_next_write,
            standard
        ),
        case!(admin::plan_change_keeps_live_promises, standard),
        case!(admin::revert_plan_returns_to_the_configuration, standard),
        case!(admin::override_and_clear, standard),
        case!(admin::adjust_total, standard),
        case!(scopes::shared_scope_counts_everybody, standard),
        case!(scopes::unused_scope_answers_its_plan, standard),
        case!(invalid::invalid_reserve_changes_nothing, standard),
        case!(invalid::invalid_settle_changes_nothing, standard),
        case!(invalid::invalid_extend_and_adjust, standard),
        case!(race::seed_002_race, race_catalog),
        case!(race::racing_settles_add_up, standard),
    ]
}

/// The case with this name.
pub fn case(name: &str) -> Option<Case> {
    cases().into_iter().find(|c| c.name == name)
}

/// Runs every case against fresh stores from `factory`, in order; panics
/// naming the first case that fails.
pub async fn run_all<F: StoreFactory>(factory: &F) {
    for c in cases() {
        c.run_on(factory).await;
    }
}

/// Runs the case named `name`; panics if there is none, or naming the case
/// if it fails.
pub async fn run_case<F: StoreFactory>(factory: &F, name: &str) {
    let Some(c) = case(name) else {
        panic!("no conformance case named {name:?}")
    };
    c.run_on(factory).await;
}

impl Case {
    /// Runs this case against a fresh store from `factory`. The case runs in
    /// its own task so its panic can be reported with the case's name.
    pub async fn run_on<F: StoreFactory>(&self, factory: &F) {
        let clock = Arc::new(ManualClock::new(Timestamp::from_millis(START_MS)));
        let store = factory.make((self.catalog)(), clock.clone()).await;
        let harness = Harness {
            store: Arc::new(store),
            clock,
        };
        if let Err(e) = tokio::spawn((self.run)(harness)).await {
            let why = if e.is_panic() {
                let payload = e.into_panic();
                payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "a panic without a message".to_string())
            } else {
                e.to_string()
            };
            panic!("conformance case `{}` failed: {why}", self.name);
        }
    }
}
