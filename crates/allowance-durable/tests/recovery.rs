//! Recovery: the state rebuilt from snapshot + log equals the live state
//! (a property test over random histories), faults below the log lose
//! nothing acknowledged, and damaged or shared data dirs are refused with
//! exact messages.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use allowance_conformance::catalogs::{self, MINUTE_MS, START_MS};
use allowance_core::{
    Amounts, Catalog, CatalogChange, Clock, Dimension, Limit, ManualClock, Override, OverrunPolicy,
    Plan, Reservation, ReservationId, ReserveRequest, ScopeKey, ScopeStatus, SeededIds, Status,
    Store, StoreError, Timestamp, Usage, UsageRecord, Window,
};
use allowance_durable::{DurableOptions, DurableStore, OpenError, OpenReport};
use allowance_wal::{FaultyFs, FileSystem, Fsync, RealFs, WalError};
use proptest::prelude::*;

/// Proptest cases: modest by default (CI), more with the variable set.
fn cases() -> u32 {
    std::env::var("ALLOWANCE_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

#[derive(Clone, Debug)]
enum Op {
    Reserve {
        tenant: usize,
        user: Option<usize>,
        tool: bool,
        tokens: u64,
        key: Option<u8>,
        ttl_ms: Option<u64>,
        model: bool,
    },
    Settle {
        pick: usize,
        tokens: u64,
        search_calls: u64,
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
        credit: i64,
    },
    Plan {
        tenant: usize,
        plus: Option<bool>,
    },
    /// The user plan redefined: its minute bucket at 60 or 5 (it keeps its
    /// level, and refills at the rate it was written under until the
    /// scope's next write), or a 10 s bucket (another window: its history
    /// goes at the next write, and comes back only if none came between).
    UserRate {
        rate: Option<bool>,
    },
    /// Reads every scope, as a dashboard would: reads are not in the log,
    /// so they must not change what the ledger remembers.
    Sweep,
    Advance {
        ms: u64,
    },
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..3usize, proptest::option::of(0..3usize), any::<bool>(), 0..9_000u64,
              proptest::option::of(0..4u8), proptest::option::of(1_000..600_000u64), any::<bool>())
            .prop_map(|(tenant, user, tool, tokens, key, ttl_ms, model)| Op::Reserve {
                tenant, user, tool, tokens, key, ttl_ms, model
            }),
        3 => (any::<usize>(), 0..12_000u64, 0..3u64)
            .prop_map(|(pick, tokens, search_calls)| Op::Settle { pick, tokens, search_calls }),
        1 => any::<usize>().prop_map(|pick| Op::Refund { pick }),
        1 => (any::<usize>(), proptest::option::of(0..9_000u64), proptest::option::of(1_000..900_000u64))
            .prop_map(|(pick, tokens, ttl_ms)| Op::Extend { pick, tokens, ttl_ms }),
        1 => (0..3usize, -3_000_000..3_000_000i64).prop_map(|(tenant, credit)| Op::Adjust { tenant, credit }),
        1 => (0..3usize, proptest::option::of(any::<bool>())).prop_map(|(tenant, plus)| Op::Plan { tenant, plus }),
        1 => proptest::option::of(any::<bool>()).prop_map(|rate| Op::UserRate { rate }),
        1 => Just(Op::Sweep),
        2 => prop_oneof![0..2_000u64, 0..10 * MINUTE_MS, 0..2 * 24 * 60 * MINUTE_MS]
            .prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Reopen),
    ]
}

const TENANTS: [&str; 3] = ["acme", "beta", "gamma"];

fn reserve_request(catalog: &Catalog, op: &Op) -> ReserveRequest {
    let Op::Reserve {
        tenant,
        user,
        tool,
        tokens,
        key,
        ttl_ms,
        model,
    } = op
    else {
        unreachable!("only reserves")
    };
    let mut scopes = Vec::new();
    let user_name = user.map(|u| format!("u{u}"));
    if let Some(u) = &user_name {
        scopes.push(("user", u.as_str()));
    }
    if *tool {
        scopes.push(("tool", "search"));
    }
    let scopes = catalog
        .scope_set(TENANTS[*tenant], &scopes)
        .expect("valid scopes");
    let mut req = ReserveRequest::new(scopes, Amounts::new().with(Dimension::TOKENS, *tokens));
    if *model {
        req.model = Some("gpt-4o".into());
        req.amounts = Amounts::new()
            .with(Dimension::INPUT_TOKENS, tokens / 2)
            .with(Dimension::OUTPUT_TOKENS, tokens / 2);
    }
    req.ttl_ms = *ttl_ms;
    req.idempotency_key = key.map(|k| format!("key-{k}").into());
    req
}

/// A reserve of `tokens` on one of the tenants only, held for an hour.
fn tenant_only(catalog: &Catalog, i: u64, tokens: u64) -> ReserveRequest {
    reserve_request(
        catalog,
        &Op::Reserve {
            tenant: (i % 3) as usize,
            user: None,
            tool: false,
            tokens,
            key: None,
            ttl_ms: Some(3_600_000),
            model: false,
        },
    )
}

/// The log's default segment size: most tests keep one segment.
const SEGMENT_BYTES: u64 = allowance_wal::DEFAULT_SEGMENT_BYTES;

/// A store of the test's shape on `dir` through `fs`, its log rolling
/// segments at `segment_bytes`.
async fn open_store_segmented(
    dir: &Path,
    fs: Arc<dyn FileSystem>,
    shards: usize,
    snapshot_every: u64,
    segment_bytes: u64,
    clock: &Arc<ManualClock>,
    ids: &Arc<SeededIds>,
) -> Result<(DurableStore, OpenReport), OpenError> {
    open_store_keeping(
        dir,
        fs,
        shards,
        snapshot_every,
        segment_bytes,
        None,
        clock,
        ids,
    )
    .await
}

/// [`open_store_segmented`], and with `usage_keep` the usage log keeps
/// that many records, in segments of `segment_bytes` too.
#[allow(clippy::too_many_arguments, reason = "a test helper's knobs")]
async fn open_store_keeping(
    dir: &Path,
    fs: Arc<dyn FileSystem>,
    shards: usize,
    snapshot_every: u64,
    segment_bytes: u64,
    usage_keep: Option<u64>,
    clock: &Arc<ManualClock>,
    ids: &Arc<SeededIds>,
) -> Result<(DurableStore, OpenReport), OpenError> {
    let mut opts = DurableOptions::new(dir);
    if let Some(keep) = usage_keep {
        opts.usage_keep_records = keep;
        opts.usage_segment_bytes = segment_bytes;
    }
    opts.wal.segment_bytes = segment_bytes;
    opts.shards = shards;
    opts.snapshot_every_records = snapshot_every;
    opts.wal.fsync = Fsync::Always;
    DurableStore::open(
        catalogs::standard(),
        opts,
        fs,
        clock.clone(),
        ids.clone(),
        |_| {},
    )
    .await
}

/// [`open_store_segmented`] with the log's default segment size.
async fn open_store(
    dir: &Path,
    fs: Arc<dyn FileSystem>,
    shards: usize,
    snapshot_every: u64,
    clock: &Arc<ManualClock>,
    ids: &Arc<SeededIds>,
) -> Result<(DurableStore, OpenReport), OpenError> {
    open_store_segmented(dir, fs, shards, snapshot_every, SEGMENT_BYTES, clock, ids).await
}

