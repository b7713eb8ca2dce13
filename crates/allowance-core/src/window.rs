//! The five window kinds, as state words and the arithmetic on them.
//!
//! A scope keeps the state of all its limits in one boxed slice of `u64`
//! words (one allocation per scope, see [`Plan`](crate::Plan)'s offsets),
//! all advanced to the same instant whenever the scope is touched, so no
//! window needs a timestamp of its own. Holds never enter these words: they
//! are kept per (scope, dimension) and subtracted at check time, so releasing
//! a hold is exact whatever the window did meanwhile.
//!
//! - **sliding** — `3 + ⌈slices/2⌉` words: the total, the end and ring
//!   position of the current slice (so the hot path compares instead of
//!   dividing), then the slices as `u32` halves (a 24-slice window is 96
//!   bytes, not 192). Slice `k` covers
//!   `[k·w, (k+1)·w)` with `w = period / slices`, aligned to the epoch; the
//!   window is the current slice and the `slices − 1` before it. A slice that
//!   would pass `u32::MAX` moves that limit to wide `u64` slices kept aside.
//! - **bucket** — 2 words: the deficit `capacity − level`, scaled by
//!   `period_ms` (a `u128` in fixed point with denominator `period_ms`), so a
//!   refill of `capacity / period_ms` per ms is the exact integer
//!   `capacity` per ms. `used = ⌈deficit⌉`, so `remaining` rounds down, and
//!   `retry_after = ⌈(deficit − target) / rate⌉` is exact.
//! - **calendar** — 2 words: the end of the current window and the usage in
//!   it; boundaries come from [`calendar::window_bounds`] only when a window
//!   rolls over.
//! - **total** — 1 word: usage as an `i64` (an admin credit may take it below 0).
//! - **concurrent** — no words: the gauge is the scope's count of HELD
//!   reservations.

use crate::calendar;
use crate::limit::{Fast, Limit, Window};

/// Where a sliding window's slices start in its words: after the total, the
/// end of the current slice, and the current slice's ring position.
const SLICES_AT: usize = 3;

/// Words of state a window needs.
pub(crate) fn words_for(w: &Window) -> usize {
    // Kept in step with `words_of`, which the hot path reads from the
    // precomputed `Fast` (a unit test checks they agree).
    match w {
        Window::Sliding { slices, .. } => SLICES_AT + (*slices as usize).div_ceil(2),
        Window::Bucket { .. } | Window::Calendar { .. } => 2,
        Window::Total => 1,
        Window::Concurrent => 0,
    }
}

/// [`words_for`] from a limit's precomputed parameters: what the hot loops
/// use to walk a scope's words limit by limit.
#[inline]
pub(crate) fn words_of(fast: Fast) -> usize {
    match fast {
        Fast::Sliding { slices, .. } => SLICES_AT + (slices as usize).div_ceil(2),
        Fast::Bucket { .. } | Fast::Calendar => 2,
        Fast::Total => 1,
        Fast::Concurrent => 0,
    }
}

/// Checks a limit's state words, and its wide slices if it has any, for
/// what the arithmetic relies on to index safely: their number, and a
/// sliding window's ring position within its slices. The values are free:
/// everything computed from them saturates. (Words read from outside, a
/// snapshot, are checked so before the engine uses them.)
pub(crate) fn check_words(
    limit: &Limit,
    words: &[u64],
    wide: Option<&[u64]>,
) -> Result<(), String> {
    let n = words_of(limit.fast);
    if words.len() != n {
        return Err(format!("{} state words, its window has {n}", words.len()));
    }
    match limit.fast {
        Fast::Sliding { slices, .. } => {
            if words[2] >= slices {
                return Err(format!(
                    "ring position {} of a window of {slices} slices",
                    words[2]
                ));
            }
            if let Some(w) = wide
                && w.len() as u64 != slices
            {
                return Err(format!("{} wide slices of {slices}", w.len()));
            }
        }
        _ if wide.is_some() => return Err("wide slices on a window without slices".into()),
        _ => {}
    }
    Ok(())
}

