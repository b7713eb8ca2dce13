//! The state a ledger keeps: scopes, holds, reservations and their queues.
//!
//! A [`Ledger`](crate::Ledger) is one shard; a
//! [`SharedLedger`](crate::SharedLedger) is many, each behind its own lock.
//! A reservation lives in its tenant's shard with a *hold* there for the
//! scopes that shard owns; a shared scope owned by another shard gets a
//! *foreign hold* in that shard, with its own copy of the amounts and the
//! expiry. Every shard expires its own holds at `expires_at`, so no shard
//! ever needs another shard's lock to observe an expiry.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;

use foldhash::fast::RandomState;
use hashbrown::HashTable;
use smallvec::SmallVec;

use crate::catalog::Catalog;
use crate::heap::{Entry, IndexedHeap};
use crate::limit::{Limit, Window};
use crate::plan::{KindLimit, Plan};
use crate::records::Records;
use crate::reservation::{Reservation, ReservationId, Status};
use crate::scope::ScopeKey;
use crate::units::{Amounts, Dimension};
use crate::window::{self, State};

/// A slot that holds nothing.
pub(crate) const NO_SLOT: u32 = u32::MAX;

/// What a scope holds beyond its windows; only scopes that held something
/// recently (or have wide slices) pay for it. It stays allocated while the
/// scope is busy and is trimmed when the scope is found idle, so a hot scope
/// does not allocate on every reservation.
#[derive(Clone, Debug, Default)]
pub(crate) struct Extra {
    /// Held amounts per dimension (implied dimensions are `held_count`).
    pub(crate) held: Amounts,
    /// The expiries of the holds on this scope, for "the earliest of the
    /// scope's HELD reservations expires" (retry_after, resets_at).
    pub(crate) holders: IndexedHeap,
    /// Sliding limits whose slices outgrew 32 bits: (limit index, slices).
    pub(crate) wide: SmallVec<[(u8, Box<[u64]>); 1]>,
}

/// One scope: its name, its windows' state words and its holds.
#[derive(Clone, Debug)]
pub(crate) struct ScopeState {
    /// Its canonical name: the scope index, holds and the idle-scope queue
    /// refer to the scope by slot, and find the name here.
    pub(crate) key: ScopeKey,
    /// `[0]` is the instant every window was last advanced to; then each
    /// limit's words at the plan's offsets.
    pub(crate) words: Box<[u64]>,
    pub(crate) plan: Arc<Plan>,
    pub(crate) epoch: u64,
    pub(crate) held_count: u32,
    pub(crate) gc_queued: bool,
    /// Bit i: limit i keeps wide slices in `extra`.
    pub(crate) wide_mask: u32,
    pub(crate) extra: Option<Box<Extra>>,
}

impl ScopeState {
    /// A scope with no history, its windows set up at `now_ms`.
    pub(crate) fn new(key: ScopeKey, plan: Arc<Plan>, epoch: u64, now_ms: u64) -> Self {
        let mut st = ScopeState {
            key,
            words: vec![0; plan.words as usize].into(),
            plan,
            epoch,
            held_count: 0,
            gc_queued: false,
            wide_mask: 0,
            extra: None,
        };
        st.words[0] = now_ms;
        st.set_up(0..st.plan.limits().len());
        st
    }

    /// Sets up limits that start from nothing at the instant the scope is
    /// at: a calendar window needs its end now, not at the next instant, and
    /// a sliding window its current slice.
    fn set_up(&mut self, limits: impl Iterator<Item = usize>) {
        let at = self.words[0];
        for i in limits {
            self.state(i).advance(0, at);
        }
    }

    /// Moves the scope to the catalog's current plan at `now_ms` if it
    /// changed, keeping the history of every limit whose dimension and
    /// window stay (its windows are then at `now_ms`).
    ///
    /// The plan the scope was on governs until this instant (a bucket
    /// refills at its old rate up to `now_ms`): only operations that are
    /// journaled call this on the scope's own state (a granted reserve, a
    /// growing extend, a settle, an adjustment), so where a scope moves
    /// plans depends on those alone, never on a read, a denial or a dry
    /// run, and a ledger rebuilt from its log, or the Redis store, moves it
    /// at the same instant. Those others work on a copy
    /// ([`ScopeState::needs_move`]).
    #[inline]
    pub(crate) fn sync(&mut self, catalog: &Catalog, now_ms: u64) {
        if self.stale(catalog) {
            self.resync(catalog, now_ms);
        }
    }

    /// Whether the catalog changed since the scope last moved to its plan.
    #[inline]
    fn stale(&self, catalog: &Catalog) -> bool {
        self.epoch != catalog.epoch()
    }

    /// Whether [`ScopeState::sync`] would move the scope to another plan.
    /// A catalog change that left its plan as it was (a price, another
    /// kind's plan) is taken in here: the scope is marked current, which
    /// changes nothing it answers.
    #[inline]
    pub(crate) fn needs_move(&mut self, catalog: &Catalog) -> bool {
        self.stale(catalog) && self.plan_changed(catalog)
    }

    #[cold]
    fn plan_changed(&mut self, catalog: &Catalog) -> bool {
        if Arc::ptr_eq(catalog.plan_for(&self.key), &self.plan) {
            self.epoch = catalog.epoch();
            return false;
        }
        true
    }

