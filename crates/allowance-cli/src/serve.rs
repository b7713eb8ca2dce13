//! `allowance serve`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use allowance_config::{Config, Role, StoreKind};
use allowance_core::EmbeddedStore;
use allowance_server::{AppState, Credential, Credentials, Options, RandomIds, SystemClock};
use anyhow::Context;

/// Shards of the embedded ledger: tenants spread over them, each with its
/// own lock, so more shards than cores keeps contention low.
const SHARDS: usize = 64;

/// `serve`'s flags; they override the file.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Configuration file (TOML). Without it, the built-in starter (`allowance init`).
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Address to listen on (overrides `[server] listen`).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Data directory of the embedded store (overrides `[store] data_dir`).
    #[arg(long)]
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
    if config.store.kind == StoreKind::Redis {
        return Err(format!(
            "error: {}: key `store.kind`: the redis store is not available in this version; use \"embedded\"\n",
            config.source
        ));
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
            crate::err(&message);
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            crate::err(&format!("error: cannot start the runtime: {e}\n"));
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            crate::err(&format!("error: {e:#}\n"));
            ExitCode::FAILURE
        }
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
        match w.level {
            allowance_config::Level::Warning => tracing::warn!("configuration: {}", w.message),
            allowance_config::Level::Info => tracing::info!("configuration: {}", w.message),
        }
    }
    if let Some(dir) = &config.store.data_dir {
        tracing::warn!(
            data_dir = %dir.display(),
            "the durable embedded store is not available in this version: the ledger lives in memory \
             and everything is lost when the process stops (data_dir is not used)"
        );
    } else {
        tracing::info!("store: embedded, in memory (nothing survives a restart)");
    }
    let creds = credentials(&config);
    if creds.is_open() {
        tracing::warn!("no [[tokens]] configured: the API is open to anyone who can reach {local}");
    }
    let store = EmbeddedStore::new(
        config.catalog.clone(),
        SHARDS,
        Arc::new(SystemClock::default()),
        Arc::new(RandomIds),
    );
    let options = Options {
        store_timeout: Duration::from_millis(config.store.timeout_ms),
        max_wait_ms: config.queue.max_wait_ms,
        ..Options::default()
    };
    let state = AppState::new(Arc::new(store), creds, options);
    // Machine-readable for scripts and tests that ask for port 0.
    tracing::info!(address = %local, "listening on http://{local}");
    allowance_server::serve(listener, state, allowance_server::shutdown_signal())
        .await
        .context("server")?;
    tracing::info!("stopped");
    Ok(())
}
