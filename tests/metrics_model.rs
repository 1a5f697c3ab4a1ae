//! The metrics against a reference model, over random requests through an
//! axum app with two policies on stores of their own that fail now and
//! then: policy `a` (fail open or fail closed, a skip rule, plans, missing
//! and malformed subjects let through or refused, 5xx refunds) charges an
//! enforced `read` and a shadow `trial` quota on every route (store `a`
//! counts up to 9 exactly: a full `trial` counter is left out), `search` on
//! `/search`, `tokens` (a deferred cost) on `/tokens`; policy `b` charges
//! `b` on `/b`, and a layer of the shadow quota `bs` outside it on `/bs`.
//! Handlers give their request back now and then, or take store `a` down
//! before they answer (its refunds and adds after the response are lost);
//! support resets and refunds; days end while debts are owed. After every
//! step each metric the README names (decisions by outcome and allowance,
//! charge times, refunds, changes lost, what the ledgers owe, settle and
//! drop) holds exactly what the model says, with the labels the docs
//! promise and no subject id in any label.
//!
//! `METRICS_MODEL_CASES` sets how many seeds run (default 40),
//! `METRICS_MODEL_SEED` the first one, `METRICS_MODEL_STEPS` the steps of
//! each (default 150), `METRICS_MODEL_TRACE` prints each step.

#![cfg(feature = "metrics")]

mod seeded;

use seeded::Rng;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tower::ServiceExt;
use tower_quota::jiff::Timestamp;
use tower_quota::metrics::{
    ABANDONED_CHARGES_REFUNDED, CHANGES_LOST, CHARGE_DURATION, DECISIONS, LEDGER_COUNTERS,
    LEDGER_DROPPED, LEDGER_OWED, LEDGER_SETTLED,
};
use tower_quota::store::{ChargeOutcome, ChargeRequest, Debt, StoreErrorKind};
use tower_quota::{
    FromHeader, ManualClock, MemoryStore, OnStoreError, PeriodKey, Quota, QuotaHandle, QuotaPolicy,
    QuotaStatus, Store, StoreError, Subject, SubjectPolicy, UnknownPlan, Usage,
};

/// A memory store whose charges, settles, refunds and adds fail while
/// `down` (refunds and adds as sent: they may have landed), and that says
/// it counts up to `max` exactly.
#[derive(Clone)]
struct Flaky {
    inner: MemoryStore,
    down: Arc<AtomicBool>,
    max: u64,
}

fn away() -> StoreError {
    StoreError::new(StoreErrorKind::Unavailable, "flaky: down").unsent()
}

impl Store for Flaky {
    type ChargeFuture = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<ChargeOutcome, StoreError>> + Send>,
    >;
    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        if self.down.load(Ordering::Relaxed) {
            return Box::pin(std::future::ready(Err(away())));
        }
        Box::pin(self.inner.charge(request))
    }
    async fn peek(&self, request: ChargeRequest) -> Result<Vec<Usage>, StoreError> {
        self.inner.peek(request).await
    }
    async fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        if self.down.load(Ordering::Relaxed) {
            return Err(StoreError::new(StoreErrorKind::Timeout, "flaky: lost"));
        }
        self.inner.refund(now, key, amount).await
    }
    async fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        if self.down.load(Ordering::Relaxed) {
            return Err(StoreError::new(StoreErrorKind::Timeout, "flaky: lost"));
        }
        self.inner.add(now, key, amount).await
    }
    async fn reset(&self, key: PeriodKey) -> Result<bool, StoreError> {
        self.inner.reset(key).await
    }
    async fn settle_debt(&self, now: Timestamp, debt: Debt) -> Result<Option<u64>, StoreError> {
        if self.down.load(Ordering::Relaxed) {
            return Err(away());
        }
        self.inner.settle_debt(now, debt).await
    }
    fn identity(&self) -> Option<usize> {
        self.inner.identity()
    }
    fn max_count(&self) -> u64 {
        self.max
    }
}

/// A quota of the model: name, allowance, limit, the `pro` plan's, shadow.
struct Q(&'static str, &'static str, u64, u64, bool);

