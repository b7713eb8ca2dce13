//! What one log record and one snapshot hold, and their encoding.
//!
//! A record is a version byte followed by the postcard encoding of
//! [`RecordRef`] (the writer's, borrowing what the engine handed over),
//! read back as [`Record`].

use std::cell::RefCell;

use allowance_core::{
    Amounts, Catalog, CatalogChange, Committed, Dimension, LedgerSnapshot, ReservationId,
    ReserveRequest, ScopeKey, Timestamp, Usage, UsageEvent,
};
use serde::{Deserialize, Serialize};

/// The version of the record and snapshot encodings. A reader refuses a
/// version it does not know rather than guessing.
pub const FORMAT_VERSION: u8 = 1;

/// One logged record, as the writer sees it (borrowed): the change the
/// engine committed is encoded as it is handed over ([`Committed`] derives
/// `Serialize`), so there is no second description of it to keep in step.
#[derive(Serialize)]
pub(crate) enum RecordRef<'a> {
    /// The configuration file's catalog, logged when a log starts and
    /// whenever a start finds the file changed: replay resets the catalog to
    /// it, with the admin changes in force applied on top.
    Base(&'a Catalog),
    /// A change the ledger applied.
    Change(&'a Committed<'a>),
}

/// One logged record, as replay reads it (owned).
#[derive(Debug, Deserialize)]
pub(crate) enum Record {
    Base(Box<Catalog>),
    Change(Change),
}

/// [`Committed`], owned: the same variants in the same order with the same
/// fields, so it decodes what `Committed` encoded (postcard writes a
/// variant's index, then its fields in order, and a `&T` exactly as a `T`;
/// `committed_changes_decode_as_written` below pins it).
#[derive(Debug, Deserialize)]
pub(crate) enum Change {
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

thread_local! {
    /// Each thread reuses one buffer: encoding a record allocates nothing
    /// once the buffer has grown to the largest record seen.
    static BUFFER: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Encodes `value` (version byte first) and hands the bytes to `f`
/// (which appends them to a log).
pub(crate) fn with_encoded<T: Serialize + ?Sized, R>(
    value: &T,
    f: impl FnOnce(&[u8]) -> R,
) -> Result<R, postcard::Error> {
    BUFFER.with(|b| {
        let mut buf = std::mem::take(&mut *b.borrow_mut());
        buf.clear();
        buf.push(FORMAT_VERSION);
        postcard::to_extend(value, buf).map(|buf| {
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

#[cfg(test)]
mod tests {
    use allowance_core::{Committed, Dimension, Override, ReservationId, Usage};

    use super::*;

    fn round_trip(change: &Committed<'_>) -> Change {
        let bytes = with_encoded(&RecordRef::Change(change), <[u8]>::to_vec).expect("encode");
        match decode(&bytes).expect("decode") {
            Record::Change(c) => c,
            Record::Base(_) => panic!("a change decoded as a base record"),
        }
    }

    /// Every variant of `Committed` decodes as the `Change` of the same
    /// name with the same fields: the two enums stay in step.
    #[test]
    fn committed_changes_decode_as_written() {
        let catalog = allowance_conformance::catalogs::standard();
        let scopes = catalog
            .scope_set("acme", &[("user", "bob")])
            .expect("scopes");
        let scope = scopes.tenant().clone();
        let mut req = ReserveRequest::new(scopes, Amounts::new().with(Dimension::TOKENS, 7));
        req.idempotency_key = Some("k".into());
        let id = ReservationId::mint(42, "acme");
        let now = Timestamp::from_millis(1_000);
        let usage = Usage {
            amounts: Amounts::new().with(Dimension::TOKENS, 5),
            ..Usage::default()
        };
        let amounts = Amounts::new().with(Dimension::TOKENS, 9);
        let admin = CatalogChange::SetOverride(scope.clone(), Override::Plan("plus".into()));

        match round_trip(&Committed::Reserve { now, id, req: &req }) {
            Change::Reserve {
                now: n,
                id: i,
                req: r,
            } => {
                assert_eq!((n, i), (now, id));
                assert_eq!(
                    (&r.amounts, &r.idempotency_key),
                    (&req.amounts, &req.idempotency_key)
                );
                assert!(r.scopes.same_scopes(&req.scopes));
            }
            other => panic!("reserve decoded as {other:?}"),
        }
        match round_trip(&Committed::Settle {
            now,
            id,
            usage: &usage,
        }) {
            Change::Settle {
                now: n,
                id: i,
                usage: u,
            } => assert_eq!((n, i, *u), (now, id, usage.clone())),
            other => panic!("settle decoded as {other:?}"),
        }
        match round_trip(&Committed::Refund { now, id }) {
            Change::Refund { now: n, id: i } => assert_eq!((n, i), (now, id)),
            other => panic!("refund decoded as {other:?}"),
        }
        match round_trip(&Committed::Extend {
            now,
            id,
            amounts: Some(&amounts),
            ttl_ms: Some(60_000),
        }) {
            Change::Extend {
                now: n,
                id: i,
                amounts: a,
                ttl_ms: t,
            } => {
                assert_eq!((n, i, a, t), (now, id, Some(amounts.clone()), Some(60_000)));
            }
            other => panic!("extend decoded as {other:?}"),
        }
        let adjust = Committed::Adjust {
            now,
            scope: &scope,
            dimension: Dimension::COST_MICROS,
            credit: -3,
            reason: "why",
        };
        match round_trip(&adjust) {
            Change::Adjust {
                now: n,
                scope: s,
                dimension: d,
                credit: c,
                reason: r,
            } => {
                assert_eq!(
                    (n, s, d, c, r.as_str()),
                    (now, scope.clone(), Dimension::COST_MICROS, -3, "why")
                );
            }
            other => panic!("adjust decoded as {other:?}"),
        }
        match round_trip(&Committed::Catalog(&admin)) {
            Change::Admin(c) => assert!(
                matches!(*c, CatalogChange::SetOverride(ref s, Override::Plan(ref p)) if *s == scope && p == "plus")
            ),
            other => panic!("admin change decoded as {other:?}"),
        }
        match round_trip(&Committed::Tick { now }) {
            Change::Tick { now: n } => assert_eq!(n, now),
            other => panic!("tick decoded as {other:?}"),
        }
    }
}
