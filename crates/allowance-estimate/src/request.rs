//! Request bodies: validation, and the input-token formula.
//!
//! The formula is the gateway's documented estimate (see the crate docs); the
//! stub upstream implements the same contract independently, so every rule
//! here is spelled out in the crate docs and pinned by the fixture tests.

use std::cell::Cell;

use serde_json::{Map, Value};

use crate::Tokenizer;

/// Tokens a message costs beyond its strings (OpenAI's `tokens_per_message`).
pub const MESSAGE_OVERHEAD_TOKENS: u64 = 3;
/// Tokens a message's `name` costs beyond its text (OpenAI's `tokens_per_name`).
pub const NAME_OVERHEAD_TOKENS: u64 = 1;
/// Tokens that prime the reply (`<|start|>assistant<|message|>`).
pub const REPLY_PRIMING_TOKENS: u64 = 3;
/// Tokens an image part counts for, whatever its size: what OpenAI charges
/// for a 1024×1024 image at high detail (85 base + 4 tiles × 170). A flat
/// figure keeps the estimate free of image decoding; settlement charges what
/// the provider reports.
pub const IMAGE_TOKENS: u64 = 765;
/// The largest `max_tokens`-like bound accepted: 2^53, the largest integer a
/// JSON number carries exactly in every client.
pub const MAX_OUTPUT_BOUND: u64 = 1 << 53;

/// The content-part `type`s that count as one image ([`IMAGE_TOKENS`]).
const IMAGE_PART_TYPES: [&str; 3] = ["image_url", "input_image", "image"];

/// The provider API a body is for: it decides where the prompt lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Api {
    /// OpenAI `POST /v1/chat/completions`.
    ChatCompletions,
    /// OpenAI `POST /v1/responses`.
    Responses,
    /// OpenAI `POST /v1/embeddings`.
    Embeddings,
    /// Anthropic `POST /v1/messages`.
    AnthropicMessages,
}

/// What a request will cost at most, as far as the body tells.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Estimate {
    /// The body's `model`.
    pub model: String,
    /// Input tokens by the formula of the crate docs.
    pub input_tokens: u64,
    /// The body's cap on output tokens (`max_completion_tokens`,
    /// `max_tokens`, `max_output_tokens`; `Some(0)` for embeddings). `None`
    /// when the body sets none: the gateway then uses the model's configured
    /// maximum.
    pub output_bound: Option<u64>,
    /// Whether the body asks for a server-sent-event stream.
    pub stream: bool,
    /// Whether the answer will carry usage. Chat: the body's
    /// `stream_options.include_usage` (meaningful for streams, where the
    /// gateway may inject it); always `true` for Responses and Anthropic,
    /// whose streams always end with usage; `false` for embeddings.
    pub include_usage: bool,
}

/// A body the gateway refuses before calling upstream (HTTP 400).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct BadRequest {
    /// The dotted path of the offending field: `model`,
    /// `messages[2].content`, `max_tokens`.
    pub field: String,
    /// What is wrong with it, for a person.
    pub message: String,
}

