//! [`DurableStore`]: the embedded ledger, logged before it answers.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use allowance_core::{
    AdminError, Amounts, Catalog, CatalogChange, Clock, Committed, Dimension, Durable, ExtendError,
    Granted, IdSource, Journal, MAX_USAGE_PAGE, NoJournal, RefundError, Reservation, ReservationId,
    ReserveError, ReserveRequest, ScopeKey, ScopeStatus, SettleError, SharedLedger, Store,
    StoreError, StoreStats, Timestamp, Unavailable, Usage, UsageEvent, UsagePage, UsageRecord,
};
use allowance_wal::{FileSystem, Lsn, ReplayProgress, TornTail, Wal, WalError, WalOptions};
use async_trait::async_trait;
use parking_lot::{Mutex, RwLock};

use crate::record::{self, Change, Record, RecordRef, SnapshotBody};

/// How a [`DurableStore`] keeps its data.
#[derive(Clone, Debug)]
pub struct DurableOptions {
    /// The write-ahead log: data dir, fsync policy, segment size.
    pub wal: WalOptions,
    /// Ledger shards (see [`SharedLedger::new`]).
    pub shards: usize,
    /// A snapshot is written (and the log before it deleted) once this many
    /// records were appended since the last one: recovery replays at most
    /// about this many records. At least 1.
    pub snapshot_every_records: u64,
    /// The usage log (`GET /v1/usage`) keeps at least this many of its
    /// latest records; older ones are deleted a whole segment at a time
    /// when a snapshot is written. At least 1.
    pub usage_keep_records: u64,
    /// The size of the usage log's segments (what is deleted at a time).
    pub usage_segment_bytes: u64,
}

/// Snapshot after a million records: about a second of replay at the
/// measured recovery speed, and a snapshot every few minutes under load.
pub const DEFAULT_SNAPSHOT_EVERY_RECORDS: u64 = 1_000_000;

/// The usage records kept by default: as many as the Redis store's usage
/// stream keeps (~2 GB of disk at ~200 bytes a record). An exporter that
/// reads at least that often misses nothing; an older cursor reads on from
/// the oldest record kept, as on the other stores.
pub const DEFAULT_USAGE_KEEP_RECORDS: u64 = 10_000_000;

impl DurableOptions {
    /// The defaults in `dir`: `fsync = always`, 16 shards, a snapshot every
    /// [`DEFAULT_SNAPSHOT_EVERY_RECORDS`] records, the latest
    /// [`DEFAULT_USAGE_KEEP_RECORDS`] usage records kept.
    pub fn new(dir: impl Into<std::path::PathBuf>) -> Self {
        DurableOptions {
            wal: WalOptions::new(dir),
            shards: 16,
            snapshot_every_records: DEFAULT_SNAPSHOT_EVERY_RECORDS,
            usage_keep_records: DEFAULT_USAGE_KEEP_RECORDS,
            usage_segment_bytes: DEFAULT_USAGE_SEGMENT_BYTES,
        }
    }
}

/// Why a [`DurableStore`] could not open its data dir.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The log could not be opened or read (locked, corrupt, I/O).
    #[error(transparent)]
    Wal(#[from] WalError),
    /// The latest snapshot is unreadable.
    #[error("snapshot at lsn {lsn} in {dir}: {message}")]
    Snapshot {
        /// The snapshot's log position.
        lsn: Lsn,
        /// The data dir.
        dir: String,
        /// What is wrong.
        message: String,
    },
    /// A record could not be written at start-up.
    #[error("cannot write to the write-ahead log in {dir}: {message}")]
    Write {
        /// The data dir.
        dir: String,
        /// What failed.
        message: String,
    },
}

/// What opening the data dir found and did (for the start-up log).
#[derive(Clone, Debug, Default)]
pub struct OpenReport {
    /// The snapshot recovery started from.
    pub snapshot_lsn: Option<Lsn>,
    /// Records replayed after it.
    pub replayed: u64,
    /// The log's last position after start-up.
    pub last_lsn: Lsn,
    /// The half-written end a crash left, cut off (see
    /// [`TornTail::acknowledged_lost`] for whether acknowledged records
    /// went with it).
    pub torn_tail: Option<TornTail>,
    /// The same for the usage log (its events are regenerated from the
    /// main log: nothing is lost with it).
    pub usage_torn_tail: Option<TornTail>,
    /// The main records (first, last lsn) whose usage events the usage log
    /// held though the main log had lost them (a power loss under `fsync =
    /// "batch"` before this build, or `"never"`; damage cut from the main
    /// log's end): those events stay in the export, describing operations
    /// the ledger no longer has.
    pub usage_ahead: Option<(Lsn, Lsn)>,
    /// The configuration file differs from the one the log last saw.
    pub config_changed: bool,
    /// The admin changes in force (plans, overrides, models, dimensions
    /// set through the API), which win over the configuration file.
    pub admin_changes: Vec<String>,
    /// Admin changes that no longer apply to the new configuration file,
    /// with the reason (they stay logged; they are skipped).
    pub skipped_admin_changes: Vec<String>,
    /// Logged operations that did not replay as they ran (should be none:
    /// each is a bug report).
    pub divergences: Vec<String>,
    /// Reservations expired in all once start-up observed the clock (those
    /// the log's own history expired included): a counter, not only the
    /// ones that expired while the store was down.
    pub expired_total: u64,
    /// Time spent opening.
    pub elapsed: Duration,
}

/// A store's open ledger and its log. Replaced as a whole when the log
/// fails and the store rebuilds from disk.
struct Live {
    ledger: SharedLedger,
    wal: Wal,
    /// The usage log (`data_dir/usage/`): derived from `wal`, regenerated
    /// from it after a crash, never truncated.
    usage_wal: Wal,
    /// Usage events of main records not durable yet, in main-log order:
    /// they reach the usage log only once their record is durable, so the
    /// usage log never holds an event the main log could lose.
    pending_usage: Mutex<std::collections::VecDeque<(Lsn, Vec<UsageEvent>)>>,
    /// Under `fsync = "batch"` a main record is acknowledged at its write
    /// and synced within the window: its events wait for the sync, so the
    /// usage log (synced on its own) never gets to the disk ahead of the
    /// main log and a power loss cannot leave it holding events the ledger
    /// lost. (Under `"always"` durable is synced; under `"never"` nothing
    /// is synced until a roll, snapshot or close, and the usage log is not
    /// synced either.)
    usage_after_sync: bool,
    /// Bumped before and after each trim of the usage log (odd while one
    /// runs): a page read that failed while it changed is read again, as
    /// a segment may have been deleted under it. (No lock across the I/O.)
    usage_trims: AtomicU64,
    /// The configuration file's catalog the log last recorded.
    base: Arc<Catalog>,
    /// Admin changes in force, oldest first: what a new configuration file
    /// is overlaid with. Changed under every shard lock (with the log append).
    overlay: Mutex<Vec<CatalogChange>>,
    since_snapshot: AtomicU64,
    snapshotting: AtomicBool,
}

