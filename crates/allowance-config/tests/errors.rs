//! Bad files: each problem is one line naming the file, the offending key's
//! line and the key; all problems are listed, in line order; a bad file
//! gives no configuration at all.

use allowance_config::parse;

const HASH: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

/// Parses `text` as `bad.toml` and compares the error lines with `expected`.
fn check(text: &str, expected: &[&str]) {
    let err = match parse(text, "bad.toml") {
        Ok(_) => panic!("accepted a bad file:\n{text}"),
        Err(e) => e,
    };
    let lines: Vec<String> = err.to_string().lines().map(str::to_string).collect();
    assert_eq!(lines, expected, "for the file:\n{text}");
    assert_eq!(err.problems.len(), expected.len());
}

#[test]
fn unknown_key_at_top_level() {
    check(
        "currency = \"EUR\"\ncurency = \"USD\"\n",
        &[
            "error: bad.toml:2: key `curency`: unknown key; expected one of \"currency\", \"server\", \"store\", \"reservations\", \"queue\", \"kinds\", \"plans\", \"models\", \"tokens\", \"gateway\"",
        ],
    );
}

#[test]
fn unknown_key_in_a_limit() {
    check(
        "[plans.free]\nlimits = [\n  { dimension = \"tokens\", capacity = 5, window = \"total\" },\n  { dimension = \"tokens\", capacity = 5, window = \"sliding\", period = \"1h\", slice = 60 },\n]\n",
        &[
            "error: bad.toml:4: key `plans.free.limits[1].slice`: unknown key; expected one of \"dimension\", \"capacity\", \"window\", \"period\", \"period_ms\", \"slices\", \"unit\", \"zone\", \"guaranteed\"",
        ],
    );
}

#[test]
fn unknown_key_in_a_plan() {
    check(
        "[plans.free]\nlimits = []\nweight = 2\n",
        &[
            "error: bad.toml:3: key `plans.free.weight`: unknown key; expected one of \"limits\", \"overrun\", \"overrun_percent\", \"queue_weight\"",
        ],
    );
}

#[test]
fn bad_window_names_its_limit_and_line() {
    check(
        "[plans.free]\nlimits = [\n  { dimension = \"requests\", capacity = 60, window = \"bucket\", period = \"1m\" },\n  { dimension = \"concurrent\", capacity = 4 },\n  { dimension = \"tokens\", capacity = 1000, window = \"weekly\" },\n]\n",
        &[
            "error: bad.toml:5: key `plans.free.limits[2].window`: expected one of \"sliding\", \"bucket\", \"calendar\", \"total\", \"concurrent\", got \"weekly\"",
        ],
    );
}

#[test]
fn a_window_is_required_but_for_concurrent() {
    check(
        "[plans.free]\nlimits = [{ dimension = \"tokens\", capacity = 1000 }]\n",
        &[
            "error: bad.toml:2: key `plans.free.limits[0].window`: required for dimension \"tokens\": expected one of \"sliding\", \"bucket\", \"calendar\", \"total\", \"concurrent\"",
        ],
    );
}

#[test]
fn bad_duration() {
    check(
        "[plans.free]\nlimits = [{ dimension = \"requests\", capacity = 60, window = \"bucket\", period = \"5x\" }]\n",
        &[
            "error: bad.toml:2: key `plans.free.limits[0].period`: expected a duration such as \"90s\", \"1m\" or \"24h\" (a whole number and one of the units ms, s, m, h, d), got \"5x\"",
        ],
    );
    check(
        "[store]\ntimeout = \"5x\"\n",
        &[
            "error: bad.toml:2: key `store.timeout`: expected a duration such as \"90s\", \"1m\" or \"24h\" (a whole number and one of the units ms, s, m, h, d), got \"5x\"",
        ],
    );
}

#[test]
fn a_duration_has_a_string_or_an_integer_under_its_ms_key() {
    check(
        "[store]\ntimeout = 5000\n",
        &[
            "error: bad.toml:2: key `store.timeout`: expected a duration string such as \"90s\", \"1m\" or \"24h\", got an integer (an integer goes under `timeout_ms`, in milliseconds)",
        ],
    );
    check(
        "[queue]\nmax_wait_ms = \"30s\"\n",
        &[
            "error: bad.toml:2: key `queue.max_wait_ms`: expected an integer number of milliseconds, got a string (a string such as \"90s\" goes under `max_wait`)",
        ],
    );
}

