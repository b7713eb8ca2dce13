//! # allowance-stub — a local OpenAI and Anthropic upstream
//!
//! A small server that speaks the real OpenAI and Anthropic HTTP protocols
//! (the same JSON objects and SSE framing, parsed by the official `openai`
//! and `anthropic` SDKs) so that the gateway's tests and benchmarks need no
//! paid model API. It counts input tokens with the shared formula, answers
//! a known number of output tokens, and can be scripted to fail.
//!
//! - **Model call**: a `POST` to one of the model endpoints below.
//! - **Behaviour**: how calls are answered (output size, delays,
//!   concurrency limit) until changed.
//! - **Scripted answer**: a one-shot answer (an error status, a cut stream,
//!   a hang) taken by the next model call.
//! - **Request log**: every model call as received; **stats**: counters.
//!
//! ```
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use allowance_stub::{BehaviorPatch, Scripted, Stub};
//!
//! let stub = Stub::spawn("127.0.0.1:0".parse()?).await?;
//! let base_url = stub.base_url(); // "http://127.0.0.1:PORT" — add /v1 for an SDK
//! stub.set_behavior(&BehaviorPatch { output_tokens: Some(5), ..Default::default() })?;
//! stub.enqueue([Scripted::status(429).header("retry-after", "1")])?;
//! // … point the client under test at `base_url` …
//! assert_eq!(stub.stats().total, 0);
//! # Ok(()) }
//! ```
//!
//! ## Running it as a process
//!
//! `allowance-stub --listen 127.0.0.1:0 [--output-tokens N] [--no-record]`
//! prints exactly one line, `listening on http://127.0.0.1:PORT`, on stdout
//! (flushed) once it accepts connections, then serves until killed. It logs
//! nothing per request. `--output-tokens` (default 20) is the behaviour's
//! `output_tokens` at start and after a reset; `--no-record` keeps no
//! request log (for benchmarks; stats are still counted).
//!
//! ## Model endpoints
//!
//! | endpoint | speaks | streaming (`"stream": true`) |
//! |---|---|---|
//! | `POST /v1/chat/completions` | OpenAI `chat.completion` | `data:` chunks, then `data: [DONE]` |
//! | `POST /v1/responses` | OpenAI `response` | `event:` + `data:` with `type` and `sequence_number` |
//! | `POST /v1/embeddings` | OpenAI embeddings `list` | none (`stream` is ignored) |
//! | `POST /v1/messages` | Anthropic `message` | `event:` + `data:` |
//! | `GET /v1/models` | OpenAI's list, or Anthropic's when the request has `anthropic-version` | — |
//!
//! Any `model` string is accepted and echoed back. Every answer carries a
//! request id header: `x-request-id` on OpenAI paths, `request-id` on
//! `/v1/messages`.
//!
//! **Output.** An answer has `N = min(request bound, behaviour.output_tokens)`
//! output tokens, the request bound being `max_completion_tokens` /
//! `max_tokens` (chat; the smaller if both), `max_output_tokens`
//! (responses) or `max_tokens` (messages; optional here, unlike the real
//! API). The text is [`OUTPUT_WORD`] (`" hello"`) repeated `N` times; each
//! repetition is exactly one `o200k_base` token, so a stream sends exactly
//! one token per content delta and the reported output count is `N`.
//! When the bound cut the output, chat says `finish_reason: "length"` and
//! Anthropic `stop_reason: "max_tokens"` (else `"stop"` / `"end_turn"`);
//! a Responses answer is always `status: "completed"`.
//!
//! **Reasoning.** With `reasoning_tokens: R` in the behaviour, an answer
//! also "reasons" `min(R, bound − N)` tokens (all `R` without a bound):
//! they are billed as output in the usage (chat `completion_tokens` and
//! `completion_tokens_details.reasoning_tokens`, Responses `output_tokens`
//! and `output_tokens_details.reasoning_tokens`, Anthropic `output_tokens`)
//! but never streamed, as a reasoning model's hidden thinking.
//!
//! **Usage.** `prompt_tokens` / `input_tokens` follow the shared input
//! formula (see [`formula`]), output counts are `N`:
//! - chat non-streaming: `usage {prompt_tokens, completion_tokens,
//!   total_tokens, …_details}`. Streaming: a role chunk, `N` chunks with
//!   `delta.content`, a finish chunk (`delta: {}`, `finish_reason`), then —
//!   **only** when the request set `stream_options.include_usage: true` —
//!   a chunk with `choices: []` and `usage`, every other chunk then having
//!   `"usage": null` (as OpenAI). Then `data: [DONE]`. `stream_options` on
//!   a non-streaming call is a 400, as on the real API.
//! - responses streaming: `response.created`, `response.in_progress`,
//!   `response.output_item.added`, `response.content_part.added`, `N` ×
//!   `response.output_text.delta`, `response.output_text.done`,
//!   `response.content_part.done`, `response.output_item.done`,
//!   `response.completed` (whose `response.usage` has `input_tokens`,
//!   `output_tokens`, `total_tokens`). No `[DONE]`.
//! - messages streaming: `message_start` (`message.usage.input_tokens`, and
//!   `output_tokens: 1` as the real API reports there, 0 if `N` is 0),
//!   `content_block_start`, `ping`, `N` × `content_block_delta`
//!   (`text_delta`), `content_block_stop`, `message_delta`
//!   (`usage.output_tokens: N`, cumulative), `message_stop`.
//! - embeddings: `usage {prompt_tokens, total_tokens}`; one vector per
//!   input, of `dimensions` (default 1536) floats, or base64 of
//!   little-endian `f32` with `encoding_format: "base64"` (the Python SDK's
//!   default).
//!
//! **Errors.** A body that is not JSON, not an object, without `model`, or
//! with a field of the wrong type answers 400 in the provider's shape,
//! naming the field: OpenAI `{"error": {"message", "type", "param",
//! "code"}}`, Anthropic `{"type": "error", "error": {"type", "message"},
//! "request_id"}` (`invalid_request_error`, `rate_limit_error`, `api_error`,
//! `overloaded_error`, …). Bodies above [`MAX_BODY_BYTES`] answer 413.
//!
//! ## Control API (JSON, same port)
//!
//! | call | effect |
//! |---|---|
//! | `POST /_stub/behavior {"output_tokens": 20, "token_delay_ms": 0, "first_byte_delay_ms": 0, "concurrency_limit": null, "reasoning_tokens": 0}` | changes the given keys for later calls (omitted keys unchanged, `null` limit = none); answers the whole [`Behavior`] (`GET` reads it) |
//! | `POST /_stub/enqueue [{…}, …]` | queues [`Scripted`] answers for the next model calls, in order; answers `{"queued": LEN}` |
//! | `GET /_stub/requests` | the log: `[{"path", "received_at_ms", "headers": {lower-case name: value}, "body"}]`, oldest first |
//! | `GET /_stub/stats` | `{"in_flight", "max_in_flight", "total"}` ([`Stats`]) |
//! | `POST /_stub/reset` | clears the queue, log, counters and behaviour (calls still running stay in `in_flight`) |
//!
//! A bad control body answers 400 `{"error": "<field>: <reason>"}`.
//!
//! **Behaviour.** `first_byte_delay_ms` delays the whole response (status
//! line included). `token_delay_ms` is slept before each token delta of a
//! stream (the head events, e.g. the role chunk or `message_start`, go out
//! at once); a non-streaming answer waits `N × token_delay_ms`. Delays apply
//! to successful answers only. With `concurrency_limit: K`, a model call
//! arriving while `K` calls are in flight answers 429 in the provider's
//! shape **without** `retry-after`, and takes no scripted answer.
//!
//! **Scripted answers** (`{"status", "headers", "body", "cut_after_tokens",
//! "hang_ms"}`, all optional, combinable): the call waits `hang_ms`; then
//! with `status` it answers that status with `body` verbatim, or without a
//! body the provider's error body for that status (429 → OpenAI
//! `type: "requests"`, `code: "rate_limit_exceeded"` / Anthropic
//! `rate_limit_error`; 500 → `server_error` / `api_error`); without a
//! status it answers normally, and `cut_after_tokens: K` drops the
//! connection after `K` token deltas (no finish event, no usage, no
//! `[DONE]`; a non-streaming answer is cut mid-body). `headers` are added
//! to whatever is sent. Note that the SDKs retry 429 and 5xx by default:
//! each retry is a new model call and takes the next scripted answer.
//!
//! **Order of one model call:** counted in `total` and logged; a bad body
//! answers 400 (no scripted answer taken); past the concurrency limit,
//! 429; otherwise it is in flight (until its last byte is sent or the
//! client leaves), takes the next scripted answer if any, and answers.
//! The log keeps the newest [`MAX_RECORDED_REQUESTS`] calls; a body that
//! is not JSON is logged as a JSON string of its text.
//!
//! ## The input formula
//!
//! Implemented in [`formula`] (independently of the gateway's estimator,
//! on purpose: the tests compare the two). `T(s)` is the `o200k_base` token
//! count of `s` (tiktoken-rs, `encode_ordinary`: special-token text is
//! ordinary text).
//! - A message counts `3`, plus `T(v)` for each field whose value is a
//!   string (role, content, name, tool_call_id, …), plus `1` if it has a
//!   `name` key; a `content` array counts per part: `765` for a part of
//!   type `image_url` / `input_image` / `image`, else `T(text)` for a part
//!   with a string `text`, else `T(compact JSON of the part)`; any other
//!   field value (`tool_calls`, `null`, a number) counts `T(compact JSON)`.
//!   Compact JSON is `serde_json::to_string` of the parsed `Value`.
//! - Chat: the messages, plus 3 (reply priming), plus `T(compact JSON)` of
//!   `tools` and of `functions` when present and not `null`.
//! - Responses: `instructions` as `{role: "system", content}`, a string
//!   `input` as `{role: "user", content}`, an array `input` item by item
//!   by the message rule; plus 3; plus `tools`.
//! - Messages: `system` (string or blocks) as `{role: "system", content}`,
//!   then the messages; plus 3; plus `tools`.
//! - Embeddings: `T(input)` for a string, the sum for an array of strings,
//!   the sum of lengths for an array of token arrays (the length for one
//!   token array); no overhead.
//!
//! Worked example: `[{"role":"user","content":"Hello!"}]` counts
//! `3 + T("user") + T("Hello!") + 3`.

#![forbid(unsafe_code)]

mod anthropic;
mod body;
mod call;
mod control;
pub mod formula;
mod openai;
mod server;
mod text;

pub use control::{
    Behavior, BehaviorPatch, ControlError, MAX_DELAY_MS, MAX_OUTPUT_TOKENS, MAX_QUEUED_ANSWERS,
    MAX_RECORDED_REQUESTS, RecordedRequest, Scripted, Stats,
};
pub use server::{MAX_BODY_BYTES, SpawnError, Stub, StubConfig};
pub use text::{OUTPUT_WORD, output_text};
