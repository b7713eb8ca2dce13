//! The bytes on disk: segment files, records and snapshot files.
//!
//! A segment file is `{first_lsn:020}.wal`: an 8-byte header (`ALWWAL` and
//! the format version, u16 LE) followed by records, each
//! `[len u32 LE][crc32c u32 LE over the rest][lsn u64 LE][synced u64 LE][payload]`,
//! where `len` is the payload's length and `synced` the lsn up to which the
//! log was fsynced when the writer wrote the record (version 2). A later
//! record stamped at or past a damaged one's lsn proves that the damaged one
//! had been made durable: damage, not a torn write — the proof that lets the
//! log be written over zeros synced in advance, whose pages a power loss may
//! leave in any order. Version 1 records (`[len][crc over lsn+payload][lsn]
//! [payload]`, no stamp) still read. Under `fsync = "never"` nothing is
//! synced while the log runs, so the stamp says instead what was *written*
//! before the record's write, with [`WRITTEN_STAMP`] set: a process crash
//! cannot lose what was written, so a later record stamped past a damaged
//! one proves damage there too — unless the bad bytes hold a whole sector
//! of zeros, the hole a power loss leaves in writes never fsynced (the loss
//! that mode accepts), which is cut and reported as such. A snapshot file is
//! `snapshot-{lsn:020}.snap`: `ALWSNP`, the version (u16 LE), the lsn
//! (u64 LE), the payload's length (u64 LE), a crc32c (u32 LE) over those
//! two fields and the payload, then the payload.

use std::fmt;

use crate::Lsn;

/// The magic that opens every segment file.
pub(crate) const SEGMENT_MAGIC: &[u8; 6] = b"ALWWAL";
/// The magic that opens every snapshot file.
pub(crate) const SNAPSHOT_MAGIC: &[u8; 6] = b"ALWSNP";
/// The segment format version this build writes.
pub(crate) const FORMAT_VERSION: u16 = 2;
/// The snapshot file's format version (unchanged since the first).
const SNAPSHOT_VERSION: u16 = 1;
/// Bytes of a segment file's header.
pub(crate) const SEGMENT_HEADER_BYTES: u64 = 8;
/// Set in a version 2 stamp that gives the lsn *written* (not synced)
/// before the record's write: what the writer stamps under
/// `Fsync::Never`, which syncs nothing while it runs. Lsns never reach it.
pub(crate) const WRITTEN_STAMP: u64 = 1 << 63;
/// The unit a power loss loses: no disk writes less than a sector.
const SECTOR_BYTES: usize = 512;
/// Bytes of a record's header as this build writes it (len, crc, lsn, synced).
pub(crate) const RECORD_HEADER_BYTES: usize = 24;
/// Where a record's crc32c sits, from the record's start.
const CRC_OFFSET: usize = 4;
/// Where a record's lsn sits: the checksum covers from here to the end.
const LSN_OFFSET: usize = 8;
/// Where a version 2 record's stamp (the synced lsn) sits.
const SYNCED_OFFSET: usize = 16;

/// How a segment's records are laid out, by its format version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    /// Version 1: no stamp; any valid record after a bad one proves damage.
    V1,
    /// Version 2: records stamped with the synced lsn.
    V2,
}

impl Layout {
    fn header_bytes(self) -> usize {
        match self {
            Layout::V1 => 16,
            Layout::V2 => RECORD_HEADER_BYTES,
        }
    }
}
/// Bytes of a snapshot file's header.
pub(crate) const SNAPSHOT_HEADER_BYTES: usize = 28;

/// Largest payload of one record. A ledger command is a few hundred bytes;
/// 64 MiB leaves room for bulk admin changes while a damaged length field
/// can never make the reader believe in a multi-gigabyte record.
pub const MAX_RECORD_BYTES: usize = 64 << 20;

/// The segment header this build writes.
pub(crate) fn segment_header() -> [u8; SEGMENT_HEADER_BYTES as usize] {
    let mut header = [0u8; SEGMENT_HEADER_BYTES as usize];
    header[..6].copy_from_slice(SEGMENT_MAGIC);
    header[6..].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    header
}

