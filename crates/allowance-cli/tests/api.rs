//! Every data-plane and admin endpoint over real HTTP against the real
//! binary: exact bodies and headers, every denial type, the seed 000
//! walkthrough.
mod common;

use std::collections::BTreeSet;

use common::*;
use serde_json::{Value, json};

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object().expect("an object").keys().cloned().collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn ms(t: &Value) -> i64 {
    let s = t.as_str().expect("a time string");
    let ts: jiff::Timestamp = s.parse().expect("RFC 3339");
    assert!(
        s.ends_with('Z') && s.len() == 24,
        "UTC with milliseconds: {s}"
    );
    ts.as_millisecond()
}

#[tokio::test]
async fn reserve_answers_the_reservation_remaining_and_headers() {
    let s = Server::start();
    // Raw text: `json!` would sort the keys, and the scopes' order matters.
    let body = r#"{"tenant": "acme", "scopes": {"user": "bob", "agent": "planner-7"},
                   "amounts": {"input_tokens": 3000, "output_tokens": 1000},
                   "model": "gpt-4o", "labels": {"task": "summarise"}}"#;
    let r = s
        .send(
            "POST",
            "/v1/reservations",
            None,
            Some(body),
            Some("application/json"),
        )
        .await
        .expect(201);
    let b = &r.json;
    assert_eq!(
        keys(b),
        set(&[
            "id",
            "status",
            "tenant",
            "scopes",
            "model",
            "labels",
            "held",
            "created_at",
            "expires_at",
            "remaining"
        ])
    );
    assert!(b["id"].as_str().unwrap().starts_with("rsv_"));
    assert_eq!(b["id"].as_str().unwrap().len(), 36);
    assert_eq!(b["status"], "held");
    assert_eq!(b["tenant"], "acme");
    assert_eq!(
        b["scopes"],
        json!([
            "tenant:acme",
            "tenant:acme/user:bob",
            "tenant:acme/agent:planner-7"
        ])
    );
    assert_eq!(b["model"], "gpt-4o");
    assert_eq!(b["labels"], json!({"task": "summarise"}));
    // 3000 × 2.50 + 1000 × 10.00 per million = 0.0175 → 17,500 µ.
    assert_eq!(
        b["held"],
        json!({"requests": 1, "concurrent": 1, "input_tokens": 3000, "output_tokens": 1000,
               "tokens": 4000, "cost_micros": 17500})
    );
    assert_eq!(ms(&b["expires_at"]) - ms(&b["created_at"]), 300_000);
    // Every limit of every scope: tenant 2, user 4, agent 3.
    let rem = b["remaining"].as_array().unwrap();
    assert_eq!(rem.len(), 9);
    for item in rem {
        assert_eq!(
            keys(item),
            set(&[
                "scope",
                "dimension",
                "window",
                "capacity",
                "remaining",
                "resets_at"
            ])
        );
    }
    let user_tokens = rem
        .iter()
        .find(|x| x["scope"] == "tenant:acme/user:bob" && x["dimension"] == "tokens")
        .unwrap();
    assert_eq!(
        (
            &user_tokens["window"],
            &user_tokens["capacity"],
            &user_tokens["remaining"]
        ),
        (&json!("sliding"), &json!(200_000), &json!(196_000))
    );
    // The tightest limit is the agent's concurrency: 1 of 2 left (0.5).
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"agent-concurrent\";q=2")
    );
    let state = r.header("ratelimit").unwrap();
    assert!(
        state.starts_with("\"agent-concurrent\";r=1;t=30"),
        "{state}"
    );
    // The least room among tokens limits (agent: 100,000 − 4,000), and requests
    // (agent bucket: 30 − 1).
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("96000"));
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("29"));

    // GET answers the reservation object, without `remaining`.
    let id = b["id"].as_str().unwrap();
    let g = s
        .get(&format!("/v1/reservations/{id}"), None)
        .await
        .expect(200);
    let mut expected = b.clone();
    expected.as_object_mut().unwrap().remove("remaining");
    assert_eq!(g.json, expected);
}

