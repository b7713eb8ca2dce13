//! The JSON shapes shared with the admin API: HTTP-API.md's examples round
//! trip, errors name the field, and a refused plan changes nothing.

use allowance_config::{
    LimitSpec, PlanSpec, limit_from_spec, limit_to_spec, plan_from_spec, plan_to_spec,
};
use allowance_core::{CalendarUnit, Catalog, Dimension, Limit, OverrunPolicy, Window, Zone};
use serde_json::{Value, json};

/// HTTP-API.md "A limit in JSON", verbatim.
const EXAMPLES: [&str; 5] = [
    r#"{"dimension": "tokens", "capacity": 1000000, "window": "sliding", "period_ms": 3600000, "slices": 60}"#,
    r#"{"dimension": "requests", "capacity": 60, "window": "bucket", "period_ms": 60000}"#,
    r#"{"dimension": "cost_micros", "capacity": 20000000, "window": "calendar", "unit": "day"}"#,
    r#"{"dimension": "cost_micros", "capacity": 50000000, "window": "total"}"#,
    r#"{"dimension": "concurrent", "capacity": 4}"#,
];

#[test]
fn the_spec_examples_round_trip_exactly() {
    let mut catalog = Catalog::default();
    for text in EXAMPLES {
        let spec: LimitSpec = serde_json::from_str(text).expect(text);
        let limit = limit_from_spec(&spec, &mut catalog, "limits[0]")
            .unwrap_or_else(|e| panic!("{text}: {e}"));
        let back = serde_json::to_value(limit_to_spec(&limit, &catalog)).expect("serializes");
        let original: Value = serde_json::from_str(text).expect("json");
        assert_eq!(back, original, "{text}");
    }
}

#[test]
fn every_window_round_trips_through_json() {
    let mut catalog = Catalog::default();
    let ocr = catalog
        .add_dimension("ocr_pages")
        .expect("custom dimension");
    let limits = [
        Limit::new(
            Dimension::TOKENS,
            200_000,
            Window::Sliding {
                period_ms: 3_600_000,
                slices: 60,
            },
        ),
        Limit::new(
            Dimension::INPUT_TOKENS,
            7,
            Window::Sliding {
                period_ms: 1_000,
                slices: 1,
            },
        ),
        Limit::new(
            Dimension::REQUESTS,
            60,
            Window::Bucket { period_ms: 60_000 },
        ),
        Limit::new(
            Dimension::COST_MICROS,
            5_000_000,
            Window::Calendar {
                unit: CalendarUnit::Month,
                zone: Zone::named("Europe/Paris").unwrap(),
            },
        ),
        Limit::new(
            Dimension::OUTPUT_TOKENS,
            1 << 53,
            Window::Calendar {
                unit: CalendarUnit::Week,
                zone: Zone::utc(),
            },
        ),
        Limit::new(ocr, 100, Window::Total),
        Limit::new(Dimension::CONCURRENT, 20, Window::Concurrent)
            .and_then(|l| l.with_guaranteed(2)),
    ];
    for limit in limits {
        let limit = limit.expect("valid limit");
        let json = serde_json::to_string(&limit_to_spec(&limit, &catalog)).expect("serializes");
        let spec: LimitSpec = serde_json::from_str(&json).expect("parses back");
        let back =
            limit_from_spec(&spec, &mut catalog, "").unwrap_or_else(|e| panic!("{json}: {e}"));
        assert_eq!(back, limit, "{json}");
    }
}

#[test]
fn a_period_string_is_the_same_limit_as_its_milliseconds() {
    let mut catalog = Catalog::default();
    let by_string: LimitSpec = serde_json::from_value(json!(
        {"dimension": "tokens", "capacity": 10, "window": "sliding", "period": "1h"}))
    .unwrap();
    let by_ms: LimitSpec = serde_json::from_value(json!(
        {"dimension": "tokens", "capacity": 10, "window": "sliding", "period_ms": 3_600_000}))
    .unwrap();
    assert_eq!(
        limit_from_spec(&by_string, &mut catalog, "").unwrap(),
        limit_from_spec(&by_ms, &mut catalog, "").unwrap()
    );
}

