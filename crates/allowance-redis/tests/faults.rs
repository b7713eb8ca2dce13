//! The Redis store under faults, at the store level (no HTTP): Redis killed
//! mid-load, frozen with SIGSTOP, killed and restarted from an append-only
//! file, a scope blob corrupted under a script, and racing settles and
//! refunds. Every test runs against its own redis-server (from
//! `allowance-testkit`), with the store on Redis `TIME` (no injected clock).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use allowance_conformance::catalogs::standard;
use allowance_core::{
    Amounts, Catalog, Dimension, IdSource, Limit, OverrunPolicy, Plan, RefundError, Reservation,
    ReservationId, ReserveError, ReserveRequest, ScopeKey, ScopeStatus, SeededIds, Settings,
    SettleError, Status, Store, StoreError, Usage, UsageKind, Window, WindowKind,
};
use allowance_redis::{RedisOptions, RedisStore};
use allowance_testkit::{RedisOptions as ServerOptions, RedisServer, redis_available};
use tokio::sync::Barrier;

/// Each call must come back within this, whatever the server does.
const CALL_BOUND: Duration = Duration::from_secs(3);
/// How long a recovered server has to serve the same store again.
const RECOVERY: Duration = Duration::from_secs(10);

fn ids(seed: u64) -> Arc<dyn IdSource> {
    Arc::new(SeededIds::new(seed))
}

async fn connect(
    url: &str,
    prefix: &str,
    timeout_ms: u64,
    catalog: Catalog,
    seed: u64,
) -> RedisStore {
    let mut options = RedisOptions::new(url);
    options.prefix = prefix.into();
    options.timeout_ms = timeout_ms;
    RedisStore::connect(options, catalog, None, ids(seed))
        .await
        .unwrap_or_else(|e| panic!("connecting to {url}: {e}"))
}

fn tokens(n: u64) -> Amounts {
    Amounts::new().with(Dimension::TOKENS, n)
}

fn usage(amounts: Amounts) -> Usage {
    Usage {
        amounts,
        ..Usage::default()
    }
}

fn request(catalog: &Catalog, tenant: &str, others: &[(&str, &str)], a: Amounts) -> ReserveRequest {
    let scopes = catalog
        .scope_set(tenant, others)
        .unwrap_or_else(|e| panic!("scopes of {tenant} {others:?}: {e}"));
    ReserveRequest::new(scopes, a)
}

