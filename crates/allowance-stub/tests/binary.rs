//! The built `allowance-stub` binary: one `listening on` line once ready,
//! its flags, and that it serves real HTTP at the address it printed.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

/// Kills the child however the test ends.
struct Running {
    child: Child,
    stdout: BufReader<std::process::ChildStdout>,
    stderr: std::process::ChildStderr,
}

impl Running {
    /// Stops the child and returns what it printed after the first line,
    /// on stdout and on stderr.
    fn stop(mut self) -> (String, String) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut rest = String::new();
        let _ = self.stdout.read_to_string(&mut rest);
        let mut errors = String::new();
        let _ = self.stderr.read_to_string(&mut errors);
        (rest, errors)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the binary with `args` and returns it with the URL it printed.
fn start(args: &[&str]) -> (Running, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_allowance-stub"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary starts");
    let stdout = child.stdout.take().expect("piped stdout");
    let stderr = child.stderr.take().expect("piped stderr");
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    reader.read_line(&mut line).expect("a line");
    let url = line
        .strip_suffix('\n')
        .and_then(|l| l.strip_prefix("listening on "))
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    let port: u16 = url
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("a port");
    assert_ne!(port, 0);
    (
        Running {
            child,
            stdout: reader,
            stderr,
        },
        url,
    )
}

async fn chat(url: &str) -> Value {
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "Hello!"}]});
    let response = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .timeout(Duration::from_secs(10))
        .json(&body)
        .send()
        .await
        .expect("the binary answers");
    assert_eq!(response.status(), 200);
    response.json().await.expect("JSON")
}

async fn get(url: &str) -> Value {
    reqwest::get(url)
        .await
        .expect("answers")
        .json()
        .await
        .expect("JSON")
}

#[tokio::test]
async fn prints_listening_line_and_serves() {
    let (running, url) = start(&["--listen", "127.0.0.1:0"]);
    let answer = chat(&url).await;
    assert_eq!(answer["usage"]["completion_tokens"], 20);
    let log = get(&format!("{url}/_stub/requests")).await;
    assert_eq!(log.as_array().map(Vec::len), Some(1));
    assert_eq!(get(&format!("{url}/_stub/stats")).await["total"], 1);
    // Exactly one line, and nothing logged per request.
    assert_eq!(running.stop(), (String::new(), String::new()));
}

#[tokio::test]
async fn flags_set_output_tokens_and_no_record() {
    let (_running, url) = start(&[
        "--listen",
        "127.0.0.1:0",
        "--output-tokens",
        "7",
        "--no-record",
    ]);
    let answer = chat(&url).await;
    assert_eq!(answer["usage"]["completion_tokens"], 7);
    assert_eq!(get(&format!("{url}/_stub/requests")).await, json!([]));
    assert_eq!(get(&format!("{url}/_stub/stats")).await["total"], 1);
    // A reset goes back to the flag's value, not to 20.
    reqwest::Client::new()
        .post(format!("{url}/_stub/reset"))
        .send()
        .await
        .expect("answers");
    assert_eq!(
        get(&format!("{url}/_stub/behavior")).await["output_tokens"],
        7
    );
}

#[test]
fn bad_flags_fail_with_a_message() {
    let output = Command::new(env!("CARGO_BIN_EXE_allowance-stub"))
        .args(["--listen", "nowhere"])
        .output()
        .expect("runs");
    assert!(!output.status.success());
    assert!(output.stdout.is_empty());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--listen"));
}
