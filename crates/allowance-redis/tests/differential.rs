//! Property test: the Redis store answers every operation exactly as the
//! engine does, over random histories.
//!
//! The Redis store re-implements the ledger's rules in Lua (`ledger.lua`),
//! and the conformance suite checks them case by case. This test checks
//! them against the engine itself, which `allowance-core`'s model test holds
//! to a naive reference model: one history (reserves on 2 tenants with any
//! of user, agent, task and the shared `tool:search`, dry runs, idempotency
//! keys and their conflicts, model-priced requests; settles below, at and
//! above the hold with a custom dimension; refunds; extends; admin credits
//! and debits; plan overrides set and cleared; `expire_due`; clock steps
//! from milliseconds to days) runs against an [`EmbeddedStore`] and a
//! [`RedisStore`] on the same manual clock, with ids drawn from the same
//! seed. After every operation, the two answers (grant, denial with its
//! scope, limit, `retry_after` and reset, or error) must be equal, and so
//! must every scope's status and every reservation either store granted.
//! At the end, the usage logs must report the same events.
//!
//! The same on a 3-node cluster, where reservations with the shared scope
//! span slots (there the tool plan is never redefined: see `op`). One
//! Redis deployment for the whole test; each case has its
//! own key prefix. 24 cases by default (8 on the cluster);
//! `ALLOWANCE_PROPTEST_CASES=500` for a soak run.
//! Failures are kept in `tests/differential.proptest-regressions` and
//! replayed first.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use allowance_conformance::catalogs::{self, DAY_MS, MINUTE_MS, SECOND_MS, START_MS};
use allowance_core::{
    Amounts, CalendarUnit, Catalog, CatalogChange, Charge, Clock, Dimension, EmbeddedStore, Limit,
    ManualClock, Override, OverrunPolicy, Plan, ReservationId, ReserveRequest, ScopeKey, SeededIds,
    Store, Timestamp, Usage, UsageRecord, Window, Zone,
};
use allowance_redis::{RedisOptions, RedisStore};
use allowance_testkit::{RedisCluster, RedisServer, redis_available};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};

