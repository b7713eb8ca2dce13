//! Arbitrary JSON — and JSON-ish objects built from the API's real field
//! names with values of random types — sent to every endpoint of one real
//! server. Property: never a 5xx; every non-2xx answer has the error shape
//! with a known `type` matching its status; and a refused request leaves
//! every watched scope, the held reservation and the plans exactly as they
//! were. Cases: `ALLOWANCE_PROPTEST_CASES` (default 64, to keep CI fast).
mod common;
use common::*;

use std::cell::RefCell;
use std::fmt::Write as _;

use allowance_testkit::fuzz::{self, J, Vocabulary, mutate};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{Value, json};

/// No bucket windows (their fill drains with time, which would make two
/// pictures of an untouched ledger differ), holds that outlive the test,
/// and large capacities so that the fixture can always be made again.
const CONFIG: &str = r#"
[reservations]
default_ttl_ms = 3_600_000
max_ttl_ms = 3_600_000

[kinds.tenant]
plan = "tenant-plan"
[kinds.user]
plan = "user-plan"
[kinds.task]
plan = "task-plan"
[kinds.tool]
shared = true
plan = "tool-plan"

[plans.tenant-plan]
limits = [
  { dimension = "cost_micros", capacity = 9_000_000_000_000_000, window = "sliding", period = "1h", slices = 60 },
  { dimension = "concurrent", capacity = 1000 },
]
[plans.user-plan]
limits = [
  { dimension = "requests", capacity = 100_000, window = "sliding", period = "1h", slices = 60 },
  { dimension = "tokens", capacity = 9_000_000_000_000_000, window = "sliding", period = "1h", slices = 60 },
  { dimension = "concurrent", capacity = 1000 },
]
[plans.task-plan]
limits = [{ dimension = "tokens", capacity = 1_000_000, window = "total" }]
[plans.tool-plan]
limits = [{ dimension = "requests", capacity = 100_000, window = "sliding", period = "1h", slices = 60 }]
[plans.fuzz-plan]
limits = []

[models."gpt-4o"]
input_per_million = "2.50"
output_per_million = "10.00"
"#;

/// Every field name of the native API's bodies, and dimension and kind names.
const FIELD_NAMES: &[&str] = &[
    "tenant",
    "scopes",
    "amounts",
    "model",
    "ttl_ms",
    "idempotency_key",
    "wait_ms",
    "priority",
    "labels",
    "dry_run",
    "usage",
    "charges",
    "name",
    "cost_micros",
    "limits",
    "dimension",
    "capacity",
    "window",
    "period_ms",
    "period",
    "slices",
    "unit",
    "zone",
    "guaranteed",
    "overrun",
    "overrun_percent",
    "queue_weight",
    "plan",
    "amount",
    "reason",
    "input_tokens",
    "output_tokens",
    "tokens",
    "requests",
    "concurrent",
    "cached_input_tokens",
    "user",
    "task",
    "tool",
    "agent",
    "search_calls",
];

/// String values the server gives meaning to.
const WORDS: &[&str] = &[
    "acme",
    "beta",
    "fuzz",
    "bob",
    "u1",
    "t1",
    "search",
    "gpt-4o",
    "sliding",
    "bucket",
    "total",
    "calendar",
    "concurrent",
    "day",
    "month",
    "UTC",
    "Europe/Paris",
    "1h",
    "90s",
    "fuzz-plan",
    "tokens",
    "requests",
    "cost_micros",
    "charge_actual",
    "allow_overrun",
    "",
];

/// Numbers at and beyond every edge, as raw JSON text.
const EDGE_NUMBERS: &[&str] = &[
    "0",
    "-0",
    "1",
    "-1",
    "1.5",
    "1e3",
    "3600000",
    "3600001",
    "60001",
    "9007199254740992",
    "9007199254740993",
    "-9007199254740993",
    "18446744073709551615",
    "18446744073709551616",
    "1e400",
    "-1e400",
    "1e-400",
    "2.0",
];

