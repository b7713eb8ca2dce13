//! `on_error = "fail_open_local"` at the store level: [`FailOpenLocal`]
//! around a [`RedisStore`] on a real redis-server (from `allowance-testkit`,
//! append-only file fsynced on every write so what Redis acknowledged
//! before the outage survives its restart), the stores on a manual clock.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use allowance_conformance::catalogs::START_MS;
use allowance_core::{
    Amounts, CalendarUnit, Catalog, CatalogChange, Dimension, Limit, ManualClock, Override,
    OverrunPolicy, Plan, ReservationId, ReserveError, ReserveRequest, ScopeKey, ScopeStatus,
    SeededIds, Settings, SettleError, Status, Store, StoreError, Usage, UsageKind, Window, Zone,
};
use allowance_redis::{FailOpenLocal, RedisOptions, RedisStore};
use allowance_testkit::{RedisOptions as ServerOptions, RedisServer, redis_available};

/// How long a restarted Redis has to take the reconciliation.
const RECOVERY: Duration = Duration::from_secs(10);

/// Tenants: tokens 1,000 a sliding hour and 200 concurrent; the tenant
/// `tight` has its own limits (an override): 20 concurrent; `daily`: 1,000
/// tokens a UTC day.
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
            vec![
                Limit::new(Dimension::TOKENS, 1000, hour).unwrap(),
                Limit::new(Dimension::CONCURRENT, 200, Window::Concurrent).unwrap(),
            ],
            OverrunPolicy::ChargeActual,
        )
        .unwrap(),
    );
    c.set_kind("tenant", Some("t"), false).unwrap();
    let tight = Plan::new(
        "tight",
        vec![Limit::new(Dimension::CONCURRENT, 20, Window::Concurrent).unwrap()],
        OverrunPolicy::ChargeActual,
    )
    .unwrap();
    c.set_override(ScopeKey::tenant("tight").unwrap(), Override::Limits(tight))
        .unwrap();
    let daily = Plan::new(
        "daily",
        vec![
            Limit::new(
                Dimension::TOKENS,
                1000,
                Window::Calendar {
                    unit: CalendarUnit::Day,
                    zone: Zone::utc(),
                },
            )
            .unwrap(),
        ],
        OverrunPolicy::ChargeActual,
    )
    .unwrap();
    c.set_override(ScopeKey::tenant("daily").unwrap(), Override::Limits(daily))
        .unwrap();
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

/// Runs a blocking testkit call (kill, restart) off the async workers' backs.
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

fn options(server: &RedisServer) -> RedisOptions {
    let mut options = RedisOptions::new(server.url());
    options.prefix = "fo:".into();
    options.timeout_ms = 500;
    options
}

fn manual_clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(allowance_core::Timestamp::from_millis(
        START_MS,
    )))
}

/// A fail-open store (fraction 0.1) on `server`, and its clock.
async fn store(server: &RedisServer) -> (FailOpenLocal, Arc<ManualClock>) {
    let clock = manual_clock();
    let ids = Arc::new(SeededIds::new(0xfa11));
    let redis = RedisStore::connect(options(server), catalog(), Some(clock.clone()), ids.clone())
        .await
        .unwrap_or_else(|e| panic!("connecting: {e}"));
    (
        FailOpenLocal::new(Arc::new(redis), 0.1, clock.clone(), ids),
        clock,
    )
}

