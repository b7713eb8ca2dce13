//! The [`Store`] abstraction the server calls, so the embedded ledger and
//! Redis are interchangeable, and the embedded implementation of it.
//!
//! A store owns its clock and its id source: in production the clock is the
//! wall (or Redis `TIME`), in tests a [`ManualClock`], so one conformance
//! suite drives every store the same way.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;

use crate::catalog::{Catalog, Override};
use crate::error::{AdminError, ExtendError, RefundError, ReserveError, SettleError};
use crate::model::ModelPrice;
use crate::plan::Plan;
use crate::reservation::{Granted, Reservation, ReservationId, ReserveRequest, ScopeStatus, Usage};
use crate::scope::ScopeKey;
use crate::shared::{Committed, Journal, SharedLedger};
use crate::units::{Amounts, Dimension, Timestamp};
use crate::usage::{MAX_USAGE_PAGE, UsageEvent, UsagePage, UsageRecord};

/// A source of the current instant.
pub trait Clock: Send + Sync + 'static {
    /// Now, in ms since the epoch.
    fn now(&self) -> Timestamp;
}

/// A clock that moves only when told to: for tests and benchmarks.
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    /// A clock showing `at`.
    pub fn new(at: Timestamp) -> Self {
        ManualClock(AtomicU64::new(at.as_millis()))
    }

    /// Moves the clock forward by `ms`.
    pub fn advance_ms(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }

    /// Sets the clock.
    pub fn set(&self, at: Timestamp) {
        self.0.store(at.as_millis(), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.0.load(Ordering::SeqCst))
    }
}

/// A source of 128 random bits per reservation id.
pub trait IdSource: Send + Sync + 'static {
    /// 128 bits, at least 120 of them unpredictable in production.
    fn next_random(&self) -> u128;
}

/// Deterministic ids (SplitMix64 from a seed): for tests and replays only —
/// they are guessable.
#[derive(Debug, Default)]
pub struct SeededIds(AtomicU64);

impl SeededIds {
    /// Ids from `seed`.
    pub fn new(seed: u64) -> Self {
        SeededIds(AtomicU64::new(seed))
    }
}

impl IdSource for SeededIds {
    fn next_random(&self) -> u128 {
        let mix = |mut z: u64| {
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        // Two golden-ratio steps per id (2 × 0x9e37_79b9_7f4a_7c15, wrapped).
        let s = self.0.fetch_add(0x3c6e_f372_fe94_f82a, Ordering::Relaxed);
        (u128::from(mix(s)) << 64) | u128::from(mix(s.wrapping_add(0x9e37_79b9_7f4a_7c15)))
    }
}

/// A store could not answer: the outcome is unknown (HTTP 503). Retry a
/// reserve with the same idempotency key, a settle or refund as is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("store unavailable: {0}")]
pub struct Unavailable(pub String);

/// An operation's own error, or the store's failure to answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError<E> {
    /// The ledger answered with a refusal or an error.
    #[error(transparent)]
    Rejected(E),
    /// The store did not answer.
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
}

/// Counters a server exports as metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Reservations HELD now.
    pub held_reservations: u64,
    /// Reservations expired since the store started.
    pub expired_total: u64,
}

/// What a store that answers on its own during an outage of the store
/// behind it (`on_error = "fail_open_local"`) reports, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FailOpenStats {
    /// Whether it answers reserves on its own ledger now (an outage, or
    /// the hand-over after one).
    pub answering_locally: bool,
    /// Reservations it admitted on its own ledger since it started.
    pub admitted_locally_total: u64,
    /// Of those, the ones reconciled into the store behind it.
    pub imported_total: u64,
    /// Those not reconciled yet.
    pub pending_reconciliation: u64,
}

