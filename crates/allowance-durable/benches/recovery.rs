//! Recovery speed of the durable store (issue 4: "≥ 1M log records/s
//! replayed; report time to start with 10M records and with a snapshot").
//!
//! 1. **Build.** A [`DurableStore`] (`fsync = never`, no automatic
//!    snapshot) is driven on a manual clock with a realistic mix until its
//!    log holds exactly `ALLOWANCE_RECOVERY_RECORDS` records (default 1M;
//!    the figure is 10M): 16 tenants, users and agents under them,
//!    two shared tools; reserve → settle mostly, some refunds, some
//!    extend → settle, some holds left to expire; idempotency keys, labels
//!    and model-priced requests on a share of them. 64 requests run at
//!    once (so the log's group commit batches the build) and a hold ends 8
//!    batches (~10 s of simulated time) after it was taken. The clock moves
//!    20 ms per reservation (`ALLOWANCE_RECOVERY_STEP_MS`), so 1M records
//!    span ~2.8 simulated hours and 10M ~28: buckets refill, sliding and calendar
//!    windows roll, unsettled holds expire (5 min TTL, or 30 s) and, past
//!    the day's retention, ended reservations are forgotten during replay.
//! 2. **Start from the log.** `DurableStore::open` is timed in a *fresh
//!    process* (this binary re-run with `ALLOWANCE_RECOVERY_CHILD_DIR`), so
//!    the heap starts empty and the RSS read from `/proc/self/status` is the
//!    recovered store's; the log's files are in the page cache (warm).
//!    `ALLOWANCE_RECOVERY_RUNS` runs (default 3); the median is reported.
//!    As a yardstick, the log layer alone (`Wal::open` + a replay that only
//!    looks at the bytes) is timed in this process too.
//! 3. **Start from a snapshot.** A snapshot is written (`snapshot_now`,
//!    timed, the same number of runs, while a probe reads a tenant's status
//!    every millisecond: its slowest answer is how long the snapshot held
//!    the ledger's locks) and the fresh-process open timed again.
//!
//! Everything lives in a directory under `ALLOWANCE_BENCH_DIR` (default
//! `std::env::temp_dir()`), removed at the end unless
//! `ALLOWANCE_RECOVERY_KEEP_DIR` is set. Each open prints its process id:
//! under `perf record -g`, `perf report --pid` picks one open's samples.
//!
//! Under `cargo test --benches` (no `--bench` argument) it runs once on
//! 2,000 records, as a check that it still works.
//!
//! Run: `cargo bench -p allowance-durable --bench recovery`;
//! `ALLOWANCE_RECOVERY_RECORDS=10000000` for the figure (the build
//! then takes a few minutes and the process a few GiB).

#![allow(
    clippy::print_stdout,
    reason = "a benchmark's report is what it prints"
)]

use std::collections::VecDeque;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use allowance_core::{
    Amounts, CalendarUnit, Catalog, Clock, Dimension, Limit, ManualClock, ModelPrice,
    OverrunPolicy, Plan, ReservationId, ReserveRequest, SeededIds, Settings, Store, Timestamp,
    Usage, Window, Zone,
};
use allowance_durable::{DurableOptions, DurableStore, OpenReport};
use allowance_wal::{Fsync, RealFs, Wal};
use tokio::task::JoinSet;

type BenchResult<T> = Result<T, Box<dyn Error>>;

/// Where the simulated clock starts: 2026-01-01T00:00:00Z.
const START_MS: u64 = 1_767_225_600_000;
/// Tenants of the workload.
const TENANTS: u64 = 16;
/// Users under each tenant.
const USERS_PER_TENANT: u64 = 1_000;
/// Agents under each tenant.
const AGENTS_PER_TENANT: u64 = 8;
/// The shared tool scopes.
const TOOLS: [&str; 2] = ["search", "browse"];
/// Requests in flight at once while building: enough for the log's group
/// commit to batch the writes, as under real concurrent load.
const BATCH: usize = 64;
/// A hold ends this many batches after it was taken.
const HOLD_BATCHES: usize = 8;
/// Ledger shards, the store's default.
const SHARDS: usize = 16;
/// Records of the log by default: enough for a steady replay rate, short
/// enough for `cargo bench` (the 10M is set by the variable).
const BENCH_RECORDS: u64 = 1_000_000;
/// Opens (and snapshots) timed per run: the median of 3.
const BENCH_RUNS: u64 = 3;
/// Records of the log under `cargo test --benches`.
const SMOKE_RECORDS: u64 = 2_000;
/// Progress is printed every this many records while building.
const PROGRESS_EVERY_RECORDS: u64 = 1_000_000;

