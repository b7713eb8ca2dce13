//! `on_error = "fail_open_local"` end to end: the real binary on a Redis
//! store (its own redis-server, append-only file fsynced on every write),
//! Redis killed and restarted under it.
mod common;

use std::time::{Duration, Instant};

use allowance_testkit::{RedisOptions, RedisServer, redis_available};
use common::*;
use serde_json::{Value, json};

/// Tenants get 1,000 tokens a sliding hour and 200 concurrent; during an
/// outage, a tenth of that per process.
const CONFIG: &str = r#"
[kinds.tenant]
plan = "t"
[plans.t]
limits = [
  { dimension = "tokens", capacity = 1000, window = "sliding", period = "1h", slices = 60 },
  { dimension = "concurrent", capacity = 200 },
]
"#;

/// How long the server has to reconcile once Redis is back.
const RECONCILE_BOUND: Duration = Duration::from_secs(10);

fn reserve_body(tokens: u64) -> Value {
    json!({"tenant": "acme", "amounts": {"tokens": tokens}})
}

async fn tokens_used(s: &Server) -> Option<(i64, i64)> {
    let r = s.get("/v1/scopes/tenant:acme", None).await;
    if r.status != 200 {
        return None;
    }
    let l = &r.json["limits"][0];
    assert_eq!(l["dimension"], "tokens", "{}", r.json);
    Some((l["used"].as_i64()?, l["held"].as_i64()?))
}

/// Redis killed: reserves are admitted (201) up to the emergency limit
/// (1000 × 0.1 tokens), then typed 429s with the scaled figures; settles of
/// them answer 200. Redis restarted: the server's sweeper brings what was
/// settled during the outage into Redis's ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_local_admits_at_most_the_emergency_limits() {
    let Some(()) = redis_available() else { return };
    let mut redis = RedisServer::start_with(RedisOptions {
        appendonly: true,
        appendfsync: "always",
        ..Default::default()
    });
    // A killed Redis refuses connections at once, so the outage is seen
    // without waiting for the timeout; a generous one keeps a slow but
    // live Redis (a loaded CI machine) from failing open before the
    // outage, which would settle the first reservation locally.
    let toml = format!(
        "{CONFIG}\n[store]\nkind = \"redis\"\nurl = \"{}\"\ntimeout_ms = 3000\non_error = \"fail_open_local\"\nfail_open_fraction = 0.1\n",
        redis.url()
    );
    let (_dir, path) = config_file(&toml);
    let path = path.to_string_lossy().to_string();
    let s = Server::serve_args(&["--listen", "127.0.0.1:0", "--config", &path]);
    assert!(
        s.log_text().contains("fail_open_local"),
        "the policy is logged at start-up:\n{}",
        s.log_text()
    );

    // Before the outage, in Redis: 30 tokens.
    let r = s
        .post("/v1/reservations", None, &reserve_body(30))
        .await
        .expect(201);
    let before = r.json["id"].as_str().unwrap().to_string();
    s.post(
        &format!("/v1/reservations/{before}/settle"),
        None,
        &json!({"usage": {"tokens": 30}}),
    )
    .await
    .expect(200);
    assert_eq!(tokens_used(&s).await, Some((30, 0)));

    tokio::task::block_in_place(|| redis.kill9());

    // 100 tokens here: ten reserves of 10, then 429.
    let mut ids = Vec::new();
    for i in 0..10 {
        let t = Instant::now();
        let r = s.post("/v1/reservations", None, &reserve_body(10)).await;
        assert_eq!(r.status, 201, "local reserve #{i}: {}", r.json);
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        ids.push(r.json["id"].as_str().unwrap().to_string());
    }
    let denied = s
        .post("/v1/reservations", None, &reserve_body(10))
        .await
        .expect(429);
    let e = &denied.json["error"];
    assert_eq!(
        (
            &e["scope"],
            &e["dimension"],
            &e["capacity"],
            &e["remaining"]
        ),
        (
            &json!("tenant:acme"),
            &json!("tokens"),
            &json!(100),
            &json!(0)
        ),
        "{}",
        denied.json
    );
    assert!(denied.header("retry-after").is_some());
    // The outage and what it admitted show on /metrics.
    let m = s.get("/metrics", None).await.expect(200);
    let text = m.json.as_str().unwrap_or_default();
    for line in [
        "allowance_store_answering_locally 1",
        "allowance_store_local_admissions_total 10",
        "allowance_store_local_pending 10",
    ] {
        assert!(text.lines().any(|l| l == line), "{line}:\n{text}");
    }

    // Settles of the local reservations answer 200 (7 tokens each), one is refunded.
    for id in &ids[..9] {
        let r = s
            .post(
                &format!("/v1/reservations/{id}/settle"),
                None,
                &json!({"usage": {"tokens": 7}}),
            )
            .await
            .expect(200);
        assert_eq!(r.json["status"], "settled");
    }
    s.post(
        &format!("/v1/reservations/{}/refund", ids[9]),
        None,
        &json!({}),
    )
    .await
    .expect(200);
    let got = s
        .get(&format!("/v1/reservations/{}", ids[0]), None)
        .await
        .expect(200);
    assert_eq!(got.json["status"], "settled");
    // Redis's own ids and the scope status wait for Redis: 503.
    let r = s.get(&format!("/v1/reservations/{before}"), None).await;
    assert_eq!(r.status, 503, "{}", r.json);
    assert_eq!(r.error_type(), "store_unavailable");
    assert_eq!(tokens_used(&s).await, None);

    // Redis back: within a moment the scope shows the outage's usage.
    tokio::task::block_in_place(|| redis.restart());
    let deadline = Instant::now() + RECONCILE_BOUND;
    let expected = (30 + 9 * 7, 0);
    loop {
        let now = tokens_used(&s).await;
        if now == Some(expected) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not reconciled within {RECONCILE_BOUND:?}: {now:?}, expected {expected:?}\n{}",
            s.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The settled reservations answer from Redis, replays included.
    let replay = s
        .post(
            &format!("/v1/reservations/{}/settle", ids[0]),
            None,
            &json!({"usage": {"tokens": 7}}),
        )
        .await
        .expect(200);
    assert_eq!(replay.json["status"], "settled");
    // The usage log has one record for each reservation ended locally.
    let export = s.get("/v1/usage?limit=1000", None).await.expect(200);
    let text = match &export.json {
        Value::String(lines) => lines.clone(),
        one => one.to_string(),
    };
    for id in &ids {
        let records = text.lines().filter(|l| l.contains(id.as_str())).count();
        assert_eq!(records, 1, "usage records of {id}:\n{text}");
    }
    // One warning for the outage, not one per request; one when it ends
    // (after the hand-over: a second of Redis answering the sweeper).
    handed_over(&s).await;
    let log = s.log_text();
    let count = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    assert_eq!(count("admitting locally"), 1, "{log}");
    assert_eq!(count("Redis answers again"), 1, "{log}");
    // The full capacity is Redis's again.
    s.post("/v1/reservations", None, &reserve_body(500))
        .await
        .expect(201);
}

