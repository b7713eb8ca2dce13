//! The no-op ceiling on this machine, for BENCHMARKS.md:
//!
//! - `ceiling [SCENARIO] [SECONDS] [CONCURRENCY]` measures it in-process
//!   (defaults: pairs, 10, 64) and prints the report;
//! - `ceiling serve ADDR` only serves it (e.g. `127.0.0.1:9000`), so the
//!   client and the server can run as two processes and their CPU time be
//!   read apart (`ALLOWANCE_BENCH_SERVER=http://127.0.0.1:9000 ceiling …`
//!   then benchmarks that server instead).
//!
//! Run with `cargo run --release -p allowance-bench --example ceiling -- …`.

#![allow(clippy::print_stdout, reason = "an example prints its result")]

use std::time::Duration;

use allowance_bench::{BenchOptions, Progress, Scenario, measure_ceiling, run, serve_noop};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1).peekable();
    if args.peek().map(String::as_str) == Some("serve") {
        let addr = args.nth(1).unwrap_or_else(|| "127.0.0.1:9000".to_owned());
        let listener = tokio::net::TcpListener::bind(&addr).await?;
        eprintln!("no-op server on http://{}", listener.local_addr()?);
        serve_noop(listener).await?;
        return Ok(());
    }
    let scenario: Scenario = args.next().as_deref().unwrap_or("pairs").parse()?;
    let seconds: u64 = args.next().as_deref().unwrap_or("10").parse()?;
    let concurrency: usize = args.next().as_deref().unwrap_or("64").parse()?;
    let opts = BenchOptions {
        scenario,
        duration: Duration::from_secs(seconds),
        concurrency,
        progress: Progress::auto(),
        ..BenchOptions::default()
    };
    let report = match std::env::var("ALLOWANCE_BENCH_SERVER") {
        Ok(server) => run(&BenchOptions { server, ..opts }).await?,
        Err(_) => measure_ceiling(&opts).await?,
    };
    println!("{report}");
    Ok(())
}
