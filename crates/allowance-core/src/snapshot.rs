//! Snapshots: the whole ledger at one instant as a value that encodes
//! (serde, postcard in the durable store), and a ledger rebuilt from one.
//!
//! A snapshot is *logical*: it records what the rules read — per scope its
//! name, the plan it is on, its windows' state words; per remembered
//! reservation the reservation, the amounts sent with an idempotency key,
//! when it may be forgotten and whether its key points at it; per hold its
//! owner, scopes, amounts and expiry; per shard the instant it observed —
//! never a slot, a hash-table layout, a free list or a heap position. A
//! restore rebuilds those through the shard's own insert paths, so a
//! snapshot survives changes to the engine's internal layouts and can be
//! restored into another number of shards (everything is routed again: by
//! the tenant's tag for tenants, their scopes and their reservations, by
//! name for shared scopes).
//!
//! Two things make "the same state" more than the reservations and the
//! windows:
//!
//! - **Plans not yet caught up with.** A scope moves to a new plan lazily,
//!   on its next operation after a catalog change (keeping the history of
//!   every limit whose dimension and window stay). A scope still on an old
//!   plan is recorded with that plan, and restored on it with an epoch no
//!   catalog has, so its next operation makes the same move the source's
//!   would. Which plan a scope moves *to*, and what it keeps, depends only
//!   on the plans' contents, never on which `Arc` holds them.
//! - **Shards at different instants.** Each shard observes time on its own
//!   (expiry is observed lazily), so a shard may still hold its copy of a
//!   hold its reservation's home shard already expired, or the reverse.
//!   Restored into the same number of shards, every shard keeps its own
//!   instant and holds, exactly. Restored into another number, a new shard
//!   takes the latest instant of the shards it is made of and observes it
//!   at once: the holds due by then expire, which for a caller whose clock
//!   never goes back can only make an ended reservation (and its
//!   idempotency key) be forgotten sooner than in the source — when a
//!   reservation is forgotten is the one thing observation time decides.
//!
//! What is not kept: the order in which the idle-scope collector looks at
//! scopes due at the same instant (their slots). No answer shows it, except
//! through a scope two catalog changes behind, whose kept history already
//! depends, in any ledger, on whether the collector reached it between the
//! changes.
//!
//! Restoring checks everything it reads — every reference in range, every
//! name routed where it lives, the state words of every window against its
//! plan — then runs the invariant checks on the result, and refuses with a
//! [`SnapshotError`] saying what is wrong rather than build a ledger that
//! breaks a rule.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use crate::catalog::{Catalog, MAX_SCOPES_LIMIT};
use crate::invariants;
use crate::ops::Router;
use crate::plan::{MAX_LIMITS_PER_PLAN, OverrunPolicy, Plan};
use crate::reservation::{Labels, Reservation, ReservationId, Status};
use crate::scope::{ScopeKey, ScopeSet};
use crate::shard::{
    CopyCut, Hold, HoldScope, NO_SLOT, Record, ScopeState, ShardState, idempotency_key,
};
use crate::shared::{Padded, SharedLedger};
use crate::sync::{Mutex, MutexGuard};
use crate::units::{Amounts, Timestamp};

/// The layout of [`LedgerSnapshot`] this build writes and reads. Decoding
/// another refuses at the first field instead of misreading the rest.
pub const SNAPSHOT_FORMAT: u32 = 1;

/// The epoch a scope still on an old plan is restored with: no catalog has
/// it (they start at 1 and only count up), so the scope re-resolves its plan
/// on its next operation, as it would have in the source.
const STALE_EPOCH: u64 = 0;

/// The whole ledger at one instant (every shard), catalog included.
///
/// Made by [`SharedLedger::snapshot_with`], turned back into a ledger by
/// [`SharedLedger::from_snapshot`]; in between it is only encoded and
/// decoded. Scope names and scope sets are written once each and referred
/// to by number.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LedgerSnapshot {
    format: Format,
    catalog: Catalog,
    /// Plans some scopes are still on after a catalog change they have not
    /// seen yet (the catalog no longer gives them).
    stale_plans: Vec<Arc<Plan>>,
    /// Every scope name the snapshot mentions.
    keys: Vec<ScopeKey>,
    /// Every reservation's scopes, as numbers in `keys`.
    scope_sets: Vec<Vec<u32>>,
    shards: Vec<ShardSnapshot>,
}

impl LedgerSnapshot {
    /// The number of shards of the ledger it was taken from.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The configuration in force when it was taken.
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    /// The number of reservations it remembers (held, and ended within
    /// their retention).
    pub fn reservation_count(&self) -> usize {
        self.shards.iter().map(|s| s.records.len()).sum()
    }
}

