//! Snapshots: written atomically, read back checked, and the segments they
//! cover are deleted so recovery stays short.

mod common;

use std::fs;
use std::sync::Arc;

use allowance_wal::{FaultyFs, Fsync, RealFs, Wal, WalError, WalOptions};
use common::{TempDir, durable, payload, read_after, runtime, segment_files};

fn options(dir: &TempDir) -> WalOptions {
    WalOptions {
        segment_bytes: 256,
        ..WalOptions::new(dir.path())
    }
}

fn snapshot_files(dir: &TempDir) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir.path())
        .expect("read dir")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
        .filter(|n| n.starts_with("snapshot-"))
        .collect();
    names.sort();
    names
}

/// First lsn of each segment file, from its name.
fn segment_starts(dir: &TempDir) -> Vec<u64> {
    segment_files(dir.path())
        .iter()
        .map(|p| {
            let stem = p.file_stem().expect("stem").to_str().expect("utf-8");
            stem.parse().expect("lsn")
        })
        .collect()
}

#[test]
fn a_snapshot_replaces_the_segments_it_covers() {
    let rt = runtime();
    let dir = TempDir::new("snapshot");
    let (wal, _) = Wal::open(options(&dir), Arc::new(RealFs)).expect("open");
    assert_eq!(wal.latest_snapshot().expect("none yet"), None);
    let expected: Vec<(u64, Vec<u8>)> = (1..=100).map(|i| (i, payload(i))).collect();
    for (lsn, bytes) in &expected {
        assert_eq!(wal.append(bytes).expect("append"), *lsn);
    }
    durable(&rt, &wal, 100).expect("durable");
    let before = segment_starts(&dir);

    wal.write_snapshot(60, b"state after 60").expect("snapshot");
    assert_eq!(
        wal.latest_snapshot().expect("read"),
        Some((60, b"state after 60".to_vec()))
    );
    assert_eq!(snapshot_files(&dir), ["snapshot-00000000000000000060.snap"]);
    // Exactly the segments whose records are all at or below 60 are gone.
    let after = segment_starts(&dir);
    let kept: Vec<u64> = before
        .iter()
        .enumerate()
        .filter(|&(i, _)| before.get(i + 1).is_none_or(|&next| next > 61))
        .map(|(_, &first)| first)
        .collect();
    assert_eq!(after, kept);
    assert!(
        after.len() < before.len() && after[0] <= 61,
        "{before:?} → {after:?}"
    );

    assert_eq!(read_after(&wal, 60), expected[60..]);
    let err = wal.replay(0, |_, _| Ok(())).expect_err("compacted");
    assert_eq!(
        err.to_string(),
        format!(
            "replay after lsn 0 needs records a snapshot removed: the log starts at lsn {}",
            after[0]
        )
    );
    let err = wal.write_snapshot(50, b"older").expect_err("older");
    assert_eq!(
        err.to_string(),
        "snapshot at lsn 50 is older than the latest snapshot (lsn 60)"
    );
    let err = wal.write_snapshot(101, b"future").expect_err("future");
    assert!(
        matches!(
            err,
            WalError::NotAppended {
                lsn: 101,
                last: 100
            }
        ),
        "{err}"
    );
    assert_eq!(snapshot_files(&dir), ["snapshot-00000000000000000060.snap"]);
    drop(wal);

    let (wal, recovered) = Wal::open(options(&dir), Arc::new(RealFs)).expect("reopen");
    assert_eq!(
        (recovered.last_lsn, recovered.snapshot_lsn),
        (100, Some(60))
    );
    let on_disk: u64 = 101 - after[0];
    assert_eq!(recovered.records, on_disk);
    assert_eq!(read_after(&wal, 60), expected[60..]);

    // A snapshot of everything leaves only the segment being written.
    wal.write_snapshot(100, b"state after 100")
        .expect("snapshot");
    assert_eq!(snapshot_files(&dir), ["snapshot-00000000000000000100.snap"]);
    assert_eq!(segment_files(dir.path()).len(), 1);
    assert_eq!(read_after(&wal, 100), []);
    assert_eq!(wal.append(b"101").expect("append"), 101);
    durable(&rt, &wal, 101).expect("durable");
    drop(wal);
    let (wal, recovered) = Wal::open(options(&dir), Arc::new(RealFs)).expect("reopen");
    assert_eq!(
        (recovered.last_lsn, recovered.snapshot_lsn),
        (101, Some(100))
    );
    assert_eq!(read_after(&wal, 100), [(101, b"101".to_vec())]);
}

