//! From the spanned TOML document to a [`Config`]: each section is read on
//! its own, every problem is recorded with its line and key, and a config
//! is returned only when there is none.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use allowance_core::{
    Catalog, Dimension, Limit, MAX_AMOUNT, MAX_SCOPES_LIMIT, ModelPrice, Override, OverrunPolicy,
    Plan, ScopeKey, Settings, TENANT_KIND, Window, parse_price_micros, valid_id, valid_kind,
};
use toml::de::{DeTable, DeValue};

use crate::error::{ConfigErrors, Problem};
use crate::read::{Bad, Doc, Item, Read, Table, child_path, tables_of};
use crate::settings::{
    Fsync, GatewayKey, GatewaySettings, OnError, QueueSettings, Role, ServerSettings, StoreKind,
    StoreSettings, TokenSpec, UpstreamSettings,
};
use crate::spec::{LimitSpec, PlanSpec, assemble_plan, join, limit_from_spec};
use crate::{Config, Notes};

/// Largest configuration file read: a config is a page or two; anything
/// this large is the wrong file.
pub const MAX_CONFIG_BYTES: usize = 4 << 20;
/// Longest hold a configuration may allow: a hold covers one call or one
/// run, and `extend` exists for long ones.
pub const MAX_TTL_BOUND_MS: u64 = 30 * DAY_MS;
/// Longest retention of ended reservations and idempotency keys: bounds
/// the memory an idle deployment keeps.
pub const MAX_RETENTION_MS: u64 = 400 * DAY_MS;
/// Longest store call timeout: past a minute a caller has long given up.
pub const MAX_STORE_TIMEOUT_MS: u64 = 60_000;
/// Longest admission wait: a waiter holds an open connection.
pub const MAX_WAIT_BOUND_MS: u64 = 3_600_000;
/// Most waiters in the queue: each costs memory and a connection.
pub const MAX_WAITERS_BOUND: u64 = 10_000_000;
/// Largest `max_output_tokens` of a model (no model emits more in one call).
pub const MAX_OUTPUT_TOKENS_BOUND: u64 = 10_000_000;
/// Largest gateway request body: 1 GiB.
pub const MAX_BODY_BYTES_BOUND: u64 = 1 << 30;
/// Most retries of one gateway call (each still counts upstream).
pub const MAX_RETRIES_BOUND: u64 = 10;

const DAY_MS: u64 = 86_400_000;
/// The default currency when the file names none.
pub const DEFAULT_CURRENCY: &str = "USD";
/// Output tokens reserved for a priced model that names no bound.
pub const DEFAULT_MAX_OUTPUT_TOKENS: u64 = 4096;
/// Default retries of an upstream 429 or 5xx (what the OpenAI SDKs do).
pub const DEFAULT_MAX_RETRIES: u32 = 2;
/// The kind of the gateway's shared upstream scopes (`upstream:<name>`).
pub const UPSTREAM_KIND: &str = "upstream";
/// The internal tenant the gateway's upstream reservations belong to: a
/// call's own tenant holds the estimate (refunded when the call fails),
/// while each upstream attempt is a reservation of this tenant on
/// `upstream:<name>` (kept: the provider counted it). It has no limits of
/// its own, and no gateway key may name it.
pub const GATEWAY_TENANT: &str = "~gateway";

const TOP_KEYS: &[&str] = &[
    "currency",
    "server",
    "store",
    "reservations",
    "queue",
    "kinds",
    "plans",
    "models",
    "tokens",
    "gateway",
];
const LIMIT_KEYS: &[&str] = &[
    "dimension",
    "capacity",
    "window",
    "period",
    "period_ms",
    "slices",
    "unit",
    "zone",
    "guaranteed",
];

/// A read whose value, absent or bad, falls back to `default` (the problem
/// is recorded already, and the config will not be returned).
fn or<T>(read: Read<T>, default: T) -> T {
    read.ok().flatten().unwrap_or(default)
}

/// `Option<Result<T, Bad>>` (an optional key, read) as a [`Read`].
fn opt<T>(value: Option<Result<T, Bad>>) -> Read<T> {
    value.transpose()
}

/// The offset of the first table header (a line starting with `[`) after
/// `from`, or the end of `text`.
fn next_table_header(text: &str, from: usize) -> usize {
    let mut offset = from;
    for line in text.get(from..).unwrap_or("").split_inclusive('\n').skip(1) {
        offset += line.len();
        if line.trim_start().starts_with('[') {
            return offset - line.len();
        }
    }
    text.len()
}

/// Parses a configuration; see [`crate::parse`].
pub(crate) fn parse_text(text: &str, source: &str) -> Result<Config, ConfigErrors> {
    if text.len() > MAX_CONFIG_BYTES {
        return Err(ConfigErrors::whole_file(
            source,
            format!(
                "the file has {} bytes; a configuration has at most {MAX_CONFIG_BYTES}",
                text.len()
            ),
        ));
    }
    let mut doc = Doc::new(text);
    let (root, syntax) = DeTable::parse_recoverable(text);
    if !syntax.is_empty() {
        // The end of a duplicated table: its keys are duplicates too, but
        // only of that one mistake.
        let mut skip_until = 0;
        for e in &syntax {
            let span = e.span().unwrap_or(0..0);
            let what = text.get(span.clone()).unwrap_or("").trim();
            if e.message() == "duplicate key" && !what.is_empty() {
                if span.start < skip_until {
                    continue;
                }
                let line_start = text[..span.start].rfind('\n').map_or(0, |i| i + 1);
                let line = text[line_start..].lines().next().unwrap_or("").trim();
                let message = if line.starts_with('[') {
                    skip_until = next_table_header(text, span.end);
                    let header = line.find(']').map_or(line, |i| {
                        let end = if line[i..].starts_with("]]") {
                            i + 2
                        } else {
                            i + 1
                        };
                        &line[..end]
                    });
                    format!("invalid TOML: the table `{header}` is defined twice")
                } else {
                    format!("invalid TOML: the key `{what}` is defined twice")
                };
                doc.syntax(span.start, message);
                continue;
            }
            doc.syntax(span.start, format!("invalid TOML: {}", e.message()));
        }
        return Err(finish(doc, source));
    }
    let root = Table::root(root.get_ref());
    root.check_keys(&mut doc, TOP_KEYS);

    let currency = read_currency(&mut doc, &root);
    let server = read_server(&mut doc, &root);
    let mut notes = Notes::default();
    let store = read_store(&mut doc, &root, &mut notes);
    let queue = read_queue(&mut doc, &root);
    let (settings, reservations_offset) = read_reservations(&mut doc, &root);
    let mut catalog = match Catalog::new(settings) {
        Ok(c) => c,
        Err(e) => {
            // Already checked key by key; this is the engine's own word.
            doc.error(reservations_offset, &e.field, e.message);
            Catalog::default()
        }
    };
    let plans = read_plans(&mut doc, &root, &mut catalog, &mut notes);
    let kinds_written = read_kinds(&mut doc, &root, &mut catalog, &plans, &mut notes);
    read_models(&mut doc, &root, &mut catalog);
    let tokens = read_tokens(&mut doc, &root);
    let gateway = read_gateway(&mut doc, &root, &catalog, &kinds_written, &tokens);
    if let Some(g) = &gateway {
        install_upstreams(&mut doc, &root, &mut catalog, g);
    }

    if !doc.problems.is_empty() {
        return Err(finish(doc, source));
    }
    Ok(Config {
        source: source.to_string(),
        currency,
        server,
        store,
        queue,
        catalog,
        tokens: tokens.into_iter().map(|(t, _)| t).collect(),
        gateway,
        notes,
    })
}