/// [`SNAPSHOT_FORMAT`], checked as soon as it is decoded.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[serde(try_from = "u32")]
struct Format(u32);

impl TryFrom<u32> for Format {
    type Error = String;

    fn try_from(v: u32) -> Result<Self, String> {
        if v != SNAPSHOT_FORMAT {
            return Err(format!(
                "snapshot format {v}, this build reads format {SNAPSHOT_FORMAT}"
            ));
        }
        Ok(Format(v))
    }
}

/// One shard: the instant it observed, and what it holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct ShardSnapshot {
    now_ms: u64,
    /// Reservations expired with this shard as their home (a metric).
    expired_count: u64,
    /// In slot order, so a restore into as many shards keeps their order.
    scopes: Vec<ScopeSnapshot>,
    records: Vec<RecordSnapshot>,
    /// Home and foreign holds alike.
    holds: Vec<HoldSnapshot>,
}

/// One scope with state.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct ScopeSnapshot {
    /// Its name, a number in the snapshot's keys.
    key: u32,
    /// `None`: the plan the catalog gives it. `Some(i)`: `stale_plans[i]`.
    stale_plan: Option<u32>,
    /// When its windows were last advanced, then each limit's words.
    words: Vec<u64>,
    /// Sliding limits whose slices outgrew 32 bits: (limit index, slices).
    wide: Vec<(u8, Vec<u64>)>,
    /// When the idle-scope collector looks at it next, if it is queued.
    gc_due_ms: Option<u64>,
}

/// One remembered reservation ([`Reservation`]'s fields, its scope set by
/// number) and what the shard keeps beside it.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct RecordSnapshot {
    id: ReservationId,
    status: Status,
    /// A number in the snapshot's scope sets.
    scopes: u32,
    model: Option<Arc<str>>,
    labels: Option<Labels>,
    held: Amounts,
    created_at: Timestamp,
    expires_at: Timestamp,
    ended_at: Option<Timestamp>,
    charged: Option<Amounts>,
    late: bool,
    overrun: OverrunPolicy,
    idempotency_key: Option<Arc<str>>,
    /// The amounts as sent (kept with an idempotency key only).
    sent: Option<Amounts>,
    /// When it may be forgotten, once ended.
    drop_at_ms: u64,
    /// Whether its tenant's idempotency key points at it (a key outlives
    /// its retention in a record until a new reservation takes it over).
    key_bound: bool,
}

/// One hold: a reservation's amounts on the scopes one shard owns.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct HoldSnapshot {
    owner: ReservationId,
    /// (position in the owner's scopes, name as a number in the keys).
    scopes: Vec<(u8, u32)>,
    amounts: Amounts,
    expires_ms: u64,
}

/// Why a snapshot was not restored: what in it is inconsistent (a corrupt
/// file, or one written by a build with other rules). Nothing was built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    /// The snapshot contradicts itself or the rules; the message says where.
    #[error("inconsistent snapshot: {0}")]
    Inconsistent(String),
}

impl SharedLedger {
    /// Takes every shard lock (ascending) and the catalog, calls `f` while
    /// holding them (the store reads its log position there: no operation
    /// can commit in between), marks every shard as owing its state to
    /// this snapshot, unlocks; then each shard's state is copied by
    /// whoever locks it next (an operation, before it changes anything,
    /// or this call, which locks every shard once): the snapshot is the
    /// ledger at the instant `f` ran, and no operation waits for more than
    /// the copies of the shards it locks.
    ///
    /// The catalog's lock is taken first, as a catalog change takes it.
    /// Reads only: no shard observes anything, so the ledger's answers are
    /// the same as if no snapshot had been taken.
    pub fn snapshot_with<R>(&self, f: impl FnOnce() -> R) -> (R, LedgerSnapshot) {
        let ((), r, snapshot) = self.snapshot_inner(|_| (), f);
        (r, snapshot)
    }

    /// [`SharedLedger::snapshot_with`] for a store that keeps a usage log:
    /// under the same locks, first a [`tick`](SharedLedger::tick_journaled)
    /// at `now` commits the expiries waiting to be reported, so the snapshot
    /// holds none (a snapshot does not carry them). Its ticket comes first.
    pub fn snapshot_journaled<J: crate::Journal, R>(
        &self,
        now: crate::Timestamp,
        journal: &J,
        f: impl FnOnce() -> R,
    ) -> (Option<J::Ticket>, R, LedgerSnapshot) {
        self.snapshot_inner(|guards| SharedLedger::tick_guards(guards, now, journal), f)
    }

