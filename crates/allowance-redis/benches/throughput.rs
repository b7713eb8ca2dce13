//! The Redis store against Redis itself (the issue: "a reserve costs one
//! round trip; store-level reserve throughput ≥ 50% of the trivial
//! multi-key EVALSHA; p50 added latency over one Redis round trip ≤ 0.2 ms").
//!
//! One run starts its own `redis-server` (allowance-testkit: a free port of
//! 127.0.0.1, no persistence, never the Redis on 6379) and measures, one
//! after the other, each for `ALLOWANCE_BENCH_SECS` seconds (default 5)
//! after a warm-up of `ALLOWANCE_BENCH_WARMUP_MS` (default 500), with
//! `ALLOWANCE_BENCH_CONCURRENCY` tasks (default 64) that share one
//! multiplexed connection — one redis-rs `ConnectionManager` for a and b,
//! one [`RedisStore`] (which holds its own) for c and d:
//!
//! - a. `ping` — `PING`: one round trip, the reference.
//! - b. `evalsha` — [`TRIVIAL_LUA`] on [`K`] keys sharing one hash tag: a
//!   script call touching as many keys as a 3-scope reserve, doing nothing
//!   else (see [`K`] for the count).
//! - c. `reserve` — `RedisStore::reserve` of 1,000 tokens on 3 scopes
//!   (tenant, user, agent), each task on its own tenant, user and agent;
//!   every plan is one sliding-hour tokens limit of 10^15, so nothing is
//!   denied and holds (5 min) never expire during the run.
//! - d. `pair` — `reserve` then `settle` (700 tokens) of the same
//!   reservation; latency and rates are per pair.
//!
//! Then, unless `ALLOWANCE_BENCH_LATENCY_CONCURRENCY` is 0 or equal to the
//! concurrency, a, b and c again with that many tasks (default 1): at 64
//! in flight on one connection, a p50 is mostly queueing behind the other
//! 63, so the "added latency" target is read at concurrency 1.
//!
//! The database is flushed before each measurement. The store runs with
//! `clock: None` (the time is Redis' `TIME`) and [`SeededIds`].
//! `ALLOWANCE_BENCH_THREADS` sets the client's tokio worker threads
//! (default: the machine's cores, which the server shares).
//!
//! For each: operations/s, latency p50/p99 (hdrhistogram, ns resolution),
//! errors, and from the server's own counters over the measured window
//! (`INFO cpu commandstats`): round trips per operation (client commands —
//! every command the scripts never run), Redis commands per operation (the
//! scripts' commands included) and Redis CPU per operation; the client's
//! CPU per operation (`/proc/self/stat`, Linux only). Then the ratios and
//! one JSON line.
//!
//! Run: `cargo bench -p allowance-redis --bench throughput`
//! (or `scripts/bench-redis.sh`, which adds `redis-benchmark`'s figures).
//! Under `cargo test --benches` (no `--bench` argument) each measurement
//! lasts 0.3 s, as a check that it still works.

#![allow(
    clippy::print_stdout,
    reason = "a benchmark's report is what it prints"
)]

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use allowance_core::{
    Amounts, Catalog, Dimension, Limit, OverrunPolicy, Plan, ReserveRequest, SeededIds, Settings,
    Store, Usage, Window,
};
use allowance_redis::{RedisOptions, RedisStore};
use allowance_testkit::{RedisServer, redis_available};
use hdrhistogram::Histogram;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use serde_json::json;

/// Keys a 3-scope reserve touches, counted from `ledger.lua`'s reserve path
/// (`ops.reserve` with no idempotency key, nothing due to expire), where
/// B is the tenant group's key base and each scope has its own SB:
///
/// | # | key | commands |
/// | --- | --- | --- |
/// | 1 | `<prefix>cat` | LLEN (the catalog version check) |
/// | 2 | `B:x` (HELD by expiry) | ZRANGEBYSCORE (observe_tag), ZADD |
/// | 3 | `B:d` (ended, by forget time) | ZRANGEBYSCORE (observe_tag) |
/// | 4 | `B:r:<id>` (the record) | EXISTS, SET |
/// | 5–7 | `SB:h:<scope>` × 3 (holders) | ZRANGEBYSCORE (observe_scope), ZADD |
/// | 8–10 | `SB:s:<scope>` × 3 (scope blobs) | GET (load_scope), SET (store_scope) |
/// | 11 | `B:n` (counters) | HINCRBY |
///
/// 11 keys, 19 commands (and `TIME`). The trivial script touches each key
/// once: GET on the odd ones, SET on the even ones (6 GETs, 5 SETs).
const K: usize = 11;

