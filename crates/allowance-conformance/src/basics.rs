//! Reserve, settle and refund on their happy paths; all or nothing; the
//! walkthrough of seed 000.

use std::sync::Arc;

use allowance_core::{
    Amounts, CatalogChange, DenialKind, Dimension, Override, OverrunPolicy, Status, Usage,
    WindowKind,
};

use crate::Harness;
use crate::catalogs::{DAY_MS, DEFAULT_TTL_MS};
use crate::support::{at, charge, key, tokens, usage};

const ALL_FOUR: [(&str, &str); 3] = [("user", "bob"), ("agent", "a1"), ("task", "t1")];

/// A reserve holds its amounts on every scope at once (tokens derived from
/// input + output, `requests` and `concurrent` implied); a settle releases
/// the hold and records the actual usage in every window.
pub(crate) async fn reserve_settle_happy_path(h: Harness) {
    let sent = Amounts::new()
        .with(Dimension::INPUT_TOKENS, 3000)
        .with(Dimension::OUTPUT_TOKENS, 1000)
        .with(Dimension::COST_MICROS, 17_500);
    let mut req = h.request("acme", &ALL_FOUR, sent.clone()).await;
    req.labels = Some(Arc::from(vec![("team".to_string(), "search".to_string())]));
    let g = h.reserve(&req).await;
    let held = sent.clone().with(Dimension::TOKENS, 4000);
    assert_eq!(
        (g.status, g.replayed, g.dry_run),
        (Status::Held, false, false)
    );
    assert_eq!(g.held, held, "the grant holds the amounts, tokens derived");
    assert_eq!(g.expires_at, at(DEFAULT_TTL_MS), "the default TTL applies");

    let r = h.get(g.id).await;
    assert_eq!(r.id, g.id);
    assert_eq!(r.status, Status::Held);
    assert_eq!(
        r.scopes, req.scopes,
        "the reservation keeps its scopes, tenant first"
    );
    assert_eq!(r.held, held);
    assert_eq!(
        (r.created_at, r.expires_at, r.ended_at),
        (at(0), at(DEFAULT_TTL_MS), None)
    );
    assert_eq!((r.charged.as_ref(), r.late), (None, false));
    assert_eq!(
        r.overrun,
        OverrunPolicy::ChargeActual,
        "the tenant plan's policy"
    );
    assert_eq!(r.labels, req.labels, "labels are kept");
    assert_eq!(
        (r.model.as_deref(), r.idempotency_key.as_deref()),
        (None, None)
    );

    let t = "tenant:acme";
    assert_eq!(
        h.figures(t, "tokens", WindowKind::Sliding).await,
        (0, 4000, 96_000)
    );
    assert_eq!(
        h.figures(t, "cost_micros", WindowKind::Total).await,
        (0, 17_500, 9_982_500)
    );
    let conc = h.limit(t, "concurrent", WindowKind::Concurrent).await;
    assert_eq!(
        (conc.used, conc.held, conc.remaining),
        (0, 1, 7),
        "one HELD reservation"
    );
    assert_eq!(
        conc.resets_at,
        Some(at(DEFAULT_TTL_MS)),
        "the gauge frees at the expiry"
    );
    let user = "tenant:acme/user:bob";
    assert_eq!(
        h.figures(user, "requests", WindowKind::Bucket).await,
        (0, 1, 59)
    );
    let agent = h
        .limit("tenant:acme/agent:a1", "tokens", WindowKind::Calendar)
        .await;
    assert_eq!((agent.used, agent.held, agent.remaining), (0, 4000, 16_000));
    assert_eq!(
        agent.resets_at,
        Some(at(DAY_MS)),
        "a calendar day resets at midnight"
    );
    let task = "tenant:acme/task:t1";
    assert_eq!(
        h.figures(task, "cost_micros", WindowKind::Total).await,
        (0, 17_500, 982_500)
    );
    for s in [t, user, "tenant:acme/agent:a1", task] {
        assert_eq!(
            h.status(s).await.held_reservations,
            1,
            "{s} counts one HELD reservation"
        );
    }

    h.advance_ms(10_000);
    let actual = Amounts::new()
        .with(Dimension::INPUT_TOKENS, 2500)
        .with(Dimension::OUTPUT_TOKENS, 800)
        .with(Dimension::COST_MICROS, 14_000);
    let s = h.settle(g.id, &usage(actual.clone())).await;
    assert_eq!(s.status, Status::Settled);
    assert_eq!(
        s.charged,
        Some(actual.with(Dimension::TOKENS, 3300)),
        "charged actual"
    );
    assert_eq!((s.ended_at, s.late), (Some(at(10_000)), false));
    assert_eq!(
        s.held, held,
        "an ended reservation answers what it last held"
    );

    assert_eq!(
        h.figures(t, "tokens", WindowKind::Sliding).await,
        (3300, 0, 96_700)
    );
    assert_eq!(
        h.figures(t, "cost_micros", WindowKind::Total).await,
        (14_000, 0, 9_986_000)
    );
    let conc = h.limit(t, "concurrent", WindowKind::Concurrent).await;
    assert_eq!(
        (conc.used, conc.held, conc.remaining, conc.resets_at),
        (0, 0, 8, None)
    );
    assert_eq!(
        h.figures(user, "requests", WindowKind::Bucket).await,
        (1, 0, 59),
        "requests stays charged after a settle"
    );
    assert_eq!(
        h.figures("tenant:acme/agent:a1", "tokens", WindowKind::Calendar)
            .await,
        (3300, 0, 16_700)
    );
    assert_eq!(
        h.figures(task, "cost_micros", WindowKind::Total).await,
        (14_000, 0, 986_000)
    );
    for s in [t, user, "tenant:acme/agent:a1", task] {
        assert_eq!(
            h.status(s).await.held_reservations,
            0,
            "{s} holds nothing after the settle"
        );
    }
}

