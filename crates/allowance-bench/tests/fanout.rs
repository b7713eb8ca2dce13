//! The `fanout` scenario (issue 6): its name, the ideal schedule's
//! arithmetic, reading a scope status, the report's figures and table, and
//! one short run against a stand-in server on 127.0.0.1.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use allowance_bench::{
    BenchError, BenchOptions, FANOUT_RATIO_TARGET, FanoutOptions, FanoutPlan, FanoutReport,
    IdealSchedule, Latency, Overhead, Report, Scenario, ScopeReading, measure_ceiling, run,
};
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use common::{axum_server, noop};

/// The issue's plan: 60 requests per minute compressed 10× (a bucket of 60
/// over 6 s) and a 350,000-token total budget.
fn issue_plan() -> FanoutPlan {
    FanoutPlan {
        requests_capacity: 60,
        requests_period: Duration::from_secs(6),
        token_budget: 350_000,
    }
}

/// `fanout` parses, prints, is listed, and ends its pairs with a settle.
#[test]
fn scenario_name() {
    assert_eq!("fanout".parse(), Ok(Scenario::Fanout));
    assert_eq!(Scenario::Fanout.to_string(), "fanout");
    assert!(Scenario::ALL.contains(&Scenario::Fanout));
    assert_eq!(Scenario::Fanout.second_call(), "settle");
    let err = "fan-out".parse::<Scenario>().expect_err("unknown");
    assert!(err.to_string().contains("fanout"), "{err}");
    // The issue's defaults.
    let f = FanoutOptions::default();
    assert_eq!(
        (
            f.tasks,
            f.input_tokens,
            f.output_tokens,
            f.call,
            f.overhead_rounds
        ),
        (120, 3_000, 500, Duration::from_millis(200), 50)
    );
}

/// The issue's figures: 100 of 120 fit the budget; 60 at once, then 40 at
/// one per 100 ms, plus the last call: 4.2 s.
#[test]
fn ideal_schedule_of_the_issue() {
    let ideal = IdealSchedule::new(&issue_plan(), 120, 3_500, Duration::from_millis(200));
    assert_eq!(
        ideal,
        IdealSchedule {
            admitted: 100,
            refused: 20,
            duration: Duration::from_millis(4_200),
        }
    );
}

/// The edges: the bucket does not bind, the budget does not bind, nothing
/// fits, P/C not a whole number of nanoseconds, a task of no tokens.
#[test]
fn ideal_schedule_edges() {
    let call = Duration::from_millis(200);
    // At most C admitted: all at t = 0, the ideal is one call.
    let few = IdealSchedule::new(&issue_plan(), 50, 3_500, call);
    assert_eq!((few.admitted, few.refused, few.duration), (50, 0, call));
    let exactly_c = IdealSchedule::new(&issue_plan(), 60, 3_500, call);
    assert_eq!(exactly_c.duration, call);
    // One past C: one refill (100 ms) then the call.
    let one_more = IdealSchedule::new(&issue_plan(), 61, 3_500, call);
    assert_eq!(one_more.duration, Duration::from_millis(300));
    // A budget with room for all: N admitted.
    let rich = FanoutPlan {
        token_budget: 10_000_000,
        ..issue_plan()
    };
    let all = IdealSchedule::new(&rich, 120, 3_500, call);
    assert_eq!((all.admitted, all.refused), (120, 0));
    assert_eq!(all.duration, Duration::from_millis(6_000 + 200));
    // Nothing fits: nothing to wait for.
    let poor = FanoutPlan {
        token_budget: 3_499,
        ..issue_plan()
    };
    let none = IdealSchedule::new(&poor, 120, 3_500, call);
    assert_eq!(
        (none.admitted, none.refused, none.duration),
        (0, 120, Duration::ZERO)
    );
    // A bucket of 7 per second: 3 past C take 3/7 s, truncated to the nanosecond.
    let sevens = FanoutPlan {
        requests_capacity: 7,
        requests_period: Duration::from_secs(1),
        token_budget: 1_000_000,
    };
    let odd = IdealSchedule::new(&sevens, 10, 100, Duration::ZERO);
    assert_eq!(odd.duration, Duration::from_nanos(428_571_428));
    // Tasks of no tokens never meet the budget.
    let free = IdealSchedule::new(&poor, 5, 0, call);
    assert_eq!(free.admitted, 5);
}

