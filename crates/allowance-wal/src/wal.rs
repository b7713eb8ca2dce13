//! The log: appends in memory, one writer thread doing group commits,
//! waiters woken per batch, replay and snapshots.

use std::any::Any;
use std::mem;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};
use tokio::sync::oneshot;

use crate::format::{
    self, MAX_RECORD_BYTES, RECORD_HEADER_BYTES, SEGMENT_HEADER_BYTES, check_segment_header,
    parse_record, parse_snapshot_name, snapshot_name,
};
use crate::fs::FileSystem;
use crate::recover::{self, Active, Segment, create_segment, write_all_at};
use crate::{Fsync, Lsn, Recovered, ReplayProgress, WalError, WalOptions};

/// Replay reports progress every this many records (and once at the end).
const PROGRESS_EVERY_RECORDS: u64 = 1 << 16;
/// The writer keeps its batch buffer's allocation between batches up to
/// this size, so a burst does not pin its peak memory forever.
const KEEP_BATCH_CAPACITY: usize = 4 << 20;
/// Under [`Fsync::Always`] the writer keeps at least this much room of
/// zeros, written and synced, ahead of the records: an `fdatasync` of
/// records written over them need not commit a new file size through the
/// file system's journal, which measured 0.05–0.09 ms of every lone
/// request's fsync on ext4.
const ZEROS_LOW_WATER_BYTES: u64 = 256 << 10;
/// How much room of zeros the writer adds at a time, between batches: one
/// size commit per this many bytes of records, each a short stall of the
/// batches that arrive meanwhile.
const ZEROS_CHUNK_BYTES: u64 = 1 << 20;

/// A write-ahead log in a data dir. `Send + Sync`: share it in an `Arc`.
///
/// Records get dense lsns from 1 in the order of [`append`](Wal::append)
/// calls. One writer thread takes everything appended since its last batch,
/// writes it with one `write`, syncs it per [`Fsync`], then wakes the
/// waiters of that batch: concurrent callers share one fsync.
///
/// After a write or fsync error the log is *failed*: appends and waits
/// return [`WalError::Failed`], and the writer, before it stops, cuts the
/// active segment back to the end of the last acknowledged record (through
/// a new file handle: a failed fsync is never retried on the same one).
/// The owner recovers by dropping the `Wal` and opening the dir again,
/// which re-reads the disk: every acknowledged record is there; a record
/// appended but not acknowledged may or may not be (if the cut itself
/// failed, it may reappear).
///
/// Dropping the `Wal` writes and syncs what was appended, then releases the
/// lock; [`close`](Wal::close) does the same and reports a failure.
pub struct Wal {
    shared: Arc<Shared>,
    writer: Mutex<Option<JoinHandle<()>>>,
    // Dropped after `Drop::drop` joined the writer: the dir stays locked
    // until the last write is done.
    _lock: Box<dyn Any + Send + Sync>,
}

struct Shared {
    dir: PathBuf,
    fsync: Fsync,
    segment_bytes: u64,
    max_pending_bytes: u64,
    write_every: Option<std::time::Duration>,
    fs: Arc<dyn FileSystem>,
    state: Mutex<State>,
    /// Wakes the writer: something was appended, a sync is wanted, or shutdown.
    writer_cv: Condvar,
    /// Wakes blocking waiters (a snapshot waiting for its sync).
    progress_cv: Condvar,
    segments: Mutex<Vec<Segment>>,
    /// One snapshot at a time.
    snapshot_lock: Mutex<()>,
}

struct State {
    /// Encoded records appended since the writer's last batch.
    pending: Vec<u8>,
    /// The lsn of the first record in `pending` (meaningful when non-empty).
    pending_first_lsn: Lsn,
    /// The last lsn appended.
    last_lsn: Lsn,
    /// Every record up to here has been written to its segment.
    written_lsn: Lsn,
    /// Every record up to here has been fsynced.
    synced_lsn: Lsn,
    failed: Option<Arc<str>>,
    sync_wanted: bool,
    shutdown: bool,
    /// Every record up to here is durable per the policy (what
    /// [`Wal::durable`] waits for).
    durable_lsn: Lsn,
    /// Async waiters of [`Wal::durable`], each woken once, when its own
    /// record is durable: waking every waiter on every batch (a watch
    /// channel) cost more CPU than the fsync saved at 64 in flight.
    waiters: Vec<(Lsn, Waiter)>,
}

