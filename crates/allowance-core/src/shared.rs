//! [`SharedLedger`]: the ledger for many threads, with no global lock.

use std::sync::Arc;

use smallvec::SmallVec;

use crate::catalog::Catalog;
use crate::error::{AdminError, ExtendError, Invalid, RefundError, ReserveError, SettleError};
use crate::invariants;
use crate::ops::{Locked, Router};
use crate::reservation::{
    Granted, Reservation, ReservationId, ReserveRequest, ScopeStatus, Status, Usage,
};
use crate::scope::ScopeKey;
use crate::shard::{Shard, ShardState};
use crate::sync::{Mutex, MutexGuard};
use crate::units::{Amounts, Dimension, Timestamp};
use crate::usage::{Adjustment, UsageEvent, UsageKind};

/// Keeps each shard's lock on its own cache line, so threads working on
/// different tenants do not slow each other down through false sharing.
#[repr(align(128))]
#[derive(Debug)]
pub(crate) struct Padded<T>(pub(crate) T);

impl Padded<Mutex<Shard>> {
    /// Locks the shard. If a snapshot's cut still waits for this shard's
    /// state, the state is copied there first, before the caller can change
    /// it: a snapshot stops each shard only for that shard's own copy.
    #[inline]
    pub(crate) fn lock(&self) -> MutexGuard<'_, Shard> {
        let mut g = self.0.lock();
        if g.copy_to.is_some() {
            g.copy_out();
        }
        g
    }
}

/// What a settle, refund or extend answers without copying the whole
/// reservation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The reservation's status after the operation.
    pub status: Status,
    /// Whether a settle came after expiry.
    pub late: bool,
    /// What was recorded (settled only).
    pub charged: Option<Amounts>,
    /// What is (or was last) held.
    pub held: Amounts,
    /// When the hold expires (or expired).
    pub expires_at: Timestamp,
}

/// The refusal of a reservation id minted for another tenant.
fn foreign_id() -> ReserveError {
    Invalid::new("id", "the reservation id was not minted for this tenant").into()
}

impl From<&Reservation> for Outcome {
    fn from(r: &Reservation) -> Self {
        Outcome {
            status: r.status,
            late: r.late,
            charged: r.charged.clone(),
            held: r.held.clone(),
            expires_at: r.expires_at,
        }
    }
}

/// A change the ledger applied, as the command that reproduces it.
///
/// Handed to a [`Journal`] while the operation's shard locks are still
/// held, so for every shard the journal's order is the order the shard
/// applied its changes: replaying the journal through the same engine, with
/// the same instants, rebuilds the same state. `now` is the instant the
/// operation used (the clock's reading, or later if a shard had already
/// observed a later one), never the wall clock at replay.
///
/// It serializes (serde) as the record a write-ahead log keeps; a decoder
/// mirrors its variants in this order.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub enum Committed<'a> {
    /// A reserve that held something (not a dry run, not an idempotent repeat).
    Reserve {
        /// The instant used.
        now: Timestamp,
        /// The minted id.
        id: ReservationId,
        /// The request as received.
        req: &'a ReserveRequest,
    },
    /// A settle that was accepted (a repeat included: replaying it is harmless).
    Settle {
        /// The instant used.
        now: Timestamp,
        /// The reservation.
        id: ReservationId,
        /// The usage as received.
        usage: &'a Usage,
    },
    /// A refund that was accepted.
    Refund {
        /// The instant used.
        now: Timestamp,
        /// The reservation.
        id: ReservationId,
    },
    /// An extend that was accepted.
    Extend {
        /// The instant used.
        now: Timestamp,
        /// The reservation.
        id: ReservationId,
        /// The new hold, if given.
        amounts: Option<&'a Amounts>,
        /// The new time to live, if given.
        ttl_ms: Option<u64>,
    },
    /// An admin credit or debit.
    Adjust {
        /// The instant used.
        now: Timestamp,
        /// The scope adjusted.
        scope: &'a ScopeKey,
        /// The dimension adjusted.
        dimension: Dimension,
        /// Positive: a credit; negative: a debit.
        credit: i64,
        /// Why (for the usage log).
        reason: &'a str,
    },
    /// A configuration change (every shard's lock is held).
    Catalog(&'a crate::store::CatalogChange),
    /// Every shard observed `now` and reported its expiries (the sweeper,
    /// when some were waiting to be reported, or a snapshot).
    Tick {
        /// The instant every shard observed.
        now: Timestamp,
    },
}

