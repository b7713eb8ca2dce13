//! A long stream is not tokenized before its call: it is held on the bound
//! of its byte length, the call starts, the exact count is made meanwhile,
//! and the holds are swapped for exact ones. These tests check the swap's
//! records and amounts, that a bound which does not fit never refuses a
//! call that does (it is counted first), that a refusal names the true
//! size, and that whole answers are still counted first.
//!
//! Every prompt carries a nonce: the token-count cache (process-wide, and
//! the gateway runs in this process) must not know it, or the estimate is
//! exact at once and no bound is used.

mod common_gateway;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use allowance_stub::BehaviorPatch;
use common_gateway::*;
use serde_json::{Value, json};

/// A prompt of about `words` words that no other call has sent: ~5 bytes
/// and ~1 token a word, so its bound (bytes) is well above its count.
fn long_unique_prompt(words: usize) -> String {
    static NONCE: AtomicU64 = AtomicU64::new(0);
    let n = NONCE.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id();
    let mut s = format!("[{pid}-{n}-{:?}] ", Instant::now());
    for i in 0..words {
        s.push_str(["alpha ", "beta ", "gamma ", "delta "][i % 4]);
    }
    s
}

fn stream_chat(content: &str, max_tokens: u64) -> Value {
    let mut b = chat(content, max_tokens);
    b["stream"] = json!(true);
    b
}

