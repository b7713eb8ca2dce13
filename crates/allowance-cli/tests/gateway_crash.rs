//! kill -9 of the real `allowance` binary serving the gateway on the
//! durable store, under concurrent model calls (whole and streamed), then
//! a restart on the same data directory. The upstream is the stub, in this
//! test's process, so it outlives every kill.
//!
//! What must hold after each restart:
//! - **A whole answer's settle is kept once a later call was forwarded.**
//!   The gateway settles a whole answer before passing it on and makes it
//!   durable after (docs/GATEWAY.md, step 6), and it makes a call's
//!   reserve durable before forwarding it. The log is one ordered file, so
//!   when a call B sent after A's answer came back was forwarded (B got a
//!   200), A's settle is on disk: its task scope shows exactly A's usage.
//! - **Nothing is counted twice or on part of its scopes.** Once the
//!   killed process's holds have expired, the tenant's `used` tokens equal
//!   the sum over every call's own task scope, and every reservation in
//!   the usage log ended at most once (an expiry may be followed by a late
//!   settle, nothing else).
//!
//! `ALLOWANCE_CRASH_ROUNDS` (default 3) sets the kill/restart cycles.
mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};
use tokio::task::JoinSet;

/// The gateway key every call uses (tenant acme, user bob, may add tasks).
const KEY: &str = "gw-crash-key-4d2e";
/// Concurrent callers during the load.
const CALLERS: u64 = 12;
/// Bound on one phase: a hang fails the test, a slow machine does not.
const PHASE_BOUND: Duration = Duration::from_secs(60);

/// `total` token limits everywhere (never refilling, never denying), so
/// `used` is the exact sum of what was charged. A short TTL: the holds of
/// calls the kill cut off expire seconds after the restart.
fn config(stub_url: &str) -> String {
    format!(
        r#"
[store]
fsync = "always"
[reservations]
default_ttl_ms = 2000
[kinds.tenant]
plan = "t"
[kinds.user]
plan = "t"
[kinds.task]
plan = "t"
[plans.t]
limits = [{{ dimension = "tokens", capacity = 1_000_000_000_000, window = "total" }}]
[models."gpt-4o"]
input_per_million = "2.50"
output_per_million = "10.00"
max_output_tokens = 1000
[gateway]
stream_tranche_tokens = 4
[[gateway.upstreams]]
name = "stub"
base_url = "{stub_url}"
models = ["gpt-4o"]
[[gateway.keys]]
sha256 = "{key}"
tenant = "acme"
user = "bob"
client_scopes = ["task"]
"#,
        key = allowance_server::token_sha256_hex(KEY),
    )
}

/// One model call as the client saw it.
#[derive(Debug, Clone)]
struct Call {
    /// Its task scope's id (`task:<task>`): unique per call.
    task: String,
    stream: bool,
    sent_at: Instant,
    /// The status, once the answer's head arrived.
    status: Option<u16>,
    /// When the whole answer had arrived (a whole body, or a stream to
    /// its `[DONE]`).
    done_at: Option<Instant>,
    /// input + output tokens of a whole answer's `usage`.
    tokens: Option<u64>,
}

async fn one_call(client: &reqwest::Client, base: &str, task: String, stream: bool) -> Call {
    let mut call = Call {
        task,
        stream,
        sent_at: Instant::now(),
        status: None,
        done_at: None,
        tokens: None,
    };
    let body = json!({
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": format!("hello {}", call.task)}],
        "max_tokens": 6,
        "stream": stream,
    });
    let sent = client
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(KEY)
        .header("x-allowance-task", &call.task)
        .json(&body)
        .timeout(Duration::from_secs(20))
        .send()
        .await;
    let Ok(resp) = sent else { return call };
    call.status = Some(resp.status().as_u16());
    let Ok(text) = resp.text().await else {
        return call;
    };
    if stream {
        if text.contains("data: [DONE]") {
            call.done_at = Some(Instant::now());
        }
    } else if let Ok(v) = serde_json::from_str::<Value>(&text) {
        call.done_at = Some(Instant::now());
        let u = &v["usage"];
        if let (Some(i), Some(o)) = (u["prompt_tokens"].as_u64(), u["completion_tokens"].as_u64()) {
            call.tokens = Some(i + o);
        }
    }
    call
}

/// Callers sending calls until `stop`; every call they sent, answered or not.
async fn load(base: String, round: u64, stop: Arc<AtomicBool>) -> Vec<Call> {
    let client = reqwest::Client::new();
    let counter = Arc::new(AtomicU64::new(0));
    let mut set = JoinSet::new();
    for caller in 0..CALLERS {
        let (client, base, stop, counter) =
            (client.clone(), base.clone(), stop.clone(), counter.clone());
        set.spawn(async move {
            let mut calls = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let n = counter.fetch_add(1, Ordering::Relaxed);
                let task = format!("r{round}-c{n}");
                calls.push(one_call(&client, &base, task, (n + caller) % 3 == 0).await);
            }
            calls
        });
    }
    let mut all = Vec::new();
    while let Some(r) = set.join_next().await {
        all.extend(r.expect("a caller task"));
    }
    all
}

/// A scope's status (it must answer 200).
async fn scope(server: &Server, scope: &str) -> Value {
    server
        .get(&format!("/v1/scopes/{scope}"), None)
        .await
        .expect(200)
        .json
}