/// A refund releases every hold and records nothing, not even the request:
/// every scope then reads as if it had never been used.
pub(crate) async fn refund_happy_path(h: Harness) {
    let amounts = tokens(4000).with(Dimension::COST_MICROS, 20_000);
    let id = h.hold("acme", &ALL_FOUR, amounts.clone()).await;
    h.advance_ms(5_000);
    let r = h.refund(id).await;
    assert_eq!(r.status, Status::Refunded);
    assert_eq!(
        (r.ended_at, r.charged.as_ref(), r.late),
        (Some(at(5_000)), None, false)
    );
    assert_eq!(
        r.held, amounts,
        "an ended reservation answers what it last held"
    );
    assert_eq!(
        h.get(id).await,
        r,
        "a read answers what the refund answered"
    );

    // The same scopes of a tenant that never did anything, for comparison.
    for (used, fresh) in [
        ("tenant:acme", "tenant:zed"),
        ("tenant:acme/user:bob", "tenant:zed/user:bob"),
        ("tenant:acme/agent:a1", "tenant:zed/agent:a1"),
        ("tenant:acme/task:t1", "tenant:zed/task:t1"),
    ] {
        let (a, b) = (h.status(used).await, h.status(fresh).await);
        assert_eq!(
            (a.plan, a.held_reservations, a.limits),
            (b.plan, b.held_reservations, b.limits),
            "after a refund {used} reads like a scope never used"
        );
    }
}

/// A priced model derives `cost_micros` (rounded up) at reserve and at
/// settle, cached input priced apart; tool charges add cost and custom
/// dimensions, counted on the shared tool scope.
pub(crate) async fn settle_with_model_and_charges(h: Harness) {
    let catalog = h.store.catalog().await.expect("catalog");
    let search_calls = catalog.dimension("search_calls").expect("configured");
    let others = [("task", "t1"), ("tool", "search")];
    let sent = Amounts::new()
        .with(Dimension::INPUT_TOKENS, 3000)
        .with(Dimension::OUTPUT_TOKENS, 1000)
        .with(search_calls, 2);
    let mut req = h.request("acme", &others, sent.clone()).await;
    req.model = Some("gpt-4o".into());
    let g = h.reserve(&req).await;
    // 3000 × 2.50 + 1000 × 10.00 per million = 17,500 micros.
    let held = sent
        .with(Dimension::TOKENS, 4000)
        .with(Dimension::COST_MICROS, 17_500);
    assert_eq!(g.held, held, "cost derived from the model's prices");
    assert_eq!(h.get(g.id).await.model.as_deref(), Some("gpt-4o"));
    assert_eq!(
        h.figures("tool:search", "search_calls", WindowKind::Sliding)
            .await,
        (0, 2, 98)
    );

    let u = Usage {
        amounts: Amounts::new()
            .with(Dimension::INPUT_TOKENS, 3000)
            .with(Dimension::OUTPUT_TOKENS, 500),
        cached_input_tokens: 1000,
        charges: vec![charge(
            "search",
            10_000,
            Amounts::new().with(search_calls, 2),
        )],
    };
    let s = h.settle(g.id, &u).await;
    // 2000 × 2.50 + 1000 × 1.25 + 500 × 10.00 per million = 11,250, plus 10,000 of search.
    let charged = Amounts::new()
        .with(Dimension::INPUT_TOKENS, 3000)
        .with(Dimension::OUTPUT_TOKENS, 500)
        .with(Dimension::TOKENS, 3500)
        .with(Dimension::COST_MICROS, 21_250)
        .with(search_calls, 2);
    assert_eq!(s.charged, Some(charged));
    assert_eq!(
        h.figures("tenant:acme", "cost_micros", WindowKind::Total)
            .await,
        (21_250, 0, 9_978_750)
    );
    assert_eq!(
        h.figures("tenant:acme/task:t1", "cost_micros", WindowKind::Total)
            .await,
        (21_250, 0, 978_750)
    );
    assert_eq!(
        h.figures("tool:search", "search_calls", WindowKind::Sliding)
            .await,
        (2, 0, 98)
    );

    // An explicit cost wins over the model's prices.
    let mut req = h
        .request(
            "acme",
            &[],
            tokens(100).with(Dimension::COST_MICROS, 50_000),
        )
        .await;
    req.model = Some("gpt-4o".into());
    let g = h.reserve(&req).await;
    assert_eq!(
        g.held.get(Dimension::COST_MICROS),
        50_000,
        "cost given, not derived"
    );
}

