//! Bad inputs answer `Invalid` naming the field, before anything changes.

use std::sync::Arc;

use allowance_core::{
    AdminError, Amounts, Catalog, Dimension, ExtendError, MAX_AMOUNT, Settings, SettleError,
    Status, StoreError, Usage,
};

use crate::Harness;
use crate::support::{charge, key, tokens, usage};

const SCOPES: [&str; 3] = ["tenant:acme", "tenant:acme/agent:a1", "tool:search"];
const TOO_LARGE: u64 = MAX_AMOUNT + 1;

/// Every malformed reserve is refused with the field it got wrong, holds
/// nothing, and binds no idempotency key.
pub(crate) async fn invalid_reserve_changes_nothing(h: Harness) {
    h.spend("acme", &[("agent", "a1")], tokens(100)).await;
    let before = h.statuses(&SCOPES).await;
    let base = h.request("acme", &[("agent", "a1")], tokens(100)).await;
    let with = |f: &dyn Fn(&mut allowance_core::ReserveRequest)| {
        let mut r = base.clone();
        f(&mut r);
        r
    };
    let many_labels: Vec<(String, String)> = (0..17)
        .map(|i| (format!("k{i}"), "v".to_string()))
        .collect();
    let cases = [
        ("amounts.tokens", with(&|r| r.amounts = tokens(TOO_LARGE))),
        ("ttl_ms", with(&|r| r.ttl_ms = Some(0))),
        ("ttl_ms", with(&|r| r.ttl_ms = Some(3_600_001))),
        (
            "idempotency_key",
            with(&|r| r.idempotency_key = Some("".into())),
        ),
        (
            "idempotency_key",
            with(&|r| r.idempotency_key = Some("k".repeat(201).into())),
        ),
        (
            "idempotency_key",
            with(&|r| {
                r.idempotency_key = Some("dry".into());
                r.dry_run = true;
            }),
        ),
        (
            "labels",
            with(&|r| r.labels = Some(Arc::from(many_labels.clone()))),
        ),
        (
            "labels.team",
            with(&|r| r.labels = Some(Arc::from(vec![("team".into(), "x".repeat(257))]))),
        ),
        // An unpriced model on a scope that limits cost would spend for free.
        ("model", with(&|r| r.model = Some("mystery-model".into()))),
    ];
    for (field, req) in cases {
        assert_eq!(h.reserve_invalid(&req).await, field, "the field named");
        assert_eq!(
            h.statuses(&SCOPES).await,
            before,
            "an invalid {field} changes nothing"
        );
    }

    // More scopes than the store allows, built by a more permissive catalog.
    let mut wide = Catalog::new(Settings {
        max_scopes: 16,
        ..Settings::default()
    })
    .expect("valid settings");
    wide.set_kind("agent", None, false).expect("a valid kind");
    let ids: Vec<String> = (0..8).map(|i| format!("a{i}")).collect();
    let nine: Vec<(&str, &str)> = ids.iter().map(|id| ("agent", id.as_str())).collect();
    let req = allowance_core::ReserveRequest::new(
        wide.scope_set("acme", &nine)
            .expect("nine scopes fit the wide catalog"),
        tokens(1),
    );
    assert_eq!(h.reserve_invalid(&req).await, "scopes", "at most 8 scopes");
    assert_eq!(h.statuses(&SCOPES).await, before);

    // The key of an invalid attempt stays free.
    let mut keyed = with(&|r| r.ttl_ms = Some(0));
    keyed.idempotency_key = Some("first-try".into());
    h.reserve_invalid(&keyed).await;
    keyed.ttl_ms = None;
    assert!(
        !h.reserve(&keyed).await.replayed,
        "an invalid attempt bound no key"
    );
}

