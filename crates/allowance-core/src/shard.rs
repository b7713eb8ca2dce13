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
use smallvec::SmallVec;

use crate::catalog::Catalog;
use crate::heap::{Entry, IndexedHeap};
use crate::limit::{Limit, Window};
use crate::plan::Plan;
use crate::reservation::{Reservation, ReservationId, Status};
use crate::scope::{ScopeKey, ScopeSet};
use crate::units::{Amounts, Dimension};
use crate::window::{self, State};

/// A slot that holds nothing.
pub(crate) const NO_SLOT: u32 = u32::MAX;

/// What a scope holds beyond its windows; only scopes with holds (or wide
/// slices) pay for it.
#[derive(Debug, Default)]
pub(crate) struct Extra {
    /// Held amounts per dimension (implied dimensions are `held_count`).
    pub(crate) held: Amounts,
    /// The expiries of the holds on this scope, for "the earliest of the
    /// scope's HELD reservations expires" (retry_after, resets_at).
    pub(crate) holders: IndexedHeap,
    /// Sliding limits whose slices outgrew 32 bits: (limit index, slices).
    pub(crate) wide: SmallVec<[(u8, Box<[u64]>); 1]>,
}

/// One scope: its windows' state words and its holds.
#[derive(Debug)]
pub(crate) struct ScopeState {
    /// `[0]` is the instant every window was last advanced to; then each
    /// limit's words at the plan's offsets.
    pub(crate) words: Box<[u64]>,
    pub(crate) plan: Arc<Plan>,
    pub(crate) epoch: u64,
    pub(crate) held_count: u32,
    pub(crate) gc_queued: bool,
    pub(crate) extra: Option<Box<Extra>>,
}

impl ScopeState {
    pub(crate) fn new(plan: Arc<Plan>, epoch: u64) -> Self {
        ScopeState {
            words: vec![0; plan.words as usize].into(),
            plan,
            epoch,
            held_count: 0,
            gc_queued: false,
            extra: None,
        }
    }

    /// Moves the scope to the catalog's current plan if it changed,
    /// keeping the history of every limit whose dimension and window stay.
    pub(crate) fn sync(&mut self, catalog: &Catalog, key: &ScopeKey) {
        if self.epoch == catalog.epoch() {
            return;
        }
        self.epoch = catalog.epoch();
        let plan = catalog.plan_for(key);
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
        for (j, limit) in plan.limits().iter().enumerate() {
            let Some(i) = self
                .plan
                .limits()
                .iter()
                .position(|o| o.same_history(limit))
            else {
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
        if !wide.is_empty() {
            self.extra.get_or_insert_with(Default::default).wide = wide;
        }
        self.trim_extra();
    }

    /// The state of limit `i`.
    pub(crate) fn state(&mut self, i: usize) -> State<'_> {
        let ScopeState {
            words, plan, extra, ..
        } = self;
        let limit: &Limit = &plan.limits()[i];
        let at = plan.offsets[i] as usize;
        let n = window::words_for(limit.window());
        let wide = extra
            .as_mut()
            .and_then(|e| e.wide.iter_mut().find(|(k, _)| usize::from(*k) == i))
            .map(|(_, w)| &mut w[..]);
        State {
            limit,
            words: &mut words[at..at + n],
            wide,
        }
    }

    /// Advances every window to `now_ms`.
    pub(crate) fn advance(&mut self, now_ms: u64) {
        let from = self.words[0];
        if now_ms <= from {
            return;
        }
        for i in 0..self.plan.limits().len() {
            self.state(i).advance(from, now_ms);
        }
        self.words[0] = now_ms;
    }

    /// Held amount of `dim` on this scope.
    pub(crate) fn held(&self, dim: Dimension) -> u64 {
        if dim.is_implied() {
            return u64::from(self.held_count);
        }
        self.extra.as_ref().map_or(0, |e| e.held.get(dim))
    }

    /// When the earliest hold on this scope expires.
    pub(crate) fn earliest_expiry(&self) -> Option<u64> {
        self.extra
            .as_ref()
            .and_then(|e| e.holders.peek())
            .map(|e| e.due_ms)
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
        }
        self.state(i).record(now_ms, amount);
    }