fn cases() -> u32 {
    std::env::var("ALLOWANCE_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24)
}

const TENANTS: [&str; 2] = ["acme", "beta"];

#[derive(Clone, Debug)]
enum Op {
    Reserve {
        tenant: usize,
        user: Option<usize>,
        agent: Option<usize>,
        task: Option<usize>,
        tool: bool,
        tokens: u64,
        search_calls: u64,
        key: Option<u8>,
        ttl_ms: Option<u64>,
        model: bool,
        dry_run: bool,
    },
    Settle {
        pick: usize,
        tokens: u64,
        search_calls: u64,
        /// Reported as input and output tokens (priced by the model, with
        /// this many cached input tokens), not as plain `tokens`.
        split: Option<u64>,
        /// A tool charge of this many micros, counting the search calls.
        charge_micros: Option<u64>,
    },
    Refund {
        pick: usize,
    },
    Extend {
        pick: usize,
        tokens: Option<u64>,
        ttl_ms: Option<u64>,
    },
    Adjust {
        tenant: usize,
        cost: bool,
        credit: i64,
    },
    Plan {
        tenant: usize,
        plan: Option<usize>,
    },
    /// A plan redefined, a model repriced, or users given their own
    /// limits, at run time: `which` picks what, `variant` how.
    Redefine {
        which: usize,
        variant: usize,
    },
    Advance {
        ms: u64,
    },
    ExpireDue,
}

fn op(cluster: bool) -> impl Strategy<Value = Op> {
    let reserve = (
        (
            0..2usize,
            proptest::option::of(0..3usize),
            proptest::option::of(0..2usize),
        ),
        (proptest::option::of(0..2usize), any::<bool>()),
        (prop_oneof![0..3_000u64, 0..30_000u64], 0..40u64),
        (
            proptest::option::of(0..3u8),
            proptest::option::of(1_000..600_000u64),
        ),
        (any::<bool>(), prop::bool::weighted(0.1)),
    )
        .prop_map(
            |(
                (tenant, user, agent),
                (task, tool),
                (tokens, search_calls),
                (key, ttl_ms),
                (model, dry_run),
            )| {
                Op::Reserve {
                    tenant,
                    user,
                    agent,
                    task,
                    tool,
                    tokens,
                    search_calls,
                    key,
                    ttl_ms,
                    model,
                    dry_run,
                }
            },
        );
    prop_oneof![
        8 => reserve,
        4 => (
            (any::<usize>(), prop_oneof![0..3_000u64, 0..40_000u64], 0..50u64),
            (proptest::option::of(0..2_000u64), proptest::option::of(0..5_000_000u64)),
        )
            .prop_map(|((pick, tokens, search_calls), (split, charge_micros))| Op::Settle {
                pick,
                tokens,
                search_calls,
                split,
                charge_micros,
            }),
        2 => any::<usize>().prop_map(|pick| Op::Refund { pick }),
        2 => (any::<usize>(), proptest::option::of(0..20_000u64), proptest::option::of(1_000..900_000u64))
            .prop_map(|(pick, tokens, ttl_ms)| Op::Extend { pick, tokens, ttl_ms }),
        1 => (0..2usize, any::<bool>(), -3_000_000..3_000_000i64)
            .prop_map(|(tenant, cost, credit)| Op::Adjust { tenant, cost, credit }),
        1 => (0..2usize, proptest::option::of(0..3usize)).prop_map(|(tenant, plan)| Op::Plan { tenant, plan }),
        3 => prop_oneof![
            0..2 * SECOND_MS,
            0..2 * MINUTE_MS,
            0..10 * MINUTE_MS,
            0..2 * DAY_MS,
        ]
        .prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::ExpireDue),
        // On a cluster not the tool plan: a cross-slot attempt the
        // tenant's slot refuses leaves the shared scope moved to its new
        // plan (docs/REDIS-STORE.md, "Shared scopes on a cluster").
        1 => (prop::sample::select(if cluster { &[0usize, 1, 3, 4][..] } else { &[0usize, 1, 2, 3, 4][..] }), 0..4usize)
            .prop_map(|(which, variant)| Op::Redefine { which, variant }),
    ]
}

