//! A seeded random walk of requests through an axum app with enforced and
//! shadow quotas, plans, nested layers, 5xx refunds, deferred costs,
//! support resets and refunds, and clock steps across period ends,
//! checked after each step against a reference model: statuses, what each
//! counter holds, the RateLimit fields of shadow quotas, and the metrics.
//!
//! `SHADOW_MODEL_CASES` sets how many cases run (default 30),
//! `SHADOW_MODEL_SEED` the first seed, `SHADOW_MODEL_TRACE` prints each
//! step and the metrics seen.

#![cfg(feature = "metrics")]

mod fields;
mod seeded;

use seeded::Rng;

use std::collections::HashMap;
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{HeaderMap, Request, StatusCode};
use jiff::Timestamp;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tower::ServiceExt;
use tower_quota::metrics::{
    ABANDONED_CHARGES_REFUNDED, DECISIONS, LEASE_BLOCKS, LEASE_LOCAL_CHARGES, LEASE_UNITS_RETURNED,
};
use tower_quota::{
    FromHeader, LeasedStore, ManualClock, MemoryStore, Quota, QuotaHandle, QuotaPolicy, Store,
    Subject, UnknownPlan,
};

/// Counters by name and sorted labels.
type Seen = HashMap<(String, Vec<(String, String)>), u64>;

/// A quota of the model: name, allowance, period in seconds, own limit,
/// plan limits, shadow.
#[derive(Clone)]
struct Q {
    name: &'static str,
    allowance: &'static str,
    secs: i64,
    limit: u64,
    plans: &'static [(&'static str, u64)],
    shadow: bool,
}

impl Q {
    fn quota(&self) -> Quota {
        let mut q = match self.secs {
            60 => Quota::per_minute(self.limit),
            3600 => Quota::hourly(self.limit),
            86400 => Quota::daily(self.limit),
            _ => unreachable!(),
        }
        .allowance(self.allowance);
        for (plan, limit) in self.plans {
            q = q.plan(*plan, *limit);
        }
        if self.shadow {
            q = q.shadow();
        }
        q
    }
    fn limit_for(&self, plan: Option<&str>) -> u64 {
        plan.and_then(|p| self.plans.iter().find(|(n, _)| *n == p).map(|(_, l)| *l))
            .unwrap_or(self.limit)
    }
}

const READ: Q = Q {
    name: "read-day",
    allowance: "read",
    secs: 86400,
    limit: 25,
    plans: &[("pro", 45)],
    shadow: false,
};
const BURST: Q = Q {
    name: "burst-minute",
    allowance: "burst",
    secs: 60,
    limit: 3,
    plans: &[("pro", 5)],
    shadow: true,
};
const SEARCH: Q = Q {
    name: "search-minute",
    allowance: "search",
    secs: 60,
    limit: 2,
    plans: &[("team", 4)],
    shadow: false,
};
const SEARCH_TRIAL: Q = Q {
    name: "search-trial-minute",
    allowance: "search-trial",
    secs: 60,
    limit: 1,
    plans: &[],
    shadow: true,
};
const TRIAL: Q = Q {
    name: "trial-hour",
    allowance: "trial",
    secs: 3600,
    limit: 2,
    plans: &[("pro", 3)],
    shadow: true,
};
const TOKENS: Q = Q {
    name: "tokens-day",
    allowance: "tokens",
    secs: 86400,
    limit: 20,
    plans: &[("pro", 40)],
    shadow: false,
};
const TOKENS_TRIAL: Q = Q {
    name: "tokens-trial-minute",
    allowance: "tokens-trial",
    secs: 60,
    limit: 6,
    plans: &[],
    shadow: true,
};

const ALL: [Q; 7] = [
    READ,
    BURST,
    SEARCH,
    SEARCH_TRIAL,
    TRIAL,
    TOKENS,
    TOKENS_TRIAL,
];

/// Layers of the app: the outer one on every route, then each path's own.
fn layers_of(path: &str) -> Vec<Vec<Q>> {
    let inner = match path {
        "/" => None,
        "/search" => Some(vec![SEARCH, SEARCH_TRIAL]),
        "/trial" => Some(vec![TRIAL]),
        "/tokens" => Some(vec![TOKENS, TOKENS_TRIAL]),
        _ => unreachable!(),
    };
    let mut layers = vec![vec![READ, BURST]];
    layers.extend(inner);
    layers
}

