//! The walkthrough of seed 000 (`__main__`), figure for figure, on a manual
//! clock: an agent limit of 1,000 and a tenant limit of 1,500 tokens per
//! hour (60 slices), holds of 5 minutes.

use allowance_core::*;

struct World {
    ledger: Ledger,
    now_ms: u64,
    next_id: u128,
}

impl World {
    fn new() -> Self {
        let hour = Window::Sliding {
            period_ms: 3_600_000,
            slices: 60,
        };
        let mut c = Catalog::new(Settings {
            default_ttl_ms: 300_000,
            ..Settings::default()
        })
        .unwrap();
        let plan = |name: &str, cap| {
            Plan::new(
                name,
                vec![Limit::new(Dimension::TOKENS, cap, hour.clone()).unwrap()],
                OverrunPolicy::ChargeActual,
            )
            .unwrap()
        };
        c.set_plan(plan("tenant", 1500));
        c.set_plan(plan("agent", 1000));
        c.set_kind("tenant", Some("tenant"), false).unwrap();
        c.set_kind("agent", Some("agent"), false).unwrap();
        World {
            ledger: Ledger::new(c),
            now_ms: 0,
            next_id: 1,
        }
    }

    fn now(&self) -> Timestamp {
        Timestamp::from_millis(self.now_ms)
    }

    fn reserve(
        &mut self,
        agent: &str,
        tenant: &str,
        estimate: u64,
    ) -> Result<ReservationId, ReserveError> {
        let scopes = self
            .ledger
            .catalog()
            .scope_set(tenant, &[("agent", agent)])
            .unwrap();
        let id = ReservationId(self.next_id);
        self.next_id += 1;
        let req = ReserveRequest::new(scopes, Amounts::new().with(Dimension::TOKENS, estimate));
        self.ledger.reserve(self.now(), id, &req).map(|g| g.id)
    }

    fn settle(&mut self, id: ReservationId, actual: u64) -> Reservation {
        let usage = Usage {
            amounts: Amounts::new().with(Dimension::TOKENS, actual),
            ..Usage::default()
        };
        self.ledger.settle(self.now(), id, &usage).unwrap().clone()
    }

    fn remaining(&mut self, scope: &str) -> i64 {
        let key = ScopeKey::parse(scope).unwrap();
        let status = self.ledger.status(self.now(), &key);
        self.ledger.check_invariants().unwrap();
        status.limits[0].remaining
    }
}

#[test]
fn seed_000_walkthrough() {
    let mut w = World::new();
    let r1 = w.reserve("a1", "t", 1000).unwrap();
    assert_eq!(w.remaining("tenant:t/agent:a1"), 0);
    assert_eq!(w.remaining("tenant:t"), 500);

    // The agent has room, the tenant does not: refused at the tenant,
    // and the agent is untouched.
    let Err(ReserveError::Denied(d)) = w.reserve("a2", "t", 600) else {
        panic!("expected a denial")
    };
    assert_eq!(d.scope.as_str(), "tenant:t");
    assert_eq!(d.kind, DenialKind::RateLimited);
    assert_eq!((d.capacity, d.remaining, d.requested), (1500, 500, 600));
    // Holds alone block: retry when the earliest hold expires (5 minutes).
    assert_eq!(d.retry_after_ms, Some(300_000));
    assert_eq!(w.remaining("tenant:t/agent:a2"), 1000);

    let first = w.settle(r1, 700);
    let again = w.settle(r1, 700); // idempotent
    assert_eq!(first, again);
    assert_eq!(first.status, Status::Settled);
    assert_eq!(w.remaining("tenant:t/agent:a1"), 300);
    assert_eq!(w.remaining("tenant:t"), 800);

    let r2 = w.reserve("a1", "t", 100).unwrap();
    let now = w.now();
    assert_eq!(w.ledger.refund(now, r2).unwrap().status, Status::Refunded);
    assert_eq!(w.ledger.refund(now, r2).unwrap().status, Status::Refunded);
    assert_eq!(w.remaining("tenant:t/agent:a1"), 300);

    let r3 = w.reserve("a1", "t", 200).unwrap();
    w.now_ms = 301_000; // the agent crashed: its hold expires
    assert_eq!(w.remaining("tenant:t/agent:a1"), 300);
    let now = w.now();
    assert_eq!(w.ledger.get(now, r3).unwrap().status, Status::Expired);
    let late = w.settle(r3, 50); // a late settle records real usage once
    assert!(late.late);
    assert_eq!(late.status, Status::Settled);
    assert_eq!(w.remaining("tenant:t/agent:a1"), 250);
    assert_eq!(w.remaining("tenant:t"), 750);

    w.now_ms = 4_000_000; // everything has left the window
    assert_eq!(w.remaining("tenant:t/agent:a1"), 1000);
    assert_eq!(w.remaining("tenant:t"), 1500);
}
