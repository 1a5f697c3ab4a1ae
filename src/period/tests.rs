//! Windows, stamps and first-use deadlines, checked against dates worked out
//! by hand from the calendar and the time-zone database.

use std::time::Duration;

use jiff::tz::{Offset, TimeZone};
use jiff::{SignedDuration, Timestamp};
use proptest::prelude::*;

use super::{Period, Window};

fn ts(s: &str) -> Timestamp {
    s.parse()
        .unwrap_or_else(|e| panic!("{s:?} is not a timestamp: {e}"))
}

fn zone(name: &str) -> TimeZone {
    TimeZone::get(name).unwrap_or_else(|e| panic!("time zone {name:?} is not in the database: {e}"))
}

fn berlin() -> TimeZone {
    zone("Europe/Berlin")
}

const NANO: SignedDuration = SignedDuration::from_nanos(1);

fn hours(n: i64) -> SignedDuration {
    SignedDuration::from_hours(n)
}

/// Asserts a window's start, end and stamp at once, so a failure shows all
/// three.
#[track_caller]
fn assert_window(window: &Window, start: &str, end: &str, stamp: &str) {
    assert_eq!(
        (window.start(), window.end(), window.stamp()),
        (ts(start), ts(end), stamp),
        "window {window:?}"
    );
}

/// A zone's aliases name one day: instances configured with either, and
/// callers naming either, count on one counter. UTC's names are all UTC.
#[test]
fn a_zones_aliases_stamp_its_windows_alike() {
    let at = ts("2026-12-02T13:05:10Z");
    for names in [
        ["America/New_York", "US/Eastern"],
        ["Asia/Kolkata", "Asia/Calcutta"],
        ["Asia/Kathmandu", "Asia/Katmandu"],
        ["UTC", "Etc/GMT"],
    ] {
        let [a, b] = names.map(|name| Period::day().in_time_zone(zone(name)).window(at));
        assert_eq!(a.stamp(), b.stamp(), "{names:?}");
        assert_eq!((a.start(), a.end()), (b.start(), b.end()), "{names:?}");
    }
    let day = Period::day().in_time_zone(zone("US/Eastern")).window(at);
    assert_eq!(day.stamp(), "2026-12-02[America/New_York]");
}

/// Every window from the one containing `from` up to the one containing
/// `until`, following each window's end to the next.
fn windows_between(period: &Period, from: Timestamp, until: Timestamp) -> Vec<Window> {
    let mut windows = vec![period.window(from)];
    while windows.last().unwrap().end() <= until {
        let next = period.window(windows.last().unwrap().end());
        windows.push(next);
        assert!(windows.len() < 10_000, "windows never reach {until}");
    }
    windows
}

/// Each window starts where the previous one ended, and no two share a stamp.
#[track_caller]
fn assert_contiguous_and_distinct(windows: &[Window]) {
    for pair in windows.windows(2) {
        assert_eq!(
            pair[0].end(),
            pair[1].start(),
            "a gap or overlap between {pair:?}"
        );
    }
    for (i, a) in windows.iter().enumerate() {
        assert!(a.length() > SignedDuration::ZERO, "empty window {a:?}");
        for b in &windows[..i] {
            assert_ne!(
                a.stamp(),
                b.stamp(),
                "two windows share a stamp: {a:?} and {b:?}"
            );
        }
    }
}

// Calendar windows in UTC.

#[test]
fn utc_minute() {
    let window = Period::minute().window(ts("2026-12-02T13:05:42.123456789Z"));
    assert_window(
        &window,
        "2026-12-02T13:05:00Z",
        "2026-12-02T13:06:00Z",
        "2026-12-02T13:05",
    );
    assert_eq!(window.length(), SignedDuration::from_secs(60));
}

#[test]
fn utc_hour() {
    let window = Period::hour().window(ts("2026-12-02T13:05:42Z"));
    assert_window(
        &window,
        "2026-12-02T13:00:00Z",
        "2026-12-02T14:00:00Z",
        "2026-12-02T13",
    );
    assert_eq!(window.length(), hours(1));
}

#[test]
fn utc_day() {
    let window = Period::day().window(ts("2026-12-02T13:05:42Z"));
    assert_window(
        &window,
        "2026-12-02T00:00:00Z",
        "2026-12-03T00:00:00Z",
        "2026-12-02",
    );
    assert_eq!(window.length(), hours(24));
}

#[test]
fn utc_week_starts_on_monday() {
    // 2026-12-02 is a Wednesday in ISO week 49.
    let window = Period::week().window(ts("2026-12-02T13:05:42Z"));
    assert_window(
        &window,
        "2026-11-30T00:00:00Z",
        "2026-12-07T00:00:00Z",
        "2026-W49",
    );
    assert_eq!(window.length(), hours(7 * 24));
    // Sunday night is still the same week, Monday midnight is the next.
    assert_eq!(
        Period::week().window(ts("2026-12-06T23:59:59.999999999Z")),
        window
    );
    assert_eq!(
        Period::week().window(ts("2026-12-07T00:00:00Z")).stamp(),
        "2026-W50"
    );
}

#[test]
fn utc_month() {
    let window = Period::month().window(ts("2026-12-02T13:05:42Z"));
    assert_window(
        &window,
        "2026-12-01T00:00:00Z",
        "2027-01-01T00:00:00Z",
        "2026-12",
    );
    assert_eq!(window.length(), hours(31 * 24));
}

#[test]
fn utc_zone_names_give_the_same_stamps_as_the_default() {
    let at = ts("2026-12-02T13:05:42Z");
    let names = [
        "UTC",
        "Etc/UTC",
        "utc",
        "Zulu",
        "GMT",
        "Etc/GMT",
        "Etc/GMT+0",
        "Etc/GMT-0",
        "GMT0",
        "Greenwich",
        "Etc/Greenwich",
    ];
    let zones = names.into_iter().map(zone);
    for tz in [TimeZone::UTC, TimeZone::fixed(Offset::UTC)]
        .into_iter()
        .chain(zones)
    {
        for period in [
            Period::minute(),
            Period::hour(),
            Period::day(),
            Period::week(),
            Period::month(),
        ] {
            assert_eq!(
                period.clone().in_time_zone(tz.clone()).window(at),
                period.window(at),
                "{period:?} in {tz:?}"
            );
        }
    }
}

#[test]
fn stamps_are_zero_padded() {
    let at = ts("2027-01-04T03:07:00Z");
    assert_eq!(Period::minute().window(at).stamp(), "2027-01-04T03:07");
    assert_eq!(Period::hour().window(at).stamp(), "2027-01-04T03");
    assert_eq!(Period::day().window(at).stamp(), "2027-01-04");
    assert_eq!(Period::week().window(at).stamp(), "2027-W01");
    assert_eq!(Period::month().window(at).stamp(), "2027-01");
}

// The end is exclusive: an instant on a boundary opens the next window.

