//! Group commit really batches: concurrent appenders share fsyncs, and
//! each batch is written with one write.

mod common;

use std::sync::Arc;
use std::time::Duration;

use allowance_wal::{FaultyFs, Wal, WalOptions};
use common::{TempDir, read_after, runtime};

/// Ten rounds of 64 tasks that each append one record and wait for it to
/// be durable (`Fsync::Always`) on a disk whose fsync takes 2 ms: every
/// waiter is answered, every record is in the log, and the rounds take far
/// fewer fsyncs than records.
#[test]
fn sixty_four_concurrent_appenders_share_a_handful_of_fsyncs() {
    const ROUNDS: u64 = 10;
    const APPENDERS: u64 = 64;
    let dir = TempDir::new("group-commit");
    let fs = FaultyFs::new();
    fs.set_sync_delay(Duration::from_millis(2));
    let (wal, _) = Wal::open(WalOptions::new(dir.path()), Arc::new(fs.clone())).expect("open");
    let wal = Arc::new(wal);
    let before = fs.stats();
    let rt = runtime();
    for round in 0..ROUNDS {
        let barrier = Arc::new(tokio::sync::Barrier::new(APPENDERS as usize));
        let lsns = rt.block_on(async {
            let tasks: Vec<_> = (0..APPENDERS)
                .map(|i| {
                    let (wal, barrier) = (Arc::clone(&wal), Arc::clone(&barrier));
                    tokio::spawn(async move {
                        barrier.wait().await;
                        let lsn = wal.append(&(round * APPENDERS + i).to_le_bytes())?;
                        wal.durable(lsn).await.map(|()| lsn)
                    })
                })
                .collect();
            let mut lsns = Vec::new();
            for task in tasks {
                lsns.push(task.await.expect("task").expect("durable"));
            }
            lsns
        });
        let mut sorted = lsns;
        sorted.sort_unstable();
        let first = round * APPENDERS + 1;
        assert_eq!(sorted, (first..first + APPENDERS).collect::<Vec<_>>());
    }
    let after = fs.stats();
    let syncs = after.syncs - before.syncs;
    let writes = after.writes - before.writes;
    let records = ROUNDS * APPENDERS;
    assert!(
        syncs <= records / 8,
        "{records} durable appends took {syncs} fsyncs: group commit is not batching"
    );
    // One write and one fsync per batch (no segment roll happens here).
    assert_eq!(writes, syncs, "each batch is written with one write");

    let replayed = read_after(&wal, 0);
    assert_eq!(replayed.len() as u64, records);
    for (lsn, bytes) in &replayed {
        let value = u64::from_le_bytes(bytes.as_slice().try_into().expect("8 bytes"));
        assert!(value < records, "lsn {lsn} holds {value}");
    }
    let mut values: Vec<u64> = replayed
        .iter()
        .map(|(_, b)| u64::from_le_bytes(b.as_slice().try_into().expect("8 bytes")))
        .collect();
    values.sort_unstable();
    assert_eq!(
        values,
        (0..records).collect::<Vec<_>>(),
        "every record once"
    );
}

/// Records appended unannounced wait for the first waiter to wake the
/// writer, which then finds them all: one write and one fsync for a
/// task's joined appends, however fast the writer wakes.
#[test]
fn unannounced_appends_share_the_batch_their_waiter_asks_for() {
    let dir = TempDir::new("unannounced");
    let fs = FaultyFs::new();
    let (wal, _) = Wal::open(WalOptions::new(dir.path()), Arc::new(fs.clone())).expect("open");
    let rt = runtime();
    let warm_up = wal.append(b"warm-up").expect("append");
    common::durable(&rt, &wal, warm_up).expect("durable");
    for round in 0..20u64 {
        // The writer asleep, as between a quiet server's calls (an awake
        // writer takes whatever it finds, announced or not).
        std::thread::sleep(Duration::from_millis(5));
        let before = fs.stats();
        let first = wal
            .append_unannounced(&round.to_le_bytes())
            .expect("append");
        // However long the task takes between its appends.
        std::thread::sleep(Duration::from_millis(2));
        let second = wal
            .append_unannounced(&(round + 100).to_le_bytes())
            .expect("append");
        rt.block_on(async {
            let (a, b) = tokio::join!(wal.durable(first), wal.durable(second));
            a.and(b)
        })
        .expect("durable");
        let after = fs.stats();
        assert_eq!(after.writes - before.writes, 1, "round {round}: one write");
        assert_eq!(after.syncs - before.syncs, 1, "round {round}: one fsync");
    }
    assert_eq!(read_after(&wal, 0).len(), 41);
}
