//! What crosses to the script and back: MessagePack maps with short field
//! names (the script in `ledger.lua` documents them), and their conversions
//! from and to the engine's types.

use std::collections::BTreeMap;
use std::fmt;

use allowance_core::calendar::window_bounds;
use allowance_core::{
    Amounts, Catalog, Dimension, Limit, OverrunPolicy, Reservation, ReservationId, ScopeKey,
    ScopeSet, Status, Timestamp, Window,
};
use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

/// Amounts by dimension name (how the script and records keep them).
pub(crate) type NamedAmounts = BTreeMap<String, u64>;

/// A request to the script; absent fields are nil there.
#[derive(Serialize, Default)]
pub(crate) struct Req<'a> {
    pub op: &'a str,
    pub p: &'a str,
    /// On a cluster: usage streams per group.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub cl: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub now: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cv: Option<u64>,
    /// Retention of ended reservations and of idempotency keys, ms.
    pub re: u64,
    pub ri: u64,
    /// The usage stream's approximate length bound.
    pub um: u64,
    /// The tenant group's key base.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub b: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tn: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ik: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fp: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dry: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rr: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub h: Option<NamedAmounts>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rec: Option<Rec>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub scopes: Vec<ScopeSpec>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub v: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub c: Option<NamedAmounts>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub d: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credit: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub change: Option<String>,
    /// A usage read: the first stream id (XRANGE syntax) and how many.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n: Option<u64>,
    /// fend: `settle` or `release`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fin: Option<&'static str>,
    /// fend of an import: the instant the usage happened (ms).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at: Option<u64>,
    /// fextend: take back a raise, restoring the expiry `ox`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub undo: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ox: Option<u64>,
}

/// A scope and its current plan's limits, resolved by the Rust side.
#[derive(Serialize, Clone, Debug)]
pub(crate) struct ScopeSpec {
    /// The canonical name.
    pub n: String,
    /// Its key base (the tenant group's, or its own for a shared scope).
    pub b: String,
    pub lims: Vec<LimSpec>,
}

/// One limit as the script needs it.
#[derive(Serialize, Clone, Debug)]
#[allow(non_snake_case)]
pub(crate) struct LimSpec {
    /// Dimension and window: what keeps a window's history across plan changes.
    pub id: String,
    /// The dimension's name.
    pub d: String,
    /// An implied dimension (`requests`, `concurrent`): its hold is the count of holds.
    pub im: bool,
    /// Capacity.
    pub c: u64,
    /// s(liding), b(ucket), c(alendar), t(otal), n (concurrent).
    pub k: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub w: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub P: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cs: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ce: Option<u64>,
    /// What the operation asks of this limit (reserve, extend).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub q: Option<u64>,
    /// What a settle records on it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub a: Option<u64>,
}

impl LimSpec {
    /// The spec of `limit`, calendar bounds taken at `now_ms`.
    pub(crate) fn of(catalog: &Catalog, limit: &Limit, now_ms: u64) -> LimSpec {
        let dim = limit.dimension();
        let d = catalog.dimension_name(dim).to_string();
        let mut s = LimSpec {
            id: String::new(),
            d,
            im: dim.is_implied(),
            c: limit.capacity(),
            k: "n",
            w: None,
            n: None,
            P: None,
            cs: None,
            ce: None,
            q: None,
            a: None,
        };
        let window = match limit.window() {
            Window::Sliding { period_ms, slices } => {
                s.k = "s";
                s.w = Some(period_ms / u64::from(*slices));
                s.n = Some(u64::from(*slices));
                format!("s{period_ms}/{slices}")
            }
            Window::Bucket { period_ms } => {
                s.k = "b";
                s.P = Some(*period_ms);
                format!("b{period_ms}")
            }
            Window::Calendar { unit, zone } => {
                s.k = "c";
                let (start, end) = window_bounds(*unit, zone, now_ms);
                s.cs = Some(start);
                s.ce = Some(end);
                format!("c{}/{}", unit.as_str(), zone.name())
            }
            Window::Total => {
                s.k = "t";
                "t".to_string()
            }
            Window::Concurrent => "n".to_string(),
        };
        s.id = format!("{}|{window}", s.d);
        s
    }
}

