//! `check`: self-defeating plans are named with their numbers; sound ones
//! only get their quorum as info.

use allowance_config::{Level, Warning, check, parse, plans_table};

fn findings(text: &str) -> Vec<Warning> {
    let config = parse(text, "check.toml").unwrap_or_else(|e| panic!("{e}"));
    check(&config)
}

const PLANS: &str = r#"
[kinds.tenant]
plan = "tenant"
[kinds.user]
plan = "user"
[kinds.agent]
plan = "agent"
[kinds.task]
plan = "task"
[kinds.tool]
shared = true
plan = "tool"

[plans.tenant]
overrun = "cap_at_estimate"
limits = [
  { dimension = "tokens", capacity = 100_000, window = "sliding", period = "1h", slices = 60 },
  { dimension = "cost_micros", capacity = 9_000_000, window = "calendar", unit = "day" },
]
[plans.user]
limits = [
  { dimension = "tokens", capacity = 100_000, window = "sliding", period = "1h", slices = 60 },
  { dimension = "tokens", capacity = 900_000, window = "sliding", period = "24h", slices = 24 },
]
[plans.agent]
limits = [
  { dimension = "tokens", capacity = 30_000, window = "sliding", period = "1h", slices = 12 },
  { dimension = "cost_micros", capacity = 3_000_000, window = "calendar", unit = "day", zone = "Europe/Paris" },
]
[plans.task]
limits = [{ dimension = "tokens", capacity = 25_000, window = "sliding", period_ms = 3_600_000 }]
[plans.tool]
limits = [{ dimension = "tokens", capacity = 5_000_000, window = "sliding", period = "1h" }]
"#;

#[test]
fn a_nested_cap_at_the_tenant_cap_is_a_shared_fuse() {
    let found = findings(PLANS);
    let warnings: Vec<&Warning> = found.iter().filter(|w| w.level == Level::Warning).collect();
    assert_eq!(warnings.len(), 1, "{found:#?}");
    let w = warnings[0];
    assert_eq!(w.plans, ["user", "tenant"]);
    assert_eq!(
        w.message,
        "kind `user` (plan `user`) caps tokens (sliding 1h) at 100_000, at or above the tenant \
         plan `tenant`'s 100_000: quorum 1; the tenant cap is a shared fuse one user can blow \
         for everybody"
    );
}

#[test]
fn every_other_pair_reports_its_quorum_as_info() {
    let infos: Vec<String> = findings(PLANS)
        .into_iter()
        .filter(|w| w.level == Level::Info)
        .map(|w| w.message)
        .collect();
    // agent: same period, other slices, still the same window; a 3.33 quorum.
    // task: period_ms spelling of the same hour. The 24h user limit, the
    // Paris-day agent limit (the tenant's day is UTC) and the shared tool
    // have no counterpart.
    assert_eq!(
        infos,
        [
            "kind `agent` (plan `agent`) vs tenant (plan `tenant`), tokens (sliding 1h): quorum \
             100_000 ÷ 30_000 = 3.33: that many agent scopes at their cap exhaust the tenant",
            "kind `task` (plan `task`) vs tenant (plan `tenant`), tokens (sliding 1h): quorum \
             100_000 ÷ 25_000 = 4: that many task scopes at their cap exhaust the tenant",
        ]
    );
}

#[test]
fn overrun_and_guarantees_off_the_tenant_plan_and_unused_plans() {
    let text = r#"
[kinds.tenant]
plan = "tenant"
[kinds.user]
plan = "user"

[plans.tenant]
overrun = "allow_overrun"
limits = [{ dimension = "concurrent", capacity = 20, guaranteed = 2 }]
[plans.user]
overrun = "allow_overrun"
overrun_percent = 25
limits = [{ dimension = "concurrent", capacity = 4, guaranteed = 1 }]
[plans.enterprise]
limits = []
"#;
    let messages: Vec<String> = findings(text)
        .into_iter()
        .filter(|w| w.level == Level::Warning)
        .map(|w| w.message)
        .collect();
    assert_eq!(
        messages,
        [
            "plan `user` sets overrun = \"allow_overrun\" (25%), but the overrun policy is read \
             from the tenant's plan only (the tenant kind's is `tenant`): it has no effect unless \
             a tenant is moved to `user` by an override",
            "plan `user` guarantees 1 concurrent reservations, but guarantees are read from the \
             tenant's plan only: it has no effect unless a tenant is moved to `user` by an override",
            "plan `enterprise` is the default plan of no kind: only an override (PUT /v1/scopes/…) \
             can put a scope on it",
        ]
    );
}

