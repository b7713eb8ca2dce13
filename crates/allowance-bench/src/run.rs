//! A run: validate, start the workers, wait for the window to close, merge.

use std::sync::Arc;
use std::time::Duration;

use hdrhistogram::Histogram;
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::client::Target;
use crate::progress::Reporter;
use crate::report::Latency;
use crate::worker::{Clock, Live, Tally, Worker};
use crate::{
    BenchError, BenchOptions, MAX_CONCURRENCY, MAX_DURATION, Report, Scenario, serve_noop,
};

/// How long calls in flight when the window closes may take to finish; a
/// pair already started deserves its answer, a server that hangs does not
/// get to hang the bench.
const DRAIN_GRACE: Duration = Duration::from_secs(2);

/// Bound on the first connection that checks the server is there at all.
const PREFLIGHT_TIMEOUT: Duration = Duration::from_secs(5);

/// The histograms' range in microseconds: 1 µs to a minute, which covers
/// every call since calls are cut at [`crate::client::REQUEST_TIMEOUT`].
const HISTOGRAM_MAX_MICROS: u64 = 60_000_000;

fn validate(opts: &BenchOptions) -> Result<(), BenchError> {
    if opts.concurrency == 0 || opts.concurrency > MAX_CONCURRENCY {
        return Err(BenchError::InvalidOption {
            field: "concurrency",
            reason: format!("{} is outside 1..={MAX_CONCURRENCY}", opts.concurrency),
        });
    }
    if opts.duration.is_zero() || opts.duration > MAX_DURATION {
        return Err(BenchError::InvalidOption {
            field: "duration",
            reason: format!(
                "{} ms is outside (0 s, {} s]",
                opts.duration.as_millis(),
                MAX_DURATION.as_secs()
            ),
        });
    }
    if opts.warmup > MAX_DURATION {
        return Err(BenchError::InvalidOption {
            field: "warmup",
            reason: format!("{:?} is over {} s", opts.warmup, MAX_DURATION.as_secs()),
        });
    }
    Ok(())
}

/// Runs `opts.scenario` against `opts.server` and reports what the measured
/// window saw.
///
/// Every worker holds one HTTP/1.1 keep-alive connection and does its pairs
/// in sequence; a connection the server breaks is dialled again (and the
/// failure counted). The run takes the warm-up, the duration, and at most
/// two more seconds for calls in flight. Needs a tokio runtime with the time
/// and I/O drivers; a multi-threaded one spreads the workers over the cores.
///
/// # Errors
/// A bad option (naming the field), or a server that cannot be reached at
/// all before the start. Nothing the server answers afterwards is an error:
/// denials and failures are counted in the [`Report`].
pub async fn run(opts: &BenchOptions) -> Result<Report, BenchError> {
    validate(opts)?;
    if opts.scenario == Scenario::Fanout {
        return crate::fanout::run(opts).await;
    }
    let target = Arc::new(Target::parse(&opts.server, opts.token.as_deref())?);
    preflight(&target).await?;
    let histogram = Histogram::<u64>::new_with_bounds(1, HISTOGRAM_MAX_MICROS, 3)
        .map_err(|e| BenchError::Worker(format!("histogram: {e}")))?;

    let start = Instant::now();
    let measure_start = start + opts.warmup;
    let measure_end = measure_start + opts.duration;
    let clock = Clock {
        measure_start,
        measure_end,
        hard_stop: measure_end + DRAIN_GRACE,
    };
    let live = Arc::new(Live::default());
    let reporter = Reporter::start(opts.progress, clock, Arc::clone(&live));

    let mut workers = JoinSet::new();
    for index in 0..opts.concurrency {
        let worker = Worker {
            index,
            concurrency: opts.concurrency,
            scenario: opts.scenario,
            target: Arc::clone(&target),
            clock,
            live: Arc::clone(&live),
        };
        workers.spawn(worker.run(histogram.clone()));
    }
    let mut tallies = Vec::with_capacity(opts.concurrency);
    let mut failure = None;
    while let Some(joined) = workers.join_next().await {
        match joined {
            Ok(tally) => tallies.push(tally),
            Err(e) => {
                failure = Some(BenchError::Worker(e.to_string()));
                workers.abort_all();
            }
        }
    }
    reporter.finish();
    if let Some(failure) = failure {
        return Err(failure);
    }
    if let Some(answer) = live.refused.get() {
        return Err(BenchError::Refused(answer.clone()));
    }
    merge(opts, clock, histogram, tallies)
}

