//! A model call's request, checked: what the answer needs from the body.

use serde_json::{Map, Value};

use crate::formula;

/// Largest `dimensions` an embeddings call may ask for.
pub(crate) const MAX_EMBEDDING_DIMENSIONS: u32 = 4096;
/// The vector length when a call does not ask (text-embedding-3-small's).
pub(crate) const DEFAULT_EMBEDDING_DIMENSIONS: u32 = 1536;

/// The model endpoints the stub serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Chat,
    Responses,
    Embeddings,
    Messages,
}

/// Whose wire shapes (errors, headers) an endpoint speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Provider {
    OpenAi,
    Anthropic,
}

impl Endpoint {
    pub(crate) fn path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Responses => "/v1/responses",
            Self::Embeddings => "/v1/embeddings",
            Self::Messages => "/v1/messages",
        }
    }

    pub(crate) fn provider(self) -> Provider {
        match self {
            Self::Messages => Provider::Anthropic,
            _ => Provider::OpenAi,
        }
    }

    /// The fields that bound the output, in the order they are checked.
    fn bound_fields(self) -> &'static [&'static str] {
        match self {
            Self::Chat => &["max_completion_tokens", "max_tokens"],
            Self::Responses => &["max_output_tokens"],
            Self::Messages => &["max_tokens"],
            Self::Embeddings => &[],
        }
    }
}

/// A request the stub refuses with 400; `param` names the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BadRequest {
    pub(crate) param: Option<String>,
    pub(crate) message: String,
}

impl BadRequest {
    pub(crate) fn new(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            param: param.map(str::to_owned),
            message: message.into(),
        }
    }

    fn field(param: &str, reason: &str) -> Self {
        Self::new(Some(param), format!("{param}: {reason}"))
    }
}

/// How an embeddings call wants its vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EmbeddingShape {
    pub(crate) inputs: usize,
    pub(crate) dimensions: u32,
    pub(crate) base64: bool,
}

/// A checked model call.
#[derive(Debug, Clone)]
pub(crate) struct Call {
    pub(crate) endpoint: Endpoint,
    pub(crate) model: String,
    pub(crate) stream: bool,
    /// Chat only: `stream_options.include_usage`.
    pub(crate) include_usage: bool,
    /// The smallest of the request's output bounds.
    pub(crate) bound: Option<u64>,
    pub(crate) input_tokens: u64,
    pub(crate) embedding: Option<EmbeddingShape>,
    /// Responses only: request fields the real API echoes in its answer.
    pub(crate) echo: Map<String, Value>,
    /// Hidden reasoning tokens of the answer (set when it is made): in the
    /// usage's output, never in the text.
    pub(crate) reasoning_tokens: u64,
}

fn optional_bool(body: &Map<String, Value>, field: &str) -> Result<bool, BadRequest> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(flag)) => Ok(*flag),
        Some(_) => Err(BadRequest::field(field, "must be a boolean")),
    }
}

fn optional_positive(body: &Map<String, Value>, field: &str) -> Result<Option<u64>, BadRequest> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => match value.as_u64() {
            Some(n) if n >= 1 => Ok(Some(n)),
            _ => Err(BadRequest::field(field, "must be an integer of at least 1")),
        },
    }
}

fn model(body: &Map<String, Value>, provider: Provider) -> Result<String, BadRequest> {
    match body.get("model") {
        Some(Value::String(model)) if !model.is_empty() => Ok(model.clone()),
        None | Some(Value::Null) => Err(BadRequest::new(
            Some("model"),
            match provider {
                Provider::OpenAi => "you must provide a model parameter",
                Provider::Anthropic => "model: Field required",
            },
        )),
        Some(_) => Err(BadRequest::field("model", "must be a non-empty string")),
    }
}

fn include_usage(body: &Map<String, Value>, stream: bool) -> Result<bool, BadRequest> {
    let options = match body.get("stream_options") {
        None | Some(Value::Null) => return Ok(false),
        Some(Value::Object(options)) => options,
        Some(_) => return Err(BadRequest::field("stream_options", "must be an object")),
    };
    if !stream {
        // The real API refuses this too; a gateway that adds it to
        // non-streaming calls should learn so here.
        return Err(BadRequest::new(
            Some("stream_options"),
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
        ));
    }
    match options.get("include_usage") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(flag)) => Ok(*flag),
        Some(_) => Err(BadRequest::field(
            "stream_options.include_usage",
            "must be a boolean",
        )),
    }
}

