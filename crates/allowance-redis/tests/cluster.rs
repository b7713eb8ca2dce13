//! The conformance suite on a 3-node Redis Cluster made with
//! `redis-cli --cluster create`: every case on one cluster, each under its
//! own key prefix, run one after the other so a failure names its case.
//!
//! Shared scopes live in other hash slots than a tenant's keys: a
//! reservation on one is made by a script per slot (src/cross.rs). The
//! suite passes with them; the weaker guarantees that remain — a refused
//! reservation leaves no hold behind once it answers, a settle interrupted
//! between its scripts is finished by the sweeper — have tests of their own.

use std::sync::Arc;

use allowance_conformance::{StoreFactory, cases, catalogs};
use allowance_core::{
    Amounts, Catalog, Dimension, ManualClock, ReserveError, ReserveRequest, SeededIds, Store,
    StoreError, Timestamp,
};
use allowance_redis::{RedisOptions, RedisStore};
use allowance_testkit::{RedisCluster, redis_available};

struct OnCluster {
    url: String,
    prefix: String,
}

impl StoreFactory for OnCluster {
    type S = RedisStore;

    async fn make(&self, catalog: Catalog, clock: Arc<ManualClock>) -> RedisStore {
        let mut options = RedisOptions::new(&self.url);
        options.prefix = self.prefix.clone();
        let store = RedisStore::connect(
            options,
            catalog,
            Some(clock),
            Arc::new(SeededIds::new(0x5eed)),
        )
        .await
        .unwrap_or_else(|e| panic!("connecting to {}: {e}", self.url));
        assert!(store.is_cluster(), "the store sees a cluster");
        store
    }
}

/// The case that checks the usage log's order across tenants: on a
/// cluster there is no commit order across nodes, so the log orders
/// tenants by time; [`usage_log_on_a_cluster`] checks the guarantee that
/// remains.
const ORDER_ACROSS_TENANTS: &str = "usage_log_records_every_end";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_on_a_three_node_cluster() {
    let Some(()) = redis_available() else { return };
    let cluster = RedisCluster::start(3);
    let url = cluster.urls()[0].clone();
    let mut failed = Vec::new();
    let mut ran = 0;
    for (i, case) in cases().into_iter().enumerate() {
        if case.name == ORDER_ACROSS_TENANTS {
            continue;
        }
        ran += 1;
        let factory = OnCluster {
            url: url.clone(),
            prefix: format!("c{i}:"),
        };
        // Each case in its own task: a failure is reported, the rest still run.
        let name = case.name;
        let outcome = tokio::spawn(async move { case.run_on(&factory).await }).await;
        if outcome.is_err() {
            failed.push(name);
        }
    }
    assert!(
        failed.is_empty(),
        "cases failing on the cluster: {failed:?}"
    );
    assert_eq!(ran + 1, cases().len());
}