/// A status answer as `GET /v1/scopes/tenant:fanout-1` gives it.
fn status_json(requests_remaining: i64, tokens_used: i64, tokens_held: u64) -> String {
    format!(
        r#"{{"scope": "tenant:fanout-1", "plan": "fanout", "held_reservations": 0, "limits": [
            {{"dimension": "requests", "window": "bucket", "period_ms": 6000, "capacity": 60,
              "used": {}, "held": 0, "remaining": {requests_remaining}, "resets_at": null}},
            {{"dimension": "tokens", "window": "total", "capacity": 350000,
              "used": {tokens_used}, "held": {tokens_held}, "remaining": {}, "resets_at": null}}]}}"#,
        60 - requests_remaining,
        350_000 - tokens_used - tokens_held as i64
    )
}

/// The plan is read from the bucket and the total budget; a fresh tenant
/// is told from a used one.
#[test]
fn scope_status_is_read() {
    let fresh = ScopeReading::parse(status_json(60, 0, 0).as_bytes()).expect("parse");
    assert_eq!(fresh.plan, issue_plan());
    assert!(fresh.is_fresh());
    assert_eq!((fresh.tokens_used, fresh.tokens_held), (0, 0));

    let after = ScopeReading::parse(status_json(3, 350_000, 0).as_bytes()).expect("parse");
    assert_eq!(after.tokens_used, 350_000);
    assert!(!after.is_fresh());
    for (remaining, used, held) in [(59, 0, 0), (60, 1, 0), (60, 0, 3_500)] {
        let reading =
            ScopeReading::parse(status_json(remaining, used, held).as_bytes()).expect("parse");
        assert!(!reading.is_fresh(), "{reading:?}");
    }
}

/// A plan without the two limits, or a body that is no status, is refused
/// with the reason.
#[test]
fn scope_status_without_the_limits() {
    let no_bucket = r#"{"scope": "tenant:x", "plan": "p", "held_reservations": 0, "limits": [
        {"dimension": "requests", "window": "sliding", "period_ms": 60000, "slices": 60,
         "capacity": 60, "used": 0, "held": 0, "remaining": 60, "resets_at": null},
        {"dimension": "tokens", "window": "total", "capacity": 5, "used": 0, "held": 0,
         "remaining": 5, "resets_at": null}]}"#;
    let err = ScopeReading::parse(no_bucket.as_bytes()).expect_err("no bucket");
    assert!(err.contains("requests") && err.contains("bucket"), "{err}");

    let no_budget = r#"{"scope": "tenant:x", "plan": "p", "held_reservations": 0, "limits": [
        {"dimension": "requests", "window": "bucket", "period_ms": 60000,
         "capacity": 60, "used": 0, "held": 0, "remaining": 60, "resets_at": null},
        {"dimension": "concurrent", "window": "concurrent", "capacity": 20, "used": 0,
         "held": 0, "remaining": 20, "resets_at": null}]}"#;
    let err = ScopeReading::parse(no_budget.as_bytes()).expect_err("no budget");
    assert!(err.contains("tokens") && err.contains("total"), "{err}");

    let err = ScopeReading::parse(br#"{"error": {"type": "not_found"}}"#).expect_err("no status");
    assert!(err.contains("not a scope status"), "{err}");
}

fn latency(p50_us: u64, count: u64) -> Latency {
    Latency {
        count,
        p50: Duration::from_micros(p50_us),
        p99: Duration::from_micros(p50_us * 3),
        p999: Duration::from_micros(p50_us * 4),
        max: Duration::from_micros(p50_us * 5),
    }
}

fn sample_report(total_ms: u64, tokens_used: i64) -> FanoutReport {
    let plan = issue_plan();
    FanoutReport {
        server: "http://127.0.0.1:8787".to_owned(),
        tenant: "fanout-1".to_owned(),
        tasks: 120,
        tokens_per_task: 3_500,
        call: Duration::from_millis(200),
        plan,
        ideal: IdealSchedule::new(&plan, 120, 3_500, Duration::from_millis(200)),
        admitted: 100,
        settled: 100,
        refused: 20,
        refused_by_kind: BTreeMap::from([("402 budget_exhausted".to_owned(), 20)]),
        errors: 0,
        errors_by_kind: BTreeMap::new(),
        total: Duration::from_millis(total_ms),
        first_queued: Some(Duration::from_micros(304_100)),
        tokens_used,
        tokens_held: 0,
        wait: latency(1_500, 100),
        refusal: latency(4_200_000, 20),
        settle: latency(450, 100),
        overhead: Some(Ok(Overhead {
            tenant: "fanout-1-overhead".to_owned(),
            rounds: 50,
            immediate_reserve: latency(100, 50),
            immediate_pair: latency(200, 50),
            freed_to_admitted: latency(180, 50),
            queued_p50_us: -15,
            waiter_first: 34,
        })),
    }
}

