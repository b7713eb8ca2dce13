//! Opening a log after a crash: a torn tail is cut and reported; damage
//! anywhere else stops the open with the file, the byte offset and what is
//! wrong, and changes nothing on disk.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use allowance_wal::{Fsync, RealFs, Recovered, TornTail, Wal, WalError, WalOptions};
use common::{TempDir, durable, payload, read_after, runtime, segment_files};

const HEADER: usize = 8;
const RECORD_HEADER: usize = 24;

fn open(dir: &Path, segment_bytes: u64) -> Result<(Wal, Recovered), WalError> {
    let opts = WalOptions {
        fsync: Fsync::Always,
        segment_bytes,
        ..WalOptions::new(dir)
    };
    Wal::open(opts, Arc::new(RealFs))
}

/// Writes `payloads` as lsns 1.. into a fresh log, each made durable
/// before the next is appended (so each record is stamped with the lsn
/// before it: any record proves every earlier one synced), and closes it.
fn write_log(dir: &Path, segment_bytes: u64, payloads: &[Vec<u8>]) {
    let rt = runtime();
    let (wal, _) = open(dir, segment_bytes).expect("open");
    for p in payloads {
        let lsn = wal.append(p).expect("append");
        durable(&rt, &wal, lsn).expect("durable");
    }
    wal.close().expect("close");
}

fn numbered(payloads: &[Vec<u8>]) -> Vec<(u64, Vec<u8>)> {
    (1..).zip(payloads.iter().cloned()).collect()
}

/// Byte offset of each record in a single-segment log of `payloads`.
fn offsets(payloads: &[Vec<u8>]) -> Vec<usize> {
    let mut at = HEADER;
    payloads
        .iter()
        .map(|p| {
            let start = at;
            at += RECORD_HEADER + p.len();
            start
        })
        .collect()
}

/// The checksum of record `lsn` as [`write_log`] stamps it (synced up to
/// the record before).
fn crc(lsn: u64, payload: &[u8]) -> u32 {
    stamped_crc(lsn, lsn - 1, payload)
}

fn stamped_crc(lsn: u64, synced: u64, payload: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&lsn.to_le_bytes());
    crc32c::crc32c_append(crc32c::crc32c_append(crc, &synced.to_le_bytes()), payload)
}

/// A version 2 record as the writer writes it.
fn record(lsn: u64, synced: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(&stamped_crc(lsn, synced, payload).to_le_bytes());
    out.extend_from_slice(&lsn.to_le_bytes());
    out.extend_from_slice(&synced.to_le_bytes());
    out.extend_from_slice(payload);
    out
}

fn only_segment(dir: &Path) -> PathBuf {
    let files = segment_files(dir);
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}

fn corrupt_error(dir: &Path, segment_bytes: u64) -> String {
    match open(dir, segment_bytes) {
        Ok(_) => panic!("opened a damaged log"),
        Err(e @ WalError::Corrupt { .. }) => e.to_string(),
        Err(e) => panic!("expected a corruption error, got {e}"),
    }
}

