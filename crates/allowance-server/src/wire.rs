//! The JSON bodies of HTTP-API.md, as the handlers read and write them. The
//! OpenAPI document is generated from these same types.
//!
//! Requests reject unknown fields. Maps (`scopes`, `amounts`, `labels`)
//! keep the order they were sent in (the reservation's scopes are reported
//! in the request's order) and reject a key given twice.

use std::fmt;
use std::marker::PhantomData;

use allowance_core::{
    Amounts, Catalog, Dimension, Granted, Invalid, MAX_AMOUNT, Remaining, Reservation,
    ReservationId, ScopeKey, ScopeStatus, Timestamp, Window, WindowKind,
};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use utoipa::ToSchema;

/// RFC 3339 UTC with milliseconds: `2026-11-29T16:05:00.000Z`. Formatted
/// by hand (civil date from days, Hinnant's algorithm): every answer
/// carries several of these, and a general formatter showed in profiles.
pub fn rfc3339(t: Timestamp) -> String {
    ascii_str(&rfc3339_bytes(t)).to_owned()
}

/// The 24 ASCII bytes of [`rfc3339`]`(t)`, with no heap string.
fn rfc3339_bytes(t: Timestamp) -> [u8; 24] {
    const DAY_MS: u64 = 86_400_000;
    let ms = t.as_millis();
    if ms >= 253_402_300_800_000 {
        // Beyond year 9999: not an instant this ledger can produce.
        return *b"9999-12-31T23:59:59.999Z";
    }
    let (days, in_day) = ((ms / DAY_MS) as i64, ms % DAY_MS);
    let mut out = *b"0000-00-00T00:00:00.000Z";
    out[..10].copy_from_slice(&date_bytes(days));
    let (h, m, s, milli) = (
        in_day / 3_600_000,
        in_day / 60_000 % 60,
        in_day / 1_000 % 60,
        in_day % 1_000,
    );
    put_digits(&mut out[11..13], h);
    put_digits(&mut out[14..16], m);
    put_digits(&mut out[17..19], s);
    put_digits(&mut out[20..23], milli);
    out
}

/// `n`'s last `out.len()` decimal digits, zero-padded, into `out`. By hand:
/// this runs several times in every answer, and `write!` costs several
/// times the arithmetic.
fn put_digits(out: &mut [u8], mut n: u64) {
    for b in out.iter_mut().rev() {
        *b = b'0' + (n % 10) as u8;
        n /= 10;
    }
}

/// `YYYY-MM-DD` of a day since the epoch (the days-to-civil algorithm),
/// remembered per thread for the last day asked: the instants of one
/// answer, and of consecutive answers, nearly always share their date.
fn date_bytes(days: i64) -> [u8; 10] {
    thread_local! {
        static LAST: std::cell::Cell<(i64, [u8; 10])> = const { std::cell::Cell::new((i64::MIN, [0; 10])) };
    }
    let (last_day, last) = LAST.get();
    if last_day == days {
        return last;
    }
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let mut out = *b"0000-00-00";
    put_digits(&mut out[0..4], year as u64);
    put_digits(&mut out[5..7], month as u64);
    put_digits(&mut out[8..10], day as u64);
    LAST.set((days, out));
    out
}

/// Bytes this module wrote as ASCII, as the `&str` they are.
fn ascii_str(bytes: &[u8]) -> &str {
    std::str::from_utf8(bytes).unwrap_or_default()
}

/// An instant as it goes on the wire: [`rfc3339`], serialized from a
/// stack buffer (an answer carries several; each would be a heap string).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireTime(pub Timestamp);

impl Serialize for WireTime {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(ascii_str(&rfc3339_bytes(self.0)))
    }
}

/// A reservation id as it goes on the wire (its `Display`), serialized
/// from a stack buffer ([`ReservationId::to_ascii`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireId(pub ReservationId);

impl Serialize for WireId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(ascii_str(&self.0.to_ascii()))
    }
}

/// A reservation's canonical scope names as a JSON array, read from its
/// scope set (no vector of names built per answer).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScopesView<'a>(pub &'a [ScopeKey]);

impl Serialize for ScopesView<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(ScopeKey::as_str))
    }
}

/// The wire name of a window kind.
pub fn window_name(w: WindowKind) -> &'static str {
    w.as_str()
}

