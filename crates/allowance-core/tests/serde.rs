//! Every type the durable store logs survives a postcard round trip, and a
//! decoder refuses, with an error, every encoding of a value the type's
//! constructors would refuse: deserialization is a trust boundary.
//!
//! Random values (amounts, usages, requests) come from proptest, 64 cases
//! by default (`ALLOWANCE_PROPTEST_CASES` for more); the rest are the
//! values with every variant and option set.

use std::fmt::Debug;
use std::sync::Arc;

use allowance_core::*;
use proptest::prelude::*;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

const T0_MS: u64 = 1_700_000_000_000;

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    postcard::to_stdvec(v).expect("every value encodes")
}

fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, postcard::Error> {
    postcard::from_bytes(bytes)
}

/// Encodes, decodes, and checks the value and its encoding come back.
fn round_trip<T: Serialize + DeserializeOwned + PartialEq + Debug>(v: &T) -> T {
    let bytes = encode(v);
    let back: T = decode(&bytes).unwrap_or_else(|e| panic!("{v:?} does not decode: {e}"));
    assert_eq!(&back, v);
    assert_eq!(encode(&back), bytes, "one value, one encoding");
    back
}

/// [`round_trip`] for types without `PartialEq`: compared by their
/// encoding (the callers compare what they can read back).
fn round_trip_by_encoding<T: Serialize + DeserializeOwned + Debug>(v: &T) -> T {
    let bytes = encode(v);
    let back: T = decode(&bytes).unwrap_or_else(|e| panic!("{v:?} does not decode: {e}"));
    assert_eq!(encode(&back), bytes);
    back
}

/// Asserts that `wire` (the encoding of something shaped like a `T`) does
/// not decode as a `T`; `why` names the case.
#[track_caller]
fn refused<T: DeserializeOwned + Debug>(wire: &impl Serialize, why: &str) {
    // postcard keeps only the kind of a decoder's error, not its message:
    // what is checked is that the value is refused.
    if let Ok(v) = decode::<T>(&encode(wire)) {
        panic!("decoded {v:?}, expected a refusal ({why})");
    }
}

fn search_dim(c: &Catalog) -> Dimension {
    c.dimension("search_calls").expect("registered")
}

fn paris() -> Zone {
    Zone::named("Europe/Paris").expect("a known zone")
}

/// Every window kind, the calendar one in UTC and in a zone.
fn every_window() -> Vec<Window> {
    vec![
        Window::Sliding {
            period_ms: 60_000,
            slices: 6,
        },
        Window::Bucket { period_ms: 10_000 },
        Window::Calendar {
            unit: CalendarUnit::Day,
            zone: paris(),
        },
        Window::Calendar {
            unit: CalendarUnit::Month,
            zone: Zone::utc(),
        },
        Window::Total,
        Window::Concurrent,
    ]
}

