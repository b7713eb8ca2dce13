//! The data plane: reserve, get, settle, refund, extend, scope status; and
//! the operations routes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use allowance_core::{
    Catalog, Charge, DenialKind, Dimension, Granted, Reservation, ReservationId, ReserveError,
    ReserveRequest, ScopeKey, StoreError, Unavailable, Usage,
};
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::auth::{Caller, Principal};
use crate::error::{ApiError, ErrorBody, IntoApiError};
use crate::extract::{JsonBody, OptionalJsonBody, PathText};
use crate::wire::{
    ExtendBody, RefundBody, ReservationView, ReserveBody, ScopeStatusView, SettleBody, amounts_of,
};
use crate::{AppState, metrics};

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/reservations", post(reserve))
        .route("/v1/reservations/{id}", get(get_reservation))
        .route("/v1/reservations/{id}/settle", post(settle))
        .route("/v1/reservations/{id}/refund", post(refund))
        .route("/v1/reservations/{id}/extend", post(extend))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/v1/usage", get(crate::usage::usage))
}

/// Outcome label of an error answer.
pub(crate) fn outcome_of(e: &ApiError) -> &'static str {
    match e.status().as_u16() {
        400 | 413 | 415 => "invalid",
        401 | 403 => "refused",
        404 => "not_found",
        409 => "conflict",
        429 | 402 | 422 => "denied",
        503 => "unavailable",
        _ => "error",
    }
}

