//! Errors and denials: "bad request", "not now" and "never" are different types.

use std::fmt;

use crate::limit::WindowKind;
use crate::reservation::Status;
use crate::scope::ScopeKey;
use crate::units::Timestamp;

/// A bad input, found before anything changed. `field` is a dotted path to
/// the offending input (`amounts.input_tokens`, `scopes.user`, `ttl_ms`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Invalid {
    /// Dotted path to the offending field.
    pub field: String,
    /// What is wrong with it, for a human.
    pub message: String,
}

impl Invalid {
    /// An invalid `field`, with a message.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Why a reservation (or an extension) was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DenialKind {
    /// Room will come by itself (usage leaving a window, refill, a calendar
    /// boundary, holds ending): retry after `retry_after_ms`. HTTP 429.
    RateLimited,
    /// A `total` limit lacks room because of usage: a hard stop until an
    /// admin acts. HTTP 402.
    BudgetExhausted,
    /// The amount is larger than the limit's whole capacity: it can never
    /// pass. HTTP 422.
    ExceedsLimit,
}

impl DenialKind {
    /// The wire name (`rate_limited`, `budget_exhausted`, `exceeds_limit`).
    pub fn as_str(self) -> &'static str {
        match self {
            DenialKind::RateLimited => "rate_limited",
            DenialKind::BudgetExhausted => "budget_exhausted",
            DenialKind::ExceedsLimit => "exceeds_limit",
        }
    }

    /// Precedence when several limits refuse: exceeds_limit over
    /// budget_exhausted over rate_limited.
    pub(crate) fn rank(self) -> u8 {
        match self {
            DenialKind::ExceedsLimit => 2,
            DenialKind::BudgetExhausted => 1,
            DenialKind::RateLimited => 0,
        }
    }
}

/// A typed refusal naming the binding limit, so the caller can choose what
/// to do (wait, pick a cheaper model, alert a human).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    /// rate_limited, budget_exhausted or exceeds_limit.
    pub kind: DenialKind,
    /// The canonical scope whose limit said no.
    pub scope: ScopeKey,
    /// The dimension's name.
    pub dimension: String,
    /// The limit's window kind.
    pub window: WindowKind,
    /// The limit's capacity.
    pub capacity: u64,
    /// `capacity − used − held` now (negative after an overrun).
    pub remaining: i64,
    /// What the request asked of this limit.
    pub requested: u64,
    /// When a retry can pass this limit; `None` for hard stops. Always ≥ 1
    /// when present.
    pub retry_after_ms: Option<u64>,
    /// When the window next frees room without new traffic, where such an
    /// instant exists.
    pub resets_at: Option<Timestamp>,
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} {} ({} window) has {} of {} left, {} requested",
            self.kind.as_str(),
            self.scope,
            self.dimension,
            self.window.as_str(),
            self.remaining,
            self.capacity,
            self.requested
        )?;
        if let Some(ms) = self.retry_after_ms {
            write!(f, "; retry after {ms} ms")?;
        }
        Ok(())
    }
}

/// Why a reserve did not grant.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReserveError {
    /// The request is malformed; nothing changed.
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// A limit refused; nothing changed.
    #[error("{0}")]
    Denied(Box<Denial>),
    /// The idempotency key is bound to a different request.
    #[error("idempotency key {key:?} was used for a different request")]
    IdempotencyConflict {
        /// The key.
        key: String,
    },
    /// The reservation id is already in use.
    #[error("reservation id already exists")]
    DuplicateId,
}

/// Why a settle did not happen.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SettleError {
    /// The usage is malformed; nothing changed.
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// No such reservation (or it ended longer ago than the retention).
    #[error("reservation not found")]
    NotFound,
    /// The reservation was refunded: it cannot be settled.
    #[error("reservation is {status}, it cannot be settled")]
    Conflict {
        /// Its status.
        status: Status,
    },
}

/// Why a refund did not happen.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RefundError {
    /// No such reservation.
    #[error("reservation not found")]
    NotFound,
    /// The reservation was settled: it cannot be refunded.
    #[error("reservation is {status}, it cannot be refunded")]
    Conflict {
        /// Its status.
        status: Status,
    },
}

/// Why an extend did not happen; the reservation is exactly as it was.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExtendError {
    /// The request is malformed.
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// No such reservation.
    #[error("reservation not found")]
    NotFound,
    /// Only a HELD reservation can be extended.
    #[error("reservation is {status}, only a held reservation can be extended")]
    NotHeld {
        /// Its status.
        status: Status,
    },
    /// A limit refused the extra amounts; the reservation is still HELD as it was.
    #[error("{0}")]
    Denied(Box<Denial>),
}

/// Why an admin change was refused; nothing changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    /// The change is malformed.
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// The named plan, scope or limit does not exist.
    #[error("{0} not found")]
    NotFound(String),
}
