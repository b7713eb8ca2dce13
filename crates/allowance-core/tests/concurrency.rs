//! Real OS threads against one [`SharedLedger`]: no overspend, exact
//! accounting, holds equal to the live reservations, and every reservation
//! leaving HELD at most once — under a random mix of operations on tenants
//! whose reservations span shards through a shared `tool:search` scope,
//! under the seed-002 burst (40 tasks racing for a €20.00 daily cap), and
//! for two threads on disjoint tenants and on one hot tenant.
//!
//! Correctness only: speed is measured by the benchmarks, never asserted
//! here. The defaults keep the suite to a few seconds in debug; for more,
//! `ALLOWANCE_STRESS_ROUNDS` (seed-002 rounds, default 200) and
//! `ALLOWANCE_STRESS_OPS` (operations per hammering thread, default 3000).

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread;

use allowance_core::*;
use common::Changes;

/// Shards of every ledger here: more than the tenants, so tenants and the
/// shared scope land in different shards.
const SHARDS: usize = 8;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// SplitMix64: a fast, seedable generator, so a failing run can be replayed
/// by its seed (the interleaving aside).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn id(&mut self, tenant: &str) -> ReservationId {
        let random = (u128::from(self.next()) << 64) | u128::from(self.next());
        ReservationId::mint(random, tenant)
    }
}

/// The shard a tenant (or a shared scope, by its name) lives in — the same
/// stable hash the ledger routes by, so the tests can pick names that land
/// where they need them. Were the routing to change, the names would only
/// land less deliberately; no assertion depends on it.
fn shard_of(name: &str) -> usize {
    usize::from(ReservationId::tenant_tag(name)) & (SHARDS - 1)
}

/// `n` tenant names: the first in the shard of `tool:search`, the others
/// each in a shard of its own, away from it.
fn spread_tenants(n: usize) -> Vec<String> {
    let tool = shard_of("tool:search");
    let mut used = vec![tool];
    let mut out = Vec::new();
    let same = (0..)
        .map(|i| format!("co{i}"))
        .find(|t| shard_of(t) == tool)
        .expect("some name hashes anywhere");
    out.push(same);
    for i in 0.. {
        if out.len() == n {
            break;
        }
        let t = format!("org{i}");
        if !used.contains(&shard_of(&t)) {
            used.push(shard_of(&t));
            out.push(t);
        }
    }
    out
}

fn limit(dim: Dimension, capacity: u64, window: Window) -> Limit {
    Limit::new(dim, capacity, window).expect("a valid limit")
}

fn key(name: &str) -> ScopeKey {
    ScopeKey::parse(name).expect("a valid scope name")
}

/// The limit of `dimension` with a window of `kind` in a status.
fn find<'a>(status: &'a ScopeStatus, dimension: &str, kind: WindowKind) -> &'a LimitStatus {
    status
        .limits
        .iter()
        .find(|l| l.dimension == dimension && l.window.kind() == kind)
        .unwrap_or_else(|| panic!("{} has no {kind} limit on {dimension}", status.scope))
}

// ---------------------------------------------------------------------------
// The hammer: a random mix of every operation from many threads.

/// 2025-03-13T23:59:50Z: the users' calendar day turns over during the run.
const START_MS: u64 = 1_741_910_390_000;
/// A "long" hold outlives the whole run, so while nobody ends it, it is
/// certainly HELD — which makes the concurrency lower bound below exact.
const LONG_TTL_MS: u64 = 3_000_000;
/// The clock never moves further than this during the run (< LONG_TTL_MS).
const MAX_ADVANCE_MS: u64 = 1_000_000;
const TENANTS: usize = 4;
const USER_CONCURRENT: u64 = 3;
const AGENT_CONCURRENT: u64 = 2;
const TOOL_CONCURRENT: u64 = 12;

/// Scopes of one reservation shape: the tenant plus some of its user and
/// agent, and maybe the shared tool.
struct Combo {
    scopes: ScopeSet,
    tenant: usize,
    user: Option<usize>,
    agent: Option<usize>,
    tool: bool,
}

impl Combo {
    /// The concurrency gauges this shape counts against, as indices into
    /// [`Hammer::gauges`]: 4 per tenant (2 users, 2 agents), then the tool.
    fn gauges(&self) -> Vec<usize> {
        let mut g = Vec::new();
        if let Some(u) = self.user {
            g.push(self.tenant * 4 + u);
        }
        if let Some(a) = self.agent {
            g.push(self.tenant * 4 + 2 + a);
        }
        if self.tool {
            g.push(TENANTS * 4);
        }
        g
    }
}

fn gauge_capacity(g: usize) -> u64 {
    match g {
        g if g == TENANTS * 4 => TOOL_CONCURRENT,
        g if g % 4 < 2 => USER_CONCURRENT,
        _ => AGENT_CONCURRENT,
    }
}

/// A reservation some thread was granted and nobody is known to have ended.
struct Live {
    id: ReservationId,
    combo: usize,
    long: bool,
    tokens: u64,
    cost_micros: u64,
    /// Still counted in the gauges (only long holds are); the first thread
    /// to end it takes it out, before its call, so the gauge never counts a
    /// reservation the ledger may already have released.
    /// A lock, not an atomic flag: the thread that clears it keeps it
    /// until the gauges went down, so another thread that finds it cleared
    /// cannot end the reservation in between (with a flag it could, and the
    /// gauges then counted a released hold: a false "over capacity").
    counted: Mutex<bool>,
}

/// One answer to a settle or refund.
enum Answer {
    Settle(Result<Reservation, SettleError>),
    Refund(Result<Reservation, RefundError>),
}

