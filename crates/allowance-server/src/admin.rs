//! The admin plane: plans, per-scope overrides, adjustments; and the scope
//! routes (whose paths carry a `/` inside the scope name).

use std::sync::Arc;

use allowance_config::{LimitSpec, PlanSpec, plan_from_spec, plan_to_spec};
use allowance_core::{Catalog, CatalogChange, Override, Plan};
use axum::Router;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use serde::Serialize;
use utoipa::ToSchema;

use crate::AppState;
use crate::error::{ApiError, ErrorBody, IntoApiError};
use crate::extract::{JsonBody, PathText};
use crate::routes::{measured, scope_for};
use crate::wire::{AdjustBody, MAX_REASON_BYTES, ScopeOverrideBody, ScopeStatusView};

pub(crate) fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/plans", get(list_plans))
        .route("/v1/plans/{name}", put(put_plan).delete(delete_plan))
        .route(
            "/v1/scopes/{*rest}",
            get(scope_get)
                .put(scope_put)
                .delete(scope_delete)
                .post(scope_post),
        )
}

/// A plan with its name.
#[derive(Debug, Serialize, ToSchema)]
pub struct PlanView {
    /// The plan's name.
    pub name: String,
    /// Its limits and policies.
    #[serde(flatten)]
    pub spec: PlanSpec,
}

/// `GET /v1/plans`.
#[derive(Debug, Serialize, ToSchema)]
pub struct PlansView {
    /// Every plan, by name.
    pub plans: Vec<PlanView>,
}

fn plan_view(plan: &Plan, catalog: &Catalog) -> PlanView {
    PlanView {
        name: plan.name().to_string(),
        spec: plan_to_spec(plan, catalog),
    }
}

/// Every plan.
#[utoipa::path(get, path = "/v1/plans",
    responses((status = 200, body = PlansView), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn list_plans(State(state): State<AppState>, headers: HeaderMap) -> Response {
    measured("admin", async {
        state
            .credentials()
            .authenticate(&headers)?
            .require_admin()?;
        let catalog = state.catalog().await?;
        let mut plans: Vec<PlanView> = catalog.plans().map(|p| plan_view(p, &catalog)).collect();
        plans.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(("ok", axum::Json(PlansView { plans }).into_response()))
    })
    .await
}

/// Custom dimensions a list of limits names that the catalog lacks, in
/// first-use order.
fn new_dimensions(limits: &[LimitSpec], catalog: &Catalog) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for l in limits {
        if catalog.dimension(&l.dimension).is_none() && !out.contains(&l.dimension) {
            out.push(l.dimension.clone());
        }
    }
    out
}

/// Validates `build` against a copy of the catalog (a refusal changes
/// nothing), registers the custom dimensions it needs, then builds it again
/// against the catalog in force and applies the change. Callers hold the
/// admin lock, so nothing interleaves between the two steps.
async fn apply_with_dimensions<T>(
    state: &AppState,
    limits: &[LimitSpec],
    build: impl Fn(&mut Catalog) -> Result<T, allowance_core::Invalid>,
    change: impl Fn(T) -> CatalogChange,
) -> Result<T, ApiError>
where
    T: Clone,
{
    let catalog = state.catalog().await?;
    let mut scratch = (*catalog).clone();
    build(&mut scratch)?;
    for name in new_dimensions(limits, &catalog) {
        apply_change(state, &CatalogChange::AddDimension(name), &catalog).await?;
    }
    let fresh = state.catalog().await?;
    let mut copy = (*fresh).clone();
    let built = build(&mut copy)?;
    apply_change(state, &change(built.clone()), &fresh).await?;
    Ok(built)
}

/// Applies an admin change through the store; a refusal is answered as
/// the API answers it (`catalog`: the one the change was built against).
async fn apply_change(
    state: &AppState,
    change: &CatalogChange,
    catalog: &Catalog,
) -> Result<(), ApiError> {
    state
        .call(state.store().change_catalog(change))
        .await?
        .map_err(|e| e.into_api(state.now(), catalog))
}

/// A plan name in a path: `[A-Za-z0-9._-]{1,64}`, as in the file.
fn check_plan_name(name: &str) -> Result<(), ApiError> {
    if allowance_config::valid_plan_name(name) {
        return Ok(());
    }
    Err(ApiError::invalid(
        Some("name".into()),
        format!("invalid plan name {name:?}: expected [A-Za-z0-9._-]{{1,64}}"),
    ))
}

