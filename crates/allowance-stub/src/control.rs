//! The stub's controls: behaviour, scripted answers, the request log and
//! the statistics, shared by the HTTP control API and the Rust methods.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

/// The request log keeps the newest this many calls: enough for any test,
/// small enough that a long benchmark cannot grow the stub without bound.
pub const MAX_RECORDED_REQUESTS: usize = 10_000;
/// Scripted answers waiting at once; a test scripting more is mistaken.
pub const MAX_QUEUED_ANSWERS: usize = 10_000;
/// The largest answer (tokens) the stub generates: the text is built in
/// memory.
pub const MAX_OUTPUT_TOKENS: u32 = 1_000_000;
/// The longest delay or hang a test may ask for (10 minutes).
pub const MAX_DELAY_MS: u64 = 600_000;

/// How model calls are answered unless a scripted answer says otherwise.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Behavior {
    /// Tokens of output per call, before the request's own bound.
    pub output_tokens: u32,
    /// Pause before each output token (streams) or `N` times it before the
    /// whole answer (non-streaming).
    pub token_delay_ms: u64,
    /// Pause before the response starts (status line included).
    pub first_byte_delay_ms: u64,
    /// At most this many model calls in flight; one more answers 429.
    pub concurrency_limit: Option<u32>,
    /// Reasoning tokens per call: billed as output in the usage (and
    /// reported as `reasoning_tokens`) but never streamed, as a reasoning
    /// model's hidden thinking; within the request's bound, after the
    /// visible output.
    #[serde(default)]
    pub reasoning_tokens: u32,
}

impl Behavior {
    /// The behaviour after a reset: `output_tokens` as configured, no
    /// delays, no limit.
    #[must_use]
    pub fn with_output_tokens(output_tokens: u32) -> Self {
        Self {
            output_tokens,
            token_delay_ms: 0,
            first_byte_delay_ms: 0,
            concurrency_limit: None,
            reasoning_tokens: 0,
        }
    }
}

/// A change to [`Behavior`]: `None` leaves a field unchanged. For
/// `concurrency_limit`, `Some(None)` (JSON `null`) removes the limit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BehaviorPatch {
    /// New [`Behavior::output_tokens`].
    #[serde(default)]
    pub output_tokens: Option<u32>,
    /// New [`Behavior::token_delay_ms`].
    #[serde(default)]
    pub token_delay_ms: Option<u64>,
    /// New [`Behavior::first_byte_delay_ms`].
    #[serde(default)]
    pub first_byte_delay_ms: Option<u64>,
    /// New [`Behavior::concurrency_limit`]; `Some(None)` removes the limit.
    #[serde(default, deserialize_with = "present")]
    pub concurrency_limit: Option<Option<u32>>,
    /// New [`Behavior::reasoning_tokens`].
    #[serde(default)]
    pub reasoning_tokens: Option<u32>,
}

/// Tells a key given as `null` (`Some(None)`) from a missing key (`None`).
fn present<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Option<u32>>, D::Error> {
    Option::<u32>::deserialize(deserializer).map(Some)
}

