//! A seeded random walk of requests through an axum app whose quotas spread
//! their resets (`Quota::spread_reset`), of every period `Period` has:
//! minutes, hours, days, weeks, months in the quota's own zone (a named
//! zone, an alias or a fixed offset) or each caller's (read from a header),
//! fixed windows of odd lengths, rolling periods of odd lengths and a
//! first-use month. The clock steps onto, 1 ns, 1 ms and 1 s before and
//! after the windows' boundaries near a clock change or a month's end (the
//! 31st, February's 28th or 29th), each subject's turn after a reset
//! (the boundary plus its spread), and each rolling period's end. After
//! each step, a reference model computed with jiff alone says the status,
//! `RateLimit`'s `r` and `t` (the time to the subject's own turn: the real
//! reset plus a spread in `[0, spread]` that is the subject's own for the
//! quota), `RateLimit-Policy`'s `w`, `Retry-After` and the problem's
//! `detail`, and the support router's `used`, `resets_at`, `first_call`
//! and `reset` text (the real reset, without spread). Each quota's windows
//! are checked to cut time into pieces without gaps or overlaps.
//!
//! `SPREAD_MODEL_CASES` sets how many cases run (default 4),
//! `SPREAD_MODEL_SEED` the first seed, `SPREAD_MODEL_TRACE` prints each step.

mod fields;
mod redis_support;
mod seeded;
mod zone_names;

use seeded::Rng;

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use jiff::civil::Date;
use jiff::tz::{Offset, TimeZone};
use jiff::{SignedDuration, Timestamp, ToSpan};
use tower::ServiceExt;
use tower_quota::store::{RedisStore, Store};
use tower_quota::{zone_from_header, Anchor, FromHeader, ManualClock, Period, Quota, QuotaPolicy};

const LIMIT: u64 = 2;

/// Caller zones: clock changes of every kind, aliases, UTC's names.
const CALLER_ZONES: &[&str] = &[
    "Europe/Berlin",
    "Australia/Lord_Howe",
    "Pacific/Chatham",
    "Pacific/Apia",
    "America/St_Johns",
    "America/Santiago",
    "Asia/Kolkata",
    "Asia/Calcutta",
    "Asia/Kathmandu",
    "US/Eastern",
    "Etc/UTC",
    "GMT",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Minute,
    Hour,
    Day,
    Week,
    Month,
    /// A fixed window of so many seconds, cut from the epoch.
    Fixed(i64),
    /// A rolling period of so many seconds.
    Rolling(i64),
    /// A month from the first call.
    RollingMonth,
}

impl Kind {
    fn calendar(self) -> bool {
        !matches!(self, Kind::Rolling(_) | Kind::RollingMonth)
    }

    /// Whether a caller's zone moves its windows.
    fn zoned(self) -> bool {
        matches!(
            self,
            Kind::Minute | Kind::Hour | Kind::Day | Kind::Week | Kind::Month
        )
    }

    fn nominal(self) -> i64 {
        match self {
            Kind::Minute => 60,
            Kind::Hour => 3_600,
            Kind::Day => 86_400,
            Kind::Week => 604_800,
            Kind::Month | Kind::RollingMonth => 2_592_000,
            Kind::Fixed(s) | Kind::Rolling(s) => s,
        }
    }

    fn quota(self) -> Quota {
        match self {
            Kind::Minute => Quota::per_minute(LIMIT),
            Kind::Hour => Quota::hourly(LIMIT),
            Kind::Day => Quota::daily(LIMIT),
            Kind::Week => Quota::weekly(LIMIT),
            Kind::Month => Quota::monthly(LIMIT),
            Kind::Fixed(s) => Quota::fixed_window(LIMIT, Duration::from_secs(s as u64)),
            Kind::Rolling(s) => Quota::rolling(LIMIT, Duration::from_secs(s as u64)),
            Kind::RollingMonth => Quota::monthly(LIMIT).anchored(Anchor::FirstUse),
        }
    }
}

fn length_name(s: i64) -> String {
    if s % 3600 == 0 {
        format!("{}h", s / 3600)
    } else if s % 60 == 0 {
        format!("{}m", s / 60)
    } else {
        format!("{s}s")
    }
}

