//! Races over HTTP: many simultaneous clients never overspend, and settles
//! add up; graceful shutdown finishes what it accepted.
mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use tokio::task::JoinSet;

/// Fires `n` identical reserves at once; returns the answers.
async fn simultaneous(s: &Server, n: usize, body: Value) -> Vec<Reply> {
    let mut set = JoinSet::new();
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n));
    for _ in 0..n {
        let client = s.client.clone();
        let url = s.url("/v1/reservations");
        let body = body.clone();
        let barrier = barrier.clone();
        set.spawn(async move {
            barrier.wait().await;
            let r = client.post(url).json(&body).send().await.expect("request");
            let status = r.status().as_u16();
            let headers = r.headers().clone();
            let json: Value = r.json().await.expect("json");
            Reply {
                status,
                headers,
                json,
            }
        });
    }
    set.join_all().await
}

fn count(replies: &[Reply], status: u16) -> usize {
    replies.iter().filter(|r| r.status == status).count()
}

/// Seed 002: a €20 daily cap and forty tasks of €4.45 starting in the same
/// instant. Check-then-act would admit all forty; the ledger admits
/// exactly as many as fit.
#[tokio::test]
async fn seed_002_forty_simultaneous_reserves() {
    let s = Server::with_config(RACE_CONFIG);
    let task =
        json!({"tenant": "acme", "scopes": {"user": "eve"}, "amounts": {"cost_micros": 4_450_000}});
    let replies = simultaneous(&s, 40, task.clone()).await;
    assert_eq!(count(&replies, 201), 4, "4 × 4.45 fit in 20, 5 do not");
    assert_eq!(count(&replies, 429), 36);
    assert!(replies.iter().all(|r| r.status == 201 || r.status == 429));
    let st = s
        .get("/v1/scopes/tenant:acme/user:eve", None)
        .await
        .expect(200);
    let cost = &st.json["limits"][0];
    assert_eq!(
        (&cost["held"], &cost["remaining"]),
        (&json!(17_800_000), &json!(2_200_000))
    );

    // The seed's figures: a user already at €18.10 admits none of forty.
    let spent = s
        .post(
            "/v1/reservations",
            None,
            &json!({"tenant": "acme", "scopes": {"user": "sam"}, "amounts": {"cost_micros": 18_100_000}}),
        )
        .await
        .expect(201);
    let id = spent.json["id"].as_str().unwrap();
    s.post(
        &format!("/v1/reservations/{id}/settle"),
        None,
        &json!({"usage": {"cost_micros": 18_100_000}}),
    )
    .await
    .expect(200);
    let mut sam = task.clone();
    sam["scopes"]["user"] = json!("sam");
    let replies = simultaneous(&s, 40, sam).await;
    assert_eq!(
        count(&replies, 201),
        0,
        "€18.10 + €4.45 > €20: none may start"
    );
    assert_eq!(count(&replies, 429), 40);
}

/// A concurrency gauge of 4 and forty simultaneous reserves: exactly 4.
#[tokio::test]
async fn concurrency_gauge_race() {
    let s = Server::with_config(RACE_CONFIG);
    s.put(
        "/v1/scopes/tenant:acme/user:gus",
        None,
        &json!({"plan": "gauge"}),
    )
    .await
    .expect(200);
    let body = json!({"tenant": "acme", "scopes": {"user": "gus"}, "amounts": {"input_tokens": 1}});
    for round in 0..3 {
        let replies = simultaneous(&s, 40, body.clone()).await;
        assert_eq!(count(&replies, 201), 4, "round {round}");
        assert_eq!(count(&replies, 429), 36, "round {round}");
        // Settle the admitted ones: the gauge is free again.
        for r in replies.iter().filter(|r| r.status == 201) {
            let id = r.json["id"].as_str().unwrap();
            s.post(
                &format!("/v1/reservations/{id}/settle"),
                None,
                &json!({"usage": {}}),
            )
            .await
            .expect(200);
        }
    }
}

/// Many clients reserve and settle at once, some settles repeated: the
/// scope's usage is exactly the sum of what the answers say was charged.
#[tokio::test]
async fn racing_settles_add_up() {
    let s = Server::with_config(RACE_CONFIG);
    let mut set = JoinSet::new();
    for worker in 0..16u64 {
        let client = s.client.clone();
        let base = s.base.clone();
        set.spawn(async move {
            let mut charged = 0u64;
            for i in 0..20u64 {
                let body = json!({"tenant": "acme", "scopes": {"user": "pool"},
                                  "amounts": {"cost_micros": 10_000}});
                let r = client
                    .post(format!("{base}/v1/reservations"))
                    .json(&body)
                    .send()
                    .await
                    .expect("reserve");
                assert_eq!(r.status(), 201);
                let v: Value = r.json().await.expect("json");
                let id = v["id"].as_str().unwrap().to_string();
                let actual = 1_000 + worker * 100 + i;
                let settle = json!({"usage": {"cost_micros": actual}});
                // Every other settle is sent twice: idempotent.
                for _ in 0..(1 + i % 2) {
                    let r = client
                        .post(format!("{base}/v1/reservations/{id}/settle"))
                        .json(&settle)
                        .send()
                        .await
                        .expect("settle");
                    assert_eq!(r.status(), 200);
                    let v: Value = r.json().await.expect("json");
                    assert_eq!(v["charged"]["cost_micros"], actual);
                }
                charged += actual;
            }
            charged
        });
    }
    let total: u64 = set.join_all().await.into_iter().sum();
    let st = s
        .get("/v1/scopes/tenant:acme/user:pool", None)
        .await
        .expect(200);
    assert_eq!(st.json["limits"][0]["used"], total);
    assert_eq!(st.json["limits"][0]["held"], 0);
    assert_eq!(st.json["held_reservations"], 0);
}

/// SIGTERM while a settle is half-sent: the server finishes it (answers
/// 200 with the settled reservation), refuses new connections, and exits 0.
#[tokio::test]
async fn graceful_shutdown_finishes_the_settle_in_flight() {
    let s = Server::start();
    let id = s
        .post(
            "/v1/reservations",
            None,
            &json!({"tenant": "acme", "amounts": {"input_tokens": 5}}),
        )
        .await
        .expect(201)
        .json["id"]
        .as_str()
        .unwrap()
        .to_string();
    let addr = s.base.trim_start_matches("http://").to_string();
    let body = br#"{"usage": {"input_tokens": 4}}"#;
    let mut conn = TcpStream::connect(&addr).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        conn,
        "POST /v1/reservations/{id}/settle HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    conn.write_all(&body[..10]).unwrap();
    conn.flush().unwrap();
    std::thread::sleep(Duration::from_millis(200));

    let pid = s.pid();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    std::thread::sleep(Duration::from_millis(300));
    conn.write_all(&body[10..]).unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).expect("the answer");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"status\":\"settled\""), "{answer}");
    assert!(answer.contains("\"input_tokens\":4"), "{answer}");

    let status = s.terminate();
    assert!(status.success(), "exit {status:?}");
    assert!(
        TcpStream::connect(&addr).is_err(),
        "nothing listens after the shutdown"
    );
}
