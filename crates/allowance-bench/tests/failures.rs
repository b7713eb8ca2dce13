//! A misbehaving server shows up in the report as errors or denials: never a
//! panic, never a hang.

mod common;

use std::time::{Duration, Instant};

use allowance_bench::{BenchError, BenchOptions, Report, Scenario, run};
use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use common::{axum_server, raw_server};

/// One measured second, no warm-up (so every call counts), 4 connections.
fn opts(url: &str) -> BenchOptions {
    BenchOptions {
        warmup: Duration::ZERO,
        ..common::short(url, Scenario::Pairs)
    }
}

fn kinds(report: &Report) -> Vec<&str> {
    report.errors_by_kind.keys().map(String::as_str).collect()
}

const ERROR_500: &str = r#"{"error": {"type": "store_unavailable", "message": "x"}}"#;

/// Every call answered 500: all errors, no pair.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_counted() {
    let router = Router::new().fallback(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "boom") });
    let server = axum_server(router).await;
    let report = run(&opts(&server.url)).await.expect("run");
    assert_eq!(report.pairs, 0, "{report}");
    assert!(report.errors > 0, "{report}");
    assert_eq!(kinds(&report), ["reserve: 500 -"], "{report}");
    assert_eq!(report.errors, report.attempts, "{report}");
    assert_eq!(report.pairs_per_s, 0.0);
}

/// A reserve that works and a settle that answers 404: the second call's
/// failure is counted under its name and type, and there is no pair.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_call_errors_are_counted() {
    let router = Router::new()
        .route(
            "/v1/reservations",
            post(|| async { (StatusCode::CREATED, r#"{"id": "rsv_x", "status": "held"}"#) }),
        )
        .route(
            "/v1/reservations/{id}/settle",
            post(|| async {
                (
                    StatusCode::NOT_FOUND,
                    r#"{"error": {"type": "not_found", "message": "x"}}"#,
                )
            }),
        );
    let server = axum_server(router).await;
    let report = run(&opts(&server.url)).await.expect("run");
    assert_eq!(report.pairs, 0, "{report}");
    assert_eq!(kinds(&report), ["settle: 404 not_found"], "{report}");
    assert_eq!(report.errors, report.attempts, "{report}");
    assert_eq!(report.reserve.count, report.attempts);
}

/// Denials are counted by status and type, are not errors, and a denied
/// reserve makes no second call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denials_are_counted_not_errors() {
    let router = Router::new().route(
        "/v1/reservations",
        post(|| async {
            (
                StatusCode::TOO_MANY_REQUESTS,
                r#"{"error": {"type": "rate_limited", "message": "x", "retry_after_ms": 10}}"#,
            )
        }),
    );
    let server = axum_server(router).await;
    let report = run(&opts(&server.url)).await.expect("run");
    assert_eq!(report.errors, 0, "{report}");
    assert!(report.denials > 0, "{report}");
    assert_eq!(report.denials, report.attempts);
    assert_eq!(
        report.denials_by_kind.get("429 rate_limited"),
        Some(&report.denials)
    );
    assert_eq!((report.pairs, report.second.count), (0, 0));
}

/// A reserve answer without an id is an error, not a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_answers_are_errors() {
    let router = Router::new()
        .route(
            "/v1/reservations",
            post(|| async { (StatusCode::CREATED, "[1, 2") }),
        )
        .fallback(|| async { (StatusCode::SERVICE_UNAVAILABLE, ERROR_500) });
    let server = axum_server(router).await;
    let report = run(&opts(&server.url)).await.expect("run");
    assert_eq!(
        kinds(&report),
        ["reserve: 201 reserve answer without an id"]
    );
}

/// A server that closes every connection as soon as it opens: transport
/// errors, the bench dials again, and the run ends on time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_connections_are_errors() {
    let server = raw_server(drop).await;
    let started = Instant::now();
    let report = run(&opts(&server.url)).await.expect("run");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(report.pairs, 0, "{report}");
    assert!(report.errors > 0, "{report}");
    assert!(
        kinds(&report).iter().all(|k| k.starts_with("transport: ")),
        "{report}"
    );
}

/// A server that accepts and never answers: each call is cut when the
/// window closes (plus the drain grace) and counted as a timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_server_times_out() {
    let (keep, held) = std::sync::mpsc::channel();
    let server = raw_server(move |stream| {
        // Hold the connection open, unanswered, for as long as the test runs.
        let _ = keep.send(stream);
    })
    .await;
    let started = Instant::now();
    let report = run(&opts(&server.url)).await.expect("run");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(6),
        "{took:?}"
    );
    assert_eq!(kinds(&report), ["transport: timeout"], "{report}");
    // One reserve per worker, each cut once.
    assert_eq!(report.errors, 4, "{report}");
    drop(held);
}

/// Nothing listening: one clear error before any load, naming the address.
#[tokio::test]
async fn nothing_listening_is_an_error() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    let err = run(&opts(&format!("http://{addr}")))
        .await
        .expect_err("refused");
    assert!(
        matches!(&err, BenchError::Connect { addr: a, .. } if *a == addr.to_string()),
        "{err}"
    );
}
