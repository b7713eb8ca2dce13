//! The shared input-token formula, implemented here independently of the
//! gateway's estimator so that tests comparing the two mean something.
//!
//! `T(s)` is the number of `o200k_base` tokens of `s`, with special-token
//! text treated as ordinary text (`encode_ordinary`).
//!
//! A *message* (an object) counts `3`, plus for each of its fields:
//! - a string value: `T(value)`;
//! - `content` holding an array of parts: each part counts
//!   [`IMAGE_TOKENS`] if its `type` is `image_url`, `input_image` or `image`,
//!   else `T(text)` if it has a string `text`, else `T(compact JSON of the
//!   part)`;
//! - any other value (`tool_calls`, a number, `null`, an array outside
//!   `content`): `T(compact JSON of the value)`;
//!
//! plus `1` more when the message has a `name` key. Compact JSON is
//! `serde_json::to_string` of the parsed `serde_json::Value`.
//!
//! Each request adds [`REPLY_PRIMING_TOKENS`] (3), and `T(compact JSON)` of
//! its `tools` array (and of `functions`, for chat) when present and not
//! `null`. Embeddings have no overhead.

use std::sync::LazyLock;

use serde_json::{Map, Value};
use tiktoken_rs::CoreBPE;

/// What each message costs before its fields are counted.
pub const MESSAGE_OVERHEAD_TOKENS: u64 = 3;
/// What every chat-like request adds for the reply's priming.
pub const REPLY_PRIMING_TOKENS: u64 = 3;
/// What a `name` field adds beyond the tokens of its value.
pub const NAME_TOKENS: u64 = 1;
/// The flat price of one image part, whatever its size or detail.
pub const IMAGE_TOKENS: u64 = 765;

/// Part `type`s that count as an image.
const IMAGE_PART_TYPES: [&str; 3] = ["image_url", "input_image", "image"];

static TOKENIZER: LazyLock<&'static CoreBPE> = LazyLock::new(tiktoken_rs::o200k_base_singleton);

/// A body the formula cannot be applied to; the field is a JSON path such as
/// `messages[2]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct FormulaError {
    /// Where in the body the problem is (`messages`, `input[3]`, `tools`).
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

impl FormulaError {
    fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// `T(text)`: the `o200k_base` token count of `text`, special-token text
/// counted as ordinary text.
#[must_use]
pub fn token_count(text: &str) -> u64 {
    TOKENIZER.encode_ordinary(text).len() as u64
}

fn json_tokens(value: &Value) -> u64 {
    // Serializing a `Value` cannot fail: its keys are strings already.
    token_count(&serde_json::to_string(value).unwrap_or_default())
}

fn part_tokens(part: &Value) -> u64 {
    if let Value::Object(fields) = part {
        let is_image = matches!(
            fields.get("type"),
            Some(Value::String(kind)) if IMAGE_PART_TYPES.contains(&kind.as_str())
        );
        if is_image {
            return IMAGE_TOKENS;
        }
        if let Some(Value::String(text)) = fields.get("text") {
            return token_count(text);
        }
    }
    json_tokens(part)
}

fn content_tokens(content: &Value) -> u64 {
    match content {
        Value::String(text) => token_count(text),
        Value::Array(parts) => parts.iter().map(part_tokens).sum(),
        other => json_tokens(other),
    }
}

/// Tokens of one message by the chat rule (see the module docs).
#[must_use]
pub fn message_tokens(message: &Map<String, Value>) -> u64 {
    let mut total = MESSAGE_OVERHEAD_TOKENS;
    for (key, value) in message {
        total += match (key.as_str(), value) {
            (_, Value::String(text)) => token_count(text),
            ("content", content) => content_tokens(content),
            (_, other) => json_tokens(other),
        };
        if key == "name" {
            total += NAME_TOKENS;
        }
    }
    total
}

/// A message `{role, content}` made up from a top-level field
/// (`instructions`, `system`, a string `input`).
fn synthetic_message_tokens(role: &str, content: &Value) -> u64 {
    MESSAGE_OVERHEAD_TOKENS + token_count(role) + content_tokens(content)
}

fn message_list_tokens(
    body: &Map<String, Value>,
    field: &str,
    required: bool,
) -> Result<u64, FormulaError> {
    let messages = match body.get(field) {
        Some(Value::Array(messages)) => messages,
        None | Some(Value::Null) if !required => return Ok(0),
        None | Some(Value::Null) => return Err(FormulaError::new(field, "is required")),
        Some(_) => {
            return Err(FormulaError::new(
                field,
                "must be an array of message objects",
            ));
        }
    };
    let mut total = 0;
    for (index, message) in messages.iter().enumerate() {
        let Value::Object(message) = message else {
            return Err(FormulaError::new(
                format!("{field}[{index}]"),
                "must be an object",
            ));
        };
        total += message_tokens(message);
    }
    Ok(total)
}

fn tool_list_tokens(body: &Map<String, Value>, field: &str) -> Result<u64, FormulaError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(0),
        Some(tools @ Value::Array(_)) => Ok(json_tokens(tools)),
        Some(_) => Err(FormulaError::new(field, "must be an array")),
    }
}

/// Input tokens of a `POST /v1/chat/completions` body.
///
/// # Errors
/// When `messages` is missing or not an array of objects, or `tools` /
/// `functions` is not an array.
pub fn chat_input_tokens(body: &Map<String, Value>) -> Result<u64, FormulaError> {
    let messages = message_list_tokens(body, "messages", true)?;
    let tools = tool_list_tokens(body, "tools")? + tool_list_tokens(body, "functions")?;
    Ok(messages + REPLY_PRIMING_TOKENS + tools)
}

