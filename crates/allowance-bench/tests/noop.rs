//! The no-op server parses bodies as strictly as the real server must
//! (HTTP-API.md): it is a fair ceiling only if it does the same parsing work.

mod common;

use common::{noop, post, post_json};
use hyper::StatusCode;

const RESERVE: &str = "/v1/reservations";
const SETTLE: &str = "/v1/reservations/rsv_1/settle";
const REFUND: &str = "/v1/reservations/rsv_1/refund";

/// The error object's `type` and `field`.
fn error_of(answer: &common::Answer) -> (String, Option<String>) {
    let error = &answer.json["error"];
    (
        error["type"].as_str().unwrap_or("<none>").to_owned(),
        error["field"].as_str().map(str::to_owned),
    )
}

/// A full reserve body (every field of the spec's example) is accepted, and
/// the answer has the real answer's shape and headers.
#[tokio::test]
async fn accepts_the_spec_example() {
    let server = noop().await;
    let body = r#"{"tenant": "acme", "scopes": {"user": "bob", "agent": "planner-7"},
        "amounts": {"input_tokens": 3000, "output_tokens": 1000}, "model": "gpt-4o",
        "ttl_ms": 300000, "idempotency_key": "v1:run42", "wait_ms": 0, "priority": 0,
        "labels": {"task": "summarise"}}"#;
    let answer = post_json(&server, RESERVE, body).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    assert!(answer.json["id"].as_str().is_some_and(|id| !id.is_empty()));
    assert_eq!(answer.json["status"], "held");
    assert!(answer.headers.contains_key("ratelimit-policy"));

    let settle = r#"{"usage": {"input_tokens": 2950, "output_tokens": 700},
        "charges": [{"name": "search", "cost_micros": 5000, "amounts": {"search_calls": 1}}]}"#;
    let answer = post_json(&server, SETTLE, settle).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.json["status"], "settled");
}

/// An unknown field is a 400 `invalid_request` naming it, at any depth.
#[tokio::test]
async fn rejects_unknown_fields() {
    let server = noop().await;
    let cases = [
        (
            RESERVE,
            r#"{"tenant": "a", "amounts": {"tokens": 1}, "tenat": "b"}"#,
            "tenat",
        ),
        (SETTLE, r#"{"usage": {}, "useage": {}}"#, "useage"),
        (
            SETTLE,
            r#"{"usage": {}, "charges": [{"name": "s", "cost_micros": 1, "cost": 2}]}"#,
            "charges[0].cost",
        ),
        (REFUND, r#"{"reason": "x"}"#, "reason"),
    ];
    for (path, body, field) in cases {
        let answer = post_json(&server, path, body).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(
            error_of(&answer),
            ("invalid_request".to_owned(), Some(field.to_owned())),
            "{body}"
        );
    }
}

/// Wrong types and missing required fields name the field; a body that is
/// not JSON at all names none.
#[tokio::test]
async fn names_the_offending_field() {
    let server = noop().await;
    let cases = [
        (
            RESERVE,
            r#"{"tenant": "a", "amounts": {"input_tokens": "x"}}"#,
            Some("amounts.input_tokens"),
        ),
        (
            RESERVE,
            r#"{"tenant": "a", "amounts": {"input_tokens": -1}}"#,
            Some("amounts.input_tokens"),
        ),
        (RESERVE, r#"{"amounts": {}}"#, Some("tenant")),
        (
            RESERVE,
            r#"{"tenant": "a", "scopes": {"user": 7}, "amounts": {}}"#,
            Some("scopes.user"),
        ),
        (SETTLE, r#"{}"#, Some("usage")),
        (
            SETTLE,
            r#"{"usage": {}, "charges": [{"name": "s"}]}"#,
            Some("charges[0].cost_micros"),
        ),
        (RESERVE, "not json", None),
        (RESERVE, r#"{"tenant": "a", "amounts": {}} trailing"#, None),
    ];
    for (path, body, field) in cases {
        let answer = post_json(&server, path, body).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(
            error_of(&answer),
            ("invalid_request".to_owned(), field.map(str::to_owned)),
            "{body}"
        );
    }
}

/// A body that is not `application/json` is a 415; a refund may have no body.
#[tokio::test]
async fn media_type_and_empty_refund() {
    let server = noop().await;
    let body = br#"{"tenant": "a", "amounts": {}}"#.to_vec();
    let answer = post(&server, RESERVE, Some("text/plain"), body.clone()).await;
    assert_eq!(answer.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(error_of(&answer).0, "unsupported_media_type");
    let answer = post(&server, RESERVE, None, body.clone()).await;
    assert_eq!(answer.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let answer = post(
        &server,
        RESERVE,
        Some("application/json; charset=utf-8"),
        body,
    )
    .await;
    assert_eq!(answer.status, StatusCode::CREATED);

    let answer = post(&server, REFUND, None, Vec::new()).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.json["status"], "refunded");
    let answer = post_json(&server, REFUND, "{}").await;
    assert_eq!(answer.status, StatusCode::OK);
    // An empty settle is not allowed: usage is required.
    let answer = post(&server, SETTLE, None, Vec::new()).await;
    assert_eq!(answer.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
}

/// The 64 KiB limit is inclusive: 65,536 bytes pass, 65,537 are a 413.
#[tokio::test]
async fn body_limit_is_inclusive() {
    let server = noop().await;
    let sized = |len: usize| {
        let head = r#"{"tenant": "a", "amounts": {}}"#;
        let mut body = head.as_bytes().to_vec();
        // Whitespace after the value is valid JSON, so only the size changes.
        body.resize(len, b' ');
        body
    };
    let answer = post(&server, RESERVE, Some("application/json"), sized(65_536)).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    let answer = post(&server, RESERVE, Some("application/json"), sized(65_537)).await;
    assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(error_of(&answer).0, "payload_too_large");
}

/// Routes it does not serve answer 404 in the spec's error shape.
#[tokio::test]
async fn other_routes_are_not_found() {
    let server = noop().await;
    let answer = post_json(&server, "/v1/reservations/rsv_1/extend", "{}").await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    assert_eq!(error_of(&answer).0, "not_found");
}