/// With the log gone but a snapshot left, the log goes on after the
/// snapshot's lsn: no lsn is ever given twice.
#[test]
fn a_snapshot_without_log_continues_after_its_lsn() {
    let rt = runtime();
    let dir = TempDir::new("snapshot-only");
    let (wal, _) = Wal::open(options(&dir), Arc::new(RealFs)).expect("open");
    for i in 1..=10 {
        wal.append(&payload(i)).expect("append");
    }
    durable(&rt, &wal, 10).expect("durable");
    wal.write_snapshot(10, b"ten").expect("snapshot");
    drop(wal);
    for segment in segment_files(dir.path()) {
        fs::remove_file(segment).expect("remove");
    }
    let (wal, recovered) = Wal::open(options(&dir), Arc::new(RealFs)).expect("reopen");
    assert_eq!(
        (
            recovered.last_lsn,
            recovered.records,
            recovered.snapshot_lsn
        ),
        (10, 0, Some(10))
    );
    assert_eq!(wal.append(b"eleven").expect("append"), 11);
    durable(&rt, &wal, 11).expect("durable");
    assert_eq!(read_after(&wal, 10), [(11, b"eleven".to_vec())]);
}

/// A log missing records between its snapshot and its first segment
/// refuses to open.
#[test]
fn records_missing_between_snapshot_and_log_stop_the_open() {
    let rt = runtime();
    let dir = TempDir::new("snapshot-gap");
    let (wal, _) = Wal::open(options(&dir), Arc::new(RealFs)).expect("open");
    for i in 1..=60 {
        wal.append(&payload(i)).expect("append");
    }
    durable(&rt, &wal, 60).expect("durable");
    drop(wal);
    let files = segment_files(dir.path());
    assert!(files.len() > 3);
    fs::remove_file(&files[0]).expect("remove");
    let err = Wal::open(options(&dir), Arc::new(RealFs))
        .err()
        .expect("refused");
    let starts = segment_starts(&dir);
    assert_eq!(
        err.to_string(),
        format!(
            "{}: byte 0: the log starts at lsn {} but there is no snapshot: records 1 ..= {} are missing",
            files[1].display(),
            starts[0],
            starts[0] - 1
        )
    );
}

/// Even with `Fsync::Never`, a snapshot waits for the log to be fsynced up
/// to its lsn: it never covers records the log could still lose.
#[test]
fn a_snapshot_syncs_the_log_first_whatever_the_policy() {
    let rt = runtime();
    let dir = TempDir::new("snapshot-never");
    let fs = FaultyFs::new();
    let opts = WalOptions {
        fsync: Fsync::Never,
        ..WalOptions::new(dir.path())
    };
    let (wal, _) = Wal::open(opts, Arc::new(fs.clone())).expect("open");
    for i in 1..=10 {
        wal.append(&payload(i)).expect("append");
    }
    durable(&rt, &wal, 10).expect("written");
    let before = fs.stats().syncs;
    wal.write_snapshot(10, b"ten").expect("snapshot");
    // One fsync of the segment, one of the snapshot file.
    assert_eq!(fs.stats().syncs - before, 2);
    // And a power loss right now loses none of the ten.
    fs.crash(0).expect("crash");
    drop(wal);
    fs.recover();
    let (wal, recovered) = Wal::open(WalOptions::new(dir.path()), Arc::new(fs)).expect("reopen");
    assert_eq!((recovered.last_lsn, recovered.records), (10, 10));
    assert_eq!(read_after(&wal, 0).len(), 10);
}

/// A damaged snapshot is reported with its file and offset, not used.
#[test]
fn a_damaged_snapshot_is_named_not_used() {
    let rt = runtime();
    let dir = TempDir::new("snapshot-crc");
    let (wal, _) = Wal::open(options(&dir), Arc::new(RealFs)).expect("open");
    wal.append(b"one").expect("append");
    durable(&rt, &wal, 1).expect("durable");
    wal.write_snapshot(1, b"state").expect("snapshot");
    let path = dir.path().join("snapshot-00000000000000000001.snap");
    let mut bytes = fs::read(&path).expect("read");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    fs::write(&path, &bytes).expect("write");
    let err = wal.latest_snapshot().expect_err("damaged");
    let lsn_and_len: Vec<u8> = [1u64.to_le_bytes(), 5u64.to_le_bytes()].concat();
    let stored = crc32c::crc32c_append(crc32c::crc32c(&lsn_and_len), b"state");
    let computed = crc32c::crc32c_append(crc32c::crc32c(&lsn_and_len), b"statd");
    assert_eq!(
        err.to_string(),
        format!(
            "{}: byte 24: checksum mismatch: stored crc32c {stored:#010x}, computed {computed:#010x}",
            path.display()
        )
    );
}
