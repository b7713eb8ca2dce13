//! The Redis store over TLS (`rediss://`) and through Sentinel
//! (`redis+sentinel://`), against real processes from `allowance-testkit`:
//! the conformance suite over each, certificate verification, and a
//! Sentinel failover under a live store.

use std::sync::Arc;
use std::time::{Duration, Instant};

use allowance_conformance::{StoreFactory, cases, catalogs};
use allowance_core::{
    Amounts, Catalog, Dimension, ManualClock, ReservationId, ReserveRequest, SeededIds, Status,
    Store, StoreError, Usage,
};
use allowance_redis::{RedisOptions, RedisStore};
use allowance_testkit::{
    RedisOptions as ServerOptions, RedisSentinel, RedisServer, redis_available,
};

/// The master name the Sentinels monitor.
const MASTER: &str = "allowance-master";
/// The store's bound on every call in the failover test.
const STORE_TIMEOUT_MS: u64 = 500;
/// How long any single store call may take, whatever the servers do.
const CALL_BOUND: Duration = Duration::from_secs(3);
/// How long the Sentinel has to promote the replica.
const PROMOTION: Duration = Duration::from_secs(30);
/// How long the same store has to serve again once the replica is promoted.
const RECOVERY: Duration = Duration::from_secs(20);

/// Stores on `url`, each under its own prefix, on the suite's manual clock.
struct Factory {
    url: String,
    prefix: String,
}

impl StoreFactory for Factory {
    type S = RedisStore;

    async fn make(&self, catalog: Catalog, clock: Arc<ManualClock>) -> RedisStore {
        let mut options = RedisOptions::new(&self.url);
        options.prefix = self.prefix.clone();
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

/// Runs every conformance case against `url`, one after the other, each
/// under its own prefix; returns the names of those that failed.
async fn failing_cases(url: &str) -> Vec<&'static str> {
    let mut failed = Vec::new();
    for (i, case) in cases().into_iter().enumerate() {
        let factory = Factory {
            url: url.to_owned(),
            prefix: format!("c{i}:"),
        };
        let name = case.name;
        // Each case in its own task: a failure is reported, the rest still run.
        if tokio::spawn(async move { case.run_on(&factory).await })
            .await
            .is_err()
        {
            failed.push(name);
        }
    }
    failed
}

fn tls_server() -> RedisServer {
    RedisServer::start_with(ServerOptions {
        tls: true,
        ..ServerOptions::default()
    })
}

/// Runs a blocking testkit call (kill, polls) off the async workers' backs.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_over_tls() {
    let Some(()) = redis_available() else { return };
    let server = tls_server();
    let url = format!("{}#insecure", server.url());
    assert!(url.starts_with("rediss://127.0.0.1:"), "{url}");
    let failed = failing_cases(&url).await;
    assert!(failed.is_empty(), "cases failing over TLS: {failed:?}");
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_verifies_certificates() {
    let Some(()) = redis_available() else { return };
    let server = tls_server();
    let connect = |url: String| async move {
        let mut options = RedisOptions::new(url);
        options.prefix = "verify:".into();
        let connecting = RedisStore::connect(
            options,
            catalogs::standard(),
            None,
            Arc::new(SeededIds::new(7)),
        );
        tokio::time::timeout(Duration::from_secs(10), connecting)
            .await
            .expect("connect gave up within 10 s")
    };

    // The testkit's CA is trusted by nobody: a verified connection fails.
    match connect(server.url()).await {
        Ok(_) => panic!(
            "connected to {} although its CA ({}) is not trusted",
            server.url(),
            server.ca_file().unwrap().display()
        ),
        Err(e) => {
            let text = e.to_string();
            eprintln!("verified connect refused, as it should be: {text}");
            let lower = text.to_lowercase();
            assert!(
                lower.contains("certificate") || lower.contains("tls"),
                "the error does not say why: {text}"
            );
        }
    }

    // The same server without verification: the failure above was the certificate's.
    let store = connect(format!("{}#insecure", server.url()))
        .await
        .unwrap_or_else(|e| panic!("connecting with #insecure: {e}"));
    let catalog = store.catalog().await.expect("catalog");
    let scopes = catalog.scope_set("t1", &[("user", "u1")]).expect("scopes");
    let req = ReserveRequest::new(scopes, Amounts::new().with(Dimension::TOKENS, 10));
    store.reserve(&req).await.expect("a reserve over TLS");
}

/// Set (to a `rediss://` URL without `#insecure`) only in the child process
/// that [`tls_trusts_the_ca_in_ssl_cert_file`] starts.
const VERIFIED_URL_VAR: &str = "ALLOWANCE_TEST_VERIFIED_TLS_URL";
/// What that child prints once it is served over a verified connection.
const VERIFIED_MARK: &str = "verified TLS connection served";

/// The verified path: the test binary again, in a child process whose
/// `SSL_CERT_FILE` is the test CA (the variable must be set before the first
/// TLS connection, and this process may not set its own environment), runs
/// [`verified_tls_in_child`], which connects without `#insecure`.
#[test]
fn tls_trusts_the_ca_in_ssl_cert_file() {
    let Some(()) = redis_available() else { return };
    let server = tls_server();
    let output = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", "verified_tls_in_child", "--nocapture"])
        .env("SSL_CERT_FILE", server.ca_file().expect("a CA"))
        .env(VERIFIED_URL_VAR, server.url())
        .output()
        .expect("running the test binary");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stderr.contains(VERIFIED_MARK),
        "the child ({}) was not served over a verified connection:\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
        output.status
    );
}