/// The figures: ratio over the ideal, overspend over the budget, the
/// overhead's differences, and the verdict.
#[test]
fn report_figures() {
    let met = sample_report(4_410, 350_000);
    let ratio = met.ratio().expect("an ideal");
    assert!((ratio - 1.05).abs() < 1e-9, "{ratio}");
    assert_eq!(met.overspend(), 0);
    assert!(met.meets_targets());
    let Some(Ok(o)) = &met.overhead else {
        panic!("overhead")
    };
    assert!((o.queued_p50_ms() - -0.015).abs() < 1e-9);
    assert!((o.vs_reserve_ms() - -0.115).abs() < 1e-9);
    assert!((o.vs_pair_ms() - -0.215).abs() < 1e-9);

    let slow = sample_report(4_700, 350_000);
    assert!(slow.ratio().is_some_and(|r| r > FANOUT_RATIO_TARGET));
    assert!(!slow.meets_targets());

    let over = sample_report(4_410, 353_500);
    assert_eq!(over.overspend(), 3_500);
    assert!(!over.meets_targets());

    let short = FanoutReport {
        admitted: 99,
        ..sample_report(4_410, 346_500)
    };
    assert!(!short.meets_targets(), "fewer admitted than the ideal");

    let empty = FanoutReport {
        ideal: IdealSchedule {
            admitted: 0,
            refused: 120,
            duration: Duration::ZERO,
        },
        ..sample_report(4_410, 0)
    };
    assert_eq!(empty.ratio(), None);
    assert!(!empty.meets_targets());
}

/// The first word of the line that starts with `key`, and the rest split
/// on blanks: what `scripts/bench-queue.sh` reads with awk.
fn fields(table: &str, key: &str) -> Vec<String> {
    let line = table
        .lines()
        .find(|l| l.starts_with(&format!("  {key} ")))
        .unwrap_or_else(|| panic!("no line for {key:?} in\n{table}"));
    line.split_whitespace().map(str::to_owned).collect()
}

/// The table has the lines the script picks its figures from, at the
/// columns it reads them, and the verdicts.
#[test]
fn report_table() {
    let table = sample_report(4_410, 350_000).to_string();
    assert!(
        table.starts_with(
            "http://127.0.0.1:8787 · scenario fanout · tenant:fanout-1 · 120 tasks of 3500 tokens, 200.000 ms call\n"
        ),
        "{table}"
    );
    assert!(
        table.contains("  plan         requests 60 per 6.000 s (bucket) · tokens 350000 (total)\n"),
        "{table}"
    );
    assert_eq!(fields(&table, "admitted")[1], "100");
    assert!(table.contains("(ideal 100; settled 100)"), "{table}");
    assert_eq!(fields(&table, "refused")[1], "20");
    assert!(
        table.contains("    refused          20  402 budget_exhausted\n"),
        "{table}"
    );
    assert_eq!(fields(&table, "errors")[1], "0");
    assert!(
        table.contains("  completion   4.410 s (first reserve → last settle) · ideal 4.200 s\n"),
        "{table}"
    );
    assert!(
        table.contains(
            "  1st queued   admitted at 304.100 ms (ideal 100.000 ms: one refill, P/C)\n"
        ),
        "{table}"
    );
    assert_eq!(fields(&table, "ratio")[1], "1.050×");
    assert!(table.contains("(target ≤ 1.1×: met)"), "{table}");
    let overspend = fields(&table, "overspend");
    assert_eq!(overspend[1], "0");
    assert!(
        table.contains("(used 350000 of 350000, still held 0)"),
        "{table}"
    );
    assert_eq!(fields(&table, "queue wait")[3], "1.500");
    assert_eq!(fields(&table, "settle")[2], "0.450");
    // The overhead phase.
    assert!(
        table.contains(
            "  overhead     50 rounds on tenant:fanout-1-overhead (one concurrent reservation)\n"
        ),
        "{table}"
    );
    assert_eq!(fields(&table, "immediate")[2], "0.100");
    assert_eq!(fields(&table, "imm.+settle")[2], "0.200");
    assert_eq!(fields(&table, "freed→adm.")[2], "0.180");
    assert_eq!(fields(&table, "queued")[1], "-0.015");
    assert!(
        table.contains("(the waiter's came first in 34 of 50)"),
        "{table}"
    );
    assert!(
        table.contains(
            "  queued−imm.  -0.115 ms vs an immediate reserve, -0.215 ms vs an immediate reserve+settle (p50)\n"
        ),
        "{table}"
    );

    let slow = sample_report(4_700, 353_500).to_string();
    assert!(slow.contains("1.119× (target ≤ 1.1×: NOT met)"), "{slow}");
    assert_eq!(fields(&slow, "overspend")[1], "3500");

    let failed = FanoutReport {
        overhead: Some(Err("PUT tenant:x limits: 403 forbidden".to_owned())),
        ..sample_report(4_410, 350_000)
    };
    assert!(
        failed
            .to_string()
            .contains("  overhead     failed: PUT tenant:x limits: 403 forbidden\n")
    );
    let skipped = FanoutReport {
        overhead: None,
        first_queued: None,
        ..sample_report(4_410, 350_000)
    };
    let text = skipped.to_string();
    assert!(
        !text.contains("overhead") && !text.contains("1st queued"),
        "{text}"
    );
}

