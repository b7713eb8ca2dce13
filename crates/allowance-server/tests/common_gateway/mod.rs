//! The gateway's test harness: a stub upstream (`allowance_stub::Stub`)
//! and a gateway server, both in-process on 127.0.0.1:0, called over real
//! HTTP with reqwest. Each test starts its own pair, with an upstream name
//! of its own: the metrics recorder is process-wide, and a name shared by
//! two tests would mix their gauges and counters.
//!
//! What the ledger did is read back the way an operator would: scope
//! status (`GET /v1/scopes/…`) and the usage log (`GET /v1/usage`), never
//! the gateway's internals.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use allowance_core::EmbeddedStore;
use allowance_server::gateway::Gateway;
use allowance_server::{AppState, Credentials, Options, RandomIds, SystemClock, serve};
use allowance_stub::{BehaviorPatch, Stub};
use serde_json::{Value, json};
use tokio::net::TcpListener;

/// The gateway key of user bob in tenant acme (may add agent and task
/// scopes).
pub const KEY: &str = "gw-key-bob-7f3a";
/// A key of user carol in tenant acme that may add only agent scopes.
pub const KEY_NARROW: &str = "gw-key-carol-91c2";
/// The key the gateway sends upstream (`api_key_env`), never a client's.
pub const UPSTREAM_KEY: &str = "sk-upstream-only-5d1e";
/// The caller scope every call of [`KEY`] counts on besides its tenant.
pub const BOB: &str = "tenant:acme/user:bob";
/// gpt-4o's prices in micros per million tokens (as configured below).
pub const GPT4O_IN_MICROS: u64 = 2_500_000;
/// gpt-4o's output price in micros per million tokens.
pub const GPT4O_OUT_MICROS: u64 = 10_000_000;
/// The `max_output_tokens` of model `gpt-tiny` (priced as gpt-4o): small,
/// so a call that names no bound outgrows it in a few dozen events.
pub const TINY_MAX_OUTPUT: u64 = 40;
/// claude-x's input price in micros per million tokens.
pub const CLAUDE_IN_MICROS: u64 = 3_000_000;
/// claude-x's output price in micros per million tokens.
pub const CLAUDE_OUT_MICROS: u64 = 15_000_000;

/// How a test's gateway is configured.
#[derive(Clone, Debug)]
pub struct Setup {
    /// The upstream's name (unique per test: see the module doc).
    pub upstream: String,
    /// `limits = [...]` of the user plan (bob and carol).
    pub user_limits: String,
    /// `limits = [...]` of the agent plan.
    pub agent_limits: String,
    /// `limits = [...]` of the task plan.
    pub task_limits: String,
    /// `gateway.stream_tranche_tokens`.
    pub tranche_tokens: u64,
    /// `gateway.max_body_bytes`.
    pub max_body_bytes: Option<u64>,
    /// The upstream's `models` (a TOML array).
    pub models: String,
    /// The upstream's `max_retries`.
    pub max_retries: Option<u32>,
    /// The upstream's `max_concurrent`.
    pub max_concurrent: Option<u64>,
    /// The upstream's `requests_per_minute`.
    pub requests_per_minute: Option<u64>,
    /// Where the upstream is (default: the stub).
    pub base_url: Option<String>,
    /// `[reservations] default_ttl_ms`.
    pub default_ttl_ms: Option<u64>,
    /// `[queue] max_wait_ms` (default: the server's).
    pub max_wait_ms: Option<u64>,
}

impl Setup {
    /// A roomy gateway on a wildcard upstream named `upstream`.
    pub fn new(upstream: &str) -> Setup {
        Setup {
            upstream: upstream.to_string(),
            user_limits: r#"[{ dimension = "tokens", capacity = 1000000, window = "total" }]"#
                .to_string(),
            agent_limits: "[]".to_string(),
            task_limits: "[]".to_string(),
            tranche_tokens: 8,
            max_body_bytes: None,
            models: r#"["*"]"#.to_string(),
            max_retries: None,
            max_concurrent: None,
            max_wait_ms: None,
            requests_per_minute: None,
            base_url: None,
            default_ttl_ms: None,
        }
    }

