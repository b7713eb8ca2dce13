//! `GET /v1/usage` through the router without a socket, on a manual clock:
//! every kind of record as exact JSON lines, late settles, repeats,
//! pagination and its cursor header, tenant filtering, bad queries and
//! credentials, an unavailable store.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use allowance_core::{
    AdminError, Amounts, Catalog, CatalogChange, Dimension, EmbeddedStore, ExtendError, Granted,
    ManualClock, RefundError, Reservation, ReservationId, ReserveError, ReserveRequest, ScopeKey,
    ScopeStatus, SeededIds, SettleError, Store, StoreError, StoreStats, Timestamp, Unavailable,
    Usage, UsagePage,
};
use allowance_server::{AppState, Credential, Credentials, Options, app};
use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tower::ServiceExt;

const ADMIN: &str = "admin-token";
const ACME: &str = "acme-token";
const BETA: &str = "beta-token";

/// 2023-11-14T22:13:20.000Z.
const START_MS: u64 = 1_700_000_000_000;

struct World {
    store: Arc<EmbeddedStore>,
    clock: Arc<ManualClock>,
    state: AppState,
}

fn credentials() -> Credentials {
    let cred = |token: &str, tenant: Option<&str>| Credential {
        sha256: Sha256::digest(token.as_bytes()).into(),
        tenant: tenant.map(str::to_string),
    };
    Credentials::new(vec![
        cred(ADMIN, None),
        cred(ACME, Some("acme")),
        cred(BETA, Some("beta")),
    ])
}

/// The starter's catalog on an embedded store; `tokens`: admin, acme and
/// beta tokens, else an open server.
fn world(tokens: bool) -> World {
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(START_MS)));
    let store = Arc::new(EmbeddedStore::new(
        allowance_config::starter().catalog.clone(),
        4,
        clock.clone(),
        Arc::new(SeededIds::new(7)),
    ));
    let creds = if tokens {
        credentials()
    } else {
        Credentials::default()
    };
    let state = AppState::with_clock(store.clone(), creds, Options::default(), clock.clone());
    World {
        store,
        clock,
        state,
    }
}

/// An answer: status, `X-Next-Cursor`, content type, raw body.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    next: Option<String>,
    content_type: Option<String>,
    text: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or(Value::Null)
    }

    /// The body's lines as JSON (each line must end in `\n`).
    fn lines(&self) -> Vec<Value> {
        assert!(
            self.text.is_empty() || self.text.ends_with('\n'),
            "every line ends in a newline: {:?}",
            self.text
        );
        self.text
            .lines()
            .map(|l| serde_json::from_str(l).expect("each line is one JSON object"))
            .collect()
    }

    fn cursors(&self) -> Vec<String> {
        self.lines()
            .iter()
            .map(|l| l["cursor"].as_str().expect("cursor string").to_string())
            .collect()
    }
}

async fn call(
    state: &AppState,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> Answer {
    let mut req = Request::builder().method(method).uri(path);
    if !body.is_empty() {
        req = req.header("content-type", "application/json");
    }
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = app(state.clone())
        .oneshot(req.body(Body::from(body.to_string())).unwrap())
        .await
        .unwrap();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
    };
    let (status, next, content_type) = (
        resp.status(),
        header("x-next-cursor"),
        header("content-type"),
    );
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        next,
        content_type,
        text: String::from_utf8(bytes.to_vec()).unwrap(),
    }
}

async fn usage(w: &World, query: &str, token: Option<&str>) -> Answer {
    call(&w.state, "GET", &format!("/v1/usage{query}"), token, "").await
}

/// Reserves; returns the id.
async fn reserve(w: &World, token: Option<&str>, body: &str) -> String {
    let a = call(&w.state, "POST", "/v1/reservations", token, body).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    a.json()["id"].as_str().unwrap().to_string()
}