fn finish(doc: Doc, source: &str) -> ConfigErrors {
    let mut problems: Vec<Problem> = doc.problems;
    problems.sort_by_key(|p| p.line);
    ConfigErrors {
        file: source.to_string(),
        problems,
    }
}

// ---- scalar sections

/// The ISO 4217 currency codes (the list of 2025, with the codes being
/// withdrawn still accepted), sorted for a binary search.
const ISO_4217: &[&str] = &[
    "AED", "AFN", "ALL", "AMD", "ANG", "AOA", "ARS", "AUD", "AWG", "AZN", "BAM", "BBD", "BDT",
    "BGN", "BHD", "BIF", "BMD", "BND", "BOB", "BOV", "BRL", "BSD", "BTN", "BWP", "BYN", "BZD",
    "CAD", "CDF", "CHE", "CHF", "CHW", "CLF", "CLP", "CNY", "COP", "COU", "CRC", "CUC", "CUP",
    "CVE", "CZK", "DJF", "DKK", "DOP", "DZD", "EGP", "ERN", "ETB", "EUR", "FJD", "FKP", "GBP",
    "GEL", "GHS", "GIP", "GMD", "GNF", "GTQ", "GYD", "HKD", "HNL", "HTG", "HUF", "IDR", "ILS",
    "INR", "IQD", "IRR", "ISK", "JMD", "JOD", "JPY", "KES", "KGS", "KHR", "KMF", "KPW", "KRW",
    "KWD", "KYD", "KZT", "LAK", "LBP", "LKR", "LRD", "LSL", "LYD", "MAD", "MDL", "MGA", "MKD",
    "MMK", "MNT", "MOP", "MRU", "MUR", "MVR", "MWK", "MXN", "MXV", "MYR", "MZN", "NAD", "NGN",
    "NIO", "NOK", "NPR", "NZD", "OMR", "PAB", "PEN", "PGK", "PHP", "PKR", "PLN", "PYG", "QAR",
    "RON", "RSD", "RUB", "RWF", "SAR", "SBD", "SCR", "SDG", "SEK", "SGD", "SHP", "SLE", "SLL",
    "SOS", "SRD", "SSP", "STN", "SVC", "SYP", "SZL", "THB", "TJS", "TMT", "TND", "TOP", "TRY",
    "TTD", "TWD", "TZS", "UAH", "UGX", "USD", "USN", "UYI", "UYU", "UYW", "UZS", "VED", "VES",
    "VND", "VUV", "WST", "XAF", "XAG", "XAU", "XBA", "XBB", "XBC", "XBD", "XCD", "XCG", "XDR",
    "XOF", "XPD", "XPF", "XPT", "XSU", "XTS", "XUA", "XXX", "YER", "ZAR", "ZMW", "ZWG", "ZWL",
];

fn read_currency(doc: &mut Doc, root: &Table) -> String {
    let Some(item) = root.get("currency") else {
        return DEFAULT_CURRENCY.to_string();
    };
    let Ok(text) = item.str(doc) else {
        return DEFAULT_CURRENCY.to_string();
    };
    if ISO_4217.binary_search(&text).is_err() {
        doc.error(
            item.offset,
            &item.path,
            format!("expected an ISO 4217 code such as \"EUR\" or \"USD\", got {text:?}"),
        );
    }
    text.to_string()
}

fn read_server(doc: &mut Doc, root: &Table) -> ServerSettings {
    let mut server = ServerSettings::default();
    let Ok(Some(t)) = root.table(doc, "server") else {
        return server;
    };
    t.check_keys(doc, &["listen"]);
    if let Some(item) = t.get("listen")
        && let Ok(text) = item.str(doc)
    {
        match text.parse::<SocketAddr>() {
            Ok(addr) => server.listen = addr,
            Err(_) => doc.error(
                item.offset,
                &item.path,
                format!("expected an IP address and port such as \"127.0.0.1:8787\", got {text:?}"),
            ),
        }
    }
    server
}