/// Cutting the file at every byte inside the last record: open cuts the
/// partial record, reports where and how much, keeps the four before it,
/// and the log goes on from lsn 5.
#[test]
fn a_torn_last_record_is_cut_at_every_byte_offset() {
    let rt = runtime();
    let dir = TempDir::new("torn");
    let payloads: Vec<Vec<u8>> = (1..=5).map(|i| payload(i * 11 + 2)).collect();
    assert!(
        payloads[4].len() > 20,
        "the last record must have a payload to tear"
    );
    write_log(dir.path(), 1 << 20, &payloads);
    let segment = only_segment(dir.path());
    let full = fs::read(&segment).expect("read");
    let last_start = offsets(&payloads)[4];
    let last_len = full.len() - last_start;

    for cut in last_start..full.len() {
        fs::write(&segment, &full[..cut]).expect("cut");
        let (wal, recovered) = open(dir.path(), 1 << 20).expect("open");
        let present = cut - last_start;
        // What is reported dropped ends at the last byte that is not
        // zero: zeros after the records are room synced ahead, and a torn
        // record of nothing but zeros is a clean end.
        let nonzero = full[last_start..cut]
            .iter()
            .rposition(|&b| b != 0)
            .map_or(0, |last| last + 1);
        let torn = (nonzero > 0).then(|| TornTail {
            file: segment.clone(),
            offset: last_start as u64,
            bytes_dropped: nonzero as u64,
            reason: format!(
                "incomplete record: it needs {} bytes but only {present} remain in the file",
                if present < RECORD_HEADER {
                    RECORD_HEADER
                } else {
                    last_len
                }
            ),
            acknowledged_lost: false,
        });
        assert_eq!(
            recovered,
            Recovered {
                last_lsn: 4,
                records: 4,
                snapshot_lsn: None,
                torn_tail: torn,
            },
            "cut at byte {cut}"
        );
        assert_eq!(
            read_after(&wal, 0),
            numbered(&payloads[..4]),
            "cut at {cut}"
        );
        // The torn bytes are gone; what follows the records is the room
        // of zeros the writer keeps ahead of them.
        let on_disk = fs::read(&segment).expect("read");
        assert_eq!(on_disk[..last_start], full[..last_start], "cut at {cut}");
        assert!(
            on_disk[last_start..].iter().all(|&b| b == 0),
            "cut at {cut}"
        );

        assert_eq!(wal.append(b"again").expect("append"), 5);
        durable(&rt, &wal, 5).expect("durable");
        drop(wal);
        let (wal, recovered) = open(dir.path(), 1 << 20).expect("reopen");
        assert_eq!((recovered.last_lsn, recovered.torn_tail), (5, None));
        assert_eq!(read_after(&wal, 4), [(5, b"again".to_vec())]);
    }
}

/// A last record whose checksum fails is a torn tail too; zeros after the
/// last record are not.
#[test]
fn a_bad_checksum_at_the_very_end_is_a_torn_tail_and_zeros_are_a_clean_end() {
    let dir = TempDir::new("torn-crc");
    let payloads: Vec<Vec<u8>> = (1..=3).map(|i| vec![i as u8; 30]).collect();
    write_log(dir.path(), 1 << 20, &payloads);
    let segment = only_segment(dir.path());
    let full = fs::read(&segment).expect("read");
    let last_start = offsets(&payloads)[2];

    let mut damaged = full.clone();
    let at = damaged.len() - 1;
    damaged[at] ^= 0x40;
    fs::write(&segment, &damaged).expect("write");
    let mut flipped = payloads[2].clone();
    flipped[29] ^= 0x40;
    let (wal, recovered) = open(dir.path(), 1 << 20).expect("open");
    assert_eq!(
        recovered.torn_tail,
        Some(TornTail {
            file: segment.clone(),
            offset: last_start as u64,
            bytes_dropped: (full.len() - last_start) as u64,
            reason: format!(
                "checksum mismatch: stored crc32c {:#010x}, computed {:#010x}",
                crc(3, &payloads[2]),
                crc(3, &flipped)
            ),
            acknowledged_lost: false,
        })
    );
    assert_eq!(read_after(&wal, 0), numbered(&payloads[..2]));
    drop(wal);

    // Zeros after the last record are the room the writer synces ahead
    // of its records: a clean end, cut without a report.
    let mut zeros = fs::read(&segment).expect("read");
    let valid = zeros.len();
    zeros.extend_from_slice(&[0; 4096]);
    fs::write(&segment, &zeros).expect("write");
    let (wal, recovered) = open(dir.path(), 1 << 20).expect("open");
    assert_eq!((recovered.last_lsn, recovered.torn_tail), (2, None));
    assert_eq!(read_after(&wal, 0), numbered(&payloads[..2]));
    drop(wal);
    assert_eq!(fs::metadata(&segment).expect("stat").len(), valid as u64);
}

/// A flipped byte in an earlier record's payload: open fails naming the
/// file and offset, drops nothing, and keeps failing the same way.
#[test]
fn a_damaged_record_before_the_end_stops_the_open_with_file_and_offset() {
    let dir = TempDir::new("mid-crc");
    let payloads: Vec<Vec<u8>> = (1..=5).map(|i| payload(i * 5 + 40)).collect();
    write_log(dir.path(), 1 << 20, &payloads);
    let segment = only_segment(dir.path());
    let mut bytes = fs::read(&segment).expect("read");
    let at = offsets(&payloads);
    bytes[at[1] + RECORD_HEADER + 3] ^= 0x01;
    fs::write(&segment, &bytes).expect("write");
    let mut flipped = payloads[1].clone();
    flipped[3] ^= 0x01;

    let expected = format!(
        "{}: byte {}: checksum mismatch: stored crc32c {:#010x}, computed {:#010x} \
         (a valid record, lsn 3, written after this one was synced, follows at byte {}: \
         damage, not a torn write)",
        segment.display(),
        at[1],
        crc(2, &payloads[1]),
        crc(2, &flipped),
        at[2]
    );
    assert_eq!(corrupt_error(dir.path(), 1 << 20), expected);
    assert_eq!(
        fs::read(&segment).expect("read"),
        bytes,
        "the file was changed"
    );
    assert_eq!(corrupt_error(dir.path(), 1 << 20), expected, "second try");
}