/// Keys of an [`Ordered`] object checked for repeats by a scan; beyond, a set.
const SCAN_KEYS: usize = 16;

/// Serializes `(name, value)` pairs as a JSON object, in order.
fn serialize_pairs<S: serde::Serializer, K: Serialize, V: Serialize>(
    pairs: &[(K, V)],
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(Some(pairs.len()))?;
    for (k, v) in pairs {
        m.serialize_entry(k, v)?;
    }
    m.end()
}

/// A JSON object read in order, each key once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ordered<V>(pub Vec<(String, V)>);

impl<V> Default for Ordered<V> {
    fn default() -> Self {
        Ordered(Vec::new())
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Ordered<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V2<V>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for V2<V> {
            type Value = Ordered<V>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                // Room for the usual few keys (serde_json gives no size hint).
                let mut out: Vec<(String, V)> = Vec::with_capacity(4);
                // A few keys are the rule (amounts, scopes): a scan. A 64 KiB
                // body can carry thousands: past a few, a set, so duplicate
                // detection never goes quadratic.
                let mut seen: Option<std::collections::HashSet<String>> = None;
                while let Some(key) = map.next_key::<String>()? {
                    if out.len() == SCAN_KEYS {
                        seen = Some(out.iter().map(|(k, _)| k.clone()).collect());
                    }
                    let repeated = match &mut seen {
                        Some(set) => !set.insert(key.clone()),
                        None => out.iter().any(|(k, _)| *k == key),
                    };
                    if repeated {
                        // serde's own wording, so the error names `{path}.{key}`.
                        return Err(de::Error::custom(format!("duplicate field `{key}`")));
                    }
                    let value = map.next_value::<V>()?;
                    out.push((key, value));
                }
                Ok(Ordered(out))
            }
        }
        d.deserialize_map(V2(PhantomData))
    }
}

/// An amount: a whole number from 0 to 2^53 (JSON numbers above that lose
/// precision in many clients).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Amount(pub u64);

impl<'de> Deserialize<'de> for Amount {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct A;
        impl Visitor<'_> for A {
            type Value = Amount;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "a whole number from 0 to {MAX_AMOUNT}")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Amount, E> {
                if v > MAX_AMOUNT {
                    return Err(E::custom(format!(
                        "{v} is above the largest amount, {MAX_AMOUNT}"
                    )));
                }
                Ok(Amount(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Amount, E> {
                match u64::try_from(v) {
                    Ok(v) => self.visit_u64(v),
                    Err(_) => Err(E::custom(format!("{v} is negative; amounts are 0 or more"))),
                }
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Amount, E> {
                if v.fract() == 0.0 && v.abs() >= MAX_AMOUNT as f64 {
                    Err(E::custom(format!(
                        "{v} is above the largest amount, {MAX_AMOUNT}"
                    )))
                } else {
                    Err(E::custom(format!("{v} is not a whole number")))
                }
            }
        }
        d.deserialize_any(A)
    }
}

/// A signed whole number for admin adjustments (credit > 0, debit < 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SignedAmount(pub i64);

impl<'de> Deserialize<'de> for SignedAmount {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct A;
        impl Visitor<'_> for A {
            type Value = SignedAmount;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "a whole number from -{MAX_AMOUNT} to {MAX_AMOUNT}")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<SignedAmount, E> {
                if v > MAX_AMOUNT {
                    return Err(E::custom(format!("{v} is above {MAX_AMOUNT}")));
                }
                Ok(SignedAmount(v as i64))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<SignedAmount, E> {
                if v.unsigned_abs() > MAX_AMOUNT {
                    return Err(E::custom(format!("{v} is beyond ±{MAX_AMOUNT}")));
                }
                Ok(SignedAmount(v))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<SignedAmount, E> {
                Err(E::custom(format!("{v} is not a whole number in range")))
            }
        }
        d.deserialize_any(A)
    }
}

/// A duration in ms (`ttl_ms`, `wait_ms`): a whole number ≥ 0.
pub type Millis = Amount;

