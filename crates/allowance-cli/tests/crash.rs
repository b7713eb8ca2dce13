//! kill -9 crash tests for the durable embedded store (issue 4, SEMANTICS.md
//! "Store failure"): whatever the server acknowledged before it was killed
//! is in the ledger after a restart on the same data directory — exactly,
//! in one state, never twice — and the only uncertainty is the requests
//! that were in flight. Also: one process per data directory, a graceful
//! restart keeps reservations and admin changes, and `--data-dir ""` keeps
//! nothing.
//!
//! `ALLOWANCE_CRASH_ROUNDS` (default 5) sets the kill/restart cycles of the
//! first test, `ALLOWANCE_CRASH_SEED` replays its random choices (the
//! interleaving of requests and the instant of the kill still vary).
mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use reqwest::Method;
use serde_json::{Value, json};
use tokio::task::JoinSet;

/// Budgets far beyond what the load can spend, so nothing is ever denied:
/// every answer is a grant, a settle or a refund whose effect the test can
/// add up. Several tenants put several shards in one log; the shared
/// `tool:search` makes some operations lock two shards. The TTL outlives
/// the test, restarts included, so no hold expires under the checks.
/// `fsync = "always"` (the default, written out): an answer means on disk.
const CRASH_CONFIG: &str = r#"
[store]
fsync = "always"
[reservations]
default_ttl_ms = 3_600_000
max_ttl_ms = 3_600_000
[kinds.tenant]
plan = "metered"
[kinds.tool]
shared = true
plan = "metered"
[kinds.user]
plan = "open"
[plans.metered]
limits = [
  { dimension = "tokens", capacity = 1_000_000_000_000, window = "total" },
  { dimension = "concurrent", capacity = 1_000_000 },
]
[plans.open]
limits = []
"#;

/// The tenants the load spreads over.
const TENANTS: [&str; 4] = ["acme", "beta", "gamma", "delta"];
/// The shared scope half of the reservations add.
const TOOL: &str = "tool:search";
/// Concurrent clients during the load.
const WORKERS: u64 = 32;
/// The largest estimate; an actual goes up to 1.5× it (charge_actual
/// records all of it).
const MAX_ESTIMATE: u64 = 10_000;
/// Matches `max_ttl_ms` of [`CRASH_CONFIG`].
const TTL_MS: u64 = 3_600_000;
/// Requests sent at once by the checks: a sequential pass over a few
/// thousand reservations would dominate the test's time.
const CHECK_CONCURRENCY: usize = 16;
/// Bound on one phase (draining the load, a pass of checks): a hang fails
/// the test, a slow machine does not.
const PHASE_BOUND: Duration = Duration::from_secs(120);
/// Bound on one request: after it, the outcome is unknown (like a 503).
const REQUEST_BOUND: Duration = Duration::from_secs(30);
/// Older ended reservations re-read after each restart (all of the
/// current round's and all held ones always are): keeps a long local run
/// (`ALLOWANCE_CRASH_ROUNDS=50`) linear in the rounds.
const OLD_SAMPLE: usize = 64;

/// SplitMix64: a seeded generator in a few lines, so a failing run's
/// choices can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// In `0..n` (`n > 0`); the modulo bias is irrelevant here.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// An independent generator for a worker.
    fn fork(&mut self) -> Rng {
        Rng(self.next())
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not a whole number")),
    )
}

/// A client with a bound on every request, for one server.
#[derive(Clone)]
struct Api {
    client: reqwest::Client,
    base: String,
}

impl Api {
    fn of(s: &Server) -> Api {
        Api {
            client: reqwest::Client::builder()
                .timeout(REQUEST_BOUND)
                .build()
                .expect("client"),
            base: s.base.clone(),
        }
    }

    /// Status and JSON body, or the transport error (no answer).
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Reply, String> {
        let mut req = self.client.request(method, format!("{}{path}", self.base));
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = req.send().await.map_err(|e| format!("{e:?}"))?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let text = resp.text().await.map_err(|e| format!("{e:?}"))?;
        let json = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok(Reply {
            status,
            headers,
            json,
        })
    }

    /// As [`Api::call`] where the server is up and must answer.
    async fn must(&self, method: Method, path: &str, body: Option<&Value>) -> Reply {
        let what = format!("{method} {path}");
        self.call(method, path, body)
            .await
            .unwrap_or_else(|e| panic!("{what}: no answer from a running server: {e}"))
    }

