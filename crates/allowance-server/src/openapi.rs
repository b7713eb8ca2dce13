//! `GET /openapi.json`: the OpenAPI 3.1 document, generated from the types
//! and handlers themselves.

use axum::Router;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use utoipa::openapi::path::{Operation, ParameterIn};
use utoipa::openapi::schema::{Object, Schema};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{Content, Ref, RefOr, Required, ResponseBuilder};
use utoipa::{Modify, OpenApi};

use allowance_core::{MAX_ID_LEN, MAX_KIND_LEN};

use crate::AppState;
use crate::extract::MAX_BODY_BYTES;
use crate::wire::MAX_REASON_BYTES;

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
        crate::admin::delete_plan,
        crate::admin::scope_put,
        crate::admin::scope_delete,
        crate::admin::scope_post,
        crate::usage::usage,
    ),
    components(schemas(allowance_config::LimitSpec, crate::error::DenialBody)),
    modifiers(&Bearer, &FlattenedSchemas, &OptionalBodies, &PatternsAndBounds, &CommonErrors, &Descriptions)
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

/// Rebuilds the two schemas the derive gets wrong from the derived ones (so
/// they follow the types):
/// - `ErrorObject` flattens an `Option<DenialBody>`, which the derive writes
///   as `allOf: [oneOf: [DenialBody, null], …]` — a schema no error without a
///   denial matches. The denial's fields become optional properties instead.
/// - `PlanView` flattens `PlanSpec`, whose `additionalProperties: false` (a
///   request's unknown field is a 400) would refuse the view's own `name`.
struct FlattenedSchemas;

impl Modify for FlattenedSchemas {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let Some(c) = openapi.components.as_mut() else {
            return;
        };
        let object =
            |schemas: &std::collections::BTreeMap<String, RefOr<Schema>>, name: &str| match schemas
                .get(name)
            {
                Some(RefOr::T(Schema::Object(o))) => Some(o.clone()),
                _ => None,
            };
        let error = object(&c.schemas, "ErrorObject");
        if let (Some(mut error), Some(denial)) = (error, object(&c.schemas, "DenialBody")) {
            for (name, schema) in denial.properties {
                error.properties.entry(name).or_insert(schema);
            }
            c.schemas
                .insert("ErrorObject".into(), RefOr::T(Schema::Object(error)));
        }
        if let Some(mut view) = object(&c.schemas, "PlanSpec") {
            let name = Object::builder()
                .schema_type(utoipa::openapi::schema::Type::String)
                .description(Some("The plan's name."))
                .build();
            view.properties.insert("name".into(), name.into());
            view.required.insert(0, "name".into());
            view.description = Some("A plan with its name.".into());
            c.schemas
                .insert("PlanView".into(), RefOr::T(Schema::Object(view)));
        }
    }
}

/// A refund takes no body or `{}` (HTTP-API.md). The derive marks a body
/// optional only when its type is an `Option`, which would document `null`
/// as a body too, and the server refuses `null` (a body must be an object).
struct OptionalBodies;

impl Modify for OptionalBodies {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let refund = openapi
            .paths
            .paths
            .get_mut("/v1/reservations/{id}/refund")
            .and_then(|item| item.post.as_mut())
            .and_then(|op| op.request_body.as_mut());
        if let Some(RefOr::T(body)) = refund {
            body.required = Some(Required::False);
        }
    }
}

/// Every operation of the document, with its path.
fn operations(
    openapi: &mut utoipa::openapi::OpenApi,
) -> impl Iterator<Item = (&str, &mut Operation)> {
    openapi.paths.paths.iter_mut().flat_map(|(path, item)| {
        [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
        ]
        .into_iter()
        .flatten()
        .map(move |op| (path.as_str(), op))
    })
}

/// A scope id's pattern (tenant names included), from the core's own
/// limit: `[A-Za-z0-9._~@+=-]{1,MAX_ID_LEN}` (`allowance_core::valid_id`).
fn id_pattern() -> String {
    format!("[A-Za-z0-9._~@+=-]{{1,{MAX_ID_LEN}}}")
}

/// A scope name's pattern: `kind:id` or `tenant:id/kind:id`
/// (`ScopeKey::parse`), a little wider than the parser (any kind may lead),
/// so a value it refuses is refused by the server too.
fn scope_pattern() -> String {
    let kind = format!("[a-z][a-z0-9_-]{{0,{}}}", MAX_KIND_LEN - 1);
    let part = format!("{kind}:{}", id_pattern());
    format!("^{part}(/{part})?$")
}

/// The patterns of the path parameters, by name: set here once for every
/// operation that takes one (the derive takes a literal per handler). An
/// id is `ReservationId`'s display form.
fn path_pattern(name: &str) -> Option<String> {
    match name {
        "id" => Some(r"^rsv_[0-9a-f]{32}$".to_string()),
        "scope" => Some(scope_pattern()),
        _ => None,
    }
}

/// Sets [`path_pattern`] on the path parameters it names, the tenant's
/// pattern on a reserve's `tenant`, and an adjustment `reason`'s longest
/// length: each from the code's own limit (the derive takes literals).
struct PatternsAndBounds;

impl Modify for PatternsAndBounds {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for (_, op) in operations(openapi) {
            for param in op.parameters.iter_mut().flatten() {
                let RefOr::T(param) = param else { continue };
                let pattern = path_pattern(&param.name);
                if param.parameter_in == ParameterIn::Path
                    && let Some(RefOr::T(Schema::Object(o))) = param.schema.as_mut()
                {
                    o.pattern = pattern;
                }
            }
        }
        if let Some(tenant) = property(openapi, "ReserveBody", "tenant") {
            tenant.pattern = Some(format!("^{}$", id_pattern()));
        }
        if let Some(reason) = property(openapi, "AdjustBody", "reason") {
            // maxLength counts characters: at most the byte limit, so the
            // document is never narrower than the server.
            reason.max_length = Some(MAX_REASON_BYTES);
        }
    }
}