/// The usage log on a cluster, written by eight tenants at once (eight
/// groups, spread over the nodes) while an exporter pages through it with a
/// stored cursor: every end exactly once, cursors increasing, each tenant's
/// records in its own commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_log_on_a_cluster() {
    let Some(()) = redis_available() else { return };
    let cluster = RedisCluster::start(3);
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(catalogs::START_MS)));
    let store = Arc::new(
        OnCluster {
            url: cluster.urls()[0].clone(),
            prefix: "usage:".into(),
        }
        .make(catalogs::standard(), clock)
        .await,
    );
    let catalog = store.catalog().await.expect("catalog");
    let mut writers = Vec::new();
    for t in 0..8 {
        let (store, catalog) = (store.clone(), catalog.clone());
        writers.push(tokio::spawn(async move {
            let scopes = catalog.scope_set(&format!("t{t}"), &[]).expect("scopes");
            let mut ended = Vec::new();
            for _ in 0..6 {
                let req =
                    ReserveRequest::new(scopes.clone(), Amounts::new().with(Dimension::TOKENS, 10));
                let id = store.reserve(&req).await.expect("reserve").id;
                let usage = allowance_core::Usage {
                    amounts: Amounts::new().with(Dimension::TOKENS, 7),
                    ..Default::default()
                };
                store.settle(id, &usage).await.expect("settle");
                ended.push(id);
            }
            ended
        }));
    }
    let mut seen = Vec::new();
    let mut cursor = None;
    let mut quiet = 0;
    loop {
        let page = store.usage(cursor, 3, None).await.expect("usage");
        if let Some(c) = cursor {
            assert!(
                page.records.iter().all(|r| r.cursor > c),
                "a page starts after its cursor"
            );
        }
        seen.extend(
            page.records
                .iter()
                .map(|r| (r.cursor, r.event.reservation.as_ref().map(|x| x.id))),
        );
        cursor = Some(page.next_cursor);
        let done = writers.iter().all(|w| w.is_finished());
        if page.records.is_empty() {
            if done {
                quiet += 1;
                if quiet == 3 {
                    break;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    }
    let mut expected = Vec::new();
    for w in writers {
        expected.push(w.await.expect("writer"));
    }
    assert!(seen.windows(2).all(|w| w[0].0 < w[1].0), "cursors increase");
    let ids: Vec<_> = seen
        .iter()
        .map(|(_, id)| id.expect("a reservation's end"))
        .collect();
    assert_eq!(ids.len(), 48, "every end once");
    for tenant in &expected {
        let order: Vec<_> = ids
            .iter()
            .filter(|id| tenant.contains(id))
            .copied()
            .collect();
        assert_eq!(&order, tenant, "a tenant's records in its commit order");
    }
}

fn search_calls(catalog: &Catalog, n: u64) -> Amounts {
    Amounts::new().with(catalog.dimension("search_calls").expect("the dimension"), n)
}

/// A reservation the tenant's script refuses after its shared scope's
/// group held it: once the refusal answers, the shared hold is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_cross_slot_reservation_leaves_no_hold() {
    let Some(()) = redis_available() else { return };
    let cluster = RedisCluster::start(3);
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(catalogs::START_MS)));
    let store = OnCluster {
        url: cluster.urls()[0].clone(),
        prefix: "refused:".into(),
    }
    .make(catalogs::standard(), clock)
    .await;
    let catalog = store.catalog().await.expect("catalog");
    let scopes = catalog
        .scope_set("acme", &[("tool", "search")])
        .expect("scopes");
    // The tool has room for 5 calls; the tenant has none for 200,000 tokens.
    let amounts = search_calls(&catalog, 5).with(Dimension::TOKENS, 200_000);
    match store
        .reserve(&ReserveRequest::new(scopes.clone(), amounts))
        .await
    {
        Err(StoreError::Rejected(ReserveError::Denied(d))) => {
            assert_eq!(d.scope.as_str(), "tenant:acme", "{d:?}");
        }
        other => panic!("expected the tenant's refusal, got {other:?}"),
    }
    let tool = &scopes.as_slice()[1];
    let st = store.status(tool).await.expect("status");
    assert_eq!(st.held_reservations, 0, "no hold left behind: {st:?}");
    assert!(
        st.limits.iter().all(|l| l.held == 0 && l.used == 0),
        "{st:?}"
    );
    // And the shared group refusing first leaves the tenant untouched.
    let too_many = search_calls(&catalog, 101);
    match store
        .reserve(&ReserveRequest::new(scopes.clone(), too_many))
        .await
    {
        Err(StoreError::Rejected(ReserveError::Denied(d))) => {
            assert_eq!(d.scope.as_str(), "tool:search", "{d:?}")
        }
        other => panic!("expected the tool's refusal, got {other:?}"),
    }
    let tenant = store.status(scopes.tenant()).await.expect("status");
    assert_eq!(tenant.held_reservations, 0, "{tenant:?}");
}

/// The node holding a key, found by asking each.
fn node_of(cluster: &RedisCluster, pattern: &str) -> Option<usize> {
    cluster.nodes().iter().position(|n| {
        n.command(&["KEYS", pattern])
            .is_ok_and(|k| k.lines().any(|l| !l.is_empty() && l != "(nil)"))
    })
}

