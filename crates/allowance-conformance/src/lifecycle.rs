//! The state machine of a reservation: idempotent terminal states,
//! conflicts, late settles, extend, and expiry observed by every read.

use allowance_core::{
    Amounts, CatalogChange, DenialKind, Dimension, ExtendError, Override, RefundError, SettleError,
    Status, WindowKind,
};

use crate::Harness;
use crate::catalogs::{DAY_MS, DEFAULT_TTL_MS};
use crate::support::{at, key, tokens, unknown_id, usage};

const SCOPES: [&str; 3] = [
    "tenant:acme",
    "tenant:acme/user:bob",
    "tenant:acme/agent:a1",
];
const OTHERS: [(&str, &str); 2] = [("user", "bob"), ("agent", "a1")];

/// A settle repeated — even with other figures, even later — answers the
/// first settle's reservation and records nothing more.
pub(crate) async fn settle_is_idempotent(h: Harness) {
    let id = h.hold("acme", &OTHERS, tokens(1000)).await;
    h.set_ms(1_000);
    let first = h.settle(id, &usage(tokens(700))).await;
    let after_first = h.statuses(&SCOPES).await;
    assert_eq!(
        h.settle(id, &usage(tokens(700))).await,
        first,
        "the same settle again"
    );
    assert_eq!(
        h.settle(id, &usage(tokens(900))).await,
        first,
        "another usage is ignored"
    );
    assert_eq!(
        h.statuses(&SCOPES).await,
        after_first,
        "a repeat records nothing"
    );
    h.set_ms(60_000);
    assert_eq!(
        h.settle(id, &usage(tokens(700))).await,
        first,
        "a later repeat too"
    );
    assert_eq!(
        h.get(id).await,
        first,
        "a read answers the settled reservation"
    );
    assert_eq!(
        h.figures("tenant:acme", "tokens", WindowKind::Sliding)
            .await,
        (700, 0, 99_300),
        "usage recorded once"
    );
}

/// A refund repeated answers the first refund's reservation.
pub(crate) async fn refund_is_idempotent(h: Harness) {
    let id = h.hold("acme", &OTHERS, tokens(1000)).await;
    h.set_ms(1_000);
    let first = h.refund(id).await;
    let after_first = h.statuses(&SCOPES).await;
    h.set_ms(60_000);
    assert_eq!(h.refund(id).await, first, "a repeat answers the same");
    assert_eq!(h.get(id).await, first);
    assert_eq!(
        h.statuses(&SCOPES).await,
        after_first,
        "a repeat releases nothing more"
    );
}

/// A settled reservation cannot be refunded: conflict, nothing changes.
pub(crate) async fn refund_after_settle_conflicts(h: Harness) {
    let id = h.hold("acme", &OTHERS, tokens(1000)).await;
    let settled = h.settle(id, &usage(tokens(800))).await;
    let before = h.statuses(&SCOPES).await;
    assert_eq!(
        h.refund_err(id).await,
        RefundError::Conflict {
            status: Status::Settled
        }
    );
    assert_eq!(h.get(id).await, settled, "still settled");
    assert_eq!(
        h.statuses(&SCOPES).await,
        before,
        "the usage stays recorded"
    );
}

/// A refunded reservation cannot be settled: conflict, nothing recorded.
pub(crate) async fn settle_after_refund_conflicts(h: Harness) {
    let id = h.hold("acme", &OTHERS, tokens(1000)).await;
    let refunded = h.refund(id).await;
    let before = h.statuses(&SCOPES).await;
    assert_eq!(
        h.settle_err(id, &usage(tokens(800))).await,
        SettleError::Conflict {
            status: Status::Refunded
        }
    );
    assert_eq!(h.get(id).await, refunded, "still refunded");
    assert_eq!(h.statuses(&SCOPES).await, before, "nothing recorded");
}

