//! What to measure: the scenario, the target server and the load shape.

use std::fmt;
use std::io::IsTerminal;
use std::str::FromStr;
use std::time::Duration;

use crate::ParseScenarioError;

/// The server `allowance serve` listens on by default.
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:8787";

/// Upper bound on workers: each holds one TCP connection (and a file
/// descriptor on both ends), and 10 000 is far past what saturates a server.
pub const MAX_CONCURRENCY: usize = 10_000;

/// Upper bound on `duration` and `warmup`: a day is past any useful run, and
/// a bound keeps deadline arithmetic far from overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

/// How many tenants the `tenants` scenario cycles over: enough that the
/// server keeps thousands of scopes live, few enough to stay in memory.
pub const TENANTS_SCENARIO_TENANTS: usize = 10_000;

/// What each worker does in a loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scenario {
    /// Reserve on its own tenant `bench-<worker>`, then settle. The starter
    /// plan (20 concurrent holds per tenant) never denies it.
    Pairs,
    /// Reserve on its own tenant, then refund.
    Refund,
    /// Every worker reserves on one tenant `bench-hot`, then settles:
    /// denials are expected and counted.
    Contention,
    /// Reserve then settle, cycling over [`TENANTS_SCENARIO_TENANTS`]
    /// tenants `bench-t<k>` so the server sees many scopes.
    Tenants,
    /// Seed 003's fan-out through the admission queue: `tasks` sub-tasks
    /// start at once on one tenant, each reserving with `wait_ms` and
    /// settling after a simulated call; measured against the ideal
    /// schedule of the tenant's plan (see [`FanoutOptions`]). It ignores
    /// `duration`, `warmup` and `concurrency`.
    Fanout,
}

impl Scenario {
    /// Every scenario, in the order the CLI lists them.
    pub const ALL: [Scenario; 5] = [
        Scenario::Pairs,
        Scenario::Refund,
        Scenario::Contention,
        Scenario::Tenants,
        Scenario::Fanout,
    ];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Pairs => "pairs",
            Scenario::Refund => "refund",
            Scenario::Contention => "contention",
            Scenario::Tenants => "tenants",
            Scenario::Fanout => "fanout",
        }
    }

    /// The call that ends a pair: `settle` or `refund`.
    pub fn second_call(self) -> &'static str {
        match self {
            Scenario::Refund => "refund",
            Scenario::Pairs | Scenario::Contention | Scenario::Tenants | Scenario::Fanout => {
                "settle"
            }
        }
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Scenario {
    type Err = ParseScenarioError;

    /// Names are matched exactly (lower case), as the CLI prints them.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Scenario::ALL
            .into_iter()
            .find(|scenario| scenario.name() == s)
            .ok_or_else(|| ParseScenarioError {
                given: s.to_owned(),
            })
    }
}

/// How the run reports progress while it measures (always on stderr).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// An indicatif bar with the elapsed time and pairs/s so far.
    Bar,
    /// One plain line per second, for logs and pipes.
    Lines,
    /// Nothing (tests, or a caller that prints its own).
    Off,
}

impl Progress {
    /// A bar when stderr is a terminal, plain lines otherwise.
    pub fn auto() -> Progress {
        if std::io::stderr().is_terminal() {
            Progress::Bar
        } else {
            Progress::Lines
        }
    }
}

/// Everything [`run`](crate::run) needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchOptions {
    /// The server's base URL: `http://host:port`, optionally with a path
    /// prefix (a server behind a proxy). A URL without a scheme is taken as
    /// `http://`; `https` is refused, since TLS would measure the client's
    /// crypto rather than the server.
    pub server: String,
    /// A bearer token, sent as `Authorization: Bearer <token>`. It needs the
    /// `admin` role, since the scenarios reserve for `bench-*` tenants.
    pub token: Option<String>,
    /// What each worker does.
    pub scenario: Scenario,
    /// How long to measure, after the warm-up.
    pub duration: Duration,
    /// How long to run before measuring (connections opened, caches warm);
    /// nothing done in it is counted.
    pub warmup: Duration,
    /// How many workers, each on its own keep-alive connection.
    pub concurrency: usize,
    /// How progress is shown.
    pub progress: Progress,
    /// The `fanout` scenario's shape (other scenarios ignore it).
    pub fanout: FanoutOptions,
}

impl BenchOptions {
    /// The benchmark against `server`: `pairs`, 10 s after a 1 s
    /// warm-up, 64 connections, progress off.
    pub fn new(server: impl Into<String>) -> BenchOptions {
        BenchOptions {
            server: server.into(),
            token: None,
            scenario: Scenario::Pairs,
            duration: Duration::from_secs(10),
            warmup: Duration::from_secs(1),
            concurrency: 64,
            progress: Progress::Off,
            fanout: FanoutOptions::default(),
        }
    }
}

impl Default for BenchOptions {
    /// [`BenchOptions::new`] on [`DEFAULT_SERVER`].
    fn default() -> BenchOptions {
        BenchOptions::new(DEFAULT_SERVER)
    }
}

/// Upper bound on the `fanout` scenario's overhead rounds.
pub const MAX_OVERHEAD_ROUNDS: usize = 10_000;

/// The `fanout` scenario (seed 003): `tasks` sub-tasks all started at once
/// on one tenant, each `POST /v1/reservations` with `wait_ms`, then — after
/// `call` — a settle with the same amounts as the actual.
///
/// The defaults are the issue's: 120 sub-tasks of 3,000 prompt + 500 output
/// tokens, a 200 ms call, a 60 s wait, and 50 rounds measuring a queued
/// admission against an immediate one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FanoutOptions {
    /// How many sub-tasks.
    pub tasks: usize,
    /// Prompt tokens each reserves and settles.
    pub input_tokens: u64,
    /// Output tokens each reserves and settles.
    pub output_tokens: u64,
    /// The simulated model call: from the admission to the settle.
    pub call: Duration,
    /// The `wait_ms` each reserve sends (at most the server's
    /// `queue.max_wait_ms`).
    pub wait: Duration,
    /// The tenant; `None` picks a fresh one, `fanout-<unix ms>`, since a
    /// total budget never refills and the ideal assumes a fresh tenant.
    pub tenant: Option<String>,
    /// Rounds of the queued-vs-immediate overhead phase, on the tenant
    /// `<tenant>-overhead` given its own limits (one concurrent
    /// reservation); 0 skips the phase.
    pub overhead_rounds: usize,
}

impl Default for FanoutOptions {
    fn default() -> FanoutOptions {
        FanoutOptions {
            tasks: 120,
            input_tokens: 3_000,
            output_tokens: 500,
            call: Duration::from_millis(200),
            wait: Duration::from_secs(60),
            tenant: None,
            overhead_rounds: 50,
        }
    }
}
