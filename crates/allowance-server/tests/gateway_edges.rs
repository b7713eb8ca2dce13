//! The gateway's edges, end to end over real HTTP with the stub upstream:
//! output without a bound of the request's own, reasoning that is billed
//! but never streamed, refusals by the upstream's own limits (their headers,
//! and a wait that cannot succeed), scope headers that repeat the key, a
//! stream that breaks off, and 502s the client must not retry.

mod common_gateway;

use std::time::{Duration, Instant};

use allowance_stub::{BehaviorPatch, Scripted};
use common_gateway::*;
use serde_json::{Value, json};

/// A task budget of `tokens` (input and output together).
fn task_budget(tokens: u64) -> String {
    format!(r#"[{{ dimension = "tokens", capacity = {tokens}, window = "total" }}]"#)
}

/// A chat stream on `model` without any output bound.
fn unbounded_stream(model: &str) -> Value {
    json!({
        "model": model,
        "stream": true,
        "messages": [{"role": "user", "content": "Count forever."}]
    })
}

fn chat_errors(events: &[Sse]) -> Vec<Value> {
    events
        .iter()
        .filter_map(Sse::json)
        .filter(|v| v.get("error").is_some())
        .collect()
}

// --- F1: no bound in the request --------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_a_bound_is_cut_when_its_budget_is_spent() {
    // The model's max_output_tokens (40) is only the estimate: nothing told
    // the provider to stop there. The stream tops up past it and is cut when
    // the budget refuses, never spending past it.
    const BUDGET: u64 = 150;
    let mut setup = Setup::new("nobound-cut");
    setup.task_limits = task_budget(BUDGET);
    let gw = Gw::start(setup).await;
    gw.behave(BehaviorPatch {
        output_tokens: Some(300),
        ..Default::default()
    });
    let body = unbounded_stream("gpt-tiny");
    let input = stub_chat_tokens(&body);
    let r = read(
        gw.post("/v1/chat/completions")
            .header("x-allowance-task", "nobound")
            .json(&body),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let events = sse_events(&r.text);
    let words = hellos(&chat_content(&events));
    let errors = chat_errors(&events);
    assert_eq!(errors.len(), 1, "cut with one error event: {words} words");
    assert_eq!(
        errors[0]["error"]["code"], "budget_exhausted",
        "{}",
        errors[0]
    );
    assert!(
        words > TINY_MAX_OUTPUT,
        "stopped at the model's estimate ({words} words)"
    );
    assert!(
        input + words <= BUDGET,
        "{input} + {words} > {BUDGET}: spent past the budget"
    );
    gw.wait_nothing_held().await;
    let rec = &gw.wait_caller_records(1).await[0];
    assert_eq!(amount(rec, "charged", "output_tokens"), words, "{rec}");
    let (used, held) = gw.limit("tenant:acme/task:nobound", "tokens").await;
    assert_eq!((used, held), (input + words, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_a_bound_holds_past_the_models_estimate() {
    let gw = Gw::start(Setup::new("nobound-room")).await;
    gw.behave(BehaviorPatch {
        output_tokens: Some(100),
        ..Default::default()
    });
    let body = unbounded_stream("gpt-tiny");
    let r = gw.call("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let events = sse_events(&r.text);
    assert_eq!(hellos(&chat_content(&events)), 100);
    assert!(chat_errors(&events).is_empty(), "{}", r.text);
    gw.wait_nothing_held().await;
    let rec = &gw.wait_caller_records(1).await[0];
    assert_eq!(amount(rec, "charged", "output_tokens"), 100, "{rec}");
    // Held tranche by tranche as the output flowed, past the estimate of 40.
    let held = amount(rec, "held", "output_tokens");
    assert!((100..=116).contains(&held), "held output {held}: {rec}");
    // The request went upstream as the client sent it: no bound added.
    let sent = &gw.stub.requests()[0].body;
    assert!(sent.get("max_tokens").is_none(), "{sent}");
    assert!(sent.get("max_completion_tokens").is_none(), "{sent}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_with_a_bound_still_stops_topping_up_at_it() {
    let gw = Gw::start(Setup::new("bound-stays")).await;
    gw.behave(BehaviorPatch {
        output_tokens: Some(100),
        ..Default::default()
    });
    let mut body = unbounded_stream("gpt-tiny");
    body["max_tokens"] = json!(30);
    let r = gw.call("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(hellos(&chat_content(&sse_events(&r.text))), 30);
    gw.wait_nothing_held().await;
    let rec = &gw.wait_caller_records(1).await[0];
    assert_eq!(amount(rec, "held", "output_tokens"), 30, "{rec}");
    assert_eq!(amount(rec, "charged", "output_tokens"), 30, "{rec}");
}

// --- F2: reasoning ----------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reasoning_stream_the_budget_cannot_cover_is_refused_up_front() {
    // Reasoning is billed as output but never streamed: a stream cannot see
    // it coming, so it holds its whole bound up front, as a whole call does,
    // and is refused as the whole call would be. Not held that way, one
    // tranche is held and 1,503 output tokens are settled on a budget of 1,000.
    const BUDGET: u64 = 1_000;
    let mut setup = Setup::new("reason-refused");
    setup.task_limits = task_budget(BUDGET);
    let gw = Gw::start(setup).await;
    gw.behave(BehaviorPatch {
        output_tokens: Some(3),
        reasoning_tokens: Some(1_500),
        ..Default::default()
    });
    let bodies = [
        (
            "/v1/responses",
            json!({"model": "gpt-4o", "input": "Think hard.", "max_output_tokens": 2000,
                   "stream": true, "reasoning": {"effort": "high"}}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "gpt-4o", "max_completion_tokens": 2000, "stream": true,
                   "reasoning_effort": "high",
                   "messages": [{"role": "user", "content": "Think hard."}]}),
        ),
        (
            "/v1/messages",
            json!({"model": "claude-x", "max_tokens": 2000, "stream": true,
                   "thinking": {"type": "enabled", "budget_tokens": 1600},
                   "messages": [{"role": "user", "content": "Think hard."}]}),
        ),
    ];
    for (path, body) in &bodies {
        // The whole call's answer, and the stream's: the same refusal.
        let mut whole = body.clone();
        whole["stream"] = json!(false);
        let w = read(
            gw.post(path)
                .header("anthropic-version", "2023-06-01")
                .header("x-allowance-task", "reason")
                .json(&whole),
        )
        .await;
        let s = read(
            gw.post(path)
                .header("anthropic-version", "2023-06-01")
                .header("x-allowance-task", "reason")
                .json(body),
        )
        .await;
        assert_eq!(w.status, 422, "{path} whole: {}", w.text);
        assert_eq!(s.status, w.status, "{path} stream: {}", s.text);
    }
    assert_eq!(gw.stub.stats().total, 0, "nothing went upstream");
    let (used, held) = gw.limit("tenant:acme/task:reason", "tokens").await;
    assert_eq!((used, held), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reasoning_stream_holds_its_bound_and_settles_the_reasoning() {
    let gw = Gw::start(Setup::new("reason-held")).await;
    gw.behave(BehaviorPatch {
        output_tokens: Some(3),
        reasoning_tokens: Some(500),
        ..Default::default()
    });
    let cases = [
        (
            "/v1/responses",
            json!({"model": "gpt-4o", "input": "Think.", "max_output_tokens": 600,
                   "stream": true, "reasoning": {"effort": "low"}}),
            600,
        ),
        (
            "/v1/chat/completions",
            json!({"model": "gpt-4o", "max_completion_tokens": 600, "stream": true,
                   "reasoning_effort": "low",
                   "messages": [{"role": "user", "content": "Think."}]}),
            600,
        ),
        (
            "/v1/messages",
            json!({"model": "claude-x", "max_tokens": 600, "stream": true,
                   "thinking": {"type": "enabled", "budget_tokens": 550},
                   "messages": [{"role": "user", "content": "Think."}]}),
            600,
        ),
        // Reasoning turned off: a tranche at a time, as any stream.
        (
            "/v1/chat/completions",
            json!({"model": "gpt-4o", "max_completion_tokens": 600, "stream": true,
                   "reasoning_effort": "none",
                   "messages": [{"role": "user", "content": "Think."}]}),
            8,
        ),
        (
            "/v1/messages",
            json!({"model": "claude-x", "max_tokens": 600, "stream": true,
                   "thinking": {"type": "disabled"},
                   "messages": [{"role": "user", "content": "Think."}]}),
            8,
        ),
    ];
    for (path, body, _) in &cases {
        let r = read(
            gw.post(path)
                .header("anthropic-version", "2023-06-01")
                .json(body),
        )
        .await;
        assert_eq!(r.status, 200, "{path}: {}", r.text);
        let failed = sse_events(&r.text).iter().any(|e| {
            e.name.as_deref() == Some("error") || e.json().is_some_and(|v| v["error"].is_object())
        });
        assert!(!failed, "{path}: {}", r.text);
    }
    gw.wait_nothing_held().await;
    let recs = gw.wait_caller_records(cases.len()).await;
    for (rec, (path, _, held)) in recs.iter().zip(&cases) {
        assert_eq!(amount(rec, "held", "output_tokens"), *held, "{path}: {rec}");
        assert_eq!(
            amount(rec, "charged", "output_tokens"),
            503,
            "{path}: the reasoning is settled: {rec}"
        );
    }
}

// --- F3: refusals by the upstream's own limits -------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_limit_that_cannot_free_in_time_refuses_at_once_with_its_headers() {
    let mut setup = Setup::new("uplimit");
    setup.user_limits = r#"[{ dimension = "tokens", capacity = 1000000, window = "total" },
                            { dimension = "requests", capacity = 1000, window = "total" }]"#
        .to_string();
    let gw = Gw::start(setup).await;
    // The upstream takes one request per 10 minutes.
    let limits = json!({"limits": [
        {"dimension": "requests", "capacity": 1, "window": "bucket", "period_ms": 600_000}
    ]});
    let r = read(
        gw.client
            .put(gw.url(&format!("/v1/scopes/{}", gw.upstream_scope())))
            .json(&limits),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let body = chat("Hello.", 10);
    let first = gw.call("/v1/chat/completions", &body).await;
    assert_eq!(first.status, 200, "{}", first.text);
    assert_eq!(
        first.header("x-ratelimit-limit-requests").as_deref(),
        Some("1000")
    );
    gw.wait_nothing_held().await;

    // The caller's own limits have room; the upstream's has none for ~600 s,
    // far past the call's wait (60 s): refused at once, not after the wait.
    let started = Instant::now();
    let second = read(
        gw.post("/v1/chat/completions")
            .timeout(Duration::from_secs(30))
            .json(&body),
    )
    .await;
    let took = started.elapsed();
    assert_eq!(second.status, 429, "{}", second.text);
    assert!(took < Duration::from_secs(3), "waited {took:?} for nothing");
    let retry_after: u64 = second
        .header("retry-after")
        .expect("retry-after")
        .parse()
        .unwrap();
    assert!(retry_after > 500, "retry-after {retry_after}");
    // The headers of the limit that said no, not the caller's.
    assert_eq!(
        second.header("x-ratelimit-limit-requests").as_deref(),
        Some("1"),
        "{:?}",
        second.headers
    );
    assert_eq!(
        second.header("x-ratelimit-remaining-requests").as_deref(),
        Some("0")
    );
    let v = second.json();
    assert_eq!(v["error"]["allowance"]["scope"], gw.upstream_scope(), "{v}");
    assert_eq!(gw.stub.stats().total, 1, "the refusal went nowhere");
    gw.wait_nothing_held().await;
    let callers = gw.caller_records().await;
    assert_eq!(callers.len(), 2);
    assert_eq!(callers[1]["kind"], "refunded", "{}", callers[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_limit_blocked_by_a_hold_still_waits_for_it() {
    // A hold can end any moment (its call answers): the ledger's retry (the
    // hold's expiry, past the call's wait here) is no reason to refuse, so
    // the call waits for room as before.
    let mut setup = Setup::new("upwait");
    setup.default_ttl_ms = Some(120_000);
    let gw = Gw::start(setup).await;
    let limits = json!({"limits": [
        {"dimension": "concurrent", "capacity": 1, "window": "concurrent"}
    ]});
    let r = read(
        gw.client
            .put(gw.url(&format!("/v1/scopes/{}", gw.upstream_scope())))
            .json(&limits),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    gw.stub.enqueue([Scripted::hang_ms(400)]).unwrap();
    let body = chat("Hello.", 10);
    let (a, b) = tokio::join!(gw.call("/v1/chat/completions", &body), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        gw.call("/v1/chat/completions", &body).await
    });
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(b.status, 200, "{}", b.text);
    assert_eq!(gw.stub.stats().total, 2);
}

// --- F5: scope headers --------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scope_headers_that_repeat_the_key_agree_and_repeats_are_named() {
    let gw = Gw::start(Setup::new("scopeheaders")).await;
    let body = chat("Hello.", 5);
    let call = |headers: Vec<(&'static str, &'static str)>| {
        let mut req = gw.post("/v1/chat/completions").json(&body);
        for (k, v) in headers {
            req = req.header(k, v);
        }
        read(req)
    };
    // The key's own tenant and user: they agree, and add nothing.
    let r = call(vec![
        ("x-allowance-tenant", "acme"),
        ("x-allowance-user", "bob"),
    ])
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    // Another tenant: the key fixes it.
    let r = call(vec![("x-allowance-tenant", "globex")]).await;
    assert_eq!(r.status, 403, "{}", r.text);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("fixes tenant \"acme\""), "{msg}");
    // The same task twice: one scope.
    let r = call(vec![("x-allowance-task", "a"), ("x-allowance-task", "a")]).await;
    assert_eq!(r.status, 200, "{}", r.text);
    // Two different tasks: named as such, not as something the key fixes.
    let r = call(vec![("x-allowance-task", "a"), ("x-allowance-task", "b")]).await;
    assert_eq!(r.status, 400, "{}", r.text);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("given twice"), "{msg}");
    assert!(!msg.contains("key fixes"), "{msg}");
    gw.wait_nothing_held().await;
    let callers = gw.caller_records().await;
    assert_eq!(callers.len(), 2, "two calls went through");
    assert_eq!(
        callers[0]["scopes"],
        json!(["tenant:acme", "tenant:acme/user:bob"]),
        "{}",
        callers[0]
    );
    assert_eq!(
        callers[1]["scopes"],
        json!(["tenant:acme", "tenant:acme/user:bob", "tenant:acme/task:a"]),
        "{}",
        callers[1]
    );
}

// --- F4: a stream that breaks off ----------------------------------------------

/// Reads a body chunk by chunk: its text, and whether it ended in an error.
async fn read_to_break(req: reqwest::RequestBuilder) -> (String, bool) {
    let mut resp = req.send().await.expect("answered");
    assert_eq!(resp.status(), 200);
    let mut text = String::new();
    loop {
        match resp.chunk().await {
            Ok(Some(c)) => text.push_str(&String::from_utf8_lossy(&c)),
            Ok(None) => return (text, false),
            Err(_) => return (text, true),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_stream_sends_its_error_event_then_aborts() {
    let gw = Gw::start(Setup::new("brokenevent")).await;
    for round in 0..3 {
        gw.stub.enqueue([Scripted::cut_after_tokens(5)]).unwrap();
        let mut body = chat("Go on.", 50);
        body["stream"] = json!(true);
        let (text, aborted) = read_to_break(gw.post("/v1/chat/completions").json(&body)).await;
        let events = sse_events(&text);
        assert_eq!(hellos(&chat_content(&events)), 5, "round {round}");
        let last = events.last().and_then(Sse::json).expect("JSON");
        assert!(
            last["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("broke off")),
            "round {round}: no error event at the end:\n{text}"
        );
        assert!(aborted, "round {round}: the body ended cleanly");

        gw.stub.enqueue([Scripted::cut_after_tokens(4)]).unwrap();
        let body = json!({"model": "claude-x", "max_tokens": 50, "stream": true,
                          "messages": [{"role": "user", "content": "Go on."}]});
        let (text, aborted) = read_to_break(gw.post("/v1/messages").json(&body)).await;
        let last = sse_events(&text).last().cloned().expect("events");
        assert_eq!(
            last.name.as_deref(),
            Some("error"),
            "round {round}:\n{text}"
        );
        assert_eq!(last.json().unwrap()["error"]["type"], "api_error");
        assert!(aborted, "round {round}: the body ended cleanly");
    }
}

// --- 502s the client must not retry ---------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_after_sending_is_a_502_not_to_retry() {
    // An upstream that reads the request and hangs up without an answer:
    // the provider may have run the call.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let _ = sock.read(&mut buf).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
                drop(sock);
            });
        }
    });
    let mut setup = Setup::new("lostafter");
    setup.base_url = Some(format!("http://{addr}"));
    let gw = Gw::start(setup).await;
    let r = gw.call("/v1/chat/completions", &chat("Hello.", 5)).await;
    assert_eq!(r.status, 502, "{}", r.text);
    assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
    gw.wait_nothing_held().await;
    let callers = gw.caller_records().await;
    assert_eq!(callers[0]["kind"], "refunded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_answer_that_broke_off_is_a_502_not_to_retry() {
    let gw = Gw::start(Setup::new("wholebroke")).await;
    gw.stub.enqueue([Scripted::cut_after_tokens(3)]).unwrap();
    let r = gw.call("/v1/chat/completions", &chat("Hello.", 20)).await;
    assert_eq!(r.status, 502, "{}", r.text);
    assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_401_names_the_gateways_upstream_key() {
    let gw = Gw::start(Setup::new("up401")).await;
    gw.stub
        .enqueue([Scripted::status(401), Scripted::status(401)])
        .unwrap();
    let r = gw.call("/v1/chat/completions", &chat("Hello.", 5)).await;
    assert_eq!(r.status, 502, "{}", r.text);
    assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
    let v = r.json();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("upstream key"), "{msg}");
    assert!(
        msg.contains("Incorrect API key"),
        "the provider's word: {msg}"
    );
    assert_ne!(v["error"]["code"], "invalid_api_key", "{v}");

    let body = json!({"model": "claude-x", "max_tokens": 5,
                      "messages": [{"role": "user", "content": "Hi."}]});
    let r = gw.call("/v1/messages", &body).await;
    assert_eq!(r.status, 502, "{}", r.text);
    let v = r.json();
    assert_eq!(v["error"]["type"], "api_error", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("upstream key")
    );
    assert_eq!(gw.stub.stats().total, 2, "a 401 is not retried");
    gw.wait_nothing_held().await;
    let callers = gw.caller_records().await;
    assert!(
        callers.iter().all(|c| c["kind"] == "refunded"),
        "{callers:#?}"
    );
}

/// A call waiting for a place upstream (every one taken) waits no longer
/// than `[queue] max_wait_ms`, as it would for room in the ledger (found by
/// an audit: a call waited 19.7 s behind a 10 s call with an 8 s bound,
/// holding its caller's reservation all along).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waits_for_a_place_upstream_no_longer_than_max_wait() {
    let mut setup = Setup::new("gatewait");
    setup.max_concurrent = Some(1);
    setup.max_wait_ms = Some(600);
    let gw = Gw::start(setup).await;
    gw.stub.enqueue([Scripted::hang_ms(3_000)]).unwrap();
    let body = chat("Hello.", 10);
    let started = std::time::Instant::now();
    let (a, b) = tokio::join!(gw.call("/v1/chat/completions", &body), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let b = gw.call("/v1/chat/completions", &body).await;
        (b, started.elapsed())
    });
    let (b, b_took) = b;
    assert_eq!(a.status, 200, "{}", a.text);
    assert_eq!(b.status, 429, "{}", b.text);
    assert!(b.text.contains("upstream_busy"), "{}", b.text);
    // Generous: it must answer at its bound (0.6 s), not when the first
    // call ends (3 s).
    assert!(
        b_took < Duration::from_millis(2_500),
        "answered after {b_took:?}"
    );
    assert_eq!(gw.stub.stats().total, 1, "the refused call went nowhere");
    gw.wait_nothing_held().await;
}
