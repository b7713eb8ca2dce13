//! One worker: a keep-alive connection doing its scenario's pairs in sequence.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use hyper::StatusCode;
use serde::Deserialize;
use tokio::time::Instant;

use crate::client::{Answer, Conn, REQUEST_TIMEOUT, Target, encode_segment};
use crate::{Scenario, TENANTS_SCENARIO_TENANTS};

/// Pause after a failed dial, so a server that is down costs a count per
/// pause rather than a core spinning on `connect`.
const RECONNECT_PAUSE: Duration = Duration::from_millis(50);

/// The settle body every pair sends: the actual is below the estimate.
const SETTLE_BODY: &str = r#"{"usage": {"input_tokens": 90, "output_tokens": 40}}"#;

/// The refund body: the spec allows none or `{}`; `{}` goes through the JSON
/// parser as a client library would send it.
const REFUND_BODY: &str = "{}";

/// The phases of a run, shared by every worker.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    /// Pairs that start at or after this are measured.
    pub(crate) measure_start: Instant,
    /// No pair starts at or after this.
    pub(crate) measure_end: Instant,
    /// Calls still running at this instant are cut (counted as timeouts).
    pub(crate) hard_stop: Instant,
}

impl Clock {
    /// The deadline for a call starting now.
    fn call_deadline(&self) -> Instant {
        (Instant::now() + REQUEST_TIMEOUT).min(self.hard_stop)
    }
}

/// Counters the progress display reads while the run goes on.
#[derive(Debug, Default)]
pub(crate) struct Live {
    pub(crate) pairs: AtomicU64,
    pub(crate) denials: AtomicU64,
    pub(crate) errors: AtomicU64,
    /// The first 401 or 403 a reserve got: the credentials will not change
    /// during the run, so every worker stops at once.
    pub(crate) refused: std::sync::OnceLock<String>,
}

/// What one worker measured.
pub(crate) struct Tally {
    pub(crate) reserve: Histogram<u64>,
    pub(crate) second: Histogram<u64>,
    pub(crate) pair: Histogram<u64>,
    pub(crate) pairs: u64,
    pub(crate) attempts: u64,
    pub(crate) denials: BTreeMap<String, u64>,
    pub(crate) errors: BTreeMap<String, u64>,
    /// When its last measured pair ended.
    pub(crate) finished_at: Instant,
}

