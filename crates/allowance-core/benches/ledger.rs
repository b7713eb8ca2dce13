//! Reserve + settle throughput of the ledger (issue 2's targets).
//!
//! Every reservation names three scopes (tenant, user, agent) and every
//! scope's plan has four limits: a `requests` bucket, a `tokens` bucket, a
//! 24-slice sliding `cost_micros` window and a `concurrent` gauge. Time is a
//! manual clock (a `Timestamp` advanced by 1 ms per pair, so buckets refill
//! and sliding slices roll), users and agents rotate over 1,000 of each so no
//! scope but the tenant is hot, and one prebuilt request per (user, agent)
//! is reused (its scopes are reference counted), as is one `Usage`.
//!
//! - `single_thread/*` — one reserve + settle pair per iteration on
//!   [`SharedLedger`] (64 shards), on the same core behind one global
//!   `parking_lot::Mutex<Ledger>`, and on `governor`'s keyed limiter
//!   (`check_key`: one key, and one per scope), a floor that does far less.
//! - `threads/*` — pairs per second with 1 and 2 threads (disjoint tenants
//!   in different shards, or one hot tenant), each thread doing `iters`
//!   pairs; throughput is `threads · iters / wall time`.
//!
//! After criterion's report comes each benchmark's CPU time per pair and
//! the share of time its threads waited for a CPU: on a shared machine the
//! wall time also counts the time other processes had the core.
//! Ended reservations are remembered for 60 s of simulated time
//! (`ALLOWANCE_BENCH_RETENTION_MS` for another retention).
//!
//! Run: `cargo bench -p allowance-core --bench ledger` (criterion's
//! filters work: `-- single_thread`). Without criterion:
//! `ALLOWANCE_BENCH_MODE=paired` measures the target ratios as paired
//! rounds run back to back (robust to a load that comes and goes), and
//! `ALLOWANCE_BENCH_MODE=shared|mutex ALLOWANCE_BENCH_PAIRS=n` runs n
//! single-thread pairs for a profiler (`valgrind --tool=callgrind`, `perf`).

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use allowance_core::{
    Amounts, Catalog, Dimension, Ledger, Limit, OverrunPolicy, Plan, ReservationId, ReserveRequest,
    Settings, SharedLedger, Timestamp, Usage, Window,
};
use criterion::{Criterion, Throughput, criterion_group};
use governor::clock::FakeRelativeClock;
use governor::{Quota, RateLimiter};
use parking_lot::Mutex;

/// Users (and agents) each thread rotates over.
const ROTATION: usize = 1000;
/// Shards of the shared ledger: a few times the cores, as its docs advise.
const SHARDS: usize = 64;
/// A realistic start (2025), so calendar-like arithmetic sees real magnitudes.
const START_MS: u64 = 1_750_000_000_000;

/// One plan of the benchmark's shape: four limits, capacities high enough
/// that no pair is ever refused (a refusal would measure another path).
fn plan(
    name: &str,
    requests_per_min: u64,
    tokens_per_min: u64,
    cost_micros_per_day: u64,
    concurrent: u64,
) -> Arc<Plan> {
    let minute = Window::Bucket { period_ms: 60_000 };
    let day = Window::Sliding {
        period_ms: 86_400_000,
        slices: 24,
    };
    let limits = vec![
        Limit::new(Dimension::REQUESTS, requests_per_min, minute.clone()).expect("valid limit"),
        Limit::new(Dimension::TOKENS, tokens_per_min, minute).expect("valid limit"),
        Limit::new(Dimension::COST_MICROS, cost_micros_per_day, day).expect("valid limit"),
        Limit::new(Dimension::CONCURRENT, concurrent, Window::Concurrent).expect("valid limit"),
    ];
    Plan::new(name, limits, OverrunPolicy::ChargeActual).expect("valid plan")
}

