//! One data dir, one log: a second `Wal` on the same dir — in this process
//! or in another one — is refused, naming the dir and the holder's pid.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;

use allowance_wal::{RealFs, Wal, WalOptions};
use common::TempDir;

/// Set in the child process this test starts: the dir to hold.
const HOLD_DIR: &str = "ALLOWANCE_WAL_TEST_HOLD_DIR";
/// What the child prints once it holds the dir.
const HOLDING: &str = "allowance-wal-test: holding the dir";

#[test]
fn a_second_wal_in_this_process_is_refused_until_the_first_is_dropped() {
    let dir = TempDir::new("lock-same");
    let (first, _) = Wal::open(WalOptions::new(dir.path()), Arc::new(RealFs)).expect("open");
    let err = Wal::open(WalOptions::new(dir.path()), Arc::new(RealFs))
        .err()
        .expect("second open refused");
    assert_eq!(
        err.to_string(),
        format!(
            "data dir {} is in use by another allowance write-ahead log (pid {}, this process); \
             one data dir serves one process at a time",
            dir.path().display(),
            std::process::id()
        )
    );
    assert_eq!(first.append(b"still mine").expect("append"), 1);
    drop(first);
    let (_again, recovered) =
        Wal::open(WalOptions::new(dir.path()), Arc::new(RealFs)).expect("reopen");
    assert_eq!(recovered.last_lsn, 1);
}

/// The test binary runs itself again as the holder: a real second process.
#[test]
fn a_second_process_is_refused_with_the_holders_pid() {
    if let Ok(dir) = std::env::var(HOLD_DIR) {
        // Child: hold the dir until the parent closes our stdin.
        let (_wal, _) = Wal::open(WalOptions::new(dir), Arc::new(RealFs)).expect("child open");
        // On its own line: the harness has printed `test … ... ` before it.
        let mut stdout = std::io::stdout();
        writeln!(stdout, "\n{HOLDING}").expect("tell the parent");
        stdout.flush().expect("flush");
        let mut rest = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut rest);
        return;
    }

    let dir = TempDir::new("lock-other");
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "a_second_process_is_refused_with_the_holders_pid",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HOLD_DIR, dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the holder");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    loop {
        let line = lines
            .next()
            .expect("the holder exited before holding")
            .expect("read");
        if line == HOLDING {
            break;
        }
    }

    let err = Wal::open(WalOptions::new(dir.path()), Arc::new(RealFs))
        .err()
        .expect("refused while the other process holds the dir");
    assert_eq!(
        err.to_string(),
        format!(
            "data dir {} is in use by another allowance write-ahead log (pid {}); \
             one data dir serves one process at a time",
            dir.path().display(),
            child.id()
        )
    );

    drop(child.stdin.take());
    let status = child.wait().expect("wait");
    assert!(status.success(), "holder failed: {status}");
    Wal::open(WalOptions::new(dir.path()), Arc::new(RealFs)).expect("free once the holder exited");
}
