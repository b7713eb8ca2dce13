//! The OpenAI endpoints over real HTTP: shapes, streaming framing, output
//! sizes, and usage computed by the input formula (the expected counts are
//! spelled out here with the test's own `T`).

mod common;

use allowance_stub::{BehaviorPatch, OUTPUT_WORD};
use common::{get_json, parse_sse, post, post_json, post_sse, stub, t, tj};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";
const RESPONSES: &str = "/v1/responses";
const EMBEDDINGS: &str = "/v1/embeddings";

fn hello_chat() -> Value {
    json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hello!"}]})
}

#[tokio::test]
async fn chat_non_streaming_shape_and_usage() {
    let stub = stub().await;
    let response = post(&stub, CHAT, &hello_chat()).await;
    assert_eq!(response.status(), 200);
    assert!(response.headers().contains_key("x-request-id"));
    let body: Value = response.json().await.expect("JSON");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "gpt-4o-mini");
    assert!(
        body["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("chatcmpl-"))
    );
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], OUTPUT_WORD.repeat(20));
    assert_eq!(choice["finish_reason"], "stop");
    let expected_input = 3 + t("user") + t("Hello!") + 3;
    assert_eq!(body["usage"]["prompt_tokens"], expected_input);
    assert_eq!(body["usage"]["completion_tokens"], 20);
    assert_eq!(body["usage"]["total_tokens"], expected_input + 20);
}

#[tokio::test]
async fn chat_bound_limits_output_and_says_length() {
    let stub = stub().await;
    let mut request = hello_chat();
    request["max_tokens"] = json!(7);
    let (_, body) = post_json(&stub, CHAT, &request).await;
    assert_eq!(body["usage"]["completion_tokens"], 7);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    // The smaller of the two bounds wins.
    request["max_completion_tokens"] = json!(4);
    let (_, body) = post_json(&stub, CHAT, &request).await;
    assert_eq!(body["usage"]["completion_tokens"], 4);
    assert_eq!(
        t(body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()),
        4
    );
    // A bound above the behaviour's output changes nothing.
    request["max_completion_tokens"] = json!(500);
    request["max_tokens"] = Value::Null;
    let (_, body) = post_json(&stub, CHAT, &request).await;
    assert_eq!(body["usage"]["completion_tokens"], 20);
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn chat_usage_follows_the_formula() {
    let stub = stub().await;
    let tool_calls = json!([{"id": "call_1", "type": "function",
        "function": {"name": "lookup", "arguments": "{\"q\":\"x\"}"}}]);
    let tools = json!([{"type": "function", "function": {"name": "lookup",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]);
    let request = json!({
        "model": "gpt-4o",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "name": "bob", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
            ]},
            {"role": "assistant", "content": null, "tool_calls": tool_calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"}
        ],
        "tools": tools
    });
    let expected = (3 + t("system") + t("You are terse."))
        + (3 + t("user") + t("bob") + 1 + t("What is in this picture?") + 765)
        + (3 + t("assistant") + t("null") + tj(&tool_calls))
        + (3 + t("tool") + t("call_1") + t("42"))
        + 3
        + tj(&tools);
    let (status, body) = post_json(&stub, CHAT, &request).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], expected);
}