async fn settle(w: &World, token: Option<&str>, id: &str, body: &str) -> Answer {
    let a = call(
        &w.state,
        "POST",
        &format!("/v1/reservations/{id}/settle"),
        token,
        body,
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    a
}

async fn refund(w: &World, token: Option<&str>, id: &str) {
    let a = call(
        &w.state,
        "POST",
        &format!("/v1/reservations/{id}/refund"),
        token,
        "",
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
}

async fn adjust(w: &World, token: Option<&str>, scope: &str, body: &str) {
    let a = call(
        &w.state,
        "POST",
        &format!("/v1/scopes/{scope}/adjust"),
        token,
        body,
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
}

const SMALL: &str = r#"{"tenant": "acme", "amounts": {"input_tokens": 10}}"#;

#[tokio::test]
async fn every_kind_of_record_as_exact_json_lines() {
    let w = world(false);
    // Settled: with scopes, a model and labels.
    let settled = reserve(
        &w,
        None,
        r#"{"tenant": "acme", "scopes": {"user": "bob"}, "model": "gpt-4o",
            "amounts": {"input_tokens": 1000, "output_tokens": 500}, "labels": {"task": "sum"}}"#,
    )
    .await;
    w.clock.advance_ms(1_000);
    settle(
        &w,
        None,
        &settled,
        r#"{"usage": {"input_tokens": 900, "output_tokens": 400}}"#,
    )
    .await;
    // Refunded: no model, no labels.
    let refunded = reserve(
        &w,
        None,
        r#"{"tenant": "acme", "amounts": {"input_tokens": 10}, "ttl_ms": 60000}"#,
    )
    .await;
    w.clock.advance_ms(1_000);
    refund(&w, None, &refunded).await;
    // Expired: found by the sweep, recorded at its expiry instant.
    let expired = reserve(
        &w,
        None,
        r#"{"tenant": "acme", "amounts": {"output_tokens": 7}, "ttl_ms": 5000}"#,
    )
    .await;
    w.clock.advance_ms(10_000);
    w.store.expire_due().await.unwrap();
    // Adjusted: a debit of a task's total budget.
    adjust(
        &w,
        None,
        "tenant:acme/task:t1",
        r#"{"dimension": "cost_micros", "amount": -5000, "reason": "refund of a bad run"}"#,
    )
    .await;

    let a = usage(&w, "", None).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    assert_eq!(a.content_type.as_deref(), Some("application/x-ndjson"));
    assert_eq!(a.next.as_deref(), Some("4"));
    let expected = [
        format!(
            r#"{{"cursor":"1","at":"2023-11-14T22:13:21.000Z","kind":"settled","reservation":"{settled}","tenant":"acme","scopes":["tenant:acme","tenant:acme/user:bob"],"model":"gpt-4o","labels":{{"task":"sum"}},"held":{{"requests":1,"concurrent":1,"input_tokens":1000,"output_tokens":500,"tokens":1500,"cost_micros":7500}},"charged":{{"requests":1,"input_tokens":900,"output_tokens":400,"tokens":1300,"cost_micros":6250}},"late":false}}"#
        ),
        format!(
            r#"{{"cursor":"2","at":"2023-11-14T22:13:22.000Z","kind":"refunded","reservation":"{refunded}","tenant":"acme","scopes":["tenant:acme"],"model":null,"labels":{{}},"held":{{"requests":1,"concurrent":1,"input_tokens":10,"tokens":10}},"charged":null,"late":false}}"#
        ),
        format!(
            r#"{{"cursor":"3","at":"2023-11-14T22:13:27.000Z","kind":"expired","reservation":"{expired}","tenant":"acme","scopes":["tenant:acme"],"model":null,"labels":{{}},"held":{{"requests":1,"concurrent":1,"output_tokens":7,"tokens":7}},"charged":null,"late":false}}"#
        ),
        r#"{"cursor":"4","at":"2023-11-14T22:13:32.000Z","kind":"adjusted","reservation":null,"tenant":"acme","scopes":["tenant:acme/task:t1"],"model":null,"labels":null,"held":{},"charged":null,"late":false,"dimension":"cost_micros","credit":-5000,"reason":"refund of a bad run"}"#.to_string(),
    ];
    let want: String = expected.iter().map(|l| format!("{l}\n")).collect();
    assert_eq!(a.text, want);
}

#[tokio::test]
async fn a_late_settle_follows_the_expiry_and_a_repeat_adds_nothing() {
    let w = world(false);
    let id = reserve(
        &w,
        None,
        r#"{"tenant": "acme", "amounts": {"input_tokens": 100}, "ttl_ms": 1000}"#,
    )
    .await;
    w.clock.advance_ms(3_000);
    // No sweep ran: the settle itself finds the expiry, reports it, then
    // its own late settle.
    let body = r#"{"usage": {"input_tokens": 80}}"#;
    let first = settle(&w, None, &id, body).await;
    assert_eq!(first.json()["late"], true);
    let a = usage(&w, "", None).await;
    let lines = a.lines();
    assert_eq!(lines.len(), 2, "{}", a.text);
    assert_eq!(
        (&lines[0]["kind"], &lines[0]["charged"], &lines[0]["late"]),
        (&json!("expired"), &Value::Null, &json!(false))
    );
    assert_eq!(
        lines[0]["at"], "2023-11-14T22:13:21.000Z",
        "the expiry instant"
    );
    assert_eq!(
        (&lines[1]["kind"], &lines[1]["late"]),
        (&json!("settled"), &json!(true))
    );
    assert_eq!(
        lines[1]["at"], "2023-11-14T22:13:23.000Z",
        "the settle instant"
    );
    assert_eq!(
        lines[1]["charged"],
        json!({"requests": 1, "input_tokens": 80, "tokens": 80})
    );
    assert_eq!(lines[0]["reservation"], json!(id));
    assert_eq!(lines[1]["reservation"], json!(id));
    assert_eq!(a.next.as_deref(), Some("2"));

    // A repeat answers the same and is not a second record; neither is a
    // sweep that finds nothing new, nor a refund of the settled one (409).
    w.clock.advance_ms(1_000);
    let again = settle(&w, None, &id, body).await;
    assert_eq!(again.text, first.text);
    w.store.expire_due().await.unwrap();
    let conflict = call(
        &w.state,
        "POST",
        &format!("/v1/reservations/{id}/refund"),
        None,
        "",
    )
    .await;
    assert_eq!(conflict.status, StatusCode::CONFLICT);
    let b = usage(&w, "?since=2", None).await;
    assert_eq!((b.text.as_str(), b.next.as_deref()), ("", Some("2")));
    assert_eq!(usage(&w, "", None).await.text, a.text);
}

#[tokio::test]
async fn a_refund_of_an_expired_hold_is_only_its_expiry() {
    let w = world(false);
    let id = reserve(
        &w,
        None,
        r#"{"tenant": "acme", "amounts": {"input_tokens": 1}, "ttl_ms": 1000}"#,
    )
    .await;
    w.clock.advance_ms(2_000);
    refund(&w, None, &id).await;
    refund(&w, None, &id).await;
    let a = usage(&w, "", None).await;
    let kinds: Vec<Value> = a.lines().iter().map(|l| l["kind"].clone()).collect();
    assert_eq!(kinds, vec![json!("expired")], "{}", a.text);
}

#[tokio::test]
async fn pages_follow_the_cursor_and_repeat_it_when_nothing_is_new() {
    let w = world(false);
    // Nothing yet: an empty page, cursor 0 (or the one given).
    let a = usage(&w, "", None).await;
    assert_eq!(
        (a.status, a.text.as_str(), a.next.as_deref()),
        (StatusCode::OK, "", Some("0"))
    );
    assert_eq!(a.content_type.as_deref(), Some("application/x-ndjson"));
    assert_eq!(usage(&w, "?since=7", None).await.next.as_deref(), Some("7"));

    let mut ids = Vec::new();
    for _ in 0..5 {
        let id = reserve(&w, None, SMALL).await;
        refund(&w, None, &id).await;
        ids.push(id);
    }
    let mut since: Option<String> = None;
    let mut pages = Vec::new();
    loop {
        let q = match &since {
            Some(s) => format!("?limit=2&since={s}"),
            None => "?limit=2".to_string(),
        };
        let a = usage(&w, &q, None).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text);
        let next = a.next.clone().expect("X-Next-Cursor on every page");
        pages.push((a.cursors(), next.clone()));
        if since.as_deref() == Some(next.as_str()) {
            break;
        }
        since = Some(next);
    }
    let page = |c: &[&str], n: &str| {
        (
            c.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            n.to_string(),
        )
    };
    assert_eq!(
        pages,
        vec![
            page(&["1", "2"], "2"),
            page(&["3", "4"], "4"),
            page(&["5"], "5"),
            page(&[], "5"),
        ]
    );
    // The records are the refunds, in order.
    let all = usage(&w, "", None).await;
    let got: Vec<Value> = all
        .lines()
        .iter()
        .map(|l| l["reservation"].clone())
        .collect();
    let want: Vec<Value> = ids.iter().map(|i| json!(i)).collect();
    assert_eq!(got, want);
    // A cursor past the end is answered as given: nothing new.
    let far = usage(&w, "?since=18446744073709551615", None).await;
    assert_eq!(
        (far.text.as_str(), far.next.as_deref()),
        ("", Some("18446744073709551615"))
    );
}

#[tokio::test]
async fn a_tenant_token_reads_only_its_tenant() {
    let w = world(true);
    // acme, beta, acme; then an adjustment of a shared scope (no tenant).
    let a1 = reserve(&w, Some(ACME), SMALL).await;
    refund(&w, Some(ACME), &a1).await;
    let b1 = reserve(
        &w,
        Some(BETA),
        r#"{"tenant": "beta", "amounts": {"input_tokens": 10}}"#,
    )
    .await;
    settle(&w, Some(BETA), &b1, r#"{"usage": {"input_tokens": 3}}"#).await;
    let a2 = reserve(&w, Some(ADMIN), SMALL).await;
    refund(&w, Some(ADMIN), &a2).await;
    let put = call(
        &w.state,
        "PUT",
        "/v1/scopes/tool:search",
        Some(ADMIN),
        r#"{"limits": [{"dimension": "requests", "capacity": 100, "window": "total"}]}"#,
    )
    .await;
    assert_eq!(put.status, StatusCode::OK, "{}", put.text);
    adjust(
        &w,
        Some(ADMIN),
        "tool:search",
        r#"{"dimension": "requests", "amount": 10, "reason": "goodwill"}"#,
    )
    .await;

    let reservations =
        |a: &Answer| -> Vec<Value> { a.lines().iter().map(|l| l["reservation"].clone()).collect() };
    let admin = usage(&w, "", Some(ADMIN)).await;
    assert_eq!(admin.status, StatusCode::OK);
    assert_eq!(
        reservations(&admin),
        vec![json!(a1), json!(b1), json!(a2), Value::Null]
    );
    let shared = &admin.lines()[3];
    assert_eq!(
        (&shared["tenant"], &shared["scopes"], &shared["credit"]),
        (&Value::Null, &json!(["tool:search"]), &json!(10))
    );
    assert_eq!(admin.next.as_deref(), Some("4"));

    let acme = usage(&w, "", Some(ACME)).await;
    assert_eq!(acme.status, StatusCode::OK);
    assert_eq!(reservations(&acme), vec![json!(a1), json!(a2)]);
    assert!(acme.lines().iter().all(|l| l["tenant"] == "acme"));
    // The cursor moves past what the token may not see: the next page
    // starts after it, and reads nothing.
    assert_eq!(acme.next.as_deref(), Some("4"));
    assert_eq!(usage(&w, "?since=4", Some(ACME)).await.text, "");
    let beta = usage(&w, "?since=1&limit=1", Some(BETA)).await;
    assert_eq!(
        (reservations(&beta), beta.next.as_deref()),
        (vec![json!(b1)], Some("2"))
    );
    let beta = usage(&w, "?since=2&limit=1", Some(BETA)).await;
    assert_eq!(
        (beta.text.as_str(), beta.next.as_deref()),
        ("", Some("2")),
        "nothing of beta's is new: the cursor repeats"
    );

    // No token, an unknown one, a malformed header: 401, nothing listed.
    for token in [None, Some("not-a-token")] {
        let a = usage(&w, "", token).await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{token:?}");
        assert_eq!(a.json()["error"]["type"], "unauthorized");
        assert_eq!(a.next, None);
    }
    // Credentials come before the query: a bad one does not reveal
    // whether the query would have passed.
    let a = usage(&w, "?limit=0", None).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn bad_since_or_limit_is_a_400_naming_it_and_changes_nothing() {
    let w = world(false);
    for _ in 0..3 {
        let id = reserve(&w, None, SMALL).await;
        refund(&w, None, &id).await;
    }
    let before = usage(&w, "", None).await.text;
    let status_before = call(&w.state, "GET", "/v1/scopes/tenant:acme", None, "")
        .await
        .text;
    for (query, field) in [
        ("?since=abc", "since"),
        ("?since=-1", "since"),
        ("?since=", "since"),
        ("?since=1.5", "since"),
        ("?since=18446744073709551616", "since"),
        ("?since=1&since=2", "since"),
        ("?limit=0", "limit"),
        ("?limit=10001", "limit"),
        ("?limit=-5", "limit"),
        ("?limit=1e3", "limit"),
        ("?since=1&limit=x", "limit"),
    ] {
        let a = usage(&w, query, None).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{query}: {}", a.text);
        let e = a.json();
        assert_eq!(e["error"]["type"], "invalid_request", "{query}");
        assert_eq!(e["error"]["field"], field, "{query}");
        assert_eq!(a.next, None, "{query}: no cursor on an error");
    }
    assert_eq!(usage(&w, "", None).await.text, before);
    assert_eq!(
        call(&w.state, "GET", "/v1/scopes/tenant:acme", None, "")
            .await
            .text,
        status_before
    );
    // The bounds themselves pass; percent-encoding is decoded. Any other
    // parameter is a 400 naming it: `sinse=` would re-read the whole log,
    // `tenant=beta` would look like a filter and filter nothing.
    assert_eq!(usage(&w, "?limit=10000", None).await.status, StatusCode::OK);
    assert_eq!(usage(&w, "?limit=1", None).await.cursors(), vec!["1"]);
    assert_eq!(usage(&w, "?%73ince=2", None).await.cursors(), vec!["3"]);
    for (query, field) in [
        ("?since=1&format=csv", "format"),
        ("?tenant=beta", "tenant"),
        ("?sinse=1", "sinse"),
    ] {
        let a = usage(&w, query, None).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{query}: {}", a.text);
        assert!(
            a.text.contains(&format!("\"field\":\"{field}\"")),
            "{query}: {}",
            a.text
        );
    }
}

#[tokio::test]
async fn custom_dimensions_are_named_from_the_catalog() {
    let w = world(false);
    // A task with its own total budget on a custom dimension, registered
    // through the admin API.
    let put = call(
        &w.state,
        "PUT",
        "/v1/scopes/tenant:acme/task:t9",
        None,
        r#"{"limits": [{"dimension": "search_calls", "capacity": 100, "window": "total"}]}"#,
    )
    .await;
    assert_eq!(put.status, StatusCode::OK, "{}", put.text);
    let id = reserve(
        &w,
        None,
        r#"{"tenant": "acme", "scopes": {"task": "t9"}, "amounts": {"search_calls": 4}}"#,
    )
    .await;
    settle(
        &w,
        None,
        &id,
        r#"{"usage": {"search_calls": 2},
            "charges": [{"name": "search", "cost_micros": 5000, "amounts": {"search_calls": 1}}]}"#,
    )
    .await;
    adjust(
        &w,
        None,
        "tenant:acme/task:t9",
        r#"{"dimension": "search_calls", "amount": 50, "reason": "bonus"}"#,
    )
    .await;
    let a = usage(&w, "", None).await;
    let lines = a.lines();
    assert_eq!(
        lines[0]["held"],
        json!({"requests": 1, "concurrent": 1, "search_calls": 4})
    );
    assert_eq!(
        lines[0]["charged"],
        json!({"requests": 1, "cost_micros": 5000, "search_calls": 3})
    );
    assert_eq!(
        (&lines[1]["dimension"], &lines[1]["credit"]),
        (&json!("search_calls"), &json!(50))
    );
    // The reservation object and the usage record render amounts alike.
    let get = call(&w.state, "GET", &format!("/v1/reservations/{id}"), None, "").await;
    assert_eq!(get.json()["charged"], lines[0]["charged"]);
    assert_eq!(get.json()["held"], lines[0]["held"]);
}

#[tokio::test]
async fn documented_in_openapi_and_counted_in_metrics() {
    let w = world(false);
    assert_eq!(usage(&w, "", None).await.status, StatusCode::OK);
    let doc = call(&w.state, "GET", "/openapi.json", None, "")
        .await
        .json();
    let get = &doc["paths"]["/v1/usage"]["get"];
    assert!(get.is_object(), "no GET /v1/usage in the document");
    let ok = &get["responses"]["200"];
    assert!(ok["content"]["application/x-ndjson"].is_object(), "{ok}");
    assert!(ok["headers"]["X-Next-Cursor"].is_object(), "{ok}");
    let names: Vec<&str> = get["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["since", "limit"]);
    let metrics = call(&w.state, "GET", "/metrics", None, "").await.text;
    assert!(
        metrics.contains(r#"allowance_operations_total{op="usage",outcome="ok"}"#),
        "{metrics}"
    );
}

type Fut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// An embedded store whose usage log does not answer.
struct NoUsage(EmbeddedStore);

// `Store` is an `async_trait`; this crate does not depend on the macro, so
// the methods are written as it expands them.
impl Store for NoUsage {
    fn reserve<'s, 'r, 'f>(
        &'s self,
        req: &'r ReserveRequest,
    ) -> Fut<'f, Result<Granted, StoreError<ReserveError>>>
    where
        's: 'f,
        'r: 'f,
        Self: 'f,
    {
        self.0.reserve(req)
    }
    fn settle<'s, 'u, 'f>(
        &'s self,
        id: ReservationId,
        usage: &'u Usage,
    ) -> Fut<'f, Result<Reservation, StoreError<SettleError>>>
    where
        's: 'f,
        'u: 'f,
        Self: 'f,
    {
        self.0.settle(id, usage)
    }
    fn refund<'s, 'f>(
        &'s self,
        id: ReservationId,
    ) -> Fut<'f, Result<Reservation, StoreError<RefundError>>>
    where
        's: 'f,
        Self: 'f,
    {
        self.0.refund(id)
    }
    fn extend<'s, 'a, 'f>(
        &'s self,
        id: ReservationId,
        amounts: Option<&'a Amounts>,
        ttl_ms: Option<u64>,
    ) -> Fut<'f, Result<Reservation, StoreError<ExtendError>>>
    where
        's: 'f,
        'a: 'f,
        Self: 'f,
    {
        self.0.extend(id, amounts, ttl_ms)
    }
    fn get<'s, 'f>(&'s self, id: ReservationId) -> Fut<'f, Result<Option<Reservation>, Unavailable>>
    where
        's: 'f,
        Self: 'f,
    {
        self.0.get(id)
    }
    fn status<'s, 'k, 'f>(
        &'s self,
        scope: &'k ScopeKey,
    ) -> Fut<'f, Result<ScopeStatus, Unavailable>>
    where
        's: 'f,
        'k: 'f,
        Self: 'f,
    {
        self.0.status(scope)
    }
    fn adjust<'s, 'k, 'r, 'f>(
        &'s self,
        scope: &'k ScopeKey,
        dimension: Dimension,
        credit: i64,
        reason: &'r str,
    ) -> Fut<'f, Result<ScopeStatus, StoreError<AdminError>>>
    where
        's: 'f,
        'k: 'f,
        'r: 'f,
        Self: 'f,
    {
        self.0.adjust(scope, dimension, credit, reason)
    }
    fn catalog<'s, 'f>(&'s self) -> Fut<'f, Result<Arc<Catalog>, Unavailable>>
    where
        's: 'f,
        Self: 'f,
    {
        self.0.catalog()
    }
    fn change_catalog<'s, 'c, 'f>(
        &'s self,
        change: &'c CatalogChange,
    ) -> Fut<'f, Result<(), StoreError<AdminError>>>
    where
        's: 'f,
        'c: 'f,
        Self: 'f,
    {
        self.0.change_catalog(change)
    }
    fn expire_due<'s, 'f>(&'s self) -> Fut<'f, Result<u64, Unavailable>>
    where
        's: 'f,
        Self: 'f,
    {
        self.0.expire_due()
    }
    fn stats<'s, 'f>(&'s self) -> Fut<'f, Result<StoreStats, Unavailable>>
    where
        's: 'f,
        Self: 'f,
    {
        self.0.stats()
    }
    fn usage<'s, 't, 'f>(
        &'s self,
        _since: Option<u64>,
        _limit: usize,
        _tenant: Option<&'t str>,
    ) -> Fut<'f, Result<UsagePage, Unavailable>>
    where
        's: 'f,
        't: 'f,
        Self: 'f,
    {
        Box::pin(async { Err(Unavailable("the usage log is fenced".into())) })
    }
}

#[tokio::test]
async fn an_unavailable_store_is_the_usual_503() {
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(START_MS)));
    let store = NoUsage(EmbeddedStore::new(
        allowance_config::starter().catalog.clone(),
        1,
        clock.clone(),
        Arc::new(SeededIds::new(1)),
    ));
    let state = AppState::with_clock(
        Arc::new(store),
        Credentials::default(),
        Options::default(),
        clock,
    );
    let a = call(&state, "GET", "/v1/usage?since=3", None, "").await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        a.json(),
        json!({"error": {"type": "store_unavailable", "message": "the usage log is fenced"}})
    );
    assert_eq!(a.next, None);
}