#[test]
fn both_period_and_period_ms() {
    check(
        "[plans.free]\nlimits = [{ dimension = \"requests\", capacity = 60, window = \"bucket\", period = \"1m\", period_ms = 60000 }]\n",
        &[
            "error: bad.toml:2: key `plans.free.limits[0].period`: give either `period` (a string such as \"1h\") or `period_ms`, not both",
        ],
    );
    check(
        "[reservations]\ndefault_ttl = \"5m\"\ndefault_ttl_ms = 300000\n",
        &[
            "error: bad.toml:3: key `reservations.default_ttl_ms`: give either `default_ttl` (a string such as \"90s\") or `default_ttl_ms`, not both",
        ],
    );
}

#[test]
fn default_ttl_above_max_ttl() {
    check(
        "[reservations]\ndefault_ttl_ms = 600_000\nmax_ttl_ms = 300_000\n",
        &[
            "error: bad.toml:2: key `reservations.default_ttl_ms`: the default TTL (10m) is above the maximum TTL (5m)",
        ],
    );
    // With the default left out, the maximum is the key written, so it is named.
    check(
        "[reservations]\nmax_ttl = \"1m\"\n",
        &[
            "error: bad.toml:2: key `reservations.max_ttl`: the maximum TTL (1m) is below the default TTL (5m, the default)",
        ],
    );
}

#[test]
fn redis_with_data_dir_and_redis_without_url() {
    check(
        "[store]\nkind = \"redis\"\ndata_dir = \"./data\"\n",
        &[
            "error: bad.toml:2: key `store.url`: required when kind = \"redis\" (such as \"redis://127.0.0.1:6379/0\")",
            "error: bad.toml:3: key `store.data_dir`: only for kind = \"embedded\": a redis store keeps its data in Redis",
        ],
    );
    check(
        "[store]\nurl = \"redis://127.0.0.1:6379/0\"\n",
        &[
            "error: bad.toml:2: key `store.url`: only for kind = \"redis\" (the embedded store keeps its data in `data_dir`)",
        ],
    );
}

#[test]
fn unknown_zone() {
    check(
        "[plans.free]\nlimits = [\n  { dimension = \"cost_micros\", capacity = 5_000_000, window = \"calendar\", unit = \"month\", zone = \"Mars/Olympus\" },\n]\n",
        &[
            "error: bad.toml:3: key `plans.free.limits[0].zone`: unknown time zone \"Mars/Olympus\" (expected an IANA name such as \"Europe/Paris\", or \"UTC\")",
        ],
    );
}

#[test]
fn bad_hash() {
    check(
        "[[tokens]]\nsha256 = \"9f86d0\"\nrole = \"admin\"\n",
        &[
            "error: bad.toml:2: key `tokens[0].sha256`: expected a SHA-256 as 64 hex digits (`allowance token` prints one), got 6 characters",
        ],
    );
    let not_hex = format!("{}zz", &HASH[..62]);
    check(
        &format!("[[tokens]]\nrole = \"admin\"\nsha256 = \"{not_hex}\"\n"),
        &[
            "error: bad.toml:3: key `tokens[0].sha256`: expected a SHA-256 as 64 hex digits (0-9, a-f, either case)",
        ],
    );
}

#[test]
fn tenant_token_without_tenant_and_admin_with_one() {
    check(
        &format!("[[tokens]]\nsha256 = \"{HASH}\"\nrole = \"tenant\"\n"),
        &[
            "error: bad.toml:3: key `tokens[0].tenant`: required when role = \"tenant\": the tenant this token acts for",
        ],
    );
    check(
        &format!("[[tokens]]\nsha256 = \"{HASH}\"\nrole = \"admin\"\ntenant = \"acme\"\n"),
        &[
            "error: bad.toml:4: key `tokens[0].tenant`: an admin token has no tenant (it acts on every tenant); remove it or use role = \"tenant\"",
        ],
    );
}