#[tokio::test]
async fn settle_refund_extend_and_their_repeats() {
    let s = Server::start();
    let reserve = |amounts: Value| {
        let s = &s;
        async move {
            s.post(
                "/v1/reservations",
                None,
                &json!({"tenant": "acme", "scopes": {"user": "ann"}, "amounts": amounts}),
            )
            .await
            .expect(201)
            .json["id"]
                .as_str()
                .unwrap()
                .to_string()
        }
    };

    // Settle, then the same settle again: JSON-equal answers.
    let id = reserve(json!({"input_tokens": 1000, "output_tokens": 500})).await;
    let body = json!({"usage": {"input_tokens": 900, "output_tokens": 300},
                      "charges": [{"name": "search", "cost_micros": 5000}]});
    let first = s
        .post(&format!("/v1/reservations/{id}/settle"), None, &body)
        .await
        .expect(200);
    assert_eq!(first.json["status"], "settled");
    assert_eq!(first.json["late"], false);
    assert!(first.json["ended_at"].is_string());
    assert_eq!(
        first.json["charged"],
        json!({"requests": 1, "input_tokens": 900, "output_tokens": 300, "tokens": 1200,
               "cost_micros": 5000})
    );
    let again = s
        .post(&format!("/v1/reservations/{id}/settle"), None, &body)
        .await
        .expect(200);
    assert_eq!(first.json, again.json);
    // Refund of a settled reservation: 409 naming its status.
    let c = s
        .send(
            "POST",
            &format!("/v1/reservations/{id}/refund"),
            None,
            None,
            None,
        )
        .await
        .expect(409);
    assert_eq!(c.error_type(), "conflict");
    assert_eq!(c.json["error"]["status"], "settled");

    // Refund (no body, and `{}`), repeat, then settle → 409.
    let id = reserve(json!({"input_tokens": 10})).await;
    let r1 = s
        .send(
            "POST",
            &format!("/v1/reservations/{id}/refund"),
            None,
            None,
            None,
        )
        .await
        .expect(200);
    assert_eq!(r1.json["status"], "refunded");
    assert!(r1.json.get("charged").is_none());
    let r2 = s
        .post(&format!("/v1/reservations/{id}/refund"), None, &json!({}))
        .await
        .expect(200);
    assert_eq!(r1.json, r2.json);
    let c = s
        .post(
            &format!("/v1/reservations/{id}/settle"),
            None,
            &json!({"usage": {}}),
        )
        .await
        .expect(409);
    assert_eq!(c.json["error"]["status"], "refunded");

    // Extend amounts and ttl; then an extension past the user's tokens cap
    // is denied and leaves the hold as it was.
    let id = reserve(json!({"input_tokens": 1000})).await;
    let before = s
        .get(&format!("/v1/reservations/{id}"), None)
        .await
        .expect(200);
    let e = s
        .post(
            &format!("/v1/reservations/{id}/extend"),
            None,
            &json!({"amounts": {"output_tokens": 500}, "ttl_ms": 600_000}),
        )
        .await
        .expect(200);
    assert_eq!(e.json["held"]["output_tokens"], 500);
    assert_eq!(e.json["held"]["tokens"], 1500);
    assert!(ms(&e.json["expires_at"]) > ms(&before.json["expires_at"]));
    let d = s
        .post(
            &format!("/v1/reservations/{id}/extend"),
            None,
            &json!({"amounts": {"output_tokens": 250_000}}),
        )
        .await
        .expect(422);
    assert_eq!(d.error_type(), "exceeds_limit");
    let after = s
        .get(&format!("/v1/reservations/{id}"), None)
        .await
        .expect(200);
    assert_eq!(after.json, e.json, "a refused extension changes nothing");
    // `{}` is a 400; an ended reservation is a 409.
    let bad = s
        .post(&format!("/v1/reservations/{id}/extend"), None, &json!({}))
        .await
        .expect(400);
    assert_eq!(bad.error_type(), "invalid_request");
    s.send(
        "POST",
        &format!("/v1/reservations/{id}/refund"),
        None,
        None,
        None,
    )
    .await
    .expect(200);
    let c = s
        .post(
            &format!("/v1/reservations/{id}/extend"),
            None,
            &json!({"ttl_ms": 1000}),
        )
        .await
        .expect(409);
    assert_eq!(c.json["error"]["status"], "refunded");

    // Unknown ids: 404 for every route.
    let unknown = "rsv_0123456789abcdef0123456789abcdef";
    s.get(&format!("/v1/reservations/{unknown}"), None)
        .await
        .expect(404);
    for op in ["settle", "refund", "extend"] {
        let r = s
            .post(
                &format!("/v1/reservations/{unknown}/{op}"),
                None,
                &json!({"usage": {}, "ttl_ms": 1}),
            )
            .await;
        // settle/extend bodies carry a field the other does not: only the
        // routes whose body fits reach the lookup.
        assert!(r.status == 404 || r.status == 400, "{op}: {}", r.json);
    }
}