/// The common report shows the fan-out's table when it carries one.
#[test]
fn report_shows_the_fanout_table() {
    let fanout = sample_report(4_410, 350_000);
    let report = Report {
        server: fanout.server.clone(),
        scenario: Scenario::Fanout,
        concurrency: 120,
        elapsed: fanout.total,
        pairs: 100,
        pairs_per_s: 100.0 / 4.41,
        attempts: 120,
        denials: 20,
        denials_by_kind: fanout.refused_by_kind.clone(),
        errors: 0,
        errors_by_kind: BTreeMap::new(),
        reserve: latency(1_000, 120),
        second: fanout.settle,
        pair: latency(200_000, 100),
        fanout: Some(fanout.clone()),
    };
    assert_eq!(report.to_string(), fanout.to_string());
}

/// Bad fan-out options name their field before any connection (port 9
/// has nothing listening); the scenario has no no-op ceiling.
#[tokio::test]
async fn bad_fanout_options() {
    let base = BenchOptions {
        scenario: Scenario::Fanout,
        ..BenchOptions::new("http://127.0.0.1:9")
    };
    let with = |fanout: FanoutOptions| BenchOptions {
        fanout,
        ..base.clone()
    };
    let cases = [
        (
            with(FanoutOptions {
                tasks: 0,
                ..FanoutOptions::default()
            }),
            "fanout.tasks",
        ),
        (
            with(FanoutOptions {
                wait: Duration::ZERO,
                ..FanoutOptions::default()
            }),
            "fanout.wait",
        ),
        (
            with(FanoutOptions {
                overhead_rounds: 1_000_000,
                ..FanoutOptions::default()
            }),
            "fanout.overhead_rounds",
        ),
        (
            with(FanoutOptions {
                tenant: Some(String::new()),
                ..FanoutOptions::default()
            }),
            "fanout.tenant",
        ),
    ];
    for (opts, field) in cases {
        match run(&opts).await {
            Err(BenchError::InvalidOption { field: named, .. }) => assert_eq!(named, field),
            other => panic!("expected an invalid {field}, got {other:?}"),
        }
    }
    match measure_ceiling(&base).await {
        Err(BenchError::InvalidOption { field, .. }) => assert_eq!(field, "scenario"),
        other => panic!("expected an invalid scenario, got {other:?}"),
    }
}

/// The no-op server has no scopes: the run stops before any load, saying
/// which call failed.
#[tokio::test]
async fn a_server_without_scopes_is_a_setup_error() {
    let server = noop().await;
    let opts = BenchOptions {
        scenario: Scenario::Fanout,
        ..BenchOptions::new(server.url.clone())
    };
    match run(&opts).await {
        Err(BenchError::Setup(reason)) => {
            assert!(
                reason.contains("GET /v1/scopes/tenant%3Afanout-"),
                "{reason}"
            )
        }
        other => panic!("expected a setup error, got {other:?}"),
    }
}

/// A stand-in for the real server: a bucket that never binds, a budget of
/// `budget` tokens charged at reserve (402 past it), every reserve at once.
#[derive(Clone, Default)]
struct StandIn {
    used: Arc<AtomicU64>,
    ids: Arc<AtomicU64>,
}