/// A plan's `limits`: `capacity` tokens in all, never refilled.
fn tokens_total(capacity: u64) -> String {
    format!(r#"[{{ dimension = "tokens", capacity = {capacity}, window = "total" }}]"#)
}

fn held_input(rec: &Value) -> u64 {
    amount(rec, "held", "input_tokens")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_stream_starts_on_a_bound_and_then_holds_exactly() {
    let gw = Gw::start(Setup::new("boundswap")).await;
    gw.count_upstream_exactly().await;
    // A slow stream: the swap happens while it runs (the count of ~5K
    // tokens takes milliseconds, a debug build's tens).
    gw.behave(BehaviorPatch {
        output_tokens: Some(20),
        token_delay_ms: Some(150),
        ..Default::default()
    });
    let body = stream_chat(&long_unique_prompt(5_000), 50);
    assert!(serde_json::to_vec(&body).unwrap().len() > 16 * 1024);
    let input = stub_chat_tokens(&body);
    let call = tokio::spawn(read(gw.post("/v1/chat/completions").json(&body)));

    // While it streams: the bound's holds are refunded, exact ones held.
    let started = Instant::now();
    let swapped = loop {
        let refunded: Vec<Value> = gw
            .usage_log()
            .await
            .into_iter()
            .filter(|r| r["kind"] == "refunded")
            .collect();
        if refunded.len() == 2 {
            break refunded;
        }
        assert!(
            !call.is_finished(),
            "the stream ended before its holds were swapped: {:#?}",
            gw.usage_log().await
        );
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no swap after 20 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    for rec in &swapped {
        assert!(
            held_input(rec) > input,
            "the bound is above the count: {rec}"
        );
        assert_eq!(amount(rec, "charged", "input_tokens"), 0, "{rec}");
    }
    assert!(!call.is_finished(), "swapped while streaming");
    assert_eq!(gw.held_reservations("tenant:acme").await, 1);
    assert_eq!(gw.held_reservations(&gw.upstream_scope()).await, 1);
    let (_, held) = gw.limit(BOB, "tokens").await;
    assert!(
        (input + 8..=input + 50).contains(&held),
        "the exact input and the output tranches: held {held}, input {input}"
    );

    let r = call.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(hellos(&chat_content(&sse_events(&r.text))), 20);
    gw.wait_nothing_held().await;

    let callers = gw.caller_records().await;
    let settled: Vec<&Value> = callers.iter().filter(|r| r["kind"] == "settled").collect();
    assert_eq!(callers.len(), 2, "{callers:#?}");
    assert_eq!(settled.len(), 1, "{callers:#?}");
    let rec = settled[0];
    assert_eq!(held_input(rec), input, "{rec}");
    assert_eq!(amount(rec, "charged", "input_tokens"), input, "{rec}");
    assert_eq!(amount(rec, "charged", "output_tokens"), 20, "{rec}");
    assert_eq!(
        amount(rec, "charged", "cost_micros"),
        cost_micros(input, 20, GPT4O_IN_MICROS, GPT4O_OUT_MICROS)
    );
    let attempts = gw.attempt_records().await;
    assert_eq!(attempts.len(), 2, "{attempts:#?}");
    let attempt = attempts
        .iter()
        .find(|r| r["kind"] == "settled")
        .expect("a settled attempt");
    assert_eq!(held_input(attempt), input, "{attempt}");

    // Charged once, exactly, everywhere.
    assert_eq!(gw.limit(BOB, "tokens").await, (input + 20, 0));
    assert_eq!(
        gw.limit(&gw.upstream_scope(), "input_tokens").await,
        (input, 0)
    );
    assert_eq!(
        gw.limit(&gw.upstream_scope(), "requests").await,
        (1, 0),
        "one request upstream, whatever was swapped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_that_does_not_fit_is_counted_first_and_the_call_goes() {
    let prompt = long_unique_prompt(5_000);
    let body = stream_chat(&prompt, 50);
    let input = stub_chat_tokens(&body);
    // Room for the call's true size, not for its bound (~5 bytes a token).
    let mut setup = Setup::new("boundtight");
    setup.user_limits = tokens_total(input + 60);
    let gw = Gw::start(setup).await;
    let r = gw.call("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(hellos(&chat_content(&sse_events(&r.text))), 20);
    gw.wait_nothing_held().await;
    let callers = gw.caller_records().await;
    assert_eq!(callers.len(), 1, "no bound was held: {callers:#?}");
    assert_eq!(callers[0]["kind"], "settled");
    assert_eq!(held_input(&callers[0]), input);
    assert_eq!(gw.limit(BOB, "tokens").await, (input + 20, 0));
    // The bound's refusal is not a denial anyone sees.
    assert_eq!(
        gw.metric("allowance_denials_total", &[])
            .await
            .unwrap_or(0.0),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_stream_that_does_not_fit_is_refused_for_its_true_size() {
    let body = stream_chat(&long_unique_prompt(5_000), 50);
    let input = stub_chat_tokens(&body);
    // A stream holds its input and a first tranche of output (8 here).
    let mut setup = Setup::new("boundrefused");
    setup.user_limits = tokens_total(input + 4);
    let gw = Gw::start(setup).await;
    let r = gw.call("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 422, "more than the whole capacity: {}", r.text);
    let d = &r.json()["error"]["allowance"];
    assert_eq!(d["scope"], BOB, "{}", r.text);
    assert_eq!(d["dimension"], "tokens");
    assert_eq!(d["requested"], input + 8, "the true size: {}", r.text);
    assert_eq!(
        gw.metric("allowance_denials_total", &[("type", "exceeds_limit")])
            .await,
        Some(1.0),
        "counted once"
    );
    assert!(gw.stub.requests().is_empty(), "nothing was sent upstream");
    gw.wait_nothing_held().await;
    assert!(gw.caller_records().await.is_empty());
    // The attempt's place is asked for beside the caller's hold (one store
    // round trip), so a refused call refunds it: never charged.
    for rec in gw.attempt_records().await {
        assert_eq!(rec["kind"], "refunded", "{rec}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_whole_call_is_counted_before_it_is_held() {
    let gw = Gw::start(Setup::new("boundwhole")).await;
    let body = chat(&long_unique_prompt(5_000), 50);
    let input = stub_chat_tokens(&body);
    let r = gw.call("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    gw.wait_nothing_held().await;
    let callers = gw.caller_records().await;
    assert_eq!(callers.len(), 1, "{callers:#?}");
    assert_eq!(callers[0]["kind"], "settled");
    assert_eq!(held_input(&callers[0]), input);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_stream_broken_off_at_once_is_charged_its_exact_count() {
    // No usage comes: the gateway charges its own estimate of the input,
    // which must be the count, not the bound, however early the end.
    let gw = Gw::start(Setup::new("boundbroke")).await;
    gw.stub
        .enqueue([allowance_stub::Scripted::cut_after_tokens(1)])
        .unwrap();
    let body = stream_chat(&long_unique_prompt(5_000), 50);
    let input = stub_chat_tokens(&body);
    let _ = try_read(gw.post("/v1/chat/completions").json(&body)).await;
    gw.wait_nothing_held().await;
    let callers = gw.caller_records().await;
    let settled: Vec<&Value> = callers.iter().filter(|r| r["kind"] == "settled").collect();
    assert_eq!(settled.len(), 1, "{callers:#?}");
    assert_eq!(amount(settled[0], "charged", "input_tokens"), input);
    assert_eq!(amount(settled[0], "charged", "output_tokens"), 1);
    assert_eq!(gw.limit(BOB, "tokens").await, (input + 1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_holds_never_become_durable_is_not_passed_on() {
    let _one_at_a_time = DURABLE_FAULTS.lock().await;
    let (gw, faulty, _dir) = durable_gw("undurable").await;

    // On a working disk: held, durable while the call ran, passed on.
    let first = chat("Hello.", 20);
    let r = gw.call("/v1/chat/completions", &first).await;
    assert_eq!(r.status, 200, "{}", r.text);

    // Its settle becomes durable after its answer: a reserve answered
    // (durable) now means everything logged before it is durable too, so
    // the fault below hits the next call's holds, not that settle.
    let r = read(
        gw.client
            .post(gw.url("/v1/reservations"))
            .json(&json!({"tenant": "acme", "amounts": {"requests": 1}})),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text);

    // The log's next fsync fails: the call's holds never become durable,
    // so its answer is not passed on as if counted. (The usage log's own
    // background sync may take a one-off fault first and leave the call
    // alone — it then answers 200 and the fault is set again.)
    let failed = chat("Hello again.", 20);
    let mut tries = 0;
    let r = loop {
        faulty.fail_sync(1);
        let r = gw.call("/v1/chat/completions", &failed).await;
        tries += 1;
        if r.status != 200 || tries == 20 {
            break r;
        }
    };
    assert_eq!(r.status, 503, "{}", r.text);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("could not record") || m.contains("store")),
        "{}",
        r.text
    );
    let passed_on = tries - 1;

    // The store rebuilds from its data dir and serves again.
    faulty.recover();
    let last = chat("Back?", 20);
    let started = Instant::now();
    loop {
        let r = gw.call("/v1/chat/completions", &last).await;
        if r.status == 200 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the store never served again: {} {}",
            r.status,
            r.text
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The failed call was never sent upstream; its reserve was lost with
    // the log, or came back with it (written, not synced) and is held
    // until it expires. Never charged, never counted twice.
    let tokens = |body: &Value| stub_chat_tokens(body) + 20;
    let ok = tokens(&first) + tokens(&last) + passed_on * tokens(&failed);
    let f = tokens(&failed);
    // (The store may fence once more as its usage log's writer meets the
    // disk it failed on: wait until it answers.)
    let started = Instant::now();
    while read(gw.client.get(gw.url(&format!("/v1/scopes/{BOB}"))))
        .await
        .status
        != 200
    {
        assert!(started.elapsed() < Duration::from_secs(20), "no status");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (used, held) = gw.limit(BOB, "tokens").await;
    assert!(
        [(ok, 0), (ok, f)].contains(&(used, held)),
        "used {used}, held {held}: the calls that passed on use {ok}, the failed one {f}"
    );
    assert_eq!(
        gw.stub.requests().len() as u64,
        2 + passed_on,
        "the failed call never reached the provider"
    );
}

/// Taken by the tests that inject a log fault at "the next write/fsync":
/// each assumes which of its store's writes comes next, and the usage
/// log's batched writer (every 5 ms, off the request path) shifts under the
/// load of another such test running beside it.
static DURABLE_FAULTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A gateway on a durable store whose file system can fail on demand.
async fn durable_gw(upstream: &str) -> (Gw, allowance_wal::FaultyFs, tempfile::TempDir) {
    durable_gw_with(Setup::new(upstream)).await
}

/// [`durable_gw`] with a setup of the test's own.
async fn durable_gw_with(setup: Setup) -> (Gw, allowance_wal::FaultyFs, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("a temp dir");
    let faulty = allowance_wal::FaultyFs::new();
    let gw = Gw::start_durable(setup, std::sync::Arc::new(faulty.clone()), dir.path()).await;
    (gw, faulty, dir)
}

/// The caller records once the store answers (it may be rebuilding: 503).
async fn caller_records_when_serving(gw: &Gw) -> Option<Vec<Value>> {
    let r = read(gw.client.get(gw.url("/v1/usage?limit=10000"))).await;
    if r.status != 200 {
        return None;
    }
    Some(
        r.text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str::<Value>(l).expect("a JSON line"))
            .filter(|r| r["tenant"] == "acme")
            .collect(),
    )
}

/// `(used, held)` of `dimension` on `scope` once the store answers.
async fn limit_when_serving(gw: &Gw, scope: &str, dimension: &str) -> Option<(u64, u64)> {
    let r = read(gw.client.get(gw.url(&format!("/v1/scopes/{scope}")))).await;
    if r.status != 200 {
        return None;
    }
    let s = r.json();
    let l = s["limits"]
        .as_array()?
        .iter()
        .find(|l| l["dimension"] == dimension)?
        .clone();
    Some((l["used"].as_u64()?, l["held"].as_u64()?))
}

// A whole answer's settles are applied, the answer passed on, and only then
// made durable. When the log then fails (the process lives on, the store
// rebuilds from its data dir without the settles), the gateway knows the
// settles were lost: it must apply them again once the store serves, as
// the plain settle's retries did before. Otherwise the rebuilt ledger holds
// the call's reservation HELD until it expires, and the call that was
// answered 200 is never charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_answers_settle_lost_with_the_log_is_applied_again() {
    let _one_at_a_time = DURABLE_FAULTS.lock().await;
    let (gw, faulty, _dir) = durable_gw("settlelost").await;
    let body = chat("Hello, durable world.", 20);
    let tokens = stub_chat_tokens(&body) + 20;
    // The provider takes its time: the holds are durable long before it
    // answers, so the next write to the log is the settles'.
    gw.behave(BehaviorPatch {
        first_byte_delay_ms: Some(800),
        ..Default::default()
    });
    let call = tokio::spawn(read(gw.post("/v1/chat/completions").json(&body)));
    let started = Instant::now();
    while gw.held_reservations(BOB).await == 0 {
        assert!(started.elapsed() < Duration::from_secs(5), "never held");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    faulty.fail_write(1);
    let r = call.await.unwrap();
    assert_eq!(
        r.status, 200,
        "answered before the settle is durable: {}",
        r.text
    );

    // The store rebuilds; the settle must come back (never expire unpaid).
    let started = Instant::now();
    loop {
        let now = limit_when_serving(&gw, BOB, "tokens").await;
        if now == Some((tokens, 0)) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the answered call is not charged after the rebuild: (used, held) {now:?}, \
             want ({tokens}, 0); callers {:#?}",
            caller_records_when_serving(&gw).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let started = Instant::now();
    let callers = loop {
        match caller_records_when_serving(&gw).await {
            Some(c) if !c.is_empty() => break c,
            other => {
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "no settle in the usage log: {other:#?}; whole log {:#?}",
                    read(gw.client.get(gw.url("/v1/usage?limit=10000"))).await
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let settled: Vec<&Value> = callers.iter().filter(|r| r["kind"] == "settled").collect();
    assert_eq!(settled.len(), 1, "charged once: {callers:#?}");
}

// A stream whose bound fits but whose swap would not (no room for both
// holds at once) must not run on the bound: its top-ups would compete with
// its own bound and cut it (`insufficient_quota`) though its true size fits
// with room to spare. A dry run beside the bound's reserve sees that, and
// the call is counted first and held exactly instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_left_on_its_bound_is_not_cut_for_the_bound() {
    let body = stream_chat(&long_unique_prompt(5_000), 50);
    let input = stub_chat_tokens(&body);
    let bound = allowance_estimate::estimate_bound(
        allowance_estimate::Api::ChatCompletions,
        &body,
        allowance_estimate::Tokenizer::O200kBase,
    )
    .expect("a valid body");
    assert!(!bound.exact);
    let bound = bound.estimate.input_tokens;
    assert!(bound > 2 * input, "bound {bound}, input {input}");
    // Room for the bound and its first tranche (8) and a little more; not
    // for the exact hold beside it. The call's true size, input + 40,
    // fits many times over.
    let mut setup = Setup::new("boundstays");
    setup.user_limits = tokens_total(bound + 8 + 4);
    let gw = Gw::start(setup).await;
    gw.behave(BehaviorPatch {
        output_tokens: Some(40),
        token_delay_ms: Some(20),
        ..Default::default()
    });
    let r = gw.call("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let events = sse_events(&r.text);
    assert_eq!(
        hellos(&chat_content(&events)),
        40,
        "the whole answer, not cut: {:#?}",
        events.iter().rev().take(3).collect::<Vec<_>>()
    );
    gw.wait_nothing_held().await;
    assert_eq!(gw.limit(BOB, "tokens").await, (input + 40, 0));
}

// On the durable store the swap's new holds wait for an fsync. The events
// flow on meanwhile: the swap used to run in the stream's own task, so
// whenever the exact count was ready before the provider's first bytes,
// the client waited for that fsync too. Here every fsync takes 400 ms (a
// reserve that queues behind another commit still answers within the
// store's 1 s timeout), the count is ready as the stream starts, and the
// provider writes an event every 25 ms: no silence near the fsync's length
// is allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_flows_on_while_its_holds_are_swapped() {
    use futures_util::StreamExt;
    let _one_at_a_time = DURABLE_FAULTS.lock().await;
    // One tranche holds the whole output: a top-up waits for its fsync on
    // the stream's path by design (it must be held before more is
    // relayed), and this test is about the swap alone.
    let mut setup = Setup::new("swapflow");
    setup.tranche_tokens = 100;
    let (gw, faulty, _dir) = durable_gw_with(setup).await;
    gw.count_upstream_exactly().await;
    gw.behave(BehaviorPatch {
        output_tokens: Some(30),
        token_delay_ms: Some(25),
        ..Default::default()
    });
    let body = stream_chat(&long_unique_prompt(5_000), 60);
    let input = stub_chat_tokens(&body);
    let fsync = Duration::from_millis(400);
    faulty.set_sync_delay(fsync);

    let resp = gw
        .post("/v1/chat/completions")
        .json(&body)
        .send()
        .await
        .expect("the call is answered");
    assert_eq!(resp.status(), 200);
    let mut events = resp.bytes_stream();
    let mut text = String::new();
    let mut last = Instant::now();
    let mut longest_silence = Duration::ZERO;
    while let Some(chunk) = events.next().await {
        longest_silence = longest_silence.max(last.elapsed());
        last = Instant::now();
        text.push_str(std::str::from_utf8(&chunk.expect("a chunk")).expect("UTF-8"));
    }
    assert_eq!(hellos(&chat_content(&sse_events(&text))), 30, "{text}");
    assert!(
        longest_silence < fsync * 3 / 4,
        "the stream fell silent for {longest_silence:?} (events every 25 ms, an fsync takes {fsync:?}): \
         the swap's reserve stood between the provider and the client"
    );

    // It was swapped all the same (once its reserve was durable), and the
    // call settled on the exact holds.
    faulty.set_sync_delay(Duration::ZERO);
    gw.wait_nothing_held().await;
    let callers = gw.caller_records().await;
    assert_eq!(
        callers.len(),
        2,
        "the bound's and the exact one: {callers:#?}"
    );
    let refunded = callers
        .iter()
        .find(|r| r["kind"] == "refunded")
        .expect("the bound's hold refunded");
    assert!(held_input(refunded) > input, "{refunded}");
    let settled = callers
        .iter()
        .find(|r| r["kind"] == "settled")
        .expect("the exact hold settled");
    assert_eq!(held_input(settled), input, "{settled}");
    assert_eq!(
        amount(settled, "charged", "input_tokens"),
        input,
        "{settled}"
    );
    assert_eq!(amount(settled, "charged", "output_tokens"), 30, "{settled}");
}

// A call's own hold and its place upstream are reserved together and must
// be durable before anything goes upstream: they share one group commit.
// Awaited one by one, the second record could miss the first's batch (the
// log's writer, woken by the first append, took it alone) and wait for a
// second fsync. Here every fsync takes 300 ms: the call must answer after
// about one of them, not two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calls_two_holds_share_one_fsync() {
    let _one_at_a_time = DURABLE_FAULTS.lock().await;
    let (gw, faulty, _dir) = durable_gw("onecommit").await;
    let body = chat("Hello, durable world.", 20);
    // One call first: connections, caches and lazy set-up out of the way.
    let r = read(gw.post("/v1/chat/completions").json(&body)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    gw.wait_nothing_held().await;

    let fsync = Duration::from_millis(300);
    faulty.set_sync_delay(fsync);
    // Let a commit already under way (the first call's settles) finish.
    tokio::time::sleep(fsync * 2).await;
    let started = Instant::now();
    let r = read(gw.post("/v1/chat/completions").json(&body)).await;
    let took = started.elapsed();
    faulty.set_sync_delay(Duration::ZERO);
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(
        took >= fsync,
        "answered in {took:?}, before its holds' fsync ({fsync:?}) could end"
    );
    assert!(
        took < fsync * 2 - Duration::from_millis(50),
        "answered in {took:?}: its two holds took two fsyncs of {fsync:?}, one after the other"
    );
    gw.wait_nothing_held().await;
    // Both calls settled (the usage log follows the main log shortly).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let settled = gw
            .caller_records()
            .await
            .iter()
            .filter(|r| r["kind"] == "settled")
            .count();
        if settled == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "{settled} of 2 calls settled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
