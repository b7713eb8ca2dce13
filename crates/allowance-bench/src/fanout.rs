//! The `fanout` scenario (seed 003, issue 6): many sub-tasks started at once
//! on one tenant go through the admission queue (`wait_ms`); the run is
//! judged against the ideal schedule of the tenant's plan.
//!
//! - **plan** — read from `GET /v1/scopes/tenant:<t>` before the start: the
//!   `requests` bucket (capacity C, refill period P) and the `tokens` total
//!   budget B ([`FanoutPlan`]).
//! - **ideal schedule** — min(N, ⌊B / tokens per task⌋) admitted, the first
//!   C at once and then one every P/C, each running the call
//!   ([`IdealSchedule`]).
//! - **completion** — from the first reserve sent to the last settle answered.
//! - **overspend** — tokens used after the run beyond B (must be 0).
//! - **overhead** — a queued admission against an immediate one, on a second
//!   tenant limited to one concurrent reservation ([`Overhead`]).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hyper::{Method, StatusCode};
use serde::Deserialize;
use tokio::sync::Barrier;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::client::{Answer, Conn, REQUEST_TIMEOUT, Target, encode_segment};
use crate::report::{Latency, ms};
use crate::worker::{Reserved, answer_kind, classify_reserve};
use crate::{
    BenchError, BenchOptions, FanoutOptions, MAX_CONCURRENCY, MAX_DURATION, MAX_OVERHEAD_ROUNDS,
    Progress, Report, Scenario,
};

/// The target: the completion time is at most this multiple of the
/// ideal schedule's.
pub const FANOUT_RATIO_TARGET: f64 = 1.1;

/// Overhead rounds run first and not counted (connections and caches warm).
const OVERHEAD_WARMUP_ROUNDS: usize = 5;

/// How long the overhead phase's waiter waits in the queue before the
/// settle that frees its slot is sent: long enough to be queued for sure
/// on a loaded machine, short enough for quick rounds.
const QUEUE_PAUSE: Duration = Duration::from_millis(20);

/// The limits of a tenant's plan the ideal schedule is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FanoutPlan {
    /// The `requests` bucket's capacity C: how many are admitted at once.
    pub requests_capacity: u64,
    /// The bucket's refill period P: C more admissions per P, one per P/C.
    pub requests_period: Duration,
    /// The `tokens` total budget B (a `total` window: it never refills).
    pub token_budget: u64,
}

/// What `GET /v1/scopes/tenant:<t>` says about a fan-out tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScopeReading {
    /// The plan's bucket and budget.
    pub plan: FanoutPlan,
    /// Room left in the `requests` bucket.
    pub requests_remaining: i64,
    /// Tokens the budget has recorded as used.
    pub tokens_used: i64,
    /// Tokens held on the budget by live reservations.
    pub tokens_held: u64,
    /// Live reservations on the scope.
    pub held_reservations: u64,
}

#[derive(Deserialize)]
struct StatusAnswer {
    held_reservations: u64,
    limits: Vec<LimitAnswer>,
}

#[derive(Deserialize)]
struct LimitAnswer {
    dimension: String,
    window: String,
    #[serde(default)]
    period_ms: Option<u64>,
    capacity: u64,
    used: i64,
    held: u64,
    remaining: i64,
}

impl ScopeReading {
    /// Reads a scope status answer (HTTP-API.md, `GET /v1/scopes/{scope}`):
    /// the first `requests` limit with a `bucket` window and the first
    /// `tokens` limit with a `total` window.
    ///
    /// # Errors
    /// A body that is not a scope status, or a plan without one of the two
    /// limits (the message says which).
    pub fn parse(body: &[u8]) -> Result<ScopeReading, String> {
        let status: StatusAnswer =
            serde_json::from_slice(body).map_err(|e| format!("not a scope status answer ({e})"))?;
        let bucket = status
            .limits
            .iter()
            .find(|l| l.dimension == "requests" && l.window == "bucket")
            .ok_or("the plan has no requests limit with a bucket window")?;
        let period_ms = bucket
            .period_ms
            .filter(|&p| p > 0)
            .ok_or("the requests bucket has no period_ms")?;
        if bucket.capacity == 0 {
            return Err("the requests bucket has capacity 0".to_owned());
        }
        let budget = status
            .limits
            .iter()
            .find(|l| l.dimension == "tokens" && l.window == "total")
            .ok_or("the plan has no tokens limit with a total window")?;
        Ok(ScopeReading {
            plan: FanoutPlan {
                requests_capacity: bucket.capacity,
                requests_period: Duration::from_millis(period_ms),
                token_budget: budget.capacity,
            },
            requests_remaining: bucket.remaining,
            tokens_used: budget.used,
            tokens_held: budget.held,
            held_reservations: status.held_reservations,
        })
    }

