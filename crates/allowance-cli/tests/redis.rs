//! Two `allowance serve` processes sharing one Redis: one ledger, whichever
//! instance a request reaches. Each test starts its own redis-server.
mod common;

use std::time::{Duration, Instant};

use allowance_testkit::{RedisServer, redis_available};
use common::*;
use serde_json::{Value, json};
use tokio::task::JoinSet;

/// A config on `redis`, and two servers started from it.
fn pair(redis: &RedisServer, extra: &str) -> (tempfile::TempDir, Server, Server) {
    let toml = format!(
        "{RACE_CONFIG}\n[store]\nkind = \"redis\"\nurl = \"{}\"\ntimeout_ms = 300\n{extra}",
        redis.url()
    );
    let (dir, path) = config_file(&toml);
    let path = path.to_string_lossy().to_string();
    let args = ["--listen", "127.0.0.1:0", "--config", &path];
    (dir, Server::serve_args(&args), Server::serve_args(&args))
}

/// `n` reserves at once, alternating between the two servers.
async fn simultaneous(servers: [&Server; 2], n: usize, body: Value) -> Vec<u16> {
    let mut set = JoinSet::new();
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n));
    for i in 0..n {
        let s = servers[i % 2];
        let (client, url, body, barrier) = (
            s.client.clone(),
            s.url("/v1/reservations"),
            body.clone(),
            barrier.clone(),
        );
        set.spawn(async move {
            barrier.wait().await;
            let r = client.post(url).json(&body).send().await.expect("request");
            r.status().as_u16()
        });
    }
    set.join_all().await
}

/// Seed 002 split across two instances: exactly as many admitted as fit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_002_race_across_two_instances() {
    let Some(()) = redis_available() else { return };
    let redis = RedisServer::start();
    let (_dir, a, b) = pair(&redis, "");
    let task =
        json!({"tenant": "acme", "scopes": {"user": "eve"}, "amounts": {"cost_micros": 4_450_000}});
    let statuses = simultaneous([&a, &b], 40, task).await;
    let admitted = statuses.iter().filter(|&&s| s == 201).count();
    let denied = statuses.iter().filter(|&&s| s == 429).count();
    assert_eq!((admitted, denied), (4, 36), "{statuses:?}");
    for s in [&a, &b] {
        let st = s
            .get("/v1/scopes/tenant:acme/user:eve", None)
            .await
            .expect(200);
        let cost = &st.json["limits"][0];
        assert_eq!(
            (&cost["held"], &cost["remaining"]),
            (&json!(17_800_000), &json!(2_200_000)),
            "both instances see the same holds"
        );
    }
}

/// A reservation made on one instance is settled on the other, replays
/// are idempotent on both, and a refund after the settle conflicts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_on_one_settle_on_the_other() {
    let Some(()) = redis_available() else { return };
    let redis = RedisServer::start();
    let (_dir, a, b) = pair(&redis, "");
    let r = a
        .post(
            "/v1/reservations",
            None,
            &json!({"tenant": "acme", "scopes": {"user": "ann"}, "amounts": {"cost_micros": 5_000_000}}),
        )
        .await
        .expect(201);
    let id = r.json["id"].as_str().unwrap().to_string();
    let settle = json!({"usage": {"cost_micros": 3_000_000}});
    let path = format!("/v1/reservations/{id}/settle");
    let first = b.post(&path, None, &settle).await.expect(200);
    assert_eq!(first.json["status"], "settled");
    let again = a.post(&path, None, &settle).await.expect(200);
    assert_eq!(again.json["charged"], first.json["charged"]);
    let got = a
        .get(&format!("/v1/reservations/{id}"), None)
        .await
        .expect(200);
    assert_eq!(got.json["status"], "settled");
    let refund = b
        .post(&format!("/v1/reservations/{id}/refund"), None, &json!({}))
        .await;
    assert_eq!(refund.status, 409, "{:?}", refund.json);
    let st = b
        .get("/v1/scopes/tenant:acme/user:ann", None)
        .await
        .expect(200);
    assert_eq!(st.json["limits"][0]["used"], 3_000_000);
    assert_eq!(st.json["limits"][0]["held"], 0);
}