/// An admin change to the catalog.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub enum CatalogChange {
    /// Define or replace a plan.
    SetPlan(Arc<Plan>),
    /// Move a scope to a plan, or give it its own limits.
    SetOverride(ScopeKey, Override),
    /// Return a scope to its kind's default plan (with
    /// [`apply_on`](CatalogChange::apply_on): to the configuration file's
    /// override of it, where the file has one).
    ClearOverride(ScopeKey),
    /// Define or replace a model's prices.
    SetModel(String, ModelPrice),
    /// Register a custom dimension (a no-op when it exists). A plan built
    /// against a copy of the catalog names its custom dimensions by number:
    /// add them first, in the same order, with admin changes serialized.
    AddDimension(String),
    /// Return a plan to the configuration file's version: what the admin
    /// API set for it no longer wins over the file (SEMANTICS: "until
    /// deleted"). A plan the file does not have is not found.
    RevertPlan(String),
}

impl CatalogChange {
    /// Applies the change to a catalog, `configured` being the
    /// configuration file's (what [`CatalogChange::RevertPlan`] returns to).
    pub fn apply_on(&self, c: &mut Catalog, configured: &Catalog) -> Result<(), AdminError> {
        match self {
            CatalogChange::RevertPlan(name) => {
                let plan = configured.plan(name).ok_or_else(|| {
                    AdminError::NotFound(format!("plan {name:?} in the configuration file"))
                })?;
                known_dimensions(c, plan)?;
                c.set_plan(plan.clone());
                Ok(())
            }
            // A scope the file gives an override of its own (an upstream's
            // limits, from its settings) returns to that, not to its kind's
            // plan: clearing an API override must not drop the provider's
            // limits until a restart (found by an audit).
            CatalogChange::ClearOverride(s) => match configured.override_of(s) {
                Some(o) => c.set_override(s.clone(), o.clone()),
                None => self.apply(c),
            },
            other => other.apply(c),
        }
    }

    /// Applies the change to a catalog. [`CatalogChange::RevertPlan`] needs
    /// the configuration file's catalog: use [`CatalogChange::apply_on`].
    pub fn apply(&self, c: &mut Catalog) -> Result<(), AdminError> {
        match self {
            CatalogChange::RevertPlan(_) => Err(AdminError::Invalid(crate::error::Invalid::new(
                "plan",
                "returning a plan to the file's version needs the configuration file's catalog",
            ))),
            CatalogChange::SetPlan(p) => {
                known_dimensions(c, p)?;
                c.set_plan(p.clone());
                Ok(())
            }
            CatalogChange::SetOverride(s, o) => {
                if let Override::Limits(p) = o {
                    known_dimensions(c, p)?;
                }
                c.set_override(s.clone(), o.clone())
            }
            CatalogChange::ClearOverride(s) => {
                if c.clear_override(s) {
                    Ok(())
                } else {
                    Err(AdminError::NotFound(format!("an override for {s}")))
                }
            }
            CatalogChange::SetModel(n, p) => c.set_model(n, p.clone()).map_err(AdminError::Invalid),
            CatalogChange::AddDimension(name) => c
                .add_dimension(name)
                .map(|_| ())
                .map_err(AdminError::Invalid),
        }
    }
}

/// Refuses a plan naming a dimension this catalog does not have (it was
/// built against another catalog).
fn known_dimensions(c: &Catalog, plan: &Plan) -> Result<(), AdminError> {
    for (i, l) in plan.limits().iter().enumerate() {
        if c.dimension_name(l.dimension()) == "unknown" {
            return Err(AdminError::Invalid(crate::error::Invalid::new(
                format!("limits[{i}].dimension"),
                "a custom dimension the catalog does not have: add it first",
            )));
        }
    }
    Ok(())
}

/// When a change a store has applied is durable: see
/// [`Store::settle_decided`].
#[must_use = "a decided change is acknowledged only once durable"]
pub struct Durable(Option<DurableWait>);

/// The wait behind a pending [`Durable`].
type DurableWait = Pin<Box<dyn Future<Output = Result<(), Unavailable>> + Send>>;

impl Durable {
    /// Durable already.
    pub fn now() -> Durable {
        Durable(None)
    }

    /// Durable when `wait` resolves `Ok`; never, if it fails.
    pub fn when(wait: impl Future<Output = Result<(), Unavailable>> + Send + 'static) -> Durable {
        Durable(Some(Box::pin(wait)))
    }

    /// Whether there is nothing to wait for.
    pub fn is_now(&self) -> bool {
        self.0.is_none()
    }

