//! What can go wrong, one variant per distinct cause.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use crate::Lsn;

/// An error of the write-ahead log.
#[derive(Debug, thiserror::Error)]
pub enum WalError {
    /// An option of [`WalOptions`](crate::WalOptions) is out of range.
    #[error("invalid write-ahead log option `{field}`: {reason}")]
    InvalidOption {
        /// The option, e.g. `segment_bytes`.
        field: &'static str,
        /// What is wrong with its value.
        reason: String,
    },
    /// Another [`Wal`](crate::Wal), in this process or another, has the dir.
    #[error(
        "data dir {} is in use by another allowance write-ahead log ({holder}); \
         one data dir serves one process at a time",
        dir.display()
    )]
    Locked {
        /// The data dir.
        dir: PathBuf,
        /// What the holder recorded, e.g. `pid 4242`.
        holder: String,
    },
    /// A file operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done, e.g. `read segment`.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// The log or a snapshot is damaged somewhere a crash cannot explain.
    /// Nothing was dropped: start-up stops until someone decides.
    #[error("{}: byte {offset}: {what}", file.display())]
    Corrupt {
        /// The damaged file.
        file: PathBuf,
        /// The byte offset of the damage in that file.
        offset: u64,
        /// What is wrong there.
        what: String,
    },
    /// An earlier write or fsync failed; the log takes nothing more until
    /// it is dropped and opened again.
    #[error("the write-ahead log failed and must be reopened: {cause}")]
    Failed {
        /// The first error, e.g. the failed fsync.
        cause: Arc<str>,
    },
    /// The payload exceeds [`MAX_RECORD_BYTES`](crate::MAX_RECORD_BYTES).
    #[error("record of {bytes} bytes exceeds the largest record ({max} bytes)")]
    RecordTooLarge {
        /// The payload's length.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// Appended records waiting for the disk exceed
    /// [`WalOptions::max_pending_bytes`](crate::WalOptions::max_pending_bytes);
    /// nothing was appended, and a later append may succeed.
    #[error(
        "the write-ahead log is {pending_bytes} bytes behind the disk (at most {max} allowed); try again"
    )]
    Backlog {
        /// Bytes appended and not yet written.
        pending_bytes: u64,
        /// The limit.
        max: u64,
    },
    /// An lsn that was never appended was given.
    #[error("lsn {lsn} was never appended (the last appended lsn is {last})")]
    NotAppended {
        /// The lsn given.
        lsn: Lsn,
        /// The last lsn appended so far.
        last: Lsn,
    },
    /// Replay was asked for records a snapshot already removed.
    #[error(
        "replay after lsn {after} needs records a snapshot removed: the log starts at lsn {first}"
    )]
    Compacted {
        /// The `after` given to replay.
        after: Lsn,
        /// The first lsn the log still holds.
        first: Lsn,
    },
    /// A snapshot older than the latest one was offered.
    #[error("snapshot at lsn {lsn} is older than the latest snapshot (lsn {latest})")]
    SnapshotOlder {
        /// The lsn of the offered snapshot.
        lsn: Lsn,
        /// The lsn of the latest snapshot on disk.
        latest: Lsn,
    },
    /// The replay callback refused a record.
    #[error("replaying lsn {lsn}: {message}")]
    Replay {
        /// The record it refused.
        lsn: Lsn,
        /// The callback's message.
        message: String,
    },
}

impl WalError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        WalError::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn corrupt(file: impl Into<PathBuf>, offset: u64, what: impl Into<String>) -> Self {
        WalError::Corrupt {
            file: file.into(),
            offset,
            what: what.into(),
        }
    }
}