/// A test's empty data dir, a clock at [`START_MS`], ids seeded with
/// `seed` and the real file system.
fn setup(
    seed: u64,
) -> (
    tempfile::TempDir,
    Arc<ManualClock>,
    Arc<SeededIds>,
    Arc<dyn FileSystem>,
) {
    (
        tempfile::tempdir().expect("temp dir"),
        Arc::new(ManualClock::new(Timestamp::from_millis(START_MS))),
        Arc::new(SeededIds::new(seed)),
        Arc::new(RealFs),
    )
}

/// Leaves in `dir` a closed store's log: its configuration, then `pairs`
/// reserve + refund pairs of tenant-only requests.
async fn write_pairs(
    dir: &Path,
    fs: &Arc<dyn FileSystem>,
    clock: &Arc<ManualClock>,
    ids: &Arc<SeededIds>,
    pairs: u64,
) {
    let (store, _) = open_store(dir, fs.clone(), 4, u64::MAX, clock, ids)
        .await
        .expect("open");
    let catalog = catalogs::standard();
    for i in 0..pairs {
        let req = tenant_only(&catalog, i, 1);
        let id = store.reserve(&req).await.expect("reserve").id;
        store.refund(id).await.expect("refund");
    }
    store.close().await.expect("close");
}

/// [`open_store`], waiting (up to 20 s) while the dir is still held: by a
/// store being replaced, or by a snapshot finishing in the background after
/// a store was dropped as a crash would drop it.
#[allow(clippy::too_many_arguments, reason = "a test helper's knobs")]
async fn open_when_free(
    dir: &Path,
    fs: Arc<dyn FileSystem>,
    shards: usize,
    snapshot_every: u64,
    segment_bytes: u64,
    usage_keep: Option<u64>,
    clock: &Arc<ManualClock>,
    ids: &Arc<SeededIds>,
) -> Result<(DurableStore, OpenReport), OpenError> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        match open_store_keeping(
            dir,
            fs.clone(),
            shards,
            snapshot_every,
            segment_bytes,
            usage_keep,
            clock,
            ids,
        )
        .await
        {
            Err(OpenError::Wal(WalError::Locked { .. }))
                if std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(5)).await
            }
            other => return other,
        }
    }
}

/// Everything observable: every scope's limits and every reservation.
async fn observe(
    store: &DurableStore,
    scopes: &[ScopeKey],
    ids: &[ReservationId],
) -> (Vec<ScopeStatus>, Vec<Option<Reservation>>) {
    let mut statuses = Vec::new();
    for s in scopes {
        statuses.push(store.status(s).await.expect("status"));
    }
    let mut reservations = Vec::new();
    for id in ids {
        reservations.push(store.get(*id).await.expect("get"));
    }
    (statuses, reservations)
}

/// The whole usage log, page by page.
async fn usage_log(store: &DurableStore) -> Vec<UsageRecord> {
    let mut out = Vec::new();
    let mut since = None;
    loop {
        let page = store.usage(since, 7, None).await.expect("usage");
        if page.records.is_empty() {
            return out;
        }
        since = Some(page.next_cursor);
        out.extend(page.records);
    }
}

/// Each end of a reservation is reported once (an expiry and a late settle
/// are two different ends).
fn assert_each_end_once(log: &[UsageRecord]) {
    let mut seen = std::collections::HashSet::new();
    for r in log {
        if let Some(res) = &r.event.reservation {
            assert!(
                seen.insert((r.event.kind, res.id)),
                "{:?} of {} reported twice",
                r.event.kind,
                res.id
            );
        }
    }
}

