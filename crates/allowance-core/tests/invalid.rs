//! Every invalid input is a typed error naming the offending field, and a
//! refused ledger operation changes nothing: around each one the runner
//! compares the full observable state (the status of every scope in use,
//! `get` of every reservation, and the reservation, scope and hold counts)
//! before and after. Each boundary value is shown passing next to the first
//! value that fails (2^53 passes, 2^53 + 1 does not).

use allowance_core::*;

/// The largest accepted amount, and the first refused one.
const MAX: u64 = MAX_AMOUNT;
const OVER: u64 = MAX_AMOUNT + 1;
const TTL_MAX_MS: u64 = 3_600_000;

// ============================================================================
// The fixture: a ledger with a reservation in every state
// ============================================================================

/// The configuration: a tenant plan with tokens, cost and concurrency, an
/// agent plan, a shared tool, a priced model and two custom dimensions.
fn catalog() -> Catalog {
    let mut c = Catalog::default();
    let search = c.add_dimension("search_calls").unwrap();
    c.add_dimension("ocr_pages").unwrap();
    let minute = || Window::Sliding {
        period_ms: 60_000,
        slices: 60,
    };
    let plan = |name: &str, limits: Vec<Limit>| {
        Plan::new(name, limits, OverrunPolicy::ChargeActual).unwrap()
    };
    c.set_plan(plan(
        "tenant",
        vec![
            Limit::new(Dimension::TOKENS, 1000, minute()).unwrap(),
            Limit::new(Dimension::COST_MICROS, 1_000_000, Window::Total).unwrap(),
            Limit::new(Dimension::CONCURRENT, 10, Window::Concurrent).unwrap(),
        ],
    ));
    c.set_plan(plan(
        "agent",
        vec![Limit::new(Dimension::TOKENS, 500, minute()).unwrap()],
    ));
    c.set_plan(plan(
        "tool",
        vec![Limit::new(search, 100, minute()).unwrap()],
    ));
    c.set_kind("tenant", Some("tenant"), false).unwrap();
    c.set_kind("agent", Some("agent"), false).unwrap();
    c.set_kind("tool", Some("tool"), true).unwrap();
    let gpt = ModelPrice {
        input_micros_per_million: 2_500_000,
        cached_input_micros_per_million: 1_250_000,
        output_micros_per_million: 10_000_000,
        max_output_tokens: 4096,
        tokenizer: "o200k_base".into(),
    };
    c.set_model("gpt", gpt).unwrap();
    c
}

struct Fixture {
    ledger: Ledger,
    now: Timestamp,
    scopes: ScopeSet,
    /// HELD, with an idempotency key.
    held: ReservationId,
    settled: ReservationId,
    refunded: ReservationId,
    expired: ReservationId,
    /// Never used.
    unknown: ReservationId,
}

/// Everything a caller can observe.
type Snapshot = (Vec<ScopeStatus>, Vec<Option<Reservation>>, [usize; 3]);

fn fixture() -> Fixture {
    let mut ledger = Ledger::new(catalog());
    let t0 = Timestamp::from_millis(1_000);
    let scopes = ledger
        .catalog()
        .scope_set("t", &[("agent", "a"), ("tool", "search")])
        .unwrap();
    let search = ledger.catalog().dimension("search_calls").unwrap();
    let amounts = Amounts::new().with(Dimension::TOKENS, 100).with(search, 1);
    let mut req = ReserveRequest::new(scopes.clone(), amounts);
    let ids = [1, 2, 3, 4].map(ReservationId);
    for id in ids {
        req.idempotency_key = (id == ids[0]).then(|| "k".into());
        req.ttl_ms = Some(if id == ids[3] { 1 } else { TTL_MAX_MS });
        ledger.reserve(t0, id, &req).unwrap();
    }
    let used = Usage {
        amounts: Amounts::new().with(Dimension::TOKENS, 50),
        ..Usage::default()
    };
    ledger.settle(t0, ids[1], &used).unwrap();
    ledger.refund(t0, ids[2]).unwrap();
    let now = Timestamp::from_millis(10_000);
    let mut f = Fixture {
        ledger,
        now,
        scopes,
        held: ids[0],
        settled: ids[1],
        refunded: ids[2],
        expired: ids[3],
        unknown: ReservationId(99),
    };
    let states = [ids[0], ids[1], ids[2], ids[3]].map(|id| f.ledger.get(now, id).unwrap().status);
    assert_eq!(
        states,
        [
            Status::Held,
            Status::Settled,
            Status::Refunded,
            Status::Expired
        ]
    );
    f
}

impl Fixture {
    fn snapshot(&mut self) -> Snapshot {
        let now = self.now;
        let statuses = self
            .scopes
            .as_slice()
            .iter()
            .map(|k| self.ledger.status(now, k))
            .collect();
        let ids = [
            self.held,
            self.settled,
            self.refunded,
            self.expired,
            self.unknown,
        ];
        let res = ids
            .iter()
            .map(|&id| self.ledger.get(now, id).cloned())
            .collect();
        let counts = [
            self.ledger.reservation_count(),
            self.ledger.scope_count(),
            self.ledger.held_count(),
        ];
        (statuses, res, counts)
    }

