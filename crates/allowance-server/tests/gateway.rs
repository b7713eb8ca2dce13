//! The gateway end to end, whole (non-streaming) answers: exact settlement
//! from the upstream's usage, the model table's cost, input estimates
//! against the stub's independent count on the estimator's fixtures, the
//! model list, budget denials in each provider's shape, and bad input
//! refused before anything is held or forwarded.
//!
//! A stub upstream and a gateway run in-process on 127.0.0.1 for each test;
//! what the ledger did is read back over HTTP (scope status, usage log).

mod common_gateway;

use std::path::PathBuf;

use common_gateway::*;
use serde_json::{Value, json};

fn usage_input(api_path: &str, body: &Value) -> u64 {
    match api_path {
        "/v1/chat/completions" | "/v1/embeddings" => body["usage"]["prompt_tokens"].as_u64(),
        _ => body["usage"]["input_tokens"].as_u64(),
    }
    .unwrap_or_else(|| panic!("no input usage in {body}"))
}

fn usage_output(api_path: &str, body: &Value) -> u64 {
    match api_path {
        "/v1/chat/completions" => body["usage"]["completion_tokens"].as_u64(),
        "/v1/embeddings" => Some(0),
        _ => body["usage"]["output_tokens"].as_u64(),
    }
    .unwrap_or_else(|| panic!("no output usage in {body}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_settles_exactly_what_the_upstream_reported() {
    let gw = Gw::start(Setup::new("exact")).await;
    let first = chat("What is the capital of Australia? One word.", 50);
    let expected_input = stub_chat_tokens(&first);

    let r = gw.call("/v1/chat/completions", &first).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let body = r.json();
    assert_eq!(body["usage"]["prompt_tokens"], expected_input, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 20, "{body}");
    // The client sees its own budget, tightest over its scopes, after the
    // hold (input + the whole output bound).
    assert_eq!(
        r.header("x-ratelimit-limit-tokens").as_deref(),
        Some("1000000")
    );
    assert_eq!(
        r.header("x-ratelimit-remaining-tokens"),
        Some((1_000_000 - expected_input - 50).to_string())
    );

    // A second call, bounded by `max_completion_tokens` below the stub's 20.
    let mut second = chat("And of New Zealand?", 500);
    second.as_object_mut().unwrap().remove("max_tokens");
    second["max_completion_tokens"] = json!(7);
    let second_input = stub_chat_tokens(&second);
    let r2 = gw.call("/v1/chat/completions", &second).await;
    assert_eq!(r2.status, 200, "{}", r2.text);
    assert_eq!(r2.json()["usage"]["completion_tokens"], 7);

    gw.wait_nothing_held().await;
    let (used, held) = gw.limit(BOB, "tokens").await;
    assert_eq!(used, expected_input + 20 + second_input + 7, "bob's tokens");
    assert_eq!(held, 0);

    let callers = gw.caller_records().await;
    assert_eq!(callers.len(), 2, "{callers:#?}");
    for (rec, input, output, bound) in [
        (&callers[0], expected_input, 20, 50),
        (&callers[1], second_input, 7, 7),
    ] {
        assert_eq!(rec["kind"], "settled", "{rec}");
        assert_eq!(rec["model"], "gpt-4o");
        assert_eq!(rec["scopes"], json!(["tenant:acme", BOB]));
        assert_eq!(
            amount(rec, "held", "input_tokens"),
            input,
            "the estimate: {rec}"
        );
        assert_eq!(
            amount(rec, "held", "output_tokens"),
            bound,
            "the bound: {rec}"
        );
        assert_eq!(amount(rec, "charged", "input_tokens"), input, "{rec}");
        assert_eq!(amount(rec, "charged", "output_tokens"), output, "{rec}");
        assert_eq!(amount(rec, "charged", "tokens"), input + output, "{rec}");
        assert_eq!(
            amount(rec, "charged", "cost_micros"),
            cost_micros(input, output, GPT4O_IN_MICROS, GPT4O_OUT_MICROS),
            "{rec}"
        );
        assert_eq!(rec["late"], false);
    }
    let attempts = gw.attempt_records().await;
    assert_eq!(attempts.len(), 2, "{attempts:#?}");
    assert_eq!(attempts[0]["scopes"][1], gw.upstream_scope());
    assert_eq!(
        amount(&attempts[0], "charged", "input_tokens"),
        expected_input
    );
    assert_eq!(amount(&attempts[0], "charged", "output_tokens"), 20);

    // What went upstream: the body as sent, the gateway's own upstream
    // key, never the client's.
    let seen = gw.stub.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen[0].body, first,
        "a whole call's body is forwarded unchanged"
    );
    assert_eq!(
        seen[0].headers.get("authorization").map(String::as_str),
        Some(format!("Bearer {UPSTREAM_KEY}").as_str())
    );
    for req in &seen {
        for (name, value) in &req.headers {
            assert!(
                !value.contains(KEY),
                "the client's key went upstream in {name}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_embeddings_and_messages_settle_exactly() {
    let gw = Gw::start(Setup::new("apis")).await;
    let responses = json!({
        "model": "gpt-4o",
        "instructions": "Answer in French.",
        "input": "How are you today?",
        "max_output_tokens": 7
    });
    let embeddings = json!({
        "model": "text-embedding-3-small",
        "input": ["the quick brown fox", "jumps over the lazy dog", "¿qué tal?"],
        "dimensions": 4
    });
    let messages = json!({
        "model": "claude-x",
        "max_tokens": 30,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Name three rivers."}]
    });
    let expected = [
        (
            "/v1/responses",
            &responses,
            allowance_stub::formula::responses_input_tokens(responses.as_object().unwrap())
                .unwrap(),
            7,
            7,
        ),
        (
            "/v1/embeddings",
            &embeddings,
            allowance_stub::formula::embeddings_input_tokens(embeddings.as_object().unwrap())
                .unwrap(),
            0,
            0,
        ),
        (
            "/v1/messages",
            &messages,
            allowance_stub::formula::messages_input_tokens(messages.as_object().unwrap()).unwrap(),
            20,
            30,
        ),
    ];
    for (path, body, input, output, _) in &expected {
        let req = if *path == "/v1/messages" {
            // Anthropic's SDK sends its key in x-api-key.
            gw.client
                .post(gw.url(path))
                .header("x-api-key", KEY)
                .header("anthropic-version", "2023-06-01")
                .json(body)
        } else {
            gw.post(path).json(body)
        };
        let r = read(req).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text);
        let v = r.json();
        assert_eq!(usage_input(path, &v), *input, "{path}: the stub's count");
        assert_eq!(usage_output(path, &v), *output, "{path}");
    }
    gw.wait_nothing_held().await;
    let callers = gw.caller_records().await;
    assert_eq!(callers.len(), 3, "{callers:#?}");
    for (rec, (path, _, input, output, bound)) in callers.iter().zip(&expected) {
        assert_eq!(rec["kind"], "settled", "{path}: {rec}");
        assert_eq!(
            amount(rec, "held", "input_tokens"),
            *input,
            "{path} estimate: {rec}"
        );
        assert_eq!(
            amount(rec, "held", "output_tokens"),
            *bound,
            "{path} held output: {rec}"
        );
        assert_eq!(
            amount(rec, "charged", "input_tokens"),
            *input,
            "{path}: {rec}"
        );
        assert_eq!(
            amount(rec, "charged", "output_tokens"),
            *output,
            "{path}: {rec}"
        );
    }
    // Priced models are charged by the model table; the embedding model is
    // not in it (no cost derived).
    assert_eq!(
        amount(&callers[0], "charged", "cost_micros"),
        cost_micros(expected[0].2, 7, GPT4O_IN_MICROS, GPT4O_OUT_MICROS)
    );
    assert_eq!(
        amount(&callers[2], "charged", "cost_micros"),
        cost_micros(expected[2].2, 20, CLAUDE_IN_MICROS, CLAUDE_OUT_MICROS)
    );
    let (used, held) = gw.limit(BOB, "tokens").await;
    assert_eq!(used, expected.iter().map(|e| e.2 + e.3).sum::<u64>());
    assert_eq!(held, 0);

    // Anthropic's call went upstream with the gateway's key in x-api-key
    // and the client's anthropic-version, and without the client's key.
    let sent = gw.stub.requests();
    let msg = sent
        .iter()
        .find(|r| r.path == "/v1/messages")
        .expect("forwarded");
    assert_eq!(
        msg.headers.get("x-api-key").map(String::as_str),
        Some(UPSTREAM_KEY)
    );
    assert_eq!(
        msg.headers.get("anthropic-version").map(String::as_str),
        Some("2023-06-01")
    );
    for req in &sent {
        for (name, value) in &req.headers {
            assert!(
                !value.contains(KEY),
                "the client's key went upstream in {name}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_list_is_the_configured_routes() {
    let mut setup = Setup::new("models");
    setup.models = r#"["gpt-4o", "claude-x", "text-embedding-3-small"]"#.to_string();
    let gw = Gw::start(setup).await;
    let r = read(gw.client.get(gw.url("/v1/models")).bearer_auth(KEY)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let v = r.json();
    assert_eq!(v["object"], "list");
    let mut ids: Vec<&str> = v["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| {
            assert_eq!(m["object"], "model", "{m}");
            assert_eq!(m["owned_by"], "models", "{m}");
            m["id"].as_str().expect("an id")
        })
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, ["claude-x", "gpt-4o", "text-embedding-3-small"]);

    for req in [
        gw.client.get(gw.url("/v1/models")),
        gw.client.get(gw.url("/v1/models")).bearer_auth("not-a-key"),
    ] {
        let r = read(req).await;
        assert_eq!(r.status, 401, "{}", r.text);
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    }
    assert_eq!(
        gw.stub.stats().total,
        0,
        "listing models asks nothing upstream"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_estimates_equal_the_upstreams_count_on_every_fixture() {
    let mut setup = Setup::new("fixtures");
    setup.user_limits =
        r#"[{ dimension = "tokens", capacity = 100000000, window = "total" }]"#.to_string();
    let gw = Gw::start(setup).await;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../allowance-estimate/fixtures");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("the fixtures")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|n| n.ends_with(".json"))
        .collect();
    names.sort();
    let mut checked = Vec::new();
    for name in &names {
        let path = if name.starts_with("chat_") {
            "/v1/chat/completions"
        } else if name.starts_with("responses_") {
            "/v1/responses"
        } else if name.starts_with("anthropic_") {
            "/v1/messages"
        } else {
            continue;
        };
        let body: Value = serde_json::from_slice(&std::fs::read(dir.join(name)).expect("readable"))
            .expect("a JSON fixture");
        let obj = body.as_object().expect("an object");
        // The stub's own implementation of the formula: what it reports.
        let reported = match path {
            "/v1/chat/completions" => allowance_stub::formula::chat_input_tokens(obj),
            "/v1/responses" => allowance_stub::formula::responses_input_tokens(obj),
            _ => allowance_stub::formula::messages_input_tokens(obj),
        }
        .expect("a valid fixture");
        // As given, and with streaming flipped: both paths settle.
        let mut flipped = body.clone();
        let streams = body["stream"] == true;
        if streams {
            let f = flipped.as_object_mut().unwrap();
            f.remove("stream");
            f.remove("stream_options");
        } else {
            flipped["stream"] = json!(true);
        }
        // The whole call first: it counts the prompt, so the stream finds
        // the count cached and holds it exactly from the start (a long
        // stream not counted yet starts on a bound: `gateway_bound.rs`).
        let mut variants = [("as given", &body), ("stream flipped", &flipped)];
        if streams {
            variants.reverse();
        }
        for (variant, b) in variants {
            let r = gw.call(path, b).await;
            assert_eq!(r.status, 200, "{name} {variant}: {}", r.text);
            if b["stream"] != true {
                assert_eq!(
                    usage_input(path, &r.json()),
                    reported,
                    "{name}: the stub's count"
                );
            }
            checked.push((format!("{name} ({variant})"), reported));
            // A stream settles after its last byte: wait for its record, so
            // the log keeps the calls' order.
            gw.wait_caller_records(checked.len()).await;
        }
    }
    for family in ["chat_", "responses_", "anthropic_"] {
        for kind in ["english", "code", "multilingual"] {
            let want = format!("{family}{kind}.json");
            assert!(
                checked.iter().any(|(n, _)| n.starts_with(&want)),
                "fixture {want} is missing: {names:?}"
            );
        }
    }
    gw.wait_nothing_held().await;
    let callers = gw.caller_records().await;
    assert_eq!(callers.len(), checked.len());
    let mut wrong = Vec::new();
    for ((name, reported), rec) in checked.iter().zip(&callers) {
        let estimate = amount(rec, "held", "input_tokens");
        let settled = amount(rec, "charged", "input_tokens");
        if estimate != *reported || settled != *reported {
            wrong.push(format!(
                "{name}: estimate {estimate}, upstream {reported}, settled {settled}"
            ));
        }
    }
    assert!(wrong.is_empty(), "estimates off:\n{}", wrong.join("\n"));
}

/// One bad request and what it must get.
struct Bad {
    what: &'static str,
    path: &'static str,
    key: Option<&'static str>,
    headers: Vec<(&'static str, &'static str)>,
    body: Vec<u8>,
    status: u16,
    /// OpenAI's `param` (None: not checked beyond the status and shape).
    param: Option<&'static str>,
}

fn bad(what: &'static str, path: &'static str, body: &str, status: u16) -> Bad {
    Bad {
        what,
        path,
        key: Some(KEY),
        headers: Vec::new(),
        body: body.as_bytes().to_vec(),
        status,
        param: None,
    }
}

impl Bad {
    fn param(mut self, p: &'static str) -> Self {
        self.param = Some(p);
        self
    }
    fn key(mut self, k: Option<&'static str>) -> Self {
        self.key = k;
        self
    }
    fn header(mut self, name: &'static str, value: &'static str) -> Self {
        self.headers.push((name, value));
        self
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_before_anything_is_held_or_forwarded() {
    let mut setup = Setup::new("badinput");
    setup.models = r#"["gpt-4o", "claude-x"]"#.to_string();
    setup.max_body_bytes = Some(4096);
    let gw = Gw::start(setup).await;
    let ok_chat =
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_tokens":5}"#;
    let ok_msg =
        r#"{"model":"claude-x","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#;
    let big = format!(
        r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "a".repeat(5000)
    );
    let cases = vec![
        bad("no key", "/v1/chat/completions", ok_chat, 401).key(None),
        bad("unknown key", "/v1/chat/completions", ok_chat, 401).key(Some("sk-wrong")),
        bad("no key, Anthropic", "/v1/messages", ok_msg, 401).key(None),
        bad("basic auth", "/v1/chat/completions", ok_chat, 401)
            .key(None)
            .header("authorization", "Basic Z3c6a2V5"),
        bad(
            "task scope on a key without it",
            "/v1/chat/completions",
            ok_chat,
            403,
        )
        .key(Some(KEY_NARROW))
        .header("x-allowance-task", "t1"),
        bad(
            "another user than the key's",
            "/v1/chat/completions",
            ok_chat,
            403,
        )
        .header("x-allowance-user", "mallory"),
        bad("another tenant", "/v1/chat/completions", ok_chat, 403)
            .header("x-allowance-tenant", "globex"),
        bad(
            "a scope id with bad characters",
            "/v1/chat/completions",
            ok_chat,
            400,
        )
        .header("x-allowance-task", "no spaces!"),
        bad(
            "invalid JSON",
            "/v1/chat/completions",
            r#"{"model": "gpt-4o","#,
            400,
        ),
        bad("an empty body", "/v1/chat/completions", "", 400),
        bad("not an object", "/v1/chat/completions", "[1, 2]", 400),
        bad(
            "no model",
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"hi"}]}"#,
            400,
        )
        .param("model"),
        bad(
            "a model that is not a string",
            "/v1/chat/completions",
            r#"{"model":42,"messages":[]}"#,
            400,
        )
        .param("model"),
        bad(
            "an unknown model",
            "/v1/chat/completions",
            r#"{"model":"gpt-9-ultra","messages":[{"role":"user","content":"hi"}]}"#,
            400,
        )
        .param("model"),
        bad(
            "a negative max_tokens",
            "/v1/chat/completions",
            r#"{"model":"gpt-4o","messages":[],"max_tokens":-1}"#,
            400,
        )
        .param("max_tokens"),
        bad(
            "a string max_tokens",
            "/v1/chat/completions",
            r#"{"model":"gpt-4o","messages":[],"max_tokens":"ten"}"#,
            400,
        )
        .param("max_tokens"),
        bad(
            "a fractional max_completion_tokens",
            "/v1/chat/completions",
            r#"{"model":"gpt-4o","messages":[],"max_completion_tokens":1.5}"#,
            400,
        )
        .param("max_completion_tokens"),
        bad(
            "a bad max_output_tokens",
            "/v1/responses",
            r#"{"model":"gpt-4o","input":"hi","max_output_tokens":"x"}"#,
            400,
        )
        .param("max_output_tokens"),
        bad(
            "stream not a boolean",
            "/v1/chat/completions",
            r#"{"model":"gpt-4o","messages":[],"stream":"yes"}"#,
            400,
        )
        .param("stream"),
        bad(
            "messages not an array",
            "/v1/chat/completions",
            r#"{"model":"gpt-4o","messages":"hi"}"#,
            400,
        )
        .param("messages"),
        bad(
            "Anthropic without max_tokens",
            "/v1/messages",
            r#"{"model":"claude-x","messages":[{"role":"user","content":"hi"}]}"#,
            400,
        ),
        bad(
            "a body over max_body_bytes",
            "/v1/chat/completions",
            &big,
            413,
        ),
        bad(
            "a body over max_body_bytes, Anthropic",
            "/v1/messages",
            &big,
            413,
        ),
    ];
    let mut wrong = Vec::new();
    for case in &cases {
        let mut req = gw
            .client
            .post(gw.url(case.path))
            .header("content-type", "application/json")
            .body(case.body.clone());
        if let Some(k) = case.key {
            req = req.bearer_auth(k);
        }
        for (n, v) in &case.headers {
            req = req.header(*n, *v);
        }
        let r = match try_read(req).await {
            Ok(r) => r,
            Err(e) => {
                wrong.push(format!("{}: no answer ({e})", case.what));
                continue;
            }
        };
        if r.status != case.status {
            wrong.push(format!(
                "{}: status {} (want {}): {}",
                case.what, r.status, case.status, r.text
            ));
            continue;
        }
        let Ok(v) = serde_json::from_str::<Value>(&r.text) else {
            wrong.push(format!("{}: not JSON: {}", case.what, r.text));
            continue;
        };
        if case.path == "/v1/messages" {
            let want = match case.status {
                401 => "authentication_error",
                403 => "permission_error",
                _ => "invalid_request_error",
            };
            if v["type"] != "error" || v["error"]["type"] != want {
                wrong.push(format!("{}: not Anthropic's {want} shape: {v}", case.what));
            }
        } else {
            if !v["error"]["message"].is_string() || !v["error"]["type"].is_string() {
                wrong.push(format!("{}: not OpenAI's error shape: {v}", case.what));
            }
            if let Some(p) = case.param
                && v["error"]["param"] != p
            {
                wrong.push(format!(
                    "{}: param {} (want {p}): {v}",
                    case.what, v["error"]["param"]
                ));
            }
        }
        if case.what == "a scope id with bad characters"
            && !v
                .to_string()
                .to_ascii_lowercase()
                .contains("x-allowance-task")
        {
            wrong.push(format!("{}: the header is not named: {v}", case.what));
        }
    }
    assert!(wrong.is_empty(), "wrong answers:\n{}", wrong.join("\n"));
    assert_eq!(
        gw.stub.stats().total,
        0,
        "a bad call was forwarded: {:#?}",
        gw.stub.requests()
    );
    assert!(
        gw.usage_log().await.is_empty(),
        "a bad call touched the ledger"
    );
    assert_eq!(gw.held_reservations("tenant:acme").await, 0);
    assert_eq!(gw.limit(BOB, "tokens").await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_errors_name_the_offending_field() {
    // Anthropic's error shape has no `param`: the field must be in the
    // message, or the client cannot tell what to fix.
    let gw = Gw::start(Setup::new("anthropicfield")).await;
    let cases = [
        (
            "max_tokens",
            json!({"model": "claude-x", "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "max_tokens",
            json!({"model": "claude-x", "max_tokens": "x", "messages": []}),
        ),
        (
            "messages",
            json!({"model": "claude-x", "max_tokens": 5, "messages": "hi"}),
        ),
        ("model", json!({"max_tokens": 5, "messages": []})),
    ];
    let mut wrong = Vec::new();
    for (field, body) in &cases {
        let r = read(
            gw.client
                .post(gw.url("/v1/messages"))
                .header("x-api-key", KEY)
                .header("anthropic-version", "2023-06-01")
                .json(body),
        )
        .await;
        assert_eq!(r.status, 400, "{body}: {}", r.text);
        let v = r.json();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        if !v["error"]["message"].as_str().unwrap_or("").contains(field) {
            wrong.push(format!("{body} -> {v}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "messages that do not name the field:\n{}",
        wrong.join("\n")
    );
    assert_eq!(gw.stub.stats().total, 0);
}

/// A scope header that repeats what the gateway key fixes agrees with it
/// and is accepted, whether or not the kind is one the client may add
/// (GATEWAY.md); another value is a 403. (Found by an audit: agreeing
/// with the key's own user was refused.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scope_header_agreeing_with_the_key_is_accepted() {
    let gw = Gw::start(Setup::new("agreeing")).await;
    let r = read(
        gw.post("/v1/chat/completions")
            .header("x-allowance-user", "bob")
            .json(&chat("hi", 5)),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = read(
        gw.post("/v1/chat/completions")
            .header("x-allowance-user", "mallory")
            .json(&chat("hi", 5)),
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.text);
    assert_eq!(gw.stub.stats().total, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_scope_header_is_a_clean_error() {
    // `X-Allowance-` with nothing after the prefix is a valid header name.
    let gw = Gw::start(Setup::new("emptyscope")).await;
    let r = try_read(
        gw.post("/v1/chat/completions")
            .header("x-allowance-", "x")
            .json(&chat("hi", 5)),
    )
    .await;
    let r = r.unwrap_or_else(|e| panic!("the gateway dropped the connection (a panic?): {e}"));
    assert!(
        r.status == 400 || r.status == 403,
        "status {}: {}",
        r.status,
        r.text
    );
    assert_eq!(gw.stub.stats().total, 0);
    assert!(gw.usage_log().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_of_exactly_max_body_bytes_is_accepted() {
    let mut setup = Setup::new("bodylimit");
    setup.max_body_bytes = Some(2048);
    let gw = Gw::start(setup).await;
    let pad_to = |len: usize| {
        let skeleton =
            r#"{"model":"gpt-4o","max_tokens":5,"messages":[{"role":"user","content":""}]}"#;
        let fill = "x".repeat(len - skeleton.len());
        skeleton.replace(r#""content":"""#, &format!(r#""content":"{fill}""#))
    };
    let exact = pad_to(2048);
    assert_eq!(exact.len(), 2048);
    let r = read(
        gw.post("/v1/chat/completions")
            .header("content-type", "application/json")
            .body(exact),
    )
    .await;
    assert_eq!(r.status, 200, "a body of exactly the limit: {}", r.text);
    let over = pad_to(2049);
    let r = read(
        gw.post("/v1/chat/completions")
            .header("content-type", "application/json")
            .body(over),
    )
    .await;
    assert_eq!(r.status, 413, "{}", r.text);
    assert_eq!(gw.stub.stats().total, 1, "only the first was forwarded");
    gw.wait_nothing_held().await;
    assert_eq!(gw.caller_records().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budget_denials_speak_each_providers_shape_and_forward_nothing() {
    let mut setup = Setup::new("denials");
    // One request per minute per task; 300 tokens in all per agent.
    setup.task_limits =
        r#"[{ dimension = "requests", capacity = 1, window = "bucket", period = "60s" }]"#
            .to_string();
    setup.agent_limits =
        r#"[{ dimension = "tokens", capacity = 300, window = "total" }]"#.to_string();
    let gw = Gw::start(setup).await;
    let openai = |scope: (&'static str, &'static str), max_tokens: u64| {
        gw.post("/v1/chat/completions")
            .header(scope.0, scope.1)
            .json(&chat("Count to three.", max_tokens))
    };
    let anthropic = |scope: (&'static str, &'static str), max_tokens: u64| {
        gw.client
            .post(gw.url("/v1/messages"))
            .header("x-api-key", KEY)
            .header("anthropic-version", "2023-06-01")
            .header(scope.0, scope.1)
            .json(&json!({
                "model": "claude-x",
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": "Count to three."}]
            }))
    };
    let task = ("x-allowance-task", "t1");
    let agent = ("x-allowance-agent", "a1");

    // Room for one of each, then denials.
    assert_eq!(read(openai(task, 10)).await.status, 200);
    assert_eq!(read(openai(agent, 100)).await.status, 200);
    let forwarded = gw.stub.stats().total;
    assert_eq!(forwarded, 2);
    let (agent_used, _) = gw.limit("tenant:acme/agent:a1", "tokens").await;
    assert!(agent_used > 0 && agent_used < 100, "{agent_used}");

    // 429: the rate limit, with when to come back.
    let r = read(openai(task, 10)).await;
    assert_eq!(r.status, 429, "{}", r.text);
    let retry_after: u64 = r
        .header("retry-after")
        .expect("retry-after on a 429")
        .parse()
        .expect("whole seconds");
    assert!((1..=60).contains(&retry_after), "retry-after {retry_after}");
    let retry_after_ms: u64 = r
        .header("retry-after-ms")
        .expect("retry-after-ms")
        .parse()
        .unwrap();
    assert!(retry_after_ms > 0 && retry_after_ms.div_ceil(1000) == retry_after);
    // The limit that said no, in the headers a success carries too.
    assert_eq!(r.header("x-ratelimit-limit-requests").as_deref(), Some("1"));
    assert_eq!(
        r.header("x-ratelimit-remaining-requests").as_deref(),
        Some("0")
    );
    assert!(r.header("x-ratelimit-reset-requests").is_some());
    let v = r.json();
    assert_eq!(v["error"]["code"], "rate_limited", "{v}");
    assert!(v["error"]["message"].is_string());
    assert_eq!(
        v["error"]["allowance"]["scope"], "tenant:acme/task:t1",
        "{v}"
    );
    assert_eq!(v["error"]["allowance"]["dimension"], "requests", "{v}");

    // 402: the budget, which no retry helps (no retry-after).
    let r = read(openai(agent, 300 - agent_used - 5)).await;
    assert_eq!(r.status, 402, "{}", r.text);
    assert_eq!(r.header("retry-after"), None);
    let v = r.json();
    assert_eq!(v["error"]["type"], "insufficient_quota", "{v}");
    assert_eq!(v["error"]["code"], "budget_exhausted", "{v}");
    assert_eq!(
        v["error"]["allowance"]["scope"], "tenant:acme/agent:a1",
        "{v}"
    );
    assert_eq!(v["error"]["allowance"]["dimension"], "tokens", "{v}");

    // 422: larger than the whole budget.
    let r = read(openai(agent, 5000)).await;
    assert_eq!(r.status, 422, "{}", r.text);
    assert_eq!(r.json()["error"]["code"], "exceeds_limit");

    // The same three in Anthropic's shape.
    let r = read(anthropic(task, 10)).await;
    assert_eq!(r.status, 429, "{}", r.text);
    assert!(r.header("retry-after").is_some());
    assert_eq!(
        r.header("anthropic-ratelimit-requests-limit").as_deref(),
        Some("1")
    );
    assert!(r.header("anthropic-ratelimit-requests-reset").is_some());
    let v = r.json();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    let r = read(anthropic(agent, 300 - agent_used - 5)).await;
    assert_eq!(r.status, 402, "{}", r.text);
    let v = r.json();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "billing_error", "{v}");
    let r = read(anthropic(agent, 5000)).await;
    assert_eq!(r.status, 422, "{}", r.text);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");

    assert_eq!(
        gw.stub.stats().total,
        forwarded,
        "a denied call was forwarded"
    );
    gw.wait_nothing_held().await;
    assert_eq!(
        gw.caller_records().await.len(),
        2,
        "denials leave no record"
    );
    assert_eq!(
        gw.limit("tenant:acme/agent:a1", "tokens").await,
        (agent_used, 0)
    );
}

/// A body that is not JSON by its content type is a 415, and a wrong
/// method a 405 with `Allow`, each in the provider's error shape (never an
/// empty body), with nothing held or forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_content_type_or_method_is_refused_in_the_providers_shape() {
    let gw = Gw::start(Setup::new("wrongshape")).await;
    let body = chat("hi", 3).to_string();
    for content_type in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        None,
    ] {
        let mut req = gw
            .client
            .post(gw.url("/v1/chat/completions"))
            .bearer_auth(KEY)
            .body(body.clone());
        if let Some(t) = content_type {
            req = req.header("content-type", t);
        }
        let r = read(req).await;
        assert_eq!(r.status, 415, "{content_type:?}: {}", r.text);
        let v = r.json();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
    // With parameters, it is still JSON.
    let r = read(
        gw.client
            .post(gw.url("/v1/chat/completions"))
            .bearer_auth(KEY)
            .header("content-type", "application/json; charset=utf-8")
            .body(body.clone()),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let forwarded = gw.stub.stats().total;

    for (method, path, allow, anthropic) in [
        (reqwest::Method::GET, "/v1/chat/completions", "POST", false),
        (reqwest::Method::DELETE, "/v1/messages", "POST", true),
        (reqwest::Method::POST, "/v1/models", "GET", false),
    ] {
        let r = read(
            gw.client
                .request(method.clone(), gw.url(path))
                .bearer_auth(KEY),
        )
        .await;
        assert_eq!(r.status, 405, "{method} {path}: {}", r.text);
        assert_eq!(r.header("allow").as_deref(), Some(allow));
        let v = r.json();
        if anthropic {
            assert_eq!(
                (&v["type"], &v["error"]["type"]),
                (&json!("error"), &json!("invalid_request_error")),
                "{v}"
            );
        } else {
            assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        }
        assert!(
            v["error"]["message"].as_str().unwrap().contains(path),
            "{v}"
        );
    }
    assert_eq!(
        gw.stub.stats().total,
        forwarded,
        "a refused call was forwarded"
    );
    gw.wait_nothing_held().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_without_usage_is_charged_as_reserved() {
    let gw = Gw::start(Setup::new("nousage")).await;
    let reply = json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "gpt-4o",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "hi"}}]
    });
    gw.stub
        .enqueue([allowance_stub::Scripted::status(200).body(reply.clone())])
        .unwrap();
    let body = chat("Say hi.", 40);
    let input = stub_chat_tokens(&body);
    let r = gw.call("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json(), reply, "passed on as it came");
    gw.wait_nothing_held().await;
    let rec = &gw.caller_records().await[0];
    assert_eq!(rec["kind"], "settled");
    // Never free: the estimate and the whole bound.
    assert_eq!(amount(rec, "charged", "input_tokens"), input, "{rec}");
    assert_eq!(amount(rec, "charged", "output_tokens"), 40, "{rec}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_scope_headers_count_the_call_on_those_scopes() {
    let mut setup = Setup::new("clientscopes");
    setup.agent_limits =
        r#"[{ dimension = "tokens", capacity = 10000, window = "total" }]"#.to_string();
    setup.task_limits =
        r#"[{ dimension = "tokens", capacity = 5000, window = "total" }]"#.to_string();
    let gw = Gw::start(setup).await;
    let body = chat("Plan the next step.", 12);
    let input = stub_chat_tokens(&body);
    let r = read(
        gw.post("/v1/chat/completions")
            .header("X-Allowance-Agent", "planner-7")
            .header("X-Allowance-Task", "run42-t7")
            .json(&body),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    // The tightest tokens limit over the call's scopes is the task's.
    assert_eq!(
        r.header("x-ratelimit-limit-tokens").as_deref(),
        Some("5000")
    );
    assert_eq!(
        r.header("x-ratelimit-remaining-tokens"),
        Some((5000 - input - 12).to_string())
    );
    gw.wait_nothing_held().await;
    let rec = &gw.caller_records().await[0];
    let mut scopes: Vec<String> = rec["scopes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    scopes.sort();
    assert_eq!(
        scopes,
        [
            "tenant:acme",
            "tenant:acme/agent:planner-7",
            "tenant:acme/task:run42-t7",
            "tenant:acme/user:bob"
        ]
    );
    for scope in [
        BOB,
        "tenant:acme/agent:planner-7",
        "tenant:acme/task:run42-t7",
    ] {
        assert_eq!(gw.limit(scope, "tokens").await, (input + 12, 0), "{scope}");
    }
}
