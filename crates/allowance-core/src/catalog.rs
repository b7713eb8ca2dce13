//! The catalog: kinds, dimensions, plans, per-scope overrides, models and
//! reservation settings — everything the ledger is configured with, and that
//! an admin may change at run time (effective for the next operation).

use std::collections::HashMap as StdHashMap;
use std::collections::HashSet;

use serde::{Deserialize, Serialize, Serializer};

/// Catalog maps are read on every plan resolution: a fast hash (foldhash,
/// randomly seeded, so tenant-chosen names cannot aim at collisions).
type HashMap<K, V> = StdHashMap<K, V, foldhash::fast::RandomState>;
use std::sync::Arc;

use crate::error::{AdminError, Invalid};
use crate::model::ModelPrice;
use crate::plan::Plan;
use crate::scope::{self, ScopeKey, ScopeSet, TENANT_KIND};
use crate::units::Dimension;

/// Most custom dimensions a deployment may define.
pub const MAX_CUSTOM_DIMENSIONS: usize = 64;
/// Longest idempotency key, in characters (Unicode scalar values).
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 200;
/// Upper bound for `max_scopes` (scopes per reservation, the tenant included).
pub const MAX_SCOPES_LIMIT: usize = 16;
/// Longest label key and value, in bytes.
pub const MAX_LABEL_KEY_LEN: usize = 64;
/// Longest label value, in bytes.
pub const MAX_LABEL_VALUE_LEN: usize = 256;

/// Reservation settings (`[reservations]` in CONFIG.md).
///
/// Decoding checks them with [`Settings::validate`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SettingsFields")]
pub struct Settings {
    /// TTL of a reservation that names none.
    pub default_ttl_ms: u64,
    /// Largest TTL accepted (reserve and extend).
    pub max_ttl_ms: u64,
    /// How long an idempotency key is remembered after its reservation ends.
    pub idempotency_retention_ms: u64,
    /// How long an ended reservation still answers reads and replays.
    pub ended_retention_ms: u64,
    /// Scopes per reservation, the tenant included.
    pub max_scopes: usize,
    /// Labels per reservation.
    pub max_labels: usize,
}

/// [`Settings`]' encoded fields, before they are checked.
#[derive(Deserialize)]
struct SettingsFields {
    default_ttl_ms: u64,
    max_ttl_ms: u64,
    idempotency_retention_ms: u64,
    ended_retention_ms: u64,
    max_scopes: usize,
    max_labels: usize,
}

impl TryFrom<SettingsFields> for Settings {
    type Error = Invalid;

    fn try_from(f: SettingsFields) -> Result<Settings, Invalid> {
        let s = Settings {
            default_ttl_ms: f.default_ttl_ms,
            max_ttl_ms: f.max_ttl_ms,
            idempotency_retention_ms: f.idempotency_retention_ms,
            ended_retention_ms: f.ended_retention_ms,
            max_scopes: f.max_scopes,
            max_labels: f.max_labels,
        };
        s.validate()?;
        Ok(s)
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            default_ttl_ms: 300_000,
            max_ttl_ms: 3_600_000,
            idempotency_retention_ms: 86_400_000,
            ended_retention_ms: 86_400_000,
            max_scopes: 8,
            max_labels: 16,
        }
    }
}

impl Settings {
    /// Checks the settings against each other and their bounds.
    pub fn validate(&self) -> Result<(), Invalid> {
        if self.max_ttl_ms == 0 {
            return Err(Invalid::new(
                "reservations.max_ttl_ms",
                "must be at least 1",
            ));
        }
        if self.default_ttl_ms == 0 || self.default_ttl_ms > self.max_ttl_ms {
            return Err(Invalid::new(
                "reservations.default_ttl_ms",
                "must be between 1 and max_ttl_ms",
            ));
        }
        if self.max_scopes == 0 || self.max_scopes > MAX_SCOPES_LIMIT {
            return Err(Invalid::new(
                "reservations.max_scopes",
                format!("must be between 1 and {MAX_SCOPES_LIMIT}"),
            ));
        }
        if self.max_labels > 64 {
            return Err(Invalid::new(
                "reservations.max_labels",
                "must be at most 64",
            ));
        }
        Ok(())
    }
}

