//! Stream events of each API, as the providers send them, read one by one
//! and folded into text and usage as the gateway does.

use allowance_estimate::{Api, PartialUsage, StreamEvent, Usage, read_stream_event};
use serde_json::{Value, json};

/// What a gateway keeps from a whole stream.
#[derive(Debug, Default)]
struct Folded {
    text: String,
    usage: PartialUsage,
    usage_only_events: usize,
    done_at: Option<usize>,
    errors: usize,
}

/// Parses an SSE transcript (`event:` and `data:` lines) and reads each
/// event; chat's `[DONE]` is the caller's to recognise, as in the gateway.
fn fold(api: Api, sse: &str) -> Folded {
    let mut folded = Folded::default();
    let mut name = None;
    let mut index = 0;
    for line in sse.lines().map(str::trim) {
        if let Some(n) = line.strip_prefix("event: ") {
            name = Some(n.to_owned());
        } else if let Some(data) = line.strip_prefix("data: ") {
            if data == "[DONE]" {
                folded.done_at = Some(index);
                continue;
            }
            let value: Value = serde_json::from_str(data).unwrap();
            let event = read_stream_event(api, name.as_deref(), &value);
            event.text_delta.append_to(&mut folded.text);
            assert_eq!(
                event.text_delta.len_bytes(),
                event.text_delta.iter().map(str::len).sum::<usize>()
            );
            if let Some(u) = event.usage {
                folded.usage.merge(u);
            }
            folded.usage_only_events += usize::from(event.usage_only);
            if event.done {
                assert!(folded.done_at.is_none(), "two done events");
                folded.done_at = Some(index);
            }
            folded.errors += usize::from(event.error);
            index += 1;
            name = None;
        }
    }
    folded
}

fn usage(input_tokens: u64, cached_input_tokens: u64, output_tokens: u64) -> Option<Usage> {
    Some(Usage {
        input_tokens,
        cached_input_tokens,
        output_tokens,
    })
}

// A chat stream with include_usage: text from each delta, the usage-only
// last chunk flagged, earlier `usage: null` chunks ignored.
#[test]
fn chat_text_stream() {
    let sse = r#"
data: {"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","system_fingerprint":"fp_44709d6fcb","choices":[{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}],"usage":null}

data: {"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}],"usage":null}

data: {"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"content":" there!"},"logprobs":null,"finish_reason":null}],"usage":null}

data: {"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}],"usage":null}

data: {"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","choices":[],"usage":{"prompt_tokens":19,"completion_tokens":3,"total_tokens":22,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}

data: [DONE]
"#;
    let f = fold(Api::ChatCompletions, sse);
    assert_eq!(f.text, "Hello there!");
    assert_eq!(f.usage.complete(), usage(19, 0, 3));
    assert_eq!(f.usage_only_events, 1);
    assert_eq!(f.done_at, Some(5));
    assert_eq!(f.errors, 0);
}

// Tool-call deltas: the name, then the arguments in pieces; without
// include_usage no usage arrives.
#[test]
fn chat_tool_call_stream() {
    let sse = r#"
data: {"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"gpt-4.1","choices":[{"index":0,"delta":{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":"call_DdmO9pD3xa9XTPNJ32zg2hcA","type":"function","function":{"name":"get_weather","arguments":""}}]},"finish_reason":null}]}

data: {"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"gpt-4.1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"loc"}}]},"finish_reason":null}]}

data: {"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"gpt-4.1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"ation\":\"Paris\"}"}}]},"finish_reason":null}]}

data: {"id":"chatcmpl-9","object":"chat.completion.chunk","created":1,"model":"gpt-4.1","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}

data: [DONE]
"#;
    let f = fold(Api::ChatCompletions, sse);
    assert_eq!(f.text, "get_weather{\"location\":\"Paris\"}");
    assert!(f.usage.is_empty());
    assert_eq!(f.usage_only_events, 0);
}