/// Whether `requested` more fits under the limit's capacity with `held`
/// held, given the limit's words (advanced to now): `requested ≤ capacity −
/// used − held`, exactly (for a bucket, against the fixed-point level, which
/// is what rounding `used` up gives too). Reads no slices, so a limit with
/// wide slices answers from its words alone (the total is kept there).
#[inline(always)]
pub(crate) fn fits(fast: Fast, capacity: u64, words: &[u64], requested: u64, held: u64) -> bool {
    let Some(target) = capacity
        .checked_sub(held)
        .and_then(|r| r.checked_sub(requested))
    else {
        return false;
    };
    match fast {
        Fast::Bucket { period_ms } => deficit(words) <= u128::from(target) * u128::from(period_ms),
        Fast::Sliding { .. } => words[0] <= target,
        Fast::Calendar => words[1] <= target,
        Fast::Total => (words[0] as i64) <= target as i64,
        Fast::Concurrent => true,
    }
}

/// Slices of a sliding window: packed `u32` halves, or wide `u64`s once a
/// slice outgrew 32 bits.
pub(crate) enum Slices<'a> {
    Narrow(&'a mut [u64]),
    Wide(&'a mut [u64]),
}

impl Slices<'_> {
    #[inline]
    fn get(&self, i: usize) -> u64 {
        match self {
            Slices::Narrow(w) => (w[i / 2] >> ((i % 2) * 32)) & 0xffff_ffff,
            Slices::Wide(w) => w[i],
        }
    }

    /// Sets slice `i`; `false` (and nothing changed) if a narrow slice cannot hold `v`.
    #[inline]
    fn set(&mut self, i: usize, v: u64) -> bool {
        match self {
            Slices::Narrow(w) => {
                if v > u64::from(u32::MAX) {
                    return false;
                }
                let shift = (i % 2) * 32;
                w[i / 2] = (w[i / 2] & !(0xffff_ffff << shift)) | (v << shift);
                true
            }
            Slices::Wide(w) => {
                w[i] = v;
                true
            }
        }
    }

    fn clear(&mut self) {
        match self {
            Slices::Narrow(w) | Slices::Wide(w) => w.fill(0),
        }
    }
}

/// A sliding window's history carried into a window of the same dimension
/// and period cut into another number of slices (a plan change that only
/// moves `slices` keeps the history, SEMANTICS "Plan"): each old slice's
/// usage counts as if used at the last instant that slice could have held
/// it (its end, or `now_ms`), in the new slice holding that instant (never
/// before the new window's oldest slice): with finer slices none of it
/// leaves before a whole period after it was used; with coarser ones it
/// leaves by the new window's own rounding, as new usage would. `old` is
/// advanced to `now_ms`; returns the new slices by ring position.
pub(crate) fn reslice(old: &mut State<'_>, new: &Limit, now_ms: u64) -> Option<Vec<u64>> {
    let (
        Fast::Sliding {
            width_ms: w0,
            slices: n0,
        },
        Fast::Sliding {
            width_ms: w1,
            slices: n1,
        },
    ) = (old.limit.fast, new.fast)
    else {
        return None;
    };
    let mut out = vec![0u64; n1 as usize];
    let cur = now_ms / w1;
    let oldest_new = cur.saturating_add(1).saturating_sub(n1);
    let sl = old.slices();
    let s1 = now_ms / w0;
    for k in s1.saturating_add(1).saturating_sub(n0)..=s1 {
        let v = sl.get((k % n0) as usize);
        if v == 0 {
            continue;
        }
        let last = k
            .saturating_add(1)
            .saturating_mul(w0)
            .saturating_sub(1)
            .min(now_ms);
        let k1 = (last / w1).max(oldest_new);
        let slot = &mut out[(k1 % n1) as usize];
        *slot = slot.saturating_add(v);
    }
    Some(out)
}

impl State<'_> {
    /// Puts carried-over slices (by ring position, from [`reslice`]) into
    /// this sliding window, set up empty at the same instant; `false`, and
    /// nothing changed, when one needs more than a narrow slice (the caller
    /// gives the limit wide slices and tries again).
    pub(crate) fn take_slices(&mut self, carried: &[u64]) -> bool {
        let mut sl = self.slices();
        if carried.iter().enumerate().any(|(i, &v)| !sl.set(i, v)) {
            sl.clear();
            return false;
        }
        self.words[0] = carried.iter().fold(0u64, |t, &v| t.saturating_add(v));
        true
    }
}