/// The trivial script. `scripts/bench-redis.sh` loads the same text (keep
/// them identical, so they share a SHA1) and runs it with `redis-benchmark`.
const TRIVIAL_LUA: &str = "for i = 1, #KEYS do if i % 2 == 1 then redis.call('GET', KEYS[i]) else redis.call('SET', KEYS[i], ARGV[1]) end end return #KEYS";

/// The value the trivial script writes (about a scope blob's size); the
/// keys are prefilled with it, so its GETs read real values.
const VALUE_LEN: usize = 64;

/// Every plan's capacity: nothing is ever denied.
const CAPACITY: u64 = 1_000_000_000_000_000;

/// Tokens reserved, and settled.
const RESERVED: u64 = 1_000;
const SETTLED: u64 = 700;

/// Commands the scripts (ledger.lua, the trivial one) run; every other
/// command counted by Redis came from a client: a round trip.
const SCRIPT_COMMANDS: &[&str] = &[
    "time",
    "get",
    "set",
    "del",
    "exists",
    "zadd",
    "zrem",
    "zrange",
    "zrangebyscore",
    "hincrby",
    "llen",
    "rpush",
    "xadd",
    "publish",
];

/// Linux' USER_HZ: /proc's CPU times are in these ticks.
const USER_HZ: f64 = 100.0;

/// How one run is configured.
#[derive(Clone, Copy, Debug)]
struct Config {
    measure: Duration,
    warmup: Duration,
    concurrency: usize,
    latency_concurrency: usize,
    threads: usize,
}

fn env_f64(name: &str, default: f64) -> f64 {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}: expected a number, got {v:?}")),
        Err(_) => default,
    }
}

impl Config {
    fn from_env(benching: bool) -> Config {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let (secs, warmup_ms, concurrency) = if benching {
            (5.0, 500.0, 64.0)
        } else {
            (0.3, 100.0, 8.0)
        };
        Config {
            measure: Duration::from_secs_f64(env_f64("ALLOWANCE_BENCH_SECS", secs).max(0.05)),
            warmup: Duration::from_secs_f64(
                env_f64("ALLOWANCE_BENCH_WARMUP_MS", warmup_ms).max(0.0) / 1000.0,
            ),
            concurrency: env_f64("ALLOWANCE_BENCH_CONCURRENCY", concurrency).max(1.0) as usize,
            latency_concurrency: env_f64("ALLOWANCE_BENCH_LATENCY_CONCURRENCY", 1.0).max(0.0)
                as usize,
            threads: env_f64("ALLOWANCE_BENCH_THREADS", cores as f64).max(1.0) as usize,
        }
    }
}

/// The server's counters at one instant.
struct ServerStats {
    cpu_s: f64,
    calls: HashMap<String, u64>,
}

/// `INFO cpu commandstats`, read on a connection of its own.
async fn server_stats(port: u16) -> ServerStats {
    let info = tokio::task::spawn_blocking(move || {
        allowance_testkit::command(port, &["INFO", "cpu", "commandstats"])
    })
    .await
    .expect("the INFO task panicked")
    .expect("INFO cpu commandstats");
    let mut stats = ServerStats {
        cpu_s: 0.0,
        calls: HashMap::new(),
    };
    for line in info.lines().map(str::trim_end) {
        if let Some(v) = line
            .strip_prefix("used_cpu_user:")
            .or_else(|| line.strip_prefix("used_cpu_sys:"))
        {
            stats.cpu_s += v.parse::<f64>().unwrap_or(0.0);
        } else if let Some(rest) = line.strip_prefix("cmdstat_")
            && let Some((name, fields)) = rest.split_once(':')
        {
            let calls = fields
                .split(',')
                .find_map(|f| f.strip_prefix("calls="))
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            stats.calls.insert(name.to_string(), calls);
        }
    }
    stats
}

