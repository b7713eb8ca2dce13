//! `allowance status SCOPE`: a scope's limits with fill bars.

use anyhow::Context;
use std::process::ExitCode;

use serde_json::Value;

/// `status`'s arguments.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// Canonical scope name, e.g. `tenant:acme/user:bob`.
    scope: String,
    /// The server.
    #[arg(
        long,
        default_value = "http://127.0.0.1:8787",
        env = "ALLOWANCE_SERVER"
    )]
    server: String,
    /// API token (admin, or the scope's tenant).
    #[arg(long, env = "ALLOWANCE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Print the server's JSON instead of the table.
    #[arg(long)]
    json: bool,
}

const BAR_CELLS: usize = 24;

/// A bar of `BAR_CELLS` cells: used (█), then held (▒), then room (·).
pub fn bar(used: i64, held: u64, capacity: u64) -> String {
    let cap = capacity.max(1) as f64;
    let cells = |n: f64| {
        ((n / cap) * BAR_CELLS as f64)
            .round()
            .clamp(0.0, BAR_CELLS as f64) as usize
    };
    let used_cells = cells(used.max(0) as f64);
    let held_cells = cells(used.max(0) as f64 + held as f64).saturating_sub(used_cells);
    let room = BAR_CELLS.saturating_sub(used_cells + held_cells);
    format!(
        "{}{}{}",
        "█".repeat(used_cells),
        "▒".repeat(held_cells),
        "·".repeat(room)
    )
}

fn window_text(l: &Value) -> String {
    let kind = l["window"].as_str().unwrap_or("?");
    let period = l["period_ms"]
        .as_u64()
        .map(allowance_config::format_duration_ms);
    match (kind, period, l["unit"].as_str()) {
        ("sliding", Some(p), _) => format!("sliding {p}/{}", l["slices"].as_u64().unwrap_or(0)),
        ("bucket", Some(p), _) => format!("bucket {p}"),
        ("calendar", _, Some(unit)) => {
            let zone = l["zone"].as_str().unwrap_or("UTC");
            format!("calendar {unit} {zone}")
        }
        (k, _, _) => k.to_string(),
    }
}

/// The table for a status answer.
pub fn render(status: &Value) -> String {
    let mut out = format!(
        "{}  plan {}  held reservations {}\n",
        status["scope"].as_str().unwrap_or("?"),
        status["plan"].as_str().unwrap_or("?"),
        status["held_reservations"].as_u64().unwrap_or(0)
    );
    let limits = status["limits"].as_array().cloned().unwrap_or_default();
    if limits.is_empty() {
        out.push_str("  (no limits)\n");
    }
    for l in &limits {
        let used = l["used"].as_i64().unwrap_or(0);
        let held = l["held"].as_u64().unwrap_or(0);
        let capacity = l["capacity"].as_u64().unwrap_or(0);
        let pct = if capacity == 0 {
            0.0
        } else {
            100.0 * (used.max(0) as f64 + held as f64) / capacity as f64
        };
        let resets = l["resets_at"]
            .as_str()
            .map(|t| format!("  room at {t}"))
            .unwrap_or_default();
        out.push_str(&format!(
            "  {:<14} {:<24} [{}] {:>5.1}%  used {} held {} of {}  remaining {}{}\n",
            l["dimension"].as_str().unwrap_or("?"),
            window_text(l),
            bar(used, held, capacity),
            pct,
            used,
            held,
            capacity,
            l["remaining"].as_i64().unwrap_or(0),
            resets
        ));
    }
    out
}