/// How a kind of scope is configured.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KindSpec {
    /// The default plan of scopes of this kind (`None`: no limits).
    pub plan: Option<String>,
    /// Whether scopes of this kind are global (`tool:search`) rather than
    /// inside a tenant.
    pub shared: bool,
}

/// A per-scope override: another plan (a tier change) or its own limits.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Override {
    /// Move the scope to this named plan.
    Plan(String),
    /// Give the scope its own limits.
    Limits(Arc<Plan>),
}

/// The ledger's configuration. Cloning is cheap enough for admin changes
/// (plans are shared), and every change bumps an epoch so scopes re-resolve
/// their plan on their next operation, never in a scan.
///
/// Encoded as its settings, custom dimensions (in order: their numbers),
/// plans, kinds, overrides and models, each list sorted by name, so one
/// configuration has one encoding (two catalogs are the same configuration
/// when they encode the same). The epoch is not encoded: it means something
/// only to the ledger that counted it. Decoding rebuilds the catalog through
/// its own setters and refuses a repeated name or a reference to a plan it
/// does not hold.
#[derive(Clone, Debug, Deserialize)]
#[serde(try_from = "CatalogFields")]
pub struct Catalog {
    settings: Settings,
    kinds: HashMap<String, KindSpec>,
    plans: HashMap<String, Arc<Plan>>,
    overrides: HashMap<ScopeKey, Override>,
    models: HashMap<String, ModelPrice>,
    custom_dimensions: Vec<String>,
    unlimited: Arc<Plan>,
    epoch: u64,
}

/// What a [`Catalog`] encodes, borrowed and in its encoding's order.
#[derive(Serialize)]
struct CatalogView<'a> {
    settings: &'a Settings,
    custom_dimensions: &'a [String],
    plans: Vec<&'a Arc<Plan>>,
    kinds: Vec<(&'a str, &'a KindSpec)>,
    overrides: Vec<(&'a ScopeKey, &'a Override)>,
    models: Vec<(&'a str, &'a ModelPrice)>,
}

impl Serialize for Catalog {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut plans: Vec<&Arc<Plan>> = self.plans.values().collect();
        plans.sort_unstable_by(|a, b| a.name().cmp(b.name()));
        let mut kinds: Vec<(&str, &KindSpec)> =
            self.kinds.iter().map(|(k, v)| (k.as_str(), v)).collect();
        kinds.sort_unstable_by_key(|(k, _)| *k);
        let mut overrides: Vec<(&ScopeKey, &Override)> = self.overrides.iter().collect();
        overrides.sort_unstable_by_key(|(k, _)| *k);
        let mut models: Vec<(&str, &ModelPrice)> =
            self.models.iter().map(|(k, v)| (k.as_str(), v)).collect();
        models.sort_unstable_by_key(|(k, _)| *k);
        CatalogView {
            settings: &self.settings,
            custom_dimensions: &self.custom_dimensions,
            plans,
            kinds,
            overrides,
            models,
        }
        .serialize(s)
    }
}

/// A [`Catalog`]'s encoded fields, before they are checked.
#[derive(Deserialize)]
struct CatalogFields {
    settings: Settings,
    custom_dimensions: Vec<String>,
    plans: Vec<Arc<Plan>>,
    kinds: Vec<(String, KindSpec)>,
    overrides: Vec<(ScopeKey, Override)>,
    models: Vec<(String, ModelPrice)>,
}

impl TryFrom<CatalogFields> for Catalog {
    type Error = Invalid;

