//! Snapshots: a ledger restored from a snapshot of another answers every
//! later operation exactly as the original does, and a corrupt snapshot is
//! refused or restored whole, never a panic.
//!
//! - `restored_ledgers_answer_like_the_original`: random histories on a
//!   4-shard ledger A (reserves over several tenants and the shared
//!   `tool:*` scopes, with idempotency keys, replays and conflicts, dry
//!   runs; settles below, at and above the hold with tool charges, late
//!   ones included; refunds; extends; adjustments; reads that observe one
//!   shard; `expire_due`; clock moves from a millisecond to hours; catalog
//!   changes that leave scopes on an old plan). At a random step A is
//!   snapshotted, postcard-encoded, decoded and restored into B — with 4
//!   shards, or 1, 2 or 8 — and the rest of the history runs on both: every
//!   answer must be equal, then every scope's status, every reservation,
//!   the remembered ids and the invariants. With 4 shards B's own snapshot
//!   must encode to the same bytes as A's. Restored into another number of
//!   shards, both ledgers observe every shard after every step
//!   (`expire_due`): that is what makes two shard counts forget ended
//!   reservations at the same instants (see `snapshot.rs`).
//! - `garbled_snapshots_are_refused_or_restored_whole` and
//!   `arbitrary_bytes_never_panic`: valid encodings with bytes flipped,
//!   set, dropped or cut, and random bytes, decoded as a snapshot, a request
//!   and a catalog. When a snapshot decodes, `from_snapshot` refuses it or
//!   gives a ledger that passes its invariants, serves operations on
//!   everything it holds, and snapshots and restores again.
//! - Two cases the random histories reach too rarely to rely on: scopes
//!   still on a plan the catalog replaced, and shards that observed
//!   different instants restored into every shard count.
//!
//! 64 cases each by default; `ALLOWANCE_PROPTEST_CASES` for more, and
//! `ALLOWANCE_PROPTEST_STATS=1` (with `--nocapture`) prints what the
//! snapshots held and how corrupt ones were refused.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use allowance_core::*;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::strategy::ValueTree;
use proptest::test_runner::{FileFailurePersistence, TestCaseError, TestRunner};

// ---------------------------------------------------------------- the setup

/// A realistic instant (2023-11-14T22:13:20Z).
const T0_MS: u64 = 1_700_000_000_000;
const SHARDS: usize = 4;
const SEARCH: &str = "search_calls";
const MODEL: &str = "gpt";
const MAX: u64 = MAX_AMOUNT;
/// Short retentions, so that hour-long clock moves make the ledgers forget
/// ended reservations and idempotency keys within one history.
const IDEMPOTENCY_RETENTION_MS: u64 = 600_000;
const ENDED_RETENTION_MS: u64 = 1_200_000;
const MAX_TTL_MS: u64 = 120_000;

const IN: Dimension = Dimension::INPUT_TOKENS;
const OUT: Dimension = Dimension::OUTPUT_TOKENS;
const TOKENS: Dimension = Dimension::TOKENS;
const COST: Dimension = Dimension::COST_MICROS;
const REQUESTS: Dimension = Dimension::REQUESTS;
const CONCURRENT: Dimension = Dimension::CONCURRENT;

/// The kinds, whether each is shared, and its plan at the start.
const KINDS: [(&str, bool, usize); 4] = [
    ("tenant", false, 0),
    ("user", false, 2),
    ("agent", false, 3),
    ("tool", true, 4),
];
const PLAN_NAMES: [&str; 7] = [
    "tenant", "tenant-b", "user", "agent", "tool", "tool-b", "huge",
];
const TOOLS: [&str; 3] = ["search", "ocr", "web"];

fn ts(ms: u64) -> Timestamp {
    Timestamp::from_millis(ms)
}

fn zone(name: &str) -> Zone {
    Zone::named(name).expect("a known zone")
}

fn sliding(period_ms: u64, slices: u32) -> Window {
    Window::Sliding { period_ms, slices }
}

fn bucket(period_ms: u64) -> Window {
    Window::Bucket { period_ms }
}

fn calendar(unit: CalendarUnit, z: &str) -> Window {
    Window::Calendar {
        unit,
        zone: zone(z),
    }
}

/// Plan `i` of [`PLAN_NAMES`] as first defined: every window kind (the
/// calendar ones in UTC and in two zones) and every overrun policy. Plan
/// `huge` lets a slice outgrow 32 bits (wide slices).
fn contents(i: usize, search: Dimension) -> (Vec<Limit>, OverrunPolicy) {
    use CalendarUnit::{Day, Hour, Minute};
    let l = |d, cap, w| Limit::new(d, cap, w).expect("a valid limit");
    match i {
        0 => (
            vec![
                l(TOKENS, 5000, sliding(60_000, 6)),
                l(COST, 200_000, Window::Total),
                l(REQUESTS, 10, bucket(10_000)),
                l(CONCURRENT, 4, Window::Concurrent),
            ],
            OverrunPolicy::ChargeActual,
        ),
        1 => (
            vec![
                l(TOKENS, 4000, bucket(30_000)),
                l(COST, 100_000, calendar(Hour, "Europe/Paris")),
                l(CONCURRENT, 2, Window::Concurrent),
                l(REQUESTS, 8, sliding(10_000, 2)),
            ],
            OverrunPolicy::CapAtEstimate,
        ),
        2 => (
            vec![
                l(TOKENS, 2000, calendar(Minute, "UTC")),
                l(REQUESTS, 3, sliding(4000, 4)),
            ],
            OverrunPolicy::AllowOverrun { percent: 10 },
        ),
        3 => (
            vec![
                l(TOKENS, 1000, sliding(4000, 4)),
                l(OUT, 500, bucket(5000)),
                l(IN, 3000, Window::Total),
            ],
            OverrunPolicy::ChargeActual,
        ),
        4 => (
            vec![
                l(search, 4, calendar(Day, "America/New_York")),
                l(REQUESTS, 6, sliding(10_000, 2)),
                l(CONCURRENT, 3, Window::Concurrent),
            ],
            OverrunPolicy::ChargeActual,
        ),
        5 => (
            vec![
                l(search, 10, bucket(60_000)),
                l(COST, 50_000, sliding(60_000, 3)),
            ],
            OverrunPolicy::ChargeActual,
        ),
        _ => (
            vec![
                l(TOKENS, MAX, sliding(4000, 4)),
                l(COST, MAX, bucket(10_000)),
                l(search, MAX, Window::Total),
            ],
            OverrunPolicy::ChargeActual,
        ),
    }
}