/// A catalog with every window kind, every overrun policy, a queue weight,
/// a guarantee, custom dimensions, models, shared and unshared kinds, a
/// kind without a plan, and both kinds of override.
fn full_catalog() -> Catalog {
    let settings = Settings {
        default_ttl_ms: 20_000,
        max_ttl_ms: 120_000,
        idempotency_retention_ms: 600_000,
        ended_retention_ms: 1_200_000,
        max_scopes: 6,
        max_labels: 4,
    };
    let mut c = Catalog::new(settings).expect("valid settings");
    let search = c.add_dimension("search_calls").expect("a valid name");
    let pages = c.add_dimension("pages").expect("a valid name");
    let l = |d, cap, w| Limit::new(d, cap, w).expect("a valid limit");
    let tenant = Plan::with_weight(
        "tenant",
        vec![
            l(
                Dimension::TOKENS,
                5000,
                Window::Sliding {
                    period_ms: 60_000,
                    slices: 6,
                },
            ),
            l(Dimension::COST_MICROS, 200_000, Window::Total),
            l(
                Dimension::REQUESTS,
                10,
                Window::Bucket { period_ms: 10_000 },
            ),
            l(Dimension::CONCURRENT, 4, Window::Concurrent)
                .with_guaranteed(2)
                .expect("a valid guarantee"),
            l(
                Dimension::COST_MICROS,
                100_000,
                Window::Calendar {
                    unit: CalendarUnit::Day,
                    zone: paris(),
                },
            ),
        ],
        OverrunPolicy::AllowOverrun { percent: 25 },
        7,
    )
    .expect("a valid plan");
    c.set_plan(tenant);
    c.set_plan(
        Plan::new(
            "user",
            vec![l(
                Dimension::TOKENS,
                2000,
                Window::Calendar {
                    unit: CalendarUnit::Minute,
                    zone: Zone::utc(),
                },
            )],
            OverrunPolicy::CapAtEstimate,
        )
        .expect("a valid plan"),
    );
    c.set_plan(
        Plan::new(
            "tool",
            vec![
                l(search, 4, Window::Total),
                l(
                    pages,
                    100,
                    Window::Calendar {
                        unit: CalendarUnit::Week,
                        zone: Zone::named("America/New_York").expect("a known zone"),
                    },
                ),
            ],
            OverrunPolicy::ChargeActual,
        )
        .expect("a valid plan"),
    );
    c.set_kind("tenant", Some("tenant"), false).expect("valid");
    c.set_kind("user", Some("user"), false).expect("valid");
    c.set_kind("agent", None, false).expect("valid");
    c.set_kind("tool", Some("tool"), true).expect("valid");
    c.set_override(
        ScopeKey::parse("tenant:acme/user:bob").expect("a valid name"),
        Override::Plan("tenant".into()),
    )
    .expect("valid");
    let own = Plan::new(
        "own",
        vec![l(
            Dimension::OUTPUT_TOKENS,
            300,
            Window::Bucket { period_ms: 5000 },
        )],
        OverrunPolicy::CapAtEstimate,
    )
    .expect("a valid plan");
    c.set_override(
        ScopeKey::parse("tool:search").expect("a valid name"),
        Override::Limits(own),
    )
    .expect("valid");
    for (name, input) in [("gpt-a", 2_500_000), ("gpt-b", 150_000)] {
        c.set_model(
            name,
            ModelPrice {
                input_micros_per_million: input,
                cached_input_micros_per_million: input / 2,
                output_micros_per_million: input * 4,
                max_output_tokens: 16_384,
                tokenizer: "o200k_base".into(),
            },
        )
        .expect("a valid model");
    }
    c
}

// ------------------------------------------------------- the small types

#[test]
fn ids_and_instants_round_trip_compactly() {
    for id in [0, 1, u128::MAX, 0x0123_4567_89ab_cdef_0123_4567_89ab_cdef] {
        let id = ReservationId::mint(id, "acme");
        assert_eq!(encode(&id).len(), 16, "an id is its 16 bytes");
        round_trip(&id);
    }
    for ms in [0, 1, T0_MS, u64::MAX] {
        round_trip(&Timestamp::from_millis(ms));
    }
    // A current instant is a 6-byte varint, not 8 fixed bytes.
    assert_eq!(encode(&Timestamp::from_millis(T0_MS)).len(), 6);
    for s in [
        Status::Held,
        Status::Settled,
        Status::Refunded,
        Status::Expired,
    ] {
        round_trip(&s);
        assert_eq!(encode(&s).len(), 1);
    }
}

#[test]
fn dimensions_round_trip_and_impossible_ones_are_refused() {
    let c = full_catalog();
    for d in Dimension::BUILTIN {
        round_trip(&d);
    }
    round_trip(&search_dim(&c));
    let mut many = Catalog::default();
    let mut last = Dimension::TOKENS;
    for i in 0..MAX_CUSTOM_DIMENSIONS {
        last = many.add_dimension(&format!("d{i}")).expect("room for it");
    }
    round_trip(&last);
    // One past the last custom dimension any catalog can register.
    refused::<Dimension>(&(last.index() as u16 + 1), "no catalog has it");
    refused::<Dimension>(&u16::MAX, "no catalog has it");
}

