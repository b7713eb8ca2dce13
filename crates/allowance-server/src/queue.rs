//! The admission queue (`wait_ms`, HTTP-API.md): a reserve refused for a
//! retryable reason waits here and is admitted as soon as room frees.
//!
//! - **Wake-ups** — a dispatcher task tries the waiters again when this
//!   server settles, refunds or expires something ([`AdmissionQueue::kick`])
//!   and when a waiter's `retry_after` comes (a timer per earliest retry,
//!   never a polling loop); with a store shared by several servers (Redis),
//!   another server's settle is announced by the store
//!   (`Store::on_room_freed`), and a missed announcement is caught by a
//!   bounded re-check ([`RECHECK`]).
//! - **Fairness** — start-time fair queueing across tenants: each tenant
//!   has a virtual time that grows by `1 / queue_weight` per admission, and
//!   the tenant with the lowest goes first; a tenant that starts waiting
//!   joins at the current virtual time (no banked credit), or at its own if
//!   its last admissions put it later (no free pass for a tenant that only
//!   ever has one waiter). Within a tenant,
//!   higher `priority` first, then first come first served. A tenant's
//!   first waiters (up to [`HEADS_PER_TENANT`]) are considered in that
//!   order; one refused by a scope holds up only those after it that touch
//!   that scope.
//! - **Guarantees** — a tenant plan's concurrency limit may carry
//!   `guaranteed` (CONFIG.md 9): tenants holding fewer reservations than
//!   that are tried before the others, so a tenant bursting above its
//!   guarantee only takes room nobody guaranteed is waiting for.
//! - **No waiter's room is taken** — a waiter refused by scope S blocks S
//!   until it is tried again: waiters after it in the fair order that touch
//!   S wait for that, and an immediate reserve touching S is refused with
//!   that waiter's denial. Waiters refused elsewhere proceed.
//! - **Cancellation** — a waiter whose request is dropped (the client went
//!   away) leaves the queue at once; if the dispatcher admitted it in the
//!   same instant, the grant finds no one and is refunded. A waiter whose
//!   deadline passes while the dispatcher's reserve for it is in flight is
//!   answered by that attempt (a grant or its denial), not told no while
//!   the grant goes to nobody.
//! - **Bounds** — waiters per tenant and in all; past them the refusal is
//!   the denial at once, marked `queue_full`.
//! - **Idempotency** — while a reserve with an idempotency key waits, a
//!   duplicate (same tenant and key) answers 409 `conflict` (SEMANTICS 15)
//!   rather than waiting or reserving beside it.
//! - **Answers stay current** — a denial given from the queue (a waiter's
//!   `wait_ms` ran out, or an immediate reserve held up by a waiter)
//!   carries its `retry_after_ms` less the time since the store said it.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use allowance_core::{
    Denial, DenialKind, Granted, ReserveError, ReserveRequest, ScopeKey, StoreError, Unavailable,
};
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

/// The longest a waiter goes untried: what bounds the wait for room freed
/// by another server sharing the store, which this one is not told of.
pub const RECHECK: Duration = Duration::from_secs(1);

/// How many of a tenant's first waiters a pass considers, in the tenant's
/// order: one refused by a scope holds up those after it that touch that
/// scope (they are not asked), not those on other scopes (a user at its own
/// limit does not stop a colleague whose room is free). Bounded, so a pass
/// stays proportional to the tenants waiting.
const HEADS_PER_TENANT: usize = 8;

/// One admission's share of virtual time at weight 1 (a multiple of every
/// weight up to 1000 would be exact; this keeps the ratios within 1e-6).
const VTIME_UNIT: u128 = 1 << 40;

/// How many may wait.
#[derive(Clone, Copy, Debug)]
pub struct QueueLimits {
    /// Waiters one tenant may have at once.
    pub per_tenant: usize,
    /// Waiters in all.
    pub total: usize,
}

impl Default for QueueLimits {
    fn default() -> Self {
        QueueLimits {
            per_tenant: 1000,
            total: 100_000,
        }
    }
}

/// What a waiter is finally told.
pub(crate) type Outcome = Result<Granted, StoreError<ReserveError>>;

