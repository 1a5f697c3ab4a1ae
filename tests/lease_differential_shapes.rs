//! Leased counting against plain counting, through the layer, on apps of
//! random shapes (the shapes `lease_differential.rs` never builds): an
//! outer layer and a nested one of the same policy, each of one to three
//! quotas of different periods (fixed windows of 10 and 30 s, minute,
//! hour, day, week, month), calendar or first-use, shadow or enforced, on
//! two allowances, with plan limits and spread resets; the nested layer
//! may repeat a quota of the outer one (charged once, by the outer layer).
//! Each layer's cost is fixed (up to 12: larger than the blocks of a store
//! whose `max_block` is 3 or 5), read from the request, or deferred (its
//! real cost, below or above the up-front one, read from the response).
//! Callers may name their own time zone (`zone_from_header`), and change
//! plan from one request to the next. Scripts step the clock to the exact
//! end of a period (a calendar one, or a first-use deadline told by the
//! store), a millisecond before or after, past the idle bound and the
//! lease time, and mix support refunds (`refund`, `refund_allowance`,
//! `refund_at` the instant a handler was told its request was charged) and
//! resets, in a caller's zone, between requests, and handlers that undo
//! their request (`refund_request`).
//!
//! Two apps built the same but for the store (a `MemoryStore`, and a
//! `LeasedStore` over one): every answer, field and body and every support
//! answer and standing must be the same. Support refunds stay within what
//! the subject was charged (the leased store's documented bound).
//!
//! `LEASE_SHAPES_CASES` sets the number of cases (32 by default, about
//! three seconds in a debug build; 5 000 pass).

#[allow(dead_code)] // The other differential tests' routes.
mod differential;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::routing::{get, MethodRouter};
use axum::Router;
use http::{HeaderMap, Request, StatusCode};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tower::ServiceExt;
use tower_quota::jiff::tz::TimeZone;
use tower_quota::jiff::{SignedDuration, Timestamp};
use tower_quota::store::LeasedStore;
use tower_quota::{
    zone_from_header, Anchor, FromHeader, InvalidRequest, ManualClock, MemoryStore, Period, Quota,
    QuotaHandle, QuotaLayer, QuotaPolicy, QuotaStatus, QuotaUsage, Store, Subject, UnknownPlan,
};

const SUBJECTS: [&str; 2] = ["acme", "globex"];
const ALLOWANCES: [&str; 2] = ["a", "b"];
const PLANS: [Option<&str>; 4] = [None, Some("free"), Some("pro"), Some("gold")];
const ZONES: [Option<&str>; 3] = [None, Some("Asia/Kolkata"), Some("Pacific/Chatham")];
/// Fixed windows of 10 and 30 s, minute, hour, day, week, month.
const PERIODS: usize = 7;
const PATHS: [&str; 6] = ["/o", "/o/fail", "/o/undo", "/n", "/n/fail", "/n/undo"];

#[derive(Clone, Debug)]
struct QuotaSpec {
    period: usize,
    first_use: bool,
    limit: u64,
    free: Option<u64>,
    pro: Option<u64>,
    shadow: bool,
    /// A calendar quota's reset told up to a fraction of its period later.
    spread: bool,
    allowance: usize,
}

#[derive(Clone, Copy, Debug)]
enum CostSpec {
    Fixed(u64),
    /// The request's `x-units`.
    Units,
    /// So much up front; the real cost the response's `x-real`.
    Deferred(u64),
}

#[derive(Clone, Debug)]
struct LayerSpec {
    quotas: Vec<QuotaSpec>,
    cost: CostSpec,
}

#[derive(Clone, Debug)]
struct AppSpec {
    outer: LayerSpec,
    inner: LayerSpec,
    /// The outer quota the inner layer repeats.
    shared: Option<usize>,
    zones: bool,
    refund_5xx: bool,
    max_block: u64,
}

fn quota_spec() -> impl Strategy<Value = QuotaSpec> {
    (
        0..PERIODS,
        any::<bool>(),
        prop_oneof![2 => 2u64..12, 2 => 12u64..40, 1 => 40u64..200],
        proptest::option::of(1u64..30),
        proptest::option::of(5u64..80),
        prop_oneof![4 => Just(false), 1 => Just(true)],
        prop_oneof![3 => Just(false), 1 => Just(true)],
        0..ALLOWANCES.len(),
    )
        .prop_map(
            |(period, first_use, limit, free, pro, shadow, spread, allowance)| QuotaSpec {
                period,
                first_use,
                limit,
                free,
                pro,
                shadow,
                spread,
                allowance,
            },
        )
}

