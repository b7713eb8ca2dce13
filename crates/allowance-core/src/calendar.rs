//! Calendar windows: the minute, hour, day, week or month that contains an instant.
//!
//! A window starts where the *local* clock of its zone crosses a boundary: the top of
//! the minute or hour, midnight, Monday 00:00 (weeks start on Monday), the 1st of the
//! month 00:00. Windows are therefore not fixed lengths once DST is involved:
//!
//! - A spring-forward day is 23 h and a fall-back day 25 h long. When a boundary is
//!   skipped by a jump forward (local midnight does not exist), the window starts at
//!   the first instant that does exist, i.e. the instant of the jump.
//! - On a fall-back the clock shows some local times twice. Days, weeks and months
//!   start at the *first* showing of their midnight, so no day is ever split. Minutes
//!   and hours start at *every* showing of their boundary: New York's repeated 01:00
//!   hour is two one-hour windows, not one two-hour window.
//!
//! Instants are integer milliseconds since the Unix epoch. A window that began before
//! the epoch is reported as starting at 0. Nothing here reads the clock or panics.

use std::fmt;

use jiff::civil::{DateTime, Time};
use jiff::tz::{AmbiguousOffset, TimeZone};
use jiff::{Span, Timestamp};
use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

const MINUTE_MS: u64 = 60_000;
const HOUR_MS: u64 = 60 * MINUTE_MS;
const DAY_MS: u64 = 24 * HOUR_MS;

/// Unit of a calendar window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CalendarUnit {
    /// From one top of the minute to the next.
    Minute,
    /// From one top of the hour to the next.
    Hour,
    /// From local midnight to the next.
    Day,
    /// From Monday 00:00 to the next Monday 00:00.
    Week,
    /// From the 1st of the month 00:00 to the 1st of the next month.
    Month,
}

impl CalendarUnit {
    /// Parses "minute" | "hour" | "day" | "week" | "month".
    pub fn parse(s: &str) -> Option<CalendarUnit> {
        match s {
            "minute" => Some(CalendarUnit::Minute),
            "hour" => Some(CalendarUnit::Hour),
            "day" => Some(CalendarUnit::Day),
            "week" => Some(CalendarUnit::Week),
            "month" => Some(CalendarUnit::Month),
            _ => None,
        }
    }

    /// The name used in config and JSON ("minute", ...).
    pub fn as_str(self) -> &'static str {
        match self {
            CalendarUnit::Minute => "minute",
            CalendarUnit::Hour => "hour",
            CalendarUnit::Day => "day",
            CalendarUnit::Week => "week",
            CalendarUnit::Month => "month",
        }
    }

    /// One window's worth of civil (wall-clock) time.
    fn span(self) -> Span {
        match self {
            CalendarUnit::Minute => Span::new().minutes(1),
            CalendarUnit::Hour => Span::new().hours(1),
            CalendarUnit::Day => Span::new().days(1),
            CalendarUnit::Week => Span::new().weeks(1),
            CalendarUnit::Month => Span::new().months(1),
        }
    }
}

/// The zone a calendar window is aligned in: UTC or an IANA zone.
#[derive(Clone, Debug)]
pub struct Zone {
    name: Box<str>,
    tz: TimeZone,
}

impl Zone {
    /// UTC.
    pub fn utc() -> Zone {
        Zone {
            name: "UTC".into(),
            tz: TimeZone::UTC,
        }
    }

    /// An IANA zone by name ("Europe/Paris"); "UTC" gives utc().
    pub fn named(name: &str) -> Result<Zone, UnknownZone> {
        if name == "UTC" {
            return Ok(Zone::utc());
        }
        match TimeZone::get(name) {
            Ok(tz) => Ok(Zone {
                name: name.into(),
                tz,
            }),
            Err(_) => Err(UnknownZone {
                name: name.to_owned(),
            }),
        }
    }

    /// The zone's name as given ("UTC" for utc()).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether this is UTC (fast path).
    pub fn is_utc(&self) -> bool {
        &*self.name == "UTC"
    }
}