struct Waiter {
    tenant: Arc<str>,
    priority: i32,
    seq: u64,
    req: Arc<ReserveRequest>,
    next_try: Instant,
    /// Why it waits: its last refusal (the scope in it is what it blocks).
    denial: Box<Denial>,
    /// When the store gave `denial` (its `retry_after_ms` counts from then).
    denied_at: Instant,
    /// Its reservation's tenant and idempotency key, if it has one.
    key: Option<String>,
    tx: Option<oneshot::Sender<Outcome>>,
    /// The dispatcher's reserve for it is in flight.
    trying: bool,
    /// Its deadline passed (or its client left) while that reserve was in
    /// flight: the attempt's outcome is its answer, a grant or the denial.
    leaving: bool,
}

impl Waiter {
    /// Its denial as of now: `retry_after_ms` less the time since.
    fn current_denial(&self) -> Box<Denial> {
        let mut d = self.denial.clone();
        let elapsed_ms = u64::try_from(self.denied_at.elapsed().as_millis()).unwrap_or(u64::MAX);
        d.retry_after_ms = d
            .retry_after_ms
            .map(|ms| ms.saturating_sub(elapsed_ms).max(1));
        d
    }
}

/// A waiting reserve's tenant and idempotency key as one map key.
fn waiting_key(req: &ReserveRequest) -> Option<String> {
    req.idempotency_key
        .as_deref()
        .map(|k| format!("{}\n{k}", req.scopes.tenant_name()))
}

struct TenantQ {
    /// (priority, arrival) of its waiters, best first.
    order: BTreeSet<(Reverse<i32>, u64)>,
    vtime: u128,
    weight: u32,
}

#[derive(Default)]
struct State {
    next_seq: u64,
    waiters: HashMap<u64, Waiter>,
    tenants: HashMap<Arc<str>, TenantQ>,
    /// Waiters by the scope that refused them last.
    blocked: Blocked,
    /// The [`waiting_key`]s of the waiters that have one.
    keys: HashSet<String>,
    /// The virtual time of the latest admission: where a tenant that starts
    /// waiting joins.
    vclock: u128,
    /// Tenants with no waiter whose virtual time is still ahead of the
    /// clock: one that waits again resumes from there, so a tenant that
    /// never has more than one waiter is charged for its admissions too
    /// (without this it rejoined at the clock each time, never behind
    /// anyone, and took a weight-3 tenant's share). Pruned once much larger
    /// than the tenants waiting.
    idle_vtime: HashMap<Arc<str>, u128>,
    /// `idle_vtime`'s size that triggers the next pruning (doubles when a
    /// pruning keeps most: amortized O(1) a take).
    idle_prune_at: usize,
}

/// A waiter's place, to leave the queue with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Ticket(u64);

/// Why a waiter was not queued.
pub(crate) enum NotQueued {
    /// The queue is full: the denial that sent it there.
    Full(Box<Denial>),
    /// A reserve with the same tenant and idempotency key is waiting.
    Duplicate,
}

/// The queue and its dispatcher's wake-up.
pub struct AdmissionQueue {
    state: parking_lot::Mutex<State>,
    /// `state.waiters.len()`, written under the lock: every reserve and
    /// settle asks whether anyone waits, and the answer is almost always
    /// no, so they read this instead of taking the queue's one lock.
    waiting: AtomicUsize,
    kick: Notify,
    limits: QueueLimits,
    started: std::sync::OnceLock<()>,
    /// The longest a waiter goes untried: [`RECHECK`] when other processes
    /// change the store, else only its own retry time bounds it.
    recheck: Option<Duration>,
}

/// A tenant's first waiter, in fair order.
struct Candidate {
    ticket: Ticket,
    req: Arc<ReserveRequest>,
    /// Its place in the fair order: (its tenant's virtual time, its
    /// tenant's first arrival, its rank in its tenant's own order).
    order: (u128, u64, usize),
    /// Whether it is due to be tried.
    ready: bool,
    next_try: Instant,
    /// The scope that refused it last.
    blocked_by: ScopeKey,
}

impl AdmissionQueue {
    /// An empty queue; `shared`: other processes change the store (see
    /// `Store::is_shared`), so waiters are re-checked every [`RECHECK`].
    pub fn new(limits: QueueLimits, shared: bool) -> Self {
        AdmissionQueue {
            state: parking_lot::Mutex::new(State::default()),
            waiting: AtomicUsize::new(0),
            kick: Notify::new(),
            limits,
            started: std::sync::OnceLock::new(),
            recheck: shared.then_some(RECHECK),
        }
    }