/// `POST /v1/reservations`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReserveBody {
    /// The tenant (always one of the scopes). (Its pattern in the OpenAPI
    /// document comes from the core's limits: `openapi::PatternsAndBounds`.)
    pub tenant: String,
    /// Other scopes by kind: `{"user": "bob", "tool": "search"}`.
    #[serde(default)]
    #[schema(value_type = std::collections::BTreeMap<String, String>)]
    pub scopes: Ordered<String>,
    /// Amounts to hold by dimension.
    #[schema(value_type = std::collections::BTreeMap<String, u64>)]
    pub amounts: Ordered<Amount>,
    /// A model of the model table: prices `cost_micros`.
    #[serde(default)]
    pub model: Option<String>,
    /// Time to live of the hold; the configured default when absent.
    #[serde(default)]
    #[schema(value_type = Option<u64>)]
    pub ttl_ms: Option<Millis>,
    /// Same key, same request → the same reservation.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// Time to wait in the admission queue for room (0: answer at once).
    #[serde(default)]
    #[schema(value_type = Option<u64>)]
    pub wait_ms: Option<Millis>,
    /// Order among one tenant's waiters (higher first).
    #[serde(default)]
    pub priority: Option<i32>,
    /// Free-form labels for the usage log.
    #[serde(default)]
    #[schema(value_type = Option<std::collections::BTreeMap<String, String>>)]
    pub labels: Option<Ordered<String>>,
    /// Answer as a reserve would, hold nothing.
    #[serde(default)]
    pub dry_run: bool,
}

/// One non-token charge of a settle.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChargeBody {
    /// What it was for (`search`).
    pub name: String,
    /// Its cost, added to `cost_micros`.
    #[schema(value_type = u64)]
    pub cost_micros: Amount,
    /// Custom dimensions it counts (`{"search_calls": 1}`).
    #[serde(default)]
    #[schema(value_type = std::collections::BTreeMap<String, u64>)]
    pub amounts: Ordered<Amount>,
}

/// `POST /v1/reservations/{id}/settle`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SettleBody {
    /// Actual usage by dimension; `cached_input_tokens` is the part of
    /// `input_tokens` served from a cache.
    #[schema(value_type = std::collections::BTreeMap<String, u64>)]
    pub usage: Ordered<Amount>,
    /// Non-token costs.
    #[serde(default)]
    pub charges: Vec<ChargeBody>,
}

/// `POST /v1/reservations/{id}/refund` (the body is optional).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RefundBody {}

/// `POST /v1/reservations/{id}/extend`: at least one field.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExtendBody {
    /// Amounts to add to the hold.
    #[serde(default)]
    #[schema(value_type = Option<std::collections::BTreeMap<String, u64>>)]
    pub amounts: Option<Ordered<Amount>>,
    /// A new time to live, from now.
    #[serde(default)]
    #[schema(value_type = Option<u64>)]
    pub ttl_ms: Option<Millis>,
}

/// The longest adjustment `reason`, in bytes.
pub const MAX_REASON_BYTES: usize = 1024;

/// `POST /v1/scopes/{scope}/adjust`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AdjustBody {
    /// The dimension of the scope's `total` limit.
    pub dimension: String,
    /// Credit (> 0: room grows) or debit (< 0).
    #[schema(value_type = i64)]
    pub amount: SignedAmount,
    /// Why (kept for the audit trail): 1 to [`MAX_REASON_BYTES`] bytes, not
    /// only spaces. (Its `maxLength` in the OpenAPI document is set from the
    /// constant: `openapi::PatternsAndBounds`.)
    #[schema(min_length = 1, pattern = r"\S")]
    pub reason: String,
}

/// `PUT /v1/scopes/{scope}`: exactly one of the two.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ScopeOverrideBody {
    /// Move the scope to this plan (a tier change).
    #[serde(default)]
    pub plan: Option<String>,
    /// Give the scope its own limits.
    #[serde(default)]
    pub limits: Option<Vec<allowance_config::LimitSpec>>,
}

/// Amounts by dimension name, in dimension order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AmountsView<'a>(pub SmallVec<[(&'a str, u64); 8]>);

impl Serialize for AmountsView<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        serialize_pairs(&self.0, s)
    }
}

impl<'a> AmountsView<'a> {
    /// `amounts` with the implied `requests: 1` and `concurrent: 1` of a
    /// reservation shown first (when `implied`).
    pub fn of(amounts: &Amounts, catalog: &'a Catalog, implied: &[Dimension]) -> Self {
        // On the stack: every answer builds one or two of these.
        let mut out = SmallVec::new();
        for d in implied {
            out.push((catalog.dimension_name(*d), 1));
        }
        for (d, n) in amounts.iter() {
            if !implied.contains(&d) {
                out.push((catalog.dimension_name(d), n));
            }
        }
        AmountsView(out)
    }
}

