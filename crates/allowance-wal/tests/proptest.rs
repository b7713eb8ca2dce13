//! Random histories of appends, waits, injected faults (failed writes and
//! fsyncs, short writes, a full disk), power losses, reopens and snapshots,
//! checked against a model: the list of records the log was given, and how
//! many of them were acknowledged.
//!
//! After every reopen, snapshot + log must hold a prefix of the model that
//! contains every acknowledged record, byte for byte. Under `Fsync::Always`
//! that holds across power losses too; `Batch` and `Never` only promise it
//! across process crashes, so their histories reopen without losing power.
//!
//! 64 cases by default; `ALLOWANCE_PROPTEST_CASES=1000` for a soak run.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use allowance_wal::{FaultyFs, Fsync, Wal, WalError, WalOptions};
use common::TempDir;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};

#[derive(Debug, Clone)]
enum Op {
    /// Append these payloads (nothing waits for them).
    Append(Vec<Vec<u8>>),
    /// Wait for the last appended record to be durable.
    Durable,
    FailWrite(u64),
    FailSync(u64),
    ShortWrite(u64),
    DiskFull(u64),
    /// Power loss keeping this many unsynced bytes per file, after
    /// letting the writer run for this many microseconds.
    Crash(u64, u64),
    /// Power loss keeping a random half (by this seed) of the unsynced
    /// blocks of this many bytes written over zeros synced ahead, in no
    /// order, after letting the writer run for this many microseconds.
    CrashScattered(u64, u64, u64),
    Reopen,
    /// Snapshot at the last appended lsn.
    Snapshot,
}

fn payload() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        2 => Just(Vec::new()),
        6 => prop::collection::vec(any::<u8>(), 1..40),
        2 => prop::collection::vec(any::<u8>(), 100..300),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => prop::collection::vec(payload(), 1..6).prop_map(Op::Append),
        6 => Just(Op::Durable),
        1 => (1u64..4).prop_map(Op::FailWrite),
        1 => (1u64..4).prop_map(Op::FailSync),
        1 => (1u64..3).prop_map(Op::ShortWrite),
        1 => prop_oneof![Just(0u64), 0u64..600].prop_map(Op::DiskFull),
        1 => (
            prop_oneof![Just(0u64), 1u64..200, Just(u64::MAX)],
            prop_oneof![Just(0u64), 100u64..1500],
        )
            .prop_map(|(keep, wait_us)| Op::Crash(keep, wait_us)),
        2 => (
            any::<u64>(),
            prop_oneof![Just(16u64), Just(64), Just(512), Just(4096)],
            prop_oneof![Just(0u64), 100u64..1500],
        )
            .prop_map(|(seed, block, wait_us)| Op::CrashScattered(seed, block, wait_us)),
        2 => Just(Op::Reopen),
        1 => Just(Op::Snapshot),
    ]
}

fn fsync() -> impl Strategy<Value = Fsync> {
    prop_oneof![
        3 => Just(Fsync::Always),
        1 => Just(Fsync::Batch { window: Duration::from_millis(1) }),
        1 => Just(Fsync::Never),
    ]
}

/// How often the interesting paths ran, printed at the end: a property
/// test whose faults never fire proves little.
static FAILED_WAITS: AtomicU64 = AtomicU64::new(0);
static POWER_LOSSES: AtomicU64 = AtomicU64::new(0);
static TORN_TAILS: AtomicU64 = AtomicU64::new(0);
static UNACKED_DROPPED: AtomicU64 = AtomicU64::new(0);
static SNAPSHOTS: AtomicU64 = AtomicU64::new(0);

/// What the log must hold.
#[derive(Default)]
struct Model {
    /// Payloads by lsn - 1: what the log was given and may still hold.
    records: Vec<Vec<u8>>,
    /// Records 1..=acked were acknowledged: they must survive.
    acked: u64,
}

/// The snapshot's payload: every record up to its lsn, length-prefixed.
fn encode_state(records: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in records {
        out.extend_from_slice(&(r.len() as u32).to_le_bytes());
        out.extend_from_slice(r);
    }
    out
}

fn decode_state(mut bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let len: [u8; 4] = bytes
            .get(..4)
            .and_then(|b| b.try_into().ok())
            .ok_or("short length")?;
        let len = u32::from_le_bytes(len) as usize;
        let record = bytes.get(4..4 + len).ok_or("short record")?;
        out.push(record.to_vec());
        bytes = &bytes[4 + len..];
    }
    Ok(out)
}

