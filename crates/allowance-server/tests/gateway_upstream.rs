//! The gateway against a failing upstream: 5xx retried then refunded,
//! 4xx passed on, 429s waited out exactly through one backoff shared by
//! every call, every attempt counted on `upstream:<name>` (connect errors
//! not), an upstream that is not there, the adaptive concurrency under a
//! provider's ceiling, and slow answers that must keep their holds.
//!
//! Timing assertions are lower bounds taken from the stub's own clock
//! (`received_at_ms`), or generous upper bounds that only catch a stall.

mod common_gateway;

use std::time::{Duration, Instant};

use allowance_stub::{BehaviorPatch, Scripted};
use common_gateway::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_500s_are_retried_then_passed_on_and_refunded() {
    let mut setup = Setup::new("fivehundreds");
    setup.max_retries = Some(2);
    let gw = Gw::start(setup).await;
    gw.count_upstream_exactly().await;
    gw.stub
        .enqueue([
            Scripted::status(500),
            Scripted::status(500),
            Scripted::status(500),
        ])
        .unwrap();
    let r = gw.call("/v1/chat/completions", &chat("Hello?", 20)).await;
    assert_eq!(r.status, 500, "{}", r.text);
    assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
    let v = r.json();
    assert_eq!(
        v["error"]["type"], "server_error",
        "the upstream's body: {v}"
    );
    assert_eq!(gw.stub.stats().total, 3, "1 + max_retries attempts");

    gw.wait_nothing_held().await;
    assert_eq!(
        gw.limit(BOB, "tokens").await,
        (0, 0),
        "a failed call costs nothing"
    );
    let callers = gw.caller_records().await;
    assert_eq!(callers.len(), 1);
    assert_eq!(callers[0]["kind"], "refunded", "{}", callers[0]);
    // The provider counted every attempt.
    let attempts = gw.attempt_records().await;
    assert_eq!(attempts.len(), 3);
    assert!(
        attempts.iter().all(|a| a["kind"] == "settled"),
        "{attempts:#?}"
    );
    let up = gw.upstream_scope();
    assert_eq!(gw.limit(&up, "requests").await, (3, 0));
    assert_eq!(gw.limit(&up, "input_tokens").await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_500_then_a_success_settles_once_and_counts_both_attempts() {
    let gw = Gw::start(Setup::new("fivethenok")).await;
    gw.count_upstream_exactly().await;
    gw.stub.enqueue([Scripted::status(503)]).unwrap();
    let body = chat("Hello again?", 20);
    let input = stub_chat_tokens(&body);
    let r = gw.call("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
    gw.wait_nothing_held().await;
    assert_eq!(gw.limit(BOB, "tokens").await, (input + 20, 0));
    let callers = gw.caller_records().await;
    assert_eq!(
        callers.len(),
        1,
        "one settle for the call, not one per attempt"
    );
    assert_eq!(amount(&callers[0], "charged", "output_tokens"), 20);
    let up = gw.upstream_scope();
    assert_eq!(gw.limit(&up, "requests").await, (2, 0));
    assert_eq!(gw.limit(&up, "input_tokens").await, (input, 0));
    assert_eq!(gw.limit(&up, "output_tokens").await, (20, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_4xx_is_passed_on_at_once_and_refunded() {
    let gw = Gw::start(Setup::new("fourhundred")).await;
    gw.count_upstream_exactly().await;
    let err = json!({"error": {"message": "This model's maximum context length is 8 tokens.",
                               "type": "invalid_request_error", "param": "messages",
                               "code": "context_length_exceeded"}});
    gw.stub
        .enqueue([Scripted::status(400).body(err.clone())])
        .unwrap();
    let r = gw
        .call("/v1/chat/completions", &chat("A long prompt.", 20))
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json(), err, "the provider's body, unchanged");
    assert_eq!(r.header("x-should-retry"), None, "no retry was made");
    assert_eq!(gw.stub.stats().total, 1, "a 4xx is not retried");
    gw.wait_nothing_held().await;
    assert_eq!(gw.caller_records().await[0]["kind"], "refunded");
    assert_eq!(gw.limit(BOB, "tokens").await, (0, 0));
    assert_eq!(gw.limit(&gw.upstream_scope(), "requests").await, (1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_is_waited_out_exactly_and_every_call_waits_with_it() {
    let gw = Gw::start(Setup::new("backoff")).await;
    gw.count_upstream_exactly().await;
    gw.stub
        .enqueue([Scripted::status(429).header("retry-after", "1")])
        .unwrap();
    let first = tokio::spawn(read(
        gw.post("/v1/chat/completions").json(&chat("first", 10)),
    ));
    // The 429 has been answered once the stub logged it.
    let started = Instant::now();
    while gw.stub.requests().is_empty() {
        assert!(started.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let t0 = gw.stub.requests()[0].received_at_ms;
    tokio::time::sleep(Duration::from_millis(150)).await;
    // Calls that come in during the backoff wait for it too.
    let later: Vec<_> = (0..4)
        .map(|i| {
            tokio::spawn(read(
                gw.post("/v1/chat/completions")
                    .json(&chat(&format!("later {i}"), 10)),
            ))
        })
        .collect();
    let r = first.await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
    for t in later {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text);
    }
    let log = gw.stub.requests();
    assert_eq!(log.len(), 6, "one 429, its retry, four others");
    for req in &log[1..] {
        assert!(
            req.received_at_ms >= t0 + 1000,
            "a call reached the upstream {} ms after its 429 said wait 1 s",
            req.received_at_ms - t0
        );
    }
    assert_eq!(
        gw.limit(&gw.upstream_scope(), "requests").await.0,
        6,
        "the 429 counts"
    );
    let n429 = gw
        .metric(
            "allowance_gateway_upstream_429_total",
            &[("upstream", "backoff")],
        )
        .await;
    assert_eq!(n429, Some(1.0));
    gw.wait_nothing_held().await;
    assert!(
        gw.caller_records()
            .await
            .iter()
            .all(|r| r["kind"] == "settled")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_hit_by_a_429_backs_off_together() {
    // Six calls at once; the first to arrive gets a 429 with retry-after.
    // Calls already on the wire may land just after it; no call may land
    // later inside the backoff.
    const RACE_MS: u64 = 150;
    let gw = Gw::start(Setup::new("burst")).await;
    gw.stub
        .enqueue([Scripted::status(429).header("retry-after-ms", "1200")])
        .unwrap();
    let calls: Vec<_> = (0..6)
        .map(|i| {
            tokio::spawn(read(
                gw.post("/v1/chat/completions")
                    .json(&chat(&format!("burst {i}"), 10)),
            ))
        })
        .collect();
    for c in calls {
        let r = c.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text);
    }
    let log = gw.stub.requests();
    assert_eq!(log.len(), 7);
    let t0 = log[0].received_at_ms;
    for req in &log[1..] {
        let after = req.received_at_ms.saturating_sub(t0);
        assert!(
            after <= RACE_MS || after >= 1200,
            "a call reached the upstream {after} ms after a 429 that said wait 1200 ms"
        );
    }
    assert!(
        log.iter().filter(|r| r.received_at_ms >= t0 + 1200).count() >= 1,
        "the retry"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passed_on_429_keeps_its_retry_after() {
    // Past the longest backoff the gateway waits out itself (30 s), the
    // provider's 429 goes to the client, which "decides" (call.rs) — and
    // can decide only if it is told when to come back.
    let gw = Gw::start(Setup::new("longwait")).await;
    gw.stub
        .enqueue([Scripted::status(429).header("retry-after", "120")])
        .unwrap();
    let r = gw.call("/v1/chat/completions", &chat("Now?", 10)).await;
    assert_eq!(r.status, 429, "{}", r.text);
    let retry_after: u64 = r
        .header("retry-after")
        .unwrap_or_else(|| panic!("no retry-after on a passed-on 429: {:?}", r.headers))
        .parse()
        .expect("seconds");
    assert!((100..=120).contains(&retry_after), "{retry_after}");
    gw.wait_nothing_held().await;
    assert_eq!(gw.caller_records().await[0]["kind"], "refunded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_provider_backoff_does_not_stall_later_calls() {
    // A 429 asking for 120 s is passed on to its caller at once (longer
    // than the gateway waits). A later call must not sit silently for
    // those 120 s holding its budget: it is answered promptly (a 429 with
    // when to retry, or an answer).
    let gw = Gw::start(Setup::new("stall")).await;
    gw.stub
        .enqueue([Scripted::status(429).header("retry-after", "120")])
        .unwrap();
    let r = gw.call("/v1/chat/completions", &chat("Now?", 10)).await;
    assert_eq!(r.status, 429, "{}", r.text);
    let later = try_read(
        gw.post("/v1/chat/completions")
            .timeout(Duration::from_secs(5))
            .json(&chat("And now?", 10)),
    )
    .await;
    let later = later.unwrap_or_else(|e| {
        panic!("a later call was not answered within 5 s (stalled behind a 120 s backoff): {e}")
    });
    assert!(
        later.status == 200 || later.status == 429,
        "{}: {}",
        later.status,
        later.text
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_attempt_is_counted_on_the_upstream_scope() {
    let mut setup = Setup::new("attempts");
    setup.max_retries = Some(3);
    let gw = Gw::start(setup).await;
    gw.count_upstream_exactly().await;
    gw.stub
        .enqueue([
            Scripted::status(429).header("retry-after-ms", "100"),
            Scripted::status(500),
            Scripted::status(502),
        ])
        .unwrap();
    let body = chat("Third time lucky?", 15);
    let input = stub_chat_tokens(&body);
    let r = gw.call("/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(gw.stub.stats().total, 4);
    gw.wait_nothing_held().await;
    let up = gw.upstream_scope();
    assert_eq!(
        gw.limit(&up, "requests").await,
        (4, 0),
        "requests = attempts"
    );
    assert_eq!(gw.limit(&up, "input_tokens").await, (input, 0));
    assert_eq!(gw.limit(&up, "output_tokens").await, (15, 0));
    let attempts = gw.attempt_records().await;
    assert_eq!(attempts.len(), 4);
    assert!(attempts.iter().all(|a| a["kind"] == "settled"));
    let callers = gw.caller_records().await;
    assert_eq!(callers.len(), 1);
    assert_eq!(amount(&callers[0], "charged", "input_tokens"), input);
    assert_eq!(amount(&callers[0], "charged", "output_tokens"), 15);
    let retries = gw
        .metric(
            "allowance_gateway_retries_total",
            &[("upstream", "attempts")],
        )
        .await;
    assert_eq!(retries, Some(3.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_is_not_there_is_a_502_refunded_and_not_counted() {
    // A port that was just free: nothing listens there.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut setup = Setup::new("nowhere");
    setup.max_retries = Some(2);
    setup.base_url = Some(format!("http://127.0.0.1:{closed}"));
    let gw = Gw::start(setup).await;
    gw.count_upstream_exactly().await;

    let r = gw.call("/v1/chat/completions", &chat("Anyone?", 10)).await;
    assert_eq!(r.status, 502, "{}", r.text);
    assert_eq!(r.json()["error"]["type"], "api_error");
    assert_eq!(r.header("x-should-retry").as_deref(), Some("false"));
    let r = read(
        gw.post("/v1/messages")
            .json(&json!({"model": "claude-x", "max_tokens": 10,
            "messages": [{"role": "user", "content": "Anyone?"}]})),
    )
    .await;
    assert_eq!(r.status, 502, "{}", r.text);
    let v = r.json();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "api_error", "{v}");

    gw.wait_nothing_held().await;
    assert_eq!(gw.limit(BOB, "tokens").await, (0, 0));
    let callers = gw.caller_records().await;
    assert_eq!(callers.len(), 2);
    assert!(
        callers.iter().all(|c| c["kind"] == "refunded"),
        "{callers:#?}"
    );
    // Three attempts each, none reached a provider: none counted.
    let attempts = gw.attempt_records().await;
    assert_eq!(attempts.len(), 6, "{attempts:#?}");
    assert!(
        attempts.iter().all(|a| a["kind"] == "refunded"),
        "{attempts:#?}"
    );
    assert_eq!(gw.limit(&gw.upstream_scope(), "requests").await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_adaptive_width_narrows_under_a_providers_concurrency_ceiling() {
    // The stub takes 2 calls at once and answers a third 429 without
    // retry-after, like a provider's concurrency ceiling. (Kept to a few
    // calls: see `a_burst_of_bare_429s_is_one_backoff_step` for why a
    // wider burst is slow today.)
    const MAX_CONCURRENT: u64 = 4;
    let mut setup = Setup::new("adaptive");
    setup.max_concurrent = Some(MAX_CONCURRENT);
    setup.max_retries = Some(10);
    let gw = Gw::start(setup).await;
    gw.behave(BehaviorPatch {
        output_tokens: Some(5),
        token_delay_ms: Some(20),
        concurrency_limit: Some(Some(2)),
        ..Default::default()
    });
    let calls: Vec<_> = (0..6)
        .map(|i| {
            tokio::spawn(read(
                gw.post("/v1/chat/completions")
                    .timeout(Duration::from_secs(30))
                    .json(&chat(&format!("call {i}"), 5)),
            ))
        })
        .collect();
    // The width while the calls run (it widens again, by one per `width`
    // clean answers, once they pass).
    let mut narrowest = f64::INFINITY;
    while !calls.iter().all(|c| c.is_finished()) {
        if let Some(w) = gw
            .metric(
                "allowance_gateway_upstream_width",
                &[("upstream", "adaptive")],
            )
            .await
        {
            narrowest = narrowest.min(w);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for c in calls {
        let r = c.await.unwrap();
        assert_eq!(
            r.status, 200,
            "every call gets through in the end: {}",
            r.text
        );
    }
    assert!(
        (1.0..MAX_CONCURRENT as f64).contains(&narrowest),
        "narrowest width {narrowest} under a provider that takes 2 (max_concurrent {MAX_CONCURRENT})"
    );
    let n429 = gw
        .metric(
            "allowance_gateway_upstream_429_total",
            &[("upstream", "adaptive")],
        )
        .await
        .unwrap_or(0.0);
    assert!(n429 >= 1.0);
    assert!(gw.stub.stats().max_in_flight <= 2);
    gw.wait_nothing_held().await;
    let callers = gw.caller_records().await;
    assert_eq!(callers.len(), 6);
    assert!(callers.iter().all(|c| c["kind"] == "settled"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_concurrent_bounds_the_calls_in_flight_upstream() {
    let mut setup = Setup::new("onebyone");
    setup.max_concurrent = Some(1);
    let gw = Gw::start(setup).await;
    gw.behave(BehaviorPatch {
        output_tokens: Some(5),
        token_delay_ms: Some(30),
        ..Default::default()
    });
    let calls: Vec<_> = (0..4)
        .map(|i| {
            let mut body = chat(&format!("call {i}"), 5);
            if i % 2 == 1 {
                body["stream"] = json!(true);
            }
            tokio::spawn(read(gw.post("/v1/chat/completions").json(&body)))
        })
        .collect();
    for c in calls {
        let r = c.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text);
    }
    let stats = gw.stub.stats();
    assert_eq!(stats.total, 4);
    assert_eq!(
        stats.max_in_flight, 1,
        "max_concurrent = 1, streams included"
    );
    gw.wait_nothing_held().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_bare_429s_is_one_backoff_step() {
    // Eight calls at once against a provider that takes two: six 429s
    // without retry-after arrive together. They are one overload signal
    // (the gate already treats them so); counted as six consecutive ones
    // they raise the shared backoff to 2^5 x 500 ms (8-16 s) for every
    // call on the upstream. Rounds of 250-500 ms, 500-1000 ms, … finish
    // all eight in a few seconds.
    // Enough retries for four rounds of two (the default two retries
    // would pass the last round's 429 on, as configured).
    let mut setup = Setup::new("streak");
    setup.max_retries = Some(4);
    let gw = Gw::start(setup).await;
    gw.behave(BehaviorPatch {
        output_tokens: Some(5),
        token_delay_ms: Some(20),
        concurrency_limit: Some(Some(2)),
        ..Default::default()
    });
    let calls: Vec<_> = (0..8)
        .map(|i| {
            tokio::spawn(try_read(
                gw.post("/v1/chat/completions")
                    .timeout(Duration::from_secs(5))
                    .json(&chat(&format!("call {i}"), 5)),
            ))
        })
        .collect();
    let mut late = 0;
    for c in calls {
        match c.await.unwrap() {
            Ok(r) => assert_eq!(r.status, 200, "{}", r.text),
            Err(_) => late += 1,
        }
    }
    let log = gw.stub.requests();
    let gaps: Vec<u64> = log
        .windows(2)
        .map(|w| w[1].received_at_ms.saturating_sub(w[0].received_at_ms))
        .collect();
    assert_eq!(
        late, 0,
        "{late} of 8 calls not answered within 5 s; gaps between upstream requests (ms): {gaps:?}"
    );
    let longest = gaps.iter().max().copied().unwrap_or(0);
    assert!(longest <= 3000, "a {longest} ms pause: {gaps:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_gives_up_on_a_slow_answer_still_pays_for_it() {
    // The provider ran the call: the gateway reads it to the end and
    // settles it even though nobody is there to read the answer.
    let gw = Gw::start(Setup::new("gaveup")).await;
    gw.stub.enqueue([Scripted::hang_ms(700)]).unwrap();
    let body = chat("Take your time.", 30);
    let input = stub_chat_tokens(&body);
    let r = gw
        .post("/v1/chat/completions")
        .timeout(Duration::from_millis(150))
        .json(&body)
        .send()
        .await;
    assert!(r.is_err(), "the client gave up");
    let rec = &gw.wait_caller_records(1).await[0];
    gw.wait_nothing_held().await;
    assert_eq!(rec["kind"], "settled", "{rec}");
    assert_eq!(amount(rec, "charged", "input_tokens"), input);
    assert_eq!(amount(rec, "charged", "output_tokens"), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_whole_answer_keeps_its_hold() {
    // A whole answer may take minutes (the gateway waits up to 10); the
    // caller's hold (default TTL 5 min; here 1 s) must last as long as the
    // call, or its room is given to others while it runs.
    let mut setup = Setup::new("slowwhole");
    setup.default_ttl_ms = Some(1000);
    let gw = Gw::start(setup).await;
    gw.stub.enqueue([Scripted::hang_ms(1800)]).unwrap();
    let r = gw
        .call("/v1/chat/completions", &chat("Think it over.", 10))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    gw.wait_nothing_held().await;
    let log = gw.caller_records().await;
    assert!(
        log.iter()
            .all(|r| r["kind"] == "settled" && r["late"] == false),
        "the hold expired while the upstream worked: {log:#?}"
    );
    // So must the attempt's hold on the upstream (its bulkhead and token
    // buckets): an audit found it expired, then settled late.
    let attempts = gw.attempt_records().await;
    assert!(
        !attempts.is_empty()
            && attempts
                .iter()
                .all(|r| r["kind"] == "settled" && r["late"] == false),
        "the attempt's hold expired while the upstream worked: {attempts:#?}"
    );
}
