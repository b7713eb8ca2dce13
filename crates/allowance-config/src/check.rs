//! `check-config`: the effective plans as a table, and warnings about
//! configurations that are valid but defeat themselves.

use std::fmt;

use allowance_core::{
    Dimension, Limit, Override, OverrunPolicy, Plan, ScopeKey, TENANT_KIND, Window,
};

use crate::Config;
use crate::duration::format_duration_ms;

/// How loud a [`Warning`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Probably a mistake.
    Warning,
    /// Worth knowing (e.g. how many users it takes to exhaust a tenant).
    Info,
}

/// A finding of [`check`], naming the plans and numbers concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Warning {
    /// Warning or info.
    pub level: Level,
    /// The plans concerned (for tools that group findings).
    pub plans: Vec<String>,
    /// One line for a human.
    pub message: String,
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let level = match self.level {
            Level::Warning => "warning",
            Level::Info => "info",
        };
        write!(f, "{level}: {}", self.message)
    }
}

fn warning(plans: &[&str], message: String) -> Warning {
    Warning {
        level: Level::Warning,
        plans: plans.iter().map(|p| p.to_string()).collect(),
        message,
    }
}

/// `300000000` → `300_000_000`, as a config file would write it.
fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push('_');
        }
        out.push(c);
    }
    out
}

/// Whether two windows count over the same span: same kind and period
/// (slices may differ), same calendar unit and zone.
fn same_span(a: &Window, b: &Window) -> bool {
    match (a, b) {
        (Window::Sliding { period_ms: p, .. }, Window::Sliding { period_ms: q, .. }) => p == q,
        (Window::Bucket { period_ms: p }, Window::Bucket { period_ms: q }) => p == q,
        (Window::Calendar { unit: u, zone: z }, Window::Calendar { unit: v, zone: y }) => {
            u == v && z == y
        }
        (Window::Total, Window::Total) | (Window::Concurrent, Window::Concurrent) => true,
        _ => false,
    }
}

/// "sliding 1d", "bucket 1m", "calendar month Europe/Paris", "total", "concurrent".
fn describe_window(w: &Window) -> String {
    match w {
        Window::Sliding { period_ms, .. } => format!("sliding {}", format_duration_ms(*period_ms)),
        Window::Bucket { period_ms } => format!("bucket {}", format_duration_ms(*period_ms)),
        Window::Calendar { unit, zone } => format!("calendar {} {}", unit.as_str(), zone.name()),
        Window::Total => "total".to_string(),
        Window::Concurrent => "concurrent".to_string(),
    }
}

/// Levenshtein distance, for custom dimensions that look like typos.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// The plans in file order, then any others (added later) by name.
fn plans_in_order(config: &Config) -> Vec<&std::sync::Arc<Plan>> {
    let c = &config.catalog;
    let mut plans: Vec<_> = config
        .notes
        .plan_order
        .iter()
        .filter_map(|n| c.plan(n))
        .collect();
    let mut rest: Vec<_> = c
        .plans()
        .filter(|p| !config.notes.plan_order.iter().any(|n| n == p.name()))
        .collect();
    rest.sort_by(|a, b| a.name().cmp(b.name()));
    plans.extend(rest);
    plans
}

/// The kinds in file order (`tenant` first), then any others by name.
fn kinds_in_order(config: &Config) -> Vec<String> {
    let mut kinds: Vec<String> = config
        .notes
        .kind_order
        .iter()
        .filter(|k| config.catalog.kind(k).is_some())
        .cloned()
        .collect();
    let mut rest: Vec<String> = config
        .catalog
        .kinds()
        .map(|(k, _)| k.to_string())
        .filter(|k| !kinds.contains(k))
        .collect();
    rest.sort();
    kinds.extend(rest);
    kinds
}