fn read_store(doc: &mut Doc, root: &Table, notes: &mut Notes) -> StoreSettings {
    let mut store = StoreSettings::default();
    let Ok(Some(t)) = root.table(doc, "store") else {
        return store;
    };
    t.check_keys(
        doc,
        &[
            "kind",
            "data_dir",
            "url",
            "on_error",
            "fsync",
            "timeout",
            "timeout_ms",
            "fail_open_fraction",
        ],
    );
    let kind_item = t.get("kind");
    store.kind = or(
        opt(kind_item.as_ref().map(|i| {
            i.one_of(
                doc,
                &[
                    ("embedded", StoreKind::Embedded),
                    ("redis", StoreKind::Redis),
                ],
            )
        })),
        StoreKind::Embedded,
    );
    let redis = store.kind == StoreKind::Redis;
    store.data_dir = if redis { None } else { store.data_dir };
    if let Some(item) = t.get("data_dir") {
        if redis {
            doc.error(
                item.offset,
                &item.path,
                "only for kind = \"embedded\": a redis store keeps its data in Redis",
            );
        } else if let Ok(dir) = item.str(doc) {
            store.data_dir = (!dir.is_empty()).then(|| PathBuf::from(dir));
        }
    }
    match t.get("url") {
        Some(item) if !redis => doc.error(
            item.offset,
            &item.path,
            "only for kind = \"redis\" (the embedded store keeps its data in `data_dir`)",
        ),
        Some(item) => {
            if let Ok(url) = item.str(doc) {
                match redis_url_problem(url) {
                    None => store.url = Some(url.to_string()),
                    Some(why) => doc.error(
                        item.offset,
                        &item.path,
                        format!(
                            "{why}, got {url:?} (expected such as \"redis://127.0.0.1:6379/0\")"
                        ),
                    ),
                }
            }
        }
        None if redis => {
            let offset = kind_item.map_or(t.offset, |i| i.offset);
            doc.error(
                offset,
                &child_path(&t.path, "url"),
                "required when kind = \"redis\" (such as \"redis://127.0.0.1:6379/0\")",
            );
        }
        None => {}
    }
    let on_error_item = t.get("on_error");
    store.on_error = or(
        opt(on_error_item.as_ref().map(|i| {
            i.one_of(
                doc,
                &[
                    ("fail_closed", OnError::FailClosed),
                    ("fail_open_local", OnError::FailOpenLocal),
                ],
            )
        })),
        OnError::FailClosed,
    );
    if let Some(item) = &on_error_item
        && store.on_error == OnError::FailOpenLocal
        && !redis
    {
        // Accepted, it would be ignored: the embedded store has no local
        // fallback to admit against when its own disk fails.
        doc.error(
            item.offset,
            &item.path,
            "\"fail_open_local\" is only for kind = \"redis\": the embedded store answers \
             store_unavailable (503) when its log cannot be written (DURABLE-STORE.md)",
        );
    }
    if let Some(item) = t.get("fsync") {
        if redis {
            doc.error(
                item.offset,
                &item.path,
                "only for kind = \"embedded\" (Redis has its own persistence settings)",
            );
        } else {
            store.fsync = or(
                opt(Some(item.one_of(
                    doc,
                    &[
                        ("always", Fsync::Always),
                        ("batch", Fsync::Batch),
                        ("never", Fsync::Never),
                    ],
                ))),
                Fsync::Always,
            );
        }
    }
    if let Ok(Some((ms, _))) = t.duration_ms(doc, "timeout", 1, MAX_STORE_TIMEOUT_MS) {
        store.timeout_ms = ms;
    }
    if let Some(item) = t.get("fail_open_fraction")
        && let Ok(f) = item.number(doc)
    {
        if f.is_finite() && f > 0.0 && f <= 1.0 {
            store.fail_open_fraction = f;
        } else {
            doc.error(
                item.offset,
                &item.path,
                format!("expected a share above 0 and at most 1 (such as 0.1), got {f}"),
            );
        }
    }
    // (`fail_open_fraction` under fail_closed is not reported: the starter
    // shows it beside `on_error` as the knob of the other policy.)
    if t.get("fsync").is_some() && store.data_dir.is_none() && !redis {
        notes.no_effect.push(
            "store.fsync has no effect with data_dir = \"\": the ledger is kept in memory only"
                .into(),
        );
    }
    store
}

fn read_queue(doc: &mut Doc, root: &Table) -> QueueSettings {
    let mut queue = QueueSettings::default();
    let Ok(Some(t)) = root.table(doc, "queue") else {
        return queue;
    };
    t.check_keys(
        doc,
        &[
            "max_waiters_per_tenant",
            "max_waiters",
            "max_wait",
            "max_wait_ms",
        ],
    );
    let count = |doc: &mut Doc, key: &str, default: usize| {
        let read =
            opt(t.get(key).map(|i| i.u64_in(doc, 0, MAX_WAITERS_BOUND))).map(Option::flatten);
        or(read, default as u64) as usize
    };
    queue.max_waiters_per_tenant =
        count(doc, "max_waiters_per_tenant", queue.max_waiters_per_tenant);
    queue.max_waiters = count(doc, "max_waiters", queue.max_waiters);
    if let Ok(Some((ms, _))) = t.duration_ms(doc, "max_wait", 0, MAX_WAIT_BOUND_MS) {
        queue.max_wait_ms = ms;
    }
    queue
}

/// `[reservations]`, with where the section starts (for the engine's own
/// check, which should never fire after ours).
fn read_reservations(doc: &mut Doc, root: &Table) -> (Settings, usize) {
    let mut s = Settings::default();
    let Ok(Some(t)) = root.table(doc, "reservations") else {
        return (s, 0);
    };
    t.check_keys(
        doc,
        &[
            "default_ttl",
            "default_ttl_ms",
            "max_ttl",
            "max_ttl_ms",
            "idempotency_retention",
            "idempotency_retention_ms",
            "ended_retention",
            "ended_retention_ms",
            "max_scopes",
            "max_labels",
        ],
    );
    let default_ttl = t.duration_ms(doc, "default_ttl", 1, MAX_TTL_BOUND_MS);
    let max_ttl = t.duration_ms(doc, "max_ttl", 1, MAX_TTL_BOUND_MS);
    if let Ok(Some((ms, _))) = t.duration_ms(doc, "idempotency_retention", 0, MAX_RETENTION_MS) {
        s.idempotency_retention_ms = ms;
    }
    if let Ok(Some((ms, _))) = t.duration_ms(doc, "ended_retention", 0, MAX_RETENTION_MS) {
        s.ended_retention_ms = ms;
    }
    if let Some(item) = t.get("max_scopes")
        && let Ok(Some(n)) = item.u64_in(doc, 1, MAX_SCOPES_LIMIT as u64)
    {
        s.max_scopes = n as usize;
    }
    if let Some(item) = t.get("max_labels")
        && let Ok(Some(n)) = item.u64_in(doc, 0, 64)
    {
        s.max_labels = n as usize;
    }
    // Compare only values that were read well: a bad one is reported already.
    if let (Ok(d), Ok(m)) = (&default_ttl, &max_ttl) {
        if let Some((ms, _)) = d {
            s.default_ttl_ms = *ms;
        }
        if let Some((ms, _)) = m {
            s.max_ttl_ms = *ms;
        }
        if s.default_ttl_ms > s.max_ttl_ms {
            let (d_ms, m_ms) = (
                crate::duration::format_duration_ms(s.default_ttl_ms),
                crate::duration::format_duration_ms(s.max_ttl_ms),
            );
            match (d, m) {
                (Some((_, item)), _) => doc.error(
                    item.offset,
                    &item.path,
                    format!("the default TTL ({d_ms}) is above the maximum TTL ({m_ms})"),
                ),
                (None, Some((_, item))) => doc.error(
                    item.offset,
                    &item.path,
                    format!(
                        "the maximum TTL ({m_ms}) is below the default TTL ({d_ms}, the default)"
                    ),
                ),
                (None, None) => {}
            }
            // Reported: keep the engine from reporting it a second time.
            s.default_ttl_ms = s.max_ttl_ms;
        }
    }
    (s, t.offset)
}

// ---- plans and kinds

/// What [`read_plans`] found: every plan name written (even those with
/// problems, so a kind naming one is not reported twice) and the plans built.
struct Plans {
    names: Vec<String>,
    built: Vec<Arc<Plan>>,
}

fn read_plans(doc: &mut Doc, root: &Table, catalog: &mut Catalog, notes: &mut Notes) -> Plans {
    let mut plans = Plans {
        names: Vec::new(),
        built: Vec::new(),
    };
    let Ok(Some(t)) = root.table(doc, "plans") else {
        return plans;
    };
    for item in t.items() {
        plans.names.push(item.key.to_string());
        if let Ok((plan, explicit_overrun)) = read_plan(doc, &item, catalog) {
            if explicit_overrun {
                notes.explicit_overrun.push(plan.name().to_string());
            }
            notes.plan_order.push(plan.name().to_string());
            catalog.set_plan(plan.clone());
            plans.built.push(plan);
        }
    }
    plans
}