/// A damaged length field makes the record look like it runs past the end
/// of the file: still damage, since valid records follow.
#[test]
fn a_damaged_length_in_the_last_segment_is_not_mistaken_for_a_torn_tail() {
    let dir = TempDir::new("mid-len");
    let payloads: Vec<Vec<u8>> = (1..=5).map(|i| vec![i as u8; 50]).collect();
    write_log(dir.path(), 1 << 20, &payloads);
    let segment = only_segment(dir.path());
    let mut bytes = fs::read(&segment).expect("read");
    let at = offsets(&payloads);
    bytes[at[1] + 2] = 0x7f; // len 50 becomes 0x007f0032
    fs::write(&segment, &bytes).expect("write");
    assert_eq!(
        corrupt_error(dir.path(), 1 << 20),
        format!(
            "{}: byte {}: incomplete record: it needs {} bytes but only {} remain in the file \
             (a valid record, lsn 3, written after this one was synced, follows at byte {}: \
             damage, not a torn write)",
            segment.display(),
            at[1],
            RECORD_HEADER + 0x007f_0032,
            bytes.len() - at[1],
            at[2]
        )
    );
    assert_eq!(fs::read(&segment).expect("read"), bytes);
}

/// Damage at the end of a segment that is not the last one is never a
/// torn tail: nothing is written after a segment is finished and synced.
#[test]
fn damage_at_the_end_of_an_earlier_segment_stops_the_open() {
    let dir = TempDir::new("mid-segment");
    // 64-byte segments: each 40-byte record fills one.
    let payloads: Vec<Vec<u8>> = (1..=4).map(|i| vec![i as u8; 40]).collect();
    write_log(dir.path(), 64, &payloads);
    let files = segment_files(dir.path());
    assert_eq!(files.len(), 4, "{files:?}");
    let mut bytes = fs::read(&files[1]).expect("read");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x80;
    fs::write(&files[1], &bytes).expect("write");
    let mut flipped = payloads[1].clone();
    flipped[39] ^= 0x80;
    assert_eq!(
        corrupt_error(dir.path(), 64),
        format!(
            "{}: byte 8: checksum mismatch: stored crc32c {:#010x}, computed {:#010x} \
             (in a segment that is not the last one: damage, not a torn write)",
            files[1].display(),
            crc(2, &payloads[1]),
            crc(2, &flipped)
        )
    );
}

/// A missing segment, records in the wrong order and a foreign file under
/// a segment's name are each named precisely.
#[test]
fn gaps_misplaced_records_and_foreign_files_are_damage() {
    // A segment removed from the middle.
    let dir = TempDir::new("gap");
    let payloads: Vec<Vec<u8>> = (1..=4).map(|i| vec![i as u8; 40]).collect();
    write_log(dir.path(), 64, &payloads);
    let files = segment_files(dir.path());
    fs::remove_file(&files[1]).expect("remove");
    assert_eq!(
        corrupt_error(dir.path(), 64),
        format!(
            "{}: byte 0: the segment starts at lsn 3 but the previous segment ({}) ends at lsn 1",
            files[2].display(),
            files[0].display()
        )
    );

    // Two records of the same size swapped: checksums hold, lsns do not.
    let dir = TempDir::new("swap");
    let payloads: Vec<Vec<u8>> = (1..=3).map(|i| vec![i as u8; 10]).collect();
    write_log(dir.path(), 1 << 20, &payloads);
    let segment = only_segment(dir.path());
    let mut bytes = fs::read(&segment).expect("read");
    let at = offsets(&payloads);
    let size = RECORD_HEADER + 10;
    let second: Vec<u8> = bytes[at[1]..at[1] + size].to_vec();
    bytes.copy_within(at[2]..at[2] + size, at[1]);
    bytes[at[2]..at[2] + size].copy_from_slice(&second);
    fs::write(&segment, &bytes).expect("write");
    assert_eq!(
        corrupt_error(dir.path(), 1 << 20),
        format!(
            "{}: byte {}: the record has lsn 3, expected 2",
            segment.display(),
            at[1]
        )
    );

    // Something else under a segment's name.
    let dir = TempDir::new("foreign");
    let stranger = dir.path().join("00000000000000000001.wal");
    fs::write(&stranger, b"not a log at all").expect("write");
    assert_eq!(
        corrupt_error(dir.path(), 1 << 20),
        format!(
            "{}: byte 0: bad magic: not an allowance write-ahead log segment",
            stranger.display()
        )
    );
    assert_eq!(fs::read(&stranger).expect("read"), b"not a log at all");
}