    /// Waiters now.
    pub fn depth(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Tells the dispatcher room may have freed (a settle, refund, expiry).
    ///
    /// A waiter queued concurrently with a kick that saw none is not
    /// missed: whoever queues a waiter kicks after queueing it.
    pub fn kick(&self) {
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.kick.notify_one();
        }
    }

    /// The denial of a waiter blocked on one of `scopes`, if any: an
    /// immediate reserve on them would take room that waiter could use.
    pub(crate) fn blocking(&self, req: &ReserveRequest) -> Option<Box<Denial>> {
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return None;
        }
        let st = self.state.lock();
        if st.blocked.by_scope.is_empty() {
            return None;
        }
        // The longest-waiting waiter held up there speaks for them all (a
        // look-up, not a scan: this is every immediate reserve's path).
        let seq = req
            .scopes
            .as_slice()
            .iter()
            .find_map(|k| st.blocked.by_scope.get(k).and_then(|set| set.first()))?;
        st.waiters.get(seq).map(Waiter::current_denial)
    }

    /// Whether a reserve with `req`'s tenant and idempotency key waits.
    pub(crate) fn is_waiting(&self, req: &ReserveRequest) -> bool {
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return false;
        }
        waiting_key(req).is_some_and(|k| self.state.lock().keys.contains(&k))
    }

    /// Queues a waiter refused with `denial`; its outcome comes on `tx`.
    /// It is queued fairly as `fair_tenant`'s (the reservation's own
    /// tenant unless the gateway waits on an upstream for a caller).
    pub(crate) fn push(
        &self,
        req: Arc<ReserveRequest>,
        fair_tenant: Option<Arc<str>>,
        weight: u32,
        priority: i32,
        denial: Box<Denial>,
        tx: oneshot::Sender<Outcome>,
    ) -> Result<Ticket, NotQueued> {
        let tenant: Arc<str> = fair_tenant.unwrap_or_else(|| Arc::from(req.scopes.tenant_name()));
        let key = waiting_key(&req);
        let mut st = self.state.lock();
        if key.as_ref().is_some_and(|k| st.keys.contains(k)) {
            return Err(NotQueued::Duplicate);
        }
        let tenant_depth = st.tenants.get(&tenant).map_or(0, |t| t.order.len());
        if st.waiters.len() >= self.limits.total || tenant_depth >= self.limits.per_tenant {
            return Err(NotQueued::Full(denial));
        }
        st.next_seq += 1;
        let seq = st.next_seq;
        if let Some(k) = &key {
            st.keys.insert(k.clone());
        }
        let vclock = st.vclock;
        let resumed = if st.tenants.contains_key(&tenant) {
            0
        } else {
            st.idle_vtime.remove(&tenant).unwrap_or(0)
        };
        let t = st.tenants.entry(tenant.clone()).or_insert_with(|| TenantQ {
            order: BTreeSet::new(),
            vtime: vclock.max(resumed),
            weight: weight.max(1),
        });
        if t.order.is_empty() {
            // Joins now: no credit banked while it was not waiting.
            t.vtime = t.vtime.max(vclock);
        }
        t.weight = weight.max(1);
        t.order.insert((Reverse(priority), seq));
        st.blocked.add(&denial.scope, seq);
        st.waiters.insert(
            seq,
            Waiter {
                tenant,
                priority,
                seq,
                req,
                next_try: retry_at(&denial, self.recheck),
                denial,
                denied_at: Instant::now(),
                key,
                tx: Some(tx),
                trying: false,
                leaving: false,
            },
        );
        self.waiting.store(st.waiters.len(), Ordering::SeqCst);
        metrics::gauge!("allowance_queue_depth").set(st.waiters.len() as f64);
        Ok(Ticket(seq))
    }

    /// Takes a waiter out (its deadline passed, or its client left):
    /// `None` if the dispatcher already took it to answer it, or is trying
    /// it now — then that attempt answers it (a grant, or its denial), so a
    /// waiter is never told no while a grant is on its way to nobody.
    pub(crate) fn remove(&self, ticket: Ticket) -> Option<Box<Denial>> {
        let (w, others) = {
            let mut st = self.state.lock();
            if let Some(w) = st.waiters.get_mut(&ticket.0)
                && w.trying
            {
                w.leaving = true;
                return None;
            }
            let w = take(&mut st, &self.waiting, ticket)?;
            (w, !st.waiters.is_empty())
        };
        if others {
            // Whoever it held up is tried now, not at its inherited time.
            self.kick.notify_one();
        }
        Some(w.current_denial())
    }

    /// Starts the dispatcher on first use.
    pub(crate) fn ensure_dispatcher(self: &Arc<Self>, state: crate::AppState) {
        if self.started.set(()).is_ok() {
            let queue = self.clone();
            tokio::spawn(async move { queue.dispatch(state).await });
        }
    }

    /// The heads of the tenants' queues in fair order; with `all`, all
    /// are due (room may have freed), else those whose retry time came.
    fn candidates(&self, all: bool, now: Instant) -> Vec<Candidate> {
        let st = self.state.lock();
        let waiters = &st.waiters;
        let mut heads: Vec<Candidate> = st
            .tenants
            .values()
            .flat_map(|t| {
                // Tenants by (virtual time, first waiter's arrival); within
                // one, its own order (priority, then arrival).
                let first = t.order.first().map_or(0, |&(_, seq)| seq);
                t.order
                    .iter()
                    .take(HEADS_PER_TENANT)
                    .enumerate()
                    .filter_map(move |(rank, &(_, seq))| {
                        let w = waiters.get(&seq)?;
                        Some(Candidate {
                            ticket: Ticket(seq),
                            req: w.req.clone(),
                            order: (t.vtime, first, rank),
                            ready: all || w.next_try <= now,
                            next_try: w.next_try,
                            blocked_by: w.denial.scope.clone(),
                        })
                    })
            })
            .collect();
        heads.sort_unstable_by_key(|c| c.order);
        heads
    }

    /// A waiter behind one that a scope refuses waits for that one's retry.
    fn defer(&self, ticket: Ticket, until: Instant) {
        if let Some(w) = self.state.lock().waiters.get_mut(&ticket.0) {
            w.next_try = w.next_try.max(until);
        }
    }

    /// When the dispatcher must look again without being kicked.
    fn next_wake(&self) -> Option<Instant> {
        let st = self.state.lock();
        st.tenants
            .values()
            .flat_map(|t| t.order.iter().take(HEADS_PER_TENANT))
            .filter_map(|(_, s)| st.waiters.get(s))
            .map(|w| w.next_try)
            .min()
    }

    async fn dispatch(self: Arc<Self>, state: crate::AppState) {
        loop {
            let kicked = match self.next_wake() {
                Some(at) => tokio::select! {
                    _ = self.kick.notified() => true,
                    _ = tokio::time::sleep_until(at) => false,
                },
                None => {
                    self.kick.notified().await;
                    true
                }
            };
            self.pass(&state, kicked).await;
        }
    }

    /// Tries the waiters in fair order until a pass admits nobody.
    async fn pass(&self, state: &crate::AppState, mut all: bool) {
        loop {
            let now = Instant::now();
            let mut candidates = self.candidates(all, now);
            if !candidates.iter().any(|c| c.ready) {
                return;
            }
            self.guarantees_first(state, &mut candidates).await;
            // Scopes a waiter earlier in the order is refused by, and until
            // when: nobody after it takes room there before it is tried again.
            let mut blocked: HashMap<ScopeKey, Instant> = HashMap::new();
            let mut admitted = false;
            for c in candidates {
                let behind = c
                    .req
                    .scopes
                    .as_slice()
                    .iter()
                    .filter_map(|k| blocked.get(k))
                    .max()
                    .copied();
                if let Some(until) = behind {
                    self.defer(c.ticket, until);
                    continue;
                }
                if !c.ready {
                    let until = blocked.entry(c.blocked_by).or_insert(c.next_try);
                    *until = (*until).max(c.next_try);
                    continue;
                }
                if !self.start_try(c.ticket) {
                    // It left since the candidates were read.
                    continue;
                }
                let outcome = match state.call(state.store().reserve(&c.req)).await {
                    Ok(r) => r,
                    Err(_) => Err(StoreError::Unavailable(Unavailable(
                        "the store did not answer in time".into(),
                    ))),
                };
                match outcome {
                    Ok(granted) => {
                        admitted = true;
                        self.admit(state, c.ticket, granted).await;
                    }
                    Err(StoreError::Rejected(ReserveError::Denied(d)))
                        if d.kind == DenialKind::RateLimited =>
                    {
                        let scope = d.scope.clone();
                        if let Some(until) = self.refused(c.ticket, d) {
                            let entry = blocked.entry(scope).or_insert(until);
                            *entry = (*entry).max(until);
                        }
                    }
                    Err(other) => self.finish(c.ticket, Err(other)),
                }
            }
            if !admitted {
                return;
            }
            // New heads: give them their turn now.
            all = true;
        }
    }

    /// Tenants holding fewer reservations than their plan's guaranteed
    /// concurrency go first (CONFIG.md 9, seed 002): a tenant bursting
    /// above its guarantee can only take room nobody guaranteed waits for.
    /// Asks the store for the count only for tenants whose plan has one.
    async fn guarantees_first(&self, state: &crate::AppState, candidates: &mut [Candidate]) {
        let Ok(Ok(catalog)) = state.call(state.store().catalog()).await else {
            return;
        };
        // Only the tenants about to be tried, with a guarantee, are asked,
        // all at once.
        let mut asked: Vec<(ScopeKey, u64)> = Vec::new();
        for c in candidates.iter().filter(|c| c.ready) {
            let tenant = c.req.scopes.tenant();
            let guaranteed = catalog
                .plan_for(tenant)
                .limits()
                .iter()
                .find(|l| l.dimension() == allowance_core::Dimension::CONCURRENT)
                .map_or(0, |l| l.guaranteed());
            if guaranteed > 0 && !asked.iter().any(|(t, _)| t == tenant) {
                asked.push((tenant.clone(), guaranteed));
            }
        }
        if asked.is_empty() {
            return;
        }
        let held = futures_util::future::join_all(
            asked
                .iter()
                .map(|(t, _)| state.call(state.store().status(t))),
        )
        .await;
        let below: HashMap<ScopeKey, bool> = asked
            .into_iter()
            .zip(held)
            .map(|((tenant, guaranteed), held)| {
                let n = match held {
                    Ok(Ok(st)) => st.held_reservations,
                    _ => u64::MAX,
                };
                (tenant, n < guaranteed)
            })
            .collect();
        candidates.sort_by_key(|c| {
            (
                !below.get(c.req.scopes.tenant()).copied().unwrap_or(false),
                c.order,
            )
        });
    }

    /// Hands a grant to its waiter; if it left meanwhile, gives the room back.
    async fn admit(&self, state: &crate::AppState, ticket: Ticket, granted: Granted) {
        let tx = {
            let mut st = self.state.lock();
            // Start-time fair queueing: the clock moves to this admission's
            // start tag, the tenant's virtual time past it.
            let tenant = st.waiters.get(&ticket.0).map(|w| w.tenant.clone());
            if let Some(tenant) = tenant
                && let Some(t) = st.tenants.get_mut(&tenant)
            {
                let start = t.vtime;
                t.vtime += VTIME_UNIT / u128::from(t.weight);
                st.vclock = st.vclock.max(start);
            }
            take(&mut st, &self.waiting, ticket).and_then(|mut w| w.tx.take())
        };
        metrics::counter!("allowance_queue_admissions_total").increment(1);
        let id = granted.id;
        let undelivered = match tx {
            Some(tx) => tx.send(Ok(granted)).is_err(),
            None => true,
        };
        if undelivered {
            // The client left as it was admitted: it must hold nothing.
            if let Ok(Err(e)) = state.call(state.store().refund(id)).await {
                tracing::warn!(%id, error = %e, "refunding an admission nobody waits for");
            }
        }
    }

    /// Marks a waiter as being tried (see [`AdmissionQueue::remove`]);
    /// `false` if it is gone.
    fn start_try(&self, ticket: Ticket) -> bool {
        match self.state.lock().waiters.get_mut(&ticket.0) {
            Some(w) => {
                w.trying = true;
                true
            }
            None => false,
        }
    }

    /// Records a waiter's new refusal; answers when it is tried next, or
    /// `None` when it was leaving (its deadline passed during the attempt)
    /// and is answered with this refusal instead.
    fn refused(&self, ticket: Ticket, d: Box<Denial>) -> Option<Instant> {
        let next_try = retry_at(&d, self.recheck);
        let mut st = self.state.lock();
        if st.waiters.get(&ticket.0).is_some_and(|w| w.leaving) {
            drop(st);
            metrics::counter!("allowance_queue_timeouts_total").increment(1);
            self.finish(ticket, Err(StoreError::Rejected(ReserveError::Denied(d))));
            self.kick.notify_one();
            return None;
        }
        let State {
            waiters, blocked, ..
        } = &mut *st;
        let Some(w) = waiters.get_mut(&ticket.0) else {
            return Some(next_try);
        };
        w.trying = false;
        if w.denial.scope != d.scope {
            blocked.remove(&w.denial.scope, w.seq);
            blocked.add(&d.scope, w.seq);
        }
        w.next_try = next_try;
        w.denial = d;
        w.denied_at = Instant::now();
        Some(next_try)
    }

    fn finish(&self, ticket: Ticket, outcome: Outcome) {
        let tx = {
            let mut st = self.state.lock();
            take(&mut st, &self.waiting, ticket).and_then(|mut w| w.tx.take())
        };
        if let Some(tx) = tx {
            let _ = tx.send(outcome);
        }
    }
}

