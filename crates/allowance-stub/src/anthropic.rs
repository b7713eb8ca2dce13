//! Anthropic's wire shapes: the Messages API (object and streaming events),
//! models and errors.

use serde_json::{Value, json};

use crate::body::{Events, named_event};
use crate::call::Call;
use crate::text::{OUTPUT_WORD, new_id, output_text};

/// The models `GET /v1/models` lists to an Anthropic client.
pub(crate) const MODELS: [(&str, &str); 3] = [
    ("claude-sonnet-4-6", "Claude Sonnet 4.6"),
    ("claude-haiku-4-5", "Claude Haiku 4.5"),
    ("claude-opus-4-6", "Claude Opus 4.6"),
];

/// The error object for `status`, with the `type` the real API uses.
pub(crate) fn error_body(status: u16, message: &str, request_id: &str) -> Value {
    let kind = match status {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        504 => "timeout_error",
        529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": message}, "request_id": request_id})
}

/// The message the real API sends with a bare `status`.
pub(crate) fn default_message(status: u16) -> &'static str {
    match status {
        401 => "invalid x-api-key",
        403 => "Your API key does not have permission to use the specified resource.",
        404 => "The requested resource could not be found.",
        429 => "Number of request tokens has exceeded your per-minute rate limit.",
        400..=499 => "Invalid request.",
        529 => "Overloaded",
        _ => "Internal server error",
    }
}

fn stop_reason(hit_bound: bool) -> &'static str {
    if hit_bound { "max_tokens" } else { "end_turn" }
}

fn usage(input_tokens: u64, output_tokens: u64) -> Value {
    json!({
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "service_tier": "standard"
    })
}

fn message(call: &Call, id: &str, content: Value, stop: Value, usage: Value) -> Value {
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": call.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": null,
        "usage": usage
    })
}

/// A complete `message`.
pub(crate) fn message_json(call: &Call, output_tokens: u64, hit_bound: bool) -> Value {
    message(
        call,
        &new_id("msg_"),
        json!([{"type": "text", "text": output_text(output_tokens)}]),
        Value::from(stop_reason(hit_bound)),
        usage(call.input_tokens, output_tokens + call.reasoning_tokens),
    )
}

/// Messages streaming: `message_start` (input usage, and the one output
/// token the real API reports there), `content_block_start`, `ping`, one
/// `content_block_delta` per token, `content_block_stop`, `message_delta`
/// (the cumulative `output_tokens`), `message_stop`.
pub(crate) fn message_events(call: &Call, output_tokens: u64, hit_bound: bool) -> Events {
    let start = message(
        call,
        &new_id("msg_"),
        json!([]),
        Value::Null,
        usage(call.input_tokens, output_tokens.min(1)),
    );
    let head = vec![
        named_event(
            "message_start",
            &json!({"type": "message_start", "message": start}),
        ),
        named_event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        named_event("ping", &json!({"type": "ping"})),
    ];
    let token = named_event(
        "content_block_delta",
        &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": OUTPUT_WORD}}),
    );
    let tokens = vec![token; usize::try_from(output_tokens).unwrap_or(0)];
    let tail = vec![
        named_event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": 0}),
        ),
        named_event(
            "message_delta",
            &json!({
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason(hit_bound), "stop_sequence": null},
                "usage": {"output_tokens": output_tokens + call.reasoning_tokens}
            }),
        ),
        named_event("message_stop", &json!({"type": "message_stop"})),
    ];
    Events { head, tokens, tail }
}

/// `GET /v1/models` as Anthropic shapes it.
pub(crate) fn models_json() -> Value {
    let data: Vec<Value> = MODELS
        .iter()
        .map(|(id, name)| {
            json!({"type": "model", "id": id, "display_name": name, "created_at": "2026-01-01T00:00:00Z"})
        })
        .collect();
    json!({
        "data": data,
        "has_more": false,
        "first_id": MODELS[0].0,
        "last_id": MODELS[MODELS.len() - 1].0
    })
}