/// One limit's room after a grant.
#[derive(Debug, Serialize, ToSchema, PartialEq)]
pub struct RemainingView<'a> {
    /// The scope.
    pub scope: &'a str,
    /// The dimension.
    pub dimension: &'a str,
    /// The window kind.
    pub window: &'static str,
    /// The capacity.
    pub capacity: u64,
    /// Room left after this reservation (negative after an overrun).
    pub remaining: i64,
    /// When room next appears without new traffic.
    #[schema(value_type = Option<String>)]
    pub resets_at: Option<WireTime>,
}

impl<'a> RemainingView<'a> {
    /// From the engine's report.
    pub fn of(r: &'a Remaining) -> Self {
        RemainingView {
            scope: r.scope.as_str(),
            dimension: &r.dimension,
            window: window_name(r.window),
            capacity: r.capacity,
            remaining: r.remaining,
            resets_at: r.resets_at.map(WireTime),
        }
    }
}

/// A reservation as answered by every reservation route.
#[derive(Debug, Serialize, ToSchema, PartialEq)]
pub struct ReservationView<'a> {
    /// `rsv_` + 32 hex digits; absent on a dry run.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub id: Option<WireId>,
    /// `held`, `settled`, `refunded`, `expired` (or `dry_run`).
    pub status: &'static str,
    /// The tenant.
    pub tenant: &'a str,
    /// Canonical scopes, the tenant first, then in the request's order.
    #[schema(value_type = Vec<String>)]
    pub scopes: ScopesView<'a>,
    /// The model named at reserve.
    pub model: Option<&'a str>,
    /// Labels.
    #[schema(value_type = std::collections::BTreeMap<String, String>)]
    pub labels: LabelsView<'a>,
    /// Amounts held (or last held, once ended).
    #[schema(value_type = std::collections::BTreeMap<String, u64>)]
    pub held: AmountsView<'a>,
    /// When it was made.
    #[schema(value_type = String)]
    pub created_at: WireTime,
    /// When the hold expires (or expired).
    #[schema(value_type = String)]
    pub expires_at: WireTime,
    /// When it ended.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub ended_at: Option<WireTime>,
    /// What a settle recorded after the overrun policy.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<std::collections::BTreeMap<String, u64>>)]
    pub charged: Option<AmountsView<'a>>,
    /// Whether it was settled after it expired (present once ended).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub late: Option<bool>,
    /// On an idempotent repeat of a reserve.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replayed: Option<bool>,
    /// Every limit's room after a reserve (reserve answers only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remaining: Option<Vec<RemainingView<'a>>>,
}

/// Labels as a JSON object, in the order sent.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LabelsView<'a>(pub &'a [(String, String)]);

impl Serialize for LabelsView<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        serialize_pairs(self.0, s)
    }
}

const IMPLIED: [Dimension; 2] = [Dimension::REQUESTS, Dimension::CONCURRENT];

/// A JSON string: the bytes as they are when nothing needs escaping (names
/// and statuses: the usual case), else serde_json's own escaping.
/// The bytes serde_json escapes in a string: control characters, `"` and `\`.
static ESCAPED: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        table[b] = true;
        b += 1;
    }
    table[b'"' as usize] = true;
    table[b'\\' as usize] = true;
    table
};

fn json_str(out: &mut Vec<u8>, s: &str) {
    // One table look-up a byte: the names here are short, and a vectorized
    // scan's set-up and tail cost more than the whole of it.
    if !s.bytes().any(|b| ESCAPED[usize::from(b)]) {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        // Writing into a Vec cannot fail, and a &str always serializes.
        let _ = serde_json::to_writer(&mut *out, s);
    }
}

/// A name the ledger validated at the boundary — a scope, a dimension, a
/// status or window kind — which never holds a byte that needs escaping
/// (checked in debug builds): no scan.
fn json_name(out: &mut Vec<u8>, name: &str) {
    debug_assert!(!name.bytes().any(|b| ESCAPED[usize::from(b)]), "{name:?}");
    out.reserve(name.len() + 2);
    out.push(b'"');
    out.extend_from_slice(name.as_bytes());
    out.push(b'"');
}