    /// Runs `op` and asserts that it changed nothing observable.
    fn unchanged<T>(&mut self, what: &str, op: impl FnOnce(&mut Ledger, Timestamp) -> T) -> T {
        let before = self.snapshot();
        let out = op(&mut self.ledger, self.now);
        assert_eq!(before, self.snapshot(), "{what}: changed the ledger");
        self.ledger
            .check_invariants()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        out
    }

    fn dim(&self, name: &str) -> Dimension {
        self.ledger.catalog().dimension(name).unwrap()
    }

    /// A valid request on the fixture's scopes.
    fn request(&self) -> ReserveRequest {
        ReserveRequest::new(
            self.scopes.clone(),
            Amounts::new().with(Dimension::TOKENS, 10),
        )
    }
}

fn field_of<T: std::fmt::Debug>(what: &str, r: Result<T, ReserveError>) -> String {
    match r {
        Err(ReserveError::Invalid(e)) => e.field,
        other => panic!("{what}: expected an invalid input, got {other:?}"),
    }
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect::<Vec<_>>()
        .into()
}

// ============================================================================
// reserve
// ============================================================================

/// Each malformed reserve names its field and changes nothing.
#[test]
fn invalid_reserves_name_the_field_and_change_nothing() {
    let mut f = fixture();
    let search = f.dim("search_calls");
    let long_key = "k".repeat(MAX_LABEL_KEY_LEN + 1);
    let long_key_field = format!("labels.{long_key}");
    let seventeen: Vec<(String, String)> = (0..17).map(|i| (format!("l{i}"), "v".into())).collect();
    // A scope set of 9 built by a catalog allowing more: the ledger's own
    // bound (8, the tenant included) still refuses it.
    let nine = {
        let mut c = Catalog::new(Settings {
            max_scopes: 16,
            ..Settings::default()
        })
        .unwrap();
        c.set_kind("agent", None, false).unwrap();
        let ids: Vec<String> = (0..8).map(|i| format!("a{i}")).collect();
        let pairs: Vec<(&str, &str)> = ids.iter().map(|i| ("agent", i.as_str())).collect();
        c.scope_set("t", &pairs).unwrap()
    };
    // A dimension the ledger's catalog never registered (another catalog's).
    let foreign = {
        let mut c = catalog();
        c.add_dimension("x").unwrap();
        c.add_dimension("y").unwrap()
    };
    type Edit = Box<dyn Fn(&mut ReserveRequest)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "tokens above 2^53",
            Box::new(|r| r.amounts.set(Dimension::TOKENS, OVER)),
            "amounts.tokens",
        ),
        (
            "a custom amount above 2^53",
            Box::new(move |r| r.amounts.set(search, u64::MAX)),
            "amounts.search_calls",
        ),
        (
            "an unknown dimension",
            Box::new(move |r| r.amounts.set(foreign, 1)),
            "amounts",
        ),
        ("ttl 0", Box::new(|r| r.ttl_ms = Some(0)), "ttl_ms"),
        (
            "ttl above the maximum",
            Box::new(|r| r.ttl_ms = Some(TTL_MAX_MS + 1)),
            "ttl_ms",
        ),
        (
            "an empty idempotency key",
            Box::new(|r| r.idempotency_key = Some("".into())),
            "idempotency_key",
        ),
        (
            "a 201-character idempotency key",
            Box::new(|r| r.idempotency_key = Some("k".repeat(201).into())),
            "idempotency_key",
        ),
        (
            "a 201-character idempotency key of two-byte characters",
            Box::new(|r| r.idempotency_key = Some("é".repeat(201).into())),
            "idempotency_key",
        ),
        (
            "an idempotency key on a dry run",
            Box::new(|r| {
                r.idempotency_key = Some("fresh".into());
                r.dry_run = true;
            }),
            "idempotency_key",
        ),
        (
            "17 labels",
            Box::new(move |r| r.labels = Some(seventeen.clone().into())),
            "labels",
        ),
        (
            "a 65-byte label key",
            Box::new(move |r| r.labels = Some(labels(&[(&long_key, "v")]))),
            &long_key_field,
        ),
        (
            "a 257-byte label value",
            Box::new(|r| r.labels = Some(labels(&[("k", &"v".repeat(257))]))),
            "labels.k",
        ),
        (
            "an empty label key",
            Box::new(|r| r.labels = Some(labels(&[("", "v")]))),
            "labels.",
        ),
        (
            "an unpriced model where a scope limits cost",
            Box::new(|r| r.model = Some("mystery".into())),
            "model",
        ),
        (
            "more scopes than max_scopes",
            Box::new(move |r| r.scopes = nine.clone()),
            "scopes",
        ),
    ];
    for (what, edit, field) in cases {
        let mut req = f.request();
        edit(&mut req);
        let id = ReservationId(1000);
        let got = f.unchanged(what, |l, now| l.reserve(now, id, &req));
        assert_eq!(field_of(what, got), field, "{what}");
    }
}

