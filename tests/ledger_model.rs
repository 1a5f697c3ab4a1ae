//! Fail-open counting under random interleavings: a policy under
//! `OnStoreError::FailOpen` with two nested layers (a calendar and a
//! first-use quota outside, a calendar one inside, a deferred cost on one
//! route), sent random requests of a few subjects (served, 5xx refunded,
//! undone by their handler, dropped mid-flight) while the store switches
//! between healthy (one settle in four applied with its answer lost on the
//! wire), slow (answers within `store_timeout`), late (answers after it;
//! a settle is applied all the same, and one sent again under its id adds
//! nothing, as the Redis store's marks make it), and away (fails every
//! call, unsent), and the policy's clock
//! steps on across midnight and first-use deadlines. At each quiet point
//! (the store healthy, `settle_owed` awaited): nothing is owed, and each
//! live calendar counter holds exactly what the requests served in its
//! window cost (less what was given back, plus what was added); a live
//! first-use counter holds what the store says it charged to it, plus at
//! most the debts of requests within a period of its first call (README
//! "cases that count otherwise": a first-use debt lands in the counter live
//! when it is settled). Debts of periods over before the store came back
//! go uncounted (README "When the store fails"), counters of periods over
//! are not read, nor those of periods that end within 10 s (a give-back
//! never sent in a period's last 5 s is not sent again: `store::resend`).
//! The ledger's metrics agree with what it owes after every step, and at
//! each quiet point with what the requests whose charges failed owe and
//! what the store settled (two more variants add support resets, and a
//! small bound on counters owed). The runtime's time is paused: a run
//! takes milliseconds.
//!
//! `LEDGER_MODEL_SEEDS=n` runs `n` seeds; `LEDGER_MODEL_ONLY=seed` one;
//! `LEDGER_MODEL_METRICS` prints the metrics at each quiet point.

#![cfg(feature = "metrics")]

mod seeded;

use seeded::Rng;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_quota::jiff::{SignedDuration, Timestamp};
use tower_quota::store::{ChargeOutcome, ChargeRequest, Debt, StoreErrorKind};
use tower_quota::{
    FromHeader, ManualClock, MemoryStore, OnStoreError, PeriodKey, Quota, QuotaHandle, QuotaPolicy,
    QuotaStatus, Store, StoreError, Subject, Usage,
};

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tower_quota::metrics::{LEDGER_COUNTERS, LEDGER_DROPPED, LEDGER_OWED, LEDGER_SETTLED};

/// The ledger's metrics so far.
#[derive(Default, Debug, Clone)]
struct LedgerMetrics {
    owed: u64,
    settled: u64,
    dropped: HashMap<String, u64>,
    counters: f64,
}

impl LedgerMetrics {
    fn read(&mut self, snapshotter: &Snapshotter) {
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let key = key.key();
            let reason = key
                .labels()
                .find(|l| l.key() == "reason")
                .map(|l| l.value().to_owned());
            match (key.name(), value) {
                (n, DebugValue::Counter(v)) if n == LEDGER_OWED => self.owed += v,
                (n, DebugValue::Counter(v)) if n == LEDGER_SETTLED => self.settled += v,
                (n, DebugValue::Counter(v)) if n == LEDGER_DROPPED => {
                    *self.dropped.entry(reason.unwrap_or_default()).or_default() += v;
                }
                (n, DebugValue::Gauge(v)) if n == LEDGER_COUNTERS => {
                    self.counters += v.into_inner();
                }
                _ => {}
            }
        }
    }

    fn dropped(&self, reason: &str) -> u64 {
        self.dropped.get(reason).copied().unwrap_or(0)
    }

    /// Units owed and not accounted for (settled, or dropped once owed).
    fn open(&self) -> i128 {
        let dropped: u64 = self
            .dropped
            .iter()
            .filter(|(r, _)| r.as_str() != "full")
            .map(|(_, v)| *v)
            .sum();
        self.owed as i128 - self.settled as i128 - dropped as i128
    }
}

const LIMIT: u64 = 1_000_000;

fn tracing() -> bool {
    std::env::var("LEDGER_MODEL_TRACE").is_ok()
}

