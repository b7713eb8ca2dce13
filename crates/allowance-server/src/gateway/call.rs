//! One gateway call, from the client's bytes to the answer: authenticate,
//! estimate, reserve, schedule on the upstream, forward (retrying 429s and
//! 5xx with the same hold), settle or refund.

use std::sync::Arc;
use std::time::Duration;

use allowance_config::{DEFAULT_MAX_OUTPUT_TOKENS, GATEWAY_TENANT, GatewayKey, UPSTREAM_KIND};
use allowance_core::{
    Amounts, Catalog, Dimension, Durable, Granted, ReservationId, ReserveError, ReserveRequest,
    StoreError, Usage,
};
use allowance_estimate::{Api, Estimate, Tokenizer};
use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use serde_json::Value;
use tokio::time::Instant;

use super::answer::{Flavor, GatewayError, insert, ratelimit_headers};
use super::upstream::{BACKOFF_MAX, MAX_RETRY_WAIT, Permit, Upstream};
use super::{Gateway, stream};
use crate::AppState;
use crate::routes::admit;

/// Bound on opening a connection to an upstream.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on a non-streaming answer, and on the silence between two events
/// of a stream: generations are long, a dead upstream must still end.
pub(crate) const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(600);
/// Bodies past this size are tokenized off the async workers (a 32K-token
/// prompt takes milliseconds).
const TOKENIZE_INLINE_BYTES: usize = 64 * 1024;
/// A stream whose body is past this size (~4K tokens, ~0.5 ms to tokenize)
/// is held on a bound of its input and counted exactly while the call runs
/// (see [`Prepared::count_later`]).
const BOUND_FIRST_BYTES: usize = 16 * 1024;
/// Backoff between retries of a 5xx or a refused connection (per call,
/// doubled per attempt, jittered).
const SERVER_ERROR_BACKOFF: Duration = Duration::from_millis(250);

/// Client-supplied scope headers: `X-Allowance-<Kind>`.
const SCOPE_HEADER_PREFIX: &str = "x-allowance-";

/// What a call needs once its request is understood.
pub(crate) struct Prepared {
    pub api: Api,
    pub flavor: Flavor,
    pub upstream: Arc<Upstream>,
    pub http: reqwest::Client,
    pub catalog: Arc<Catalog>,
    pub tenant: String,
    pub tenant_req: ReserveRequest,
    /// Each upstream attempt's reservation: `upstream:<name>` of the
    /// internal tenant, the same amounts.
    pub attempt_req: ReserveRequest,
    pub model: String,
    pub tokenizer: Tokenizer,
    pub estimate: Estimate,
    /// Output tokens the whole call may produce (the request's bound or the
    /// model's).
    pub output_bound: u64,
    /// Whether the request set `output_bound` itself. When it did not, the
    /// model's `max_output_tokens` is only the estimate: the provider is not
    /// told to stop there, so a stream tops up past it, tranche by tranche,
    /// until a top-up is refused.
    pub bounded: bool,
    /// Output tokens reserved at first (all of them, or a stream's tranche).
    pub output_reserved: u64,
    pub tranche_tokens: u64,
    /// The body to send (rewritten when `include_usage` was injected).
    pub body: Bytes,
    /// Whether the gateway added `stream_options.include_usage`.
    pub injected_usage: bool,
    /// The body, when `estimate.input_tokens` is a bound, not a count: a
    /// long stream's prompt is not tokenized before the call (milliseconds
    /// at 32K tokens, all of it before the first byte) but held on the
    /// bound of its byte length, and counted on the background thread while
    /// the provider works; the holds are then swapped for exact ones.
    pub count_later: Option<Value>,
    /// The path and query as received (`/v1/chat/completions?x=1`).
    pub path: String,
    /// Headers passed upstream as received (`anthropic-version`, …).
    pub passed: HeaderMap,
    pub started: Instant,
}

/// The route handler's body: everything after parsing runs in its own
/// task, so a client that goes away mid-call does not cut it half-way (the
/// call still settles what the provider produced).
pub(crate) async fn handle(state: AppState, api: Api, headers: HeaderMap, body: Body) -> Response {
    let flavor = match api {
        Api::AnthropicMessages => Flavor::Anthropic,
        _ => Flavor::OpenAi,
    };
    let started = Instant::now();
    let prepared = match prepare(&state, api, flavor, &headers, body, started).await {
        Ok(p) => p,
        Err(e) => {
            count_call(api, "invalid");
            return e.respond(flavor, HeaderMap::new());
        }
    };
    match tokio::spawn(run(state, prepared)).await {
        Ok(r) => r,
        Err(_) => GatewayError::unavailable("the call failed inside the gateway")
            .respond(flavor, HeaderMap::new()),
    }
}

fn api_name(api: Api) -> &'static str {
    match api {
        Api::ChatCompletions => "chat_completions",
        Api::Responses => "responses",
        Api::Embeddings => "embeddings",
        Api::AnthropicMessages => "messages",
    }
}

pub(crate) fn count_call(api: Api, outcome: &'static str) {
    ::metrics::counter!("allowance_gateway_calls_total", "api" => api_name(api), "outcome" => outcome)
        .increment(1);
}

/// The outcome a refused reserve counts as: a ledger's denial is
/// `denied`, but a store that did not answer is `unavailable` (its caller
/// also counts a store error: an outage must not read as tenants at their
/// limits), and a request the ledger found invalid is `invalid`.
fn refusal_outcome(e: &GatewayError) -> &'static str {
    match e.status {
        StatusCode::SERVICE_UNAVAILABLE => "unavailable",
        StatusCode::TOO_MANY_REQUESTS
        | StatusCode::PAYMENT_REQUIRED
        | StatusCode::UNPROCESSABLE_ENTITY => "denied",
        s if s.is_client_error() => "invalid",
        _ => "error",
    }
}