/// A settle whose shared group refuses to run scripts after the tenant's
/// script committed it: the settle answers (it is in the ledger), the
/// reservation stays pending, and the sweeper records the charges on the
/// shared scope once the group runs scripts again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_finishes_an_interrupted_cross_slot_settle() {
    let Some(()) = redis_available() else { return };
    let cluster = RedisCluster::start(3);
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(catalogs::START_MS)));
    let mut options = RedisOptions::new(cluster.urls()[0].clone());
    options.prefix = "sweep:".into();
    options.timeout_ms = 300;
    let store = RedisStore::connect(
        options,
        catalogs::standard(),
        Some(clock.clone()),
        Arc::new(SeededIds::new(9)),
    )
    .await
    .expect("connect");
    let catalog = store.catalog().await.expect("catalog");
    // A tenant whose keys are on another node than the tool's.
    let mut picked = None;
    for t in 0..64 {
        let tenant = format!("t{t}");
        let scopes = catalog
            .scope_set(&tenant, &[("tool", "search")])
            .expect("scopes");
        let id = store
            .reserve(&ReserveRequest::new(
                scopes.clone(),
                search_calls(&catalog, 1),
            ))
            .await
            .expect("reserve")
            .id;
        let tool_node = node_of(&cluster, "sweep:{s*}:s:tool:search").expect("the tool's node");
        let rec_node =
            node_of(&cluster, &format!("sweep:{{t*}}:r:{id}")).expect("the record's node");
        if tool_node != rec_node {
            picked = Some((scopes, id, tool_node));
            break;
        }
        store.refund(id).await.expect("refund");
    }
    let (scopes, id, tool_node) = picked.expect("a tenant on another node than the tool");
    let tool = scopes.as_slice()[1].clone();
    let before = store.status(&tool).await.expect("status").limits[0].used;
    // The tool's node stops running the ledger functions (a stop or a partition would
    // only delay them: Redis runs what it had received once it resumes).
    let node = &cluster.nodes()[tool_node];
    node.command(&["ACL", "SETUSER", "default", "-fcall", "-evalsha", "-eval"])
        .expect("ACL");
    let usage = allowance_core::Usage {
        amounts: search_calls(&catalog, 3),
        ..Default::default()
    };
    let settled = store.settle(id, &usage).await;
    // Still pending: the sweeper cannot finish it while the node refuses.
    clock.advance_ms(3_000);
    assert!(
        store.expire_due().await.is_err(),
        "the sweep reaches the refusing node"
    );
    node.command(&["ACL", "SETUSER", "default", "+fcall", "+evalsha", "+eval"])
        .expect("ACL");
    let settled = settled.expect("the tenant's part commits the settle");
    assert_eq!(settled.status, allowance_core::Status::Settled);
    // Past the pending grace, the sweeper finishes the shared part.
    let mut done = false;
    for _ in 0..50 {
        if store.expire_due().await.is_ok() {
            let st = store.status(&tool).await.expect("status");
            if st.limits[0].used == before + 3 && st.limits[0].held == 0 {
                done = true;
                break;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(done, "the sweeper recorded the shared scope's charges");
    // Finishing again changes nothing (idempotent by id).
    store.expire_due().await.expect("sweep");
    let st = store.status(&tool).await.expect("status");
    assert_eq!(st.limits[0].used, before + 3);
}

/// An extend across slots: a refusal by the shared group changes nothing,
/// a raise reaches both slots, and a new expiry holds in both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cross_slot_extend_is_all_or_nothing() {
    let Some(()) = redis_available() else { return };
    let cluster = RedisCluster::start(3);
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(catalogs::START_MS)));
    let store = OnCluster {
        url: cluster.urls()[0].clone(),
        prefix: "extend:".into(),
    }
    .make(catalogs::standard(), clock.clone())
    .await;
    let catalog = store.catalog().await.expect("catalog");
    let scopes = catalog
        .scope_set("acme", &[("tool", "search")])
        .expect("scopes");
    let tool = scopes.as_slice()[1].clone();
    let mut req = ReserveRequest::new(
        scopes.clone(),
        search_calls(&catalog, 5).with(Dimension::TOKENS, 100),
    );
    req.ttl_ms = Some(10_000);
    let id = store.reserve(&req).await.expect("reserve").id;
    let held =
        |st: &allowance_core::ScopeStatus| st.limits.iter().map(|l| l.held).collect::<Vec<_>>();
    let (tenant_before, tool_before) = (
        held(&store.status(scopes.tenant()).await.expect("status")),
        held(&store.status(&tool).await.expect("status")),
    );
    assert_eq!(tool_before, vec![5]);
    // 5 + 96 > 100 on the tool: refused, and nothing moved on either side.
    let raise = search_calls(&catalog, 96).with(Dimension::TOKENS, 1);
    match store.extend(id, Some(&raise), Some(60_000)).await {
        Err(StoreError::Rejected(allowance_core::ExtendError::Denied(d))) => {
            assert_eq!(d.scope.as_str(), "tool:search", "{d:?}")
        }
        other => panic!("expected the tool's refusal, got {other:?}"),
    }
    assert_eq!(
        held(&store.status(scopes.tenant()).await.expect("status")),
        tenant_before
    );
    assert_eq!(
        held(&store.status(&tool).await.expect("status")),
        tool_before
    );
    // A raise that fits reaches both, and the new expiry holds on both.
    let res = store
        .extend(id, Some(&search_calls(&catalog, 10)), Some(60_000))
        .await
        .expect("extend");
    assert_eq!(held(&store.status(&tool).await.expect("status")), vec![15]);
    clock.advance_ms(30_000); // past the first expiry, before the new one
    assert_eq!(
        store.get(id).await.expect("get").map(|r| r.status),
        Some(allowance_core::Status::Held)
    );
    assert_eq!(held(&store.status(&tool).await.expect("status")), vec![15]);
    clock.set(res.expires_at);
    assert_eq!(
        held(&store.status(&tool).await.expect("status")),
        vec![0],
        "expired in its group too"
    );
}