/// Runs `ops` on the store; returns the ids it was granted.
async fn run(
    store: &mut DurableStore,
    ops: &[Op],
    reopen: &mut impl AsyncFnMut() -> DurableStore,
    clock: &ManualClock,
) -> Vec<ReservationId> {
    let catalog = catalogs::standard();
    let mut granted: Vec<ReservationId> = Vec::new();
    let pick = |granted: &[ReservationId], i: usize| granted.get(i % granted.len().max(1)).copied();
    for op in ops {
        match op {
            Op::Reserve { .. } => {
                if let Ok(g) = store.reserve(&reserve_request(&catalog, op)).await {
                    granted.push(g.id);
                }
            }
            Op::Settle {
                pick: i,
                tokens,
                search_calls,
            } => {
                if let Some(id) = pick(&granted, *i) {
                    let search = catalog.dimension("search_calls").expect("custom dimension");
                    let usage = Usage {
                        amounts: Amounts::new()
                            .with(Dimension::TOKENS, *tokens)
                            .with(search, *search_calls),
                        ..Usage::default()
                    };
                    let _ = store.settle(id, &usage).await;
                }
            }
            Op::Refund { pick: i } => {
                if let Some(id) = pick(&granted, *i) {
                    let _ = store.refund(id).await;
                }
            }
            Op::Extend {
                pick: i,
                tokens,
                ttl_ms,
            } => {
                if let Some(id) = pick(&granted, *i) {
                    let amounts = tokens.map(|t| Amounts::new().with(Dimension::TOKENS, t));
                    let _ = store.extend(id, amounts.as_ref(), *ttl_ms).await;
                }
            }
            Op::Adjust { tenant, credit } => {
                let scope = ScopeKey::tenant(TENANTS[*tenant]).expect("valid");
                let _ = store
                    .adjust(&scope, Dimension::COST_MICROS, *credit, "property test")
                    .await;
            }
            Op::Plan { tenant, plus } => {
                let scope = ScopeKey::tenant(TENANTS[*tenant]).expect("valid");
                let change = match plus {
                    Some(true) => CatalogChange::SetOverride(scope, Override::Plan("plus".into())),
                    Some(false) => {
                        CatalogChange::SetOverride(scope, Override::Plan("tenant-capped".into()))
                    }
                    None => CatalogChange::ClearOverride(scope),
                };
                let _ = store.change_catalog(&change).await;
            }
            Op::UserRate { rate } => {
                let window = Window::Bucket {
                    period_ms: if rate.is_some() { MINUTE_MS } else { 10_000 },
                };
                let per_window = if *rate == Some(true) { 60 } else { 5 };
                let limit = Limit::new(Dimension::REQUESTS, per_window, window).expect("valid");
                let plan = Plan::new("user", vec![limit], OverrunPolicy::ChargeActual)
                    .expect("valid plan");
                store
                    .change_catalog(&CatalogChange::SetPlan(plan))
                    .await
                    .expect("a valid plan");
            }
            Op::Sweep => {
                let scopes = store.with_ledger(|l| l.known_scopes()).expect("serving");
                observe(store, &scopes, &granted).await;
            }
            Op::Advance { ms } => clock.advance_ms(*ms),
            Op::Reopen => {
                // One store per data dir: the old one lets go first.
                store.clone().close().await.expect("close");
                *store = reopen().await;
            }
        }
    }
    granted
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// For random histories (reopened now and then, snapshots every few
    /// records), the ledger rebuilt from snapshot + log answers exactly as
    /// the live one did: every scope's limits, every reservation; and the
    /// usage log is the same where both still keep it (some histories trim
    /// it to a few records at every snapshot).
    #[test]
    fn rebuilt_equals_live(
        ops in proptest::collection::vec(op(), 1..60),
        shards in prop_oneof![Just(1usize), Just(4), Just(16)],
        snapshot_every in 1u64..30,
        // Small segments: the log rolls, snapshots delete whole segments,
        // and a reopen's replay checks the finished ones.
        segment_bytes in prop_oneof![Just(SEGMENT_BYTES), 512u64..4096],
        usage_keep in prop_oneof![Just(None), (1u64..20).prop_map(Some)],
    ) {
        let rt = runtime();
        rt.block_on(async {
            let (dir, clock, ids, fs) = setup(42);
            let (mut store, _) = open_store_keeping(dir.path(), fs.clone(), shards, snapshot_every, segment_bytes, usage_keep, &clock, &ids)
                .await
                .expect("open");
            // A reopen mid-history: `run` closes the old store first (one
            // process per data dir).
            let mut reopen = async || {
                let (s, report) =
                    open_when_free(dir.path(), fs.clone(), shards, snapshot_every, segment_bytes, usage_keep, &clock, &ids)
                        .await
                        .expect("reopen");
                assert!(report.divergences.is_empty(), "{:?}", report.divergences);
                s
            };
            let granted = run(&mut store, &ops, &mut reopen, &clock).await;
            let scopes = store.with_ledger(|l| l.known_scopes()).expect("serving");
            let live = observe(&store, &scopes, &granted).await;
            let live_usage = usage_log(&store).await;
            assert_each_end_once(&live_usage);
            store.with_ledger(|l| l.check_invariants(clock.now())).expect("serving").expect("invariants");
            // As after kill -9: the store is dropped without a clean close
            // (a snapshot still being written holds the dir a moment longer).
            drop(store);
            let rebuilt = reopen().await;
            let again = observe(&rebuilt, &scopes, &granted).await;
            prop_assert_eq!(&live.0, &again.0);
            prop_assert_eq!(&live.1, &again.1);
            // A snapshot still running when the store was dropped may have
            // reported expiries the last reads observed (a tick): those may
            // follow, nothing else.
            let rebuilt_usage = usage_log(&rebuilt).await;
            // Where both still keep records (a trim may have run in either).
            let from = live_usage.first().zip(rebuilt_usage.first()).map_or(0, |(a, b)| a.cursor.max(b.cursor));
            let live_usage: Vec<_> = live_usage.into_iter().filter(|r| r.cursor >= from).collect();
            let rebuilt_usage: Vec<_> = rebuilt_usage.into_iter().filter(|r| r.cursor >= from).collect();
            prop_assert!(rebuilt_usage.len() >= live_usage.len());
            prop_assert_eq!(&live_usage[..], &rebuilt_usage[..live_usage.len()]);
            prop_assert!(rebuilt_usage[live_usage.len()..]
                .iter()
                .all(|r| r.event.kind == allowance_core::UsageKind::Expired));
            prop_assert!(rebuilt_usage.windows(2).all(|w| w[1].cursor == w[0].cursor + 1));
            assert_each_end_once(&rebuilt_usage);
            rebuilt.with_ledger(|l| l.check_invariants(clock.now())).expect("serving").expect("invariants");
            Ok(())
        })?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// The usage log is derived from the main log: lose all of it, or its
    /// tail, and a restart regenerates exactly the same records, cursors
    /// included — and rebuilds the same ledger, though the records before
    /// the usage log's end replay without their events and those after it
    /// with them.
    #[test]
    fn usage_log_is_regenerated_from_the_main_log(
        ops in proptest::collection::vec(op(), 1..60),
        shards in prop_oneof![Just(1usize), Just(4)],
        lose_all in any::<bool>(),
        cut_bytes in 1u64..400,
        segment_bytes in prop_oneof![Just(SEGMENT_BYTES), 512u64..4096],
    ) {
        let rt = runtime();
        rt.block_on(async {
            let (dir, clock, ids, fs) = setup(43);
            // No snapshots: the main log holds everything to regenerate from.
            let (mut store, _) = open_store_segmented(dir.path(), fs.clone(), shards, u64::MAX, segment_bytes, &clock, &ids)
                .await
                .expect("open");
            let mut reopen = async || {
                open_store_segmented(dir.path(), fs.clone(), shards, u64::MAX, segment_bytes, &clock, &ids)
                    .await
                    .expect("reopen")
                    .0
            };
            let granted = run(&mut store, &ops, &mut reopen, &clock).await;
            store.expire_due().await.expect("sweep");
            let before = usage_log(&store).await;
            assert_each_end_once(&before);
            let scopes = store.with_ledger(|l| l.known_scopes()).expect("serving");
            let live = observe(&store, &scopes, &granted).await;
            store.close().await.expect("close");
            let usage_dir = dir.path().join("usage");
            if lose_all {
                std::fs::remove_dir_all(&usage_dir).expect("remove the usage log");
            } else if let Some(last) = std::fs::read_dir(&usage_dir)
                .expect("usage dir")
                .map(|e| e.expect("entry").path())
                .filter(|p| p.extension().is_some_and(|e| e == "wal"))
                .max()
            {
                let len = std::fs::metadata(&last).expect("metadata").len();
                // Cut into the records, never into the segment's header.
                let keep = len.saturating_sub(cut_bytes).max(64.min(len));
                let f = std::fs::OpenOptions::new().write(true).open(&last).expect("open");
                f.set_len(keep).expect("cut");
            }
            let (store, report) = open_store_segmented(dir.path(), fs.clone(), shards, u64::MAX, segment_bytes, &clock, &ids)
                .await
                .expect("reopen");
            prop_assert!(report.divergences.is_empty(), "{:?}", report.divergences);
            prop_assert_eq!(&before, &usage_log(&store).await);
            let again = observe(&store, &scopes, &granted).await;
            prop_assert_eq!(&live.0, &again.0);
            prop_assert_eq!(&live.1, &again.1);
            store.with_ledger(|l| l.check_invariants(clock.now())).expect("serving").expect("invariants");
            // Expiries after the restart are reported once, not again for
            // the records replayed without their events.
            clock.advance_ms(2 * 24 * 60 * MINUTE_MS);
            store.expire_due().await.expect("sweep");
            assert_each_end_once(&usage_log(&store).await);
            Ok(())
        })?;
    }
}

/// What a test knows was acknowledged.
#[derive(Default)]
struct Acked {
    reserved: Vec<ReservationId>,
    settled: Vec<(ReservationId, Reservation)>,
    refunded: Vec<ReservationId>,
}

/// Faults below the log (failed writes, failed fsyncs, short writes, a full
/// disk), then a power loss: nothing acknowledged is lost, the store answers
/// `store_unavailable` while the disk fails and serves again when it works.
#[test]
fn faults_below_the_log_lose_nothing_acknowledged() {
    // Whatever was not fsynced is gone (a few torn bytes kept).
    faults_then_power_loss(|faulty| faulty.crash(13).expect("crash"));
}

/// The same, with a power loss that keeps a random half of the unsynced
/// 64-byte blocks written over the zeros the logs keep ahead: holes before
/// surviving records, which recovery must cut as torn, not refuse.
#[test]
fn faults_then_a_scattered_power_loss_lose_nothing_acknowledged() {
    for seed in 0..3 {
        faults_then_power_loss(|faulty| faulty.crash_scattered(seed, 64).expect("crash"));
    }
}

fn faults_then_power_loss(lose_power: impl Fn(&FaultyFs)) {
    let rt = runtime();
    rt.block_on(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let clock = Arc::new(ManualClock::new(Timestamp::from_millis(START_MS)));
        let ids = Arc::new(SeededIds::new(7));
        let faulty = FaultyFs::new();
        let fs: Arc<dyn FileSystem> = Arc::new(faulty.clone());
        let (store, _) = open_store(dir.path(), fs.clone(), 4, 25, &clock, &ids)
            .await
            .expect("open");
        let catalog = catalogs::standard();
        let mut acked = Acked::default();
        let mut unavailable = 0;
        for round in 0..40u64 {
            // A fault every few rounds, of each kind in turn.
            match round % 8 {
                1 => faulty.fail_write(1 + round % 3),
                3 => faulty.fail_sync(1 + round % 2),
                5 => faulty.short_write(1),
                7 => faulty.fill_disk(200),
                _ => {}
            }
            let req = reserve_request(
                &catalog,
                &Op::Reserve {
                    tenant: (round % 3) as usize,
                    user: Some((round % 2) as usize),
                    tool: round % 4 == 0,
                    tokens: 100 + round,
                    key: None,
                    ttl_ms: Some(3_600_000),
                    model: false,
                },
            );
            let reserved = store.reserve(&req).await;
            let id = match reserved {
                Ok(g) => {
                    acked.reserved.push(g.id);
                    Some(g.id)
                }
                Err(StoreError::Unavailable(_)) => {
                    unavailable += 1;
                    None
                }
                Err(e) => panic!("round {round}: unexpected refusal {e}"),
            };
            if let Some(id) = id {
                let usage = Usage {
                    amounts: Amounts::new().with(Dimension::TOKENS, 50 + round),
                    ..Usage::default()
                };
                if round % 5 == 0 {
                    match store.refund(id).await {
                        Ok(_) => acked.refunded.push(id),
                        Err(StoreError::Unavailable(_)) => unavailable += 1,
                        Err(e) => panic!("round {round}: refund refused {e}"),
                    }
                } else if round % 5 != 1 {
                    // Most settles answer once applied, acknowledged once
                    // durable (as the gateway's whole answers do).
                    let settled = if round % 3 == 0 {
                        store.settle(id, &usage).await
                    } else {
                        match store.settle_decided(id, &usage).await {
                            Ok((r, durable)) => durable
                                .wait()
                                .await
                                .map(|()| r)
                                .map_err(StoreError::Unavailable),
                            Err(e) => Err(e),
                        }
                    };
                    match settled {
                        Ok(r) => acked.settled.push((id, r)),
                        Err(StoreError::Unavailable(_)) => unavailable += 1,
                        Err(e) => panic!("round {round}: settle refused {e}"),
                    }
                }
            }
            // The disk works again: the store must serve again, no restart.
            faulty.recover();
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while store.is_rebuilding() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the store did not rebuild within 20 s"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        assert!(
            unavailable > 0,
            "the faults were never felt: the test proves nothing"
        );
        // Writes in flight at the power loss: a slow disk holds the fsync
        // of a first reserve while eight more queue up behind it; they are
        // written together as the next batch, whose fsync the power loss
        // cuts (never acknowledged, and over the zeros synced ahead: in
        // any order).
        faulty.set_sync_delay(Duration::from_millis(40));
        let spawn_reserve = |i: u64| {
            let store = store.clone();
            let req = reserve_request(
                &catalog,
                &Op::Reserve {
                    tenant: (i % 3) as usize,
                    user: Some(0),
                    tool: false,
                    tokens: 10 + i,
                    key: None,
                    ttl_ms: Some(3_600_000),
                    model: false,
                },
            );
            tokio::spawn(async move { store.reserve(&req).await })
        };
        let mut in_flight = vec![spawn_reserve(0)];
        tokio::time::sleep(Duration::from_millis(10)).await;
        in_flight.extend((1..=8).map(spawn_reserve));
        tokio::time::sleep(Duration::from_millis(50)).await;
        lose_power(&faulty);
        for task in in_flight {
            if let Ok(granted) = task.await.expect("in-flight reserve") {
                acked.reserved.push(granted.id);
            }
        }
        faulty.set_sync_delay(Duration::ZERO);
        drop(store);
        faulty.recover();
        // A snapshot still finishing in the background holds the dir a
        // moment longer (a real power loss would not wait for it).
        let (store, report) = open_when_free(
            dir.path(),
            fs.clone(),
            4,
            25,
            SEGMENT_BYTES,
            None,
            &clock,
            &ids,
        )
        .await
        .expect("reopen after the power loss");
        assert!(report.divergences.is_empty(), "{:?}", report.divergences);
        for (id, answer) in &acked.settled {
            let now = store
                .get(*id)
                .await
                .expect("get")
                .expect("an acknowledged settle is kept");
            assert_eq!(now.status, Status::Settled, "{id}");
            assert_eq!(now.charged, answer.charged, "{id}");
        }
        for id in &acked.refunded {
            let now = store
                .get(*id)
                .await
                .expect("get")
                .expect("an acknowledged refund is kept");
            assert_eq!(now.status, Status::Refunded, "{id}");
        }
        for id in &acked.reserved {
            assert!(
                store.get(*id).await.expect("get").is_some(),
                "acknowledged reserve {id} lost"
            );
        }
        // The usage log was regenerated where the faults cut it: every
        // acknowledged end is in it exactly once.
        let log = usage_log(&store).await;
        assert_each_end_once(&log);
        let logged = |kind: allowance_core::UsageKind, id: ReservationId| {
            log.iter().any(|r| {
                r.event.kind == kind && r.event.reservation.as_ref().is_some_and(|res| res.id == id)
            })
        };
        for (id, _) in &acked.settled {
            assert!(
                logged(allowance_core::UsageKind::Settled, *id),
                "settle {id} not in the usage log"
            );
        }
        for id in &acked.refunded {
            assert!(
                logged(allowance_core::UsageKind::Refunded, *id),
                "refund {id} not in the usage log"
            );
        }
        store
            .with_ledger(|l| l.check_invariants(clock.now()))
            .expect("serving")
            .expect("invariants");
    });
}