/// Everything that can refuse a call before anything is held.
async fn prepare(
    state: &AppState,
    api: Api,
    flavor: Flavor,
    headers: &HeaderMap,
    body: Body,
    started: Instant,
) -> Result<Prepared, GatewayError> {
    let gw: &Gateway = state
        .gateway()
        .ok_or_else(|| GatewayError::unavailable("the gateway is not configured"))?;
    let key = gw.authenticate(headers)?;
    if !crate::extract::is_json_content_type(headers) {
        return Err(GatewayError::unsupported_media_type(
            headers
                .get(axum::http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok()),
        ));
    }
    let bytes = axum::body::to_bytes(body, gw.max_body_bytes)
        .await
        .map_err(|_| GatewayError::too_large(gw.max_body_bytes))?;
    let mut json: Value = serde_json::from_slice(&bytes)
        .map_err(|e| GatewayError::invalid(None, format!("the body is not valid JSON: {e}")))?;
    let model = allowance_estimate::model_of(&json)
        .map_err(|e| GatewayError::invalid(Some(e.field), e.message))?
        .to_string();
    let upstream = gw.route(&model).cloned().ok_or_else(|| {
        GatewayError::invalid(
            Some("model".into()),
            format!("model {model:?} is not served by this gateway (GET /v1/models lists those that are)"),
        )
    })?;
    let catalog = state
        .call(state.store().catalog())
        .await
        .map_err(|_| GatewayError::unavailable("the store did not answer in time"))?
        .map_err(|e| GatewayError::unavailable(format!("the store is unavailable: {e}")))?;
    let price = catalog.model(&model);
    let tokenizer = price
        .and_then(|p| Tokenizer::from_name(&p.tokenizer))
        .unwrap_or(Tokenizer::O200kBase);
    let mut input_bounded = false;
    let estimate = if bytes.len() > BOUND_FIRST_BYTES
        && let Ok(b) = allowance_estimate::estimate_bound(api, &json, tokenizer)
        && (b.exact || b.estimate.stream)
    {
        // Exact from the cache (a re-sent conversation), or a stream that
        // can start on the bound. (A bad body is refused below, as ever.)
        input_bounded = !b.exact;
        Ok(b.estimate)
    } else if bytes.len() > TOKENIZE_INLINE_BYTES {
        // The body goes to the blocking thread and comes back: no copy.
        let (body, estimate) = tokio::task::spawn_blocking(move || {
            let e = allowance_estimate::estimate(api, &json, tokenizer);
            (json, e)
        })
        .await
        .map_err(|_| GatewayError::unavailable("the estimate failed"))?;
        json = body;
        estimate
    } else {
        allowance_estimate::estimate(api, &json, tokenizer)
    }
    .map_err(|e| GatewayError::invalid(Some(e.field), e.message))?;
    let mut output_bound = estimate
        .output_bound
        .or(price.map(|p| p.max_output_tokens))
        .unwrap_or(DEFAULT_MAX_OUTPUT_TOKENS);
    // Chat's `n` asks for that many choices, each up to the bound.
    if api == Api::ChatCompletions
        && let Some(n) = json.get("n").and_then(Value::as_u64)
        && n > 1
    {
        output_bound = output_bound.saturating_mul(n.min(128));
    }
    // Without a bound of its own the model's is only an estimate: nothing
    // tells the provider to stop there (see `Prepared::bounded`).
    let bounded = estimate.output_bound.is_some();
    // Reasoning is billed as output but never streamed: a stream that asks
    // for it cannot be metered as it flows, so it holds its whole bound up
    // front, as a whole call does.
    let reasoning = asks_for_reasoning(api, &json);
    let output_reserved = if estimate.stream && !reasoning {
        gw.tranche_tokens.min(output_bound)
    } else {
        output_bound
    };

    // Chat streams carry usage only when asked: ask, and hide the answer.
    let mut injected_usage = false;
    let mut body = bytes;
    if api == Api::ChatCompletions
        && estimate.stream
        && !estimate.include_usage
        && let Some(obj) = json.as_object_mut()
    {
        injected_usage = true;
        if !obj.contains_key("stream_options")
            && let Some(spliced) = with_last_member(&body, INCLUDE_USAGE_MEMBER)
        {
            // The client's bytes, one member more: a long prompt is not
            // encoded again (the member is new: no key is duplicated).
            body = spliced;
        } else {
            let opts = obj
                .entry("stream_options")
                .or_insert_with(|| Value::Object(Default::default()));
            if !opts.is_object() {
                *opts = Value::Object(Default::default());
            }
            opts["include_usage"] = Value::Bool(true);
            body = Bytes::from(serde_json::to_vec(&json).map_err(|e| {
                GatewayError::invalid(None, format!("the body cannot be re-encoded: {e}"))
            })?);
        }
    }

    let scopes = scopes_of(key, headers)?;
    let pairs: Vec<(&str, &str)> = scopes
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let set = catalog.scope_set(&key.tenant, &pairs).map_err(|e| {
        GatewayError::invalid(Some(e.field.replace("scopes.", "x-allowance-")), e.message)
    })?;
    let amounts = Amounts::new()
        .with(Dimension::INPUT_TOKENS, estimate.input_tokens)
        .with(Dimension::OUTPUT_TOKENS, output_reserved);
    let attempt_set = catalog
        .scope_set(
            GATEWAY_TENANT,
            &[(UPSTREAM_KIND, upstream.settings.name.as_str())],
        )
        .map_err(|e| GatewayError::unavailable(format!("upstream scope: {e}")))?;
    let attempt_req = ReserveRequest::new(attempt_set, amounts.clone());
    let mut tenant_req = ReserveRequest::new(set, amounts);
    tenant_req.model = Some(Arc::from(model.as_str()));
    tenant_req.report_remaining = true;

    let mut passed = HeaderMap::new();
    for (name, value) in headers {
        let n = name.as_str();
        if n.starts_with("anthropic-") || n == "openai-beta" || n == "accept" {
            passed.insert(name.clone(), value.clone());
        }
    }
    let count_later = input_bounded.then_some(json);
    Ok(Prepared {
        api,
        flavor,
        upstream,
        http: gw.http.clone(),
        catalog,
        tenant: key.tenant.clone(),
        tenant_req,
        attempt_req,
        model,
        tokenizer,
        estimate,
        output_bound,
        bounded,
        output_reserved,
        tranche_tokens: gw.tranche_tokens,
        body,
        injected_usage,
        count_later,
        path: String::new(),
        passed,
        started,
    })
}

