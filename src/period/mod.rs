//! Periods, their anchors and the windows they cut time into.
//!
//! A [`Period`] says how long an allowance lasts; an [`Anchor`] says where it
//! starts:
//!
//! - [`Anchor::Calendar`]: the period is a named stretch of a shared clock (the
//!   calendar day 2026-12-02 in UTC, ISO week 2026-W49 in Europe/Berlin, the
//!   10-second window starting at 13:33:20Z). Every instance of an application
//!   derives the same [`Window`] from the same instant, writes its stamp into
//!   the counter's key, and all subjects get a fresh allowance at the same
//!   moment.
//! - [`Anchor::FirstUse`]: the period starts at each subject's first call and
//!   ends one period later. Nothing in the key names it; the counter's fixed
//!   deadline, set once when the counter is created, is the reset.

pub(crate) mod cache;
mod clock;

use std::fmt::{self, Write as _};
use std::sync::Arc;
use std::time::Duration;

use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::{SignedDuration, Timestamp, ToSpan};

pub use self::clock::{Clock, ManualClock, SystemClock};

/// Where a period starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Anchor {
    /// On a shared clock: every subject's period starts and ends together, at
    /// calendar boundaries in the period's time zone (or, for fixed-length
    /// periods, at multiples of the length since the Unix epoch).
    ///
    /// What it promises a customer: "1 000 calls per day, reset at midnight
    /// UTC". Support can state the reset time from the calendar alone.
    Calendar,
    /// At the subject's first call: the allowance returns exactly one period
    /// after the call that opened the period, however often the subject calls
    /// in between.
    ///
    /// What it promises a customer: "1 000 calls per rolling 24 hours from
    /// your first call". Resets are staggered across subjects.
    FirstUse,
}

impl Anchor {
    /// `"calendar"` or `"first-use"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Anchor::Calendar => "calendar",
            Anchor::FirstUse => "first-use",
        }
    }
}

impl fmt::Display for Anchor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The longest fixed period, and the longest reset spread: 100 Julian years.
/// Longer ones would put window ends past the range of dates the calendar
/// arithmetic supports.
pub(crate) const MAX_FIXED_SECONDS: u64 = 100 * 31_557_600;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Unit {
    Minute,
    Hour,
    Day,
    Week,
    Month,
    /// Whole seconds, at least one.
    Fixed(i64),
}

/// How long an allowance lasts: a calendar unit in a time zone, or a fixed
/// number of seconds.
///
/// Calendar units (minute, hour, day, ISO week starting on Monday, month)
/// follow the civil calendar of the period's time zone, UTC unless set with
/// [`Period::in_time_zone`]: a day in Europe/Berlin lasts 23 hours on the
/// last Sunday of March and 25 hours on the last Sunday of October, and a
/// month lasts 28 to 31 days. Fixed periods ([`Period::fixed`]) are cut at
/// multiples of their length since the Unix epoch.
///
/// Under [`Anchor::FirstUse`], minute, hour, day, week and fixed periods are
/// exact durations (a day is 24 hours from the first call); a month ends on
/// the same day of the next month at the same wall-clock time in the period's
/// time zone (clamped to the month's last day).
///
/// ```
/// use tower_quota::Period;
/// use jiff::{tz::TimeZone, Timestamp};
///
/// let berlin = Period::day().in_time_zone(TimeZone::get("Europe/Berlin").unwrap());
/// // The last Sunday of March 2026: clocks jump from 02:00 to 03:00.
/// let at: Timestamp = "2026-03-29T12:00:00Z".parse().unwrap();
/// let window = berlin.window(at);
/// assert_eq!(window.stamp(), "2026-03-29[Europe/Berlin]");
/// assert_eq!(window.length().as_hours(), 23);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Period {
    unit: Unit,
    tz: TimeZone,
    // `None` for UTC: stamps carry no zone suffix then.
    tz_label: Option<Arc<str>>,
}

impl Period {
    const fn unit(unit: Unit) -> Self {
        Self {
            unit,
            tz: TimeZone::UTC,
            tz_label: None,
        }
    }

    /// A calendar minute.
    pub const fn minute() -> Self {
        Self::unit(Unit::Minute)
    }

