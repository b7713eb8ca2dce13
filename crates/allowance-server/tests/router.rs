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