/// Whether a request asks the model to reason: `reasoning` on
/// `/v1/responses`, `reasoning_effort` on chat completions, `thinking` on
/// Anthropic messages — unless it turns reasoning off (`"none"`,
/// `"disabled"`, `null`).
fn asks_for_reasoning(api: Api, json: &Value) -> bool {
    let off = |v: Option<&Value>| v.and_then(Value::as_str).is_some_and(|s| s == "none");
    match api {
        Api::Responses => match json.get("reasoning") {
            None | Some(Value::Null) => false,
            Some(r) => !off(r.get("effort")),
        },
        Api::ChatCompletions => match json.get("reasoning_effort") {
            None | Some(Value::Null) => false,
            Some(e) => !off(Some(e)),
        },
        Api::AnthropicMessages => match json.get("thinking") {
            None | Some(Value::Null) => false,
            Some(t) => t.get("type").and_then(Value::as_str) != Some("disabled"),
        },
        Api::Embeddings => false,
    }
}

/// The member that asks a chat stream for its usage.
const INCLUDE_USAGE_MEMBER: &[u8] = br#""stream_options":{"include_usage":true}"#;

/// `object` (the bytes of a JSON object, as parsed already, trailing
/// whitespace allowed) with `member` (`"key":value`) added last; `None` when
/// the bytes do not end the way a JSON object does.
fn with_last_member(object: &[u8], member: &[u8]) -> Option<Bytes> {
    let close = object.iter().rposition(|b| !b.is_ascii_whitespace())?;
    if object[close] != b'}' {
        return None;
    }
    let before = object[..close]
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())?;
    let mut out = Vec::with_capacity(object.len() + member.len() + 1);
    out.extend_from_slice(&object[..close]);
    if object[before] != b'{' {
        out.push(b',');
    }
    out.extend_from_slice(member);
    out.extend_from_slice(&object[close..]);
    Some(Bytes::from(out))
}

impl Prepared {
    /// Sets the input estimate, on the call's requests too.
    pub(crate) fn set_input_tokens(&mut self, input_tokens: u64) {
        self.estimate.input_tokens = input_tokens;
        self.tenant_req
            .amounts
            .set(Dimension::INPUT_TOKENS, input_tokens);
        self.attempt_req
            .amounts
            .set(Dimension::INPUT_TOKENS, input_tokens);
    }
}

/// The exact count of a body whose input was bounded, made in the
/// background while its call runs.
pub(crate) type Counting =
    tokio::sync::oneshot::Receiver<Result<Estimate, allowance_estimate::BadRequest>>;

/// Counts `json` exactly on the low-priority background thread: nobody
/// waits for it. `Err(json)` when its queue is full.
fn count_in_background(api: Api, tokenizer: Tokenizer, json: Value) -> Result<Counting, Value> {
    super::background::try_spawn(json, move |json| {
        allowance_estimate::estimate(api, &json, tokenizer)
    })
}

/// Counts `json` exactly on a blocking thread, for a call that waits.
async fn count_now(api: Api, tokenizer: Tokenizer, json: Value) -> Option<u64> {
    let counted =
        tokio::task::spawn_blocking(move || allowance_estimate::estimate(api, &json, tokenizer))
            .await;
    exact_count(counted)
}

/// The exact input count of a finished count, if it succeeded.
pub(crate) fn exact_count<E>(
    result: Result<Result<Estimate, allowance_estimate::BadRequest>, E>,
) -> Option<u64> {
    match result {
        Ok(Ok(e)) => Some(e.input_tokens),
        Ok(Err(e)) => {
            // The bound's pass accepted the same body: this cannot happen.
            tracing::warn!(error = %e, "gateway: the exact count refused a body the bound accepted; the bound stays");
            None
        }
        Err(_) => None,
    }
}

/// The scopes a call counts against besides its tenant: the key's user
/// and agent, and what the client adds with `X-Allowance-<Kind>` headers
/// for the kinds its key allows.
fn scopes_of(key: &GatewayKey, headers: &HeaderMap) -> Result<Vec<(String, String)>, GatewayError> {
    let mut out: Vec<(String, String)> = Vec::new();
    if let Some(u) = &key.user {
        out.push(("user".into(), u.clone()));
    }
    if let Some(a) = &key.agent {
        out.push(("agent".into(), a.clone()));
    }
    for (name, value) in headers {
        let Some(kind) = name.as_str().strip_prefix(SCOPE_HEADER_PREFIX) else {
            continue;
        };
        if !allowance_core::valid_kind(kind) {
            return Err(GatewayError::invalid(
                Some(name.as_str().to_string()),
                "a scope header is X-Allowance-<Kind>, with a kind such as agent or task",
            ));
        }
        let header = format!(
            "X-Allowance-{}{}",
            kind[..1].to_ascii_uppercase(),
            &kind[1..]
        );
        let id = value
            .to_str()
            .map_err(|_| GatewayError::invalid(Some(header.clone()), "not a valid scope id"))?;
        // The key always fixes the tenant, and its user and agent when it
        // names them.
        let fixed_by_key = match kind {
            "tenant" => Some(&key.tenant),
            "user" => key.user.as_ref(),
            "agent" => key.agent.as_ref(),
            _ => None,
        };
        if let Some(fixed) = fixed_by_key {
            // A header that repeats what the key fixes adds nothing: it
            // agrees, whether or not the kind is one the client may add.
            if fixed != id {
                return Err(GatewayError::forbidden(format!(
                    "{header}: the gateway key fixes {kind} {fixed:?}"
                )));
            }
            continue;
        }
        if !key.client_scopes.iter().any(|k| k == kind) {
            return Err(GatewayError::forbidden(format!(
                "{header}: this gateway key may not add `{kind}` scopes (its client_scopes are {:?})",
                key.client_scopes
            )));
        }
        if let Some((_, given)) = out.iter().find(|(k, _)| k == kind) {
            // The same header twice: one scope of a kind per call.
            if given != id {
                return Err(GatewayError::invalid(
                    Some(header.clone()),
                    format!(
                        "{header} is given twice, as {given:?} and {id:?}: a call has one {kind}"
                    ),
                ));
            }
            continue;
        }
        out.push((kind.to_string(), id.to_string()));
    }
    Ok(out)
}

/// How one upstream attempt ended.
enum Attempt {
    /// A 2xx answer (its attempt reservation is settled by whoever reads it).
    Answered(reqwest::Response, Option<ReservationId>, Permit),
    /// A final non-2xx answer to pass on.
    Failed(reqwest::Response),
    /// No answer at all; `sent` when the request may have reached the
    /// provider (a timeout, a connection lost after sending): the provider
    /// may have run it, so the client must not retry it either.
    NoAnswer { why: String, sent: bool },
    /// The gateway refused to schedule it (upstream limits).
    Refused(GatewayError),
}