/// One plan of four limits, capacities high enough that nothing is refused
/// (a refusal is not logged, so it would only slow the build down).
fn plan(name: &str, per_minute: u64, day: Window, concurrent: u64) -> BenchResult<Arc<Plan>> {
    let minute = Window::Bucket { period_ms: 60_000 };
    let limits = vec![
        Limit::new(Dimension::REQUESTS, per_minute, minute.clone())?,
        Limit::new(Dimension::TOKENS, per_minute * 100_000, minute)?,
        Limit::new(Dimension::COST_MICROS, per_minute * 1_000_000_000, day)?,
        Limit::new(Dimension::CONCURRENT, concurrent, Window::Concurrent)?,
    ];
    Ok(Plan::new(name, limits, OverrunPolicy::ChargeActual)?)
}

/// The catalog of the build and of every open (the same, so no start logs a
/// configuration change). Settings are the defaults: holds of 5 minutes,
/// ended reservations and idempotency keys remembered for a day.
fn catalog() -> BenchResult<Catalog> {
    let mut c = Catalog::new(Settings::default())?;
    let sliding_day = Window::Sliding {
        period_ms: 86_400_000,
        slices: 24,
    };
    let calendar_day = Window::Calendar {
        unit: CalendarUnit::Day,
        zone: Zone::utc(),
    };
    c.set_plan(plan("org", 1_000_000, sliding_day.clone(), 100_000)?);
    c.set_plan(plan("member", 10_000, sliding_day, 1_000)?);
    c.set_plan(plan("bot", 100_000, calendar_day, 10_000)?);
    c.set_plan(plan(
        "tool",
        1_000_000,
        Window::Sliding {
            period_ms: 3_600_000,
            slices: 60,
        },
        100_000,
    )?);
    c.set_kind("tenant", Some("org"), false)?;
    c.set_kind("user", Some("member"), false)?;
    c.set_kind("agent", Some("bot"), false)?;
    c.set_kind("tool", Some("tool"), true)?;
    c.set_model(
        "gpt-4o",
        ModelPrice {
            input_micros_per_million: 2_500_000,
            cached_input_micros_per_million: 1_250_000,
            output_micros_per_million: 10_000_000,
            max_output_tokens: 16_384,
            tokenizer: "o200k_base".into(),
        },
    )?;
    Ok(c)
}

/// The store's options in `dir`: nothing synced while building (the figure
/// is recovery, not the disk) and no automatic snapshot.
fn options(dir: &Path) -> DurableOptions {
    let mut opts = DurableOptions::new(dir);
    opts.wal.fsync = Fsync::Never;
    opts.shards = SHARDS;
    opts.snapshot_every_records = u64::MAX;
    opts
}

fn runtime() -> BenchResult<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// SplitMix64: the workload's deterministic randomness.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// How a reservation ends.
#[derive(Clone, Debug)]
enum Ending {
    Settle(Usage),
    Refund,
    /// Extend (more room, a longer TTL), then settle a few batches later.
    ExtendThenSettle(Amounts, Usage),
    /// Never ended: the hold expires.
    Expire,
}