fn open_deferred(dir: &Path, segment_bytes: u64) -> Result<(Wal, Recovered), WalError> {
    let opts = WalOptions {
        fsync: Fsync::Always,
        segment_bytes,
        defer_sealed_checks: true,
        ..WalOptions::new(dir)
    };
    Wal::open(opts, Arc::new(RealFs))
}

/// With `defer_sealed_checks`, damage in a finished segment passes the
/// open and stops the replay, with the very error a full open gives.
fn deferred_corrupt_error(dir: &Path, segment_bytes: u64) -> String {
    let (wal, _) =
        open_deferred(dir, segment_bytes).expect("a deferred open checks only the last segment");
    match wal.replay(0, |_, _| Ok(())) {
        Ok(n) => panic!("replayed {n} records of a damaged log"),
        Err(e @ WalError::Corrupt { .. }) => e.to_string(),
        Err(e) => panic!("expected a corruption error, got {e}"),
    }
}

/// A log of `n` 40-byte records in 64-byte segments: one record a segment.
fn one_record_segments(name: &str, n: u8) -> (TempDir, Vec<Vec<u8>>, Vec<PathBuf>) {
    let dir = TempDir::new(name);
    let payloads: Vec<Vec<u8>> = (1..=n).map(|i| vec![i; 40]).collect();
    write_log(dir.path(), 64, &payloads);
    let files = segment_files(dir.path());
    assert_eq!(files.len(), usize::from(n), "{files:?}");
    (dir, payloads, files)
}

/// An undamaged log opened with `defer_sealed_checks` reports and replays
/// exactly what a full open does, and goes on appending where it ended.
#[test]
fn a_deferred_open_finds_the_same_log() {
    let dir = TempDir::new("deferred-same");
    let payloads: Vec<Vec<u8>> = (0..300).map(payload).collect();
    write_log(dir.path(), 256, &payloads);
    let (wal, full) = open(dir.path(), 256).expect("open");
    let all = read_after(&wal, 0);
    drop(wal);
    let (wal, deferred) = open_deferred(dir.path(), 256).expect("deferred open");
    assert_eq!(deferred, full);
    assert_eq!(all, numbered(&payloads));
    assert_eq!(read_after(&wal, 0), all);
    assert_eq!(read_after(&wal, 123), all[123..].to_vec());
    let rt = runtime();
    let lsn = wal.append(b"after").expect("append");
    assert_eq!(lsn, 301);
    durable(&rt, &wal, lsn).expect("durable");
}