    fn snapshot_inner<T, R>(
        &self,
        first: impl FnOnce(&mut [MutexGuard<'_, crate::shard::Shard>]) -> T,
        f: impl FnOnce() -> R,
    ) -> (T, R, LedgerSnapshot) {
        self.snapshot_cut(first, f, || (), PARALLEL_COPY_RECORDS)
    }

    /// [`SharedLedger::snapshot_inner`], calling `between` once every lock
    /// is released and before the shards no operation has touched since
    /// are copied (tests change the ledger there), and copying on several
    /// threads from `parallel_from` remembered reservations on.
    ///
    /// Under every lock only the cut is made: `first`, `f`, and each shard
    /// marked as owing its state to the cut. Each shard's state is then
    /// copied by whoever locks it next — an operation, before it changes
    /// anything, or this snapshot, which locks every shard once after the
    /// cut (on several threads for a large ledger). So the ledger as a
    /// whole never stops for the copy: an operation waits at most for the
    /// copy of the shards it locks. The snapshot's own form (names
    /// interned, maps flattened, references checked) is built from the
    /// copies after that.
    pub(crate) fn snapshot_cut<T, R>(
        &self,
        first: impl FnOnce(&mut [MutexGuard<'_, crate::shard::Shard>]) -> T,
        f: impl FnOnce() -> R,
        between: impl FnOnce(),
        parallel_from: usize,
    ) -> (T, R, LedgerSnapshot) {
        let cut = Arc::new(CopyCut {
            states: crate::sync::Mutex::new(vec![None; self.shards.len()]),
        });
        let catalog_guard = self.catalog.lock();
        let mut guards: Vec<MutexGuard<'_, _>> = self.shards.iter().map(|s| s.lock()).collect();
        let t = first(&mut guards);
        let r = f();
        let catalog = Arc::clone(&catalog_guard);
        let records: usize = guards.iter().map(|g| g.st.records.len()).sum();
        for (i, g) in guards.iter_mut().enumerate() {
            g.copy_to = Some((Arc::downgrade(&cut), i));
        }
        drop(guards);
        drop(catalog_guard);
        between();
        let threads = if records < parallel_from {
            1
        } else {
            copy_threads()
        };
        lock_each(&self.shards, threads);
        let states: Vec<ShardState> = std::mem::take(&mut *cut.states.lock())
            .into_iter()
            .map(|st| st.expect("every shard was locked, so copied, after the cut"))
            .collect();
        let mut w = Writer::new(&catalog);
        let shards = states.iter().map(|st| w.shard(st)).collect();
        drop(states);
        let snapshot = LedgerSnapshot {
            format: Format(SNAPSHOT_FORMAT),
            catalog: (*catalog).clone(),
            stale_plans: w.stale_plans,
            keys: w.keys,
            scope_sets: w.scope_sets,
            shards,
        };
        (t, r, snapshot)
    }

    /// A ledger of `shards` shards (rounded as [`SharedLedger::new`] does)
    /// holding exactly the snapshot's state; see the module documentation
    /// for a snapshot restored into another number of shards.
    pub fn from_snapshot(
        snapshot: LedgerSnapshot,
        shards: usize,
    ) -> Result<SharedLedger, SnapshotError> {
        restore(snapshot, shards).map_err(SnapshotError::Inconsistent)
    }

    /// Every scope that has state (a test helper; order unspecified). An
    /// idle scope may be dropped at any operation that observes its shard,
    /// so two ledgers with the same answers need not list the same scopes:
    /// compare the status of every scope either lists.
    pub fn known_scopes(&self) -> Vec<ScopeKey> {
        let mut out = Vec::new();
        for s in self.shards.iter() {
            let g = s.lock();
            out.extend(g.st.scopes.iter().flatten().map(|sc| sc.key.clone()));
        }
        out
    }

    /// Every remembered reservation id (a test helper; order unspecified).
    pub fn known_reservations(&self) -> Vec<ReservationId> {
        let mut out = Vec::new();
        for s in self.shards.iter() {
            let g = s.lock();
            out.extend(g.st.records.iter().map(|r| r.res.id));
        }
        out
    }
}

/// Remembered reservations past which a snapshot locks (so copies) the
/// shards on more than one thread: below it the copy takes well under a
/// millisecond and starting threads would only add to it.
const PARALLEL_COPY_RECORDS: usize = 50_000;

/// Threads that copy the shards after a snapshot's cut: one per core, at
/// most 8 (the copy is memory-bound; more add little).
fn copy_threads() -> usize {
    if cfg!(allowance_shuttle) {
        // The model checker schedules only its own threads.
        return 1;
    }
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

/// Locks every shard once, on up to `threads` threads, each taking the
/// next shard not yet taken: a shard a snapshot's cut still waits for is
/// copied then (see [`Padded::lock`]). A thread that cannot be started
/// leaves its share to the others.
fn lock_each(shards: &[Padded<Mutex<crate::shard::Shard>>], threads: usize) {
    let threads = threads.min(shards.len());
    if threads <= 1 {
        shards.iter().for_each(|s| drop(s.lock()));
        return;
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let take = || {
        while let Some(s) = shards.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
            drop(s.lock());
        }
    };
    std::thread::scope(|scope| {
        let helpers: Vec<_> = (1..threads)
            .filter_map(|_| {
                std::thread::Builder::new()
                    .name("allowance-snapshot-copy".to_owned())
                    .spawn_scoped(scope, take)
                    .ok()
            })
            .collect();
        take();
        for helper in helpers {
            if let Err(panic) = helper.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
}

/// Builds a snapshot's tables while walking the shards.
struct Writer<'a> {
    catalog: &'a Catalog,
    keys: Vec<ScopeKey>,
    key_numbers: HashMap<ScopeKey, u32>,
    scope_sets: Vec<Vec<u32>>,
    set_numbers: HashMap<Vec<u32>, u32>,
    stale_plans: Vec<Arc<Plan>>,
    plan_numbers: HashMap<*const Plan, u32>,
}

impl<'a> Writer<'a> {
    fn new(catalog: &'a Catalog) -> Self {
        Writer {
            catalog,
            keys: Vec::new(),
            key_numbers: HashMap::new(),
            scope_sets: Vec::new(),
            set_numbers: HashMap::new(),
            stale_plans: Vec::new(),
            plan_numbers: HashMap::new(),
        }
    }

    fn key(&mut self, key: &ScopeKey) -> u32 {
        if let Some(&n) = self.key_numbers.get(key) {
            return n;
        }
        let n = self.keys.len() as u32;
        self.keys.push(key.clone());
        self.key_numbers.insert(key.clone(), n);
        n
    }

    fn scope_set(&mut self, set: &ScopeSet) -> u32 {
        let numbers: Vec<u32> = set.as_slice().iter().map(|k| self.key(k)).collect();
        if let Some(&n) = self.set_numbers.get(&numbers) {
            return n;
        }
        let n = self.scope_sets.len() as u32;
        self.scope_sets.push(numbers.clone());
        self.set_numbers.insert(numbers, n);
        n
    }

    /// `None` when the scope is on the plan the catalog gives it.
    fn plan(&mut self, st: &ScopeState) -> Option<u32> {
        if Arc::ptr_eq(&st.plan, self.catalog.plan_for(&st.key)) {
            return None;
        }
        let ptr = Arc::as_ptr(&st.plan);
        if let Some(&n) = self.plan_numbers.get(&ptr) {
            return Some(n);
        }
        let n = self.stale_plans.len() as u32;
        self.stale_plans.push(st.plan.clone());
        self.plan_numbers.insert(ptr, n);
        Some(n)
    }

    fn shard(&mut self, st: &ShardState) -> ShardSnapshot {
        let gc_due: HashMap<u32, u64> = st.gc.iter().map(|e| (e.0.1, e.0.0)).collect();
        let mut scopes = Vec::with_capacity(st.index.len());
        for (slot, sc) in st.scopes.iter().enumerate() {
            let Some(sc) = sc else { continue };
            let wide = sc.extra.as_ref().map_or_else(Vec::new, |e| {
                e.wide.iter().map(|(k, w)| (*k, w.to_vec())).collect()
            });
            scopes.push(ScopeSnapshot {
                key: self.key(&sc.key),
                stale_plan: self.plan(sc),
                words: sc.words.to_vec(),
                wide,
                gc_due_ms: gc_due.get(&(slot as u32)).copied(),
            });
        }
        let mut records = Vec::with_capacity(st.records.len());
        for rec in st.records.iter() {
            let r = &rec.res;
            let key_bound = r.idempotency_key.as_ref().is_some_and(|k| {
                let k = idempotency_key(r.scopes.tenant_name(), k);
                st.idempotency.get(&k) == Some(&r.id)
            });
            records.push(RecordSnapshot {
                id: r.id,
                status: r.status,
                scopes: self.scope_set(&r.scopes),
                model: r.model.clone(),
                labels: r.labels.clone(),
                held: r.held.clone(),
                created_at: r.created_at,
                expires_at: r.expires_at,
                ended_at: r.ended_at,
                charged: r.charged.clone(),
                late: r.late,
                overrun: r.overrun,
                idempotency_key: r.idempotency_key.clone(),
                sent: rec.sent.as_deref().cloned(),
                drop_at_ms: rec.drop_at,
                key_bound,
            });
        }
        let mut holds = Vec::with_capacity(st.expiry.len());
        for hold in st.holds.iter().flatten() {
            let mut scopes = Vec::with_capacity(hold.scopes.len());
            for hs in &hold.scopes {
                // A scope with holds is never dropped (an invariant).
                if let Some(Some(sc)) = st.scopes.get(hs.slot as usize) {
                    scopes.push((hs.index, self.key(&sc.key)));
                }
            }
            holds.push(HoldSnapshot {
                owner: hold.owner,
                scopes,
                amounts: hold.amounts.clone(),
                expires_ms: hold.expires_ms,
            });
        }
        ShardSnapshot {
            now_ms: st.now_ms,
            expired_count: st.expired_count,
            scopes,
            records,
            holds,
        }
    }
}

/// A hold's scopes: (position in the owner's scopes, name).
type HoldScopes = Vec<(u8, ScopeKey)>;

/// A hold being rebuilt in one new shard, from one or more old holds.
struct Group {
    owner: ReservationId,
    scopes: HoldScopes,
    amounts: Amounts,
    expires_ms: u64,
}

/// [`SharedLedger::from_snapshot`], with the reason as a message: the
/// scopes first (holds find them by name), then the reservations, then the
/// holds, then the checks.
fn restore(snapshot: LedgerSnapshot, shards: usize) -> Result<SharedLedger, String> {
    let LedgerSnapshot {
        format: _,
        catalog,
        stale_plans,
        keys,
        scope_sets,
        shards: mut old,
    } = snapshot;
    let n_old = old.len();
    if !(1..=256).contains(&n_old) || !n_old.is_power_of_two() {
        return Err(format!(
            "{n_old} shards: a ledger has a power of two of them, 1 to 256"
        ));
    }
    let ledger = SharedLedger::new(catalog, shards);
    let catalog = ledger.catalog();
    let mut r = Rebuild::new(&catalog, keys, ledger.shard_count(), &old);
    r.sets(&scope_sets)?;
    for (i, o) in old.iter_mut().enumerate() {
        r.scopes(i, std::mem::take(&mut o.scopes), &stale_plans)?;
    }
    for (i, o) in old.iter_mut().enumerate() {
        r.records(i, std::mem::take(&mut o.records))?;
    }
    r.queue_ended();
    for (i, o) in old.iter_mut().enumerate() {
        r.group_holds(i, std::mem::take(&mut o.holds))?;
    }
    r.holds()?;
    let parts = r.finish()?;
    for (shard, st) in ledger.shards.iter().zip(parts) {
        shard.lock().st = st;
    }
    Ok(ledger)
}

/// The shards being rebuilt, and what the snapshot's numbers refer to.
struct Rebuild<'a> {
    catalog: &'a Catalog,
    router: Router,
    /// The shard count differs from the snapshot's: everything moves to
    /// where it routes now, instead of having to be where it routes.
    resharded: bool,
    keys: Vec<ScopeKey>,
    sets: Vec<ScopeSet>,
    parts: Vec<ShardState>,
    /// Ended reservations per shard, unkeyed then keyed: (drop at, id).
    ended: Vec<[Vec<(u64, ReservationId)>; 2]>,
    /// Holds per shard, and where each owner's is among them.
    groups: Vec<Vec<Group>>,
    group_of: HashMap<(usize, ReservationId), usize>,
}

impl<'a> Rebuild<'a> {
    /// Empty shards at their instants: shard `j` of `n` is made of the
    /// shards `i` of the snapshot with `i ≡ j` modulo the smaller count
    /// (routing keeps the low bits of a tag), and starts at the latest of
    /// their instants.
    fn new(catalog: &'a Catalog, keys: Vec<ScopeKey>, n: usize, old: &[ShardSnapshot]) -> Self {
        let m = n.min(old.len());
        let mut parts: Vec<ShardState> = (0..n).map(|_| ShardState::default()).collect();
        for (i, o) in old.iter().enumerate() {
            for (j, p) in parts.iter_mut().enumerate() {
                if i % m == j % m {
                    p.now_ms = p.now_ms.max(o.now_ms);
                }
            }
            let p = &mut parts[i % n];
            p.expired_count = p.expired_count.saturating_add(o.expired_count);
        }
        Rebuild {
            catalog,
            router: Router::new(n),
            resharded: n != old.len(),
            keys,
            sets: Vec::new(),
            parts,
            ended: (0..n).map(|_| Default::default()).collect(),
            groups: (0..n).map(|_| Vec::new()).collect(),
            group_of: HashMap::new(),
        }
    }

    fn key(&self, i: u32) -> Result<&ScopeKey, String> {
        self.keys
            .get(i as usize)
            .ok_or_else(|| format!("scope #{i} is not among the {} names", self.keys.len()))
    }

    /// Where something found in shard `from` goes: where it routes (`to`),
    /// which must be `from` itself when the shard count is the same.
    fn place(&self, what: &dyn std::fmt::Display, from: usize, to: usize) -> Result<usize, String> {
        if self.resharded || from == to {
            Ok(to)
        } else {
            Err(format!(
                "{what} is in shard {from} but routes to shard {to}"
            ))
        }
    }

    /// The scope sets, each checked as a reservation's.
    fn sets(&mut self, scope_sets: &[Vec<u32>]) -> Result<(), String> {
        for (i, numbers) in scope_sets.iter().enumerate() {
            if numbers.len() > MAX_SCOPES_LIMIT {
                return Err(format!("scope set #{i} has {} scopes", numbers.len()));
            }
            let keys = numbers
                .iter()
                .map(|&k| self.key(k).cloned())
                .collect::<Result<Vec<_>, _>>()?;
            let set = ScopeSet::from_keys(keys).map_err(|e| format!("scope set #{i}: {e}"))?;
            self.sets.push(set);
        }
        Ok(())
    }

    /// Shard `i`'s scopes, on their plans, with their words checked.
    fn scopes(
        &mut self,
        i: usize,
        scopes: Vec<ScopeSnapshot>,
        stale_plans: &[Arc<Plan>],
    ) -> Result<(), String> {
        for sc in scopes {
            let k = self.key(sc.key)?.clone();
            let j = self.place(&k, i, self.router.of_scope(&k))?;
            let plan = match sc.stale_plan {
                None => (self.catalog.plan_for(&k).clone(), self.catalog.epoch()),
                Some(p) => {
                    let plan = stale_plans.get(p as usize).ok_or_else(|| {
                        format!("{k} is on plan #{p}, which is not in the snapshot")
                    })?;
                    (plan.clone(), STALE_EPOCH)
                }
            };
            if sc.wide.len() > MAX_LIMITS_PER_PLAN {
                return Err(format!("{k} has {} wide windows", sc.wide.len()));
            }
            let wide = sc
                .wide
                .into_iter()
                .map(|(limit, slices)| (limit, slices.into_boxed_slice()))
                .collect();
            let st = ScopeState::restored(k.clone(), plan, sc.words.into(), wide)
                .map_err(|e| format!("{k}: {e}"))?;
            self.parts[j].restore_scope(st, sc.gc_due_ms)?;
        }
        Ok(())
    }

    /// Shard `i`'s reservations, each in its tenant's shard, with the
    /// idempotency keys bound to them.
    fn records(&mut self, i: usize, records: Vec<RecordSnapshot>) -> Result<(), String> {
        for r in records {
            let id = r.id;
            let scopes = self
                .sets
                .get(r.scopes as usize)
                .ok_or_else(|| format!("{id} has scope set #{}, not in the snapshot", r.scopes))?
                .clone();
            if id.tag() != scopes.tenant_tag() {
                return Err(format!("{id} was not minted for {}", scopes.tenant()));
            }
            let j = self.place(&id, i, self.router.of_id(id))?;
            let multi_shard = scopes
                .as_slice()
                .iter()
                .any(|k| self.router.of_scope(k) != j);
            let part = &mut self.parts[j];
            if part.records.contains(id) {
                return Err(format!("{id} is remembered twice"));
            }
            if r.sent.is_some() != r.idempotency_key.is_some() {
                return Err(format!(
                    "{id} keeps the amounts sent without an idempotency key, or the reverse"
                ));
            }
            if r.key_bound {
                let Some(key) = &r.idempotency_key else {
                    return Err(format!("{id} is bound to an idempotency key it has not"));
                };
                let k = idempotency_key(scopes.tenant_name(), key);
                if part.idempotency.insert(k, id).is_some() {
                    return Err(format!(
                        "{id}'s idempotency key {key:?} is bound to two reservations"
                    ));
                }
            }
            if r.status != Status::Held {
                let keyed = usize::from(r.idempotency_key.is_some());
                self.ended[j][keyed].push((r.drop_at_ms, id));
            }
            part.records.insert(id, || Record {
                res: Reservation {
                    id,
                    status: r.status,
                    scopes,
                    model: r.model,
                    labels: r.labels,
                    held: r.held,
                    created_at: r.created_at,
                    expires_at: r.expires_at,
                    ended_at: r.ended_at,
                    charged: r.charged,
                    late: r.late,
                    overrun: r.overrun,
                    idempotency_key: r.idempotency_key,
                },
                sent: r.sent.map(Box::new),
                hold_slot: NO_SLOT,
                multi_shard,
                drop_at: r.drop_at_ms,
            });
            part.multi_shard_records += usize::from(multi_shard);
        }
        Ok(())
    }

    /// The queues of ended reservations. Forgetting pops a queue while its
    /// front is due: in drop order, each ended reservation once (the
    /// source's queues may also hold entries a later settle made stale,
    /// which forget nothing).
    fn queue_ended(&mut self) {
        let ended = std::mem::take(&mut self.ended);
        for (part, [unkeyed, keyed]) in self.parts.iter_mut().zip(ended) {
            for (queue, mut entries) in [(&mut part.ended, unkeyed), (&mut part.ended_keyed, keyed)]
            {
                entries.sort_by_key(|&(at, _)| at);
                queue.extend(entries);
            }
        }
    }

    /// Shard `i`'s holds, split by the shard each scope routes to and
    /// merged with the other parts of the same hold that land there.
    fn group_holds(&mut self, i: usize, holds: Vec<HoldSnapshot>) -> Result<(), String> {
        for h in holds {
            let owner = h.owner;
            if h.scopes.is_empty() || h.scopes.len() > MAX_SCOPES_LIMIT {
                return Err(format!("a hold of {owner} on {} scopes", h.scopes.len()));
            }
            let mut by_shard: SmallVec<[(usize, HoldScopes); 2]> = SmallVec::new();
            for (index, k) in h.scopes {
                let k = self.key(k)?.clone();
                let what = format_args!("a hold of {owner} on {k}");
                let j = self.place(&what, i, self.router.of_scope(&k))?;
                match by_shard.iter_mut().find(|(s, _)| *s == j) {
                    Some((_, v)) => v.push((index, k)),
                    None => by_shard.push((j, vec![(index, k)])),
                }
            }
            for (j, scopes) in by_shard {
                let part = Group {
                    owner,
                    scopes,
                    amounts: h.amounts.clone(),
                    expires_ms: h.expires_ms,
                };
                self.merge_hold(j, part)?;
            }
        }
        Ok(())
    }

    /// Adds one part of a hold to shard `j`'s.
    fn merge_hold(&mut self, j: usize, part: Group) -> Result<(), String> {
        let owner = part.owner;
        let Some(&g) = self.group_of.get(&(j, owner)) else {
            self.group_of.insert((j, owner), self.groups[j].len());
            self.groups[j].push(part);
            return Ok(());
        };
        if !self.resharded {
            return Err(format!("{owner} holds twice in shard {j}"));
        }
        let now = self.parts[j].now_ms;
        let g = &mut self.groups[j][g];
        if g.amounts == part.amounts && g.expires_ms == part.expires_ms {
            // Two shards' parts of one hold, now in one shard.
            g.scopes.extend(part.scopes);
            return Ok(());
        }
        // Otherwise one is a copy of an expired hold that its shard had yet
        // to observe (its id since reused, as the later one shows): due
        // here, it goes. The later one is kept.
        let newer = part.expires_ms > g.expires_ms;
        let older_expiry = g.expires_ms.min(part.expires_ms);
        if older_expiry > now {
            return Err(format!("two holds of {owner} in shard {j} differ"));
        }
        if newer {
            *g = part;
        }
        Ok(())
    }

    /// Adds the grouped holds to their shards: a home hold to its
    /// reservation, which must be HELD with the same amounts and expiry; a
    /// foreign one to the shard's index of foreign holds.
    fn holds(&mut self) -> Result<(), String> {
        let groups = std::mem::take(&mut self.groups);
        for (j, (part, gs)) in self.parts.iter_mut().zip(groups).enumerate() {
            for mut g in gs {
                let owner = g.owner;
                g.scopes.sort_by_key(|&(index, _)| index);
                for (a, (ia, ka)) in g.scopes.iter().enumerate() {
                    if g.scopes[..a].iter().any(|(ib, kb)| ib == ia || kb == ka) {
                        return Err(format!("{owner} holds twice on {ka} in shard {j}"));
                    }
                }
                let home = self.router.of_id(owner) == j;
                if home {
                    let matches = part.records.get(owner).is_some_and(|r| {
                        r.res.status == Status::Held
                            && r.hold_slot == NO_SLOT
                            && r.res.held == g.amounts
                            && r.res.expires_at.as_millis() == g.expires_ms
                    });
                    if !matches {
                        // A copy of a hold its home already expired, now
                        // in that home: it would be expired on the spot.
                        if self.resharded && g.expires_ms <= part.now_ms {
                            continue;
                        }
                        return Err(format!(
                            "a hold of {owner} in shard {j} matches no held reservation"
                        ));
                    }
                }
                let mut scopes: SmallVec<[HoldScope; 4]> = SmallVec::new();
                for (index, k) in &g.scopes {
                    let slot = part
                        .slot_of(k)
                        .ok_or_else(|| format!("{owner} holds on {k}, which has no state"))?;
                    scopes.push(HoldScope {
                        index: *index,
                        slot,
                        pos: NO_SLOT,
                    });
                }
                let slot = part.add_hold(Hold {
                    owner,
                    foreign: !home,
                    scopes,
                    amounts: g.amounts,
                    expires_ms: g.expires_ms,
                    heap_pos: NO_SLOT,
                });
                if home {
                    if let Some(rec) = part.records.get_mut(owner) {
                        rec.hold_slot = slot;
                    }
                } else {
                    part.foreign.insert(owner, slot);
                }
            }
        }
        Ok(())
    }

    /// Shards made of several observe their instant now (what is due by
    /// then expires, as any operation would first do); then every invariant
    /// is checked, each shard's and across shards.
    fn finish(mut self) -> Result<Vec<ShardState>, String> {
        if self.resharded {
            for part in self.parts.iter_mut() {
                let now = part.now_ms;
                part.observe(self.catalog, now, 0);
            }
        }
        for (j, part) in self.parts.iter().enumerate() {
            invariants::check_shard(j, part)?;
        }
        let states: Vec<&ShardState> = self.parts.iter().collect();
        invariants::check_routes(&states, self.router)?;
        Ok(self.parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Dimension, Limit, ReserveRequest, Usage, Window};

    /// A ledger of 16 shards with reservations held, settled and
    /// remembered in most of them.
    fn busy_ledger() -> SharedLedger {
        let hour = Window::Sliding {
            period_ms: 3_600_000,
            slices: 60,
        };
        let mut catalog = Catalog::default();
        let plan = Plan::new(
            "p",
            vec![Limit::new(Dimension::TOKENS, 1 << 40, hour).expect("limit")],
            OverrunPolicy::ChargeActual,
        )
        .expect("plan");
        catalog.set_plan(plan);
        catalog.set_kind("tenant", Some("p"), false).expect("kind");
        catalog.set_kind("user", Some("p"), false).expect("kind");
        catalog.set_kind("tool", Some("p"), true).expect("kind");
        let ledger = SharedLedger::new(catalog, 16);
        let now = Timestamp::from_millis(1_700_000_000_000);
        for i in 0..600u64 {
            let tenant = format!("t{}", i % 37);
            let user = format!("u{}", i % 11);
            let mut pairs = vec![("user", user.as_str())];
            if i % 5 == 0 {
                pairs.push(("tool", "search"));
            }
            let scopes = ledger.catalog().scope_set(&tenant, &pairs).expect("scopes");
            let id = ReservationId::mint(u128::from(i + 1) << 8, &tenant);
            let req = ReserveRequest::new(scopes, Amounts::new().with(Dimension::TOKENS, 10 + i));
            ledger.reserve(now, id, &req).expect("reserve");
            if i % 3 != 0 {
                let usage = Usage {
                    amounts: Amounts::new().with(Dimension::TOKENS, i),
                    ..Usage::default()
                };
                ledger.settle(now, id, &usage).expect("settle");
            }
        }
        ledger
    }

    fn encoded(snapshot: &LedgerSnapshot) -> Vec<u8> {
        postcard::to_allocvec(snapshot).expect("encode")
    }

    /// More of the same traffic, on every shard.
    fn more(ledger: &SharedLedger, from: u64) {
        let now = Timestamp::from_millis(1_700_000_000_000);
        for i in from..from + 200 {
            let tenant = format!("t{}", i % 37);
            let scopes = ledger
                .catalog()
                .scope_set(&tenant, &[("tool", "search")])
                .expect("scopes");
            let id = ReservationId::mint(u128::from(i + 1) << 8, &tenant);
            let req = ReserveRequest::new(scopes, Amounts::new().with(Dimension::TOKENS, 1));
            ledger.reserve(now, id, &req).expect("reserve");
        }
    }

    /// A snapshot is the ledger at its cut: operations made after it, on
    /// shards the snapshot has not copied yet, copy their shard first and
    /// are not in it — whether one thread or several copy the rest.
    #[test]
    fn a_snapshot_is_the_ledger_at_its_cut() {
        for (threads_from, shift) in [(usize::MAX, 0), (0, 1_000)] {
            let ledger = busy_ledger();
            let cut =
                |between: &dyn Fn()| ledger.snapshot_cut(|_| (), || (), between, threads_from).2;
            let before = encoded(&cut(&|| ()));
            // Operations on every shard between the cut and the copy.
            let during = encoded(&cut(&|| more(&ledger, 10_000 + shift)));
            assert_eq!(during, before, "copied from {threads_from} records on");
            // They are in the next one, and the ledger is whole.
            let after = cut(&|| ());
            assert_ne!(encoded(&after), before);
            let restored = SharedLedger::from_snapshot(after, 16).expect("restore");
            assert_eq!(restored.known_reservations().len(), 800);
            let now = Timestamp::from_millis(1_700_000_000_000);
            ledger.check_invariants(now).expect("invariants");
            // No shard still owes a copy to a finished snapshot.
            assert!(ledger.shards.iter().all(|s| s.0.lock().copy_to.is_none()));
        }
    }
}