/// The `i`th reservation of the workload and how it ends.
fn transaction(catalog: &Catalog, i: u64) -> BenchResult<(ReserveRequest, Ending)> {
    let r = mix64(i);
    let pick = |shift: u32, n: u64| (r >> shift) % n;
    let tenant = format!("t{}", pick(0, TENANTS));
    let user = format!("u{}", pick(8, USERS_PER_TENANT));
    let agent = format!("a{}", pick(20, AGENTS_PER_TENANT));
    let mut scopes: Vec<(&str, &str)> = Vec::with_capacity(3);
    // 70% name a user, half of those an agent too; 30% a shared tool.
    if pick(24, 10) < 7 {
        scopes.push(("user", &user));
        if pick(28, 2) == 0 {
            scopes.push(("agent", &agent));
        }
    }
    if pick(30, 10) < 3 {
        scopes.push(("tool", TOOLS[pick(34, 2) as usize]));
    }
    let scopes = catalog.scope_set(&tenant, &scopes)?;
    // 40% are priced by the model from input and output tokens; the rest
    // give tokens and cost directly.
    let priced = pick(36, 10) < 4;
    let tokens = 200 + pick(40, 4_000);
    let (amounts, actual) = if priced {
        let output = tokens / 4;
        (
            Amounts::new()
                .with(Dimension::INPUT_TOKENS, tokens)
                .with(Dimension::OUTPUT_TOKENS, output),
            Amounts::new()
                .with(Dimension::INPUT_TOKENS, tokens)
                .with(Dimension::OUTPUT_TOKENS, output * 3 / 5),
        )
    } else {
        (
            Amounts::new()
                .with(Dimension::TOKENS, tokens)
                .with(Dimension::COST_MICROS, tokens * 3),
            // One in ten uses more than it reserved (charged in full).
            Amounts::new()
                .with(Dimension::TOKENS, tokens * (6 + pick(52, 6)) / 10)
                .with(Dimension::COST_MICROS, tokens * 2),
        )
    };
    let mut req = ReserveRequest::new(scopes, amounts.clone());
    if priced {
        req.model = Some(Arc::from("gpt-4o"));
    }
    if pick(56, 10) == 0 {
        req.idempotency_key = Some(Arc::from(format!("k{i:x}")));
    }
    if pick(60, 5) == 0 {
        req.labels = Some(Arc::from(vec![("route".to_owned(), "chat".to_owned())]));
    }
    let usage = Usage {
        amounts: actual,
        cached_input_tokens: if priced { tokens / 3 } else { 0 },
        charges: Vec::new(),
    };
    let ending = match mix64(r) % 100 {
        0..5 => {
            // Half of the abandoned holds ask for a short TTL.
            if pick(44, 2) == 0 {
                req.ttl_ms = Some(30_000);
            }
            Ending::Expire
        }
        5..13 => Ending::Refund,
        13..18 => {
            let more = amounts
                .iter()
                .fold(Amounts::new(), |a, (d, v)| a.with(d, v + v / 2));
            Ending::ExtendThenSettle(more, usage)
        }
        _ => Ending::Settle(usage),
    };
    Ok((req, ending))
}

/// What one request of a batch did.
enum Done {
    Reserved(ReservationId, Ending),
    Extended(ReservationId, Usage),
    Ended,
}

