//! `on_error = "fail_open_local"`: when Redis cannot answer, admit against
//! a share of every limit, counted in this process, and bring what was
//! admitted into Redis when it answers again.
//!
//! [`FailOpenLocal`] wraps a [`RedisStore`]. Every operation asks Redis
//! first; a reserve (or dry run) that Redis cannot answer
//! ([`StoreError::Unavailable`]) is answered by a **local ledger** instead:
//! an in-memory [`SharedLedger`] on the catalog in force with every limit's
//! capacity scaled to `max(1, floor(capacity × fraction))` — the plans (so
//! each kind's default plan) and the per-scope `Limits` overrides alike.
//! Its denials are real, typed denials (HTTP 429) with the scaled figures.
//! The local ledger is built at the first outage, without I/O, and is
//! rescaled when the catalog in force has changed since.
//!
//! - **Routing** — a settle, refund, extend or get of a reservation
//!   admitted locally goes to the local ledger, wherever Redis stands;
//!   every other id goes to Redis (503 when it is down: the caller retries,
//!   nothing is guessed). A reserve whose idempotency key was first used
//!   locally is answered locally while that reservation is still local, so
//!   a retry during a flapping outage replays rather than admits twice.
//!   `status`, `adjust`, the catalog, `usage` and `stats` are Redis's only.
//! - **During an outage** — once Redis has failed a reserve or the sweeper,
//!   reserves are answered locally without asking Redis (a hung Redis or a
//!   partition would cost each the store's timeout) until the sweeper ends
//!   the outage: Redis must have answered it for [`HANDOVER`] (1 s) and
//!   every reservation still held here must have its shadow hold there.
//!   So this instance never admits in Redis beside a local hold Redis does
//!   not count yet, and every instance that saw the outage leaves the
//!   others' sweepers (every 250 ms) time to shadow theirs first.
//! - **Reconciliation** — [`FailOpenLocal::reconcile`] imports every local
//!   reservation that has ended (settled, refunded, or expired — expiry is
//!   observed by the read) with [`RedisStore::import_ended`], idempotent by
//!   id, and forgets it locally only once Redis has confirmed the import;
//!   from then on its id is Redis's (a replayed get or settle keeps
//!   answering, from the imported record; a late settle of an imported
//!   expired reservation is recorded by Redis). [`Store::expire_due`], which
//!   the server's sweeper calls every 250 ms, runs it after Redis's own
//!   sweep succeeds, so it happens as soon as Redis answers again. A HELD
//!   local reservation stays local until it ends, but Redis counts its room
//!   meanwhile: the same sweep gives it a shadow hold there
//!   ([`RedisStore::shadow`]: its amounts on its scopes until its expiry,
//!   sent again after a local extend), which its import replaces — so
//!   other instances admit only what is left beside it. While an expired
//!   reservation is being imported, a (late) settle of it answers 503 for
//!   that moment, so the import never misses it.
//! - **What Redis sees** — local usage counts in Redis's windows from the
//!   instant it was used (a sliding window in that instant's slice, a
//!   calendar window only if it is in the current period; a bucket as of
//!   the import, its refill since not credited); the usage log gets one
//!   record per reservation ended locally, with its own end instant. An idempotency key comes along: a
//!   retried reserve with it replays the imported reservation (unless
//!   Redis gave the key to a live reservation of its own meanwhile). The
//!   local ledger starts empty: it
//!   does not know what Redis had counted before the outage, so during an
//!   outage each process may admit up to `fraction` of every capacity on
//!   top of it (that is the policy).
//! - **Durability, honestly** — the local ledger is in memory. If this
//!   process dies while Redis is down, what it admitted and settled locally
//!   and has not imported yet is **lost**: those settles were answered 200
//!   and never reach the ledger. `fail_open_local` trades that guarantee
//!   for availability during an outage; `fail_closed` keeps it.
//!
//! - **Starting without Redis** — over a store made by
//!   [`RedisStore::connect_later`] (what `allowance serve` does under this
//!   policy when Redis cannot be reached at start), every reserve is local
//!   until the sweeper's [`Store::expire_due`] connects; the local ledger
//!   uses the configured catalog until then.
//!
//! A call that timed out may still have been applied by Redis: a reserve
//! admitted locally after such a timeout may then also hold in Redis until
//! its TTL — the outage errs towards counting too much, never too little.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use allowance_core::{
    AdminError, Amounts, Catalog, CatalogChange, Clock, Dimension, ExtendError, FailOpenStats,
    Granted, IdSource, Invalid, Limit, Override, Plan, RefundError, Reservation, ReservationId,
    ReserveError, ReserveRequest, ScopeKey, ScopeStatus, SettleError, SharedLedger, Status, Store,
    StoreError, StoreStats, Timestamp, Unavailable, Usage, UsagePage,
};
use async_trait::async_trait;
use parking_lot::Mutex;