    /// [`ScopeState::sync`] once the catalog changed (off the hot path).
    #[cold]
    fn resync(&mut self, catalog: &Catalog, now_ms: u64) {
        // Up to now on the old plan: its rates and windows were in force.
        self.advance(now_ms);
        self.epoch = catalog.epoch();
        let plan = catalog.plan_for(&self.key);
        if Arc::ptr_eq(plan, &self.plan) {
            return;
        }
        let mut words = vec![0u64; plan.words as usize].into_boxed_slice();
        words[0] = self.words[0];
        let mut wide: SmallVec<[(u8, Box<[u64]>); 1]> = SmallVec::new();
        let old_wide = self
            .extra
            .as_mut()
            .map(|e| std::mem::take(&mut e.wide))
            .unwrap_or_default();
        let mut fresh: SmallVec<[usize; 4]> = SmallVec::new();
        // Sliding limits whose slices alone changed: their history, cut anew.
        let mut carried: SmallVec<[(usize, Vec<u64>); 1]> = SmallVec::new();
        let old_plan = self.plan.clone();
        let mut old_wide = old_wide;
        for (j, limit) in plan.limits().iter().enumerate() {
            let Some(i) = old_plan.limits().iter().position(|o| o.same_history(limit)) else {
                // The finest such window, if several (as the Redis store picks).
                let finest = (0..old_plan.limits().len())
                    .filter(|&i| old_plan.limits()[i].reslices(limit))
                    .max_by_key(|&i| match old_plan.limits()[i].window() {
                        Window::Sliding { slices, .. } => *slices,
                        _ => 0,
                    });
                if let Some(i) = finest {
                    let n = window::words_for(old_plan.limits()[i].window());
                    let from = old_plan.offsets[i] as usize;
                    let mut old = window::State {
                        limit: &old_plan.limits()[i],
                        words: &mut self.words[from..from + n],
                        wide: old_wide
                            .iter_mut()
                            .find(|(k, _)| usize::from(*k) == i)
                            .map(|(_, w)| &mut w[..]),
                    };
                    if let Some(c) = window::reslice(&mut old, limit, now_ms) {
                        carried.push((j, c));
                    }
                }
                fresh.push(j);
                continue;
            };
            let n = window::words_for(limit.window());
            let (from, to) = (self.plan.offsets[i] as usize, plan.offsets[j] as usize);
            words[to..to + n].copy_from_slice(&self.words[from..from + n]);
            if let Some((_, w)) = old_wide.iter().find(|(k, _)| usize::from(*k) == i) {
                wide.push((j as u8, w.clone()));
            }
        }
        self.words = words;
        self.plan = plan.clone();
        self.set_up(fresh.into_iter());
        self.wide_mask = wide.iter().fold(0, |m, (k, _)| m | (1 << k));
        if !wide.is_empty() {
            self.extra.get_or_insert_with(Default::default).wide = wide;
        }
        for (j, c) in carried {
            if !self.state(j).take_slices(&c) {
                self.extra
                    .get_or_insert_with(Default::default)
                    .wide
                    .push((j as u8, vec![0; c.len()].into_boxed_slice()));
                self.wide_mask |= 1 << j;
                let taken = self.state(j).take_slices(&c);
                debug_assert!(taken, "wide slices take any amount");
            }
        }
        self.trim_extra();
    }

    /// A scope as a snapshot recorded it: on `plan` as of catalog `epoch`,
    /// with its state words and wide slices, and nothing held yet (holds are
    /// added with [`ShardState::add_hold`]). Refused if the words do not fit
    /// the plan ([`ScopeState::check_layout`]).
    pub(crate) fn restored(
        key: ScopeKey,
        (plan, epoch): (Arc<Plan>, u64),
        words: Box<[u64]>,
        wide: SmallVec<[(u8, Box<[u64]>); 1]>,
    ) -> Result<Self, String> {
        let wide_mask = wide.iter().fold(0u32, |m, (k, _)| {
            m | 1u32.checked_shl(u32::from(*k)).unwrap_or(0)
        });
        let st = ScopeState {
            key,
            words,
            plan,
            epoch,
            held_count: 0,
            gc_queued: false,
            wide_mask,
            extra: (!wide.is_empty()).then(|| {
                Box::new(Extra {
                    wide,
                    ..Extra::default()
                })
            }),
        };
        st.check_layout()?;
        Ok(st)
    }

    /// Checks that the state words fit the plan: their number, each limit's
    /// words ([`window::check_words`]), and one wide-slices entry per bit of
    /// `wide_mask`, each for a sliding limit of the plan.
    pub(crate) fn check_layout(&self) -> Result<(), String> {
        let limits = self.plan.limits();
        if self.words.len() != self.plan.words as usize {
            return Err(format!(
                "{} state words, its plan {:?} has {}",
                self.words.len(),
                self.plan.name(),
                self.plan.words
            ));
        }
        let wide = self.extra.as_ref().map_or(&[][..], |e| &e.wide[..]);
        let mut mask = 0u32;
        for (k, _) in wide {
            let bit = 1u32.checked_shl(u32::from(*k)).unwrap_or(0);
            if usize::from(*k) >= limits.len() || mask & bit != 0 {
                return Err(format!("wide slices for limit {k}, given twice or absent"));
            }
            mask |= bit;
        }
        if mask != self.wide_mask {
            return Err(format!(
                "wide slices of limits {mask:#b}, marked {:#b}",
                self.wide_mask
            ));
        }
        for (i, limit) in limits.iter().enumerate() {
            let at = self.plan.offsets[i] as usize;
            let end = self
                .plan
                .offsets
                .get(i + 1)
                .map_or(self.words.len(), |&o| o as usize);
            let w = wide
                .iter()
                .find(|(k, _)| usize::from(*k) == i)
                .map(|(_, w)| &w[..]);
            window::check_words(limit, &self.words[at..end], w)
                .map_err(|e| format!("limit {i}: {e}"))?;
        }
        Ok(())
    }