/// The boundary values themselves pass: an amount of exactly 2^53, a ttl of
/// exactly the maximum, a 200-character key (of two-byte characters), 16 labels with a 64-byte key
/// and a 256-byte value.
#[test]
fn boundary_values_are_accepted() {
    let mut f = fixture();
    let pages = f.dim("ocr_pages"); // limited by no plan
    let mut req = f.request();
    req.amounts.set(pages, MAX);
    req.ttl_ms = Some(TTL_MAX_MS);
    // Characters, not bytes: 200 two-byte characters are 400 bytes.
    req.idempotency_key = Some("é".repeat(MAX_IDEMPOTENCY_KEY_LEN).into());
    let mut ls: Vec<(String, String)> = (0..15).map(|i| (format!("l{i}"), "v".into())).collect();
    ls.push((
        "k".repeat(MAX_LABEL_KEY_LEN),
        "v".repeat(MAX_LABEL_VALUE_LEN),
    ));
    req.labels = Some(ls.into());
    let g = f.ledger.reserve(f.now, ReservationId(1000), &req).unwrap();
    assert_eq!(g.held.get(pages), MAX);
    assert_eq!(g.expires_at.as_millis(), 10_000 + TTL_MAX_MS);
    // The maximum number of charges passes.
    let mut small = f.request();
    small.idempotency_key = None;
    f.ledger
        .reserve(f.now, ReservationId(1001), &small)
        .unwrap();
    let named = Charge {
        name: "c".into(),
        ..Charge::default()
    };
    let many = Usage {
        charges: vec![named; MAX_CHARGES],
        ..Usage::default()
    };
    f.ledger.settle(f.now, ReservationId(1001), &many).unwrap();
    // Every usage figure at 2^53, and a 64-character charge name.
    let usage = Usage {
        amounts: Amounts::new().with(pages, MAX),
        cached_input_tokens: MAX,
        charges: vec![Charge {
            name: "c".repeat(64),
            cost_micros: MAX,
            amounts: Amounts::new().with(pages, MAX),
        }],
    };
    // Engine's choice: 2^53 + 2^53 pages (usage plus a charge) is past any
    // single input's bound, but it is a sum, not an input: it is recorded,
    // not refused.
    let r = f.ledger.settle(f.now, ReservationId(1000), &usage).unwrap();
    assert_eq!(r.charged.as_ref().unwrap().get(pages), 2 * MAX);
    f.ledger.check_invariants().unwrap();
    // The tenant's cost budget is now overdrawn by ~2^53: even a request for
    // no cost at all is refused (`0 ≤ capacity − used` fails), as
    // charge_actual promises.
    let got = f.ledger.reserve(f.now, ReservationId(1002), &small);
    let Err(ReserveError::Denied(d)) = got else {
        panic!("expected a denial, got {got:?}");
    };
    assert_eq!(
        (d.kind, d.dimension.as_str(), d.requested),
        (DenialKind::BudgetExhausted, "cost_micros", 0)
    );
}

/// Refusals that are not about the input's shape change nothing either: an
/// id already in use, a key bound to another request, a denial.
#[test]
fn conflicting_reserves_change_nothing() {
    let mut f = fixture();
    let req = f.request();
    let held = f.held;
    let got = f.unchanged("a duplicate id", |l, now| l.reserve(now, held, &req));
    assert_eq!(got, Err(ReserveError::DuplicateId));
    let mut other = f.request();
    other.idempotency_key = Some("k".into());
    let got = f.unchanged("a key bound elsewhere", |l, now| {
        l.reserve(now, ReservationId(1000), &other)
    });
    assert!(matches!(got, Err(ReserveError::IdempotencyConflict { key }) if key == "k"));
    let mut big = f.request();
    big.amounts.set(Dimension::TOKENS, 501);
    let got = f.unchanged("a denial", |l, now| {
        l.reserve(now, ReservationId(1000), &big)
    });
    let Err(ReserveError::Denied(d)) = got else {
        panic!("expected a denial, got {got:?}");
    };
    assert_eq!(
        (d.kind, d.scope.as_str(), d.dimension.as_str()),
        (DenialKind::ExceedsLimit, "tenant:t/agent:a", "tokens")
    );
}

// ============================================================================
// settle, refund, extend, get
// ============================================================================