use crate::RedisStore;
use crate::wire::fingerprint;

/// Shards of the local ledger: it serves only during an outage.
const LOCAL_SHARDS: usize = 16;

/// Most imports one [`FailOpenLocal::reconcile`] sends (concurrently); the
/// next sweep takes the rest.
const RECONCILE_BATCH: usize = 256;

/// How long Redis must have answered the sweeper before an outage ends and
/// reserves go to Redis again: several sweeps (every 250 ms) of every
/// instance, so each has shadowed the holds it admitted locally before any
/// instance that saw the outage admits in Redis beside them.
pub const HANDOVER: std::time::Duration = std::time::Duration::from_secs(1);

/// The local ledger and the catalog (Redis's, unscaled) it was built from.
struct Local {
    ledger: SharedLedger,
    source: Arc<Catalog>,
}

/// A reservation admitted locally and not yet imported into Redis.
struct Entry {
    /// Its import is under way: a late settle must wait for it.
    importing: bool,
    /// Its tenant and idempotency key (see [`idem_key`]), if it has one.
    key: Option<String>,
    /// What its idempotency key binds, as Redis records it (carried into
    /// Redis with the import).
    fingerprint: Option<String>,
    /// The expiry and amounts of the shadow hold Redis has confirmed for
    /// it while it is held here ([`RedisStore::shadow`]), if any.
    shadowed: Option<(Timestamp, Amounts)>,
}

impl Entry {
    /// Whether Redis holds `r`'s room as `r` stands (no extend since).
    fn shadows(&self, r: &Reservation) -> bool {
        self.shadowed
            .as_ref()
            .is_some_and(|(x, h)| *x == r.expires_at && *h == r.held)
    }
}

#[derive(Default)]
struct State {
    local: Option<Local>,
    /// The ids admitted locally, until imported.
    pending: HashMap<ReservationId, Entry>,
    /// Idempotency keys first used locally -> their reservation.
    keys: HashMap<String, ReservationId>,
}

impl State {
    /// Forgets an imported reservation.
    fn forget(&mut self, id: ReservationId) {
        if let Some(Entry { key: Some(k), .. }) = self.pending.remove(&id) {
            self.keys.remove(&k);
        }
    }
}

/// An ended local reservation to import, with what its idempotency key
/// binds.
type Ended = (Reservation, Option<String>);

/// A tenant's idempotency key as one map key.
fn idem_key(tenant: &str, key: &str) -> String {
    format!("{tenant}\n{key}")
}

/// A [`Store`] on Redis that admits locally, against a share of every
/// limit, while Redis cannot answer (see the module documentation).
pub struct FailOpenLocal {
    redis: Arc<RedisStore>,
    fraction: f64,
    clock: Arc<dyn Clock>,
    ids: Arc<dyn IdSource>,
    state: Mutex<State>,
    admitted: AtomicU64,
    imported: AtomicU64,
    /// In an outage, or its hand-over: reserves are answered locally.
    outage: AtomicBool,
    /// When the sweeper first found Redis answering again in this outage.
    back_since: Mutex<Option<std::time::Instant>>,
}