const SUBJECTS: [&str; 3] = ["alice", "bob", "carol"];
const PLANS: [Option<&str>; 7] = [
    None,
    Some(""),
    Some("free"),
    Some("pro"),
    Some("team"),
    Some("gold"),
    Some("pro"),
];

#[derive(Default)]
struct Model {
    /// (quota name, subject, window) -> count
    counts: HashMap<(&'static str, String, i64), u64>,
    /// (name, labels sorted) -> value
    metrics: Seen,
}

impl Model {
    fn window(q: &Q, now: Timestamp) -> i64 {
        now.as_second().div_euclid(q.secs)
    }
    fn used(&self, q: &Q, subject: &str, now: Timestamp) -> u64 {
        *self
            .counts
            .get(&(q.name, subject.to_owned(), Self::window(q, now)))
            .unwrap_or(&0)
    }
    fn live(&self, q: &Q, subject: &str, now: Timestamp) -> bool {
        self.counts
            .contains_key(&(q.name, subject.to_owned(), Self::window(q, now)))
    }
    fn set(&mut self, q: &Q, subject: &str, now: Timestamp, value: u64) {
        self.counts
            .insert((q.name, subject.to_owned(), Self::window(q, now)), value);
    }
    fn decision(&mut self, outcome: &str, allowance: &str) {
        self.metric(
            DECISIONS,
            &[("allowance", allowance), ("outcome", outcome)],
            1,
        );
    }
    fn metric(&mut self, name: &str, labels: &[(&str, &str)], by: u64) {
        let mut labels: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        labels.sort();
        *self.metrics.entry((name.to_owned(), labels)).or_default() += by;
    }
}

fn accumulate(seen: &mut Seen, snapshotter: &Snapshotter) {
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let mut labels: Vec<(String, String)> = key
            .labels()
            .map(|l| (l.key().to_owned(), l.value().to_owned()))
            .collect();
        labels.sort();
        if let DebugValue::Counter(n) = value {
            *seen.entry((key.name().to_owned(), labels)).or_default() += n;
        }
    }
}

