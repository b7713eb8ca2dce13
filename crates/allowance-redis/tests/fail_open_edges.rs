//! Adversarial edges of `fail_open_local` ([`FailOpenLocal`]) on a real
//! redis-server from `allowance-testkit`: what a settle answered 200 while
//! the reservation was local must reach Redis exactly once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use allowance_conformance::catalogs::START_MS;
use allowance_core::{
    Amounts, Catalog, Dimension, Limit, ManualClock, OverrunPolicy, Plan, ReserveRequest, ScopeKey,
    SeededIds, Settings, Status, Store, Usage, Window,
};
use allowance_redis::{FailOpenLocal, RedisOptions, RedisStore};
use allowance_testkit::{RedisOptions as ServerOptions, RedisServer, redis_available};

/// How long a restarted Redis has to answer again.
const RECOVERY: Duration = Duration::from_secs(10);

/// Tenants: 1,000 tokens a sliding hour.
fn catalog() -> Catalog {
    let hour = Window::Sliding {
        period_ms: 3_600_000,
        slices: 60,
    };
    let mut c = Catalog::new(Settings {
        default_ttl_ms: 300_000,
        ..Settings::default()
    })
    .unwrap();
    c.set_plan(
        Plan::new(
            "t",
            vec![Limit::new(Dimension::TOKENS, 1000, hour).unwrap()],
            OverrunPolicy::ChargeActual,
        )
        .unwrap(),
    );
    c.set_kind("tenant", Some("t"), false).unwrap();
    c
}

fn tokens(n: u64) -> Amounts {
    Amounts::new().with(Dimension::TOKENS, n)
}

fn usage(n: u64) -> Usage {
    Usage {
        amounts: tokens(n),
        ..Usage::default()
    }
}

fn request(c: &Catalog, tenant: &str, n: u64) -> ReserveRequest {
    ReserveRequest::new(c.scope_set(tenant, &[]).unwrap(), tokens(n))
}

fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

fn aof() -> ServerOptions {
    ServerOptions {
        appendonly: true,
        appendfsync: "always",
        ..Default::default()
    }
}

/// A fail-open store (fraction 0.1, 500 ms timeout) on `server`.
async fn store(server: &RedisServer) -> (FailOpenLocal, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(allowance_core::Timestamp::from_millis(
        START_MS,
    )));
    let ids = Arc::new(SeededIds::new(0xed9e));
    let mut options = RedisOptions::new(server.url());
    options.prefix = "foe:".into();
    options.timeout_ms = 500;
    let redis = RedisStore::connect(options, catalog(), Some(clock.clone()), ids.clone())
        .await
        .unwrap_or_else(|e| panic!("connecting: {e}"));
    (
        FailOpenLocal::new(Arc::new(redis), 0.1, clock.clone(), ids),
        clock,
    )
}

