//! The usage log: every end of a reservation and every adjustment, once,
//! in commit order, with cursors that page without gaps or repeats.

use allowance_core::{Dimension, ReservationId, Status, UsageKind, UsageRecord};

use crate::Harness;
use crate::catalogs::{DAY_MS, DEFAULT_TTL_MS, START_MS};
use crate::support::{key, tokens, usage};

/// Every record after `since`, a page of `limit` at a time, checking the
/// pages join up.
async fn all_after(
    h: &Harness,
    since: Option<u64>,
    limit: usize,
    tenant: Option<&str>,
) -> Vec<UsageRecord> {
    let mut out: Vec<UsageRecord> = Vec::new();
    let mut cursor = since;
    loop {
        let page = h
            .store
            .usage(cursor, limit, tenant)
            .await
            .expect("the usage log answers");
        assert!(page.records.len() <= limit, "a page holds at most `limit`");
        if page.records.is_empty() {
            assert_eq!(
                page.next_cursor,
                cursor.unwrap_or(0),
                "with nothing new the cursor stays"
            );
            return out;
        }
        for r in &page.records {
            assert!(
                out.last().is_none_or(|l| l.cursor < r.cursor)
                    && cursor.is_none_or(|c| c < r.cursor),
                "cursors increase"
            );
        }
        assert!(page.next_cursor >= page.records.last().map_or(0, |r| r.cursor));
        out.extend(page.records);
        cursor = Some(page.next_cursor);
    }
}

fn summary(records: &[UsageRecord]) -> Vec<(UsageKind, Option<ReservationId>)> {
    records
        .iter()
        .map(|r| (r.event.kind, r.event.reservation.as_ref().map(|res| res.id)))
        .collect()
}

/// An expiry is reported even when nothing wrote on its tenant for longer
/// than ended reservations are remembered (a day in this catalog), so the
/// observation that expires a hold also forgets it: a store down over a
/// weekend, or a tenant idle without a sweeper. Once for a hold a read saw
/// expire before the silence, once for a hold nothing saw.
pub(crate) async fn expiry_reported_after_a_long_silence(h: Harness) {
    let seen = h.hold("acme", &[], tokens(300)).await;
    let unseen = h.hold("acme", &[("user", "bob")], tokens(200)).await;
    h.set_ms(DEFAULT_TTL_MS);
    let read = h.store.get(seen).await.expect("get").expect("remembered");
    assert_eq!(read.status, Status::Expired, "a read observes the expiry");
    h.set_ms(DEFAULT_TTL_MS + 3 * DAY_MS);
    // The next write on the tenant, then a sweep: every store has reported
    // what expired by now.
    let next = h.hold("acme", &[], tokens(100)).await;
    h.store.expire_due().await.expect("expire_due");

    let all = all_after(&h, None, 1000, None).await;
    let mut ended = summary(&all);
    ended.sort_by_key(|(_, id)| id.map(|id| id.to_string()));
    let mut want = vec![
        (UsageKind::Expired, Some(seen)),
        (UsageKind::Expired, Some(unseen)),
    ];
    want.sort_by_key(|(_, id)| id.map(|id| id.to_string()));
    assert_eq!(ended, want, "both expiries, once each, nothing else");
    for r in &all {
        let res = r.event.reservation.as_ref().expect("a reservation");
        assert_eq!(
            (res.status, res.charged.clone(), res.late),
            (Status::Expired, None, false)
        );
        assert_eq!(r.event.at, res.expires_at);
        assert_eq!(res.expires_at.as_millis(), START_MS + DEFAULT_TTL_MS);
    }
    assert_eq!(
        h.store.get(next).await.expect("get").map(|r| r.status),
        Some(Status::Held)
    );
}