    /// Whether nothing has touched the tenant yet: a full bucket, an unused
    /// budget and no hold — what the ideal schedule assumes.
    pub fn is_fresh(&self) -> bool {
        self.requests_remaining == i64::try_from(self.plan.requests_capacity).unwrap_or(i64::MAX)
            && self.tokens_used == 0
            && self.tokens_held == 0
            && self.held_reservations == 0
    }
}

/// The best any admission queue can do with a plan: the ideal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdealSchedule {
    /// min(N, ⌊B / tokens per task⌋): every task the budget has room for.
    pub admitted: u64,
    /// The others: N − admitted.
    pub refused: u64,
    /// The first C at t = 0, then one per P/C, each running the call:
    /// (admitted − C) × P/C + call when admitted > C, else the call (zero
    /// when nothing is admitted).
    pub duration: Duration,
}

impl IdealSchedule {
    /// The ideal for `tasks` sub-tasks of `tokens_per_task` tokens, each
    /// holding its reservation for `call`, under `plan`.
    pub fn new(
        plan: &FanoutPlan,
        tasks: u64,
        tokens_per_task: u64,
        call: Duration,
    ) -> IdealSchedule {
        let fit = plan
            .token_budget
            .checked_div(tokens_per_task)
            .unwrap_or(u64::MAX);
        let admitted = tasks.min(fit);
        let capacity = plan.requests_capacity.max(1);
        let duration = if admitted == 0 {
            Duration::ZERO
        } else if admitted > capacity {
            let nanos = plan.requests_period.as_nanos() * u128::from(admitted - capacity)
                / u128::from(capacity);
            Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX)).saturating_add(call)
        } else {
            call
        };
        IdealSchedule {
            admitted,
            refused: tasks - admitted,
            duration,
        }
    }
}

/// A queued admission against an immediate one, on a tenant whose only
/// limit is one concurrent reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overhead {
    /// The tenant it ran on.
    pub tenant: String,
    /// Rounds measured (after a few uncounted).
    pub rounds: u64,
    /// An immediate reserve: request to answer, with room.
    pub immediate_reserve: Latency,
    /// An immediate reserve and its settle: reserve request to settle answer.
    pub immediate_pair: Latency,
    /// From the settle that frees the only slot being sent to the answer
    /// of the reserve waiting for it.
    pub freed_to_admitted: Latency,
    /// A queued admission: the median, in microseconds, from the answer of
    /// the settle that frees the only slot to the answer of the reserve
    /// waiting for it — negative when the waiter's answer comes first (the
    /// server wakes the queue before it answers the settle).
    pub queued_p50_us: i64,
    /// Rounds in which the waiter's answer came before the settle's.
    pub waiter_first: u64,
}

impl Overhead {
    /// The queued admission's p50 in milliseconds (signed).
    pub fn queued_p50_ms(&self) -> f64 {
        self.queued_p50_us as f64 / 1000.0
    }

    /// Queued p50 minus immediate reserve p50, in milliseconds: what an
    /// admission through the queue costs, once room frees, beyond one made
    /// at once (negative: less).
    pub fn vs_reserve_ms(&self) -> f64 {
        self.queued_p50_ms() - self.immediate_reserve.p50.as_secs_f64() * 1000.0
    }

    /// Queued p50 minus immediate reserve+settle p50, in milliseconds.
    pub fn vs_pair_ms(&self) -> f64 {
        self.queued_p50_ms() - self.immediate_pair.p50.as_secs_f64() * 1000.0
    }
}

/// The median (lower middle) of signed samples; 0 when there are none.
pub(crate) fn median_i64(samples: &[i64]) -> i64 {
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    match sorted.len() {
        0 => 0,
        n => sorted[(n - 1) / 2],
    }
}

