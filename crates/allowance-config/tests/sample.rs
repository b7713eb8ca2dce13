//! Every key of CONFIG.md's sample block parses, with the value written
//! (the fixture is the block, copied, with real hashes for the elided ones).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use allowance_config::{Fsync, OnError, Role, StoreKind, load, parse};
use allowance_core::{CalendarUnit, Dimension, OverrunPolicy, Window, Zone};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn read(name: &str) -> String {
    std::fs::read_to_string(fixture(name)).expect("fixture exists")
}

/// SHA-256 in hex, decoded (test data only).
fn unhex(s: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex");
    }
    out
}

#[test]
fn the_sample_alone_names_two_undefined_plans() {
    // The sample shows every key but defines only two of the plans its kinds
    // name: a file is complete for plans, so these are errors, on their lines.
    let text = read("sample.toml");
    let err = parse(&text, "sample.toml").unwrap_err();
    let line_of = |needle: &str| {
        text.lines()
            .position(|l| l.contains(needle))
            .expect("line present")
            + 2 // the plan line follows the kind's header; lines are 1-based
    };
    let expected = [
        format!(
            "error: sample.toml:{}: key `kinds.agent.plan`: no plan named \"agent-default\" (defined: user-default, tenant-default)",
            line_of("[kinds.agent]")
        ),
        format!(
            "error: sample.toml:{}: key `kinds.task.plan`: no plan named \"task-default\" (defined: user-default, tenant-default)",
            line_of("[kinds.task]")
        ),
    ];
    assert_eq!(err.to_string(), expected.join("\n"));
}

#[test]
fn every_key_of_the_sample_parses_with_its_value() {
    let path = std::env::temp_dir().join(format!("allowance-sample-{}.toml", std::process::id()));
    let text = read("sample.toml") + &read("sample-completion.toml");
    std::fs::write(&path, &text).expect("write temp file");
    let loaded = load(&path);
    std::fs::remove_file(&path).ok();
    let config = loaded.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.source, path.display().to_string());

    assert_eq!(config.currency, "EUR");
    assert_eq!(
        config.server.listen,
        "127.0.0.1:8787".parse::<SocketAddr>().unwrap()
    );

    let store = &config.store;
    assert_eq!(store.kind, StoreKind::Embedded);
    assert_eq!(
        store.data_dir.as_deref(),
        Some(Path::new("./allowance-data"))
    );
    assert_eq!(store.url, None);
    assert_eq!(store.on_error, OnError::FailClosed);
    assert_eq!(store.fsync, Fsync::Always);
    assert_eq!(store.timeout_ms, 1000);
    assert_eq!(store.fail_open_fraction, 0.1);

    let s = config.catalog.settings();
    assert_eq!(
        (
            s.default_ttl_ms,
            s.max_ttl_ms,
            s.idempotency_retention_ms,
            s.ended_retention_ms
        ),
        (300_000, 3_600_000, 86_400_000, 86_400_000)
    );
    assert_eq!((s.max_scopes, s.max_labels), (8, 16));

    let q = &config.queue;
    assert_eq!(
        (q.max_waiters_per_tenant, q.max_waiters, q.max_wait_ms),
        (1000, 100_000, 60_000)
    );

    let c = &config.catalog;
    for (kind, plan) in [
        ("tenant", "tenant-default"),
        ("user", "user-default"),
        ("agent", "agent-default"),
        ("task", "task-default"),
    ] {
        let spec = c.kind(kind).unwrap_or_else(|| panic!("kind {kind}"));
        assert_eq!(spec.plan.as_deref(), Some(plan));
        assert!(!spec.shared);
    }
    let tool = c.kind("tool").expect("kind tool");
    assert!(tool.shared);
    assert_eq!(tool.plan, None);

    let user = c.plan("user-default").expect("user plan");
    let limits: Vec<(Dimension, u64, Window)> = user
        .limits()
        .iter()
        .map(|l| (l.dimension(), l.capacity(), l.window().clone()))
        .collect();
    assert_eq!(
        limits,
        [
            (
                Dimension::REQUESTS,
                60,
                Window::Bucket { period_ms: 60_000 }
            ),
            (
                Dimension::TOKENS,
                200_000,
                Window::Sliding {
                    period_ms: 3_600_000,
                    slices: 60
                }
            ),
            (
                Dimension::COST_MICROS,
                20_000_000,
                Window::Sliding {
                    period_ms: 86_400_000,
                    slices: 24
                }
            ),
            (Dimension::CONCURRENT, 4, Window::Concurrent),
        ]
    );
    let tenant = c.plan("tenant-default").expect("tenant plan");
    assert_eq!(tenant.overrun(), OverrunPolicy::ChargeActual);
    assert_eq!(tenant.queue_weight(), 1);
    assert_eq!(tenant.limits().len(), 2);
    let task = c.plan("task-default").expect("task plan");
    assert_eq!(
        task.limits()[0].window(),
        &Window::Calendar {
            unit: CalendarUnit::Month,
            zone: Zone::named("Europe/Paris").unwrap()
        }
    );

    let gpt = c.model("gpt-4o").expect("model");
    assert_eq!(
        (
            gpt.input_micros_per_million,
            gpt.cached_input_micros_per_million,
            gpt.output_micros_per_million
        ),
        (2_500_000, 1_250_000, 10_000_000)
    );
    assert_eq!(
        (gpt.max_output_tokens, gpt.tokenizer.as_str()),
        (16_384, "o200k_base")
    );

    assert_eq!(config.tokens.len(), 2);
    assert_eq!(config.tokens[0].role, Role::Admin);
    assert_eq!(
        config.tokens[0].sha256,
        unhex("9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08")
    );
    assert_eq!(config.tokens[1].role, Role::Tenant("acme".into()));

    let g = config.gateway.as_ref().expect("gateway");
    assert_eq!(
        (g.stream_tranche_tokens, g.max_body_bytes),
        (1024, 33_554_432)
    );
    let up = &g.upstreams[0];
    assert_eq!(
        (up.name.as_str(), up.base_url.as_str()),
        ("openai", "https://api.openai.com")
    );
    assert_eq!(up.api_key_env.as_deref(), Some("OPENAI_API_KEY"));
    assert_eq!(up.models, ["gpt-4o", "gpt-4o-mini"]);
    assert_eq!(
        (
            up.requests_per_minute,
            up.input_tokens_per_minute,
            up.output_tokens_per_minute,
            up.max_concurrent
        ),
        (Some(500), Some(30_000), Some(8_000), Some(50))
    );
    assert_eq!(up.max_retries, 3);
    let key = &g.keys[0];
    assert_eq!(
        key.sha256,
        unhex("fcde2b2edba56bf408601fb721fe9b5c338d10ee429ea04fae5511b68fbf8fb9")
    );
    assert_eq!(
        (key.tenant.as_str(), key.user.as_deref()),
        ("acme", Some("bob"))
    );
    assert_eq!(key.client_scopes, ["agent", "task"]);
}

