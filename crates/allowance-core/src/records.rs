//! The reservations a shard remembers: held ones, and ended ones until their
//! retention passes.
//!
//! Records sit in a slab (a vector with a free list) and a hash table maps
//! an id to its slab index. A table entry is the index and 32 bits of the
//! id's hash (8 bytes), so the table of a few hundred thousand records
//! stays in the CPU's caches, a lookup reads a record only when those 32
//! bits match, and the table grows or cleans up its tombstones without
//! reading any record (a rehash that read every cold record would cost a
//! cache miss per record). A record freed when a retention passes is the
//! very slot the next reserve reuses (the free list is LIFO), so the new
//! record is written to warm memory, and no reserve allocates once the slab
//! has grown to the steady state.
//!
//! The slab grows by segments that double in length, so growing never moves
//! a record: a vector's doubling would copy every remembered record (a day
//! of them, hundreds of megabytes) under the shard's lock in one operation.
//! The slab is compacted when fewer than a quarter of its slots are live, so
//! its memory follows the number of remembered records down after a burst.
//! Indices are therefore valid within one operation only: nothing keeps
//! one across operations (the queues of ended reservations keep ids).

use std::hash::BuildHasher;

use foldhash::fast::RandomState;
use hashbrown::HashTable;

use crate::reservation::ReservationId;
use crate::shard::Record;

/// Slabs at most this long are never compacted (not worth the pass).
const COMPACT_MIN_SLOTS: usize = 1024;

/// A table entry: the record's slab index and 32 bits of its id's hash.
type Entry = (u32, u32);

/// log2 of the first segment's length.
const FIRST_SEGMENT_LOG2: u32 = 6;

/// Slots by index, in segments of 64, 128, 256, … slots: slot `i` is in
/// segment `log2(i / 64 + 1)`. A segment is allocated at its full length
/// but filled as slots are pushed, so nothing is written ahead of use.
#[derive(Clone, Debug)]
struct Segments<T> {
    segments: Vec<Vec<Option<T>>>,
    len: usize,
}