// One chunk can carry several pieces: every choice (n > 1) and every tool
// call, in order.
#[test]
fn chat_chunk_with_several_pieces() {
    let chunk = json!({"choices": [
        {"index": 0, "delta": {"content": "A", "tool_calls": [
            {"index": 0, "function": {"arguments": "{\"a\""}},
            {"index": 1, "function": {"arguments": "{\"b\""}}]}},
        {"index": 1, "delta": {"content": "B", "refusal": "no"}},
    ]});
    let event = read_stream_event(Api::ChatCompletions, None, &chunk);
    assert_eq!(
        event.text_delta.iter().collect::<Vec<_>>(),
        ["A", "{\"a\"", "{\"b\"", "B", "no"]
    );
    assert_eq!(event.usage, None);
    // A chunk with choices and usage (some compatible servers) is not
    // usage-only: hiding it would drop text.
    let both = json!({"choices": [{"index": 0, "delta": {"content": "x"}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1}});
    let event = read_stream_event(Api::ChatCompletions, None, &both);
    assert!(!event.usage_only);
    assert_eq!(event.usage.and_then(PartialUsage::complete), usage(1, 0, 1));
    // A usage chunk without `choices` at all is usage-only too.
    let bare = json!({"usage": {"prompt_tokens": 2, "completion_tokens": 5}});
    assert!(read_stream_event(Api::ChatCompletions, None, &bare).usage_only);
}

// Responses: text deltas, then `response.completed` with usage, done.
#[test]
fn responses_stream() {
    let sse = r#"
event: response.created
data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_67c9fdcecf","object":"response","created_at":1741290958,"status":"in_progress","model":"gpt-4.1-2025-04-14","output":[],"usage":null}}

event: response.in_progress
data: {"type":"response.in_progress","sequence_number":1,"response":{"id":"resp_67c9fdcecf","object":"response","status":"in_progress","output":[],"usage":null}}

event: response.output_item.added
data: {"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":{"id":"msg_67c9fdcf37","type":"message","status":"in_progress","role":"assistant","content":[]}}

event: response.output_text.delta
data: {"type":"response.output_text.delta","sequence_number":3,"item_id":"msg_67c9fdcf37","output_index":0,"content_index":0,"delta":"Hi"}

event: response.output_text.delta
data: {"type":"response.output_text.delta","sequence_number":4,"item_id":"msg_67c9fdcf37","output_index":0,"content_index":0,"delta":" there!"}

event: response.output_text.done
data: {"type":"response.output_text.done","sequence_number":5,"item_id":"msg_67c9fdcf37","output_index":0,"content_index":0,"text":"Hi there!"}

event: response.completed
data: {"type":"response.completed","sequence_number":6,"response":{"id":"resp_67c9fdcecf","object":"response","created_at":1741290958,"status":"completed","model":"gpt-4.1-2025-04-14","output":[{"id":"msg_67c9fdcf37","type":"message","status":"completed","role":"assistant","content":[{"type":"output_text","text":"Hi there!","annotations":[]}]}],"usage":{"input_tokens":37,"input_tokens_details":{"cached_tokens":0},"output_tokens":11,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":48}}}
"#;
    let f = fold(Api::Responses, sse);
    assert_eq!(f.text, "Hi there!");
    assert_eq!(f.usage.complete(), usage(37, 0, 11));
    assert_eq!(f.done_at, Some(6));
    assert_eq!(f.errors, 0);
}

// Responses function-call arguments count as output; `response.incomplete`
// (hit max_output_tokens) ends the stream with usage; `response.failed`
// ends it as an error.
#[test]
fn responses_endings() {
    let args = json!({"type": "response.function_call_arguments.delta", "sequence_number": 4,
        "item_id": "fc_1", "output_index": 0, "delta": "{\"city\":"});
    let event = read_stream_event(Api::Responses, None, &args);
    assert_eq!(event.text_delta.iter().collect::<String>(), "{\"city\":");

    let incomplete = json!({"type": "response.incomplete", "sequence_number": 90, "response": {
        "id": "resp_2", "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
        "usage": {"input_tokens": 2000, "input_tokens_details": {"cached_tokens": 1920},
                  "output_tokens": 64, "output_tokens_details": {"reasoning_tokens": 64}, "total_tokens": 2064}}});
    let event = read_stream_event(Api::Responses, Some("response.incomplete"), &incomplete);
    assert!(event.done && !event.error);
    assert_eq!(
        event.usage.and_then(PartialUsage::complete),
        usage(2000, 1920, 64)
    );

    let failed = json!({"type": "response.failed", "sequence_number": 3, "response": {
        "id": "resp_3", "status": "failed", "error": {"code": "server_error", "message": "The model failed."},
        "usage": null}});
    let event = read_stream_event(Api::Responses, None, &failed);
    assert_eq!((event.done, event.error, event.usage), (true, true, None));

    let error = json!({"type": "error", "code": "ERR_SOMETHING", "message": "Something went wrong", "sequence_number": 1});
    let event = read_stream_event(Api::Responses, None, &error);
    assert_eq!((event.done, event.error), (false, true));
}

// Anthropic: input from `message_start` (cache reads and writes added), the
// cumulative output from `message_delta`, text and tool JSON from the
// deltas, `message_stop` ends it; `ping` says nothing.
#[test]
fn anthropic_stream() {
    let sse = r#"
event: message_start
data: {"type":"message_start","message":{"id":"msg_014p7gG3wDgGV9EUtLvnow3U","type":"message","role":"assistant","model":"claude-sonnet-4-5-20250929","stop_sequence":null,"usage":{"input_tokens":472,"cache_creation_input_tokens":0,"cache_read_input_tokens":2048,"output_tokens":2},"content":[],"stop_reason":null}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}

event: ping
data: {"type": "ping"}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Okay, let me check"}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" the weather."}}

event: content_block_stop
data: {"type":"content_block_stop","index":0}

event: content_block_start
data: {"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_01T1x1fJ34qAmk2tNTrN7Up6","name":"get_weather","input":{}}}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":""}}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"location\": \"San Fra"}}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"ncisco, CA\"}"}}

