//! Random configurations from extreme values: each is refused with a clear
//! panic when it is made, or works; no request of an accepted one panics,
//! every answer is a normal one, nothing is admitted past a limit, and the
//! fields are well-formed Structured Fields.
//!
//! `CONFIG_FUZZ_CASES` sets how many cases run (default 400),
//! `CONFIG_FUZZ_TRACE` prints each configuration and answer.

mod seeded;

use seeded::Rng;

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tower::ServiceExt;
use tower_quota::jiff::tz::{Offset, TimeZone};
use tower_quota::jiff::{SignedDuration, Timestamp};
use tower_quota::{
    zone_from_header, Clock, FromHeader, InvalidRequest, LeasedStore, MemoryStore, OnStoreError,
    Quota, QuotaHandle, QuotaLayer, QuotaPolicy, Store, UnknownPlan,
};

/// A clock that goes anywhere jiff holds, set by the test.
#[derive(Clone)]
struct Anywhere(Arc<Mutex<Timestamp>>);

impl Clock for Anywhere {
    fn now(&self) -> Timestamp {
        *self.0.lock().unwrap()
    }
}

const LIMITS: &[u64] = &[
    0,
    1,
    2,
    3,
    10,
    (1 << 53) - 1,
    1 << 53,
    (1 << 53) + 1,
    999_999_999_999_999,
    1_000_000_000_000_000,
    u64::MAX - 1,
    u64::MAX,
];

const COSTS: &[u64] = &[
    0,
    1,
    1,
    1,
    2,
    3,
    (1 << 53) - 1,
    (1 << 53) + 1,
    u64::MAX / 2 + 1,
    u64::MAX - 1,
    u64::MAX,
];

const Y100: u64 = 100 * 31_557_600;

fn durations() -> Vec<Duration> {
    vec![
        Duration::ZERO,
        Duration::from_nanos(1),
        Duration::from_secs(1),
        Duration::new(1, 1),
        Duration::from_secs(10),
        Duration::from_secs(59),
        Duration::from_secs(86_400),
        Duration::from_secs(31 * 86_400),
        Duration::from_secs(365 * 86_400),
        Duration::from_secs(Y100),
        Duration::from_secs(Y100 + 1),
        Duration::from_secs(u64::MAX),
        Duration::MAX,
    ]
}

fn spreads() -> Vec<Duration> {
    vec![
        Duration::ZERO,
        Duration::ZERO,
        Duration::from_nanos(1),
        Duration::from_secs(1),
        Duration::from_secs(30),
        Duration::from_secs(31),
        Duration::from_secs(1_800),
        Duration::from_secs(43_200),
        Duration::from_secs(43_201),
        Duration::from_secs(1_296_000),
        Duration::from_secs(Y100 / 2),
        Duration::from_secs(Y100),
        Duration::MAX,
    ]
}

fn zones() -> Vec<TimeZone> {
    let mut zones = vec![TimeZone::UTC];
    for name in [
        "Europe/Berlin",
        "Pacific/Chatham",
        "Australia/Lord_Howe",
        "America/St_Johns",
        "Asia/Kolkata",
        "Asia/Kathmandu",
        "America/Sao_Paulo",
        "Pacific/Apia",
        "Antarctica/Troll",
        "America/Havana",
        "Etc/GMT+12",
        "US/Eastern",
    ] {
        if let Ok(zone) = TimeZone::get(name) {
            zones.push(zone);
        }
    }
    zones.push(TimeZone::fixed(Offset::from_seconds(14 * 3600).unwrap()));
    zones.push(TimeZone::fixed(
        Offset::from_seconds(-(12 * 3600 + 59)).unwrap(),
    ));
    zones.push(TimeZone::posix("EST5EDT,M3.2.0,M11.1.0").unwrap());
    zones
}