    fn try_from(f: CatalogFields) -> Result<Catalog, Invalid> {
        let repeated = |field: &str, name: &dyn std::fmt::Display| {
            Err(Invalid::new(field, format!("{name} is given twice")))
        };
        let mut c = Catalog::new(f.settings)?;
        for name in &f.custom_dimensions {
            // A repeat (or a built-in name) would shift the numbers of
            // every dimension after it.
            if c.dimension(name).is_some() {
                return repeated("custom_dimensions", name);
            }
            c.add_dimension(name)?;
        }
        for plan in f.plans {
            if c.plans.contains_key(plan.name()) {
                return repeated("plans", &plan.name());
            }
            c.plans.insert(plan.name().to_string(), plan);
        }
        let mut kinds = HashSet::new();
        for (name, spec) in &f.kinds {
            if !kinds.insert(name.as_str()) {
                return repeated("kinds", name);
            }
            c.set_kind(name, spec.plan.as_deref(), spec.shared)?;
        }
        // Whether an override's scope fits its kind is checked when it is
        // set, not here: a kind may have been redefined since.
        for (scope, over) in f.overrides {
            if c.overrides.contains_key(&scope) {
                return repeated("overrides", &scope);
            }
            if let Override::Plan(name) = &over
                && !c.plans.contains_key(name)
            {
                return Err(Invalid::new(
                    format!("overrides.{scope}"),
                    format!("no plan named {name:?}"),
                ));
            }
            c.overrides.insert(scope, over);
        }
        for (name, price) in f.models {
            if c.models.contains_key(&name) {
                return repeated("models", &name);
            }
            c.set_model(&name, price)?;
        }
        Ok(c)
    }
}

impl Default for Catalog {
    fn default() -> Self {
        Catalog::new(Settings::default()).expect("the default settings are valid")
    }
}

impl Catalog {
    /// A catalog with only the `tenant` kind (no limits) and these settings.
    pub fn new(settings: Settings) -> Result<Catalog, Invalid> {
        settings.validate()?;
        let mut kinds = HashMap::default();
        kinds.insert(
            TENANT_KIND.to_string(),
            KindSpec {
                plan: None,
                shared: false,
            },
        );
        Ok(Catalog {
            settings,
            kinds,
            plans: HashMap::default(),
            overrides: HashMap::default(),
            models: HashMap::default(),
            custom_dimensions: Vec::new(),
            unlimited: Plan::unlimited(),
            epoch: 1,
        })
    }

    /// The reservation settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Changes the epoch, so every scope re-resolves its plan.
    fn bump(&mut self) {
        self.epoch += 1;
    }

    /// Moves the epoch past `previous` (a catalog replacing one whose
    /// epoch was `previous`), so every scope re-resolves its plan even when
    /// this catalog was built or decoded elsewhere.
    pub(crate) fn follow_epoch(&mut self, previous: u64) {
        self.epoch = self.epoch.max(previous) + 1;
    }

    #[inline]
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    // ---- dimensions

    /// The dimension with this name (built-in or custom).
    pub fn dimension(&self, name: &str) -> Option<Dimension> {
        Dimension::builtin(name).or_else(|| {
            self.custom_dimensions
                .iter()
                .position(|d| d == name)
                .map(|i| Dimension(Dimension::BUILTIN_COUNT + i as u16))
        })
    }

    /// Registers a custom dimension (`[a-z][a-z0-9_]{0,31}`), or returns the
    /// existing one of that name.
    pub fn add_dimension(&mut self, name: &str) -> Result<Dimension, Invalid> {
        if let Some(d) = self.dimension(name) {
            return Ok(d);
        }
        let b = name.as_bytes();
        let valid = !b.is_empty()
            && b.len() <= 32
            && b[0].is_ascii_lowercase()
            && b.iter()
                .all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_');
        if !valid {
            return Err(Invalid::new(
                "dimension",
                format!("invalid dimension name {name:?}: expected [a-z][a-z0-9_]{{0,31}}"),
            ));
        }
        if self.custom_dimensions.len() >= MAX_CUSTOM_DIMENSIONS {
            return Err(Invalid::new(
                "dimension",
                format!("at most {MAX_CUSTOM_DIMENSIONS} custom dimensions"),
            ));
        }
        self.custom_dimensions.push(name.to_string());
        Ok(Dimension(
            Dimension::BUILTIN_COUNT + (self.custom_dimensions.len() - 1) as u16,
        ))
    }

