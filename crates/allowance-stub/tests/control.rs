//! The control API over real HTTP and through the Rust methods: behaviour,
//! scripted answers (429, 500, verbatim bodies, cuts, hangs), the
//! concurrency limit, unbuffered streaming, the request log, stats, reset.

mod common;

use std::time::{Duration, Instant};

use allowance_stub::{BehaviorPatch, MAX_RECORDED_REQUESTS, OUTPUT_WORD, Scripted, Stats};
use common::{client, control, get_json, parse_sse, post, post_json, read_until_end, stub, t};
use futures_util::StreamExt;
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";

fn chat(stream: bool) -> Value {
    json!({"model": "gpt-4o-mini", "stream": stream, "messages": [{"role": "user", "content": "Hello!"}]})
}

fn stats_of(value: &Value) -> Stats {
    serde_json::from_value(value.clone()).expect("stats shape")
}

#[tokio::test]
async fn behavior_patch_changes_only_given_keys() {
    let stub = stub().await;
    let (status, body) = control(
        &stub,
        "/_stub/behavior",
        &json!({"output_tokens": 3, "concurrency_limit": 4}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        json!({"output_tokens": 3, "token_delay_ms": 0, "first_byte_delay_ms": 0, "concurrency_limit": 4, "reasoning_tokens": 0})
    );
    let (_, body) = control(&stub, "/_stub/behavior", &json!({"token_delay_ms": 1})).await;
    assert_eq!(body["output_tokens"], 3);
    assert_eq!(body["concurrency_limit"], 4);
    let (_, body) = control(
        &stub,
        "/_stub/behavior",
        &json!({"concurrency_limit": null}),
    )
    .await;
    assert_eq!(body["concurrency_limit"], Value::Null);
    assert_eq!(body["token_delay_ms"], 1);
    assert_eq!(get_json(&stub, "/_stub/behavior").await, body);

    let (_, answer) = post_json(&stub, CHAT, &chat(false)).await;
    assert_eq!(answer["usage"]["completion_tokens"], 3);
    assert_eq!(
        answer["choices"][0]["message"]["content"],
        OUTPUT_WORD.repeat(3)
    );
}

#[tokio::test]
async fn bad_control_bodies_name_the_field() {
    let stub = stub().await;
    let cases = [
        (
            "/_stub/behavior",
            json!({"output_tokens": "many"}),
            "output_tokens",
        ),
        ("/_stub/behavior", json!({"token_delay": 5}), "token_delay"),
        (
            "/_stub/behavior",
            json!({"first_byte_delay_ms": 700_000}),
            "first_byte_delay_ms",
        ),
        (
            "/_stub/enqueue",
            json!([{"status": 429}, {"status": 99}]),
            "[1].status",
        ),
        ("/_stub/enqueue", json!([{"hang": 5}]), "hang"),
        ("/_stub/enqueue", json!([{"status": 200}]), "[0].body"),
        ("/_stub/enqueue", json!({"status": 429}), "sequence"),
    ];
    for (path, body, field) in cases {
        let (status, answer) = control(&stub, path, &body).await;
        assert_eq!(status, 400, "{body}");
        let message = answer["error"].as_str().unwrap_or_default();
        assert!(message.contains(field), "{body} -> {message}");
    }
    // A refused enqueue queues nothing.
    let (_, answer) = post_json(&stub, CHAT, &chat(false)).await;
    assert_eq!(answer["object"], "chat.completion");
}

#[tokio::test]
async fn scripted_429_500_and_verbatim_body() {
    let stub = stub().await;
    let script = json!([
        {"status": 429, "headers": {"retry-after": "1", "x-ratelimit-remaining-requests": "0"}},
        {"status": 500},
        {"status": 400, "body": {"error": {"message": "custom", "type": "invalid_request_error", "param": "x", "code": "c"}}},
        {"status": 200, "body": {"hello": "world"}, "headers": {"x-extra": "yes"}}
    ]);
    let (status, body) = control(&stub, "/_stub/enqueue", &script).await;
    assert_eq!((status, body), (200, json!({"queued": 4})));

    let response = post(&stub, CHAT, &chat(false)).await;
    assert_eq!(response.status(), 429);
    assert_eq!(
        response.headers().get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    assert!(
        response
            .headers()
            .contains_key("x-ratelimit-remaining-requests")
    );
    assert!(response.headers().contains_key("x-request-id"));
    let body: Value = response.json().await.expect("JSON");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    assert_eq!(body["error"]["param"], Value::Null);

    let (status, body) =
        post_json(&stub, "/v1/responses", &json!({"model": "m", "input": "x"})).await;
    assert_eq!(status, 500);
    assert_eq!(body["error"]["type"], "server_error");

    let (status, body) = post_json(&stub, CHAT, &chat(true)).await;
    assert_eq!(status, 400, "a scripted status wins over streaming");
    assert_eq!(body["error"]["message"], "custom");

    let response = post(&stub, CHAT, &chat(false)).await;
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers().get("x-extra").map(|v| v.as_bytes()),
        Some(&b"yes"[..])
    );
    assert_eq!(
        response.json::<Value>().await.expect("JSON"),
        json!({"hello": "world"})
    );

    // The queue is empty again: a normal answer.
    let (status, body) = post_json(&stub, CHAT, &chat(false)).await;
    assert_eq!(status, 200);
    assert_eq!(body["usage"]["completion_tokens"], 20);
}

#[tokio::test]
async fn cut_after_tokens_drops_the_stream_without_usage() {
    let stub = stub().await;
    stub.enqueue([Scripted::cut_after_tokens(5)])
        .expect("valid");
    let mut request = chat(true);
    request["stream_options"] = json!({"include_usage": true});
    let response = post(&stub, CHAT, &request).await;
    assert_eq!(response.status(), 200);
    let (text, failed) = read_until_end(response).await;
    assert!(failed, "the connection drops mid-body");
    let complete: Vec<&str> = text
        .split("\n\n")
        .filter(|block| !block.is_empty())
        .collect();
    let events = parse_sse(&complete.join("\n\n"));
    let tokens = events
        .iter()
        .filter(|e| e.data.contains(&format!("\"content\":\"{OUTPUT_WORD}\"")))
        .count();
    assert_eq!(tokens, 5);
    assert!(!text.contains("[DONE]"));
    assert!(!text.contains("prompt_tokens"));
    assert!(!text.contains("finish_reason\":\"stop"));

    // On Anthropic and Responses streams too, and mid-body when not streaming.
    stub.enqueue([
        Scripted::cut_after_tokens(2),
        Scripted::cut_after_tokens(0),
        Scripted::cut_after_tokens(1),
    ])
    .expect("valid");
    let messages = json!({"model": "m", "max_tokens": 50, "stream": true, "messages": [{"role": "user", "content": "x"}]});
    let (text, failed) = read_until_end(post(&stub, "/v1/messages", &messages).await).await;
    assert!(failed);
    assert_eq!(
        text.matches("content_block_delta").count(),
        2 * 2,
        "event line and type, twice"
    );
    assert!(!text.contains("message_delta"));
    let responses = json!({"model": "m", "input": "x", "stream": true});
    let (text, failed) = read_until_end(post(&stub, "/v1/responses", &responses).await).await;
    assert!(failed);
    assert!(text.contains("response.created") && !text.contains("response.output_text.delta"));
    assert!(!text.contains("response.completed"));
    let (text, failed) = read_until_end(post(&stub, CHAT, &chat(false)).await).await;
    assert!(failed);
    assert!(
        serde_json::from_str::<Value>(&text).is_err(),
        "a truncated body: {text}"
    );
}

#[tokio::test]
async fn hang_delays_the_answer() {
    let stub = stub().await;
    stub.enqueue([Scripted::hang_ms(400), Scripted::hang_ms(2000)])
        .expect("valid");
    let started = Instant::now();
    let (status, _) = post_json(&stub, CHAT, &chat(false)).await;
    assert_eq!(status, 200);
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "{:?}",
        started.elapsed()
    );

    // A client with a shorter timeout gives up while the stub hangs.
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(200))
        .build()
        .expect("client");
    let error = impatient
        .post(format!("{}{CHAT}", stub.base_url()))
        .json(&chat(false))
        .send()
        .await
        .err();
    assert!(error.is_some_and(|e| e.is_timeout()));
}