impl<T> Default for Segments<T> {
    fn default() -> Self {
        Segments {
            segments: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Segments<T> {
    /// Slot `i`'s segment and its place in it.
    #[inline]
    fn locate(i: usize) -> (usize, usize) {
        let j = i + (1 << FIRST_SEGMENT_LOG2);
        let segment = (usize::BITS - 1 - j.leading_zeros()) - FIRST_SEGMENT_LOG2;
        (segment as usize, j - (1 << (segment + FIRST_SEGMENT_LOG2)))
    }

    #[inline]
    fn get(&self, i: usize) -> &Option<T> {
        let (s, k) = Self::locate(i);
        &self.segments[s][k]
    }

    #[inline]
    fn get_mut(&mut self, i: usize) -> &mut Option<T> {
        let (s, k) = Self::locate(i);
        &mut self.segments[s][k]
    }

    /// Adds a slot at the end; returns its index.
    #[inline]
    fn push(&mut self, value: Option<T>) -> usize {
        let (s, _) = Self::locate(self.len);
        if s == self.segments.len() {
            self.segments
                .push(Vec::with_capacity(1 << (s as u32 + FIRST_SEGMENT_LOG2)));
        }
        self.segments[s].push(value);
        self.len += 1;
        self.len - 1
    }

    /// Number of slots, free ones included.
    fn len(&self) -> usize {
        self.len
    }

    fn iter(&self) -> impl Iterator<Item = &Option<T>> + '_ {
        self.segments.iter().flatten()
    }

    /// Drops the free slots: the live ones, in order, make a new slab.
    fn retain_live(&mut self) {
        let mut live = Segments::default();
        for value in std::mem::take(&mut self.segments).into_iter().flatten() {
            if value.is_some() {
                live.push(value);
            }
        }
        *self = live;
    }
}

/// The table's 64-bit hash of an entry, from the 32 bits it keeps: spread
/// by an odd multiplier, so the low bits (the bucket) and the top seven
/// (hashbrown's tag) both vary.
#[inline]
fn table_hash(h32: u32) -> u64 {
    u64::from(h32).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The records of one shard, by id.
#[derive(Clone, Debug, Default)]
pub(crate) struct Records {
    hasher: RandomState,
    table: HashTable<Entry>,
    slab: Segments<Record>,
    free: Vec<u32>,
}

impl Records {
    /// 32 bits of the id's (randomly seeded) hash.
    #[inline]
    fn h32(&self, id: ReservationId) -> u32 {
        let h = self.hasher.hash_one(id.0);
        (h ^ (h >> 32)) as u32
    }

    /// The slab index of `id`'s record.
    #[inline]
    pub(crate) fn find(&self, id: ReservationId) -> Option<u32> {
        let h32 = self.h32(id);
        let slab = &self.slab;
        self.table
            .find(table_hash(h32), |&(i, h)| {
                h == h32 && matches!(slab.get(i as usize), Some(r) if r.res.id == id)
            })
            .map(|&(i, _)| i)
    }

    /// `id`'s record.
    #[inline]
    pub(crate) fn get(&self, id: ReservationId) -> Option<&Record> {
        self.find(id).map(|i| self.at(i))
    }

    /// `id`'s record, to change it.
    #[inline]
    pub(crate) fn get_mut(&mut self, id: ReservationId) -> Option<&mut Record> {
        self.find(id).map(|i| self.at_mut(i))
    }

    /// Whether `id` is remembered.
    #[inline]
    pub(crate) fn contains(&self, id: ReservationId) -> bool {
        self.find(id).is_some()
    }

    /// The record at a slab index found in this operation.
    #[inline]
    pub(crate) fn at(&self, i: u32) -> &Record {
        self.slab
            .get(i as usize)
            .as_ref()
            .expect("a slab index found in this operation")
    }

    /// [`Records::at`], to change it.
    #[inline]
    pub(crate) fn at_mut(&mut self, i: u32) -> &mut Record {
        self.slab
            .get_mut(i as usize)
            .as_mut()
            .expect("a slab index found in this operation")
    }

    /// Adds the record `make` builds, whose id is not remembered yet (the
    /// caller checked); returns its slab index.
    #[inline]
    pub(crate) fn insert(&mut self, id: ReservationId, make: impl FnOnce() -> Record) -> u32 {
        let h32 = self.h32(id);
        let i = match self.free.pop() {
            Some(i) => {
                *self.slab.get_mut(i as usize) = Some(make());
                i
            }
            None => self.slab.push(Some(make())) as u32,
        };
        debug_assert_eq!(
            self.slab.get(i as usize).as_ref().map(|r| r.res.id),
            Some(id)
        );
        self.table
            .insert_unique(table_hash(h32), (i, h32), |&(_, h)| table_hash(h));
        i
    }

    /// Removes `id`'s record unless `keep` says to keep it; `on_remove`
    /// sees it just before it is dropped (in place: a record is never
    /// moved out of the slab).
    pub(crate) fn remove_unless(
        &mut self,
        id: ReservationId,
        keep: impl FnOnce(&Record) -> bool,
        on_remove: impl FnOnce(&Record),
    ) {
        let h32 = self.h32(id);
        let Records {
            table, slab, free, ..
        } = self;
        let Ok(entry) = table.find_entry(table_hash(h32), |&(i, h)| {
            h == h32 && matches!(slab.get(i as usize), Some(r) if r.res.id == id)
        }) else {
            return;
        };
        let i = entry.get().0;
        let Some(rec) = slab.get(i as usize).as_ref() else {
            return;
        };
        if keep(rec) {
            return;
        }
        on_remove(rec);
        entry.remove();
        *slab.get_mut(i as usize) = None;
        free.push(i);
        self.compact_if_sparse();
    }

    /// Number of records.
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// Every record, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Record> + '_ {
        self.slab.iter().flatten()
    }

    /// Moves the live records to the front and frees the rest of the slab
    /// once fewer than a quarter of its slots are live: amortized O(1) per
    /// removal (at least three quarters of the slots were freed since the
    /// slab last had this length).
    fn compact_if_sparse(&mut self) {
        let live = self.table.len();
        if self.slab.len() <= COMPACT_MIN_SLOTS || live * 4 >= self.slab.len() {
            return;
        }
        self.slab.retain_live();
        self.free.clear();
        self.free.shrink_to(live);
        self.table.clear();
        self.table.shrink_to(live, |&(_, h)| table_hash(h));
        for i in 0..self.slab.len() {
            let id = self
                .slab
                .get(i)
                .as_ref()
                .map_or(ReservationId(0), |r| r.res.id);
            let h32 = self.h32(id);
            self.table
                .insert_unique(table_hash(h32), (i as u32, h32), |&(_, h)| table_hash(h));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::OverrunPolicy;
    use crate::reservation::{Reservation, Status};
    use crate::scope::{ScopeKey, ScopeSet};
    use crate::shard::NO_SLOT;
    use crate::units::{Amounts, Timestamp};

    fn record(scopes: &ScopeSet, id: u128) -> Record {
        Record {
            res: Reservation {
                id: ReservationId(id),
                status: Status::Held,
                scopes: scopes.clone(),
                model: None,
                labels: None,
                held: Amounts::new(),
                created_at: Timestamp::from_millis(0),
                expires_at: Timestamp::from_millis(1),
                ended_at: None,
                charged: None,
                late: false,
                overrun: OverrunPolicy::ChargeActual,
                idempotency_key: None,
            },
            sent: None,
            hold_slot: NO_SLOT,
            multi_shard: false,
            drop_at: 0,
        }
    }

    /// Slot indices walk the segments in order: each segment filled from
    /// its start to its length (64, 128, …) before the next begins.
    #[test]
    fn slots_fill_segments_in_order() {
        let mut expected = (0, 0);
        for i in 0..100_000 {
            assert_eq!(Segments::<()>::locate(i), expected, "slot {i}");
            expected.1 += 1;
            if expected.1 == 1 << (expected.0 as u32 + FIRST_SEGMENT_LOG2) {
                expected = (expected.0 + 1, 0);
            }
        }
        let mut seg = Segments::default();
        for i in 0..1000 {
            assert_eq!(seg.push(Some(i)), i);
        }
        assert!((0..1000).all(|i| *seg.get(i) == Some(i)));
        assert_eq!(
            seg.segments.iter().map(Vec::capacity).collect::<Vec<_>>(),
            [64, 128, 256, 512, 1024]
        );
    }

    /// Ids are found after inserts, removals that reuse slots, and the
    /// compactions a large removal triggers; `keep` vetoes a removal.
    #[test]
    fn ids_survive_slot_reuse_and_compaction() {
        let scopes = ScopeSet::from_vec(vec![ScopeKey::tenant("acme").unwrap()]);
        let mut r = Records::default();
        let n: u128 = 5000;
        for id in 0..n {
            assert!(!r.contains(ReservationId(id)));
            r.insert(ReservationId(id), || record(&scopes, id));
        }
        let mut removed = 0;
        r.remove_unless(ReservationId(7), |_| true, |_| removed += 1);
        assert!(r.contains(ReservationId(7)) && removed == 0);
        // Remove all but every tenth: the slab compacts on the way down.
        for id in (0..n).filter(|id| id % 10 != 0) {
            r.remove_unless(
                ReservationId(id),
                |_| false,
                |rec| {
                    assert_eq!(rec.res.id, ReservationId(id));
                    removed += 1;
                },
            );
        }
        assert_eq!(removed, 4500);
        assert_eq!(r.len(), 500);
        assert!(r.slab.len() <= 1250, "compacted: {} slots", r.slab.len());
        for id in 0..n {
            let found = r.get(ReservationId(id)).map(|rec| rec.res.id);
            assert_eq!(found.is_some(), id % 10 == 0, "{id}");
            assert!(found.is_none_or(|f| f == ReservationId(id)));
        }
        // Freed slots are reused, and every id still answers.
        for id in n..n + 600 {
            let i = r.insert(ReservationId(id), || record(&scopes, id));
            assert_eq!(r.at(i).res.id, ReservationId(id));
        }
        assert_eq!(r.iter().count(), 1100);
        assert!((n..n + 600).all(|id| r.contains(ReservationId(id))));
        assert!((0..n).step_by(10).all(|id| r.contains(ReservationId(id))));
    }
}