/// When to try a waiter refused with `d` again: at its `retry_after`, and
/// within `recheck` when given.
fn retry_at(d: &Denial, recheck: Option<Duration>) -> Instant {
    let ms = d.retry_after_ms.unwrap_or(1).max(1);
    // A waiter waits at most `queue.max_wait_ms` (≤ 1 h): a retry past a
    // day is as good as never.
    let wait = Duration::from_millis(ms).min(Duration::from_secs(86_400));
    Instant::now() + recheck.map_or(wait, |r| wait.min(r))
}

/// Waiters by the scope that refused them, and by that scope's kind (the
/// `allowance_queue_depth_by_kind` gauge: what the queue waits on).
#[derive(Default)]
struct Blocked {
    /// The waiters each scope holds up, by arrival.
    by_scope: HashMap<ScopeKey, BTreeSet<u64>>,
    by_kind: HashMap<String, usize>,
}

impl Blocked {
    fn add(&mut self, scope: &ScopeKey, seq: u64) {
        self.by_scope.entry(scope.clone()).or_default().insert(seq);
        let n = self.by_kind.entry(scope.kind().to_string()).or_default();
        *n += 1;
        ::metrics::gauge!("allowance_queue_depth_by_kind", "kind" => scope.kind().to_string())
            .set(*n as f64);
    }