/// Waits until the server logs the end of the outage: Redis has answered
/// its sweeper for the hand-over, and everything held locally is shadowed.
async fn handed_over(s: &Server) {
    let deadline = Instant::now() + RECONCILE_BOUND;
    while !s.log_text().contains("reserves go to Redis again") {
        assert!(
            Instant::now() < deadline,
            "the outage did not end within {RECONCILE_BOUND:?}:\n{}",
            s.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A frozen Redis (SIGSTOP) fails open too: after `timeout_ms` without an
/// answer the local ledger admits, within the server's bound on a store
/// call, and the outage's settle reaches Redis once it runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_fails_open_within_the_store_timeout() {
    let Some(()) = redis_available() else { return };
    let redis = RedisServer::start();
    let toml = format!(
        "{CONFIG}\n[store]\nkind = \"redis\"\nurl = \"{}\"\ntimeout_ms = 300\non_error = \"fail_open_local\"\n",
        redis.url()
    );
    let (_dir, path) = config_file(&toml);
    let path = path.to_string_lossy().to_string();
    let s = Server::serve_args(&["--listen", "127.0.0.1:0", "--config", &path]);
    s.post("/v1/reservations", None, &reserve_body(1))
        .await
        .expect(201);

    tokio::task::block_in_place(|| redis.stop());
    let t = Instant::now();
    let r = s
        .post("/v1/reservations", None, &reserve_body(100))
        .await
        .expect(201);
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "admitted after {:?}",
        t.elapsed()
    );
    let id = r.json["id"].as_str().unwrap().to_string();
    // The default fraction is 0.1 too: the local 100 are all held.
    let denied = s
        .post("/v1/reservations", None, &reserve_body(1))
        .await
        .expect(429);
    assert_eq!(denied.json["error"]["capacity"], 100, "{}", denied.json);
    s.post(
        &format!("/v1/reservations/{id}/settle"),
        None,
        &json!({"usage": {"tokens": 60}}),
    )
    .await
    .expect(200);

    tokio::task::block_in_place(|| redis.cont());
    let deadline = Instant::now() + RECONCILE_BOUND;
    loop {
        // The frozen Redis still ran the reserves it had been sent once it
        // woke (holds until their TTL): only `used` is compared.
        let used = tokens_used(&s).await.map(|(used, _)| used);
        if used == Some(60) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not reconciled within {RECONCILE_BOUND:?}: {used:?}\n{}",
            s.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Started while Redis is down: under `fail_closed` the server refuses to
/// start and says why (a wrong address is found at once, not by the first
/// request); under `fail_open_local` it starts, admits locally, and once
/// Redis comes its sweeper connects and brings in what was settled
/// meanwhile — a restart during an outage does not take the service down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_local_starts_while_redis_is_down() {
    let Some(()) = redis_available() else { return };
    let mut redis = RedisServer::start_with(RedisOptions {
        appendonly: true,
        appendfsync: "always",
        ..Default::default()
    });
    let url = redis.url();
    tokio::task::block_in_place(|| redis.kill9());

    let closed = format!(
        "{CONFIG}\n[store]\nkind = \"redis\"\nurl = \"{url}\"\ntimeout_ms = 500\non_error = \"fail_closed\"\n"
    );
    let (_closed_dir, closed) = config_file(&closed);
    let closed = closed.to_string_lossy().to_string();
    match serve_until_exit(
        &["--listen", "127.0.0.1:0", "--config", &closed],
        Duration::from_secs(30),
    ) {
        Startup::Exited { status, stderr } => {
            assert!(!status.success(), "{stderr}");
            assert!(
                stderr.contains("cannot start the redis store")
                    && stderr.contains("cannot reach Redis"),
                "the error should say Redis cannot be reached:\n{stderr}"
            );
        }
        other => panic!("fail_closed should refuse to start without Redis: {other:?}"),
    }

    let open = format!(
        "{CONFIG}\n[store]\nkind = \"redis\"\nurl = \"{url}\"\ntimeout_ms = 500\non_error = \"fail_open_local\"\n"
    );
    let (_open_dir, open) = config_file(&open);
    let open = open.to_string_lossy().to_string();
    let s = Server::serve_args(&["--listen", "127.0.0.1:0", "--config", &open]);
    assert!(
        s.log_text().contains("starting anyway"),
        "the start without Redis is logged:\n{}",
        s.log_text()
    );
    let r = s
        .post("/v1/reservations", None, &reserve_body(30))
        .await
        .expect(201);
    let id = r.json["id"].as_str().unwrap().to_string();
    s.post(
        &format!("/v1/reservations/{id}/settle"),
        None,
        &json!({"usage": {"tokens": 20}}),
    )
    .await
    .expect(200);
    // Scope status is Redis's only, and the store is not ready.
    assert_eq!(tokens_used(&s).await, None);
    assert_eq!(s.get("/readyz", None).await.status, 503);
    let denied = s
        .post("/v1/reservations", None, &reserve_body(100))
        .await
        .expect(429);
    assert_eq!(denied.json["error"]["capacity"], 100, "{}", denied.json);

    tokio::task::block_in_place(|| redis.restart());
    let deadline = Instant::now() + RECONCILE_BOUND;
    loop {
        let used = tokens_used(&s).await;
        if used == Some((20, 0)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not connected and reconciled within {RECONCILE_BOUND:?}: {used:?}\n{}",
            s.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.get("/readyz", None).await.expect(200);
    // Redis admits from now on (the outage handed over): the full 1,000
    // tokens, not the local 100.
    handed_over(&s).await;
    s.post("/v1/reservations", None, &reserve_body(500))
        .await
        .expect(201);
    assert_eq!(tokens_used(&s).await, Some((20, 500)));
}