impl FailOpenLocal {
    /// Wraps `redis`; during an outage each limit admits
    /// `max(1, floor(capacity × fraction))` here (`fraction` is clamped to
    /// (0, 1]). `clock` and `ids` serve the local ledger.
    pub fn new(
        redis: Arc<RedisStore>,
        fraction: f64,
        clock: Arc<dyn Clock>,
        ids: Arc<dyn IdSource>,
    ) -> FailOpenLocal {
        let fraction = if fraction.is_finite() && fraction > 0.0 {
            fraction.min(1.0)
        } else {
            f64::MIN_POSITIVE
        };
        FailOpenLocal {
            redis,
            fraction,
            clock,
            ids,
            state: Mutex::new(State::default()),
            admitted: AtomicU64::new(0),
            imported: AtomicU64::new(0),
            outage: AtomicBool::new(false),
            back_since: Mutex::new(None),
        }
    }

    /// The Redis store inside.
    pub fn redis(&self) -> &Arc<RedisStore> {
        &self.redis
    }

    /// The share of every capacity admitted locally.
    pub fn fraction(&self) -> f64 {
        self.fraction
    }

    /// Reservations admitted locally since this store started (dry runs
    /// and idempotent replays not counted).
    pub fn admitted_locally(&self) -> u64 {
        self.admitted.load(Ordering::Relaxed)
    }

    /// Local reservations imported into Redis since this store started.
    pub fn imported(&self) -> u64 {
        self.imported.load(Ordering::Relaxed)
    }

    /// Local reservations not yet imported into Redis (held ones included).
    pub fn pending_reconciliation(&self) -> usize {
        self.state.lock().pending.len()
    }

    /// Imports into Redis the local reservations that have ended (at most
    /// a batch per call), each forgotten locally once Redis has it, and
    /// gives each one still held a shadow hold there (or brings its shadow
    /// up to date after an extend), so that Redis counts its room until it
    /// ends; returns how many were imported. Reports the first call Redis
    /// could not answer (the rest wait for the next call).
    pub async fn reconcile(&self) -> Result<usize, Unavailable> {
        let (batch, held) = self.take_ended();
        if batch.is_empty() && held.is_empty() {
            return Ok(0);
        }
        let mut guard = Importing {
            owner: self,
            ids: batch.iter().map(|(r, _)| r.id).collect(),
        };
        let imports = futures_util::future::join_all(
            batch
                .iter()
                .map(|(r, fingerprint)| self.redis.import(r, fingerprint.as_deref())),
        );
        let shadows = futures_util::future::join_all(held.iter().map(|r| self.redis.shadow(r)));
        let (results, shadowed) = futures_util::future::join(imports, shadows).await;
        let mut done = Vec::new();
        let mut failed = None;
        for (res, result) in held.iter().zip(shadowed) {
            match result {
                Ok(()) => {
                    if let Some(e) = self.state.lock().pending.get_mut(&res.id) {
                        e.shadowed = Some((res.expires_at, res.held.clone()));
                    }
                }
                Err(StoreError::Unavailable(e)) => {
                    failed.get_or_insert(e);
                }
                Err(StoreError::Rejected(e)) => {
                    tracing::error!(id = %res.id, error = %e, "Redis refused a shadow hold for a reservation admitted locally");
                }
            }
        }
        for ((res, _), result) in batch.iter().zip(results) {
            match result {
                Ok(()) => done.push(res.id),
                Err(StoreError::Unavailable(e)) => {
                    failed.get_or_insert(e);
                }
                Err(StoreError::Rejected(e)) => {
                    // Cannot happen for an ended reservation minted for its
                    // tenant: kept (and retried) rather than dropped.
                    tracing::error!(id = %res.id, error = %e, "Redis refused to import a reservation admitted locally");
                }
            }
        }
        {
            let mut st = self.state.lock();
            for id in &done {
                st.forget(*id);
            }
        }
        guard.ids.retain(|id| !done.contains(id));
        drop(guard);
        self.imported
            .fetch_add(done.len() as u64, Ordering::Relaxed);
        if !done.is_empty() {
            tracing::info!(
                imported = done.len(),
                pending = self.pending_reconciliation(),
                "reconciled reservations admitted locally during a Redis outage"
            );
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(done.len()),
        }
    }