#[derive(Default)]
struct Stats {
    granted: u64,
    rate_limited: u64,
    budget_exhausted: u64,
    exceeds_limit: u64,
    settles: u64,
    refunds: u64,
    extends: u64,
    extends_denied: u64,
    expire_calls: u64,
    status_reads: u64,
    /// Denials by the kind of scope, dimension and window that said no.
    denied_by: HashMap<String, u64>,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        self.granted += o.granted;
        self.rate_limited += o.rate_limited;
        self.budget_exhausted += o.budget_exhausted;
        self.exceeds_limit += o.exceeds_limit;
        self.settles += o.settles;
        self.refunds += o.refunds;
        self.extends += o.extends;
        self.extends_denied += o.extends_denied;
        self.expire_calls += o.expire_calls;
        self.status_reads += o.status_reads;
        for (k, v) in &o.denied_by {
            *self.denied_by.entry(k.clone()).or_default() += v;
        }
    }
}

/// What one hammering thread reports back.
#[derive(Default)]
struct Report {
    granted: Vec<(ReservationId, usize)>,
    answers: Vec<(ReservationId, Answer)>,
    stats: Stats,
}

struct Hammer {
    ledger: SharedLedger,
    search_calls: Dimension,
    combos: Vec<Combo>,
    clock_ms: AtomicU64,
    pool: Mutex<Vec<Arc<Live>>>,
    /// Lower bounds of the HELD reservations on each concurrency-limited
    /// scope: raised after a long reserve is granted, lowered before the
    /// first call that may end it.
    gauges: Vec<AtomicI64>,
    /// Every reservation the gauges count now, by id (its combo): taken in
    /// before the count goes up and out after it goes down, so a count over
    /// capacity can name them all, the ones a thread is ending included.
    counted: Mutex<HashMap<ReservationId, usize>>,
}