async fn handler(headers: HeaderMap) -> (StatusCode, [(&'static str, String); 1]) {
    let status = headers
        .get("x-status")
        .map(|v| StatusCode::from_bytes(v.as_bytes()).unwrap())
        .unwrap_or(StatusCode::OK);
    let tokens = headers
        .get("x-tokens")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_else(|| "1".to_owned());
    (status, [("x-tokens-used", tokens)])
}

struct App<St: Store> {
    app: Router,
    handle: QuotaHandle<St>,
    clock: ManualClock,
    reject_unknown: bool,
}

fn app<St: Store + Clone>(store: St, reject_unknown: bool, start: Timestamp) -> App<St> {
    let clock = ManualClock::new(start);
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .clock(clock.clone())
        .plan(|parts| {
            parts
                .headers
                .get("x-plan")
                .map(|v| v.to_str().unwrap().to_owned())
        })
        .plans(["free", "pro", "team"])
        .on_unknown_plan(if reject_unknown {
            UnknownPlan::Reject
        } else {
            UnknownPlan::DefaultLimits
        })
        .refund_server_errors(true)
        .build();
    let search = Router::new()
        .route("/search", get(handler))
        .route_layer(policy.layer(SEARCH.quota()).quota(SEARCH_TRIAL.quota()));
    let trial = Router::new()
        .route("/trial", get(handler))
        .route_layer(policy.layer(TRIAL.quota()));
    let tokens = Router::new().route("/tokens", get(handler)).route_layer(
        policy
            .layer(TOKENS.quota())
            .quota(TOKENS_TRIAL.quota())
            .deferred_cost(1, |response| {
                response
                    .headers
                    .get("x-tokens-used")
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .unwrap_or(1)
            }),
    );
    let app = Router::new()
        .route("/", get(handler))
        .merge(search)
        .merge(trial)
        .merge(tokens)
        .route_layer(policy.layer(READ.quota()).quota(BURST.quota()));
    App {
        app,
        handle: policy.handle(),
        clock,
        reject_unknown,
    }
}

fn known(plan: Option<&str>, reject_unknown: bool) -> Result<Option<&str>, ()> {
    match plan {
        None | Some("") => Ok(None),
        Some(p @ ("free" | "pro" | "team")) => Ok(Some(p)),
        Some(_) if reject_unknown => Err(()),
        Some(_) => Ok(None),
    }
}

/// One case; `leased` checks the store's own counts only after shutdown
/// (a leased store's peek sees its blocks).
async fn run_case<St: Store + Clone>(
    seed: u64,
    steps: usize,
    store: St,
    leased: Option<&LeasedStore<MemoryStore>>,
    snapshotter: &Snapshotter,
) {
    let mut rng = Rng(seed);
    let start: Timestamp = "2026-12-02T23:57:30Z".parse().unwrap();
    let reject_unknown = rng.below(2) == 0;
    let App {
        app,
        handle,
        clock,
        reject_unknown,
    } = app(store, reject_unknown, start);
    let mut model = Model::default();
    let mut seen = HashMap::new();
    // Each subject's current plan (changes now and then, mid-period).
    let mut plans: HashMap<&str, Option<&str>> =
        SUBJECTS.iter().map(|s| (*s, *rng.pick(&PLANS))).collect();
    let mut charges = 0u64; // charges sent through the store
    for step in 0..steps {
        let now = clock.now();
        let subject = *rng.pick(&SUBJECTS);
        let roll = rng.below(100);
        let ctx = format!("seed {seed} step {step} at {now} subject {subject}");
        let trace = std::env::var_os("SHADOW_MODEL_TRACE").is_some();
        if roll < 8 {
            let secs = *rng.pick(&[1u64, 20, 45, 61, 600, 3600, 86_400]);
            clock.advance(Duration::from_secs(secs));
            if trace {
                eprintln!("{ctx}: advance {secs}");
            }
            continue;
        } else if roll < 10 {
            plans.insert(subject, *rng.pick(&PLANS));
            continue;
        } else if roll < 14 {
            let allowance = *rng.pick(&["read", "burst", "search", "trial", "tokens"]);
            let n = handle
                .reset_allowance(&Subject::account(subject), allowance)
                .await
                .unwrap();
            assert_eq!(n, 1, "{ctx}");
            if trace {
                eprintln!("{ctx}: reset {allowance}");
            }
            for q in ALL.iter().filter(|q| q.allowance == allowance) {
                model
                    .counts
                    .remove(&(q.name, subject.to_owned(), Model::window(q, now)));
            }
        } else if roll < 18 {
            let allowance = *rng.pick(&["read", "burst", "search", "trial", "tokens"]);
            let mut amount = rng.below(3) + 1;
            let q = ALL.iter().find(|q| q.allowance == allowance).unwrap();
            if leased.is_some() {
                // Support refunds at most what was spent (see LeasedStore).
                amount = amount.min(model.used(q, subject, now));
                if amount == 0 {
                    continue;
                }
            }
            let after = handle
                .refund_allowance(&Subject::account(subject), allowance, amount)
                .await
                .unwrap();
            let expected = model
                .live(q, subject, now)
                .then(|| model.used(q, subject, now).saturating_sub(amount));
            if trace {
                eprintln!("{ctx}: refund {amount} of {allowance}: {after:?}, model {expected:?}");
            }
            if leased.is_none() {
                assert_eq!(
                    after,
                    vec![expected],
                    "{ctx}: refund {amount} of {allowance}"
                );
            }
            if let Some(v) = expected {
                model.set(q, subject, now, v);
            }
        } else {
            let path = *rng.pick(&["/", "/search", "/trial", "/tokens", "/tokens"]);
            let plan_header = plans[subject];
            let fail = rng.below(6) == 0;
            let tokens = *rng.pick(&[0u64, 1, 1, 2, 5, 9]);
            let mut request = Request::get(path).header("x-account-id", subject);
            if let Some(p) = plan_header {
                request = request.header("x-plan", p);
            }
            if fail {
                request = request.header("x-status", "500");
            }
            request = request.header("x-tokens", tokens.to_string());
            let response = app
                .clone()
                .oneshot(request.body(Body::empty()).unwrap())
                .await
                .unwrap();
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
            let ctx = format!("{ctx} {path} plan {plan_header:?} fail {fail} tokens {tokens}");
            let (head, body) = response.into_parts();
            let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
            let response = http::Response::from_parts(head, ());
            if trace {
                eprintln!(
                    "{ctx}: {} {:?} {}",
                    response.status(),
                    response
                        .headers()
                        .get_all("ratelimit")
                        .iter()
                        .collect::<Vec<_>>(),
                    String::from_utf8_lossy(&body)
                );
            }
            // The model.
            let expected = match known(plan_header, reject_unknown) {
                Err(()) => StatusCode::FORBIDDEN,
                Ok(plan) => {
                    let mut charged: Vec<Q> = Vec::new();
                    let mut status = if fail {
                        StatusCode::INTERNAL_SERVER_ERROR
                    } else {
                        StatusCode::OK
                    };
                    for layer in layers_of(path) {
                        charges += 1;
                        let refusing: Vec<&Q> = layer
                            .iter()
                            .filter(|q| {
                                !q.shadow && model.used(q, subject, now) + 1 > q.limit_for(plan)
                            })
                            .collect();
                        if !refusing.is_empty() {
                            for q in refusing {
                                model.decision("refused", q.allowance);
                            }
                            status = StatusCode::TOO_MANY_REQUESTS;
                            break;
                        }
                        for q in &layer {
                            let used = model.used(q, subject, now) + 1;
                            model.set(q, subject, now, used);
                            model.decision("admitted", q.allowance);
                            if q.shadow && used > q.limit_for(plan) {
                                model.decision("shadow_refused", q.allowance);
                            }
                            charged.push(q.clone());
                        }
                    }
                    if status != StatusCode::OK {
                        // Refused further in, or a 5xx: every charge back.
                        for q in &charged {
                            let used = model.used(q, subject, now);
                            model.set(q, subject, now, used - 1);
                            model.metric(ABANDONED_CHARGES_REFUNDED, &[], 1);
                        }
                    } else if path == "/tokens" {
                        for q in [&TOKENS, &TOKENS_TRIAL] {
                            let used = model.used(q, subject, now);
                            model.set(q, subject, now, used - 1 + tokens);
                            if tokens == 0 {
                                model.metric(ABANDONED_CHARGES_REFUNDED, &[], 1);
                            }
                        }
                    }
                    if status == StatusCode::OK {
                        let r = fields::remaining(response.headers());
                        for q in &charged {
                            if q.name.starts_with("tokens") {
                                continue;
                            }
                            let want = q
                                .limit_for(plan)
                                .saturating_sub(model.used(q, subject, now));
                            assert_eq!(r.get(q.name), Some(&want), "{ctx}: r of {}", q.name);
                        }
                    }
                    status
                }
            };
            assert_eq!(response.status(), expected, "{ctx}");
        }
        // The counters, as support reads them.
        if leased.is_none() {
            for s in SUBJECTS {
                let plan = known(plans[s], false).unwrap();
                let usage = handle
                    .usage_on_plan(&Subject::account(s), plan)
                    .await
                    .unwrap();
                for q in &ALL {
                    let u = usage.iter().find(|u| u.name() == q.name).unwrap();
                    assert_eq!(
                        u.used(),
                        model.used(q, s, now),
                        "{ctx}: used of {} for {s}",
                        q.name
                    );
                    assert_eq!(
                        u.limit(),
                        q.limit_for(plan),
                        "{ctx}: limit of {} for {s}",
                        q.name
                    );
                }
            }
        }
        // The metrics.
        accumulate(&mut seen, snapshotter);
        for (key, want) in &model.metrics {
            let got = seen.get(key).copied().unwrap_or(0);
            assert_eq!(got, *want, "{ctx}: metric {key:?}");
        }
        for (key, got) in &seen {
            if key.0 == DECISIONS || key.0 == ABANDONED_CHARGES_REFUNDED {
                let want = model.metrics.get(key).copied().unwrap_or(0);
                assert_eq!(*got, want, "{ctx}: metric {key:?}");
            }
        }
    }
    if std::env::var_os("SHADOW_MODEL_TRACE").is_some() {
        let mut all: Vec<_> = seen.iter().collect();
        all.sort();
        eprintln!("seed {seed}: {all:?}");
    }
    if let Some(leased) = leased {
        let returned = leased.shutdown().await;
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        accumulate(&mut seen, snapshotter);
        let get = |name: &str| {
            seen.iter()
                .filter(|(k, _)| k.0 == name)
                .map(|(_, v)| *v)
                .sum::<u64>()
        };
        let (blocks, local, back) = (
            get(LEASE_BLOCKS),
            get(LEASE_LOCAL_CHARGES),
            get(LEASE_UNITS_RETURNED),
        );
        assert!(
            back >= returned,
            "seed {seed}: returned {back} < shutdown's {returned}"
        );
        assert!(local <= charges, "seed {seed}: {local} local of {charges}");
        assert!(
            local == 0 || blocks > 0,
            "seed {seed}: local charges without a block"
        );
        // Once every unit is back, the store holds what the model says.
        let inner = leased.inner().clone();
        let handle = QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(inner)
            .plan(|_| None)
            .clock(clock.clone())
            .build();
        for q in &ALL {
            handle.layer(q.quota());
        }
        let handle = handle.handle();
        let now = clock.now();
        for s in SUBJECTS {
            let usage = handle.usage(&Subject::account(s)).await.unwrap();
            for q in &ALL {
                let u = usage.iter().find(|u| u.name() == q.name).unwrap();
                assert_eq!(
                    u.used(),
                    model.used(q, s, now),
                    "seed {seed}: {} of {s} after shutdown",
                    q.name
                );
            }
        }
    }
}

fn cases() -> (u64, u64) {
    let n = std::env::var("SHADOW_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let seed = std::env::var("SHADOW_MODEL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    (seed, n)
}

fn with_recorder(work: impl FnOnce(Snapshotter)) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || work(snapshotter));
}

#[test]
fn shadow_and_plans_match_the_model_on_the_memory_store() {
    let (first, n) = cases();
    for seed in first..first + n {
        with_recorder(|snapshotter| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(run_case(seed, 300, MemoryStore::new(), None, &snapshotter));
        });
    }
}

