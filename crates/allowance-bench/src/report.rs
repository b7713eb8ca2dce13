//! What a run measured, as a value and as a short table.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use hdrhistogram::Histogram;

use crate::{FanoutReport, Scenario};

/// The throughput target: the server does at least this share of
/// the no-op server's pairs per second.
pub const THROUGHPUT_TARGET_RATIO: f64 = 0.8;

/// The latency target: the server's p99 is at most this multiple of
/// the no-op server's p99.
pub const P99_TARGET_RATIO: f64 = 1.5;

/// Percentiles of one kind of call, from a histogram with 3 significant
/// digits (so each figure is within 0.1%). All zero when nothing was measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Latency {
    /// How many calls were measured.
    pub count: u64,
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// 99.9th percentile.
    pub p999: Duration,
    /// Slowest.
    pub max: Duration,
}

impl Latency {
    /// Reads the percentiles of a histogram in microseconds.
    pub(crate) fn from_micros(histogram: &Histogram<u64>) -> Latency {
        if histogram.is_empty() {
            return Latency::default();
        }
        let at = |q: f64| Duration::from_micros(histogram.value_at_quantile(q));
        Latency {
            count: histogram.len(),
            p50: at(0.5),
            p99: at(0.99),
            p999: at(0.999),
            max: Duration::from_micros(histogram.max()),
        }
    }

    /// The exact percentiles (nearest rank) of a few samples.
    pub(crate) fn from_samples(samples: &[Duration]) -> Latency {
        if samples.is_empty() {
            return Latency::default();
        }
        let mut sorted = samples.to_vec();
        sorted.sort_unstable();
        let n = sorted.len();
        let at = |q: f64| {
            // Nearest rank: the smallest sample with at least q of them at or below it.
            let rank = (q * n as f64).ceil() as usize;
            sorted[rank.clamp(1, n) - 1]
        };
        Latency {
            count: n as u64,
            p50: at(0.5),
            p99: at(0.99),
            p999: at(0.999),
            max: sorted[n - 1],
        }
    }
}

/// What [`run`](crate::run) measured over the measured window (the warm-up
/// is counted nowhere).
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// The server measured, as given.
    pub server: String,
    /// The scenario run.
    pub scenario: Scenario,
    /// How many workers (connections).
    pub concurrency: usize,
    /// From the start of the measured window to the end of its last pair
    /// (at least the requested duration: pairs in flight at the end finish).
    pub elapsed: Duration,
    /// Completed pairs: an admitted reserve and a successful second call.
    pub pairs: u64,
    /// `pairs` per second of `elapsed`.
    pub pairs_per_s: f64,
    /// Reserves sent (admitted, denied, or failed).
    pub attempts: u64,
    /// Denied reserves (429, 402, 422).
    pub denials: u64,
    /// Denials by `"<status> <error.type>"`, e.g. `"429 rate_limited"`.
    pub denials_by_kind: BTreeMap<String, u64>,
    /// Calls that failed: transport errors, timeouts, 5xx and any other
    /// unexpected answer.
    pub errors: u64,
    /// Errors by kind, e.g. `"transport: timeout"` or `"settle: 404 not_found"`.
    pub errors_by_kind: BTreeMap<String, u64>,
    /// Reserve latency, over every answered reserve (denials included:
    /// the server did the work of refusing).
    pub reserve: Latency,
    /// Latency of the second call (settle or refund), over successful ones.
    pub second: Latency,
    /// Reserve start to second call end, over completed pairs.
    pub pair: Latency,
    /// The `fanout` scenario's own figures (`None` for the others); the
    /// table then shows them instead.
    pub fanout: Option<FanoutReport>,
}

/// Milliseconds with three decimals: the figures are microsecond-precise.
pub(crate) fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1000.0)
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(fanout) = &self.fanout {
            return fanout.fmt(f);
        }
        writeln!(
            f,
            "{} · scenario {} · concurrency {} · {:.2} s measured",
            self.server,
            self.scenario,
            self.concurrency,
            self.elapsed.as_secs_f64()
        )?;
        writeln!(
            f,
            "  pairs     {:>10}  ({:.1}/s)",
            self.pairs, self.pairs_per_s
        )?;
        writeln!(f, "  reserves  {:>10}", self.attempts)?;
        writeln!(f, "  denials   {:>10}", self.denials)?;
        writeln!(f, "  errors    {:>10}", self.errors)?;
        writeln!(
            f,
            "  {:<9} {:>8} {:>12} {:>12} {:>12} {:>12}",
            "latency", "count", "p50", "p99", "p99.9", "max"
        )?;
        for (name, latency) in [
            ("reserve", &self.reserve),
            (self.scenario.second_call(), &self.second),
            ("pair", &self.pair),
        ] {
            writeln!(
                f,
                "  {:<9} {:>8} {:>12} {:>12} {:>12} {:>12}",
                name,
                latency.count,
                ms(latency.p50),
                ms(latency.p99),
                ms(latency.p999),
                ms(latency.max)
            )?;
        }
        for (kind, n) in &self.denials_by_kind {
            writeln!(f, "  denied   {n:>10}  {kind}")?;
        }
        for (kind, n) in &self.errors_by_kind {
            writeln!(f, "  failed   {n:>10}  {kind}")?;
        }
        Ok(())
    }
}