/// Where a [`SharedLedger`] reports the changes it applied (a write-ahead
/// log). `commit` runs under shard locks: it must only queue (no I/O, no
/// waiting) and must never call back into the ledger.
pub trait Journal {
    /// What the caller gets back to wait on (e.g. the log position).
    type Ticket;
    /// Whether this journal keeps a usage log: then each commit comes with
    /// its [`UsageEvent`]s (the expiries its shards reported since their
    /// last commit, then its own settle, refund or adjustment), which costs
    /// a copy of each reservation that ended. The ledger must also have
    /// been told to [`report_usage`](SharedLedger::report_usage).
    const USAGE: bool = false;
    /// Records one applied change and, if [`Journal::USAGE`], its usage events.
    fn commit(&self, change: &Committed<'_>, usage: Vec<UsageEvent>) -> Self::Ticket;
}

/// The journal of a ledger that keeps nothing (memory only): free.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoJournal;

impl Journal for NoJournal {
    type Ticket = ();
    #[inline(always)]
    fn commit(&self, _change: &Committed<'_>, _usage: Vec<UsageEvent>) {}
}

/// The expiries the locked shards reported since their last commit, as
/// usage events (empty unless the journal keeps a usage log).
fn drained<J: Journal>(l: &mut Locked<'_>) -> Vec<UsageEvent> {
    let mut out = Vec::new();
    if !J::USAGE {
        return out;
    }
    for (_, st) in l.parts.iter_mut() {
        drain_shard(st, &mut out);
    }
    out
}

/// Moves a shard's reported expiries into `out`, each as the reservation
/// was when it expired (a late settle in the same operation comes after).
fn drain_shard(st: &mut ShardState, out: &mut Vec<UsageEvent>) {
    for res in std::mem::take(&mut st.expired_outbox) {
        out.push(UsageEvent::ended(UsageKind::Expired, res.expires_at, res));
    }
}

/// The status of a reservation the home shard remembers, before an
/// operation: tells a settle or refund from its repeat (which changes
/// nothing and is not a second usage record).
fn status_before(l: &Locked<'_>, id: ReservationId) -> Option<crate::reservation::Status> {
    l.parts[l.home].1.records.get(id).map(|r| r.res.status)
}

/// A reservation's end as a usage event.
fn ended(kind: UsageKind, res: &Reservation) -> UsageEvent {
    UsageEvent::ended(kind, res.ended_at.unwrap_or(res.expires_at), res.clone())
}

/// The instant an operation used: the home shard observed it last.
#[inline]
fn used_now(l: &Locked<'_>) -> Timestamp {
    Timestamp::from_millis(l.parts[l.home].1.now_ms)
}

/// The ledger shared by many threads: linearizable, with no global lock.
///
/// State is split into shards, each behind its own mutex: a tenant and all
/// its scopes and reservations live in one shard (chosen by a stable hash of
/// the tenant, which [`ReservationId::mint`] also stamps into ids), and
/// shared scopes are spread over the shards by name. An operation locks the
/// shards it touches in ascending order (no deadlock), runs the same
/// transition as [`Ledger`](crate::Ledger), and unlocks: operations on
/// tenants in different shards run in parallel, and no lock is held longer
/// than the in-memory update.
///
/// ```
/// use allowance_core::*;
/// let mut catalog = Catalog::default();
/// let plan = Plan::new("t", vec![Limit::new(Dimension::TOKENS, 1000, Window::Total).unwrap()], OverrunPolicy::ChargeActual).unwrap();
/// catalog.set_plan(plan);
/// catalog.set_kind("tenant", Some("t"), false).unwrap();
/// let ledger = SharedLedger::new(catalog, 16);
/// let req = ReserveRequest::new(ledger.catalog().scope_set("acme", &[]).unwrap(),
///                               Amounts::new().with(Dimension::TOKENS, 600));
/// let now = Timestamp::from_millis(1_000);
/// let id = ReservationId::mint(0xfeed_f00d_dead_beef_0000_1111_2222_3333, "acme");
/// ledger.reserve(now, id, &req).unwrap();
/// ledger.settle(now, id, &Usage { amounts: Amounts::new().with(Dimension::TOKENS, 250), ..Usage::default() }).unwrap();
/// let status = ledger.status(now, req.scopes.tenant());
/// assert_eq!(status.limits[0].remaining, 750);
/// ```
#[derive(Debug)]
pub struct SharedLedger {
    pub(crate) shards: Box<[Padded<Mutex<Shard>>]>,
    pub(crate) router: Router,
    pub(crate) catalog: Mutex<Arc<Catalog>>,
}

impl SharedLedger {
    /// A ledger of `shards` shards (rounded up to a power of two, at most
    /// 256; a few times the number of cores is plenty).
    pub fn new(catalog: Catalog, shards: usize) -> Self {
        let n = shards.clamp(1, 256).next_power_of_two();
        let catalog = Arc::new(catalog);
        SharedLedger {
            shards: (0..n)
                .map(|_| {
                    Padded(Mutex::new(Shard {
                        catalog: catalog.clone(),
                        st: ShardState::default(),
                        copy_to: None,
                    }))
                })
                .collect(),
            router: Router::new(n),
            catalog: Mutex::new(catalog),
        }
    }