fn json_time(out: &mut Vec<u8>, t: WireTime) {
    out.push(b'"');
    out.extend_from_slice(&rfc3339_bytes(t.0));
    out.push(b'"');
}

fn json_bool(out: &mut Vec<u8>, b: bool) {
    out.extend_from_slice(if b { b"true" } else { b"false" });
}

fn json_int(out: &mut Vec<u8>, n: impl itoa::Integer) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// `value`, or `null`.
fn json_opt<T>(out: &mut Vec<u8>, value: Option<T>, write: impl FnOnce(&mut Vec<u8>, T)) {
    match value {
        Some(v) => write(out, v),
        None => out.extend_from_slice(b"null"),
    }
}

/// `open`, the items separated by commas, `close`: an array or an object.
fn json_seq<T>(
    out: &mut Vec<u8>,
    [open, close]: [u8; 2],
    items: impl IntoIterator<Item = T>,
    mut write: impl FnMut(&mut Vec<u8>, T),
) {
    out.push(open);
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write(out, item);
    }
    out.push(close);
}

/// An object of string keys, in order.
fn json_object<'k, V>(
    out: &mut Vec<u8>,
    pairs: impl IntoIterator<Item = (&'k str, V)>,
    mut value: impl FnMut(&mut Vec<u8>, V),
) {
    json_seq(out, *b"{}", pairs, |out, (k, v)| {
        json_str(out, k);
        out.push(b':');
        value(out, v);
    });
}

fn json_amounts(out: &mut Vec<u8>, a: &AmountsView<'_>) {
    // Dimension names are validated identifiers.
    json_seq(out, *b"{}", a.0.iter().copied(), |out, (k, v)| {
        json_name(out, k);
        out.push(b':');
        json_int(out, v);
    });
}

impl ReservationView<'_> {
    /// The view as JSON, byte for byte what its `Serialize` writes (a test
    /// holds them equal), written by hand: every reservation route
    /// answers one, and serde writes each key through its string escaper
    /// (a profile of `allowance bench` put serializing at ~6% of the
    /// server's CPU).
    pub fn to_json(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1024);
        out.push(b'{');
        if let Some(id) = self.id {
            out.extend_from_slice(b"\"id\":\"");
            out.extend_from_slice(&id.0.to_ascii());
            out.extend_from_slice(b"\",");
        }
        out.extend_from_slice(b"\"status\":");
        json_name(&mut out, self.status);
        out.extend_from_slice(b",\"tenant\":");
        json_name(&mut out, self.tenant);
        out.extend_from_slice(b",\"scopes\":");
        json_seq(&mut out, *b"[]", self.scopes.0, |out, k| {
            json_name(out, k.as_str())
        });
        out.extend_from_slice(b",\"model\":");
        json_opt(&mut out, self.model, json_str);
        out.extend_from_slice(b",\"labels\":");
        json_object(
            &mut out,
            self.labels.0.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            json_str,
        );
        out.extend_from_slice(b",\"held\":");
        json_amounts(&mut out, &self.held);
        out.extend_from_slice(b",\"created_at\":");
        json_time(&mut out, self.created_at);
        out.extend_from_slice(b",\"expires_at\":");
        json_time(&mut out, self.expires_at);
        if let Some(t) = self.ended_at {
            out.extend_from_slice(b",\"ended_at\":");
            json_time(&mut out, t);
        }
        if let Some(c) = &self.charged {
            out.extend_from_slice(b",\"charged\":");
            json_amounts(&mut out, c);
        }
        if let Some(late) = self.late {
            out.extend_from_slice(b",\"late\":");
            json_bool(&mut out, late);
        }
        if let Some(replayed) = self.replayed {
            out.extend_from_slice(b",\"replayed\":");
            json_bool(&mut out, replayed);
        }
        if let Some(list) = &self.remaining {
            out.extend_from_slice(b",\"remaining\":");
            json_seq(&mut out, *b"[]", list, |out, r| {
                out.extend_from_slice(b"{\"scope\":");
                json_name(out, r.scope);
                out.extend_from_slice(b",\"dimension\":");
                json_name(out, r.dimension);
                out.extend_from_slice(b",\"window\":");
                json_name(out, r.window);
                out.extend_from_slice(b",\"capacity\":");
                json_int(out, r.capacity);
                out.extend_from_slice(b",\"remaining\":");
                json_int(out, r.remaining);
                out.extend_from_slice(b",\"resets_at\":");
                json_opt(out, r.resets_at, json_time);
                out.push(b'}');
            });
        }
        out.push(b'}');
        out
    }
}