macro_rules! trace {
    ($($t:tt)*) => {
        if tracing() {
            eprintln!($($t)*);
        }
    };
}
const ROLLING: u64 = 60;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Healthy,
    /// Answers within `store_timeout`.
    Slow,
    /// Answers after `store_timeout`: a charge whose caller stopped
    /// waiting is not applied (or applied and given back); a refund, an
    /// add or a settle is (a settle sent again under its id then adds
    /// nothing, as the Redis store's marks make it).
    Late,
    /// Every call fails, never sent.
    Away,
}

struct FlakyState {
    mode: Mode,
    rng: Rng,
    /// The charges answered admitted to their caller: the request's
    /// instant and the line's key.
    delivered: HashSet<(Timestamp, String)>,
    /// The first call of the counter each of them was charged to, as the
    /// store answered (a charge lands in the counter live when the store
    /// runs it: see `quiet`).
    landed: HashMap<(Timestamp, String), Option<Timestamp>>,
    /// Units of the settles whose caller got `Ok(Some(_))`: what the
    /// ledger counts as settled.
    settled: u64,
    /// The ids of the settles applied: one sent again adds nothing.
    settle_ids: HashSet<u64>,
}

/// A memory store whose calls answer at once, late, or never reach it.
#[derive(Clone)]
struct Flaky {
    inner: MemoryStore,
    state: Arc<Mutex<FlakyState>>,
}

fn unsent() -> StoreError {
    StoreError::new(StoreErrorKind::Unavailable, "flaky: away").unsent()
}

impl Flaky {
    fn draw(&self) -> (Mode, Duration) {
        let mut state = self.state.lock().unwrap();
        let mode = state.mode;
        let r = state.rng.next();
        let ms = match mode {
            Mode::Healthy | Mode::Away => 0,
            Mode::Slow => 1 + r % 60,
            Mode::Late => 120 + r % 500,
        };
        (mode, Duration::from_millis(ms))
    }

    /// A refund or an add: applied after the delay whether or not its
    /// caller still waits (sent, the store applies it).
    fn change<F>(
        &self,
        what: String,
        make: impl FnOnce(MemoryStore) -> F + Send + 'static,
    ) -> Pin<Box<dyn Future<Output = Result<Option<u64>, StoreError>> + Send>>
    where
        F: Future<Output = Result<Option<u64>, StoreError>> + Send + 'static,
    {
        let (mode, delay) = self.draw();
        match mode {
            Mode::Away => {
                trace!("  store {what} unsent");
                Box::pin(std::future::ready(Err(unsent())))
            }
            Mode::Healthy => {
                let change = make(self.inner.clone());
                Box::pin(async move {
                    let answer = change.await;
                    trace!("  store {what} -> {answer:?}");
                    answer
                })
            }
            Mode::Slow | Mode::Late => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let inner = self.inner.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let answer = make(inner).await;
                    trace!("  store {what} (late {delay:?}) -> {answer:?}");
                    let _ = tx.send(answer);
                });
                Box::pin(async move {
                    rx.await.unwrap_or_else(|_| {
                        Err(StoreError::new(StoreErrorKind::Other, "flaky: lost"))
                    })
                })
            }
        }
    }
}

type Charging = Pin<Box<dyn Future<Output = Result<ChargeOutcome, StoreError>> + Send>>;

impl Store for Flaky {
    type ChargeFuture = Charging;