/// Each malformed settle names its field and leaves the reservation HELD.
#[test]
fn invalid_settles_name_the_field_and_change_nothing() {
    let mut f = fixture();
    let search = f.dim("search_calls");
    let charge = |name: &str, cost_micros, amounts: Amounts| Charge {
        name: name.into(),
        cost_micros,
        amounts,
    };
    let ok = charge("search", 1, Amounts::new().with(search, 1));
    let cases: Vec<(&str, Usage, &str)> = vec![
        (
            "tokens above 2^53",
            Usage {
                amounts: Amounts::new().with(Dimension::TOKENS, OVER),
                ..Usage::default()
            },
            "usage.tokens",
        ),
        (
            "cost above 2^53",
            Usage {
                amounts: Amounts::new().with(Dimension::COST_MICROS, u64::MAX),
                ..Usage::default()
            },
            "usage.cost_micros",
        ),
        (
            "cached input above 2^53",
            Usage {
                cached_input_tokens: OVER,
                ..Usage::default()
            },
            "usage.cached_input_tokens",
        ),
        (
            "65 charges",
            Usage {
                charges: vec![ok.clone(); MAX_CHARGES + 1],
                ..Usage::default()
            },
            "charges",
        ),
        (
            "an empty charge name",
            Usage {
                charges: vec![charge("", 1, Amounts::new())],
                ..Usage::default()
            },
            "charges[0].name",
        ),
        (
            "a 65-character charge name",
            Usage {
                charges: vec![ok.clone(), charge(&"c".repeat(65), 1, Amounts::new())],
                ..Usage::default()
            },
            "charges[1].name",
        ),
        (
            "a charge cost above 2^53",
            Usage {
                charges: vec![charge("search", OVER, Amounts::new())],
                ..Usage::default()
            },
            "charges[0].cost_micros",
        ),
        (
            "a charge amount above 2^53",
            Usage {
                charges: vec![
                    ok.clone(),
                    charge("search", 1, Amounts::new().with(search, OVER)),
                ],
                ..Usage::default()
            },
            "charges[1].amounts.search_calls",
        ),
    ];
    let held = f.held;
    for (what, usage, field) in cases {
        let got = f.unchanged(what, |l, now| l.settle(now, held, &usage).cloned());
        match got {
            Err(SettleError::Invalid(e)) => assert_eq!(e.field, field, "{what}"),
            other => panic!("{what}: expected an invalid input, got {other:?}"),
        }
    }
    // A late settle validates the same way: the expired one stays EXPIRED.
    let expired = f.expired;
    let bad = Usage {
        amounts: Amounts::new().with(Dimension::TOKENS, OVER),
        ..Usage::default()
    };
    let got = f.unchanged("a late settle", |l, now| {
        l.settle(now, expired, &bad).cloned()
    });
    assert!(matches!(got, Err(SettleError::Invalid(e)) if e.field == "usage.tokens"));
}

/// Unknown ids are NotFound (`get`: None) for every operation; a settle of
/// a refunded or a refund of a settled reservation is a conflict; an extend
/// of anything not HELD is NotHeld; none of them changes anything.
#[test]
fn unknown_and_ended_reservations_change_nothing() {
    let mut f = fixture();
    let (unknown, settled, refunded, expired) = (f.unknown, f.settled, f.refunded, f.expired);
    let usage = Usage::default();
    let more = Amounts::new().with(Dimension::TOKENS, 1);
    let got = f.unchanged("settle unknown", |l, now| {
        l.settle(now, unknown, &usage).cloned()
    });
    assert_eq!(got, Err(SettleError::NotFound));
    let got = f.unchanged("refund unknown", |l, now| l.refund(now, unknown).cloned());
    assert_eq!(got, Err(RefundError::NotFound));
    let got = f.unchanged("extend unknown", |l, now| {
        l.extend(now, unknown, Some(&more), None).cloned()
    });
    assert_eq!(got, Err(ExtendError::NotFound));
    let got = f.unchanged("get unknown", |l, now| l.get(now, unknown).cloned());
    assert_eq!(got, None);
    let got = f.unchanged("settle refunded", |l, now| {
        l.settle(now, refunded, &usage).cloned()
    });
    assert_eq!(
        got,
        Err(SettleError::Conflict {
            status: Status::Refunded
        })
    );
    let got = f.unchanged("refund settled", |l, now| l.refund(now, settled).cloned());
    assert_eq!(
        got,
        Err(RefundError::Conflict {
            status: Status::Settled
        })
    );
    for (id, status) in [
        (settled, Status::Settled),
        (refunded, Status::Refunded),
        (expired, Status::Expired),
    ] {
        let got = f.unchanged("extend ended", |l, now| {
            l.extend(now, id, Some(&more), Some(1_000)).cloned()
        });
        assert_eq!(got, Err(ExtendError::NotHeld { status }));
    }
    // Repeats that are no-ops: refund of a refunded or expired reservation,
    // settle of a settled one.
    let got = f.unchanged("refund refunded", |l, now| {
        l.refund(now, refunded).map(|r| r.status)
    });
    assert_eq!(got, Ok(Status::Refunded));
    let got = f.unchanged("refund expired", |l, now| {
        l.refund(now, expired).map(|r| r.status)
    });
    assert_eq!(got, Ok(Status::Expired));
    let got = f.unchanged("settle settled", |l, now| {
        l.settle(now, settled, &usage).map(|r| r.status)
    });
    assert_eq!(got, Ok(Status::Settled));
}