/// What the `fanout` scenario measured.
#[derive(Debug, Clone, PartialEq)]
pub struct FanoutReport {
    /// The server measured, as given.
    pub server: String,
    /// The tenant the sub-tasks ran on.
    pub tenant: String,
    /// Sub-tasks started.
    pub tasks: u64,
    /// Tokens each reserved and settled (prompt + output).
    pub tokens_per_task: u64,
    /// The simulated call: admission to settle.
    pub call: Duration,
    /// The tenant's plan, read before the start.
    pub plan: FanoutPlan,
    /// The ideal schedule under that plan.
    pub ideal: IdealSchedule,
    /// Reserves admitted (201).
    pub admitted: u64,
    /// Admitted reserves whose settle answered 200.
    pub settled: u64,
    /// Reserves refused (402, 429, 422).
    pub refused: u64,
    /// Refusals by `"<status> <error.type>"`, e.g. `"402 budget_exhausted"`.
    pub refused_by_kind: BTreeMap<String, u64>,
    /// Failed calls: transport errors, timeouts, 5xx, a failed settle.
    pub errors: u64,
    /// Failures by kind.
    pub errors_by_kind: BTreeMap<String, u64>,
    /// From the first reserve sent to the last settle answered (to the last
    /// reserve answered when nothing settled).
    pub total: Duration,
    /// When the first admission beyond the bucket's capacity (the C+1-th)
    /// was answered, from the first reserve sent; the ideal is P/C.
    /// `None` when no more than C were admitted.
    pub first_queued: Option<Duration>,
    /// Tokens the budget recorded as used after the run.
    pub tokens_used: i64,
    /// Tokens still held on the budget after the run (0 when all settled).
    pub tokens_held: u64,
    /// Per admission: its reserve's request to answer (the queue wait).
    pub wait: Latency,
    /// Per refusal: its reserve's request to answer.
    pub refusal: Latency,
    /// Per settle: request to answer.
    pub settle: Latency,
    /// The queued-vs-immediate phase: `None` when skipped, the reason when
    /// it failed.
    pub overhead: Option<Result<Overhead, String>>,
}

impl FanoutReport {
    /// Completion over the ideal schedule; `None` when the ideal is zero.
    pub fn ratio(&self) -> Option<f64> {
        (!self.ideal.duration.is_zero())
            .then(|| self.total.as_secs_f64() / self.ideal.duration.as_secs_f64())
    }

    /// Tokens used beyond the budget (0 when within it).
    pub fn overspend(&self) -> u64 {
        let budget = i64::try_from(self.plan.token_budget).unwrap_or(i64::MAX);
        u64::try_from(self.tokens_used.saturating_sub(budget)).unwrap_or(0)
    }

    /// The targets: ratio ≤ [`FANOUT_RATIO_TARGET`], no overspend,
    /// the ideal's admissions, and no failure.
    pub fn meets_targets(&self) -> bool {
        self.ratio().is_some_and(|r| r <= FANOUT_RATIO_TARGET)
            && self.overspend() == 0
            && self.admitted == self.ideal.admitted
            && self.errors == 0
    }
}

fn secs(d: Duration) -> String {
    format!("{:.3} s", d.as_secs_f64())
}

fn latency_row(f: &mut fmt::Formatter<'_>, name: &str, l: &Latency) -> fmt::Result {
    writeln!(
        f,
        "  {:<12} {:>8} {:>12} {:>12} {:>12} {:>12}",
        name,
        l.count,
        ms(l.p50),
        ms(l.p99),
        ms(l.p999),
        ms(l.max)
    )
}

