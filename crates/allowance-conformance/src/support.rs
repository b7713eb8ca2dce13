//! Small helpers that keep the cases reading like scripts: each wraps one
//! [`Store`](allowance_core::Store) call and panics with what was attempted
//! when the answer is not the expected kind.

use allowance_core::{
    Amounts, Charge, Denial, Dimension, ExtendError, LimitStatus, RefundError, Reservation,
    ReservationId, ReserveError, ReserveRequest, ScopeKey, ScopeSet, ScopeStatus, SettleError,
    StoreError, Timestamp, Usage, WindowKind,
};

use crate::Harness;
use crate::catalogs::START_MS;

/// `tokens: n`.
pub(crate) fn tokens(n: u64) -> Amounts {
    Amounts::new().with(Dimension::TOKENS, n)
}

/// `cost_micros: n`.
pub(crate) fn cost(n: u64) -> Amounts {
    Amounts::new().with(Dimension::COST_MICROS, n)
}

/// Usage of `amounts`, with no cached input and no charges.
pub(crate) fn usage(amounts: Amounts) -> Usage {
    Usage {
        amounts,
        ..Usage::default()
    }
}

/// A tool charge.
pub(crate) fn charge(name: &str, cost_micros: u64, amounts: Amounts) -> Charge {
    Charge {
        name: name.to_string(),
        cost_micros,
        amounts,
    }
}

/// The instant `ms` after the start of every case.
pub(crate) fn at(ms: u64) -> Timestamp {
    Timestamp::from_millis(START_MS + ms)
}

/// A canonical scope name, parsed.
pub(crate) fn key(name: &str) -> ScopeKey {
    ScopeKey::parse(name).unwrap_or_else(|e| panic!("bad scope name {name:?} in a case: {e}"))
}

/// An id no store minted (for "not found" answers).
pub(crate) fn unknown_id(tenant: &str) -> ReservationId {
    ReservationId::mint(0x5eed_0000_0000_0000_0000_0000_0000_0000, tenant)
}

impl Harness {
    /// Sets the clock to `ms` after the case's start.
    pub(crate) fn set_ms(&self, ms: u64) {
        self.clock.set(at(ms));
    }

    /// Moves the clock forward by `ms`.
    pub(crate) fn advance_ms(&self, ms: u64) {
        self.clock.advance_ms(ms);
    }

    /// The scopes of a request, built from the store's catalog.
    pub(crate) async fn scopes(&self, tenant: &str, others: &[(&str, &str)]) -> ScopeSet {
        let catalog = self
            .store
            .catalog()
            .await
            .expect("catalog: store unavailable");
        catalog
            .scope_set(tenant, others)
            .unwrap_or_else(|e| panic!("scopes {tenant} {others:?}: {e}"))
    }

    /// A request for `amounts` on `tenant` and `others`.
    pub(crate) async fn request(
        &self,
        tenant: &str,
        others: &[(&str, &str)],
        amounts: Amounts,
    ) -> ReserveRequest {
        ReserveRequest::new(self.scopes(tenant, others).await, amounts)
    }

    /// Reserves, expecting a grant.
    pub(crate) async fn reserve(&self, req: &ReserveRequest) -> allowance_core::Granted {
        match self.store.reserve(req).await {
            Ok(g) => g,
            Err(e) => panic!(
                "reserve {:?} on {:?} should be granted, got {e:?}",
                req.amounts,
                req.scopes.as_slice()
            ),
        }
    }

    /// Reserves `amounts` on `tenant` and `others`, expecting a grant;
    /// answers the id.
    pub(crate) async fn hold(
        &self,
        tenant: &str,
        others: &[(&str, &str)],
        amounts: Amounts,
    ) -> ReservationId {
        let req = self.request(tenant, others, amounts).await;
        self.reserve(&req).await.id
    }

    /// Reserves then settles `amounts` at once: usage in every window.
    pub(crate) async fn spend(&self, tenant: &str, others: &[(&str, &str)], amounts: Amounts) {
        let id = self.hold(tenant, others, amounts.clone()).await;
        self.settle(id, &usage(amounts)).await;
    }

