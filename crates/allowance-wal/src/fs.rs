//! The few file operations the log needs, behind a trait so tests can put
//! a failing disk ([`FaultyFs`](crate::FaultyFs)) under a real log.

use std::any::Any;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// An open file the log writes: a segment or a snapshot being written.
pub trait WalFile: Send {
    /// Writes at byte `offset` like `pwrite(2)`: may write fewer bytes
    /// than given and reports how many it wrote. (Positional, so the log
    /// can write its records over the zeros it synced ahead of them.)
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<usize>;
    /// `fdatasync(2)`: makes the written bytes (and the size) durable.
    fn sync_data(&mut self) -> io::Result<()>;
    /// Truncates (or extends) the file to `len` bytes.
    fn set_len(&mut self, len: u64) -> io::Result<()>;
    /// The file's size in bytes.
    fn size(&self) -> io::Result<u64>;
}

/// What [`FileSystem::try_lock`] found.
pub enum LockAttempt {
    /// The lock is ours until the guard is dropped.
    Acquired(Box<dyn Any + Send + Sync>),
    /// Someone else holds it; `holder` is what they recorded in the lock
    /// file (empty if they had not written it yet).
    Held {
        /// The holder's own description, e.g. `pid 4242`.
        holder: String,
    },
}

/// The file system under a [`Wal`](crate::Wal). Paths are absolute or
/// relative to the process's working directory, as given in
/// [`WalOptions::dir`](crate::WalOptions::dir).
pub trait FileSystem: Send + Sync {
    /// Creates `dir` and its parents if missing.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Takes an exclusive lock on the file at `path` (created if missing)
    /// without waiting, and records `holder` in it once taken. The lock
    /// must also exclude a second lock of the same path in this process.
    fn try_lock(&self, path: &Path, holder: &str) -> io::Result<LockAttempt>;
    /// The names of the entries of `dir` (names that are not UTF-8 are
    /// skipped: the log never creates one).
    fn list_dir(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// The whole content of the file at `path`.
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    /// Creates the file at `path` for writing, truncating any old one.
    fn create(&self, path: &Path) -> io::Result<Box<dyn WalFile>>;
    /// Opens the existing file at `path` for writing, keeping its content.
    /// (Not `O_APPEND`: Linux would put every positional write at the end.)
    fn open_write(&self, path: &Path) -> io::Result<Box<dyn WalFile>>;
    /// Renames `from` to `to`, replacing `to` atomically.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes the file at `path`.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Makes `dir`'s entries (creations, renames, removals) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
}

/// The real file system: `std::fs`, `fdatasync` and `flock`.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealFs;

struct RealFile(File);

impl WalFile for RealFile {
    fn write_at(&mut self, buf: &[u8], offset: u64) -> io::Result<usize> {
        FileExt::write_at(&self.0, buf, offset)
    }
    fn sync_data(&mut self) -> io::Result<()> {
        self.0.sync_data()
    }
    fn set_len(&mut self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }
}

impl FileSystem for RealFs {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        fs::create_dir_all(dir)
    }

    fn try_lock(&self, path: &Path, holder: &str) -> io::Result<LockAttempt> {
        // Not truncated on open: until the lock is ours the file holds the
        // current holder's description, which the refusal reports.
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        // `flock(2)` locks belong to the open file description, so a second
        // open of the same path in this process is refused too.
        match file.try_lock() {
            Ok(()) => {
                file.set_len(0)?;
                file.write_all(holder.as_bytes())?;
                Ok(LockAttempt::Acquired(Box::new(file)))
            }
            Err(TryLockError::WouldBlock) => {
                let mut bytes = Vec::new();
                // Bounded: a lock file holds a short description.
                (&mut file).take(256).read_to_end(&mut bytes)?;
                Ok(LockAttempt::Held {
                    holder: String::from_utf8_lossy(&bytes).trim().to_owned(),
                })
            }
            Err(TryLockError::Error(e)) => Err(e),
        }
    }

    fn list_dir(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in fs::read_dir(dir)? {
            if let Ok(name) = entry?.file_name().into_string() {
                names.push(name);
            }
        }
        Ok(names)
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        fs::read(path)
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn WalFile>> {
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        Ok(Box::new(RealFile(file)))
    }

    fn open_write(&self, path: &Path) -> io::Result<Box<dyn WalFile>> {
        let file = OpenOptions::new().write(true).open(path)?;
        Ok(Box::new(RealFile(file)))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
}