    /// Waits until the change is durable; `Err` when it never will be (the
    /// store failed: treat the change as an unavailable store's).
    pub async fn wait(self) -> Result<(), Unavailable> {
        match self.0 {
            Some(wait) => wait.await,
            None => Ok(()),
        }
    }
}

impl std::fmt::Debug for Durable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Durable(pending)"
        } else {
            "Durable(now)"
        })
    }
}

/// What a server needs from a ledger store. Every operation is atomic and
/// linearizable; time and ids come from the store.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Holds `req.amounts` on every scope, all or nothing (or answers a dry run).
    async fn reserve(&self, req: &ReserveRequest) -> Result<Granted, StoreError<ReserveError>>;
    /// [`Store::reserve`], answered as soon as the ledger has applied it;
    /// durable when the [`Durable`] resolves. For reservations a caller
    /// makes together and waits for together (a gateway call's own hold
    /// and its place upstream): on the durable store they then share one
    /// group commit. Nothing may act on the grant (call a provider, answer
    /// a client) before its `Durable` resolves `Ok`. Await it: the durable
    /// store does not wake its log's writer for a decided change until
    /// someone waits (a change nobody waits for is written with the next
    /// batch anyone asks for).
    async fn reserve_decided(
        &self,
        req: &ReserveRequest,
    ) -> Result<(Granted, Durable), StoreError<ReserveError>> {
        self.reserve(req).await.map(|g| (g, Durable::now()))
    }
    /// Records usage and releases the hold; idempotent.
    async fn settle(
        &self,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<Reservation, StoreError<SettleError>>;
    /// [`Store::settle`], answered as soon as the ledger has applied it
    /// (later operations see it); durable when the [`Durable`] resolves.
    /// Await it, as [`Store::reserve_decided`]'s.
    async fn settle_decided(
        &self,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<(Reservation, Durable), StoreError<SettleError>> {
        self.settle(id, usage).await.map(|r| (r, Durable::now()))
    }
    /// Releases the hold, records nothing; idempotent.
    async fn refund(&self, id: ReservationId) -> Result<Reservation, StoreError<RefundError>>;
    /// Raises the hold and/or pushes the expiry out.
    async fn extend(
        &self,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Result<Reservation, StoreError<ExtendError>>;
    /// A reservation, expiry observed.
    async fn get(&self, id: ReservationId) -> Result<Option<Reservation>, Unavailable>;
    /// A scope's limits.
    async fn status(&self, scope: &ScopeKey) -> Result<ScopeStatus, Unavailable>;
    /// An admin credit or debit on a scope's `total` limits; `reason` goes
    /// to the usage log with it.
    async fn adjust(
        &self,
        scope: &ScopeKey,
        dimension: Dimension,
        credit: i64,
        reason: &str,
    ) -> Result<ScopeStatus, StoreError<AdminError>>;
    /// The configuration in force.
    async fn catalog(&self) -> Result<Arc<Catalog>, Unavailable>;
    /// Changes the configuration, effective for the next operation.
    async fn change_catalog(&self, change: &CatalogChange) -> Result<(), StoreError<AdminError>>;
    /// Expires what is due (a background sweeper calls this); returns the
    /// number of reservations expired so far.
    async fn expire_due(&self) -> Result<u64, Unavailable>;
    /// Counters for metrics (expiry observed first).
    async fn stats(&self) -> Result<StoreStats, Unavailable>;
    /// The fail-open state of a store that can answer on its own while the
    /// store behind it cannot; `None` (the default) for every other store.
    /// Read from memory: it answers during the outage it describes.
    fn fail_open_stats(&self) -> Option<FailOpenStats> {
        None
    }
    /// Calls `wake` whenever room may have freed through *another*
    /// process sharing this store (a settle, refund or expiry there), so an
    /// admission queue looks again. A store only this process writes has
    /// nothing to report: the default does nothing.
    fn on_room_freed(&self, wake: Arc<dyn Fn() + Send + Sync>) {
        let _ = wake;
    }
    /// Whether other processes change this store's ledger (Redis): room
    /// they free is learnt through [`Store::on_room_freed`], which may miss
    /// a message, so an admission queue also re-checks its waiters within a
    /// bound. A store only this process writes needs no re-check: every
    /// change is this process's own.
    fn is_shared(&self) -> bool {
        false
    }
    /// The usage log after `since` (from the oldest retained record when
    /// `None`), at most `limit` records (capped at [`MAX_USAGE_PAGE`]),
    /// only `tenant`'s when given.
    async fn usage(
        &self,
        since: Option<u64>,
        limit: usize,
        tenant: Option<&str>,
    ) -> Result<UsagePage, Unavailable>;
}

/// How many usage records the in-memory store keeps (the oldest go first):
/// an exporter reading at least this often misses nothing.
pub const MEMORY_USAGE_RECORDS: usize = 100_000;

/// The in-memory usage log: a bounded ring, numbered from 1.
#[derive(Debug, Default)]
struct MemoryUsage {
    records: std::collections::VecDeque<UsageRecord>,
    next_cursor: u64,
}

/// The in-memory store's journal: keeps usage events in the ring. Runs
/// under the ledger's shard locks, so the ring's order is commit order.
struct UsageJournal<'a>(&'a parking_lot::Mutex<MemoryUsage>);

impl Journal for UsageJournal<'_> {
    type Ticket = ();
    const USAGE: bool = true;

    fn commit(&self, _change: &Committed<'_>, usage: Vec<UsageEvent>) {
        if usage.is_empty() {
            return;
        }
        // The oldest records leave the ring after the lock is released:
        // freeing them is most of the work, and every settle of every
        // shard takes this lock.
        let mut evicted: smallvec::SmallVec<[UsageRecord; 2]> = smallvec::SmallVec::new();
        let mut log = self.0.lock();
        for event in usage {
            log.next_cursor += 1;
            let cursor = log.next_cursor;
            if log.records.len() == MEMORY_USAGE_RECORDS {
                evicted.extend(log.records.pop_front());
            }
            log.records.push_back(UsageRecord { cursor, event });
        }
        drop(log);
        drop(evicted);
    }
}