/// The overrun policy of the tenant's plan decides what a settle above the
/// estimate records: the actual, the estimate, or the estimate + 10 %, per
/// dimension, tokens derived again; tool charges are never capped.
pub(crate) async fn overrun_policies(h: Harness) {
    let catalog = h.store.catalog().await.expect("catalog");
    let search_calls = catalog.dimension("search_calls").expect("configured");
    for (tenant, plan) in [("capped", "tenant-capped"), ("lenient", "tenant-lenient")] {
        let change = CatalogChange::SetOverride(
            key(&format!("tenant:{tenant}")),
            Override::Plan(plan.into()),
        );
        h.store
            .change_catalog(&change)
            .await
            .expect("override the tenant's plan");
    }
    let estimate = Amounts::new()
        .with(Dimension::INPUT_TOKENS, 1000)
        .with(Dimension::OUTPUT_TOKENS, 1000);
    let actual = Usage {
        amounts: Amounts::new()
            .with(Dimension::INPUT_TOKENS, 1500)
            .with(Dimension::OUTPUT_TOKENS, 1200),
        cached_input_tokens: 0,
        charges: vec![charge(
            "search",
            5_000,
            Amounts::new().with(search_calls, 3),
        )],
    };
    let cases = [
        ("honest", OverrunPolicy::ChargeActual, (1500, 1200, 2700)),
        ("capped", OverrunPolicy::CapAtEstimate, (1000, 1000, 2000)),
        (
            "lenient",
            OverrunPolicy::AllowOverrun { percent: 10 },
            (1100, 1100, 2200),
        ),
    ];
    for (i, (tenant, policy, (input, output, total))) in cases.into_iter().enumerate() {
        let id = h
            .hold(tenant, &[("tool", "search")], estimate.clone())
            .await;
        let s = h.settle(id, &actual).await;
        assert_eq!(
            s.overrun, policy,
            "{tenant}: the policy is fixed at reserve"
        );
        let want = Amounts::new()
            .with(Dimension::INPUT_TOKENS, input)
            .with(Dimension::OUTPUT_TOKENS, output)
            .with(Dimension::TOKENS, total)
            .with(Dimension::COST_MICROS, 5_000)
            .with(search_calls, 3);
        assert_eq!(s.charged, Some(want), "{tenant}: what {policy:?} records");
        let scope = format!("tenant:{tenant}");
        assert_eq!(
            h.figures(&scope, "tokens", WindowKind::Sliding).await.0,
            total as i64,
            "{tenant}: the window records what was charged"
        );
        assert_eq!(
            h.figures("tool:search", "search_calls", WindowKind::Sliding)
                .await
                .0,
            3 * (i as i64 + 1),
            "tool charges are never capped, and the shared scope counts every tenant"
        );
    }
}