impl axum::response::IntoResponse for ReservationView<'_> {
    /// 200 with the JSON (built directly: axum's `Vec<u8>` answer sets an
    /// octet-stream type that would then be replaced).
    fn into_response(self) -> axum::response::Response {
        let mut answer = axum::response::Response::new(axum::body::Body::from(self.to_json()));
        answer.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        );
        answer
    }
}

impl<'a> ReservationView<'a> {
    /// A reservation as read back.
    pub fn of(r: &'a Reservation, catalog: &'a Catalog) -> Self {
        let ended = r.ended_at.is_some();
        ReservationView {
            id: Some(WireId(r.id)),
            status: r.status.as_str(),
            tenant: r.scopes.tenant_name(),
            scopes: ScopesView(r.scopes.as_slice()),
            model: r.model.as_deref(),
            labels: LabelsView(r.labels.as_deref().unwrap_or_default()),
            held: AmountsView::of(&r.held, catalog, &IMPLIED),
            created_at: WireTime(r.created_at),
            expires_at: WireTime(r.expires_at),
            ended_at: r.ended_at.map(WireTime),
            charged: r
                .charged
                .as_ref()
                .map(|c| AmountsView::of(c, catalog, &[Dimension::REQUESTS])),
            late: ended.then_some(r.late),
            replayed: None,
            remaining: None,
        }
    }

    /// A fresh grant or a dry run of `req` (a replay is answered from the
    /// stored reservation instead).
    pub fn granted(
        g: &'a Granted,
        req: &'a allowance_core::ReserveRequest,
        catalog: &'a Catalog,
    ) -> Self {
        ReservationView {
            id: (!g.dry_run).then_some(WireId(g.id)),
            status: if g.dry_run {
                "dry_run"
            } else {
                g.status.as_str()
            },
            tenant: req.scopes.tenant_name(),
            scopes: ScopesView(req.scopes.as_slice()),
            model: req.model.as_deref(),
            labels: LabelsView(req.labels.as_deref().unwrap_or_default()),
            held: AmountsView::of(&g.held, catalog, &IMPLIED),
            created_at: WireTime(g.created_at),
            expires_at: WireTime(g.expires_at),
            ended_at: None,
            charged: None,
            late: None,
            replayed: None,
            remaining: Some(g.remaining.iter().map(RemainingView::of).collect()),
        }
    }
}

/// One limit of a scope's status.
#[derive(Debug, Serialize, ToSchema, PartialEq)]
pub struct LimitStatusView {
    /// The dimension.
    pub dimension: String,
    /// The window kind.
    pub window: &'static str,
    /// Sliding and bucket windows: their length.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period_ms: Option<u64>,
    /// Sliding windows: the number of slices.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slices: Option<u32>,
    /// Calendar windows: minute, hour, day, week or month.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unit: Option<&'static str>,
    /// Calendar windows: the zone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// The capacity.
    pub capacity: u64,
    /// Usage in the window.
    pub used: i64,
    /// Held by live reservations.
    pub held: u64,
    /// `capacity − used − held` (negative after an overrun).
    pub remaining: i64,
    /// When room next appears without new traffic.
    pub resets_at: Option<String>,
}

/// `GET /v1/scopes/{scope}`.
#[derive(Debug, Serialize, ToSchema, PartialEq)]
pub struct ScopeStatusView {
    /// The canonical scope.
    pub scope: String,
    /// Its plan (`override` when it has its own limits).
    pub plan: String,
    /// HELD reservations on it.
    pub held_reservations: u64,
    /// Every limit of its plan.
    pub limits: Vec<LimitStatusView>,
}