    fn charge(&self, request: ChargeRequest) -> Charging {
        let (mode, delay) = self.draw();
        let state = Arc::clone(&self.state);
        let now = request.now;
        let keys: Vec<String> = request
            .lines
            .iter()
            .map(|l| l.key.as_str().to_owned())
            .collect();
        let what = format!(
            "charge {now} {:?}",
            request
                .lines
                .iter()
                .map(|l| (l.key.as_str().to_owned(), l.cost))
                .collect::<Vec<_>>()
        );
        trace!("  store {what} ({mode:?} {delay:?})");
        let deliver = move |answer: &Result<ChargeOutcome, StoreError>| {
            trace!(
                "  store {what} answered {:?}",
                answer.as_ref().map(|o| (
                    o.admitted,
                    o.usage
                        .iter()
                        .map(|u| (u.used, u.first_call))
                        .collect::<Vec<_>>()
                ))
            );
            if let Ok(outcome) = answer {
                if outcome.admitted {
                    let mut state = state.lock().unwrap();
                    for (key, usage) in keys.iter().zip(&outcome.usage) {
                        state.delivered.insert((now, key.clone()));
                        state.landed.insert((now, key.clone()), usage.first_call);
                    }
                }
            }
        };
        match mode {
            Mode::Away => Box::pin(std::future::ready(Err(unsent()))),
            Mode::Healthy => {
                let charge = self.inner.charge(request);
                Box::pin(async move {
                    let answer = charge.await;
                    deliver(&answer);
                    answer
                })
            }
            Mode::Slow | Mode::Late => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let inner = self.inner.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    if tx.is_closed() {
                        // Its caller stopped waiting: not applied.
                        return;
                    }
                    let answer = inner.charge(request.clone()).await;
                    trace!(
                        "  store charge at {now} applied late {:?}",
                        answer.as_ref().map(|o| o.admitted)
                    );
                    if let Err(Ok(outcome)) = tx.send(answer) {
                        trace!("  store charge at {now} given back");
                        // Applied as its caller stopped waiting: given back.
                        if outcome.admitted {
                            for (line, usage) in request.lines.iter().zip(&outcome.usage) {
                                let _ = match usage.first_call {
                                    Some(first) => {
                                        inner
                                            .refund_made_at(now, line.key.clone(), line.cost, first)
                                            .await
                                    }
                                    None => inner.refund(now, line.key.clone(), line.cost).await,
                                };
                            }
                        }
                    }
                });
                Box::pin(async move {
                    let answer = rx.await.unwrap_or_else(|_| {
                        Err(StoreError::new(StoreErrorKind::Other, "flaky: lost"))
                    });
                    deliver(&answer);
                    answer
                })
            }
        }
    }
    fn peek(
        &self,
        request: ChargeRequest,
    ) -> impl Future<Output = Result<Vec<Usage>, StoreError>> + Send {
        self.inner.peek(request)
    }
    fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        let what = format!("refund {:?}", (now, key.as_str(), amount));
        self.change(
            what,
            move |s| async move { s.refund(now, key, amount).await },
        )
    }
    fn refund_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        let what = format!("refund_made_by {:?}", (now, key.as_str(), amount));
        self.change(what, move |s| async move {
            s.refund_made_by(now, key, amount, made_by).await
        })
    }
    fn refund_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        let what = format!("refund_made_at {:?}", (now, key.as_str(), amount));
        self.change(what, move |s| async move {
            s.refund_made_at(now, key, amount, first_call).await
        })
    }
    fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        let what = format!("add {:?}", (now, key.as_str(), amount));
        self.change(what, move |s| async move { s.add(now, key, amount).await })
    }
    fn add_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        let what = format!("add_made_by {:?}", (now, key.as_str(), amount));
        self.change(what, move |s| async move {
            s.add_made_by(now, key, amount, made_by).await
        })
    }
    fn add_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        let what = format!("add_made_at {:?}", (now, key.as_str(), amount));
        self.change(what, move |s| async move {
            s.add_made_at(now, key, amount, first_call).await
        })
    }
    fn settle_debt(
        &self,
        now: Timestamp,
        debt: Debt,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        let (mode, delay) = self.draw();
        // One healthy settle in four is applied with its answer lost on the
        // wire.
        let lost = mode == Mode::Healthy && self.state.lock().unwrap().rng.next().is_multiple_of(4);
        let inner = self.inner.clone();
        let state = Arc::clone(&self.state);
        let amount = debt.amount;
        // Applied once per id, as the Redis store's marks make it: one sent
        // again adds nothing (the count it answers is not read).
        let apply = {
            let state = Arc::clone(&self.state);
            move |inner: MemoryStore, debt: Debt| async move {
                let id = debt.id;
                if state.lock().unwrap().settle_ids.contains(&id) {
                    trace!("  store settle at {now} {debt:?}: its id seen, nothing added");
                    return Ok(Some(0));
                }
                let what = format!("{debt:?}");
                let answer = inner.settle_debt(now, debt).await;
                trace!("  store settle at {now} {what} -> {answer:?}");
                if let Ok(Some(_)) = answer {
                    state.lock().unwrap().settle_ids.insert(id);
                }
                answer
            }
        };
        async move {
            let answer = match mode {
                Mode::Away => Err(unsent()),
                Mode::Healthy if lost => {
                    let _ = apply(inner, debt).await;
                    trace!("  (its answer lost)");
                    Err(StoreError::new(
                        StoreErrorKind::Timeout,
                        "flaky: answer lost",
                    ))
                }
                Mode::Healthy => apply(inner, debt).await,
                Mode::Slow | Mode::Late => {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        // Applied whether its caller still waits or not.
                        let _ = tx.send(apply(inner, debt).await);
                    });
                    rx.await.unwrap_or_else(|_| {
                        Err(StoreError::new(StoreErrorKind::Other, "flaky: lost"))
                    })
                }
            };
            if let Ok(Some(_)) = answer {
                state.lock().unwrap().settled += amount;
            }
            answer
        }
    }
    fn reset(&self, key: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.inner.reset(key)
    }
    fn identity(&self) -> Option<usize> {
        self.inner.identity()
    }
    fn max_count(&self) -> u64 {
        self.inner.max_count()
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Route {
    Ok,
    Fail,
    Deferred(u64),
    Undo,
    Slow,
}

/// A request as sent, and what became of it.
#[derive(Debug)]
struct Sent {
    at: Timestamp,
    subject: usize,
    route: Route,
    /// The status it was served with; `None`: dropped before its answer.
    served: Arc<Mutex<Option<StatusCode>>>,
}

type Handle = QuotaHandle<Flaky>;

fn app(policy: &QuotaPolicy<FromHeader, Flaky>, quotas: &Quotas) -> Router {
    let deferred = |parts: &http::response::Parts| {
        parts
            .headers
            .get("x-cost")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(1)
    };
    let cost = |c: String| async move { ([("x-cost", c)], "deferred").into_response() };
    let undo = |State(handle): State<Handle>, status: QuotaStatus| async move {
        let _ = handle.refund_request(&status).await;
        "undone"
    };
    let inner = policy.layer(quotas.b.clone());
    Router::new()
        .route("/ok", get(|| async { "ok" }).route_layer(inner.clone()))
        .route(
            "/fail",
            get(|| async { StatusCode::INTERNAL_SERVER_ERROR }).route_layer(inner.clone()),
        )
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(200)).await;
                "slow"
            })
            .route_layer(inner.clone()),
        )
        .route("/undo", get(undo).route_layer(inner))
        .route(
            "/deferred/{cost}",
            get(move |axum::extract::Path(c): axum::extract::Path<String>| cost(c))
                .route_layer(policy.layer(quotas.d.clone()).deferred_cost(1, deferred)),
        )
        .with_state(policy.handle())
        .layer(policy.layer(quotas.a.clone()).quota(quotas.r.clone()))
}

