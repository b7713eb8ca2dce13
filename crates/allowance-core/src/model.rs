//! The model table: prices per million tokens, and the cost of a call.

use serde::{Deserialize, Serialize};

use crate::error::Invalid;

/// Per-model pricing and defaults, in micro-units of the deployment's
/// currency per million tokens (so "2.50" EUR per million is 2_500_000).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelPrice {
    /// Price of a million uncached input tokens.
    pub input_micros_per_million: u64,
    /// Price of a million cached input tokens.
    pub cached_input_micros_per_million: u64,
    /// Price of a million output tokens.
    pub output_micros_per_million: u64,
    /// The output bound reserved when a call names none.
    pub max_output_tokens: u64,
    /// The tokenizer's name (`o200k_base`, `cl100k_base`).
    pub tokenizer: String,
}

impl ModelPrice {
    /// The cost of a call in `cost_micros`, computed in 128-bit integers and
    /// rounded up once. `cached_input` is the part of `input` that was cached.
    ///
    /// ```
    /// use allowance_core::ModelPrice;
    /// let gpt4o = ModelPrice {
    ///     input_micros_per_million: 2_500_000, cached_input_micros_per_million: 1_250_000,
    ///     output_micros_per_million: 10_000_000, max_output_tokens: 16_384, tokenizer: "o200k_base".into(),
    /// };
    /// assert_eq!(gpt4o.cost_micros(3000, 0, 1000), 17_500);
    /// assert_eq!(gpt4o.cost_micros(1, 0, 0), 3); // 2.5 micros, rounded up
    /// ```
    pub fn cost_micros(&self, input: u64, cached_input: u64, output: u64) -> u64 {
        let cached = cached_input.min(input);
        let total = u128::from(input - cached) * u128::from(self.input_micros_per_million)
            + u128::from(cached) * u128::from(self.cached_input_micros_per_million)
            + u128::from(output) * u128::from(self.output_micros_per_million);
        u64::try_from(total.div_ceil(1_000_000)).unwrap_or(u64::MAX)
    }
}

/// Parses a decimal price per million tokens ("2.50", "0.075", "10") into
/// micro-units; at most 6 decimals, at most 2^53 micro-units.
///
/// ```
/// use allowance_core::parse_price_micros;
/// assert_eq!(parse_price_micros("2.50", "input_per_million").unwrap(), 2_500_000);
/// assert_eq!(parse_price_micros("0.075", "x").unwrap(), 75_000);
/// assert!(parse_price_micros("0.0000001", "x").is_err());
/// assert!(parse_price_micros("-1", "x").is_err());
/// ```
pub fn parse_price_micros(text: &str, field: &str) -> Result<u64, Invalid> {
    let bad = |why: &str| Invalid::new(field, format!("price {text:?}: {why}"));
    let (whole, frac) = text.split_once('.').unwrap_or((text, ""));
    if whole.is_empty()
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(bad("expected a decimal number such as \"2.50\""));
    }
    if frac.len() > 6 {
        return Err(bad(
            "at most 6 decimals (one micro-unit per million tokens)",
        ));
    }
    let whole: u64 = whole.parse().map_err(|_| bad("too large"))?;
    let frac_micros: u64 = format!("{frac:0<6}")
        .parse()
        .map_err(|_| bad("bad decimals"))?;
    whole
        .checked_mul(1_000_000)
        .and_then(|w| w.checked_add(frac_micros))
        .filter(|&m| m <= crate::MAX_AMOUNT)
        .ok_or_else(|| bad("too large"))
}
