//! The server's settings: `[server]`, `[store]`, `[queue]`, credentials and
//! the gateway. Every field has the default CONFIG.md's sample shows.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

/// `[server]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerSettings {
    /// Where the HTTP API listens (default `127.0.0.1:8787`: loopback, so a
    /// server without credentials is not reachable from elsewhere).
    pub listen: SocketAddr,
}

/// The default listen address.
pub const DEFAULT_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 8787);

impl Default for ServerSettings {
    fn default() -> Self {
        ServerSettings {
            listen: DEFAULT_LISTEN,
        }
    }
}

/// Which store keeps the ledger.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StoreKind {
    /// In the process, with a write-ahead log in `data_dir` (or memory only).
    #[default]
    Embedded,
    /// A Redis server (single node, Sentinel or cluster).
    Redis,
}

/// What a reserve does when the store does not answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnError {
    /// Refuse with 503: never spend what cannot be counted.
    #[default]
    FailClosed,
    /// Admit against `fail_open_fraction` of each capacity, per process.
    FailOpenLocal,
}

/// When the embedded store's log reaches the disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fsync {
    /// Before every answer.
    #[default]
    Always,
    /// Grouped: a crash may lose the last few milliseconds.
    Batch,
    /// Left to the operating system.
    Never,
}

impl Fsync {
    /// The name the file uses (`always`, `batch`, `never`).
    pub fn as_str(self) -> &'static str {
        match self {
            Fsync::Always => "always",
            Fsync::Batch => "batch",
            Fsync::Never => "never",
        }
    }
}

impl std::fmt::Display for Fsync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `[store]`.
#[derive(Clone, Debug, PartialEq)]
pub struct StoreSettings {
    /// Embedded (default) or Redis.
    pub kind: StoreKind,
    /// Embedded: where the log and snapshots live; `None` keeps everything
    /// in memory (`data_dir = ""`). Relative paths are relative to the
    /// server's working directory, like `--data-dir`. Default
    /// `./allowance-data` for the embedded store, `None` for Redis.
    pub data_dir: Option<PathBuf>,
    /// Redis: the server's URL (required for Redis, refused otherwise).
    pub url: Option<String>,
    /// fail_closed (default) or fail_open_local.
    pub on_error: OnError,
    /// Embedded: always (default), batch or never.
    pub fsync: Fsync,
    /// Bound on every store call, in ms (default 1000).
    pub timeout_ms: u64,
    /// fail_open_local: share of each capacity one process may admit
    /// (default 0.1, above 0 and at most 1).
    pub fail_open_fraction: f64,
}

/// The embedded store's directory when the file names none.
pub const DEFAULT_DATA_DIR: &str = "./allowance-data";

impl Default for StoreSettings {
    fn default() -> Self {
        StoreSettings {
            kind: StoreKind::Embedded,
            data_dir: Some(PathBuf::from(DEFAULT_DATA_DIR)),
            url: None,
            on_error: OnError::FailClosed,
            fsync: Fsync::Always,
            timeout_ms: 1000,
            fail_open_fraction: 0.1,
        }
    }
}

/// `[queue]`: bounds of the admission queue (HTTP-API.md answer 9).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueSettings {
    /// Waiters one tenant may have at once (default 1000).
    pub max_waiters_per_tenant: usize,
    /// Waiters in all (default 100,000).
    pub max_waiters: usize,
    /// Largest `wait_ms` a reserve may ask for (default 60 s).
    pub max_wait_ms: u64,
}

impl Default for QueueSettings {
    fn default() -> Self {
        QueueSettings {
            max_waiters_per_tenant: 1000,
            max_waiters: 100_000,
            max_wait_ms: 60_000,
        }
    }
}

/// What an API token may do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// Everything, the admin plane included.
    Admin,
    /// The data plane of this one tenant.
    Tenant(String),
}

/// One `[[tokens]]` entry: the SHA-256 of a bearer token (never the token).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenSpec {
    /// SHA-256 of the token's bytes.
    pub sha256: [u8; 32],
    /// What the token may do.
    pub role: Role,
}

/// `[gateway]`: the OpenAI/Anthropic-compatible proxy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewaySettings {
    /// Output tokens a streaming call reserves at a time (default 1024).
    pub stream_tranche_tokens: u64,
    /// Largest request body on gateway routes (default 32 MiB).
    pub max_body_bytes: usize,
    /// The upstream providers.
    pub upstreams: Vec<UpstreamSettings>,
    /// The gateway's client keys (separate from `[[tokens]]`).
    pub keys: Vec<GatewayKey>,
}

/// One `[[gateway.upstreams]]` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamSettings {
    /// Its name: the shared scope `upstream:<name>` counts its use.
    pub name: String,
    /// `https://api.openai.com` (without `/v1`: the path is appended as received).
    pub base_url: String,
    /// The environment variable holding its API key (`None`: sent without one).
    pub api_key_env: Option<String>,
    /// Models routed to it; `"*"` takes every model no other upstream lists.
    pub models: Vec<String>,
    /// The provider's own request rate limit, per minute.
    pub requests_per_minute: Option<u64>,
    /// The provider's input-token rate limit, per minute.
    pub input_tokens_per_minute: Option<u64>,
    /// The provider's output-token rate limit, per minute.
    pub output_tokens_per_minute: Option<u64>,
    /// Calls in flight at once.
    pub max_concurrent: Option<u64>,
    /// Retries of an upstream 429 or 5xx (default 2).
    pub max_retries: u32,
}

/// One `[[gateway.keys]]` entry: a client key mapped to its scopes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewayKey {
    /// SHA-256 of the key.
    pub sha256: [u8; 32],
    /// The tenant its calls count against.
    pub tenant: String,
    /// A user scope every call also counts against.
    pub user: Option<String>,
    /// An agent scope every call also counts against.
    pub agent: Option<String>,
    /// Kinds the client may add per call (`X-Allowance-Agent`, `-Task`).
    pub client_scopes: Vec<String>,
}