/// Appends each committed change to the log, under the ledger's locks.
/// `announce: false` does not wake the log's writer (see
/// [`Wal::append_unannounced`]): for a change whose durability is awaited
/// together with a sibling's (the decided operations).
struct WalJournal<'a> {
    live: &'a Live,
    announce: bool,
}

impl<'a> WalJournal<'a> {
    /// The journal of an operation that waits for its own record.
    fn new(live: &'a Live) -> Self {
        WalJournal {
            live,
            announce: true,
        }
    }
}

/// A journaled change's place in the log (or why it has none).
type WalTicket = Result<Lsn, String>;

impl Journal for WalJournal<'_> {
    type Ticket = WalTicket;
    const USAGE: bool = true;

    fn commit(&self, change: &Committed<'_>, usage: Vec<UsageEvent>) -> Self::Ticket {
        journal_commit(self.live, change, usage, self.announce)
    }
}

/// Appends a change (waking the log's writer when `announce`) and queues
/// its usage events.
fn journal_commit(
    live: &Live,
    change: &Committed<'_>,
    usage: Vec<UsageEvent>,
    announce: bool,
) -> Result<Lsn, String> {
    if let Committed::Catalog(c) = change {
        record::push_overlay(&mut live.overlay.lock(), c);
    }
    // Held across the append, so the queue is in the main log's order.
    let mut pending = live.pending_usage.lock();
    let lsn = record::with_encoded(&RecordRef::Change(change), |bytes| {
        if announce {
            live.wal.append(bytes)
        } else {
            live.wal.append_unannounced(bytes)
        }
    })
    .map_err(|e| format!("cannot encode the record: {e}"))?
    .map_err(|e| e.to_string())?;
    if !usage.is_empty() {
        pending.push_back((lsn, usage));
    }
    Ok(lsn)
}

/// Appends `events` (the main record `main_lsn`'s, from `first_index` on)
/// to the usage log.
fn append_usage(
    usage_wal: &Wal,
    main_lsn: Lsn,
    first_index: usize,
    events: &[UsageEvent],
) -> Result<(), String> {
    for (i, event) in events.iter().enumerate() {
        let entry = record::UsageEntryRef {
            main_lsn,
            index: u32::try_from(first_index + i).unwrap_or(u32::MAX),
            event,
        };
        record::with_encoded(&entry, |bytes| usage_wal.append(bytes))
            .map_err(|e| format!("cannot encode a usage record: {e}"))?
            .map_err(|e| format!("usage log: {e}"))?;
    }
    Ok(())
}

/// Moves the usage events of every durable main record into the usage log.
fn flush_usage(live: &Live) -> Result<(), String> {
    let mut pending = live.pending_usage.lock();
    if pending.is_empty() {
        // Most operations (reserves) have no events: spare the log's lock.
        return Ok(());
    }
    let durable = if live.usage_after_sync {
        live.wal.synced_lsn()
    } else {
        live.wal.durable_lsn()
    };
    while let Some((lsn, _)) = pending.front() {
        if *lsn > durable {
            break;
        }
        let Some((lsn, events)) = pending.pop_front() else {
            break;
        };
        append_usage(&live.usage_wal, lsn, 0, &events)?;
    }
    Ok(())
}

/// Collects the usage events a replayed operation produces.
#[derive(Default)]
struct Collect(std::cell::RefCell<Vec<UsageEvent>>);

impl Journal for Collect {
    type Ticket = ();
    const USAGE: bool = true;

    fn commit(&self, _change: &Committed<'_>, usage: Vec<UsageEvent>) {
        self.0.borrow_mut().extend(usage);
    }
}

struct Inner {
    live: RwLock<Option<Arc<Live>>>,
    config: Arc<Catalog>,
    opts: DurableOptions,
    fs: Arc<dyn FileSystem>,
    clock: Arc<dyn Clock>,
    ids: Arc<dyn IdSource>,
    rebuilding: AtomicBool,
}

/// The durable embedded store: a [`SharedLedger`] whose every change is
/// appended to a write-ahead log (under the ledger's locks, so the log's
/// order is the ledger's) and made durable before the answer; recovery
/// replays snapshot + log through the same engine with the logged instants.
///
/// If the log fails (a write or fsync error, disk full), the store *fences*:
/// every operation answers [`Unavailable`] (the outcome is unknown) while a
/// background task reopens the data dir and rebuilds the ledger from what
/// is on disk — which holds everything ever acknowledged. It serves again
/// as soon as the disk works, without a restart.
#[derive(Clone)]
pub struct DurableStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for DurableStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableStore")
            .field("dir", &self.inner.opts.wal.dir)
            .finish_non_exhaustive()
    }
}

impl DurableStore {
    /// Opens (or creates) the data dir: recovers snapshot + log, cutting a
    /// torn tail, refusing corruption with its file and offset, and
    /// refusing a data dir another process has. `progress` hears about a
    /// long replay. Must run inside a Tokio runtime.
    pub async fn open(
        config: Catalog,
        opts: DurableOptions,
        fs: Arc<dyn FileSystem>,
        clock: Arc<dyn Clock>,
        ids: Arc<dyn IdSource>,
        progress: impl FnMut(ReplayProgress) + Send + 'static,
    ) -> Result<(DurableStore, OpenReport), OpenError> {
        let inner = Arc::new(Inner {
            live: RwLock::new(None),
            config: Arc::new(config),
            opts,
            fs,
            clock,
            ids,
            rebuilding: AtomicBool::new(false),
        });
        let (live, report) = open_live(&inner, progress).await?;
        *inner.live.write() = Some(live);
        Ok((DurableStore { inner }, report))
    }

    /// Runs `f` on the ledger (for tests and tools); `None` while rebuilding.
    pub fn with_ledger<R>(&self, f: impl FnOnce(&SharedLedger) -> R) -> Option<R> {
        let live = self.inner.live.read().clone()?;
        Some(f(&live.ledger))
    }

