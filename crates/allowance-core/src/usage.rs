//! The usage log's records: what billing exports.
//!
//! Every settle, refund, expiry and admin adjustment becomes one
//! [`UsageEvent`], produced by the journaled operations of
//! [`SharedLedger`](crate::SharedLedger) in the order the ledger committed
//! them. A store numbers them with cursors that never change, so an exporter
//! that stores its cursor never misses or repeats a record.

use serde::{Deserialize, Serialize};

use crate::reservation::Reservation;
use crate::scope::ScopeKey;
use crate::units::{Dimension, Timestamp};

/// What a usage record reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UsageKind {
    /// A reservation was settled (`late` if after its expiry).
    Settled,
    /// A reservation was refunded.
    Refunded,
    /// A hold expired unsettled (nothing charged; a late settle may follow).
    Expired,
    /// An admin credited or debited a scope's `total` limits.
    Adjusted,
}

impl UsageKind {
    /// The name used on the wire: `settled`, `refunded`, `expired`, `adjusted`.
    pub fn as_str(self) -> &'static str {
        match self {
            UsageKind::Settled => "settled",
            UsageKind::Refunded => "refunded",
            UsageKind::Expired => "expired",
            UsageKind::Adjusted => "adjusted",
        }
    }
}

/// An admin adjustment of a scope's `total` limits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Adjustment {
    /// The scope adjusted.
    pub scope: ScopeKey,
    /// The dimension adjusted.
    pub dimension: Dimension,
    /// Positive: a credit (room grows); negative: a debit.
    pub credit: i64,
    /// Why (the admin's words; empty when none was given).
    pub reason: String,
}

/// One entry of the usage log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageEvent {
    /// When it happened: the settle or refund instant, the expiry instant
    /// (`expires_at`), the adjustment instant.
    pub at: Timestamp,
    /// What happened.
    pub kind: UsageKind,
    /// The reservation as it ended (settled, refunded, expired); `None` for
    /// an adjustment.
    pub reservation: Option<Reservation>,
    /// The adjustment; `None` otherwise.
    pub adjustment: Option<Adjustment>,
}

impl UsageEvent {
    /// A reservation's end.
    pub fn ended(kind: UsageKind, at: Timestamp, reservation: Reservation) -> Self {
        UsageEvent {
            at,
            kind,
            reservation: Some(reservation),
            adjustment: None,
        }
    }

    /// The tenant it concerns (an adjustment of a shared scope: none).
    pub fn tenant(&self) -> Option<&str> {
        match (&self.reservation, &self.adjustment) {
            (Some(r), _) => Some(r.scopes.tenant_name()),
            (None, Some(a)) => a.scope.tenant_name(),
            (None, None) => None,
        }
    }
}

/// A usage event with its cursor: its place in the log, stable forever.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageRecord {
    /// Increases along the log; `since=<cursor>` starts after it.
    pub cursor: u64,
    /// The event.
    pub event: UsageEvent,
}

/// One page of the usage log.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsagePage {
    /// The records after `since`, oldest first.
    pub records: Vec<UsageRecord>,
    /// Where the next page starts: the last record's cursor, or `since`
    /// itself (0 when absent) when there are no new records.
    pub next_cursor: u64,
}

/// The most records one page may ask for.
pub const MAX_USAGE_PAGE: usize = 10_000;