#[test]
fn zones_units_windows_and_policies_round_trip() {
    for w in every_window() {
        round_trip(&w);
    }
    for u in [
        CalendarUnit::Minute,
        CalendarUnit::Hour,
        CalendarUnit::Day,
        CalendarUnit::Week,
        CalendarUnit::Month,
    ] {
        round_trip(&u);
    }
    for p in [
        OverrunPolicy::ChargeActual,
        OverrunPolicy::CapAtEstimate,
        OverrunPolicy::AllowOverrun { percent: 0 },
        OverrunPolicy::AllowOverrun { percent: 10_000 },
    ] {
        round_trip(&p);
    }
    // A zone decodes through the zone database: an unknown one is refused.
    refused::<Zone>(&"Mars/Olympus", "an unknown zone");
    refused::<Zone>(&"x".repeat(10_000), "a name no zone has");
    assert_eq!(round_trip_by_encoding(&paris()).name(), "Europe/Paris");
}

#[test]
fn limits_round_trip_and_invalid_ones_are_refused() {
    for w in every_window() {
        let dim = if w == Window::Concurrent {
            Dimension::CONCURRENT
        } else {
            Dimension::TOKENS
        };
        let limit = Limit::new(dim, 1000, w).expect("a valid limit");
        round_trip(&limit);
    }
    let guaranteed = Limit::new(Dimension::CONCURRENT, 8, Window::Concurrent)
        .and_then(|l| l.with_guaranteed(3))
        .expect("a valid limit");
    assert_eq!(round_trip(&guaranteed).guaranteed(), 3);

    // (dimension, capacity, window, guaranteed): a limit's encoding.
    let total = Window::Total;
    refused::<Limit>(&(Dimension::TOKENS, 0u64, &total, 0u64), "capacity 0");
    refused::<Limit>(
        &(Dimension::TOKENS, MAX_AMOUNT + 1, &total, 0u64),
        "capacity past 2^53",
    );
    refused::<Limit>(&(Dimension::TOKENS, 10u64, &total, 1u64), "a guarantee");
    refused::<Limit>(
        &(Dimension::CONCURRENT, 2u64, Window::Concurrent, 3u64),
        "a guarantee above the capacity",
    );
    refused::<Limit>(
        &(Dimension::TOKENS, 10u64, Window::Concurrent, 0u64),
        "a gauge of tokens",
    );
    let sliding = |period_ms, slices| Window::Sliding { period_ms, slices };
    for (w, why) in [
        (sliding(1000, 3), "a period not a multiple of the slices"),
        (sliding(1000, 0), "no slices"),
        (sliding(0, 1), "an empty period"),
        (sliding(MAX_PERIOD_MS * 2, 2), "a period past 400 days"),
        (Window::Bucket { period_ms: 0 }, "an empty bucket period"),
    ] {
        refused::<Limit>(&(Dimension::TOKENS, 10u64, w, 0u64), why);
    }
}

#[test]
fn plans_round_trip_with_their_layout_and_invalid_ones_are_refused() {
    let c = full_catalog();
    for name in ["tenant", "user", "tool"] {
        let plan = c.plan(name).expect("defined");
        let back: Arc<Plan> = round_trip_by_encoding(plan);
        assert_eq!(back.name(), plan.name());
        assert_eq!(back.limits(), plan.limits());
        assert_eq!(back.overrun(), plan.overrun());
        assert_eq!(back.queue_weight(), plan.queue_weight());
    }
    assert_eq!(
        round_trip_by_encoding(c.plan("tenant").expect("defined")).queue_weight(),
        7
    );
    let limit = Limit::new(Dimension::TOKENS, 10, Window::Total).expect("valid");
    let charge = OverrunPolicy::ChargeActual;
    // (name, limits, overrun, queue_weight): a plan's encoding.
    refused::<Plan>(&("", vec![&limit], charge, 1u32), "an empty name");
    refused::<Plan>(&("p", vec![&limit, &limit], charge, 1u32), "a repeat");
    refused::<Plan>(&("p", vec![&limit], charge, 0u32), "queue weight 0");
    refused::<Plan>(
        &(
            "p",
            vec![&limit],
            OverrunPolicy::AllowOverrun { percent: 10_001 },
            1u32,
        ),
        "an overrun past 10000%",
    );
    let many: Vec<Limit> = (0..=MAX_LIMITS_PER_PLAN as u64)
        .map(|i| {
            Limit::new(Dimension::TOKENS, 10, Window::Bucket { period_ms: i + 1 }).expect("valid")
        })
        .collect();
    refused::<Plan>(&("p", many, charge, 1u32), "too many limits");
}