    /// The configuration in force.
    pub fn catalog(&self) -> Arc<Catalog> {
        self.catalog.lock().clone()
    }

    /// Changes the configuration, effective for the next operation of every
    /// shard. `f` sees a copy; an error changes nothing.
    pub fn update_catalog<R, E>(
        &self,
        f: impl FnOnce(&mut Catalog) -> Result<R, E>,
    ) -> Result<R, E> {
        let mut current = self.catalog.lock();
        let mut next = (**current).clone();
        let r = f(&mut next)?;
        let next = Arc::new(next);
        for s in self.shards.iter() {
            s.lock().catalog = next.clone();
        }
        *current = next;
        Ok(r)
    }

    /// Applies an admin change and journals it, ordered against every
    /// shard's operations: all shard locks are held (ascending) while the
    /// catalog is swapped and the change committed, so a replay sees it
    /// exactly between the same operations as the live ledger did.
    pub fn change_catalog_journaled<J: Journal>(
        &self,
        change: &crate::store::CatalogChange,
        configured: &Catalog,
        journal: &J,
    ) -> Result<J::Ticket, AdminError> {
        let mut current = self.catalog.lock();
        let mut next = (**current).clone();
        change.apply_on(&mut next, configured)?;
        let next = Arc::new(next);
        let mut guards: Vec<MutexGuard<'_, Shard>> = self.shards.iter().map(|s| s.lock()).collect();
        for g in guards.iter_mut() {
            g.catalog = next.clone();
        }
        *current = next;
        // A catalog change observes nothing: it reports no expiries.
        Ok(journal.commit(&Committed::Catalog(change), Vec::new()))
    }

    /// Turns on expiry reporting for the usage log (a store that keeps one
    /// calls this once, before serving).
    pub fn report_usage(&self) {
        for s in self.shards.iter() {
            s.lock().st.report_expiries = true;
        }
    }

    /// Whether some shard has expiries waiting to be reported (a cheap
    /// check before a [`tick_journaled`](SharedLedger::tick_journaled)).
    pub fn has_unreported_expiries(&self) -> bool {
        self.shards
            .iter()
            .any(|s| !s.lock().st.expired_outbox.is_empty())
    }

    /// Every shard observes `now` (or the latest instant any shard saw, if
    /// later) under every lock, and the expiries waiting to be reported are
    /// committed as a [`Committed::Tick`]; nothing is committed when there
    /// are none. The sweeper calls this so an idle shard's expiries reach
    /// the usage log without waiting for the next operation there.
    pub fn tick_journaled<J: Journal>(&self, now: Timestamp, journal: &J) -> Option<J::Ticket> {
        let mut guards: Vec<MutexGuard<'_, Shard>> = self.shards.iter().map(|s| s.lock()).collect();
        Self::tick_guards(&mut guards, now, journal)
    }

