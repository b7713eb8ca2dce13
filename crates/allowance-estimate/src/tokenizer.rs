//! The tokenizers, and the cache of token counts.
//!
//! Agents re-send their whole conversation every turn, so most of the text a
//! gateway sees was tokenized on an earlier request. Tokenizing costs ~0.7 µs
//! even for `"user"` (the regex pass has a fixed cost), ~3.5 µs for a tool
//! call id and ~0.7 ms for a 16 KB message; a cache lookup costs 0.1–0.2 µs
//! and hashing 16 KB ~1 µs. So every non-empty string's count is kept, keyed
//! by a 128-bit hash of the tokenizer and the text, and a turn tokenizes only
//! its new strings. Roles and ids are re-sent as faithfully as contents, so
//! short strings earn their entries as long ones do.
//!
//! The hash is xxh3-128 with a seed drawn once per process (and a different
//! one per tokenizer): a tenant cannot prepare two texts that collide in
//! every gateway, and a collision would only change an estimate (the
//! reservation), never the settled usage.
//!
//! The cache is quick_cache's S3-FIFO: a string seen once (a one-off
//! request) leaves soon; strings seen again (a conversation's prefix) stay.

use std::hash::BuildHasher;
use std::sync::LazyLock;

use quick_cache::sync::Cache;
use tiktoken_rs::CoreBPE;

/// How many counts the cache keeps by default: ~34 MB (an entry is a 16-byte
/// hash and a 4-byte count, ~68 bytes with the cache's tables, measured),
/// about 1,600 agents' 100-message conversations (~300 strings each).
pub const CACHE_CAPACITY_ENTRIES: usize = 500_000;

/// A byte-pair encoding whose token counts the estimate uses.
///
/// Counts are of `encode_ordinary`: text that looks like a special token
/// (`<|endoftext|>`) counts as ordinary text, as a provider counts user text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tokenizer {
    /// `o200k_base`: GPT-4o, GPT-4.1, o-series and GPT-5 models.
    O200kBase,
    /// `cl100k_base`: GPT-4, GPT-3.5 and the `text-embedding-3` models.
    Cl100kBase,
}

impl Tokenizer {
    /// The tokenizer named `name` (`o200k_base`, `cl100k_base`), as a
    /// configuration file spells it.
    pub fn from_name(name: &str) -> Option<Tokenizer> {
        match name {
            "o200k_base" => Some(Tokenizer::O200kBase),
            "cl100k_base" => Some(Tokenizer::Cl100kBase),
            _ => None,
        }
    }

    /// The tokenizer's name, the inverse of [`Tokenizer::from_name`].
    pub fn name(self) -> &'static str {
        match self {
            Tokenizer::O200kBase => "o200k_base",
            Tokenizer::Cl100kBase => "cl100k_base",
        }
    }

    /// The number of tokens in `text`, tokenized now (no cache).
    pub fn count(self, text: &str) -> u64 {
        if text.is_empty() {
            return 0;
        }
        // usize → u64 is lossless on every platform Rust supports.
        self.bpe().encode_ordinary(text).len() as u64
    }

    /// The count of `text` if the process-wide cache has it.
    pub(crate) fn lookup(self, text: &str) -> Option<u64> {
        if text.is_empty() {
            return Some(0);
        }
        let cache = &*COUNT_CACHE;
        cache.counts.get(&cache.key(self, text)).map(u64::from)
    }

    /// The number of tokens in `text`, from the process-wide cache if it was
    /// counted before (and kept there now if not).
    pub fn count_cached(self, text: &str) -> u64 {
        if text.is_empty() {
            return 0;
        }
        let cache = &*COUNT_CACHE;
        let key = cache.key(self, text);
        if let Some(count) = cache.counts.get(&key) {
            return u64::from(count);
        }
        let count = self.count(text);
        // A count past u32 needs a 4 GB string; such a one is not kept.
        if let Ok(small) = u32::try_from(count) {
            cache.counts.insert(key, small);
        }
        count
    }

    /// Loads the tokenizer's ranks now (~150 ms, once per process), so the
    /// first request does not pay for it. A server calls this at start-up.
    pub fn warm_up(self) {
        let _ = self.bpe();
        LazyLock::force(&COUNT_CACHE);
    }

    fn bpe(self) -> &'static CoreBPE {
        match self {
            Tokenizer::O200kBase => tiktoken_rs::o200k_base_singleton(),
            Tokenizer::Cl100kBase => tiktoken_rs::cl100k_base_singleton(),
        }
    }
}