impl fmt::Display for FanoutReport {
    /// A table whose lines start with a fixed word (`admitted`, `ratio`,
    /// `overspend`, `overhead` …), for scripts to pick figures from.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} · scenario fanout · tenant:{} · {} tasks of {} tokens, {} call",
            self.server,
            self.tenant,
            self.tasks,
            self.tokens_per_task,
            ms(self.call)
        )?;
        writeln!(
            f,
            "  plan         requests {} per {} (bucket) · tokens {} (total)",
            self.plan.requests_capacity,
            secs(self.plan.requests_period),
            self.plan.token_budget
        )?;
        writeln!(
            f,
            "  admitted     {:>8}  (ideal {}; settled {})",
            self.admitted, self.ideal.admitted, self.settled
        )?;
        writeln!(
            f,
            "  refused      {:>8}  (ideal {})",
            self.refused, self.ideal.refused
        )?;
        for (kind, n) in &self.refused_by_kind {
            writeln!(f, "    refused    {n:>8}  {kind}")?;
        }
        writeln!(f, "  errors       {:>8}", self.errors)?;
        for (kind, n) in &self.errors_by_kind {
            writeln!(f, "    failed     {n:>8}  {kind}")?;
        }
        writeln!(
            f,
            "  completion   {} (first reserve → last settle) · ideal {}",
            secs(self.total),
            secs(self.ideal.duration)
        )?;
        if let Some(at) = self.first_queued {
            let capacity = u32::try_from(self.plan.requests_capacity.max(1)).unwrap_or(u32::MAX);
            writeln!(
                f,
                "  1st queued   admitted at {} (ideal {}: one refill, P/C)",
                ms(at),
                ms(self.plan.requests_period / capacity)
            )?;
        }
        match self.ratio() {
            Some(r) => writeln!(
                f,
                "  ratio        {r:.3}× (target ≤ {FANOUT_RATIO_TARGET}×: {})",
                if r <= FANOUT_RATIO_TARGET {
                    "met"
                } else {
                    "NOT met"
                }
            )?,
            None => writeln!(f, "  ratio        n/a (the ideal schedule is empty)")?,
        }
        writeln!(
            f,
            "  overspend    {:>8}  tokens (used {} of {}, still held {})",
            self.overspend(),
            self.tokens_used,
            self.plan.token_budget,
            self.tokens_held
        )?;
        writeln!(
            f,
            "  {:<12} {:>8} {:>12} {:>12} {:>12} {:>12}",
            "latency", "count", "p50", "p99", "p99.9", "max"
        )?;
        latency_row(f, "queue wait", &self.wait)?;
        latency_row(f, "refusal", &self.refusal)?;
        latency_row(f, "settle", &self.settle)?;
        match &self.overhead {
            None => {}
            Some(Err(reason)) => writeln!(f, "  overhead     failed: {reason}")?,
            Some(Ok(o)) => {
                writeln!(
                    f,
                    "  overhead     {} rounds on tenant:{} (one concurrent reservation)",
                    o.rounds, o.tenant
                )?;
                latency_row(f, "immediate", &o.immediate_reserve)?;
                latency_row(f, "imm.+settle", &o.immediate_pair)?;
                latency_row(f, "freed→adm.", &o.freed_to_admitted)?;
                writeln!(
                    f,
                    "  queued       {:.3} ms p50, settle answer → waiter answer (the waiter's came first in {} of {})",
                    o.queued_p50_ms(),
                    o.waiter_first,
                    o.rounds
                )?;
                writeln!(
                    f,
                    "  queued−imm.  {:+.3} ms vs an immediate reserve, {:+.3} ms vs an immediate reserve+settle (p50)",
                    o.vs_reserve_ms(),
                    o.vs_pair_ms()
                )?;
            }
        }
        Ok(())
    }
}

fn validate(opts: &FanoutOptions) -> Result<(), BenchError> {
    let invalid = |field: &'static str, reason: String| BenchError::InvalidOption { field, reason };
    if opts.tasks == 0 || opts.tasks > MAX_CONCURRENCY {
        return Err(invalid(
            "fanout.tasks",
            format!("{} is outside 1..={MAX_CONCURRENCY}", opts.tasks),
        ));
    }
    if opts.call > MAX_DURATION {
        return Err(invalid(
            "fanout.call",
            format!("{:?} is over {} s", opts.call, MAX_DURATION.as_secs()),
        ));
    }
    if opts.wait.as_millis() == 0 || opts.wait > MAX_DURATION {
        return Err(invalid(
            "fanout.wait",
            format!(
                "{:?} is outside [1 ms, {} s]",
                opts.wait,
                MAX_DURATION.as_secs()
            ),
        ));
    }
    if opts.overhead_rounds > MAX_OVERHEAD_ROUNDS {
        return Err(invalid(
            "fanout.overhead_rounds",
            format!(
                "{} is outside 0..={MAX_OVERHEAD_ROUNDS}",
                opts.overhead_rounds
            ),
        ));
    }
    if opts.tenant.as_deref() == Some("") {
        return Err(invalid("fanout.tenant", "the tenant is empty".to_owned()));
    }
    Ok(())
}