/// `used` tokens on `scope`.
async fn used(server: &Server, name: &str) -> u64 {
    let s = scope(server, name).await;
    let limits = s["limits"].as_array().expect("limits");
    limits
        .iter()
        .find(|l| l["dimension"] == "tokens")
        .and_then(|l| l["used"].as_u64())
        .unwrap_or_else(|| panic!("no tokens limit on {name}: {s}"))
}

/// Waits until the tenant holds nothing (the killed process's calls
/// expire after their 2 s TTL).
async fn wait_nothing_held(server: &Server) {
    let started = Instant::now();
    loop {
        let s = scope(server, "tenant:acme").await;
        if s["held_reservations"].as_u64() == Some(0) {
            return;
        }
        assert!(
            started.elapsed() < PHASE_BOUND,
            "holds left on tenant:acme: {s}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The whole usage log: each reservation's record kinds in order, and the
/// tokens charged to tenant acme's calls in all.
async fn endings(server: &Server) -> (HashMap<String, Vec<String>>, u64) {
    let mut by_id: HashMap<String, Vec<String>> = HashMap::new();
    let mut charged = 0;
    for v in server.usage_records(None).await {
        if v["tenant"] == "acme" {
            charged += v["charged"]["tokens"].as_u64().unwrap_or(0);
        }
        if let Some(id) = v["reservation"].as_str() {
            by_id
                .entry(id.to_string())
                .or_default()
                .push(v["kind"].as_str().unwrap_or("").to_string());
        }
    }
    (by_id, charged)
}

fn start(config: &Path, data: &Path) -> Server {
    Server::on_data_dir(config, data)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_keeps_what_it_acted_on_across_kill_9() {
    let rounds = std::env::var("ALLOWANCE_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3u64);
    let stub = allowance_stub::Stub::spawn("127.0.0.1:0".parse().expect("an address"))
        .await
        .expect("the stub starts");
    let (_config_dir, config_path) = config_file(&config(&stub.base_url()));
    let data = tempfile::tempdir().expect("a data dir");
    let mut all: Vec<Call> = Vec::new();
    let mut server = start(&config_path, data.path());
    let mut tenant_before = 0;
    for round in 0..rounds {
        // Load, then a kill at a moment that varies with the round.
        let stop = Arc::new(AtomicBool::new(false));
        let load = tokio::spawn(load(server.base.clone(), round, stop.clone()));
        tokio::time::sleep(Duration::from_millis(300 + 170 * (round % 5))).await;
        let killed = tokio::task::spawn_blocking(move || server.kill_9());
        killed.await.expect("kill");
        stop.store(true, Ordering::Relaxed);
        let calls = tokio::time::timeout(PHASE_BOUND, load)
            .await
            .expect("the callers stop once the server is gone")
            .expect("the load task");
        let answered = calls.iter().filter(|c| c.done_at.is_some()).count();
        eprintln!(
            "round {round}: {} calls, {answered} answered in full before the kill",
            calls.len()
        );
        assert!(
            answered > 0,
            "round {round}: no call was answered before the kill"
        );
        let calls_len = calls.len();
        all.extend(calls);

        server = start(&config_path, data.path());
        let ctx = format!("after kill {round}");

        // 1. Every whole answer of this round followed by a forwarded call
        //    is kept (earlier rounds' were checked after their own kill).
        let round_calls = &all[all.len() - calls_len..];
        let forwarded_after = |t: Instant| {
            round_calls
                .iter()
                .any(|b| b.sent_at > t && b.status == Some(200))
        };
        let mut kept = 0;
        for a in round_calls
            .iter()
            .filter(|a| !a.stream && a.status == Some(200))
        {
            let (Some(done), Some(tokens)) = (a.done_at, a.tokens) else {
                continue;
            };
            if forwarded_after(done) {
                kept += 1;
                let scope = format!("tenant:acme/task:{}", a.task);
                assert_eq!(
                    used(&server, &scope).await,
                    tokens,
                    "{ctx}: the whole answer of {} was followed by a forwarded call, \
                     but its settle was lost",
                    a.task
                );
            }
        }
        eprintln!("round {round}: {kept} whole answers followed by a forwarded call, all kept");
        assert!(
            kept > 0,
            "{ctx}: no whole answer was followed by a forwarded call"
        );

        // 2. Once the cut-off calls expired: the tenant, its user, the
        //    usage log and this round's calls' own scopes agree, and
        //    nothing ended twice.
        wait_nothing_held(&server).await;
        let tenant = used(&server, "tenant:acme").await;
        let user = used(&server, "tenant:acme/user:bob").await;
        let (endings, charged) = endings(&server).await;
        assert_eq!(tenant, user, "{ctx}: the tenant and the user differ");
        assert_eq!(
            tenant, charged,
            "{ctx}: the tenant's used tokens are not what the usage log charged"
        );
        let mut round_tasks = 0;
        for c in round_calls {
            round_tasks += used(&server, &format!("tenant:acme/task:{}", c.task)).await;
        }
        assert_eq!(
            tenant - tenant_before,
            round_tasks,
            "{ctx}: the tenant's growth this round is not the sum of the round's calls"
        );
        tenant_before = tenant;
        for (id, kinds) in endings {
            let ok = matches!(
                kinds
                    .iter()
                    .map(String::as_str)
                    .collect::<Vec<_>>()
                    .as_slice(),
                ["settled"] | ["refunded"] | ["expired"] | ["expired", "settled"]
            );
            assert!(ok, "{ctx}: reservation {id} ended as {kinds:?}");
        }
    }
    drop(server);
}