event: content_block_stop
data: {"type":"content_block_stop","index":1}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":89}}

event: message_stop
data: {"type":"message_stop"}
"#;
    let f = fold(Api::AnthropicMessages, sse);
    assert_eq!(
        f.text,
        "Okay, let me check the weather.get_weather{\"location\": \"San Francisco, CA\"}"
    );
    assert_eq!(f.usage.complete(), usage(2520, 2048, 89));
    assert_eq!(f.done_at, Some(12));
    assert_eq!(f.errors, 0);
}

// Thinking counts as output; `message_start` alone already gives a usage
// (input, and output so far) if the stream breaks; an `error` event is
// flagged; the SSE event name stands in for a missing `type`.
#[test]
fn anthropic_thinking_and_errors() {
    let thinking = json!({"type": "content_block_delta", "index": 0,
        "delta": {"type": "thinking_delta", "thinking": "Let me solve this step by step"}});
    let event = read_stream_event(Api::AnthropicMessages, None, &thinking);
    assert_eq!(
        event.text_delta.iter().collect::<String>(),
        "Let me solve this step by step"
    );
    let signature = json!({"type": "content_block_delta", "index": 0,
        "delta": {"type": "signature_delta", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3h"}});
    assert!(
        read_stream_event(Api::AnthropicMessages, None, &signature)
            .text_delta
            .is_empty()
    );

    let start = json!({"type": "message_start", "message": {"usage": {"input_tokens": 25, "output_tokens": 1}}});
    let event = read_stream_event(Api::AnthropicMessages, Some("message_start"), &start);
    assert_eq!(
        event.usage.and_then(PartialUsage::complete),
        usage(25, 0, 1)
    );

    let overloaded =
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}});
    let event = read_stream_event(Api::AnthropicMessages, Some("error"), &overloaded);
    assert_eq!((event.error, event.done), (true, false));

    let untyped_stop = json!({});
    assert!(read_stream_event(Api::AnthropicMessages, Some("message_stop"), &untyped_stop).done);
    assert!(!read_stream_event(Api::AnthropicMessages, None, &untyped_stop).done);
}

// Events that say nothing read as the empty event, whatever their shape.
#[test]
fn unknown_events_are_empty() {
    for (api, data) in [
        (
            Api::ChatCompletions,
            json!({"choices": "nonsense", "usage": 3}),
        ),
        (Api::ChatCompletions, json!([1, 2, 3])),
        (
            Api::ChatCompletions,
            json!({"choices": [{"delta": {"content": 7}}], "usage": null}),
        ),
        (
            Api::Responses,
            json!({"type": "response.output_text.delta", "delta": 5}),
        ),
        (
            Api::Responses,
            json!({"type": "response.web_search_call.searching"}),
        ),
        (
            Api::AnthropicMessages,
            json!({"type": "message_delta", "usage": null}),
        ),
        (Api::Embeddings, json!({"type": "message_stop"})),
    ] {
        assert_eq!(
            read_stream_event(api, None, &data),
            StreamEvent::default(),
            "{api:?} {data}"
        );
    }
}