/// A property of a component schema, as an object schema.
fn property<'a>(
    openapi: &'a mut utoipa::openapi::OpenApi,
    schema: &str,
    name: &str,
) -> Option<&'a mut Object> {
    let body = openapi.components.as_mut()?.schemas.get_mut(schema)?;
    let RefOr::T(Schema::Object(body)) = body else {
        return None;
    };
    match body.properties.get_mut(name)? {
        RefOr::T(Schema::Object(o)) => Some(o),
        _ => None,
    }
}

/// Documents the error answers every route of a kind can give, where its
/// own annotation does not: HTTP-API.md says which (a bad credential, a body
/// that is not JSON or too large, a malformed path parameter, a store that
/// does not answer), and they come from the shared extractors, not the
/// handler.
struct CommonErrors;

impl CommonErrors {
    fn add(op: &mut Operation, status: &str, description: &str) {
        op.responses
            .responses
            .entry(status.to_string())
            .or_insert_with(|| {
                ResponseBuilder::new()
                    .description(description)
                    .content(
                        "application/json",
                        Content::new(Some(Ref::from_schema_name("ErrorBody"))),
                    )
                    .build()
                    .into()
            });
    }
}

impl Modify for CommonErrors {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        const INVALID: &str = "Invalid request (`field` names the offending field)";
        for (path, op) in operations(openapi) {
            if op.security.is_some() {
                Self::add(op, "401", "No or unknown credential");
                Self::add(op, "403", "The credential may not do this");
            }
            if op.request_body.is_some() {
                Self::add(op, "400", INVALID);
                let too_large = format!("The body is over {} KiB", MAX_BODY_BYTES / 1024);
                Self::add(op, "413", &too_large);
                Self::add(op, "415", "The body is not `application/json`");
            }
            // A malformed reservation id is a 404 like an unknown one
            // (SERVER-CHOICES.md); a malformed scope or plan name a 400.
            let (reservation, scope) = (path.contains("{id}"), path.contains("{scope}"));
            if reservation || scope {
                Self::add(
                    op,
                    "404",
                    "No such reservation or scope (or another tenant's)",
                );
            }
            if scope || path.contains("{name}") {
                Self::add(op, "400", INVALID);
            }
            if path.starts_with("/v1/") {
                Self::add(op, "503", "The store did not answer");
            }
        }
    }
}

/// OpenAPI requires a description on every response; the derive leaves
/// out the ones an annotation did not write, which made the document
/// invalid (42 responses). Each gets its status's reason phrase.
struct Descriptions;

impl Modify for Descriptions {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for (_, op) in operations(openapi) {
            for (status, response) in op.responses.responses.iter_mut() {
                if let RefOr::T(r) = response
                    && r.description.trim().is_empty()
                {
                    r.description = axum::http::StatusCode::from_bytes(status.as_bytes())
                        .ok()
                        .and_then(|s| s.canonical_reason())
                        .unwrap_or("Answer")
                        .to_string();
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use allowance_core::ScopeKey;

    /// Every response has a description (OpenAPI 3.1 requires it).
    #[test]
    fn every_response_is_described() {
        let doc: serde_json::Value = serde_json::from_str(&openapi_json()).unwrap();
        let mut seen = 0;
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                for (status, r) in op["responses"].as_object().unwrap() {
                    let d = r["description"].as_str().unwrap_or("");
                    assert!(!d.trim().is_empty(), "{method} {path} {status}: {r}");
                    seen += 1;
                }
            }
        }
        assert!(seen > 50, "{seen} responses");
    }

    /// The documented patterns follow the parser: every name it takes
    /// matches, and the names it refuses for their characters or lengths
    /// do not (the pattern is wider only in which kind may lead).
    #[test]
    fn scope_and_tenant_patterns_agree_with_the_parser() {
        let scope = regex::Regex::new(&scope_pattern()).unwrap();
        let tenant = regex::Regex::new(&format!("^{}$", id_pattern())).unwrap();
        let long_id = "x".repeat(MAX_ID_LEN);
        let long_kind = format!("k{}", "x".repeat(MAX_KIND_LEN - 1));
        let taken = [
            "tenant:acme".to_string(),
            "tenant:acme/user:bob".to_string(),
            "tool:search".to_string(),
            format!("tenant:{long_id}/{long_kind}:A.b_c~d@e+f=g-h"),
        ];
        for name in &taken {
            assert!(ScopeKey::parse(name).is_ok(), "{name}");
            assert!(scope.is_match(name), "{name}");
        }
        let refused = [
            "0".to_string(),
            "tenant:".to_string(),
            "Tenant:acme".to_string(),
            "tenant:ac me".to_string(),
            "tenant:acme/user:bob/agent:x".to_string(),
            format!("tenant:{long_id}x"),
            format!("{long_kind}x:acme"),
        ];
        for name in &refused {
            assert!(ScopeKey::parse(name).is_err(), "{name}");
            assert!(!scope.is_match(name), "{name}");
        }
        for b in 0u8..128 {
            let id = char::from(b).to_string();
            assert_eq!(
                tenant.is_match(&id),
                allowance_core::valid_id(&id),
                "{id:?}"
            );
        }
        assert!(tenant.is_match(&long_id) && !tenant.is_match(&format!("{long_id}x")));
    }
}