#[test]
fn undefined_plan() {
    check(
        "[kinds.user]\nplan = \"free\"\n\n[plans.pro]\nlimits = []\n",
        &["error: bad.toml:2: key `kinds.user.plan`: no plan named \"free\" (defined: pro)"],
    );
}

#[test]
fn negative_capacity_and_capacity_as_string() {
    check(
        "[plans.free]\nlimits = [{ dimension = \"tokens\", capacity = -5, window = \"total\" }]\n",
        &[
            "error: bad.toml:2: key `plans.free.limits[0].capacity`: expected an integer between 1 and 2^53, got -5",
        ],
    );
    check(
        "[plans.free]\nlimits = [{ dimension = \"tokens\", capacity = \"5\", window = \"total\" }]\n",
        &[
            "error: bad.toml:2: key `plans.free.limits[0].capacity`: expected an integer between 1 and 2^53, got a string",
        ],
    );
    check(
        "[plans.free]\nlimits = [{ dimension = \"tokens\", capacity = 0, window = \"total\" }]\n",
        &[
            "error: bad.toml:2: key `plans.free.limits[0].capacity`: expected an integer between 1 and 2^53, got 0",
        ],
    );
}

#[test]
fn toml_syntax_error_names_its_line() {
    check(
        "currency = \"EUR\"\n[server]\nlisten = \"127.0.0.1:8787\n",
        &["error: bad.toml:3: invalid TOML: invalid basic string, expected `\"`"],
    );
    check(
        "currency = \"EUR\"\n[server]\nlisten = 127.0.0.1:8787\n",
        &["error: bad.toml:3: invalid TOML: invalid float, expected nothing"],
    );
}

#[test]
fn several_problems_give_several_lines_in_line_order() {
    check(
        "[store]\nfsync = \"sometimes\"\n\n[plans.free]\nlimits = [\n  { dimension = \"tokens\", capacity = -1, window = \"total\" },\n  { dimension = \"tokens\", capacity = 5, window = \"weekly\" },\n]\noverrun = \"refund\"\n\n[kinds.user]\nplan = \"paid\"\ncolour = \"blue\"\n",
        &[
            "error: bad.toml:2: key `store.fsync`: expected one of \"always\", \"batch\", \"never\", got \"sometimes\"",
            "error: bad.toml:6: key `plans.free.limits[0].capacity`: expected an integer between 1 and 2^53, got -1",
            "error: bad.toml:7: key `plans.free.limits[1].window`: expected one of \"sliding\", \"bucket\", \"calendar\", \"total\", \"concurrent\", got \"weekly\"",
            "error: bad.toml:9: key `plans.free.overrun`: expected one of \"charge_actual\", \"cap_at_estimate\", \"allow_overrun\", got \"refund\"",
            "error: bad.toml:12: key `kinds.user.plan`: no plan named \"paid\" (defined: free)",
            "error: bad.toml:13: key `kinds.user.colour`: unknown key; expected one of \"plan\", \"shared\"",
        ],
    );
}

#[test]
fn limit_parameters_that_do_not_apply_are_errors() {
    check(
        "[plans.free]\nlimits = [{ dimension = \"tokens\", capacity = 5, window = \"total\", period = \"1h\" }]\n",
        &["error: bad.toml:2: key `plans.free.limits[0].period`: a total window takes no `period`"],
    );
    check(
        "[plans.free]\nlimits = [{ dimension = \"tokens\", capacity = 5, window = \"bucket\", period = \"1h\", slices = 6 }]\n",
        &[
            "error: bad.toml:2: key `plans.free.limits[0].slices`: a bucket window takes no `slices`",
        ],
    );
    check(
        "[plans.free]\nlimits = [{ dimension = \"tokens\", capacity = 5, window = \"sliding\", period = \"1001ms\" }]\n",
        &[
            "error: bad.toml:2: key `plans.free.limits[0].period`: 1001 ms is not a multiple of 60 slices",
        ],
    );
    check(
        "[plans.free]\nlimits = [{ dimension = \"concurrent\", capacity = 4, guaranteed = 5 }]\n",
        &["error: bad.toml:2: key `plans.free.limits[0].guaranteed`: 5 is above the capacity 4"],
    );
    check(
        "[plans.free]\nlimits = [{ dimension = \"concurrent\", capacity = 4, window = \"sliding\", period = \"1h\" }]\n",
        &[
            "error: bad.toml:2: key `plans.free.limits[0].window`: the dimension `concurrent` takes no window, and only it is a concurrency gauge",
        ],
    );
}