/// `capacity − held − requested`, or `None` when it would be negative (the
/// request cannot fit whatever the window's usage).
#[inline(always)]
pub(crate) fn room(capacity: u64, held: u64, requested: u64) -> Option<u64> {
    capacity.checked_sub(held)?.checked_sub(requested)
}

/// A bucket's deficit (its words from the limit's offset on) after
/// `elapsed_ms` more of refill; stored back when it changed.
#[inline(always)]
pub(crate) fn bucket_refill(words: &mut [u64], capacity: u64, elapsed_ms: u64) -> u128 {
    let d = deficit(words);
    if d == 0 || elapsed_ms == 0 {
        return d;
    }
    // capacity ≤ 2^53: the product cannot overflow 128 bits.
    let d = d.saturating_sub(u128::from(capacity) * u128::from(elapsed_ms));
    set_deficit(words, d);
    d
}

/// Whether a bucket with this deficit has `room` (see [`room`]) left:
/// against the fixed-point level, which is what rounding `used` up gives.
#[inline(always)]
pub(crate) fn bucket_fits(deficit: u128, room: u64, period_ms: u64) -> bool {
    deficit <= u128::from(room) * u128::from(period_ms)
}

/// Records `amount` on a bucket (its words from the limit's offset on).
#[inline(always)]
pub(crate) fn bucket_record(words: &mut [u64], amount: u64, period_ms: u64) {
    let add = u128::from(amount) * u128::from(period_ms);
    set_deficit(words, deficit(words).saturating_add(add));
}

/// The hot path's forms of [`State::advance`] for a limit without wide
/// slices (`limits[i]`, whose `fast` and `capacity` are given), on the
/// scope's words from the limit's offset on: the common case in a compare
/// or two, the rest (a slice or calendar window rolling over) out of line.
#[inline(always)]
pub(crate) fn advance_narrow(
    (fast, capacity): (Fast, u64),
    (limits, i): (&[Limit], usize),
    words: &mut [u64],
    from_ms: u64,
    now_ms: u64,
) {
    match fast {
        Fast::Sliding { .. } => {
            if now_ms >= words[1] {
                advance_cold(&limits[i], words, from_ms, now_ms);
            }
        }
        Fast::Bucket { .. } => {
            let d = deficit(words);
            if d != 0 {
                // capacity ≤ 2^53: the product cannot overflow 128 bits.
                let refill = u128::from(capacity) * u128::from(now_ms.saturating_sub(from_ms));
                set_deficit(words, d.saturating_sub(refill));
            }
        }
        Fast::Calendar => {
            if now_ms >= words[0] {
                advance_cold(&limits[i], words, from_ms, now_ms);
            }
        }
        Fast::Total | Fast::Concurrent => {}
    }
}

#[cold]
#[inline(never)]
fn advance_cold(limit: &Limit, words: &mut [u64], from_ms: u64, now_ms: u64) {
    let n = words_of(limit.fast);
    State {
        limit,
        words: &mut words[..n],
        wide: None,
    }
    .advance(from_ms, now_ms);
}

