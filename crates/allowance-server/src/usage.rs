//! `GET /v1/usage`: the usage log for billing (HTTP-API.md "Usage log"), as
//! JSON lines — settles, refunds, expiries and admin adjustments in commit
//! order, each with a cursor an exporter stores to resume.
//!
//! Query: `since` (a cursor; absent: from the oldest retained record) and
//! `limit` (1 to [`MAX_USAGE_PAGE`], default [`DEFAULT_USAGE_LIMIT`]).
//! Other parameters are ignored, as every other route ignores its query.
//! An admin (or anyone, on an open server) reads every tenant; a tenant
//! token only its own tenant's records.

use allowance_core::{Catalog, MAX_USAGE_PAGE, UsageEvent, UsagePage, UsageRecord};
use axum::extract::{Query, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::AppState;
use crate::auth::Principal;
use crate::error::{ApiError, ErrorBody};
use crate::routes::measured;
use crate::wire::{AmountsView, LabelsView, ReservationView, rfc3339};

/// Records per page when `limit` is absent: a page stays well under a
/// megabyte, and an exporter catches up in a few requests.
pub const DEFAULT_USAGE_LIMIT: usize = 1_000;

/// The media type of the answer: one JSON object per line.
pub const NDJSON: &str = "application/x-ndjson";

/// Where the next page starts (`since=` of the next request).
pub const NEXT_CURSOR: HeaderName = HeaderName::from_static("x-next-cursor");

/// One line of `GET /v1/usage`. The field order is fixed: exporters that
/// diff or hash lines see the same bytes for the same record.
#[derive(Debug, Serialize, ToSchema, PartialEq)]
pub struct UsageRecordView<'a> {
    /// Its place in the log, as a string: cursors are u64 and JSON numbers
    /// lose precision past 2^53 in many clients.
    pub cursor: String,
    /// When it happened: the settle or refund instant, the expiry instant
    /// (`expires_at`), the adjustment instant.
    pub at: String,
    /// `settled`, `refunded`, `expired` or `adjusted`.
    pub kind: &'static str,
    /// The reservation's id; null for an adjustment.
    pub reservation: Option<String>,
    /// The tenant; null for an adjustment of a shared scope.
    pub tenant: Option<&'a str>,
    /// The reservation's canonical scopes (tenant first); an adjustment's
    /// one scope.
    pub scopes: Vec<&'a str>,
    /// The model named at reserve.
    pub model: Option<&'a str>,
    /// The reservation's labels (`{}` when it had none); null for an
    /// adjustment.
    #[schema(value_type = Option<std::collections::BTreeMap<String, String>>)]
    pub labels: Option<LabelsView<'a>>,
    /// Amounts held (the last hold, as the reservation object shows it);
    /// `{}` for an adjustment.
    #[schema(value_type = std::collections::BTreeMap<String, u64>)]
    pub held: AmountsView<'a>,
    /// What a settle recorded after the overrun policy; null otherwise.
    #[schema(value_type = Option<std::collections::BTreeMap<String, u64>>)]
    pub charged: Option<AmountsView<'a>>,
    /// A settle after the reservation had expired.
    pub late: bool,
    /// An adjustment's dimension (adjustments only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dimension: Option<&'a str>,
    /// An adjustment's amount: positive credits room, negative debits it
    /// (adjustments only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credit: Option<i64>,
    /// Why the adjustment was made, as the admin gave it (adjustments only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'a str>,
}

impl<'a> UsageRecordView<'a> {
    /// A record, its amounts and dimensions named by `catalog`.
    pub fn of(record: &'a UsageRecord, catalog: &'a Catalog) -> Self {
        let UsageEvent {
            at,
            kind,
            reservation,
            adjustment,
        } = &record.event;
        let mut view = UsageRecordView {
            cursor: record.cursor.to_string(),
            at: rfc3339(*at),
            kind: kind.as_str(),
            reservation: None,
            tenant: record.event.tenant(),
            scopes: Vec::new(),
            model: None,
            labels: None,
            held: AmountsView::default(),
            charged: None,
            late: false,
            dimension: None,
            credit: None,
            reason: None,
        };
        if let Some(r) = reservation {
            // The reservation object's own rendering, so amounts and names
            // read the same in both places.
            let r = ReservationView::of(r, catalog);
            view.reservation = r.id.map(|id| id.0.to_string());
            view.scopes = r.scopes.0.iter().map(|k| k.as_str()).collect();
            view.model = r.model;
            view.labels = Some(r.labels);
            view.held = r.held;
            view.charged = r.charged;
            view.late = r.late.unwrap_or(false);
        }
        if let Some(a) = adjustment {
            view.scopes = vec![a.scope.as_str()];
            view.dimension = Some(catalog.dimension_name(a.dimension));
            view.credit = Some(a.credit);
            view.reason = Some(&a.reason);
        }
        view
    }
}

/// The page as JSON lines, each ending in `\n`; empty when it has none.
pub fn ndjson(page: &UsagePage, catalog: &Catalog) -> Result<Vec<u8>, serde_json::Error> {
    let mut out = Vec::with_capacity(page.records.len() * 384);
    for record in &page.records {
        serde_json::to_writer(&mut out, &UsageRecordView::of(record, catalog))?;
        out.push(b'\n');
    }
    Ok(out)
}

/// What the query asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsageQuery {
    /// Start after this cursor; `None`: from the oldest retained record.
    pub since: Option<u64>,
    /// At most this many records.
    pub limit: usize,
}

/// A whole number written in decimal digits only (no sign, no spaces).
fn digits(v: &str) -> Option<u64> {
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse().ok()
}