/// Drives a new store in `dir` until its log holds exactly `records`
/// records after its configuration; returns the clock's final instant.
async fn build(dir: &Path, records: u64, step_ms: u64) -> BenchResult<Timestamp> {
    let catalog = catalog()?;
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(START_MS)));
    let (store, _) = DurableStore::open(
        catalog.clone(),
        options(dir),
        Arc::new(RealFs),
        clock.clone(),
        Arc::new(SeededIds::new(7)),
        |_| {},
    )
    .await?;
    let started = Instant::now();
    let mut written = 0u64;
    let mut next_progress = PROGRESS_EVERY_RECORDS;
    let mut next_txn = 0u64;
    // What ends in each of the next batches, oldest first.
    let mut pending: VecDeque<Vec<(ReservationId, Ending)>> = VecDeque::new();
    while written < records {
        let due = if pending.len() >= HOLD_BATCHES {
            pending.pop_front().unwrap_or_default()
        } else {
            Vec::new()
        };
        let mut batch = JoinSet::new();
        // Every request logs exactly one record, so the last batch can stop
        // at `records` exactly.
        let mut budget = (records - written).min(2 * BATCH as u64);
        let mut later = Vec::new();
        for (id, ending) in due {
            if budget == 0 {
                later.push((id, ending));
                continue;
            }
            budget -= 1;
            let store = store.clone();
            batch.spawn(async move {
                match ending {
                    Ending::Settle(usage) => store
                        .settle(id, &usage)
                        .await
                        .map(|_| Done::Ended)
                        .map_err(|e| format!("settle {id}: {e}")),
                    Ending::Refund => store
                        .refund(id)
                        .await
                        .map(|_| Done::Ended)
                        .map_err(|e| format!("refund {id}: {e}")),
                    Ending::ExtendThenSettle(more, usage) => store
                        .extend(id, Some(&more), Some(600_000))
                        .await
                        .map(|_| Done::Extended(id, usage))
                        .map_err(|e| format!("extend {id}: {e}")),
                    Ending::Expire => Err(format!("{id} was to expire, not end")),
                }
            });
        }
        for _ in 0..BATCH {
            if budget == 0 {
                break;
            }
            budget -= 1;
            let (req, ending) = transaction(&catalog, next_txn)?;
            next_txn += 1;
            let store = store.clone();
            batch.spawn(async move {
                match store.reserve(&req).await {
                    Ok(g) if g.replayed => Err(format!("reserve {} answered a repeat", g.id)),
                    Ok(g) => Ok(Done::Reserved(g.id, ending)),
                    Err(e) => Err(format!("reserve: {e}")),
                }
            });
        }
        let mut ends = later;
        while let Some(done) = batch.join_next().await {
            written += 1;
            match done?? {
                Done::Reserved(_, Ending::Expire) | Done::Ended => {}
                Done::Reserved(id, ending) => ends.push((id, ending)),
                Done::Extended(id, usage) => ends.push((id, Ending::Settle(usage))),
            }
        }
        pending.push_back(ends);
        clock.advance_ms(step_ms * BATCH as u64);
        if written >= next_progress {
            next_progress += PROGRESS_EVERY_RECORDS;
            let secs = started.elapsed().as_secs_f64();
            println!(
                "  built {written} records in {secs:.1} s ({:.0} records/s), \
                 simulated {:.1} h, {} holds",
                written as f64 / secs,
                (clock_ms(&clock) - START_MS) as f64 / 3_600_000.0,
                store.with_ledger(|l| l.hold_count()).unwrap_or_default(),
            );
        }
    }
    let end = Timestamp::from_millis(clock_ms(&clock));
    store.close().await?;
    Ok(end)
}

fn clock_ms(clock: &ManualClock) -> u64 {
    clock.now().as_millis()
}

/// One timed open, as measured by a fresh process.
#[derive(Clone, Debug, Default)]
struct OpenRun {
    /// The child's process id (to pick its samples out of a profile).
    pid: u32,
    replayed: u64,
    snapshot_lsn: u64,
    wall_s: f64,
    /// Time the open reported itself (`OpenReport::elapsed`).
    report_s: f64,
    /// User + system CPU of the whole process during the open.
    cpu_s: f64,
    rss_before_kib: u64,
    rss_after_kib: u64,
    hwm_kib: u64,
    expired_at_start: u64,
    divergences: usize,
}

/// A field of `/proc/self/status` in KiB (Linux), 0 elsewhere.
fn proc_status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// The process's user + system CPU seconds, from `/proc/self/stat` (clock
/// ticks of 10 ms, Linux's `USER_HZ`), 0 elsewhere.
fn process_cpu_s() -> f64 {
    let ticks = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // Fields after the command name, which may hold spaces: the
            // 14th and 15th of the line (utime, stime) are the 12th and
            // 13th after it.
            let rest = s.rsplit_once(')')?.1;
            let mut f = rest.split_whitespace().skip(11);
            let user: u64 = f.next()?.parse().ok()?;
            let system: u64 = f.next()?.parse().ok()?;
            Some(user + system)
        })
        .unwrap_or(0);
    ticks as f64 / 100.0
}

