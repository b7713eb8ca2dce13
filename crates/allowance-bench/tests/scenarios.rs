//! Every scenario, run for about a second against the no-op server over real
//! HTTP on 127.0.0.1, gives a sane report.

mod common;

use allowance_bench::{Comparison, Scenario, compare, measure_ceiling, run};
use common::{assert_sane, noop, short};

/// `pairs`: reserve then settle on one tenant per worker, no denial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pairs_reserve_then_settle() {
    let server = noop().await;
    let report = run(&short(&server.url, Scenario::Pairs))
        .await
        .expect("run");
    assert_sane(&report);
    assert_eq!(report.denials, 0);
    let table = report.to_string();
    assert!(table.contains("scenario pairs"), "{table}");
    assert!(table.contains("settle"), "{table}");
}

/// `refund`: the second call is a refund, and the table says so. The server
/// is given without a scheme, as a user may type it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refund_reserve_then_refund() {
    let server = noop().await;
    let bare = server.url.trim_start_matches("http://").to_owned();
    let report = run(&short(&bare, Scenario::Refund)).await.expect("run");
    assert_sane(&report);
    let table = report.to_string();
    assert!(table.contains("refund"), "{table}");
    assert!(!table.contains("settle"), "{table}");
}

/// `contention`: all workers on one tenant; the no-op never denies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contention_on_one_tenant() {
    let server = noop().await;
    let report = run(&short(&server.url, Scenario::Contention))
        .await
        .expect("run");
    assert_sane(&report);
}

/// `tenants`: cycling over many tenants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_cycle() {
    let server = noop().await;
    let report = run(&short(&server.url, Scenario::Tenants))
        .await
        .expect("run");
    assert_sane(&report);
}

/// The ceiling runs in-process on its own port, and comparing a server with
/// itself gives ratios near 1 (loose bounds: two 1 s runs on a shared machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ceiling_and_comparison() {
    let server = noop().await;
    let opts = short(&server.url, Scenario::Pairs);
    let target = run(&opts).await.expect("run");
    let ceiling = measure_ceiling(&opts).await.expect("ceiling");
    assert_sane(&ceiling);
    assert!(
        ceiling.server.starts_with("no-op http://127.0.0.1:"),
        "{}",
        ceiling.server
    );
    assert_ne!(ceiling.server, format!("no-op {}", server.url));
    let comparison = Comparison::new(&target, &ceiling);
    let throughput = comparison.throughput_ratio.expect("ceiling did pairs");
    assert!(throughput > 0.2 && throughput < 5.0, "{comparison}");
    let p99 = comparison.p99_ratio.expect("both did pairs");
    assert!(p99 > 0.0 && p99.is_finite(), "{comparison}");
    let text = compare(&target, &ceiling);
    assert!(text.contains("throughput"), "{text}");
    assert!(
        text.contains(&format!("{:.1}%", throughput * 100.0)),
        "{text}"
    );
    assert!(text.contains(&format!("{p99:.2}×")), "{text}");
}