/// A torn tail is cut and reported; damage in the middle stops start-up with
/// the file and offset; a second store on the same dir is refused.
#[test]
fn torn_tail_corruption_and_a_second_process() {
    let rt = runtime();
    rt.block_on(async {
        let (dir, clock, ids, fs) = setup(9);
        let catalog = catalogs::standard();
        let (store, _) = open_store(dir.path(), fs.clone(), 4, u64::MAX, &clock, &ids)
            .await
            .expect("open");
        // A second store on the same data dir is refused, naming it.
        let err = open_store(dir.path(), fs.clone(), 4, u64::MAX, &clock, &ids)
            .await
            .expect_err("the dir is taken");
        let message = err.to_string();
        assert!(message.contains("in use"), "{message}");
        assert!(
            message.contains(&dir.path().display().to_string()),
            "{message}"
        );
        let mut ids_granted = Vec::new();
        for i in 0..20u64 {
            let req = tenant_only(&catalog, i, 10 + i);
            ids_granted.push(store.reserve(&req).await.expect("reserve").id);
        }
        store.close().await.expect("close");

        let segment = std::fs::read_dir(dir.path())
            .expect("read dir")
            .map(|e| e.expect("entry").path())
            .find(|p| p.extension().is_some_and(|e| e == "wal"))
            .expect("a segment file");
        // A torn tail: half a record at the end.
        let full = std::fs::read(&segment).expect("read");
        std::fs::write(&segment, &full[..full.len() - 7]).expect("tear");
        let (store, report) = open_store(dir.path(), fs.clone(), 4, u64::MAX, &clock, &ids)
            .await
            .expect("a torn tail is not an error");
        let torn = report.torn_tail.clone().expect("reported");
        assert_eq!(torn.file, segment);
        // The torn record was the last reserve: everything before it is kept.
        for id in &ids_granted[..19] {
            assert!(store.get(*id).await.expect("get").is_some());
        }
        assert!(store.get(ids_granted[19]).await.expect("get").is_none());
        store.close().await.expect("close");

        // Damage in the middle: a flipped byte inside an early record.
        let mut bytes = std::fs::read(&segment).expect("read");
        let at = bytes.len() / 2;
        bytes[at] ^= 0x40;
        std::fs::write(&segment, &bytes).expect("damage");
        let err = open_store(dir.path(), fs.clone(), 4, u64::MAX, &clock, &ids)
            .await
            .expect_err("corruption stops start-up");
        let message = err.to_string();
        assert!(
            message.contains(&segment.display().to_string()) && message.contains("byte "),
            "the message names the file and offset: {message}"
        );
    });
}

