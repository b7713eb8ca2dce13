//! Bad inputs on every data-plane and admin endpoint of the real binary:
//! each row asserts the exact status, `error.type` and `error.field`
//! (HTTP-API.md "Errors" and answers 1, 2 and 5), no answer is ever 5xx,
//! and after the whole table the ledger is exactly as it was.
mod common;
use common::*;

use serde_json::{Value, json};

/// Scopes whose status must not move (the held reservation's, the task
/// budget that `adjust` rows aim at, and a bystander tenant).
const WATCHED: [&str; 6] = [
    "tenant:acme",
    "tenant:acme/user:bob",
    "tenant:acme/agent:a1",
    "tenant:acme/task:t1",
    "tool:search",
    "tenant:beta",
];

/// A well-formed id no reservation has.
const UNKNOWN_ID: &str = "rsv_0123456789abcdef0123456789abcdef";

/// The limit of a native API body (HTTP-API.md answer 2: inclusive).
const LIMIT_BYTES: usize = 65_536;

/// JSON numbers (and non-numbers) that are not an amount, by name. Raw
/// text, so that `1e400` and 2^64 reach the server as written.
const BAD_AMOUNTS: [(&str, &str); 7] = [
    ("negative", "-1"),
    ("fractional", "1.5"),
    ("2^53+1", "9007199254740993"),
    ("2^64", "18446744073709551616"),
    ("1e400", "1e400"),
    ("string", "\"5\""),
    ("null", "null"),
];

/// One request and the answer HTTP-API.md asks for.
struct Row {
    name: String,
    method: &'static str,
    path: String,
    content_type: Option<&'static str>,
    body: Option<String>,
    status: u16,
    kind: &'static str,
    field: Option<String>,
}

/// The rows, built with the held reservation's id (`{held}`).
struct Table {
    rows: Vec<Row>,
    held: String,
}

impl Table {
    fn path(&self, p: &str) -> String {
        p.replace("{held}", &self.held)
    }

    /// A JSON body expected to be refused with 400 naming `field`.
    fn bad(&mut self, name: &str, method: &'static str, path: &str, body: &str, field: &str) {
        let path = self.path(path);
        self.rows.push(Row {
            name: name.to_string(),
            method,
            path,
            content_type: Some("application/json"),
            body: Some(body.to_string()),
            status: 400,
            kind: "invalid_request",
            field: Some(field.to_string()),
        });
    }

    /// Any answer, in full.
    #[allow(clippy::too_many_arguments)]
    fn row(
        &mut self,
        name: &str,
        method: &'static str,
        path: &str,
        content_type: Option<&'static str>,
        body: Option<&str>,
        status: u16,
        kind: &'static str,
        field: Option<&str>,
    ) {
        let path = self.path(path);
        self.rows.push(Row {
            name: name.to_string(),
            method,
            path,
            content_type,
            body: body.map(str::to_string),
            status,
            kind,
            field: field.map(str::to_string),
        });
    }

    /// The body-level rows every JSON endpoint shares: not JSON, wrong or
    /// missing content type, empty, over the size limit.
    fn body_basics(&mut self, route: &str, method: &'static str, path: &str, valid: &str) {
        let json = Some("application/json");
        self.row(
            &format!("{route}: truncated JSON"),
            method,
            path,
            json,
            Some(&valid[..valid.len() - 1]),
            400,
            "invalid_request",
            None,
        );
        self.row(
            &format!("{route}: not JSON"),
            method,
            path,
            json,
            Some("hello"),
            400,
            "invalid_request",
            None,
        );
        self.row(
            &format!("{route}: trailing garbage"),
            method,
            path,
            json,
            Some(&format!("{valid} x")),
            400,
            "invalid_request",
            None,
        );
        self.row(
            &format!("{route}: a raw control character in a string"),
            method,
            path,
            json,
            Some(&valid.replacen("{\"", "{\"\u{1}", 1)),
            400,
            "invalid_request",
            None,
        );
        self.row(
            &format!("{route}: an array, not an object"),
            method,
            path,
            json,
            Some("[]"),
            400,
            "invalid_request",
            None,
        );
        self.row(
            &format!("{route}: a number, not an object"),
            method,
            path,
            json,
            Some("5"),
            400,
            "invalid_request",
            None,
        );
        self.row(
            &format!("{route}: text/plain"),
            method,
            path,
            Some("text/plain"),
            Some(valid),
            415,
            "unsupported_media_type",
            None,
        );
        self.row(
            &format!("{route}: form content type"),
            method,
            path,
            Some("application/x-www-form-urlencoded"),
            Some("a=1"),
            415,
            "unsupported_media_type",
            None,
        );
        self.row(
            &format!("{route}: no content type"),
            method,
            path,
            None,
            Some(valid),
            415,
            "unsupported_media_type",
            None,
        );
        self.row(
            &format!("{route}: application/jsonx"),
            method,
            path,
            Some("application/jsonx"),
            Some(valid),
            415,
            "unsupported_media_type",
            None,
        );
        self.row(
            &format!("{route}: 65,537 bytes"),
            method,
            path,
            json,
            Some(&padded(valid, LIMIT_BYTES + 1)),
            413,
            "payload_too_large",
            None,
        );
    }
}