    /// The state of limit `i`.
    #[inline]
    pub(crate) fn state(&mut self, i: usize) -> State<'_> {
        let ScopeState {
            words,
            plan,
            extra,
            wide_mask,
            ..
        } = self;
        let limit: &Limit = &plan.limits()[i];
        let at = plan.offsets[i] as usize;
        let end = plan
            .offsets
            .get(i + 1)
            .map_or(plan.words as usize, |&o| o as usize);
        let n = end - at;
        // Wide slices are rare: look for them only when this limit has some.
        let wide = if *wide_mask & (1 << i) == 0 {
            None
        } else {
            extra
                .as_mut()
                .and_then(|e| e.wide.iter_mut().find(|(k, _)| usize::from(*k) == i))
                .map(|(_, w)| &mut w[..])
        };
        State {
            limit,
            words: &mut words[at..at + n],
            wide,
        }
    }

    /// Advances every window to `now_ms`.
    #[inline]
    pub(crate) fn advance(&mut self, now_ms: u64) {
        // Every window is set up at `words[0]` (see `set_up`): the same
        // instant changes nothing (a settle right after its reserve).
        if now_ms > self.words[0] {
            self.advance_from(now_ms);
        }
    }

    /// [`ScopeState::advance`] when time moved.
    fn advance_from(&mut self, now_ms: u64) {
        let from = self.words[0];
        if self.wide_mask == 0 {
            let ScopeState { words, plan, .. } = self;
            for (i, h) in plan.hot.iter().enumerate() {
                let w = &mut words[h.at as usize..];
                window::advance_narrow((h.fast, h.capacity), (plan.limits(), i), w, from, now_ms);
            }
        } else {
            for i in 0..self.plan.limits().len() {
                self.state(i).advance(from, now_ms);
            }
        }
        self.words[0] = now_ms;
    }

    /// Advances every window to `now_ms` and answers whether
    /// `requested(dim)` more fits under every limit: reserve's walk over a
    /// scope, both in one pass. With `only_positive`, limits asked for
    /// nothing pass.
    #[inline]
    pub(crate) fn advance_and_fit(
        &mut self,
        now_ms: u64,
        requested: &impl Fn(Dimension) -> u64,
        only_positive: bool,
    ) -> bool {
        let from = self.words[0];
        let moved = now_ms > from;
        if self.wide_mask != 0 {
            self.advance(now_ms);
            return self.fits_all(requested, only_positive);
        }
        let ScopeState {
            words,
            plan,
            extra,
            held_count,
            ..
        } = self;
        let held = extra.as_ref().map(|e| &e.held);
        let held_of = |dim: Dimension| {
            if dim.is_implied() {
                u64::from(*held_count)
            } else {
                held.map_or(0, |a| a.get(dim))
            }
        };
        // Whether limit `l` has room for what is asked of it, by `test`.
        let passes = |l: &KindLimit, test: &dyn Fn(u64) -> bool| {
            let req = requested(l.dim);
            (only_positive && req == 0)
                || window::room(l.capacity, held_of(l.dim), req).is_some_and(test)
        };
        let elapsed = if moved { now_ms - from } else { 0 };
        let k = &plan.by_kind;
        let mut ok = true;
        for l in k.buckets.iter() {
            let d = window::bucket_refill(&mut words[l.at as usize..], l.capacity, elapsed);
            ok = ok && passes(l, &|room| window::bucket_fits(d, room, l.ms));
        }
        for l in k.sliding.iter() {
            let at = l.at as usize;
            if moved && now_ms >= words[at + 1] {
                let h = &plan.hot[usize::from(l.index)];
                window::advance_narrow(
                    (h.fast, h.capacity),
                    (plan.limits(), usize::from(l.index)),
                    &mut words[at..],
                    from,
                    now_ms,
                );
            }
            // The window's total is its first word.
            let total = words[at];
            ok = ok && passes(l, &|room| total <= room);
        }
        for l in k.concurrent.iter() {
            ok = ok && passes(l, &|_| true);
        }
        for l in k.other.iter() {
            let h = &plan.hot[usize::from(l.index)];
            let w = &mut words[l.at as usize..];
            if moved {
                window::advance_narrow(
                    (h.fast, h.capacity),
                    (plan.limits(), usize::from(l.index)),
                    w,
                    from,
                    now_ms,
                );
            }
            let w = &words[l.at as usize..];
            ok = ok && passes(l, &|room| window::fits(h.fast, room, w, 0, 0));
        }
        if moved {
            words[0] = now_ms;
        }
        ok
    }

    /// Whether `requested(dim)` more fits under every limit (the hot path of
    /// a check: the refused case is worked out limit by limit by the
    /// caller). With `only_positive`, limits asked for nothing pass.
    #[inline]
    pub(crate) fn fits_all(
        &self,
        requested: &impl Fn(Dimension) -> u64,
        only_positive: bool,
    ) -> bool {
        let held = self.extra.as_ref().map(|e| &e.held);
        for h in self.plan.hot.iter() {
            let dim = h.dim;
            let req = requested(dim);
            if only_positive && req == 0 {
                continue;
            }
            let held = if dim.is_implied() {
                u64::from(self.held_count)
            } else {
                held.map_or(0, |a| a.get(dim))
            };
            if !window::fits(h.fast, h.capacity, &self.words[h.at as usize..], req, held) {
                return false;
            }
        }
        true
    }

    /// Held amount of `dim` on this scope.
    #[inline]
    pub(crate) fn held(&self, dim: Dimension) -> u64 {
        if dim.is_implied() {
            return u64::from(self.held_count);
        }
        self.extra.as_ref().map_or(0, |e| e.held.get(dim))
    }

    /// When the earliest hold on this scope expires.
    #[inline]
    pub(crate) fn earliest_expiry(&self) -> Option<u64> {
        self.extra
            .as_ref()
            .and_then(|e| e.holders.peek())
            .map(|e| e.due_ms)
    }

    /// When the earliest hold on this scope that holds some of `dim`
    /// expires (every hold holds the implied dimensions, `requests` and
    /// `concurrent`), the hold of reservation `skip` aside (an extend's
    /// own: it never frees room for its own raise). `holds` is the shard's
    /// hold table.
    ///
    /// Only a denial asks (never a grant), and the walk is bounded: the
    /// holds are visited in expiry order, best first down the holder heap,
    /// at most [`HOLD_WALK`] of them (`skip`'s counted); when none of those
    /// holds `dim`, the answer is the expiry of the last one visited — no
    /// later than the true one, and the same whatever order holds expiring
    /// at the same instant are visited in, so the Redis store, which walks
    /// its own order, answers alike. `None` when the scope holds nothing.
    #[cold]
    pub(crate) fn earliest_holding(
        &self,
        holds: &[Option<Hold>],
        dim: Dimension,
        skip: Option<ReservationId>,
    ) -> Option<u64> {
        let entries = self.extra.as_ref()?.holders.entries();
        // The frontier of the walk: heap positions by their entries' keys
        // (expiry, hold slot, tag), smallest first.
        type Frontier = BinaryHeap<Reverse<((u64, u32, u8), u32)>>;
        let mut frontier = Frontier::new();
        let key = |i: usize| {
            let e = entries[i];
            Reverse(((e.due_ms, e.slot, e.tag), i as u32))
        };
        if !entries.is_empty() {
            frontier.push(key(0));
        }
        let mut last = None;
        for _ in 0..HOLD_WALK {
            let Some(Reverse(((due, slot, _), i))) = frontier.pop() else {
                break;
            };
            last = Some(due);
            if let Some(Some(h)) = holds.get(slot as usize)
                && Some(h.owner) != skip
                && (dim.is_implied() || h.amounts.get(dim) > 0)
            {
                return Some(due);
            }
            for c in [2 * i as usize + 1, 2 * i as usize + 2] {
                if c < entries.len() {
                    frontier.push(key(c));
                }
            }
        }
        last
    }

    /// Records usage of `amount` on limit `i` at `now_ms`.
    pub(crate) fn record(&mut self, i: usize, now_ms: u64, amount: u64) {
        let s = self.state(i);
        if s.needs_wide(now_ms, amount) {
            let w = s.widen();
            self.extra
                .get_or_insert_with(Default::default)
                .wide
                .push((i as u8, w));
            self.wide_mask |= 1 << i;
        }
        self.state(i).record(now_ms, amount);
    }

    /// Records a settle's charged amounts on every limit (`requests` = 1).
    #[inline]
    pub(crate) fn record_all(&mut self, now_ms: u64, charged: &Amounts) {
        // `requests` is 1 per settle; the `concurrent` gauge records nothing.
        let row = charged.builtin_row(1, 0);
        let amount_of = |dim: Dimension| match row.get(dim.index()) {
            Some(&a) => a,
            None => charged.get(dim),
        };
        if self.wide_mask == 0 {
            let ScopeState { words, plan, .. } = self;
            let k = &plan.by_kind;
            let mut slow: u32 = 0;
            for l in k.buckets.iter() {
                let amount = amount_of(l.dim);
                if amount != 0 {
                    window::bucket_record(&mut words[l.at as usize..], amount, l.ms);
                }
            }
            // `concurrent` records nothing.
            for l in k.sliding.iter().chain(k.other.iter()) {
                let amount = amount_of(l.dim);
                let fast = plan.hot[usize::from(l.index)].fast;
                if amount != 0
                    && !window::record_narrow(fast, &mut words[l.at as usize..], now_ms, amount)
                {
                    slow |= 1 << l.index;
                }
            }
            if slow != 0 {
                self.record_slow(slow, now_ms, charged);
            }
        } else {
            self.record_slow(u32::MAX, now_ms, charged);
        }
    }

    /// Records on the limits in `mask` one by one (wide slices, or a slice
    /// about to outgrow 32 bits): the rest of [`ScopeState::record_all`].
    #[cold]
    #[inline(never)]
    fn record_slow(&mut self, mut mask: u32, now_ms: u64, charged: &Amounts) {
        for (i, limit) in self.plan.clone().limits().iter().enumerate() {
            if mask & 1 != 0 {
                let amount = match limit.dimension() {
                    Dimension::REQUESTS => 1,
                    Dimension::CONCURRENT => 0,
                    d => charged.get(d),
                };
                if amount > 0 {
                    self.record(i, now_ms, amount);
                }
            }
            mask >>= 1;
        }
    }

    /// Drops the extra part once it holds nothing.
    pub(crate) fn trim_extra(&mut self) {
        if let Some(e) = &self.extra
            && self.held_count == 0
            && e.wide.is_empty()
            && e.held.is_empty()
        {
            self.extra = None;
        }
    }

    /// When every window will be empty without new traffic (`None`: never).
    pub(crate) fn empty_at(&mut self, now_ms: u64) -> Option<u64> {
        let mut at = now_ms;
        for i in 0..self.plan.limits().len() {
            at = at.max(self.state(i).empty_at(now_ms)?);
        }
        Some(at)
    }

    /// Bytes this scope's state uses beyond the map entry (for the memory benchmark).
    pub fn heap_bytes(&self) -> usize {
        self.words.len() * 8
            + self.extra.as_ref().map_or(0, |e| {
                std::mem::size_of::<Extra>()
                    + e.holders.len() * std::mem::size_of::<Entry>()
                    + e.wide.iter().map(|(_, w)| w.len() * 8).sum::<usize>()
            })
    }
}