/// Does nothing unless started by [`tls_trusts_the_ca_in_ssl_cert_file`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verified_tls_in_child() {
    let Ok(url) = std::env::var(VERIFIED_URL_VAR) else {
        return;
    };
    assert!(!url.contains("#insecure"), "{url}");
    let mut options = RedisOptions::new(&url);
    options.prefix = "verified:".into();
    let connecting = RedisStore::connect(
        options,
        catalogs::standard(),
        None,
        Arc::new(SeededIds::new(8)),
    );
    let store = tokio::time::timeout(Duration::from_secs(10), connecting)
        .await
        .expect("connect gave up within 10 s")
        .unwrap_or_else(|e| panic!("connecting to {url} with SSL_CERT_FILE set: {e}"));
    let catalog = store.catalog().await.expect("catalog");
    let scopes = catalog.scope_set("t1", &[("user", "u1")]).expect("scopes");
    let req = ReserveRequest::new(scopes, tokens(10));
    store
        .reserve(&req)
        .await
        .expect("a reserve over verified TLS");
    eprintln!("{VERIFIED_MARK}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_through_sentinel() {
    let Some(()) = redis_available() else { return };
    let master = RedisServer::start();
    let sentinel = RedisSentinel::start(&master, MASTER);
    let url = sentinel.url(MASTER);
    let failed = failing_cases(&url).await;
    assert!(
        failed.is_empty(),
        "cases failing through Sentinel ({url}): {failed:?}"
    );
    // Everything went to the master.
    let keys = master.command(&["DBSIZE"]).unwrap();
    assert_ne!(keys, "0", "nothing written on the master");
    drop(sentinel);
}

