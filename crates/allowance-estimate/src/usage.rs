//! Usage as the providers report it, in one shape.
//!
//! Every provider's input count here includes its cached part: OpenAI's
//! `prompt_tokens`/`input_tokens` already do; Anthropic's `input_tokens`
//! excludes the cache reads and writes, so they are added back.

use serde_json::Value;

use crate::Api;

/// Tokens an answer used, as the provider reported them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// All input tokens, the cached ones included.
    pub input_tokens: u64,
    /// The part of `input_tokens` read from the provider's prompt cache.
    pub cached_input_tokens: u64,
    /// Output tokens, reasoning included.
    pub output_tokens: u64,
}

/// Usage as one stream event reports it: some fields arrive early (Anthropic's
/// input in `message_start`), others late (its output in `message_delta`).
/// Each field is cumulative, so a later value replaces an earlier one
/// ([`PartialUsage::merge`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PartialUsage {
    /// All input tokens, the cached ones included, if this event says.
    pub input_tokens: Option<u64>,
    /// The cached part of the input, if this event says.
    pub cached_input_tokens: Option<u64>,
    /// Output tokens so far, if this event says.
    pub output_tokens: Option<u64>,
}

impl PartialUsage {
    /// Takes every field `newer` reports, keeping the others.
    pub fn merge(&mut self, newer: PartialUsage) {
        self.input_tokens = newer.input_tokens.or(self.input_tokens);
        self.cached_input_tokens = newer.cached_input_tokens.or(self.cached_input_tokens);
        self.output_tokens = newer.output_tokens.or(self.output_tokens);
    }

    /// The usage, once both input and output are known (an unreported cached
    /// part is 0).
    pub fn complete(self) -> Option<Usage> {
        Some(Usage {
            input_tokens: self.input_tokens?,
            cached_input_tokens: self.cached_input_tokens.unwrap_or(0),
            output_tokens: self.output_tokens?,
        })
    }

    /// Whether no field is reported.
    pub fn is_empty(&self) -> bool {
        self.input_tokens.is_none()
            && self.cached_input_tokens.is_none()
            && self.output_tokens.is_none()
    }
}

impl From<Usage> for PartialUsage {
    fn from(u: Usage) -> PartialUsage {
        PartialUsage {
            input_tokens: Some(u.input_tokens),
            cached_input_tokens: Some(u.cached_input_tokens),
            output_tokens: Some(u.output_tokens),
        }
    }
}

/// The usage of a complete (non-stream) answer: its `usage` object, read per
/// `api`. `None` when the body carries no usage with both input and output
/// counts (an error body, a proxy that strips it).
pub fn usage_from_response(api: Api, body: &Value) -> Option<Usage> {
    let usage = body.get("usage")?;
    let partial = match api {
        Api::ChatCompletions => chat_usage(usage),
        Api::Responses => responses_usage(usage),
        Api::AnthropicMessages => anthropic_usage(usage),
        Api::Embeddings => PartialUsage {
            input_tokens: count(usage, "prompt_tokens"),
            cached_input_tokens: Some(0),
            output_tokens: Some(0),
        },
    };
    partial.complete()
}

/// Chat's `usage` (in a body or in the last chunk of a stream).
pub(crate) fn chat_usage(usage: &Value) -> PartialUsage {
    PartialUsage {
        input_tokens: count(usage, "prompt_tokens"),
        cached_input_tokens: usage
            .get("prompt_tokens_details")
            .and_then(|d| count(d, "cached_tokens")),
        output_tokens: count(usage, "completion_tokens"),
    }
}

/// Responses' `usage` (in a body or in `response.completed`'s `response`).
pub(crate) fn responses_usage(usage: &Value) -> PartialUsage {
    PartialUsage {
        input_tokens: count(usage, "input_tokens"),
        cached_input_tokens: usage
            .get("input_tokens_details")
            .and_then(|d| count(d, "cached_tokens")),
        output_tokens: count(usage, "output_tokens"),
    }
}

/// Anthropic's `usage` (in a body, `message_start`'s `message` or
/// `message_delta`). Its `input_tokens` excludes cache reads and writes, which
/// are billed input too; a `message_delta` that reports only `output_tokens`
/// leaves the input alone.
pub(crate) fn anthropic_usage(usage: &Value) -> PartialUsage {
    let uncached = count(usage, "input_tokens");
    let cache_read = count(usage, "cache_read_input_tokens");
    let cache_write = count(usage, "cache_creation_input_tokens");
    PartialUsage {
        input_tokens: uncached.map(|i| {
            i.saturating_add(cache_read.unwrap_or(0))
                .saturating_add(cache_write.unwrap_or(0))
        }),
        cached_input_tokens: match uncached {
            Some(_) => Some(cache_read.unwrap_or(0)),
            None => cache_read,
        },
        output_tokens: count(usage, "output_tokens"),
    }
}

fn count(object: &Value, field: &str) -> Option<u64> {
    object.get(field)?.as_u64()
}