#[test]
fn plan_level_problems() {
    check(
        "[plans.free]\nlimits = [\n  { dimension = \"tokens\", capacity = 5, window = \"total\" },\n  { dimension = \"tokens\", capacity = 9, window = \"total\" },\n]\n",
        &[
            "error: bad.toml:4: key `plans.free.limits[1]`: duplicates an earlier limit (same dimension and window)",
        ],
    );
    check(
        "[plans.free]\nlimits = []\noverrun = \"cap_at_estimate\"\noverrun_percent = 5\n",
        &[
            "error: bad.toml:4: key `plans.free.overrun_percent`: only with overrun = \"allow_overrun\"",
        ],
    );
    check(
        "[plans.free]\nlimits = []\nqueue_weight = 0\n",
        &[
            "error: bad.toml:3: key `plans.free.queue_weight`: expected an integer between 1 and 1000, got 0",
        ],
    );
}

#[test]
fn plan_names_are_those_the_admin_api_takes() {
    check(
        "[kinds.user]\nplan = \"a b\"\n\n[plans.\"a b\"]\nlimits = []\n",
        &[
            "error: bad.toml:4: key `plans.\"a b\"`: invalid plan name \"a b\": expected [A-Za-z0-9._-]{1,64}",
        ],
    );
    check(
        "[plans.\"override:tenant:acme\"]\n",
        &[
            "error: bad.toml:1: key `plans.\"override:tenant:acme\"`: invalid plan name \"override:tenant:acme\": expected [A-Za-z0-9._-]{1,64}",
        ],
    );
}

#[test]
fn plan_names_follow_the_engine() {
    let long = "p".repeat(65);
    check(
        &format!("[kinds.user]\nplan = \"{long}\"\n\n[plans.{long}]\nlimits = []\n"),
        &[&format!(
            "error: bad.toml:4: key `plans.{long}`: invalid plan name: a plan name has 1 to 64 characters"
        )],
    );
}

#[test]
fn kinds_and_dimensions() {
    check(
        "[kinds.tenant]\nshared = true\n",
        &["error: bad.toml:2: key `kinds.tenant.shared`: the tenant kind cannot be shared"],
    );
    check(
        "[kinds.Users]\n",
        &[
            "error: bad.toml:1: key `kinds.Users`: invalid kind name: expected [a-z][a-z0-9_-]{0,31}",
        ],
    );
    check(
        "[plans.free]\nlimits = [{ dimension = \"Search-Calls\", capacity = 5, window = \"total\" }]\n",
        &[
            "error: bad.toml:2: key `plans.free.limits[0].dimension`: \"Search-Calls\" is neither a built-in dimension (requests, concurrent, input_tokens, output_tokens, tokens, cost_micros) nor a valid custom name ([a-z][a-z0-9_]{0,31})",
        ],
    );
}

#[test]
fn models() {
    check(
        "[models.\"gpt-4.1\"]\ninput_per_million = 2.5\noutput_per_million = \"8.00\"\n",
        &[
            "error: bad.toml:2: key `models.\"gpt-4.1\".input_per_million`: write prices as strings (\"2.5\"): a float cannot hold every decimal exactly",
        ],
    );
    check(
        "[models.m]\ninput_per_million = \"0.0000001\"\n",
        &[
            "error: bad.toml:1: key `models.m.output_per_million`: required: a decimal price per million tokens such as \"2.50\"",
            "error: bad.toml:2: key `models.m.input_per_million`: price \"0.0000001\": at most 6 decimals (one micro-unit per million tokens)",
        ],
    );
    check(
        "[models.m]\ninput_per_million = \"1\"\noutput_per_million = \"2\"\ntokenizer = \"p50k_base\"\n",
        &[
            "error: bad.toml:4: key `models.m.tokenizer`: expected one of \"o200k_base\", \"cl100k_base\", got \"p50k_base\"",
        ],
    );
}