    /// Many requests, [`CHECK_CONCURRENCY`] at a time; answers in order.
    async fn many(&self, requests: Vec<(Method, String, Option<Value>)>) -> Vec<Reply> {
        let gate = Arc::new(tokio::sync::Semaphore::new(CHECK_CONCURRENCY));
        let mut set = JoinSet::new();
        let n = requests.len();
        for (i, (method, path, body)) in requests.into_iter().enumerate() {
            let api = self.clone();
            let gate = gate.clone();
            set.spawn(async move {
                let _permit = gate.acquire_owned().await.expect("semaphore");
                (i, api.must(method, &path, body.as_ref()).await)
            });
        }
        let joined = tokio::time::timeout(PHASE_BOUND, set.join_all())
            .await
            .expect("a pass of checks hung");
        let mut out: Vec<Option<Reply>> = vec![None; n];
        for (i, r) in joined {
            out[i] = Some(r);
        }
        out.into_iter().map(|r| r.expect("every answer")).collect()
    }
}

/// What the test knows about one reservation's state.
#[derive(Clone, Debug, PartialEq)]
enum State {
    /// Reserve sent, no answer: it may or may not exist (no id known).
    ReserveUnknown,
    /// Acknowledged reserve (or found again by its idempotency key), and
    /// no settle or refund sent.
    Held,
    /// Settle with this actual sent, no answer.
    SettleUnknown(u64),
    /// Refund sent, no answer.
    RefundUnknown,
    /// Settle acknowledged with these charged tokens.
    Settled(u64),
    /// Refund acknowledged.
    Refunded,
}

/// One reservation the load made, and what its answers said.
#[derive(Clone, Debug)]
struct Rsv {
    /// Its idempotency key: how an unanswered reserve is found again.
    key: String,
    tenant: &'static str,
    /// Whether it also counts against [`TOOL`].
    tool: bool,
    estimate: u64,
    id: Option<String>,
    state: State,
    /// The acknowledged settle or refund answer: a repeat must equal it.
    ended: Option<Value>,
    /// Changed since the last restart: read back in full after the next.
    fresh: bool,
}

impl Rsv {
    fn reserve_body(&self) -> Value {
        let mut body = json!({"tenant": self.tenant, "amounts": {"tokens": self.estimate},
                              "ttl_ms": TTL_MS, "idempotency_key": self.key});
        if self.tool {
            body["scopes"] = json!({"tool": "search"});
        }
        body
    }

    fn counts_on(&self, scope: &str) -> bool {
        scope.strip_prefix("tenant:") == Some(self.tenant) || (self.tool && scope == TOOL)
    }

    fn id(&self) -> &str {
        self.id.as_deref().expect("a known id")
    }

    fn path(&self, action: &str) -> String {
        match action {
            "" => format!("/v1/reservations/{}", self.id()),
            _ => format!("/v1/reservations/{}/{action}", self.id()),
        }
    }
}

fn settle_body(actual: u64) -> Value {
    json!({"usage": {"tokens": actual}})
}

/// The charged tokens of a settled reservation (absent when zero).
fn charged_tokens(body: &Value) -> u64 {
    body["charged"]["tokens"].as_u64().unwrap_or(0)
}

fn scopes() -> Vec<String> {
    let mut all: Vec<String> = TENANTS.iter().map(|t| format!("tenant:{t}")).collect();
    all.push(TOOL.to_string());
    all
}

/// What one scope's status may show, given what the test knows.
#[derive(Debug, Default)]
struct Expected {
    used_lo: u64,
    used_hi: u64,
    held_lo: u64,
    held_hi: u64,
    count_lo: u64,
    count_hi: u64,
}

impl Expected {
    /// An acknowledged change is certain; an unanswered one may or may not
    /// have landed, so it widens the range by what it could have done.
    fn of(ledger: &[Rsv], scope: &str) -> Expected {
        let mut e = Expected::default();
        for r in ledger.iter().filter(|r| r.counts_on(scope)) {
            match r.state {
                State::Held => {
                    e.held_lo += r.estimate;
                    e.held_hi += r.estimate;
                    e.count_lo += 1;
                    e.count_hi += 1;
                }
                State::SettleUnknown(actual) => {
                    e.used_hi += actual;
                    e.held_hi += r.estimate;
                    e.count_hi += 1;
                }
                State::ReserveUnknown | State::RefundUnknown => {
                    e.held_hi += r.estimate;
                    e.count_hi += 1;
                }
                State::Settled(charged) => {
                    e.used_lo += charged;
                    e.used_hi += charged;
                }
                State::Refunded => {}
            }
        }
        e
    }
}