/// Reads `since` and `limit` from decoded query pairs. A parameter given
/// twice is a 400 naming it: which one counts would be a guess. Any other
/// parameter is a 400 naming it too: an exporter whose `sinse=` went
/// unnoticed would read the whole log again, and bill it twice.
pub fn parse_query(pairs: &[(String, String)]) -> Result<UsageQuery, ApiError> {
    let (mut since, mut limit): (Option<&str>, Option<&str>) = (None, None);
    for (key, value) in pairs {
        let slot = match key.as_str() {
            "since" => &mut since,
            "limit" => &mut limit,
            other => {
                return Err(ApiError::invalid(
                    Some(other.to_string()),
                    format!(
                        "unknown query parameter {other:?}: the usage log takes since and limit"
                    ),
                ));
            }
        };
        if slot.is_some() {
            return Err(ApiError::invalid(
                Some(key.clone()),
                format!("{key} is given twice"),
            ));
        }
        *slot = Some(value);
    }
    let since = match since {
        None => None,
        Some(v) => Some(digits(v).ok_or_else(|| {
            ApiError::invalid(
                Some("since".into()),
                format!("since must be a cursor (a whole number ≥ 0), not {v:?}"),
            )
        })?),
    };
    let limit = match limit {
        None => DEFAULT_USAGE_LIMIT,
        Some(v) => digits(v)
            .and_then(|n| usize::try_from(n).ok())
            .filter(|n| (1..=MAX_USAGE_PAGE).contains(n))
            .ok_or_else(|| {
                ApiError::invalid(
                    Some("limit".into()),
                    format!("limit must be a whole number from 1 to {MAX_USAGE_PAGE}, not {v:?}"),
                )
            })?,
    };
    Ok(UsageQuery { since, limit })
}

/// The usage log after a cursor, as JSON lines.
#[utoipa::path(get, path = "/v1/usage",
    params(
        ("since" = Option<String>, Query, description = "A cursor (decimal u64): records after it. Absent: from the oldest retained record.", pattern = r"^[0-9]{1,20}$"),
        ("limit" = Option<u32>, Query, description = "At most this many records, 1 to 10000 (default 1000).")),
    responses(
        (status = 200, description = "One JSON object per line, oldest first (empty body when none). An admin token reads every tenant, a tenant token its own.",
            content_type = "application/x-ndjson", body = UsageRecordView,
            headers(("X-Next-Cursor" = String, description = "`since` of the next request: the last record looked at, or the given cursor when nothing is new"))),
        (status = 400, description = "`since` or `limit` invalid", body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 503, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn usage(State(state): State<AppState>, headers: HeaderMap, uri: Uri) -> Response {
    measured("usage", async {
        let who = state.credentials().authenticate(&headers)?;
        let Query(pairs) = Query::<Vec<(String, String)>>::try_from_uri(&uri)
            .map_err(|e| ApiError::invalid(None, format!("the query string is not valid: {e}")))?;
        let query = parse_query(&pairs)?;
        let tenant = match &who {
            Principal::Admin => None,
            Principal::Tenant(t) => Some(t.as_str()),
        };
        let page = state
            .call(state.store().usage(query.since, query.limit, tenant))
            .await??;
        // Read after the page: custom dimensions are only ever added while
        // the server runs, so this catalog names every one the page uses.
        let catalog = state.catalog().await?;
        let body = ndjson(&page, &catalog).map_err(|e| {
            ApiError::unavailable(format!("the usage log could not be rendered: {e}"))
        })?;
        Ok((
            "ok",
            (
                StatusCode::OK,
                [
                    (CONTENT_TYPE, HeaderValue::from_static(NDJSON)),
                    (NEXT_CURSOR, HeaderValue::from(page.next_cursor)),
                ],
                body,
            )
                .into_response(),
        ))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// The error's `field`, as its debug form shows it.
    fn field_of(e: &ApiError) -> String {
        format!("{e:?}")
    }

    #[test]
    fn queries_read_as_the_spec_says() {
        let q = |list: &[(&str, &str)]| parse_query(&pairs(list));
        assert_eq!(
            q(&[]).unwrap(),
            UsageQuery {
                since: None,
                limit: DEFAULT_USAGE_LIMIT
            }
        );
        assert_eq!(
            q(&[("since", "18446744073709551615"), ("limit", "10000")]).unwrap(),
            UsageQuery {
                since: Some(u64::MAX),
                limit: MAX_USAGE_PAGE
            }
        );
        assert_eq!(
            q(&[("limit", "1"), ("since", "0")]).unwrap(),
            UsageQuery {
                since: Some(0),
                limit: 1
            }
        );
        for (bad, field) in [
            (("sinse", "5"), "sinse"),
            (("other", "x"), "other"),
            (("since", ""), "since"),
            (("since", "-1"), "since"),
            (("since", "+1"), "since"),
            (("since", "1.0"), "since"),
            (("since", " 1"), "since"),
            (("since", "18446744073709551616"), "since"),
            (("limit", "0"), "limit"),
            (("limit", "10001"), "limit"),
            (("limit", "ten"), "limit"),
            (("limit", ""), "limit"),
        ] {
            let e = q(&[bad]).unwrap_err();
            assert_eq!(e.status(), 400, "{bad:?}");
            assert!(
                field_of(&e).contains(&format!("field: Some(\"{field}\")")),
                "{bad:?}: {e:?}"
            );
        }
        let e = q(&[("since", "1"), ("since", "2")]).unwrap_err();
        assert!(field_of(&e).contains("field: Some(\"since\")"), "{e:?}");
    }
}
