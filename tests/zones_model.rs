//! A seeded random walk of requests through an axum app with daily, weekly
//! and monthly calendar quotas, from subjects in several zones (each
//! caller's zone read from a header; no header: the quotas' own zone),
//! the clock stepping onto, just before and just after local midnights,
//! week and month starts and clock changes of hard zones (23- and 25-hour
//! days, Lord Howe's half hour, Chatham's +12:45, Apia's lost 2011-12-30,
//! Kiritimati's +14, St. John's -3:30, Santiago's and Havana's days that
//! begin at 01:00, Casablanca's Ramadan), checked after each step against a
//! reference model computed with jiff alone: the status, `RateLimit`'s `r`
//! and `t`, `Retry-After`, `RateLimit-Policy`'s `w`, and the support
//! router's `used` and `resets_at` with `?zone=`.
//!
//! `ZONES_MODEL_CASES` sets how many cases run (default 12),
//! `ZONES_MODEL_SEED` the first seed, `ZONES_MODEL_TRACE` prints each step.

mod seeded;

use seeded::Rng;

use std::collections::HashMap;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, Response, StatusCode};
use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::{SignedDuration, Timestamp, ToSpan};
use tower::ServiceExt;
use tower_quota::{zone_from_header, FromHeader, ManualClock, Quota, QuotaPolicy};

/// Zones with hard days, and an alias or two (counted as their zone).
const ZONES: &[&str] = &[
    "Europe/Berlin",
    "Australia/Lord_Howe",
    "Pacific/Chatham",
    "Pacific/Apia",
    "Pacific/Kiritimati",
    "America/St_Johns",
    "America/Santiago",
    "America/Havana",
    "Africa/Casablanca",
    "America/New_York",
    "Asia/Kolkata",
    "Cuba",
    "Chile/Continental",
    "NZ-CHAT",
    "UTC",
    "Etc/UTC",
];

const LIMIT: u64 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Day,
    Week,
    Month,
}

const KINDS: [Kind; 3] = [Kind::Day, Kind::Week, Kind::Month];

impl Kind {
    fn path(self) -> &'static str {
        match self {
            Kind::Day => "day",
            Kind::Week => "week",
            Kind::Month => "month",
        }
    }
}

/// The local period of `kind` containing `at` in `tz`, as jiff tells it:
/// the first and the next day of the period, each begun at its
/// `start_of_day`.
fn period(kind: Kind, tz: &TimeZone, at: Timestamp) -> (Timestamp, Timestamp) {
    let date = at.to_zoned_datetime(tz.clone()).date();
    let (first, next): (Date, Date) = match kind {
        Kind::Day => (date, date.tomorrow().unwrap()),
        Kind::Week => {
            let monday = date
                .checked_sub(i64::from(date.weekday().to_monday_zero_offset()).days())
                .unwrap();
            (monday, monday.checked_add(7.days()).unwrap())
        }
        Kind::Month => {
            let first = date.first_of_month();
            (first, first.checked_add(1.month()).unwrap())
        }
    };
    let begin = |d: Date| {
        d.to_zoned_datetime(tz.clone())
            .unwrap()
            .start_of_day()
            .unwrap()
            .timestamp()
    };
    let (start, end) = (begin(first), begin(next));
    if at >= end {
        // A clock set back across midnight (St. John's at 00:01 until
        // 2010) shows the day before again: the period is the one that
        // began last (the crate's documented choice).
        let later = next;
        let after = match kind {
            Kind::Day => later.tomorrow().unwrap(),
            Kind::Week => later.checked_add(7.days()).unwrap(),
            Kind::Month => later.checked_add(1.month()).unwrap(),
        };
        return (begin(later), begin(after));
    }
    (start, end)
}

/// Names of UTC: one counter whichever a caller names.
const UTC_NAMES: &[&str] = &[
    "UTC",
    "Etc/UTC",
    "GMT",
    "Etc/GMT",
    "Zulu",
    "Universal",
    "Etc/UCT",
];