    /// The configuration file.
    pub fn toml(&self, base_url: &str) -> String {
        let mut gateway = format!(
            "[gateway]\nstream_tranche_tokens = {}\n",
            self.tranche_tokens
        );
        if let Some(b) = self.max_body_bytes {
            gateway.push_str(&format!("max_body_bytes = {b}\n"));
        }
        let mut upstream = format!(
            "[[gateway.upstreams]]\nname = \"{}\"\nbase_url = \"{base_url}\"\napi_key_env = \"GW_TEST_UPSTREAM_KEY\"\nmodels = {}\n",
            self.upstream, self.models
        );
        if let Some(r) = self.max_retries {
            upstream.push_str(&format!("max_retries = {r}\n"));
        }
        if let Some(c) = self.max_concurrent {
            upstream.push_str(&format!("max_concurrent = {c}\n"));
        }
        if let Some(r) = self.requests_per_minute {
            upstream.push_str(&format!("requests_per_minute = {r}\n"));
        }
        let reservations = match self.default_ttl_ms {
            Some(ttl) => format!("[reservations]\ndefault_ttl_ms = {ttl}\n"),
            None => String::new(),
        };
        format!(
            r#"
{reservations}
[kinds.user]
plan = "u"
[kinds.agent]
plan = "a"
[kinds.task]
plan = "t"
[plans.u]
limits = {user}
[plans.a]
limits = {agent}
[plans.t]
limits = {task}
[models."gpt-4o"]
input_per_million = "2.50"
output_per_million = "10.00"
max_output_tokens = 16384
[models."claude-x"]
input_per_million = "3.00"
output_per_million = "15.00"
max_output_tokens = 8192
[models."gpt-tiny"]
input_per_million = "2.50"
output_per_million = "10.00"
max_output_tokens = {TINY_MAX_OUTPUT}
{gateway}
{upstream}
[[gateway.keys]]
sha256 = "{bob}"
tenant = "acme"
user = "bob"
client_scopes = ["agent", "task"]
[[gateway.keys]]
sha256 = "{carol}"
tenant = "acme"
user = "carol"
client_scopes = ["agent"]
"#,
            user = self.user_limits,
            agent = self.agent_limits,
            task = self.task_limits,
            bob = allowance_server::token_sha256_hex(KEY),
            carol = allowance_server::token_sha256_hex(KEY_NARROW),
        )
    }
}

/// A running stub and gateway, and a client for both.
pub struct Gw {
    /// The upstream.
    pub stub: Stub,
    /// `http://127.0.0.1:PORT` of the gateway.
    pub base: String,
    /// A client without a default timeout (each call sets its own).
    pub client: reqwest::Client,
    /// The upstream's name (`upstream:<name>` is its shared scope).
    pub upstream: String,
    /// The server's state (kept alive with the test).
    pub state: AppState,
}

/// One answer, read whole.
#[derive(Debug)]
pub struct Reply {
    /// Its status.
    pub status: u16,
    /// Its headers.
    pub headers: reqwest::header::HeaderMap,
    /// Its body as text.
    pub text: String,
}

impl Reply {
    /// The body as JSON (panics with the text when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text)
            .unwrap_or_else(|e| panic!("not JSON ({e}): status {} {:?}", self.status, self.text))
    }

    /// A header's value, if present.
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("an ASCII header").to_string())
    }
}

/// One server-sent event as a client sees it.
#[derive(Debug, Clone)]
pub struct Sse {
    /// The `event:` line.
    pub name: Option<String>,
    /// The `data:` lines joined by `\n`.
    pub data: String,
}

impl Sse {
    /// The data as JSON, when it is.
    pub fn json(&self) -> Option<Value> {
        serde_json::from_str(&self.data).ok()
    }
}

/// Splits an SSE body into events.
pub fn sse_events(body: &str) -> Vec<Sse> {
    let normalized = body.replace("\r\n", "\n");
    normalized
        .split("\n\n")
        .filter(|block| !block.trim().is_empty())
        .map(|block| {
            let mut name = None;
            let mut data: Option<String> = None;
            for line in block.lines() {
                let (field, value) = match line.split_once(':') {
                    Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                    None => (line, ""),
                };
                match field {
                    "event" => name = Some(value.to_string()),
                    "data" => match &mut data {
                        Some(d) => {
                            d.push('\n');
                            d.push_str(value);
                        }
                        None => data = Some(value.to_string()),
                    },
                    _ => {}
                }
            }
            Sse {
                name,
                data: data.unwrap_or_default(),
            }
        })
        .collect()
}

/// The content tokens of a chat stream's chunks (`" hello"` each from
/// the stub), in order.
pub fn chat_content(events: &[Sse]) -> String {
    let mut out = String::new();
    for e in events {
        if let Some(v) = e.json()
            && let Some(choices) = v["choices"].as_array()
        {
            for c in choices {
                if let Some(s) = c["delta"]["content"].as_str() {
                    out.push_str(s);
                }
            }
        }
    }
    out
}

/// Counts `" hello"` words in a text the stub produced.
pub fn hellos(text: &str) -> u64 {
    text.matches(allowance_stub::OUTPUT_WORD).count() as u64
}

