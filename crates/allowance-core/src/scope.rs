//! Scope names: what a ceiling is counted against.
//!
//! Scopes of ordinary kinds live inside a tenant and their canonical name
//! carries it (`tenant:acme/user:bob`); the tenant itself is `tenant:acme`;
//! scopes of a kind configured `shared` are global (`upstream:openai`).
//! Kinds match `[a-z][a-z0-9_-]{0,31}`, ids `[A-Za-z0-9._~@+=-]{1,128}`.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, LazyLock};

use serde::de::{self, SeqAccess, Visitor};
use serde::ser::SerializeSeq;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::catalog::MAX_SCOPES_LIMIT;
use crate::error::Invalid;

/// Longest kind name (TigerStyle: a limit on everything).
pub const MAX_KIND_LEN: usize = 32;
/// Longest scope id.
pub const MAX_ID_LEN: usize = 128;
/// The kind every tenant scope has.
pub const TENANT_KIND: &str = "tenant";

/// Whether `kind` is a valid kind name.
pub fn valid_kind(kind: &str) -> bool {
    let b = kind.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_KIND_LEN
        && b[0].is_ascii_lowercase()
        && b[1..]
            .iter()
            .all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_' || c == b'-')
}

/// Whether `id` is a valid scope id (tenant names included).
pub fn valid_id(id: &str) -> bool {
    let b = id.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_ID_LEN
        && b.iter()
            .all(|&c| c.is_ascii_alphanumeric() || b"._~@+=-".contains(&c))
}

/// A canonical scope name, cheap to clone (one reference count).
///
/// Equality, order and hashing are those of the canonical string, so maps
/// keyed by `ScopeKey` can be searched with a `&str`.
#[derive(Clone)]
pub struct ScopeKey {
    name: Arc<str>,
    /// The name's hash under this process's random seed, made once with
    /// the key: the ledger's scope index uses it, so an operation on a
    /// request's scopes hashes no name (requests and their keys are built
    /// once and reused).
    hash: u64,
}

/// The seed of [`ScopeKey`]'s hashes: random per process, so that names a
/// tenant chooses cannot aim at collisions.
static NAME_HASHER: LazyLock<foldhash::fast::RandomState> = LazyLock::new(Default::default);

impl PartialEq for ScopeKey {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.name, &other.name)
            || (self.hash == other.hash && *self.name == *other.name)
    }
}

impl Eq for ScopeKey {}

impl PartialOrd for ScopeKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ScopeKey {
    fn cmp(&self, other: &Self) -> Ordering {
        self.name.cmp(&other.name)
    }
}

impl ScopeKey {
    /// The tenant scope `tenant:{tenant}`.
    pub fn tenant(tenant: &str) -> Result<ScopeKey, Invalid> {
        if !valid_id(tenant) {
            return Err(Invalid::new(
                "tenant",
                format!("invalid tenant {tenant:?}: expected [A-Za-z0-9._~@+=-]{{1,128}}"),
            ));
        }
        // `concat`, not `format!`: every reservation names its tenant.
        Ok(ScopeKey::from_name(
            [TENANT_KIND, ":", tenant].concat().into(),
        ))
    }

    /// A scope of `kind` inside `tenant` (`tenant:{tenant}/{kind}:{id}`), or a
    /// global one (`{kind}:{id}`) when `shared`. `field` names the input in
    /// errors (e.g. `scopes.user`).
    pub fn new(
        tenant: &str,
        kind: &str,
        id: &str,
        shared: bool,
        field: &str,
    ) -> Result<ScopeKey, Invalid> {
        if !valid_kind(kind) {
            return Err(Invalid::new(
                field,
                format!("invalid kind {kind:?}: expected [a-z][a-z0-9_-]{{0,31}}"),
            ));
        }
        if kind == TENANT_KIND {
            return Err(Invalid::new(
                field,
                "the tenant scope is implied; name it with `tenant`",
            ));
        }
        if !valid_id(id) {
            return Err(Invalid::new(
                field,
                format!("invalid id {id:?}: expected [A-Za-z0-9._~@+=-]{{1,128}}"),
            ));
        }
        if shared {
            return Ok(ScopeKey::from_name([kind, ":", id].concat().into()));
        }
        if !valid_id(tenant) {
            return Err(Invalid::new("tenant", format!("invalid tenant {tenant:?}")));
        }
        Ok(ScopeKey::from_name(
            [TENANT_KIND, ":", tenant, "/", kind, ":", id]
                .concat()
                .into(),
        ))
    }

    /// Parses a canonical name (`tenant:acme`, `tenant:acme/user:bob`,
    /// `tool:search`) without consulting any configuration: whether the kind
    /// exists, and is shared, is the catalog's business.
    pub fn parse(name: &str) -> Result<ScopeKey, Invalid> {
        let bad = || Invalid::new("scope", format!("invalid scope name {name:?}"));
        let (first, rest) = match name.split_once('/') {
            Some((a, b)) => (a, Some(b)),
            None => (name, None),
        };
        let (k, id) = first.split_once(':').ok_or_else(bad)?;
        if !valid_kind(k) || !valid_id(id) {
            return Err(bad());
        }
        if let Some(rest) = rest {
            let (k2, id2) = rest.split_once(':').ok_or_else(bad)?;
            if k != TENANT_KIND || k2 == TENANT_KIND || !valid_kind(k2) || !valid_id(id2) {
                return Err(bad());
            }
        }
        Ok(ScopeKey::from_name(name.into()))
    }