struct Quotas {
    a: Quota,
    r: Quota,
    b: Quota,
    d: Quota,
}

impl Quotas {
    fn new() -> Self {
        Self {
            a: Quota::daily(LIMIT).allowance("a"),
            r: Quota::rolling(LIMIT, Duration::from_secs(ROLLING)).allowance("r"),
            b: Quota::per_minute(LIMIT).allowance("b"),
            d: Quota::per_minute(LIMIT).allowance("d"),
        }
    }
}

fn account(subject: usize) -> String {
    format!("s{subject}")
}

/// What a served request `sent` costs on the line of `key` (charged at its
/// instant or not, as `charged` says), given its route.
fn cost(sent: &Sent, status: StatusCode, inner: bool, charged: bool) -> u64 {
    if status.is_server_error() {
        return 0;
    }
    match sent.route {
        Route::Fail => 0,
        // A request that owes its charge has no line to give back: its debt
        // counts as served (`QuotaHandle::refund_request`).
        Route::Undo => u64::from(!charged),
        Route::Deferred(c) if inner => c,
        _ => 1,
    }
}

/// What a run adds to the plain model: support resets, a small bound of
/// counters owed. Either makes the store's counts inexact (a reset forgets,
/// a debt past the bound goes uncounted): only the metrics are checked.
#[derive(Clone, Copy, Debug, Default)]
struct Variant {
    resets: bool,
    max_owed: Option<usize>,
}