fn plan(name: &str, i: usize, search: Dimension) -> Arc<Plan> {
    let (limits, overrun) = contents(i, search);
    Plan::new(name, limits, overrun).expect("a valid plan")
}

fn catalog() -> Catalog {
    let settings = Settings {
        default_ttl_ms: 20_000,
        max_ttl_ms: MAX_TTL_MS,
        idempotency_retention_ms: IDEMPOTENCY_RETENTION_MS,
        ended_retention_ms: ENDED_RETENTION_MS,
        max_scopes: 8,
        max_labels: 4,
    };
    let mut c = Catalog::new(settings).expect("valid settings");
    let search = c.add_dimension(SEARCH).expect("a valid name");
    for (i, name) in PLAN_NAMES.iter().enumerate() {
        c.set_plan(plan(name, i, search));
    }
    for (kind, shared, p) in KINDS {
        c.set_kind(kind, Some(PLAN_NAMES[p]), shared)
            .expect("a valid kind");
    }
    c.set_model(
        MODEL,
        ModelPrice {
            input_micros_per_million: 2_500_000,
            cached_input_micros_per_million: 1_250_000,
            output_micros_per_million: 10_000_000,
            max_output_tokens: 4096,
            tokenizer: "o200k_base".into(),
        },
    )
    .expect("a valid model");
    // The last tenant is on `huge` from the start, so big settles make
    // wide slices.
    let last = TENANTS.last().expect("tenants");
    c.set_override(
        ScopeKey::tenant(last).expect("a valid tenant"),
        Override::Plan("huge".into()),
    )
    .expect("a valid override");
    c
}

/// Four tenants in four different shards of eight (so in pairs of four,
/// alone in two, together in one).
static TENANTS: LazyLock<Vec<String>> = LazyLock::new(|| {
    let mut out: Vec<String> = Vec::new();
    let mut taken = Vec::new();
    for i in 0.. {
        let name = format!("t{i}");
        let shard = ReservationId::tenant_tag(&name) & 7;
        if !taken.contains(&shard) {
            taken.push(shard);
            out.push(name);
        }
        if out.len() == 4 {
            break;
        }
    }
    out
});

/// Every scope the histories touch: each tenant with two users and two
/// agents, then the shared tools.
static UNIVERSE: LazyLock<Vec<ScopeKey>> = LazyLock::new(|| {
    let mut out = Vec::new();
    for t in TENANTS.iter() {
        out.push(ScopeKey::tenant(t).expect("a valid tenant"));
        for (kind, id) in [
            ("user", "u0"),
            ("user", "u1"),
            ("agent", "a0"),
            ("agent", "a1"),
        ] {
            out.push(ScopeKey::new(t, kind, id, false, "scope").expect("a valid scope"));
        }
    }
    for id in TOOLS {
        out.push(ScopeKey::new("x", "tool", id, true, "scope").expect("a valid scope"));
    }
    out
});