fn limit(dimension: Dimension, capacity: u64, window: Window) -> Limit {
    Limit::new(dimension, capacity, window).expect("valid limit")
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

/// The change a [`Op::Redefine`] makes: other windows and capacities for
/// the agent, user and tool plans (variant 0 is the original), other prices
/// for the model, or own limits for user `u0` of both tenants.
fn redefinition(catalog: &Catalog, which: usize, variant: usize) -> Vec<CatalogChange> {
    let search = catalog.dimension("search_calls").expect("custom dimension");
    let co = OverrunPolicy::ChargeActual;
    let plan = |name: &str, limits: Vec<Limit>| Plan::new(name, limits, co).expect("valid plan");
    let hour_bucket = Window::Bucket {
        period_ms: 60 * MINUTE_MS,
    };
    let minute_bucket = Window::Bucket {
        period_ms: MINUTE_MS,
    };
    match which {
        0 => vec![CatalogChange::SetPlan(plan(
            "agent",
            vec![match variant {
                0 => limit(Dimension::TOKENS, 20_000, calendar(CalendarUnit::Day)),
                1 => limit(Dimension::TOKENS, 5_000, sliding(60 * MINUTE_MS, 12)),
                _ => limit(Dimension::TOKENS, 50_000, hour_bucket),
            }],
        ))],
        1 => vec![CatalogChange::SetPlan(plan(
            "user",
            match variant {
                0 => vec![limit(Dimension::REQUESTS, 60, minute_bucket)],
                // The same bucket at another rate: it keeps its level, and
                // refills at the old rate until the scope's next write.
                1 => vec![limit(Dimension::REQUESTS, 5, minute_bucket)],
                // Another period: the bucket starts afresh.
                2 => vec![limit(
                    Dimension::REQUESTS,
                    5,
                    Window::Bucket {
                        period_ms: 10 * SECOND_MS,
                    },
                )],
                _ => vec![
                    limit(Dimension::REQUESTS, 10, sliding(MINUTE_MS, 6)),
                    limit(Dimension::TOKENS, 30_000, Window::Total),
                    limit(Dimension::CONCURRENT, 2, Window::Concurrent),
                ],
            },
        ))],
        2 => vec![CatalogChange::SetPlan(plan(
            "tool",
            vec![match variant {
                0 => limit(search, 100, sliding(MINUTE_MS, 60)),
                1 => limit(search, 30, sliding(MINUTE_MS, 60)),
                _ => limit(search, 50, calendar(CalendarUnit::Hour)),
            }],
        ))],
        3 => {
            let mut price = catalogs::gpt_4o();
            match variant {
                0 => {}
                1 => {
                    price.input_micros_per_million *= 2;
                    price.cached_input_micros_per_million *= 2;
                    price.output_micros_per_million *= 2;
                }
                _ => {
                    price.input_micros_per_million = 150_000;
                    price.cached_input_micros_per_million = 75_000;
                    price.output_micros_per_million = 600_000;
                }
            }
            vec![CatalogChange::SetModel("gpt-4o".into(), price)]
        }
        _ => TENANTS
            .iter()
            .map(|tenant| {
                let set = catalog
                    .scope_set(tenant, &[("user", "u0")])
                    .expect("valid scopes");
                let user = set
                    .as_slice()
                    .iter()
                    .find(|k| k.kind() == "user")
                    .expect("a user scope")
                    .clone();
                match variant {
                    0 => CatalogChange::ClearOverride(user),
                    1 => CatalogChange::SetOverride(
                        user,
                        Override::Limits(plan(
                            "u0-own",
                            vec![limit(Dimension::TOKENS, 3_000, sliding(10 * MINUTE_MS, 10))],
                        )),
                    ),
                    _ => CatalogChange::SetOverride(user, Override::Plan("task".into())),
                }
            })
            .collect(),
    }
}

fn reserve_request(catalog: &Catalog, op: &Op) -> ReserveRequest {
    let Op::Reserve {
        tenant,
        user,
        agent,
        task,
        tool,
        tokens,
        search_calls,
        key,
        ttl_ms,
        model,
        dry_run,
    } = op
    else {
        unreachable!("only reserves")
    };
    let names: Vec<(&str, String)> = [
        user.map(|u| ("user", format!("u{u}"))),
        agent.map(|a| ("agent", format!("a{a}"))),
        task.map(|t| ("task", format!("t{t}"))),
        tool.then(|| ("tool", "search".to_owned())),
    ]
    .into_iter()
    .flatten()
    .collect();
    let others: Vec<(&str, &str)> = names.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let scopes = catalog
        .scope_set(TENANTS[*tenant], &others)
        .expect("valid scopes");
    let search = catalog.dimension("search_calls").expect("custom dimension");
    let mut amounts = Amounts::new().with(Dimension::TOKENS, *tokens);
    if *tool {
        amounts = amounts.with(search, *search_calls);
    }
    let mut req = ReserveRequest::new(scopes, amounts);
    if *model {
        req.model = Some("gpt-4o".into());
        req.amounts = Amounts::new()
            .with(Dimension::INPUT_TOKENS, tokens / 2)
            .with(Dimension::OUTPUT_TOKENS, tokens - tokens / 2);
    }
    req.ttl_ms = *ttl_ms;
    req.dry_run = *dry_run;
    req.idempotency_key = key.map(|k| format!("key-{k}").into());
    req
}

/// Every scope the histories can touch.
fn universe(catalog: &Catalog) -> Vec<ScopeKey> {
    let mut keys = vec![ScopeKey::parse("tool:search").expect("valid")];
    for tenant in TENANTS {
        let mut others: Vec<(&str, String)> = Vec::new();
        for u in 0..3 {
            others.push(("user", format!("u{u}")));
        }
        for a in 0..2 {
            others.push(("agent", format!("a{a}")));
        }
        for t in 0..2 {
            others.push(("task", format!("t{t}")));
        }
        keys.push(ScopeKey::tenant(tenant).expect("valid"));
        for (kind, id) in &others {
            let set = catalog
                .scope_set(tenant, &[(kind, id.as_str())])
                .expect("valid scopes");
            keys.extend(set.as_slice().iter().filter(|k| !k.is_tenant()).cloned());
        }
    }
    keys
}

/// What a store answered, as text; see [`Ids::name`].
type Answer = String;

/// The reservation ids one store has shown, in order of first appearance.
/// The stores mint ids their own way (the same seed gives different ids),
/// so answers are compared with each id replaced by its place in this list:
/// the same history must show the same ids at the same places.
#[derive(Default)]
struct Ids(Vec<String>);

impl Ids {
    /// `text` with every `rsv_<32 hex digits>` replaced by `#<place>`.
    fn name(&mut self, text: &str) -> String {
        const LEN: usize = 4 + 32;
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(at) = rest.find("rsv_") {
            out.push_str(&rest[..at]);
            let candidate = rest.get(at..at + LEN);
            match candidate.filter(|c| c[4..].bytes().all(|b| b.is_ascii_hexdigit())) {
                Some(id) => {
                    let place = match self.0.iter().position(|known| known == id) {
                        Some(place) => place,
                        None => {
                            self.0.push(id.to_owned());
                            self.0.len() - 1
                        }
                    };
                    out.push_str(&format!("#{place}"));
                    rest = &rest[at + LEN..];
                }
                None => {
                    out.push_str("rsv_");
                    rest = &rest[at + 4..];
                }
            }
        }
        out.push_str(rest);
        out
    }
}

/// Runs one op on `store`; returns its answer and, for a grant that holds,
/// the id.
async fn apply(
    store: &dyn Store,
    catalog: &Catalog,
    granted: &[ReservationId],
    op: &Op,
) -> (Answer, Option<ReservationId>) {
    let pick = |i: usize| granted.get(i % granted.len().max(1)).copied();
    match op {
        Op::Reserve { dry_run, .. } => {
            let answer = store.reserve(&reserve_request(catalog, op)).await;
            let id = match &answer {
                Ok(g) if !dry_run && !g.replayed => Some(g.id),
                _ => None,
            };
            (format!("{answer:?}"), id)
        }
        Op::Settle {
            pick: i,
            tokens,
            search_calls,
            split,
            charge_micros,
        } => match pick(*i) {
            Some(id) => {
                let search = catalog.dimension("search_calls").expect("custom dimension");
                let mut usage = Usage {
                    amounts: Amounts::new().with(Dimension::TOKENS, *tokens),
                    ..Usage::default()
                };
                if let Some(cached) = split {
                    let input = tokens / 3;
                    usage.amounts = Amounts::new()
                        .with(Dimension::INPUT_TOKENS, input)
                        .with(Dimension::OUTPUT_TOKENS, tokens - input);
                    usage.cached_input_tokens = (*cached).min(input);
                }
                match charge_micros {
                    Some(cost_micros) => usage.charges.push(Charge {
                        name: "search".into(),
                        cost_micros: *cost_micros,
                        amounts: Amounts::new().with(search, *search_calls),
                    }),
                    None => usage.amounts = usage.amounts.with(search, *search_calls),
                }
                (format!("{:?}", store.settle(id, &usage).await), None)
            }
            None => ("nothing to settle".into(), None),
        },
        Op::Refund { pick: i } => match pick(*i) {
            Some(id) => (format!("{:?}", store.refund(id).await), None),
            None => ("nothing to refund".into(), None),
        },
        Op::Extend {
            pick: i,
            tokens,
            ttl_ms,
        } => match pick(*i) {
            Some(id) => {
                let amounts = tokens.map(|t| Amounts::new().with(Dimension::TOKENS, t));
                let answer = store.extend(id, amounts.as_ref(), *ttl_ms).await;
                (format!("{answer:?}"), None)
            }
            None => ("nothing to extend".into(), None),
        },
        Op::Adjust {
            tenant,
            cost,
            credit,
        } => {
            let scope = ScopeKey::tenant(TENANTS[*tenant]).expect("valid");
            let dimension = match cost {
                true => Dimension::COST_MICROS,
                false => Dimension::TOKENS,
            };
            let answer = store
                .adjust(&scope, dimension, *credit, "differential test")
                .await;
            (format!("{answer:?}"), None)
        }
        Op::Plan { tenant, plan } => {
            let scope = ScopeKey::tenant(TENANTS[*tenant]).expect("valid");
            let change = match plan {
                Some(p) => {
                    let name = ["plus", "tenant-capped", "tenant-lenient"][*p];
                    CatalogChange::SetOverride(scope, Override::Plan(name.into()))
                }
                None => CatalogChange::ClearOverride(scope),
            };
            (format!("{:?}", store.change_catalog(&change).await), None)
        }
        Op::Redefine { which, variant } => {
            let mut answers = Vec::new();
            for change in redefinition(catalog, *which, *variant) {
                answers.push(format!("{:?}", store.change_catalog(&change).await));
            }
            (answers.join("; "), None)
        }
        // Moved by the caller, once for both stores.
        Op::Advance { .. } => (String::new(), None),
        Op::ExpireDue => (format!("{:?}", store.expire_due().await), None),
    }
}

/// Every scope's status and every granted reservation, as text.
async fn observe(
    store: &dyn Store,
    scopes: &[ScopeKey],
    granted: &[ReservationId],
    ids: &mut Ids,
) -> Vec<String> {
    let mut out = Vec::new();
    for s in scopes {
        out.push(format!("{s}: {:?}", store.status(s).await));
    }
    for id in granted {
        out.push(ids.name(&format!("{id}: {:?}", store.get(*id).await)));
    }
    out
}

/// The whole usage log, page by page, without the cursors (each store
/// numbers its own).
async fn usage_log(store: &dyn Store, ids: &mut Ids) -> Vec<String> {
    let mut out = Vec::new();
    let mut since = None;
    loop {
        let page = store.usage(since, 50, None).await.expect("usage");
        if page.records.is_empty() {
            return out;
        }
        since = Some(page.next_cursor);
        out.extend(
            page.records
                .iter()
                .map(|r: &UsageRecord| ids.name(&format!("{:?}", r.event))),
        );
    }
}

/// Runs `ops` on both stores and fails at the first operation they answer
/// differently, or after which anything observable differs.
async fn compare(
    url: &str,
    prefix: String,
    cluster: bool,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let catalog = catalogs::standard();
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(START_MS)));
    let engine = EmbeddedStore::new(
        catalog.clone(),
        4,
        clock.clone(),
        Arc::new(SeededIds::new(7)),
    );
    let mut options = RedisOptions::new(url);
    options.prefix = prefix;
    let redis = RedisStore::connect(
        options,
        catalog.clone(),
        Some(clock.clone()),
        Arc::new(SeededIds::new(7)),
    )
    .await
    .map_err(|e| TestCaseError::fail(format!("connecting to {url}: {e}")))?;
    prop_assert_eq!(redis.is_cluster(), cluster);
    let scopes = universe(&catalog);
    let (mut engine_ids, mut redis_ids) = (Ids::default(), Ids::default());
    let (mut engine_granted, mut redis_granted) = (Vec::new(), Vec::new());
    for (step, op) in ops.iter().enumerate() {
        if let Op::Advance { ms } = op {
            clock.advance_ms(*ms);
        }
        let (want, id) = apply(&engine, &catalog, &engine_granted, op).await;
        let (got, redis_id) = apply(&redis, &catalog, &redis_granted, op).await;
        let (want, mut got) = (engine_ids.name(&want), redis_ids.name(&got));
        // On a cluster a reservation on a shared scope is decided slot by
        // slot, and the refusal reported is the binding one among the slots
        // that answered (docs/REDIS-STORE.md, "Shared scopes on a
        // cluster"): any refusal answers a refusal; everything after must
        // still be equal.
        const DENIED: &str = "Err(Rejected(Denied(";
        if cluster && want.starts_with(DENIED) && got.starts_with(DENIED) {
            got = want.clone();
        }
        prop_assert_eq!(
            &want,
            &got,
            "step {} ({:?}) at {} ms: the engine answered left, Redis right",
            step,
            op,
            clock.now().as_millis() - START_MS
        );
        prop_assert_eq!(id.is_some(), redis_id.is_some());
        engine_granted.extend(id);
        redis_granted.extend(redis_id);
        let want = observe(&engine, &scopes, &engine_granted, &mut engine_ids).await;
        let got = observe(&redis, &scopes, &redis_granted, &mut redis_ids).await;
        for (w, g) in want.iter().zip(&got) {
            prop_assert_eq!(
                w,
                g,
                "after step {} ({:?}) at {} ms: the engine saw left, Redis right",
                step,
                op,
                clock.now().as_millis() - START_MS
            );
        }
    }
    // Both report every expiry, but not at the same moment: the engine
    // with the next operation that writes on the tenant's shard, Redis as
    // soon as anything looks. So: everything reported, then the same
    // events in any order.
    prop_assert_eq!(engine.expire_due().await, redis.expire_due().await);
    let mut want = usage_log(&engine, &mut engine_ids).await;
    let mut got = usage_log(&redis, &mut redis_ids).await;
    want.sort();
    got.sort();
    prop_assert_eq!(want, got, "the usage logs differ");
    Ok(())
}

