//! What can stop a benchmark before it measures anything.
//!
//! Once the run has started, nothing the server does is fatal: failures are
//! counted in the [`Report`](crate::Report) instead.

/// Why [`run`](crate::run) could not measure.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// An option is out of range or malformed; `field` names it as the CLI
    /// does (`server`, `token`, `concurrency`, `duration`, `warmup`).
    #[error("invalid {field}: {reason}")]
    InvalidOption {
        /// The option at fault.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The server could not be reached at all before the run started.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// `host:port` as dialled.
        addr: String,
        /// The transport error.
        #[source]
        source: std::io::Error,
    },
    /// The server refused the benchmark's credentials (401 or 403): no
    /// pair could ever complete, so the run stops at the first refusal.
    #[error(
        "the server refused the reserve: {0} (give --token an admin token; the benchmark \
         reserves for its own tenants, bench-*)"
    )]
    Refused(String),
    /// A worker task ended abnormally (a bug in the harness, not the server).
    #[error("a bench worker failed: {0}")]
    Worker(String),
    /// The ceiling's no-op server could not be started.
    #[error("cannot start the no-op server: {0}")]
    Ceiling(#[source] std::io::Error),
    /// The `fanout` scenario could not set up its run: the tenant's plan
    /// lacks what the scenario measures against, the tenant is not fresh,
    /// or a setup call failed.
    #[error("fanout: {0}")]
    Setup(String),
}

/// A scenario name that is not one of `pairs`, `refund`, `contention`, `tenants`, `fanout`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown scenario {given:?}: expected one of pairs, refund, contention, tenants, fanout")]
pub struct ParseScenarioError {
    /// The name as given.
    pub given: String,
}
