//! Idempotency keys and dry runs.

use std::sync::Arc;

use allowance_core::{Amounts, Dimension, ReserveError, Status, StoreError, WindowKind};

use crate::Harness;
use crate::catalogs::DEFAULT_TTL_MS;
use crate::support::{at, tokens, usage};

const KEY: &str = "v1:run42:t7:openai:9f2c";

/// A repeat with the same key and request answers the existing reservation
/// (whatever its status) and holds nothing new; ttl and labels may differ,
/// the scopes may come in another order; keys are per tenant.
pub(crate) async fn idempotency_key_replays(h: Harness) {
    let others = [("agent", "a1"), ("task", "t1")];
    let mut req = h.request("acme", &others, tokens(1000)).await;
    req.idempotency_key = Some(KEY.into());
    req.ttl_ms = Some(60_000);
    let first = h.reserve(&req).await;
    assert!(!first.replayed, "the first attempt is no replay");

    let mut again = h
        .request("acme", &[("task", "t1"), ("agent", "a1")], tokens(1000))
        .await;
    again.idempotency_key = Some(KEY.into());
    again.ttl_ms = Some(120_000);
    again.labels = Some(Arc::from(vec![("attempt".to_string(), "2".to_string())]));
    h.set_ms(1_000);
    let replay = h.reserve(&again).await;
    assert!(replay.replayed, "a repeat is a replay");
    assert_eq!(
        (replay.id, replay.status, &replay.held, replay.expires_at),
        (first.id, Status::Held, &first.held, at(60_000)),
        "the existing reservation, as it is"
    );
    let t = h.status("tenant:acme").await;
    assert_eq!(t.held_reservations, 1, "a replay holds nothing new");
    assert_eq!(
        h.figures("tenant:acme", "tokens", WindowKind::Sliding)
            .await,
        (0, 1000, 99_000)
    );

    h.settle(first.id, &usage(tokens(800))).await;
    let replay = h.reserve(&req).await;
    assert_eq!(
        (replay.replayed, replay.id, replay.status),
        (true, first.id, Status::Settled),
        "a replay answers the reservation whatever its status"
    );
    assert_eq!(
        h.figures("tenant:acme", "tokens", WindowKind::Sliding)
            .await,
        (800, 0, 99_200)
    );

    // The same key in another tenant is another key.
    let mut other = h.request("beta", &others, tokens(1000)).await;
    other.idempotency_key = Some(KEY.into());
    let g = h.reserve(&other).await;
    assert!(!g.replayed, "keys are unique per tenant, not global");
    assert_ne!(g.id, first.id);

    // An expired reservation replays as expired, and holds nothing new.
    let mut short = h.request("acme", &[], tokens(500)).await;
    short.idempotency_key = Some("short".into());
    short.ttl_ms = Some(1_000);
    let s = h.reserve(&short).await;
    h.set_ms(10_000);
    let replay = h.reserve(&short).await;
    assert_eq!(
        (replay.replayed, replay.id, replay.status),
        (true, s.id, Status::Expired)
    );
    assert_eq!(h.status("tenant:acme").await.held_reservations, 0);
}

/// The same key with a different request (scopes, amounts as sent, model)
/// is a conflict, and changes nothing.
pub(crate) async fn idempotency_key_conflicts(h: Harness) {
    let mut req = h.request("acme", &[("agent", "a1")], tokens(1000)).await;
    req.idempotency_key = Some(KEY.into());
    h.reserve(&req).await;
    let names = [
        "tenant:acme",
        "tenant:acme/agent:a1",
        "tenant:acme/agent:a2",
    ];
    let before = h.statuses(&names).await;

    let mut more = req.clone();
    more.amounts = tokens(1001);
    let mut elsewhere = h.request("acme", &[("agent", "a2")], tokens(1000)).await;
    elsewhere.idempotency_key = Some(KEY.into());
    let mut priced = req.clone();
    priced.model = Some("gpt-4o".into());
    for (what, r) in [
        ("other amounts", more),
        ("other scopes", elsewhere),
        ("another model", priced),
    ] {
        match h.store.reserve(&r).await {
            Err(StoreError::Rejected(ReserveError::IdempotencyConflict { key })) => {
                assert_eq!(key, KEY, "{what}: the conflict names the key")
            }
            other => panic!("{what}: the same key with {what} should conflict, got {other:?}"),
        }
    }
    assert_eq!(
        h.statuses(&names).await,
        before,
        "a conflict changes nothing"
    );

    // Amounts compare as sent: tokens given explicitly is another request,
    // even though it derives the same hold.
    let io = Amounts::new()
        .with(Dimension::INPUT_TOKENS, 100)
        .with(Dimension::OUTPUT_TOKENS, 50);
    let mut derived = h.request("acme", &[], io.clone()).await;
    derived.idempotency_key = Some("as-sent".into());
    h.reserve(&derived).await;
    let mut explicit = derived.clone();
    explicit.amounts = io.with(Dimension::TOKENS, 150);
    assert!(
        matches!(
            h.store.reserve(&explicit).await,
            Err(StoreError::Rejected(
                ReserveError::IdempotencyConflict { .. }
            ))
        ),
        "amounts are compared as sent"
    );
}