/// Every scope's status against what the ledger allows; exact once no
/// state is unknown.
async fn check_scopes(api: &Api, ledger: &[Rsv], ctx: &str) {
    for scope in scopes() {
        let st = api
            .must(Method::GET, &format!("/v1/scopes/{scope}"), None)
            .await;
        assert_eq!(st.status, 200, "{ctx}: status of {scope}: {}", st.json);
        let limit = |dimension: &str| {
            st.json["limits"]
                .as_array()
                .and_then(|ls| ls.iter().find(|l| l["dimension"] == dimension))
                .cloned()
                .unwrap_or_else(|| panic!("{ctx}: {scope} has no {dimension} limit: {}", st.json))
        };
        let number = |v: &Value, what: &str| {
            v.as_u64()
                .unwrap_or_else(|| panic!("{ctx}: {scope}: {what} is {v}: {}", st.json))
        };
        let tokens = limit("tokens");
        let used = number(&tokens["used"], "tokens used");
        let held = number(&tokens["held"], "tokens held");
        let count = number(&st.json["held_reservations"], "held_reservations");
        let gauge = number(&limit("concurrent")["held"], "concurrent held");
        let e = Expected::of(ledger, &scope);
        assert!(
            (e.used_lo..=e.used_hi).contains(&used),
            "{ctx}: {scope} has used {used} tokens; the acknowledged settles add up to {}, \
             and the unanswered ones could add at most {} more\n{}",
            e.used_lo,
            e.used_hi - e.used_lo,
            st.json
        );
        assert!(
            (e.held_lo..=e.held_hi).contains(&held),
            "{ctx}: {scope} holds {held} tokens; the acknowledged holds add up to {}, \
             and the unanswered requests could leave at most {} more\n{}",
            e.held_lo,
            e.held_hi - e.held_lo,
            st.json
        );
        assert!(
            (e.count_lo..=e.count_hi).contains(&count),
            "{ctx}: {scope} has {count} held reservations, expected {}..={}\n{}",
            e.count_lo,
            e.count_hi,
            st.json
        );
        assert_eq!(
            gauge, count,
            "{ctx}: {scope}: the concurrency gauge counts every held reservation\n{}",
            st.json
        );
    }
}

/// One client of the load: reserve → settle (65%), reserve → refund
/// (25%), or reserve and keep it held (10%), until `stop` or a request
/// gets no answer. Returns what it made and any answer no correct server
/// gives (a denial, a wrong body).
async fn load_worker(
    api: Api,
    stop: Arc<AtomicBool>,
    mut rng: Rng,
    tag: String,
) -> (Vec<Rsv>, Vec<String>) {
    let mut made = Vec::new();
    let mut odd = Vec::new();
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let mut r = Rsv {
            key: format!("{tag}-{i}"),
            tenant: TENANTS[rng.below(TENANTS.len() as u64) as usize],
            tool: rng.below(2) == 0,
            estimate: 1 + rng.below(MAX_ESTIMATE),
            id: None,
            state: State::ReserveUnknown,
            ended: None,
            fresh: true,
        };
        i += 1;
        match api
            .call(Method::POST, "/v1/reservations", Some(&r.reserve_body()))
            .await
        {
            Ok(a) if a.status == 201 && a.json["id"].is_string() && a.json["status"] == "held" => {
                r.id = a.json["id"].as_str().map(str::to_string);
                r.state = State::Held;
                r.fresh = true;
            }
            // 503 means the outcome is unknown (SEMANTICS.md, answer 17).
            Ok(a) if a.status == 503 => {
                made.push(r);
                continue;
            }
            // No answer: the server is gone (the kill). Stop, or this client
            // would count hundreds of refused connections as in flight.
            Err(_) => {
                made.push(r);
                break;
            }
            Ok(a) => {
                odd.push(format!("reserve {}: {} {}", r.key, a.status, a.json));
                continue;
            }
        }
        let roll = rng.below(100);
        if roll < 65 {
            let actual = rng.below(r.estimate * 3 / 2 + 1);
            r.state = State::SettleUnknown(actual);
            match api
                .call(Method::POST, &r.path("settle"), Some(&settle_body(actual)))
                .await
            {
                Ok(a)
                    if a.status == 200
                        && a.json["status"] == "settled"
                        && charged_tokens(&a.json) == actual =>
                {
                    r.state = State::Settled(actual);
                    r.ended = Some(a.json);
                }
                Ok(a) if a.status == 503 => {}
                Err(_) => {
                    made.push(r);
                    break;
                }
                Ok(a) => odd.push(format!(
                    "settle {} ({actual}): {} {}",
                    r.id(),
                    a.status,
                    a.json
                )),
            }
        } else if roll < 90 {
            r.state = State::RefundUnknown;
            match api
                .call(Method::POST, &r.path("refund"), Some(&json!({})))
                .await
            {
                Ok(a) if a.status == 200 && a.json["status"] == "refunded" => {
                    r.state = State::Refunded;
                    r.ended = Some(a.json);
                }
                Ok(a) if a.status == 503 => {}
                Err(_) => {
                    made.push(r);
                    break;
                }
                Ok(a) => odd.push(format!("refund {}: {} {}", r.id(), a.status, a.json)),
            }
        }
        made.push(r);
    }
    (made, odd)
}

