//! `allowance serve`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use allowance_config::{Config, OnError, Role, StoreKind};
use allowance_core::{EmbeddedStore, Store};
use allowance_durable::{DurableOptions, DurableStore};
use allowance_redis::{FailOpenLocal, RedisOptions, RedisStore};
use allowance_server::{AppState, Credential, Credentials, Options, RandomIds, SystemClock};
use allowance_wal::Fsync as WalFsync;
use anyhow::Context;
use clap::builder::TypedValueParser;

/// Shards of the embedded ledger: tenants spread over them, each with its
/// own lock, so more shards than cores keeps contention low.
const SHARDS: usize = 64;

/// `fsync = "batch"`: the longest an acknowledged record waits for its
/// fsync — what a power loss can cost (a process crash loses nothing).
const BATCH_WINDOW: Duration = Duration::from_millis(10);

/// `on_error = "fail_open_local"`: time for the local ledger to answer
/// after Redis's `timeout_ms` ran out.
const FAIL_OPEN_SLACK: Duration = Duration::from_millis(250);

/// `serve`'s flags; they override the file.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Configuration file (TOML). Without it, the built-in starter (`allowance init`).
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Address to listen on (overrides `[server] listen`).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Data directory of the embedded store (overrides `[store] data_dir`;
    /// `--data-dir ""` keeps the ledger in memory only).
    // clap's PathBuf parser refuses an empty value; "" is meaningful here.
    #[arg(long, value_parser = clap::builder::OsStringValueParser::new().map(PathBuf::from))]
    data_dir: Option<PathBuf>,
    /// Allow listening on a non-loopback address with no tokens configured.
    #[arg(long)]
    insecure_no_auth: bool,
}

/// Loads the configuration and applies the flags; a problem is reported
/// with the file, line and key and exits 2.
fn configure(args: &ServeArgs) -> Result<Config, String> {
    let mut config = match &args.config {
        Some(path) => {
            allowance_config::load(path).map_err(|e| format!("{}\n", e.to_string().trim_end()))?
        }
        None => allowance_config::starter(),
    };
    if let Some(listen) = args.listen {
        config.server.listen = listen;
    }
    if let Some(dir) = &args.data_dir {
        if config.store.kind == StoreKind::Redis {
            return Err(
                "error: --data-dir: the store is redis (`[store] kind`); a data directory is for the embedded store\n"
                    .into(),
            );
        }
        config.store.data_dir = (!dir.as_os_str().is_empty()).then(|| dir.clone());
    }
    // The environment completes the file: an upstream's key that is not
    // there is a configuration problem, found before anything starts.
    if let Some(first) = unset_api_keys(&config).first() {
        let source = args
            .config
            .as_ref()
            .map_or(allowance_config::STARTER_SOURCE.into(), |p| {
                p.display().to_string()
            });
        return Err(format!("error: {source}: {first}\n"));
    }
    let open = config.tokens.is_empty();
    if open && !config.server.listen.ip().is_loopback() && !args.insecure_no_auth {
        return Err(format!(
            "error: refusing to listen on {} with no credentials: anyone who can reach it could spend any tenant's budget.\n\
             Configure [[tokens]] (see `allowance token`), listen on 127.0.0.1, or pass --insecure-no-auth.\n",
            config.server.listen
        ));
    }
    Ok(config)
}

/// The gateway upstreams whose `api_key_env` is not set here (see
/// [`allowance_server::gateway::unset_api_keys`]).
pub(crate) fn unset_api_keys(config: &Config) -> Vec<String> {
    config.gateway.as_ref().map_or_else(Vec::new, |g| {
        allowance_server::gateway::unset_api_keys(g, |name| std::env::var(name).ok())
    })
}

fn credentials(config: &Config) -> Credentials {
    Credentials::new(
        config
            .tokens
            .iter()
            .map(|t| Credential {
                sha256: t.sha256,
                tenant: match &t.role {
                    Role::Admin => None,
                    Role::Tenant(name) => Some(name.clone()),
                },
            })
            .collect(),
    )
}

/// Runs the service until SIGTERM/SIGINT; exit 0 after a clean shutdown,
/// 2 on a configuration problem, 1 when it cannot start.
pub fn run(args: ServeArgs) -> ExitCode {
    let config = match configure(&args) {
        Ok(c) => c,
        Err(message) => {
            crate::fatal(&message);
            return ExitCode::from(2);
        }
    };
    no_huge_pages();
    let runtime = match crate::server_runtime() {
        Ok(r) => r,
        Err(e) => {
            crate::fatal(&format!("error: cannot start the runtime: {e}\n"));
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            crate::fatal(&format!("error: {e:#}\n"));
            ExitCode::FAILURE
        }
    }
}

