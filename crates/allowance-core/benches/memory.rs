//! Memory per scope at 1M scopes with history (issue 2's target: ≤ 400 bytes).
//!
//! Every live heap byte is counted by the `cap` crate's allocator wrapper
//! (a counting `#[global_allocator]` of our own would need `unsafe`, which
//! the workspace forbids in every target). 1M user scopes under 4 tenants
//! each get one reserve + settle, so every window has history: a used
//! sliding slice and two partly drained buckets. The tenants' plan is
//! unlimited so only the user scopes carry the 4-limit plan of the ledger
//! benchmark. Ended reservations are forgotten 1 ms after they end (the
//! clock advances 1 ms per 10,000 scopes), so the figure is the scopes'
//! memory, not the reservation log's, which is reported apart.
//!
//! Two figures: right after the last scope's settle, when every scope is
//! still within the engine's idle-scope grace (5 s: a scope that held
//! something keeps its holds' bookkeeping until the grace passes, so a
//! scope used again soon does not rebuild it), and **at rest**, 30 s
//! later, after `expire_due` has trimmed them — the steady state of a
//! scope with history, which the target is about. The buckets refill per
//! hour so that one settle's use is still visible then.
//!
//! Run: `cargo bench -p allowance-core --bench memory`
//! (`ALLOWANCE_BENCH_SCOPES=n` for another count).

#![allow(
    clippy::print_stdout,
    reason = "a benchmark's report is what it prints"
)]

use std::alloc::System;
use std::sync::Arc;

use allowance_core::{
    Amounts, Catalog, Dimension, Ledger, Limit, OverrunPolicy, Plan, ReservationId, ReserveRequest,
    Settings, Timestamp, Usage, Window,
};
use cap::Cap;

#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

const START_MS: u64 = 1_750_000_000_000;
/// When the scopes are measured at rest: well past the engine's idle-scope
/// grace (5 s), well before an hour bucket refills one request (60 s).
const AT_REST_AFTER_MS: u64 = 30_000;
const TENANTS: [&str; 4] = ["t0", "t1", "t2", "t3"];

/// The ledger benchmark's plan shape: requests and tokens buckets, a
/// 24-slice sliding cost window, a concurrency gauge. With hour buckets
/// (the scopes' part) one settle's use stays visible for tens of seconds,
/// past [`AT_REST_AFTER_MS`]; the reservation log's part, which reuses its
/// users every 2 s, needs minute buckets. A bucket's state is two words
/// whatever its period.
fn member_plan(bucket_period_ms: u64) -> Arc<Plan> {
    let bucket = Window::Bucket {
        period_ms: bucket_period_ms,
    };
    let day = Window::Sliding {
        period_ms: 86_400_000,
        slices: 24,
    };
    let limits = vec![
        Limit::new(Dimension::REQUESTS, 60, bucket.clone()).expect("valid limit"),
        Limit::new(Dimension::TOKENS, 60_000, bucket).expect("valid limit"),
        Limit::new(Dimension::COST_MICROS, 10_000_000_000, day).expect("valid limit"),
        Limit::new(Dimension::CONCURRENT, 100, Window::Concurrent).expect("valid limit"),
    ];
    Plan::new("member", limits, OverrunPolicy::ChargeActual).expect("valid plan")
}

fn ledger(ended_retention_ms: u64, bucket_period_ms: u64) -> Ledger {
    let settings = Settings {
        ended_retention_ms,
        ..Settings::default()
    };
    let mut c = Catalog::new(settings).expect("valid settings");
    c.set_plan(member_plan(bucket_period_ms));
    // The tenant kind keeps the default catalog's "no plan": unlimited.
    c.set_kind("user", Some("member"), false)
        .expect("valid kind");
    Ledger::new(c)
}

fn amounts() -> (Amounts, Usage) {
    let held = Amounts::new()
        .with(Dimension::TOKENS, 1_000)
        .with(Dimension::COST_MICROS, 2_000);
    let usage = Usage {
        amounts: Amounts::new()
            .with(Dimension::TOKENS, 700)
            .with(Dimension::COST_MICROS, 1_400),
        ..Usage::default()
    };
    (held, usage)
}

/// Resident set size, from /proc (0 where there is none).
fn rss_bytes() -> usize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<usize>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// Reserves and settles once on user `i` at `now_ms`.
fn touch(l: &mut Ledger, i: usize, now_ms: u64, held: &Amounts, usage: &Usage) {
    let user = format!("u{i}");
    let scopes = l
        .catalog()
        .scope_set(TENANTS[i % TENANTS.len()], &[("user", &user)])
        .expect("valid scopes");
    let req = ReserveRequest::new(scopes, held.clone());
    let now = Timestamp::from_millis(now_ms);
    let id = ReservationId(i as u128 + 1);
    l.reserve(now, id, &req).expect("granted");
    l.settle(now, id, usage).expect("settled");
}

