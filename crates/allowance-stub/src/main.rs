//! `allowance-stub`: a local OpenAI/Anthropic stand-in on a port, for tests
//! and benchmarks. Prints `listening on http://ADDR` once ready.

use std::io::Write;
use std::net::SocketAddr;

use allowance_stub::{Stub, StubConfig};
use anyhow::Context;
use clap::Parser;

/// Serve the stub upstream until killed.
#[derive(Debug, Parser)]
#[command(name = "allowance-stub", version, about)]
struct Args {
    /// Address to listen on; port 0 picks a free one.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Output tokens per call (before the request's own bound), also after
    /// a reset.
    #[arg(long, default_value_t = 20)]
    output_tokens: u32,
    /// Keep no request log (benchmarks).
    #[arg(long)]
    no_record: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = StubConfig {
        output_tokens: args.output_tokens,
        record: !args.no_record,
    };
    let stub = Stub::spawn_with(args.listen, config).await?;
    {
        // The one line a parent process waits for; flushed because stdout
        // is a pipe there.
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "listening on {}", stub.base_url()).context("writing to stdout")?;
        stdout.flush().context("flushing stdout")?;
    }
    tokio::signal::ctrl_c()
        .await
        .context("waiting for ctrl-c")?;
    Ok(())
}
