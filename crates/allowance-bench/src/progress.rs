//! Progress on stderr while a run measures: a bar on a terminal, plain lines
//! in a log.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

use crate::Progress;
use crate::worker::{Clock, Live};

/// How often the bar is redrawn: smooth enough, cheap enough.
const BAR_TICK: Duration = Duration::from_millis(200);

/// How often a plain line is printed.
const LINE_TICK: Duration = Duration::from_secs(1);

/// A running progress display; [`Reporter::finish`] removes it.
pub(crate) struct Reporter {
    task: Option<JoinHandle<()>>,
    bar: Option<ProgressBar>,
}

fn pairs_per_s(pairs: u64, since: Instant) -> f64 {
    let secs = since.elapsed().as_secs_f64();
    if secs > 0.0 { pairs as f64 / secs } else { 0.0 }
}

impl Reporter {
    /// Starts showing progress in the given style.
    pub(crate) fn start(mode: Progress, clock: Clock, live: Arc<Live>) -> Reporter {
        match mode {
            Progress::Off => Reporter {
                task: None,
                bar: None,
            },
            Progress::Bar => {
                let total_ms = (clock.measure_end - clock.measure_start).as_millis();
                let bar = ProgressBar::new(u64::try_from(total_ms).unwrap_or(u64::MAX));
                // The template is a constant; should it ever not parse, the default bar still works.
                if let Ok(style) =
                    ProgressStyle::with_template("{spinner} [{elapsed_precise}] [{bar:30}] {msg}")
                {
                    bar.set_style(style.progress_chars("=> "));
                }
                bar.set_message("warming up");
                let shown = bar.clone();
                let task = tokio::spawn(async move {
                    let mut tick = tokio::time::interval(BAR_TICK);
                    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
                    loop {
                        tick.tick().await;
                        let now = Instant::now();
                        if now < clock.measure_start {
                            shown.tick();
                            continue;
                        }
                        let done = (now.min(clock.measure_end) - clock.measure_start).as_millis();
                        shown.set_position(u64::try_from(done).unwrap_or(u64::MAX));
                        let pairs = live.pairs.load(Ordering::Relaxed);
                        shown.set_message(format!(
                            "{pairs} pairs, {:.0}/s, {} denials, {} errors",
                            pairs_per_s(pairs, clock.measure_start),
                            live.denials.load(Ordering::Relaxed),
                            live.errors.load(Ordering::Relaxed),
                        ));
                    }
                });
                Reporter {
                    task: Some(task),
                    bar: Some(bar),
                }
            }
            Progress::Lines => {
                let task = tokio::spawn(async move {
                    tokio::time::sleep_until(clock.measure_start).await;
                    let mut tick =
                        tokio::time::interval_at(clock.measure_start + LINE_TICK, LINE_TICK);
                    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
                    let mut last_pairs = 0;
                    let mut last_at = clock.measure_start;
                    loop {
                        let now = tick.tick().await;
                        let pairs = live.pairs.load(Ordering::Relaxed);
                        let window = (now - last_at).as_secs_f64();
                        let now_rate = if window > 0.0 {
                            pairs.saturating_sub(last_pairs) as f64 / window
                        } else {
                            0.0
                        };
                        eprintln!(
                            "bench: {:>4.0} s  {pairs} pairs  {now_rate:.0}/s now  {:.0}/s so far  {} denials  {} errors",
                            (now - clock.measure_start).as_secs_f64(),
                            pairs_per_s(pairs, clock.measure_start),
                            live.denials.load(Ordering::Relaxed),
                            live.errors.load(Ordering::Relaxed),
                        );
                        last_pairs = pairs;
                        last_at = now;
                    }
                });
                Reporter {
                    task: Some(task),
                    bar: None,
                }
            }
        }
    }

    /// Stops the display and clears the bar, so the report prints cleanly.
    pub(crate) fn finish(self) {
        if let Some(task) = self.task {
            task.abort();
        }
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }
}