/// The bodies every call sends, built once.
struct Bodies {
    reserve_path: String,
    /// Reserve with `wait_ms`.
    queued: Bytes,
    /// Reserve without.
    immediate: Bytes,
    settle: Bytes,
}

impl Bodies {
    fn new(target: &Target, tenant: &str, opts: &FanoutOptions, wait_ms: u128) -> Bodies {
        let amounts = serde_json::json!({
            "input_tokens": opts.input_tokens,
            "output_tokens": opts.output_tokens,
        });
        let immediate = serde_json::json!({ "tenant": tenant, "amounts": amounts });
        let mut queued = immediate.clone();
        queued["wait_ms"] = serde_json::json!(u64::try_from(wait_ms).unwrap_or(u64::MAX));
        let settle = serde_json::json!({ "usage": amounts });
        Bodies {
            reserve_path: target.path("/v1/reservations"),
            queued: Bytes::from(queued.to_string()),
            immediate: Bytes::from(immediate.to_string()),
            settle: Bytes::from(settle.to_string()),
        }
    }
}

fn scope_path(target: &Target, tenant: &str) -> String {
    target.path(&format!(
        "/v1/scopes/{}",
        encode_segment(&format!("tenant:{tenant}"))
    ))
}

fn settle_path(target: &Target, id: &str) -> String {
    target.path(&format!("/v1/reservations/{}/settle", encode_segment(id)))
}

/// `what` answered: an error naming the call, unless 200.
fn expect_ok(what: &str, answer: Result<Answer, crate::client::Failure>) -> Result<Answer, String> {
    match answer {
        Ok(a) if a.status == StatusCode::OK => Ok(a),
        Ok(a) => Err(format!("{what}: {}", answer_kind(&a))),
        Err(failure) => Err(format!("{what}: {}", failure.kind())),
    }
}

async fn open(target: &Target) -> Result<Conn, String> {
    Conn::open(target, Instant::now() + REQUEST_TIMEOUT)
        .await
        .map_err(|f| f.kind().to_owned())
}

async fn read_scope(
    conn: &mut Conn,
    target: &Target,
    tenant: &str,
) -> Result<ScopeReading, String> {
    let path = scope_path(target, tenant);
    let answer = conn
        .call(
            target,
            Method::GET,
            &path,
            None,
            Instant::now() + REQUEST_TIMEOUT,
        )
        .await;
    let answer = expect_ok(&format!("GET {path}"), answer)?;
    ScopeReading::parse(&answer.body).map_err(|e| format!("tenant:{tenant}: {e}"))
}

/// How one sub-task ended.
enum Ending {
    /// Admitted, then settled.
    Settled {
        settle_sent: Instant,
        settled: Instant,
    },
    /// Admitted, but the settle failed.
    SettleFailed(String),
    /// Refused, by `"<status> <type>"`.
    Refused(String),
    /// The reserve failed.
    Failed(String),
}

struct TaskResult {
    sent: Instant,
    answered: Instant,
    ending: Ending,
}

/// One sub-task: waits for the start, reserves (waiting in the queue),
/// "calls the model", settles the actual.
async fn sub_task(
    mut conn: Conn,
    target: Arc<Target>,
    bodies: Arc<Bodies>,
    start: Arc<Barrier>,
    wait: Duration,
    call: Duration,
) -> TaskResult {
    start.wait().await;
    let sent = Instant::now();
    let answer = conn
        .post(
            &target,
            &bodies.reserve_path,
            bodies.queued.clone(),
            sent + wait + REQUEST_TIMEOUT,
        )
        .await;
    let answered = Instant::now();
    let done = |ending| TaskResult {
        sent,
        answered,
        ending,
    };
    let answer = match answer {
        Ok(a) => a,
        Err(failure) => return done(Ending::Failed(failure.kind().to_owned())),
    };
    let id = match classify_reserve(&answer) {
        Reserved::Held(id) => id,
        Reserved::Denied(kind) => return done(Ending::Refused(kind)),
        Reserved::Unexpected(kind) => return done(Ending::Failed(format!("reserve: {kind}"))),
    };
    tokio::time::sleep(call).await;
    let settle_sent = Instant::now();
    let answer = conn
        .post(
            &target,
            &settle_path(&target, &id),
            bodies.settle.clone(),
            settle_sent + REQUEST_TIMEOUT,
        )
        .await;
    match expect_ok("settle", answer) {
        Ok(_) => done(Ending::Settled {
            settle_sent,
            settled: Instant::now(),
        }),
        Err(kind) => done(Ending::SettleFailed(kind)),
    }
}

