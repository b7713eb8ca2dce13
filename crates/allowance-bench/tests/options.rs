//! Options are checked before any load, each error naming its field; scenario
//! names and the comparison's figures.

use std::collections::BTreeMap;
use std::time::Duration;

use allowance_bench::{
    BenchError, BenchOptions, Comparison, Latency, MAX_CONCURRENCY, Report, Scenario, compare, run,
};

/// Scenario names round-trip, and an unknown one is named in the error.
#[test]
fn scenario_names() {
    for scenario in Scenario::ALL {
        assert_eq!(scenario.to_string().parse::<Scenario>(), Ok(scenario));
    }
    assert_eq!("pairs".parse(), Ok(Scenario::Pairs));
    let err = "Pairs".parse::<Scenario>().expect_err("case matters");
    assert_eq!(err.given, "Pairs");
    assert!(err.to_string().contains("contention"), "{err}");
}

/// Each bad option is refused with its field named, before any connection
/// (port 9 on 127.0.0.1 has nothing listening: a connection would be a
/// `Connect` error instead).
#[tokio::test]
async fn bad_options_name_their_field() {
    let base = BenchOptions::new("http://127.0.0.1:9");
    let cases: Vec<(BenchOptions, &str)> = vec![
        (
            BenchOptions {
                concurrency: 0,
                ..base.clone()
            },
            "concurrency",
        ),
        (
            BenchOptions {
                concurrency: MAX_CONCURRENCY + 1,
                ..base.clone()
            },
            "concurrency",
        ),
        (
            BenchOptions {
                duration: Duration::ZERO,
                ..base.clone()
            },
            "duration",
        ),
        (
            BenchOptions {
                warmup: Duration::from_secs(90_000),
                ..base.clone()
            },
            "warmup",
        ),
        (BenchOptions::new("https://127.0.0.1:9"), "server"),
        (BenchOptions::new("ftp://127.0.0.1:9"), "server"),
        (BenchOptions::new("http://user:pw@127.0.0.1:9"), "server"),
        (BenchOptions::new("http://127.0.0.1:9/?x=1"), "server"),
        (BenchOptions::new("http://"), "server"),
        (BenchOptions::new("not a url"), "server"),
        (
            BenchOptions {
                token: Some(String::new()),
                ..base.clone()
            },
            "token",
        ),
        (
            BenchOptions {
                token: Some("a\nb".to_owned()),
                ..base.clone()
            },
            "token",
        ),
    ];
    for (opts, field) in cases {
        match run(&opts).await {
            Err(BenchError::InvalidOption { field: named, .. }) => {
                assert_eq!(named, field, "{opts:?}")
            }
            other => panic!("{opts:?}: expected an invalid {field}, got {other:?}"),
        }
    }
}

fn report(pairs_per_s: f64, pair_p99_ms: u64) -> Report {
    let latency = Latency {
        count: 100,
        p50: Duration::from_micros(100),
        p99: Duration::from_millis(pair_p99_ms),
        p999: Duration::from_millis(pair_p99_ms * 2),
        max: Duration::from_millis(pair_p99_ms * 3),
    };
    Report {
        server: "http://127.0.0.1:8787".to_owned(),
        scenario: Scenario::Pairs,
        concurrency: 64,
        elapsed: Duration::from_secs(10),
        pairs: (pairs_per_s * 10.0) as u64,
        pairs_per_s,
        attempts: (pairs_per_s * 10.0) as u64,
        denials: 0,
        denials_by_kind: BTreeMap::new(),
        errors: 0,
        errors_by_kind: BTreeMap::new(),
        reserve: latency,
        second: latency,
        pair: latency,
        fanout: None,
    }
}

/// The ratios are target over ceiling, judged against 80% and 1.5×.
#[test]
fn comparison_figures() {
    let ceiling = report(10_000.0, 4);
    let met = Comparison::new(&report(8_500.0, 5), &ceiling);
    assert_eq!(met.throughput_ratio, Some(0.85));
    assert_eq!(met.p99_ratio, Some(1.25));
    assert!(met.meets_targets());
    let text = compare(&report(8_500.0, 5), &ceiling);
    assert!(
        text.contains("85.0% of the ceiling (target ≥ 80%: met)"),
        "{text}"
    );
    assert!(text.contains("= 1.25× (target ≤ 1.5×: met)"), "{text}");

    let slow = Comparison::new(&report(7_000.0, 8), &ceiling);
    assert!(!slow.meets_targets());
    let text = slow.to_string();
    assert!(
        text.contains("70.0% of the ceiling (target ≥ 80%: NOT met)"),
        "{text}"
    );
    assert!(text.contains("= 2.00× (target ≤ 1.5×: NOT met)"), "{text}");

    // A ceiling that measured nothing gives no ratio rather than infinity.
    let empty = Report {
        pairs: 0,
        pairs_per_s: 0.0,
        pair: Latency::default(),
        ..ceiling
    };
    let unknown = Comparison::new(&report(8_500.0, 5), &empty);
    assert_eq!((unknown.throughput_ratio, unknown.p99_ratio), (None, None));
    assert!(!unknown.meets_targets());
    assert!(unknown.to_string().contains("n/a"));
}
