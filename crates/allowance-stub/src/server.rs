//! The HTTP side: model endpoints, control endpoints, and [`Stub`], the
//! running server.

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::body::{Piece, streamed};
use crate::call::{BadRequest, Call, Endpoint, Provider};
use crate::control::{
    Behavior, BehaviorPatch, ControlError, Controls, InFlight, MAX_OUTPUT_TOKENS, RecordedRequest,
    Scripted, Stats, unix_ms,
};
use crate::text::new_id;
use crate::{anthropic, openai};

/// Request bodies above this are refused (413): prompts in tests are far
/// smaller, and the whole body is held in memory.
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// How a stub is started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StubConfig {
    /// [`Behavior::output_tokens`] at start and after a reset (default 20).
    pub output_tokens: u32,
    /// Keep the request log (default true); benchmarks turn it off.
    pub record: bool,
}

impl Default for StubConfig {
    fn default() -> Self {
        Self {
            output_tokens: 20,
            record: true,
        }
    }
}

/// Why a stub did not start.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// What the OS said.
        source: io::Error,
    },
    /// `output_tokens` is above [`MAX_OUTPUT_TOKENS`].
    #[error("output_tokens: must be at most {MAX_OUTPUT_TOKENS}")]
    OutputTokens,
}

/// A running stub upstream. Dropping it stops accepting connections.
#[derive(Debug)]
pub struct Stub {
    addr: SocketAddr,
    controls: Arc<Controls>,
    server: JoinHandle<()>,
}

impl std::fmt::Debug for Controls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controls").finish_non_exhaustive()
    }
}

impl Stub {
    /// Starts a stub on `addr` (port 0 picks a free port) with the default
    /// [`StubConfig`]. It serves on the current tokio runtime.
    ///
    /// # Errors
    /// When the address cannot be bound.
    pub async fn spawn(addr: SocketAddr) -> Result<Self, SpawnError> {
        Self::spawn_with(addr, StubConfig::default()).await
    }

    /// Starts a stub on `addr` with `config`.
    ///
    /// # Errors
    /// When the address cannot be bound or the config is out of range.
    pub async fn spawn_with(addr: SocketAddr, config: StubConfig) -> Result<Self, SpawnError> {
        if config.output_tokens > MAX_OUTPUT_TOKENS {
            return Err(SpawnError::OutputTokens);
        }
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| SpawnError::Bind { addr, source })?;
        let local = listener
            .local_addr()
            .map_err(|source| SpawnError::Bind { addr, source })?;
        // Load the tokenizer now (~0.1 s once per process) rather than in
        // the first call, which a benchmark would otherwise count.
        let _ = tokio::task::spawn_blocking(|| crate::formula::token_count("warm up")).await;
        let controls = Arc::new(Controls::new(config.output_tokens, config.record));
        let app = router(Arc::clone(&controls));
        // Small SSE writes must leave at once: with Nagle's algorithm a
        // token event can wait for the client's delayed ACK (~40 ms).
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let server = tokio::spawn(async move {
            // Serving ends only when the task is aborted or accept fails for
            // good; neither leaves anything to report.
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            addr: local,
            controls,
            server,
        })
    }

    /// The address it listens on.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`, without `/v1`.
    #[must_use]
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The behaviour in force.
    #[must_use]
    pub fn behavior(&self) -> Behavior {
        self.controls.behavior()
    }

    /// Changes the behaviour for later calls; returns it whole.
    ///
    /// # Errors
    /// A field out of range (nothing changes then).
    pub fn set_behavior(&self, patch: &BehaviorPatch) -> Result<Behavior, ControlError> {
        self.controls.set_behavior(patch)
    }

    /// Queues one-shot answers for the next model calls, in order; returns
    /// the queue's length.
    ///
    /// # Errors
    /// An answer that cannot be sent, or a full queue (nothing is queued
    /// then).
    pub fn enqueue(
        &self,
        answers: impl IntoIterator<Item = Scripted>,
    ) -> Result<usize, ControlError> {
        self.controls.enqueue(answers.into_iter().collect())
    }

    /// The request log, oldest first.
    #[must_use]
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.controls.requests()
    }

    /// The call counters.
    #[must_use]
    pub fn stats(&self) -> Stats {
        self.controls.stats()
    }

    /// Clears the queue, the log, the counters and the behaviour.
    pub fn reset(&self) {
        self.controls.reset();
    }
}

impl Drop for Stub {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// The stub's routes over `controls`.
pub(crate) fn router(controls: Arc<Controls>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/responses", post(responses))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/messages", post(messages))
        .route("/_stub/behavior", get(get_behavior).post(post_behavior))
        .route("/_stub/enqueue", post(enqueue))
        .route("/_stub/requests", get(requests))
        .route("/_stub/stats", get(stats))
        .route("/_stub/reset", post(reset))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(controls)
}

type Shared = State<Arc<Controls>>;

async fn chat(State(controls): Shared, headers: HeaderMap, body: Bytes) -> Response {
    model_call(controls, Endpoint::Chat, &headers, &body).await
}