/// Findings about a valid configuration that probably does not do what its
/// author meant, each naming the plans and numbers:
///
/// - a nested kind's cap (user, agent, task …) at or above the tenant plan's
///   cap on the same dimension and window: the tenant cap is then a shared
///   fuse one user can blow for everybody; for every such pair below it, the
///   quorum (tenant cap ÷ user cap: how many at their cap exhaust the
///   tenant) as info;
/// - `overrun` set on a plan that is not the tenant kind's (it is read from
///   the tenant's plan only);
/// - a concurrency `guaranteed` on a plan that is not the tenant kind's;
/// - a plan that is no kind's default (only an override can use it);
/// - a custom dimension whose name is close to a built-in one (`token`);
/// - a per-tenant queue bound above the global one;
/// - no `[[tokens]]` while listening beyond loopback; a gateway with no keys;
/// - `fsync` for a ledger kept in memory (`data_dir = ""`);
/// - a model the gateway routes that has no price while a plan limits
///   `cost_micros` (every call to it would be refused).
pub fn check(config: &Config) -> Vec<Warning> {
    let c = &config.catalog;
    let mut out = Vec::new();
    let tenant_plan = c
        .kind(TENANT_KIND)
        .and_then(|k| k.plan.as_deref())
        .and_then(|n| c.plan(n));

    // Nested caps against the tenant's.
    if let Some(tp) = tenant_plan {
        for kind in kinds_in_order(config) {
            let Some(spec) = c.kind(&kind) else { continue };
            if kind == TENANT_KIND || spec.shared {
                continue;
            }
            let Some(plan) = spec.plan.as_deref().and_then(|n| c.plan(n)) else {
                continue;
            };
            for l in plan.limits() {
                for t in tp.limits() {
                    if l.dimension() != t.dimension() || !same_span(l.window(), t.window()) {
                        continue;
                    }
                    out.push(quorum(config, &kind, plan, l, tp, t));
                }
            }
        }
    }

    let tenant_name = tenant_plan.map(|p| p.name());
    for plan in plans_in_order(config) {
        let name = plan.name();
        let is_tenant = Some(name) == tenant_name;
        if !is_tenant && config.notes.explicit_overrun.iter().any(|p| p == name) {
            let policy = match plan.overrun() {
                OverrunPolicy::AllowOverrun { percent } => {
                    format!("\"allow_overrun\" ({percent}%)")
                }
                other => format!("{:?}", other.as_str()),
            };
            let tenant = tenant_name.map_or("the tenant kind has no plan".to_string(), |t| {
                format!("the tenant kind's is `{t}`")
            });
            out.push(warning(
                &[name],
                format!(
                    "plan `{name}` sets overrun = {policy}, but the overrun policy is read from \
                     the tenant's plan only ({tenant}): it has no effect unless a tenant is moved \
                     to `{name}` by an override"
                ),
            ));
        }
        if !is_tenant {
            for l in plan.limits().iter().filter(|l| l.guaranteed() > 0) {
                out.push(warning(
                    &[name],
                    format!(
                        "plan `{name}` guarantees {} concurrent reservations, but guarantees are \
                         read from the tenant's plan only: it has no effect unless a tenant is \
                         moved to `{name}` by an override",
                        l.guaranteed()
                    ),
                ));
            }
        }
        let used = c.kinds().any(|(_, k)| k.plan.as_deref() == Some(name));
        if !used {
            out.push(warning(
                &[name],
                format!(
                    "plan `{name}` is the default plan of no kind: only an override \
                     (PUT /v1/scopes/…) can put a scope on it"
                ),
            ));
        }
    }

    // Custom dimensions that look like a misspelt built-in one.
    let mut seen: Vec<&str> = Vec::new();
    for plan in plans_in_order(config) {
        for l in plan.limits() {
            let name = c.dimension_name(l.dimension());
            if Dimension::builtin(name).is_some() || seen.contains(&name) {
                continue;
            }
            seen.push(name);
            let close = Dimension::BUILTIN
                .iter()
                .filter_map(|d| d.builtin_name())
                .find(|b| distance(name, b) <= 2 || b.starts_with(name) || name.starts_with(b));
            if let Some(builtin) = close {
                out.push(warning(
                    &[plan.name()],
                    format!(
                        "plan `{}` counts a custom dimension `{name}`, close to the built-in \
                         `{builtin}`: a reservation's {builtin} never counts against it (a typo?)",
                        plan.name()
                    ),
                ));
            }
        }
    }

    for moot in &config.notes.no_effect {
        out.push(warning(&[], moot.clone()));
    }
    let q = &config.queue;
    if q.max_waiters_per_tenant > q.max_waiters {
        out.push(warning(
            &[],
            format!(
                "queue.max_waiters_per_tenant ({}) is above queue.max_waiters ({}): the global \
                 bound is reached first",
                q.max_waiters_per_tenant, q.max_waiters
            ),
        ));
    }
    if config.tokens.is_empty() && !config.server.listen.ip().is_loopback() {
        out.push(warning(
            &[],
            format!(
                "no [[tokens]] while listening on {}: the server will refuse to start without \
                 credentials unless run with --insecure-no-auth",
                config.server.listen
            ),
        ));
    }
    if let Some(g) = &config.gateway {
        let cost_plans: Vec<&str> = plans_in_order(config)
            .into_iter()
            .filter(|p| p.limits_dimension(Dimension::COST_MICROS))
            .map(|p| p.name())
            .collect();
        for up in g.upstreams.iter().filter(|_| !cost_plans.is_empty()) {
            for model in up
                .models
                .iter()
                .filter(|m| *m != "*" && c.model(m).is_none())
            {
                out.push(warning(
                    &cost_plans,
                    format!(
                        "upstream `{}` routes model {model:?}, which has no price in [models], \
                         while plan `{}` limits cost_micros: the gateway refuses every call to \
                         it (price it under [models.{model:?}])",
                        up.name, cost_plans[0]
                    ),
                ));
            }
        }
    }
    if let Some(g) = &config.gateway
        && g.keys.is_empty()
    {
        out.push(warning(
            &[],
            "[gateway] has no [[gateway.keys]]: no client can call it".to_string(),
        ));
    }
    out
}