/// Where each key of a table was written, so an engine error naming a
/// field (`window`) is reported on that key's line.
struct Lines(Vec<(String, usize)>);

impl Lines {
    fn of(table: &Table) -> Lines {
        Lines(
            table
                .items()
                .into_iter()
                .map(|i| (i.key.to_string(), i.offset))
                .collect(),
        )
    }

    /// The offset of `field` or of its nearest written parent.
    fn find(&self, field: &str, fallback: usize) -> usize {
        let mut f = field;
        loop {
            if let Some((_, offset)) = self.0.iter().find(|(k, _)| k == f) {
                return *offset;
            }
            match f.rfind(['.', '[']) {
                Some(i) => f = &f[..i],
                None => return fallback,
            }
        }
    }
}

fn read_plan(doc: &mut Doc, item: &Item, catalog: &mut Catalog) -> Result<(Arc<Plan>, bool), Bad> {
    let t = item.table(doc)?;
    t.check_keys(
        doc,
        &["limits", "overrun", "overrun_percent", "queue_weight"],
    );
    let mut spec = PlanSpec::default();
    let mut ok = true;
    let mut lines = Lines::of(&t);
    let overrun_item = t.get("overrun");
    match overrun_item.as_ref().map(|i| i.str(doc)) {
        Some(Ok(s)) => spec.overrun = Some(s.to_string()),
        Some(Err(Bad)) => ok = false,
        None => {}
    }
    match opt(t.get("overrun_percent").map(|i| i.u64_in(doc, 0, 10_000))) {
        Ok(v) => spec.overrun_percent = v.flatten().and_then(|v| u32::try_from(v).ok()),
        Err(Bad) => ok = false,
    }
    match opt(t.get("queue_weight").map(|i| i.u64_in(doc, 1, 1000))) {
        Ok(v) => spec.queue_weight = v.flatten().and_then(|v| u32::try_from(v).ok()),
        Err(Bad) => ok = false,
    }
    if item.key.len() <= 64 && !crate::valid_plan_name(item.key) {
        // The admin API could never change such a plan (the engine's own
        // check, below, is only its length).
        doc.error(
            item.offset,
            &t.path,
            format!(
                "invalid plan name {:?}: expected [A-Za-z0-9._-]{{1,64}}",
                item.key
            ),
        );
        ok = false;
    }
    let mut limits = Vec::new();
    match t.get("limits") {
        // Every key has a default: a plan without limits limits nothing.
        None => {}
        Some(limits_item) => {
            let tables = tables_of(doc, &limits_item)?;
            for (i, table) in tables.into_iter().enumerate() {
                let Ok(table) = table else {
                    ok = false;
                    continue;
                };
                lines.0.push((format!("limits[{i}]"), table.offset));
                match read_limit(doc, &table, catalog) {
                    Ok(limit) => limits.push(limit),
                    Err(Bad) => ok = false,
                }
            }
        }
    }
    // Plan-level checks run even when a limit is bad (then with no limits,
    // so the indices of duplicate-limit errors stay true), to list them all.
    let name = item.key;
    let result = assemble_plan(name, if ok { limits } else { Vec::new() }, &spec, "");
    match result {
        Ok(plan) if ok => Ok((plan, overrun_item.is_some())),
        Ok(_) => Err(Bad),
        Err(e) if e.field == "name" => {
            let message = format!("invalid plan name: {}", e.message);
            doc.error(item.offset, &t.path, message);
            Err(Bad)
        }
        Err(e) => {
            let offset = lines.find(&e.field, item.offset);
            doc.error(offset, &join(&t.path, &e.field), e.message);
            Err(Bad)
        }
    }
}

/// One limit table, read into a [`LimitSpec`] and built by the same code
/// as the admin API's.
fn read_limit(
    doc: &mut Doc,
    t: &Table,
    catalog: &mut Catalog,
) -> Result<allowance_core::Limit, Bad> {
    t.check_keys(doc, LIMIT_KEYS);
    let mut ok = true;
    let mut spec = LimitSpec::default();
    let text = |doc: &mut Doc, key: &str, ok: &mut bool| -> Option<String> {
        match t.get(key).map(|i| i.str(doc)) {
            Some(Ok(s)) => Some(s.to_string()),
            Some(Err(Bad)) => {
                *ok = false;
                None
            }
            None => None,
        }
    };
    match text(doc, "dimension", &mut ok) {
        Some(d) => spec.dimension = d,
        None if t.get("dimension").is_none() => {
            doc.error(
                t.offset,
                &child_path(&t.path, "dimension"),
                "required (such as \"tokens\" or \"cost_micros\")",
            );
            ok = false;
        }
        None => {}
    }
    match t.get("capacity") {
        None => {
            doc.error(
                t.offset,
                &child_path(&t.path, "capacity"),
                "required: an integer between 1 and 2^53",
            );
            ok = false;
        }
        Some(item) => match item.u64_in(doc, 1, MAX_AMOUNT) {
            Ok(Some(c)) => spec.capacity = c,
            _ => ok = false,
        },
    }
    spec.window = text(doc, "window", &mut ok);
    match t.get("period") {
        Some(item) if !matches!(item.value.get_ref(), DeValue::String(_)) => {
            doc.error(
                item.offset,
                &item.path,
                "expected a duration string such as \"90s\", \"1m\" or \"24h\" (an integer goes \
                 under `period_ms`, in milliseconds)",
            );
            ok = false;
        }
        _ => spec.period = text(doc, "period", &mut ok),
    }
    match t.get("period_ms") {
        Some(item) if !matches!(item.value.get_ref(), DeValue::Integer(_)) => {
            doc.error(
                item.offset,
                &item.path,
                "expected an integer number of milliseconds (a string such as \"1h\" goes under \
                 `period`)",
            );
            ok = false;
        }
        Some(item) => match item.u64_in(doc, 1, u64::MAX) {
            Ok(v) => spec.period_ms = v,
            Err(Bad) => ok = false,
        },
        None => {}
    }
    match opt(t
        .get("slices")
        .map(|i| i.u64_in(doc, 1, u64::from(allowance_core::MAX_SLICES))))
    {
        Ok(v) => spec.slices = v.flatten().and_then(|v| u32::try_from(v).ok()),
        Err(Bad) => ok = false,
    }
    spec.unit = text(doc, "unit", &mut ok);
    spec.zone = text(doc, "zone", &mut ok);
    match opt(t.get("guaranteed").map(|i| i.u64_in(doc, 0, MAX_AMOUNT))) {
        Ok(v) => spec.guaranteed = v.flatten(),
        Err(Bad) => ok = false,
    }
    if !ok {
        return Err(Bad);
    }
    limit_from_spec(&spec, catalog, "").map_err(|e| {
        let offset = Lines::of(t).find(&e.field, t.offset);
        doc.error(offset, &join(&t.path, &e.field), e.message);
        Bad
    })
}