/// Times a handler body and counts its outcome.
///
/// A combinator, not an `async fn`: an `async fn` would keep its argument
/// and the future it awaits as two copies of the handler's whole state, and
/// every request would copy both (the data-plane handlers return this
/// future directly for the same reason).
pub(crate) fn measured<F>(op: &'static str, f: F) -> impl Future<Output = Response>
where
    F: Future<Output = Result<(&'static str, Response), ApiError>>,
{
    let started = Instant::now();
    futures_util::FutureExt::map(f, move |result| {
        let (outcome, response) = match result {
            Ok(r) => r,
            Err(e) => (outcome_of(&e), e.into_response()),
        };
        metrics::operation(op, outcome, started.elapsed());
        response
    })
}

/// The answer of get, settle, refund and extend: the reservation object.
fn reservation_answer(r: &Reservation, catalog: &Catalog) -> Response {
    ReservationView::of(r, catalog).into_response()
}

/// `rsv_…` → id; anything else answers 404, as an unknown id does.
fn parse_id(id: &str) -> Result<ReservationId, ApiError> {
    ReservationId::parse(id).ok_or_else(|| ApiError::not_found("reservation not found"))
}

/// A reservation the caller may see, or 404 (another tenant's answers
/// exactly as a missing one).
async fn visible(
    state: &AppState,
    who: &Principal,
    id: ReservationId,
) -> Result<Option<Reservation>, ApiError> {
    let r = state.call(state.store().get(id)).await??;
    Ok(r.filter(|r| who.may_use(r.scopes.tenant_name())))
}

/// For a tenant token: 404 unless the reservation is its own. An admin
/// goes straight to the operation (one store call, not two).
async fn check_owner(state: &AppState, who: &Principal, id: ReservationId) -> Result<(), ApiError> {
    if matches!(who, Principal::Admin) {
        return Ok(());
    }
    match visible(state, who, id).await? {
        Some(_) => Ok(()),
        None => Err(ApiError::not_found("reservation not found")),
    }
}

/// Builds the engine's request from the body. Every check that names a
/// field happens here or in the engine, before anything changes.
fn reserve_request(
    body: ReserveBody,
    catalog: &Catalog,
    max_wait_ms: u64,
) -> Result<ReserveRequest, ApiError> {
    if let Some(w) = body.wait_ms
        && w.0 > max_wait_ms
    {
        return Err(ApiError::invalid(
            Some("wait_ms".into()),
            format!("at most {max_wait_ms} ms (queue.max_wait_ms)"),
        ));
    }
    let pairs: Vec<(&str, &str)> = body
        .scopes
        .0
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let scopes = catalog.scope_set(&body.tenant, &pairs)?;
    crate::wire::check_implied(&body.amounts, "amounts", true)?;
    let mut amounts = amounts_of(&body.amounts, catalog, "amounts")?;
    // A call that names no output bound holds the model's (SEMANTICS, the
    // model table) — unless the caller gave its own estimate of the tokens
    // or the cost, which the bound would only inflate. Only a key absent
    // from the body counts as naming none: `"output_tokens": 0` is a bound.
    if let Some(price) = body.model.as_deref().and_then(|m| catalog.model(m))
        && !body
            .amounts
            .0
            .iter()
            .any(|(name, _)| matches!(name.as_str(), "output_tokens" | "tokens" | "cost_micros"))
    {
        amounts.set(Dimension::OUTPUT_TOKENS, price.max_output_tokens);
    }
    let mut req = ReserveRequest::new(scopes, amounts);
    req.model = body.model.map(Arc::from);
    req.ttl_ms = body.ttl_ms.map(|t| t.0);
    req.idempotency_key = body.idempotency_key.map(Arc::from);
    req.dry_run = body.dry_run;
    req.labels = body.labels.map(|l| Arc::from(l.0));
    req.report_remaining = true;
    Ok(req)
}

/// Reserve: hold an estimate on every scope at once.
#[utoipa::path(post, path = "/v1/reservations", request_body = ReserveBody,
    responses(
        (status = 201, description = "Held", body = ReservationView),
        (status = 200, description = "An idempotent replay (`replayed: true`) or a dry run (`status: dry_run`)", body = ReservationView),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 402, description = "A total budget is exhausted", body = ErrorBody),
        (status = 409, description = "Idempotency key reused for another request", body = ErrorBody),
        (status = 422, description = "More than a limit's whole capacity", body = ErrorBody),
        (status = 429, description = "Rate limited: retry after", body = ErrorBody),
        (status = 503, description = "Store unavailable: outcome unknown", body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) fn reserve(
    State(state): State<AppState>,
    Caller(who): Caller,
    body: Result<JsonBody<ReserveBody>, ApiError>,
) -> impl Future<Output = Response> {
    measured("reserve", async move {
        let who = who?;
        let JsonBody(body) = body?;
        if !who.may_use(&body.tenant) {
            return Err(ApiError::forbidden(format!(
                "this token may not reserve for tenant {:?}",
                body.tenant
            )));
        }
        let catalog = state.catalog().await?;
        // A dry run answers at once (HTTP-API.md: it ignores wait_ms).
        let wait_ms = match body.wait_ms {
            Some(w) if !body.dry_run => w.0,
            _ => 0,
        };
        let priority = body.priority.unwrap_or(0);
        let req = reserve_request(body, &catalog, state.options().max_wait_ms)?;
        let granted = match admit(&state, &catalog, &req, wait_ms, priority, None).await? {
            Ok(g) => g,
            Err(e) => {
                if let StoreError::Rejected(ReserveError::Denied(d)) = &e {
                    metrics::denial(d);
                }
                return Err(e.into_api(state.now(), &catalog));
            }
        };
        if granted.replayed {
            // The stored reservation is the answer (it may have ended since).
            let stored = state.call(state.store().get(granted.id)).await??;
            let mut view = match &stored {
                Some(r) => ReservationView::of(r, &catalog),
                None => ReservationView::granted(&granted, &req, &catalog),
            };
            view.replayed = Some(true);
            view.remaining = None;
            return Ok(("replayed", view.into_response()));
        }
        let view = ReservationView::granted(&granted, &req, &catalog);
        let (outcome, status) = if granted.dry_run {
            ("dry_run", StatusCode::OK)
        } else {
            ("ok", StatusCode::CREATED)
        };
        let mut answer = view.into_response();
        *answer.status_mut() = status;
        crate::headers::add_success_headers(
            answer.headers_mut(),
            &granted.remaining,
            state.now(),
            &catalog,
        );
        Ok((outcome, answer))
    })
}

/// A reservation, expiry observed.
#[utoipa::path(get, path = "/v1/reservations/{id}",
    params(("id" = String, Path, description = "rsv_ + 32 hex digits")),
    responses(
        (status = 200, body = ReservationView),
        (status = 404, body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) fn get_reservation(
    State(state): State<AppState>,
    Caller(who): Caller,
    PathText(id): PathText,
) -> impl Future<Output = Response> {
    measured("get", async move {
        let who = who?;
        let id = parse_id(&id)?;
        let Some(r) = visible(&state, &who, id).await? else {
            return Err(ApiError::not_found("reservation not found"));
        };
        let catalog = state.catalog().await?;
        state.queue().kick();
        Ok(("ok", reservation_answer(&r, &catalog)))
    })
}

fn usage_of(body: SettleBody, catalog: &Catalog) -> Result<Usage, ApiError> {
    let mut usage = Usage::default();
    let mut rest = crate::wire::Ordered::default();
    for (name, n) in body.usage.0 {
        if name == "cached_input_tokens" {
            usage.cached_input_tokens = n.0;
        } else {
            rest.0.push((name, n));
        }
    }
    crate::wire::check_implied(&rest, "usage", true)?;
    usage.amounts = amounts_of(&rest, catalog, "usage")?;
    for (i, c) in body.charges.into_iter().enumerate() {
        usage.charges.push(Charge {
            amounts: amounts_of(&c.amounts, catalog, &format!("charges[{i}].amounts"))?,
            name: c.name,
            cost_micros: c.cost_micros.0,
        });
    }
    Ok(usage)
}

/// Settle: record the actual and release the hold; idempotent.
#[utoipa::path(post, path = "/v1/reservations/{id}/settle", request_body = SettleBody,
    params(("id" = String, Path, description = "rsv_ + 32 hex digits")),
    responses(
        (status = 200, description = "Settled (a repeat answers the same)", body = ReservationView),
        (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, description = "The reservation was refunded", body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) fn settle(
    State(state): State<AppState>,
    Caller(who): Caller,
    PathText(id): PathText,
    body: Result<JsonBody<SettleBody>, ApiError>,
) -> impl Future<Output = Response> {
    measured("settle", async move {
        let who = who?;
        let JsonBody(body) = body?;
        let id = parse_id(&id)?;
        let catalog = state.catalog().await?;
        let usage = usage_of(body, &catalog)?;
        check_owner(&state, &who, id).await?;
        let r = state
            .call(state.store().settle(id, &usage))
            .await?
            .map_err(|e| e.into_api(state.now(), &catalog))?;
        state.queue().kick();
        Ok(("ok", reservation_answer(&r, &catalog)))
    })
}

/// Refund: release the hold, record nothing; idempotent.
#[utoipa::path(post, path = "/v1/reservations/{id}/refund", request_body(content = RefundBody, description = "No body, or {}"),
    params(("id" = String, Path, description = "rsv_ + 32 hex digits")),
    responses(
        (status = 200, description = "Refunded (or expired: nothing to release)", body = ReservationView),
        (status = 404, body = ErrorBody),
        (status = 409, description = "The reservation was settled", body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) fn refund(
    State(state): State<AppState>,
    Caller(who): Caller,
    PathText(id): PathText,
    body: Result<OptionalJsonBody<RefundBody>, ApiError>,
) -> impl Future<Output = Response> {
    measured("refund", async move {
        let who = who?;
        let OptionalJsonBody(RefundBody {}) = body?;
        let id = parse_id(&id)?;
        check_owner(&state, &who, id).await?;
        let catalog = state.catalog().await?;
        let r = state
            .call(state.store().refund(id))
            .await?
            .map_err(|e| e.into_api(state.now(), &catalog))?;
        state.queue().kick();
        Ok(("ok", reservation_answer(&r, &catalog)))
    })
}

/// Extend: raise the hold and/or push the expiry out.
#[utoipa::path(post, path = "/v1/reservations/{id}/extend", request_body = ExtendBody,
    params(("id" = String, Path, description = "rsv_ + 32 hex digits")),
    responses(
        (status = 200, body = ReservationView),
        (status = 400, body = ErrorBody),
        (status = 402, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, description = "No longer held", body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 429, body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) fn extend(
    State(state): State<AppState>,
    Caller(who): Caller,
    PathText(id): PathText,
    body: Result<JsonBody<ExtendBody>, ApiError>,
) -> impl Future<Output = Response> {
    measured("extend", async move {
        let who = who?;
        let JsonBody(body) = body?;
        if body.amounts.is_none() && body.ttl_ms.is_none() {
            return Err(ApiError::invalid(
                Some("amounts".into()),
                "give amounts, ttl_ms or both",
            ));
        }
        let id = parse_id(&id)?;
        let catalog = state.catalog().await?;
        let amounts = match &body.amounts {
            Some(a) => {
                crate::wire::check_implied(a, "amounts", false)?;
                Some(amounts_of(a, &catalog, "amounts")?)
            }
            None => None,
        };
        check_owner(&state, &who, id).await?;
        let result = state
            .call(
                state
                    .store()
                    .extend(id, amounts.as_ref(), body.ttl_ms.map(|t| t.0)),
            )
            .await?;
        let r = match result {
            Ok(r) => r,
            Err(e) => {
                if let StoreError::Rejected(allowance_core::ExtendError::Denied(d)) = &e {
                    metrics::denial(d);
                }
                return Err(e.into_api(state.now(), &catalog));
            }
        };
        state.queue().kick();
        Ok(("ok", reservation_answer(&r, &catalog)))
    })
}

/// Parses a scope from a path (raw or percent-encoded: axum decodes it),
/// checks its kind is configured, and hides other tenants' scopes from a
/// tenant token (404). A tenant token may read shared scopes.
pub(crate) fn scope_for(
    catalog: &Catalog,
    who: &Principal,
    raw: &str,
    for_write: bool,
) -> Result<ScopeKey, ApiError> {
    let key = ScopeKey::parse(raw).map_err(|mut i| {
        i.field = "scope".into();
        ApiError::from(i)
    })?;
    catalog.check_scope(&key).map_err(|mut i| {
        i.field = "scope".into();
        ApiError::from(i)
    })?;
    let visible = match (who, key.tenant_name()) {
        (Principal::Admin, _) => true,
        (Principal::Tenant(t), Some(owner)) => t == owner,
        (Principal::Tenant(_), None) => !for_write,
    };
    if !visible {
        return Err(ApiError::not_found("scope not found"));
    }
    Ok(key)
}

/// A scope's limits with use, holds and room.
#[utoipa::path(get, path = "/v1/scopes/{scope}",
    params(("scope" = String, Path, description = "Canonical scope name, e.g. tenant:acme/user:bob (raw or percent-encoded)")),
    responses(
        (status = 200, body = ScopeStatusView),
        (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn scope_status(state: AppState, headers: HeaderMap, raw: String) -> Response {
    measured("status", async {
        let who = state.credentials().authenticate(&headers)?;
        let catalog = state.catalog().await?;
        let key = scope_for(&catalog, &who, &raw, false)?;
        let s = state.call(state.store().status(&key)).await??;
        Ok(("ok", axum::Json(ScopeStatusView::of(&s)).into_response()))
    })
    .await
}

/// The process is up.
#[utoipa::path(get, path = "/healthz", responses((status = 200, description = "ok")))]
pub(crate) async fn healthz() -> &'static str {
    "ok\n"
}

/// The store answers.
#[utoipa::path(get, path = "/readyz", responses((status = 200, description = "ready"), (status = 503, body = ErrorBody)))]
pub(crate) async fn readyz(State(state): State<AppState>) -> Response {
    crate::respond(
        async {
            // A read that reaches the store itself (a Redis store answers
            // its catalog from memory, so that would say nothing).
            let probe = ScopeKey::tenant("~readyz").map_err(ApiError::from)?;
            let answer = state.call(state.store().status(&probe)).await;
            if !matches!(answer, Ok(Ok(_))) {
                metrics::store_error("ready");
            }
            answer??;
            Ok::<_, ApiError>("ready\n")
        }
        .await,
    )
}

/// Prometheus text format.
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus text exposition", content_type = "text/plain")))]
pub(crate) async fn metrics_text(State(state): State<AppState>) -> Response {
    match state.call(state.store().stats()).await {
        Ok(Ok(s)) => metrics::store_stats(s),
        _ => metrics::store_error("stats"),
    }
    if let Some(f) = state.store().fail_open_stats() {
        metrics::fail_open(f);
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics().render(),
    )
        .into_response()
}

/// The denial of a waiter the queue holds for one of a reserve's scopes,
/// which comes first (see [`held_up`] for the answer). A request with an
/// idempotency key goes to the store first: a retry must get its replay,
/// even while waiters hold the scope (a new keyed reservation may then take
/// room ahead of them: the one exception). A dry run is held up as the
/// reserve it mimics would be.
pub(crate) fn queue_blocks(
    state: &AppState,
    req: &ReserveRequest,
) -> Option<Box<allowance_core::Denial>> {
    if req.idempotency_key.is_some() {
        None
    } else {
        state.queue().blocking(req)
    }
}

/// The answer of a reserve held up by a waiter (`waiter`: its denial): the
/// request's own denial if it has one — a hard stop (`exceeds_limit`,
/// `budget_exhausted`) outranks the wait, and its own rate limit is more
/// precise — found by a dry run; else the waiter's, with this request's
/// `requested` and the limit's `remaining` as of now. Never a grant.
pub(crate) async fn held_up(
    state: &AppState,
    req: &ReserveRequest,
    mut waiter: Box<allowance_core::Denial>,
) -> Result<StoreError<ReserveError>, ApiError> {
    let mut dry = req.clone();
    dry.dry_run = true;
    let would = match state.call(state.store().reserve(&dry)).await? {
        Ok(g) => g,
        Err(e) => return Ok(e),
    };
    let catalog = state.catalog().await?;
    if let Some(dim) = catalog.dimension(&waiter.dimension) {
        waiter.requested = would.held.get(dim);
        if let Some(r) = would.remaining.iter().find(|r| {
            r.scope == waiter.scope && r.dimension == waiter.dimension && r.window == waiter.window
        }) {
            // A dry run reports the room after this request.
            waiter.remaining = r.remaining.saturating_add_unsigned(waiter.requested);
        }
    }
    Ok(StoreError::Rejected(ReserveError::Denied(waiter)))
}

/// A reserve through the admission queue: at once when no waiter is
/// blocked on its scopes (else refused with that waiter's denial, so it
/// never takes room a waiter could use); refused for a retryable reason
/// with `wait_ms > 0`, it waits for room (see `queue.rs`).
///
/// `fair_for` queues the waiter as another tenant's for fairness (the
/// gateway waits on an upstream's scope on behalf of its caller).
pub(crate) async fn admit(
    state: &AppState,
    catalog: &Catalog,
    req: &ReserveRequest,
    wait_ms: u64,
    priority: i32,
    fair_for: Option<&str>,
) -> Result<Result<Granted, StoreError<ReserveError>>, ApiError> {
    if state.queue().is_waiting(req) {
        return Err(duplicate_of_a_waiter());
    }
    let first = match queue_blocks(state, req) {
        // Boxed: a rare path, kept out of every reserve's future.
        Some(d) => Err(Box::pin(held_up(state, req, d)).await?),
        None => state.call(state.store().reserve(req)).await?,
    };
    let denial = match first {
        Err(StoreError::Rejected(ReserveError::Denied(d)))
            if wait_ms > 0 && d.kind == DenialKind::RateLimited =>
        {
            d
        }
        other => return Ok(other),
    };
    // Boxed: only a waiting request pays for the queue's state, and every
    // other reserve's future stays small (it is moved as a whole).
    Box::pin(wait_for_room(
        state, catalog, req, wait_ms, priority, fair_for, denial,
    ))
    .await
}

/// 409 for a reserve whose idempotency key a waiter in the queue has
/// (SEMANTICS 15): its outcome is the first one's, still undecided.
fn duplicate_of_a_waiter() -> ApiError {
    ApiError::conflict(
        "a reserve with this idempotency key is waiting in the admission queue; retry it once that one is answered",
        None,
    )
}

/// [`admit`]'s wait in the queue, for a reserve refused as rate limited
/// (`denial`) that may wait `wait_ms`.
async fn wait_for_room(
    state: &AppState,
    catalog: &Catalog,
    req: &ReserveRequest,
    wait_ms: u64,
    priority: i32,
    fair_for: Option<&str>,
    denial: Box<allowance_core::Denial>,
) -> Result<Result<Granted, StoreError<ReserveError>>, ApiError> {
    let queue = state.queue().clone();
    let (fair_tenant, weight) = match fair_for.map(ScopeKey::tenant) {
        Some(Ok(t)) => (
            Some(Arc::from(t.tenant_name().unwrap_or_default())),
            catalog.plan_for(&t).queue_weight(),
        ),
        _ => (None, catalog.plan_for(req.scopes.tenant()).queue_weight()),
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let started = tokio::time::Instant::now();
    let ticket = match queue.push(
        Arc::new(req.clone()),
        fair_tenant,
        weight,
        priority,
        denial,
        tx,
    ) {
        Ok(t) => t,
        Err(crate::queue::NotQueued::Full(d)) => {
            ::metrics::counter!("allowance_queue_full_total").increment(1);
            // A denial like any other on the dashboards (its handler counts
            // the denials the store gives, and this one is the queue's).
            metrics::denial(&d);
            return Err(ApiError::denied(&d, state.now(), catalog).queue_full());
        }
        Err(crate::queue::NotQueued::Duplicate) => return Err(duplicate_of_a_waiter()),
    };
    // Leaves the queue if this request is dropped (the client went away).
    let mut leave = Leave {
        queue: queue.clone(),
        ticket: Some(ticket),
        rx: Some(rx),
        state: state.clone(),
    };
    queue.ensure_dispatcher(state.clone());
    queue.kick();
    let deadline = started + Duration::from_millis(wait_ms);
    let outcome = {
        let rx = leave.rx.as_mut().expect("armed");
        tokio::select! {
            r = &mut *rx => r.ok(),
            _ = tokio::time::sleep_until(deadline) => match queue.remove(ticket) {
                Some(d) => {
                    ::metrics::counter!("allowance_queue_timeouts_total").increment(1);
                    let d = denial_now(state, req).await.unwrap_or(d);
                    Some(Err(StoreError::Rejected(ReserveError::Denied(d))))
                }
                // Admitted in the same instant: the grant is on its way.
                None => rx.await.ok(),
            },
        }
    };
    leave.disarm();
    ::metrics::histogram!("allowance_queue_wait_seconds").record(started.elapsed().as_secs_f64());
    Ok(outcome.unwrap_or_else(|| {
        Err(StoreError::Unavailable(Unavailable(
            "the admission queue stopped".into(),
        )))
    }))
}

/// The denial a reserve gets now, by a dry run: a waiter whose `wait_ms`
/// ran out is told the room there is now (its last denial's `remaining`
/// may be seconds old: a bucket refilled meanwhile). `None` if the dry run
/// would pass (the waiter's last denial then stands) or the store failed.
async fn denial_now(state: &AppState, req: &ReserveRequest) -> Option<Box<allowance_core::Denial>> {
    let mut dry = req.clone();
    dry.dry_run = true;
    dry.idempotency_key = None;
    match state.call(state.store().reserve(&dry)).await {
        Ok(Err(StoreError::Rejected(ReserveError::Denied(d)))) => Some(d),
        _ => None,
    }
}

/// Takes a waiter out of the queue when its request is dropped.
struct Leave {
    queue: Arc<crate::AdmissionQueue>,
    ticket: Option<crate::queue::Ticket>,
    rx: Option<tokio::sync::oneshot::Receiver<crate::queue::Outcome>>,
    state: AppState,
}

impl Leave {
    fn disarm(mut self) {
        self.ticket = None;
    }
}

impl Drop for Leave {
    fn drop(&mut self) {
        if let Some(t) = self.ticket.take()
            && self.queue.remove(t).is_none()
            && let Some(mut rx) = self.rx.take()
        {
            // The dispatcher took it: a grant sent before this close is
            // here to refund; one sent after fails and the dispatcher
            // refunds it.
            rx.close();
            if let Ok(Ok(granted)) = rx.try_recv() {
                let state = self.state.clone();
                tokio::spawn(async move {
                    let _ = state.call(state.store().refund(granted.id)).await;
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use allowance_core::{EmbeddedStore, ManualClock, SeededIds, Timestamp};

    /// Every request moves its handler's future whole (into axum's box and
    /// through the layers), so a data-plane handler's future must stay
    /// small: an `async fn` wrapper or a rare path's state inline (the
    /// queue's wait, a replay's read) once made the reserve's 2.7 KiB.
    #[tokio::test]
    async fn data_plane_handler_futures_stay_small() {
        let clock = Arc::new(ManualClock::new(Timestamp::from_millis(1_700_000_000_000)));
        let store = Arc::new(EmbeddedStore::new(
            allowance_config::starter().catalog.clone(),
            4,
            clock.clone(),
            Arc::new(SeededIds::new(7)),
        ));
        let state = AppState::with_clock(
            store,
            crate::Credentials::default(),
            crate::Options::default(),
            clock,
        );
        let admin = || Caller(Ok(Principal::Admin));
        let id = || PathText(String::from("rsv_00000000000000000000000000000001"));
        let body: ReserveBody =
            serde_json::from_str(r#"{"tenant": "a", "amounts": {"tokens": 1}}"#).unwrap();
        let sizes = [
            (
                "reserve",
                size_of_val(&reserve(State(state.clone()), admin(), Ok(JsonBody(body)))),
                1024,
            ),
            (
                "get",
                size_of_val(&get_reservation(State(state.clone()), admin(), id())),
                512,
            ),
            (
                "settle",
                size_of_val(&settle(
                    State(state.clone()),
                    admin(),
                    id(),
                    Ok(JsonBody(serde_json::from_str(r#"{"usage": {}}"#).unwrap())),
                )),
                512,
            ),
            (
                "refund",
                size_of_val(&refund(
                    State(state.clone()),
                    admin(),
                    id(),
                    Ok(OptionalJsonBody(RefundBody {})),
                )),
                512,
            ),
            (
                "extend",
                size_of_val(&extend(
                    State(state.clone()),
                    admin(),
                    id(),
                    Ok(JsonBody(serde_json::from_str(r#"{"ttl_ms": 5}"#).unwrap())),
                )),
                512,
            ),
        ];
        for (name, size, most) in sizes {
            eprintln!("{name}: {size} bytes");
            assert!(
                size <= most,
                "the {name} handler's future is {size} bytes (at most {most})"
            );
        }
    }
}
