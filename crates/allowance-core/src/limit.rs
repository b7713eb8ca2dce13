//! Limits: `(dimension, capacity, window)`. A `Limit` that exists is valid.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::calendar::{CalendarUnit, Zone};
use crate::error::Invalid;
use crate::units::{Dimension, MAX_AMOUNT};

/// Most slices a sliding window may have: bounds the memory of a scope and
/// the cost of the (denial-only) retry computation.
pub const MAX_SLICES: u32 = 3600;
/// Default slices of a sliding window.
pub const DEFAULT_SLICES: u32 = 60;
/// Longest period of a sliding window or bucket (400 days): longer windows
/// are calendar or total budgets.
pub const MAX_PERIOD_MS: u64 = 400 * 24 * 3600 * 1000;

/// The kind of a limit's window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WindowKind {
    /// Rolling window of slices.
    Sliding,
    /// Token bucket, continuous refill.
    Bucket,
    /// Fixed window aligned to calendar boundaries.
    Calendar,
    /// Never refills.
    Total,
    /// At most `capacity` HELD reservations at once.
    Concurrent,
}

impl WindowKind {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            WindowKind::Sliding => "sliding",
            WindowKind::Bucket => "bucket",
            WindowKind::Calendar => "calendar",
            WindowKind::Total => "total",
            WindowKind::Concurrent => "concurrent",
        }
    }
}

impl fmt::Display for WindowKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A window with its parameters.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Window {
    /// Usage over the last `period_ms`, made of `slices` epoch-aligned slices
    /// of `period_ms / slices` each: approximate to one slice, and no instant
    /// resets it.
    Sliding {
        /// The window's length.
        period_ms: u64,
        /// Number of slices; `period_ms` is a multiple of it.
        slices: u32,
    },
    /// A token bucket of `capacity`, refilling continuously at
    /// `capacity / period_ms`; it starts full.
    Bucket {
        /// Time to refill from empty.
        period_ms: u64,
    },
    /// A fixed window aligned to `unit` boundaries in `zone`.
    Calendar {
        /// minute, hour, day, week (Monday) or month.
        unit: CalendarUnit,
        /// UTC or an IANA zone.
        zone: Zone,
    },
    /// Never refills; only an admin adjustment changes it.
    Total,
    /// The gauge of HELD reservations (dimension `concurrent` only).
    Concurrent,
}

impl Window {
    /// The kind of this window.
    pub fn kind(&self) -> WindowKind {
        match self {
            Window::Sliding { .. } => WindowKind::Sliding,
            Window::Bucket { .. } => WindowKind::Bucket,
            Window::Calendar { .. } => WindowKind::Calendar,
            Window::Total => WindowKind::Total,
            Window::Concurrent => WindowKind::Concurrent,
        }
    }

    /// A window's length in ms (sliding and bucket), for headers.
    pub fn period_ms(&self) -> Option<u64> {
        match self {
            Window::Sliding { period_ms, .. } | Window::Bucket { period_ms } => Some(*period_ms),
            _ => None,
        }
    }
}

/// One ceiling: at most `capacity` of `dimension` per `window`.
///
/// ```
/// use allowance_core::{Dimension, Limit, Window};
/// let l = Limit::new(Dimension::TOKENS, 200_000, Window::Sliding { period_ms: 3_600_000, slices: 60 }).unwrap();
/// assert_eq!(l.capacity(), 200_000);
/// assert!(Limit::new(Dimension::TOKENS, 0, Window::Total).is_err());
/// ```
///
/// Encoded as its dimension, capacity, window and guarantee; decoded
/// through [`Limit::new`] and [`Limit::with_guaranteed`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "LimitFields")]
pub struct Limit {
    dimension: Dimension,
    capacity: u64,
    window: Window,
    guaranteed: u64,
    #[serde(skip)]
    pub(crate) fast: Fast,
}

/// A [`Limit`]'s encoded fields, before they are checked.
#[derive(Deserialize)]
struct LimitFields {
    dimension: Dimension,
    capacity: u64,
    window: Window,
    guaranteed: u64,
}

impl TryFrom<LimitFields> for Limit {
    type Error = Invalid;

    fn try_from(f: LimitFields) -> Result<Limit, Invalid> {
        let limit = Limit::new(f.dimension, f.capacity, f.window)?;
        if f.guaranteed == 0 {
            return Ok(limit);
        }
        limit.with_guaranteed(f.guaranteed)
    }
}

