//! Random JSON for the property tests that throw arbitrary and near-valid
//! bodies at the HTTP API and the gateway.
//!
//! A [`Vocabulary`] names the words an API gives meaning to (field names,
//! string values, numbers at its edges); the strategies draw mostly from it,
//! so random objects reach the deeper checks instead of failing at the
//! first unknown field. Numbers stay as their JSON text ([`J::Num`]), so
//! `1e400`, `-0` and `18446744073709551616` reach the server as written,
//! which a `serde_json::Value` could not hold.
//!
//! ```
//! use allowance_testkit::fuzz::{J, Vocabulary, mutate, value};
//! use proptest::strategy::{Strategy, ValueTree};
//! use proptest::test_runner::TestRunner;
//!
//! const VOCABULARY: Vocabulary = Vocabulary {
//!     words: &["gpt-4o", ""],
//!     field_names: &["model", "max_tokens"],
//!     edge_numbers: &["0", "-1", "1e400"],
//!     free_text: "[a-z]{0,8}",
//! };
//! let template = J::object(vec![("model", J::string("gpt-4o")), ("max_tokens", J::number("5"))]);
//! let mut runner = TestRunner::deterministic();
//! let random = value(&VOCABULARY).new_tree(&mut runner).unwrap().current();
//! // Replace the first value, keep the second.
//! let choices = [(22u8, random), (0u8, J::Null)];
//! let mutated = mutate(&template, &mut choices.iter());
//! assert!(mutated.text().ends_with(r#""max_tokens":5}"#));
//! ```

use std::fmt::Write as _;

use proptest::prelude::*;

/// A JSON value kept as a tree and rendered by hand (numbers as raw text,
/// object keys in order, duplicates allowed).
#[derive(Debug, Clone)]
pub enum J {
    /// `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A number, as its JSON text.
    Num(String),
    /// A string (escaped when rendered).
    Str(String),
    /// An array.
    Arr(Vec<J>),
    /// An object, its fields in order.
    Obj(Vec<(String, J)>),
}

impl J {
    /// A string value.
    pub fn string(s: &str) -> J {
        J::Str(s.to_string())
    }

    /// A number, as its JSON text.
    pub fn number(text: &str) -> J {
        J::Num(text.to_string())
    }

    /// An object of `fields`, in order.
    pub fn object(fields: Vec<(&str, J)>) -> J {
        J::Obj(
            fields
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
        )
    }

    /// Appends the JSON text to `out`.
    pub fn render(&self, out: &mut String) {
        match self {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Num(n) => out.push_str(n),
            J::Str(s) => out.push_str(&serde_json::Value::String(s.clone()).to_string()),
            J::Arr(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    v.render(out);
                }
                out.push(']');
            }
            J::Obj(fields) => {
                out.push('{');
                for (i, (k, v)) in fields.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    let _ = write!(out, "{}:", serde_json::Value::String(k.clone()));
                    v.render(out);
                }
                out.push('}');
            }
        }
    }

    /// The JSON text.
    pub fn text(&self) -> String {
        let mut s = String::new();
        self.render(&mut s);
        s
    }
}

/// The words an API gives meaning to, which the strategies favour.
#[derive(Debug, Clone, Copy)]
pub struct Vocabulary {
    /// String values the API reads (names, kinds, units, empty).
    pub words: &'static [&'static str],
    /// Field names of its bodies (and of their nested objects).
    pub field_names: &'static [&'static str],
    /// Numbers at and beyond its edges, as JSON text.
    pub edge_numbers: &'static [&'static str],
    /// A regex for short free-form strings beside `words`.
    pub free_text: &'static str,
}

/// A number's JSON text: an edge, a small count, any `u64` / `i64`, or
/// any finite `f64` in exponent form.
pub fn number(v: &Vocabulary) -> impl Strategy<Value = String> + use<> {
    prop_oneof![
        3 => prop::sample::select(v.edge_numbers).prop_map(str::to_string),
        3 => (0u64..5_000).prop_map(|n| n.to_string()),
        1 => any::<u64>().prop_map(|n| n.to_string()),
        1 => any::<i64>().prop_map(|n| n.to_string()),
        1 => any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(|f| format!("{f:e}")),
    ]
}

/// A string: mostly a word of the vocabulary, else free text or any
/// printable characters.
pub fn string(v: &Vocabulary) -> impl Strategy<Value = String> + use<> {
    prop_oneof![
        3 => prop::sample::select(v.words).prop_map(str::to_string),
        1 => v.free_text,
        1 => "\\PC{0,16}",
    ]
}

/// An object key: mostly a field name, else any printable characters.
pub fn key(v: &Vocabulary) -> impl Strategy<Value = String> + use<> {
    prop_oneof![
        4 => prop::sample::select(v.field_names).prop_map(str::to_string),
        1 => "\\PC{0,10}",
    ]
}

/// Any JSON value up to 4 levels deep, object keys mostly field names.
pub fn value(v: &Vocabulary) -> impl Strategy<Value = J> + use<> {
    let leaf = prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::Bool),
        number(v).prop_map(J::Num),
        string(v).prop_map(J::Str),
    ];
    let v = *v;
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(J::Arr),
            prop::collection::vec((key(&v), inner), 0..6).prop_map(J::Obj),
        ]
    })
}

/// `template` with each object field, depth first, kept (22 times in 24),
/// its value replaced by the next choice's random value (22), or dropped
/// (23); a choice is used per field, and fields past the choices are kept.
pub fn mutate(template: &J, choices: &mut std::slice::Iter<'_, (u8, J)>) -> J {
    match template {
        J::Obj(fields) => J::Obj(
            fields
                .iter()
                .filter_map(|(k, v)| match choices.next() {
                    Some((22, random)) => Some((k.clone(), random.clone())),
                    Some((23, _)) => None,
                    _ => Some((k.clone(), mutate(v, choices))),
                })
                .collect(),
        ),
        J::Arr(items) => J::Arr(items.iter().map(|v| mutate(v, choices)).collect()),
        leaf => leaf.clone(),
    }
}
