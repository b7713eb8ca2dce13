//! Every denial kind, with every field: which limit said no, how much room
//! it has, what was asked, when a retry can pass and when the window resets.

use allowance_core::{Amounts, Denial, DenialKind, Dimension, ExtendError, WindowKind};

use crate::Harness;
use crate::catalogs::{DAY_MS, HOUR_MS};
use crate::support::{at, cost, key, tokens};

use DenialKind::{BudgetExhausted, ExceedsLimit, RateLimited};
use WindowKind::{Bucket, Calendar, Concurrent, Sliding, Total};

/// A denial, written out in full.
#[allow(clippy::too_many_arguments)]
fn denial(
    kind: DenialKind,
    scope: &str,
    dimension: &str,
    window: WindowKind,
    capacity: u64,
    remaining: i64,
    requested: u64,
    retry_after_ms: Option<u64>,
    resets_at_ms: Option<u64>,
) -> Denial {
    Denial {
        kind,
        scope: key(scope),
        dimension: dimension.to_string(),
        window,
        capacity,
        remaining,
        requested,
        retry_after_ms,
        resets_at: resets_at_ms.map(at),
    }
}

/// Sliding window, usage in the way: retry when enough of the oldest slices
/// have left for the request to fit; `resets_at` is when the oldest
/// non-empty slice leaves.
pub(crate) async fn rate_limited_sliding_usage(h: Harness) {
    h.set_ms(30_000);
    h.spend("acme", &[], tokens(60_000)).await; // minute 0
    h.set_ms(90_000);
    h.spend("acme", &[], tokens(30_000)).await; // minute 1
    h.set_ms(120_000);

    let d = h.deny(&h.request("acme", &[], tokens(20_000)).await).await;
    let want = |requested, retry, resets| {
        denial(
            RateLimited,
            "tenant:acme",
            "tokens",
            Sliding,
            100_000,
            10_000,
            requested,
            Some(retry),
            Some(resets),
        )
    };
    // Minute 0 leaving (at 1 h) frees 60,000: enough.
    assert_eq!(
        d,
        want(20_000, HOUR_MS - 120_000, HOUR_MS),
        "20,000 waits for minute 0"
    );
    // 95,000 needs minute 1 gone too (at 1 h 1 min).
    let d = h.deny(&h.request("acme", &[], tokens(95_000)).await).await;
    assert_eq!(
        d,
        want(95_000, HOUR_MS + 60_000 - 120_000, HOUR_MS),
        "95,000 waits for minute 1"
    );

    h.set_ms(HOUR_MS - 1);
    let d = h.deny(&h.request("acme", &[], tokens(20_000)).await).await;
    assert_eq!(
        d,
        want(20_000, 1, HOUR_MS),
        "one millisecond before, still refused"
    );
    h.set_ms(HOUR_MS);
    h.hold("acme", &[], tokens(20_000)).await;
    assert_eq!(
        h.figures("tenant:acme", "tokens", Sliding).await,
        (30_000, 20_000, 50_000),
        "minute 0 left the window"
    );
}

/// Holds alone block: retry when the earliest hold on the scope expires.
/// Usage blocks with holds present: the holds are assumed to stay.
pub(crate) async fn rate_limited_by_holds(h: Harness) {
    let r1 = h.hold("acme", &[], tokens(70_000)).await; // expires at 5 min
    h.set_ms(1_000);
    let d = h.deny(&h.request("acme", &[], tokens(40_000)).await).await;
    let want = denial(
        RateLimited,
        "tenant:acme",
        "tokens",
        Sliding,
        100_000,
        30_000,
        40_000,
        Some(299_000),
        Some(300_000),
    );
    assert_eq!(
        d, want,
        "40,000 > 100,000 − 70,000 held: only the hold ending helps (and the \
         window, empty, has no reset of its own: the hold's expiry is it)"
    );

    h.spend("acme", &[], tokens(20_000)).await; // minute 0
    let d = h.deny(&h.request("acme", &[], tokens(25_000)).await).await;
    let want = denial(
        RateLimited,
        "tenant:acme",
        "tokens",
        Sliding,
        100_000,
        10_000,
        25_000,
        Some(HOUR_MS - 1_000),
        Some(HOUR_MS),
    );
    assert_eq!(d, want, "25,000 fits beside the hold once minute 0 leaves");

    h.refund(r1).await;
    h.hold("acme", &[], tokens(40_000)).await;
}