#[test]
fn shadow_and_plans_match_the_model_on_a_leased_store() {
    let (first, n) = cases();
    for seed in first..first + n {
        with_recorder(|snapshotter| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let leased = LeasedStore::new(MemoryStore::new());
                run_case(seed, 300, leased.clone(), Some(&leased), &snapshotter).await;
            });
        });
    }
}

/// A leased store admits up to the limit on one instance, as the memory
/// store does, after a deferred cost took the count (this instance's block
/// included) past the limit: a request whose line is paid from the block,
/// beside a line the store must charge, was refused with a 429 naming no
/// quota ("The quota store refused this request").
#[tokio::test]
async fn a_leased_store_admits_up_to_the_limit_after_a_deferred_cost() {
    let clock = ManualClock::new("2026-12-02T23:57:30Z".parse().unwrap());
    let leased = LeasedStore::new(MemoryStore::new());
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(leased.clone())
        .clock(clock.clone())
        .build();
    let app = Router::new().route("/tokens", get(handler)).route_layer(
        policy
            .layer(Quota::daily(20).allowance("tokens"))
            .quota(Quota::per_minute(100).allowance("tokens-burst"))
            .deferred_cost(1, |response| {
                response
                    .headers
                    .get("x-tokens-used")
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .unwrap_or(1)
            }),
    );
    let call = |tokens: &str| {
        Request::get("/tokens")
            .header("x-account-id", "bob")
            .header("x-tokens", tokens)
            .body(Body::empty())
            .unwrap()
    };
    // 1, 9 and 9 tokens: 19 of the day's 20 spent; the next minute's
    // counter is new (charged in the store), the day's paid from a block.
    for (advance, tokens) in [(0, "1"), (0, "9"), (122, "9"), (1, "1")] {
        clock.advance(Duration::from_secs(advance));
        let response = app.clone().oneshot(call(tokens)).await.unwrap();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }
    // The 20th token was the last.
    let response = app.clone().oneshot(call("1")).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    leased.shutdown().await;
    let usage = policy
        .handle()
        .usage(&Subject::account("bob"))
        .await
        .unwrap();
    let day = usage.iter().find(|u| u.name() == "tokens-day").unwrap();
    assert_eq!(day.used(), 20);
}

