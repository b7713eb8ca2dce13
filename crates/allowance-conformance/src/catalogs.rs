//! The catalogs the cases configure their stores with.
//!
//! [`standard`] — every window kind, on the kinds a deployment has:
//!
//! | kind | plan | limits |
//! | --- | --- | --- |
//! | `tenant` | `tenant` | tokens 100,000 / sliding hour (60 slices of 1 min); cost_micros 10,000,000 total; concurrent 8 |
//! | `user` | `user` | requests 60 / bucket of 1 min (one back per second) |
//! | `agent` | `agent` | tokens 20,000 / calendar day (UTC) |
//! | `task` | `task` | cost_micros 1,000,000 total (a per-run budget) |
//! | `tool` (shared) | `tool` | search_calls 100 / sliding minute (60 slices of 1 s) |
//!
//! and, for plan changes and overrides, `plus` (the tenant plan with tokens
//! 200,000, cost_micros 50,000,000, concurrent 16), `tenant-capped`
//! (`tenant` with `cap_at_estimate`) and `tenant-lenient` (`tenant` with
//! `allow_overrun(10)`). The model `gpt-4o` costs 2.50 / 1.25 (cached) /
//! 10.00 per million tokens. Holds last 5 minutes unless told otherwise.
//!
//! [`seed_000`] and [`race`] reproduce the figures of the design documents.

use std::sync::Arc;

use allowance_core::{
    CalendarUnit, Catalog, Dimension, Limit, ModelPrice, OverrunPolicy, Plan, Settings, Window,
    Zone,
};

/// Where every case's clock starts: 2026-01-01T00:00:00Z, on a day, hour,
/// minute and second boundary, so window arithmetic in the cases is plain.
pub const START_MS: u64 = 1_767_225_600_000;
/// One second.
pub const SECOND_MS: u64 = 1_000;
/// One minute.
pub const MINUTE_MS: u64 = 60 * SECOND_MS;
/// One hour.
pub const HOUR_MS: u64 = 60 * MINUTE_MS;
/// One day.
pub const DAY_MS: u64 = 24 * HOUR_MS;
/// The default TTL of a hold in every catalog here (the spec's 5 minutes).
pub const DEFAULT_TTL_MS: u64 = 5 * MINUTE_MS;

fn limit(dimension: Dimension, capacity: u64, window: Window) -> Limit {
    Limit::new(dimension, capacity, window).expect("the suite's limits are valid")
}

fn plan(name: &str, limits: Vec<Limit>, overrun: OverrunPolicy) -> Arc<Plan> {
    Plan::new(name, limits, overrun).expect("the suite's plans are valid")
}

fn sliding(period_ms: u64, slices: u32) -> Window {
    Window::Sliding { period_ms, slices }
}

fn tenant_limits(tokens: u64, cost_micros: u64, concurrent: u64) -> Vec<Limit> {
    vec![
        limit(Dimension::TOKENS, tokens, sliding(HOUR_MS, 60)),
        limit(Dimension::COST_MICROS, cost_micros, Window::Total),
        limit(Dimension::CONCURRENT, concurrent, Window::Concurrent),
    ]
}

/// The price table's one model: 2.50 / 1.25 / 10.00 per million tokens.
pub fn gpt_4o() -> ModelPrice {
    ModelPrice {
        input_micros_per_million: 2_500_000,
        cached_input_micros_per_million: 1_250_000,
        output_micros_per_million: 10_000_000,
        max_output_tokens: 16_384,
        tokenizer: "o200k_base".into(),
    }
}

/// The catalog most cases use (see the table above).
pub fn standard() -> Catalog {
    let mut c = Catalog::new(Settings {
        default_ttl_ms: DEFAULT_TTL_MS,
        ..Settings::default()
    })
    .expect("the suite's settings are valid");
    let search_calls = c
        .add_dimension("search_calls")
        .expect("a valid dimension name");
    let co = OverrunPolicy::ChargeActual;
    c.set_plan(plan("tenant", tenant_limits(100_000, 10_000_000, 8), co));
    c.set_plan(plan(
        "tenant-capped",
        tenant_limits(100_000, 10_000_000, 8),
        OverrunPolicy::CapAtEstimate,
    ));
    c.set_plan(plan(
        "tenant-lenient",
        tenant_limits(100_000, 10_000_000, 8),
        OverrunPolicy::AllowOverrun { percent: 10 },
    ));
    c.set_plan(plan("plus", tenant_limits(200_000, 50_000_000, 16), co));
    let minute_bucket = Window::Bucket {
        period_ms: MINUTE_MS,
    };
    c.set_plan(plan(
        "user",
        vec![limit(Dimension::REQUESTS, 60, minute_bucket)],
        co,
    ));
    let day = Window::Calendar {
        unit: CalendarUnit::Day,
        zone: Zone::utc(),
    };
    c.set_plan(plan(
        "agent",
        vec![limit(Dimension::TOKENS, 20_000, day)],
        co,
    ));
    c.set_plan(plan(
        "task",
        vec![limit(Dimension::COST_MICROS, 1_000_000, Window::Total)],
        co,
    ));
    c.set_plan(plan(
        "tool",
        vec![limit(search_calls, 100, sliding(MINUTE_MS, 60))],
        co,
    ));
    for kind in ["tenant", "user", "agent", "task"] {
        c.set_kind(kind, Some(kind), false)
            .expect("the plan exists");
    }
    c.set_kind("tool", Some("tool"), true)
        .expect("the plan exists");
    c.set_model("gpt-4o", gpt_4o()).expect("a valid model name");
    c
}

/// Seed 000: agents may use 1,000 tokens an hour, the tenant 1,500 (sliding
/// hour of 60 slices), holds of 5 minutes.
pub fn seed_000() -> Catalog {
    let mut c = Catalog::new(Settings {
        default_ttl_ms: DEFAULT_TTL_MS,
        ..Settings::default()
    })
    .expect("the suite's settings are valid");
    let hour = sliding(HOUR_MS, 60);
    let co = OverrunPolicy::ChargeActual;
    c.set_plan(plan(
        "tenant",
        vec![limit(Dimension::TOKENS, 1500, hour.clone())],
        co,
    ));
    c.set_plan(plan(
        "agent",
        vec![limit(Dimension::TOKENS, 1000, hour)],
        co,
    ));
    c.set_kind("tenant", Some("tenant"), false)
        .expect("the plan exists");
    c.set_kind("agent", Some("agent"), false)
        .expect("the plan exists");
    c
}

/// Seed 002: a user's daily cap of €20 (`cost_micros` 20,000,000 per
/// calendar day); the tenant has no limits of its own.
pub fn race() -> Catalog {
    let mut c = Catalog::new(Settings {
        default_ttl_ms: DEFAULT_TTL_MS,
        ..Settings::default()
    })
    .expect("the suite's settings are valid");
    let day = Window::Calendar {
        unit: CalendarUnit::Day,
        zone: Zone::utc(),
    };
    c.set_plan(plan(
        "daily",
        vec![limit(Dimension::COST_MICROS, 20_000_000, day)],
        OverrunPolicy::ChargeActual,
    ));
    c.set_kind("user", Some("daily"), false)
        .expect("the plan exists");
    c
}
