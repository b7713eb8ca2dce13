//! Opening a data dir: the lock, the scan of every segment, the torn tail.
//!
//! What counts as a torn tail: the first bad record of the *last* segment
//! (incomplete, too long, or failing its checksum) when no valid record
//! after it proves it was made durable — in a version 2 segment, a record
//! stamped as written after the bad record's lsn was synced; in a version 1
//! segment, any valid record. A crash mid-write can only leave that: the
//! pages of the last, unsynced write may reach the disk in any order, so
//! records of that write may follow a hole. Zeros from the bad record to
//! the end of a version 2 segment are its clean end: the room the writer
//! synced ahead. A bad record anywhere else — in an earlier segment, or
//! with proof after it — is damage: open fails naming the file and the
//! byte offset, and drops nothing. A checksum-valid record with an
//! unexpected lsn, or a gap between segments, is damage too.
//!
//! One limit, shared by any log that cannot tell a torn write from damage
//! to the last write: damage to the records of the last group commit
//! before a stop (nothing proves them synced yet) is cut and reported as a
//! torn tail, not refused.
//!
//! With [`WalOptions::defer_sealed_checks`] the finished segments are not
//! read here: the replay that reads them makes the same checks
//! ([`Wal::replay_with_progress`](crate::Wal::replay_with_progress)).

use std::any::Any;
use std::io;
use std::path::{Path, PathBuf};

use crate::format::{
    self, BadRecord, Layout, SEGMENT_HEADER_BYTES, check_segment_header, parse_record,
    parse_segment_name, parse_snapshot_name, segment_name,
};
use crate::fs::{FileSystem, LockAttempt, WalFile};
use crate::{Lsn, Recovered, TornTail, WalError, WalOptions};

/// The lock file in the data dir.
pub(crate) const LOCK_FILE: &str = "LOCK";

/// A segment file of the log.
#[derive(Debug, Clone)]
pub(crate) struct Segment {
    pub(crate) first_lsn: Lsn,
    pub(crate) path: PathBuf,
}

/// The segment the writer appends to.
pub(crate) struct Active {
    pub(crate) file: Box<dyn WalFile>,
    pub(crate) path: PathBuf,
    /// The file's size as written by us.
    pub(crate) bytes: u64,
    /// The size up to which every record is acknowledged (durable under
    /// the policy): what a failure rolls the file back to.
    pub(crate) acked_bytes: u64,
    /// The file's size (at most: a failed write of zeros may have grown
    /// it less): past `bytes`, zeros the writer wrote and synced ahead, so
    /// that a record's fsync need not commit a new file size.
    pub(crate) zeroed_to: u64,
}

impl Active {
    fn new(file: Box<dyn WalFile>, path: PathBuf, bytes: u64) -> Active {
        Active {
            file,
            path,
            bytes,
            acked_bytes: bytes,
            zeroed_to: bytes,
        }
    }
}

/// An opened data dir, ready for the writer.
pub(crate) struct Opened {
    pub(crate) lock: Box<dyn Any + Send + Sync>,
    pub(crate) segments: Vec<Segment>,
    pub(crate) active: Active,
    pub(crate) recovered: Recovered,
}