/// The same idempotency key on both instances names one reservation; a
/// different request under it conflicts on either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_replays_across_instances() {
    let Some(()) = redis_available() else { return };
    let redis = RedisServer::start();
    let (_dir, a, b) = pair(&redis, "");
    let body = json!({"tenant": "acme", "scopes": {"user": "ivy"}, "amounts": {"cost_micros": 1_000},
        "idempotency_key": "call-7"});
    let first = a.post("/v1/reservations", None, &body).await.expect(201);
    let replay = b.post("/v1/reservations", None, &body).await;
    assert!(
        replay.status == 200 || replay.status == 201,
        "{:?}",
        replay.json
    );
    assert_eq!(replay.json["id"], first.json["id"]);
    let mut other = body.clone();
    other["amounts"]["cost_micros"] = json!(2_000);
    let conflict = b.post("/v1/reservations", None, &other).await;
    assert_eq!(conflict.status, 409, "{:?}", conflict.json);
    let st = a
        .get("/v1/scopes/tenant:acme/user:ivy", None)
        .await
        .expect(200);
    assert_eq!(st.json["limits"][0]["held"], 1_000, "one hold, not two");
}

/// An override set through one instance's admin API binds on the other
/// by its next operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_change_applies_on_every_instance() {
    let Some(()) = redis_available() else { return };
    let redis = RedisServer::start();
    let (_dir, a, b) = pair(&redis, "");
    a.put(
        "/v1/scopes/tenant:acme/user:gus",
        None,
        &json!({"plan": "gauge"}),
    )
    .await
    .expect(200);
    let body = json!({"tenant": "acme", "scopes": {"user": "gus"}, "amounts": {"input_tokens": 1}});
    for _ in 0..4 {
        b.post("/v1/reservations", None, &body).await.expect(201);
    }
    let fifth = b.post("/v1/reservations", None, &body).await;
    assert_eq!(
        fifth.status, 429,
        "the gauge of 4 set on A binds on B: {:?}",
        fifth.json
    );
    let st = b
        .get("/v1/scopes/tenant:acme/user:gus", None)
        .await
        .expect(200);
    assert_eq!(st.json["plan"], "gauge");
}

/// Redis gone: fail_closed answers 503 store_unavailable within the store
/// timeout (300 ms here; bounded generously), and serves again once
/// Redis is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_answers_503_then_recovers() {
    let Some(()) = redis_available() else { return };
    let mut redis = RedisServer::start();
    let (_dir, a, _b) = pair(&redis, "");
    let body = json!({"tenant": "acme", "scopes": {"user": "dan"}, "amounts": {"cost_micros": 1}});
    a.post("/v1/reservations", None, &body).await.expect(201);
    redis.kill9();
    for _ in 0..3 {
        let t = Instant::now();
        let r = a.post("/v1/reservations", None, &body).await;
        assert_eq!(r.status, 503, "{:?}", r.json);
        assert_eq!(r.error_type(), "store_unavailable");
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "no hang: {:?}",
            t.elapsed()
        );
    }
    // The outage shows in the metrics without client traffic too: the
    // sweeper's and /readyz's failed calls count as store errors.
    a.get("/readyz", None).await.expect(503);
    let counted = |text: &str, op: &str| -> u64 {
        let prefix = format!("allowance_store_errors_total{{op=\"{op}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let m = a.get("/metrics", None).await.expect(200);
        let text = m.json.as_str().unwrap_or_default().to_string();
        if counted(&text, "expire") >= 1 {
            assert_eq!(counted(&text, "reserve"), 3, "{text}");
            assert_eq!(counted(&text, "ready"), 1, "{text}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no sweep failure counted:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = a.post("/v1/reservations", None, &body).await;
        if r.status == 201 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still {} after Redis returned",
            r.status
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