impl Tally {
    fn error(&mut self, measured: bool, live: &Live, kind: String) {
        if measured {
            *self.errors.entry(kind).or_default() += 1;
            live.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One worker's fixed inputs.
pub(crate) struct Worker {
    pub(crate) index: usize,
    pub(crate) concurrency: usize,
    pub(crate) scenario: Scenario,
    pub(crate) target: Arc<Target>,
    pub(crate) clock: Clock,
    pub(crate) live: Arc<Live>,
}

/// What a reserve answered.
pub(crate) enum Reserved {
    Held(String),
    Denied(String),
    Unexpected(String),
}

/// The part of a reserve answer the bench reads.
#[derive(Deserialize)]
struct HeldAnswer {
    id: String,
}

/// The part of an error answer the bench reads.
#[derive(Deserialize)]
struct ErrorAnswer {
    error: ErrorObject,
}

#[derive(Deserialize)]
struct ErrorObject {
    #[serde(rename = "type")]
    kind: String,
}

/// `"<status> <error.type>"`, the key denials and errors are counted under;
/// `-` when the body is not the spec's error object.
pub(crate) fn answer_kind(answer: &Answer) -> String {
    let kind = serde_json::from_slice::<ErrorAnswer>(&answer.body)
        .map(|e| e.error.kind)
        .unwrap_or_else(|_| "-".to_owned());
    format!("{} {kind}", answer.status.as_u16())
}

pub(crate) fn classify_reserve(answer: &Answer) -> Reserved {
    match answer.status {
        StatusCode::CREATED | StatusCode::OK => {
            match serde_json::from_slice::<HeldAnswer>(&answer.body) {
                Ok(held) => Reserved::Held(held.id),
                Err(_) => Reserved::Unexpected(format!(
                    "{} reserve answer without an id",
                    answer.status.as_u16()
                )),
            }
        }
        // The spec's three denials; anything else is not a denial, whatever its body says.
        StatusCode::TOO_MANY_REQUESTS
        | StatusCode::PAYMENT_REQUIRED
        | StatusCode::UNPROCESSABLE_ENTITY => Reserved::Denied(answer_kind(answer)),
        _ => Reserved::Unexpected(answer_kind(answer)),
    }
}

/// Microseconds, at least 1 (the histograms' lowest value).
fn micros(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_micros())
        .unwrap_or(u64::MAX)
        .max(1)
}

impl Worker {
    fn tenant_body(tenant: &str) -> Bytes {
        Bytes::from(format!(
            r#"{{"tenant": "{tenant}", "amounts": {{"input_tokens": 100, "output_tokens": 50}}}}"#
        ))
    }

    /// Runs pairs until the end of the measured window, then returns what
    /// it measured. `histogram` is the empty histogram every tally starts from.
    pub(crate) async fn run(self, histogram: Histogram<u64>) -> Tally {
        let mut tally = Tally {
            reserve: histogram.clone(),
            second: histogram.clone(),
            pair: histogram,
            pairs: 0,
            attempts: 0,
            denials: BTreeMap::new(),
            errors: BTreeMap::new(),
            finished_at: self.clock.measure_start,
        };
        let reserve_path = self.target.path("/v1/reservations");
        let fixed_body = match self.scenario {
            Scenario::Pairs | Scenario::Refund => {
                Some(Self::tenant_body(&format!("bench-{}", self.index)))
            }
            Scenario::Contention => Some(Self::tenant_body("bench-hot")),
            Scenario::Tenants => None,
            // Never run by workers: `run` hands it to `fanout`.
            Scenario::Fanout => Some(Self::tenant_body("bench-fanout")),
        };
        let second_body = Bytes::from_static(match self.scenario {
            Scenario::Refund => REFUND_BODY.as_bytes(),
            _ => SETTLE_BODY.as_bytes(),
        });
        let second_call = self.scenario.second_call();
        let mut next_tenant = self.index % TENANTS_SCENARIO_TENANTS;
        let mut conn: Option<Conn> = None;

        loop {
            let started = Instant::now();
            if started >= self.clock.measure_end || self.live.refused.get().is_some() {
                break;
            }
            let measured = started >= self.clock.measure_start;
            let mut live_conn = match conn.take() {
                Some(c) => c,
                None => match Conn::open(&self.target, self.clock.call_deadline()).await {
                    Ok(c) => c,
                    Err(failure) => {
                        tally.error(measured, &self.live, failure.kind().to_owned());
                        let pause = (Instant::now() + RECONNECT_PAUSE).min(self.clock.measure_end);
                        tokio::time::sleep_until(pause).await;
                        continue;
                    }
                },
            };
            let body = match &fixed_body {
                Some(body) => body.clone(),
                None => {
                    let body = Self::tenant_body(&format!("bench-t{next_tenant}"));
                    next_tenant = (next_tenant + self.concurrency) % TENANTS_SCENARIO_TENANTS;
                    body
                }
            };

            // The first call: reserve.
            let reserve_start = Instant::now();
            let answer = match live_conn
                .post(
                    &self.target,
                    &reserve_path,
                    body,
                    self.clock.call_deadline(),
                )
                .await
            {
                Ok(answer) => answer,
                Err(failure) => {
                    if measured {
                        tally.attempts += 1;
                    }
                    tally.error(measured, &self.live, failure.kind().to_owned());
                    continue; // the connection is dropped; the next pair dials again
                }
            };
            let reserved_at = Instant::now();
            if measured {
                tally.attempts += 1;
                tally
                    .reserve
                    .saturating_record(micros(reserved_at - reserve_start));
                tally.finished_at = reserved_at;
            }
            let id = match classify_reserve(&answer) {
                Reserved::Held(id) => id,
                Reserved::Denied(kind) => {
                    if measured {
                        *tally.denials.entry(kind).or_default() += 1;
                        self.live.denials.fetch_add(1, Ordering::Relaxed);
                    }
                    conn = Some(live_conn);
                    continue;
                }
                Reserved::Unexpected(kind) => {
                    if matches!(
                        answer.status,
                        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
                    ) {
                        let _ = self.live.refused.set(kind.clone());
                    }
                    tally.error(measured, &self.live, format!("reserve: {kind}"));
                    conn = Some(live_conn);
                    continue;
                }
            };

            // The second call: settle or refund the hold just made.
            let second_path = self.target.path(&format!(
                "/v1/reservations/{}/{second_call}",
                encode_segment(&id)
            ));
            let second_start = Instant::now();
            let answer = match live_conn
                .post(
                    &self.target,
                    &second_path,
                    second_body.clone(),
                    self.clock.call_deadline(),
                )
                .await
            {
                Ok(answer) => answer,
                Err(failure) => {
                    tally.error(measured, &self.live, failure.kind().to_owned());
                    continue;
                }
            };
            let ended = Instant::now();
            conn = Some(live_conn);
            if answer.status != StatusCode::OK {
                let kind = format!("{second_call}: {}", answer_kind(&answer));
                tally.error(measured, &self.live, kind);
                continue;
            }
            if measured {
                tally.pairs += 1;
                tally.second.saturating_record(micros(ended - second_start));
                tally.pair.saturating_record(micros(ended - reserve_start));
                tally.finished_at = ended;
                self.live.pairs.fetch_add(1, Ordering::Relaxed);
            }
        }
        tally
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ids with characters outside the unreserved set still make one path segment.
    #[test]
    fn ids_are_encoded_as_one_segment() {
        assert_eq!(encode_segment("rsv_3k9-a.b~"), "rsv_3k9-a.b~");
        assert_eq!(encode_segment("a/b c"), "a%2Fb%20c");
        assert_eq!(encode_segment("é"), "%C3%A9");
    }

    /// A denial is told apart from an error by its status, and keyed by the error type.
    #[test]
    fn answers_are_classified_by_status_then_type() {
        let answer = |status: u16, body: &'static str| Answer {
            status: StatusCode::from_u16(status).unwrap_or(StatusCode::IM_A_TEAPOT),
            body: Bytes::from_static(body.as_bytes()),
        };
        assert!(matches!(
            classify_reserve(&answer(201, r#"{"id": "rsv_1", "status": "held"}"#)),
            Reserved::Held(id) if id == "rsv_1"
        ));
        assert!(matches!(
            classify_reserve(&answer(429, r#"{"error": {"type": "rate_limited", "message": "x"}}"#)),
            Reserved::Denied(kind) if kind == "429 rate_limited"
        ));
        assert!(matches!(
            classify_reserve(&answer(500, "oops")),
            Reserved::Unexpected(kind) if kind == "500 -"
        ));
        assert!(matches!(
            classify_reserve(&answer(201, "{}")),
            Reserved::Unexpected(kind) if kind == "201 reserve answer without an id"
        ));
    }
}