/// The store opens its log checking only the last segment and lets the
/// replay check the rest: damage in a finished segment still stops
/// start-up, naming the file and offset, and changes nothing on disk.
#[test]
fn damage_in_a_finished_segment_stops_start_up() {
    let rt = runtime();
    rt.block_on(async {
        let (dir, clock, ids, fs) = setup(10);
        let catalog = catalogs::standard();
        // A few records a segment: 60 records fill several.
        let open = || open_store_segmented(dir.path(), fs.clone(), 4, u64::MAX, 1024, &clock, &ids);
        let (store, _) = open().await.expect("open");
        // Each reserve settled, so the tenants' concurrency limits never bite.
        let mut granted = Vec::new();
        for i in 0..30u64 {
            let req = tenant_only(&catalog, i, 10 + i);
            let id = store.reserve(&req).await.expect("reserve").id;
            let usage = Usage {
                amounts: Amounts::new().with(Dimension::TOKENS, i),
                ..Usage::default()
            };
            store.settle(id, &usage).await.expect("settle");
            granted.push(id);
        }
        store.close().await.expect("close");
        let mut segments: Vec<_> = std::fs::read_dir(dir.path())
            .expect("read dir")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "wal"))
            .collect();
        segments.sort();
        assert!(segments.len() >= 3, "{segments:?}");

        // Undamaged, every reservation comes back.
        let (store, report) = open().await.expect("reopen");
        assert_eq!(
            report.replayed, 61,
            "the configuration record, 30 reserves and settles"
        );
        for id in &granted {
            let r = store.get(*id).await.expect("get").expect("kept");
            assert_eq!(r.status, Status::Settled, "{r:?}");
        }
        store.close().await.expect("close");

        // A flipped byte in the second segment, which is finished.
        let damaged = &segments[1];
        let mut bytes = std::fs::read(damaged).expect("read");
        let at = bytes.len() / 2;
        bytes[at] ^= 0x40;
        std::fs::write(damaged, &bytes).expect("damage");
        let before: Vec<Vec<u8>> = segments
            .iter()
            .map(|p| std::fs::read(p).expect("read"))
            .collect();
        let err = open().await.expect_err("damage stops start-up");
        let message = err.to_string();
        assert!(
            message.contains(&damaged.display().to_string())
                && message.contains("byte ")
                && message.contains("not the last one: damage, not a torn write"),
            "the message names the file, the offset and why: {message}"
        );
        let after: Vec<Vec<u8>> = segments
            .iter()
            .map(|p| std::fs::read(p).expect("read"))
            .collect();
        assert!(before == after, "a failed start-up changed the log");
    });
}

/// Admin changes survive restarts and win over the configuration file; the
/// rest of an edited file takes effect.
#[test]
fn admin_changes_survive_and_win_over_the_file() {
    let rt = runtime();
    rt.block_on(async {
        let (dir, clock, ids, fs) = setup(11);
        let (store, _) = open_store(dir.path(), fs.clone(), 4, u64::MAX, &clock, &ids)
            .await
            .expect("open");
        let acme = ScopeKey::tenant("acme").expect("valid");
        store
            .change_catalog(&CatalogChange::SetOverride(
                acme.clone(),
                Override::Plan("plus".into()),
            ))
            .await
            .expect("override");
        store.close().await.expect("close");

        // Same file: the override is back.
        let (store, report) = open_store(dir.path(), fs.clone(), 4, u64::MAX, &clock, &ids)
            .await
            .expect("reopen");
        assert!(!report.config_changed);
        assert_eq!(report.admin_changes, vec![format!("override on {acme}")]);
        let status = store.status(&acme).await.expect("status");
        assert_eq!(status.plan, "plus");
        store.close().await.expect("close");

        // An edited file (the tenant plan's tokens raised): it applies to
        // everybody, and the override still wins for acme.
        let mut edited = catalogs::standard();
        let mut opts = DurableOptions::new(dir.path());
        opts.shards = 4;
        edited.set_plan(
            allowance_core::Plan::new(
                "tenant",
                vec![
                    allowance_core::Limit::new(
                        Dimension::TOKENS,
                        123,
                        allowance_core::Window::Total,
                    )
                    .expect("valid"),
                ],
                allowance_core::OverrunPolicy::ChargeActual,
            )
            .expect("valid"),
        );
        let (store, report) = DurableStore::open(
            edited.clone(),
            opts.clone(),
            fs.clone(),
            clock.clone(),
            ids.clone(),
            |_| {},
        )
        .await
        .expect("open with the edited file");
        assert!(report.config_changed);
        assert_eq!(store.status(&acme).await.expect("status").plan, "plus");
        let beta = ScopeKey::tenant("beta").expect("valid");
        let beta_status = store.status(&beta).await.expect("status");
        assert_eq!(beta_status.limits[0].capacity, 123);
        store.close().await.expect("close");
        // And it stays so after another restart with the edited file.
        let (store, report) =
            DurableStore::open(edited, opts, fs, clock.clone(), ids.clone(), |_| {})
                .await
                .expect("reopen");
        assert!(!report.config_changed);
        assert_eq!(
            store.status(&beta).await.expect("status").limits[0].capacity,
            123
        );
        assert_eq!(store.status(&acme).await.expect("status").plan, "plus");
    });
}