impl Variant {
    fn exact(&self) -> bool {
        !self.resets && self.max_owed.is_none()
    }
}

async fn run(seed: u64, steps: usize, snapshotter: &Snapshotter, variant: Variant) -> Vec<String> {
    let mut seen = LedgerMetrics::default();
    let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0xDEAD_BEEF);
    let clock = ManualClock::new("2026-12-02T23:57:30Z".parse().unwrap());
    let memory = MemoryStore::new();
    let store = Flaky {
        inner: memory.clone(),
        state: Arc::new(Mutex::new(FlakyState {
            mode: Mode::Healthy,
            rng: Rng(seed ^ 0x5151),
            delivered: HashSet::new(),
            landed: HashMap::new(),
            settled: 0,
            settle_ids: HashSet::new(),
        })),
    };
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store.clone())
        .clock(clock.clone())
        .on_store_error(OnStoreError::FailOpen)
        .refund_server_errors(true);
    let policy = match variant.max_owed {
        Some(max) => policy.max_owed_counters(max),
        None => policy,
    }
    .build();
    let quotas = Quotas::new();
    let app = app(&policy, &quotas);
    let mut sent: Vec<Sent> = Vec::new();
    let mut tasks = Vec::new();
    let mut broken = Vec::new();
    let subjects = 3;
    for step in 0..steps {
        let r = rng.next() % 100;
        match r {
            0..=54 => {
                // A request, at an instant of its own.
                clock.advance(SignedDuration::from_millis(1));
                let subject = (rng.next() % subjects as u64) as usize;
                let route = match rng.next() % 10 {
                    0..=3 => Route::Ok,
                    4 => Route::Fail,
                    5 | 6 => Route::Deferred(rng.next() % 4),
                    7 | 8 => Route::Undo,
                    _ => Route::Slow,
                };
                let path = match route {
                    Route::Ok => "/ok".to_owned(),
                    Route::Fail => "/fail".to_owned(),
                    Route::Deferred(c) => format!("/deferred/{c}"),
                    Route::Undo => "/undo".to_owned(),
                    Route::Slow => "/slow".to_owned(),
                };
                let request = Request::get(path)
                    .header("x-account-id", account(subject))
                    .body(Body::empty())
                    .unwrap();
                let served = Arc::new(Mutex::new(None));
                // Dropped after a while, or awaited.
                let drop_after =
                    (rng.next().is_multiple_of(4)).then(|| Duration::from_millis(rng.next() % 400));
                let call = app.clone().oneshot(request);
                let into = Arc::clone(&served);
                tasks.push(tokio::spawn(async move {
                    let response = match drop_after {
                        Some(after) => match tokio::time::timeout(after, call).await {
                            Ok(response) => response,
                            Err(_) => return,
                        },
                        None => call.await,
                    };
                    *into.lock().unwrap() = Some(response.unwrap().status());
                }));
                trace!(
                    "request s{subject} {} {route:?} drop after {drop_after:?}",
                    clock.now()
                );
                sent.push(Sent {
                    at: clock.now(),
                    subject,
                    route,
                    served,
                });
                // The request reaches its layers at its instant.
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
            }
            55..=74 => {
                let ms = rng.next() % 300;
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            75..=84 => {
                let mode = match rng.next() % 4 {
                    0 => Mode::Healthy,
                    1 => Mode::Slow,
                    2 => Mode::Late,
                    _ => Mode::Away,
                };
                store.state.lock().unwrap().mode = mode;
                trace!("mode {mode:?} at {}", clock.now());
            }
            85..=94 => {
                // The clock steps on: within a second, or across minutes
                // and first-use deadlines.
                let ms = if rng.next().is_multiple_of(3) {
                    5_000 + rng.next() % 70_000
                } else {
                    rng.next() % 1_000
                };
                clock.advance(SignedDuration::from_millis(ms as i64));
                trace!("clock {}", clock.now());
            }
            _ if variant.resets => {
                let subject = rng.next() % subjects as u64;
                let who = Subject::account(account(subject as usize));
                let reset = policy.handle().reset(&who).await;
                trace!("reset s{subject} at {}: {reset:?}", clock.now());
            }
            _ => {}
        }
        // At any point the test task runs, the ledger's metrics agree with
        // what it owes: each change to the book and its metrics is made
        // without an await between them.
        seen.read(snapshotter);
        let owed = policy.owed();
        if seen.counters != owed.counters as f64 || seen.open() != i128::from(owed.units) {
            broken.push(format!(
                "step {step}: metrics {seen:?} (open {}), ledger owes {owed:?}",
                seen.open()
            ));
            break;
        }
        if step % 60 == 59 || step == steps - 1 {
            quiet(
                &store,
                &policy,
                &memory,
                &quotas,
                &clock,
                &sent,
                &mut tasks,
                subjects,
                &mut broken,
                variant.exact(),
            )
            .await;
            seen.read(snapshotter);
            check_metrics(
                &seen,
                &store,
                &policy,
                &quotas,
                &sent,
                &mut broken,
                variant,
                true,
            );
            if !broken.is_empty() {
                break;
            }
        }
    }
    if !broken.is_empty() {
        return broken;
    }
    // The store goes away with debts owed, and the policy is dropped: what
    // its ledger owed is abandoned, and the gauge back to zero.
    store.state.lock().unwrap().mode = Mode::Away;
    for subject in 0..subjects {
        clock.advance(SignedDuration::from_millis(1));
        let request = Request::get("/ok")
            .header("x-account-id", account(subject))
            .body(Body::empty())
            .unwrap();
        let status = app.clone().oneshot(request).await.unwrap().status();
        sent.push(Sent {
            at: clock.now(),
            subject,
            route: Route::Ok,
            served: Arc::new(Mutex::new(Some(status))),
        });
    }
    for task in tasks.drain(..) {
        task.await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(rng.next() % 300)).await;
    let namespace = policy.namespace().clone();
    let keep = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store.clone())
        .namespace(namespace.as_str())
        .build();
    drop(app);
    drop(policy);
    tokio::time::sleep(Duration::from_secs(10)).await;
    seen.read(snapshotter);
    if seen.open() != 0 || seen.counters != 0.0 {
        broken.push(format!(
            "after the policy was dropped: {seen:?} (open {})",
            seen.open()
        ));
    }
    check_metrics(
        &seen,
        &store,
        &keep,
        &quotas,
        &sent,
        &mut broken,
        variant,
        false,
    );
    broken
}

