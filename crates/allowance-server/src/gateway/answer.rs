//! What the gateway answers of its own: errors in the provider's shape (so
//! the official SDKs classify them: a 429 is retried after `retry-after`, a
//! 402 is not) and the provider-style rate-limit headers of a call.

use allowance_core::{Catalog, Denial, DenialKind, Remaining, Timestamp};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::error::DenialBody;

/// Whose protocol a route speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flavor {
    /// OpenAI: `{"error": {"message", "type", "param", "code"}}`,
    /// `x-ratelimit-*` headers.
    OpenAi,
    /// Anthropic: `{"type": "error", "error": {"type", "message"}}`,
    /// `anthropic-ratelimit-*` headers.
    Anthropic,
}

/// An answer the gateway makes itself (nothing was forwarded, or what was
/// forwarded failed without an answer to pass on).
#[derive(Debug)]
pub(crate) struct GatewayError {
    pub status: StatusCode,
    /// OpenAI's `type` (Anthropic's is derived from the status).
    pub openai_type: &'static str,
    /// OpenAI's `code`.
    pub code: Option<&'static str>,
    pub message: String,
    /// The offending field (OpenAI's `param`).
    pub param: Option<String>,
    /// The ledger's denial, for the `allowance` member and the headers.
    pub denial: Option<DenialBody>,
    pub headers: HeaderMap,
}

impl GatewayError {
    fn new(status: StatusCode, openai_type: &'static str, message: impl Into<String>) -> Self {
        GatewayError {
            status,
            openai_type,
            code: None,
            message: message.into(),
            param: None,
            denial: None,
            headers: HeaderMap::new(),
        }
    }