impl Hammer {
    fn new() -> Hammer {
        let mut c = Catalog::default();
        let search_calls = c.add_dimension("search_calls").unwrap();
        let plan = |name: &str, limits: Vec<Limit>| {
            // The tenant's plan governs the overrun policy: capping at the
            // estimate keeps every on-time settle within what was admitted.
            Plan::new(name, limits, OverrunPolicy::CapAtEstimate).unwrap()
        };
        c.set_plan(plan(
            "tenant",
            vec![
                limit(Dimension::COST_MICROS, 16_000_000, Window::Total),
                limit(
                    Dimension::TOKENS,
                    200_000,
                    Window::Sliding {
                        period_ms: 10_000,
                        slices: 20,
                    },
                ),
            ],
        ));
        c.set_plan(plan(
            "user",
            vec![
                limit(
                    Dimension::COST_MICROS,
                    6_000_000,
                    Window::Calendar {
                        unit: CalendarUnit::Day,
                        zone: Zone::utc(),
                    },
                ),
                limit(Dimension::CONCURRENT, USER_CONCURRENT, Window::Concurrent),
            ],
        ));
        c.set_plan(plan(
            "agent",
            vec![
                limit(
                    Dimension::TOKENS,
                    60_000,
                    Window::Bucket { period_ms: 20_000 },
                ),
                limit(Dimension::CONCURRENT, AGENT_CONCURRENT, Window::Concurrent),
                limit(Dimension::TOKENS, 1_500_000, Window::Total),
            ],
        ));
        c.set_plan(plan(
            "tool",
            vec![
                limit(search_calls, 3_000, Window::Total),
                limit(Dimension::CONCURRENT, TOOL_CONCURRENT, Window::Concurrent),
                limit(
                    Dimension::REQUESTS,
                    2_000,
                    Window::Sliding {
                        period_ms: 10_000,
                        slices: 10,
                    },
                ),
            ],
        ));
        c.set_kind("tenant", Some("tenant"), false).unwrap();
        c.set_kind("user", Some("user"), false).unwrap();
        c.set_kind("agent", Some("agent"), false).unwrap();
        c.set_kind("tool", Some("tool"), true).unwrap();

        let mut combos = Vec::new();
        for (t, tenant) in spread_tenants(TENANTS).iter().enumerate() {
            for tool in [false, true] {
                for (user, agent) in [
                    (Some(0), None),
                    (Some(1), None),
                    (None, Some(0)),
                    (None, Some(1)),
                    (Some(0), Some(1)),
                    (Some(1), Some(0)),
                ] {
                    let (u, a) = (
                        user.map(|u| format!("u{u}")),
                        agent.map(|a| format!("a{a}")),
                    );
                    let mut named: Vec<(&str, &str)> = Vec::new();
                    if let Some(u) = &u {
                        named.push(("user", u));
                    }
                    if let Some(a) = &a {
                        named.push(("agent", a));
                    }
                    if tool {
                        named.push(("tool", "search"));
                    }
                    combos.push(Combo {
                        scopes: c.scope_set(tenant, &named).unwrap(),
                        tenant: t,
                        user,
                        agent,
                        tool,
                    });
                }
            }
        }
        Hammer {
            ledger: SharedLedger::new(c, SHARDS),
            search_calls,
            combos,
            clock_ms: AtomicU64::new(START_MS),
            pool: Mutex::new(Vec::new()),
            gauges: (0..=TENANTS * 4).map(|_| AtomicI64::new(0)).collect(),
            counted: Mutex::new(HashMap::new()),
        }
    }

    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.clock_ms.load(Ordering::SeqCst))
    }

    fn pick(&self, rng: &mut Rng, remove: bool) -> Option<Arc<Live>> {
        let mut pool = self.pool.lock().unwrap();
        if pool.is_empty() {
            return None;
        }
        let i = rng.below(pool.len() as u64) as usize;
        Some(if remove {
            pool.swap_remove(i)
        } else {
            pool[i].clone()
        })
    }

    /// Takes a reservation out of the gauges, once, before a call that may end it.
    fn uncount(&self, live: &Live) {
        if !live.long {
            return;
        }
        let mut counted = live.counted.lock().unwrap();
        if std::mem::take(&mut *counted) {
            for g in self.combos[live.combo].gauges() {
                self.gauges[g].fetch_sub(1, Ordering::SeqCst);
            }
            self.counted.lock().unwrap().remove(&live.id);
        }
    }

    /// Prints what the ledger says of every reservation counted in gauge
    /// `g` (and of `new`, just granted on combo `ci`): which are HELD.
    fn explain_gauge(&self, g: usize, new: ReservationId, ci: usize) {
        let now = self.now();
        let counted: Vec<(ReservationId, usize)> = self
            .counted
            .lock()
            .unwrap()
            .iter()
            .map(|(id, c)| (*id, *c))
            .collect();
        let mut lines = vec![format!(
            "gauge {g} over capacity at {now:?}; new {new} (combo {ci})"
        )];
        for (id, combo) in counted
            .into_iter()
            .filter(|(_, c)| self.combos[*c].gauges().contains(&g))
        {
            let r = self.ledger.get(now, id);
            lines.push(format!(
                "  counted {} combo {}: {:?} expires {:?} ended {:?} scopes {:?}",
                id,
                combo,
                r.as_ref().map(|r| r.status),
                r.as_ref().map(|r| r.expires_at),
                r.as_ref().map(|r| r.ended_at),
                r.as_ref().map(|r| r
                    .scopes
                    .as_slice()
                    .iter()
                    .map(|k| k.to_string())
                    .collect::<Vec<_>>()),
            ));
        }
        let r = self.ledger.get(now, new);
        lines.push(format!("  new: {:?}", r.map(|r| (r.status, r.expires_at))));
        for key in self.combos[ci].scopes.as_slice() {
            let st = self.ledger.status(now, key);
            let gauge = st
                .limits
                .iter()
                .find(|l| l.window.kind() == WindowKind::Concurrent);
            lines.push(format!(
                "  {}: held_reservations {} gauge {:?}",
                key,
                st.held_reservations,
                gauge.map(|l| (l.held, l.capacity))
            ));
        }
        eprintln!("{}", lines.join("\n"));
    }

    fn reserve(&self, rng: &mut Rng, report: &mut Report) {
        let ci = rng.below(self.combos.len() as u64) as usize;
        let combo = &self.combos[ci];
        let long = rng.chance(50);
        let (tokens, cost_micros) = (rng.range(100, 3_000), rng.range(1_000, 80_000));
        let mut amounts = Amounts::new()
            .with(Dimension::TOKENS, tokens)
            .with(Dimension::COST_MICROS, cost_micros);
        if combo.tool {
            amounts = amounts.with(self.search_calls, 1);
        }
        let mut req = ReserveRequest::new(combo.scopes.clone(), amounts);
        req.ttl_ms = Some(if long {
            LONG_TTL_MS
        } else {
            rng.range(20, 400)
        });
        let id = rng.id(combo.scopes.tenant_name());
        match self.ledger.reserve(self.now(), id, &req) {
            Ok(g) => {
                assert_eq!((g.id, g.status, g.replayed), (id, Status::Held, false));
                report.stats.granted += 1;
                report.granted.push((id, ci));
                if long {
                    self.counted.lock().unwrap().insert(id, ci);
                    for g in combo.gauges() {
                        let held = self.gauges[g].fetch_add(1, Ordering::SeqCst) + 1;
                        if held as u64 > gauge_capacity(g) {
                            self.explain_gauge(g, id, ci);
                        }
                        assert!(
                            held as u64 <= gauge_capacity(g),
                            "gauge {g}: {held} reservations certainly HELD, capacity {}",
                            gauge_capacity(g)
                        );
                    }
                }
                self.pool.lock().unwrap().push(Arc::new(Live {
                    id,
                    combo: ci,
                    long,
                    tokens,
                    cost_micros,
                    counted: Mutex::new(long),
                }));
            }
            Err(ReserveError::Denied(d)) => {
                // A denial is honest: the binding limit really lacks room.
                assert!(
                    i128::from(d.requested) > i128::from(d.remaining),
                    "denied with room: {d}"
                );
                let by = format!("{}/{}/{}", d.scope.kind(), d.dimension, d.window);
                *report.stats.denied_by.entry(by).or_default() += 1;
                match d.kind {
                    DenialKind::RateLimited => {
                        assert!(d.retry_after_ms.is_some_and(|ms| ms >= 1), "{d}");
                        report.stats.rate_limited += 1;
                    }
                    DenialKind::BudgetExhausted => report.stats.budget_exhausted += 1,
                    DenialKind::ExceedsLimit => report.stats.exceeds_limit += 1,
                }
            }
            Err(e) => panic!("reserve {id}: unexpected {e:?}"),
        }
    }

    fn settle(&self, rng: &mut Rng, report: &mut Report) {
        // Mostly the picker owns what it ends; sometimes it leaves the
        // reservation in the pool, so others repeat or race the ending.
        let remove = rng.chance(80);
        let Some(live) = self.pick(rng, remove) else {
            return;
        };
        let combo = &self.combos[live.combo];
        let mut amounts = Amounts::new()
            .with(Dimension::TOKENS, rng.range(0, live.tokens * 3 / 2))
            .with(
                Dimension::COST_MICROS,
                rng.range(0, live.cost_micros * 3 / 2),
            );
        if combo.tool {
            amounts = amounts.with(self.search_calls, rng.below(3));
        }
        let usage = Usage {
            amounts,
            ..Usage::default()
        };
        self.uncount(&live);
        let r = self.ledger.settle_view(self.now(), live.id, &usage);
        match &r {
            Ok(res) => {
                assert_eq!(res.status, Status::Settled, "{}", live.id);
                // A long hold outlives the run: it can never have expired.
                assert!(
                    !(live.long && res.late),
                    "long {} settled late: {res:?}",
                    live.id
                );
            }
            Err(SettleError::Conflict { status }) => {
                assert_eq!(*status, Status::Refunded, "{}", live.id)
            }
            Err(e) => panic!("settle {}: unexpected {e:?}", live.id),
        }
        report.stats.settles += 1;
        report.answers.push((live.id, Answer::Settle(r)));
    }

    fn refund(&self, rng: &mut Rng, report: &mut Report) {
        let remove = rng.chance(80);
        let Some(live) = self.pick(rng, remove) else {
            return;
        };
        self.uncount(&live);
        let r = self.ledger.refund_view(self.now(), live.id);
        match &r {
            Ok(res) => {
                assert!(
                    matches!(res.status, Status::Refunded | Status::Expired),
                    "refund {} answered {}",
                    live.id,
                    res.status
                );
                assert!(
                    !(live.long && res.status == Status::Expired),
                    "long {} expired: {res:?}",
                    live.id
                );
            }
            Err(RefundError::Conflict { status }) => {
                assert_eq!(*status, Status::Settled, "{}", live.id)
            }
            Err(e) => panic!("refund {}: unexpected {e:?}", live.id),
        }
        report.stats.refunds += 1;
        report.answers.push((live.id, Answer::Refund(r)));
    }

    fn extend(&self, rng: &mut Rng, report: &mut Report) {
        let Some(live) = self.pick(rng, false) else {
            return;
        };
        // Long holds keep their lease (a new TTL could only shorten it past
        // the run's end, which the gauges rely on); short ones get a new one.
        let ttl_ms = (!live.long && rng.chance(50)).then(|| rng.range(20, 400));
        let amounts = (ttl_ms.is_none() || rng.chance(50))
            .then(|| Amounts::new().with(Dimension::TOKENS, rng.range(1, 300)));
        match self
            .ledger
            .extend(self.now(), live.id, amounts.as_ref(), ttl_ms)
        {
            Ok(o) => assert_eq!(o.status, Status::Held),
            Err(ExtendError::NotHeld { .. }) => {}
            Err(ExtendError::Denied(d)) => {
                assert!(i128::from(d.requested) > i128::from(d.remaining), "{d}");
                report.stats.extends_denied += 1;
            }
            Err(e) => panic!("extend {}: unexpected {e:?}", live.id),
        }
        report.stats.extends += 1;
    }

    /// Reads a concurrency-limited scope: its gauge never exceeds capacity.
    fn read_gauge(&self, rng: &mut Rng, report: &mut Report) {
        let combo = &self.combos[rng.below(self.combos.len() as u64) as usize];
        let tenant = combo.scopes.tenant_name();
        let name = match rng.below(3) {
            0 => "tool:search".to_string(),
            1 => format!("tenant:{tenant}/user:u{}", rng.below(2)),
            _ => format!("tenant:{tenant}/agent:a{}", rng.below(2)),
        };
        let status = self.ledger.status(self.now(), &key(&name));
        let gauge = find(&status, "concurrent", WindowKind::Concurrent);
        assert!(gauge.held <= gauge.capacity, "{name}: {gauge:?}");
        assert_eq!(gauge.held, status.held_reservations, "{name}");
        report.stats.status_reads += 1;
    }

    fn run_thread(&self, seed: u64, ops: u64) -> Report {
        let mut rng = Rng(seed);
        let mut report = Report::default();
        for _ in 0..ops {
            let crowded = self.pool.lock().unwrap().len() >= 256;
            match rng.below(100) {
                r if r < 45 && !crowded => self.reserve(&mut rng, &mut report),
                r if r < 65 => self.settle(&mut rng, &mut report),
                r if r < 78 => self.refund(&mut rng, &mut report),
                r if r < 86 => self.extend(&mut rng, &mut report),
                r if r < 89 => {
                    self.ledger.expire_due(self.now());
                    report.stats.expire_calls += 1;
                }
                r if r < 95 => {
                    let step = rng.range(1, 50);
                    // Bounded, so long holds outlive the run.
                    let _ = self
                        .clock_ms
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                            (t + step <= START_MS + MAX_ADVANCE_MS).then_some(t + step)
                        });
                }
                _ => self.read_gauge(&mut rng, &mut report),
            }
        }
        report
    }
}

