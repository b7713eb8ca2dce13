//! The ledger's invariants, stated in code (SEMANTICS.md): the tests call
//! these after every step of every generated history.

use std::cmp::Reverse;
use std::collections::{HashMap, HashSet};

use crate::ops::Router;
use crate::reservation::{ReservationId, Status};
use crate::shard::{NO_SLOT, ShardState};
use crate::units::{Amounts, Dimension};

/// Checks one shard. `Err` describes the first broken invariant.
pub(crate) fn check_shard(shard: usize, st: &ShardState) -> Result<(), String> {
    let fail = |what: String| Err(format!("shard {shard}: {what}"));
    let mut per_scope: HashMap<&str, (u32, Amounts)> = HashMap::new();
    let mut live = 0usize;
    for (slot, hold) in st.holds.iter().enumerate() {
        let Some(hold) = hold else { continue };
        live += 1;
        if hold.expires_ms <= st.now_ms {
            return fail(format!(
                "hold {slot} of {} expired at {} but is still held at {}",
                hold.owner, hold.expires_ms, st.now_ms
            ));
        }
        let e = st.expiry.entries().get(hold.heap_pos as usize);
        if e.map(|e| (e.slot, e.due_ms)) != Some((slot as u32, hold.expires_ms)) {
            return fail(format!("hold {slot}: expiry heap position is wrong"));
        }
        for (k, hs) in hold.scopes.iter().enumerate() {
            let Some(sc) = st.scopes.get(hs.slot as usize).and_then(|s| s.as_ref()) else {
                return fail(format!(
                    "hold {slot} holds on slot {}, which is empty",
                    hs.slot
                ));
            };
            let key = &sc.key;
            if st.slot_of(key) != Some(hs.slot) {
                return fail(format!("hold {slot}: the slot of {key} is stale"));
            }
            let pos = hs.pos as usize;
            let entry = sc
                .extra
                .as_ref()
                .and_then(|x| x.holders.entries().get(pos).copied());
            if entry.map(|e| (e.slot, e.tag, e.due_ms))
                != Some((slot as u32, k as u8, hold.expires_ms))
            {
                return fail(format!("hold {slot}: position in {key}'s holders is wrong"));
            }
            if !hold.foreign {
                // The hold is on the reservation's own scopes.
                let named = st
                    .records
                    .get(hold.owner)
                    .and_then(|r| r.res.scopes.as_slice().get(usize::from(hs.index)));
                if named != Some(key) {
                    return fail(format!(
                        "hold {slot}: scope {} of {} is not {key}",
                        hs.index, hold.owner
                    ));
                }
            }
            let e = per_scope.entry(key.as_str()).or_default();
            e.0 += 1;
            e.1.add(&hold.amounts);
        }
        if hold.foreign {
            if st.foreign.get(&hold.owner) != Some(&(slot as u32)) {
                return fail(format!(
                    "foreign hold {slot} of {} is not indexed",
                    hold.owner
                ));
            }
        } else {
            let Some(rec) = st.records.get(hold.owner) else {
                return fail(format!("hold {slot} belongs to unknown {}", hold.owner));
            };
            if rec.res.status != Status::Held || rec.hold_slot != slot as u32 {
                return fail(format!(
                    "hold {slot}: {} is {} with slot {}",
                    hold.owner, rec.res.status, rec.hold_slot
                ));
            }
            if rec.res.held != hold.amounts || rec.res.expires_at.as_millis() != hold.expires_ms {
                return fail(format!(
                    "hold {slot}: amounts or expiry differ from {}",
                    hold.owner
                ));
            }
        }
    }
    if live != st.expiry.len() || live + st.free_slots.len() != st.holds.len() {
        return fail(format!(
            "{live} live holds, {} in the expiry heap, {} free of {}",
            st.expiry.len(),
            st.free_slots.len(),
            st.holds.len()
        ));
    }
    if st.foreign.len() != st.holds.iter().flatten().filter(|h| h.foreign).count() {
        return fail("the foreign index counts holds that do not exist".into());
    }
    if st.index.len() + st.free_scopes.len() != st.scopes.len()
        || st.scopes.iter().filter(|s| s.is_some()).count() != st.index.len()
    {
        return fail("the scope index and the scope table disagree".into());
    }
    for &slot in st.index.iter() {
        let Some(sc) = st.scopes.get(slot as usize).and_then(|s| s.as_ref()) else {
            return fail(format!("the index points at an empty slot {slot}"));
        };
        let key = &sc.key;
        if st.slot_of(key) != Some(slot) {
            return fail(format!("{key} is not found at its slot {slot}"));
        }
        if let Err(e) = sc.check_layout() {
            return fail(format!("{key}: {e}"));
        }
        // Windows are advanced to the instants the shard observed, never past.
        if sc.words[0] > st.now_ms {
            return fail(format!(
                "{key} was advanced to {}, past the shard's {}",
                sc.words[0], st.now_ms
            ));
        }
        let (count, amounts) = per_scope.remove(key.as_str()).unwrap_or_default();
        // held equals the sum over its HELD reservations of their held amounts.
        if sc.held_count != count {
            return fail(format!(
                "{key}: held_count {} but {count} holds",
                sc.held_count
            ));
        }
        let held = sc
            .extra
            .as_ref()
            .map(|e| e.held.clone())
            .unwrap_or_default();
        if held != amounts {
            return fail(format!(
                "{key}: held {held:?} but its holds sum to {amounts:?}"
            ));
        }
        let holders = sc.extra.as_ref().map_or(0, |e| e.holders.len());
        if holders != count as usize {
            return fail(format!("{key}: {holders} holder entries for {count} holds"));
        }
        if held.get(Dimension::REQUESTS) != 0 {
            return fail(format!("{key}: implied dimensions are never stored"));
        }
    }
    // The idle-scope queue names each queued scope once, and only those.
    let mut queued = HashSet::new();
    for Reverse((_, slot)) in st.gc.iter() {
        let is_queued = matches!(st.scopes.get(*slot as usize), Some(Some(sc)) if sc.gc_queued);
        if !is_queued || !queued.insert(*slot) {
            return fail(format!(
                "the idle-scope queue names slot {slot}, which is not queued there once"
            ));
        }
    }
    if queued.len() != st.scopes.iter().flatten().filter(|s| s.gc_queued).count() {
        return fail("a scope marked queued is not in the idle-scope queue".into());
    }
    if st.records.iter().count() != st.records.len() {
        return fail("the record index and the record slab disagree".into());
    }
    let multi = st.records.iter().filter(|r| r.multi_shard).count();
    if multi != st.multi_shard_records {
        return fail(format!(
            "{multi} multi-shard records, counted {}",
            st.multi_shard_records
        ));
    }
    for rec in st.records.iter() {
        let id = &rec.res.id;
        if st.records.find(*id).map(|i| st.records.at(i).res.id) != Some(*id) {
            return fail(format!("{id} is not found by its id"));
        }
        let held = rec.res.status == Status::Held;
        if held != (rec.hold_slot != NO_SLOT) {
            return fail(format!(
                "{id} is {} with hold slot {}",
                rec.res.status, rec.hold_slot
            ));
        }
        if held == rec.res.ended_at.is_some() {
            return fail(format!(
                "{id} is {} but ended_at is {:?}",
                rec.res.status, rec.res.ended_at
            ));
        }
        if (rec.res.status == Status::Settled) != rec.res.charged.is_some() {
            return fail(format!("{id}: charged is set iff settled"));
        }
    }
    for (k, id) in &st.idempotency {
        if !st.records.contains(*id) {
            return fail(format!("idempotency key {k:?} points at forgotten {id}"));
        }
    }
    Ok(())
}

