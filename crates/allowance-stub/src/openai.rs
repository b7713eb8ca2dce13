//! OpenAI's wire shapes: chat completions (and their chunks), the
//! Responses API (object and streaming events), embeddings, models, errors.

use bytes::Bytes;
use serde_json::{Value, json};

use crate::body::{Events, data_event, named_event};
use crate::call::{Call, EmbeddingShape};
use crate::text::{OUTPUT_WORD, new_id, output_text, unix_s};

const SYSTEM_FINGERPRINT: &str = "fp_allowance_stub";

/// The models `GET /v1/models` lists; any model name is accepted anyway.
pub(crate) const MODELS: [&str; 5] = [
    "gpt-4o-mini",
    "gpt-4o",
    "gpt-4.1-mini",
    "text-embedding-3-small",
    "text-embedding-3-large",
];

/// The error object for `status`, with the `type` and `code` the real API
/// uses for it.
pub(crate) fn error_body(status: u16, message: &str, param: Option<&str>) -> Value {
    let (kind, code) = match status {
        401 => ("invalid_request_error", Value::from("invalid_api_key")),
        429 => ("requests", Value::from("rate_limit_exceeded")),
        400..=499 => ("invalid_request_error", Value::Null),
        _ => ("server_error", Value::Null),
    };
    json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
}

/// The message the real API sends with a bare `status`.
pub(crate) fn default_message(status: u16) -> &'static str {
    match status {
        401 => "Incorrect API key provided.",
        403 => "You are not allowed to sample from this model.",
        404 => "The model does not exist or you do not have access to it.",
        429 => "Rate limit reached for requests. Please try again later.",
        400..=499 => "Invalid request.",
        500 => "The server had an error while processing your request. Sorry about that!",
        503 => "The engine is currently overloaded, please try again later.",
        _ => "The server had an error processing your request.",
    }
}

fn chat_usage(input_tokens: u64, text_tokens: u64, reasoning_tokens: u64) -> Value {
    let output_tokens = text_tokens + reasoning_tokens;
    json!({
        "prompt_tokens": input_tokens,
        "completion_tokens": output_tokens,
        "total_tokens": input_tokens + output_tokens,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": reasoning_tokens,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0
        }
    })
}

fn finish_reason(hit_bound: bool) -> &'static str {
    if hit_bound { "length" } else { "stop" }
}

/// A `chat.completion` object.
pub(crate) fn chat_json(call: &Call, output_tokens: u64, hit_bound: bool) -> Value {
    json!({
        "id": new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": unix_s(),
        "model": call.model,
        "choices": [{
            "index": 0,
            "message": {
                "role": "assistant",
                "content": output_text(output_tokens),
                "refusal": null,
                "annotations": []
            },
            "logprobs": null,
            "finish_reason": finish_reason(hit_bound)
        }],
        "usage": chat_usage(call.input_tokens, output_tokens, call.reasoning_tokens),
        "service_tier": "default",
        "system_fingerprint": SYSTEM_FINGERPRINT
    })
}

/// `chat.completion.chunk` events: a role chunk, one chunk per token, a
/// finish chunk, the usage chunk only with `include_usage` (every other
/// chunk then says `"usage": null`), and `[DONE]`.
pub(crate) fn chat_events(call: &Call, output_tokens: u64, hit_bound: bool) -> Events {
    let id = new_id("chatcmpl-");
    let created = unix_s();
    let chunk = |delta: Value, finish: Value| {
        let mut chunk = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": call.model,
            "service_tier": "default",
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]
        });
        if call.include_usage {
            chunk["usage"] = Value::Null;
        }
        data_event(&chunk)
    };
    let head = vec![chunk(
        json!({"role": "assistant", "content": "", "refusal": null}),
        Value::Null,
    )];
    // Every token chunk is the same bytes: build it once.
    let token = chunk(json!({"content": OUTPUT_WORD}), Value::Null);
    let tokens = vec![token; usize::try_from(output_tokens).unwrap_or(0)];
    let mut tail = vec![chunk(json!({}), Value::from(finish_reason(hit_bound)))];
    if call.include_usage {
        tail.push(data_event(&json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": call.model,
            "service_tier": "default",
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [],
            "usage": chat_usage(call.input_tokens, output_tokens, call.reasoning_tokens)
        })));
    }
    tail.push(Bytes::from_static(b"data: [DONE]\n\n"));
    Events { head, tokens, tail }
}

fn responses_usage(input_tokens: u64, text_tokens: u64, reasoning_tokens: u64) -> Value {
    let output_tokens = text_tokens + reasoning_tokens;
    json!({
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens
    })
}