/// Writes all of `buf` at `offset`, looping over short writes like
/// `write_all_at`.
pub(crate) fn write_all_at(
    file: &mut dyn WalFile,
    mut buf: &[u8],
    mut offset: u64,
) -> io::Result<()> {
    while !buf.is_empty() {
        match file.write_at(buf, offset) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => {
                let n = n.min(buf.len());
                buf = &buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Creates the segment starting at `first_lsn` atomically: header written
/// and synced under a temporary name, then renamed and the dir synced, so a
/// segment file never exists without its header.
pub(crate) fn create_segment(
    fs: &dyn FileSystem,
    dir: &Path,
    first_lsn: Lsn,
) -> Result<(Box<dyn WalFile>, PathBuf), WalError> {
    let name = segment_name(first_lsn);
    let path = dir.join(&name);
    let tmp = dir.join(format!("{name}.tmp"));
    let mut file = fs
        .create(&tmp)
        .map_err(|e| WalError::io("create segment", &tmp, e))?;
    write_all_at(file.as_mut(), &format::segment_header(), 0)
        .map_err(|e| WalError::io("write segment header", &tmp, e))?;
    file.sync_data()
        .map_err(|e| WalError::io("fsync segment", &tmp, e))?;
    fs.rename(&tmp, &path)
        .map_err(|e| WalError::io("rename segment into place", &path, e))?;
    fs.sync_dir(dir)
        .map_err(|e| WalError::io("fsync data dir", dir, e))?;
    Ok((file, path))
}

/// Takes the lock, scans the log, cuts a torn tail and opens the segment
/// to append to.
pub(crate) fn open_dir(opts: &WalOptions, fs: &dyn FileSystem) -> Result<Opened, WalError> {
    let dir = opts.dir.as_path();
    fs.create_dir_all(dir)
        .map_err(|e| WalError::io("create data dir", dir, e))?;
    let lock = take_lock(fs, dir)?;

    let mut segments = Vec::new();
    let mut snapshots = Vec::new();
    let names = fs
        .list_dir(dir)
        .map_err(|e| WalError::io("list data dir", dir, e))?;
    for name in names {
        // Leftovers of a crash while creating a segment or a snapshot:
        // never renamed into place, so never part of the log.
        if name.ends_with(".wal.tmp") || name.ends_with(".snap.tmp") {
            let path = dir.join(&name);
            fs.remove_file(&path)
                .map_err(|e| WalError::io("remove leftover temporary file", &path, e))?;
        } else if let Some(first_lsn) = parse_segment_name(&name) {
            segments.push(Segment {
                first_lsn,
                path: dir.join(name),
            });
        } else if let Some(lsn) = parse_snapshot_name(&name) {
            snapshots.push(lsn);
        }
    }
    segments.sort_by_key(|s| s.first_lsn);
    snapshots.sort_unstable();
    let snapshot_lsn = snapshots.last().copied();
    let base = snapshot_lsn.unwrap_or(0);

    let scan = scan_segments(fs, &segments, base, opts.defer_sealed_checks)?;
    let log_last = scan.next_lsn - 1;
    let last_lsn = log_last.max(base);
    if base > log_last && !segments.is_empty() {
        // The snapshot covers every record on disk: those segments are
        // history, and the log continues after the snapshot.
        for segment in segments.drain(..) {
            fs.remove_file(&segment.path).map_err(|e| {
                WalError::io("remove segment covered by the snapshot", &segment.path, e)
            })?;
        }
    }

    let last_segment = segments.last().map(|last| last.path.clone());
    let active = match last_segment {
        Some(path) => {
            let file = settle_last_segment(fs, &path, scan.last_bytes, scan.last_file_bytes)?;
            if scan.last_layout == Layout::V2 && scan.last_bytes < opts.segment_bytes {
                Active::new(file, path, scan.last_bytes)
            } else {
                // Full, or written by a build before the stamps: this
                // build appends only to a version 2 segment of its own.
                drop(file);
                if scan.last_bytes <= SEGMENT_HEADER_BYTES {
                    // Empty: its successor takes its name (the rename
                    // replaces it atomically).
                    segments.pop();
                }
                new_active(fs, dir, last_lsn + 1, &mut segments)?
            }
        }
        None => new_active(fs, dir, last_lsn + 1, &mut segments)?,
    };
    if base > log_last {
        fs.sync_dir(dir)
            .map_err(|e| WalError::io("fsync data dir", dir, e))?;
    }

    Ok(Opened {
        lock,
        segments,
        active,
        recovered: Recovered {
            last_lsn,
            records: scan.records,
            snapshot_lsn,
            torn_tail: scan.torn_tail,
        },
    })
}

fn new_active(
    fs: &dyn FileSystem,
    dir: &Path,
    first_lsn: Lsn,
    segments: &mut Vec<Segment>,
) -> Result<Active, WalError> {
    let (file, path) = create_segment(fs, dir, first_lsn)?;
    segments.push(Segment {
        first_lsn,
        path: path.clone(),
    });
    Ok(Active::new(file, path, SEGMENT_HEADER_BYTES))
}

/// Opens the last segment, cuts it back to its last valid record (a torn
/// tail, or zeros synced ahead) and syncs it: what a crashed process left
/// in the page cache becomes durable before anything new is acknowledged
/// after it, and no unsynced record of a torn write outlives the cut.
fn settle_last_segment(
    fs: &dyn FileSystem,
    path: &Path,
    valid_bytes: u64,
    file_bytes: u64,
) -> Result<Box<dyn WalFile>, WalError> {
    let mut file = fs
        .open_write(path)
        .map_err(|e| WalError::io("open segment", path, e))?;
    if file_bytes > valid_bytes {
        file.set_len(valid_bytes)
            .map_err(|e| WalError::io("truncate the torn tail of", path, e))?;
    }
    file.sync_data()
        .map_err(|e| WalError::io("fsync segment", path, e))?;
    Ok(file)
}

fn take_lock(fs: &dyn FileSystem, dir: &Path) -> Result<Box<dyn Any + Send + Sync>, WalError> {
    let path = dir.join(LOCK_FILE);
    let me = format!("pid {}", std::process::id());
    match fs
        .try_lock(&path, &me)
        .map_err(|e| WalError::io("lock", &path, e))?
    {
        LockAttempt::Acquired(guard) => Ok(guard),
        LockAttempt::Held { holder } => {
            let holder = if holder.is_empty() {
                "holder unknown".to_owned()
            } else if holder == me {
                format!("{holder}, this process")
            } else {
                holder
            };
            Err(WalError::Locked {
                dir: dir.to_path_buf(),
                holder,
            })
        }
    }
}

struct Scan {
    /// The lsn the next record would get from the log alone.
    next_lsn: Lsn,
    records: u64,
    /// Valid bytes of the last segment.
    last_bytes: u64,
    /// The last segment's size on disk (with any torn tail or zeros).
    last_file_bytes: u64,
    /// How the last segment's records are laid out.
    last_layout: Layout,
    torn_tail: Option<TornTail>,
}

/// Reads and checks every segment, or with `defer_sealed` only the last
/// one, trusting the finished segments' names for where each one ends
/// (the replay that reads them checks it).
fn scan_segments(
    fs: &dyn FileSystem,
    segments: &[Segment],
    base: Lsn,
    defer_sealed: bool,
) -> Result<Scan, WalError> {
    let mut scan = Scan {
        next_lsn: base + 1,
        records: 0,
        last_bytes: 0,
        last_file_bytes: 0,
        last_layout: Layout::V2,
        torn_tail: None,
    };
    for (i, segment) in segments.iter().enumerate() {
        let path = &segment.path;
        let first = segment.first_lsn;
        if first == 0 {
            return Err(WalError::corrupt(
                path,
                0,
                "the file name says lsn 0, but lsns start at 1",
            ));
        }
        if i == 0 && first > base + 1 {
            let covered = match base {
                0 => "there is no snapshot".to_owned(),
                _ => format!("the latest snapshot covers only up to lsn {base}"),
            };
            return Err(WalError::corrupt(
                path,
                0,
                format!(
                    "the log starts at lsn {first} but {covered}: records {} ..= {} are missing",
                    base + 1,
                    first - 1
                ),
            ));
        }
        let is_last = i + 1 == segments.len();
        if defer_sealed && !is_last {
            // Sorted by name, so the next segment starts no earlier.
            let next_first = segments[i + 1].first_lsn;
            scan.records += next_first - first;
            scan.next_lsn = next_first;
            continue;
        }
        if i > 0 && first != scan.next_lsn {
            return Err(segment_gap(
                path,
                first,
                &segments[i - 1].path,
                scan.next_lsn - 1,
            ));
        }
        let data = fs
            .read(path)
            .map_err(|e| WalError::io("read segment", path, e))?;
        let layout =
            check_segment_header(&data).map_err(|what| WalError::corrupt(path, 0, what))?;
        let mut at = SEGMENT_HEADER_BYTES as usize;
        let mut expect = first;
        while at < data.len() {
            match parse_record(&data, at, layout) {
                Ok(record) if record.lsn == expect => {
                    at = record.end;
                    expect += 1;
                    scan.records += 1;
                }
                Ok(record) => {
                    return Err(WalError::corrupt(
                        path,
                        at as u64,
                        format!("the record has lsn {}, expected {expect}", record.lsn),
                    ));
                }
                Err(bad) => {
                    scan.torn_tail = torn_or_damage(path, &data, at, expect, is_last, layout, bad)?;
                    break;
                }
            }
        }
        scan.next_lsn = expect;
        if is_last {
            scan.last_bytes = at as u64;
            scan.last_file_bytes = data.len() as u64;
            scan.last_layout = layout;
        }
    }
    Ok(scan)
}

/// Decides whether the bad record at `at` is the log's clean end (`None`:
/// zeros to the end of a version 2 segment), a torn tail, or damage.
fn torn_or_damage(
    path: &Path,
    data: &[u8],
    at: usize,
    expect: Lsn,
    is_last: bool,
    layout: Layout,
    bad: BadRecord,
) -> Result<Option<TornTail>, WalError> {
    if !is_last {
        return Err(sealed_damage(path, at, &bad));
    }
    if layout == Layout::V2 && format::all_zeros(&data[at..]) {
        return Ok(None);
    }
    let nonzero_end = |data: &[u8]| {
        data.iter()
            .rposition(|&b| b != 0)
            .map_or(at, |last| last + 1)
    };
    if let Some((later_at, later_lsn, written_only)) =
        format::valid_record_after(data, at, expect, layout)
    {
        if written_only && format::holds_zero_sector(&data[at..later_at], at as u64) {
            // Written after the bad record without an fsync between: a
            // power loss may have kept the later write and lost this one.
            return Ok(Some(TornTail {
                file: path.to_path_buf(),
                offset: at as u64,
                bytes_dropped: (nonzero_end(data).max(at) - at) as u64,
                reason: format!(
                    "{bad}: a hole of zeros a power loss left in writes never fsynced (fsync = \"never\"); the records from lsn {expect} on, acknowledged ones included (a valid one, lsn {later_lsn}, follows at byte {later_at}), are lost"
                ),
                acknowledged_lost: true,
            }));
        }
        let proof = match layout {
            Layout::V1 => "",
            Layout::V2 => ", written after this one was synced",
        };
        return Err(WalError::corrupt(
            path,
            at as u64,
            format!(
                "{bad} (a valid record, lsn {later_lsn}{proof}, follows at byte {later_at}: damage, not a torn write)"
            ),
        ));
    }
    let end = match layout {
        Layout::V1 => data.len(),
        // The bad bytes end where the zeros synced ahead begin.
        Layout::V2 => nonzero_end(data),
    };
    Ok(Some(TornTail {
        file: path.to_path_buf(),
        offset: at as u64,
        bytes_dropped: (end.max(at) - at) as u64,
        reason: bad.to_string(),
        acknowledged_lost: false,
    }))
}

/// A bad record in a finished segment: never a torn tail, since nothing is
/// written to a segment after it is finished and synced.
pub(crate) fn sealed_damage(path: &Path, at: usize, bad: &BadRecord) -> WalError {
    WalError::corrupt(
        path,
        at as u64,
        format!("{bad} (in a segment that is not the last one: damage, not a torn write)"),
    )
}

/// The error for a segment that does not start where the previous one
/// ended: a missing segment, or one cut short.
pub(crate) fn segment_gap(
    path: &Path,
    first: Lsn,
    previous: &Path,
    previous_last: Lsn,
) -> WalError {
    WalError::corrupt(
        path,
        0,
        format!(
            "the segment starts at lsn {first} but the previous segment ({}) ends at lsn {previous_last}",
            previous.display()
        ),
    )
}