#[test]
fn scope_keys_and_sets_decode_only_through_their_checks() {
    let c = full_catalog();
    for name in ["tenant:acme", "tenant:acme/user:bob", "tool:search"] {
        round_trip(&ScopeKey::parse(name).expect("a valid name"));
    }
    for bad in [
        "",
        "acme",
        "Tenant:acme",
        "tenant:acme/tenant:b",
        "tenant:a/user:b/agent:c",
        "tenant:sp ace",
    ] {
        refused::<ScopeKey>(&bad, bad);
    }
    refused::<ScopeKey>(&format!("tenant:{}", "x".repeat(129)), "a long id");

    let set = c
        .scope_set("acme", &[("user", "bob"), ("tool", "search")])
        .expect("valid");
    let back = round_trip(&set);
    assert_eq!(back.tenant_tag(), set.tenant_tag());
    assert!(back.any_shared());
    round_trip(&c.scope_set("acme", &[]).expect("valid"));

    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    for (bad, why) in [
        (names(&[]), "no scopes"),
        (names(&["tenant:acme/user:bob"]), "the tenant is not first"),
        (
            names(&["tool:search", "tenant:acme"]),
            "a shared scope first",
        ),
        (names(&["tenant:acme", "tenant:other"]), "two tenants"),
        (
            names(&["tenant:acme", "tenant:other/user:bob"]),
            "another tenant's scope",
        ),
        (
            names(&["tenant:acme", "tool:search", "tool:search"]),
            "a repeat",
        ),
        (names(&["tenant:acme", "nope"]), "a bad name"),
    ] {
        refused::<ScopeSet>(&bad, why);
    }
    let mut many = vec!["tenant:acme".to_string()];
    many.extend((0..MAX_SCOPES_LIMIT).map(|i| format!("tool:t{i}")));
    refused::<ScopeSet>(&many, "more scopes than any reservation has");
}

#[test]
fn amounts_decode_only_in_their_own_shape() {
    let c = full_catalog();
    let a = Amounts::new()
        .with(Dimension::INPUT_TOKENS, 3000)
        .with(Dimension::COST_MICROS, MAX_AMOUNT)
        .with(search_dim(&c), 2);
    round_trip(&a);
    round_trip(&Amounts::new());
    // Two built-ins: a length, then (dimension, varint) pairs.
    let small = Amounts::new()
        .with(Dimension::INPUT_TOKENS, 3000)
        .with(Dimension::OUTPUT_TOKENS, 20);
    assert_eq!(encode(&small).len(), 1 + (1 + 2) + (1 + 1));
    let pairs = |v: &[(u16, u64)]| v.to_vec();
    for (bad, why) in [
        (pairs(&[(2, 0)]), "a zero"),
        (pairs(&[(0, 1)]), "requests, implied"),
        (pairs(&[(1, 1)]), "concurrent, implied"),
        (pairs(&[(3, 1), (2, 1)]), "out of order"),
        (pairs(&[(2, 1), (2, 1)]), "a repeat"),
        (pairs(&[(9999, 1)]), "no such dimension"),
    ] {
        refused::<Amounts>(&bad, why);
    }
}

#[test]
fn settings_are_checked_when_decoded() {
    round_trip(&Settings::default());
    let ok = Settings::default();
    for bad in [
        Settings {
            max_ttl_ms: 0,
            ..ok.clone()
        },
        Settings {
            default_ttl_ms: ok.max_ttl_ms + 1,
            ..ok.clone()
        },
        Settings {
            max_scopes: 0,
            ..ok.clone()
        },
        Settings {
            max_scopes: MAX_SCOPES_LIMIT + 1,
            ..ok.clone()
        },
        Settings {
            max_labels: 65,
            ..ok.clone()
        },
    ] {
        refused::<Settings>(&bad, "invalid settings");
    }
}

#[test]
fn models_and_overrides_round_trip() {
    let c = full_catalog();
    round_trip(c.model("gpt-a").expect("defined"));
    for (_, over) in c.overrides() {
        let back = round_trip_by_encoding(over);
        match (over, &back) {
            (Override::Plan(a), Override::Plan(b)) => assert_eq!(a, b),
            (Override::Limits(a), Override::Limits(b)) => assert_eq!(a.limits(), b.limits()),
            _ => panic!("{over:?} came back as {back:?}"),
        }
    }
}

