//! One upstream provider as the gateway sees it: where it is, its key, the
//! one backoff all its calls share after a 429, and the adaptive
//! concurrency that converges under its real ceiling.

use std::sync::Arc;
use std::time::Duration;

use allowance_config::UpstreamSettings;
use axum::http::HeaderMap;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

/// The first backoff after a 429 that says nothing of when to retry;
/// doubled per consecutive 429.
const BACKOFF_BASE: Duration = Duration::from_millis(500);
/// The longest backoff without a header (and the longest header honoured
/// without question: a provider asking for more is passed on to the client).
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// The most a call waits for retries in all, beyond which the provider's
/// answer is passed on (the client decides).
pub(crate) const MAX_RETRY_WAIT: Duration = Duration::from_secs(60);
/// The width of the adaptive gate when the upstream sets no
/// `max_concurrent` (high: the ledger and the provider's 429s shape it).
const DEFAULT_WIDTH: u64 = 1024;
/// Multiplicative decrease on a 429, at most once per this interval (a
/// burst of 429s from one overload is one signal, not many).
const DECREASE_EVERY: Duration = Duration::from_millis(200);

/// An upstream provider.
pub(crate) struct Upstream {
    pub settings: UpstreamSettings,
    /// `Bearer`/`x-api-key` value sent upstream (from `api_key_env` at start).
    pub api_key: Option<String>,
    backoff: Mutex<Backoff>,
    gate: Gate,
}

#[derive(Default)]
struct Backoff {
    /// No attempt starts before this instant.
    until: Option<Instant>,
    /// Consecutive 429s without a header (the exponent).
    streak: u32,
}

impl Upstream {
    pub fn new(settings: UpstreamSettings, api_key: Option<String>) -> Self {
        let width = settings.max_concurrent.unwrap_or(DEFAULT_WIDTH);
        let upstream = Upstream {
            settings,
            api_key,
            backoff: Mutex::new(Backoff::default()),
            gate: Gate::new(width),
        };
        // On /metrics from the start, not from its first change.
        upstream.report_width();
        upstream
    }

    /// When the shared backoff ends (`None`: no backoff now).
    pub fn backoff_until(&self) -> Option<Instant> {
        let b = self.backoff.lock();
        b.until.filter(|u| *u > Instant::now())
    }

    /// A 429 from the provider: every call on this upstream waits until
    /// the time it names (`retry-after-ms`, `retry-after`,
    /// `x-ratelimit-reset-*`), or a jittered exponential backoff when it
    /// names none. Returns the wait this attempt should honour.
    pub fn on_429(&self, headers: &HeaderMap) -> Duration {
        let now = Instant::now();
        self.gate.decrease(now);
        self.report_width();
        let mut b = self.backoff.lock();
        let wait = match retry_delay(headers) {
            Some(d) => {
                b.streak = 0;
                d
            }
            None => match b.until.filter(|u| *u > now) {
                // A backoff already runs: the 429s of one burst are one
                // step of it, not one step each.
                Some(u) => u - now,
                None => {
                    b.streak = b.streak.saturating_add(1);
                    jittered(b.streak)
                }
            },
        };
        let until = now + wait;
        b.until = Some(b.until.map_or(until, |u| u.max(until)));
        wait
    }

    /// A clean answer: the streak of 429s is over and the gate may widen.
    pub fn on_success(&self) {
        self.backoff.lock().streak = 0;
        if self.gate.increase() {
            self.report_width();
        }
    }

    fn report_width(&self) {
        ::metrics::gauge!("allowance_gateway_upstream_width", "upstream" => self.settings.name.clone())
            .set(self.width() as f64);
    }

    /// Waits for a place in the adaptive gate.
    pub async fn acquire(self: &Arc<Self>) -> Permit {
        self.gate.acquire().await;
        Permit {
            upstream: self.clone(),
        }
    }

    /// A place in the gate if one is free now.
    pub fn try_acquire(self: &Arc<Self>) -> Option<Permit> {
        let mut s = self.gate.state.lock();
        if s.in_flight < s.limit {
            s.in_flight += 1;
            drop(s);
            return Some(Permit {
                upstream: self.clone(),
            });
        }
        None
    }

    /// The adaptive width now (for metrics and tests).
    pub fn width(&self) -> u64 {
        self.gate.state.lock().limit
    }
}

