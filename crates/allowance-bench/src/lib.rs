//! # allowance-bench — load on the allowance HTTP server, against a ceiling
//!
//! `allowance bench` measures reserve+settle pairs per second and their
//! latency over HTTP/1.1 keep-alive. A server can only be as fast as its HTTP
//! stack, so the same run also measures a **no-op** axum server
//! ([`noop_router`]) that parses the same JSON bodies on the same routes and
//! answers fixed JSON: the target is ≥ 80% of its throughput with a p99
//! within 1.5× of its p99 ([`compare`]).
//!
//! - **worker** — one keep-alive HTTP/1.1 connection doing its calls in sequence.
//! - **pair** — a reserve and its second call (settle, or refund); a denied
//!   reserve is an attempt with no second call.
//! - **denial** — a 429/402/422 answer: counted, never fatal.
//! - **error** — a transport failure, a timeout, a 5xx, or any other
//!   unexpected answer.
//! - **warm-up** — time spent before measuring, counted nowhere.
//! - **fan-out** — the `fanout` scenario (seed 003): sub-tasks started at
//!   once through the admission queue, judged against the ideal schedule of
//!   the tenant's plan ([`FanoutReport`]); `scripts/bench-queue.sh` runs it.
//! - **gateway** — the `gateway` scenario (issue 7): the latency the
//!   gateway adds over calling its upstream directly ([`gateway`]);
//!   `scripts/bench-gateway.sh` runs it.
//!
//! ```no_run
//! use allowance_bench::{BenchOptions, Scenario, compare, measure_ceiling, run};
//! use std::time::Duration;
//!
//! # async fn demo() -> Result<(), allowance_bench::BenchError> {
//! let opts = BenchOptions {
//!     scenario: Scenario::Pairs,
//!     duration: Duration::from_secs(10),
//!     ..BenchOptions::new("http://127.0.0.1:8787")
//! };
//! let target = run(&opts).await?;
//! let ceiling = measure_ceiling(&opts).await?;
//! eprintln!("{target}\n{}", compare(&target, &ceiling));
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_code)]

mod client;
mod error;
mod fanout;
pub mod gateway;
mod noop;
mod options;
mod progress;
mod report;
mod run;
mod worker;

pub use error::{BenchError, ParseScenarioError};
pub use fanout::{
    FANOUT_RATIO_TARGET, FanoutPlan, FanoutReport, IdealSchedule, Overhead, ScopeReading,
};
pub use gateway::{GatewayBenchOptions, GatewayReport, GatewayTarget, run_gateway};
pub use noop::{noop_router, serve_noop};
pub use options::{
    BenchOptions, DEFAULT_SERVER, FanoutOptions, MAX_CONCURRENCY, MAX_DURATION,
    MAX_OVERHEAD_ROUNDS, Progress, Scenario, TENANTS_SCENARIO_TENANTS,
};
pub use report::{Comparison, Latency, P99_TARGET_RATIO, Report, THROUGHPUT_TARGET_RATIO, compare};
pub use run::{measure_ceiling, run};
