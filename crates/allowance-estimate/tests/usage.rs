//! Usage read from complete answers, shaped as the providers' documentation
//! shows them.

use allowance_estimate::{Api, PartialUsage, Usage, usage_from_response};
use serde_json::json;

fn usage(input_tokens: u64, cached_input_tokens: u64, output_tokens: u64) -> Usage {
    Usage {
        input_tokens,
        cached_input_tokens,
        output_tokens,
    }
}

// Chat: `prompt_tokens` (cached tokens included) and `completion_tokens`.
#[test]
fn chat_completion() {
    let body = json!({
        "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
        "object": "chat.completion",
        "created": 1741570283,
        "model": "gpt-4o-2024-08-06",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "The image shows a wooden boardwalk.",
            "refusal": null, "annotations": []}, "logprobs": null, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": 1117, "completion_tokens": 46, "total_tokens": 1163,
            "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
        },
        "service_tier": "default",
        "system_fingerprint": "fp_fc9f1d7035"
    });
    assert_eq!(
        usage_from_response(Api::ChatCompletions, &body),
        Some(usage(1117, 1024, 46))
    );
    // Older models and compatible servers omit the details: cached is 0.
    let plain = json!({"usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}});
    assert_eq!(
        usage_from_response(Api::ChatCompletions, &plain),
        Some(usage(9, 0, 12))
    );
}

// Responses: `input_tokens` (cached included), `output_tokens` (reasoning
// included).
#[test]
fn responses() {
    let body = json!({
        "id": "resp_67ccd3a9da748190baa7f1570fe91ac604becb25c45c1d41",
        "object": "response",
        "created_at": 1741476777,
        "status": "completed",
        "model": "o4-mini-2025-04-16",
        "output": [
            {"type": "reasoning", "id": "rs_67ccd3acc8d48190a77525dc", "summary": []},
            {"type": "message", "id": "msg_67ccd3acc8d48190a77525dc", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "In a peaceful grove beneath a silver moon...", "annotations": []}]}
        ],
        "usage": {
            "input_tokens": 328, "input_tokens_details": {"cached_tokens": 256},
            "output_tokens": 1186, "output_tokens_details": {"reasoning_tokens": 1024},
            "total_tokens": 1514
        }
    });
    assert_eq!(
        usage_from_response(Api::Responses, &body),
        Some(usage(328, 256, 1186))
    );
}

// Anthropic: `input_tokens` excludes cache reads and writes; the gateway's
// input is all three, its cached part the reads.
#[test]
fn anthropic_message() {
    let body = json!({
        "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5-20250929",
        "content": [{"type": "text", "text": "Hello! How can I help?"}],
        "stop_reason": "end_turn",
        "stop_sequence": null,
        "usage": {
            "input_tokens": 21, "cache_creation_input_tokens": 188086, "cache_read_input_tokens": 0,
            "cache_creation": {"ephemeral_5m_input_tokens": 188086, "ephemeral_1h_input_tokens": 0},
            "output_tokens": 393, "service_tier": "standard"
        }
    });
    assert_eq!(
        usage_from_response(Api::AnthropicMessages, &body),
        Some(usage(188107, 0, 393))
    );
    let cached = json!({"usage": {"input_tokens": 50, "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 100000, "output_tokens": 503}});
    assert_eq!(
        usage_from_response(Api::AnthropicMessages, &cached),
        Some(usage(100050, 100000, 503))
    );
    let plain = json!({"usage": {"input_tokens": 12, "output_tokens": 6}});
    assert_eq!(
        usage_from_response(Api::AnthropicMessages, &plain),
        Some(usage(12, 0, 6))
    );
}

// Embeddings: `prompt_tokens`, no output.
#[test]
fn embeddings() {
    let body = json!({
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [-0.006929283, -0.005336422, -4.547132e-05]}],
        "model": "text-embedding-3-small",
        "usage": {"prompt_tokens": 5, "total_tokens": 5}
    });
    assert_eq!(
        usage_from_response(Api::Embeddings, &body),
        Some(usage(5, 0, 0))
    );
}

// No usage, partial usage or the wrong API's field names read as None, not
// as zero: the gateway then settles its own count.
#[test]
fn missing_usage_is_none() {
    let error = json!({"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}});
    let anthropic_error =
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}});
    for api in [
        Api::ChatCompletions,
        Api::Responses,
        Api::Embeddings,
        Api::AnthropicMessages,
    ] {
        assert_eq!(usage_from_response(api, &error), None);
        assert_eq!(usage_from_response(api, &anthropic_error), None);
        assert_eq!(usage_from_response(api, &json!({"usage": null})), None);
    }
    assert_eq!(
        usage_from_response(
            Api::ChatCompletions,
            &json!({"usage": {"prompt_tokens": 3}})
        ),
        None
    );
    assert_eq!(
        usage_from_response(
            Api::ChatCompletions,
            &json!({"usage": {"input_tokens": 3, "output_tokens": 1}})
        ),
        None
    );
    assert_eq!(
        usage_from_response(
            Api::Responses,
            &json!({"usage": {"prompt_tokens": 3, "completion_tokens": 1}})
        ),
        None
    );
    assert_eq!(
        usage_from_response(
            Api::AnthropicMessages,
            &json!({"usage": {"output_tokens": 1}})
        ),
        None
    );
    assert_eq!(
        usage_from_response(
            Api::ChatCompletions,
            &json!({"usage": {"prompt_tokens": -3, "completion_tokens": 1}})
        ),
        None
    );
}

// Merging keeps what a later event does not say and replaces what it does.
#[test]
fn partial_usage_merges() {
    let mut total = PartialUsage::default();
    assert!(total.is_empty());
    assert_eq!(total.complete(), None);
    total.merge(PartialUsage {
        input_tokens: Some(40),
        cached_input_tokens: Some(30),
        output_tokens: Some(1),
    });
    total.merge(PartialUsage {
        output_tokens: Some(17),
        ..PartialUsage::default()
    });
    assert_eq!(total.complete(), Some(usage(40, 30, 17)));
    total.merge(PartialUsage::from(usage(41, 0, 18)));
    assert_eq!(total.complete(), Some(usage(41, 0, 18)));
}