#[tokio::test]
async fn dry_run_and_idempotency() {
    let s = Server::start();
    let body = json!({"tenant": "acme", "scopes": {"user": "dry"}, "amounts": {"input_tokens": 500},
                      "dry_run": true});
    let before = s
        .get("/v1/scopes/tenant:acme/user:dry", None)
        .await
        .expect(200);
    let d = s.post("/v1/reservations", None, &body).await.expect(200);
    assert_eq!(d.json["status"], "dry_run");
    assert!(d.json.get("id").is_none());
    assert!(d.json["remaining"].is_array());
    let after = s
        .get("/v1/scopes/tenant:acme/user:dry", None)
        .await
        .expect(200);
    assert_eq!(before.json, after.json, "a dry run holds nothing");

    let keyed = json!({"tenant": "acme", "amounts": {"input_tokens": 10},
                       "idempotency_key": "run42:t7"});
    let a = s.post("/v1/reservations", None, &keyed).await.expect(201);
    let b = s.post("/v1/reservations", None, &keyed).await.expect(200);
    assert_eq!(b.json["replayed"], true);
    assert_eq!(a.json["id"], b.json["id"]);
    assert!(b.json.get("remaining").is_none());
    let other = json!({"tenant": "acme", "amounts": {"input_tokens": 11},
                       "idempotency_key": "run42:t7"});
    let c = s.post("/v1/reservations", None, &other).await.expect(409);
    assert_eq!(c.error_type(), "conflict");
}