/// This process's CPU time (user + system), from `/proc/self/stat`.
fn client_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // "pid (comm) state ppid …": utime and stime are fields 14 and 15, the
    // 12th and 13th after the comm's closing parenthesis.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / USER_HZ)
}

/// One measurement's figures.
struct Measured {
    name: &'static str,
    concurrency: usize,
    ops: u64,
    secs: f64,
    errors: u64,
    first_error: Option<String>,
    latency_ns: Histogram<u64>,
    /// Client commands (round trips) per operation.
    round_trips: f64,
    /// Commands Redis ran per operation, the scripts' included.
    commands: f64,
    redis_cpu_us: f64,
    client_cpu_us: Option<f64>,
}

impl Measured {
    fn ops_per_s(&self) -> f64 {
        self.ops as f64 / self.secs
    }

    fn ms(&self, quantile: f64) -> f64 {
        self.latency_ns.value_at_quantile(quantile) as f64 / 1e6
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "name": self.name,
            "concurrency": self.concurrency,
            "ops": self.ops,
            "ops_per_s": round(self.ops_per_s(), 1),
            "p50_ms": round(self.ms(0.5), 4),
            "p99_ms": round(self.ms(0.99), 4),
            "errors": self.errors,
            "round_trips_per_op": round(self.round_trips, 3),
            "redis_commands_per_op": round(self.commands, 2),
            "redis_cpu_us_per_op": round(self.redis_cpu_us, 2),
            "client_cpu_us_per_op": self.client_cpu_us.map(|c| round(c, 2)),
        })
    }
}

fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

/// One task's share of a measurement.
struct TaskResult {
    ops: u64,
    errors: u64,
    first_error: Option<String>,
    latency_ns: Histogram<u64>,
}

fn histogram() -> Histogram<u64> {
    // 1 ns to 60 s, 3 significant digits.
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds")
}

/// Flushes the database, runs `setup` (a command, if not empty), then
/// `op(task)` in a loop on `concurrency` tasks for the warm-up and the
/// measured window; counts the operations that started and ended inside
/// the window.
async fn measure<F, Fut>(
    cfg: &Config,
    server: &RedisServer,
    name: &'static str,
    concurrency: usize,
    setup: Vec<String>,
    op: F,
) -> Measured
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), String>> + Send + 'static,
{
    let port = server.port();
    tokio::task::spawn_blocking(move || {
        allowance_testkit::command(port, &["FLUSHALL"]).expect("FLUSHALL");
        if !setup.is_empty() {
            let args: Vec<&str> = setup.iter().map(String::as_str).collect();
            allowance_testkit::command(port, &args).expect("the measurement's setup");
        }
    })
    .await
    .expect("the setup task panicked");
    let op = Arc::new(op);
    let start = Instant::now() + cfg.warmup;
    let end = start + cfg.measure;
    let tasks: Vec<_> = (0..concurrency)
        .map(|task| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut r = TaskResult {
                    ops: 0,
                    errors: 0,
                    first_error: None,
                    latency_ns: histogram(),
                };
                loop {
                    let t0 = Instant::now();
                    if t0 >= end {
                        break;
                    }
                    let outcome = op(task).await;
                    let t1 = Instant::now();
                    match outcome {
                        Ok(()) if t0 >= start && t1 <= end => {
                            r.ops += 1;
                            let ns = (t1 - t0).as_nanos().clamp(1, 60_000_000_000) as u64;
                            r.latency_ns
                                .record(ns)
                                .expect("within the histogram's bounds");
                        }
                        Ok(()) => {}
                        Err(e) => {
                            r.errors += 1;
                            r.first_error.get_or_insert(e);
                        }
                    }
                }
                r
            })
        })
        .collect();
    tokio::time::sleep_until(start.into()).await;
    let (before, cpu_before) = (server_stats(port).await, client_cpu_s());
    tokio::time::sleep_until(end.into()).await;
    let (after, cpu_after) = (server_stats(port).await, client_cpu_s());
    let mut m = Measured {
        name,
        concurrency,
        ops: 0,
        secs: cfg.measure.as_secs_f64(),
        errors: 0,
        first_error: None,
        latency_ns: histogram(),
        round_trips: 0.0,
        commands: 0.0,
        redis_cpu_us: 0.0,
        client_cpu_us: None,
    };
    for task in tasks {
        let r = task.await.expect("a benchmark task panicked");
        m.ops += r.ops;
        m.errors += r.errors;
        if m.first_error.is_none() {
            m.first_error = r.first_error;
        }
        m.latency_ns
            .add(&r.latency_ns)
            .expect("histograms of the same bounds");
    }
    let ops = m.ops.max(1) as f64;
    let (mut client, mut all) = (0u64, 0u64);
    for (cmd, &calls) in &after.calls {
        let delta = calls.saturating_sub(before.calls.get(cmd).copied().unwrap_or(0));
        if cmd == "info" {
            continue; // these snapshots
        }
        all += delta;
        if !SCRIPT_COMMANDS.contains(&cmd.as_str()) {
            client += delta;
        }
    }
    m.round_trips = client as f64 / ops;
    m.commands = all as f64 / ops;
    m.redis_cpu_us = (after.cpu_s - before.cpu_s) * 1e6 / ops;
    m.client_cpu_us = cpu_before.zip(cpu_after).map(|(b, a)| (a - b) * 1e6 / ops);
    m
}

