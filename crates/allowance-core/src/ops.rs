//! The transitions, written once over the set of shards an operation locked.
//!
//! Each reads top to bottom: observe the time (expiring what is due), find
//! every rejection in a fixed order, then — past the point where nothing can
//! fail — one block of mutation. That is what makes "a refusal changes
//! nothing" true by construction.

use smallvec::SmallVec;

use crate::catalog::{
    Catalog, MAX_IDEMPOTENCY_KEY_LEN, MAX_LABEL_KEY_LEN, MAX_LABEL_VALUE_LEN, MAX_SCOPES_LIMIT,
};
use crate::error::{
    AdminError, Denial, DenialKind, ExtendError, Invalid, RefundError, ReserveError, SettleError,
};
use crate::limit::{Window, WindowKind};
use crate::reservation::{
    Granted, LimitStatus, Remaining, Reservation, ReservationId, ReserveRequest, ScopeStatus,
    Status, Usage,
};
use crate::scope::{ScopeKey, ScopeSet};
use crate::shard::{
    GC_PER_OPERATION, Hold, HoldScope, NO_SLOT, Record, ScopeState, ShardState, idempotency_key,
};
use crate::units::{Amounts, Dimension, MAX_AMOUNT, Timestamp};

/// Most charges in one settle.
pub const MAX_CHARGES: usize = 64;

/// The scopes a check moved to a new plan, by their position in the
/// request, each with its state from before (empty unless the catalog
/// changed since the scopes were last written: no allocation then).
type Moved = Vec<(usize, Box<ScopeState>)>;

/// Which shard owns what. A single-shard ledger routes everything to 0.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Router {
    mask: usize,
}

impl Router {
    /// A router over `n` shards (a power of two, at most 256).
    pub(crate) fn new(n: usize) -> Self {
        debug_assert!(n.is_power_of_two() && n <= 256);
        Router { mask: n - 1 }
    }

    pub(crate) fn of_tenant(&self, tenant: &str) -> usize {
        usize::from(ReservationId::tenant_tag(tenant)) & self.mask
    }

    pub(crate) fn of_scope(&self, key: &ScopeKey) -> usize {
        if self.mask == 0 {
            return 0;
        }
        match key.tenant_name() {
            Some(t) => self.of_tenant(t),
            // Shared scopes spread over the shards by their own name.
            None => usize::from(ReservationId::tenant_tag(key.as_str())) & self.mask,
        }
    }

    pub(crate) fn of_id(&self, id: ReservationId) -> usize {
        usize::from(id.tag()) & self.mask
    }

