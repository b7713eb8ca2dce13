//! Helpers shared by the integration tests: servers on 127.0.0.1:0 and a
//! one-shot HTTP/1.1 client.

#![allow(dead_code, reason = "each test file uses a subset")]

use std::time::Duration;

use allowance_bench::{BenchOptions, Report, Scenario, serve_noop};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{HeaderMap, Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A server task that stops when dropped.
pub struct Server {
    pub url: String,
    pub addr: std::net::SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts the no-op server on 127.0.0.1:0.
pub async fn noop() -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let _ = serve_noop(listener).await;
    });
    Server {
        url: format!("http://{addr}"),
        addr,
        task,
    }
}

/// Serves any axum router on 127.0.0.1:0.
pub async fn axum_server(router: axum::Router) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Server {
        url: format!("http://{addr}"),
        addr,
        task,
    }
}

/// Accepts connections on 127.0.0.1:0 and hands each to `on_accept`.
pub async fn raw_server<F>(mut on_accept: F) -> Server
where
    F: FnMut(TcpStream) + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            on_accept(stream);
        }
    });
    Server {
        url: format!("http://{addr}"),
        addr,
        task,
    }
}

/// A short run: ~1 s measured after a short warm-up, 4 connections.
pub fn short(server: &str, scenario: Scenario) -> BenchOptions {
    BenchOptions {
        scenario,
        duration: Duration::from_secs(1),
        warmup: Duration::from_millis(200),
        concurrency: 4,
        ..BenchOptions::new(server)
    }
}

/// The percentiles of every latency are ordered, and the counts agree with
/// the totals.
pub fn assert_sane(report: &Report) {
    assert!(report.pairs > 0, "no pairs:\n{report}");
    assert_eq!(report.errors, 0, "errors:\n{report}");
    for latency in [&report.reserve, &report.second, &report.pair] {
        assert!(latency.p50 > Duration::ZERO, "{report}");
        assert!(latency.p50 <= latency.p99, "{report}");
        assert!(latency.p99 <= latency.p999, "{report}");
        assert!(latency.p999 <= latency.max, "{report}");
    }
    // A pair takes at least as long as its reserve.
    assert!(report.pair.p50 >= report.reserve.p50, "{report}");
    assert_eq!(report.pair.count, report.pairs);
    assert_eq!(report.second.count, report.pairs);
    assert_eq!(report.reserve.count, report.attempts);
    assert_eq!(report.attempts, report.pairs + report.denials);
    assert_eq!(report.denials, report.denials_by_kind.values().sum::<u64>());
    assert!(report.elapsed >= Duration::from_secs(1), "{report}");
    let rate = report.pairs as f64 / report.elapsed.as_secs_f64();
    assert!((report.pairs_per_s - rate).abs() < 1e-6, "{report}");
}

/// What one request answered.
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub json: serde_json::Value,
}

/// POSTs `body` to `path` over a fresh connection.
pub async fn post(
    server: &Server,
    path: &str,
    content_type: Option<&str>,
    body: Vec<u8>,
) -> Answer {
    let stream = TcpStream::connect(server.addr).await.expect("connect");
    let (mut sender, connection) = http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(connection);
    let mut request = Request::builder()
        .method(Method::POST)
        .uri(path)
        .header(HOST, server.addr.to_string());
    if let Some(content_type) = content_type {
        request = request.header(CONTENT_TYPE, content_type);
    }
    let request = request.body(Full::new(Bytes::from(body))).expect("request");
    let response = sender.send_request(request).await.expect("send");
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    Answer {
        status,
        headers,
        json,
    }
}

/// POSTs a JSON text.
pub async fn post_json(server: &Server, path: &str, body: &str) -> Answer {
    post(
        server,
        path,
        Some("application/json"),
        body.as_bytes().to_vec(),
    )
    .await
}