/// Runs a blocking testkit call (kill, restart, stop…) off the async workers' backs.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// Reserves until the store answers again (after a fault is lifted).
async fn reserve_until_served(
    store: &RedisStore,
    req: &ReserveRequest,
) -> (ReservationId, Duration) {
    let started = Instant::now();
    loop {
        match store.reserve(req).await {
            Ok(g) => return (g.id, started.elapsed()),
            Err(StoreError::Unavailable(e)) => {
                assert!(
                    started.elapsed() < RECOVERY,
                    "the same store did not serve again within {RECOVERY:?}: last error {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(StoreError::Rejected(e)) => panic!("a reserve after recovery was refused: {e:?}"),
        }
    }
}

/// What one load task saw.
#[derive(Debug, Default)]
struct LoadReport {
    ok: u64,
    unavailable_before_kill: u64,
    denied_before_kill: u64,
    calls_after_kill: u64,
    slowest: Duration,
}

/// Records a call's outcome; panics on anything but Unavailable once the
/// server is known dead, and on a call slower than [`CALL_BOUND`].
fn note<T, E: std::fmt::Debug>(
    report: &mut LoadReport,
    what: &str,
    after_kill: bool,
    took: Duration,
    r: &Result<T, StoreError<E>>,
) {
    report.slowest = report.slowest.max(took);
    assert!(
        took < CALL_BOUND,
        "a {what} took {took:?} (bound {CALL_BOUND:?})"
    );
    if after_kill {
        report.calls_after_kill += 1;
        match r {
            Err(StoreError::Unavailable(_)) => {}
            Ok(_) => panic!("a {what} started after the kill succeeded"),
            Err(StoreError::Rejected(e)) => {
                panic!("a {what} started after the kill was answered with {e:?}")
            }
        }
        return;
    }
    match r {
        Ok(_) => report.ok += 1,
        Err(StoreError::Unavailable(_)) => report.unavailable_before_kill += 1,
        Err(StoreError::Rejected(e)) => {
            // A hold left by a settle lost to the kill can fill the
            // tenant's concurrency; nothing else may be refused.
            assert!(
                format!("{e:?}").starts_with("Denied"),
                "a {what} before the kill was refused: {e:?}"
            );
            report.denied_before_kill += 1;
        }
    }
}

/// 1. Redis is killed under 16 concurrent reserve+settle loops: from then on
///    every call fails closed (Unavailable) within its bound, and once the
///    server is back the same store serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_when_redis_dies_mid_load() {
    let Some(()) = redis_available() else { return };
    const TASKS: usize = 16;
    let mut server = RedisServer::start();
    let catalog = standard();
    let store = Arc::new(connect(&server.url(), "faults:", 300, catalog.clone(), 1).await);
    let killed: Arc<OnceLock<Instant>> = Arc::new(OnceLock::new());
    let stop = Arc::new(AtomicBool::new(false));

    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (store, killed, stop) = (store.clone(), killed.clone(), stop.clone());
            // The tenant scope only: a user's bucket (60 a minute) would refuse a fast loop.
            let req = request(&catalog, &format!("load-{t}"), &[], tokens(1));
            tokio::spawn(async move {
                let mut report = LoadReport::default();
                while !stop.load(Ordering::SeqCst) {
                    let after_kill = killed.get().is_some();
                    let started = Instant::now();
                    let r = store.reserve(&req).await;
                    note(&mut report, "reserve", after_kill, started.elapsed(), &r);
                    let Ok(g) = r else {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    };
                    let after_kill = killed.get().is_some();
                    let started = Instant::now();
                    let r = store.settle(g.id, &usage(tokens(1))).await;
                    note(&mut report, "settle", after_kill, started.elapsed(), &r);
                    if r.is_err() {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
                report
            })
        })
        .collect();

    tokio::time::sleep(Duration::from_millis(200)).await;
    blocking(|| server.kill9());
    killed.set(Instant::now()).expect("killed once");
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::SeqCst);

    let mut reports = Vec::new();
    for (t, task) in tasks.into_iter().enumerate() {
        let report = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .unwrap_or_else(|_| panic!("load task {t} did not end"))
            .unwrap_or_else(|e| panic!("load task {t} panicked: {e}"));
        assert!(
            report.calls_after_kill > 0,
            "task {t} made no call after the kill: {report:?}"
        );
        reports.push(report);
    }
    let ok: u64 = reports.iter().map(|r| r.ok).sum();
    assert!(ok > 0, "nothing succeeded before the kill: {reports:?}");
    let slowest = reports.iter().map(|r| r.slowest).max().unwrap_or_default();
    eprintln!(
        "before the kill: {ok} ok, {} unavailable, {} denied; after: {} calls, all unavailable; slowest call {slowest:?}",
        reports
            .iter()
            .map(|r| r.unavailable_before_kill)
            .sum::<u64>(),
        reports.iter().map(|r| r.denied_before_kill).sum::<u64>(),
        reports.iter().map(|r| r.calls_after_kill).sum::<u64>(),
    );

    // No AOF: the data is gone, but the same store object serves again.
    blocking(|| server.restart());
    let req = request(&catalog, "after-restart", &[("user", "u1")], tokens(5));
    let (id, waited) = reserve_until_served(&store, &req).await;
    eprintln!("served again {waited:?} after the restart");
    let settled = store
        .settle(id, &usage(tokens(4)))
        .await
        .expect("a settle after the restart");
    assert_eq!(settled.status, Status::Settled);
}