/// A server's report against the no-op ceiling: the figures BENCHMARKS.md needs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Comparison {
    /// Target pairs/s over ceiling pairs/s; `None` when the ceiling did none.
    pub throughput_ratio: Option<f64>,
    /// Target pair p99 over ceiling pair p99; `None` when either measured no pair.
    pub p99_ratio: Option<f64>,
    /// The same for the reserve call alone.
    pub reserve_p99_ratio: Option<f64>,
    /// The same for the second call alone.
    pub second_p99_ratio: Option<f64>,
    target_pairs_per_s: f64,
    ceiling_pairs_per_s: f64,
    target_p99: Duration,
    ceiling_p99: Duration,
}

fn p99_ratio(target: &Latency, ceiling: &Latency) -> Option<f64> {
    if target.count == 0 || ceiling.count == 0 || ceiling.p99.is_zero() {
        return None;
    }
    Some(target.p99.as_secs_f64() / ceiling.p99.as_secs_f64())
}

impl Comparison {
    /// Compares `target` (the real server) with `ceiling` (the no-op server).
    /// Latency is compared on whole pairs, the unit the target counts.
    pub fn new(target: &Report, ceiling: &Report) -> Comparison {
        let throughput_ratio = (ceiling.pairs_per_s > 0.0 && ceiling.pairs_per_s.is_finite())
            .then(|| target.pairs_per_s / ceiling.pairs_per_s);
        Comparison {
            throughput_ratio,
            p99_ratio: p99_ratio(&target.pair, &ceiling.pair),
            reserve_p99_ratio: p99_ratio(&target.reserve, &ceiling.reserve),
            second_p99_ratio: p99_ratio(&target.second, &ceiling.second),
            target_pairs_per_s: target.pairs_per_s,
            ceiling_pairs_per_s: ceiling.pairs_per_s,
            target_p99: target.pair.p99,
            ceiling_p99: ceiling.pair.p99,
        }
    }

    /// Whether both of the targets are met (unknown counts as not met).
    pub fn meets_targets(&self) -> bool {
        self.throughput_ratio
            .is_some_and(|r| r >= THROUGHPUT_TARGET_RATIO)
            && self.p99_ratio.is_some_and(|r| r <= P99_TARGET_RATIO)
    }
}

fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "met",
        Some(false) => "NOT met",
        None => "unknown",
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ratio = |r: Option<f64>, suffix: &str| match r {
            Some(r) if suffix == "%" => format!("{:.1}%", r * 100.0),
            Some(r) => format!("{r:.2}{suffix}"),
            None => "n/a".to_owned(),
        };
        writeln!(
            f,
            "throughput  {:.1}/s vs no-op {:.1}/s = {} of the ceiling (target ≥ {:.0}%: {})",
            self.target_pairs_per_s,
            self.ceiling_pairs_per_s,
            ratio(self.throughput_ratio, "%"),
            THROUGHPUT_TARGET_RATIO * 100.0,
            verdict(self.throughput_ratio.map(|r| r >= THROUGHPUT_TARGET_RATIO)),
        )?;
        writeln!(
            f,
            "p99 pair    {} vs no-op {} = {} (target ≤ {P99_TARGET_RATIO}×: {})",
            ms(self.target_p99),
            ms(self.ceiling_p99),
            ratio(self.p99_ratio, "×"),
            verdict(self.p99_ratio.map(|r| r <= P99_TARGET_RATIO)),
        )?;
        write!(
            f,
            "p99 reserve {} · p99 second call {}",
            ratio(self.reserve_p99_ratio, "×"),
            ratio(self.second_p99_ratio, "×"),
        )
    }
}

/// The throughput and p99 ratios of `target` against `ceiling`, as lines
/// ready for BENCHMARKS.md (see [`Comparison`] for the values).
pub fn compare(target: &Report, ceiling: &Report) -> String {
    Comparison::new(target, ceiling).to_string()
}
