//! Arbitrary and near-valid bodies sent to every model route of a real
//! gateway (in-process, over HTTP, with the stub as its upstream).
//!
//! Properties, for every body on every route, streamed or not:
//! - the gateway answers, and never with a 5xx (the stub is healthy, so a
//!   5xx could only be the gateway's own failure);
//! - every refusal is in the provider's error shape: OpenAI's
//!   `{"error": {"message", "type"}}` on `/v1/chat/completions`,
//!   `/v1/responses` and `/v1/embeddings`, Anthropic's `{"type": "error",
//!   "error": {"type", "message"}}` on `/v1/messages`;
//! - a call refused before it was forwarded changed nothing: no usage
//!   record, and the caller's scope exactly as before;
//! - whatever the answer, nothing stays held afterwards (no leaked hold
//!   on the tenant or the upstream), and a success or a forwarded refusal
//!   left exactly its records in the usage log.
//!
//! Cases: `ALLOWANCE_PROPTEST_CASES` (default 64, to keep CI fast).
mod common_gateway;
use common_gateway::*;

use std::time::Duration;

use allowance_testkit::fuzz::{self, J, Vocabulary, mutate};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::Value;

/// Numbers at the edges of what the request fields take.
const EDGE_NUMBERS: &[&str] = &[
    "0",
    "-1",
    "1",
    "1.0",
    "0.5",
    "-0",
    "1e3",
    "1e400",
    "-1e400",
    "4294967295",
    "4294967296",
    "9007199254740993",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775808",
    "99999999999999999999999999",
];

/// Strings the request fields hold, and some they should not.
const WORDS: &[&str] = &[
    "",
    "gpt-4o",
    "claude-x",
    "user",
    "assistant",
    "system",
    "developer",
    "tool",
    "function",
    "text",
    "image_url",
    "input_text",
    "image",
    "tool_use",
    "tool_result",
    "hello",
    "data:image/png;base64,AAAA",
    "https://example.invalid/cat.png",
    "auto",
    "high",
    "low",
    " ",
    "\u{0}",
    "é☃𝄞",
];

/// The field names of the four request shapes (and of their nested
/// objects), so random objects reach the deeper parsing.
const FIELD_NAMES: &[&str] = &[
    "model",
    "messages",
    "role",
    "content",
    "name",
    "type",
    "text",
    "image_url",
    "url",
    "detail",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "stream",
    "stream_options",
    "include_usage",
    "tools",
    "function",
    "parameters",
    "description",
    "input",
    "instructions",
    "system",
    "source",
    "tool_choice",
    "n",
    "encoding_format",
    "dimensions",
    "temperature",
    "metadata",
    "user",
];

/// What the four request shapes give meaning to.
const VOCABULARY: Vocabulary = Vocabulary {
    words: WORDS,
    field_names: FIELD_NAMES,
    edge_numbers: EDGE_NUMBERS,
    free_text: "[a-z0-9 _.-]{0,40}",
};

fn value() -> impl Strategy<Value = J> {
    fuzz::value(&VOCABULARY)
}

fn key() -> impl Strategy<Value = String> {
    fuzz::key(&VOCABULARY)
}

fn s(v: &str) -> J {
    J::string(v)
}

fn n(v: &str) -> J {
    J::number(v)
}

fn o(fields: Vec<(&str, J)>) -> J {
    J::object(fields)
}