#[tokio::test]
async fn every_denial_type_with_its_headers() {
    let s = Server::start();
    // rate_limited: the user may hold 4 at once (concurrent gauge).
    let hold = json!({"tenant": "acme", "scopes": {"user": "busy"}, "amounts": {"input_tokens": 1},
                      "ttl_ms": 60_000});
    for _ in 0..4 {
        s.post("/v1/reservations", None, &hold).await.expect(201);
    }
    let d = s.post("/v1/reservations", None, &hold).await.expect(429);
    let e = &d.json["error"];
    assert_eq!(
        keys(e),
        set(&[
            "type",
            "message",
            "scope",
            "dimension",
            "window",
            "capacity",
            "remaining",
            "requested",
            "retry_after_ms",
            "resets_at"
        ])
    );
    assert_eq!(e["type"], "rate_limited");
    assert_eq!(e["scope"], "tenant:acme/user:busy");
    assert_eq!(e["dimension"], "concurrent");
    assert_eq!(e["window"], "concurrent");
    assert_eq!(
        (&e["capacity"], &e["remaining"], &e["requested"]),
        (&json!(4), &json!(0), &json!(1))
    );
    let retry_ms = e["retry_after_ms"].as_u64().unwrap();
    assert!(
        retry_ms > 50_000 && retry_ms <= 60_000,
        "the first hold ends: {retry_ms}"
    );
    assert_eq!(
        d.header("retry-after"),
        Some(retry_ms.div_ceil(1000).to_string().as_str())
    );
    assert_eq!(d.header("x-budget-scope"), Some("tenant:acme/user:busy"));
    assert_eq!(d.header("x-budget-dimension"), Some("concurrent"));
    assert_eq!(
        d.header("ratelimit-policy"),
        Some("\"user-concurrent\";q=4")
    );
    assert_eq!(
        d.header("ratelimit"),
        Some(format!("\"user-concurrent\";r=0;t={}", retry_ms.div_ceil(1000)).as_str())
    );

    // exceeds_limit: more than the user's whole hourly tokens capacity.
    let d = s
        .post(
            "/v1/reservations",
            None,
            &json!({"tenant": "acme", "scopes": {"user": "big"}, "amounts": {"input_tokens": 200_001}}),
        )
        .await
        .expect(422);
    assert_eq!(d.error_type(), "exceeds_limit");
    assert_eq!(d.json["error"]["retry_after_ms"], Value::Null);
    assert_eq!(d.json["error"]["requested"], 200_001);
    assert!(d.header("retry-after").is_none(), "no retry helps");
    assert_eq!(d.header("x-budget-dimension"), Some("tokens"));
    assert_eq!(
        d.header("ratelimit-policy"),
        Some("\"user-tokens\";q=200000;w=3600")
    );

    // budget_exhausted: a task's total cost budget (5,000,000 µ) spent.
    let spend =
        json!({"tenant": "acme", "scopes": {"task": "t1"}, "amounts": {"cost_micros": 4_000_000}});
    let id = s
        .post("/v1/reservations", None, &spend)
        .await
        .expect(201)
        .json["id"]
        .as_str()
        .unwrap()
        .to_string();
    s.post(
        &format!("/v1/reservations/{id}/settle"),
        None,
        &json!({"usage": {"cost_micros": 4_500_000}}),
    )
    .await
    .expect(200);
    let more =
        json!({"tenant": "acme", "scopes": {"task": "t1"}, "amounts": {"cost_micros": 1_000_000}});
    let d = s.post("/v1/reservations", None, &more).await.expect(402);
    assert_eq!(d.error_type(), "budget_exhausted");
    assert_eq!(d.json["error"]["scope"], "tenant:acme/task:t1");
    assert_eq!(d.json["error"]["remaining"], 500_000);
    assert_eq!(d.json["error"]["retry_after_ms"], Value::Null);
    assert_eq!(
        d.header("ratelimit-policy"),
        Some("\"task-cost_micros\";q=5000000")
    );
    // An admin credit makes room again (audited), and the status shows it.
    let a = s
        .post(
            "/v1/scopes/tenant:acme/task:t1/adjust",
            None,
            &json!({"dimension": "cost_micros", "amount": 1_000_000, "reason": "goodwill"}),
        )
        .await
        .expect(200);
    let cost = a.json["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["dimension"] == "cost_micros")
        .unwrap()
        .clone();
    assert_eq!(
        (&cost["used"], &cost["remaining"]),
        (&json!(3_500_000), &json!(1_500_000))
    );
    s.post("/v1/reservations", None, &more).await.expect(201);
    assert!(s.log_has("goodwill"), "the adjustment is in the log");
}

#[tokio::test]
async fn scope_status_plans_overrides() {
    let s = Server::start();
    // A scope never used answers its plan with zero use; raw or encoded path.
    let raw = s
        .get("/v1/scopes/tenant:acme/user:new", None)
        .await
        .expect(200);
    let enc = s
        .get("/v1/scopes/tenant%3Aacme%2Fuser%3Anew", None)
        .await
        .expect(200);
    assert_eq!(raw.json, enc.json);
    assert_eq!(
        raw.json,
        json!({"scope": "tenant:acme/user:new", "plan": "user-default", "held_reservations": 0,
               "limits": [
                 {"dimension": "requests", "window": "bucket", "period_ms": 60000, "capacity": 60,
                  "used": 0, "held": 0, "remaining": 60, "resets_at": null},
                 {"dimension": "tokens", "window": "sliding", "period_ms": 3600000, "slices": 60,
                  "capacity": 200000, "used": 0, "held": 0, "remaining": 200000, "resets_at": null},
                 {"dimension": "cost_micros", "window": "sliding", "period_ms": 86400000, "slices": 24,
                  "capacity": 20000000, "used": 0, "held": 0, "remaining": 20000000, "resets_at": null},
                 {"dimension": "concurrent", "window": "concurrent", "capacity": 4,
                  "used": 0, "held": 0, "remaining": 4, "resets_at": null}]})
    );

    // Plans: list, define, move a scope to it, its own limits, back.
    let plans = s.get("/v1/plans", None).await.expect(200);
    let names: Vec<&str> = plans.json["plans"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "agent-default",
            "task-default",
            "tenant-default",
            "tool-default",
            "user-default"
        ]
    );
    let tiny = json!({"limits": [{"dimension": "tokens", "capacity": 100, "window": "sliding",
                                  "period_ms": 60000, "slices": 60}]});
    let p = s.put("/v1/plans/tiny", None, &tiny).await.expect(200);
    assert_eq!(p.json["name"], "tiny");
    assert_eq!(p.json["limits"], tiny["limits"]);
    let moved = s
        .put(
            "/v1/scopes/tenant:acme/user:new",
            None,
            &json!({"plan": "tiny"}),
        )
        .await
        .expect(200);
    assert_eq!(moved.json["plan"], "tiny");
    let d = s
        .post(
            "/v1/reservations",
            None,
            &json!({"tenant": "acme", "scopes": {"user": "new"}, "amounts": {"input_tokens": 101}}),
        )
        .await
        .expect(422);
    assert_eq!(d.json["error"]["capacity"], 100);
    // Its own limits, with a custom dimension new to the catalog.
    let own = json!({"limits": [{"dimension": "search_calls", "capacity": 3, "window": "total"}]});
    let o = s
        .put("/v1/scopes/tenant:acme/user:new", None, &own)
        .await
        .expect(200);
    assert_eq!(o.json["limits"][0]["dimension"], "search_calls");
    let ok = json!({"tenant": "acme", "scopes": {"user": "new"}, "amounts": {"search_calls": 3}});
    s.post("/v1/reservations", None, &ok).await.expect(201);
    s.post("/v1/reservations", None, &ok).await.expect(429);
    // Back to the kind's default plan; a second delete finds no override.
    let back = s
        .send(
            "DELETE",
            "/v1/scopes/tenant:acme/user:new/override",
            None,
            None,
            None,
        )
        .await
        .expect(200);
    assert_eq!(back.json["plan"], "user-default");
    s.send(
        "DELETE",
        "/v1/scopes/tenant:acme/user:new/override",
        None,
        None,
        None,
    )
    .await
    .expect(404);
}