    /// A calendar hour.
    pub const fn hour() -> Self {
        Self::unit(Unit::Hour)
    }

    /// A calendar day, midnight to midnight.
    pub const fn day() -> Self {
        Self::unit(Unit::Day)
    }

    /// An ISO 8601 week, Monday 00:00 to the next Monday 00:00.
    pub const fn week() -> Self {
        Self::unit(Unit::Week)
    }

    /// A calendar month, from the first of the month at 00:00.
    pub const fn month() -> Self {
        Self::unit(Unit::Month)
    }

    /// A fixed number of whole seconds. Under [`Anchor::Calendar`] the windows
    /// start at multiples of `length` since the Unix epoch, whatever the time
    /// zone.
    ///
    /// # Panics
    ///
    /// When `length` is shorter than a second, longer than 100 years
    /// (3 155 760 000 seconds), or not a whole number of seconds.
    pub fn fixed(length: Duration) -> Self {
        assert!(
            length.subsec_nanos() == 0 && (1..=MAX_FIXED_SECONDS).contains(&length.as_secs()),
            "a fixed period is a whole number of seconds, from one second to 100 years (got {length:?})"
        );
        let secs =
            i64::try_from(length.as_secs()).expect("a period shorter than 292 billion years");
        Self::unit(Unit::Fixed(secs))
    }

    /// The same period in time zone `tz`. Only calendar units (day, week,
    /// month, and hour or minute in zones with odd offsets) depend on it.
    ///
    /// # Panics
    ///
    /// When `tz` is neither a zone of the IANA list (it has a primary name)
    /// nor a fixed offset: a bare POSIX TZ string, or a file of the system's
    /// zone database that is no zone of the list (`localtime`,
    /// `posixrules`, `right/…`), whose rules differ from host to host.
    /// Counter keys need a name that means one zone everywhere.
    #[must_use]
    pub fn in_time_zone(mut self, tz: TimeZone) -> Self {
        self.tz_label = zone_label(&tz);
        self.tz = tz;
        self
    }

    /// The period's time zone.
    pub fn time_zone(&self) -> &TimeZone {
        &self.tz
    }

    /// A short human name: `minute`, `hour`, `day`, `week`, `month`, or the
    /// length of a fixed period such as `10s`, `15m`, `2h`.
    pub fn name(&self) -> String {
        match self.unit {
            Unit::Minute => "minute".into(),
            Unit::Hour => "hour".into(),
            Unit::Day => "day".into(),
            Unit::Week => "week".into(),
            Unit::Month => "month".into(),
            Unit::Fixed(s) => length_name(s),
        }
    }

    /// The period's length in seconds, when every period has the same
    /// (all but months).
    fn fixed_seconds(&self) -> Option<i64> {
        match self.unit {
            Unit::Minute => Some(60),
            Unit::Hour => Some(3_600),
            Unit::Day => Some(86_400),
            Unit::Week => Some(604_800),
            Unit::Fixed(s) => Some(s),
            Unit::Month => None,
        }
    }

