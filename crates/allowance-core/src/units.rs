//! Time, amounts and dimensions: the units every other module counts in.

use std::fmt;

use serde::de::{self, SeqAccess, Visitor};
use serde::ser::SerializeSeq;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thin_vec::ThinVec;

use crate::catalog::MAX_CUSTOM_DIMENSIONS;

/// The largest amount accepted anywhere (2^53): every amount survives a trip
/// through a JSON number (an IEEE double) exactly.
pub const MAX_AMOUNT: u64 = 1 << 53;

/// An instant, in integer milliseconds since the Unix epoch.
///
/// The engine never reads a clock: every transition takes a `Timestamp`
/// produced at the boundary, so replaying a log reproduces the same state.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The instant `ms` milliseconds after the epoch.
    pub const fn from_millis(ms: u64) -> Self {
        Timestamp(ms)
    }

    /// Milliseconds since the epoch.
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// `self + ms`, saturating at the end of time instead of wrapping.
    pub const fn saturating_add_ms(self, ms: u64) -> Self {
        Timestamp(self.0.saturating_add(ms))
    }

    /// Milliseconds from `self` until `later`, or 0 if `later` is not later.
    pub const fn ms_until(self, later: Timestamp) -> u64 {
        later.0.saturating_sub(self.0)
    }
}

/// What is counted. Built-in dimensions have fixed indices; custom ones
/// (tool calls, pages) are registered in the [`Catalog`](crate::Catalog) and
/// numbered after them.
///
/// Encoded as its index; decoding refuses an index no catalog can have
/// (past the built-ins and [`MAX_CUSTOM_DIMENSIONS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "u16")]
pub struct Dimension(pub(crate) u16);

impl TryFrom<u16> for Dimension {
    type Error = String;

    fn try_from(index: u16) -> Result<Self, Self::Error> {
        if usize::from(index) >= Dimension::LIMIT {
            return Err(format!(
                "dimension #{index}: at most {} dimensions exist",
                Dimension::LIMIT
            ));
        }
        Ok(Dimension(index))
    }
}

impl Dimension {
    /// One per reservation, implied: held while HELD, used once settled.
    pub const REQUESTS: Dimension = Dimension(0);
    /// One per HELD reservation, implied: a gauge, never "used".
    pub const CONCURRENT: Dimension = Dimension(1);
    /// Prompt tokens.
    pub const INPUT_TOKENS: Dimension = Dimension(2);
    /// Completion tokens.
    pub const OUTPUT_TOKENS: Dimension = Dimension(3);
    /// Input + output, unless given explicitly.
    pub const TOKENS: Dimension = Dimension(4);
    /// Millionths of the deployment's one currency.
    pub const COST_MICROS: Dimension = Dimension(5);

    /// Number of built-in dimensions; custom dimensions start here.
    pub const BUILTIN_COUNT: u16 = 6;

    /// One past the largest index a dimension can have.
    const LIMIT: usize = Dimension::BUILTIN_COUNT as usize + MAX_CUSTOM_DIMENSIONS;

    /// The built-in dimensions, in index order.
    pub const BUILTIN: [Dimension; 6] = [
        Dimension::REQUESTS,
        Dimension::CONCURRENT,
        Dimension::INPUT_TOKENS,
        Dimension::OUTPUT_TOKENS,
        Dimension::TOKENS,
        Dimension::COST_MICROS,
    ];

    /// The dimension's index (built-ins first).
    pub const fn index(self) -> usize {
        self.0 as usize
    }

    /// The name of a built-in dimension, `None` for a custom one (its name
    /// lives in the catalog).
    pub const fn builtin_name(self) -> Option<&'static str> {
        Some(match self.0 {
            0 => "requests",
            1 => "concurrent",
            2 => "input_tokens",
            3 => "output_tokens",
            4 => "tokens",
            5 => "cost_micros",
            _ => return None,
        })
    }

    /// The built-in dimension with this name.
    pub fn builtin(name: &str) -> Option<Dimension> {
        Dimension::BUILTIN
            .into_iter()
            .find(|d| d.builtin_name() == Some(name))
    }

    /// `requests` and `concurrent` are implied by every reservation; they
    /// are never named in amounts.
    pub const fn is_implied(self) -> bool {
        self.0 <= 1
    }
}

