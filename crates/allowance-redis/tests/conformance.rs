//! The conformance suite against the Redis store on a single node: every
//! case on its own redis-server (started by the test, on a free port), the
//! store reading the suite's manual clock instead of Redis `TIME`.

use std::collections::BTreeSet;
use std::sync::Arc;

use allowance_conformance::{StoreFactory, cases, run_case};
use allowance_core::{Catalog, ManualClock, SeededIds};
use allowance_redis::{RedisOptions, RedisStore};
use allowance_testkit::{RedisServer, redis_available};

struct OnRedis {
    url: String,
}

impl StoreFactory for OnRedis {
    type S = RedisStore;

    async fn make(&self, catalog: Catalog, clock: Arc<ManualClock>) -> RedisStore {
        let mut options = RedisOptions::new(&self.url);
        options.prefix = "conformance:".into();
        RedisStore::connect(
            options,
            catalog,
            Some(clock),
            Arc::new(SeededIds::new(0x5eed)),
        )
        .await
        .unwrap_or_else(|e| panic!("connecting to {}: {e}", self.url))
    }
}

macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        const TESTED: &[&str] = &[$(stringify!($case)),*];

        mod single_node {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let Some(()) = redis_available() else { return };
                    let server = RedisServer::start();
                    run_case(&OnRedis { url: server.url() }, stringify!($case)).await;
                    drop(server);
                }
            )*
        }
    };
}

allowance_conformance::every_case!(conformance);

#[test]
fn every_case_has_a_test() {
    let listed: BTreeSet<&str> = cases().iter().map(|c| c.name).collect();
    let tested: BTreeSet<&str> = TESTED.iter().copied().collect();
    assert_eq!(listed, tested);
}