    /// The calendar window containing `at`: where it starts and ends, and the
    /// stamp that names it in counter keys.
    ///
    /// Stamps are truncated timestamps in the period's time zone:
    /// `2026-12-02T13:05` (minute), `2026-12-02T13` (hour), `2026-12-02`
    /// (day), `2026-W49` (week), `2026-12` (month), and
    /// `2026-12-02T13:33:20Z/PT10S` for fixed periods. Outside UTC the stamp
    /// of a day, week or month ends with the zone's name,
    /// `2026-12-02[Europe/Berlin]`. A minute or an hour that is a minute or
    /// an hour of UTC (every minute in today's zones; every hour at a
    /// whole-hour offset, as in Berlin) is named as in UTC, whatever the
    /// zone: the same instants, one counter. Any other (an hour in
    /// Kolkata, at +05:30) carries its UTC offset and the zone's name,
    /// `2026-12-02T13+05:30[Asia/Kolkata]`. Two different windows never
    /// share a stamp.
    ///
    /// A window that would begin or end beyond the range `jiff` supports
    /// (years -9999 and 9999) is cut at its first or last instant.
    pub fn window(&self, at: Timestamp) -> Window {
        let tz = &self.tz;
        let mut stamp = String::with_capacity(40);
        let (start, end) = match self.unit {
            Unit::Fixed(len) => {
                let floor = floor_seconds(at).div_euclid(len) * len;
                // Cut at the ends of the range: a window of up to 100 years
                // reaches past them from decades away.
                let start = Timestamp::from_second(floor).unwrap_or(Timestamp::MIN);
                let end = Timestamp::from_second(floor + len).unwrap_or(Timestamp::MAX);
                write!(stamp, "{}/", start.strftime("%Y-%m-%dT%H:%M:%SZ")).expect("infallible");
                write_duration(&mut stamp, len);
                return Window::new(start, end, stamp);
            }
            Unit::Minute | Unit::Hour => {
                let step = if self.unit == Unit::Minute { 60 } else { 3600 };
                let (start, end) = sub_day_window(at, tz, step);
                // The same instants as a minute or an hour of UTC (every
                // minute in today's zones, every hour at a whole-hour
                // offset): named as in UTC, so that callers in every such
                // zone count on one counter.
                let floor = start.as_second();
                if start.subsec_nanosecond() == 0
                    && floor.rem_euclid(step) == 0
                    && end.as_second() - floor == step
                {
                    let format = match self.unit {
                        Unit::Minute => "%Y-%m-%dT%H:%M",
                        _ => "%Y-%m-%dT%H",
                    };
                    write!(stamp, "{}", start.strftime(format)).expect("infallible");
                    return Window::new(start, end, stamp);
                }
                let local = start.to_zoned_datetime(tz.clone());
                let format = match (self.unit, self.tz_label.is_some()) {
                    (Unit::Minute, false) => "%Y-%m-%dT%H:%M",
                    (Unit::Minute, true) => "%Y-%m-%dT%H:%M%:z",
                    (_, false) => "%Y-%m-%dT%H",
                    (_, true) => "%Y-%m-%dT%H%:z",
                };
                write!(stamp, "{}", local.strftime(format)).expect("infallible");
                (start, end)
            }
            // The window of the local date, week or month `at` falls in;
            // or a later one that began by `at`: a clock set back just after
            // midnight (St. John's did so at 00:01 from 1987 to 2010) shows
            // the day before again after the next one began, and the window
            // is the one that began last.
            // Past the range of instants `jiff` holds (within a window of
            // the years -9999 and 9999), the window is cut at its first or
            // last instant, as a fixed one is.
            Unit::Day => {
                let mut date = at.to_zoned_datetime(tz.clone()).date();
                let mut next = date.tomorrow().ok();
                let mut end = starts(next, tz, Timestamp::MAX);
                while at >= end && end < Timestamp::MAX {
                    let Some(day) = next else { break };
                    date = day;
                    next = day.tomorrow().ok();
                    end = starts(next, tz, Timestamp::MAX);
                }
                write!(stamp, "{}", date.strftime("%Y-%m-%d")).expect("infallible");
                (starts(Some(date), tz, Timestamp::MIN), end)
            }
            Unit::Week => {
                let date = at.to_zoned_datetime(tz.clone()).date();
                let back = i64::from(date.weekday().to_monday_zero_offset());
                // A day of the window's week (its Monday, when there is
                // one): it names the week.
                let mut day = date;
                let mut start = starts(date.checked_sub(back.days()).ok(), tz, Timestamp::MIN);
                let mut next = date.checked_add((7 - back).days()).ok();
                let mut end = starts(next, tz, Timestamp::MAX);
                while at >= end && end < Timestamp::MAX {
                    let Some(monday) = next else { break };
                    (day, start) = (monday, end);
                    next = monday.checked_add(7.days()).ok();
                    end = starts(next, tz, Timestamp::MAX);
                }
                write!(stamp, "{}", day.strftime("%G-W%V")).expect("infallible");
                (start, end)
            }
            Unit::Month => {
                let mut first = at.to_zoned_datetime(tz.clone()).date().first_of_month();
                let mut next = first.checked_add(1.month()).ok();
                let mut end = starts(next, tz, Timestamp::MAX);
                while at >= end && end < Timestamp::MAX {
                    let Some(month) = next else { break };
                    first = month;
                    next = month.checked_add(1.month()).ok();
                    end = starts(next, tz, Timestamp::MAX);
                }
                write!(stamp, "{}", first.strftime("%Y-%m")).expect("infallible");
                (starts(Some(first), tz, Timestamp::MIN), end)
            }
        };
        if let Some(label) = &self.tz_label {
            write!(stamp, "[{label}]").expect("infallible");
        }
        Window::new(start, end, stamp)
    }

