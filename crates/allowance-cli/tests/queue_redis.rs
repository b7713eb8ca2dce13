//! The admission queue across two `allowance serve` processes sharing one
//! Redis: a settle on one server admits a waiter on the other, told by the
//! scripts' `freed` message or, without it, found by the bounded re-check
//! (`RECHECK`). Each test starts its own redis-server.
mod common;

use std::time::{Duration, Instant};

use allowance_server::RECHECK;
use allowance_testkit::{RedisServer, redis_available};
use common::*;
use serde_json::{Value, json};

/// Tenants with one reservation at a time.
const ONE_AT_A_TIME: &str = r#"
[kinds.tenant]
plan = "one"
[plans.one]
limits = [{ dimension = "concurrent", capacity = 1 }]
"#;

/// `allowance serve` on the plan above, over Redis at `url`.
fn server(url: &str) -> (tempfile::TempDir, Server) {
    let toml = format!("{ONE_AT_A_TIME}\n[store]\nkind = \"redis\"\nurl = \"{url}\"\n");
    let (dir, path) = config_file(&toml);
    let path = path.to_string_lossy().to_string();
    let server = Server::serve_args(&["--listen", "127.0.0.1:0", "--config", &path]);
    (dir, server)
}

/// Subscribers to the servers' `freed` channel (default prefix).
fn freed_subscribers(redis: &RedisServer) -> String {
    redis
        .command(&["PUBSUB", "NUMSUB", "allowance:freed"])
        .expect("PUBSUB NUMSUB")
}

/// Waits (bounded) until `n` servers listen for `freed` messages.
fn until_subscribers(redis: &RedisServer, n: u32) {
    let started = Instant::now();
    while !freed_subscribers(redis).ends_with(&n.to_string()) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "freed subscribers: {} (expected {n})",
            freed_subscribers(redis)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Holds acme's one slot on `a`, queues a waiter on `b`, settles on `a`:
/// returns how long after the settle's answer `b` admitted its waiter.
async fn settle_on_a_admits_on_b(a: &Server, b: &Server) -> Duration {
    let hold = a
        .post(
            "/v1/reservations",
            None,
            &json!({"tenant": "acme", "amounts": {}}),
        )
        .await
        .expect(201);
    let id = hold.json["id"].as_str().expect("an id").to_string();

    let waiter = {
        let req = b
            .client
            .post(b.url("/v1/reservations"))
            .json(&json!({"tenant": "acme", "amounts": {}, "wait_ms": 5_000}));
        tokio::spawn(async move {
            let resp = req.send().await.expect("B answers");
            let status = resp.status().as_u16();
            let body: Value = resp.json().await.expect("a JSON body");
            (status, body, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "B answered with no room");

    a.post(
        &format!("/v1/reservations/{id}/settle"),
        None,
        &json!({"usage": {}}),
    )
    .await
    .expect(200);
    let settled = Instant::now();
    let (status, body, at) = waiter.await.expect("the waiter's task");
    assert_eq!(status, 201, "{body}");
    let after = at.saturating_duration_since(settled);

    // Settled on A (the server B may lack permissions A has).
    let id = body["id"].as_str().expect("an id");
    a.post(
        &format!("/v1/reservations/{id}/settle"),
        None,
        &json!({"usage": {}}),
    )
    .await
    .expect(200);
    for s in [a, b] {
        let st = s.get("/v1/scopes/tenant:acme", None).await.expect(200);
        assert_eq!(st.json["held_reservations"], 0, "{}", st.json);
    }
    after
}

/// A waiter on B is admitted when a settle on A frees the room, within the
/// re-check bound (plus a generous second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_on_one_server_admits_a_waiter_on_the_other() {
    let Some(()) = redis_available() else { return };
    let redis = RedisServer::start();
    let (_da, a) = server(&redis.url());
    let (_db, b) = server(&redis.url());
    until_subscribers(&redis, 2);
    let after = settle_on_a_admits_on_b(&a, &b).await;
    let bound = RECHECK + Duration::from_secs(1);
    assert!(
        after < bound,
        "admitted on B {after:?} after the settle on A (bound {bound:?})"
    );
}

/// B is not told of A's settle (its Redis user may not subscribe, so it
/// never hears the `freed` message): the bounded re-check finds the room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_freed_message_the_recheck_finds_the_room() {
    let Some(()) = redis_available() else { return };
    let redis = RedisServer::start();
    // Everything but pub/sub channels.
    redis
        .command(&[
            "ACL",
            "SETUSER",
            "deaf",
            "on",
            ">deaf-password",
            "~*",
            "resetchannels",
            "+@all",
        ])
        .expect("ACL SETUSER");
    let deaf_url = format!("redis://deaf:deaf-password@127.0.0.1:{}/0", redis.port());
    let (_da, a) = server(&redis.url());
    let (_db, b) = server(&deaf_url);
    until_subscribers(&redis, 1);
    // B keeps failing to subscribe: still only A listens.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(
        freed_subscribers(&redis).ends_with('1'),
        "{}",
        freed_subscribers(&redis)
    );
    let after = settle_on_a_admits_on_b(&a, &b).await;
    let bound = RECHECK + Duration::from_secs(1);
    assert!(
        after < bound,
        "admitted on B {after:?} after the settle on A (bound {bound:?})"
    );
}
