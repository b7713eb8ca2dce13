//! Reservations and the requests and answers around them.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::limit::WindowKind;
use crate::plan::OverrunPolicy;
use crate::scope::{ScopeKey, ScopeSet};
use crate::units::{Amounts, Timestamp};

/// A reservation's id: 128 bits, of which at least 120 are random (made at
/// the boundary, passed in, so a replayed log makes the same ids). The low
/// 8 bits may carry a tag of the tenant ([`ReservationId::mint`]) so a
/// sharded ledger finds a reservation's home without a global index.
///
/// Encoded as its 16 bytes, little-endian: ids are random, so a varint
/// would only make them longer.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(from = "[u8; 16]", into = "[u8; 16]")]
pub struct ReservationId(pub u128);

impl From<[u8; 16]> for ReservationId {
    fn from(bytes: [u8; 16]) -> Self {
        ReservationId(u128::from_le_bytes(bytes))
    }
}

impl From<ReservationId> for [u8; 16] {
    fn from(id: ReservationId) -> Self {
        id.0.to_le_bytes()
    }
}

impl ReservationId {
    /// An id from 128 random bits, with the low 8 replaced by the tenant's
    /// tag (120 random bits remain). Every id given to a
    /// [`SharedLedger`](crate::SharedLedger) must be made so.
    ///
    /// ```
    /// use allowance_core::ReservationId;
    /// let id = ReservationId::mint(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef, "acme");
    /// assert_eq!(id.tag(), ReservationId::tenant_tag("acme"));
    /// assert_eq!(ReservationId::parse(&id.to_string()), Some(id));
    /// ```
    pub fn mint(random: u128, tenant: &str) -> Self {
        ReservationId((random & !0xff) | u128::from(Self::tenant_tag(tenant)))
    }

    /// The stable 8-bit tag of a tenant name (FNV-1a, folded). Stable across
    /// processes and versions: it routes ids to shards.
    pub fn tenant_tag(tenant: &str) -> u8 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in tenant.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        (h ^ (h >> 8) ^ (h >> 16) ^ (h >> 24) ^ (h >> 32) ^ (h >> 40) ^ (h >> 48) ^ (h >> 56)) as u8
    }

    /// The tag in the low 8 bits.
    pub fn tag(self) -> u8 {
        self.0 as u8
    }

    /// Parses the display form `rsv_` + 32 lowercase hex digits.
    pub fn parse(s: &str) -> Option<ReservationId> {
        let hex = s.strip_prefix("rsv_")?.as_bytes();
        if hex.len() != 32 {
            return None;
        }
        // Lowercase digits only, as `Display` writes them; folded by hand
        // through a table (`from_str_radix` re-checks every digit and its
        // overflow; every settle, refund and read parses one).
        const BAD: u8 = 0xff;
        const DIGITS: [u8; 256] = {
            let mut t = [BAD; 256];
            let mut i = 0;
            while i < 10 {
                t[b'0' as usize + i] = i as u8;
                i += 1;
            }
            let mut i = 0;
            while i < 6 {
                t[b'a' as usize + i] = 10 + i as u8;
                i += 1;
            }
            t
        };
        let mut n = 0u128;
        let mut bad = 0u8;
        for &b in hex {
            let digit = DIGITS[usize::from(b)];
            bad |= digit & 0xf0;
            n = (n << 4) | u128::from(digit & 0x0f);
        }
        (bad == 0).then_some(ReservationId(n))
    }
}

impl ReservationId {
    /// Its text form (`rsv_` + 32 lowercase hex digits, as `Display`
    /// writes it) as ASCII bytes, with no allocation: every answer carries
    /// an id.
    ///
    /// ```
    /// use allowance_core::ReservationId;
    /// let id = ReservationId(0xabc);
    /// assert_eq!(&id.to_ascii()[..], id.to_string().as_bytes());
    /// ```
    pub fn to_ascii(self) -> [u8; 36] {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = *b"rsv_00000000000000000000000000000000";
        let mut n = self.0;
        for b in out[4..].iter_mut().rev() {
            *b = HEX[(n & 0xf) as usize];
            n >>= 4;
        }
        out
    }
}

impl fmt::Display for ReservationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Only ASCII digits, letters and `_` were written.
        f.write_str(std::str::from_utf8(&self.to_ascii()).unwrap_or_default())
    }
}

impl fmt::Debug for ReservationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Where a reservation is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Status {
    /// Holding its amounts on every scope.
    Held,
    /// Usage recorded (terminal).
    Settled,
    /// Released with nothing recorded (terminal).
    Refunded,
    /// Its TTL passed; holds released. A late settle may still record usage.
    Expired,
}

impl Status {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Held => "held",
            Status::Settled => "settled",
            Status::Refunded => "refunded",
            Status::Expired => "expired",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Free-form labels carried by a reservation into the usage log.
pub type Labels = Arc<[(String, String)]>;

/// A reserve request. Build the scopes with
/// [`Catalog::scope_set`](crate::Catalog::scope_set); a request can be
/// reused (its shared parts are reference counted).
///
/// Its encoding is every field as given: the engine checks a request when
/// it runs it, so a decoded request is refused exactly as a received one.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReserveRequest {
    /// The tenant scope first, then the others.
    pub scopes: ScopeSet,
    /// Amounts as sent (zeros dropped); `tokens` and `cost_micros` are
    /// derived when absent.
    pub amounts: Amounts,
    /// A model from the model table, for `cost_micros`.
    pub model: Option<Arc<str>>,
    /// Time to live; the catalog's default when `None`.
    pub ttl_ms: Option<u64>,
    /// Makes a retried reserve return the same reservation.
    pub idempotency_key: Option<Arc<str>>,
    /// Answer as a reserve would, and change nothing.
    pub dry_run: bool,
    /// Labels for the usage log.
    pub labels: Option<Labels>,
    /// Also answer the remaining room of every limit of every scope.
    pub report_remaining: bool,
}

