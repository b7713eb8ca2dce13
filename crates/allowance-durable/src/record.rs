//! What one log record and one snapshot hold, and their encoding.
//!
//! A record is a version byte followed by the postcard encoding of
//! [`Record`]. The writing side serializes [`RecordRef`], which borrows
//! what the engine handed over; the two enums have the same variants in the
//! same order with the same fields, so their encodings are the same (postcard
//! writes a variant's index, then its fields in order, and a `&T` exactly as
//! a `T`). A test pins that.

use std::cell::RefCell;

use allowance_core::{
    Amounts, Catalog, CatalogChange, Committed, Dimension, LedgerSnapshot, ReservationId,
    ReserveRequest, ScopeKey, Timestamp, Usage, UsageEvent,
};
use serde::{Deserialize, Serialize};

/// The version of the record and snapshot encodings. A reader refuses a
/// version it does not know rather than guessing.
pub const FORMAT_VERSION: u8 = 1;

/// One logged change, as the writer sees it (borrowed).
#[derive(Serialize)]
pub(crate) enum RecordRef<'a> {
    /// The configuration file's catalog, logged when a log starts and
    /// whenever a start finds the file changed: replay resets the catalog to
    /// it, with the admin changes in force applied on top.
    Base(&'a Catalog),
    Reserve {
        now: Timestamp,
        id: ReservationId,
        req: &'a ReserveRequest,
    },
    Settle {
        now: Timestamp,
        id: ReservationId,
        usage: &'a Usage,
    },
    Refund {
        now: Timestamp,
        id: ReservationId,
    },
    Extend {
        now: Timestamp,
        id: ReservationId,
        amounts: Option<&'a Amounts>,
        ttl_ms: Option<u64>,
    },
    Adjust {
        now: Timestamp,
        scope: &'a ScopeKey,
        dimension: Dimension,
        credit: i64,
        reason: &'a str,
    },
    Admin(&'a CatalogChange),
    /// Every shard observed `now` and reported its expiries.
    Tick {
        now: Timestamp,
    },
}

/// One logged change, as replay reads it (owned).
#[derive(Debug, Deserialize)]
pub(crate) enum Record {
    Base(Box<Catalog>),
    Reserve {
        now: Timestamp,
        id: ReservationId,
        req: Box<ReserveRequest>,
    },
    Settle {
        now: Timestamp,
        id: ReservationId,
        usage: Box<Usage>,
    },
    Refund {
        now: Timestamp,
        id: ReservationId,
    },
    Extend {
        now: Timestamp,
        id: ReservationId,
        amounts: Option<Amounts>,
        ttl_ms: Option<u64>,
    },
    Adjust {
        now: Timestamp,
        scope: ScopeKey,
        dimension: Dimension,
        credit: i64,
        reason: String,
    },
    Admin(Box<CatalogChange>),
    Tick {
        now: Timestamp,
    },
}

impl<'a> From<&Committed<'a>> for RecordRef<'a> {
    fn from(c: &Committed<'a>) -> Self {
        match *c {
            Committed::Reserve { now, id, req } => RecordRef::Reserve { now, id, req },
            Committed::Settle { now, id, usage } => RecordRef::Settle { now, id, usage },
            Committed::Refund { now, id } => RecordRef::Refund { now, id },
            Committed::Extend {
                now,
                id,
                amounts,
                ttl_ms,
            } => RecordRef::Extend {
                now,
                id,
                amounts,
                ttl_ms,
            },
            Committed::Adjust {
                now,
                scope,
                dimension,
                credit,
                reason,
            } => RecordRef::Adjust {
                now,
                scope,
                dimension,
                credit,
                reason,
            },
            Committed::Catalog(change) => RecordRef::Admin(change),
            Committed::Tick { now } => RecordRef::Tick { now },
        }
    }
}

