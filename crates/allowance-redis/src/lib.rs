//! # allowance-redis — many servers, one ledger
//!
//! [`RedisStore`] implements [`Store`] on a Redis (or Valkey) server, so
//! several `allowance serve` processes behind a load balancer share one
//! ledger and still never overspend.
//!
//! Each operation is **one atomic script** (`ledger.lua`, a Redis function
//! library called with FCALL, loaded where missing) that checks every scope and limit before
//! its first write. The Rust side does what needs the catalog or 128-bit
//! arithmetic: it validates the request exactly as the engine does
//! ([`prepare_reserve`], [`settle_charges`]), resolves each scope's plan to
//! a list of limits, prices models and computes calendar boundaries in IANA
//! zones; the script keeps the state and applies the window arithmetic.
//!
//! - **Round trips** — a reserve, refund and get cost one; a settle and an
//!   extend two (a read of the record, whose model, hold and policy decide
//!   the charges, then the script, which refuses if an extend changed the
//!   record meanwhile — the settle then starts over).
//! - **Time** — from the Redis server (`TIME`) in production, so instances
//!   with skewed clocks agree; a [`Clock`] given to the store is passed to
//!   the script instead (tests).
//! - **Keys** — every key of a tenant carries the hash tag of its 8-bit
//!   tenant tag (`{t3f}`), the one a [`ReservationId`] carries too, so a
//!   settle finds the record from the id alone. Scopes hold compact
//!   MessagePack blobs; an idle scope's key expires when its windows empty.
//! - **Expiry** — each tenant group keeps its HELD reservations in a sorted
//!   set by expiry, and each scope its holders; every operation expires what
//!   is due among what it touches, and [`Store::expire_due`] sweeps the 256
//!   groups. Nothing scans all reservations or scopes.
//! - **Catalog** — admin changes are appended to a list in Redis with a
//!   compare-and-set on its length, then every group is told the new
//!   version; every script call carries the version its limits were
//!   resolved with and is refused (before any write) when its group knows
//!   a newer one, so a change applies everywhere by each instance's next
//!   operation.
//! - **Usage log** — a stream per group written by the same scripts, read
//!   as one log merged by entry id.
//! - **Cluster** — detected at connect; each script runs in one group's
//!   slot, and a reservation on a shared scope takes one script per slot
//!   (see `cross.rs` and docs/REDIS-STORE.md).

#![forbid(unsafe_code)]

mod cross;
mod fail_open;
mod wire;

pub use fail_open::{FailOpenLocal, HANDOVER};

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use allowance_core::{
    AdminError, Amounts, Catalog, CatalogChange, Clock, Denial, DenialKind, Dimension, ExtendError,
    Granted, IdSource, Invalid, LimitStatus, MAX_USAGE_PAGE, RefundError, Remaining, Reservation,
    ReservationId, ReserveError, ReserveRequest, ScopeKey, ScopeStatus, SettleError, Status, Store,
    StoreError, StoreStats, Timestamp, Unavailable, Usage, UsageEvent, UsageKind, UsagePage,
    UsageRecord, WindowKind, check_adjust, check_extend, extend_delta, prepare_reserve,
    settle_charges,
};
use async_trait::async_trait;
use parking_lot::RwLock;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};

pub use allowance_core::Adjustment;

use crate::wire::{
    AdjOut, LimOut, LimSpec, Rec, Reply, Req, ScopeSpec, fingerprint, named, overrun_name,
    recorded, status_of,
};

/// The ledger's function library, loaded once per server (FUNCTION LOAD)
/// and called with FCALL.
const LEDGER_LUA: &str = include_str!("ledger.lua");

/// The ledger library as loaded: named after a hash of its text, so two
/// versions of allowance sharing a Redis (a rolling upgrade) each call
/// their own.
struct LedgerFunction {
    name: String,
    code: String,
}

impl LedgerFunction {
    fn new() -> Self {
        // FNV-1a: stable across builds and processes.
        let hash = LEDGER_LUA.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        let name = format!("allowance_ledger_{hash:016x}");
        let code = LEDGER_LUA
            .replacen("LIBRARY_NAME", &format!("allowance_{hash:016x}"), 1)
            .replacen("FUNCTION_NAME", &name, 1);
        LedgerFunction { name, code }
    }

    /// FCALL, loading the library first where the server lacks it (a new
    /// or restarted server, a new cluster node, a FUNCTION FLUSH).
    async fn call<T: redis::FromRedisValue>(
        &self,
        conn: &mut Conn,
        key: &str,
        body: &[u8],
    ) -> redis::RedisResult<T> {
        let mut fcall = redis::cmd("FCALL");
        fcall.arg(&self.name).arg(1).arg(key).arg(body);
        match fcall.query_async(conn).await {
            Err(e) if e.to_string().contains("Function not found") => {
                let () = redis::cmd("FUNCTION")
                    .arg("LOAD")
                    .arg("REPLACE")
                    .arg(&self.code)
                    .query_async::<String>(conn)
                    .await
                    .map(|_| ())?;
                fcall.query_async(conn).await
            }
            other => other,
        }
    }
}

/// Attempts at an operation that the script asked to start over (the
/// catalog changed, a calendar boundary passed, an extend raced a settle).
const MAX_ATTEMPTS: usize = 8;

/// Attempts at a settle or an extend whose record other extends keep
/// changing between its read and its script. A settle starts over at once
/// and an extend only after [`contention_pause`], so settles win such races
/// (a stream of extends starved them into 503s); each attempt is two round
/// trips, so this is tens of milliseconds at worst.
const MAX_CONTENDED_ATTEMPTS: usize = 256;

/// A random pause of up to a millisecond for an extend that lost a race for
/// its record: extenders spread out and a settle finds the record still.
fn contention_pause() -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    Duration::from_micros(random % 1_000)
}

/// How a [`RedisStore`] connects and names its keys.
#[derive(Clone, Debug)]
pub struct RedisOptions {
    /// `redis://host:port/db` (or `rediss://` for TLS).
    pub url: String,
    /// Prepended to every key, so several ledgers can share one Redis.
    pub prefix: String,
    /// Bound on every call: a stalled Redis answers 503 after this long.
    pub timeout_ms: u64,
    /// The usage stream's length is kept near this (the oldest go first).
    pub usage_max_records: u64,
}

impl RedisOptions {
    /// Options for `url` with the defaults: prefix `allowance:`, 1 s
    /// timeout, 10 million usage records.
    pub fn new(url: impl Into<String>) -> Self {
        RedisOptions {
            url: url.into(),
            prefix: "allowance:".into(),
            timeout_ms: 1000,
            usage_max_records: 10_000_000,
        }
    }
}

/// `url` with its password hidden (`redis://user:***@host`), for messages
/// and logs: a store's errors never carry the secret.
///
/// ```
/// use allowance_redis::redacted_url;
/// assert_eq!(redacted_url("redis://:s3cret@r:6379/0"), "redis://:***@r:6379/0");
/// assert_eq!(redacted_url("redis+sentinel://app:pw@s1:26379/m"), "redis+sentinel://app:***@s1:26379/m");
/// assert_eq!(redacted_url("redis://r:6379"), "redis://r:6379");
/// ```
pub fn redacted_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                // A lone name may be a password (redis-rs reads it as a
                // user, but people write `redis://secret@host`).
                None => format!("{}***{}", &url[..scheme + 3], &url[at..]),
            }
        }
        _ => url.to_string(),
    }
}

/// Why a store could not start.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL does not parse.
    #[error("store.url: {0}")]
    Url(String),
    /// Redis did not answer.
    #[error("cannot reach Redis at {url}: {why}")]
    Unreachable {
        /// The URL tried.
        url: String,
        /// What failed.
        why: String,
    },
}

impl ConnectError {
    /// What failed, without the URL (it may hold a password): for messages
    /// that repeat, such as a reconnection's.
    fn reason(self) -> String {
        match self {
            ConnectError::Unreachable { why, .. } | ConnectError::Url(why) => why,
        }
    }
}

/// Whether `e` says the server could not be reached or stopped answering
/// (as opposed to an answer the server gave).
fn connection_trouble(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout()
}

/// The catalog in force here: the configured one with the admin changes
/// kept in Redis applied, and how many of them.
struct Current {
    catalog: Arc<Catalog>,
    version: u64,
}

/// A [`Store`] on Redis. Cheap to share: one multiplexed connection.
pub struct RedisStore {
    /// Swapped when Sentinel names a new master; cloned out for each call
    /// (never held across one).
    conn: parking_lot::RwLock<Conn>,
    /// Set before a cluster connection is installed (never unset).
    cluster: std::sync::atomic::AtomicBool,
    /// Held while [`connect_now`](RedisStore::connect_now) dials.
    dialing: tokio::sync::Mutex<()>,
    /// Cluster only: since when (ms since the epoch) calls have failed as
    /// if the cluster were unreachable, 0 while they succeed; the sweeper
    /// rebuilds the cluster client when this lasts ([`CLUSTER_HEAL_AFTER`]).
    cluster_failing_since_ms: std::sync::atomic::AtomicU64,
    /// When the cluster client was last rebuilt (ms since the epoch).
    cluster_rebuilt_at_ms: std::sync::atomic::AtomicU64,
    /// Where the master is found again after a failover (Sentinel only).
    sentinel: Option<SentinelSource>,
    /// How a Sentinel-named master is connected to (timeouts).
    direct: redis::AsyncConnectionConfig,
    /// When this instance last asked the sentinels (ms since the epoch).
    resolved_at_ms: std::sync::atomic::AtomicU64,
    /// The URL connected to (for the room-freed subscription).
    url: String,
    ledger: LedgerFunction,
    prefix: String,
    clock: Option<Arc<dyn Clock>>,
    ids: Arc<dyn IdSource>,
    current: RwLock<Current>,
    /// The configuration file's catalog (a reverted plan returns to it).
    configured: Arc<Catalog>,
    timeout: Duration,
    usage_max: u64,
    /// Records of reservations this instance granted and has not seen end
    /// (bounded: cleared when full), so their settle costs one round trip.
    recent: parking_lot::Mutex<std::collections::HashMap<ReservationId, Rec>>,
    /// Cluster only: releases of a refused reservation's shared holds not
    /// known to have landed, by reservation id (see
    /// [`cross::PendingRelease`]).
    releases: parking_lot::Mutex<std::collections::HashMap<String, cross::PendingRelease>>,
}