    /// The name of a dimension.
    pub fn dimension_name(&self, dim: Dimension) -> &str {
        dim.builtin_name().unwrap_or_else(|| {
            self.custom_dimensions
                .get(dim.index() - usize::from(Dimension::BUILTIN_COUNT))
                .map_or("unknown", |s| s.as_str())
        })
    }

    // ---- kinds

    /// Defines (or redefines) a kind with its default plan, which must exist.
    pub fn set_kind(
        &mut self,
        name: &str,
        plan: Option<&str>,
        shared: bool,
    ) -> Result<(), Invalid> {
        if !scope::valid_kind(name) {
            return Err(Invalid::new("kind", format!("invalid kind {name:?}")));
        }
        if name == TENANT_KIND && shared {
            return Err(Invalid::new(
                "kinds.tenant.shared",
                "the tenant kind cannot be shared",
            ));
        }
        if let Some(p) = plan
            && !self.plans.contains_key(p)
        {
            return Err(Invalid::new(
                format!("kinds.{name}.plan"),
                format!("no plan named {p:?}"),
            ));
        }
        self.kinds.insert(
            name.to_string(),
            KindSpec {
                plan: plan.map(str::to_string),
                shared,
            },
        );
        self.bump();
        Ok(())
    }

    /// The kind's configuration.
    pub fn kind(&self, name: &str) -> Option<&KindSpec> {
        self.kinds.get(name)
    }

    /// All kinds.
    pub fn kinds(&self) -> impl Iterator<Item = (&str, &KindSpec)> {
        self.kinds.iter().map(|(k, v)| (k.as_str(), v))
    }

    // ---- plans

    /// Defines or replaces a plan; effective for the next operation of every
    /// scope on it (usage history is kept where a limit's dimension and
    /// window are unchanged).
    pub fn set_plan(&mut self, plan: Arc<Plan>) {
        self.plans.insert(plan.name().to_string(), plan);
        self.bump();
    }

    /// The plan with this name.
    pub fn plan(&self, name: &str) -> Option<&Arc<Plan>> {
        self.plans.get(name)
    }

    /// All plans.
    pub fn plans(&self) -> impl Iterator<Item = &Arc<Plan>> {
        self.plans.values()
    }

    /// Moves one scope to another plan or gives it its own limits.
    pub fn set_override(&mut self, scope: ScopeKey, over: Override) -> Result<(), AdminError> {
        self.check_scope(&scope).map_err(AdminError::Invalid)?;
        if let Override::Plan(name) = &over
            && !self.plans.contains_key(name)
        {
            return Err(AdminError::NotFound(format!("plan {name:?}")));
        }
        self.overrides.insert(scope, over);
        self.bump();
        Ok(())
    }

    /// Returns a scope to its kind's default plan; whether it had an override.
    pub fn clear_override(&mut self, scope: &ScopeKey) -> bool {
        let had = self.overrides.remove(scope).is_some();
        if had {
            self.bump();
        }
        had
    }

    /// A scope's override, if it has one.
    pub fn override_of(&self, scope: &ScopeKey) -> Option<&Override> {
        self.overrides.get(scope)
    }

    /// The overrides in force.
    pub fn overrides(&self) -> impl Iterator<Item = (&ScopeKey, &Override)> {
        self.overrides.iter()
    }

