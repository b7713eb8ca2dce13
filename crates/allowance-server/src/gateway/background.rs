//! Work no call waits for — the exact count of a long stream already
//! running on a bound — on a few threads of their own at a low CPU
//! priority (nice ~10), so that on a busy machine it yields to what a
//! client does wait for: other calls' reserves, first bytes and events.
//!
//! (Not tokio's blocking pool: a thread's priority can be lowered but not
//! raised again without privileges, and that pool runs waited-for work.)

use std::sync::mpsc;
use std::sync::{LazyLock, Mutex};

use thread_priority::{ThreadPriority, ThreadPriorityValue};
use tokio::sync::oneshot;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// Threads of the pool: counting is CPU-bound; more than the cores would
/// only queue in the kernel instead of here.
fn threads() -> usize {
    std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(1)
        .min(4)
}

/// `ThreadPriorityValue` 25 maps to nice ~9 on Linux (0 is nice 19, 99 is
/// nice −20): a fifth of a normal thread's share when they compete.
const BACKGROUND_PRIORITY: u8 = 25;

static POOL: LazyLock<Mutex<mpsc::Sender<Job>>> = LazyLock::new(|| {
    let (tx, rx) = mpsc::channel::<Job>();
    let rx = std::sync::Arc::new(Mutex::new(rx));
    for i in 0..threads() {
        let rx = rx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("allowance-background-{i}"))
            .spawn(move || {
                if let Ok(p) = ThreadPriorityValue::try_from(BACKGROUND_PRIORITY)
                    && let Err(e) = thread_priority::set_current_thread_priority(
                        ThreadPriority::Crossplatform(p),
                    )
                {
                    // Still correct, only not deferential: say so once.
                    tracing::debug!(error = ?e, "background thread keeps the normal priority");
                }
                loop {
                    // The lock is held only to take a job, never to run it.
                    let job = match rx.lock() {
                        Ok(rx) => rx.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start a background thread");
        }
    }
    Mutex::new(tx)
});

/// Runs `f` on a background thread; its result comes on the receiver (an
/// error if the job could not run: the pool has no thread, or `f`
/// panicked — the thread survives that).
pub(crate) fn spawn<T, F>(f: F) -> oneshot::Receiver<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let (tx, rx) = oneshot::channel();
    let job: Job = Box::new(move || {
        // A panic drops the sender (the receiver errs), not the thread.
        if let Ok(v) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            let _ = tx.send(v);
        }
    });
    if let Ok(pool) = POOL.lock() {
        // A send fails only when every thread is gone: the job is dropped
        // with its sender, and the receiver says so.
        let _ = pool.send(job);
    }
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_jobs_and_survives_a_panicking_one() {
        let answers: Vec<_> = (0..16u64).map(|i| spawn(move || i * i)).collect();
        for (i, rx) in answers.into_iter().enumerate() {
            assert_eq!(rx.await.unwrap(), (i * i) as u64);
        }
        // A panic ends that job (its receiver errs), not its thread: more
        // panics than threads, and the pool still answers.
        for _ in 0..2 * threads() {
            let failed = spawn(|| -> u64 { panic!("a job that fails") });
            assert!(failed.await.is_err());
        }
        assert_eq!(spawn(|| 7).await.unwrap(), 7);
    }

    #[test]
    fn its_threads_run_at_a_lower_priority() {
        let rx = spawn(|| {
            (
                std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default(),
                std::thread::current().name().map(str::to_owned),
            )
        });
        let (stat, name) = rx.blocking_recv().unwrap();
        // Field 19 of /proc/<tid>/stat is the nice value; the fields after
        // the `(comm)` one start at field 3.
        let after = stat.rsplit_once(')').map(|(_, s)| s).unwrap_or("");
        let nice: i64 = after
            .split_whitespace()
            .nth(16)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        assert!(
            name.unwrap_or_default()
                .starts_with("allowance-background-")
        );
        if cfg!(target_os = "linux") {
            assert!(nice > 0, "nice {nice}");
        }
    }
}