/// 2. A frozen Redis (SIGSTOP): calls fail within the timeout, and the store
///    serves again after SIGCONT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_fails_within_the_timeout_and_recovers() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start();
    let catalog = standard();
    let store = connect(&server.url(), "faults:", 300, catalog.clone(), 2).await;
    let req = request(&catalog, "frozen", &[("user", "u1")], tokens(10));
    let held = store
        .reserve(&req)
        .await
        .expect("a reserve before the stop")
        .id;

    blocking(|| server.stop());
    let started = Instant::now();
    let reserve = store.reserve(&req).await;
    let reserve_took = started.elapsed();
    let started = Instant::now();
    let settle = store.settle(held, &usage(tokens(3))).await;
    let settle_took = started.elapsed();
    let started = Instant::now();
    let status = store.status(req.scopes.tenant()).await;
    let status_took = started.elapsed();
    blocking(|| server.cont());

    assert!(
        matches!(reserve, Err(StoreError::Unavailable(_))),
        "a reserve on a stopped server: {reserve:?}"
    );
    assert!(
        reserve_took < CALL_BOUND,
        "the reserve took {reserve_took:?}"
    );
    assert!(
        matches!(settle, Err(StoreError::Unavailable(_))),
        "a settle on a stopped server: {settle:?}"
    );
    assert!(settle_took < CALL_BOUND, "the settle took {settle_took:?}");
    assert!(status.is_err(), "a status on a stopped server: {status:?}");
    assert!(status_took < CALL_BOUND, "the status took {status_took:?}");

    let (id, waited) = reserve_until_served(&store, &req).await;
    eprintln!(
        "stopped: reserve failed in {reserve_took:?}, settle in {settle_took:?}, status in {status_took:?}; served again {waited:?} after SIGCONT"
    );
    store
        .settle(id, &usage(tokens(2)))
        .await
        .expect("a settle after SIGCONT");
    // The settle that timed out may have run once the server resumed (its
    // outcome was unknown): settling again is the retry, and is idempotent.
    let again = store
        .settle(held, &usage(tokens(3)))
        .await
        .expect("the retried settle");
    assert_eq!(again.status, Status::Settled);
    assert_eq!(
        again.charged.as_ref().map(|c| c.get(Dimension::TOKENS)),
        Some(3)
    );
}

/// One acknowledged reservation of the AOF test.
#[derive(Debug)]
struct Ack {
    id: ReservationId,
    tenant: String,
    held: Amounts,
    /// The settle's charges, when it was settled.
    charged: Option<Amounts>,
}

/// Checks one tenant scope's status against its acknowledged reservations.
fn check_tenant_status(catalog: &Catalog, st: &ScopeStatus, acks: &[&Ack]) {
    let live: Vec<&&Ack> = acks.iter().filter(|a| a.charged.is_none()).collect();
    assert_eq!(
        st.held_reservations,
        live.len() as u64,
        "{}: held reservations",
        st.scope
    );
    for l in &st.limits {
        let dim = catalog
            .dimension(&l.dimension)
            .unwrap_or_else(|| panic!("a dimension {:?}", l.dimension));
        if l.window.kind() == WindowKind::Concurrent {
            assert_eq!(
                (l.used, l.held),
                (0, live.len() as u64),
                "{}: concurrent",
                st.scope
            );
            continue;
        }
        let used: u64 = acks
            .iter()
            .filter_map(|a| a.charged.as_ref())
            .map(|c| c.get(dim))
            .sum();
        let held: u64 = live.iter().map(|a| a.held.get(dim)).sum();
        assert_eq!(
            (l.used, l.held),
            (used as i64, held),
            "{}: {} {} (used, held)",
            st.scope,
            l.dimension,
            l.window.kind()
        );
    }
}