fn say(progress: Progress, line: &str) {
    if progress != Progress::Off {
        eprintln!("bench: {line}");
    }
}

/// Runs the `fanout` scenario (see the module doc) and reports it as a
/// [`Report`] whose `fanout` holds the scenario's own figures.
pub(crate) async fn run(opts: &BenchOptions) -> Result<Report, BenchError> {
    let fo = &opts.fanout;
    validate(fo)?;
    let target = Arc::new(Target::parse(&opts.server, opts.token.as_deref())?);
    crate::run::preflight(&target).await?;
    let tenant = fo.tenant.clone().unwrap_or_else(|| {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        format!("fanout-{ms}")
    });
    let setup = BenchError::Setup;
    let mut admin = open(&target).await.map_err(setup)?;
    let before = read_scope(&mut admin, &target, &tenant)
        .await
        .map_err(setup)?;
    if !before.is_fresh() {
        return Err(setup(format!(
            "tenant:{tenant} is not fresh (requests remaining {} of {}, tokens used {}, held {}, {} live reservations): the ideal schedule assumes a full bucket and an unused budget",
            before.requests_remaining,
            before.plan.requests_capacity,
            before.tokens_used,
            before.tokens_held,
            before.held_reservations
        )));
    }
    let plan = before.plan;
    let tokens_per_task = fo.input_tokens.saturating_add(fo.output_tokens);
    let tasks = fo.tasks as u64;
    let ideal = IdealSchedule::new(&plan, tasks, tokens_per_task, fo.call);
    let bodies = Arc::new(Bodies::new(&target, &tenant, fo, fo.wait.as_millis()));
    say(
        opts.progress,
        &format!(
            "fanout: {tasks} tasks on tenant:{tenant}; ideal {} admitted in {:.3} s",
            ideal.admitted,
            ideal.duration.as_secs_f64()
        ),
    );

    // Every connection is open before the start, so the dials are not timed.
    let mut conns = Vec::with_capacity(fo.tasks);
    for _ in 0..fo.tasks {
        conns.push(
            open(&target)
                .await
                .map_err(|e| setup(format!("dialling: {e}")))?,
        );
    }
    let start = Arc::new(Barrier::new(fo.tasks));
    let mut running = JoinSet::new();
    for conn in conns {
        running.spawn(sub_task(
            conn,
            Arc::clone(&target),
            Arc::clone(&bodies),
            Arc::clone(&start),
            fo.wait,
            fo.call,
        ));
    }
    let mut results = Vec::with_capacity(fo.tasks);
    while let Some(joined) = running.join_next().await {
        match joined {
            Ok(r) => results.push(r),
            Err(e) => {
                running.abort_all();
                return Err(BenchError::Worker(e.to_string()));
            }
        }
    }

    let after = read_scope(&mut admin, &target, &tenant)
        .await
        .map_err(setup)?;
    let overhead = if fo.overhead_rounds == 0 {
        None
    } else {
        say(
            opts.progress,
            &format!("fanout: {} overhead rounds", fo.overhead_rounds),
        );
        Some(measure_overhead(&target, &format!("{tenant}-overhead"), fo).await)
    };

    let report = tally(
        opts,
        FanoutReport {
            server: opts.server.clone(),
            tenant,
            tasks,
            tokens_per_task,
            call: fo.call,
            plan,
            ideal,
            admitted: 0,
            settled: 0,
            refused: 0,
            refused_by_kind: BTreeMap::new(),
            errors: 0,
            errors_by_kind: BTreeMap::new(),
            total: Duration::ZERO,
            first_queued: None,
            tokens_used: after.tokens_used,
            tokens_held: after.tokens_held,
            wait: Latency::default(),
            refusal: Latency::default(),
            settle: Latency::default(),
            overhead,
        },
        &results,
    );
    Ok(report)
}