    /// Reserves, expecting a denial.
    pub(crate) async fn deny(&self, req: &ReserveRequest) -> Denial {
        match self.store.reserve(req).await {
            Err(StoreError::Rejected(ReserveError::Denied(d))) => *d,
            other => panic!(
                "reserve {:?} on {:?} should be denied, got {other:?}",
                req.amounts,
                req.scopes.as_slice()
            ),
        }
    }

    /// Reserves, expecting a bad-request answer; returns the field named.
    pub(crate) async fn reserve_invalid(&self, req: &ReserveRequest) -> String {
        match self.store.reserve(req).await {
            Err(StoreError::Rejected(ReserveError::Invalid(i))) => i.field,
            other => panic!(
                "reserve {:?} on {:?} should be invalid, got {other:?}",
                req.amounts,
                req.scopes.as_slice()
            ),
        }
    }

    /// Settles, expecting success.
    pub(crate) async fn settle(&self, id: ReservationId, u: &Usage) -> Reservation {
        self.store
            .settle(id, u)
            .await
            .unwrap_or_else(|e| panic!("settle {id} with {u:?} should succeed, got {e:?}"))
    }

    /// Settles, expecting an error.
    pub(crate) async fn settle_err(&self, id: ReservationId, u: &Usage) -> SettleError {
        match self.store.settle(id, u).await {
            Err(StoreError::Rejected(e)) => e,
            other => panic!("settle {id} with {u:?} should be refused, got {other:?}"),
        }
    }

    /// Refunds, expecting success.
    pub(crate) async fn refund(&self, id: ReservationId) -> Reservation {
        self.store
            .refund(id)
            .await
            .unwrap_or_else(|e| panic!("refund {id} should succeed, got {e:?}"))
    }

    /// Refunds, expecting an error.
    pub(crate) async fn refund_err(&self, id: ReservationId) -> RefundError {
        match self.store.refund(id).await {
            Err(StoreError::Rejected(e)) => e,
            other => panic!("refund {id} should be refused, got {other:?}"),
        }
    }

    /// Extends, expecting success.
    pub(crate) async fn extend(
        &self,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> Reservation {
        self.store
            .extend(id, amounts, ttl_ms)
            .await
            .unwrap_or_else(|e| panic!("extend {id} by {amounts:?}, ttl {ttl_ms:?}: {e:?}"))
    }

    /// Extends, expecting an error.
    pub(crate) async fn extend_err(
        &self,
        id: ReservationId,
        amounts: Option<&Amounts>,
        ttl_ms: Option<u64>,
    ) -> ExtendError {
        match self.store.extend(id, amounts, ttl_ms).await {
            Err(StoreError::Rejected(e)) => e,
            other => panic!(
                "extend {id} by {amounts:?}, ttl {ttl_ms:?} should be refused, got {other:?}"
            ),
        }
    }

    /// A reservation that must exist.
    pub(crate) async fn get(&self, id: ReservationId) -> Reservation {
        self.store
            .get(id)
            .await
            .expect("get: store unavailable")
            .unwrap_or_else(|| panic!("reservation {id} should exist"))
    }

    /// A scope's status, by canonical name.
    pub(crate) async fn status(&self, scope: &str) -> ScopeStatus {
        self.store
            .status(&key(scope))
            .await
            .expect("status: store unavailable")
    }

    /// The statuses of several scopes (to compare before and after).
    pub(crate) async fn statuses(&self, scopes: &[&str]) -> Vec<ScopeStatus> {
        let mut out = Vec::with_capacity(scopes.len());
        for s in scopes {
            out.push(self.status(s).await);
        }
        out
    }

    /// The limit of `dimension` with a window of `window` on a scope.
    pub(crate) async fn limit(
        &self,
        scope: &str,
        dimension: &str,
        window: WindowKind,
    ) -> LimitStatus {
        let st = self.status(scope).await;
        st.limits
            .iter()
            .find(|l| l.dimension == dimension && l.window.kind() == window)
            .cloned()
            .unwrap_or_else(|| panic!("{scope} has no {window} limit on {dimension}: {st:?}"))
    }

    /// `(used, held, remaining)` of a limit.
    pub(crate) async fn figures(
        &self,
        scope: &str,
        dimension: &str,
        window: WindowKind,
    ) -> (i64, u64, i64) {
        let l = self.limit(scope, dimension, window).await;
        (l.used, l.held, l.remaining)
    }
}