    /// Whether the period's windows move with its time zone: every unit but
    /// fixed windows, which are cut from the epoch.
    pub(crate) fn depends_on_zone(&self) -> bool {
        !matches!(self.unit, Unit::Fixed(_))
    }

    /// Whether two periods may write the same stamps: the same calendar, or
    /// minutes (hours) in two zones, which share the windows that are
    /// minutes (hours) of UTC (see [`Period::window`]).
    pub(crate) fn may_share_stamps(&self, other: &Period) -> bool {
        match self.unit {
            Unit::Minute | Unit::Hour => self.unit == other.unit,
            _ => self.calendar_identity() == other.calendar_identity(),
        }
    }

    /// Whether two periods have the same unit, whatever their zones.
    pub(crate) fn same_unit(&self, other: &Period) -> bool {
        self.unit == other.unit
    }

    /// Which calendar the stamps of this period come from: quotas with the
    /// same identity write the same stamps. Fixed windows ignore the zone.
    pub(crate) fn calendar_identity(&self) -> String {
        match (self.unit, &self.tz_label) {
            (Unit::Fixed(s), _) => format!("fixed/{s}"),
            (unit, None) => format!("{unit:?}"),
            (unit, Some(zone)) => format!("{unit:?}[{zone}]"),
        }
    }

    /// How the allowance returns under `anchor`, in words a support agent
    /// can read to a customer: `every day at 00:00 Europe/Berlin`,
    /// `every Monday at 00:00 UTC`, `24h after the first call`.
    pub fn describe_reset(&self, anchor: Anchor) -> String {
        // The zone as configured, as `format_instant` tells its instants
        // (keys carry its primary name).
        let zone = match (&self.tz_label, self.tz.iana_name()) {
            (None, _) => "UTC".to_owned(),
            (Some(_), Some(name)) => name.to_owned(),
            (Some(label), None) => label.to_string(),
        };
        match (anchor, self.unit) {
            (Anchor::FirstUse, Unit::Month) => {
                format!("one month after the first call (same day and time, {zone})")
            }
            // The exact length: "a day after" reads as the next day.
            (Anchor::FirstUse, _) => {
                let seconds = self
                    .fixed_seconds()
                    .expect("all but months have one length");
                format!("{} after the first call", length_name(seconds))
            }
            (Anchor::Calendar, Unit::Minute) => format!("at the start of every minute ({zone})"),
            (Anchor::Calendar, Unit::Hour) => format!("at the start of every hour ({zone})"),
            (Anchor::Calendar, Unit::Day) => format!("every day at 00:00 {zone}"),
            (Anchor::Calendar, Unit::Week) => format!("every Monday at 00:00 {zone}"),
            (Anchor::Calendar, Unit::Month) => {
                format!("on the 1st of every month at 00:00 {zone}")
            }
            (Anchor::Calendar, Unit::Fixed(_)) => {
                format!("every {} counted from 1970-01-01T00:00:00Z", self.name())
            }
        }
    }

    /// `at` as read in the period's time zone, in RFC 3339 (RFC 9557 with a
    /// named zone): `2026-12-04T23:00:00Z` in UTC,
    /// `2026-12-05T00:00:00+01:00[Europe/Berlin]` in a named zone,
    /// `2026-12-05T05:30:00+05:30` at a fixed offset. The words of
    /// [`Period::describe_reset`] and the instants told with them agree.
    pub(crate) fn format_instant(&self, at: Timestamp) -> String {
        match (&self.tz_label, self.tz.iana_name()) {
            (None, _) => at.to_string(),
            (Some(_), Some(_)) => at.to_zoned_datetime(self.tz.clone()).to_string(),
            (Some(_), None) => at.display_with_offset(self.tz.to_offset(at)).to_string(),
        }
    }