/// One of a hold's scopes that this shard owns.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HoldScope {
    /// Its position in the reservation's scopes (the tenant is 0).
    pub(crate) index: u8,
    /// Its slot in this shard's scope table. Valid while the hold lives: a
    /// scope with holds is never dropped.
    pub(crate) slot: u32,
    /// Where the hold's entry sits in the scope's holder heap.
    pub(crate) pos: u32,
}

/// A hold of one reservation on the scopes of one shard.
#[derive(Clone, Debug)]
pub(crate) struct Hold {
    pub(crate) owner: ReservationId,
    /// Whether the reservation lives in another shard.
    pub(crate) foreign: bool,
    /// The scopes this shard owns (each scope's holder-heap entry is tagged
    /// with its position here).
    pub(crate) scopes: SmallVec<[HoldScope; 4]>,
    pub(crate) amounts: Amounts,
    pub(crate) expires_ms: u64,
    pub(crate) heap_pos: u32,
}

/// A reservation as stored.
#[derive(Clone, Debug)]
pub(crate) struct Record {
    pub(crate) res: Reservation,
    /// Amounts as sent, for idempotent replays: kept only with an
    /// idempotency key (nothing else reads them).
    pub(crate) sent: Option<Box<Amounts>>,
    /// Its hold in this shard while HELD.
    pub(crate) hold_slot: u32,
    /// Whether some of its scopes live in other shards.
    pub(crate) multi_shard: bool,
    /// When it may be forgotten (once ended).
    pub(crate) drop_at: u64,
}