#[allow(clippy::too_many_arguments)]
async fn quiet(
    store: &Flaky,
    policy: &QuotaPolicy<FromHeader, Flaky>,
    memory: &MemoryStore,
    quotas: &Quotas,
    clock: &ManualClock,
    sent: &[Sent],
    tasks: &mut Vec<tokio::task::JoinHandle<()>>,
    subjects: usize,
    broken: &mut Vec<String>,
    exact: bool,
) {
    store.state.lock().unwrap().mode = Mode::Healthy;
    for task in tasks.drain(..) {
        task.await.unwrap();
    }
    // Calls on their way land, give-backs never sent are sent again.
    tokio::time::sleep(Duration::from_secs(30)).await;
    let left = policy.settle_owed(Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    if left.units != 0 || policy.owed().units != 0 {
        broken.push(format!("owed at quiet: {left:?} then {:?}", policy.owed()));
    }
    if !exact {
        return;
    }
    let now = clock.now();
    trace!("quiet at {now}");
    let delivered = store.state.lock().unwrap().delivered.clone();
    let landed = store.state.lock().unwrap().landed.clone();
    // A give-back or an add the store never sent is sent again only while
    // its counter's period has more than 5 s left (`store::resend`): one
    // that failed in the last seconds of a period may never land. The
    // counters of periods that end within 10 s (5 s, and the last wait of
    // one sent again) are not checked.
    let soon = now.checked_add(SignedDuration::from_secs(10)).unwrap();
    let ns = policy.namespace();
    for subject in 0..subjects {
        let who = Subject::account(account(subject));
        // Calendar counters: exact.
        for (quota, inner) in [(&quotas.a, false), (&quotas.b, true), (&quotas.d, true)] {
            let line = quota.line(ns, &who, now, 1);
            if line.lifetime.end() <= soon {
                continue;
            }
            let key = line.key.as_str().to_owned();
            let used = memory
                .peek(ChargeRequest {
                    charged_at: None,
                    now,
                    lines: smallvec::smallvec![line],
                })
                .await
                .unwrap()[0]
                .used;
            let mut expected = 0;
            for s in sent.iter().filter(|s| s.subject == subject) {
                let Some(status) = *s.served.lock().unwrap() else {
                    continue;
                };
                // Which inner layer a route passed.
                // Which inner layer a route passed (every route passes the
                // outer one).
                let on_route = !inner
                    || match s.route {
                        Route::Deferred(_) => std::ptr::eq(quota, &quotas.d),
                        _ => !std::ptr::eq(quota, &quotas.d),
                    };
                if !on_route {
                    continue;
                }
                let at_key = quota.line(ns, &who, s.at, 1).key.as_str().to_owned();
                if at_key != key {
                    continue;
                }
                let charged = delivered.contains(&(s.at, key.clone()));
                expected += cost(s, status, inner, charged);
            }
            if used != expected && std::env::var("LEDGER_MODEL_TRACE").is_ok() {
                for s in sent.iter().filter(|s| s.subject == subject) {
                    let at_key = quota.line(ns, &who, s.at, 1).key.as_str().to_owned();
                    if at_key == key {
                        eprintln!(
                            "{} {:?} {:?} charged={}",
                            s.at,
                            s.route,
                            *s.served.lock().unwrap(),
                            delivered.contains(&(s.at, key.clone()))
                        );
                    }
                }
            }
            if used != expected {
                broken.push(format!(
                    "{} of s{subject} at {now}: store {used}, model {expected}",
                    quota.name()
                ));
            }
        }
        // The first-use counter: what was charged to its period, plus at
        // most the debts of requests within a period of its first call.
        let line = quotas.r.line(ns, &who, now, 1);
        let key = line.key.as_str().to_owned();
        let usage = memory
            .peek(ChargeRequest {
                charged_at: None,
                now,
                lines: smallvec::smallvec![line],
            })
            .await
            .unwrap()
            .remove(0);
        let Some(first) = usage.first_call else {
            continue;
        };
        let len = SignedDuration::from_secs(ROLLING as i64);
        let end = first.checked_add(len).unwrap();
        if end <= soon {
            continue;
        }
        let (mut low, mut high) = (0, 0);
        for s in sent.iter().filter(|s| s.subject == subject) {
            let Some(status) = *s.served.lock().unwrap() else {
                continue;
            };
            let charged = delivered.contains(&(s.at, key.clone()));
            let c = cost(s, status, false, charged);
            if std::env::var("LEDGER_MODEL_TRACE").is_ok() {
                eprintln!(
                    "r s{subject} {} {:?} {status} charged={charged} cost={c}",
                    s.at, s.route
                );
            }
            if charged {
                // In the counter it was charged to, whatever its instant:
                // a charge lands in the counter live when the store runs
                // it, which a settle may have opened at an earlier request
                // (README: "a period that starts at a request that did not
                // open one"), or a charge of a later instant.
                if landed.get(&(s.at, key.clone())).copied().flatten() == Some(first) {
                    low += c;
                    high += c;
                }
            } else if s.at > first.checked_sub(len).unwrap() && s.at < end {
                // A debt lands in the counter live when it is settled,
                // which its request's period may not be (README "Two cases
                // count otherwise"), or is dropped once its period is over.
                high += c;
            }
        }
        if usage.used < low || usage.used > high {
            broken.push(format!(
                "{} of s{subject} at {now} (first call {first}): store {}, model {low}..={high}",
                quotas.r.name(),
                usage.used
            ));
        }
    }
}

/// At a quiet point: the ledger took on what the served requests whose
/// charges failed owe, per line; what it settled is what the store
/// answered settled; the rest was dropped, for periods over (nothing is
/// full, refused, abandoned or reset here); and it owes no counter.
#[allow(clippy::too_many_arguments)] // The quiet point's whole state.
fn check_metrics(
    seen: &LedgerMetrics,
    store: &Flaky,
    policy: &QuotaPolicy<FromHeader, Flaky>,
    quotas: &Quotas,
    sent: &[Sent],
    broken: &mut Vec<String>,
    variant: Variant,
    settled_all: bool,
) {
    let ns = policy.namespace();
    let delivered = store.state.lock().unwrap().delivered.clone();
    let mut owed = 0u64;
    for s in sent {
        let Some(status) = *s.served.lock().unwrap() else {
            continue;
        };
        let who = Subject::account(account(s.subject));
        let inner = match s.route {
            Route::Deferred(_) => &quotas.d,
            _ => &quotas.b,
        };
        for (quota, is_inner) in [(&quotas.a, false), (&quotas.r, false), (inner, true)] {
            let key = quota.line(ns, &who, s.at, 1).key.as_str().to_owned();
            if !delivered.contains(&(s.at, key)) {
                owed += cost(s, status, is_inner, false);
            }
        }
    }
    let settled = store.state.lock().unwrap().settled;
    if std::env::var_os("LEDGER_MODEL_METRICS").is_some() {
        eprintln!("quiet: owed {owed}, {seen:?}");
    }
    let ctx = format!("metrics {seen:?}; model owed {owed}, store settled {settled}");
    // Dropped as full: never taken on.
    if seen.owed + seen.dropped("full") != owed {
        broken.push(format!(
            "owed_total + full {} != model {owed}: {ctx}",
            seen.owed
        ));
    }
    if seen.settled != settled {
        broken.push(format!(
            "settled_total {} != store {settled}: {ctx}",
            seen.settled
        ));
    }
    if seen.open() != 0 || seen.counters != 0.0 {
        broken.push(format!("not all accounted for at quiet: {ctx}"));
    }
    let mut none = vec!["refused"];
    if settled_all {
        none.push("abandoned");
    }
    if !variant.resets {
        none.push("reset");
    }
    if variant.max_owed.is_none() {
        none.push("full");
    }
    for reason in none {
        if seen.dropped(reason) != 0 {
            broken.push(format!("dropped {reason}: {ctx}"));
        }
    }
}

fn runs(seeds: std::ops::Range<u64>, steps: usize, variant: Variant) {
    let seeds = match std::env::var("LEDGER_MODEL_SEEDS") {
        Ok(n) => seeds.start..seeds.start + n.parse::<u64>().expect("a number of seeds"),
        Err(_) => seeds,
    };
    let only = std::env::var("LEDGER_MODEL_ONLY")
        .ok()
        .map(|s| s.parse::<u64>().unwrap());
    let mut failed = Vec::new();
    for seed in seeds {
        if only.is_some_and(|only| only != seed) {
            continue;
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let broken = metrics::with_local_recorder(&recorder, || {
            runtime.block_on(run(seed, steps, &snapshotter, variant))
        });
        if !broken.is_empty() {
            failed.push((seed, broken));
        }
    }
    assert!(
        failed.is_empty(),
        "{} seeds broke; the first: {:#?}",
        failed.len(),
        &failed[..failed.len().min(4)]
    );
}

#[test]
fn fail_open_admissions_are_counted_once() {
    runs(0..40, 300, Variant::default());
}

#[test]
fn ledger_metrics_match_with_resets_and_a_small_bound() {
    runs(
        1_000..1_040,
        300,
        Variant {
            resets: true,
            max_owed: Some(3),
        },
    );
}

#[test]
fn ledger_metrics_match_with_resets() {
    runs(
        2_000..2_040,
        300,
        Variant {
            resets: true,
            max_owed: None,
        },
    );
}