/// 3. appendfsync always: after kill -9 and a restart from the append-only
///    file, a new store finds every acknowledged reserve and settle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aof_always_loses_nothing_acknowledged() {
    let Some(()) = redis_available() else { return };
    const TENANTS: u64 = 50;
    const N: u64 = 300;
    let mut server = RedisServer::start_with(ServerOptions {
        appendonly: true,
        appendfsync: "always",
        ..ServerOptions::default()
    });
    let catalog = standard();
    let store = connect(&server.url(), "aof:", 1000, catalog.clone(), 3).await;

    let mut acks = Vec::new();
    for k in 0..N {
        let tenant = format!("aof-{}", k % TENANTS);
        let amounts = tokens(100 + 7 * k).with(Dimension::COST_MICROS, 1_000 + 13 * k);
        let req = request(&catalog, &tenant, &[], amounts);
        let g = store
            .reserve(&req)
            .await
            .unwrap_or_else(|e| panic!("reserve #{k} on {tenant}: {e:?}"));
        acks.push(Ack {
            id: g.id,
            tenant,
            held: g.held,
            charged: None,
        });
    }
    // Rounds 0, 2 and 4 of every tenant are settled, 1, 3 and 5 stay held.
    for (k, ack) in acks.iter_mut().enumerate() {
        if (k as u64 / TENANTS) % 2 == 1 {
            continue;
        }
        let k = k as u64;
        let actual = tokens(50 + 3 * k).with(Dimension::COST_MICROS, 500 + 11 * k);
        let res = store
            .settle(ack.id, &usage(actual))
            .await
            .unwrap_or_else(|e| panic!("settle #{k}: {e:?}"));
        assert_eq!(res.status, Status::Settled);
        ack.charged = Some(res.charged.expect("a settled reservation has its charges"));
    }
    drop(store);

    blocking(|| {
        server.kill9();
        server.restart();
    });
    let store = connect(&server.url(), "aof:", 1000, catalog.clone(), 33).await;

    for ack in &acks {
        let res = store
            .get(ack.id)
            .await
            .unwrap_or_else(|e| panic!("get {}: {e}", ack.id))
            .unwrap_or_else(|| panic!("acknowledged {} ({}) lost", ack.id, ack.tenant));
        assert_eq!(res.held, ack.held, "{}: held amounts", ack.id);
        match &ack.charged {
            None => assert_eq!(res.status, Status::Held, "{} was held", ack.id),
            Some(c) => {
                assert_eq!(res.status, Status::Settled, "{} was settled", ack.id);
                assert_eq!(res.charged.as_ref(), Some(c), "{}: charges", ack.id);
            }
        }
    }

    let mut by_tenant: BTreeMap<&str, Vec<&Ack>> = BTreeMap::new();
    for ack in &acks {
        by_tenant.entry(&ack.tenant).or_default().push(ack);
    }
    for (tenant, tenant_acks) in &by_tenant {
        let scope = ScopeKey::tenant(tenant).expect("a valid tenant");
        let st = store
            .status(&scope)
            .await
            .expect("status after the restart");
        check_tenant_status(&catalog, &st, tenant_acks);
    }

    let page = store
        .usage(None, 10_000, None)
        .await
        .expect("usage after the restart");
    let settled: HashMap<ReservationId, &Amounts> = acks
        .iter()
        .filter_map(|a| a.charged.as_ref().map(|c| (a.id, c)))
        .collect();
    let mut seen = BTreeSet::new();
    for r in &page.records {
        assert_eq!(
            r.event.kind,
            UsageKind::Settled,
            "an unexpected record {r:?}"
        );
        let res = r
            .event
            .reservation
            .as_ref()
            .expect("a settle's reservation");
        let charged = settled
            .get(&res.id)
            .unwrap_or_else(|| panic!("a settle record of an unacknowledged settle {r:?}"));
        assert_eq!(
            res.charged.as_ref(),
            Some(*charged),
            "{}: logged charges",
            res.id
        );
        assert!(seen.insert(res.id), "{} logged twice", res.id);
    }
    assert_eq!(
        seen.len(),
        settled.len(),
        "one record per acknowledged settle"
    );
    let stats = store.stats().await.expect("stats after the restart");
    assert_eq!(stats.held_reservations, N / 2);
}

/// Every key of the server, with its `DUMP` (type, value and encoding).
async fn dump_all(conn: &mut redis::aio::MultiplexedConnection) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg("*")
        .query_async(conn)
        .await
        .expect("KEYS");
    let mut out = BTreeMap::new();
    for key in keys {
        let dump: Option<Vec<u8>> = redis::cmd("DUMP")
            .arg(&key)
            .query_async(conn)
            .await
            .expect("DUMP");
        if let Some(d) = dump {
            out.insert(key, d);
        }
    }
    out
}

