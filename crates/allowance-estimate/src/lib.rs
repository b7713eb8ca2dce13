//! # allowance-estimate — what a model call will cost, before and after
//!
//! The gateway reserves budget before it calls a provider, so it needs a
//! number from the request body alone; afterwards it settles what the
//! provider reports. This crate gives both halves, with no I/O:
//!
//! - **estimate** — [`estimate`] validates a body and counts its input tokens
//!   by the formula below; the output side is the body's own cap
//!   ([`Estimate::output_bound`]).
//! - **usage** — [`usage_from_response`] reads a complete answer's usage;
//!   [`read_stream_event`] reads one stream event's text, usage and end.
//! - **tokenizer** — [`Tokenizer`]: tiktoken's `o200k_base` or
//!   `cl100k_base`, counting `encode_ordinary` (special-token text counts as
//!   ordinary text).
//!
//! ## The input-token formula
//!
//! `T(s)` is the token count of string `s`. A *message* is a JSON object; it
//! counts **3**, plus `T(v)` for every field whose value `v` is a string
//! (`role`, `content`, `name`, `tool_call_id`, `type`, …), plus **1** more if
//! its `name` is a string, plus, for every other field:
//!
//! - `content` as an array of parts: each part with a string `text` counts
//!   `T(text)`; a part of type `image_url`, `input_image` or `image` counts
//!   **765**; any other part counts 0 for OpenAI and `T(compact JSON of the
//!   part)` for Anthropic (`tool_use`, `tool_result`, `document`, …);
//! - any other value (`tool_calls`, an OpenAI `content: null`, numbers,
//!   objects) counts `T(compact JSON of the value)`.
//!
//! "Compact JSON" is `serde_json::to_string` of the parsed value: no spaces,
//! object keys sorted (serde_json's default map).
//!
//! | API | input tokens |
//! |---|---|
//! | chat completions | Σ messages + 3 (reply priming) + tools |
//! | responses | `instructions` as `{role: "system", content}` + `input` (a string as `{role: "user", content}`, an array as one message per item) + 3 + tools |
//! | Anthropic messages | `system` as `{role: "system", content}` (a string, or blocks counted as parts) + Σ messages + 3 + tools |
//! | embeddings | `T(input)`, Σ `T` over an array of strings, the number of ids in token arrays; no overhead |
//!
//! where *tools* is `T(compact JSON)` of the body's `tools` and of its legacy
//! `functions`, when present. For example, chat messages
//! `[{"role": "user", "content": "Hello!"}]` count
//! `3 + T("user") + T("Hello!") + 3` = 3 + 1 + 2 + 3 = 9 with `o200k_base`.
//!
//! ## The cache
//!
//! Agents re-send their conversation every turn. [`estimate`] keeps the count
//! of every string it tokenizes (contents, roles, ids, serialized `tools`) in
//! a process-wide, bounded cache ([`CACHE_CAPACITY_ENTRIES`] counts, ~34 MB,
//! S3-FIFO eviction) keyed by a 128-bit hash of the tokenizer and the text,
//! so a turn tokenizes only its new strings: a 32K-token conversation costs
//! ~11 ms the first time and ~20 µs after (`benches/tokenize.rs`). [`estimate_uncached`] gives the
//! same answer without it. Call [`Tokenizer::warm_up`] at start-up: loading
//! a tokenizer's ranks takes ~150 ms.
//!
//! ```
//! use allowance_estimate::{Api, Tokenizer, estimate};
//! use serde_json::json;
//!
//! let body = json!({
//!     "model": "gpt-4o-mini",
//!     "messages": [{"role": "user", "content": "Hello!"}],
//!     "max_completion_tokens": 256,
//!     "stream": true,
//!     "stream_options": {"include_usage": true}
//! });
//! let e = estimate(Api::ChatCompletions, &body, Tokenizer::O200kBase)?;
//! assert_eq!((e.model.as_str(), e.input_tokens, e.output_bound), ("gpt-4o-mini", 9, Some(256)));
//! assert!(e.stream && e.include_usage);
//!
//! // A bad field is refused by name, before anything is tokenized.
//! let bad = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": 7}]});
//! let err = estimate(Api::ChatCompletions, &bad, Tokenizer::O200kBase).unwrap_err();
//! assert_eq!(err.field, "messages[0].content");
//! # Ok::<(), allowance_estimate::BadRequest>(())
//! ```

#![forbid(unsafe_code)]

mod request;
mod stream;
mod tokenizer;
mod usage;

pub use request::{
    Api, BOUND_EXACT_BUDGET_BYTES, BOUND_EXACT_MAX_BYTES, BadRequest, Bounded, Estimate,
    IMAGE_TOKENS, MAX_OUTPUT_BOUND, MESSAGE_OVERHEAD_TOKENS, NAME_OVERHEAD_TOKENS,
    REPLY_PRIMING_TOKENS, estimate, estimate_bound, estimate_uncached, model_of,
};
pub use stream::{StreamEvent, TextDelta, read_stream_event};
pub use tokenizer::{
    CACHE_CAPACITY_ENTRIES, Tokenizer, clear_count_cache, count_cache_len, set_count_cache_capacity,
};
pub use usage::{PartialUsage, Usage, usage_from_response};