#[test]
fn an_instant_on_a_boundary_belongs_to_the_next_window() {
    let cases = [
        (Period::minute(), "2026-12-02T13:06:00Z", "2026-12-02T13:06"),
        (Period::hour(), "2026-12-02T14:00:00Z", "2026-12-02T14"),
        (Period::day(), "2026-12-03T00:00:00Z", "2026-12-03"),
        (Period::week(), "2026-12-07T00:00:00Z", "2026-W50"),
        (Period::month(), "2027-01-01T00:00:00Z", "2027-01"),
        (
            Period::fixed(Duration::from_secs(10)),
            "2026-12-02T13:33:30Z",
            "2026-12-02T13:33:30Z/PT10S",
        ),
    ];
    for (period, boundary, stamp) in cases {
        let boundary = ts(boundary);
        let before = period.window(boundary - NANO);
        let at = period.window(boundary);
        assert_eq!(before.end(), boundary, "{period:?}");
        assert!(
            !before.contains(boundary),
            "{period:?}: the end is inside {before:?}"
        );
        assert_eq!(at.start(), boundary, "{period:?}");
        assert!(at.contains(boundary), "{period:?}");
        assert_eq!(at.stamp(), stamp, "{period:?}");
        assert_ne!(before.stamp(), at.stamp(), "{period:?}");
    }
}

#[test]
fn window_contains_its_start_and_not_its_end() {
    let window = Period::day().window(ts("2026-12-02T13:05:42Z"));
    assert!(window.contains(window.start()));
    assert!(window.contains(window.end() - NANO));
    assert!(!window.contains(window.end()));
    assert!(!window.contains(window.start() - NANO));
    assert_eq!(window.length(), window.end() - window.start());
}

// ISO weeks: the week-year is not the calendar year at the edges.

#[test]
fn new_year_2027_falls_in_week_53_of_2026() {
    // 2026 starts on a Thursday, so it has 53 ISO weeks; the last one runs
    // from Monday 2026-12-28 to Sunday 2027-01-03.
    let week = Period::week();
    let dec31 = week.window(ts("2026-12-31T12:00:00Z"));
    assert_window(
        &dec31,
        "2026-12-28T00:00:00Z",
        "2027-01-04T00:00:00Z",
        "2026-W53",
    );
    assert_eq!(week.window(ts("2027-01-01T00:00:00Z")), dec31);
    assert_eq!(week.window(ts("2027-01-03T23:59:59Z")), dec31);
    let next = week.window(ts("2027-01-04T00:00:00Z"));
    assert_window(
        &next,
        "2027-01-04T00:00:00Z",
        "2027-01-11T00:00:00Z",
        "2027-W01",
    );
}

#[test]
fn late_december_can_belong_to_week_1_of_the_next_year() {
    // Monday 2024-12-30 opens ISO week 2025-W01.
    let window = Period::week().window(ts("2024-12-31T08:00:00Z"));
    assert_window(
        &window,
        "2024-12-30T00:00:00Z",
        "2025-01-06T00:00:00Z",
        "2025-W01",
    );
    let before = Period::week().window(ts("2024-12-29T23:59:59Z"));
    assert_eq!(before.stamp(), "2024-W52");
}

#[test]
fn early_january_can_belong_to_the_previous_week_year() {
    // Sunday 2021-01-03 is in 2020-W53; 2020 started on a Wednesday of a leap year.
    let window = Period::week().window(ts("2021-01-03T08:00:00Z"));
    assert_window(
        &window,
        "2020-12-28T00:00:00Z",
        "2021-01-04T00:00:00Z",
        "2020-W53",
    );
}

#[test]
fn weeks_of_a_year_are_numbered_one_to_fifty_three() {
    let week = Period::week();
    let windows = windows_between(
        &week,
        ts("2026-01-01T00:00:00Z"),
        ts("2026-12-31T00:00:00Z"),
    );
    let stamps: Vec<&str> = windows.iter().map(Window::stamp).collect();
    let expected: Vec<String> = (1..=53).map(|n| format!("2026-W{n:02}")).collect();
    assert_eq!(stamps, expected);
    assert_contiguous_and_distinct(&windows);
    assert!(windows.iter().all(|w| w.length() == hours(7 * 24)));
}

// Months of 28 to 31 days.

#[test]
fn month_lengths_in_a_leap_year() {
    let month = Period::month();
    let windows = windows_between(
        &month,
        ts("2028-01-15T00:00:00Z"),
        ts("2028-12-15T00:00:00Z"),
    );
    let days: Vec<i64> = windows.iter().map(|w| w.length().as_hours() / 24).collect();
    assert_eq!(days, [31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]);
    let stamps: Vec<&str> = windows.iter().map(Window::stamp).collect();
    let expected: Vec<String> = (1..=12).map(|m| format!("2028-{m:02}")).collect();
    assert_eq!(stamps, expected);
    assert_contiguous_and_distinct(&windows);
}

#[test]
fn january_31_is_followed_by_february() {
    let month = Period::month();
    let jan = month.window(ts("2027-01-31T23:59:59.999999999Z"));
    assert_window(
        &jan,
        "2027-01-01T00:00:00Z",
        "2027-02-01T00:00:00Z",
        "2027-01",
    );
    let feb = month.window(jan.end());
    assert_window(
        &feb,
        "2027-02-01T00:00:00Z",
        "2027-03-01T00:00:00Z",
        "2027-02",
    );
    assert_eq!(feb.length(), hours(28 * 24));

    let feb_leap = month.window(ts("2028-02-29T12:00:00Z"));
    assert_window(
        &feb_leap,
        "2028-02-01T00:00:00Z",
        "2028-03-01T00:00:00Z",
        "2028-02",
    );
    assert_eq!(feb_leap.length(), hours(29 * 24));
}

#[test]
fn december_ends_in_the_next_year() {
    let dec = Period::month().window(ts("2026-12-31T23:59:59Z"));
    assert_window(
        &dec,
        "2026-12-01T00:00:00Z",
        "2027-01-01T00:00:00Z",
        "2026-12",
    );
    assert_eq!(Period::month().window(dec.end()).stamp(), "2027-01");
    let last_day = Period::day().window(ts("2026-12-31T23:59:59Z"));
    assert_window(
        &last_day,
        "2026-12-31T00:00:00Z",
        "2027-01-01T00:00:00Z",
        "2026-12-31",
    );
}

// Europe/Berlin: a 23-hour day in March and a 25-hour day in October.

#[test]
fn berlin_day_when_clocks_go_forward_lasts_23_hours() {
    let day = Period::day().in_time_zone(berlin());
    let window = day.window(ts("2026-03-29T12:00:00Z"));
    // Midnight CET (+01:00) to midnight CEST (+02:00).
    assert_window(
        &window,
        "2026-03-28T23:00:00Z",
        "2026-03-29T22:00:00Z",
        "2026-03-29[Europe/Berlin]",
    );
    assert_eq!(window.length(), hours(23));
    assert_eq!(
        day.window(ts("2026-03-29T22:00:00Z")).stamp(),
        "2026-03-30[Europe/Berlin]"
    );
    assert_eq!(
        day.window(ts("2026-03-28T22:59:59Z")).stamp(),
        "2026-03-28[Europe/Berlin]"
    );
}

#[test]
fn berlin_day_when_clocks_go_back_lasts_25_hours() {
    let day = Period::day().in_time_zone(berlin());
    let window = day.window(ts("2026-10-25T12:00:00Z"));
    // Midnight CEST (+02:00) to midnight CET (+01:00).
    assert_window(
        &window,
        "2026-10-24T22:00:00Z",
        "2026-10-25T23:00:00Z",
        "2026-10-25[Europe/Berlin]",
    );
    assert_eq!(window.length(), hours(25));
    assert_eq!(
        day.window(ts("2026-10-25T23:00:00Z")).stamp(),
        "2026-10-26[Europe/Berlin]"
    );
}