    pub fn invalid(param: Option<String>, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message);
        e.param = param;
        e
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message);
        e.code = Some("invalid_api_key");
        e
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "permission_error", message)
    }

    pub fn too_large(limit_bytes: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is larger than gateway.max_body_bytes ({limit_bytes} bytes)"),
        )
    }

    /// A method the route does not take: 405 with `Allow`, in the
    /// provider's shape (as OpenAI answers it), never an empty body.
    pub fn method_not_allowed(method: &str, path: &str, allow: &'static str) -> Self {
        let mut e = Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("Invalid method for URL ({method} {path}): use {allow}"),
        );
        insert(&mut e.headers, "allow", allow);
        e
    }

    /// A body that is not JSON by its `Content-Type` (HTTP-API.md answer 2).
    pub fn unsupported_media_type(got: Option<&str>) -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            match got {
                Some(t) => format!("the body must be application/json, got Content-Type {t:?}"),
                None => "the body must be application/json (no Content-Type was given)".into(),
            },
        )
    }

    /// The upstream could not be reached or did not answer (502).
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "api_error", message)
    }

    /// A 502 the SDK must not retry: the provider may have run the call
    /// (a retry would be a second generation, billed again), or a retry
    /// cannot help (the gateway's own upstream key was refused).
    pub fn bad_gateway_final(message: impl Into<String>) -> Self {
        let mut e = Self::bad_gateway(message);
        insert(&mut e.headers, "x-should-retry", "false");
        e
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "api_error", message)
    }

    /// The upstream asked every call to wait longer than this one may.
    pub fn upstream_backoff(upstream: &str, left: std::time::Duration) -> Self {
        let ms = left.as_millis() as u64;
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_exceeded",
            format!("upstream {upstream:?} asked for a pause of {ms} ms more (its own rate limit)"),
        );
        e.code = Some("upstream_rate_limited");
        insert(
            &mut e.headers,
            "retry-after",
            &ms.div_ceil(1000).to_string(),
        );
        insert(&mut e.headers, "retry-after-ms", &ms.to_string());
        e
    }

    /// Every place upstream stayed taken for as long as the call may wait
    /// (`[queue] max_wait_ms`): a 429 the SDKs retry after a second.
    pub fn upstream_busy(upstream: &str, waited: std::time::Duration) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_exceeded",
            format!(
                "upstream {upstream:?} had no free place for {} ms, as long as a call may wait ([queue] max_wait_ms)",
                waited.as_millis()
            ),
        );
        e.code = Some("upstream_busy");
        insert(&mut e.headers, "retry-after", "1");
        insert(&mut e.headers, "retry-after-ms", "1000");
        e
    }

    /// A ledger denial: 429 (retry after), 402 (budget: the SDKs do not
    /// retry it) or 422 (the call can never fit).
    pub fn denied(d: &Denial, now: Timestamp, catalog: &Catalog) -> Self {
        let (status, openai_type, code) = match d.kind {
            DenialKind::RateLimited => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_exceeded",
                "rate_limited",
            ),
            DenialKind::BudgetExhausted => (
                StatusCode::PAYMENT_REQUIRED,
                "insufficient_quota",
                "budget_exhausted",
            ),
            DenialKind::ExceedsLimit => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request_error",
                "exceeds_limit",
            ),
        };
        let mut e = Self::new(status, openai_type, d.to_string());
        e.code = Some(code);
        if let Some(ms) = d.retry_after_ms {
            insert(
                &mut e.headers,
                "retry-after",
                &ms.div_ceil(1000).to_string(),
            );
            // The SDKs read this one first, to the millisecond.
            insert(&mut e.headers, "retry-after-ms", &ms.to_string());
        }
        crate::error::denial_headers(&mut e.headers, d, now, catalog);
        e.denial = Some(DenialBody::of(d));
        e
    }

    /// The error body in `flavor`.
    pub fn body(&self, flavor: Flavor) -> Value {
        let mut v = match flavor {
            Flavor::OpenAi => json!({"error": {
                "message": self.message,
                "type": self.openai_type,
                "param": self.param,
                "code": self.code,
            }}),
            // Anthropic's shape has no field member: the message names it.
            Flavor::Anthropic => json!({"type": "error", "error": {
                "type": anthropic_type(self.status),
                "message": match &self.param {
                    Some(p) => format!("{p}: {}", self.message),
                    None => self.message.clone(),
                },
            }}),
        };
        if let (Some(d), Some(err)) = (&self.denial, v.get_mut("error"))
            && let Ok(d) = serde_json::to_value(d)
        {
            err["allowance"] = d;
        }
        v
    }

    /// The whole answer in `flavor`. `extra` (the call's own headers) never
    /// overrides the error's: a denial carries the headers of the limit
    /// that said no.
    pub fn respond(self, flavor: Flavor, extra: HeaderMap) -> Response {
        let body = self.body(flavor);
        let mut r = (self.status, axum::Json(body)).into_response();
        r.headers_mut().extend(extra);
        if let Some(d) = &self.denial {
            denial_ratelimit_headers(r.headers_mut(), d, flavor);
        }
        r.headers_mut().extend(self.headers);
        r
    }
}

/// Anthropic's error type for a status.
fn anthropic_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 405 | 413 | 415 | 422 => "invalid_request_error",
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// One SSE event that ends a stream the gateway cut, in `flavor` (and the
/// Responses API's shape when `responses`).
pub(crate) fn stream_error_event(e: &GatewayError, flavor: Flavor, responses: bool) -> String {
    if responses {
        let v = json!({"type": "error", "code": e.code, "message": e.message, "param": null});
        return format!("event: error\ndata: {v}\n\n");
    }
    match flavor {
        Flavor::OpenAi => format!("data: {}\n\n", e.body(flavor)),
        Flavor::Anthropic => format!("event: error\ndata: {}\n\n", e.body(flavor)),
    }
}

/// The provider-style rate-limit headers of a call: the tightest
/// `requests` limit and the tightest `tokens` limit over the call's scopes
/// (HTTP-API.md answer 10). OpenAI resets are durations (`1s`, `6m0s`);
/// Anthropic's are RFC 3339 instants.
pub(crate) fn ratelimit_headers(
    remaining: &[Remaining],
    now: Timestamp,
    flavor: Flavor,
) -> HeaderMap {
    let mut h = HeaderMap::new();
    for word in ["requests", "tokens"] {
        let of_dimension = remaining.iter().filter(|r| r.dimension == word);
        let Some(r) = crate::headers::tightest(of_dimension) else {
            continue;
        };
        let reset_ms = r
            .resets_at
            .map(|at| at.as_millis().saturating_sub(now.as_millis()));
        // Anthropic's reset is an instant, to the second.
        let reset_at = reset_ms.and_then(|ms| {
            let ts = jiff::Timestamp::from_millisecond((now.as_millis() + ms) as i64).ok()?;
            Some(ts.round(jiff::Unit::Second).unwrap_or(ts).to_string())
        });
        limit_headers(
            &mut h,
            flavor,
            word,
            r.capacity,
            r.remaining,
            reset_ms,
            reset_at,
        );
    }
    h
}