/// The call from the reserve on.
async fn run(state: AppState, mut p: Prepared) -> Response {
    p.path = match p.api {
        Api::ChatCompletions => "/v1/chat/completions",
        Api::Responses => "/v1/responses",
        Api::Embeddings => "/v1/embeddings",
        Api::AnthropicMessages => "/v1/messages",
    }
    .to_string();
    // The caller's hold and the first attempt's place upstream are asked
    // for at once (one store round trip less, which is an fsync on the
    // durable store); the latter only when it needs no wait.
    let mut counting = None;
    let (granted, first) = match p.count_later.take() {
        None => tokio::join!(reserve_tenant(&state, &p, true), schedule_now(&state, &p)),
        Some(json) => {
            // The swap to exact holds reserves before it refunds: it needs
            // room for a second hold. A dry run of twice the bound's input,
            // asked beside the reserve, says whether there is (a swap that
            // found no room would leave the stream's top-ups to compete
            // with its own bound, and cut it for a size it does not have).
            let mut probe = p.tenant_req.clone();
            probe.dry_run = true;
            probe.report_remaining = false;
            probe.amounts.set(
                Dimension::INPUT_TOKENS,
                p.estimate.input_tokens.saturating_mul(2),
            );
            let (granted, first, room) = tokio::join!(
                reserve_tenant(&state, &p, false),
                schedule_now(&state, &p),
                admit(&state, &p.catalog, &probe, 0, 0, None)
            );
            let room_to_swap = matches!(room, Ok(Ok(_)));
            let later = if granted.is_ok() && first.is_some() && room_to_swap {
                // Held on the bound, with a place upstream: go, and count
                // meanwhile — unless the background queue is full.
                count_in_background(p.api, p.tokenizer, json)
            } else {
                Err(json)
            };
            match later {
                Ok(c) => {
                    counting = Some(c);
                    (granted, first)
                }
                Err(json) => {
                    // The bound does not fit, or leaves no room to swap, or
                    // must wait, or the background is busy: a refusal must be
                    // for the call's true size, so count first, as any call.
                    // (A refund is logged after the reserve it ends: no need to
                    // wait for the reserve's own durability.)
                    if let Ok((g, _)) = &granted {
                        refund(&state, g.id).await;
                    }
                    if let Some((permit, id, _)) = first {
                        drop(permit);
                        refund(&state, id).await;
                    }
                    if let Some(n) = count_now(p.api, p.tokenizer, json).await {
                        p.set_input_tokens(n);
                    }
                    tokio::join!(reserve_tenant(&state, &p, true), schedule_now(&state, &p))
                }
            }
        }
    };
    let (granted, first) = made_durable(&state, granted, first).await;
    let granted = match granted {
        Ok(g) => g,
        Err(e) => {
            if let Some((permit, id)) = first {
                drop(permit);
                refund(&state, id).await;
            }
            let outcome = refusal_outcome(&e);
            if outcome == "unavailable" {
                crate::metrics::store_error("gateway");
            }
            count_call(p.api, outcome);
            return e.respond(p.flavor, HeaderMap::new());
        }
    };
    // The caller's hold lives as long as the call, however long the
    // provider takes (a renewed lease, not a long TTL: a crashed gateway's
    // holds still expire soon).
    let lease = Lease::start(&state, &p, granted.id);
    let rate_headers = ratelimit_headers(&granted.remaining, state.now(), p.flavor);
    let (outcome, retried) = attempts(&state, &p, first).await;
    let mut extra = rate_headers;
    if retried {
        // The gateway retried already: the SDK must not multiply that.
        insert(&mut extra, "x-should-retry", "false");
    }
    match outcome {
        Attempt::Answered(resp, attempt_id, permit) => {
            p.upstream.on_success();
            // The answer decides: a provider may answer a stream request
            // whole (an embedding, an error page with a 200).
            let is_stream = resp
                .headers()
                .get(reqwest::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"));
            let lease = lease.and(&state, &p, attempt_id);
            if is_stream {
                stream::start(
                    state, p, granted.id, resp, attempt_id, permit, lease, extra, counting,
                )
            } else {
                // Answered whole after all: settled now, from exact figures.
                if let Some(c) = counting
                    && let Some(n) = exact_count(c.await)
                {
                    p.set_input_tokens(n);
                }
                let r = finish_whole(&state, &p, granted.id, resp, attempt_id, extra).await;
                drop(lease);
                drop(permit);
                r
            }
        }
        Attempt::Failed(resp) if resp.status() == reqwest::StatusCode::UNAUTHORIZED => {
            // The provider refused the gateway's upstream key, not the
            // client's gateway key: passed on as a 401, it would read as
            // the client's own key being wrong.
            drop(lease);
            refund(&state, granted.id).await;
            count_call(p.api, "upstream_error");
            upstream_key_refused(&p, resp)
                .await
                .respond(p.flavor, extra)
        }
        Attempt::Failed(resp) => {
            drop(lease);
            refund(&state, granted.id).await;
            count_call(p.api, "upstream_error");
            pass_on(resp, extra).await
        }
        Attempt::NoAnswer { why, sent } => {
            drop(lease);
            refund(&state, granted.id).await;
            count_call(p.api, "upstream_unreachable");
            let e = if sent {
                GatewayError::bad_gateway_final(why)
            } else {
                GatewayError::bad_gateway(why)
            };
            e.respond(p.flavor, extra)
        }
        Attempt::Refused(e) => {
            drop(lease);
            refund(&state, granted.id).await;
            count_call(p.api, "upstream_limited");
            // The caller's own rate-limit headers (taken with its hold, now
            // refunded) are not the limit that said no: the refusal carries
            // its own.
            let mut own = HeaderMap::new();
            if retried {
                insert(&mut own, "x-should-retry", "false");
            }
            e.respond(p.flavor, own)
        }
    }
}

/// The caller's reservation: answered at once (the SDK retries a 429
/// after its `retry-after`).
/// `count_denial`: false for a try on a bound, which a refusal does not end.
async fn reserve_tenant(
    state: &AppState,
    p: &Prepared,
    count_denial: bool,
) -> Result<(Granted, Durable), GatewayError> {
    match admit_decided(state, &p.tenant_req).await {
        Ok(Ok(g)) => Ok(g),
        Ok(Err(StoreError::Rejected(ReserveError::Denied(d)))) => {
            if count_denial {
                crate::metrics::denial(&d);
            }
            Err(GatewayError::denied(&d, state.now(), &p.catalog))
        }
        Ok(Err(StoreError::Rejected(ReserveError::Invalid(i)))) => {
            Err(GatewayError::invalid(Some(i.field), i.message))
        }
        Ok(Err(e)) => Err(GatewayError::unavailable(format!(
            "the ledger refused: {e}"
        ))),
        Err(_) => Err(GatewayError::unavailable(
            "the store did not answer in time",
        )),
    }
}

/// Upstream attempts until one answers for good: 429s wait the shared
/// backoff (the provider's stated time, exactly), 5xx and refused
/// connections a short per-call backoff; every attempt that reached the
/// provider is counted on `upstream:<name>`. Returns whether it retried.
async fn attempts(
    state: &AppState,
    p: &Prepared,
    mut first: Option<(Permit, ReservationId)>,
) -> (Attempt, bool) {
    let up = &p.upstream;
    let max_retries = up.settings.max_retries;
    let mut retries = 0u32;
    let mut waited = Duration::ZERO;
    let label = up.settings.name.clone();
    loop {
        let scheduled = match first.take() {
            Some((permit, id)) => Ok((permit, Some(id))),
            None => schedule(state, p).await,
        };
        let (permit, attempt_id) = match scheduled {
            Ok(x) => x,
            Err(e) => return (Attempt::Refused(e), retries > 0),
        };
        let sent = Instant::now();
        // The attempt's hold on the upstream lives as long as the provider
        // takes to answer, as the caller's does (its TTL would otherwise
        // free the upstream's bulkhead under a call still running).
        let in_flight = Lease(Vec::new()).and(state, p, attempt_id);
        let result = send(p).await;
        drop(in_flight);
        ::metrics::histogram!("allowance_gateway_upstream_seconds", "upstream" => label.clone())
            .record(sent.elapsed().as_secs_f64());
        let retry_in = match result {
            Ok(resp) if resp.status().is_success() => {
                return (Attempt::Answered(resp, attempt_id, permit), retries > 0);
            }
            Ok(resp) => {
                // The provider answered: it counted the attempt.
                settle_attempt(state, attempt_id, None).await;
                drop(permit);
                let status = resp.status();
                let wait = if status == reqwest::StatusCode::TOO_MANY_REQUESTS {
                    ::metrics::counter!("allowance_gateway_upstream_429_total", "upstream" => label.clone())
                        .increment(1);
                    let wait = up.on_429(resp.headers());
                    // A provider asking for longer than we would wait is
                    // answered as is: the client decides.
                    (wait <= BACKOFF_MAX).then_some(wait)
                } else if status.is_server_error() {
                    Some(jittered_backoff(retries))
                } else {
                    None
                };
                match wait {
                    Some(w) if retries < max_retries && waited + w <= MAX_RETRY_WAIT => w,
                    _ => return (Attempt::Failed(resp), retries > 0),
                }
            }
            Err(SendError::Http(e)) if e.is_connect() => {
                // Nothing reached the provider.
                if let Some(id) = attempt_id {
                    refund(state, id).await;
                }
                drop(permit);
                let w = jittered_backoff(retries);
                if retries < max_retries && waited + w <= MAX_RETRY_WAIT {
                    w
                } else {
                    return (
                        Attempt::NoAnswer {
                            why: format!("upstream {} is unreachable: {e}", up.settings.name),
                            sent: false,
                        },
                        retries > 0,
                    );
                }
            }
            Err(e) => {
                // Sent, then lost: the provider may have counted it, and
                // may have run it; not retried (no second generation).
                settle_attempt(state, attempt_id, None).await;
                let why = match e {
                    SendError::Http(e) if !e.is_timeout() => {
                        format!("upstream {} failed: {e}", up.settings.name)
                    }
                    _ => format!("upstream {} did not answer in time", up.settings.name),
                };
                return (Attempt::NoAnswer { why, sent: true }, retries > 0);
            }
        };
        retries += 1;
        waited += retry_in;
        ::metrics::counter!("allowance_gateway_retries_total", "upstream" => label.clone())
            .increment(1);
        // 429s are honoured through the shared backoff in `schedule`;
        // other failures wait here, for this call only.
        if up.backoff_until().is_none() {
            tokio::time::sleep(retry_in).await;
        }
    }
}

fn jittered_backoff(retries: u32) -> Duration {
    let d = SERVER_ERROR_BACKOFF.saturating_mul(1 << retries.min(6));
    d / 2 + (d / 2).mul_f64(rand::random::<f64>())
}

/// Waits for the upstream: its shared backoff, a place in its adaptive
/// gate, and room on `upstream:<name>` (through the admission queue,
/// fairly for the caller's tenant). Returns the attempt's reservation.
async fn schedule(
    state: &AppState,
    p: &Prepared,
) -> Result<(Permit, Option<ReservationId>), GatewayError> {
    let up = &p.upstream;
    let max_wait = Duration::from_millis(state.options().max_wait_ms);
    backoff(p, max_wait).await?;
    // The gate's wait counts against the call's as the ledger's does: a
    // call never waits longer than `max_wait_ms` for a place (it waited on,
    // holding its caller's reservation, for as long as the calls ahead ran).
    let gate_left = max_wait.saturating_sub(p.started.elapsed());
    let Ok(permit) = tokio::time::timeout(gate_left, up.acquire()).await else {
        return Err(GatewayError::upstream_busy(
            &up.settings.name,
            p.started.elapsed(),
        ));
    };
    let req = &p.attempt_req;
    let max_wait_ms = state.options().max_wait_ms;
    let left_ms = max_wait_ms.saturating_sub(p.started.elapsed().as_millis() as u64);
    // First without a wait: a refusal whose retry comes after the call may
    // wait anyway is answered at once (the client is told when to come
    // back), not after sitting out the whole wait.
    let mut admitted = admit(state, &p.catalog, req, 0, 0, Some(&p.tenant)).await;
    if let Ok(Err(StoreError::Rejected(ReserveError::Denied(d)))) = &admitted
        && left_ms > 0
        && d.kind == allowance_core::DenialKind::RateLimited
        && !wait_cannot_end_in(state, d, left_ms).await
    {
        admitted = admit(state, &p.catalog, req, left_ms, 0, Some(&p.tenant)).await;
    }
    let id = match admitted {
        Ok(Ok(g)) => g.id,
        Ok(Err(StoreError::Rejected(ReserveError::Denied(d)))) => {
            return Err(GatewayError::denied(&d, state.now(), &p.catalog));
        }
        Ok(Err(e)) => return Err(GatewayError::unavailable(format!("upstream scope: {e}"))),
        Err(_) => {
            return Err(GatewayError::unavailable(
                "the store did not answer in time",
            ));
        }
    };
    // A 429 may have come in while this call waited.
    if let Err(e) = backoff(p, max_wait).await {
        refund(state, id).await;
        return Err(e);
    }
    Ok((permit, Some(id)))
}

/// Whether a rate-limit denial cannot end within `left_ms`: its retry comes
/// later, and nothing held on the refusing scope could end sooner and give
/// room back (with holds, the ledger's retry is only their expiry, and a
/// refund may come first). Without holds, room comes back only as usage
/// leaves the window, at the ledger's retry, or later when others take it.
async fn wait_cannot_end_in(state: &AppState, d: &allowance_core::Denial, left_ms: u64) -> bool {
    if d.retry_after_ms.is_none_or(|ms| ms <= left_ms) {
        return false;
    }
    match state.call(state.store().status(&d.scope)).await {
        Ok(Ok(status)) => status.held_reservations == 0,
        _ => false,
    }
}

/// The provider's 401: the gateway's upstream key was refused (a 502 the
/// client does not retry, naming the upstream and its message).
async fn upstream_key_refused(p: &Prepared, resp: reqwest::Response) -> GatewayError {
    let body = tokio::time::timeout(UPSTREAM_TIMEOUT, resp.bytes())
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    let said = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .map(|m| format!(": {m}"))
        .unwrap_or_default();
    GatewayError::bad_gateway_final(format!(
        "upstream {} refused the gateway's upstream key (401{said}); your gateway key was accepted: tell the gateway's operator",
        p.upstream.settings.name
    ))
}

/// The first attempt's place upstream when it is free now: no backoff, a
/// free place in the gate, room on `upstream:<name>` at once. `None` sends
/// the call through [`schedule`], which waits.
async fn schedule_now(state: &AppState, p: &Prepared) -> Option<(Permit, ReservationId, Durable)> {
    let up = &p.upstream;
    if up.backoff_until().is_some() {
        return None;
    }
    let permit = up.try_acquire()?;
    match admit_decided(state, &p.attempt_req).await {
        Ok(Ok((g, durable))) => Some((permit, g.id, durable)),
        _ => None,
    }
}

/// [`admit`] without a wait, answered when the ledger has applied the
/// reserve: the caller awaits the [`Durable`] (with its siblings', see
/// [`durable_by`]).
pub(crate) async fn admit_decided(
    state: &AppState,
    req: &ReserveRequest,
) -> Result<Result<(Granted, Durable), StoreError<ReserveError>>, crate::error::ApiError> {
    if let Some(d) = crate::routes::queue_blocks(state, req) {
        return Ok(Err(Box::pin(crate::routes::held_up(state, req, d)).await?));
    }
    state.call(state.store().reserve_decided(req)).await
}

/// Waits, under the store timeout, until a decided change is durable
/// (`None`: nothing to wait for). Reserves made together are awaited
/// together (`tokio::join!` of these): on the durable store they then share
/// one group commit, where awaited one by one the second record could miss
/// the first's batch and queue a second fsync.
pub(crate) async fn durable_by(state: &AppState, d: Option<Durable>) -> Result<(), GatewayError> {
    let Some(d) = d else { return Ok(()) };
    match state.call(Box::pin(d.wait())).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(GatewayError::unavailable(format!(
            "the ledger's log failed: {e}"
        ))),
        Err(_) => Err(GatewayError::unavailable(
            "the store did not answer in time",
        )),
    }
}