#[test]
fn server_and_store_values() {
    check(
        "[server]\nlisten = \"localhost\"\n",
        &[
            "error: bad.toml:2: key `server.listen`: expected an IP address and port such as \"127.0.0.1:8787\", got \"localhost\"",
        ],
    );
    check(
        "[store]\nfail_open_fraction = 1.5\n",
        &[
            "error: bad.toml:2: key `store.fail_open_fraction`: expected a share above 0 and at most 1 (such as 0.1), got 1.5",
        ],
    );
    for bad in ["euro", "XYZ", "eur"] {
        check(
            &format!("currency = \"{bad}\"\n"),
            &[&format!(
                "error: bad.toml:1: key `currency`: expected an ISO 4217 code such as \"EUR\" or \"USD\", got \"{bad}\""
            )],
        );
    }
    for good in ["AED", "CHF", "JPY", "USD", "ZWG"] {
        allowance_config::parse(&format!("currency = \"{good}\"\n"), "ok.toml")
            .unwrap_or_else(|e| panic!("{good}: {e}"));
    }
    check(
        "[store]\nkind = \"redis\"\nurl = \"redis://r:6379\"\nfsync = \"never\"\n",
        &[
            "error: bad.toml:4: key `store.fsync`: only for kind = \"embedded\" (Redis has its own persistence settings)",
        ],
    );
}

#[test]
fn tokens_and_gateway_keys_are_separate() {
    check(
        &format!(
            "[[tokens]]\nsha256 = \"{HASH}\"\nrole = \"admin\"\n[[tokens]]\nsha256 = \"{}\"\nrole = \"tenant\"\ntenant = \"acme\"\n",
            HASH.to_uppercase()
        ),
        &[
            "error: bad.toml:5: key `tokens[1].sha256`: the same hash as tokens[0]: one token has one role",
        ],
    );
    check(
        &format!(
            "[[tokens]]\nsha256 = \"{HASH}\"\nrole = \"admin\"\n\n[gateway]\n[[gateway.upstreams]]\nname = \"openai\"\nbase_url = \"https://api.openai.com\"\nmodels = [\"*\"]\n[[gateway.keys]]\nsha256 = \"{HASH}\"\ntenant = \"acme\"\n"
        ),
        &[
            "error: bad.toml:11: key `gateway.keys[0].sha256`: the same secret as an API token in [[tokens]]: a gateway key and an API token must differ (CONFIG.md answer 7)",
        ],
    );
}

#[test]
fn gateway_upstreams() {
    check(
        "[gateway]\nmax_body_bytes = 1024\n",
        &[
            "error: bad.toml:1: key `gateway.upstreams`: required: at least one [[gateway.upstreams]] to forward calls to",
        ],
    );
    check(
        "[[gateway.upstreams]]\nname = \"openai\"\nbase_url = \"https://api.openai.com/v1\"\nmodels = [\"gpt-4o\"]\n[[gateway.upstreams]]\nname = \"azure\"\nbase_url = \"https://example.invalid\"\nmodels = [\"gpt-4o\"]\n",
        &[
            "error: bad.toml:3: key `gateway.upstreams[0].base_url`: leave out `/v1`: the client's path (/v1/chat/completions) is appended as received, got \"https://api.openai.com/v1\"",
        ],
    );
    check(
        "[[gateway.upstreams]]\nname = \"openai\"\nbase_url = \"https://api.openai.com\"\nmodels = [\"gpt-4o\"]\n[[gateway.upstreams]]\nname = \"azure\"\nbase_url = \"https://example.invalid\"\nmodels = [\"gpt-4o\"]\n",
        &[
            "error: bad.toml:8: key `gateway.upstreams[1].models`: model \"gpt-4o\" is already routed to upstream \"openai\"",
        ],
    );
    check(
        "[[gateway.upstreams]]\nname = \"openai\"\nbase_url = \"https://api.openai.com\"\nmodels = [\"*\"]\n[[gateway.keys]]\nsha256 = \"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\"\ntenant = \"acme\"\nuser = \"bob\"\nclient_scopes = [\"agent\"]\n",
        &[
            "error: bad.toml:8: key `gateway.keys[0].user`: needs a configured, non-shared kind `user` ([kinds.user])",
            "error: bad.toml:9: key `gateway.keys[0].client_scopes`: \"agent\" is not a configured kind a client may add (not tenant, not shared)",
        ],
    );
}