const READ: Q = Q("read-day", "read", 6, 9, false);
const TRIAL: Q = Q("trial-day", "trial", 3, 4, true);
const SEARCH: Q = Q("search-day", "search", 3, 5, false);
const TOKENS: Q = Q("tokens-day", "tokens", 5, 8, false);
const B: Q = Q("b-day", "b", 4, 4, false);
const BS: Q = Q("bs-day", "bs", 2, 2, true);
const A_QUOTAS: [Q; 4] = [READ, TRIAL, SEARCH, TOKENS];

impl Q {
    fn quota(&self) -> Quota {
        let mut q = Quota::daily(self.2).named(self.0).allowance(self.1);
        if self.3 != self.2 {
            q = q.plan("pro", self.3);
        }
        if self.4 {
            q.shadow()
        } else {
            q
        }
    }
    fn limit(&self, pro: bool) -> u64 {
        if pro {
            self.3
        } else {
            self.2
        }
    }
}

/// The most store `a` says it counts exactly: a shadow counter stops
/// there.
const MOST_A: u64 = 9;

const SUBJECTS: [&str; 2] = ["subject-7f3a9c", "subject-acme01"];

/// Counters (and gauges, as deltas) by name and sorted labels.
type Seen = HashMap<(String, Vec<(String, String)>), f64>;

/// A ledger's entries: (quota name, subject, day) -> the units of each.
type Owed = HashMap<(&'static str, &'static str, i64), Vec<u64>>;

#[derive(Default)]
struct Model {
    /// (quota name, subject) -> count, today; a key absent: no counter.
    counts: HashMap<(&'static str, &'static str), u64>,
    /// Per policy (0: a, 1: b): (quota name, subject, day) -> the units
    /// of each entry of the ledger (one holds up to the store's most).
    owed: [Owed; 2],
    /// Today.
    day: i64,
    metrics: Seen,
}

impl Model {
    fn used(&self, q: &Q, s: &'static str) -> u64 {
        self.counts.get(&(q.0, s)).copied().unwrap_or(0)
    }
    fn metric(&mut self, name: &str, labels: &[(&str, &str)], by: f64) {
        let mut labels: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        labels.sort();
        *self.metrics.entry((name.to_owned(), labels)).or_default() += by;
    }
    fn decision(&mut self, outcome: &str, qs: &[&Q]) {
        for q in qs {
            self.metric(DECISIONS, &[("outcome", outcome), ("allowance", q.1)], 1.0);
        }
    }
    fn owe(&mut self, policy: usize, q: &Q, s: &'static str, units: u64) {
        if units == 0 {
            return;
        }
        let most = [MOST_A, u64::MAX][policy];
        let entries = self.owed[policy].entry((q.0, s, self.day)).or_default();
        match entries.iter_mut().find(|e| **e + units <= most) {
            Some(entry) => *entry += units,
            None => {
                entries.push(units);
                self.metric(LEDGER_COUNTERS, &[], 1.0);
            }
        }
        self.metric(LEDGER_OWED, &[], units as f64);
    }
    fn settle(&mut self, policy: usize) {
        for ((name, s, day), entries) in std::mem::take(&mut self.owed[policy]) {
            for units in entries {
                if day == self.day {
                    *self.counts.entry((name, s)).or_default() += units;
                    self.metric(LEDGER_SETTLED, &[], units as f64);
                } else {
                    self.metric(LEDGER_DROPPED, &[("reason", "ended")], units as f64);
                }
                self.metric(LEDGER_COUNTERS, &[], -1.0);
            }
        }
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
        for (_, value) in &labels {
            assert!(
                !SUBJECTS.iter().any(|s| value.contains(s)),
                "{}{labels:?} carries a subject id",
                key.name()
            );
        }
        let by = match value {
            DebugValue::Counter(n) => n as f64,
            DebugValue::Gauge(n) => n.into_inner(),
            DebugValue::Histogram(values) => values.len() as f64,
        };
        *seen.entry((key.name().to_owned(), labels)).or_default() += by;
    }
}