/// Amounts per dimension, zeros dropped.
///
/// Never contains the implied dimensions (`requests`, `concurrent`). The
/// four counted built-in dimensions sit in a fixed array (every operation
/// reads them, in O(1)); custom dimensions are a short sorted list, a
/// `ThinVec` (one pointer, where a `Vec` is three): a remembered
/// reservation keeps two amounts and a hold one, and most have no custom
/// dimension at all (cloning an empty `ThinVec` allocates nothing and
/// calls nothing).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Amounts {
    builtin: [u64; 4],
    custom: ThinVec<(Dimension, u64)>,
}

impl Amounts {
    /// No amounts.
    pub fn new() -> Self {
        Amounts::default()
    }

    #[inline]
    fn builtin_slot(dim: Dimension) -> Option<usize> {
        match dim.0 {
            2..=5 => Some(usize::from(dim.0) - 2),
            _ => None,
        }
    }

    /// The amount of `dim` (0 when absent).
    #[inline]
    pub fn get(&self, dim: Dimension) -> u64 {
        match Self::builtin_slot(dim) {
            Some(i) => self.builtin[i],
            None if dim.is_implied() => 0,
            None => match self.custom.binary_search_by_key(&dim, |&(d, _)| d) {
                Ok(i) => self.custom[i].1,
                Err(_) => 0,
            },
        }
    }

    /// Whether `dim` has a non-zero amount.
    #[inline]
    pub fn contains(&self, dim: Dimension) -> bool {
        self.get(dim) != 0
    }

    /// Sets `dim` to `amount`; 0 removes it. Implied dimensions are ignored.
    #[inline]
    pub fn set(&mut self, dim: Dimension, amount: u64) {
        if let Some(i) = Self::builtin_slot(dim) {
            self.builtin[i] = amount;
            return;
        }
        if dim.is_implied() {
            return;
        }
        match self.custom.binary_search_by_key(&dim, |&(d, _)| d) {
            Ok(i) if amount == 0 => {
                self.custom.remove(i);
            }
            Ok(i) => self.custom[i].1 = amount,
            Err(_) if amount == 0 => {}
            Err(i) => self.custom.insert(i, (dim, amount)),
        }
    }

    /// Adds `b` to every amount, saturating.
    #[inline]
    pub fn add(&mut self, b: &Amounts) {
        for (x, y) in self.builtin.iter_mut().zip(b.builtin) {
            *x = x.saturating_add(y);
        }
        for &(d, v) in &b.custom {
            let s = self.get(d).saturating_add(v);
            self.set(d, s);
        }
    }

    /// Subtracts `b` from every amount, saturating at 0.
    #[inline]
    pub fn sub(&mut self, b: &Amounts) {
        for (x, y) in self.builtin.iter_mut().zip(b.builtin) {
            *x = x.saturating_sub(y);
        }
        for &(d, v) in &b.custom {
            let s = self.get(d).saturating_sub(v);
            self.set(d, s);
        }
    }

    /// `f(amount, other's amount)` for every non-zero amount of `self`;
    /// a zero result drops the dimension.
    #[inline]
    pub(crate) fn map_with(&self, other: &Amounts, mut f: impl FnMut(u64, u64) -> u64) -> Amounts {
        let mut out = Amounts::new();
        for ((o, &a), &b) in out
            .builtin
            .iter_mut()
            .zip(&self.builtin)
            .zip(&other.builtin)
        {
            if a != 0 {
                *o = f(a, b);
            }
        }
        for &(d, a) in &self.custom {
            out.set(d, f(a, other.get(d)));
        }
        out
    }