/// Turns transparent huge pages off for this process, as Redis advises
/// for itself. The ledger's memory grows with every remembered
/// reservation; with THP on, each first touch of a new 2 MiB region zeroes
/// all of it inside the request that touched it (~5% of the server's CPU
/// in a profile of `allowance bench`, and a latency spike for that
/// request). With 4 KiB pages the same memory is zeroed as it is used.
fn no_huge_pages() {
    #[cfg(target_os = "linux")]
    if let Err(e) = nix::sys::prctl::set_thp_disable(true) {
        tracing::debug!(error = %e, "transparent huge pages stay as the system sets them");
    }
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let listen = config.server.listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let local = listener.local_addr().context("listener address")?;
    tracing::info!(config = %config.source, "configuration loaded");
    for w in allowance_config::check(&config) {
        // Started anyway (--insecure-no-auth): the open API is logged below,
        // not check-config's "will refuse to start" about this very start.
        if w.message.starts_with("no [[tokens]] while listening") {
            continue;
        }
        match w.level {
            allowance_config::Level::Warning => tracing::warn!("configuration: {}", w.message),
            allowance_config::Level::Info => tracing::info!("configuration: {}", w.message),
        }
    }
    let creds = credentials(&config);
    if creds.is_open() {
        tracing::warn!("no [[tokens]] configured: the API is open to anyone who can reach {local}");
    }
    let clock: Arc<SystemClock> = Arc::new(SystemClock::default());
    let (store, durable): (Arc<dyn Store>, Option<DurableStore>) = match &config.store.data_dir {
        _ if config.store.kind == StoreKind::Redis => {
            (connect_redis(&config, clock.clone()).await?, None)
        }
        Some(dir) => {
            let store = open_durable(&config, dir, clock.clone()).await?;
            (Arc::new(store.clone()), Some(store))
        }
        None => {
            tracing::info!(
                "store: embedded, in memory (data_dir = \"\": nothing survives a restart)"
            );
            let store =
                EmbeddedStore::new(config.catalog.clone(), SHARDS, clock, Arc::new(RandomIds));
            (Arc::new(store), None)
        }
    };
    let mut store_timeout = Duration::from_millis(config.store.timeout_ms);
    if config.store.kind == StoreKind::Redis && config.store.on_error == OnError::FailOpenLocal {
        // Redis is given `timeout_ms` to answer, then the local ledger
        // answers: the bound on a store call leaves room for both.
        store_timeout = store_timeout * 2 + FAIL_OPEN_SLACK;
    }
    let gateway = match &config.gateway {
        Some(g) => {
            let gw = allowance_server::gateway::Gateway::new(g).map_err(|e| anyhow::anyhow!(e))?;
            tracing::info!(
                upstreams = g.upstreams.len(),
                keys = g.keys.len(),
                "gateway: OpenAI- and Anthropic-compatible routes on /v1/chat/completions, /v1/responses, /v1/embeddings, /v1/models and /v1/messages"
            );
            Some(Arc::new(gw))
        }
        None => None,
    };
    let options = Options {
        gateway,
        store_timeout,
        max_wait_ms: config.queue.max_wait_ms,
        queue_limits: allowance_server::QueueLimits {
            per_tenant: config.queue.max_waiters_per_tenant,
            total: config.queue.max_waiters,
        },
        ..Options::default()
    };
    let state = AppState::new(store, creds, options);
    // Machine-readable for scripts and tests that ask for port 0.
    tracing::info!(address = %local, "listening on http://{local}");
    allowance_server::serve(listener, state, allowance_server::shutdown_signal())
        .await
        .context("server")?;
    if let Some(store) = durable {
        store.close().await.context("closing the write-ahead log")?;
    }
    tracing::info!("stopped");
    Ok(())
}

/// Connects to the Redis store; every instance sharing it should load the
/// same configuration (admin changes made through the API are shared).
/// Under `on_error = "fail_open_local"` it is wrapped in [`FailOpenLocal`].
async fn connect_redis(config: &Config, clock: Arc<SystemClock>) -> anyhow::Result<Arc<dyn Store>> {
    let url = config
        .store
        .url
        .clone()
        .context("store.url is required for the redis store")?;
    let mut options = RedisOptions::new(url.clone());
    options.timeout_ms = config.store.timeout_ms;
    let catalog = config.catalog.clone();
    let store = match config.store.on_error {
        // Fails loudly at start: a wrong URL or password is found now, not
        // by the first request.
        OnError::FailClosed => RedisStore::connect(options, catalog, None, Arc::new(RandomIds))
            .await
            .context("cannot start the redis store")?,
        // Starts without Redis too: this policy answers during an outage,
        // and a restart during one must not stop the service.
        OnError::FailOpenLocal => {
            let later = RedisStore::connect_later(options, catalog, None, Arc::new(RandomIds))
                .context("cannot start the redis store")?;
            if let Err(e) = later.connect_now().await {
                tracing::error!(
                    url = %allowance_redis::redacted_url(&url),
                    error = %e,
                    "Redis cannot be reached: starting anyway (on_error = \"fail_open_local\"), admitting locally until the sweeper connects"
                );
            }
            later
        }
    };
    tracing::info!(url = %allowance_redis::redacted_url(&url), prefix = store.prefix(), "store: redis");
    match config.store.on_error {
        OnError::FailClosed => {
            tracing::info!(
                on_error = "fail_closed",
                "store failure policy: a reserve answers 503 store_unavailable while Redis cannot answer"
            );
            Ok(Arc::new(store))
        }
        OnError::FailOpenLocal => {
            let fraction = config.store.fail_open_fraction;
            tracing::info!(
                on_error = "fail_open_local",
                fail_open_fraction = fraction,
                "store failure policy: while Redis cannot answer, this process admits against each limit's capacity × {fraction} and reconciles when Redis is back (what it admitted locally is lost if it dies before then)"
            );
            Ok(Arc::new(FailOpenLocal::new(
                Arc::new(store),
                fraction,
                clock,
                Arc::new(RandomIds),
            )))
        }
    }
}