/// A reservation record as the script keeps it.
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub(crate) struct Rec {
    pub id: String,
    /// held | settled | refunded | expired (set by the script).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub st: String,
    /// Scope names, the tenant first, and their key bases.
    pub sc: Vec<String>,
    pub sb: Vec<String>,
    /// The tenant's name.
    pub tn: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub m: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lb: Option<Vec<(String, String)>>,
    #[serde(deserialize_with = "named_amounts")]
    pub h: NamedAmounts,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cr: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e: Option<u64>,
    #[serde(
        default,
        deserialize_with = "opt_named_amounts",
        skip_serializing_if = "Option::is_none"
    )]
    pub c: Option<NamedAmounts>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub late: Option<bool>,
    /// The overrun policy: `charge_actual`, `cap_at_estimate`, `allow_overrun:<percent>`.
    pub ov: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ik: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp: Option<String>,
    /// Bumped by every extend: a settle's charges were worked out from one version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub v: Option<u64>,
}

/// A denial as the script reports it (indexes 1-based).
#[derive(Deserialize, Debug, Clone)]
pub(crate) struct DenyOut {
    pub kind: String,
    pub ra: Option<u64>,
    pub s: usize,
    pub l: usize,
    pub cap: u64,
    pub rem: i64,
    pub q: u64,
    pub rs: Option<u64>,
}

/// One limit's use, hold and reset.
#[derive(Deserialize, Debug, Clone, Copy)]
pub(crate) struct LimOut {
    pub u: i64,
    pub h: u64,
    pub r: Option<u64>,
}

/// The script's answer.
#[derive(Deserialize, Debug, Default)]
pub(crate) struct Reply {
    pub t: String,
    pub now: Option<u64>,
    pub rec: Option<Rec>,
    pub replay: Option<bool>,
    pub dry: Option<bool>,
    pub x: Option<u64>,
    #[serde(default, deserialize_with = "opt_nested")]
    pub rem: Option<Vec<Vec<LimOut>>>,
    pub d: Option<DenyOut>,
    pub st: Option<String>,
    pub hc: Option<u64>,
}

/// An adjustment as the usage stream keeps it.
#[derive(Deserialize, Debug)]
pub(crate) struct AdjOut {
    pub s: String,
    pub d: String,
    pub c: i64,
    pub w: String,
}

/// A status the script wrote, or an error naming what it was.
pub(crate) fn status_of(st: &str) -> Result<Status, String> {
    match st {
        "held" => Ok(Status::Held),
        "settled" => Ok(Status::Settled),
        "refunded" => Ok(Status::Refunded),
        "expired" => Ok(Status::Expired),
        other => Err(format!("a record with status {other:?}")),
    }
}

pub(crate) fn overrun_name(p: OverrunPolicy) -> String {
    match p {
        OverrunPolicy::AllowOverrun { percent } => format!("allow_overrun:{percent}"),
        other => other.as_str().to_string(),
    }
}

fn overrun_of(s: &str) -> Result<OverrunPolicy, String> {
    match s {
        "charge_actual" => Ok(OverrunPolicy::ChargeActual),
        "cap_at_estimate" => Ok(OverrunPolicy::CapAtEstimate),
        _ => s
            .strip_prefix("allow_overrun:")
            .and_then(|p| p.parse().ok())
            .map(|percent| OverrunPolicy::AllowOverrun { percent })
            .ok_or_else(|| format!("an overrun policy {s:?}")),
    }
}

/// Amounts by name (implied dimensions are never stored).
pub(crate) fn named(catalog: &Catalog, a: &Amounts) -> NamedAmounts {
    a.iter()
        .filter(|(d, _)| !d.is_implied())
        .map(|(d, v)| (catalog.dimension_name(d).to_string(), v))
        .collect()
}