    /// Builder form of [`Amounts::set`].
    ///
    /// ```
    /// use allowance_core::{Amounts, Dimension};
    /// let a = Amounts::new().with(Dimension::INPUT_TOKENS, 3000).with(Dimension::OUTPUT_TOKENS, 0);
    /// assert_eq!(a.get(Dimension::INPUT_TOKENS), 3000);
    /// assert_eq!(a.iter().count(), 1);
    /// ```
    pub fn with(mut self, dim: Dimension, amount: u64) -> Self {
        self.set(dim, amount);
        self
    }

    /// The non-zero amounts, by dimension.
    pub fn iter(&self) -> impl Iterator<Item = (Dimension, u64)> + '_ {
        self.builtin
            .iter()
            .enumerate()
            .filter(|(_, v)| **v != 0)
            .map(|(i, v)| (Dimension(i as u16 + 2), *v))
            .chain(self.custom.iter().copied())
    }

    /// Whether every amount is zero.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.builtin == [0; 4] && self.custom.is_empty()
    }

    /// The first amount above [`MAX_AMOUNT`], if any.
    #[inline]
    pub fn first_too_large(&self) -> Option<(Dimension, u64)> {
        // The common case in a few compares: built-ins only, all in range.
        if self.custom.is_empty() && self.builtin.iter().all(|&a| a <= MAX_AMOUNT) {
            return None;
        }
        self.iter().find(|&(_, a)| a > MAX_AMOUNT)
    }

    /// Every built-in dimension's amount by index, given the implied
    /// `requests` and `concurrent` (a hot loop reads a limit's amount with
    /// one index instead of a match).
    #[inline]
    pub(crate) fn builtin_row(&self, requests: u64, concurrent: u64) -> [u64; 6] {
        let [a, b, c, d] = self.builtin;
        [requests, concurrent, a, b, c, d]
    }

    /// No custom dimension, and every amount at most [`MAX_AMOUNT`].
    #[inline]
    pub(crate) fn builtin_only_in_range(&self) -> bool {
        self.custom.is_empty() && self.builtin.iter().all(|&a| a <= MAX_AMOUNT)
    }
}

impl FromIterator<(Dimension, u64)> for Amounts {
    fn from_iter<I: IntoIterator<Item = (Dimension, u64)>>(iter: I) -> Self {
        let mut a = Amounts::new();
        for (d, v) in iter {
            a.set(d, v);
        }
        a
    }
}

/// Encoded as the list of non-zero `(dimension, amount)` pairs in dimension
/// order, so that decoding can check the shape [`Amounts::iter`] gives and
/// one set of amounts has one encoding.
impl Serialize for Amounts {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.iter().count()))?;
        for pair in self.iter() {
            seq.serialize_element(&pair)?;
        }
        seq.end()
    }
}

/// Refuses a zero amount, an implied dimension, or dimensions out of order
/// (a repeat included): none of them is what [`Amounts`] encodes.
impl<'de> Deserialize<'de> for Amounts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct AmountsVisitor;

        impl<'de> Visitor<'de> for AmountsVisitor {
            type Value = Amounts;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("(dimension, amount) pairs in dimension order")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Amounts, A::Error> {
                let mut out = Amounts::new();
                let mut last: Option<Dimension> = None;
                while let Some((dim, amount)) = seq.next_element::<(Dimension, u64)>()? {
                    if dim.is_implied() {
                        return Err(de::Error::custom(format!(
                            "amounts: {dim:?} is implied, never given"
                        )));
                    }
                    if amount == 0 {
                        return Err(de::Error::custom(format!(
                            "amounts: {dim:?} is zero (zeros are dropped)"
                        )));
                    }
                    if last.is_some_and(|l| l >= dim) {
                        return Err(de::Error::custom(format!(
                            "amounts: {dim:?} is out of order"
                        )));
                    }
                    last = Some(dim);
                    out.set(dim, amount);
                }
                Ok(out)
            }
        }

        d.deserialize_seq(AmountsVisitor)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}