/// Each malformed extend names its field and leaves the hold as it was.
/// Engine's choice: the input is checked before the reservation is looked
/// up, so a malformed extend of an unknown id is Invalid, not NotFound.
#[test]
fn invalid_extends_name_the_field_and_change_nothing() {
    let mut f = fixture();
    let over = Amounts::new().with(Dimension::TOKENS, OVER);
    let cases: Vec<(&str, Option<&Amounts>, Option<u64>, &str)> = vec![
        ("neither amounts nor ttl", None, None, "amounts"),
        ("ttl 0", None, Some(0), "ttl_ms"),
        (
            "ttl above the maximum",
            None,
            Some(TTL_MAX_MS + 1),
            "ttl_ms",
        ),
        ("an amount above 2^53", Some(&over), None, "amounts.tokens"),
    ];
    for id in [f.held, f.unknown] {
        for (what, amounts, ttl_ms, field) in &cases {
            let got = f.unchanged(what, |l, now| l.extend(now, id, *amounts, *ttl_ms).cloned());
            match got {
                Err(ExtendError::Invalid(e)) => assert_eq!(e.field, *field, "{what}"),
                other => panic!("{what}: expected an invalid input, got {other:?}"),
            }
        }
    }
    // The boundary ttl passes.
    let held = f.held;
    let r = f
        .ledger
        .extend(f.now, held, None, Some(TTL_MAX_MS))
        .unwrap();
    assert_eq!(r.expires_at.as_millis(), 10_000 + TTL_MAX_MS);
}

// ============================================================================
// admin operations
// ============================================================================

/// Admin changes that are refused change nothing: an adjustment above 2^53
/// or on a scope of an unknown kind or without a total limit, an override
/// to an unknown plan, and a catalog update that fails half way.
#[test]
fn refused_admin_changes_change_nothing() {
    let mut f = fixture();
    let tenant = f.scopes.tenant().clone();
    let agent = f.scopes.as_slice()[1].clone();
    let got = f.unchanged("credit above 2^53", |l, now| {
        l.adjust(
            now,
            &tenant,
            Dimension::COST_MICROS,
            i64::try_from(OVER).unwrap(),
        )
    });
    assert!(matches!(got, Err(AdminError::Invalid(e)) if e.field == "amount"));
    let got = f.unchanged("debit above 2^53", |l, now| {
        l.adjust(
            now,
            &tenant,
            Dimension::COST_MICROS,
            -i64::try_from(OVER).unwrap(),
        )
    });
    assert!(matches!(got, Err(AdminError::Invalid(e)) if e.field == "amount"));
    let team = ScopeKey::parse("tenant:t/team:x").unwrap();
    let got = f.unchanged("an unknown kind", |l, now| {
        l.adjust(now, &team, Dimension::COST_MICROS, 1)
    });
    assert!(matches!(got, Err(AdminError::Invalid(e)) if e.field == "scope"));
    let got = f.unchanged("no total limit", |l, now| {
        l.adjust(now, &agent, Dimension::TOKENS, 1)
    });
    assert!(matches!(got, Err(AdminError::NotFound(_))));
    // The boundary passes.
    let max = i64::try_from(MAX).unwrap();
    f.ledger
        .adjust(f.now, &tenant, Dimension::COST_MICROS, max)
        .unwrap();
    f.ledger
        .adjust(f.now, &tenant, Dimension::COST_MICROS, -max)
        .unwrap();

    let got = f.unchanged("an override to an unknown plan", |l, _| {
        l.update_catalog(|c| c.set_override(agent.clone(), Override::Plan("gold".into())))
    });
    assert!(matches!(got, Err(AdminError::NotFound(_))));
    let got = f.unchanged("an override of a shared-ness mismatch", |l, _| {
        let wrong = ScopeKey::parse("tenant:t/tool:search").unwrap();
        l.update_catalog(|c| c.set_override(wrong, Override::Plan("agent".into())))
    });
    assert!(matches!(got, Err(AdminError::Invalid(e)) if e.field == "scope"));
    // A failing update keeps none of its earlier edits.
    let got = f.unchanged("a half-failed update", |l, _| {
        l.update_catalog(|c| {
            let tiny = Plan::new(
                "tenant",
                vec![Limit::new(Dimension::TOKENS, 1, Window::Total).unwrap()],
                OverrunPolicy::ChargeActual,
            )
            .unwrap();
            c.set_plan(tiny);
            c.set_kind("Bad Kind", None, false)
        })
    });
    assert_eq!(got.unwrap_err().field, "kind");
    assert_eq!(
        f.ledger.catalog().plan("tenant").unwrap().limits().len(),
        3,
        "the plan edit before the failure was not kept"
    );
}

