//! Cross-slot reservations on a Redis Cluster under faults and retries
//! (src/cross.rs and the `fhold`/`fend`/`fextend` ops of ledger.lua), from
//! an adversarial review: each test states a guarantee of docs/REDIS-STORE.md ("Shared scopes on a cluster") or of
//! the engine's semantics that the cluster path must keep.

use std::sync::Arc;
use std::time::Duration;

use allowance_conformance::catalogs;
use allowance_core::{
    Amounts, Catalog, ManualClock, ReserveError, ReserveRequest, ScopeSet, SeededIds, Status,
    Store, StoreError, Timestamp, Usage,
};
use allowance_redis::{RedisOptions, RedisStore};
use allowance_testkit::{RedisCluster, redis_available};

async fn store_on(
    cluster: &RedisCluster,
    prefix: &str,
    timeout_ms: u64,
    clock: Arc<ManualClock>,
    seed: u64,
) -> RedisStore {
    let mut options = RedisOptions::new(cluster.urls()[0].clone());
    options.prefix = prefix.into();
    options.timeout_ms = timeout_ms;
    let store = RedisStore::connect(
        options,
        catalogs::standard(),
        Some(clock),
        Arc::new(SeededIds::new(seed)),
    )
    .await
    .expect("connect");
    assert!(store.is_cluster());
    store
}

fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(Timestamp::from_millis(catalogs::START_MS)))
}

fn search_calls(catalog: &Catalog, n: u64) -> Amounts {
    Amounts::new().with(catalog.dimension("search_calls").expect("the dimension"), n)
}

/// The node serving the slot of `key`.
fn owner(cluster: &RedisCluster, key: &str) -> usize {
    let slot: u16 = cluster.nodes()[0]
        .command(&["CLUSTER", "KEYSLOT", key])
        .expect("KEYSLOT")
        .trim()
        .parse()
        .expect("a slot");
    cluster
        .nodes()
        .iter()
        .position(|n| {
            let nodes = n.command(&["CLUSTER", "NODES"]).expect("CLUSTER NODES");
            let me = nodes
                .lines()
                .find(|l| l.contains("myself"))
                .expect("myself")
                .to_string();
            me.split_whitespace().skip(8).any(|r| {
                let (a, b) = r.split_once('-').unwrap_or((r, r));
                match (a.parse::<u16>(), b.parse::<u16>()) {
                    (Ok(a), Ok(b)) => a <= slot && slot <= b,
                    _ => false,
                }
            })
        })
        .expect("an owner")
}

/// The tag of a tenant's keys, `{tXX}`.
fn tenant_key(prefix: &str, tenant: &str) -> String {
    format!(
        "{prefix}{{t{:02x}}}:x",
        allowance_core::ReservationId::tenant_tag(tenant)
    )
}

fn tool_key(prefix: &str) -> String {
    format!(
        "{prefix}{{s{:02x}}}:s:tool:search",
        allowance_core::ReservationId::tenant_tag("tool:search")
    )
}

/// A tenant whose group is on another node than `tool:search`'s, and
/// the two nodes.
fn tenant_elsewhere(
    cluster: &RedisCluster,
    catalog: &Catalog,
    prefix: &str,
) -> (ScopeSet, usize, usize) {
    let tool_node = owner(cluster, &tool_key(prefix));
    for t in 0..256 {
        let tenant = format!("t{t}");
        let node = owner(cluster, &tenant_key(prefix, &tenant));
        if node != tool_node {
            let scopes = catalog
                .scope_set(&tenant, &[("tool", "search")])
                .expect("scopes");
            return (scopes, node, tool_node);
        }
    }
    panic!("every tenant on the tool's node")
}

/// An idempotent retry of a granted reservation answers the original grant
/// (`replayed`), whatever room is left: the engine and the single-node
/// script look the key up before checking any limit. On a cluster the
/// shared group's `fhold` checks (and holds) the shared scope first, so a
/// retry of a reservation that filled the shared scope is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_retry_replays_even_when_the_shared_scope_is_full() {
    let Some(()) = redis_available() else { return };
    let cluster = RedisCluster::start(3);
    let store = store_on(&cluster, "idem:", 1000, clock(), 1).await;
    let catalog = store.catalog().await.expect("catalog");
    let scopes = catalog
        .scope_set("acme", &[("tool", "search")])
        .expect("scopes");
    let mut req = ReserveRequest::new(scopes.clone(), search_calls(&catalog, 100));
    req.idempotency_key = Some(Arc::from("job-1"));
    let first = store.reserve(&req).await.expect("the first reserve");
    assert!(!first.replayed);
    let retry = store.reserve(&req).await;
    match retry {
        Ok(g) => {
            assert!(g.replayed, "{g:?}");
            assert_eq!(g.id, first.id);
        }
        Err(e) => panic!("a retry of the same key must replay the grant, got {e:?}"),
    }
    let tool = store.status(&scopes.as_slice()[1]).await.expect("status");
    assert_eq!(tool.held_reservations, 1, "{tool:?}");
}