const STAND_IN_BUDGET: u64 = 4 * 3_500;

async fn stand_in_status(State(s): State<StandIn>) -> String {
    let used = s.used.load(Ordering::SeqCst);
    format!(
        r#"{{"scope": "tenant:t", "plan": "p", "held_reservations": 0, "limits": [
            {{"dimension": "requests", "window": "bucket", "period_ms": 1000, "capacity": 100,
              "used": 0, "held": 0, "remaining": 100, "resets_at": null}},
            {{"dimension": "tokens", "window": "total", "capacity": {STAND_IN_BUDGET},
              "used": {used}, "held": 0, "remaining": {}, "resets_at": null}}]}}"#,
        STAND_IN_BUDGET - used
    )
}

async fn stand_in_reserve(State(s): State<StandIn>, body: String) -> (StatusCode, String) {
    let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let tokens = json["amounts"]["input_tokens"].as_u64().unwrap_or(0)
        + json["amounts"]["output_tokens"].as_u64().unwrap_or(0);
    let overhead = json["tenant"]
        .as_str()
        .is_some_and(|t| t.ends_with("-overhead"));
    if !overhead
        && s.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| {
                (u + tokens <= STAND_IN_BUDGET).then_some(u + tokens)
            })
            .is_err()
    {
        return (
            StatusCode::PAYMENT_REQUIRED,
            r#"{"error": {"type": "budget_exhausted", "message": "no"}}"#.to_owned(),
        );
    }
    let id = s.ids.fetch_add(1, Ordering::SeqCst);
    (
        StatusCode::CREATED,
        format!(r#"{{"id": "rsv_{id}", "status": "held"}}"#),
    )
}

/// A short fan-out against the stand-in: the budget's refusals are counted
/// by type, the ideal is one call (the bucket never binds), nothing is
/// overspent, and a "queued" waiter admitted while the slot is held (the
/// stand-in has no queue) fails the overhead phase with that reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_run_against_a_stand_in() {
    let router = Router::new()
        .route(
            "/v1/scopes/{*scope}",
            get(stand_in_status).put(stand_in_status),
        )
        .route("/v1/reservations", post(stand_in_reserve))
        .route(
            "/v1/reservations/{id}/settle",
            post(|| async { r#"{"status": "settled"}"# }),
        )
        .with_state(StandIn::default());
    let server = axum_server(router).await;
    let opts = BenchOptions {
        scenario: Scenario::Fanout,
        fanout: FanoutOptions {
            tasks: 6,
            call: Duration::from_millis(20),
            tenant: Some("fan".to_owned()),
            overhead_rounds: 2,
            ..FanoutOptions::default()
        },
        ..BenchOptions::new(server.url.clone())
    };
    let report = run(&opts).await.expect("run");
    let fanout = report.fanout.clone().expect("the fan-out's figures");
    assert_eq!(fanout.tenant, "fan");
    assert_eq!((fanout.admitted, fanout.settled, fanout.refused), (4, 4, 2));
    assert_eq!(
        fanout.refused_by_kind,
        BTreeMap::from([("402 budget_exhausted".to_owned(), 2)])
    );
    assert_eq!(fanout.errors, 0, "{fanout}");
    assert_eq!(fanout.ideal.duration, Duration::from_millis(20));
    assert!(fanout.total >= Duration::from_millis(20), "{fanout}");
    assert_eq!(fanout.first_queued, None);
    assert_eq!((fanout.tokens_used, fanout.overspend()), (14_000, 0));
    assert_eq!(
        (fanout.wait.count, fanout.refusal.count, fanout.settle.count),
        (4, 2, 4)
    );
    match &fanout.overhead {
        Some(Err(reason)) => assert!(reason.contains("only slot was held"), "{reason}"),
        other => panic!("expected the overhead phase to fail, got {other:?}"),
    }
    // The common figures agree.
    assert_eq!((report.attempts, report.pairs, report.denials), (6, 4, 2));
    assert_eq!(report.reserve.count, 6);
    assert_eq!(report.elapsed, fanout.total);
    assert!(report.to_string().contains("scenario fanout"));

    // The same tenant again is not fresh: refused before any load.
    match run(&opts).await {
        Err(BenchError::Setup(reason)) => assert!(reason.contains("not fresh"), "{reason}"),
        other => panic!("expected a setup error, got {other:?}"),
    }
}