fn embedding_shape(body: &Map<String, Value>) -> Result<EmbeddingShape, BadRequest> {
    let inputs = match body.get("input") {
        Some(Value::Array(items)) if items.iter().all(Value::is_u64) => 1,
        Some(Value::Array(items)) => items.len(),
        _ => 1,
    };
    let dimensions = match body.get("dimensions") {
        None | Some(Value::Null) => DEFAULT_EMBEDDING_DIMENSIONS,
        Some(value) => match value.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) if (1..=MAX_EMBEDDING_DIMENSIONS).contains(&n) => n,
            _ => {
                return Err(BadRequest::field(
                    "dimensions",
                    &format!("must be an integer in 1..={MAX_EMBEDDING_DIMENSIONS}"),
                ));
            }
        },
    };
    let base64 = match body.get("encoding_format") {
        None | Some(Value::Null) => false,
        Some(Value::String(format)) if format == "float" => false,
        Some(Value::String(format)) if format == "base64" => true,
        Some(_) => {
            return Err(BadRequest::field(
                "encoding_format",
                "must be \"float\" or \"base64\"",
            ));
        }
    };
    Ok(EmbeddingShape {
        inputs,
        dimensions,
        base64,
    })
}

impl Call {
    /// Checks `body` for `endpoint` and applies the input formula.
    pub(crate) fn parse(endpoint: Endpoint, body: &Value) -> Result<Self, BadRequest> {
        let Value::Object(body) = body else {
            return Err(BadRequest::new(
                None,
                "the request body must be a JSON object",
            ));
        };
        let model = model(body, endpoint.provider())?;
        // Embeddings have no streaming form; a `stream` key there is ignored.
        let stream = endpoint != Endpoint::Embeddings && optional_bool(body, "stream")?;
        let include_usage = if endpoint == Endpoint::Chat {
            include_usage(body, stream)?
        } else {
            false
        };
        let mut bound: Option<u64> = None;
        for field in endpoint.bound_fields() {
            if let Some(n) = optional_positive(body, field)? {
                bound = Some(bound.map_or(n, |b| b.min(n)));
            }
        }
        let counted = match endpoint {
            Endpoint::Chat => formula::chat_input_tokens(body),
            Endpoint::Responses => formula::responses_input_tokens(body),
            Endpoint::Messages => formula::messages_input_tokens(body),
            Endpoint::Embeddings => formula::embeddings_input_tokens(body),
        };
        let input_tokens = counted.map_err(|e| BadRequest::field(&e.field, &e.reason))?;
        let embedding = match endpoint {
            Endpoint::Embeddings => Some(embedding_shape(body)?),
            _ => None,
        };
        let mut echo = Map::new();
        if endpoint == Endpoint::Responses {
            for field in [
                "instructions",
                "max_output_tokens",
                "tools",
                "metadata",
                "previous_response_id",
            ] {
                if let Some(value) = body.get(field) {
                    echo.insert(field.to_owned(), value.clone());
                }
            }
        }
        Ok(Self {
            endpoint,
            model,
            stream,
            include_usage,
            bound,
            input_tokens,
            embedding,
            echo,
            reasoning_tokens: 0,
        })
    }

    /// Output tokens of the answer: the behaviour's, within the request's
    /// bound.
    pub(crate) fn output_tokens(&self, behavior_tokens: u32) -> u64 {
        let tokens = u64::from(behavior_tokens);
        self.bound.map_or(tokens, |bound| bound.min(tokens))
    }

    /// Reasoning tokens of the answer: the behaviour's, within what the
    /// request's bound leaves after `output_tokens` of text.
    pub(crate) fn reasoning_tokens(&self, behavior_reasoning: u32, output_tokens: u64) -> u64 {
        let tokens = u64::from(behavior_reasoning);
        self.bound.map_or(tokens, |bound| {
            tokens.min(bound.saturating_sub(output_tokens))
        })
    }

    /// Whether the request's bound, not the behaviour, ended the output.
    pub(crate) fn hit_bound(&self, behavior_tokens: u32) -> bool {
        self.bound
            .is_some_and(|bound| bound < u64::from(behavior_tokens))
    }
}