/// Resolves a [`Wal::durable`] call: `Ok`, or the cause of the failure.
type Waiter = oneshot::Sender<Result<(), Arc<str>>>;

impl Shared {
    fn durable_lsn(&self, written: Lsn, synced: Lsn) -> Lsn {
        match self.fsync {
            Fsync::Always => synced,
            Fsync::Batch { .. } | Fsync::Never => written,
        }
    }
}

impl Wal {
    /// Opens (or creates) the log in `opts.dir`.
    ///
    /// Takes the dir's `LOCK` file (a second `Wal` on the same dir, in this
    /// process or another, gets [`WalError::Locked`] naming the dir and the
    /// holder's pid), scans every segment, cuts a torn tail off the last one
    /// (reported in [`Recovered::torn_tail`]) and fails with
    /// [`WalError::Corrupt`] — file, byte offset, what is wrong — on damage
    /// anywhere else (with [`WalOptions::defer_sealed_checks`], damage in a
    /// finished segment is reported by the replay that reads it instead).
    /// Then it starts the writer thread.
    pub fn open(opts: WalOptions, fs: Arc<dyn FileSystem>) -> Result<(Wal, Recovered), WalError> {
        opts.validate()?;
        let opened = recover::open_dir(&opts, fs.as_ref())?;
        let last = opened.recovered.last_lsn;
        let shared = Arc::new(Shared {
            dir: opts.dir,
            fsync: opts.fsync,
            segment_bytes: opts.segment_bytes,
            max_pending_bytes: opts.max_pending_bytes,
            write_every: opts.write_every,
            fs,
            state: Mutex::new(State {
                pending: Vec::new(),
                pending_first_lsn: last + 1,
                last_lsn: last,
                written_lsn: last,
                synced_lsn: last,
                failed: None,
                sync_wanted: false,
                shutdown: false,
                durable_lsn: last,
                waiters: Vec::new(),
            }),
            writer_cv: Condvar::new(),
            progress_cv: Condvar::new(),
            segments: Mutex::new(opened.segments),
            snapshot_lock: Mutex::new(()),
        });
        let mut writer = Writer {
            zeroing: shared.fsync == Fsync::Always,
            shared: Arc::clone(&shared),
            active: opened.active,
            dirty_since: None,
            written_lsn: last,
            synced_lsn: last,
        };
        // Before the writer starts: the first records already find zeros.
        writer.zero_ahead()?;
        let handle = std::thread::Builder::new()
            .name("allowance-wal".to_owned())
            .spawn(move || writer.run())
            .map_err(|e| WalError::io("start the writer thread for", &shared.dir, e))?;
        let wal = Wal {
            shared,
            writer: Mutex::new(Some(handle)),
            _lock: opened.lock,
        };
        Ok((wal, opened.recovered))
    }

    /// Appends `payload` as the next record and returns its lsn. Does no
    /// I/O: the record reaches the disk with the writer's next batch (await
    /// [`durable`](Wal::durable)). The order of `append` calls is the log's
    /// order, so callers append while holding their own lock.
    ///
    /// Fails, appending nothing, when the log has failed, the payload
    /// exceeds [`MAX_RECORD_BYTES`], or the backlog is full.
    pub fn append(&self, payload: &[u8]) -> Result<Lsn, WalError> {
        let lsn = self.append_unannounced(payload)?;
        if self.shared.write_every.is_none() {
            self.shared.writer_cv.notify_one();
        }
        Ok(lsn)
    }

