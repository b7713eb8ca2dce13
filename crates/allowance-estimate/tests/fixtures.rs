//! The fixtures are what they claim: the Anthropic and Responses shapes are
//! conversions of the chat ones, and the sized prompts have their size.
//!
//! `ALLOWANCE_BLESS=1 cargo test -p allowance-estimate --test fixtures`
//! rewrites the converted files after a chat fixture changes.

mod common;

use allowance_estimate::{Api, Tokenizer, estimate};
use common::*;

// Each committed Anthropic/Responses fixture equals the conversion of its
// chat fixture, so the shapes cannot drift apart.
#[test]
fn converted_fixtures_match_their_chat_source() {
    let bless = std::env::var_os("ALLOWANCE_BLESS").is_some();
    for name in CONVERTED_FIXTURES {
        let source = chat(name);
        for (file, converted) in [
            (format!("anthropic_{name}.json"), to_anthropic(&source)),
            (format!("responses_{name}.json"), to_responses(&source)),
        ] {
            if bless {
                let text = serde_json::to_string_pretty(&converted).unwrap() + "\n";
                std::fs::write(fixture_path(&file), text).unwrap();
            }
            assert_eq!(
                load(&file),
                converted,
                "{file} differs from the conversion of chat_{name}.json"
            );
        }
    }
}

// The sized fixtures are near their names in every shape (o200k_base), so
// benchmarks at "4K" measure about 4K tokens.
#[test]
fn sized_fixtures_have_their_size() {
    for (name, low, high) in [
        ("100", 80, 130),
        ("4k", 3_700, 4_300),
        ("32k", 30_000, 36_000),
    ] {
        for (api, body) in [
            (Api::ChatCompletions, chat(name)),
            (Api::AnthropicMessages, anthropic(name)),
            (Api::Responses, responses(name)),
        ] {
            let tokens = estimate(api, &body, Tokenizer::O200kBase)
                .unwrap()
                .input_tokens;
            assert!(
                (low..=high).contains(&tokens),
                "{api:?} {name}: {tokens} tokens"
            );
        }
    }
}

// The fixtures stay small enough to commit (the brief's budget: 300 KB).
#[test]
fn fixtures_fit_the_size_budget() {
    let dir = fixture_path("");
    let total: u64 = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert!(total < 300_000, "fixtures take {total} bytes");
}
