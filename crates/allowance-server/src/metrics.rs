//! Prometheus metrics (HTTP-API.md "Operations"). Labels are bounded: an
//! operation name, an outcome, a scope *kind* (from the configuration),
//! a dimension (configured ones only) and a denial type — never a scope id,
//! a tenant or a reservation.

use std::sync::OnceLock;
use std::time::Duration;

use allowance_core::{Denial, StoreStats};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Operations by outcome: `op` (reserve, settle, refund, extend, get,
/// status, admin, usage), `outcome` (ok, replayed, dry_run, denied, invalid,
/// not_found, conflict, unavailable, …).
pub const OPERATIONS: &str = "allowance_operations_total";
/// Denials by `scope_kind`, `dimension` and `type`.
pub const DENIALS: &str = "allowance_denials_total";
/// Latency of each operation, as seen by the handler (`op`).
pub const DURATION: &str = "allowance_operation_duration_seconds";
/// Reservations HELD now.
pub const HELD: &str = "allowance_held_reservations";
/// Reservations expired since start.
pub const EXPIRED: &str = "allowance_expired_reservations_total";
/// Store calls that did not answer (`op`: an operation's name, or
/// `expire`, `ready`, `stats`, `gateway` — see [`store_error`]).
pub const STORE_ERRORS: &str = "allowance_store_errors_total";
/// Reserves answered from an idempotency key.
pub const REPLAYS: &str = "allowance_idempotent_replays_total";

/// Installs the process-wide recorder once and returns its handle (a
/// second call returns the first handle).
pub fn install() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let buckets = [
                0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005,
                0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            ];
            // Waits and upstream calls span milliseconds to minutes; the
            // estimate ratio sits around 1. Histograms, not summaries: they
            // aggregate across instances.
            let waits = [
                0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                120.0, 300.0, 600.0,
            ];
            let ratios = [0.5, 0.75, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0];
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(DURATION.to_string()), &buckets)
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full("allowance_queue_wait_seconds".into()),
                        &waits,
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full("allowance_gateway_upstream_seconds".into()),
                        &waits,
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full("allowance_gateway_input_estimate_ratio".into()),
                        &ratios,
                    )
                })
                .unwrap_or_else(|_| PrometheusBuilder::new());
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            // Another recorder already installed (an embedding program's):
            // ours still renders what is recorded through it directly.
            let _ = metrics::set_global_recorder(recorder);
            describe();
            handle
        })
        .clone()
}

fn describe() {
    metrics::describe_counter!(OPERATIONS, "Ledger operations by outcome.");
    metrics::describe_counter!(DENIALS, "Denials by scope kind, dimension and type.");
    metrics::describe_histogram!(
        DURATION,
        metrics::Unit::Seconds,
        "Handler latency of ledger operations."
    );
    metrics::describe_gauge!(HELD, "Reservations held now.");
    metrics::describe_counter!(EXPIRED, "Reservations expired since the server started.");
    metrics::describe_counter!(STORE_ERRORS, "Store calls that did not answer.");
    metrics::describe_counter!(REPLAYS, "Reserves answered from an idempotency key.");
    metrics::describe_gauge!(
        "allowance_store_answering_locally",
        "1 while a fail_open_local store admits on its own ledger (Redis down, or the hand-over after)."
    );
    metrics::describe_counter!(
        "allowance_store_local_admissions_total",
        "Reservations admitted on the local ledger during Redis outages."
    );
    metrics::describe_counter!(
        "allowance_store_local_imports_total",
        "Locally admitted reservations reconciled into Redis."
    );
    metrics::describe_gauge!(
        "allowance_store_local_pending",
        "Locally admitted reservations not yet reconciled into Redis."
    );
}

/// The operations and outcomes [`operation`] is called with: their
/// handles are registered once, so an operation's accounting is two atomic
/// updates, not a registry look-up that copies the key's labels each time.
const OPS: [&str; 8] = [
    "reserve", "settle", "refund", "extend", "get", "status", "admin", "usage",
];
const OUTCOMES: [&str; 10] = [
    "ok",
    "replayed",
    "dry_run",
    "invalid",
    "refused",
    "not_found",
    "conflict",
    "denied",
    "unavailable",
    "error",
];

struct OpHandles {
    duration: metrics::Histogram,
    outcomes: [metrics::Counter; OUTCOMES.len()],
    store_errors: metrics::Counter,
}

fn handles() -> &'static [OpHandles] {
    static HANDLES: OnceLock<Vec<OpHandles>> = OnceLock::new();
    HANDLES.get_or_init(|| {
        // Handles taken before the recorder is installed would be no-ops.
        install();
        OPS.iter()
            .map(|&op| OpHandles {
                duration: metrics::histogram!(DURATION, "op" => op),
                outcomes: OUTCOMES
                    .map(|outcome| metrics::counter!(OPERATIONS, "op" => op, "outcome" => outcome)),
                store_errors: metrics::counter!(STORE_ERRORS, "op" => op),
            })
            .collect()
    })
}

/// Counts one operation's outcome and latency.
pub fn operation(op: &'static str, outcome: &'static str, elapsed: Duration) {
    if outcome == "replayed" {
        metrics::counter!(REPLAYS).increment(1);
    }
    let op_at = OPS.iter().position(|&o| o == op);
    let outcome_at = OUTCOMES.iter().position(|&o| o == outcome);
    let (Some(op_at), Some(outcome_at)) = (op_at, outcome_at) else {
        // A name outside the tables: the registry's slower path.
        metrics::counter!(OPERATIONS, "op" => op, "outcome" => outcome).increment(1);
        metrics::histogram!(DURATION, "op" => op).record(elapsed.as_secs_f64());
        if outcome == "unavailable" {
            metrics::counter!(STORE_ERRORS, "op" => op).increment(1);
        }
        return;
    };
    let h = &handles()[op_at];
    h.outcomes[outcome_at].increment(1);
    h.duration.record(elapsed.as_secs_f64());
    if outcome == "unavailable" {
        h.store_errors.increment(1);
    }
}

/// Counts a denial by scope kind, dimension and type.
pub fn denial(d: &Denial) {
    metrics::counter!(
        DENIALS,
        "scope_kind" => d.scope.kind().to_string(),
        "dimension" => d.dimension.clone(),
        "type" => d.kind.as_str()
    )
    .increment(1);
}

/// Counts a store call that did not answer outside an operation's handler
/// (`op`: `expire` for the sweeper, `ready` for `/readyz`, `stats` for a
/// scrape's read, `gateway`), so an outage with no client traffic still
/// shows.
pub fn store_error(op: &'static str) {
    metrics::counter!(STORE_ERRORS, "op" => op).increment(1);
}

/// Publishes a fail-open store's state (read at scrape time): whether it
/// answers on its own ledger now, and what it admitted there.
pub fn fail_open(f: allowance_core::FailOpenStats) {
    metrics::gauge!("allowance_store_answering_locally").set(u8::from(f.answering_locally));
    metrics::counter!("allowance_store_local_admissions_total").absolute(f.admitted_locally_total);
    metrics::counter!("allowance_store_local_imports_total").absolute(f.imported_total);
    metrics::gauge!("allowance_store_local_pending").set(f.pending_reconciliation as f64);
}

/// Publishes the store's counters (read at scrape time).
pub fn store_stats(s: StoreStats) {
    metrics::gauge!(HELD).set(s.held_reservations as f64);
    metrics::counter!(EXPIRED).absolute(s.expired_total);
}