    /// [`append`](Wal::append) without waking the writer: the first
    /// [`durable`](Wal::durable) call that waits does. For records a task
    /// appends together and then waits for together (a gateway call's own
    /// hold and its place upstream): woken at the first append, the writer
    /// could take that record alone, and the second would wait for a
    /// second fsync behind it. A record nobody waits for is written with
    /// the next batch anyone asks for.
    pub fn append_unannounced(&self, payload: &[u8]) -> Result<Lsn, WalError> {
        if payload.len() > MAX_RECORD_BYTES {
            return Err(WalError::RecordTooLarge {
                bytes: payload.len(),
                max: MAX_RECORD_BYTES,
            });
        }
        let mut state = self.shared.state.lock();
        if let Some(cause) = &state.failed {
            return Err(WalError::Failed {
                cause: Arc::clone(cause),
            });
        }
        let pending = state.pending.len() as u64;
        let record = (RECORD_HEADER_BYTES + payload.len()) as u64;
        if pending > 0 && pending + record > self.shared.max_pending_bytes {
            return Err(WalError::Backlog {
                pending_bytes: pending,
                max: self.shared.max_pending_bytes,
            });
        }
        let lsn = state.last_lsn + 1;
        if pending == 0 {
            state.pending_first_lsn = lsn;
        }
        format::encode_record(&mut state.pending, lsn, payload);
        state.last_lsn = lsn;
        Ok(lsn)
    }