/// A token bucket: retry after exactly deficit / rate; `resets_at` is when
/// the bucket is full again.
pub(crate) async fn rate_limited_bucket(h: Harness) {
    for _ in 0..60 {
        h.spend("acme", &[("user", "bob")], Amounts::new()).await;
    }
    let req = h.request("acme", &[("user", "bob")], Amounts::new()).await;
    let want = |retry| {
        denial(
            RateLimited,
            "tenant:acme/user:bob",
            "requests",
            Bucket,
            60,
            0,
            1,
            Some(retry),
            Some(60_000),
        )
    };
    assert_eq!(
        h.deny(&req).await,
        want(1_000),
        "one request comes back per second"
    );
    h.set_ms(999);
    assert_eq!(h.deny(&req).await, want(1), "0.999 of a request is not one");
    h.set_ms(1_000);
    h.reserve(&req).await;
    assert_eq!(
        h.figures("tenant:acme/user:bob", "requests", Bucket).await,
        (59, 1, 0)
    );
}

/// A calendar window: retry at the next boundary, which is also `resets_at`.
pub(crate) async fn rate_limited_calendar(h: Harness) {
    h.set_ms(HOUR_MS);
    h.spend("acme", &[("agent", "a1")], tokens(15_000)).await;
    let req = h.request("acme", &[("agent", "a1")], tokens(6_000)).await;
    let want = |retry| {
        denial(
            RateLimited,
            "tenant:acme/agent:a1",
            "tokens",
            Calendar,
            20_000,
            5_000,
            6_000,
            Some(retry),
            Some(DAY_MS),
        )
    };
    assert_eq!(
        h.deny(&req).await,
        want(DAY_MS - HOUR_MS),
        "retry at midnight"
    );
    h.set_ms(DAY_MS - 1);
    assert_eq!(h.deny(&req).await, want(1));
    h.set_ms(DAY_MS);
    h.reserve(&req).await;
    assert_eq!(
        h.figures("tenant:acme/agent:a1", "tokens", Calendar).await,
        (0, 6_000, 14_000),
        "a new day starts empty"
    );
}

/// The concurrency gauge: retry when the earliest HELD reservation expires,
/// which is also its `resets_at`.
pub(crate) async fn rate_limited_concurrent(h: Harness) {
    h.hold("acme", &[], Amounts::new()).await; // expires at 300 s
    h.set_ms(5_000);
    let mut last = None;
    for _ in 0..7 {
        last = Some(h.hold("acme", &[], Amounts::new()).await); // expire at 305 s
    }
    h.set_ms(10_000);
    let req = h.request("acme", &[], Amounts::new()).await;
    let want = denial(
        RateLimited,
        "tenant:acme",
        "concurrent",
        Concurrent,
        8,
        0,
        1,
        Some(290_000),
        Some(300_000),
    );
    assert_eq!(
        h.deny(&req).await,
        want,
        "the ninth waits for the first to expire"
    );

    h.refund(last.expect("seven holds")).await;
    h.reserve(&req).await; // expires at 310 s
    assert_eq!(h.deny(&req).await.retry_after_ms, Some(290_000));
    h.set_ms(300_000);
    h.reserve(&req).await;
    let gauge = h.limit("tenant:acme", "concurrent", Concurrent).await;
    assert_eq!((gauge.held, gauge.remaining), (8, 0));
    assert_eq!(
        gauge.resets_at,
        Some(at(305_000)),
        "the earliest expiry left"
    );
}

/// A total limit blocked by holds alone is rate limited (the holds will
/// end); a total never resets, so `resets_at` is the hold's expiry.
pub(crate) async fn rate_limited_total_holds(h: Harness) {
    let r = h.hold("acme", &[("task", "t1")], cost(800_000)).await;
    h.set_ms(1_000);
    let req = h.request("acme", &[("task", "t1")], cost(300_000)).await;
    let want = denial(
        RateLimited,
        "tenant:acme/task:t1",
        "cost_micros",
        Total,
        1_000_000,
        200_000,
        300_000,
        Some(299_000),
        Some(300_000),
    );
    assert_eq!(h.deny(&req).await, want);
    h.refund(r).await;
    h.reserve(&req).await;
}

