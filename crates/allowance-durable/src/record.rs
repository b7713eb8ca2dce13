//! What one log record and one snapshot hold, and their encoding.
//!
//! A record is a version byte followed by the postcard encoding of
//! [`RecordRef`] (the writer's, borrowing what the engine handed over),
//! read back as [`Record`].

use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::Arc;

use allowance_core::{
    Amounts, Catalog, CatalogChange, Committed, Dimension, Labels, LedgerSnapshot,
    MAX_SCOPES_LIMIT, ReservationId, ReserveRequest, ScopeKey, ScopeSet, Timestamp, Usage,
    UsageEvent,
};
use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use smallvec::SmallVec;

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

/// One logged record, as replay reads it (owned). `R` is the reserve
/// request: [`RequestIn`] as decoded, a [`ReserveRequest`] once its names
/// are interned.
#[derive(Debug, Deserialize)]
pub(crate) enum Record<R = Box<ReserveRequest>> {
    Base(Box<Catalog>),
    Change(Change<R>),
}

/// [`Committed`], owned: the same variants in the same order with the same
/// fields, so it decodes what `Committed` encoded (postcard writes a
/// variant's index, then its fields in order, and a `&T` exactly as a `T`;
/// `committed_changes_decode_as_written` below pins it).
#[derive(Debug, Deserialize)]
pub(crate) enum Change<R = Box<ReserveRequest>> {
    Reserve {
        now: Timestamp,
        id: ReservationId,
        req: R,
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

/// A [`ReserveRequest`] as encoded, its names borrowed from the record's
/// bytes: the same fields in the same order (`committed_changes_decode_as_written`
/// pins it), turned into a request by [`Decoder`].
#[derive(Debug, Deserialize)]
pub(crate) struct RequestIn<'a> {
    #[serde(borrow)]
    scopes: ScopeNames<'a>,
    amounts: Amounts,
    #[serde(borrow)]
    model: Option<&'a str>,
    ttl_ms: Option<u64>,
    idempotency_key: Option<Arc<str>>,
    dry_run: bool,
    labels: Option<Labels>,
    report_remaining: bool,
}

/// A request's scope names as encoded (a [`ScopeSet`]: a sequence of
/// canonical names), read no further than [`MAX_SCOPES_LIMIT`] of them.
#[derive(Debug)]
struct ScopeNames<'a>(SmallVec<[&'a str; 4]>);

impl<'de: 'a, 'a> Deserialize<'de> for ScopeNames<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct NamesVisitor<'a>(std::marker::PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for NamesVisitor<'a> {
            type Value = ScopeNames<'a>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("the scope names of a reservation, the tenant first")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut names = SmallVec::new();
                while let Some(name) = seq.next_element::<&'de str>()? {
                    if names.len() == MAX_SCOPES_LIMIT {
                        return Err(de::Error::custom(format!(
                            "scopes: more than {MAX_SCOPES_LIMIT}"
                        )));
                    }
                    names.push(name);
                }
                Ok(ScopeNames(names))
            }
        }

        d.deserialize_seq(NamesVisitor(std::marker::PhantomData))
    }
}

/// Distinct names a [`Decoder`] keeps at most: past this, further new
/// names are allocated per record as without it, so a log of endless
/// distinct names cannot grow the table without bound.
const MAX_INTERNED: usize = 1 << 20;

/// Decodes records, sharing one [`ScopeKey`] (one allocation, checked and
/// hashed once) per distinct scope name and one `Arc<str>` per model name
/// across all of them. Besides the work saved per record, the ledger's
/// scope lookups then find the very key they hold and compare pointers,
/// not names.
#[derive(Default)]
pub(crate) struct Decoder {
    scopes: HashSet<ScopeKey, foldhash::fast::RandomState>,
    models: HashSet<Arc<str>, foldhash::fast::RandomState>,
}

impl Decoder {
    /// Decodes one record; the error says what is wrong.
    pub(crate) fn decode(&mut self, bytes: &[u8]) -> Result<Record, String> {
        let (&version, body) = bytes.split_first().ok_or("an empty record")?;
        if version != FORMAT_VERSION {
            return Err(format!(
                "record format version {version}, this build reads {FORMAT_VERSION}: \
                 start the version of allowance that wrote it"
            ));
        }
        let record: Record<RequestIn<'_>> =
            postcard::from_bytes(body).map_err(|e| format!("undecodable record: {e}"))?;
        let change = match record {
            Record::Base(catalog) => return Ok(Record::Base(catalog)),
            Record::Change(change) => change,
        };
        let change = match change {
            Change::Reserve { now, id, req } => Change::Reserve {
                now,
                id,
                req: Box::new(
                    self.request(req)
                        .map_err(|e| format!("undecodable record: {e}"))?,
                ),
            },
            Change::Settle { now, id, usage } => Change::Settle { now, id, usage },
            Change::Refund { now, id } => Change::Refund { now, id },
            Change::Extend {
                now,
                id,
                amounts,
                ttl_ms,
            } => Change::Extend {
                now,
                id,
                amounts,
                ttl_ms,
            },
            Change::Adjust {
                now,
                scope,
                dimension,
                credit,
                reason,
            } => Change::Adjust {
                now,
                scope: self.intern_key(scope),
                dimension,
                credit,
                reason,
            },
            Change::Admin(change) => Change::Admin(change),
            Change::Tick { now } => Change::Tick { now },
        };
        Ok(Record::Change(change))
    }