/// A denial by a `requests` or `tokens` limit carries the same rate-limit
/// headers a success does, for the limit that said no: its capacity, what
/// is left (none, or less than asked) and when a retry can pass (OpenAI: a
/// duration; Anthropic: the instant the window frees room).
fn denial_ratelimit_headers(h: &mut HeaderMap, d: &DenialBody, flavor: Flavor) {
    if matches!(d.dimension.as_str(), "requests" | "tokens") {
        limit_headers(
            h,
            flavor,
            &d.dimension,
            d.capacity,
            d.remaining,
            d.retry_after_ms,
            d.resets_at.clone(),
        );
    }
}

/// One limit's rate-limit headers in `flavor`'s names: `x-ratelimit-*-{word}`
/// with a duration reset (`reset_ms`), or `anthropic-ratelimit-{word}-*`
/// with an instant (`reset_at`, RFC 3339).
fn limit_headers(
    h: &mut HeaderMap,
    flavor: Flavor,
    word: &str,
    capacity: u64,
    remaining: i64,
    reset_ms: Option<u64>,
    reset_at: Option<String>,
) {
    let left = remaining.max(0).to_string();
    match flavor {
        Flavor::OpenAi => {
            insert(
                h,
                &format!("x-ratelimit-limit-{word}"),
                &capacity.to_string(),
            );
            insert(h, &format!("x-ratelimit-remaining-{word}"), &left);
            if let Some(ms) = reset_ms {
                insert(h, &format!("x-ratelimit-reset-{word}"), &go_duration(ms));
            }
        }
        Flavor::Anthropic => {
            let base = format!("anthropic-ratelimit-{word}");
            insert(h, &format!("{base}-limit"), &capacity.to_string());
            insert(h, &format!("{base}-remaining"), &left);
            if let Some(at) = reset_at {
                insert(h, &format!("{base}-reset"), &at);
            }
        }
    }
}

/// A duration in OpenAI's (Go's) format: `12ms`, `1s`, `1.5s`, `6m0s`,
/// `1h2m3s` (the unit test below pins each form).
pub(crate) fn go_duration(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let h = ms / 3_600_000;
    let m = ms / 60_000 % 60;
    let s_ms = ms % 60_000;
    let secs = if s_ms.is_multiple_of(1000) {
        format!("{}s", s_ms / 1000)
    } else {
        let frac = format!("{:03}", s_ms % 1000);
        format!("{}.{}s", s_ms / 1000, frac.trim_end_matches('0'))
    };
    match (h, m) {
        (0, 0) => secs,
        (0, m) => format!("{m}m{secs}"),
        (h, m) => format!("{h}h{m}m{secs}"),
    }
}

pub(crate) fn insert(h: &mut HeaderMap, name: &str, value: &str) {
    if let (Ok(n), Ok(v)) = (HeaderName::try_from(name), HeaderValue::from_str(value)) {
        h.insert(n, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_openai_s() {
        assert_eq!(go_duration(0), "0ms");
        assert_eq!(go_duration(12), "12ms");
        assert_eq!(go_duration(1000), "1s");
        assert_eq!(go_duration(1500), "1.5s");
        assert_eq!(go_duration(1250), "1.25s");
        assert_eq!(go_duration(360_000), "6m0s");
        assert_eq!(go_duration(3_723_000), "1h2m3s");
        assert_eq!(go_duration(3_600_000), "1h0m0s");
    }

    #[test]
    fn anthropic_types_follow_the_status() {
        assert_eq!(
            anthropic_type(StatusCode::PAYMENT_REQUIRED),
            "billing_error"
        );
        assert_eq!(
            anthropic_type(StatusCode::TOO_MANY_REQUESTS),
            "rate_limit_error"
        );
        assert_eq!(
            anthropic_type(StatusCode::UNAUTHORIZED),
            "authentication_error"
        );
    }
}