/// Checks a segment file's header and says how its records are laid out;
/// the error says what is wrong with it.
pub(crate) fn check_segment_header(data: &[u8]) -> Result<Layout, String> {
    if data.len() < SEGMENT_HEADER_BYTES as usize {
        return Err(format!(
            "the file is {} bytes, shorter than the {SEGMENT_HEADER_BYTES}-byte segment header",
            data.len()
        ));
    }
    if &data[..6] != SEGMENT_MAGIC {
        return Err("bad magic: not an allowance write-ahead log segment".to_owned());
    }
    match u16::from_le_bytes([data[6], data[7]]) {
        1 => Ok(Layout::V1),
        FORMAT_VERSION => Ok(Layout::V2),
        version => Err(format!(
            "segment format version {version}, this build reads versions 1 to {FORMAT_VERSION}"
        )),
    }
}

/// The checksum stored in a record: crc32c over everything after it (the
/// lsn, the stamp in version 2, the payload), which a record holds side by
/// side, so one pass computes it: a second call per record was a
/// measurable part of reading a log of small records.
fn record_crc(covered: &[u8]) -> u32 {
    crc32c::crc32c(covered)
}

/// Appends one record to `out`, unsealed: its stamp and checksum are
/// written by [`seal_records`] when the writer writes it, since only the
/// writer knows what is synced then. The caller has checked the payload's
/// length against [`MAX_RECORD_BYTES`].
pub(crate) fn encode_record(out: &mut Vec<u8>, lsn: Lsn, payload: &[u8]) {
    // The length fits: MAX_RECORD_BYTES is far below u32::MAX.
    let len = payload.len() as u32;
    out.reserve(RECORD_HEADER_BYTES + payload.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&lsn.to_le_bytes());
    out.extend_from_slice(&[0; 8]);
    out.extend_from_slice(payload);
}

/// Stamps every record [`encode_record`] put in `records` with `synced`
/// (every record up to that lsn is fsynced) and writes its checksum.
pub(crate) fn seal_records(records: &mut [u8], synced: Lsn) {
    let mut at = 0;
    while at + RECORD_HEADER_BYTES <= records.len() {
        let end = at + RECORD_HEADER_BYTES + u32_at(records, at) as usize;
        records[at + SYNCED_OFFSET..at + RECORD_HEADER_BYTES]
            .copy_from_slice(&synced.to_le_bytes());
        let crc = record_crc(&records[at + LSN_OFFSET..end]);
        records[at + CRC_OFFSET..at + LSN_OFFSET].copy_from_slice(&crc.to_le_bytes());
        at = end;
    }
}

/// Why the bytes at some offset are not a valid record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BadRecord {
    /// Fewer bytes remain than the record header (or the record) needs.
    Partial {
        /// Bytes the record would need from its start.
        needed: u64,
        /// Bytes that remain in the file from its start.
        remaining: u64,
    },
    /// The length field exceeds [`MAX_RECORD_BYTES`].
    TooLarge {
        /// The length field.
        len: u64,
    },
    /// The stored checksum does not match the bytes.
    Checksum {
        /// The stored checksum.
        stored: u32,
        /// The checksum of the bytes as read.
        computed: u32,
    },
}

impl fmt::Display for BadRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BadRecord::Partial { needed, remaining } => write!(
                f,
                "incomplete record: it needs {needed} bytes but only {remaining} remain in the file"
            ),
            BadRecord::TooLarge { len } => write!(
                f,
                "record length {len} exceeds the largest record ({MAX_RECORD_BYTES} bytes)"
            ),
            BadRecord::Checksum { stored, computed } => write!(
                f,
                "checksum mismatch: stored crc32c {stored:#010x}, computed {computed:#010x}"
            ),
        }
    }
}

/// A record read back from a segment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Record<'a> {
    pub(crate) lsn: Lsn,
    /// The log was fsynced up to here when the record was written (`None`
    /// in a version 1 segment) — or only written, when `written_only`.
    pub(crate) synced: Option<Lsn>,
    /// The stamp gives what was written before, not what was synced
    /// ([`WRITTEN_STAMP`]).
    pub(crate) written_only: bool,
    pub(crate) payload: &'a [u8],
    /// Offset just past the record.
    pub(crate) end: usize,
}

fn u32_at(data: &[u8], at: usize) -> u32 {
    let mut bytes = [0u8; 4];
    bytes.copy_from_slice(&data[at..at + 4]);
    u32::from_le_bytes(bytes)
}

fn u64_at(data: &[u8], at: usize) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&data[at..at + 8]);
    u64::from_le_bytes(bytes)
}