fn main() {
    let n: usize = std::env::var("ALLOWANCE_BENCH_SCOPES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let (held, usage) = amounts();

    // 1. Scopes. The request (and so its scope names) is dropped after each
    //    pair, so the ledger's map holds the only copy of every name.
    let mut l = ledger(1, 3_600_000);
    let (bytes_before, rss_before) = (ALLOCATOR.allocated(), rss_bytes());
    for i in 0..n {
        touch(&mut l, i, START_MS + (i / 10_000) as u64, &held, &usage);
    }
    let end_ms = START_MS + (n / 10_000) as u64 + 2;
    l.expire_due(Timestamp::from_millis(end_ms));
    let scopes = l.scope_count();
    assert!(
        scopes >= n,
        "every scope with history is kept: {scopes} < {n}"
    );
    assert_eq!(
        l.reservation_count(),
        0,
        "ended reservations were forgotten"
    );
    println!(
        "scopes: {scopes} ({n} users with history under {} tenants)",
        TENANTS.len()
    );
    let report = |l: &Ledger, when: &str, target: &str| {
        let (bytes, rss) = (ALLOCATOR.allocated(), rss_bytes());
        let scopes = l.scope_count();
        println!("{when}:");
        println!(
            "  live heap bytes / scope:          {:.1}{target}",
            bytes.saturating_sub(bytes_before) as f64 / scopes as f64
        );
        println!(
            "  RSS growth / scope:               {:.1}  (malloc overhead and retained free memory included)",
            rss.saturating_sub(rss_before) as f64 / scopes as f64
        );
        println!(
            "  Ledger::scope_heap_bytes / scope: {:.1}  (names and state words, no map or GC queue)",
            l.scope_heap_bytes() as f64 / scopes as f64
        );
        l.scope_heap_bytes()
    };
    let within_grace = report(
        &l,
        "just after the last settle (every scope within the 5 s idle-scope grace)",
        "",
    );
    let end_ms = end_ms + AT_REST_AFTER_MS;
    l.expire_due(Timestamp::from_millis(end_ms));
    // The tenants (no plan, nothing in their windows) may go; no user may.
    assert!(
        l.scope_count() >= n,
        "every scope with history is kept at rest: {} < {n}",
        l.scope_count()
    );
    let at_rest = report(
        &l,
        &format!("at rest, {} s later", AT_REST_AFTER_MS / 1_000),
        "  (target <= 400)",
    );
    // Were the grace ever longer than the wait, "at rest" would quietly
    // measure the scopes within it again.
    assert!(
        at_rest < within_grace,
        "the idle scopes were not trimmed {AT_REST_AFTER_MS} ms after their last use: \
         raise AT_REST_AFTER_MS past the engine's idle-scope grace"
    );
    // Every window has history: the last user's limits all show use.
    let probe = l
        .catalog()
        .scope_set(
            TENANTS[(n - 1) % TENANTS.len()],
            &[("user", &format!("u{}", n - 1))],
        )
        .expect("valid scopes");
    let status = l.status(Timestamp::from_millis(end_ms), &probe.as_slice()[1]);
    let used: Vec<i64> = status.limits.iter().map(|s| s.used).collect();
    println!("last user's used per limit (requests, tokens, cost_micros, concurrent): {used:?}");
    assert!(used[..3].iter().all(|&u| u > 0), "history in every window");
    drop(l);

    // 2. For comparison: an ended reservation remembered for its retention
    //    (the default day), on 1,000 scopes.
    let m = n / 10;
    let mut l = ledger(Settings::default().ended_retention_ms, 60_000);
    for i in 0..1_000 {
        touch(&mut l, i, START_MS, &held, &usage);
    }
    let before = ALLOCATOR.allocated();
    for i in 1_000..1_000 + m {
        let user = format!("u{}", i % 1_000);
        let scopes = l
            .catalog()
            .scope_set(TENANTS[i % TENANTS.len()], &[("user", &user)])
            .expect("valid scopes");
        let req = ReserveRequest::new(scopes, held.clone());
        let now = Timestamp::from_millis(START_MS + (i / 1_000) as u64 * 2_000);
        let id = ReservationId(i as u128 + 1);
        l.reserve(now, id, &req).expect("granted");
        l.settle(now, id, &usage).expect("settled");
    }
    let per_record = ALLOCATOR.allocated().saturating_sub(before) as f64 / m as f64;
    println!(
        "live heap bytes / ended reservation remembered ({} of them): {per_record:.1}",
        l.reservation_count() - 1_000
    );
}
