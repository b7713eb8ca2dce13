//! A file system that fails on command, for tests: [`FaultyFs`].

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::fs::{FileSystem, LockAttempt, RealFs, WalFile};

/// `ENOSPC`, as the kernel reports a full disk.
const ENOSPC: i32 = 28;
/// `EIO`, as the kernel reports a failed write or fsync.
const EIO: i32 = 5;

/// The real file system with faults injected on command, for tests.
///
/// - [`fail_write`](FaultyFs::fail_write) / [`fail_sync`](FaultyFs::fail_sync):
///   the n-th write or fsync from now fails with `EIO`, doing nothing.
/// - [`short_write`](FaultyFs::short_write): the n-th write writes only
///   half its bytes and says so, as `write(2)` may.
/// - [`fill_disk`](FaultyFs::fill_disk): after `free_bytes` more bytes every
///   write fails with `ENOSPC` (the write that crosses the line is short).
/// - [`crash`](FaultyFs::crash): a power loss — every file loses what was
///   never fsynced (but a chosen number of bytes: a torn write), and every
///   operation fails until [`recover`](FaultyFs::recover) — through a file
///   opened before the crash, for good (its process died with the power).
/// - [`crash_scattered`](FaultyFs::crash_scattered): a power loss that
///   keeps a random half of the unsynced blocks written over a file's
///   synced bytes, in no order (the file's size stays what was synced).
///
/// Bytes written over synced ones and lost in a crash read back as zeros:
/// the model of a log that only ever writes over zeros it synced ahead.
///
/// Like Linux, a failed fsync does not keep the data for a later one: the
/// bytes it should have made durable are lost at the next crash even if a
/// later fsync succeeds (they read back as zeros).
///
/// Clones share their faults and counters.
#[derive(Clone, Default)]
pub struct FaultyFs {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    real: RealFs,
    state: Mutex<FaultState>,
}

#[derive(Default)]
struct FaultState {
    stats: FsStats,
    fail_write_at: Option<u64>,
    fail_sync_at: Option<u64>,
    short_write_at: Option<u64>,
    free_bytes: Option<u64>,
    sync_delay: Duration,
    crashed: bool,
    /// Power losses so far. A file opened before the last one belongs to
    /// a process the power loss killed: it fails for good, even after
    /// [`FaultyFs::recover`] (a thread of the old store still finishing,
    /// say a snapshot, must not write through it into the recovered disk).
    crashes: u64,
    /// What each file (by id) has durably; ids follow renames, as inodes do.
    tracks: HashMap<u64, Track>,
    /// The file id behind each path written through us.
    paths: HashMap<PathBuf, u64>,
    next_id: u64,
}

/// What a file has durably, as a disk would after a power loss.
#[derive(Default, Clone)]
struct Track {
    synced_len: u64,
    /// Ranges a failed fsync gave up on: zeros after a crash.
    lost: Vec<(u64, u64)>,
    /// Ranges below `synced_len` written since the last fsync: each of
    /// their pages may or may not survive a crash.
    dirty: Vec<(u64, u64)>,
}

/// What a crash keeps of the bytes not yet fsynced.
#[derive(Clone, Copy)]
enum Survivors {
    /// The first this many, in file order (a torn sequential write).
    Prefix(u64),
    /// Each block of this many bytes written over synced bytes with even
    /// odds (a seeded choice); nothing past the synced size.
    Scattered { seed: u64, block_bytes: u64 },
}

/// Cuts `ranges` at `len` (a file truncated there), dropping empty ones.
fn trim_ranges(ranges: &mut Vec<(u64, u64)>, len: u64) {
    ranges.retain_mut(|range| {
        range.1 = range.1.min(len);
        range.0 < range.1
    });
}

/// A well-mixed 64-bit hash (splitmix64's finaliser), for seeded choices.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Counts of the operations that went through a [`FaultyFs`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FsStats {
    /// `write` calls on files (successful or not).
    pub writes: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// `sync_data` calls on files (successful or not).
    pub syncs: u64,
    /// `sync_dir` calls.
    pub dir_syncs: u64,
}