/// The hot path's form of [`State::record`] for a limit without wide
/// slices, on the scope's words from the limit's offset on (advanced to
/// `now_ms`). `false`, and nothing changed, when a sliding slice would
/// outgrow 32 bits: the caller widens it first (see [`State::needs_wide`]).
#[inline(always)]
pub(crate) fn record_narrow(fast: Fast, words: &mut [u64], now_ms: u64, amount: u64) -> bool {
    match fast {
        Fast::Sliding { width_ms, slices } => {
            let end = words[1];
            let i = if now_ms < end && now_ms >= end.saturating_sub(width_ms) {
                words[2] as usize
            } else {
                ((now_ms / width_ms) % slices) as usize
            };
            let k = SLICES_AT + i / 2;
            let shift = (i % 2) * 32;
            let v = ((words[k] >> shift) & 0xffff_ffff).saturating_add(amount);
            if v > u64::from(u32::MAX) {
                return false;
            }
            words[k] = (words[k] & !(0xffff_ffff << shift)) | (v << shift);
            words[0] = words[0].saturating_add(amount);
        }
        Fast::Bucket { period_ms } => {
            let add = u128::from(amount) * u128::from(period_ms);
            set_deficit(words, deficit(words).saturating_add(add));
        }
        Fast::Calendar => words[1] = words[1].saturating_add(amount),
        Fast::Total => {
            let add = i64::try_from(amount).unwrap_or(i64::MAX);
            words[0] = (words[0] as i64).saturating_add(add) as u64;
        }
        Fast::Concurrent => {}
    }
    true
}

/// When slice `k` leaves a window of `n` slices of `w` ms: `(k + n)·w`,
/// saturating at the end of time (an instant within a period of `u64::MAX`
/// would overflow).
#[inline]
fn slice_end(k: u64, n: u64, w: u64) -> u64 {
    k.saturating_add(n).saturating_mul(w)
}

/// The state of one limit of one scope: its words, and its wide slices if it
/// has any.
pub(crate) struct State<'a> {
    pub(crate) limit: &'a Limit,
    pub(crate) words: &'a mut [u64],
    pub(crate) wide: Option<&'a mut [u64]>,
}

#[inline]
fn deficit(words: &[u64]) -> u128 {
    (u128::from(words[0]) << 64) | u128::from(words[1])
}

#[inline]
fn set_deficit(words: &mut [u64], d: u128) {
    words[0] = (d >> 64) as u64;
    words[1] = d as u64;
}