/// The child's side: open `dir` once, print the figures on one line.
fn child(dir: &Path, now_ms: u64) -> BenchResult<()> {
    let rt = runtime()?;
    let rss_before_kib = proc_status_kib("VmRSS");
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(now_ms)));
    let catalog = catalog()?;
    let cpu_before = process_cpu_s();
    let started = Instant::now();
    let (store, report): (DurableStore, OpenReport) = rt.block_on(DurableStore::open(
        catalog,
        options(dir),
        Arc::new(RealFs),
        clock,
        Arc::new(SeededIds::new(8)),
        |_| {},
    ))?;
    let wall_s = started.elapsed().as_secs_f64();
    let cpu_s = process_cpu_s() - cpu_before;
    let run = OpenRun {
        pid: std::process::id(),
        replayed: report.replayed,
        snapshot_lsn: report.snapshot_lsn.unwrap_or(0),
        wall_s,
        report_s: report.elapsed.as_secs_f64(),
        cpu_s,
        rss_before_kib,
        rss_after_kib: proc_status_kib("VmRSS"),
        hwm_kib: proc_status_kib("VmHWM"),
        expired_at_start: report.expired_total,
        divergences: report.divergences.len(),
    };
    for d in &report.divergences {
        eprintln!("divergence: {d}");
    }
    println!(
        "pid={} replayed={} snapshot_lsn={} wall_s={} report_s={} cpu_s={} rss_before_kib={} \
         rss_after_kib={} hwm_kib={} expired_at_start={} divergences={}",
        run.pid,
        run.replayed,
        run.snapshot_lsn,
        run.wall_s,
        run.report_s,
        run.cpu_s,
        run.rss_before_kib,
        run.rss_after_kib,
        run.hwm_kib,
        run.expired_at_start,
        run.divergences,
    );
    rt.block_on(store.close())?;
    Ok(())
}

/// Runs one open of `dir` in a fresh process and reads its figures.
fn open_in_child(dir: &Path, now: Timestamp) -> BenchResult<OpenRun> {
    let out = Command::new(std::env::current_exe()?)
        .env("ALLOWANCE_RECOVERY_CHILD_DIR", dir)
        .env(
            "ALLOWANCE_RECOVERY_CHILD_NOW_MS",
            now.as_millis().to_string(),
        )
        .stderr(std::process::Stdio::inherit())
        .output()?;
    if !out.status.success() {
        return Err(format!("the open failed in the child: {}", out.status).into());
    }
    let text = String::from_utf8(out.stdout)?;
    let mut run = OpenRun::default();
    for pair in text.split_whitespace() {
        let Some((key, value)) = pair.split_once('=') else {
            continue;
        };
        match key {
            "pid" => run.pid = value.parse()?,
            "replayed" => run.replayed = value.parse()?,
            "snapshot_lsn" => run.snapshot_lsn = value.parse()?,
            "wall_s" => run.wall_s = value.parse()?,
            "report_s" => run.report_s = value.parse()?,
            "cpu_s" => run.cpu_s = value.parse()?,
            "rss_before_kib" => run.rss_before_kib = value.parse()?,
            "rss_after_kib" => run.rss_after_kib = value.parse()?,
            "hwm_kib" => run.hwm_kib = value.parse()?,
            "expired_at_start" => run.expired_at_start = value.parse()?,
            "divergences" => run.divergences = value.parse()?,
            _ => {}
        }
    }
    if run.divergences > 0 {
        return Err(format!("{} records did not replay as they ran", run.divergences).into());
    }
    Ok(run)
}