/// Tenant, user and agent plans of one sliding-hour tokens limit each.
fn catalog() -> Catalog {
    let mut c = Catalog::new(Settings::default()).expect("default settings are valid");
    let hour = Window::Sliding {
        period_ms: 3_600_000,
        slices: 60,
    };
    for kind in ["tenant", "user", "agent"] {
        let limit = Limit::new(Dimension::TOKENS, CAPACITY, hour.clone()).expect("a valid limit");
        c.set_plan(
            Plan::new(kind, vec![limit], OverrunPolicy::ChargeActual).expect("a valid plan"),
        );
        c.set_kind(kind, Some(kind), false)
            .expect("the plan exists");
    }
    c
}

fn print_header() {
    println!(
        "{:<9} {:>5} {:>10} {:>9} {:>9} {:>7} {:>9} {:>9} {:>11} {:>12}",
        "",
        "conc",
        "ops/s",
        "p50 ms",
        "p99 ms",
        "errors",
        "rt/op",
        "cmds/op",
        "redis us/op",
        "client us/op"
    );
}

fn print_row(m: &Measured) {
    let client = m
        .client_cpu_us
        .map_or_else(|| "-".to_string(), |c| format!("{c:.1}"));
    println!(
        "{:<9} {:>5} {:>10.0} {:>9.3} {:>9.3} {:>7} {:>9.2} {:>9.1} {:>11.1} {:>12}",
        m.name,
        m.concurrency,
        m.ops_per_s(),
        m.ms(0.5),
        m.ms(0.99),
        m.errors,
        m.round_trips,
        m.commands,
        m.redis_cpu_us,
        client
    );
    if let Some(e) = &m.first_error {
        println!("          first error: {e}");
    }
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "NOT met" }
}