/// A zone as the model tells it: the zone, the name its texts carry
/// (`None`: UTC, told with a `Z`), whether it is a fixed offset.
#[derive(Clone)]
struct Zone {
    tz: TimeZone,
    label: Option<String>,
    fixed: bool,
}

impl Zone {
    /// A quota's own zone, as configured (an alias keeps its name in texts).
    fn own(name: &str) -> Self {
        if let Some(offset) = name.strip_prefix("fixed") {
            let seconds: i32 = offset.parse().unwrap();
            let offset = Offset::from_seconds(seconds).unwrap();
            return Zone {
                tz: TimeZone::fixed(offset),
                label: (seconds != 0).then(|| offset.to_string()),
                fixed: true,
            };
        }
        let tz = TimeZone::get(name).unwrap();
        let primary = tz.primary_iana_name().unwrap().to_owned();
        Zone {
            label: (!zone_names::UTC_NAMES.contains(&primary.as_str())).then(|| name.to_owned()),
            tz,
            fixed: false,
        }
    }

    /// A caller's zone: under its primary name.
    fn caller(name: &str) -> Self {
        let primary = TimeZone::get(name)
            .unwrap()
            .primary_iana_name()
            .unwrap()
            .to_owned();
        Zone::own(&primary)
    }

    /// The name counters of this zone are told apart by.
    fn key(&self) -> String {
        match &self.label {
            None => "UTC".into(),
            Some(_) if self.fixed => format!("{:?}", self.tz.to_fixed_offset().unwrap()),
            Some(_) => self.tz.primary_iana_name().unwrap().to_owned(),
        }
    }

    fn word(&self) -> String {
        self.label.clone().unwrap_or_else(|| "UTC".into())
    }

    fn format(&self, at: Timestamp) -> String {
        match &self.label {
            None => at.to_string(),
            Some(_) if self.fixed => at
                .display_with_offset(self.tz.to_fixed_offset().unwrap())
                .to_string(),
            Some(name) => at
                .to_zoned_datetime(TimeZone::get(name).unwrap())
                .to_string(),
        }
    }
}

fn begin(date: Date, tz: &TimeZone) -> Timestamp {
    date.to_zoned_datetime(tz.clone())
        .unwrap()
        .start_of_day()
        .unwrap()
        .timestamp()
}

/// Minutes and hours follow the local clock, cut at offset changes.
fn sub_day(at: Timestamp, tz: &TimeZone, step: i64) -> (Timestamp, Timestamp) {
    let offset = i64::from(tz.to_offset(at).seconds());
    let local = at.as_second() + offset;
    let floor = local.div_euclid(step) * step - offset;
    let mut start = Timestamp::from_second(floor).unwrap();
    let mut end = Timestamp::from_second(floor + step).unwrap();
    if let Some(t) = tz
        .preceding(at + SignedDuration::from_nanos(1))
        .next()
        .map(|t| t.timestamp())
    {
        start = start.max(t);
    }
    if let Some(t) = tz.following(at).next().map(|t| t.timestamp()) {
        end = end.min(t);
    }
    (start, end)
}

/// The calendar window of `kind` containing `at` in `tz`, with jiff alone.
fn window(kind: Kind, tz: &TimeZone, at: Timestamp) -> (Timestamp, Timestamp) {
    let date = at.to_zoned_datetime(tz.clone()).date();
    let (first, next): (Date, Date) = match kind {
        Kind::Minute => return sub_day(at, tz, 60),
        Kind::Hour => return sub_day(at, tz, 3_600),
        Kind::Fixed(len) => {
            let floor = at.as_second().div_euclid(len) * len;
            return (
                Timestamp::from_second(floor).unwrap(),
                Timestamp::from_second(floor + len).unwrap(),
            );
        }
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
        Kind::Rolling(_) | Kind::RollingMonth => unreachable!("no calendar window"),
    };
    (begin(first, tz), begin(next, tz))
}