    /// [`SharedLedger::tick_journaled`] with every shard already locked.
    pub(crate) fn tick_guards<J: Journal>(
        guards: &mut [MutexGuard<'_, Shard>],
        now: Timestamp,
        journal: &J,
    ) -> Option<J::Ticket> {
        // One instant for all, as a replay of the tick will use.
        let now = guards
            .iter()
            .map(|g| g.st.now_ms)
            .fold(now.as_millis(), u64::max);
        let mut events = Vec::new();
        for g in guards.iter_mut() {
            let Shard { catalog, st, .. } = &mut **g;
            st.observe(catalog, now, 0);
            drain_shard(st, &mut events);
        }
        if events.is_empty() {
            return None;
        }
        Some(journal.commit(
            &Committed::Tick {
                now: Timestamp::from_millis(now),
            },
            events,
        ))
    }

    /// Replaces the whole configuration (a restart with an edited file),
    /// under every shard lock. Not journaled: the caller logs what it needs.
    pub fn replace_catalog(&self, mut catalog: Catalog) {
        let mut current = self.catalog.lock();
        catalog.follow_epoch(current.epoch());
        let next = Arc::new(catalog);
        let mut guards: Vec<MutexGuard<'_, Shard>> = self.shards.iter().map(|s| s.lock()).collect();
        for g in guards.iter_mut() {
            g.catalog = next.clone();
        }
        *current = next;
    }

    /// Runs `f` with the given shards locked (ascending, deduplicated).
    fn with_shards<R>(
        &self,
        shards: &[usize],
        home: usize,
        f: impl FnOnce(&mut Locked<'_>) -> R,
    ) -> R {
        let mut guards: SmallVec<[MutexGuard<'_, Shard>; 4]> =
            shards.iter().map(|&i| self.shards[i].lock()).collect();
        let mut catalog = None;
        let mut parts = SmallVec::new();
        for (k, g) in guards.iter_mut().enumerate() {
            let Shard { catalog: c, st, .. } = &mut **g;
            if shards[k] == home {
                catalog = Some(&**c);
            }
            parts.push((shards[k], st));
        }
        let home_pos = shards
            .iter()
            .position(|&s| s == home)
            .expect("the home shard is locked");
        let mut locked = Locked {
            catalog: catalog.expect("the home shard is locked"),
            parts,
            home: home_pos,
            router: self.router,
        };
        f(&mut locked)
    }

    /// Runs `f` on the shards a reservation lives in: its home, found from
    /// the id's tag, and — if it holds shared scopes elsewhere — those too.
    fn with_reservation<R>(&self, id: ReservationId, f: impl FnOnce(&mut Locked<'_>) -> R) -> R {
        let home = self.router.of_id(id);
        let scopes = {
            let mut g = self.shards[home].lock();
            // A shard that remembers no multi-shard reservation needs no
            // lookup here (the operation looks the id up itself).
            let multi =
                g.st.multi_shard_records > 0 && g.st.records.get(id).is_some_and(|r| r.multi_shard);
            if !multi {
                // The common case: everything lives in the home shard, already locked.
                return Self::run_home(&mut g, home, self.router, f);
            }
            g.st.records
                .get(id)
                .map(|r| r.res.scopes.clone())
                .expect("found above, under the same lock")
        };
        // A reservation's scopes never change, so the set found here stays
        // right after the home lock is dropped to take all locks in order.
        let shards = self.router.shards_of(&scopes);
        self.with_shards(&shards, home, f)
    }

    /// Runs `f` with only the home shard locked (already, by `g`).
    #[inline]
    fn run_home<R>(
        g: &mut MutexGuard<'_, Shard>,
        home: usize,
        router: Router,
        f: impl FnOnce(&mut Locked<'_>) -> R,
    ) -> R {
        let Shard { catalog, st, .. } = &mut **g;
        let mut locked = Locked {
            catalog,
            parts: smallvec::smallvec![(home, st)],
            home: 0,
            router,
        };
        f(&mut locked)
    }

    /// Holds `req.amounts` on every scope, all or nothing. `id` must be made
    /// by [`ReservationId::mint`] for the request's tenant.
    pub fn reserve(
        &self,
        now: Timestamp,
        id: ReservationId,
        req: &ReserveRequest,
    ) -> Result<Granted, ReserveError> {
        // Not `reserve_journaled(…, &NoJournal).0`: the grant comes straight
        // from the engine instead of being moved out of a (result, ticket)
        // tuple, 35 instructions fewer a pair on the hot path.
        if id.tag() != req.scopes.tenant_tag() {
            return Err(foreign_id());
        }
        self.with_request_shards(id, req, |l| l.reserve(now, id, req))
    }

    /// [`SharedLedger::reserve`], journaling a grant that held something
    /// (the ticket is `None` for a denial, a dry run or an idempotent repeat).
    pub fn reserve_journaled<J: Journal>(
        &self,
        now: Timestamp,
        id: ReservationId,
        req: &ReserveRequest,
        journal: &J,
    ) -> (Result<Granted, ReserveError>, Option<J::Ticket>) {
        if id.tag() != req.scopes.tenant_tag() {
            return (Err(foreign_id()), None);
        }
        let run = |l: &mut Locked<'_>| {
            let r = l.reserve(now, id, req);
            let ticket = match &r {
                Ok(g) if !g.replayed && !g.dry_run => {
                    let usage = drained::<J>(l);
                    Some(journal.commit(
                        &Committed::Reserve {
                            now: used_now(l),
                            id,
                            req,
                        },
                        usage,
                    ))
                }
                _ => None,
            };
            (r, ticket)
        };
        self.with_request_shards(id, req, run)
    }

    /// Runs `f` on the shards a new reservation touches: its home, found
    /// from the id's tenant tag (checked by the caller), and the shards of
    /// its shared scopes, if any.
    #[inline]
    fn with_request_shards<R>(
        &self,
        id: ReservationId,
        req: &ReserveRequest,
        f: impl FnOnce(&mut Locked<'_>) -> R,
    ) -> R {
        let home = self.router.of_id(id);
        if !req.scopes.any_shared() {
            // Every scope lives in the tenant's shard.
            let mut g = self.shards[home].lock();
            return Self::run_home(&mut g, home, self.router, f);
        }
        let shards = self.router.shards_of(&req.scopes);
        self.with_shards(&shards, home, f)
    }

    /// Settles (see [`Ledger::settle`](crate::Ledger::settle)).
    pub fn settle(
        &self,
        now: Timestamp,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<Outcome, SettleError> {
        self.with_reservation(id, |l| {
            l.settle(now, id, usage).map(|i| Outcome::from(l.res_at(i)))
        })
    }

    /// Settles, answering the whole reservation.
    pub fn settle_view(
        &self,
        now: Timestamp,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<Reservation, SettleError> {
        self.settle_journaled(now, id, usage, &NoJournal)
            .map(|(r, ())| r)
    }

    /// [`SharedLedger::settle_view`], journaling an accepted settle.
    pub fn settle_journaled<J: Journal>(
        &self,
        now: Timestamp,
        id: ReservationId,
        usage: &Usage,
        journal: &J,
    ) -> Result<(Reservation, J::Ticket), SettleError> {
        self.with_reservation(id, |l| {
            let repeat = J::USAGE && status_before(l, id) == Some(Status::Settled);
            let i = l.settle(now, id, usage)?;
            let mut events = drained::<J>(l);
            let res = l.res_at(i).clone();
            // A repeat changed nothing: its record is logged (replaying it
            // is harmless) but it is not a second usage record.
            if J::USAGE && !repeat {
                events.push(ended(UsageKind::Settled, &res));
            }
            let ticket = journal.commit(
                &Committed::Settle {
                    now: used_now(l),
                    id,
                    usage,
                },
                events,
            );
            Ok((res, ticket))
        })
    }

    /// Refunds (see [`Ledger::refund`](crate::Ledger::refund)).
    pub fn refund(&self, now: Timestamp, id: ReservationId) -> Result<Outcome, RefundError> {
        self.with_reservation(id, |l| {
            l.refund(now, id).map(|i| Outcome::from(l.res_at(i)))
        })
    }

    /// Refunds, answering the whole reservation.
    pub fn refund_view(
        &self,
        now: Timestamp,
        id: ReservationId,
    ) -> Result<Reservation, RefundError> {
        self.refund_journaled(now, id, &NoJournal).map(|(r, ())| r)
    }

    /// [`SharedLedger::refund_view`], journaling an accepted refund.
    pub fn refund_journaled<J: Journal>(
        &self,
        now: Timestamp,
        id: ReservationId,
        journal: &J,
    ) -> Result<(Reservation, J::Ticket), RefundError> {
        self.with_reservation(id, |l| {
            let repeat = J::USAGE && status_before(l, id) == Some(Status::Refunded);
            let i = l.refund(now, id)?;
            let mut events = drained::<J>(l);
            let res = l.res_at(i).clone();
            // A refund of an expired hold leaves it expired: no record.
            if J::USAGE && !repeat && res.status == Status::Refunded {
                events.push(ended(UsageKind::Refunded, &res));
            }
            let ticket = journal.commit(
                &Committed::Refund {
                    now: used_now(l),
                    id,
                },
                events,
            );
            Ok((res, ticket))
        })
    }

    /// Extends (see [`Ledger::extend`](crate::Ledger::extend)).
    pub fn extend(
        &self,
        now: Timestamp,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Result<Outcome, ExtendError> {
        self.with_reservation(id, |l| {
            l.extend(now, id, amounts, ttl_ms)
                .map(|i| Outcome::from(l.res_at(i)))
        })
    }

    /// Extends, answering the whole reservation.
    pub fn extend_view(
        &self,
        now: Timestamp,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Result<Reservation, ExtendError> {
        self.extend_journaled(now, id, amounts, ttl_ms, &NoJournal)
            .map(|(r, ())| r)
    }

    /// [`SharedLedger::extend_view`], journaling an accepted extend.
    pub fn extend_journaled<J: Journal>(
        &self,
        now: Timestamp,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
        journal: &J,
    ) -> Result<(Reservation, J::Ticket), ExtendError> {
        self.with_reservation(id, |l| {
            let i = l.extend(now, id, amounts, ttl_ms)?;
            let events = drained::<J>(l);
            let ticket = journal.commit(
                &Committed::Extend {
                    now: used_now(l),
                    id,
                    amounts,
                    ttl_ms,
                },
                events,
            );
            Ok((l.res_at(i).clone(), ticket))
        })
    }

    /// A reservation as of `now` (expiry observed).
    pub fn get(&self, now: Timestamp, id: ReservationId) -> Option<Reservation> {
        self.with_reservation(id, |l| l.get(now, id).map(|i| l.res_at(i).clone()))
    }

    /// A scope's limits as of `now`.
    pub fn status(&self, now: Timestamp, scope: &ScopeKey) -> ScopeStatus {
        let s = self.router.of_scope(scope);
        self.with_shards(&[s], s, |l| l.status(now, scope))
    }

    /// An admin credit or debit on the scope's `total` limits of `dimension`.
    pub fn adjust(
        &self,
        now: Timestamp,
        scope: &ScopeKey,
        dimension: Dimension,
        credit: i64,
    ) -> Result<ScopeStatus, AdminError> {
        self.adjust_journaled(now, scope, dimension, credit, "", &NoJournal)
            .map(|(s, ())| s)
    }

    /// [`SharedLedger::adjust`], journaling an accepted adjustment and its
    /// `reason` (the usage log's audit trail).
    pub fn adjust_journaled<J: Journal>(
        &self,
        now: Timestamp,
        scope: &ScopeKey,
        dimension: Dimension,
        credit: i64,
        reason: &str,
        journal: &J,
    ) -> Result<(ScopeStatus, J::Ticket), AdminError> {
        let s = self.router.of_scope(scope);
        self.with_shards(&[s], s, |l| {
            let status = l.adjust(now, scope, dimension, credit)?;
            let mut events = drained::<J>(l);
            if J::USAGE {
                events.push(UsageEvent {
                    at: used_now(l),
                    kind: UsageKind::Adjusted,
                    reservation: None,
                    adjustment: Some(Adjustment {
                        scope: scope.clone(),
                        dimension,
                        credit,
                        reason: reason.to_owned(),
                    }),
                });
            }
            let ticket = journal.commit(
                &Committed::Adjust {
                    now: used_now(l),
                    scope,
                    dimension,
                    credit,
                    reason,
                },
                events,
            );
            Ok((status, ticket))
        })
    }

    /// Expires every hold due at `now` in every shard (one shard locked at a
    /// time), forgets what passed its retention and drops idle scopes.
    /// Returns the number of reservations expired so far in all.
    pub fn expire_due(&self, now: Timestamp) -> u64 {
        self.shards
            .iter()
            .map(|s| {
                let mut g = s.lock();
                let Shard { catalog, st, .. } = &mut *g;
                st.observe(catalog, now.as_millis(), usize::MAX);
                st.expired_count
            })
            .sum()
    }

    /// Number of shards.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Number of HELD holds in all shards (foreign holds included).
    pub fn hold_count(&self) -> usize {
        self.shards.iter().map(|s| s.lock().st.expiry.len()).sum()
    }

    /// Number of HELD reservations (each counted once, in its home shard).
    pub fn held_reservations(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let g = s.lock();
                g.st.expiry.len() - g.st.foreign.len()
            })
            .sum()
    }

    /// Checks every invariant, each shard's and across shards, after all
    /// shards observed `now` (with every shard locked: a test helper).
    pub fn check_invariants(&self, now: Timestamp) -> Result<(), String> {
        let mut guards: Vec<_> = self.shards.iter().map(|s| s.lock()).collect();
        let now = guards
            .iter()
            .map(|g| g.st.now_ms)
            .fold(now.as_millis(), u64::max);
        for g in guards.iter_mut() {
            let Shard { catalog, st, .. } = &mut **g;
            st.observe(catalog, now, 0);
        }
        for (i, g) in guards.iter().enumerate() {
            invariants::check_shard(i, &g.st)?;
        }
        let states: Vec<&ShardState> = guards.iter().map(|g| &g.st).collect();
        invariants::check_foreign(&states, |id| self.router.of_id(id))
    }
}