/// After a restart, the reservations the test knows by id are read back:
/// every one changed since the last restart, every held one, and a sample
/// of older ended ones (or all with `everything`). Each must exist and be
/// in the one state the answers allow.
async fn reread(api: &Api, ledger: &[Rsv], everything: bool, rng: &mut Rng, ctx: &str) {
    let mut picked: Vec<usize> = Vec::new();
    let mut older: Vec<usize> = Vec::new();
    for (i, r) in ledger.iter().enumerate() {
        if r.id.is_none() {
            continue;
        }
        if everything || r.fresh || r.state == State::Held {
            picked.push(i);
        } else {
            older.push(i);
        }
    }
    for _ in 0..OLD_SAMPLE.min(older.len()) {
        let k = rng.below(older.len() as u64) as usize;
        picked.push(older.swap_remove(k));
    }
    let requests = picked
        .iter()
        .map(|&i| (Method::GET, ledger[i].path(""), None))
        .collect();
    let answers = api.many(requests).await;
    for (&i, a) in picked.iter().zip(answers) {
        let r = &ledger[i];
        assert_eq!(
            a.status,
            200,
            "{ctx}: reservation {} (reserve acknowledged, then {:?}) is gone after the restart: {}",
            r.id(),
            r.state,
            a.json
        );
        let status = a.json["status"].as_str().unwrap_or("");
        let ok = match r.state {
            State::Held => status == "held",
            State::Settled(charged) => status == "settled" && charged_tokens(&a.json) == charged,
            State::Refunded => status == "refunded",
            State::SettleUnknown(actual) => {
                status == "held" || (status == "settled" && charged_tokens(&a.json) == actual)
            }
            State::RefundUnknown => status == "held" || status == "refunded",
            State::ReserveUnknown => unreachable!("no id"),
        };
        assert!(
            ok,
            "{ctx}: reservation {} should be {:?} (what its answers said) but reads {status}: {}",
            r.id(),
            r.state,
            a.json
        );
        if let Some(ended) = &r.ended {
            assert_eq!(
                &a.json,
                ended,
                "{ctx}: reservation {} reads differently from its acknowledged {status} answer",
                r.id()
            );
        }
    }
}

/// What a client does after a 503 or a lost connection (SEMANTICS.md,
/// answer 17): a reserve again with its idempotency key, a settle or
/// refund again as it was. Afterwards every state is known.
async fn resolve(api: &Api, ledger: &mut [Rsv], ctx: &str) {
    for r in ledger.iter_mut() {
        match r.state {
            State::ReserveUnknown => {
                let a = api
                    .must(Method::POST, "/v1/reservations", Some(&r.reserve_body()))
                    .await;
                // 200 + replayed: it had landed; 201: it had not, and now has.
                let replayed = a.status == 200 && a.json["replayed"] == true;
                assert!(
                    (replayed || a.status == 201) && a.json["status"] == "held",
                    "{ctx}: reserve {} sent again with its idempotency key: {} {}",
                    r.key,
                    a.status,
                    a.json
                );
                r.id = a.json["id"].as_str().map(str::to_string);
                r.state = State::Held;
                r.fresh = true;
            }
            State::SettleUnknown(actual) => {
                let a = api
                    .must(Method::POST, &r.path("settle"), Some(&settle_body(actual)))
                    .await;
                assert!(
                    a.status == 200
                        && a.json["status"] == "settled"
                        && charged_tokens(&a.json) == actual,
                    "{ctx}: settle {} ({actual}) sent again: {} {}",
                    r.id(),
                    a.status,
                    a.json
                );
                r.state = State::Settled(actual);
                r.ended = Some(a.json);
                r.fresh = true;
            }
            State::RefundUnknown => {
                let a = api
                    .must(Method::POST, &r.path("refund"), Some(&json!({})))
                    .await;
                assert!(
                    a.status == 200 && a.json["status"] == "refunded",
                    "{ctx}: refund {} sent again: {} {}",
                    r.id(),
                    a.status,
                    a.json
                );
                r.state = State::Refunded;
                r.ended = Some(a.json);
                r.fresh = true;
            }
            State::Held | State::Settled(_) | State::Refunded => {}
        }
    }
}