thread_local! {
    /// Each thread reuses one buffer: encoding a record allocates nothing
    /// once the buffer has grown to the largest record seen.
    static BUFFER: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Encodes `record` and hands the bytes to `f` (which appends them).
pub(crate) fn with_encoded<R>(
    record: &RecordRef<'_>,
    f: impl FnOnce(&[u8]) -> R,
) -> Result<R, postcard::Error> {
    BUFFER.with(|b| {
        let mut buf = std::mem::take(&mut *b.borrow_mut());
        buf.clear();
        buf.push(FORMAT_VERSION);
        postcard::to_extend(record, buf).map(|buf| {
            let r = f(&buf);
            *b.borrow_mut() = buf;
            r
        })
    })
}

/// Decodes one record; the error says what is wrong.
pub(crate) fn decode(bytes: &[u8]) -> Result<Record, String> {
    let (&version, body) = bytes.split_first().ok_or("an empty record")?;
    if version != FORMAT_VERSION {
        return Err(format!(
            "record format version {version}, this build reads {FORMAT_VERSION}: \
             start the version of allowance that wrote it"
        ));
    }
    postcard::from_bytes(body).map_err(|e| format!("undecodable record: {e}"))
}

/// What a snapshot file holds besides the log position in its name.
#[derive(Serialize, Deserialize)]
pub(crate) struct SnapshotBody {
    /// The configuration file's catalog in force when it was taken.
    pub(crate) base: Catalog,
    /// The admin changes in force, oldest first (superseded ones dropped).
    pub(crate) overlay: Vec<CatalogChange>,
    /// The ledger itself (its catalog is `base` with `overlay` applied).
    pub(crate) ledger: LedgerSnapshot,
}

/// Encodes a snapshot body (version byte first).
pub(crate) fn encode_snapshot(body: &SnapshotBody) -> Result<Vec<u8>, postcard::Error> {
    postcard::to_extend(body, vec![FORMAT_VERSION])
}

/// Decodes a snapshot body.
pub(crate) fn decode_snapshot(bytes: &[u8]) -> Result<SnapshotBody, String> {
    let (&version, body) = bytes.split_first().ok_or("an empty snapshot")?;
    if version != FORMAT_VERSION {
        return Err(format!(
            "snapshot format version {version}, this build reads {FORMAT_VERSION}"
        ));
    }
    postcard::from_bytes(body).map_err(|e| format!("undecodable snapshot: {e}"))
}

/// Adds an admin change to the list in force, dropping what it supersedes,
/// so the list stays as small as the changes that still matter.
pub(crate) fn push_overlay(overlay: &mut Vec<CatalogChange>, change: &CatalogChange) {
    use CatalogChange as C;
    // Dimension numbers follow the order dimensions were added: an existing
    // one keeps its place (adding it again is a no-op anyway).
    if let C::AddDimension(name) = change {
        if !overlay
            .iter()
            .any(|old| matches!(old, C::AddDimension(n) if n == name))
        {
            overlay.push(change.clone());
        }
        return;
    }
    let supersedes = |old: &C| match (old, change) {
        (C::SetPlan(a), C::SetPlan(b)) => a.name() == b.name(),
        (
            C::SetOverride(a, _) | C::ClearOverride(a),
            C::SetOverride(b, _) | C::ClearOverride(b),
        ) => a == b,
        (C::SetModel(a, _), C::SetModel(b, _)) => a == b,
        _ => false,
    };
    overlay.retain(|old| !supersedes(old));
    overlay.push(change.clone());
}

/// One record of the usage log (`data_dir/usage/`): an event with the main
/// log's record it came from, so recovery knows which events to regenerate.
#[derive(Serialize)]
pub(crate) struct UsageEntryRef<'a> {
    /// The main log's lsn of the operation that produced the event.
    pub(crate) main_lsn: u64,
    /// Its place among that operation's events.
    pub(crate) index: u32,
    pub(crate) event: &'a UsageEvent,
}

/// [`UsageEntryRef`], as read back.
#[derive(Deserialize)]
pub(crate) struct UsageEntry {
    pub(crate) main_lsn: u64,
    pub(crate) index: u32,
    pub(crate) event: UsageEvent,
}

/// Decodes a usage entry.
pub(crate) fn decode_usage(bytes: &[u8]) -> Result<UsageEntry, String> {
    let (&version, body) = bytes.split_first().ok_or("an empty usage record")?;
    if version != FORMAT_VERSION {
        return Err(format!(
            "usage record format version {version}, this build reads {FORMAT_VERSION}"
        ));
    }
    postcard::from_bytes(body).map_err(|e| format!("undecodable usage record: {e}"))
}

/// Encodes a usage entry and hands the bytes to `f`.
pub(crate) fn with_encoded_usage<R>(
    entry: &UsageEntryRef<'_>,
    f: impl FnOnce(&[u8]) -> R,
) -> Result<R, postcard::Error> {
    BUFFER.with(|b| {
        let mut buf = std::mem::take(&mut *b.borrow_mut());
        buf.clear();
        buf.push(FORMAT_VERSION);
        postcard::to_extend(entry, buf).map(|buf| {
            let r = f(&buf);
            *b.borrow_mut() = buf;
            r
        })
    })
}