/// Waits until Redis answers the sweeper again.
async fn until_redis_answers(store: &FailOpenLocal) {
    let started = Instant::now();
    while store.redis().expire_due().await.is_err() {
        assert!(started.elapsed() < RECOVERY, "Redis did not come back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs the sweeper until nothing admitted locally waits for Redis.
async fn reconcile_all(store: &FailOpenLocal) {
    let started = Instant::now();
    while store.pending_reconciliation() > 0 {
        let _ = store.expire_due().await;
        assert!(
            started.elapsed() < RECOVERY,
            "{} reservations still not reconciled",
            store.pending_reconciliation()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An import whose reply is lost (Redis stalls past the timeout, then runs
/// the queued script) is marked "not importing" again, so a late settle of
/// the locally expired reservation is answered locally (200, settled,
/// charged 50); the next import of it is then a duplicate by id and
/// changes nothing: Redis keeps the EXPIRED record and never sees the 50
/// tokens that settle charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_settle_after_a_lost_import_reply_reaches_redis() {
    let Some(()) = redis_available() else { return };
    let mut server = RedisServer::start_with(aof());
    let (fo, clock) = store(&server).await;
    let c = catalog();
    let acme = ScopeKey::tenant("acme").unwrap();

    // Outage: admitted locally, then expires locally.
    blocking(|| server.kill9());
    let mut req = request(&c, "acme", 60);
    req.ttl_ms = Some(1_000);
    let g = fo.reserve(&req).await.unwrap();
    assert_eq!(fo.admitted_locally(), 1);
    clock.advance_ms(1_001);
    assert_eq!(
        fo.get(g.id).await.unwrap().map(|r| r.status),
        Some(Status::Expired)
    );

    // Redis back; the first import's reply is lost: Redis is stalled past
    // the client's timeout, then runs the script it had queued.
    blocking(|| server.restart());
    until_redis_answers(&fo).await;
    // The ledger script is loaded again (a restarted Redis forgot it).
    let warm = fo.reserve(&request(&c, "other", 1)).await.unwrap();
    fo.settle(warm.id, &usage(1)).await.unwrap();
    assert_eq!(fo.admitted_locally(), 1);
    blocking(|| server.stop());
    assert!(fo.reconcile().await.is_err(), "the import should time out");
    blocking(|| server.cont());
    let started = Instant::now();
    loop {
        if let Ok(Some(r)) = fo.redis().get(g.id).await {
            assert_eq!(r.status, Status::Expired);
            break;
        }
        assert!(started.elapsed() < RECOVERY, "the queued import never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(fo.pending_reconciliation(), 1, "not confirmed: still local");

    // A late settle: answered locally, 200, 50 tokens charged.
    let settled = fo.settle(g.id, &usage(50)).await.unwrap();
    assert_eq!(
        (
            settled.status,
            settled.charged.as_ref().map(|c| c.get(Dimension::TOKENS))
        ),
        (Status::Settled, Some(50))
    );

    reconcile_all(&fo).await;
    let st = fo.redis().status(&acme).await.unwrap();
    let used = st.limits[0].used;
    let rec = fo.redis().get(g.id).await.unwrap().expect("imported");
    assert_eq!(
        (
            used,
            rec.status,
            rec.charged.map(|c| c.get(Dimension::TOKENS))
        ),
        (50, Status::Settled, Some(50)),
        "the settle answered 200 (charged 50) must reach Redis: {st:?}"
    );
}

/// Control for the test above: without a lost reply, the late settle of a
/// locally expired reservation reaches Redis (charged once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_late_settle_then_extend_settle_are_imported_once() {
    let Some(()) = redis_available() else { return };
    let mut server = RedisServer::start_with(aof());
    let (fo, clock) = store(&server).await;
    let c = catalog();
    let acme = ScopeKey::tenant("acme").unwrap();

    blocking(|| server.kill9());
    let mut req = request(&c, "acme", 20);
    req.ttl_ms = Some(1_000);
    let late = fo.reserve(&req).await.unwrap();
    let grown = fo.reserve(&request(&c, "acme", 10)).await.unwrap();
    // Extend adds: 10 + 60 = 70 held.
    let r = fo.extend(grown.id, Some(&tokens(60)), None).await.unwrap();
    assert_eq!(r.held.get(Dimension::TOKENS), 70);
    clock.advance_ms(1_001);
    let l = fo.settle(late.id, &usage(15)).await.unwrap();
    assert_eq!((l.status, l.late), (Status::Settled, true));

    blocking(|| server.restart());
    until_redis_answers(&fo).await;
    // Settled after Redis came back, before reconciliation: still local.
    let s = fo.settle(grown.id, &usage(65)).await.unwrap();
    assert_eq!(s.charged.map(|c| c.get(Dimension::TOKENS)), Some(65));
    reconcile_all(&fo).await;
    // Concurrent sweeps and a replayed settle change nothing.
    let (a, b) = tokio::join!(fo.expire_due(), fo.expire_due());
    a.unwrap();
    b.unwrap();
    let again = fo.settle(grown.id, &usage(1)).await.unwrap();
    assert_eq!(again.charged.map(|c| c.get(Dimension::TOKENS)), Some(65));
    let st = fo.redis().status(&acme).await.unwrap();
    assert_eq!(st.limits[0].used, 80, "15 + 65: {st:?}");
}