/// Runs the property on the Redis deployment at `url`, `cases` histories.
fn run_histories(url: &str, cases: u32, cluster: bool) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let case = AtomicU64::new(0);
    let config = Config {
        cases,
        // The runner is built by hand (one Redis for every case), so it is
        // told where the regressions file goes.
        source_file: Some(file!()),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let result = runner.run(&proptest::collection::vec(op(cluster), 1..120), |ops| {
        let prefix = format!("diff{}:", case.fetch_add(1, Ordering::Relaxed));
        rt.block_on(compare(url, prefix, cluster, &ops))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Random histories: the Redis store on one node and the engine agree at
/// every step.
#[test]
fn redis_answers_as_the_engine_does() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start();
    run_histories(&server.url(), cases(), false);
}

/// The same on a 3-node cluster, where a reservation with the shared
/// `tool:search` spans two slots (`cross.rs`: one script per slot, a
/// denial compensated): run one operation at a time, it must answer
/// exactly as the engine does. A third of the cases (a cluster costs more
/// round trips).
#[test]
fn redis_cluster_answers_as_the_engine_does() {
    let Some(()) = redis_available() else { return };
    let cluster = RedisCluster::start(3);
    run_histories(&cluster.urls()[0], cases().div_ceil(3), true);
}

/// A refund, or an extend that only moves the expiry, must leave a scope
/// on the plan it was last written under, as the engine does: on one node
/// and on a cluster, where the shared scope's holds are released and
/// re-timed by scripts of their own (`fend`, `fextend`). Here the tool
/// plan's window changes and changes back around them; the minute's 5
/// search calls must still count.
#[test]
fn a_release_leaves_the_scope_on_its_plan() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start();
    let cluster = RedisCluster::start(3);
    let reserve = Op::Reserve {
        tenant: 0,
        user: None,
        agent: None,
        task: None,
        tool: true,
        tokens: 100,
        search_calls: 5,
        key: None,
        ttl_ms: None,
        model: false,
        dry_run: false,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let release = Op::Refund { pick: 1 };
    let retime = Op::Extend {
        pick: 1,
        tokens: None,
        ttl_ms: Some(60_000),
    };
    for (i, between) in [release, retime].into_iter().enumerate() {
        let ops = [
            reserve.clone(),
            Op::Settle {
                pick: 0,
                tokens: 100,
                search_calls: 5,
                split: None,
                charge_micros: None,
            },
            reserve.clone(),
            // The tool plan on a calendar hour, then back on its sliding
            // minute.
            Op::Redefine {
                which: 2,
                variant: 2,
            },
            Op::Advance { ms: 1_000 },
            between,
            Op::Redefine {
                which: 2,
                variant: 0,
            },
        ];
        let prefix = format!("release{i}:");
        rt.block_on(compare(&server.url(), prefix.clone(), false, &ops))
            .unwrap_or_else(|e| panic!("on one node: {e}"));
        rt.block_on(compare(&cluster.urls()[0], prefix, true, &ops))
            .unwrap_or_else(|e| panic!("on the cluster: {e}"));
    }
}