async fn responses(State(controls): Shared, headers: HeaderMap, body: Bytes) -> Response {
    model_call(controls, Endpoint::Responses, &headers, &body).await
}

async fn embeddings(State(controls): Shared, headers: HeaderMap, body: Bytes) -> Response {
    model_call(controls, Endpoint::Embeddings, &headers, &body).await
}

async fn messages(State(controls): Shared, headers: HeaderMap, body: Bytes) -> Response {
    model_call(controls, Endpoint::Messages, &headers, &body).await
}

async fn models(headers: HeaderMap) -> Response {
    // Anthropic's SDK always sends `anthropic-version`; OpenAI's never does.
    let (body, id_header) = if headers.contains_key("anthropic-version") {
        (anthropic::models_json(), "request-id")
    } else {
        (openai::models_json(), "x-request-id")
    };
    let mut response = json_response(StatusCode::OK, &body);
    set_header(&mut response, id_header, &new_id("req_"));
    response
}

fn header_log(headers: &HeaderMap) -> BTreeMap<String, String> {
    let mut log: BTreeMap<String, String> = BTreeMap::new();
    for (name, value) in headers {
        let value = String::from_utf8_lossy(value.as_bytes());
        log.entry(name.as_str().to_owned())
            .and_modify(|joined| {
                joined.push_str(", ");
                joined.push_str(&value);
            })
            .or_insert_with(|| value.into_owned());
    }
    log
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    (
        status,
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        bytes,
    )
        .into_response()
}

fn set_header(response: &mut Response, name: &str, value: &str) {
    if let (Ok(name), Ok(value)) = (
        HeaderName::from_bytes(name.as_bytes()),
        HeaderValue::from_str(value),
    ) {
        response.headers_mut().insert(name, value);
    }
}

fn error_response(
    provider: Provider,
    status: u16,
    message: &str,
    param: Option<&str>,
    request_id: &str,
) -> Response {
    let body = match provider {
        Provider::OpenAi => openai::error_body(status, message, param),
        Provider::Anthropic => anthropic::error_body(status, message, request_id),
    };
    json_response(
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        &body,
    )
}

fn default_message(provider: Provider, status: u16) -> &'static str {
    match provider {
        Provider::OpenAi => openai::default_message(status),
        Provider::Anthropic => anthropic::default_message(status),
    }
}

fn bad_request(provider: Provider, bad: &BadRequest, request_id: &str) -> Response {
    error_response(
        provider,
        400,
        &bad.message,
        bad.param.as_deref(),
        request_id,
    )
}

