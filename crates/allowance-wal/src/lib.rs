//! # allowance-wal — the write-ahead log under the durable embedded store
//!
//! The embedded store must not forget a day's spend when the process dies,
//! so every ledger transition is appended here before it is acknowledged.
//! The payloads are opaque bytes: the store encodes its commands into them.
//!
//! - **record** — one payload with its lsn, the lsn synced when it was
//!   written, and a crc32c, in a segment file.
//! - **lsn** — log sequence number: dense, from 1, in `append` order.
//! - **group commit** — one writer thread writes everything appended since
//!   its last batch with one `write` and one fsync, then wakes that batch's
//!   waiters: 64 concurrent requests share one fsync.
//! - **zeros ahead** — under [`Fsync::Always`] records are written over
//!   zeros synced in advance, so a record's fsync commits no new file size.
//! - **torn tail** — the half-written end a crash leaves in the last
//!   segment (with holes, over zeros: pages reach the disk in any order):
//!   cut off at open and reported. Damage anywhere else — or a bad record
//!   followed by one written after it was synced — stops [`Wal::open`]
//!   with the file, the byte offset and what is wrong.
//! - **snapshot** — the store's state after some lsn; writing one deletes
//!   the segments it covers, so recovery time stays bounded.
//!
//! ```
//! use std::sync::Arc;
//! use allowance_wal::{RealFs, Wal, WalOptions};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = std::env::temp_dir().join(format!("allowance-wal-doc-{}", std::process::id()));
//! # let _ = std::fs::remove_dir_all(&dir);
//! let runtime = tokio::runtime::Builder::new_current_thread().build()?;
//! let (wal, recovered) = Wal::open(WalOptions::new(&dir), Arc::new(RealFs))?;
//! assert_eq!(recovered.last_lsn, 0);
//! let lsn = wal.append(b"reserve r1 1000 tokens")?;
//! runtime.block_on(wal.durable(lsn))?; // fsynced: now it may be acknowledged
//! drop(wal);
//!
//! let (wal, recovered) = Wal::open(WalOptions::new(&dir), Arc::new(RealFs))?;
//! assert_eq!((recovered.last_lsn, recovered.torn_tail), (1, None));
//! let mut seen = Vec::new();
//! wal.replay(0, |lsn, payload| Ok(seen.push((lsn, payload.to_vec()))))?;
//! assert_eq!(seen, [(1, b"reserve r1 1000 tokens".to_vec())]);
//! # drop(wal);
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok(())
//! # }
//! ```
//!
//! The on-disk format is described in the `format` module's source; the
//! torn-tail rule in `recover`'s.

#![forbid(unsafe_code)]

mod error;
mod faulty;
mod format;
mod fs;
mod options;
mod recover;
mod wal;

pub use error::WalError;
pub use faulty::{FaultyFs, FsStats};
pub use format::MAX_RECORD_BYTES;
pub use fs::{FileSystem, LockAttempt, RealFs, WalFile};
pub use options::{
    DEFAULT_MAX_PENDING_BYTES, DEFAULT_SEGMENT_BYTES, Fsync, MAX_BATCH_WINDOW, MAX_SEGMENT_BYTES,
    MIN_SEGMENT_BYTES, Recovered, ReplayProgress, TornTail, WalOptions,
};
pub use wal::Wal;

/// A log sequence number: dense, starting at 1; 0 means "before the first record".
pub type Lsn = u64;