fn cost_spec() -> impl Strategy<Value = CostSpec> {
    prop_oneof![
        2 => Just(CostSpec::Fixed(1)),
        1 => (2u64..13).prop_map(CostSpec::Fixed),
        1 => Just(CostSpec::Units),
        2 => (1u64..6).prop_map(CostSpec::Deferred),
    ]
}

fn layer_spec(quotas: std::ops::Range<usize>) -> impl Strategy<Value = LayerSpec> {
    (proptest::collection::vec(quota_spec(), quotas), cost_spec())
        .prop_map(|(quotas, cost)| LayerSpec { quotas, cost })
}

fn app_spec() -> impl Strategy<Value = AppSpec> {
    (
        layer_spec(1..4),
        layer_spec(0..3),
        proptest::option::of(0..3usize),
        any::<bool>(),
        any::<bool>(),
        prop_oneof![Just(3u64), Just(5), Just(1_000)],
    )
        .prop_map(|(outer, inner, shared, zones, refund_5xx, max_block)| {
            let shared = shared.map(|i| i % outer.quotas.len());
            let (mut outer, mut inner) = (outer, inner);
            if inner.quotas.is_empty() && shared.is_none() {
                inner.quotas.push(outer.quotas[0].clone());
            }
            // No two quotas of a policy on one allowance, period and
            // anchor (they would share a counter): each moved to the next
            // combination free.
            let mut used = [false; 4 * PERIODS];
            for quota in outer.quotas.iter_mut().chain(inner.quotas.iter_mut()) {
                let mut at =
                    (quota.allowance * 2 + usize::from(quota.first_use)) * PERIODS + quota.period;
                while used[at] {
                    at = (at + 1) % (4 * PERIODS);
                }
                used[at] = true;
                quota.allowance = at / (2 * PERIODS);
                quota.first_use = (at / PERIODS) % 2 == 1;
                quota.period = at % PERIODS;
            }
            AppSpec {
                outer,
                inner,
                shared,
                zones,
                refund_5xx,
                max_block,
            }
        })
}

fn quota(spec: &QuotaSpec, name: String) -> Quota {
    let period = match spec.period {
        0 => Period::fixed(Duration::from_secs(10)),
        1 => Period::fixed(Duration::from_secs(30)),
        2 => Period::minute(),
        3 => Period::hour(),
        4 => Period::day(),
        5 => Period::week(),
        _ => Period::month(),
    };
    let anchor = if spec.first_use {
        Anchor::FirstUse
    } else {
        Anchor::Calendar
    };
    let mut quota = Quota::new(spec.limit, period, anchor)
        .allowance(ALLOWANCES[spec.allowance])
        .named(name);
    if let Some(limit) = spec.free {
        quota = quota.plan("free", limit);
    }
    if let Some(limit) = spec.pro {
        quota = quota.plan("pro", limit);
    }
    if spec.shadow {
        quota = quota.shadow();
    }
    if spec.spread {
        let spread = [5, 10, 20, 600, 3_600, 3_600, 3_600][spec.period];
        quota = quota.spread_reset(Duration::from_secs(spread));
    }
    quota
}

fn header_u64(headers: &http::HeaderMap, name: &str) -> u64 {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(1)
}

fn layer<St: Store>(
    policy: &QuotaPolicy<FromHeader, St>,
    quotas: Vec<Quota>,
    cost: CostSpec,
) -> QuotaLayer<FromHeader, St> {
    let mut quotas = quotas.into_iter();
    let mut layer = policy.layer(quotas.next().unwrap());
    for quota in quotas {
        layer = layer.quota(quota);
    }
    match cost {
        CostSpec::Fixed(cost) => layer.cost(cost),
        CostSpec::Units => {
            layer.cost_fn(|parts| Ok::<_, InvalidRequest>(header_u64(&parts.headers, "x-units")))
        }
        CostSpec::Deferred(upfront) => {
            layer.deferred_cost(upfront, |response| header_u64(&response.headers, "x-real"))
        }
    }
}

