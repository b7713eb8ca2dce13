//! Append, durable and replay round trips: across segment rolls, in every
//! fsync mode, across reopens; and the refusals that change nothing.

mod common;

use std::sync::Arc;
use std::time::Duration;

use allowance_wal::{
    FaultyFs, Fsync, MAX_RECORD_BYTES, RealFs, Recovered, ReplayProgress, Wal, WalOptions,
};
use common::{TempDir, durable, payload, read_after, runtime, segment_files};

fn options(dir: &TempDir, fsync: Fsync, segment_bytes: u64) -> WalOptions {
    WalOptions {
        fsync,
        segment_bytes,
        ..WalOptions::new(dir.path())
    }
}

/// 300 records of 0..96 bytes in 256-byte segments: every record comes
/// back, in order, after the writes and after a reopen, in all three modes.
#[test]
fn records_round_trip_across_segment_rolls_in_every_mode() {
    let rt = runtime();
    let modes = [
        Fsync::Always,
        Fsync::Batch {
            window: Duration::from_millis(3),
        },
        Fsync::Never,
    ];
    for fsync in modes {
        let dir = TempDir::new("roundtrip");
        let (wal, recovered) =
            Wal::open(options(&dir, fsync, 256), Arc::new(RealFs)).expect("open");
        let fresh = Recovered {
            last_lsn: 0,
            records: 0,
            snapshot_lsn: None,
            torn_tail: None,
        };
        assert_eq!(recovered, fresh);

        let expected: Vec<(u64, Vec<u8>)> = (1..=300).map(|i| (i, payload(i))).collect();
        for chunk in expected.chunks(7) {
            let mut last = 0;
            for (want, bytes) in chunk {
                last = wal.append(bytes).expect("append");
                assert_eq!(last, *want, "{fsync:?}: lsns are dense, in append order");
            }
            durable(&rt, &wal, last).expect("durable");
            assert!(wal.durable_lsn() >= last);
        }
        assert_eq!(read_after(&wal, 0), expected, "{fsync:?}: before reopen");
        let segments = segment_files(dir.path()).len();
        assert!(
            segments > 20,
            "{fsync:?}: only {segments} segments: no rolls"
        );
        wal.close().expect("close");

        let (wal, recovered) =
            Wal::open(options(&dir, fsync, 256), Arc::new(RealFs)).expect("reopen");
        assert_eq!(
            recovered,
            Recovered {
                last_lsn: 300,
                records: 300,
                ..fresh
            }
        );
        assert_eq!(read_after(&wal, 0), expected, "{fsync:?}: after reopen");
        assert_eq!(
            read_after(&wal, 123),
            expected[123..],
            "{fsync:?}: after 123"
        );
        assert_eq!(
            read_after(&wal, 300),
            [],
            "{fsync:?}: nothing after the last"
        );
        assert_eq!(wal.append(b"next").expect("append"), 301);
        durable(&rt, &wal, 301).expect("durable");
        assert_eq!(read_after(&wal, 300), [(301, b"next".to_vec())]);
    }
}

/// An empty payload and one larger than a whole segment are records like
/// any other; a payload over the limit is refused and takes no lsn.
#[test]
fn odd_sizes_round_trip_and_oversized_records_are_refused() {
    let rt = runtime();
    let dir = TempDir::new("sizes");
    let (wal, _) = Wal::open(options(&dir, Fsync::Always, 64), Arc::new(RealFs)).expect("open");
    let big = vec![0xA5; 10_000];
    assert_eq!(wal.append(b"").expect("empty"), 1);
    assert_eq!(wal.append(&big).expect("big"), 2);
    let too_big = vec![0; MAX_RECORD_BYTES + 1];
    let err = wal.append(&too_big).expect_err("over the limit");
    assert_eq!(
        err.to_string(),
        format!(
            "record of {} bytes exceeds the largest record ({MAX_RECORD_BYTES} bytes)",
            MAX_RECORD_BYTES + 1
        )
    );
    assert_eq!(wal.append(b"after").expect("after"), 3);
    durable(&rt, &wal, 3).expect("durable");
    drop(wal);
    let (wal, recovered) =
        Wal::open(options(&dir, Fsync::Always, 64), Arc::new(RealFs)).expect("reopen");
    assert_eq!(recovered.last_lsn, 3);
    assert_eq!(
        read_after(&wal, 0),
        [(1, vec![]), (2, big), (3, b"after".to_vec())]
    );
}