/// Everything one shard owns.
#[derive(Clone, Debug, Default)]
pub(crate) struct ShardState {
    /// Scope name → slot in `scopes` (the name itself lives in the scope's
    /// state): one hash per scope per operation; holds and the rest of the
    /// operation use the slot.
    pub(crate) index: HashTable<u32>,
    pub(crate) scopes: Vec<Option<ScopeState>>,
    pub(crate) free_scopes: Vec<u32>,
    pub(crate) records: Records,
    pub(crate) holds: Vec<Option<Hold>>,
    pub(crate) free_slots: Vec<u32>,
    pub(crate) foreign: HashMap<ReservationId, u32, RandomState>,
    pub(crate) expiry: IndexedHeap,
    pub(crate) idempotency: HashMap<Box<str>, ReservationId, RandomState>,
    pub(crate) ended: VecDeque<(u64, ReservationId)>,
    pub(crate) ended_keyed: VecDeque<(u64, ReservationId)>,
    /// Scopes to look at for idleness: (when, slot). A scope is queued at
    /// most once (`gc_queued`) and only its own entry drops it, so a slot
    /// here always names the scope that was queued.
    pub(crate) gc: BinaryHeap<Reverse<(u64, u32)>>,
    /// The latest instant this shard has seen: time never goes backwards here.
    pub(crate) now_ms: u64,
    /// Reservations expired in this shard (their home): a counter for metrics.
    pub(crate) expired_count: u64,
    /// Records of reservations with scopes in other shards: while there
    /// are none, a settle or refund needs no lookup to know it locks only
    /// this shard.
    pub(crate) multi_shard_records: usize,
    /// Whether expiries are reported for the usage log (a store that keeps
    /// one turns it on).
    pub(crate) report_expiries: bool,
    /// Home reservations that expired since the last journaled operation
    /// on this shard collected them, each as it was when it expired: the
    /// usage log's `expired` records. Reads expire holds too, but only a
    /// journaled operation reports them, so the log and a replay of it
    /// agree on where each appears. Kept whole, not by id: the same
    /// observation may also forget the record (a shard untouched for
    /// longer than the ended retention), and its expiry must still be
    /// reported.
    pub(crate) expired_outbox: Vec<Reservation>,
}

/// A shard: its configuration and its state.
#[derive(Debug)]
pub(crate) struct Shard {
    pub(crate) catalog: Arc<Catalog>,
    pub(crate) st: ShardState,
    /// A snapshot's cut this shard has not been copied for yet, and the
    /// shard's place in it: whoever locks the shard next copies its state
    /// there first (see `Padded::lock` in `shared.rs`).
    pub(crate) copy_to: Option<(std::sync::Weak<CopyCut>, usize)>,
}

/// The shards' states at a snapshot's cut, filled in as each shard is next
/// locked (by an operation, before it changes anything, or by the
/// snapshot itself).
#[derive(Debug)]
pub(crate) struct CopyCut {
    pub(crate) states: crate::sync::Mutex<Vec<Option<ShardState>>>,
}

impl Shard {
    /// Copies the state into the cut waiting for it, if one is (a snapshot
    /// dropped meanwhile wants nothing).
    #[cold]
    pub(crate) fn copy_out(&mut self) {
        if let Some((cut, i)) = self.copy_to.take()
            && let Some(cut) = cut.upgrade()
        {
            let st = self.st.clone();
            cut.states.lock()[i] = Some(st);
        }
    }
}

/// How long a scope found idle (nothing held) is kept before the idle-scope
/// collector looks at it: it is dropped then if its windows are empty.
/// Without it, a scope whose plan only counts concurrency (a tenant capped
/// on calls in flight) was dropped after every reservation's end and built
/// again by the next: a malloc, a free and an index insert and removal per
/// reservation. Memory stays bounded: an idle scope lives at most this long
/// past the moment its windows empty.
pub(crate) const IDLE_SCOPE_GRACE_MS: u64 = 5_000;

/// Most holds a denial looks at to find the earliest one that holds the
/// refused limit's dimension ([`ScopeState::earliest_holding`]); the
/// Redis store's `ledger.lua` walks as many (`HOLD_WALK`).
pub(crate) const HOLD_WALK: usize = 64;

/// How many idle scopes one operation may drop on its way (bounded so an
/// operation's latency never depends on how many scopes went idle).
pub(crate) const GC_PER_OPERATION: usize = 4;