/// A shadow quota whose counter holds the most the store counts passes the
/// request uncounted, counted as `shadow_refused`, with no `admitted` when
/// its layer has no other quota; beside an enforced quota, the enforced
/// one is charged alone.
#[test]
fn a_saturated_shadow_quota_counts_as_documented() {
    with_recorder(|snapshotter| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let clock = ManualClock::new("2026-12-02T12:00:00Z".parse().unwrap());
            let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
                .clock(clock.clone())
                .build();
            let deferred = |response: &http::response::Parts| {
                response
                    .headers
                    .get("x-tokens-used")
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .unwrap_or(1)
            };
            let app = Router::new()
                .route("/alone", get(handler))
                .route_layer(
                    policy
                        .layer(Quota::daily(5).allowance("lone").shadow())
                        .deferred_cost(1, deferred),
                )
                .merge(
                    Router::new().route("/beside", get(handler)).route_layer(
                        policy
                            .layer(Quota::hourly(3).allowance("kept"))
                            .quota(Quota::daily(5).allowance("side").shadow())
                            .deferred_cost(1, deferred),
                    ),
                );
            let call = |path: &str, tokens: u64| {
                Request::get(path)
                    .header("x-account-id", "dan")
                    .header("x-tokens", tokens.to_string())
                    .body(Body::empty())
                    .unwrap()
            };
            let mut seen = HashMap::new();
            let count = |seen: &Seen, o: &str, a: &str| {
                let mut labels = vec![
                    ("allowance".to_owned(), a.to_owned()),
                    ("outcome".to_owned(), o.to_owned()),
                ];
                labels.sort();
                seen.get(&(DECISIONS.to_owned(), labels))
                    .copied()
                    .unwrap_or(0)
            };
            for path in ["/alone", "/beside"] {
                let r = app.clone().oneshot(call(path, u64::MAX)).await.unwrap();
                assert_eq!(r.status(), StatusCode::OK);
            }
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
            let usage = policy
                .handle()
                .usage(&Subject::account("dan"))
                .await
                .unwrap();
            let used = |name: &str| usage.iter().find(|u| u.name() == name).unwrap().used();
            assert_eq!(used("lone-day"), u64::MAX);
            assert_eq!(used("side-day"), u64::MAX);
            assert_eq!(used("kept-hour"), u64::MAX);
            clock.advance(Duration::from_secs(3600));
            accumulate(&mut seen, &snapshotter);
            let before_lone = count(&seen, "shadow_refused", "lone");
            let before_side = count(&seen, "shadow_refused", "side");
            let admitted_lone = count(&seen, "admitted", "lone");
            let r = app.clone().oneshot(call("/alone", 1)).await.unwrap();
            assert_eq!(r.status(), StatusCode::OK);
            assert!(!r
                .headers()
                .get_all("ratelimit")
                .iter()
                .any(|v| v.to_str().unwrap().contains("lone-day")));
            let r = app.clone().oneshot(call("/beside", 1)).await.unwrap();
            assert_eq!(r.status(), StatusCode::OK);
            let fields: Vec<_> = r
                .headers()
                .get_all("ratelimit")
                .iter()
                .map(|v| v.to_str().unwrap().to_owned())
                .collect();
            assert!(fields.iter().all(|f| !f.contains("side-day")), "{fields:?}");
            assert!(
                fields.iter().any(|f| f.contains("\"kept-hour\";r=2")),
                "{fields:?}"
            );
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
            accumulate(&mut seen, &snapshotter);
            assert_eq!(count(&seen, "shadow_refused", "lone"), before_lone + 1);
            assert_eq!(count(&seen, "admitted", "lone"), admitted_lone);
            assert_eq!(count(&seen, "shadow_refused", "side"), before_side + 1);
            let usage = policy
                .handle()
                .usage(&Subject::account("dan"))
                .await
                .unwrap();
            let used = |name: &str| usage.iter().find(|u| u.name() == name).unwrap().used();
            assert_eq!(used("kept-hour"), 1);
            assert_eq!(used("side-day"), u64::MAX);
        });
    });
}