/// How long calls to a cluster must keep failing before the sweeper
/// rebuilds the cluster client, and the least time between two rebuilds:
/// redis-rs's client can stay stuck refreshing its slot map after a node
/// was killed and restarted, every call timing out although the cluster is
/// healthy again (found by an audit; `the_store_answers_again_after_a_node_restarts`).
const CLUSTER_HEAL_AFTER: Duration = Duration::from_secs(2);

/// How many granted records an instance remembers for one-round-trip settles.
const RECENT_RECORDS: usize = 65_536;

/// One multiplexed connection: to a single node (re-established by
/// itself), or to a cluster (routed by each command's first key).
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    /// Through Sentinel: a connection that never reconnects by itself. A
    /// ConnectionManager would dial the old master's address again after a
    /// failover, and whatever answers there (the old master restarted empty,
    /// or another server given the port) would take writes the promoted
    /// replica never sees. Once this one breaks, only the sentinels say where
    /// to go (`after_failure`), and redis-rs checks the ROLE of what they name.
    Sentinel(MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
    /// Not connected yet ([`RedisStore::connect_later`] while Redis could
    /// not be reached): every call fails at once, as a connection refused
    /// would, until [`RedisStore::connect_now`] succeeds.
    Down,
}

/// What a call on [`Conn::Down`] answers: an I/O error, like a refused
/// connection, so every caller treats it as Redis being unreachable.
fn not_connected() -> redis::RedisError {
    redis::RedisError::from(std::io::Error::new(
        std::io::ErrorKind::NotConnected,
        "not connected yet (Redis was unreachable when this instance started)",
    ))
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Sentinel(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Down => Box::pin(async { Err(not_connected()) }),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Down => Box::pin(async { Err(not_connected()) }),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Sentinel(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
            Conn::Down => 0,
        }
    }
}

/// `redis+sentinel://[user:password@]host:port[,host:port…]/master_name[/db]`:
/// the sentinels to ask, and what to ask them for.
struct SentinelSource {
    sentinels: Vec<String>,
    master_name: String,
    node: redis::sentinel::SentinelNodeConnectionInfo,
}

impl SentinelSource {
    /// `None` for a URL that names no sentinels.
    fn parse(url: &str) -> Result<Option<SentinelSource>, ConnectError> {
        let Some(rest) = url.strip_prefix("redis+sentinel://") else {
            if url.starts_with("rediss+sentinel://") {
                return Err(ConnectError::Url(
                    "TLS through Sentinel (rediss+sentinel://) is not supported yet".into(),
                ));
            }
            return Ok(None);
        };
        let bad = |why: &str| {
            ConnectError::Url(format!(
                "{why}: expected redis+sentinel://[user:password@]host:port[,host:port]/master_name[/db]"
            ))
        };
        let (auth, rest) = match rest.rsplit_once('@') {
            Some((auth, rest)) => (Some(auth), rest),
            None => (None, rest),
        };
        let (hosts, path) = rest.split_once('/').ok_or_else(|| bad("no master name"))?;
        let mut path = path.split('/');
        let master_name = path
            .next()
            .filter(|n| !n.is_empty())
            .ok_or_else(|| bad("no master name"))?;
        let db: i64 = match path.next() {
            None | Some("") => 0,
            Some(d) => d.parse().map_err(|_| bad("the database is not a number"))?,
        };
        let sentinels: Vec<String> = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| format!("redis://{h}"))
            .collect();
        if sentinels.is_empty() {
            return Err(bad("no sentinel address"));
        }
        let mut info = redis::RedisConnectionInfo::default().set_db(db);
        if let Some(auth) = auth {
            let (user, password) = auth.split_once(':').unwrap_or(("", auth));
            if !user.is_empty() {
                info = info.set_username(user);
            }
            info = info.set_password(password);
        }
        Ok(Some(SentinelSource {
            sentinels,
            master_name: master_name.to_string(),
            node: redis::sentinel::SentinelNodeConnectionInfo::default()
                .set_redis_connection_info(info),
        }))
    }

    /// A client for the master the sentinels name now.
    async fn master(&self) -> redis::RedisResult<redis::Client> {
        let mut client = redis::sentinel::SentinelClient::build(
            self.sentinels.clone(),
            self.master_name.as_str(),
            Some(self.node.clone()),
            redis::sentinel::SentinelServerType::Master,
        )?;
        client.async_get_client().await
    }
}