struct World {
    dir: TempDir,
    fs: FaultyFs,
    fsync: Fsync,
    /// Open with `defer_sealed_checks`: the replay every reopen makes must
    /// then find what open would have.
    defer_sealed_checks: bool,
    /// 300 bytes (a roll every few records) or 64 KiB (records written
    /// over many blocks of zeros synced ahead).
    segment_bytes: u64,
    wal: Option<Wal>,
    model: Model,
    rt: tokio::runtime::Runtime,
}

impl World {
    fn options(&self) -> WalOptions {
        WalOptions {
            fsync: self.fsync,
            segment_bytes: self.segment_bytes,
            defer_sealed_checks: self.defer_sealed_checks,
            ..WalOptions::new(self.dir.path())
        }
    }

    fn wal(&self) -> &Wal {
        self.wal.as_ref().expect("open")
    }

    fn apply(&mut self, op: &Op) -> Result<(), String> {
        match op {
            Op::Append(payloads) => {
                for p in payloads {
                    match self.wal().append(p) {
                        Ok(lsn) => {
                            let want = self.model.records.len() as u64 + 1;
                            if lsn != want {
                                return Err(format!("append got lsn {lsn}, expected {want}"));
                            }
                            self.model.records.push(p.clone());
                        }
                        Err(WalError::Failed { .. }) if self.wal().is_failed() => {}
                        Err(e) => return Err(format!("append: {e}")),
                    }
                }
            }
            Op::Durable => {
                let lsn = self.wal().last_lsn();
                let wal = self.wal();
                let outcome = self.rt.block_on(async {
                    tokio::time::timeout(Duration::from_secs(20), wal.durable(lsn)).await
                });
                match outcome {
                    Err(_) => return Err(format!("durable({lsn}) hung")),
                    Ok(Ok(())) => self.model.acked = self.model.acked.max(lsn),
                    Ok(Err(WalError::Failed { .. })) if self.wal().is_failed() => {
                        FAILED_WAITS.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(Err(e)) => return Err(format!("durable({lsn}): {e}")),
                }
            }
            Op::FailWrite(n) => self.fs.fail_write(*n),
            Op::FailSync(n) => self.fs.fail_sync(*n),
            Op::ShortWrite(n) => self.fs.short_write(*n),
            Op::DiskFull(free) => self.fs.fill_disk(*free),
            Op::Crash(keep, wait_us) if self.fsync == Fsync::Always => {
                std::thread::sleep(Duration::from_micros(*wait_us));
                self.fs.crash(*keep).map_err(|e| format!("crash: {e}"))?;
                POWER_LOSSES.fetch_add(1, Ordering::Relaxed);
                self.wal = None;
                self.fs.recover();
                self.reopen()?;
            }
            Op::CrashScattered(seed, block, wait_us) if self.fsync == Fsync::Always => {
                std::thread::sleep(Duration::from_micros(*wait_us));
                self.fs
                    .crash_scattered(*seed, *block)
                    .map_err(|e| format!("crash: {e}"))?;
                POWER_LOSSES.fetch_add(1, Ordering::Relaxed);
                self.wal = None;
                self.fs.recover();
                self.reopen()?;
            }
            Op::Crash(..) | Op::CrashScattered(..) | Op::Reopen => {
                self.wal = None;
                self.reopen()?;
            }
            Op::Snapshot => {
                let lsn = self.wal().last_lsn();
                let upto = usize::try_from(lsn).map_err(|e| e.to_string())?;
                let state = encode_state(&self.model.records[..upto]);
                // A snapshot is durable: its records must survive.
                // Injected faults may make it fail; the log stays sound.
                if self.wal().write_snapshot(lsn, &state).is_ok() {
                    SNAPSHOTS.fetch_add(1, Ordering::Relaxed);
                    self.model.acked = self.model.acked.max(lsn);
                }
            }
        }
        Ok(())
    }

    /// Opens the log (first with the faults still armed; if that fails
    /// with an I/O error, again on a healed disk) and checks it against
    /// the model.
    fn reopen(&mut self) -> Result<(), String> {
        let recovered = match Wal::open(self.options(), Arc::new(self.fs.clone())) {
            Ok(opened) => opened,
            Err(WalError::Io { .. }) => {
                self.fs.recover();
                Wal::open(self.options(), Arc::new(self.fs.clone()))
                    .map_err(|e| format!("reopen on a healed disk: {e}"))?
            }
            Err(e) => return Err(format!("reopen: {e}")),
        };
        let (wal, recovered) = recovered;
        let (after, mut records) = match wal.latest_snapshot().map_err(|e| e.to_string())? {
            Some((lsn, bytes)) => {
                let records = decode_state(&bytes)?;
                if records.len() as u64 != lsn {
                    return Err(format!("snapshot at {lsn} holds {} records", records.len()));
                }
                (lsn, records)
            }
            None => (0, Vec::new()),
        };
        wal.replay(after, |lsn, payload| {
            if lsn != records.len() as u64 + 1 {
                return Err(format!("replayed lsn {lsn} after {}", records.len()));
            }
            records.push(payload.to_vec());
            Ok(())
        })
        .map_err(|e| format!("replay: {e}"))?;
        let found = records.len() as u64;
        if found != recovered.last_lsn {
            return Err(format!(
                "replayed {found} records, open said {}",
                recovered.last_lsn
            ));
        }
        if found < self.model.acked {
            return Err(format!(
                "acknowledged records lost: {} acknowledged, {found} recovered",
                self.model.acked
            ));
        }
        for (i, record) in records.iter().enumerate() {
            match self.model.records.get(i) {
                Some(given) if given == record => {}
                Some(given) => {
                    return Err(format!(
                        "lsn {} altered: given {given:?}, recovered {record:?}",
                        i + 1
                    ));
                }
                None => return Err(format!("lsn {} was never appended", i + 1)),
            }
        }
        if recovered.torn_tail.is_some() {
            TORN_TAILS.fetch_add(1, Ordering::Relaxed);
        }
        UNACKED_DROPPED.fetch_add(self.model.records.len() as u64 - found, Ordering::Relaxed);
        // What was recovered is on disk and synced: the new baseline.
        self.model.records.truncate(records.len());
        self.model.acked = found;
        self.wal = Some(wal);
        Ok(())
    }
}

fn run(
    fsync: Fsync,
    defer: bool,
    segment_bytes: u64,
    sync_delay_us: u64,
    ops: &[Op],
) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| e.to_string())?;
    let mut world = World {
        dir: TempDir::new("proptest"),
        fs: FaultyFs::new(),
        fsync,
        defer_sealed_checks: defer,
        segment_bytes,
        wal: None,
        model: Model::default(),
        rt,
    };
    // A slow fsync lets power losses land between a write and its fsync.
    world
        .fs
        .set_sync_delay(Duration::from_micros(sync_delay_us));
    world.reopen()?;
    for (i, op) in ops.iter().enumerate() {
        world
            .apply(op)
            .map_err(|e| format!("step {i}, {op:?}: {e}"))?;
    }
    // A final power loss (or reopen) must keep every acknowledged record.
    let last = if fsync == Fsync::Always {
        Op::Crash(0, 0)
    } else {
        Op::Reopen
    };
    world
        .apply(&last)
        .map_err(|e| format!("final {last:?}: {e}"))
}

