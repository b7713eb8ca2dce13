//! Black-box harness: starts the real `allowance` binary on a free
//! 127.0.0.1 port and talks HTTP to it.
#![allow(dead_code, missing_docs)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use serde_json::Value;

/// The binary under test.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_allowance")
}

/// A running server; killed when dropped.
pub struct Server {
    child: Option<Child>,
    pub base: String,
    pub client: reqwest::Client,
    pub log: Arc<Mutex<Vec<String>>>,
    _dir: Option<tempfile::TempDir>,
}

/// Admin and tenant tokens configured by [`Server::with_tokens`].
pub const ADMIN_TOKEN: &str = "test-admin-token";
pub const ACME_TOKEN: &str = "test-acme-token";
pub const BETA_TOKEN: &str = "test-beta-token";

fn sha256_hex(token: &str) -> String {
    allowance_server::token_sha256_hex(token)
}

/// The starter configuration plus three tokens: admin, acme, beta.
pub fn config_with_tokens() -> String {
    format!(
        "{}\n[[tokens]]\nsha256 = \"{}\"\nrole = \"admin\"\n\n[[tokens]]\nsha256 = \"{}\"\nrole = \"tenant\"\ntenant = \"acme\"\n\n[[tokens]]\nsha256 = \"{}\"\nrole = \"tenant\"\ntenant = \"beta\"\n",
        allowance_config::STARTER,
        sha256_hex(ADMIN_TOKEN),
        sha256_hex(ACME_TOKEN),
        sha256_hex(BETA_TOKEN)
    )
}

impl Server {
    /// `allowance serve` with the built-in starter.
    pub fn start() -> Server {
        Self::spawn(&[], None)
    }

    /// `allowance serve --config FILE` with `toml` as the file.
    pub fn with_config(toml: &str) -> Server {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("allowance.toml");
        std::fs::write(&path, toml).expect("write config");
        let p = path.to_string_lossy().to_string();
        Self::spawn(&["--config", &p], Some(dir))
    }

    /// The starter with admin/acme/beta tokens.
    pub fn with_tokens() -> Server {
        Self::with_config(&config_with_tokens())
    }

    /// Every server gets its own data dir (the durable store is the
    /// default): tests never share one, nor leave one in the source tree.
    fn spawn(extra: &[&str], dir: Option<tempfile::TempDir>) -> Server {
        let dir = dir.unwrap_or_else(|| tempfile::tempdir().expect("temp dir"));
        let data = dir.path().join("data").to_string_lossy().to_string();
        let mut args = vec!["--listen", "127.0.0.1:0", "--data-dir", &data];
        args.extend_from_slice(extra);
        Self::spawn_serve(&args, Some(dir))
    }

    /// `allowance serve ARGS` exactly as given (no `--listen` added). The
    /// address it reports is reached through 127.0.0.1 (a server told to
    /// listen on 0.0.0.0 reports that): tests never talk to another host.
    pub fn serve_args(args: &[&str]) -> Server {
        Self::spawn_serve(args, None)
    }