/// A place in an upstream's gate, given back on drop.
pub(crate) struct Permit {
    upstream: Arc<Upstream>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.upstream.gate.release();
    }
}

/// AIMD concurrency: lowered by a quarter on a 429, raised by one after
/// a full width of clean answers, never above the configured width.
struct Gate {
    state: Mutex<GateState>,
    notify: Notify,
}

struct GateState {
    max: u64,
    limit: u64,
    in_flight: u64,
    clean: u64,
    last_decrease: Option<Instant>,
}

impl Gate {
    fn new(max: u64) -> Self {
        Gate {
            state: Mutex::new(GateState {
                max,
                limit: max,
                in_flight: 0,
                clean: 0,
                last_decrease: None,
            }),
            notify: Notify::new(),
        }
    }

    async fn acquire(&self) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            // Registered before the check: a release between the check
            // and the await still wakes this waiter.
            notified.as_mut().enable();
            {
                let mut s = self.state.lock();
                if s.in_flight < s.limit {
                    s.in_flight += 1;
                    return;
                }
            }
            notified.await;
        }
    }

    fn release(&self) {
        let mut s = self.state.lock();
        s.in_flight = s.in_flight.saturating_sub(1);
        drop(s);
        self.notify.notify_one();
    }

    fn decrease(&self, now: Instant) {
        let mut s = self.state.lock();
        if s.last_decrease
            .is_some_and(|t| now.duration_since(t) < DECREASE_EVERY)
        {
            return;
        }
        s.last_decrease = Some(now);
        s.limit = (s.limit - s.limit / 4).max(1);
        s.clean = 0;
    }

    /// Returns whether the width grew.
    fn increase(&self) -> bool {
        let mut s = self.state.lock();
        s.clean += 1;
        if s.clean >= s.limit && s.limit < s.max {
            s.clean = 0;
            s.limit += 1;
            drop(s);
            self.notify.notify_one();
            return true;
        }
        false
    }
}

/// The wait a 429's headers ask for, exactly: `retry-after-ms`, then
/// `retry-after` (seconds or an HTTP date), then the latest of the
/// `x-ratelimit-reset-requests` / `-tokens` whose remaining is 0 (all
/// of them when none says 0), then Anthropic's RFC 3339 resets.
pub(crate) fn retry_delay(h: &HeaderMap) -> Option<Duration> {
    let get = |name: &str| h.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(ms) = get("retry-after-ms").and_then(|v| v.parse::<f64>().ok())
        && ms.is_finite()
        && ms >= 0.0
    {
        return Some(Duration::from_micros((ms * 1000.0) as u64));
    }
    if let Some(v) = get("retry-after") {
        if let Ok(s) = v.parse::<f64>()
            && s.is_finite()
            && s >= 0.0
        {
            return Some(Duration::from_millis((s * 1000.0) as u64));
        }
        if let Ok(at) = jiff::fmt::rfc2822::parse(v) {
            let ms = at.timestamp().as_millisecond() - jiff::Timestamp::now().as_millisecond();
            return Some(Duration::from_millis(ms.max(0) as u64));
        }
    }
    let mut resets = Vec::new();
    for kind in ["requests", "tokens", "input-tokens", "output-tokens"] {
        if let Some(d) = get(&format!("x-ratelimit-reset-{kind}")).and_then(parse_go_duration) {
            let exhausted = get(&format!("x-ratelimit-remaining-{kind}")) == Some("0");
            resets.push((exhausted, d));
        }
        if let Some(at) = get(&format!("anthropic-ratelimit-{kind}-reset"))
            && let Ok(ts) = at.parse::<jiff::Timestamp>()
        {
            let ms = ts.as_millisecond() - jiff::Timestamp::now().as_millisecond();
            let exhausted = get(&format!("anthropic-ratelimit-{kind}-remaining")) == Some("0");
            resets.push((exhausted, Duration::from_millis(ms.max(0) as u64)));
        }
    }
    let any_exhausted = resets.iter().any(|(e, _)| *e);
    resets
        .into_iter()
        .filter(|(e, _)| *e || !any_exhausted)
        .map(|(_, d)| d)
        .max()
}