/// A refund of an expired reservation is a no-op success (it stays
/// EXPIRED), so a late settle can still record the real usage.
pub(crate) async fn refund_after_expiry_succeeds(h: Harness) {
    let mut req = h.request("acme", &OTHERS, tokens(1000)).await;
    req.ttl_ms = Some(60_000);
    let id = h.reserve(&req).await.id;
    h.set_ms(60_000);
    let r = h.refund(id).await;
    assert_eq!(
        r.status,
        Status::Expired,
        "a refund after expiry changes nothing"
    );
    assert_eq!(h.refund(id).await, r, "and a repeat answers the same");
    assert_eq!(
        h.figures("tenant:acme", "tokens", WindowKind::Sliding)
            .await,
        (0, 0, 100_000)
    );
    let late = h.settle(id, &usage(tokens(400))).await;
    assert_eq!((late.status, late.late), (Status::Settled, true));
    assert_eq!(
        h.figures("tenant:acme", "tokens", WindowKind::Sliding)
            .await,
        (400, 0, 99_600),
        "the late settle recorded the usage"
    );
}

/// An id the store never minted: reads answer nothing, operations not found.
pub(crate) async fn unknown_reservation(h: Harness) {
    h.hold("acme", &[], tokens(1)).await;
    let id = unknown_id("acme");
    assert_eq!(h.store.get(id).await.expect("get"), None);
    assert_eq!(
        h.settle_err(id, &usage(tokens(1))).await,
        SettleError::NotFound
    );
    assert_eq!(h.refund_err(id).await, RefundError::NotFound);
    assert_eq!(
        h.extend_err(id, None, Some(1_000)).await,
        ExtendError::NotFound
    );
}

/// A settle after expiry records the usage (and the request), is flagged
/// late, and does not release the hold a second time: another
/// reservation's hold stays whole.
pub(crate) async fn late_settle_after_expiry(h: Harness) {
    let r1 = h.hold("acme", &OTHERS, tokens(2000)).await; // expires at 300 s
    h.set_ms(200_000);
    let r2 = h.hold("acme", &[("agent", "a1")], tokens(500)).await; // at 500 s
    h.set_ms(DEFAULT_TTL_MS);
    assert_eq!(
        h.get(r1).await.status,
        Status::Expired,
        "expired at expires_at exactly"
    );
    assert_eq!(
        h.figures("tenant:acme", "tokens", WindowKind::Sliding)
            .await,
        (0, 500, 99_500)
    );
    assert_eq!(
        h.figures("tenant:acme/user:bob", "requests", WindowKind::Bucket)
            .await,
        (0, 0, 60),
        "an expiry charges nothing, not even the request"
    );

    let late = h.settle(r1, &usage(tokens(1500))).await;
    assert_eq!((late.status, late.late), (Status::Settled, true));
    assert_eq!(late.charged, Some(tokens(1500)));
    assert_eq!(
        h.figures("tenant:acme", "tokens", WindowKind::Sliding)
            .await,
        (1500, 500, 98_000),
        "usage recorded; the other hold untouched"
    );
    assert_eq!(
        h.figures("tenant:acme/agent:a1", "tokens", WindowKind::Calendar)
            .await,
        (1500, 500, 18_000)
    );
    assert_eq!(
        h.figures("tenant:acme/user:bob", "requests", WindowKind::Bucket)
            .await,
        (1, 0, 59),
        "a late settle records the request too"
    );
    assert_eq!(
        h.settle(r1, &usage(tokens(1500))).await,
        late,
        "a repeat answers the same"
    );
    assert_eq!(h.get(r2).await.status, Status::Held);

    // cap_at_estimate caps a late settle at what was held when it expired.
    let capped =
        CatalogChange::SetOverride(key("tenant:frugal"), Override::Plan("tenant-capped".into()));
    h.store.change_catalog(&capped).await.expect("override");
    let r3 = h.hold("frugal", &[], tokens(1000)).await;
    h.extend(r3, Some(&tokens(500)), None).await;
    h.set_ms(2 * DEFAULT_TTL_MS);
    let late = h.settle(r3, &usage(tokens(2000))).await;
    assert_eq!(
        late.charged,
        Some(tokens(1500)),
        "the estimate as last extended"
    );
}

