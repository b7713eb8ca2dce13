//! The conformance suite against the durable store: every rule of
//! SEMANTICS.md holds through the write-ahead log, and holds across
//! restarts — the store is closed and reopened (recovered from its data dir
//! by replay) between operations, and the engine's invariants are checked
//! after every operation.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use allowance_conformance::{StoreFactory, cases, run_all, run_case};
use allowance_core::{
    AdminError, Amounts, Catalog, CatalogChange, Clock, Dimension, ExtendError, Granted,
    ManualClock, RefundError, Reservation, ReservationId, ReserveError, ReserveRequest, ScopeKey,
    ScopeStatus, SeededIds, SettleError, Store, StoreError, StoreStats, Unavailable, Usage,
    UsagePage,
};
use allowance_durable::{DurableOptions, DurableStore};
use allowance_wal::{Fsync, RealFs};
use tokio::sync::RwLock;

/// Durable stores of `shards` shards, reopened every `reopen_every`
/// operations (0: never).
struct Durable {
    shards: usize,
    reopen_every: u64,
}

impl StoreFactory for Durable {
    type S = Reopening;

    async fn make(&self, catalog: Catalog, clock: Arc<ManualClock>) -> Reopening {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut opts = DurableOptions::new(dir.path());
        opts.shards = self.shards;
        // The suite checks semantics, not durability against power loss.
        opts.wal.fsync = Fsync::Never;
        // Snapshots now and then, so recovery starts from one too.
        opts.snapshot_every_records = 5;
        let ids = Arc::new(SeededIds::new(0x00c0_ffee ^ self.shards as u64));
        let store = open(&catalog, &opts, &clock, &ids).await;
        Reopening {
            store: RwLock::new(store),
            catalog,
            opts,
            clock,
            ids,
            ops: AtomicU64::new(0),
            reopen_every: self.reopen_every,
            _dir: dir,
        }
    }
}

async fn open(
    catalog: &Catalog,
    opts: &DurableOptions,
    clock: &Arc<ManualClock>,
    ids: &Arc<SeededIds>,
) -> DurableStore {
    let (store, report) = DurableStore::open(
        catalog.clone(),
        opts.clone(),
        Arc::new(RealFs),
        clock.clone(),
        ids.clone(),
        |_| {},
    )
    .await
    .expect("open the data dir");
    assert!(
        report.divergences.is_empty(),
        "replay diverged: {:?}",
        report.divergences
    );
    store
}

/// The durable store, closed and reopened every few operations, checking the
/// engine's invariants after every operation.
struct Reopening {
    store: RwLock<DurableStore>,
    catalog: Catalog,
    opts: DurableOptions,
    clock: Arc<ManualClock>,
    ids: Arc<SeededIds>,
    ops: AtomicU64,
    reopen_every: u64,
    _dir: tempfile::TempDir,
}

impl Reopening {
    async fn current(&self) -> DurableStore {
        self.store.read().await.clone()
    }

    async fn check<T>(&self, answer: T) -> T {
        let store = self.current().await;
        let checked = store.with_ledger(|l| l.check_invariants(self.clock.now()));
        if let Some(Err(e)) = checked {
            panic!("an engine invariant broke: {e}");
        }
        let n = self.ops.fetch_add(1, Ordering::SeqCst) + 1;
        if self.reopen_every > 0 && n.is_multiple_of(self.reopen_every) {
            let mut slot = self.store.write().await;
            slot.clone().close().await.expect("close");
            *slot = open(&self.catalog, &self.opts, &self.clock, &self.ids).await;
        }
        answer
    }
}

#[async_trait::async_trait]
impl Store for Reopening {
    async fn reserve(&self, req: &ReserveRequest) -> Result<Granted, StoreError<ReserveError>> {
        let a = self.store.read().await.reserve(req).await;
        self.check(a).await
    }

    async fn settle(
        &self,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<Reservation, StoreError<SettleError>> {
        let a = self.store.read().await.settle(id, usage).await;
        self.check(a).await
    }

    async fn refund(&self, id: ReservationId) -> Result<Reservation, StoreError<RefundError>> {
        let a = self.store.read().await.refund(id).await;
        self.check(a).await
    }

    async fn extend(
        &self,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Result<Reservation, StoreError<ExtendError>> {
        let a = self.store.read().await.extend(id, amounts, ttl_ms).await;
        self.check(a).await
    }

    async fn get(&self, id: ReservationId) -> Result<Option<Reservation>, Unavailable> {
        let a = self.store.read().await.get(id).await;
        self.check(a).await
    }

    async fn status(&self, scope: &ScopeKey) -> Result<ScopeStatus, Unavailable> {
        let a = self.store.read().await.status(scope).await;
        self.check(a).await
    }

    async fn adjust(
        &self,
        scope: &ScopeKey,
        dimension: Dimension,
        credit: i64,
        reason: &str,
    ) -> Result<ScopeStatus, StoreError<AdminError>> {
        let a = self
            .store
            .read()
            .await
            .adjust(scope, dimension, credit, reason)
            .await;
        self.check(a).await
    }

    async fn catalog(&self) -> Result<Arc<Catalog>, Unavailable> {
        self.store.read().await.catalog().await
    }

    async fn change_catalog(&self, change: &CatalogChange) -> Result<(), StoreError<AdminError>> {
        let a = self.store.read().await.change_catalog(change).await;
        self.check(a).await
    }

    async fn expire_due(&self) -> Result<u64, Unavailable> {
        let a = self.store.read().await.expire_due().await;
        self.check(a).await
    }

    async fn stats(&self) -> Result<StoreStats, Unavailable> {
        let a = self.store.read().await.stats().await;
        self.check(a).await
    }

    async fn usage(
        &self,
        since: Option<u64>,
        limit: usize,
        tenant: Option<&str>,
    ) -> Result<UsagePage, Unavailable> {
        self.store.read().await.usage(since, limit, tenant).await
    }
}

/// One `#[tokio::test]` per case: on one shard as is, and on sixteen shards
/// closed and reopened (replayed from disk) every third operation. The list must name every
/// case: `every_case_has_a_test` fails otherwise.
macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        const TESTED: &[&str] = &[$(stringify!($case)),*];

        mod one_shard {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    run_case(&Durable { shards: 1, reopen_every: 0 }, stringify!($case)).await;
                }
            )*
        }

        mod sixteen_shards_reopened {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    run_case(&Durable { shards: 16, reopen_every: 3 }, stringify!($case)).await;
                }
            )*
        }
    };
}

allowance_conformance::every_case!(conformance);

/// No case is left without its own test, and no test names a case that
/// does not exist.
#[test]
fn every_case_has_a_test() {
    let listed: BTreeSet<&str> = cases().iter().map(|c| c.name).collect();
    let tested: BTreeSet<&str> = TESTED.iter().copied().collect();
    assert_eq!(listed, tested);
    assert_eq!(listed.len(), cases().len(), "case names are unique");
}

/// The whole suite in one go on 4 shards, reopened after every operation:
/// every state a case reaches survives a restart exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_all_reopened_after_every_operation() {
    run_all(&Durable {
        shards: 4,
        reopen_every: 1,
    })
    .await;
}
