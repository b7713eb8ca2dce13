//! Tokenizer throughput and the cost of an estimate, cold and cached.
//!
//! - `tokenize/<fixture>`: `Tokenizer::count` (o200k_base, no cache) on the
//!   concatenated text of the English, code and multilingual fixtures;
//!   throughput in tokens.
//! - `estimate/chat_<size>/cold`: `estimate_uncached` on the 100-, 4K- and
//!   32K-token chat fixtures: everything tokenized.
//! - `estimate/chat_<size>/cached`: `estimate` on the same body again: what
//!   an agent's next turn costs when its new message is short.
//! - `estimate/chat_32k/next_turn`: the 32K conversation cached plus a new
//!   ~1K-token tool result never seen before (a fresh one each iteration).
//! - `estimate/{anthropic,responses}_4k/{cold,cached}`: the other shapes.
//!
//! Run: `cargo bench -p allowance-estimate -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use allowance_estimate::{Api, Tokenizer, estimate, estimate_uncached};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use serde_json::{Value, json};

#[path = "../tests/common/mod.rs"]
mod common;

/// Every string in a body, joined: the text a tokenizer sees.
fn all_text(v: &Value, out: &mut String) {
    match v {
        Value::String(s) => {
            out.push_str(s);
            out.push('\n');
        }
        Value::Array(items) => items.iter().for_each(|i| all_text(i, out)),
        Value::Object(fields) => fields.values().for_each(|f| all_text(f, out)),
        _ => {}
    }
}

fn tokenize(c: &mut Criterion) {
    let tokenizer = Tokenizer::O200kBase;
    tokenizer.warm_up();
    let mut group = c.benchmark_group("tokenize");
    for name in ["english", "code", "multilingual"] {
        let mut text = String::new();
        all_text(&common::chat(name)["messages"], &mut text);
        group.throughput(Throughput::Elements(tokenizer.count(&text)));
        group.bench_function(name, |b| b.iter(|| tokenizer.count(black_box(&text))));
    }
    group.finish();
}

fn bench_estimate(c: &mut Criterion, id: &str, api: Api, body: &Value) {
    let tokenizer = Tokenizer::O200kBase;
    let tokens = estimate_uncached(api, body, tokenizer)
        .expect("fixture is valid")
        .input_tokens;
    let mut group = c.benchmark_group(format!("estimate/{id}"));
    group.throughput(Throughput::Elements(tokens));
    group.bench_function("cold", |b| {
        b.iter(|| estimate_uncached(api, black_box(body), tokenizer))
    });
    estimate(api, body, tokenizer).expect("fixture is valid");
    group.bench_function("cached", |b| {
        b.iter(|| estimate(api, black_box(body), tokenizer))
    });
    group.finish();
}

fn estimates(c: &mut Criterion) {
    Tokenizer::O200kBase.warm_up();
    for size in ["100", "4k", "32k"] {
        bench_estimate(
            c,
            &format!("chat_{size}"),
            Api::ChatCompletions,
            &common::chat(size),
        );
    }
    bench_estimate(
        c,
        "anthropic_4k",
        Api::AnthropicMessages,
        &common::anthropic("4k"),
    );
    bench_estimate(c, "responses_4k", Api::Responses, &common::responses("4k"));

    // The next turn of a long conversation: the prefix is cached, the new
    // tool result (~1K tokens) is not: each iteration's is unique.
    let mut body = common::chat("32k");
    estimate(Api::ChatCompletions, &body, Tokenizer::O200kBase).expect("fixture is valid");
    let result_text = common::chat("4k")["messages"][3]["content"]
        .as_str()
        .expect("a tool result")
        .to_owned();
    let result_text: String = result_text.chars().take(4_000).collect();
    body["messages"]
        .as_array_mut()
        .expect("messages")
        .push(json!({"role": "tool", "tool_call_id": "call_x", "content": ""}));
    let mut turn = 0u64;
    c.bench_function("estimate/chat_32k/next_turn", |b| {
        b.iter(|| {
            turn += 1;
            let messages = body["messages"].as_array_mut().expect("messages");
            let last = messages.last_mut().expect("the new message");
            last["content"] = Value::String(format!("run {turn}\n{result_text}"));
            estimate(Api::ChatCompletions, black_box(&body), Tokenizer::O200kBase)
        })
    });
}

criterion_group!(benches, tokenize, estimates);
criterion_main!(benches);
