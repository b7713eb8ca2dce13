//! The OpenAI- and Anthropic-compatible gateway (HTTP-API.md "Gateway").
//!
//! A client points its SDK's base URL here. Each call is authenticated by
//! a gateway key (its tenant, user, agent), estimated with the model's
//! tokenizer ([`allowance_estimate`]), reserved on the caller's scopes,
//! scheduled against the upstream's own limits (its shared scope
//! `upstream:<name>`, through the admission queue, fairly across tenants),
//! forwarded, and settled from the upstream's usage — or refunded when the
//! upstream fails. Streams pass through event by event, their hold topped
//! up tranche by tranche as output flows.
//!
//! Two reservations per call, on purpose: the caller's (refunded when the
//! call fails: a failed call costs the caller nothing) and one per
//! upstream *attempt* on `upstream:<name>`, held by the internal tenant
//! [`allowance_config::GATEWAY_TENANT`] and always settled when the
//! provider answered (it counted the attempt against its own limits).

// Errors end a call before or after the upstream, never in a loop: their
// size does not matter, and boxing them would only add an allocation.
#![allow(clippy::result_large_err)]

mod answer;
mod background;
mod call;
mod sse;
mod stream;
mod upstream;

use std::collections::HashMap;
use std::sync::Arc;

use allowance_config::{GatewayKey, GatewaySettings};
use allowance_estimate::Api;
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::{get, post};

use crate::AppState;
pub(crate) use answer::{Flavor, GatewayError};
use upstream::Upstream;

/// The gateway's configuration, resolved at start-up: upstreams with their
/// keys read from the environment, routes by model, client keys.
pub struct Gateway {
    tranche_tokens: u64,
    max_body_bytes: usize,
    upstreams: Vec<Arc<Upstream>>,
    routes: HashMap<String, usize>,
    wildcard: Option<usize>,
    keys: Vec<GatewayKey>,
    http: reqwest::Client,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("upstreams", &self.upstreams.len())
            .field("keys", &self.keys.len())
            .finish_non_exhaustive()
    }
}

/// The upstreams whose `api_key_env` names a variable `env` does not have
/// (or has empty), as `key … : …` messages, in order: what
/// [`Gateway::new`] refuses, for `serve` to refuse before anything starts
/// and `check-config` to warn of.
pub fn unset_api_keys(
    settings: &GatewaySettings,
    env: impl Fn(&str) -> Option<String>,
) -> Vec<String> {
    settings
        .upstreams
        .iter()
        .enumerate()
        .filter_map(|(i, u)| {
            let var = u.api_key_env.as_ref()?;
            env(var).filter(|k| !k.is_empty()).is_none().then(|| {
                format!(
                    "key `gateway.upstreams[{i}].api_key_env`: the environment variable {var} (upstream {:?}) is not set",
                    u.name
                )
            })
        })
        .collect()
}

impl Gateway {
    /// Resolves `[gateway]`, reading each upstream's `api_key_env` from the
    /// environment. A named variable that is not set is an error: calls
    /// would fail upstream one by one instead of at start-up.
    pub fn new(settings: &GatewaySettings) -> Result<Gateway, String> {
        Self::with_env(settings, |name| std::env::var(name).ok())
    }

    /// [`Gateway::new`] with the environment given (tests).
    pub fn with_env(
        settings: &GatewaySettings,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Gateway, String> {
        if let Some(unset) = unset_api_keys(settings, &env).into_iter().next() {
            return Err(unset);
        }
        let mut upstreams = Vec::new();
        let mut routes = HashMap::new();
        let mut wildcard = None;
        for (i, u) in settings.upstreams.iter().enumerate() {
            let api_key = u.api_key_env.as_deref().and_then(&env);
            for m in &u.models {
                if m == "*" {
                    wildcard = Some(i);
                } else {
                    routes.insert(m.clone(), i);
                }
            }
            upstreams.push(Arc::new(Upstream::new(u.clone(), api_key)));
        }
        // Loading a tokenizer takes ~150 ms: at start, not in a first call.
        allowance_estimate::Tokenizer::O200kBase.warm_up();
        allowance_estimate::Tokenizer::Cl100kBase.warm_up();
        background::start();
        let http = reqwest::Client::builder()
            .connect_timeout(call::CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .pool_max_idle_per_host(1024)
            .build()
            .map_err(|e| format!("cannot build the upstream HTTP client: {e}"))?;
        Ok(Gateway {
            tranche_tokens: settings.stream_tranche_tokens,
            max_body_bytes: settings.max_body_bytes,
            upstreams,
            routes,
            wildcard,
            keys: settings.keys.clone(),
            http,
        })
    }

    /// The upstream a model is routed to.
    fn route(&self, model: &str) -> Option<&Arc<Upstream>> {
        self.routes
            .get(model)
            .or(self.wildcard.as_ref())
            .map(|&i| &self.upstreams[i])
    }

    /// The key a call presents (`Authorization: Bearer`, or Anthropic's
    /// `x-api-key`), compared in constant time against every hash.
    fn authenticate(&self, headers: &HeaderMap) -> Result<&GatewayKey, GatewayError> {
        let bearer = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(crate::auth::bearer);
        let key = bearer
            .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
            .filter(|k| !k.is_empty())
            .ok_or_else(|| {
                GatewayError::unauthorized(
                    "missing gateway key: send Authorization: Bearer <key> (or x-api-key)",
                )
            })?;
        crate::auth::matching(&self.keys, |k| &k.sha256, key)
            .ok_or_else(|| GatewayError::unauthorized("unknown gateway key"))
    }

    /// The models routed by name, for `GET /v1/models`.
    fn model_list(&self) -> Vec<(&str, &str)> {
        let mut out: Vec<(&str, &str)> = self
            .routes
            .iter()
            .map(|(m, &i)| (m.as_str(), self.upstreams[i].settings.name.as_str()))
            .collect();
        out.sort_unstable();
        out
    }
}

/// The gateway's routes (merged by [`crate::app`] when `[gateway]` is set).
pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/responses", post(responses))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/messages", post(messages))
        .route("/v1/models", get(models))
        .method_not_allowed_fallback(wrong_method)
}

/// A wrong method on a gateway route: 405 in the provider's shape (the
/// Anthropic one on `/v1/messages`).
async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let path = uri.path();
    let (flavor, allow) = match path {
        "/v1/messages" => (Flavor::Anthropic, "POST"),
        "/v1/models" => (Flavor::OpenAi, "GET"),
        _ => (Flavor::OpenAi, "POST"),
    };
    GatewayError::method_not_allowed(method.as_str(), path, allow).respond(flavor, HeaderMap::new())
}

async fn chat(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    call::handle(state, Api::ChatCompletions, headers, body).await
}

async fn responses(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    call::handle(state, Api::Responses, headers, body).await
}

async fn embeddings(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    call::handle(state, Api::Embeddings, headers, body).await
}

async fn messages(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    call::handle(state, Api::AnthropicMessages, headers, body).await
}

/// `GET /v1/models`: the models the gateway routes, in OpenAI's list shape.
async fn models(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let Some(gw) = state.gateway() else {
        return GatewayError::unavailable("no gateway").respond(Flavor::OpenAi, HeaderMap::new());
    };
    if let Err(e) = gw.authenticate(&headers) {
        return e.respond(Flavor::OpenAi, HeaderMap::new());
    }
    let data: Vec<serde_json::Value> = gw
        .model_list()
        .into_iter()
        .map(|(id, owner)| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": owner}))
        .collect();
    axum::response::IntoResponse::into_response(axum::Json(
        serde_json::json!({"object": "list", "data": data}),
    ))
}