/// `durable` of an lsn never appended is an error, not a hang; lsn 0 is
/// durable at once.
#[test]
fn durable_refuses_lsns_never_appended() {
    let rt = runtime();
    let dir = TempDir::new("not-appended");
    let (wal, _) = Wal::open(WalOptions::new(dir.path()), Arc::new(RealFs)).expect("open");
    durable(&rt, &wal, 0).expect("lsn 0");
    let lsn = wal.append(b"x").expect("append");
    let err = durable(&rt, &wal, lsn + 1).expect_err("never appended");
    assert_eq!(
        err.to_string(),
        "lsn 2 was never appended (the last appended lsn is 1)"
    );
    durable(&rt, &wal, lsn).expect("the real one");
}

/// Bad options are refused with the option's name, before anything is
/// created on disk.
#[test]
fn bad_options_name_the_field_and_touch_nothing() {
    let dir = TempDir::new("options");
    let target = dir.path().join("never-created");
    let cases = [
        (
            WalOptions {
                segment_bytes: 10,
                ..WalOptions::new(&target)
            },
            "invalid write-ahead log option `segment_bytes`: 10 is outside 64 ..= 1073741824",
        ),
        (
            WalOptions {
                fsync: Fsync::Batch {
                    window: Duration::ZERO,
                },
                ..WalOptions::new(&target)
            },
            "invalid write-ahead log option `fsync.window`: 0ns is outside 1ms ..= 60s",
        ),
        (
            WalOptions {
                max_pending_bytes: 0,
                ..WalOptions::new(&target)
            },
            "invalid write-ahead log option `max_pending_bytes`: 0: no record could ever be appended",
        ),
        (
            WalOptions::new(""),
            "invalid write-ahead log option `dir`: empty: an in-memory store has no write-ahead log",
        ),
    ];
    for (opts, message) in cases {
        let err = Wal::open(opts, Arc::new(RealFs)).err().expect("refused");
        assert_eq!(err.to_string(), message);
        assert!(!target.exists(), "{message}: created the dir anyway");
    }
}

/// The progress callback sees the total up front and a last call with
/// everything replayed; a record the callback refuses stops the replay
/// with its lsn.
#[test]
fn replay_reports_progress_and_stops_at_a_refused_record() {
    let rt = runtime();
    let dir = TempDir::new("progress");
    let (wal, _) = Wal::open(WalOptions::new(dir.path()), Arc::new(RealFs)).expect("open");
    let count = 70_000u64;
    let mut last = 0;
    for i in 1..=count {
        last = wal.append(&i.to_le_bytes()).expect("append");
    }
    durable(&rt, &wal, last).expect("durable");

    let mut calls = Vec::new();
    let mut sum = 0u64;
    let replayed = wal
        .replay_with_progress(
            10,
            |lsn, bytes| {
                let value = u64::from_le_bytes(bytes.try_into().map_err(|_| "8 bytes")?);
                if value != lsn {
                    return Err(format!("lsn {lsn} holds {value}"));
                }
                sum += value;
                Ok(())
            },
            |p| calls.push(p),
        )
        .expect("replay");
    assert_eq!(replayed, count - 10);
    assert_eq!(sum, (11..=count).sum::<u64>());
    let total = count - 10;
    assert_eq!(
        calls,
        [
            ReplayProgress {
                replayed: 65_536,
                total
            },
            ReplayProgress {
                replayed: total,
                total
            }
        ]
    );

    let err = wal
        .replay(0, |lsn, _| {
            if lsn == 5 {
                Err("the ledger refused it".to_owned())
            } else {
                Ok(())
            }
        })
        .expect_err("refused");
    assert_eq!(err.to_string(), "replaying lsn 5: the ledger refused it");
}

/// While the disk is behind by `max_pending_bytes`, appends fail fast and
/// append nothing; once the writer catches up they succeed again.
#[test]
fn a_full_backlog_refuses_appends_until_the_disk_catches_up() {
    let rt = runtime();
    let dir = TempDir::new("backlog");
    let fs = FaultyFs::new();
    // A slow disk holds the writer in its fsync while we append.
    fs.set_sync_delay(Duration::from_millis(300));
    let opts = WalOptions {
        max_pending_bytes: 40,
        ..WalOptions::new(dir.path())
    };
    let (wal, _) = Wal::open(opts, Arc::new(fs.clone())).expect("open");
    let syncs = fs.stats().syncs;
    let first = wal.append(&[1; 20]).expect("first");
    while fs.stats().syncs == syncs {
        std::thread::yield_now();
    }
    // The writer is in the fsync of `first`: these wait in memory.
    let second = wal.append(&[2; 20]).expect("one record is always accepted");
    let err = wal.append(&[3; 20]).expect_err("backlog full");
    assert_eq!(
        err.to_string(),
        "the write-ahead log is 44 bytes behind the disk (at most 40 allowed); try again"
    );
    assert!(!wal.is_failed(), "a backlog is not a failure");
    durable(&rt, &wal, second).expect("durable");
    let third = wal.append(&[3; 20]).expect("room again");
    assert_eq!((first, second, third), (1, 2, 3));
    durable(&rt, &wal, third).expect("durable");
    assert_eq!(
        read_after(&wal, 0),
        [(1, vec![1; 20]), (2, vec![2; 20]), (3, vec![3; 20])]
    );
}

