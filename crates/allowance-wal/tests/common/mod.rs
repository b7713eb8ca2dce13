//! Helpers shared by the integration tests: data dirs on the real disk,
//! a runtime to await durability, and reading a whole log back.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use allowance_wal::{Lsn, Wal, WalError};

static NEXT_DIR: AtomicU64 = AtomicU64::new(0);

/// A fresh data dir under Cargo's target tmp dir (the real disk, not a
/// tmpfs: fsync has to mean something), removed when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join("allowance-wal")
            .join(format!(
                "{name}-{}-{}",
                std::process::id(),
                NEXT_DIR.fetch_add(1, Ordering::Relaxed)
            ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create test dir");
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A small multi-thread runtime with timers.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .expect("runtime")
}

/// Awaits `wal.durable(lsn)`, failing the test instead of hanging.
pub fn durable(rt: &tokio::runtime::Runtime, wal: &Wal, lsn: Lsn) -> Result<(), WalError> {
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(20), wal.durable(lsn))
            .await
            .expect("durable() hung for 20 s")
    })
}

/// A deterministic payload whose length varies with `i` (0 ..= 96 bytes).
pub fn payload(i: u64) -> Vec<u8> {
    let len = (i * 37 % 97) as usize;
    (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect()
}

/// Every record after `after`, as (lsn, payload).
pub fn read_after(wal: &Wal, after: Lsn) -> Vec<(Lsn, Vec<u8>)> {
    let mut out = Vec::new();
    wal.replay(after, |lsn, payload| {
        out.push((lsn, payload.to_vec()));
        Ok(())
    })
    .expect("replay");
    out
}

/// The segment files of `dir`, sorted.
pub fn segment_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "wal"))
        .collect();
    files.sort();
    files
}