#[tokio::test]
async fn chat_stream_without_include_usage_has_no_usage() {
    let stub = stub().await;
    stub.set_behavior(&BehaviorPatch {
        output_tokens: Some(5),
        ..BehaviorPatch::default()
    })
    .expect("valid");
    let mut request = hello_chat();
    request["stream"] = json!(true);
    let (headers, events) = post_sse(&stub, CHAT, &request).await;
    assert!(headers.contains_key("x-request-id"));
    assert!(
        events.iter().all(|e| e.event.is_none()),
        "chat SSE has no event lines"
    );
    assert_eq!(events.last().map(|e| e.data.as_str()), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(common::Sse::json)
        .collect();
    // role chunk, 5 token chunks, finish chunk.
    assert_eq!(chunks.len(), 7);
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert!(
            chunk.get("usage").is_none(),
            "no usage key without include_usage: {chunk}"
        );
        assert_eq!(chunk["id"], chunks[0]["id"]);
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    for chunk in &chunks[1..6] {
        assert_eq!(chunk["choices"][0]["delta"]["content"], OUTPUT_WORD);
        assert_eq!(
            t(chunk["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or_default()),
            1
        );
    }
    assert_eq!(chunks[6]["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn chat_stream_with_include_usage_ends_with_a_usage_chunk() {
    let stub = stub().await;
    let mut request = hello_chat();
    request["stream"] = json!(true);
    request["stream_options"] = json!({"include_usage": true});
    request["max_tokens"] = json!(3);
    let (_, events) = post_sse(&stub, CHAT, &request).await;
    assert_eq!(events.last().map(|e| e.data.as_str()), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(common::Sse::json)
        .collect();
    assert_eq!(chunks.len(), 1 + 3 + 1 + 1);
    let (usage_chunk, others) = chunks.split_last().expect("chunks");
    for chunk in others {
        assert_eq!(
            chunk["usage"],
            Value::Null,
            "every other chunk says usage null"
        );
        assert!(chunk.get("usage").is_some());
    }
    assert_eq!(
        others[others.len() - 1]["choices"][0]["finish_reason"],
        "length"
    );
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(
        usage_chunk["usage"]["prompt_tokens"],
        3 + t("user") + t("Hello!") + 3
    );
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 3);
    // include_usage: false is the same as absent.
    request["stream_options"] = json!({"include_usage": false});
    let (_, events) = post_sse(&stub, CHAT, &request).await;
    assert!(events.iter().all(|e| !e.data.contains("\"usage\"")));
}

#[tokio::test]
async fn stream_options_without_stream_is_refused() {
    let stub = stub().await;
    let mut request = hello_chat();
    request["stream_options"] = json!({"include_usage": true});
    let (status, body) = post_json(&stub, CHAT, &request).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "stream_options");
}

#[tokio::test]
async fn responses_non_streaming_shape_and_usage() {
    let stub = stub().await;
    let request = json!({
        "model": "gpt-4o-mini",
        "instructions": "Answer briefly.",
        "input": "Tell me a story",
        "max_output_tokens": 16
    });
    let response = post(&stub, RESPONSES, &request).await;
    assert_eq!(response.status(), 200);
    assert!(response.headers().contains_key("x-request-id"));
    let body: Value = response.json().await.expect("JSON");
    assert_eq!(body["object"], "response");
    assert_eq!(body["status"], "completed");
    assert_eq!(body["max_output_tokens"], 16);
    let item = &body["output"][0];
    assert_eq!(item["type"], "message");
    assert_eq!(item["content"][0]["type"], "output_text");
    assert_eq!(item["content"][0]["text"], OUTPUT_WORD.repeat(16));
    let expected =
        (3 + t("system") + t("Answer briefly.")) + (3 + t("user") + t("Tell me a story")) + 3;
    assert_eq!(body["usage"]["input_tokens"], expected);
    assert_eq!(body["usage"]["output_tokens"], 16);
    assert_eq!(body["usage"]["total_tokens"], expected + 16);
}

#[tokio::test]
async fn responses_array_input_follows_the_formula() {
    let stub = stub().await;
    let tools = json!([{"type": "function", "name": "f", "parameters": {"type": "object"}}]);
    let request = json!({
        "model": "gpt-4o-mini",
        "input": [
            {"role": "user", "content": [
                {"type": "input_text", "text": "Describe"},
                {"type": "input_image", "image_url": "data:image/png;base64,AA"}
            ]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A cat."}]},
            {"type": "function_call_output", "call_id": "c9", "output": "sunny"}
        ],
        "tools": tools
    });
    let expected = (3 + t("user") + t("Describe") + 765)
        + (3 + t("message") + t("assistant") + t("A cat."))
        + (3 + t("function_call_output") + t("c9") + t("sunny"))
        + 3
        + tj(&tools);
    let (status, body) = post_json(&stub, RESPONSES, &request).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["input_tokens"], expected);
}

#[tokio::test]
async fn responses_stream_events() {
    let stub = stub().await;
    let request =
        json!({"model": "gpt-4o-mini", "input": "hi", "stream": true, "max_output_tokens": 4});
    let (_, events) = post_sse(&stub, RESPONSES, &request).await;
    let names: Vec<&str> = events
        .iter()
        .map(|e| e.event.as_deref().unwrap_or(""))
        .collect();
    let mut expected = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    expected.extend(["response.output_text.delta"; 4]);
    expected.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(names, expected);
    for (index, event) in events.iter().enumerate() {
        let data = event.json();
        assert_eq!(data["type"], names[index], "type matches the event line");
        assert_eq!(
            data["sequence_number"], index,
            "sequence numbers rise from 0"
        );
    }
    assert_eq!(events[0].json()["response"]["status"], "in_progress");
    for event in &events[4..8] {
        assert_eq!(event.json()["delta"], OUTPUT_WORD);
    }
    let completed = events[events.len() - 1].json();
    assert_eq!(completed["response"]["status"], "completed");
    assert_eq!(
        completed["response"]["usage"]["input_tokens"],
        3 + t("user") + t("hi") + 3
    );
    assert_eq!(completed["response"]["usage"]["output_tokens"], 4);
    assert_eq!(
        completed["response"]["output"][0]["content"][0]["text"],
        OUTPUT_WORD.repeat(4)
    );
}

#[tokio::test]
async fn embeddings_float_and_base64() {
    let stub = stub().await;
    let request =
        json!({"model": "text-embedding-3-small", "input": ["one two", "three"], "dimensions": 8});
    let (status, body) = post_json(&stub, EMBEDDINGS, &request).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "list");
    assert_eq!(body["data"].as_array().map(Vec::len), Some(2));
    assert_eq!(body["data"][1]["index"], 1);
    assert_eq!(
        body["data"][0]["embedding"].as_array().map(Vec::len),
        Some(8)
    );
    assert_eq!(body["usage"]["prompt_tokens"], t("one two") + t("three"));
    assert_eq!(body["usage"]["total_tokens"], t("one two") + t("three"));

    let request = json!({"model": "m", "input": [[1, 2, 3], [4, 5]], "encoding_format": "base64", "dimensions": 4});
    let (_, body) = post_json(&stub, EMBEDDINGS, &request).await;
    assert_eq!(body["usage"]["prompt_tokens"], 5);
    // 4 little-endian f32 = 16 bytes = 24 base64 characters.
    assert_eq!(
        body["data"][0]["embedding"].as_str().map(str::len),
        Some(24)
    );

    let request = json!({"model": "m", "input": "a single string", "stream": true});
    let (status, body) = post_json(&stub, EMBEDDINGS, &request).await;
    assert_eq!(status, 200, "stream is ignored on embeddings");
    assert_eq!(body["usage"]["prompt_tokens"], t("a single string"));
    assert_eq!(
        body["data"][0]["embedding"].as_array().map(Vec::len),
        Some(1536)
    );
}

#[tokio::test]
async fn models_lists_openai_or_anthropic_shapes() {
    let stub = stub().await;
    let body = get_json(&stub, "/v1/models").await;
    assert_eq!(body["object"], "list");
    assert_eq!(body["data"][0]["object"], "model");
    let anthropic: Value = common::client()
        .get(format!("{}/v1/models", stub.base_url()))
        .header("anthropic-version", "2023-06-01")
        .send()
        .await
        .expect("answers")
        .json()
        .await
        .expect("JSON");
    assert_eq!(anthropic["data"][0]["type"], "model");
    assert_eq!(anthropic["has_more"], false);
}

#[tokio::test]
async fn bad_bodies_are_400_in_openai_shape() {
    let stub = stub().await;
    let response = common::client()
        .post(format!("{}{CHAT}", stub.base_url()))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("answers");
    assert_eq!(response.status(), 400);
    assert!(response.headers().contains_key("x-request-id"));
    let body: Value = response.json().await.expect("JSON");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("parse"))
    );
    assert!(body["error"].get("param").is_some() && body["error"].get("code").is_some());

    let (status, body) = post_json(&stub, CHAT, &json!({"messages": []})).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "model");
    let (status, body) = post_json(&stub, RESPONSES, &json!({"input": "x"})).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "model");

    let cases = [
        (
            CHAT,
            json!({"model": "m", "messages": [{"role": "user"}, 3]}),
            "messages[1]",
        ),
        (
            CHAT,
            json!({"model": "m", "messages": [], "max_tokens": -1}),
            "max_tokens",
        ),
        (
            CHAT,
            json!({"model": "m", "messages": [], "stream": "yes"}),
            "stream",
        ),
        (
            CHAT,
            json!({"model": "m", "messages": [], "tools": {}}),
            "tools",
        ),
        (RESPONSES, json!({"model": "m", "input": 5}), "input"),
        (
            RESPONSES,
            json!({"model": "m", "instructions": 5}),
            "instructions",
        ),
        (EMBEDDINGS, json!({"model": "m"}), "input"),
        (
            EMBEDDINGS,
            json!({"model": "m", "input": "x", "dimensions": 0}),
            "dimensions",
        ),
        (
            EMBEDDINGS,
            json!({"model": "m", "input": "x", "encoding_format": "hex"}),
            "encoding_format",
        ),
        (CHAT, json!([1, 2]), ""),
    ];
    for (path, request, param) in cases {
        let (status, body) = post_json(&stub, path, &request).await;
        assert_eq!(status, 400, "{request}");
        if param.is_empty() {
            assert_eq!(body["error"]["param"], Value::Null);
        } else {
            assert_eq!(body["error"]["param"], param, "{request} -> {body}");
            assert!(
                body["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(param)),
                "{body}"
            );
        }
    }
}

