//! Every refusal names its field, and nothing the providers would accept is
//! refused.

use allowance_estimate::{Api, Tokenizer, estimate, model_of};
use serde_json::{Value, json};

/// The field `estimate` refuses `body` for.
fn refused(api: Api, body: Value) -> String {
    match estimate(api, &body, Tokenizer::O200kBase) {
        Ok(e) => panic!("{api:?} accepted {body}: {e:?}"),
        Err(bad) => {
            assert!(!bad.message.is_empty());
            assert_eq!(bad.to_string(), format!("{}: {}", bad.field, bad.message));
            bad.field
        }
    }
}

fn accepted(api: Api, body: Value) {
    if let Err(bad) = estimate(api, &body, Tokenizer::O200kBase) {
        panic!("{api:?} refused {body}: {bad}");
    }
}

const ALL: [Api; 4] = [
    Api::ChatCompletions,
    Api::Responses,
    Api::Embeddings,
    Api::AnthropicMessages,
];

/// A valid body for `api`, plus `extra` fields (which replace).
fn body(api: Api, extra: Value) -> Value {
    let mut base = match api {
        Api::ChatCompletions => {
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
        }
        Api::Responses => json!({"model": "gpt-4o", "input": "hi"}),
        Api::Embeddings => json!({"model": "text-embedding-3-small", "input": "hi"}),
        Api::AnthropicMessages => json!({"model": "claude-sonnet-4-5", "max_tokens": 100,
            "messages": [{"role": "user", "content": "hi"}]}),
    };
    for (k, v) in extra.as_object().unwrap() {
        base[k] = v.clone();
    }
    base
}

fn without(mut body: Value, field: &str) -> Value {
    body.as_object_mut().unwrap().remove(field);
    body
}

// `model` must be a non-empty string, for every API, and is checked first.
#[test]
fn model() {
    for api in ALL {
        assert_eq!(
            refused(api, without(body(api, json!({})), "model")),
            "model"
        );
        for bad in [json!(null), json!(""), json!(4), json!(["gpt-4o"])] {
            assert_eq!(
                refused(api, body(api, json!({"model": bad, "stream": "x"}))),
                "model"
            );
        }
    }
    assert_eq!(model_of(&json!({"model": "gpt-4o"})), Ok("gpt-4o"));
    assert_eq!(model_of(&json!([])).unwrap_err().field, "model");
}

// A body that is not an object is refused as a whole.
#[test]
fn body_not_an_object() {
    for api in ALL {
        assert_eq!(refused(api, json!([1, 2])), "body");
    }
}

// `stream` must be a boolean; chat's `stream_options` an object with a
// boolean `include_usage`.
#[test]
fn stream_flags() {
    for api in ALL {
        assert_eq!(refused(api, body(api, json!({"stream": "true"}))), "stream");
        accepted(api, body(api, json!({"stream": null})));
    }
    let chat = Api::ChatCompletions;
    assert_eq!(
        refused(chat, body(chat, json!({"stream_options": true}))),
        "stream_options"
    );
    assert_eq!(
        refused(
            chat,
            body(chat, json!({"stream_options": {"include_usage": 1}}))
        ),
        "stream_options.include_usage"
    );
}

// Output caps must be integers from 0 to 2^53, each named; Anthropic's
// `max_tokens` is required.
#[test]
fn output_bounds() {
    let bad = [
        json!(-1),
        json!(1.5),
        json!("100"),
        json!(9_007_199_254_740_993_u64),
        json!(true),
    ];
    for (api, field) in [
        (Api::ChatCompletions, "max_tokens"),
        (Api::ChatCompletions, "max_completion_tokens"),
        (Api::Responses, "max_output_tokens"),
        (Api::AnthropicMessages, "max_tokens"),
    ] {
        for value in &bad {
            assert_eq!(
                refused(api, body(api, json!({field: value}))),
                field,
                "{value}"
            );
        }
        accepted(api, body(api, json!({field: 0})));
        accepted(api, body(api, json!({field: 9_007_199_254_740_992_u64})));
    }
    // A valid cap does not hide an invalid other one.
    let chat = Api::ChatCompletions;
    assert_eq!(
        refused(
            chat,
            body(chat, json!({"max_completion_tokens": 5, "max_tokens": -5}))
        ),
        "max_tokens"
    );
    let anthropic = Api::AnthropicMessages;
    assert_eq!(
        refused(anthropic, without(body(anthropic, json!({})), "max_tokens")),
        "max_tokens"
    );
    assert_eq!(
        refused(anthropic, body(anthropic, json!({"max_tokens": null}))),
        "max_tokens"
    );
}