    /// Whether the store is fenced, rebuilding after a log failure.
    pub fn is_rebuilding(&self) -> bool {
        self.inner.live.read().is_none()
    }

    /// Writes a snapshot now (normally automatic, every
    /// `snapshot_every_records`): returns its log position. Blocking: call
    /// off the async runtime.
    pub fn snapshot_now(&self) -> Result<Lsn, String> {
        let live = self.inner.live().map_err(|e| e.0)?;
        write_snapshot(
            &live,
            self.inner.clock.now(),
            self.inner.opts.usage_keep_records,
        )
    }

    /// Stops the log cleanly (everything appended written and synced).
    pub async fn close(self) -> Result<(), WalError> {
        let live = self.inner.live.write().take();
        let Some(mut live) = live else { return Ok(()) };
        // Requests still holding the ledger finish first; they are few
        // and short (no request outlives its store timeout).
        loop {
            match Arc::try_unwrap(live) {
                Ok(l) => {
                    return tokio::task::spawn_blocking(move || l.wal.close())
                        .await
                        .unwrap_or(Ok(()));
                }
                Err(still_shared) => {
                    live = still_shared;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }
}

impl Inner {
    fn live(&self) -> Result<Arc<Live>, Unavailable> {
        self.live.read().clone().ok_or_else(|| {
            Unavailable(
                "the write-ahead log failed; the store is rebuilding from its data dir".to_owned(),
            )
        })
    }
}

/// Opens the data dir and rebuilds the ledger: snapshot, then log.
async fn open_live(
    inner: &Arc<Inner>,
    progress: impl FnMut(ReplayProgress) + Send + 'static,
) -> Result<(Arc<Live>, OpenReport), OpenError> {
    let started = Instant::now();
    let inner2 = inner.clone();
    let (live, mut report, wait_for) =
        tokio::task::spawn_blocking(move || recover(&inner2, progress))
            .await
            .map_err(|e| OpenError::Write {
                dir: inner.opts.wal.dir.display().to_string(),
                message: format!("recovery stopped: {e}"),
            })??;
    if let Some(lsn) = wait_for {
        live.wal.durable(lsn).await.map_err(|e| OpenError::Write {
            dir: inner.opts.wal.dir.display().to_string(),
            message: e.to_string(),
        })?;
    }
    report.expired_total = live.ledger.expire_due(inner.clock.now());
    report.elapsed = started.elapsed();
    Ok((Arc::new(live), report))
}

/// Applies `overlay` to `base`: the catalog in force. Changes that no longer
/// apply (a plan naming a dimension the file dropped) are skipped and listed.
fn compose(base: &Catalog, overlay: &[CatalogChange], skipped: &mut Vec<String>) -> Catalog {
    let mut c = base.clone();
    for change in overlay {
        match change.apply_on(&mut c, base) {
            Ok(()) => {}
            // Clearing an override the file does not have: nothing to do.
            Err(AdminError::NotFound(_)) if matches!(change, CatalogChange::ClearOverride(_)) => {}
            Err(e) => skipped.push(format!("{}: {e}", describe(change))),
        }
    }
    c
}

/// One line per admin change, for the start-up log.
fn describe(change: &CatalogChange) -> String {
    match change {
        CatalogChange::SetPlan(p) => format!("plan {:?} set through the API", p.name()),
        CatalogChange::SetOverride(s, _) => format!("override on {s}"),
        CatalogChange::ClearOverride(s) => format!("override on {s} cleared"),
        CatalogChange::SetModel(m, _) => format!("model {m:?} priced through the API"),
        CatalogChange::AddDimension(d) => format!("dimension {d:?} added through the API"),
        CatalogChange::RevertPlan(p) => format!("plan {p:?} returned to the file's"),
    }
}

/// Replays records into a ledger, checking each replays as it ran.
struct Replayer {
    ledger: SharedLedger,
    /// The usage log and the position it has reached: the events of main
    /// records after it are appended as replay regenerates them.
    usage_wal: Wal,
    usage_upto: (Lsn, Option<u32>),
    /// Whether the ledger reports expiries (for usage events): off while
    /// replaying records whose events the usage log already holds, so none
    /// pile up unreported; on from the first record it may lack events of.
    reporting: bool,
    base: Option<Catalog>,
    overlay: Vec<CatalogChange>,
    skipped: Vec<String>,
    divergences: Vec<String>,
}

/// Divergences kept for the report (the count is what matters past this).
const MAX_REPORTED_DIVERGENCES: usize = 20;

impl Replayer {
    fn diverged(&mut self, lsn: Lsn, what: String) {
        if self.divergences.len() < MAX_REPORTED_DIVERGENCES {
            self.divergences.push(format!("lsn {lsn}: {what}"));
        }
    }

    fn apply(&mut self, lsn: Lsn, rec: &Record) -> Result<(), String> {
        if self.base.is_none() && !matches!(rec, Record::Base(_)) {
            return Err(
                "the log does not start with its configuration (a Base record): \
                        it was not written by this version of allowance"
                    .to_owned(),
            );
        }
        let change = match rec {
            Record::Base(c) => {
                self.skipped.clear();
                let next = compose(c, &self.overlay, &mut self.skipped);
                self.ledger.replace_catalog(next);
                self.base = Some((**c).clone());
                return Ok(());
            }
            // A catalog change has no usage events either way.
            Record::Change(Change::Admin(change)) => {
                self.apply_admin(lsn, change);
                return Ok(());
            }
            Record::Change(change) => change,
        };
        // The usage log is written in the main log's order, so it holds
        // every event of the records before the one it ends in.
        if lsn < self.usage_upto.0 {
            self.apply_change(lsn, change, None);
            return Ok(());
        }
        if !self.reporting {
            // Expiries observed from here on may be missing from the usage
            // log: collect them, as the live ledger did, for each record's
            // events. None is pending: reporting was off until now.
            self.ledger.report_usage();
            self.reporting = true;
        }
        self.apply_with_usage(lsn, change)
    }

    fn apply_admin(&mut self, lsn: Lsn, change: &CatalogChange) {
        // A reverted plan returns to the file the log had then (its Base).
        let base = self.base.as_ref();
        let applied = self.ledger.update_catalog(|c| match base {
            Some(base) => change.apply_on(c, base),
            None => change.apply(c),
        });
        match applied {
            Ok(()) => {}
            Err(e) => self.diverged(lsn, format!("{} refused: {e}", describe(change))),
        }
        record::push_overlay(&mut self.overlay, change);
    }

    /// Replays one change. With `events`, through the journaled calls,
    /// which collect the change's usage events (the usage log may lack
    /// them); without, through the plain calls, for a change whose events
    /// the usage log already holds: they change the state exactly as the
    /// journaled ones, which only add the events (a copy of each
    /// reservation that ended). Expiry reporting is off until the first
    /// record with events to collect (see `reporting`), so no expiry waits
    /// to be reported then.
    fn apply_change(&mut self, lsn: Lsn, change: &Change, events: Option<&Collect>) {
        let ledger = &self.ledger;
        let diverged = match *change {
            Change::Reserve { now, id, ref req } => {
                let r = match events {
                    Some(ev) => ledger.reserve_journaled(now, id, req, ev).0,
                    None => ledger.reserve(now, id, req),
                };
                match r {
                    Ok(g) if !g.replayed && !g.dry_run => None,
                    Ok(_) => Some(format!("reserve {id} answered a repeat")),
                    Err(e) => Some(format!("reserve {id} refused: {e}")),
                }
            }
            Change::Settle { now, id, ref usage } => match events {
                Some(ev) => ledger.settle_journaled(now, id, usage, ev).map(drop),
                None => ledger.settle(now, id, usage).map(drop),
            }
            .err()
            .map(|e| format!("settle {id} refused: {e}")),
            Change::Refund { now, id } => match events {
                Some(ev) => ledger.refund_journaled(now, id, ev).map(drop),
                None => ledger.refund(now, id).map(drop),
            }
            .err()
            .map(|e| format!("refund {id} refused: {e}")),
            Change::Extend {
                now,
                id,
                ref amounts,
                ttl_ms,
            } => match events {
                Some(ev) => ledger
                    .extend_journaled(now, id, amounts.as_ref(), ttl_ms, ev)
                    .map(drop),
                None => ledger.extend(now, id, amounts.as_ref(), ttl_ms).map(drop),
            }
            .err()
            .map(|e| format!("extend {id} refused: {e}")),
            Change::Adjust {
                now,
                ref scope,
                dimension,
                credit,
                ref reason,
            } => match events {
                Some(ev) => ledger
                    .adjust_journaled(now, scope, dimension, credit, reason, ev)
                    .map(drop),
                None => ledger.adjust(now, scope, dimension, credit).map(drop),
            }
            .err()
            .map(|e| format!("adjust {scope} refused: {e}")),
            // Every shard observes `now`, as the logged tick made them. With
            // reporting off it finds nothing to report, which proves nothing
            // (its expiries are in the usage log); with it on, it must.
            Change::Tick { now } => match events {
                Some(ev) => ledger
                    .tick_journaled(now, ev)
                    .is_none()
                    .then(|| "a tick reported no expiry".to_owned()),
                None => {
                    let _ = ledger.tick_journaled(now, &NoJournal);
                    None
                }
            },
            Change::Admin(ref change) => {
                self.apply_admin(lsn, change);
                None
            }
        };
        if let Some(why) = diverged {
            self.diverged(lsn, why);
        }
    }

    /// Replays a change whose usage events the usage log may lack, and
    /// appends the missing ones.
    fn apply_with_usage(&mut self, lsn: Lsn, change: &Change) -> Result<(), String> {
        let events = Collect::default();
        self.apply_change(lsn, change, Some(&events));
        // Events the usage log lacks (a crash came between the two logs'
        // writes) are appended now, in the order they first happened.
        let events = events.0.into_inner();
        let from = match self.usage_upto {
            (upto, _) if lsn > upto => 0,
            (upto, Some(index)) if lsn == upto => index as usize + 1,
            _ => events.len(),
        };
        if from < events.len() {
            append_usage(&self.usage_wal, lsn, from, &events[from..])?;
        }
        Ok(())
    }
}

/// Decoded records handed from the reading thread to the applying one.
const REPLAY_BATCH: usize = 1024;
/// Batches in flight between the two threads (each way).
const REPLAY_BATCHES_IN_FLIGHT: usize = 4;

/// Replays the log after `after` into `replayer` on two threads: this one
/// reads, checks and decodes the log, another applies the records through
/// the engine (the larger part), so the two overlap. The order is kept: one
/// reader, one applier, a FIFO between them.
///
/// The applier hands every applied batch back, and the records are dropped
/// here, on the thread that allocated them: freed on the other thread,
/// the system allocator takes this thread's arena lock for every free while
/// this thread allocates under it (a tenth of a replay's time went to that
/// lock), and this thread's own frees refill its cache for the next batch's
/// allocations. The batch vectors are reused too.
fn replay_pipelined(
    wal: &Wal,
    after: Lsn,
    mut replayer: Replayer,
    progress: impl FnMut(ReplayProgress),
) -> Result<(u64, Replayer), OpenError> {
    type Batch = Vec<(Lsn, Record)>;
    let (tx, rx) = std::sync::mpsc::sync_channel::<Batch>(REPLAY_BATCHES_IN_FLIGHT);
    // Room for every batch vector there can be (those in flight, the one
    // being filled, the one being applied), so handing one back never
    // waits; were it ever full, the batch would drop on the applier:
    // slower, not wrong.
    let (back_tx, back_rx) = std::sync::mpsc::sync_channel::<Batch>(REPLAY_BATCHES_IN_FLIGHT + 2);
    std::thread::scope(|scope| {
        let applier = scope.spawn(move || {
            for batch in rx {
                for (lsn, rec) in &batch {
                    replayer.apply(*lsn, rec).map_err(|e| (*lsn, e))?;
                }
                // The reader may have stopped: then the batch drops here.
                let _ = back_tx.try_send(batch);
            }
            Ok::<Replayer, (Lsn, String)>(replayer)
        });
        let mut batch = Vec::with_capacity(REPLAY_BATCH);
        let mut decoder = record::Decoder::default();
        let mut tx = Some(tx);
        let read = wal.replay_with_progress(
            after,
            |lsn, bytes| {
                batch.push((lsn, decoder.decode(bytes)?));
                if batch.len() == REPLAY_BATCH {
                    let next = match back_rx.try_recv() {
                        Ok(mut applied) => {
                            applied.clear();
                            applied
                        }
                        Err(_) => Vec::with_capacity(REPLAY_BATCH),
                    };
                    let full = std::mem::replace(&mut batch, next);
                    // A closed channel: the applier stopped on an error,
                    // which its join reports.
                    if tx.as_ref().is_none_or(|t| t.send(full).is_err()) {
                        return Err("the replay stopped".to_owned());
                    }
                }
                Ok(())
            },
            progress,
        );
        if read.is_ok()
            && !batch.is_empty()
            && let Some(t) = &tx
        {
            let _ = t.send(std::mem::take(&mut batch));
        }
        drop(tx.take());
        let applied = applier.join().map_err(|_| WalError::Replay {
            lsn: after,
            message: "the replay's applying thread panicked".to_owned(),
        })?;
        match (read, applied) {
            // An applier error is the cause of a reader stop: report it.
            (_, Err((lsn, message))) => Err(WalError::Replay { lsn, message }.into()),
            (Err(e), Ok(_)) => Err(e.into()),
            (Ok(n), Ok(replayer)) => Ok((n, replayer)),
        }
    })
}

/// The blocking part of opening: returns the live ledger, the report, and
/// an lsn to wait for before serving (a Base record written at start).
fn recover(
    inner: &Inner,
    progress: impl FnMut(ReplayProgress),
) -> Result<(Live, OpenReport, Option<Lsn>), OpenError> {
    let dir = inner.opts.wal.dir.display().to_string();
    // The two logs are independent files: each open reads and checks its
    // whole log, so they run side by side (the usage log's is a third of
    // the main one's on a typical mix).
    //
    // The main log is replayed whole right after (from the snapshot on), and
    // the replay checks every record it reads as open would: open checks
    // only the last segment, so the log is read and checked once, not
    // twice (an eighth of the start-up at a million records, measured).
    let main_opts = WalOptions {
        defer_sealed_checks: true,
        ..inner.opts.wal.clone()
    };
    let (main, usage) = std::thread::scope(|scope| {
        let usage = scope.spawn(|| {
            Wal::open(
                usage_options(&inner.opts.wal, inner.opts.usage_segment_bytes),
                inner.fs.clone(),
            )
        });
        let main = Wal::open(main_opts, inner.fs.clone());
        // A panic there is a bug: carried on here as if it had run here.
        let usage = usage
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (main, usage)
    });
    let (wal, recovered) = main?;
    let (usage_wal, usage_recovered) = usage?;
    let mut usage_upto = last_usage(&usage_wal)?;
    let mut report = OpenReport {
        torn_tail: recovered.torn_tail.clone(),
        usage_torn_tail: usage_recovered.torn_tail.clone(),
        ..OpenReport::default()
    };
    if usage_upto.0 > recovered.last_lsn {
        // The usage log holds events of main records the main log no longer
        // has (a power loss took records it had acknowledged but not
        // synced, or damage to its last write was cut): they were exported
        // and stay, reported. The main log writes those lsns again: a
        // rewind makes their events count as missing, to regenerate.
        report.usage_ahead = Some((recovered.last_lsn + 1, usage_upto.0));
        usage_wal.append(&record::encode_rewind(recovered.last_lsn))?;
        // On disk before the main log writes those lsns again: a crash must
        // not find their new events missing and the ghosts' taken for them.
        usage_wal.sync_all()?;
        usage_upto = (recovered.last_lsn, None);
    }
    let snapshot = wal.latest_snapshot()?;
    // Where replay starts: the latest snapshot, or an empty ledger on the
    // configuration file (whose first record is then its Base).
    let (ledger, base, overlay, after) = match snapshot {
        Some((lsn, bytes)) => {
            let bad = |message: String| OpenError::Snapshot {
                lsn,
                dir: dir.clone(),
                message,
            };
            let body = record::decode_snapshot(&bytes).map_err(bad)?;
            let ledger = SharedLedger::from_snapshot(body.ledger, inner.opts.shards)
                .map_err(|e| bad(e.to_string()))?;
            report.snapshot_lsn = Some(lsn);
            (ledger, Some(body.base), body.overlay, lsn)
        }
        None => (
            SharedLedger::new((*inner.config).clone(), inner.opts.shards),
            None,
            Vec::new(),
            0,
        ),
    };
    let replayer = Replayer {
        ledger,
        usage_wal,
        usage_upto,
        reporting: false,
        base,
        overlay,
        skipped: Vec::new(),
        divergences: Vec::new(),
    };
    let (replayed, replayer) = replay_pipelined(&wal, after, replayer, progress)?;
    report.replayed = replayed;
    let Replayer {
        ledger,
        usage_wal,
        usage_upto: _,
        reporting: _,
        base,
        overlay,
        skipped,
        divergences,
    } = replayer;
    // The store reports expiries from now on, whether or not replay came
    // to a record the usage log lacked.
    ledger.report_usage();
    report.divergences = divergences;
    report.skipped_admin_changes = skipped;
    report.admin_changes = overlay.iter().map(describe).collect();
    // The configuration file wins over what the log last saw, except where
    // an admin change (kept in `overlay`) says otherwise.
    let same = base
        .as_ref()
        .is_some_and(|b| same_catalog(b, &inner.config));
    let mut wait_for = None;
    if !same {
        report.config_changed = base.is_some();
        let lsn = record::with_encoded(&RecordRef::Base(&inner.config), |b| wal.append(b))
            .map_err(|e| OpenError::Write {
                dir: dir.clone(),
                message: format!("cannot encode the configuration: {e}"),
            })?
            .map_err(|e| OpenError::Write {
                dir: dir.clone(),
                message: e.to_string(),
            })?;
        let mut skipped = Vec::new();
        ledger.replace_catalog(compose(&inner.config, &overlay, &mut skipped));
        report.skipped_admin_changes = skipped;
        wait_for = Some(lsn);
    }
    report.last_lsn = wal.last_lsn();
    let live = Live {
        ledger,
        wal,
        usage_wal,
        usage_after_sync: matches!(inner.opts.wal.fsync, allowance_wal::Fsync::Batch { .. }),
        pending_usage: Mutex::new(std::collections::VecDeque::new()),
        usage_trims: AtomicU64::new(0),
        base: inner.config.clone(),
        overlay: Mutex::new(overlay),
        since_snapshot: AtomicU64::new(report.replayed),
        snapshotting: AtomicBool::new(false),
    };
    Ok((live, report, wait_for))
}

/// The usage log's options: in `usage/` under the data dir, small segments
/// (a page read scans one). Fsynced per group commit like the main log,
/// though nothing waits for it: a log acknowledged before its fsync could,
/// after a failed fsync and a power loss, come back with a hole that stops
/// start-up; fsynced, a failure cuts it back cleanly and a restart
/// regenerates the rest from the main log.
fn usage_options(main: &WalOptions, segment_bytes: u64) -> WalOptions {
    let mut opts = WalOptions::new(main.dir.join("usage"));
    // Synced per batch, after the main records it derives from are (see
    // `Live::usage_after_sync`) — except under "never", where the main log
    // is not synced while it runs, nor then is this.
    opts.fsync = match main.fsync {
        allowance_wal::Fsync::Never => allowance_wal::Fsync::Never,
        _ => allowance_wal::Fsync::Always,
    };
    opts.segment_bytes = segment_bytes;
    // Nothing in a request's path waits for it: write (and fsync) in
    // batches every few ms instead of waking a thread per operation.
    opts.write_every = Some(USAGE_WRITE_EVERY);
    opts
}

/// How often the usage log's writer looks for new records: what a usage
/// page read may wait at most for the last answered operation's records.
const USAGE_WRITE_EVERY: Duration = Duration::from_millis(5);

/// Usage log segments: a page read decodes at most a few of them.
pub const DEFAULT_USAGE_SEGMENT_BYTES: u64 = 4 << 20;

/// Where the usage log stands: the main lsn and event index of its last
/// record (`(0, None)` when it is empty).
fn last_usage(usage_wal: &Wal) -> Result<(Lsn, Option<u32>), OpenError> {
    let last = usage_wal.last_lsn();
    if last == 0 {
        return Ok((0, None));
    }
    let at = |bytes: &[u8]| {
        Ok(match record::decode_usage(bytes)? {
            record::UsageItem::Event(entry) => (entry.main_lsn, Some(entry.index)),
            // Every event of the records up to it is present (none after).
            record::UsageItem::Rewind { main_lsn } => (main_lsn, None),
        })
    };
    match usage_record(usage_wal, last, at) {
        Ok(found) => Ok(found.unwrap_or((0, None))),
        // No record after the last trim survived (damage: they were
        // synced): the trim's snapshot is that last record (`trim_usage`).
        Err(WalError::Compacted { .. }) => {
            let Some((lsn, bytes)) = usage_wal.latest_snapshot()? else {
                return Ok((0, None));
            };
            at(&bytes).map_err(|message| OpenError::Snapshot {
                lsn,
                dir: usage_wal.dir().display().to_string(),
                message,
            })
        }
        Err(e) => Err(e.into()),
    }
}

/// `f` of the usage record at `lsn` (`None`: not written yet), read alone.
fn usage_record<T>(
    usage_wal: &Wal,
    lsn: Lsn,
    f: impl FnOnce(&[u8]) -> Result<T, String>,
) -> Result<Option<T>, WalError> {
    let mut f = Some(f);
    let mut found = None;
    let read = usage_wal.replay(lsn - 1, |_, bytes| {
        if let Some(f) = f.take() {
            found = Some(f(bytes)?);
        }
        Err(STOP_REPLAY.to_owned())
    });
    match read {
        Ok(_) => Ok(found),
        Err(WalError::Replay { message, .. }) if message == STOP_REPLAY => Ok(found),
        Err(e) => Err(e),
    }
}

/// What a replay callback answers to stop a replay that has read enough
/// (not an error).
const STOP_REPLAY: &str = "stop: read enough";

/// Two catalogs are the same configuration when they encode the same.
fn same_catalog(a: &Catalog, b: &Catalog) -> bool {
    match (postcard::to_stdvec(a), postcard::to_stdvec(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// Writes a snapshot of `live` and deletes the log it covers; then trims the
/// usage log to its latest `keep_usage` records.
fn write_snapshot(live: &Live, now: Timestamp, keep_usage: u64) -> Result<Lsn, String> {
    // Expiries not reported yet are committed first (a snapshot carries
    // none), under the same locks.
    let (tick, (lsn, overlay), ledger) =
        live.ledger
            .snapshot_journaled(now, &WalJournal::new(live), || {
                (live.wal.last_lsn(), live.overlay.lock().clone())
            });
    if let Some(ticket) = tick {
        ticket?;
    }
    // The usage log is derived from the main log: it must be on disk before
    // the main records it came from are deleted.
    live.wal.sync_all().map_err(|e| e.to_string())?;
    flush_usage(live)?;
    live.usage_wal
        .sync_all()
        .map_err(|e| format!("usage log: {e}"))?;
    let body = SnapshotBody {
        base: (*live.base).clone(),
        overlay,
        ledger,
    };
    let bytes = record::encode_snapshot(&body).map_err(|e| format!("encode snapshot: {e}"))?;
    live.wal
        .write_snapshot(lsn, &bytes)
        .map_err(|e| e.to_string())?;
    if let Err(e) = trim_usage(live, keep_usage) {
        // Nothing is lost: the log is only longer until the next snapshot.
        tracing::warn!(error = %e, "usage log: old records not deleted");
    }
    Ok(lsn)
}

/// Deletes the usage log's segments whose records are all older than its
/// latest `keep` records. The usage log has no state to snapshot: a
/// snapshot of it only marks where it now starts, which is what lets it open
/// again without the records before (writing it deletes the covered
/// segments).
///
/// That snapshot holds the record at its lsn: should every record after it
/// be lost (damage: they were synced), a start-up still knows how far the
/// usage log had come in the main log (`last_usage`).
fn trim_usage(live: &Live, keep: u64) -> Result<(), String> {
    let synced = live.usage_wal.synced_lsn();
    let keep = keep.max(1);
    if synced <= keep {
        return Ok(());
    }
    let through = synced - keep;
    live.usage_trims.fetch_add(1, Ordering::AcqRel);
    let trimmed = trim_usage_through(live, through);
    live.usage_trims.fetch_add(1, Ordering::AcqRel);
    trimmed
}

/// [`trim_usage`] of the records up to `through`.
fn trim_usage_through(live: &Live, through: Lsn) -> Result<(), String> {
    let last_dropped = match usage_record(&live.usage_wal, through, |b| Ok(b.to_vec())) {
        Ok(bytes) => bytes.ok_or_else(|| format!("usage record {through} not written"))?,
        // Trimmed this far already.
        Err(WalError::Compacted { .. }) => return Ok(()),
        Err(e) => return Err(e.to_string()),
    };
    live.usage_wal
        .write_snapshot(through, &last_dropped)
        .map_err(|e| e.to_string())
}

impl DurableStore {
    /// Applies a reserve and appends its record (waking the log's writer
    /// when `announce`); answers the live store it used, the grant, and the
    /// record's ticket (`None`: nothing was written — a dry run or a replay).
    fn apply_reserve(
        &self,
        req: &ReserveRequest,
        announce: bool,
    ) -> Result<(Arc<Live>, Granted, Option<WalTicket>), StoreError<ReserveError>> {
        let live = self.inner.live()?;
        let id = ReservationId::mint(self.inner.ids.next_random(), req.scopes.tenant_name());
        let now = self.inner.clock.now();
        let journal = WalJournal {
            live: &live,
            announce,
        };
        let (r, ticket) = live.ledger.reserve_journaled(now, id, req, &journal);
        let g = r.map_err(StoreError::Rejected)?;
        Ok((live, g, ticket))
    }

    /// Waits until the ticket's record is durable; fences the store if the
    /// log failed.
    async fn durable(
        &self,
        live: &Arc<Live>,
        ticket: Result<Lsn, String>,
    ) -> Result<(), Unavailable> {
        let lsn = match ticket {
            Ok(lsn) => lsn,
            Err(cause) => return Err(self.fence(live, &cause)),
        };
        if let Err(e) = live.wal.durable(lsn).await {
            return Err(self.fence(live, &e.to_string()));
        }
        if let Err(e) = flush_usage(live) {
            return Err(self.fence(live, &e));
        }
        self.maybe_snapshot(live);
        Ok(())
    }

    /// Waits until everything appended so far is durable: an answer that
    /// repeats an earlier change (an idempotent reserve) must not be given
    /// before that change is on disk.
    async fn settled_so_far(&self, live: &Arc<Live>) -> Result<(), Unavailable> {
        let lsn = live.wal.last_lsn();
        live.wal
            .durable(lsn)
            .await
            .map_err(|e| self.fence(live, &e.to_string()))
    }

    fn maybe_snapshot(&self, live: &Arc<Live>) {
        let every = self.inner.opts.snapshot_every_records.max(1);
        if live.since_snapshot.fetch_add(1, Ordering::Relaxed) + 1 < every
            || live.snapshotting.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let live = live.clone();
        let now = self.inner.clock.now();
        let keep_usage = self.inner.opts.usage_keep_records;
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            match write_snapshot(&live, now, keep_usage) {
                Ok(lsn) => {
                    live.since_snapshot.store(0, Ordering::Relaxed);
                    tracing::info!(
                        lsn,
                        elapsed_ms = started.elapsed().as_millis() as u64,
                        "snapshot written"
                    );
                }
                // A failed snapshot loses nothing: the log still holds it all.
                Err(e) => tracing::warn!(error = %e, "snapshot failed; the log is kept"),
            }
            live.snapshotting.store(false, Ordering::Release);
        });
    }

    /// The log failed: stop serving from this ledger (memory may hold a
    /// change the disk does not) and rebuild from disk in the background.
    fn fence(&self, live: &Arc<Live>, cause: &str) -> Unavailable {
        {
            let mut current = self.inner.live.write();
            if current.as_ref().is_some_and(|c| Arc::ptr_eq(c, live)) {
                *current = None;
            }
        }
        if !self.inner.rebuilding.swap(true, Ordering::AcqRel) {
            tracing::error!(
                error = %cause,
                dir = %self.inner.opts.wal.dir.display(),
                "the write-ahead log failed: answering store_unavailable and rebuilding from disk"
            );
            tokio::spawn(rebuild(self.inner.clone(), live.clone()));
        }
        Unavailable(format!(
            "the write-ahead log failed ({cause}); the store is rebuilding from its data dir"
        ))
    }
}

/// Drops the failed ledger and log (releasing the dir), then reopens the
/// data dir until it works.
async fn rebuild(inner: Arc<Inner>, failed: Arc<Live>) {
    // Requests still holding the failed ledger see the failed log and let go
    // quickly; the dir's lock is released when the last one does. This is
    // a recovery path, not a hot one: a short poll is the simple way.
    let mut failed = failed;
    loop {
        match Arc::try_unwrap(failed) {
            Ok(live) => {
                let _ = tokio::task::spawn_blocking(move || drop(live)).await;
                break;
            }
            Err(still_shared) => {
                failed = still_shared;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    let mut delay = Duration::from_millis(50);
    loop {
        match open_live(&inner, |_| {}).await {
            Ok((live, report)) => {
                *inner.live.write() = Some(live);
                inner.rebuilding.store(false, Ordering::Release);
                tracing::info!(
                    replayed = report.replayed,
                    last_lsn = report.last_lsn,
                    "the store rebuilt from its data dir and serves again"
                );
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "the data dir still fails");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}

#[async_trait]
impl Store for DurableStore {
    async fn reserve(&self, req: &ReserveRequest) -> Result<Granted, StoreError<ReserveError>> {
        let (live, g, ticket) = self.apply_reserve(req, true)?;
        match ticket {
            Some(t) => self.durable(&live, t).await?,
            // A replay of an earlier reserve: answered once everything
            // appended so far is durable. A dry run changed nothing.
            None if g.replayed => self.settled_so_far(&live).await?,
            None => {}
        }
        Ok(g)
    }

    async fn reserve_decided(
        &self,
        req: &ReserveRequest,
    ) -> Result<(Granted, Durable), StoreError<ReserveError>> {
        let (live, g, ticket) = self.apply_reserve(req, false)?;
        let this = self.clone();
        // What `reserve` would wait for, to be waited for by the caller.
        let durable = match ticket {
            Some(t) => Durable::when(async move { this.durable(&live, t).await }),
            None if g.replayed => Durable::when(async move { this.settled_so_far(&live).await }),
            None => Durable::now(),
        };
        Ok((g, durable))
    }

    async fn settle_decided(
        &self,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<(Reservation, Durable), StoreError<SettleError>> {
        let live = self.inner.live()?;
        // Unannounced, as `reserve_decided`: a whole answer's two settles
        // (the caller's and the attempt's) share the batch their waiter
        // asks for.
        let (r, t) = live
            .ledger
            .settle_journaled(
                self.inner.clock.now(),
                id,
                usage,
                &WalJournal {
                    live: &live,
                    announce: false,
                },
            )
            .map_err(StoreError::Rejected)?;
        let this = self.clone();
        Ok((
            r,
            Durable::when(async move { this.durable(&live, t).await }),
        ))
    }

    async fn settle(
        &self,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<Reservation, StoreError<SettleError>> {
        let live = self.inner.live()?;
        let (r, t) = live
            .ledger
            .settle_journaled(self.inner.clock.now(), id, usage, &WalJournal::new(&live))
            .map_err(StoreError::Rejected)?;
        self.durable(&live, t).await?;
        Ok(r)
    }

    async fn refund(&self, id: ReservationId) -> Result<Reservation, StoreError<RefundError>> {
        let live = self.inner.live()?;
        let (r, t) = live
            .ledger
            .refund_journaled(self.inner.clock.now(), id, &WalJournal::new(&live))
            .map_err(StoreError::Rejected)?;
        self.durable(&live, t).await?;
        Ok(r)
    }

    async fn extend(
        &self,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Result<Reservation, StoreError<ExtendError>> {
        let live = self.inner.live()?;
        let (r, t) = live
            .ledger
            .extend_journaled(
                self.inner.clock.now(),
                id,
                amounts,
                ttl_ms,
                &WalJournal::new(&live),
            )
            .map_err(StoreError::Rejected)?;
        self.durable(&live, t).await?;
        Ok(r)
    }

    async fn get(&self, id: ReservationId) -> Result<Option<Reservation>, Unavailable> {
        let live = self.inner.live()?;
        Ok(live.ledger.get(self.inner.clock.now(), id))
    }

    async fn status(&self, scope: &ScopeKey) -> Result<ScopeStatus, Unavailable> {
        let live = self.inner.live()?;
        Ok(live.ledger.status(self.inner.clock.now(), scope))
    }

    async fn adjust(
        &self,
        scope: &ScopeKey,
        dimension: Dimension,
        credit: i64,
        reason: &str,
    ) -> Result<ScopeStatus, StoreError<AdminError>> {
        let live = self.inner.live()?;
        let (s, t) = live
            .ledger
            .adjust_journaled(
                self.inner.clock.now(),
                scope,
                dimension,
                credit,
                reason,
                &WalJournal::new(&live),
            )
            .map_err(StoreError::Rejected)?;
        self.durable(&live, t).await?;
        Ok(s)
    }

    async fn catalog(&self) -> Result<Arc<Catalog>, Unavailable> {
        Ok(self.inner.live()?.ledger.catalog())
    }

    async fn change_catalog(&self, change: &CatalogChange) -> Result<(), StoreError<AdminError>> {
        let live = self.inner.live()?;
        let t = live
            .ledger
            .change_catalog_journaled(change, &live.base, &WalJournal::new(&live))
            .map_err(StoreError::Rejected)?;
        self.durable(&live, t).await?;
        Ok(())
    }

    async fn expire_due(&self) -> Result<u64, Unavailable> {
        let live = self.inner.live()?;
        let expired = live.ledger.expire_due(self.inner.clock.now());
        // Expiries no operation reported yet reach the usage log now.
        if live.ledger.has_unreported_expiries()
            && let Some(ticket) = live
                .ledger
                .tick_journaled(self.inner.clock.now(), &WalJournal::new(&live))
        {
            self.durable(&live, ticket).await?;
        }
        Ok(expired)
    }

    async fn stats(&self) -> Result<StoreStats, Unavailable> {
        let live = self.inner.live()?;
        let expired_total = live.ledger.expire_due(self.inner.clock.now());
        Ok(StoreStats {
            held_reservations: live.ledger.held_reservations() as u64,
            expired_total,
        })
    }

    async fn usage(
        &self,
        since: Option<u64>,
        limit: usize,
        tenant: Option<&str>,
    ) -> Result<UsagePage, Unavailable> {
        let live = self.inner.live()?;
        // Everything answered so far is in the usage log once durable: an
        // answered settle is in the next page.
        flush_usage(&live).map_err(|e| self.fence(&live, &e))?;
        let last = live.usage_wal.last_lsn();
        live.usage_wal
            .durable(last)
            .await
            .map_err(|e| Unavailable(format!("usage log: {e}")))?;
        let limit = limit.min(MAX_USAGE_PAGE);
        let after = since.unwrap_or(0);
        let tenant = tenant.map(str::to_owned);
        let page = tokio::task::spawn_blocking(move || read_usage(&live, after, limit, tenant))
            .await
            .map_err(|e| Unavailable(format!("usage log reader stopped: {e}")))??;
        Ok(page)
    }
}

/// Reads one page of the usage log from disk.
fn read_usage(
    live: &Live,
    after: u64,
    limit: usize,
    tenant: Option<String>,
) -> Result<UsagePage, Unavailable> {
    let mut page = UsagePage {
        records: Vec::new(),
        next_cursor: after,
    };
    if limit == 0 {
        return Ok(page);
    }
    let mut attempts = 0;
    let outcome = loop {
        let trims = live.usage_trims.load(Ordering::Acquire);
        page.records.clear();
        page.next_cursor = after;
        let mut outcome = replay_usage(live, after, limit, tenant.as_deref(), &mut page);
        if let Err(WalError::Compacted { first, .. }) = outcome {
            // Records before `first` were deleted (the usage log keeps its
            // latest records): the page starts at the oldest one kept.
            outcome = replay_usage(live, first - 1, limit, tenant.as_deref(), &mut page);
        }
        let trimmed_meanwhile = trims % 2 == 1 || live.usage_trims.load(Ordering::Acquire) != trims;
        attempts += 1;
        if outcome.is_err() && trimmed_meanwhile && attempts < 5 {
            // A trim takes milliseconds: let it finish (a blocking thread).
            std::thread::sleep(Duration::from_millis(1 << attempts));
            continue;
        }
        break outcome;
    };
    if page.records.is_empty() {
        // HTTP-API.md: with no new records the cursor repeats.
        page.next_cursor = after;
    }
    outcome
        .map(|()| page)
        .map_err(|e| Unavailable(format!("usage log: {e}")))
}

/// Adds the usage records after `after` to `page` until it holds `limit`.
fn replay_usage(
    live: &Live,
    after: u64,
    limit: usize,
    tenant: Option<&str>,
    page: &mut UsagePage,
) -> Result<(), WalError> {
    let read = live.usage_wal.replay(after, |lsn, bytes| {
        page.next_cursor = lsn;
        let entry = match record::decode_usage(bytes)? {
            record::UsageItem::Event(entry) => entry,
            record::UsageItem::Rewind { .. } => return Ok(()),
        };
        if tenant.is_none_or(|t| entry.event.tenant() == Some(t)) {
            page.records.push(UsageRecord {
                cursor: lsn,
                event: entry.event,
            });
            if page.records.len() == limit {
                return Err(STOP_REPLAY.to_owned());
            }
        }
        Ok(())
    });
    match read {
        Ok(_) => Ok(()),
        Err(WalError::Replay { message, .. }) if message == STOP_REPLAY => Ok(()),
        Err(e) => Err(e),
    }
}