fn read_kinds(
    doc: &mut Doc,
    root: &Table,
    catalog: &mut Catalog,
    plans: &Plans,
    notes: &mut Notes,
) -> Vec<String> {
    notes.kind_order.push(TENANT_KIND.to_string());
    let Ok(Some(t)) = root.table(doc, "kinds") else {
        return Vec::new();
    };
    let written = t.items().iter().map(|i| i.key.to_string()).collect();
    for item in t.items() {
        let Ok(kt) = item.table(doc) else { continue };
        kt.check_keys(doc, &["plan", "shared"]);
        if !valid_kind(item.key) {
            doc.error(
                item.offset,
                &item.path,
                "invalid kind name: expected [a-z][a-z0-9_-]{0,31}",
            );
            continue;
        }
        let mut ok = true;
        let plan_item = kt.get("plan");
        let mut plan = None;
        if let Some(pi) = &plan_item {
            match pi.str(doc) {
                Ok(name) if plans.built.iter().any(|p| p.name() == name) => plan = Some(name),
                // Defined with problems of its own, reported already.
                Ok(name) if plans.names.iter().any(|n| n == name) => ok = false,
                Ok(name) => {
                    let defined = if plans.names.is_empty() {
                        "no plan is defined".to_string()
                    } else {
                        format!("defined: {}", plans.names.join(", "))
                    };
                    doc.error(
                        pi.offset,
                        &pi.path,
                        format!("no plan named {name:?} ({defined})"),
                    );
                    ok = false;
                }
                Err(Bad) => ok = false,
            }
        }
        let shared_item = kt.get("shared");
        let shared = match shared_item.as_ref().map(|i| i.bool(doc)) {
            Some(Ok(b)) => b,
            Some(Err(Bad)) => {
                ok = false;
                false
            }
            None => false,
        };
        if !ok {
            continue;
        }
        if let Err(e) = catalog.set_kind(item.key, plan, shared) {
            let at = if e.field.ends_with(".shared") {
                shared_item.as_ref()
            } else {
                plan_item.as_ref()
            };
            let (offset, key) = at.map_or((item.offset, item.path.clone()), |i| {
                (i.offset, i.path.clone())
            });
            doc.error(offset, &key, e.message);
            continue;
        }
        if item.key != TENANT_KIND {
            notes.kind_order.push(item.key.to_string());
        }
    }
    written
}

// ---- models

fn read_models(doc: &mut Doc, root: &Table, catalog: &mut Catalog) {
    let Ok(Some(t)) = root.table(doc, "models") else {
        return;
    };
    for item in t.items() {
        if let Ok(price) = read_model(doc, &item)
            && let Err(e) = catalog.set_model(item.key, price)
        {
            doc.error(item.offset, &item.path, e.message);
        }
    }
}

/// A price per million tokens: a decimal string (`"2.50"`) or an integer.
fn price(doc: &mut Doc, t: &Table, key: &str) -> Read<u64> {
    let Some(item) = t.get(key) else {
        return Ok(None);
    };
    let text = match item.value.get_ref() {
        DeValue::String(s) => s.to_string(),
        DeValue::Integer(i) if i.radix() == 10 => i.as_str().to_string(),
        DeValue::Float(f) => {
            doc.error(
                item.offset,
                &item.path,
                format!(
                    "write prices as strings (\"{f}\"): a float cannot hold every decimal exactly"
                ),
            );
            return Err(Bad);
        }
        _ => {
            doc.error(
                item.offset,
                &item.path,
                "expected a decimal price per million tokens such as \"2.50\"",
            );
            return Err(Bad);
        }
    };
    parse_price_micros(&text, key).map(Some).map_err(|e| {
        doc.error(item.offset, &item.path, e.message);
        Bad
    })
}

fn read_model(doc: &mut Doc, item: &Item) -> Result<ModelPrice, Bad> {
    let t = item.table(doc)?;
    t.check_keys(
        doc,
        &[
            "input_per_million",
            "cached_input_per_million",
            "output_per_million",
            "max_output_tokens",
            "tokenizer",
        ],
    );
    let required = |doc: &mut Doc, key: &str| -> Result<u64, Bad> {
        match price(doc, &t, key)? {
            Some(p) => Ok(p),
            None => {
                doc.error(
                    item.offset,
                    &child_path(&t.path, key),
                    "required: a decimal price per million tokens such as \"2.50\"",
                );
                Err(Bad)
            }
        }
    };
    let input = required(doc, "input_per_million");
    let output = required(doc, "output_per_million");
    let cached = price(doc, &t, "cached_input_per_million");
    let max_output = opt(t
        .get("max_output_tokens")
        .map(|i| i.u64_in(doc, 1, MAX_OUTPUT_TOKENS_BOUND)))
    .map(Option::flatten);
    let tokenizer = opt(t.get("tokenizer").map(|i| {
        i.one_of(
            doc,
            &[("o200k_base", "o200k_base"), ("cl100k_base", "cl100k_base")],
        )
    }));
    let (input, output, cached, max_output, tokenizer) =
        (input?, output?, cached?, max_output?, tokenizer?);
    Ok(ModelPrice {
        input_micros_per_million: input,
        // Unpriced cached input costs what uncached input does: never
        // cheaper than the provider's bill.
        cached_input_micros_per_million: cached.unwrap_or(input),
        output_micros_per_million: output,
        max_output_tokens: max_output.unwrap_or(DEFAULT_MAX_OUTPUT_TOKENS),
        tokenizer: tokenizer.unwrap_or("o200k_base").to_string(),
    })
}

// ---- credentials

/// A SHA-256 in hex, either case (CONFIG.md answer 7).
fn sha256(doc: &mut Doc, item: &Item) -> Result<[u8; 32], Bad> {
    let text = item.str(doc)?;
    let bad = |doc: &mut Doc| {
        doc.error(
            item.offset,
            &item.path,
            format!(
                "expected a SHA-256 as 64 hex digits (`allowance token` prints one), got {} \
                 characters",
                text.chars().count()
            ),
        );
        Bad
    };
    let bytes = text.as_bytes();
    if bytes.len() != 64 {
        return Err(bad(doc));
    }
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        let (Some(hi), Some(lo)) = (hex_digit(pair[0]), hex_digit(pair[1])) else {
            doc.error(
                item.offset,
                &item.path,
                "expected a SHA-256 as 64 hex digits (0-9, a-f, either case)",
            );
            return Err(Bad);
        };
        out[i] = hi << 4 | lo;
    }
    Ok(out)
}

fn hex_digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// An id (tenant, user) as the engine accepts it in a scope.
fn id(doc: &mut Doc, item: &Item) -> Result<String, Bad> {
    let text = item.str(doc)?;
    if valid_id(text) {
        Ok(text.to_string())
    } else {
        doc.error(
            item.offset,
            &item.path,
            format!("{text:?} is not a valid id: expected [A-Za-z0-9._~@+=-]{{1,128}}"),
        );
        Err(Bad)
    }
}