    /// The local reservations that have ended, marked as being imported,
    /// each with what its idempotency key binds; and those still held whose
    /// shadow hold in Redis is missing or out of date.
    fn take_ended(&self) -> (Vec<Ended>, Vec<Reservation>) {
        let mut st = self.state.lock();
        let State { local, pending, .. } = &mut *st;
        let Some(local) = local else {
            return (Vec::new(), Vec::new());
        };
        let now = self.clock.now();
        let mut out = Vec::new();
        let mut held = Vec::new();
        let mut lost = Vec::new();
        for (id, entry) in pending.iter_mut() {
            if entry.importing {
                continue;
            }
            match local.ledger.get(now, *id) {
                Some(r) if r.status != Status::Held => {
                    entry.importing = true;
                    out.push((r, entry.fingerprint.clone()));
                    if out.len() == RECONCILE_BATCH {
                        break;
                    }
                }
                Some(r) => {
                    if !entry.shadows(&r) && held.len() < RECONCILE_BATCH {
                        held.push(r);
                    }
                }
                None => lost.push(*id),
            }
        }
        for id in lost {
            // Only when Redis stayed away longer than the ended retention.
            tracing::error!(%id, "a reservation admitted locally was forgotten before Redis came back: its usage is lost");
            st.forget(id);
        }
        (out, held)
    }

    /// Whether reserves are answered locally: during an outage and its
    /// hand-over (see [`HANDOVER`]).
    pub fn answering_locally(&self) -> bool {
        self.outage.load(Ordering::Relaxed)
    }

    /// Notes that Redis failed: an outage begins (or goes on), and any
    /// hand-over starts again when it answers.
    fn redis_failed(&self, e: &Unavailable) {
        *self.back_since.lock() = None;
        if !self.outage.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                error = %e,
                fraction = self.fraction,
                "Redis cannot answer: admitting locally against each limit's capacity × fraction (fail_open_local) until it does"
            );
        }
    }

    /// Notes that the sweeper found Redis answering and reconciled: the
    /// outage ends once Redis has answered for [`HANDOVER`] and every
    /// reservation still held here has its shadow hold there.
    fn redis_answered(&self) {
        if !self.outage.load(Ordering::Relaxed) {
            return;
        }
        let since = *self
            .back_since
            .lock()
            .get_or_insert_with(std::time::Instant::now);
        if since.elapsed() < HANDOVER || self.unshadowed() > 0 {
            return;
        }
        *self.back_since.lock() = None;
        if self.outage.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                pending = self.pending_reconciliation(),
                admitted_locally = self.admitted_locally(),
                "Redis answers again and holds what is held here: reserves go to Redis again"
            );
        }
    }

    /// Reservations held here whose shadow hold Redis has not confirmed as
    /// they stand.
    fn unshadowed(&self) -> usize {
        let st = self.state.lock();
        let Some(local) = &st.local else { return 0 };
        let now = self.clock.now();
        st.pending
            .iter()
            .filter(|(id, e)| {
                local
                    .ledger
                    .get(now, **id)
                    .is_some_and(|r| r.status == Status::Held && !e.shadows(&r))
            })
            .count()
    }

    /// Builds the local ledger, or rescales it if the catalog changed.
    async fn ensure_local(&self) -> Result<(), Unavailable> {
        let catalog = self.redis.catalog().await?;
        if let Some(l) = &self.state.lock().local
            && Arc::ptr_eq(&l.source, &catalog)
        {
            return Ok(());
        }
        let scaled = scaled_catalog(&catalog, self.fraction).map_err(|e| {
            Unavailable(format!(
                "fail_open_local: cannot scale the catalog ({e}); failing closed"
            ))
        })?;
        let mut st = self.state.lock();
        match &mut st.local {
            Some(l) if Arc::ptr_eq(&l.source, &catalog) => {}
            Some(l) => {
                l.ledger.replace_catalog(scaled);
                l.source = catalog;
            }
            None => {
                st.local = Some(Local {
                    ledger: SharedLedger::new(scaled, LOCAL_SHARDS),
                    source: catalog,
                });
            }
        }
        Ok(())
    }

    /// Answers a reserve on the local ledger (`why`: Redis's failure, if
    /// that is the reason, for the log).
    async fn reserve_local(
        &self,
        req: &ReserveRequest,
        why: Option<&Unavailable>,
    ) -> Result<Granted, StoreError<ReserveError>> {
        // The outage begins with Redis's failure, whatever the local
        // ledger answers (a local denial too).
        if let Some(e) = why {
            self.redis_failed(e);
        }
        if let Err(e) = self.ensure_local().await {
            tracing::error!(error = %e, "fail_open_local: no local ledger");
            return Err(StoreError::Unavailable(why.cloned().unwrap_or(e)));
        }
        let tenant = req.scopes.tenant_name();
        let granted = {
            let mut st = self.state.lock();
            let State {
                local,
                pending,
                keys,
            } = &mut *st;
            let local = local.as_ref().expect("built above, never removed");
            let ledger = &local.ledger;
            let id = ReservationId::mint(self.ids.next_random(), tenant);
            let g = ledger
                .reserve(self.clock.now(), id, req)
                .map_err(StoreError::Rejected)?;
            if !g.replayed && !g.dry_run {
                let key = req.idempotency_key.as_deref().map(|k| idem_key(tenant, k));
                if let Some(k) = &key {
                    keys.insert(k.clone(), g.id);
                }
                let fingerprint = key.as_ref().map(|_| {
                    fingerprint(
                        &local.source,
                        &req.scopes,
                        &req.amounts,
                        req.model.as_deref(),
                    )
                });
                pending.insert(
                    g.id,
                    Entry {
                        importing: false,
                        key,
                        fingerprint,
                        shadowed: None,
                    },
                );
                self.admitted.fetch_add(1, Ordering::Relaxed);
            }
            g
        };
        Ok(granted)
    }

    /// Runs `f` on the local ledger if `id` was admitted locally and is not
    /// imported yet (`f` is told whether its import is under way).
    fn on_local<R>(
        &self,
        id: ReservationId,
        f: impl FnOnce(&SharedLedger, Timestamp, bool) -> R,
    ) -> Option<R> {
        let st = self.state.lock();
        let entry = st.pending.get(&id)?;
        let local = st.local.as_ref()?;
        Some(f(&local.ledger, self.clock.now(), entry.importing))
    }

    fn is_local_key(&self, req: &ReserveRequest) -> bool {
        req.idempotency_key.as_deref().is_some_and(|k| {
            self.state
                .lock()
                .keys
                .contains_key(&idem_key(req.scopes.tenant_name(), k))
        })
    }
}