impl BadRequest {
    fn new(field: impl Into<String>, message: impl Into<String>) -> BadRequest {
        BadRequest {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// The body's `model`: a non-empty string, or a [`BadRequest`] naming `model`.
pub fn model_of(body: &Value) -> Result<&str, BadRequest> {
    match body.get("model") {
        Some(Value::String(m)) if !m.is_empty() => Ok(m),
        Some(Value::String(_)) => Err(BadRequest::new("model", "must not be empty")),
        None | Some(Value::Null) => Err(BadRequest::new("model", "is required")),
        Some(_) => Err(BadRequest::new("model", "must be a string")),
    }
}

/// Validates `body` for `api` and estimates it, with long strings' counts
/// from the process-wide cache (see [`Tokenizer::count_cached`]).
pub fn estimate(api: Api, body: &Value, tokenizer: Tokenizer) -> Result<Estimate, BadRequest> {
    estimate_with(
        api,
        body,
        Counter {
            tokenizer,
            mode: Mode::Cached,
            bounded: &Cell::new(false),
            budget: &Cell::new(0),
        },
    )
}

/// [`estimate`] tokenizing every string now, bypassing the cache: the same
/// answer, at the cost of a first request. Benchmarks and tests use it.
pub fn estimate_uncached(
    api: Api,
    body: &Value,
    tokenizer: Tokenizer,
) -> Result<Estimate, BadRequest> {
    estimate_with(
        api,
        body,
        Counter {
            tokenizer,
            mode: Mode::Uncached,
            bounded: &Cell::new(false),
            budget: &Cell::new(0),
        },
    )
}

/// An estimate that may bound some counts instead of making them: see
/// [`estimate_bound`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bounded {
    /// The estimate; its `input_tokens` is at least the exact count.
    pub estimate: Estimate,
    /// Whether every string was counted (from the cache or tokenized), so
    /// `input_tokens` is exactly what [`estimate`] answers.
    pub exact: bool,
}

/// Strings up to this many bytes are tokenized by [`estimate_bound`] when
/// the cache does not know them (tens of microseconds at most); longer
/// ones are bounded.
pub const BOUND_EXACT_MAX_BYTES: usize = 256;

/// At most this many bytes of short strings are tokenized by one
/// [`estimate_bound`] (about half a millisecond); past it, short strings
/// are bounded too, so a body of many thousands of short messages costs
/// no more than a long one.
pub const BOUND_EXACT_BUDGET_BYTES: usize = 16 * 1024;

/// [`estimate`] without tokenizing what is slow to tokenize: a string the
/// cache does not know and longer than [`BOUND_EXACT_MAX_BYTES`] counts as
/// its length in bytes — and so does any string once
/// [`BOUND_EXACT_BUDGET_BYTES`] of short ones were tokenized. That is an upper bound — every token of
/// `o200k_base` and `cl100k_base` stands for at least one byte — so the
/// estimate is never below [`estimate`]'s, and costs microseconds for a
/// body that takes milliseconds to tokenize (a gateway can hold on the
/// bound, start the call, and count exactly meanwhile). The same
/// validation, the same errors.
///
/// ```
/// use allowance_estimate::{Api, Tokenizer, estimate, estimate_bound};
/// use serde_json::json;
///
/// let long = "word ".repeat(1_000);
/// let body = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": long}]});
/// let bound = estimate_bound(Api::ChatCompletions, &body, Tokenizer::O200kBase)?;
/// let exact = estimate(Api::ChatCompletions, &body, Tokenizer::O200kBase)?;
/// assert!(!bound.exact && bound.estimate.input_tokens >= exact.input_tokens);
/// // Counted once, the string is in the cache: the bound is now exact.
/// let again = estimate_bound(Api::ChatCompletions, &body, Tokenizer::O200kBase)?;
/// assert!(again.exact && again.estimate == exact);
/// # Ok::<(), allowance_estimate::BadRequest>(())
/// ```
pub fn estimate_bound(api: Api, body: &Value, tokenizer: Tokenizer) -> Result<Bounded, BadRequest> {
    let bounded = Cell::new(false);
    let budget = Cell::new(BOUND_EXACT_BUDGET_BYTES);
    let estimate = estimate_with(
        api,
        body,
        Counter {
            tokenizer,
            mode: Mode::Bound,
            bounded: &bounded,
            budget: &budget,
        },
    )?;
    Ok(Bounded {
        estimate,
        exact: !bounded.get(),
    })
}

fn estimate_with(api: Api, body: &Value, counter: Counter<'_>) -> Result<Estimate, BadRequest> {
    // Cheap checks first: a bad `max_tokens` costs no tokenizing.
    if !body.is_object() {
        return Err(BadRequest::new("body", "must be a JSON object"));
    }
    let model = model_of(body)?.to_owned();
    let stream = stream_flag(body)?;
    let (output_bound, include_usage) = match api {
        Api::ChatCompletions => {
            let completion = output_bound(body, "max_completion_tokens")?;
            let legacy = output_bound(body, "max_tokens")?;
            (completion.or(legacy), chat_include_usage(body)?)
        }
        Api::Responses => (output_bound(body, "max_output_tokens")?, true),
        Api::AnthropicMessages => match output_bound(body, "max_tokens")? {
            Some(bound) => (Some(bound), true),
            None => return Err(BadRequest::new("max_tokens", "is required")),
        },
        Api::Embeddings => (Some(0), false),
    };
    let input_tokens = match api {
        Api::ChatCompletions => chat_input(body, counter)?,
        Api::Responses => responses_input(body, counter)?,
        Api::AnthropicMessages => anthropic_input(body, counter)?,
        Api::Embeddings => embeddings_input(body, counter)?,
    };
    Ok(Estimate {
        model,
        input_tokens,
        output_bound,
        stream,
        include_usage,
    })
}

fn stream_flag(body: &Value) -> Result<bool, BadRequest> {
    match body.get("stream") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(BadRequest::new("stream", "must be a boolean")),
    }
}

fn chat_include_usage(body: &Value) -> Result<bool, BadRequest> {
    match body.get("stream_options") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Object(options)) => match options.get("include_usage") {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(BadRequest::new(
                "stream_options.include_usage",
                "must be a boolean",
            )),
        },
        Some(_) => Err(BadRequest::new("stream_options", "must be an object")),
    }
}

