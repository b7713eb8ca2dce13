//! The ceiling: a server that does everything the real one does at the HTTP
//! layer (routing, reading and parsing the same JSON bodies strictly) and
//! nothing of the ledger, answering fixed JSON of the real answers' size.
//!
//! It checks no token (the real server's SHA-256 of the token is ledger-side
//! work for this purpose) and answers a fixed reservation id, so the client
//! settles the same id every time.

use std::collections::BTreeMap;
use std::fmt;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path};
use axum::http::header::{CONTENT_TYPE, HeaderName};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::serve::ListenerExt;
use serde::de::{DeserializeOwned, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// The spec's body limit on the native API (inclusive).
const MAX_BODY_BYTES: usize = 64 * 1024;

/// `POST /v1/reservations`, as HTTP-API.md writes it: only `tenant` and
/// `amounts` are required.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[expect(
    dead_code,
    reason = "the no-op parses what the real server parses, and reads none of it"
)]
struct ReserveBody {
    tenant: String,
    #[serde(default)]
    scopes: ScopeList,
    amounts: BTreeMap<String, u64>,
    model: Option<String>,
    ttl_ms: Option<u64>,
    idempotency_key: Option<String>,
    wait_ms: Option<u64>,
    priority: Option<i64>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    dry_run: bool,
}

/// `POST /v1/reservations/{id}/settle`. `usage` is required here: a settle
/// that states no usage would silently charge nothing.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[expect(
    dead_code,
    reason = "the no-op parses what the real server parses, and reads none of it"
)]
struct SettleBody {
    usage: BTreeMap<String, u64>,
    #[serde(default)]
    charges: Vec<Charge>,
}

/// One non-token cost in a settle.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[expect(
    dead_code,
    reason = "the no-op parses what the real server parses, and reads none of it"
)]
struct Charge {
    name: String,
    cost_micros: u64,
    #[serde(default)]
    amounts: BTreeMap<String, u64>,
}

/// `POST /v1/reservations/{id}/refund`: no body, or `{}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RefundBody {}

/// `scopes` in the request's order (the canonical scope list keeps it), as
/// `kind → id` pairs.
#[derive(Default)]
struct ScopeList(#[expect(dead_code, reason = "parsed, never read")] Vec<(String, String)>);

impl<'de> Deserialize<'de> for ScopeList {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<ScopeList, D::Error> {
        struct Ordered;
        impl<'de> Visitor<'de> for Ordered {
            type Value = ScopeList;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of scope kinds to ids")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ScopeList, A::Error> {
                let mut scopes = Vec::with_capacity(map.size_hint().unwrap_or(0).min(8));
                while let Some(entry) = map.next_entry::<String, String>()? {
                    scopes.push(entry);
                }
                Ok(ScopeList(scopes))
            }
        }
        deserializer.deserialize_map(Ordered)
    }
}

/// A reserve answer as the spec shows it, with the starter tenant plan's
/// two limits in `remaining`.
const RESERVE_ANSWER: &str = r#"{"id":"rsv_01JDQ8Z3K9M4N5P6Q7R8S9T0VW","status":"held","tenant":"bench-0","scopes":["tenant:bench-0"],"held":{"requests":1,"concurrent":1,"input_tokens":100,"output_tokens":50,"tokens":150,"cost_micros":0},"expires_at":"2026-11-29T16:05:00.000Z","remaining":[{"scope":"tenant:bench-0","dimension":"cost_micros","window":"sliding","capacity":300000000,"remaining":300000000,"resets_at":"2026-11-30T16:00:00.000Z"},{"scope":"tenant:bench-0","dimension":"concurrent","window":"concurrent","capacity":20,"remaining":19,"resets_at":null}]}"#;