#[tokio::test]
async fn operations_routes() {
    let s = Server::start();
    s.post(
        "/v1/reservations",
        None,
        &json!({"tenant": "secret-tenant", "amounts": {"input_tokens": 1}}),
    )
    .await
    .expect(201);
    s.post(
        "/v1/reservations",
        None,
        &json!({"tenant": "secret-tenant", "scopes": {"user": "u"}, "amounts": {"input_tokens": 999_999}}),
    )
    .await
    .expect(422);
    let m = s.get("/metrics", None).await.expect(200);
    let text = m.json.as_str().unwrap();
    assert!(
        text.contains("allowance_operations_total{op=\"reserve\",outcome=\"ok\"} 1"),
        "{text}"
    );
    assert!(
        text.contains(
            "allowance_denials_total{scope_kind=\"user\",dimension=\"tokens\",type=\"exceeds_limit\"} 1"
        ),
        "{text}"
    );
    assert!(text.contains("allowance_held_reservations 1"), "{text}");
    assert!(
        text.contains("allowance_operation_duration_seconds_bucket"),
        "{text}"
    );
    assert!(!text.contains("secret-tenant"), "no scope ids in metrics");

    let doc = s.get("/openapi.json", None).await.expect(200).json;
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    for path in [
        "/v1/reservations",
        "/v1/reservations/{id}",
        "/v1/reservations/{id}/settle",
        "/v1/reservations/{id}/refund",
        "/v1/reservations/{id}/extend",
        "/v1/scopes/{scope}",
        "/v1/scopes/{scope}/override",
        "/v1/scopes/{scope}/adjust",
        "/v1/plans",
        "/v1/plans/{name}",
        "/healthz",
        "/readyz",
        "/metrics",
    ] {
        assert!(
            doc["paths"].get(path).is_some(),
            "{path} missing from the OpenAPI document"
        );
    }
    assert!(doc["components"]["schemas"].get("ReserveBody").is_some());

    // The error object: one schema every error matches, the denial's fields
    // optional in it (not `allOf` a denial-or-null, which only denials match).
    let schemas = &doc["components"]["schemas"];
    let error = &schemas["ErrorObject"];
    assert!(error.get("allOf").is_none(), "{error}");
    assert_eq!(error["required"], json!(["type", "message"]));
    for field in ["field", "scope", "dimension", "retry_after_ms", "status"] {
        assert!(error["properties"].get(field).is_some(), "{field}: {error}");
    }
    // A plan as answered: its spec's fields and its name, in one object.
    let view = &schemas["PlanView"];
    assert!(view.get("allOf").is_none(), "{view}");
    assert!(view["properties"].get("name").is_some() && view["properties"].get("limits").is_some());
    // Errors the shared extractors give are documented on every route.
    let reserve = &doc["paths"]["/v1/reservations"]["post"]["responses"];
    for status in ["400", "401", "403", "413", "415", "503"] {
        assert!(reserve.get(status).is_some(), "{status}: {reserve}");
    }
    assert_eq!(
        doc["paths"]["/v1/reservations/{id}/refund"]["post"]["requestBody"]["required"],
        json!(false)
    );
    let tenant = &schemas["ReserveBody"]["properties"]["tenant"]["pattern"];
    assert_eq!(tenant, &json!("^[A-Za-z0-9._~@+=-]{1,128}$"));
    let reason = &schemas["AdjustBody"]["properties"]["reason"];
    assert_eq!(
        (&reason["minLength"], &reason["maxLength"]),
        (&json!(1), &json!(1024)),
        "{reason}"
    );
    assert_eq!(reserve["413"]["description"], "The body is over 64 KiB");
    // Every path parameter naming a reservation or a scope has its pattern.
    for (path, method) in [
        ("/v1/reservations/{id}/settle", "post"),
        ("/v1/scopes/{scope}/adjust", "post"),
    ] {
        let pattern = &doc["paths"][path][method]["parameters"][0]["schema"]["pattern"];
        assert!(
            pattern.as_str().is_some_and(|p| p.starts_with('^')),
            "{path}: {pattern}"
        );
    }

    let nf = s.get("/v1/nothing-here", None).await.expect(404);
    assert_eq!(nf.error_type(), "not_found");
}