/// Folds the sub-tasks' results into the report, and the report into the
/// common [`Report`] (reserve = every answered reserve, second = settles,
/// pair = reserve sent to settle answered).
fn tally(opts: &BenchOptions, mut fr: FanoutReport, results: &[TaskResult]) -> Report {
    let mut answered_all = Vec::new();
    let mut waits = Vec::new();
    let mut refusals = Vec::new();
    let mut settles = Vec::new();
    let mut pairs = Vec::new();
    let first = results.iter().map(|r| r.sent).min();
    let mut last_settle: Option<Instant> = None;
    let mut last_answer: Option<Instant> = None;
    let mut admissions = Vec::new();
    for r in results {
        let latency = r.answered - r.sent;
        last_answer = last_answer.max(Some(r.answered));
        match &r.ending {
            Ending::Settled {
                settle_sent,
                settled,
            } => {
                fr.admitted += 1;
                fr.settled += 1;
                admissions.push(r.answered);
                waits.push(latency);
                answered_all.push(latency);
                settles.push(*settled - *settle_sent);
                pairs.push(*settled - r.sent);
                last_settle = last_settle.max(Some(*settled));
            }
            Ending::SettleFailed(kind) => {
                fr.admitted += 1;
                admissions.push(r.answered);
                waits.push(latency);
                answered_all.push(latency);
                fr.errors += 1;
                *fr.errors_by_kind.entry(kind.clone()).or_default() += 1;
            }
            Ending::Refused(kind) => {
                fr.refused += 1;
                refusals.push(latency);
                answered_all.push(latency);
                *fr.refused_by_kind.entry(kind.clone()).or_default() += 1;
            }
            Ending::Failed(kind) => {
                fr.errors += 1;
                *fr.errors_by_kind.entry(kind.clone()).or_default() += 1;
            }
        }
    }
    if let Some(first) = first {
        if let Some(last) = last_settle.or(last_answer) {
            fr.total = last - first;
        }
        admissions.sort_unstable();
        let capacity = usize::try_from(fr.plan.requests_capacity).unwrap_or(usize::MAX);
        fr.first_queued = admissions.get(capacity).map(|&at| at - first);
    }
    fr.wait = Latency::from_samples(&waits);
    fr.refusal = Latency::from_samples(&refusals);
    fr.settle = Latency::from_samples(&settles);
    let secs = fr.total.as_secs_f64();
    Report {
        server: opts.server.clone(),
        scenario: Scenario::Fanout,
        concurrency: results.len(),
        elapsed: fr.total,
        pairs: fr.settled,
        pairs_per_s: if secs > 0.0 {
            fr.settled as f64 / secs
        } else {
            0.0
        },
        attempts: results.len() as u64,
        denials: fr.refused,
        denials_by_kind: fr.refused_by_kind.clone(),
        errors: fr.errors,
        errors_by_kind: fr.errors_by_kind.clone(),
        reserve: Latency::from_samples(&answered_all),
        second: fr.settle,
        pair: Latency::from_samples(&pairs),
        fanout: Some(fr),
    }
}

/// Reserves on `conn`; the id when admitted.
async fn reserve(
    conn: &mut Conn,
    target: &Target,
    path: &str,
    body: Bytes,
    deadline: Instant,
) -> Result<String, String> {
    match conn.post(target, path, body, deadline).await {
        Ok(answer) => match classify_reserve(&answer) {
            Reserved::Held(id) => Ok(id),
            Reserved::Denied(kind) | Reserved::Unexpected(kind) => Err(format!("reserve: {kind}")),
        },
        Err(failure) => Err(format!("reserve: {}", failure.kind())),
    }
}

