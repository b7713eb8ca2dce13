//! `GET /openapi.json`: the OpenAPI 3.1 document, generated from the types
//! and handlers themselves.

use axum::Router;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::AppState;

#[derive(OpenApi)]
#[openapi(
    info(title = "allowance", description = "Budgets and rate limits for AI agents: reserve an estimate, settle the actual."),
    paths(
        crate::routes::reserve,
        crate::routes::get_reservation,
        crate::routes::settle,
        crate::routes::refund,
        crate::routes::extend,
        crate::routes::scope_status,
        crate::routes::healthz,
        crate::routes::readyz,
        crate::routes::metrics_text,
        crate::admin::list_plans,
        crate::admin::put_plan,
        crate::admin::scope_put,
        crate::admin::scope_delete,
        crate::admin::scope_post,
        crate::usage::usage,
    ),
    components(schemas(allowance_config::LimitSpec)),
    modifiers(&Bearer)
)]
struct Doc;

struct Bearer;

impl Modify for Bearer {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        if let Some(c) = openapi.components.as_mut() {
            c.add_security_scheme(
                "bearer",
                SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
            );
        }
    }
}

/// The OpenAPI document as JSON.
pub fn openapi_json() -> String {
    Doc::openapi()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

pub(crate) fn router() -> Router<AppState> {
    Router::new().route("/openapi.json", get(serve_doc))
}

async fn serve_doc() -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        openapi_json(),
    )
        .into_response()
}