// America/Santiago: clocks change at midnight. In April the Saturday ends
// at 24:00 -03 and 23:00 -04 comes again: a 25-hour Saturday, and Sunday
// starts at the one real midnight. In September Sunday's 00:00 never
// comes: the day starts at 01:00 and lasts 23 hours.

#[test]
fn santiago_saturday_when_clocks_go_back_at_midnight_lasts_25_hours() {
    let day = Period::day().in_time_zone(zone("America/Santiago"));
    let saturday = day.window(ts("2026-04-04T12:00:00Z"));
    assert_window(
        &saturday,
        "2026-04-04T03:00:00Z",
        "2026-04-05T04:00:00Z",
        "2026-04-04[America/Santiago]",
    );
    assert_eq!(saturday.length(), hours(25));
    // The hour of 23:00 that comes twice is Saturday's, both times.
    assert_eq!(
        day.window(ts("2026-04-05T03:30:00Z")).stamp(),
        "2026-04-04[America/Santiago]"
    );
    assert_eq!(
        day.window(ts("2026-04-05T04:00:00Z")).stamp(),
        "2026-04-05[America/Santiago]"
    );
}

#[test]
fn santiago_sunday_when_clocks_go_forward_at_midnight_starts_at_one() {
    let day = Period::day().in_time_zone(zone("America/Santiago"));
    let sunday = day.window(ts("2026-09-06T12:00:00Z"));
    // 01:00 -03, the first instant of the day, to Monday's 00:00 -03.
    assert_window(
        &sunday,
        "2026-09-06T04:00:00Z",
        "2026-09-07T03:00:00Z",
        "2026-09-06[America/Santiago]",
    );
    assert_eq!(sunday.length(), hours(23));
    assert_eq!(
        day.window(ts("2026-09-06T03:59:59Z")).stamp(),
        "2026-09-05[America/Santiago]"
    );
}

#[test]
fn berlin_hours_of_the_23_hour_day() {
    let hour = Period::hour().in_time_zone(berlin());
    let day = Period::day()
        .in_time_zone(berlin())
        .window(ts("2026-03-29T12:00:00Z"));
    let windows = windows_between(&hour, day.start(), day.end() - NANO);
    assert_eq!(windows.len(), 23);
    assert_eq!(windows.first().unwrap().start(), day.start());
    assert_eq!(windows.last().unwrap().end(), day.end());
    assert_contiguous_and_distinct(&windows);
    assert!(
        windows.iter().all(|w| w.length() == hours(1)),
        "{windows:#?}"
    );
}

#[test]
fn berlin_skipped_hour_has_no_window() {
    // At 01:00Z the clocks jump from 02:00 CET to 03:00 CEST.
    let hour = Period::hour().in_time_zone(berlin());
    let before = hour.window(ts("2026-03-29T00:59:59Z"));
    assert_window(
        &before,
        "2026-03-29T00:00:00Z",
        "2026-03-29T01:00:00Z",
        // Local 01:00: an hour of UTC, named as in UTC.
        "2026-03-29T00",
    );
    let after = hour.window(ts("2026-03-29T01:00:00Z"));
    assert_window(
        &after,
        "2026-03-29T01:00:00Z",
        "2026-03-29T02:00:00Z",
        // Local 03:00.
        "2026-03-29T01",
    );
    let day = Period::day()
        .in_time_zone(berlin())
        .window(ts("2026-03-29T12:00:00Z"));
    let windows = windows_between(&hour, day.start(), day.end() - NANO);
    // No window for the skipped local hour 02:00: 23 hours, one after
    // the other.
    assert_eq!(windows.len(), 23);
    assert_contiguous_and_distinct(&windows);
    for window in &windows {
        let local = window.start().to_zoned_datetime(berlin());
        assert_ne!(local.hour(), 2, "a window in the skipped hour: {window:?}");
    }
}

#[test]
fn berlin_minutes_across_the_skipped_hour() {
    let minute = Period::minute().in_time_zone(berlin());
    let before = minute.window(ts("2026-03-29T00:59:30Z"));
    // Local 01:59, then 03:00: minutes of UTC, named as in UTC.
    assert_eq!(before.stamp(), "2026-03-29T00:59");
    let after = minute.window(before.end());
    assert_window(
        &after,
        "2026-03-29T01:00:00Z",
        "2026-03-29T01:01:00Z",
        "2026-03-29T01:00",
    );
}

#[test]
fn berlin_repeated_hour_gives_two_windows() {
    // At 01:00Z the clocks go back from 03:00 CEST to 02:00 CET: the local
    // hour 02:00-03:00 happens twice.
    let hour = Period::hour().in_time_zone(berlin());
    let first = hour.window(ts("2026-10-25T00:30:00Z"));
    let second = hour.window(ts("2026-10-25T01:30:00Z"));
    assert_window(
        &first,
        "2026-10-25T00:00:00Z",
        "2026-10-25T01:00:00Z",
        // Local 02:00 CEST, then 02:00 CET: two hours of UTC.
        "2026-10-25T00",
    );
    assert_window(
        &second,
        "2026-10-25T01:00:00Z",
        "2026-10-25T02:00:00Z",
        "2026-10-25T01",
    );
    assert_ne!(first.stamp(), second.stamp());
    assert_eq!(first.length(), hours(1));
    assert_eq!(second.length(), hours(1));
    assert_eq!(first.end(), second.start());
    // The instant of the change belongs to the second.
    assert_eq!(hour.window(ts("2026-10-25T01:00:00Z")), second);
    assert_eq!(hour.window(ts("2026-10-25T00:59:59.999999999Z")), first);
}

#[test]
fn berlin_hours_of_the_25_hour_day() {
    let hour = Period::hour().in_time_zone(berlin());
    let day = Period::day()
        .in_time_zone(berlin())
        .window(ts("2026-10-25T12:00:00Z"));
    let windows = windows_between(&hour, day.start(), day.end() - NANO);
    assert_eq!(windows.len(), 25);
    assert_eq!(windows.first().unwrap().start(), day.start());
    assert_eq!(windows.last().unwrap().end(), day.end());
    assert_contiguous_and_distinct(&windows);
    assert!(
        windows.iter().all(|w| w.length() == hours(1)),
        "{windows:#?}"
    );
    // The local hour 02:00 twice: two windows, two stamps.
    let twos: Vec<&str> = windows
        .iter()
        .filter(|w| w.start().to_zoned_datetime(berlin()).hour() == 2)
        .map(Window::stamp)
        .collect();
    assert_eq!(twos, ["2026-10-25T00", "2026-10-25T01"]);
}

#[test]
fn berlin_minutes_of_the_repeated_hour_are_distinct() {
    let minute = Period::minute().in_time_zone(berlin());
    let windows = windows_between(
        &minute,
        ts("2026-10-24T23:55:00Z"),
        ts("2026-10-25T02:05:00Z"),
    );
    assert_contiguous_and_distinct(&windows);
    assert!(windows
        .iter()
        .all(|w| w.length() == SignedDuration::from_secs(60)));
    // Local 02:30 CEST, then 02:30 CET.
    assert_eq!(
        minute.window(ts("2026-10-25T00:30:00Z")).stamp(),
        "2026-10-25T00:30"
    );
    assert_eq!(
        minute.window(ts("2026-10-25T01:30:00Z")).stamp(),
        "2026-10-25T01:30"
    );
}