/// The catalog every ledger of this benchmark is built from.
fn catalog() -> Catalog {
    // Ended reservations are remembered for a minute of simulated time (the
    // default is a day): at 1 ms per pair that keeps ~60k records per ledger,
    // a steady state well past the caches, instead of a map that grows for
    // the whole run (a day at 4M pairs/s would be billions of records).
    // `ALLOWANCE_BENCH_RETENTION_MS` sets another retention, to see what
    // the reservation log costs.
    let ended_retention_ms = std::env::var("ALLOWANCE_BENCH_RETENTION_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60_000);
    let settings = Settings {
        ended_retention_ms,
        ..Settings::default()
    };
    let mut c = Catalog::new(settings).expect("valid settings");
    c.set_plan(plan(
        "org",
        10_000_000,
        10_000_000_000,
        10_000_000_000_000,
        10_000,
    ));
    c.set_plan(plan("member", 6_000, 10_000_000, 10_000_000_000, 100));
    c.set_kind("tenant", Some("org"), false)
        .expect("valid kind");
    c.set_kind("user", Some("member"), false)
        .expect("valid kind");
    c.set_kind("agent", Some("member"), false)
        .expect("valid kind");
    c
}

/// Two tenant names whose shards differ in a ledger of [`SHARDS`] shards.
fn disjoint_tenants() -> [String; 2] {
    let shard = |t: &str| usize::from(ReservationId::tenant_tag(t)) % SHARDS;
    let first = "t0".to_string();
    let second = (1..)
        .map(|k| format!("t{k}"))
        .find(|t| shard(t) != shard(&first))
        .expect("some tenant lands in another shard");
    [first, second]
}

/// SplitMix64: turns a counter into the random half of an id.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One thread's workload: its tenant, its prebuilt requests, its manual
/// clock and id counter (both carried over between criterion's calls).
/// Aligned so two threads' counters never share a cache line.
#[repr(align(128))]
struct Driver {
    requests: Vec<ReserveRequest>,
    usage: Usage,
    tag: u8,
    thread: u64,
    count: u64,
    now_ms: u64,
}

impl Driver {
    /// Requests for `tenant` over users and agents `first..first + ROTATION`.
    fn new(catalog: &Catalog, tenant: &str, thread: u64, first: usize) -> Driver {
        let amounts = Amounts::new()
            .with(Dimension::TOKENS, 1_000)
            .with(Dimension::COST_MICROS, 2_000);
        let requests = (first..first + ROTATION)
            .map(|i| {
                let (user, agent) = (format!("u{i}"), format!("a{i}"));
                let scopes = catalog
                    .scope_set(tenant, &[("user", &user), ("agent", &agent)])
                    .expect("valid scopes");
                ReserveRequest::new(scopes, amounts.clone())
            })
            .collect();
        Driver {
            requests,
            usage: Usage {
                amounts: Amounts::new()
                    .with(Dimension::TOKENS, 700)
                    .with(Dimension::COST_MICROS, 1_400),
                ..Usage::default()
            },
            tag: ReservationId::tenant_tag(tenant),
            thread,
            count: 0,
            now_ms: START_MS,
        }
    }

    /// The next pair's instant, id and request index. Ids are what
    /// `ReservationId::mint` makes (the tenant's tag in the low 8 bits),
    /// unique per thread and counter.
    fn next(&mut self) -> (Timestamp, ReservationId, usize) {
        let c = self.count;
        self.count += 1;
        self.now_ms += 1;
        let random = (u128::from(mix64(c ^ (self.thread << 56))) << 64)
            | (u128::from(c) << 16)
            | (u128::from(self.thread) << 8);
        let id = ReservationId(random | u128::from(self.tag));
        let i = (c % ROTATION as u64) as usize;
        (Timestamp::from_millis(self.now_ms), id, i)
    }
}

/// A ledger the benchmark can drive a pair on.
trait Pairs: Sync {
    fn pair(&self, d: &mut Driver);
}

impl Pairs for SharedLedger {
    fn pair(&self, d: &mut Driver) {
        let (now, id, i) = d.next();
        let granted = self.reserve(now, id, &d.requests[i]).expect("granted");
        black_box(granted);
        let settled = self.settle(now, id, &d.usage).expect("settled");
        black_box(settled);
    }
}

impl Pairs for Mutex<Ledger> {
    fn pair(&self, d: &mut Driver) {
        let (now, id, i) = d.next();
        let granted = self
            .lock()
            .reserve(now, id, &d.requests[i])
            .expect("granted");
        black_box(granted);
        let mut l = self.lock();
        black_box(l.settle(now, id, &d.usage).expect("settled"));
    }
}

/// The calling thread's (time on a CPU, time waiting for one) in ns, from
/// the kernel's scheduler statistics; `None` where there are none. The
/// kernel brings them up to date at scheduler ticks, so one reading may lag
/// by up to a tick: unbiased, and negligible summed over many samples.
fn thread_times() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let mut it = s.split_whitespace().map(|v| v.parse::<u64>().ok());
    Some((it.next()??, it.next()??))
}

