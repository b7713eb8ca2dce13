//! Reading a JSON body, failing at the boundary with the precise answer:
//! 415 for a body that is not `application/json`, 413 above the size limit
//! (inclusive: exactly the limit passes), 400 naming the field otherwise.

use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::header::CONTENT_TYPE;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// Native API bodies: at most 64 KiB.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// A body read and parsed; `Json<T>` with our errors.
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

/// A body that may be absent (refund): no bytes parse as `T::default()`.
#[derive(Debug)]
pub struct OptionalJsonBody<T>(pub T);

fn is_json(req: &Request) -> bool {
    is_json_content_type(req.headers())
}

/// Whether `headers` say the body is JSON (`application/json`, with
/// parameters or not, or a `…+json` type): the native API's and the
/// gateway's 415 rule.
pub(crate) fn is_json_content_type(headers: &axum::http::HeaderMap) -> bool {
    let Some(ct) = headers.get(CONTENT_TYPE) else {
        return false;
    };
    // What every client sends, checked before the general parse below.
    if ct.as_bytes().eq_ignore_ascii_case(b"application/json") {
        return true;
    }
    let Ok(ct) = ct.to_str() else { return false };
    let essence = ct.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
        || (essence.len() > 5
            && essence[..essence.len() - 5].contains('/')
            && essence.to_ascii_lowercase().ends_with("+json"))
}

async fn read(req: Request) -> Result<bytes::Bytes, ApiError> {
    let body: Body = req.into_body();
    // One byte over the limit is enough to know it is too large.
    match axum::body::to_bytes(body, MAX_BODY_BYTES).await {
        Ok(b) => Ok(b),
        Err(e) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            if too_large {
                Err(ApiError::payload_too_large(MAX_BODY_BYTES))
            } else {
                Err(ApiError::invalid(
                    None,
                    format!("could not read the body: {e}"),
                ))
            }
        }
    }
}

/// Parses `bytes` as `T`, naming the offending field's dotted path.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // Good bodies take serde_json's own path; only a failure is parsed
    // again, tracking the path to name the field (the tracking costs as
    // much as the parse itself, on every request).
    if let Ok(v) = serde_json::from_slice(bytes) {
        return Ok(v);
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let result: Result<T, _> = serde_path_to_error::deserialize(&mut de);
    let value = match result {
        Ok(v) => v,
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            return Err(json_error(path, &inner));
        }
    };
    if let Err(e) = de.end() {
        return Err(ApiError::invalid(
            None,
            format!("the body is not one JSON value: {}", strip_position(&e)),
        ));
    }
    Ok(value)
}

fn json_error(path: String, e: &serde_json::Error) -> ApiError {
    use serde_json::error::Category;
    match e.classify() {
        // A number beyond f64 (`1e400`) is valid JSON that serde_json
        // refuses as a syntax error: it is a bad value, so name its field.
        Category::Syntax if path != "." && !path.is_empty() && is_out_of_range(e) => {
            ApiError::invalid(Some(path), strip_position(e))
        }
        Category::Syntax | Category::Eof | Category::Io => ApiError::invalid(
            None,
            format!("the body is not valid JSON: {}", strip_position(e)),
        ),
        Category::Data => {
            let msg = strip_position(e);
            // serde names the unknown or missing field in its message; the
            // path points at the object that holds it.
            let field = if let Some(name) = quoted_after(&msg, "unknown field `") {
                // The path already ends at the unknown key (it was read as
                // one); a missing field is only in the message.
                if path == name || path.ends_with(&format!(".{name}")) {
                    path
                } else {
                    join(&path, &name)
                }
            } else if let Some(name) = quoted_after(&msg, "missing field `")
                .or_else(|| quoted_after(&msg, "duplicate field `"))
            {
                join(&path, &name)
            } else if path == "." {
                String::new()
            } else {
                path
            };
            ApiError::invalid((!field.is_empty()).then_some(field), msg)
        }
    }
}

fn is_out_of_range(e: &serde_json::Error) -> bool {
    e.to_string().starts_with("number out of range")
}

/// Every body of the native API is a JSON object. serde's derived structs
/// also accept an array of the fields in order, so `[]` would pass as an
/// empty refund body: refuse anything but an object before parsing.
fn require_object(bytes: &[u8]) -> Result<(), ApiError> {
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') | None => Ok(()),
        Some(b'[') => Err(ApiError::invalid(
            None,
            "the body must be a JSON object, not an array",
        )),
        // Anything else: let the parser say what is wrong with it.
        Some(_) => Ok(()),
    }
}

fn join(path: &str, name: &str) -> String {
    if path.is_empty() || path == "." {
        name.to_string()
    } else {
        format!("{path}.{name}")
    }
}

fn quoted_after(msg: &str, prefix: &str) -> Option<String> {
    let rest = &msg[msg.find(prefix)? + prefix.len()..];
    Some(rest[..rest.find('`')?].to_string())
}

/// serde_json appends " at line 1 column 17": useful, but the field path
/// says more and the position is noise in a one-line body.
fn strip_position(e: &serde_json::Error) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _: &S) -> Result<Self, Self::Rejection> {
        if !is_json(&req) {
            return Err(ApiError::unsupported_media_type());
        }
        let bytes = read(req).await?;
        require_object(&bytes)?;
        parse(&bytes).map(JsonBody)
    }
}

impl<S: Send + Sync, T: DeserializeOwned + Default> FromRequest<S> for OptionalJsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _: &S) -> Result<Self, Self::Rejection> {
        let declared_json = is_json(&req);
        let bytes = read(req).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(OptionalJsonBody(T::default()));
        }
        if !declared_json {
            return Err(ApiError::unsupported_media_type());
        }
        require_object(&bytes)?;
        parse(&bytes).map(OptionalJsonBody)
    }
}

/// A path's one parameter as text (`/v1/reservations/{id}`, a scope, a
/// plan's name). A parameter that is not UTF-8 once percent-decoded
/// (`%ff`) is a 400 in the API's error shape naming `path`: axum's own
/// answer is plain text.
#[derive(Debug)]
pub struct PathText(pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathText {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match Path::<String>::from_request_parts(parts, state).await {
            Ok(Path(text)) => Ok(PathText(text)),
            Err(e) => Err(ApiError::invalid(Some("path".into()), e.body_text())),
        }
    }
}
