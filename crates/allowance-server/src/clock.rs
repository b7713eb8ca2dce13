//! The wall clock and random ids: the boundary's, never the engine's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use allowance_core::{Clock, IdSource, Timestamp};

/// The system clock in ms since the epoch, never going backwards: a wall
/// clock stepped back (NTP) reads as the latest instant already seen, so
/// holds never expire "twice" and windows never run backwards.
#[derive(Debug, Default)]
pub struct SystemClock {
    latest_ms: AtomicU64,
}

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        let wall_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let before = self.latest_ms.fetch_max(wall_ms, Ordering::Relaxed);
        Timestamp::from_millis(before.max(wall_ms))
    }
}

/// Reservation ids from the operating system's CSPRNG (via a thread-local
/// generator seeded from it): unguessable, so an id is a capability.
#[derive(Debug, Default, Clone, Copy)]
pub struct RandomIds;

impl IdSource for RandomIds {
    fn next_random(&self) -> u128 {
        rand::random()
    }
}