/// The tenant's node stops during a keyed cross-slot reserve (503: outcome
/// unknown), then resumes and runs what it had received. Found in review:
/// the store used to release the shared hold on that 503, so a reservation
/// committed late held nothing on the shared scope and its settle recorded
/// nothing there. Now an unknown outcome keeps the shared hold, and a settle
/// records on the shared scope whatever became of the hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_part_that_commits_after_a_timeout_keeps_its_shared_usage() {
    let Some(()) = redis_available() else { return };
    let cluster = RedisCluster::start(3);
    let clock = clock();
    let prefix = "late:";
    let store = store_on(&cluster, prefix, 300, clock.clone(), 2).await;
    let catalog = store.catalog().await.expect("catalog");
    let (scopes, tenant_node, _tool_node) = tenant_elsewhere(&cluster, &catalog, prefix);
    let tool = scopes.as_slice()[1].clone();
    let mut req = ReserveRequest::new(scopes.clone(), search_calls(&catalog, 5));
    req.idempotency_key = Some(Arc::from("job-7"));

    // Connections to both nodes are up before one stops.
    store.status(scopes.tenant()).await.expect("status");
    store.status(&tool).await.expect("status");
    cluster.nodes()[tenant_node].stop();
    let first = store.reserve(&req).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    cluster.nodes()[tenant_node].cont();
    assert!(
        matches!(first, Err(StoreError::Unavailable(_))),
        "the tenant's part timed out: {first:?}"
    );
    // The resumed node ran the FCALL it had received.
    let mut granted = None;
    for _ in 0..50 {
        match store.reserve(&req).await {
            Ok(g) => {
                granted = Some(g);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    // Either the first reserve committed after its timeout (the retry is
    // its replay) or it never ran (the retry made it): both must leave the
    // shared scope holding, then recording, exactly one reservation's worth.
    let granted = granted.expect("the retry answers");
    let held = store.status(&tool).await.expect("status");
    let settled = store
        .settle(
            granted.id,
            &Usage {
                amounts: search_calls(&catalog, 3),
                ..Default::default()
            },
        )
        .await
        .expect("settle");
    assert_eq!(settled.status, Status::Settled);
    clock.advance_ms(3_000);
    for _ in 0..5 {
        let _ = store.expire_due().await;
    }
    let after = store.status(&tool).await.expect("status");
    assert_eq!(
        (held.limits[0].held, after.limits[0].used),
        (5, 3),
        "while held the shared scope held its 5 calls ({held:?}); settled, it records the 3 used ({after:?})"
    );
}

/// A shared group's `fhold` that times out (its node is stopped) but runs
/// once the node resumes: the reserve answered 503 and wrote no record, so
/// nobody can refund the hold, and the compensation skipped that group
/// (only groups that answered "ok" are released). The shared scope holds
/// room for no reservation until the hold's TTL (5 minutes here), not
/// "for the length of a round trip".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_hold_that_commits_after_a_timeout_is_released() {
    let Some(()) = redis_available() else { return };
    let cluster = RedisCluster::start(3);
    let clock = clock();
    let prefix = "orphan:";
    let store = store_on(&cluster, prefix, 300, clock.clone(), 3).await;
    let catalog = store.catalog().await.expect("catalog");
    let (scopes, _tenant_node, tool_node) = tenant_elsewhere(&cluster, &catalog, prefix);
    let tool = scopes.as_slice()[1].clone();
    store.status(scopes.tenant()).await.expect("status");
    store.status(&tool).await.expect("status");
    cluster.nodes()[tool_node].stop();
    let reserve = store
        .reserve(&ReserveRequest::new(
            scopes.clone(),
            search_calls(&catalog, 40),
        ))
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    cluster.nodes()[tool_node].cont();
    assert!(
        matches!(reserve, Err(StoreError::Unavailable(_))),
        "{reserve:?}"
    );
    let tenant = store.status(scopes.tenant()).await.expect("status");
    assert_eq!(tenant.held_reservations, 0, "no reservation was made");
    // Well within the hold's 5-minute TTL, past any round trip.
    clock.advance_ms(10_000);
    let mut st = store.status(&tool).await;
    for _ in 0..20 {
        if st.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        st = store.status(&tool).await;
    }
    let st = st.expect("status");
    assert_eq!(
        (st.held_reservations, st.limits[0].held),
        (0, 0),
        "a hold stands on the shared scope without any reservation: {st:?}"
    );
}

/// Several tenants race for the shared scope's 100 calls: never more than
/// 100 held, and once all answered only the granted ones hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_tenants_never_overfill_the_shared_scope() {
    let Some(()) = redis_available() else { return };
    let cluster = RedisCluster::start(3);
    let store = Arc::new(store_on(&cluster, "race:", 1000, clock(), 4).await);
    let catalog = store.catalog().await.expect("catalog");
    let mut tasks = Vec::new();
    for t in 0..12 {
        let (store, catalog) = (store.clone(), catalog.clone());
        tasks.push(tokio::spawn(async move {
            let scopes = catalog
                .scope_set(&format!("r{t}"), &[("tool", "search")])
                .expect("scopes");
            let mut granted = 0;
            for _ in 0..10 {
                match store
                    .reserve(&ReserveRequest::new(
                        scopes.clone(),
                        search_calls(&catalog, 7),
                    ))
                    .await
                {
                    Ok(_) => granted += 7,
                    Err(StoreError::Rejected(ReserveError::Denied(_))) => {}
                    Err(e) => panic!("{e:?}"),
                }
            }
            granted
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("task");
    }
    let tool = catalog.scope_set("r0", &[("tool", "search")]).expect("s");
    let st = store.status(&tool.as_slice()[1]).await.expect("status");
    assert!(total <= 100, "granted {total} calls of 100");
    assert_eq!(st.limits[0].held, total, "{st:?}");
}

/// Expired on both sides, then settled late: the shared scope records the
/// usage once, and a replayed settle changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_settle_across_slots_records_once() {
    let Some(()) = redis_available() else { return };
    let cluster = RedisCluster::start(3);
    let clock = clock();
    let store = store_on(&cluster, "lateset:", 1000, clock.clone(), 5).await;
    let catalog = store.catalog().await.expect("catalog");
    let scopes = catalog
        .scope_set("acme", &[("tool", "search")])
        .expect("scopes");
    let tool = scopes.as_slice()[1].clone();
    let mut req = ReserveRequest::new(scopes.clone(), search_calls(&catalog, 10));
    req.ttl_ms = Some(1_000);
    let id = store.reserve(&req).await.expect("reserve").id;
    let raised = store
        .extend(id, Some(&search_calls(&catalog, 4)), None)
        .await
        .expect("extend");
    assert_eq!(raised.status, Status::Held);
    clock.advance_ms(2_000);
    store.expire_due().await.expect("sweep");
    let st = store.status(&tool).await.expect("status");
    assert_eq!((st.limits[0].held, st.limits[0].used), (0, 0), "{st:?}");
    let usage = Usage {
        amounts: search_calls(&catalog, 6),
        ..Default::default()
    };
    store.settle(id, &usage).await.expect("late settle");
    store.settle(id, &usage).await.expect("replayed settle");
    clock.advance_ms(3_000);
    store.expire_due().await.expect("sweep");
    store.settle(id, &usage).await.expect("replayed settle");
    let st = store.status(&tool).await.expect("status");
    assert_eq!((st.limits[0].held, st.limits[0].used), (0, 6), "{st:?}");
}

/// A node killed (`kill -9`) and restarted on its port and data dir: the
/// store answers again without a restart of its own, on the node's slots
/// and across slots. (Found by an audit: the cluster client's slot refresh
/// never completed, and every call answered 503 for good.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_answers_again_after_a_node_restarts() {
    let Some(()) = redis_available() else { return };
    let mut cluster = RedisCluster::start_with(
        3,
        allowance_testkit::RedisOptions {
            appendonly: true,
            appendfsync: "always",
            ..Default::default()
        },
    );
    let store = Arc::new(store_on(&cluster, "restart:", 500, clock(), 7).await);
    // The server's sweeper, as in `allowance serve`.
    let sweeper = {
        let store = store.clone();
        tokio::spawn(async move {
            loop {
                let _ = store.expire_due().await;
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };
    let catalog = store.catalog().await.expect("catalog");
    let (scopes, tenant_node, _) = tenant_elsewhere(&cluster, &catalog, "restart:");
    let req = ReserveRequest::new(scopes.clone(), search_calls(&catalog, 1));
    let before = store.reserve(&req).await.expect("before the restart");
    store
        .settle(before.id, &Usage::default())
        .await
        .expect("settled");

    // Down for a while, with calls failing meanwhile (each one sends the
    // cluster client looking for the slots again), then back.
    tokio::task::block_in_place(|| cluster.nodes_mut()[tenant_node].kill9());
    for _ in 0..5 {
        assert!(
            store.reserve(&req).await.is_err(),
            "the tenant's node is down"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    tokio::task::block_in_place(|| cluster.nodes_mut()[tenant_node].restart());
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let ok = cluster.nodes().iter().all(|n| {
            n.command(&["CLUSTER", "INFO"])
                .is_ok_and(|i| i.lines().any(|l| l.trim_end() == "cluster_state:ok"))
        });
        if ok {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the cluster did not heal"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let last = match store.reserve(&req).await {
            Ok(g) => {
                store.refund(g.id).await.expect("refund after recovery");
                break;
            }
            Err(e) => e,
        };
        assert!(
            std::time::Instant::now() < deadline,
            "the store still fails 15 s after the node is back: {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let status = store.status(&scopes.as_slice()[0]).await.expect("status");
    assert_eq!(status.held_reservations, 0, "{status:?}");
    sweeper.abort();
}

/// As above, with the shared group's node stopped for twice the store
/// timeout (1 s at 500 ms), as an audit did through two `serve` processes
/// and saw the late hold stay until its TTL: here, with the sweeper running,
/// the release reaches the group once it wakes and nothing stays held. (The
/// audit's case is not reproduced at the store level; REDIS-STORE.md keeps
/// it as a known gap.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_hold_is_released_after_a_stop_longer_than_the_timeout() {
    let Some(()) = redis_available() else { return };
    let cluster = RedisCluster::start(3);
    let clock = clock();
    let prefix = "orphan2:";
    let store = store_on(&cluster, prefix, 500, clock.clone(), 4).await;
    let catalog = store.catalog().await.expect("catalog");
    let (scopes, _tenant_node, tool_node) = tenant_elsewhere(&cluster, &catalog, prefix);
    let tool = scopes.as_slice()[1].clone();
    store.status(scopes.tenant()).await.expect("status");
    store.status(&tool).await.expect("status");
    let stopped = std::time::Instant::now();
    cluster.nodes()[tool_node].stop();
    let reserve = store
        .reserve(&ReserveRequest::new(
            scopes.clone(),
            search_calls(&catalog, 40),
        ))
        .await;
    tokio::time::sleep(Duration::from_millis(1_000).saturating_sub(stopped.elapsed())).await;
    cluster.nodes()[tool_node].cont();
    assert!(
        matches!(reserve, Err(StoreError::Unavailable(_))),
        "{reserve:?}"
    );
    // The sweeper runs; well within the hold's 5-minute TTL.
    clock.advance_ms(10_000);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let _ = store.expire_due().await;
        if let Ok(st) = store.status(&tool).await
            && (st.held_reservations, st.limits[0].held) == (0, 0)
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a hold stands on the shared scope without any reservation: {:?}",
            store.status(&tool).await
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A refused reservation's release of its shared hold that never lands —
/// the shared group's node stopped when it was sent, then died and came
/// back from its append-only file with the hold — is sent again by the
/// sweeper until it lands, instead of leaving the hold to block the shared
/// scope until its TTL. (An audit saw such a release never arrive through
/// two `serve` processes.) The tenant's node is paused so that the tool's
/// hold is taken, and its node stopped, before the tenant's part refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_never_landed_is_sent_again_by_the_sweeper() {
    let Some(()) = redis_available() else { return };
    let mut cluster = RedisCluster::start_with(
        3,
        allowance_testkit::RedisOptions {
            appendonly: true,
            appendfsync: "always",
            ..Default::default()
        },
    );
    let prefix = "lost:";
    let store = Arc::new(store_on(&cluster, prefix, 1000, clock(), 5).await);
    let catalog = store.catalog().await.expect("catalog");
    let (scopes, tenant_node, tool_node) = tenant_elsewhere(&cluster, &catalog, prefix);
    let tool = scopes.as_slice()[1].clone();
    store.status(scopes.tenant()).await.expect("status");
    store.status(&tool).await.expect("status");

    // The tool has room for 5 calls; the tenant none for 200,000 tokens.
    let mut req = ReserveRequest::new(
        scopes.clone(),
        search_calls(&catalog, 5).with(allowance_core::Dimension::TOKENS, 200_000),
    );
    req.ttl_ms = Some(600_000);
    cluster.nodes()[tenant_node]
        .command(&["CLIENT", "PAUSE", "600", "ALL"])
        .expect("pause the tenant's node");
    let reserve = tokio::spawn({
        let store = store.clone();
        async move { store.reserve(&req).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    tokio::task::block_in_place(|| cluster.nodes()[tool_node].stop());
    let reserve = reserve.await.expect("the reserve's task");
    assert!(
        matches!(reserve, Err(StoreError::Unavailable(_))),
        "refused, its release unanswered: {reserve:?}"
    );
    // The release dies with the stopped node; the hold comes back with it.
    tokio::task::block_in_place(|| {
        cluster.nodes_mut()[tool_node].kill9();
        cluster.nodes_mut()[tool_node].restart();
    });

    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let _ = store.expire_due().await;
        if let Ok(st) = store.status(&tool).await
            && (st.held_reservations, st.limits[0].held) == (0, 0)
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the hold of a refused reservation still blocks the shared scope: {:?}",
            store.status(&tool).await
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
