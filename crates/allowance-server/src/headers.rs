//! The IETF `RateLimit-Policy` / `RateLimit` headers
//! (draft-ietf-httpapi-ratelimit-headers, structured fields) for the
//! binding limit: the denying one, or on success the tightest one (the
//! smallest remaining/capacity ratio).
//!
//! `"<kind>-<dimension>";q=<capacity>;w=<window seconds>` and
//! `"<kind>-<dimension>";r=<remaining>;t=<seconds to room>`. `w` is the
//! window's length (a calendar window's nominal length: a month counts 30
//! days); `total` and `concurrent` limits have no window, so no `w`. `r` is
//! never negative (an overrun reads as 0). `t` is omitted when no instant
//! brings room.

use allowance_core::{
    CalendarUnit, Catalog, Denial, Remaining, ScopeKey, Timestamp, Window, WindowKind,
};
use axum::http::{HeaderMap, HeaderName, HeaderValue};

/// The limit the headers describe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    name: String,
    capacity: u64,
    window_s: Option<u64>,
    remaining: u64,
    reset_s: Option<u64>,
}

impl Binding {
    /// The denying limit.
    pub fn from_denial(d: &Denial, _now: Timestamp, catalog: &Catalog) -> Binding {
        Binding {
            name: format!("{}-{}", d.scope.kind(), d.dimension),
            capacity: d.capacity,
            window_s: window_seconds(catalog, &d.scope, &d.dimension, d.window, d.capacity),
            remaining: d.remaining.max(0) as u64,
            reset_s: d.retry_after_ms.map(|ms| ms.div_ceil(1000)),
        }
    }

    /// A limit's room after a grant.
    pub fn from_remaining(r: &Remaining, now: Timestamp, catalog: &Catalog) -> Binding {
        Binding {
            name: [r.scope.kind(), "-", &r.dimension].concat(),
            capacity: r.capacity,
            window_s: window_seconds(catalog, &r.scope, &r.dimension, r.window, r.capacity),
            remaining: r.remaining.max(0) as u64,
            reset_s: r.resets_at.map(|at| {
                at.as_millis()
                    .saturating_sub(now.as_millis())
                    .div_ceil(1000)
            }),
        }
    }

    /// `RateLimit-Policy`.
    pub fn policy(&self) -> String {
        self.item(("q", self.capacity), self.window_s.map(|w| ("w", w)))
    }

    /// `RateLimit`.
    pub fn state(&self) -> String {
        self.item(("r", self.remaining), self.reset_s.map(|t| ("t", t)))
    }

    /// `"<name>";<k>=<v>[;<k>=<v>]`, built without the formatting
    /// machinery (every grant answers two of these).
    fn item(&self, first: (&str, u64), second: Option<(&str, u64)>) -> String {
        let mut out = String::with_capacity(self.name.len() + 40);
        out.push('"');
        out.push_str(&self.name);
        out.push('"');
        for (key, n) in std::iter::once(first).chain(second) {
            out.push(';');
            out.push_str(key);
            out.push('=');
            out.push_str(itoa::Buffer::new().format(n));
        }
        out
    }
}

/// The tightest limit of a grant: smallest remaining/capacity, compared
/// exactly (cross-multiplied in 128 bits); the first in report order wins
/// a tie.
pub fn tightest<'a>(remaining: impl IntoIterator<Item = &'a Remaining>) -> Option<&'a Remaining> {
    remaining.into_iter().reduce(|best, r| {
        let lhs = i128::from(r.remaining) * i128::from(best.capacity);
        let rhs = i128::from(best.remaining) * i128::from(r.capacity);
        if lhs < rhs { r } else { best }
    })
}

/// The success headers: `RateLimit-Policy`/`RateLimit` for the tightest
/// limit, and `X-RateLimit-Remaining-Tokens` / `-Requests`: the smallest
/// remaining room among the `tokens` (resp. `requests`) limits of the
/// reservation's scopes, when there are any (never negative). Added to
/// `h`, the answer's own headers (no map of their own to merge).
pub fn add_success_headers(
    h: &mut HeaderMap,
    remaining: &[Remaining],
    now: Timestamp,
    catalog: &Catalog,
) {
    if let Some(r) = tightest(remaining) {
        let b = Binding::from_remaining(r, now, catalog);
        insert(h, RATELIMIT_POLICY, b.policy());
        insert(h, RATELIMIT, b.state());
    }
    for (dimension, header) in [
        ("tokens", REMAINING_TOKENS),
        ("requests", REMAINING_REQUESTS),
    ] {
        let least = remaining
            .iter()
            .filter(|r| r.dimension == dimension)
            .map(|r| r.remaining.max(0))
            .min();
        if let Some(n) = least {
            h.insert(header, HeaderValue::from(n));
        }
    }
}

// Checked once, at compile time, not on every answer.
const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const REMAINING_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-remaining-tokens");
const REMAINING_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-remaining-requests");

/// `value` (built here, so always a valid header value) as the header's
/// bytes, without a copy.
fn insert(h: &mut HeaderMap, name: HeaderName, value: String) {
    if let Ok(v) = HeaderValue::from_maybe_shared(bytes::Bytes::from(value)) {
        h.insert(name, v);
    }
}

/// The window length in seconds of the scope's limit matching
/// (dimension, kind, capacity), looked up in the scope's plan.
fn window_seconds(
    catalog: &Catalog,
    scope: &ScopeKey,
    dimension: &str,
    kind: WindowKind,
    capacity: u64,
) -> Option<u64> {
    let plan = catalog.plan_for(scope);
    let limit = plan.limits().iter().find(|l| {
        l.window().kind() == kind
            && l.capacity() == capacity
            && catalog.dimension_name(l.dimension()) == dimension
    })?;
    match limit.window() {
        Window::Sliding { period_ms, .. } | Window::Bucket { period_ms } => {
            Some(period_ms.div_ceil(1000))
        }
        Window::Calendar { unit, .. } => Some(match unit {
            CalendarUnit::Minute => 60,
            CalendarUnit::Hour => 3_600,
            CalendarUnit::Day => 86_400,
            CalendarUnit::Week => 604_800,
            CalendarUnit::Month => 2_592_000,
        }),
        Window::Total | Window::Concurrent => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rem(remaining: i64, capacity: u64) -> Remaining {
        Remaining {
            scope: ScopeKey::tenant("a").unwrap(),
            dimension: "tokens".into(),
            window: WindowKind::Total,
            capacity,
            remaining,
            resets_at: None,
        }
    }

    #[test]
    fn tightest_is_the_smallest_ratio() {
        let list = [rem(50, 100), rem(10, 1000), rem(5, 10)];
        assert_eq!(tightest(&list).unwrap().capacity, 1000);
        let overrun = [rem(1, 10), rem(-5, 1000)];
        assert_eq!(tightest(&overrun).unwrap().remaining, -5);
        assert!(tightest(&[] as &[Remaining]).is_none());
    }

    #[test]
    fn headers_follow_the_draft_syntax() {
        let b = Binding {
            name: "user-tokens".into(),
            capacity: 200_000,
            window_s: Some(3600),
            remaining: 140_800,
            reset_s: Some(60),
        };
        assert_eq!(b.policy(), "\"user-tokens\";q=200000;w=3600");
        assert_eq!(b.state(), "\"user-tokens\";r=140800;t=60");
        let total = Binding {
            window_s: None,
            reset_s: None,
            ..b
        };
        assert_eq!(total.policy(), "\"user-tokens\";q=200000");
        assert_eq!(total.state(), "\"user-tokens\";r=140800");
    }
}