// `messages` (chat, Anthropic) must be a non-empty array of objects whose
// content is a string or an array of part objects.
#[test]
fn messages() {
    for api in [Api::ChatCompletions, Api::AnthropicMessages] {
        assert_eq!(
            refused(api, without(body(api, json!({})), "messages")),
            "messages"
        );
        for bad in [json!([]), json!("hi"), json!({"role": "user"}), json!(null)] {
            assert_eq!(
                refused(api, body(api, json!({"messages": bad}))),
                "messages"
            );
        }
        let msgs = |third: Value| {
            json!({"messages": [
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, third]})
        };
        assert_eq!(refused(api, body(api, msgs(json!("hi")))), "messages[2]");
        for bad in [json!(5), json!(true), json!({"type": "text", "text": "x"})] {
            assert_eq!(
                refused(
                    api,
                    body(api, msgs(json!({"role": "user", "content": bad})))
                ),
                "messages[2].content"
            );
        }
        assert_eq!(
            refused(
                api,
                body(
                    api,
                    msgs(json!({"role": "user", "content": [{"type": "text", "text": "x"}, "y"]}))
                )
            ),
            "messages[2].content[1]"
        );
    }
    // OpenAI allows a null content (an assistant turn that only calls tools);
    // Anthropic does not.
    let null_content = json!({"messages": [{"role": "assistant", "content": null}]});
    accepted(
        Api::ChatCompletions,
        body(Api::ChatCompletions, null_content.clone()),
    );
    assert_eq!(
        refused(
            Api::AnthropicMessages,
            body(Api::AnthropicMessages, null_content)
        ),
        "messages[0].content"
    );
}

// Anthropic's `system` is a string or an array of block objects.
#[test]
fn anthropic_system() {
    let api = Api::AnthropicMessages;
    for bad in [json!(3), json!({"type": "text", "text": "x"}), json!(true)] {
        assert_eq!(refused(api, body(api, json!({"system": bad}))), "system");
    }
    assert_eq!(
        refused(
            api,
            body(api, json!({"system": [{"type": "text", "text": "x"}, 7]}))
        ),
        "system[1]"
    );
    accepted(api, body(api, json!({"system": "You are kind."})));
    accepted(
        api,
        body(
            api,
            json!({"system": [{"type": "text", "text": "You are kind."}]}),
        ),
    );
}

// Responses: `instructions` a string; `input` a string or an array of item
// objects with string or part-array content.
#[test]
fn responses_fields() {
    let api = Api::Responses;
    assert_eq!(
        refused(api, body(api, json!({"instructions": ["x"]}))),
        "instructions"
    );
    assert_eq!(refused(api, body(api, json!({"input": 42}))), "input");
    assert_eq!(
        refused(api, body(api, json!({"input": ["hi"]}))),
        "input[0]"
    );
    assert_eq!(
        refused(
            api,
            body(
                api,
                json!({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": 1}]})
            )
        ),
        "input[1].content"
    );
    assert_eq!(
        refused(
            api,
            body(api, json!({"input": [{"role": "user", "content": [7]}]}))
        ),
        "input[0].content[0]"
    );
    accepted(api, without(body(api, json!({})), "input"));
}

// Embeddings' `input`: a string, or a non-empty array of strings, token ids
// or token arrays.
#[test]
fn embeddings_input() {
    let api = Api::Embeddings;
    assert_eq!(
        refused(api, without(body(api, json!({})), "input")),
        "input"
    );
    for bad in [json!(null), json!(7), json!([]), json!({"text": "x"})] {
        assert_eq!(refused(api, body(api, json!({"input": bad}))), "input");
    }
    assert_eq!(
        refused(api, body(api, json!({"input": ["ok", null]}))),
        "input[1]"
    );
    assert_eq!(
        refused(api, body(api, json!({"input": [{"a": 1}]}))),
        "input[0]"
    );
}

// Unknown fields, unknown roles, odd part types and extra message fields
// pass: the provider validates those, and knows its own new features.
#[test]
fn unknown_things_pass() {
    accepted(
        Api::ChatCompletions,
        body(
            Api::ChatCompletions,
            json!({
                "future_option": {"x": [1, 2]},
                "messages": [
                    {"role": "narrator", "content": [{"type": "hologram", "data": "..."}], "mood": "calm"},
                    {"role": "user", "content": ""},
                ],
                "tools": "not even an array",
            }),
        ),
    );
    accepted(
        Api::AnthropicMessages,
        body(
            Api::AnthropicMessages,
            json!({
                "metadata": {"user_id": "u1"},
                "thinking": {"type": "enabled", "budget_tokens": 2048},
                "messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}],
            }),
        ),
    );
    accepted(
        Api::Responses,
        body(
            Api::Responses,
            json!({
                "reasoning": {"effort": "high"},
                "input": [{"type": "reasoning", "id": "rs_1", "summary": []}],
            }),
        ),
    );
}