/// The queued-vs-immediate phase; the reason when it could not run.
async fn measure_overhead(
    target: &Target,
    tenant: &str,
    fo: &FanoutOptions,
) -> Result<Overhead, String> {
    let mut a = open(target).await?;
    let mut b = open(target).await?;
    // Its own limits: one concurrent reservation, nothing else to bind.
    let limits = serde_json::json!({ "limits": [{ "dimension": "concurrent", "capacity": 1 }] });
    let put = a
        .call(
            target,
            Method::PUT,
            &scope_path(target, tenant),
            Some(Bytes::from(limits.to_string())),
            Instant::now() + REQUEST_TIMEOUT,
        )
        .await;
    expect_ok(&format!("PUT tenant:{tenant} limits"), put)?;
    // The waiter waits at most this: its slot frees after QUEUE_PAUSE.
    let wait_ms = fo.wait.as_millis().min(REQUEST_TIMEOUT.as_millis());
    let bodies = Bodies::new(target, tenant, fo, wait_ms);
    let total = OVERHEAD_WARMUP_ROUNDS + fo.overhead_rounds;

    let mut reserves = Vec::with_capacity(fo.overhead_rounds);
    let mut pairs = Vec::with_capacity(fo.overhead_rounds);
    for round in 0..total {
        let sent = Instant::now();
        let id = reserve(
            &mut a,
            target,
            &bodies.reserve_path,
            bodies.immediate.clone(),
            sent + REQUEST_TIMEOUT,
        )
        .await?;
        let reserved = Instant::now();
        expect_ok(
            "settle",
            a.post(
                target,
                &settle_path(target, &id),
                bodies.settle.clone(),
                Instant::now() + REQUEST_TIMEOUT,
            )
            .await,
        )?;
        let settled = Instant::now();
        if round >= OVERHEAD_WARMUP_ROUNDS {
            reserves.push(reserved - sent);
            pairs.push(settled - sent);
        }
    }

    let mut freeing = Vec::with_capacity(fo.overhead_rounds);
    let mut handoffs = Vec::with_capacity(fo.overhead_rounds);
    let mut waiter_first = 0;
    for round in 0..total {
        let holder = reserve(
            &mut a,
            target,
            &bodies.reserve_path,
            bodies.immediate.clone(),
            Instant::now() + REQUEST_TIMEOUT,
        )
        .await?;
        let waiter = async {
            let sent = Instant::now();
            let id = reserve(
                &mut b,
                target,
                &bodies.reserve_path,
                bodies.queued.clone(),
                sent + fo.wait + REQUEST_TIMEOUT,
            )
            .await;
            (id, Instant::now())
        };
        let freer = async {
            tokio::time::sleep(QUEUE_PAUSE).await;
            let sent = Instant::now();
            let answer = a
                .post(
                    target,
                    &settle_path(target, &holder),
                    bodies.settle.clone(),
                    sent + REQUEST_TIMEOUT,
                )
                .await;
            (expect_ok("settle", answer), sent, Instant::now())
        };
        let ((waited, waiter_answered), (freed, settle_sent, settle_answered)) =
            tokio::join!(waiter, freer);
        freed?;
        let id = waited.map_err(|e| format!("queued {e}"))?;
        if waiter_answered < settle_sent {
            return Err(format!(
                "the waiter was admitted while tenant:{tenant}'s only slot was held"
            ));
        }
        if round >= OVERHEAD_WARMUP_ROUNDS {
            if waiter_answered < settle_answered {
                waiter_first += 1;
            }
            freeing.push(waiter_answered - settle_sent);
            let signed = if waiter_answered >= settle_answered {
                (waiter_answered - settle_answered).as_micros() as i64
            } else {
                -((settle_answered - waiter_answered).as_micros() as i64)
            };
            handoffs.push(signed);
        }
        expect_ok(
            "settle",
            b.post(
                target,
                &settle_path(target, &id),
                bodies.settle.clone(),
                Instant::now() + REQUEST_TIMEOUT,
            )
            .await,
        )?;
    }
    Ok(Overhead {
        tenant: tenant.to_owned(),
        rounds: fo.overhead_rounds as u64,
        immediate_reserve: Latency::from_samples(&reserves),
        immediate_pair: Latency::from_samples(&pairs),
        freed_to_admitted: Latency::from_samples(&freeing),
        queued_p50_us: median_i64(&handoffs),
        waiter_first,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nearest-rank percentiles of a few samples, and signed medians.
    #[test]
    fn percentiles_of_samples() {
        let samples: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        let l = Latency::from_samples(&samples);
        assert_eq!(l.count, 100);
        assert_eq!(l.p50, Duration::from_millis(50));
        assert_eq!(l.p99, Duration::from_millis(99));
        assert_eq!(l.p999, Duration::from_millis(100));
        assert_eq!(l.max, Duration::from_millis(100));
        let one = Latency::from_samples(&[Duration::from_micros(7)]);
        assert_eq!(
            (one.p50, one.max),
            (Duration::from_micros(7), Duration::from_micros(7))
        );
        assert_eq!(Latency::from_samples(&[]), Latency::default());

        assert_eq!(median_i64(&[5, -3, 1]), 1);
        assert_eq!(median_i64(&[4, -2]), -2);
        assert_eq!(median_i64(&[]), 0);
    }
}