// ============================================================================
// names: scopes, kinds, dimensions, zones
// ============================================================================

/// `Catalog::scope_set` names the field of each bad scope (`tenant`,
/// `scopes.{kind}`, `scopes`), and the boundary lengths pass.
#[test]
fn scope_sets_refuse_bad_names() {
    let c = catalog();
    let id128 = "i".repeat(MAX_ID_LEN);
    let id129 = "i".repeat(MAX_ID_LEN + 1);
    // (tenant, scopes, the field named)
    type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        ("", vec![], "tenant"),
        ("a/b", vec![], "tenant"),
        ("sp ace", vec![], "tenant"),
        ("café", vec![], "tenant"),
        ("a:b", vec![], "tenant"),
        (&id129, vec![], "tenant"),
        ("t", vec![("team", "x")], "scopes.team"),
        ("t", vec![("Agent", "x")], "scopes.Agent"),
        ("t", vec![("tenant", "x")], "scopes.tenant"),
        ("t", vec![("agent", "")], "scopes.agent"),
        ("t", vec![("agent", "bob smith")], "scopes.agent"),
        ("t", vec![("agent", "a/b")], "scopes.agent"),
        ("t", vec![("agent", &id129)], "scopes.agent"),
        ("t", vec![("tool", "se arch")], "scopes.tool"),
        ("t", vec![("agent", "a"), ("agent", "a")], "scopes.agent"),
        (
            "t",
            vec![("agent", "a"), ("tool", "s"), ("tool", "s")],
            "scopes.tool",
        ),
        ("t", (0..8).map(|_| ("agent", "a")).collect(), "scopes"),
    ];
    for (tenant, scopes, field) in cases {
        let e = c.scope_set(tenant, &scopes).unwrap_err();
        assert_eq!(e.field, field, "{tenant:?} {scopes:?}: {e}");
    }
    // Boundaries: a 128-character id and tenant, every allowed character,
    // 7 scopes besides the tenant (max_scopes = 8).
    let ids: Vec<String> = (0..7).map(|i| format!("a.b_c~d@e+f=g-{i}")).collect();
    let seven: Vec<(&str, &str)> = ids.iter().map(|i| ("agent", i.as_str())).collect();
    assert_eq!(c.scope_set(&id128, &seven).unwrap().len(), 8);
    let s = c
        .scope_set("t", &[("agent", &id128), ("tool", "s")])
        .unwrap();
    assert_eq!(s.as_slice()[2].as_str(), "tool:s");
}

/// `ScopeKey::parse` and `ScopeKey::tenant` refuse malformed names.
#[test]
fn scope_keys_refuse_bad_names() {
    for bad in [
        "",
        "acme",
        "tenant:",
        ":x",
        "Tenant:x",
        "tenant:a b",
        "user:bob/tool:x",
        "tenant:a/tenant:b",
        "tenant:a/user",
        "tenant:a/user:",
        "tenant:a/user:b/c:d",
        "tenant:a/User:b",
    ] {
        assert_eq!(ScopeKey::parse(bad).unwrap_err().field, "scope", "{bad:?}");
    }
    for good in ["tenant:acme", "tenant:acme/user:bob", "tool:search"] {
        assert_eq!(ScopeKey::parse(good).unwrap().as_str(), good);
    }
    assert_eq!(ScopeKey::tenant("a/b").unwrap_err().field, "tenant");
}

/// Kinds and custom dimensions: bad names are refused naming `kind` or
/// `dimension`, and a refused change leaves the catalog as it was.
#[test]
fn kinds_and_dimensions_refuse_bad_names() {
    let mut c = catalog();
    for bad in [
        "",
        "Agent",
        "1agent",
        "a.b",
        "a b",
        "k".repeat(MAX_KIND_LEN + 1).as_str(),
    ] {
        assert_eq!(
            c.set_kind(bad, None, false).unwrap_err().field,
            "kind",
            "{bad:?}"
        );
        assert!(c.kind(bad).is_none());
    }
    c.set_kind(&"k".repeat(MAX_KIND_LEN), None, false).unwrap();
    let e = c.set_kind("team", Some("gold"), false).unwrap_err();
    assert_eq!(e.field, "kinds.team.plan");
    assert!(c.kind("team").is_none());
    let e = c.set_kind("tenant", Some("tenant"), true).unwrap_err();
    assert_eq!(e.field, "kinds.tenant.shared");
    assert!(!c.kind("tenant").unwrap().shared);

    for bad in [
        "",
        "Search",
        "1abc",
        "search-calls",
        "a b",
        "d".repeat(33).as_str(),
    ] {
        assert_eq!(
            c.add_dimension(bad).unwrap_err().field,
            "dimension",
            "{bad:?}"
        );
        assert_eq!(c.dimension(bad), None);
    }
    let d32 = c.add_dimension(&"d".repeat(32)).unwrap();
    assert_eq!(c.dimension_name(d32), "d".repeat(32));
    // A built-in name is the built-in dimension, not a new one.
    assert_eq!(c.add_dimension("tokens").unwrap(), Dimension::TOKENS);
    // At most MAX_CUSTOM_DIMENSIONS (3 registered so far).
    for i in 3..MAX_CUSTOM_DIMENSIONS {
        c.add_dimension(&format!("x{i}")).unwrap();
    }
    assert_eq!(c.add_dimension("one_more").unwrap_err().field, "dimension");

    let e = c.set_model(
        "",
        ModelPrice {
            input_micros_per_million: 1,
            cached_input_micros_per_million: 1,
            output_micros_per_million: 1,
            max_output_tokens: 1,
            tokenizer: "x".into(),
        },
    );
    assert_eq!(e.unwrap_err().field, "model");
}