// ------------------------------------------------------------- the catalog

/// A catalog comes back as the same configuration: the same encoding, and
/// the same plan for every scope, dimensions, models, kinds and settings.
#[test]
fn a_catalog_round_trips_completely() {
    let c = full_catalog();
    let back: Catalog = round_trip_by_encoding(&c);
    assert_eq!(back.settings(), c.settings());
    for name in ["search_calls", "pages", "tokens"] {
        assert_eq!(back.dimension(name), c.dimension(name), "{name}");
    }
    for model in ["gpt-a", "gpt-b", "gpt-c"] {
        assert_eq!(back.model(model), c.model(model));
    }
    let mut kinds: Vec<_> = back
        .kinds()
        .map(|(k, s)| (k.to_string(), s.clone()))
        .collect();
    let mut want: Vec<_> = c.kinds().map(|(k, s)| (k.to_string(), s.clone())).collect();
    kinds.sort_by(|a, b| a.0.cmp(&b.0));
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(kinds, want);
    for name in [
        "tenant:acme",
        "tenant:acme/user:bob",
        "tenant:acme/user:eve",
        "tenant:acme/agent:a1",
        "tool:search",
        "tool:ocr",
    ] {
        let key = ScopeKey::parse(name).expect("a valid name");
        let (a, b) = (c.plan_for(&key), back.plan_for(&key));
        assert_eq!((a.name(), a.limits()), (b.name(), b.limits()), "{name}");
    }
    // The encoding does not depend on the order things were defined in.
    let mut reordered = Catalog::new(c.settings().clone()).expect("valid");
    reordered.add_dimension("search_calls").expect("valid");
    reordered.add_dimension("pages").expect("valid");
    let mut plans: Vec<Arc<Plan>> = c.plans().cloned().collect();
    plans.sort_by(|a, b| b.name().cmp(a.name()));
    for p in plans {
        reordered.set_plan(p);
    }
    for model in ["gpt-b", "gpt-a"] {
        reordered
            .set_model(model, c.model(model).expect("defined").clone())
            .expect("valid");
    }
    for kind in ["tool", "agent", "user", "tenant"] {
        let spec = c.kind(kind).expect("defined");
        reordered
            .set_kind(kind, spec.plan.as_deref(), spec.shared)
            .expect("valid");
    }
    let mut overrides: Vec<_> = c.overrides().map(|(k, o)| (k.clone(), o.clone())).collect();
    overrides.sort_by(|a, b| b.0.cmp(&a.0));
    for (k, o) in overrides {
        reordered.set_override(k, o).expect("valid");
    }
    assert_eq!(encode(&reordered), encode(&c));
}

/// The same operations on a ledger configured with a decoded catalog
/// answer the same as on the original.
#[test]
fn a_decoded_catalog_configures_the_same_ledger() {
    let c = full_catalog();
    let back: Catalog = decode(&encode(&c)).expect("decodes");
    let mut ledgers = [Ledger::new(c.clone()), Ledger::new(back)];
    let scopes = c
        .scope_set("acme", &[("user", "bob"), ("tool", "search")])
        .expect("valid");
    let mut req = ReserveRequest::new(
        scopes.clone(),
        Amounts::new()
            .with(Dimension::INPUT_TOKENS, 900)
            .with(Dimension::OUTPUT_TOKENS, 200),
    );
    req.model = Some("gpt-a".into());
    let answers: Vec<_> = ledgers
        .iter_mut()
        .map(|l| {
            let now = Timestamp::from_millis(T0_MS);
            let granted = l.reserve(now, ReservationId(7), &req);
            let settled = l
                .settle(
                    now.saturating_add_ms(500),
                    ReservationId(7),
                    &Usage {
                        amounts: Amounts::new().with(Dimension::OUTPUT_TOKENS, 250),
                        ..Usage::default()
                    },
                )
                .cloned();
            let status: Vec<_> = scopes
                .as_slice()
                .iter()
                .map(|k| l.status(now.saturating_add_ms(900), k))
                .collect();
            (granted, settled, status)
        })
        .collect();
    assert_eq!(answers[0], answers[1]);
}