fn output_bound(body: &Value, field: &'static str) -> Result<Option<u64>, BadRequest> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(bound) if bound <= MAX_OUTPUT_BOUND => Ok(Some(bound)),
            _ => Err(BadRequest::new(field, "must be an integer from 0 to 2^53")),
        },
        Some(_) => Err(BadRequest::new(field, "must be an integer from 0 to 2^53")),
    }
}

// Sums below cannot overflow: every token counted needs at least one byte of
// body (an image's 765 needs ~20), so a u64 overflows only past 2^54 bytes.

fn chat_input(body: &Value, c: Counter<'_>) -> Result<u64, BadRequest> {
    let messages = message_list(body, "messages")?;
    let mut n = REPLY_PRIMING_TOKENS + tools(body, c);
    for (i, m) in messages.iter().enumerate() {
        n += message(m, "messages", i, Parts::OpenAi, c)?;
    }
    Ok(n)
}

fn responses_input(body: &Value, c: Counter<'_>) -> Result<u64, BadRequest> {
    let mut n = REPLY_PRIMING_TOKENS + tools(body, c);
    match body.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => n += synthetic_message(c, "system", c.text(s)),
        Some(_) => return Err(BadRequest::new("instructions", "must be a string")),
    }
    match body.get("input") {
        // `input` may be absent: `previous_response_id` or a stored prompt
        // supplies the conversation, which the provider counts.
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => n += synthetic_message(c, "user", c.text(s)),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                n += message(item, "input", i, Parts::OpenAi, c)?;
            }
        }
        Some(_) => {
            return Err(BadRequest::new(
                "input",
                "must be a string or an array of items",
            ));
        }
    }
    Ok(n)
}

fn anthropic_input(body: &Value, c: Counter<'_>) -> Result<u64, BadRequest> {
    let messages = message_list(body, "messages")?;
    let mut n = REPLY_PRIMING_TOKENS + tools(body, c);
    match body.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => n += synthetic_message(c, "system", c.text(s)),
        Some(Value::Array(blocks)) => {
            let content = parts(blocks, Parts::Anthropic, c, || "system".to_owned())?;
            n += synthetic_message(c, "system", content);
        }
        Some(_) => {
            return Err(BadRequest::new(
                "system",
                "must be a string or an array of blocks",
            ));
        }
    }
    for (i, m) in messages.iter().enumerate() {
        n += message(m, "messages", i, Parts::Anthropic, c)?;
    }
    Ok(n)
}

fn embeddings_input(body: &Value, c: Counter<'_>) -> Result<u64, BadRequest> {
    const EXPECTED: &str = "must be a string, or a non-empty array of strings or of token arrays";
    match body.get("input") {
        Some(Value::String(s)) => Ok(c.text(s)),
        Some(Value::Array(items)) if !items.is_empty() => {
            let mut n = 0;
            for (i, item) in items.iter().enumerate() {
                n += match item {
                    Value::String(s) => c.text(s),
                    // One array of token ids, or an array of them.
                    Value::Number(_) => 1,
                    Value::Array(ids) => ids.len() as u64,
                    _ => {
                        return Err(BadRequest::new(
                            format!("input[{i}]"),
                            "must be a string, a token id or an array of token ids",
                        ));
                    }
                };
            }
            Ok(n)
        }
        _ => Err(BadRequest::new("input", EXPECTED)),
    }
}

fn message_list<'a>(body: &'a Value, field: &'static str) -> Result<&'a [Value], BadRequest> {
    match body.get(field) {
        Some(Value::Array(list)) if !list.is_empty() => Ok(list),
        Some(Value::Array(_)) => Err(BadRequest::new(field, "must not be empty")),
        None | Some(Value::Null) => Err(BadRequest::new(field, "is required")),
        Some(_) => Err(BadRequest::new(field, "must be an array of messages")),
    }
}

/// `tools` (and the legacy `functions`) count as their compact JSON.
fn tools(body: &Value, c: Counter<'_>) -> u64 {
    ["tools", "functions"]
        .iter()
        .filter_map(|field| body.get(*field))
        .filter(|v| !v.is_null())
        .map(|v| c.json(v))
        .sum()
}