    fn spawn_serve(serve_args: &[&str], dir: Option<tempfile::TempDir>) -> Server {
        let mut cmd = Command::new(bin());
        cmd.args(["--log-format", "json", "serve"])
            .args(serve_args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn allowance");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel::<String>();
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Ok(v) = serde_json::from_str::<Value>(&line)
                    && let Some(addr) = v["fields"]["address"].as_str()
                {
                    let _ = tx.send(addr.to_string());
                }
                log2.lock().unwrap().push(line);
            }
        });
        // Generous: a cold debug binary on a loaded 2-core machine.
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "the server did not say where it listens; log:\n{}",
                    log.lock().unwrap().join("\n")
                );
            }
        };
        let addr = match addr.parse::<std::net::SocketAddr>() {
            Ok(a) if a.ip().is_unspecified() => format!("127.0.0.1:{}", a.port()),
            _ => addr,
        };
        Server {
            child: Some(child),
            base: format!("http://{addr}"),
            client: reqwest::Client::new(),
            log,
            _dir: dir,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// SIGTERM, then wait for the exit (bounded generously).
    pub fn terminate(self) -> ExitStatus {
        self.signal("TERM")
    }

    /// Sends `signal` (`TERM`, `HUP`…) and waits for the exit.
    pub fn signal(mut self, signal: &str) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        let _ = Command::new("kill")
            .args([&format!("-{signal}"), &child.id().to_string()])
            .status();
        for _ in 0..600 {
            if let Ok(Some(status)) = child.try_wait() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        panic!("the server did not exit within 30 s of SIG{signal}");
    }

    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// Whether a log line containing `needle` arrives within 10 s: a line
    /// the server writes while answering may reach the reader thread after
    /// the answer reaches the test.
    #[allow(dead_code)] // not every test binary waits for a line
    pub fn log_has(&self, needle: &str) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if self.log_text().contains(needle) {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends a request; returns status, headers and the body as JSON (or
    /// `Value::String` of the raw text when it is not JSON).
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&str>,
        content_type: Option<&str>,
    ) -> Reply {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        let mut req = self.client.request(method, self.url(path));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        if let Some(b) = body {
            req = req.body(b.to_string());
        }
        let resp = req.send().await.expect("request");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let text = resp.text().await.expect("body");
        let json = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Reply {
            status,
            headers,
            json,
        }
    }

    pub async fn post(&self, path: &str, token: Option<&str>, body: &Value) -> Reply {
        self.send(
            "POST",
            path,
            token,
            Some(&body.to_string()),
            Some("application/json"),
        )
        .await
    }

    pub async fn put(&self, path: &str, token: Option<&str>, body: &Value) -> Reply {
        self.send(
            "PUT",
            path,
            token,
            Some(&body.to_string()),
            Some("application/json"),
        )
        .await
    }

    pub async fn get(&self, path: &str, token: Option<&str>) -> Reply {
        self.send("GET", path, token, None, None).await
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// An answer.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub json: Value,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Asserts the status, printing the body when it differs.
    pub fn expect(self, status: u16) -> Self {
        assert_eq!(self.status, status, "unexpected answer: {}", self.json);
        self
    }

    pub fn error_type(&self) -> &str {
        self.json["error"]["type"].as_str().unwrap_or("")
    }

    pub fn field(&self) -> Option<&str> {
        self.json["error"]["field"].as_str()
    }
}

/// `allowance ARGS` to completion (stdin closed), with its exit status and output.
pub fn run_cli(args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run allowance")
}

impl Server {
    /// GET of every scope in `scopes` (with `token`), plus `extra_paths`,
    /// as one JSON array: a picture of the ledger to compare before and
    /// after a request. Each answer is kept whole (status and body).
    pub async fn snapshot(
        &self,
        token: Option<&str>,
        scopes: &[&str],
        extra_paths: &[&str],
    ) -> Value {
        let mut out = Vec::new();
        for s in scopes {
            let r = self.get(&format!("/v1/scopes/{s}"), token).await;
            out.push(serde_json::json!({"path": s, "status": r.status, "body": r.json}));
        }
        for p in extra_paths {
            let r = self.get(p, token).await;
            out.push(serde_json::json!({"path": p, "status": r.status, "body": r.json}));
        }
        Value::Array(out)
    }
}

impl Server {
    /// The whole usage log (`GET /v1/usage`, page after page by
    /// `X-Next-Cursor`), oldest first.
    pub async fn usage_records(&self, token: Option<&str>) -> Vec<Value> {
        let mut records = Vec::new();
        let mut since: Option<String> = None;
        loop {
            let query = since
                .as_ref()
                .map_or(String::new(), |c| format!("&since={c}"));
            let mut req = self
                .client
                .get(self.url(&format!("/v1/usage?limit=1000{query}")));
            if let Some(t) = token {
                req = req.bearer_auth(t);
            }
            let resp = req.send().await.expect("usage log");
            assert_eq!(resp.status(), 200, "GET /v1/usage");
            let next = resp
                .headers()
                .get("x-next-cursor")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let text = resp.text().await.expect("a body");
            let before = records.len();
            records.extend(
                text.lines()
                    .filter(|l| !l.trim().is_empty())
                    .map(|l| serde_json::from_str::<Value>(l).expect("a JSON line")),
            );
            if records.len() == before || next.is_none() || next == since {
                return records;
            }
            since = next;
        }
    }
}

/// A config file in a temp dir, for the commands that take a path.
pub fn config_file(toml: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("allowance.toml");
    std::fs::write(&path, toml).expect("write");
    (dir, path)
}

impl Server {
    /// `allowance serve` on 127.0.0.1:0 with a config file and a data
    /// directory the caller owns: both outlive the process, so a server
    /// started again on the same directory finds what this one left.
    pub fn on_data_dir(config: &std::path::Path, data_dir: &std::path::Path) -> Server {
        let config = config.to_string_lossy().to_string();
        let data_dir = data_dir.to_string_lossy().to_string();
        Self::serve_args(&[
            "--listen",
            "127.0.0.1:0",
            "--config",
            &config,
            "--data-dir",
            &data_dir,
        ])
    }

    /// `kill -9` (`Child::kill` is SIGKILL): no graceful shutdown, no
    /// flush, no lock removed — what a crash or the OOM killer leaves.
    /// Returns once the process is gone (bounded generously).
    pub fn kill_9(mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        let _ = child.kill();
        // Polled often: callers stop their clients once this returns.
        for _ in 0..6000 {
            if let Ok(Some(status)) = child.try_wait() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("the server was still there 30 s after SIGKILL");
    }
}

/// How a `serve` that is expected to refuse to start ended.
#[derive(Debug)]
pub enum Startup {
    /// It exited by itself.
    Exited { status: ExitStatus, stderr: String },
    /// It logged the address it listens on, i.e. it started serving; it
    /// was killed.
    Listening { stderr: String },
    /// Neither within the bound; it was killed.
    Hung { stderr: String },
}

/// `allowance --log-format json serve ARGS`, watched for up to `bound`:
/// did it exit on its own, or start listening? Never waits past `bound`,
/// and never leaves the process running.
pub fn serve_until_exit(serve_args: &[&str], bound: Duration) -> Startup {
    let mut child = Command::new(bin())
        .args(["--log-format", "json", "serve"])
        .args(serve_args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn allowance");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel::<String>();
    // The channel closes when stderr does, i.e. when the process is gone.
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = std::time::Instant::now() + bound;
    let mut lines = Vec::new();
    let stop = |child: &mut Child| {
        let _ = child.kill();
        let _ = child.wait();
    };
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let listening = serde_json::from_str::<Value>(&line)
                    .is_ok_and(|v| v["fields"]["address"].is_string());
                lines.push(line);
                if listening {
                    stop(&mut child);
                    return Startup::Listening {
                        stderr: lines.join("\n"),
                    };
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                for _ in 0..600 {
                    if let Ok(Some(status)) = child.try_wait() {
                        return Startup::Exited {
                            status,
                            stderr: lines.join("\n"),
                        };
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                stop(&mut child);
                return Startup::Hung {
                    stderr: lines.join("\n"),
                };
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                stop(&mut child);
                return Startup::Hung {
                    stderr: lines.join("\n"),
                };
            }
        }
    }
}

/// Plans for the race tests: an open tenant, users with a €20 daily
/// cost cap and a gauge of 1000, and a `gauge` plan of 4 concurrent.
pub const RACE_CONFIG: &str = r#"
[kinds.tenant]
plan = "open"
[kinds.user]
plan = "daily"
[plans.open]
limits = []
[plans.daily]
limits = [
  { dimension = "cost_micros", capacity = 20_000_000, window = "sliding", period = "24h", slices = 24 },
  { dimension = "concurrent", capacity = 1000 },
]
[plans.gauge]
limits = [{ dimension = "concurrent", capacity = 4 }]
"#;