/// Parses OpenAI's reset durations: `1s`, `6m0s`, `1.5s`, `12ms`, `1h2m3s`.
pub(crate) fn parse_go_duration(s: &str) -> Option<Duration> {
    let mut total_ms = 0f64;
    let mut rest = s.trim();
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..end].parse().ok()?;
        rest = &rest[end..];
        let (unit_ms, len) = if rest.starts_with("ms") {
            (1.0, 2)
        } else if rest.starts_with('h') {
            (3_600_000.0, 1)
        } else if rest.starts_with('m') {
            (60_000.0, 1)
        } else if rest.starts_with('s') {
            (1000.0, 1)
        } else {
            return None;
        };
        total_ms += number * unit_ms;
        rest = &rest[len..];
    }
    total_ms
        .is_finite()
        .then(|| Duration::from_micros((total_ms * 1000.0) as u64))
}

/// Exponential backoff with jitter in [d/2, d]: spread so waiters that
/// hit the same 429 do not come back together.
fn jittered(streak: u32) -> Duration {
    let exp = BACKOFF_BASE.saturating_mul(1u32 << streak.saturating_sub(1).min(10));
    let d = exp.min(BACKOFF_MAX);
    let half = d / 2;
    half + half.mul_f64(rand::random::<f64>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn the_most_precise_header_wins() {
        let h = headers(&[("retry-after-ms", "1500"), ("retry-after", "9")]);
        assert_eq!(retry_delay(&h), Some(Duration::from_millis(1500)));
        let h = headers(&[("retry-after", "2")]);
        assert_eq!(retry_delay(&h), Some(Duration::from_secs(2)));
    }

    #[test]
    fn the_exhausted_reset_is_the_one_that_counts() {
        let h = headers(&[
            ("x-ratelimit-reset-requests", "6m0s"),
            ("x-ratelimit-remaining-requests", "12"),
            ("x-ratelimit-reset-tokens", "1.5s"),
            ("x-ratelimit-remaining-tokens", "0"),
        ]);
        assert_eq!(retry_delay(&h), Some(Duration::from_millis(1500)));
        assert_eq!(retry_delay(&HeaderMap::new()), None);
    }

    #[test]
    fn go_durations_parse() {
        assert_eq!(parse_go_duration("12ms"), Some(Duration::from_millis(12)));
        assert_eq!(parse_go_duration("1h2m3s"), Some(Duration::from_secs(3723)));
        assert_eq!(parse_go_duration("0.5s"), Some(Duration::from_millis(500)));
        assert_eq!(parse_go_duration("soon"), None);
        assert_eq!(parse_go_duration(""), None);
    }

    #[test]
    fn jitter_stays_in_its_band_and_caps() {
        for streak in 1..20 {
            let d = jittered(streak);
            let full = BACKOFF_BASE
                .saturating_mul(1u32 << (streak - 1).min(10))
                .min(BACKOFF_MAX);
            assert!(d >= full / 2 && d <= full, "{streak}: {d:?}");
        }
    }

    #[tokio::test]
    async fn the_gate_narrows_on_429_and_widens_slowly() {
        let settings = UpstreamSettings {
            name: "p".into(),
            base_url: "http://127.0.0.1:1".into(),
            api_key_env: None,
            models: vec!["*".into()],
            requests_per_minute: None,
            input_tokens_per_minute: None,
            output_tokens_per_minute: None,
            max_concurrent: Some(8),
            max_retries: 2,
        };
        let u = Arc::new(Upstream::new(settings, None));
        assert_eq!(u.width(), 8);
        u.on_429(&headers(&[("retry-after", "0")]));
        assert_eq!(u.width(), 6);
        // A second 429 of the same burst is the same signal.
        u.on_429(&headers(&[("retry-after", "0")]));
        assert_eq!(u.width(), 6);
        for _ in 0..5 {
            u.on_success();
        }
        assert_eq!(u.width(), 6);
        u.on_success();
        assert_eq!(u.width(), 7);
        // Six permits fill a width of 7 less one; the seventh waits for none.
        let mut permits = Vec::new();
        for _ in 0..7 {
            permits.push(u.acquire().await);
        }
        let waiter = tokio::spawn({
            let u = u.clone();
            async move { u.acquire().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "an eighth call passed a gate of 7");
        permits.pop();
        let p = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("a released place wakes the waiter")
            .unwrap();
        drop(p);
    }
}