/// Where scope paths point for writes: scopes of the `fuzz` tenant only,
/// so the fixture can always be made again whatever a write did.
const FUZZ_SCOPES: &[&str] = &["tenant:fuzz/user:u1", "tenant:fuzz/task:t1", "tenant:fuzz"];

/// What the native API gives meaning to.
const VOCABULARY: Vocabulary = Vocabulary {
    words: WORDS,
    field_names: FIELD_NAMES,
    edge_numbers: EDGE_NUMBERS,
    free_text: "[a-z0-9:/_.-]{0,12}",
};

/// Any JSON value, object keys mostly the API's own.
fn value() -> impl Strategy<Value = J> {
    fuzz::value(&VOCABULARY)
}

fn key() -> impl Strategy<Value = String> {
    fuzz::key(&VOCABULARY)
}

/// A request body: an arbitrary value, an object of real field names with
/// random values, or one of those cut short (not JSON).
fn body() -> impl Strategy<Value = String> {
    fn object() -> impl Strategy<Value = String> {
        prop::collection::vec((prop::sample::select(FIELD_NAMES), value()), 0..8).prop_map(
            |fields| {
                J::Obj(
                    fields
                        .into_iter()
                        .map(|(k, v)| (k.to_string(), v))
                        .collect(),
                )
                .text()
            },
        )
    }
    prop_oneof![
        2 => value().prop_map(|v| v.text()),
        3 => object(),
        4 => near_valid(),
        1 => (object(), any::<prop::sample::Index>()).prop_map(|(text, cut)| {
            let mut at = cut.index(text.len().max(1));
            while !text.is_char_boundary(at) {
                at -= 1;
            }
            text[..at].to_string()
        }),
    ]
}

/// Valid bodies of each endpoint, the starting points of [`near_valid`].
fn templates() -> Vec<J> {
    let (s, n, o) = (J::string, J::number, J::object);
    vec![
        o(vec![
            ("tenant", s("fuzz")),
            (
                "scopes",
                o(vec![
                    ("user", s("u1")),
                    ("task", s("t1")),
                    ("tool", s("search")),
                ]),
            ),
            (
                "amounts",
                o(vec![("input_tokens", n("100")), ("output_tokens", n("10"))]),
            ),
            ("model", s("gpt-4o")),
            ("ttl_ms", n("60000")),
            ("labels", o(vec![("task", s("summarise"))])),
            ("dry_run", J::Bool(false)),
        ]),
        o(vec![
            (
                "usage",
                o(vec![("input_tokens", n("90")), ("output_tokens", n("7"))]),
            ),
            (
                "charges",
                J::Arr(vec![o(vec![
                    ("name", s("search")),
                    ("cost_micros", n("5000")),
                    ("amounts", o(vec![])),
                ])]),
            ),
        ]),
        o(vec![
            ("amounts", o(vec![("output_tokens", n("5"))])),
            ("ttl_ms", n("60000")),
        ]),
        o(vec![
            (
                "limits",
                J::Arr(vec![o(vec![
                    ("dimension", s("tokens")),
                    ("capacity", n("1000")),
                    ("window", s("sliding")),
                    ("period", s("1h")),
                    ("slices", n("60")),
                ])]),
            ),
            ("overrun", s("charge_actual")),
        ]),
        o(vec![("plan", s("fuzz-plan"))]),
        o(vec![
            ("dimension", s("tokens")),
            ("amount", n("-5")),
            ("reason", s("fuzz")),
        ]),
    ]
}

/// An endpoint's valid body with a few values replaced by random ones,
/// some fields dropped, and maybe one field added: inputs that get past
/// the parser and reach the deeper checks (and sometimes pass).
fn near_valid() -> impl Strategy<Value = String> {
    (
        any::<prop::sample::Index>(),
        prop::collection::vec((0u8..24, value()), 24),
        prop::option::weighted(0.2, (key(), value())),
    )
        .prop_map(|(which, choices, extra)| {
            let all = templates();
            let mut mutated = mutate(&all[which.index(all.len())], &mut choices.iter());
            if let (J::Obj(fields), Some(extra)) = (&mut mutated, extra) {
                fields.push(extra);
            }
            mutated.text()
        })
}

