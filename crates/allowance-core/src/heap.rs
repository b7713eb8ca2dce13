//! An indexed binary min-heap of expiry instants.
//!
//! Holds expire in O(log n) each and are removed (settled, refunded) or
//! re-keyed (extended) in O(log n) as well: every entry knows where it sits,
//! because the owner of each entry is told its position whenever it moves.
//! A lazily deleted heap would be simpler, but at millions of settles per
//! second its dead entries would outnumber the live ones by far.

/// One entry: when it is due, which hold it belongs to, and which of that
/// hold's position slots records where the entry sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) due_ms: u64,
    pub(crate) slot: u32,
    pub(crate) tag: u8,
}

impl Entry {
    fn key(&self) -> (u64, u32, u8) {
        (self.due_ms, self.slot, self.tag)
    }
}

/// The heap. `set_pos(slot, tag, pos)` is called for every entry that moves,
/// so its owner can find it again.
#[derive(Clone, Debug, Default)]
pub(crate) struct IndexedHeap {
    entries: Vec<Entry>,
}

impl IndexedHeap {
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn peek(&self) -> Option<Entry> {
        self.entries.first().copied()
    }

    pub(crate) fn entries(&self) -> &[Entry] {
        &self.entries
    }

    pub(crate) fn push(&mut self, e: Entry, set_pos: &mut impl FnMut(u32, u8, u32)) {
        self.entries.push(e);
        let i = self.entries.len() - 1;
        set_pos(e.slot, e.tag, i as u32);
        self.sift_up(i, set_pos);
    }

    /// Removes the entry at `pos` and returns it.
    pub(crate) fn remove(&mut self, pos: u32, set_pos: &mut impl FnMut(u32, u8, u32)) -> Entry {
        let pos = pos as usize;
        let last = self.entries.len() - 1;
        self.entries.swap(pos, last);
        let removed = self
            .entries
            .pop()
            .expect("heap is not empty: pos was valid");
        if pos < self.entries.len() {
            let moved = self.entries[pos];
            set_pos(moved.slot, moved.tag, pos as u32);
            self.sift_down(pos, set_pos);
            self.sift_up(pos, set_pos);
        }
        if self.entries.capacity() > 64 && self.entries.len() * 4 < self.entries.capacity() {
            // Memory follows the live holds down after a burst.
            self.entries.shrink_to(self.entries.len() * 2);
        }
        removed
    }

    /// Changes the due instant of the entry at `pos`.
    pub(crate) fn update(&mut self, pos: u32, due_ms: u64, set_pos: &mut impl FnMut(u32, u8, u32)) {
        let pos = pos as usize;
        self.entries[pos].due_ms = due_ms;
        self.sift_down(pos, set_pos);
        self.sift_up(pos, set_pos);
    }

    fn sift_up(&mut self, mut i: usize, set_pos: &mut impl FnMut(u32, u8, u32)) {
        while i > 0 {
            let parent = (i - 1) / 2;
            if self.entries[i].key() >= self.entries[parent].key() {
                break;
            }
            self.entries.swap(i, parent);
            let (a, b) = (self.entries[i], self.entries[parent]);
            set_pos(a.slot, a.tag, i as u32);
            set_pos(b.slot, b.tag, parent as u32);
            i = parent;
        }
    }

    fn sift_down(&mut self, mut i: usize, set_pos: &mut impl FnMut(u32, u8, u32)) {
        let n = self.entries.len();
        loop {
            let (l, r) = (2 * i + 1, 2 * i + 2);
            let mut min = i;
            if l < n && self.entries[l].key() < self.entries[min].key() {
                min = l;
            }
            if r < n && self.entries[r].key() < self.entries[min].key() {
                min = r;
            }
            if min == i {
                break;
            }
            self.entries.swap(i, min);
            let (a, b) = (self.entries[i], self.entries[min]);
            set_pos(a.slot, a.tag, i as u32);
            set_pos(b.slot, b.tag, min as u32);
            i = min;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        /// Random pushes, removals and updates keep the heap ordered and every
        /// recorded position exact.
        #[test]
        fn positions_stay_exact(ops in proptest::collection::vec((0u8..3, 0u64..50, 0u32..20), 0..200)) {
            let mut heap = IndexedHeap::default();
            let mut pos: HashMap<u32, u32> = HashMap::new();
            for (op, due, slot) in ops {
                let at = pos.get(&slot).copied();
                let mut moved: Vec<(u32, u32)> = Vec::new();
                let mut set = |s: u32, _t: u8, p: u32| moved.push((s, p));
                match (op, at) {
                    (0, None) => heap.push(Entry { due_ms: due, slot, tag: 0 }, &mut set),
                    (1, Some(p)) => {
                        let e = heap.remove(p, &mut set);
                        prop_assert_eq!(e.slot, slot);
                    }
                    (2, Some(p)) => heap.update(p, due, &mut set),
                    _ => {}
                }
                if op == 1 && at.is_some() {
                    pos.remove(&slot);
                }
                for (s, p) in moved {
                    if s != slot || op != 1 { pos.insert(s, p); }
                }
                for (s, p) in &pos { prop_assert_eq!(heap.entries()[*p as usize].slot, *s); }
                prop_assert_eq!(heap.len(), pos.len());
                if let Some(top) = heap.peek() {
                    prop_assert!(heap.entries().iter().all(|e| e.due_ms >= top.due_ms));
                }
            }
        }
    }
}