#[test]
fn berlin_week_and_month_across_changes() {
    let tz = berlin();
    // The week of the October change lasts 169 hours; its Monday is
    // 2026-10-19, ISO week 43.
    let week = Period::week()
        .in_time_zone(tz.clone())
        .window(ts("2026-10-25T12:00:00Z"));
    assert_window(
        &week,
        "2026-10-18T22:00:00Z",
        "2026-10-25T23:00:00Z",
        "2026-W43[Europe/Berlin]",
    );
    assert_eq!(week.length(), hours(7 * 24 + 1));
    // March 2026 lasts 31 days less an hour.
    let march = Period::month()
        .in_time_zone(tz)
        .window(ts("2026-03-15T12:00:00Z"));
    assert_window(
        &march,
        "2026-02-28T23:00:00Z",
        "2026-03-31T22:00:00Z",
        "2026-03[Europe/Berlin]",
    );
    assert_eq!(march.length(), hours(31 * 24 - 1));
}

#[test]
fn berlin_day_follows_local_midnight() {
    // 23:30Z on 2026-12-01 is already 00:30 on 2026-12-02 in Berlin.
    let day = Period::day().in_time_zone(berlin());
    let window = day.window(ts("2026-12-01T23:30:00Z"));
    assert_window(
        &window,
        "2026-12-01T23:00:00Z",
        "2026-12-02T23:00:00Z",
        "2026-12-02[Europe/Berlin]",
    );
    assert_eq!(
        Period::day().window(ts("2026-12-01T23:30:00Z")).stamp(),
        "2026-12-01"
    );
}

// Zones with odd offsets and half-hour changes.

#[test]
fn kolkata_hours_start_at_half_past_utc() {
    let hour = Period::hour().in_time_zone(zone("Asia/Kolkata"));
    let window = hour.window(ts("2026-12-02T13:05:00Z"));
    // 18:35 in Kolkata.
    assert_window(
        &window,
        "2026-12-02T12:30:00Z",
        "2026-12-02T13:30:00Z",
        "2026-12-02T18+05:30[Asia/Kolkata]",
    );
    let windows = windows_between(
        &hour,
        ts("2026-12-01T00:00:00Z"),
        ts("2026-12-03T00:00:00Z"),
    );
    assert_contiguous_and_distinct(&windows);
    assert!(windows.iter().all(|w| w.length() == hours(1)));
    assert!(windows.iter().all(|w| w.start().as_second() % 3600 == 1800));
}

#[test]
fn kolkata_day_starts_at_18_30_utc() {
    let day = Period::day().in_time_zone(zone("Asia/Kolkata"));
    let window = day.window(ts("2026-12-02T20:00:00Z"));
    assert_window(
        &window,
        "2026-12-02T18:30:00Z",
        "2026-12-03T18:30:00Z",
        "2026-12-03[Asia/Kolkata]",
    );
}

#[test]
fn lord_howe_half_hour_fall_back_keeps_hours_distinct() {
    // Lord Howe Island moves between +11:00 and +10:30. On 2026-04-05 at
    // 02:00 +11:00 (15:00Z) the clocks go back to 01:30 +10:30: the local
    // half hour 01:30-02:00 happens twice.
    let hour = Period::hour().in_time_zone(zone("Australia/Lord_Howe"));
    let windows = windows_between(
        &hour,
        ts("2026-04-04T12:00:00Z"),
        ts("2026-04-04T18:00:00Z"),
    );
    assert_contiguous_and_distinct(&windows);
    assert!(windows.iter().all(|w| w.length() <= hours(1)));

    let before = hour.window(ts("2026-04-04T14:59:59Z"));
    assert_window(
        &before,
        "2026-04-04T14:00:00Z",
        "2026-04-04T15:00:00Z",
        // At +11:00 an hour of UTC, named as in UTC.
        "2026-04-04T14",
    );
    let repeated = hour.window(ts("2026-04-04T15:00:00Z"));
    assert_window(
        &repeated,
        "2026-04-04T15:00:00Z",
        "2026-04-04T15:30:00Z",
        "2026-04-05T01+10:30[Australia/Lord_Howe]",
    );
    let after = hour.window(ts("2026-04-04T15:30:00Z"));
    assert_window(
        &after,
        "2026-04-04T15:30:00Z",
        "2026-04-04T16:30:00Z",
        "2026-04-05T02+10:30[Australia/Lord_Howe]",
    );
}

#[test]
fn lord_howe_half_hour_spring_forward_keeps_hours_contiguous() {
    // On 2026-10-04 at 02:00 +10:30 (2026-10-03T15:30Z) the clocks jump to
    // 02:30 +11:00.
    let hour = Period::hour().in_time_zone(zone("Australia/Lord_Howe"));
    let windows = windows_between(
        &hour,
        ts("2026-10-03T12:00:00Z"),
        ts("2026-10-03T18:00:00Z"),
    );
    assert_contiguous_and_distinct(&windows);
    assert!(windows.iter().all(|w| w.length() <= hours(1)));

    let before = hour.window(ts("2026-10-03T15:29:59Z"));
    assert_window(
        &before,
        "2026-10-03T14:30:00Z",
        "2026-10-03T15:30:00Z",
        "2026-10-04T01+10:30[Australia/Lord_Howe]",
    );
    let short = hour.window(ts("2026-10-03T15:30:00Z"));
    assert_window(
        &short,
        "2026-10-03T15:30:00Z",
        "2026-10-03T16:00:00Z",
        "2026-10-04T02+11:00[Australia/Lord_Howe]",
    );
    // At +11:00 again: an hour of UTC.
    let after = hour.window(ts("2026-10-03T16:00:00Z"));
    assert_eq!(after.stamp(), "2026-10-03T16");
}

/// A minute or an hour whose instants are a minute or an hour of UTC is
/// one counter whatever zone names it: callers in several zones (or one
/// caller under several names of its zone) do not each get a window of
/// their own. An hour at a half-hour offset is not one of UTC's, and keeps
/// a stamp of its own.
#[test]
fn minutes_and_whole_hours_are_named_as_in_utc_in_every_zone() {
    let at = ts("2026-12-02T13:05:10Z");
    let zones = [
        "UTC",
        "Europe/Berlin",
        "Asia/Tokyo",
        "America/New_York",
        "US/Eastern",
        "Asia/Kolkata",
        "Asia/Kathmandu",
    ];
    for name in zones {
        let minute = Period::minute().in_time_zone(zone(name)).window(at);
        assert_window(
            &minute,
            "2026-12-02T13:05:00Z",
            "2026-12-02T13:06:00Z",
            "2026-12-02T13:05",
        );
    }
    for name in ["UTC", "Europe/Berlin", "Asia/Tokyo", "US/Eastern"] {
        let hour = Period::hour().in_time_zone(zone(name)).window(at);
        assert_window(
            &hour,
            "2026-12-02T13:00:00Z",
            "2026-12-02T14:00:00Z",
            "2026-12-02T13",
        );
    }
    let kolkata = Period::hour().in_time_zone(zone("Asia/Kolkata")).window(at);
    assert_window(
        &kolkata,
        "2026-12-02T12:30:00Z",
        "2026-12-02T13:30:00Z",
        "2026-12-02T18+05:30[Asia/Kolkata]",
    );
    let kathmandu = Period::hour()
        .in_time_zone(zone("Asia/Kathmandu"))
        .window(at);
    assert_window(
        &kathmandu,
        "2026-12-02T12:15:00Z",
        "2026-12-02T13:15:00Z",
        "2026-12-02T18+05:45[Asia/Kathmandu]",
    );
}