/// A settled reservation object (settle answers it without `remaining`).
const SETTLE_ANSWER: &str = r#"{"id":"rsv_01JDQ8Z3K9M4N5P6Q7R8S9T0VW","status":"settled","tenant":"bench-0","scopes":["tenant:bench-0"],"model":null,"labels":{},"held":{"requests":1,"concurrent":1,"input_tokens":100,"output_tokens":50,"tokens":150,"cost_micros":0},"created_at":"2026-11-29T16:00:00.000Z","expires_at":"2026-11-29T16:05:00.000Z","ended_at":"2026-11-29T16:00:00.004Z","charged":{"requests":1,"input_tokens":90,"output_tokens":40,"tokens":130,"cost_micros":0},"late":false}"#;

/// A refunded reservation object.
const REFUND_ANSWER: &str = r#"{"id":"rsv_01JDQ8Z3K9M4N5P6Q7R8S9T0VW","status":"refunded","tenant":"bench-0","scopes":["tenant:bench-0"],"model":null,"labels":{},"held":{"requests":1,"concurrent":1,"input_tokens":100,"output_tokens":50,"tokens":150,"cost_micros":0},"created_at":"2026-11-29T16:00:00.000Z","expires_at":"2026-11-29T16:05:00.000Z","ended_at":"2026-11-29T16:00:00.004Z","late":false}"#;

/// The headers a successful reserve carries (HTTP-API.md), with fixed values.
/// (Names checked at compile time, as the server's are.)
const RESERVE_HEADERS: [(HeaderName, &str); 4] = [
    (
        HeaderName::from_static("ratelimit-policy"),
        r#""tenant-concurrent";q=20"#,
    ),
    (
        HeaderName::from_static("ratelimit"),
        r#""tenant-concurrent";r=19;t=0"#,
    ),
    (
        HeaderName::from_static("x-ratelimit-remaining-tokens"),
        "1000000",
    ),
    (
        HeaderName::from_static("x-ratelimit-remaining-requests"),
        "1000",
    ),
];

/// A refusal in the spec's error shape: the one place the no-op turns a bad
/// request into HTTP.
struct Rejection {
    status: StatusCode,
    kind: &'static str,
    message: String,
    field: Option<String>,
}

fn error(
    status: StatusCode,
    kind: &'static str,
    message: String,
    field: Option<String>,
) -> Rejection {
    Rejection {
        status,
        kind,
        message,
        field,
    }
}

impl IntoResponse for Rejection {
    fn into_response(self) -> Response {
        let mut object = serde_json::json!({"type": self.kind, "message": self.message});
        if let (Some(field), Some(map)) = (self.field, object.as_object_mut()) {
            map.insert("field".to_owned(), serde_json::Value::String(field));
        }
        (self.status, Json(serde_json::json!({ "error": object }))).into_response()
    }
}

/// The request's `Content-Type`, the one header the no-op reads: taken
/// where it lies, as the real server reads its headers (the `HeaderMap`
/// extractor would clone them all).
struct ContentType(Option<HeaderValue>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for ContentType {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(ContentType(parts.headers.get(CONTENT_TYPE).cloned()))
    }
}

fn is_json(content_type: &ContentType) -> bool {
    let Some(ct) = &content_type.0 else {
        return false;
    };
    // What every client sends, before the general parse (as the server).
    if ct.as_bytes().eq_ignore_ascii_case(b"application/json") {
        return true;
    }
    Some(ct)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"))
}

/// Reads a body the way the real server must: size limit, media type, strict
/// JSON with the offending field named. `Ok(None)` is an empty body where one
/// is allowed.
fn parse<T: DeserializeOwned>(
    content_type: &ContentType,
    body: Result<Bytes, BytesRejection>,
    empty_allowed: bool,
) -> Result<Option<T>, Rejection> {
    let bytes = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                format!("the body is over {MAX_BODY_BYTES} bytes"),
                None,
            )
        } else {
            error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                format!("the body could not be read: {rejection}"),
                None,
            )
        }
    })?;
    if bytes.is_empty() && empty_allowed {
        return Ok(None);
    }
    if !is_json(content_type) {
        return Err(error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "the body must be application/json".to_owned(),
            None,
        ));
    }
    // As the real server parses: serde_json's plain path for a good body,
    // the path-tracking one again only to name a bad field.
    if let Ok(parsed) = serde_json::from_slice::<T>(&bytes) {
        return Ok(Some(parsed));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(&bytes);
    let parsed = serde_path_to_error::deserialize::<_, T>(&mut deserializer)
        .map_err(|e| invalid(e.path().to_string(), e.into_inner()))?;
    deserializer.end().map_err(|e| invalid(String::new(), e))?;
    Ok(Some(parsed))
}