/// What a benchmark's threads spent, beside criterion's wall time: on a
/// shared machine the wall time counts the time other processes had the
/// core, the CPU time does not, and the run-queue wait says how much that was.
#[derive(Default)]
struct Tally {
    pairs: u64,
    cpu_ns: u64,
    wait_ns: u64,
    thread_wall_ns: u64,
}

/// Tallies per benchmark, printed after criterion's report.
static TALLIES: Mutex<Vec<(String, Tally)>> = Mutex::new(Vec::new());

fn tally(name: &str, pairs: u64, cpu_ns: u64, wait_ns: u64, thread_wall_ns: u64) {
    let mut all = TALLIES.lock();
    let i = match all.iter().position(|(n, _)| n == name) {
        Some(i) => i,
        None => {
            all.push((name.to_string(), Tally::default()));
            all.len() - 1
        }
    };
    let t = &mut all[i].1;
    t.pairs += pairs;
    t.cpu_ns += cpu_ns;
    t.wait_ns += wait_ns;
    t.thread_wall_ns += thread_wall_ns;
}

#[allow(
    clippy::print_stdout,
    reason = "the CPU-time table is part of the benchmark's report"
)]
fn print_tallies() {
    println!("\nCPU time per pair (warm-up included), beside criterion's wall time:");
    println!(
        "{:<44} {:>14} {:>16}",
        "benchmark", "cpu ns/pair", "run-queue wait"
    );
    for (name, t) in TALLIES.lock().iter() {
        if t.pairs == 0 || t.thread_wall_ns == 0 {
            continue;
        }
        println!(
            "{name:<44} {:>14.1} {:>15.1}%",
            t.cpu_ns as f64 / t.pairs as f64,
            100.0 * t.wait_ns as f64 / t.thread_wall_ns as f64
        );
    }
}

#[allow(
    clippy::disallowed_methods,
    reason = "the benchmark harness measures wall time; the engine still reads no clock"
)]
fn wall_now() -> Instant {
    Instant::now()
}

/// Runs `iters` of `f` on this thread; answers the wall time, and tallies
/// the CPU time under `name`.
fn timed(name: &str, iters: u64, mut f: impl FnMut()) -> Duration {
    let t0 = thread_times();
    let start = wall_now();
    for _ in 0..iters {
        f();
    }
    let wall = start.elapsed();
    if let (Some((c0, w0)), Some((c1, w1))) = (t0, thread_times()) {
        tally(name, iters, c1 - c0, w1 - w0, wall.as_nanos() as u64);
    }
    wall
}

