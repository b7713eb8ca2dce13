//! Property test: the ledger agrees with a deliberately naive reference model
//! over long random histories.
//!
//! Each generated history (50–200 operations) mixes reserve (any subset of
//! scopes over 3 tenants, plus the shared `tool:search` and `tool:ocr`, so
//! holds cross shards), settle (below, at and above the hold, with tool
//! charges in a custom dimension), refund, extend, clock moves (small steps,
//! slice widths, calendar boundaries, TTLs and jumps of hours), plan changes
//! at run time (a kind's default plan, a plan redefined, per-scope overrides
//! set and cleared), admin adjustments, dry runs, idempotent replays and
//! conflicts, reused ids, `expire_due`, and repeats on ended reservations.
//! The same history runs against a [`Ledger`] and a 4-shard [`SharedLedger`].
//!
//! The model shares no ledger logic with the engine (it borrows only
//! [`window_bounds`] for calendar boundaries, and the documented routing of
//! `SharedLedger` to count its holds): it keeps every settled usage event
//! in a `Vec` and recomputes each window from scratch at every read —
//! sliding windows by summing the events of the last `slices` slices,
//! calendar windows from [`window_bounds`], totals as the sum of everything
//! minus admin credits, buckets with the closed form of a token bucket
//! (deficit = max over suffixes of the usage since an event minus the refill
//! since it), holds by scanning the live reservations. It decides every
//! grant and denial itself (kind, scope, limit, retry_after, resets_at).
//!
//! After every step, for both engines: every scope's status and every
//! reservation must equal the model's, and the invariants must hold.
//!
//! 64 cases by default; `ALLOWANCE_PROPTEST_CASES=2000` for a soak run
//! (`cargo test --release -p allowance-core --test model`), and
//! `ALLOWANCE_PROPTEST_STATS=1` (with `--nocapture`) prints how often each
//! outcome happened. Failures are kept in `tests/model.proptest-regressions`
//! and replayed first.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use allowance_core::calendar::window_bounds;
use allowance_core::*;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{FileFailurePersistence, TestRunner};

// ---------------------------------------------------------------- the setup

/// A realistic instant (2023-11-14T22:13:20Z): calendar arithmetic near the
/// epoch would hide nothing, but an engine that confuses "0" with "unset"
/// only shows up away from it.
const T0_MS: u64 = 1_700_000_000_000;
const DEFAULT_TTL_MS: u64 = 20_000;
const MAX_TTL_MS: u64 = 120_000;
/// Short retentions, so that big clock jumps make the ledger forget ended
/// reservations and idempotency keys within one history.
const IDEMPOTENCY_RETENTION_MS: u64 = 1_800_000;
const ENDED_RETENTION_MS: u64 = 7_200_000;
const SHARDS: usize = 4;
/// Most holds a denial looks at for the earliest one holding the refused
/// dimension (the engine's and the Redis store's bound).
const HOLD_WALK: usize = 64;
const MAX: u64 = MAX_AMOUNT;
const SEARCH: &str = "search_calls";
const PRICED: &str = "gpt-priced";
const UNPRICED: &str = "gpt-unpriced";
const PRICE_IN: u128 = 2_500_000;
const PRICE_CACHED: u128 = 1_250_000;
const PRICE_OUT: u128 = 10_000_000;

const IN: Dimension = Dimension::INPUT_TOKENS;
const OUT: Dimension = Dimension::OUTPUT_TOKENS;
const TOKENS: Dimension = Dimension::TOKENS;
const COST: Dimension = Dimension::COST_MICROS;
const REQUESTS: Dimension = Dimension::REQUESTS;
const CONCURRENT: Dimension = Dimension::CONCURRENT;

/// The kinds, and whether each is shared.
const KINDS: [(&str, bool); 4] = [
    ("tenant", false),
    ("user", false),
    ("agent", false),
    ("tool", true),
];
/// Named plans; plan `i` starts with the contents `i` of [`pool`].
const PLAN_NAMES: [&str; 11] = [
    "tenant", "tenant2", "tenant3", "user", "user2", "agent", "agent2", "tool", "tool2", "tiny",
    "huge",
];
/// The default plan of each kind at the start.
const KIND_PLANS: [usize; 4] = [0, 3, 5, 7];
/// Every capacity of the pool: amounts are biased to these, ±1.
const CAPS: [u64; 22] = [
    1, 2, 3, 4, 5, 6, 8, 10, 500, 800, 1000, 1500, 2000, 3000, 4000, 5000, 10_000, 20_000, 50_000,
    100_000, 200_000, MAX,
];
/// Step sizes equal to the slice widths of the pool's sliding windows (and one that is not).
const SLICE_WIDTHS_MS: [u64; 5] = [1000, 2000, 5000, 10_000, 20_000];

/// The contents of a plan: limits and overrun policy.
#[derive(Clone, Debug)]
struct Contents {
    own_name: &'static str,
    limits: Vec<(Dimension, u64, Window)>,
    overrun: OverrunPolicy,
}

fn sliding(period_ms: u64, slices: u32) -> Window {
    Window::Sliding { period_ms, slices }
}

fn calendar(unit: CalendarUnit) -> Window {
    Window::Calendar {
        unit,
        zone: Zone::utc(),
    }
}

fn bucket(period_ms: u64) -> Window {
    Window::Bucket { period_ms }
}

/// Every window kind and every overrun policy, with capacities small enough
/// that histories hit them. Some pairs share a (dimension, window) with a
/// different capacity, so plan changes keep history across a new capacity.
fn pool(search: Dimension) -> Vec<Contents> {
    use CalendarUnit::{Hour, Minute};
    use OverrunPolicy::*;
    let c = |own_name, limits, overrun| Contents {
        own_name,
        limits,
        overrun,
    };
    vec![
        c(
            "own-tenant",
            vec![
                (TOKENS, 5000, sliding(60_000, 6)),
                (COST, 200_000, Window::Total),
                (REQUESTS, 10, bucket(10_000)),
                (CONCURRENT, 4, Window::Concurrent),
            ],
            ChargeActual,
        ),
        c(
            "own-tenant2",
            vec![
                (TOKENS, 3000, sliding(60_000, 6)),
                (COST, 100_000, calendar(Hour)),
                (REQUESTS, 5, bucket(10_000)),
                (CONCURRENT, 2, Window::Concurrent),
            ],
            CapAtEstimate,
        ),
        c(
            "own-tenant3",
            vec![
                (TOKENS, 4000, bucket(30_000)),
                (TOKENS, 20_000, Window::Total),
                (COST, MAX, Window::Total),
            ],
            AllowOverrun { percent: 10 },
        ),
        c(
            "own-user",
            vec![
                (TOKENS, 2000, calendar(Minute)),
                (REQUESTS, 3, sliding(4000, 4)),
            ],
            ChargeActual,
        ),
        c(
            "own-user2",
            vec![
                (TOKENS, 10_000, Window::Total),
                (CONCURRENT, 2, Window::Concurrent),
                (IN, 1500, sliding(4000, 4)),
            ],
            AllowOverrun { percent: 50 },
        ),
        c(
            "own-agent",
            vec![(TOKENS, 1000, sliding(4000, 4)), (OUT, 500, bucket(5000))],
            ChargeActual,
        ),
        c(
            "own-agent2",
            vec![
                (IN, 800, calendar(Minute)),
                (CONCURRENT, 1, Window::Concurrent),
                (COST, 20_000, sliding(60_000, 3)),
            ],
            CapAtEstimate,
        ),
        c(
            "own-tool",
            vec![
                (search, 4, calendar(Minute)),
                (REQUESTS, 6, sliding(10_000, 2)),
                (CONCURRENT, 3, Window::Concurrent),
            ],
            ChargeActual,
        ),
        c(
            "own-tool2",
            vec![
                (search, 10, bucket(60_000)),
                (COST, 50_000, sliding(60_000, 3)),
                (REQUESTS, 8, sliding(10_000, 2)),
            ],
            ChargeActual,
        ),
        c(
            "own-tiny",
            vec![(REQUESTS, 2, Window::Total), (TOKENS, 1, calendar(Hour))],
            AllowOverrun { percent: 0 },
        ),
        c(
            "own-huge",
            vec![
                (TOKENS, MAX, sliding(4000, 4)),
                (COST, MAX, bucket(10_000)),
                (search, MAX, Window::Total),
                (REQUESTS, 8, bucket(5000)),
            ],
            ChargeActual,
        ),
    ]
}

fn build_plan(name: &str, c: &Contents) -> Arc<Plan> {
    let limits = c
        .limits
        .iter()
        .map(|(d, cap, w)| Limit::new(*d, *cap, w.clone()).expect("the pool's limits are valid"))
        .collect();
    Plan::new(name, limits, c.overrun).expect("the pool's plans are valid")
}

fn price() -> ModelPrice {
    ModelPrice {
        input_micros_per_million: PRICE_IN as u64,
        cached_input_micros_per_million: PRICE_CACHED as u64,
        output_micros_per_million: PRICE_OUT as u64,
        max_output_tokens: 4096,
        tokenizer: "o200k_base".into(),
    }
}

fn settings() -> Settings {
    Settings {
        default_ttl_ms: DEFAULT_TTL_MS,
        max_ttl_ms: MAX_TTL_MS,
        idempotency_retention_ms: IDEMPOTENCY_RETENTION_MS,
        ended_retention_ms: ENDED_RETENTION_MS,
        ..Settings::default()
    }
}

/// The catalog both engines start from.
fn catalog() -> (Catalog, Dimension) {
    let mut c = Catalog::new(settings()).expect("valid settings");
    let search = c.add_dimension(SEARCH).expect("a valid dimension name");
    c.set_model(PRICED, price()).expect("a valid model");
    for (name, contents) in PLAN_NAMES.iter().zip(pool(search)) {
        c.set_plan(build_plan(name, &contents));
    }
    for ((kind, shared), plan) in KINDS.iter().zip(KIND_PLANS) {
        c.set_kind(kind, Some(PLAN_NAMES[plan]), *shared)
            .expect("a valid kind");
    }
    (c, search)
}

/// The shard a scope lives in: tenant scopes with their tenant, shared
/// scopes by their own name (the routing `SharedLedger` documents).
fn shard_of(key: &ScopeKey) -> usize {
    let name = key.tenant_name().unwrap_or(key.as_str());
    usize::from(ReservationId::tenant_tag(name)) % SHARDS
}

/// Three tenants in three different shards, so that the shared scopes are
/// foreign to at least two of them.
fn tenants() -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for i in 0.. {
        let name = format!("t{i}");
        let shard = shard_of(&ScopeKey::tenant(&name).expect("a valid tenant"));
        let taken = out
            .iter()
            .any(|t| shard_of(&ScopeKey::tenant(t).expect("a valid tenant")) == shard);
        if !taken {
            out.push(name);
        }
        if out.len() == 3 {
            break;
        }
    }
    out
}

fn dim_name(d: Dimension) -> &'static str {
    d.builtin_name().unwrap_or(SEARCH)
}

fn ts(ms: u64) -> Timestamp {
    Timestamp::from_millis(ms)
}