fn instants() -> Vec<Timestamp> {
    let at = |s: &str| s.parse::<Timestamp>().unwrap();
    vec![
        at("2026-03-29T00:59:59Z"),
        at("2026-10-25T00:59:59Z"),
        at("2026-12-31T23:59:59.999999999Z"),
        at("2011-12-29T10:59:59Z"),
        at("2018-11-04T02:59:59Z"),
        at("2026-04-05T14:44:59Z"),
        at("2026-09-27T13:44:59Z"),
        at("2262-04-11T23:47:16Z"),
        at("1677-09-21T00:12:44Z"),
        at("9999-12-30T21:59:00Z"),
        at("9999-12-30T00:00:00Z"),
        at("9999-12-15T00:00:00Z"),
        at("9950-01-01T00:00:00Z"),
        Timestamp::MAX,
        Timestamp::MAX - SignedDuration::from_secs(1),
        Timestamp::MIN,
        Timestamp::MIN + SignedDuration::from_secs(3_600),
        at("-009999-01-02T02:00:00Z"),
        at("1970-01-01T00:00:00Z"),
    ]
}

const STEPS: &[i64] = &[
    0,
    0,
    1,
    1,
    59,
    60,
    3_599,
    3_600,
    86_400,
    -1,
    -3_600,
    -86_400,
    31 * 86_400,
    Y100 as i64,
    -(Y100 as i64),
];

const NAMES: &[&str] = &[
    "", " ", "a\"b\\c", "x, y;z=1", "é", "\t", "dup", "dup", "read-day", "ok", "~",
];

const TAGS: &[&str] = &[
    "default", "default", "read", "read", "write", "", " ", "a\"b", "é", "x,y", "\\",
];

const PLANS: &[&str] = &["pro", "pro", "free", "", " ", "a\"b", "é"];

/// What each case is told, to replay it.
fn trace() -> bool {
    std::env::var("CONFIG_FUZZ_TRACE").is_ok()
}

/// Set while a configuration is made: a panic then is a refusal.
static BUILDING: AtomicBool = AtomicBool::new(false);
/// Panics outside of building (a request, a task of the crate).
static REQUEST_PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// Messages of refusals, to read.
static REFUSALS: Mutex<BTreeMap<String, usize>> = Mutex::new(BTreeMap::new());
static ACCEPTED: AtomicUsize = AtomicUsize::new(0);
static REQUESTS: AtomicUsize = AtomicUsize::new(0);
static ADMITTED: AtomicUsize = AtomicUsize::new(0);

fn install_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            let message = info
                .payload()
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| {
                    info.payload()
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                })
                .unwrap_or_default();
            let location = info
                .location()
                .map(|l| format!("{}:{}", l.file(), l.line()))
                .unwrap_or_default();
            if BUILDING.load(Ordering::SeqCst) {
                // Keep the message with the numbers blanked, to group them.
                let key: String = message
                    .chars()
                    .map(|c| if c.is_ascii_digit() { '#' } else { c })
                    .take(160)
                    .collect();
                *REFUSALS
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(format!("{key} @ {location}"))
                    .or_default() += 1;
            } else if !message.starts_with("test-case:") {
                REQUEST_PANICS
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(format!("{message} @ {location}"));
            }
        }));
    });
}

/// A refusal's message is clear: it says what setting is wrong, not a
/// bare unwrap or arithmetic failure.
fn clear(message: &str) -> bool {
    const UNCLEAR: &[&str] = &[
        "called `Option::unwrap()`",
        "called `Result::unwrap()`",
        "attempt to",
        "index out of bounds",
        "overflow",
        "divide by zero",
        "RefCell",
    ];
    message.len() > 20 && !UNCLEAR.iter().any(|u| message.contains(u))
}

fn panic_message(payload: &Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}

#[derive(Clone, Debug)]
enum CostKind {
    Fixed(u64),
    /// From the `x-cost` header.
    Header,
    /// Up front, the rest from the response's `x-real`.
    Deferred(u64),
}

#[derive(Debug)]
struct LayerSpec {
    /// Indices into the case's quotas.
    quotas: Vec<usize>,
    cost: CostKind,
}

/// Mostly one of `usual`, now and then one of `extreme`.
fn mostly<T: Clone>(rng: &mut Rng, usual: &[T], extreme: &[T]) -> T {
    if rng.below(6) == 0 {
        rng.pick(extreme).clone()
    } else {
        rng.pick(usual).clone()
    }
}