/// The routes, each with valid bodies to mutate (small outputs, so a
/// forwarded call is quick).
fn templates() -> Vec<(&'static str, Vec<J>)> {
    let chat_messages = J::Arr(vec![
        o(vec![("role", s("system")), ("content", s("be brief"))]),
        o(vec![
            ("role", s("user")),
            ("name", s("bob")),
            (
                "content",
                J::Arr(vec![
                    o(vec![("type", s("text")), ("text", s("hello there"))]),
                    o(vec![
                        ("type", s("image_url")),
                        (
                            "image_url",
                            o(vec![("url", s("https://example.invalid/cat.png"))]),
                        ),
                    ]),
                ]),
            ),
        ]),
    ]);
    let chat_tools = J::Arr(vec![o(vec![
        ("type", s("function")),
        (
            "function",
            o(vec![
                ("name", s("lookup")),
                ("description", s("finds things")),
                (
                    "parameters",
                    o(vec![("type", s("object")), ("properties", o(vec![]))]),
                ),
            ]),
        ),
    ])]);
    let anthropic_messages = J::Arr(vec![o(vec![
        ("role", s("user")),
        (
            "content",
            J::Arr(vec![o(vec![("type", s("text")), ("text", s("hello"))])]),
        ),
    ])]);
    vec![
        (
            "/v1/chat/completions",
            vec![
                o(vec![
                    ("model", s("gpt-4o")),
                    ("messages", chat_messages.clone()),
                    ("max_tokens", n("3")),
                ]),
                o(vec![
                    ("model", s("gpt-4o")),
                    ("messages", chat_messages),
                    ("tools", chat_tools),
                    ("max_completion_tokens", n("3")),
                    ("stream", J::Bool(true)),
                    ("stream_options", o(vec![("include_usage", J::Bool(true))])),
                ]),
            ],
        ),
        (
            "/v1/responses",
            vec![
                o(vec![
                    ("model", s("gpt-4o")),
                    ("input", s("hello")),
                    ("instructions", s("be brief")),
                    ("max_output_tokens", n("3")),
                ]),
                o(vec![
                    ("model", s("gpt-4o")),
                    (
                        "input",
                        J::Arr(vec![o(vec![
                            ("role", s("user")),
                            (
                                "content",
                                J::Arr(vec![o(vec![
                                    ("type", s("input_text")),
                                    ("text", s("hello")),
                                ])]),
                            ),
                        ])]),
                    ),
                    ("max_output_tokens", n("3")),
                    ("stream", J::Bool(true)),
                ]),
            ],
        ),
        (
            "/v1/embeddings",
            vec![
                o(vec![("model", s("gpt-4o")), ("input", s("hello"))]),
                o(vec![
                    ("model", s("gpt-4o")),
                    ("input", J::Arr(vec![s("hello"), s("there")])),
                    ("encoding_format", s("float")),
                ]),
            ],
        ),
        (
            "/v1/messages",
            vec![
                o(vec![
                    ("model", s("claude-x")),
                    ("max_tokens", n("3")),
                    ("system", s("be brief")),
                    ("messages", anthropic_messages.clone()),
                ]),
                o(vec![
                    ("model", s("claude-x")),
                    ("max_tokens", n("3")),
                    (
                        "system",
                        J::Arr(vec![o(vec![("type", s("text")), ("text", s("be brief"))])]),
                    ),
                    ("messages", anthropic_messages),
                    ("stream", J::Bool(true)),
                ]),
            ],
        ),
    ]
}

/// How a case's body is made.
#[derive(Debug, Clone)]
enum Shape {
    /// A route's valid body, a few values replaced, dropped or added.
    NearValid {
        template: prop::sample::Index,
        choices: Vec<(u8, J)>,
        extra: Option<(String, J)>,
    },
    /// Any JSON value.
    Any(J),
    /// An object of the shapes' field names with random values.
    Fields(Vec<(&'static str, J)>),
    /// A near-valid body cut short: not JSON.
    Cut(prop::sample::Index, prop::sample::Index),
}

#[derive(Debug, Clone)]
struct Case {
    route: prop::sample::Index,
    shape: Shape,
    /// An `X-Allowance-Agent` header (bob's key may add agent scopes).
    agent: Option<String>,
}

fn case() -> impl Strategy<Value = Case> {
    let near_valid = (
        any::<prop::sample::Index>(),
        prop::collection::vec((0u8..24, value()), 32),
        prop::option::weighted(0.2, (key(), value())),
    )
        .prop_map(|(template, choices, extra)| Shape::NearValid {
            template,
            choices,
            extra,
        });
    let shape = prop_oneof![
        6 => near_valid,
        1 => value().prop_map(Shape::Any),
        2 => prop::collection::vec((prop::sample::select(FIELD_NAMES), value()), 0..8)
            .prop_map(Shape::Fields),
        1 => (any::<prop::sample::Index>(), any::<prop::sample::Index>())
            .prop_map(|(t, at)| Shape::Cut(t, at)),
    ];
    (
        any::<prop::sample::Index>(),
        shape,
        prop::option::weighted(
            0.15,
            prop_oneof![
                3 => "[a-z0-9_-]{1,12}",
                1 => "\\PC{0,12}",
            ],
        ),
    )
        .prop_map(|(route, shape, agent)| Case {
            route,
            shape,
            agent,
        })
}

impl Case {
    /// The route and the body's bytes.
    fn request(&self) -> (&'static str, String) {
        let all = templates();
        let (route, bodies) = &all[self.route.index(all.len())];
        let body = match &self.shape {
            Shape::NearValid {
                template,
                choices,
                extra,
            } => {
                let mut mutated =
                    mutate(&bodies[template.index(bodies.len())], &mut choices.iter());
                if let (J::Obj(fields), Some(extra)) = (&mut mutated, extra) {
                    fields.push(extra.clone());
                }
                mutated.text()
            }
            Shape::Any(v) => v.text(),
            Shape::Fields(fields) => J::Obj(
                fields
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.clone()))
                    .collect(),
            )
            .text(),
            Shape::Cut(t, at) => {
                let text = bodies[t.index(bodies.len())].text();
                let mut at = at.index(text.len());
                while !text.is_char_boundary(at) {
                    at -= 1;
                }
                text[..at].to_string()
            }
        };
        (route, body)
    }
}

