//! The built-in starter: it parses, it is the self-contained subset of the
//! sample CONFIG.md describes, and `check-config` output is stable through
//! a round trip of every plan through its JSON shape and back into TOML.

use std::collections::BTreeMap;

use allowance_config::{
    Config, Level, PlanSpec, STARTER, STARTER_SOURCE, StoreKind, check, parse, plan_from_spec,
    plan_to_spec, plans_table, starter,
};

#[test]
fn the_starter_parses_and_is_what_init_prints() {
    let config = parse(STARTER, STARTER_SOURCE).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.source, "<built-in starter>");
    assert_eq!(plans_table(&config), plans_table(&starter()));
}

#[test]
fn the_starter_is_self_contained_and_safe() {
    let config = starter();
    let c = &config.catalog;
    for kind in ["tenant", "user", "agent", "task"] {
        let spec = c.kind(kind).unwrap_or_else(|| panic!("kind {kind}"));
        assert!(!spec.shared, "{kind}");
        let plan = spec
            .plan
            .as_deref()
            .unwrap_or_else(|| panic!("{kind} has a plan"));
        assert!(
            c.plan(plan).is_some_and(|p| !p.limits().is_empty()),
            "{plan}"
        );
    }
    assert!(c.kind("tool").is_some_and(|k| k.shared));
    for model in ["gpt-4o", "gpt-4o-mini", "claude-sonnet-4-5"] {
        let price = c.model(model).unwrap_or_else(|| panic!("model {model}"));
        assert!(price.input_micros_per_million > 0 && price.output_micros_per_million > 0);
        assert!(price.cached_input_micros_per_million <= price.input_micros_per_million);
    }
    // No credentials, so loopback only; the gateway is there but commented out.
    assert!(config.tokens.is_empty());
    assert!(config.server.listen.ip().is_loopback());
    assert!(config.gateway.is_none());
    assert!(STARTER.lines().any(|l| l.trim() == "# [gateway]"));
    assert!(STARTER.lines().any(|l| l.trim() == "# [[tokens]]"));
    // The durable embedded store in ./allowance-data, fsync before answering.
    assert_eq!(config.store.kind, StoreKind::Embedded);
    assert_eq!(
        config.store.data_dir.as_deref(),
        Some(std::path::Path::new(allowance_config::DEFAULT_DATA_DIR))
    );
    // Uncommenting the gateway section (the file's end) gives a file that
    // still parses, once its key has a real hash.
    let hash = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
    let at = STARTER.find("# [gateway]").expect("gateway section");
    let gateway: String = STARTER[at..]
        .lines()
        .map(|l| {
            l.strip_prefix("# ")
                .unwrap_or(l)
                .replace("…64 hex digits…", hash)
                + "\n"
        })
        .collect();
    let uncommented = format!("{}{gateway}", &STARTER[..at]);
    let with_gateway = parse(&uncommented, "uncommented.toml").unwrap_or_else(|e| panic!("{e}"));
    let g = with_gateway.gateway.expect("gateway");
    assert_eq!(
        (g.upstreams[0].name.as_str(), g.keys[0].tenant.as_str()),
        ("openai", "acme")
    );
}

#[test]
fn the_starter_has_no_warnings_only_quorums() {
    let findings = check(&starter());
    assert!(!findings.is_empty(), "the quorums are reported");
    for f in &findings {
        assert_eq!(f.level, Level::Info, "{f}");
        assert!(f.message.contains("quorum"), "{f}");
    }
}

/// Writes a config's kinds and plans back as TOML, plans through their JSON shape.
fn kinds_and_plans_as_toml(config: &Config) -> String {
    let c = &config.catalog;
    let mut root = toml::Table::new();
    let mut kinds = toml::Table::new();
    for (name, spec) in c.kinds() {
        let mut k = toml::Table::new();
        if let Some(p) = &spec.plan {
            k.insert("plan".into(), toml::Value::String(p.clone()));
        }
        if spec.shared {
            k.insert("shared".into(), toml::Value::Boolean(true));
        }
        kinds.insert(name.to_string(), toml::Value::Table(k));
    }
    let plans: BTreeMap<String, PlanSpec> = c
        .plans()
        .map(|p| (p.name().to_string(), plan_to_spec(p, c)))
        .collect();
    root.insert("kinds".into(), toml::Value::Table(kinds));
    root.insert(
        "plans".into(),
        toml::Value::try_from(plans).expect("plans serialize"),
    );
    toml::to_string(&root).expect("serializes")
}

#[test]
fn plans_round_trip_through_json_and_toml() {
    let config = starter();
    let text = kinds_and_plans_as_toml(&config);
    let again = parse(&text, "round-trip.toml").unwrap_or_else(|e| panic!("{e}\n{text}"));
    for plan in config.catalog.plans() {
        let other = again.catalog.plan(plan.name()).expect("plan kept");
        assert_eq!(other.limits(), plan.limits());
        assert_eq!(
            (other.overrun(), other.queue_weight()),
            (plan.overrun(), plan.queue_weight())
        );
        let mut scratch = config.catalog.clone();
        let rebuilt = plan_from_spec(
            plan.name(),
            &plan_to_spec(plan, &config.catalog),
            &mut scratch,
            "",
        )
        .expect("a plan's own spec is valid");
        assert_eq!(rebuilt.limits(), plan.limits());
    }
    // The table lists kinds in file order; rows are otherwise the same.
    let sorted = |t: String| {
        let mut lines: Vec<String> = t.lines().map(str::to_string).collect();
        lines.sort();
        lines
    };
    assert_eq!(sorted(plans_table(&again)), sorted(plans_table(&config)));
}

#[test]
fn the_table_has_a_row_per_limit_in_aligned_columns() {
    let config = starter();
    let table = plans_table(&config);
    let header = table.lines().next().expect("header");
    let columns: Vec<usize> = ["KIND", "PLAN", "DIMENSION", "CAPACITY", "WINDOW", "PERIOD"]
        .iter()
        .map(|h| header.find(h).expect("column"))
        .collect();
    let c = &config.catalog;
    let mut rows = 0;
    for (kind, spec) in c.kinds() {
        let plan = c
            .plan(spec.plan.as_deref().expect("every starter kind has a plan"))
            .unwrap();
        for limit in plan.limits() {
            let dim = c.dimension_name(limit.dimension());
            let row = table
                .lines()
                .find(|l| {
                    l.get(columns[0]..).is_some_and(|s| s.starts_with(kind))
                        && l.get(columns[2]..)
                            .is_some_and(|s| s.starts_with(&format!("{dim} ")))
                })
                .unwrap_or_else(|| panic!("row for {kind} {dim} in\n{table}"));
            assert!(row[columns[1]..].starts_with(plan.name()), "{row}");
            assert!(
                row[columns[4]..].starts_with(limit.window().kind().as_str()),
                "{row}"
            );
            rows += 1;
        }
    }
    let table_rows = table.lines().skip(1).take_while(|l| !l.is_empty()).count();
    assert_eq!(table_rows, rows);
}