/// A total limit out of room because of usage is a hard stop: no retry, no
/// reset, not even a day later.
pub(crate) async fn budget_exhausted(h: Harness) {
    h.spend("acme", &[("task", "t1")], cost(800_000)).await;
    let req = h.request("acme", &[("task", "t1")], cost(300_000)).await;
    let want = |remaining| {
        denial(
            BudgetExhausted,
            "tenant:acme/task:t1",
            "cost_micros",
            Total,
            1_000_000,
            remaining,
            300_000,
            None,
            None,
        )
    };
    assert_eq!(h.deny(&req).await, want(200_000));
    h.set_ms(2 * DAY_MS);
    assert_eq!(h.deny(&req).await, want(200_000), "a total never refills");

    // Usage alone blocks, holds or not: still exhausted.
    h.hold("acme", &[("task", "t1")], cost(100_000)).await;
    let req = h.request("acme", &[("task", "t1")], cost(250_000)).await;
    let mut d = want(100_000);
    d.requested = 250_000;
    assert_eq!(h.deny(&req).await, d);
}

/// D1 of the retry audit: only a hold that holds some of the refused
/// dimension can free room for it. The scope's earliest hold (1 s) holds
/// no `cost_micros`: the retry waits for the one that does (60 s), and is
/// the same once the first has ended.
pub(crate) async fn retry_waits_for_a_hold_of_the_refused_dimension(h: Harness) {
    let task = [("task", "t1")];
    let mut a = h.request("acme", &task, cost(600_000)).await;
    a.ttl_ms = Some(60_000);
    h.reserve(&a).await;
    let mut b = h.request("acme", &task, tokens(1_000)).await;
    b.ttl_ms = Some(1_000);
    h.reserve(&b).await;
    h.set_ms(10);
    let req = h.request("acme", &task, cost(500_000)).await;
    let want = |retry| {
        denial(
            RateLimited,
            "tenant:acme/task:t1",
            "cost_micros",
            Total,
            1_000_000,
            400_000,
            500_000,
            Some(retry),
            Some(60_000),
        )
    };
    assert_eq!(
        h.deny(&req).await,
        want(59_990),
        "the 1 s hold holds no cost_micros: not the one to wait for"
    );
    h.set_ms(1_000);
    assert_eq!(
        h.deny(&req).await,
        want(59_000),
        "the hold without cost_micros ended: nothing changed"
    );
    h.set_ms(60_000);
    h.reserve(&req).await;
}

/// D2 of the retry audit: holds block, and usage too. The retry is no
/// earlier than usage leaving room for the request with the holds gone:
/// here minute 0's 70,000 leaving at 1 h, not the 1 s hold's end.
pub(crate) async fn retry_waits_for_usage_behind_holds(h: Harness) {
    h.spend("acme", &[], tokens(70_000)).await; // minute 0: leaves at 1 h
    h.set_ms(30_000);
    let mut hold = h.request("acme", &[], tokens(30_000)).await;
    hold.ttl_ms = Some(1_000);
    h.reserve(&hold).await;
    let req = h.request("acme", &[], tokens(80_000)).await;
    let want = |remaining, retry| {
        denial(
            RateLimited,
            "tenant:acme",
            "tokens",
            Sliding,
            100_000,
            remaining,
            80_000,
            Some(retry),
            Some(HOUR_MS),
        )
    };
    assert_eq!(
        h.deny(&req).await,
        want(0, HOUR_MS - 30_000),
        "80,000 fits only once the 70,000 used have left, hold or not"
    );
    h.set_ms(31_000);
    assert_eq!(
        h.deny(&req).await,
        want(30_000, HOUR_MS - 31_000),
        "the hold ended: still the usage to wait for"
    );
    h.set_ms(HOUR_MS - 1);
    h.deny(&req).await;
    h.set_ms(HOUR_MS);
    h.reserve(&req).await;
}

/// D3 of the retry audit: a `total` whose usage alone leaves no room for
/// the request is a hard stop, even with holds on it that will end.
pub(crate) async fn budget_exhausted_when_usage_alone_blocks(h: Harness) {
    let task = [("task", "t1")];
    h.spend("acme", &task, cost(700_000)).await;
    let mut hold = h.request("acme", &task, cost(200_000)).await;
    hold.ttl_ms = Some(1_000);
    h.reserve(&hold).await;
    let req = h.request("acme", &task, cost(900_000)).await;
    let want = |remaining| {
        denial(
            BudgetExhausted,
            "tenant:acme/task:t1",
            "cost_micros",
            Total,
            1_000_000,
            remaining,
            900_000,
            None,
            None,
        )
    };
    assert_eq!(
        h.deny(&req).await,
        want(100_000),
        "900,000 > 1,000,000 − 700,000 used: the hold ending cannot help"
    );
    h.set_ms(1_000);
    assert_eq!(h.deny(&req).await, want(300_000), "the hold ended: still");
}