    /// Resolves once record `lsn` (and every one before it) is durable per
    /// the [`Fsync`] policy: `Always`, after the fdatasync of a group
    /// commit holding it; `Batch` and `Never`, after its `write(2)`.
    ///
    /// Fails if the log fails first (every waiter of a failed batch gets
    /// the error), or if `lsn` was never appended. `lsn` 0 is at once durable.
    pub async fn durable(&self, lsn: Lsn) -> Result<(), WalError> {
        let rx = {
            let mut state = self.shared.state.lock();
            if lsn > state.last_lsn {
                return Err(WalError::NotAppended {
                    lsn,
                    last: state.last_lsn,
                });
            }
            if state.durable_lsn >= lsn {
                return Ok(());
            }
            if let Some(cause) = &state.failed {
                return Err(WalError::Failed {
                    cause: Arc::clone(cause),
                });
            }
            // Registered under the lock the writer publishes under: no
            // wake-up can slip between the check above and this.
            let (tx, rx) = oneshot::channel();
            state.waiters.push((lsn, tx));
            rx
        };
        // A no-op unless the writer sleeps: then this record was appended
        // unannounced and nothing else woke it. (After the lock: a woken
        // writer must not find it held.)
        if self.shared.write_every.is_none() {
            self.shared.writer_cv.notify_one();
        }
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(cause)) => Err(WalError::Failed { cause }),
            // The waiter was dropped with the log: an error beats a hang.
            Err(_) => Err(WalError::Failed {
                cause: Arc::from("the write-ahead log was closed"),
            }),
        }
    }

    /// Replays every record with an lsn above `after`, in order, through
    /// `f`; returns how many it replayed. See [`replay_with_progress`](Wal::replay_with_progress).
    pub fn replay(
        &self,
        after: Lsn,
        f: impl FnMut(Lsn, &[u8]) -> Result<(), String>,
    ) -> Result<u64, WalError> {
        self.replay_with_progress(after, f, |_| {})
    }

    /// Replays every record with an lsn above `after` that has been
    /// written (appends not yet written by the writer are not included),
    /// re-reading and re-checking the segments it reads as open does (each
    /// record's checksum and lsn, each segment starting where the previous
    /// one ended), so it fails with [`WalError::Corrupt`] where open would
    /// have, had damage come after open or open deferred the check
    /// ([`WalOptions::defer_sealed_checks`]); `progress` is called every
    /// 65,536 records and at the end. A record `f` refuses stops the replay
    /// with [`WalError::Replay`]. Records a snapshot removed cannot be
    /// replayed: [`WalError::Compacted`]. Meant for recovery, before
    /// snapshots start: a snapshot deleting a segment mid-replay makes the
    /// replay fail with an I/O error.
    pub fn replay_with_progress(
        &self,
        after: Lsn,
        mut f: impl FnMut(Lsn, &[u8]) -> Result<(), String>,
        mut progress: impl FnMut(ReplayProgress),
    ) -> Result<u64, WalError> {
        let upto = self.shared.state.lock().written_lsn;
        let segments = self.shared.segments.lock().clone();
        if after >= upto {
            progress(ReplayProgress {
                replayed: 0,
                total: 0,
            });
            return Ok(0);
        }
        let first = segments.first().map_or(upto + 1, |s| s.first_lsn);
        if after + 1 < first {
            return Err(WalError::Compacted { after, first });
        }
        let total = upto - after;
        let mut replayed = 0u64;
        let mut next = first;
        let mut end = (PathBuf::new(), 0u64);
        // The segment read before this one, if any: where this one must
        // start (checked here too, for a log opened with
        // `defer_sealed_checks`, whose open did not).
        let mut previous: Option<&Path> = None;
        for (i, segment) in segments.iter().enumerate() {
            if next > upto {
                break;
            }
            let following = segments.get(i + 1).map(|s| s.first_lsn);
            if following.is_some_and(|f| f <= after + 1) {
                next = segments[i + 1].first_lsn;
                continue;
            }
            let path = &segment.path;
            if let Some(previous) = previous
                && segment.first_lsn != next
            {
                return Err(recover::segment_gap(
                    path,
                    segment.first_lsn,
                    previous,
                    next - 1,
                ));
            }
            let data = self
                .shared
                .fs
                .read(path)
                .map_err(|e| WalError::io("read segment", path, e))?;
            let layout =
                check_segment_header(&data).map_err(|what| WalError::corrupt(path, 0, what))?;
            let mut at = SEGMENT_HEADER_BYTES as usize;
            next = segment.first_lsn;
            while at < data.len() && next <= upto {
                let record = parse_record(&data, at, layout).map_err(|bad| match following {
                    Some(_) => recover::sealed_damage(path, at, &bad),
                    None => WalError::corrupt(path, at as u64, bad.to_string()),
                })?;
                if record.lsn != next {
                    return Err(WalError::corrupt(
                        path,
                        at as u64,
                        format!("the record has lsn {}, expected {next}", record.lsn),
                    ));
                }
                if let Some(following) = following
                    && record.lsn >= following
                {
                    return Err(WalError::corrupt(
                        path,
                        at as u64,
                        format!(
                            "the record has lsn {}, but the next segment ({}) starts at lsn {following}",
                            record.lsn,
                            segments[i + 1].path.display()
                        ),
                    ));
                }
                if record.lsn > after {
                    f(record.lsn, record.payload).map_err(|message| WalError::Replay {
                        lsn: record.lsn,
                        message,
                    })?;
                    replayed += 1;
                    if replayed.is_multiple_of(PROGRESS_EVERY_RECORDS) {
                        progress(ReplayProgress { replayed, total });
                    }
                }
                at = record.end;
                next += 1;
            }
            end = (path.clone(), at as u64);
            previous = Some(path);
        }
        if next <= upto {
            // Something removed or cut a segment behind our back.
            return Err(WalError::corrupt(
                &end.0,
                end.1,
                format!(
                    "the log ends at lsn {} but lsn {upto} was written",
                    next - 1
                ),
            ));
        }
        progress(ReplayProgress { replayed, total });
        Ok(replayed)
    }

    /// Writes `bytes` as the snapshot of the state after record `lsn`,
    /// atomically (temporary file, fsync, rename, fsync of the dir), then
    /// deletes older snapshots and every segment whose records are all at
    /// or below `lsn`.
    ///
    /// Blocks until the log is fsynced up to `lsn` first (whatever the
    /// policy), so a snapshot never covers records the log could still
    /// lose; call it off the async runtime. Fails, changing nothing, if
    /// `lsn` was never appended or is older than the latest snapshot. A
    /// failure here does not fail the log.
    pub fn write_snapshot(&self, lsn: Lsn, bytes: &[u8]) -> Result<(), WalError> {
        let _one_at_a_time = self.shared.snapshot_lock.lock();
        {
            let state = self.shared.state.lock();
            if let Some(cause) = &state.failed {
                return Err(WalError::Failed {
                    cause: Arc::clone(cause),
                });
            }
            if lsn > state.last_lsn {
                return Err(WalError::NotAppended {
                    lsn,
                    last: state.last_lsn,
                });
            }
        }
        let older = self.snapshot_lsns()?;
        if let Some(&latest) = older.last()
            && lsn < latest
        {
            return Err(WalError::SnapshotOlder { lsn, latest });
        }
        self.wait_synced(lsn)?;

        let fs = self.shared.fs.as_ref();
        let dir = self.shared.dir.as_path();
        let name = snapshot_name(lsn);
        let path = dir.join(&name);
        let tmp = dir.join(format!("{name}.tmp"));
        let written = write_file_durably(fs, &tmp, &format::encode_snapshot(lsn, bytes));
        if let Err(e) = written {
            // Best effort: open() removes leftovers anyway.
            let _ = fs.remove_file(&tmp);
            return Err(e);
        }
        fs.rename(&tmp, &path)
            .map_err(|e| WalError::io("rename snapshot into place", &path, e))?;
        sync_dir(fs, dir)?;

        for old in older.into_iter().filter(|&old| old < lsn) {
            let old_path = dir.join(snapshot_name(old));
            fs.remove_file(&old_path)
                .map_err(|e| WalError::io("remove old snapshot", &old_path, e))?;
        }
        let mut segments = self.shared.segments.lock();
        // The last segment is the writer's: never deleted, even if covered.
        let covered = segments
            .windows(2)
            .take_while(|pair| pair[1].first_lsn <= lsn + 1)
            .count();
        let mut removed = 0;
        let mut outcome = Ok(());
        for segment in &segments[..covered] {
            if let Err(e) = fs.remove_file(&segment.path) {
                outcome = Err(WalError::io(
                    "remove segment covered by the snapshot",
                    &segment.path,
                    e,
                ));
                break;
            }
            removed += 1;
        }
        segments.drain(..removed);
        drop(segments);
        outcome?;
        sync_dir(fs, dir)
    }

    /// The latest snapshot, checked against its checksum: `(lsn, bytes)`.
    pub fn latest_snapshot(&self) -> Result<Option<(Lsn, Vec<u8>)>, WalError> {
        let Some(&lsn) = self.snapshot_lsns()?.last() else {
            return Ok(None);
        };
        let path = self.shared.dir.join(snapshot_name(lsn));
        let data = self
            .shared
            .fs
            .read(&path)
            .map_err(|e| WalError::io("read snapshot", &path, e))?;
        let bytes = format::decode_snapshot(&data, lsn)
            .map_err(|(offset, what)| WalError::corrupt(&path, offset, what))?;
        Ok(Some((lsn, bytes)))
    }

    /// Whether a write or fsync failed; the log then needs reopening.
    pub fn is_failed(&self) -> bool {
        self.shared.state.lock().failed.is_some()
    }

    /// The last lsn appended (0 for an empty log).
    pub fn last_lsn(&self) -> Lsn {
        self.shared.state.lock().last_lsn
    }

    /// Every record up to this lsn is durable per the [`Fsync`] policy.
    pub fn durable_lsn(&self) -> Lsn {
        self.shared.state.lock().durable_lsn
    }

    /// Every record up to this lsn has been fsynced (under [`Fsync::Always`]
    /// the same as [`durable_lsn`](Wal::durable_lsn); under the others it
    /// may lag what was acknowledged).
    pub fn synced_lsn(&self) -> Lsn {
        self.shared.state.lock().synced_lsn
    }

    /// The data dir.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// Writes and syncs everything appended, stops the writer and releases
    /// the dir; fails if the log had failed (or fails doing so).
    pub fn close(self) -> Result<(), WalError> {
        self.stop_writer();
        match &self.shared.state.lock().failed {
            Some(cause) => Err(WalError::Failed {
                cause: Arc::clone(cause),
            }),
            None => Ok(()),
        }
    }

    fn stop_writer(&self) {
        let Some(handle) = self.writer.lock().take() else {
            return;
        };
        self.shared.state.lock().shutdown = true;
        self.shared.writer_cv.notify_one();
        // The writer never panics; if it did, its failure is already recorded
        // or the records were never acknowledged: nothing to add here.
        let _ = handle.join();
    }

    /// Blocks until everything appended so far is fsynced, whatever the
    /// policy (a log derived from another is made safe before the other
    /// deletes what it was derived from). Call it off the async runtime.
    pub fn sync_all(&self) -> Result<Lsn, WalError> {
        let lsn = self.last_lsn();
        self.wait_synced(lsn)?;
        Ok(lsn)
    }

    fn wait_synced(&self, lsn: Lsn) -> Result<(), WalError> {
        let mut state = self.shared.state.lock();
        loop {
            if state.synced_lsn >= lsn {
                return Ok(());
            }
            if let Some(cause) = &state.failed {
                return Err(WalError::Failed {
                    cause: Arc::clone(cause),
                });
            }
            state.sync_wanted = true;
            self.shared.writer_cv.notify_one();
            self.shared.progress_cv.wait(&mut state);
        }
    }

    fn snapshot_lsns(&self) -> Result<Vec<Lsn>, WalError> {
        let dir = &self.shared.dir;
        let names = self
            .shared
            .fs
            .list_dir(dir)
            .map_err(|e| WalError::io("list data dir", dir, e))?;
        let mut lsns: Vec<Lsn> = names
            .iter()
            .filter_map(|n| parse_snapshot_name(n))
            .collect();
        lsns.sort_unstable();
        Ok(lsns)
    }
}