/// Sums per reservation shape, from the settles' answers.
#[derive(Default)]
struct Charged {
    total: u64,
    late: u64,
}

#[test]
fn hammer_many_threads_no_overspend_exact_accounting_each_reservation_ends_once() {
    // Proves, under real contention on multi-shard reservations: concurrent
    // gauges never exceed capacity, invariants hold mid-run and at the end,
    // every `total` limit records exactly what successful settles charged
    // (and no more than capacity plus late settles), and each reservation
    // leaves HELD at most once while repeats answer idempotently.
    const THREADS: u64 = 8;
    let ops = env_or("ALLOWANCE_STRESS_OPS", 3_000);
    let h = Hammer::new();
    let done = AtomicBool::new(false);
    let start = Barrier::new(THREADS as usize + 1);
    let (reports, mid_run_checks) = thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (h, start) = (&h, &start);
                s.spawn(move || {
                    start.wait();
                    h.run_thread(0x5eed_0000 + t, ops)
                })
            })
            .collect();
        // The checker locks every shard while the others run.
        let checker = s.spawn(|| {
            start.wait();
            let mut checks = 0u64;
            // Every concurrency-limited scope, read between the checks: a
            // gauge over its capacity is caught in the act, by the ledger's
            // own figures.
            let mut gauged: Vec<ScopeKey> = vec![key("tool:search")];
            for c in &h.combos {
                let t = c.scopes.tenant_name();
                for n in ["user:u0", "user:u1", "agent:a0", "agent:a1"] {
                    let k = key(&format!("tenant:{t}/{n}"));
                    if !gauged.contains(&k) {
                        gauged.push(k);
                    }
                }
            }
            while !done.load(Ordering::SeqCst) {
                if let Err(e) = h.ledger.check_invariants(h.now()) {
                    panic!("mid-run invariant broken: {e}");
                }
                for k in &gauged {
                    let st = h.ledger.status(h.now(), k);
                    let g = find(&st, "concurrent", WindowKind::Concurrent);
                    assert!(g.held <= g.capacity, "{k}: {g:?} (mid-run)");
                }
                checks += 1;
                thread::sleep(std::time::Duration::from_millis(1));
            }
            checks
        });
        // Joined before any unwrap: a worker's panic must stop the checker
        // too, or the scope would wait for it forever (a hang, not a failure).
        let joined: Vec<_> = workers.into_iter().map(|w| w.join()).collect();
        done.store(true, Ordering::SeqCst);
        let checks = checker.join().unwrap();
        let reports: Vec<Report> = joined.into_iter().map(|r| r.unwrap()).collect();
        (reports, checks)
    });
    assert!(mid_run_checks > 0, "the checker never ran while others did");

    let now = h.now();
    h.ledger.check_invariants(now).unwrap();
    // Every hold has ended once the longest lease has passed; records are
    // kept for a day, so every reservation can still be read back.
    let end = now.saturating_add_ms(LONG_TTL_MS + 1);
    h.ledger.expire_due(end);
    h.ledger.check_invariants(end).unwrap();
    assert_eq!(h.ledger.hold_count(), 0);

    let mut stats = Stats::default();
    let mut granted: Vec<(ReservationId, usize)> = Vec::new();
    let mut answers: HashMap<ReservationId, Vec<Answer>> = HashMap::new();
    for r in reports {
        stats.add(&r.stats);
        granted.extend(r.granted);
        for (id, a) in r.answers {
            answers.entry(id).or_default().push(a);
        }
    }

    let mut tenant_cost: Vec<Charged> = (0..TENANTS).map(|_| Charged::default()).collect();
    let mut agent_tokens: Vec<Charged> = (0..TENANTS * 2).map(|_| Charged::default()).collect();
    let mut tool_calls = Charged::default();
    let (mut settled_n, mut late_n, mut refunded_n, mut expired_n, mut repeats) = (0, 0, 0, 0, 0);
    for &(id, ci) in &granted {
        let combo = &h.combos[ci];
        let mut settled: Vec<&Reservation> = Vec::new();
        let mut refunded: Vec<&Reservation> = Vec::new();
        let (mut refund_saw_expired, mut settle_conflicts, mut refund_conflicts) = (false, 0, 0);
        for a in answers.get(&id).map(Vec::as_slice).unwrap_or_default() {
            match a {
                Answer::Settle(Ok(r)) => settled.push(r),
                Answer::Settle(Err(_)) => settle_conflicts += 1,
                Answer::Refund(Ok(r)) if r.status == Status::Refunded => refunded.push(r),
                Answer::Refund(Ok(_)) => refund_saw_expired = true,
                Answer::Refund(Err(_)) => refund_conflicts += 1,
            }
        }
        // One ending at most: never both settled and refunded, and every
        // repeat of the ending answers the same reservation.
        assert!(
            settled.is_empty() || refunded.is_empty(),
            "{id} was both settled and refunded"
        );
        for r in settled.iter().skip(1) {
            assert_eq!(
                (r.status, &r.charged, r.ended_at, r.late),
                (
                    settled[0].status,
                    &settled[0].charged,
                    settled[0].ended_at,
                    settled[0].late
                ),
                "{id}: a repeated settle answered differently"
            );
        }
        for r in refunded.iter().skip(1) {
            assert_eq!(
                r.ended_at, refunded[0].ended_at,
                "{id}: a repeated refund differs"
            );
        }
        repeats += settled.len().saturating_sub(1) + refunded.len().saturating_sub(1);
        // A conflict names the ending that won, which some call made.
        assert!(settle_conflicts == 0 || !refunded.is_empty(), "{id}");
        assert!(refund_conflicts == 0 || !settled.is_empty(), "{id}");
        // A refund that found it expired comes before any settle, which is late.
        assert!(
            !refund_saw_expired || settled.iter().all(|r| r.late),
            "{id}"
        );

        let last = h.ledger.get(end, id).expect("kept for the retention");
        if let Some(s) = settled.first() {
            assert_eq!(
                (last.status, &last.charged, last.ended_at, last.late),
                (Status::Settled, &s.charged, s.ended_at, s.late),
                "{id}"
            );
            let charged = s
                .charged
                .as_ref()
                .expect("a settled reservation has charged");
            let late = |c: &mut Charged, v: u64| {
                c.total += v;
                if s.late {
                    c.late += v;
                }
            };
            late(
                &mut tenant_cost[combo.tenant],
                charged.get(Dimension::COST_MICROS),
            );
            if let Some(a) = combo.agent {
                late(
                    &mut agent_tokens[combo.tenant * 2 + a],
                    charged.get(Dimension::TOKENS),
                );
            }
            if combo.tool {
                late(&mut tool_calls, charged.get(h.search_calls));
            }
            settled_n += 1;
            late_n += u64::from(s.late);
        } else if let Some(r) = refunded.first() {
            assert_eq!(
                (last.status, last.ended_at),
                (Status::Refunded, r.ended_at),
                "{id}"
            );
            refunded_n += 1;
        } else {
            assert_eq!(last.status, Status::Expired, "{id}");
            expired_n += 1;
        }
    }

    // Every `total` limit recorded exactly what the settles charged, and
    // went past its capacity by no more than late settles brought in.
    let check_total = |scope: &str, dimension: &str, c: &Charged| {
        let st = h.ledger.status(end, &key(scope));
        let l = find(&st, dimension, WindowKind::Total);
        assert_eq!(l.held, 0, "{scope}");
        assert_eq!(
            l.used, c.total as i64,
            "{scope} {dimension}: used vs charged"
        );
        assert!(
            c.total <= l.capacity + c.late,
            "{scope} {dimension}: {} used of {} with {} late",
            c.total,
            l.capacity,
            c.late
        );
    };
    let tenants = spread_tenants(TENANTS);
    for (t, name) in tenants.iter().enumerate() {
        check_total(&format!("tenant:{name}"), "cost_micros", &tenant_cost[t]);
        for a in 0..2 {
            check_total(
                &format!("tenant:{name}/agent:a{a}"),
                "tokens",
                &agent_tokens[t * 2 + a],
            );
        }
    }
    check_total("tool:search", "search_calls", &tool_calls);

    // The run did what it was meant to: every kind of ending happened.
    assert!(
        stats.granted >= 200,
        "too little was granted: {}",
        stats.granted
    );
    assert!(settled_n > 0 && late_n > 0 && refunded_n > 0 && expired_n > 0);
    assert!(stats.rate_limited + stats.budget_exhausted > 0);
    eprintln!(
        "hammer: {THREADS} threads x {ops} ops; granted {}, denied {}/{}/{} (rate/budget/exceeds); \
         settled {settled_n} ({late_n} late), refunded {refunded_n}, expired {expired_n}; \
         {repeats} repeated endings; {} settle and {} refund calls; {} extends ({} denied); \
         {} expire_due, {} gauge reads, {mid_run_checks} mid-run invariant checks; denials by {:?}",
        stats.granted,
        stats.rate_limited,
        stats.budget_exhausted,
        stats.exceeds_limit,
        stats.settles,
        stats.refunds,
        stats.extends,
        stats.extends_denied,
        stats.expire_calls,
        stats.status_reads,
        stats.denied_by,
    );
}