/// D5 of the retry audit: a `total` with room for the request beside its
/// usage, blocked by a hold, is rate limited until that hold ends (a
/// refund or the expiry frees the room, with no admin).
pub(crate) async fn rate_limited_when_holds_alone_block_a_total(h: Harness) {
    let task = [("task", "t1")];
    h.spend("acme", &task, cost(300_000)).await;
    let r = h.hold("acme", &task, cost(600_000)).await; // expires at 300 s
    h.set_ms(1_000);
    let req = h.request("acme", &task, cost(200_000)).await;
    let want = denial(
        RateLimited,
        "tenant:acme/task:t1",
        "cost_micros",
        Total,
        1_000_000,
        100_000,
        200_000,
        Some(299_000),
        Some(300_000),
    );
    assert_eq!(
        h.deny(&req).await,
        want,
        "200,000 ≤ 1,000,000 − 300,000 used: the hold's end frees the room"
    );
    h.refund(r).await;
    h.reserve(&req).await;
}

/// D4 of the retry audit: an extend's own hold never frees room for its
/// raise (it ends only with the reservation): the retry waits for the
/// earliest *other* hold. With no other hold in the way, a raise that
/// usage alone leaves no room for is, on a `total`, a hard stop.
pub(crate) async fn extend_does_not_wait_for_its_own_hold(h: Harness) {
    let task = [("task", "t1")];
    let mut a = h.request("acme", &task, cost(300_000)).await;
    a.ttl_ms = Some(2_000);
    let a = h.reserve(&a).await.id;
    let mut b = h.request("acme", &task, cost(500_000)).await;
    b.ttl_ms = Some(60_000);
    let b = h.reserve(&b).await.id;
    h.set_ms(10);
    let raise = cost(300_000);
    let want = denial(
        RateLimited,
        "tenant:acme/task:t1",
        "cost_micros",
        Total,
        1_000_000,
        200_000,
        300_000,
        Some(59_990),
        Some(60_000),
    );
    match h.extend_err(a, Some(&raise), None).await {
        ExtendError::Denied(d) => assert_eq!(
            *d, want,
            "the raise waits for B (60 s), not for its own hold's end (2 s)"
        ),
        other => panic!("extend should be denied, got {other:?}"),
    }
    h.refund(b).await;
    let r = h.extend(a, Some(&raise), None).await;
    assert_eq!(r.held.get(Dimension::COST_MICROS), 600_000);

    // Own hold 600,000 and 300,000 used: 200,000 more can never fit while
    // the reservation lives (a total never frees usage).
    h.spend("acme", &task, cost(300_000)).await;
    let more = cost(200_000);
    let want = denial(
        BudgetExhausted,
        "tenant:acme/task:t1",
        "cost_micros",
        Total,
        1_000_000,
        100_000,
        200_000,
        None,
        None,
    );
    match h.extend_err(a, Some(&more), None).await {
        ExtendError::Denied(d) => assert_eq!(*d, want, "no other hold to wait for"),
        other => panic!("extend should be denied, got {other:?}"),
    }
}

/// An amount above a limit's whole capacity can never pass.
pub(crate) async fn exceeds_limit(h: Harness) {
    let req = h.request("acme", &[("task", "t1")], cost(1_000_001)).await;
    let want = denial(
        ExceedsLimit,
        "tenant:acme/task:t1",
        "cost_micros",
        Total,
        1_000_000,
        1_000_000,
        1_000_001,
        None,
        None,
    );
    assert_eq!(h.deny(&req).await, want);

    let req = h.request("acme", &[], tokens(100_001)).await;
    let want = denial(
        ExceedsLimit,
        "tenant:acme",
        "tokens",
        Sliding,
        100_000,
        100_000,
        100_001,
        None,
        None,
    );
    assert_eq!(
        h.deny(&req).await,
        want,
        "a fresh sliding window has no reset instant"
    );
    h.hold("acme", &[], tokens(100_000)).await;
}

