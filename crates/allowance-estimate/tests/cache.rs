//! The cache changes the speed of an estimate, never its value: for random
//! conversations, with strings repeated across turns (cache hits), a cache
//! small enough to evict, and both tokenizers, the cached estimate equals
//! the uncached one. 64 cases by default; `ALLOWANCE_PROPTEST_CASES` for more.

use allowance_estimate::{
    Api, Tokenizer, count_cache_len, estimate, estimate_uncached, set_count_cache_capacity,
};
use proptest::prelude::*;
use serde_json::{Value, json};

/// A pool of texts: short and long ones, and near-duplicates of the long
/// ones that differ in one character at the end, which must not share an
/// entry.
fn text_pool() -> Vec<String> {
    let base = "Der schnelle braune Fuchs — 快速的棕色狐狸 — the quick brown fox 🦊 jumps.\n    indented(code);\n";
    let mut pool = vec![
        "".to_owned(),
        "ok".to_owned(),
        "Hello!".to_owned(),
        "<|endoftext|>".to_owned(),
    ];
    for n in [4, 9, 30] {
        let long = base.repeat(n);
        pool.push(format!("{long}!"));
        pool.push(format!("{long}?"));
        pool.push(long);
    }
    pool
}

#[derive(Clone, Debug)]
struct Msg {
    role: usize,
    text: usize,
    name: Option<usize>,
    call: Option<usize>,
    parts: bool,
}

fn msg() -> impl Strategy<Value = Msg> {
    (
        0..4usize,
        0..13usize,
        proptest::option::of(0..13usize),
        proptest::option::weighted(0.2, 0..13usize),
        any::<bool>(),
    )
        .prop_map(|(role, text, name, call, parts)| Msg {
            role,
            text,
            name,
            call,
            parts,
        })
}

fn chat_body(msgs: &[Msg], pool: &[String]) -> Value {
    const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];
    let messages: Vec<Value> = msgs
        .iter()
        .map(|m| {
            let text = &pool[m.text];
            let mut v = if m.parts {
                json!({"role": ROLES[m.role], "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": "x"}}]})
            } else {
                json!({"role": ROLES[m.role], "content": text})
            };
            if let Some(n) = m.name {
                v["name"] = json!(pool[n]);
            }
            if let Some(c) = m.call {
                v["tool_calls"] = json!([{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": pool[c]}}]);
            }
            v
        })
        .collect();
    json!({"model": "gpt-4o", "messages": messages, "tools": [{"type": "function", "function": {"name": "f", "description": pool[12]}}]})
}

fn cases() -> u32 {
    std::env::var("ALLOWANCE_PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(64)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn cached_equals_uncached(
        turns in proptest::collection::vec(proptest::collection::vec(msg(), 1..6), 1..5),
        cl100k in any::<bool>(),
    ) {
        // Small enough that a case's long strings evict each other.
        set_count_cache_capacity(8);
        let tokenizer = if cl100k { Tokenizer::Cl100kBase } else { Tokenizer::O200kBase };
        let pool = text_pool();
        // Each turn re-sends the conversation so far plus new messages, as an
        // agent does.
        let mut conversation = Vec::new();
        for turn in turns {
            conversation.extend(turn);
            let chat = chat_body(&conversation, &pool);
            let anthropic = json!({"model": "claude", "max_tokens": 10, "system": pool[9], "messages": chat["messages"]});
            let responses = json!({"model": "gpt-4o", "instructions": pool[6], "input": chat["messages"]});
            for (api, body) in [(Api::ChatCompletions, &chat), (Api::AnthropicMessages, &anthropic), (Api::Responses, &responses)] {
                let cold = estimate_uncached(api, body, tokenizer);
                let first = estimate(api, body, tokenizer);
                let second = estimate(api, body, tokenizer);
                prop_assert_eq!(&first, &cold);
                prop_assert_eq!(&second, &cold);
            }
        }
        prop_assert!(count_cache_len() <= 8 + 16, "the cache holds {} entries", count_cache_len());
    }
}