async fn sleep_ms(ms: u64) {
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// One model call, in a fixed order: count and record it, refuse a bad
/// body (400), refuse past the concurrency limit (429), take the next
/// scripted answer, then answer.
async fn model_call(
    controls: Arc<Controls>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    raw: &Bytes,
) -> Response {
    let received_at_ms = unix_ms();
    controls.count_call();
    let parsed = serde_json::from_slice::<Value>(raw);
    if controls.records() {
        let body = match &parsed {
            Ok(value) => value.clone(),
            Err(_) => Value::String(String::from_utf8_lossy(raw).into_owned()),
        };
        controls.record(RecordedRequest {
            path: endpoint.path().to_owned(),
            received_at_ms,
            headers: header_log(headers),
            body,
        });
    }
    let provider = endpoint.provider();
    let request_id = new_id("req_");
    let id_header = match provider {
        Provider::OpenAi => "x-request-id",
        Provider::Anthropic => "request-id",
    };
    let mut response = match parsed {
        Err(error) => {
            let message = format!("We could not parse the JSON body of your request: {error}");
            bad_request(provider, &BadRequest::new(None, message), &request_id)
        }
        Ok(body) => match Call::parse(endpoint, &body) {
            Err(bad) => bad_request(provider, &bad, &request_id),
            Ok(call) => admitted_call(&controls, call, &request_id).await,
        },
    };
    set_header(&mut response, id_header, &request_id);
    response
}

async fn admitted_call(controls: &Arc<Controls>, call: Call, request_id: &str) -> Response {
    let provider = call.endpoint.provider();
    let behavior = controls.behavior();
    let Some(in_flight) = controls.admit(behavior.concurrency_limit) else {
        let message = "Too many concurrent requests: the concurrency limit is reached.";
        return error_response(provider, 429, message, None, request_id);
    };
    let scripted = controls.next_scripted().unwrap_or_default();
    if let Some(ms) = scripted.hang_ms {
        sleep_ms(ms).await;
    }
    let mut response = match scripted.status {
        Some(status) => match &scripted.body {
            Some(body) => {
                json_response(StatusCode::from_u16(status).unwrap_or(StatusCode::OK), body)
            }
            None => error_response(
                provider,
                status,
                default_message(provider, status),
                None,
                request_id,
            ),
        },
        None => answer(&call, &behavior, scripted.cut_after_tokens, in_flight).await,
    };
    for (name, value) in &scripted.headers {
        set_header(&mut response, name, value);
    }
    response
}

/// A successful answer, after the behaviour's delays.
async fn answer(
    call: &Call,
    behavior: &Behavior,
    cut_after_tokens: Option<u32>,
    in_flight: InFlight,
) -> Response {
    sleep_ms(behavior.first_byte_delay_ms).await;
    let output_tokens = call.output_tokens(behavior.output_tokens);
    let hit_bound = call.hit_bound(behavior.output_tokens);
    let mut call = call.clone();
    call.reasoning_tokens = call.reasoning_tokens(behavior.reasoning_tokens, output_tokens);
    let call = &call;
    let token_delay = Duration::from_millis(behavior.token_delay_ms);
    let cut = cut_after_tokens.map(u64::from);
    let events = match (call.stream, call.endpoint) {
        (false, _) | (true, Endpoint::Embeddings) => None,
        (true, Endpoint::Chat) => Some(openai::chat_events(call, output_tokens, hit_bound)),
        (true, Endpoint::Responses) => Some(openai::responses_events(call, output_tokens)),
        (true, Endpoint::Messages) => {
            Some(anthropic::message_events(call, output_tokens, hit_bound))
        }
    };
    if let Some(events) = events {
        let body = streamed(events.into_pieces(cut), token_delay, Some(in_flight));
        return (
            StatusCode::OK,
            [
                (
                    CONTENT_TYPE,
                    HeaderValue::from_static("text/event-stream; charset=utf-8"),
                ),
                (CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            ],
            body,
        )
            .into_response();
    }
    // A non-streaming answer takes as long as generating it would.
    let generation = token_delay.saturating_mul(u32::try_from(output_tokens).unwrap_or(u32::MAX));
    if !generation.is_zero() {
        tokio::time::sleep(generation).await;
    }
    let body = match (call.endpoint, call.embedding) {
        (Endpoint::Chat, _) => openai::chat_json(call, output_tokens, hit_bound),
        (Endpoint::Responses, _) => openai::responses_json(call, output_tokens),
        (Endpoint::Messages, _) => anthropic::message_json(call, output_tokens, hit_bound),
        (Endpoint::Embeddings, Some(shape)) => openai::embeddings_json(call, shape),
        (Endpoint::Embeddings, None) => json!({}),
    };
    let Some(_) = cut else {
        return json_response(StatusCode::OK, &body);
    };
    // Cut mid-body: half of the JSON, then the connection drops.
    let mut bytes = serde_json::to_vec(&body).unwrap_or_default();
    bytes.truncate(bytes.len() / 2);
    let pieces = vec![Piece::Event(Bytes::from(bytes)), Piece::Cut];
    (
        StatusCode::OK,
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        streamed(pieces, Duration::ZERO, Some(in_flight)),
    )
        .into_response()
}

#[derive(serde::Serialize)]
struct ControlFailure {
    error: String,
}

fn control_error(status: StatusCode, message: String) -> Response {
    (status, axum::Json(ControlFailure { error: message })).into_response()
}

/// Parses a control body; the error message names the field that is wrong.
fn parse_control<T: DeserializeOwned>(raw: &[u8]) -> Result<T, String> {
    let mut deserializer = serde_json::Deserializer::from_slice(raw);
    serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        let path = error.path().to_string();
        if path == "." {
            error.inner().to_string()
        } else {
            format!("{path}: {}", error.inner())
        }
    })
}

async fn get_behavior(State(controls): Shared) -> Response {
    axum::Json(controls.behavior()).into_response()
}

async fn post_behavior(State(controls): Shared, raw: Bytes) -> Response {
    let patch: BehaviorPatch = match parse_control(&raw) {
        Ok(patch) => patch,
        Err(message) => return control_error(StatusCode::BAD_REQUEST, message),
    };
    match controls.set_behavior(&patch) {
        Ok(behavior) => axum::Json(behavior).into_response(),
        Err(error) => control_error(StatusCode::BAD_REQUEST, error.to_string()),
    }
}

async fn enqueue(State(controls): Shared, raw: Bytes) -> Response {
    let answers: Vec<Scripted> = match parse_control(&raw) {
        Ok(answers) => answers,
        Err(message) => return control_error(StatusCode::BAD_REQUEST, message),
    };
    match controls.enqueue(answers) {
        Ok(queued) => axum::Json(json!({"queued": queued})).into_response(),
        Err(error) => control_error(StatusCode::BAD_REQUEST, error.to_string()),
    }
}

async fn requests(State(controls): Shared) -> Response {
    axum::Json(controls.requests()).into_response()
}

async fn stats(State(controls): Shared) -> Response {
    axum::Json(controls.stats()).into_response()
}

async fn reset(State(controls): Shared) -> Response {
    controls.reset();
    axum::Json(json!({"reset": true})).into_response()
}

async fn not_found(method: Method, uri: Uri) -> Response {
    let message = format!("Invalid URL ({method} {})", uri.path());
    let mut response = error_response(Provider::OpenAi, 404, &message, None, "");
    set_header(&mut response, "x-request-id", &new_id("req_"));
    response
}
