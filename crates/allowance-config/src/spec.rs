//! The JSON shapes of a limit and a plan (HTTP-API.md "A limit in JSON"),
//! shared by the admin API and the configuration file: one validation path,
//! so a plan the file accepts is a plan `PUT /v1/plans/{name}` accepts.

use std::sync::Arc;

use allowance_core::{
    CalendarUnit, Catalog, DEFAULT_SLICES, Dimension, Invalid, Limit, OverrunPolicy, Plan, Window,
    WindowKind, Zone,
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::duration::parse_duration_ms;

/// The window names, in the order error messages list them.
pub(crate) const WINDOW_NAMES: &str = r#""sliding", "bucket", "calendar", "total", "concurrent""#;
/// The calendar units, in the order error messages list them.
pub(crate) const UNIT_NAMES: &str = r#""minute", "hour", "day", "week", "month""#;
/// The overrun policies, in the order error messages list them.
pub(crate) const OVERRUN_NAMES: &str = r#""charge_actual", "cap_at_estimate", "allow_overrun""#;
/// `overrun_percent` when `overrun = "allow_overrun"` names none (CONFIG.md answer 3).
pub const DEFAULT_OVERRUN_PERCENT: u32 = 10;

/// One limit, as JSON and as a TOML inline table:
/// `{"dimension": "tokens", "capacity": 1000000, "window": "sliding", "period_ms": 3600000, "slices": 60}`.
///
/// Strings rather than enums for `window`, `unit` and `zone`, so that a bad
/// value is reported by [`limit_from_spec`] naming its field
/// (`limits[2].window: expected one of …`) instead of by the JSON decoder.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitSpec {
    /// What is counted: `requests`, `concurrent`, `input_tokens`,
    /// `output_tokens`, `tokens`, `cost_micros`, or a custom dimension
    /// (`[a-z][a-z0-9_]{0,31}`, registered on first use).
    #[schema(example = "tokens")]
    pub dimension: String,
    /// The ceiling, 1 to 2^53.
    #[schema(example = 1_000_000)]
    pub capacity: u64,
    /// `sliding`, `bucket`, `calendar`, `total` or `concurrent`; absent only
    /// for the dimension `concurrent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(example = "sliding")]
    pub window: Option<String>,
    /// Length of a sliding window or a bucket's refill time, in ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(example = 3_600_000)]
    pub period_ms: Option<u64>,
    /// The same as a duration string (`"90s"`, `"1h"`, `"24h"`); give
    /// either this or `period_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period: Option<String>,
    /// Slices of a sliding window (default 60); `period_ms` is a multiple of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slices: Option<u32>,
    /// Calendar unit: `minute`, `hour`, `day`, `week` (from Monday) or `month`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
    /// IANA zone of a calendar window (default `UTC`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// Concurrency guaranteed to each tenant in a shared scope (concurrent
    /// limits only, at most `capacity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guaranteed: Option<u64>,
}

/// A plan, as JSON (`PUT /v1/plans/{name}`) and as a `[plans.NAME]` table.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PlanSpec {
    /// The limits, in order (the order breaks ties between denials).
    /// Required: an empty list is a plan with no limits.
    pub limits: Vec<LimitSpec>,
    /// `charge_actual` (default), `cap_at_estimate` or `allow_overrun`;
    /// read from the tenant's plan only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(example = "charge_actual")]
    pub overrun: Option<String>,
    /// Tolerated overrun in percent (`allow_overrun` only; default 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overrun_percent: Option<u32>,
    /// The tenant's share in the admission queue, 1 to 1000 (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_weight: Option<u32>,
}

/// `field.sub`, or `sub` when `field` is empty.
pub(crate) fn join(field: &str, sub: &str) -> String {
    if field.is_empty() {
        sub.to_string()
    } else {
        format!("{field}.{sub}")
    }
}

/// The rule of custom dimension names (the one `Catalog::add_dimension`
/// applies), checked before anything is registered.
fn valid_dimension_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 32
        && b[0].is_ascii_lowercase()
        && b.iter()
            .all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_')
}

