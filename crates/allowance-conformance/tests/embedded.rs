//! The conformance suite against the embedded store, with 1 and 16 shards
//! (one test per case and shard count, so a failure names both), and the
//! engine's own invariants checked after every operation a case makes.

use std::collections::BTreeSet;
use std::sync::Arc;

use allowance_conformance::{StoreFactory, cases, run_all, run_case};
use allowance_core::{
    AdminError, Amounts, Catalog, CatalogChange, Clock, Dimension, EmbeddedStore, ExtendError,
    Granted, ManualClock, RefundError, Reservation, ReservationId, ReserveError, ReserveRequest,
    ScopeKey, ScopeStatus, SeededIds, SettleError, Store, StoreError, StoreStats, Unavailable,
    Usage, UsagePage,
};

/// Embedded stores of `shards` shards with deterministic ids.
struct Embedded {
    shards: usize,
}

impl StoreFactory for Embedded {
    type S = Checked;

    async fn make(&self, catalog: Catalog, clock: Arc<ManualClock>) -> Checked {
        let ids = Arc::new(SeededIds::new(0x00c0_ffee ^ self.shards as u64));
        Checked {
            inner: EmbeddedStore::new(catalog, self.shards, clock.clone(), ids),
            clock,
        }
    }
}

/// The embedded store, checking SEMANTICS.md's invariants (held = the sum of
/// live holds, on every shard and across shards) after every operation.
struct Checked {
    inner: EmbeddedStore,
    clock: Arc<ManualClock>,
}

impl Checked {
    fn check<T>(&self, answer: T) -> T {
        if let Err(e) = self.inner.ledger().check_invariants(self.clock.now()) {
            panic!("an engine invariant broke: {e}");
        }
        answer
    }
}

#[async_trait::async_trait]
impl Store for Checked {
    async fn reserve(&self, req: &ReserveRequest) -> Result<Granted, StoreError<ReserveError>> {
        let a = self.inner.reserve(req).await;
        self.check(a)
    }

    async fn settle(
        &self,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<Reservation, StoreError<SettleError>> {
        let a = self.inner.settle(id, usage).await;
        self.check(a)
    }

    async fn refund(&self, id: ReservationId) -> Result<Reservation, StoreError<RefundError>> {
        let a = self.inner.refund(id).await;
        self.check(a)
    }

    async fn extend(
        &self,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Result<Reservation, StoreError<ExtendError>> {
        let a = self.inner.extend(id, amounts, ttl_ms).await;
        self.check(a)
    }

    async fn get(&self, id: ReservationId) -> Result<Option<Reservation>, Unavailable> {
        let a = self.inner.get(id).await;
        self.check(a)
    }

    async fn status(&self, scope: &ScopeKey) -> Result<ScopeStatus, Unavailable> {
        let a = self.inner.status(scope).await;
        self.check(a)
    }

    async fn adjust(
        &self,
        scope: &ScopeKey,
        dimension: Dimension,
        credit: i64,
        reason: &str,
    ) -> Result<ScopeStatus, StoreError<AdminError>> {
        let a = self.inner.adjust(scope, dimension, credit, reason).await;
        self.check(a)
    }

    async fn catalog(&self) -> Result<Arc<Catalog>, Unavailable> {
        self.inner.catalog().await
    }

    async fn change_catalog(&self, change: &CatalogChange) -> Result<(), StoreError<AdminError>> {
        let a = self.inner.change_catalog(change).await;
        self.check(a)
    }

    async fn expire_due(&self) -> Result<u64, Unavailable> {
        let a = self.inner.expire_due().await;
        self.check(a)
    }

    async fn stats(&self) -> Result<StoreStats, Unavailable> {
        let a = self.inner.stats().await;
        self.check(a)
    }

    async fn usage(
        &self,
        since: Option<u64>,
        limit: usize,
        tenant: Option<&str>,
    ) -> Result<UsagePage, Unavailable> {
        self.inner.usage(since, limit, tenant).await
    }
}

/// One `#[tokio::test]` per case and shard count. The list must name every
/// case: `every_case_has_a_test` fails otherwise.
macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        const TESTED: &[&str] = &[$(stringify!($case)),*];

        mod one_shard {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    run_case(&Embedded { shards: 1 }, stringify!($case)).await;
                }
            )*
        }

        mod sixteen_shards {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    run_case(&Embedded { shards: 16 }, stringify!($case)).await;
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

/// `run_all` runs the whole suite in one go (here on 4 shards, a count the
/// per-case tests do not use).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_all_on_four_shards() {
    run_all(&Embedded { shards: 4 }).await;
}
