//! The usage log against the real binary: `GET /v1/usage` after settles,
//! refunds, an expiry and an adjustment; `allowance usage export` writing
//! exactly what the server serves and the cursor to resume from; tenant
//! tokens; refusals as one line and exit 1; the log and its cursors kept
//! across a clean restart and a `kill -9` of the durable store.
mod common;

use std::io::{Read, Write};
use std::process::Output;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

/// The body of `GET /v1/usage{query}` as raw text, with the cursor header.
async fn log(s: &Server, query: &str, token: Option<&str>) -> (String, String) {
    let mut req = s.client.get(s.url(&format!("/v1/usage{query}")));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.expect("request");
    assert_eq!(resp.status(), 200, "GET /v1/usage{query}");
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "application/x-ndjson"
    );
    let next = resp.headers()["x-next-cursor"]
        .to_str()
        .unwrap()
        .to_string();
    (resp.text().await.expect("body"), next)
}

fn lines(text: &str) -> Vec<Value> {
    assert!(text.is_empty() || text.ends_with('\n'), "{text:?}");
    text.lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn kinds(text: &str) -> Vec<String> {
    lines(text)
        .iter()
        .map(|l| l["kind"].as_str().unwrap().to_string())
        .collect()
}

/// `allowance usage export ARGS` (the token through `ALLOWANCE_TOKEN`
/// when given), bounded so a hang fails the test.
async fn export(s: &str, token: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = tokio::process::Command::new(bin());
    cmd.args(["usage", "export", "--server", s])
        .args(args)
        .env_remove("ALLOWANCE_TOKEN")
        .env_remove("ALLOWANCE_SERVER")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    if let Some(t) = token {
        cmd.env("ALLOWANCE_TOKEN", t);
    }
    tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("`usage export` finished within 60 s")
        .expect("run allowance")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).expect("UTF-8")
}

/// Exit 0, the JSON lines on stdout, `next cursor: N` alone on stderr.
fn exported(out: &Output) -> (String, String) {
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{out:?}");
    let cursor = stderr
        .strip_prefix("next cursor: ")
        .and_then(|r| r.strip_suffix('\n'))
        .unwrap_or_else(|| panic!("stderr is the cursor line only: {stderr:?}"));
    (text(&out.stdout), cursor.to_string())
}

/// Exit 1, nothing on stdout, one `error: …` line on stderr.
fn refused(out: &Output) -> String {
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(text(&out.stdout), "", "nothing written");
    assert!(
        stderr.starts_with("error: ") && stderr.ends_with('\n') && stderr.lines().count() == 1,
        "one error line: {stderr:?}"
    );
    stderr
}