/// A control call the stub refuses; the message names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    /// A field is out of range.
    #[error("{field}: {reason}")]
    Invalid {
        /// The JSON field (`output_tokens`, `[2].status`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The scripted-answer queue would exceed [`MAX_QUEUED_ANSWERS`].
    #[error("the queue holds at most {MAX_QUEUED_ANSWERS} scripted answers")]
    QueueFull,
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ControlError {
    ControlError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

fn check_delay(field: String, value: Option<u64>) -> Result<(), ControlError> {
    match value {
        Some(ms) if ms > MAX_DELAY_MS => {
            Err(invalid(field, format!("must be at most {MAX_DELAY_MS}")))
        }
        _ => Ok(()),
    }
}

impl BehaviorPatch {
    /// Checks every field against its limit.
    ///
    /// # Errors
    /// The first field out of range.
    pub fn validate(&self) -> Result<(), ControlError> {
        if self.output_tokens.is_some_and(|n| n > MAX_OUTPUT_TOKENS) {
            return Err(invalid(
                "output_tokens",
                format!("must be at most {MAX_OUTPUT_TOKENS}"),
            ));
        }
        if self.reasoning_tokens.is_some_and(|n| n > MAX_OUTPUT_TOKENS) {
            return Err(invalid(
                "reasoning_tokens",
                format!("must be at most {MAX_OUTPUT_TOKENS}"),
            ));
        }
        check_delay("token_delay_ms".into(), self.token_delay_ms)?;
        check_delay("first_byte_delay_ms".into(), self.first_byte_delay_ms)
    }

    fn apply(&self, behavior: &mut Behavior) {
        if let Some(n) = self.output_tokens {
            behavior.output_tokens = n;
        }
        if let Some(ms) = self.token_delay_ms {
            behavior.token_delay_ms = ms;
        }
        if let Some(ms) = self.first_byte_delay_ms {
            behavior.first_byte_delay_ms = ms;
        }
        if let Some(limit) = self.concurrency_limit {
            behavior.concurrency_limit = limit;
        }
        if let Some(n) = self.reasoning_tokens {
            behavior.reasoning_tokens = n;
        }
    }
}

/// A one-shot answer for the next model call. Fields combine: the call
/// first waits `hang_ms`, then answers `status` (with `body`, or the
/// provider's error body) or, without a status, answers normally but cut
/// after `cut_after_tokens`; `headers` are added to whatever is sent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scripted {
    /// The status to answer with, 200..=599; below 400 needs a `body`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Response headers to add (`retry-after`, …).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// The JSON body to send verbatim with `status`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<Value>,
    /// Drop the connection after this many output tokens (no usage, no
    /// end of stream); a non-streaming answer is cut mid-body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut_after_tokens: Option<u32>,
    /// Wait this long before answering.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hang_ms: Option<u64>,
}

impl Scripted {
    /// Answer with `status` and the provider's error body for it.
    #[must_use]
    pub fn status(status: u16) -> Self {
        Self {
            status: Some(status),
            ..Self::default()
        }
    }

    /// Answer normally but drop the connection after `tokens` output tokens.
    #[must_use]
    pub fn cut_after_tokens(tokens: u32) -> Self {
        Self {
            cut_after_tokens: Some(tokens),
            ..Self::default()
        }
    }

    /// Wait `ms` milliseconds, then answer normally.
    #[must_use]
    pub fn hang_ms(ms: u64) -> Self {
        Self {
            hang_ms: Some(ms),
            ..Self::default()
        }
    }

    /// Adds a response header.
    #[must_use]
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers
            .insert(name.to_ascii_lowercase(), value.to_owned());
        self
    }

    /// Sends `body` verbatim instead of the provider's error body.
    #[must_use]
    pub fn body(mut self, body: Value) -> Self {
        self.body = Some(body);
        self
    }

    /// Checks the answer can be sent; `at` prefixes field names (`[2]`).
    ///
    /// # Errors
    /// A status out of range, a success status without a body, a header
    /// that is not a valid HTTP header, or a hang too long.
    pub fn validate(&self, at: &str) -> Result<(), ControlError> {
        if let Some(status) = self.status {
            if !(200..=599).contains(&status) {
                return Err(invalid(format!("{at}status"), "must be in 200..=599"));
            }
            if status < 400 && self.body.is_none() {
                return Err(invalid(
                    format!("{at}body"),
                    "is required with a status below 400",
                ));
            }
        }
        for (name, value) in &self.headers {
            if axum::http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(invalid(
                    format!("{at}headers"),
                    format!("{name:?} is not a header name"),
                ));
            }
            if axum::http::HeaderValue::from_str(value).is_err() {
                return Err(invalid(
                    format!("{at}headers.{name}"),
                    "is not a valid header value",
                ));
            }
        }
        check_delay(format!("{at}hang_ms"), self.hang_ms)
    }
}

/// One model call as received.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedRequest {
    /// The request path (`/v1/chat/completions`).
    pub path: String,
    /// When it arrived, Unix milliseconds.
    pub received_at_ms: u64,
    /// Its headers, names lower-case; repeated headers joined by `", "`.
    pub headers: BTreeMap<String, String>,
    /// The parsed JSON body, or the raw text as a JSON string when it did
    /// not parse.
    pub body: Value,
}

