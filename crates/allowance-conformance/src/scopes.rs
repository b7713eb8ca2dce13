//! Shared scopes, and scopes never used.

use allowance_core::{
    Amounts, CalendarUnit, DenialKind, LimitStatus, Status, Window, WindowKind, Zone,
};

use crate::Harness;
use crate::catalogs::{DAY_MS, DEFAULT_TTL_MS, HOUR_MS, MINUTE_MS};
use crate::support::{at, usage};

/// A shared scope (`tool:search`) counts every tenant's holds and usage;
/// each tenant's own scopes count only its own.
pub(crate) async fn shared_scope_counts_everybody(h: Harness) {
    let catalog = h.store.catalog().await.expect("catalog");
    let calls = |n| {
        let search_calls = catalog.dimension("search_calls").expect("configured");
        Amounts::new().with(search_calls, n)
    };
    let search = [("tool", "search")];
    let acme = h.hold("acme", &search, calls(60)).await;
    let d = h.deny(&h.request("beta", &search, calls(50)).await).await;
    assert_eq!(
        (d.kind, d.scope.as_str(), d.dimension.as_str(), d.window),
        (
            DenialKind::RateLimited,
            "tool:search",
            "search_calls",
            WindowKind::Sliding
        ),
        "another tenant's hold counts on the shared scope"
    );
    assert_eq!(
        (d.capacity, d.remaining, d.requested, d.retry_after_ms),
        (100, 40, 50, Some(DEFAULT_TTL_MS))
    );
    let beta = h.hold("beta", &search, calls(40)).await;
    let tool = h.status("tool:search").await;
    assert_eq!(tool.held_reservations, 2);
    assert_eq!((tool.limits[0].held, tool.limits[0].remaining), (100, 0));
    assert_eq!(
        h.status("tenant:beta").await.held_reservations,
        1,
        "its own only"
    );

    h.set_ms(1_000);
    h.settle(acme, &usage(calls(60))).await;
    assert_eq!(
        h.figures("tool:search", "search_calls", WindowKind::Sliding)
            .await,
        (60, 40, 0)
    );
    h.refund(beta).await;
    assert_eq!(
        h.figures("tool:search", "search_calls", WindowKind::Sliding)
            .await,
        (60, 0, 40)
    );

    // Another tenant's hold on the shared scope expires like any other.
    let mut req = h.request("gamma", &search, calls(40)).await;
    req.ttl_ms = Some(10_000);
    let gamma = h.reserve(&req).await.id;
    h.set_ms(11_000);
    assert_eq!(
        h.figures("tool:search", "search_calls", WindowKind::Sliding)
            .await,
        (60, 0, 40),
        "the expired hold left the shared scope"
    );
    assert_eq!(h.status("tenant:gamma").await.held_reservations, 0);
    assert_eq!(h.get(gamma).await.status, Status::Expired);

    // Usage leaves the one-minute window: second 1 leaves at 61 s.
    h.set_ms(61_000);
    assert_eq!(
        h.figures("tool:search", "search_calls", WindowKind::Sliding)
            .await,
        (0, 0, 100)
    );

    // Ten tenants of ten calls fill it; the eleventh waits.
    for i in 0..10 {
        h.spend(&format!("t{i}"), &search, calls(10)).await;
    }
    let d = h.deny(&h.request("t10", &search, calls(1)).await).await;
    assert_eq!((d.scope.as_str(), d.remaining), ("tool:search", 0));
}

/// A scope never used answers its plan's limits with zero use: every
/// capacity whole, nothing held, a reset instant only for calendar windows.
pub(crate) async fn unused_scope_answers_its_plan(h: Harness) {
    let fresh = |dimension: &str, capacity: u64, window: Window, resets_at| LimitStatus {
        dimension: dimension.to_string(),
        window,
        capacity,
        used: 0,
        held: 0,
        remaining: capacity as i64,
        resets_at,
    };
    let day = Window::Calendar {
        unit: CalendarUnit::Day,
        zone: Zone::utc(),
    };
    h.set_ms(HOUR_MS + 1);
    let expected = [
        (
            "tenant:nobody",
            "tenant",
            vec![
                fresh(
                    "tokens",
                    100_000,
                    Window::Sliding {
                        period_ms: HOUR_MS,
                        slices: 60,
                    },
                    None,
                ),
                fresh("cost_micros", 10_000_000, Window::Total, None),
                fresh("concurrent", 8, Window::Concurrent, None),
            ],
        ),
        (
            "tenant:nobody/user:u",
            "user",
            vec![fresh(
                "requests",
                60,
                Window::Bucket {
                    period_ms: MINUTE_MS,
                },
                None,
            )],
        ),
        (
            "tenant:nobody/agent:a",
            "agent",
            vec![fresh("tokens", 20_000, day, Some(at(DAY_MS)))],
        ),
        (
            "tenant:nobody/task:t",
            "task",
            vec![fresh("cost_micros", 1_000_000, Window::Total, None)],
        ),
        (
            "tool:never-called",
            "tool",
            vec![fresh(
                "search_calls",
                100,
                Window::Sliding {
                    period_ms: MINUTE_MS,
                    slices: 60,
                },
                None,
            )],
        ),
    ];
    for (scope, plan, limits) in expected {
        let st = h.status(scope).await;
        assert_eq!(st.scope.as_str(), scope, "the status names its scope");
        assert_eq!(st.plan, plan, "{scope} is on its kind's plan");
        assert_eq!(st.held_reservations, 0);
        assert_eq!(st.limits, limits, "{scope} answers its plan with zero use");
    }
}
