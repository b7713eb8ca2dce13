//! `allowance usage export`: the usage log (settles, refunds, expiries,
//! adjustments) as JSON lines on stdout, for billing. Pages through
//! `GET /v1/usage` until nothing is new, then prints `next cursor: N` on
//! stderr: a cron job passes it back as `--since N` and never misses or
//! repeats a record.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use allowance_core::MAX_USAGE_PAGE;
use anyhow::{Context, bail};

/// `usage`'s arguments.
#[derive(Debug, clap::Args)]
pub struct UsageArgs {
    #[command(subcommand)]
    command: UsageCommand,
}

#[derive(Debug, clap::Subcommand)]
enum UsageCommand {
    /// Print the usage log after a cursor as JSON lines (stdout); the cursor
    /// to resume from goes to stderr as `next cursor: N`.
    Export(ExportArgs),
}

/// `usage export`'s arguments.
#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// The server.
    #[arg(
        long,
        default_value = "http://127.0.0.1:8787",
        env = "ALLOWANCE_SERVER"
    )]
    server: String,
    /// API token: admin (every tenant) or a tenant's (its own records).
    #[arg(long, env = "ALLOWANCE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Start after this cursor (the `next cursor` of the last export);
    /// from the oldest record the server keeps when absent.
    #[arg(long, value_name = "CURSOR")]
    since: Option<u64>,
    /// Records per request (the server's default, 1000, when absent).
    #[arg(long, value_name = "N",
        value_parser = clap::value_parser!(u64).range(1..=MAX_USAGE_PAGE as u64))]
    limit: Option<u64>,
}

/// How long to wait to connect: a cron job should fail, not hang.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one page may take (10,000 records are a few megabytes).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `usage`'s subcommand; exit 1 with one line on stderr when the
/// server cannot be reached, refuses, or stdout cannot be written.
pub fn run(args: UsageArgs) -> ExitCode {
    match args.command {
        UsageCommand::Export(args) => export(&args),
    }
}

fn export(args: &ExportArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            crate::err(&format!("error: {e}\n"));
            return ExitCode::FAILURE;
        }
    };
    let mut cursor = args.since;
    let mut stdout = std::io::stdout().lock();
    match runtime.block_on(pages(args, &mut stdout, &mut cursor)) {
        Ok(()) => {
            crate::err(&format!("next cursor: {}\n", cursor.unwrap_or(0)));
            ExitCode::SUCCESS
        }
        Err(e) => {
            // What was written stays written: say where it ends, so a
            // resume neither repeats nor skips a record.
            let written = match cursor {
                Some(c) if cursor != args.since => {
                    format!(" (records up to cursor {c} were written: resume with --since {c})")
                }
                _ => String::new(),
            };
            let message = format!("{e:#}").replace('\n', " ");
            crate::err(&format!("error: {message}{written}\n"));
            ExitCode::FAILURE
        }
    }
}

/// Writes every page after `cursor` to `sink`, moving `cursor` past each
/// page only once it is written.
async fn pages(
    args: &ExportArgs,
    sink: &mut dyn Write,
    cursor: &mut Option<u64>,
) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(REQUEST_TIMEOUT)
        .build()
        .context("cannot make an HTTP client")?;
    loop {
        let url = page_url(&args.server, *cursor, args.limit);
        let mut req = client.get(&url);
        if let Some(t) = &args.token {
            req = req.bearer_auth(t);
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("cannot reach {}", args.server))?;
        let status = resp.status();
        let next = resp
            .headers()
            .get("x-next-cursor")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let body = resp
            .bytes()
            .await
            .with_context(|| format!("{status}: the answer was cut off"))?;
        if !status.is_success() {
            bail!("{}", refusal(status, &body));
        }
        let Some(next) = next else {
            bail!(
                "{status}: the answer has no X-Next-Cursor header: is {url} an allowance server?"
            );
        };
        let since = cursor.unwrap_or(0);
        if next < since {
            bail!("the server's cursor went backwards, from {since} to {next}");
        }
        sink.write_all(&body)
            .and_then(|()| sink.flush())
            .context("cannot write to stdout")?;
        *cursor = Some(next);
        // The server repeats the cursor it was given when nothing is new.
        if next == since {
            return Ok(());
        }
    }
}

/// `GET /v1/usage` after `since`.
fn page_url(server: &str, since: Option<u64>, limit: Option<u64>) -> String {
    let mut url = format!("{}/v1/usage", server.trim_end_matches('/'));
    let mut sep = '?';
    for (name, value) in [("since", since), ("limit", limit)] {
        if let Some(v) = value {
            url.push_str(&format!("{sep}{name}={v}"));
            sep = '&';
        }
    }
    url
}

/// A refusal in one line: the status and the error body's message (or the
/// start of whatever else came back).
fn refusal(status: reqwest::StatusCode, body: &[u8]) -> String {
    let message = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| {
            let text = String::from_utf8_lossy(body);
            let first = text.lines().next().unwrap_or("").trim();
            first.chars().take(200).collect()
        });
    if message.is_empty() {
        status.to_string()
    } else {
        format!("{status}: {message}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_carry_only_what_was_given() {
        assert_eq!(page_url("http://h:1/", None, None), "http://h:1/v1/usage");
        assert_eq!(
            page_url("http://h:1", Some(0), None),
            "http://h:1/v1/usage?since=0"
        );
        assert_eq!(
            page_url("http://h:1", Some(7), Some(2)),
            "http://h:1/v1/usage?since=7&limit=2"
        );
        assert_eq!(
            page_url("http://h:1", None, Some(2)),
            "http://h:1/v1/usage?limit=2"
        );
    }

    #[test]
    fn refusals_are_one_line() {
        let s = reqwest::StatusCode::UNAUTHORIZED;
        assert_eq!(
            refusal(
                s,
                br#"{"error": {"type": "unauthorized", "message": "unknown token"}}"#
            ),
            "401 Unauthorized: unknown token"
        );
        let s = reqwest::StatusCode::BAD_GATEWAY;
        assert_eq!(
            refusal(s, b"<html>\n<body>bad gateway</body>\n</html>"),
            "502 Bad Gateway: <html>"
        );
        assert_eq!(refusal(s, b""), "502 Bad Gateway");
    }
}
