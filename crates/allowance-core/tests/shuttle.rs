//! Model checks of [`SharedLedger`]'s locking protocol with shuttle: the
//! shard mutexes are shuttle's (`--cfg allowance_shuttle`, see `src/sync.rs`),
//! so shuttle explores many interleavings of the lock acquisitions and
//! reports any deadlock, panic or failed assertion with a replayable
//! schedule. Run with `scripts/shuttle.sh`; more schedules with
//! `ALLOWANCE_SHUTTLE_ITERS` (default 1000 per scheduler and scenario).
//!
//! Every scenario makes reservations that span shards: a tenant's home
//! shard plus the shard of the shared `tool:search` scope.

#![cfg(allowance_shuttle)]

mod common;

use std::sync::Arc;

use allowance_core::*;
use common::Changes;
use shuttle::thread;

/// Few shards, so different tenants still share some and every lock order
/// is exercised; chosen names put the tenants and the tool apart.
const SHARDS: usize = 4;

fn iterations() -> usize {
    std::env::var("ALLOWANCE_SHUTTLE_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

/// Runs `f` under the random scheduler and under PCT (which favours the
/// few-preemption schedules that most lock bugs need).
fn check(f: impl Fn() + Send + Sync + 'static) {
    let f = Arc::new(f);
    let g = f.clone();
    shuttle::check_random(move || f(), iterations());
    shuttle::check_pct(move || g(), iterations(), 3);
}

/// The shard a tenant (or a shared scope, by name) lives in: the ledger's
/// own stable routing hash, so names can be picked to land apart.
fn shard_of(name: &str) -> usize {
    usize::from(ReservationId::tenant_tag(name)) & (SHARDS - 1)
}

/// Two tenants in two different shards, neither the tool's.
fn tenants() -> (String, String) {
    let tool = shard_of("tool:search");
    let mut names = (0..).map(|i| format!("t{i}"));
    let a = names.find(|t| shard_of(t) != tool).unwrap();
    let b = names
        .find(|t| shard_of(t) != tool && shard_of(t) != shard_of(&a))
        .unwrap();
    (a, b)
}

/// Fixed ids: shuttle replays a failing schedule only if the test itself
/// is deterministic.
fn id(n: u128, tenant: &str) -> ReservationId {
    ReservationId::mint(n << 64 | 0x5eed << 8, tenant)
}

const NOW: Timestamp = Timestamp::from_millis(1_741_953_600_000);

fn cost(micros: u64) -> Amounts {
    Amounts::new().with(Dimension::COST_MICROS, micros)
}

fn usage(micros: u64) -> Usage {
    Usage {
        amounts: cost(micros),
        ..Usage::default()
    }
}

/// A ledger whose shared tool admits `tool_concurrent` holds at once and
/// whose users may spend 20 in a sliding day.
fn ledger(tool_concurrent: u64) -> SharedLedger {
    let mut c = Catalog::default();
    let tool = Plan::new(
        "tool",
        vec![Limit::new(Dimension::CONCURRENT, tool_concurrent, Window::Concurrent).unwrap()],
        OverrunPolicy::ChargeActual,
    )
    .unwrap();
    let user = Plan::new(
        "user",
        vec![
            Limit::new(
                Dimension::COST_MICROS,
                20,
                Window::Sliding {
                    period_ms: 86_400_000,
                    slices: 24,
                },
            )
            .unwrap(),
        ],
        OverrunPolicy::ChargeActual,
    )
    .unwrap();
    let tenant = Plan::new(
        "tenant",
        vec![Limit::new(Dimension::COST_MICROS, 1_000, Window::Total).unwrap()],
        OverrunPolicy::ChargeActual,
    )
    .unwrap();
    c.set_plan(tool);
    c.set_plan(user);
    c.set_plan(tenant);
    c.set_kind("tenant", Some("tenant"), false).unwrap();
    c.set_kind("user", Some("user"), false).unwrap();
    c.set_kind("tool", Some("tool"), true).unwrap();
    SharedLedger::new(c, SHARDS)
}

fn request(l: &SharedLedger, tenant: &str, micros: u64) -> ReserveRequest {
    let scopes = l
        .catalog()
        .scope_set(tenant, &[("user", "u"), ("tool", "search")])
        .unwrap();
    ReserveRequest::new(scopes, cost(micros))
}

fn tool_holds(l: &SharedLedger) -> u64 {
    let key = ScopeKey::parse("tool:search").unwrap();
    l.status(NOW, &key).held_reservations
}

#[test]
fn reserves_on_two_tenants_through_a_shared_scope_while_others_end() {
    // Proves no deadlock and intact invariants when two tenants in two
    // shards reserve through the shared tool while a third thread settles
    // one multi-shard reservation and refunds another.
    check(|| {
        let (a, b) = tenants();
        let l = Arc::new(ledger(3));
        let (r0, r1) = (id(1, &a), id(2, &b));
        l.reserve(NOW, r0, &request(&l, &a, 1)).unwrap();
        l.reserve(NOW, r1, &request(&l, &b, 1)).unwrap();
        let reserver = |tenant: String, n: u128| {
            let l = l.clone();
            thread::spawn(move || {
                let req = request(&l, &tenant, 1);
                match l.reserve(NOW, id(n, &tenant), &req) {
                    Ok(_) => 1u64,
                    Err(ReserveError::Denied(d)) => {
                        assert_eq!(d.scope.as_str(), "tool:search", "{d}");
                        0
                    }
                    Err(e) => panic!("unexpected {e:?}"),
                }
            })
        };
        let t1 = reserver(a.clone(), 10);
        let t2 = reserver(b.clone(), 11);
        let ender = {
            let l = l.clone();
            thread::spawn(move || {
                assert_eq!(
                    l.settle(NOW, r0, &usage(1)).unwrap().status,
                    Status::Settled
                );
                assert_eq!(l.refund(NOW, r1).unwrap().status, Status::Refunded);
            })
        };
        let admitted = t1.join().unwrap() + t2.join().unwrap();
        ender.join().unwrap();
        l.check_invariants(NOW).unwrap();
        // The tool had room for one while r0 and r1 held: at least one got in,
        // and what it holds is exactly what was admitted.
        assert!(admitted >= 1);
        assert_eq!(tool_holds(&l), admitted);
        assert_eq!(l.hold_count(), admitted as usize * 2);
    });
}

#[test]
fn seed002_in_miniature_three_racers_one_admitted() {
    // Proves the reserve is atomic across shards: 10 of 20 spent, three
    // threads each asking 6 through a multi-shard reservation, exactly one
    // admitted and the others told what is left.
    check(|| {
        let (a, _) = tenants();
        let l = Arc::new(ledger(10));
        let first = id(1, &a);
        l.reserve(NOW, first, &request(&l, &a, 10)).unwrap();
        l.settle(NOW, first, &usage(10)).unwrap();
        let racers: Vec<_> = (0..3u128)
            .map(|n| {
                let (l, a) = (l.clone(), a.clone());
                thread::spawn(move || l.reserve(NOW, id(10 + n, &a), &request(&l, &a, 6)))
            })
            .collect();
        let answers: Vec<_> = racers.into_iter().map(|r| r.join().unwrap()).collect();
        assert_eq!(answers.iter().filter(|r| r.is_ok()).count(), 1);
        for r in &answers {
            if let Err(e) = r {
                let ReserveError::Denied(d) = e else {
                    panic!("unexpected {e:?}")
                };
                assert_eq!(
                    (d.scope.as_str(), d.kind, d.remaining),
                    (
                        format!("tenant:{a}/user:u").as_str(),
                        DenialKind::RateLimited,
                        4
                    )
                );
            }
        }
        l.check_invariants(NOW).unwrap();
        assert_eq!(tool_holds(&l), 1);
    });
}

#[test]
fn settle_racing_refund_on_one_reservation_ends_it_once() {
    // Proves a reservation leaves HELD once when two settles and a refund
    // race on it: the winner's answer is repeated, the loser gets a
    // conflict naming it, and usage is recorded at most once.
    check(|| {
        let (a, _) = tenants();
        let l = Arc::new(ledger(10));
        let r = id(1, &a);
        l.reserve(NOW, r, &request(&l, &a, 8)).unwrap();
        let settler = |micros: u64| {
            let l = l.clone();
            thread::spawn(move || l.settle_view(NOW, r, &usage(micros)))
        };
        let s1 = settler(5);
        let s2 = settler(7);
        let refunder = {
            let l = l.clone();
            thread::spawn(move || l.refund_view(NOW, r))
        };
        let (s1, s2, rf) = (
            s1.join().unwrap(),
            s2.join().unwrap(),
            refunder.join().unwrap(),
        );
        let last = l.get(NOW, r).unwrap();
        let user = ScopeKey::parse(&format!("tenant:{a}/user:u")).unwrap();
        let used = l.status(NOW, &user).limits[0].used;
        match &rf {
            Ok(res) => {
                assert_eq!(res.status, Status::Refunded);
                for s in [&s1, &s2] {
                    assert_eq!(
                        s,
                        &Err(SettleError::Conflict {
                            status: Status::Refunded
                        })
                    );
                }
                assert_eq!(&last, res);
                assert_eq!(used, 0);
            }
            Err(e) => {
                assert_eq!(
                    e,
                    &RefundError::Conflict {
                        status: Status::Settled
                    }
                );
                // Both settles answer the one that went first.
                let (s1, s2) = (s1.unwrap(), s2.unwrap());
                assert_eq!(s1, s2);
                assert_eq!(s1, last);
                let charged = last.charged.as_ref().unwrap().get(Dimension::COST_MICROS);
                assert!(charged == 5 || charged == 7);
                assert_eq!(used, charged as i64);
            }
        }
        assert_eq!(l.hold_count(), 0);
        l.check_invariants(NOW).unwrap();
    });
}

#[test]
fn multi_shard_settle_while_another_tenant_reserves_the_shared_scope() {
    // Proves the settle path that reads a reservation's shards under one
    // lock, drops it and locks them all stays right when another tenant
    // takes the shared scope's shard in between, and a concurrent extend of
    // the same reservation sees it either HELD or ended, never half.
    check(|| {
        let (a, b) = tenants();
        // The tool admits one hold: b gets in only once a's is settled.
        let l = Arc::new(ledger(1));
        let r = id(1, &a);
        l.reserve(NOW, r, &request(&l, &a, 3)).unwrap();
        let settler = {
            let l = l.clone();
            thread::spawn(move || l.settle(NOW, r, &usage(2)).unwrap())
        };
        let extender = {
            let l = l.clone();
            thread::spawn(move || l.extend(NOW, r, None, Some(60_000)))
        };
        let other = {
            let (l, b) = (l.clone(), b.clone());
            thread::spawn(move || l.reserve(NOW, id(2, &b), &request(&l, &b, 1)))
        };
        let settled = settler.join().unwrap();
        let extended = extender.join().unwrap();
        let admitted = other.join().unwrap();
        assert_eq!(settled.status, Status::Settled);
        match extended {
            Ok(o) => {
                // Extended while still HELD: the settle came after it.
                assert_eq!(o.status, Status::Held);
                assert_eq!(o.expires_at, NOW.saturating_add_ms(60_000));
            }
            Err(e) => assert_eq!(
                e,
                ExtendError::NotHeld {
                    status: Status::Settled
                }
            ),
        }
        match &admitted {
            Ok(g) => assert_eq!(g.status, Status::Held),
            Err(ReserveError::Denied(d)) => {
                assert_eq!(
                    (d.scope.as_str(), d.kind),
                    ("tool:search", DenialKind::RateLimited)
                )
            }
            Err(e) => panic!("unexpected {e:?}"),
        }
        l.check_invariants(NOW).unwrap();
        assert_eq!(tool_holds(&l), u64::from(admitted.is_ok()));
        assert_eq!(l.get(NOW, r).unwrap().status, Status::Settled);
    });
}

#[test]
fn an_end_racing_the_reserve_of_its_own_id_sees_all_or_nothing() {
    // Proves that a settle or refund arriving while the reserve of the same
    // multi-shard id is in flight either finds nothing or ends the whole
    // reservation in every shard — never a part of it (the id's home shard
    // is looked up first, the others locked after).
    check(|| {
        let (a, _) = tenants();
        let l = Arc::new(ledger(3));
        let r = id(1, &a);
        let settler = {
            let l = l.clone();
            thread::spawn(move || l.settle(NOW, r, &usage(2)))
        };
        let refunder = {
            let l = l.clone();
            thread::spawn(move || l.refund(NOW, r))
        };
        l.reserve(NOW, r, &request(&l, &a, 3)).unwrap();
        let settled = settler.join().unwrap();
        let refunded = refunder.join().unwrap();
        l.check_invariants(NOW).unwrap();
        let last = l.get(NOW, r).unwrap();
        match (&settled, &refunded) {
            (Err(SettleError::NotFound), Err(RefundError::NotFound)) => {
                assert_eq!(last.status, Status::Held);
                assert_eq!(l.hold_count(), 2);
            }
            (Ok(o), Err(RefundError::NotFound | RefundError::Conflict { .. })) => {
                assert_eq!((o.status, last.status), (Status::Settled, Status::Settled));
            }
            (Err(SettleError::NotFound | SettleError::Conflict { .. }), Ok(o)) => {
                assert_eq!(
                    (o.status, last.status),
                    (Status::Refunded, Status::Refunded)
                );
            }
            other => panic!("both ended it, or neither consistently: {other:?}"),
        }
        if last.status != Status::Held {
            assert_eq!(l.hold_count(), 0);
        }
    });
}

/// A snapshot taken while two tenants reserve and settle (each on its home
/// shard and the tool's) is the ledger at its cut: every change committed
/// before the cut is in it, whole, and none after — whichever shards the
/// changes copied before the snapshot did.
#[test]
fn a_snapshot_amid_changes_is_the_ledger_at_its_cut() {
    check(|| {
        let l = Arc::new(ledger(8));
        let changes = Arc::new(Changes::default());
        let (a, b) = tenants();
        let racers: Vec<_> = [(1u128, a), (2, b)]
            .into_iter()
            .map(|(n, tenant)| {
                let (l, changes) = (l.clone(), changes.clone());
                thread::spawn(move || {
                    let id = id(n, &tenant);
                    let req = request(&l, &tenant, 3);
                    l.reserve_journaled(NOW, id, &req, &*changes).0.unwrap();
                    l.settle_journaled(NOW, id, &usage(2), &*changes).unwrap();
                    id
                })
            })
            .collect();
        let (at_cut, snapshot) = l.snapshot_with(|| changes.so_far());
        let ids: Vec<ReservationId> = racers.into_iter().map(|r| r.join().unwrap()).collect();
        let restored = SharedLedger::from_snapshot(snapshot, SHARDS).unwrap();
        for id in ids {
            let expected = at_cut.iter().rev().find(|(i, _)| *i == id).map(|(_, s)| *s);
            let found = restored.get(NOW, id).map(|r| r.status);
            assert_eq!(
                found, expected,
                "{id:?} in the snapshot, against the changes at its cut"
            );
        }
        // The tool's holds in the snapshot are those of the reservations
        // held at the cut.
        let held = at_cut
            .iter()
            .filter(|(i, s)| *s == Status::Held && !at_cut.contains(&(*i, Status::Settled)))
            .count() as u64;
        assert_eq!(tool_holds(&restored), held);
    });
}