/// The error's field and message for a limit given as JSON.
fn limit_error(value: Value) -> (String, String) {
    let spec: LimitSpec = serde_json::from_value(value).expect("shape is fine");
    let mut catalog = Catalog::default();
    let err = limit_from_spec(&spec, &mut catalog, "limits[2]").expect_err("refused");
    (err.field, err.message)
}

#[test]
fn limit_errors_name_the_field() {
    let cases = [
        (
            json!({"dimension": "tokens", "capacity": 5, "window": "weekly"}),
            "limits[2].window",
        ),
        (
            json!({"dimension": "tokens", "capacity": 5}),
            "limits[2].window",
        ),
        (
            json!({"dimension": "tokens", "capacity": 0, "window": "total"}),
            "limits[2].capacity",
        ),
        (
            json!({"dimension": "tokens", "capacity": 9_007_199_254_740_993_u64, "window": "total"}),
            "limits[2].capacity",
        ),
        (
            json!({"dimension": "tokens", "capacity": 5, "window": "sliding"}),
            "limits[2].period",
        ),
        (
            json!({"dimension": "tokens", "capacity": 5, "window": "sliding", "period_ms": 1001}),
            "limits[2].period_ms",
        ),
        (
            json!({"dimension": "tokens", "capacity": 5, "window": "sliding", "period": "1001ms"}),
            "limits[2].period",
        ),
        (
            json!({"dimension": "tokens", "capacity": 5, "window": "sliding", "period": "5x"}),
            "limits[2].period",
        ),
        (
            json!({"dimension": "tokens", "capacity": 5, "window": "sliding", "period": "1h", "period_ms": 3_600_000}),
            "limits[2].period",
        ),
        (
            json!({"dimension": "tokens", "capacity": 5, "window": "sliding", "period": "1h", "slices": 0}),
            "limits[2].slices",
        ),
        (
            json!({"dimension": "tokens", "capacity": 5, "window": "calendar"}),
            "limits[2].unit",
        ),
        (
            json!({"dimension": "tokens", "capacity": 5, "window": "calendar", "unit": "fortnight"}),
            "limits[2].unit",
        ),
        (
            json!({"dimension": "tokens", "capacity": 5, "window": "calendar", "unit": "day", "zone": "Mars/Olympus"}),
            "limits[2].zone",
        ),
        (
            json!({"dimension": "tokens", "capacity": 5, "window": "total", "zone": "UTC"}),
            "limits[2].zone",
        ),
        (
            json!({"dimension": "tokens", "capacity": 5, "window": "total", "guaranteed": 1}),
            "limits[2].guaranteed",
        ),
        (
            json!({"dimension": "concurrent", "capacity": 5, "guaranteed": 6}),
            "limits[2].guaranteed",
        ),
        (
            json!({"dimension": "concurrent", "capacity": 5, "window": "total"}),
            "limits[2].window",
        ),
        (
            json!({"dimension": "Tokens", "capacity": 5, "window": "total"}),
            "limits[2].dimension",
        ),
    ];
    for (value, field) in cases {
        let (got, message) = limit_error(value.clone());
        assert_eq!(got, field, "{value}: {message}");
        assert!(!message.is_empty());
    }
}

#[test]
fn unknown_json_fields_are_refused() {
    let err = serde_json::from_value::<LimitSpec>(json!(
        {"dimension": "tokens", "capacity": 5, "window": "total", "windw": "x"}))
    .unwrap_err();
    assert!(err.to_string().contains("unknown field `windw`"), "{err}");
    let err = serde_json::from_value::<PlanSpec>(json!({"limits": [], "overun": "x"})).unwrap_err();
    assert!(err.to_string().contains("unknown field `overun`"), "{err}");
    let err =
        serde_json::from_value::<PlanSpec>(json!({"overrun": "cap_at_estimate"})).unwrap_err();
    assert!(err.to_string().contains("missing field `limits`"), "{err}");
}