/// What differs between two dumps, `except` left out.
fn changes(
    before: &BTreeMap<Vec<u8>, Vec<u8>>,
    after: &BTreeMap<Vec<u8>, Vec<u8>>,
    except: &[u8],
) -> Vec<String> {
    let name = |k: &[u8]| String::from_utf8_lossy(k).into_owned();
    let mut out = Vec::new();
    for (k, v) in before {
        if k.as_slice() == except {
            continue;
        }
        match after.get(k) {
            None => out.push(format!("deleted: {}", name(k))),
            Some(w) if w != v => out.push(format!("changed: {}", name(k))),
            Some(_) => {}
        }
    }
    for k in after.keys() {
        if !before.contains_key(k) {
            out.push(format!("created: {}", name(k)));
        }
    }
    out
}

/// The key of a scope's blob, found among the server's keys.
fn scope_blob_key(keys: &BTreeMap<Vec<u8>, Vec<u8>>, scope: &ScopeKey) -> Vec<u8> {
    let suffix = format!(":s:{}", scope.as_str());
    let found: Vec<&Vec<u8>> = keys
        .keys()
        .filter(|k| k.ends_with(suffix.as_bytes()))
        .collect();
    assert_eq!(found.len(), 1, "one blob key for {scope}: {found:?}");
    found[0].clone()
}

/// A held reservation on tenant, user and agent, and one scope's blob
/// corrupted; answers the store, a request on the same scopes, the held id,
/// the corrupted key and a connection.
async fn corrupted_setup(
    server: &RedisServer,
    corrupt_index: usize,
) -> (
    RedisStore,
    ReserveRequest,
    ReservationId,
    Vec<u8>,
    redis::aio::MultiplexedConnection,
) {
    let catalog = standard();
    let store = connect(&server.url(), "faults:", 1000, catalog.clone(), 4).await;
    let req = request(
        &catalog,
        "t1",
        &[("user", "u1"), ("agent", "a1")],
        tokens(100),
    );
    assert_eq!(req.scopes.len(), 3);
    let id = store.reserve(&req).await.expect("the first reserve").id;
    let client = redis::Client::open(server.url()).expect("a client");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("a connection");
    let keys = dump_all(&mut conn).await;
    let scopes = req.scopes.as_slice();
    for s in scopes {
        scope_blob_key(&keys, s);
    }
    let victim = scope_blob_key(&keys, &scopes[corrupt_index]);
    let () = redis::cmd("SET")
        .arg(&victim)
        .arg("garbage")
        .query_async(&mut conn)
        .await
        .expect("SET garbage");
    (store, req, id, victim, conn)
}

/// Asserts nothing but the corrupted key changed, and it still holds the garbage.
async fn assert_untouched(
    conn: &mut redis::aio::MultiplexedConnection,
    before: &BTreeMap<Vec<u8>, Vec<u8>>,
    victim: &[u8],
    what: &str,
) {
    let after = dump_all(conn).await;
    let diff = changes(before, &after, victim);
    assert!(
        diff.is_empty(),
        "{what} failed on a corrupted scope but left a partial write:\n  {}",
        diff.join("\n  ")
    );
    let raw: Option<Vec<u8>> = redis::cmd("GET")
        .arg(victim)
        .query_async(conn)
        .await
        .expect("GET");
    assert_eq!(raw.as_deref(), Some(&b"garbage"[..]));
}

/// 4a. A reserve whose second scope's blob is unreadable fails closed and
///     writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_reserve_leaves_no_partial_write() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start();
    let (store, req, _held, victim, mut conn) = corrupted_setup(&server, 1).await;
    let before = dump_all(&mut conn).await;
    let r = store.reserve(&req).await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(_))),
        "a reserve on a corrupted scope: {r:?}"
    );
    assert_untouched(&mut conn, &before, &victim, "a reserve").await;
}