fn tokens(n: u64) -> Amounts {
    Amounts::new().with(Dimension::TOKENS, n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover() {
    let Some(()) = redis_available() else { return };
    let mut master = RedisServer::start();
    let replica = RedisServer::replica_of(&master);
    let sentinel = RedisSentinel::start(&master, MASTER);

    let mut options = RedisOptions::new(sentinel.url(MASTER));
    options.prefix = "failover:".into();
    options.timeout_ms = STORE_TIMEOUT_MS;
    let store = RedisStore::connect(
        options,
        catalogs::standard(),
        None,
        Arc::new(SeededIds::new(0xfa11)),
    )
    .await
    .unwrap_or_else(|e| panic!("connecting through {}: {e}", sentinel.url(MASTER)));
    let catalog = store.catalog().await.expect("catalog");
    let scopes = catalog.scope_set("t1", &[("user", "u1")]).expect("scopes");
    let req = ReserveRequest::new(scopes, tokens(100));
    let usage = Usage {
        amounts: tokens(40),
        ..Usage::default()
    };

    let mut settled: Vec<ReservationId> = Vec::new();
    for _ in 0..3 {
        let id = store.reserve(&req).await.expect("reserve").id;
        let r = store.settle(id, &usage).await.expect("settle");
        assert_eq!(r.status, Status::Settled);
        settled.push(id);
    }
    // The replica must have all of it before the master dies (replication
    // is asynchronous: what it lacks is lost, by design). A `WAIT` on a
    // connection of its own, as this test had, answered at once, and the
    // failover lost a settled reservation now and then under load.
    blocking(|| master.wait_replicated(&replica, Duration::from_secs(10)));

    blocking(|| master.kill9());
    let killed = Instant::now();
    blocking(|| {
        while sentinel.master_port(MASTER) != Some(replica.port()) {
            assert!(
                killed.elapsed() < PROMOTION,
                "the Sentinel did not promote the replica (port {}) within {PROMOTION:?}; it names {:?}",
                replica.port(),
                sentinel.master_port(MASTER)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let promoted = Instant::now();
    // Something answers at the old master's address again, empty and a
    // master (the old one restarted without its data, or another server
    // given the port, as happened in CI): the store must not take it for
    // the master, though a reconnect to the same address would reach it.
    blocking(|| master.restart());

    // The same store serves again, each call bounded, failing only as Unavailable meanwhile.
    let mut failures = 0;
    let id = loop {
        let started = Instant::now();
        let outcome = tokio::time::timeout(CALL_BOUND, store.reserve(&req))
            .await
            .unwrap_or_else(|_| panic!("a reserve hung past {CALL_BOUND:?} after the failover"));
        match outcome {
            Ok(granted) => break granted.id,
            Err(StoreError::Unavailable(e)) => {
                failures += 1;
                assert!(
                    promoted.elapsed() < RECOVERY,
                    "the store did not serve again within {RECOVERY:?} of the promotion; last: {e:?}"
                );
                // A failed call must not eat the sleep the loop needs.
                let spent = started.elapsed();
                tokio::time::sleep(Duration::from_millis(100).saturating_sub(spent)).await;
            }
            Err(other) => panic!("a reserve after the failover failed with {other:?}"),
        }
    };
    eprintln!(
        "served again {:?} after the promotion ({failures} calls failed meanwhile)",
        promoted.elapsed()
    );

    // On the promoted replica, with what was settled before the failover.
    let r = tokio::time::timeout(CALL_BOUND, store.settle(id, &usage))
        .await
        .expect("settle bounded")
        .expect("settle after the failover");
    assert_eq!(r.status, Status::Settled);
    for before in settled {
        let r = tokio::time::timeout(CALL_BOUND, store.get(before))
            .await
            .expect("get bounded")
            .expect("get after the failover")
            .unwrap_or_else(|| panic!("{before} settled before the failover is gone"));
        assert_eq!(r.status, Status::Settled, "{before}");
    }
    let info = blocking(|| replica.command(&["INFO", "replication"])).unwrap();
    assert!(info.contains("role:master"), "{info}");
    // What the store wrote after the failover is on the promoted replica.
    let keys = blocking(|| replica.command(&["KEYS", &format!("failover:*:r:{id}")])).unwrap();
    assert!(
        keys.contains(&id.to_string()),
        "{id} is not on the promoted replica: {keys:?}"
    );
}