/// The reservations ended since the last restart, after it: a repeat of
/// the acknowledged settle or refund answers exactly the same, and the
/// other ending is a conflict (one state, never two).
async fn repeat_endings(api: &Api, ledger: &[Rsv], ctx: &str) {
    let ended: Vec<&Rsv> = ledger
        .iter()
        .filter(|r| r.fresh && r.ended.is_some())
        .collect();
    let mut requests = Vec::new();
    for r in &ended {
        let (same, other) = match r.state {
            State::Settled(actual) => (
                (Method::POST, r.path("settle"), Some(settle_body(actual))),
                (Method::POST, r.path("refund"), Some(json!({}))),
            ),
            State::Refunded => (
                (Method::POST, r.path("refund"), Some(json!({}))),
                (Method::POST, r.path("settle"), Some(settle_body(1))),
            ),
            _ => unreachable!("an ended answer only for an ended state"),
        };
        requests.push(same);
        requests.push(other);
    }
    let answers = api.many(requests).await;
    for (r, pair) in ended.iter().zip(answers.chunks(2)) {
        let (same, other) = (&pair[0], &pair[1]);
        assert_eq!(
            (same.status, Some(&same.json)),
            (200, r.ended.as_ref()),
            "{ctx}: {} repeated after the restart answers differently",
            r.id()
        );
        assert_eq!(
            other.status,
            409,
            "{ctx}: {} is {:?}; the other ending must be a conflict: {}",
            r.id(),
            r.state,
            other.json
        );
    }
}

/// Settles or refunds held reservations: about half of them, or all.
async fn end_held(api: &Api, ledger: &mut [Rsv], all: bool, rng: &mut Rng, ctx: &str) {
    let mut chosen = Vec::new();
    let mut requests = Vec::new();
    for (i, r) in ledger.iter().enumerate() {
        if r.state != State::Held || (!all && rng.below(2) == 0) {
            continue;
        }
        if rng.below(4) == 0 {
            requests.push((Method::POST, r.path("refund"), Some(json!({}))));
            chosen.push((i, None));
        } else {
            let actual = rng.below(r.estimate * 3 / 2 + 1);
            requests.push((Method::POST, r.path("settle"), Some(settle_body(actual))));
            chosen.push((i, Some(actual)));
        }
    }
    let answers = api.many(requests).await;
    for ((i, actual), a) in chosen.into_iter().zip(answers) {
        let r = &mut ledger[i];
        let (want, state) = match actual {
            Some(actual) => ("settled", State::Settled(actual)),
            None => ("refunded", State::Refunded),
        };
        assert!(
            a.status == 200
                && a.json["status"] == want
                && actual.is_none_or(|actual| charged_tokens(&a.json) == actual),
            "{ctx}: ending {} (held since before a restart) as {want}: {} {}",
            r.id(),
            a.status,
            a.json
        );
        r.state = state;
        r.ended = Some(a.json);
        r.fresh = true;
    }
}

/// Runs the load on `server` for `load_ms`, then kills it with SIGKILL in
/// the middle of it. Returns what the load made.
async fn load_then_kill(
    server: Server,
    load_ms: u64,
    round: u64,
    seed: u64,
    rng: &mut Rng,
) -> Vec<Rsv> {
    let api = Api::of(&server);
    let stop = Arc::new(AtomicBool::new(false));
    let mut set = JoinSet::new();
    for w in 0..WORKERS {
        set.spawn(load_worker(
            api.clone(),
            stop.clone(),
            rng.fork(),
            format!("crash-{seed}-{round}-{w}"),
        ));
    }
    tokio::time::sleep(Duration::from_millis(load_ms)).await;
    let status = server.kill_9();
    stop.store(true, Ordering::Relaxed);
    assert!(!status.success(), "SIGKILL: {status:?}");
    let results = tokio::time::timeout(PHASE_BOUND, set.join_all())
        .await
        .expect("the load did not end after the kill");
    let mut made = Vec::new();
    let mut odd = Vec::new();
    for (m, o) in results {
        made.extend(m);
        odd.extend(o);
    }
    assert!(
        odd.is_empty(),
        "seed {seed} round {round}: answers no server should give under this load:\n{}",
        odd.join("\n")
    );
    made
}

