//! Credentials: bearer tokens configured as SHA-256 hashes, each `admin`
//! or bound to one tenant. The presented token is hashed and compared in
//! constant time against every configured hash (no early exit), so timing
//! says nothing about which hash, or how much of one, matched.

use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::ApiError;

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// Everything (also: any caller when no tokens are configured).
    Admin,
    /// The data plane of one tenant, and reads of shared scopes.
    Tenant(String),
}

impl Principal {
    /// Whether this caller may act for `tenant`'s scopes and reservations.
    pub fn may_use(&self, tenant: &str) -> bool {
        match self {
            Principal::Admin => true,
            Principal::Tenant(t) => t == tenant,
        }
    }

    /// Admin-only routes.
    pub fn require_admin(&self) -> Result<(), ApiError> {
        match self {
            Principal::Admin => Ok(()),
            Principal::Tenant(_) => Err(ApiError::forbidden("this route needs an admin token")),
        }
    }
}

/// The caller, authenticated from the request's headers where they lie:
/// the `HeaderMap` extractor would clone every header of every request
/// only for this. The outcome is kept, not rejected, so a handler answers
/// 401 before it looks at the body, as it did when it authenticated itself.
pub(crate) struct Caller(pub Result<Principal, ApiError>);

impl axum::extract::FromRequestParts<crate::AppState> for Caller {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &crate::AppState,
    ) -> Result<Self, Self::Rejection> {
        Ok(Caller(state.credentials().authenticate(&parts.headers)))
    }
}

/// One configured credential.
#[derive(Debug, Clone)]
pub struct Credential {
    /// SHA-256 of the token.
    pub sha256: [u8; 32],
    /// `None`: admin; `Some(t)`: tenant `t`.
    pub tenant: Option<String>,
}

/// The configured credentials.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    list: Vec<Credential>,
}

impl Credentials {
    /// Credentials from a list; an empty list runs the server open.
    pub fn new(list: Vec<Credential>) -> Self {
        Credentials { list }
    }

    /// Whether no token is configured (every caller is admin).
    pub fn is_open(&self) -> bool {
        self.list.is_empty()
    }

    /// Who sent these headers: 401 when a token is needed and missing or
    /// unknown.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Principal, ApiError> {
        if self.is_open() {
            return Ok(Principal::Admin);
        }
        let Some(value) = headers.get(AUTHORIZATION) else {
            return Err(ApiError::unauthorized(
                "missing credentials: send Authorization: Bearer <token>",
            ));
        };
        let token = value
            .to_str()
            .ok()
            .and_then(bearer)
            .filter(|t| !t.is_empty());
        let Some(token) = token else {
            return Err(ApiError::unauthorized(
                "malformed Authorization header: expected Bearer <token>",
            ));
        };
        match matching(&self.list, |c| &c.sha256, token) {
            Some(Credential { tenant: None, .. }) => Ok(Principal::Admin),
            Some(Credential {
                tenant: Some(t), ..
            }) => Ok(Principal::Tenant(t.clone())),
            None => Err(ApiError::unauthorized("unknown token")),
        }
    }
}

/// The token of an `Authorization: Bearer <token>` value.
pub(crate) fn bearer(value: &str) -> Option<&str> {
    let (scheme, rest) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
}

/// The entry of `list` whose hash is the SHA-256 of `secret`, compared in
/// constant time against every entry (no early exit).
pub(crate) fn matching<'a, T>(
    list: &'a [T],
    hash: impl Fn(&T) -> &[u8; 32],
    secret: &str,
) -> Option<&'a T> {
    let digest: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
    let mut found = None;
    for entry in list {
        if bool::from(hash(entry).ct_eq(&digest)) {
            found = Some(entry);
        }
    }
    found
}

/// SHA-256 of a token, as configured (`sha256 = "…"`), lowercase hex.
pub fn token_sha256_hex(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// A new random token: `alw_` + 32 random bytes in hex (256 bits).
pub fn new_token() -> String {
    let bytes: [u8; 32] = rand::random();
    format!("alw_{}", hex::encode(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn creds() -> Credentials {
        let h = |t: &str| -> [u8; 32] { Sha256::digest(t.as_bytes()).into() };
        Credentials::new(vec![
            Credential {
                sha256: h("root"),
                tenant: None,
            },
            Credential {
                sha256: h("acme-key"),
                tenant: Some("acme".into()),
            },
        ])
    }

    fn with(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        h
    }

    #[test]
    fn roles_and_refusals() {
        let c = creds();
        assert_eq!(
            c.authenticate(&with("Bearer root")).unwrap(),
            Principal::Admin
        );
        assert_eq!(
            c.authenticate(&with("bearer acme-key")).unwrap(),
            Principal::Tenant("acme".into())
        );
        for bad in ["Bearer nope", "Basic cm9vdA==", "Bearer ", "root"] {
            let e = c.authenticate(&with(bad)).unwrap_err();
            assert_eq!(e.status(), 401, "{bad}");
        }
        assert_eq!(c.authenticate(&HeaderMap::new()).unwrap_err().status(), 401);
        assert_eq!(
            Credentials::default()
                .authenticate(&HeaderMap::new())
                .unwrap(),
            Principal::Admin
        );
    }

    #[test]
    fn tokens_hash_as_configured() {
        assert_eq!(
            token_sha256_hex("test"),
            "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
        );
        let t = new_token();
        assert_eq!(t.len(), 4 + 64);
        assert_ne!(t, new_token());
    }
}
