//! Credentials and tenancy (HTTP-API.md "Credentials" and answer 3), tier
//! changes through the admin plane, and the refusal to run open on a
//! non-loopback address — all against the real binary.
mod common;
use common::*;

use std::time::Duration;

use serde_json::{Value, json};

/// A well-formed id no reservation has.
const UNKNOWN_ID: &str = "rsv_0123456789abcdef0123456789abcdef";

/// Asserts a refusal: status, type, and the error body's shape.
fn refused(r: &Reply, status: u16, kind: &str, what: &str) {
    assert_eq!(r.status, status, "{what}: {}", r.json);
    assert_eq!(r.error_type(), kind, "{what}: {}", r.json);
    assert!(
        r.json["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{what}: no message: {}",
        r.json
    );
}

async fn reserve(s: &Server, token: &str, body: Value) -> Reply {
    s.post("/v1/reservations", Some(token), &body).await
}

/// Sends `method path` with a raw Authorization header value (or none).
async fn with_auth(
    s: &Server,
    method: &str,
    path: &str,
    auth: Option<&str>,
    body: Option<&str>,
) -> Reply {
    let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
    let mut req = s.client.request(method, s.url(path));
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    if let Some(b) = body {
        req = req
            .header("content-type", "application/json")
            .body(b.to_string());
    }
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.expect("body");
    let json = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Reply {
        status,
        headers,
        json,
    }
}

#[tokio::test]
async fn tokens_roles_and_tenant_isolation() {
    let s = Server::with_tokens();

    // beta's reservation, which acme must not see in any way.
    let theirs = reserve(
        &s,
        BETA_TOKEN,
        json!({"tenant": "beta", "scopes": {"user": "bob"}, "amounts": {"tokens": 10}}),
    )
    .await
    .expect(201);
    let theirs = theirs.json["id"].as_str().expect("id").to_string();
    let mine = reserve(
        &s,
        ACME_TOKEN,
        json!({"tenant": "acme", "amounts": {"tokens": 10}}),
    )
    .await
    .expect(201);
    let mine = mine.json["id"].as_str().expect("id").to_string();

    // ---- 401: missing, unknown or malformed credentials, on every route
    // that needs one; checked before the body is even looked at.
    let routes: [(&str, String, Option<&str>); 11] = [
        (
            "POST",
            "/v1/reservations".into(),
            Some(r#"{"tenant": "acme", "amounts": {"tokens": 1}}"#),
        ),
        ("GET", format!("/v1/reservations/{mine}"), None),
        (
            "POST",
            format!("/v1/reservations/{mine}/settle"),
            Some(r#"{"usage": {"tokens": 1}}"#),
        ),
        ("POST", format!("/v1/reservations/{mine}/refund"), None),
        (
            "POST",
            format!("/v1/reservations/{mine}/extend"),
            Some(r#"{"ttl_ms": 60000}"#),
        ),
        ("GET", "/v1/scopes/tenant:acme".into(), None),
        ("GET", "/v1/plans".into(), None),
        ("PUT", "/v1/plans/p".into(), Some(r#"{"limits": []}"#)),
        (
            "PUT",
            "/v1/scopes/tenant:acme/user:bob".into(),
            Some(r#"{"plan": "agent-default"}"#),
        ),
        (
            "DELETE",
            "/v1/scopes/tenant:acme/user:bob/override".into(),
            None,
        ),
        (
            "POST",
            "/v1/scopes/tenant:acme/task:t/adjust".into(),
            Some(r#"{"dimension": "tokens", "amount": 1, "reason": "r"}"#),
        ),
    ];
    let bad_credentials: [(&str, Option<String>); 7] = [
        ("missing", None),
        ("unknown token", Some("Bearer not-a-token".into())),
        ("empty bearer", Some("Bearer ".into())),
        ("no scheme", Some(ADMIN_TOKEN.into())),
        ("basic scheme", Some(format!("Basic {ADMIN_TOKEN}"))),
        (
            "the hash instead of the token",
            Some(format!(
                "Bearer {}",
                allowance_server::token_sha256_hex(ADMIN_TOKEN)
            )),
        ),
        (
            "the token with a suffix",
            Some(format!("Bearer {ADMIN_TOKEN}x")),
        ),
    ];
    for (method, path, body) in &routes {
        for (what, auth) in &bad_credentials {
            let r = with_auth(&s, method, path, auth.as_deref(), *body).await;
            refused(&r, 401, "unauthorized", &format!("{method} {path}, {what}"));
        }
        // A malformed body does not get past a missing credential either.
        if body.is_some() {
            let r = with_auth(&s, method, path, None, Some("{not json")).await;
            refused(
                &r,
                401,
                "unauthorized",
                &format!("{method} {path}, no token, bad body"),
            );
        }
    }
    // The scheme is case-insensitive (RFC 9110).
    with_auth(
        &s,
        "GET",
        "/v1/scopes/tenant:acme",
        Some(&format!("bearer {ACME_TOKEN}")),
        None,
    )
    .await
    .expect(200);

    // ---- 403: a tenant token reserving for another tenant.
    let r = reserve(
        &s,
        ACME_TOKEN,
        json!({"tenant": "beta", "amounts": {"tokens": 1}}),
    )
    .await;
    refused(&r, 403, "forbidden", "acme reserving for beta");

    // ---- 404: another tenant's reservation answers exactly as an unknown one.
    let ops: [(&str, &str, Option<&str>); 4] = [
        ("GET", "", None),
        ("POST", "/settle", Some(r#"{"usage": {"tokens": 1}}"#)),
        ("POST", "/refund", None),
        ("POST", "/extend", Some(r#"{"ttl_ms": 60000}"#)),
    ];
    for (method, suffix, body) in ops {
        let auth = format!("Bearer {ACME_TOKEN}");
        let other = with_auth(
            &s,
            method,
            &format!("/v1/reservations/{theirs}{suffix}"),
            Some(&auth),
            body,
        )
        .await;
        let unknown = with_auth(
            &s,
            method,
            &format!("/v1/reservations/{UNKNOWN_ID}{suffix}"),
            Some(&auth),
            body,
        )
        .await;
        refused(
            &other,
            404,
            "not_found",
            &format!("acme {method} beta's reservation{suffix}"),
        );
        assert_eq!(
            other.json, unknown.json,
            "{method} {suffix}: another tenant's reservation must look unknown"
        );
    }
    // ... and none of it touched beta's reservation.
    let r = s
        .get(&format!("/v1/reservations/{theirs}"), Some(BETA_TOKEN))
        .await
        .expect(200);
    assert_eq!(r.json["status"], "held", "{}", r.json);
    let r = s
        .get(&format!("/v1/reservations/{theirs}"), Some(ADMIN_TOKEN))
        .await
        .expect(200);
    assert_eq!(r.json["tenant"], "beta");
    // The owner sees its own.
    s.get(&format!("/v1/reservations/{mine}"), Some(ACME_TOKEN))
        .await
        .expect(200);

    // ---- scopes: another tenant's → 404; its own and shared ones → 200.
    for scope in ["tenant:beta", "tenant:beta/user:bob"] {
        let r = s
            .get(&format!("/v1/scopes/{scope}"), Some(ACME_TOKEN))
            .await;
        refused(&r, 404, "not_found", &format!("acme reading {scope}"));
    }
    for scope in ["tenant:acme", "tenant:acme/user:bob", "tool:search"] {
        let r = s
            .get(&format!("/v1/scopes/{scope}"), Some(ACME_TOKEN))
            .await
            .expect(200);
        assert_eq!(r.json["scope"], scope, "{}", r.json);
    }
    let r = s
        .get("/v1/scopes/tenant:beta", Some(BETA_TOKEN))
        .await
        .expect(200);
    assert_eq!(r.json["held_reservations"], 1, "{}", r.json);

    // ---- admin-only routes with a tenant token → 403, even on its own scopes.
    for (method, path, body) in &routes[6..] {
        let r = with_auth(
            &s,
            method,
            path,
            Some(&format!("Bearer {ACME_TOKEN}")),
            *body,
        )
        .await;
        refused(&r, 403, "forbidden", &format!("acme {method} {path}"));
    }
    // The admin token may do them (a plan with no limits is a valid plan).
    s.put("/v1/plans/p", Some(ADMIN_TOKEN), &json!({"limits": []}))
        .await
        .expect(200);
    s.get("/v1/plans", Some(ADMIN_TOKEN)).await.expect(200);

    // ---- operations routes need no token; metrics name no scope.
    for path in ["/healthz", "/readyz", "/metrics", "/openapi.json"] {
        let r = s.get(path, None).await;
        assert_eq!(r.status, 200, "{path}: {}", r.json);
    }
    let metrics = s.get("/metrics", None).await.expect(200);
    let text = metrics.json.as_str().expect("prometheus text");
    for id in ["acme", "beta", "bob"] {
        assert!(!text.contains(id), "/metrics names {id:?}:\n{text}");
    }
    let doc = s.get("/openapi.json", None).await.expect(200);
    assert!(
        doc.json["paths"]["/v1/reservations"].is_object(),
        "{}",
        doc.json
    );
}

#[tokio::test]
async fn tier_changes_apply_to_the_next_operation() {
    let s = Server::with_tokens();
    let ask = |user: &str| json!({"tenant": "acme", "scopes": {"user": user}, "amounts": {"input_tokens": 4000}});
    // Reserves, and refunds at once when granted: only the verdict matters.
    let verdict = |user: &'static str| {
        let s = &s;
        let body = ask(user);
        async move {
            let r = reserve(s, ACME_TOKEN, body).await;
            if r.status == 201 {
                let id = r.json["id"].as_str().expect("id");
                s.post(
                    &format!("/v1/reservations/{id}/refund"),
                    Some(ACME_TOKEN),
                    &json!({}),
                )
                .await
                .expect(200);
            }
            r
        }
    };
    let default_plan = s
        .get("/v1/scopes/tenant:acme/user:bob", Some(ADMIN_TOKEN))
        .await
        .expect(200)
        .json["plan"]
        .clone();
    verdict("bob").await.expect(201);

    // A tighter tier, then bob moved onto it.
    let tight = json!({"limits": [
        {"dimension": "tokens", "capacity": 1000, "window": "sliding", "period_ms": 3_600_000, "slices": 60}
    ]});
    let r = s
        .put("/v1/plans/tight", Some(ADMIN_TOKEN), &tight)
        .await
        .expect(200);
    assert_eq!(r.json["name"], "tight", "{}", r.json);
    let r = s
        .put(
            "/v1/scopes/tenant:acme/user:bob",
            Some(ADMIN_TOKEN),
            &json!({"plan": "tight"}),
        )
        .await
        .expect(200);
    assert_eq!(r.json["plan"], "tight", "{}", r.json);
    assert_eq!(r.json["limits"][0]["capacity"], 1000, "{}", r.json);

    // The very next reserve is judged by it; another user is not.
    let r = verdict("bob").await;
    refused(&r, 422, "exceeds_limit", "bob on the tight plan");
    assert_eq!(
        r.json["error"]["scope"], "tenant:acme/user:bob",
        "{}",
        r.json
    );
    assert_eq!(r.json["error"]["dimension"], "tokens");
    assert_eq!(r.json["error"]["capacity"], 1000);
    verdict("ann").await.expect(201);

    // Removing the override restores the kind's default plan at once.
    let r = s
        .send(
            "DELETE",
            "/v1/scopes/tenant:acme/user:bob/override",
            Some(ADMIN_TOKEN),
            None,
            None,
        )
        .await
        .expect(200);
    assert_eq!(r.json["plan"], default_plan, "{}", r.json);
    verdict("bob").await.expect(201);

    // Changing the kind's default plan changes every user on the next op.
    let r = s
        .put("/v1/plans/user-default", Some(ADMIN_TOKEN), &tight)
        .await
        .expect(200);
    assert_eq!(
        r.json["limits"].as_array().map(Vec::len),
        Some(1),
        "{}",
        r.json
    );
    for user in ["bob", "ann", "carol"] {
        let r = verdict(user).await;
        refused(
            &r,
            422,
            "exceeds_limit",
            &format!("{user} after user-default tightened"),
        );
        assert_eq!(r.json["error"]["scope"], format!("tenant:acme/user:{user}"));
    }
    let r = s
        .get("/v1/scopes/tenant:acme/user:dave", Some(ACME_TOKEN))
        .await
        .expect(200);
    assert_eq!(
        r.json["limits"],
        json!([{
            "dimension": "tokens", "window": "sliding", "period_ms": 3_600_000, "slices": 60,
            "capacity": 1000, "used": 0, "held": 0, "remaining": 1000, "resets_at": null
        }])
    );
}

#[tokio::test]
async fn open_server_refuses_a_non_loopback_address() {
    // No tokens and 0.0.0.0: exit 2 before binding, naming the way out.
    let out = run_cli(&["serve", "--listen", "0.0.0.0:0"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--insecure-no-auth"), "{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");

    // The same with a configuration file that listens there.
    let (_dir, path) = config_file(
        &allowance_config::STARTER.replace("listen = \"127.0.0.1:8787\"", "listen = \"0.0.0.0:0\""),
    );
    let out = run_cli(&["serve", "--config", &path.to_string_lossy()]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--insecure-no-auth"));

    // With --insecure-no-auth it starts; it is only ever spoken to on
    // 127.0.0.1, then stopped.
    let s = Server::serve_args(&[
        "--listen",
        "0.0.0.0:0",
        "--insecure-no-auth",
        "--data-dir",
        "",
    ]);
    assert!(s.base.starts_with("http://127.0.0.1:"), "{}", s.base);
    s.get("/healthz", None).await.expect(200);
    s.get("/v1/scopes/tenant:acme", None).await.expect(200);
    assert!(
        s.log_text().contains("no [[tokens]] configured"),
        "an open server says so in its log:\n{}",
        s.log_text()
    );
    let status = tokio::time::timeout(Duration::from_secs(40), async move {
        tokio::task::spawn_blocking(move || s.terminate())
            .await
            .expect("join")
    })
    .await
    .expect("stopped");
    assert!(status.success(), "{status:?}");
}