/// A method a path does not take: 404 `not_found` (HTTP-API.md's error types
/// have no 405), with an `Allow` that lists what that resource takes — for a
/// scope's sub-resources too, which share one wildcard route.
#[tokio::test]
async fn a_method_a_path_does_not_take_answers_404_with_its_allow() {
    let s = Server::start();
    for (method, path, allow) in [
        ("DELETE", "/v1/reservations", "POST"),
        ("PUT", "/v1/scopes/tenant:acme/adjust", "POST"),
        ("OPTIONS", "/v1/scopes/tenant:acme/adjust", "POST"),
        ("GET", "/v1/scopes/tenant:acme/override", "DELETE"),
        ("POST", "/v1/scopes/tenant:acme/user:bob", "GET,HEAD,PUT"),
        ("OPTIONS", "/v1/scopes/tenant%3Aacme", "GET,HEAD,PUT"),
    ] {
        let r = s.send(method, path, None, None, None).await.expect(404);
        assert_eq!(r.error_type(), "not_found", "{method} {path}");
        assert_eq!(r.header("allow"), Some(allow), "{method} {path}");
    }
}

/// Seed 000 over HTTP: agents 1,000 and tenant 1,500 tokens an hour.
#[tokio::test]
async fn seed_000_walkthrough() {
    let config = r#"
[reservations]
default_ttl_ms = 300_000
[kinds.tenant]
plan = "tenant"
[kinds.agent]
plan = "agent"
[plans.tenant]
limits = [{ dimension = "tokens", capacity = 1500, window = "sliding", period = "1h", slices = 60 }]
[plans.agent]
limits = [{ dimension = "tokens", capacity = 1000, window = "sliding", period = "1h", slices = 60 }]
"#;
    let s = Server::with_config(config);
    let reserve = |agent: &'static str, n: u64, ttl_ms: u64| {
        let s = &s;
        async move {
            s.post(
                "/v1/reservations",
                None,
                &json!({"tenant": "t", "scopes": {"agent": agent}, "amounts": {"tokens": n},
                        "ttl_ms": ttl_ms}),
            )
            .await
        }
    };
    let remaining = |scope: &'static str| {
        let s = &s;
        async move {
            s.get(&format!("/v1/scopes/{scope}"), None)
                .await
                .expect(200)
                .json["limits"][0]["remaining"]
                .as_i64()
                .unwrap()
        }
    };
    let r1 = reserve("a1", 1000, 300_000).await.expect(201).json["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(remaining("tenant:t/agent:a1").await, 0);
    assert_eq!(remaining("tenant:t").await, 500);
    let d = reserve("a2", 600, 300_000).await.expect(429);
    assert_eq!(d.json["error"]["scope"], "tenant:t");
    assert_eq!(
        (
            &d.json["error"]["capacity"],
            &d.json["error"]["remaining"],
            &d.json["error"]["requested"]
        ),
        (&json!(1500), &json!(500), &json!(600))
    );
    let retry = d.json["error"]["retry_after_ms"].as_u64().unwrap();
    assert!(
        retry > 290_000 && retry <= 300_000,
        "the hold ends in 5 minutes: {retry}"
    );
    assert_eq!(remaining("tenant:t/agent:a2").await, 1000);

    let settle = json!({"usage": {"tokens": 700}});
    let first = s
        .post(&format!("/v1/reservations/{r1}/settle"), None, &settle)
        .await
        .expect(200);
    let again = s
        .post(&format!("/v1/reservations/{r1}/settle"), None, &settle)
        .await
        .expect(200);
    assert_eq!(first.json, again.json);
    assert_eq!(remaining("tenant:t/agent:a1").await, 300);
    assert_eq!(remaining("tenant:t").await, 800);

    let r2 = reserve("a1", 100, 300_000).await.expect(201).json["id"]
        .as_str()
        .unwrap()
        .to_string();
    for _ in 0..2 {
        let r = s
            .send(
                "POST",
                &format!("/v1/reservations/{r2}/refund"),
                None,
                None,
                None,
            )
            .await
            .expect(200);
        assert_eq!(r.json["status"], "refunded");
    }
    assert_eq!(remaining("tenant:t/agent:a1").await, 300);

    // The agent crashes: its hold (a short TTL here) expires on its own.
    let r3 = reserve("a1", 200, 300).await.expect(201).json["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(remaining("tenant:t/agent:a1").await, 100);
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    assert_eq!(remaining("tenant:t/agent:a1").await, 300);
    let g = s
        .get(&format!("/v1/reservations/{r3}"), None)
        .await
        .expect(200);
    assert_eq!(g.json["status"], "expired");
    let late = s
        .post(
            &format!("/v1/reservations/{r3}/settle"),
            None,
            &json!({"usage": {"tokens": 50}}),
        )
        .await
        .expect(200);
    assert_eq!(
        (&late.json["status"], &late.json["late"]),
        (&json!("settled"), &json!(true))
    );
    assert_eq!(remaining("tenant:t/agent:a1").await, 250);
    assert_eq!(remaining("tenant:t").await, 750);
    // (The last step of the seed — everything leaving the hour — is the
    // engine's test, on a manual clock.)
}

/// A reservation's `held`, sent back as a reserve's `amounts` (or the
/// implied `requests: 1` in a settle's usage), is accepted: the implied
/// dimensions may say what they are. Any other value is a 400 (bad_input.rs).
#[tokio::test]
async fn held_amounts_sent_back_are_accepted() {
    let s = Server::start();
    let first = s
        .post(
            "/v1/reservations",
            None,
            &json!({"tenant": "acme", "amounts": {"input_tokens": 10}}),
        )
        .await
        .expect(201);
    let again = s
        .post(
            "/v1/reservations",
            None,
            &json!({"tenant": "acme", "amounts": first.json["held"]}),
        )
        .await
        .expect(201);
    assert_eq!(again.json["held"], first.json["held"]);
    let id = again.json["id"].as_str().unwrap();
    let settled = s
        .post(
            &format!("/v1/reservations/{id}/settle"),
            None,
            &json!({"usage": {"requests": 1, "input_tokens": 8}}),
        )
        .await
        .expect(200);
    assert_eq!(settled.json["charged"]["requests"], 1, "{}", settled.json);
}

/// A reserve naming a priced model and no output bound holds the model's
/// `max_output_tokens` (gpt-4o: 16,384 in the starter) and its cost; an
/// explicit `output_tokens` (0 included), `tokens` or `cost_micros` is the
/// caller's own estimate and is kept as given. (Found by an audit: the
/// bound was held by the gateway only, so such a reserve held no output.)
#[tokio::test]
async fn a_model_without_an_output_bound_holds_the_models() {
    let s = Server::start();
    let held = |amounts: Value| {
        let s = &s;
        async move {
            s.post(
                "/v1/reservations",
                None,
                &json!({"tenant": "acme", "model": "gpt-4o", "amounts": amounts}),
            )
            .await
            .expect(201)
            .json["held"]
                .clone()
        }
    };
    let h = held(json!({"input_tokens": 100})).await;
    assert_eq!(h["output_tokens"], 16_384, "{h}");
    assert_eq!(h["tokens"], 16_484, "{h}");
    // 100 × 2.50 + 16,384 × 10.00 per million, rounded up: 164,090.
    assert_eq!(h["cost_micros"], 164_090, "{h}");
    let h = held(json!({"input_tokens": 100, "output_tokens": 0})).await;
    assert_eq!(
        (h.get("output_tokens"), &h["tokens"]),
        (None, &json!(100)),
        "{h}"
    );
    assert_eq!(h["cost_micros"], 250, "{h}");
    let h = held(json!({"input_tokens": 100, "tokens": 500})).await;
    assert_eq!(
        (h.get("output_tokens"), &h["tokens"]),
        (None, &json!(500)),
        "{h}"
    );
    let h = held(json!({"input_tokens": 100, "cost_micros": 9})).await;
    assert_eq!(
        (h.get("output_tokens"), &h["cost_micros"]),
        (None, &json!(9)),
        "{h}"
    );
    // Without a model there is no bound to hold.
    let r = s
        .post(
            "/v1/reservations",
            None,
            &json!({"tenant": "acme", "amounts": {"input_tokens": 100}}),
        )
        .await
        .expect(201);
    assert_eq!(r.json["held"].get("output_tokens"), None, "{}", r.json);
}

/// `DELETE /v1/plans/{name}` returns a plan the admin API set to the
/// configuration file's version (answered as the plan now in force); a
/// plan the file does not have has none to return to (404).
#[tokio::test]
async fn a_plan_set_through_the_api_returns_to_the_files_on_delete() {
    let s = Server::start();
    let plans = s.get("/v1/plans", None).await.expect(200).json;
    let file_version = plans["plans"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["name"] == "user-default"))
        .cloned()
        .expect("the starter's user-default plan");
    let seven = json!({"limits": [{"dimension": "requests", "capacity": 7, "window": "bucket", "period_ms": 60000}]});
    s.put("/v1/plans/user-default", None, &seven)
        .await
        .expect(200);
    let reverted = s
        .send("DELETE", "/v1/plans/user-default", None, None, None)
        .await
        .expect(200)
        .json;
    assert_eq!(reverted, file_version);
    let again = s.get("/v1/plans", None).await.expect(200).json;
    assert!(
        again["plans"]
            .as_array()
            .expect("plans")
            .contains(&file_version),
        "{again}"
    );
    s.put("/v1/plans/api-only", None, &seven).await.expect(200);
    let missing = s
        .send("DELETE", "/v1/plans/api-only", None, None, None)
        .await
        .expect(404);
    assert_eq!(
        missing.json["error"]["type"], "not_found",
        "{}",
        missing.json
    );
}

