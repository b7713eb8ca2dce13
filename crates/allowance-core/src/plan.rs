//! Plans (named lists of limits, a tier) and the overrun policy.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::Invalid;
use crate::limit::{Fast, Limit};
use crate::units::Dimension;
use crate::window;

/// Most limits in one plan.
pub const MAX_LIMITS_PER_PLAN: usize = 32;

/// What a settle records when the actual usage exceeds what was held: a
/// strategy chosen per plan (the tenant's plan governs a reservation) and
/// fixed at reserve time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OverrunPolicy {
    /// Record the actual usage; a budget may go below zero (honest accounting).
    #[default]
    ChargeActual,
    /// Record `min(actual, held)`: the caller was promised its estimate.
    CapAtEstimate,
    /// Record `min(actual, floor(held × (100 + percent) / 100))`.
    AllowOverrun {
        /// Tolerated overrun, in percent of the hold.
        percent: u32,
    },
}

impl OverrunPolicy {
    /// What to record for one dimension, given what was held and what was used.
    ///
    /// ```
    /// use allowance_core::OverrunPolicy;
    /// assert_eq!(OverrunPolicy::ChargeActual.charge(100, 150), 150);
    /// assert_eq!(OverrunPolicy::CapAtEstimate.charge(100, 150), 100);
    /// assert_eq!(OverrunPolicy::AllowOverrun { percent: 10 }.charge(100, 150), 110);
    /// assert_eq!(OverrunPolicy::AllowOverrun { percent: 10 }.charge(100, 50), 50);
    /// ```
    pub fn charge(self, held: u64, actual: u64) -> u64 {
        match self {
            OverrunPolicy::ChargeActual => actual,
            OverrunPolicy::CapAtEstimate => actual.min(held),
            OverrunPolicy::AllowOverrun { percent } => {
                let cap = u128::from(held) * (100 + u128::from(percent)) / 100;
                actual.min(u64::try_from(cap).unwrap_or(u64::MAX))
            }
        }
    }

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            OverrunPolicy::ChargeActual => "charge_actual",
            OverrunPolicy::CapAtEstimate => "cap_at_estimate",
            OverrunPolicy::AllowOverrun { .. } => "allow_overrun",
        }
    }
}

/// What a scope's hot loops read of one limit, packed together (an array
/// of these is half the size of the limits, with the offsets inline).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hot {
    pub(crate) fast: Fast,
    pub(crate) capacity: u64,
    /// Where the limit's state starts in a scope's state words.
    pub(crate) at: u32,
    pub(crate) dim: Dimension,
}

/// A limit as the per-kind hot loops read it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KindLimit {
    pub(crate) dim: Dimension,
    /// Its position in the plan (for the rare paths that need the `Limit`).
    pub(crate) index: u16,
    /// Where its state starts in a scope's state words.
    pub(crate) at: u32,
    pub(crate) capacity: u64,
    /// A bucket's period (a sliding window's slice width, unread).
    pub(crate) ms: u64,
}

/// A plan's limits grouped by window kind: a loop over one kind runs the
/// same few instructions for every limit, with no dispatch on the kind.
/// The order within the plan matters only to tell which denial is
/// reported, which the refused path works out limit by limit in plan order.
#[derive(Debug, Default)]
pub(crate) struct ByKind {
    pub(crate) buckets: Box<[KindLimit]>,
    pub(crate) sliding: Box<[KindLimit]>,
    pub(crate) concurrent: Box<[KindLimit]>,
    /// Calendar and total limits: per limit, through [`Hot`].
    pub(crate) other: Box<[KindLimit]>,
}

impl ByKind {
    fn new(hot: &[Hot]) -> ByKind {
        let mut k = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, h) in hot.iter().enumerate() {
            let ms = match h.fast {
                Fast::Sliding { width_ms, .. } => width_ms,
                Fast::Bucket { period_ms } => period_ms,
                _ => 0,
            };
            let l = KindLimit {
                dim: h.dim,
                index: i as u16,
                at: h.at,
                capacity: h.capacity,
                ms,
            };
            match h.fast {
                Fast::Bucket { .. } => k.0.push(l),
                Fast::Sliding { .. } => k.1.push(l),
                Fast::Concurrent => k.2.push(l),
                Fast::Calendar | Fast::Total => k.3.push(l),
            }
        }
        ByKind {
            buckets: k.0.into(),
            sliding: k.1.into(),
            concurrent: k.2.into(),
            other: k.3.into(),
        }
    }
}

/// A named list of limits: a tier (`free`, `plus`, `enterprise`), or the
/// limits given to one scope by an override.
///
/// Encoded as its name, limits, overrun policy and queue weight; decoded
/// through [`Plan::with_weight`]'s checks (the layout is worked out again).
#[derive(Debug, Serialize, Deserialize)]
#[serde(try_from = "PlanFields")]
pub struct Plan {
    name: Box<str>,
    limits: Box<[Limit]>,
    overrun: OverrunPolicy,
    queue_weight: u32,
    /// Where each limit's state starts in a scope's state words.
    #[serde(skip)]
    pub(crate) offsets: Box<[u32]>,
    /// What the hot loops read of each limit, in plan order, in one array.
    #[serde(skip)]
    pub(crate) hot: Box<[Hot]>,
    /// The same, grouped by window kind.
    #[serde(skip)]
    pub(crate) by_kind: ByKind,
    /// Words of state a scope on this plan needs (a timestamp first).
    #[serde(skip)]
    pub(crate) words: u32,
}

