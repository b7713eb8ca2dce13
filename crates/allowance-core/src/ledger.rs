//! [`Ledger`]: the deterministic, single-threaded state machine.

use std::sync::Arc;

use smallvec::smallvec;

use crate::catalog::Catalog;
use crate::error::{AdminError, ExtendError, RefundError, ReserveError, SettleError};
use crate::invariants;
use crate::ops::{Locked, Router};
use crate::reservation::{Granted, Reservation, ReservationId, ReserveRequest, ScopeStatus, Usage};
use crate::scope::ScopeKey;
use crate::shard::{Shard, ShardState};
use crate::units::{Amounts, Dimension, Timestamp};

/// The reservation ledger: every rule of SEMANTICS.md as a deterministic
/// state machine. Every transition takes `now` and reads no clock, does no
/// I/O; ids are made by the caller. Not thread-safe by itself: share it with
/// [`SharedLedger`](crate::SharedLedger).
///
/// Time never goes backwards inside a ledger: an operation with an earlier
/// `now` than one already seen runs at the later instant.
#[derive(Debug)]
pub struct Ledger {
    shard: Shard,
}

impl Ledger {
    /// An empty ledger configured by `catalog`.
    pub fn new(catalog: Catalog) -> Self {
        Ledger {
            shard: Shard {
                catalog: Arc::new(catalog),
                st: ShardState::default(),
                copy_to: None,
            },
        }
    }

    /// The configuration in force.
    pub fn catalog(&self) -> &Catalog {
        &self.shard.catalog
    }

    /// Changes the configuration (plans, overrides, models, kinds): effective
    /// for the next operation. `f` sees a copy; an error changes nothing.
    pub fn update_catalog<R, E>(
        &mut self,
        f: impl FnOnce(&mut Catalog) -> Result<R, E>,
    ) -> Result<R, E> {
        let mut next = (*self.shard.catalog).clone();
        let r = f(&mut next)?;
        self.shard.catalog = Arc::new(next);
        Ok(r)
    }

    fn locked(&mut self) -> Locked<'_> {
        let Shard { catalog, st, .. } = &mut self.shard;
        Locked {
            catalog,
            parts: smallvec![(0, st)],
            home: 0,
            router: Router::new(1),
        }
    }

    /// Holds `req.amounts` on every scope of the request, all or nothing.
    pub fn reserve(
        &mut self,
        now: Timestamp,
        id: ReservationId,
        req: &ReserveRequest,
    ) -> Result<Granted, ReserveError> {
        self.locked().reserve(now, id, req)
    }

    /// Records the actual usage (per the overrun policy) and releases the
    /// hold; a repeat answers the same.
    pub fn settle(
        &mut self,
        now: Timestamp,
        id: ReservationId,
        usage: &Usage,
    ) -> Result<&Reservation, SettleError> {
        let i = self.locked().settle(now, id, usage)?;
        Ok(&self.shard.st.records.at(i).res)
    }

    /// Releases the hold and records nothing; a repeat answers the same.
    pub fn refund(
        &mut self,
        now: Timestamp,
        id: ReservationId,
    ) -> Result<&Reservation, RefundError> {
        let i = self.locked().refund(now, id)?;
        Ok(&self.shard.st.records.at(i).res)
    }

    /// Raises the hold by `amounts` (all or nothing) and/or sets
    /// `expires_at = now + ttl_ms`.
    pub fn extend(
        &mut self,
        now: Timestamp,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Result<&Reservation, ExtendError> {
        let i = self.locked().extend(now, id, amounts, ttl_ms)?;
        Ok(&self.shard.st.records.at(i).res)
    }

    /// A reservation as of `now` (expiry observed).
    pub fn get(&mut self, now: Timestamp, id: ReservationId) -> Option<&Reservation> {
        let i = self.locked().get(now, id)?;
        Some(&self.shard.st.records.at(i).res)
    }

    /// A scope's limits as of `now`; a scope never used answers its plan
    /// with zero use.
    pub fn status(&mut self, now: Timestamp, scope: &ScopeKey) -> ScopeStatus {
        self.locked().status(now, scope)
    }

    /// An admin credit (positive: room grows) or debit on the scope's
    /// `total` limits of `dimension`.
    pub fn adjust(
        &mut self,
        now: Timestamp,
        scope: &ScopeKey,
        dimension: Dimension,
        credit: i64,
    ) -> Result<ScopeStatus, AdminError> {
        self.locked().adjust(now, scope, dimension, credit)
    }

    /// Expires every hold due at `now`, forgets what passed its retention and
    /// drops idle scopes. Returns the number of reservations expired so far.
    pub fn expire_due(&mut self, now: Timestamp) -> u64 {
        let Shard { catalog, st, .. } = &mut self.shard;
        st.observe(catalog, now.as_millis(), usize::MAX);
        st.expired_count
    }

    /// Number of scopes with state in memory.
    pub fn scope_count(&self) -> usize {
        self.shard.st.index.len()
    }

    /// Number of reservations remembered (held, and ended within retention).
    pub fn reservation_count(&self) -> usize {
        self.shard.st.records.len()
    }

    /// Number of HELD reservations.
    pub fn held_count(&self) -> usize {
        self.shard.st.expiry.len()
    }

    /// Bytes of heap the scopes' states use, beyond the map's own table
    /// (for the memory benchmark).
    pub fn scope_heap_bytes(&self) -> usize {
        let st = &self.shard.st;
        st.scopes
            .iter()
            .flatten()
            .map(|s| s.key.as_str().len() + 16 + s.heap_bytes())
            .sum()
    }

    /// Checks the invariants of SEMANTICS.md (as of the last instant observed).
    pub fn check_invariants(&self) -> Result<(), String> {
        invariants::check_shard(0, &self.shard.st)
    }
}