fn required<'a, 'i>(
    doc: &mut Doc,
    t: &Table<'a, 'i>,
    key: &str,
    what: &str,
) -> Result<Item<'a, 'i>, Bad> {
    t.get(key).ok_or_else(|| {
        doc.error(
            t.offset,
            &child_path(&t.path, key),
            format!("required: {what}"),
        );
        Bad
    })
}

/// The tokens, each with the offset of its `sha256` (to report duplicates).
fn read_tokens(doc: &mut Doc, root: &Table) -> Vec<(TokenSpec, usize)> {
    let mut tokens: Vec<(TokenSpec, usize)> = Vec::new();
    let Some(item) = root.get("tokens") else {
        return tokens;
    };
    let Ok(tables) = tables_of(doc, &item) else {
        return tokens;
    };
    for t in tables.into_iter().flatten() {
        t.check_keys(doc, &["sha256", "role", "tenant"]);
        let hash = required(doc, &t, "sha256", "the token's SHA-256 in hex")
            .and_then(|i| sha256(doc, &i).map(|h| (h, i)));
        #[derive(Clone, Copy)]
        enum R {
            Admin,
            Tenant,
        }
        let role_item = required(doc, &t, "role", "\"admin\" or \"tenant\"");
        let role = role_item
            .as_ref()
            .map_err(|b| *b)
            .and_then(|i| i.one_of(doc, &[("admin", R::Admin), ("tenant", R::Tenant)]));
        let tenant_item = t.get("tenant");
        let role = match (role, &tenant_item) {
            (Ok(R::Admin), Some(ti)) => {
                doc.error(
                    ti.offset,
                    &ti.path,
                    "an admin token has no tenant (it acts on every tenant); remove it or use \
                     role = \"tenant\"",
                );
                Err(Bad)
            }
            (Ok(R::Admin), None) => Ok(Role::Admin),
            (Ok(R::Tenant), Some(ti)) => match id(doc, ti) {
                // Its reservations are the gateway's upstream attempts: a
                // token for it could settle or refund them.
                Ok(t) if t == GATEWAY_TENANT => {
                    doc.error(
                        ti.offset,
                        &ti.path,
                        format!(
                            "{GATEWAY_TENANT:?} is the gateway's internal tenant (its upstream attempts)"
                        ),
                    );
                    Err(Bad)
                }
                other => other.map(Role::Tenant),
            },
            (Ok(R::Tenant), None) => {
                let offset = role_item.as_ref().map_or(t.offset, |i| i.offset);
                doc.error(
                    offset,
                    &child_path(&t.path, "tenant"),
                    "required when role = \"tenant\": the tenant this token acts for",
                );
                Err(Bad)
            }
            (Err(Bad), _) => Err(Bad),
        };
        if let Ok((hash, hi)) = hash {
            if let Some(first) = tokens.iter().position(|(tk, _)| tk.sha256 == hash) {
                doc.error(
                    hi.offset,
                    &hi.path,
                    format!("the same hash as tokens[{first}]: one token has one role"),
                );
            } else if let Ok(role) = role {
                tokens.push((TokenSpec { sha256: hash, role }, hi.offset));
            }
        }
    }
    tokens
}

// ---- gateway

fn read_gateway(
    doc: &mut Doc,
    root: &Table,
    catalog: &Catalog,
    kinds_written: &[String],
    tokens: &[(TokenSpec, usize)],
) -> Option<GatewaySettings> {
    let gateway_item = root.get("gateway")?;
    let t = gateway_item.table(doc).ok()?;
    t.check_keys(
        doc,
        &[
            "stream_tranche_tokens",
            "max_body_bytes",
            "upstreams",
            "keys",
        ],
    );
    let stream_tranche_tokens = or(
        opt(t
            .get("stream_tranche_tokens")
            .map(|i| i.u64_in(doc, 1, 1_000_000)))
        .map(Option::flatten),
        1024,
    );
    let max_body_bytes = or(
        opt(t
            .get("max_body_bytes")
            .map(|i| i.u64_in(doc, 1, MAX_BODY_BYTES_BOUND)))
        .map(Option::flatten),
        32 << 20,
    ) as usize;
    let upstreams = read_upstreams(doc, &t);
    let keys = read_gateway_keys(doc, &t, catalog, kinds_written, tokens);
    Some(GatewaySettings {
        stream_tranche_tokens,
        max_body_bytes,
        upstreams,
        keys,
    })
}

/// Makes the gateway's upstream limits ledger limits: the kind `upstream`
/// (shared; configured by the file or added here), each upstream's scope
/// given its own limits (requests, input and output tokens per minute as
/// token buckets, concurrency as a gauge), and the internal
/// [`GATEWAY_TENANT`] without limits.
fn install_upstreams(doc: &mut Doc, root: &Table, catalog: &mut Catalog, g: &GatewaySettings) {
    match catalog.kind(UPSTREAM_KIND) {
        Some(k) if !k.shared => {
            // At `shared = false` if written, else at `[kinds.upstream]`.
            let upstream = root
                .get("kinds")
                .and_then(|k| k.table(doc).ok())
                .and_then(|t| t.get(UPSTREAM_KIND));
            let shared = upstream
                .as_ref()
                .and_then(|u| u.table(doc).ok())
                .and_then(|t| t.get("shared"));
            let offset = shared
                .map(|i| i.offset)
                .or(upstream.map(|i| i.offset))
                .unwrap_or(root.offset);
            doc.error(
                offset,
                "kinds.upstream.shared",
                "the kind `upstream` holds the gateway's shared upstream scopes: it must be `shared = true`",
            );
            return;
        }
        Some(_) => {}
        None => {
            if let Err(e) = catalog.set_kind(UPSTREAM_KIND, None, true) {
                doc.error(root.offset, &e.field, e.message);
                return;
            }
        }
    }
    let minute = Window::Bucket { period_ms: 60_000 };
    for u in &g.upstreams {
        let mut limits = Vec::new();
        for (dimension, capacity) in [
            (Dimension::REQUESTS, u.requests_per_minute),
            (Dimension::INPUT_TOKENS, u.input_tokens_per_minute),
            (Dimension::OUTPUT_TOKENS, u.output_tokens_per_minute),
        ] {
            if let Some(c) = capacity
                && let Ok(l) = Limit::new(dimension, c, minute.clone())
            {
                limits.push(l);
            }
        }
        if let Some(c) = u.max_concurrent
            && let Ok(l) = Limit::new(Dimension::CONCURRENT, c, Window::Concurrent)
        {
            limits.push(l);
        }
        let plan = Plan::new(
            &format!("upstream-{}", u.name),
            limits,
            OverrunPolicy::ChargeActual,
        );
        let scope = ScopeKey::new(
            GATEWAY_TENANT,
            UPSTREAM_KIND,
            &u.name,
            true,
            "gateway.upstreams.name",
        );
        if let (Ok(plan), Ok(scope)) = (plan, scope) {
            let _ = catalog.set_override(scope, Override::Limits(plan));
        }
    }
    if let (Ok(plan), Ok(scope)) = (
        Plan::new("gateway-internal", Vec::new(), OverrunPolicy::ChargeActual),
        ScopeKey::tenant(GATEWAY_TENANT),
    ) {
        let _ = catalog.set_override(scope, Override::Limits(plan));
    }
}