    /// The instant a first-use period opened at `first_call` ends: the last
    /// instant `jiff` supports (in the year 9999), when it would end later.
    pub fn end_of_first_use(&self, first_call: Timestamp) -> Timestamp {
        self.checked_end_of_first_use(first_call)
            .unwrap_or(Timestamp::MAX)
    }

    /// As [`end_of_first_use`](Self::end_of_first_use), `None` past the
    /// range `jiff` supports: for a first call a store reports, which
    /// another tool may have written.
    pub(crate) fn checked_end_of_first_use(&self, first_call: Timestamp) -> Option<Timestamp> {
        match self.fixed_seconds() {
            Some(secs) => first_call.checked_add(SignedDuration::from_secs(secs)).ok(),
            None => first_call
                .to_zoned_datetime(self.tz.clone())
                .checked_add(1.month())
                .ok()
                .map(|end| end.timestamp()),
        }
    }

    /// The part of a first-use counter's key that names its period: the
    /// length as an ISO 8601 duration (`PT24H`, `PT10S`), or `P1M` and the
    /// zone for months. It tells apart two first-use quotas of one allowance
    /// with different lengths.
    pub fn first_use_label(&self) -> String {
        let mut label = String::with_capacity(16);
        match self.unit {
            Unit::Minute => write_duration(&mut label, 60),
            Unit::Hour => write_duration(&mut label, 3_600),
            Unit::Day => write_duration(&mut label, 86_400),
            Unit::Week => write_duration(&mut label, 604_800),
            Unit::Fixed(s) => write_duration(&mut label, s),
            Unit::Month => {
                label.push_str("P1M");
                if let Some(zone) = &self.tz_label {
                    write!(label, "[{zone}]").expect("infallible");
                }
            }
        }
        label
    }

    /// The length in seconds every period has under `anchor`, when they all
    /// have one: not calendar months, nor calendar hours, days and weeks in
    /// a zone whose offset changes.
    pub(crate) fn constant_seconds(&self, anchor: Anchor) -> Option<u64> {
        let steady_zone = self.tz_label.is_none() || self.tz.to_fixed_offset().is_ok();
        match (anchor, self.unit) {
            (_, Unit::Fixed(s)) => Some(s.unsigned_abs()),
            (_, Unit::Minute) => Some(60),
            (_, Unit::Month) => None,
            (Anchor::Calendar, _) if !steady_zone => None,
            (_, Unit::Hour) => Some(3_600),
            (_, Unit::Day) => Some(86_400),
            (_, Unit::Week) => Some(604_800),
        }
    }

    /// A typical length in seconds: exact for fixed periods, minutes, hours
    /// and weeks outside DST changes; 30 days for a month.
    pub fn nominal_seconds(&self) -> u64 {
        match self.unit {
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 604_800,
            Unit::Month => 2_592_000,
            Unit::Fixed(s) => s.unsigned_abs(),
        }
    }
}

/// One calendar window: `[start, end)` and its stamp.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    start: Timestamp,
    end: Timestamp,
    stamp: Arc<str>,
}

impl Window {
    pub(crate) fn new(start: Timestamp, end: Timestamp, stamp: String) -> Self {
        Self {
            start,
            end,
            stamp: stamp.into(),
        }
    }

    pub(crate) fn first_use(start: Timestamp, end: Timestamp, label: &str) -> Self {
        Self {
            start,
            end,
            stamp: label.into(),
        }
    }

    /// The first instant of the window.
    pub fn start(&self) -> Timestamp {
        self.start
    }

    /// The first instant after the window: when the allowance returns.
    pub fn end(&self) -> Timestamp {
        self.end
    }

    /// The name of the window, as written in counter keys.
    pub fn stamp(&self) -> &str {
        &self.stamp
    }

    /// `end - start`.
    pub fn length(&self) -> SignedDuration {
        self.end.duration_since(self.start)
    }

    /// Whether `at` falls in `[start, end)`.
    pub fn contains(&self, at: Timestamp) -> bool {
        self.start <= at && at < self.end
    }
}