#[test]
fn lord_howe_days_last_23_and_a_half_and_24_and_a_half_hours() {
    let day = Period::day().in_time_zone(zone("Australia/Lord_Howe"));
    let fall_back = day.window(ts("2026-04-04T20:00:00Z"));
    assert_eq!(fall_back.stamp(), "2026-04-05[Australia/Lord_Howe]");
    assert_eq!(fall_back.length(), SignedDuration::from_mins(24 * 60 + 30));
    let spring_forward = day.window(ts("2026-10-04T00:00:00Z"));
    assert_eq!(spring_forward.stamp(), "2026-10-04[Australia/Lord_Howe]");
    assert_eq!(
        spring_forward.length(),
        SignedDuration::from_mins(23 * 60 + 30)
    );
}

#[test]
fn fixed_offset_zone_is_named_by_its_offset() {
    let tz = TimeZone::fixed(Offset::from_seconds(5 * 3600 + 30 * 60).unwrap());
    let at = ts("2026-12-02T13:05:00Z");
    let day = Period::day().in_time_zone(tz.clone()).window(at);
    assert_window(
        &day,
        "2026-12-01T18:30:00Z",
        "2026-12-02T18:30:00Z",
        "2026-12-02[+05:30]",
    );
    let hour = Period::hour().in_time_zone(tz).window(at);
    assert_window(
        &hour,
        "2026-12-02T12:30:00Z",
        "2026-12-02T13:30:00Z",
        "2026-12-02T18+05:30[+05:30]",
    );
}

#[test]
fn a_whole_skipped_day_leaves_no_gap() {
    // Samoa moved across the date line: in Apia, 2011-12-29 was followed by
    // 2011-12-31.
    let day = Period::day().in_time_zone(zone("Pacific/Apia"));
    let dec29 = day.window(ts("2011-12-30T09:59:59Z"));
    assert_eq!(dec29.stamp(), "2011-12-29[Pacific/Apia]");
    let dec31 = day.window(dec29.end());
    assert_eq!(dec31.stamp(), "2011-12-31[Pacific/Apia]");
    assert_eq!(dec29.end(), ts("2011-12-30T10:00:00Z"));
    assert_eq!(dec31.start(), dec29.end());
}

// Fixed windows, aligned to the Unix epoch.

#[test]
fn fixed_ten_seconds() {
    let period = Period::fixed(Duration::from_secs(10));
    let window = period.window(ts("2026-12-02T13:33:27.5Z"));
    assert_window(
        &window,
        "2026-12-02T13:33:20Z",
        "2026-12-02T13:33:30Z",
        "2026-12-02T13:33:20Z/PT10S",
    );
    assert_eq!(window.start().as_second() % 10, 0);
    assert_eq!(period.window(ts("2026-12-02T13:33:20Z")), window);
    assert_eq!(period.window(ts("2026-12-02T13:33:29.999999999Z")), window);
}

#[test]
fn fixed_windows_ignore_the_time_zone() {
    let utc = Period::fixed(Duration::from_secs(86_400));
    let berlin = utc.clone().in_time_zone(berlin());
    let at = ts("2026-03-29T12:00:00Z");
    assert_eq!(berlin.window(at), utc.window(at));
    assert_window(
        &utc.window(at),
        "2026-03-29T00:00:00Z",
        "2026-03-30T00:00:00Z",
        "2026-03-29T00:00:00Z/PT24H",
    );
}

#[test]
fn fixed_window_stamps_name_the_length() {
    let at = ts("2026-12-02T13:33:27Z");
    let stamp = |secs| {
        Period::fixed(Duration::from_secs(secs))
            .window(at)
            .stamp()
            .to_owned()
    };
    assert_eq!(stamp(1), "2026-12-02T13:33:27Z/PT1S");
    assert_eq!(stamp(90), "2026-12-02T13:33:00Z/PT90S");
    assert_eq!(stamp(900), "2026-12-02T13:30:00Z/PT15M");
    assert_eq!(stamp(7200), "2026-12-02T12:00:00Z/PT2H");
    // Two lengths whose windows start together never share a stamp.
    assert_ne!(stamp(60), stamp(3600));
    assert_ne!(
        Period::fixed(Duration::from_secs(10))
            .window(ts("2026-12-02T13:00:00Z"))
            .stamp(),
        Period::fixed(Duration::from_secs(20))
            .window(ts("2026-12-02T13:00:00Z"))
            .stamp(),
    );
}

#[test]
fn fixed_windows_before_the_epoch_round_down() {
    let period = Period::fixed(Duration::from_secs(10));
    let window = period.window(ts("1969-12-31T23:59:59.5Z"));
    assert_window(
        &window,
        "1969-12-31T23:59:50Z",
        "1970-01-01T00:00:00Z",
        "1969-12-31T23:59:50Z/PT10S",
    );
    assert_eq!(
        period.window(window.end()).stamp(),
        "1970-01-01T00:00:00Z/PT10S"
    );
}

/// A file of the system's zone database that names no zone of the IANA list
/// (`localtime` is each host's own zone) means another zone on another host:
/// a quota's zone is refused where the quota is made. (Where the database
/// lacks these files, there is nothing to refuse.)
#[test]
fn a_zone_file_that_names_no_iana_zone_is_refused() {
    for name in ["localtime", "posixrules", "right/Asia/Tokyo"] {
        let Ok(tz) = TimeZone::get(name) else {
            continue;
        };
        let refused = std::panic::catch_unwind(|| Period::day().in_time_zone(tz));
        let message = refused.expect_err(name);
        let message = message.downcast_ref::<String>().expect("a message");
        assert!(
            message.contains("a zone of the IANA list or a fixed offset"),
            "{name}: {message}"
        );
    }
    // Aliases and primary names are zones of the list.
    let _ = Period::day().in_time_zone(zone("US/Eastern"));
    let _ = Period::day().in_time_zone(zone("Asia/Kolkata"));
}

#[test]
#[should_panic(expected = "whole number of seconds")]
fn fixed_period_of_a_fraction_of_a_second_is_refused() {
    let _ = Period::fixed(Duration::from_millis(1500));
}

#[test]
#[should_panic(expected = "from one second to 100 years")]
fn fixed_period_of_zero_is_refused() {
    let _ = Period::fixed(Duration::ZERO);
}

#[test]
#[should_panic(expected = "from one second to 100 years")]
fn fixed_period_beyond_a_century_is_refused() {
    let _ = Period::fixed(Duration::from_secs(400_000_000_000));
}

#[test]
fn fixed_period_of_a_century_works_at_both_ends_of_the_clock() {
    let century = Period::fixed(Duration::from_secs(100 * 31_557_600));
    for at in ["1678-01-01T00:00:00Z", "2262-01-01T00:00:00Z"] {
        let at: Timestamp = at.parse().unwrap();
        assert!(century.window(at).contains(at));
        assert!(century.end_of_first_use(at) > at);
    }
}