// ---------------------------------------------------------------------------
// Seed 002: forty tasks released at once against a €20.00 daily cap.

const CAP_MICROS: u64 = 20_000_000;
const SPENT_MICROS: u64 = 10_000_000;
const TASK_MICROS: u64 = 4_450_000;
const RACERS: usize = 40;

fn seed002_catalog(calendar: bool) -> Catalog {
    let window = if calendar {
        Window::Calendar {
            unit: CalendarUnit::Day,
            zone: Zone::utc(),
        }
    } else {
        Window::Sliding {
            period_ms: 86_400_000,
            slices: 24,
        }
    };
    let mut c = Catalog::default();
    c.set_plan(
        Plan::new(
            "user-daily",
            vec![limit(Dimension::COST_MICROS, CAP_MICROS, window)],
            OverrunPolicy::ChargeActual,
        )
        .unwrap(),
    );
    c.set_kind("user", Some("user-daily"), false).unwrap();
    c.set_kind("tool", None, true).unwrap();
    c
}

/// One round: a fresh ledger with €10.00 spent, and the request the racers send.
struct Round {
    ledger: SharedLedger,
    req: ReserveRequest,
    now: Timestamp,
    results: Mutex<Vec<Result<Granted, ReserveError>>>,
}

fn check_round(n: u64, calendar: bool, round: &Round) -> Result<(), String> {
    let results = round.results.lock().unwrap();
    let user = &round.req.scopes.as_slice()[1];
    let granted = results.iter().filter(|r| r.is_ok()).count();
    if results.len() != RACERS || granted != 2 {
        return Err(format!(
            "round {n} (calendar: {calendar}): {granted} of {} admitted, expected exactly 2",
            results.len()
        ));
    }
    for r in results.iter() {
        if let Err(e) = r {
            // Every loser saw both winners' holds: €1.10 left, nothing to wait for
            // but the holds, so a retry is advised.
            let ok = matches!(e, ReserveError::Denied(d)
                if d.scope == *user
                    && d.kind == DenialKind::RateLimited
                    && d.remaining == (CAP_MICROS - SPENT_MICROS - 2 * TASK_MICROS) as i64
                    && d.requested == TASK_MICROS);
            if !ok {
                return Err(format!("round {n}: unexpected answer {e:?}"));
            }
        }
    }
    let st = round.ledger.status(round.now, user);
    let l = &st.limits[0];
    if (l.used, l.held) != (SPENT_MICROS as i64, 2 * TASK_MICROS) {
        return Err(format!("round {n}: user limit is {l:?}"));
    }
    round
        .ledger
        .check_invariants(round.now)
        .map_err(|e| format!("round {n}: {e}"))
}