/// Past the end of time, instants and durations saturate (a bucket 2^53
/// short of a capacity of 10 a minute refills in ~10^12 years).
fn sat_u64(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

fn sat_i64(v: i128) -> i64 {
    v.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

fn invalid(field: impl Into<String>) -> Invalid {
    Invalid::new(field, "")
}

/// How often each outcome happened over all cases: printed with
/// `ALLOWANCE_PROPTEST_STATS=1`, to see that histories reach every path.
static STATS: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());

fn tally(what: impl Into<String>) {
    let mut stats = STATS.lock().unwrap_or_else(|e| e.into_inner());
    *stats.entry(what.into()).or_default() += 1;
}

fn denial_name(d: &Denial) -> String {
    format!(
        "{} on {} {}",
        d.kind.as_str(),
        d.window.as_str(),
        d.dimension
    )
}

// ---------------------------------------------------------- the model

#[derive(Clone, Debug)]
struct MLimit {
    dim: Dimension,
    cap: u64,
    window: Window,
    /// Events (and credits) with a sequence number below this one happened
    /// before this limit joined the scope's plan: they do not count.
    since_seq: u64,
    /// `(from_ms, capacity)`: a bucket refills at the capacity in force.
    caps: Vec<(u64, u64)>,
}

#[derive(Clone, Debug)]
struct MScope {
    plan: String,
    overrun: OverrunPolicy,
    limits: Vec<MLimit>,
}

#[derive(Clone, Copy, Debug)]
struct Event {
    seq: u64,
    at_ms: u64,
    dim: Dimension,
    amount: u64,
}

#[derive(Clone, Copy, Debug)]
enum MOverride {
    Plan(usize),
    Own(usize),
}

#[derive(Clone, Debug)]
struct MRec {
    res: Reservation,
    sent: Amounts,
    scopes: Vec<usize>,
    /// When the ledger may forget it (once ended).
    drop_at: u64,
    /// Holds it makes in a 4-shard ledger (one per shard it touches).
    holds: u64,
}

struct Model {
    now: u64,
    search: Dimension,
    seq: u64,
    pool: Vec<Contents>,
    plans: Vec<usize>,
    kinds: Vec<Option<usize>>,
    overrides: HashMap<usize, MOverride>,
    universe: Vec<ScopeKey>,
    index: HashMap<String, usize>,
    /// Each scope as its last journaled operation left it (see
    /// [`Model::view`]).
    scopes: Vec<MScope>,
    /// Configuration changes so far, and as of which each scope was moved.
    version: u64,
    synced: Vec<u64>,
    events: Vec<Vec<Event>>,
    credits: Vec<Vec<(u64, Dimension, i64)>>,
    records: BTreeMap<ReservationId, MRec>,
    idempotency: HashMap<(String, String), ReservationId>,
    expired: u64,
}

fn kind_index(key: &ScopeKey) -> usize {
    KINDS
        .iter()
        .position(|(k, _)| *k == key.kind())
        .expect("a configured kind")
}

impl Model {
    fn new(search: Dimension, universe: Vec<ScopeKey>, now: u64) -> Self {
        let index = universe
            .iter()
            .enumerate()
            .map(|(i, k)| (k.as_str().to_string(), i))
            .collect();
        let n = universe.len();
        let mut m = Model {
            now,
            search,
            seq: 0,
            pool: pool(search),
            plans: (0..PLAN_NAMES.len()).collect(),
            kinds: KIND_PLANS.iter().map(|&p| Some(p)).collect(),
            overrides: HashMap::new(),
            universe,
            index,
            scopes: vec![
                MScope {
                    plan: String::new(),
                    overrun: OverrunPolicy::ChargeActual,
                    limits: Vec::new(),
                };
                n
            ],
            version: 0,
            synced: vec![u64::MAX; n],
            events: vec![Vec::new(); n],
            credits: vec![Vec::new(); n],
            records: BTreeMap::new(),
            idempotency: HashMap::new(),
            expired: 0,
        };
        for s in 0..n {
            m.sync(s);
        }
        m
    }

    /// The plan in force for scope `s`: its override, else its kind's plan.
    fn resolve(&self, s: usize) -> Option<(String, &Contents)> {
        match self.overrides.get(&s) {
            Some(MOverride::Own(c)) => Some((self.pool[*c].own_name.to_string(), &self.pool[*c])),
            Some(MOverride::Plan(p)) => {
                Some((PLAN_NAMES[*p].to_string(), &self.pool[self.plans[*p]]))
            }
            None => self.kinds[kind_index(&self.universe[s])]
                .map(|p| (PLAN_NAMES[p].to_string(), &self.pool[self.plans[p]])),
        }
    }

    /// Scope `s` as an operation now sees it. A configuration change moves
    /// a scope to its plan at the scope's next journaled operation (a
    /// granted reserve, a growing extend, a settle, an adjustment: see
    /// [`Model::sync`]), keeping the history of each limit whose dimension
    /// and window it had; the old plan governs until then (a bucket
    /// refills at its old capacity). Anything else, a read, a denial or a
    /// dry run, sees the scope moved now, on a copy.
    fn view(&self, s: usize) -> MScope {
        let stored = &self.scopes[s];
        if self.synced[s] == self.version {
            return stored.clone();
        }
        let (plan, overrun, limits) = match self.resolve(s) {
            Some((name, c)) => (name, c.overrun, c.limits.clone()),
            None => ("unlimited".to_string(), OverrunPolicy::ChargeActual, vec![]),
        };
        let limits = limits
            .into_iter()
            .map(|(dim, cap, window)| {
                match stored
                    .limits
                    .iter()
                    .find(|o| o.dim == dim && o.window == window)
                {
                    Some(o) => {
                        let mut caps = o.caps.clone();
                        if caps.last().map(|c| c.1) != Some(cap) {
                            caps.push((self.now, cap));
                        }
                        MLimit {
                            dim,
                            cap,
                            window,
                            since_seq: o.since_seq,
                            caps,
                        }
                    }
                    None => MLimit {
                        dim,
                        cap,
                        window,
                        since_seq: self.seq,
                        caps: vec![(self.now, cap)],
                    },
                }
            })
            .collect();
        MScope {
            plan,
            overrun,
            limits,
        }
    }

    /// A journaled operation on scope `s`: it moves to its plan now.
    fn sync(&mut self, s: usize) {
        self.scopes[s] = self.view(s);
        self.synced[s] = self.version;
    }

    /// After a configuration change: scopes move at their next journaled
    /// operation.
    fn reconfigured(&mut self) {
        self.version += 1;
    }

    // ---- time

    fn keep_ms(res: &Reservation) -> u64 {
        if res.idempotency_key.is_some() {
            ENDED_RETENTION_MS.max(IDEMPOTENCY_RETENTION_MS)
        } else {
            ENDED_RETENTION_MS
        }
    }

    /// Moves to `now`: holds due expire, ended reservations past their
    /// retention are forgotten (and their idempotency keys with them).
    fn observe(&mut self, now: u64) {
        assert!(now >= self.now, "the test never moves the clock back");
        self.now = now;
        for rec in self.records.values_mut() {
            if rec.res.status == Status::Held && rec.res.expires_at.as_millis() <= now {
                rec.res.status = Status::Expired;
                rec.res.ended_at = Some(rec.res.expires_at);
                // The retention of the record runs from the expiry itself,
                // not from when it was observed: what is remembered is a
                // function of time alone, so a ledger rebuilt from its log
                // remembers exactly what the live one did.
                rec.drop_at = rec.res.expires_at.as_millis() + Self::keep_ms(&rec.res);
                self.expired += 1;
                tally("observe: hold expired");
            }
        }
        let gone: Vec<ReservationId> = self
            .records
            .iter()
            .filter(|(_, r)| r.res.status != Status::Held && r.drop_at <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            let rec = self.records.remove(&id).expect("listed above");
            tally("observe: reservation forgotten after its retention");
            if let Some(key) = &rec.res.idempotency_key {
                let k = (rec.res.scopes.tenant_name().to_string(), key.to_string());
                if self.idempotency.get(&k) == Some(&id) {
                    self.idempotency.remove(&k);
                }
            }
        }
    }

    // ---- reads, recomputed from scratch

    fn live(&self, s: usize) -> impl Iterator<Item = &MRec> + '_ {
        let now = self.now;
        self.records.values().filter(move |r| {
            r.res.status == Status::Held
                && now < r.res.expires_at.as_millis()
                && r.scopes.contains(&s)
        })
    }

    fn held(&self, s: usize, dim: Dimension) -> u64 {
        self.live(s).fold(0u64, |acc, r| {
            let a = if dim.is_implied() {
                1
            } else {
                r.res.held.get(dim)
            };
            acc.saturating_add(a)
        })
    }

    fn held_count(&self, s: usize) -> u64 {
        self.live(s).count() as u64
    }

    fn earliest_expiry(&self, s: usize) -> Option<u64> {
        self.live(s).map(|r| r.res.expires_at.as_millis()).min()
    }

    /// The expiry of the earliest live hold on `s` that holds some of
    /// `dim` (every hold holds the implied dimensions), `skip`'s aside;
    /// looking at no more than the [`HOLD_WALK`] earliest holds (`skip`'s
    /// counted), and answering the last of those when none of them does.
    fn earliest_holding(
        &self,
        s: usize,
        dim: Dimension,
        skip: Option<ReservationId>,
    ) -> Option<u64> {
        let mut holds: Vec<(u64, bool)> = self
            .live(s)
            .map(|r| {
                let holds_dim = dim.is_implied() || r.res.held.get(dim) > 0;
                (
                    r.res.expires_at.as_millis(),
                    holds_dim && Some(r.res.id) != skip,
                )
            })
            .collect();
        holds.sort_unstable();
        holds.truncate(HOLD_WALK);
        let found = holds.iter().find(|h| h.1).map(|h| h.0);
        if found.is_some() && found != self.earliest_expiry(s) {
            tally("denial: a hold-based retry passed holds that hold none of the dimension");
        }
        found.or(holds.last().map(|h| h.0))
    }

    fn counted<'a>(&'a self, s: usize, l: &'a MLimit) -> impl Iterator<Item = &'a Event> + 'a {
        self.events[s]
            .iter()
            .filter(move |e| e.seq >= l.since_seq && e.dim == l.dim)
    }

    /// Slices of a sliding window in the window at `at_ms`: `[lo, cur]`.
    fn slice_range(period_ms: u64, slices: u32, at_ms: u64) -> (u64, u64, u64) {
        let w = period_ms / u64::from(slices);
        let cur = at_ms / w;
        (w, (cur + 1).saturating_sub(u64::from(slices)), cur)
    }

    /// Sliding usage at `at_ms` of the events recorded so far.
    fn sliding_used(&self, s: usize, l: &MLimit, at_ms: u64) -> u128 {
        let Window::Sliding { period_ms, slices } = l.window else {
            unreachable!("a sliding limit")
        };
        let (w, lo, _) = Self::slice_range(period_ms, slices, at_ms);
        self.counted(s, l)
            .filter(|e| e.at_ms / w >= lo)
            .map(|e| u128::from(e.amount))
            .sum()
    }

    /// Refill of a bucket between two instants, in units × period: the
    /// capacity in force at each instant per ms.
    fn refill(l: &MLimit, from: u64, to: u64) -> u128 {
        let mut total = 0u128;
        for (i, &(start, cap)) in l.caps.iter().enumerate() {
            let end = l.caps.get(i + 1).map_or(u64::MAX, |c| c.0);
            let (a, b) = (start.max(from), end.min(to));
            if b > a {
                total += u128::from(cap) * u128::from(b - a);
            }
        }
        total
    }

    /// A bucket's deficit (capacity − level) × period, in closed form: a
    /// bucket that starts full and refills continuously is short, now, of
    /// the largest "usage since event k minus refill since event k" (or of
    /// nothing).
    fn bucket_deficit(&self, s: usize, l: &MLimit) -> u128 {
        let Window::Bucket { period_ms } = l.window else {
            unreachable!("a bucket limit")
        };
        let events: Vec<&Event> = self.counted(s, l).collect();
        let mut best = 0u128;
        let mut since = 0u128;
        for e in events.iter().rev() {
            since += u128::from(e.amount) * u128::from(period_ms);
            best = best.max(since.saturating_sub(Self::refill(l, e.at_ms, self.now)));
        }
        best
    }

    fn used(&self, s: usize, l: &MLimit) -> i128 {
        match &l.window {
            Window::Sliding { .. } => self.sliding_used(s, l, self.now) as i128,
            Window::Bucket { period_ms } => {
                self.bucket_deficit(s, l).div_ceil(u128::from(*period_ms)) as i128
            }
            Window::Calendar { unit, zone } => {
                let (start, end) = window_bounds(*unit, zone, self.now);
                self.counted(s, l)
                    .filter(|e| start <= e.at_ms && e.at_ms < end)
                    .map(|e| i128::from(e.amount))
                    .sum()
            }
            Window::Total => {
                let used: i128 = self.counted(s, l).map(|e| i128::from(e.amount)).sum();
                let credit: i128 = self.credits[s]
                    .iter()
                    .filter(|(seq, d, _)| *seq >= l.since_seq && *d == l.dim)
                    .map(|(_, _, c)| i128::from(*c))
                    .sum();
                used - credit
            }
            Window::Concurrent => 0,
        }
    }

    /// When room next appears without new traffic.
    fn resets_at(&self, s: usize, l: &MLimit) -> Option<u64> {
        match &l.window {
            Window::Sliding { period_ms, slices } => {
                let (w, lo, _) = Self::slice_range(*period_ms, *slices, self.now);
                self.counted(s, l)
                    .map(|e| e.at_ms / w)
                    .filter(|k| *k >= lo)
                    .min()
                    .map(|k| (k + u64::from(*slices)) * w)
            }
            Window::Bucket { .. } => {
                let d = self.bucket_deficit(s, l);
                (d > 0).then(|| {
                    self.now
                        .saturating_add(sat_u64(d.div_ceil(u128::from(l.cap))))
                })
            }
            Window::Calendar { unit, zone } => Some(window_bounds(*unit, zone, self.now).1),
            Window::Total => None,
            Window::Concurrent => self.earliest_expiry(s),
        }
    }

    /// Time until usage alone is at most `target` (holds assumed to stay);
    /// `None` when it never falls by itself.
    fn ms_until_used_at_most(&self, s: usize, l: &MLimit, target: u64) -> Option<u64> {
        match &l.window {
            Window::Sliding { period_ms, slices } => {
                // Try each instant a slice leaves, oldest first.
                let (w, lo, cur) = Self::slice_range(*period_ms, *slices, self.now);
                let n = u64::from(*slices);
                (lo..=cur)
                    .map(|k| (k + n) * w)
                    .find(|&at| self.sliding_used(s, l, at) <= u128::from(target))
                    .map(|at| at - self.now)
            }
            Window::Bucket { period_ms } => {
                let need = self.bucket_deficit(s, l) - u128::from(target) * u128::from(*period_ms);
                Some(sat_u64(need.div_ceil(u128::from(l.cap))))
            }
            Window::Calendar { unit, zone } => {
                Some(window_bounds(*unit, zone, self.now).1 - self.now)
            }
            Window::Total | Window::Concurrent => None,
        }
    }

    fn limit_status(&self, s: usize, l: &MLimit) -> LimitStatus {
        let used = self.used(s, l);
        let held = self.held(s, l.dim);
        LimitStatus {
            dimension: dim_name(l.dim).to_string(),
            window: l.window.clone(),
            capacity: l.cap,
            used: sat_i64(used),
            held,
            remaining: sat_i64(i128::from(l.cap) - used - i128::from(held)),
            resets_at: self.resets_at(s, l).map(ts),
        }
    }

    fn status(&self, s: usize) -> ScopeStatus {
        let view = self.view(s);
        ScopeStatus {
            scope: self.universe[s].clone(),
            plan: view.plan,
            held_reservations: self.held_count(s),
            limits: view
                .limits
                .iter()
                .map(|l| self.limit_status(s, l))
                .collect(),
        }
    }

    fn remaining(&self, keys: &ScopeSet, scopes: &[usize]) -> Vec<Remaining> {
        let mut out = Vec::new();
        for (key, &s) in keys.as_slice().iter().zip(scopes) {
            for l in &self.view(s).limits {
                let st = self.limit_status(s, l);
                out.push(Remaining {
                    scope: key.clone(),
                    dimension: st.dimension,
                    window: l.window.kind(),
                    capacity: st.capacity,
                    remaining: st.remaining,
                    resets_at: st.resets_at,
                });
            }
        }
        out
    }

    /// The denial the rules of SEMANTICS.md give, if any limit refuses.
    fn check(
        &self,
        keys: &ScopeSet,
        scopes: &[usize],
        requested: &dyn Fn(Dimension) -> u64,
        only_positive: bool,
        own: Option<(ReservationId, &Amounts)>,
    ) -> Option<Denial> {
        let rank = |k: DenialKind| match k {
            DenialKind::ExceedsLimit => 2,
            DenialKind::BudgetExhausted => 1,
            DenialKind::RateLimited => 0,
        };
        let mut best: Option<Denial> = None;
        for (i, &s) in scopes.iter().enumerate() {
            for l in &self.view(s).limits {
                let mut req = requested(l.dim);
                if only_positive && req == 0 {
                    continue;
                }
                // An extend: what the reservation holds already counts
                // towards the whole capacity it can never pass, and stays
                // while it is extended (as usage would).
                let own_held = own.map_or(0, |(_, o)| o.get(l.dim));
                let used = self.used(s, l);
                let held = self.held(s, l.dim);
                let room = i128::from(l.cap) - used - i128::from(held);
                if i128::from(req) <= room {
                    continue;
                }
                let mut hold_due = None;
                let (kind, retry) = if req > l.cap {
                    (DenialKind::ExceedsLimit, None)
                } else if u128::from(req) + u128::from(own_held) > u128::from(l.cap) {
                    req += own_held;
                    (DenialKind::ExceedsLimit, None)
                } else {
                    // What usage may be for the request to fit with every
                    // other hold gone, and when it gets there by itself.
                    let free = l.cap - own_held - req;
                    let until_free = if used <= i128::from(free) {
                        Some(0)
                    } else {
                        self.ms_until_used_at_most(s, l, free)
                    };
                    // Beside the current holds, once usage leaves.
                    let beside = if u128::from(req) + u128::from(held) <= u128::from(l.cap) {
                        self.ms_until_used_at_most(s, l, l.cap - held - req)
                    } else {
                        None
                    };
                    match (until_free, beside) {
                        (None, _) => (DenialKind::BudgetExhausted, None),
                        (Some(_), Some(ms)) => (DenialKind::RateLimited, Some(ms.max(1))),
                        (Some(until_free), None) => {
                            // Holds block: the earliest other one holding
                            // the dimension, not before usage leaves room.
                            hold_due = self.earliest_holding(s, l.dim, own.map(|(id, _)| id));
                            let ms = hold_due.map_or(1, |e| e - self.now);
                            if until_free > ms {
                                tally("denial: a hold-based retry waits for usage to leave");
                            }
                            if matches!(l.window, Window::Total) {
                                tally("denial: a total blocked by holds is rate limited");
                            }
                            if own.is_some() && hold_due != self.earliest_expiry(s) {
                                tally("denial: an extend's retry passed its own hold");
                            }
                            (DenialKind::RateLimited, Some(ms.max(until_free).max(1)))
                        }
                    }
                };
                let d = Denial {
                    kind,
                    scope: keys.as_slice()[i].clone(),
                    dimension: dim_name(l.dim).to_string(),
                    window: l.window.kind(),
                    capacity: l.cap,
                    remaining: sat_i64(room),
                    requested: req,
                    retry_after_ms: retry,
                    resets_at: self.resets_at(s, l).or(hold_due).map(ts),
                };
                // exceeds_limit over budget_exhausted over rate_limited; among
                // rate_limited the latest retry; ties keep the earlier one.
                let better = match &best {
                    None => true,
                    Some(b) if rank(d.kind) != rank(b.kind) => rank(d.kind) > rank(b.kind),
                    Some(b) => {
                        d.kind == DenialKind::RateLimited && d.retry_after_ms > b.retry_after_ms
                    }
                };
                if better {
                    best = Some(d);
                }
            }
        }
        best
    }

    // ---- amounts

    fn cost_micros(input: u64, cached: u64, output: u64) -> u64 {
        let cached = cached.min(input);
        let t = u128::from(input - cached) * PRICE_IN
            + u128::from(cached) * PRICE_CACHED
            + u128::from(output) * PRICE_OUT;
        u64::try_from(t.div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }

    /// `tokens` = input + output unless given; `cost_micros` from the price
    /// table unless given. The flag: a model named without a price.
    fn derive(sent: &Amounts, model: Option<&str>, cached: u64) -> (Amounts, bool) {
        let mut a = sent.clone();
        let (i, o) = (a.get(IN), a.get(OUT));
        if a.get(TOKENS) == 0 {
            a.set(TOKENS, i.saturating_add(o));
        }
        let mut unpriced = false;
        if a.get(COST) == 0 {
            match model {
                Some(PRICED) => a.set(COST, Self::cost_micros(i, cached, o)),
                Some(_) => unpriced = true,
                None => {}
            }
        }
        (a, unpriced)
    }

    fn too_large(a: &Amounts) -> Option<Dimension> {
        a.iter().find(|&(_, v)| v > MAX).map(|(d, _)| d)
    }

    fn add_into(a: &mut Amounts, b: &Amounts) {
        for (d, v) in b.iter() {
            a.set(d, a.get(d).saturating_add(v));
        }
    }

    // ---- transitions

    fn reserve(
        &mut self,
        now: u64,
        id: ReservationId,
        req: &ReserveRequest,
        scopes: &[usize],
    ) -> Result<Granted, ReserveError> {
        self.observe(now);
        if let Some(d) = Self::too_large(&req.amounts) {
            return Err(invalid(format!("amounts.{}", dim_name(d))).into());
        }
        let ttl_ms = req.ttl_ms.unwrap_or(DEFAULT_TTL_MS);
        if ttl_ms == 0 || ttl_ms > MAX_TTL_MS {
            return Err(invalid("ttl_ms").into());
        }
        if req.idempotency_key.is_some() && req.dry_run {
            return Err(invalid("idempotency_key").into());
        }
        let (held, unpriced) = Self::derive(&req.amounts, req.model.as_deref(), 0);
        let limits_cost = scopes
            .iter()
            .any(|&s| self.view(s).limits.iter().any(|l| l.dim == COST));
        if unpriced && limits_cost {
            return Err(invalid("model").into());
        }
        let tenant = req.scopes.tenant_name().to_string();
        if let Some(key) = &req.idempotency_key {
            let bound = self
                .idempotency
                .get(&(tenant.clone(), key.to_string()))
                .and_then(|rid| self.records.get(rid));
            if let Some(rec) = bound {
                let key_expired = rec
                    .res
                    .ended_at
                    .is_some_and(|e| now >= e.as_millis() + IDEMPOTENCY_RETENTION_MS);
                if !key_expired {
                    let mut a: Vec<&str> = rec
                        .res
                        .scopes
                        .as_slice()
                        .iter()
                        .map(|k| k.as_str())
                        .collect();
                    let mut b: Vec<&str> =
                        req.scopes.as_slice().iter().map(|k| k.as_str()).collect();
                    a.sort_unstable();
                    b.sort_unstable();
                    let same = a == b && rec.sent == req.amounts && rec.res.model == req.model;
                    if !same {
                        return Err(ReserveError::IdempotencyConflict {
                            key: key.to_string(),
                        });
                    }
                    return Ok(Granted {
                        id: rec.res.id,
                        status: rec.res.status,
                        replayed: true,
                        dry_run: false,
                        held: rec.res.held.clone(),
                        created_at: rec.res.created_at,
                        expires_at: rec.res.expires_at,
                        remaining: Vec::new(),
                    });
                }
            }
        }
        if self.records.contains_key(&id) {
            return Err(ReserveError::DuplicateId);
        }
        let requested = |d: Dimension| if d.is_implied() { 1 } else { held.get(d) };
        if let Some(denial) = self.check(&req.scopes, scopes, &requested, false, None) {
            return Err(ReserveError::Denied(Box::new(denial)));
        }
        let expires_at = ts(now + ttl_ms);
        if req.dry_run {
            // Exactly what a reserve would answer: the room after this hold.
            let mut remaining = self.remaining(&req.scopes, scopes);
            for r in &mut remaining {
                let d = Dimension::builtin(&r.dimension).unwrap_or(self.search);
                let asked = requested(d);
                r.remaining = sat_i64(i128::from(r.remaining) - i128::from(asked));
                if r.window == WindowKind::Concurrent {
                    r.resets_at = Some(r.resets_at.map_or(expires_at, |e| e.min(expires_at)));
                }
            }
            return Ok(Granted {
                id,
                status: Status::Held,
                replayed: false,
                dry_run: true,
                held,
                created_at: ts(now),
                expires_at,
                remaining,
            });
        }
        for &s in scopes {
            self.sync(s);
        }
        let shards: std::collections::BTreeSet<usize> =
            req.scopes.as_slice().iter().map(shard_of).collect();
        let res = Reservation {
            id,
            status: Status::Held,
            scopes: req.scopes.clone(),
            model: req.model.clone(),
            labels: req.labels.clone(),
            held: held.clone(),
            created_at: ts(now),
            expires_at,
            ended_at: None,
            charged: None,
            late: false,
            overrun: self.scopes[scopes[0]].overrun,
            idempotency_key: req.idempotency_key.clone(),
        };
        self.records.insert(
            id,
            MRec {
                res,
                sent: req.amounts.clone(),
                scopes: scopes.to_vec(),
                drop_at: 0,
                holds: shards.len() as u64,
            },
        );
        if let Some(key) = &req.idempotency_key {
            self.idempotency.insert((tenant, key.to_string()), id);
        }
        let remaining = if req.report_remaining {
            self.remaining(&req.scopes, scopes)
        } else {
            Vec::new()
        };
        Ok(Granted {
            id,
            status: Status::Held,
            replayed: false,
            dry_run: false,
            held,
            created_at: ts(now),
            expires_at,
            remaining,
        })
    }

    fn charge(policy: OverrunPolicy, held: u64, actual: u64) -> u64 {
        match policy {
            OverrunPolicy::ChargeActual => actual,
            OverrunPolicy::CapAtEstimate => actual.min(held),
            OverrunPolicy::AllowOverrun { percent } => {
                let cap = u128::from(held) * (100 + u128::from(percent)) / 100;
                u128::from(actual).min(cap) as u64
            }
        }
    }

    fn settle(
        &mut self,
        now: u64,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<Reservation, SettleError> {
        self.observe(now);
        let rec = self.records.get(&id).ok_or(SettleError::NotFound)?;
        match rec.res.status {
            Status::Settled => return Ok(rec.res.clone()),
            Status::Refunded => {
                return Err(SettleError::Conflict {
                    status: Status::Refunded,
                });
            }
            Status::Held | Status::Expired => {}
        }
        if let Some(d) = Self::too_large(&usage.amounts) {
            return Err(invalid(format!("usage.{}", dim_name(d))).into());
        }
        if usage.cached_input_tokens > MAX {
            return Err(invalid("usage.cached_input_tokens").into());
        }
        for (i, c) in usage.charges.iter().enumerate() {
            if c.name.is_empty() || c.name.len() > 64 {
                return Err(invalid(format!("charges[{i}].name")).into());
            }
            if c.cost_micros > MAX {
                return Err(invalid(format!("charges[{i}].cost_micros")).into());
            }
            if let Some(d) = Self::too_large(&c.amounts) {
                return Err(invalid(format!("charges[{i}].amounts.{}", dim_name(d))).into());
            }
        }
        let (actual, _) = Self::derive(
            &usage.amounts,
            rec.res.model.as_deref(),
            usage.cached_input_tokens,
        );
        let mut charged: Amounts = actual
            .iter()
            .map(|(d, a)| (d, Self::charge(rec.res.overrun, rec.res.held.get(d), a)))
            .collect();
        if usage.amounts.get(TOKENS) == 0 {
            charged.set(TOKENS, charged.get(IN).saturating_add(charged.get(OUT)));
        }
        for c in &usage.charges {
            charged.set(COST, charged.get(COST).saturating_add(c.cost_micros));
            Self::add_into(&mut charged, &c.amounts);
        }
        let scopes = rec.scopes.clone();
        for s in scopes {
            self.sync(s);
            let mut record = |dim: Dimension, amount: u64| {
                self.events[s].push(Event {
                    seq: self.seq,
                    at_ms: now,
                    dim,
                    amount,
                });
                self.seq += 1;
            };
            record(REQUESTS, 1);
            for (d, v) in charged.iter() {
                record(d, v);
            }
        }
        let rec = self.records.get_mut(&id).expect("looked up above");
        rec.res.late = rec.res.status == Status::Expired;
        rec.res.status = Status::Settled;
        rec.res.ended_at = Some(ts(now));
        rec.res.charged = Some(charged);
        rec.drop_at = now + Self::keep_ms(&rec.res);
        Ok(rec.res.clone())
    }

    fn refund(&mut self, now: u64, id: ReservationId) -> Result<Reservation, RefundError> {
        self.observe(now);
        let rec = self.records.get_mut(&id).ok_or(RefundError::NotFound)?;
        match rec.res.status {
            Status::Settled => Err(RefundError::Conflict {
                status: Status::Settled,
            }),
            Status::Refunded | Status::Expired => Ok(rec.res.clone()),
            Status::Held => {
                rec.res.status = Status::Refunded;
                rec.res.ended_at = Some(ts(now));
                rec.drop_at = now + Self::keep_ms(&rec.res);
                Ok(rec.res.clone())
            }
        }
    }

    fn extend(
        &mut self,
        now: u64,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Result<Reservation, ExtendError> {
        self.observe(now);
        if amounts.is_none() && ttl_ms.is_none() {
            return Err(invalid("amounts").into());
        }
        if ttl_ms.is_some_and(|t| t == 0 || t > MAX_TTL_MS) {
            return Err(invalid("ttl_ms").into());
        }
        if let Some(d) = amounts.and_then(Self::too_large) {
            return Err(invalid(format!("amounts.{}", dim_name(d))).into());
        }
        let rec = self.records.get(&id).ok_or(ExtendError::NotFound)?;
        if rec.res.status != Status::Held {
            return Err(ExtendError::NotHeld {
                status: rec.res.status,
            });
        }
        let delta = amounts.map_or_else(Amounts::new, |a| {
            Self::derive(a, rec.res.model.as_deref(), 0).0
        });
        if !delta.is_empty() {
            let requested = |d: Dimension| if d.is_implied() { 0 } else { delta.get(d) };
            if let Some(d) = self.check(
                &rec.res.scopes,
                &rec.scopes,
                &requested,
                true,
                Some((id, &rec.res.held)),
            ) {
                return Err(ExtendError::Denied(Box::new(d)));
            }
            for s in rec.scopes.clone() {
                self.sync(s);
            }
        }
        let rec = self.records.get_mut(&id).expect("looked up above");
        Self::add_into(&mut rec.res.held, &delta);
        if let Some(t) = ttl_ms {
            rec.res.expires_at = ts(now + t);
        }
        Ok(rec.res.clone())
    }

    fn adjust(
        &mut self,
        now: u64,
        s: usize,
        dim: Dimension,
        credit: i64,
    ) -> Result<ScopeStatus, AdminError> {
        self.observe(now);
        if credit.unsigned_abs() > MAX {
            return Err(invalid("amount").into());
        }
        let has_total = self
            .view(s)
            .limits
            .iter()
            .any(|l| l.dim == dim && l.window == Window::Total);
        if !has_total {
            return Err(AdminError::NotFound(String::new()));
        }
        self.sync(s);
        self.credits[s].push((self.seq, dim, credit));
        self.seq += 1;
        Ok(self.status(s))
    }

    fn get(&self, id: ReservationId) -> Option<Reservation> {
        self.records.get(&id).map(|r| r.res.clone())
    }

    fn live_holds(&self, shared: bool) -> usize {
        self.records
            .values()
            .filter(|r| r.res.status == Status::Held)
            .map(|r| if shared { r.holds as usize } else { 1 })
            .sum()
    }
}

// ---------------------------------------------------------- the engines

/// What the test needs of a ledger, answered as owned values so the
/// single-threaded and the sharded ledger compare alike.
trait Engine {
    fn label(&self) -> &'static str;
    fn reserve(
        &mut self,
        now: u64,
        id: ReservationId,
        req: &ReserveRequest,
    ) -> Result<Granted, ReserveError>;
    fn settle(
        &mut self,
        now: u64,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<Reservation, SettleError>;
    fn refund(&mut self, now: u64, id: ReservationId) -> Result<Reservation, RefundError>;
    fn extend(
        &mut self,
        now: u64,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Result<Reservation, ExtendError>;
    fn get(&mut self, now: u64, id: ReservationId) -> Option<Reservation>;
    fn status(&mut self, now: u64, scope: &ScopeKey) -> ScopeStatus;
    fn adjust(
        &mut self,
        now: u64,
        scope: &ScopeKey,
        dim: Dimension,
        credit: i64,
    ) -> Result<ScopeStatus, AdminError>;
    fn expire_due(&mut self, now: u64) -> u64;
    fn configure(
        &mut self,
        change: &dyn Fn(&mut Catalog) -> Result<bool, String>,
    ) -> Result<bool, String>;
    fn invariants(&mut self, now: u64) -> Result<(), String>;
    fn hold_count(&mut self) -> usize;
    fn is_shared(&self) -> bool;
}

impl Engine for Ledger {
    fn label(&self) -> &'static str {
        "Ledger"
    }
    fn reserve(
        &mut self,
        now: u64,
        id: ReservationId,
        req: &ReserveRequest,
    ) -> Result<Granted, ReserveError> {
        Ledger::reserve(self, ts(now), id, req)
    }
    fn settle(
        &mut self,
        now: u64,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<Reservation, SettleError> {
        Ledger::settle(self, ts(now), id, usage).cloned()
    }
    fn refund(&mut self, now: u64, id: ReservationId) -> Result<Reservation, RefundError> {
        Ledger::refund(self, ts(now), id).cloned()
    }
    fn extend(
        &mut self,
        now: u64,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Result<Reservation, ExtendError> {
        Ledger::extend(self, ts(now), id, amounts, ttl_ms).cloned()
    }
    fn get(&mut self, now: u64, id: ReservationId) -> Option<Reservation> {
        Ledger::get(self, ts(now), id).cloned()
    }
    fn status(&mut self, now: u64, scope: &ScopeKey) -> ScopeStatus {
        Ledger::status(self, ts(now), scope)
    }
    fn adjust(
        &mut self,
        now: u64,
        scope: &ScopeKey,
        dim: Dimension,
        credit: i64,
    ) -> Result<ScopeStatus, AdminError> {
        Ledger::adjust(self, ts(now), scope, dim, credit)
    }
    fn expire_due(&mut self, now: u64) -> u64 {
        Ledger::expire_due(self, ts(now))
    }
    fn configure(
        &mut self,
        change: &dyn Fn(&mut Catalog) -> Result<bool, String>,
    ) -> Result<bool, String> {
        self.update_catalog(change)
    }
    fn invariants(&mut self, _now: u64) -> Result<(), String> {
        self.check_invariants()
    }
    fn hold_count(&mut self) -> usize {
        self.held_count()
    }
    fn is_shared(&self) -> bool {
        false
    }
}

impl Engine for SharedLedger {
    fn label(&self) -> &'static str {
        "SharedLedger"
    }
    fn reserve(
        &mut self,
        now: u64,
        id: ReservationId,
        req: &ReserveRequest,
    ) -> Result<Granted, ReserveError> {
        SharedLedger::reserve(self, ts(now), id, req)
    }
    fn settle(
        &mut self,
        now: u64,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<Reservation, SettleError> {
        self.settle_view(ts(now), id, usage)
    }
    fn refund(&mut self, now: u64, id: ReservationId) -> Result<Reservation, RefundError> {
        self.refund_view(ts(now), id)
    }
    fn extend(
        &mut self,
        now: u64,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Result<Reservation, ExtendError> {
        self.extend_view(ts(now), id, amounts, ttl_ms)
    }
    fn get(&mut self, now: u64, id: ReservationId) -> Option<Reservation> {
        SharedLedger::get(self, ts(now), id)
    }
    fn status(&mut self, now: u64, scope: &ScopeKey) -> ScopeStatus {
        SharedLedger::status(self, ts(now), scope)
    }
    fn adjust(
        &mut self,
        now: u64,
        scope: &ScopeKey,
        dim: Dimension,
        credit: i64,
    ) -> Result<ScopeStatus, AdminError> {
        SharedLedger::adjust(self, ts(now), scope, dim, credit)
    }
    fn expire_due(&mut self, now: u64) -> u64 {
        SharedLedger::expire_due(self, ts(now))
    }
    fn configure(
        &mut self,
        change: &dyn Fn(&mut Catalog) -> Result<bool, String>,
    ) -> Result<bool, String> {
        self.update_catalog(change)
    }
    fn invariants(&mut self, now: u64) -> Result<(), String> {
        self.check_invariants(ts(now))
    }
    fn hold_count(&mut self) -> usize {
        SharedLedger::hold_count(self)
    }
    fn is_shared(&self) -> bool {
        true
    }
}

/// Invalid inputs compare by field only (messages are for humans).
fn blank_invalid(i: Invalid) -> Invalid {
    invalid(i.field)
}

fn norm_reserve(r: Result<Granted, ReserveError>) -> Result<Granted, ReserveError> {
    r.map_err(|e| match e {
        ReserveError::Invalid(i) => ReserveError::Invalid(blank_invalid(i)),
        e => e,
    })
}

fn norm_settle(r: Result<Reservation, SettleError>) -> Result<Reservation, SettleError> {
    r.map_err(|e| match e {
        SettleError::Invalid(i) => SettleError::Invalid(blank_invalid(i)),
        e => e,
    })
}

fn norm_extend(r: Result<Reservation, ExtendError>) -> Result<Reservation, ExtendError> {
    r.map_err(|e| match e {
        ExtendError::Invalid(i) => ExtendError::Invalid(blank_invalid(i)),
        e => e,
    })
}

fn norm_admin(r: Result<ScopeStatus, AdminError>) -> Result<ScopeStatus, AdminError> {
    r.map_err(|e| match e {
        AdminError::Invalid(i) => AdminError::Invalid(blank_invalid(i)),
        AdminError::NotFound(_) => AdminError::NotFound(String::new()),
    })
}

fn same<T: PartialEq + Debug>(who: &str, what: &str, engine: &T, model: &T) -> Result<(), String> {
    if engine == model {
        Ok(())
    } else {
        Err(format!(
            "{who}: {what} differs\n  engine: {engine:?}\n  model:  {model:?}"
        ))
    }
}

// ---------------------------------------------------------- the operations

/// An amount, biased to the edges: 0, the pool's capacities ±1, 2^53 (the
/// largest accepted) and above it (typed `Invalid`), up to `u64::MAX`.
#[derive(Clone, Debug)]
enum Amt {
    Zero,
    Small(u64),
    Mid(u64),
    Cap(usize, i8),
    Max,
    MaxPlusOne,
    NearU64Max(u8),
}

impl Amt {
    fn value(&self) -> u64 {
        match self {
            Amt::Zero => 0,
            Amt::Small(v) | Amt::Mid(v) => *v,
            Amt::Cap(i, d) => CAPS[*i].saturating_add_signed(i64::from(*d)),
            Amt::Max => MAX,
            Amt::MaxPlusOne => MAX + 1,
            Amt::NearU64Max(k) => u64::MAX - u64::from(*k),
        }
    }
}

fn amt() -> impl Strategy<Value = Amt> {
    prop_oneof![
        20 => Just(Amt::Zero),
        30 => (1u64..=300).prop_map(Amt::Small),
        8 => (300u64..=1500).prop_map(Amt::Mid),
        10 => (0..CAPS.len(), -1i8..=1).prop_map(|(i, d)| Amt::Cap(i, d)),
        2 => Just(Amt::Max),
        1 => Just(Amt::MaxPlusOne),
        1 => (0u8..3).prop_map(Amt::NearU64Max),
    ]
}

#[derive(Clone, Debug)]
struct AmtSet {
    input: Amt,
    output: Amt,
    tokens: Option<Amt>,
    cost: Option<Amt>,
    search: Option<Amt>,
}

fn amt_set() -> impl Strategy<Value = AmtSet> {
    (
        amt(),
        amt(),
        prop::option::weighted(0.15, amt()),
        prop::option::weighted(0.15, amt()),
        // Tool calls come a few at a time (the tool limits are 4 and 10).
        prop::option::weighted(
            0.3,
            prop_oneof![4 => (0u64..=5).prop_map(Amt::Small), 1 => amt()],
        ),
    )
        .prop_map(|(input, output, tokens, cost, search)| AmtSet {
            input,
            output,
            tokens,
            cost,
            search,
        })
}

impl AmtSet {
    fn amounts(&self, search: Dimension) -> Amounts {
        let mut a = Amounts::new()
            .with(IN, self.input.value())
            .with(OUT, self.output.value());
        for (d, v) in [
            (TOKENS, &self.tokens),
            (COST, &self.cost),
            (search, &self.search),
        ] {
            if let Some(v) = v {
                a.set(d, v.value());
            }
        }
        a
    }
}

/// A usage figure relative to what the reservation holds.
#[derive(Clone, Debug)]
enum UseAmt {
    Zero,
    Same,
    MinusOne,
    PlusOne,
    Half,
    Double,
    Abs(Amt),
}

impl UseAmt {
    fn value(&self, held: u64) -> u64 {
        match self {
            UseAmt::Zero => 0,
            UseAmt::Same => held,
            UseAmt::MinusOne => held.saturating_sub(1),
            UseAmt::PlusOne => held.saturating_add(1),
            UseAmt::Half => held / 2,
            UseAmt::Double => held.saturating_mul(2),
            UseAmt::Abs(a) => a.value(),
        }
    }
}

fn use_amt() -> impl Strategy<Value = UseAmt> {
    prop_oneof![
        2 => Just(UseAmt::Zero),
        4 => Just(UseAmt::Same),
        2 => Just(UseAmt::MinusOne),
        2 => Just(UseAmt::PlusOne),
        3 => Just(UseAmt::Half),
        2 => Just(UseAmt::Double),
        2 => amt().prop_map(UseAmt::Abs),
    ]
}

#[derive(Clone, Debug)]
struct ChargeSpec {
    cost: Amt,
    search: u64,
    bad_name: bool,
}

#[derive(Clone, Debug)]
struct UsageSpec {
    input: UseAmt,
    output: UseAmt,
    tokens: Option<UseAmt>,
    cost: Option<UseAmt>,
    search: Option<UseAmt>,
    cached: Option<Amt>,
    charges: Vec<ChargeSpec>,
}

fn usage_spec() -> impl Strategy<Value = UsageSpec> {
    let charge =
        (amt(), 0u64..=3, prop::bool::weighted(0.03)).prop_map(|(cost, search, bad_name)| {
            ChargeSpec {
                cost,
                search,
                bad_name,
            }
        });
    (
        use_amt(),
        use_amt(),
        prop::option::weighted(0.15, use_amt()),
        prop::option::weighted(0.15, use_amt()),
        prop::option::weighted(0.3, use_amt()),
        prop::option::weighted(0.15, amt()),
        prop::collection::vec(charge, 0..=2),
    )
        .prop_map(
            |(input, output, tokens, cost, search, cached, charges)| UsageSpec {
                input,
                output,
                tokens,
                cost,
                search,
                cached,
                charges,
            },
        )
}

impl UsageSpec {
    fn usage(&self, held: &Amounts, search: Dimension) -> Usage {
        let mut amounts = Amounts::new()
            .with(IN, self.input.value(held.get(IN)))
            .with(OUT, self.output.value(held.get(OUT)));
        for (d, v) in [
            (TOKENS, &self.tokens),
            (COST, &self.cost),
            (search, &self.search),
        ] {
            if let Some(v) = v {
                amounts.set(d, v.value(held.get(d)));
            }
        }
        Usage {
            amounts,
            cached_input_tokens: self.cached.as_ref().map_or(0, Amt::value),
            charges: self
                .charges
                .iter()
                .map(|c| Charge {
                    name: if c.bad_name {
                        String::new()
                    } else {
                        "search".into()
                    },
                    cost_micros: c.cost.value(),
                    amounts: Amounts::new().with(search, c.search),
                })
                .collect(),
        }
    }
}

#[derive(Clone, Debug)]
enum Ttl {
    Default,
    Short(u64),
    Long(u64),
    One,
    Zero,
    OverMax,
}

impl Ttl {
    fn value(&self) -> Option<u64> {
        match self {
            Ttl::Default => None,
            Ttl::Short(v) | Ttl::Long(v) => Some(*v),
            Ttl::One => Some(1),
            Ttl::Zero => Some(0),
            Ttl::OverMax => Some(MAX_TTL_MS + 1),
        }
    }
}

fn ttl() -> impl Strategy<Value = Ttl> {
    prop_oneof![
        20 => Just(Ttl::Default),
        8 => (2u64..=5000).prop_map(Ttl::Short),
        8 => (20_000u64..=MAX_TTL_MS).prop_map(Ttl::Long),
        1 => Just(Ttl::One),
        1 => Just(Ttl::Zero),
        1 => Just(Ttl::OverMax),
    ]
}

#[derive(Clone, Debug)]
struct ReqSpec {
    tenant: usize,
    user: Option<usize>,
    agent: Option<usize>,
    search: bool,
    ocr: bool,
    reverse: bool,
    amounts: AmtSet,
    /// 0: none, 1: priced, 2: named without a price.
    model: u8,
    ttl: Ttl,
    keyed: bool,
    dry_run: bool,
    report: bool,
    labels: bool,
}

fn req_spec() -> impl Strategy<Value = ReqSpec> {
    (
        (
            0usize..3,
            prop::option::weighted(0.6, 0usize..2),
            prop::option::weighted(0.6, 0usize..2),
            prop::bool::weighted(0.35),
            prop::bool::weighted(0.2),
            any::<bool>(),
        ),
        amt_set(),
        prop_oneof![8 => Just(0u8), 6 => Just(1u8), 1 => Just(2u8)],
        ttl(),
        (
            prop::bool::weighted(0.25),
            prop::bool::weighted(0.1),
            prop::bool::weighted(0.2),
            prop::bool::weighted(0.1),
        ),
    )
        .prop_map(
            |(
                (tenant, user, agent, search, ocr, reverse),
                amounts,
                model,
                ttl,
                (keyed, dry_run, report, labels),
            )| {
                ReqSpec {
                    tenant,
                    user,
                    agent,
                    search,
                    ocr,
                    reverse,
                    amounts,
                    model,
                    ttl,
                    keyed,
                    dry_run,
                    report,
                    labels,
                }
            },
        )
}

/// How an idempotent repeat differs from the first request.
#[derive(Clone, Debug)]
enum Replay {
    /// The same request (scopes in another order, another TTL, labels, report).
    Same(Ttl),
    /// Another amount: a conflict while the key is bound.
    Amount,
    /// Another scope set.
    Scope,
    /// Another model.
    Model,
}

#[derive(Clone, Debug)]
enum Step {
    Small(u64),
    Ms(u64),
    Slice(usize),
    ToMinute(i8),
    ToHour,
    Ttl,
    Big(u64),
}

#[derive(Clone, Debug)]
enum Target {
    Plan(usize),
    Own(usize),
}

#[derive(Clone, Debug)]
enum Op {
    Reserve(Box<ReqSpec>),
    Replay(Index, Replay),
    /// A reserve under the id of an earlier reservation.
    ReuseId(Index, Box<ReqSpec>),
    Settle(Pick, Box<UsageSpec>),
    Refund(Pick),
    Extend(Pick, Option<AmtSet>, Option<Ttl>),
    /// settle, refund, extend of an id never issued.
    Unknown(u8),
    Advance(Step),
    SetKindPlan(usize, Option<usize>),
    RedefinePlan(usize, usize),
    SetOverride(usize, Target),
    ClearOverride(usize),
    Adjust(usize, u8, i64),
    ExpireDue,
}

const UNIVERSE_LEN: usize = 17;

/// Which earlier reservation an operation targets: one of the last few
/// (likely still held), or any (likely ended: repeats and late settles).
#[derive(Clone, Debug)]
struct Pick {
    index: Index,
    recent: bool,
}

fn pick() -> impl Strategy<Value = Pick> {
    (any::<Index>(), prop::bool::weighted(0.6)).prop_map(|(index, recent)| Pick { index, recent })
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (1u64..=50).prop_map(Step::Small),
        3 => (50u64..=2000).prop_map(Step::Ms),
        3 => (0..SLICE_WIDTHS_MS.len()).prop_map(Step::Slice),
        2 => (-1i8..=1).prop_map(Step::ToMinute),
        1 => Just(Step::ToHour),
        2 => Just(Step::Ttl),
        1 => (3_600_000u64..=7_200_000).prop_map(Step::Big),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let credit = prop_oneof![
        3 => Just(1i64),
        3 => Just(-1i64),
        3 => Just(1000i64),
        3 => Just(-1000i64),
        3 => Just(50_000i64),
        1 => Just(MAX as i64),
        1 => Just(-(MAX as i64)),
        1 => Just(MAX as i64 + 1),
        1 => Just(i64::MIN),
    ];
    // Mostly the tenant scopes and dimensions with `total` limits.
    let adjusted = prop_oneof![
        2 => (0usize..3).prop_map(|t| t * 5),
        1 => 0..UNIVERSE_LEN,
    ];
    let extend = prop_oneof![
        6 => amt_set().prop_map(|a| (Some(a), None)),
        2 => ttl().prop_map(|t| (None, Some(t))),
        2 => (amt_set(), ttl()).prop_map(|(a, t)| (Some(a), Some(t))),
        // Neither: a typed Invalid.
        1 => Just((None, None)),
    ];
    let replay = prop_oneof![
        3 => ttl().prop_map(Replay::Same),
        1 => Just(Replay::Amount),
        1 => Just(Replay::Scope),
        1 => Just(Replay::Model),
    ];
    prop_oneof![
        30 => req_spec().prop_map(|r| Op::Reserve(Box::new(r))),
        5 => (any::<Index>(), replay).prop_map(|(i, r)| Op::Replay(i, r)),
        1 => (any::<Index>(), req_spec()).prop_map(|(i, r)| Op::ReuseId(i, Box::new(r))),
        16 => (pick(), usage_spec()).prop_map(|(i, u)| Op::Settle(i, Box::new(u))),
        5 => pick().prop_map(Op::Refund),
        8 => (pick(), extend).prop_map(|(i, (a, t))| Op::Extend(i, a, t)),
        1 => (0u8..3).prop_map(Op::Unknown),
        12 => step().prop_map(Op::Advance),
        2 => (0..KINDS.len(), prop::option::weighted(0.9, 0..PLAN_NAMES.len()))
            .prop_map(|(k, p)| Op::SetKindPlan(k, p)),
        1 => (0..PLAN_NAMES.len(), 0..PLAN_NAMES.len()).prop_map(|(p, c)| Op::RedefinePlan(p, c)),
        2 => (0..UNIVERSE_LEN, prop_oneof![(0..PLAN_NAMES.len()).prop_map(Target::Plan), (0..PLAN_NAMES.len()).prop_map(Target::Own)])
            .prop_map(|(s, t)| Op::SetOverride(s, t)),
        1 => (0..UNIVERSE_LEN).prop_map(Op::ClearOverride),
        3 => (adjusted, prop_oneof![3 => Just(1u8), 2 => Just(0u8), 1 => 2u8..5], credit)
            .prop_map(|(s, d, c)| Op::Adjust(s, d, c)),
        3 => Just(Op::ExpireDue),
    ]
}

// ---------------------------------------------------------- one history

struct World {
    model: Model,
    engines: Vec<Box<dyn Engine>>,
    catalog: Catalog,
    search: Dimension,
    tenants: Vec<String>,
    /// Every id a reserve granted (in order), with its request.
    issued: Vec<(ReservationId, ReqSpec)>,
    /// Every keyed request sent (not a dry run), with its key.
    keyed: Vec<(ReqSpec, String)>,
    next_id: u128,
    next_key: u64,
}

impl World {
    fn new(start_offset_ms: u64) -> World {
        let (c, search) = catalog();
        let tenants = tenants();
        let mut universe = Vec::new();
        for t in &tenants {
            universe.push(ScopeKey::tenant(t).expect("a valid tenant"));
            for (kind, id) in [
                ("user", "u0"),
                ("user", "u1"),
                ("agent", "a0"),
                ("agent", "a1"),
            ] {
                universe.push(ScopeKey::new(t, kind, id, false, "scope").expect("a valid scope"));
            }
        }
        for id in ["search", "ocr"] {
            universe.push(ScopeKey::new("x", "tool", id, true, "scope").expect("a valid scope"));
        }
        assert_eq!(universe.len(), UNIVERSE_LEN);
        let now = T0_MS + start_offset_ms;
        World {
            model: Model::new(search, universe, now),
            engines: vec![
                Box::new(Ledger::new(c.clone())),
                Box::new(SharedLedger::new(c.clone(), SHARDS)),
            ],
            catalog: c,
            search,
            tenants,
            issued: Vec::new(),
            keyed: Vec::new(),
            next_id: 1,
            next_key: 1,
        }
    }

    fn mint(&mut self, tenant: usize) -> ReservationId {
        let random = (0x5eed_0000_u128 << 96) | (self.next_id << 8);
        self.next_id += 1;
        ReservationId::mint(random, &self.tenants[tenant])
    }

    fn request(
        &self,
        spec: &ReqSpec,
        key: Option<&str>,
    ) -> Result<(ReserveRequest, Vec<usize>), String> {
        let user = spec.user.map(|u| format!("u{u}"));
        let agent = spec.agent.map(|a| format!("a{a}"));
        let mut pairs: Vec<(&str, &str)> = Vec::new();
        if let Some(u) = &user {
            pairs.push(("user", u));
        }
        if let Some(a) = &agent {
            pairs.push(("agent", a));
        }
        if spec.search {
            pairs.push(("tool", "search"));
        }
        if spec.ocr {
            pairs.push(("tool", "ocr"));
        }
        if spec.reverse {
            pairs.reverse();
        }
        let scopes = self
            .catalog
            .scope_set(&self.tenants[spec.tenant], &pairs)
            .map_err(|e| format!("scope_set: {e}"))?;
        let idx = scopes
            .as_slice()
            .iter()
            .map(|k| self.model.index[k.as_str()])
            .collect();
        let mut req = ReserveRequest::new(scopes, spec.amounts.amounts(self.search));
        req.model = match spec.model {
            1 => Some(PRICED.into()),
            2 => Some(UNPRICED.into()),
            _ => None,
        };
        req.ttl_ms = spec.ttl.value();
        req.idempotency_key = key.map(Into::into);
        req.dry_run = spec.dry_run;
        req.report_remaining = spec.report;
        if spec.labels {
            req.labels = Some(Arc::from(vec![("run".to_string(), "r1".to_string())]));
        }
        Ok((req, idx))
    }

    fn now(&self) -> u64 {
        self.model.now
    }

    fn pick(&self, p: &Pick) -> (ReservationId, Option<Amounts>) {
        if self.issued.is_empty() {
            return (ReservationId::mint(0xdead << 64, &self.tenants[0]), None);
        }
        let from = if p.recent {
            self.issued.len().saturating_sub(4)
        } else {
            0
        };
        let id = self.issued[from + p.index.index(self.issued.len() - from)].0;
        (id, self.model.records.get(&id).map(|r| r.res.held.clone()))
    }

    /// Runs one reserve on the model and every engine.
    fn reserve(
        &mut self,
        id: ReservationId,
        spec: &ReqSpec,
        key: Option<String>,
    ) -> Result<(), String> {
        let (req, idx) = self.request(spec, key.as_deref())?;
        let now = self.now();
        let want = self.model.reserve(now, id, &req, &idx);
        for e in &mut self.engines {
            let got = norm_reserve(e.reserve(now, id, &req));
            same(e.label(), "reserve", &got, &want)?;
        }
        tally(match &want {
            Ok(g) if g.replayed => format!("reserve: replay of a {} reservation", g.status),
            Ok(g) if g.dry_run => "reserve: dry run granted".to_string(),
            Ok(_) if idx.len() > 1 && req.scopes.as_slice().iter().any(|k| k.is_shared()) => {
                "reserve: granted with a shared scope".to_string()
            }
            Ok(_) => "reserve: granted".to_string(),
            Err(ReserveError::Denied(d)) => format!("reserve: {}", denial_name(d)),
            Err(ReserveError::Invalid(i)) => format!("reserve: invalid {}", i.field),
            Err(ReserveError::IdempotencyConflict { .. }) => "reserve: key conflict".to_string(),
            Err(ReserveError::DuplicateId) => "reserve: duplicate id".to_string(),
        });
        if let Ok(g) = &want
            && !g.dry_run
            && !g.replayed
        {
            self.issued.push((id, spec.clone()));
        }
        if let Some(k) = key
            && !spec.dry_run
        {
            self.keyed.push((spec.clone(), k));
        }
        Ok(())
    }

    fn configure(
        &mut self,
        change: &dyn Fn(&mut Catalog) -> Result<bool, String>,
    ) -> Result<bool, String> {
        let want = change(&mut self.catalog)?;
        for e in &mut self.engines {
            let got = e.configure(change)?;
            same(e.label(), "configure", &got, &want)?;
        }
        Ok(want)
    }

    fn apply(&mut self, op: &Op) -> Result<(), String> {
        let now = self.now();
        match op {
            Op::Reserve(spec) => {
                let key = spec.keyed.then(|| {
                    self.next_key += 1;
                    format!("v1:run:{}:sha", self.next_key)
                });
                let id = self.mint(spec.tenant);
                self.reserve(id, spec, key)?;
            }
            Op::Replay(i, how) => {
                if self.keyed.is_empty() {
                    return Ok(());
                }
                let (mut spec, key) = self.keyed[i.index(self.keyed.len())].clone();
                spec.dry_run = false;
                match how {
                    Replay::Same(ttl) => {
                        spec.reverse = !spec.reverse;
                        spec.ttl = ttl.clone();
                        spec.labels = !spec.labels;
                        spec.report = !spec.report;
                    }
                    Replay::Amount => {
                        let v = spec.amounts.output.value();
                        spec.amounts.output = Amt::Small(if v < MAX { v + 1 } else { v - 1 });
                    }
                    Replay::Scope => spec.search = !spec.search,
                    Replay::Model => spec.model = (spec.model + 1) % 3,
                }
                let id = self.mint(spec.tenant);
                self.reserve(id, &spec, Some(key))?;
            }
            Op::ReuseId(i, spec) => {
                if self.issued.is_empty() {
                    return Ok(());
                }
                let (id, first) = self.issued[i.index(self.issued.len())].clone();
                let mut spec = (**spec).clone();
                // The id names its tenant: reuse it within the same tenant.
                spec.tenant = first.tenant;
                self.reserve(id, &spec, None)?;
            }
            Op::Settle(i, u) => {
                let (id, held) = self.pick(i);
                let usage = u.usage(&held.unwrap_or_default(), self.search);
                self.model.observe(now);
                let before = self.model.records.get(&id).map(|r| r.res.status);
                let want = self.model.settle(now, id, &usage);
                tally(match (&want, before) {
                    (Ok(r), Some(Status::Expired)) if r.late => "settle: late".to_string(),
                    (Ok(_), Some(s)) => format!("settle: of a {s} reservation"),
                    (Err(SettleError::Invalid(i)), _) => format!("settle: invalid {}", i.field),
                    (Err(e), _) => format!("settle: {e}"),
                    (Ok(_), None) => "settle: of nothing".to_string(),
                });
                for e in &mut self.engines {
                    same(
                        e.label(),
                        "settle",
                        &norm_settle(e.settle(now, id, &usage)),
                        &want,
                    )?;
                }
            }
            Op::Refund(i) => {
                let (id, _) = self.pick(i);
                self.model.observe(now);
                let before = self.model.records.get(&id).map(|r| r.res.status);
                let want = self.model.refund(now, id);
                tally(match (&want, before) {
                    (Ok(_), Some(s)) => format!("refund: of a {s} reservation"),
                    (Err(e), _) => format!("refund: {e}"),
                    (Ok(_), None) => "refund: of nothing".to_string(),
                });
                for e in &mut self.engines {
                    same(e.label(), "refund", &e.refund(now, id), &want)?;
                }
            }
            Op::Extend(i, amounts, ttl) => {
                let (id, _) = self.pick(i);
                let amounts = amounts.as_ref().map(|a| a.amounts(self.search));
                let ttl = ttl.as_ref().map(|t| t.value().unwrap_or(DEFAULT_TTL_MS));
                let want = self.model.extend(now, id, amounts.as_ref(), ttl);
                tally(match &want {
                    Ok(_) => "extend: done".to_string(),
                    Err(ExtendError::Denied(d)) => format!("extend: {}", denial_name(d)),
                    Err(ExtendError::Invalid(i)) => format!("extend: invalid {}", i.field),
                    Err(e) => format!("extend: {e}"),
                });
                for e in &mut self.engines {
                    let got = norm_extend(e.extend(now, id, amounts.as_ref(), ttl));
                    same(e.label(), "extend", &got, &want)?;
                }
            }
            Op::Unknown(what) => {
                let id = ReservationId::mint(0xdead << 64, &self.tenants[0]);
                for e in &mut self.engines {
                    match what {
                        0 => same(
                            e.label(),
                            "settle unknown",
                            &e.settle(now, id, &Usage::default()),
                            &Err(SettleError::NotFound),
                        )?,
                        1 => same(
                            e.label(),
                            "refund unknown",
                            &e.refund(now, id),
                            &Err(RefundError::NotFound),
                        )?,
                        _ => same(
                            e.label(),
                            "extend unknown",
                            &e.extend(now, id, None, Some(1000)),
                            &Err(ExtendError::NotFound),
                        )?,
                    }
                }
                self.model.observe(now);
            }
            Op::Advance(s) => {
                let by = match s {
                    Step::Small(ms) | Step::Ms(ms) | Step::Big(ms) => *ms,
                    Step::Slice(i) => SLICE_WIDTHS_MS[*i],
                    Step::ToMinute(d) => {
                        let next = (now / 60_000 + 1) * 60_000;
                        next.saturating_add_signed(i64::from(*d))
                            .saturating_sub(now)
                    }
                    Step::ToHour => (now / 3_600_000 + 1) * 3_600_000 - now,
                    Step::Ttl => DEFAULT_TTL_MS,
                };
                self.model.observe(now + by);
            }
            Op::SetKindPlan(k, p) => {
                let (kind, shared) = KINDS[*k];
                let plan = p.map(|p| PLAN_NAMES[p]);
                self.configure(&|c| {
                    c.set_kind(kind, plan, shared)
                        .map(|()| true)
                        .map_err(|e| e.to_string())
                })?;
                self.model.kinds[*k] = *p;
                self.model.reconfigured();
            }
            Op::RedefinePlan(p, contents) => {
                let plan = build_plan(PLAN_NAMES[*p], &self.model.pool[*contents]);
                self.configure(&|c| {
                    c.set_plan(plan.clone());
                    Ok(true)
                })?;
                self.model.plans[*p] = *contents;
                self.model.reconfigured();
            }
            Op::SetOverride(s, target) => {
                let key = self.model.universe[*s].clone();
                let over = match target {
                    Target::Plan(p) => Override::Plan(PLAN_NAMES[*p].to_string()),
                    Target::Own(c) => {
                        let contents = &self.model.pool[*c];
                        Override::Limits(build_plan(contents.own_name, contents))
                    }
                };
                self.configure(&|c| {
                    c.set_override(key.clone(), over.clone())
                        .map(|()| true)
                        .map_err(|e| e.to_string())
                })?;
                let m = match target {
                    Target::Plan(p) => MOverride::Plan(*p),
                    Target::Own(c) => MOverride::Own(*c),
                };
                self.model.overrides.insert(*s, m);
                self.model.reconfigured();
            }
            Op::ClearOverride(s) => {
                let key = self.model.universe[*s].clone();
                let had = self.configure(&|c| Ok(c.clear_override(&key)))?;
                same(
                    "catalog",
                    "clear_override",
                    &had,
                    &self.model.overrides.remove(s).is_some(),
                )?;
                self.model.reconfigured();
            }
            Op::Adjust(s, d, credit) => {
                let dim = [TOKENS, COST, REQUESTS, self.search, IN][usize::from(*d)];
                let key = self.model.universe[*s].clone();
                let want = self.model.adjust(now, *s, dim, *credit);
                tally(match &want {
                    Ok(_) => "adjust: done".to_string(),
                    Err(e) => format!("adjust: {e}"),
                });
                for e in &mut self.engines {
                    let got = norm_admin(e.adjust(now, &key, dim, *credit));
                    same(e.label(), "adjust", &got, &want)?;
                }
            }
            Op::ExpireDue => {
                self.model.observe(now);
                for e in &mut self.engines {
                    // Reservations expired, whatever the number of shards.
                    let want = self.model.expired;
                    same(e.label(), "expire_due", &e.expire_due(now), &want)?;
                }
            }
        }
        Ok(())
    }

    /// Every scope's status, engine against model.
    fn sweep(&mut self) -> Result<(), String> {
        let now = self.now();
        self.model.observe(now);
        for e in &mut self.engines {
            for (s, key) in self.model.universe.iter().enumerate() {
                same(
                    e.label(),
                    &format!("status of {key}"),
                    &e.status(now, key),
                    &self.model.status(s),
                )?;
            }
        }
        Ok(())
    }

    /// Every scope's status and every reservation, engine against model,
    /// then the engines' own invariants.
    fn compare(&mut self) -> Result<(), String> {
        let now = self.now();
        self.model.observe(now);
        self.sweep()?;
        let ids: Vec<ReservationId> = {
            let mut v: Vec<ReservationId> = self.issued.iter().map(|(id, _)| *id).collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        for e in &mut self.engines {
            for id in &ids {
                same(
                    e.label(),
                    &format!("reservation {id}"),
                    &e.get(now, *id),
                    &self.model.get(*id),
                )?;
            }
            e.invariants(now)
                .map_err(|m| format!("{}: invariant: {m}", e.label()))?;
            let want = self.model.live_holds(e.is_shared());
            same(e.label(), "hold count", &e.hold_count(), &want)?;
        }
        Ok(())
    }
}

/// Runs a history, comparing everything after every step. The status
/// sweep reads every scope, even right after a configuration change: a
/// read must not move a scope to its new plan (only its next journaled
/// operation does), which the model checks by moving its scopes only then.
fn run(start_offset_ms: u64, ops: &[Op]) -> Result<(), String> {
    let mut w = World::new(start_offset_ms);
    w.compare().map_err(|e| format!("at the start: {e}"))?;
    for (i, op) in ops.iter().enumerate() {
        let at = w.now();
        w.apply(op)
            .and_then(|()| w.compare())
            .map_err(|e| format!("step {i} at {at} ms, {op:?}:\n{e}"))?;
    }
    Ok(())
}

fn config() -> ProptestConfig {
    let cases = std::env::var("ALLOWANCE_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    ProptestConfig {
        cases,
        // The runner is built by hand (to print the statistics), so it is
        // told the source file the regressions file sits next to.
        source_file: Some(file!()),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        max_shrink_iters: 20_000,
        ..ProptestConfig::default()
    }
}

/// Every step of a long random history leaves both ledgers exactly where
/// the naive model says, with their invariants intact.
#[test]
fn ledger_matches_the_naive_model() {
    let mut runner = TestRunner::new(config());
    let histories = (0u64..3_600_000, prop::collection::vec(op(), 50..=200));
    let result = runner.run(&histories, |(start_offset_ms, ops)| {
        run(start_offset_ms, &ops).map_err(TestCaseError::fail)
    });
    if std::env::var_os("ALLOWANCE_PROPTEST_STATS").is_some() {
        let stats = STATS.lock().unwrap_or_else(|e| e.into_inner());
        for (what, n) in stats.iter() {
            eprintln!("{n:>9}  {what}");
        }
    }
    if let Err(e) = result {
        panic!("{e}");
    }
}

// ------------------------------------------ histories found by the search

/// An `Index` that picks the last element of any collection of up to 1,000.
fn last_index() -> Index {
    use proptest::strategy::ValueTree;
    let mut runner = TestRunner::deterministic();
    loop {
        let i = any::<Index>()
            .new_tree(&mut runner)
            .expect("an index")
            .current();
        if i.index(1000) == 999 {
            return i;
        }
    }
}

/// A reserve of `input_tokens` on tenant 0 (and agent `a0` if asked).
fn reserve_op(agent: bool, input: u64) -> Op {
    Op::Reserve(Box::new(ReqSpec {
        tenant: 0,
        user: None,
        agent: agent.then_some(0),
        search: false,
        ocr: false,
        reverse: false,
        amounts: AmtSet {
            input: Amt::Small(input),
            output: Amt::Zero,
            tokens: None,
            cost: None,
            search: None,
        },
        model: 0,
        ttl: Ttl::Default,
        keyed: false,
        dry_run: false,
        report: false,
        labels: false,
    }))
}

/// A settle of the latest reservation, at what it holds.
fn settle_last_op() -> Op {
    Op::Settle(
        Pick {
            index: last_index(),
            recent: true,
        },
        Box::new(UsageSpec {
            input: UseAmt::Same,
            output: UseAmt::Zero,
            tokens: None,
            cost: None,
            search: None,
            cached: None,
            charges: vec![],
        }),
    )
}

/// A settle right after a plan change records into the scope's new plan:
/// the agent kind moves to a plan with a `requests` limit while a
/// reservation on an agent is held, and its settle counts there.
#[test]
fn settle_after_a_plan_change_records_into_the_new_plan() {
    let ops = [
        reserve_op(true, 0),
        Op::SetKindPlan(2, Some(0)),
        settle_last_op(),
    ];
    run(0, &ops).unwrap_or_else(|e| panic!("{e}"));
}

/// After a plan change lowers a bucket's capacity (same period: its
/// history is kept), a scope not written since still refills at the old
/// rate, even when the idle-scope collector looks at it meanwhile: 8
/// requests used refill in 8 s at 10 per 10 s, and are 3 short at 5 s
/// when the collector runs (6 s more at 5 per 10 s); the next write moves
/// it to the new capacity.
#[test]
fn a_bucket_refills_at_its_old_capacity_until_the_next_write() {
    let mut ops = Vec::new();
    for _ in 0..8 {
        ops.push(reserve_op(false, 0));
        ops.push(settle_last_op());
    }
    ops.push(Op::SetKindPlan(0, Some(1)));
    ops.push(Op::Advance(Step::Ms(5000)));
    ops.push(Op::Advance(Step::Ms(4000)));
    for _ in 0..4 {
        ops.push(reserve_op(false, 0));
        ops.push(settle_last_op());
    }
    ops.push(Op::Advance(Step::Ms(6000)));
    run(0, &ops).unwrap_or_else(|e| panic!("{e}"));
}

// ------------------------------------- the retry audit's cases, as histories

/// A reserve on tenant 0 alone of `input` tokens and `cost` micros, for
/// `ttl` (tenant 0 is on `own-tenant`: tokens 5,000 per sliding minute,
/// cost_micros 200,000 total, requests 10 per 10 s bucket, concurrent 4).
fn reserve_for(input: u64, cost: Option<u64>, ttl: Ttl) -> Op {
    let Op::Reserve(mut spec) = reserve_op(false, input) else {
        unreachable!("a reserve")
    };
    spec.amounts.cost = cost.map(Amt::Small);
    spec.ttl = ttl;
    Op::Reserve(spec)
}

/// An `Index` that picks the first element of any collection.
fn first_index() -> Index {
    use proptest::strategy::ValueTree;
    let mut runner = TestRunner::deterministic();
    loop {
        let i = any::<Index>()
            .new_tree(&mut runner)
            .expect("an index")
            .current();
        if i.index(1000) == 0 {
            return i;
        }
    }
}

/// D1: the earliest hold holds no cost_micros; the total's retry waits for
/// the one that does, before and after the first has ended.
#[test]
fn retry_waits_for_a_hold_of_the_refused_dimension() {
    let ops = [
        reserve_for(0, Some(120_000), Ttl::Long(60_000)),
        reserve_for(10, None, Ttl::Short(1_000)),
        Op::Advance(Step::Small(10)),
        reserve_for(0, Some(100_000), Ttl::Default),
        Op::Advance(Step::Ms(1_000)),
        reserve_for(0, Some(100_000), Ttl::Default),
    ];
    run(0, &ops).unwrap_or_else(|e| panic!("{e}"));
}

/// D2: a hold and usage both in the way of a sliding window: the retry is
/// no earlier than the usage leaving.
#[test]
fn retry_waits_for_usage_behind_holds() {
    let ops = [
        reserve_for(3_500, None, Ttl::Default),
        settle_last_op(),
        reserve_for(1_500, None, Ttl::Short(1_000)),
        reserve_for(4_000, None, Ttl::Default),
        Op::Advance(Step::Ms(1_000)),
        reserve_for(4_000, None, Ttl::Default),
    ];
    run(0, &ops).unwrap_or_else(|e| panic!("{e}"));
}

/// D3 and D5: a total is exhausted when usage alone leaves no room for the
/// request, and rate limited when its holds' ends would.
#[test]
fn a_total_is_exhausted_only_by_usage() {
    let ops = [
        reserve_for(0, Some(60_000), Ttl::Default),
        settle_last_op(),
        reserve_for(0, Some(120_000), Ttl::Short(1_000)),
        // 40,000 ≤ 200,000 − 60,000 used: the hold's end frees it.
        reserve_for(0, Some(40_000), Ttl::Default),
        // 150,000 > 200,000 − 60,000 used: a hard stop.
        reserve_for(0, Some(150_000), Ttl::Default),
        Op::Advance(Step::Ms(1_000)),
        reserve_for(0, Some(150_000), Ttl::Default),
    ];
    run(0, &ops).unwrap_or_else(|e| panic!("{e}"));
}

/// D4: an extend's own hold, the earliest to expire, is not the one its
/// retry waits for; with none other in the way, usage alone blocks.
#[test]
fn extend_does_not_wait_for_its_own_hold() {
    let first = Pick {
        index: first_index(),
        recent: false,
    };
    let cost = |c: u64| AmtSet {
        input: Amt::Zero,
        output: Amt::Zero,
        tokens: None,
        cost: Some(Amt::Small(c)),
        search: None,
    };
    let ops = [
        reserve_for(0, Some(60_000), Ttl::Short(2_000)),
        reserve_for(0, Some(100_000), Ttl::Long(60_000)),
        Op::Advance(Step::Small(10)),
        Op::Extend(first.clone(), Some(cost(60_000)), None),
        Op::Refund(Pick {
            index: last_index(),
            recent: true,
        }),
        Op::Extend(first.clone(), Some(cost(60_000)), None),
        reserve_for(0, Some(60_000), Ttl::Default),
        settle_last_op(),
        // Own 120,000 and 60,000 used: 40,000 more never fits.
        Op::Extend(first, Some(cost(40_000)), None),
    ];
    run(0, &ops).unwrap_or_else(|e| panic!("{e}"));
}

/// The walk's bound: 70 holds of no tokens expire before the one that
/// holds the bucket's tokens; the retry is the 64th's expiry (the walk
/// stops there), in the engine as in the model.
#[test]
fn the_hold_walk_is_bounded() {
    // `tenant3`: tokens 4,000 per 30 s bucket, 20,000 total; cost unbounded.
    let mut ops = vec![Op::SetKindPlan(0, Some(2))];
    for i in 0..70 {
        ops.push(reserve_for(0, None, Ttl::Short(1_000 + i * 10)));
    }
    ops.push(reserve_for(4_000, None, Ttl::Long(60_000)));
    ops.push(reserve_for(1, None, Ttl::Default));
    ops.push(Op::Advance(Step::Ms(1_500)));
    ops.push(reserve_for(1, None, Ttl::Default));
    run(0, &ops).unwrap_or_else(|e| panic!("{e}"));
}