/// `json` (an object) padded with spaces before its last `}` to `len` bytes.
fn valid_plan_body() -> &'static str {
    r#"{"limits": [{"dimension": "tokens", "capacity": 1000, "window": "total"}]}"#
}

fn padded(json: &str, len: usize) -> String {
    let cut = json.rfind('}').expect("an object");
    assert!(json.len() <= len, "the body is already longer than {len}");
    let mut out = String::with_capacity(len);
    out.push_str(&json[..cut]);
    out.push_str(&" ".repeat(len - json.len()));
    out.push_str(&json[cut..]);
    assert_eq!(out.len(), len);
    out
}

/// The starter plus four kinds, so that a reservation can name more than
/// `max_scopes` (8, the tenant included) scopes.
fn config() -> String {
    let mut toml = allowance_config::STARTER.to_string();
    for k in ["k1", "k2", "k3", "k4"] {
        toml.push_str(&format!("\n[kinds.{k}]\nplan = \"agent-default\"\n"));
    }
    toml
}

fn build(held: &str) -> Table {
    let mut t = Table {
        rows: Vec::new(),
        held: held.to_string(),
    };
    let json = Some("application/json");

    // ---- POST /v1/reservations
    let r = "/v1/reservations";
    let valid = r#"{"tenant": "acme", "scopes": {"user": "bob"}, "amounts": {"input_tokens": 10}}"#;
    t.body_basics("reserve", "POST", r, valid);
    t.row(
        "reserve: empty body",
        "POST",
        r,
        json,
        Some(""),
        400,
        "invalid_request",
        None,
    );
    t.row(
        "reserve: empty body, no content type",
        "POST",
        r,
        None,
        None,
        415,
        "unsupported_media_type",
        None,
    );
    t.bad("reserve: {}", "POST", r, "{}", "tenant");
    t.bad(
        "reserve: no amounts",
        "POST",
        r,
        r#"{"tenant": "acme"}"#,
        "amounts",
    );
    t.bad(
        "reserve: tenant a number",
        "POST",
        r,
        r#"{"tenant": 5, "amounts": {}}"#,
        "tenant",
    );
    t.bad(
        "reserve: tenant twice",
        "POST",
        r,
        r#"{"tenant": "acme", "tenant": "beta", "amounts": {}}"#,
        "tenant",
    );
    t.bad(
        "reserve: bad tenant name",
        "POST",
        r,
        r#"{"tenant": "ac me", "amounts": {}}"#,
        "tenant",
    );
    t.bad(
        "reserve: empty tenant",
        "POST",
        r,
        r#"{"tenant": "", "amounts": {}}"#,
        "tenant",
    );
    t.bad(
        "reserve: amounts an array",
        "POST",
        r,
        r#"{"tenant": "acme", "amounts": [1]}"#,
        "amounts",
    );
    for (what, n) in BAD_AMOUNTS {
        t.bad(
            &format!("reserve: amount {what}"),
            "POST",
            r,
            &format!(r#"{{"tenant": "acme", "amounts": {{"input_tokens": {n}}}}}"#),
            "amounts.input_tokens",
        );
    }
    // The implied dimensions say what they are or nothing (a reservation
    // is 1 request and, while held, 1 concurrent).
    for (what, amounts, field) in [
        ("requests 5", r#"{"requests": 5}"#, "amounts.requests"),
        ("concurrent 3", r#"{"concurrent": 3}"#, "amounts.concurrent"),
        (
            "requests 2^53",
            r#"{"requests": 9007199254740992}"#,
            "amounts.requests",
        ),
    ] {
        t.bad(
            &format!("reserve: implied {what}"),
            "POST",
            r,
            &format!(r#"{{"tenant": "acme", "amounts": {amounts}}}"#),
            field,
        );
    }
    t.bad(
        "reserve: unknown dimension",
        "POST",
        r,
        r#"{"tenant": "acme", "amounts": {"wat": 1}}"#,
        "amounts.wat",
    );
    t.bad(
        "reserve: unknown top-level field",
        "POST",
        r,
        r#"{"tenant": "acme", "amounts": {}, "bogus": 1}"#,
        "bogus",
    );
    t.bad(
        "reserve: misspelt field",
        "POST",
        r,
        r#"{"tenant": "acme", "amounts": {}, "ttl": 1000}"#,
        "ttl",
    );
    t.bad(
        "reserve: unknown kind",
        "POST",
        r,
        r#"{"tenant": "acme", "scopes": {"team": "x"}, "amounts": {}}"#,
        "scopes.team",
    );
    t.bad(
        "reserve: kind not a name",
        "POST",
        r,
        r#"{"tenant": "acme", "scopes": {"Team X": "x"}, "amounts": {}}"#,
        "scopes.Team X",
    );
    t.bad(
        "reserve: bad scope id",
        "POST",
        r,
        r#"{"tenant": "acme", "scopes": {"user": "b b"}, "amounts": {}}"#,
        "scopes.user",
    );
    t.bad(
        "reserve: scope id too long",
        "POST",
        r,
        &format!(
            r#"{{"tenant": "acme", "scopes": {{"user": "{}"}}, "amounts": {{}}}}"#,
            "b".repeat(129)
        ),
        "scopes.user",
    );
    t.bad(
        "reserve: scope id a number",
        "POST",
        r,
        r#"{"tenant": "acme", "scopes": {"user": 5}, "amounts": {}}"#,
        "scopes.user",
    );
    t.bad(
        "reserve: tenant as a scope",
        "POST",
        r,
        r#"{"tenant": "acme", "scopes": {"tenant": "beta"}, "amounts": {}}"#,
        "scopes.tenant",
    );
    t.bad(
        "reserve: a kind twice",
        "POST",
        r,
        r#"{"tenant": "acme", "scopes": {"user": "a", "user": "b"}, "amounts": {}}"#,
        "scopes.user",
    );
    t.bad(
        "reserve: scopes an array",
        "POST",
        r,
        r#"{"tenant": "acme", "scopes": ["user"], "amounts": {}}"#,
        "scopes",
    );
    t.bad("reserve: too many scopes", "POST", r,
        r#"{"tenant": "acme", "scopes": {"user": "u", "agent": "a", "task": "t", "tool": "search", "k1": "x", "k2": "x", "k3": "x", "k4": "x"}, "amounts": {}}"#,
        "scopes");
    for (what, n) in [
        ("0", "0"),
        ("above max_ttl_ms", "3600001"),
        ("negative", "-5"),
        ("a string", "\"60000\""),
        ("1e400", "1e400"),
    ] {
        t.bad(
            &format!("reserve: ttl_ms {what}"),
            "POST",
            r,
            &format!(r#"{{"tenant": "acme", "amounts": {{"tokens": 1}}, "ttl_ms": {n}}}"#),
            "ttl_ms",
        );
    }
    t.bad(
        "reserve: idempotency key too long",
        "POST",
        r,
        &format!(
            r#"{{"tenant": "acme", "amounts": {{"tokens": 1}}, "idempotency_key": "{}"}}"#,
            "k".repeat(201)
        ),
        "idempotency_key",
    );
    t.bad(
        "reserve: empty idempotency key",
        "POST",
        r,
        r#"{"tenant": "acme", "amounts": {"tokens": 1}, "idempotency_key": ""}"#,
        "idempotency_key",
    );
    let labels: Vec<String> = (0..17).map(|i| format!(r#""l{i}": "v""#)).collect();
    t.bad(
        "reserve: 17 labels",
        "POST",
        r,
        &format!(
            r#"{{"tenant": "acme", "amounts": {{"tokens": 1}}, "labels": {{{}}}}}"#,
            labels.join(", ")
        ),
        "labels",
    );
    let long_key = "k".repeat(65);
    t.bad(
        "reserve: label key too long",
        "POST",
        r,
        &format!(
            r#"{{"tenant": "acme", "amounts": {{"tokens": 1}}, "labels": {{"{long_key}": "v"}}}}"#
        ),
        &format!("labels.{long_key}"),
    );
    t.bad(
        "reserve: label value too long",
        "POST",
        r,
        &format!(
            r#"{{"tenant": "acme", "amounts": {{"tokens": 1}}, "labels": {{"task": "{}"}}}}"#,
            "v".repeat(257)
        ),
        "labels.task",
    );
    t.bad(
        "reserve: label value a number",
        "POST",
        r,
        r#"{"tenant": "acme", "amounts": {"tokens": 1}, "labels": {"task": 1}}"#,
        "labels.task",
    );
    t.bad(
        "reserve: wait_ms above queue.max_wait_ms",
        "POST",
        r,
        r#"{"tenant": "acme", "amounts": {"tokens": 1}, "wait_ms": 60001}"#,
        "wait_ms",
    );
    t.bad(
        "reserve: priority a string",
        "POST",
        r,
        r#"{"tenant": "acme", "amounts": {"tokens": 1}, "priority": "high"}"#,
        "priority",
    );
    t.bad(
        "reserve: dry_run a string",
        "POST",
        r,
        r#"{"tenant": "acme", "amounts": {"tokens": 1}, "dry_run": "yes"}"#,
        "dry_run",
    );
    t.bad(
        "reserve: model a number",
        "POST",
        r,
        r#"{"tenant": "acme", "amounts": {"tokens": 1}, "model": 4}"#,
        "model",
    );
    t.bad(
        "reserve: unpriced model where cost is limited",
        "POST",
        r,
        r#"{"tenant": "acme", "amounts": {"input_tokens": 1}, "model": "no-such-model"}"#,
        "model",
    );
    t.bad(
        "reserve: 65,536 bytes pass the size check",
        "POST",
        r,
        &padded(r#"{"tenant": "acme", "amounts": {"wat": 1}}"#, LIMIT_BYTES),
        "amounts.wat",
    );

    // ---- POST /v1/reservations/{id}/settle
    let s = "/v1/reservations/{held}/settle";
    let valid = r#"{"usage": {"input_tokens": 10}}"#;
    t.body_basics("settle", "POST", s, valid);
    t.row(
        "settle: empty body",
        "POST",
        s,
        json,
        Some(""),
        400,
        "invalid_request",
        None,
    );
    t.bad("settle: {}", "POST", s, "{}", "usage");
    t.bad(
        "settle: implied requests 5",
        "POST",
        s,
        r#"{"usage": {"requests": 5}}"#,
        "usage.requests",
    );
    t.bad(
        "settle: usage an array",
        "POST",
        s,
        r#"{"usage": []}"#,
        "usage",
    );
    t.bad(
        "settle: unknown top-level field",
        "POST",
        s,
        r#"{"usage": {}, "bogus": 1}"#,
        "bogus",
    );
    t.bad(
        "settle: unknown dimension",
        "POST",
        s,
        r#"{"usage": {"wat": 1}}"#,
        "usage.wat",
    );
    for (what, n) in BAD_AMOUNTS {
        t.bad(
            &format!("settle: usage {what}"),
            "POST",
            s,
            &format!(r#"{{"usage": {{"input_tokens": {n}}}}}"#),
            "usage.input_tokens",
        );
        t.bad(
            &format!("settle: charge cost {what}"),
            "POST",
            s,
            &format!(r#"{{"usage": {{}}, "charges": [{{"name": "search", "cost_micros": {n}}}]}}"#),
            "charges[0].cost_micros",
        );
    }
    t.bad(
        "settle: cached_input_tokens 2^53+1",
        "POST",
        s,
        r#"{"usage": {"cached_input_tokens": 9007199254740993}}"#,
        "usage.cached_input_tokens",
    );
    t.bad(
        "settle: charges an object",
        "POST",
        s,
        r#"{"usage": {}, "charges": {"name": "x"}}"#,
        "charges",
    );
    t.bad(
        "settle: charge without cost",
        "POST",
        s,
        r#"{"usage": {}, "charges": [{"name": "search"}]}"#,
        "charges[0].cost_micros",
    );
    t.bad(
        "settle: charge without name",
        "POST",
        s,
        r#"{"usage": {}, "charges": [{"cost_micros": 1}]}"#,
        "charges[0].name",
    );
    t.bad(
        "settle: unknown field in a charge",
        "POST",
        s,
        r#"{"usage": {}, "charges": [{"name": "search", "cost_micros": 1, "bogus": 2}]}"#,
        "charges[0].bogus",
    );
    t.bad(
        "settle: a charge field twice",
        "POST",
        s,
        r#"{"usage": {}, "charges": [{"name": "a", "name": "b", "cost_micros": 1}]}"#,
        "charges[0].name",
    );
    t.bad(
        "settle: empty charge name",
        "POST",
        s,
        r#"{"usage": {}, "charges": [{"name": "", "cost_micros": 1}]}"#,
        "charges[0].name",
    );
    t.bad("settle: unknown dimension in a charge", "POST", s,
        r#"{"usage": {}, "charges": [{"name": "search", "cost_micros": 1, "amounts": {"zzz": 1}}]}"#, "charges[0].amounts.zzz");
    t.bad("settle: the second charge is bad", "POST", s,
        r#"{"usage": {}, "charges": [{"name": "a", "cost_micros": 1}, {"name": "b", "cost_micros": -1}]}"#, "charges[1].cost_micros");
    let charges: Vec<&str> = (0..65)
        .map(|_| r#"{"name": "x", "cost_micros": 1}"#)
        .collect();
    t.bad(
        "settle: 65 charges",
        "POST",
        s,
        &format!(r#"{{"usage": {{}}, "charges": [{}]}}"#, charges.join(",")),
        "charges",
    );
    for (what, id) in ids() {
        t.row(
            &format!("settle: {what} id"),
            "POST",
            &format!("/v1/reservations/{id}/settle"),
            json,
            Some(valid),
            404,
            "not_found",
            None,
        );
    }

    // ---- POST /v1/reservations/{id}/refund (no body, or {})
    let f = "/v1/reservations/{held}/refund";
    t.row(
        "refund: truncated JSON",
        "POST",
        f,
        json,
        Some("{"),
        400,
        "invalid_request",
        None,
    );
    t.row(
        "refund: not JSON",
        "POST",
        f,
        json,
        Some("hello"),
        400,
        "invalid_request",
        None,
    );
    t.row(
        "refund: an array",
        "POST",
        f,
        json,
        Some("[]"),
        400,
        "invalid_request",
        None,
    );
    t.row(
        "refund: a number",
        "POST",
        f,
        json,
        Some("5"),
        400,
        "invalid_request",
        None,
    );
    t.bad(
        "refund: unknown field",
        "POST",
        f,
        r#"{"reason": "x"}"#,
        "reason",
    );
    t.row(
        "refund: {} as text/plain",
        "POST",
        f,
        Some("text/plain"),
        Some("{}"),
        415,
        "unsupported_media_type",
        None,
    );
    t.row(
        "refund: {} without content type",
        "POST",
        f,
        None,
        Some("{}"),
        415,
        "unsupported_media_type",
        None,
    );
    t.row(
        "refund: 65,537 bytes",
        "POST",
        f,
        json,
        Some(&padded("{}", LIMIT_BYTES + 1)),
        413,
        "payload_too_large",
        None,
    );
    for (what, id) in ids() {
        t.row(
            &format!("refund: {what} id"),
            "POST",
            &format!("/v1/reservations/{id}/refund"),
            None,
            None,
            404,
            "not_found",
            None,
        );
    }

    // ---- POST /v1/reservations/{id}/extend
    let e = "/v1/reservations/{held}/extend";
    let valid = r#"{"amounts": {"output_tokens": 5}, "ttl_ms": 60000}"#;
    t.body_basics("extend", "POST", e, valid);
    t.row(
        "extend: empty body",
        "POST",
        e,
        json,
        Some(""),
        400,
        "invalid_request",
        None,
    );
    t.bad("extend: {}", "POST", e, "{}", "amounts");
    t.bad(
        "extend: implied requests (an extend adds none)",
        "POST",
        e,
        r#"{"amounts": {"requests": 1}}"#,
        "amounts.requests",
    );
    t.bad(
        "extend: unknown field",
        "POST",
        e,
        r#"{"ttl_ms": 1000, "x": 1}"#,
        "x",
    );
    for (what, n) in [
        ("0", "0"),
        ("above max_ttl_ms", "3600001"),
        ("1e400", "1e400"),
        ("a string", "\"1000\""),
    ] {
        t.bad(
            &format!("extend: ttl_ms {what}"),
            "POST",
            e,
            &format!(r#"{{"ttl_ms": {n}}}"#),
            "ttl_ms",
        );
    }
    for (what, n) in BAD_AMOUNTS {
        t.bad(
            &format!("extend: amount {what}"),
            "POST",
            e,
            &format!(r#"{{"amounts": {{"tokens": {n}}}}}"#),
            "amounts.tokens",
        );
    }
    t.bad(
        "extend: unknown dimension",
        "POST",
        e,
        r#"{"amounts": {"zz": 1}}"#,
        "amounts.zz",
    );
    for (what, id) in ids() {
        t.row(
            &format!("extend: {what} id"),
            "POST",
            &format!("/v1/reservations/{id}/extend"),
            json,
            Some(valid),
            404,
            "not_found",
            None,
        );
    }

    // ---- GET /v1/reservations/{id}
    for (what, id) in ids() {
        t.row(
            &format!("get: {what} id"),
            "GET",
            &format!("/v1/reservations/{id}"),
            None,
            None,
            404,
            "not_found",
            None,
        );
    }

    // ---- GET /v1/scopes/{scope}
    for (what, scope) in [
        ("not a scope name", "garbage"),
        ("unknown kind", "tenant:acme/team:x"),
        ("a shared kind inside a tenant", "tenant:acme/tool:search"),
        ("a tenant kind without its tenant", "user:bob"),
        ("three levels", "tenant:acme/user:bob/agent:x"),
        ("a space, percent-encoded", "tenant:ac%20me"),
        ("an encoded slash in an id", "tenant:acme%2Fuser%2Fx"),
        ("an empty id", "tenant:"),
    ] {
        t.row(
            &format!("scope status: {what}"),
            "GET",
            &format!("/v1/scopes/{scope}"),
            None,
            None,
            400,
            "invalid_request",
            Some("scope"),
        );
    }

    // ---- a path parameter that is not UTF-8 once percent-decoded: the
    // API's error shape naming `path` (it was axum's plain text).
    for (method, path, body) in [
        ("GET", "/v1/scopes/tenant:a%ff", None),
        ("GET", "/v1/reservations/%ff", None),
        (
            "POST",
            "/v1/reservations/%ff/settle",
            Some(r#"{"usage": {}}"#),
        ),
        ("POST", "/v1/reservations/%c3%28/refund", None),
        (
            "POST",
            "/v1/reservations/%ff/extend",
            Some(r#"{"ttl_ms": 1}"#),
        ),
        ("PUT", "/v1/plans/%ff", Some(valid_plan_body())),
        ("DELETE", "/v1/scopes/tenant:acme/user:%ff/override", None),
    ] {
        t.row(
            &format!("{method} {path}: not UTF-8"),
            method,
            path,
            body.map(|_| "application/json"),
            body,
            400,
            "invalid_request",
            Some("path"),
        );
    }

    // ---- PUT /v1/plans/{name}: aimed at a plan in use, so that a body
    // wrongly accepted would change bob's limits.
    let p = "/v1/plans/user-default";
    let valid = r#"{"limits": [{"dimension": "tokens", "capacity": 1000, "window": "total"}]}"#;
    t.body_basics("put plan", "PUT", p, valid);
    t.bad("put plan: {}", "PUT", p, "{}", "limits");
    t.bad(
        "put plan: limits an object",
        "PUT",
        p,
        r#"{"limits": {}}"#,
        "limits",
    );
    t.bad(
        "put plan: unknown field",
        "PUT",
        p,
        r#"{"limits": [], "bogus": 1}"#,
        "bogus",
    );
    t.bad(
        "put plan: unknown field in a limit",
        "PUT",
        p,
        r#"{"limits": [{"dimension": "tokens", "capacity": 5, "window": "total", "bogus": 1}]}"#,
        "limits[0].bogus",
    );
    for (what, n) in BAD_AMOUNTS.into_iter().chain([("0", "0")]) {
        t.bad(
            &format!("put plan: capacity {what}"),
            "PUT",
            p,
            &format!(
                r#"{{"limits": [{{"dimension": "tokens", "capacity": {n}, "window": "total"}}]}}"#
            ),
            "limits[0].capacity",
        );
    }
    t.bad(
        "put plan: unknown window",
        "PUT",
        p,
        r#"{"limits": [{"dimension": "tokens", "capacity": 5, "window": "weekly"}]}"#,
        "limits[0].window",
    );
    t.bad("put plan: the second limit is bad", "PUT", p,
        r#"{"limits": [{"dimension": "tokens", "capacity": 5, "window": "total"}, {"dimension": "tokens", "capacity": 5, "window": "nah"}]}"#,
        "limits[1].window");
    t.bad(
        "put plan: bad dimension name",
        "PUT",
        p,
        r#"{"limits": [{"dimension": "Bad Dim", "capacity": 5, "window": "total"}]}"#,
        "limits[0].dimension",
    );
    t.bad("put plan: bad period", "PUT", p,
        r#"{"limits": [{"dimension": "tokens", "capacity": 5, "window": "sliding", "period": "1x"}]}"#, "limits[0].period");
    t.bad("put plan: zero slices", "PUT", p,
        r#"{"limits": [{"dimension": "tokens", "capacity": 5, "window": "sliding", "period": "1h", "slices": 0}]}"#, "limits[0].slices");
    t.bad("put plan: period on a total window", "PUT", p,
        r#"{"limits": [{"dimension": "tokens", "capacity": 5, "window": "total", "period_ms": 1000}]}"#, "limits[0].period_ms");
    t.bad(
        "put plan: unknown overrun",
        "PUT",
        p,
        r#"{"limits": [], "overrun": "nope"}"#,
        "overrun",
    );
    t.bad(
        "put plan: queue_weight 0",
        "PUT",
        p,
        r#"{"limits": [], "queue_weight": 0}"#,
        "queue_weight",
    );
    t.bad(
        "put plan: bad plan name",
        "PUT",
        "/v1/plans/bad%20name",
        r#"{"limits": []}"#,
        "name",
    );

    // ---- PUT /v1/scopes/{scope}
    let sc = "/v1/scopes/tenant:acme/user:bob";
    let valid = r#"{"plan": "agent-default"}"#;
    t.body_basics("put scope", "PUT", sc, valid);
    t.bad("put scope: {}", "PUT", sc, "{}", "plan");
    t.bad(
        "put scope: plan and limits",
        "PUT",
        sc,
        r#"{"plan": "agent-default", "limits": []}"#,
        "plan",
    );
    t.bad(
        "put scope: unknown plan",
        "PUT",
        sc,
        r#"{"plan": "nope"}"#,
        "plan",
    );
    t.bad(
        "put scope: plan a number",
        "PUT",
        sc,
        r#"{"plan": 5}"#,
        "plan",
    );
    t.bad(
        "put scope: unknown field",
        "PUT",
        sc,
        r#"{"plan": "agent-default", "x": 1}"#,
        "x",
    );
    t.bad(
        "put scope: capacity 1e400",
        "PUT",
        sc,
        r#"{"limits": [{"dimension": "tokens", "capacity": 1e400, "window": "total"}]}"#,
        "limits[0].capacity",
    );
    t.bad("put scope: period on a total window", "PUT", sc,
        r#"{"limits": [{"dimension": "tokens", "capacity": 5, "window": "total", "period": "1h"}]}"#, "limits[0].period");
    for (what, scope) in [
        ("not a scope name", "garbage"),
        ("unknown kind", "tenant:acme/team:x"),
        ("shared kind inside a tenant", "tenant:acme/tool:search"),
    ] {
        t.bad(
            &format!("put scope: {what}"),
            "PUT",
            &format!("/v1/scopes/{scope}"),
            valid,
            "scope",
        );
    }

    // ---- DELETE /v1/scopes/{scope}/override
    for (what, scope) in [
        ("not a scope name", "garbage"),
        ("unknown kind", "tenant:acme/team:x"),
        ("shared kind inside a tenant", "tenant:acme/tool:search"),
    ] {
        t.row(
            &format!("delete override: {what}"),
            "DELETE",
            &format!("/v1/scopes/{scope}/override"),
            None,
            None,
            400,
            "invalid_request",
            Some("scope"),
        );
    }
    t.row(
        "delete override: none set",
        "DELETE",
        "/v1/scopes/tenant:acme/user:bob/override",
        None,
        None,
        404,
        "not_found",
        None,
    );

    // ---- POST /v1/scopes/{scope}/adjust
    let a = "/v1/scopes/tenant:acme/task:t1/adjust";
    let valid = r#"{"dimension": "tokens", "amount": -5, "reason": "test"}"#;
    t.body_basics("adjust", "POST", a, valid);
    t.bad("adjust: {}", "POST", a, "{}", "dimension");
    t.bad(
        "adjust: no reason",
        "POST",
        a,
        r#"{"dimension": "tokens", "amount": 5}"#,
        "reason",
    );
    t.bad(
        "adjust: empty reason",
        "POST",
        a,
        r#"{"dimension": "tokens", "amount": 5, "reason": " "}"#,
        "reason",
    );
    t.bad(
        "adjust: unknown field",
        "POST",
        a,
        r#"{"dimension": "tokens", "amount": 5, "reason": "r", "y": 1}"#,
        "y",
    );
    t.bad(
        "adjust: unknown dimension",
        "POST",
        a,
        r#"{"dimension": "zzz", "amount": 5, "reason": "r"}"#,
        "dimension",
    );
    for (what, n) in [
        ("fractional", "1.5"),
        ("2^53+1", "9007199254740993"),
        ("-(2^53+1)", "-9007199254740993"),
        ("2^64", "18446744073709551616"),
        ("1e400", "1e400"),
        ("a string", "\"5\""),
        ("null", "null"),
    ] {
        t.bad(
            &format!("adjust: amount {what}"),
            "POST",
            a,
            &format!(r#"{{"dimension": "tokens", "amount": {n}, "reason": "r"}}"#),
            "amount",
        );
    }
    for (what, scope) in [
        ("not a scope name", "garbage"),
        ("unknown kind", "tenant:acme/team:x"),
    ] {
        t.bad(
            &format!("adjust: {what}"),
            "POST",
            &format!("/v1/scopes/{scope}/adjust"),
            valid,
            "scope",
        );
    }
    // The task plan has `total` limits on tokens and cost_micros only: no
    // budget of requests to credit — the body's fault, naming the field.
    t.row(
        "adjust: no total limit on that dimension",
        "POST",
        a,
        json,
        Some(r#"{"dimension": "requests", "amount": 5, "reason": "r"}"#),
        400,
        "invalid_request",
        Some("dimension"),
    );
    t
}

/// Reservation ids that must answer 404: well-formed but unknown, and
/// malformed in several ways.
fn ids() -> [(&'static str, &'static str); 6] {
    [
        ("unknown", UNKNOWN_ID),
        ("malformed", "nope"),
        ("uppercase hex", "rsv_0123456789ABCDEF0123456789ABCDEF"),
        ("short", "rsv_0123456789abcdef"),
        ("non-hex", "rsv_0123456789abcdef0123456789abcdeg"),
        ("percent-encoded NUL", "%00"),
    ]
}

async fn check(s: &Server, row: &Row) -> Option<String> {
    let r = s
        .send(
            row.method,
            &row.path,
            None,
            row.body.as_deref(),
            row.content_type,
        )
        .await;
    let mut problems = Vec::new();
    if r.status >= 500 {
        problems.push(format!("a {} (5xx)", r.status));
    }
    if r.status != row.status {
        problems.push(format!("status {} (want {})", r.status, row.status));
    }
    if !r.json["error"]["message"].is_string() {
        problems.push("no error.message".into());
    }
    if r.error_type() != row.kind {
        problems.push(format!("type {:?} (want {:?})", r.error_type(), row.kind));
    }
    let field = r.json["error"].get("field");
    match (&row.field, field) {
        (None, None) => {}
        (Some(want), Some(Value::String(got))) if got == want => {}
        (want, got) => problems.push(format!("field {got:?} (want {want:?})")),
    }
    (!problems.is_empty()).then(|| {
        format!(
            "{}: {} {} → {}\n    answer: {}",
            row.name,
            row.method,
            row.path,
            problems.join("; "),
            r.json
        )
    })
}

#[tokio::test]
async fn every_bad_input_is_refused_precisely_and_changes_nothing() {
    let s = Server::with_config(&config());
    let held = s
        .post(
            "/v1/reservations",
            None,
            &json!({"tenant": "acme",
                    "scopes": {"user": "bob", "agent": "a1", "task": "t1", "tool": "search"},
                    "amounts": {"input_tokens": 1000, "output_tokens": 200},
                    "model": "gpt-4o", "ttl_ms": 3_600_000}),
        )
        .await
        .expect(201);
    let held = held.json["id"].as_str().expect("an id").to_string();
    let held_path = format!("/v1/reservations/{held}");
    let extra = [held_path.as_str(), "/v1/plans"];
    let before = s.snapshot(None, &WATCHED, &extra).await;
    assert_eq!(before[3]["body"]["held_reservations"], 1, "{before}");

    let table = build(&held);
    assert!(
        table.rows.len() > 200,
        "the table lost rows: {}",
        table.rows.len()
    );
    let mut failures = Vec::new();
    for row in &table.rows {
        if let Some(f) = check(&s, row).await {
            failures.push(f);
        }
    }

    // The size limit is inclusive: a valid dry run of exactly 65,536 bytes
    // is answered, one byte more is not (and neither holds anything).
    let dry = r#"{"tenant": "acme", "scopes": {"user": "bob"}, "amounts": {"tokens": 1}, "dry_run": true}"#;
    let exact = padded(dry, LIMIT_BYTES);
    let r = s
        .send(
            "POST",
            "/v1/reservations",
            None,
            Some(&exact),
            Some("application/json"),
        )
        .await
        .expect(200);
    assert_eq!(r.json["status"], "dry_run", "{}", r.json);
    let over = padded(dry, LIMIT_BYTES + 1);
    let r = s
        .send(
            "POST",
            "/v1/reservations",
            None,
            Some(&over),
            Some("application/json"),
        )
        .await
        .expect(413);
    assert_eq!(r.error_type(), "payload_too_large");

    let after = s.snapshot(None, &WATCHED, &extra).await;
    assert!(
        failures.is_empty(),
        "{} of {} rows answered otherwise than HTTP-API.md asks:\n{}",
        failures.len(),
        table.rows.len(),
        failures.join("\n")
    );
    assert_eq!(before, after, "a refused request changed the ledger");
    assert_eq!(after[6]["body"]["status"], "held");
}