/// Extend raises the hold on every scope, all or nothing: a refusal leaves
/// the reservation and every scope exactly as they were.
pub(crate) async fn extend_amounts_all_or_nothing(h: Harness) {
    let others = [("agent", "a1"), ("task", "t1")];
    let names = ["tenant:acme", "tenant:acme/agent:a1", "tenant:acme/task:t1"];
    let id = h
        .hold(
            "acme",
            &others,
            tokens(10_000).with(Dimension::COST_MICROS, 100_000),
        )
        .await;
    let r = h.extend(id, Some(&tokens(5_000)), None).await;
    assert_eq!(r.status, Status::Held);
    assert_eq!(r.held, tokens(15_000).with(Dimension::COST_MICROS, 100_000));
    assert_eq!(
        r.expires_at,
        at(DEFAULT_TTL_MS),
        "amounts alone leave the expiry"
    );
    assert_eq!(
        h.figures("tenant:acme", "tokens", WindowKind::Sliding)
            .await,
        (0, 15_000, 85_000)
    );
    assert_eq!(
        h.figures("tenant:acme/agent:a1", "tokens", WindowKind::Calendar)
            .await,
        (0, 15_000, 5_000)
    );

    let before = (h.get(id).await, h.statuses(&names).await);
    // With its own 15,000, 6,000 more pass the agent's whole 20,000: it can
    // never fit (a retry at its own expiry would find it ended).
    let ExtendError::Denied(d) = h.extend_err(id, Some(&tokens(6_000)), None).await else {
        panic!("6,000 more tokens do not fit the agent")
    };
    assert_eq!(
        (d.kind, d.scope.as_str(), d.dimension.as_str()),
        (DenialKind::ExceedsLimit, "tenant:acme/agent:a1", "tokens")
    );
    assert_eq!(
        (d.capacity, d.remaining, d.requested),
        (20_000, 5_000, 21_000),
        "requested: the whole hold it asked for"
    );
    assert_eq!((d.retry_after_ms, d.resets_at), (None, Some(at(DAY_MS))));
    assert_eq!(
        (h.get(id).await, h.statuses(&names).await),
        before,
        "nothing changed"
    );

    // The tokens would fit; the cost does not: neither is raised.
    let both = tokens(1_000).with(Dimension::COST_MICROS, 950_000);
    let ExtendError::Denied(d) = h.extend_err(id, Some(&both), None).await else {
        panic!("950,000 more micros do not fit the task")
    };
    assert_eq!(
        (d.scope.as_str(), d.dimension.as_str()),
        ("tenant:acme/task:t1", "cost_micros")
    );
    assert_eq!(
        (h.get(id).await, h.statuses(&names).await),
        before,
        "nothing changed"
    );

    // Another reservation's hold blocks what would fit beside its own:
    // rate limited, until that hold ends (at 301 s: its own, ending at
    // 300 s, never frees room for its own raise).
    h.set_ms(1_000);
    let other = h.hold("acme", &others, tokens(3_000)).await;
    let ExtendError::Denied(d) = h.extend_err(id, Some(&tokens(2_500)), None).await else {
        panic!("2,500 more tokens do not fit beside the other hold")
    };
    assert_eq!(
        (d.kind, d.scope.as_str(), d.remaining, d.requested),
        (
            DenialKind::RateLimited,
            "tenant:acme/agent:a1",
            2_000,
            2_500
        )
    );
    assert_eq!(d.retry_after_ms, Some(DEFAULT_TTL_MS));
    h.refund(other).await;

    // tokens are derived from input + output, as at reserve.
    let io = Amounts::new()
        .with(Dimension::INPUT_TOKENS, 100)
        .with(Dimension::OUTPUT_TOKENS, 50);
    let r = h.extend(id, Some(&io), None).await;
    assert_eq!(r.held.get(Dimension::TOKENS), 15_150);

    // A full concurrency gauge does not refuse an extend: it asks for no
    // more reservations, only more tokens.
    for _ in 0..7 {
        h.hold("acme", &[], Amounts::new()).await;
    }
    let r = h.extend(id, Some(&tokens(100)), None).await;
    assert_eq!(r.held.get(Dimension::TOKENS), 15_250);
}

