//! The input-token formula against hand-written sums, and every fixture
//! against a second, independent implementation of the contract.
//!
//! `T` is computed with tiktoken-rs directly (`common::t`), never with the
//! crate's counter.

mod common;

use allowance_estimate::{Api, Estimate, Tokenizer, estimate, estimate_uncached};
use common::*;
use serde_json::{Value, json};

fn input(api: Api, body: &Value) -> u64 {
    let cached = estimate(api, body, Tokenizer::O200kBase).unwrap();
    let uncached = estimate_uncached(api, body, Tokenizer::O200kBase).unwrap();
    assert_eq!(cached, uncached);
    cached.input_tokens
}

// The contract's worked example: 3 + T("user") + T("Hello!") + 3 = 9.
#[test]
fn worked_example() {
    let body = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "Hello!"}]});
    assert_eq!(
        input(Api::ChatCompletions, &body),
        3 + t("user") + t("Hello!") + 3
    );
    assert_eq!(input(Api::ChatCompletions, &body), 9);
}

// Every string field counts, `name` adds 1, `tool_calls` and a null content
// count as compact JSON, text parts count their text and images 765, other
// parts nothing; `tools` and `functions` count as compact JSON.
#[test]
fn chat_message_fields() {
    let calls = json!([{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]);
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let functions = json!([{"name": "legacy", "parameters": {}}]);
    let body = json!({
        "model": "gpt-4o",
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "name": "ana", "content": [
                {"type": "text", "text": "Weather here?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            ]},
            {"role": "assistant", "content": null, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "18°C, light rain"},
        ],
        "tools": tools,
        "functions": functions,
        "temperature": 0.2,
    });
    let expected = (3 + t("system") + t("Be terse."))
        + (3 + t("user") + t("ana") + 1 + t("Weather here?") + 765)
        + (3 + t("assistant") + t("null") + tj(&calls))
        + (3 + t("tool") + t("call_1") + t("18°C, light rain"))
        + 3
        + tj(&tools)
        + tj(&functions);
    assert_eq!(input(Api::ChatCompletions, &body), expected);
}

// Special-token text is ordinary text: `<|endoftext|>` is several tokens.
#[test]
fn special_token_text_counts_as_text() {
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "<|endoftext|><|im_start|>"}]});
    let expected = 3 + t("user") + t("<|endoftext|><|im_start|>") + 3;
    assert!(t("<|endoftext|><|im_start|>") > 2);
    assert_eq!(input(Api::ChatCompletions, &body), expected);
}

// `instructions` and a string `input` count as system and user messages.
#[test]
fn responses_string_input() {
    let body = json!({"model": "gpt-4.1", "instructions": "Talk like a pirate.",
        "input": "Are semicolons optional in JavaScript?"});
    let expected = (3 + t("system") + t("Talk like a pirate."))
        + (3 + t("user") + t("Are semicolons optional in JavaScript?"))
        + 3;
    assert_eq!(input(Api::Responses, &body), expected);
}

// Input items count by the chat rule: their `type`, `call_id`, `arguments`
// and `output` strings too; `input_file` parts count nothing.
#[test]
fn responses_items() {
    let tools = json!([{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]);
    let body = json!({
        "model": "gpt-4.1",
        "input": [
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "What is in this image and file?"},
                {"type": "input_image", "image_url": "https://example.invalid/a.png"},
                {"type": "input_file", "file_id": "file-abc"},
            ]},
            {"type": "function_call", "call_id": "call_9", "name": "lookup", "arguments": "{\"q\":\"x\"}"},
            {"type": "function_call_output", "call_id": "call_9", "output": "nothing found"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Nothing.", "annotations": []}]},
        ],
        "tools": tools,
    });
    let expected = (3 + t("message") + t("user") + t("What is in this image and file?") + 765)
        + (3 + t("function_call") + t("call_9") + t("lookup") + 1 + t("{\"q\":\"x\"}"))
        + (3 + t("function_call_output") + t("call_9") + t("nothing found"))
        + (3 + t("assistant") + t("Nothing."))
        + 3
        + tj(&tools);
    assert_eq!(input(Api::Responses, &body), expected);
}