/// Another name of the zone `name` names, sometimes.
fn alias(rng: &mut Rng, name: &'static str) -> &'static str {
    let names: &[&'static str] = match name {
        "America/Havana" | "Cuba" => &["America/Havana", "Cuba"],
        "America/Santiago" | "Chile/Continental" => &["America/Santiago", "Chile/Continental"],
        "Pacific/Chatham" | "NZ-CHAT" => &["Pacific/Chatham", "NZ-CHAT"],
        "Australia/Lord_Howe" => &["Australia/Lord_Howe", "Australia/LHI"],
        "America/St_Johns" => &["America/St_Johns", "Canada/Newfoundland"],
        "Asia/Kolkata" => &["Asia/Kolkata", "Asia/Calcutta"],
        "America/New_York" => &["America/New_York", "US/Eastern"],
        n if UTC_NAMES.contains(&n) => UTC_NAMES,
        _ => return name,
    };
    names[rng.below(names.len() as u64) as usize]
}

fn ceil_secs(from: Timestamp, to: Timestamp) -> u64 {
    let d = to.duration_since(from);
    if d <= SignedDuration::ZERO {
        return 0;
    }
    d.as_secs() as u64 + u64::from(d.subsec_nanos() != 0)
}

/// `name` as a parameter of a Structured Field: `;name=N`.
fn param(field: &str, name: &str) -> u64 {
    let key = format!(";{name}=");
    let at = field
        .find(&key)
        .unwrap_or_else(|| panic!("{name} in {field}"));
    field[at + key.len()..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

fn header<'a>(response: &'a Response<Body>, name: &str) -> Option<&'a str> {
    response.headers().get(name).map(|v| v.to_str().unwrap())
}

async fn body(response: Response<Body>) -> String {
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// An instant of the support router: RFC 3339, with a zone's name or not.
fn instant(text: &str) -> Timestamp {
    if text.contains('[') {
        text.parse::<jiff::ZonedDateTime>().unwrap().timestamp()
    } else {
        text.parse().unwrap()
    }
}

/// The instants worth stepping onto near `zone`'s clock change `change`:
/// the change, the local midnights around it, its week's and month's
/// starts and ends.
fn boundaries(tz: &TimeZone, change: Timestamp) -> Vec<Timestamp> {
    let mut out = vec![change];
    for probe in [
        change - SignedDuration::from_hours(30),
        change,
        change + SignedDuration::from_hours(30),
    ] {
        for kind in KINDS {
            let (start, end) = period(kind, tz, probe);
            out.push(start);
            out.push(end);
        }
    }
    out
}

struct Subject {
    id: String,
    /// The zone its header names; `None`: no header.
    zone: Option<&'static str>,
}

async fn run_case(seed: u64, trace: bool) -> (usize, usize) {
    let mut rng = Rng(seed);
    let own_name = *rng.pick(&[
        "UTC",
        "America/Santiago",
        "Pacific/Apia",
        "Australia/Lord_Howe",
        "America/Havana",
        "Africa/Casablanca",
    ]);
    let own = TimeZone::get(own_name).unwrap();

    // The focus: a clock change of one zone between 2011 and 2027.
    let focus_name = *rng.pick(ZONES);
    let focus = TimeZone::get(focus_name).unwrap();
    let from: Timestamp = "1990-01-01T00:00:00Z".parse().unwrap();
    let until: Timestamp = "2037-12-31T00:00:00Z".parse().unwrap();
    let changes: Vec<Timestamp> = focus
        .following(from)
        .map(|t| t.timestamp())
        .take_while(|t| *t < until)
        .collect();
    let change = if changes.is_empty() {
        from + SignedDuration::from_hours(rng.below(24 * 365 * 16) as i64)
    } else {
        *rng.pick(&changes)
    };
    let mut points = boundaries(&focus, change);
    // A second zone's boundaries near there.
    let other_name = *rng.pick(ZONES);
    let other = TimeZone::get(other_name).unwrap();
    points.extend(boundaries(&other, change));
    points.extend(boundaries(&own, change));
    let mut instants = Vec::new();
    for p in points {
        for offset in [
            SignedDuration::ZERO,
            SignedDuration::from_secs(-1),
            SignedDuration::from_secs(1),
            SignedDuration::from_nanos(-1),
            SignedDuration::from_nanos(1),
            SignedDuration::from_secs(-(rng.below(3_600) as i64)),
        ] {
            if rng.below(3) != 0 {
                instants.push(p + offset);
            }
        }
    }
    instants.sort();
    instants.dedup();

    let subjects: Vec<Subject> = (0..5)
        .map(|i| Subject {
            id: format!("s{i}"),
            zone: if rng.below(5) == 0 {
                None
            } else {
                Some(*rng.pick(ZONES))
            },
        })
        .collect();
    // The focus zone's callers are there for sure.
    let subjects: Vec<Subject> = subjects
        .into_iter()
        .chain([Subject {
            id: "focus".into(),
            zone: Some(focus_name),
        }])
        .map(|s| {
            // `'static` names: the focus zone's is looked up again.
            let zone = s
                .zone
                .map(|z| *ZONES.iter().find(|n| **n == z).unwrap_or(&"Europe/Berlin"));
            Subject { zone, ..s }
        })
        .collect();

    let clock = ManualClock::new(instants[0]);
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock.clone())
        .time_zone(zone_from_header("x-zone"))
        .build();
    let layer = |kind: Kind| {
        let quota = match kind {
            Kind::Day => Quota::daily(LIMIT),
            Kind::Week => Quota::weekly(LIMIT),
            Kind::Month => Quota::monthly(LIMIT),
        };
        policy.layer(quota.allowance(kind.path()).in_time_zone(own.clone()))
    };
    let app = Router::new()
        .route("/day", get(|| async { "ok" }).layer(layer(Kind::Day)))
        .route("/week", get(|| async { "ok" }).layer(layer(Kind::Week)))
        .route("/month", get(|| async { "ok" }).layer(layer(Kind::Month)));
    let admin = Router::new().nest("/admin", policy.handle().router());

    // (subject, zone's primary name, kind, period start) -> used.
    let mut used: HashMap<(String, String, Kind, Timestamp), u64> = HashMap::new();
    let (mut steps, mut lookups) = (0, 0);
    for now in instants {
        clock.set(now);
        for _ in 0..=rng.below(3) {
            let subject = rng.pick(&subjects);
            let kind = *rng.pick(&KINDS);
            // Sometimes another name of the subject's zone: one counter.
            let sent = subject.zone.map(|z| alias(&mut rng, z));
            let tz = match sent {
                Some(name) => TimeZone::get(name).unwrap(),
                None => own.clone(),
            };
            let primary = tz.primary_iana_name().or(tz.iana_name()).unwrap_or("UTC");
            let zone_key = if UTC_NAMES.contains(&primary) {
                "UTC".to_owned()
            } else {
                primary.to_owned()
            };
            let (start, end) = period(kind, &tz, now);
            assert!(
                start <= now && now < end,
                "seed {seed}: the model's period {start}..{end} of {kind:?} in {zone_key} holds {now}"
            );
            let key = (subject.id.clone(), zone_key.clone(), kind, start);
            let count = used.entry(key).or_insert(0);
            let admit = *count < LIMIT;
            if admit {
                *count += 1;
            }
            let mut request =
                Request::get(format!("/{}", kind.path())).header("x-account-id", &subject.id);
            if let Some(zone) = sent {
                request = request.header("x-zone", zone);
            }
            let response = app
                .clone()
                .oneshot(request.body(Body::empty()).unwrap())
                .await
                .unwrap();
            steps += 1;
            let what = format!(
                "seed {seed}: {} ({sent:?}) {kind:?} at {now} = {} local; model period {} .. {} ({} s), used {count}",
                subject.id,
                now.to_zoned_datetime(tz.clone()),
                start.to_zoned_datetime(tz.clone()),
                end.to_zoned_datetime(tz.clone()),
                ceil_secs(start, end),
            );
            if trace {
                eprintln!("{what}: {:?} {:?}", response.status(), response.headers());
            }
            let expected = if admit {
                StatusCode::OK
            } else {
                StatusCode::TOO_MANY_REQUESTS
            };
            assert_eq!(response.status(), expected, "{what}");
            let limit = header(&response, "ratelimit").unwrap_or_else(|| panic!("{what}"));
            let policy_field = header(&response, "ratelimit-policy").unwrap();
            assert_eq!(param(limit, "r"), LIMIT - *count, "{what}: {limit}");
            assert_eq!(param(limit, "t"), ceil_secs(now, end), "{what}: {limit}");
            assert_eq!(
                param(policy_field, "w"),
                ceil_secs(start, end).max(1),
                "{what}: {policy_field}"
            );
            if !admit {
                let retry: u64 = header(&response, "retry-after")
                    .unwrap_or_else(|| panic!("{what}: no retry-after"))
                    .parse()
                    .unwrap();
                assert_eq!(retry, ceil_secs(now, end).max(1), "{what}");
            }
            drop(response);

            // The support router, for the same subject in the same zone.
            let asked = subject.zone.map(|z| alias(&mut rng, z));
            let uri = match asked {
                Some(zone) => format!("/admin/quota/account/{}?zone={zone}", subject.id),
                None => format!("/admin/quota/account/{}", subject.id),
            };
            let shown = admin
                .clone()
                .oneshot(Request::get(uri).body(Body::empty()).unwrap())
                .await
                .unwrap();
            assert_eq!(shown.status(), StatusCode::OK, "{what}");
            let json: serde_json::Value = serde_json::from_str(&body(shown).await).unwrap();
            lookups += 1;
            for entry in json["allowances"].as_array().unwrap() {
                let kind = match entry["allowance"].as_str().unwrap() {
                    "day" => Kind::Day,
                    "week" => Kind::Week,
                    _ => Kind::Month,
                };
                let (start, end) = period(kind, &tz, now);
                let model = used
                    .get(&(subject.id.clone(), zone_key.clone(), kind, start))
                    .copied()
                    .unwrap_or(0);
                assert_eq!(entry["used"], model, "{what}: support {kind:?}: {entry}");
                assert_eq!(
                    entry["remaining"],
                    LIMIT - model,
                    "{what}: support {kind:?}: {entry}"
                );
                let resets_at = instant(entry["resets_at"].as_str().unwrap());
                assert_eq!(resets_at, end, "{what}: support {kind:?}: {entry}");
            }
        }
    }
    (steps, lookups)
}

#[tokio::test]
async fn calendar_quotas_in_callers_zones_follow_jiffs_local_periods() {
    let cases: u64 = std::env::var("ZONES_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    let first: u64 = std::env::var("ZONES_MODEL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let trace = std::env::var_os("ZONES_MODEL_TRACE").is_some();
    let (mut steps, mut lookups) = (0, 0);
    for seed in first..first + cases {
        let (s, l) = run_case(seed, trace).await;
        steps += s;
        lookups += l;
    }
    eprintln!("{cases} cases, {steps} requests, {lookups} support lookups");
}
