//! Helpers shared by the stub's HTTP tests: a stub, a client, SSE parsing
//! and `T(s)` computed here with tiktoken-rs, apart from the stub's own.

#![allow(dead_code)]

use std::time::Duration;

use allowance_stub::Stub;
use futures_util::StreamExt;
use serde_json::Value;

/// `T(s)` of the formula, computed by the test itself.
pub fn t(text: &str) -> u64 {
    tiktoken_rs::o200k_base_singleton()
        .encode_ordinary(text)
        .len() as u64
}

/// `T(compact JSON of value)`.
pub fn tj(value: &Value) -> u64 {
    t(&serde_json::to_string(value).expect("a Value serializes"))
}

pub async fn stub() -> Stub {
    Stub::spawn("127.0.0.1:0".parse().expect("an address"))
        .await
        .expect("the stub starts")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("a client")
}

/// POSTs `body` to `path` and returns the response.
pub async fn post(stub: &Stub, path: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{}{path}", stub.base_url()))
        .json(body)
        .send()
        .await
        .expect("the stub answers")
}

/// POSTs and returns the status and JSON body.
pub async fn post_json(stub: &Stub, path: &str, body: &Value) -> (u16, Value) {
    let response = post(stub, path, body).await;
    let status = response.status().as_u16();
    let body = response.json::<Value>().await.expect("a JSON body");
    (status, body)
}

/// One server-sent event: its `event:` name if any, and its `data:`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sse {
    pub event: Option<String>,
    pub data: String,
}

impl Sse {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.data)
            .unwrap_or_else(|e| panic!("data {:?} is JSON: {e}", self.data))
    }
}

/// Splits an SSE body into events.
pub fn parse_sse(text: &str) -> Vec<Sse> {
    text.split("\n\n")
        .filter(|block| !block.trim().is_empty())
        .map(|block| {
            let mut event = None;
            let mut data = Vec::new();
            for line in block.lines() {
                if let Some(name) = line.strip_prefix("event: ") {
                    event = Some(name.to_owned());
                } else if let Some(payload) = line.strip_prefix("data: ") {
                    data.push(payload);
                } else {
                    panic!("unexpected SSE line {line:?}");
                }
            }
            Sse {
                event,
                data: data.join("\n"),
            }
        })
        .collect()
}

/// POSTs a streaming request and reads the whole SSE body.
pub async fn post_sse(
    stub: &Stub,
    path: &str,
    body: &Value,
) -> (reqwest::header::HeaderMap, Vec<Sse>) {
    let response = post(stub, path, body).await;
    assert_eq!(response.status(), 200, "a streaming call succeeds");
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let head = response.headers().clone();
    let text = response.text().await.expect("the stream completes");
    (head, parse_sse(&text))
}

/// Reads a body chunk by chunk until it ends or fails; returns the text
/// received and whether it failed.
pub async fn read_until_end(response: reqwest::Response) -> (String, bool) {
    let mut stream = response.bytes_stream();
    let mut text = Vec::new();
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(bytes) => text.extend_from_slice(&bytes),
            Err(_) => return (String::from_utf8_lossy(&text).into_owned(), true),
        }
    }
    (String::from_utf8_lossy(&text).into_owned(), false)
}

/// The control API over HTTP.
pub async fn control(stub: &Stub, path: &str, body: &Value) -> (u16, Value) {
    post_json(stub, path, body).await
}

pub async fn get_json(stub: &Stub, path: &str) -> Value {
    client()
        .get(format!("{}{path}", stub.base_url()))
        .send()
        .await
        .expect("the stub answers")
        .json()
        .await
        .expect("a JSON body")
}