#[test]
fn plans_round_trip_and_errors_name_the_field() {
    let mut catalog = Catalog::default();
    let spec: PlanSpec = serde_json::from_value(json!({
        "limits": [
            {"dimension": "search_calls", "capacity": 100, "window": "calendar", "unit": "day", "zone": "Europe/Paris"},
            {"dimension": "concurrent", "capacity": 20, "guaranteed": 2},
        ],
        "overrun": "allow_overrun",
        "queue_weight": 3,
    }))
    .unwrap();
    let plan = plan_from_spec("enterprise", &spec, &mut catalog, "").unwrap();
    assert_eq!(plan.overrun(), OverrunPolicy::AllowOverrun { percent: 10 });
    assert_eq!(plan.queue_weight(), 3);
    let back = plan_to_spec(&plan, &catalog);
    assert_eq!(back.overrun_percent, Some(10));
    let again = plan_from_spec("enterprise", &back, &mut catalog, "").unwrap();
    assert_eq!(again.limits(), plan.limits());
    assert_eq!(
        (again.overrun(), again.queue_weight()),
        (plan.overrun(), plan.queue_weight())
    );

    let bad = |value: Value| {
        let spec: PlanSpec = serde_json::from_value(value).unwrap();
        plan_from_spec("p", &spec, &mut Catalog::default(), "plan")
            .unwrap_err()
            .field
    };
    assert_eq!(
        bad(json!({"limits": [], "overrun": "refund"})),
        "plan.overrun"
    );
    assert_eq!(
        bad(json!({"limits": [], "overrun_percent": 5})),
        "plan.overrun_percent"
    );
    assert_eq!(
        bad(json!({"limits": [], "overrun": "allow_overrun", "overrun_percent": 10_001})),
        "plan.overrun_percent"
    );
    assert_eq!(
        bad(json!({"limits": [], "queue_weight": 0})),
        "plan.queue_weight"
    );
    assert_eq!(
        bad(json!({"limits": [
            {"dimension": "tokens", "capacity": 5, "window": "total"},
            {"dimension": "tokens", "capacity": 5, "window": "sliding", "period": "90x"},
        ]})),
        "plan.limits[1].period"
    );
    assert_eq!(
        bad(json!({"limits": [
            {"dimension": "tokens", "capacity": 5, "window": "total"},
            {"dimension": "tokens", "capacity": 6, "window": "total"},
        ]})),
        "plan.limits[1]"
    );
}

#[test]
fn a_refused_plan_registers_no_dimension() {
    let mut catalog = Catalog::default();
    let spec: PlanSpec = serde_json::from_value(json!({"limits": [
        {"dimension": "ocr_pages", "capacity": 5, "window": "total"},
        {"dimension": "tokens", "capacity": 5, "window": "weekly"},
    ]}))
    .unwrap();
    assert!(plan_from_spec("p", &spec, &mut catalog, "").is_err());
    assert_eq!(catalog.dimension("ocr_pages"), None);

    // A single refused limit does not register its dimension either.
    let limit: LimitSpec = serde_json::from_value(json!(
        {"dimension": "ocr_pages", "capacity": 5, "window": "sliding"}))
    .unwrap();
    assert!(limit_from_spec(&limit, &mut catalog, "").is_err());
    assert_eq!(catalog.dimension("ocr_pages"), None);
}

#[test]
fn the_schemas_describe_the_shapes() {
    use utoipa::PartialSchema;
    let schema = serde_json::to_value(<LimitSpec as PartialSchema>::schema()).unwrap();
    let required: Vec<&str> = schema["required"]
        .as_array()
        .expect("required list")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(required, ["dimension", "capacity"]);
    for field in [
        "window",
        "period_ms",
        "period",
        "slices",
        "unit",
        "zone",
        "guaranteed",
    ] {
        assert!(
            schema["properties"][field].is_object(),
            "{field} in {schema}"
        );
    }
    let plan = serde_json::to_value(<PlanSpec as PartialSchema>::schema()).unwrap();
    assert!(plan["properties"]["limits"].is_object(), "{plan}");
}