/// Every kind of damage a full open finds in a finished segment — a bad
/// record, a missing segment, a segment cut short, a record of the next
/// segment, something else under a segment's name — a deferred open's
/// replay finds too, with the same message; the last segment is still
/// checked at open.
#[test]
fn a_deferred_open_leaves_no_damage_unreported() {
    // A flipped bit at the end of the second of four segments.
    let (dir, _, files) = one_record_segments("deferred-flip", 4);
    let mut bytes = fs::read(&files[1]).expect("read");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x80;
    fs::write(&files[1], &bytes).expect("write");
    let full = corrupt_error(dir.path(), 64);
    assert!(full.contains("not the last one"), "{full}");
    assert_eq!(deferred_corrupt_error(dir.path(), 64), full);

    // A segment removed from the middle.
    let (dir, _, files) = one_record_segments("deferred-gap", 4);
    fs::remove_file(&files[1]).expect("remove");
    let full = corrupt_error(dir.path(), 64);
    assert!(
        full.contains("starts at lsn 3 but the previous segment"),
        "{full}"
    );
    assert_eq!(deferred_corrupt_error(dir.path(), 64), full);

    // A finished segment cut back to its header.
    let (dir, _, files) = one_record_segments("deferred-cut", 4);
    fs::OpenOptions::new()
        .write(true)
        .open(&files[1])
        .and_then(|f| f.set_len(HEADER as u64))
        .expect("cut");
    let full = corrupt_error(dir.path(), 64);
    assert!(full.contains("ends at lsn 1"), "{full}");
    assert_eq!(deferred_corrupt_error(dir.path(), 64), full);

    // The second segment also holds the third one's record (lsn 3), which
    // the third segment holds as well: a full open sees the third segment
    // start where the second should have ended; the replay sees lsn 3 in
    // the second segment. Both name the place.
    let (dir, _, files) = one_record_segments("deferred-overlap", 4);
    let mut second = fs::read(&files[1]).expect("read");
    second.extend_from_slice(&fs::read(&files[2]).expect("read")[HEADER..]);
    fs::write(&files[1], &second).expect("write");
    assert_eq!(
        corrupt_error(dir.path(), 64),
        format!(
            "{}: byte 0: the segment starts at lsn 3 but the previous segment ({}) ends at lsn 3",
            files[2].display(),
            files[1].display()
        )
    );
    assert_eq!(
        deferred_corrupt_error(dir.path(), 64),
        format!(
            "{}: byte {}: the record has lsn 3, but the next segment ({}) starts at lsn 3",
            files[1].display(),
            HEADER + RECORD_HEADER + 40,
            files[2].display()
        )
    );

    // Something else under a finished segment's name.
    let (dir, _, files) = one_record_segments("deferred-foreign", 3);
    fs::write(&files[0], b"not a log at all").expect("write");
    let full = corrupt_error(dir.path(), 64);
    assert!(full.contains("bad magic"), "{full}");
    assert_eq!(deferred_corrupt_error(dir.path(), 64), full);

    // Damage in the last segment stops a deferred open itself.
    let (dir, _, files) = one_record_segments("deferred-last", 3);
    let mut bytes = fs::read(&files[2]).expect("read");
    bytes[HEADER + RECORD_HEADER] ^= 0x01;
    // A valid record after the damaged one, written once it was synced:
    // not a torn tail.
    bytes.extend_from_slice(&record(4, 3, &[9u8; 40]));
    fs::write(&files[2], &bytes).expect("write");
    let full = corrupt_error(dir.path(), 64);
    match open_deferred(dir.path(), 64) {
        Err(e @ WalError::Corrupt { .. }) => assert_eq!(e.to_string(), full),
        Err(e) => panic!("expected a corruption error, got {e}"),
        Ok(_) => panic!("a deferred open accepted a damaged last segment"),
    }
}

/// A version 1 record, as builds before the stamps wrote them.
fn v1_record(lsn: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_le_bytes().to_vec();
    let crc = crc32c::crc32c_append(crc32c::crc32c(&lsn.to_le_bytes()), payload);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&lsn.to_le_bytes());
    out.extend_from_slice(payload);
    out
}

fn v1_segment(records: &[Vec<u8>]) -> Vec<u8> {
    let mut bytes = b"ALWWAL".to_vec();
    bytes.extend_from_slice(&1u16.to_le_bytes());
    for r in records {
        bytes.extend_from_slice(r);
    }
    bytes
}