/// Define or change a plan; effective for the next operation of every
/// scope on it.
#[utoipa::path(put, path = "/v1/plans/{name}", request_body = PlanSpec,
    params(("name" = String, Path, description = "[A-Za-z0-9._-]{1,64}")),
    responses((status = 200, body = PlanView), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn put_plan(
    State(state): State<AppState>,
    headers: HeaderMap,
    PathText(name): PathText,
    body: Result<JsonBody<PlanSpec>, ApiError>,
) -> Response {
    measured("admin", async {
        state
            .credentials()
            .authenticate(&headers)?
            .require_admin()?;
        let JsonBody(spec) = body?;
        check_plan_name(&name)?;
        let _serial = state.admin_lock().lock().await;
        let plan = apply_with_dimensions(
            &state,
            &spec.limits,
            |c| plan_from_spec(&name, &spec, c, ""),
            CatalogChange::SetPlan,
        )
        .await?;
        let catalog = state.catalog().await?;
        tracing::info!(plan = %name, "plan set through the admin API");
        Ok(("ok", axum::Json(plan_view(&plan, &catalog)).into_response()))
    })
    .await
}

/// Return a plan to the configuration file's version: what the admin API
/// set for it stops winning over the file (and a later edit of the file
/// takes effect at the next start). Answers the plan now in force; a plan
/// the file does not have is a 404 (it has no version to return to).
#[utoipa::path(delete, path = "/v1/plans/{name}",
    params(("name" = String, Path, description = "[A-Za-z0-9._-]{1,64}")),
    responses((status = 200, body = PlanView), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn delete_plan(
    State(state): State<AppState>,
    headers: HeaderMap,
    PathText(name): PathText,
) -> Response {
    measured("admin", async {
        state
            .credentials()
            .authenticate(&headers)?
            .require_admin()?;
        check_plan_name(&name)?;
        let _serial = state.admin_lock().lock().await;
        let catalog = state.catalog().await?;
        apply_change(&state, &CatalogChange::RevertPlan(name.clone()), &catalog).await?;
        let catalog = state.catalog().await?;
        let plan = catalog
            .plan(&name)
            .ok_or_else(|| ApiError::not_found(format!("plan {name:?} not found")))?;
        tracing::info!(plan = %name, "plan returned to the configuration file's version");
        Ok(("ok", axum::Json(plan_view(plan, &catalog)).into_response()))
    })
    .await
}

/// What follows the scope in a `/v1/scopes/…` path.
enum ScopePath<'a> {
    Scope(&'a str),
    Override(&'a str),
    Adjust(&'a str),
}

impl ScopePath<'_> {
    /// The methods this resource takes, for `Allow`: the one axum would
    /// send lists every method of the whole `/v1/scopes/{*rest}` route.
    fn allow(&self) -> &'static str {
        match self {
            ScopePath::Scope(_) => "GET,HEAD,PUT",
            ScopePath::Override(_) => "DELETE",
            ScopePath::Adjust(_) => "POST",
        }
    }
}

/// The answer to a method a `/v1/scopes/…` path (after the prefix) does not
/// take, with its own `Allow`.
fn scope_method_not_allowed(rest: &str) -> ApiError {
    ApiError::method_not_allowed().with_allow(split(rest).allow())
}

/// The answer to a method `path` does not take. A scope path names its own
/// methods in `Allow` (axum would list the whole wildcard route's); any
/// other keeps the one axum adds.
pub(crate) fn method_not_allowed(path: &str) -> ApiError {
    match path.strip_prefix("/v1/scopes/") {
        Some(rest) => scope_method_not_allowed(rest),
        None => ApiError::method_not_allowed(),
    }
}

fn split(rest: &str) -> ScopePath<'_> {
    // A scope segment is always `kind:id`, so a last segment without a
    // colon can only be one of these suffixes.
    if let Some(s) = rest.strip_suffix("/override") {
        ScopePath::Override(s)
    } else if let Some(s) = rest.strip_suffix("/adjust") {
        ScopePath::Adjust(s)
    } else {
        ScopePath::Scope(rest)
    }
}

async fn scope_get(
    State(state): State<AppState>,
    headers: HeaderMap,
    PathText(rest): PathText,
) -> Response {
    match split(&rest) {
        ScopePath::Scope(s) => crate::routes::scope_status(state, headers, s.to_string()).await,
        _ => scope_method_not_allowed(&rest).into_response(),
    }
}

async fn status_view(
    state: &AppState,
    key: &allowance_core::ScopeKey,
) -> Result<Response, ApiError> {
    let s = state.call(state.store().status(key)).await??;
    Ok(axum::Json(ScopeStatusView::of(&s)).into_response())
}

/// Move a scope to another plan (a tier change) or give it its own limits;
/// effective for the next operation.
#[utoipa::path(put, path = "/v1/scopes/{scope}", request_body = ScopeOverrideBody,
    params(("scope" = String, Path, description = "Canonical scope name, e.g. tenant:acme/user:bob (raw or percent-encoded)")),
    responses((status = 200, body = ScopeStatusView), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn scope_put(
    State(state): State<AppState>,
    headers: HeaderMap,
    PathText(rest): PathText,
    body: Result<JsonBody<ScopeOverrideBody>, ApiError>,
) -> Response {
    let ScopePath::Scope(raw) = split(&rest) else {
        return scope_method_not_allowed(&rest).into_response();
    };
    measured("admin", async {
        let who = state.credentials().authenticate(&headers)?;
        who.require_admin()?;
        let JsonBody(body) = body?;
        let catalog = state.catalog().await?;
        let key = scope_for(&catalog, &who, raw, true)?;
        let _serial = state.admin_lock().lock().await;
        match (body.plan, body.limits) {
            (Some(plan), None) => {
                let change = CatalogChange::SetOverride(key.clone(), Override::Plan(plan.clone()));
                apply_change(&state, &change, &catalog)
                    .await
                    .map_err(|e| match e {
                        // An unknown plan is the body's fault, not a missing route.
                        e if e.status() == 404 => ApiError::invalid(
                            Some("plan".into()),
                            format!("no plan named {plan:?}"),
                        ),
                        e => e,
                    })?;
                tracing::info!(scope = %key, plan = %plan, "scope moved to a plan");
            }
            (None, Some(limits)) => {
                let spec = PlanSpec {
                    limits,
                    ..PlanSpec::default()
                };
                // Named for what it is, not for the scope: a scope's name
                // can be longer than a plan name may be.
                let name = "override";
                apply_with_dimensions(
                    &state,
                    &spec.limits,
                    |c| plan_from_spec(name, &spec, c, ""),
                    |p: Arc<Plan>| CatalogChange::SetOverride(key.clone(), Override::Limits(p)),
                )
                .await?;
                tracing::info!(scope = %key, "scope given its own limits");
            }
            _ => {
                return Err(ApiError::invalid(
                    Some("plan".into()),
                    "give exactly one of plan and limits",
                ));
            }
        }
        Ok(("ok", status_view(&state, &key).await?))
    })
    .await
}

/// Return a scope to its kind's default plan.
#[utoipa::path(delete, path = "/v1/scopes/{scope}/override",
    params(("scope" = String, Path, description = "Canonical scope name, e.g. tenant:acme/user:bob (raw or percent-encoded)")),
    responses((status = 200, body = ScopeStatusView), (status = 403, body = ErrorBody), (status = 404, description = "No override", body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn scope_delete(
    State(state): State<AppState>,
    headers: HeaderMap,
    PathText(rest): PathText,
) -> Response {
    let ScopePath::Override(raw) = split(&rest) else {
        return scope_method_not_allowed(&rest).into_response();
    };
    measured("admin", async {
        let who = state.credentials().authenticate(&headers)?;
        who.require_admin()?;
        let catalog = state.catalog().await?;
        let key = scope_for(&catalog, &who, raw, true)?;
        let _serial = state.admin_lock().lock().await;
        apply_change(&state, &CatalogChange::ClearOverride(key.clone()), &catalog).await?;
        tracing::info!(scope = %key, "scope override cleared");
        Ok(("ok", status_view(&state, &key).await?))
    })
    .await
}

/// Credit (amount > 0) or debit (amount < 0) a scope's `total` limits.
#[utoipa::path(post, path = "/v1/scopes/{scope}/adjust", request_body = AdjustBody,
    params(("scope" = String, Path, description = "Canonical scope name, e.g. tenant:acme/user:bob (raw or percent-encoded)")),
    responses((status = 200, body = ScopeStatusView), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn scope_post(
    State(state): State<AppState>,
    headers: HeaderMap,
    PathText(rest): PathText,
    body: Result<JsonBody<AdjustBody>, ApiError>,
) -> Response {
    let ScopePath::Adjust(raw) = split(&rest) else {
        return scope_method_not_allowed(&rest).into_response();
    };
    measured("admin", async {
        let who = state.credentials().authenticate(&headers)?;
        who.require_admin()?;
        let JsonBody(body) = body?;
        if body.reason.trim().is_empty() || body.reason.len() > MAX_REASON_BYTES {
            return Err(ApiError::invalid(
                Some("reason".into()),
                format!("say why, in 1 to {MAX_REASON_BYTES} bytes"),
            ));
        }
        let catalog = state.catalog().await?;
        let key = scope_for(&catalog, &who, raw, true)?;
        let Some(dim) = catalog.dimension(&body.dimension) else {
            return Err(ApiError::invalid(
                Some("dimension".into()),
                format!("unknown dimension {:?}", body.dimension),
            ));
        };
        let s = state
            .call(state.store().adjust(&key, dim, body.amount.0, &body.reason))
            .await?
            .map_err(|e| match e.into_api(state.now(), &catalog) {
                // The scope exists (every scope does); what is missing is a
                // `total` limit on that dimension: the body's fault.
                e if e.status() == 404 => ApiError::invalid(
                    Some("dimension".into()),
                    format!(
                        "the scope's plan has no total limit on {:?}: only total budgets are adjusted",
                        body.dimension
                    ),
                ),
                e => e,
            })?;
        // The usage log carries the adjustment with its reason (an
        // `adjusted` record); operators also see it in this log line.
        tracing::info!(scope = %key, dimension = %body.dimension, amount = body.amount.0,
            reason = %body.reason, "admin adjustment");
        Ok(("ok", axum::Json(ScopeStatusView::of(&s)).into_response()))
    })
    .await
}