/// The handler: answers `x-status`, says it used `x-tokens`, and gives
/// its request back (policy `a`'s charges) when asked to.
async fn handler(
    State((handle, down)): State<(QuotaHandle<Flaky>, Arc<AtomicBool>)>,
    request: axum::extract::Request,
) -> (StatusCode, [(&'static str, String); 1]) {
    let headers = request.headers();
    let status = request.extensions().get::<QuotaStatus>().cloned();
    let code = headers
        .get("x-status")
        .map(|v| StatusCode::from_bytes(v.as_bytes()).unwrap())
        .unwrap_or(StatusCode::OK);
    if headers.contains_key("x-crash") {
        down.store(true, Ordering::Relaxed);
    }
    if let (Some(status), true) = (status, headers.contains_key("x-undo")) {
        let _ = handle.refund_request(&status).await;
    }
    let tokens = headers
        .get("x-tokens")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_else(|| "1".to_owned());
    (code, [("x-tokens-used", tokens)])
}

/// How a case's policies are set.
#[derive(Clone, Copy, Debug)]
struct Setup {
    a_open: bool,
    b_open: bool,
    a_missing_allowed: bool,
    a_malformed_allowed: bool,
    b_missing_allowed: bool,
    b_refunds_5xx: bool,
}

struct App {
    app: Router,
    a: QuotaPolicy<FromHeader, Flaky>,
    b: QuotaPolicy<FromHeader, Flaky>,
    a_down: Arc<AtomicBool>,
    b_down: Arc<AtomicBool>,
    clock: ManualClock,
}

fn choice(allowed: bool) -> SubjectPolicy {
    if allowed {
        SubjectPolicy::Allow
    } else {
        SubjectPolicy::Reject(StatusCode::UNAUTHORIZED)
    }
}

fn on_error(open: bool) -> OnStoreError {
    if open {
        OnStoreError::FailOpen
    } else {
        OnStoreError::FailClosed {
            retry_after: Duration::from_secs(1),
        }
    }
}

fn app(setup: Setup, start: Timestamp) -> App {
    let clock = ManualClock::new(start);
    let flaky = |max| Flaky {
        inner: MemoryStore::new(),
        down: Arc::default(),
        max,
    };
    let (sa, sb) = (flaky(MOST_A), flaky(u64::MAX));
    let (a_down, b_down) = (sa.down.clone(), sb.down.clone());
    let a = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(sa)
        .clock(clock.clone())
        .skip_if(|parts| parts.headers.contains_key("x-skip"))
        .on_missing_subject(choice(setup.a_missing_allowed))
        .on_malformed_subject(choice(setup.a_malformed_allowed))
        .plan(|parts| {
            parts
                .headers
                .get("x-plan")
                .map(|v| v.to_str().unwrap().to_owned())
        })
        .plans(["pro"])
        .on_unknown_plan(UnknownPlan::Reject)
        .on_store_error(on_error(setup.a_open))
        .refund_server_errors(true)
        .build();
    let b = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(sb)
        .clock(clock.clone())
        .namespace("b")
        .on_missing_subject(choice(setup.b_missing_allowed))
        .on_store_error(on_error(setup.b_open))
        .refund_server_errors(setup.b_refunds_5xx)
        .build();
    let handle = a.handle();
    let search = Router::new()
        .route("/search", get(handler))
        .route_layer(a.layer(SEARCH.quota()));
    let tokens = Router::new().route("/tokens", get(handler)).route_layer(
        a.layer(TOKENS.quota()).deferred_cost(1, |response| {
            response
                .headers
                .get("x-tokens-used")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(1)
        }),
    );
    let bee = Router::new()
        .route("/b", get(handler))
        .route_layer(b.layer(B.quota()));
    let bees = Router::new()
        .route("/bs", get(handler))
        .route_layer(b.layer(B.quota()))
        .route_layer(b.layer(BS.quota()));
    let app = Router::new()
        .route("/", get(handler))
        .merge(search)
        .merge(tokens)
        .merge(bee)
        .merge(bees)
        .route_layer(a.layer(READ.quota()).quota(TRIAL.quota()))
        .with_state((handle, a_down.clone()));
    App {
        app,
        a,
        b,
        a_down,
        b_down,
        clock,
    }
}

/// What a request sends.
#[derive(Debug)]
struct Sent {
    path: &'static str,
    subject: Option<&'static str>,
    twice: bool,
    skip: bool,
    plan: Option<&'static str>,
    fail: bool,
    undo: bool,
    crash: bool,
    tokens: u64,
}

/// One seed's walk, checked after every step.
async fn run_case(seed: u64, steps: usize, snapshotter: &Snapshotter) {
    let mut rng = Rng(seed);
    let setup = Setup {
        a_open: rng.below(2) == 0,
        b_open: rng.below(2) == 0,
        a_missing_allowed: rng.below(2) == 0,
        a_malformed_allowed: rng.below(2) == 0,
        b_missing_allowed: rng.below(2) == 0,
        b_refunds_5xx: rng.below(2) == 0,
    };
    let start: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap();
    let App {
        app,
        a,
        b,
        a_down,
        b_down,
        clock,
    } = app(setup, start);
    let trace = std::env::var_os("METRICS_MODEL_TRACE").is_some();
    let mut model = Model::default();
    let mut seen = Seen::new();
    for step in 0..steps {
        let ctx = format!("seed {seed} step {step} {setup:?}");
        let roll = rng.below(100);
        if roll < 6 {
            // The stores go down, or come back (and settle what they owe).
            let (which, down) = if rng.below(2) == 0 {
                (0, &a_down)
            } else {
                (1, &b_down)
            };
            let now_down = !down.load(Ordering::Relaxed);
            down.store(now_down, Ordering::Relaxed);
            if !now_down {
                let left = match which {
                    0 => a.settle_owed(Duration::from_secs(1)).await,
                    _ => b.settle_owed(Duration::from_secs(1)).await,
                };
                assert_eq!(left.units, 0, "{ctx}");
                model.settle(which);
            }
            if trace {
                eprintln!("{ctx}: store {which} down {now_down}");
            }
        } else if roll < 8 {
            // A new day: every counter starts afresh, once nothing is owed.
            let now = clock.now();
            let next = now + tower_quota::jiff::SignedDuration::from_hours(24);
            clock.set(next);
            model.counts.clear();
            model.day += 1;
            if trace {
                eprintln!("{ctx}: next day");
            }
        } else if roll < 11 {
            // Support: a reset of everything policy `a` counts, or a refund.
            let s = *rng.pick(&SUBJECTS);
            let subject = Subject::account(s);
            let handle = a.handle();
            if rng.below(2) == 0 {
                handle.reset(&subject).await.unwrap();
                for q in &A_QUOTAS {
                    model.counts.remove(&(q.0, s));
                    let day = model.day;
                    for units in model.owed[0].remove(&(q.0, s, day)).unwrap_or_default() {
                        model.metric(LEDGER_DROPPED, &[("reason", "reset")], units as f64);
                        model.metric(LEDGER_COUNTERS, &[], -1.0);
                    }
                }
                if trace {
                    eprintln!("{ctx}: reset {s}");
                }
            } else if !a_down.load(Ordering::Relaxed) {
                let amount = rng.below(3) + 1;
                let allowance = *rng.pick(&["", "read", "trial", "search", "tokens"]);
                if allowance.is_empty() {
                    handle.refund(&subject, amount).await.unwrap();
                } else {
                    handle
                        .refund_allowance(&subject, allowance, amount)
                        .await
                        .unwrap();
                }
                for q in A_QUOTAS
                    .iter()
                    .filter(|q| allowance.is_empty() || q.1 == allowance)
                {
                    if let Some(n) = model.counts.get_mut(&(q.0, s)) {
                        *n = n.saturating_sub(amount);
                    }
                }
                if trace {
                    eprintln!("{ctx}: refund {amount} to {s}");
                }
            }
        } else {
            let sent = Sent {
                path: rng.pick::<&str>(&["/", "/search", "/tokens", "/b", "/bs", "/bs"]),
                subject: match rng.below(10) {
                    0 => None,
                    _ => Some(*rng.pick(&SUBJECTS)),
                },
                twice: rng.below(12) == 0,
                skip: rng.below(10) == 0,
                plan: *rng.pick(&[None, None, Some("pro"), Some("gold")]),
                fail: rng.below(6) == 0,
                undo: rng.below(8) == 0,
                crash: rng.below(15) == 0,
                tokens: *rng.pick(&[0u64, 1, 1, 3]),
            };
            let expected = request(&mut model, &sent, setup, &a_down, &b_down);
            let mut request = Request::get(sent.path);
            if let Some(s) = sent.subject {
                request = request.header("x-account-id", s);
                if sent.twice {
                    request = request.header("x-account-id", s);
                }
            }
            if let Some(p) = sent.plan {
                request = request.header("x-plan", p);
            }
            if sent.skip {
                request = request.header("x-skip", "1");
            }
            if sent.fail {
                request = request.header("x-status", "500");
            }
            if sent.undo {
                request = request.header("x-undo", "1");
            }
            if sent.crash {
                request = request.header("x-crash", "1");
            }
            request = request.header("x-tokens", sent.tokens.to_string());
            let response = app
                .clone()
                .oneshot(request.body(Body::empty()).unwrap())
                .await
                .unwrap();
            let status = response.status();
            let _ = axum::body::to_bytes(response.into_body(), usize::MAX).await;
            if trace {
                eprintln!("{ctx}: {sent:?}: {status}, model {expected}");
            }
            assert_eq!(status, expected, "{ctx}: {sent:?}");
        }
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        accumulate(&mut seen, snapshotter);
        compare(&seen, &model, &ctx);
    }
}

/// Checks that `seen` holds what `model` says. Debts of a day that ended
/// while their store was away are dropped (`ended`) by the ledger when it
/// next looks, at the latest once the store answers: until then, some of
/// them may be dropped already.
fn compare(seen: &Seen, model: &Model, ctx: &str) {
    let counters = (LEDGER_COUNTERS.to_owned(), vec![]);
    let ended = (
        LEDGER_DROPPED.to_owned(),
        vec![("reason".to_owned(), "ended".to_owned())],
    );
    let value = |m: &Seen, k| m.get(k).copied().unwrap_or(0.0);
    let sorted = |m: &Seen| {
        let mut v: Vec<_> = m
            .iter()
            .filter(|(k, v)| **v != 0.0 && **k != counters && **k != ended)
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        v.sort_by(|x, y| x.0.partial_cmp(&y.0).unwrap());
        v
    };
    assert_eq!(sorted(seen), sorted(&model.metrics), "{ctx}: metrics");
    let (mut units, mut entries) = (0.0, 0.0);
    for ((_, _, day), owed) in model.owed.iter().flatten() {
        if *day < model.day {
            units += owed.iter().sum::<u64>() as f64;
            entries += owed.len() as f64;
        }
    }
    let dropped = value(seen, &ended) - value(&model.metrics, &ended);
    let let_go = value(&model.metrics, &counters) - value(seen, &counters);
    assert!(
        (0.0..=units).contains(&dropped)
            && (0.0..=entries).contains(&let_go)
            && (dropped == 0.0) == (let_go == 0.0),
        "{ctx}: dropped {dropped} (of {units} owed to ended days), {let_go} counters let go (of {entries})"
    );
}

/// Runs `sent` through the model: the status, with the metrics and counts
/// updated.
fn request(
    model: &mut Model,
    sent: &Sent,
    setup: Setup,
    a_down: &AtomicBool,
    b_down: &AtomicBool,
) -> StatusCode {
    let duration = |model: &mut Model| model.metric(CHARGE_DURATION, &[("store", "other")], 1.0);
    let s = match sent.subject {
        Some(s) if !sent.twice => Some(s),
        _ => None,
    };
    let pro = sent.plan == Some("pro");
    let inner: Option<&Q> = match sent.path {
        "/search" => Some(&SEARCH),
        "/tokens" => Some(&TOKENS),
        _ => None,
    };
    let outer = [&READ, &TRIAL];
    // Policy a's lines charged (quota, cost) and owed, as it goes.
    let mut charged: Vec<(&Q, u64)> = Vec::new();
    let mut owing = false;
    // Policy a, outer layer.
    let a_counts = if sent.skip {
        model.decision("skipped", &outer);
        false
    } else if s.is_none() {
        let allowed = if sent.twice && sent.subject.is_some() {
            setup.a_malformed_allowed
        } else {
            setup.a_missing_allowed
        };
        if !allowed {
            return StatusCode::UNAUTHORIZED;
        }
        model.decision("skipped", &outer);
        false
    } else if sent.plan == Some("gold") {
        return StatusCode::FORBIDDEN;
    } else {
        true
    };
    let s_a = s.filter(|_| a_counts);
    if let Some(s) = s_a {
        // Outer layer, then the inner one of the same policy.
        let mut layers: Vec<Vec<&Q>> = vec![outer.to_vec()];
        layers.extend(inner.map(|q| vec![q]));
        for layer in layers {
            if owing {
                model.decision("store_error", &layer);
                continue;
            }
            duration(model);
            if a_down.load(Ordering::Relaxed) {
                model.decision("store_error", &layer);
                if !setup.a_open {
                    give_back(model, &charged, s);
                    return StatusCode::SERVICE_UNAVAILABLE;
                }
                owing = true;
                continue;
            }
            let full: Vec<&Q> = layer
                .iter()
                .copied()
                .filter(|q| !q.4 && model.used(q, s) + 1 > q.limit(pro))
                .collect();
            if !full.is_empty() {
                model.decision("refused", &full);
                give_back(model, &charged, s);
                return StatusCode::TOO_MANY_REQUESTS;
            }
            // A shadow counter at the most the store counts: counted
            // shadow_refused, and the charge goes again without it.
            let saturated: Vec<&Q> = layer
                .iter()
                .copied()
                .filter(|q| q.4 && model.used(q, s) + 1 > MOST_A)
                .collect();
            if !saturated.is_empty() {
                model.decision("shadow_refused", &saturated);
                duration(model);
            }
            let layer: Vec<&Q> = layer
                .into_iter()
                .filter(|q| !saturated.iter().any(|x| x.0 == q.0))
                .collect();
            model.decision("admitted", &layer);
            let mut over = Vec::new();
            for q in &layer {
                let n = model.counts.entry((q.0, s)).or_default();
                *n += 1;
                if q.4 && *n > q.limit(pro) {
                    over.push(*q);
                }
                charged.push((q, 1));
            }
            model.decision("shadow_refused", &over);
        }
    }
    // Policy b, inside a's outer layer: on /b, its `b` layer; on /bs, a
    // layer of the shadow quota `bs` outside that one.
    let b_layers: Vec<&Q> = match sent.path {
        "/b" => vec![&B],
        "/bs" => vec![&BS, &B],
        _ => vec![],
    };
    let mut b_lines: Vec<(&Q, u64)> = Vec::new();
    let mut b_owes: Vec<&Q> = Vec::new();
    // Let through uncounted by b's outermost layer.
    let mut b_uncounted = false;
    for q in b_layers {
        let shadow = q.4;
        let refused = match s {
            _ if b_uncounted => None,
            // A layer of shadow quotas passes a request it cannot charge,
            // uncounted; the layers further in decide as they would alone.
            None if sent.twice && sent.subject.is_some() => {
                (!shadow).then_some(StatusCode::BAD_REQUEST)
            }
            None if !setup.b_missing_allowed => (!shadow).then_some(StatusCode::UNAUTHORIZED),
            None => {
                model.decision("skipped", &[q]);
                b_uncounted = true;
                None
            }
            // A layer further out owes under fail open: this one owes too.
            Some(_) if !b_owes.is_empty() && setup.b_open => {
                model.decision("store_error", &[q]);
                b_owes.push(q);
                None
            }
            Some(s) => {
                duration(model);
                if b_down.load(Ordering::Relaxed) {
                    model.decision("store_error", &[q]);
                    if setup.b_open || shadow {
                        b_owes.push(q);
                        None
                    } else {
                        Some(StatusCode::SERVICE_UNAVAILABLE)
                    }
                } else if !shadow && model.used(q, s) + 1 > q.2 {
                    model.decision("refused", &[q]);
                    Some(StatusCode::TOO_MANY_REQUESTS)
                } else {
                    model.decision("admitted", &[q]);
                    let n = model.counts.entry((q.0, s)).or_default();
                    *n += 1;
                    if shadow && *n > q.2 {
                        model.decision("shadow_refused", &[q]);
                    }
                    b_lines.push((q, 1));
                    None
                }
            }
        };
        if let Some(status) = refused {
            if let Some(s) = s_a {
                give_back(model, &charged, s);
            }
            if let Some(s) = s {
                give_back(model, &b_lines, s);
            }
            return status;
        }
    }
    // Served: the handler gives policy a's lines back when asked to (not
    // counted: a support action), then the layers see the response.
    // The handler takes store a down before it answers.
    let crashed = sent.crash;
    if let (Some(s), true) = (s_a, sent.undo) {
        for (q, cost) in std::mem::take(&mut charged) {
            if crashed {
                continue;
            }
            if let Some(n) = model.counts.get_mut(&(q.0, s)) {
                *n = n.saturating_sub(cost);
            }
        }
    }
    if sent.fail {
        if let Some(s) = s_a {
            if crashed {
                for (_, cost) in &charged {
                    model.metric(CHANGES_LOST, &[("change", "refund")], *cost as f64);
                }
            } else {
                give_back(model, &charged, s);
            }
        }
        if let Some(s) = s {
            if setup.b_refunds_5xx {
                give_back(model, &b_lines, s);
            } else {
                for q in b_owes {
                    model.owe(1, q, s, 1);
                }
            }
        }
        return StatusCode::INTERNAL_SERVER_ERROR;
    }
    if let Some(s) = s {
        for q in b_owes {
            model.owe(1, q, s, 1);
        }
    }
    if let Some(s) = s_a {
        if owing {
            let mut layers = vec![&READ, &TRIAL];
            layers.extend(inner);
            // Lines charged before the store failed are not owed.
            for q in layers {
                if charged.iter().any(|(c, _)| c.0 == q.0) {
                    continue;
                }
                let cost = if q.0 == TOKENS.0 { sent.tokens } else { 1 };
                model.owe(0, q, s, cost);
            }
        } else if inner.is_some_and(|q| q.0 == TOKENS.0) && !sent.undo {
            // The deferred cost: the unused part of the up-front one
            // given back, or the rest added.
            match sent.tokens {
                0 if crashed => model.metric(CHANGES_LOST, &[("change", "refund")], 1.0),
                0 => give_back(model, &[(&TOKENS, 1)], s),
                1 => {}
                n if crashed => model.metric(CHANGES_LOST, &[("change", "add")], (n - 1) as f64),
                n => *model.counts.entry((TOKENS.0, s)).or_default() += n - 1,
            }
        }
    }
    StatusCode::OK
}

/// Policy a's lines given back, each counted as a refund.
fn give_back(model: &mut Model, charged: &[(&Q, u64)], s: &'static str) {
    for (q, cost) in charged {
        if let Some(n) = model.counts.get_mut(&(q.0, s)) {
            *n = n.saturating_sub(*cost);
        }
        model.metric(ABANDONED_CHARGES_REFUNDED, &[], 1.0);
    }
}

#[test]
fn every_metric_holds_what_the_model_says() {
    let cases: u64 = std::env::var("METRICS_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let first: u64 = std::env::var("METRICS_MODEL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let steps: usize = std::env::var("METRICS_MODEL_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150);
    for seed in first..first + cases {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        metrics::with_local_recorder(&recorder, || {
            runtime.block_on(run_case(seed, steps, &snapshotter))
        });
    }
}