    /// Drops the extra part once it holds nothing.
    pub(crate) fn trim_extra(&mut self) {
        if let Some(e) = &self.extra {
            if self.held_count == 0 && e.wide.is_empty() && e.held.is_empty() {
                self.extra = None;
            }
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

/// A local scope of a hold: its index, key and position in its holders.
type HolderAt = (usize, ScopeKey, u32);

/// A hold of one reservation on the scopes of one shard.
#[derive(Debug)]
pub(crate) struct Hold {
    pub(crate) owner: ReservationId,
    /// Whether the reservation lives in another shard.
    pub(crate) foreign: bool,
    pub(crate) scopes: ScopeSet,
    /// Which of `scopes` this shard owns (bit i: scope i).
    pub(crate) local: u32,
    pub(crate) amounts: Amounts,
    pub(crate) expires_ms: u64,
    pub(crate) heap_pos: u32,
    /// Position in each local scope's holder heap, by scope index.
    pub(crate) holder_pos: SmallVec<[u32; 4]>,
}

impl Hold {
    pub(crate) fn local_scopes(&self) -> impl Iterator<Item = (usize, &ScopeKey)> + '_ {
        self.scopes
            .as_slice()
            .iter()
            .enumerate()
            .filter(|(i, _)| self.local & (1 << i) != 0)
    }
}

/// A reservation as stored.
#[derive(Debug)]
pub(crate) struct Record {
    pub(crate) res: Reservation,
    /// Amounts as sent (for idempotent replays).
    pub(crate) sent: Amounts,
    /// Its hold in this shard while HELD.
    pub(crate) hold_slot: u32,
    /// Whether some of its scopes live in other shards.
    pub(crate) multi_shard: bool,
    /// When it may be forgotten (once ended).
    pub(crate) drop_at: u64,
}

/// Everything one shard owns.
#[derive(Debug, Default)]
pub(crate) struct ShardState {
    pub(crate) scopes: hashbrown::HashMap<ScopeKey, ScopeState, RandomState>,
    pub(crate) records: HashMap<ReservationId, Record, RandomState>,
    pub(crate) holds: Vec<Option<Hold>>,
    pub(crate) free_slots: Vec<u32>,
    pub(crate) foreign: HashMap<ReservationId, u32, RandomState>,
    pub(crate) expiry: IndexedHeap,
    pub(crate) idempotency: HashMap<Box<str>, ReservationId, RandomState>,
    pub(crate) ended: VecDeque<(u64, ReservationId)>,
    pub(crate) ended_keyed: VecDeque<(u64, ReservationId)>,
    pub(crate) gc: BinaryHeap<Reverse<(u64, ScopeKey)>>,
    /// The latest instant this shard has seen: time never goes backwards here.
    pub(crate) now_ms: u64,
    /// Expired holds processed (a counter for metrics and tests).
    pub(crate) expired_count: u64,
}

/// A shard: its configuration and its state.
#[derive(Debug)]
pub(crate) struct Shard {
    pub(crate) catalog: Arc<Catalog>,
    pub(crate) st: ShardState,
}

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

impl ShardState {
    /// The scope's state, created fresh if absent, on its current plan and
    /// advanced to `now_ms`.
    pub(crate) fn scope_mut(
        &mut self,
        catalog: &Catalog,
        key: &ScopeKey,
        now_ms: u64,
    ) -> &mut ScopeState {
        let ShardState { scopes, gc, .. } = self;
        let st = scopes
            .entry_ref(key)
            .or_insert_with(|| ScopeState::new(catalog.plan_for(key).clone(), catalog.epoch()));
        st.sync(catalog, key);
        st.advance(now_ms);
        if !st.gc_queued && st.held_count == 0 {
            st.gc_queued = true;
            gc.push(Reverse((now_ms, key.clone())));
        }
        st
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
            if let Some(Some(h)) = holds.get_mut(slot as usize) {
                h.holder_pos[usize::from(tag)] = pos;
            }
        }
    }

    /// Adds a hold on this shard's scopes (which exist: the check created
    /// them). Returns its slot.
    pub(crate) fn add_hold(&mut self, mut hold: Hold) -> u32 {
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.holds.push(None);
                (self.holds.len() - 1) as u32
            }
        };
        hold.holder_pos = smallvec::smallvec![NO_SLOT; hold.scopes.len()];
        let expires = hold.expires_ms;
        let (scope_set, local) = (hold.scopes.clone(), hold.local);
        let amounts = hold.amounts.clone();
        self.holds[slot as usize] = Some(hold);
        let ShardState {
            scopes,
            holds,
            expiry,
            ..
        } = self;
        expiry.push(
            Entry {
                due_ms: expires,
                slot,
                tag: 0,
            },
            &mut Self::set_heap_pos(holds),
        );
        for (i, key) in scope_set.as_slice().iter().enumerate() {
            if local & (1 << i) == 0 {
                continue;
            }
            let st = scopes
                .get_mut(key)
                .expect("the check created every scope it held");
            st.held_count += 1;
            let extra = st.extra.get_or_insert_with(Default::default);
            for (d, a) in amounts.iter() {
                let v = extra.held.get(d).saturating_add(a);
                extra.held.set(d, v);
            }
            extra.holders.push(
                Entry {
                    due_ms: expires,
                    slot,
                    tag: i as u8,
                },
                &mut Self::set_holder_pos(holds),
            );
        }
        slot
    }

    /// Releases a hold from every scope of this shard, and returns it.
    pub(crate) fn release_hold(&mut self, slot: u32, now_ms: u64) -> Hold {
        let hold = self.holds[slot as usize].take().expect("a live hold slot");
        let ShardState {
            scopes,
            holds,
            expiry,
            gc,
            free_slots,
            ..
        } = self;
        expiry.remove(hold.heap_pos, &mut Self::set_heap_pos(holds));
        for (i, key) in hold.local_scopes() {
            let Some(st) = scopes.get_mut(key.as_str()) else {
                continue;
            };
            st.held_count -= 1;
            if let Some(extra) = st.extra.as_mut() {
                for (d, a) in hold.amounts.iter() {
                    let v = extra.held.get(d).saturating_sub(a);
                    extra.held.set(d, v);
                }
                extra
                    .holders
                    .remove(hold.holder_pos[i], &mut Self::set_holder_pos(holds));
            }
            if st.held_count == 0 {
                st.trim_extra();
                if !st.gc_queued {
                    st.gc_queued = true;
                    gc.push(Reverse((now_ms, key.clone())));
                }
            }
        }
        free_slots.push(slot);
        hold
    }

    /// Raises a hold by `delta` on every scope of this shard.
    pub(crate) fn raise_hold(&mut self, slot: u32, delta: &Amounts) {
        let ShardState { scopes, holds, .. } = self;
        let Some(Some(hold)) = holds.get_mut(slot as usize) else {
            return;
        };
        for (d, a) in delta.iter() {
            let v = hold.amounts.get(d).saturating_add(a);
            hold.amounts.set(d, v);
        }
        for (_, key) in hold.local_scopes() {
            if let Some(extra) = scopes.get_mut(key.as_str()).and_then(|s| s.extra.as_mut()) {
                for (d, a) in delta.iter() {
                    let v = extra.held.get(d).saturating_add(a);
                    extra.held.set(d, v);
                }
            }
        }
    }

    /// Moves a hold's expiry.
    pub(crate) fn move_hold(&mut self, slot: u32, expires_ms: u64) {
        let (heap_pos, locals): (u32, SmallVec<[HolderAt; 4]>) = {
            let Some(Some(hold)) = self.holds.get_mut(slot as usize) else {
                return;
            };
            hold.expires_ms = expires_ms;
            (
                hold.heap_pos,
                hold.local_scopes()
                    .map(|(i, k)| (i, k.clone(), hold.holder_pos[i]))
                    .collect(),
            )
        };
        let ShardState {
            scopes,
            holds,
            expiry,
            ..
        } = self;
        expiry.update(heap_pos, expires_ms, &mut Self::set_heap_pos(holds));
        for (_, key, pos) in locals {
            if let Some(extra) = scopes.get_mut(&key).and_then(|s| s.extra.as_mut()) {
                extra
                    .holders
                    .update(pos, expires_ms, &mut Self::set_holder_pos(holds));
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
            let hold = self.release_hold(top.slot, now);
            self.expired_count += 1;
            if hold.foreign {
                self.foreign.remove(&hold.owner);
            } else if let Some(rec) = self.records.get_mut(&hold.owner) {
                rec.res.status = Status::Expired;
                rec.res.ended_at = Some(crate::Timestamp::from_millis(hold.expires_ms));
                rec.hold_slot = NO_SLOT;
                self.schedule_drop(catalog, hold.owner, now);
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
        let s = catalog.settings();
        let Some(rec) = self.records.get_mut(&id) else {
            return;
        };
        let keyed = rec.res.idempotency_key.is_some();
        let keep = if keyed {
            s.ended_retention_ms.max(s.idempotency_retention_ms)
        } else {
            s.ended_retention_ms
        };
        rec.drop_at = now.saturating_add(keep);
        if keyed {
            self.ended_keyed.push_back((rec.drop_at, id));
        } else {
            self.ended.push_back((rec.drop_at, id));
        }
    }

    fn forget(&mut self, id: ReservationId, at: u64) {
        let Some(rec) = self.records.get(&id) else {
            return;
        };
        if rec.drop_at != at || rec.res.status == Status::Held {
            return; // a later settle moved its retention
        }
        let rec = self.records.remove(&id).expect("just looked up");
        if let Some(key) = &rec.res.idempotency_key {
            let k = idempotency_key(rec.res.scopes.tenant_name(), key);
            if self.idempotency.get(&k) == Some(&id) {
                self.idempotency.remove(&k);
            }
        }
    }

    /// Drops up to `budget` scopes that hold nothing and whose windows are
    /// empty; re-queues those that will be empty later.
    pub(crate) fn collect(&mut self, now: u64, budget: usize) {
        for _ in 0..budget {
            match self.gc.peek() {
                Some(Reverse((due, _))) if *due <= now => {}
                _ => return,
            }
            let Some(Reverse((_, key))) = self.gc.pop() else {
                return;
            };
            let Some(st) = self.scopes.get_mut(&key) else {
                continue;
            };
            st.gc_queued = false;
            if st.held_count > 0 {
                continue; // the release of its last hold queues it again
            }
            st.advance(now);
            match st.empty_at(now) {
                Some(at) if at <= now => {
                    self.scopes.remove(&key);
                }
                Some(at) => {
                    st.gc_queued = true;
                    self.gc.push(Reverse((at, key)));
                }
                None => {} // a used total budget: kept until an admin credit
            }
        }
    }

    /// Allocation-free view of whether a plan limits a dimension with a window.
    pub(crate) fn limits_with(plan: &Plan, dim: Dimension, kind: fn(&Window) -> bool) -> bool {
        plan.limits()
            .iter()
            .any(|l| l.dimension() == dim && kind(l.window()))
    }
}