#[test]
fn inconsistent_catalogs_are_refused() {
    let c = full_catalog();
    let limit = Limit::new(Dimension::TOKENS, 10, Window::Total).expect("valid");
    let plan = Plan::new("p", vec![limit], OverrunPolicy::ChargeActual).expect("valid");
    let none: Vec<(ScopeKey, Override)> = Vec::new();
    let no_models: Vec<(String, ModelPrice)> = Vec::new();
    let kinds = |plan: Option<&str>| {
        vec![(
            "user".to_string(),
            KindSpec {
                plan: plan.map(Into::into),
                shared: false,
            },
        )]
    };
    // (settings, custom dimensions, plans, kinds, overrides, models).
    let wire =
        |dims: Vec<&str>, plans: Vec<Arc<Plan>>, kinds: Vec<(String, KindSpec)>, overrides| {
            encode(&(c.settings(), dims, plans, kinds, overrides, &no_models))
        };
    let ok = wire(
        vec!["a"],
        vec![plan.clone()],
        kinds(Some("p")),
        none.clone(),
    );
    decode::<Catalog>(&ok).expect("the well-formed one decodes");
    let bob = ScopeKey::parse("tenant:acme/user:bob").expect("a valid name");
    for (bytes, why) in [
        (
            wire(vec!["a", "a"], vec![], vec![], none.clone()),
            "a repeated dimension",
        ),
        (
            wire(vec!["tokens"], vec![], vec![], none.clone()),
            "a built-in's name",
        ),
        (
            wire(vec!["Bad"], vec![], vec![], none.clone()),
            "a bad dimension name",
        ),
        (
            wire(
                vec![],
                vec![plan.clone(), plan.clone()],
                vec![],
                none.clone(),
            ),
            "a repeated plan",
        ),
        (
            wire(vec![], vec![], kinds(Some("p")), none.clone()),
            "a kind's plan is missing",
        ),
        (
            wire(
                vec![],
                vec![],
                vec![(
                    "tenant".into(),
                    KindSpec {
                        plan: None,
                        shared: true,
                    },
                )],
                none.clone(),
            ),
            "a shared tenant kind",
        ),
        (
            wire(
                vec![],
                vec![plan.clone()],
                [kinds(None), kinds(Some("p"))].concat(),
                none.clone(),
            ),
            "a repeated kind",
        ),
        (
            wire(
                vec![],
                vec![],
                kinds(None),
                vec![(bob.clone(), Override::Plan("missing".into()))],
            ),
            "an override naming no plan",
        ),
        (
            wire(
                vec![],
                vec![plan.clone()],
                kinds(None),
                vec![
                    (bob.clone(), Override::Plan("p".into())),
                    (bob.clone(), Override::Limits(plan.clone())),
                ],
            ),
            "a repeated override",
        ),
    ] {
        assert!(decode::<Catalog>(&bytes).is_err(), "{why}");
    }
}

// -------------------------------------------------------- the commands

/// The shape of the store's `CatalogChange` (whose derive lives with it):
/// every variant's fields encode and decode.
#[derive(Debug, Serialize, Deserialize)]
enum Change {
    SetPlan(Arc<Plan>),
    SetOverride(ScopeKey, Override),
    ClearOverride(ScopeKey),
    SetModel(String, ModelPrice),
    AddDimension(String),
}

#[test]
fn catalog_changes_round_trip() {
    let c = full_catalog();
    let bob = ScopeKey::parse("tenant:acme/user:bob").expect("a valid name");
    let plan = c.plan("tenant").expect("defined").clone();
    for change in [
        Change::SetPlan(plan.clone()),
        Change::SetOverride(bob.clone(), Override::Plan("user".into())),
        Change::SetOverride(bob.clone(), Override::Limits(plan)),
        Change::ClearOverride(bob),
        Change::SetModel("gpt-a".into(), c.model("gpt-a").expect("defined").clone()),
        Change::AddDimension("pages".into()),
    ] {
        round_trip_by_encoding(&change);
    }
}

fn cases() -> u32 {
    std::env::var("ALLOWANCE_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

fn amount() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => Just(0u64),
        5 => 1u64..=5000,
        1 => Just(MAX_AMOUNT),
        1 => any::<u64>(),
    ]
}

