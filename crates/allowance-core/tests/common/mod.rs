//! Helpers shared by the integration tests that include this module.
#![allow(dead_code)] // each test binary uses its own subset

use std::sync::Mutex;

use allowance_core::{Committed, Journal, ReservationId, Status, UsageEvent};

/// A journal that records, in commit order (commits run under the shard
/// locks, so this is the ledger's own order), each reservation's reserve
/// (as `Held`) and settle (as `Settled`).
#[derive(Default)]
pub struct Changes(Mutex<Vec<(ReservationId, Status)>>);

impl Changes {
    /// Every change recorded so far, in commit order.
    pub fn so_far(&self) -> Vec<(ReservationId, Status)> {
        self.0.lock().expect("the journal's lock").clone()
    }

    /// How many changes were recorded so far.
    pub fn len(&self) -> usize {
        self.0.lock().expect("the journal's lock").len()
    }
}

impl Journal for Changes {
    type Ticket = ();
    fn commit(&self, change: &Committed<'_>, _usage: Vec<UsageEvent>) {
        let entry = match change {
            Committed::Reserve { id, .. } => (*id, Status::Held),
            Committed::Settle { id, .. } => (*id, Status::Settled),
            _ => return,
        };
        self.0.lock().expect("the journal's lock").push(entry);
    }
}