fn tally(made: &[Rsv]) -> String {
    let count = |f: fn(&State) -> bool| made.iter().filter(|r| f(&r.state)).count();
    format!(
        "{} reserves: {} settled, {} refunded, {} held; unanswered: {} reserves, {} settles, {} refunds",
        made.len(),
        count(|s| matches!(s, State::Settled(_))),
        count(|s| *s == State::Refunded),
        count(|s| *s == State::Held),
        count(|s| *s == State::ReserveUnknown),
        count(|s| matches!(s, State::SettleUnknown(_))),
        count(|s| *s == State::RefundUnknown),
    )
}

/// Concurrent reserve → settle / refund / keep, SIGKILL in the middle,
/// restart on the same data dir, check, resolve, repeat: the acknowledged
/// ledger accumulates over the rounds and is never lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_settles_survive_kill_9() {
    let rounds = env_u64("ALLOWANCE_CRASH_ROUNDS").unwrap_or(5);
    let seed = env_u64("ALLOWANCE_CRASH_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    eprintln!(
        "crash test: seed {seed}, {rounds} rounds (ALLOWANCE_CRASH_SEED={seed} replays the choices)"
    );
    let mut rng = Rng(seed);
    let data = tempfile::tempdir().expect("data dir");
    let (_config_dir, config) = config_file(CRASH_CONFIG);

    let mut ledger: Vec<Rsv> = Vec::new();
    let mut server = Server::on_data_dir(&config, data.path());
    for round in 0..rounds {
        let ctx = format!("seed {seed} round {round}");
        let load_ms = 50 + rng.below(351);
        let made = load_then_kill(server, load_ms, round, seed, &mut rng).await;
        eprintln!("{ctx}: killed after {load_ms} ms: {}", tally(&made));
        ledger.extend(made);

        server = Server::on_data_dir(&config, data.path());
        let api = Api::of(&server);
        reread(&api, &ledger, false, &mut rng, &ctx).await;
        check_scopes(&api, &ledger, &format!("{ctx}, after the restart")).await;
        repeat_endings(&api, &ledger, &ctx).await;
        for r in &mut ledger {
            r.fresh = false;
        }
        resolve(&api, &mut ledger, &ctx).await;
        check_scopes(
            &api,
            &ledger,
            &format!("{ctx}, unanswered requests resolved"),
        )
        .await;
        end_held(&api, &mut ledger, round + 1 == rounds, &mut rng, &ctx).await;
        check_scopes(&api, &ledger, &format!("{ctx}, held ones ended")).await;
    }

    // Everything has ended: one more crash with nothing in flight.
    let ctx = format!("seed {seed}, final restart");
    assert!(ledger.iter().all(|r| r.state != State::Held));
    server.kill_9();
    let server = Server::on_data_dir(&config, data.path());
    let api = Api::of(&server);
    reread(&api, &ledger, true, &mut rng, &ctx).await;
    check_scopes(&api, &ledger, &ctx).await;
    repeat_endings(&api, &ledger, &ctx).await;
    eprintln!(
        "{ctx}: {} reservations in the ledger, all accounted for",
        ledger.len()
    );
}

