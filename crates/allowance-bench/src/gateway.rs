//! The `gateway` scenario (issue 7): the latency the gateway adds over
//! calling its upstream directly.
//!
//! The same chat-completions requests go to the upstream itself (the
//! **direct** endpoint, e.g. the stub) and to one or more **targets** (the
//! gateway in front of that upstream, a durable gateway, LiteLLM's proxy…),
//! interleaved call by call, the order rotating every iteration, so the
//! machine's noise hits every endpoint alike. A closed loop: each worker
//! waits for an answer before its next call, over one keep-alive HTTP/1.1
//! connection per endpoint (concurrency 1 by default: latency, not load).
//!
//! - **shape** — a prompt size (100, 4,096, 32,768 tokens by default), a
//!   [`Prefix`] and a [`Delivery`].
//! - **unique** prompts ([`Prefix::Unique`]) are new on every call (a nonce
//!   leads the one big message), so the gateway's token-count cache never
//!   helps: every call is tokenized in full. **warm** prompts
//!   ([`Prefix::Warm`]) repeat the same conversation (system message, a big
//!   user message, an assistant reply) and end with a short new user
//!   message: the agent pattern the cache is for.
//! - **metrics** — a whole answer's time from the request to the last byte
//!   ([`Metric::Total`]); a stream's time to the first byte of its body
//!   ([`Metric::FirstByte`]) and to its end ([`Metric::End`]).
//! - **round** — `iterations` calls of every shape to every endpoint; a
//!   round's p50s are compared endpoint to endpoint, and the report gives
//!   the median over rounds of each p50 and of each overhead (target p50 −
//!   direct p50), and p99s over every round's calls.
//!
//! Each prompt size is calibrated first against the direct endpoint: the
//! word count is fitted so that the upstream's reported `prompt_tokens`
//! lands on the size, and the report gives the count reached.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HOST, HeaderValue};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::report::Latency;
use crate::{BenchError, MAX_CONCURRENCY, Progress};

/// The scenario's name on the command line (`allowance bench --scenario gateway`).
pub const GATEWAY_SCENARIO: &str = "gateway";

/// The prompt sizes, in input tokens.
pub const DEFAULT_PROMPT_SIZES_TOKENS: [u64; 3] = [100, 4_096, 32_768];

/// The largest prompt size accepted: past the context window of any model
/// the gateway routes, and a body (~4 bytes a token) far below its limit.
pub const MAX_PROMPT_TOKENS: u64 = 1_000_000;

/// Upper bound on `rounds` and `iterations`: far past a useful run, and it
/// keeps the sample vectors' sizes far from overflow.
pub const MAX_GATEWAY_ROUNDS: usize = 10_000;

/// The target for a whole (non-streaming) answer's p50 overhead up
/// to 100 prompt tokens.
pub const SMALL_PROMPT_OVERHEAD_TARGET: Duration = Duration::from_micros(500);

/// The target for a whole answer's p50 overhead up to 4,096 prompt
/// tokens.
pub const MEDIUM_PROMPT_OVERHEAD_TARGET: Duration = Duration::from_micros(1_500);

/// The target for a stream's first-byte p50 overhead (applied here
/// to every prompt size).
pub const FIRST_BYTE_OVERHEAD_TARGET: Duration = Duration::from_micros(1_000);

/// Bound on one call: a 32K-token prompt through a slow proxy on a busy
/// machine takes tens of milliseconds; a target that stops answering must
/// still end the run.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Bound on an answer's body: a 20-token answer is a few KiB, a runaway
/// endpoint must not make the bench buffer without end.
const MAX_ANSWER_BYTES: usize = 4 << 20;

/// The API path every endpoint is called on, after its base path.
const CHAT_PATH: &str = "/v1/chat/completions";

/// The short system message every prompt starts with.
const SYSTEM_MESSAGE: &str = "You are a careful assistant working on a long-running task.";

/// The assistant turn of a warm conversation, between the big prefix and
/// the new question.
const ASSISTANT_REPLY: &str = "Noted. I have read the material above and will use it.";

/// Words the prompts are made of: common English words, each one token
/// (with its leading space) in the usual BPE vocabularies, so a prompt's
/// size in tokens is close to its size in words.
const WORDS: [&str; 64] = [
    "the", "agent", "budget", "model", "call", "token", "limit", "window", "tenant", "user",
    "task", "request", "answer", "cost", "rate", "plan", "queue", "stream", "output", "input",
    "scope", "time", "day", "hour", "minute", "second", "value", "state", "store", "log", "price",
    "number", "system", "service", "server", "client", "key", "data", "file", "line", "word",
    "text", "first", "last", "next", "new", "old", "small", "large", "long", "short", "high",
    "low", "good", "more", "less", "each", "every", "some", "many", "and", "of", "to", "in",
];

/// Which endpoint order a prompt is built for: the big message is new on
/// every call, or the same conversation repeats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Prefix {
    /// Every call's prompt is new: the gateway tokenizes all of it.
    Unique,
    /// The same conversation prefix every call, a short new last message:
    /// the gateway's token-count cache holds the prefix.
    Warm,
}

impl Prefix {
    /// The name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Prefix::Unique => "unique",
            Prefix::Warm => "warm",
        }
    }
}

/// How the answer comes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Delivery {
    /// `"stream": false`: one JSON answer.
    Whole,
    /// `"stream": true`: server-sent events, ending with `data: [DONE]`.
    Stream,
}

impl Delivery {
    /// The name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Delivery::Whole => "whole",
            Delivery::Stream => "stream",
        }
    }

    /// What is timed for this delivery.
    pub fn metrics(self) -> &'static [Metric] {
        match self {
            Delivery::Whole => &[Metric::Total],
            Delivery::Stream => &[Metric::FirstByte, Metric::End],
        }
    }
}

/// What is timed, from the moment the request is handed to the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Metric {
    /// A whole answer: until its last byte.
    Total,
    /// A stream: until the first byte of its body (the first event).
    FirstByte,
    /// A stream: until its last byte.
    End,
}

impl Metric {
    /// The name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Total => "total",
            Metric::FirstByte => "first byte",
            Metric::End => "end",
        }
    }

    fn index(self) -> usize {
        match self {
            Metric::Total => 0,
            Metric::FirstByte => 1,
            Metric::End => 2,
        }
    }
}

/// One kind of request: a prompt size, its prefix, its delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Shape {
    /// The prompt size aimed at, in input tokens.
    pub prompt_tokens: u64,
    /// Unique or warm.
    pub prefix: Prefix,
    /// Whole or streamed.
    pub delivery: Delivery,
}

/// An endpoint measured against the direct one: a name for the report and
/// its base URL (`http://host:port`, no `/v1`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayTarget {
    /// The label in the report (`memory`, `durable`, `litellm`).
    pub name: String,
    /// The base URL; requests go to `<url>/v1/chat/completions`.
    pub url: String,
}

/// A `--target` that is neither `URL` nor `NAME=URL` with a usable name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid target {given:?}: {reason}")]
pub struct ParseTargetError {
    /// The text as given.
    pub given: String,
    /// What is wrong with it.
    pub reason: String,
}

impl FromStr for GatewayTarget {
    type Err = ParseTargetError;

    /// `NAME=URL`, or a bare `URL` named after itself. A name is letters,
    /// digits, `-` and `_` (it labels table columns).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason: &str| ParseTargetError {
            given: s.to_owned(),
            reason: reason.to_owned(),
        };
        let (name, url) = match s.split_once('=') {
            Some((name, url)) if !name.contains("://") => (name, url),
            _ => (s, s),
        };
        if url.is_empty() {
            return Err(err("the URL is empty"));
        }
        if name.is_empty() {
            return Err(err("the name before `=` is empty"));
        }
        if name != url
            && !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(err("a name holds only letters, digits, `-` and `_`"));
        }
        Ok(GatewayTarget {
            name: name.to_owned(),
            url: url.to_owned(),
        })
    }
}