impl Drop for Wal {
    fn drop(&mut self) {
        self.stop_writer();
    }
}

fn sync_dir(fs: &dyn FileSystem, dir: &Path) -> Result<(), WalError> {
    fs.sync_dir(dir)
        .map_err(|e| WalError::io("fsync data dir", dir, e))
}

fn write_file_durably(fs: &dyn FileSystem, path: &Path, bytes: &[u8]) -> Result<(), WalError> {
    let mut file = fs
        .create(path)
        .map_err(|e| WalError::io("create snapshot", path, e))?;
    write_all_at(file.as_mut(), bytes, 0).map_err(|e| WalError::io("write snapshot", path, e))?;
    file.sync_data()
        .map_err(|e| WalError::io("fsync snapshot", path, e))
}

/// How many leading bytes of `bytes` (encoded records) to write into a
/// segment with `room` bytes left, and how many records they hold: records
/// until one reaches `room`, at least one.
fn split_records(bytes: &[u8], room: u64) -> (usize, u64) {
    let mut at = 0usize;
    let mut records = 0u64;
    while at + RECORD_HEADER_BYTES <= bytes.len() {
        let mut len = [0u8; 4];
        len.copy_from_slice(&bytes[at..at + 4]);
        at += RECORD_HEADER_BYTES + u32::from_le_bytes(len) as usize;
        records += 1;
        if at as u64 >= room {
            break;
        }
    }
    (at.min(bytes.len()), records)
}