    /// A key for a name already checked.
    fn from_name(name: Arc<str>) -> ScopeKey {
        let hash = NAME_HASHER.hash_one(&*name);
        ScopeKey { name, hash }
    }

    /// The name's hash for the ledger's scope index (see the field).
    #[inline]
    pub(crate) fn index_hash(&self) -> u64 {
        self.hash
    }

    /// The canonical name.
    pub fn as_str(&self) -> &str {
        &self.name
    }

    /// The scope's kind (`tenant`, `user`, `tool`…).
    pub fn kind(&self) -> &str {
        let last = self.last_part();
        let end = last.bytes().position(|b| b == b':').unwrap_or(last.len());
        &last[..end]
    }

    /// The scope's id within its kind.
    pub fn id(&self) -> &str {
        let last = self.last_part();
        last.bytes()
            .position(|b| b == b':')
            .map_or("", |i| &last[i + 1..])
    }

    /// The tenant a tenant-namespaced scope belongs to; `None` for a shared scope.
    pub fn tenant_name(&self) -> Option<&str> {
        let rest = self.name.strip_prefix("tenant:")?;
        let end = rest.bytes().position(|b| b == b'/').unwrap_or(rest.len());
        Some(&rest[..end])
    }

    /// The `kind:id` after the last `/`. Byte loops, not `str` patterns:
    /// names are short and these run on every reservation, where the
    /// pattern searchers' set-up cost more than the search.
    fn last_part(&self) -> &str {
        let start = self
            .name
            .bytes()
            .rposition(|b| b == b'/')
            .map_or(0, |i| i + 1);
        &self.name[start..]
    }

    /// Whether this is a tenant scope itself (`tenant:acme`).
    pub fn is_tenant(&self) -> bool {
        self.name.starts_with("tenant:") && !self.name.contains('/')
    }

    /// Whether this is a global scope of a shared kind.
    pub fn is_shared(&self) -> bool {
        !self.name.starts_with("tenant:")
    }
}

impl Hash for ScopeKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state)
    }
}

impl From<&ScopeKey> for ScopeKey {
    fn from(k: &ScopeKey) -> Self {
        k.clone()
    }
}

impl Borrow<str> for ScopeKey {
    fn borrow(&self) -> &str {
        &self.name
    }
}

impl fmt::Debug for ScopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.name, f)
    }
}

impl fmt::Display for ScopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

/// Encoded as the canonical name.
impl Serialize for ScopeKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// Decoded through [`ScopeKey::parse`]: a bad name is an error, never a key.
impl<'de> Deserialize<'de> for ScopeKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct NameVisitor;

        impl Visitor<'_> for NameVisitor {
            type Value = ScopeKey;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a canonical scope name")
            }

            fn visit_str<E: de::Error>(self, name: &str) -> Result<ScopeKey, E> {
                ScopeKey::parse(name).map_err(E::custom)
            }
        }

        d.deserialize_str(NameVisitor)
    }
}

/// The scopes of one reservation: the tenant scope first, then the others in
/// the order of the request, without duplicates. Shared between requests and
/// the reservations they create (cloning is one reference count).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScopeSet {
    keys: Arc<[ScopeKey]>,
    /// The tenant's routing tag and whether any scope is shared, computed
    /// once here rather than on every operation.
    tenant_tag: u8,
    any_shared: bool,
}

impl ScopeSet {
    /// Builds a set; `scopes[0]` must be the tenant scope. Use
    /// [`Catalog::scope_set`](crate::Catalog::scope_set) to build one from a
    /// request (it checks kinds against the configuration).
    pub(crate) fn from_vec(scopes: Vec<ScopeKey>) -> Self {
        let tenant_tag = crate::ReservationId::tenant_tag(scopes[0].tenant_name().unwrap_or(""));
        let any_shared = scopes.iter().any(ScopeKey::is_shared);
        ScopeSet {
            keys: scopes.into(),
            tenant_tag,
            any_shared,
        }
    }

