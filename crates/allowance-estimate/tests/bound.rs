//! `estimate_bound` is never below the exact estimate, agrees with it on
//! everything but `input_tokens`, is exact once the cache knows every long
//! string, and refuses bad bodies with the same errors. (Its own test
//! binary: the cache is process-wide, and these tests clear it.)

mod common;

use allowance_estimate::{
    Api, BOUND_EXACT_BUDGET_BYTES, BOUND_EXACT_MAX_BYTES, Tokenizer, clear_count_cache, estimate,
    estimate_bound, estimate_uncached,
};
use common::{CHAT_FIXTURES, CONVERTED_FIXTURES, anthropic, chat, responses};
use proptest::prelude::*;
use serde_json::{Value, json};

/// Every fixture in every API shape it has.
fn bodies() -> Vec<(String, Api, Value)> {
    let mut out = Vec::new();
    for name in CHAT_FIXTURES {
        out.push((format!("chat_{name}"), Api::ChatCompletions, chat(name)));
    }
    for name in CONVERTED_FIXTURES {
        out.push((
            format!("anthropic_{name}"),
            Api::AnthropicMessages,
            anthropic(name),
        ));
        out.push((format!("responses_{name}"), Api::Responses, responses(name)));
    }
    out
}

// One test, not several: they would clear each other's cache.
#[test]
fn bound_is_an_upper_bound_then_exact_once_cached() {
    for tokenizer in [Tokenizer::O200kBase, Tokenizer::Cl100kBase] {
        clear_count_cache();
        for (name, api, body) in bodies() {
            let exact = estimate_uncached(api, &body, tokenizer).unwrap();
            let cold = estimate_bound(api, &body, tokenizer).unwrap();
            assert!(
                cold.estimate.input_tokens >= exact.input_tokens,
                "{name}: bound {} < exact {}",
                cold.estimate.input_tokens,
                exact.input_tokens
            );
            let mut same = cold.estimate.clone();
            same.input_tokens = exact.input_tokens;
            assert_eq!(same, exact, "{name}: only input_tokens may differ");
            if cold.exact {
                assert_eq!(cold.estimate, exact, "{name}: flagged exact");
            }
            // Counted once through the cache: the bound is the count.
            assert_eq!(estimate(api, &body, tokenizer).unwrap(), exact, "{name}");
            let warm = estimate_bound(api, &body, tokenizer).unwrap();
            assert!(warm.exact, "{name}: every string is cached now");
            assert_eq!(warm.estimate, exact, "{name}");
        }
        // The long prompts are bounded when cold, not tokenized.
        clear_count_cache();
        for name in ["4k", "32k"] {
            let cold = estimate_bound(Api::ChatCompletions, &chat(name), tokenizer).unwrap();
            let exact = estimate_uncached(Api::ChatCompletions, &chat(name), tokenizer).unwrap();
            assert!(!cold.exact, "chat_{name} cold");
            assert!(
                cold.estimate.input_tokens > exact.input_tokens,
                "chat_{name}"
            );
        }
        // Many short new strings: only a budget of them is tokenized, the
        // rest bounded (a body of thousands of short messages costs what a
        // long one does).
        clear_count_cache();
        let messages: Vec<Value> = (0..4_000)
            .map(
                |i| json!({"role": "user", "content": format!("short message number {i} says hi")}),
            )
            .collect();
        let body = json!({"model": "m", "messages": messages});
        let bound = estimate_bound(Api::ChatCompletions, &body, tokenizer).unwrap();
        let exact = estimate_uncached(Api::ChatCompletions, &body, tokenizer).unwrap();
        assert!(!bound.exact);
        assert!(bound.estimate.input_tokens > exact.input_tokens);
        // A bounded string adds (bytes − tokens) over the count; at most
        // budget / 26 of them (each is ≥ 26 bytes) were tokenized instead.
        let excess: Vec<u64> = (0..4_000)
            .map(|i| {
                let text = format!("short message number {i} says hi");
                text.len() as u64 - tokenizer.count(&text)
            })
            .collect();
        let all_bounded: u64 = excess.iter().sum();
        let most_spared = (BOUND_EXACT_BUDGET_BYTES / 26 + 1) as u64 * excess.iter().max().unwrap();
        let got = bound.estimate.input_tokens - exact.input_tokens;
        assert!(
            got + most_spared >= all_bounded,
            "only {got} over the count; bounding all but a budget's worth adds at least {}",
            all_bounded - most_spared
        );
    }
}

#[test]
fn bad_bodies_are_refused_alike() {
    let long = "x".repeat(BOUND_EXACT_MAX_BYTES * 4);
    let cases = [
        (Api::ChatCompletions, json!([1, 2])),
        (Api::ChatCompletions, json!({"messages": []})),
        (
            Api::ChatCompletions,
            json!({"model": "m", "messages": [{"role": "user", "content": long}, {"role": "user", "content": 7}]}),
        ),
        (
            Api::ChatCompletions,
            json!({"model": "m", "messages": [{"role": "user", "content": long}], "max_tokens": -1}),
        ),
        (
            Api::AnthropicMessages,
            json!({"model": "m", "messages": [{"role": "user", "content": long}]}),
        ),
        (
            Api::Responses,
            json!({"model": "m", "input": [{"role": "user", "content": long}], "stream": "yes"}),
        ),
    ];
    for (api, body) in cases {
        let want = estimate_uncached(api, &body, Tokenizer::O200kBase).unwrap_err();
        let got = estimate_bound(api, &body, Tokenizer::O200kBase).unwrap_err();
        assert_eq!(got, want, "{body}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("ALLOWANCE_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64)
    ))]

    /// Any text, in any script, bounds its own count.
    #[test]
    fn any_text_is_bounded(texts in proptest::collection::vec(".{0,600}", 1..6)) {
        let messages: Vec<Value> = texts
            .iter()
            .map(|t| json!({"role": "user", "content": t}))
            .collect();
        let body = json!({"model": "m", "messages": messages});
        for tokenizer in [Tokenizer::O200kBase, Tokenizer::Cl100kBase] {
            let exact = estimate_uncached(Api::ChatCompletions, &body, tokenizer).unwrap();
            let bound = estimate_bound(Api::ChatCompletions, &body, tokenizer).unwrap();
            prop_assert!(bound.estimate.input_tokens >= exact.input_tokens);
            if bound.exact {
                prop_assert_eq!(bound.estimate.input_tokens, exact.input_tokens);
            }
        }
    }
}