async fn run(cfg: Config, server: &RedisServer) {
    let url = server.url();
    let info = server.command(&["INFO", "server"]).expect("INFO server");
    let version = info
        .lines()
        .find_map(|l| l.trim_end().strip_prefix("redis_version:"))
        .unwrap_or("?")
        .to_string();

    let timeout = Duration::from_millis(RedisOptions::new("").timeout_ms);
    let client = redis::Client::open(url.as_str()).expect("a valid URL");
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout));
    let conn = ConnectionManager::new_with_config(client, config)
        .await
        .expect("connect to the benchmark's redis-server");
    let store = Arc::new(
        RedisStore::connect(
            RedisOptions::new(url.clone()),
            catalog(),
            None,
            Arc::new(SeededIds::new(0x5eed)),
        )
        .await
        .expect("connect the store"),
    );

    let script = Arc::new(redis::Script::new(TRIVIAL_LUA));
    let keys: Arc<Vec<String>> = Arc::new((1..=K).map(|i| format!("key{i}{{t}}")).collect());
    let value: Arc<String> = Arc::new("x".repeat(VALUE_LEN));

    // Every task's own tenant, user and agent.
    let max_tasks = cfg.concurrency.max(cfg.latency_concurrency);
    let catalog = store.catalog().await.expect("the store's catalog");
    let requests: Arc<Vec<ReserveRequest>> = Arc::new(
        (0..max_tasks)
            .map(|t| {
                let scopes = catalog
                    .scope_set(
                        &format!("bench-{t}"),
                        &[("user", &format!("u{t}")), ("agent", &format!("a{t}"))],
                    )
                    .expect("valid scopes");
                ReserveRequest::new(scopes, Amounts::new().with(Dimension::TOKENS, RESERVED))
            })
            .collect(),
    );
    let usage = Arc::new(Usage {
        amounts: Amounts::new().with(Dimension::TOKENS, SETTLED),
        ..Usage::default()
    });

    println!(
        "allowance-redis throughput: redis-server {version} on 127.0.0.1:{} (pid {}), \
         {:.1} s per measurement after {:.1} s warm-up, {} client threads",
        server.port(),
        server.pid(),
        cfg.measure.as_secs_f64(),
        cfg.warmup.as_secs_f64(),
        cfg.threads
    );
    println!(
        "trivial script: {K} keys key1{{t}}..key{K}{{t}} ({} GET, {} SET of {VALUE_LEN} bytes), sha1 {}",
        K.div_ceil(2),
        K / 2,
        script.get_hash()
    );
    println!(
        "reserve: {RESERVED} tokens on 3 scopes (tenant bench-N, user uN, agent aN; one tenant per task); \
         pair: reserve + settle {SETTLED}"
    );
    println!(
        "rt/op: client commands (round trips) per op; cmds/op: commands Redis ran per op, scripts' included;"
    );
    println!("redis/client us/op: CPU time per op of the server / this process");
    println!();
    print_header();

    let mut results: Vec<Measured> = Vec::new();
    let mut concurrencies = vec![cfg.concurrency];
    if cfg.latency_concurrency > 0 && cfg.latency_concurrency != cfg.concurrency {
        concurrencies.push(cfg.latency_concurrency);
    }
    for (round, &c) in concurrencies.iter().enumerate() {
        let conn_ = conn.clone();
        let ping = measure(&cfg, server, "ping", c, Vec::new(), move |_| {
            let mut conn = conn_.clone();
            async move {
                redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            }
        })
        .await;
        print_row(&ping);
        results.push(ping);

        let (conn_, script_, keys_, value_) =
            (conn.clone(), script.clone(), keys.clone(), value.clone());
        // The keys exist, so the GETs read a value.
        let mut mset = vec!["MSET".to_string()];
        for k in keys.iter() {
            mset.extend([k.clone(), value.to_string()]);
        }
        let evalsha = measure(&cfg, server, "evalsha", c, mset, move |_| {
            let (mut conn, script, keys, value) = (
                conn_.clone(),
                script_.clone(),
                keys_.clone(),
                value_.clone(),
            );
            async move {
                let mut inv = script.prepare_invoke();
                for k in keys.iter() {
                    inv.key(k);
                }
                inv.arg(value.as_str());
                match inv.invoke_async::<i64>(&mut conn).await {
                    Ok(n) if n == K as i64 => Ok(()),
                    Ok(n) => Err(format!("the trivial script answered {n}")),
                    Err(e) => Err(e.to_string()),
                }
            }
        })
        .await;
        print_row(&evalsha);
        results.push(evalsha);

        let (store_, requests_) = (store.clone(), requests.clone());
        let reserve = measure(&cfg, server, "reserve", c, Vec::new(), move |task| {
            let (store, requests) = (store_.clone(), requests_.clone());
            async move {
                store
                    .reserve(&requests[task])
                    .await
                    .map(drop)
                    .map_err(|e| format!("reserve: {e}"))
            }
        })
        .await;
        print_row(&reserve);
        results.push(reserve);

        if round == 0 {
            let (store_, requests_, usage_) = (store.clone(), requests.clone(), usage.clone());
            let pair = measure(&cfg, server, "pair", c, Vec::new(), move |task| {
                let (store, requests, usage) = (store_.clone(), requests_.clone(), usage_.clone());
                async move {
                    let granted = store
                        .reserve(&requests[task])
                        .await
                        .map_err(|e| format!("reserve: {e}"))?;
                    store
                        .settle(granted.id, &usage)
                        .await
                        .map(drop)
                        .map_err(|e| format!("settle: {e}"))
                }
            })
            .await;
            print_row(&pair);
            results.push(pair);
        }
    }

    let find = |name: &str, c: usize| {
        results
            .iter()
            .find(|m| m.name == name && m.concurrency == c)
            .expect("measured")
    };
    let c = cfg.concurrency;
    let (ping, evalsha, reserve) = (find("ping", c), find("evalsha", c), find("reserve", c));
    let throughput_ratio = reserve.ops_per_s() / evalsha.ops_per_s().max(f64::MIN_POSITIVE);
    let added = reserve.ms(0.5) - ping.ms(0.5);
    println!();
    println!("ratios");
    println!(
        "  reserve round trips (client commands per reserve, c={c})  {:>8.2}      target 1: {}",
        reserve.round_trips,
        verdict((reserve.round_trips - 1.0).abs() < 0.05)
    );
    println!(
        "  reserve ops/s / trivial EVALSHA ops/s (c={c})             {:>7.1}%      target >= 50%: {}",
        throughput_ratio * 100.0,
        verdict(throughput_ratio >= 0.5)
    );
    println!(
        "  reserve Redis CPU / trivial EVALSHA Redis CPU (c={c})     {:>8.2}x",
        reserve.redis_cpu_us / evalsha.redis_cpu_us.max(f64::MIN_POSITIVE)
    );
    println!(
        "  reserve p50 - PING p50 (c={c}, mostly queueing)            {:>8.3} ms",
        added
    );
    let mut added_json = serde_json::Map::new();
    added_json.insert(c.to_string(), json!(round(added, 4)));
    if concurrencies.len() > 1 {
        let l = cfg.latency_concurrency;
        let added_l = find("reserve", l).ms(0.5) - find("ping", l).ms(0.5);
        let ratio_l = find("reserve", l).ops_per_s() / find("evalsha", l).ops_per_s();
        println!(
            "  reserve p50 - PING p50 (c={l})                            {:>8.3} ms   target <= 0.2 ms: {}",
            added_l,
            verdict(added_l <= 0.2)
        );
        println!(
            "  reserve ops/s / trivial EVALSHA ops/s (c={l})              {:>7.1}%",
            ratio_l * 100.0
        );
        added_json.insert(l.to_string(), json!(round(added_l, 4)));
    }
    let doc = json!({
        "bench": "allowance-redis/throughput",
        "redis_version": version,
        "secs": cfg.measure.as_secs_f64(),
        "warmup_ms": cfg.warmup.as_millis() as u64,
        "concurrency": cfg.concurrency,
        "latency_concurrency": cfg.latency_concurrency,
        "threads": cfg.threads,
        "k": K,
        "trivial_sha1": script.get_hash(),
        "results": results.iter().map(Measured::json).collect::<Vec<_>>(),
        "reserve_round_trips": round(reserve.round_trips, 3),
        "reserve_vs_evalsha_throughput": round(throughput_ratio, 4),
        "added_p50_ms": added_json,
    });
    println!();
    println!("{doc}");
}

fn main() {
    let Some(()) = redis_available() else { return };
    // `cargo bench` passes `--bench`; `cargo test --benches` does not, and
    // then short measurements check that the benchmark still works.
    let benching = std::env::args().any(|a| a == "--bench");
    let cfg = Config::from_env(benching);
    let server = RedisServer::start();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.threads)
        .enable_all()
        .build()
        .expect("a tokio runtime")
        .block_on(run(cfg, &server));
}