/// A refusal anywhere changes nothing anywhere: not at the tenant when a
/// later scope refuses, not at the other scopes when the tenant refuses.
pub(crate) async fn all_or_nothing(h: Harness) {
    let catalog = h.store.catalog().await.expect("catalog");
    let search_calls = catalog.dimension("search_calls").expect("configured");
    let others = [
        ("user", "bob"),
        ("agent", "a1"),
        ("task", "t1"),
        ("tool", "search"),
    ];
    let names = [
        "tenant:acme",
        "tenant:acme/user:bob",
        "tenant:acme/agent:a1",
        "tenant:acme/task:t1",
        "tool:search",
    ];
    // The tenant's budget is nearly all held by another call.
    h.hold(
        "acme",
        &[],
        Amounts::new().with(Dimension::COST_MICROS, 9_500_000),
    )
    .await;
    let before = h.statuses(&names).await;

    let fits_all_but_tenant = Amounts::new()
        .with(Dimension::TOKENS, 1000)
        .with(Dimension::COST_MICROS, 600_000)
        .with(search_calls, 1);
    let req = h.request("acme", &others, fits_all_but_tenant).await;
    let d = h.deny(&req).await;
    assert_eq!(
        (d.scope.as_str(), d.dimension.as_str(), d.kind),
        ("tenant:acme", "cost_micros", DenialKind::RateLimited),
        "the tenant refuses"
    );
    assert_eq!(
        h.statuses(&names).await,
        before,
        "a refusal at the tenant changes no scope"
    );

    let fits_all_but_tool = Amounts::new()
        .with(Dimension::TOKENS, 1000)
        .with(search_calls, 101);
    let req = h.request("acme", &others, fits_all_but_tool).await;
    let d = h.deny(&req).await;
    assert_eq!(
        (d.scope.as_str(), d.kind),
        ("tool:search", DenialKind::ExceedsLimit),
        "the last scope refuses"
    );
    assert_eq!(
        h.statuses(&names).await,
        before,
        "a refusal at the last scope changes none"
    );

    let fits = Amounts::new()
        .with(Dimension::TOKENS, 1000)
        .with(Dimension::COST_MICROS, 400_000)
        .with(search_calls, 1);
    let req = h.request("acme", &others, fits).await;
    h.reserve(&req).await;
    let after = h.statuses(&names).await;
    let held: Vec<u64> = after.iter().map(|s| s.held_reservations).collect();
    assert_eq!(
        held,
        [2, 1, 1, 1, 1],
        "a grant holds on every scope it names"
    );
}

/// Seed 000, figure for figure, through the store on its clock: agents may
/// use 1,000 tokens an hour, the tenant 1,500, holds last 5 minutes.
pub(crate) async fn seed_000_walkthrough(h: Harness) {
    let remaining = |scope: &'static str| {
        let h = h.clone();
        async move { h.figures(scope, "tokens", WindowKind::Sliding).await.2 }
    };
    let req = |agent: &'static str, estimate: u64| {
        let h = h.clone();
        async move { h.request("t", &[("agent", agent)], tokens(estimate)).await }
    };

    let r1 = h.reserve(&req("a1", 1000).await).await.id;
    assert_eq!(remaining("tenant:t/agent:a1").await, 0);
    assert_eq!(remaining("tenant:t").await, 500);

    // The agent has room, the tenant does not: refused at the tenant, and
    // the other agent is untouched.
    let d = h.deny(&req("a2", 600).await).await;
    assert_eq!(
        (d.scope.as_str(), d.kind),
        ("tenant:t", DenialKind::RateLimited)
    );
    assert_eq!((d.capacity, d.remaining, d.requested), (1500, 500, 600));
    assert_eq!(
        d.retry_after_ms,
        Some(300_000),
        "holds alone block: retry when the earliest hold expires"
    );
    assert_eq!(remaining("tenant:t/agent:a2").await, 1000);

    let first = h.settle(r1, &usage(tokens(700))).await;
    let again = h.settle(r1, &usage(tokens(700))).await;
    assert_eq!(first, again, "a settle repeated answers the same");
    assert_eq!(first.status, Status::Settled);
    assert_eq!(remaining("tenant:t/agent:a1").await, 300);
    assert_eq!(remaining("tenant:t").await, 800);

    let r2 = h.reserve(&req("a1", 100).await).await.id;
    assert_eq!(h.refund(r2).await.status, Status::Refunded);
    assert_eq!(h.refund(r2).await.status, Status::Refunded);
    assert_eq!(remaining("tenant:t/agent:a1").await, 300);

    let r3 = h.reserve(&req("a1", 200).await).await.id;
    h.set_ms(301_000); // the agent crashed: its hold expires
    assert_eq!(remaining("tenant:t/agent:a1").await, 300);
    assert_eq!(h.get(r3).await.status, Status::Expired);
    let late = h.settle(r3, &usage(tokens(50))).await; // real usage, recorded once
    assert!(late.late, "a settle after expiry is flagged late");
    assert_eq!(late.status, Status::Settled);
    assert_eq!(remaining("tenant:t/agent:a1").await, 250);
    assert_eq!(remaining("tenant:t").await, 750);

    h.set_ms(4_000_000); // everything has left the window
    assert_eq!(remaining("tenant:t/agent:a1").await, 1000);
    assert_eq!(remaining("tenant:t").await, 1500);
}