fn read_upstreams(doc: &mut Doc, gateway: &Table) -> Vec<UpstreamSettings> {
    let mut out: Vec<UpstreamSettings> = Vec::new();
    let Some(item) = gateway.get("upstreams") else {
        doc.error(
            gateway.offset,
            &child_path(&gateway.path, "upstreams"),
            "required: at least one [[gateway.upstreams]] to forward calls to",
        );
        return out;
    };
    let Ok(tables) = tables_of(doc, &item) else {
        return out;
    };
    if tables.is_empty() {
        doc.error(item.offset, &item.path, "at least one upstream is needed");
    }
    // Which upstream each model is routed to, to refuse ambiguous routes.
    let mut routes: Vec<(String, String)> = Vec::new();
    for t in tables.into_iter().flatten() {
        t.check_keys(
            doc,
            &[
                "name",
                "base_url",
                "api_key_env",
                "models",
                "requests_per_minute",
                "input_tokens_per_minute",
                "output_tokens_per_minute",
                "max_concurrent",
                "max_retries",
            ],
        );
        let name = required(
            doc,
            &t,
            "name",
            "the upstream's name (its scope is upstream:<name>)",
        )
        .and_then(|i| {
            let n = id(doc, &i)?;
            if out.iter().any(|u| u.name == n) {
                doc.error(i.offset, &i.path, format!("a second upstream named {n:?}"));
                return Err(Bad);
            }
            Ok(n)
        });
        let base_url = required(doc, &t, "base_url", "such as \"https://api.openai.com\"")
            .and_then(|i| base_url(doc, &i));
        let api_key_env = opt(t.get("api_key_env").map(|i| {
            let v = i.str(doc)?;
            let b = v.as_bytes();
            let valid = !b.is_empty()
                && b.len() <= 256
                && !b[0].is_ascii_digit()
                && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_');
            if valid {
                Ok(v.to_string())
            } else {
                doc.error(
                    i.offset,
                    &i.path,
                    format!("expected the name of an environment variable such as \"OPENAI_API_KEY\", got {v:?}"),
                );
                Err(Bad)
            }
        }));
        let models =
            required(doc, &t, "models", "the models routed here, or [\"*\"]").and_then(|i| {
                let models = i.strings(doc)?;
                if models.is_empty() {
                    doc.error(
                        i.offset,
                        &i.path,
                        "name at least one model, or \"*\" for all",
                    );
                    return Err(Bad);
                }
                let mut bad = false;
                for m in &models {
                    if m.is_empty() || m.len() > 128 {
                        doc.error(i.offset, &i.path, "a model name has 1 to 128 characters");
                        bad = true;
                    } else if let Some((_, other)) = routes.iter().find(|(r, _)| r == m) {
                        doc.error(
                            i.offset,
                            &i.path,
                            format!("model {m:?} is already routed to upstream {other:?}"),
                        );
                        bad = true;
                    }
                }
                if bad { Err(Bad) } else { Ok((models, i)) }
            });
        let rate = |doc: &mut Doc, key: &str| {
            opt(t.get(key).map(|i| i.u64_in(doc, 1, MAX_AMOUNT))).map(Option::flatten)
        };
        let rpm = rate(doc, "requests_per_minute");
        let itpm = rate(doc, "input_tokens_per_minute");
        let otpm = rate(doc, "output_tokens_per_minute");
        let conc =
            opt(t.get("max_concurrent").map(|i| i.u64_in(doc, 1, 1_000_000))).map(Option::flatten);
        let retries = opt(t
            .get("max_retries")
            .map(|i| i.u64_in(doc, 0, MAX_RETRIES_BOUND)))
        .map(Option::flatten);
        if let (
            Ok(name),
            Ok(base_url),
            Ok(api_key_env),
            Ok((models, _)),
            Ok(rpm),
            Ok(itpm),
            Ok(otpm),
            Ok(conc),
            Ok(retries),
        ) = (
            name,
            base_url,
            api_key_env,
            models,
            rpm,
            itpm,
            otpm,
            conc,
            retries,
        ) {
            for m in &models {
                routes.push((m.clone(), name.clone()));
            }
            out.push(UpstreamSettings {
                name,
                base_url,
                api_key_env,
                models,
                requests_per_minute: rpm,
                input_tokens_per_minute: itpm,
                output_tokens_per_minute: otpm,
                max_concurrent: conc,
                max_retries: retries.map_or(DEFAULT_MAX_RETRIES, |r| r as u32),
            });
        }
    }
    out
}

/// An upstream's base URL: http(s), without the `/v1` the client's path
/// brings (HTTP-API.md answer 10); a trailing `/` is dropped.
fn base_url(doc: &mut Doc, item: &Item) -> Result<String, Bad> {
    let url = item.str(doc)?;
    let trimmed = url.trim_end_matches('/');
    let rest = trimmed
        .strip_prefix("https://")
        .or_else(|| trimmed.strip_prefix("http://"));
    let problem = match rest {
        None => {
            Some("expected an http:// or https:// URL such as \"https://api.openai.com\"".into())
        }
        Some(host) if host.is_empty() || host.starts_with('/') => {
            Some("the URL has no host".into())
        }
        Some(_) if trimmed.ends_with("/v1") => Some(
            "leave out `/v1`: the client's path (/v1/chat/completions) is appended as received"
                .into(),
        ),
        Some(_) if url.len() > 2048 || url.chars().any(char::is_whitespace) => {
            Some("not a valid URL".into())
        }
        // The parser reqwest uses: a URL it refuses would fail every call.
        Some(_) => match url::Url::parse(trimmed) {
            Err(e) => Some(format!("not a valid URL ({e})")),
            Ok(parsed) if parsed.query().is_some() || parsed.fragment().is_some() => {
                Some("a base URL has no query or fragment (the client's path is appended)".into())
            }
            Ok(_) => None,
        },
    };
    match problem {
        Some(why) => {
            doc.error(item.offset, &item.path, format!("{why}, got {url:?}"));
            Err(Bad)
        }
        None => Ok(trimmed.to_string()),
    }
}

