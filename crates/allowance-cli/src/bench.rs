//! `allowance bench`: the load generator of `allowance-bench`, with the
//! options of CONFIG.md, and the no-op ceiling to compare against.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use allowance_bench::{BenchOptions, Progress, Report};
use allowance_core::EmbeddedStore;
use allowance_server::{AppState, Credentials, Options, RandomIds, SystemClock};
use anyhow::Context;

mod gateway;

/// `bench`'s flags.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// The server to load (HTTP/1.1 keep-alive, one connection per worker).
    #[arg(long, default_value = allowance_bench::DEFAULT_SERVER, conflicts_with = "embedded")]
    server: String,
    /// Start a server in this process (starter configuration, in memory) and load it.
    #[arg(long)]
    embedded: bool,
    /// pairs (reserve+settle), refund (reserve+refund), contention (one tenant), tenants (many
    /// tenants), fanout (seed 003: sub-tasks released at once, waiting in the admission queue),
    /// gateway (issue 7: the gateway's latency over its upstream; see --target, --direct).
    #[arg(long, default_value = "pairs")]
    scenario: gateway::ScenarioArg,
    /// fanout: how many sub-tasks.
    #[arg(long, default_value_t = 120)]
    tasks: usize,
    /// fanout: the simulated model call, from admission to settle (`200ms`).
    #[arg(long, default_value = "200ms")]
    call: String,
    /// fanout: the `wait_ms` each reserve sends (`60s`; at most the server's queue.max_wait_ms).
    #[arg(long, default_value = "60s")]
    wait: String,
    /// fanout: the tenant (default: a fresh `fanout-<unix ms>`, as a total budget never refills).
    #[arg(long)]
    tenant: Option<String>,
    /// fanout: rounds of the queued-vs-immediate overhead phase (0 skips it).
    #[arg(long, default_value_t = 50)]
    overhead_rounds: usize,
    /// How long to measure, after a 1 s warm-up (`10s`, `1m`).
    #[arg(long, default_value = "10s")]
    duration: String,
    /// Connections, each doing its pairs in sequence (default 64; gateway: 1).
    #[arg(long)]
    concurrency: Option<usize>,
    /// API token (admin: the scenarios use tenants named bench-*).
    #[arg(long, env = "ALLOWANCE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Also measure the no-op ceiling in this process, and print the ratios.
    #[arg(long)]
    ceiling: bool,
    /// Also measure a no-op ceiling already running (`allowance bench-noop`), and print the ratios.
    #[arg(long, conflicts_with = "ceiling")]
    ceiling_server: Option<String>,
    // Boxed: its many flags would make every `Command` variant as large.
    #[command(flatten)]
    gateway: Box<gateway::GatewayArgs>,
}

/// Runs the benchmark; exit 1 on a setup error (unreachable server, bad
/// option, refused credentials) or when no pair completed.
pub fn run(args: BenchArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            crate::err(&format!("error: {e}\n"));
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(bench(args)) {
        Ok(text) => {
            crate::out(&text);
            ExitCode::SUCCESS
        }
        Err(e) => {
            crate::err(&format!("error: {e:#}\n"));
            ExitCode::FAILURE
        }
    }
}

async fn bench(args: BenchArgs) -> anyhow::Result<String> {
    let duration_ms = allowance_config::parse_duration_ms(&args.duration)
        .map_err(|e| anyhow::anyhow!("--duration: {e}"))?;
    let scenario = match args.scenario {
        gateway::ScenarioArg::Gateway => {
            return gateway::bench(*args.gateway, args.concurrency).await;
        }
        gateway::ScenarioArg::Load(s) => s,
    };
    let mut opts = BenchOptions::new(args.server.clone());
    opts.scenario = scenario;
    opts.duration = std::time::Duration::from_millis(duration_ms);
    let ms = |flag: &str, text: &str| {
        allowance_config::parse_duration_ms(text)
            .map(std::time::Duration::from_millis)
            .map_err(|e| anyhow::anyhow!("--{flag}: {e}"))
    };
    opts.fanout.tasks = args.tasks;
    opts.fanout.call = ms("call", &args.call)?;
    opts.fanout.wait = ms("wait", &args.wait)?;
    opts.fanout.tenant = args.tenant.clone();
    opts.fanout.overhead_rounds = args.overhead_rounds;
    opts.concurrency = args.concurrency.unwrap_or(64);
    opts.token = args.token.clone();
    opts.progress = Progress::auto();
    if args.embedded {
        opts.server = format!("http://{}", start_embedded().await?);
    }
    let mut out = String::new();
    // Flat: the bench's errors already end with their cause.
    let target = allowance_bench::run(&opts)
        .await
        .map_err(|e| anyhow::anyhow!("benchmark: {e}"))?;
    if target.pairs == 0 && target.errors > 0 {
        // A script must not read a run of failures as a measurement.
        anyhow::bail!(
            "{target}\nno pair completed: all {} failed (see the errors above)",
            target.errors
        );
    }
    out.push_str(&format!("{target}\n"));
    let ceiling: Option<Report> = if args.ceiling {
        Some(
            allowance_bench::measure_ceiling(&opts)
                .await
                .context("no-op ceiling")?,
        )
    } else if let Some(url) = &args.ceiling_server {
        let mut o = opts.clone();
        o.server = url.clone();
        o.token = None;
        Some(allowance_bench::run(&o).await.context("no-op ceiling")?)
    } else {
        None
    };
    if let Some(c) = ceiling {
        out.push_str(&format!("{c}\n"));
        out.push_str(&allowance_bench::compare(&target, &c));
        out.push('\n');
    }
    Ok(out)
}

/// A server on 127.0.0.1:0 in this process, as `serve` would run it with
/// the starter configuration.
async fn start_embedded() -> anyhow::Result<SocketAddr> {
    let config = allowance_config::starter();
    let store = EmbeddedStore::new(
        config.catalog.clone(),
        64,
        Arc::new(SystemClock::default()),
        Arc::new(RandomIds),
    );
    let state = AppState::new(Arc::new(store), Credentials::default(), Options::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(allowance_server::serve(
        listener,
        state,
        std::future::pending(),
    ));
    Ok(addr)
}

/// `allowance bench-noop`: the ceiling as its own process, so client and
/// server are two processes for the ceiling as for the real server.
pub fn noop(listen: SocketAddr) -> ExitCode {
    let runtime = match crate::server_runtime() {
        Ok(r) => r,
        Err(e) => {
            crate::err(&format!("error: {e}\n"));
            return ExitCode::FAILURE;
        }
    };
    let result: anyhow::Result<()> = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("cannot listen on {listen}"))?;
        tracing::info!(address = %listener.local_addr()?, "no-op ceiling listening");
        tokio::select! {
            r = allowance_bench::serve_noop(listener) => r.context("no-op server")?,
            _ = allowance_server::shutdown_signal() => {}
        }
        Ok(())
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            crate::err(&format!("error: {e:#}\n"));
            ExitCode::FAILURE
        }
    }
}