/// The writer thread's own state.
struct Writer {
    shared: Arc<Shared>,
    active: Active,
    /// When the oldest written-but-unsynced byte was written.
    dirty_since: Option<Instant>,
    written_lsn: Lsn,
    synced_lsn: Lsn,
    /// Whether to keep zeros synced ahead of the records: under
    /// [`Fsync::Always`], until writing them fails (a full disk: records
    /// are then appended, growing the file, until the next segment).
    zeroing: bool,
}

/// One batch taken from the appenders.
struct Batch {
    first_lsn: Lsn,
    last_lsn: Lsn,
    force_sync: bool,
    shutdown: bool,
}

impl Writer {
    fn run(mut self) {
        let mut bytes = Vec::new();
        loop {
            let batch = self.take(&mut bytes);
            let outcome = self.commit(&mut bytes, &batch);
            bytes.clear();
            if bytes.capacity() > KEEP_BATCH_CAPACITY {
                bytes = Vec::new();
            }
            // After the batch's waiters were woken: topping up the zeros
            // delays only the batches that come meanwhile.
            let outcome = outcome.and_then(|()| match batch.shutdown {
                true => Ok(()),
                false => self.zero_ahead(),
            });
            match outcome {
                Ok(()) if batch.shutdown => return self.cut_zeros(),
                Ok(()) => {}
                Err(e) => return self.fail(&e),
            }
        }
    }