const USUAL_SECONDS: &[u64] = &[1, 10, 59, 3_600, 86_400, 31 * 86_400, 365 * 86_400, Y100];

fn quota(rng: &mut Rng, log: &mut String, reads_plan: bool) -> Quota {
    let durations = durations();
    let zones = zones();
    let limit = *rng.pick(LIMITS);
    let mut q = match rng.below(9) {
        0 => Quota::per_minute(limit),
        1 => Quota::hourly(limit),
        2 => Quota::daily(limit),
        3 => Quota::weekly(limit),
        4 => Quota::monthly(limit),
        5 | 6 => {
            let d = mostly(
                rng,
                &USUAL_SECONDS
                    .iter()
                    .map(|&s| Duration::from_secs(s))
                    .collect::<Vec<_>>(),
                &durations,
            );
            log.push_str(&format!(" rolling({limit}, {d:?})"));
            Quota::rolling(limit, d)
        }
        _ => {
            let d = mostly(
                rng,
                &USUAL_SECONDS
                    .iter()
                    .map(|&s| Duration::from_secs(s))
                    .collect::<Vec<_>>(),
                &durations,
            );
            log.push_str(&format!(" fixed_window({limit}, {d:?})"));
            Quota::fixed_window(limit, d)
        }
    };
    log.push_str(&format!(" {}", q.name()));
    if rng.below(3) == 0 {
        let tag = mostly(rng, &TAGS[..5], TAGS);
        log.push_str(&format!(" .allowance({tag:?})"));
        q = q.allowance(tag);
    }
    if rng.below(3) == 0 {
        let zone = mostly(rng, &zones[..zones.len() - 1], &zones);
        log.push_str(&format!(" .in_time_zone({zone:?})"));
        q = q.in_time_zone(zone);
    }
    if rng.below(4) == 0 {
        log.push_str(" .anchored(FirstUse)");
        q = q.anchored(tower_quota::Anchor::FirstUse);
    }
    if rng.below(3) == 0 {
        let name = mostly(rng, &NAMES[1..], NAMES);
        log.push_str(&format!(" .named({name:?})"));
        q = q.named(name);
    }
    for _ in 0..if reads_plan || rng.below(10) == 0 {
        rng.below(3)
    } else {
        0
    } {
        let plan = mostly(rng, &PLANS[..3], PLANS);
        let limit = *rng.pick(LIMITS);
        log.push_str(&format!(" .plan({plan:?}, {limit})"));
        q = q.plan(plan, limit);
    }
    if rng.below(4) == 0 {
        log.push_str(" .shadow()");
        q = q.shadow();
    }
    if rng.below(3) == 0 {
        let spread = mostly(rng, &spreads()[..6], &spreads());
        log.push_str(&format!(" .spread_reset({spread:?})"));
        q = q.spread_reset(spread);
    }
    log.push('\n');
    q
}

/// Everything about a case but its store.
struct Case {
    seed: u64,
    quotas: Vec<Quota>,
    layers: Vec<LayerSpec>,
    start: Timestamp,
    reads_plan: bool,
    plan: Option<&'static str>,
    reads_zone: bool,
    zone_header: Option<String>,
    fail_closed: bool,
    refund_server_errors: bool,
    log: String,
}