impl ReserveRequest {
    /// A request for `amounts` on `scopes`, with every option at its default.
    pub fn new(scopes: ScopeSet, amounts: Amounts) -> Self {
        ReserveRequest {
            scopes,
            amounts,
            model: None,
            ttl_ms: None,
            idempotency_key: None,
            dry_run: false,
            labels: None,
            report_remaining: false,
        }
    }
}

/// One limit's room, as reported with a grant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Remaining {
    /// The scope.
    pub scope: ScopeKey,
    /// The dimension's name.
    pub dimension: String,
    /// The window kind.
    pub window: WindowKind,
    /// The capacity.
    pub capacity: u64,
    /// `capacity − used − held` after this reservation.
    pub remaining: i64,
    /// When room next appears without new traffic.
    pub resets_at: Option<Timestamp>,
}

/// A granted reserve (or a dry run that would be granted, or a replay).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Granted {
    /// The reservation's id (for a dry run, the id it would have had).
    pub id: ReservationId,
    /// Held; for a replay the existing reservation's status.
    pub status: Status,
    /// Whether this answers an idempotent repeat.
    pub replayed: bool,
    /// Whether nothing was held (`dry_run`).
    pub dry_run: bool,
    /// The amounts held (derived `tokens` and `cost_micros` included;
    /// `requests` and `concurrent` are implied).
    pub held: Amounts,
    /// When the reservation was made (for a replay, the original instant).
    pub created_at: Timestamp,
    /// When the hold expires.
    pub expires_at: Timestamp,
    /// Every limit's room, when asked for (`report_remaining`, dry runs).
    pub remaining: Vec<Remaining>,
}

/// Usage reported at settle.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Actual amounts (a missing dimension counts as 0).
    pub amounts: Amounts,
    /// The part of `input_tokens` served from a cache (priced apart).
    pub cached_input_tokens: u64,
    /// Non-token costs (tool calls, vendors), never capped by the overrun policy.
    pub charges: Vec<Charge>,
}

/// A non-token charge recorded at settle.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charge {
    /// What it was for (`search`).
    pub name: String,
    /// Its cost, added to `cost_micros`.
    pub cost_micros: u64,
    /// Custom dimensions it counts (`search_calls: 1`).
    pub amounts: Amounts,
}

/// A reservation, as read back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    /// Its id.
    pub id: ReservationId,
    /// Its status.
    pub status: Status,
    /// Its scopes, the tenant first.
    pub scopes: ScopeSet,
    /// The model named at reserve.
    pub model: Option<Arc<str>>,
    /// Labels.
    pub labels: Option<Labels>,
    /// Amounts held (or last held, once ended).
    pub held: Amounts,
    /// When it was made.
    pub created_at: Timestamp,
    /// When the hold expires (or expired).
    pub expires_at: Timestamp,
    /// When it ended, once it has.
    pub ended_at: Option<Timestamp>,
    /// What a settle recorded after the overrun policy (`requests` implied as 1).
    pub charged: Option<Amounts>,
    /// Whether it was settled after it had expired.
    pub late: bool,
    /// The overrun policy fixed at reserve time.
    pub overrun: OverrunPolicy,
    /// Its idempotency key.
    pub idempotency_key: Option<Arc<str>>,
}

/// One limit of a scope, as reported by a status read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitStatus {
    /// The dimension's name.
    pub dimension: String,
    /// The window and its parameters.
    pub window: crate::limit::Window,
    /// The capacity.
    pub capacity: u64,
    /// Usage in the window (bucket: capacity − level; total: all usage; concurrent: 0).
    pub used: i64,
    /// Held by live reservations (concurrent: their number).
    pub held: u64,
    /// `capacity − used − held`; negative after an overrun.
    pub remaining: i64,
    /// When room next appears without new traffic.
    pub resets_at: Option<Timestamp>,
}

/// A scope's status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScopeStatus {
    /// The canonical scope.
    pub scope: ScopeKey,
    /// Its plan's name.
    pub plan: String,
    /// Number of HELD reservations on it.
    pub held_reservations: u64,
    /// Every limit of its plan.
    pub limits: Vec<LimitStatus>,
}

#[cfg(test)]
mod tests {
    use super::ReservationId;

    #[test]
    fn ids_parse_only_in_their_display_form() {
        let id = ReservationId(0x0123_4567_89ab_cdef_0011_2233_4455_66ff);
        assert_eq!(ReservationId::parse(&id.to_string()), Some(id));
        assert_eq!(
            ReservationId::parse("rsv_ffffffffffffffffffffffffffffffff"),
            Some(ReservationId(u128::MAX))
        );
        for bad in [
            "",
            "rsv_",
            "0123456789abcdef0011223344556600",
            "rsv_0123456789ABCDEF0011223344556600",
            "rsv_0123456789abcdef001122334455660g",
            "rsv_0123456789abcdef00112233445566",
            "rsv_0123456789abcdef001122334455660000",
            "RSV_0123456789abcdef0011223344556600",
            "rsv_0123456789abcdef00112233445566é",
            "rsv_ 123456789abcdef0011223344556600",
        ] {
            assert_eq!(ReservationId::parse(bad), None, "{bad:?}");
        }
    }
}
