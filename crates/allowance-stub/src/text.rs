//! The answer text: one word repeated, chosen so that each repetition is
//! exactly one `o200k_base` token and so `N` repetitions are `N` tokens.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The word every answer repeats: `" hello"`, with its leading space, one
/// token however many times it repeats (a test checks 1..=2000). A stream
/// sends one repetition per content delta; the whole text of an `N`-token
/// answer is `OUTPUT_WORD.repeat(N)` (so it starts with a space).
pub const OUTPUT_WORD: &str = " hello";

/// The answer text of `tokens` output tokens.
#[must_use]
pub fn output_text(tokens: u64) -> String {
    OUTPUT_WORD.repeat(usize::try_from(tokens).unwrap_or(usize::MAX))
}

/// Distinguishes ids across stub processes started at different times.
static ID_EPOCH: LazyLock<u64> = LazyLock::new(|| {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_micros()).unwrap_or(0) & 0xffff_ffff_ffff
        })
});
static ID_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh id such as `chatcmpl-…`, unique within the process.
pub(crate) fn new_id(prefix: &str) -> String {
    let n = ID_COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}stub{:012x}{n:08x}", *ID_EPOCH)
}

/// Unix time in seconds, the `created` of OpenAI objects.
pub(crate) fn unix_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}