/// Longest zone name a decoder looks up (the longest IANA name has 32
/// characters): a corrupt name is refused before it reaches the database.
const MAX_ZONE_NAME_LEN: usize = 64;

/// Encoded as its name.
impl Serialize for Zone {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name)
    }
}

/// Decoded through [`Zone::named`]: a zone this build does not know is an error.
impl<'de> Deserialize<'de> for Zone {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ZoneVisitor;

        impl Visitor<'_> for ZoneVisitor {
            type Value = Zone;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an IANA time zone name or \"UTC\"")
            }

            fn visit_str<E: de::Error>(self, name: &str) -> Result<Zone, E> {
                if name.len() > MAX_ZONE_NAME_LEN {
                    return Err(E::custom(format!(
                        "a time zone name of {} bytes",
                        name.len()
                    )));
                }
                Zone::named(name).map_err(E::custom)
            }
        }

        d.deserialize_str(ZoneVisitor)
    }
}

impl PartialEq for Zone {
    fn eq(&self, other: &Zone) -> bool {
        self.name == other.name
    }
}

impl Eq for Zone {}

/// The error for an unknown IANA zone name; Display: `unknown time zone "Mars/Olympus"`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownZone {
    /// The name that was looked up.
    pub name: String,
}

impl fmt::Display for UnknownZone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown time zone {:?}", self.name)
    }
}

impl std::error::Error for UnknownZone {}

/// The calendar window containing `now_ms`: `(start_ms, end_ms)`, start inclusive, end exclusive,
/// both as ms since the epoch, with start_ms <= now_ms < end_ms. Boundaries are local-time
/// boundaries in `zone` (midnight, the top of the hour, Monday 00:00 for weeks, the 1st of the
/// month 00:00), converted to instants DST-correctly (a day in a DST-change week may be 23 h or 25 h;
/// when local midnight does not exist, the day starts at the first instant that does).
///
/// Edge cases, none of which panic:
/// - a window that began before the epoch starts at 0;
/// - an end past `u64::MAX` saturates to `u64::MAX` (so for `now_ms == u64::MAX` the result
///   is `(start, u64::MAX)` and `now_ms < end_ms` cannot hold);
/// - past the zone database's range (after the year 9999) the UTC window is returned.
pub fn window_bounds(unit: CalendarUnit, zone: &Zone, now_ms: u64) -> (u64, u64) {
    if zone.is_utc() {
        return utc_bounds(unit, now_ms);
    }
    zoned_bounds(unit, &zone.tz, now_ms).unwrap_or_else(|| utc_bounds(unit, now_ms))
}

/// UTC windows by integer arithmetic: valid for every `u64`, unlike jiff's year-9999 range.
fn utc_bounds(unit: CalendarUnit, now_ms: u64) -> (u64, u64) {
    let fixed = |len: u64| {
        let start = now_ms - now_ms % len;
        (start, start.saturating_add(len))
    };
    let days = |from: u64, to: u64| (from * DAY_MS, to.saturating_mul(DAY_MS));
    let today = now_ms / DAY_MS;
    match unit {
        CalendarUnit::Minute => fixed(MINUTE_MS),
        CalendarUnit::Hour => fixed(HOUR_MS),
        CalendarUnit::Day => fixed(DAY_MS),
        CalendarUnit::Week => {
            // 1970-01-01 was a Thursday, 3 days after a Monday.
            let since_monday = (today + 3) % 7;
            let monday = today + 7 - since_monday; // the *next* Monday; never underflows
            match monday.checked_sub(7) {
                Some(this_monday) => days(this_monday, monday),
                // The week of the epoch began on 1969-12-29.
                None => (0, days(0, monday).1),
            }
        }
        CalendarUnit::Month => {
            let first = today - (day_of_month(today) - 1);
            // The next 1st is 28 to 31 days later.
            let mut next = first + 28;
            while day_of_month(next) != 1 {
                next += 1;
            }
            days(first, next)
        }
    }
}

/// The day of the month (1..=31) of a day count since 1970-01-01, after Howard Hinnant's
/// `civil_from_days`: exact for every `u64`, unlike jiff's year-9999 range.
fn day_of_month(days: u64) -> u64 {
    let z = days + 719_468; // days since 0000-03-01: years run March to February
    let era = z / 146_097; // 400-year eras
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153; // month, counted from March
    doy - (153 * mp + 2) / 5 + 1
}