fn amounts() -> impl Strategy<Value = Amounts> {
    let c = full_catalog();
    let dims = [
        Dimension::INPUT_TOKENS,
        Dimension::OUTPUT_TOKENS,
        Dimension::TOKENS,
        Dimension::COST_MICROS,
        search_dim(&c),
        c.dimension("pages").expect("registered"),
    ];
    prop::collection::vec(amount(), dims.len())
        .prop_map(move |v| dims.iter().copied().zip(v).collect())
}

fn text() -> impl Strategy<Value = String> {
    "[a-z0-9:/ é-]{0,12}"
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    /// Every field of a usage, tool charges included, comes back.
    #[test]
    fn usages_round_trip(
        amounts in amounts(),
        cached in amount(),
        charges in prop::collection::vec((text(), amount(), amounts()), 0..4),
    ) {
        let usage = Usage {
            amounts,
            cached_input_tokens: cached,
            charges: charges
                .into_iter()
                .map(|(name, cost_micros, amounts)| Charge { name, cost_micros, amounts })
                .collect(),
        };
        round_trip(&usage);
    }

    /// Every field of a request comes back, and a decoded request is
    /// granted or refused exactly as the original.
    #[test]
    fn reserve_requests_round_trip(
        scopes in (0usize..3, any::<bool>(), any::<bool>()),
        amounts in amounts(),
        model in prop::option::of(prop_oneof![Just("gpt-a"), Just("gpt-zz")]),
        ttl_ms in prop::option::of(0u64..200_000),
        key in prop::option::of(text()),
        dry_run in any::<bool>(),
        labels in prop::option::of(prop::collection::vec((text(), text()), 0..6)),
        report_remaining in any::<bool>(),
    ) {
        let c = full_catalog();
        let tenant = ["acme", "globex", "initech"][scopes.0];
        let mut pairs = Vec::new();
        if scopes.1 {
            pairs.push(("user", "bob"));
        }
        if scopes.2 {
            pairs.push(("tool", "search"));
        }
        let req = ReserveRequest {
            scopes: c.scope_set(tenant, &pairs).expect("valid"),
            amounts,
            model: model.map(Into::into),
            ttl_ms,
            idempotency_key: key.map(Into::into),
            dry_run,
            labels: labels.map(Into::into),
            report_remaining,
        };
        let back: ReserveRequest = round_trip_by_encoding(&req);
        prop_assert_eq!(format!("{back:?}"), format!("{req:?}"));
        let now = Timestamp::from_millis(T0_MS);
        let id = ReservationId::mint(0xabcd << 64, tenant);
        let answers: Vec<_> = [&req, &back]
            .into_iter()
            .map(|r| {
                let mut l = Ledger::new(c.clone());
                (l.reserve(now, id, r), l.get(now, id).cloned())
            })
            .collect();
        prop_assert_eq!(&answers[0], &answers[1]);
    }

    /// A reservation as read back, in every state, comes back.
    #[test]
    fn reservations_round_trip(
        input in 1u64..3000,
        used in amount(),
        end in 0u8..4,
        key in any::<bool>(),
    ) {
        let c = full_catalog();
        let mut l = Ledger::new(c.clone());
        let scopes = c
            .scope_set("acme", &[("user", "eve"), ("tool", "search")])
            .expect("valid");
        let mut req = ReserveRequest::new(scopes, Amounts::new().with(Dimension::INPUT_TOKENS, input));
        req.model = Some("gpt-b".into());
        req.labels = Some(vec![("run".to_string(), "r1".to_string())].into());
        req.idempotency_key = key.then(|| "k1".into());
        let now = Timestamp::from_millis(T0_MS);
        let id = ReservationId::mint(0x77 << 64, "acme");
        if l.reserve(now, id, &req).is_err() {
            return Ok(());
        }
        let later = now.saturating_add_ms(30_000);
        let usage = Usage {
            amounts: Amounts::new().with(Dimension::OUTPUT_TOKENS, used),
            ..Usage::default()
        };
        match end {
            0 => {}
            1 => { let _ = l.settle(now, id, &usage); }
            2 => { let _ = l.refund(now, id); }
            _ => { let _ = l.settle(later, id, &usage); } // expired, then a late settle
        }
        let res = l.get(later, id).cloned().expect("remembered");
        round_trip(&res);
    }
}