/// Everything [`run_gateway`] needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayBenchOptions {
    /// The endpoints measured against `direct`, each with its own
    /// connections; names must differ from each other and from `direct`.
    pub targets: Vec<GatewayTarget>,
    /// The upstream itself (the stub), called directly.
    pub direct: String,
    /// Sent as `Authorization: Bearer <key>` to every endpoint (the
    /// gateway's key; LiteLLM's master key; the stub ignores it).
    pub key: Option<String>,
    /// The `model` of every request.
    pub model: String,
    /// `max_tokens` of every request: the answer's length (the stub writes
    /// this many tokens when it is below its own default).
    pub max_tokens: u64,
    /// The prompt sizes, in input tokens.
    pub prompt_sizes_tokens: Vec<u64>,
    /// Measured rounds; the report gives medians over them.
    pub rounds: usize,
    /// Calls of each shape to each endpoint per round, per worker.
    pub iterations: usize,
    /// Iterations before the first round, counted nowhere (connections
    /// open, the warm prefixes cached, the targets' lazy work done).
    pub warmup_iterations: usize,
    /// Workers, each with its own connection to every endpoint.
    pub concurrency: usize,
    /// A target whose overheads the others' are divided by (LiteLLM), so
    /// the report gives "×reference" ratios from the same run.
    pub reference: Option<String>,
    /// Whether the reference is measured in a phase of its own in every
    /// round (with direct calls of that phase to compare it with), rather
    /// than interleaved call by call with the other targets. A reference
    /// such as LiteLLM's proxy keeps a core busy after each answer
    /// (logging, cost tracking: 34-38 s of CPU over a 57 s run here); on a
    /// 2-core machine that work can otherwise run during the next
    /// endpoint's call and count as the gateway's overhead. Ignored without
    /// a reference.
    pub reference_apart: bool,
    /// How progress is shown.
    pub progress: Progress,
}

impl GatewayBenchOptions {
    /// The measurement of `targets` against `direct`: 100 / 4,096 /
    /// 32,768-token prompts, `gpt-4o`, 20 output tokens, 5 rounds of 40
    /// iterations after 5 of warm-up, concurrency 1, progress off.
    pub fn new(direct: impl Into<String>, targets: Vec<GatewayTarget>) -> GatewayBenchOptions {
        GatewayBenchOptions {
            targets,
            direct: direct.into(),
            key: None,
            model: "gpt-4o".to_owned(),
            max_tokens: 20,
            prompt_sizes_tokens: DEFAULT_PROMPT_SIZES_TOKENS.to_vec(),
            rounds: 5,
            iterations: 40,
            warmup_iterations: 5,
            concurrency: 1,
            reference: None,
            reference_apart: true,
            progress: Progress::Off,
        }
    }

    /// Every shape measured, in report order.
    pub fn shapes(&self) -> Vec<Shape> {
        let mut shapes = Vec::new();
        for &prompt_tokens in &self.prompt_sizes_tokens {
            for prefix in [Prefix::Unique, Prefix::Warm] {
                for delivery in [Delivery::Whole, Delivery::Stream] {
                    shapes.push(Shape {
                        prompt_tokens,
                        prefix,
                        delivery,
                    });
                }
            }
        }
        shapes
    }

    fn validate(&self) -> Result<(), BenchError> {
        let invalid =
            |field: &'static str, reason: String| BenchError::InvalidOption { field, reason };
        if self.targets.is_empty() {
            return Err(invalid(
                "target",
                "no target to measure against the direct endpoint".to_owned(),
            ));
        }
        let mut names = vec!["direct"];
        for t in &self.targets {
            if names.contains(&t.name.as_str()) {
                return Err(invalid(
                    "target",
                    format!("the name {:?} is used twice (`direct` is taken)", t.name),
                ));
            }
            names.push(&t.name);
        }
        if let Some(reference) = &self.reference
            && !self.targets.iter().any(|t| &t.name == reference)
        {
            return Err(invalid(
                "reference",
                format!(
                    "{reference:?} is not one of the targets' names {:?}",
                    &names[1..]
                ),
            ));
        }
        if self.model.is_empty() {
            return Err(invalid("model", "the model is empty".to_owned()));
        }
        if self.max_tokens == 0 {
            return Err(invalid("max_tokens", "must be at least 1".to_owned()));
        }
        if self.prompt_sizes_tokens.is_empty() {
            return Err(invalid("sizes", "no prompt size".to_owned()));
        }
        for &size in &self.prompt_sizes_tokens {
            if !(16..=MAX_PROMPT_TOKENS).contains(&size) {
                return Err(invalid(
                    "sizes",
                    format!("{size} is outside 16..={MAX_PROMPT_TOKENS} tokens"),
                ));
            }
        }
        let mut sorted = self.prompt_sizes_tokens.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != self.prompt_sizes_tokens.len() {
            return Err(invalid("sizes", "a size is listed twice".to_owned()));
        }
        for (field, n) in [("rounds", self.rounds), ("iterations", self.iterations)] {
            if n == 0 || n > MAX_GATEWAY_ROUNDS {
                return Err(invalid(
                    field,
                    format!("{n} is outside 1..={MAX_GATEWAY_ROUNDS}"),
                ));
            }
        }
        if self.warmup_iterations > MAX_GATEWAY_ROUNDS {
            return Err(invalid(
                "warmup_iterations",
                format!("{} is over {MAX_GATEWAY_ROUNDS}", self.warmup_iterations),
            ));
        }
        if self.concurrency == 0 || self.concurrency > MAX_CONCURRENCY {
            return Err(invalid(
                "concurrency",
                format!("{} is outside 1..={MAX_CONCURRENCY}", self.concurrency),
            ));
        }
        Ok(())
    }
}

/// An endpoint, parsed once.
#[derive(Debug, Clone)]
struct Endpoint {
    name: String,
    addr: String,
    host: HeaderValue,
    path: String,
    authorization: Option<HeaderValue>,
}

impl Endpoint {
    /// Parses `url`; `field` names the option in errors (`direct`, `target`).
    fn parse(
        field: &'static str,
        name: &str,
        url: &str,
        key: Option<&str>,
    ) -> Result<Endpoint, BenchError> {
        let invalid = |reason: String| BenchError::InvalidOption { field, reason };
        let with_scheme = if url.contains("://") {
            url.to_owned()
        } else {
            format!("http://{url}")
        };
        let uri: Uri = with_scheme
            .parse()
            .map_err(|e| invalid(format!("{url:?} is not a URL ({e})")))?;
        if uri.scheme_str() != Some("http") {
            return Err(invalid(format!(
                "{url:?}: only http:// is measured (TLS would time the client's crypto)"
            )));
        }
        let authority = uri
            .authority()
            .filter(|a| !a.host().is_empty())
            .ok_or_else(|| invalid(format!("{url:?} has no host")))?;
        if authority.as_str().contains('@') || uri.query().is_some() {
            return Err(invalid(format!(
                "{url:?}: give a base URL without credentials or query"
            )));
        }
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|e| invalid(format!("{url:?}: bad host ({e})")))?;
        let base = uri.path().trim_end_matches('/');
        // `http://host/v1` is a common way to write a base URL: do not call `/v1/v1/…`.
        let base = base.strip_suffix("/v1").unwrap_or(base);
        let authorization =
            match key {
                None => None,
                Some("") => {
                    return Err(BenchError::InvalidOption {
                        field: "key",
                        reason: "the key is empty".to_owned(),
                    });
                }
                Some(key) => Some(HeaderValue::from_str(&format!("Bearer {key}")).map_err(
                    |_| BenchError::InvalidOption {
                        field: "key",
                        reason: "the key holds characters an HTTP header cannot carry".to_owned(),
                    },
                )?),
            };
        Ok(Endpoint {
            name: name.to_owned(),
            addr: format!(
                "{}:{}",
                authority.host(),
                authority.port_u16().unwrap_or(80)
            ),
            host,
            path: format!("{base}{CHAT_PATH}"),
            authorization,
        })
    }
}

/// One keep-alive HTTP/1.1 connection.
struct Conn {
    sender: http1::SendRequest<Full<Bytes>>,
}

/// What one exchange gave: when the first body byte and the last byte came,
/// and the body when asked for.
struct Exchange {
    status: StatusCode,
    first_byte: Duration,
    end: Duration,
    body: Bytes,
}