/// The ids a [`FailOpenLocal::reconcile`] is importing: whatever is left
/// when it ends (or is cancelled) is marked local again.
struct Importing<'a> {
    owner: &'a FailOpenLocal,
    ids: Vec<ReservationId>,
}

impl Drop for Importing<'_> {
    fn drop(&mut self) {
        if self.ids.is_empty() {
            return;
        }
        let mut st = self.owner.state.lock();
        for id in &self.ids {
            if let Some(e) = st.pending.get_mut(id) {
                e.importing = false;
            }
        }
    }
}

/// `max(1, floor(capacity × fraction))`, never above `capacity`.
fn scale(capacity: u64, fraction: f64) -> u64 {
    ((capacity as f64 * fraction).floor() as u64).clamp(1, capacity.max(1))
}

/// `plan` with every capacity (and guarantee) scaled.
fn scaled_plan(plan: &Plan, fraction: f64) -> Result<Arc<Plan>, Invalid> {
    let limits = plan
        .limits()
        .iter()
        .map(|l| {
            let scaled = Limit::new(
                l.dimension(),
                scale(l.capacity(), fraction),
                l.window().clone(),
            )?;
            if l.guaranteed() == 0 {
                return Ok(scaled);
            }
            let g = scale(l.guaranteed(), fraction).min(scaled.capacity());
            scaled.with_guaranteed(g)
        })
        .collect::<Result<Vec<_>, Invalid>>()?;
    Plan::with_weight(plan.name(), limits, plan.overrun(), plan.queue_weight())
}