    /// The request, its names interned, with the checks its own decoding
    /// makes (each name's syntax, the set's shape).
    fn request(&mut self, req: RequestIn<'_>) -> Result<ReserveRequest, String> {
        let RequestIn {
            scopes,
            amounts,
            model,
            ttl_ms,
            idempotency_key,
            dry_run,
            labels,
            report_remaining,
        } = req;
        let keys = scopes
            .0
            .iter()
            .map(|name| self.scope(name))
            .collect::<Result<Vec<_>, _>>()?;
        let scopes = ScopeSet::from_keys(keys).map_err(|e| e.to_string())?;
        Ok(ReserveRequest {
            scopes,
            amounts,
            model: model.map(|m| self.model(m)),
            ttl_ms,
            idempotency_key,
            dry_run,
            labels,
            report_remaining,
        })
    }

    fn scope(&mut self, name: &str) -> Result<ScopeKey, String> {
        if let Some(key) = self.scopes.get(name) {
            return Ok(key.clone());
        }
        let key = ScopeKey::parse(name).map_err(|e| e.to_string())?;
        if self.scopes.len() < MAX_INTERNED {
            self.scopes.insert(key.clone());
        }
        Ok(key)
    }

    /// An already decoded key, swapped for the interned one if there is one
    /// (so later lookups of it compare pointers too).
    fn intern_key(&mut self, key: ScopeKey) -> ScopeKey {
        match self.scopes.get(key.as_str()) {
            Some(known) => known.clone(),
            None => {
                if self.scopes.len() < MAX_INTERNED {
                    self.scopes.insert(key.clone());
                }
                key
            }
        }
    }

    fn model(&mut self, name: &str) -> Arc<str> {
        if let Some(known) = self.models.get(name) {
            return known.clone();
        }
        let model: Arc<str> = name.into();
        if self.models.len() < MAX_INTERNED {
            self.models.insert(model.clone());
        }
        model
    }
}