/// Settles, refunds, expiries (also a late settle after one) and
/// adjustments each appear once, in order, with what they charged; repeats
/// and denials add nothing; pages of any size join up; a tenant sees only
/// its own.
pub(crate) async fn usage_log_records_every_end(h: Harness) {
    let before = all_after(&h, None, 1000, None).await;
    assert!(before.is_empty(), "a new store has an empty usage log");

    let settled = h.hold("acme", &[("user", "bob")], tokens(1000)).await;
    let refunded = h.hold("beta", &[], tokens(500)).await;
    let expiring = h.hold("acme", &[], tokens(300)).await;
    h.settle(settled, &usage(tokens(800))).await;
    h.settle(settled, &usage(tokens(800))).await; // a repeat: no record
    h.refund(refunded).await;
    h.refund(refunded).await; // a repeat: no record
    h.set_ms(DEFAULT_TTL_MS); // `expiring` expires now…
    let late = h.settle(expiring, &usage(tokens(250))).await; // …and is settled late
    assert!(late.late);
    h.store
        .adjust(
            &key("tenant:acme"),
            Dimension::COST_MICROS,
            -5_000,
            "refund of a bad run",
        )
        .await
        .expect("adjust");

    let all = all_after(&h, None, 1000, None).await;
    assert_eq!(
        summary(&all),
        vec![
            (UsageKind::Settled, Some(settled)),
            (UsageKind::Refunded, Some(refunded)),
            (UsageKind::Expired, Some(expiring)),
            (UsageKind::Settled, Some(expiring)),
            (UsageKind::Adjusted, None),
        ],
        "each end once, in commit order"
    );
    let s = all[0].event.reservation.as_ref().expect("a reservation");
    assert_eq!(
        (s.status, s.charged.clone()),
        (Status::Settled, Some(tokens(800)))
    );
    assert_eq!(all[0].event.at.as_millis(), START_MS);
    let r = all[1].event.reservation.as_ref().expect("a reservation");
    assert_eq!((r.status, r.charged.clone()), (Status::Refunded, None));
    let e = all[2].event.reservation.as_ref().expect("a reservation");
    assert_eq!(
        (e.status, e.charged.clone(), e.late),
        (Status::Expired, None, false),
        "the expiry as it was, before the late settle"
    );
    assert_eq!(all[2].event.at, e.expires_at);
    let l = all[3].event.reservation.as_ref().expect("a reservation");
    assert_eq!(
        (l.status, l.late, l.charged.clone()),
        (Status::Settled, true, Some(tokens(250)))
    );
    let a = all[4].event.adjustment.as_ref().expect("an adjustment");
    assert_eq!(
        (a.scope.to_string(), a.dimension, a.credit),
        ("tenant:acme".to_owned(), Dimension::COST_MICROS, -5_000)
    );
    assert_eq!(
        a.reason, "refund of a bad run",
        "the reason is the audit trail"
    );
    assert_eq!(all[4].event.tenant(), Some("acme"));

    // Any page size gives the same log.
    for limit in [1, 2, 3] {
        assert_eq!(
            all_after(&h, None, limit, None).await,
            all,
            "pages of {limit}"
        );
    }
    // Resuming from any cursor gives exactly the rest.
    for (i, r) in all.iter().enumerate() {
        assert_eq!(all_after(&h, Some(r.cursor), 2, None).await, all[i + 1..]);
    }
    // A tenant's view: only its records, same cursors.
    let beta = all_after(&h, None, 1, Some("beta")).await;
    assert_eq!(summary(&beta), vec![(UsageKind::Refunded, Some(refunded))]);
    assert_eq!(beta[0].cursor, all[1].cursor);
    let acme = all_after(&h, None, 10, Some("acme")).await;
    assert_eq!(acme.len(), 4);

    // A hold that expires with no operation after it reaches the log when
    // the store's sweeper runs.
    let idle = h.hold("gamma", &[], tokens(10)).await;
    h.advance_ms(DEFAULT_TTL_MS);
    h.store.expire_due().await.expect("sweep");
    let rest = all_after(&h, Some(all[4].cursor), 10, None).await;
    assert_eq!(summary(&rest), vec![(UsageKind::Expired, Some(idle))]);
}