fn ceil_secs(from: Timestamp, to: Timestamp) -> u64 {
    let d = to.duration_since(from);
    if d <= SignedDuration::ZERO {
        return 0;
    }
    d.as_secs() as u64 + u64::from(d.subsec_nanos() != 0)
}

fn ceil_to_second(at: Timestamp) -> Timestamp {
    let whole = Timestamp::from_second(at.as_second()).unwrap();
    if whole < at {
        whole + SignedDuration::from_secs(1)
    } else {
        whole
    }
}

fn fnv(hash: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(hash, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The spread a subject is told for a quota: fixed by the subject and the
/// quota's name, the same on every instance (see `Quota::spread_reset`).
fn spread_of(id: &str, name: &str, spread: u64) -> u64 {
    if spread == 0 {
        return 0;
    }
    let basis = 0xcbf2_9ce4_8422_2325;
    let subject = fnv(fnv(fnv(basis, b"account"), &[0]), id.as_bytes());
    let mixed = subject ^ fnv(basis, name.as_bytes());
    mixed.wrapping_mul(0xbf58_476d_1ce4_e5b9).rotate_left(31) % (spread + 1)
}

struct Spec {
    kind: Kind,
    allowance: String,
    spread: u64,
}

impl Spec {
    fn name(&self) -> String {
        match self.kind {
            Kind::Minute => format!("{}-minute", self.allowance),
            Kind::Hour => format!("{}-hour", self.allowance),
            Kind::Day => format!("{}-day", self.allowance),
            Kind::Week => format!("{}-week", self.allowance),
            Kind::Month => format!("{}-month", self.allowance),
            Kind::Fixed(s) => format!("{}-{}", self.allowance, length_name(s)),
            Kind::Rolling(s) => format!("{}-rolling-{}", self.allowance, length_name(s)),
            Kind::RollingMonth => format!("{}-rolling-month", self.allowance),
        }
    }

    fn rule(&self, zone: &Zone) -> String {
        let word = zone.word();
        match self.kind {
            Kind::Minute => format!("at the start of every minute ({word})"),
            Kind::Hour => format!("at the start of every hour ({word})"),
            Kind::Day => format!("every day at 00:00 {word}"),
            Kind::Week => format!("every Monday at 00:00 {word}"),
            Kind::Month => format!("on the 1st of every month at 00:00 {word}"),
            Kind::Fixed(s) => format!("every {} counted from 1970-01-01T00:00:00Z", length_name(s)),
            Kind::Rolling(s) => format!("{} after the first call", length_name(s)),
            Kind::RollingMonth => {
                format!("one month after the first call (same day and time, {word})")
            }
        }
    }
}

struct Caller {
    id: String,
    /// The zone its header names; `None`: no header.
    zone: Option<&'static str>,
}

/// Where a rolling period stands: its first call, its end, what it spent.
#[derive(Clone, Copy, Debug)]
struct Open {
    first: Timestamp,
    end: Timestamp,
    used: u64,
}

fn at(text: &str) -> Timestamp {
    text.parse().unwrap()
}

/// Instants worth a look around `focus`: the windows of `kind` in `tz`
/// that hold it and its neighbours, their starts and ends.
fn boundaries(kind: Kind, tz: &TimeZone, focus: Timestamp, out: &mut Vec<Timestamp>) {
    if !kind.calendar() {
        return;
    }
    let mut probe = focus;
    for _ in 0..2 {
        let (start, _) = window(kind, tz, probe);
        probe = start - SignedDuration::from_nanos(1);
    }
    for _ in 0..4 {
        let (start, end) = window(kind, tz, probe);
        out.push(start);
        out.push(end);
        probe = end;
    }
}

/// One case on `store`; with `rolling`, first-use quotas too (their
/// deadlines on Redis follow the server's clock, not the manual one).
async fn run_case<St: Store>(seed: u64, trace: bool, store: St, rolling: bool) -> usize {
    let mut rng = Rng(seed);
    let own_name = *rng.pick(&[
        "UTC",
        "Europe/Berlin",
        "Australia/Lord_Howe",
        "America/Santiago",
        "Asia/Calcutta",
        "Pacific/Chatham",
        "fixed20700",
        "fixed-12600",
        "fixed50400",
    ]);
    let own = Zone::own(own_name);

    let mut kinds = vec![Kind::Minute, Kind::Hour, Kind::Day, Kind::Week, Kind::Month];
    for _ in 0..2 {
        kinds.push(Kind::Fixed(*rng.pick(&[
            1, 7, 13, 61, 90, 599, 3_599, 3_601, 5_400, 86_399, 86_401, 604_803,
        ])));
        let length = *rng.pick(&[1, 7, 61, 3_599, 86_399, 86_401, 2_419_201]);
        if rolling {
            kinds.push(Kind::Rolling(length));
        }
    }
    if rolling {
        kinds.push(Kind::RollingMonth);
    }
    let specs: Vec<Spec> = kinds
        .iter()
        .enumerate()
        .map(|(i, &kind)| {
            let most = (kind.nominal() / 2) as u64;
            let spread = match rng.below(4) {
                0 => 0,
                1 => most,
                _ => rng.below(most + 1),
            };
            Spec {
                kind,
                allowance: format!("a{i}"),
                spread,
            }
        })
        .collect();

    // The focus: a clock change of a caller's zone, or a month's end.
    let focus_zone = TimeZone::get(rng.pick::<&str>(CALLER_ZONES)).unwrap();
    let from = at("2012-01-01T00:00:00Z");
    let changes: Vec<Timestamp> = focus_zone
        .following(from)
        .map(|t| t.timestamp())
        .take_while(|t| *t < at("2030-01-01T00:00:00Z"))
        .collect();
    let focus = if changes.is_empty() || rng.below(2) == 0 {
        let date = *rng.pick(&[
            jiff::civil::date(2026, 1, 31),
            jiff::civil::date(2026, 2, 28),
            jiff::civil::date(2028, 2, 29),
            jiff::civil::date(2028, 1, 30),
            jiff::civil::date(2026, 3, 31),
            jiff::civil::date(2026, 4, 30),
            jiff::civil::date(2026, 12, 31),
        ]);
        begin(date, &own.tz) + SignedDuration::from_secs(rng.below(86_400) as i64)
    } else {
        *rng.pick(&changes)
    };

    let callers: Vec<Caller> = (0..4)
        .map(|i| Caller {
            id: format!("c{i}"),
            zone: (rng.below(3) != 0).then(|| *rng.pick(CALLER_ZONES)),
        })
        .collect();
    let zone_of = |caller: &Caller, kind: Kind| -> Zone {
        match caller.zone {
            Some(name) if kind.zoned() => Zone::caller(name),
            _ => own.clone(),
        }
    };

    let mut points = Vec::new();
    for spec in &specs {
        let mut zones = vec![own.tz.clone()];
        zones.extend(callers.iter().map(|c| zone_of(c, spec.kind).tz));
        for tz in zones {
            let mut here = Vec::new();
            boundaries(spec.kind, &tz, focus, &mut here);
            for p in here {
                points.push(p);
                // Each caller's turn after the reset.
                for caller in &callers {
                    let turn = spread_of(&caller.id, &spec.name(), spec.spread);
                    points.push(p + SignedDuration::from_secs(turn as i64));
                }
            }
        }
    }
    points.push(focus);
    let mut instants = BTreeSet::new();
    let offsets = [
        SignedDuration::ZERO,
        SignedDuration::from_nanos(-1),
        SignedDuration::from_nanos(1),
        SignedDuration::from_millis(-1),
        SignedDuration::from_millis(1),
        SignedDuration::from_secs(-1),
        SignedDuration::from_secs(1),
    ];
    let keep = (points.len() * offsets.len()).max(1) as u64;
    for p in points {
        for offset in offsets {
            // About 400 instants in all.
            if rng.below(keep) < 400 {
                instants.insert(p + offset);
            }
        }
    }

    let clock = ManualClock::new(*instants.first().unwrap());
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .store_timeout(Some(Duration::from_secs(5)))
        .clock(clock.clone())
        .time_zone(zone_from_header("x-zone"))
        .build();
    let mut app = Router::new();
    for spec in &specs {
        let quota = spec
            .kind
            .quota()
            .allowance(spec.allowance.clone())
            .in_time_zone(own.tz.clone())
            .spread_reset(Duration::from_secs(spec.spread));
        assert_eq!(quota.name(), spec.name());
        // Each window of the quota in its own zone starts where the one
        // before ended.
        if spec.kind.calendar() {
            let period: &Period = quota.period();
            let w = period.window(focus);
            assert!(w.contains(focus), "seed {seed}: {w:?} holds {focus}");
            let next = period.window(w.end());
            assert_eq!(next.start(), w.end(), "seed {seed}: no gap after {w:?}");
            assert_ne!(next.stamp(), w.stamp(), "seed {seed}");
            let before = period.window(w.start() - SignedDuration::from_nanos(1));
            assert_eq!(before.end(), w.start(), "seed {seed}: no gap before {w:?}");
        }
        app = app.route(
            &format!("/{}", spec.allowance),
            get(|| async { "ok" }).layer(policy.layer(quota)),
        );
    }
    let admin = Router::new().nest("/admin", policy.handle().router());

    // Calendar: (caller, allowance, zone key, window start) -> used.
    let mut used: HashMap<(String, String, String, Timestamp), u64> = HashMap::new();
    // Rolling: (caller, allowance) -> the open period.
    let mut open: HashMap<(String, String), Open> = HashMap::new();
    let mut steps = 0;
    let mut added = 0;
    let mut queue = instants;
    while let Some(now) = queue.pop_first() {
        clock.set(now);
        for _ in 0..=rng.below(2) {
            let caller = rng.pick(&callers);
            let spec = rng.pick(&specs);
            let zone = zone_of(caller, spec.kind);
            let name = spec.name();
            let key = (caller.id.clone(), spec.allowance.clone());
            // Where the model stands: the count after this request, the
            // period's start and end, its first call.
            let (admit, count, start, end, first) = if spec.kind.calendar() {
                let (start, end) = window(spec.kind, &zone.tz, now);
                assert!(start <= now && now < end, "seed {seed}: model window");
                // Minutes and hours of UTC are one counter in every zone.
                let step = match spec.kind {
                    Kind::Minute => 60,
                    Kind::Hour => 3_600,
                    _ => 0,
                };
                let zone_key = if !spec.kind.zoned()
                    || (step > 0
                        && start.as_second() % step == 0
                        && end.as_second() - start.as_second() == step)
                {
                    String::new()
                } else {
                    zone.key()
                };
                let count = used
                    .entry((caller.id.clone(), spec.allowance.clone(), zone_key, start))
                    .or_insert(0);
                let admit = *count < LIMIT;
                if admit {
                    *count += 1;
                }
                (admit, *count, start, end, None)
            } else {
                let period = open.get(&key).copied().filter(|o| now < o.end);
                let mut period = period.unwrap_or_else(|| {
                    let end = match spec.kind {
                        Kind::Rolling(s) => now + SignedDuration::from_secs(s),
                        _ => now
                            .to_zoned_datetime(zone.tz.clone())
                            .checked_add(1.month())
                            .unwrap()
                            .timestamp(),
                    };
                    Open {
                        first: now,
                        end,
                        used: 0,
                    }
                });
                let admit = period.used < LIMIT;
                if admit {
                    period.used += 1;
                    if period.used == 1 && added < 120 {
                        // Its end, and around it, are worth a look (a
                        // few, or each period's end opens more).
                        added += 3;
                        for offset in &offsets[..3] {
                            queue.insert(period.end + *offset);
                        }
                    }
                    open.insert(key.clone(), period);
                }
                (
                    admit,
                    period.used,
                    period.first,
                    period.end,
                    Some(period.first),
                )
            };
            // First-use periods are spread already: no turn of their own.
            let turn = if spec.kind.calendar() {
                spread_of(&caller.id, &name, spec.spread)
            } else {
                0
            };
            assert!(turn <= spec.spread);
            let mut request =
                Request::get(format!("/{}", spec.allowance)).header("x-account-id", &caller.id);
            if let Some(z) = caller.zone {
                request = request.header("x-zone", z);
            }
            let response = app
                .clone()
                .oneshot(request.body(Body::empty()).unwrap())
                .await
                .unwrap();
            steps += 1;
            let what = format!(
                "seed {seed}: {} ({:?}) {name} (spread {}, turn {turn}) at {now} = {}; model {} .. {}, used {count}",
                caller.id,
                caller.zone,
                spec.spread,
                now.to_zoned_datetime(zone.tz.clone()),
                zone.format(start),
                zone.format(end),
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
            let fields = fields::ratelimit(response.headers());
            let (r, t) = fields[&name];
            assert_eq!(r, LIMIT - count, "{what}");
            let told = ceil_secs(now, end + SignedDuration::from_secs(turn as i64));
            assert_eq!(t, told, "{what}: t");
            let policy_field = response.headers()["ratelimit-policy"].to_str().unwrap();
            let w: u64 = policy_field
                .split(";w=")
                .nth(1)
                .unwrap()
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(w, ceil_secs(start, end).max(1), "{what}: {policy_field}");
            if !admit {
                let retry: u64 = response.headers()["retry-after"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert_eq!(retry, told.max(1), "{what}: Retry-After");
                let body = axum::body::to_bytes(response.into_body(), 1 << 16)
                    .await
                    .unwrap();
                let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
                let detail = problem["detail"].as_str().unwrap();
                let mut expected = format!("it resets at {}", zone.format(ceil_to_second(end)));
                if turn > 0 {
                    expected += &format!(
                        "; retry from {}.",
                        zone.format(ceil_to_second(end + SignedDuration::from_secs(turn as i64)))
                    );
                } else {
                    expected += ".";
                }
                assert!(
                    detail.ends_with(&expected),
                    "{what}: {detail:?}, expected {expected:?}"
                );
            }

            // The support router, for the caller in its zone: the real
            // reset, without spread.
            let uri = match caller.zone {
                Some(z) => format!("/admin/quota/account/{}?zone={z}", caller.id),
                None => format!("/admin/quota/account/{}", caller.id),
            };
            let shown = admin
                .clone()
                .oneshot(Request::get(uri).body(Body::empty()).unwrap())
                .await
                .unwrap();
            assert_eq!(shown.status(), StatusCode::OK, "{what}");
            let body = axum::body::to_bytes(shown.into_body(), 1 << 20)
                .await
                .unwrap();
            let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let entry = json["allowances"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["allowance"] == spec.allowance.as_str())
                .unwrap_or_else(|| panic!("{what}: {json}"));
            assert_eq!(entry["name"], name.as_str(), "{what}: {entry}");
            assert_eq!(entry["used"], count, "{what}: {entry}");
            let resets_at: Timestamp = entry["resets_at"].as_str().unwrap().parse().unwrap();
            assert_eq!(resets_at, end, "{what}: {entry}");
            let rule = spec.rule(&zone);
            let reset = match first {
                Some(first) => {
                    assert_eq!(entry["first_call"], first.to_string(), "{what}: {entry}");
                    format!("{rule} ({}), at {}", zone.format(first), zone.format(end))
                }
                None => format!("{rule}; next at {}", zone.format(end)),
            };
            assert_eq!(entry["reset"], reset.as_str(), "{what}: {entry}");
        }
    }
    steps
}

fn settings(default_cases: u64) -> (u64, u64, bool) {
    let cases: u64 = std::env::var("SPREAD_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_cases);
    let first: u64 = std::env::var("SPREAD_MODEL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    (
        cases,
        first,
        std::env::var_os("SPREAD_MODEL_TRACE").is_some(),
    )
}

#[tokio::test]
async fn spread_resets_tell_each_subject_its_own_turn_in_every_period() {
    let (cases, first, trace) = settings(4);
    let mut steps = 0;
    for seed in first..first + cases {
        steps += run_case(seed, trace, tower_quota::store::MemoryStore::new(), true).await;
    }
    eprintln!("{cases} cases, {steps} requests");
}

/// The calendar quotas on Redis, each case on a server of its own.
#[tokio::test]
async fn spread_resets_on_redis_tell_each_subject_its_own_turn() {
    if !redis_support::redis_available() {
        return;
    }
    let (cases, first, trace) = settings(1);
    let mut steps = 0;
    for seed in first..first + cases {
        let server = redis_support::RedisServer::start();
        // Budgets as long as the policy's `store_timeout`: the model is of
        // fields and resets, not of a redis-server the machine is too busy
        // to run for 80 ms while this one call waits for it.
        let store = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(2))
            .wait_timeout(Duration::from_secs(2))
            .connect_timeout(Duration::from_secs(2))
            .build()
            .expect("a Redis store");
        steps += run_case(seed, trace, store, false).await;
    }
    eprintln!("{cases} cases on Redis, {steps} requests");
}

/// Every period's windows, in zones of the whole time zone database
/// around their clock changes (1900 to 2040), follow each other without a
/// gap or an overlap, each holds the instants it is asked for, and no two
/// different windows of a zone share a stamp. `SPREAD_MODEL_ZONES` sets
/// how many zones are walked (default 24, drawn from the seed).
#[test]
fn windows_of_every_period_cut_time_without_gaps_in_every_zone() {
    let (_, first, _) = settings(1);
    let mut rng = Rng(first);
    // Zones a quota can be in (not `localtime`, `posixrules`, `right/…`).
    let mut names: Vec<String> = jiff::tz::db()
        .available()
        .map(|n| n.to_string())
        .filter(|n| tower_quota::period::is_nameable(&TimeZone::get(n).unwrap()))
        .collect();
    names.sort();
    let zones: usize = std::env::var("SPREAD_MODEL_ZONES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24);
    let picked: Vec<&String> = if zones >= names.len() {
        names.iter().collect()
    } else {
        (0..zones).map(|_| rng.pick(&names)).collect()
    };
    let mut windows = 0;
    for name in picked {
        let tz = TimeZone::get(name).unwrap();
        let changes: Vec<Timestamp> = tz
            .following(at("1900-01-01T00:00:00Z"))
            .map(|t| t.timestamp())
            .take_while(|t| *t < at("2040-01-01T00:00:00Z"))
            .collect();
        let mut foci: Vec<Timestamp> = (0..4)
            .filter(|_| !changes.is_empty())
            .map(|_| *rng.pick(&changes))
            .collect();
        foci.push(at("2026-02-28T12:00:00Z"));
        let periods = [
            (Period::minute(), 90),
            (Period::hour(), 60),
            (Period::day(), 10),
            (Period::week(), 4),
            (Period::month(), 3),
            (Period::fixed(Duration::from_secs(5_401)), 40),
        ];
        for (period, count) in periods {
            let period = period.in_time_zone(tz.clone());
            let mut stamps: HashMap<String, (Timestamp, Timestamp)> = HashMap::new();
            for &focus in &foci {
                let mut w = period.window(focus);
                assert!(w.contains(focus), "{name} {period:?}: {w:?} holds {focus}");
                // Back half the walk, then forward across the focus.
                for _ in 0..count / 2 {
                    w = period.window(w.start() - SignedDuration::from_nanos(1));
                }
                for _ in 0..count {
                    windows += 1;
                    let what = format!("{name} {}: {w:?}", period.name());
                    assert!(w.start() < w.end(), "{what}");
                    for probe in [w.start(), w.end() - SignedDuration::from_nanos(1)] {
                        assert_eq!(period.window(probe), w, "{what} at {probe}");
                    }
                    let before = period.window(w.start() - SignedDuration::from_nanos(1));
                    assert_eq!(before.end(), w.start(), "{what}: gap or overlap before");
                    let next = period.window(w.end());
                    assert_eq!(next.start(), w.end(), "{what}: gap or overlap after");
                    if let Some(kept) = stamps.insert(w.stamp().to_owned(), (w.start(), w.end())) {
                        assert_eq!(kept, (w.start(), w.end()), "{what}: one stamp, two windows");
                    }
                    w = next;
                }
            }
        }
    }
    eprintln!("{windows} windows");
}