/// Checks that something listens before starting the workers, so a wrong
/// address is one clear error rather than a report full of failed dials.
pub(crate) async fn preflight(target: &Target) -> Result<(), BenchError> {
    let connect = tokio::time::timeout(PREFLIGHT_TIMEOUT, TcpStream::connect(&target.addr));
    match connect.await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(source)) => Err(BenchError::Connect {
            addr: target.addr.clone(),
            source,
        }),
        Err(_) => Err(BenchError::Connect {
            addr: target.addr.clone(),
            source: std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no connection within {} s", PREFLIGHT_TIMEOUT.as_secs()),
            ),
        }),
    }
}

fn merge(
    opts: &BenchOptions,
    clock: Clock,
    empty: Histogram<u64>,
    tallies: Vec<Tally>,
) -> Result<Report, BenchError> {
    let mut reserve = empty.clone();
    let mut second = empty.clone();
    let mut pair = empty;
    let mut report = Report {
        server: opts.server.clone(),
        scenario: opts.scenario,
        concurrency: opts.concurrency,
        elapsed: opts.duration,
        pairs: 0,
        pairs_per_s: 0.0,
        attempts: 0,
        denials: 0,
        denials_by_kind: Default::default(),
        errors: 0,
        errors_by_kind: Default::default(),
        reserve: Latency::default(),
        second: Latency::default(),
        pair: Latency::default(),
        fanout: None,
    };
    let mut last_end = clock.measure_end;
    for tally in tallies {
        // Every histogram has the same bounds, so adding cannot fail; it is still no panic.
        let add = |into: &mut Histogram<u64>, from: &Histogram<u64>| {
            into.add(from)
                .map_err(|e| BenchError::Worker(format!("histogram: {e:?}")))
        };
        add(&mut reserve, &tally.reserve)?;
        add(&mut second, &tally.second)?;
        add(&mut pair, &tally.pair)?;
        report.pairs += tally.pairs;
        report.attempts += tally.attempts;
        for (kind, n) in tally.denials {
            report.denials += n;
            *report.denials_by_kind.entry(kind).or_default() += n;
        }
        for (kind, n) in tally.errors {
            report.errors += n;
            *report.errors_by_kind.entry(kind).or_default() += n;
        }
        last_end = last_end.max(tally.finished_at);
    }
    report.elapsed = last_end - clock.measure_start;
    let secs = report.elapsed.as_secs_f64();
    report.pairs_per_s = if secs > 0.0 {
        report.pairs as f64 / secs
    } else {
        0.0
    };
    report.reserve = Latency::from_micros(&reserve);
    report.second = Latency::from_micros(&second);
    report.pair = Latency::from_micros(&pair);
    Ok(report)
}

/// Measures the ceiling: starts the no-op server ([`crate::noop_router`]) on
/// `127.0.0.1:0` in this process and runs the same options against it; the
/// report's `server` names it `no-op http://127.0.0.1:<port>`.
///
/// The no-op server runs on the caller's runtime, so it shares the cores
/// with the client exactly as a separate server process would.
///
/// # Errors
/// As [`run`], or [`BenchError::Ceiling`] when the server cannot bind.
/// `fanout` has no ceiling (the no-op server has no plans, queue or
/// scopes): it is an invalid `scenario` here.
pub async fn measure_ceiling(opts: &BenchOptions) -> Result<Report, BenchError> {
    if opts.scenario == Scenario::Fanout {
        return Err(BenchError::InvalidOption {
            field: "scenario",
            reason: "fanout measures the admission queue against its ideal schedule; the no-op server has no ceiling for it".to_owned(),
        });
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(BenchError::Ceiling)?;
    let addr = listener.local_addr().map_err(BenchError::Ceiling)?;
    let server = tokio::spawn(serve_noop(listener));
    let url = format!("http://{addr}");
    let ceiling_opts = BenchOptions {
        server: url.clone(),
        ..opts.clone()
    };
    let result = run(&ceiling_opts).await;
    server.abort();
    result.map(|report| Report {
        server: format!("no-op {url}"),
        ..report
    })
}