/// The log layer alone, as a yardstick: `Wal::open` (scan and checks)
/// plus a replay whose callback only looks at the bytes; records/s.
fn scan_log(dir: &Path) -> BenchResult<f64> {
    let started = Instant::now();
    let (wal, _) = Wal::open(options(dir).wal, Arc::new(RealFs))?;
    let mut bytes = 0usize;
    let records = wal.replay(0, |_, b| {
        bytes += b.len();
        Ok(())
    })?;
    let secs = started.elapsed().as_secs_f64();
    std::hint::black_box(bytes);
    wal.close()?;
    Ok(records as f64 / secs)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => 0.0,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Prints each run and the medians; returns the median wall seconds.
fn report_opens(what: &str, runs: &[OpenRun]) -> f64 {
    for (i, r) in runs.iter().enumerate() {
        let from = if r.snapshot_lsn > 0 {
            format!("snapshot at lsn {} + ", r.snapshot_lsn)
        } else {
            String::new()
        };
        let rate = if r.replayed > 0 {
            format!(" ({:.0} records/s)", r.replayed as f64 / r.wall_s)
        } else {
            String::new()
        };
        println!(
            "  {what} run {} (pid {}): {from}{} records replayed in {:.3} s wall{rate}; \
             open's own timer {:.3} s, CPU {:.2} s, RSS {:.0} → {:.0} MiB (peak {:.0} MiB); \
             {} expiries in all",
            i + 1,
            r.pid,
            r.replayed,
            r.wall_s,
            r.report_s,
            r.cpu_s,
            mib(r.rss_before_kib),
            mib(r.rss_after_kib),
            mib(r.hwm_kib),
            r.expired_at_start,
        );
    }
    let wall = median(runs.iter().map(|r| r.wall_s).collect());
    let cpu = median(runs.iter().map(|r| r.cpu_s).collect());
    let rate = median(runs.iter().map(|r| r.replayed as f64 / r.wall_s).collect());
    // CPU time is read in 10 ms ticks: never divide by a zero reading.
    let cpu_rate = median(
        runs.iter()
            .map(|r| r.replayed as f64 / r.cpu_s.max(0.01))
            .collect(),
    );
    let rss = median(runs.iter().map(|r| mib(r.rss_after_kib)).collect());
    let hwm = median(runs.iter().map(|r| mib(r.hwm_kib)).collect());
    // A start from a fresh snapshot replays nothing: no rate to give.
    let rates = if runs.iter().any(|r| r.replayed > 0) {
        format!(", {rate:.0} records/s wall ({cpu_rate:.0} per CPU-second)")
    } else {
        String::new()
    };
    println!(
        "  {what}, median of {}: {wall:.3} s to start ({cpu:.2} s CPU){rates}; \
         RSS after open {rss:.0} MiB, peak {hwm:.0} MiB",
        runs.len()
    );
    wall
}

/// Bytes of the files in `dir` whose names end with `suffix`.
fn bytes_of(dir: &Path, suffix: &str) -> BenchResult<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name().to_string_lossy().ends_with(suffix) {
            total += entry.metadata()?.len();
        }
    }
    Ok(total)
}