/// Waits (bounded) until the log has `n` records; returns its text.
async fn wait_for_records(s: &Server, n: usize) -> String {
    let started = Instant::now();
    loop {
        let (body, _) = log(s, "", Some(ADMIN_TOKEN)).await;
        if body.lines().count() >= n {
            return body;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the log never reached {n} records: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn reserve(s: &Server, token: &str, body: Value) -> String {
    let r = s
        .post("/v1/reservations", Some(token), &body)
        .await
        .expect(201);
    r.json["id"].as_str().unwrap().to_string()
}

/// One of each kind, in this order: expired, settled (acme), refunded
/// (acme), adjusted (acme's task), settled (beta). Returns the ids.
async fn one_of_each(s: &Server) -> Vec<String> {
    let expired = reserve(
        s,
        ACME_TOKEN,
        json!({"tenant": "acme", "amounts": {"input_tokens": 5}, "ttl_ms": 200}),
    )
    .await;
    // The server's sweeper finds it: no request about it arrives.
    wait_for_records(s, 1).await;
    let settled = reserve(
        s,
        ACME_TOKEN,
        json!({"tenant": "acme", "scopes": {"user": "bob"}, "model": "gpt-4o",
               "amounts": {"input_tokens": 1000, "output_tokens": 500}}),
    )
    .await;
    s.post(
        &format!("/v1/reservations/{settled}/settle"),
        Some(ACME_TOKEN),
        &json!({"usage": {"input_tokens": 900, "output_tokens": 400}}),
    )
    .await
    .expect(200);
    let refunded = reserve(
        s,
        ACME_TOKEN,
        json!({"tenant": "acme", "amounts": {"input_tokens": 10}}),
    )
    .await;
    s.post(
        &format!("/v1/reservations/{refunded}/refund"),
        Some(ACME_TOKEN),
        &json!({}),
    )
    .await
    .expect(200);
    s.post(
        "/v1/scopes/tenant:acme/task:t1/adjust",
        Some(ADMIN_TOKEN),
        &json!({"dimension": "cost_micros", "amount": -5000, "reason": "a bad run"}),
    )
    .await
    .expect(200);
    let beta = reserve(
        s,
        BETA_TOKEN,
        json!({"tenant": "beta", "amounts": {"input_tokens": 10}}),
    )
    .await;
    s.post(
        &format!("/v1/reservations/{beta}/settle"),
        Some(BETA_TOKEN),
        &json!({"usage": {"input_tokens": 3}}),
    )
    .await
    .expect(200);
    vec![expired, settled, refunded, beta]
}

#[tokio::test]
async fn the_log_over_http_and_its_export() {
    let s = Server::with_tokens();
    let ids = one_of_each(&s).await;
    let (all, next) = log(&s, "", Some(ADMIN_TOKEN)).await;
    assert_eq!(
        kinds(&all),
        ["expired", "settled", "refunded", "adjusted", "settled"]
    );
    let records = lines(&all);
    let reservations: Vec<&Value> = records.iter().map(|l| &l["reservation"]).collect();
    assert_eq!(
        reservations,
        [
            &json!(ids[0]),
            &json!(ids[1]),
            &json!(ids[2]),
            &Value::Null,
            &json!(ids[3])
        ]
    );
    assert_eq!(next, records[4]["cursor"].as_str().unwrap());
    // Cursors are strings of increasing integers.
    let cursors: Vec<u64> = records
        .iter()
        .map(|l| l["cursor"].as_str().unwrap().parse().unwrap())
        .collect();
    assert!(cursors.windows(2).all(|w| w[0] < w[1]), "{cursors:?}");
    assert_eq!(
        (&records[0]["charged"], &records[0]["late"]),
        (&Value::Null, &json!(false))
    );
    assert_eq!(
        records[1]["charged"],
        json!({"requests": 1, "input_tokens": 900, "output_tokens": 400, "tokens": 1300,
               "cost_micros": 6250})
    );
    assert_eq!(
        (
            &records[3]["scopes"],
            &records[3]["dimension"],
            &records[3]["credit"]
        ),
        (
            &json!(["tenant:acme/task:t1"]),
            &json!("cost_micros"),
            &json!(-5000)
        )
    );

    // The export writes exactly what the server serves, page after page,
    // and the cursor to resume from.
    let base = s.base.clone();
    for args in [&[][..], &["--limit", "2"], &["--limit", "1"]] {
        let (out, cursor) = exported(&export(&base, Some(ADMIN_TOKEN), args).await);
        assert_eq!(out, all, "{args:?}");
        assert_eq!(cursor, next, "{args:?}");
    }
    // Resuming from the cursor: nothing new, the same cursor.
    let (out, cursor) = exported(&export(&base, Some(ADMIN_TOKEN), &["--since", &next]).await);
    assert_eq!((out.as_str(), cursor.as_str()), ("", next.as_str()));
    // From the middle: the rest.
    let middle = records[2]["cursor"].as_str().unwrap();
    let (out, _) = exported(
        &export(
            &base,
            Some(ADMIN_TOKEN),
            &["--since", middle, "--limit", "1"],
        )
        .await,
    );
    let rest: String = all.lines().skip(3).map(|l| format!("{l}\n")).collect();
    assert_eq!(out, rest);
    // A new record: the next export from the stored cursor is exactly it.
    let id = reserve(
        &s,
        ADMIN_TOKEN,
        json!({"tenant": "acme", "amounts": {"input_tokens": 1}}),
    )
    .await;
    s.post(
        &format!("/v1/reservations/{id}/refund"),
        Some(ADMIN_TOKEN),
        &json!({}),
    )
    .await
    .expect(200);
    let (out, cursor) = exported(&export(&base, Some(ADMIN_TOKEN), &["--since", &next]).await);
    let new = lines(&out);
    assert_eq!(new.len(), 1, "{out}");
    assert_eq!(
        (&new[0]["reservation"], &new[0]["kind"]),
        (&json!(id), &json!("refunded"))
    );
    assert_eq!(cursor, new[0]["cursor"].as_str().unwrap());
}

#[tokio::test]
async fn a_tenant_token_sees_only_its_tenant() {
    let s = Server::with_tokens();
    one_of_each(&s).await;
    let (all, next) = log(&s, "", Some(ADMIN_TOKEN)).await;
    let acme_lines: String = all
        .lines()
        .filter(|l| serde_json::from_str::<Value>(l).unwrap()["tenant"] == "acme")
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(
        kinds(&acme_lines),
        ["expired", "settled", "refunded", "adjusted"]
    );
    let (acme, _) = log(&s, "", Some(ACME_TOKEN)).await;
    assert_eq!(acme, acme_lines);
    let (beta, _) = log(&s, "", Some(BETA_TOKEN)).await;
    assert_eq!(kinds(&beta), ["settled"]);
    assert!(lines(&beta).iter().all(|l| l["tenant"] == "beta"));

    let (out, _) = exported(&export(&s.base, Some(ACME_TOKEN), &["--limit", "1"]).await);
    assert_eq!(out, acme_lines);
    let (out, cursor) = exported(&export(&s.base, Some(BETA_TOKEN), &[]).await);
    assert_eq!(out, beta);
    assert_eq!(cursor, next, "beta's record is the last one");
}

#[tokio::test]
async fn refusals_are_one_line_and_exit_1() {
    let s = Server::with_tokens();
    one_of_each(&s).await;
    // 401 over HTTP and through the command.
    let r = s.get("/v1/usage", None).await.expect(401);
    assert_eq!(r.error_type(), "unauthorized");
    let r = s.get("/v1/usage", Some("wrong")).await.expect(401);
    assert_eq!(r.error_type(), "unauthorized");
    let e = refused(&export(&s.base, None, &[]).await);
    assert!(
        e.contains("401") && e.contains("missing credentials"),
        "{e}"
    );
    let e = refused(&export(&s.base, Some("wrong"), &[]).await);
    assert!(e.contains("401") && e.contains("unknown token"), "{e}");
    // The flag wins over nothing; a bad limit never reaches the server.
    let out = export(&s.base, None, &["--token", ADMIN_TOKEN, "--since", "999"]).await;
    assert_eq!(exported(&out), (String::new(), "999".to_string()));
    let out = export(&s.base, Some(ADMIN_TOKEN), &["--limit", "0"]).await;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    // 400 from the server naming the field.
    let r = s
        .get("/v1/usage?since=x", Some(ADMIN_TOKEN))
        .await
        .expect(400);
    assert_eq!(r.field(), Some("since"));
    let r = s
        .get("/v1/usage?limit=10001", Some(ADMIN_TOKEN))
        .await
        .expect(400);
    assert_eq!(r.field(), Some("limit"));

    // Connection refused: a port nobody listens on any more.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let e = refused(&export(&format!("http://127.0.0.1:{port}"), Some(ADMIN_TOKEN), &[]).await);
    assert!(e.contains("cannot reach"), "{e}");

    // 403 and 503 (an allowance server answers neither to this route):
    // a stand-in that answers one canned response to each connection.
    for (status, body) in [
        (
            "403 Forbidden",
            r#"{"error": {"type": "forbidden", "message": "not for you"}}"#,
        ),
        (
            "503 Service Unavailable",
            r#"{"error": {"type": "store_unavailable", "message": "the store is fenced"}}"#,
        ),
    ] {
        let base = canned(status, body);
        let e = refused(&export(&base, Some(ADMIN_TOKEN), &[]).await);
        let code = &status[..3];
        let message = &serde_json::from_str::<Value>(body).unwrap()["error"]["message"];
        assert!(
            e.contains(code) && e.contains(message.as_str().unwrap()),
            "{e}"
        );
    }

    // A page written, then a failure: the page stays on stdout and the one
    // error line says where it ends, so a resume repeats nothing.
    let line = "{\"cursor\":\"7\",\"kind\":\"refunded\"}\n";
    let base = canned_sequence(vec![
        (
            "200 OK",
            "content-type: application/x-ndjson\r\nx-next-cursor: 7\r\n",
            line,
        ),
        (
            "503 Service Unavailable",
            "content-type: application/json\r\n",
            r#"{"error": {"type": "store_unavailable", "message": "fenced"}}"#,
        ),
    ]);
    let out = export(&base, Some(ADMIN_TOKEN), &["--since", "3"]).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(text(&out.stdout), line);
    assert_eq!(
        text(&out.stderr),
        "error: 503 Service Unavailable: fenced (records up to cursor 7 were written: resume with --since 7)\n"
    );
    // Something that is not an allowance server: no cursor header.
    let base = canned_sequence(vec![(
        "200 OK",
        "content-type: text/html\r\n",
        "<html></html>",
    )]);
    let e = refused(&export(&base, Some(ADMIN_TOKEN), &[]).await);
    assert!(e.contains("no X-Next-Cursor"), "{e}");
}

/// A stand-in server on 127.0.0.1 that answers `status` and `body` to
/// every connection; returns its base URL.
fn canned(status: &'static str, body: &'static str) -> String {
    canned_sequence(vec![(status, "content-type: application/json\r\n", body)])
}

/// A stand-in server answering its n-th connection with the n-th of
/// `answers` (status, extra header lines, body), the last one after that.
fn canned_sequence(answers: Vec<(&'static str, &'static str, &'static str)>) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for (n, stream) in listener.incoming().enumerate() {
            let Ok(mut stream) = stream else { break };
            let (status, headers, body) = answers[n.min(answers.len() - 1)];
            // Read the request head (a GET has no body), then answer.
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                match stream.read(&mut byte) {
                    Ok(1) => head.push(byte[0]),
                    _ => break,
                }
            }
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\n{headers}content-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    base
}

#[tokio::test]
async fn the_log_and_its_cursors_survive_restarts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("allowance.toml");
    std::fs::write(&config, config_with_tokens()).expect("config");
    let data = dir.path().join("data");

    let s = Server::on_data_dir(&config, &data);
    one_of_each(&s).await;
    let (before, next) = log(&s, "", Some(ADMIN_TOKEN)).await;
    let (exported_before, cursor) = exported(&export(&s.base, Some(ADMIN_TOKEN), &[]).await);
    assert_eq!((&exported_before, &cursor), (&before, &next));
    assert!(s.terminate().success());

    // A clean restart: the same records under the same cursors; the
    // stored cursor resumes with nothing new.
    let s = Server::on_data_dir(&config, &data);
    assert_eq!(
        log(&s, "", Some(ADMIN_TOKEN)).await,
        (before.clone(), next.clone())
    );
    let (out, again) = exported(&export(&s.base, Some(ADMIN_TOKEN), &["--since", &cursor]).await);
    assert_eq!((out.as_str(), again.as_str()), ("", cursor.as_str()));
    // New records continue the numbering.
    let id = reserve(
        &s,
        ACME_TOKEN,
        json!({"tenant": "acme", "amounts": {"input_tokens": 1}}),
    )
    .await;
    s.post(
        &format!("/v1/reservations/{id}/settle"),
        Some(ACME_TOKEN),
        &json!({"usage": {"input_tokens": 1}}),
    )
    .await
    .expect(200);
    let (after, next2) = log(&s, "", Some(ADMIN_TOKEN)).await;
    assert!(after.starts_with(&before), "old records unchanged");
    let added = lines(&after[before.len()..]);
    assert_eq!(added.len(), 1, "{after}");
    assert_eq!(added[0]["reservation"], json!(id));
    let added_cursor: u64 = added[0]["cursor"].as_str().unwrap().parse().unwrap();
    assert!(added_cursor > next.parse::<u64>().unwrap());
    assert_eq!(next2, added_cursor.to_string());

    // A crash (kill -9): everything acknowledged is still there, under the
    // same cursors.
    assert!(!s.kill_9().success());
    let s = Server::on_data_dir(&config, &data);
    assert_eq!(
        log(&s, "", Some(ADMIN_TOKEN)).await,
        (after.clone(), next2.clone())
    );
    let (out, resumed) = exported(&export(&s.base, Some(ADMIN_TOKEN), &["--since", &cursor]).await);
    assert_eq!(out, after[before.len()..]);
    assert_eq!(resumed, next2);
    assert!(s.terminate().success());
}