#[tokio::test]
async fn unknown_paths_are_404() {
    let stub = stub().await;
    let response = post(&stub, "/v1/completions-nope", &json!({})).await;
    assert_eq!(response.status(), 404);
    let body: Value = response.json().await.expect("JSON");
    assert_eq!(body["error"]["type"], "invalid_request_error");
}

#[test]
fn sse_parser_reads_named_and_plain_events() {
    let events = parse_sse("event: a\ndata: {\"x\":1}\n\ndata: [DONE]\n\n");
    assert_eq!(events.len(), 2);
    assert_eq!(events[0].event.as_deref(), Some("a"));
    assert_eq!(events[1].data, "[DONE]");
}

#[tokio::test]
async fn reasoning_is_billed_as_output_but_never_streamed() {
    let stub = stub().await;
    stub.set_behavior(&BehaviorPatch {
        output_tokens: Some(4),
        reasoning_tokens: Some(50),
        ..BehaviorPatch::default()
    })
    .expect("valid");
    // Whole, without a bound: all of it.
    let (status, body) = post_json(&stub, CHAT, &hello_chat()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["choices"][0]["message"]["content"],
        OUTPUT_WORD.repeat(4)
    );
    assert_eq!(body["usage"]["completion_tokens"], 54);
    assert_eq!(
        body["usage"]["completion_tokens_details"]["reasoning_tokens"],
        50
    );
    // Streamed, within a bound of 30: 4 visible, 26 reasoned, none streamed.
    let request =
        json!({"model": "gpt-4o-mini", "input": "Think.", "max_output_tokens": 30, "stream": true});
    let (_, events) = post_sse(&stub, RESPONSES, &request).await;
    let deltas = events
        .iter()
        .filter(|e| e.event.as_deref() == Some("response.output_text.delta"))
        .count();
    assert_eq!(deltas, 4);
    let completed = events.last().expect("events").json();
    let usage = &completed["response"]["usage"];
    assert_eq!(usage["output_tokens"], 30, "{usage}");
    assert_eq!(usage["output_tokens_details"]["reasoning_tokens"], 26);
}