/// A `response` object in `status`, with the request fields the real API
/// echoes.
fn response_object(
    call: &Call,
    id: &str,
    created: u64,
    status: &str,
    output: Value,
    usage: Value,
) -> Value {
    let echo = |field: &str, default: Value| call.echo.get(field).cloned().unwrap_or(default);
    json!({
        "id": id,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": false,
        "error": null,
        "incomplete_details": null,
        "instructions": echo("instructions", Value::Null),
        "max_output_tokens": echo("max_output_tokens", Value::Null),
        "model": call.model,
        "output": output,
        "parallel_tool_calls": true,
        "previous_response_id": echo("previous_response_id", Value::Null),
        "reasoning": {"effort": null, "summary": null},
        "service_tier": "default",
        "store": true,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": echo("tools", json!([])),
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": null,
        "metadata": echo("metadata", json!({}))
    })
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "annotations": [], "logprobs": [], "text": text})
}

fn message_item(item_id: &str, status: &str, content: Value) -> Value {
    json!({"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content})
}

/// A completed `response` object.
pub(crate) fn responses_json(call: &Call, output_tokens: u64) -> Value {
    let text = output_text(output_tokens);
    let item = message_item(&new_id("msg_"), "completed", json!([text_part(&text)]));
    response_object(
        call,
        &new_id("resp_"),
        unix_s(),
        "completed",
        json!([item]),
        responses_usage(call.input_tokens, output_tokens, call.reasoning_tokens),
    )
}

/// The Responses API's events, each with its `type` and a rising
/// `sequence_number`, ending with `response.completed` and its usage.
pub(crate) fn responses_events(call: &Call, output_tokens: u64) -> Events {
    let id = new_id("resp_");
    let item_id = new_id("msg_");
    let created = unix_s();
    let text = output_text(output_tokens);
    let mut sequence = 0_u64;
    let mut event = |kind: &str, mut fields: Value| {
        fields["type"] = Value::from(kind);
        fields["sequence_number"] = Value::from(sequence);
        sequence += 1;
        named_event(kind, &fields)
    };
    let in_progress = response_object(call, &id, created, "in_progress", json!([]), Value::Null);
    let head = vec![
        event("response.created", json!({"response": in_progress})),
        event("response.in_progress", json!({"response": in_progress})),
        event(
            "response.output_item.added",
            json!({"output_index": 0, "item": message_item(&item_id, "in_progress", json!([]))}),
        ),
        event(
            "response.content_part.added",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": text_part("")}),
        ),
    ];
    let tokens = (0..output_tokens)
        .map(|_| {
            event(
                "response.output_text.delta",
                json!({
                    "item_id": item_id,
                    "output_index": 0,
                    "content_index": 0,
                    "delta": OUTPUT_WORD,
                    "logprobs": []
                }),
            )
        })
        .collect();
    let done_item = message_item(&item_id, "completed", json!([text_part(&text)]));
    let completed = response_object(
        call,
        &id,
        created,
        "completed",
        json!([done_item]),
        responses_usage(call.input_tokens, output_tokens, call.reasoning_tokens),
    );
    let tail = vec![
        event(
            "response.output_text.done",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
        ),
        event(
            "response.content_part.done",
            json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": text_part(&text)}),
        ),
        event(
            "response.output_item.done",
            json!({"output_index": 0, "item": done_item}),
        ),
        event("response.completed", json!({"response": completed})),
    ];
    Events { head, tokens, tail }
}

/// The same unit vector for every input: the stub has no meaning to embed.
fn unit_vector(dimensions: u32) -> Vec<f32> {
    let component = 1.0 / (f64::from(dimensions)).sqrt();
    #[allow(clippy::cast_possible_truncation)]
    let component = component as f32;
    vec![component; dimensions as usize]
}

const BASE64_ALPHABET: &[u8; 64] =
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard padded base64, enough for `encoding_format: "base64"`.
fn base64(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(BASE64_ALPHABET[((n >> shift) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// An embeddings `list`; with `base64`, each vector is its little-endian
/// `f32` bytes in base64, as the real API (and the Python SDK's default).
pub(crate) fn embeddings_json(call: &Call, shape: EmbeddingShape) -> Value {
    let vector = unit_vector(shape.dimensions);
    let embedding = if shape.base64 {
        let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
        Value::from(base64(&bytes))
    } else {
        json!(vector)
    };
    let data: Vec<Value> = (0..shape.inputs)
        .map(|index| json!({"object": "embedding", "index": index, "embedding": embedding}))
        .collect();
    json!({
        "object": "list",
        "data": data,
        "model": call.model,
        "usage": {"prompt_tokens": call.input_tokens, "total_tokens": call.input_tokens}
    })
}

/// `GET /v1/models`.
pub(crate) fn models_json() -> Value {
    let data: Vec<Value> = MODELS
        .iter()
        .map(|id| json!({"id": id, "object": "model", "created": 1_700_000_000, "owned_by": "system"}))
        .collect();
    json!({"object": "list", "data": data})
}

#[cfg(test)]
mod tests {
    use super::base64;

    #[test]
    fn base64_matches_rfc_4648_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (plain, encoded) in cases {
            assert_eq!(base64(plain.as_bytes()), encoded, "{plain:?}");
        }
    }
}
