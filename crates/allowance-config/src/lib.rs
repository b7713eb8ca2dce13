//! # allowance-config — the configuration file
//!
//! One TOML file (CONFIG.md) configures a deployment: the scalar settings of
//! the server, store, reservations and queue, and — complete in itself —
//! the kinds of scope, the plans, the model prices, the API tokens and the
//! gateway. This crate turns it into the engine's [`Catalog`] and the
//! server's settings, or into one line per problem naming file, line and key.
//!
//! - **kind** — a kind of scope (`user`, `agent`, `tool`) and its default plan.
//! - **plan** — a named list of limits; the tenant's plan also sets the overrun policy.
//! - **limit spec** — the JSON and TOML shape of a limit ([`LimitSpec`]).
//! - **starter** — the built-in configuration `allowance init` prints ([`STARTER`]).
//! - **check** — warnings about plans that defeat themselves ([`check`]).
//!
//! ```
//! let config = allowance_config::parse(r#"
//! [kinds.user]
//! plan = "free"
//! [plans.free]
//! limits = [{ dimension = "requests", capacity = 60, window = "bucket", period = "1m" }]
//! "#, "allowance.toml").unwrap();
//! assert!(config.catalog.kind("user").is_some());
//!
//! let err = allowance_config::parse("[plans.free]\nlimits = [{ dimension = \"tokens\", capacity = 5, window = \"weekly\" }]\n", "a.toml")
//!     .unwrap_err();
//! assert!(err.to_string().starts_with("error: a.toml:2: key `plans.free.limits[0].window`: expected one of"));
//! ```

#![forbid(unsafe_code)]

mod check;
mod duration;
mod error;
mod parse;
mod read;
mod settings;
mod spec;

use std::io::Read as _;
use std::path::Path;

use allowance_core::Catalog;

pub use check::{Level, Warning, check, plans_table};
pub use duration::{format_duration_ms, parse_duration_ms};
pub use error::{ConfigErrors, Problem};
pub use parse::{
    DEFAULT_CURRENCY, DEFAULT_MAX_OUTPUT_TOKENS, DEFAULT_MAX_RETRIES, GATEWAY_TENANT,
    MAX_BODY_BYTES_BOUND, MAX_CONFIG_BYTES, MAX_OUTPUT_TOKENS_BOUND, MAX_RETENTION_MS,
    MAX_RETRIES_BOUND, MAX_STORE_TIMEOUT_MS, MAX_TTL_BOUND_MS, MAX_WAIT_BOUND_MS,
    MAX_WAITERS_BOUND, UPSTREAM_KIND,
};
pub use settings::{
    DEFAULT_DATA_DIR, DEFAULT_LISTEN, Fsync, GatewayKey, GatewaySettings, OnError, QueueSettings,
    Role, ServerSettings, StoreKind, StoreSettings, TokenSpec, UpstreamSettings,
};
pub use spec::{
    DEFAULT_OVERRUN_PERCENT, LimitSpec, PlanSpec, limit_from_spec, limit_to_spec, plan_from_spec,
    plan_to_spec,
};

/// Whether `name` can name a plan in a configuration file or through the
/// admin API: `[A-Za-z0-9._-]{1,64}` (a URL path segment and a TOML bare
/// key as it is).
///
/// ```
/// assert!(allowance_config::valid_plan_name("pro-2024.v2"));
/// assert!(!allowance_config::valid_plan_name("a b"));
/// assert!(!allowance_config::valid_plan_name(""));
/// ```
pub fn valid_plan_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// The name [`starter`] gives as its source.
pub const STARTER_SOURCE: &str = "<built-in starter>";

/// The built-in configuration: what `allowance init` prints and what
/// `allowance serve` runs without `--config`.
pub const STARTER: &str = include_str!("starter.toml");

/// A loaded configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// The file's path as given, or [`STARTER_SOURCE`].
    pub source: String,
    /// The currency `cost_micros` are millionths of (ISO 4217, default USD).
    pub currency: String,
    /// `[server]`.
    pub server: ServerSettings,
    /// `[store]`.
    pub store: StoreSettings,
    /// `[queue]`.
    pub queue: QueueSettings,
    /// Kinds, plans, models, custom dimensions and `[reservations]` settings.
    pub catalog: Catalog,
    /// `[[tokens]]`: API credentials, as hashes.
    pub tokens: Vec<TokenSpec>,
    /// `[gateway]`, when configured.
    pub gateway: Option<GatewaySettings>,
    /// What the catalog does not keep, for [`check`] and [`plans_table`].
    pub(crate) notes: Notes,
}

/// Facts of the file the catalog does not keep.
#[derive(Clone, Debug, Default)]
pub(crate) struct Notes {
    /// Kinds in file order, `tenant` first.
    pub(crate) kind_order: Vec<String>,
    /// Plans in file order.
    pub(crate) plan_order: Vec<String>,
    /// Plans that set `overrun` explicitly.
    pub(crate) explicit_overrun: Vec<String>,
    /// Settings the file gives that the rest of it makes moot, as warnings.
    pub(crate) no_effect: Vec<String>,
}

/// Parses a configuration file's text; `source` names it in messages.
/// Every problem is listed, in line order; nothing of the starter is merged
/// in (CONFIG.md answer 1).
pub fn parse(text: &str, source: &str) -> Result<Config, ConfigErrors> {
    parse::parse_text(text, source)
}

/// Reads and parses a configuration file. A file that cannot be read, is
/// larger than [`MAX_CONFIG_BYTES`] or is not UTF-8 is one problem naming it.
pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
    let source = path.display().to_string();
    let file = std::fs::File::open(path)
        .map_err(|e| ConfigErrors::whole_file(&source, format!("cannot read the file: {e}")))?;
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| ConfigErrors::whole_file(&source, format!("cannot read the file: {e}")))?;
    if bytes.len() > MAX_CONFIG_BYTES {
        return Err(ConfigErrors::whole_file(
            &source,
            format!("the file is larger than {MAX_CONFIG_BYTES} bytes; is it the right file?"),
        ));
    }
    let text = String::from_utf8(bytes).map_err(|e| {
        ConfigErrors::whole_file(
            &source,
            format!("not UTF-8 text (byte {})", e.utf8_error().valid_up_to()),
        )
    })?;
    parse(&text, &source)
}

/// The built-in configuration, parsed.
pub fn starter() -> Config {
    match parse(STARTER, STARTER_SOURCE) {
        Ok(config) => config,
        // A test parses STARTER; a broken starter never ships.
        Err(e) => unreachable!("the built-in starter configuration is invalid:\n{e}"),
    }
}