/// The idempotency map's key: the tenant and the key, one string.
pub(crate) fn idempotency_key(tenant: &str, key: &str) -> Box<str> {
    let mut s = String::with_capacity(tenant.len() + key.len() + 1);
    s.push_str(tenant);
    s.push('\n');
    s.push_str(key);
    s.into()
}

fn set_heap_pos(holds: &mut [Option<Hold>]) -> impl FnMut(u32, u8, u32) + '_ {
    move |slot, _tag, pos| {
        if let Some(Some(h)) = holds.get_mut(slot as usize) {
            h.heap_pos = pos;
        }
    }
}

fn set_holder_pos(holds: &mut [Option<Hold>]) -> impl FnMut(u32, u8, u32) + '_ {
    move |slot, tag, pos| {
        if let Some(Some(h)) = holds.get_mut(slot as usize)
            && let Some(hs) = h.scopes.get_mut(usize::from(tag))
        {
            hs.pos = pos;
        }
    }
}

/// Queues the scope in `slot` for the idle-scope collector, due
/// [`IDLE_SCOPE_GRACE_MS`] from `now_ms`, if it holds nothing and is not
/// queued already (only its own entry ever drops it).
#[inline]
fn queue_if_idle(
    gc: &mut BinaryHeap<Reverse<(u64, u32)>>,
    st: &mut ScopeState,
    slot: u32,
    now_ms: u64,
) {
    if st.held_count == 0 && !st.gc_queued {
        st.gc_queued = true;
        gc.push(Reverse((now_ms.saturating_add(IDLE_SCOPE_GRACE_MS), slot)));
    }
}

#[inline]
fn live(scopes: &mut [Option<ScopeState>], slot: u32) -> &mut ScopeState {
    scopes[slot as usize]
        .as_mut()
        .expect("a scope slot held by a live hold")
}

/// The hash of a scope name in a shard's index: made with the key, once.
#[inline]
fn name_hash(key: &ScopeKey) -> u64 {
    key.index_hash()
}

/// What a released hold was: its owner, whether it was foreign, and when
/// it was due to expire.
pub(crate) type Released = (ReservationId, bool, u64);

impl ShardState {
    /// The slot of an existing scope.
    #[inline]
    pub(crate) fn slot_of(&self, key: &ScopeKey) -> Option<u32> {
        let scopes = &self.scopes;
        self.index
            .find(
                name_hash(key),
                |&s| matches!(&scopes[s as usize], Some(st) if st.key == *key),
            )
            .copied()
    }

    /// The scope's slot, its state created fresh if absent, on its current
    /// plan and advanced to `now_ms`.
    #[inline]
    pub(crate) fn scope_slot(&mut self, catalog: &Catalog, key: &ScopeKey, now_ms: u64) -> u32 {
        let slot = self.find_or_add(catalog, key, now_ms);
        let ShardState { scopes, gc, .. } = self;
        let st = live(scopes, slot);
        st.sync(catalog, now_ms);
        st.advance(now_ms);
        queue_if_idle(gc, st, slot, now_ms);
        slot
    }

    /// The scope's slot, its state created fresh (set up at `now_ms`) if
    /// absent.
    #[inline]
    fn find_or_add(&mut self, catalog: &Catalog, key: &ScopeKey, now_ms: u64) -> u32 {
        let hash = name_hash(key);
        let ShardState {
            index,
            scopes,
            free_scopes,
            ..
        } = self;
        let found = index
            .find(
                hash,
                |&s| matches!(&scopes[s as usize], Some(st) if st.key == *key),
            )
            .copied();
        match found {
            Some(s) => s,
            None => {
                let st = ScopeState::new(
                    key.clone(),
                    catalog.plan_for(key).clone(),
                    catalog.epoch(),
                    now_ms,
                );
                let s = match free_scopes.pop() {
                    Some(s) => {
                        scopes[s as usize] = Some(st);
                        s
                    }
                    None => {
                        scopes.push(Some(st));
                        (scopes.len() - 1) as u32
                    }
                };
                let scopes = &*scopes;
                index.insert_unique(hash, s, |&j| {
                    scopes[j as usize]
                        .as_ref()
                        .map_or(0, |st| name_hash(&st.key))
                });
                s
            }
        }
    }

    /// Adds a restored scope ([`ScopeState::restored`]), queued for the
    /// idle-scope collector at `gc_due_ms` when given. Refused if the shard
    /// already has a scope of that name.
    pub(crate) fn restore_scope(
        &mut self,
        mut st: ScopeState,
        gc_due_ms: Option<u64>,
    ) -> Result<u32, String> {
        if self.slot_of(&st.key).is_some() {
            return Err(format!("{} has two states", st.key));
        }
        let hash = name_hash(&st.key);
        st.gc_queued = gc_due_ms.is_some();
        let ShardState {
            index,
            scopes,
            free_scopes,
            gc,
            ..
        } = self;
        let slot = match free_scopes.pop() {
            Some(s) => {
                scopes[s as usize] = Some(st);
                s
            }
            None => {
                scopes.push(Some(st));
                (scopes.len() - 1) as u32
            }
        };
        let scopes = &*scopes;
        index.insert_unique(hash, slot, |&j| {
            scopes[j as usize]
                .as_ref()
                .map_or(0, |st| name_hash(&st.key))
        });
        if let Some(due) = gc_due_ms {
            gc.push(Reverse((due, slot)));
        }
        Ok(slot)
    }

