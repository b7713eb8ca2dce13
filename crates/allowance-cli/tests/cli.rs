//! The command line (CONFIG.md "Command line"): init, check-config, serve
//! with a bad file, token, status and bench — the real binary each time.
mod common;
use common::*;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use sha2::{Digest, Sha256};

/// `allowance ARGS`, killed (and the test failed) if it runs past `limit`.
fn run_bounded(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn allowance");
    let started = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "`allowance {}` still running after {limit:?}; stderr:\n{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).expect("UTF-8 output")
}

/// Names of the `[section.NAME]` tables of a TOML text, in order.
fn tables(toml: &str, section: &str) -> Vec<String> {
    let prefix = format!("[{section}.");
    toml.lines()
        .filter_map(|l| l.trim().strip_prefix(&prefix))
        .filter_map(|rest| rest.split(']').next())
        .map(str::to_string)
        .collect()
}

/// 1-based line of the first line of `text` containing `needle`.
fn line_of(text: &str, needle: &str) -> usize {
    text.lines()
        .position(|l| l.contains(needle))
        .map(|i| i + 1)
        .unwrap_or_else(|| panic!("{needle:?} is not in the file"))
}

fn sha256_hex(s: &str) -> String {
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn init_round_trips_through_check_config() {
    let init = run_bounded(&["init"], Duration::from_secs(30));
    assert!(init.status.success(), "{init:?}");
    let starter = text(&init.stdout);
    assert_eq!(
        starter,
        allowance_config::STARTER,
        "init prints the built-in starter"
    );
    let (_dir, path) = config_file(&starter);
    let file = path.to_string_lossy().to_string();

    let out = run_bounded(&["check-config", &file], Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let table = text(&out.stdout);
    let plans = tables(&starter, "plans");
    let kinds = tables(&starter, "kinds");
    assert!(plans.len() >= 4 && kinds.len() >= 4, "{plans:?} {kinds:?}");
    for plan in &plans {
        assert!(
            table
                .lines()
                .any(|l| l.split_whitespace().any(|w| w == plan)),
            "plan {plan} is not in the table:\n{table}"
        );
    }
    for kind in &kinds {
        assert!(
            table.lines().any(|l| l.starts_with(kind.as_str())),
            "kind {kind} has no row:\n{table}"
        );
    }
    assert!(
        out.stderr.is_empty() || !text(&out.stderr).contains("error"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn bad_configurations_exit_2_naming_file_line_and_key() {
    // Three problems at once: a bad window, an unknown key, a bad duration.
    let toml = "\
[plans.free]
limits = [
  { dimension = \"tokens\", capacity = 5, window = \"weekly\" },
]
bogus_key = 1

[kinds.user]
plan = \"free\"

[reservations]
default_ttl = \"soon\"
";
    let (_dir, path) = config_file(toml);
    let file = path.to_string_lossy().to_string();
    let expected = [
        (line_of(toml, "weekly"), "plans.free.limits[0].window"),
        (line_of(toml, "bogus_key"), "plans.free.bogus_key"),
        (line_of(toml, "default_ttl"), "reservations.default_ttl"),
    ];
    let check = run_bounded(&["check-config", &file], Duration::from_secs(30));
    assert_eq!(check.status.code(), Some(2), "{check:?}");
    let stderr = text(&check.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines.len(),
        expected.len(),
        "one line per problem:\n{stderr}"
    );
    for (line, (at, key)) in lines.iter().zip(expected) {
        let head = format!("error: {file}:{at}: key `{key}`: ");
        assert!(line.starts_with(&head), "want {head:?}…, got {line:?}");
        assert!(line.len() > head.len(), "no message: {line:?}");
    }
    assert!(
        lines[0].contains("\"sliding\""),
        "the window line lists the choices: {}",
        lines[0]
    );
    assert!(check.stdout.is_empty(), "no table for a bad file");

    // `serve --config` refuses the same file the same way, before binding.
    let serve = run_bounded(
        &["serve", "--config", &file, "--listen", "127.0.0.1:0"],
        Duration::from_secs(30),
    );
    assert_eq!(serve.status.code(), Some(2), "{serve:?}");
    let serve_lines: Vec<String> = text(&serve.stderr)
        .lines()
        .filter(|l| l.starts_with("error: "))
        .map(str::to_string)
        .collect();
    assert_eq!(serve_lines, lines, "serve and check-config report alike");

    // One problem each: an unknown top-level key; a bad value in a plan.
    for (toml, needle, key) in [
        ("currency = \"EUR\"\nwat = 1\n", "wat", "wat"),
        (
            "[plans.p]\nlimits = [{ dimension = \"tokens\", capacity = 5, window = \"sliding\", period = \"1x\" }]\n",
            "1x",
            "plans.p.limits[0].period",
        ),
    ] {
        let (_dir, path) = config_file(toml);
        let file = path.to_string_lossy().to_string();
        for args in [
            vec!["check-config", file.as_str()],
            vec![
                "serve",
                "--config",
                file.as_str(),
                "--listen",
                "127.0.0.1:0",
            ],
        ] {
            let out = run_bounded(&args, Duration::from_secs(30));
            assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
            let head = format!("error: {file}:{}: key `{key}`: ", line_of(toml, needle));
            let stderr = text(&out.stderr);
            assert!(
                stderr.lines().any(|l| l.starts_with(&head)),
                "{args:?}: want {head:?}…, got:\n{stderr}"
            );
        }
    }

    // A file that is not there names itself.
    let out = run_bounded(
        &["check-config", "/nonexistent/allowance.toml"],
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(text(&out.stderr).starts_with("error: /nonexistent/allowance.toml: "));
}

/// `allowance token`: (token, sha256, the configuration snippet it prints).
fn new_token() -> (String, String, String) {
    let out = run_bounded(&["token"], Duration::from_secs(30));
    assert!(out.status.success(), "{out:?}");
    let stdout = text(&out.stdout);
    let field = |name: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| panic!("no {name:?} line:\n{stdout}"))
    };
    let snippet = stdout
        .lines()
        .skip_while(|l| !l.starts_with("[[tokens]]"))
        .collect::<Vec<_>>()
        .join("\n");
    (field("token:"), field("sha256:"), snippet)
}

#[tokio::test]
async fn token_prints_a_token_and_its_sha256_that_a_server_accepts() {
    let (admin, admin_hash, snippet) = new_token();
    let (tenant, tenant_hash, _) = new_token();
    assert_ne!(admin, tenant, "tokens are random");
    for (t, h) in [(&admin, &admin_hash), (&tenant, &tenant_hash)] {
        assert!(t.len() >= 32, "a token of at least 128 bits: {t}");
        assert_eq!(*h, sha256_hex(t), "sha256 of {t}");
    }
    assert!(snippet.contains(&admin_hash), "{snippet}");

    // The printed snippet as is (admin), and the other hash in upper case
    // (CONFIG.md answer 7: either case).
    let toml = format!(
        "{}\n{snippet}\n\n[[tokens]]\nsha256 = \"{}\"\nrole = \"tenant\"\ntenant = \"acme\"\n",
        allowance_config::STARTER,
        tenant_hash.to_uppercase()
    );
    let s = Server::with_config(&toml);
    s.get("/v1/plans", Some(&admin)).await.expect(200);
    s.get("/v1/scopes/tenant:acme", Some(&tenant))
        .await
        .expect(200);
    let r = s.get("/v1/plans", Some(&tenant)).await.expect(403);
    assert_eq!(r.error_type(), "forbidden");
    let r = s.get("/v1/plans", None).await.expect(401);
    assert_eq!(r.error_type(), "unauthorized");
    // The hash is not the credential.
    s.get("/v1/plans", Some(&admin_hash)).await.expect(401);

    // bench without a token, or with a tenant's: it stops at the first
    // refusal and fails, instead of reporting a run of 401s as a result.
    for token in [None, Some(tenant.clone())] {
        let base = s.base.clone();
        let out = tokio::task::spawn_blocking(move || {
            let mut args = vec!["bench", "--server", &base, "--duration", "30s"];
            if let Some(t) = &token {
                args.extend(["--token", t]);
            }
            run_bounded(&args, Duration::from_secs(25))
        })
        .await
        .expect("join");
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains("the server refused the reserve: 40")
                && stderr.contains("--token an admin token"),
            "{stderr}"
        );
    }
}

#[tokio::test]
async fn status_and_bench_against_a_running_server() {
    let s = Server::start();
    let scope = "tenant:acme/user:bob";
    s.post(
        "/v1/reservations",
        None,
        &json!({"tenant": "acme", "scopes": {"user": "bob"}, "amounts": {"input_tokens": 50_000}}),
    )
    .await
    .expect(201);
    let status = s
        .get(&format!("/v1/scopes/{scope}"), None)
        .await
        .expect(200)
        .json;
    let base = s.base.clone();

    let out = tokio::task::spawn_blocking({
        let base = base.clone();
        move || {
            run_bounded(
                &["status", scope, "--server", &base],
                Duration::from_secs(30),
            )
        }
    })
    .await
    .expect("join");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let shown = text(&out.stdout);
    let first = shown.lines().next().unwrap_or_default();
    assert!(first.starts_with(scope), "{shown}");
    assert!(
        first.contains(status["plan"].as_str().expect("plan")),
        "{shown}"
    );
    let limits = status["limits"].as_array().expect("limits");
    assert!(!limits.is_empty());
    for l in limits {
        let dim = l["dimension"].as_str().expect("dimension");
        let line = shown
            .lines()
            .find(|line| line.split_whitespace().next() == Some(dim))
            .unwrap_or_else(|| panic!("no line for {dim}:\n{shown}"));
        assert!(line.contains(&format!("of {}", l["capacity"])), "{line}");
        assert!(line.contains(&format!("held {}", l["held"])), "{line}");
        assert!(line.contains('[') && line.contains(']'), "a bar: {line}");
    }
    // 50,000 of 200,000 tokens held: a quarter of the tokens bar is held (▒).
    let tokens = shown
        .lines()
        .find(|l| l.trim_start().starts_with("tokens"))
        .expect("tokens");
    assert!(tokens.contains('▒'), "{tokens}");

    // A scope with a `?` is looked up as written (one encoded path
    // segment), not cut at the `?` into `tenant:acme`.
    let out = tokio::task::spawn_blocking({
        let base = base.clone();
        move || {
            run_bounded(
                &["status", "tenant:acme?x=1", "--server", &base],
                Duration::from_secs(30),
            )
        }
    })
    .await
    .expect("join");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        text(&out.stderr).contains("400 Bad Request: invalid scope name \"tenant:acme?x=1\""),
        "{out:?}"
    );

    // An unreachable server: exit 1 and a clear message.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let dead = format!("http://127.0.0.1:{port}");
    let out = tokio::task::spawn_blocking({
        let dead = dead.clone();
        move || {
            run_bounded(
                &["status", scope, "--server", &dead],
                Duration::from_secs(30),
            )
        }
    })
    .await
    .expect("join");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("cannot reach") && stderr.contains(&dead),
        "{stderr}"
    );

    // bench: reserve+settle pairs for a second, no errors.
    let out = tokio::task::spawn_blocking(move || {
        run_bounded(
            &[
                "bench",
                "--server",
                &base,
                "--duration",
                "1s",
                "--concurrency",
                "4",
            ],
            Duration::from_secs(60),
        )
    })
    .await
    .expect("join");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let report = text(&out.stdout);
    let count = |name: &str| -> u64 {
        report
            .lines()
            .find_map(|l| {
                let mut w = l.split_whitespace();
                (w.next() == Some(name)).then(|| w.next()).flatten()
            })
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {name} count:\n{report}"))
    };
    assert!(count("pairs") > 0, "{report}");
    assert_eq!(count("errors"), 0, "{report}");
    assert!(
        report
            .lines()
            .any(|l| l.trim_start().starts_with("pairs") && l.contains("/s)")),
        "pairs per second:\n{report}"
    );
}

/// `serve` turns transparent huge pages off for itself (the kernel says
/// so in the process's status file).
#[cfg(target_os = "linux")]
#[test]
fn serve_runs_without_transparent_huge_pages() {
    let s = Server::start();
    let status = std::fs::read_to_string(format!("/proc/{}/status", s.pid())).expect("status");
    let line = status
        .lines()
        .find(|l| l.starts_with("THP_enabled:"))
        .unwrap_or_else(|| panic!("no THP_enabled line (a kernel before 5.0?): {status}"));
    assert_eq!(line.split_whitespace().nth(1), Some("0"), "{line}");
}

/// An upstream's `api_key_env` names a variable that is not set: `serve`
/// refuses to start as for any bad configuration (exit 2, the file and key
/// named), and `check-config`, which may run where the keys are not,
/// passes with a warning saying so.
#[test]
fn an_unset_upstream_key_stops_serve_and_warns_check_config() {
    let var = "ALLOWANCE_TEST_KEY_THAT_IS_NEVER_SET";
    let (_dir, path) = config_file(&format!(
        "[[gateway.upstreams]]\nname = \"openai\"\nbase_url = \"http://127.0.0.1:9\"\nmodels = [\"*\"]\napi_key_env = \"{var}\"\n"
    ));
    let path = path.to_string_lossy().to_string();
    let key = "key `gateway.upstreams[0].api_key_env`: the environment variable";

    let checked = run_bounded(&["check-config", &path], Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&checked.stderr);
    assert_eq!(checked.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("warning: ") && stderr.contains(key) && stderr.contains(var),
        "{stderr}"
    );

    let served = run_bounded(
        &["serve", "--listen", "127.0.0.1:0", "--config", &path],
        Duration::from_secs(30),
    );
    let stderr = String::from_utf8_lossy(&served.stderr);
    assert_eq!(served.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("error: {path}: {key} {var}")),
        "{stderr}"
    );
}

/// A Redis store that cannot start says where it tried without the
/// password in the URL (an audit found it printed in full, while every
/// log line hid it).
#[test]
fn a_redis_store_that_cannot_start_hides_the_password() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let dir = std::env::temp_dir().join(format!("allowance-cli-redact-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    for url in [
        format!("redis://:TopSecret-1@127.0.0.1:{port}/0"),
        format!("redis://app:TopSecret-1@127.0.0.1:{port}/0"),
    ] {
        let file = dir.join("redis.toml");
        std::fs::write(
            &file,
            format!("[store]\nkind = \"redis\"\nurl = \"{url}\"\ntimeout_ms = 300\n"),
        )
        .expect("write the config");
        let out = run_bounded(
            &[
                "serve",
                "--config",
                file.to_str().expect("utf-8"),
                "--listen",
                "127.0.0.1:0",
            ],
            Duration::from_secs(30),
        );
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        let stderr = text(&out.stderr);
        assert!(stderr.contains("cannot reach Redis at"), "{stderr}");
        assert!(stderr.contains(":***@127.0.0.1"), "{stderr}");
        assert!(
            !stderr.contains("TopSecret"),
            "the password leaked: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Under `--log-format json` a fatal start-up error is JSON log lines too
/// (it was text among the JSON, found by an audit), with the same words.
#[test]
fn a_fatal_error_is_json_under_json_logs() {
    let out = run_bounded(
        &[
            "--log-format",
            "json",
            "serve",
            "--listen",
            "0.0.0.0:0",
            "--data-dir",
            "",
        ],
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = text(&out.stderr);
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(
        lines.iter().any(|l| l["level"] == "ERROR"
            && l["fields"]["message"].as_str().is_some_and(
                |m| m.starts_with("refusing to listen on 0.0.0.0:0 with no credentials")
            )),
        "{stderr}"
    );
}
