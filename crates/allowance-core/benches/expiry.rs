//! Cost of expiring n held reservations (SEMANTICS.md: O(log n) or better
//! per expired reservation, never a scan).
//!
//! For n = 10k, 100k and 1M: a fresh [`Ledger`] gets n reservations at one
//! instant, each on three scopes (its tenant, one of 1,000 users, one of
//! 1,000 agents, so a user holds up to n/1,000), with distinct pseudo-random
//! TTLs (1 s – 51 min) or all the same TTL (5 min); then the clock jumps past
//! them all and one `expire_due` is timed: every hold leaves the expiry heap
//! and its three scopes' holder heaps, every reservation becomes EXPIRED,
//! and the 2,001 scopes, now empty, are dropped. Reported: time per expiry,
//! the median of several runs (min and max beside it).
//!
//! Run: `cargo bench -p allowance-core --bench expiry`
//! (`ALLOWANCE_BENCH_EXPIRY_N=10000,100000` for other sizes,
//! `ALLOWANCE_BENCH_REPS=n` for another number of runs).

#![allow(
    clippy::print_stdout,
    reason = "a benchmark's report is what it prints"
)]

use std::sync::Arc;
use std::time::Duration;

use allowance_core::{
    Amounts, Catalog, Dimension, Ledger, Limit, OverrunPolicy, Plan, ReservationId, ReserveRequest,
    Timestamp, Window,
};

const START_MS: u64 = 1_750_000_000_000;
const USERS: usize = 1_000;

/// The ledger benchmark's plan shape, with room for a million holds.
fn plan(name: &str, scale: u64) -> Arc<Plan> {
    let minute = Window::Bucket { period_ms: 60_000 };
    let day = Window::Sliding {
        period_ms: 86_400_000,
        slices: 24,
    };
    let limits = vec![
        Limit::new(Dimension::REQUESTS, 10 * scale, minute.clone()).expect("valid limit"),
        Limit::new(Dimension::TOKENS, 10_000 * scale, minute).expect("valid limit"),
        Limit::new(Dimension::COST_MICROS, 10_000 * scale, day).expect("valid limit"),
        Limit::new(Dimension::CONCURRENT, 10 * scale, Window::Concurrent).expect("valid limit"),
    ];
    Plan::new(name, limits, OverrunPolicy::ChargeActual).expect("valid plan")
}

fn catalog() -> Catalog {
    let mut c = Catalog::default();
    c.set_plan(plan("org", 1_000_000));
    c.set_plan(plan("member", 1_000));
    c.set_kind("tenant", Some("org"), false)
        .expect("valid kind");
    c.set_kind("user", Some("member"), false)
        .expect("valid kind");
    c.set_kind("agent", Some("member"), false)
        .expect("valid kind");
    c
}

/// SplitMix64, for TTLs spread without pattern.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One run: n holds, then the timed `expire_due`.
fn run(n: usize, distinct_ttls: bool) -> Duration {
    let mut l = Ledger::new(catalog());
    let amounts = Amounts::new()
        .with(Dimension::TOKENS, 1_000)
        .with(Dimension::COST_MICROS, 2_000);
    let mut requests: Vec<ReserveRequest> = (0..USERS)
        .map(|i| {
            let (user, agent) = (format!("u{i}"), format!("a{i}"));
            let scopes = l
                .catalog()
                .scope_set("acme", &[("user", &user), ("agent", &agent)])
                .expect("valid scopes");
            ReserveRequest::new(scopes, amounts.clone())
        })
        .collect();
    let now = Timestamp::from_millis(START_MS);
    for i in 0..n {
        let req = &mut requests[i % USERS];
        req.ttl_ms = Some(if distinct_ttls {
            1_000 + mix64(i as u64) % 3_000_000
        } else {
            300_000
        });
        l.reserve(now, ReservationId(i as u128 + 1), req)
            .expect("granted");
    }
    assert_eq!(l.held_count(), n);
    let later = Timestamp::from_millis(START_MS + 3_600_001);
    #[allow(
        clippy::disallowed_methods,
        reason = "the benchmark measures wall time; the engine still reads no clock"
    )]
    let start = std::time::Instant::now();
    let expired = l.expire_due(later);
    let took = start.elapsed();
    assert_eq!(expired, n as u64, "every hold expired");
    assert_eq!(l.held_count(), 0);
    took
}

fn main() {
    let sizes: Vec<usize> = std::env::var("ALLOWANCE_BENCH_EXPIRY_N")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![10_000, 100_000, 1_000_000]);
    let reps: Option<usize> = std::env::var("ALLOWANCE_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok());
    println!(
        "{:>9}  {:<13}  {:>16}  {:>9}  {:>9}  runs",
        "n", "ttls", "median ns/expiry", "min", "max"
    );
    for &n in &sizes {
        for distinct in [true, false] {
            // Fewer runs at a million: each builds a million holds first.
            let r = reps.unwrap_or(if n >= 1_000_000 { 3 } else { 7 }).max(1);
            let mut per: Vec<f64> = (0..r)
                .map(|_| run(n, distinct).as_nanos() as f64 / n as f64)
                .collect();
            per.sort_by(f64::total_cmp);
            println!(
                "{n:>9}  {:<13}  {:>16.1}  {:>9.1}  {:>9.1}  {r}",
                if distinct { "distinct" } else { "all the same" },
                per[per.len() / 2],
                per[0],
                per[per.len() - 1],
            );
        }
    }
}