    fn remove(&mut self, scope: &ScopeKey, seq: u64) {
        if let Some(set) = self.by_scope.get_mut(scope) {
            set.remove(&seq);
            if set.is_empty() {
                self.by_scope.remove(scope);
            }
        }
        if let Some(n) = self.by_kind.get_mut(scope.kind()) {
            *n = n.saturating_sub(1);
            ::metrics::gauge!("allowance_queue_depth_by_kind", "kind" => scope.kind().to_string())
                .set(*n as f64);
        }
    }
}

fn take(st: &mut State, waiting: &AtomicUsize, ticket: Ticket) -> Option<Waiter> {
    let w = st.waiters.remove(&ticket.0)?;
    st.blocked.remove(&w.denial.scope, w.seq);
    if let Some(k) = &w.key {
        st.keys.remove(k);
    }
    if let Some(t) = st.tenants.get_mut(&w.tenant) {
        t.order.remove(&(Reverse(w.priority), w.seq));
        if t.order.is_empty() {
            // A tenant that comes back joins at the clock, or where its own
            // admissions left it if that is later.
            let vtime = t.vtime;
            st.tenants.remove(&w.tenant);
            if vtime > st.vclock {
                st.idle_vtime.insert(w.tenant.clone(), vtime);
                if st.idle_vtime.len() > st.idle_prune_at.max(1024) {
                    let vclock = st.vclock;
                    st.idle_vtime.retain(|_, v| *v > vclock);
                    st.idle_prune_at = 2 * st.idle_vtime.len();
                }
            }
        }
    }
    waiting.store(st.waiters.len(), Ordering::SeqCst);
    metrics::gauge!("allowance_queue_depth").set(st.waiters.len() as f64);
    Some(w)
}