fn unavailable(e: impl std::fmt::Display) -> Unavailable {
    Unavailable(format!("redis: {e}"))
}

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl RedisStore {
    /// Connects, and catches up with the admin changes other instances
    /// made. `catalog` is the configuration (every instance should load the
    /// same); `clock` replaces the Redis server's time when given (tests).
    /// Fails if Redis cannot be reached within `options.timeout_ms`.
    pub async fn connect(
        options: RedisOptions,
        catalog: Catalog,
        clock: Option<Arc<dyn Clock>>,
        ids: Arc<dyn IdSource>,
    ) -> Result<RedisStore, ConnectError> {
        let store = RedisStore::connect_later(options, catalog, clock, ids)?;
        let conn = store.dial().await?;
        store.install(conn);
        store
            .catch_up()
            .await
            .map_err(|e| ConnectError::Unreachable {
                url: redacted_url(&store.url),
                why: e.0,
            })?;
        Ok(store)
    }

    /// A store that is not connected yet: only the URL is checked. Every
    /// call answers [`Unavailable`] at once until
    /// [`connect_now`](RedisStore::connect_now) succeeds, which
    /// [`expire_due`](Store::expire_due) (the server's sweeper) tries
    /// first. For a process that must start while Redis is down
    /// (`on_error = "fail_open_local"`); it runs on the configured catalog
    /// until it connects and catches up.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use allowance_core::{Catalog, SeededIds, Store};
    /// # use allowance_redis::{RedisOptions, RedisStore};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// // Nothing listens on port 1: the store still starts.
    /// let store = RedisStore::connect_later(
    ///     RedisOptions::new("redis://127.0.0.1:1"),
    ///     Catalog::default(),
    ///     None,
    ///     Arc::new(SeededIds::new(7)),
    /// )
    /// .unwrap();
    /// assert!(!store.is_connected());
    /// assert!(store.stats().await.is_err());
    /// # }
    /// ```
    pub fn connect_later(
        options: RedisOptions,
        catalog: Catalog,
        clock: Option<Arc<dyn Clock>>,
        ids: Arc<dyn IdSource>,
    ) -> Result<RedisStore, ConnectError> {
        // rediss:// needs a crypto provider; redis-rs picks none. (An
        // error only says one is installed already.)
        let _ = rustls::crypto::ring::default_provider().install_default();
        let timeout = Duration::from_millis(options.timeout_ms.max(1));
        let sentinel = SentinelSource::parse(&options.url)?;
        if sentinel.is_none() {
            redis::Client::open(options.url.as_str())
                .map_err(|e| ConnectError::Url(e.to_string()))?;
        }
        Ok(RedisStore {
            conn: parking_lot::RwLock::new(Conn::Down),
            cluster: std::sync::atomic::AtomicBool::new(false),
            dialing: tokio::sync::Mutex::new(()),
            cluster_failing_since_ms: std::sync::atomic::AtomicU64::new(0),
            cluster_rebuilt_at_ms: std::sync::atomic::AtomicU64::new(0),
            sentinel,
            direct: redis::AsyncConnectionConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout)),
            resolved_at_ms: std::sync::atomic::AtomicU64::new(wall_ms()),
            url: options.url,
            ledger: LedgerFunction::new(),
            prefix: options.prefix,
            clock,
            ids,
            configured: Arc::new(catalog.clone()),
            current: RwLock::new(Current {
                catalog: Arc::new(catalog),
                version: 0,
            }),
            timeout,
            usage_max: options.usage_max_records.max(1),
            recent: parking_lot::Mutex::default(),
            releases: parking_lot::Mutex::default(),
        })
    }

    /// Whether a connection is established (it then re-establishes itself
    /// after a failure; only [`connect_later`](RedisStore::connect_later)
    /// makes a store that has none).
    pub fn is_connected(&self) -> bool {
        !matches!(*self.conn.read(), Conn::Down)
    }

    /// Connects a store made by [`connect_later`](RedisStore::connect_later)
    /// and catches up with the admin changes kept in Redis; does nothing
    /// once connected. One attempt at a time: a call while another is
    /// dialing answers [`Unavailable`] at once.
    pub async fn connect_now(&self) -> Result<(), Unavailable> {
        if self.is_connected() {
            return Ok(());
        }
        let Ok(_dialing) = self.dialing.try_lock() else {
            return Err(Unavailable("redis: still connecting".into()));
        };
        if self.is_connected() {
            // Sentinel's failure path connected it meanwhile.
            return Ok(());
        }
        let conn = self
            .dial()
            .await
            .map_err(|e| Unavailable(format!("redis: {}", e.reason())))?;
        self.install(conn);
        tracing::warn!(
            cluster = self.is_cluster(),
            "redis: connected (it was unreachable when this instance started)"
        );
        self.catch_up().await
    }

    /// Opens the connection `self.url` names: through the sentinels, to a
    /// cluster (a node that says so), or to a single node.
    async fn dial(&self) -> Result<Conn, ConnectError> {
        let timeout = self.timeout;
        let unreachable = |why: String| ConnectError::Unreachable {
            url: redacted_url(&self.url),
            why,
        };
        let no_answer = || unreachable(format!("no answer within {} ms", timeout.as_millis()));
        if let Some(source) = &self.sentinel {
            let client = tokio::time::timeout(timeout * 2, source.master())
                .await
                .map_err(|_| unreachable("the sentinels did not answer in time".into()))?
                .map_err(|e| unreachable(e.to_string()))?;
            // A master Sentinel names is never a cluster node.
            let c = tokio::time::timeout(
                timeout,
                client.get_multiplexed_async_connection_with_config(&self.direct),
            )
            .await
            .map_err(|_| no_answer())?
            .map_err(|e| unreachable(e.to_string()))?;
            return Ok(Conn::Sentinel(c));
        }
        let client =
            redis::Client::open(self.url.as_str()).map_err(|e| ConnectError::Url(e.to_string()))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(5))
            .set_max_delay(Duration::from_millis(50));
        let single =
            tokio::time::timeout(timeout, ConnectionManager::new_with_config(client, config))
                .await
                .map_err(|_| no_answer())?
                .map_err(|e| unreachable(e.to_string()))?;
        // A cluster node says so; the cluster client then finds the others.
        let info: String = tokio::time::timeout(
            timeout,
            redis::cmd("INFO")
                .arg("cluster")
                .query_async(&mut single.clone()),
        )
        .await
        .map_err(|_| no_answer())?
        .map_err(|e| unreachable(e.to_string()))?;
        if !info.lines().any(|l| l.trim() == "cluster_enabled:1") {
            return Ok(Conn::Single(single));
        }
        let client = redis::cluster::ClusterClient::builder(vec![self.url.as_str()])
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .build()
            .map_err(|e| ConnectError::Url(e.to_string()))?;
        let c = tokio::time::timeout(timeout * 5, client.get_async_connection())
            .await
            .map_err(|_| unreachable("the cluster did not answer in time".into()))?
            .map_err(|e| unreachable(e.to_string()))?;
        Ok(Conn::Cluster(c))
    }

    /// Rebuilds the cluster client when calls have failed for
    /// [`CLUSTER_HEAL_AFTER`] (at most once per that long): a fresh client
    /// reads the slot map anew. A failed rebuild keeps the old client.
    async fn heal_cluster(&self) {
        use std::sync::atomic::Ordering;
        let since = self.cluster_failing_since_ms.load(Ordering::Relaxed);
        let heal_after_ms = CLUSTER_HEAL_AFTER.as_millis() as u64;
        let now = wall_ms();
        let last = self.cluster_rebuilt_at_ms.load(Ordering::Relaxed);
        if since == 0
            || now < since.saturating_add(heal_after_ms)
            || now < last.saturating_add(heal_after_ms)
            || self
                .cluster_rebuilt_at_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        match self.dial().await {
            Ok(conn @ Conn::Cluster(_)) => {
                self.install(conn);
                self.cluster_failing_since_ms.store(0, Ordering::Relaxed);
                tracing::warn!(
                    "redis: the cluster client kept failing; replaced it with a new one"
                );
            }
            Ok(_) => tracing::error!(
                "redis: the server at the configured URL is no longer a cluster node"
            ),
            Err(e) => tracing::warn!(
                error = %e.reason(),
                "redis: rebuilding the cluster client failed; trying again later"
            ),
        }
    }

    /// Makes `conn` the one every call uses. The cluster flag goes first: a
    /// call that read it as unset just before may still reach the cluster
    /// with a single node's script, which the cluster refuses (CROSSSLOT):
    /// an [`Unavailable`] at the instant of the first connection, never a
    /// wrong write.
    fn install(&self, conn: Conn) {
        if matches!(conn, Conn::Cluster(_)) {
            self.cluster
                .store(true, std::sync::atomic::Ordering::Release);
        }
        *self.conn.write() = conn;
    }

    fn conn(&self) -> Conn {
        self.conn.read().clone()
    }

    /// After a failed call through Sentinel: if the master may have moved
    /// (the connection failed, or it answers READONLY as a demoted master),
    /// asks the sentinels again — at most twice a second — and switches to
    /// the master they name.
    async fn after_failure(&self, e: Option<&redis::RedisError>) {
        if self.is_cluster() && e.is_none_or(|e| connection_trouble(e) || e.is_cluster_error()) {
            let _ = self.cluster_failing_since_ms.compare_exchange(
                0,
                wall_ms(),
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        let Some(source) = &self.sentinel else {
            return;
        };
        let moved = e.is_none_or(|e| {
            connection_trouble(e) || e.is_unrecoverable_error() || e.code() == Some("READONLY")
        });
        let now = wall_ms();
        let last = self
            .resolved_at_ms
            .load(std::sync::atomic::Ordering::Relaxed);
        if !moved
            || now < last.saturating_add(500)
            || self
                .resolved_at_ms
                .compare_exchange(
                    last,
                    now,
                    std::sync::atomic::Ordering::Relaxed,
                    std::sync::atomic::Ordering::Relaxed,
                )
                .is_err()
        {
            return;
        }
        let switched = async {
            let client = source.master().await.map_err(|e| e.to_string())?;
            client
                .get_multiplexed_async_connection_with_config(&self.direct)
                .await
                .map_err(|e| e.to_string())
        };
        match tokio::time::timeout(self.timeout * 2, switched).await {
            Ok(Ok(connection)) => {
                *self.conn.write() = Conn::Sentinel(connection);
                tracing::warn!("redis: connected to the master the sentinels name now");
            }
            Ok(Err(why)) => {
                tracing::warn!(error = %why, "redis: the sentinels named no reachable master")
            }
            Err(_) => tracing::warn!("redis: the sentinels did not answer in time"),
        }
    }

    /// On a cluster, the specs a tenant's script may touch (its slot's).
    fn local_only(&self, specs: &[ScopeSpec]) -> Vec<ScopeSpec> {
        specs
            .iter()
            .filter(|s| !self.is_cluster() || !cross::is_shared_base(&s.b))
            .cloned()
            .collect()
    }

    /// After a tenant's script ended a reservation: on a cluster, the
    /// shared groups are told (a failure leaves it to the sweeper).
    async fn finish_shared(&self, catalog: &Catalog, rec: &Rec) {
        if !self.is_cluster() || !rec.sb.iter().any(|b| cross::is_shared_base(b)) {
            return;
        }
        if let Err(e) = self.finish_cross(catalog, rec).await {
            tracing::warn!(id = %rec.id, error = %e, "the shared scopes of an ended reservation are left to the sweeper");
        }
    }

    /// Remembers a record this instance granted (or extended).
    fn remember(&self, rec: &Rec) {
        let Some(id) = ReservationId::parse(&rec.id) else {
            return;
        };
        let mut recent = self.recent.lock();
        if recent.len() >= RECENT_RECORDS {
            // Forgetting only costs the read it would have saved.
            recent.clear();
        }
        recent.insert(id, rec.clone());
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Whether the server is a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.cluster.load(std::sync::atomic::Ordering::Acquire)
    }

    fn now_ms(&self) -> Option<u64> {
        self.clock.as_ref().map(|c| c.now().as_millis())
    }

    /// The instant calendar bounds are computed at before the script says
    /// otherwise: the injected clock, else this machine's.
    fn estimate_ms(&self) -> u64 {
        self.now_ms().unwrap_or_else(wall_ms)
    }

    fn snapshot(&self) -> (Arc<Catalog>, u64) {
        let c = self.current.read();
        (c.catalog.clone(), c.version)
    }

    /// The key base of a tenant group.
    fn tenant_base(&self, tag: u8) -> String {
        format!("{}{{t{tag:02x}}}", self.prefix)
    }

    /// The key base of a shared-scope group.
    fn shared_base(&self, tag: u8) -> String {
        format!("{}{{s{tag:02x}}}", self.prefix)
    }

    /// The base of every group: the 256 tenant groups (numbered 0–255),
    /// then the 256 shared-scope groups (256–511).
    fn group_base(&self, group: u16) -> String {
        if group < 256 {
            self.tenant_base(group as u8)
        } else {
            self.shared_base((group - 256) as u8)
        }
    }

    fn scope_base(&self, key: &ScopeKey) -> String {
        match key.tenant_name() {
            Some(t) if !key.is_shared() => self.tenant_base(ReservationId::tenant_tag(t)),
            _ => self.shared_base(ReservationId::tenant_tag(key.as_str())),
        }
    }

    /// The catalog's list of admin changes.
    fn catalog_key(&self) -> String {
        format!("{}{{c}}:cat", self.prefix)
    }

    fn spec(&self, catalog: &Catalog, key: &ScopeKey, now_ms: u64) -> ScopeSpec {
        ScopeSpec {
            n: key.as_str().to_string(),
            b: self.scope_base(key),
            lims: catalog
                .plan_for(key)
                .limits()
                .iter()
                .map(|l| LimSpec::of(catalog, l, now_ms))
                .collect(),
        }
    }

    /// The specs of `keys`, each limit told by `fill` what the operation
    /// asks of or records on its dimension.
    fn specs(
        &self,
        catalog: &Catalog,
        keys: &[ScopeKey],
        now_ms: u64,
        fill: impl Fn(Dimension, &mut LimSpec),
    ) -> Vec<ScopeSpec> {
        keys.iter()
            .map(|k| {
                let mut s = self.spec(catalog, k, now_ms);
                for (l, spec) in catalog.plan_for(k).limits().iter().zip(&mut s.lims) {
                    fill(l.dimension(), spec);
                }
                s
            })
            .collect()
    }

    fn req<'a>(&'a self, op: &'a str, catalog: &Catalog) -> Req<'a> {
        let s = catalog.settings();
        Req {
            op,
            p: &self.prefix,
            cl: self.is_cluster(),
            now: self.now_ms(),
            re: s.ended_retention_ms,
            ri: s.idempotency_retention_ms,
            um: self.usage_max,
            ..Req::default()
        }
    }

    /// Runs the script with `req`, routed by `key_base`.
    async fn call(&self, key_base: &str, req: &Req<'_>) -> Result<Reply, Unavailable> {
        let body = rmp_serde::to_vec_named(req).map_err(unavailable)?;
        let mut conn = self.conn();
        let raw: Vec<u8> = self
            .bounded(req.op, self.ledger.call(&mut conn, key_base, &body))
            .await?;
        let reply: Reply = rmp_serde::from_slice(&raw).map_err(|e| {
            tracing::error!(error = %e, op = req.op, "unreadable answer from the ledger script");
            Unavailable(format!("an unreadable answer from the ledger script: {e}"))
        })?;
        if reply.t == "elsewhere" {
            // A shadow hold (`fail_open_local`): not "not found", which a
            // client takes as final and so loses the settle.
            return Err(Unavailable(
                "this reservation was admitted by another instance while Redis was unreachable \
                 and is held there until it ends: retry (it is this ledger's once it ends), or \
                 settle it through that instance"
                    .into(),
            ));
        }
        Ok(reply)
    }

    /// `request`'s answer within the timeout. Every failure goes through
    /// [`RedisStore::after_failure`], so that through Sentinel a broken
    /// connection is replaced whichever request found it broken.
    async fn bounded<T>(
        &self,
        what: &str,
        request: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, Unavailable> {
        match tokio::time::timeout(self.timeout, request).await {
            Ok(Ok(answer)) => {
                if self
                    .cluster_failing_since_ms
                    .load(std::sync::atomic::Ordering::Relaxed)
                    != 0
                {
                    self.cluster_failing_since_ms
                        .store(0, std::sync::atomic::Ordering::Relaxed);
                }
                Ok(answer)
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, op = what, "redis call failed");
                self.after_failure(Some(&e)).await;
                Err(unavailable(e))
            }
            Err(_) => {
                self.after_failure(None).await;
                Err(Unavailable(format!(
                    "redis did not answer within {} ms",
                    self.timeout.as_millis()
                )))
            }
        }
    }

    /// Applies the admin changes made since this instance last looked.
    async fn catch_up(&self) -> Result<(), Unavailable> {
        let (catalog, version) = self.snapshot();
        let mut conn = self.conn();
        let changes: Vec<String> = self
            .bounded(
                "catalog",
                redis::cmd("LRANGE")
                    .arg(self.catalog_key())
                    .arg(version)
                    .arg(-1)
                    .query_async(&mut conn),
            )
            .await?;
        if changes.is_empty() {
            return Ok(());
        }
        let mut next = (*catalog).clone();
        for (i, text) in changes.iter().enumerate() {
            let applied = serde_json::from_str::<CatalogChange>(text)
                .map_err(|e| e.to_string())
                .and_then(|c| {
                    c.apply_on(&mut next, &self.configured)
                        .map_err(|e| e.to_string())
                });
            if let Err(e) = applied {
                // Another instance accepted it against its configuration:
                // the configurations differ. Counted, so versions agree.
                tracing::warn!(change = version + i as u64, error = %e, "an admin change from Redis does not apply to this configuration");
            }
        }
        let mut cur = self.current.write();
        if cur.version == version {
            cur.catalog = Arc::new(next);
            cur.version = version + changes.len() as u64;
        }
        Ok(())
    }

    fn corrupt(what: String) -> Unavailable {
        tracing::error!(what = %what, "the ledger in Redis holds something this version cannot read");
        Unavailable(format!("unreadable ledger data: {what}"))
    }

    fn reservation(&self, catalog: &Catalog, rec: &Rec) -> Result<Reservation, Unavailable> {
        rec.reservation(catalog).map_err(Self::corrupt)
    }

    /// The record an `ok` answer to a reserve stands for: a replay carries
    /// the stored record; a fresh grant only the instant and expiry the
    /// script stamped on `sent` (held, version 1), as it stored it.
    fn granted_record<'a>(
        reply: &'a Reply,
        sent: Option<&Rec>,
    ) -> Result<Cow<'a, Rec>, Unavailable> {
        if let Some(rec) = &reply.rec {
            return Ok(Cow::Borrowed(rec));
        }
        let (Some(sent), Some(now), Some(x)) = (sent, reply.now, reply.x) else {
            return Err(Self::corrupt(
                "a grant without its instant and expiry".into(),
            ));
        };
        let mut rec = sent.clone();
        rec.st = "held".to_string();
        rec.cr = Some(now);
        rec.x = Some(x);
        rec.v = Some(1);
        Ok(Cow::Owned(rec))
    }

    /// Handles the answers every ledger call may give instead of a result:
    /// `Some(now)` to start over (with the server's instant for calendar
    /// bounds), after catching up with the catalog if it changed.
    async fn again(&self, reply: &Reply, estimate: &mut u64) -> Result<bool, Unavailable> {
        match reply.t.as_str() {
            "stale" => {
                self.catch_up().await?;
                Ok(true)
            }
            "cal" => {
                *estimate = reply.now.unwrap_or(*estimate);
                Ok(true)
            }
            "retry" => Ok(true),
            _ => Ok(false),
        }
    }

    fn denial(
        catalog: &Catalog,
        scopes: &[&ScopeKey],
        d: &wire::DenyOut,
    ) -> Result<Box<Denial>, Unavailable> {
        let scope = scopes
            .get(d.s.wrapping_sub(1))
            .ok_or_else(|| Self::corrupt(format!("a denial of scope #{}", d.s)))?;
        let limit = catalog
            .plan_for(scope)
            .limits()
            .get(d.l.wrapping_sub(1))
            .ok_or_else(|| Self::corrupt(format!("a denial of limit #{}", d.l)))?;
        let kind = match d.kind.as_str() {
            "rate" => DenialKind::RateLimited,
            "budget" => DenialKind::BudgetExhausted,
            "exceeds" => DenialKind::ExceedsLimit,
            k => return Err(Self::corrupt(format!("a denial kind {k:?}"))),
        };
        Ok(Box::new(Denial {
            kind,
            scope: (*scope).clone(),
            dimension: catalog.dimension_name(limit.dimension()).to_string(),
            window: limit.window().kind(),
            capacity: d.cap,
            remaining: d.rem,
            requested: d.q,
            retry_after_ms: d.ra,
            resets_at: d.rs.map(Timestamp::from_millis),
        }))
    }

    fn out_of(rem: &Option<Vec<Vec<LimOut>>>, si: usize, li: usize) -> Result<LimOut, Unavailable> {
        rem.as_ref()
            .and_then(|r| r.get(si))
            .and_then(|s| s.get(li))
            .copied()
            .ok_or_else(|| Self::corrupt("a report missing a limit".into()))
    }

    fn remaining(
        catalog: &Catalog,
        scopes: &[ScopeKey],
        rem: &Option<Vec<Vec<LimOut>>>,
    ) -> Result<Vec<Remaining>, Unavailable> {
        let mut out = Vec::new();
        for (si, key) in scopes.iter().enumerate() {
            for (li, l) in catalog.plan_for(key).limits().iter().enumerate() {
                let o = Self::out_of(rem, si, li)?;
                out.push(Remaining {
                    scope: key.clone(),
                    dimension: catalog.dimension_name(l.dimension()).to_string(),
                    window: l.window().kind(),
                    capacity: l.capacity(),
                    remaining: sat(i128::from(l.capacity()) - i128::from(o.u) - i128::from(o.h)),
                    resets_at: o.r.map(Timestamp::from_millis),
                });
            }
        }
        Ok(out)
    }

    fn scope_status(
        catalog: &Catalog,
        key: &ScopeKey,
        reply: &Reply,
    ) -> Result<ScopeStatus, Unavailable> {
        let plan = catalog.plan_for(key);
        let mut limits = Vec::new();
        for (li, l) in plan.limits().iter().enumerate() {
            let o = Self::out_of(&reply.rem, 0, li)?;
            limits.push(LimitStatus {
                dimension: catalog.dimension_name(l.dimension()).to_string(),
                window: l.window().clone(),
                capacity: l.capacity(),
                used: o.u,
                held: o.h,
                remaining: sat(i128::from(l.capacity()) - i128::from(o.u) - i128::from(o.h)),
                resets_at: o.r.map(Timestamp::from_millis),
            });
        }
        Ok(ScopeStatus {
            scope: key.clone(),
            plan: plan.name().to_string(),
            held_reservations: reply.hc.unwrap_or(0),
            limits,
        })
    }

    /// Reads a record as it stands (a settle or extend works out its
    /// amounts from it).
    async fn peek(&self, catalog: &Catalog, id: ReservationId) -> Result<Option<Rec>, Unavailable> {
        let mut r = self.req("peek", catalog);
        let base = self.tenant_base(id.tag());
        r.b = Some(base.clone());
        r.id = Some(id.to_string());
        let reply = self.call(&base, &r).await?;
        match reply.t.as_str() {
            "nf" => Ok(None),
            "ok" => Ok(reply.rec),
            t => Err(Self::corrupt(format!("an answer {t:?} to a read"))),
        }
    }

    fn give_up() -> Unavailable {
        Unavailable("the ledger kept changing under this operation; retry".into())
    }

    /// The answer of a script that only says it is done (`ok`).
    fn plain_ok(reply: &Reply, what: &str) -> Result<(), StoreError<Invalid>> {
        match reply.t.as_str() {
            "ok" => Ok(()),
            t => Err(Self::corrupt(format!("an answer {t:?} to {what}")).into()),
        }
    }

    /// A reservation's tenant and the base of its tenant group, refusing
    /// an id not minted for that tenant (it would live in another group).
    fn home_of<'r>(&self, res: &'r Reservation) -> Result<(&'r str, String), StoreError<Invalid>> {
        let tenant = res.scopes.tenant_name();
        if res.id.tag() != ReservationId::tenant_tag(tenant) {
            return Err(StoreError::Rejected(Invalid::new(
                "id",
                "the id was not minted for this tenant",
            )));
        }
        Ok((tenant, self.tenant_base(ReservationId::tenant_tag(tenant))))
    }

    /// Brings in a reservation that ended outside Redis (admitted under
    /// `fail_open_local` while Redis was unreachable, then settled, refunded
    /// or expired locally): a settled one's charges are recorded on its
    /// scopes (at the time of the import) and every one joins the usage log
    /// with its own end instant. Idempotent by id: importing it again
    /// changes nothing. A HELD reservation is refused (end it first).
    ///
    /// Its idempotency key, if any, is not carried into Redis (a reserve
    /// with the key is a new reservation there); [`FailOpenLocal`], which
    /// knows the request the key bound, carries it.
    pub async fn import_ended(&self, res: &Reservation) -> Result<(), StoreError<Invalid>> {
        self.import(res, None).await
    }

    /// [`import_ended`](RedisStore::import_ended), with the reservation's
    /// idempotency key carried when `fingerprint` (what the key bound, as
    /// [`wire::fingerprint`] made it from the request) is given: a reserve
    /// with the key then replays the imported reservation, for the
    /// idempotency retention after it ended — unless Redis has given the
    /// key to a live reservation of its own meanwhile, which keeps it.
    pub(crate) async fn import(
        &self,
        res: &Reservation,
        fingerprint: Option<&str>,
    ) -> Result<(), StoreError<Invalid>> {
        if res.status == Status::Held {
            return Err(StoreError::Rejected(Invalid::new(
                "status",
                "only an ended reservation can be imported",
            )));
        }
        let (tenant, base) = self.home_of(res)?;
        let charged = res.charged.clone().unwrap_or_default();
        // The key travels only with what it bound.
        let keyed = res.idempotency_key.as_deref().zip(fingerprint);
        let mut estimate = self.estimate_ms();
        for _ in 0..MAX_ATTEMPTS {
            let (catalog, version) = self.snapshot();
            let keys = res.scopes.as_slice();
            let settled = res.status == Status::Settled;
            let mut specs = self.specs(&catalog, keys, estimate, |d, spec| {
                spec.a = Some(if settled { recorded(d, &charged) } else { 0 });
            });
            let bases: Vec<String> = specs.iter().map(|s| s.b.clone()).collect();
            if self.is_cluster() {
                // A shared scope lives in its group's slot, out of the
                // tenant script's reach: its charges are recorded there
                // first (idempotent by id), then the tenant's part, so a
                // retry after a failure between the two records nothing
                // twice. Nothing was held there: only a settle records.
                let groups = cross::shared_groups(&specs);
                if settled && !groups.is_empty() {
                    let end_ms = res.ended_at.unwrap_or(res.expires_at).as_millis();
                    let id = res.id.to_string();
                    self.fend_all(&catalog, &id, &groups, &specs, "settle", Some(end_ms))
                        .await?;
                }
                specs.retain(|s| !cross::is_shared_base(&s.b));
            }
            let mut r = self.req("import", &catalog);
            r.cv = Some(version);
            r.b = Some(base.clone());
            r.rec = Some(Rec {
                id: res.id.to_string(),
                st: res.status.as_str().to_string(),
                sc: keys.iter().map(|k| k.as_str().to_string()).collect(),
                sb: bases,
                tn: tenant.to_string(),
                m: res.model.as_deref().map(str::to_string),
                lb: res.labels.as_ref().map(|l| l.to_vec()),
                h: named(&catalog, &res.held),
                cr: Some(res.created_at.as_millis()),
                x: Some(res.expires_at.as_millis()),
                e: Some(res.ended_at.unwrap_or(res.expires_at).as_millis()),
                c: res.charged.as_ref().map(|c| named(&catalog, c)),
                late: res.late.then_some(true),
                ov: overrun_name(res.overrun),
                ik: keyed.map(|(key, _)| key.to_string()),
                fp: keyed.map(|(_, fp)| fp.to_string()),
                v: Some(1),
            });
            r.scopes = specs;
            let reply = self.call(&base, &r).await?;
            if self.again(&reply, &mut estimate).await? {
                continue;
            }
            return Self::plain_ok(&reply, "an import");
        }
        Err(Self::give_up().into())
    }

    /// Holds room in Redis for a reservation still HELD outside it
    /// (admitted under `fail_open_local` while Redis was unreachable), so
    /// that Redis counts its hold until it ends: a **shadow hold** on its
    /// scopes, with its amounts and expiry, checked against no limit (it was
    /// admitted already). Its id stays unknown to every other operation; the
    /// reservation's [`import`](RedisStore::import) replaces the shadow, and
    /// if none ever comes (the instance died) the shadow expires with the
    /// reservation, leaving no trace. Sent again (after a local extend), it
    /// takes the new amounts and expiry; after the import it changes nothing.
    ///
    /// On a cluster only the scopes in the tenant's slot are shadowed (a
    /// shared scope lives in another slot, which one script cannot reach).
    pub(crate) async fn shadow(&self, res: &Reservation) -> Result<(), StoreError<Invalid>> {
        if res.status != Status::Held {
            return Err(StoreError::Rejected(Invalid::new(
                "status",
                "only a held reservation can be shadowed",
            )));
        }
        let (tenant, base) = self.home_of(res)?;
        let cluster = self.is_cluster();
        let keys: Vec<ScopeKey> = res
            .scopes
            .as_slice()
            .iter()
            .filter(|k| !cluster || self.scope_base(k) == base)
            .cloned()
            .collect();
        let mut estimate = self.estimate_ms();
        for _ in 0..MAX_ATTEMPTS {
            let (catalog, version) = self.snapshot();
            let specs = self.specs(&catalog, &keys, estimate, |_, _| {});
            let mut r = self.req("shadow", &catalog);
            r.cv = Some(version);
            r.b = Some(base.clone());
            r.rec = Some(Rec {
                id: res.id.to_string(),
                sc: keys.iter().map(|k| k.as_str().to_string()).collect(),
                sb: specs.iter().map(|s| s.b.clone()).collect(),
                tn: tenant.to_string(),
                h: named(&catalog, &res.held),
                cr: Some(res.created_at.as_millis()),
                x: Some(res.expires_at.as_millis()),
                ov: overrun_name(res.overrun),
                ..Rec::default()
            });
            r.scopes = specs;
            let reply = self.call(&base, &r).await?;
            if self.again(&reply, &mut estimate).await? {
                continue;
            }
            return Self::plain_ok(&reply, "a shadow hold");
        }
        Err(Self::give_up().into())
    }

    /// Tells every group of catalog version `version`.
    async fn bump_all(&self, catalog: &Catalog, version: u64) -> Result<(), Unavailable> {
        let calls = (0..512u16).map(|g| {
            let base = self.group_base(g);
            async move {
                let mut r = self.req("bump", catalog);
                r.b = Some(base.clone());
                r.cv = Some(version);
                self.call(&base, &r).await
            }
        });
        for reply in futures_util::future::join_all(calls).await {
            reply?;
        }
        Ok(())
    }

    /// One command per key, all in flight at once (keys in any slots).
    async fn each<T: redis::FromRedisValue>(
        &self,
        cmds: Vec<redis::Cmd>,
    ) -> Result<Vec<T>, Unavailable> {
        let calls = cmds.into_iter().map(|cmd| {
            let mut conn = self.conn();
            async move { cmd.query_async::<T>(&mut conn).await }
        });
        let all = async {
            futures_util::future::join_all(calls)
                .await
                .into_iter()
                .collect::<redis::RedisResult<Vec<T>>>()
        };
        self.bounded("read", all).await
    }

    /// The groups (by tag) whose sorted sets `sets` hold something due by
    /// `now_ms`: one look at each set's first entry, all in flight at once.
    async fn due_groups(
        &self,
        base: impl Fn(u8) -> String,
        sets: [&str; 2],
        now_ms: u64,
    ) -> Result<Vec<u8>, Unavailable> {
        let cmds = (0..=255u8)
            .flat_map(|tag| {
                let base = base(tag);
                sets.map(|set| {
                    let mut c = redis::cmd("ZRANGE");
                    c.arg(format!("{base}:{set}"))
                        .arg(0)
                        .arg(0)
                        .arg("WITHSCORES");
                    c
                })
            })
            .collect();
        let firsts: Vec<Vec<(String, f64)>> = self.each(cmds).await?;
        let now = now_ms as f64;
        Ok((0..=255u8)
            .filter(|&tag| {
                let i = usize::from(tag) * 2;
                firsts[i..i + 2]
                    .iter()
                    .any(|first| first.first().is_some_and(|(_, at)| *at <= now))
            })
            .collect())
    }

    /// HELD reservations: the sizes of the 256 groups' expiry sets (each
    /// holds exactly its group's HELD reservations, once expiry is observed).
    async fn held_total(&self) -> Result<u64, Unavailable> {
        let cmds = (0..=255u8)
            .map(|tag| {
                let mut c = redis::cmd("ZCARD");
                c.arg(format!("{}:x", self.tenant_base(tag)));
                c
            })
            .collect();
        let sizes: Vec<u64> = self.each(cmds).await?;
        Ok(sizes.into_iter().sum())
    }

    /// Sums a per-group counter over the 256 tenant groups.
    async fn sum_counter(&self, field: &str) -> Result<u64, Unavailable> {
        let cmds = (0..=255u8)
            .map(|tag| {
                let mut c = redis::cmd("HGET");
                c.arg(format!("{}:n", self.tenant_base(tag))).arg(field);
                c
            })
            .collect();
        let values: Vec<Option<i64>> = self.each(cmds).await?;
        Ok(values.into_iter().flatten().map(|v| v.max(0) as u64).sum())
    }

    /// One group's part of the usage log after `start` (at most `n`
    /// entries), and the server's instant when it was read.
    async fn usage_part(
        &self,
        catalog: &Catalog,
        group: u16,
        start: String,
        n: usize,
    ) -> Result<(u64, redis::streams::StreamRangeReply), Unavailable> {
        let base = self.group_base(group);
        let mut r = self.req("usage", catalog);
        r.b = Some(base.clone());
        r.start = Some(start);
        r.n = Some(n as u64);
        let body = rmp_serde::to_vec_named(&r).map_err(unavailable)?;
        let mut conn = self.conn();
        self.bounded("usage", self.ledger.call(&mut conn, &base, &body))
            .await
    }
}