impl State<'_> {
    /// The ring position of the slice holding `now_ms`: cached by the last
    /// advance when `now_ms` is in that slice (it always is after one).
    #[inline(always)]
    fn ring_index(&self, now_ms: u64, width_ms: u64, slices: u64) -> usize {
        let end = self.words[1];
        if now_ms < end && now_ms >= end.saturating_sub(width_ms) {
            self.words[2] as usize
        } else {
            ((now_ms / width_ms) % slices) as usize
        }
    }

    #[inline]
    fn slices(&mut self) -> Slices<'_> {
        match &mut self.wide {
            Some(w) => Slices::Wide(w),
            None => Slices::Narrow(&mut self.words[SLICES_AT..]),
        }
    }

    /// Brings the window from `from_ms` (when the scope was last touched) to `now_ms`.
    #[inline(always)]
    pub(crate) fn advance(&mut self, from_ms: u64, now_ms: u64) {
        match self.limit.fast {
            Fast::Sliding {
                width_ms: w,
                slices: n,
            } => {
                // Still in the slice of the last advance: a compare, not a
                // division (64-bit divisions cost tens of cycles each).
                if now_ms < self.words[1] {
                    return;
                }
                let (s0, s1) = (from_ms / w, now_ms / w);
                self.words[1] = s1.saturating_add(1).saturating_mul(w);
                self.words[2] = s1 % n;
                if s1 <= s0 {
                    return;
                }
                if s1 - s0 >= n {
                    self.slices().clear();
                    self.words[0] = 0;
                    return;
                }
                let mut total = self.words[0];
                let mut sl = self.slices();
                for k in s0 + 1..=s1 {
                    let i = (k % n) as usize;
                    total = total.saturating_sub(sl.get(i));
                    sl.set(i, 0);
                }
                self.words[0] = total;
            }
            Fast::Bucket { .. } => {
                let d = deficit(self.words);
                if d == 0 {
                    return;
                }
                let elapsed = u128::from(now_ms.saturating_sub(from_ms));
                let refill = u128::from(self.limit.capacity()).saturating_mul(elapsed);
                set_deficit(self.words, d.saturating_sub(refill));
            }
            Fast::Calendar => {
                if now_ms >= self.words[0]
                    && let Window::Calendar { unit, zone } = self.limit.window()
                {
                    let (_, end) = calendar::window_bounds(*unit, zone, now_ms);
                    self.words[0] = end;
                    self.words[1] = 0;
                }
            }
            Fast::Total | Fast::Concurrent => {}
        }
    }

    /// Usage in the window now (after [`State::advance`]).
    #[inline]
    pub(crate) fn used(&self) -> i64 {
        let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        match self.limit.fast {
            Fast::Sliding { .. } => clamp(self.words[0]),
            Fast::Bucket { period_ms } => {
                let d = deficit(self.words);
                if d == 0 {
                    return 0;
                }
                i64::try_from(d.div_ceil(u128::from(period_ms))).unwrap_or(i64::MAX)
            }
            Fast::Calendar => clamp(self.words[1]),
            Fast::Total => self.words[0] as i64,
            Fast::Concurrent => 0,
        }
    }

    /// Whether `requested` more fits (see [`fits`]).
    #[inline]
    pub(crate) fn fits(&self, requested: u64, held: u64) -> bool {
        fits(
            self.limit.fast,
            self.limit.capacity(),
            self.words,
            requested,
            held,
        )
    }

    /// Whether recording `amount` now needs wide slices first.
    #[inline(always)]
    pub(crate) fn needs_wide(&self, now_ms: u64, amount: u64) -> bool {
        match (self.limit.fast, &self.wide) {
            (Fast::Sliding { width_ms, slices }, None) => {
                let i = self.ring_index(now_ms, width_ms, slices);
                let cur = (self.words[SLICES_AT + i / 2] >> ((i % 2) * 32)) & 0xffff_ffff;
                cur.saturating_add(amount) > u64::from(u32::MAX)
            }
            _ => false,
        }
    }

    /// The slices as wide `u64`s (to move this limit to wide storage).
    pub(crate) fn widen(&self) -> Box<[u64]> {
        match self.limit.fast {
            Fast::Sliding { slices, .. } => (0..slices as usize)
                .map(|i| (self.words[SLICES_AT + i / 2] >> ((i % 2) * 32)) & 0xffff_ffff)
                .collect(),
            _ => Box::new([]),
        }
    }

    /// Records `amount` of usage at `now_ms` (after [`State::advance`]).
    /// Saturates instead of wrapping: accounting that far past any capacity
    /// keeps refusing either way. The caller widens sliding slices first
    /// when [`State::needs_wide`] says so.
    #[inline(always)]
    pub(crate) fn record(&mut self, now_ms: u64, amount: u64) {
        match self.limit.fast {
            Fast::Sliding { width_ms, slices } => {
                let i = self.ring_index(now_ms, width_ms, slices);
                self.words[0] = self.words[0].saturating_add(amount);
                let mut sl = self.slices();
                let v = sl.get(i).saturating_add(amount);
                let stored = sl.set(i, v);
                debug_assert!(stored, "the caller widens before recording");
            }
            Fast::Bucket { period_ms } => {
                let add = u128::from(amount) * u128::from(period_ms);
                let d = deficit(self.words).saturating_add(add);
                set_deficit(self.words, d);
            }
            Fast::Calendar => self.words[1] = self.words[1].saturating_add(amount),
            Fast::Total => {
                let add = i64::try_from(amount).unwrap_or(i64::MAX);
                self.words[0] = (self.words[0] as i64).saturating_add(add) as u64;
            }
            Fast::Concurrent => {}
        }
    }

    /// An admin credit (positive: usage falls) or debit on a `total` window.
    pub(crate) fn adjust(&mut self, credit: i64) {
        if let Fast::Total = self.limit.fast {
            self.words[0] = (self.words[0] as i64).saturating_sub(credit) as u64;
        }
    }

    /// Time from `now_ms` until usage alone falls to `target` or below,
    /// holds assumed to stay; `None` when it never will by itself (`total`,
    /// `concurrent`). Call only when `used() > target`.
    pub(crate) fn ms_until_used_at_most(&mut self, now_ms: u64, target: u64) -> Option<u64> {
        match self.limit.fast {
            Fast::Sliding {
                width_ms: w,
                slices: n,
            } => {
                let cur = now_ms / w;
                let oldest = cur.saturating_add(1).saturating_sub(n);
                let total = self.words[0];
                let sl = self.slices();
                let mut left = total;
                for k in oldest..=cur {
                    left = left.saturating_sub(sl.get((k % n) as usize));
                    if left <= target {
                        return Some(slice_end(k, n, w).saturating_sub(now_ms));
                    }
                }
                Some(slice_end(cur, n, w).saturating_sub(now_ms))
            }
            Fast::Bucket { period_ms } => {
                let target_scaled = u128::from(target) * u128::from(period_ms);
                let need = deficit(self.words).saturating_sub(target_scaled);
                let ms = need.div_ceil(u128::from(self.limit.capacity()));
                Some(u64::try_from(ms).unwrap_or(u64::MAX))
            }
            Fast::Calendar => Some(self.words[0].saturating_sub(now_ms)),
            Fast::Total | Fast::Concurrent => None,
        }
    }

    /// When room next appears without new traffic (the status's
    /// `resets_at`): sliding, when the oldest non-empty slice leaves; bucket,
    /// when full again; calendar, the next boundary; otherwise `None`
    /// (concurrent is answered by the scope, from its holds).
    pub(crate) fn resets_at(&mut self, now_ms: u64) -> Option<u64> {
        match self.limit.fast {
            Fast::Sliding {
                width_ms: w,
                slices: n,
            } => {
                if self.words[0] == 0 {
                    return None;
                }
                let cur = now_ms / w;
                let sl = self.slices();
                (cur.saturating_add(1).saturating_sub(n)..=cur)
                    .find(|k| sl.get((k % n) as usize) > 0)
                    .map(|k| slice_end(k, n, w))
            }
            Fast::Bucket { .. } => {
                let d = deficit(self.words);
                (d > 0).then(|| {
                    let ms = d.div_ceil(u128::from(self.limit.capacity()));
                    now_ms.saturating_add(u64::try_from(ms).unwrap_or(u64::MAX))
                })
            }
            Fast::Calendar => Some(self.words[0]),
            Fast::Total | Fast::Concurrent => None,
        }
    }

    /// When this window will hold no usage if nothing new happens: `Some(now)`
    /// if it is empty already, `None` if never (a used `total`).
    pub(crate) fn empty_at(&mut self, now_ms: u64) -> Option<u64> {
        match self.limit.fast {
            Fast::Sliding {
                width_ms: w,
                slices: n,
            } => {
                if self.words[0] == 0 {
                    return Some(now_ms);
                }
                let cur = now_ms / w;
                let sl = self.slices();
                let newest = (cur.saturating_add(1).saturating_sub(n)..=cur)
                    .rev()
                    .find(|k| sl.get((k % n) as usize) > 0)
                    .unwrap_or(cur);
                Some(slice_end(newest, n, w))
            }
            Fast::Bucket { .. } => Some(self.resets_at(now_ms).unwrap_or(now_ms)),
            Fast::Calendar => Some(if self.words[1] == 0 {
                now_ms
            } else {
                self.words[0]
            }),
            Fast::Total => (self.words[0] == 0).then_some(now_ms),
            Fast::Concurrent => Some(now_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calendar::{CalendarUnit, Zone};
    use crate::units::Dimension;

    fn state_for(limit: &Limit) -> Vec<u64> {
        vec![0; words_for(limit.window())]
    }

    /// A sliding window of 4 slices of 1 s: usage leaves slice by slice,
    /// and retry_after names the instant the needed slice leaves.
    #[test]
    fn sliding_slices_leave_in_order() {
        let l = Limit::new(
            Dimension::TOKENS,
            100,
            Window::Sliding {
                period_ms: 4000,
                slices: 4,
            },
        )
        .unwrap();
        let mut words = state_for(&l);
        let mut s = State {
            limit: &l,
            words: &mut words,
            wide: None,
        };
        s.advance(0, 10_500);
        s.record(10_500, 30); // slice 10
        s.advance(10_500, 11_200);
        s.record(11_200, 50); // slice 11
        assert_eq!(s.used(), 80);
        // To get used <= 40, slice 10 (30) is not enough alone... 80-30=50 > 40; slice 11 must leave too.
        assert_eq!(s.ms_until_used_at_most(11_200, 40), Some(15_000 - 11_200));
        assert_eq!(s.ms_until_used_at_most(11_200, 50), Some(14_000 - 11_200));
        assert_eq!(s.resets_at(11_200), Some(14_000));
        s.advance(11_200, 13_999);
        assert_eq!(s.used(), 80);
        s.advance(13_999, 14_000);
        assert_eq!(s.used(), 50);
        s.advance(14_000, 15_000);
        assert_eq!(s.used(), 0);
        assert_eq!(s.resets_at(15_000), None);
    }

    /// A bucket refills continuously and exactly; retry_after = deficit / rate.
    #[test]
    fn bucket_refills_exactly() {
        let l = Limit::new(
            Dimension::REQUESTS,
            60,
            Window::Bucket { period_ms: 60_000 },
        )
        .unwrap();
        let mut words = state_for(&l);
        let mut s = State {
            limit: &l,
            words: &mut words,
            wide: None,
        };
        s.advance(0, 1_000_000);
        assert_eq!(s.used(), 0);
        s.record(1_000_000, 60);
        assert_eq!(s.used(), 60);
        // One request per second comes back.
        s.advance(1_000_000, 1_000_999);
        assert_eq!(
            s.used(),
            60,
            "remaining rounds down: 0.999 of a request is not one"
        );
        s.advance(1_000_999, 1_001_000);
        assert_eq!(s.used(), 59);
        // used must fall to 55: 4 more seconds.
        assert_eq!(s.ms_until_used_at_most(1_001_000, 55), Some(4_000));
        assert_eq!(s.resets_at(1_001_000), Some(1_060_000));
    }

    #[test]
    fn narrow_slices_widen_instead_of_overflowing() {
        let l = Limit::new(
            Dimension::COST_MICROS,
            1 << 53,
            Window::Sliding {
                period_ms: 24,
                slices: 24,
            },
        )
        .unwrap();
        let mut words = state_for(&l);
        let s = State {
            limit: &l,
            words: &mut words,
            wide: None,
        };
        assert!(!s.needs_wide(5, u64::from(u32::MAX)));
        assert!(s.needs_wide(5, u64::from(u32::MAX) + 1));
        let mut wide = s.widen();
        let mut s = State {
            limit: &l,
            words: &mut words,
            wide: Some(&mut wide),
        };
        s.record(5, 1 << 40);
        s.record(5, 1 << 40);
        assert_eq!(s.used(), 1 << 41);
        assert_eq!(s.ms_until_used_at_most(6, 0), Some(24 + 5 - 6));
    }

    #[test]
    fn calendar_rolls_at_the_boundary() {
        let l = Limit::new(
            Dimension::COST_MICROS,
            10,
            Window::Calendar {
                unit: CalendarUnit::Minute,
                zone: Zone::utc(),
            },
        )
        .unwrap();
        let mut words = state_for(&l);
        let mut s = State {
            limit: &l,
            words: &mut words,
            wide: None,
        };
        s.advance(0, 90_000);
        s.record(90_000, 7);
        assert_eq!(s.resets_at(90_000), Some(120_000));
        assert_eq!(s.ms_until_used_at_most(90_000, 0), Some(30_000));
        s.advance(90_000, 119_999);
        assert_eq!(s.used(), 7);
        s.advance(119_999, 120_000);
        assert_eq!(s.used(), 0);
    }

    #[test]
    fn total_never_refills_but_takes_credits() {
        let l = Limit::new(Dimension::COST_MICROS, 10, Window::Total).unwrap();
        let mut words = state_for(&l);
        let mut s = State {
            limit: &l,
            words: &mut words,
            wide: None,
        };
        s.record(1, 8);
        s.advance(1, u64::MAX / 2);
        assert_eq!(s.used(), 8);
        assert_eq!(s.ms_until_used_at_most(5, 0), None);
        s.adjust(10);
        assert_eq!(s.used(), -2);
        s.adjust(-3);
        assert_eq!(s.used(), 1);
    }
}