/// Two processes appending to one log would interleave and corrupt it: a
/// second `serve` on a data dir in use exits non-zero, naming the
/// directory, and the first is unharmed.
#[tokio::test]
async fn second_process_on_same_data_dir_is_refused() {
    let data = tempfile::tempdir().expect("data dir");
    let (_config_dir, config) = config_file(CRASH_CONFIG);
    let first = Server::on_data_dir(&config, data.path());
    let api = Api::of(&first);
    let settled = reserve_and_settle(&api, "acme", 40, 30).await;

    let dir = data.path().to_string_lossy().to_string();
    let second = serve_until_exit(
        &[
            "--listen",
            "127.0.0.1:0",
            "--config",
            &config.to_string_lossy(),
            "--data-dir",
            &dir,
        ],
        Duration::from_secs(60),
    );
    match second {
        Startup::Exited { status, stderr } => {
            assert!(!status.success(), "the second server exited 0:\n{stderr}");
            let lower = stderr.to_lowercase();
            assert!(
                lower.contains("in use") || lower.contains("locked"),
                "the error should say the data dir is in use or locked:\n{stderr}"
            );
            let canonical = std::fs::canonicalize(data.path())
                .map(|p| p.to_string_lossy().to_string())
                .unwrap_or_else(|_| dir.clone());
            assert!(
                stderr.contains(&dir) || stderr.contains(&canonical),
                "the error should name the data dir {dir}:\n{stderr}"
            );
        }
        Startup::Listening { stderr } => {
            panic!("a second server started serving on {dir} while the first holds it:\n{stderr}")
        }
        Startup::Hung { stderr } => {
            panic!("a second server on {dir} neither exited nor served:\n{stderr}")
        }
    }

    // The first keeps serving, and what it wrote is intact.
    let again = api.must(Method::GET, &settled.path(""), None).await;
    assert_eq!(Some(&again.json), settled.ended.as_ref());
    let later = reserve_and_settle(&api, "acme", 20, 10).await;
    first.kill_9();
    let third = Server::on_data_dir(&config, data.path());
    let api = Api::of(&third);
    for r in [&settled, &later] {
        let a = api.must(Method::GET, &r.path(""), None).await;
        assert_eq!(
            (a.status, Some(&a.json)),
            (200, r.ended.as_ref()),
            "{} after the first server was killed and a third started",
            r.id()
        );
    }
}

/// Reserve `estimate` tokens for `tenant` and settle `actual`; returns
/// the reservation with its settle answer.
async fn reserve_and_settle(api: &Api, tenant: &'static str, estimate: u64, actual: u64) -> Rsv {
    let mut r = Rsv {
        key: format!("{tenant}-{estimate}-{actual}"),
        tenant,
        tool: false,
        estimate,
        id: None,
        state: State::Held,
        ended: None,
        fresh: true,
    };
    let a = api
        .must(Method::POST, "/v1/reservations", Some(&r.reserve_body()))
        .await
        .expect(201);
    r.id = a.json["id"].as_str().map(str::to_string);
    let s = api
        .must(Method::POST, &r.path("settle"), Some(&settle_body(actual)))
        .await
        .expect(200);
    r.state = State::Settled(actual);
    r.ended = Some(s.json);
    r
}

/// The picture of the ledger compared across a restart: every
/// reservation, the plans, and the scopes (the windows are `total` and
/// `concurrent`: nothing in them moves with the clock).
async fn picture(api: &Api, ids: &[String], scopes: &[&str]) -> Vec<(String, Value)> {
    let mut paths: Vec<String> = ids
        .iter()
        .map(|id| format!("/v1/reservations/{id}"))
        .collect();
    paths.push("/v1/plans".to_string());
    paths.extend(scopes.iter().map(|s| format!("/v1/scopes/{s}")));
    let mut out = Vec::new();
    for p in paths {
        let a = api.must(Method::GET, &p, None).await;
        out.push((p, json!({"status": a.status, "body": a.json})));
    }
    out
}