/// Windows in a real zone; `None`, so that the caller falls back to UTC, when jiff cannot
/// represent an instant involved (beyond the year 9999).
fn zoned_bounds(unit: CalendarUnit, tz: &TimeZone, now_ms: u64) -> Option<(u64, u64)> {
    let now = Timestamp::from_millisecond(i64::try_from(now_ms).ok()?).ok()?;
    let (start, end) = match unit {
        CalendarUnit::Minute => clock_bounds(tz, now, MINUTE_MS)?,
        CalendarUnit::Hour => clock_bounds(tz, now, HOUR_MS)?,
        CalendarUnit::Day | CalendarUnit::Week | CalendarUnit::Month => {
            calendar_bounds(unit, tz, now)?
        }
    };
    // Instants before the epoch clamp to 0.
    let millis = |t: i64| u64::try_from(t).unwrap_or(0);
    let (start, end) = (millis(start), millis(end));
    // Holds for every zone in the tzdb (checked for all transitions 1970-2040); the check
    // only keeps the promise should some future rule break the reasoning above.
    (start <= now_ms && now_ms < end).then_some((start, end))
}

/// Days, weeks and months: from the first instant the local clock reaches the window's
/// first midnight to the first instant it reaches the next window's. A skipped midnight
/// is reached at the jump over it; a midnight shown twice by a jump back counts once, so
/// a day is never split.
fn calendar_bounds(unit: CalendarUnit, tz: &TimeZone, now: Timestamp) -> Option<(i64, i64)> {
    let date = tz.to_datetime(now).date();
    let first_day = match unit {
        CalendarUnit::Week => {
            let since_monday = date.weekday().to_monday_zero_offset();
            date.checked_sub(Span::new().days(since_monday)).ok()?
        }
        CalendarUnit::Month => date.first_of_month(),
        _ => date,
    };
    let this = DateTime::from_parts(first_day, Time::midnight());
    let next = this.checked_add(unit.span()).ok()?;
    let (start, end) = (first_reached(tz, this)?, first_reached(tz, next)?);
    if end > now.as_millisecond() {
        return Some((start, end));
    }
    // A jump back across midnight (00:01 -> 23:01, Newfoundland until 2011) shows
    // yesterday's times again after today has begun: those instants belong to today.
    let after_next = next.checked_add(unit.span()).ok()?;
    Some((end, first_reached(tz, after_next)?))
}

/// The first instant, in ms, at which the local clock reads `civil` or later.
fn first_reached(tz: &TimeZone, civil: DateTime) -> Option<i64> {
    let instant = match tz.to_ambiguous_timestamp(civil).offset() {
        AmbiguousOffset::Unambiguous { offset } => offset.to_timestamp(civil).ok()?,
        // Shown twice (fall-back): the first showing.
        AmbiguousOffset::Fold { before, .. } => before.to_timestamp(civil).ok()?,
        // Skipped (spring-forward): the jump. Read with the post-jump offset, `civil` is
        // an instant just before the jump, so the jump is the next transition.
        AmbiguousOffset::Gap { after, .. } => {
            let just_before = after.to_timestamp(civil).ok()?;
            tz.following(just_before).next()?.timestamp()
        }
    };
    Some(instant.as_millisecond())
}

/// Minutes and hours: every instant at which the local clock shows the top of the minute
/// (hour) starts a window, and so does a jump forward over one. A fall-back therefore
/// shows the repeated hour as two one-hour windows; a jump back that does not land on a
/// boundary (Lord Howe's 02:00 -> 01:30) just lengthens the current window.
fn clock_bounds(tz: &TimeZone, now: Timestamp, unit_ms: u64) -> Option<(i64, i64)> {
    let clock = Clock {
        tz,
        unit: i64::try_from(unit_ms).ok()?,
    };
    let now = now.as_millisecond();
    Some((clock.last_boundary(now)?, clock.next_boundary(now)?))
}