/// A [`Plan`]'s encoded fields, before they are checked.
#[derive(Deserialize)]
struct PlanFields {
    name: String,
    limits: Vec<Limit>,
    overrun: OverrunPolicy,
    queue_weight: u32,
}

impl TryFrom<PlanFields> for Plan {
    type Error = Invalid;

    fn try_from(f: PlanFields) -> Result<Plan, Invalid> {
        Plan::build(&f.name, f.limits, f.overrun, f.queue_weight)
    }
}

impl Plan {
    /// A validated plan. Errors name the field as `limits[i].…`.
    ///
    /// ```
    /// use allowance_core::{Dimension, Limit, OverrunPolicy, Plan, Window};
    /// let plan = Plan::new("free", vec![
    ///     Limit::new(Dimension::REQUESTS, 60, Window::Bucket { period_ms: 60_000 }).unwrap(),
    ///     Limit::new(Dimension::CONCURRENT, 4, Window::Concurrent).unwrap(),
    /// ], OverrunPolicy::ChargeActual).unwrap();
    /// assert_eq!(plan.limits().len(), 2);
    /// ```
    pub fn new(
        name: &str,
        limits: Vec<Limit>,
        overrun: OverrunPolicy,
    ) -> Result<Arc<Plan>, Invalid> {
        Plan::with_weight(name, limits, overrun, 1)
    }

    /// [`Plan::new`] with a queue weight (the tenant's share in the admission queue).
    pub fn with_weight(
        name: &str,
        limits: Vec<Limit>,
        overrun: OverrunPolicy,
        queue_weight: u32,
    ) -> Result<Arc<Plan>, Invalid> {
        Plan::build(name, limits, overrun, queue_weight).map(Arc::new)
    }

    /// [`Plan::with_weight`] before it is shared (a decoder builds one too).
    fn build(
        name: &str,
        limits: Vec<Limit>,
        overrun: OverrunPolicy,
        queue_weight: u32,
    ) -> Result<Plan, Invalid> {
        if name.is_empty() || name.len() > 64 {
            return Err(Invalid::new("name", "a plan name has 1 to 64 characters"));
        }
        if limits.len() > MAX_LIMITS_PER_PLAN {
            return Err(Invalid::new(
                "limits",
                format!("at most {MAX_LIMITS_PER_PLAN} limits per plan"),
            ));
        }
        if queue_weight == 0 || queue_weight > 1000 {
            return Err(Invalid::new("queue_weight", "must be between 1 and 1000"));
        }
        if let OverrunPolicy::AllowOverrun { percent } = overrun
            && percent > 10_000
        {
            return Err(Invalid::new(
                "overrun_percent",
                "must be between 0 and 10000",
            ));
        }
        for (i, a) in limits.iter().enumerate() {
            if limits[..i].iter().any(|b| b.same_history(a)) {
                return Err(Invalid::new(
                    format!("limits[{i}]"),
                    "duplicates an earlier limit (same dimension and window)",
                ));
            }
        }
        let mut offsets = Vec::with_capacity(limits.len());
        let mut words = 1u32;
        for l in &limits {
            offsets.push(words);
            words += window::words_for(l.window()) as u32;
        }
        let hot = limits
            .iter()
            .zip(&offsets)
            .map(|(l, &at)| Hot {
                fast: l.fast,
                capacity: l.capacity(),
                at,
                dim: l.dimension(),
            })
            .collect();
        let hot: Box<[Hot]> = hot;
        Ok(Plan {
            by_kind: ByKind::new(&hot),
            hot,
            name: name.into(),
            limits: limits.into(),
            overrun,
            queue_weight,
            offsets: offsets.into(),
            words,
        })
    }

    /// The plan's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its limits, in order (the order breaks ties between denials).
    pub fn limits(&self) -> &[Limit] {
        &self.limits
    }

    /// Its overrun policy (read from the tenant's plan only).
    pub fn overrun(&self) -> OverrunPolicy {
        self.overrun
    }

    /// The tenant's share in the admission queue.
    pub fn queue_weight(&self) -> u32 {
        self.queue_weight
    }

    /// Whether any limit counts `dim`.
    pub fn limits_dimension(&self, dim: Dimension) -> bool {
        self.limits.iter().any(|l| l.dimension() == dim)
    }

    /// An empty plan (no limits), for kinds configured without one.
    pub fn unlimited() -> Arc<Plan> {
        Plan::new("unlimited", Vec::new(), OverrunPolicy::ChargeActual)
            .expect("the empty plan is valid")
    }
}
