//! Every non-2xx answer: `{"error": {"type", "message", ...}}`, with the
//! denial headers where they apply.

use allowance_core::{
    AdminError, Catalog, Denial, DenialKind, ExtendError, Invalid, RefundError, ReserveError,
    SettleError, StoreError, Timestamp, Unavailable,
};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::headers;
use crate::wire::{rfc3339, window_name};

/// The error body's inner object. Denial fields are present only on
/// denials; `field` only on `invalid_request` (and absent when the body is
/// not JSON at all).
#[derive(Debug, Serialize, ToSchema, PartialEq)]
pub struct ErrorObject {
    /// `invalid_request`, `unauthorized`, `forbidden`, `not_found`,
    /// `conflict`, `rate_limited`, `budget_exhausted`, `exceeds_limit`,
    /// `payload_too_large`, `unsupported_media_type`, `store_unavailable`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// For a human.
    pub message: String,
    /// Dotted path to the offending field (`amounts.input_tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The denial's details. (Documented as optional properties of this
    /// object: the OpenAPI document's `FlattenedSchemas` adds them.)
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    #[schema(ignore)]
    pub denial: Option<DenialBody>,
    /// The reservation's status, on a `conflict` about one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<&'static str>,
    /// A waiting reserve refused because the admission queue is full.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_full: Option<bool>,
}

/// What a denial adds to the error object (HTTP-API.md "Errors").
#[derive(Debug, Serialize, ToSchema, PartialEq)]
pub struct DenialBody {
    /// The canonical scope whose limit said no.
    pub scope: String,
    /// The limit's dimension.
    pub dimension: String,
    /// The limit's window kind.
    pub window: &'static str,
    /// The limit's capacity.
    pub capacity: u64,
    /// `capacity − used − held` now.
    pub remaining: i64,
    /// What the request asked of this limit.
    pub requested: u64,
    /// When a retry can pass; null when no retry will help.
    pub retry_after_ms: Option<u64>,
    /// When the window next frees room, where such an instant exists.
    pub resets_at: Option<String>,
}

impl DenialBody {
    /// The body's denial fields of `d`.
    pub fn of(d: &Denial) -> DenialBody {
        DenialBody {
            scope: d.scope.as_str().to_string(),
            dimension: d.dimension.clone(),
            window: window_name(d.window),
            capacity: d.capacity,
            remaining: d.remaining,
            requested: d.requested,
            retry_after_ms: d.retry_after_ms,
            resets_at: d.resets_at.map(rfc3339),
        }
    }
}

/// The headers every denial carries, native or gateway: `X-Budget-Scope`,
/// `X-Budget-Dimension`, `RateLimit-Policy` and `RateLimit`.
pub(crate) fn denial_headers(h: &mut HeaderMap, d: &Denial, now: Timestamp, catalog: &Catalog) {
    let mut put = |name: &'static str, value: &str| {
        if let Ok(v) = HeaderValue::from_str(value) {
            h.insert(HeaderName::from_static(name), v);
        }
    };
    put("x-budget-scope", d.scope.as_str());
    put("x-budget-dimension", &d.dimension);
    let binding = headers::Binding::from_denial(d, now, catalog);
    put("ratelimit-policy", &binding.policy());
    put("ratelimit", &binding.state());
}

/// `{"error": {...}}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorObject,
}

/// An error answer: status, body and extra headers (boxed: errors are
/// rare, and `Result`s on the hot path stay small).
#[derive(Debug)]
pub struct ApiError(Box<Repr>);

#[derive(Debug)]
struct Repr {
    status: StatusCode,
    object: ErrorObject,
    headers: HeaderMap,
}

impl ApiError {
    fn plain(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError(Box::new(Repr {
            status,
            object: ErrorObject {
                kind,
                message: message.into(),
                field: None,
                denial: None,
                status: None,
                queue_full: None,
            },
            headers: HeaderMap::new(),
        }))
    }

    /// 400 `invalid_request` naming `field` (a dotted path; `None` when the
    /// body is not JSON at all).
    pub fn invalid(field: Option<String>, message: impl Into<String>) -> Self {
        let mut e = Self::plain(StatusCode::BAD_REQUEST, "invalid_request", message);
        e.0.object.field = field;
        e
    }