/// Why a call gave no usable timing.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum CallError {
    Connect,
    Transport,
    Timeout,
    TooLarge,
    Status(u16),
    /// A stream whose body does not end with `data: [DONE]`.
    UnfinishedStream,
    /// A whole answer that is not a chat completion.
    NotACompletion,
}

impl CallError {
    fn kind(&self) -> String {
        match self {
            CallError::Connect => "transport: connect".to_owned(),
            CallError::Transport => "transport: broken during a call".to_owned(),
            CallError::Timeout => "transport: timeout".to_owned(),
            CallError::TooLarge => "transport: answer too large".to_owned(),
            CallError::Status(s) => format!("status {s}"),
            CallError::UnfinishedStream => "stream without data: [DONE]".to_owned(),
            CallError::NotACompletion => "answer without choices".to_owned(),
        }
    }

    /// Whether the connection is unusable afterwards.
    fn breaks_connection(&self) -> bool {
        matches!(
            self,
            CallError::Connect | CallError::Transport | CallError::Timeout | CallError::TooLarge
        )
    }
}

impl Conn {
    async fn open(addr: &str) -> Result<Conn, CallError> {
        let stream = match tokio::time::timeout(CALL_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(_)) => return Err(CallError::Connect),
            Err(_) => return Err(CallError::Timeout),
        };
        // Every endpoint gets the same: no Nagle delay on either side of the comparison.
        let _ = stream.set_nodelay(true);
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|_| CallError::Connect)?;
        tokio::spawn(async move {
            // A broken connection surfaces on the next call.
            let _ = connection.await;
        });
        Ok(Conn { sender })
    }

    /// POSTs `body` and reads the whole answer, timing the first body byte
    /// and the end from the moment the request is handed over.
    async fn exchange(
        &mut self,
        ep: &Endpoint,
        body: Bytes,
        keep_body: bool,
    ) -> Result<Exchange, CallError> {
        let mut builder = Request::builder()
            .method(Method::POST)
            .uri(ep.path.as_str())
            .header(HOST, ep.host.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(a) = &ep.authorization {
            builder = builder.header(AUTHORIZATION, a.clone());
        }
        let request = builder
            .body(Full::new(body))
            .map_err(|_| CallError::Transport)?;
        let call = async {
            self.sender
                .ready()
                .await
                .map_err(|_| CallError::Transport)?;
            let sent = Instant::now();
            let response = self
                .sender
                .send_request(request)
                .await
                .map_err(|_| CallError::Transport)?;
            let status = response.status();
            let mut body = response.into_body();
            let mut first_byte = None;
            let mut kept = Vec::new();
            let mut tail: Vec<u8> = Vec::new();
            let mut total_bytes = 0usize;
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|_| CallError::Transport)?;
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                if data.is_empty() {
                    continue;
                }
                first_byte.get_or_insert_with(|| sent.elapsed());
                total_bytes += data.len();
                if total_bytes > MAX_ANSWER_BYTES {
                    return Err(CallError::TooLarge);
                }
                if keep_body || status != StatusCode::OK {
                    kept.extend_from_slice(&data);
                }
                // Only the end matters for `[DONE]`: keep a short tail.
                tail.extend_from_slice(&data);
                if tail.len() > 64 {
                    tail.drain(..tail.len() - 64);
                }
            }
            let end = sent.elapsed();
            if !keep_body && status == StatusCode::OK {
                kept = tail;
            }
            Ok(Exchange {
                status,
                first_byte: first_byte.unwrap_or(end),
                end,
                body: Bytes::from(kept),
            })
        };
        tokio::time::timeout(CALL_TIMEOUT, call)
            .await
            .unwrap_or(Err(CallError::Timeout))
    }
}

/// A prompt of one size and prefix, fitted against the direct endpoint.
#[derive(Debug, Clone)]
struct Prompt {
    /// The big message's text (the whole prompt but the framing).
    bulk: String,
    /// Input tokens the direct endpoint counted, at calibration.
    measured_tokens: u64,
}

/// Deterministic text of `words` words: the same on every run, so runs are
/// comparable, varied enough that it tokenizes like prose.
fn prose(words: usize, seed: u64) -> String {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut out = String::with_capacity(words * 7);
    for i in 0..words {
        // PCG-style LCG; the high bits are the well-mixed ones.
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let word = WORDS[(state >> 58) as usize];
        if i > 0 {
            out.push(if i % 17 == 0 { '.' } else { ' ' });
            if i % 17 == 0 {
                out.push(' ');
            }
        }
        out.push_str(word);
    }
    out.push('.');
    out
}

/// The request body of one call.
fn request_body(
    opts: &GatewayBenchOptions,
    prefix: Prefix,
    bulk: &str,
    delivery: Delivery,
    nonce: &str,
) -> Bytes {
    let messages = match prefix {
        // The nonce leads the big message, so its hash (the cache key) is new.
        Prefix::Unique => json!([
            {"role": "system", "content": SYSTEM_MESSAGE},
            {"role": "user", "content": format!("[{nonce}] {bulk}")},
        ]),
        Prefix::Warm => json!([
            {"role": "system", "content": SYSTEM_MESSAGE},
            {"role": "user", "content": bulk},
            {"role": "assistant", "content": ASSISTANT_REPLY},
            {"role": "user", "content": format!("Next step [{nonce}]: summarise the above in one line.")},
        ]),
    };
    let mut body = json!({
        "model": opts.model,
        "messages": messages,
        "max_tokens": opts.max_tokens,
    });
    if delivery == Delivery::Stream {
        body["stream"] = Value::Bool(true);
    }
    // Serializing a `Value` cannot fail.
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}

/// Checks an answer and turns it into the timings its delivery measures.
fn check(exchange: &Exchange, delivery: Delivery) -> Result<(), CallError> {
    if exchange.status != StatusCode::OK {
        return Err(CallError::Status(exchange.status.as_u16()));
    }
    match delivery {
        Delivery::Stream => {
            let tail = String::from_utf8_lossy(&exchange.body);
            if !tail.trim_end().ends_with("data: [DONE]") {
                return Err(CallError::UnfinishedStream);
            }
        }
        Delivery::Whole => {
            // The tail of a chat completion closes its JSON object.
            if !exchange.body.trim_ascii_end().ends_with(b"}") {
                return Err(CallError::NotACompletion);
            }
        }
    }
    Ok(())
}

/// Unique per call, and per run: a gateway that lives across runs must not
/// find an earlier run's prompt in its cache.
struct Nonces {
    run: u64,
    next: AtomicU64,
}

impl Nonces {
    fn new() -> Nonces {
        let run = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Nonces {
            run,
            next: AtomicU64::new(0),
        }
    }

    fn next(&self) -> String {
        format!(
            "{:x}-{}",
            self.run,
            self.next.fetch_add(1, Ordering::Relaxed)
        )
    }
}

/// One call to the direct endpoint for its reported `prompt_tokens`.
async fn count_tokens(
    opts: &GatewayBenchOptions,
    direct: &Endpoint,
    conn: &mut Option<Conn>,
    prefix: Prefix,
    bulk: &str,
    nonces: &Nonces,
) -> Result<u64, BenchError> {
    let body = request_body(opts, prefix, bulk, Delivery::Whole, &nonces.next());
    let setup = |reason: String| BenchError::InvalidOption {
        field: "direct",
        reason,
    };
    let c = match conn {
        Some(c) => c,
        None => conn.insert(
            Conn::open(&direct.addr)
                .await
                .map_err(|e| setup(format!("{}: cannot call it ({})", direct.addr, e.kind())))?,
        ),
    };
    let exchange = c.exchange(direct, body, true).await.map_err(|e| {
        *conn = None;
        setup(format!("{}: {}", direct.addr, e.kind()))
    })?;
    if exchange.status != StatusCode::OK {
        return Err(setup(format!(
            "POST {} answered {}: {}",
            direct.path,
            exchange.status,
            excerpt(&exchange.body)
        )));
    }
    let answer: Value = serde_json::from_slice(&exchange.body)
        .map_err(|e| setup(format!("the answer is not JSON ({e})")))?;
    answer["usage"]["prompt_tokens"].as_u64().ok_or_else(|| {
        setup(format!(
            "the answer has no usage.prompt_tokens to size the prompts by: {}",
            excerpt(&exchange.body)
        ))
    })
}

fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let mut cut: String = text.chars().take(300).collect();
    if cut.len() < text.len() {
        cut.push('…');
    }
    cut
}

/// Fits the word count of each size's big message so the direct
/// endpoint's count lands on the size: tokens = a + b·words, from two
/// probes, then checked.
async fn calibrate(
    opts: &GatewayBenchOptions,
    direct: &Endpoint,
    nonces: &Nonces,
) -> Result<BTreeMap<(u64, Prefix), Prompt>, BenchError> {
    let mut conn = None;
    let mut out = BTreeMap::new();
    for &size in &opts.prompt_sizes_tokens {
        for prefix in [Prefix::Unique, Prefix::Warm] {
            let seed = size ^ ((prefix as u64) << 40);
            let w1 = usize::try_from(size).unwrap_or(usize::MAX).max(8);
            let w0 = w1 / 2;
            let t0 =
                count_tokens(opts, direct, &mut conn, prefix, &prose(w0, seed), nonces).await?;
            let t1 =
                count_tokens(opts, direct, &mut conn, prefix, &prose(w1, seed), nonces).await?;
            let per_word = (t1 as f64 - t0 as f64) / (w1 - w0) as f64;
            let fixed = t1 as f64 - per_word * w1 as f64;
            let words = if per_word > 0.0 {
                ((size as f64 - fixed) / per_word).round().max(1.0) as usize
            } else {
                w1
            };
            let bulk = prose(words, seed);
            let measured_tokens =
                count_tokens(opts, direct, &mut conn, prefix, &bulk, nonces).await?;
            out.insert(
                (size, prefix),
                Prompt {
                    bulk,
                    measured_tokens,
                },
            );
        }
    }
    Ok(out)
}

/// Every worker's samples, by round, endpoint, shape and metric.
#[derive(Debug, Clone)]
struct Samples {
    endpoints: usize,
    shapes: usize,
    cells: Vec<Vec<Duration>>,
}

impl Samples {
    fn new(rounds: usize, endpoints: usize, shapes: usize) -> Samples {
        Samples {
            endpoints,
            shapes,
            cells: vec![Vec::new(); rounds * endpoints * shapes * 3],
        }
    }

    fn at(
        &mut self,
        round: usize,
        endpoint: usize,
        shape: usize,
        metric: Metric,
    ) -> &mut Vec<Duration> {
        let i = ((round * self.endpoints + endpoint) * self.shapes + shape) * 3 + metric.index();
        &mut self.cells[i]
    }

    fn get(&self, round: usize, endpoint: usize, shape: usize, metric: Metric) -> &[Duration] {
        let i = ((round * self.endpoints + endpoint) * self.shapes + shape) * 3 + metric.index();
        &self.cells[i]
    }

    fn merge(&mut self, other: Samples) {
        for (into, from) in self.cells.iter_mut().zip(other.cells) {
            into.extend(from);
        }
    }
}

/// What one worker brings back.
struct WorkerResult {
    samples: Samples,
    errors: BTreeMap<(usize, String), u64>,
}

/// Shared, read-only state of a run.
struct Plan {
    opts: GatewayBenchOptions,
    /// The direct endpoint first, then the targets in the order given; with
    /// the reference apart, a second direct endpoint last (the same URL,
    /// called in the reference's phase).
    endpoints: Vec<Endpoint>,
    /// Each phase's endpoints, its direct one first: one phase with every
    /// endpoint, or the reference's own second phase.
    phases: Vec<Vec<usize>>,
    /// Lines the workers up at each phase's start, so that one worker's
    /// reference calls never overlap another's gateway calls.
    phase_barrier: tokio::sync::Barrier,
    shapes: Vec<Shape>,
    prompts: BTreeMap<(u64, Prefix), Prompt>,
    nonces: Nonces,
    calls_done: AtomicU64,
    errors_seen: AtomicU64,
}

impl Plan {
    /// The direct endpoint that endpoint `e` is compared with: the first of
    /// its phase (`e` itself for a direct one).
    fn direct_of(&self, e: usize) -> usize {
        self.phases
            .iter()
            .find(|phase| phase.contains(&e))
            .map_or(0, |phase| phase[0])
    }
}

/// How long a worker waits at each change of phase, so that what an
/// endpoint does after its last answer (LiteLLM's logging and cost
/// tracking) is over before the next phase's first call.
const PHASE_PAUSE: Duration = Duration::from_millis(250);

/// A worker's connections (one per endpoint, opened on first use) and what
/// it measured.
struct WorkerState {
    conns: Vec<Option<Conn>>,
    measured: WorkerResult,
}

impl WorkerState {
    /// Sends `body` (shape `s`) to endpoint `e` and records the times, in
    /// `round` (none while warming up), or the failure.
    async fn call(
        &mut self,
        plan: &Plan,
        e: usize,
        s: usize,
        delivery: Delivery,
        body: Bytes,
        round: Option<usize>,
    ) {
        let ep = &plan.endpoints[e];
        let result = match &mut self.conns[e] {
            Some(c) => c.exchange(ep, body, false).await,
            None => match Conn::open(&ep.addr).await {
                Ok(c) => self.conns[e].insert(c).exchange(ep, body, false).await,
                Err(err) => Err(err),
            },
        }
        .and_then(|x| check(&x, delivery).map(|()| x));
        plan.calls_done.fetch_add(1, Ordering::Relaxed);
        match result {
            Ok(x) => {
                let Some(r) = round else { return };
                match delivery {
                    Delivery::Whole => self.measured.samples.at(r, e, s, Metric::Total).push(x.end),
                    Delivery::Stream => {
                        self.measured
                            .samples
                            .at(r, e, s, Metric::FirstByte)
                            .push(x.first_byte);
                        self.measured.samples.at(r, e, s, Metric::End).push(x.end);
                    }
                }
            }
            Err(err) => {
                if err.breaks_connection() {
                    self.conns[e] = None;
                }
                if round.is_some() {
                    plan.errors_seen.fetch_add(1, Ordering::Relaxed);
                    *self.measured.errors.entry((e, err.kind())).or_default() += 1;
                }
            }
        }
    }
}

/// A worker: `warmup_iterations` then `rounds × iterations` iterations of
/// each phase in turn, each iteration calling every shape on every endpoint
/// of its phase, the endpoint order rotating by one every iteration (and
/// differing between workers).
async fn worker(
    index: usize,
    plan: Arc<Plan>,
    bar: Option<ProgressBar>,
    lines: bool,
) -> WorkerResult {
    let opts = &plan.opts;
    let n = plan.endpoints.len();
    let mut state = WorkerState {
        conns: (0..n).map(|_| None).collect(),
        measured: WorkerResult {
            samples: Samples::new(opts.rounds, n, plan.shapes.len()),
            errors: BTreeMap::new(),
        },
    };
    let started = Instant::now();
    let blocks = std::iter::once((None, opts.warmup_iterations))
        .chain((0..opts.rounds).map(|r| (Some(r), opts.iterations)));
    for (round, iterations) in blocks {
        for (p, phase) in plan.phases.iter().enumerate() {
            if plan.phases.len() > 1 {
                plan.phase_barrier.wait().await;
                // Every phase but the run's very first follows another.
                if round.is_some() || p > 0 {
                    tokio::time::sleep(PHASE_PAUSE).await;
                }
            }
            for iteration in 0..iterations {
                for (s, shape) in plan.shapes.iter().enumerate() {
                    let Some(prompt) = plan.prompts.get(&(shape.prompt_tokens, shape.prefix))
                    else {
                        continue;
                    };
                    // One body for every endpoint: they all see the same bytes.
                    let body = request_body(
                        opts,
                        shape.prefix,
                        &prompt.bulk,
                        shape.delivery,
                        &plan.nonces.next(),
                    );
                    for k in 0..phase.len() {
                        let e = phase[(k + iteration + index) % phase.len()];
                        state
                            .call(&plan, e, s, shape.delivery, body.clone(), round)
                            .await;
                    }
                }
                if let Some(bar) = &bar {
                    bar.inc(1);
                    bar.set_message(match round {
                        None => "warming up".to_owned(),
                        Some(r) => format!(
                            "round {}/{} · {} calls · {} errors",
                            r + 1,
                            opts.rounds,
                            plan.calls_done.load(Ordering::Relaxed),
                            plan.errors_seen.load(Ordering::Relaxed)
                        ),
                    });
                }
            }
        }
        if lines
            && index == 0
            && let Some(r) = round
        {
            eprintln!(
                "bench: gateway round {}/{} done at {:.1} s · {} calls · {} errors",
                r + 1,
                opts.rounds,
                started.elapsed().as_secs_f64(),
                plan.calls_done.load(Ordering::Relaxed),
                plan.errors_seen.load(Ordering::Relaxed)
            );
        }
    }
    state.measured
}