impl std::fmt::Display for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Sets how many counts the process-wide cache keeps (default
/// [`CACHE_CAPACITY_ENTRIES`]); shrinking evicts at once.
pub fn set_count_cache_capacity(entries: u64) {
    COUNT_CACHE.counts.set_capacity(entries);
}

/// How many counts the process-wide cache holds now.
pub fn count_cache_len() -> usize {
    COUNT_CACHE.counts.len()
}

/// Empties the process-wide cache (benchmarks use it to measure cold runs).
pub fn clear_count_cache() {
    COUNT_CACHE.counts.clear();
}

/// xxh3-128 of the text, under the tokenizer's seed, as two words: a
/// `[u64; 2]` key packs with a `u32` count into 24 bytes, a `u128` would
/// align the entry to 32.
type CountKey = [u64; 2];

struct CountCache {
    seed: u64,
    counts: Cache<CountKey, u32>,
}

impl CountCache {
    fn key(&self, tokenizer: Tokenizer, text: &str) -> CountKey {
        let seed = self.seed.wrapping_add(tokenizer as u64);
        let hash = xxhash_rust::xxh3::xxh3_128_with_seed(text.as_bytes(), seed);
        [hash as u64, (hash >> 64) as u64]
    }
}

static COUNT_CACHE: LazyLock<CountCache> = LazyLock::new(|| CountCache {
    // `RandomState` is seeded from the OS once per process: the only source
    // of randomness std offers without a new dependency.
    seed: std::hash::RandomState::new().hash_one(0x5eed_u64),
    counts: Cache::new(CACHE_CAPACITY_ENTRIES),
});

#[cfg(test)]
mod tests {
    use super::*;

    // The names round-trip, and unknown names are refused rather than guessed.
    #[test]
    fn names_round_trip() {
        for t in [Tokenizer::O200kBase, Tokenizer::Cl100kBase] {
            assert_eq!(Tokenizer::from_name(t.name()), Some(t));
        }
        assert_eq!(Tokenizer::from_name("p50k_base"), None);
        assert_eq!(Tokenizer::from_name("O200K_BASE"), None);
    }

    // Counts are tiktoken's `encode_ordinary` lengths; special-token text is
    // ordinary text (7 tokens, not the single id 199999).
    #[test]
    fn counts_match_tiktoken() {
        let bpe = tiktoken_rs::o200k_base_singleton();
        for text in [
            "Hello!",
            "",
            "<|endoftext|>",
            "fn main() {\n    println!(\"hi\");\n}",
        ] {
            assert_eq!(
                Tokenizer::O200kBase.count(text),
                bpe.encode_ordinary(text).len() as u64
            );
        }
        assert!(Tokenizer::O200kBase.count("<|endoftext|>") > 1);
    }

    // A string counts the same through the cache, for each tokenizer; the
    // two tokenizers do not share entries; the first count fills the cache.
    #[test]
    fn cache_keeps_tokenizers_apart() {
        let text = format!("Übersetzung — 翻訳 — ترجمة. {}", line!()).repeat(20);
        let o = Tokenizer::O200kBase;
        let c = Tokenizer::Cl100kBase;
        assert_ne!(o.count(&text), c.count(&text));
        let cache = &*COUNT_CACHE;
        assert_ne!(cache.key(o, &text), cache.key(c, &text));
        assert!(!cache.counts.contains_key(&cache.key(o, &text)));
        for _ in 0..2 {
            assert_eq!(o.count_cached(&text), o.count(&text));
            assert_eq!(c.count_cached(&text), c.count(&text));
        }
        assert_eq!(
            cache.counts.get(&cache.key(o, &text)),
            Some(o.count(&text) as u32)
        );
        assert_eq!(
            cache.counts.get(&cache.key(c, &text)),
            Some(c.count(&text) as u32)
        );
        // The empty string is 0 tokens and takes no entry.
        assert_eq!(o.count_cached(""), 0);
        assert!(!cache.counts.contains_key(&cache.key(o, "")));
    }
}
