//! # allowance-core — the reservation ledger
//!
//! Agents are limited by tokens and money, and the true cost of a call is
//! only known after it ends. So a caller *reserves* an estimate against every
//! scope it touches at once, *settles* the actual afterwards, *refunds* a
//! failed call, and a hold that is never settled *expires*.
//!
//! - **scope** — what a ceiling counts against: `tenant:acme`,
//!   `tenant:acme/user:bob`, or a shared `tool:search`.
//! - **limit** — `(dimension, capacity, window)`; windows are `sliding`,
//!   `bucket`, `calendar`, `total` and the `concurrent` gauge.
//! - **plan** — a named list of limits; each kind of scope has a default.
//! - **hold** — what a HELD reservation keeps from every limit of its scopes.
//! - **denial** — `rate_limited` (retry after…), `budget_exhausted`, or
//!   `exceeds_limit`, naming the scope and limit that said no.
//!
//! The engine is deterministic: every transition takes `now` and reads no
//! clock. [`Ledger`] is the single-threaded state machine; [`SharedLedger`]
//! shares it between threads without a global lock; [`Store`] is what a
//! server calls, so the embedded ledger and Redis are interchangeable.
//!
//! ```
//! use allowance_core::*;
//!
//! // Agents may hold 1,000 tokens an hour, the tenant 1,500 (seed 000).
//! let hour = Window::Sliding { period_ms: 3_600_000, slices: 60 };
//! let mut catalog = Catalog::default();
//! catalog.set_plan(Plan::new("tenant", vec![Limit::new(Dimension::TOKENS, 1500, hour.clone())?], OverrunPolicy::ChargeActual)?);
//! catalog.set_plan(Plan::new("agent", vec![Limit::new(Dimension::TOKENS, 1000, hour)?], OverrunPolicy::ChargeActual)?);
//! catalog.set_kind("tenant", Some("tenant"), false)?;
//! catalog.set_kind("agent", Some("agent"), false)?;
//! let mut ledger = Ledger::new(catalog);
//!
//! let now = Timestamp::from_millis(0);
//! let scopes = ledger.catalog().scope_set("t", &[("agent", "a1")])?;
//! let r1 = ReservationId(1);
//! ledger.reserve(now, r1, &ReserveRequest::new(scopes.clone(), Amounts::new().with(Dimension::TOKENS, 1000)))?;
//!
//! // Another agent has room, the tenant does not: refused, nothing changes.
//! let a2 = ledger.catalog().scope_set("t", &[("agent", "a2")])?;
//! let err = ledger.reserve(now, ReservationId(2), &ReserveRequest::new(a2, Amounts::new().with(Dimension::TOKENS, 600)));
//! let Err(ReserveError::Denied(denial)) = err else { panic!("expected a denial") };
//! assert_eq!((denial.scope.as_str(), denial.kind), ("tenant:t", DenialKind::RateLimited));
//!
//! // Settle the actual 700: 300 come back to the agent, 800 to the tenant.
//! ledger.settle(now, r1, &Usage { amounts: Amounts::new().with(Dimension::TOKENS, 700), ..Usage::default() })?;
//! assert_eq!(ledger.status(now, scopes.tenant()).limits[0].remaining, 800);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]

pub mod calendar;
mod catalog;
mod error;
mod heap;
mod invariants;
mod ledger;
mod limit;
mod model;
mod ops;
mod plan;
mod records;
mod reservation;
mod scope;
mod shard;
mod shared;
mod snapshot;
mod store;
mod sync;
mod units;
mod usage;
mod window;

pub use calendar::{CalendarUnit, Zone};
pub use catalog::{
    Catalog, KindSpec, MAX_CUSTOM_DIMENSIONS, MAX_IDEMPOTENCY_KEY_LEN, MAX_LABEL_KEY_LEN,
    MAX_LABEL_VALUE_LEN, MAX_SCOPES_LIMIT, Override, Settings,
};
pub use error::{
    AdminError, Denial, DenialKind, ExtendError, Invalid, RefundError, ReserveError, SettleError,
};
pub use ledger::Ledger;
pub use limit::{DEFAULT_SLICES, Limit, MAX_PERIOD_MS, MAX_SLICES, Window, WindowKind};
pub use model::{ModelPrice, parse_price_micros};
pub use ops::{
    MAX_CHARGES, PreparedReserve, check_adjust, check_extend, extend_delta, prepare_reserve,
    settle_charges,
};
pub use plan::{MAX_LIMITS_PER_PLAN, OverrunPolicy, Plan};
pub use reservation::{
    Charge, Granted, Labels, LimitStatus, Remaining, Reservation, ReservationId, ReserveRequest,
    ScopeStatus, Status, Usage,
};
pub use scope::{MAX_ID_LEN, MAX_KIND_LEN, ScopeKey, ScopeSet, TENANT_KIND, valid_id, valid_kind};
pub use shared::{Committed, Journal, NoJournal, Outcome, SharedLedger};
pub use snapshot::{LedgerSnapshot, SNAPSHOT_FORMAT, SnapshotError};
pub use store::{
    CatalogChange, Clock, Durable, EmbeddedStore, FailOpenStats, IdSource, MEMORY_USAGE_RECORDS,
    ManualClock, SeededIds, Store, StoreError, StoreStats, Unavailable, usage_page,
};
pub use units::{Amounts, Dimension, MAX_AMOUNT, Timestamp};
pub use usage::{Adjustment, MAX_USAGE_PAGE, UsageEvent, UsageKind, UsagePage, UsageRecord};