/// Fetches and prints; exit 1 when the server cannot be reached or refuses.
pub fn run(args: StatusArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            crate::err(&format!("error: {e:#}\n"));
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(fetch(&args)) {
        Ok(v) => {
            if args.json {
                let pretty = serde_json::to_string_pretty(&v).unwrap_or_default();
                crate::out(&format!("{pretty}\n"));
            } else {
                crate::out(&render(&v));
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            crate::err(&format!("error: {e:#}\n"));
            ExitCode::FAILURE
        }
    }
}

async fn fetch(args: &StatusArgs) -> anyhow::Result<Value> {
    let url = scope_url(&args.server, &args.scope)?;
    let client = reqwest::Client::new();
    let mut req = client.get(url);
    if let Some(t) = &args.token {
        req = req.bearer_auth(t);
    }
    // The chain says why (reqwest's own text names only the URL): printed
    // with `{:#}` below.
    let resp = req
        .send()
        .await
        .with_context(|| format!("cannot reach {}", args.server))?;
    let status = resp.status();
    let body: Value = resp.json().await.map_err(|e| {
        anyhow::anyhow!("the server answered {status} with a body that is not JSON: {e}")
    })?;
    if !status.is_success() {
        let msg = body["error"]["message"].as_str().unwrap_or("no message");
        anyhow::bail!("{status}: {msg}");
    }
    Ok(body)
}

/// `{server}/v1/scopes/{scope}` with the scope as one percent-encoded path
/// segment (HTTP-API.md answer 6), so a `?`, `#` or `..` in it reaches the
/// server as part of the name instead of cutting or moving the path.
fn scope_url(server: &str, scope: &str) -> anyhow::Result<reqwest::Url> {
    let mut url = reqwest::Url::parse(server)
        .map_err(|e| anyhow::anyhow!("--server {server:?} is not a URL ({e})"))?;
    if url.cannot_be_a_base() || !matches!(url.scheme(), "http" | "https") {
        anyhow::bail!("--server {server:?} is not an http:// or https:// URL");
    }
    url.path_segments_mut()
        .map_err(|()| anyhow::anyhow!("--server {server:?} cannot take a path"))?
        .pop_if_empty()
        .extend(["v1", "scopes", scope]);
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scope_is_one_encoded_path_segment() {
        let url = |server: &str, scope: &str| scope_url(server, scope).map(|u| u.to_string());
        assert_eq!(
            url("http://127.0.0.1:8787", "tenant:acme/user:bob").unwrap(),
            "http://127.0.0.1:8787/v1/scopes/tenant:acme%2Fuser:bob"
        );
        assert_eq!(
            url("http://127.0.0.1:8787/", "tenant:a?b").unwrap(),
            "http://127.0.0.1:8787/v1/scopes/tenant:a%3Fb"
        );
        assert_eq!(
            url("http://h/base/", "tenant:acme/../tenant:x").unwrap(),
            "http://h/base/v1/scopes/tenant:acme%2F..%2Ftenant:x"
        );
        assert_eq!(
            url("http://h", "tenant:acme#x").unwrap(),
            "http://h/v1/scopes/tenant:acme%23x"
        );
        assert!(url("notaurl", "tenant:a").is_err());
        assert!(url("ftp://h", "tenant:a").is_err());
    }

    #[test]
    fn bars_show_used_then_held() {
        assert_eq!(bar(0, 0, 100), "·".repeat(24));
        assert_eq!(
            bar(50, 25, 100),
            format!("{}{}{}", "█".repeat(12), "▒".repeat(6), "·".repeat(6))
        );
        assert_eq!(
            bar(150, 0, 100),
            "█".repeat(24),
            "an overrun fills the bar, no more"
        );
        assert_eq!(bar(-5, 0, 100), "·".repeat(24));
    }

    #[test]
    fn renders_every_limit() {
        let v: Value = serde_json::json!({
        "scope": "tenant:acme/user:bob", "plan": "user-default", "held_reservations": 1,
        "limits": [
            {"dimension": "tokens", "window": "sliding", "period_ms": 3600000, "slices": 60,
             "capacity": 200000, "used": 50000, "held": 10000, "remaining": 140000,
             "resets_at": "2026-11-29T16:01:00.000Z"},
            {"dimension": "concurrent", "window": "concurrent", "capacity": 4, "used": 0,
             "held": 1, "remaining": 3, "resets_at": null}
        ]});
        let text = render(&v);
        assert!(text.starts_with("tenant:acme/user:bob  plan user-default  held reservations 1"));
        assert!(text.contains("sliding 1h/60"), "{text}");
        assert!(text.contains(" 30.0%"), "{text}");
        assert!(text.contains("room at 2026-11-29T16:01:00.000Z"), "{text}");
        assert!(text.contains("concurrent"), "{text}");
    }
}