/// A data dir written before the stamps opens and replays as it did; new
/// records go to a new, version 2 segment; the old rules still judge the
/// old segment (any valid record after a bad one is damage).
#[test]
fn a_version_1_log_opens_and_continues_in_version_2() {
    let rt = runtime();
    let dir = TempDir::new("v1");
    let payloads: Vec<Vec<u8>> = (1..=3).map(|i| vec![i as u8; 25]).collect();
    let old = dir.path().join("00000000000000000001.wal");
    let records: Vec<Vec<u8>> = (1..)
        .zip(&payloads)
        .map(|(lsn, p)| v1_record(lsn, p))
        .collect();
    fs::write(&old, v1_segment(&records)).expect("write");

    let (wal, recovered) = open(dir.path(), 1 << 20).expect("open");
    assert_eq!((recovered.last_lsn, recovered.torn_tail), (3, None));
    assert_eq!(read_after(&wal, 0), numbered(&payloads));
    let lsn = wal.append(b"new").expect("append");
    assert_eq!(lsn, 4);
    durable(&rt, &wal, lsn).expect("durable");
    wal.close().expect("close");
    let files = segment_files(dir.path());
    assert_eq!(
        files,
        [old.clone(), dir.path().join("00000000000000000004.wal")]
    );
    assert_eq!(fs::read(&files[1]).expect("read")[6..8], 2u16.to_le_bytes());
    let (wal, _) = open(dir.path(), 1 << 20).expect("reopen");
    let mut all = numbered(&payloads);
    all.push((4, b"new".to_vec()));
    assert_eq!(read_after(&wal, 0), all);
    drop(wal);

    // A torn version 1 tail is cut and reported, zeros included.
    let dir = TempDir::new("v1-torn");
    let old = dir.path().join("00000000000000000001.wal");
    let mut bytes = v1_segment(&records);
    let whole = bytes.len();
    bytes.truncate(whole - 5);
    bytes.extend_from_slice(&[0; 7]);
    fs::write(&old, &bytes).expect("write");
    let (wal, recovered) = open(dir.path(), 1 << 20).expect("open");
    let torn = recovered.torn_tail.expect("a torn tail");
    let last_start = whole - records[2].len();
    assert_eq!(
        (torn.offset, torn.bytes_dropped),
        (last_start as u64, (bytes.len() - last_start) as u64)
    );
    assert_eq!(read_after(&wal, 0), numbered(&payloads[..2]));
    drop(wal);

    // Damage before a valid version 1 record: damage, unstamped proof.
    let dir = TempDir::new("v1-damage");
    let old = dir.path().join("00000000000000000001.wal");
    let mut bytes = v1_segment(&records);
    let second = HEADER + records[0].len();
    bytes[second + 16] ^= 0x01;
    fs::write(&old, &bytes).expect("write");
    let text = corrupt_error(dir.path(), 1 << 20);
    assert!(
        text.ends_with(&format!(
            "(a valid record, lsn 3, follows at byte {}: damage, not a torn write)",
            second + records[1].len()
        )),
        "{text}"
    );
}

/// After a power loss mid-write, a hole (a block of the last write that
/// never reached the disk) followed by records of that same write is a
/// torn tail: those records were never synced, so never acknowledged. A
/// record written after the hole's lsn was synced proves the hole damage.
#[test]
fn a_hole_is_torn_unless_a_later_record_was_written_after_it_was_synced() {
    let dir = TempDir::new("hole");
    let payloads: Vec<Vec<u8>> = (1..=2).map(|i| vec![i as u8; 30]).collect();
    write_log(dir.path(), 1 << 20, &payloads);
    let segment = only_segment(dir.path());
    let synced = fs::read(&segment).expect("read");
    // Lsns 3..=5 written in one batch (stamped 2), over zeros; lsn 3's
    // block lost.
    let mut bytes = synced.clone();
    let hole = bytes.len();
    bytes.extend_from_slice(&[0; 54]);
    let survivors = [record(4, 2, &[4; 30]), record(5, 2, &[5; 30])].concat();
    bytes.extend_from_slice(&survivors);
    bytes.extend_from_slice(&[0; 4096]);
    fs::write(&segment, &bytes).expect("write");
    let (wal, recovered) = open(dir.path(), 1 << 20).expect("open");
    assert_eq!(
        recovered.torn_tail,
        Some(TornTail {
            file: segment.clone(),
            offset: hole as u64,
            bytes_dropped: (54 + survivors.len()) as u64,
            reason: format!(
                "checksum mismatch: stored crc32c 0x00000000, computed {:#010x}",
                crc32c::crc32c(&[0; 16])
            ),
            acknowledged_lost: false,
        })
    );
    assert_eq!(read_after(&wal, 0), numbered(&payloads));
    drop(wal);
    assert_eq!(fs::read(&segment).expect("read")[..], synced[..]);

    // The same hole, but lsn 5 was written after lsn 3 was synced.
    let mut bytes = synced.clone();
    bytes.extend_from_slice(&[0; 54]);
    bytes.extend_from_slice(&record(4, 2, &[4; 30]));
    let proof_at = bytes.len();
    bytes.extend_from_slice(&record(5, 3, &[5; 30]));
    fs::write(&segment, &bytes).expect("write");
    assert_eq!(
        corrupt_error(dir.path(), 1 << 20),
        format!(
            "{}: byte {hole}: checksum mismatch: stored crc32c 0x00000000, computed {:#010x} \
             (a valid record, lsn 5, written after this one was synced, follows at byte {proof_at}: \
             damage, not a torn write)",
            segment.display(),
            crc32c::crc32c(&[0; 16])
        )
    );
    assert_eq!(fs::read(&segment).expect("read"), bytes, "changed nothing");
}