    /// Tops up the zeros ahead of the records when less than
    /// [`ZEROS_LOW_WATER_BYTES`] remain (never past the segment's size).
    /// Fails only if their fsync fails: after a failed write (a full disk)
    /// the records are appended as to any growing file, and a log that
    /// cannot write its records fails on them.
    fn zero_ahead(&mut self) -> Result<(), WalError> {
        let active = &mut self.active;
        let limit = self.shared.segment_bytes;
        if !self.zeroing
            || active.zeroed_to >= limit
            || active.zeroed_to - active.bytes >= ZEROS_LOW_WATER_BYTES
        {
            return Ok(());
        }
        let to = (active.zeroed_to + ZEROS_CHUNK_BYTES).min(limit);
        let zeros = vec![0u8; (to - active.zeroed_to) as usize];
        let written = write_all_at(active.file.as_mut(), &zeros, active.zeroed_to);
        // Even a failed write may have grown the file: a roll or a stop
        // must still cut it back to its last record.
        active.zeroed_to = to;
        if written.is_err() {
            self.zeroing = false;
            return Ok(());
        }
        active
            .file
            .sync_data()
            .map_err(|e| WalError::io("fsync segment", &active.path, e))
    }

    /// A clean stop leaves the segment ending at its last record. Best
    /// effort: zeros after the records are a clean end all the same.
    fn cut_zeros(&mut self) {
        let active = &mut self.active;
        if active.zeroed_to > active.bytes {
            let _ = active
                .file
                .set_len(active.bytes)
                .and_then(|()| active.file.sync_data());
        }
    }

    /// Waits for work, then takes everything appended so far into `bytes`.
    fn take(&self, bytes: &mut Vec<u8>) -> Batch {
        let shared = &self.shared;
        let mut state = shared.state.lock();
        loop {
            if !state.pending.is_empty() || state.sync_wanted || state.shutdown {
                break;
            }
            if let Some(every) = shared.write_every {
                // Appends do not wake this writer: it looks every `every`
                // (a sync request or shutdown still wakes it at once).
                shared.writer_cv.wait_for(&mut state, every);
                continue;
            }
            let deadline = match (shared.fsync, self.dirty_since) {
                (Fsync::Batch { window }, Some(since)) => Some(since + window),
                _ => None,
            };
            match deadline {
                Some(deadline) if Instant::now() >= deadline => break,
                Some(deadline) => {
                    shared.writer_cv.wait_until(&mut state, deadline);
                }
                None => shared.writer_cv.wait(&mut state),
            }
        }
        mem::swap(&mut state.pending, bytes);
        Batch {
            first_lsn: state.pending_first_lsn,
            last_lsn: state.last_lsn,
            force_sync: mem::take(&mut state.sync_wanted) || state.shutdown,
            shutdown: state.shutdown,
        }
    }

    /// Writes one batch with one write, syncs per policy, wakes waiters.
    fn commit(&mut self, bytes: &mut [u8], batch: &Batch) -> Result<(), WalError> {
        // Stamped now, not at append: only the writer knows what is synced.
        // Under `Never` nothing is synced while the log runs: the stamp
        // says what was written before, which a process crash cannot lose,
        // so damage in the middle of the log is still told from a torn end.
        let stamp = match self.shared.fsync {
            Fsync::Never => self.written_lsn | format::WRITTEN_STAMP,
            Fsync::Always | Fsync::Batch { .. } => self.synced_lsn,
        };
        format::seal_records(bytes, stamp);
        let bytes = &*bytes;
        let mut rest = bytes;
        let mut next_lsn = batch.first_lsn;
        while !rest.is_empty() {
            let segment_bytes = self.shared.segment_bytes;
            if self.active.bytes >= segment_bytes && self.active.bytes > SEGMENT_HEADER_BYTES {
                self.roll(next_lsn)?;
            }
            // Usually the whole batch; at a roll, the records up to the one
            // that fills the segment (at least one record).
            let (take, records) =
                split_records(rest, segment_bytes - self.active.bytes.min(segment_bytes));
            let active = &mut self.active;
            write_all_at(active.file.as_mut(), &rest[..take], active.bytes)
                .map_err(|e| WalError::io("write segment", &active.path, e))?;
            active.bytes += take as u64;
            active.zeroed_to = active.zeroed_to.max(active.bytes);
            rest = &rest[take..];
            next_lsn += records;
            self.written_lsn = next_lsn - 1;
            self.dirty_since.get_or_insert_with(Instant::now);
        }
        debug_assert!(bytes.is_empty() || self.written_lsn == batch.last_lsn);
        let sync = match self.dirty_since {
            None => false,
            Some(since) => {
                batch.force_sync
                    || match self.shared.fsync {
                        Fsync::Always => true,
                        Fsync::Batch { window } => since.elapsed() >= window,
                        Fsync::Never => false,
                    }
            }
        };
        if sync {
            self.sync()?;
        }
        if self.shared.fsync != Fsync::Always {
            // Acknowledged at the write: a failure keeps it. (After a failed
            // fsync a later power loss may then turn it into zeros in the
            // middle of the log, which open reports as damage: the price of
            // acknowledging before the fsync. `Always` has no such window.)
            self.active.acked_bytes = self.active.bytes;
        }
        self.publish();
        Ok(())
    }