#[tokio::test]
async fn first_chunk_arrives_before_the_stream_ends() {
    let stub = stub().await;
    stub.set_behavior(&BehaviorPatch {
        output_tokens: Some(6),
        token_delay_ms: Some(100),
        ..BehaviorPatch::default()
    })
    .expect("valid");
    let started = Instant::now();
    let response = post(&stub, CHAT, &chat(true)).await;
    let mut stream = response.bytes_stream();
    let first = stream.next().await.expect("a first chunk").expect("bytes");
    let first_at = started.elapsed();
    assert!(String::from_utf8_lossy(&first).contains("\"role\":\"assistant\""));
    let mut rest = Vec::new();
    while let Some(chunk) = stream.next().await {
        rest.extend_from_slice(&chunk.expect("bytes"));
    }
    let done_at = started.elapsed();
    assert!(String::from_utf8_lossy(&rest).ends_with("data: [DONE]\n\n"));
    // Six tokens at 100 ms each come after the first chunk.
    assert!(
        done_at >= first_at + Duration::from_millis(500),
        "first {first_at:?}, done {done_at:?}"
    );
}

#[tokio::test]
async fn first_byte_and_token_delays_apply_to_non_streaming_answers() {
    let stub = stub().await;
    stub.set_behavior(&BehaviorPatch {
        output_tokens: Some(4),
        token_delay_ms: Some(50),
        first_byte_delay_ms: Some(200),
        ..BehaviorPatch::default()
    })
    .expect("valid");
    let started = Instant::now();
    let (status, _) = post_json(&stub, CHAT, &chat(false)).await;
    assert_eq!(status, 200);
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn concurrency_limit_refuses_the_extra_call() {
    let stub = stub().await;
    let (status, _) = control(
        &stub,
        "/_stub/behavior",
        &json!({"concurrency_limit": 2, "first_byte_delay_ms": 800}),
    )
    .await;
    assert_eq!(status, 200);
    let url = format!("{}{CHAT}", stub.base_url());
    let slow: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                client()
                    .post(url)
                    .json(&chat(false))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    while stub.stats().in_flight < 2 {
        assert!(Instant::now() < deadline, "two calls in flight");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let extra = post(&stub, CHAT, &chat(false)).await;
    assert_eq!(extra.status(), 429);
    assert!(extra.headers().get("retry-after").is_none());
    let body: Value = extra.json().await.expect("JSON");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    let anthropic = post(
        &stub,
        "/v1/messages",
        &json!({"model": "m", "max_tokens": 1, "messages": []}),
    )
    .await;
    assert_eq!(anthropic.status(), 429);
    assert_eq!(
        anthropic.json::<Value>().await.expect("JSON")["error"]["type"],
        "rate_limit_error"
    );
    for call in slow {
        assert_eq!(call.await.expect("joined").expect("answered"), 200);
    }
    let stats = stats_of(&get_json(&stub, "/_stub/stats").await);
    assert_eq!(
        stats,
        Stats {
            in_flight: 0,
            max_in_flight: 2,
            total: 4
        }
    );
}

#[tokio::test]
async fn streams_stay_in_flight_until_done() {
    let stub = stub().await;
    stub.set_behavior(&BehaviorPatch {
        output_tokens: Some(5),
        token_delay_ms: Some(100),
        ..BehaviorPatch::default()
    })
    .expect("valid");
    let response = post(&stub, CHAT, &chat(true)).await;
    assert_eq!(
        stub.stats().in_flight,
        1,
        "headers sent, body still streaming"
    );
    let (_, failed) = read_until_end(response).await;
    assert!(!failed);
    let deadline = Instant::now() + Duration::from_secs(5);
    while stub.stats().in_flight != 0 {
        assert!(Instant::now() < deadline, "the call leaves in_flight");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A client that leaves mid-stream frees its slot too.
    let response = post(&stub, CHAT, &chat(true)).await;
    drop(response);
    let deadline = Instant::now() + Duration::from_secs(5);
    while stub.stats().in_flight != 0 {
        assert!(
            Instant::now() < deadline,
            "an abandoned stream leaves in_flight"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(stub.stats().max_in_flight, 1);
}

#[tokio::test]
async fn request_log_records_path_headers_and_body() {
    let stub = stub().await;
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let body = chat(false);
    let response = client()
        .post(format!("{}{CHAT}", stub.base_url()))
        .header("Authorization", "Bearer sk-test")
        .header("X-Allowance-Tenant", "acme")
        .json(&body)
        .send()
        .await
        .expect("answers");
    assert_eq!(response.status(), 200);
    let garbage = client()
        .post(format!("{}/v1/messages", stub.base_url()))
        .body("not json")
        .send()
        .await
        .expect("answers");
    assert_eq!(garbage.status(), 400);

    let log = get_json(&stub, "/_stub/requests").await;
    let entries = log.as_array().expect("an array");
    assert_eq!(entries.len(), 2);
    assert_eq!(entries[0]["path"], CHAT);
    assert_eq!(entries[0]["headers"]["authorization"], "Bearer sk-test");
    assert_eq!(entries[0]["headers"]["x-allowance-tenant"], "acme");
    assert_eq!(entries[0]["body"], body);
    let at = entries[0]["received_at_ms"].as_u64().expect("ms");
    assert!(at >= before && at <= before + 60_000, "{at} vs {before}");
    assert_eq!(entries[1]["path"], "/v1/messages");
    assert_eq!(entries[1]["body"], "not json");
    // The Rust method sees the same log.
    let direct = stub.requests();
    assert_eq!(direct.len(), 2);
    assert_eq!(direct[0].body, body);
    assert_eq!(
        direct[0]
            .headers
            .get("x-allowance-tenant")
            .map(String::as_str),
        Some("acme")
    );

    let stats = stats_of(&get_json(&stub, "/_stub/stats").await);
    assert_eq!(
        stats,
        Stats {
            in_flight: 0,
            max_in_flight: 1,
            total: 2
        }
    );
    assert_eq!(stub.stats(), stats);
}

#[tokio::test]
async fn request_log_is_bounded() {
    let stub = stub().await;
    let http = client();
    let url = format!("{}/v1/embeddings", stub.base_url());
    let calls = MAX_RECORDED_REQUESTS + 5;
    for chunk in (0..calls).collect::<Vec<_>>().chunks(250) {
        let sends = chunk.iter().map(|i| {
            let http = http.clone();
            let url = url.clone();
            async move {
                http.post(url)
                    .body(format!("{{\"n\": {i}}}"))
                    .send()
                    .await
                    .map(|r| r.status())
            }
        });
        for status in futures_util::future::join_all(sends).await {
            assert_eq!(
                status.expect("answers"),
                400,
                "no model: refused but recorded"
            );
        }
    }
    let log = stub.requests();
    assert_eq!(log.len(), MAX_RECORDED_REQUESTS);
    assert_eq!(stub.stats().total, calls as u64);
    let mut seen: Vec<u64> = log.iter().filter_map(|r| r.body["n"].as_u64()).collect();
    seen.sort_unstable();
    // Concurrent batches arrive in any order within a batch, but the five
    // dropped are among the first batch.
    assert!(seen[0] < 250 && *seen.last().unwrap_or(&0) == calls as u64 - 1);
}

#[tokio::test]
async fn reset_clears_queue_log_stats_and_behavior() {
    let stub = stub().await;
    stub.set_behavior(&BehaviorPatch {
        output_tokens: Some(2),
        concurrency_limit: Some(Some(0)),
        ..BehaviorPatch::default()
    })
    .expect("valid");
    let (status, _) = post_json(&stub, CHAT, &chat(false)).await;
    assert_eq!(status, 429, "a limit of 0 refuses everything");
    control(&stub, "/_stub/enqueue", &json!([{"status": 500}])).await;

    let (status, body) = control(&stub, "/_stub/reset", &json!({})).await;
    assert_eq!(status, 200, "{body}");
    assert!(stub.requests().is_empty());
    assert_eq!(stub.stats(), Stats::default());
    assert_eq!(stub.behavior().output_tokens, 20);
    assert_eq!(stub.behavior().concurrency_limit, None);
    let (status, body) = post_json(&stub, CHAT, &chat(false)).await;
    assert_eq!(status, 200, "the queued 500 is gone");
    assert_eq!(body["usage"]["completion_tokens"], 20);
    assert_eq!(
        body["usage"]["prompt_tokens"],
        3 + t("user") + t("Hello!") + 3
    );

    stub.reset();
    assert_eq!(stub.stats().total, 0);
}