    /// [`ShardState::scope_slot`] and whether `requested(dim)` more fits
    /// under every limit of the scope ([`ScopeState::advance_and_fit`]).
    /// A scope that moves to a new plan for the check also returns its
    /// state from before the move: a check that grants nothing (a denial, a
    /// dry run) puts it back ([`ShardState::unsync`]), as only journaled
    /// operations may move a scope (see [`ScopeState::sync`]).
    #[inline]
    pub(crate) fn scope_check(
        &mut self,
        catalog: &Catalog,
        key: &ScopeKey,
        now_ms: u64,
        requested: &impl Fn(Dimension) -> u64,
        only_positive: bool,
    ) -> (u32, bool, Option<Box<ScopeState>>) {
        let slot = self.find_or_add(catalog, key, now_ms);
        let ShardState { scopes, gc, .. } = self;
        let st = live(scopes, slot);
        let before = st.needs_move(catalog).then(|| {
            let before = Box::new(st.clone());
            st.sync(catalog, now_ms);
            before
        });
        let fits = st.advance_and_fit(now_ms, requested, only_positive);
        queue_if_idle(gc, st, slot, now_ms);
        (slot, fits, before)
    }

    /// Puts back a scope's state from before [`ShardState::scope_check`]
    /// moved it to a new plan. Only its plan and windows differ: the check
    /// changed no hold, so the rest is as it was.
    #[cold]
    pub(crate) fn unsync(&mut self, slot: u32, before: ScopeState) {
        let st = live(&mut self.scopes, slot);
        let gc_queued = st.gc_queued;
        *st = before;
        // A queue entry pushed by the check stays in the queue.
        st.gc_queued |= gc_queued;
    }

    /// The state in a slot.
    #[inline]
    pub(crate) fn scope_at(&mut self, slot: u32) -> &mut ScopeState {
        live(&mut self.scopes, slot)
    }

    /// The state in a slot, and the shard's holds (what a denial reads to
    /// find which holds stand in its way).
    #[inline]
    pub(crate) fn scope_and_holds(&mut self, slot: u32) -> (&mut ScopeState, &[Option<Hold>]) {
        let ShardState { scopes, holds, .. } = self;
        (live(scopes, slot), holds)
    }

    /// [`ShardState::scope_slot`], then the state.
    pub(crate) fn scope_mut(
        &mut self,
        catalog: &Catalog,
        key: &ScopeKey,
        now_ms: u64,
    ) -> &mut ScopeState {
        let slot = self.scope_slot(catalog, key, now_ms);
        self.scope_at(slot)
    }