fn sat(v: i128) -> i64 {
    v.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

#[async_trait]
impl Store for RedisStore {
    async fn reserve(&self, req: &ReserveRequest) -> Result<Granted, StoreError<ReserveError>> {
        let tenant = req.scopes.tenant_name();
        let base = self.tenant_base(req.scopes.tenant_tag());
        let mut estimate = self.estimate_ms();
        for _ in 0..MAX_ATTEMPTS {
            let (catalog, version) = self.snapshot();
            let prep = prepare_reserve(&catalog, req).map_err(StoreError::Rejected)?;
            let id = ReservationId::mint(self.ids.next_random(), tenant);
            let keys = req.scopes.as_slice();
            let specs = self.specs(&catalog, keys, estimate, |d, spec| {
                spec.q = Some(prep.requested(d));
            });
            let mut r = self.req("reserve", &catalog);
            r.cv = Some(version);
            r.b = Some(base.clone());
            r.id = Some(id.to_string());
            r.tn = Some(tenant.to_string());
            r.ik = req.idempotency_key.as_deref().map(str::to_string);
            r.fp = req
                .idempotency_key
                .as_ref()
                .map(|_| fingerprint(&catalog, &req.scopes, &req.amounts, req.model.as_deref()));
            r.ttl = Some(prep.ttl_ms);
            r.dry = req.dry_run.then_some(true);
            r.rr = req.report_remaining.then_some(true);
            r.h = Some(named(&catalog, &prep.held));
            r.rec = Some(Rec {
                id: id.to_string(),
                sc: keys.iter().map(|k| k.as_str().to_string()).collect(),
                sb: specs.iter().map(|s| s.b.clone()).collect(),
                tn: tenant.to_string(),
                m: req.model.as_deref().map(str::to_string),
                lb: req.labels.as_ref().map(|l| l.to_vec()),
                h: named(&catalog, &prep.held),
                ov: overrun_name(catalog.plan_for(req.scopes.tenant()).overrun()),
                ik: r.ik.clone(),
                fp: r.fp.clone(),
                ..Rec::default()
            });
            if self.is_cluster() && req.scopes.any_shared() {
                r.scopes = self.local_only(&specs);
                match self
                    .reserve_cross(&catalog, version, req, &prep, id, &specs, r, &mut estimate)
                    .await?
                {
                    Some(granted) => return Ok(granted),
                    None => continue,
                }
            }
            r.scopes = specs;
            let reply = self.call(&base, &r).await?;
            if self.again(&reply, &mut estimate).await? {
                continue;
            }
            return match reply.t.as_str() {
                "idem" => Err(StoreError::Rejected(ReserveError::IdempotencyConflict {
                    key: req.idempotency_key.as_deref().unwrap_or("").to_string(),
                })),
                "dup" => Err(StoreError::Rejected(ReserveError::DuplicateId)),
                "deny" => {
                    let d = reply
                        .d
                        .as_ref()
                        .ok_or_else(|| Self::corrupt("a denial without detail".into()))?;
                    let scopes: Vec<&ScopeKey> = keys.iter().collect();
                    Err(StoreError::Rejected(ReserveError::Denied(Self::denial(
                        &catalog, &scopes, d,
                    )?)))
                }
                "ok" if reply.dry == Some(true) => {
                    let now = reply.now.unwrap_or(estimate);
                    let expires_at = Timestamp::from_millis(reply.x.unwrap_or(now));
                    let mut remaining = Self::remaining(&catalog, keys, &reply.rem)?;
                    // The room after this hold, exactly what the reserve would report.
                    let asked: Vec<u64> = r
                        .scopes
                        .iter()
                        .flat_map(|s| s.lims.iter().map(|l| l.q.unwrap_or(0)))
                        .collect();
                    for (x, q) in remaining.iter_mut().zip(asked) {
                        x.remaining = sat(i128::from(x.remaining) - i128::from(q));
                        if x.window == WindowKind::Concurrent {
                            x.resets_at =
                                Some(x.resets_at.map_or(expires_at, |e| e.min(expires_at)));
                        }
                    }
                    Ok(Granted {
                        id,
                        status: Status::Held,
                        replayed: false,
                        dry_run: true,
                        held: prep.held,
                        created_at: Timestamp::from_millis(now),
                        expires_at,
                        remaining,
                    })
                }
                "ok" => {
                    let rec = Self::granted_record(&reply, r.rec.as_ref())?;
                    let res = self.reservation(&catalog, &rec)?;
                    if res.status == Status::Held {
                        self.remember(&rec);
                    }
                    let remaining = if reply.replay == Some(true) || !req.report_remaining {
                        Vec::new()
                    } else {
                        Self::remaining(&catalog, keys, &reply.rem)?
                    };
                    Ok(Granted {
                        id: res.id,
                        status: res.status,
                        replayed: reply.replay == Some(true),
                        dry_run: false,
                        held: res.held,
                        created_at: res.created_at,
                        expires_at: res.expires_at,
                        remaining,
                    })
                }
                t => Err(Self::corrupt(format!("an answer {t:?} to a reserve")).into()),
            };
        }
        Err(Self::give_up().into())
    }

    async fn settle(
        &self,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<Reservation, StoreError<SettleError>> {
        let base = self.tenant_base(id.tag());
        let mut estimate = self.estimate_ms();
        // The record this instance granted, if it still remembers it: the
        // read is skipped (the script refuses if an extend changed it).
        let mut remembered = self.recent.lock().remove(&id);
        for _ in 0..MAX_CONTENDED_ATTEMPTS {
            let (catalog, version) = self.snapshot();
            let (rec, res, charged) = match remembered.take() {
                Some(rec) => {
                    let res = self.reservation(&catalog, &rec)?;
                    match settle_charges(&catalog, &res, usage) {
                        Ok(charged) => (rec, res, charged),
                        // The read decides which answer comes first (a
                        // settled reservation answers even a bad usage).
                        Err(_) => continue,
                    }
                }
                None => {
                    let Some(rec) = self.peek(&catalog, id).await? else {
                        return Err(StoreError::Rejected(SettleError::NotFound));
                    };
                    let res = self.reservation(&catalog, &rec)?;
                    match res.status {
                        Status::Settled => return Ok(res),
                        Status::Refunded => {
                            return Err(StoreError::Rejected(SettleError::Conflict {
                                status: res.status,
                            }));
                        }
                        Status::Held | Status::Expired => {}
                    }
                    let charged =
                        settle_charges(&catalog, &res, usage).map_err(StoreError::Rejected)?;
                    (rec, res, charged)
                }
            };
            let mut r = self.req("settle", &catalog);
            r.cv = Some(version);
            r.b = Some(base.clone());
            r.id = Some(id.to_string());
            r.v = rec.v;
            r.c = Some(named(&catalog, &charged));
            let specs = self.specs(&catalog, res.scopes.as_slice(), estimate, |d, spec| {
                spec.a = Some(recorded(d, &charged));
            });
            r.scopes = self.local_only(&specs);
            let reply = self.call(&base, &r).await?;
            if self.again(&reply, &mut estimate).await? {
                continue;
            }
            return match reply.t.as_str() {
                "nf" => Err(StoreError::Rejected(SettleError::NotFound)),
                "conflict" => Err(StoreError::Rejected(SettleError::Conflict {
                    status: status_of(reply.st.as_deref().unwrap_or("")).map_err(Self::corrupt)?,
                })),
                "ok" => {
                    let rec = reply
                        .rec
                        .as_ref()
                        .ok_or_else(|| Self::corrupt("a settle without its record".into()))?;
                    let res = self.reservation(&catalog, rec)?;
                    self.finish_shared(&catalog, rec).await;
                    Ok(res)
                }
                t => Err(Self::corrupt(format!("an answer {t:?} to a settle")).into()),
            };
        }
        Err(Self::give_up().into())
    }

    async fn refund(&self, id: ReservationId) -> Result<Reservation, StoreError<RefundError>> {
        let base = self.tenant_base(id.tag());
        let (catalog, _) = self.snapshot();
        self.recent.lock().remove(&id);
        let mut r = self.req("refund", &catalog);
        r.b = Some(base.clone());
        r.id = Some(id.to_string());
        let reply = self.call(&base, &r).await?;
        match reply.t.as_str() {
            "nf" => Err(StoreError::Rejected(RefundError::NotFound)),
            "conflict" => Err(StoreError::Rejected(RefundError::Conflict {
                status: status_of(reply.st.as_deref().unwrap_or("")).map_err(Self::corrupt)?,
            })),
            "ok" => {
                let rec = reply
                    .rec
                    .as_ref()
                    .ok_or_else(|| Self::corrupt("a refund without its record".into()))?;
                let res = self.reservation(&catalog, rec)?;
                self.finish_shared(&catalog, rec).await;
                Ok(res)
            }
            t => Err(Self::corrupt(format!("an answer {t:?} to a refund")).into()),
        }
    }

    async fn extend(
        &self,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Result<Reservation, StoreError<ExtendError>> {
        let base = self.tenant_base(id.tag());
        let mut estimate = self.estimate_ms();
        self.recent.lock().remove(&id);
        for _ in 0..MAX_CONTENDED_ATTEMPTS {
            let (catalog, version) = self.snapshot();
            check_extend(&catalog, amounts, ttl_ms).map_err(StoreError::Rejected)?;
            let Some(rec) = self.peek(&catalog, id).await? else {
                return Err(StoreError::Rejected(ExtendError::NotFound));
            };
            let res = self.reservation(&catalog, &rec)?;
            if res.status != Status::Held {
                return Err(StoreError::Rejected(ExtendError::NotHeld {
                    status: res.status,
                }));
            }
            let delta = extend_delta(&catalog, res.model.as_deref(), amounts);
            let mut r = self.req("extend", &catalog);
            r.cv = Some(version);
            r.b = Some(base.clone());
            r.id = Some(id.to_string());
            r.v = rec.v;
            r.h = Some(named(&catalog, &delta));
            r.ttl = ttl_ms;
            let specs = self.specs(&catalog, res.scopes.as_slice(), estimate, |d, spec| {
                spec.q = Some(if d.is_implied() { 0 } else { delta.get(d) });
            });
            r.scopes = self.local_only(&specs);
            let reply = if self.is_cluster() && res.scopes.any_shared() {
                match self
                    .extend_cross(
                        &catalog,
                        version,
                        &rec,
                        &specs,
                        &delta,
                        ttl_ms,
                        r,
                        &mut estimate,
                    )
                    .await?
                {
                    Some(reply) => reply,
                    None => continue,
                }
            } else {
                self.call(&base, &r).await?
            };
            if self.again(&reply, &mut estimate).await? {
                if reply.t == "retry" {
                    tokio::time::sleep(contention_pause()).await;
                }
                continue;
            }
            return match reply.t.as_str() {
                "nf" => Err(StoreError::Rejected(ExtendError::NotFound)),
                "notheld" => Err(StoreError::Rejected(ExtendError::NotHeld {
                    status: status_of(reply.st.as_deref().unwrap_or("")).map_err(Self::corrupt)?,
                })),
                "deny" => {
                    let d = reply
                        .d
                        .as_ref()
                        .ok_or_else(|| Self::corrupt("a denial without detail".into()))?;
                    let scopes: Vec<&ScopeKey> = res.scopes.as_slice().iter().collect();
                    Err(StoreError::Rejected(ExtendError::Denied(Self::denial(
                        &catalog, &scopes, d,
                    )?)))
                }
                "ok" => {
                    let rec = reply
                        .rec
                        .as_ref()
                        .ok_or_else(|| Self::corrupt("an extend without its record".into()))?;
                    let res = self.reservation(&catalog, rec)?;
                    self.remember(rec);
                    Ok(res)
                }
                t => Err(Self::corrupt(format!("an answer {t:?} to an extend")).into()),
            };
        }
        Err(Self::give_up().into())
    }

    async fn get(&self, id: ReservationId) -> Result<Option<Reservation>, Unavailable> {
        let base = self.tenant_base(id.tag());
        let (catalog, _) = self.snapshot();
        let mut r = self.req("get", &catalog);
        r.b = Some(base.clone());
        r.id = Some(id.to_string());
        let reply = self.call(&base, &r).await?;
        match (reply.t.as_str(), &reply.rec) {
            ("nf", _) => Ok(None),
            ("ok", Some(rec)) => Ok(Some(self.reservation(&catalog, rec)?)),
            (t, _) => Err(Self::corrupt(format!("an answer {t:?} to a get"))),
        }
    }

    async fn status(&self, scope: &ScopeKey) -> Result<ScopeStatus, Unavailable> {
        let mut estimate = self.estimate_ms();
        for _ in 0..MAX_ATTEMPTS {
            let (catalog, version) = self.snapshot();
            let spec = self.spec(&catalog, scope, estimate);
            let base = spec.b.clone();
            let mut r = self.req("status", &catalog);
            r.cv = Some(version);
            r.scopes = vec![spec];
            let reply = self.call(&base, &r).await?;
            if self.again(&reply, &mut estimate).await? {
                continue;
            }
            return match reply.t.as_str() {
                "ok" => Self::scope_status(&catalog, scope, &reply),
                t => Err(Self::corrupt(format!("an answer {t:?} to a status"))),
            };
        }
        Err(Self::give_up())
    }

    async fn adjust(
        &self,
        scope: &ScopeKey,
        dimension: Dimension,
        credit: i64,
        reason: &str,
    ) -> Result<ScopeStatus, StoreError<AdminError>> {
        let mut estimate = self.estimate_ms();
        for _ in 0..MAX_ATTEMPTS {
            let (catalog, version) = self.snapshot();
            check_adjust(&catalog, scope, dimension, credit).map_err(StoreError::Rejected)?;
            let spec = self.spec(&catalog, scope, estimate);
            let base = spec.b.clone();
            let mut r = self.req("adjust", &catalog);
            r.cv = Some(version);
            r.scopes = vec![spec];
            r.d = Some(catalog.dimension_name(dimension).to_string());
            r.credit = Some(credit);
            r.reason = Some(reason.to_string());
            r.tn = scope.tenant_name().map(str::to_string);
            let reply = self.call(&base, &r).await?;
            if self.again(&reply, &mut estimate).await? {
                continue;
            }
            return match reply.t.as_str() {
                "ok" => Ok(Self::scope_status(&catalog, scope, &reply)?),
                t => Err(Self::corrupt(format!("an answer {t:?} to an adjust")).into()),
            };
        }
        Err(Self::give_up().into())
    }

    async fn catalog(&self) -> Result<Arc<Catalog>, Unavailable> {
        Ok(self.snapshot().0)
    }

    async fn change_catalog(&self, change: &CatalogChange) -> Result<(), StoreError<AdminError>> {
        let text = serde_json::to_string(change)
            .map_err(|e| StoreError::Unavailable(Unavailable(format!("encoding a change: {e}"))))?;
        for _ in 0..MAX_ATTEMPTS {
            let (catalog, version) = self.snapshot();
            // Checked here first: a change this catalog refuses never reaches Redis.
            let mut next = (*catalog).clone();
            change
                .apply_on(&mut next, &self.configured)
                .map_err(StoreError::Rejected)?;
            let mut r = self.req("catalog", &catalog);
            r.cv = Some(version);
            r.change = Some(text.clone());
            r.now = None;
            let reply = self.call(&self.catalog_key(), &r).await?;
            match reply.t.as_str() {
                "stale" => self.catch_up().await?,
                "ok" => {
                    {
                        let mut cur = self.current.write();
                        if cur.version == version {
                            cur.catalog = Arc::new(next);
                            cur.version = version + 1;
                        }
                    }
                    // Every group learns of the new version, so every
                    // instance's next operation there catches up first.
                    self.bump_all(&catalog, version + 1).await?;
                    return Ok(());
                }
                t => {
                    return Err(
                        Self::corrupt(format!("an answer {t:?} to a catalog change")).into(),
                    );
                }
            }
        }
        Err(Self::give_up().into())
    }

    async fn expire_due(&self) -> Result<u64, Unavailable> {
        // The sweeper is what connects a store started without Redis, and
        // what replaces a cluster client that stays stuck.
        self.connect_now().await?;
        self.heal_cluster().await;
        // Admin changes made through another instance reach this one by its
        // next sweep too, not only by its next script in an updated group:
        // an idle instance's catalog (and the emergency ledger a
        // `fail_open_local` outage would build from it) stays current.
        self.catch_up().await?;
        let (catalog, _) = self.snapshot();
        // One pipelined look at every group's earliest expiry and earliest
        // retention end; only the groups with something due get a script.
        // (By this instance's clock: a skewed one delays the sweep by its
        // skew, never an operation's own expiry, which the script observes.)
        let due = self
            .due_groups(|tag| self.tenant_base(tag), ["x", "d"], self.estimate_ms())
            .await?;
        let calls = due.into_iter().map(|tag| {
            let base = self.tenant_base(tag);
            let catalog = &catalog;
            async move {
                let mut r = self.req("tick", catalog);
                r.b = Some(base.clone());
                self.call(&base, &r).await
            }
        });
        for reply in futures_util::future::join_all(calls).await {
            reply?;
        }
        if self.is_cluster() {
            self.sweep_cross(&catalog).await?;
        }
        self.sum_counter("expired").await
    }

    fn is_shared(&self) -> bool {
        true
    }

    fn on_room_freed(&self, wake: Arc<dyn Fn() + Send + Sync>) {
        // The scripts PUBLISH on `<prefix>freed` when a reservation ends;
        // a subscriber per server wakes its queue. A Cluster broadcasts a
        // PUBLISH to every node, so one node's subscription hears them all.
        // Lost messages only delay a waiter to its bounded re-check.
        let channel = format!("{}freed", self.prefix);
        let url = self.url.clone();
        let sentinel = self.sentinel.as_ref().map(|s| SentinelSource {
            sentinels: s.sentinels.clone(),
            master_name: s.master_name.clone(),
            node: s.node.clone(),
        });
        tokio::spawn(async move {
            use futures_util::StreamExt;
            loop {
                let client = match &sentinel {
                    Some(s) => s.master().await,
                    None => redis::Client::open(url.as_str()),
                };
                let subscribed = async {
                    let mut pubsub = client?.get_async_pubsub().await?;
                    pubsub.subscribe(&channel).await?;
                    Ok::<_, redis::RedisError>(pubsub)
                };
                match subscribed.await {
                    Ok(pubsub) => {
                        let mut messages = pubsub.into_on_message();
                        while messages.next().await.is_some() {
                            wake();
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "redis: the room-freed subscription failed")
                    }
                }
                // Gone (Redis restarted, a failover): subscribe again soon;
                // waiters are re-checked meanwhile anyway.
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
    }

    async fn stats(&self) -> Result<StoreStats, Unavailable> {
        let expired_total = self.expire_due().await?;
        Ok(StoreStats {
            held_reservations: self.held_total().await?,
            expired_total,
        })
    }

    async fn usage(
        &self,
        since: Option<u64>,
        limit: usize,
        tenant: Option<&str>,
    ) -> Result<UsagePage, Unavailable> {
        let (catalog, _) = self.snapshot();
        let limit = limit.clamp(1, MAX_USAGE_PAGE);
        // A tenant's records are all in its group; all tenants: every group.
        // On a single node one stream holds every record (group 0); on a
        // cluster a tenant's records are all in its group's stream.
        let groups: Vec<u16> = match tenant {
            _ if !self.is_cluster() => vec![0],
            Some(t) => vec![u16::from(ReservationId::tenant_tag(t))],
            None => (0..512).collect(),
        };
        let mut after = since.map(UsagePos::of);
        let mut waits = 0;
        loop {
            let parts = futures_util::future::join_all(groups.iter().map(|&g| {
                let start = match after {
                    None => "-".to_string(),
                    // Positions order by (ms, seq, group): a later group
                    // may hold the cursor's own id, an earlier one not.
                    Some(c) if g > c.group => format!("{}-{}", c.ms, c.seq),
                    Some(c) => format!("({}-{}", c.ms, c.seq),
                };
                self.usage_part(&catalog, g, start, limit)
            }))
            .await;
            // Complete below `horizon`: no group will ever add an entry
            // before the instant it was read at, nor (for a group that
            // filled its batch) before its last entry read.
            let mut horizon = u64::MAX;
            let mut entries = Vec::new();
            let mut any_full = false;
            for (&g, part) in groups.iter().zip(parts) {
                let (read_at_ms, range) = part?;
                horizon = horizon.min(
                    UsagePos {
                        ms: read_at_ms,
                        seq: 0,
                        group: 0,
                    }
                    .cursor(),
                );
                let full = range.ids.len() == limit;
                any_full |= full;
                for entry in range.ids {
                    let pos = UsagePos::from_id(&entry.id, g)
                        .ok_or_else(|| Self::corrupt(format!("a usage entry id {:?}", entry.id)))?;
                    entries.push((pos.cursor(), entry));
                }
                if full && let Some((last, _)) = entries.last() {
                    horizon = horizon.min(*last + 1);
                }
            }
            entries.sort_by_key(|(c, _)| *c);
            let waiting = entries.iter().any(|(c, _)| *c >= horizon);
            let mut page = UsagePage {
                records: Vec::new(),
                next_cursor: since.unwrap_or(0),
            };
            let mut scanned = None;
            for (cursor, entry) in entries.into_iter().take_while(|(c, _)| *c < horizon) {
                if page.records.len() == limit {
                    break;
                }
                let event = self.usage_event(&catalog, &entry)?;
                page.next_cursor = cursor;
                scanned = Some(cursor);
                if tenant.is_none_or(|t| event.tenant() == Some(t)) {
                    page.records.push(UsageRecord { cursor, event });
                }
            }
            if page.records.is_empty() {
                page.next_cursor = since.unwrap_or(0);
                // A full batch of other tenants' records: read on past it.
                if any_full && let Some(c) = scanned {
                    after = Some(UsagePos::of(c));
                    continue;
                }
                // Entries written in the very millisecond of the read are
                // not final yet: wait for the next one rather than answer
                // an empty page while records exist.
                if waiting && waits < 20 {
                    waits += 1;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
            }
            return Ok(page);
        }
    }
}

/// A usage record's place in the merged log: its stream id and group,
/// ordered by (ms, seq, group) and packed into the u64 cursor as
/// `ms · 2^22 + seq · 2^9 + group` (ms fits 42 bits until 2109; a group
/// adds far fewer than 8192 entries in one millisecond).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct UsagePos {
    ms: u64,
    seq: u64,
    group: u16,
}

impl UsagePos {
    fn from_id(id: &str, group: u16) -> Option<UsagePos> {
        let (ms, seq) = id.split_once('-')?;
        let (ms, seq): (u64, u64) = (ms.parse().ok()?, seq.parse().ok()?);
        (seq < 1 << 13 && ms < 1 << 42).then_some(UsagePos { ms, seq, group })
    }

    fn of(cursor: u64) -> UsagePos {
        UsagePos {
            ms: cursor >> 22,
            seq: (cursor >> 9) & ((1 << 13) - 1),
            group: (cursor & 511) as u16,
        }
    }

    fn cursor(self) -> u64 {
        (self.ms << 22) | (self.seq << 9) | u64::from(self.group)
    }
}

impl RedisStore {
    fn usage_event(
        &self,
        catalog: &Catalog,
        entry: &redis::streams::StreamId,
    ) -> Result<UsageEvent, Unavailable> {
        let field = |name: &str| -> Result<Vec<u8>, Unavailable> {
            entry
                .get::<Vec<u8>>(name)
                .ok_or_else(|| Self::corrupt(format!("a usage entry without {name:?}")))
        };
        let kind = String::from_utf8_lossy(&field("k")?).into_owned();
        let at: u64 = String::from_utf8_lossy(&field("at")?)
            .parse()
            .map_err(|_| Self::corrupt("a usage entry's instant".into()))?;
        let at = Timestamp::from_millis(at);
        if kind == "adjusted" {
            let a: AdjOut =
                rmp_serde::from_slice(&field("a")?).map_err(|e| Self::corrupt(e.to_string()))?;
            let scope = ScopeKey::parse(&a.s).map_err(|e| Self::corrupt(e.to_string()))?;
            let dimension = catalog
                .dimension(&a.d)
                .ok_or_else(|| Self::corrupt(format!("a dimension {:?}", a.d)))?;
            return Ok(UsageEvent {
                at,
                kind: UsageKind::Adjusted,
                reservation: None,
                adjustment: Some(Adjustment {
                    scope,
                    dimension,
                    credit: a.c,
                    reason: a.w,
                }),
            });
        }
        let kind = match kind.as_str() {
            "settled" => UsageKind::Settled,
            "refunded" => UsageKind::Refunded,
            "expired" => UsageKind::Expired,
            k => return Err(Self::corrupt(format!("a usage kind {k:?}"))),
        };
        let rec: Rec =
            rmp_serde::from_slice(&field("r")?).map_err(|e| Self::corrupt(e.to_string()))?;
        Ok(UsageEvent::ended(
            kind,
            at,
            self.reservation(catalog, &rec)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_positions_round_trip_and_order() {
        let p = UsagePos::from_id("1764460800123-7", 300).unwrap();
        assert_eq!(UsagePos::of(p.cursor()), p);
        let q = UsagePos::from_id("1764460800123-7", 301).unwrap();
        let r = UsagePos::from_id("1764460800123-8", 0).unwrap();
        let t = UsagePos::from_id("1764460800124-0", 0).unwrap();
        assert!(p.cursor() < q.cursor() && q.cursor() < r.cursor() && r.cursor() < t.cursor());
        assert!(UsagePos::from_id("1-8192", 0).is_none());
        assert!(UsagePos::from_id("x-1", 0).is_none());
        assert!(UsagePos::from_id("17", 0).is_none());
    }
}