/// A calendar window that reaches past the ends of the range `jiff`
/// supports is cut there, as a fixed one is: not a panic (on a request's
/// path, with a clock of the application's own).
#[test]
fn a_calendar_window_past_the_ends_of_time_is_cut_there() {
    let tokyo = TimeZone::get("Asia/Tokyo").unwrap();
    for period in [
        Period::minute(),
        Period::hour(),
        Period::day(),
        Period::week(),
        Period::month(),
        Period::day().in_time_zone(tokyo.clone()),
        Period::month().in_time_zone(tokyo),
    ] {
        for at in [
            Timestamp::MAX,
            ts("9999-12-30T12:00:00Z"),
            ts("9999-12-15T00:00:00Z"),
            Timestamp::MIN,
            ts("-009999-01-05T00:00:00Z"),
        ] {
            let window = period.window(at);
            assert!(
                window.start() <= at && (at < window.end() || at == Timestamp::MAX),
                "{period:?} at {at}: {window:?}"
            );
        }
        assert_eq!(period.window(Timestamp::MAX).end(), Timestamp::MAX);
        assert_eq!(period.end_of_first_use(Timestamp::MAX), Timestamp::MAX);
    }
    assert_eq!(Period::month().window(Timestamp::MAX).stamp(), "9999-12");
    assert_eq!(Period::week().window(Timestamp::MAX).stamp(), "9999-W52");
}

// First use: exact durations, and calendar months.

#[test]
fn first_use_day_is_24_hours_even_across_a_change() {
    let day = Period::day().in_time_zone(berlin());
    // Noon CET on the Saturday before the March change: 24 hours later it is
    // 13:00 CEST, not noon.
    assert_eq!(
        day.end_of_first_use(ts("2026-03-28T11:00:00Z")),
        ts("2026-03-29T11:00:00Z")
    );
    assert_eq!(
        day.end_of_first_use(ts("2026-10-24T10:00:00Z")),
        ts("2026-10-25T10:00:00Z")
    );
    assert_eq!(
        Period::day().end_of_first_use(ts("2026-12-02T13:05:42.5Z")),
        ts("2026-12-03T13:05:42.5Z")
    );
}

#[test]
fn first_use_of_fixed_units_is_exact() {
    let at = ts("2026-12-02T13:05:42.123Z");
    assert_eq!(
        Period::minute().end_of_first_use(at),
        at + SignedDuration::from_secs(60)
    );
    assert_eq!(Period::hour().end_of_first_use(at), at + hours(1));
    assert_eq!(
        Period::week().in_time_zone(berlin()).end_of_first_use(at),
        at + hours(7 * 24)
    );
    assert_eq!(
        Period::fixed(Duration::from_secs(10)).end_of_first_use(at),
        at + SignedDuration::from_secs(10)
    );
    // A week across the October change is still 168 hours.
    let oct = ts("2026-10-21T12:00:00Z");
    assert_eq!(
        Period::week().in_time_zone(berlin()).end_of_first_use(oct),
        oct + hours(168)
    );
}

#[test]
fn first_use_month_from_january_31_ends_on_the_last_day_of_february() {
    let month = Period::month();
    assert_eq!(
        month.end_of_first_use(ts("2027-01-31T10:00:00Z")),
        ts("2027-02-28T10:00:00Z")
    );
    assert_eq!(
        month.end_of_first_use(ts("2028-01-31T10:00:00Z")),
        ts("2028-02-29T10:00:00Z")
    );
    assert_eq!(
        month.end_of_first_use(ts("2027-03-31T10:00:00Z")),
        ts("2027-04-30T10:00:00Z")
    );
    assert_eq!(
        month.end_of_first_use(ts("2026-12-31T23:59:59Z")),
        ts("2027-01-31T23:59:59Z")
    );
    assert_eq!(
        month.end_of_first_use(ts("2026-12-02T13:05:00Z")),
        ts("2027-01-02T13:05:00Z")
    );
}

#[test]
fn first_use_month_keeps_the_local_wall_clock() {
    // Noon CET on 2026-03-15 is 11:00Z; noon CEST on 2026-04-15 is 10:00Z.
    let month = Period::month().in_time_zone(berlin());
    assert_eq!(
        month.end_of_first_use(ts("2026-03-15T11:00:00Z")),
        ts("2026-04-15T10:00:00Z")
    );
    // 23:30Z on 2027-01-30 is already 00:30 on the 31st in Berlin, so the
    // month there clamps to 00:30 on 2027-02-28; in UTC it is the 30th, which
    // clamps to 23:30 on the 28th.
    assert_eq!(
        month.end_of_first_use(ts("2027-01-30T23:30:00Z")),
        ts("2027-02-27T23:30:00Z")
    );
    assert_eq!(
        Period::month().end_of_first_use(ts("2027-01-30T23:30:00Z")),
        ts("2027-02-28T23:30:00Z")
    );
}

#[test]
fn first_use_labels() {
    assert_eq!(Period::minute().first_use_label(), "PT1M");
    assert_eq!(Period::hour().first_use_label(), "PT1H");
    assert_eq!(Period::day().first_use_label(), "PT24H");
    assert_eq!(Period::week().first_use_label(), "PT168H");
    assert_eq!(
        Period::fixed(Duration::from_secs(10)).first_use_label(),
        "PT10S"
    );
    assert_eq!(
        Period::fixed(Duration::from_secs(90)).first_use_label(),
        "PT90S"
    );
    assert_eq!(
        Period::fixed(Duration::from_secs(900)).first_use_label(),
        "PT15M"
    );
    assert_eq!(Period::month().first_use_label(), "P1M");
    assert_eq!(
        Period::month().in_time_zone(berlin()).first_use_label(),
        "P1M[Europe/Berlin]"
    );
    // Exact durations do not depend on the zone.
    assert_eq!(
        Period::day().in_time_zone(berlin()).first_use_label(),
        "PT24H"
    );
}

#[test]
fn first_use_labels_of_different_lengths_differ() {
    let periods = [
        Period::minute(),
        Period::hour(),
        Period::day(),
        Period::week(),
        Period::month(),
        Period::month().in_time_zone(berlin()),
        Period::fixed(Duration::from_secs(1)),
        Period::fixed(Duration::from_secs(10)),
        Period::fixed(Duration::from_secs(90)),
        Period::fixed(Duration::from_secs(7200)),
    ];
    for (i, a) in periods.iter().enumerate() {
        for b in &periods[..i] {
            assert_ne!(a.first_use_label(), b.first_use_label(), "{a:?} and {b:?}");
        }
    }
}

#[test]
fn names_and_nominal_lengths() {
    let cases = [
        (Period::minute(), "minute", 60),
        (Period::hour(), "hour", 3_600),
        (Period::day(), "day", 86_400),
        (Period::week(), "week", 604_800),
        (Period::month(), "month", 2_592_000),
        (Period::fixed(Duration::from_secs(10)), "10s", 10),
        (Period::fixed(Duration::from_secs(900)), "15m", 900),
        (Period::fixed(Duration::from_secs(7200)), "2h", 7200),
    ];
    for (period, name, secs) in cases {
        assert_eq!(period.name(), name);
        assert_eq!(period.nominal_seconds(), secs, "{name}");
    }
}

// Properties over random instants, units and zones.