#[test]
fn seed002_forty_racers_against_a_daily_cap_admit_exactly_two() {
    // Proves the reserve is atomic across threads: €10.00 spent of €20.00,
    // forty €4.45 tasks released by one barrier, exactly two admitted (not
    // forty, as check-then-act would) — with a sliding 24 h window and a
    // calendar day, alone and in a reservation spanning shards.
    let rounds = env_or("ALLOWANCE_STRESS_ROUNDS", 200);
    let catalogs = [seed002_catalog(false), seed002_catalog(true)];
    let tenant = (0..)
        .map(|i| format!("acme{i}"))
        .find(|t| shard_of(t) != shard_of("tool:search"))
        .unwrap();
    let slot: Arc<Mutex<Option<Arc<Round>>>> = Arc::new(Mutex::new(None));
    let barrier = Arc::new(Barrier::new(RACERS + 1));
    // Detached threads, not scoped: a failing round must not leave the
    // test waiting for racers parked on the barrier.
    let racers: Vec<_> = (0..RACERS)
        .map(|t| {
            let (slot, barrier, tenant) = (slot.clone(), barrier.clone(), tenant.clone());
            thread::spawn(move || {
                let mut rng = Rng(0x0002_0000 + t as u64);
                loop {
                    barrier.wait();
                    let Some(round) = slot.lock().unwrap().clone() else {
                        return;
                    };
                    let r = round.ledger.reserve(round.now, rng.id(&tenant), &round.req);
                    round.results.lock().unwrap().push(r);
                    barrier.wait();
                }
            })
        })
        .collect();

    let mut failure = None;
    for n in 0..rounds {
        let calendar = n % 2 == 1;
        let spans_shards = n % 4 >= 2;
        let ledger = SharedLedger::new(catalogs[usize::from(calendar)].clone(), SHARDS);
        // A fresh user each round, at noon UTC of a different day: no window
        // or calendar boundary falls inside a round.
        let now = Timestamp::from_millis(1_741_953_600_000 + n * 86_400_000);
        let user = format!("u{n}");
        let mut named = vec![("user", user.as_str())];
        if spans_shards {
            named.push(("tool", "search"));
        }
        let scopes = ledger.catalog().scope_set(&tenant, &named).unwrap();
        let spend = ReserveRequest::new(
            scopes.clone(),
            Amounts::new().with(Dimension::COST_MICROS, SPENT_MICROS),
        );
        let first = ReservationId::mint(u128::from(n) << 64, &tenant);
        ledger.reserve(now, first, &spend).unwrap();
        let usage = Usage {
            amounts: Amounts::new().with(Dimension::COST_MICROS, SPENT_MICROS),
            ..Usage::default()
        };
        ledger.settle(now, first, &usage).unwrap();
        let round = Arc::new(Round {
            ledger,
            req: ReserveRequest::new(
                scopes,
                Amounts::new().with(Dimension::COST_MICROS, TASK_MICROS),
            ),
            now,
            results: Mutex::new(Vec::with_capacity(RACERS)),
        });
        *slot.lock().unwrap() = Some(round.clone());
        barrier.wait(); // release the racers
        barrier.wait(); // every racer has its answer
        if let Err(e) = check_round(n, calendar, &round) {
            failure = Some(e);
            break;
        }
    }
    *slot.lock().unwrap() = None;
    barrier.wait();
    for r in racers {
        r.join().unwrap();
    }
    if let Some(e) = failure {
        panic!("{e}");
    }
}

