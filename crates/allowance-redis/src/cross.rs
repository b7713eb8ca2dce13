//! Reservations across hash slots, on a Redis Cluster: a shared scope lives
//! in its own group's slot, so a reservation on one is made by more than
//! one script.
//!
//! - **reserve** — each shared group holds its scopes first (`fhold`),
//!   then the tenant's script checks the tenant's scopes and writes the
//!   record. A refusal anywhere releases what was held (`fend release`)
//!   before it answers, so a refused reservation leaves no hold behind;
//!   until then a hold may briefly stand without its reservation. When
//!   several groups refuse, the binding denial is chosen among the refusals
//!   seen, with the rule of SEMANTICS.md — a shared scope's refusal can
//!   hide a tenant scope's, which one script would have weighed too.
//! - **settle, refund** — the tenant's script ends the reservation and
//!   lists it as pending; then each shared group records the charges and
//!   releases its hold (`fend`, idempotent by id), and the pending mark is
//!   cleared. If the instance dies in between, any instance's sweeper
//!   finishes the work from the record: usage is never lost, only late.
//! - **extend** — the shared groups raise (checking) first, then the
//!   tenant; a refusal takes the raises back.
//! - **expiry** — each group expires its own holds at the expiry it
//!   computed (within the few ms between the scripts).

use std::collections::BTreeMap;

use allowance_core::{
    Amounts, Catalog, ExtendError, Granted, ReservationId, ReserveError, ScopeKey, Status,
    StoreError, Timestamp, Unavailable, WindowKind,
};

use crate::wire::{DenyOut, LimOut, Rec, Reply, ScopeSpec, named, recorded};
use crate::{RedisStore, sat};

/// The shared groups among `specs`: each base with the indexes of its scopes.
pub(crate) fn shared_groups(specs: &[ScopeSpec]) -> Vec<(String, Vec<usize>)> {
    let mut groups: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, s) in specs.iter().enumerate() {
        if is_shared_base(&s.b) {
            groups.entry(&s.b).or_default().push(i);
        }
    }
    groups
        .into_iter()
        .map(|(b, idx)| (b.to_string(), idx))
        .collect()
}

/// A denial's scope number (1-based) within one script's scopes, as a
/// number within the whole reservation's.
fn global_scope(idx: &[usize], s: usize) -> usize {
    idx[s.wrapping_sub(1).min(idx.len() - 1)] + 1
}

pub(crate) fn is_shared_base(base: &str) -> bool {
    base.contains("{s")
}

/// The binding denial among those seen (`s` already global, 1-based).
fn binding(denials: Vec<DenyOut>) -> Option<DenyOut> {
    let rank = |k: &str| match k {
        "exceeds" => 2,
        "budget" => 1,
        _ => 0,
    };
    let mut best: Option<DenyOut> = None;
    for d in denials {
        let beats = match &best {
            None => true,
            Some(b) if rank(&d.kind) != rank(&b.kind) => rank(&d.kind) > rank(&b.kind),
            Some(b) if d.kind == "rate" && d.ra != b.ra => d.ra > b.ra,
            // Ties go to the earlier scope, then the earlier limit.
            Some(b) => (d.s, d.l) < (b.s, b.l),
        };
        if beats {
            best = Some(d);
        }
    }
    best
}

/// A release of a refused reservation's shared holds that is not known to
/// have landed: registered before it is sent, so that neither a group that
/// does not answer nor a request cancelled mid-release (a client gone, a
/// deadline) leaves the hold standing until its TTL; the sweeper sends it
/// again ([`RedisStore::sweep_cross`]) until it lands or the hold it undoes
/// has expired in its group anyway. Idempotent: a release of a released
/// hold changes nothing, and one that comes first leaves a tombstone.
#[derive(Clone, Debug)]
pub(crate) struct PendingRelease {
    groups: Vec<(String, Vec<usize>)>,
    specs: Vec<ScopeSpec>,
    /// After this (ms, the store's clock) the hold has expired by itself.
    until_ms: u64,
}

/// Pending releases kept at most (each a few hundred bytes): past this a
/// release that fails is left to the hold's TTL, as before there was a list.
const MAX_PENDING_RELEASES: usize = 10_000;

