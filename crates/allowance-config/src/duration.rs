//! Durations in the file: `"90s"`, `"1m"`, `"24h"` under a plain key, or an
//! integer number of milliseconds under its `_ms` key (CONFIG.md answer 4).

const UNITS_MS: [(&str, u64); 5] = [
    ("d", 86_400_000),
    ("h", 3_600_000),
    ("m", 60_000),
    ("s", 1_000),
    ("ms", 1),
];

/// Parses `"<digits><unit>"` with unit `ms`, `s`, `m`, `h` or `d` into
/// milliseconds. One number and one unit: `"1h30m"` and `"1.5h"` are
/// refused rather than guessed at (write `"90m"`).
///
/// ```
/// use allowance_config::parse_duration_ms;
/// assert_eq!(parse_duration_ms("90s"), Ok(90_000));
/// assert_eq!(parse_duration_ms("24h"), Ok(86_400_000));
/// assert_eq!(parse_duration_ms("250ms"), Ok(250));
/// assert!(parse_duration_ms("5x").is_err());
/// assert!(parse_duration_ms("1h30m").is_err());
/// ```
pub fn parse_duration_ms(text: &str) -> Result<u64, String> {
    let bad = || {
        format!(
            "expected a duration such as \"90s\", \"1m\" or \"24h\" (a whole number and one \
             of the units ms, s, m, h, d), got {text:?}"
        )
    };
    let digits_end = text
        .bytes()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits_end);
    if number.is_empty() {
        return Err(bad());
    }
    let scale_ms = UNITS_MS
        .iter()
        .find(|(name, _)| *name == unit)
        .map(|(_, ms)| *ms)
        .ok_or_else(bad)?;
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is too long"))?;
    n.checked_mul(scale_ms)
        .ok_or_else(|| format!("{text:?} is too long"))
}

/// Formats milliseconds with the largest unit that divides them exactly
/// (`90_000` → `"90s"`), so [`parse_duration_ms`] reads it back to the same
/// value. One day is `"24h"`, as people write it; days start at two.
///
/// ```
/// use allowance_config::format_duration_ms;
/// assert_eq!(format_duration_ms(3_600_000), "1h");
/// assert_eq!(format_duration_ms(86_400_000), "24h");
/// assert_eq!(format_duration_ms(7 * 86_400_000), "7d");
/// assert_eq!(format_duration_ms(90_000), "90s");
/// assert_eq!(format_duration_ms(1_500), "1500ms");
/// ```
pub fn format_duration_ms(ms: u64) -> String {
    if ms == 0 {
        return "0ms".to_string();
    }
    let (name, scale) = UNITS_MS
        .iter()
        .find(|(name, scale)| ms.is_multiple_of(*scale) && (*name != "d" || ms >= 2 * scale))
        .copied()
        .unwrap_or(("ms", 1));
    format!("{}{name}", ms / scale)
}