/// Removes the data dir however the benchmark ends, unless asked to keep it.
struct TempDir {
    path: PathBuf,
    keep: bool,
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if self.keep {
            println!("data dir kept: {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

fn main() -> BenchResult<()> {
    if let Some(dir) = std::env::var_os("ALLOWANCE_RECOVERY_CHILD_DIR") {
        let now_ms = env_u64("ALLOWANCE_RECOVERY_CHILD_NOW_MS", START_MS);
        return child(Path::new(&dir), now_ms);
    }
    // `cargo bench` passes `--bench`; `cargo test --benches` does not, and
    // then a small log checks that the benchmark still works, quickly.
    let benching = std::env::args().any(|a| a == "--bench");
    let (records, runs) = if benching {
        (BENCH_RECORDS, BENCH_RUNS)
    } else {
        (SMOKE_RECORDS, 1)
    };
    let records = env_u64("ALLOWANCE_RECOVERY_RECORDS", records).max(1);
    let runs = env_u64("ALLOWANCE_RECOVERY_RUNS", runs).max(1);
    let step_ms = env_u64("ALLOWANCE_RECOVERY_STEP_MS", 20);
    let base = std::env::var_os("ALLOWANCE_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = TempDir {
        path: base.join(format!("allowance-recovery-bench-{}", std::process::id())),
        keep: std::env::var_os("ALLOWANCE_RECOVERY_KEEP_DIR").is_some(),
    };
    let _ = std::fs::remove_dir_all(&dir.path);
    std::fs::create_dir_all(&dir.path)?;
    println!(
        "recovery benchmark: {records} records in {} ({runs} opens per case, {step_ms} ms per reservation)",
        dir.path.display()
    );

    // 1. Build the log.
    let rt = runtime()?;
    let started = Instant::now();
    let end = rt.block_on(build(&dir.path, records, step_ms))?;
    let log_bytes = bytes_of(&dir.path, ".wal")?;
    println!(
        "built {records} records in {:.1} s: {} bytes of log ({:.0} bytes a record), \
         {:.1} simulated hours",
        started.elapsed().as_secs_f64(),
        log_bytes,
        log_bytes as f64 / records as f64,
        (end.as_millis() - START_MS) as f64 / 3_600_000.0,
    );

    // 2. Start from the log alone, in fresh processes.
    println!("start from the log (fresh process; the log is in the page cache):");
    let mut from_log = Vec::new();
    for _ in 0..runs {
        let run = open_in_child(&dir.path, end)?;
        // The configuration record the log starts with, then every command.
        if run.replayed != records + 1 {
            return Err(format!(
                "replayed {} records, expected {} (the configuration + {records})",
                run.replayed,
                records + 1
            )
            .into());
        }
        from_log.push(run);
    }
    let log_wall = report_opens("from the log", &from_log);
    let mut scans = Vec::new();
    for _ in 0..runs {
        scans.push(scan_log(&dir.path)?);
    }
    println!(
        "  the log layer alone (Wal::open + replay, no decoding, in this process), \
         median of {runs}: {:.0} records/s",
        median(scans)
    );

    // 3. A snapshot, then start from it.
    println!("snapshot:");
    let (store, _) = rt.block_on(DurableStore::open(
        catalog()?,
        options(&dir.path),
        Arc::new(RealFs),
        Arc::new(ManualClock::new(end)),
        Arc::new(SeededIds::new(9)),
        |_| {},
    ))?;
    // While each snapshot is taken, a probe reads a tenant's status every
    // millisecond: its slowest answer is how long the snapshot stopped the
    // ledger (it copies the state under every shard lock).
    let probe_scope = catalog()?.scope_set("t0", &[])?.tenant().clone();
    let mut writes = Vec::new();
    let mut stalls = Vec::new();
    for i in 0..runs {
        let (lsn, secs, stall) = rt.block_on(async {
            let stop = Arc::new(AtomicBool::new(false));
            let probe = tokio::spawn({
                let (store, scope, stop) = (store.clone(), probe_scope.clone(), stop.clone());
                async move {
                    let mut worst = Duration::ZERO;
                    while !stop.load(Ordering::Relaxed) {
                        let asked = Instant::now();
                        let _ = store.status(&scope).await;
                        worst = worst.max(asked.elapsed());
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    worst
                }
            });
            let s = store.clone();
            let started = Instant::now();
            let lsn = tokio::task::spawn_blocking(move || s.snapshot_now()).await;
            let secs = started.elapsed().as_secs_f64();
            stop.store(true, Ordering::Relaxed);
            let stall = probe.await.unwrap_or_default();
            (lsn, secs, stall)
        });
        let lsn = lsn??;
        println!(
            "  snapshot {} at lsn {lsn} written in {secs:.3} s; the ledger answered \
             nothing for up to {:.3} s of it",
            i + 1,
            stall.as_secs_f64()
        );
        writes.push(secs);
        stalls.push(stall.as_secs_f64());
    }
    let snapshot_bytes = bytes_of(&dir.path, ".snap")?;
    rt.block_on(store.close())?;
    println!(
        "  snapshot: {snapshot_bytes} bytes ({:.1} MiB), median write {:.3} s, \
         median stall {:.3} s; log left after it: {} bytes",
        snapshot_bytes as f64 / (1024.0 * 1024.0),
        median(writes),
        median(stalls),
        bytes_of(&dir.path, ".wal")?,
    );
    println!("start from the snapshot (fresh process, files in the page cache):");
    let mut from_snapshot = Vec::new();
    for _ in 0..runs {
        from_snapshot.push(open_in_child(&dir.path, end)?);
    }
    let snap_wall = report_opens("from the snapshot", &from_snapshot);
    println!(
        "start from the snapshot ÷ from the log: {:.3} ({:.3} s vs {:.3} s)",
        snap_wall / log_wall,
        snap_wall,
        log_wall
    );
    Ok(())
}
