//! How a [`Wal`](crate::Wal) is opened, and what opening it found.

use std::path::PathBuf;
use std::time::Duration;

use crate::{Lsn, WalError};

/// When a record counts as durable, so [`Wal::durable`](crate::Wal::durable)
/// resolves (`[store] fsync` in CONFIG.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fsync {
    /// After an `fdatasync` of the group commit that holds the record:
    /// nothing acknowledged is lost, not even on power loss.
    Always,
    /// After the `write(2)` of the group commit that holds the record; an
    /// `fdatasync` follows within `window`. A process crash loses nothing
    /// acknowledged; a power loss or kernel crash loses at most the records
    /// acknowledged in the last `window` (plus the time of one fsync).
    Batch {
        /// Longest time written data waits for its fsync; `1 ms ..= 60 s`.
        window: Duration,
    },
    /// After the `write(2)`; fsync only when a segment is rolled, before a
    /// snapshot and at a clean close. A process crash loses nothing
    /// acknowledged; a power loss may lose everything since the last fsync.
    Never,
}

/// Segments roll at 64 MiB by default: recovery reads a segment whole, and
/// a snapshot deletes whole segments, so this bounds both the memory of a
/// replay and what a snapshot leaves behind.
pub const DEFAULT_SEGMENT_BYTES: u64 = 64 << 20;
/// The smallest `segment_bytes` (tiny segments are for tests).
pub const MIN_SEGMENT_BYTES: u64 = 64;
/// The largest `segment_bytes`: recovery reads a segment into memory.
pub const MAX_SEGMENT_BYTES: u64 = 1 << 30;
/// Default bound on appended bytes waiting for the disk: a stalled disk
/// makes appends fail fast instead of growing memory without end.
pub const DEFAULT_MAX_PENDING_BYTES: u64 = 256 << 20;
/// The longest `Fsync::Batch` window: past a minute the "bound" on loss
/// stops meaning much for a billing ledger.
pub const MAX_BATCH_WINDOW: Duration = Duration::from_secs(60);

/// Where and how a [`Wal`](crate::Wal) keeps its log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalOptions {
    /// The data dir: segments, snapshots and the `LOCK` file. Created if missing.
    pub dir: PathBuf,
    /// When an appended record counts as durable.
    pub fsync: Fsync,
    /// A new segment file is started once the current one has reached this
    /// size (it may exceed it by one group commit); `64 ..= 1 GiB`.
    pub segment_bytes: u64,
    /// Appends fail with [`WalError::Backlog`] while this many bytes wait
    /// for the disk (one record is always accepted); at least 1.
    pub max_pending_bytes: u64,
    /// `None` (default): every append wakes the writer at once. `Some(d)`:
    /// appends never wake it; it writes what accumulated every `d` (or when
    /// a sync is asked for). For a log nobody waits on in a request's path
    /// (a derived log): far fewer wake-ups and fsyncs, each a bigger batch.
    pub write_every: Option<Duration>,
    /// `false` (default): open reads and checks every segment. `true`: open
    /// checks only the last segment (where a torn tail can be) and the
    /// segments' names; the finished segments are checked by the replays
    /// that read them, with the same errors open would give. For a caller
    /// that replays the whole log right after opening — recovery — this
    /// reads and checks the log once instead of twice. A finished segment
    /// no replay reads (all its records under the snapshot the caller
    /// starts from) is then never checked, and [`Recovered::records`]
    /// counts the finished segments' records from their names.
    pub defer_sealed_checks: bool,
}

impl WalOptions {
    /// The defaults (`Fsync::Always`, 64 MiB segments, 256 MiB backlog) in `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        WalOptions {
            dir: dir.into(),
            fsync: Fsync::Always,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            max_pending_bytes: DEFAULT_MAX_PENDING_BYTES,
            write_every: None,
            defer_sealed_checks: false,
        }
    }

    /// Checks every option; the error names the first bad one.
    pub fn validate(&self) -> Result<(), WalError> {
        if self.dir.as_os_str().is_empty() {
            return Err(WalError::InvalidOption {
                field: "dir",
                reason: "empty: an in-memory store has no write-ahead log".to_owned(),
            });
        }
        if let Fsync::Batch { window } = self.fsync
            && (window < Duration::from_millis(1) || window > MAX_BATCH_WINDOW)
        {
            return Err(WalError::InvalidOption {
                field: "fsync.window",
                reason: format!("{window:?} is outside 1ms ..= {MAX_BATCH_WINDOW:?}"),
            });
        }
        if !(MIN_SEGMENT_BYTES..=MAX_SEGMENT_BYTES).contains(&self.segment_bytes) {
            return Err(WalError::InvalidOption {
                field: "segment_bytes",
                reason: format!(
                    "{} is outside {MIN_SEGMENT_BYTES} ..= {MAX_SEGMENT_BYTES}",
                    self.segment_bytes
                ),
            });
        }
        if let Some(every) = self.write_every
            && (every < Duration::from_millis(1) || every > MAX_BATCH_WINDOW)
        {
            return Err(WalError::InvalidOption {
                field: "write_every",
                reason: format!("{every:?} is outside 1ms ..= {MAX_BATCH_WINDOW:?}"),
            });
        }
        if self.max_pending_bytes == 0 {
            return Err(WalError::InvalidOption {
                field: "max_pending_bytes",
                reason: "0: no record could ever be appended".to_owned(),
            });
        }
        Ok(())
    }
}

/// What [`Wal::open`](crate::Wal::open) found on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    /// The last lsn in the log (or of the latest snapshot, if that is
    /// later); the next append gets `last_lsn + 1`. 0 for a new log.
    pub last_lsn: Lsn,
    /// Records in the log files (snapshots not counted).
    pub records: u64,
    /// The lsn of the latest snapshot's file name, if there is one.
    pub snapshot_lsn: Option<Lsn>,
    /// The torn tail that was cut off, if there was one.
    pub torn_tail: Option<TornTail>,
}

/// A torn tail cut off at open: the end of the last segment that a crash
/// left half-written. Its records were never acknowledged under
/// `Fsync::Always`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    /// The segment file.
    pub file: PathBuf,
    /// Where the first incomplete or damaged record started; the file now
    /// ends here.
    pub offset: u64,
    /// How many bytes were cut off, not counting the zeros a version 2
    /// segment ends in (room synced ahead of the records).
    pub bytes_dropped: u64,
    /// What was wrong with the record at `offset`.
    pub reason: String,
    /// Acknowledged records were cut too: the bad bytes were a hole a power
    /// loss left in writes never fsynced (`Fsync::Never`), with records
    /// written after them. Otherwise only the last write before a crash
    /// was cut (acknowledged under `Fsync::Batch` or `Never` alone, and
    /// then only when the crash was a power loss).
    pub acknowledged_lost: bool,
}

/// How far a replay has come, for a progress bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayProgress {
    /// Records replayed so far.
    pub replayed: u64,
    /// Records this replay will replay in all.
    pub total: u64,
}