/// What is wrong with a Redis URL, checked as the store will read it (the
/// parser redis-rs uses, its rules for the host and the database, and the
/// store's own `redis+sentinel://` form), so that `check-config` refuses
/// what `serve` could not connect with.
fn redis_url_problem(url: &str) -> Option<String> {
    if url.len() > 4096 || url.chars().any(char::is_whitespace) {
        return Some("not a valid URL".into());
    }
    if url.starts_with("rediss+sentinel://") {
        return Some("TLS through Sentinel (rediss+sentinel://) is not supported yet".into());
    }
    if let Some(rest) = url.strip_prefix("redis+sentinel://") {
        let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
        let Some((hosts, path)) = rest.split_once('/') else {
            return Some(
                "a Sentinel URL names its master: redis+sentinel://host:port/master_name".into(),
            );
        };
        let mut path = path.split('/');
        if path.next().is_none_or(str::is_empty) {
            return Some(
                "a Sentinel URL names its master: redis+sentinel://host:port/master_name".into(),
            );
        }
        if let Some(problem) = db_problem(path.next().unwrap_or("")) {
            return Some(problem);
        }
        if path.next().is_some() {
            return Some("a Sentinel URL ends at /master_name[/db]".into());
        }
        if hosts.split(',').all(str::is_empty) {
            return Some("a Sentinel URL needs at least one sentinel address".into());
        }
        for host in hosts.split(',').filter(|h| !h.is_empty()) {
            if let Some(problem) = tcp_problem(&format!("redis://{host}")) {
                return Some(format!("sentinel {host:?}: {problem}"));
            }
        }
        return None;
    }
    let parsed = match url::Url::parse(url) {
        Ok(parsed) => parsed,
        Err(e) => return Some(format!("not a valid URL ({e})")),
    };
    match parsed.scheme() {
        "redis" | "rediss" | "valkey" | "valkeys" => tcp_problem(url),
        "unix" | "redis+unix" | "valkey+unix" => match parsed.to_file_path() {
            Ok(path) if path.as_os_str().len() > 1 => None,
            _ => Some("a unix:// URL names the socket's path: unix:///run/redis.sock".into()),
        },
        other => Some(format!(
            "unknown scheme {other:?}: expected redis://, rediss://, redis+sentinel:// or unix://"
        )),
    }
}

/// A TCP Redis URL's host, port, database and fragment, as redis-rs reads
/// them.
fn tcp_problem(url: &str) -> Option<String> {
    let parsed = match url::Url::parse(url) {
        Ok(parsed) => parsed,
        Err(e) => return Some(format!("not a valid URL ({e})")),
    };
    match parsed.host_str() {
        None | Some("") => return Some("the URL has no host".into()),
        Some("0.0.0.0" | "[::]") => {
            return Some("a wildcard address (0.0.0.0 or ::) is not a server to connect to".into());
        }
        Some(_) => {}
    }
    if let Some(problem) = db_problem(parsed.path().trim_matches('/')) {
        return Some(problem);
    }
    match parsed.fragment() {
        None => None,
        Some("insecure") if matches!(parsed.scheme(), "rediss" | "valkeys") => None,
        Some(_) => Some("the only fragment is #insecure, on a rediss:// URL".into()),
    }
}

/// The database number of a Redis URL's path (`""` is database 0).
fn db_problem(db: &str) -> Option<String> {
    match db {
        "" => None,
        db if db.parse::<u32>().is_ok() => None,
        db => Some(format!("the database {db:?} is not a number")),
    }
}

fn read_gateway_keys(
    doc: &mut Doc,
    gateway: &Table,
    catalog: &Catalog,
    kinds_written: &[String],
    tokens: &[(TokenSpec, usize)],
) -> Vec<GatewayKey> {
    // A kind written with problems of its own is reported already: naming
    // it again here would only repeat that.
    let broken =
        |kind: &str| catalog.kind(kind).is_none() && kinds_written.iter().any(|k| k == kind);
    let mut out: Vec<GatewayKey> = Vec::new();
    let Some(item) = gateway.get("keys") else {
        return out;
    };
    let Ok(tables) = tables_of(doc, &item) else {
        return out;
    };
    let mut seen: HashSet<[u8; 32]> = HashSet::new();
    for t in tables.into_iter().flatten() {
        t.check_keys(doc, &["sha256", "tenant", "user", "agent", "client_scopes"]);
        let hash = required(doc, &t, "sha256", "the key's SHA-256 in hex").and_then(|i| {
            let h = sha256(doc, &i)?;
            if tokens.iter().any(|(tk, _)| tk.sha256 == h) {
                doc.error(
                    i.offset,
                    &i.path,
                    "the same secret as an API token in [[tokens]]: a gateway key and an API \
                     token must differ (CONFIG.md answer 7)",
                );
                return Err(Bad);
            }
            if !seen.insert(h) {
                doc.error(i.offset, &i.path, "the same hash as an earlier gateway key");
                return Err(Bad);
            }
            Ok(h)
        });
        let tenant = required(
            doc,
            &t,
            "tenant",
            "the tenant the key's calls count against",
        )
        .and_then(|i| {
            let t = id(doc, &i)?;
            if t == GATEWAY_TENANT {
                doc.error(
                    i.offset,
                    &i.path,
                    format!("{GATEWAY_TENANT:?} is the gateway's internal tenant (its upstream attempts)"),
                );
                return Err(Bad);
            }
            Ok(t)
        });
        let scope_id = |doc: &mut Doc, kind: &str| -> Read<String> {
            let Some(i) = t.get(kind) else {
                return Ok(None);
            };
            let v = id(doc, &i)?;
            match catalog.kind(kind) {
                Some(k) if !k.shared => Ok(Some(v)),
                None if broken(kind) => Err(Bad),
                _ => {
                    doc.error(
                        i.offset,
                        &i.path,
                        format!("needs a configured, non-shared kind `{kind}` ([kinds.{kind}])"),
                    );
                    Err(Bad)
                }
            }
        };
        let user = scope_id(doc, "user");
        let agent = scope_id(doc, "agent");
        let client_scopes = opt(t.get("client_scopes").map(|i| {
            let kinds = i.strings(doc)?;
            let mut bad = false;
            for k in &kinds {
                if broken(k) {
                    bad = true;
                    continue;
                }
                let fine = k != TENANT_KIND && catalog.kind(k).is_some_and(|s| !s.shared);
                if !fine {
                    doc.error(
                        i.offset,
                        &i.path,
                        format!("{k:?} is not a configured kind a client may add (not tenant, not shared)"),
                    );
                    bad = true;
                }
            }
            if bad { Err(Bad) } else { Ok(kinds) }
        }));
        if let (Ok(sha256), Ok(tenant), Ok(user), Ok(agent), Ok(client_scopes)) =
            (hash, tenant, user, agent, client_scopes)
        {
            out.push(GatewayKey {
                sha256,
                tenant,
                user,
                agent,
                client_scopes: client_scopes.unwrap_or_default(),
            });
        }
    }
    out
}