    fn sync(&mut self) -> Result<(), WalError> {
        self.active
            .file
            .sync_data()
            .map_err(|e| WalError::io("fsync segment", &self.active.path, e))?;
        self.synced_lsn = self.written_lsn;
        self.dirty_since = None;
        self.active.acked_bytes = self.active.bytes;
        Ok(())
    }

    /// Finishes the active segment (cut back to its last record and synced
    /// whatever the policy, so only the last segment can ever have a torn
    /// tail or zeros at its end) and starts the next one.
    fn roll(&mut self, first_lsn: Lsn) -> Result<(), WalError> {
        let active = &mut self.active;
        if active.zeroed_to > active.bytes {
            active
                .file
                .set_len(active.bytes)
                .map_err(|e| WalError::io("cut the zeros after the records of", &active.path, e))?;
            active.zeroed_to = active.bytes;
            self.sync()?;
        } else if self.dirty_since.is_some() {
            self.sync()?;
        }
        let shared = &self.shared;
        let (file, path) = create_segment(shared.fs.as_ref(), &shared.dir, first_lsn)?;
        shared.segments.lock().push(Segment {
            first_lsn,
            path: path.clone(),
        });
        self.active = Active {
            file,
            path,
            bytes: SEGMENT_HEADER_BYTES,
            acked_bytes: SEGMENT_HEADER_BYTES,
            zeroed_to: SEGMENT_HEADER_BYTES,
        };
        self.zeroing = self.shared.fsync == Fsync::Always;
        Ok(())
    }

    fn publish(&self) {
        let durable = self.shared.durable_lsn(self.written_lsn, self.synced_lsn);
        let mut ready = Vec::new();
        {
            let mut state = self.shared.state.lock();
            state.written_lsn = self.written_lsn;
            state.synced_lsn = self.synced_lsn;
            if durable > state.durable_lsn {
                state.durable_lsn = durable;
                // Only the waiters whose record this batch made durable.
                let waiters = mem::take(&mut state.waiters);
                for (lsn, tx) in waiters {
                    if lsn <= durable {
                        ready.push(tx);
                    } else {
                        state.waiters.push((lsn, tx));
                    }
                }
            }
        }
        self.shared.progress_cv.notify_all();
        for tx in ready {
            let _ = tx.send(Ok(()));
        }
    }

    /// Marks the log failed after cutting the active segment back to its
    /// last acknowledged record, so a reopen in this process does not find
    /// unacknowledged records whose pages the kernel may already have given
    /// up on (after a failed fsync, Linux can drop them from the disk while
    /// a read still shows them).
    fn fail(self, error: &WalError) {
        let Writer { shared, active, .. } = self;
        let Active {
            file,
            path,
            acked_bytes,
            ..
        } = active;
        // Never retry on the handle that failed.
        drop(file);
        let mut cause = error.to_string();
        let cut = shared.fs.open_write(&path).and_then(|mut file| {
            file.set_len(acked_bytes)?;
            file.sync_data()
        });
        if let Err(e) = cut {
            cause.push_str(&format!(
                "; cutting {} back to its last acknowledged record also failed ({e}), \
                 so unacknowledged records may reappear on reopen",
                path.display()
            ));
        }
        let cause: Arc<str> = Arc::from(cause);
        let waiters = {
            let mut state = shared.state.lock();
            state.failed = Some(Arc::clone(&cause));
            state.pending = Vec::new();
            mem::take(&mut state.waiters)
        };
        shared.progress_cv.notify_all();
        for (_, tx) in waiters {
            let _ = tx.send(Err(Arc::clone(&cause)));
        }
    }
}