    /// The shards a scope set touches, ascending (the lock order).
    pub(crate) fn shards_of(&self, scopes: &ScopeSet) -> SmallVec<[usize; 4]> {
        // Tenant-namespaced scopes all live in the tenant's shard: only
        // shared scopes need hashing.
        let home = usize::from(scopes.tenant_tag()) & self.mask;
        let mut v: SmallVec<[usize; 4]> = smallvec::smallvec![home];
        if !scopes.any_shared() {
            return v;
        }
        v.extend(
            scopes.as_slice()[1..]
                .iter()
                .filter(|k| k.is_shared())
                .map(|k| self.of_scope(k)),
        );
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// The shards one operation holds, and which of them is the tenant's home.
pub(crate) struct Locked<'a> {
    pub(crate) catalog: &'a Catalog,
    pub(crate) parts: SmallVec<[(usize, &'a mut ShardState); 4]>,
    pub(crate) home: usize,
    pub(crate) router: Router,
}

/// The binding limit so far, while checking.
#[derive(Clone, Copy)]
struct Candidate {
    kind: DenialKind,
    retry_after_ms: Option<u64>,
    scope: usize,
    limit: usize,
    capacity: u64,
    remaining: i64,
    requested: u64,
    resets_at: Option<u64>,
}

impl Candidate {
    /// Whether `self` should be reported rather than `other` (found earlier).
    fn beats(&self, other: &Candidate) -> bool {
        if self.kind.rank() != other.kind.rank() {
            return self.kind.rank() > other.kind.rank();
        }
        // Among rate_limited, the latest retry binds (a retry must pass them all);
        // ties keep the earlier scope and limit.
        self.kind == DenialKind::RateLimited && self.retry_after_ms > other.retry_after_ms
    }
}

fn sat_i64(v: i128) -> i64 {
    v.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

/// Works out, limit by limit, why one scope refuses `requested(dim)`
/// (its windows advanced to `now`; the fast path found some limit that does
/// not fit), keeping the binding denial in `best`. With `only_positive`,
/// limits asked for nothing are skipped (an extend raising one dimension is
/// not refused by another). `own` is the reservation being extended and
/// what it holds already: a raise that with it would pass a limit's whole
/// capacity can never fit, whatever the others do (`exceeds_limit`, its
/// `requested` the reservation's whole hold), rather than a retry at its
/// own expiry; and its own hold, which cannot end while it is extended,
/// counts as usage below. `holds` is the shard's hold table.
///
/// The rule (docs/ENGINE-CHOICES.md, "Denials"), per refused limit, with
/// `free = capacity − own − requested` (what usage may be for the request
/// to fit once every other hold is gone):
///
/// - usage above `free` that never leaves by itself (a `total`):
///   `budget_exhausted`, a hard stop;
/// - the request fits beside the current holds once usage leaves
///   (`requested ≤ capacity − held`, a window that empties): `rate_limited`
///   when usage has fallen to `capacity − held − requested`;
/// - otherwise holds block: `rate_limited` at the expiry of the earliest
///   other hold that holds the limit's dimension
///   ([`ScopeState::earliest_holding`]), and no earlier than usage falls to
///   `free`.
///
/// A hold-based retry gives the denial a `resets_at` (that hold's expiry)
/// where the window has none of its own.
#[cold]
#[inline(never)]
fn check_scope(
    (st, holds): (&mut ScopeState, &[Option<Hold>]),
    scope: usize,
    now: u64,
    requested: &impl Fn(Dimension) -> u64,
    (only_positive, own): (bool, Option<(ReservationId, &Amounts)>),
    best: &mut Option<Candidate>,
) {
    for li in 0..st.plan.limits().len() {
        let (dim, cap) = {
            let l = &st.plan.limits()[li];
            (l.dimension(), l.capacity())
        };
        let mut req = requested(dim);
        if only_positive && req == 0 {
            continue;
        }
        let held = st.held(dim);
        let own_held = own.map_or(0, |(_, o)| o.get(dim));
        if st.state(li).fits(req, held) {
            continue;
        }
        // Refused: everything below is the denial's detail, off the hot path.
        let mut s = st.state(li);
        let used = s.used();
        let room = i128::from(cap) - i128::from(used) - i128::from(held);
        if i128::from(req) <= room {
            continue;
        }
        let window_resets = s.resets_at(now);
        // What usage may be once every other hold is gone, and how long it
        // takes to get there (`None`: never by itself).
        let free = cap.saturating_sub(own_held).saturating_sub(req);
        let until_free = if req > cap || req.saturating_add(own_held) > cap {
            None
        } else if i128::from(used) <= i128::from(free) {
            Some(0)
        } else {
            s.ms_until_used_at_most(now, free)
        };
        // Beside the current holds, once usage leaves (`None`: not so).
        let beside_holds = if held <= cap && req <= cap - held {
            s.ms_until_used_at_most(now, cap - held - req)
        } else {
            None
        };
        let mut hold_due = None;
        let (kind_of, retry) = if req > cap {
            (DenialKind::ExceedsLimit, None)
        } else if req.saturating_add(own_held) > cap {
            req = req.saturating_add(own_held);
            (DenialKind::ExceedsLimit, None)
        } else if let Some(until_free) = until_free {
            match beside_holds {
                Some(ms) => (DenialKind::RateLimited, Some(ms.max(1))),
                None => {
                    // Holds block: the earliest to end that holds some of
                    // this dimension, and not before usage leaves room.
                    hold_due = st.earliest_holding(holds, dim, own.map(|(id, _)| id));
                    let ms = hold_due.map_or(1, |e| e.saturating_sub(now));
                    (DenialKind::RateLimited, Some(ms.max(until_free).max(1)))
                }
            }
        } else {
            // Usage alone blocks, and never leaves by itself.
            (DenialKind::BudgetExhausted, None)
        };
        let c = Candidate {
            kind: kind_of,
            retry_after_ms: retry,
            scope,
            limit: li,
            capacity: cap,
            remaining: sat_i64(room),
            requested: req,
            resets_at: window_resets.or(hold_due),
        };
        if best.as_ref().is_none_or(|b| c.beats(b)) {
            *best = Some(c);
        }
    }
}

/// Every limit's room on one scope, for a grant's `remaining` list.
fn report_scope(
    catalog: &Catalog,
    key: &ScopeKey,
    st: &mut ScopeState,
    now: u64,
    out: &mut Vec<Remaining>,
) {
    // Straight into `out`, not through `limit_statuses`: every grant
    // reports its scopes, and that list's copies of each limit cost more
    // than the figures.
    let earliest = st.earliest_expiry();
    out.reserve(st.plan.limits().len());
    for li in 0..st.plan.limits().len() {
        let f = limit_figures(st, li, earliest, now);
        out.push(Remaining {
            scope: key.clone(),
            dimension: catalog.dimension_name(f.dimension).to_string(),
            window: st.plan.limits()[li].window().kind(),
            capacity: f.capacity,
            remaining: f.remaining,
            resets_at: f.resets_at,
        });
    }
}

/// One limit's figures, shared by a grant's report and a status read.
struct Figures {
    dimension: Dimension,
    capacity: u64,
    used: i64,
    held: u64,
    /// `capacity − used − held`, saturated.
    remaining: i64,
    resets_at: Option<Timestamp>,
}

/// Limit `li`'s figures (`earliest`: the scope's earliest hold expiry, a
/// concurrent limit's next room).
fn limit_figures(st: &mut ScopeState, li: usize, earliest: Option<u64>, now: u64) -> Figures {
    let (dimension, capacity, concurrent) = {
        let l = &st.plan.limits()[li];
        (
            l.dimension(),
            l.capacity(),
            matches!(l.window(), Window::Concurrent),
        )
    };
    let held = st.held(dimension);
    let mut s = st.state(li);
    let used = s.used();
    let resets_at = if concurrent {
        earliest
    } else {
        s.resets_at(now)
    };
    Figures {
        dimension,
        capacity,
        used,
        held,
        remaining: sat_i64(i128::from(capacity) - i128::from(used) - i128::from(held)),
        resets_at: resets_at.map(Timestamp::from_millis),
    }
}

pub(crate) fn limit_statuses(catalog: &Catalog, st: &mut ScopeState, now: u64) -> Vec<LimitStatus> {
    let earliest = st.earliest_expiry();
    (0..st.plan.limits().len())
        .map(|li| {
            let f = limit_figures(st, li, earliest, now);
            LimitStatus {
                dimension: catalog.dimension_name(f.dimension).to_string(),
                capacity: f.capacity,
                used: f.used,
                held: f.held,
                remaining: f.remaining,
                resets_at: f.resets_at,
                window: st.plan.limits()[li].window().clone(),
            }
        })
        .collect()
}

fn dim_field(catalog: &Catalog, prefix: &str, dim: Dimension) -> String {
    format!("{prefix}.{}", catalog.dimension_name(dim))
}

/// `tokens` (input + output) and `cost_micros` (from the model's prices)
/// where the amounts do not give them.
#[inline]
fn derive(
    catalog: &Catalog,
    amounts: &Amounts,
    model: Option<&str>,
    cached_input: u64,
) -> (Amounts, bool) {
    let mut a = amounts.clone();
    let (input, output) = (
        a.get(Dimension::INPUT_TOKENS),
        a.get(Dimension::OUTPUT_TOKENS),
    );
    if !a.contains(Dimension::TOKENS) {
        a.set(Dimension::TOKENS, input.saturating_add(output));
    }
    let mut unpriced = false;
    if !a.contains(Dimension::COST_MICROS)
        && let Some(m) = model
    {
        unpriced = !price(catalog, &mut a, m, (input, cached_input, output));
    }
    (a, unpriced)
}

/// Sets `cost_micros` from the model's prices; `false` when the model has none.
#[inline(never)]
fn price(
    catalog: &Catalog,
    a: &mut Amounts,
    model: &str,
    (input, cached, output): (u64, u64, u64),
) -> bool {
    match catalog.model(model) {
        Some(price) => {
            a.set(
                Dimension::COST_MICROS,
                price.cost_micros(input, cached, output),
            );
            true
        }
        None => false,
    }
}

/// Every amount at most 2^53, every dimension known: the common case (no
/// custom dimension, all in range) in a few compares, inline.
#[inline]
fn check_amounts(catalog: &Catalog, amounts: &Amounts, prefix: &str) -> Result<(), Invalid> {
    if amounts.builtin_only_in_range() {
        return Ok(());
    }
    check_amounts_slow(catalog, amounts, prefix)
}

#[cold]
#[inline(never)]
fn check_amounts_slow(catalog: &Catalog, amounts: &Amounts, prefix: &str) -> Result<(), Invalid> {
    if let Some((d, a)) = amounts.first_too_large() {
        return Err(Invalid::new(
            dim_field(catalog, prefix, d),
            format!("{a} is above the largest amount, 2^53"),
        ));
    }
    for (d, _) in amounts.iter() {
        if d.index() >= usize::from(Dimension::BUILTIN_COUNT)
            && catalog.dimension_name(d) == "unknown"
        {
            return Err(Invalid::new(
                prefix,
                format!("unknown dimension #{}", d.index()),
            ));
        }
    }
    Ok(())
}

/// The slot of reservation `id`'s hold in one locked shard: its home hold,
/// or a foreign hold for the shared scopes that shard owns.
fn hold_slot_in(part: &ShardState, is_home: bool, id: ReservationId) -> u32 {
    if is_home {
        part.records.get(id).map_or(NO_SLOT, |r| r.hold_slot)
    } else {
        part.foreign.get(&id).copied().unwrap_or(NO_SLOT)
    }
}

impl<'a> Locked<'a> {
    fn part(&mut self, shard: usize) -> &mut ShardState {
        let i = self
            .parts
            .iter()
            .position(|(s, _)| *s == shard)
            .expect("the operation locked every shard it touches");
        &mut *self.parts[i].1
    }

    /// The locked shard that owns `key` (no routing when only one is locked).
    #[inline(always)]
    fn scope_part(&mut self, key: &ScopeKey) -> &mut ShardState {
        if self.parts.len() == 1 {
            return &mut *self.parts[0].1;
        }
        let s = self.router.of_scope(key);
        self.part(s)
    }

    /// The tenant's shard (`home` is its position among the locked parts).
    #[inline(always)]
    fn home(&mut self) -> &mut ShardState {
        let h = self.home;
        &mut *self.parts[h].1
    }

    /// Observes `now` on every locked shard; returns the instant used (no
    /// earlier than any of them saw).
    pub(crate) fn observe(&mut self, now: Timestamp) -> u64 {
        let now = self
            .parts
            .iter()
            .map(|(_, s)| s.now_ms)
            .fold(now.as_millis(), u64::max);
        let catalog = self.catalog;
        for (_, s) in self.parts.iter_mut() {
            s.observe(catalog, now, GC_PER_OPERATION);
        }
        now
    }

    fn denial(
        &self,
        scopes: &ScopeSet,
        c: Candidate,
        st_plan_limit: (Dimension, Window),
    ) -> Box<Denial> {
        Box::new(Denial {
            kind: c.kind,
            scope: scopes.as_slice()[c.scope].clone(),
            dimension: self.catalog.dimension_name(st_plan_limit.0).to_string(),
            window: st_plan_limit.1.kind(),
            capacity: c.capacity,
            remaining: c.remaining,
            requested: c.requested,
            retry_after_ms: c.retry_after_ms,
            resets_at: c.resets_at.map(Timestamp::from_millis),
        })
    }

    /// Checks `requested` against every scope; the binding denial if any.
    /// `slots` receives each scope's slot in the shard that owns it (a
    /// reservation has at most [`MAX_SCOPES_LIMIT`] scopes: checked at
    /// reserve against `max_scopes`, which is bounded by it). `moved`
    /// receives the state, from before, of each scope the check moved to a
    /// new plan: a check that grants nothing hands it to [`Locked::unsync`].
    fn check(
        &mut self,
        scopes: &ScopeSet,
        now: u64,
        requested: &impl Fn(Dimension) -> u64,
        (only_positive, own): (bool, Option<(ReservationId, &Amounts)>),
        slots: &mut [u32; MAX_SCOPES_LIMIT],
        moved: &mut Moved,
    ) -> Option<Box<Denial>> {
        let catalog = self.catalog;
        let mut best: Option<Candidate> = None;
        for ((i, key), out) in scopes.as_slice().iter().enumerate().zip(slots.iter_mut()) {
            let part = self.scope_part(key);
            let (slot, fits, before) =
                part.scope_check(catalog, key, now, requested, only_positive);
            *out = slot;
            if let Some(before) = before {
                moved.push((i, before));
            }
            if !fits {
                check_scope(
                    part.scope_and_holds(slot),
                    i,
                    now,
                    requested,
                    (only_positive, own),
                    &mut best,
                );
            }
        }
        let c = best?;
        let key = &scopes.as_slice()[c.scope];
        let st = self.scope_part(key).scope_at(slots[c.scope]);
        let l = &st.plan.limits()[c.limit];
        let what = (l.dimension(), l.window().clone());
        Some(self.denial(scopes, c, what))
    }

    /// Puts back the scopes a check moved to a new plan (see
    /// [`ShardState::unsync`]): for a check that grants nothing.
    #[cold]
    fn unsync(&mut self, scopes: &ScopeSet, slots: &[u32; MAX_SCOPES_LIMIT], moved: Moved) {
        for (i, before) in moved {
            let key = &scopes.as_slice()[i];
            self.scope_part(key).unsync(slots[i], *before);
        }
    }

    fn remaining(&mut self, scopes: &ScopeSet, now: u64) -> Vec<Remaining> {
        let catalog = self.catalog;
        let mut out = Vec::new();
        for key in scopes.as_slice() {
            let st = self.scope_part(key).scope_mut(catalog, key, now);
            report_scope(catalog, key, st, now, &mut out);
        }
        out
    }

    pub(crate) fn reserve(
        &mut self,
        now: Timestamp,
        id: ReservationId,
        req: &ReserveRequest,
    ) -> Result<Granted, ReserveError> {
        let now = self.observe(now);
        let catalog = self.catalog;
        let settings = catalog.settings();

        // 1. The request itself.
        let PreparedReserve { held, ttl_ms } = prepare_reserve(catalog, req)?;
        // 2. Idempotency: a repeat answers the existing reservation.
        let idem = req
            .idempotency_key
            .as_ref()
            .map(|k| idempotency_key(req.scopes.tenant_name(), k));
        if let Some(k) = &idem {
            let home = self.home();
            if let Some(rec) = home
                .idempotency
                .get(k)
                .and_then(|rid| home.records.get(*rid))
            {
                let key_expired = rec.res.ended_at.is_some_and(|e| {
                    now >= e
                        .as_millis()
                        .saturating_add(settings.idempotency_retention_ms)
                });
                if !key_expired {
                    let same = rec.res.scopes.same_scopes(&req.scopes)
                        && rec.sent.as_deref() == Some(&req.amounts)
                        && rec.res.model == req.model;
                    if !same {
                        return Err(ReserveError::IdempotencyConflict {
                            key: req.idempotency_key.as_deref().unwrap_or("").to_string(),
                        });
                    }
                    return Ok(Granted {
                        id: rec.res.id,
                        status: rec.res.status,
                        replayed: true,
                        dry_run: false,
                        held: rec.res.held.clone(),
                        created_at: rec.res.created_at,
                        expires_at: rec.res.expires_at,
                        remaining: Vec::new(),
                    });
                }
            }
        }
        if self.home().records.contains(id) {
            return Err(ReserveError::DuplicateId);
        }

        // 3. Every limit of every scope.
        let requested = |d: Dimension| if d.is_implied() { 1 } else { held.get(d) };
        let mut slots = [NO_SLOT; MAX_SCOPES_LIMIT];
        let mut moved = Moved::new();
        if let Some(denial) = self.check(
            &req.scopes,
            now,
            &requested,
            (false, None),
            &mut slots,
            &mut moved,
        ) {
            self.unsync(&req.scopes, &slots, moved);
            return Err(ReserveError::Denied(denial));
        }
        let expires_ms = now.saturating_add(ttl_ms);
        if req.dry_run {
            // Exactly what the reserve would answer: the room after this hold.
            let expires_at = Timestamp::from_millis(expires_ms);
            let mut remaining = self.remaining(&req.scopes, now);
            for r in &mut remaining {
                let asked = catalog.dimension(&r.dimension).map_or(0, &requested);
                r.remaining = sat_i64(i128::from(r.remaining) - i128::from(asked));
                if r.window == WindowKind::Concurrent {
                    r.resets_at = Some(r.resets_at.map_or(expires_at, |e| e.min(expires_at)));
                }
            }
            // A dry run is not journaled: it leaves the scopes on their plans.
            self.unsync(&req.scopes, &slots, moved);
            return Ok(Granted {
                id,
                status: Status::Held,
                replayed: false,
                dry_run: true,
                held,
                created_at: Timestamp::from_millis(now),
                expires_at,
                remaining,
            });
        }

        // 4. Nothing can fail past this point.
        let router = self.router;
        // The tenant's plan governs the whole reservation (its scope is first, at home).
        let overrun = self.home().scope_at(slots[0]).plan.overrun();
        let home_shard = self.parts[self.home].0;
        let mut home_slot = NO_SLOT;
        let mut multi_shard = false;
        let single = self.parts.len() == 1;
        for pi in 0..self.parts.len() {
            let shard = self.parts[pi].0;
            let hold_scopes: SmallVec<[HoldScope; 4]> = req
                .scopes
                .as_slice()
                .iter()
                .zip(slots)
                .enumerate()
                .filter(|&(_, (k, _))| single || router.of_scope(k) == shard)
                .map(|(i, (_, slot))| HoldScope {
                    index: i as u8,
                    slot,
                    pos: NO_SLOT,
                })
                .collect();
            if hold_scopes.is_empty() {
                continue;
            }
            let foreign = shard != home_shard;
            multi_shard |= foreign;
            let part = &mut *self.parts[pi].1;
            let slot = part.add_hold(Hold {
                owner: id,
                foreign,
                scopes: hold_scopes,
                amounts: held.clone(),
                expires_ms,
                heap_pos: NO_SLOT,
            });
            if foreign {
                part.foreign.insert(id, slot);
            } else {
                home_slot = slot;
            }
        }
        let remaining = if req.report_remaining {
            self.remaining(&req.scopes, now)
        } else {
            Vec::new()
        };
        let home = self.home();
        let sent = idem.is_some().then(|| Box::new(req.amounts.clone()));
        // Built inside the slab's slot: a record is a few hundred bytes.
        home.records.insert(id, || Record {
            res: Reservation {
                id,
                status: Status::Held,
                scopes: req.scopes.clone(),
                model: req.model.clone(),
                labels: req.labels.clone(),
                held: held.clone(),
                created_at: Timestamp::from_millis(now),
                expires_at: Timestamp::from_millis(expires_ms),
                ended_at: None,
                charged: None,
                late: false,
                overrun,
                idempotency_key: req.idempotency_key.clone(),
            },
            sent,
            hold_slot: home_slot,
            multi_shard,
            drop_at: 0,
        });
        home.multi_shard_records += usize::from(multi_shard);
        if let Some(k) = idem {
            home.idempotency.insert(k, id);
        }
        Ok(Granted {
            id,
            status: Status::Held,
            replayed: false,
            dry_run: false,
            held,
            created_at: Timestamp::from_millis(now),
            expires_at: Timestamp::from_millis(expires_ms),
            remaining,
        })
    }

    /// Releases every hold of a HELD reservation (its record at slab index
    /// `ri` in the home shard), in every locked shard.
    fn release_all_at(&mut self, id: ReservationId, ri: u32, now: u64) {
        let home = self.home;
        for pi in 0..self.parts.len() {
            let part = &mut *self.parts[pi].1;
            if pi == home {
                let slot = std::mem::replace(&mut part.records.at_mut(ri).hold_slot, NO_SLOT);
                if slot != NO_SLOT {
                    part.release_hold(slot, now);
                }
            } else if let Some(slot) = part.foreign.remove(&id) {
                part.release_hold(slot, now);
            }
        }
    }

    /// The home shard's record at a slab index an operation answered.
    #[inline]
    pub(crate) fn res_at(&self, i: u32) -> &Reservation {
        &self.parts[self.home].1.records.at(i).res
    }

    /// Settles; answers the slab index of the reservation's record in the
    /// home shard (read it with [`Locked::res_at`]).
    pub(crate) fn settle(
        &mut self,
        now: Timestamp,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<u32, SettleError> {
        let now = self.observe(now);
        let catalog = self.catalog;
        let ri = self.home().records.find(id).ok_or(SettleError::NotFound)?;
        let (status, hold_slot) = {
            let rec = self.home().records.at(ri);
            (rec.res.status, rec.hold_slot)
        };
        match status {
            Status::Settled => return Ok(ri),
            Status::Refunded => return Err(SettleError::Conflict { status }),
            Status::Held | Status::Expired => {}
        }

        // 1. The usage, and 2. what to record.
        let charged = settle_charges(catalog, &self.home().records.at(ri).res, usage)?;

        // 3. Nothing can fail past this point.
        if status == Status::Held {
            // The holds know their scopes' slots: record there and release,
            // in one pass over each hold's scopes.
            let home = self.home;
            for pi in 0..self.parts.len() {
                let part = &mut *self.parts[pi].1;
                let slot = if pi == home {
                    part.records.at_mut(ri).hold_slot = NO_SLOT;
                    hold_slot
                } else {
                    part.foreign.remove(&id).unwrap_or(NO_SLOT)
                };
                if slot != NO_SLOT {
                    part.release_hold_recording(slot, now, Some((catalog, &charged)));
                }
            }
        } else {
            // A late settle: the holds are gone, so the scopes are found by
            // name (the only settle that clones the scope set).
            let scopes = self.home().records.at(ri).res.scopes.clone();
            for key in scopes.as_slice() {
                self.scope_part(key)
                    .scope_mut(catalog, key, now)
                    .record_all(now, &charged);
            }
        }
        let home = self.home();
        let rec = home.records.at_mut(ri);
        rec.res.status = Status::Settled;
        rec.res.late = status == Status::Expired;
        rec.res.ended_at = Some(Timestamp::from_millis(now));
        rec.res.charged = Some(charged);
        home.schedule_drop_at(catalog, ri, now);
        Ok(ri)
    }

    /// Refunds; answers the slab index of the record (see [`Locked::settle`]).
    pub(crate) fn refund(&mut self, now: Timestamp, id: ReservationId) -> Result<u32, RefundError> {
        let now = self.observe(now);
        let ri = self.home().records.find(id).ok_or(RefundError::NotFound)?;
        let status = self.home().records.at(ri).res.status;
        match status {
            Status::Settled => return Err(RefundError::Conflict { status }),
            Status::Refunded | Status::Expired => {}
            Status::Held => {
                self.release_all_at(id, ri, now);
                let catalog = self.catalog;
                let home = self.home();
                let rec = home.records.at_mut(ri);
                rec.res.status = Status::Refunded;
                rec.res.ended_at = Some(Timestamp::from_millis(now));
                home.schedule_drop_at(catalog, ri, now);
            }
        }
        Ok(ri)
    }

    /// Extends; answers the slab index of the record (see [`Locked::settle`]).
    pub(crate) fn extend(
        &mut self,
        now: Timestamp,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Result<u32, ExtendError> {
        let now = self.observe(now);
        let catalog = self.catalog;
        check_extend(catalog, amounts, ttl_ms)?;
        let ri = self.home().records.find(id).ok_or(ExtendError::NotFound)?;
        let (status, model, scopes, own) = {
            let rec = self.home().records.at(ri);
            (
                rec.res.status,
                rec.res.model.clone(),
                rec.res.scopes.clone(),
                rec.res.held.clone(),
            )
        };
        if status != Status::Held {
            return Err(ExtendError::NotHeld { status });
        }
        let delta = extend_delta(catalog, model.as_deref(), amounts);
        if !delta.is_empty() {
            let requested = |d: Dimension| if d.is_implied() { 0 } else { delta.get(d) };
            let mut slots = [NO_SLOT; MAX_SCOPES_LIMIT];
            let mut moved = Moved::new();
            if let Some(denial) = self.check(
                &scopes,
                now,
                &requested,
                (true, Some((id, &own))),
                &mut slots,
                &mut moved,
            ) {
                self.unsync(&scopes, &slots, moved);
                return Err(ExtendError::Denied(denial));
            }
        }

        // Nothing can fail past this point.
        let new_expiry = ttl_ms.map(|t| now.saturating_add(t));
        let home = self.home;
        for pi in 0..self.parts.len() {
            let part = &mut *self.parts[pi].1;
            let slot = hold_slot_in(part, pi == home, id);
            if slot == NO_SLOT {
                continue;
            }
            if !delta.is_empty() {
                part.raise_hold(slot, &delta);
            }
            if let Some(e) = new_expiry {
                part.move_hold(slot, e);
            }
        }
        let rec = self.home().records.at_mut(ri);
        rec.res.held.add(&delta);
        if let Some(e) = new_expiry {
            rec.res.expires_at = Timestamp::from_millis(e);
        }
        Ok(ri)
    }

    /// A reservation as of `now` (expiry observed): the slab index of its
    /// record (see [`Locked::settle`]).
    pub(crate) fn get(&mut self, now: Timestamp, id: ReservationId) -> Option<u32> {
        self.observe(now);
        self.home().records.find(id)
    }

    pub(crate) fn status(&mut self, now: Timestamp, key: &ScopeKey) -> ScopeStatus {
        let now = self.observe(now);
        let catalog = self.catalog;
        let part = self.scope_part(key);
        // A scope never used answers its plan with zero use, and is not created.
        let mut fresh;
        let mut moved_copy;
        let slot = part.slot_of(key);
        let st = match slot {
            Some(slot) => {
                let st = part.scope_at(slot);
                // On its own plan, in place: advancing a plan's windows
                // gives the same whatever the steps.
                st.advance(now);
                if st.needs_move(catalog) {
                    // A read is not journaled: it moves a copy to the new
                    // plan (see `ScopeState::sync`).
                    moved_copy = st.clone();
                    moved_copy.sync(catalog, now);
                    &mut moved_copy
                } else {
                    st
                }
            }
            None => {
                fresh = ScopeState::new(
                    key.clone(),
                    catalog.plan_for(key).clone(),
                    catalog.epoch(),
                    now,
                );
                &mut fresh
            }
        };
        ScopeStatus {
            scope: key.clone(),
            plan: st.plan.name().to_string(),
            held_reservations: u64::from(st.held_count),
            limits: limit_statuses(catalog, st, now),
        }
    }

    pub(crate) fn adjust(
        &mut self,
        now: Timestamp,
        key: &ScopeKey,
        dim: Dimension,
        credit: i64,
    ) -> Result<ScopeStatus, AdminError> {
        let now = self.observe(now);
        let catalog = self.catalog;
        check_adjust(catalog, key, dim, credit)?;
        let part = self.scope_part(key);
        let st = part.scope_mut(catalog, key, now);
        for li in 0..st.plan.limits().len() {
            if st.plan.limits()[li].dimension() == dim {
                st.state(li).adjust(credit);
            }
        }
        Ok(self.status(Timestamp::from_millis(now), key))
    }
}

/// What a valid reserve request holds, and for how long: the checks every
/// store makes before it looks at any state (so a store that keeps its
/// state elsewhere, Redis, refuses exactly what the engine refuses).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedReserve {
    /// The amounts to hold: the request's, `tokens` and `cost_micros`
    /// derived where it gave none.
    pub held: Amounts,
    /// The hold's lifetime (the request's, or the default).
    pub ttl_ms: u64,
}

impl PreparedReserve {
    /// What a reserve asks of `dim`: the held amount, or 1 for the implied
    /// dimensions (`requests`, `concurrent`).
    pub fn requested(&self, dim: Dimension) -> u64 {
        if dim.is_implied() {
            1
        } else {
            self.held.get(dim)
        }
    }
}

/// Checks a reserve request against the catalog's settings and derives
/// what it holds; changes nothing.
pub fn prepare_reserve(
    catalog: &Catalog,
    req: &ReserveRequest,
) -> Result<PreparedReserve, ReserveError> {
    let settings = catalog.settings();
    if req.scopes.len() > settings.max_scopes {
        return Err(Invalid::new(
            "scopes",
            format!(
                "at most {} scopes per reservation, the tenant included",
                settings.max_scopes
            ),
        )
        .into());
    }
    check_amounts(catalog, &req.amounts, "amounts")?;
    let ttl_ms = req.ttl_ms.unwrap_or(settings.default_ttl_ms);
    if ttl_ms == 0 || ttl_ms > settings.max_ttl_ms {
        return Err(Invalid::new(
            "ttl_ms",
            format!("must be between 1 and {} ms", settings.max_ttl_ms),
        )
        .into());
    }
    if let Some(key) = &req.idempotency_key {
        if req.dry_run {
            return Err(
                Invalid::new("idempotency_key", "a dry run takes no idempotency key").into(),
            );
        }
        // Characters, as the spec counts them (a byte count would refuse
        // 101 two-byte characters); the byte length bounds the count first.
        if key.is_empty()
            || (key.len() > MAX_IDEMPOTENCY_KEY_LEN
                && key.chars().count() > MAX_IDEMPOTENCY_KEY_LEN)
        {
            return Err(Invalid::new(
                "idempotency_key",
                format!("must have 1 to {MAX_IDEMPOTENCY_KEY_LEN} characters"),
            )
            .into());
        }
    }
    if let Some(labels) = &req.labels {
        if labels.len() > settings.max_labels {
            return Err(
                Invalid::new("labels", format!("at most {} labels", settings.max_labels)).into(),
            );
        }
        for (k, v) in labels.iter() {
            if k.is_empty() || k.len() > MAX_LABEL_KEY_LEN || v.len() > MAX_LABEL_VALUE_LEN {
                return Err(Invalid::new(
                    format!("labels.{k}"),
                    format!(
                        "label keys have 1 to {MAX_LABEL_KEY_LEN} bytes, values at most {MAX_LABEL_VALUE_LEN}"
                    ),
                )
                .into());
            }
        }
    }
    let (held, unpriced) = derive(catalog, &req.amounts, req.model.as_deref(), 0);
    if unpriced {
        let limits_cost = req
            .scopes
            .as_slice()
            .iter()
            .any(|k| catalog.plan_for(k).limits_dimension(Dimension::COST_MICROS));
        if limits_cost {
            return Err(Invalid::new(
                "model",
                format!(
                    "model {:?} has no price, and a scope limits cost_micros: give cost_micros or price the model",
                    req.model.as_deref().unwrap_or("")
                ),
            )
            .into());
        }
    }
    Ok(PreparedReserve { held, ttl_ms })
}

/// Checks a settle's usage and works out what it charges `res` (a HELD or
/// EXPIRED reservation): the overrun policy per dimension, `tokens` derived
/// again, then tool charges, never capped. Changes nothing.
pub fn settle_charges(
    catalog: &Catalog,
    res: &Reservation,
    usage: &Usage,
) -> Result<Amounts, SettleError> {
    check_amounts(catalog, &usage.amounts, "usage")?;
    if usage.cached_input_tokens > MAX_AMOUNT {
        return Err(Invalid::new(
            "usage.cached_input_tokens",
            "above the largest amount, 2^53",
        )
        .into());
    }
    if usage.charges.len() > MAX_CHARGES {
        return Err(Invalid::new("charges", format!("at most {MAX_CHARGES} charges")).into());
    }
    for (i, c) in usage.charges.iter().enumerate() {
        if c.name.is_empty() || c.name.len() > 64 {
            return Err(Invalid::new(
                format!("charges[{i}].name"),
                "a charge name has 1 to 64 characters",
            )
            .into());
        }
        if c.cost_micros > MAX_AMOUNT {
            return Err(Invalid::new(
                format!("charges[{i}].cost_micros"),
                "above the largest amount, 2^53",
            )
            .into());
        }
        check_amounts(catalog, &c.amounts, &format!("charges[{i}].amounts"))?;
    }
    let overrun = res.overrun;
    let mut charged = {
        let (actual, _) = derive(
            catalog,
            &usage.amounts,
            res.model.as_deref(),
            usage.cached_input_tokens,
        );
        actual.map_with(&res.held, |a, h| overrun.charge(h, a))
    };
    if !usage.amounts.contains(Dimension::TOKENS) {
        let t = charged
            .get(Dimension::INPUT_TOKENS)
            .saturating_add(charged.get(Dimension::OUTPUT_TOKENS));
        charged.set(Dimension::TOKENS, t);
    }
    for c in &usage.charges {
        let cost = charged
            .get(Dimension::COST_MICROS)
            .saturating_add(c.cost_micros);
        charged.set(Dimension::COST_MICROS, cost);
        charged.add(&c.amounts);
    }
    Ok(charged)
}

/// Checks an extend's arguments; changes nothing.
pub fn check_extend(
    catalog: &Catalog,
    amounts: Option<&Amounts>,
    ttl_ms: Option<u64>,
) -> Result<(), ExtendError> {
    let settings = catalog.settings();
    if amounts.is_none() && ttl_ms.is_none() {
        return Err(Invalid::new("amounts", "extend needs amounts, ttl_ms or both").into());
    }
    if let Some(t) = ttl_ms
        && (t == 0 || t > settings.max_ttl_ms)
    {
        return Err(Invalid::new(
            "ttl_ms",
            format!("must be between 1 and {} ms", settings.max_ttl_ms),
        )
        .into());
    }
    if let Some(a) = amounts {
        check_amounts(catalog, a, "amounts")?;
    }
    Ok(())
}

/// What an extend adds to a reservation on `model`: `amounts` with
/// `tokens` and `cost_micros` derived where absent (nothing without amounts).
pub fn extend_delta(catalog: &Catalog, model: Option<&str>, amounts: Option<&Amounts>) -> Amounts {
    match amounts {
        Some(a) => derive(catalog, a, model, 0).0,
        None => Amounts::new(),
    }
}

/// Checks an admin adjustment: a known scope, an amount in range, and a
/// `total` limit on `dim` to adjust. Changes nothing.
pub fn check_adjust(
    catalog: &Catalog,
    key: &ScopeKey,
    dim: Dimension,
    credit: i64,
) -> Result<(), AdminError> {
    catalog.check_scope(key)?;
    if credit.unsigned_abs() > MAX_AMOUNT {
        return Err(Invalid::new("amount", "above the largest amount, 2^53").into());
    }
    let has_total = catalog
        .plan_for(key)
        .limits()
        .iter()
        .any(|l| l.dimension() == dim && *l.window() == Window::Total);
    if !has_total {
        return Err(AdminError::NotFound(format!(
            "a total limit on {} for {key}",
            catalog.dimension_name(dim)
        )));
    }
    Ok(())
}