    /// Adds a hold on this shard's scopes (their slots, from the check, are
    /// in `hold.scopes`). Returns its slot.
    pub(crate) fn add_hold(&mut self, mut hold: Hold) -> u32 {
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.holds.push(None);
                (self.holds.len() - 1) as u32
            }
        };
        let expires = hold.expires_ms;
        let ShardState {
            scopes,
            holds,
            expiry,
            ..
        } = self;
        // The new hold is not in `holds` yet: the heaps tell it its
        // positions directly, and the holds they move through `holds`.
        for k in 0..hold.scopes.len() {
            let st = live(scopes, hold.scopes[k].slot);
            st.held_count += 1;
            let extra = st.extra.get_or_insert_with(Default::default);
            extra.held.add(&hold.amounts);
            let entry = Entry {
                due_ms: expires,
                slot,
                tag: k as u8,
            };
            extra.holders.push(entry, &mut |s, tag, pos| {
                let h = if s == slot {
                    Some(&mut hold)
                } else {
                    holds.get_mut(s as usize).and_then(Option::as_mut)
                };
                if let Some(hs) = h.and_then(|h| h.scopes.get_mut(usize::from(tag))) {
                    hs.pos = pos;
                }
            });
        }
        let entry = Entry {
            due_ms: expires,
            slot,
            tag: 0,
        };
        expiry.push(entry, &mut |s, _, pos| {
            if s == slot {
                hold.heap_pos = pos;
            } else if let Some(Some(h)) = holds.get_mut(s as usize) {
                h.heap_pos = pos;
            }
        });
        holds[slot as usize] = Some(hold);
        slot
    }

    /// Releases a hold from every scope of this shard.
    #[inline]
    pub(crate) fn release_hold(&mut self, slot: u32, now_ms: u64) -> Released {
        self.release_hold_recording(slot, now_ms, None)
    }

    /// [`ShardState::release_hold`], recording `charged` on each scope
    /// first when given (a settle: one pass over the hold's scopes, with
    /// no lookup by name).
    pub(crate) fn release_hold_recording(
        &mut self,
        slot: u32,
        now_ms: u64,
        record: Option<(&Catalog, &Amounts)>,
    ) -> Released {
        let hold = self.holds[slot as usize].take().expect("a live hold slot");
        let ShardState {
            scopes,
            holds,
            expiry,
            gc,
            free_slots,
            ..
        } = self;
        expiry.remove(hold.heap_pos, &mut set_heap_pos(holds));
        for hs in &hold.scopes {
            let st = live(scopes, hs.slot);
            if let Some((catalog, charged)) = record {
                // A plan change since the scope was last touched is in
                // force for this settle too: record into the current
                // plan's limits.
                st.sync(catalog, now_ms);
                st.advance(now_ms);
                st.record_all(now_ms, charged);
            }
            st.held_count -= 1;
            if let Some(extra) = st.extra.as_mut() {
                extra.held.sub(&hold.amounts);
                extra.holders.remove(hs.pos, &mut set_holder_pos(holds));
            }
            queue_if_idle(gc, st, hs.slot, now_ms);
        }
        free_slots.push(slot);
        (hold.owner, hold.foreign, hold.expires_ms)
    }

    /// Raises a hold by `delta` on every scope of this shard.
    pub(crate) fn raise_hold(&mut self, slot: u32, delta: &Amounts) {
        let ShardState { scopes, holds, .. } = self;
        let Some(Some(hold)) = holds.get_mut(slot as usize) else {
            return;
        };
        hold.amounts.add(delta);
        for hs in &hold.scopes {
            if let Some(extra) = live(scopes, hs.slot).extra.as_mut() {
                extra.held.add(delta);
            }
        }
    }

    /// Moves a hold's expiry.
    pub(crate) fn move_hold(&mut self, slot: u32, expires_ms: u64) {
        let (heap_pos, locals): (u32, SmallVec<[HoldScope; 4]>) = {
            let Some(Some(hold)) = self.holds.get_mut(slot as usize) else {
                return;
            };
            hold.expires_ms = expires_ms;
            (hold.heap_pos, hold.scopes.clone())
        };
        let ShardState {
            scopes,
            holds,
            expiry,
            ..
        } = self;
        expiry.update(heap_pos, expires_ms, &mut set_heap_pos(holds));
        for hs in locals {
            if let Some(extra) = live(scopes, hs.slot).extra.as_mut() {
                extra
                    .holders
                    .update(hs.pos, expires_ms, &mut set_holder_pos(holds));
            }
        }
    }

    /// Observes `now_ms` (never earlier than what this shard saw): expires
    /// due holds, forgets ended reservations past their retention, and drops
    /// up to `gc_budget` idle scopes. Returns the instant used.
    pub(crate) fn observe(&mut self, catalog: &Catalog, now_ms: u64, gc_budget: usize) -> u64 {
        let now = now_ms.max(self.now_ms);
        self.now_ms = now;
        while let Some(top) = self.expiry.peek() {
            if top.due_ms > now {
                break;
            }
            let (owner, foreign, expires_ms) = self.release_hold(top.slot, now);
            if foreign {
                self.foreign.remove(&owner);
            } else if let Some(rec) = self.records.get_mut(owner) {
                // Counted in the home shard only: one per reservation.
                self.expired_count += 1;
                rec.res.status = Status::Expired;
                rec.res.ended_at = Some(crate::Timestamp::from_millis(expires_ms));
                rec.hold_slot = NO_SLOT;
                if self.report_expiries {
                    self.expired_outbox.push(rec.res.clone());
                }
                // Retention counts from the expiry itself, not from when it
                // was observed: what is remembered is then a function of
                // time alone, the same in a ledger rebuilt from its log.
                // (Holds expire in due order, each due after the instant of
                // any earlier observation, so the queue stays sorted.)
                self.schedule_drop(catalog, owner, expires_ms);
            }
        }
        for keyed in [false, true] {
            loop {
                let queue = if keyed {
                    &mut self.ended_keyed
                } else {
                    &mut self.ended
                };
                match queue.front() {
                    Some(&(at, id)) if at <= now => {
                        queue.pop_front();
                        self.forget(id, at);
                    }
                    _ => break,
                }
            }
        }
        self.collect(now, gc_budget);
        now
    }

    /// Queues an ended reservation to be forgotten after its retention.
    pub(crate) fn schedule_drop(&mut self, catalog: &Catalog, id: ReservationId, now: u64) {
        if let Some(i) = self.records.find(id) {
            self.schedule_drop_at(catalog, i, now);
        }
    }

    /// [`ShardState::schedule_drop`] for the record at a slab index.
    pub(crate) fn schedule_drop_at(&mut self, catalog: &Catalog, i: u32, now: u64) {
        let s = catalog.settings();
        let rec = self.records.at_mut(i);
        let keyed = rec.res.idempotency_key.is_some();
        let keep = if keyed {
            s.ended_retention_ms.max(s.idempotency_retention_ms)
        } else {
            s.ended_retention_ms
        };
        rec.drop_at = now.saturating_add(keep);
        let entry = (rec.drop_at, rec.res.id);
        if keyed {
            self.ended_keyed.push_back(entry);
        } else {
            self.ended.push_back(entry);
        }
    }

    fn forget(&mut self, id: ReservationId, at: u64) {
        let idempotency = &mut self.idempotency;
        let multi = &mut self.multi_shard_records;
        self.records.remove_unless(
            id,
            // A later settle moved its retention: that entry forgets it.
            |r| r.drop_at != at || r.res.status == Status::Held,
            |r| {
                if r.multi_shard {
                    *multi -= 1;
                }
                if let Some(key) = &r.res.idempotency_key {
                    let k = idempotency_key(r.res.scopes.tenant_name(), key);
                    if idempotency.get(&k) == Some(&id) {
                        idempotency.remove(&k);
                    }
                }
            },
        );
    }

    /// Drops up to `budget` scopes that hold nothing and whose windows are
    /// empty; re-queues those that will be empty later.
    pub(crate) fn collect(&mut self, now: u64, budget: usize) {
        for _ in 0..budget {
            match self.gc.peek() {
                Some(Reverse((due, _))) if *due <= now => {}
                _ => return,
            }
            let Some(Reverse((_, slot))) = self.gc.pop() else {
                return;
            };
            let Some(Some(st)) = self.scopes.get_mut(slot as usize) else {
                continue;
            };
            st.gc_queued = false;
            if st.held_count > 0 {
                continue; // the release of its last hold queues it again
            }
            st.trim_extra();
            // On the plan it is on, even if the catalog moved on: that plan
            // governs until the scope's next journaled operation (see
            // `ScopeState::sync`), and windows empty under it stay empty
            // under any plan, so dropping the scope now is the same as
            // keeping it, whenever the collector happens to run.
            st.advance(now);
            match st.empty_at(now) {
                Some(at) if at <= now => {
                    let hash = name_hash(&st.key);
                    if let Ok(entry) = self.index.find_entry(hash, |&s| s == slot) {
                        entry.remove();
                    }
                    self.scopes[slot as usize] = None;
                    self.free_scopes.push(slot);
                }
                Some(at) => {
                    st.gc_queued = true;
                    self.gc.push(Reverse((at, slot)));
                }
                None => {} // a used total budget: kept until an admin credit
            }
        }
    }
}