/// A message the body implies (`{role, content}` from `system`,
/// `instructions` or a string `input`), whose content counts `content`.
fn synthetic_message(c: Counter<'_>, role: &str, content: u64) -> u64 {
    MESSAGE_OVERHEAD_TOKENS + c.text(role) + content
}

/// How a message's `content` array counts parts that are neither text nor
/// images: OpenAI's audio and file parts count nothing; Anthropic's
/// `tool_use`, `tool_result`, `document` blocks carry the conversation, so
/// they count as their compact JSON.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Parts {
    OpenAi,
    Anthropic,
}

fn message(
    m: &Value,
    list: &'static str,
    i: usize,
    rule: Parts,
    c: Counter<'_>,
) -> Result<u64, BadRequest> {
    let Value::Object(fields) = m else {
        return Err(BadRequest::new(format!("{list}[{i}]"), "must be an object"));
    };
    let mut n = MESSAGE_OVERHEAD_TOKENS;
    for (key, value) in fields {
        n += match (key.as_str(), value) {
            (_, Value::String(s)) => c.text(s),
            ("content", Value::Array(content)) => {
                parts(content, rule, c, || format!("{list}[{i}].content"))?
            }
            // An assistant turn that only calls tools has `content: null`;
            // like any other non-string value it counts as its JSON, `null`.
            ("content", Value::Null) if rule == Parts::OpenAi => c.json(value),
            ("content", _) => {
                return Err(BadRequest::new(
                    format!("{list}[{i}].content"),
                    "must be a string or an array of content parts",
                ));
            }
            (_, other) => c.json(other),
        };
    }
    if matches!(fields.get("name"), Some(Value::String(_))) {
        n += NAME_OVERHEAD_TOKENS;
    }
    Ok(n)
}

fn parts(
    content: &[Value],
    rule: Parts,
    c: Counter<'_>,
    path: impl Fn() -> String,
) -> Result<u64, BadRequest> {
    let mut n = 0;
    for (j, part) in content.iter().enumerate() {
        let Value::Object(fields) = part else {
            return Err(BadRequest::new(
                format!("{}[{j}]", path()),
                "must be an object",
            ));
        };
        n += part_tokens(fields, part, rule, c);
    }
    Ok(n)
}

fn part_tokens(fields: &Map<String, Value>, part: &Value, rule: Parts, c: Counter<'_>) -> u64 {
    if let Some(Value::String(text)) = fields.get("text") {
        return c.text(text);
    }
    let is_image = matches!(fields.get("type"), Some(Value::String(t)) if IMAGE_PART_TYPES.contains(&t.as_str()));
    match (is_image, rule) {
        (true, _) => IMAGE_TOKENS,
        (false, Parts::Anthropic) => c.json(part),
        (false, Parts::OpenAi) => 0,
    }
}

/// How a [`Counter`] counts a string.
#[derive(Clone, Copy)]
enum Mode {
    /// Through the process-wide cache.
    Cached,
    /// Tokenized now.
    Uncached,
    /// From the cache, or tokenized when short, or bounded by its length.
    Bound,
}

/// Counts strings.
#[derive(Clone, Copy)]
struct Counter<'a> {
    tokenizer: Tokenizer,
    mode: Mode,
    /// Set when a [`Mode::Bound`] count was a bound.
    bounded: &'a Cell<bool>,
    /// Bytes of short strings [`Mode::Bound`] may still tokenize.
    budget: &'a Cell<usize>,
}

impl Counter<'_> {
    fn text(self, s: &str) -> u64 {
        match self.mode {
            Mode::Cached => self.tokenizer.count_cached(s),
            Mode::Uncached => self.tokenizer.count(s),
            Mode::Bound => match self.tokenizer.lookup(s) {
                Some(n) => n,
                None if s.len() <= BOUND_EXACT_MAX_BYTES && s.len() <= self.budget.get() => {
                    self.budget.set(self.budget.get() - s.len());
                    self.tokenizer.count_cached(s)
                }
                None => {
                    self.bounded.set(true);
                    // usize → u64 is lossless on every platform Rust supports.
                    s.len() as u64
                }
            },
        }
    }

    /// The tokens of `v`'s compact JSON (`serde_json::to_string`: object keys
    /// in the order serde_json keeps them — sorted, unless a crate in the
    /// build enables its `preserve_order` feature).
    fn json(self, v: &Value) -> u64 {
        // Serializing a `Value` cannot fail: its keys are strings.
        serde_json::to_string(v).map_or(0, |s| self.text(&s))
    }
}