fn open_never(dir: &Path) -> Result<(Wal, Recovered), WalError> {
    let opts = WalOptions {
        fsync: Fsync::Never,
        ..WalOptions::new(dir)
    };
    Wal::open(opts, Arc::new(RealFs))
}

/// A `fsync = "never"` log of `n` records of 300 bytes, each written (so
/// acknowledged) before the next is appended, closed without a clean stop's
/// cut (dropped, as a crash leaves it); the segment's bytes.
fn never_log(dir: &Path, n: u64) -> (PathBuf, Vec<u8>, Vec<Vec<u8>>) {
    let rt = runtime();
    let payloads: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8 + 1; 300]).collect();
    let (wal, _) = open_never(dir).expect("open");
    for p in &payloads {
        let lsn = wal.append(p).expect("append");
        durable(&rt, &wal, lsn).expect("written");
    }
    drop(wal);
    let segment = only_segment(dir);
    let bytes = fs::read(&segment).expect("read");
    (segment, bytes, payloads)
}

/// Under `fsync = "never"` nothing is synced while the log runs, yet what
/// was written is acknowledged and no process crash loses it: a flipped
/// byte in the middle of the log is damage (the open stops, naming the
/// file and offset), not a torn tail to cut with every acknowledged record
/// after it. (Found by an audit: the stamp said "synced up to 0", so any
/// damage looked like a torn tail and 52 of 100 reservations vanished.)
#[test]
fn under_never_a_flipped_byte_mid_log_is_damage_not_a_torn_tail() {
    let dir = TempDir::new("never-flip");
    let (segment, mut bytes, payloads) = never_log(dir.path(), 20);
    let at = offsets(&payloads)[5] + RECORD_HEADER + 7;
    bytes[at] ^= 0x40;
    fs::write(&segment, &bytes).expect("flip");
    let err = match open_never(dir.path()) {
        Ok(_) => panic!("opened a damaged log"),
        Err(e @ WalError::Corrupt { .. }) => e.to_string(),
        Err(e) => panic!("expected a corruption error, got {e}"),
    };
    let record_at = offsets(&payloads)[5];
    assert!(
        err.contains(&format!("byte {record_at}")) && err.contains("damage"),
        "{err}"
    );
    assert_eq!(fs::read(&segment).expect("read"), bytes, "nothing changed");
    // The end torn by a crash is still cut: the last record half written.
    let last = offsets(&payloads)[19];
    bytes[at] ^= 0x40;
    fs::write(&segment, &bytes[..last + 40]).expect("heal, then tear");
    let (wal, recovered) = open_never(dir.path()).expect("a torn end opens");
    let torn = recovered.torn_tail.expect("reported");
    assert_eq!((torn.offset, torn.acknowledged_lost), (last as u64, false));
    assert_eq!(read_after(&wal, 0).len(), 19);
}

/// A power loss under `fsync = "never"` may keep a later write and lose an
/// earlier one: a whole sector of zeros where records were, valid records
/// after it. That is the loss the mode accepts: the log is cut at the
/// hole, and the report says acknowledged records went with it.
#[test]
fn under_never_a_sector_hole_a_power_loss_left_is_cut_and_reported_as_lost() {
    let dir = TempDir::new("never-hole");
    let (segment, mut bytes, payloads) = never_log(dir.path(), 20);
    let sector = offsets(&payloads)[8].next_multiple_of(512);
    bytes[sector..sector + 512].fill(0);
    fs::write(&segment, &bytes).expect("hole");
    let first_bad = offsets(&payloads)
        .into_iter()
        .rposition(|o| o <= sector)
        .expect("a record before the hole");
    let (wal, recovered) = open_never(dir.path()).expect("a power loss's hole opens");
    let torn = recovered.torn_tail.expect("reported");
    assert!(torn.acknowledged_lost, "{torn:?}");
    assert_eq!(torn.offset, offsets(&payloads)[first_bad] as u64);
    assert!(torn.reason.contains("power loss"), "{}", torn.reason);
    assert_eq!(read_after(&wal, 0), numbered(&payloads[..first_bad]));
}