/// The model table's cost: 128-bit, rounded up once (SEMANTICS.md 13).
pub fn cost_micros(input: u64, output: u64, in_price: u64, out_price: u64) -> u64 {
    let total =
        u128::from(input) * u128::from(in_price) + u128::from(output) * u128::from(out_price);
    u64::try_from(total.div_ceil(1_000_000)).expect("a cost in range")
}

/// A chat body with one user message.
pub fn chat(content: &str, max_tokens: u64) -> Value {
    json!({
        "model": "gpt-4o",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": content}
        ],
        "max_tokens": max_tokens
    })
}

/// The stub formula's prompt tokens for a chat body (computed by the stub's
/// own implementation, independent of the gateway's estimator).
pub fn stub_chat_tokens(body: &Value) -> u64 {
    allowance_stub::formula::chat_input_tokens(body.as_object().expect("an object"))
        .expect("a valid chat body")
}

impl Gw {
    /// Starts a stub and a gateway configured by `setup`.
    pub async fn start(setup: Setup) -> Gw {
        Gw::start_on(setup, |catalog| async move {
            let store: Arc<dyn allowance_core::Store> = Arc::new(EmbeddedStore::new(
                catalog,
                16,
                Arc::new(SystemClock::default()),
                Arc::new(RandomIds),
            ));
            store
        })
        .await
    }

    /// [`Gw::start`] on the durable store in `data_dir`, its files through
    /// `fs` (the real file system, or one that fails on demand).
    pub async fn start_durable(
        setup: Setup,
        fs: Arc<dyn allowance_wal::FileSystem>,
        data_dir: &std::path::Path,
    ) -> Gw {
        let path = data_dir.to_owned();
        Gw::start_on(setup, |catalog| async move {
            let (store, _) = allowance_durable::DurableStore::open(
                catalog,
                allowance_durable::DurableOptions::new(&path),
                fs,
                Arc::new(SystemClock::default()),
                Arc::new(RandomIds),
                |_| {},
            )
            .await
            .expect("the store opens");
            let store: Arc<dyn allowance_core::Store> = Arc::new(store);
            store
        })
        .await
    }