/// 4b. A settle of a held reservation whose third scope's blob is
///     unreadable fails closed and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_settle_leaves_no_partial_write() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start();
    let (store, _req, held, victim, mut conn) = corrupted_setup(&server, 2).await;
    let before = dump_all(&mut conn).await;
    let r = store.settle(held, &usage(tokens(80))).await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(_))),
        "a settle on a corrupted scope: {r:?}"
    );
    assert_untouched(&mut conn, &before, &victim, "a settle").await;
}

/// A refund whose third scope is unreadable: the script reads every scope
/// before releasing any, so nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_refund_leaves_no_partial_write() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start();
    let (store, _req, held, victim, mut conn) = corrupted_setup(&server, 2).await;
    let before = dump_all(&mut conn).await;
    let r = store.refund(held).await;
    assert!(
        matches!(r, Err(StoreError::Unavailable(_))),
        "a refund on a corrupted scope: {r:?}"
    );
    assert_untouched(&mut conn, &before, &victim, "a refund").await;
}

/// A tenant that may hold many reservations at once (the standard tenant
/// plan allows 8): tokens 1,000,000 / sliding hour, concurrent 1,000.
fn roomy_catalog() -> Catalog {
    let mut c = Catalog::new(Settings {
        default_ttl_ms: 5 * 60_000,
        ..Settings::default()
    })
    .expect("valid settings");
    let plan = Plan::new(
        "roomy",
        vec![
            Limit::new(
                Dimension::TOKENS,
                1_000_000,
                Window::Sliding {
                    period_ms: 3_600_000,
                    slices: 60,
                },
            )
            .expect("a valid limit"),
            Limit::new(Dimension::CONCURRENT, 1_000, Window::Concurrent).expect("a valid limit"),
        ],
        OverrunPolicy::ChargeActual,
    )
    .expect("a valid plan");
    c.set_plan(plan);
    c.set_kind("tenant", Some("roomy"), false)
        .expect("the plan exists");
    c
}

/// How one reservation's race ended.
struct RaceOutcome {
    id: ReservationId,
    settles: [Result<Reservation, StoreError<SettleError>>; 2],
    refund: Result<Reservation, StoreError<RefundError>>,
}