/// A path segment: a real name or junk.
fn segment(real: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![
        2 => prop::sample::select(real).prop_map(str::to_string),
        1 => "[a-z0-9:/_.%-]{0,20}",
        1 => "\\PC{0,20}",
    ]
}

/// Percent-encodes all but unreserved characters, `:` and `/`.
fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~:/".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[derive(Debug, Clone)]
struct Case {
    body: String,
    content_type: Option<&'static str>,
    plan_name: String,
    scope: String,
    any_path: String,
}

fn case() -> impl Strategy<Value = Case> {
    (
        body(),
        prop_oneof![
            8 => Just(Some("application/json")),
            1 => Just(Some("text/plain")),
            1 => Just(None),
        ],
        segment(&["fuzz-plan", "fuzz-plan-2"]),
        segment(FUZZ_SCOPES),
        segment(&[
            "tenant:acme",
            "tool:search",
            "tenant:fuzz/user:u1",
            "rsv_0123456789abcdef0123456789abcdef",
        ]),
    )
        .prop_map(|(body, content_type, plan_name, scope, any_path)| Case {
            body,
            content_type,
            plan_name,
            scope,
            any_path,
        })
}

/// The types of HTTP-API.md "Errors" and their statuses (a method a
/// route does not take is a 404: that route does not exist).
fn status_of(kind: &str) -> Option<&'static [u16]> {
    Some(match kind {
        "invalid_request" => &[400],
        "unauthorized" => &[401],
        "forbidden" => &[403],
        "not_found" => &[404],
        "conflict" => &[409],
        "rate_limited" => &[429],
        "budget_exhausted" => &[402],
        "exceeds_limit" => &[422],
        "payload_too_large" => &[413],
        "unsupported_media_type" => &[415],
        "store_unavailable" => &[503],
        _ => return None,
    })
}

/// The reservation every `settle`/`refund`/`extend` aims at, made again
/// (on a fresh tenant) whenever a request ends it.
#[derive(Clone)]
struct Fixture {
    id: String,
    tenant: String,
    made: usize,
}

async fn make_fixture(s: &Server, made: usize) -> Fixture {
    let tenant = format!("fx{made}");
    let r = s
        .post(
            "/v1/reservations",
            None,
            &json!({"tenant": tenant, "scopes": {"user": "bob"},
                    "amounts": {"input_tokens": 100, "output_tokens": 20},
                    "model": "gpt-4o", "ttl_ms": 3_600_000}),
        )
        .await
        .expect(201);
    Fixture {
        id: r.json["id"].as_str().expect("id").to_string(),
        tenant,
        made: made + 1,
    }
}

/// A copy of the fixture, so that no borrow is held across an await.
fn now(fixture: &RefCell<Fixture>) -> Fixture {
    fixture.borrow().clone()
}

async fn picture(s: &Server, f: &Fixture) -> Value {
    let tenant = format!("tenant:{}", f.tenant);
    let user = format!("tenant:{}/user:bob", f.tenant);
    let held = format!("/v1/reservations/{}", f.id);
    let mut scopes = vec![
        tenant.as_str(),
        user.as_str(),
        "tool:search",
        "tenant:acme",
        "tenant:beta",
    ];
    scopes.extend_from_slice(FUZZ_SCOPES);
    s.snapshot(None, &scopes, &[&held, "/v1/plans"]).await
}

fn check_shape(what: &str, r: &Reply) -> Result<(), TestCaseError> {
    prop_assert!(r.status < 500, "{what}: a {} answer: {}", r.status, r.json);
    if (200..300).contains(&r.status) {
        return Ok(());
    }
    let kind = r.json["error"]["type"].as_str();
    prop_assert!(
        kind.is_some(),
        "{what}: {} without the error shape: {}",
        r.status,
        r.json
    );
    let kind = kind.unwrap_or_default();
    let statuses = status_of(kind);
    prop_assert!(
        statuses.is_some(),
        "{what}: unknown error type {kind:?}: {}",
        r.json
    );
    prop_assert!(
        statuses.unwrap_or_default().contains(&r.status),
        "{what}: type {kind:?} with status {}: {}",
        r.status,
        r.json
    );
    prop_assert!(
        r.json["error"]["message"].is_string(),
        "{what}: no message: {}",
        r.json
    );
    if let Some(field) = r.json["error"].get("field") {
        prop_assert!(
            kind == "invalid_request" && field.as_str().is_some_and(|f| !f.is_empty()),
            "{what}: a field that is not a non-empty string on an invalid_request: {}",
            r.json
        );
    }
    Ok(())
}