fn floor_seconds(at: Timestamp) -> i64 {
    i64::try_from(at.as_nanosecond().div_euclid(1_000_000_000))
        .expect("jiff timestamps fit in i64 seconds")
}

fn midnight(date: Date, tz: &TimeZone) -> Result<Timestamp, jiff::Error> {
    // Where midnight falls in a gap, `start_of_day` gives the first instant
    // that exists on that date.
    let start = date
        .to_zoned_datetime(tz.clone())?
        .start_of_day()?
        .timestamp();
    // Unless the gap began the day before (Toronto, 1919-03-31: 23:30 EST
    // to 00:30 EDT): then the date begins at the clock change, before the
    // instant `start_of_day` names.
    if let Some(change) = tz.preceding(start).next() {
        let at = change.timestamp();
        let began = tz.to_datetime(at).date() == date;
        let before = at
            .checked_sub(SignedDuration::from_nanos(1))
            .is_ok_and(|before| tz.to_datetime(before).date() < date);
        if began && before {
            return Ok(at);
        }
    }
    Ok(start)
}

/// The instant `date` begins in `tz`; `bound` when there is no such date,
/// or it begins beyond the range of instants `jiff` holds.
fn starts(date: Option<Date>, tz: &TimeZone, bound: Timestamp) -> Timestamp {
    date.and_then(|date| midnight(date, tz).ok())
        .unwrap_or(bound)
}

/// Minute and hour windows follow the local clock: truncate the local time,
/// and split the window at an offset change inside it (zones whose offsets
/// move by half an hour).
fn sub_day_window(at: Timestamp, tz: &TimeZone, step: i64) -> (Timestamp, Timestamp) {
    let offset = i64::from(tz.to_offset(at).seconds());
    let local = floor_seconds(at) + offset;
    let floor = local.div_euclid(step) * step;
    // Cut at the ends of the range of instants `jiff` holds.
    let mut start = Timestamp::from_second(floor - offset).unwrap_or(Timestamp::MIN);
    let mut end = Timestamp::from_second(floor + step - offset).unwrap_or(Timestamp::MAX);
    let current = tz.to_offset(at);
    if tz.to_offset(start) != current {
        let just_after = at.checked_add(SignedDuration::from_nanos(1)).unwrap_or(at);
        if let Some(t) = tz.preceding(just_after).next() {
            start = start.max(t.timestamp());
        }
    }
    let last = end
        .checked_sub(SignedDuration::from_nanos(1))
        .unwrap_or(end);
    if tz.to_offset(last) != current {
        if let Some(t) = tz.following(at).next() {
            end = end.min(t.timestamp());
        }
    }
    (start, end)
}

fn write_duration(out: &mut String, secs: i64) {
    if secs % 3600 == 0 {
        write!(out, "PT{}H", secs / 3600)
    } else if secs % 60 == 0 {
        write!(out, "PT{}M", secs / 60)
    } else {
        write!(out, "PT{secs}S")
    }
    .expect("infallible");
}

/// Whole seconds from `now` until `at`, rounded up: a client that waits this
/// long never comes back before `at`.
pub(crate) fn seconds_until(now: Timestamp, at: Timestamp) -> u64 {
    let d = at.duration_since(now);
    if d.is_negative() || d.is_zero() {
        return 0;
    }
    d.as_secs().unsigned_abs() + u64::from(d.subsec_nanos() != 0)
}

/// Whole seconds from `now` until `spread` seconds after `at` (a subject's
/// turn, when resets are spread), rounded up: 0 once that is past, and
/// less than the spread once `at` is.
pub(crate) fn seconds_until_turn(now: Timestamp, at: Timestamp, spread: u64) -> u64 {
    if spread == 0 {
        return seconds_until(now, at);
    }
    let turn = i64::try_from(spread)
        .ok()
        .and_then(|spread| at.checked_add(SignedDuration::from_secs(spread)).ok());
    match turn {
        Some(turn) => seconds_until(now, turn),
        // Past the last instant a timestamp holds: as far as it goes, then
        // the spread.
        None => seconds_until(now, at).saturating_add(spread),
    }
}