/// A record that passes its checksum but does not decode (written by
/// something else) stops start-up naming its lsn — the two-thread replay
/// neither hangs nor panics on it, wherever it falls in a batch.
#[test]
fn an_undecodable_record_stops_start_up_with_its_lsn() {
    let rt = runtime();
    rt.block_on(async {
        for garbage_after in [0u64, 5, 1500] {
            let (dir, clock, ids, fs) = setup(5);
            write_pairs(dir.path(), &fs, &clock, &ids, garbage_after).await;
            // A well-framed record (valid checksum) of nonsense.
            let (wal, recovered) =
                allowance_wal::Wal::open(allowance_wal::WalOptions::new(dir.path()), fs.clone())
                    .expect("open the log");
            let lsn = wal.append(&[1, 0xff, 0xff, 0xff]).expect("append");
            assert_eq!(lsn, recovered.last_lsn + 1);
            wal.close().expect("close the log");
            let err = open_store(dir.path(), fs.clone(), 4, u64::MAX, &clock, &ids)
                .await
                .expect_err("an undecodable record stops start-up");
            let message = err.to_string();
            assert!(
                message.contains(&format!("lsn {lsn}")) && message.contains("undecodable"),
                "{message}"
            );
        }
    });
}

/// A record the applying thread refuses (a log whose first record is not
/// its configuration) stops start-up naming the lsn, however many records
/// the reading thread has decoded ahead of it: the reader stops feeding a
/// stopped applier, and the batches it hands back never block either side.
#[test]
fn a_record_the_applier_refuses_stops_start_up_with_its_lsn() {
    let rt = runtime();
    rt.block_on(async {
        let (source, clock, ids, fs) = setup(6);
        write_pairs(source.path(), &fs, &clock, &ids, 3000).await;
        // The same records without the first (the configuration).
        let (wal, _) =
            allowance_wal::Wal::open(allowance_wal::WalOptions::new(source.path()), fs.clone())
                .expect("open the log");
        let mut payloads = Vec::new();
        wal.replay(1, |_, payload| {
            payloads.push(payload.to_vec());
            Ok(())
        })
        .expect("read the log");
        wal.close().expect("close the log");
        assert!(payloads.len() >= 6000, "{} records", payloads.len());

        let headless = tempfile::tempdir().expect("temp dir");
        let (wal, _) =
            allowance_wal::Wal::open(allowance_wal::WalOptions::new(headless.path()), fs.clone())
                .expect("open the new log");
        for payload in &payloads {
            wal.append(payload).expect("append");
        }
        wal.close().expect("close the new log");
        let err = open_store(headless.path(), fs.clone(), 4, u64::MAX, &clock, &ids)
            .await
            .expect_err("a log without its configuration stops start-up");
        let message = err.to_string();
        assert!(
            message.contains("lsn 1:") && message.contains("configuration"),
            "{message}"
        );
    });
}

/// `reserve_decided` answers once applied and is durable when its
/// `Durable` resolves: reservations decided together and awaited together
/// are all there after a reopen, and a dry run has nothing to wait for.
#[test]
fn decided_reserves_are_durable_once_awaited() {
    let rt = runtime();
    rt.block_on(async {
        let (dir, clock, ids, fs) = setup(12);
        let (store, _) = open_store(dir.path(), fs.clone(), 4, u64::MAX, &clock, &ids)
            .await
            .expect("open");
        let catalog = catalogs::standard();
        let mut decided = Vec::new();
        for i in 0..3 {
            let (granted, durable) = store
                .reserve_decided(&tenant_only(&catalog, i, 10 + i))
                .await
                .expect("granted");
            assert!(!durable.is_now(), "a real reserve waits for its log");
            // Applied already: the ledger answers for it before it is durable.
            assert!(store.get(granted.id).await.expect("get").is_some());
            decided.push((granted.id, durable));
        }
        let mut dry = tenant_only(&catalog, 0, 1);
        dry.dry_run = true;
        let (_, durable) = store.reserve_decided(&dry).await.expect("dry run");
        assert!(durable.is_now(), "a dry run changes nothing");
        let ids_held: Vec<_> = decided.iter().map(|(id, _)| *id).collect();
        // The first wait wakes the log's writer, which finds all three.
        for (_, durable) in decided {
            durable.wait().await.expect("durable");
        }
        store.close().await.expect("close");

        let (store, _) = open_store(dir.path(), fs, 4, u64::MAX, &clock, &ids)
            .await
            .expect("reopen");
        for id in ids_held {
            let r = store.get(id).await.expect("get").expect("kept");
            assert_eq!(r.status, allowance_core::Status::Held);
        }
        store.close().await.expect("close");
    });
}

/// A store whose usage log keeps its latest `keep` records, in segments of
/// 2 KiB (about twenty records each), with snapshots only when asked.
async fn open_trimming(
    dir: &Path,
    fs: &Arc<dyn FileSystem>,
    clock: &Arc<ManualClock>,
    ids: &Arc<SeededIds>,
    keep: u64,
) -> DurableStore {
    let mut opts = DurableOptions::new(dir);
    opts.snapshot_every_records = u64::MAX;
    opts.usage_keep_records = keep;
    opts.usage_segment_bytes = 2048;
    opts.wal.fsync = Fsync::Always;
    DurableStore::open(
        catalogs::standard(),
        opts,
        fs.clone(),
        clock.clone(),
        ids.clone(),
        |_| {},
    )
    .await
    .expect("open")
    .0
}

/// The first lsns of the usage log's segments, ascending.
fn usage_segments(dir: &Path) -> Vec<u64> {
    let mut firsts: Vec<u64> = std::fs::read_dir(dir.join("usage"))
        .expect("usage dir")
        .filter_map(|e| {
            let name = e.expect("entry").file_name().into_string().ok()?;
            name.strip_suffix(".wal")?.parse().ok()
        })
        .collect();
    firsts.sort_unstable();
    firsts
}

/// `n` reserve + refund pairs of tenant-only requests: `n` usage records.
async fn refund_pairs(store: &DurableStore, from: u64, n: u64) {
    let catalog = catalogs::standard();
    for i in from..from + n {
        let id = store
            .reserve(&tenant_only(&catalog, i, 1))
            .await
            .expect("reserve")
            .id;
        store.refund(id).await.expect("refund");
    }
}

