//! Fixtures shared by the tests and the benchmark: loading, and deriving the
//! Anthropic and Responses shapes of a chat conversation.
//!
//! The `anthropic_*.json` and `responses_*.json` fixtures are the output of
//! [`to_anthropic`] and [`to_responses`] on the chat ones (a test checks it);
//! the 32K-token ones are not committed, to keep the repository small, and
//! are derived at run time.

#![allow(dead_code)] // each test binary uses a different part

use std::path::PathBuf;

use serde_json::{Map, Value, json};

/// The chat fixtures, by name, without the `chat_` prefix and `.json`.
pub const CHAT_FIXTURES: [&str; 7] = [
    "100",
    "english",
    "code",
    "multilingual",
    "multiturn_tools",
    "4k",
    "32k",
];

/// Fixtures whose Anthropic and Responses shapes are committed too.
pub const CONVERTED_FIXTURES: [&str; 6] = [
    "100",
    "english",
    "code",
    "multilingual",
    "multiturn_tools",
    "4k",
];

pub fn fixture_path(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(file)
}

/// Reads `fixtures/<file>` as JSON.
pub fn load(file: &str) -> Value {
    let path = fixture_path(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

/// The chat fixture `name` (`"4k"` reads `chat_4k.json`).
pub fn chat(name: &str) -> Value {
    load(&format!("chat_{name}.json"))
}

/// The Anthropic shape of the chat fixture `name`: committed, or derived
/// for the 32K one.
pub fn anthropic(name: &str) -> Value {
    if CONVERTED_FIXTURES.contains(&name) {
        load(&format!("anthropic_{name}.json"))
    } else {
        to_anthropic(&chat(name))
    }
}

/// The Responses shape of the chat fixture `name`.
pub fn responses(name: &str) -> Value {
    if CONVERTED_FIXTURES.contains(&name) {
        load(&format!("responses_{name}.json"))
    } else {
        to_responses(&chat(name))
    }
}

fn output_cap(chat: &Value) -> Option<Value> {
    chat.get("max_completion_tokens")
        .or_else(|| chat.get("max_tokens"))
        .cloned()
}

/// System messages joined, as one `system`/`instructions` string.
fn system_text(messages: &[Value]) -> Option<String> {
    let texts: Vec<&str> = messages
        .iter()
        .filter(|m| m["role"] == "system" || m["role"] == "developer")
        .filter_map(|m| m["content"].as_str())
        .collect();
    (!texts.is_empty()).then(|| texts.join("\n\n"))
}

/// The chat body as an Anthropic Messages body: system messages become
/// `system`; tool calls become `tool_use` blocks and tool results
/// `tool_result` blocks in a user turn; image URLs become `image` blocks;
/// consecutive turns of one role merge (Anthropic alternates roles); `name`
/// is dropped (Anthropic has none).
pub fn to_anthropic(chat: &Value) -> Value {
    let messages = chat["messages"]
        .as_array()
        .expect("chat fixture has messages");
    let mut turns: Vec<(String, Vec<Value>)> = Vec::new();
    for m in messages {
        let role = m["role"].as_str().unwrap_or("user");
        let (role, blocks) = match role {
            "system" | "developer" => continue,
            "tool" => (
                "user",
                vec![json!({
                    "type": "tool_result",
                    "tool_use_id": m["tool_call_id"],
                    "content": m["content"],
                })],
            ),
            "assistant" => {
                let mut blocks = anthropic_blocks(&m["content"]);
                for call in m["tool_calls"].as_array().into_iter().flatten() {
                    let arguments = call["function"]["arguments"].as_str().unwrap_or("{}");
                    blocks.push(json!({
                        "type": "tool_use",
                        "id": call["id"],
                        "name": call["function"]["name"],
                        "input": serde_json::from_str::<Value>(arguments).unwrap_or(json!({})),
                    }));
                }
                ("assistant", blocks)
            }
            _ => ("user", anthropic_blocks(&m["content"])),
        };
        match turns.last_mut() {
            Some((last, existing)) if last == role => existing.extend(blocks),
            _ => turns.push((role.to_owned(), blocks)),
        }
    }
    let messages: Vec<Value> = turns
        .into_iter()
        .map(|(role, blocks)| {
            // A lone text block reads as the plain string form.
            let content = match blocks.as_slice() {
                [only] if only["type"] == "text" => only["text"].clone(),
                _ => Value::Array(blocks),
            };
            json!({"role": role, "content": content})
        })
        .collect();
    let mut body = Map::new();
    body.insert("model".into(), json!("claude-sonnet-4-5"));
    body.insert("max_tokens".into(), output_cap(chat).unwrap_or(json!(1024)));
    if let Some(system) = system_text(chat["messages"].as_array().unwrap()) {
        body.insert("system".into(), json!(system));
    }
    body.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = chat.get("tools").and_then(Value::as_array) {
        let tools: Vec<Value> = tools
            .iter()
            .map(|t| {
                let f = &t["function"];
                json!({"name": f["name"], "description": f["description"], "input_schema": f["parameters"]})
            })
            .collect();
        body.insert("tools".into(), Value::Array(tools));
    }
    if let Some(stream) = chat.get("stream") {
        body.insert("stream".into(), stream.clone());
    }
    Value::Object(body)
}

fn anthropic_blocks(content: &Value) -> Vec<Value> {
    match content {
        Value::String(s) => vec![json!({"type": "text", "text": s})],
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p["type"].as_str() {
                Some("image_url") => json!({
                    "type": "image",
                    "source": {"type": "url", "url": p["image_url"]["url"]},
                }),
                _ => json!({"type": "text", "text": p["text"]}),
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The chat body as a Responses body: system messages become
/// `instructions`; messages become input items (string content stays a
/// string; parts become `input_text`/`input_image`); tool calls become
/// `function_call` items and tool results `function_call_output` items;
/// `name` is dropped.
pub fn to_responses(chat: &Value) -> Value {
    let messages = chat["messages"]
        .as_array()
        .expect("chat fixture has messages");
    let mut input = Vec::new();
    for m in messages {
        match m["role"].as_str().unwrap_or("user") {
            "system" | "developer" => {}
            "tool" => input.push(json!({
                "type": "function_call_output",
                "call_id": m["tool_call_id"],
                "output": m["content"],
            })),
            role => {
                match &m["content"] {
                    Value::String(s) => input.push(json!({"role": role, "content": s})),
                    Value::Array(parts) => {
                        let parts: Vec<Value> = parts
                            .iter()
                            .map(|p| match p["type"].as_str() {
                                Some("image_url") => json!({
                                    "type": "input_image",
                                    "image_url": p["image_url"]["url"],
                                    "detail": p["image_url"]["detail"].as_str().unwrap_or("auto"),
                                }),
                                _ => json!({"type": "input_text", "text": p["text"]}),
                            })
                            .collect();
                        input.push(json!({"role": role, "content": parts}));
                    }
                    _ => {}
                }
                for call in m["tool_calls"].as_array().into_iter().flatten() {
                    input.push(json!({
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": call["function"]["name"],
                        "arguments": call["function"]["arguments"],
                    }));
                }
            }
        }
    }
    let mut body = Map::new();
    body.insert("model".into(), chat["model"].clone());
    if let Some(system) = system_text(messages) {
        body.insert("instructions".into(), json!(system));
    }
    body.insert("input".into(), Value::Array(input));
    if let Some(cap) = output_cap(chat) {
        body.insert("max_output_tokens".into(), cap);
    }
    if let Some(tools) = chat.get("tools").and_then(Value::as_array) {
        let tools: Vec<Value> = tools
            .iter()
            .map(|t| {
                let f = &t["function"];
                let mut tool = json!({
                    "type": "function",
                    "name": f["name"],
                    "description": f["description"],
                    "parameters": f["parameters"],
                });
                if let Some(strict) = f.get("strict") {
                    tool["strict"] = strict.clone();
                }
                tool
            })
            .collect();
        body.insert("tools".into(), Value::Array(tools));
    }
    if let Some(stream) = chat.get("stream") {
        body.insert("stream".into(), stream.clone());
    }
    Value::Object(body)
}

/// `T(s)`: tiktoken-rs's `o200k_base` count, computed here directly so the
/// tests do not trust the crate's own counter.
pub fn t(s: &str) -> u64 {
    tiktoken_rs::o200k_base_singleton().encode_ordinary(s).len() as u64
}

/// `T(compact JSON of v)`.
pub fn tj(v: &Value) -> u64 {
    t(&serde_json::to_string(v).unwrap())
}