/// A length of `seconds` in the largest whole unit: `24h`, `10m`, `90s`.
fn length_name(seconds: i64) -> String {
    if seconds % 3600 == 0 {
        format!("{}h", seconds / 3600)
    } else if seconds % 60 == 0 {
        format!("{}m", seconds / 60)
    } else {
        format!("{seconds}s")
    }
}

/// Whether `tz` can be a quota's zone ([`Period::in_time_zone`], which
/// panics on any other) or a caller's (a zone the policy's reader returns
/// is refused otherwise), naming calendar windows in counter keys: a zone
/// of the IANA list (it has a primary name) or a fixed offset. A bare
/// POSIX TZ string has neither; nor has a file of the system's zone
/// database that is no zone of the list (`localtime`, `posixrules`,
/// `right/…`), whose rules differ from host to host, so that instances
/// sharing a store would count different windows under one name. Check a
/// zone read from configuration with it before making a quota.
///
/// ```
/// use tower_quota::jiff::tz::TimeZone;
/// use tower_quota::period::is_nameable;
///
/// assert!(is_nameable(&TimeZone::UTC));
/// assert!(!is_nameable(&TimeZone::posix("EST5EDT,M3.2.0,M11.1.0").unwrap()));
/// ```
pub fn is_nameable(tz: &TimeZone) -> bool {
    match (tz.primary_iana_name(), tz.iana_name()) {
        (Some(_), _) => true,
        // A file of the database that names no zone of the list, whatever
        // its offsets: its name means another zone on another host.
        (None, Some(_)) => false,
        (None, None) => tz.to_fixed_offset().is_ok(),
    }
}

/// The name that tells `tz` apart in keys: its primary IANA name, which its
/// aliases share (`US/Eastern` is `America/New_York`, `Asia/Calcutta` is
/// `Asia/Kolkata`, UTC's and GMT's names are all `UTC`), so that instances
/// configured with either, and callers naming either, count on one
/// counter. (jiff keeps the table of primary names: a release of the time
/// zone database that renames a zone, as `Europe/Kiev` became
/// `Europe/Kyiv`, gives its subjects new counters once.)
pub(crate) fn zone_name(tz: &TimeZone) -> Option<&str> {
    tz.primary_iana_name().or_else(|| tz.iana_name())
}

/// `tz` under its primary IANA name (`US/Eastern` as `America/New_York`):
/// what a quota in it tells (a refusal's detail,
/// `QuotaUsage::explain_reset`) then names the zone alike, whichever alias
/// named it. `tz` itself when it has no other name.
pub(crate) fn under_primary_name(tz: &TimeZone) -> TimeZone {
    match (tz.iana_name(), tz.primary_iana_name()) {
        (Some(given), Some(primary)) if given != primary => {
            TimeZone::get(primary).unwrap_or_else(|_| tz.clone())
        }
        _ => tz.clone(),
    }
}

/// The zone's part of a window's stamp: `None` for UTC under any of its
/// names (and GMT's, which is UTC in the time zone database: no offset, no
/// clock change), the primary IANA name of any other, or a fixed offset.
fn zone_label(tz: &TimeZone) -> Option<Arc<str>> {
    assert!(
        is_nameable(tz),
        "a quota's time zone is a zone of the IANA list or a fixed offset, got {tz:?}: a bare \
         POSIX TZ string, or a file of this system's zone database that names no zone of the \
         list and means another zone on another host, has no name that counter keys can carry"
    );
    match zone_name(tz) {
        Some(
            "UTC" | "Etc/UTC" | "Etc/UCT" | "UCT" | "Etc/Zulu" | "Zulu" | "Universal"
            | "Etc/Universal" | "GMT" | "Etc/GMT" | "Etc/GMT+0" | "Etc/GMT-0" | "Etc/GMT0" | "GMT0"
            | "GMT+0" | "GMT-0" | "Greenwich" | "Etc/Greenwich",
        ) => None,
        Some(name) => Some(name.into()),
        None => {
            let offset = tz
                .to_fixed_offset()
                .expect("a nameable zone without a name");
            if offset.seconds() == 0 {
                None
            } else {
                Some(offset.to_string().into())
            }
        }
    }
}

#[cfg(test)]
mod tests;