/// 5. Settles and a refund race on each of 32 reservations: exactly one of
///    them wins, and the tenant's figures and usage log agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_settle_and_refund_have_one_winner() {
    let Some(()) = redis_available() else { return };
    const RESERVATIONS: u64 = 32;
    const ROUNDS: usize = 3;
    let server = RedisServer::start();
    let catalog = roomy_catalog();
    let store = Arc::new(connect(&server.url(), "race:", 2000, catalog.clone(), 5).await);
    let (mut settle_wins, mut refund_wins) = (0, 0);

    for round in 0..ROUNDS {
        let tenant = format!("racer-{round}");
        let reserved: Vec<_> = (0..RESERVATIONS)
            .map(|i| {
                let store = store.clone();
                let req = request(&catalog, &tenant, &[], tokens(1_000 + i));
                tokio::spawn(async move { store.reserve(&req).await })
            })
            .collect();
        let mut ids = Vec::new();
        for r in reserved {
            let g = r.await.expect("a reserve task").expect("a reserve");
            ids.push(g.id);
        }

        let start = Arc::new(Barrier::new(ids.len() * 3));
        let mut racers = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let u = usage(tokens(500 + 7 * i as u64));
            let settle = |store: Arc<RedisStore>, start: Arc<Barrier>, u: Usage| {
                tokio::spawn(async move {
                    start.wait().await;
                    store.settle(id, &u).await
                })
            };
            let s1 = settle(store.clone(), start.clone(), u.clone());
            let refund = {
                let (store, start) = (store.clone(), start.clone());
                tokio::spawn(async move {
                    start.wait().await;
                    store.refund(id).await
                })
            };
            let s2 = settle(store.clone(), start.clone(), u);
            racers.push((id, s1, refund, s2));
        }
        let mut outcomes = Vec::new();
        for (id, s1, refund, s2) in racers {
            outcomes.push(RaceOutcome {
                id,
                settles: [
                    s1.await.expect("a settle task"),
                    s2.await.expect("a settle task"),
                ],
                refund: refund.await.expect("a refund task"),
            });
        }

        // id -> what won (Some(tokens charged) for a settle, None for a refund)
        let mut winners: HashMap<ReservationId, Option<u64>> = HashMap::new();
        for o in &outcomes {
            let id = o.id;
            let winner = match &o.refund {
                Ok(r) => {
                    assert_eq!(r.status, Status::Refunded, "{id}: the refund's answer");
                    for s in &o.settles {
                        assert!(
                            matches!(
                                s,
                                Err(StoreError::Rejected(SettleError::Conflict {
                                    status: Status::Refunded
                                }))
                            ),
                            "{id}: refunded, yet a settle answered {s:?}"
                        );
                    }
                    refund_wins += 1;
                    None
                }
                Err(StoreError::Rejected(RefundError::Conflict {
                    status: Status::Settled,
                })) => {
                    let [a, b] = &o.settles;
                    let (Ok(a), Ok(b)) = (a, b) else {
                        panic!(
                            "{id}: the refund saw it settled, yet the settles answered {a:?} / {b:?}"
                        );
                    };
                    assert_eq!(a.status, Status::Settled, "{id}");
                    assert_eq!(
                        a.charged, b.charged,
                        "{id}: both settles answer the same charges"
                    );
                    settle_wins += 1;
                    Some(a.charged.as_ref().expect("charges").get(Dimension::TOKENS))
                }
                other => panic!("{id}: a refund racing settles answered {other:?}"),
            };
            winners.insert(id, winner);
        }

        let scope = ScopeKey::tenant(&tenant).expect("a valid tenant");
        let st = store.status(&scope).await.expect("status");
        let charged: u64 = winners.values().flatten().sum();
        assert_eq!(st.held_reservations, 0, "round {round}: nothing held");
        for l in &st.limits {
            let used = if l.window.kind() == WindowKind::Concurrent {
                0
            } else {
                charged as i64
            };
            assert_eq!(
                (l.used, l.held),
                (used, 0),
                "round {round}: {} {}",
                l.dimension,
                l.window.kind()
            );
        }

        let page = store
            .usage(None, 10_000, Some(&tenant))
            .await
            .expect("usage");
        let mut ended: HashMap<ReservationId, Vec<UsageKind>> = HashMap::new();
        for r in &page.records {
            let res = r.event.reservation.as_ref().expect("a reservation's end");
            ended.entry(res.id).or_default().push(r.event.kind);
            if r.event.kind == UsageKind::Settled {
                assert_eq!(
                    res.charged.as_ref().map(|c| c.get(Dimension::TOKENS)),
                    winners.get(&res.id).copied().flatten(),
                    "round {round}: {}'s logged charges",
                    res.id
                );
            }
        }
        assert_eq!(
            ended.len(),
            ids.len(),
            "round {round}: every reservation ended"
        );
        for (id, winner) in &winners {
            let want = if winner.is_some() {
                UsageKind::Settled
            } else {
                UsageKind::Refunded
            };
            assert_eq!(
                ended.get(id).map(Vec::as_slice),
                Some(&[want][..]),
                "round {round}: {id} has exactly one ended record"
            );
        }
    }
    eprintln!("settles won {settle_wins}, refunds won {refund_wins}");
    // The reserve path is unaffected by the races: one more still fits.
    let req = request(&catalog, "racer-0", &[], tokens(1));
    let r = store.reserve(&req).await;
    assert!(
        !matches!(r, Err(StoreError::Rejected(ReserveError::Denied(_)))),
        "{r:?}"
    );
}