fn single_thread(c: &mut Criterion) {
    let mut g = c.benchmark_group("single_thread");
    g.throughput(Throughput::Elements(1));
    let [tenant, _] = disjoint_tenants();

    let shared = SharedLedger::new(catalog(), SHARDS);
    let mut d = Driver::new(&shared.catalog(), &tenant, 0, 0);
    let name = "single_thread/shared_ledger_64_shards";
    g.bench_function("shared_ledger_64_shards", |b| {
        b.iter_custom(|iters| timed(name, iters, || shared.pair(&mut d)))
    });
    drop(shared);

    let global = Mutex::new(Ledger::new(catalog()));
    let mut d = Driver::new(global.lock().catalog(), &tenant, 0, 0);
    let name = "single_thread/global_mutex_ledger";
    g.bench_function("global_mutex_ledger", |b| {
        b.iter_custom(|iters| timed(name, iters, || global.pair(&mut d)))
    });
    drop(global);

    // governor: a GCRA cell per key in a DashMap, on a fake clock advanced
    // by 1 ms per check, keys rotating like the users above.
    let per_min = |n: u32| Quota::per_minute(NonZeroU32::new(n).expect("non-zero"));
    let clock = FakeRelativeClock::default();
    let users = RateLimiter::dashmap_with_clock(per_min(6_000), clock.clone());
    let mut k = 0u32;
    let name = "single_thread/governor_check_key";
    g.bench_function("governor_check_key", |b| {
        b.iter_custom(|iters| {
            timed(name, iters, || {
                clock.advance(Duration::from_millis(1));
                k = (k + 1) % ROTATION as u32;
                black_box(users.check_key(&k).is_ok());
            })
        })
    });
    let tenants = RateLimiter::dashmap_with_clock(per_min(10_000_000), clock.clone());
    let agents = RateLimiter::dashmap_with_clock(per_min(6_000), clock.clone());
    let name = "single_thread/governor_check_key_x3";
    g.bench_function("governor_check_key_x3", |b| {
        b.iter_custom(|iters| {
            timed(name, iters, || {
                clock.advance(Duration::from_millis(1));
                k = (k + 1) % ROTATION as u32;
                black_box(tenants.check_key(&0u32).is_ok());
                black_box(users.check_key(&k).is_ok());
                black_box(agents.check_key(&k).is_ok());
            })
        })
    });
    g.finish();
}

/// Runs `iters` pairs on each driver, one thread each, all released at once
/// by a barrier; answers the wall time from the release to the last join
/// and the share of it the threads spent waiting for a CPU, and tallies
/// the threads' CPU time under `name`.
fn run_threads<L: Pairs>(
    name: &str,
    ledger: &L,
    drivers: &mut [Driver],
    iters: u64,
) -> (Duration, f64) {
    let barrier = Barrier::new(drivers.len() + 1);
    let (wall, per_thread) = std::thread::scope(|s| {
        let handles: Vec<_> = drivers
            .iter_mut()
            .map(|d| {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    let t0 = thread_times();
                    for _ in 0..iters {
                        ledger.pair(d);
                    }
                    t0.zip(thread_times())
                })
            })
            .collect();
        barrier.wait();
        let start = wall_now();
        let per_thread: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().expect("a benchmark thread panicked"))
            .collect();
        (start.elapsed(), per_thread)
    });
    let threads = drivers.len() as f64;
    let mut waited_ns = 0;
    for ((c0, w0), (c1, w1)) in per_thread.into_iter().flatten() {
        tally(name, iters, c1 - c0, w1 - w0, wall.as_nanos() as u64);
        waited_ns += w1 - w0;
    }
    (wall, waited_ns as f64 / (threads * wall.as_nanos() as f64))
}

/// One `threads/{name}` benchmark: `drivers.len()` threads on `ledger`.
fn bench_threads<L: Pairs>(c: &mut Criterion, name: &str, ledger: &L, mut drivers: Vec<Driver>) {
    let mut g = c.benchmark_group("threads");
    g.throughput(Throughput::Elements(drivers.len() as u64));
    let full = format!("threads/{name}");
    g.bench_function(name, |b| {
        b.iter_custom(|iters| run_threads(&full, ledger, &mut drivers, iters).0)
    });
    g.finish();
}