// ---------------------------------------------------------------------------
// Two threads: disjoint tenants, one hot tenant, and a shared scope.

const DRAIN_CAP: u64 = 1_000;
const DRAIN_STEP: u64 = 7;

/// Reserves and settles `DRAIN_STEP` tokens until a hard stop; answers how
/// many were admitted.
fn drain(ledger: &SharedLedger, scopes: &ScopeSet, seed: u64) -> u64 {
    let mut rng = Rng(seed);
    let req = ReserveRequest::new(
        scopes.clone(),
        Amounts::new().with(Dimension::TOKENS, DRAIN_STEP),
    );
    let usage = Usage {
        amounts: Amounts::new().with(Dimension::TOKENS, DRAIN_STEP),
        ..Usage::default()
    };
    let now = Timestamp::from_millis(START_MS);
    let mut admitted = 0;
    for _ in 0..100_000 {
        let id = rng.id(scopes.tenant_name());
        match ledger.reserve(now, id, &req) {
            Ok(_) => {
                admitted += 1;
                let o = ledger.settle(now, id, &usage).unwrap();
                assert_eq!(o.charged.unwrap().get(Dimension::TOKENS), DRAIN_STEP);
            }
            // The other thread's hold is in the way: it settles soon.
            Err(ReserveError::Denied(d)) if d.kind == DenialKind::RateLimited => {
                thread::yield_now()
            }
            Err(ReserveError::Denied(d)) if d.kind == DenialKind::BudgetExhausted => {
                assert!(d.remaining < DRAIN_STEP as i64, "{d}");
                return admitted;
            }
            Err(e) => panic!("unexpected {e:?}"),
        }
    }
    panic!("never exhausted: a live lock between two threads");
}