    /// A set from canonical keys, checked for the shape
    /// [`Catalog::scope_set`](crate::Catalog::scope_set) gives (what the
    /// catalog configures — kinds, `max_scopes` — is not its business): 1 to
    /// [`MAX_SCOPES_LIMIT`] keys, a tenant scope first, then scopes of that
    /// tenant or shared ones, no repeats. The engine routes and locks by this
    /// shape, so a set read from outside is built only through here.
    pub fn from_keys(keys: Vec<ScopeKey>) -> Result<ScopeSet, Invalid> {
        let bad = |why: String| Err(Invalid::new("scopes", why));
        let Some(tenant) = keys.first() else {
            return bad("no scopes: the tenant scope comes first".into());
        };
        if keys.len() > MAX_SCOPES_LIMIT {
            return bad(format!("{} scopes, at most {MAX_SCOPES_LIMIT}", keys.len()));
        }
        if !tenant.is_tenant() {
            return bad(format!("{tenant} comes first, not a tenant scope"));
        }
        for (i, key) in keys.iter().enumerate().skip(1) {
            if key.is_tenant() {
                return bad(format!("{key} is a second tenant scope"));
            }
            if !key.is_shared() && key.tenant_name() != tenant.tenant_name() {
                return bad(format!("{key} is not a scope of {tenant}"));
            }
            if keys[..i].contains(key) {
                return bad(format!("{key} is repeated"));
            }
        }
        Ok(ScopeSet::from_vec(keys))
    }

    /// The tenant's routing tag ([`ReservationId::tenant_tag`](crate::ReservationId::tenant_tag)).
    pub fn tenant_tag(&self) -> u8 {
        self.tenant_tag
    }

    /// Whether any scope is of a shared kind.
    pub fn any_shared(&self) -> bool {
        self.any_shared
    }

    /// The tenant scope.
    pub fn tenant(&self) -> &ScopeKey {
        &self.keys[0]
    }

    /// The tenant's name.
    pub fn tenant_name(&self) -> &str {
        self.keys[0].tenant_name().unwrap_or("")
    }

    /// All scopes, the tenant first.
    pub fn as_slice(&self) -> &[ScopeKey] {
        &self.keys
    }

    /// Number of scopes.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Never true: the tenant scope is always there.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The same scopes regardless of order (idempotent replays compare so).
    pub fn same_scopes(&self, other: &ScopeSet) -> bool {
        if self.keys.len() != other.keys.len() {
            return false;
        }
        self.keys.iter().all(|s| other.keys.contains(s))
    }
}

/// Encoded as its keys, the tenant first.
impl Serialize for ScopeSet {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.keys.len()))?;
        for key in self.keys.iter() {
            seq.serialize_element(key)?;
        }
        seq.end()
    }
}

/// Decoded with the checks of a reservation's scopes: 1 to
/// [`MAX_SCOPES_LIMIT`] keys (reading stops at the first past it), a tenant
/// scope first, then scopes of that tenant or shared ones, no repeats.
impl<'de> Deserialize<'de> for ScopeSet {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeysVisitor;

        impl<'de> Visitor<'de> for KeysVisitor {
            type Value = ScopeSet;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("the scope names of a reservation, the tenant first")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ScopeSet, A::Error> {
                let mut keys = Vec::new();
                while let Some(key) = seq.next_element::<ScopeKey>()? {
                    if keys.len() == MAX_SCOPES_LIMIT {
                        return Err(de::Error::custom(format!(
                            "scopes: more than {MAX_SCOPES_LIMIT}"
                        )));
                    }
                    keys.push(key);
                }
                ScopeSet::from_keys(keys).map_err(de::Error::custom)
            }
        }

        d.deserialize_seq(KeysVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated_and_canonical() {
        assert_eq!(ScopeKey::tenant("acme").unwrap().as_str(), "tenant:acme");
        let bob = ScopeKey::new("acme", "user", "bob", false, "scopes.user").unwrap();
        assert_eq!(bob.as_str(), "tenant:acme/user:bob");
        assert_eq!(
            (bob.kind(), bob.id(), bob.tenant_name()),
            ("user", "bob", Some("acme"))
        );
        let search = ScopeKey::new("acme", "tool", "search", true, "scopes.tool").unwrap();
        assert_eq!(search.as_str(), "tool:search");
        assert!(search.is_shared() && search.tenant_name().is_none());
        assert!(ScopeKey::tenant("acme").unwrap().is_tenant() && !bob.is_tenant());
        for bad in ["", "a/b", "a:b", "x".repeat(129).as_str(), "sp ace", "é"] {
            assert!(ScopeKey::tenant(bad).is_err(), "{bad:?}");
        }
        for bad in ["User", "1user", "", "u".repeat(33).as_str(), "a.b"] {
            let e = ScopeKey::new("acme", bad, "x", false, "scopes.k").unwrap_err();
            assert_eq!(e.field, "scopes.k");
        }
        assert!(ScopeKey::new("acme", "tenant", "x", false, "scopes.tenant").is_err());
        assert!(valid_id("a.b_c~d@e+f=g-1") && valid_kind("a_b-c9"));
    }

    #[test]
    fn parse_round_trips() {
        for name in ["tenant:acme", "tenant:acme/user:bob", "tool:search"] {
            assert_eq!(ScopeKey::parse(name).unwrap().as_str(), name);
        }
        for bad in [
            "acme",
            "tenant:",
            "user:bob/tool:x",
            "tenant:a/tenant:b",
            "tenant:a/user",
            "tenant:a/user:b/c:d",
            "Tool:x",
        ] {
            assert!(ScopeKey::parse(bad).is_err(), "{bad:?}");
        }
    }
}