/// The usage log keeps its latest records: a snapshot deletes the usage
/// segments older than them (the log no longer grows without bound); what
/// is kept is exactly the newest part of what was there, cursors
/// unchanged; a cursor from before it reads on from the oldest kept; and a
/// restart finds the same records and continues their cursors.
#[test]
fn the_usage_log_keeps_its_latest_records() {
    let rt = runtime();
    rt.block_on(async {
        let (dir, clock, ids, fs) = setup(61);
        let store = open_trimming(dir.path(), &fs, &clock, &ids, 50).await;
        refund_pairs(&store, 0, 400).await;
        let before = usage_log(&store).await;
        assert_eq!(before.len(), 400);
        let segments_before = usage_segments(dir.path()).len();
        assert!(segments_before > 10, "{segments_before} segments");

        tokio::task::block_in_place(|| store.snapshot_now()).expect("snapshot");
        let kept = usage_log(&store).await;
        assert!(
            (50..80).contains(&kept.len()),
            "{} records kept, 50 asked (whole segments go)",
            kept.len()
        );
        assert_eq!(kept[..], before[before.len() - kept.len()..]);
        assert!(usage_segments(dir.path()).len() < 10);
        // Any cursor before the oldest kept, or none, starts there.
        for since in [None, Some(0), Some(1), Some(kept[0].cursor - 1)] {
            let page = store.usage(since, 5, None).await.expect("usage");
            assert_eq!(page.records[..], kept[..5], "since {since:?}");
        }
        // A tenant's view is trimmed alike.
        let tenant = kept[0].event.tenant().expect("a tenant").to_owned();
        let page = store.usage(Some(1), 1, Some(&tenant)).await.expect("usage");
        assert_eq!(page.records[0], kept[0]);

        store.close().await.expect("close");
        let store = open_trimming(dir.path(), &fs, &clock, &ids, 50).await;
        assert_eq!(usage_log(&store).await, kept);
        refund_pairs(&store, 400, 3).await;
        let log = usage_log(&store).await;
        let cursors: Vec<u64> = log[log.len() - 3..].iter().map(|r| r.cursor).collect();
        assert_eq!(cursors, [401, 402, 403]);
        // Trimming again keeps the latest again.
        tokio::task::block_in_place(|| store.snapshot_now()).expect("snapshot");
        let log = usage_log(&store).await;
        assert_eq!(log.last().expect("records").cursor, 403);
        assert!(log.len() >= 50 && log[0].cursor >= kept[0].cursor);
        assert!(log.windows(2).all(|w| w[1].cursor == w[0].cursor + 1));
        store.close().await.expect("close");
    });
}

/// A usage log that lost every record after its last trim (damage: they
/// were synced) still opens: the trim's snapshot says how far it had come
/// in the main log, and the events of the main records after that are
/// regenerated.
#[test]
fn a_usage_log_trimmed_to_a_segment_boundary_and_cut_still_opens() {
    let rt = runtime();
    rt.block_on(async {
        let (dir, clock, ids, fs) = setup(62);
        let store = open_trimming(dir.path(), &fs, &clock, &ids, u64::MAX).await;
        refund_pairs(&store, 0, 100).await;
        let all = usage_log(&store).await;
        store.close().await.expect("close");
        // Keep exactly the records of the last segment: the trim then ends
        // where that segment starts.
        let last_first = *usage_segments(dir.path()).last().expect("segments");
        let keep = 100 - (last_first - 1);
        let store = open_trimming(dir.path(), &fs, &clock, &ids, keep).await;
        tokio::task::block_in_place(|| store.snapshot_now()).expect("snapshot");
        assert_eq!(usage_segments(dir.path()), [last_first]);
        refund_pairs(&store, 100, 5).await;
        let before = usage_log(&store).await;
        assert_eq!(before[..keep as usize], all[all.len() - keep as usize..]);
        store.close().await.expect("close");

        // Every record after the trim lost.
        for first in usage_segments(dir.path()) {
            let path = dir.path().join("usage").join(format!("{first:020}.wal"));
            if first == last_first {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .expect("open");
                f.set_len(8).expect("cut to the header");
            } else {
                std::fs::remove_file(&path).expect("remove");
            }
        }
        let store = open_trimming(dir.path(), &fs, &clock, &ids, keep).await;
        let after = usage_log(&store).await;
        // The main log kept the last five pairs (after its snapshot): their
        // refunds come back, numbered on from the trim.
        let events: Vec<_> = after.iter().map(|r| r.event.clone()).collect();
        let expected: Vec<_> = before[before.len() - 5..]
            .iter()
            .map(|r| r.event.clone())
            .collect();
        assert_eq!(events, expected);
        assert_eq!(after[0].cursor, last_first);
        store.close().await.expect("close");
    });
}

/// Pages read while the usage log is trimmed under them never fail, and
/// each is a run of consecutive records.
#[test]
fn usage_pages_read_while_the_log_is_trimmed() {
    let rt = runtime();
    rt.block_on(async {
        let (dir, clock, ids, fs) = setup(63);
        let store = Arc::new(open_trimming(dir.path(), &fs, &clock, &ids, 20).await);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (store, stop) = (store.clone(), stop.clone());
            tokio::spawn(async move {
                let mut reads = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let page = store.usage(None, 10_000, None).await.expect("a page");
                    assert!(
                        page.records
                            .windows(2)
                            .all(|w| w[1].cursor == w[0].cursor + 1)
                    );
                    reads += 1;
                    tokio::task::yield_now().await;
                }
                reads
            })
        };
        for round in 0..10 {
            refund_pairs(&store, round * 30, 30).await;
            tokio::task::block_in_place(|| store.snapshot_now()).expect("snapshot");
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let reads = reader.await.expect("the reader");
        assert!(reads > 0);
        let log = usage_log(&store).await;
        assert_eq!(log.last().expect("records").cursor, 300);
        assert!(log.len() < 60, "{} records kept, 20 asked", log.len());
    });
}

/// The one segment file of a log dir (`dir`, or `dir/usage`).
fn only_wal(dir: &Path) -> std::path::PathBuf {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "wal"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files.pop().expect("one")
}

/// Reservation ids of the `settled` or `refunded` records of a usage log.
fn ended_ids(log: &[UsageRecord]) -> Vec<ReservationId> {
    log.iter()
        .filter_map(|r| r.event.reservation.as_ref().map(|res| res.id))
        .collect()
}

/// A main log that comes back shorter than the usage log (a power loss
/// took acknowledged records it had not synced, or damage to its last
/// write was cut): the start reports the usage records of the lost main
/// records, keeps them (they were exported), and rewinds the usage log, so
/// the events of the records the main log writes next — with the same lsns
/// — are regenerated after a crash instead of being taken for present.
/// (Found by an audit: they went missing from the export for good.)
#[test]
fn a_usage_log_ahead_of_the_main_log_is_reported_and_loses_nothing_after() {
    let rt = runtime();
    rt.block_on(async {
        let (dir, clock, ids, fs) = setup(21);
        write_pairs(dir.path(), &fs, &clock, &ids, 10).await;
        // The main log loses its last records (about two pairs).
        let main = only_wal(dir.path());
        let full = std::fs::read(&main).expect("read");
        std::fs::write(&main, &full[..full.len() - 300]).expect("cut");
        let (store, report) = open_store(dir.path(), fs.clone(), 4, u64::MAX, &clock, &ids)
            .await
            .expect("open");
        let (first, last) = report.usage_ahead.expect("the usage log was ahead");
        assert!(first <= last, "{first}..={last}");
        let before = usage_log(&store).await;
        assert_eq!(before.len(), 10, "the exported records stay");
        // New operations, with the lsns the lost records had.
        let catalog = catalogs::standard();
        let mut new_ids = Vec::new();
        for i in 100..104 {
            let id = store
                .reserve(&tenant_only(&catalog, i, 1))
                .await
                .expect("reserve")
                .id;
            store.refund(id).await.expect("refund");
            new_ids.push(id);
        }
        let after = usage_log(&store).await;
        assert_eq!(&ended_ids(&after)[10..], &new_ids[..]);
        store.close().await.expect("close");

        // A crash before their usage records reached the disk: the next
        // start regenerates them from the main log.
        let usage = only_wal(&dir.path().join("usage"));
        let cut_at = after[10].cursor;
        let bytes = std::fs::read(&usage).expect("read usage");
        let (kept, _) = split_usage_before(&bytes, cut_at);
        std::fs::write(&usage, kept).expect("cut usage");
        let (store, report) = open_store(dir.path(), fs.clone(), 4, u64::MAX, &clock, &ids)
            .await
            .expect("open again");
        assert_eq!(report.usage_ahead, None, "the rewind is on disk");
        let regenerated = usage_log(&store).await;
        assert_eq!(&ended_ids(&regenerated)[10..], &new_ids[..]);
        store.close().await.expect("close");
    });
}