/// Counters over model calls since the start or the last reset.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Calls admitted and not yet answered in full (a stream counts until
    /// its last byte or until the client leaves).
    pub in_flight: u64,
    /// The most calls in flight at once.
    pub max_in_flight: u64,
    /// Every model call received, refused ones included.
    pub total: u64,
}

/// Unix time in milliseconds.
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
        })
}

/// Everything the handlers share.
pub(crate) struct Controls {
    default_output_tokens: u32,
    record: bool,
    behavior: Mutex<Behavior>,
    queue: Mutex<VecDeque<Scripted>>,
    log: Mutex<VecDeque<RecordedRequest>>,
    stats: Mutex<Stats>,
}

/// Holds one admitted call in [`Stats::in_flight`] until dropped; it owns
/// its share of the controls so that a response body stream can carry it.
pub(crate) struct InFlight {
    controls: Arc<Controls>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut stats = self.controls.stats.lock();
        stats.in_flight = stats.in_flight.saturating_sub(1);
    }
}

impl Controls {
    pub(crate) fn new(default_output_tokens: u32, record: bool) -> Self {
        Self {
            default_output_tokens,
            record,
            behavior: Mutex::new(Behavior::with_output_tokens(default_output_tokens)),
            queue: Mutex::new(VecDeque::new()),
            log: Mutex::new(VecDeque::new()),
            stats: Mutex::new(Stats::default()),
        }
    }

    pub(crate) fn behavior(&self) -> Behavior {
        self.behavior.lock().clone()
    }

    pub(crate) fn set_behavior(&self, patch: &BehaviorPatch) -> Result<Behavior, ControlError> {
        patch.validate()?;
        let mut behavior = self.behavior.lock();
        patch.apply(&mut behavior);
        Ok(behavior.clone())
    }

    /// Appends all of `answers` or none of them; returns the queue length.
    pub(crate) fn enqueue(&self, answers: Vec<Scripted>) -> Result<usize, ControlError> {
        for (index, answer) in answers.iter().enumerate() {
            answer.validate(&format!("[{index}]."))?;
        }
        let mut queue = self.queue.lock();
        if queue.len() + answers.len() > MAX_QUEUED_ANSWERS {
            return Err(ControlError::QueueFull);
        }
        queue.extend(answers);
        Ok(queue.len())
    }

    pub(crate) fn next_scripted(&self) -> Option<Scripted> {
        self.queue.lock().pop_front()
    }

    pub(crate) fn records(&self) -> bool {
        self.record
    }

    pub(crate) fn record(&self, request: RecordedRequest) {
        let mut log = self.log.lock();
        if log.len() == MAX_RECORDED_REQUESTS {
            log.pop_front();
        }
        log.push_back(request);
    }

    pub(crate) fn requests(&self) -> Vec<RecordedRequest> {
        self.log.lock().iter().cloned().collect()
    }

    pub(crate) fn stats(&self) -> Stats {
        *self.stats.lock()
    }

    pub(crate) fn count_call(&self) {
        self.stats.lock().total += 1;
    }

    /// Admits a call unless `limit` calls are in flight already.
    pub(crate) fn admit(self: &Arc<Self>, limit: Option<u32>) -> Option<InFlight> {
        let mut stats = self.stats.lock();
        if limit.is_some_and(|limit| stats.in_flight >= u64::from(limit)) {
            return None;
        }
        stats.in_flight += 1;
        stats.max_in_flight = stats.max_in_flight.max(stats.in_flight);
        Some(InFlight {
            controls: Arc::clone(self),
        })
    }

    pub(crate) fn reset(&self) {
        self.queue.lock().clear();
        self.log.lock().clear();
        // Calls still running stay counted: they will leave through their
        // guards, which must find them there.
        let mut stats = self.stats.lock();
        *stats = Stats {
            in_flight: stats.in_flight,
            max_in_flight: stats.in_flight,
            total: 0,
        };
        drop(stats);
        *self.behavior.lock() = Behavior::with_output_tokens(self.default_output_tokens);
    }
}