/// Extend's TTL sets `expires_at = now + ttl_ms`, later or sooner, and the
/// reservation expires then.
pub(crate) async fn extend_ttl(h: Harness) {
    let id = h.hold("acme", &OTHERS, tokens(1000)).await;
    h.set_ms(200_000);
    let r = h.extend(id, None, Some(300_000)).await;
    assert_eq!((r.status, r.expires_at), (Status::Held, at(500_000)));
    assert_eq!(r.held, tokens(1000), "a TTL alone leaves the amounts");
    let gauge = h
        .limit("tenant:acme", "concurrent", WindowKind::Concurrent)
        .await;
    assert_eq!(
        gauge.resets_at,
        Some(at(500_000)),
        "the gauge frees at the new expiry"
    );
    h.set_ms(499_999);
    assert_eq!(
        h.get(id).await.status,
        Status::Held,
        "kept alive past its first expiry"
    );
    h.set_ms(500_000);
    assert_eq!(h.get(id).await.status, Status::Expired);
    assert_eq!(
        h.figures("tenant:acme", "tokens", WindowKind::Sliding)
            .await,
        (0, 0, 100_000)
    );

    // Amounts and TTL together; then a shorter lease.
    let id = h.hold("acme", &OTHERS, tokens(1000)).await;
    let r = h.extend(id, Some(&tokens(500)), Some(1_000)).await;
    assert_eq!((r.held.clone(), r.expires_at), (tokens(1500), at(501_000)));
    h.set_ms(501_000);
    assert_eq!(
        h.get(id).await.status,
        Status::Expired,
        "a lease can be shortened"
    );
}

/// Only a HELD reservation can be extended.
pub(crate) async fn extend_not_held(h: Harness) {
    let settled = h.hold("acme", &[], tokens(10)).await;
    h.settle(settled, &usage(tokens(10))).await;
    let refunded = h.hold("acme", &[], tokens(10)).await;
    h.refund(refunded).await;
    let mut req = h.request("acme", &[], tokens(10)).await;
    req.ttl_ms = Some(1_000);
    let expired = h.reserve(&req).await.id;
    h.set_ms(1_000);
    let before = h.statuses(&SCOPES).await;
    for (id, status) in [
        (settled, Status::Settled),
        (refunded, Status::Refunded),
        (expired, Status::Expired),
    ] {
        assert_eq!(
            h.extend_err(id, Some(&tokens(1)), Some(60_000)).await,
            ExtendError::NotHeld { status },
            "extend of a {status} reservation"
        );
        assert_eq!(h.get(id).await.status, status, "it stays {status}");
    }
    assert_eq!(h.statuses(&SCOPES).await, before);
}

/// Expiry is observed by every read, whether or not `expire_due` ran: a
/// status shows no stale hold, a get answers EXPIRED, a reserve is not
/// blocked.
pub(crate) async fn expiry_observed_by_reads(h: Harness) {
    let mut req = h.request("acme", &[], tokens(95_000)).await;
    req.ttl_ms = Some(60_000);
    let r1 = h.reserve(&req).await.id;
    h.set_ms(59_999);
    assert_eq!(
        h.figures("tenant:acme", "tokens", WindowKind::Sliding)
            .await,
        (0, 95_000, 5_000)
    );
    let d = h.deny(&h.request("acme", &[], tokens(10_000)).await).await;
    assert_eq!(d.retry_after_ms, Some(1), "the hold ends in 1 ms");

    // A status read first.
    h.set_ms(60_000);
    let t = h.status("tenant:acme").await;
    assert_eq!(t.held_reservations, 0, "a status read sees the expiry");
    assert_eq!(
        t.limits.iter().map(|l| l.held).sum::<u64>(),
        0,
        "no stale hold"
    );
    assert_eq!(h.get(r1).await.status, Status::Expired);

    // A get first.
    req.ttl_ms = Some(60_000);
    let r2 = h.reserve(&req).await.id; // the stale hold does not block it
    h.set_ms(120_000);
    assert_eq!(
        h.get(r2).await.status,
        Status::Expired,
        "a get sees the expiry"
    );
    assert_eq!(h.status("tenant:acme").await.held_reservations, 0);

    // A reserve first.
    req.ttl_ms = Some(60_000);
    let r3 = h.reserve(&req).await.id;
    h.set_ms(180_000);
    h.hold("acme", &[], tokens(100_000)).await;
    assert_eq!(h.get(r3).await.status, Status::Expired);

    let expired = h.store.expire_due().await.expect("expire_due");
    assert!(
        expired >= 3,
        "three holds expired so far, {expired} counted"
    );
    assert_eq!(
        h.get(r1).await.status,
        Status::Expired,
        "a sweep changes no answer"
    );
    assert_eq!(h.status("tenant:acme").await.held_reservations, 1);
}