/// The finding for one nested limit against the tenant's limit of the same
/// dimension and window.
fn quorum(config: &Config, kind: &str, plan: &Plan, l: &Limit, tp: &Plan, t: &Limit) -> Warning {
    let dim = config.catalog.dimension_name(l.dimension());
    // "cost_micros (sliding 24h)"; the concurrency gauge has no window to name.
    let dim_span = match l.window() {
        Window::Concurrent => dim.to_string(),
        w => format!("{dim} ({})", describe_window(w)),
    };
    let (lc, tc) = (l.capacity(), t.capacity());
    let ratio = if tc % lc == 0 {
        (tc / lc).to_string()
    } else {
        format!("{:.2}", tc as f64 / lc as f64)
    };
    let plans = [plan.name(), tp.name()];
    if lc >= tc {
        warning(
            &plans,
            format!(
                "kind `{kind}` (plan `{}`) caps {dim_span} at {}, at or above the tenant plan \
                 `{}`'s {}: quorum {ratio}; the tenant cap is a shared fuse one {kind} can blow \
                 for everybody",
                plan.name(),
                grouped(lc),
                tp.name(),
                grouped(tc)
            ),
        )
    } else {
        Warning {
            level: Level::Info,
            plans: plans.iter().map(|p| p.to_string()).collect(),
            message: format!(
                "kind `{kind}` (plan `{}`) vs tenant (plan `{}`), {dim_span}: quorum {} ÷ {} \
                 = {ratio}: that many {kind} scopes at their cap exhaust the tenant",
                plan.name(),
                tp.name(),
                grouped(tc),
                grouped(lc)
            ),
        }
    }
}