/// Input tokens of a `POST /v1/responses` body: `instructions` as a system
/// message, a string `input` as a user message, an array `input` item by
/// item by the chat rule.
///
/// # Errors
/// When `instructions` is not a string, `input` is neither a string nor an
/// array of objects, or `tools` is not an array.
pub fn responses_input_tokens(body: &Map<String, Value>) -> Result<u64, FormulaError> {
    let instructions = match body.get("instructions") {
        None | Some(Value::Null) => 0,
        Some(text @ Value::String(_)) => synthetic_message_tokens("system", text),
        Some(_) => return Err(FormulaError::new("instructions", "must be a string")),
    };
    let input = match body.get("input") {
        Some(text @ Value::String(_)) => synthetic_message_tokens("user", text),
        _ => message_list_tokens(body, "input", false)?,
    };
    Ok(instructions + input + REPLY_PRIMING_TOKENS + tool_list_tokens(body, "tools")?)
}

/// Input tokens of an Anthropic `POST /v1/messages` body: `system` (a
/// string or an array of blocks) as a system message, then `messages` by the
/// chat rule.
///
/// # Errors
/// When `messages` is missing or not an array of objects, `system` is
/// neither a string nor an array, or `tools` is not an array.
pub fn messages_input_tokens(body: &Map<String, Value>) -> Result<u64, FormulaError> {
    let system = match body.get("system") {
        None | Some(Value::Null) => 0,
        Some(system @ (Value::String(_) | Value::Array(_))) => {
            synthetic_message_tokens("system", system)
        }
        Some(_) => {
            return Err(FormulaError::new(
                "system",
                "must be a string or an array of blocks",
            ));
        }
    };
    let messages = message_list_tokens(body, "messages", true)?;
    Ok(system + messages + REPLY_PRIMING_TOKENS + tool_list_tokens(body, "tools")?)
}

/// Input tokens of a `POST /v1/embeddings` body: a string `input` counts
/// `T(input)`; an array of strings the sum of theirs; an array of token
/// arrays the sum of their lengths (and one token array, its length).
///
/// # Errors
/// When `input` is missing or of another shape, or mixes kinds.
pub fn embeddings_input_tokens(body: &Map<String, Value>) -> Result<u64, FormulaError> {
    let items = match body.get("input") {
        Some(Value::String(text)) => return Ok(token_count(text)),
        Some(Value::Array(items)) => items,
        None | Some(Value::Null) => return Err(FormulaError::new("input", "is required")),
        Some(_) => {
            return Err(FormulaError::new(
                "input",
                "must be a string, an array of strings or an array of token arrays",
            ));
        }
    };
    if items.iter().all(Value::is_u64) {
        // One pre-tokenized input: its tokens are already counted.
        return Ok(items.len() as u64);
    }
    let mut total = 0;
    for (index, item) in items.iter().enumerate() {
        total += match item {
            Value::String(text) => token_count(text),
            Value::Array(tokens) if tokens.iter().all(Value::is_u64) => tokens.len() as u64,
            _ => {
                return Err(FormulaError::new(
                    format!("input[{index}]"),
                    "must be a string or an array of token ids, like the other items",
                ));
            }
        };
    }
    if items.iter().any(Value::is_string) && items.iter().any(Value::is_array) {
        return Err(FormulaError::new(
            "input",
            "must not mix strings and token arrays",
        ));
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => Map::new(),
        }
    }

    // The brief's worked example, spelled out.
    #[test]
    fn worked_example() {
        let body = object(json!({"messages": [{"role": "user", "content": "Hello!"}]}));
        let expected = 3 + token_count("user") + token_count("Hello!") + 3;
        assert_eq!(chat_input_tokens(&body), Ok(expected));
    }

    #[test]
    fn special_token_text_is_ordinary() {
        assert!(token_count("<|endoftext|>") > 1);
    }

    #[test]
    fn name_adds_one() {
        let with = object(json!({"role": "user", "name": "bob", "content": "x"}));
        let without = object(json!({"role": "user", "content": "x"}));
        assert_eq!(
            message_tokens(&with),
            message_tokens(&without) + token_count("bob") + 1
        );
    }

    #[test]
    fn parts_images_and_other_values() {
        let message = object(json!({
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:"}},
                {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}
            ],
            "tool_calls": [{"id": "c1"}]
        }));
        let audio = json!({"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}});
        let expected = 3
            + token_count("user")
            + token_count("look")
            + IMAGE_TOKENS
            + token_count(&serde_json::to_string(&audio).unwrap_or_default())
            + token_count(r#"[{"id":"c1"}]"#);
        assert_eq!(message_tokens(&message), expected);
    }

    #[test]
    fn bad_shapes_name_the_field() {
        let body = object(json!({"messages": [{"role": "user"}, "hi"]}));
        let error = chat_input_tokens(&body).err();
        assert_eq!(error.map(|e| e.field), Some("messages[1]".to_owned()));
        let body = object(json!({"input": [["a"]]}));
        let error = embeddings_input_tokens(&body).err();
        assert_eq!(error.map(|e| e.field), Some("input[0]".to_owned()));
        let body = object(json!({"input": ["a", [1, 2]]}));
        assert!(embeddings_input_tokens(&body).is_err());
    }

    #[test]
    fn embeddings_shapes() {
        let ids = object(json!({"input": [[1, 2, 3], [4]]}));
        assert_eq!(embeddings_input_tokens(&ids), Ok(4));
        let flat = object(json!({"input": [7, 8]}));
        assert_eq!(embeddings_input_tokens(&flat), Ok(2));
        let strings = object(json!({"input": ["a b", "c"]}));
        assert_eq!(
            embeddings_input_tokens(&strings),
            Ok(token_count("a b") + token_count("c"))
        );
    }
}