/// The counters a server exports: HELD reservations (a reservation on a
/// shared scope counted once) and holds expired so far.
pub(crate) async fn stats_count_held_and_expired(h: Harness) {
    let stats = || async { h.store.stats().await.expect("stats: store unavailable") };
    assert_eq!(stats().await.held_reservations, 0);
    let mut short = h
        .request("acme", &[("tool", "search")], tokens(1_000))
        .await;
    short.ttl_ms = Some(1_000);
    let r1 = h.reserve(&short).await.id;
    let r2 = h.hold("beta", &[], tokens(1_000)).await;
    let r3 = h.hold("acme", &[], tokens(1_000)).await;
    assert_eq!(stats().await.held_reservations, 3);
    h.settle(r2, &usage(tokens(10))).await;
    h.refund(r3).await;
    assert_eq!(stats().await.held_reservations, 1);
    let before = stats().await.expired_total;
    h.set_ms(1_000);
    let after = stats().await;
    assert_eq!(after.held_reservations, 0, "the stats read observes expiry");
    assert!(after.expired_total > before, "the expiry is counted");
    assert_eq!(h.get(r1).await.status, Status::Expired);
}

/// SEMANTICS: an ended reservation is remembered for `ended_retention_ms`
/// (reads and settle replays answer), then forgotten; an idempotency key
/// binds until `idempotency_retention_ms` past the end, then the same key
/// makes a new reservation.
pub(crate) async fn ended_reservations_are_forgotten_after_retention(h: Harness) {
    // DAY_MS: both retentions of the standard catalog.
    let settled = h.hold("acme", &[], tokens(100)).await;
    h.settle(settled, &usage(tokens(80))).await;
    let mut keyed = h.request("acme", &[], tokens(50)).await;
    keyed.idempotency_key = Some("job-1".into());
    let first = h.reserve(&keyed).await;
    h.refund(first.id).await;

    h.set_ms(DAY_MS - 1);
    assert_eq!(
        h.get(settled).await.status,
        Status::Settled,
        "remembered until its retention"
    );
    let again = h.settle(settled, &usage(tokens(80))).await;
    assert_eq!(
        again.status,
        Status::Settled,
        "a settle replay still answers"
    );
    let replay = h.reserve(&keyed).await;
    assert!(
        replay.replayed && replay.id == first.id,
        "the key still names the first reservation"
    );

    h.set_ms(DAY_MS);
    let gone = h.store.get(settled).await.expect("get: store unavailable");
    assert_eq!(gone, None, "forgotten at its retention");
    assert_eq!(
        h.settle_err(settled, &usage(tokens(80))).await,
        SettleError::NotFound
    );
    let fresh = h.reserve(&keyed).await;
    assert!(
        !fresh.replayed && fresh.id != first.id,
        "past its retention the key makes a new reservation"
    );
}

/// `settle_decided` answers what `settle` answers, changes the ledger at
/// once, and becomes durable: a settle, its repeat, and a refused one.
pub(crate) async fn decided_settle_answers_as_the_plain_one(h: Harness) {
    let id = h.hold("acme", &OTHERS, tokens(1000)).await;
    let used_before = h
        .limit("tenant:acme", "tokens", WindowKind::Sliding)
        .await
        .used;

    // Settle, decided: the plain settle's reservation; a repeat the same.
    let u = usage(tokens(700));
    let (r, durable) = h
        .store
        .settle_decided(id, &u)
        .await
        .expect("a settle, decided");
    assert_eq!(r.status, Status::Settled);
    assert_eq!(h.get(id).await.status, Status::Settled, "applied at once");
    durable.wait().await.expect("durable");
    assert_eq!(h.settle(id, &u).await, r, "the plain settle repeats it");
    let (again, durable) = h.store.settle_decided(id, &u).await.expect("a repeat");
    durable.wait().await.expect("durable");
    assert_eq!(again, r);
    let l = h.limit("tenant:acme", "tokens", WindowKind::Sliding).await;
    assert_eq!((l.held, l.used), (0, used_before + 700));

    // Refused as the plain settle is: a refunded reservation conflicts.
    let refunded = h.hold("acme", &OTHERS, tokens(10)).await;
    h.store.refund(refunded).await.expect("refunded");
    let plain = h.settle_err(refunded, &u).await;
    match h.store.settle_decided(refunded, &u).await {
        Err(allowance_core::StoreError::Rejected(e)) => assert_eq!(e, plain),
        other => panic!("a refusal, got {other:?}"),
    }
}