/// After an accepted request: undo what would make later pictures drift
/// or the fixture unusable, and take a new picture.
async fn settle_down(s: &Server, fixture: &RefCell<Fixture>, r: &Reply) {
    if r.status == 201
        && let Some(id) = r.json["id"].as_str()
        && id != fixture.borrow().id
    {
        s.send(
            "POST",
            &format!("/v1/reservations/{id}/refund"),
            None,
            None,
            None,
        )
        .await
        .expect(200);
    }
    let id = fixture.borrow().id.clone();
    let now = s
        .get(&format!("/v1/reservations/{id}"), None)
        .await
        .expect(200);
    if now.json["status"] == "held" {
        // An extend may have shortened its life: give it the whole hour again.
        s.post(
            &format!("/v1/reservations/{id}/extend"),
            None,
            &json!({"ttl_ms": 3_600_000}),
        )
        .await
        .expect(200);
    } else {
        let made = fixture.borrow().made;
        let next = make_fixture(s, made).await;
        *fixture.borrow_mut() = next;
    }
}

#[test]
fn arbitrary_json_never_breaks_the_server_or_the_ledger() {
    let cases: u32 = std::env::var("ALLOWANCE_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let s = Server::with_config(CONFIG);
    let fixture = RefCell::new(rt.block_on(make_fixture(&s, 0)));
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&case(), |c| {
        rt.block_on(async {
            let mut before = picture(&s, &now(&fixture)).await;
            let id = fixture.borrow().id.clone();
            let requests: Vec<(&str, String, bool)> = vec![
                ("POST", "/v1/reservations".into(), true),
                ("POST", format!("/v1/reservations/{id}/settle"), true),
                (
                    "POST",
                    "/v1/reservations/rsv_0123456789abcdef0123456789abcdef/settle".into(),
                    true,
                ),
                ("POST", format!("/v1/reservations/{id}/extend"), true),
                ("POST", format!("/v1/reservations/{id}/refund"), true),
                ("PUT", format!("/v1/plans/{}", encode(&c.plan_name)), true),
                ("PUT", format!("/v1/scopes/{}", encode(&c.scope)), true),
                (
                    "POST",
                    format!("/v1/scopes/{}/adjust", encode(&c.scope)),
                    true,
                ),
                (
                    "DELETE",
                    format!("/v1/scopes/{}/override", encode(&c.scope)),
                    false,
                ),
                ("GET", format!("/v1/scopes/{}", encode(&c.any_path)), false),
                (
                    "GET",
                    format!("/v1/reservations/{}", encode(&c.any_path)),
                    false,
                ),
            ];
            for (method, path, with_body) in requests {
                // The fixture may have been made again by an earlier request.
                let old = id.as_str();
                let path = path.replace(old, &fixture.borrow().id);
                let (body, ct) = if with_body {
                    (Some(c.body.as_str()), c.content_type)
                } else {
                    (None, None)
                };
                let r = s.send(method, &path, None, body, ct).await;
                let what = format!("{method} {path} {:?} ({ct:?})", c.body);
                check_shape(&what, &r)?;
                if (200..300).contains(&r.status) {
                    settle_down(&s, &fixture, &r).await;
                    before = picture(&s, &now(&fixture)).await;
                } else {
                    let after = picture(&s, &now(&fixture)).await;
                    prop_assert_eq!(
                        &before,
                        &after,
                        "{} answered {} and changed the ledger",
                        what,
                        r.json
                    );
                }
            }
            Ok(())
        })
    });
    if let Err(e) = result {
        panic!("{e}\nserver log (last lines):\n{}", tail(&s.log_text(), 20));
    }
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