#[test]
fn a_custom_dimension_close_to_a_built_in_one_is_a_likely_typo() {
    let text = r#"
[kinds.user]
plan = "user"
[plans.user]
limits = [
  { dimension = "token", capacity = 5, window = "total" },
  { dimension = "search_calls", capacity = 5, window = "total" },
]
"#;
    let messages: Vec<String> = findings(text).into_iter().map(|w| w.message).collect();
    assert_eq!(
        messages,
        [
            "plan `user` counts a custom dimension `token`, close to the built-in `tokens`: a \
          reservation's tokens never counts against it (a typo?)"
        ]
    );
}

#[test]
fn deployment_warnings() {
    let text = r#"
[server]
listen = "0.0.0.0:8787"
[queue]
max_waiters_per_tenant = 500
max_waiters = 100
[[gateway.upstreams]]
name = "local"
base_url = "http://127.0.0.1:9000"
models = ["*"]
"#;
    let messages: Vec<String> = findings(text).into_iter().map(|w| w.to_string()).collect();
    assert_eq!(
        messages,
        [
            "warning: queue.max_waiters_per_tenant (500) is above queue.max_waiters (100): the \
             global bound is reached first",
            "warning: no [[tokens]] while listening on 0.0.0.0:8787: the server will refuse to \
             start without credentials unless run with --insecure-no-auth",
            "warning: [gateway] has no [[gateway.keys]]: no client can call it",
        ]
    );
}

#[test]
fn the_table_ends_with_the_overrun_policy_and_the_findings() {
    let config = parse(PLANS, "check.toml").unwrap();
    let table = plans_table(&config);
    assert!(
        table.contains(
            "\noverrun: cap_at_estimate (from the tenant plan `tenant`); queue weight 1\n"
        ),
        "{table}"
    );
    for w in check(&config) {
        assert!(table.contains(&format!("\n{w}\n")), "{w} in\n{table}");
    }
    assert!(table.contains("\ntool (shared)  tool "), "{table}");
    assert!(table.contains("calendar  day Europe/Paris"), "{table}");
}

#[test]
fn the_table_shows_each_upstream_s_own_limits() {
    let config = parse(
        r#"
[gateway]
[[gateway.upstreams]]
name = "openai"
base_url = "https://api.openai.com"
models = ["gpt-4o"]
requests_per_minute = 500
output_tokens_per_minute = 8000
max_concurrent = 50
[[gateway.keys]]
sha256 = "fcde2b2edba56bf408601fb721fe9b5c338d10ee429ea04fae5511b68fbf8fb9"
tenant = "acme"
"#,
        "gw.toml",
    )
    .unwrap();
    let table = plans_table(&config);
    // Columns are padded: compare rows with their spaces collapsed.
    let rows: Vec<String> = table
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    for row in [
        "upstream (shared) - (no limits)",
        "upstream:openai upstream-openai requests 500 bucket 1m",
        "upstream:openai upstream-openai output_tokens 8_000 bucket 1m",
        "upstream:openai upstream-openai concurrent 50 concurrent -",
    ] {
        assert!(rows.iter().any(|r| r == row), "{row} in\n{table}");
    }
    assert!(!table.contains("~gateway"), "{table}");
}

#[test]
fn store_settings_the_rest_of_the_file_makes_moot() {
    let messages =
        |text: &str| -> Vec<String> { findings(text).into_iter().map(|w| w.to_string()).collect() };
    assert_eq!(
        messages("[store]\ndata_dir = \"\"\nfsync = \"never\"\n"),
        [
            "warning: store.fsync has no effect with data_dir = \"\": the ledger is kept in \
          memory only"
        ]
    );
    // Where they apply, no warning.
    assert!(
        messages(
            "[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1/0\"\non_error = \
             \"fail_open_local\"\nfail_open_fraction = 0.2\n"
        )
        .is_empty()
    );
    assert!(messages("[store]\ndata_dir = \"./d\"\nfsync = \"never\"\n").is_empty());
}

#[test]
fn a_routed_model_without_a_price_under_a_cost_limit_is_refused_at_every_call() {
    let text = r#"
[kinds.tenant]
plan = "t"
[plans.t]
limits = [{ dimension = "cost_micros", capacity = 1_000_000, window = "total" }]
[models."gpt-4o"]
input_per_million = "2.50"
output_per_million = "10.00"
[[gateway.upstreams]]
name = "openai"
base_url = "http://127.0.0.1:9000"
models = ["gpt-4o", "gpt-4o-mini"]
[[gateway.keys]]
sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
tenant = "acme"
"#;
    let messages: Vec<String> = findings(text).into_iter().map(|w| w.to_string()).collect();
    assert_eq!(
        messages,
        [
            "warning: upstream `openai` routes model \"gpt-4o-mini\", which has no price in \
          [models], while plan `t` limits cost_micros: the gateway refuses every call to it \
          (price it under [models.\"gpt-4o-mini\"])"
        ]
    );
    // Without a cost limit an unpriced model is fine.
    let no_cost = text.replace("cost_micros", "tokens");
    assert!(findings(&no_cost).is_empty(), "{:?}", findings(&no_cost));
}