/// Each entry as a client or support tool reads it; if `leniently`, a
/// first-use quota's period where nothing is spent is not told.
fn describe_as(entries: &[QuotaUsage], leniently: bool) -> String {
    entries
        .iter()
        .map(|u| {
            if leniently && u.quota().anchor() == Anchor::FirstUse && u.used() == 0 {
                return format!("[{} limit={} used=0]", u.name(), u.limit());
            }
            format!(
                "[{} {} limit={} used={} remaining={} resets_at={} first_call={:?}]",
                u.name(),
                u.key().as_str(),
                u.limit(),
                u.used(),
                u.remaining(),
                u.resets_at(),
                u.first_call().map(|t| t.to_string()),
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn describe(entries: &[QuotaUsage]) -> String {
    describe_as(entries, false)
}

#[derive(Clone, Copy)]
enum Kind {
    Ok,
    Fail,
    Undo,
}

fn handler<St: Store>(kind: Kind) -> MethodRouter<QuotaHandle<St>> {
    get(
        move |State(handle): State<QuotaHandle<St>>, headers: HeaderMap, status: QuotaStatus| async move {
            let real = headers
                .get("x-real")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("1")
                .to_owned();
            // What a handler keeps to refund the request later
            // (`refund_at`).
            let charged = handle.charged_at(&status);
            let charged = charged.map(|t| t.to_string());
            let mut body = format!("charged={} ", charged.as_deref().unwrap_or("-"));
            let code = match kind {
                Kind::Ok => StatusCode::OK,
                Kind::Fail => StatusCode::INTERNAL_SERVER_ERROR,
                Kind::Undo => {
                    let undone = handle.refund_request(&status).await;
                    body.push_str(&format!("{undone:?} "));
                    StatusCode::OK
                }
            };
            body.push_str(&describe(&status.entries()));
            (code, [("x-real", real)], body)
        },
    )
}

fn app<St: Store>(spec: &AppSpec, store: St, clock: ManualClock) -> (Router, QuotaHandle<St>) {
    let mut builder = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .clock(clock)
        .plan(|parts| Some(parts.headers.get("x-plan")?.to_str().ok()?.to_owned()))
        .on_unknown_plan(UnknownPlan::DefaultLimits)
        .refund_server_errors(spec.refund_5xx);
    if spec.zones {
        builder = builder.time_zone(zone_from_header("x-zone"));
    }
    let policy = builder.build();
    let outer_quotas: Vec<Quota> = spec
        .outer
        .quotas
        .iter()
        .enumerate()
        .map(|(i, q)| quota(q, format!("o{i}")))
        .collect();
    let mut inner_quotas: Vec<Quota> = spec
        .inner
        .quotas
        .iter()
        .enumerate()
        .map(|(i, q)| quota(q, format!("i{i}")))
        .collect();
    if let Some(shared) = spec.shared {
        inner_quotas.insert(0, outer_quotas[shared].clone());
    }
    let outer = layer(&policy, outer_quotas, spec.outer.cost);
    let inner = layer(&policy, inner_quotas, spec.inner.cost);
    let handle = policy.handle();
    let router = Router::new()
        .route("/n", handler(Kind::Ok))
        .route("/n/fail", handler(Kind::Fail))
        .route("/n/undo", handler(Kind::Undo))
        .route_layer(inner)
        .route("/o", handler(Kind::Ok))
        .route("/o/fail", handler(Kind::Fail))
        .route("/o/undo", handler(Kind::Undo))
        .route_layer(outer)
        .with_state(handle.clone());
    (router, handle)
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Call {
        who: usize,
        path: usize,
        plan: usize,
        zone: usize,
        units: u8,
        real: u8,
        gap_ms: u16,
    },
    /// 350 ms (past the idle bound), 2.1 s (past the lease time), 11 s, 61 s.
    Wait(u8),
    /// To the end of an entry's period (as the plain store tells it), plus
    /// `offset` ms.
    ToEnd {
        who: usize,
        zone: usize,
        entry: usize,
        offset: i8,
    },
    /// To the next multiple of 10 s, 30 s, a minute, an hour or a day
    /// since the epoch, plus `offset` ms.
    ToBoundary {
        which: usize,
        offset: i8,
    },
    Refund {
        who: usize,
        zone: usize,
        amount: u64,
    },
    RefundAllowance {
        who: usize,
        zone: usize,
        allowance: usize,
        amount: u64,
    },
    /// A refund at the instant `who`'s last request was charged.
    RefundAt {
        who: usize,
        zone: usize,
        amount: u64,
    },
    Reset {
        who: usize,
        zone: usize,
    },
    ResetAllowance {
        who: usize,
        zone: usize,
        allowance: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let who = 0..SUBJECTS.len();
    let zone = prop_oneof![3 => Just(0usize), 1 => 1..ZONES.len()];
    let offset = prop_oneof![Just(-1i8), Just(0), Just(1)];
    prop_oneof![
        40 => (
            who.clone(),
            prop_oneof![3 => Just(0usize), 1 => 1..3usize, 3 => Just(3usize), 1 => 4..6usize],
            prop_oneof![3 => Just(0usize), 1 => 1..PLANS.len()],
            zone.clone(),
            prop_oneof![3 => 0u8..4, 1 => 4u8..20],
            prop_oneof![3 => 0u8..4, 1 => 4u8..20, 1 => 20u8..60],
            prop_oneof![8 => 0u16..12, 1 => 150u16..280],
        )
            .prop_map(|(who, path, plan, zone, units, real, gap_ms)| Op::Call {
                who,
                path,
                plan,
                zone,
                units,
                real,
                gap_ms
            }),
        3 => (0u8..4).prop_map(Op::Wait),
        3 => (who.clone(), zone.clone(), 0..6usize, offset.clone())
            .prop_map(|(who, zone, entry, offset)| Op::ToEnd { who, zone, entry, offset }),
        2 => (0..5usize, offset).prop_map(|(which, offset)| Op::ToBoundary { which, offset }),
        1 => (who.clone(), zone.clone(), 0u64..6)
            .prop_map(|(who, zone, amount)| Op::Refund { who, zone, amount }),
        1 => (who.clone(), zone.clone(), 0..ALLOWANCES.len(), 0u64..6).prop_map(
            |(who, zone, allowance, amount)| Op::RefundAllowance { who, zone, allowance, amount }
        ),
        1 => (who.clone(), zone.clone(), 0u64..6)
            .prop_map(|(who, zone, amount)| Op::RefundAt { who, zone, amount }),
        1 => (who.clone(), zone.clone()).prop_map(|(who, zone)| Op::Reset { who, zone }),
        1 => (who, zone, 0..ALLOWANCES.len())
            .prop_map(|(who, zone, allowance)| Op::ResetAllowance { who, zone, allowance }),
    ]
}

async fn ask(app: &Router, op: &Op) -> String {
    let Op::Call {
        who,
        path,
        plan,
        zone,
        units,
        real,
        ..
    } = *op
    else {
        unreachable!()
    };
    let mut request = Request::get(PATHS[path])
        .header("x-account-id", SUBJECTS[who])
        .header("x-units", units.to_string())
        .header("x-real", real.to_string());
    if let Some(plan) = PLANS[plan] {
        request = request.header("x-plan", plan);
    }
    if let Some(zone) = ZONES[zone] {
        request = request.header("x-zone", zone);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    differential::answer(response).await
}

/// The handle for callers in zone `zone` (the policy's own if it reads no
/// caller zones).
fn in_zone<St: Store>(handle: &QuotaHandle<St>, zone: usize) -> QuotaHandle<St> {
    match ZONES[zone] {
        Some(name) if handle.reads_caller_zones() => handle.in_zone(TimeZone::get(name).unwrap()),
        _ => handle.clone(),
    }
}

async fn standing_as<St: Store>(handle: &QuotaHandle<St>, who: usize, leniently: bool) -> String {
    let subject = Subject::account(SUBJECTS[who]);
    let mut seen = String::new();
    let zones = if handle.reads_caller_zones() {
        ZONES.len()
    } else {
        1
    };
    for (zone, name) in ZONES.iter().enumerate().take(zones) {
        let handle = in_zone(handle, zone);
        for plan in PLANS {
            let usage = handle.usage_on_plan(&subject, plan).await.unwrap();
            seen.push_str(&format!(
                "{name:?} {plan:?}: {}\n",
                describe_as(&usage, leniently)
            ));
        }
    }
    seen
}

/// The least `who` has spent on the quotas of `allowance` (every quota's if
/// `None`) in `zone`, on the plain app.
async fn spent<St: Store>(
    handle: &QuotaHandle<St>,
    who: usize,
    zone: usize,
    allowance: Option<&str>,
) -> u64 {
    let usage = in_zone(handle, zone)
        .usage(&Subject::account(SUBJECTS[who]))
        .await
        .unwrap();
    usage
        .iter()
        .filter(|u| allowance.is_none_or(|a| u.allowance() == a))
        .map(QuotaUsage::used)
        .min()
        .unwrap_or(0)
}

async fn settle() {
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
}

static STEPS_WITH_BLOCKS: AtomicU64 = AtomicU64::new(0);
static DOCUMENTED: AtomicU64 = AtomicU64::new(0);
static STEPS: AtomicU64 = AtomicU64::new(0);

fn run(spec: &AppSpec, start: u32, ops: &[Op]) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(async {
        // Near a UTC midnight, a Kolkata one (18:30 UTC), a Chatham hour
        // (:15 UTC), or a UTC hour.
        let start: Timestamp = [
            "2026-12-04T23:58:30Z",
            "2026-12-04T18:29:40Z",
            "2026-12-04T10:14:50Z",
            "2026-12-04T09:59:55Z",
        ][start as usize % 4]
            .parse()
            .unwrap();
        let (plain_clock, leased_clock) = (ManualClock::new(start), ManualClock::new(start));
        let (plain, plain_handle) = app(spec, MemoryStore::new(), plain_clock.clone());
        let leased_store = LeasedStore::builder(MemoryStore::new())
            .idle(Duration::from_millis(300))
            .lease_time(Duration::from_secs(2))
            .max_block(spec.max_block)
            .build();
        let (leased, leased_handle) = app(spec, leased_store.clone(), leased_clock.clone());
        let advance = |by: Duration| {
            let (plain_clock, leased_clock) = (plain_clock.clone(), leased_clock.clone());
            async move {
                let mut left = by;
                while !left.is_zero() {
                    let step = if by - left < Duration::from_secs(3) {
                        left.min(Duration::from_millis(25))
                    } else {
                        left
                    };
                    let span = SignedDuration::try_from(step).unwrap();
                    plain_clock.advance(span);
                    leased_clock.advance(span);
                    tokio::time::advance(step).await;
                    settle().await;
                    left -= step;
                }
            }
        };
        let to = |at: Timestamp| {
            let now = plain_clock.now();
            if at > now {
                Duration::try_from(at.duration_since(now)).unwrap()
            } else {
                Duration::ZERO
            }
        };
        // When each subject's last request was charged (on the plain app).
        let mut charged: [Option<Timestamp>; SUBJECTS.len()] = [None; SUBJECTS.len()];
        for (step, op) in ops.iter().enumerate() {
            STEPS.fetch_add(1, Ordering::Relaxed);
            let (a, b) = match *op {
                Op::Call { who, gap_ms, .. } => {
                    let a = ask(&plain, op).await;
                    let b = ask(&leased, op).await;
                    if let Some(at) = a
                        .split_once(" | charged=")
                        .and_then(|(_, rest)| rest.split(' ').next()?.parse().ok())
                    {
                        charged[who] = Some(at);
                    }
                    advance(Duration::from_millis(u64::from(gap_ms))).await;
                    (a, b)
                }
                Op::Wait(wait) => {
                    let by = [350, 2_100, 11_000, 61_000][wait as usize % 4];
                    advance(Duration::from_millis(by)).await;
                    (String::new(), String::new())
                }
                Op::ToEnd {
                    who,
                    zone,
                    entry,
                    offset,
                } => {
                    let usage = in_zone(&plain_handle, zone)
                        .usage(&Subject::account(SUBJECTS[who]))
                        .await
                        .unwrap();
                    let end = usage[entry % usage.len()].resets_at();
                    let at = end + SignedDuration::from_millis(i64::from(offset));
                    advance(to(at)).await;
                    (String::new(), String::new())
                }
                Op::ToBoundary { which, offset } => {
                    let every = [10, 30, 60, 3_600, 86_400][which];
                    let now = plain_clock.now();
                    let next = (now.as_second().div_euclid(every) + 1) * every;
                    let at = Timestamp::from_second(next).unwrap()
                        + SignedDuration::from_millis(i64::from(offset));
                    advance(to(at)).await;
                    (String::new(), String::new())
                }
                Op::Refund { who, zone, amount } => {
                    let amount = amount.min(spent(&plain_handle, who, zone, None).await);
                    let subject = Subject::account(SUBJECTS[who]);
                    let a = in_zone(&plain_handle, zone).refund(&subject, amount).await;
                    let b = in_zone(&leased_handle, zone).refund(&subject, amount).await;
                    (
                        format!("refund {amount}: {:?}", a.unwrap()),
                        format!("refund {amount}: {:?}", b.unwrap()),
                    )
                }
                Op::RefundAllowance {
                    who,
                    zone,
                    allowance,
                    amount,
                } => {
                    let tag = ALLOWANCES[allowance];
                    let amount = amount.min(spent(&plain_handle, who, zone, Some(tag)).await);
                    let subject = Subject::account(SUBJECTS[who]);
                    let a = in_zone(&plain_handle, zone)
                        .refund_allowance(&subject, tag, amount)
                        .await;
                    let b = in_zone(&leased_handle, zone)
                        .refund_allowance(&subject, tag, amount)
                        .await;
                    (
                        format!("refund {amount}: {:?}", a.unwrap()),
                        format!("refund {amount}: {:?}", b.unwrap()),
                    )
                }
                Op::RefundAt { who, zone, amount } => {
                    let Some(at) = charged[who] else {
                        continue;
                    };
                    let amount = amount.min(spent(&plain_handle, who, zone, None).await);
                    let subject = Subject::account(SUBJECTS[who]);
                    let a = in_zone(&plain_handle, zone)
                        .refund_at(&subject, at, amount)
                        .await;
                    let b = in_zone(&leased_handle, zone)
                        .refund_at(&subject, at, amount)
                        .await;
                    (
                        format!("refund {amount} at {at}: {:?}", a.unwrap()),
                        format!("refund {amount} at {at}: {:?}", b.unwrap()),
                    )
                }
                Op::Reset { who, zone } => {
                    let subject = Subject::account(SUBJECTS[who]);
                    let a = in_zone(&plain_handle, zone).reset(&subject).await;
                    let b = in_zone(&leased_handle, zone).reset(&subject).await;
                    (format!("{:?}", a.is_ok()), format!("{:?}", b.is_ok()))
                }
                Op::ResetAllowance {
                    who,
                    zone,
                    allowance,
                } => {
                    let subject = Subject::account(SUBJECTS[who]);
                    let tag = ALLOWANCES[allowance];
                    let a = in_zone(&plain_handle, zone)
                        .reset_allowance(&subject, tag)
                        .await;
                    let b = in_zone(&leased_handle, zone)
                        .reset_allowance(&subject, tag)
                        .await;
                    (format!("{:?}", a.unwrap()), format!("{:?}", b.unwrap()))
                }
            };
            if a != b {
                return Err(format!(
                    "step {step} {op:?} at {}:\n  plain:  {a}\n  leased: {b}",
                    plain_clock.now()
                ));
            }
            if leased_store.held() > 0 {
                STEPS_WITH_BLOCKS.fetch_add(1, Ordering::Relaxed);
            }
            for (who, subject) in SUBJECTS.iter().enumerate() {
                let (mut a, mut b) = (
                    standing_as(&plain_handle, who, false).await,
                    standing_as(&leased_handle, who, false).await,
                );
                if a != b
                    && standing_as(&plain_handle, who, true).await
                        == standing_as(&leased_handle, who, true).await
                {
                    // The documented difference (see lease_differential.rs):
                    // a first-use period opened by a request that took a
                    // block and was given back whole stays open while the
                    // block is held.
                    DOCUMENTED.fetch_add(1, Ordering::Relaxed);
                    advance(Duration::from_millis(350)).await;
                    a = standing_as(&plain_handle, who, false).await;
                    b = standing_as(&leased_handle, who, false).await;
                }
                if a != b {
                    return Err(format!(
                        "step {step} {op:?} at {}: {}'s standing\n  plain:  {a}\n  leased: {b}",
                        plain_clock.now(),
                        subject
                    ));
                }
            }
        }
        leased_store.shutdown().await;
        for (who, subject) in SUBJECTS.iter().enumerate() {
            let (a, b) = (
                standing_as(&plain_handle, who, false).await,
                standing_as(&leased_handle, who, false).await,
            );
            if a != b {
                return Err(format!(
                    "after shutdown: {subject}'s standing\n  plain:  {a}\n  leased: {b}"
                ));
            }
        }
        Ok(())
    })
}

#[test]
fn one_instance_sees_the_same_with_and_without_leases_on_any_shape() {
    let cases = std::env::var("LEASE_SHAPES_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(32);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = (app_spec(), 0u32..4, proptest::collection::vec(op(), 1..120));
    let result = runner.run(&strategy, |(spec, start, ops)| {
        run(&spec, start, &ops).map_err(TestCaseError::fail)
    });
    if let Err(error) = result {
        panic!("{error}");
    }
    assert!(
        STEPS_WITH_BLOCKS.load(Ordering::Relaxed) > 0,
        "blocks were taken"
    );
    eprintln!(
        "steps: {}; with blocks held: {}; first-use periods kept open by a block: {}",
        STEPS.load(Ordering::Relaxed),
        STEPS_WITH_BLOCKS.load(Ordering::Relaxed),
        DOCUMENTED.load(Ordering::Relaxed),
    );
}