/// Waits until the caller's hold and the first attempt's place upstream
/// are durable, together, before anything goes upstream. A hold that never
/// becomes durable answers as an unavailable store.
async fn made_durable(
    state: &AppState,
    granted: Result<(Granted, Durable), GatewayError>,
    first: Option<(Permit, ReservationId, Durable)>,
) -> (
    Result<Granted, GatewayError>,
    Option<(Permit, ReservationId)>,
) {
    let (first, attempt_durable) = match first {
        Some((permit, id, d)) => (Some((permit, id)), Some(d)),
        None => (None, None),
    };
    let (granted, tenant_durable) = match granted {
        Ok((g, d)) => (g, d),
        // Refused: the call ends here, and the attempt's place is refunded
        // (a refund is logged after the reserve it ends, so neither waits).
        Err(e) => return (Err(e), first),
    };
    let (tenant_ok, attempt_ok) = tokio::join!(
        durable_by(state, Some(tenant_durable)),
        durable_by(state, attempt_durable)
    );
    // Not durable: the store fenced itself and rebuilds from what is on
    // disk; a hold it still finds there expires with its TTL, never charged.
    let granted = tenant_ok.map(|()| granted);
    let first = if attempt_ok.is_ok() { first } else { None };
    (granted, first)
}

/// Honours the upstream's shared backoff: waits until it ends, or — when
/// it ends past what this call may wait — answers 429 at once with the
/// time left (the client retries then; nobody sits on a connection).
async fn backoff(p: &Prepared, max_wait: Duration) -> Result<(), GatewayError> {
    let Some(until) = p.upstream.backoff_until() else {
        return Ok(());
    };
    let deadline = p.started + max_wait;
    if until > deadline {
        let left = until.saturating_duration_since(Instant::now());
        return Err(GatewayError::upstream_backoff(
            &p.upstream.settings.name,
            left,
        ));
    }
    tokio::time::sleep_until(until).await;
    Ok(())
}