/// The effective plans as an aligned table — kind, plan, dimension,
/// capacity, window, period — followed by the tenant's overrun policy and
/// the findings of [`check`]. What `allowance check-config` prints.
pub fn plans_table(config: &Config) -> String {
    let c = &config.catalog;
    let mut rows: Vec<[String; 6]> = vec![[
        "KIND".into(),
        "PLAN".into(),
        "DIMENSION".into(),
        "CAPACITY".into(),
        "WINDOW".into(),
        "PERIOD".into(),
    ]];
    let push_plan = |rows: &mut Vec<[String; 6]>, kind: String, plan: Option<&Plan>| {
        let name = plan.map_or("-".to_string(), |p| p.name().to_string());
        let limits = plan.map_or(&[][..], |p| p.limits());
        if limits.is_empty() {
            rows.push([
                kind,
                name,
                "(no limits)".into(),
                String::new(),
                String::new(),
                String::new(),
            ]);
            return;
        }
        for l in limits {
            let mut capacity = grouped(l.capacity());
            if l.guaranteed() > 0 {
                capacity.push_str(&format!(" ({} guaranteed)", grouped(l.guaranteed())));
            }
            let period = match l.window() {
                Window::Sliding { period_ms, slices } => {
                    format!("{} ({slices} slices)", format_duration_ms(*period_ms))
                }
                Window::Bucket { period_ms } => format_duration_ms(*period_ms),
                Window::Calendar { unit, zone } => format!("{} {}", unit.as_str(), zone.name()),
                Window::Total | Window::Concurrent => "-".into(),
            };
            rows.push([
                kind.clone(),
                name.clone(),
                c.dimension_name(l.dimension()).to_string(),
                capacity,
                l.window().kind().as_str().to_string(),
                period,
            ]);
        }
    };
    for kind in kinds_in_order(config) {
        let Some(spec) = c.kind(&kind) else { continue };
        let label = if spec.shared {
            format!("{kind} (shared)")
        } else {
            kind.clone()
        };
        let plan = spec.plan.as_deref().and_then(|n| c.plan(n)).map(|p| &**p);
        push_plan(&mut rows, label, plan);
    }
    for plan in plans_in_order(config) {
        if !c
            .kinds()
            .any(|(_, k)| k.plan.as_deref() == Some(plan.name()))
        {
            push_plan(&mut rows, "-".into(), Some(plan));
        }
    }

    // Scopes the file gives limits of their own (the gateway's upstreams),
    // under their scope's name; the gateway's internal tenant has none.
    let mut own: Vec<(&ScopeKey, &Plan)> = c
        .overrides()
        .filter_map(|(k, o)| match o {
            Override::Limits(p) if !p.limits().is_empty() => Some((k, &**p)),
            _ => None,
        })
        .collect();
    own.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
    for (scope, plan) in own {
        push_plan(&mut rows, scope.as_str().to_string(), Some(plan));
    }

    let mut widths = [0usize; 6];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in &rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            line.push_str(cell);
            if i + 1 < row.len() {
                line.extend(std::iter::repeat_n(' ', widths[i] - cell.chars().count()));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    let tenant_plan = c
        .kind(TENANT_KIND)
        .and_then(|k| k.plan.as_deref())
        .and_then(|n| c.plan(n));
    out.push('\n');
    match tenant_plan {
        Some(p) => {
            let policy = match p.overrun() {
                OverrunPolicy::AllowOverrun { percent } => format!("allow_overrun ({percent}%)"),
                other => other.as_str().to_string(),
            };
            out.push_str(&format!(
                "overrun: {policy} (from the tenant plan `{}`); queue weight {}\n",
                p.name(),
                p.queue_weight()
            ));
        }
        None => out.push_str("overrun: charge_actual (the tenant kind has no plan)\n"),
    }
    let findings = check(config);
    if !findings.is_empty() {
        out.push('\n');
        for w in findings {
            out.push_str(&w.to_string());
            out.push('\n');
        }
    }
    out
}