/// Parses and verifies the record starting at `at` (which is `< data.len()`).
pub(crate) fn parse_record(
    data: &[u8],
    at: usize,
    layout: Layout,
) -> Result<Record<'_>, BadRecord> {
    let header = layout.header_bytes();
    let remaining = (data.len() - at) as u64;
    if remaining < header as u64 {
        return Err(BadRecord::Partial {
            needed: header as u64,
            remaining,
        });
    }
    let len = u64::from(u32_at(data, at));
    let needed = header as u64 + len;
    // A length running past the end is reported as partial before it is
    // judged too large: a torn header's length field is arbitrary.
    if needed > remaining {
        return Err(BadRecord::Partial { needed, remaining });
    }
    if len > MAX_RECORD_BYTES as u64 {
        return Err(BadRecord::TooLarge { len });
    }
    let stored = u32_at(data, at + CRC_OFFSET);
    let lsn = u64_at(data, at + LSN_OFFSET);
    let start = at + header;
    let end = start + len as usize;
    let payload = &data[start..end];
    let computed = record_crc(&data[at + LSN_OFFSET..end]);
    if stored != computed {
        return Err(BadRecord::Checksum { stored, computed });
    }
    let stamp = (layout == Layout::V2).then(|| u64_at(data, at + SYNCED_OFFSET));
    Ok(Record {
        lsn,
        synced: stamp.map(|s| s & !WRITTEN_STAMP),
        written_only: stamp.is_some_and(|s| s & WRITTEN_STAMP != 0),
        payload,
        end,
    })
}

/// Whether `bytes` are all zeros: in a version 2 segment, the unwritten
/// room synced ahead of the records, a clean end.
pub(crate) fn all_zeros(bytes: &[u8]) -> bool {
    // Word by word: a segment may end in megabytes of them.
    let words = bytes.chunks_exact(8);
    let tail = words.remainder();
    words
        .map(|w| u64::from_ne_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]))
        .all(|w| w == 0)
        && tail.iter().all(|&b| b == 0)
}

/// Whether `bytes`, which start at byte `offset` of their file, hold a
/// whole sector-aligned sector of zeros: what a power loss leaves where a
/// write never reached the disk, and what flipped bits never make.
pub(crate) fn holds_zero_sector(bytes: &[u8], offset: u64) -> bool {
    let skip = (SECTOR_BYTES - (offset % SECTOR_BYTES as u64) as usize) % SECTOR_BYTES;
    bytes
        .get(skip..)
        .is_some_and(|rest| rest.chunks_exact(SECTOR_BYTES).any(all_zeros))
}

/// Finds a valid record after `bad_at` proving that the bad record there,
/// which should have had lsn `min_lsn`, is damage and not a torn tail: one
/// with an lsn of at least `min_lsn` that, in a version 2 segment, was
/// written after `min_lsn` was synced (its stamp is at least `min_lsn`).
/// Records stamped lower were written in the same unsynced stretch as the
/// bad one, which a power loss may have left with holes: they prove
/// nothing, and the scan goes on past them.
///
/// Every byte position is tried; the lsn field filters candidates before the
/// checksum is computed, so the scan costs little more than reading.
pub(crate) fn valid_record_after(
    data: &[u8],
    bad_at: usize,
    min_lsn: Lsn,
    layout: Layout,
) -> Option<(usize, Lsn, bool)> {
    let last_start = data.len().checked_sub(layout.header_bytes())?;
    // LSNs are dense, so a genuine later record cannot be further ahead
    // than one per header's worth of bytes.
    let max_lsn = min_lsn.saturating_add(data.len() as u64);
    let mut at = bad_at + 1;
    while at <= last_start {
        let lsn = u64_at(data, at + LSN_OFFSET);
        if lsn < min_lsn || lsn > max_lsn {
            at += 1;
            continue;
        }
        match parse_record(data, at, layout) {
            Ok(record) if record.synced.is_none_or(|synced| synced >= min_lsn) => {
                return Some((at, record.lsn, record.written_only));
            }
            Ok(record) => at = record.end,
            Err(_) => at += 1,
        }
    }
    None
}

/// The name of the segment whose first record is `first_lsn`.
pub(crate) fn segment_name(first_lsn: Lsn) -> String {
    format!("{first_lsn:020}.wal")
}

/// The first lsn named by a segment file name, if it is one.
pub(crate) fn parse_segment_name(name: &str) -> Option<Lsn> {
    let digits = name.strip_suffix(".wal")?;
    parse_lsn_digits(digits)
}