fn make_case(rng: &mut Rng, seed: u64) -> Case {
    let mut log = String::new();
    let reads_plan = rng.below(2) == 0;
    let quotas: Vec<Quota> = (0..1 + rng.below(5))
        .map(|_| quota(rng, &mut log, reads_plan))
        .collect();
    let layers = (0..1 + rng.below(3))
        .map(|_| {
            let mut picked: Vec<usize> = (0..1 + rng.below(3))
                .map(|_| rng.below(quotas.len() as u64) as usize)
                .collect();
            picked.dedup();
            let cost = match rng.below(5) {
                0 | 1 => CostKind::Fixed(*rng.pick(COSTS)),
                2 => CostKind::Header,
                3 => CostKind::Deferred(*rng.pick(COSTS)),
                _ => CostKind::Fixed(1),
            };
            LayerSpec {
                quotas: picked,
                cost,
            }
        })
        .collect();
    let zone_names = [
        "Europe/Berlin",
        "Pacific/Chatham",
        "Australia/Lord_Howe",
        "Asia/Kolkata",
        "America/St_Johns",
        "Pacific/Apia",
        "UTC",
    ];
    Case {
        seed,
        quotas,
        layers,
        start: *rng.pick(&instants()),
        reads_plan,
        plan: [None, Some("pro"), Some("free"), Some("other"), Some("")][rng.below(5) as usize],
        reads_zone: rng.below(3) == 0,
        zone_header: (rng.below(2) == 0).then(|| rng.pick(&zone_names).to_string()),
        fail_closed: rng.below(3) != 0,
        refund_server_errors: rng.below(2) == 0,
        log,
    }
}

/// A field's members: each name, with its integer parameters.
type Members = Vec<(String, BTreeMap<String, i64>)>;

fn parse_list(headers: &HeaderMap, name: &str) -> Result<Members, String> {
    let values: Vec<&str> = headers
        .get_all(name)
        .iter()
        .map(|v| v.to_str().map_err(|e| format!("{name}: {e}")))
        .collect::<Result<_, _>>()?;
    if values.is_empty() {
        return Ok(Vec::new());
    }
    let joined = values.join(", ");
    let list: sfv::List = sfv::Parser::new(&joined)
        .parse()
        .map_err(|e| format!("{name}: {joined:?} is not a valid Structured Field list: {e}"))?;
    list.into_iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => {
                let name = item
                    .bare_item
                    .as_string()
                    .ok_or_else(|| format!("{name}: {joined:?}: an item is no String"))?
                    .as_str()
                    .to_owned();
                let params = item
                    .params
                    .iter()
                    .map(|(k, v)| {
                        v.as_integer()
                            .map(|i| (k.as_str().to_owned(), i64::from(i)))
                            .ok_or_else(|| format!("{joined:?}: parameter {k:?} no integer"))
                    })
                    .collect::<Result<_, _>>()?;
                Ok((name, params))
            }
            sfv::ListEntry::InnerList(_) => Err(format!("{name} holds an inner list")),
        })
        .collect()
}

/// An app, its policy's handle, and the policy.
type Built<St> = (Router, QuotaHandle<St>, QuotaPolicy<FromHeader, St>);

/// The app of `case` on `store`, or the refusal's message.
fn build<St: Store>(
    case: &Case,
    store: St,
    clock: &Anywhere,
    timeout: Option<Duration>,
    on_error: OnStoreError,
    max_owed: usize,
) -> Result<Built<St>, String> {
    BUILDING.store(true, Ordering::SeqCst);
    let built = catch_unwind(AssertUnwindSafe(|| {
        let mut builder = QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store)
            .clock(clock.clone())
            .store_timeout(timeout)
            .on_store_error(on_error)
            .max_owed_counters(max_owed)
            .refund_server_errors(case.refund_server_errors);
        if case.reads_plan {
            builder = builder
                .plan(|parts| {
                    parts
                        .headers
                        .get("x-plan")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                })
                .on_unknown_plan(UnknownPlan::Reject);
        }
        if case.reads_zone {
            builder = builder.time_zone(zone_from_header("x-zone"));
        }
        let policy = builder.build();
        let mut app = Router::new().route(
            "/",
            get(|headers: HeaderMap| async move {
                let mut response = http::Response::builder();
                if headers.contains_key("x-fail") {
                    response = response.status(StatusCode::INTERNAL_SERVER_ERROR);
                }
                if let Some(real) = headers.get("x-real-in") {
                    response = response.header("x-real", real.clone());
                }
                response.body(Body::from("ok")).unwrap()
            }),
        );
        for spec in &case.layers {
            let mut quotas = spec.quotas.iter().map(|&i| case.quotas[i].clone());
            let mut layer: QuotaLayer<FromHeader, St> = policy.layer(quotas.next().unwrap());
            for q in quotas {
                layer = layer.quota(q);
            }
            layer = match spec.cost {
                CostKind::Fixed(c) => layer.cost(c),
                CostKind::Header => layer.cost_fn(|parts| {
                    parts
                        .headers
                        .get("x-cost")
                        .and_then(|v| v.to_str().ok()?.parse().ok())
                        .ok_or_else(|| InvalidRequest::new("no cost"))
                }),
                CostKind::Deferred(upfront) => layer.deferred_cost(upfront, |response| {
                    response
                        .headers
                        .get("x-real")
                        .and_then(|v| v.to_str().ok()?.parse().ok())
                        .unwrap_or(1)
                }),
            };
            app = app.layer(layer);
        }
        let handle = policy.handle();
        (app, handle, policy)
    }));
    BUILDING.store(false, Ordering::SeqCst);
    built.map_err(|payload| panic_message(&payload))
}