/// Unknown zone names are a typed error naming the zone.
#[test]
fn unknown_zones_are_refused() {
    for bad in ["Mars/Olympus", "", "Europe/Pariss"] {
        let e = Zone::named(bad).unwrap_err();
        assert_eq!(e.name, bad);
        assert!(e.to_string().contains("unknown time zone"));
    }
    for good in ["UTC", "Europe/Paris", "America/New_York"] {
        assert_eq!(Zone::named(good).unwrap().name(), good);
    }
}

// ============================================================================
// limits, plans, prices, settings
// ============================================================================

/// `Limit::new` names `capacity`, `period_ms`, `slices` or `window`.
#[test]
fn limits_refuse_bad_parameters() {
    let s = |period_ms, slices| Window::Sliding { period_ms, slices };
    let cases: Vec<(Dimension, u64, Window, &str)> = vec![
        (Dimension::TOKENS, 0, Window::Total, "capacity"),
        (Dimension::TOKENS, OVER, Window::Total, "capacity"),
        (Dimension::TOKENS, 10, s(1000, 7), "period_ms"),
        (Dimension::TOKENS, 10, s(0, 1), "period_ms"),
        (Dimension::TOKENS, 10, s(MAX_PERIOD_MS + 1, 1), "period_ms"),
        (Dimension::TOKENS, 10, s(60_000, 0), "slices"),
        (
            Dimension::TOKENS,
            10,
            s(3_601_000, MAX_SLICES + 1),
            "slices",
        ),
        (
            Dimension::TOKENS,
            10,
            Window::Bucket { period_ms: 0 },
            "period_ms",
        ),
        (
            Dimension::TOKENS,
            10,
            Window::Bucket {
                period_ms: MAX_PERIOD_MS + 1,
            },
            "period_ms",
        ),
        (Dimension::CONCURRENT, 10, Window::Total, "window"),
        (Dimension::CONCURRENT, 10, s(60_000, 60), "window"),
        (Dimension::TOKENS, 10, Window::Concurrent, "window"),
        (Dimension::REQUESTS, 10, Window::Concurrent, "window"),
    ];
    for (dim, capacity, window, field) in cases {
        let e = Limit::new(dim, capacity, window.clone()).unwrap_err();
        assert_eq!(e.field, field, "{dim:?} {capacity} {window:?}: {e}");
    }
    // Boundaries.
    Limit::new(Dimension::TOKENS, MAX, Window::Total).unwrap();
    Limit::new(Dimension::TOKENS, 1, s(3_600_000, MAX_SLICES)).unwrap();
    Limit::new(Dimension::TOKENS, 1, s(MAX_PERIOD_MS, 1)).unwrap();
    Limit::new(Dimension::TOKENS, 1, s(1, 1)).unwrap();
    Limit::new(Dimension::CONCURRENT, 1, Window::Concurrent).unwrap();
    let e = Limit::new(Dimension::CONCURRENT, 2, Window::Concurrent)
        .unwrap()
        .with_guaranteed(3)
        .unwrap_err();
    assert_eq!(e.field, "guaranteed");
}