    /// [`Gw::start`] on the store `make_store` builds from the catalog.
    pub async fn start_on<F, Fut>(setup: Setup, make_store: F) -> Gw
    where
        F: FnOnce(allowance_core::Catalog) -> Fut,
        Fut: std::future::Future<Output = Arc<dyn allowance_core::Store>>,
    {
        let stub = Stub::spawn("127.0.0.1:0".parse().expect("an address"))
            .await
            .expect("the stub starts");
        let base_url = setup.base_url.clone().unwrap_or_else(|| stub.base_url());
        let toml = setup.toml(&base_url);
        let config = allowance_config::parse(&toml, "gw.toml")
            .unwrap_or_else(|e| panic!("a valid config: {e:?}\n{toml}"));
        let settings = config.gateway.clone().expect("a [gateway] section");
        let gateway = Gateway::with_env(&settings, |name| {
            (name == "GW_TEST_UPSTREAM_KEY").then(|| UPSTREAM_KEY.to_string())
        })
        .expect("the gateway resolves");
        let store = make_store(config.catalog.clone()).await;
        let mut options = Options {
            gateway: Some(Arc::new(gateway)),
            sweep_interval: Duration::from_millis(50),
            ..Options::default()
        };
        if let Some(ms) = setup.max_wait_ms {
            options.max_wait_ms = ms;
        }
        let state = AppState::new(store, Credentials::default(), options);
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("an address"));
        tokio::spawn(serve(listener, state.clone(), std::future::pending()));
        Gw {
            stub,
            base,
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .build()
                .expect("a client"),
            upstream: setup.upstream,
            state,
        }
    }

    /// A full URL on the gateway.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `upstream:<name>`.
    pub fn upstream_scope(&self) -> String {
        format!("upstream:{}", self.upstream)
    }

    /// A POST with bob's key.
    pub fn post(&self, path: &str) -> reqwest::RequestBuilder {
        self.client
            .post(self.url(path))
            .bearer_auth(KEY)
            .timeout(Duration::from_secs(20))
    }

    /// A model call with bob's key, read whole.
    pub async fn call(&self, path: &str, body: &Value) -> Reply {
        read(self.post(path).json(body)).await
    }

    /// A stub behaviour change.
    pub fn behave(&self, patch: BehaviorPatch) {
        self.stub.set_behavior(&patch).expect("a valid behaviour");
    }

    /// `GET /v1/scopes/{scope}`.
    pub async fn scope(&self, scope: &str) -> Value {
        let r = read(self.client.get(self.url(&format!("/v1/scopes/{scope}")))).await;
        assert_eq!(r.status, 200, "scope {scope}: {}", r.text);
        r.json()
    }

    /// `(used, held)` of `dimension` on `scope` (panics when the scope has
    /// no limit on it).
    pub async fn limit(&self, scope: &str, dimension: &str) -> (u64, u64) {
        let s = self.scope(scope).await;
        let l = s["limits"]
            .as_array()
            .expect("limits")
            .iter()
            .find(|l| l["dimension"] == dimension)
            .unwrap_or_else(|| panic!("no {dimension} limit on {scope}: {s}"));
        (
            l["used"].as_u64().expect("used"),
            l["held"].as_u64().expect("held"),
        )
    }

    /// HELD reservations on `scope`.
    pub async fn held_reservations(&self, scope: &str) -> u64 {
        self.scope(scope).await["held_reservations"]
            .as_u64()
            .expect("held_reservations")
    }

    /// Waits (up to 5 s) until nothing is held on the tenant and the
    /// upstream; panics with what is left otherwise.
    pub async fn wait_nothing_held(&self) {
        let started = Instant::now();
        loop {
            let tenant = self.held_reservations("tenant:acme").await;
            let up = self.held_reservations(&self.upstream_scope()).await;
            if tenant == 0 && up == 0 {
                return;
            }
            if started.elapsed() > Duration::from_secs(5) {
                panic!(
                    "holds left after 5 s: tenant:acme {tenant}, {} {up}; usage log: {:#?}",
                    self.upstream_scope(),
                    self.usage_log().await
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// The whole usage log, oldest first.
    pub async fn usage_log(&self) -> Vec<Value> {
        let r = read(self.client.get(self.url("/v1/usage?limit=10000"))).await;
        assert_eq!(r.status, 200, "usage log: {}", r.text);
        r.text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect()
    }

    /// Usage log records of the callers (tenant acme).
    pub async fn caller_records(&self) -> Vec<Value> {
        self.usage_log()
            .await
            .into_iter()
            .filter(|r| r["tenant"] == "acme")
            .collect()
    }

    /// Usage log records of upstream attempts (the internal tenant).
    pub async fn attempt_records(&self) -> Vec<Value> {
        self.usage_log()
            .await
            .into_iter()
            .filter(|r| r["tenant"] == "~gateway")
            .collect()
    }

    /// Waits (up to 5 s) until the caller records number `n`, and returns them.
    pub async fn wait_caller_records(&self, n: usize) -> Vec<Value> {
        let started = Instant::now();
        loop {
            let records = self.caller_records().await;
            if records.len() >= n {
                return records;
            }
            if started.elapsed() > Duration::from_secs(5) {
                panic!(
                    "{} caller records after 5 s, wanted {n}: {records:#?}",
                    records.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Gives `upstream:<name>` exact counters: `total` limits (never
    /// refilling, unlike the per-minute buckets) far above what a test
    /// uses, so `used` is the exact sum of what attempts were charged.
    pub async fn count_upstream_exactly(&self) {
        let limits = json!({"limits": [
            {"dimension": "requests", "capacity": 1_000_000, "window": "total"},
            {"dimension": "input_tokens", "capacity": 1_000_000_000u64, "window": "total"},
            {"dimension": "output_tokens", "capacity": 1_000_000_000u64, "window": "total"},
        ]});
        let r = read(
            self.client
                .put(self.url(&format!("/v1/scopes/{}", self.upstream_scope())))
                .json(&limits),
        )
        .await;
        assert_eq!(
            r.status,
            200,
            "override {}: {}",
            self.upstream_scope(),
            r.text
        );
    }

    /// `/metrics` as text.
    pub async fn metrics(&self) -> String {
        let r = read(self.client.get(self.url("/metrics"))).await;
        assert_eq!(r.status, 200);
        r.text
    }

    /// The value of one sample of `/metrics` whose line starts with `name{`
    /// and contains every `label="value"` of `labels`.
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let text = self.metrics().await;
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
            .find(|l| {
                labels
                    .iter()
                    .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }
}

/// Sends a request and reads the whole answer.
pub async fn read(req: reqwest::RequestBuilder) -> Reply {
    let resp = req.send().await.expect("the request is answered");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.expect("a body");
    Reply {
        status,
        headers,
        text,
    }
}

/// Tries to read a whole answer; `Err` when the connection failed or the
/// body broke off.
pub async fn try_read(req: reqwest::RequestBuilder) -> Result<Reply, reqwest::Error> {
    let resp = req.send().await?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await?;
    Ok(Reply {
        status,
        headers,
        text,
    })
}

/// A finite `(used, held)` for a limit's `tokens`, etc.: the caller's
/// record for a reservation (its `held` and `charged` amounts).
pub fn amount(record: &Value, which: &str, dimension: &str) -> u64 {
    record[which][dimension].as_u64().unwrap_or(0)
}