// A Responses body with no `input` (a `previous_response_id` continuation)
// still counts the priming and instructions.
#[test]
fn responses_without_input() {
    let body =
        json!({"model": "gpt-4.1", "previous_response_id": "resp_1", "instructions": "Go on."});
    assert_eq!(
        input(Api::Responses, &body),
        3 + t("system") + t("Go on.") + 3
    );
}

// Anthropic: `system` as a string or blocks; text blocks count their text,
// images 765, `tool_use`/`tool_result` blocks their compact JSON.
#[test]
fn anthropic_blocks() {
    let tool_use = json!({"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Oslo"}});
    let tool_result = json!({"type": "tool_result", "tool_use_id": "toolu_01", "content": "-3°C"});
    let tools = json!([{"name": "get_weather", "input_schema": {"type": "object"}}]);
    let body = json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 1024,
        "system": [{"type": "text", "text": "You are a meteorologist.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                {"type": "text", "text": "Is it cold there?"},
            ]},
            {"role": "assistant", "content": [tool_use]},
            {"role": "user", "content": [tool_result]},
        ],
        "tools": tools,
    });
    let expected = (3 + t("system") + t("You are a meteorologist."))
        + (3 + t("user") + 765 + t("Is it cold there?"))
        + (3 + t("assistant") + tj(&tool_use))
        + (3 + t("user") + tj(&tool_result))
        + 3
        + tj(&tools);
    assert_eq!(input(Api::AnthropicMessages, &body), expected);

    let plain = json!({"model": "claude-haiku-4-5", "max_tokens": 64, "system": "Be brief.",
        "messages": [{"role": "user", "content": "Hi"}]});
    let expected = (3 + t("system") + t("Be brief.")) + (3 + t("user") + t("Hi")) + 3;
    assert_eq!(input(Api::AnthropicMessages, &plain), expected);
}

// Embeddings: strings count their tokens, token arrays their length, no
// overhead.
#[test]
fn embeddings_inputs() {
    let one = json!({"model": "text-embedding-3-small", "input": "The food was delicious."});
    assert_eq!(input(Api::Embeddings, &one), t("The food was delicious."));
    let many =
        json!({"model": "text-embedding-3-small", "input": ["first line", "second, longer line"]});
    assert_eq!(
        input(Api::Embeddings, &many),
        t("first line") + t("second, longer line")
    );
    let ids = json!({"model": "text-embedding-3-small", "input": [[1, 2, 3], [4, 5]]});
    assert_eq!(input(Api::Embeddings, &ids), 5);
    let flat = json!({"model": "text-embedding-3-small", "input": [9906, 1917, 0]});
    assert_eq!(input(Api::Embeddings, &flat), 3);
}

// The tokenizer matters: cl100k_base counts multilingual text differently.
#[test]
fn tokenizer_choice_changes_the_count() {
    let body = chat("multilingual");
    let o200k = estimate(Api::ChatCompletions, &body, Tokenizer::O200kBase).unwrap();
    let cl100k = estimate(Api::ChatCompletions, &body, Tokenizer::Cl100kBase).unwrap();
    assert!(
        cl100k.input_tokens > o200k.input_tokens,
        "{cl100k:?} vs {o200k:?}"
    );
}