/// Cross-shard: every HELD reservation with scopes elsewhere has a foreign
/// hold there with the same amounts and expiry, and every foreign hold
/// belongs to a HELD reservation. Shards must have observed the same instant.
pub(crate) fn check_foreign(
    shards: &[&ShardState],
    home_of: impl Fn(ReservationId) -> usize,
) -> Result<(), String> {
    for (i, st) in shards.iter().enumerate() {
        for hold in st.holds.iter().flatten().filter(|h| h.foreign) {
            let home = home_of(hold.owner);
            let Some(rec) = shards[home].records.get(hold.owner) else {
                return Err(format!(
                    "foreign hold in shard {i} of unknown {}",
                    hold.owner
                ));
            };
            if rec.res.status != Status::Held || !rec.multi_shard {
                return Err(format!(
                    "foreign hold in shard {i} of {} which is {}",
                    hold.owner, rec.res.status
                ));
            }
            if rec.res.held != hold.amounts || rec.res.expires_at.as_millis() != hold.expires_ms {
                return Err(format!(
                    "foreign hold in shard {i} differs from {}",
                    hold.owner
                ));
            }
        }
    }
    Ok(())
}

/// Cross-shard, for shards that need not have observed the same instant
/// (a ledger restored from a snapshot, which keeps each shard's own time):
/// everything lives in the shard it routes to; every foreign hold is a copy
/// of its HELD reservation's hold on exactly the scopes this shard owns,
/// unless the home shard already saw the hold's expiry (this shard has not
/// yet); every HELD reservation holds in every shard that owns one of its
/// scopes, unless that shard already saw its expiry. With every shard at
/// the same instant this is [`check_foreign`] and more: no exception applies.
pub(crate) fn check_routes(shards: &[&ShardState], router: Router) -> Result<(), String> {
    for (i, st) in shards.iter().enumerate() {
        let fail = |what: String| Err(format!("shard {i}: {what}"));
        for sc in st.scopes.iter().flatten() {
            if router.of_scope(&sc.key) != i {
                return fail(format!("{} lives in another shard", sc.key));
            }
        }
        for hold in st.holds.iter().flatten() {
            let home = router.of_id(hold.owner);
            if hold.foreign == (home == i) {
                return fail(format!(
                    "a hold of {} (home shard {home}) is {}marked foreign",
                    hold.owner,
                    if hold.foreign { "" } else { "not " }
                ));
            }
            let Some(home_st) = shards.get(home) else {
                return fail(format!("{} routes to no shard", hold.owner));
            };
            if !hold.foreign || home_st.now_ms >= hold.expires_ms {
                continue;
            }
            let Some(rec) = home_st.records.get(hold.owner) else {
                return fail(format!("a foreign hold of unknown {}", hold.owner));
            };
            if rec.res.status != Status::Held
                || !rec.multi_shard
                || rec.res.held != hold.amounts
                || rec.res.expires_at.as_millis() != hold.expires_ms
            {
                return fail(format!(
                    "a foreign hold of {}, which is {} with other amounts or expiry",
                    hold.owner, rec.res.status
                ));
            }
        }
        for rec in st.records.iter() {
            let id = rec.res.id;
            let scopes = rec.res.scopes.as_slice();
            if router.of_id(id) != i || id.tag() != rec.res.scopes.tenant_tag() {
                return fail(format!("{id} is not routed with its tenant"));
            }
            let multi = scopes.iter().any(|k| router.of_scope(k) != i);
            if multi != rec.multi_shard {
                return fail(format!("{id}: multi_shard is {}", rec.multi_shard));
            }
            if rec.res.status != Status::Held {
                continue;
            }
            for s in router.shards_of(&rec.res.scopes) {
                let Some(part) = shards.get(s) else {
                    return fail(format!("{id} has a scope in no shard"));
                };
                let slot = if s == i {
                    rec.hold_slot
                } else if part.now_ms >= rec.res.expires_at.as_millis() {
                    continue;
                } else {
                    part.foreign.get(&id).copied().unwrap_or(NO_SLOT)
                };
                let Some(Some(hold)) = part.holds.get(slot as usize) else {
                    return fail(format!("{id} holds nothing in shard {s}"));
                };
                // Exactly the scopes shard `s` owns, in the reservation's order.
                let want = scopes
                    .iter()
                    .enumerate()
                    .filter(|(_, k)| router.of_scope(k) == s)
                    .map(|(n, k)| (n, Some(k)));
                let part_key = |slot: u32| {
                    part.scopes
                        .get(slot as usize)
                        .and_then(|sc| sc.as_ref())
                        .map(|sc| &sc.key)
                };
                let got = hold
                    .scopes
                    .iter()
                    .map(|hs| (usize::from(hs.index), part_key(hs.slot)));
                if !want.eq(got) {
                    return fail(format!(
                        "{id}'s hold in shard {s} is not on its scopes there"
                    ));
                }
            }
        }
    }
    Ok(())
}