/// A writer with `write_every` is never woken by an append, yet writes what
/// accumulated on its own schedule: `durable` resolves (bounded generously
/// to catch a writer that never looks), and `sync_all` wakes it at once.
#[test]
fn a_lazy_writer_writes_on_its_own_schedule() {
    let dir = TempDir::new("lazy-writer");
    let opts = WalOptions {
        write_every: Some(Duration::from_millis(5)),
        ..WalOptions::new(dir.path())
    };
    let (wal, _) = Wal::open(opts, Arc::new(RealFs)).expect("open");
    let rt = runtime();
    let lsn = wal.append(b"one").expect("append");
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(20), wal.durable(lsn))
            .await
            .expect("written on the writer's schedule")
            .expect("durable");
    });
    for i in 0..100u32 {
        wal.append(&i.to_le_bytes()).expect("append");
    }
    assert_eq!(wal.sync_all().expect("sync"), 101);
    assert_eq!(wal.durable_lsn(), 101);
    drop(wal);
    let (wal, recovered) =
        Wal::open(WalOptions::new(dir.path()), Arc::new(RealFs)).expect("reopen");
    assert_eq!(recovered.last_lsn, 101);
    drop(wal);

    let bad = WalOptions {
        write_every: Some(Duration::ZERO),
        ..WalOptions::new(dir.path())
    };
    match Wal::open(bad, Arc::new(RealFs)) {
        Err(allowance_wal::WalError::InvalidOption { field, .. }) => {
            assert_eq!(field, "write_every")
        }
        other => panic!("a zero write_every is refused, got {:?}", other.map(|_| ())),
    }
}

/// Under `Fsync::Always` the segment being written has zeros synced ahead
/// of its records, so a record's fsync does not grow the file; a finished
/// segment and a cleanly closed log end at their last record. `Batch`
/// writes no zeros.
#[test]
fn zeros_are_kept_ahead_of_the_records_only_while_written() {
    let rt = runtime();
    let dir = TempDir::new("zeros-ahead");
    // 64 KiB segments, 1,000-byte records: a roll every ~65 records.
    let (wal, _) =
        Wal::open(options(&dir, Fsync::Always, 64 << 10), Arc::new(RealFs)).expect("open");
    let sizes = |dir: &TempDir| -> Vec<u64> {
        segment_files(dir.path())
            .iter()
            .map(|f| std::fs::metadata(f).expect("stat").len())
            .collect()
    };
    assert_eq!(sizes(&dir), [64 << 10], "zeros ahead from the start");
    let record = [0xab; 1000];
    for _ in 0..100 {
        let lsn = wal.append(&record).expect("append");
        durable(&rt, &wal, lsn).expect("durable");
    }
    let open_sizes = sizes(&dir);
    assert_eq!(open_sizes.len(), 2, "{open_sizes:?}");
    // The finished segment ends at its last record (8-byte header, 1,024
    // bytes a record); the active one is zeroed to its full size.
    assert_eq!((open_sizes[0] - 8) % 1024, 0, "{open_sizes:?}");
    assert_eq!(open_sizes[1], 64 << 10);
    wal.close().expect("close");
    let closed = sizes(&dir);
    assert_eq!(closed[0], open_sizes[0]);
    assert_eq!(closed[0] + closed[1] - 16, 100 * 1024, "{closed:?}");
    let (wal, recovered) =
        Wal::open(options(&dir, Fsync::Always, 64 << 10), Arc::new(RealFs)).expect("reopen");
    assert_eq!((recovered.last_lsn, recovered.torn_tail), (100, None));
    assert_eq!(read_after(&wal, 0).len(), 100);
    drop(wal);

    let dir = TempDir::new("no-zeros");
    let batch = Fsync::Batch {
        window: Duration::from_millis(1),
    };
    let (wal, _) = Wal::open(options(&dir, batch, 64 << 10), Arc::new(RealFs)).expect("open");
    let lsn = wal.append(&record).expect("append");
    durable(&rt, &wal, lsn).expect("durable");
    assert_eq!(wal.sync_all().expect("sync"), 1);
    assert_eq!(sizes(&dir), [8 + 1024]);
}
