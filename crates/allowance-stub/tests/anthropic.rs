//! The Anthropic Messages endpoint over real HTTP: object and stream shapes,
//! usage per the input formula, and errors in Anthropic's shape.

mod common;

use allowance_stub::{OUTPUT_WORD, Scripted};
use common::{post, post_json, post_sse, stub, t, tj};
use serde_json::{Value, json};

const MESSAGES: &str = "/v1/messages";

#[tokio::test]
async fn message_non_streaming_shape_and_usage() {
    let stub = stub().await;
    let request = json!({
        "model": "claude-haiku-4-5",
        "max_tokens": 6,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Hello!"}]
    });
    let response = post(&stub, MESSAGES, &request).await;
    assert_eq!(response.status(), 200);
    assert!(response.headers().contains_key("request-id"));
    let body: Value = response.json().await.expect("JSON");
    assert_eq!(body["type"], "message");
    assert_eq!(body["role"], "assistant");
    assert_eq!(body["model"], "claude-haiku-4-5");
    assert_eq!(body["content"][0]["type"], "text");
    assert_eq!(body["content"][0]["text"], OUTPUT_WORD.repeat(6));
    assert_eq!(body["stop_reason"], "max_tokens");
    let expected = (3 + t("system") + t("Be brief.")) + (3 + t("user") + t("Hello!")) + 3;
    assert_eq!(body["usage"]["input_tokens"], expected);
    assert_eq!(body["usage"]["output_tokens"], 6);
}

#[tokio::test]
async fn blocks_tools_and_system_blocks_follow_the_formula() {
    let stub = stub().await;
    let tool_use =
        json!({"type": "tool_use", "id": "tu_1", "name": "weather", "input": {"city": "Paris"}});
    let tool_result = json!({"type": "tool_result", "tool_use_id": "tu_1", "content": "sunny"});
    let tools = json!([{"name": "weather", "description": "Weather now",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let request = json!({
        "model": "claude-sonnet-4-6",
        "max_tokens": 1000,
        "system": [{"type": "text", "text": "You are a forecaster.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "Weather in Paris?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
            ]},
            {"role": "assistant", "content": [tool_use]},
            {"role": "user", "content": [tool_result]}
        ],
        "tools": tools
    });
    let expected = (3 + t("system") + t("You are a forecaster."))
        + (3 + t("user") + t("Weather in Paris?") + 765)
        + (3 + t("assistant") + tj(&tool_use))
        + (3 + t("user") + tj(&tool_result))
        + 3
        + tj(&tools);
    let (status, body) = post_json(&stub, MESSAGES, &request).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["input_tokens"], expected);
    assert_eq!(body["usage"]["output_tokens"], 20);
    assert_eq!(body["stop_reason"], "end_turn");
}

#[tokio::test]
async fn message_stream_events() {
    let stub = stub().await;
    let request = json!({
        "model": "claude-haiku-4-5",
        "max_tokens": 3,
        "stream": true,
        "messages": [{"role": "user", "content": "Hi"}]
    });
    let (headers, events) = post_sse(&stub, MESSAGES, &request).await;
    assert!(headers.contains_key("request-id"));
    let names: Vec<&str> = events
        .iter()
        .map(|e| e.event.as_deref().unwrap_or(""))
        .collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    for event in &events {
        assert_eq!(
            event.json()["type"],
            event.event.as_deref().unwrap_or(""),
            "type matches the event line"
        );
    }
    let start = events[0].json();
    assert_eq!(
        start["message"]["usage"]["input_tokens"],
        3 + t("user") + t("Hi") + 3
    );
    assert_eq!(start["message"]["content"], json!([]));
    for event in &events[3..6] {
        let delta = event.json();
        assert_eq!(delta["delta"]["type"], "text_delta");
        assert_eq!(delta["delta"]["text"], OUTPUT_WORD);
    }
    let message_delta = events[7].json();
    assert_eq!(message_delta["usage"]["output_tokens"], 3);
    assert_eq!(message_delta["delta"]["stop_reason"], "max_tokens");
}

#[tokio::test]
async fn errors_use_anthropic_shape() {
    let stub = stub().await;
    let response = common::client()
        .post(format!("{}{MESSAGES}", stub.base_url()))
        .body("][")
        .send()
        .await
        .expect("answers");
    assert_eq!(response.status(), 400);
    assert!(response.headers().contains_key("request-id"));
    let body: Value = response.json().await.expect("JSON");
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "invalid_request_error");

    let (status, body) =
        post_json(&stub, MESSAGES, &json!({"max_tokens": 5, "messages": []})).await;
    assert_eq!(status, 400);
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("model"))
    );
    let (status, body) = post_json(
        &stub,
        MESSAGES,
        &json!({"model": "m", "system": 1, "messages": []}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("system"))
    );

    stub.enqueue([
        Scripted::status(429).header("retry-after", "2"),
        Scripted::status(500),
        Scripted::status(529),
    ])
    .expect("valid");
    let request = json!({"model": "m", "max_tokens": 5, "messages": []});
    let response = post(&stub, MESSAGES, &request).await;
    assert_eq!(response.status(), 429);
    assert_eq!(
        response.headers().get("retry-after").map(|v| v.as_bytes()),
        Some(&b"2"[..])
    );
    let body: Value = response.json().await.expect("JSON");
    assert_eq!(body["error"]["type"], "rate_limit_error");
    for (status, kind) in [(500, "api_error"), (529, "overloaded_error")] {
        let (got, body) = post_json(&stub, MESSAGES, &request).await;
        assert_eq!(got, status);
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], kind);
    }
}