/// A 400 naming the field as a dotted path (`amounts.input_tokens`; array
/// items as `charges[0].name`), the unknown or missing field's name
/// included; no field when the body is not JSON at all.
fn invalid(path: String, e: serde_json::Error) -> Rejection {
    let message = e.to_string();
    let field = if e.is_data() {
        let path = if path == "." { String::new() } else { path };
        // The path already ends at an unknown field; a missing field is
        // named only in serde's message, so it is appended to its parent.
        let missing = message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split('`').next());
        match missing {
            Some(name) if path.is_empty() => Some(name.to_owned()),
            Some(name) => Some(format!("{path}.{name}")),
            None if path.is_empty() => None,
            None => Some(path),
        }
    } else {
        None
    };
    error(StatusCode::BAD_REQUEST, "invalid_request", message, field)
}

fn fixed(status: StatusCode, body: &'static str) -> Response {
    (
        status,
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        body,
    )
        .into_response()
}

async fn reserve(content_type: ContentType, body: Result<Bytes, BytesRejection>) -> Response {
    match parse::<ReserveBody>(&content_type, body, false) {
        Ok(_) => {
            let mut response = fixed(StatusCode::CREATED, RESERVE_ANSWER);
            for (name, value) in RESERVE_HEADERS {
                response
                    .headers_mut()
                    .insert(name, HeaderValue::from_static(value));
            }
            response
        }
        Err(rejection) => rejection.into_response(),
    }
}

async fn settle(
    Path(_id): Path<String>,
    content_type: ContentType,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match parse::<SettleBody>(&content_type, body, false) {
        Ok(_) => fixed(StatusCode::OK, SETTLE_ANSWER),
        Err(rejection) => rejection.into_response(),
    }
}

async fn refund(
    Path(_id): Path<String>,
    content_type: ContentType,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match parse::<RefundBody>(&content_type, body, true) {
        Ok(_) => fixed(StatusCode::OK, REFUND_ANSWER),
        Err(rejection) => rejection.into_response(),
    }
}

async fn not_found() -> Rejection {
    error(
        StatusCode::NOT_FOUND,
        "not_found",
        "the no-op server answers only reserve, settle and refund".to_owned(),
        None,
    )
}

/// The no-op router: `POST /v1/reservations` (201), `POST
/// /v1/reservations/{id}/settle` and `/refund` (200), each parsing its body
/// strictly as HTTP-API.md defines it (unknown field → 400 naming it, not
/// JSON → 415, over 64 KiB → 413) and answering fixed JSON of a real
/// answer's size. Everything else is a 404 in the spec's error shape.
pub fn noop_router() -> Router {
    Router::new()
        .route("/v1/reservations", post(reserve))
        .route("/v1/reservations/{id}/settle", post(settle))
        .route("/v1/reservations/{id}/refund", post(refund))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
}

/// Serves [`noop_router`] on `listener` until the task is dropped, with
/// `TCP_NODELAY` on every connection (as a latency-minded server sets it).
///
/// # Errors
/// Only what `axum::serve` returns; per-connection errors are absorbed.
pub async fn serve_noop(listener: tokio::net::TcpListener) -> std::io::Result<()> {
    let listener = listener.tap_io(|stream| {
        // Without it the server is slower than it would be, which is not an error.
        let _ = stream.set_nodelay(true);
    });
    axum::serve(listener, noop_router()).await
}