/// A window's kind with its parameters precomputed for the hot path (the
/// slice width is divided once, here, not on every operation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fast {
    Sliding { width_ms: u64, slices: u64 },
    Bucket { period_ms: u64 },
    Calendar,
    Total,
    Concurrent,
}

impl Limit {
    /// A validated limit. Errors name the field (`capacity`, `window`,
    /// `period_ms`, `slices`, `dimension`) relative to the limit.
    pub fn new(dimension: Dimension, capacity: u64, window: Window) -> Result<Limit, Invalid> {
        if capacity == 0 || capacity > MAX_AMOUNT {
            return Err(Invalid::new(
                "capacity",
                format!("must be between 1 and 2^53, got {capacity}"),
            ));
        }
        let concurrent_dim = dimension == Dimension::CONCURRENT;
        let concurrent_win = window == Window::Concurrent;
        if concurrent_dim != concurrent_win {
            return Err(Invalid::new(
                "window",
                "the dimension `concurrent` takes no window, and only it is a concurrency gauge",
            ));
        }
        match &window {
            Window::Sliding { period_ms, slices } => {
                if *slices == 0 || *slices > MAX_SLICES {
                    return Err(Invalid::new(
                        "slices",
                        format!("must be between 1 and {MAX_SLICES}, got {slices}"),
                    ));
                }
                if *period_ms == 0 || *period_ms > MAX_PERIOD_MS {
                    return Err(Invalid::new(
                        "period_ms",
                        format!("must be between 1 ms and 400 days, got {period_ms} ms"),
                    ));
                }
                if period_ms % u64::from(*slices) != 0 {
                    return Err(Invalid::new(
                        "period_ms",
                        format!("{period_ms} ms is not a multiple of {slices} slices"),
                    ));
                }
            }
            Window::Bucket { period_ms } => {
                if *period_ms == 0 || *period_ms > MAX_PERIOD_MS {
                    return Err(Invalid::new(
                        "period_ms",
                        format!("must be between 1 ms and 400 days, got {period_ms} ms"),
                    ));
                }
            }
            Window::Calendar { .. } | Window::Total | Window::Concurrent => {}
        }
        let fast = match &window {
            Window::Sliding { period_ms, slices } => Fast::Sliding {
                width_ms: period_ms / u64::from(*slices),
                slices: u64::from(*slices),
            },
            Window::Bucket { period_ms } => Fast::Bucket {
                period_ms: *period_ms,
            },
            Window::Calendar { .. } => Fast::Calendar,
            Window::Total => Fast::Total,
            Window::Concurrent => Fast::Concurrent,
        };
        Ok(Limit {
            dimension,
            capacity,
            window,
            guaranteed: 0,
            fast,
        })
    }

    /// A concurrency limit with a guaranteed share (CONFIG.md): tenants
    /// holding fewer than `guaranteed` are served first when waiters compete.
    pub fn with_guaranteed(mut self, guaranteed: u64) -> Result<Limit, Invalid> {
        if self.window != Window::Concurrent {
            return Err(Invalid::new(
                "guaranteed",
                "only a concurrent limit takes a guarantee",
            ));
        }
        if guaranteed > self.capacity {
            return Err(Invalid::new(
                "guaranteed",
                format!("{guaranteed} is above the capacity {}", self.capacity),
            ));
        }
        self.guaranteed = guaranteed;
        Ok(self)
    }

    /// What is counted.
    pub fn dimension(&self) -> Dimension {
        self.dimension
    }

    /// The ceiling.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The window.
    pub fn window(&self) -> &Window {
        &self.window
    }

    /// Guaranteed concurrency (0 when none).
    pub fn guaranteed(&self) -> u64 {
        self.guaranteed
    }

    /// Whether usage history carries over from `other` on a plan change:
    /// the same dimension and the same window with the same period.
    pub(crate) fn same_history(&self, other: &Limit) -> bool {
        self.dimension == other.dimension && self.window == other.window
    }

    /// Whether `other` is this sliding limit with only its slices changed:
    /// the same dimension and period, so its history is carried over, cut
    /// into the new slices ([`crate::window::reslice`]).
    pub(crate) fn reslices(&self, other: &Limit) -> bool {
        match (&self.window, &other.window) {
            (Window::Sliding { period_ms: a, .. }, Window::Sliding { period_ms: b, .. }) => {
                self.dimension == other.dimension && a == b
            }
            _ => false,
        }
    }
}