impl ScopeStatusView {
    /// From the engine's status.
    pub fn of(s: &ScopeStatus) -> Self {
        ScopeStatusView {
            scope: s.scope.as_str().to_string(),
            plan: s.plan.clone(),
            held_reservations: s.held_reservations,
            limits: s
                .limits
                .iter()
                .map(|l| {
                    let (period_ms, slices, unit, zone) = match &l.window {
                        Window::Sliding { period_ms, slices } => {
                            (Some(*period_ms), Some(*slices), None, None)
                        }
                        Window::Bucket { period_ms } => (Some(*period_ms), None, None, None),
                        Window::Calendar { unit, zone } => (
                            None,
                            None,
                            Some(unit.as_str()),
                            Some(zone.name().to_string()),
                        ),
                        Window::Total | Window::Concurrent => (None, None, None, None),
                    };
                    LimitStatusView {
                        dimension: l.dimension.clone(),
                        window: window_name(l.window.kind()),
                        period_ms,
                        slices,
                        unit,
                        zone,
                        capacity: l.capacity,
                        used: l.used,
                        held: l.held,
                        remaining: l.remaining,
                        resets_at: l.resets_at.map(rfc3339),
                    }
                })
                .collect(),
        }
    }
}

/// Amounts named by dimension → the engine's `Amounts`. An unknown
/// dimension is an error naming `{field}.{name}`.
pub fn amounts_of(
    list: &Ordered<Amount>,
    catalog: &Catalog,
    field: &str,
) -> Result<Amounts, Invalid> {
    let mut out = Amounts::new();
    for (name, Amount(n)) in &list.0 {
        let Some(d) = catalog.dimension(name) else {
            return Err(Invalid::new(
                format!("{field}.{name}"),
                format!("unknown dimension {name:?}"),
            ));
        };
        out.set(d, *n);
    }
    Ok(out)
}