/// A settle racing a stream of extends of the same reservation: each
/// extend changes the record the settle read, so the script sends it back
/// to start over. It must still land (not answer 503 "kept changing", which
/// an audit saw for 17 of 31 settles under 24 extenders), and exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_lands_under_a_stream_of_extends() {
    let Some(()) = redis_available() else { return };
    const EXTENDERS: usize = 24;
    const ROUNDS: usize = 10;
    let server = RedisServer::start();
    let catalog = roomy_catalog();
    let store = Arc::new(connect(&server.url(), "starve:", 2000, catalog.clone(), 9).await);
    for round in 0..ROUNDS {
        let tenant = format!("starved-{round}");
        let g = store
            .reserve(&request(&catalog, &tenant, &[], tokens(10)))
            .await
            .expect("a reserve");
        let id = g.id;
        let stop = Arc::new(AtomicBool::new(false));
        let extenders: Vec<_> = (0..EXTENDERS)
            .map(|_| {
                let (store, stop) = (store.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut extended = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        match store.extend(id, Some(&tokens(1)), None).await {
                            Ok(_) => extended += 1,
                            // Once the settle lands, extends are refused.
                            Err(StoreError::Rejected(_)) => break,
                            Err(StoreError::Unavailable(_)) => {}
                        }
                    }
                    extended
                })
            })
            .collect();
        // Let the extends get going before the settle starts.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let settled = tokio::time::timeout(CALL_BOUND, store.settle(id, &usage(tokens(5))))
            .await
            .expect("the settle answers in time");
        stop.store(true, Ordering::Relaxed);
        let mut extended = 0;
        for e in extenders {
            extended += e.await.expect("an extender");
        }
        let settled = settled.unwrap_or_else(|e| {
            panic!("round {round}: the settle failed after {extended} extends: {e:?}")
        });
        assert_eq!(settled.status, Status::Settled);
        let st = store
            .status(&ScopeKey::tenant(&tenant).expect("a tenant"))
            .await
            .expect("status");
        assert_eq!(st.held_reservations, 0, "round {round}");
    }
}

/// A usage stream whose last id is ahead of Redis's clock (a clock stepped
/// back, a failover to a host behind) counts an entry id's sequence up
/// within that millisecond; past 8,191 (13 bits of a cursor) the entry is
/// moved to the next millisecond, so the log stays readable (found by an
/// audit: an entry at sequence 8192 made every usage read answer 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_usage_stream_ahead_of_the_clock_stays_readable() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start();
    let catalog = roomy_catalog();
    let store = connect(&server.url(), "ahead:", 2000, catalog.clone(), 11).await;
    let tenant = "ahead";
    // One record makes the stream; then its last id is set 1.5 s ahead of
    // the server's clock, three ids short of the sequence's bound.
    let id = store
        .reserve(&request(&catalog, tenant, &[], tokens(10)))
        .await
        .expect("a reserve")
        .id;
    store.refund(id).await.expect("a refund");
    let client = redis::Client::open(server.url()).expect("a client");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("a connection");
    let (secs, micros): (u64, u64) = redis::cmd("TIME")
        .query_async(&mut conn)
        .await
        .expect("TIME");
    let ahead_ms = secs * 1000 + micros / 1000 + 1500;
    let () = redis::cmd("XSETID")
        .arg("ahead:{u}:u")
        .arg(format!("{ahead_ms}-8189"))
        .query_async(&mut conn)
        .await
        .expect("XSETID");
    for i in 0..6 {
        let g = store
            .reserve(&request(&catalog, tenant, &[], tokens(10 + i)))
            .await
            .expect("a reserve");
        store
            .settle(g.id, &usage(tokens(5 + i)))
            .await
            .expect("a settle");
    }
    let ids: Vec<redis::Value> = redis::cmd("XRANGE")
        .arg("ahead:{u}:u")
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .expect("XRANGE");
    assert_eq!(ids.len(), 7, "one refund and six settles");
    // Once the clock has passed the skew, every record reads, once, in order.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let page = store
        .usage(None, 100, Some(tenant))
        .await
        .unwrap_or_else(|e| panic!("the log is unreadable: {e}"));
    let kinds: Vec<UsageKind> = page.records.iter().map(|r| r.event.kind).collect();
    assert_eq!(
        kinds,
        [vec![UsageKind::Refunded], vec![UsageKind::Settled; 6]].concat()
    );
    let cursors: Vec<u64> = page.records.iter().map(|r| r.cursor).collect();
    assert!(cursors.windows(2).all(|w| w[0] < w[1]), "{cursors:?}");
}
