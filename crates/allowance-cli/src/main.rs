//! `allowance`: the budget and rate limiter for AI agents, as one command.
//!
//! ```text
//! allowance serve [--config FILE] [--listen ADDR] [--data-dir DIR] [--insecure-no-auth]
//! allowance init                      # print the starter configuration
//! allowance check-config FILE         # validate; print the effective plans
//! allowance status SCOPE [--server URL] [--token T]
//! allowance usage export [--server URL] [--token T] [--since CURSOR] [--limit N]
//! allowance bench [--server URL | --embedded] [--scenario NAME] [--duration 10s] [--concurrency 64]
//! allowance token                     # a new token and its sha256
//! ```

#![forbid(unsafe_code)]

mod bench;
mod serve;
mod status;
mod usage;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

/// mimalloc: the request path allocates small, short-lived buffers (bodies,
/// JSON, headers) on two threads; glibc malloc cost ~14% of the server's
/// CPU in a profile of `allowance bench`.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Budgets and rate limits for AI agents: reserve an estimate, settle the actual.
#[derive(Debug, Parser)]
#[command(name = "allowance", version, about, long_about = None)]
struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the HTTP service (the built-in starter configuration without --config).
    Serve(serve::ServeArgs),
    /// Print the commented starter configuration (what `serve` runs without a file).
    Init,
    /// Validate a configuration file and print its effective plans and warnings.
    CheckConfig {
        /// The TOML file.
        file: PathBuf,
    },
    /// Show a scope's limits with fill bars.
    Status(status::StatusArgs),
    /// The usage log for billing: `usage export` prints it as JSON lines.
    Usage(usage::UsageArgs),
    /// Load-test a server: throughput and latency of reserve+settle pairs.
    Bench(bench::BenchArgs),
    /// Serve the no-op ceiling of `bench` (same routes and bodies, fixed answers).
    #[command(hide = true)]
    BenchNoop {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:8788")]
        listen: std::net::SocketAddr,
    },
    /// Make a random API token and print it with its sha256 (for `[[tokens]]`).
    Token,
}

/// Whether logs are JSON lines (`--log-format json`): then a command's
/// fatal error is one too, not a line of text among them.
static JSON_LOGS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Prints a fatal error (`error: …` lines): as text on stderr, or as one
/// JSON log event a line under `--log-format json`.
pub(crate) fn fatal(text: &str) {
    if JSON_LOGS.get() == Some(&true) {
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            tracing::error!("{}", line.strip_prefix("error: ").unwrap_or(line));
        }
    } else {
        err(text);
    }
}

fn init_logs(format: LogFormat) {
    let _ = JSON_LOGS.set(matches!(format, LogFormat::Json));
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Writes to stdout; a closed pipe (`allowance status … | head`) is not an
/// error worth a panic.
pub(crate) fn out(text: &str) {
    use std::io::Write;
    let mut o = std::io::stdout().lock();
    let _ = o.write_all(text.as_bytes()).and_then(|()| o.flush());
}

/// Writes to stderr, ignoring a closed stream.
pub(crate) fn err(text: &str) {
    use std::io::Write;
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Init => {
            crate::out(allowance_config::STARTER);
            ExitCode::SUCCESS
        }
        Command::CheckConfig { file } => check_config(&file),
        Command::Token => {
            let token = allowance_server::new_token();
            let hash = allowance_server::token_sha256_hex(&token);
            out(&format!(
                "token:  {token}\nsha256: {hash}\n\n\
                 # in the configuration (keep the token itself secret):\n\
                 [[tokens]]\nsha256 = \"{hash}\"\n\
                 role = \"admin\"        # or role = \"tenant\" with tenant = \"...\"\n"
            ));
            ExitCode::SUCCESS
        }
        Command::Serve(args) => {
            init_logs(cli.log_format);
            serve::run(args)
        }
        Command::Status(args) => status::run(args),
        Command::Usage(args) => usage::run(args),
        Command::Bench(args) => {
            init_logs(cli.log_format);
            bench::run(args)
        }
        Command::BenchNoop { listen } => {
            init_logs(cli.log_format);
            bench::noop(listen)
        }
    }
}

fn check_config(file: &std::path::Path) -> ExitCode {
    match allowance_config::load(file) {
        Ok(config) => {
            crate::out(&allowance_config::plans_table(&config));
            // Not an error here: the file may be checked where the keys
            // are not (CI), but `serve` would refuse it.
            for unset in serve::unset_api_keys(&config) {
                crate::err(&format!(
                    "warning: {}: {unset} in this environment; `allowance serve` refuses to start without it\n",
                    file.display()
                ));
            }
            ExitCode::SUCCESS
        }
        Err(errors) => {
            crate::err(&format!("{}\n", errors.to_string().trim_end()));
            ExitCode::from(2)
        }
    }
}

/// The multi-threaded runtime every HTTP server of this binary runs on
/// (`serve` and the no-op ceiling alike, so they compare fairly).
pub(crate) fn server_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
}