/// Refuses a value of an implied dimension that contradicts it: a
/// reservation is `requests` 1 and, while held, `concurrent` 1 (SEMANTICS),
/// so a reserve's `amounts` or a settle's `usage` may say 1 (a `held` sent
/// back as it was read) and nothing else, and an extend's `amounts` (added
/// to the hold) neither. Silently replacing `"requests": 5` by 1 would let
/// a misunderstanding pass.
pub fn check_implied(list: &Ordered<Amount>, field: &str, may_be_one: bool) -> Result<(), Invalid> {
    for (name, Amount(n)) in &list.0 {
        let what = match name.as_str() {
            "requests" => "1 per reservation",
            "concurrent" => "1 per held reservation",
            _ => continue,
        };
        let n = *n;
        if n != 0 && !(may_be_one && n == 1) {
            return Err(Invalid::new(
                format!("{field}.{name}"),
                format!("`{name}` is implied ({what}): leave it out, got {n}"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_keys_are_found_past_the_scan() {
        let object = |keys: &[String]| {
            let fields: Vec<String> = keys.iter().map(|k| format!("\"{k}\": \"v\"")).collect();
            format!("{{{}}}", fields.join(", "))
        };
        let mut keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
        let ok: Ordered<String> = serde_json::from_str(&object(&keys)).unwrap();
        assert_eq!(ok.0.len(), 40);
        assert_eq!(ok.0[39].0, "k39", "order kept");
        for repeat_at in [5, SCAN_KEYS, 39] {
            keys[repeat_at] = "k3".into();
            let e = serde_json::from_str::<Ordered<String>>(&object(&keys)).unwrap_err();
            assert!(e.to_string().contains("duplicate field `k3`"), "{e}");
            keys[repeat_at] = format!("k{repeat_at}");
        }
    }

    #[test]
    fn rfc3339_matches_jiff_everywhere() {
        // Epoch, leap days, century rules, the ends of months and years,
        // and a spread of instants up to year 9999.
        let mut cases = vec![
            0u64,
            951_782_400_000,   // 2000-02-29
            4_107_542_399_999, // 2100-02-28T23:59:59.999
            4_107_542_400_000, // 2100-03-01
            1_700_000_000_123,
            253_402_207_200_000, // jiff's last instant, 9999-12-30T22:00
        ];
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            cases.push(x % 253_402_207_200_001);
        }
        for ms in cases {
            let want = jiff::Timestamp::from_millisecond(ms as i64)
                .unwrap()
                .strftime("%Y-%m-%dT%H:%M:%S%.3fZ")
                .to_string();
            assert_eq!(rfc3339(Timestamp::from_millis(ms)), want, "{ms}");
            assert_eq!(
                serde_json::to_string(&WireTime(Timestamp::from_millis(ms))).unwrap(),
                format!("\"{want}\""),
                "{ms}"
            );
        }
        assert_eq!(
            rfc3339(Timestamp::from_millis(253_402_300_799_999)),
            "9999-12-31T23:59:59.999Z"
        );
        assert_eq!(
            rfc3339(Timestamp::from_millis(u64::MAX)),
            "9999-12-31T23:59:59.999Z"
        );
    }

    #[test]
    fn wire_ids_read_as_their_display() {
        let mut x: u128 = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210;
        for n in [0, 1, 0xf, u128::MAX]
            .into_iter()
            .chain((0..10_000).map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            }))
        {
            let id = ReservationId(n);
            assert_eq!(id.to_string(), format!("rsv_{n:032x}"));
            assert_eq!(
                serde_json::to_string(&WireId(id)).unwrap(),
                format!("\"{id}\"")
            );
            assert_eq!(ReservationId::parse(&id.to_string()), Some(id));
        }
    }

    proptest::proptest! {
        /// The hand-written JSON of a reservation is serde's, byte for
        /// byte, whatever the strings hold (quotes, backslashes, control
        /// characters, any Unicode) and whichever fields are present.
        #[test]
        fn reservation_json_is_serdes(
            id in proptest::option::of(proptest::num::u128::ANY),
            status in proptest::sample::select(vec!["held", "settled", "refunded", "expired", "dry_run"]),
            tenant in "[a-z0-9_.-]{1,12}",
            users in proptest::collection::vec("[a-z0-9_.-]{1,12}", 0..3),
            model in proptest::option::of(proptest::prelude::any::<String>()),
            labels in proptest::collection::vec((proptest::prelude::any::<String>(), proptest::prelude::any::<String>()), 0..4),
            held in proptest::collection::vec(("[a-z_]{1,10}", proptest::prelude::any::<u64>()), 0..6),
            charged in proptest::option::of(proptest::collection::vec(("[a-z_]{1,10}", proptest::prelude::any::<u64>()), 0..6)),
            times in proptest::collection::vec(0..300_000_000_000_000u64, 3),
            ended in proptest::prelude::any::<bool>(),
            late in proptest::option::of(proptest::prelude::any::<bool>()),
            replayed in proptest::option::of(proptest::prelude::any::<bool>()),
            remaining in proptest::option::of(proptest::collection::vec(
                ("[a-z_]{1,10}", proptest::prelude::any::<u64>(), proptest::prelude::any::<i64>(), proptest::option::of(0..300_000_000_000_000u64)),
                0..5,
            )),
        ) {
            let mut keys = vec![ScopeKey::tenant(&tenant).unwrap()];
            for u in &users {
                keys.push(ScopeKey::new(&tenant, "user", u, false, "scopes.user").unwrap());
            }
            let view = ReservationView {
                id: id.map(|n| WireId(ReservationId(n))),
                status,
                tenant: &tenant,
                scopes: ScopesView(&keys),
                model: model.as_deref(),
                labels: LabelsView(&labels),
                held: AmountsView(held.iter().map(|(k, n)| (k.as_str(), *n)).collect()),
                created_at: WireTime(Timestamp::from_millis(times[0])),
                expires_at: WireTime(Timestamp::from_millis(times[1])),
                ended_at: ended.then(|| WireTime(Timestamp::from_millis(times[2]))),
                charged: charged
                    .as_ref()
                    .map(|c| AmountsView(c.iter().map(|(k, n)| (k.as_str(), *n)).collect())),
                late,
                replayed,
                remaining: remaining.as_ref().map(|list| {
                    list.iter()
                        .zip(keys.iter().cycle())
                        .map(|((dim, cap, room, at), key)| RemainingView {
                            scope: key.as_str(),
                            dimension: dim,
                            window: "sliding",
                            capacity: *cap,
                            remaining: *room,
                            resets_at: at.map(|ms| WireTime(Timestamp::from_millis(ms))),
                        })
                        .collect()
                }),
            };
            let by_hand = String::from_utf8(view.to_json()).unwrap();
            let by_serde = serde_json::to_string(&view).unwrap();
            proptest::prop_assert_eq!(by_hand, by_serde);
        }
    }
}