fn threads(c: &mut Criterion) {
    let [a, b] = disjoint_tenants();
    {
        let l = SharedLedger::new(catalog(), SHARDS);
        let cat = l.catalog();
        bench_threads(c, "shared/1_thread", &l, vec![Driver::new(&cat, &a, 0, 0)]);
    }
    {
        let l = SharedLedger::new(catalog(), SHARDS);
        let cat = l.catalog();
        let ds = vec![Driver::new(&cat, &a, 0, 0), Driver::new(&cat, &b, 1, 0)];
        bench_threads(c, "shared/2_threads_disjoint_tenants", &l, ds);
    }
    {
        // One tenant, each thread with its own users and agents: only the
        // tenant scope (and its shard's lock) is shared.
        let l = SharedLedger::new(catalog(), SHARDS);
        let cat = l.catalog();
        let ds = vec![
            Driver::new(&cat, &a, 0, 0),
            Driver::new(&cat, &a, 1, ROTATION),
        ];
        bench_threads(c, "shared/2_threads_hot_tenant", &l, ds);
    }
    {
        let l = Mutex::new(Ledger::new(catalog()));
        let cat = l.lock().catalog().clone();
        bench_threads(c, "mutex/1_thread", &l, vec![Driver::new(&cat, &a, 0, 0)]);
    }
    {
        let l = Mutex::new(Ledger::new(catalog()));
        let cat = l.lock().catalog().clone();
        let ds = vec![Driver::new(&cat, &a, 0, 0), Driver::new(&cat, &b, 1, 0)];
        bench_threads(c, "mutex/2_threads_disjoint_tenants", &l, ds);
    }
}

/// Profile mode (`ALLOWANCE_BENCH_MODE=shared|mutex`,
/// `ALLOWANCE_BENCH_PAIRS=n`): n single-thread pairs in a plain loop, no
/// criterion, for `perf record` or `valgrind --tool=callgrind`. Two runs
/// with different n give the per-pair cost without the setup's.
fn profile(which: &str, pairs: u64) {
    let [tenant, _] = disjoint_tenants();
    match which {
        "shared" => {
            let l = SharedLedger::new(catalog(), SHARDS);
            let mut d = Driver::new(&l.catalog(), &tenant, 0, 0);
            (0..pairs).for_each(|_| l.pair(&mut d));
        }
        "mutex" => {
            let l = Mutex::new(Ledger::new(catalog()));
            let mut d = Driver::new(l.lock().catalog(), &tenant, 0, 0);
            (0..pairs).for_each(|_| l.pair(&mut d));
        }
        other => panic!("ALLOWANCE_BENCH_MODE={other}: expected shared, mutex or paired"),
    }
}

/// Pairs per second of one round (`pairs` pairs on each driver's thread),
/// and the share of it the threads waited for a CPU.
fn round<L: Pairs>(ledger: &L, drivers: &mut [Driver], pairs: u64) -> (f64, f64) {
    let (wall, waited) = run_threads("paired", ledger, drivers, pairs);
    let rate = (drivers.len() as u64 * pairs) as f64 / wall.as_secs_f64();
    (rate, waited)
}

/// Rounds whose threads waited longer than this share of their time for a
/// CPU ran on a machine busy with other work, and are left out.
const MAX_WAIT_SHARE: f64 = 0.05;