/// Builds a validated limit from its JSON shape. Errors name the field under
/// `field` (`limits[2].window`). A custom dimension is registered in the
/// catalog, and only once the limit is known to be valid: a refusal changes
/// nothing.
///
/// ```
/// use allowance_config::{LimitSpec, limit_from_spec};
/// use allowance_core::Catalog;
/// let mut catalog = Catalog::default();
/// let spec: LimitSpec = serde_json::from_str(
///     r#"{"dimension": "requests", "capacity": 60, "window": "bucket", "period": "1m"}"#).unwrap();
/// let limit = limit_from_spec(&spec, &mut catalog, "limits[0]").unwrap();
/// assert_eq!(limit.window().period_ms(), Some(60_000));
/// let bad = LimitSpec { window: Some("weekly".into()), ..spec };
/// assert_eq!(limit_from_spec(&bad, &mut catalog, "limits[0]").unwrap_err().field, "limits[0].window");
/// ```
pub fn limit_from_spec(
    spec: &LimitSpec,
    catalog: &mut Catalog,
    field: &str,
) -> Result<Limit, Invalid> {
    let known = catalog.dimension(&spec.dimension);
    if known.is_none() && !valid_dimension_name(&spec.dimension) {
        return Err(Invalid::new(
            join(field, "dimension"),
            format!(
                "{:?} is neither a built-in dimension (requests, concurrent, input_tokens, \
                 output_tokens, tokens, cost_micros) nor a valid custom name \
                 ([a-z][a-z0-9_]{{0,31}})",
                spec.dimension
            ),
        ));
    }
    match known {
        Some(dim) => build_limit(spec, dim, field),
        None => {
            // Validate with a stand-in: only `concurrent` is special to
            // `Limit::new`, and a custom dimension never is it.
            build_limit(spec, Dimension::TOKENS, field)?;
            let dim = catalog
                .add_dimension(&spec.dimension)
                .map_err(|e| Invalid::new(join(field, "dimension"), e.message))?;
            build_limit(spec, dim, field)
        }
    }
}

fn parse_window_kind(name: &str) -> Option<WindowKind> {
    Some(match name {
        "sliding" => WindowKind::Sliding,
        "bucket" => WindowKind::Bucket,
        "calendar" => WindowKind::Calendar,
        "total" => WindowKind::Total,
        "concurrent" => WindowKind::Concurrent,
        _ => return None,
    })
}