/// A page of `records` (cursor-ordered) after `since`.
pub fn usage_page<'a>(
    records: impl IntoIterator<Item = &'a UsageRecord>,
    since: Option<u64>,
    limit: usize,
    tenant: Option<&str>,
) -> UsagePage {
    let after = since.unwrap_or(0);
    let limit = limit.min(MAX_USAGE_PAGE);
    let mut page = UsagePage {
        records: Vec::new(),
        next_cursor: after,
    };
    for r in records.into_iter().filter(|r| r.cursor > after) {
        if page.records.len() == limit {
            break;
        }
        // A filtered-out record still moves the cursor: the next page
        // starts after everything this one looked at.
        page.next_cursor = r.cursor;
        if tenant.is_none_or(|t| r.event.tenant() == Some(t)) {
            page.records.push(r.clone());
        }
    }
    if page.records.is_empty() {
        // HTTP-API.md: with no new records the cursor repeats.
        page.next_cursor = after;
    }
    page
}

/// The embedded, in-memory store: a [`SharedLedger`] with a clock and ids,
/// and the last [`MEMORY_USAGE_RECORDS`] usage records.
pub struct EmbeddedStore {
    ledger: SharedLedger,
    /// The catalog it was made with (a reverted plan returns to it).
    configured: Arc<Catalog>,
    clock: Arc<dyn Clock>,
    ids: Arc<dyn IdSource>,
    usage: parking_lot::Mutex<MemoryUsage>,
}

impl EmbeddedStore {
    /// A store over a new ledger.
    pub fn new(
        catalog: Catalog,
        shards: usize,
        clock: Arc<dyn Clock>,
        ids: Arc<dyn IdSource>,
    ) -> Self {
        let configured = Arc::new(catalog.clone());
        let ledger = SharedLedger::new(catalog, shards);
        ledger.report_usage();
        EmbeddedStore {
            ledger,
            configured,
            clock,
            ids,
            // Sized once to its bound: growing a ring of this size by
            // doubling copies it all each time, under the journal's lock.
            // (Pages are touched only as records arrive.)
            usage: parking_lot::Mutex::new(MemoryUsage {
                records: std::collections::VecDeque::with_capacity(MEMORY_USAGE_RECORDS),
                next_cursor: 0,
            }),
        }
    }