pub(crate) fn amounts_of(catalog: &Catalog, m: &NamedAmounts) -> Result<Amounts, String> {
    let mut a = Amounts::new();
    for (name, v) in m {
        let d = catalog
            .dimension(name)
            .ok_or_else(|| format!("a dimension {name:?} this catalog does not have"))?;
        a.set(d, *v);
    }
    Ok(a)
}

impl Rec {
    /// The engine's view of the record.
    pub(crate) fn reservation(&self, catalog: &Catalog) -> Result<Reservation, String> {
        let id = ReservationId::parse(&self.id).ok_or_else(|| format!("an id {:?}", self.id))?;
        let keys = self
            .sc
            .iter()
            .map(|s| ScopeKey::parse(s).map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        let scopes = ScopeSet::from_keys(keys).map_err(|e| e.to_string())?;
        Ok(Reservation {
            id,
            status: status_of(&self.st)?,
            scopes,
            model: self.m.as_deref().map(Into::into),
            labels: self.lb.clone().map(Into::into),
            held: amounts_of(catalog, &self.h)?,
            created_at: Timestamp::from_millis(self.cr.unwrap_or(0)),
            expires_at: Timestamp::from_millis(self.x.unwrap_or(0)),
            ended_at: self.e.map(Timestamp::from_millis),
            charged: self
                .c
                .as_ref()
                .map(|c| amounts_of(catalog, c))
                .transpose()?,
            late: self.late.unwrap_or(false),
            overrun: overrun_of(&self.ov)?,
            idempotency_key: self.ik.as_deref().map(Into::into),
        })
    }
}

/// What a reserve's idempotency key binds: the scopes (as a set), the
/// amounts as sent, and the model.
pub(crate) fn fingerprint(
    catalog: &Catalog,
    scopes: &ScopeSet,
    amounts: &Amounts,
    model: Option<&str>,
) -> String {
    let mut names: Vec<&str> = scopes.as_slice().iter().map(ScopeKey::as_str).collect();
    names.sort_unstable();
    let amounts: Vec<(String, u64)> = amounts
        .iter()
        .map(|(d, v)| (catalog.dimension_name(d).to_string(), v))
        .collect();
    serde_json::json!([names, amounts, model]).to_string()
}

/// What a settle records on a limit of `dim`: 1 request, nothing on the
/// gauge, else the charged amount.
pub(crate) fn recorded(dim: Dimension, charged: &Amounts) -> u64 {
    match dim {
        Dimension::REQUESTS => 1,
        Dimension::CONCURRENT => 0,
        d => charged.get(d),
    }
}

// The script's MessagePack writes an empty table as an empty array: maps
// read from it accept that too.

struct NamedVisitor;

impl<'de> Visitor<'de> for NamedVisitor {
    type Value = NamedAmounts;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("amounts by dimension name")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<NamedAmounts, A::Error> {
        let mut out = NamedAmounts::new();
        while let Some((k, v)) = map.next_entry::<String, u64>()? {
            out.insert(k, v);
        }
        Ok(out)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<NamedAmounts, A::Error> {
        if seq.next_element::<de::IgnoredAny>()?.is_some() {
            return Err(de::Error::custom("amounts: a non-empty list"));
        }
        Ok(NamedAmounts::new())
    }
}

fn named_amounts<'de, D: Deserializer<'de>>(d: D) -> Result<NamedAmounts, D::Error> {
    d.deserialize_any(NamedVisitor)
}

fn opt_named_amounts<'de, D: Deserializer<'de>>(d: D) -> Result<Option<NamedAmounts>, D::Error> {
    d.deserialize_any(NamedVisitor).map(Some)
}

fn opt_nested<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<Vec<LimOut>>>, D::Error> {
    Vec::<Vec<LimOut>>::deserialize(d).map(Some)
}