/// Decodes one record on its own (no names shared with other records).
#[cfg(test)]
pub(crate) fn decode(bytes: &[u8]) -> Result<Record, String> {
    Decoder::default().decode(bytes)
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
    // A plan returned to the file's version: the file's wins again, as if
    // the API had never set it (so a later edit of the file takes effect).
    if let C::RevertPlan(name) = change {
        overlay.retain(|old| !matches!(old, C::SetPlan(p) if p.name() == name.as_str()));
        return;
    }
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

/// A record of the usage log: an event, or a rewind. (Decoded one at a
/// time and consumed at once: the size difference costs nothing.)
#[allow(clippy::large_enum_variant)]
pub(crate) enum UsageItem {
    Event(UsageEntry),
    /// Written at a start that found the usage log ahead of the main log
    /// (events of main records a power loss or a cut tail took from it):
    /// the usage log goes on from main record `main_lsn`, so the events of
    /// the records the main log writes next (with those lsns again) are
    /// regenerated after a crash rather than taken as present. Not an
    /// event: the export skips it (its cursor is spent).
    Rewind {
        main_lsn: u64,
    },
}

/// The first byte of a rewind record, where an event has the format
/// version.
const REWIND_TAG: u8 = 0xfe;

/// A rewind record to the main log's record `main_lsn`.
pub(crate) fn encode_rewind(main_lsn: u64) -> Vec<u8> {
    let mut out = vec![REWIND_TAG];
    out.extend_from_slice(&main_lsn.to_le_bytes());
    out
}

/// Decodes a usage record.
pub(crate) fn decode_usage(bytes: &[u8]) -> Result<UsageItem, String> {
    let (&version, body) = bytes.split_first().ok_or("an empty usage record")?;
    if version == REWIND_TAG {
        let lsn: [u8; 8] = body
            .try_into()
            .map_err(|_| "a rewind record of the wrong length".to_string())?;
        return Ok(UsageItem::Rewind {
            main_lsn: u64::from_le_bytes(lsn),
        });
    }
    if version != FORMAT_VERSION {
        return Err(format!(
            "usage record format version {version}, this build reads {FORMAT_VERSION}"
        ));
    }
    postcard::from_bytes(body)
        .map(UsageItem::Event)
        .map_err(|e| format!("undecodable usage record: {e}"))
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
        // Every field away from its default: the decoder's own copy of the
        // request's layout must read each one where it was written.
        req.idempotency_key = Some("k".into());
        req.model = Some("gpt-4o".into());
        req.ttl_ms = Some(30_000);
        req.dry_run = true;
        req.labels = Some(vec![("team".to_owned(), "search".to_owned())].into());
        req.report_remaining = true;
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
                    (&r.amounts, &r.idempotency_key, &r.model, r.ttl_ms),
                    (&req.amounts, &req.idempotency_key, &req.model, req.ttl_ms)
                );
                assert_eq!(
                    (&r.labels, r.dry_run, r.report_remaining),
                    (&req.labels, req.dry_run, req.report_remaining)
                );
                assert_eq!(r.scopes, req.scopes);
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

    fn reserve_bytes(catalog: &allowance_core::Catalog, tenant: &str, user: &str) -> Vec<u8> {
        let scopes = catalog
            .scope_set(tenant, &[("user", user), ("tool", "search")])
            .expect("scopes");
        let mut req = ReserveRequest::new(scopes, Amounts::new().with(Dimension::TOKENS, 7));
        req.model = Some("gpt-4o".into());
        let change = Committed::Reserve {
            now: Timestamp::from_millis(1_000),
            id: ReservationId::mint(42, tenant),
            req: &req,
        };
        with_encoded(&RecordRef::Change(&change), <[u8]>::to_vec).expect("encode")
    }

    fn decoded_request(decoder: &mut Decoder, bytes: &[u8]) -> Box<ReserveRequest> {
        match decoder.decode(bytes).expect("decode") {
            Record::Change(Change::Reserve { req, .. }) => req,
            other => panic!("a reserve decoded as {other:?}"),
        }
    }

    /// One decoder hands out one allocation per distinct name: the second
    /// record's keys and model are the first's.
    #[test]
    fn a_decoder_shares_names_across_records() {
        let catalog = allowance_conformance::catalogs::standard();
        let mut decoder = Decoder::default();
        let a = decoded_request(&mut decoder, &reserve_bytes(&catalog, "acme", "bob"));
        let b = decoded_request(&mut decoder, &reserve_bytes(&catalog, "acme", "bob"));
        let c = decoded_request(&mut decoder, &reserve_bytes(&catalog, "acme", "eve"));
        for (x, y) in a.scopes.as_slice().iter().zip(b.scopes.as_slice()) {
            assert_eq!(x, y);
            assert_eq!(
                x.as_str().as_ptr(),
                y.as_str().as_ptr(),
                "{x} allocated twice"
            );
        }
        let (a_model, b_model) = (a.model.expect("model"), b.model.expect("model"));
        assert_eq!(a_model.as_ptr(), b_model.as_ptr());
        // The tenant and the shared tool are shared; the other user is not.
        let (a_keys, c_keys) = (a.scopes.as_slice(), c.scopes.as_slice());
        assert_eq!(a_keys[0].as_str().as_ptr(), c_keys[0].as_str().as_ptr());
        assert_eq!(a_keys[2].as_str().as_ptr(), c_keys[2].as_str().as_ptr());
        assert_eq!(c_keys[1].as_str(), "tenant:acme/user:eve");
    }

    /// An interned name is checked as a decoded one is: a bad name or a
    /// scope of another tenant makes the record undecodable, not a request.
    #[test]
    fn bad_names_in_a_reserve_are_refused() {
        let catalog = allowance_conformance::catalogs::standard();
        let good = reserve_bytes(&catalog, "acme", "bob");
        let replace = |from: &str, to: &str| {
            assert_eq!(from.len(), to.len());
            let at = good
                .windows(from.len())
                .position(|w| w == from.as_bytes())
                .expect("the name is in the record");
            let mut bad = good.clone();
            bad[at..at + to.len()].copy_from_slice(to.as_bytes());
            bad
        };
        for (from, to) in [
            ("tenant:acme/user:bob", "tenant:acme/user:b b"),
            ("tenant:acme/user:bob", "tenant:acmf/user:bob"),
            ("tool:search", "tool:sea/ch"),
        ] {
            // A decoder that knows the good names checks the new ones.
            let mut decoder = Decoder::default();
            decoded_request(&mut decoder, &good);
            let err = decoder
                .decode(&replace(from, to))
                .expect_err("a bad name is refused");
            assert!(err.starts_with("undecodable record: "), "{to}: {err}");
        }
    }
}