fn cases() -> u32 {
    std::env::var("ALLOWANCE_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

fn encode<T: serde::Serialize>(v: &T) -> Vec<u8> {
    postcard::to_stdvec(v).expect("every value encodes")
}

/// How often each outcome happened over all cases: printed with
/// `ALLOWANCE_PROPTEST_STATS=1`, to see that histories reach every path.
static STATS: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());

fn tally(what: impl Into<String>) {
    let mut stats = STATS.lock().unwrap_or_else(|e| e.into_inner());
    *stats.entry(what.into()).or_default() += 1;
}

/// Every ledger answered the same; `Err` shows the first that did not.
fn same<T: PartialEq + Debug>(what: &str, answers: &[T]) -> Result<(), String> {
    let Some((first, rest)) = answers.split_first() else {
        return Ok(());
    };
    for (i, a) in rest.iter().enumerate() {
        if a != first {
            return Err(format!(
                "{what}: the original answered\n  {first:?}\nledger {} answered\n  {a:?}",
                i + 1
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------- the operations

#[derive(Clone, Debug)]
struct Req {
    tenant: usize,
    user: Option<u8>,
    agent: Option<u8>,
    /// Bit i: tool `TOOLS[i]`.
    tools: u8,
    input: u64,
    output: u64,
    search: u64,
    model: bool,
    ttl_ms: Option<u64>,
    keyed: bool,
    dry_run: bool,
    report: bool,
    labels: bool,
}

/// A usage figure relative to the hold, or absolute.
#[derive(Clone, Debug)]
enum Use {
    Same,
    Half,
    Double,
    Abs(u64),
}

#[derive(Clone, Debug)]
struct UsageSpec {
    input: Use,
    output: Use,
    search: Option<u64>,
    cached: u64,
    /// (cost_micros, search calls) per tool charge.
    charges: Vec<(u64, u64)>,
}

/// Which earlier reservation: one of the last few (likely held), or any.
#[derive(Clone, Debug)]
struct Pick {
    index: Index,
    recent: bool,
}

#[derive(Clone, Debug)]
enum Change {
    KindPlan(usize, Option<usize>),
    /// Plan `.0` gets plan `.1`'s first contents (under its own name).
    Redefine(usize, usize),
    /// A scope moves to a named plan, or gets its own limits.
    Override(Index, usize, bool),
    Clear(Index),
}

#[derive(Clone, Debug)]
enum Op {
    Reserve(Box<Req>),
    /// The request of an earlier keyed reserve again, the same or with
    /// other amounts (a conflict while the key is bound).
    Replay(Index, bool),
    Settle(Pick, Box<UsageSpec>),
    Refund(Pick),
    Extend(Pick, Option<u64>, Option<u64>),
    Advance(u64),
    Adjust(Index, u8, i64),
    /// A status read: observes one shard only.
    Status(Index),
    ExpireDue,
    Change(Change),
}

fn amount() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => Just(0u64),
        8 => 1u64..=400,
        3 => 400u64..=3000,
        1 => Just(1u64 << 33),
        1 => Just(MAX),
        1 => Just(MAX + 1),
    ]
}

fn req() -> impl Strategy<Value = Req> {
    (
        (
            0..TENANTS.len(),
            prop::option::weighted(0.5, 0u8..2),
            prop::option::weighted(0.5, 0u8..2),
            prop_oneof![3 => Just(0u8), 2 => 1u8..8],
        ),
        (
            amount(),
            amount(),
            prop_oneof![3 => Just(0u64), 1 => 0u64..6],
        ),
        (
            prop::bool::weighted(0.4),
            prop::option::weighted(
                0.4,
                prop_oneof![5 => 2u64..=5000, 3 => 20_000u64..=MAX_TTL_MS, 1 => Just(0u64)],
            ),
        ),
        (
            prop::bool::weighted(0.25),
            prop::bool::weighted(0.1),
            prop::bool::weighted(0.15),
            prop::bool::weighted(0.1),
        ),
    )
        .prop_map(
            |((tenant, user, agent, tools), (input, output, search), (model, ttl_ms), flags)| Req {
                tenant,
                user,
                agent,
                tools,
                input,
                output,
                search,
                model,
                ttl_ms,
                keyed: flags.0,
                dry_run: flags.1,
                report: flags.2,
                labels: flags.3,
            },
        )
}

fn use_amt() -> impl Strategy<Value = Use> {
    prop_oneof![
        4 => Just(Use::Same),
        3 => Just(Use::Half),
        2 => Just(Use::Double),
        3 => amount().prop_map(Use::Abs),
    ]
}

fn usage_spec() -> impl Strategy<Value = UsageSpec> {
    (
        use_amt(),
        use_amt(),
        prop::option::weighted(0.3, 0u64..6),
        prop_oneof![3 => Just(0u64), 1 => 0u64..500],
        prop::collection::vec((prop_oneof![0u64..5000, Just(MAX)], 0u64..3), 0..=2),
    )
        .prop_map(|(input, output, search, cached, charges)| UsageSpec {
            input,
            output,
            search,
            cached,
            charges,
        })
}

fn pick() -> impl Strategy<Value = Pick> {
    (any::<Index>(), prop::bool::weighted(0.6)).prop_map(|(index, recent)| Pick { index, recent })
}

fn op() -> impl Strategy<Value = Op> {
    let credit = prop_oneof![
        Just(1i64),
        Just(-1i64),
        Just(1000i64),
        Just(-5000i64),
        Just(MAX as i64),
        Just(i64::MIN),
    ];
    let step = prop_oneof![
        4 => 1u64..=50,
        4 => 50u64..=4000,
        3 => 5000u64..=25_000,
        1 => 3_600_000u64..=7_200_000,
    ];
    let change = prop_oneof![
        2 => (0..KINDS.len(), prop::option::weighted(0.9, 0..PLAN_NAMES.len()))
            .prop_map(|(k, p)| Change::KindPlan(k, p)),
        1 => (0..PLAN_NAMES.len(), 0..PLAN_NAMES.len()).prop_map(|(p, c)| Change::Redefine(p, c)),
        2 => (any::<Index>(), 0..PLAN_NAMES.len(), any::<bool>())
            .prop_map(|(s, p, own)| Change::Override(s, p, own)),
        1 => any::<Index>().prop_map(Change::Clear),
    ];
    prop_oneof![
        30 => req().prop_map(|r| Op::Reserve(Box::new(r))),
        5 => (any::<Index>(), prop::bool::weighted(0.3)).prop_map(|(i, other)| Op::Replay(i, other)),
        16 => (pick(), usage_spec()).prop_map(|(p, u)| Op::Settle(p, Box::new(u))),
        5 => pick().prop_map(Op::Refund),
        8 => (pick(), prop::option::weighted(0.7, amount()), prop::option::weighted(0.5, 0u64..=MAX_TTL_MS))
            .prop_map(|(p, a, t)| Op::Extend(p, a, t)),
        14 => step.prop_map(Op::Advance),
        3 => (any::<Index>(), 0u8..5, credit).prop_map(|(s, d, c)| Op::Adjust(s, d, c)),
        5 => any::<Index>().prop_map(Op::Status),
        2 => Just(Op::ExpireDue),
        3 => change.prop_map(Op::Change),
    ]
}

impl Op {
    fn changes_catalog(&self) -> bool {
        matches!(self, Op::Change(_))
    }
}

// ---------------------------------------------------------- one history

struct World {
    /// The mirror of the ledgers' catalog (to build scope sets).
    catalog: Catalog,
    search: Dimension,
    /// A, then B once restored.
    ledgers: Vec<SharedLedger>,
    now: u64,
    /// Observe every shard after every step (B has another shard count).
    sync: bool,
    /// Whether every scope was read since the last catalog change.
    swept: bool,
    issued: Vec<ReservationId>,
    keyed: Vec<(usize, ReserveRequest)>,
    next_id: u128,
}

impl World {
    fn new(start_ms: u64) -> World {
        let c = catalog();
        let search = c.dimension(SEARCH).expect("registered");
        World {
            ledgers: vec![SharedLedger::new(c.clone(), SHARDS)],
            catalog: c,
            search,
            now: start_ms,
            sync: false,
            swept: true,
            issued: Vec::new(),
            keyed: Vec::new(),
            next_id: 1,
        }
    }

    fn mint(&mut self, tenant: usize) -> ReservationId {
        self.next_id += 1;
        ReservationId::mint((0x5eed_u128 << 96) | (self.next_id << 8), &TENANTS[tenant])
    }

    fn request(&self, r: &Req, key: Option<String>) -> Result<ReserveRequest, String> {
        let users = ["u0", "u1"];
        let agents = ["a0", "a1"];
        let mut pairs: Vec<(&str, &str)> = Vec::new();
        if let Some(u) = r.user {
            pairs.push(("user", users[usize::from(u)]));
        }
        if let Some(a) = r.agent {
            pairs.push(("agent", agents[usize::from(a)]));
        }
        for (i, t) in TOOLS.iter().enumerate() {
            if r.tools & (1 << i) != 0 {
                pairs.push(("tool", t));
            }
        }
        let scopes = self
            .catalog
            .scope_set(&TENANTS[r.tenant], &pairs)
            .map_err(|e| format!("scope_set: {e}"))?;
        let amounts = Amounts::new()
            .with(IN, r.input)
            .with(OUT, r.output)
            .with(self.search, r.search);
        let mut req = ReserveRequest::new(scopes, amounts);
        req.model = r.model.then(|| MODEL.into());
        req.ttl_ms = r.ttl_ms;
        req.idempotency_key = key.map(Into::into);
        req.dry_run = r.dry_run;
        req.report_remaining = r.report;
        if r.labels {
            req.labels = Some(Arc::from(vec![("run".to_string(), "r1".to_string())]));
        }
        Ok(req)
    }

    fn pick(&self, p: &Pick) -> ReservationId {
        if self.issued.is_empty() {
            return ReservationId::mint(0xdead << 64, &TENANTS[0]);
        }
        let from = if p.recent {
            self.issued.len().saturating_sub(4)
        } else {
            0
        };
        self.issued[from + p.index.index(self.issued.len() - from)]
    }

    /// Runs a reserve on every ledger.
    fn reserve(&mut self, tenant: usize, req: &ReserveRequest) -> Result<(), String> {
        let id = self.mint(tenant);
        let now = ts(self.now);
        let answers: Vec<_> = self
            .ledgers
            .iter()
            .map(|l| l.reserve(now, id, req))
            .collect();
        same("reserve", &answers)?;
        if self.ledgers.len() > 1 {
            tally(match &answers[0] {
                Ok(g) if g.replayed => "after: reserve replayed".to_string(),
                Ok(g) if g.dry_run => "after: dry run".to_string(),
                Ok(_) => "after: reserve granted".to_string(),
                Err(ReserveError::Denied(d)) => format!("after: reserve {}", d.kind.as_str()),
                Err(ReserveError::Invalid(i)) => format!("after: reserve invalid {}", i.field),
                Err(ReserveError::IdempotencyConflict { .. }) => {
                    "after: reserve key conflict".into()
                }
                Err(ReserveError::DuplicateId) => "after: reserve duplicate id".into(),
            });
        }
        if let Ok(g) = &answers[0]
            && !g.dry_run
            && !g.replayed
        {
            self.issued.push(id);
        }
        if req.idempotency_key.is_some() && !req.dry_run {
            self.keyed.push((tenant, req.clone()));
        }
        Ok(())
    }

    /// The held amounts of a reservation, as the original remembers it.
    fn held(&self, id: ReservationId) -> Amounts {
        self.ledgers[0]
            .get(ts(self.now), id)
            .map(|r| r.held)
            .unwrap_or_default()
    }

    fn usage(&self, spec: &UsageSpec, held: &Amounts) -> Usage {
        let of = |u: &Use, h: u64| match u {
            Use::Same => h,
            Use::Half => h / 2,
            Use::Double => h.saturating_mul(2),
            Use::Abs(v) => *v,
        };
        let mut amounts = Amounts::new()
            .with(IN, of(&spec.input, held.get(IN)))
            .with(OUT, of(&spec.output, held.get(OUT)));
        if let Some(s) = spec.search {
            amounts.set(self.search, s);
        }
        Usage {
            amounts,
            cached_input_tokens: spec.cached,
            charges: spec
                .charges
                .iter()
                .map(|&(cost, calls)| Charge {
                    name: "search".into(),
                    cost_micros: cost,
                    amounts: Amounts::new().with(self.search, calls),
                })
                .collect(),
        }
    }

    /// Applies a catalog change to every ledger and the mirror.
    fn change(&mut self, ch: &Change) -> Result<(), String> {
        let universe = &*UNIVERSE;
        let search = self.search;
        let f = |c: &mut Catalog| -> Result<(), String> {
            match ch {
                Change::KindPlan(k, p) => {
                    let (kind, shared, _) = KINDS[*k];
                    c.set_kind(kind, p.map(|p| PLAN_NAMES[p]), shared)
                        .map_err(|e| e.to_string())
                }
                Change::Redefine(p, with) => {
                    c.set_plan(plan(PLAN_NAMES[*p], *with, search));
                    Ok(())
                }
                Change::Override(s, p, own) => {
                    let key = universe[s.index(universe.len())].clone();
                    let over = if *own {
                        Override::Limits(plan(&format!("own-{p}"), *p, search))
                    } else {
                        Override::Plan(PLAN_NAMES[*p].into())
                    };
                    c.set_override(key, over).map_err(|e| e.to_string())
                }
                Change::Clear(s) => {
                    c.clear_override(&universe[s.index(universe.len())]);
                    Ok(())
                }
            }
        };
        let want = f(&mut self.catalog);
        let answers: Vec<_> = self.ledgers.iter().map(|l| l.update_catalog(f)).collect();
        same("catalog change", &answers)?;
        same("catalog change (mirror)", &[want, answers[0].clone()])
    }

    fn step(&mut self, op: &Op) -> Result<(), String> {
        // At most one catalog change is ever pending on a scope (each
        // change is preceded by a read of every scope): with two, which
        // limits keep their history would depend on which idle scopes the
        // collector happened to sync in between, which is layout, not state.
        if op.changes_catalog() && !self.swept {
            self.sweep()?;
        }
        let now = ts(self.now);
        let universe = &*UNIVERSE;
        match op {
            Op::Reserve(r) => {
                let key = r.keyed.then(|| format!("key-{}", self.next_id));
                let req = self.request(r, key)?;
                self.reserve(r.tenant, &req)?;
            }
            Op::Replay(i, other) => {
                if self.keyed.is_empty() {
                    return Ok(());
                }
                let (tenant, mut req) = self.keyed[i.index(self.keyed.len())].clone();
                if *other {
                    let out = req.amounts.get(OUT);
                    req.amounts.set(OUT, if out < MAX { out + 1 } else { 1 });
                }
                self.reserve(tenant, &req)?;
            }
            Op::Settle(p, spec) => {
                let id = self.pick(p);
                let usage = self.usage(spec, &self.held(id));
                let answers: Vec<_> = self
                    .ledgers
                    .iter()
                    .map(|l| l.settle_view(now, id, &usage))
                    .collect();
                same("settle", &answers)?;
                if self.ledgers.len() > 1 {
                    tally(match &answers[0] {
                        Ok(r) if r.late => "after: late settle".to_string(),
                        Ok(_) => "after: settle".to_string(),
                        Err(SettleError::Invalid(i)) => {
                            format!("after: settle invalid {}", i.field)
                        }
                        Err(e) => format!("after: settle {e}"),
                    });
                }
            }
            Op::Refund(p) => {
                let id = self.pick(p);
                let answers: Vec<_> = self
                    .ledgers
                    .iter()
                    .map(|l| l.refund_view(now, id))
                    .collect();
                same("refund", &answers)?;
            }
            Op::Extend(p, extra, ttl) => {
                let id = self.pick(p);
                let amounts = extra.map(|a| Amounts::new().with(IN, a));
                let answers: Vec<_> = self
                    .ledgers
                    .iter()
                    .map(|l| l.extend_view(now, id, amounts.as_ref(), *ttl))
                    .collect();
                same("extend", &answers)?;
            }
            Op::Advance(ms) => self.now += ms,
            Op::Adjust(s, d, credit) => {
                let key = &universe[s.index(universe.len())];
                let dim = [TOKENS, COST, REQUESTS, self.search, IN][usize::from(*d)];
                let answers: Vec<_> = self
                    .ledgers
                    .iter()
                    .map(|l| l.adjust(now, key, dim, *credit))
                    .collect();
                same("adjust", &answers)?;
            }
            Op::Status(s) => {
                let key = &universe[s.index(universe.len())];
                let answers: Vec<_> = self.ledgers.iter().map(|l| l.status(now, key)).collect();
                same("status", &answers)?;
            }
            Op::ExpireDue => self.expire_due()?,
            Op::Change(ch) => {
                self.change(ch)?;
                self.swept = false;
            }
        }
        if self.sync {
            self.expire_due()?;
        }
        Ok(())
    }

    fn expire_due(&mut self) -> Result<(), String> {
        let now = ts(self.now);
        let answers: Vec<_> = self.ledgers.iter().map(|l| l.expire_due(now)).collect();
        same("expire_due", &answers)
    }

    /// Every scope's status, on every ledger.
    fn sweep(&mut self) -> Result<(), String> {
        let now = ts(self.now);
        for key in UNIVERSE.iter() {
            let answers: Vec<_> = self.ledgers.iter().map(|l| l.status(now, key)).collect();
            same(&format!("status of {key}"), &answers)?;
        }
        self.swept = true;
        Ok(())
    }

    /// Snapshots A (through postcard) and restores it into B.
    fn restore(&mut self, shards: usize) -> Result<(), String> {
        self.sync = shards != SHARDS;
        if self.sync {
            self.expire_due()?;
        }
        let a = &self.ledgers[0];
        let (marker, snapshot) = a.snapshot_with(|| 42);
        if marker != 42 {
            return Err("snapshot_with did not answer f's value".into());
        }
        if snapshot.shard_count() != SHARDS
            || snapshot.reservation_count() != a.known_reservations().len()
        {
            return Err("the snapshot does not count what A holds".into());
        }
        let debug = format!("{snapshot:?}");
        tally(format!("restore into {shards} shards"));
        for (what, pattern) in [
            ("a scope on an old plan", "stale_plan: Some("),
            ("a hold", "HoldSnapshot"),
            ("wide slices", "wide: [("),
            ("a bound idempotency key", "key_bound: true"),
            ("an expired reservation", "status: Expired"),
            ("a late settle", "late: true"),
        ] {
            if debug.contains(pattern) {
                tally(format!("snapshot with {what}"));
            }
        }
        let bytes = encode(&snapshot);
        // Taking a snapshot changes nothing that shows in the next one.
        if encode(&a.snapshot_with(|| ()).1) != bytes {
            return Err("two snapshots in a row differ".into());
        }
        let decoded: LedgerSnapshot =
            postcard::from_bytes(&bytes).map_err(|e| format!("decode: {e}"))?;
        let b = SharedLedger::from_snapshot(decoded, shards)
            .map_err(|e| format!("restore into {shards} shards: {e}"))?;
        if b.shard_count() != shards {
            return Err(format!("B has {} shards", b.shard_count()));
        }
        if shards == SHARDS && encode(&b.snapshot_with(|| ()).1) != bytes {
            return Err("B's snapshot is not A's".into());
        }
        self.ledgers.push(b);
        Ok(())
    }

    /// Every scope, every reservation, the remembered ids, the invariants.
    fn finish(&mut self) -> Result<(), String> {
        self.sweep()?;
        let now = ts(self.now);
        let mut ids = self.issued.clone();
        ids.sort_unstable();
        ids.dedup();
        for id in ids {
            let answers: Vec<_> = self.ledgers.iter().map(|l| l.get(now, id)).collect();
            same(&format!("reservation {id}"), &answers)?;
        }
        let known: Vec<_> = self
            .ledgers
            .iter()
            .map(|l| {
                let mut v = l.known_reservations();
                v.sort_unstable();
                v
            })
            .collect();
        same("remembered reservations", &known)?;
        self.check()?;
        self.expire_due()
    }

    fn check(&self) -> Result<(), String> {
        for (i, l) in self.ledgers.iter().enumerate() {
            l.check_invariants(ts(self.now))
                .map_err(|e| format!("ledger {i}: invariant: {e}"))?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug)]
struct Case {
    start_offset_ms: u64,
    ops: Vec<Op>,
    snapshot_at: Index,
    shards: usize,
    check_every_step: bool,
}

fn case() -> impl Strategy<Value = Case> {
    (
        0u64..3_600_000,
        prop::collection::vec(op(), 20..=150),
        any::<Index>(),
        prop_oneof![6 => Just(SHARDS), 1 => Just(1usize), 1 => Just(2usize), 2 => Just(8usize)],
        any::<bool>(),
    )
        .prop_map(
            |(start_offset_ms, ops, snapshot_at, shards, check_every_step)| Case {
                start_offset_ms,
                ops,
                snapshot_at,
                shards,
                check_every_step,
            },
        )
}

fn run(c: &Case) -> Result<(), String> {
    let mut w = World::new(T0_MS + c.start_offset_ms);
    let at = c.snapshot_at.index(c.ops.len() + 1);
    for (i, op) in c.ops.iter().enumerate() {
        if i == at {
            w.restore(c.shards)
                .map_err(|e| format!("restore before step {i}: {e}"))?;
        }
        w.step(op)
            .map_err(|e| format!("step {i} at {} ms, {op:?}:\n{e}", w.now))?;
        if i >= at && c.check_every_step {
            w.check().map_err(|e| format!("after step {i}: {e}"))?;
        }
    }
    if at == c.ops.len() {
        w.restore(c.shards)
            .map_err(|e| format!("restore at the end: {e}"))?;
    }
    w.finish().map_err(|e| format!("at the end: {e}"))
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: cases(),
        max_shrink_iters: 10_000,
        // Failures are kept next to this file and replayed first.
        source_file: Some(file!()),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..ProptestConfig::default()
    }
}

/// Snapshot, encode, decode, restore: the rest of the history answers
/// the same on both ledgers, and they end in the same state.
#[test]
fn restored_ledgers_answer_like_the_original() {
    let mut runner = TestRunner::new(config());
    let result = runner.run(&case(), |c| run(&c).map_err(TestCaseError::fail));
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

/// An `Index` that picks element `want` of `len` (found by search: the
/// type has no constructor).
fn index_at(want: usize, len: usize) -> Index {
    let mut runner = TestRunner::deterministic();
    loop {
        let i = any::<Index>()
            .new_tree(&mut runner)
            .expect("an index")
            .current();
        if i.index(len) == want {
            return i;
        }
    }
}

/// A snapshot taken right after a catalog change keeps the scopes that have
/// not caught up on their old plan, and the restored ledger moves them as
/// the original does (usage kept where a limit's window stays).
#[test]
fn scopes_on_an_old_plan_move_to_the_new_one_after_a_restore() {
    let mut w = World::new(T0_MS);
    let r = Req {
        tenant: 0,
        user: Some(0),
        agent: Some(0),
        tools: 1,
        input: 300,
        output: 100,
        search: 1,
        model: false,
        ttl_ms: None,
        keyed: false,
        dry_run: false,
        report: false,
        labels: false,
    };
    let settle = UsageSpec {
        input: Use::Same,
        output: Use::Same,
        search: Some(1),
        cached: 0,
        charges: vec![],
    };
    let last = Pick {
        index: index_at(999, 1000),
        recent: true,
    };
    let ops = [
        Op::Reserve(Box::new(r.clone())),
        Op::Settle(last.clone(), Box::new(settle)),
        Op::Reserve(Box::new(r)),
        Op::Advance(1500),
        // The tenant's plan moves to `tenant-b` (tokens in a bucket now),
        // the agents' to `tenant` (keeping their sliding tokens), the
        // tools' plan is redefined, and one user gets its own limits.
        Op::Change(Change::KindPlan(0, Some(1))),
        Op::Change(Change::KindPlan(2, Some(0))),
        Op::Change(Change::Redefine(4, 5)),
        Op::Change(Change::Override(index_at(1, UNIVERSE.len()), 3, true)),
    ];
    for op in &ops {
        w.step(op).unwrap_or_else(|e| panic!("{op:?}: {e}"));
    }
    // The last change is pending on every scope but read by nothing yet.
    let (_, snap) = w.ledgers[0].snapshot_with(|| ());
    let bytes = encode(&snap);
    let stale = format!("{snap:?}");
    assert!(
        stale.contains("stale_plan: Some("),
        "some scope is on an old plan"
    );
    for shards in [SHARDS, 2] {
        let b = SharedLedger::from_snapshot(postcard::from_bytes(&bytes).expect("decodes"), shards)
            .expect("restores");
        let now = ts(w.now + 10);
        for key in UNIVERSE.iter() {
            assert_eq!(w.ledgers[0].status(now, key), b.status(now, key), "{key}");
        }
        let id = *w.issued.last().expect("issued");
        assert_eq!(w.ledgers[0].get(now, id), b.get(now, id));
    }
}

/// Shards that observed different instants (one expired a reservation its
/// other shards still hold a copy of, or the reverse) restore into any
/// number of shards: once every shard has observed the same instant, the
/// restored ledger and the original agree on everything.
#[test]
fn shards_at_different_instants_restore_into_any_count() {
    let mut w = World::new(T0_MS);
    let universe = &*UNIVERSE;
    let at = |key: &ScopeKey| {
        let i = universe
            .iter()
            .position(|k| k == key)
            .expect("in the universe");
        index_at(i, universe.len())
    };
    for tenant in 0..TENANTS.len() {
        let r = Req {
            tenant,
            user: Some(0),
            agent: None,
            tools: 0b111,
            input: 10,
            output: 5,
            search: 0,
            model: false,
            ttl_ms: Some(5000 + 1000 * tenant as u64),
            keyed: tenant == 0,
            dry_run: false,
            report: false,
            labels: false,
        };
        w.step(&Op::Reserve(Box::new(r))).expect("granted");
    }
    // The first tenant's home sees its reservation expire; one tool's shard
    // sees two of the copies it holds expire; the rest see nothing yet.
    w.step(&Op::Advance(6500)).expect("a step");
    let t0 = ScopeKey::tenant(&TENANTS[0]).expect("a valid tenant");
    // A tool in another shard than the first tenant (shared scopes route
    // by their own name's tag).
    let shard = |name: &str| usize::from(ReservationId::tenant_tag(name)) % SHARDS;
    let tool = TOOLS
        .iter()
        .map(|t| ScopeKey::new("x", "tool", t, true, "scope").expect("a valid scope"))
        .find(|k| shard(k.as_str()) != shard(&TENANTS[0]))
        .expect("a tool in another shard");
    w.step(&Op::Status(at(&t0))).expect("a read");
    w.step(&Op::Advance(1000)).expect("a step");
    w.step(&Op::Status(at(&tool))).expect("a read");
    w.step(&Op::Advance(1)).expect("a step");
    let (_, snap) = w.ledgers[0].snapshot_with(|| ());
    let debug = format!("{snap:?}");
    let instants: std::collections::BTreeSet<&str> = debug
        .split("now_ms: ")
        .skip(1)
        .map(|s| s.split(',').next().unwrap_or(""))
        .collect();
    assert!(
        instants.len() >= 3,
        "shards at different instants: {instants:?}"
    );
    let bytes = encode(&snap);
    let now = ts(w.now);
    let a = &w.ledgers[0];
    a.expire_due(now);
    for shards in [1, 2, SHARDS, 8] {
        let b = SharedLedger::from_snapshot(postcard::from_bytes(&bytes).expect("decodes"), shards)
            .unwrap_or_else(|e| panic!("into {shards} shards: {e}"));
        b.check_invariants(now).expect("invariants");
        assert_eq!(b.expire_due(now), a.expire_due(now), "{shards} shards");
        for key in universe {
            assert_eq!(
                b.status(now, key),
                a.status(now, key),
                "{key}, {shards} shards"
            );
        }
        for id in &w.issued {
            assert_eq!(b.get(now, *id), a.get(now, *id), "{id}, {shards} shards");
        }
        let mut ids = (a.known_reservations(), b.known_reservations());
        ids.0.sort_unstable();
        ids.1.sort_unstable();
        assert_eq!(ids.0, ids.1);
    }
}

// ------------------------------------------------- corrupt snapshots

/// How often each outcome happened: a corruption test that never restores
/// anything, or never refuses, tests little.
#[derive(Default)]
struct Tally {
    undecodable: AtomicU64,
    refused: AtomicU64,
    restored: AtomicU64,
}

static TALLY: LazyLock<Tally> = LazyLock::new(Tally::default);

/// A few real snapshots of 4-shard ledgers, taken after deterministic
/// random histories (shards at different instants, holds across shards,
/// scopes on old plans, wide slices, ended reservations).
static SAMPLES: LazyLock<Vec<Vec<u8>>> = LazyLock::new(|| {
    let mut runner = TestRunner::deterministic();
    let histories = prop::collection::vec(op(), 60..=120);
    let mut out = Vec::new();
    while out.len() < 4 {
        let ops = histories
            .new_tree(&mut runner)
            .expect("a history")
            .current();
        let mut w = World::new(T0_MS);
        if ops.iter().any(|op| w.step(op).is_err()) {
            continue;
        }
        let (_, snap) = w.ledgers[0].snapshot_with(|| ());
        if snap.reservation_count() > 0 {
            out.push(encode(&snap));
        }
    }
    out
});

/// A restored ledger serves every operation on everything it holds
/// without panicking, keeps its invariants, and snapshots and restores
/// again.
fn poke(l: &SharedLedger) -> Result<(), String> {
    let now = ts(T0_MS + 3_600_000);
    l.check_invariants(now)?;
    let scopes = l.known_scopes();
    let ids = l.known_reservations();
    let catalog = l.catalog();
    for key in scopes.iter().take(40) {
        l.status(now, key);
        let _ = l.adjust(now, key, TOKENS, 5);
        if let Some(t) = key.tenant_name()
            && let Ok(set) = catalog.scope_set(t, &[])
        {
            let mut req = ReserveRequest::new(set, Amounts::new().with(IN, 10));
            req.report_remaining = true;
            let _ = l.reserve(now, ReservationId::mint(0xfeed << 64, t), &req);
        }
    }
    let usage = Usage {
        amounts: Amounts::new().with(IN, 7).with(OUT, 3),
        cached_input_tokens: 1,
        charges: vec![Charge {
            name: "x".into(),
            cost_micros: 5,
            amounts: Amounts::new(),
        }],
    };
    for (n, id) in ids.iter().take(40).enumerate() {
        l.get(now, *id);
        let _ = l.extend(now, *id, Some(&Amounts::new().with(OUT, 1)), Some(1000));
        match n % 3 {
            0 => drop(l.settle(now, *id, &usage)),
            1 => drop(l.refund(now, *id)),
            _ => {}
        }
    }
    l.expire_due(now.saturating_add_ms(10_000_000));
    l.check_invariants(now)?;
    let (_, again) = l.snapshot_with(|| ());
    let bytes = encode(&again);
    let back: LedgerSnapshot =
        postcard::from_bytes(&bytes).map_err(|e| format!("re-decode: {e}"))?;
    let restored = SharedLedger::from_snapshot(back, 2)
        .map_err(|e| format!("a live ledger's snapshot is refused: {e}"))?;
    restored.check_invariants(now)
}

/// Decodes `bytes` as a snapshot and restores it into `shards`; a ledger
/// that comes out must pass [`poke`].
fn try_restore(bytes: &[u8], shards: usize) -> Result<(), String> {
    let Ok(snap) = postcard::from_bytes::<LedgerSnapshot>(bytes) else {
        TALLY.undecodable.fetch_add(1, Ordering::Relaxed);
        return Ok(());
    };
    match SharedLedger::from_snapshot(snap, shards) {
        Err(SnapshotError::Inconsistent(why)) => {
            if why.is_empty() {
                return Err("a refusal without a reason".into());
            }
            TALLY.refused.fetch_add(1, Ordering::Relaxed);
            if std::env::var_os("ALLOWANCE_PROPTEST_STATS").is_some() {
                tally(format!(
                    "refused: {}",
                    why.chars().take(90).collect::<String>()
                ));
            }
            Ok(())
        }
        Ok(l) => {
            TALLY.restored.fetch_add(1, Ordering::Relaxed);
            poke(&l)
        }
    }
}

/// One edit of an encoding.
#[derive(Clone, Debug)]
enum Edit {
    Flip(Index, u8),
    Set(Index, u8),
    Remove(Index),
    Insert(Index, u8),
    Cut(Index),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        6 => (any::<Index>(), 1u8..=255).prop_map(|(i, x)| Edit::Flip(i, x)),
        3 => (any::<Index>(), any::<u8>()).prop_map(|(i, v)| Edit::Set(i, v)),
        1 => any::<Index>().prop_map(Edit::Remove),
        1 => (any::<Index>(), any::<u8>()).prop_map(|(i, v)| Edit::Insert(i, v)),
        1 => any::<Index>().prop_map(Edit::Cut),
    ]
}

fn apply(bytes: &mut Vec<u8>, e: &Edit) {
    if bytes.is_empty() {
        return;
    }
    match e {
        Edit::Flip(i, x) => {
            let i = i.index(bytes.len());
            bytes[i] ^= x;
        }
        Edit::Set(i, v) => {
            let i = i.index(bytes.len());
            bytes[i] = *v;
        }
        Edit::Remove(i) => {
            bytes.remove(i.index(bytes.len()));
        }
        Edit::Insert(i, v) => bytes.insert(i.index(bytes.len()), *v),
        Edit::Cut(i) => bytes.truncate(i.index(bytes.len())),
    }
}

/// The encoding of a request with every field set, and of the catalog.
static OTHER_SAMPLES: LazyLock<(Vec<u8>, Vec<u8>)> = LazyLock::new(|| {
    let c = catalog();
    let mut req = ReserveRequest::new(
        c.scope_set(&TENANTS[1], &[("user", "u0"), ("tool", "ocr")])
            .expect("valid"),
        Amounts::new()
            .with(IN, 1200)
            .with(OUT, 80)
            .with(c.dimension(SEARCH).expect("registered"), 2),
    );
    req.model = Some(MODEL.into());
    req.ttl_ms = Some(30_000);
    req.idempotency_key = Some("k-1".into());
    req.labels = Some(Arc::from(vec![("run".to_string(), "r9".to_string())]));
    req.report_remaining = true;
    (encode(&req), encode(&c))
});

/// A decoded request is granted or refused by a ledger, never a panic; a
/// decoded catalog configures a ledger that serves one.
fn try_others(bytes: &[u8]) {
    let c = catalog();
    let now = ts(T0_MS);
    if let Ok(req) = postcard::from_bytes::<ReserveRequest>(bytes) {
        let l = SharedLedger::new(c.clone(), SHARDS);
        let id = ReservationId::mint(0xbeef << 64, req.scopes.tenant_name());
        let _ = l.reserve(now, id, &req);
        let _ = l.settle(now, id, &Usage::default());
    }
    if let Ok(catalog) = postcard::from_bytes::<Catalog>(bytes) {
        let l = SharedLedger::new(catalog.clone(), 2);
        for key in UNIVERSE.iter() {
            l.status(now, key);
        }
        if let Ok(set) = catalog.scope_set(&TENANTS[0], &[("user", "u1")]) {
            let req = ReserveRequest::new(set, Amounts::new().with(IN, 10));
            let _ = l.reserve(now, ReservationId::mint(1 << 64, &TENANTS[0]), &req);
        }
    }
}

/// Corrupt encodings of real snapshots are refused, or restore into
/// ledgers that pass their invariants and serve operations, in as many
/// shards and in others; requests and catalogs too.
#[test]
fn garbled_snapshots_are_refused_or_restored_whole() {
    let mut runner = TestRunner::new(ProptestConfig {
        cases: cases(),
        ..ProptestConfig::default()
    });
    let edits = prop::collection::vec(prop::collection::vec(edit(), 1..=3), 8);
    let result = runner.run(&edits, |variants| {
        for (n, edits) in variants.iter().enumerate() {
            let mut bytes = SAMPLES[n % SAMPLES.len()].clone();
            for e in edits {
                apply(&mut bytes, e);
            }
            let shards = [SHARDS, 2, 8, SHARDS][n % 4];
            try_restore(&bytes, shards).map_err(TestCaseError::fail)?;
            let (req, cat) = &*OTHER_SAMPLES;
            for sample in [req, cat] {
                let mut bytes = sample.clone();
                for e in edits {
                    apply(&mut bytes, e);
                }
                try_others(&bytes);
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    // Unchanged, every sample restores (into every shard count).
    for sample in SAMPLES.iter() {
        for shards in [1, 2, SHARDS, 8] {
            try_restore(sample, shards).unwrap_or_else(|e| panic!("{e}"));
        }
    }
    let (refused, restored) = (
        TALLY.refused.load(Ordering::Relaxed),
        TALLY.restored.load(Ordering::Relaxed),
    );
    if std::env::var_os("ALLOWANCE_PROPTEST_STATS").is_some() {
        let undecodable = TALLY.undecodable.load(Ordering::Relaxed);
        eprintln!(
            "corrupt snapshots: {undecodable} undecodable, {refused} refused, {restored} restored"
        );
        let stats = STATS.lock().unwrap_or_else(|e| e.into_inner());
        for (what, n) in stats.iter().filter(|(w, _)| w.starts_with("refused")) {
            eprintln!("{n:>9}  {what}");
        }
    }
    assert!(
        refused > 0,
        "no corruption was refused: the test saw nothing"
    );
    assert!(restored > 0, "nothing restored: the test saw nothing");
}

proptest! {
    #![proptest_config(config())]

    /// Random bytes never panic a decoder or a restore.
    #[test]
    fn arbitrary_bytes_never_panic(
        bytes in prop::collection::vec(any::<u8>(), 0..400),
        shards in prop_oneof![Just(1usize), Just(SHARDS)],
    ) {
        try_restore(&bytes, shards).map_err(TestCaseError::fail)?;
        // Past the format number, a decoder reads further.
        let mut framed = vec![1u8];
        framed.extend_from_slice(&bytes);
        try_restore(&framed, shards).map_err(TestCaseError::fail)?;
        try_others(&bytes);
    }
}

/// The format number comes first and is checked before anything else.
#[test]
fn another_format_is_refused_at_once() {
    let mut bytes = SAMPLES[0].clone();
    assert_eq!(bytes[0], SNAPSHOT_FORMAT as u8);
    bytes[0] = 2;
    let err = postcard::from_bytes::<LedgerSnapshot>(&bytes).expect_err("refused");
    assert!(!err.to_string().is_empty());
}

/// Names and scope sets are written once: one more settled reservation
/// on the same scopes costs a few dozen bytes (its id alone is 16).
#[test]
fn snapshots_are_compact() {
    let mut c = Catalog::default();
    for (kind, shared, _) in KINDS.iter().skip(1) {
        c.set_kind(kind, None, *shared).expect("a valid kind");
    }
    let ledger = SharedLedger::new(c.clone(), SHARDS);
    let scopes = c
        .scope_set(
            &TENANTS[0],
            &[("user", "u0"), ("agent", "a1"), ("tool", "web")],
        )
        .expect("valid");
    let req = ReserveRequest::new(scopes, Amounts::new().with(IN, 3).with(OUT, 2));
    let usage = Usage {
        amounts: Amounts::new().with(IN, 3).with(OUT, 1),
        ..Usage::default()
    };
    let size = |from: u64, n: u64| {
        for k in from..from + n {
            let now = ts(T0_MS + k);
            let id = ReservationId::mint(u128::from(k) << 64, &TENANTS[0]);
            ledger.reserve(now, id, &req).expect("granted");
            ledger.settle(now, id, &usage).expect("settled");
        }
        encode(&ledger.snapshot_with(|| ()).1).len()
    };
    let (a, b) = (size(0, 100), size(100, 100));
    let per = (b - a) / 100;
    if std::env::var_os("ALLOWANCE_SNAPSHOT_DUMP").is_some() {
        eprintln!("{a} bytes for 100 reservations, {b} for 200: {per} per reservation");
    }
    assert!(per <= 80, "{per} bytes per reservation");
}