/// Which denial is reported: exceeds_limit over budget_exhausted over
/// rate_limited; among rate_limited the latest retry; ties go to the earlier
/// scope in the request.
pub(crate) async fn denial_precedence(h: Harness) {
    // "never" beats "hard stop", even from a later scope.
    h.spend("one", &[("task", "t1")], cost(900_000)).await;
    let amounts = tokens(25_000).with(Dimension::COST_MICROS, 200_000);
    let req = h
        .request("one", &[("task", "t1"), ("agent", "a1")], amounts)
        .await;
    let d = h.deny(&req).await;
    assert_eq!(
        (d.kind, d.scope.as_str()),
        (ExceedsLimit, "tenant:one/agent:a1"),
        "exceeds_limit over budget_exhausted"
    );

    // A hard stop beats "not now", even from a later scope.
    h.spend("two", &[("task", "t1")], cost(900_000)).await;
    h.hold("two", &[], tokens(95_000)).await;
    let amounts = tokens(10_000).with(Dimension::COST_MICROS, 200_000);
    let d = h
        .deny(&h.request("two", &[("task", "t1")], amounts).await)
        .await;
    assert_eq!(
        (d.kind, d.scope.as_str()),
        (BudgetExhausted, "tenant:two/task:t1"),
        "budget_exhausted over rate_limited"
    );

    // Among "not now", the latest retry: a retry must pass them all.
    h.set_ms(HOUR_MS);
    h.hold("three", &[], tokens(85_000)).await;
    h.spend("three", &[("agent", "a1")], tokens(15_000)).await;
    let d = h
        .deny(&h.request("three", &[("agent", "a1")], tokens(6_000)).await)
        .await;
    let want = denial(
        RateLimited,
        "tenant:three/agent:a1",
        "tokens",
        Calendar,
        20_000,
        5_000,
        6_000,
        Some(DAY_MS - HOUR_MS),
        Some(DAY_MS),
    );
    assert_eq!(d, want, "midnight binds over the tenant's hour");

    // Equal retries: the earlier scope of the request.
    h.spend("four", &[("agent", "a1")], tokens(15_000)).await;
    h.spend("four", &[("agent", "a2")], tokens(15_000)).await;
    for (order, first) in [
        ([("agent", "a2"), ("agent", "a1")], "tenant:four/agent:a2"),
        ([("agent", "a1"), ("agent", "a2")], "tenant:four/agent:a1"),
    ] {
        let d = h
            .deny(&h.request("four", &order, tokens(6_000)).await)
            .await;
        assert_eq!(d.scope.as_str(), first, "a tie goes to the earlier scope");
    }
}

/// Tenant `z<i>` holds a token, and no search_calls, on `tool:search`
/// until 1 s + 10·i ms.
async fn hold_no_search_calls(h: &Harness, i: u64) {
    let mut r = h
        .request(&format!("z{i}"), &[("tool", "search")], tokens(1))
        .await;
    r.ttl_ms = Some(1_000 + 10 * i);
    h.reserve(&r).await;
}

/// The hold walk's bound (docs/ENGINE-CHOICES.md, "Denials"): a denial
/// looks for the earliest hold holding the refused dimension among at most
/// 64 holds in expiry order; past them it answers the 64th's expiry. On the
/// shared `tool:search` (search_calls 100 per sliding minute), holds of
/// other tenants that hold no search_calls come first.
pub(crate) async fn hold_walk_is_bounded(h: Harness) {
    let catalog = h.store.catalog().await.expect("catalog");
    let search_calls = catalog.dimension("search_calls").expect("configured");
    let tool = [("tool", "search")];
    for i in 0..3 {
        hold_no_search_calls(&h, i).await;
    }
    let mut all = h
        .request("acme", &tool, Amounts::new().with(search_calls, 100))
        .await;
    all.ttl_ms = Some(50_000);
    h.reserve(&all).await;
    let one = h
        .request("beta", &tool, Amounts::new().with(search_calls, 1))
        .await;
    let want = |retry, resets| {
        denial(
            RateLimited,
            "tool:search",
            "search_calls",
            Sliding,
            100,
            0,
            1,
            Some(retry),
            Some(resets),
        )
    };
    assert_eq!(
        h.deny(&one).await,
        want(50_000, 50_000),
        "the three holds before it hold no search_calls"
    );
    for i in 3..70 {
        hold_no_search_calls(&h, i).await;
    }
    // 70 such holds expire first: the walk stops at the 64th (i = 63).
    assert_eq!(
        h.deny(&one).await,
        want(1_630, 1_630),
        "past 64 holds, the 64th's expiry"
    );
    h.set_ms(1_630);
    assert_eq!(
        h.deny(&one).await,
        want(48_370, 50_000),
        "6 left before it: found"
    );
}
