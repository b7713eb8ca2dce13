//! The router without a socket (tower `oneshot`), on a manual clock: the
//! background sweeper expires abandoned holds with no request arriving.

use std::sync::Arc;
use std::time::Duration;

use allowance_core::{EmbeddedStore, ManualClock, SeededIds, Timestamp};
use allowance_server::{AppState, Credentials, Options, app, spawn_sweeper};
use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;

fn world() -> (Arc<EmbeddedStore>, Arc<ManualClock>, AppState) {
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(1_700_000_000_000)));
    let config = allowance_config::starter();
    let store = Arc::new(EmbeddedStore::new(
        config.catalog.clone(),
        4,
        clock.clone(),
        Arc::new(SeededIds::new(7)),
    ));
    let options = Options {
        sweep_interval: Duration::from_millis(10),
        ..Options::default()
    };
    let state = AppState::with_clock(
        store.clone(),
        Credentials::default(),
        options,
        clock.clone(),
    );
    (store, clock, state)
}

async fn call(
    state: &AppState,
    method: &str,
    path: &str,
    body: &str,
) -> (StatusCode, serde_json::Value) {
    let mut req = Request::builder().method(method).uri(path);
    if !body.is_empty() {
        req = req.header("content-type", "application/json");
    }
    let resp = app(state.clone())
        .oneshot(req.body(Body::from(body.to_string())).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

#[tokio::test]
async fn reserve_and_status_without_a_socket() {
    let (_, _, state) = world();
    let (status, body) = call(
        &state,
        "POST",
        "/v1/reservations",
        r#"{"tenant": "acme", "amounts": {"input_tokens": 10}, "ttl_ms": 1000}"#,
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["created_at"], "2023-11-14T22:13:20.000Z");
    assert_eq!(body["expires_at"], "2023-11-14T22:13:21.000Z");
    let (status, body) = call(&state, "GET", "/v1/scopes/tenant:acme", "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["held_reservations"], 1);
}

#[tokio::test]
async fn the_sweeper_expires_abandoned_holds_with_no_request() {
    let (store, clock, state) = world();
    let (status, _) = call(
        &state,
        "POST",
        "/v1/reservations",
        r#"{"tenant": "acme", "amounts": {"input_tokens": 10}, "ttl_ms": 1000}"#,
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(store.ledger().held_reservations(), 1);
    let sweeper = spawn_sweeper(&state);
    clock.advance_ms(1_000);
    // Nothing but the sweeper observes the ledger now. Bounded generously:
    // a missing sweeper hangs here, a working one takes a tick.
    let mut waited_ms = 0;
    while store.ledger().held_reservations() != 0 {
        assert!(waited_ms < 10_000, "the sweeper never expired the hold");
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited_ms += 10;
    }
    sweeper.abort();
}

/// A body that never finishes (a client that stalls mid-request) is cut at
/// the request timeout with the spec's 503, and reserves nothing.
#[tokio::test]
async fn a_stalled_body_is_cut_at_the_request_timeout() {
    let (store, _, _) = world();
    let options = Options {
        request_timeout: Duration::from_millis(200),
        max_wait_ms: 0,
        ..Options::default()
    };
    let state = AppState::new(store.clone(), Credentials::default(), options);
    let first = futures_util::stream::iter([Ok::<_, std::io::Error>(bytes::Bytes::from_static(
        b"{\"tenant\": \"acme\", ",
    ))]);
    let stalled = futures_util::StreamExt::chain(first, futures_util::stream::pending());
    let req = Request::builder()
        .method("POST")
        .uri("/v1/reservations")
        .header("content-type", "application/json")
        .body(Body::from_stream(stalled))
        .unwrap();
    // Generous: the cut comes at 200 ms; only a hang would reach this.
    let resp = tokio::time::timeout(Duration::from_secs(30), app(state).oneshot(req))
        .await
        .expect("the request timeout cut the stalled body")
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["error"]["type"], "store_unavailable", "{body}");
    let status =
        allowance_core::Store::status(&*store, &allowance_core::ScopeKey::tenant("acme").unwrap())
            .await
            .unwrap();
    assert!(status.limits.iter().all(|l| l.held == 0), "nothing held");
}