/// One request upstream.
async fn send(p: &Prepared) -> Result<reqwest::Response, SendError> {
    let up = &p.upstream;
    let url = format!("{}{}", up.settings.base_url, p.path);
    let mut rb = p
        .http
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(p.body.clone());
    for (name, value) in &p.passed {
        rb = rb.header(name.as_str(), value.as_bytes());
    }
    if let Some(key) = &up.api_key {
        rb = match p.flavor {
            Flavor::Anthropic => rb.header("x-api-key", key.as_str()),
            Flavor::OpenAi => rb.bearer_auth(key),
        };
    }
    if !p.estimate.stream {
        // The whole answer; a stream's body is bounded by its silences.
        rb = rb.timeout(UPSTREAM_TIMEOUT);
    }
    match tokio::time::timeout(UPSTREAM_TIMEOUT, rb.send()).await {
        Ok(r) => r.map_err(SendError::Http),
        Err(_) => Err(SendError::Timeout),
    }
}

/// Why a request got no answer.
enum SendError {
    Http(reqwest::Error),
    /// No answer's headers within [`UPSTREAM_TIMEOUT`].
    Timeout,
}

/// Renews reservations' leases every third of their TTL until dropped.
pub(crate) struct Lease(Vec<tokio::task::JoinHandle<()>>);