/// Drives requests through `app`; an error names what went wrong.
async fn drive<St: Store>(
    case: &Case,
    rng: &mut Rng,
    app: Router,
    handle: &QuotaHandle<St>,
    clock: &Anywhere,
    check_counts: bool,
) -> Result<(), String> {
    let deferred = case
        .layers
        .iter()
        .any(|l| matches!(l.cost, CostKind::Deferred(_)));
    for step in 0..24 {
        let secs = *rng.pick(STEPS);
        {
            let mut now = clock.0.lock().unwrap();
            if rng.below(12) == 0 {
                *now = *rng.pick(&instants());
            } else if let Ok(next) = now.checked_add(SignedDuration::from_secs(secs)) {
                *now = next;
            }
        }
        let subject = *rng.pick(&["acme", "acme", "globex", "initech"]);
        let mut request = Request::get("/").header("x-account-id", subject);
        let cost = *rng.pick(COSTS);
        if rng.below(8) != 0 {
            request = request.header("x-cost", cost.to_string());
        }
        if let Some(plan) = case.plan {
            request = request.header("x-plan", plan);
        }
        if let Some(zone) = &case.zone_header {
            let zone = match rng.below(8) {
                0 => "Nowhere/Atlantis",
                1 => "localtime",
                2 => "Pacific/Chatham",
                3 => "America/St_Johns",
                _ => zone.as_str(),
            };
            request = request.header("x-zone", zone);
        }
        if rng.below(6) == 0 {
            request = request.header("x-fail", "1");
        }
        let real = *rng.pick(COSTS);
        request = request.header("x-real-in", real.to_string());
        let request = request.body(Body::empty()).unwrap();
        let mut copy = Request::get("/").body(()).unwrap();
        *copy.headers_mut() = request.headers().clone();
        let (parts, ()) = copy.into_parts();
        let app2 = app.clone();
        REQUESTS.fetch_add(1, Ordering::Relaxed);
        let joined = tokio::spawn(async move {
            let response = app2.oneshot(request).await.unwrap();
            let (head, body) = response.into_parts();
            let body = body.collect().await.map(|b| b.to_bytes());
            (head, body)
        })
        .await;
        let now = clock.now();
        let (head, body) = match joined {
            Ok(answer) => answer,
            Err(error) if error.is_panic() => {
                return Err(format!(
                    "step {step} at {now}: the request panicked: {}",
                    panic_message(&error.into_panic())
                ))
            }
            Err(error) => return Err(format!("step {step}: {error}")),
        };
        let body = body.map_err(|e| format!("step {step}: body failed: {e}"))?;
        let status = head.status;
        if trace() {
            eprintln!(
                "  step {step} at {now} cost {cost} real {real}: {status} {:?} {:?} {}",
                head.headers.get("ratelimit-policy"),
                head.headers.get("ratelimit"),
                String::from_utf8_lossy(&body)
            );
        }
        let failing = status == StatusCode::INTERNAL_SERVER_ERROR;
        if status == StatusCode::SERVICE_UNAVAILABLE {
            let healthy = check_counts
                && now >= "1900-01-01T00:00:00Z".parse().unwrap()
                && now < "2150-01-01T00:00:00Z".parse().unwrap();
            if !case.fail_closed || healthy {
                return Err(format!(
                    "step {step} at {now}: 503 on a healthy store or under fail open: {}",
                    String::from_utf8_lossy(&body)
                ));
            }
        }
        if !(status.is_success() || failing) {
            if status.is_client_error() {
                let ct = head
                    .headers
                    .get("content-type")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                if ct != "application/problem+json" {
                    return Err(format!("step {step}: {status} with content-type {ct:?}"));
                }
                serde_json::from_slice::<serde_json::Value>(&body)
                    .map_err(|e| format!("step {step}: {status} body no JSON: {e}"))?;
            } else if status != StatusCode::SERVICE_UNAVAILABLE {
                return Err(format!("step {step} at {now}: an answer of {status}"));
            }
        }
        let policies = parse_list(&head.headers, "ratelimit-policy")
            .map_err(|e| format!("step {step}: {e}"))?;
        let limits =
            parse_list(&head.headers, "ratelimit").map_err(|e| format!("step {step}: {e}"))?;
        for (name, params) in &policies {
            let (q, w) = (params.get("q"), params.get("w"));
            if q.is_none_or(|q| *q < 0) || w.is_some_and(|w| *w < 1) {
                return Err(format!("step {step}: RateLimit-Policy {name}: {params:?}"));
            }
        }
        for (name, params) in &limits {
            let (r, t) = (params.get("r"), params.get("t"));
            if r.is_none_or(|r| *r < 0) || t.is_none_or(|t| *t < 0) {
                return Err(format!("step {step}: RateLimit {name}: {params:?}"));
            }
        }
        if let Some(after) = head.headers.get("retry-after") {
            after
                .to_str()
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| format!("step {step}: Retry-After {after:?}"))?;
        }
        if status.is_success() || failing {
            ADMITTED.fetch_add(1, Ordering::Relaxed);
        }
        // Nothing admitted past a limit: every enforced quota's count is
        // within its limit after an admitted request.
        if check_counts && !deferred && status.is_success() {
            if let Ok(usage) = handle.standing(&parts).await {
                for u in usage {
                    if !u.quota().is_shadow() && u.used() > u.limit() {
                        return Err(format!(
                            "step {step} at {now}: {} counts {} of {} after an admission",
                            u.name(),
                            u.used(),
                            u.limit()
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

fn run_case(seed: u64) -> Result<(), TestCaseError> {
    let mut rng = Rng(seed);
    BUILDING.store(true, Ordering::SeqCst);
    let case = catch_unwind(AssertUnwindSafe(|| make_case(&mut rng, seed)));
    BUILDING.store(false, Ordering::SeqCst);
    let Ok(case) = case.map_err(|payload| {
        let message = panic_message(&payload);
        assert!(clear(&message), "seed {seed}: unclear refusal {message:?}");
    }) else {
        return Ok(());
    };
    let leased = rng.below(2) == 0;
    let timeout = mostly(
        &mut rng,
        &[
            None,
            Some(Duration::from_millis(26)),
            Some(Duration::from_millis(100)),
            Some(Duration::from_secs(u64::MAX)),
            Some(Duration::MAX),
        ],
        &[
            Some(Duration::from_nanos(1)),
            Some(Duration::from_millis(25)),
        ],
    );
    let on_error = if case.fail_closed {
        OnStoreError::FailClosed {
            retry_after: *rng.pick(&[Duration::ZERO, Duration::from_secs(1), Duration::MAX]),
        }
    } else {
        OnStoreError::FailOpen
    };
    let max_owed = *rng.pick(&[0, 1, 10_000]);
    let max_counters = *rng.pick(&[1, 2, 1_000_000]);
    let block = *rng.pick(&[0, 1, 1_000, u64::MAX / 2, u64::MAX]);
    let lease_time = mostly(
        &mut rng,
        &[
            Duration::from_nanos(1),
            Duration::from_secs(1),
            Duration::from_secs(10),
            Duration::from_secs(Y100),
        ],
        &durations(),
    );
    let idle = mostly(
        &mut rng,
        &[
            Duration::from_nanos(1),
            Duration::from_secs(1),
            Duration::MAX,
        ],
        &[Duration::ZERO],
    );
    let lease_counters = *rng.pick(&[0, 1, 100_000]);
    let clock = Anywhere(Arc::new(Mutex::new(case.start)));
    let mut log = format!(
        "seed {} at {} leased {leased} (block {block}, lease {lease_time:?}, idle {idle:?}, counters {lease_counters}) \
         memory counters {max_counters} timeout {timeout:?} {on_error:?} owed {max_owed} plan {:?}/{} zone {:?}/{} refund5xx {}\n{}",
        case.seed, case.start, case.plan, case.reads_plan, case.zone_header, case.reads_zone, case.refund_server_errors, case.log
    );
    for l in &case.layers {
        log.push_str(&format!("  layer {l:?}\n"));
    }
    if trace() {
        eprintln!("{log}");
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    // Counts are checked where every admission is within a limit: fail
    // closed on a store that holds every counter.
    let check = case.fail_closed && max_counters > 2;
    let result = runtime.block_on(async {
        let memory = {
            BUILDING.store(true, Ordering::SeqCst);
            let m = catch_unwind(|| MemoryStore::new().max_counters(max_counters));
            BUILDING.store(false, Ordering::SeqCst);
            m.map_err(|p| panic_message(&p))
        };
        let memory = match memory {
            Ok(m) => m,
            Err(message) => return Err(("refused".to_owned(), message)),
        };
        if leased {
            BUILDING.store(true, Ordering::SeqCst);
            let store = catch_unwind(AssertUnwindSafe(|| {
                LeasedStore::builder(memory.clone())
                    .max_block(block)
                    .lease_time(lease_time)
                    .idle(idle)
                    .max_counters(lease_counters)
                    .build()
            }));
            BUILDING.store(false, Ordering::SeqCst);
            let store = store.map_err(|p| ("refused".to_owned(), panic_message(&p)))?;
            let (app, handle, policy) =
                build(&case, store.clone(), &clock, timeout, on_error, max_owed)
                    .map_err(|m| ("refused".to_owned(), m))?;
            ACCEPTED.fetch_add(1, Ordering::Relaxed);
            let r = drive(&case, &mut rng, app, &handle, &clock, check).await;
            store.shutdown().await;
            drop(policy);
            r.map_err(|e| ("failed".to_owned(), e))
        } else {
            let (app, handle, policy) = build(&case, memory, &clock, timeout, on_error, max_owed)
                .map_err(|m| ("refused".to_owned(), m))?;
            ACCEPTED.fetch_add(1, Ordering::Relaxed);
            let r = drive(&case, &mut rng, app, &handle, &clock, check).await;
            drop(policy);
            r.map_err(|e| ("failed".to_owned(), e))
        }
    });
    drop(runtime);
    let panics = std::mem::take(&mut *REQUEST_PANICS.lock().unwrap_or_else(|e| e.into_inner()));
    if !panics.is_empty() {
        return Err(TestCaseError::fail(format!("{log}panics: {panics:#?}")));
    }
    match result {
        Ok(()) => Ok(()),
        Err((kind, message)) if kind == "refused" => {
            if clear(&message) {
                Ok(())
            } else {
                Err(TestCaseError::fail(format!(
                    "{log}unclear refusal: {message:?}"
                )))
            }
        }
        Err((_, message)) => Err(TestCaseError::fail(format!("{log}{message}"))),
    }
}

#[test]
fn every_accepted_configuration_answers_every_request() {
    install_hook();
    let cases = std::env::var("CONFIG_FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(400);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&proptest::prelude::any::<u64>(), run_case);
    let refusals = REFUSALS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    eprintln!(
        "accepted {} configurations, {} requests, {} admitted; refusals:",
        ACCEPTED.load(Ordering::Relaxed),
        REQUESTS.load(Ordering::Relaxed),
        ADMITTED.load(Ordering::Relaxed),
    );
    for (message, n) in &refusals {
        eprintln!("  {n:>4}  {message}");
    }
    if let Err(error) = result {
        panic!("{error}");
    }
}