/// The provider's error shape for `route`, or what is wrong with `text`.
fn check_error_shape(route: &str, status: u16, text: &str) -> Result<(), String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON ({e}): {text}"))?;
    if route == "/v1/messages" {
        if v["type"] != "error"
            || !v["error"]["type"].is_string()
            || !v["error"]["message"].is_string()
        {
            return Err(format!("{status} not in Anthropic's error shape: {v}"));
        }
    } else if !v["error"]["message"].is_string() || !v["error"]["type"].is_string() {
        return Err(format!("{status} not in OpenAI's error shape: {v}"));
    }
    Ok(())
}

/// What the ledger shows of the caller: bob's token counters and the
/// number of usage records.
async fn picture(gw: &Gw) -> ((u64, u64), usize) {
    (gw.limit(BOB, "tokens").await, gw.usage_log().await.len())
}

/// The gateway every case is sent to: both model names routed, bob's
/// key, the upstream named `upstream` (one per test: see the harness).
fn setup(upstream: &str) -> Setup {
    let mut setup = Setup::new(upstream);
    setup.models = r#"["gpt-4o", "claude-x"]"#.to_string();
    setup.max_body_bytes = Some(64 * 1024);
    setup
}

/// Waits (up to 5 s) until the usage log has `n` records.
async fn wait_usage_records(gw: &Gw, n: usize) {
    let started = std::time::Instant::now();
    while gw.usage_log().await.len() < n && started.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arbitrary_bodies_never_break_the_gateway_or_the_ledger() {
    run_cases(&Gw::start(setup("fuzz-mem")).await);
}

/// The same on the durable store (write-ahead log on real files): its
/// reserves and settles answer through the log's group commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arbitrary_bodies_never_break_the_durable_gateway_or_its_ledger() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let fs = std::sync::Arc::new(allowance_wal::RealFs);
    let gw = Gw::start_durable(setup("fuzz-durable"), fs, dir.path()).await;
    run_cases(&gw);
}

/// Runs the cases against `gw` (`ALLOWANCE_PROPTEST_CASES`, default 64).
fn run_cases(gw: &Gw) {
    let cases: u32 = std::env::var("ALLOWANCE_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let handle = tokio::runtime::Handle::current();
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    // proptest's runner is synchronous: each case runs on this runtime
    // from a blocking section, so the gateway's tasks keep running.
    // The runner's error holds the failing case (large); it is only printed.
    let result = tokio::task::block_in_place(|| {
        runner
            .run(&case(), |c| handle.block_on(one_case(gw, &c)))
            .map_err(|e| e.to_string())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Sends one case and checks what it did.
async fn one_case(gw: &Gw, c: &Case) -> Result<(), TestCaseError> {
    let (route, body) = c.request();
    let what = format!("POST {route} {body}");
    let (before, records_before) = picture(gw).await;
    let forwarded_before = gw.stub.stats().total;
    let mut req = gw
        .post(route)
        .header("content-type", "application/json")
        .body(body.clone())
        .timeout(Duration::from_secs(30));
    if let Some(agent) = &c.agent {
        req = req.header("x-allowance-agent", agent.as_str());
    }
    let r = try_read(req)
        .await
        .map_err(|e| TestCaseError::fail(format!("{what}: no answer: {e}")))?;
    prop_assert!(r.status < 500, "{} answered {}: {}", what, r.status, r.text);
    if !(200..300).contains(&r.status) {
        check_error_shape(route, r.status, &r.text)
            .map_err(|e| TestCaseError::fail(format!("{what}: {e}")))?;
    }
    gw.wait_nothing_held().await;
    let forwarded = gw.stub.stats().total > forwarded_before;
    if forwarded {
        // The durable store's usage log shows a record a few
        // ms after its operation answered (its writer looks
        // every 5 ms): wait for this call's two.
        wait_usage_records(gw, records_before + 2).await;
    }
    let (after, records_after) = picture(gw).await;
    if !forwarded {
        prop_assert!(
            !(200..300).contains(&r.status),
            "{} answered {} without calling the upstream",
            what,
            r.status
        );
        prop_assert_eq!(
            (before, records_before),
            (after, records_after),
            "{} was refused ({}: {}) but changed the ledger",
            &what,
            r.status,
            &r.text
        );
    } else {
        // A forwarded call ends as one caller record and one
        // attempt record, settled or refunded. (A stream held
        // first on a bound would add the bound's refunds, but
        // that needs a body over 16 KiB, far above these.)
        let added = records_after - records_before;
        prop_assert!(
            added == 2,
            "{} ({}) left {} usage records",
            what,
            r.status,
            added
        );
        prop_assert_eq!(after.1, 0, "{} left tokens held on {}", &what, BOB);
    }
    Ok(())
}