const ZONES: &[&str] = &[
    "UTC",
    "Europe/Berlin",
    "Europe/Dublin",
    "America/New_York",
    "America/Sao_Paulo",
    "America/Havana",
    // Clocks change at midnight: a day that starts at 01:00, a 25-hour
    // Saturday.
    "America/Santiago",
    "Asia/Beirut",
    "America/St_Johns",
    "America/Toronto",
    "America/Caracas",
    "Africa/Monrovia",
    "Antarctica/Troll",
    "Asia/Kolkata",
    "Asia/Kathmandu",
    "Asia/Pyongyang",
    "Australia/Lord_Howe",
    "Australia/Adelaide",
    "Pacific/Chatham",
    "Pacific/Apia",
    "Pacific/Kiritimati",
];

fn period_in_zone() -> impl Strategy<Value = Period> {
    let unit = prop_oneof![
        Just(Period::minute()),
        Just(Period::hour()),
        Just(Period::day()),
        Just(Period::week()),
        Just(Period::month()),
        (1u64..=100_000).prop_map(|s| Period::fixed(Duration::from_secs(s))),
    ];
    (unit, proptest::sample::select(ZONES))
        .prop_map(|(period, name)| period.in_time_zone(zone(name)))
}

/// A period and an instant: anywhere from 1900 to 2100 to the nanosecond,
/// or, half of the time, within a few days of one of the zone's offset
/// changes, where windows are split, skipped or repeated.
fn period_and_instant() -> impl Strategy<Value = (Period, Timestamp)> {
    let seconds = -2_208_988_800i64..4_102_444_800;
    let nanos = 0i32..1_000_000_000;
    let near = -3 * 86_400i64..3 * 86_400;
    (period_in_zone(), any::<bool>(), seconds, nanos, near).prop_map(
        |(period, at_change, s, n, near)| {
            let anywhere = Timestamp::new(s, n).unwrap();
            let at = if at_change {
                match period.time_zone().following(anywhere).next() {
                    Some(change) => change.timestamp() + SignedDuration::new(near, n),
                    None => anywhere,
                }
            } else {
                anywhere
            };
            (period, at)
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn adjacent_windows_meet_and_never_share_a_stamp((period, at) in period_and_instant()) {
        let window = period.window(at);
        prop_assert!(window.contains(at), "{:?} does not contain {}", window, at);
        prop_assert!(window.length() > SignedDuration::ZERO);

        let next = period.window(window.end());
        prop_assert_eq!(next.start(), window.end());
        prop_assert_ne!(next.stamp(), window.stamp());

        let previous = period.window(window.start() - NANO);
        prop_assert_eq!(previous.end(), window.start());
        prop_assert_ne!(previous.stamp(), window.stamp());
    }

    #[test]
    fn every_instant_of_a_window_maps_to_it((period, at) in period_and_instant(), fraction in 0.0f64..1.0) {
        let window = period.window(at);
        prop_assert_eq!(&period.window(window.start()), &window);
        prop_assert_eq!(&period.window(window.end() - NANO), &window);
        let nanos = window.length().as_nanos() as f64 * fraction;
        let inside = window.start() + SignedDuration::from_nanos(nanos as i64);
        prop_assert!(window.contains(inside));
        prop_assert_eq!(&period.window(inside), &window);
    }

    #[test]
    fn windows_have_plausible_lengths((period, at) in period_and_instant()) {
        let length = period.window(at).length();
        let nominal = SignedDuration::from_secs(period.nominal_seconds() as i64);
        let (low, high) = match period.name().as_str() {
            "minute" | "hour" => (SignedDuration::from_secs(1), nominal),
            // Zone changes move a boundary by up to a couple of hours; Samoa
            // skipped a whole day, so one of its weeks lasted six days.
            "day" => (nominal - hours(3), nominal + hours(3)),
            "week" => (nominal - hours(27), nominal + hours(3)),
            "month" => (hours(27 * 24), hours(31 * 24 + 3)),
            _ => (nominal, nominal),
        };
        prop_assert!(low <= length && length <= high, "{:?}: {:?} not in {:?}..={:?}", period, length, low, high);
    }

    #[test]
    fn same_stamp_means_same_window((period, at) in period_and_instant(), offset in -3_000_000i64..3_000_000) {
        // Instants up to about a month apart.
        let a = period.window(at);
        let b = period.window(at + SignedDuration::from_secs(offset));
        prop_assert_eq!(a.stamp() == b.stamp(), a == b, "{:?} / {:?}", a, b);
    }

    #[test]
    fn first_use_ends_after_the_first_call((period, at) in period_and_instant()) {
        let end = period.end_of_first_use(at);
        prop_assert!(end > at);
        if period.name() != "month" {
            prop_assert_eq!(end - at, SignedDuration::from_secs(period.nominal_seconds() as i64));
        } else {
            prop_assert!(end - at >= hours(28 * 24 - 3) && end - at <= hours(31 * 24 + 3));
        }
    }
}

#[test]
fn instants_read_in_the_period_zone() {
    let at = ts("2026-12-04T23:00:00Z");
    assert_eq!(Period::day().format_instant(at), "2026-12-04T23:00:00Z");
    assert_eq!(
        Period::day()
            .in_time_zone(zone("Etc/UTC"))
            .format_instant(at),
        "2026-12-04T23:00:00Z"
    );
    assert_eq!(
        Period::day().in_time_zone(berlin()).format_instant(at),
        "2026-12-05T00:00:00+01:00[Europe/Berlin]"
    );
    assert_eq!(
        Period::month()
            .in_time_zone(berlin())
            .format_instant(ts("2026-06-30T22:00:00Z")),
        "2026-07-01T00:00:00+02:00[Europe/Berlin]"
    );
    let india = TimeZone::fixed(Offset::from_seconds(19_800).unwrap());
    assert_eq!(
        Period::week().in_time_zone(india).format_instant(at),
        "2026-12-05T04:30:00+05:30"
    );
}

#[test]
fn a_gap_that_begins_before_midnight_begins_the_day_at_the_change() {
    // Toronto, 1919-03-31: 23:30 EST on the 30th jumped to 00:30 EDT on the
    // 31st (04:30Z). The 31st begins then, not at 01:00 EDT.
    let toronto = zone("America/Toronto");
    let day = Period::day().in_time_zone(toronto.clone());
    for at in [
        "1919-03-31T04:30:00Z",
        "1919-03-31T04:45:00Z",
        "1919-03-31T05:00:00Z",
    ] {
        assert_window(
            &day.window(ts(at)),
            "1919-03-31T04:30:00Z",
            "1919-04-01T04:00:00Z",
            "1919-03-31[America/Toronto]",
        );
    }
    assert_window(
        &day.window(ts("1919-03-31T04:29:59Z")),
        "1919-03-30T05:00:00Z",
        "1919-03-31T04:30:00Z",
        "1919-03-30[America/Toronto]",
    );
    let windows = windows_between(&day, ts("1919-03-28T00:00:00Z"), ts("1919-04-03T00:00:00Z"));
    assert_contiguous_and_distinct(&windows);
    // The 31st was a Monday: the week begins at the change too.
    let week = Period::week().in_time_zone(toronto);
    let window = week.window(ts("1919-03-31T04:45:00Z"));
    assert_eq!(window.start(), ts("1919-03-31T04:30:00Z"));
    assert!(window.contains(ts("1919-03-31T04:45:00Z")), "{window:?}");
}

#[test]
fn a_clock_set_back_just_after_midnight_stays_in_the_day_that_began_last() {
    // St. John's set its clocks back at 00:01 from 1987 to 2010: on
    // 1987-10-25 at 00:01 NDT (02:31Z) back to 23:01 NST, so the 24th
    // shows again for an hour after the 25th began (02:30Z). Every instant
    // is in the window that began last, and windows stay contiguous.
    let day = Period::day().in_time_zone(zone("America/St_Johns"));
    for at in [
        "1987-10-25T02:30:00Z",
        "1987-10-25T02:40:00Z",
        "1987-10-25T03:29:59Z",
    ] {
        assert_window(
            &day.window(ts(at)),
            "1987-10-25T02:30:00Z",
            "1987-10-26T03:30:00Z",
            "1987-10-25[America/St_Johns]",
        );
    }
    assert_window(
        &day.window(ts("1987-10-25T02:29:59Z")),
        "1987-10-24T02:30:00Z",
        "1987-10-25T02:30:00Z",
        "1987-10-24[America/St_Johns]",
    );
    let windows = windows_between(&day, ts("1987-10-20T00:00:00Z"), ts("1987-10-30T00:00:00Z"));
    assert_contiguous_and_distinct(&windows);
    for unit in [Period::week(), Period::month()] {
        let period = unit.in_time_zone(zone("America/St_Johns"));
        let window = period.window(ts("1987-10-25T02:40:00Z"));
        assert!(window.contains(ts("1987-10-25T02:40:00Z")), "{window:?}");
    }
}

#[test]
fn a_clock_set_back_just_after_midnight_on_the_first_stays_in_the_month_that_began_last() {
    // St. John's, 2009-11-01: 00:01 NDT (02:31Z) back to 23:01 NST, so
    // October 31st shows again for an hour after November began (02:30Z).
    let month = Period::month().in_time_zone(zone("America/St_Johns"));
    for at in [
        "2009-11-01T02:30:00Z",
        "2009-11-01T02:40:00Z",
        "2009-11-01T03:29:59Z",
    ] {
        assert_window(
            &month.window(ts(at)),
            "2009-11-01T02:30:00Z",
            "2009-12-01T03:30:00Z",
            "2009-11[America/St_Johns]",
        );
    }
    assert_window(
        &month.window(ts("2009-11-01T02:29:59Z")),
        "2009-10-01T02:30:00Z",
        "2009-11-01T02:30:00Z",
        "2009-10[America/St_Johns]",
    );
    let windows = windows_between(
        &month,
        ts("2009-09-15T00:00:00Z"),
        ts("2009-12-15T00:00:00Z"),
    );
    assert_contiguous_and_distinct(&windows);
}

/// A first-use period is told by its exact length: "a day after the first
/// call" would read as the next calendar day.
#[test]
fn a_first_use_reset_is_told_by_its_exact_length() {
    for (period, words) in [
        (Period::minute(), "1m after the first call"),
        (Period::hour(), "1h after the first call"),
        (Period::day(), "24h after the first call"),
        (Period::week(), "168h after the first call"),
    ] {
        assert_eq!(period.describe_reset(super::Anchor::FirstUse), words);
    }
}

/// A first-use period that would end past the last instant `jiff` holds
/// ends there: never before its first call (a counter with no lifetime).
#[test]
fn a_first_use_period_past_the_end_of_time_ends_at_the_last_instant() {
    let late = Timestamp::MAX - hours(1);
    for period in [
        Period::day(),
        Period::month(),
        Period::fixed(Duration::from_secs(100 * 31_557_600)),
    ] {
        assert_eq!(period.end_of_first_use(late), Timestamp::MAX, "{period:?}");
    }
}

/// A calendar reset is told in the period's own zone, a fixed offset as
/// that offset (never as UTC), and the instants told beside it alike.
#[test]
fn a_calendar_reset_is_told_in_the_periods_zone_or_offset() {
    let calendar = super::Anchor::Calendar;
    let at = ts("2026-12-04T23:00:00Z");
    let kolkata_offset = TimeZone::fixed(Offset::from_seconds(5 * 3600 + 30 * 60).unwrap());
    for (period, words, instant) in [
        (
            Period::day(),
            "every day at 00:00 UTC",
            "2026-12-04T23:00:00Z",
        ),
        (
            Period::day().in_time_zone(berlin()),
            "every day at 00:00 Europe/Berlin",
            "2026-12-05T00:00:00+01:00[Europe/Berlin]",
        ),
        (
            Period::day().in_time_zone(kolkata_offset.clone()),
            "every day at 00:00 +05:30",
            "2026-12-05T04:30:00+05:30",
        ),
        (
            Period::week().in_time_zone(kolkata_offset),
            "every Monday at 00:00 +05:30",
            "2026-12-05T04:30:00+05:30",
        ),
    ] {
        assert_eq!(period.describe_reset(calendar), words, "{period:?}");
        assert_eq!(period.format_instant(at), instant, "{period:?}");
    }
}

/// A fixed window of up to 100 years reaches past the last instant `jiff`
/// names from decades away: it is cut there, not a panic (on a request's
/// path, with a clock of the application's own).
#[test]
fn a_fixed_window_past_the_ends_of_time_is_cut_there() {
    let century = Duration::from_secs(100 * 31_557_600);
    let period = Period::fixed(century);
    for at in [
        ts("9975-01-01T00:00:00Z"),
        Timestamp::MAX,
        ts("-009990-01-01T00:00:00Z"),
        Timestamp::MIN,
    ] {
        let window = period.window(at);
        assert!(
            window.start() <= at && at < window.end() || at == Timestamp::MAX,
            "{at}"
        );
        assert!(window.end() <= Timestamp::MAX && window.start() >= Timestamp::MIN);
    }
    assert_eq!(
        period.window(ts("9975-01-01T00:00:00Z")).end(),
        Timestamp::MAX
    );
    assert_eq!(
        period.window(ts("-009990-01-01T00:00:00Z")).start(),
        Timestamp::MIN
    );
    let quota = crate::Quota::fixed_window(1, century);
    assert_eq!(
        quota.window(ts("9975-01-01T00:00:00Z")).end(),
        Timestamp::MAX
    );
}

/// A wait is told in whole seconds, rounded up, and a subject's spread is
/// added to the reset, even where the reset is the last instant `jiff`
/// holds and the turn lies past it.
#[test]
fn a_wait_is_rounded_up_and_spread_even_at_the_end_of_time() {
    use super::{seconds_until, seconds_until_turn};
    let now = ts("2026-12-02T10:00:00.5Z");
    assert_eq!(seconds_until(now, ts("2026-12-02T10:00:10Z")), 10);
    assert_eq!(seconds_until(now, now), 0);
    assert_eq!(seconds_until(now, ts("2026-12-02T09:00:00Z")), 0);
    assert_eq!(seconds_until_turn(now, ts("2026-12-02T10:00:10Z"), 0), 10);
    assert_eq!(seconds_until_turn(now, ts("2026-12-02T10:00:10Z"), 30), 40);
    assert_eq!(seconds_until_turn(now, ts("2026-12-02T09:59:50Z"), 30), 20);
    let last = Timestamp::MAX;
    let until_last = seconds_until(now, last);
    assert_eq!(seconds_until_turn(now, last, 30), until_last + 30);
    assert_eq!(seconds_until_turn(now, last, 0), until_last);
}