/// A denied attempt binds no key: a later retry with the same key may
/// succeed, and is a first attempt.
pub(crate) async fn denied_attempt_binds_no_key(h: Harness) {
    let blocker = h.hold("acme", &[], tokens(95_000)).await;
    let mut req = h.request("acme", &[], tokens(10_000)).await;
    req.idempotency_key = Some(KEY.into());
    h.deny(&req).await;
    h.deny(&req).await;
    h.refund(blocker).await;
    let g = h.reserve(&req).await;
    assert!(!g.replayed, "the denied attempts bound nothing");
    let again = h.reserve(&req).await;
    assert_eq!((again.replayed, again.id), (true, g.id));
}

/// A dry run changes nothing, however often it is repeated: no hold, no
/// request counted, no reservation to read back.
pub(crate) async fn dry_run_changes_nothing(h: Harness) {
    let others = [("user", "bob"), ("agent", "a1")];
    let names = [
        "tenant:acme",
        "tenant:acme/user:bob",
        "tenant:acme/agent:a1",
    ];
    h.spend("acme", &others, tokens(12_000)).await;
    let before = h.statuses(&names).await;
    let mut req = h.request("acme", &others, tokens(5_000)).await;
    req.dry_run = true;
    // More than the user's 60 requests a minute: dry runs take none.
    for _ in 0..61 {
        let g = h.reserve(&req).await;
        assert!(g.dry_run && !g.replayed, "a dry run says so");
        assert_eq!(
            g.status,
            Status::Held,
            "a dry run answers what a reserve would"
        );
        assert_eq!(
            (g.held.clone(), g.expires_at),
            (tokens(5_000), at(DEFAULT_TTL_MS))
        );
        assert_eq!(
            h.store.get(g.id).await.expect("get"),
            None,
            "no reservation made"
        );
    }
    assert_eq!(h.statuses(&names).await, before, "dry runs change nothing");

    // Denied: the same denial as the reserve, and still nothing changes.
    req.amounts = tokens(9_000);
    let dry = h.deny(&req).await;
    assert_eq!(h.statuses(&names).await, before);
    req.dry_run = false;
    assert_eq!(
        h.deny(&req).await,
        dry,
        "a dry run is denied as the reserve is"
    );
}

/// A dry run answers exactly what the reserve would: the same hold, expiry
/// and remaining figures (after the hold) as a reserve asked to report them.
pub(crate) async fn dry_run_answers_like_reserve(h: Harness) {
    let others = [("user", "bob"), ("agent", "a1")];
    h.spend("acme", &others, tokens(12_000)).await;
    h.hold("acme", &[("agent", "a1")], tokens(4_000)).await;
    let mut req = h.request("acme", &others, tokens(3_000)).await;
    req.dry_run = true;
    let dry = h.reserve(&req).await;
    req.dry_run = false;
    req.report_remaining = true;
    let real = h.reserve(&req).await;
    assert_eq!((dry.dry_run, real.dry_run), (true, false));
    assert_eq!((&dry.held, dry.expires_at), (&real.held, real.expires_at));
    assert_eq!(
        dry.remaining, real.remaining,
        "a dry run reports the room a reserve would leave"
    );
    let agent = real
        .remaining
        .iter()
        .find(|r| r.scope.as_str() == "tenant:acme/agent:a1")
        .expect("every scope's limits are reported");
    assert_eq!(
        agent.remaining,
        20_000 - 12_000 - 4_000 - 3_000,
        "room after this hold"
    );
}