/// `catalog` with every limit's capacity scaled by `fraction`: every plan
/// (each kind's default plan is one of them) and every `Limits` override.
fn scaled_catalog(catalog: &Catalog, fraction: f64) -> Result<Catalog, String> {
    let mut out = catalog.clone();
    for plan in catalog.plans() {
        out.set_plan(scaled_plan(plan, fraction).map_err(|e| e.to_string())?);
    }
    for (scope, over) in catalog.overrides() {
        if let Override::Limits(plan) = over {
            let scaled = scaled_plan(plan, fraction).map_err(|e| e.to_string())?;
            out.set_override(scope.clone(), Override::Limits(scaled))
                .map_err(|e| format!("the override of {scope}: {e}"))?;
        }
    }
    Ok(out)
}

#[async_trait]
impl Store for FailOpenLocal {
    fn is_shared(&self) -> bool {
        self.redis.is_shared()
    }

    fn on_room_freed(&self, wake: Arc<dyn Fn() + Send + Sync>) {
        self.redis.on_room_freed(wake);
    }

    async fn reserve(&self, req: &ReserveRequest) -> Result<Granted, StoreError<ReserveError>> {
        if self.is_local_key(req) {
            return self.reserve_local(req, None).await;
        }
        if self.outage.load(Ordering::Relaxed) {
            // During an outage and its hand-over nothing is sent to Redis:
            // a hung server would cost every reserve the store's timeout,
            // and a reserve Redis admitted before this instance's (and the
            // others') local holds are shadowed there would admit past
            // them. The sweeper ends it (`redis_answered`).
            return self.reserve_local(req, None).await;
        }
        match self.redis.reserve(req).await {
            Err(StoreError::Unavailable(e)) => self.reserve_local(req, Some(&e)).await,
            answer => answer,
        }
    }

