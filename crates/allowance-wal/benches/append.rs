//! Throughput of the write-ahead log on the real disk (issue 4's targets).
//!
//! - `append_durable_always/{1,8,64}` — durable appends per second with
//!   `Fsync::Always`: that many tokio tasks each append a 100-byte record
//!   and await `durable` in a loop. With one task every record pays a whole
//!   fsync; with 64, group commit shares each fsync among the batch.
//! - `recover/{open,replay,open+replay}` — records per second of recovery
//!   over 200,000 records of 100 bytes (~23 MB in 64 MiB segments, in the
//!   page cache): the scan and checks of `Wal::open`, the re-read of
//!   `replay` with a callback that only looks at the bytes, and both, as a
//!   restart does them. Target: ≥ 1M records/s.
//!
//! Data dirs live under Cargo's target tmp dir (the real disk).
//! Run: `cargo bench -p allowance-wal --bench append`.

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use allowance_wal::{Fsync, RealFs, Wal, WalOptions};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

const RECORD_BYTES: usize = 100;
const REPLAY_RECORDS: u64 = 200_000;

fn bench_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("allowance-wal-bench")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("bench dir");
    dir
}

fn append_durable(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("append_durable_always");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(4));
    for concurrency in [1u64, 8, 64] {
        let dir = bench_dir(&format!("append-{concurrency}"));
        let opts = WalOptions {
            fsync: Fsync::Always,
            ..WalOptions::new(&dir)
        };
        let (wal, _) = Wal::open(opts, Arc::new(RealFs)).expect("open");
        let wal = Arc::new(wal);
        group.bench_with_input(
            BenchmarkId::from_parameter(concurrency),
            &concurrency,
            |b, &concurrency| {
                b.iter_custom(|iters| {
                    let per_task = iters.div_ceil(concurrency);
                    let start = Instant::now();
                    runtime.block_on(async {
                        let tasks: Vec<_> = (0..concurrency)
                            .map(|_| {
                                let wal = Arc::clone(&wal);
                                tokio::spawn(async move {
                                    let record = [7u8; RECORD_BYTES];
                                    for _ in 0..per_task {
                                        let lsn = wal.append(&record).expect("append");
                                        wal.durable(lsn).await.expect("durable");
                                    }
                                })
                            })
                            .collect();
                        for task in tasks {
                            task.await.expect("task");
                        }
                    });
                    // Scale to the `iters` criterion asked for.
                    start
                        .elapsed()
                        .mul_f64(iters as f64 / (per_task * concurrency) as f64)
                });
            },
        );
        drop(wal);
        let _ = std::fs::remove_dir_all(&dir);
    }
    group.finish();
}

fn recover(c: &mut Criterion) {
    let dir = bench_dir("recover");
    let opts = WalOptions::new(&dir);
    {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let (wal, _) = Wal::open(opts.clone(), Arc::new(RealFs)).expect("open");
        let mut record = [0u8; RECORD_BYTES];
        let mut last = 0;
        for i in 0..REPLAY_RECORDS {
            record[..8].copy_from_slice(&i.to_le_bytes());
            last = wal.append(&record).expect("append");
        }
        runtime.block_on(wal.durable(last)).expect("durable");
    }
    let mut group = c.benchmark_group("recover");
    group.throughput(Throughput::Elements(REPLAY_RECORDS));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(4));
    group.bench_function("open", |b| {
        b.iter(|| {
            let (wal, recovered) = Wal::open(opts.clone(), Arc::new(RealFs)).expect("open");
            assert_eq!(recovered.records, REPLAY_RECORDS);
            drop(wal);
        });
    });
    let (wal, _) = Wal::open(opts.clone(), Arc::new(RealFs)).expect("open");
    group.bench_function("replay", |b| {
        b.iter(|| {
            let mut sum = 0u64;
            let replayed = wal
                .replay(0, |_, payload| {
                    sum = sum.wrapping_add(u64::from(payload[0]));
                    Ok(())
                })
                .expect("replay");
            assert_eq!(replayed, REPLAY_RECORDS);
            black_box(sum)
        });
    });
    drop(wal);
    group.bench_function("open+replay", |b| {
        b.iter(|| {
            let (wal, _) = Wal::open(opts.clone(), Arc::new(RealFs)).expect("open");
            let replayed = wal
                .replay(0, |_, payload| {
                    black_box(payload);
                    Ok(())
                })
                .expect("replay");
            assert_eq!(replayed, REPLAY_RECORDS);
        });
    });
    group.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, append_durable, recover);
criterion_main!(benches);