#[test]
fn hashes_are_read_in_either_case() {
    let lower = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
    let text = format!(
        "[[tokens]]\nsha256 = \"{}\"\nrole = \"admin\"\n",
        lower.to_uppercase()
    );
    let config = parse(&text, "t.toml").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.tokens[0].sha256, unhex(lower));
}

#[test]
fn a_missing_file_is_one_error_naming_it() {
    let path = std::env::temp_dir().join("allowance-config-no-such-file.toml");
    let err = load(&path).unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with(&format!(
            "error: {}: cannot read the file: ",
            path.display()
        )),
        "{text}"
    );
    assert_eq!(err.problems.len(), 1);
}

#[test]
fn a_file_that_is_not_utf8_is_one_error_naming_it() {
    let path = std::env::temp_dir().join(format!("allowance-latin1-{}.toml", std::process::id()));
    std::fs::write(&path, b"currency = \"\xe9\"\n").expect("write temp file");
    let err = load(&path).unwrap_err();
    std::fs::remove_file(&path).ok();
    assert_eq!(
        err.to_string(),
        format!("error: {}: not UTF-8 text (byte 12)", path.display())
    );
}

#[test]
fn an_empty_file_is_the_defaults_with_only_the_tenant_kind() {
    let config = parse("", "empty.toml").unwrap_or_else(|e| panic!("{e}"));
    let kinds: Vec<&str> = config.catalog.kinds().map(|(k, _)| k).collect();
    assert_eq!(kinds, ["tenant"]);
    assert_eq!(config.catalog.kind("tenant").unwrap().plan, None);
    assert_eq!(config.catalog.plans().count(), 0);
    assert!(config.tokens.is_empty() && config.gateway.is_none());
    assert_eq!(config.store, allowance_config::StoreSettings::default());
    assert_eq!(config.queue, allowance_config::QueueSettings::default());
    assert_eq!(
        config.catalog.settings(),
        &allowance_core::Settings::default()
    );
}