#[test]
fn every_prefix_of_a_valid_file_fails_cleanly_or_parses() {
    // No input panics: cut the starter at every byte and parse what is left.
    let starter = allowance_config::STARTER;
    // Every line end, and every 7th character between (debug builds are slow).
    let cuts = starter
        .char_indices()
        .filter(|(i, c)| *c == '\n' || i % 7 == 0)
        .map(|(i, _)| i);
    for cut in cuts {
        let _ = parse(&starter[..cut], "cut.toml");
    }
}

/// Every key has a default: a plan written without `limits` limits nothing.
#[test]
fn a_plan_without_limits_limits_nothing() {
    let config = allowance_config::parse(
        "[kinds.user]\nplan = \"free\"\n\n[plans.free]\noverrun = \"charge_actual\"\n",
        "ok.toml",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let free = config
        .catalog
        .plans()
        .find(|p| p.name() == "free")
        .expect("the plan is there");
    assert!(free.limits().is_empty());
}

/// A key or table written twice is named, once per mistake (the keys of a
/// duplicated table are not reported again).
#[test]
fn a_duplicate_names_the_key_or_table() {
    check(
        "currency = \"EUR\"\ncurrency = \"USD\"\n",
        &["error: bad.toml:2: invalid TOML: the key `currency` is defined twice"],
    );
    check(
        "[plans.p]\nlimits = []\n\n[plans.p] # again\nlimits = []\n\n[plans.q]\nlimits = []\nlimits = []\n",
        &[
            "error: bad.toml:4: invalid TOML: the table `[plans.p]` is defined twice",
            "error: bad.toml:9: invalid TOML: the key `limits` is defined twice",
        ],
    );
    check(
        "[plans.p]\nlimits = [{ dimension = \"tokens\", dimension = \"requests\", capacity = 1 }]\n",
        &["error: bad.toml:2: invalid TOML: the key `dimension` is defined twice"],
    );
}

/// The gateway's `upstream` kind must be shared: the error is on the line
/// that says otherwise (or the kind's own table), not the first kind's.
#[test]
fn an_unshared_upstream_kind_is_reported_where_it_is_written() {
    let gateway = "[[gateway.upstreams]]\nname = \"openai\"\nbase_url = \"http://127.0.0.1:9\"\nmodels = [\"*\"]\n";
    check(
        &format!(
            "[plans.p]\nlimits = []\n\n[kinds.user]\nplan = \"p\"\n\n[kinds.upstream]\nplan = \"p\"\n\n{gateway}"
        ),
        &[
            "error: bad.toml:7: key `kinds.upstream.shared`: the kind `upstream` holds the gateway's shared upstream scopes: it must be `shared = true`",
        ],
    );
    check(
        &format!(
            "[kinds.user]\nplan = \"p\"\n[kinds.upstream]\nplan = \"p\"\nshared = false\n[plans.p]\nlimits = []\n{gateway}"
        ),
        &[
            "error: bad.toml:5: key `kinds.upstream.shared`: the kind `upstream` holds the gateway's shared upstream scopes: it must be `shared = true`",
        ],
    );
}

/// Bounds are the engine's, stated once, with their units.
#[test]
fn window_bounds_are_stated_with_their_units() {
    for slices in ["3601", "4294967296"] {
        check(
            &format!(
                "[plans.p]\nlimits = [{{ dimension = \"tokens\", capacity = 1, window = \"sliding\", period = \"1h\", slices = {slices} }}]\n"
            ),
            &[&format!(
                "error: bad.toml:2: key `plans.p.limits[0].slices`: expected an integer between 1 and 3600, got {slices}"
            )],
        );
    }
    check(
        "[plans.p]\nlimits = [{ dimension = \"tokens\", capacity = 1, window = \"bucket\", period = \"401d\" }]\n",
        &[
            "error: bad.toml:2: key `plans.p.limits[0].period`: must be between 1 ms and 400 days, got 34646400000 ms",
        ],
    );
}

#[test]
fn redis_urls_are_checked_as_the_store_reads_them() {
    let bad = |url: &str, why: &str| {
        check(
            &format!("[store]\nkind = \"redis\"\nurl = \"{url}\"\n"),
            &[&format!(
                "error: bad.toml:3: key `store.url`: {why}, got \"{url}\" (expected such as \"redis://127.0.0.1:6379/0\")"
            )],
        );
    };
    bad(
        "redis+bogus://x",
        "unknown scheme \"redis+bogus\": expected redis://, rediss://, redis+sentinel:// or unix://",
    );
    bad("redis://", "the URL has no host");
    bad(
        "redis://127.0.0.1:99999/0",
        "not a valid URL (invalid port number)",
    );
    bad(
        "redis://127.0.0.1:6379/notadb",
        "the database \"notadb\" is not a number",
    );
    bad(
        "redis://0.0.0.0:6379",
        "a wildcard address (0.0.0.0 or ::) is not a server to connect to",
    );
    bad(
        "redis://r:6379#insecure",
        "the only fragment is #insecure, on a rediss:// URL",
    );
    bad(
        "http://r:6379",
        "unknown scheme \"http\": expected redis://, rediss://, redis+sentinel:// or unix://",
    );
    bad(
        "redis+sentinel://s1:26379",
        "a Sentinel URL names its master: redis+sentinel://host:port/master_name",
    );
    bad(
        "redis+sentinel:///mymaster",
        "a Sentinel URL needs at least one sentinel address",
    );
    bad(
        "redis+sentinel://s1:263790/mymaster",
        "sentinel \"s1:263790\": not a valid URL (invalid port number)",
    );
    bad(
        "redis+sentinel://s1:26379/mymaster/x",
        "the database \"x\" is not a number",
    );
    bad(
        "rediss+sentinel://s1:26379/mymaster",
        "TLS through Sentinel (rediss+sentinel://) is not supported yet",
    );
    bad(
        "unix://",
        "a unix:// URL names the socket's path: unix:///run/redis.sock",
    );
    for good in [
        "redis://127.0.0.1:6379/0",
        "redis://r",
        "redis://user:p%40ss@[::1]:6380/3",
        "rediss://r:6380/0#insecure",
        "valkey://r:6379",
        "unix:///run/redis.sock",
        "redis+unix:///run/redis.sock?db=2",
        "redis+sentinel://s1:26379,s2:26379/mymaster/1",
        "redis+sentinel://:secret@s1:26379/mymaster",
    ] {
        parse(
            &format!("[store]\nkind = \"redis\"\nurl = \"{good}\"\n"),
            "ok.toml",
        )
        .unwrap_or_else(|e| panic!("{good}: {e}"));
    }
}

#[test]
fn fail_open_local_is_for_the_redis_store() {
    check(
        "[store]\non_error = \"fail_open_local\"\n",
        &[
            "error: bad.toml:2: key `store.on_error`: \"fail_open_local\" is only for kind = \"redis\": the embedded store answers store_unavailable (503) when its log cannot be written (DURABLE-STORE.md)",
        ],
    );
}

#[test]
fn an_upstream_base_url_reqwest_would_refuse_is_refused_here() {
    let bad = |url: &str, why: &str| {
        check(
            &format!(
                "[[gateway.upstreams]]\nname = \"openai\"\nbase_url = \"{url}\"\nmodels = [\"*\"]\n"
            ),
            &[&format!(
                "error: bad.toml:3: key `gateway.upstreams[0].base_url`: {why}, got \"{url}\""
            )],
        );
    };
    bad("http://[::1", "not a valid URL (invalid IPv6 address)");
    bad(
        "https://host:99999",
        "not a valid URL (invalid port number)",
    );
    bad(
        "https://host/path?x=1",
        "a base URL has no query or fragment (the client's path is appended)",
    );
}

#[test]
fn a_token_for_the_gateway_s_internal_tenant_is_refused() {
    check(
        &format!("[[tokens]]\nsha256 = \"{HASH}\"\nrole = \"tenant\"\ntenant = \"~gateway\"\n"),
        &[
            "error: bad.toml:4: key `tokens[0].tenant`: \"~gateway\" is the gateway's internal tenant (its upstream attempts)",
        ],
    );
}