/// SIGTERM, restart: reservations in every state, a changed plan, a new
/// plan, a scope moved to it and an admin adjustment are all there.
#[tokio::test]
async fn restart_after_graceful_shutdown_keeps_state() {
    let data = tempfile::tempdir().expect("data dir");
    let (_config_dir, config) = config_file(CRASH_CONFIG);
    let s = Server::on_data_dir(&config, data.path());
    let api = Api::of(&s);
    let reserve = |body: Value| {
        let api = api.clone();
        async move {
            let a = api
                .must(Method::POST, "/v1/reservations", Some(&body))
                .await
                .expect(201);
            a.json["id"].as_str().expect("id").to_string()
        }
    };
    let mut ids = Vec::new();
    for (i, tokens) in [100u64, 200, 300, 400].into_iter().enumerate() {
        let id = reserve(json!({"tenant": "acme", "scopes": {"user": "bob"},
                                "amounts": {"tokens": tokens}, "idempotency_key": format!("k{i}")}))
        .await;
        ids.push(id);
    }
    api.must(
        Method::POST,
        &format!("/v1/reservations/{}/settle", ids[0]),
        Some(&settle_body(90)),
    )
    .await
    .expect(200);
    api.must(
        Method::POST,
        &format!("/v1/reservations/{}/settle", ids[1]),
        Some(&settle_body(250)),
    )
    .await
    .expect(200);
    api.must(
        Method::POST,
        &format!("/v1/reservations/{}/refund", ids[2]),
        Some(&json!({})),
    )
    .await
    .expect(200);
    // ids[3] stays held.

    // Admin changes: an existing plan changed, a new plan, a scope moved
    // to it, a debit.
    let metered = json!({"limits": [
        {"dimension": "tokens", "capacity": 5_000_000, "window": "total"},
        {"dimension": "concurrent", "capacity": 7}]});
    api.must(Method::PUT, "/v1/plans/metered", Some(&metered))
        .await
        .expect(200);
    let vip = json!({"limits": [{"dimension": "tokens", "capacity": 1_000, "window": "total"}]});
    api.must(Method::PUT, "/v1/plans/vip", Some(&vip))
        .await
        .expect(200);
    api.must(
        Method::PUT,
        "/v1/scopes/tenant:acme/user:bob",
        Some(&json!({"plan": "vip"})),
    )
    .await
    .expect(200);
    api.must(
        Method::POST,
        "/v1/scopes/tenant:acme/adjust",
        Some(&json!({"dimension": "tokens", "amount": -1_000, "reason": "crash test debit"})),
    )
    .await
    .expect(200);

    let scopes = ["tenant:acme", "tenant:acme/user:bob"];
    let before = picture(&api, &ids, &scopes).await;
    let status = s.terminate();
    assert!(status.success(), "graceful exit: {status:?}");

    let s = Server::on_data_dir(&config, data.path());
    let api = Api::of(&s);
    let after = picture(&api, &ids, &scopes).await;
    for ((path, was), (_, now)) in before.iter().zip(&after) {
        assert_eq!(
            now, was,
            "GET {path} after a graceful restart (left) and before it (right)"
        );
    }
    // The moved scope still answers to its new plan, and the held one can
    // still be settled.
    let d = api
        .must(
            Method::POST,
            "/v1/reservations",
            Some(
                &json!({"tenant": "acme", "scopes": {"user": "bob"}, "amounts": {"tokens": 1_001}}),
            ),
        )
        .await
        .expect(422);
    assert_eq!(d.json["error"]["scope"], "tenant:acme/user:bob");
    let settled = api
        .must(
            Method::POST,
            &format!("/v1/reservations/{}/settle", ids[3]),
            Some(&settle_body(1)),
        )
        .await
        .expect(200);
    assert_eq!(settled.json["status"], "settled");
}

/// Memory only is an explicit opt-out: `data_dir = ""` in the file, or
/// `--data-dir ""` over a file that names a directory. A restart is empty
/// each time, and the file's directory is never created.
#[tokio::test]
async fn memory_only_forgets() {
    let parent = tempfile::tempdir().expect("temp dir");
    let unused = parent.path().join("never-written");
    let (_file_dir, in_file) = config_file(&with_data_dir(CRASH_CONFIG, Path::new("")));
    let (_flag_dir, overridden) = config_file(&with_data_dir(CRASH_CONFIG, &unused));
    let in_file = in_file.to_string_lossy().to_string();
    let overridden = overridden.to_string_lossy().to_string();
    let cases: [(&str, Vec<&str>); 2] = [
        (
            "data_dir = \"\" in the file",
            vec!["--listen", "127.0.0.1:0", "--config", &in_file],
        ),
        (
            "--data-dir \"\" over the file's data_dir",
            vec![
                "--listen",
                "127.0.0.1:0",
                "--config",
                &overridden,
                "--data-dir",
                "",
            ],
        ),
    ];
    for (case, args) in cases {
        let s = Server::serve_args(&args);
        let api = Api::of(&s);
        let r = reserve_and_settle(&api, "acme", 500, 400).await;
        let used = api
            .must(Method::GET, "/v1/scopes/tenant:acme", None)
            .await
            .expect(200);
        assert_eq!(used.json["limits"][0]["used"], 400, "{case}");
        assert!(s.terminate().success(), "{case}: graceful exit");

        let s = Server::serve_args(&args);
        let api = Api::of(&s);
        let gone = api.must(Method::GET, &r.path(""), None).await;
        assert_eq!(gone.status, 404, "{case}: {}", gone.json);
        let fresh = api
            .must(Method::GET, "/v1/scopes/tenant:acme", None)
            .await
            .expect(200);
        assert_eq!(fresh.json["limits"][0]["used"], 0, "{case}");
        assert!(
            !unused.exists(),
            "{case}: memory only, yet the file's data dir {} was created",
            unused.display()
        );
    }
}

/// `toml` with its `[store]` table's `data_dir` set to `dir` ("" for
/// memory only).
fn with_data_dir(toml: &str, dir: &Path) -> String {
    toml.replacen(
        "[store]\n",
        &format!("[store]\ndata_dir = \"{}\"\n", dir.display()),
        1,
    )
}