// The estimate's other fields: the output bound per API, stream, and
// whether usage will come back.
#[test]
fn bounds_stream_and_usage_flags() {
    let msgs = json!([{"role": "user", "content": "x"}]);
    let chat = |extra: Value| {
        let mut body = json!({"model": "gpt-4o", "messages": msgs});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        estimate(Api::ChatCompletions, &body, Tokenizer::O200kBase).unwrap()
    };
    let e = chat(json!({"max_tokens": 10, "max_completion_tokens": 20}));
    assert_eq!(
        (e.output_bound, e.stream, e.include_usage),
        (Some(20), false, false)
    );
    assert_eq!(chat(json!({"max_tokens": 10})).output_bound, Some(10));
    assert_eq!(chat(json!({"max_tokens": null})).output_bound, None);
    assert_eq!(chat(json!({})).output_bound, None);
    assert_eq!(
        chat(json!({"max_tokens": 9_007_199_254_740_992_u64})).output_bound,
        Some(1 << 53)
    );
    let s = chat(json!({"stream": true, "stream_options": {"include_usage": true}}));
    assert_eq!((s.stream, s.include_usage), (true, true));
    let s = chat(json!({"stream": true, "stream_options": {"include_usage": false}}));
    assert_eq!((s.stream, s.include_usage), (true, false));

    let r = estimate(
        Api::Responses,
        &json!({"model": "o4-mini", "input": "x", "max_output_tokens": 300, "stream": true}),
        Tokenizer::O200kBase,
    )
    .unwrap();
    assert_eq!(
        (r.output_bound, r.stream, r.include_usage),
        (Some(300), true, true)
    );
    let r = estimate(
        Api::Responses,
        &json!({"model": "o4-mini", "input": "x"}),
        Tokenizer::O200kBase,
    )
    .unwrap();
    assert_eq!(
        (r.output_bound, r.stream, r.include_usage),
        (None, false, true)
    );

    let a = estimate(
        Api::AnthropicMessages,
        &json!({"model": "claude-opus-4-1", "max_tokens": 0, "messages": msgs}),
        Tokenizer::O200kBase,
    )
    .unwrap();
    assert_eq!(
        (a.output_bound, a.stream, a.include_usage),
        (Some(0), false, true)
    );

    let e = estimate(
        Api::Embeddings,
        &json!({"model": "text-embedding-3-large", "input": "x"}),
        Tokenizer::Cl100kBase,
    )
    .unwrap();
    assert_eq!(
        e,
        Estimate {
            model: "text-embedding-3-large".into(),
            input_tokens: 1,
            output_bound: Some(0),
            stream: false,
            include_usage: false
        }
    );
}

/// The contract written out a second time, as plainly as possible, to check
/// every fixture against.
fn reference(api: Api, body: &Value) -> u64 {
    fn message(m: &Value, anthropic: bool) -> u64 {
        let mut n = 3;
        for (key, value) in m.as_object().unwrap() {
            n += match value {
                Value::String(s) => t(s),
                Value::Array(ps) if key == "content" => ps.iter().map(|p| part(p, anthropic)).sum(),
                other => tj(other),
            };
        }
        n + u64::from(m.get("name").is_some_and(Value::is_string))
    }
    fn part(p: &Value, anthropic: bool) -> u64 {
        if let Some(text) = p.get("text").and_then(Value::as_str) {
            t(text)
        } else if ["image_url", "input_image", "image"]
            .iter()
            .any(|k| p["type"] == *k)
        {
            765
        } else if anthropic {
            tj(p)
        } else {
            0
        }
    }
    let tools: u64 = ["tools", "functions"]
        .iter()
        .filter_map(|k| body.get(*k))
        .map(tj)
        .sum();
    let synthetic = |role: &str, content: &Value, anthropic: bool| {
        message(&json!({"role": role, "content": content}), anthropic)
    };
    match api {
        Api::ChatCompletions => {
            body["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| message(m, false))
                .sum::<u64>()
                + 3
                + tools
        }
        Api::Responses => {
            let instructions = body
                .get("instructions")
                .map_or(0, |i| synthetic("system", i, false));
            let input = match &body["input"] {
                Value::String(_) => synthetic("user", &body["input"], false),
                Value::Array(items) => items.iter().map(|m| message(m, false)).sum(),
                _ => 0,
            };
            instructions + input + 3 + tools
        }
        Api::AnthropicMessages => {
            let system = body
                .get("system")
                .map_or(0, |s| synthetic("system", s, true));
            system
                + body["messages"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| message(m, true))
                    .sum::<u64>()
                + 3
                + tools
        }
        Api::Embeddings => unreachable!("no embeddings fixtures"),
    }
}

// Every fixture, in every shape, counts what the plain reference counts.
#[test]
fn fixtures_match_the_reference() {
    for name in CHAT_FIXTURES {
        for (api, body) in [
            (Api::ChatCompletions, chat(name)),
            (Api::AnthropicMessages, anthropic(name)),
            (Api::Responses, responses(name)),
        ] {
            assert_eq!(input(api, &body), reference(api, &body), "{api:?} {name}");
        }
    }
}