    /// 401: no credential, or an unknown one.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        let mut e = Self::plain(StatusCode::UNAUTHORIZED, "unauthorized", message);
        e.0.headers.insert(
            axum::http::header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer"),
        );
        e
    }

    /// 403: the credential may not do this.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::plain(StatusCode::FORBIDDEN, "forbidden", message)
    }

    /// 404.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::plain(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// 409, optionally naming the reservation's status.
    pub fn conflict(message: impl Into<String>, status: Option<&'static str>) -> Self {
        let mut e = Self::plain(StatusCode::CONFLICT, "conflict", message);
        e.0.object.status = status;
        e
    }

    /// 413: a body over the limit.
    pub fn payload_too_large(limit_bytes: usize) -> Self {
        Self::plain(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the body is larger than {limit_bytes} bytes"),
        )
    }

    /// 415: a body that is not `application/json`.
    pub fn unsupported_media_type() -> Self {
        Self::plain(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "the body must be JSON, sent with Content-Type: application/json",
        )
    }

    /// 503: the store did not answer; the outcome is unknown.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            message,
        )
    }

    /// 404 for an unknown route or method (in the same error shape).
    pub fn no_route() -> Self {
        Self::not_found("no such route")
    }

    /// A path that exists but not with this method. The spec's error types
    /// have no 405; the (method, path) route does not exist, so 404.
    pub fn method_not_allowed() -> Self {
        Self::not_found("no such route: this path does not take that method")
    }

    /// With `Allow: methods` (axum adds its route's own to an answer that
    /// has none).
    pub fn with_allow(mut self, methods: &'static str) -> Self {
        self.0
            .headers
            .insert(axum::http::header::ALLOW, HeaderValue::from_static(methods));
        self
    }

    /// A denial: 429, 402 or 422 with every header HTTP-API.md asks for.
    pub fn denied(d: &Denial, now: Timestamp, catalog: &Catalog) -> Self {
        let (status, kind) = match d.kind {
            DenialKind::RateLimited => (StatusCode::TOO_MANY_REQUESTS, "rate_limited"),
            DenialKind::BudgetExhausted => (StatusCode::PAYMENT_REQUIRED, "budget_exhausted"),
            DenialKind::ExceedsLimit => (StatusCode::UNPROCESSABLE_ENTITY, "exceeds_limit"),
        };
        let mut e = Self::plain(status, kind, d.to_string());
        e.0.object.denial = Some(DenialBody::of(d));
        if let (DenialKind::RateLimited, Some(ms)) = (d.kind, d.retry_after_ms) {
            e.0.headers.insert(
                axum::http::header::RETRY_AFTER,
                HeaderValue::from(ms.div_ceil(1000)),
            );
        }
        denial_headers(&mut e.0.headers, d, now, catalog);
        e
    }

    /// Marks a denial as given because the admission queue is full.
    pub fn queue_full(mut self) -> Self {
        self.0.object.queue_full = Some(true);
        self
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.0.status
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let Repr {
            status,
            object,
            headers,
        } = *self.0;
        (status, headers, axum::Json(ErrorBody { error: object })).into_response()
    }
}

impl From<Invalid> for ApiError {
    fn from(i: Invalid) -> Self {
        ApiError::invalid(Some(i.field), i.message)
    }
}

impl From<Unavailable> for ApiError {
    fn from(u: Unavailable) -> Self {
        ApiError::unavailable(u.0)
    }
}

/// Maps an operation's error to its answer; denials need the catalog and
/// the instant for their headers.
pub(crate) trait IntoApiError {
    fn into_api(self, now: Timestamp, catalog: &Catalog) -> ApiError;
}

impl IntoApiError for ReserveError {
    fn into_api(self, now: Timestamp, catalog: &Catalog) -> ApiError {
        match self {
            ReserveError::Invalid(i) => i.into(),
            ReserveError::Denied(d) => ApiError::denied(&d, now, catalog),
            ReserveError::IdempotencyConflict { key } => ApiError::conflict(
                format!("idempotency key {key:?} was used for a different request"),
                None,
            ),
            // 128 random bits collided: the caller may simply retry.
            ReserveError::DuplicateId => {
                ApiError::unavailable("reservation id collision; retry the request")
            }
        }
    }
}

impl IntoApiError for SettleError {
    fn into_api(self, _: Timestamp, _: &Catalog) -> ApiError {
        match self {
            SettleError::Invalid(i) => i.into(),
            SettleError::NotFound => ApiError::not_found("reservation not found"),
            SettleError::Conflict { status } => ApiError::conflict(
                format!("reservation is {status}, it cannot be settled"),
                Some(status.as_str()),
            ),
        }
    }
}

impl IntoApiError for RefundError {
    fn into_api(self, _: Timestamp, _: &Catalog) -> ApiError {
        match self {
            RefundError::NotFound => ApiError::not_found("reservation not found"),
            RefundError::Conflict { status } => ApiError::conflict(
                format!("reservation is {status}, it cannot be refunded"),
                Some(status.as_str()),
            ),
        }
    }
}

impl IntoApiError for ExtendError {
    fn into_api(self, now: Timestamp, catalog: &Catalog) -> ApiError {
        match self {
            ExtendError::Invalid(i) => i.into(),
            ExtendError::NotFound => ApiError::not_found("reservation not found"),
            ExtendError::NotHeld { status } => ApiError::conflict(
                format!("reservation is {status}, only a held reservation can be extended"),
                Some(status.as_str()),
            ),
            ExtendError::Denied(d) => ApiError::denied(&d, now, catalog),
        }
    }
}

impl IntoApiError for AdminError {
    fn into_api(self, _: Timestamp, _: &Catalog) -> ApiError {
        match self {
            AdminError::Invalid(i) => i.into(),
            AdminError::NotFound(what) => ApiError::not_found(format!("{what} not found")),
        }
    }
}

impl<E: IntoApiError> IntoApiError for StoreError<E> {
    fn into_api(self, now: Timestamp, catalog: &Catalog) -> ApiError {
        match self {
            StoreError::Rejected(e) => e.into_api(now, catalog),
            StoreError::Unavailable(u) => u.into(),
        }
    }
}