impl Lease {
    pub(crate) fn start(state: &AppState, p: &Prepared, id: ReservationId) -> Lease {
        Lease(Vec::new()).and(state, p, Some(id))
    }

    /// Renews `id`'s lease too (an upstream attempt's, held as long).
    pub(crate) fn and(
        mut self,
        state: &AppState,
        p: &Prepared,
        id: Option<ReservationId>,
    ) -> Lease {
        let Some(id) = id else { return self };
        let ttl_ms = p.catalog.settings().default_ttl_ms;
        let state = state.clone();
        self.0.push(tokio::spawn(async move {
            let every = Duration::from_millis((ttl_ms / 3).max(1));
            loop {
                tokio::time::sleep(every).await;
                let _ = state
                    .call(state.store().extend(id, None, Some(ttl_ms)))
                    .await;
            }
        }));
        self
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// A whole (non-stream) answer: read, settle from its usage, pass on.
async fn finish_whole(
    state: &AppState,
    p: &Prepared,
    tenant_id: ReservationId,
    resp: reqwest::Response,
    attempt_id: Option<ReservationId>,
    extra: HeaderMap,
) -> Response {
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = match tokio::time::timeout(UPSTREAM_TIMEOUT, resp.bytes()).await {
        Ok(Ok(b)) => b,
        _ => {
            // The provider ran the call but its answer was lost: it is
            // charged as reserved (never free), and the client told.
            settle_attempt(state, attempt_id, None).await;
            settle(state, p, tenant_id, &estimated_usage(p, p.output_reserved)).await;
            count_call(p.api, "upstream_broken");
            return GatewayError::bad_gateway_final("the upstream's answer broke off")
                .respond(p.flavor, extra);
        }
    };
    let usage = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| allowance_estimate::usage_from_response(p.api, &v));
    let usage = match usage {
        Some(u) => {
            observe_estimate(p, u.input_tokens);
            ledger_usage(u)
        }
        // No usage to read: charged as reserved, never free.
        None => estimated_usage(p, p.output_reserved),
    };
    settle_whole(state, tenant_id, attempt_id, &usage).await;
    count_call(p.api, "ok");
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::OK);
    copy_headers(&headers, r.headers_mut());
    r.headers_mut().extend(extra);
    r
}

/// An upstream's final error, passed on as it came.
async fn pass_on(resp: reqwest::Response, extra: HeaderMap) -> Response {
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = tokio::time::timeout(UPSTREAM_TIMEOUT, resp.bytes())
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    copy_headers(&headers, r.headers_mut());
    if status == reqwest::StatusCode::TOO_MANY_REQUESTS {
        // When to come back: the provider's word, passed on.
        for name in ["retry-after", "retry-after-ms"] {
            if let Some(v) = headers.get(name)
                && let Ok(v) = HeaderValue::from_bytes(v.as_bytes())
            {
                r.headers_mut().insert(name, v);
            }
        }
    }
    r.headers_mut().extend(extra);
    r
}

/// The provider's headers a client may see: not hop-by-hop ones, not its
/// own rate-limit state (that of the gateway's shared key; the client's is
/// the gateway's own headers).
pub(crate) fn copy_headers(from: &reqwest::header::HeaderMap, to: &mut HeaderMap) {
    for (name, value) in from {
        let n = name.as_str();
        let skip = matches!(
            n,
            "connection"
                | "keep-alive"
                | "transfer-encoding"
                | "content-length"
                | "te"
                | "trailer"
                | "upgrade"
                | "retry-after"
                | "retry-after-ms"
        ) || n.starts_with("x-ratelimit-")
            || n.starts_with("anthropic-ratelimit-");
        if skip {
            continue;
        }
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_str().as_bytes()),
            HeaderValue::from_bytes(value.as_bytes()),
        ) {
            to.append(n, v);
        }
    }
}

/// The ledger's usage of a provider's usage.
pub(crate) fn ledger_usage(u: allowance_estimate::Usage) -> Usage {
    Usage {
        amounts: Amounts::new()
            .with(Dimension::INPUT_TOKENS, u.input_tokens)
            .with(Dimension::OUTPUT_TOKENS, u.output_tokens),
        cached_input_tokens: u.cached_input_tokens,
        charges: Vec::new(),
    }
}

/// Usage the gateway counted itself: the estimated input and `output`.
pub(crate) fn estimated_usage(p: &Prepared, output: u64) -> Usage {
    Usage {
        amounts: Amounts::new()
            .with(Dimension::INPUT_TOKENS, p.estimate.input_tokens)
            .with(Dimension::OUTPUT_TOKENS, output),
        cached_input_tokens: 0,
        charges: Vec::new(),
    }
}

/// Records how far the input estimate was from the provider's count.
pub(crate) fn observe_estimate(p: &Prepared, actual_input: u64) {
    if p.estimate.input_tokens > 0 {
        let ratio = actual_input as f64 / p.estimate.input_tokens as f64;
        ::metrics::histogram!("allowance_gateway_input_estimate_ratio", "model" => model_label(p))
            .record(ratio);
    }
}

/// A model name as a metric label: configured names only (bounded).
fn model_label(p: &Prepared) -> String {
    if p.catalog.model(&p.model).is_some() || p.upstream.settings.models.contains(&p.model) {
        p.model.clone()
    } else {
        "other".to_string()
    }
}

/// Ends a reservation with `op` (a settle or a refund), retrying while the
/// store does not answer: what a call used must not be lost to a blip.
/// `Err(Some(why))` when the store refused it, `Err(None)` when it never
/// answered.
async fn end_with_retries<T, E: std::fmt::Display, F>(
    state: &AppState,
    op: impl Fn() -> F,
) -> Result<T, Option<String>>
where
    F: std::future::Future<Output = Result<T, StoreError<E>>> + Unpin,
{
    for delay_ms in [0u64, 50, 500, 2000] {
        pause(delay_ms).await;
        match state.call(op()).await {
            Ok(Ok(t)) => {
                state.queue().kick();
                return Ok(t);
            }
            Ok(Err(StoreError::Unavailable(_))) | Err(_) => continue,
            Ok(Err(e)) => return Err(Some(e.to_string())),
        }
    }
    Err(None)
}