/// A reserve refused because the admission queue is full is a denial on
/// the dashboards like any other (it was counted only as
/// `allowance_queue_full_total`, found by an audit).
#[tokio::test]
async fn a_full_queue_s_denial_is_counted_with_the_denials() {
    let s = Server::with_config(
        "[queue]\nmax_waiters_per_tenant = 1\n[kinds.tenant]\nplan = \"one\"\n[plans.one]\nlimits = [{ dimension = \"concurrent\", capacity = 1 }]\n",
    );
    // A hold that expires within the waits, so they queue (a wait that
    // cannot end in room is refused at once).
    let body = json!({"tenant": "q", "amounts": {}, "ttl_ms": 4000});
    s.post("/v1/reservations", None, &body).await.expect(201);
    let waiting = json!({"tenant": "q", "amounts": {}, "wait_ms": 5000});
    let waiter = {
        let (base, waiting) = (s.base.clone(), waiting.clone());
        tokio::spawn(async move {
            reqwest::Client::new()
                .post(format!("{base}/v1/reservations"))
                .json(&waiting)
                .send()
                .await
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let m = s.get("/metrics", None).await.expect(200);
        if m.json
            .as_str()
            .unwrap_or_default()
            .contains("allowance_queue_depth 1")
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the waiter never queued"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let r = s.post("/v1/reservations", None, &waiting).await;
    assert_eq!(r.status, 429, "{:?}", r.json);
    assert_eq!(r.json["error"]["queue_full"], json!(true), "{:?}", r.json);
    let m = s.get("/metrics", None).await.expect(200);
    let text = m.json.as_str().unwrap();
    let denials: u64 = text
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                "allowance_denials_total{scope_kind=\"tenant\",dimension=\"concurrent\",type=\"rate_limited\"} ",
            )
        })
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    assert!(denials >= 1, "{text}");
    waiter.abort();
}