/// The median, min and max of `v`.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// Paired mode (`ALLOWANCE_BENCH_MODE=paired`, `ALLOWANCE_BENCH_ROUNDS=r`,
/// `ALLOWANCE_BENCH_PAIRS=n` per thread and round, `ALLOWANCE_BENCH_VERBOSE=1`
/// to print every round): the ratios of the
/// targets, each measured as a ratio of two rounds run back to back and
/// repeated r times. A load that comes and goes on a shared machine moves
/// both rounds of a ratio alike, where separate criterion benchmarks a
/// minute apart see different loads; a group of rounds in which any thread
/// waited for a CPU more than [`MAX_WAIT_SHARE`] of the time is dropped.
#[allow(
    clippy::print_stdout,
    reason = "the paired ratios are this mode's report"
)]
fn paired(rounds: usize, pairs: u64, verbose: bool) {
    let [a, b] = disjoint_tenants();
    let shared = SharedLedger::new(catalog(), SHARDS);
    let global = Mutex::new(Ledger::new(catalog()));
    let cat = shared.catalog();
    // Drivers: tenant a, tenant b, and tenant a again with other users.
    let mut sd = [
        Driver::new(&cat, &a, 0, 0),
        Driver::new(&cat, &b, 1, 0),
        Driver::new(&cat, &a, 2, ROTATION),
    ];
    let mut md = [Driver::new(&cat, &a, 0, 0), Driver::new(&cat, &b, 1, 0)];
    let (mut cost, mut scale, mut hot, mut mscale) = (vec![], vec![], vec![], vec![]);
    let (mut s1s, mut s2s, mut shs, mut m1s, mut m2s) = (vec![], vec![], vec![], vec![], vec![]);
    let mut dropped = 0;
    for r in 0..=rounds {
        let (s1, w1) = round(&shared, &mut sd[..1], pairs);
        let (m1, w2) = round(&global, &mut md[..1], pairs);
        let (s2, w3) = round(&shared, &mut sd[..2], pairs);
        sd.swap(1, 2);
        let (sh, w4) = round(&shared, &mut sd[..2], pairs);
        sd.swap(1, 2);
        let (m2, w5) = round(&global, &mut md[..2], pairs);
        if r == 0 {
            continue; // warm-up: records fill up to their retention
        }
        if verbose {
            println!(
                "round {r}: Kpairs/s shared 1 {:.0}, mutex 1 {:.0}, shared 2 {:.0}, \
                 shared hot {:.0}, mutex 2 {:.0}; max wait {:.1}%",
                s1 / 1e3,
                m1 / 1e3,
                s2 / 1e3,
                sh / 1e3,
                m2 / 1e3,
                100.0 * [w1, w2, w3, w4, w5].into_iter().fold(0.0, f64::max)
            );
        }
        if [w1, w2, w3, w4, w5].iter().any(|&w| w > MAX_WAIT_SHARE) {
            dropped += 1;
            continue;
        }
        cost.push(m1 / s1);
        scale.push(s2 / s1);
        hot.push(sh / s1);
        mscale.push(m2 / m1);
        s1s.push(s1 / 1e3);
        s2s.push(s2 / 1e3);
        shs.push(sh / 1e3);
        m1s.push(m1 / 1e3);
        m2s.push(m2 / 1e3);
    }
    println!(
        "{} of {rounds} rounds of {pairs} pairs per thread kept ({dropped} dropped: \
         the machine was busy); median (min - max)",
        rounds - dropped
    );
    if dropped == rounds {
        return;
    }
    let rows = [
        ("shared, 1 thread, Kpairs/s", s1s),
        ("shared, 2 threads disjoint tenants, Kpairs/s", s2s),
        ("shared, 2 threads hot tenant, Kpairs/s", shs),
        ("global mutex, 1 thread, Kpairs/s", m1s),
        ("global mutex, 2 threads disjoint, Kpairs/s", m2s),
        ("cost shared / global mutex, 1 thread", cost),
        ("scaling shared, 2 disjoint / 1", scale),
        ("scaling shared, 2 hot / 1", hot),
        ("scaling global mutex, 2 disjoint / 1", mscale),
    ];
    for (label, v) in rows {
        let (med, lo, hi) = spread(v);
        println!("{label:<46} {med:>9.3}  ({lo:.3} - {hi:.3})");
    }
}

criterion_group! {
    name = benches;
    // Fewer, shorter samples than criterion's default: the whole file runs
    // in about a minute on the shared 2-core machine.
    config = Criterion::default()
        .sample_size(40)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(4));
    targets = single_thread, threads
}
fn main() {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    match std::env::var("ALLOWANCE_BENCH_MODE").as_deref() {
        Ok("paired") => {
            let rounds = env("ALLOWANCE_BENCH_ROUNDS").unwrap_or(15).max(1) as usize;
            let pairs = env("ALLOWANCE_BENCH_PAIRS").unwrap_or(100_000);
            return paired(rounds, pairs, env("ALLOWANCE_BENCH_VERBOSE") == Some(1));
        }
        Ok(which) => return profile(which, env("ALLOWANCE_BENCH_PAIRS").unwrap_or(1_000_000)),
        Err(_) => {}
    }
    // What `criterion_main!` would expand to.
    benches();
    Criterion::default().configure_from_args().final_summary();
    print_tallies();
}