/// Settles the caller's reservation.
pub(crate) async fn settle(state: &AppState, p: &Prepared, id: ReservationId, usage: &Usage) {
    match end_with_retries(state, || state.store().settle(id, usage)).await {
        Ok(_) => {}
        Err(Some(e)) => {
            tracing::warn!(reservation = %id, model = %p.model, error = %e, "gateway settle refused")
        }
        Err(None) => tracing::error!(
            reservation = %id, model = %p.model,
            "gateway settle failed: the store did not answer; the hold will expire and the usage is not recorded"
        ),
    }
}

/// Settles an attempt's reservation on `upstream:<name>`: its usage, or
/// the request alone when it brought none.
pub(crate) async fn settle_attempt(
    state: &AppState,
    id: Option<ReservationId>,
    usage: Option<&Usage>,
) {
    let Some(id) = id else { return };
    let none = Usage::default();
    let usage = usage.unwrap_or(&none);
    if end_with_retries(state, || state.store().settle(id, usage))
        .await
        .is_err()
    {
        tracing::warn!(reservation = %id, "gateway: an upstream attempt's settle failed; its hold will expire");
    }
}

/// A whole answer's settles, applied before it is passed on (the client's
/// next call sees them) and made durable after: an answer already paid
/// for upstream gains nothing from waiting for an fsync. When the log
/// fails instead, the store rebuilds from its data dir without them: they
/// are applied again (plain, durable settles: idempotent) once it serves,
/// or the answered call would never be charged.
pub(crate) async fn settle_whole(
    state: &AppState,
    tenant_id: ReservationId,
    attempt_id: Option<ReservationId>,
    usage: &Usage,
) {
    let (caller, attempt) = tokio::join!(
        settle_applied(state, tenant_id, usage, "the caller's"),
        async {
            match attempt_id {
                Some(id) => settle_applied(state, id, usage, "an upstream attempt's").await,
                None => None,
            }
        }
    );
    let durables: Vec<(ReservationId, Durable)> = caller
        .into_iter()
        .chain(attempt)
        .filter(|(_, d)| !d.is_now())
        .collect();
    if durables.is_empty() {
        return;
    }
    let state = state.clone();
    let usage = usage.clone();
    tokio::spawn(async move {
        let again = futures_util::future::join_all(durables.into_iter().map(|(id, d)| async move {
            let e = d.wait().await.err()?;
            tracing::warn!(reservation = %id, error = %e,
                "gateway settle not durable (the store's log failed after the answer was passed on): settling again");
            Some(id)
        }))
        .await;
        for id in again.into_iter().flatten() {
            if let Err(e) = end_with_retries(&state, || state.store().settle(id, &usage)).await {
                tracing::error!(reservation = %id, error = ?e,
                    "gateway settle lost with the store's log; the hold will expire and the usage is not recorded");
            }
        }
    });
}

/// Applies a settle (decided: later operations see it) and returns when it
/// will be durable; `None`, logged, when the store refused it or never
/// answered (`whose` names the reservation in the log).
async fn settle_applied(
    state: &AppState,
    id: ReservationId,
    usage: &Usage,
    whose: &'static str,
) -> Option<(ReservationId, Durable)> {
    match end_with_retries(state, || state.store().settle_decided(id, usage)).await {
        Ok((_, durable)) => Some((id, durable)),
        Err(e) => {
            tracing::error!(reservation = %id, error = ?e,
                "gateway: {whose} settle failed; the hold will expire and the usage is not recorded");
            None
        }
    }
}

/// Refunds a reservation (a failed call costs its caller nothing).
pub(crate) async fn refund(state: &AppState, id: ReservationId) {
    if end_with_retries(state, || state.store().refund(id))
        .await
        .is_err()
    {
        tracing::warn!(reservation = %id, "gateway refund failed; the hold will expire");
    }
}

/// Waits before a retry of a store call; the first try does not wait (a
/// zero sleep still waits for the timer's next 1 ms tick).
async fn pause(ms: u64) {
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refused reserve is counted by why: an outage is not a denial.
    #[test]
    fn a_refusal_counts_as_what_it_is() {
        assert_eq!(
            refusal_outcome(&GatewayError::unavailable("redis: timed out")),
            "unavailable"
        );
        assert_eq!(
            refusal_outcome(&GatewayError::invalid(None, "no price")),
            "invalid"
        );
        assert_eq!(
            refusal_outcome(&GatewayError::forbidden("another tenant")),
            "invalid"
        );
        let mut denied = GatewayError::invalid(None, "x");
        for status in [
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::PAYMENT_REQUIRED,
            StatusCode::UNPROCESSABLE_ENTITY,
        ] {
            denied.status = status;
            assert_eq!(refusal_outcome(&denied), "denied", "{status}");
        }
    }

    #[test]
    fn a_member_is_added_last_to_any_object() {
        let member = r#""stream_options":{"include_usage":true}"#;
        for (given, want) in [
            ("{}".to_owned(), format!("{{{member}}}")),
            (" { } \n".to_owned(), format!(" {{ {member}}} \n")),
            (r#"{"a":1}"#.to_owned(), format!(r#"{{"a":1,{member}}}"#)),
            (
                "{\"a\": {\"b\": \"}\"}\n}\r\n".to_owned(),
                format!("{{\"a\": {{\"b\": \"}}\"}}\n,{member}}}\r\n"),
            ),
        ] {
            let got = with_last_member(given.as_bytes(), INCLUDE_USAGE_MEMBER).unwrap();
            let got = std::str::from_utf8(&got).unwrap();
            assert_eq!(got, want, "{given:?}");
            // The JSON is the object plus the member.
            let mut expected: Value = serde_json::from_str(&given).unwrap();
            expected["stream_options"] = serde_json::json!({"include_usage": true});
            assert_eq!(serde_json::from_str::<Value>(got).unwrap(), expected);
        }
        for not_an_object in ["[]", "\"x\"", "", "  ", "}"] {
            assert!(
                with_last_member(not_an_object.as_bytes(), INCLUDE_USAGE_MEMBER).is_none(),
                "{not_an_object:?}"
            );
        }
    }
}