fn build_limit(spec: &LimitSpec, dim: Dimension, field: &str) -> Result<Limit, Invalid> {
    let at = |sub: &str| join(field, sub);
    let kind = match spec.window.as_deref() {
        None if dim == Dimension::CONCURRENT => WindowKind::Concurrent,
        None => {
            return Err(Invalid::new(
                at("window"),
                format!(
                    "required for dimension {:?}: expected one of {WINDOW_NAMES}",
                    spec.dimension
                ),
            ));
        }
        Some(name) => parse_window_kind(name).ok_or_else(|| {
            Invalid::new(
                at("window"),
                format!("expected one of {WINDOW_NAMES}, got {name:?}"),
            )
        })?,
    };
    // The name the caller used for the period, so errors name that key.
    let (period_ms, period_key) = match (spec.period_ms, spec.period.as_deref()) {
        (Some(_), Some(_)) => {
            return Err(Invalid::new(
                at("period"),
                "give either `period` (a string such as \"1h\") or `period_ms`, not both",
            ));
        }
        (Some(ms), None) => (Some(ms), "period_ms"),
        (None, Some(text)) => (
            Some(parse_duration_ms(text).map_err(|m| Invalid::new(at("period"), m))?),
            "period",
        ),
        (None, None) => (None, "period"),
    };
    let takes_no = |key: &str| {
        Err(Invalid::new(
            at(key),
            format!("a {kind} window takes no `{key}`"),
        ))
    };
    let needs_period = || {
        Invalid::new(
            at("period"),
            format!("a {kind} window needs `period` (such as \"1h\") or `period_ms`"),
        )
    };
    if period_ms.is_some() && !matches!(kind, WindowKind::Sliding | WindowKind::Bucket) {
        return takes_no(period_key);
    }
    if spec.slices.is_some() && kind != WindowKind::Sliding {
        return takes_no("slices");
    }
    if kind != WindowKind::Calendar {
        if spec.unit.is_some() {
            return takes_no("unit");
        }
        if spec.zone.is_some() {
            return takes_no("zone");
        }
    }
    if spec.guaranteed.is_some() && kind != WindowKind::Concurrent {
        return takes_no("guaranteed");
    }
    let window = match kind {
        WindowKind::Sliding => Window::Sliding {
            period_ms: period_ms.ok_or_else(needs_period)?,
            slices: spec.slices.unwrap_or(DEFAULT_SLICES),
        },
        WindowKind::Bucket => Window::Bucket {
            period_ms: period_ms.ok_or_else(needs_period)?,
        },
        WindowKind::Calendar => {
            let unit_name = spec.unit.as_deref().ok_or_else(|| {
                Invalid::new(
                    at("unit"),
                    format!("a calendar window needs a unit: expected one of {UNIT_NAMES}"),
                )
            })?;
            let unit = CalendarUnit::parse(unit_name).ok_or_else(|| {
                Invalid::new(
                    at("unit"),
                    format!("expected one of {UNIT_NAMES}, got {unit_name:?}"),
                )
            })?;
            let zone = match spec.zone.as_deref() {
                None => Zone::utc(),
                Some(name) => Zone::named(name).map_err(|e| {
                    Invalid::new(
                        at("zone"),
                        format!("{e} (expected an IANA name such as \"Europe/Paris\", or \"UTC\")"),
                    )
                })?,
            };
            Window::Calendar { unit, zone }
        }
        WindowKind::Total => Window::Total,
        WindowKind::Concurrent => Window::Concurrent,
    };
    let limit = Limit::new(dim, spec.capacity, window).map_err(|e| {
        // The engine names the period `period_ms`; name the key the caller wrote.
        let sub = if e.field == "period_ms" {
            period_key
        } else {
            e.field.as_str()
        };
        Invalid::new(at(sub), e.message)
    })?;
    match spec.guaranteed {
        None => Ok(limit),
        Some(g) => limit
            .with_guaranteed(g)
            .map_err(|e| Invalid::new(at(&e.field), e.message)),
    }
}

/// The overrun policy of a plan spec; errors name `overrun` or
/// `overrun_percent` under `field`.
fn overrun_from_spec(spec: &PlanSpec, field: &str) -> Result<OverrunPolicy, Invalid> {
    let policy = match spec.overrun.as_deref() {
        None | Some("charge_actual") => OverrunPolicy::ChargeActual,
        Some("cap_at_estimate") => OverrunPolicy::CapAtEstimate,
        Some("allow_overrun") => OverrunPolicy::AllowOverrun {
            percent: spec.overrun_percent.unwrap_or(DEFAULT_OVERRUN_PERCENT),
        },
        Some(other) => {
            return Err(Invalid::new(
                join(field, "overrun"),
                format!("expected one of {OVERRUN_NAMES}, got {other:?}"),
            ));
        }
    };
    if spec.overrun_percent.is_some() && !matches!(policy, OverrunPolicy::AllowOverrun { .. }) {
        return Err(Invalid::new(
            join(field, "overrun_percent"),
            "only with overrun = \"allow_overrun\"",
        ));
    }
    Ok(policy)
}

/// Assembles a plan from limits already built (errors name `field.…`).
pub(crate) fn assemble_plan(
    name: &str,
    limits: Vec<Limit>,
    spec: &PlanSpec,
    field: &str,
) -> Result<Arc<Plan>, Invalid> {
    let overrun = overrun_from_spec(spec, field)?;
    Plan::with_weight(name, limits, overrun, spec.queue_weight.unwrap_or(1))
        .map_err(|e| Invalid::new(join(field, &e.field), e.message))
}