/// What one group's script answered, kept with the group.
struct Part {
    base: String,
    idx: Vec<usize>,
    reply: Result<Reply, Unavailable>,
}

impl RedisStore {
    /// Releases (or settles) a reservation's holds in `groups`.
    pub(crate) async fn fend_all(
        &self,
        catalog: &Catalog,
        id: &str,
        groups: &[(String, Vec<usize>)],
        specs: &[ScopeSpec],
        fin: &'static str,
        at_ms: Option<u64>,
    ) -> Result<(), Unavailable> {
        let calls = groups.iter().map(|(base, idx)| {
            let mut r = self.req("fend", catalog);
            r.b = Some(base.clone());
            r.id = Some(id.to_string());
            r.fin = Some(fin);
            r.at = at_ms;
            r.scopes = idx.iter().map(|&i| specs[i].clone()).collect();
            async move { self.call(base, &r).await }
        });
        for reply in futures_util::future::join_all(calls).await {
            let reply = reply?;
            if reply.t != "ok" {
                // A catalog change or a calendar boundary between the
                // scripts: the sweeper finishes it (the record is pending).
                return Err(Unavailable(format!(
                    "a shared group answered {:?} while ending a reservation",
                    reply.t
                )));
            }
        }
        Ok(())
    }

    /// Releases a refused reservation's holds in `groups`, registered as
    /// pending first and forgotten once they landed (see [`PendingRelease`]).
    async fn release_shared(
        &self,
        catalog: &Catalog,
        id: &str,
        groups: &[(String, Vec<usize>)],
        specs: &[ScopeSpec],
        ttl_ms: u64,
    ) -> Result<(), Unavailable> {
        if groups.is_empty() {
            return Ok(());
        }
        {
            let mut pending = self.releases.lock();
            if pending.len() < MAX_PENDING_RELEASES {
                // The hold's expiry as its group reckons it, with the
                // slack of one more timeout.
                let until_ms = self.estimate_ms()
                    + ttl_ms
                    + u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX);
                pending.insert(
                    id.to_string(),
                    PendingRelease {
                        groups: groups.to_vec(),
                        specs: specs.to_vec(),
                        until_ms,
                    },
                );
            }
        }
        let released = self
            .fend_all(catalog, id, groups, specs, "release", None)
            .await;
        if released.is_ok() {
            self.releases.lock().remove(id);
        }
        released
    }

    /// Sends the pending releases again (the sweeper's part); those that
    /// land, or whose holds have expired by now, are forgotten.
    async fn retry_releases(&self, catalog: &Catalog) -> Result<(), Unavailable> {
        let now = self.estimate_ms();
        let due: Vec<(String, PendingRelease)> = {
            let mut pending = self.releases.lock();
            pending.retain(|_, r| r.until_ms > now);
            pending
                .iter()
                .map(|(id, r)| (id.clone(), r.clone()))
                .collect()
        };
        if due.is_empty() {
            return Ok(());
        }
        let sent = due.iter().map(|(id, r)| async move {
            (
                id,
                self.fend_all(catalog, id, &r.groups, &r.specs, "release", None)
                    .await,
            )
        });
        let mut failed = None;
        for (id, result) in futures_util::future::join_all(sent).await {
            match result {
                Ok(()) => {
                    self.releases.lock().remove(id);
                }
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Runs `op` in every shared group of `groups` at once.
    async fn in_groups<'s>(
        &'s self,
        groups: &[(String, Vec<usize>)],
        build: impl Fn(&str, &[usize]) -> crate::wire::Req<'s>,
    ) -> Vec<Part> {
        let calls = groups.iter().map(|(base, idx)| {
            let r = build(base, idx);
            async move {
                Part {
                    base: base.clone(),
                    idx: idx.clone(),
                    reply: self.call(base, &r).await,
                }
            }
        });
        futures_util::future::join_all(calls).await
    }

    /// A reserve whose scopes span the tenant's slot and shared groups'.
    /// `Ok(None)`: start over (the catalog or a calendar bound moved).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn reserve_cross(
        &self,
        catalog: &Catalog,
        version: u64,
        req: &allowance_core::ReserveRequest,
        prep: &allowance_core::PreparedReserve,
        id: ReservationId,
        specs: &[ScopeSpec],
        tenant_req: crate::wire::Req<'_>,
        estimate: &mut u64,
    ) -> Result<Option<Granted>, StoreError<ReserveError>> {
        let keys = req.scopes.as_slice();
        // A retry of a granted key replays: asked first, before any shared
        // group holds (again) what the first grant holds already.
        if let (Some(ik), false) = (&tenant_req.ik, req.dry_run) {
            let base = tenant_req.b.clone().unwrap_or_default();
            let mut r = self.req("idem", catalog);
            r.b = Some(base.clone());
            r.tn = tenant_req.tn.clone();
            r.ik = Some(ik.clone());
            r.fp = tenant_req.fp.clone();
            let reply = self.call(&base, &r).await?;
            match reply.t.as_str() {
                "idem" => {
                    return Err(StoreError::Rejected(ReserveError::IdempotencyConflict {
                        key: ik.clone(),
                    }));
                }
                "ok" => {
                    let rec = reply
                        .rec
                        .as_ref()
                        .ok_or_else(|| Self::corrupt("a replay without its record".into()))?;
                    let res = self.reservation(catalog, rec)?;
                    return Ok(Some(Granted {
                        id: res.id,
                        status: res.status,
                        replayed: true,
                        dry_run: false,
                        held: res.held,
                        created_at: res.created_at,
                        expires_at: res.expires_at,
                        remaining: Vec::new(),
                    }));
                }
                _ => {}
            }
        }
        let groups = shared_groups(specs);
        let held = named(catalog, &prep.held);
        let ids = id.to_string();
        let parts = self
            .in_groups(&groups, |base, idx| {
                let mut r = self.req("fhold", catalog);
                r.cv = Some(version);
                r.b = Some(base.to_string());
                r.id = Some(ids.clone());
                r.ttl = Some(prep.ttl_ms);
                r.h = Some(held.clone());
                r.dry = req.dry_run.then_some(true);
                r.rr = (req.dry_run || req.report_remaining).then_some(true);
                r.scopes = idx.iter().map(|&i| specs[i].clone()).collect();
                r
            })
            .await;
        // Released on a refusal: the groups that held, and those whose
        // answer never came (their hold may still arrive: the release
        // leaves a tombstone it will find).
        let held_somewhere: Vec<(String, Vec<usize>)> = parts
            .iter()
            .filter(|p| !req.dry_run && p.reply.as_ref().map_or(true, |r| r.t == "ok"))
            .map(|p| (p.base.clone(), p.idx.clone()))
            .collect();
        let mut denials = Vec::new();
        let mut again = false;
        let mut failed = None;
        let mut rems: BTreeMap<usize, Vec<LimOut>> = BTreeMap::new();
        for p in &parts {
            match &p.reply {
                Err(e) => failed = Some(e.clone()),
                Ok(r) => match r.t.as_str() {
                    "ok" => {
                        if let Some(rem) = &r.rem {
                            for (j, &i) in p.idx.iter().enumerate() {
                                rems.insert(i, rem.get(j).cloned().unwrap_or_default());
                            }
                        }
                    }
                    "deny" => {
                        if let Some(d) = &r.d {
                            let mut d = d.clone();
                            d.s = global_scope(&p.idx, d.s);
                            denials.push(d);
                        }
                    }
                    "stale" | "cal" | "retry" => {
                        let r2 = Reply {
                            t: r.t.clone(),
                            now: r.now,
                            ..Reply::default()
                        };
                        again |= self.again(&r2, estimate).await?;
                    }
                    "dup" => failed = Some(Unavailable("a reservation id was minted twice".into())),
                    t => failed = Some(Self::corrupt(format!("an answer {t:?} to a shared hold"))),
                },
            }
        }
        let compensate = |why: &str| {
            tracing::debug!(why, "releasing the shared holds of a refused reservation");
            self.release_shared(catalog, &ids, &held_somewhere, specs, prep.ttl_ms)
        };
        if failed.is_some() || again || !denials.is_empty() {
            compensate("a shared group refused").await?;
            if let Some(e) = failed {
                return Err(e.into());
            }
            if let Some(d) = binding(denials) {
                let scopes: Vec<&ScopeKey> = keys.iter().collect();
                return Err(StoreError::Rejected(ReserveError::Denied(Self::denial(
                    catalog, &scopes, &d,
                )?)));
            }
            return Ok(None);
        }
        // The tenant's part, with the record of the whole reservation.
        let tenant_idx: Vec<usize> = (0..specs.len())
            .filter(|&i| !is_shared_base(&specs[i].b))
            .collect();
        let base = tenant_req.b.clone().unwrap_or_default();
        // No answer: the tenant's script may yet have run (and the
        // reservation exist), so the shared holds stay; if it did not run,
        // they expire with their ttl — holds over-reserve, usage never
        // overspends nor goes unrecorded.
        let reply = self.call(&base, &tenant_req).await?;
        let granted = reply.t == "ok" && reply.replay != Some(true);
        if !granted {
            compensate("the tenant's part refused").await?;
        }
        if self.again(&reply, estimate).await? {
            return Ok(None);
        }
        match reply.t.as_str() {
            "idem" => {
                return Err(StoreError::Rejected(ReserveError::IdempotencyConflict {
                    key: req.idempotency_key.as_deref().unwrap_or("").to_string(),
                }));
            }
            "dup" => return Err(StoreError::Rejected(ReserveError::DuplicateId)),
            "deny" => {
                let mut d = reply
                    .d
                    .clone()
                    .ok_or_else(|| Self::corrupt("a denial without detail".into()))?;
                d.s = global_scope(&tenant_idx, d.s);
                let scopes: Vec<&ScopeKey> = keys.iter().collect();
                return Err(StoreError::Rejected(ReserveError::Denied(Self::denial(
                    catalog, &scopes, &d,
                )?)));
            }
            "ok" => {}
            t => return Err(Self::corrupt(format!("an answer {t:?} to a reserve")).into()),
        }
        if let Some(rem) = &reply.rem {
            for (j, &i) in tenant_idx.iter().enumerate() {
                rems.insert(i, rem.get(j).cloned().unwrap_or_default());
            }
        }
        let all: Option<Vec<Vec<LimOut>>> =
            (rems.len() == specs.len()).then(|| rems.into_values().collect());
        if req.dry_run {
            let now = reply.now.unwrap_or(*estimate);
            let expires_at = Timestamp::from_millis(reply.x.unwrap_or(now));
            let mut remaining = Self::remaining(catalog, keys, &all)?;
            let asked: Vec<u64> = specs
                .iter()
                .flat_map(|s| s.lims.iter().map(|l| l.q.unwrap_or(0)))
                .collect();
            for (x, q) in remaining.iter_mut().zip(asked) {
                x.remaining = sat(i128::from(x.remaining) - i128::from(q));
                if x.window == WindowKind::Concurrent {
                    x.resets_at = Some(x.resets_at.map_or(expires_at, |e| e.min(expires_at)));
                }
            }
            return Ok(Some(Granted {
                id,
                status: Status::Held,
                replayed: false,
                dry_run: true,
                held: prep.held.clone(),
                created_at: Timestamp::from_millis(now),
                expires_at,
                remaining,
            }));
        }
        let rec = Self::granted_record(&reply, tenant_req.rec.as_ref())?;
        let res = self.reservation(catalog, &rec)?;
        let replayed = reply.replay == Some(true);
        if !replayed && res.status == Status::Held {
            self.remember(&rec);
        }
        let remaining = if replayed || !req.report_remaining {
            Vec::new()
        } else {
            Self::remaining(catalog, keys, &all)?
        };
        Ok(Some(Granted {
            id: res.id,
            status: res.status,
            replayed,
            dry_run: false,
            held: res.held,
            created_at: res.created_at,
            expires_at: res.expires_at,
            remaining,
        }))
    }

    /// After the tenant's script ended a reservation with holds in shared
    /// groups: settles (with its charges) or releases them, then clears
    /// the pending mark. A failure leaves it pending for the sweeper.
    pub(crate) async fn finish_cross(
        &self,
        catalog: &Catalog,
        rec: &Rec,
    ) -> Result<(), Unavailable> {
        let res = self.reservation(catalog, rec)?;
        let (fin, charged) = match res.status {
            Status::Settled => ("settle", res.charged.clone().unwrap_or_default()),
            Status::Refunded => ("release", Amounts::new()),
            // Expired holds expire in their groups by themselves.
            _ => ("release", Amounts::new()),
        };
        let specs = self.specs(
            catalog,
            res.scopes.as_slice(),
            self.estimate_ms(),
            |d, spec| {
                spec.a = Some(if fin == "settle" {
                    recorded(d, &charged)
                } else {
                    0
                });
            },
        );
        let groups = shared_groups(&specs);
        if !groups.is_empty() {
            self.fend_all(catalog, &rec.id, &groups, &specs, fin, None)
                .await?;
        }
        self.pdone(catalog, res.id.tag(), &rec.id).await
    }

    /// The sweeper's part: finishes the settles and refunds an instance
    /// left pending (it died, or a shared group did not answer) for at
    /// least two seconds, and expires foreign holds in the shared groups.
    pub(crate) async fn sweep_cross(&self, catalog: &Catalog) -> Result<(), Unavailable> {
        // First: a release that did not land leaves a hold blocking room.
        let retried = self.retry_releases(catalog).await;
        let now = self.estimate_ms();
        let cmds = (0..=255u8)
            .map(|tag| {
                let mut c = redis::cmd("ZRANGEBYSCORE");
                c.arg(format!("{}:p", self.tenant_base(tag)))
                    .arg("-inf")
                    .arg(now.saturating_sub(2000))
                    .arg("LIMIT")
                    .arg(0)
                    .arg(100);
                c
            })
            .collect();
        let pending: Vec<Vec<String>> = self.each(cmds).await?;
        let mut unfinished = None;
        for text in pending.into_iter().flatten() {
            let finished = match ReservationId::parse(&text) {
                Some(id) => match self.peek(catalog, id).await {
                    Ok(Some(rec)) => self.finish_cross(catalog, &rec).await,
                    // Forgotten (past its retention) or not an id: nothing
                    // left to finish; it leaves the list.
                    Ok(None) => self.pdone(catalog, id.tag(), &text).await,
                    Err(e) => Err(e),
                },
                None => Ok(()),
            };
            // One unreachable group must not stop the others' work.
            if let Err(e) = finished {
                unfinished.get_or_insert(e);
            }
        }
        let due = self
            .due_groups(|tag| self.shared_base(tag), ["fx", "fd"], now)
            .await?;
        let calls = due.into_iter().map(|tag| {
            let base = self.shared_base(tag);
            let mut r = self.req("ftick", catalog);
            r.b = Some(base.clone());
            async move { self.call(&base, &r).await }
        });
        for reply in futures_util::future::join_all(calls).await {
            reply?;
        }
        retried?;
        unfinished.map_or(Ok(()), Err)
    }

    /// Takes a reservation off its tenant group's pending list.
    async fn pdone(&self, catalog: &Catalog, tag: u8, id: &str) -> Result<(), Unavailable> {
        let base = self.tenant_base(tag);
        let mut r = self.req("pdone", catalog);
        r.b = Some(base.clone());
        r.id = Some(id.to_string());
        self.call(&base, &r).await.map(|_| ())
    }

    /// An extend of a reservation with holds in shared groups: they raise
    /// (checking) and move first, then the tenant; a refusal takes the
    /// raises back. `Ok(None)`: start over.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn extend_cross(
        &self,
        catalog: &Catalog,
        version: u64,
        rec: &Rec,
        specs: &[ScopeSpec],
        delta: &Amounts,
        ttl_ms: Option<u64>,
        tenant_req: crate::wire::Req<'_>,
        estimate: &mut u64,
    ) -> Result<Option<Reply>, StoreError<ExtendError>> {
        let groups = shared_groups(specs);
        let h = named(catalog, delta);
        let parts = self
            .in_groups(&groups, |base, idx| {
                let mut r = self.req("fextend", catalog);
                r.cv = Some(version);
                r.b = Some(base.to_string());
                r.id = Some(rec.id.clone());
                r.h = Some(h.clone());
                r.ttl = ttl_ms;
                r.scopes = idx.iter().map(|&i| specs[i].clone()).collect();
                r
            })
            .await;
        let undo = |parts: &[Part]| {
            let done: Vec<(String, Vec<usize>, Option<u64>)> = parts
                .iter()
                .filter_map(|p| match &p.reply {
                    Ok(r) if r.t == "ok" => Some((p.base.clone(), p.idx.clone(), r.x)),
                    _ => None,
                })
                .collect();
            let h = h.clone();
            async move {
                let calls = done.iter().map(|(base, idx, ox)| {
                    let mut r = self.req("fextend", catalog);
                    r.b = Some(base.clone());
                    r.id = Some(rec.id.clone());
                    r.h = Some(h.clone());
                    r.undo = true;
                    r.ox = *ox;
                    r.scopes = idx.iter().map(|&i| specs[i].clone()).collect();
                    async move { self.call(base, &r).await }
                });
                for reply in futures_util::future::join_all(calls).await {
                    reply?;
                }
                Ok::<(), Unavailable>(())
            }
        };
        let mut denials = Vec::new();
        let mut again = false;
        let mut failed = None;
        for p in &parts {
            match &p.reply {
                Err(e) => failed = Some(e.clone()),
                Ok(r) => match r.t.as_str() {
                    "ok" => {}
                    "deny" => {
                        if let Some(d) = &r.d {
                            let mut d = d.clone();
                            d.s = global_scope(&p.idx, d.s);
                            denials.push(d);
                        }
                    }
                    "notheld" => {
                        undo(&parts).await?;
                        return Err(StoreError::Rejected(ExtendError::NotHeld {
                            status: Status::Expired,
                        }));
                    }
                    "stale" | "cal" | "retry" => {
                        let r2 = Reply {
                            t: r.t.clone(),
                            now: r.now,
                            ..Reply::default()
                        };
                        again |= self.again(&r2, estimate).await?;
                    }
                    t => {
                        failed = Some(Self::corrupt(format!("an answer {t:?} to a shared extend")))
                    }
                },
            }
        }
        if failed.is_some() || again || !denials.is_empty() {
            undo(&parts).await?;
            if let Some(e) = failed {
                return Err(e.into());
            }
            if let Some(d) = binding(denials) {
                let res = self.reservation(catalog, rec)?;
                let scopes: Vec<&ScopeKey> = res.scopes.as_slice().iter().collect();
                return Err(StoreError::Rejected(ExtendError::Denied(Self::denial(
                    catalog, &scopes, &d,
                )?)));
            }
            return Ok(None);
        }
        let base = tenant_req.b.clone().unwrap_or_default();
        // No answer: the tenant's part may have run; the raises stay (the
        // shared side may hold more than the tenant's until the end).
        let reply = self.call(&base, &tenant_req).await?;
        if reply.t != "ok" {
            undo(&parts).await?;
        }
        if reply.t == "deny"
            && let Some(d) = &reply.d
        {
            let tenant_idx: Vec<usize> = (0..specs.len())
                .filter(|&i| !is_shared_base(&specs[i].b))
                .collect();
            let mut d = d.clone();
            d.s = global_scope(&tenant_idx, d.s);
            let res = self.reservation(catalog, rec)?;
            let scopes: Vec<&ScopeKey> = res.scopes.as_slice().iter().collect();
            return Err(StoreError::Rejected(ExtendError::Denied(Self::denial(
                catalog, &scopes, &d,
            )?)));
        }
        Ok(Some(reply))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(kind: &str, ra: Option<u64>, s: usize) -> DenyOut {
        DenyOut {
            kind: kind.into(),
            ra,
            s,
            l: 1,
            cap: 1,
            rem: 0,
            q: 1,
            rs: None,
        }
    }

    #[test]
    fn the_binding_denial_follows_the_rule() {
        let b = binding(vec![d("rate", Some(5), 1), d("budget", None, 2)]).unwrap();
        assert_eq!(b.kind, "budget");
        let b = binding(vec![d("rate", Some(5), 2), d("rate", Some(9), 3)]).unwrap();
        assert_eq!(b.s, 3, "the latest retry binds");
        let b = binding(vec![d("rate", Some(9), 3), d("rate", Some(9), 2)]).unwrap();
        assert_eq!(b.s, 2, "ties go to the earlier scope");
        assert!(binding(vec![]).is_none());
    }
}
