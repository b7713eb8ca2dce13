//! Server-sent events of streamed answers: their text, usage, and end.
//!
//! The gateway splits the stream into events and parses each `data:` as
//! JSON; this module says what one event means. Chat's final `data: [DONE]`
//! is not JSON, so the caller recognises it itself.

use serde_json::Value;
use smallvec::SmallVec;

use crate::Api;
use crate::usage::{PartialUsage, anthropic_usage, chat_usage, responses_usage};

/// What one stream event says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamEvent<'a> {
    /// The model output this event adds, in order: text, refusals, tool-call
    /// names and arguments, Anthropic's thinking. A gateway that must count
    /// output itself (the stream broke before usage arrived) appends these
    /// to one buffer and tokenizes that once at the end: tokens span events.
    pub text_delta: TextDelta<'a>,
    /// Usage the event reports (see [`PartialUsage::merge`]).
    pub usage: Option<PartialUsage>,
    /// A chat chunk that carries only usage (empty or no `choices`): the chunk a
    /// gateway hides from a client that did not ask for `include_usage`.
    pub usage_only: bool,
    /// The provider's last event: Responses' `response.completed`,
    /// `response.incomplete`, `response.failed`; Anthropic's `message_stop`.
    pub done: bool,
    /// The event reports a failure: an `error` event (both), or
    /// `response.failed`.
    pub error: bool,
}

/// The pieces of output text in one event, borrowed from its JSON.
///
/// A chat chunk can carry several (content, and the arguments of each tool
/// call, across choices), so this is a list rather than one `&str`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TextDelta<'a>(SmallVec<[&'a str; 2]>);

impl<'a> TextDelta<'a> {
    /// Whether the event adds no text.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The pieces, in order.
    pub fn iter(&self) -> impl Iterator<Item = &'a str> + '_ {
        self.0.iter().copied()
    }

    /// The total length of the pieces in bytes.
    pub fn len_bytes(&self) -> usize {
        self.0.iter().map(|s| s.len()).sum()
    }

    /// Appends every piece to `buffer`.
    pub fn append_to(&self, buffer: &mut String) {
        for piece in &self.0 {
            buffer.push_str(piece);
        }
    }

    fn push(&mut self, piece: Option<&'a Value>) {
        if let Some(Value::String(s)) = piece
            && !s.is_empty()
        {
            self.0.push(s);
        }
    }
}

/// Reads one event of a stream of `api`. `event_name` is the SSE `event:`
/// line, if any; the event's JSON `type` wins when both are present (they
/// agree for both providers). Unknown events read as empty.
pub fn read_stream_event<'a>(
    api: Api,
    event_name: Option<&str>,
    data: &'a Value,
) -> StreamEvent<'a> {
    let kind = match data.get("type") {
        Some(Value::String(t)) => Some(t.as_str()),
        _ => event_name,
    };
    match api {
        Api::ChatCompletions => chat_chunk(data),
        Api::Responses => responses_event(kind, data),
        Api::AnthropicMessages => anthropic_event(kind, data),
        Api::Embeddings => StreamEvent::default(),
    }
}

fn chat_chunk(data: &Value) -> StreamEvent<'_> {
    let mut event = StreamEvent::default();
    let choices = data.get("choices").and_then(Value::as_array);
    // With `n` > 1 every choice is output, so every choice's delta counts.
    for choice in choices.into_iter().flatten() {
        let Some(delta) = choice.get("delta") else {
            continue;
        };
        event.text_delta.push(delta.get("content"));
        event.text_delta.push(delta.get("refusal"));
        for call in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let function = call.get("function");
            event.text_delta.push(function.and_then(|f| f.get("name")));
            event
                .text_delta
                .push(function.and_then(|f| f.get("arguments")));
        }
        let legacy = delta.get("function_call");
        event.text_delta.push(legacy.and_then(|f| f.get("name")));
        event
            .text_delta
            .push(legacy.and_then(|f| f.get("arguments")));
    }
    if let Some(usage) = data.get("usage").filter(|u| u.is_object()) {
        event.usage = Some(chat_usage(usage));
        // OpenAI sends `choices: []`; some compatible servers omit it.
        event.usage_only = choices.is_none_or(|c| c.is_empty());
    }
    event
}

fn responses_event<'a>(kind: Option<&str>, data: &'a Value) -> StreamEvent<'a> {
    let mut event = StreamEvent::default();
    match kind {
        Some(
            "response.output_text.delta"
            | "response.refusal.delta"
            | "response.function_call_arguments.delta"
            | "response.reasoning_text.delta",
        ) => event.text_delta.push(data.get("delta")),
        Some(end @ ("response.completed" | "response.incomplete" | "response.failed")) => {
            let usage = data.get("response").and_then(|r| r.get("usage"));
            event.usage = usage.filter(|u| u.is_object()).map(responses_usage);
            event.done = true;
            event.error = end == "response.failed";
        }
        Some("error") => event.error = true,
        _ => {}
    }
    event
}

fn anthropic_event<'a>(kind: Option<&str>, data: &'a Value) -> StreamEvent<'a> {
    let mut event = StreamEvent::default();
    match kind {
        Some("message_start") => {
            let usage = data.get("message").and_then(|m| m.get("usage"));
            event.usage = usage.filter(|u| u.is_object()).map(anthropic_usage);
        }
        Some("content_block_start") => {
            // A text block starts with its first text (usually ""), a
            // tool_use block with its name.
            let block = data.get("content_block");
            event.text_delta.push(block.and_then(|b| b.get("text")));
            event.text_delta.push(block.and_then(|b| b.get("name")));
        }
        Some("content_block_delta") => {
            let delta = data.get("delta");
            for field in ["text", "partial_json", "thinking"] {
                event.text_delta.push(delta.and_then(|d| d.get(field)));
            }
        }
        Some("message_delta") => {
            let usage = data.get("usage");
            event.usage = usage.filter(|u| u.is_object()).map(anthropic_usage);
        }
        Some("message_stop") => event.done = true,
        Some("error") => event.error = true,
        _ => {}
    }
    event
}