/// Builds a validated plan named `name` from its JSON shape. Errors name the
/// field under `field` (`limits[2].window`, `overrun`). Custom dimensions
/// are registered in the catalog only when the whole plan is valid; the
/// plan itself is not added (the caller does, with `Catalog::set_plan`).
///
/// ```
/// use allowance_config::{PlanSpec, plan_from_spec};
/// use allowance_core::Catalog;
/// let mut catalog = Catalog::default();
/// let spec: PlanSpec = serde_json::from_str(r#"{"limits": [
///     {"dimension": "search_calls", "capacity": 100, "window": "calendar", "unit": "day"}
/// ], "overrun": "cap_at_estimate"}"#).unwrap();
/// let plan = plan_from_spec("tools", &spec, &mut catalog, "").unwrap();
/// assert_eq!(plan.limits().len(), 1);
/// assert!(catalog.dimension("search_calls").is_some());
/// ```
pub fn plan_from_spec(
    name: &str,
    spec: &PlanSpec,
    catalog: &mut Catalog,
    field: &str,
) -> Result<Arc<Plan>, Invalid> {
    // Work on a copy so a refusal leaves no custom dimension behind.
    let mut scratch = catalog.clone();
    let mut limits = Vec::with_capacity(spec.limits.len());
    for (i, l) in spec.limits.iter().enumerate() {
        limits.push(limit_from_spec(
            l,
            &mut scratch,
            &join(field, &format!("limits[{i}]")),
        )?);
    }
    let plan = assemble_plan(name, limits, spec, field)?;
    *catalog = scratch;
    Ok(plan)
}

/// The JSON shape of a limit (for `GET /v1/plans`), as HTTP-API.md writes
/// it: `period_ms` rather than `period`, `slices` always for sliding
/// windows, no `window` for `concurrent`, no `zone` when it is UTC.
/// `limit_from_spec(&limit_to_spec(l))` gives back `l`.
pub fn limit_to_spec(limit: &Limit, catalog: &Catalog) -> LimitSpec {
    let mut spec = LimitSpec {
        dimension: catalog.dimension_name(limit.dimension()).to_string(),
        capacity: limit.capacity(),
        ..LimitSpec::default()
    };
    match limit.window() {
        Window::Sliding { period_ms, slices } => {
            spec.window = Some("sliding".into());
            spec.period_ms = Some(*period_ms);
            spec.slices = Some(*slices);
        }
        Window::Bucket { period_ms } => {
            spec.window = Some("bucket".into());
            spec.period_ms = Some(*period_ms);
        }
        Window::Calendar { unit, zone } => {
            spec.window = Some("calendar".into());
            spec.unit = Some(unit.as_str().into());
            // UTC is the default: left out, as HTTP-API.md's examples write it.
            spec.zone = (!zone.is_utc()).then(|| zone.name().into());
        }
        Window::Total => spec.window = Some("total".into()),
        Window::Concurrent => {
            if limit.guaranteed() > 0 {
                spec.guaranteed = Some(limit.guaranteed());
            }
        }
    }
    spec
}

/// The JSON shape of a plan: its limits, and its overrun policy (with the
/// percent for `allow_overrun`) and queue weight where they differ from the
/// defaults (`charge_actual`, 1). Defaults are left out so that writing the
/// shape back — into a file or a `PUT` — sets nothing the author did not:
/// `check` warns about an `overrun` set on a plan that is not the tenant's.
pub fn plan_to_spec(plan: &Plan, catalog: &Catalog) -> PlanSpec {
    let overrun = plan.overrun();
    PlanSpec {
        limits: plan
            .limits()
            .iter()
            .map(|l| limit_to_spec(l, catalog))
            .collect(),
        overrun: (overrun != OverrunPolicy::ChargeActual).then(|| overrun.as_str().to_string()),
        overrun_percent: match overrun {
            OverrunPolicy::AllowOverrun { percent } => Some(percent),
            _ => None,
        },
        queue_weight: (plan.queue_weight() != 1).then(|| plan.queue_weight()),
    }
}