/// A malformed settle is refused with the field it got wrong; the
/// reservation stays HELD and nothing is recorded.
pub(crate) async fn invalid_settle_changes_nothing(h: Harness) {
    let catalog = h.store.catalog().await.expect("catalog");
    let search_calls = catalog.dimension("search_calls").expect("configured");
    let id = h
        .hold("acme", &[("agent", "a1"), ("tool", "search")], tokens(1000))
        .await;
    let held = h.get(id).await;
    let before = h.statuses(&SCOPES).await;
    let with_charges = |charges| Usage {
        amounts: tokens(10),
        cached_input_tokens: 0,
        charges,
    };
    let cases = [
        ("usage.tokens", usage(tokens(TOO_LARGE))),
        (
            "usage.cached_input_tokens",
            Usage {
                cached_input_tokens: TOO_LARGE,
                ..usage(tokens(10))
            },
        ),
        (
            "charges",
            with_charges(
                (0..65)
                    .map(|_| charge("search", 1, Amounts::new()))
                    .collect(),
            ),
        ),
        (
            "charges[0].name",
            with_charges(vec![charge("", 1, Amounts::new())]),
        ),
        (
            "charges[0].name",
            with_charges(vec![charge(&"n".repeat(65), 1, Amounts::new())]),
        ),
        (
            "charges[0].cost_micros",
            with_charges(vec![charge("search", TOO_LARGE, Amounts::new())]),
        ),
        (
            "charges[1].amounts.search_calls",
            with_charges(vec![
                charge("search", 1, Amounts::new()),
                charge("search", 1, Amounts::new().with(search_calls, TOO_LARGE)),
            ]),
        ),
    ];
    for (field, u) in cases {
        match h.settle_err(id, &u).await {
            SettleError::Invalid(i) => assert_eq!(i.field, field, "the field named"),
            other => panic!("a settle with a bad {field} should be invalid, got {other:?}"),
        }
        assert_eq!(h.get(id).await, held, "still HELD as it was");
        assert_eq!(
            h.statuses(&SCOPES).await,
            before,
            "a bad {field} records nothing"
        );
    }
    let s = h.settle(id, &usage(tokens(900))).await;
    assert_eq!(s.status, Status::Settled, "a valid settle still works");
}

/// A malformed extend or adjust is refused with the field it got wrong.
pub(crate) async fn invalid_extend_and_adjust(h: Harness) {
    let id = h.hold("acme", &[("agent", "a1")], tokens(1000)).await;
    let held = h.get(id).await;
    let before = h.statuses(&SCOPES).await;
    let (one, big) = (tokens(1), tokens(TOO_LARGE));
    let cases: [(&str, Option<&Amounts>, Option<u64>); 4] = [
        ("amounts", None, None),
        ("ttl_ms", None, Some(0)),
        ("ttl_ms", Some(&one), Some(3_600_001)),
        ("amounts.tokens", Some(&big), None),
    ];
    for (field, amounts, ttl_ms) in cases {
        match h.extend_err(id, amounts, ttl_ms).await {
            ExtendError::Invalid(i) => assert_eq!(i.field, field, "the field named"),
            other => panic!("an extend with a bad {field} should be invalid, got {other:?}"),
        }
        assert_eq!(h.get(id).await, held, "still HELD as it was");
        assert_eq!(h.statuses(&SCOPES).await, before);
    }

    let tenant = key("tenant:acme");
    match h
        .store
        .adjust(
            &tenant,
            Dimension::COST_MICROS,
            TOO_LARGE as i64,
            "conformance",
        )
        .await
    {
        Err(StoreError::Rejected(AdminError::Invalid(i))) => assert_eq!(i.field, "amount"),
        other => panic!("an adjust above 2^53 should be invalid, got {other:?}"),
    }
    for bad in ["tenant:acme/team:x", "tenant:acme/tool:search", "agent:a1"] {
        match h
            .store
            .adjust(&key(bad), Dimension::COST_MICROS, 1, "conformance")
            .await
        {
            Err(StoreError::Rejected(AdminError::Invalid(_))) => {}
            other => panic!("an adjust on {bad} should be invalid, got {other:?}"),
        }
    }
    assert_eq!(h.statuses(&SCOPES).await, before);
}
