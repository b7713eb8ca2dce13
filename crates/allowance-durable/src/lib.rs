//! # allowance-durable — the embedded store that survives `kill -9`
//!
//! A budget ledger that forgets the day's spend on restart hands every
//! tenant a fresh budget. [`DurableStore`] is the in-memory
//! [`SharedLedger`](allowance_core::SharedLedger) with every change logged
//! to a write-ahead log ([`allowance_wal`]) before it is acknowledged:
//!
//! - **commands, not states** — the log holds what changed the ledger
//!   (reserve with its minted id and instant, settle, refund, extend,
//!   adjust, admin changes, the configuration file's catalog); recovery
//!   replays them through the same deterministic engine with the logged
//!   instants, never the wall clock.
//! - **log order = ledger order** — a record is appended while the
//!   operation's shard locks are held (an append only queues; the log's
//!   writer thread does the I/O), so every shard replays in the order it ran.
//! - **durable before the answer** — `fsync = "always"` answers after the
//!   group commit's fdatasync (64 concurrent requests share one).
//! - **fence on failure** — a failed write or fsync turns every answer into
//!   `store_unavailable` while the store rebuilds from disk, which holds
//!   everything acknowledged; it serves again when the disk does.
//! - **snapshots** — every `snapshot_every_records` records the whole
//!   ledger is written and the log before it deleted, bounding recovery.
//! - **the configuration file and the API** — plans, overrides, models and
//!   dimensions set through the admin API survive restarts and win over the
//!   file until cleared; the rest of an edited file takes effect at start.
//!
//! ```
//! use std::sync::Arc;
//! use allowance_core::*;
//! use allowance_durable::{DurableOptions, DurableStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! let mut catalog = Catalog::default();
//! catalog.set_plan(Plan::new("t", vec![Limit::new(Dimension::TOKENS, 1000, Window::Total)?], OverrunPolicy::ChargeActual)?);
//! catalog.set_kind("tenant", Some("t"), false)?;
//! let clock = Arc::new(ManualClock::new(Timestamp::from_millis(1_000)));
//! let open = || DurableStore::open(catalog.clone(), DurableOptions::new(dir.path()),
//!     Arc::new(allowance_wal::RealFs), clock.clone(), Arc::new(SeededIds::new(7)), |_| {});
//! let (store, _) = open().await?;
//! let req = ReserveRequest::new(catalog.scope_set("acme", &[])?, Amounts::new().with(Dimension::TOKENS, 600));
//! let granted = store.reserve(&req).await?;
//! store.settle(granted.id, &Usage { amounts: Amounts::new().with(Dimension::TOKENS, 250), ..Usage::default() }).await?;
//! store.close().await?;
//!
//! let (store, report) = open().await?; // as after a crash: replayed from the log
//! assert_eq!(report.replayed, 3); // the configuration, the reserve, the settle
//! let status = store.status(req.scopes.tenant()).await?;
//! assert_eq!(status.limits[0].remaining, 750);
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_code)]

mod record;
mod store;

pub use record::FORMAT_VERSION;
pub use store::{
    DEFAULT_SNAPSHOT_EVERY_RECORDS, DEFAULT_USAGE_KEEP_RECORDS, DEFAULT_USAGE_SEGMENT_BYTES,
    DurableOptions, DurableStore, OpenError, OpenReport,
};