/// Runs the sweeper until nothing admitted locally waits for Redis.
async fn reconcile_all(store: &FailOpenLocal) {
    let started = Instant::now();
    while store.pending_reconciliation() > 0 {
        let _ = store.expire_due().await;
        assert!(
            started.elapsed() < RECOVERY,
            "{} reservations still not reconciled after {RECOVERY:?}",
            store.pending_reconciliation()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn tokens_of(s: &ScopeStatus) -> (i64, i64, u64) {
    let l = &s.limits[0];
    (l.remaining, l.used, l.held)
}

/// Usage-log records of `tenant`, by reservation id.
async fn usage_by_id(store: &RedisStore, tenant: &str) -> BTreeMap<ReservationId, Vec<UsageKind>> {
    let mut out: BTreeMap<ReservationId, Vec<UsageKind>> = BTreeMap::new();
    let mut since = None;
    loop {
        let page = store.usage(since, 1000, Some(tenant)).await.unwrap();
        if page.records.is_empty() {
            return out;
        }
        for r in page.records {
            let res = r.event.reservation.expect("a reservation's end");
            out.entry(res.id).or_default().push(r.event.kind);
        }
        since = Some(page.next_cursor);
    }
}

fn unavailable<T: std::fmt::Debug, E: std::fmt::Debug>(r: Result<T, StoreError<E>>) -> bool {
    matches!(r, Err(StoreError::Unavailable(_)))
}

/// The issue's test: with Redis gone, each limit admits at most its
/// capacity × fraction here (typed denials past it), fail_closed would have
/// answered 503, and what ended locally reaches Redis once it is back —
/// once, whatever the sweeper repeats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_local_admits_at_most_the_emergency_limits() {
    let Some(()) = redis_available() else { return };
    let mut server = RedisServer::start_with(aof());
    let (fo, clock) = store(&server).await;
    let c = catalog();
    let acme = ScopeKey::tenant("acme").unwrap();

    // Before the outage: 10 tokens settled in Redis.
    let before = fo.reserve(&request(&c, "acme", 10)).await.unwrap();
    fo.settle(before.id, &usage(10)).await.unwrap();
    assert_eq!(fo.admitted_locally(), 0);

    blocking(|| server.kill9());

    // fail_closed: the plain Redis store cannot answer.
    assert!(unavailable(
        fo.redis().reserve(&request(&c, "acme", 10)).await
    ));

    // fail_open_local: 1000 × 0.1 = 100 tokens, ten reserves of 10.
    let mut ids = Vec::new();
    for i in 0..10 {
        let mut req = request(&c, "acme", 10);
        if i == 9 {
            req.ttl_ms = Some(1_000);
        }
        let g = fo
            .reserve(&req)
            .await
            .unwrap_or_else(|e| panic!("local reserve #{i}: {e:?}"));
        assert!(!g.replayed && !g.dry_run);
        ids.push(g.id);
    }
    assert_eq!(fo.admitted_locally(), 10);
    match fo.reserve(&request(&c, "acme", 10)).await {
        Err(StoreError::Rejected(ReserveError::Denied(d))) => {
            assert_eq!(
                (d.scope.as_str(), d.dimension.as_str(), d.capacity),
                ("tenant:acme", "tokens", 100),
                "{d}"
            );
            assert_eq!((d.remaining, d.requested), (0, 10), "{d}");
        }
        other => panic!("the 11th reserve of 10 should be denied, got {other:?}"),
    }
    assert_eq!(fo.admitted_locally(), 10, "a denial is not an admission");

    // A `Limits` override is scaled too: 20 concurrent → 2.
    let t1 = fo.reserve(&request(&c, "tight", 1)).await.unwrap();
    let t2 = fo.reserve(&request(&c, "tight", 1)).await.unwrap();
    match fo.reserve(&request(&c, "tight", 1)).await {
        Err(StoreError::Rejected(ReserveError::Denied(d))) => {
            assert_eq!((d.dimension.as_str(), d.capacity), ("concurrent", 2), "{d}");
        }
        other => panic!("a third concurrent hold should be denied, got {other:?}"),
    }
    fo.refund(t1.id).await.unwrap();
    fo.refund(t2.id).await.unwrap();

    // Idempotent replays answer the same local reservation; dry runs and
    // replays are not admissions.
    let mut keyed = request(&c, "beta", 30);
    keyed.idempotency_key = Some("call-1".into());
    let b = fo.reserve(&keyed).await.unwrap();
    let replay = fo.reserve(&keyed).await.unwrap();
    assert_eq!((replay.id, replay.replayed), (b.id, true));
    let mut dry = request(&c, "beta", 70);
    dry.dry_run = true;
    assert!(fo.reserve(&dry).await.unwrap().dry_run);
    dry.amounts = tokens(71);
    assert!(matches!(
        fo.reserve(&dry).await,
        Err(StoreError::Rejected(ReserveError::Denied(_)))
    ));
    assert_eq!(fo.admitted_locally(), 13);

    // Local ids end locally: 8 settled, 1 refunded, 1 expired.
    let mut settled = Vec::new();
    for id in &ids[..8] {
        let r = fo.settle(*id, &usage(10)).await.unwrap();
        assert_eq!(r.status, Status::Settled);
        settled.push(r);
    }
    fo.refund(ids[8]).await.unwrap();
    clock.advance_ms(1_001);
    assert_eq!(
        fo.get(ids[9]).await.unwrap().map(|r| r.status),
        Some(Status::Expired)
    );
    fo.settle(b.id, &usage(25)).await.unwrap();
    // Replays of local settles answer locally, Redis or not.
    let again = fo.settle(ids[0], &usage(10)).await.unwrap();
    assert_eq!(again.charged, settled[0].charged);

    // What is Redis's stays Redis's: 503, never a guess.
    assert!(unavailable(fo.settle(before.id, &usage(10)).await));
    assert!(fo.get(before.id).await.is_err());
    assert!(fo.status(&acme).await.is_err());
    assert!(fo.expire_due().await.is_err());
    assert_eq!(fo.pending_reconciliation(), 13);

    // Redis comes back (from its append-only file): the sweeper reconciles.
    blocking(|| server.restart());
    reconcile_all(&fo).await;
    assert_eq!(fo.imported(), 13);

    let st = fo.redis().status(&acme).await.unwrap();
    assert_eq!(
        tokens_of(&st),
        (1000 - 90, 90, 0),
        "10 before the outage + 8 × 10 settled locally: {st:?}"
    );
    assert_eq!(st.held_reservations, 0);
    let beta = fo
        .redis()
        .status(&ScopeKey::tenant("beta").unwrap())
        .await
        .unwrap();
    assert_eq!(tokens_of(&beta).1, 25);

    let log = usage_by_id(fo.redis(), "acme").await;
    let expect_kind = |id: &ReservationId, kind: UsageKind| {
        assert_eq!(log.get(id), Some(&vec![kind]), "usage of {id}: {log:?}");
    };
    expect_kind(&before.id, UsageKind::Settled);
    for id in &ids[..8] {
        expect_kind(id, UsageKind::Settled);
    }
    expect_kind(&ids[8], UsageKind::Refunded);
    expect_kind(&ids[9], UsageKind::Expired);
    assert_eq!(log.len(), 11, "{log:?}");
    let tight_log = usage_by_id(fo.redis(), "tight").await;
    assert_eq!(tight_log.len(), 2, "{tight_log:?}");

    // Redis answers for the imported ids now.
    let got = fo.redis().get(ids[0]).await.unwrap().expect("imported");
    assert_eq!(
        (got.status, got.charged.as_ref()),
        (Status::Settled, settled[0].charged.as_ref())
    );
    assert_eq!(fo.get(ids[0]).await.unwrap(), Some(got.clone()));
    let replayed = fo.settle(ids[0], &usage(10)).await.unwrap();
    assert_eq!(replayed.charged, settled[0].charged);
    assert!(matches!(
        fo.refund(ids[0]).await,
        Err(StoreError::Rejected(
            allowance_core::RefundError::Conflict { .. }
        ))
    ));

    // Reconciling (and importing) again changes nothing.
    assert_eq!(fo.reconcile().await.unwrap(), 0);
    fo.expire_due().await.unwrap();
    fo.redis().import_ended(&settled[0]).await.unwrap();
    assert_eq!(fo.redis().status(&acme).await.unwrap(), st);
    assert_eq!(usage_by_id(fo.redis(), "acme").await, log);

    // A late settle of the reservation that expired locally is Redis's now.
    let late = fo.settle(ids[9], &usage(5)).await.unwrap();
    assert_eq!((late.status, late.late), (Status::Settled, true));
    let st = fo.redis().status(&acme).await.unwrap();
    assert_eq!(tokens_of(&st).1, 95);

    // And reserves are Redis's again, once the outage is handed over: its
    // full capacity.
    until_handed_over(&fo).await;
    let big = fo.reserve(&request(&c, "acme", 800)).await.unwrap();
    assert_eq!(fo.redis().get(big.id).await.unwrap().unwrap().id, big.id);
    assert_eq!(fo.admitted_locally(), 13);
}

/// Redis back but the reservation still HELD locally: it stays local (a
/// keyed retry replays it rather than admitting again in Redis) until it
/// ends, and is reconciled then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_local_reservation_stays_local_until_it_ends() {
    let Some(()) = redis_available() else { return };
    let mut server = RedisServer::start();
    let (fo, clock) = store(&server).await;
    let c = catalog();
    blocking(|| server.kill9());

    let mut req = request(&c, "acme", 40);
    req.idempotency_key = Some("k".into());
    let g = fo.reserve(&req).await.unwrap();
    // Grows within the local 100.
    let r = fo.extend(g.id, Some(&tokens(60)), None).await.unwrap();
    assert_eq!(r.held.get(Dimension::TOKENS), 100);

    blocking(|| server.restart());
    let started = Instant::now();
    while fo.expire_due().await.is_err() {
        assert!(started.elapsed() < RECOVERY, "Redis did not come back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(fo.pending_reconciliation(), 1, "still held: not imported");
    let replay = fo.reserve(&req).await.unwrap();
    assert_eq!((replay.id, replay.replayed), (g.id, true));
    // Redis counts its hold (a shadow), though the reservation is not
    // Redis's yet: another instance asking for it is told to retry (a 503),
    // not that it does not exist (a 404 a client takes as final, losing
    // its settle).
    assert!(fo.redis().get(g.id).await.is_err());
    let acme = ScopeKey::tenant("acme").unwrap();
    assert_eq!(
        tokens_of(&fo.redis().status(&acme).await.unwrap()),
        (900, 0, 100)
    );
    assert!(unavailable(fo.redis().settle(g.id, &usage(1)).await));
    assert!(unavailable(fo.redis().refund(g.id).await));
    assert!(unavailable(fo.redis().extend(g.id, None, Some(1)).await));
    // Another instance can admit only what is left beside it.
    let other = fo.redis().reserve(&request(&c, "acme", 901)).await;
    assert!(
        matches!(other, Err(StoreError::Rejected(ReserveError::Denied(_)))),
        "{other:?}"
    );
    let other = fo.redis().reserve(&request(&c, "acme", 900)).await.unwrap();
    fo.redis().refund(other.id).await.unwrap();
    // A longer ttl given locally moves the shadow's expiry with it.
    let extended = fo
        .extend(g.id, None, Some(600_000))
        .await
        .unwrap()
        .expires_at;
    fo.expire_due().await.unwrap();
    clock.set(allowance_core::Timestamp::from_millis(
        g.expires_at.as_millis() + 1,
    ));
    fo.redis().expire_due().await.unwrap();
    assert_eq!(
        tokens_of(&fo.redis().status(&acme).await.unwrap()),
        (900, 0, 100)
    );
    assert!(extended.as_millis() > g.expires_at.as_millis() + 1);

    let settled = fo.settle(g.id, &usage(70)).await.unwrap();
    assert_eq!(settled.status, Status::Settled);
    reconcile_all(&fo).await;
    // The import replaced the shadow: its hold is gone, its usage counts.
    let st = fo.redis().status(&acme).await.unwrap();
    assert_eq!(tokens_of(&st), (930, 70, 0));
    assert_eq!(
        usage_by_id(fo.redis(), "acme").await.get(&g.id),
        Some(&vec![UsageKind::Settled])
    );
    assert_eq!(
        fo.redis().get(g.id).await.unwrap().map(|r| r.status),
        Some(Status::Settled)
    );
    // A settle with other figures is the settled record's, from Redis.
    assert_eq!(
        fo.settle(g.id, &usage(1)).await.unwrap().charged,
        settled.charged
    );
    assert!(matches!(
        fo.settle(ReservationId::mint(7, "acme"), &usage(1)).await,
        Err(StoreError::Rejected(SettleError::NotFound))
    ));
}

/// The shadow hold of a reservation whose instance died before it ended
/// (its local ledger is gone) holds room until the reservation's expiry,
/// then leaves no trace: no usage, no usage-log record, no record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_hold_of_an_instance_that_died_expires_without_a_trace() {
    let Some(()) = redis_available() else { return };
    let mut server = RedisServer::start();
    let (fo, clock) = store(&server).await;
    let c = catalog();
    blocking(|| server.kill9());
    let g = fo.reserve(&request(&c, "acme", 40)).await.unwrap();
    blocking(|| server.restart());
    let started = Instant::now();
    while fo.expire_due().await.is_err() {
        assert!(started.elapsed() < RECOVERY, "Redis did not come back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let redis = fo.redis().clone();
    drop(fo);
    let acme = ScopeKey::tenant("acme").unwrap();
    assert_eq!(tokens_of(&redis.status(&acme).await.unwrap()), (960, 0, 40));
    assert_eq!(redis.stats().await.unwrap().held_reservations, 1);

    clock.set(g.expires_at);
    redis.expire_due().await.unwrap();
    assert_eq!(tokens_of(&redis.status(&acme).await.unwrap()), (1000, 0, 0));
    assert_eq!(redis.get(g.id).await.unwrap(), None);
    assert!(usage_by_id(&redis, "acme").await.is_empty());
    let stats = redis.stats().await.unwrap();
    assert_eq!((stats.held_reservations, stats.expired_total), (0, 0));
}

// Edges found by review: what a settle answered 200 while the reservation
// was local reaches Redis exactly once.

/// Runs the sweeper until the outage is over: Redis answers again, held
/// local reservations are shadowed, and the hand-over has passed.
async fn until_handed_over(store: &FailOpenLocal) {
    let started = Instant::now();
    while store.answering_locally() {
        let _ = store.expire_due().await;
        assert!(
            started.elapsed() < RECOVERY,
            "still answering locally after {RECOVERY:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until Redis answers the sweeper again.
async fn until_redis_answers(store: &FailOpenLocal) {
    let started = Instant::now();
    while store.redis().expire_due().await.is_err() {
        assert!(started.elapsed() < RECOVERY, "Redis did not come back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An import whose reply is lost (Redis stalls past the timeout, then runs
/// the queued script) leaves the reservation in Redis as expired; a late
/// settle answered locally afterwards (200, settled, charged 50) must still
/// reach Redis: the next import upgrades the expired record, once.
/// (Found by review: it used to be dropped as a duplicate.)
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
    let warm = fo.redis().reserve(&request(&c, "other", 1)).await.unwrap();
    fo.redis().settle(warm.id, &usage(1)).await.unwrap();
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

/// During an outage a reserve does not wait out the store timeout again and
/// again: once Redis has failed to answer, reserves give it only a short
/// grace before answering locally, until it answers again — and then they go
/// to Redis at once. The outage is a hung Redis (`SIGSTOP`: connections
/// accepted, nothing answered), as a network partition looks; a killed one
/// refuses connections at once. (The bound is generous: it tells a breaker
/// from none, not speeds.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_redis_does_not_cost_every_reserve_the_timeout() {
    let Some(()) = redis_available() else { return };
    let server = RedisServer::start_with(aof());
    let (fo, _clock) = store(&server).await;
    let c = catalog();
    fo.reserve(&request(&c, "acme", 1)).await.unwrap();

    blocking(|| server.stop());
    let mut slow = Vec::new();
    for i in 0..15 {
        let started = Instant::now();
        fo.reserve(&request(&c, "acme", 1))
            .await
            .unwrap_or_else(|e| panic!("local reserve #{i}: {e:?}"));
        // Without the breaker every one waits out the whole 500 ms timeout;
        // with it, the grace (a loaded machine can add to that, but it
        // cannot make a wait shorter than the timeout).
        if started.elapsed() >= Duration::from_millis(490) {
            slow.push((i, started.elapsed()));
        }
    }
    assert_eq!(fo.admitted_locally(), 15);
    // The first finds the outage (it waits out the timeout); the rest give
    // Redis only the grace.
    assert!(
        slow.iter().all(|&(i, _)| i == 0),
        "reserves after the first waited out the 500 ms timeout: {slow:?}"
    );

    blocking(|| server.cont());
    until_handed_over(&fo).await;
    fo.reserve(&request(&c, "acme", 1)).await.unwrap();
    assert_eq!(
        fo.admitted_locally(),
        15,
        "Redis answers again: admitted there"
    );
}

/// A process that starts while Redis is down (a restart during an outage)
/// serves on the local ledger at once, on the configured catalog since it
/// cannot read Redis's; the sweeper connects when Redis comes, imports what
/// was admitted meanwhile, and catches up with the admin changes kept there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_started_without_redis_connects_when_it_comes() {
    let Some(()) = redis_available() else { return };
    let mut server = RedisServer::start_with(aof());
    let c = catalog();
    let acme = ScopeKey::tenant("acme").unwrap();
    {
        // An admin change another instance made: acme gets 5,000 tokens.
        let (other, _) = store(&server).await;
        let own = Plan::new(
            "acme",
            vec![
                Limit::new(
                    Dimension::TOKENS,
                    5_000,
                    Window::Sliding {
                        period_ms: 3_600_000,
                        slices: 60,
                    },
                )
                .unwrap(),
            ],
            OverrunPolicy::ChargeActual,
        )
        .unwrap();
        other
            .change_catalog(&CatalogChange::SetOverride(
                acme.clone(),
                Override::Limits(own),
            ))
            .await
            .unwrap();
    }
    blocking(|| server.kill9());

    let clock = manual_clock();
    let ids = Arc::new(SeededIds::new(0x1a7e));
    let redis = RedisStore::connect_later(
        options(&server),
        c.clone(),
        Some(clock.clone()),
        ids.clone(),
    )
    .unwrap_or_else(|e| panic!("a store that connects later only checks the URL: {e}"));
    assert!(!redis.is_connected());
    let fo = FailOpenLocal::new(Arc::new(redis), 0.1, clock.clone(), ids);

    // Without Redis's catalog: the configured 1,000 × 0.1 tokens.
    let mut ids = Vec::new();
    for i in 0..10 {
        let started = Instant::now();
        let g = fo
            .reserve(&request(&c, "acme", 10))
            .await
            .unwrap_or_else(|e| panic!("local reserve #{i}: {e:?}"));
        assert!(
            started.elapsed() < Duration::from_millis(400),
            "a store that is not connected answers at once, not after the 500 ms timeout: {:?}",
            started.elapsed()
        );
        ids.push(g.id);
    }
    match fo.reserve(&request(&c, "acme", 10)).await {
        Err(StoreError::Rejected(ReserveError::Denied(d))) => {
            assert_eq!((d.dimension.as_str(), d.capacity), ("tokens", 100), "{d}")
        }
        other => panic!("the 11th reserve of 10 should be denied locally, got {other:?}"),
    }
    for id in &ids {
        fo.settle(*id, &usage(7)).await.unwrap();
    }
    assert_eq!(fo.admitted_locally(), 10);
    assert!(fo.expire_due().await.is_err(), "Redis is still down");
    assert!(!fo.redis().is_connected());
    assert!(unavailable(
        fo.redis().reserve(&request(&c, "acme", 1)).await
    ));

    blocking(|| server.restart());
    reconcile_all(&fo).await;
    assert!(fo.redis().is_connected());
    let st = fo.redis().status(&acme).await.unwrap();
    assert_eq!(st.limits[0].used, 70, "ten local settles of 7: {st:?}");
    assert_eq!(
        st.limits[0].capacity, 5_000,
        "the admin change kept in Redis applies once connected: {st:?}"
    );
    let catalog = fo.catalog().await.unwrap();
    assert_eq!(catalog.plan_for(&acme).limits()[0].capacity(), 5_000);
    // From now on (the outage handed over) Redis admits.
    until_handed_over(&fo).await;
    fo.reserve(&request(&c, "acme", 10)).await.unwrap();
    assert_eq!(fo.admitted_locally(), 10);
    let st = fo.redis().status(&acme).await.unwrap();
    assert_eq!((st.limits[0].used, st.limits[0].held), (70, 10), "{st:?}");
}

/// A URL that cannot be a Redis address is refused at once, connected or not.
#[test]
fn a_store_that_connects_later_still_checks_its_url() {
    for url in [
        "http://127.0.0.1:1",
        "redis+sentinel://127.0.0.1:26379",
        "rediss+sentinel://h:1/m",
    ] {
        match RedisStore::connect_later(
            RedisOptions::new(url),
            catalog(),
            None,
            Arc::new(SeededIds::new(1)),
        ) {
            Err(allowance_redis::ConnectError::Url(why)) => assert!(!why.is_empty(), "{url}"),
            Err(e) => panic!("{url}: a URL error expected, got {e}"),
            Ok(_) => panic!("{url}: accepted"),
        }
    }
}

fn keyed(c: &Catalog, tenant: &str, n: u64, key: &str) -> ReserveRequest {
    let mut req = request(c, tenant, n);
    req.idempotency_key = Some(key.into());
    req
}

/// An idempotency key used while Redis was down follows its reservation
/// into Redis: a retried reserve with it after reconciliation replays the
/// imported reservation (a different request under it is a conflict), and
/// holds nothing more — unless Redis gave the key to a live reservation of
/// its own meanwhile, which keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_used_during_an_outage_replays_after_it() {
    let Some(()) = redis_available() else { return };
    let mut server = RedisServer::start_with(aof());
    let (fo, _clock) = store(&server).await;
    let c = catalog();
    let acme = ScopeKey::tenant("acme").unwrap();

    blocking(|| server.kill9());
    let settled = fo.reserve(&keyed(&c, "acme", 10, "k")).await.unwrap();
    fo.settle(settled.id, &usage(7)).await.unwrap();
    let refunded = fo.reserve(&keyed(&c, "acme", 5, "r")).await.unwrap();
    fo.refund(refunded.id).await.unwrap();
    let taken = fo.reserve(&keyed(&c, "acme", 3, "taken")).await.unwrap();
    fo.settle(taken.id, &usage(3)).await.unwrap();
    assert_eq!(fo.admitted_locally(), 3);

    blocking(|| server.restart());
    until_redis_answers(&fo).await;
    // Another instance reuses "taken" in Redis before this one reconciles.
    let theirs = fo
        .redis()
        .reserve(&keyed(&c, "acme", 4, "taken"))
        .await
        .unwrap();
    assert!(!theirs.replayed);
    reconcile_all(&fo).await;
    until_handed_over(&fo).await;

    let again = fo.reserve(&keyed(&c, "acme", 10, "k")).await.unwrap();
    assert!(again.replayed, "{again:?}");
    assert_eq!(again.id, settled.id);
    let r = fo.get(settled.id).await.unwrap().expect("imported");
    assert_eq!(
        (r.status, r.charged.map(|c| c.get(Dimension::TOKENS))),
        (Status::Settled, Some(7))
    );
    let again = fo.reserve(&keyed(&c, "acme", 5, "r")).await.unwrap();
    assert_eq!((again.replayed, again.id), (true, refunded.id));
    match fo.reserve(&keyed(&c, "acme", 20, "k")).await {
        Err(StoreError::Rejected(ReserveError::IdempotencyConflict { key })) => {
            assert_eq!(key, "k")
        }
        other => panic!("another request under the key should conflict, got {other:?}"),
    }
    // Redis's own reservation keeps the key it was given.
    let again = fo.reserve(&keyed(&c, "acme", 4, "taken")).await.unwrap();
    assert_eq!((again.replayed, again.id), (true, theirs.id));
    assert_eq!(fo.admitted_locally(), 3, "replays are not admissions");
    let st = fo.redis().status(&acme).await.unwrap();
    assert_eq!(
        (st.limits[0].used, st.limits[0].held),
        (10, 4),
        "7 + 3 used, Redis's own 4 held, the replays hold nothing: {st:?}"
    );
}

/// What was used locally counts in Redis's windows from when it was used,
/// not from its import: usage that has left a sliding window by the time
/// Redis returns counts no more, nor does yesterday's in today's calendar
/// day.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_usage_counts_in_the_windows_from_when_it_happened() {
    let Some(()) = redis_available() else { return };
    let mut server = RedisServer::start_with(aof());
    let (fo, clock) = store(&server).await;
    let c = catalog();
    const MINUTE: u64 = 60_000;
    blocking(|| server.kill9());

    // Day 1, 22:00: 50 tokens (out of the sliding hour by the import, but
    // within the ended retention of 24 h: not forgotten locally).
    clock.advance_ms(22 * 60 * MINUTE);
    let old = fo.reserve(&request(&c, "acme", 50)).await.unwrap();
    fo.settle(old.id, &usage(50)).await.unwrap();
    // 23:31: 30 tokens (still in it).
    clock.advance_ms(91 * MINUTE);
    let recent = fo.reserve(&request(&c, "acme", 30)).await.unwrap();
    fo.settle(recent.id, &usage(30)).await.unwrap();
    // 23:59: 40 tokens of day 1's calendar budget.
    clock.advance_ms(28 * MINUTE);
    let yesterday = fo.reserve(&request(&c, "daily", 40)).await.unwrap();
    fo.settle(yesterday.id, &usage(40)).await.unwrap();

    // Day 2, 00:01: Redis is back.
    clock.advance_ms(2 * MINUTE);
    blocking(|| server.restart());
    reconcile_all(&fo).await;
    let acme = fo
        .redis()
        .status(&ScopeKey::tenant("acme").unwrap())
        .await
        .unwrap();
    assert_eq!(
        acme.limits[0].used, 30,
        "the hour holds only the 30: {acme:?}"
    );
    let daily = fo
        .redis()
        .status(&ScopeKey::tenant("daily").unwrap())
        .await
        .unwrap();
    assert_eq!(daily.limits[0].used, 0, "day 2 has used nothing: {daily:?}");
    // The usage log has all three, with their own instants.
    let log = usage_by_id(fo.redis(), "acme").await;
    assert_eq!(log.len(), 2, "{log:?}");
    assert_eq!(usage_by_id(fo.redis(), "daily").await.len(), 1);
}

/// Redis back after an outage: this instance keeps answering locally (its
/// emergency limits) until every reservation it holds locally has its
/// shadow in Redis and the hand-over has passed, so it never admits in
/// Redis beside a local hold Redis does not count yet. (Found by an audit:
/// the first reserve to reach Redis ended the outage and was admitted as
/// if the local hold did not exist — 150 used of 100.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_outage_nothing_is_admitted_in_redis_beside_an_unshadowed_hold() {
    let Some(()) = redis_available() else { return };
    let mut server = RedisServer::start_with(aof());
    let (fo, _clock) = store(&server).await;
    let c = catalog();
    let acme = ScopeKey::tenant("acme").unwrap();
    blocking(|| server.kill9());
    let held = fo.reserve(&request(&c, "acme", 100)).await.unwrap();
    assert_eq!(fo.admitted_locally(), 1);

    blocking(|| server.restart());
    until_redis_answers(&fo).await;
    // Redis answers, but nothing was shadowed yet: still local (the local
    // 100 are taken: refused there, never admitted in Redis).
    assert!(fo.answering_locally());
    let early = fo.reserve(&request(&c, "acme", 1000)).await;
    assert!(
        matches!(early, Err(StoreError::Rejected(ReserveError::Denied(_)))),
        "{early:?}"
    );
    assert_eq!(
        tokens_of(&fo.redis().status(&acme).await.unwrap()),
        (1000, 0, 0)
    );

    until_handed_over(&fo).await;
    assert_eq!(
        tokens_of(&fo.redis().status(&acme).await.unwrap()),
        (900, 0, 100)
    );
    let over = fo.reserve(&request(&c, "acme", 901)).await;
    assert!(
        matches!(over, Err(StoreError::Rejected(ReserveError::Denied(_)))),
        "{over:?}"
    );
    let rest = fo.reserve(&request(&c, "acme", 900)).await.unwrap();
    assert_eq!(fo.admitted_locally(), 1, "Redis admitted it");
    fo.settle(held.id, &usage(100)).await.unwrap();
    fo.settle(rest.id, &usage(900)).await.unwrap();
    reconcile_all(&fo).await;
    assert_eq!(
        tokens_of(&fo.redis().status(&acme).await.unwrap()),
        (0, 1000, 0)
    );
}

/// An admin change made through another instance reaches an idle one by
/// its next sweep, so the emergency ledger an outage then builds has it.
/// (Found by an audit: the idle instance built it from the stale catalog
/// and admitted 10 tokens locally against an override of 2.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_instance_sweeps_in_admin_changes_before_an_outage() {
    let Some(()) = redis_available() else { return };
    let mut server = RedisServer::start_with(aof());
    let (a, _) = store(&server).await;
    let (b, _) = store(&server).await;
    let c = catalog();
    let two = Plan::new(
        "two",
        vec![Limit::new(Dimension::TOKENS, 2, Window::Total).unwrap()],
        OverrunPolicy::ChargeActual,
    )
    .unwrap();
    a.change_catalog(&CatalogChange::SetOverride(
        ScopeKey::tenant("acme").unwrap(),
        Override::Limits(two),
    ))
    .await
    .unwrap();
    b.expire_due().await.unwrap();
    let acme = ScopeKey::tenant("acme").unwrap();
    assert_eq!(
        b.catalog().await.unwrap().plan_for(&acme).limits()[0].capacity(),
        2
    );
    blocking(|| server.kill9());
    let local = b.reserve(&request(&c, "acme", 10)).await;
    assert!(
        matches!(local, Err(StoreError::Rejected(ReserveError::Denied(_)))),
        "the emergency ledger has the override (capacity max(1, 2 × 0.1)): {local:?}"
    );
}