/// `Plan::new` refuses duplicate limits (same dimension and window), a bad
/// name, too many limits and an overrun percentage out of range.
#[test]
fn plans_refuse_duplicates_and_bad_parameters() {
    let minute = |slices| Window::Sliding {
        period_ms: 60_000,
        slices,
    };
    let tokens = |cap, w| Limit::new(Dimension::TOKENS, cap, w).unwrap();
    let cc = OverrunPolicy::ChargeActual;
    let e = Plan::new(
        "p",
        vec![tokens(10, minute(60)), tokens(20, minute(60))],
        cc,
    )
    .unwrap_err();
    assert_eq!(e.field, "limits[1]");
    let e = Plan::new(
        "p",
        vec![
            tokens(1, Window::Total),
            tokens(10, minute(60)),
            tokens(2, Window::Total),
        ],
        cc,
    )
    .unwrap_err();
    assert_eq!(e.field, "limits[2]");
    // The same dimension in other windows (or other slices) is no duplicate.
    Plan::new(
        "p",
        vec![
            tokens(10, minute(60)),
            tokens(10, minute(30)),
            tokens(10, Window::Total),
        ],
        cc,
    )
    .unwrap();
    assert_eq!(Plan::new("", vec![], cc).unwrap_err().field, "name");
    assert_eq!(
        Plan::new(&"p".repeat(65), vec![], cc).unwrap_err().field,
        "name"
    );
    let many = vec![tokens(1, Window::Total); MAX_LIMITS_PER_PLAN + 1];
    assert_eq!(Plan::new("p", many, cc).unwrap_err().field, "limits");
    let e = Plan::new("p", vec![], OverrunPolicy::AllowOverrun { percent: 10_001 }).unwrap_err();
    assert_eq!(e.field, "overrun_percent");
    Plan::new("p", vec![], OverrunPolicy::AllowOverrun { percent: 10_000 }).unwrap();
}

/// Prices: at most 6 decimals, no signs or exponents, at most 2^53 micros;
/// the error names the field given.
#[test]
fn prices_refuse_more_than_six_decimals() {
    let field = "models.gpt.input_per_million";
    for bad in [
        "0.0000001",
        "1.1234567",
        "-1",
        "+1",
        "1e3",
        "",
        ".5",
        "1.2.3",
        "abc",
        "9007199254.740993",
    ] {
        let e = parse_price_micros(bad, field).unwrap_err();
        assert_eq!(e.field, field, "{bad:?}");
    }
    for (good, micros) in [
        ("0.000001", 1),
        ("2.5", 2_500_000),
        ("10", 10_000_000),
        ("1.", 1_000_000),
        ("9007199254.740992", MAX),
    ] {
        assert_eq!(parse_price_micros(good, field).unwrap(), micros, "{good:?}");
    }
}

/// Settings are checked together: `default_ttl_ms ≤ max_ttl_ms`, both ≥ 1,
/// `max_scopes` within 1..=16, `max_labels` ≤ 64.
#[test]
fn settings_refuse_inconsistent_bounds() {
    let base = Settings::default();
    let cases = [
        (
            Settings {
                default_ttl_ms: 2_000,
                max_ttl_ms: 1_000,
                ..base.clone()
            },
            "reservations.default_ttl_ms",
        ),
        (
            Settings {
                default_ttl_ms: 0,
                ..base.clone()
            },
            "reservations.default_ttl_ms",
        ),
        (
            Settings {
                max_ttl_ms: 0,
                ..base.clone()
            },
            "reservations.max_ttl_ms",
        ),
        (
            Settings {
                max_scopes: 0,
                ..base.clone()
            },
            "reservations.max_scopes",
        ),
        (
            Settings {
                max_scopes: MAX_SCOPES_LIMIT + 1,
                ..base.clone()
            },
            "reservations.max_scopes",
        ),
        (
            Settings {
                max_labels: 65,
                ..base.clone()
            },
            "reservations.max_labels",
        ),
    ];
    for (settings, field) in cases {
        assert_eq!(
            settings.validate().unwrap_err().field,
            field,
            "{settings:?}"
        );
        assert_eq!(Catalog::new(settings).unwrap_err().field, field);
    }
    let equal = Settings {
        default_ttl_ms: 1_000,
        max_ttl_ms: 1_000,
        ..base
    };
    assert_eq!(Catalog::new(equal).unwrap().settings().max_ttl_ms, 1_000);
}

/// The shared ledger routes a reservation by its id's tenant tag, so an id
/// minted for another tenant is refused, naming `id`, before anything is
/// held.
#[test]
fn a_shared_ledger_refuses_an_id_minted_for_another_tenant() {
    let ledger = SharedLedger::new(catalog(), 16);
    let now = Timestamp::from_millis(1_000);
    let scopes = ledger.catalog().scope_set("t", &[("agent", "a")]).unwrap();
    let req = ReserveRequest::new(scopes.clone(), Amounts::new().with(Dimension::TOKENS, 10));
    let other = (0..)
        .map(|k| format!("u{k}"))
        .find(|u| ReservationId::tenant_tag(u) != ReservationId::tenant_tag("t"))
        .expect("a tenant with another tag");
    let foreign = ReservationId::mint(7 << 8, &other);
    let got = ledger.reserve(now, foreign, &req);
    assert_eq!(field_of("a foreign id", got), "id");
    let tenant = ledger.status(now, &scopes.as_slice()[0]);
    assert_eq!(tenant.held_reservations, 0, "nothing held: {tenant:?}");
    // The same request with an id of its own tenant is granted.
    ledger
        .reserve(now, ReservationId::mint(7 << 8, "t"), &req)
        .expect("granted");
}