    /// The plan in force for a scope: its override, else its kind's plan,
    /// else no limits.
    pub fn plan_for(&self, scope: &ScopeKey) -> &Arc<Plan> {
        let named = match self.overrides.get(scope) {
            Some(Override::Limits(plan)) => return plan,
            Some(Override::Plan(name)) => Some(name.as_str()),
            None => self.kinds.get(scope.kind()).and_then(|k| k.plan.as_deref()),
        };
        named
            .and_then(|n| self.plans.get(n))
            .unwrap_or(&self.unlimited)
    }

    // ---- models

    /// Defines or replaces a model's prices.
    pub fn set_model(&mut self, name: &str, price: ModelPrice) -> Result<(), Invalid> {
        if name.is_empty() || name.len() > 128 {
            return Err(Invalid::new(
                "model",
                "a model name has 1 to 128 characters",
            ));
        }
        self.models.insert(name.to_string(), price);
        self.bump();
        Ok(())
    }

    /// A model's prices.
    pub fn model(&self, name: &str) -> Option<&ModelPrice> {
        self.models.get(name)
    }

    // ---- scopes

    /// Checks that a canonical scope names a configured kind, shared or not
    /// as configured.
    pub fn check_scope(&self, scope: &ScopeKey) -> Result<(), Invalid> {
        let kind = self
            .kinds
            .get(scope.kind())
            .ok_or_else(|| Invalid::new("scope", format!("unknown kind {:?}", scope.kind())))?;
        if kind.shared != scope.is_shared() {
            return Err(Invalid::new(
                "scope",
                format!(
                    "kind {:?} is {}shared",
                    scope.kind(),
                    if kind.shared { "" } else { "not " }
                ),
            ));
        }
        Ok(())
    }

    /// Builds the scope set of a request: the tenant scope first, then each
    /// `(kind, id)` in order. Unknown kinds, bad names, duplicates and more
    /// than `max_scopes` are errors naming the field (`scopes.user`).
    ///
    /// ```
    /// use allowance_core::Catalog;
    /// let mut c = Catalog::default();
    /// c.set_kind("user", None, false).unwrap();
    /// c.set_kind("tool", None, true).unwrap();
    /// let s = c.scope_set("acme", &[("user", "bob"), ("tool", "search")]).unwrap();
    /// let names: Vec<&str> = s.as_slice().iter().map(|k| k.as_str()).collect();
    /// assert_eq!(names, ["tenant:acme", "tenant:acme/user:bob", "tool:search"]);
    /// assert_eq!(c.scope_set("acme", &[("team", "x")]).unwrap_err().field, "scopes.team");
    /// ```
    pub fn scope_set(&self, tenant: &str, scopes: &[(&str, &str)]) -> Result<ScopeSet, Invalid> {
        let mut keys = Vec::with_capacity(scopes.len() + 1);
        keys.push(ScopeKey::tenant(tenant)?);
        if scopes.len() + 1 > self.settings.max_scopes {
            return Err(Invalid::new(
                "scopes",
                format!(
                    "at most {} scopes per reservation, the tenant included",
                    self.settings.max_scopes
                ),
            ));
        }
        for (kind, id) in scopes {
            // Built only for an error: most reservations have none.
            let field = || format!("scopes.{kind}");
            let spec = self.kinds.get(*kind).filter(|_| *kind != TENANT_KIND);
            let Some(spec) = spec else {
                let why = if *kind == TENANT_KIND {
                    "the tenant scope is implied".to_string()
                } else {
                    format!("unknown kind {kind:?}")
                };
                return Err(Invalid::new(field(), why));
            };
            // An empty field is filled in below; `tenant` keeps its own.
            let key = ScopeKey::new(tenant, kind, id, spec.shared, "").map_err(|mut e| {
                if e.field.is_empty() {
                    e.field = field();
                }
                e
            })?;
            if keys.contains(&key) {
                return Err(Invalid::new(field(), format!("duplicate scope {key}")));
            }
            keys.push(key);
        }
        Ok(ScopeSet::from_vec(keys))
    }
}