/// One endpoint's figures for one shape and metric.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Figures {
    /// Calls measured, over all rounds.
    pub count: u64,
    /// The median over rounds of each round's p50.
    pub p50: Duration,
    /// The p99 over every round's calls.
    pub p99: Duration,
}

/// A target's figures for one shape and metric, with its overhead over the
/// direct endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetFigures {
    /// The target's name.
    pub name: String,
    /// Its own latency.
    pub figures: Figures,
    /// The direct calls it is compared with: the row's, or those of the
    /// reference's own phase (see [`GatewayBenchOptions::reference_apart`]).
    pub direct: Figures,
    /// Median over rounds of (target p50 − direct p50) in that round, in
    /// milliseconds (signed: noise can make it negative).
    pub overhead_p50_ms: f64,
    /// Target p99 − direct p99, over all rounds' calls, in milliseconds.
    pub overhead_p99_ms: f64,
    /// Each round's p50 overhead, in milliseconds, in round order.
    pub rounds_overhead_p50_ms: Vec<f64>,
}

/// One line group of the table: a shape, a metric, every endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayRow {
    /// The request shape.
    pub shape: Shape,
    /// What was timed.
    pub metric: Metric,
    /// The direct endpoint's figures.
    pub direct: Figures,
    /// Every target's, in the order given.
    pub targets: Vec<TargetFigures>,
}

/// A prompt size as reached by calibration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptSize {
    /// The size aimed at.
    pub nominal_tokens: u64,
    /// Unique or warm.
    pub prefix: Prefix,
    /// What the direct endpoint counted (`usage.prompt_tokens`).
    pub measured_tokens: u64,
}

/// One of the targets, judged on one target's unique-prompt figures.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// The target judged.
    pub target: String,
    /// The shape judged (always [`Prefix::Unique`]: the cache does not help).
    pub shape: Shape,
    /// [`Metric::Total`] or [`Metric::FirstByte`].
    pub metric: Metric,
    /// The measured p50 overhead, in milliseconds.
    pub overhead_p50_ms: f64,
    /// The bound.
    pub limit: Duration,
    /// Whether the overhead is within the bound.
    pub met: bool,
}

/// What [`run_gateway`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayReport {
    /// The direct endpoint's URL.
    pub direct: String,
    /// The targets, in the order given.
    pub targets: Vec<GatewayTarget>,
    /// The model requested.
    pub model: String,
    /// `max_tokens` of every request.
    pub max_tokens: u64,
    /// Measured rounds.
    pub rounds: usize,
    /// Iterations per round per worker.
    pub iterations: usize,
    /// Workers.
    pub concurrency: usize,
    /// The target the others' overheads are divided by.
    pub reference: Option<String>,
    /// Whether the reference had a phase of its own in every round (see
    /// [`GatewayBenchOptions::reference_apart`]).
    pub reference_apart: bool,
    /// The prompts as calibrated.
    pub prompts: Vec<PromptSize>,
    /// Every shape and metric.
    pub rows: Vec<GatewayRow>,
    /// Failed calls by endpoint name, then kind (`status 429`,
    /// `transport: timeout`, …); not in the figures.
    pub errors: BTreeMap<String, BTreeMap<String, u64>>,
    /// The measurement's wall time, warm-up included, calibration not.
    pub elapsed: Duration,
}