/// The name of the snapshot taken at `lsn`.
pub(crate) fn snapshot_name(lsn: Lsn) -> String {
    format!("snapshot-{lsn:020}.snap")
}

/// The lsn named by a snapshot file name, if it is one.
pub(crate) fn parse_snapshot_name(name: &str) -> Option<Lsn> {
    let digits = name.strip_prefix("snapshot-")?.strip_suffix(".snap")?;
    parse_lsn_digits(digits)
}

fn parse_lsn_digits(digits: &str) -> Option<Lsn> {
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn snapshot_crc(lsn: Lsn, payload: &[u8]) -> u32 {
    let mut crc = crc32c::crc32c(&lsn.to_le_bytes());
    crc = crc32c::crc32c_append(crc, &(payload.len() as u64).to_le_bytes());
    crc32c::crc32c_append(crc, payload)
}

/// The whole snapshot file for `payload` taken at `lsn`.
pub(crate) fn encode_snapshot(lsn: Lsn, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(SNAPSHOT_HEADER_BYTES + payload.len());
    out.extend_from_slice(SNAPSHOT_MAGIC);
    out.extend_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
    out.extend_from_slice(&lsn.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&snapshot_crc(lsn, payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// Decodes a snapshot file, checking it against the lsn its name gives.
/// The error is `(offset, what)`.
pub(crate) fn decode_snapshot(data: &[u8], named_lsn: Lsn) -> Result<Vec<u8>, (u64, String)> {
    if data.len() < SNAPSHOT_HEADER_BYTES {
        return Err((
            0,
            format!(
                "the file is {} bytes, shorter than the {SNAPSHOT_HEADER_BYTES}-byte snapshot header",
                data.len()
            ),
        ));
    }
    if &data[..6] != SNAPSHOT_MAGIC {
        return Err((0, "bad magic: not an allowance snapshot".to_owned()));
    }
    let version = u16::from_le_bytes([data[6], data[7]]);
    if version != SNAPSHOT_VERSION {
        return Err((
            6,
            format!(
                "snapshot format version {version}, this build reads version {SNAPSHOT_VERSION}"
            ),
        ));
    }
    let lsn = u64_at(data, 8);
    if lsn != named_lsn {
        return Err((
            8,
            format!("the header says lsn {lsn}, the file name says {named_lsn}"),
        ));
    }
    let len = u64_at(data, 16);
    let present = (data.len() - SNAPSHOT_HEADER_BYTES) as u64;
    if len != present {
        return Err((
            16,
            format!("the header says {len} payload bytes, the file holds {present}"),
        ));
    }
    let payload = &data[SNAPSHOT_HEADER_BYTES..];
    let stored = u32_at(data, 24);
    let computed = snapshot_crc(lsn, payload);
    if stored != computed {
        return Err((
            24,
            format!("checksum mismatch: stored crc32c {stored:#010x}, computed {computed:#010x}"),
        ));
    }
    Ok(payload.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_and_any_flipped_bit_is_caught() {
        let mut buf = Vec::new();
        encode_record(&mut buf, 7, b"hello");
        seal_records(&mut buf, 5);
        let record = parse_record(&buf, 0, Layout::V2).expect("valid");
        assert_eq!(
            (record.lsn, record.synced, record.payload, record.end),
            (7, Some(5), &b"hello"[..], buf.len())
        );
        for byte in 0..buf.len() {
            for bit in 0..8 {
                let mut damaged = buf.clone();
                damaged[byte] ^= 1 << bit;
                assert!(
                    parse_record(&damaged, 0, Layout::V2).is_err(),
                    "byte {byte} bit {bit}"
                );
            }
        }
    }

    #[test]
    fn sealing_stamps_and_checksums_every_record_of_a_batch() {
        let mut buf = Vec::new();
        for (lsn, payload) in [(3, &b"a"[..]), (4, b""), (5, b"three")] {
            encode_record(&mut buf, lsn, payload);
        }
        // Unsealed records never pass for valid ones.
        assert!(parse_record(&buf, 0, Layout::V2).is_err());
        seal_records(&mut buf, 2);
        let mut at = 0;
        for (lsn, payload) in [(3, &b"a"[..]), (4, b""), (5, b"three")] {
            let record = parse_record(&buf, at, Layout::V2).expect("valid");
            assert_eq!(
                (record.lsn, record.synced, record.payload),
                (lsn, Some(2), payload)
            );
            at = record.end;
        }
        assert_eq!(at, buf.len());
    }

    #[test]
    fn the_checksum_is_crc32c_of_the_lsn_the_stamp_then_the_payload() {
        let mut buf = Vec::new();
        encode_record(&mut buf, 0x0102_0304_0506_0708, b"payload");
        seal_records(&mut buf, 9);
        let mut covered = 0x0102_0304_0506_0708u64.to_le_bytes().to_vec();
        covered.extend_from_slice(&9u64.to_le_bytes());
        covered.extend_from_slice(b"payload");
        assert_eq!(u32_at(&buf, CRC_OFFSET), crc32c::crc32c(&covered));
    }

    /// A version 1 record, as logs written before the stamp hold them.
    fn v1_record(lsn: Lsn, payload: &[u8]) -> Vec<u8> {
        let mut out = (payload.len() as u32).to_le_bytes().to_vec();
        let crc = crc32c::crc32c_append(crc32c::crc32c(&lsn.to_le_bytes()), payload);
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&lsn.to_le_bytes());
        out.extend_from_slice(payload);
        out
    }

    #[test]
    fn version_1_segments_still_read() {
        let mut v1 = segment_header().to_vec();
        v1[6..8].copy_from_slice(&1u16.to_le_bytes());
        assert_eq!(check_segment_header(&v1), Ok(Layout::V1));
        assert_eq!(check_segment_header(&segment_header()), Ok(Layout::V2));
        let mut v3 = v1.clone();
        v3[6] = 3;
        assert_eq!(
            check_segment_header(&v3).unwrap_err(),
            "segment format version 3, this build reads versions 1 to 2"
        );
        let bytes = v1_record(4, b"old");
        let record = parse_record(&bytes, 0, Layout::V1).expect("valid");
        assert_eq!(
            (record.lsn, record.synced, record.payload, record.end),
            (4, None, &b"old"[..], bytes.len())
        );
    }

    /// After a bad record at lsn 5, only a record written once 5 was synced
    /// proves damage; records of the same unsynced stretch are skipped.
    #[test]
    fn only_a_later_stamp_proves_damage() {
        let mut stretch = vec![0u8; 40];
        let mut same = Vec::new();
        encode_record(&mut same, 6, b"same batch");
        seal_records(&mut same, 4);
        stretch.extend_from_slice(&same);
        assert_eq!(valid_record_after(&stretch, 0, 5, Layout::V2), None);
        let mut later = Vec::new();
        encode_record(&mut later, 7, b"next batch");
        seal_records(&mut later, 6);
        let at = stretch.len();
        stretch.extend_from_slice(&later);
        assert_eq!(
            valid_record_after(&stretch, 0, 5, Layout::V2),
            Some((at, 7, false))
        );
        // Version 1 has no stamps: any valid later record is proof.
        let mut old = vec![0u8; 40];
        old.extend_from_slice(&v1_record(6, b"x"));
        assert_eq!(
            valid_record_after(&old, 0, 5, Layout::V1),
            Some((40, 6, false))
        );
    }

    #[test]
    fn zeros_are_recognised_to_the_last_byte() {
        assert!(all_zeros(&[]));
        for len in [1, 7, 8, 9, 4096, 4099] {
            let mut bytes = vec![0u8; len];
            assert!(all_zeros(&bytes), "{len}");
            for at in [0, len / 2, len - 1] {
                bytes[at] = 1;
                assert!(!all_zeros(&bytes), "{len} {at}");
                bytes[at] = 0;
            }
        }
    }

    #[test]
    fn names_round_trip_and_strangers_are_not_ours() {
        assert_eq!(parse_segment_name(&segment_name(42)), Some(42));
        assert_eq!(
            parse_snapshot_name(&snapshot_name(u64::MAX)),
            Some(u64::MAX)
        );
        assert_eq!(parse_segment_name("42.wal"), None);
        assert_eq!(parse_segment_name("LOCK"), None);
        assert_eq!(
            parse_snapshot_name("snapshot-0000000000000000004x.snap"),
            None
        );
    }

    #[test]
    fn a_snapshot_round_trips_and_damage_is_named() {
        let file = encode_snapshot(9, b"state");
        assert_eq!(decode_snapshot(&file, 9).expect("valid"), b"state");
        assert_eq!(decode_snapshot(&file, 8).unwrap_err().0, 8);
        let mut damaged = file.clone();
        let last = damaged.len() - 1;
        damaged[last] ^= 1;
        assert_eq!(decode_snapshot(&damaged, 9).unwrap_err().0, 24);
    }
}