fn os_error(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

impl FaultyFs {
    /// A fault-free file system over the real one.
    pub fn new() -> Self {
        FaultyFs::default()
    }

    /// The `n`-th file write from now (1 = the next) fails with `EIO`.
    pub fn fail_write(&self, n: u64) {
        let mut state = self.inner.state.lock();
        state.fail_write_at = Some(state.stats.writes + n.max(1));
    }

    /// The `n`-th fsync of a file from now (1 = the next) fails with `EIO`.
    pub fn fail_sync(&self, n: u64) {
        let mut state = self.inner.state.lock();
        state.fail_sync_at = Some(state.stats.syncs + n.max(1));
    }

    /// The `n`-th file write from now (1 = the next) writes only half of
    /// its bytes (at least one) and reports that count.
    pub fn short_write(&self, n: u64) {
        let mut state = self.inner.state.lock();
        state.short_write_at = Some(state.stats.writes + n.max(1));
    }

    /// Leaves `free_bytes` of room: later writes fail with `ENOSPC` once it
    /// is used up, until [`recover`](FaultyFs::recover).
    pub fn fill_disk(&self, free_bytes: u64) {
        self.inner.state.lock().free_bytes = Some(free_bytes);
    }

    /// Makes every fsync of a file take at least `delay` (a slow disk).
    pub fn set_sync_delay(&self, delay: Duration) {
        self.inner.state.lock().sync_delay = delay;
    }

    /// A power loss: every file written through this file system is cut
    /// back to what was fsynced plus at most `keep_unsynced_bytes` of what
    /// was not (a torn write), ranges a failed fsync gave up on read back
    /// as zeros, and every operation fails with `EIO` until
    /// [`recover`](FaultyFs::recover) — on files opened before the crash,
    /// for good. Drop the `Wal` after this, then recover.
    pub fn crash(&self, keep_unsynced_bytes: u64) -> io::Result<()> {
        self.lose_power(Survivors::Prefix(keep_unsynced_bytes))
    }

    /// A power loss like [`crash`](FaultyFs::crash), but the blocks of
    /// `block_bytes` (a page of 4096, a sector of 512, or smaller to make
    /// more holes) written over synced bytes since the last fsync survive
    /// or not each on its own (a coin seeded by `seed`), as a disk may
    /// write them in any order; bytes past the synced size are lost. The
    /// worst case for a log written over zeros: holes before surviving
    /// records.
    pub fn crash_scattered(&self, seed: u64, block_bytes: u64) -> io::Result<()> {
        self.lose_power(Survivors::Scattered {
            seed,
            block_bytes: block_bytes.max(1),
        })
    }

    fn lose_power(&self, survivors: Survivors) -> io::Result<()> {
        let mut state = self.inner.state.lock();
        state.crashed = true;
        state.crashes += 1;
        state.fail_write_at = None;
        state.fail_sync_at = None;
        state.short_write_at = None;
        let FaultState { paths, tracks, .. } = &mut *state;
        for (path, id) in paths.iter() {
            let track = tracks.entry(*id).or_default();
            let file = match OpenOptions::new().write(true).open(path) {
                Ok(file) => file,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            let len = file.metadata()?.len();
            let mut dirty = std::mem::take(&mut track.dirty);
            dirty.sort_unstable();
            let zero = |start: u64, end: u64| -> io::Result<()> {
                if start < end {
                    file.write_all_at(&vec![0u8; (end - start) as usize], start)?;
                }
                Ok(())
            };
            let keep = match survivors {
                Survivors::Prefix(mut budget) => {
                    for &(start, end) in &dirty {
                        let kept = budget.min(end - start);
                        budget -= kept;
                        zero(start + kept, end)?;
                    }
                    len.min(track.synced_len.saturating_add(budget))
                }
                Survivors::Scattered { seed, block_bytes } => {
                    for &(start, end) in &dirty {
                        let mut block = start / block_bytes;
                        while block * block_bytes < end {
                            let lost = mix(seed ^ mix(*id ^ mix(block))) & 1 == 0;
                            if lost {
                                let from = (block * block_bytes).max(start);
                                zero(from, ((block + 1) * block_bytes).min(end))?;
                            }
                            block += 1;
                        }
                    }
                    len.min(track.synced_len)
                }
            };
            file.set_len(keep)?;
            for &(start, end) in &track.lost {
                zero(start, end.min(keep))?;
            }
            file.sync_all()?;
            track.synced_len = keep;
            track.lost.clear();
        }
        Ok(())
    }

    /// Clears every pending fault, the full disk and a crash; the delay stays.
    pub fn recover(&self) {
        let mut state = self.inner.state.lock();
        state.fail_write_at = None;
        state.fail_sync_at = None;
        state.short_write_at = None;
        state.free_bytes = None;
        state.crashed = false;
    }

    /// The operations counted so far.
    pub fn stats(&self) -> FsStats {
        self.inner.state.lock().stats
    }

    fn check_alive(&self) -> io::Result<()> {
        if self.inner.state.lock().crashed {
            return Err(os_error(EIO));
        }
        Ok(())
    }

    /// The id of the file at `path`: a new one for a created file (nothing
    /// of it durable yet), the known one for a file we wrote before, or a
    /// new one for a file we never saw (durable as it is: it was there
    /// before us).
    fn track(&self, path: &Path, created: bool) -> u64 {
        let mut state = self.inner.state.lock();
        if !created && let Some(&id) = state.paths.get(path) {
            return id;
        }
        let synced_len = match created {
            true => 0,
            false => std::fs::metadata(path).map(|m| m.len()).unwrap_or(0),
        };
        state.next_id += 1;
        let id = state.next_id;
        state.paths.insert(path.to_path_buf(), id);
        state.tracks.insert(
            id,
            Track {
                synced_len,
                ..Track::default()
            },
        );
        id
    }
}

struct FaultyFile {
    inner: Box<dyn WalFile>,
    fs: FaultyFs,
    id: u64,
    /// [`FaultState::crashes`] when it was opened.
    opened_after: u64,
}

impl FaultState {
    /// Whether a file opened after `opened_after` power losses is dead.
    fn is_dead(&self, opened_after: u64) -> bool {
        self.crashed || self.crashes != opened_after
    }
}

impl WalFile for FaultyFile {
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<usize> {
        let mut state = self.fs.inner.state.lock();
        if state.is_dead(self.opened_after) {
            return Err(os_error(EIO));
        }
        state.stats.writes += 1;
        let n = state.stats.writes;
        if state.fail_write_at == Some(n) {
            state.fail_write_at = None;
            return Err(os_error(EIO));
        }
        let mut len = buf.len();
        if state.short_write_at == Some(n) {
            state.short_write_at = None;
            len = (len / 2).max(1).min(len);
        }
        if let Some(free) = state.free_bytes {
            if free == 0 && len > 0 {
                return Err(os_error(ENOSPC));
            }
            len = len.min(usize::try_from(free).unwrap_or(usize::MAX));
        }
        let written = self.inner.write_at(&buf[..len], offset)?;
        state.stats.bytes_written += written as u64;
        let track = state.tracks.entry(self.id).or_default();
        let over_synced = (offset + written as u64).min(track.synced_len);
        if offset < over_synced {
            track.dirty.push((offset, over_synced));
        }
        if let Some(free) = state.free_bytes.as_mut() {
            *free -= written as u64;
        }
        Ok(written)
    }

    fn sync_data(&mut self) -> io::Result<()> {
        let delay = {
            let mut state = self.fs.inner.state.lock();
            if state.is_dead(self.opened_after) {
                return Err(os_error(EIO));
            }
            state.stats.syncs += 1;
            if state.fail_sync_at == Some(state.stats.syncs) {
                state.fail_sync_at = None;
                let len = self.inner.size()?;
                let track = state.tracks.entry(self.id).or_default();
                if len > track.synced_len {
                    let lost = (track.synced_len, len);
                    track.lost.push(lost);
                }
                let dirty = std::mem::take(&mut track.dirty);
                track.lost.extend(dirty);
                return Err(os_error(EIO));
            }
            state.sync_delay
        };
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        self.inner.sync_data()?;
        let len = self.inner.size()?;
        let mut state = self.fs.inner.state.lock();
        // A crash while the fsync ran: it never completed.
        if state.is_dead(self.opened_after) {
            return Err(os_error(EIO));
        }
        let track = state.tracks.entry(self.id).or_default();
        track.synced_len = len;
        track.dirty.clear();
        Ok(())
    }

    fn set_len(&mut self, len: u64) -> io::Result<()> {
        if self.fs.inner.state.lock().is_dead(self.opened_after) {
            return Err(os_error(EIO));
        }
        self.inner.set_len(len)?;
        let mut state = self.fs.inner.state.lock();
        let track = state.tracks.entry(self.id).or_default();
        track.synced_len = track.synced_len.min(len);
        trim_ranges(&mut track.lost, len);
        trim_ranges(&mut track.dirty, len);
        Ok(())
    }

    fn size(&self) -> io::Result<u64> {
        self.inner.size()
    }
}

impl FileSystem for FaultyFs {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.check_alive()?;
        self.inner.real.create_dir_all(dir)
    }

    fn try_lock(&self, path: &Path, holder: &str) -> io::Result<LockAttempt> {
        self.check_alive()?;
        self.inner.real.try_lock(path, holder)
    }

    fn list_dir(&self, dir: &Path) -> io::Result<Vec<String>> {
        self.check_alive()?;
        self.inner.real.list_dir(dir)
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        self.check_alive()?;
        self.inner.real.read(path)
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn WalFile>> {
        self.check_alive()?;
        let inner = self.inner.real.create(path)?;
        let id = self.track(path, true);
        Ok(Box::new(FaultyFile {
            inner,
            fs: self.clone(),
            id,
            opened_after: self.inner.state.lock().crashes,
        }))
    }

    fn open_write(&self, path: &Path) -> io::Result<Box<dyn WalFile>> {
        self.check_alive()?;
        let inner = self.inner.real.open_write(path)?;
        let id = self.track(path, false);
        Ok(Box::new(FaultyFile {
            inner,
            fs: self.clone(),
            id,
            opened_after: self.inner.state.lock().crashes,
        }))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.check_alive()?;
        self.inner.real.rename(from, to)?;
        let mut state = self.inner.state.lock();
        if let Some(id) = state.paths.remove(from) {
            state.paths.insert(to.to_path_buf(), id);
        }
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.check_alive()?;
        self.inner.real.remove_file(path)?;
        self.inner.state.lock().paths.remove(path);
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        {
            let mut state = self.inner.state.lock();
            if state.crashed {
                return Err(os_error(EIO));
            }
            state.stats.dir_syncs += 1;
        }
        self.inner.real.sync_dir(dir)
    }
}

impl std::fmt::Debug for FaultyFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyFs")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}