fn median_f64(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The figures of endpoint `e`: per-round p50s (None for a round without
/// calls) and the pooled figures.
fn figures_of(
    samples: &Samples,
    rounds: usize,
    e: usize,
    s: usize,
    m: Metric,
) -> (Vec<Option<f64>>, Figures) {
    let mut per_round = Vec::with_capacity(rounds);
    let mut pooled = Vec::new();
    for r in 0..rounds {
        let cell = samples.get(r, e, s, m);
        pooled.extend_from_slice(cell);
        per_round.push((!cell.is_empty()).then(|| millis(Latency::from_samples(cell).p50)));
    }
    let mut p50s: Vec<f64> = per_round.iter().flatten().copied().collect();
    let p50 = median_f64(&mut p50s);
    let all = Latency::from_samples(&pooled);
    let figures = Figures {
        count: all.count,
        p50: if p50.is_finite() {
            Duration::from_secs_f64(p50 / 1000.0)
        } else {
            Duration::ZERO
        },
        p99: all.p99,
    };
    (per_round, figures)
}

fn build_report(
    plan: &Plan,
    samples: &Samples,
    errors: BTreeMap<(usize, String), u64>,
    elapsed: Duration,
) -> GatewayReport {
    let opts = &plan.opts;
    let mut rows = Vec::new();
    for (s, shape) in plan.shapes.iter().enumerate() {
        for &metric in shape.delivery.metrics() {
            let (_, row_direct) = figures_of(samples, opts.rounds, 0, s, metric);
            let mut targets = Vec::new();
            for (e, ep) in plan.endpoints.iter().enumerate() {
                let d = plan.direct_of(e);
                if d == e {
                    continue;
                }
                // Against the direct calls of the target's own phase.
                let (direct_rounds, direct) = figures_of(samples, opts.rounds, d, s, metric);
                let (rounds, figures) = figures_of(samples, opts.rounds, e, s, metric);
                let rounds_overhead_p50_ms: Vec<f64> = rounds
                    .iter()
                    .zip(&direct_rounds)
                    .filter_map(|(t, d)| Some((*t)? - (*d)?))
                    .collect();
                let overhead_p50_ms = median_f64(&mut rounds_overhead_p50_ms.clone());
                let overhead_p99_ms = if figures.count > 0 && direct.count > 0 {
                    millis(figures.p99) - millis(direct.p99)
                } else {
                    f64::NAN
                };
                targets.push(TargetFigures {
                    name: ep.name.clone(),
                    figures,
                    direct,
                    overhead_p50_ms,
                    overhead_p99_ms,
                    rounds_overhead_p50_ms,
                });
            }
            rows.push(GatewayRow {
                shape: *shape,
                metric,
                direct: row_direct,
                targets,
            });
        }
    }
    let mut by_name: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for ((e, kind), n) in errors {
        *by_name
            .entry(plan.endpoints[e].name.clone())
            .or_default()
            .entry(kind)
            .or_default() += n;
    }
    GatewayReport {
        direct: opts.direct.clone(),
        targets: opts.targets.clone(),
        model: opts.model.clone(),
        max_tokens: opts.max_tokens,
        rounds: opts.rounds,
        iterations: opts.iterations,
        concurrency: opts.concurrency,
        reference: opts.reference.clone(),
        reference_apart: plan.phases.len() > 1,
        prompts: plan
            .prompts
            .iter()
            .map(|(&(nominal_tokens, prefix), p)| PromptSize {
                nominal_tokens,
                prefix,
                measured_tokens: p.measured_tokens,
            })
            .collect(),
        rows,
        errors: by_name,
        elapsed,
    }
}

/// Checks every endpoint answers every shape before measuring, so a
/// misconfigured target is one clear error rather than a table of failures.
async fn preflight(plan: &Plan) -> Result<(), BenchError> {
    // The reference phase's direct endpoint is the direct one again.
    for (e, ep) in plan
        .endpoints
        .iter()
        .enumerate()
        .take(plan.opts.targets.len() + 1)
    {
        let field = if e == 0 { "direct" } else { "target" };
        let mut conn = Conn::open(&ep.addr).await.map_err(|err| match err {
            CallError::Connect | CallError::Timeout => BenchError::Connect {
                addr: ep.addr.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    format!("{} ({})", ep.name, err.kind()),
                ),
            },
            other => BenchError::InvalidOption {
                field,
                reason: format!("{}: {}", ep.name, other.kind()),
            },
        })?;
        for delivery in [Delivery::Whole, Delivery::Stream] {
            let Some(prompt) = plan.prompts.values().next() else {
                continue;
            };
            let body = request_body(
                &plan.opts,
                Prefix::Unique,
                &prompt.bulk,
                delivery,
                &plan.nonces.next(),
            );
            let x =
                conn.exchange(ep, body, true)
                    .await
                    .map_err(|err| BenchError::InvalidOption {
                        field,
                        reason: format!("{} ({}): {}", ep.name, ep.addr, err.kind()),
                    })?;
            let ok = check(&x, delivery).map_err(|err| BenchError::InvalidOption {
                field,
                reason: format!(
                    "{} ({}) POST {} ({}): {}: {}",
                    ep.name,
                    ep.addr,
                    ep.path,
                    delivery.name(),
                    err.kind(),
                    excerpt(&x.body)
                ),
            });
            ok?;
        }
    }
    Ok(())
}

/// The phases of a round, each its direct endpoint first: one phase of
/// every endpoint, or, with the reference apart, the others first and then
/// the reference beside a second direct endpoint pushed on `endpoints`.
fn phases(opts: &GatewayBenchOptions, endpoints: &mut Vec<Endpoint>) -> Vec<Vec<usize>> {
    let n = endpoints.len();
    let reference = opts
        .reference
        .as_ref()
        .filter(|_| opts.reference_apart)
        .and_then(|name| (1..n).find(|&e| &endpoints[e].name == name));
    let Some(reference) = reference else {
        return vec![(0..n).collect()];
    };
    let second_direct = n;
    endpoints.push(endpoints[0].clone());
    let first = (0..n).filter(|&e| e != reference).collect();
    vec![first, vec![second_direct, reference]]
}

/// Runs the `gateway` scenario: calibrates the prompt sizes against
/// `opts.direct`, checks every endpoint answers, then measures every shape
/// on every endpoint, interleaved, and reports the overheads.
///
/// Needs a tokio runtime with the time and I/O drivers.
///
/// # Errors
/// A bad option (naming it), an endpoint that cannot be reached, or one
/// that does not answer a first request of each delivery with a proper
/// chat completion. Failures during the measurement are counted in the
/// report instead.
pub async fn run_gateway(opts: &GatewayBenchOptions) -> Result<GatewayReport, BenchError> {
    opts.validate()?;
    let key = opts.key.as_deref();
    let mut endpoints = vec![Endpoint::parse("direct", "direct", &opts.direct, key)?];
    for t in &opts.targets {
        endpoints.push(Endpoint::parse("target", &t.name, &t.url, key)?);
    }
    let nonces = Nonces::new();
    let prompts = calibrate(opts, &endpoints[0], &nonces).await?;
    let phases = phases(opts, &mut endpoints);
    let plan = Arc::new(Plan {
        opts: opts.clone(),
        shapes: opts.shapes(),
        phase_barrier: tokio::sync::Barrier::new(opts.concurrency),
        phases,
        endpoints,
        prompts,
        nonces,
        calls_done: AtomicU64::new(0),
        errors_seen: AtomicU64::new(0),
    });
    preflight(&plan).await?;

    let per_worker = (opts.warmup_iterations + opts.rounds * opts.iterations) * plan.phases.len();
    let bar = (opts.progress == Progress::Bar).then(|| {
        let bar = ProgressBar::new((per_worker * opts.concurrency) as u64);
        // The template is a constant; should it ever not parse, the default bar still works.
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] [{bar:30}] {pos}/{len} iterations · {msg}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar
    });
    let started = Instant::now();
    let mut workers = JoinSet::new();
    for index in 0..opts.concurrency {
        workers.spawn(worker(
            index,
            Arc::clone(&plan),
            bar.clone(),
            opts.progress == Progress::Lines,
        ));
    }
    let mut samples = Samples::new(opts.rounds, plan.endpoints.len(), plan.shapes.len());
    let mut errors: BTreeMap<(usize, String), u64> = BTreeMap::new();
    let mut failure = None;
    while let Some(joined) = workers.join_next().await {
        match joined {
            Ok(result) => {
                samples.merge(result.samples);
                for (k, n) in result.errors {
                    *errors.entry(k).or_default() += n;
                }
            }
            Err(e) => {
                failure = Some(BenchError::Worker(e.to_string()));
                workers.abort_all();
            }
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if let Some(failure) = failure {
        return Err(failure);
    }
    Ok(build_report(&plan, &samples, errors, started.elapsed()))
}

/// The bound for a shape's metric, when it sets one: whole answers
/// up to 100 and up to 4,096 prompt tokens, and every stream's first byte.
pub fn overhead_target(shape: Shape, metric: Metric) -> Option<Duration> {
    match metric {
        Metric::Total if shape.prompt_tokens <= 100 => Some(SMALL_PROMPT_OVERHEAD_TARGET),
        Metric::Total if shape.prompt_tokens <= 4_096 => Some(MEDIUM_PROMPT_OVERHEAD_TARGET),
        Metric::FirstByte => Some(FIRST_BYTE_OVERHEAD_TARGET),
        _ => None,
    }
}

impl GatewayReport {
    /// The targets, judged on unique prompts (the cache's help left
    /// out) for every target that has a bound.
    pub fn verdicts(&self) -> Vec<Verdict> {
        let mut out = Vec::new();
        for row in &self.rows {
            if row.shape.prefix != Prefix::Unique {
                continue;
            }
            let Some(limit) = overhead_target(row.shape, row.metric) else {
                continue;
            };
            for t in &row.targets {
                out.push(Verdict {
                    target: t.name.clone(),
                    shape: row.shape,
                    metric: row.metric,
                    overhead_p50_ms: t.overhead_p50_ms,
                    limit,
                    met: t.overhead_p50_ms <= millis(limit),
                });
            }
        }
        out
    }
}

fn signed(ms: f64) -> String {
    if ms.is_finite() {
        format!("{ms:+.3}")
    } else {
        "n/a".to_owned()
    }
}

impl fmt::Display for GatewayReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "gateway overhead · model {} · max_tokens {} · {} rounds × {} iterations · concurrency {} · {:.1} s",
            self.model,
            self.max_tokens,
            self.rounds,
            self.iterations,
            self.concurrency,
            self.elapsed.as_secs_f64()
        )?;
        writeln!(f, "direct: {}", self.direct)?;
        for t in &self.targets {
            writeln!(f, "target {}: {}", t.name, t.url)?;
        }
        if let (Some(reference), true) = (&self.reference, self.reference_apart) {
            writeln!(
                f,
                "{reference} is measured in a phase of its own in every round, after the others, against direct calls of that phase (its work after an answer does not land on the others' calls)"
            )?;
        }
        let prompts: Vec<String> = self
            .prompts
            .iter()
            .map(|p| {
                format!(
                    "{} {} → {}",
                    p.nominal_tokens,
                    p.prefix.name(),
                    p.measured_tokens
                )
            })
            .collect();
        writeln!(
            f,
            "prompt tokens (as the direct endpoint counts them): {}",
            prompts.join(", ")
        )?;
        writeln!(
            f,
            "unique = a new prompt every call (the token-count cache cannot help); warm = the same conversation prefix every call, a new short last message (the agent pattern the cache is for)"
        )?;
        writeln!(
            f,
            "p50 = median of the rounds' p50s; p99 = over all rounds' calls; +p50 = median of the rounds' (target p50 − direct p50); +p99 = target p99 − direct p99; ×direct = p50 / direct p50"
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "{:>7} {:<6} {:<6} {:<10} {:<10} {:>6} {:>9} {:>9} {:>8} {:>8} {:>8}",
            "tokens",
            "prompt",
            "call",
            "metric",
            "endpoint",
            "calls",
            "p50 ms",
            "p99 ms",
            "+p50",
            "+p99",
            "×direct"
        )?;
        for row in &self.rows {
            let lead = format!(
                "{:>7} {:<6} {:<6} {:<10}",
                row.shape.prompt_tokens,
                row.shape.prefix.name(),
                row.shape.delivery.name(),
                row.metric.name()
            );
            writeln!(
                f,
                "{lead} {:<10} {:>6} {:>9.3} {:>9.3}",
                "direct",
                row.direct.count,
                millis(row.direct.p50),
                millis(row.direct.p99)
            )?;
            for t in &row.targets {
                let ratio = if t.direct.p50.is_zero() {
                    f64::NAN
                } else {
                    t.figures.p50.as_secs_f64() / t.direct.p50.as_secs_f64()
                };
                writeln!(
                    f,
                    "{lead} {:<10} {:>6} {:>9.3} {:>9.3} {:>8} {:>8} {:>7.2}×",
                    t.name,
                    t.figures.count,
                    millis(t.figures.p50),
                    millis(t.figures.p99),
                    signed(t.overhead_p50_ms),
                    signed(t.overhead_p99_ms),
                    ratio
                )?;
            }
        }
        if let Some(reference) = &self.reference {
            writeln!(f)?;
            writeln!(
                f,
                "overhead relative to {reference} (+p50 target / +p50 {reference}, same run):"
            )?;
            for row in &self.rows {
                let Some(r) = row.targets.iter().find(|t| &t.name == reference) else {
                    continue;
                };
                let ratios: Vec<String> = row
                    .targets
                    .iter()
                    .filter(|t| &t.name != reference)
                    .map(|t| {
                        if r.overhead_p50_ms > 0.0 {
                            format!("{} {:.3}×", t.name, t.overhead_p50_ms / r.overhead_p50_ms)
                        } else {
                            format!("{} n/a", t.name)
                        }
                    })
                    .collect();
                writeln!(
                    f,
                    "{:>7} {:<6} {:<6} {:<10} {reference} {} ms; {}",
                    row.shape.prompt_tokens,
                    row.shape.prefix.name(),
                    row.shape.delivery.name(),
                    row.metric.name(),
                    signed(r.overhead_p50_ms),
                    ratios.join(", ")
                )?;
            }
        }
        writeln!(f)?;
        writeln!(f, "targets (p50 overhead, unique prompts):")?;
        for v in self.verdicts() {
            writeln!(
                f,
                "  {:<10} {:>6} tokens {:<6} {:<10} {} ms (≤ {:.1} ms): {}",
                v.target,
                v.shape.prompt_tokens,
                v.shape.delivery.name(),
                v.metric.name(),
                signed(v.overhead_p50_ms),
                millis(v.limit),
                if v.met { "met" } else { "NOT met" }
            )?;
        }
        for (name, kinds) in &self.errors {
            for (kind, n) in kinds {
                writeln!(f, "  failed {n:>6}  {name}: {kind}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_with_and_without_a_name() {
        let t: GatewayTarget = "memory=http://127.0.0.1:1".parse().unwrap();
        assert_eq!(
            (t.name.as_str(), t.url.as_str()),
            ("memory", "http://127.0.0.1:1")
        );
        let bare: GatewayTarget = "http://127.0.0.1:2".parse().unwrap();
        assert_eq!(bare.name, "http://127.0.0.1:2");
        assert!("=http://x".parse::<GatewayTarget>().is_err());
        assert!("a b=http://x".parse::<GatewayTarget>().is_err());
        assert!("name=".parse::<GatewayTarget>().is_err());
    }

    #[test]
    fn prose_is_deterministic_and_sized_in_words() {
        assert_eq!(prose(50, 7), prose(50, 7));
        assert_ne!(prose(50, 7), prose(50, 8));
        let text = prose(100, 1);
        let words = text.split_whitespace().count();
        assert_eq!(words, 100);
    }

    #[test]
    fn unique_bodies_differ_and_warm_bodies_share_their_prefix() {
        let opts = GatewayBenchOptions::new("http://127.0.0.1:1", vec![]);
        let bulk = prose(200, 3);
        let a = request_body(&opts, Prefix::Unique, &bulk, Delivery::Whole, "n1");
        let b = request_body(&opts, Prefix::Unique, &bulk, Delivery::Whole, "n2");
        let big = |body: &Bytes, i: usize| {
            let v: Value = serde_json::from_slice(body).unwrap();
            v["messages"][i]["content"].as_str().unwrap().to_owned()
        };
        assert_ne!(big(&a, 1), big(&b, 1), "unique prompts must miss the cache");
        let c = request_body(&opts, Prefix::Warm, &bulk, Delivery::Stream, "n1");
        let d = request_body(&opts, Prefix::Warm, &bulk, Delivery::Stream, "n2");
        assert_eq!(big(&c, 1), big(&d, 1), "warm prompts repeat their prefix");
        assert_ne!(big(&c, 3), big(&d, 3), "and end with a new message");
        let v: Value = serde_json::from_slice(&c).unwrap();
        assert_eq!(v["stream"], Value::Bool(true));
        assert!(v.get("stream_options").is_none());
        assert_eq!(v["max_tokens"], json!(20));
    }

    #[test]
    fn options_are_checked_by_name() {
        let target = |name: &str| GatewayTarget {
            name: name.to_owned(),
            url: "http://127.0.0.1:1".to_owned(),
        };
        let field = |o: &GatewayBenchOptions| match o.validate() {
            Err(BenchError::InvalidOption { field, .. }) => field,
            other => panic!("expected an invalid option, got {other:?}"),
        };
        let ok = GatewayBenchOptions::new("http://127.0.0.1:1", vec![target("gw")]);
        assert!(ok.validate().is_ok());
        assert_eq!(field(&GatewayBenchOptions::new("x", vec![])), "target");
        assert_eq!(
            field(&GatewayBenchOptions::new("x", vec![target("direct")])),
            "target"
        );
        assert_eq!(
            field(&GatewayBenchOptions {
                reference: Some("litellm".into()),
                ..ok.clone()
            }),
            "reference"
        );
        assert_eq!(
            field(&GatewayBenchOptions {
                prompt_sizes_tokens: vec![100, 100],
                ..ok.clone()
            }),
            "sizes"
        );
        assert_eq!(
            field(&GatewayBenchOptions {
                prompt_sizes_tokens: vec![4],
                ..ok.clone()
            }),
            "sizes"
        );
        assert_eq!(
            field(&GatewayBenchOptions {
                rounds: 0,
                ..ok.clone()
            }),
            "rounds"
        );
        assert_eq!(
            field(&GatewayBenchOptions {
                concurrency: 0,
                ..ok.clone()
            }),
            "concurrency"
        );
        assert!(matches!(
            Endpoint::parse("target", "t", "https://127.0.0.1:1", None),
            Err(BenchError::InvalidOption {
                field: "target",
                ..
            })
        ));
        let ep = Endpoint::parse("target", "t", "http://127.0.0.1:9/v1/", None).unwrap();
        assert_eq!(ep.path, "/v1/chat/completions");
    }

    /// A stand-in upstream: counts a prompt's words as its tokens, answers
    /// a chat completion, or streams one in two parts `STREAM_GAP` apart;
    /// `delay` before answering makes it a "gateway" with a known overhead.
    fn fake(delay: Duration, status: StatusCode) -> axum::Router {
        fake_sharing(delay, status, Arc::default(), Duration::ZERO)
    }

    /// A fake sharing `busy` (the machine's cores) with others: with no
    /// `linger` it answers only once it has `busy` to itself; with one, it
    /// keeps a share of `busy` for `linger` after each answer (an endpoint
    /// whose work goes on after its answer) and never waits for it itself.
    fn fake_sharing(
        delay: Duration,
        status: StatusCode,
        busy: Arc<tokio::sync::RwLock<()>>,
        linger: Duration,
    ) -> axum::Router {
        use axum::response::IntoResponse;
        axum::Router::new().route(
            "/v1/chat/completions",
            axum::routing::post(move |body: Bytes| async move {
                if linger.is_zero() {
                    drop(busy.write().await);
                } else {
                    let share = Arc::clone(&busy).read_owned().await;
                    tokio::spawn(async move {
                        tokio::time::sleep(linger).await;
                        drop(share);
                    });
                }
                tokio::time::sleep(delay).await;
                if status != StatusCode::OK {
                    return (status, "{\"error\": {\"message\": \"refused\"}}").into_response();
                }
                let v: Value = serde_json::from_slice(&body).unwrap();
                let words: usize = v["messages"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| m["content"].as_str().unwrap().split_whitespace().count())
                    .sum();
                if v["stream"] == Value::Bool(true) {
                    let (tx, rx) = tokio::sync::mpsc::channel(4);
                    tokio::spawn(async move {
                        let _ = tx.send(Bytes::from_static(b"data: {\"choices\": []}\n\n")).await;
                        tokio::time::sleep(STREAM_GAP).await;
                        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                    });
                    return axum::body::Body::new(ChannelBody(rx)).into_response();
                }
                axum::Json(json!({"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": words}})).into_response()
            }),
        )
    }

    const STREAM_GAP: Duration = Duration::from_millis(30);

    /// The known overhead of the "slow" target.
    const DELAY: Duration = Duration::from_millis(10);

    struct ChannelBody(tokio::sync::mpsc::Receiver<Bytes>);

    impl hyper::body::Body for ChannelBody {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
            self.0
                .poll_recv(cx)
                .map(|o| o.map(|b| Ok(hyper::body::Frame::data(b))))
        }
    }

    async fn serve(router: axum::Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // As the stub and the gateway do: no Nagle delay between a stream's parts.
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        format!("http://{addr}")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reference_apart_keeps_its_lingering_work_off_the_others_calls() {
        // Longer than a stream's gap (the call between two of the
        // reference's may take that long), shorter than PHASE_PAUSE.
        const LINGER: Duration = Duration::from_millis(100);
        let direct = serve(fake(Duration::ZERO, StatusCode::OK)).await;
        // Two workers apart: the phases line them up, so neither worker's
        // reference calls overlap the other's gateway calls.
        for (apart, concurrency) in [(true, 1), (false, 1), (true, 2)] {
            let busy = Arc::default();
            let gateway = serve(fake_sharing(
                Duration::ZERO,
                StatusCode::OK,
                Arc::clone(&busy),
                Duration::ZERO,
            ))
            .await;
            let reference = serve(fake_sharing(Duration::ZERO, StatusCode::OK, busy, LINGER)).await;
            let opts = GatewayBenchOptions {
                prompt_sizes_tokens: vec![64],
                rounds: 2,
                iterations: 2,
                warmup_iterations: 1,
                reference: Some("reference".into()),
                reference_apart: apart,
                concurrency,
                ..GatewayBenchOptions::new(
                    direct.clone(),
                    vec![
                        format!("gateway={gateway}").parse().unwrap(),
                        format!("reference={reference}").parse().unwrap(),
                    ],
                )
            };
            let report = run_gateway(&opts).await.unwrap();
            assert!(report.errors.is_empty(), "{:?}", report.errors);
            assert_eq!(report.reference_apart, apart);
            let row = report
                .rows
                .iter()
                .find(|r| r.shape.prefix == Prefix::Unique && r.metric == Metric::Total)
                .unwrap();
            let [gw, rf] = &row.targets[..] else {
                panic!("two targets: {row:?}")
            };
            assert_eq!(
                (gw.name.as_str(), rf.name.as_str()),
                ("gateway", "reference")
            );
            // Each compared with as many direct calls as it made itself.
            assert_eq!(gw.direct.count, gw.figures.count);
            assert_eq!(rf.direct.count, rf.figures.count);
            let waited = gw.overhead_p50_ms >= millis(LINGER) / 10.0;
            assert_eq!(
                waited, !apart,
                "apart {apart}, {concurrency} workers: {row:?}"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn measures_a_known_overhead_and_the_first_byte() {
        let direct = serve(fake(Duration::ZERO, StatusCode::OK)).await;
        let slow = serve(fake(DELAY, StatusCode::OK)).await;
        let opts = GatewayBenchOptions {
            prompt_sizes_tokens: vec![64, 300],
            rounds: 3,
            iterations: 4,
            warmup_iterations: 1,
            key: Some("sk-test".into()),
            reference: Some("slow".into()),
            ..GatewayBenchOptions::new(direct, vec![format!("slow={slow}").parse().unwrap()])
        };
        let report = run_gateway(&opts).await.unwrap();
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        // The fake counts words: calibration lands within a few of the size.
        for p in &report.prompts {
            let off = p.measured_tokens.abs_diff(p.nominal_tokens);
            assert!(off <= p.nominal_tokens / 10, "{p:?}");
        }
        assert_eq!(
            report.rows.len(),
            2 * 2 * 3,
            "2 sizes × 2 prefixes × (1 whole + 2 stream metrics)"
        );
        for row in &report.rows {
            let t = &row.targets[0];
            assert_eq!(row.direct.count, 12);
            assert_eq!(t.figures.count, 12);
            assert_eq!(t.rounds_overhead_p50_ms.len(), 3);
            // The delay comes before the answer: every metric carries it
            // (a stream's end less surely: the gap's timer jitters).
            if row.metric == Metric::End {
                assert!(t.figures.p50 >= STREAM_GAP + DELAY, "{row:?}");
            } else {
                assert!(t.overhead_p50_ms >= millis(DELAY) * 0.6, "{row:?}");
            }
            if row.metric == Metric::FirstByte {
                // The first byte is timed before the stream's second part.
                assert!(row.direct.p50 < STREAM_GAP, "{row:?}");
            }
            if row.metric == Metric::End {
                assert!(row.direct.p50 >= STREAM_GAP, "{row:?}");
            }
        }
        let verdicts = report.verdicts();
        // 64 and 300 tokens: whole at ≤ 100 and ≤ 4,096, the first byte of both.
        assert_eq!(verdicts.len(), 4);
        assert!(
            verdicts.iter().all(|v| !v.met),
            "a 10 ms delay misses every bound"
        );
        let text = report.to_string();
        assert!(text.contains("overhead relative to slow"), "{text}");
        assert!(text.contains("NOT met"), "{text}");
    }

    #[tokio::test]
    async fn a_target_that_refuses_is_a_setup_error_naming_it() {
        let direct = serve(fake(Duration::ZERO, StatusCode::OK)).await;
        let refusing = serve(fake(Duration::ZERO, StatusCode::UNAUTHORIZED)).await;
        let opts = GatewayBenchOptions {
            prompt_sizes_tokens: vec![64],
            ..GatewayBenchOptions::new(direct, vec![format!("gw={refusing}").parse().unwrap()])
        };
        match run_gateway(&opts).await {
            Err(BenchError::InvalidOption {
                field: "target",
                reason,
            }) => {
                assert!(
                    reason.contains("gw") && reason.contains("status 401"),
                    "{reason}"
                );
            }
            other => panic!("expected a target error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn an_unreachable_direct_endpoint_is_named() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let opts = GatewayBenchOptions::new(url, vec!["gw=http://127.0.0.1:1".parse().unwrap()]);
        match run_gateway(&opts).await {
            Err(BenchError::InvalidOption {
                field: "direct", ..
            }) => {}
            other => panic!("expected a direct error, got {other:?}"),
        }
    }

    #[test]
    fn medians_and_targets() {
        assert_eq!(median_f64(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median_f64(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median_f64(&mut []).is_nan());
        let shape = |prompt_tokens, delivery| Shape {
            prompt_tokens,
            prefix: Prefix::Unique,
            delivery,
        };
        assert_eq!(
            overhead_target(shape(100, Delivery::Whole), Metric::Total),
            Some(SMALL_PROMPT_OVERHEAD_TARGET)
        );
        assert_eq!(
            overhead_target(shape(4_096, Delivery::Whole), Metric::Total),
            Some(MEDIUM_PROMPT_OVERHEAD_TARGET)
        );
        assert_eq!(
            overhead_target(shape(32_768, Delivery::Whole), Metric::Total),
            None
        );
        assert_eq!(
            overhead_target(shape(32_768, Delivery::Stream), Metric::FirstByte),
            Some(FIRST_BYTE_OVERHEAD_TARGET)
        );
        assert_eq!(
            overhead_target(shape(100, Delivery::Stream), Metric::End),
            None
        );
    }
}
