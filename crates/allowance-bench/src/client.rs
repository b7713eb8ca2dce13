//! A lean HTTP/1.1 client: one bare hyper connection per worker.
//!
//! The client shares the machine with the server it measures, so it does as
//! little as it can: no pool, no redirects, no decompression, bodies built
//! once where they do not change.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http1;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HOST, HeaderValue};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout_at};

use crate::BenchError;

/// Bound on one call: a server that stops answering shows up as timeouts
/// instead of a hang. Far above any sane latency, so it never cuts a slow
/// but working server short.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Bound on reading an answer: the largest real answer is a few KiB, and a
/// runaway server must not make the bench buffer without end.
const MAX_RESPONSE_BYTES: usize = 1 << 20;

/// Where the requests go, parsed once.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// `host:port` to dial.
    pub(crate) addr: String,
    /// The `Host` header.
    host_header: HeaderValue,
    /// The path prefix (no trailing slash), usually empty.
    base_path: String,
    /// `Bearer <token>`, when a token is given.
    authorization: Option<HeaderValue>,
}

impl Target {
    /// Parses `server` (see [`BenchOptions::server`](crate::BenchOptions))
    /// and the token.
    pub(crate) fn parse(server: &str, token: Option<&str>) -> Result<Target, BenchError> {
        let invalid = |reason: String| BenchError::InvalidOption {
            field: "server",
            reason,
        };
        let with_scheme = if server.contains("://") {
            server.to_owned()
        } else {
            format!("http://{server}")
        };
        let uri: Uri = with_scheme
            .parse()
            .map_err(|e| invalid(format!("{server:?} is not a URL ({e})")))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(invalid(format!(
                    "{server:?}: https is not supported; the bench measures the server over plain HTTP/1.1"
                )));
            }
            Some(other) => {
                return Err(invalid(format!("{server:?}: scheme {other:?} is not http")));
            }
            None => return Err(invalid(format!("{server:?} has no scheme"))),
        }
        let authority = uri
            .authority()
            .ok_or_else(|| invalid(format!("{server:?} has no host")))?;
        if authority.as_str().contains('@') {
            return Err(invalid(format!(
                "{server:?}: credentials in the URL are not supported; use the token"
            )));
        }
        if authority.host().is_empty() {
            return Err(invalid(format!("{server:?} has no host")));
        }
        if uri.query().is_some() {
            return Err(invalid(format!(
                "{server:?}: a query string has no meaning here"
            )));
        }
        let port = authority.port_u16().unwrap_or(80);
        let addr = format!("{}:{port}", authority.host());
        let host_header = HeaderValue::from_str(authority.as_str())
            .map_err(|e| invalid(format!("{server:?}: bad host ({e})")))?;
        let base_path = uri.path().trim_end_matches('/').to_owned();
        let authorization = match token {
            None => None,
            Some("") => {
                return Err(BenchError::InvalidOption {
                    field: "token",
                    reason: "the token is empty".to_owned(),
                });
            }
            Some(token) => Some(HeaderValue::from_str(&format!("Bearer {token}")).map_err(
                |_| BenchError::InvalidOption {
                    field: "token",
                    reason: "the token holds characters an HTTP header cannot carry".to_owned(),
                },
            )?),
        };
        Ok(Target {
            addr,
            host_header,
            base_path,
            authorization,
        })
    }

    /// The full request path for an API path such as `/v1/reservations`.
    pub(crate) fn path(&self, api_path: &str) -> String {
        format!("{}{api_path}", self.base_path)
    }
}

/// One answer: the status and the whole body.
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) body: Bytes,
}

/// Why a call got no answer. The connection is unusable afterwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// Dialling failed.
    Connect,
    /// The server had closed the keep-alive connection before the call.
    Closed,
    /// The connection broke during the call.
    Transport,
    /// No answer within the bound.
    Timeout,
    /// The answer's body was too large to be a real answer.
    TooLarge,
}

impl Failure {
    /// The key the report counts it under.
    pub(crate) fn kind(self) -> &'static str {
        match self {
            Failure::Connect => "transport: connect",
            Failure::Closed => "transport: connection closed by the server",
            Failure::Transport => "transport: broken during a call",
            Failure::Timeout => "transport: timeout",
            Failure::TooLarge => "transport: answer too large",
        }
    }
}

/// One keep-alive HTTP/1.1 connection.
pub(crate) struct Conn {
    sender: http1::SendRequest<Full<Bytes>>,
}

impl Conn {
    /// Dials the target and starts the connection's driver task; the task
    /// ends when the `Conn` is dropped or the server closes.
    pub(crate) async fn open(target: &Target, deadline: Instant) -> Result<Conn, Failure> {
        let stream = match timeout_at(deadline, TcpStream::connect(&target.addr)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(_)) => return Err(Failure::Connect),
            Err(_) => return Err(Failure::Timeout),
        };
        // Small requests and answers: never wait for Nagle.
        let _ = stream.set_nodelay(true);
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|_| Failure::Connect)?;
        tokio::spawn(async move {
            // The error, if any, surfaces on the next call as `Closed` or `Transport`.
            let _ = connection.await;
        });
        Ok(Conn { sender })
    }

    /// POSTs `body` as JSON to `path` and reads the whole answer, giving up
    /// at `deadline`.
    pub(crate) async fn post(
        &mut self,
        target: &Target,
        path: &str,
        body: Bytes,
        deadline: Instant,
    ) -> Result<Answer, Failure> {
        self.call(target, Method::POST, path, Some(body), deadline)
            .await
    }

    /// Sends `method` to `path`, with `body` as JSON when given, and reads
    /// the whole answer, giving up at `deadline`.
    pub(crate) async fn call(
        &mut self,
        target: &Target,
        method: Method,
        path: &str,
        body: Option<Bytes>,
        deadline: Instant,
    ) -> Result<Answer, Failure> {
        let mut builder = Request::builder()
            .method(method)
            .uri(path)
            .header(HOST, target.host_header.clone());
        if body.is_some() {
            builder = builder.header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
        if let Some(authorization) = &target.authorization {
            builder = builder.header(AUTHORIZATION, authorization.clone());
        }
        // Paths are built from the target and server-made ids that were
        // percent-encoded, so this only fails on a bug; it is still no panic.
        let request = builder
            .body(Full::new(body.unwrap_or_default()))
            .map_err(|_| Failure::Transport)?;
        let call = async {
            self.sender.ready().await.map_err(|_| Failure::Closed)?;
            let response = self
                .sender
                .send_request(request)
                .await
                .map_err(|_| Failure::Transport)?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
                .collect()
                .await
                .map_err(|e| {
                    if e.is::<http_body_util::LengthLimitError>() {
                        Failure::TooLarge
                    } else {
                        Failure::Transport
                    }
                })?
                .to_bytes();
            Ok(Answer { status, body })
        };
        timeout_at(deadline, call)
            .await
            .unwrap_or(Err(Failure::Timeout))
    }
}

/// Percent-encodes a server-made id for a path segment, so an id with an
/// unexpected character still makes a valid request.
pub(crate) fn encode_segment(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for byte in id.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}