    async fn settle(
        &self,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<Reservation, StoreError<SettleError>> {
        let local = self.on_local(id, |ledger, now, importing| {
            if importing
                && ledger
                    .get(now, id)
                    .is_some_and(|r| r.status == Status::Expired)
            {
                // A late settle would change what is being imported.
                return Err(StoreError::Unavailable(Unavailable(
                    "this reservation is being reconciled into Redis: retry".into(),
                )));
            }
            ledger
                .settle_view(now, id, usage)
                .map_err(StoreError::Rejected)
        });
        match local {
            Some(answer) => answer,
            None => self.redis.settle(id, usage).await,
        }
    }

    async fn refund(&self, id: ReservationId) -> Result<Reservation, StoreError<RefundError>> {
        // A refund of an ended reservation changes nothing: safe mid-import.
        match self.on_local(id, |ledger, now, _| {
            ledger.refund_view(now, id).map_err(StoreError::Rejected)
        }) {
            Some(answer) => answer,
            None => self.redis.refund(id).await,
        }
    }

    async fn extend(
        &self,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Result<Reservation, StoreError<ExtendError>> {
        // Only a HELD reservation extends, and none is imported.
        match self.on_local(id, |ledger, now, _| {
            ledger
                .extend_view(now, id, amounts, ttl_ms)
                .map_err(StoreError::Rejected)
        }) {
            Some(answer) => answer,
            None => self.redis.extend(id, amounts, ttl_ms).await,
        }
    }

    async fn get(&self, id: ReservationId) -> Result<Option<Reservation>, Unavailable> {
        match self.on_local(id, |ledger, now, _| ledger.get(now, id)) {
            Some(answer) => Ok(answer),
            None => self.redis.get(id).await,
        }
    }

    async fn status(&self, scope: &ScopeKey) -> Result<ScopeStatus, Unavailable> {
        self.redis.status(scope).await
    }

    async fn adjust(
        &self,
        scope: &ScopeKey,
        dimension: Dimension,
        credit: i64,
        reason: &str,
    ) -> Result<ScopeStatus, StoreError<AdminError>> {
        self.redis.adjust(scope, dimension, credit, reason).await
    }

    async fn catalog(&self) -> Result<Arc<Catalog>, Unavailable> {
        self.redis.catalog().await
    }

    async fn change_catalog(&self, change: &CatalogChange) -> Result<(), StoreError<AdminError>> {
        self.redis.change_catalog(change).await
    }

    async fn expire_due(&self) -> Result<u64, Unavailable> {
        if let Some(l) = &self.state.lock().local {
            l.ledger.expire_due(self.clock.now());
        }
        let expired = match self.redis.expire_due().await {
            Ok(n) => n,
            Err(e) => {
                // An instance without traffic learns of the outage here, so
                // it too hands over when Redis returns.
                self.redis_failed(&e);
                return Err(e);
            }
        };
        self.reconcile().await?;
        self.redis_answered();
        Ok(expired)
    }

    async fn stats(&self) -> Result<StoreStats, Unavailable> {
        self.redis.stats().await
    }

    fn fail_open_stats(&self) -> Option<FailOpenStats> {
        Some(FailOpenStats {
            answering_locally: self.answering_locally(),
            admitted_locally_total: self.admitted_locally(),
            imported_total: self.imported(),
            pending_reconciliation: self.pending_reconciliation() as u64,
        })
    }

    async fn usage(
        &self,
        since: Option<u64>,
        limit: usize,
        tenant: Option<&str>,
    ) -> Result<UsagePage, Unavailable> {
        self.redis.usage(since, limit, tenant).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use allowance_core::{OverrunPolicy, Window};

    fn limit(d: Dimension, cap: u64, w: Window) -> Limit {
        Limit::new(d, cap, w).unwrap()
    }

    #[test]
    fn scales_to_at_least_one_and_never_up() {
        assert_eq!(scale(1000, 0.1), 100);
        assert_eq!(scale(1009, 0.1), 100);
        assert_eq!(scale(9, 0.1), 1);
        assert_eq!(scale(1, 0.1), 1);
        assert_eq!(scale(7, 1.0), 7);
        assert_eq!(scale(1 << 53, 0.5), 1 << 52);
    }

    #[test]
    fn scales_plans_defaults_and_overrides() {
        let hour = Window::Sliding {
            period_ms: 3_600_000,
            slices: 60,
        };
        let mut c = Catalog::default();
        c.set_plan(
            Plan::with_weight(
                "t",
                vec![
                    limit(Dimension::TOKENS, 1000, hour.clone()),
                    limit(Dimension::CONCURRENT, 20, Window::Concurrent)
                        .with_guaranteed(15)
                        .unwrap(),
                ],
                OverrunPolicy::CapAtEstimate,
                7,
            )
            .unwrap(),
        );
        c.set_plan(
            Plan::new(
                "other",
                vec![limit(Dimension::REQUESTS, 5, Window::Total)],
                OverrunPolicy::ChargeActual,
            )
            .unwrap(),
        );
        c.set_kind("tenant", Some("t"), false).unwrap();
        c.set_kind("user", Some("other"), false).unwrap();
        let own = Plan::new(
            "own",
            vec![limit(Dimension::TOKENS, 50_000, hour)],
            OverrunPolicy::ChargeActual,
        )
        .unwrap();
        let vip = ScopeKey::tenant("vip").unwrap();
        c.set_override(vip.clone(), Override::Limits(own)).unwrap();
        let moved = ScopeKey::tenant("moved").unwrap();
        c.set_override(moved.clone(), Override::Plan("other".into()))
            .unwrap();

        let s = scaled_catalog(&c, 0.1).unwrap();
        let t = s.plan_for(&ScopeKey::tenant("acme").unwrap());
        let caps: Vec<u64> = t.limits().iter().map(Limit::capacity).collect();
        assert_eq!(caps, [100, 2]);
        assert_eq!(t.limits()[1].guaranteed(), 1);
        assert_eq!(
            (t.name(), t.overrun(), t.queue_weight()),
            ("t", OverrunPolicy::CapAtEstimate, 7)
        );
        let user = s.scope_set("acme", &[("user", "u")]).unwrap();
        assert_eq!(s.plan_for(&user.as_slice()[1]).limits()[0].capacity(), 1);
        assert_eq!(s.plan_for(&vip).limits()[0].capacity(), 5_000);
        assert_eq!(s.plan_for(&moved).limits()[0].capacity(), 1);
        // The source is untouched.
        assert_eq!(c.plan_for(&vip).limits()[0].capacity(), 50_000);
    }
}
