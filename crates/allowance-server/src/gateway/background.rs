//! Work no call waits for — the exact count of a long stream already
//! running on a bound — on a thread of its own at a low CPU priority
//! (nice ~9), so that on a busy machine it yields to what a client does
//! wait for: other calls' reserves, first bytes and events.
//!
//! (Not tokio's blocking pool: a thread's priority can be lowered but not
//! raised again without privileges, and that pool runs waited-for work.)

use std::sync::LazyLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use allowance_estimate::Tokenizer;
use thread_priority::{ThreadPriority, ThreadPriorityValue};
use tokio::sync::oneshot;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// `ThreadPriorityValue` 25 maps to nice ~9 on Linux (0 is nice 19, 99 is
/// nice −20): a fifth of a normal thread's share when they compete.
const BACKGROUND_PRIORITY: u8 = 25;

/// The one background thread's queue. One thread, not a pool: the
/// tokenizers' regexes share one cache pool per regex, whose fast path
/// belongs to the first thread to use it; every other thread takes a lock
/// per match, a third of a 32K-token count (measured). One owning thread
/// counts faster than two that share.
static QUEUE: LazyLock<mpsc::Sender<Job>> = LazyLock::new(|| {
    let (tx, rx) = mpsc::channel::<Job>();
    let (ready_tx, ready_rx) = mpsc::channel::<()>();
    let spawned = std::thread::Builder::new()
        .name("allowance-background".to_owned())
        .spawn(move || {
            if let Ok(p) = ThreadPriorityValue::try_from(BACKGROUND_PRIORITY)
                && let Err(e) =
                    thread_priority::set_current_thread_priority(ThreadPriority::Crossplatform(p))
            {
                // Still correct, only not deferential: say so once.
                tracing::debug!(error = ?e, "background thread keeps the normal priority");
            }
            // Counting is this thread's work: it uses the tokenizers first,
            // and so owns their fast path.
            for t in [Tokenizer::O200kBase, Tokenizer::Cl100kBase] {
                t.count("warm up: the first use claims the fast path");
            }
            let _ = ready_tx.send(());
            while let Ok(job) = rx.recv() {
                job();
            }
        });
    match spawned {
        Ok(_) => {
            let _ = ready_rx.recv();
        }
        Err(e) => tracing::warn!(error = %e, "cannot start the background thread"),
    }
    tx
});

/// Starts the background thread now (a server calls it at start-up,
/// before any count): it then owns the tokenizers' fast paths.
pub(crate) fn start() {
    LazyLock::force(&QUEUE);
}

/// Jobs queued or running past which [`try_spawn`] refuses: the queue must
/// not grow without bound (each job holds a request body) when long
/// prompts come faster than one thread counts them (~3 ms per 32K tokens).
pub(crate) const MAX_PENDING_JOBS: usize = 32;

static PENDING: AtomicUsize = AtomicUsize::new(0);

/// Runs `f(input)` on the background thread; its result comes on the
/// receiver (an error if the job could not run: there is no thread, or `f`
/// panicked — the thread survives that). When [`MAX_PENDING_JOBS`] are
/// queued already, `Err(input)`: the caller does the work itself.
pub(crate) fn try_spawn<V, T, F>(input: V, f: F) -> Result<oneshot::Receiver<T>, V>
where
    V: Send + 'static,
    T: Send + 'static,
    F: FnOnce(V) -> T + Send + 'static,
{
    if PENDING.fetch_add(1, Ordering::AcqRel) >= MAX_PENDING_JOBS {
        PENDING.fetch_sub(1, Ordering::AcqRel);
        return Err(input);
    }
    let (tx, rx) = oneshot::channel();
    let job: Job = Box::new(move || {
        // A panic drops the sender (the receiver errs), not the thread.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(input)));
        PENDING.fetch_sub(1, Ordering::AcqRel);
        if let Ok(v) = result {
            let _ = tx.send(v);
        }
    });
    if QUEUE.send(job).is_err() {
        // The thread is gone (it never started): the job was dropped with
        // its sender, and the receiver says so.
        PENDING.fetch_sub(1, Ordering::AcqRel);
    }
    Ok(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The queue is one per process: a test that fills it must not run
    /// beside one that needs room in it.
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    #[tokio::test]
    async fn runs_jobs_and_survives_a_panicking_one() {
        let _serial = SERIAL.lock().await;
        let answers: Vec<_> = (0..16u64)
            .map(|i| try_spawn(i, |i| i * i).unwrap())
            .collect();
        for (i, rx) in answers.into_iter().enumerate() {
            assert_eq!(rx.await.unwrap(), (i * i) as u64);
        }
        // A panic ends that job (its receiver errs), not its thread.
        for _ in 0..3 {
            let failed = try_spawn((), |()| -> u64 { panic!("a job that fails") }).unwrap();
            assert!(failed.await.is_err());
        }
        assert_eq!(try_spawn((), |()| 7).unwrap().await.unwrap(), 7);
    }

    #[test]
    fn its_threads_run_at_a_lower_priority() {
        let _serial = SERIAL.blocking_lock();
        let rx = try_spawn((), |()| {
            (
                std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default(),
                std::thread::current().name().map(str::to_owned),
            )
        })
        .unwrap();
        let (stat, name) = rx.blocking_recv().unwrap();
        // Field 19 of /proc/<tid>/stat is the nice value; the fields after
        // the `(comm)` one start at field 3.
        let after = stat.rsplit_once(')').map(|(_, s)| s).unwrap_or("");
        let nice: i64 = after
            .split_whitespace()
            .nth(16)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        assert!(name.unwrap_or_default().starts_with("allowance-background"));
        if cfg!(target_os = "linux") {
            assert!(nice > 0, "nice {nice}");
        }
    }

    #[tokio::test]
    async fn a_full_queue_refuses_and_frees_as_jobs_end() {
        let _serial = SERIAL.lock().await;
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let release_rx = std::sync::Arc::new(std::sync::Mutex::new(release_rx));
        let mut held = Vec::new();
        // Fill the queue with jobs that wait to be released (fill until
        // refused: a gateway test elsewhere in the process may hold some).
        loop {
            let rx = release_rx.clone();
            match try_spawn(rx, |rx| {
                let _ = rx.lock().map(|r| r.recv());
            }) {
                Ok(job) => held.push(job),
                Err(_) => break,
            }
            assert!(held.len() <= MAX_PENDING_JOBS, "never refused");
        }
        assert_eq!(try_spawn(1, |v| v).err(), Some(1), "full: the input back");
        for _ in &held {
            let _ = release_tx.send(());
        }
        for job in held {
            job.await.unwrap();
        }
        assert_eq!(
            try_spawn((), |()| 2).unwrap().await.unwrap(),
            2,
            "room again"
        );
    }
}