/// Opens the durable embedded store in `dir`: recovery with a progress bar
/// on a terminal when it is long, then one log line of what it found.
async fn open_durable(
    config: &Config,
    dir: &std::path::Path,
    clock: Arc<SystemClock>,
) -> anyhow::Result<DurableStore> {
    let mut opts = DurableOptions::new(dir);
    opts.shards = SHARDS;
    opts.wal.fsync = match config.store.fsync {
        allowance_config::Fsync::Always => WalFsync::Always,
        allowance_config::Fsync::Batch => WalFsync::Batch {
            window: BATCH_WINDOW,
        },
        allowance_config::Fsync::Never => WalFsync::Never,
    };
    if dir.exists() && !dir.is_dir() {
        anyhow::bail!(
            "cannot open the data dir {}: it is a file, not a directory",
            dir.display()
        );
    }
    let bar = indicatif::ProgressBar::hidden();
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
    }
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "recovering {pos}/{len} log records [{bar:30}] {per_sec}, {eta} left",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let progress_bar = bar.clone();
    let (store, report) = DurableStore::open(
        config.catalog.clone(),
        opts,
        Arc::new(allowance_wal::RealFs),
        clock,
        Arc::new(RandomIds),
        move |p: allowance_wal::ReplayProgress| {
            progress_bar.set_length(p.total);
            progress_bar.set_position(p.replayed);
        },
    )
    .await
    // Flat: the store's error already ends with the OS's reason, which a
    // context chain would print a second time.
    .map_err(|e| anyhow::anyhow!("cannot open the data dir {}: {e}", dir.display()))?;
    bar.finish_and_clear();
    if let Some(torn) = &report.torn_tail {
        if torn.acknowledged_lost {
            tracing::error!(
                file = %torn.file.display(),
                offset = torn.offset,
                bytes = torn.bytes_dropped,
                reason = %torn.reason,
                "a power loss under fsync = \"never\" left a hole in the log: cut there, with the acknowledged records after it"
            );
        } else {
            tracing::warn!(
                file = %torn.file.display(),
                offset = torn.offset,
                bytes = torn.bytes_dropped,
                reason = %torn.reason,
                "cut off a torn tail: the unfinished last write before a crash (acknowledged only under fsync = \"batch\" or \"never\", and lost only to a power loss)"
            );
        }
    }
    if let Some(torn) = &report.usage_torn_tail {
        tracing::warn!(
            file = %torn.file.display(),
            offset = torn.offset,
            bytes = torn.bytes_dropped,
            "cut off a torn tail of the usage log; its events are regenerated from the main log"
        );
    }
    if let Some((first, last)) = report.usage_ahead {
        tracing::error!(
            first_lsn = first,
            last_lsn = last,
            "the usage log held events of main records the log had lost (a power loss, or damage cut from its end): they stay in the export, for operations the ledger no longer has"
        );
    }
    for change in &report.admin_changes {
        tracing::info!("in force from the API (wins over the file): {change}");
    }
    for change in &report.skipped_admin_changes {
        tracing::warn!("an admin change no longer applies and is skipped: {change}");
    }
    if !report.divergences.is_empty() {
        tracing::error!(
            divergences = ?report.divergences,
            "some logged operations did not replay as they ran: please report this"
        );
    }
    tracing::info!(
        data_dir = %dir.display(),
        fsync = %config.store.fsync,
        snapshot_lsn = report.snapshot_lsn.unwrap_or(0),
        replayed = report.replayed,
        last_lsn = report.last_lsn,
        expired_total = report.expired_total,
        config_changed = report.config_changed,
        elapsed_ms = report.elapsed.as_millis() as u64,
        "store: embedded, durable"
    );
    Ok(store)
}