    /// The ledger inside.
    pub fn ledger(&self) -> &SharedLedger {
        &self.ledger
    }
}

#[async_trait]
impl Store for EmbeddedStore {
    async fn reserve(&self, req: &ReserveRequest) -> Result<Granted, StoreError<ReserveError>> {
        let id = ReservationId::mint(self.ids.next_random(), req.scopes.tenant_name());
        self.ledger
            .reserve_journaled(self.clock.now(), id, req, &self.journal())
            .0
            .map_err(StoreError::Rejected)
    }

    async fn settle(
        &self,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<Reservation, StoreError<SettleError>> {
        self.ledger
            .settle_journaled(self.clock.now(), id, usage, &self.journal())
            .map(|(r, ())| r)
            .map_err(StoreError::Rejected)
    }

    async fn refund(&self, id: ReservationId) -> Result<Reservation, StoreError<RefundError>> {
        self.ledger
            .refund_journaled(self.clock.now(), id, &self.journal())
            .map(|(r, ())| r)
            .map_err(StoreError::Rejected)
    }

    async fn extend(
        &self,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Result<Reservation, StoreError<ExtendError>> {
        self.ledger
            .extend_journaled(self.clock.now(), id, amounts, ttl_ms, &self.journal())
            .map(|(r, ())| r)
            .map_err(StoreError::Rejected)
    }

    async fn get(&self, id: ReservationId) -> Result<Option<Reservation>, Unavailable> {
        Ok(self.ledger.get(self.clock.now(), id))
    }

    async fn status(&self, scope: &ScopeKey) -> Result<ScopeStatus, Unavailable> {
        Ok(self.ledger.status(self.clock.now(), scope))
    }

    async fn adjust(
        &self,
        scope: &ScopeKey,
        dimension: Dimension,
        credit: i64,
        reason: &str,
    ) -> Result<ScopeStatus, StoreError<AdminError>> {
        self.ledger
            .adjust_journaled(
                self.clock.now(),
                scope,
                dimension,
                credit,
                reason,
                &self.journal(),
            )
            .map(|(s, ())| s)
            .map_err(StoreError::Rejected)
    }

    async fn catalog(&self) -> Result<Arc<Catalog>, Unavailable> {
        Ok(self.ledger.catalog())
    }

    async fn change_catalog(&self, change: &CatalogChange) -> Result<(), StoreError<AdminError>> {
        self.ledger
            .update_catalog(|c| change.apply_on(c, &self.configured))
            .map_err(StoreError::Rejected)
    }

    async fn expire_due(&self) -> Result<u64, Unavailable> {
        let expired = self.ledger.expire_due(self.clock.now());
        // Expiries no operation reported yet reach the usage log now.
        if self.ledger.has_unreported_expiries() {
            self.ledger
                .tick_journaled(self.clock.now(), &self.journal());
        }
        Ok(expired)
    }

    async fn stats(&self) -> Result<StoreStats, Unavailable> {
        let expired_total = self.ledger.expire_due(self.clock.now());
        Ok(StoreStats {
            held_reservations: self.ledger.held_reservations() as u64,
            expired_total,
        })
    }

    async fn usage(
        &self,
        since: Option<u64>,
        limit: usize,
        tenant: Option<&str>,
    ) -> Result<UsagePage, Unavailable> {
        let log = self.usage.lock();
        // Cursors are dense: skip straight to the first one after `since`.
        let first = log.records.front().map_or(0, |r| r.cursor);
        let skip = match since {
            Some(s) if s >= first => (s - first + 1) as usize,
            _ => 0,
        };
        Ok(usage_page(
            log.records.iter().skip(skip.min(log.records.len())),
            since,
            limit,
            tenant,
        ))
    }
}

impl EmbeddedStore {
    fn journal(&self) -> UsageJournal<'_> {
        UsageJournal(&self.usage)
    }
}