/// The bytes of a usage segment up to its record with lsn `lsn` (not
/// included), and the rest: records are `[len u32][crc u32][lsn u64]
/// [stamp u64][payload]` after an 8-byte header.
fn split_usage_before(bytes: &[u8], lsn: u64) -> (&[u8], &[u8]) {
    let mut at = 8;
    while at + 24 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4")) as usize;
        let record_lsn = u64::from_le_bytes(bytes[at + 8..at + 16].try_into().expect("8"));
        if record_lsn == lsn {
            return bytes.split_at(at);
        }
        at += 24 + len;
    }
    panic!("no usage record {lsn}")
}

/// Under `fsync = "batch"` a settle is acknowledged at its write and synced
/// within the window; its usage record waits for that sync, so a power loss
/// in between takes both or neither: the usage log is never left holding
/// an event the ledger lost. (Found by an audit: the usage log, synced on
/// its own every few ms, reached the disk first — a settle the ledger then
/// did not have was billed, and billed again when settled anew.)
#[test]
fn under_batch_a_power_loss_never_leaves_the_usage_log_ahead() {
    let rt = runtime();
    rt.block_on(async {
        let (dir, clock, ids, _) = setup(22);
        let fs = FaultyFs::new();
        let open = |fs: FaultyFs| {
            let mut opts = DurableOptions::new(dir.path());
            // A window far longer than the test: nothing is synced by it.
            opts.wal.fsync = Fsync::Batch {
                window: Duration::from_secs(30),
            };
            let (clock, ids) = (clock.clone(), ids.clone());
            async move {
                DurableStore::open(catalogs::standard(), opts, Arc::new(fs), clock, ids, |_| {})
                    .await
            }
        };
        let (store, _) = open(fs.clone()).await.expect("open");
        let catalog = catalogs::standard();
        let id = store
            .reserve(&tenant_only(&catalog, 1, 5))
            .await
            .expect("reserve")
            .id;
        store
            .refund(id)
            .await
            .expect("refund, acknowledged at the write");
        assert!(
            usage_log(&store).await.is_empty(),
            "its usage record waits for the main log's sync"
        );
        // Long enough for the usage log's writer (every 5 ms) to have
        // written and synced anything it was given.
        tokio::time::sleep(Duration::from_millis(100)).await;
        fs.crash(0).expect("power loss");
        drop(store);
        fs.recover();
        let (store, report) = open_when_free_with(&open, fs.clone()).await;
        assert_eq!(report.usage_ahead, None);
        assert!(store.get(id).await.expect("get").is_none(), "lost unsynced");
        assert!(usage_log(&store).await.is_empty(), "and so is its record");
        store.close().await.expect("close");
    });
}

/// Opens with `open` on `fs`, waiting while a dropped store still holds
/// the dir (its writer threads finishing).
async fn open_when_free_with<F, Fut>(open: &F, fs: FaultyFs) -> (DurableStore, OpenReport)
where
    F: Fn(FaultyFs) -> Fut,
    Fut: std::future::Future<Output = Result<(DurableStore, OpenReport), OpenError>>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        match open(fs.clone()).await {
            Err(OpenError::Wal(WalError::Locked { .. }))
                if std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(5)).await
            }
            other => return other.expect("reopen after the power loss"),
        }
    }
}

/// A plan set through the admin API wins over the file until it is
/// reverted (`DELETE /v1/plans/{name}`): then the file's version is back at
/// once, stays across a restart, and an edit of the file takes effect at
/// the next start, as for any plan the API never set. (Found by an audit:
/// there was no way back, so the file's edits were ignored for good.)
#[test]
fn a_reverted_plan_follows_the_file_again() {
    let rt = runtime();
    rt.block_on(async {
        let (dir, clock, ids, fs) = setup(12);
        let total = |n| {
            allowance_core::Plan::new(
                "tenant",
                vec![
                    allowance_core::Limit::new(Dimension::TOKENS, n, allowance_core::Window::Total)
                        .expect("valid"),
                ],
                allowance_core::OverrunPolicy::ChargeActual,
            )
            .expect("valid")
        };
        let beta = ScopeKey::tenant("beta").expect("valid");
        let capacity = |store: &DurableStore| {
            let store = store.clone();
            let beta = beta.clone();
            async move { store.status(&beta).await.expect("status").limits[0].capacity }
        };
        let mut opts = DurableOptions::new(dir.path());
        opts.shards = 4;
        let open = |file: Catalog| {
            DurableStore::open(
                file,
                opts.clone(),
                fs.clone(),
                clock.clone(),
                ids.clone(),
                |_| {},
            )
        };
        let mut file = catalogs::standard();
        file.set_plan(total(100));
        let (store, _) = open(file.clone()).await.expect("open");
        store
            .change_catalog(&CatalogChange::SetPlan(total(7)))
            .await
            .expect("set through the API");
        assert_eq!(capacity(&store).await, 7);
        store
            .change_catalog(&CatalogChange::RevertPlan("tenant".into()))
            .await
            .expect("reverted");
        assert_eq!(capacity(&store).await, 100, "the file's at once");
        store.close().await.expect("close");

        let (store, report) = open(file.clone()).await.expect("reopen");
        assert!(
            report.admin_changes.is_empty(),
            "{:?}",
            report.admin_changes
        );
        assert_eq!(capacity(&store).await, 100);
        store.close().await.expect("close");

        file.set_plan(total(61));
        let (store, _) = open(file).await.expect("open the edited file");
        assert_eq!(capacity(&store).await, 61, "the file's edit applies");
        store.close().await.expect("close");
    });
}

/// A torn tail of the usage log is cut and reported, as the main log's is
/// (its events are regenerated from the main log). (Found by an audit: it
/// was cut silently.)
#[test]
fn a_torn_usage_log_tail_is_reported() {
    let rt = runtime();
    rt.block_on(async {
        let (dir, clock, ids, fs) = setup(23);
        write_pairs(dir.path(), &fs, &clock, &ids, 5).await;
        let usage = only_wal(&dir.path().join("usage"));
        let bytes = std::fs::read(&usage).expect("read usage");
        std::fs::write(&usage, &bytes[..bytes.len() - 9]).expect("tear");
        let (store, report) = open_store(dir.path(), fs.clone(), 4, u64::MAX, &clock, &ids)
            .await
            .expect("open");
        let torn = report.usage_torn_tail.expect("reported");
        assert_eq!(torn.file, usage);
        assert_eq!(report.torn_tail, None, "the main log is whole");
        assert_eq!(usage_log(&store).await.len(), 5, "regenerated");
        store.close().await.expect("close");
    });
}