fn config() -> Config {
    let cases = std::env::var("ALLOWANCE_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    Config {
        cases,
        source_file: Some(file!()),
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..Config::default()
    }
}

#[test]
fn acknowledged_records_survive_random_faults_crashes_and_reopens() {
    let mut runner = TestRunner::new(config());
    let sync_delay_us = prop_oneof![Just(0u64), 200u64..2000];
    let histories = (
        fsync(),
        any::<bool>(),
        prop_oneof![Just(300u64), Just(64 << 10)],
        sync_delay_us,
        prop::collection::vec(op(), 10..80),
    );
    let result = runner.run(
        &histories,
        |(fsync, defer, segment_bytes, sync_delay_us, ops)| {
            run(fsync, defer, segment_bytes, sync_delay_us, &ops).map_err(TestCaseError::fail)
        },
    );
    eprintln!(
        "failed waits {}, power losses {}, torn tails cut {}, unacknowledged records dropped {}, snapshots {}",
        FAILED_WAITS.load(Ordering::Relaxed),
        POWER_LOSSES.load(Ordering::Relaxed),
        TORN_TAILS.load(Ordering::Relaxed),
        UNACKED_DROPPED.load(Ordering::Relaxed),
        SNAPSHOTS.load(Ordering::Relaxed),
    );
    if let Err(e) = result {
        panic!("{e}");
    }
}