/// A zone's wall clock, ticking in `unit` ms. Between two transitions the offset is fixed
/// and the clock runs in step with UTC, so there the boundaries are the multiples of `unit`
/// in local milliseconds; only at a transition does a search move to the neighbouring
/// offset period.
struct Clock<'a> {
    tz: &'a TimeZone,
    unit: i64,
}

/// Transitions are months apart in practice; the bound only guarantees termination.
const MAX_PERIODS: usize = 4;

impl Clock<'_> {
    /// The local time at `t`, as ms since 1970-01-01T00:00 local.
    fn local(&self, t: i64) -> Option<i64> {
        let offset = self.tz.to_offset(Timestamp::from_millisecond(t).ok()?);
        Some(t + i64::from(offset.seconds()) * 1000)
    }

    /// Whether the transition at `t` is a boundary: it lands on one or jumps forward over one.
    fn is_boundary(&self, t: i64) -> Option<bool> {
        let (before, at) = (self.local(t - 1)?, self.local(t)?);
        let floor = at - at.rem_euclid(self.unit);
        Some(floor == at || floor > before)
    }

    /// The last boundary at or before `t`.
    fn last_boundary(&self, mut t: i64) -> Option<i64> {
        for _ in 0..MAX_PERIODS {
            let candidate = t - self.local(t)?.rem_euclid(self.unit);
            // The transition that began `t`'s offset period, if `candidate` predates it.
            let jump = Timestamp::from_millisecond(t + 1)
                .ok()
                .and_then(|ts| self.tz.preceding(ts).next())
                .map(|tr| tr.timestamp().as_millisecond())
                .filter(|&jump| candidate < jump);
            match jump {
                None => return Some(candidate),
                Some(jump) if self.is_boundary(jump)? => return Some(jump),
                // No boundary since the jump: keep looking before it.
                Some(jump) => t = jump - 1,
            }
        }
        None
    }

    /// The first boundary after `t`.
    fn next_boundary(&self, mut t: i64) -> Option<i64> {
        for _ in 0..MAX_PERIODS {
            let candidate = t - self.local(t)?.rem_euclid(self.unit) + self.unit;
            // The transition that ends `t`'s offset period, if it comes first.
            let jump = Timestamp::from_millisecond(t)
                .ok()
                .and_then(|ts| self.tz.following(ts).next())
                .map(|tr| tr.timestamp().as_millisecond())
                .filter(|&jump| jump <= candidate);
            match jump {
                None => return Some(candidate),
                Some(jump) if self.is_boundary(jump)? => return Some(jump),
                // The jump skips no boundary: keep looking after it.
                Some(jump) => t = jump,
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use CalendarUnit::{Day, Hour, Minute, Month, Week};

    /// RFC 3339 instant -> ms since the epoch.
    fn ms(rfc3339: &str) -> u64 {
        let ts: Timestamp = rfc3339.parse().expect("valid RFC 3339");
        u64::try_from(ts.as_millisecond()).expect("after the epoch")
    }

    fn zone(name: &str) -> Zone {
        Zone::named(name).expect("zone in tzdb")
    }

    /// Checks a table with one case per line: unit, zone, now, expected start, expected
    /// end (instants as RFC 3339); text after `#` is a comment.
    fn check(table: &str) {
        for line in table.lines() {
            let case = line.split('#').next().unwrap_or_default();
            let fields: Vec<&str> = case.split_whitespace().collect();
            let [unit, name, now, start, end] = fields[..] else {
                assert!(fields.is_empty(), "bad case: {line}");
                continue;
            };
            let unit = CalendarUnit::parse(unit).expect("unit");
            let got = window_bounds(unit, &zone(name), ms(now));
            assert_eq!(got, (ms(start), ms(end)), "{line}");
        }
    }

    #[test]
    fn utc_windows() {
        check(
            "
            minute UTC 2026-05-14T10:37:42.123Z 2026-05-14T10:37:00Z 2026-05-14T10:38:00Z
            hour   UTC 2026-05-14T10:37:42.123Z 2026-05-14T10:00:00Z 2026-05-14T11:00:00Z
            day    UTC 2026-05-14T10:37:42.123Z 2026-05-14T00:00:00Z 2026-05-15T00:00:00Z
            # 2026-05-14 is a Thursday; weeks run Monday to Monday.
            week   UTC 2026-05-14T10:37:42.123Z 2026-05-11T00:00:00Z 2026-05-18T00:00:00Z
            week   UTC 2026-05-17T23:59:59.999Z 2026-05-11T00:00:00Z 2026-05-18T00:00:00Z
            week   UTC 2026-05-18T00:00:00Z     2026-05-18T00:00:00Z 2026-05-25T00:00:00Z
            month  UTC 2026-05-14T10:37:42.123Z 2026-05-01T00:00:00Z 2026-06-01T00:00:00Z
            month  UTC 2026-12-31T23:59:59.999Z 2026-12-01T00:00:00Z 2027-01-01T00:00:00Z
            # Leap and common Februaries.
            month  UTC 2024-02-29T12:00:00Z     2024-02-01T00:00:00Z 2024-03-01T00:00:00Z
            month  UTC 2026-02-15T12:00:00Z     2026-02-01T00:00:00Z 2026-03-01T00:00:00Z
            month  UTC 2000-02-10T00:00:00Z     2000-02-01T00:00:00Z 2000-03-01T00:00:00Z
            month  UTC 2100-02-10T00:00:00Z     2100-02-01T00:00:00Z 2100-03-01T00:00:00Z
            ",
        );
    }

    #[test]
    fn utc_fast_path_matches_jiff() {
        // "Etc/UTC" is a tzdb zone, so it takes the jiff path.
        let etc_utc = zone("Etc/UTC");
        for now in [
            "1970-01-05T00:00:00Z",
            "2024-02-29T23:59:59.999Z",
            "2026-03-29T01:30:00Z",
        ] {
            for unit in [Minute, Hour, Day, Week, Month] {
                let fast = window_bounds(unit, &Zone::utc(), ms(now));
                assert_eq!(
                    fast,
                    window_bounds(unit, &etc_utc, ms(now)),
                    "{unit:?} {now}"
                );
            }
        }
    }

    #[test]
    fn paris_days_across_dst() {
        check(
            "
            # Spring forward 2026-03-29 02:00 -> 03:00: a 23 h day.
            day Europe/Paris 2026-03-29T12:00:00Z 2026-03-28T23:00:00Z 2026-03-29T22:00:00Z
            day Europe/Paris 2026-03-28T23:00:00Z 2026-03-28T23:00:00Z 2026-03-29T22:00:00Z
            # Fall back 2026-10-25 03:00 -> 02:00: a 25 h day.
            day Europe/Paris 2026-10-25T12:00:00Z 2026-10-24T22:00:00Z 2026-10-25T23:00:00Z
            ",
        );
    }

    #[test]
    fn new_york_across_dst() {
        check(
            "
            # Spring forward 2026-03-08 02:00 EST -> 03:00 EDT: a 23 h day ...
            day    America/New_York 2026-03-08T12:00:00Z 2026-03-08T05:00:00Z 2026-03-09T04:00:00Z
            # ... whose 01:00 hour ends at the jump, and the next hour is 03:00.
            hour   America/New_York 2026-03-08T06:30:00Z 2026-03-08T06:00:00Z 2026-03-08T07:00:00Z
            hour   America/New_York 2026-03-08T07:30:00Z 2026-03-08T07:00:00Z 2026-03-08T08:00:00Z
            # Fall back 2026-11-01 02:00 EDT -> 01:00 EST: a 25 h day ...
            day    America/New_York 2026-11-01T12:00:00Z 2026-11-01T04:00:00Z 2026-11-02T05:00:00Z
            # ... whose 01:00 hour is shown twice: two one-hour windows,
            hour   America/New_York 2026-11-01T05:30:00Z 2026-11-01T05:00:00Z 2026-11-01T06:00:00Z
            hour   America/New_York 2026-11-01T06:30:00Z 2026-11-01T06:00:00Z 2026-11-01T07:00:00Z
            # and 01:59 EDT is followed by 01:00 EST.
            minute America/New_York 2026-11-01T05:59:30Z 2026-11-01T05:59:00Z 2026-11-01T06:00:00Z
            minute America/New_York 2026-11-01T06:00:30Z 2026-11-01T06:00:00Z 2026-11-01T06:01:00Z
            ",
        );
    }

    #[test]
    fn weeks_start_monday() {
        check(
            "
            # Monday 2026-03-23 00:00 CET to Monday 2026-03-30 00:00 CEST: 167 h.
            week Europe/Paris     2026-03-29T12:00:00Z 2026-03-22T23:00:00Z 2026-03-29T22:00:00Z
            week Europe/Paris     2026-03-29T22:00:00Z 2026-03-29T22:00:00Z 2026-04-05T22:00:00Z
            # Sunday 23:30 EDT is Monday in UTC, but still last week locally.
            week America/New_York 2026-05-18T03:30:00Z 2026-05-11T04:00:00Z 2026-05-18T04:00:00Z
            ",
        );
    }

    #[test]
    fn paris_months() {
        check(
            "
            # In summer (+02) months start at 22:00Z the day before ...
            month Europe/Paris 2026-05-14T10:00:00Z 2026-04-30T22:00:00Z 2026-05-31T22:00:00Z
            month Europe/Paris 2026-04-30T22:30:00Z 2026-04-30T22:00:00Z 2026-05-31T22:00:00Z
            # ... in winter (+01) at 23:00Z; March starts in winter and ends in summer.
            month Europe/Paris 2026-01-14T10:00:00Z 2025-12-31T23:00:00Z 2026-01-31T23:00:00Z
            month Europe/Paris 2026-03-14T10:00:00Z 2026-02-28T23:00:00Z 2026-03-31T22:00:00Z
            ",
        );
    }

    #[test]
    fn half_hour_offsets() {
        check(
            "
            # Kolkata is +05:30 all year: hours turn at :30 UTC, days at 18:30Z.
            hour Asia/Kolkata        2026-05-14T10:15:00Z 2026-05-14T09:30:00Z 2026-05-14T10:30:00Z
            day  Asia/Kolkata        2026-05-14T10:15:00Z 2026-05-13T18:30:00Z 2026-05-14T18:30:00Z
            # Lord Howe springs forward 30 min (02:00 +10:30 -> 02:30 +11) on 2026-10-04,
            # so its 02:00 hour is the half hour 02:30-03:00.
            hour Australia/Lord_Howe 2026-10-03T15:00:00Z 2026-10-03T14:30:00Z 2026-10-03T15:30:00Z
            hour Australia/Lord_Howe 2026-10-03T15:40:00Z 2026-10-03T15:30:00Z 2026-10-03T16:00:00Z
            # It falls back 30 min (02:00 +11 -> 01:30 +10:30) on 2026-04-05: a 90 min 01:00 hour.
            hour Australia/Lord_Howe 2026-04-04T14:45:00Z 2026-04-04T14:00:00Z 2026-04-04T15:30:00Z
            ",
        );
    }

    #[test]
    fn missing_midnight_starts_at_the_jump() {
        check(
            "
            # Santiago springs forward at midnight (2026-09-06 00:00 -04 -> 01:00 -03).
            day America/Santiago 2026-09-06T12:00:00Z     2026-09-06T04:00:00Z 2026-09-07T03:00:00Z
            day America/Santiago 2026-09-06T03:59:59.999Z 2026-09-05T04:00:00Z 2026-09-06T04:00:00Z
            ",
        );
    }

    #[test]
    fn midnight_shown_twice_starts_the_day_once() {
        check(
            "
            # St. John's fell back at 00:01 (1987-10-25 00:01 -02:30 -> 23:01 -03:30):
            # the day began at the first midnight; the repeated 23:01-23:59 belongs to it.
            day    America/St_Johns 1987-10-25T02:45:00Z 1987-10-25T02:30:00Z 1987-10-26T03:30:00Z
            # The jump lands mid-hour, so the hour begun at 00:00 runs on to the next 00:00,
            # while minute windows restart at the jump (it lands on 23:01:00).
            hour   America/St_Johns 1987-10-25T02:30:30Z 1987-10-25T02:30:00Z 1987-10-25T03:30:00Z
            hour   America/St_Johns 1987-10-25T02:45:00Z 1987-10-25T02:30:00Z 1987-10-25T03:30:00Z
            minute America/St_Johns 1987-10-25T02:31:30Z 1987-10-25T02:31:00Z 1987-10-25T02:32:00Z
            ",
        );
    }

    #[test]
    fn boundaries_are_exact() {
        for (unit, name, now) in [
            (Minute, "UTC", "2026-05-14T10:37:42Z"),
            (Day, "UTC", "2026-05-14T10:37:42Z"),
            (Week, "Europe/Paris", "2026-03-29T12:00:00Z"),
            (Month, "Europe/Paris", "2026-03-14T10:00:00Z"),
            (Hour, "America/New_York", "2026-11-01T05:30:00Z"),
            (Hour, "Asia/Kolkata", "2026-05-14T10:15:00Z"),
        ] {
            let z = zone(name);
            let (start, end) = window_bounds(unit, &z, ms(now));
            assert_eq!(window_bounds(unit, &z, start), (start, end), "now == start");
            assert_eq!(
                window_bounds(unit, &z, end - 1),
                (start, end),
                "now == end - 1"
            );
            let (next_start, next_end) = window_bounds(unit, &z, end);
            assert_eq!(next_start, end, "now == end opens the next window");
            assert!(next_end > end);
        }
    }

    #[test]
    fn extreme_instants_do_not_panic() {
        let zones = [
            Zone::utc(),
            zone("Europe/Paris"),
            zone("America/New_York"),
            zone("Asia/Kolkata"),
        ];
        let jiff_max = u64::try_from(Timestamp::MAX.as_millisecond()).unwrap_or(u64::MAX);
        for z in &zones {
            for unit in [Minute, Hour, Day, Week, Month] {
                for now in [
                    0,
                    1,
                    jiff_max - 1,
                    jiff_max,
                    jiff_max + 1,
                    i64::MAX as u64,
                    u64::MAX - 1,
                    u64::MAX,
                ] {
                    let (start, end) = window_bounds(unit, z, now);
                    assert!(start <= now, "{} in {} at {now}", unit.as_str(), z.name());
                    assert!(
                        now < end || end == u64::MAX,
                        "{} in {} at {now}",
                        unit.as_str(),
                        z.name()
                    );
                }
            }
        }
        // Past jiff's range (the year 9999) zones fall back to UTC windows.
        let late = jiff_max + 1;
        assert_eq!(
            window_bounds(Month, &zone("Europe/Paris"), late),
            window_bounds(Month, &Zone::utc(), late)
        );
        // Windows that began before the epoch start at 0.
        assert_eq!(
            window_bounds(Week, &Zone::utc(), 0),
            (0, ms("1970-01-05T00:00:00Z"))
        );
        assert_eq!(
            window_bounds(Day, &zone("America/New_York"), 0),
            (0, ms("1970-01-01T05:00:00Z"))
        );
        assert_eq!(
            window_bounds(Day, &Zone::utc(), u64::MAX),
            (u64::MAX - u64::MAX % DAY_MS, u64::MAX)
        );
    }

    #[test]
    fn zones_and_units_by_name() {
        assert_eq!(Zone::named("UTC"), Ok(Zone::utc()));
        assert!(Zone::utc().is_utc());
        assert_eq!(zone("Europe/Paris").name(), "Europe/Paris");
        assert!(!zone("Europe/Paris").is_utc());
        let err = Zone::named("Mars/Olympus").unwrap_err();
        assert_eq!(
            err,
            UnknownZone {
                name: "Mars/Olympus".into()
            }
        );
        assert_eq!(err.to_string(), r#"unknown time zone "Mars/Olympus""#);
        for unit in [Minute, Hour, Day, Week, Month] {
            assert_eq!(CalendarUnit::parse(unit.as_str()), Some(unit));
        }
        assert_eq!(CalendarUnit::parse("Day"), None);
        assert_eq!(CalendarUnit::parse("year"), None);
    }
}