#[test]
fn two_threads_disjoint_hot_and_shared_drain_exactly_to_the_cap() {
    // Proves that two threads draining a `total` budget, each on its own
    // tenant, both on one hot tenant, or on two tenants through one shared
    // scope in another shard, together admit exactly ⌊cap / step⌋ per
    // budget — never one more, never one fewer.
    let per_budget = DRAIN_CAP / DRAIN_STEP;
    let mut c = Catalog::default();
    let total = |name: &str, cap| {
        Plan::new(
            name,
            vec![limit(Dimension::TOKENS, cap, Window::Total)],
            OverrunPolicy::ChargeActual,
        )
        .unwrap()
    };
    c.set_plan(total("tight", DRAIN_CAP));
    c.set_plan(total("roomy", 1_000_000));
    c.set_kind("tenant", Some("tight"), false).unwrap();
    c.set_kind("agent", None, false).unwrap();
    c.set_kind("tool", Some("tight"), true).unwrap();
    let tenants = spread_tenants(3);
    let (a, b) = (&tenants[1], &tenants[2]);
    for round in 0..20u64 {
        for case in ["disjoint", "hot", "shared"] {
            let ledger = SharedLedger::new(c.clone(), SHARDS);
            let cat = ledger.catalog();
            let scopes = match case {
                "disjoint" => [
                    cat.scope_set(a, &[("agent", "x")]).unwrap(),
                    cat.scope_set(b, &[("agent", "y")]).unwrap(),
                ],
                "hot" => [
                    cat.scope_set(a, &[("agent", "x")]).unwrap(),
                    cat.scope_set(a, &[("agent", "y")]).unwrap(),
                ],
                _ => {
                    // The tool binds, the tenants do not.
                    for t in [a, b] {
                        ledger
                            .update_catalog(|c| {
                                c.set_override(
                                    key(&format!("tenant:{t}")),
                                    Override::Plan("roomy".into()),
                                )
                            })
                            .unwrap();
                    }
                    [
                        cat.scope_set(a, &[("tool", "search")]).unwrap(),
                        cat.scope_set(b, &[("tool", "search")]).unwrap(),
                    ]
                }
            };
            let counts: Vec<u64> = thread::scope(|s| {
                let hs: Vec<_> = scopes
                    .iter()
                    .enumerate()
                    .map(|(i, sc)| {
                        let ledger = &ledger;
                        s.spawn(move || drain(ledger, sc, round * 2 + i as u64))
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let now = Timestamp::from_millis(START_MS);
            ledger.check_invariants(now).unwrap();
            assert_eq!(ledger.hold_count(), 0);
            let used = |name: &str| ledger.status(now, &key(name)).limits[0].used;
            let spent = (per_budget * DRAIN_STEP) as i64;
            match case {
                "disjoint" => {
                    assert_eq!(counts, [per_budget, per_budget], "{case} round {round}");
                    assert_eq!(used(&format!("tenant:{a}")), spent);
                    assert_eq!(used(&format!("tenant:{b}")), spent);
                }
                "hot" => {
                    assert_eq!(
                        counts.iter().sum::<u64>(),
                        per_budget,
                        "{case} round {round}"
                    );
                    assert_eq!(used(&format!("tenant:{a}")), spent);
                }
                _ => {
                    assert_eq!(
                        counts.iter().sum::<u64>(),
                        per_budget,
                        "{case} round {round}"
                    );
                    assert_eq!(used("tool:search"), spent);
                }
            }
        }
    }
}

/// Snapshots taken while threads reserve and settle on many tenants, over
/// a ledger large enough that the snapshot copies its shards on several
/// threads: each is the ledger at its cut — every change journaled before
/// the cut is in it, none after, for every reservation.
#[test]
fn snapshots_amid_traffic_are_the_ledger_at_their_cuts() {
    let mut catalog = Catalog::default();
    let open = Plan::new(
        "open",
        vec![limit(
            Dimension::TOKENS,
            MAX_AMOUNT,
            Window::Sliding {
                period_ms: 3_600_000,
                slices: 12,
            },
        )],
        OverrunPolicy::ChargeActual,
    )
    .expect("plan");
    catalog.set_plan(open);
    catalog
        .set_kind("tenant", Some("open"), false)
        .expect("kind");
    catalog.set_kind("user", Some("open"), false).expect("kind");
    catalog.set_kind("tool", Some("open"), true).expect("kind");
    let ledger = Arc::new(SharedLedger::new(catalog, 16));
    let changes = Arc::new(Changes::default());
    let now = Timestamp::from_millis(1_741_953_600_000);
    let tenants: Arc<Vec<String>> = Arc::new((0..48).map(|i| format!("t{i}")).collect());
    let pair = move |l: &SharedLedger, j: &Changes, rng: &mut Rng, settle: bool| {
        let tenant = &tenants[rng.below(tenants.len() as u64) as usize];
        let user = format!("u{}", rng.below(20));
        let mut pairs = vec![("user", user.as_str())];
        if rng.chance(30) {
            pairs.push(("tool", "search"));
        }
        let scopes = l.catalog().scope_set(tenant, &pairs).expect("scopes");
        let id = rng.id(tenant);
        let req = ReserveRequest::new(scopes, Amounts::new().with(Dimension::TOKENS, 5));
        l.reserve_journaled(now, id, &req, j).0.expect("reserve");
        if settle {
            let usage = Usage {
                amounts: Amounts::new().with(Dimension::TOKENS, 3),
                ..Usage::default()
            };
            l.settle_journaled(now, id, &usage, j).expect("settle");
        }
    };
    // Past the size from which a snapshot copies on several threads.
    let mut rng = Rng(7);
    for i in 0..52_000u64 {
        pair(&ledger, &changes, &mut rng, !i.is_multiple_of(4));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..2u64)
        .map(|w| {
            let (ledger, changes, stop) = (ledger.clone(), changes.clone(), stop.clone());
            let pair = pair.clone();
            thread::spawn(move || {
                let mut rng = Rng(100 + w);
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) || i < 200 {
                    pair(&ledger, &changes, &mut rng, !i.is_multiple_of(3));
                    i += 1;
                }
            })
        })
        .collect();
    let rounds = env_or("ALLOWANCE_STRESS_ROUNDS", 200).div_ceil(100).max(2);
    let mut cuts = Vec::new();
    for _ in 0..rounds {
        let (at_cut, snapshot) = ledger.snapshot_with(|| changes.len());
        cuts.push((at_cut, snapshot));
        thread::sleep(std::time::Duration::from_millis(5));
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().expect("worker");
    }
    let log = changes.so_far();
    for (at_cut, snapshot) in cuts {
        let mut expected: HashMap<ReservationId, Status> = HashMap::new();
        for (id, status) in &log[..at_cut] {
            expected.insert(*id, *status);
        }
        let restored = SharedLedger::from_snapshot(snapshot, 16).expect("restore");
        assert_eq!(
            restored.known_reservations().len(),
            expected.len(),
            "cut at {at_cut}"
        );
        // Everything after the cut: absent, or as it was at the cut.
        for (id, _) in &log[at_cut..] {
            let found = restored.get(now, *id).map(|r| r.status);
            assert_eq!(found, expected.get(id).copied(), "{id:?}, cut at {at_cut}");
        }
        for (id, status) in &expected {
            let found = restored.get(now, *id).map(|r| r.status);
            assert_eq!(found, Some(*status), "{id:?}, cut at {at_cut}");
        }
    }
}