/// A reservation admitted locally under `fail_open_local` (here: made on
/// an embedded ledger of the same catalog) and settled there is imported
/// into a cluster with its shared scope: the tool's usage is recorded in
/// the tool's own slot, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_records_a_shared_scope_in_its_own_slot() {
    let Some(()) = redis_available() else { return };
    let cluster = RedisCluster::start(3);
    let clock = Arc::new(ManualClock::new(Timestamp::from_millis(catalogs::START_MS)));
    let store = OnCluster {
        url: cluster.urls()[0].clone(),
        prefix: "imported:".into(),
    }
    .make(catalogs::standard(), clock)
    .await;
    let catalog = store.catalog().await.expect("catalog");
    let scopes = catalog
        .scope_set("acme", &[("tool", "search")])
        .expect("scopes");
    let local = allowance_core::SharedLedger::new(catalogs::standard(), 4);
    let now = Timestamp::from_millis(catalogs::START_MS);
    let id = allowance_core::ReservationId::mint(1, "acme");
    local
        .reserve(
            now,
            id,
            &ReserveRequest::new(scopes.clone(), search_calls(&catalog, 3)),
        )
        .expect("granted locally");
    let usage = allowance_core::Usage {
        amounts: search_calls(&catalog, 2),
        ..allowance_core::Usage::default()
    };
    local.settle(now, id, &usage).expect("settled locally");
    let settled = local.get(now, id).expect("the local record");
    store.import_ended(&settled).await.expect("imported");
    store.import_ended(&settled).await.expect("imported again");
    let tool = &scopes.as_slice()[1];
    let st = store.status(tool).await.expect("status");
    let calls = st
        .limits
        .iter()
        .find(|l| l.dimension == "search_calls")
        .expect("the tool's limit");
    assert_eq!((calls.used, calls.held), (2, 0), "{st:?}");
    let imported = store.get(id).await.expect("get").expect("the record");
    assert_eq!(imported.status, allowance_core::Status::Settled);
}
