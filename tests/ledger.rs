//! Requests that pass on a failed charge (fail open) are counted once the
//! store answers: what they owe, through real layers on the memory store
//! behind a store rigged to fail, the ledger's bound, and debts of periods
//! that are over.

// This binary rigs stores to fail, never to stall.
#[allow(dead_code)]
mod rigged;

mod interest;

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use rigged::{Rig, Rigged};
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_quota::jiff::{SignedDuration, Timestamp};
use tower_quota::store::{ChargeOutcome, ChargeRequest, Debt, StoreErrorKind};
use tower_quota::{
    unrouted, FromHeader, ManualClock, MemoryStore, Namespace, OnStoreError, PeriodKey, Quota,
    QuotaPolicy, QuotaPolicyBuilder, QuotaStatus, Store, StoreError, Subject, Usage,
};

const NOW: &str = "2026-12-02T10:00:00Z";

fn call(path: &str, account: &str) -> Request<Body> {
    Request::get(path)
        .header("x-account-id", account)
        .body(Body::empty())
        .unwrap()
}

/// An app whose one route `policy` charges on a daily quota of `limit`.
fn daily_app<St: Store>(policy: &QuotaPolicy<FromHeader, St>, limit: u64) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(policy.layer(Quota::daily(limit)))
}

fn policy<St: Store>(store: St, clock: &ManualClock) -> QuotaPolicyBuilder<FromHeader, St> {
    QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .clock(clock.clone())
        .on_store_error(OnStoreError::FailOpen)
}

fn clock() -> ManualClock {
    ManualClock::new(NOW.parse().unwrap())
}

async fn used<St: Store>(policy: &QuotaPolicy<FromHeader, St>, account: &str, name: &str) -> u64 {
    let usage = policy
        .handle()
        .usage(&Subject::account(account))
        .await
        .unwrap();
    usage.iter().find(|u| u.name() == name).unwrap().used()
}

/// Waits (in the test runtime's time) until the policy's ledger owes
/// nothing.
async fn settled<St: Store>(policy: &QuotaPolicy<FromHeader, St>) {
    for _ in 0..1_000 {
        if policy.owed().units == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the ledger still owes {:?}", policy.owed());
}

async fn send(app: &Router, request: Request<Body>) -> StatusCode {
    app.clone().oneshot(request).await.unwrap().status()
}

#[tokio::test(start_paused = true)]
async fn a_request_passed_on_a_failed_charge_is_counted_once_the_store_answers() {
    let clock = clock();
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, None);
    store.away.store(true, Ordering::Relaxed);
    let policy = policy(store.clone(), &clock).build();
    let app = daily_app(&policy, 2);
    for _ in 0..5 {
        assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
    }
    let owed = policy.owed();
    assert_eq!((owed.counters, owed.units), (1, 5), "one counter owes five");
    // Still away a while: the ledger waits, and owes the same.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(policy.owed().units, 5);

    store.away.store(false, Ordering::Relaxed);
    settled(&policy).await;
    assert_eq!(
        used(&policy, "acme", "default-day").await,
        5,
        "past the limit: what was served"
    );
}

/// A ledger whose settling task went with its runtime (a side runtime shut
/// down while the store was away) settles from the policy's next request
/// on another runtime, though that request owes nothing: the store is
/// back, and no new debt would start a task.
#[test]
fn a_ledger_whose_runtime_shut_down_settles_from_the_next_request() {
    let clock = clock();
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("read"));
    store.away.store(true, Ordering::Relaxed);
    let policy = policy(store.clone(), &clock).build();
    let app = Router::new()
        .route(
            "/read",
            get(|| async { "read" }).route_layer(policy.layer(Quota::daily(10).allowance("read"))),
        )
        .route(
            "/write",
            get(|| async { "written" })
                .route_layer(policy.layer(Quota::daily(10).allowance("write"))),
        );
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    let first = runtime();
    first.block_on(async {
        for _ in 0..3 {
            assert_eq!(send(&app, call("/read", "acme")).await, StatusCode::OK);
        }
    });
    drop(first);
    assert_eq!(policy.owed().units, 3, "owed, and no task settles it");
    store.away.store(false, Ordering::Relaxed);
    runtime().block_on(async {
        assert_eq!(send(&app, call("/write", "acme")).await, StatusCode::OK);
        assert_eq!(policy.owed().units, 3, "the write owes nothing");
        settled(&policy).await;
        assert_eq!(used(&policy, "acme", "read-day").await, 3);
    });
}

#[tokio::test(start_paused = true)]
async fn the_policys_layers_further_in_owe_theirs_without_asking_the_store() {
    let clock = clock();
    let memory = MemoryStore::new();
    let store = Rigged::new(memory.clone(), Rig::Fail, Some("read"));
    let policy = policy(store, &clock).build();
    let search = Quota::per_minute(1).allowance("search");
    let app = Router::new()
        .route("/search", get(|| async { "found" }))
        .route_layer(policy.layer(search.clone()))
        .route_layer(policy.layer(Quota::daily(10).allowance("read")));
    // The search counter is at its limit: asked, the store would refuse.
    let now: Timestamp = NOW.parse().unwrap();
    let line = search.line(policy.namespace(), &Subject::account("acme"), now, 1);
    let request = ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![line],
    };
    assert!(memory.charge(request).await.unwrap().admitted);

    assert_eq!(send(&app, call("/search", "acme")).await, StatusCode::OK);
    settled(&policy).await;
    assert_eq!(used(&policy, "acme", "read-day").await, 1);
    assert_eq!(
        used(&policy, "acme", "search-minute").await,
        2,
        "owed without asking the store, past the limit"
    );
}

#[tokio::test(start_paused = true)]
async fn what_the_answer_changes_a_charge_it_changes_a_debt() {
    let clock = clock();
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, None);
    let policy = policy(store, &clock).refund_server_errors(true).build();
    let reached = Arc::new(Notify::new());
    let slow = {
        let reached = Arc::clone(&reached);
        move || async move {
            reached.notify_one();
            std::future::pending::<&'static str>().await
        }
    };
    let tokens = Router::new()
        .route(
            "/tokens",
            get(|| async { ([("x-tokens-used", "7")], "generated").into_response() }),
        )
        .route_layer(
            policy
                .layer(Quota::daily(1_000).allowance("tokens"))
                .deferred_cost(1, |response| {
                    response
                        .headers
                        .get("x-tokens-used")
                        .and_then(|v| v.to_str().ok()?.parse().ok())
                        .unwrap_or(1)
                }),
        );
    let app = Router::new()
        .route("/ok", get(|| async { "ok" }))
        .route("/fail", get(|| async { StatusCode::INTERNAL_SERVER_ERROR }))
        .route("/slow", get(slow))
        .merge(tokens)
        .fallback(unrouted::NotFound)
        .layer(policy.layer(Quota::daily(100).allowance("calls")));

    assert_eq!(send(&app, call("/ok", "acme")).await, StatusCode::OK);
    assert_eq!(
        send(&app, call("/fail", "acme")).await,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        send(&app, call("/nowhere", "acme")).await,
        StatusCode::NOT_FOUND
    );
    assert_eq!(send(&app, call("/tokens", "acme")).await, StatusCode::OK);
    // Dropped before its answer: not served.
    let pending = tokio::spawn(app.clone().oneshot(call("/slow", "acme")));
    reached.notified().await;
    pending.abort();
    assert!(pending.await.unwrap_err().is_cancelled());

    settled(&policy).await;
    assert_eq!(
        used(&policy, "acme", "calls-day").await,
        2,
        "/ok and /tokens; not the server error, the unrouted path nor the dropped request"
    );
    assert_eq!(
        used(&policy, "acme", "tokens-day").await,
        7,
        "the deferred cost"
    );
}

/// The handler sees a request that owes its charge as counted, at its
/// instant, with no entry for the quota it owes.
#[tokio::test(start_paused = true)]
async fn a_request_that_owes_its_charge_is_not_exempt() {
    let clock = clock();
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, None);
    let policy = policy(store, &clock).build();
    let app = Router::new()
        .route(
            "/",
            get(|status: QuotaStatus| async move {
                format!(
                    "exempt={} charged_at={:?} entries={}",
                    status.is_exempt(),
                    status.charged_at(),
                    status.entries().len()
                )
            }),
        )
        .layer(policy.layer(Quota::daily(2)));
    let response = app.oneshot(call("/", "acme")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = axum::body::to_bytes(response.into_body(), 1_000)
        .await
        .unwrap();
    assert_eq!(
        std::str::from_utf8(&body).unwrap(),
        format!("exempt=false charged_at=Some({NOW}) entries=0"),
        "the store did not say where the caller stands: no entry"
    );
    settled(&policy).await;
    assert_eq!(used(&policy, "acme", "default-day").await, 1);
}

#[tokio::test(start_paused = true)]
async fn a_refusal_by_another_policy_further_in_owes_nothing() {
    let clock = clock();
    let memory = MemoryStore::new();
    let failing = policy(Rigged::new(memory.clone(), Rig::Fail, None), &clock)
        .namespace("outer")
        .build();
    let inner = policy(memory, &clock).namespace("inner").build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(inner.layer(Quota::daily(1).allowance("burst")))
        .route_layer(failing.layer(Quota::daily(10).allowance("read")));
    assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
    assert_eq!(
        send(&app, call("/", "acme")).await,
        StatusCode::TOO_MANY_REQUESTS
    );
    settled(&failing).await;
    assert_eq!(
        used(&failing, "acme", "read-day").await,
        1,
        "the one served"
    );
}

#[tokio::test(start_paused = true)]
async fn without_a_ledger_a_request_passed_on_a_failed_charge_goes_uncounted() {
    let clock = clock();
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, None);
    let policy = policy(store, &clock).max_owed_counters(0).build();
    let app = daily_app(&policy, 2);
    for _ in 0..3 {
        assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
    }
    assert_eq!(policy.owed().units, 0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(used(&policy, "acme", "default-day").await, 0);
}

/// Every log line, at every level, with its fields, and the fields of
/// every span, as text.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<String>>>);

impl Logs {
    fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

struct Text<'a>(&'a mut String);

impl tracing::field::Visit for Text<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!(" {}={value:?}", field.name()));
    }
}

impl tracing::Subscriber for Logs {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let mut line = format!("span {}:", span.metadata().name());
        span.record(&mut Text(&mut line));
        self.0.lock().unwrap().push(line);
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        let mut line = String::from("span record:");
        values.record(&mut Text(&mut line));
        self.0.lock().unwrap().push(line);
    }
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut line = format!("{}:", event.metadata().level());
        event.record(&mut Text(&mut line));
        self.0.lock().unwrap().push(line);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Checks that no log line names one of the subjects `ids` or their
/// counters' `keys`.
fn assert_no_subject_in(logs: &[String], ids: &[&str], keys: &[PeriodKey]) {
    for line in logs {
        for id in ids {
            assert!(!line.contains(id), "a log names the subject {id}: {line}");
        }
        for key in keys {
            assert!(
                !line.contains(key.as_str()),
                "a log names the key {key:?}: {line}"
            );
        }
        // A key is shown with its subject hidden (`{account:#1a2b3c4d}`),
        // never whole.
        let mut rest = line.as_str();
        while let Some(at) = rest.find("{account:") {
            rest = &rest[at + "{account:".len()..];
            assert!(rest.starts_with('#'), "a log names a key: {line}");
        }
    }
}

/// The keys of `quota`'s counters of `ids` at `at`.
fn keys_of(quota: &Quota, ids: &[&str], at: &str) -> Vec<PeriodKey> {
    let at: Timestamp = at.parse().unwrap();
    ids.iter()
        .map(|id| quota.key(&Namespace::default(), &Subject::account(*id), at))
        .collect()
}

/// Runs `work` on a current-thread runtime with paused time, with a log
/// subscriber and (with the `metrics` feature) a metrics recorder of its
/// own; returns the logs and the ledger's counters.
fn observed<F: Future<Output = ()>>(work: impl FnOnce() -> F) -> (Vec<String>, Ledger) {
    let logs = Logs::default();
    let _guard = tracing::subscriber::set_default(logs.clone());
    let _interest = interest::every_subscriber_asked();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let ledger = metrics_of(|| runtime.block_on(work()));
    (logs.lines(), ledger)
}

/// The ledger's metrics: owed, settled, dropped by reason, and the gauge
/// of counters owed.
#[derive(Debug, Default, PartialEq, Eq)]
struct Ledger {
    owed: u64,
    settled: u64,
    full: u64,
    ended: u64,
    abandoned: u64,
    refused: u64,
    counters: i64,
}

#[cfg(feature = "metrics")]
fn metrics_of(work: impl FnOnce()) -> Ledger {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use tower_quota::metrics::{LEDGER_COUNTERS, LEDGER_DROPPED, LEDGER_OWED, LEDGER_SETTLED};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, work);
    let mut ledger = Ledger::default();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let n = match value {
            DebugValue::Counter(n) => n,
            DebugValue::Gauge(n) if key.name() == LEDGER_COUNTERS => {
                ledger.counters = n.into_inner() as i64;
                continue;
            }
            _ => continue,
        };
        let reason = key
            .labels()
            .find(|l| l.key() == "reason")
            .map(|l| l.value().to_owned());
        match (key.name(), reason.as_deref()) {
            (name, _) if name == LEDGER_OWED => ledger.owed += n,
            (name, _) if name == LEDGER_SETTLED => ledger.settled += n,
            (name, Some("full")) if name == LEDGER_DROPPED => ledger.full += n,
            (name, Some("ended")) if name == LEDGER_DROPPED => ledger.ended += n,
            (name, Some("abandoned")) if name == LEDGER_DROPPED => ledger.abandoned += n,
            (name, Some("refused")) if name == LEDGER_DROPPED => ledger.refused += n,
            _ => {}
        }
    }
    ledger
}

#[cfg(not(feature = "metrics"))]
fn metrics_of(work: impl FnOnce()) -> Ledger {
    work();
    Ledger::default()
}

/// The subjects of the test of the bound: ids no log line has otherwise.
const BOUND_IDS: [&str; 5] = ["acct-ann", "acct-bob", "acct-cyd", "acct-dee", "acct-eve"];

#[test]
fn debts_past_the_bound_are_dropped_logged_and_counted() {
    let memory = MemoryStore::new();
    let (logs, metrics) = observed(|| async {
        let clock = clock();
        let store = Rigged::new(memory.clone(), Rig::Fail, None);
        store.away.store(true, Ordering::Relaxed);
        let policy = policy(store.clone(), &clock).max_owed_counters(3).build();
        let app = daily_app(&policy, 10);
        let [a, b, c, d, e] = BOUND_IDS;
        for account in [a, b, c, d, e, a, e] {
            assert_eq!(send(&app, call("/", account)).await, StatusCode::OK);
        }
        let owed = policy.owed();
        assert_eq!(
            (owed.counters, owed.units),
            (3, 4),
            "a, b and c owed (a twice); d and e past the bound"
        );
        store.away.store(false, Ordering::Relaxed);
        settled(&policy).await;
        assert_eq!(used(&policy, a, "default-day").await, 2);
        assert_eq!(used(&policy, c, "default-day").await, 1);
        assert_eq!(used(&policy, d, "default-day").await, 0);
        assert_eq!(used(&policy, e, "default-day").await, 0);
    });
    let dropped: Vec<&String> = logs
        .iter()
        .filter(|l| l.contains("owes its maximum of counters"))
        .collect();
    assert_eq!(dropped.len(), 3, "{logs:#?}");
    assert!(dropped[0].contains("max_owed_counters=3"), "{logs:#?}");
    assert!(
        logs.iter().any(|l| l.contains("settled what requests")),
        "the settle is logged too: {logs:#?}"
    );
    let keys = keys_of(&Quota::daily(10), &BOUND_IDS, NOW);
    assert_no_subject_in(&logs, &BOUND_IDS, &keys);
    if cfg!(feature = "metrics") {
        assert_eq!(
            metrics,
            Ledger {
                owed: 4,
                settled: 4,
                full: 3,
                ended: 0,
                ..Ledger::default()
            }
        );
    }
}

#[test]
fn a_debt_of_a_window_that_ended_is_dropped_not_charged_to_the_next() {
    let memory = MemoryStore::new();
    let before_midnight = "2026-12-02T23:59:50Z";
    let daily = Quota::daily(10).allowance("daily");
    let hourly = Quota::rolling(10, Duration::from_secs(3_600)).allowance("hour");
    let (logs, metrics) = observed(|| async {
        let clock = ManualClock::new(before_midnight.parse().unwrap());
        let store = Rigged::new(memory.clone(), Rig::Fail, Some("daily"));
        store.away.store(true, Ordering::Relaxed);
        let policy = policy(store.clone(), &clock).build();
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(policy.layer(daily.clone()))
            .layer(policy.layer(hourly.clone()));
        assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
        assert_eq!(policy.owed().units, 1, "the day's charge");
        // The store answers again after midnight.
        clock.advance(SignedDuration::from_secs(20));
        store.away.store(false, Ordering::Relaxed);
        settled(&policy).await;
        assert_eq!(policy.owed().counters, 0);
        assert_eq!(
            memory.len(),
            1,
            "the hour's counter only: no counter for the day that ended"
        );
        assert_eq!(
            used(&policy, "acme", "daily-day").await,
            0,
            "nothing charged to the new day"
        );
    });
    assert!(
        logs.iter().any(|l| l.contains("periods that were over")),
        "{logs:#?}"
    );
    let mut keys = keys_of(&daily, &["acme"], before_midnight);
    keys.extend(keys_of(&hourly, &["acme"], before_midnight));
    assert_no_subject_in(&logs, &["acme"], &keys);
    if cfg!(feature = "metrics") {
        assert_eq!(
            metrics,
            Ledger {
                owed: 1,
                settled: 0,
                full: 0,
                ended: 1,
                ..Ledger::default()
            }
        );
    }
}

#[test]
fn what_a_dropped_policy_still_owes_is_counted_as_abandoned() {
    let (logs, metrics) = observed(|| async {
        let clock = clock();
        let store = Rigged::new(MemoryStore::new(), Rig::Fail, None);
        store.away.store(true, Ordering::Relaxed);
        let policy = policy(store, &clock).build();
        let app = daily_app(&policy, 10);
        for account in ["acct-a", "acct-b", "acct-a"] {
            assert_eq!(send(&app, call("/", account)).await, StatusCode::OK);
        }
        let owed = policy.owed();
        assert_eq!((owed.counters, owed.units), (2, 3));
        // The task tries, and waits.
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(app);
        drop(policy);
        tokio::time::sleep(Duration::from_secs(10)).await;
    });
    assert!(
        logs.iter()
            .any(|l| l.contains("dropped with its policy") && l.contains("units=3")),
        "{logs:#?}"
    );
    let ids = ["acct-a", "acct-b"];
    assert_no_subject_in(&logs, &ids, &keys_of(&Quota::daily(10), &ids, NOW));
    if cfg!(feature = "metrics") {
        assert_eq!(
            metrics,
            Ledger {
                owed: 3,
                abandoned: 3,
                counters: 0,
                ..Ledger::default()
            }
        );
    }
}

/// Sends `/` through `app`, dropped while a middleware between its layers
/// works on the answer: the request was not served, so what `outer`
/// charged (`big-day`) goes back, and `inner` (which failed open on
/// `read-day`) owes nothing.
async fn dropped_between_layers<A: Store, B: Store>(
    app: Router,
    outer: &QuotaPolicy<FromHeader, A>,
    inner: &QuotaPolicy<FromHeader, B>,
) {
    let timed_out =
        tokio::time::timeout(Duration::from_millis(100), app.oneshot(call("/", "acme"))).await;
    assert!(timed_out.is_err());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(used(outer, "acme", "big-day").await, 0, "outer: given back");
    inner.settle_owed(Duration::from_secs(1)).await;
    assert_eq!(
        used(inner, "acme", "read-day").await,
        0,
        "inner: owes nothing"
    );
}

/// An outer layer dropped before its response goes out (a middleware
/// between the layers still working) gives back its own charge and the
/// charges of the layers further in: the request was not served, and a
/// layer further in that failed open owes nothing either.
#[tokio::test(start_paused = true)]
async fn a_drop_between_layers_leaves_no_inner_debt() {
    let clock = clock();
    let outer = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(MemoryStore::new())
        .clock(clock.clone())
        .namespace("outer")
        .build();
    let inner = policy(Rigged::new(MemoryStore::new(), Rig::Fail, None), &clock)
        .namespace("inner")
        .build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(inner.layer(Quota::daily(10).allowance("read")))
        .route_layer(axum::middleware::from_fn(rigged::slow_after))
        .route_layer(outer.layer(Quota::daily(100).allowance("big")));
    dropped_between_layers(app, &outer, &inner).await;
}

/// The same with one policy: the outer quota charged, the inner one failed.
#[tokio::test(start_paused = true)]
async fn a_drop_between_layers_of_one_policy_leaves_no_inner_debt() {
    let clock = clock();
    let policy = policy(
        Rigged::new(MemoryStore::new(), Rig::Fail, Some("read")),
        &clock,
    )
    .build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(policy.layer(Quota::daily(10).allowance("read")))
        .route_layer(axum::middleware::from_fn(rigged::slow_after))
        .route_layer(policy.layer(Quota::daily(100).allowance("big")));
    dropped_between_layers(app, &policy, &policy).await;
}

/// Served through an outer layer that charged, a request that failed open
/// further in owes its charge once the outer layer lets go of it.
#[tokio::test(start_paused = true)]
async fn a_fail_open_inside_a_charging_layer_is_owed_once_served() {
    let clock = clock();
    let outer = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(MemoryStore::new())
        .clock(clock.clone())
        .namespace("outer")
        .build();
    let inner = policy(
        Rigged::new(MemoryStore::new(), Rig::Fail, Some("read")),
        &clock,
    )
    .namespace("inner")
    .build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(inner.layer(Quota::daily(10).allowance("read")))
        .route_layer(outer.layer(Quota::daily(100).allowance("big")));
    for _ in 0..3 {
        let response = app.clone().oneshot(call("/", "acme")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    inner.settle_owed(Duration::from_secs(1)).await;
    assert_eq!(
        used(&inner, "acme", "read-day").await,
        3,
        "counted once each"
    );
    assert_eq!(used(&outer, "acme", "big-day").await, 3);
}

/// Both layers failing open, each of its own policy: the inner one's debt
/// is owed once the outer one's response goes out, even while the handler
/// keeps the request's status (and the lines in it) past the response.
#[tokio::test(start_paused = true)]
async fn a_fail_open_inside_an_owing_layer_is_owed_once_served() {
    let clock = clock();
    let outer = policy(Rigged::new(MemoryStore::new(), Rig::Fail, None), &clock)
        .namespace("outer")
        .build();
    let inner = policy(Rigged::new(MemoryStore::new(), Rig::Fail, None), &clock)
        .namespace("inner")
        .build();
    let kept: Arc<Mutex<Option<QuotaStatus>>> = Arc::default();
    let handler = {
        let kept = Arc::clone(&kept);
        move |status: QuotaStatus| async move {
            *kept.lock().unwrap() = Some(status);
            "ok"
        }
    };
    let app = Router::new()
        .route("/", get(handler))
        .route_layer(inner.layer(Quota::daily(10).allowance("read")))
        .route_layer(outer.layer(Quota::daily(100).allowance("big")));
    assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
    outer.settle_owed(Duration::from_secs(1)).await;
    inner.settle_owed(Duration::from_secs(1)).await;
    assert_eq!(used(&outer, "acme", "big-day").await, 1);
    assert_eq!(
        used(&inner, "acme", "read-day").await,
        1,
        "served: the inner debt is owed, the status still kept"
    );
    assert!(kept.lock().unwrap().is_some());
}

/// A support reset while the ledger owes the caller's counter: the caller
/// starts afresh, and what requests of before the reset owe does not land
/// in the new counter (a charge of before is wiped by the reset too).
#[tokio::test(start_paused = true)]
async fn a_support_reset_forgets_what_the_caller_owed() {
    let clock = clock();
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, None);
    store.away.store(true, Ordering::Relaxed);
    let policy = policy(store.clone(), &clock).build();
    let app = daily_app(&policy, 10);
    for _ in 0..3 {
        assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
    }
    assert_eq!(send(&app, call("/", "zeta")).await, StatusCode::OK);
    assert_eq!(policy.owed().units, 4);
    policy
        .handle()
        .reset(&Subject::account("acme"))
        .await
        .unwrap();
    assert_eq!(policy.owed().units, 1, "only the other caller's");
    store.away.store(false, Ordering::Relaxed);
    settled(&policy).await;
    assert_eq!(used(&policy, "acme", "default-day").await, 0, "afresh");
    assert_eq!(used(&policy, "zeta", "default-day").await, 1);
}

/// A memory store whose calls fail or hang while told so: charges fail
/// (`failing`); settles hang a second and time out (`slow`), never answer
/// (`holding`), or fail at once (`away`); resets are never sent
/// (`resets_fail`), applied and answered as timed out (`resets_late`), or
/// applied and answered a second later (`resets_slow`); settles are
/// refused for good (`refusing`, an error of kind `Other`); `most`, when
/// set, is the most it counts exactly.
#[derive(Clone, Default)]
struct Gate {
    inner: MemoryStore,
    refusing: Arc<AtomicBool>,
    most: Option<u64>,
    failing: Arc<AtomicBool>,
    slow: Arc<AtomicBool>,
    holding: Arc<AtomicBool>,
    away: Arc<AtomicBool>,
    resets_fail: Arc<AtomicBool>,
    resets_late: Arc<AtomicBool>,
    resets_slow: Arc<AtomicBool>,
    /// Stands for another instance's client of the same counters: a store
    /// without an identity, whose policy's ledger a reset through another
    /// policy's handle in this process does not reach.
    elsewhere: bool,
}

fn unavailable(what: &'static str) -> StoreError {
    StoreError::new(StoreErrorKind::Unavailable, what)
}

impl Store for Gate {
    type ChargeFuture =
        std::pin::Pin<Box<dyn Future<Output = Result<ChargeOutcome, StoreError>> + Send>>;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        if self.failing.load(Ordering::SeqCst) {
            return Box::pin(std::future::ready(Err(unavailable("down"))));
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
        self.inner.refund(now, key, amount).await
    }
    async fn refund_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.refund_made_by(now, key, amount, made_by).await
    }
    async fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.add(now, key, amount).await
    }
    async fn add_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.add_made_by(now, key, amount, made_by).await
    }
    async fn add_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.add_made_at(now, key, amount, first_call).await
    }
    fn reset(&self, key: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let fail = self.resets_fail.load(Ordering::SeqCst);
        let late = self.resets_late.load(Ordering::SeqCst);
        let slow = self.resets_slow.load(Ordering::SeqCst);
        let inner = self.inner.clone();
        async move {
            if fail {
                // Away: never sent.
                return Err(unavailable("away").unsent());
            }
            let done = inner.reset(key).await;
            if late {
                // Applied, but answered too late (as a Redis reset past the
                // store's timeout, followed to its end).
                return Err(StoreError::new(StoreErrorKind::Timeout, "late"));
            }
            if slow {
                // Applied, and answered a second later.
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            done
        }
    }
    fn settle_debt(
        &self,
        now: Timestamp,
        debt: Debt,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        let (slow, hold) = (
            self.slow.load(Ordering::SeqCst),
            self.holding.load(Ordering::SeqCst),
        );
        let away = self.away.load(Ordering::SeqCst);
        let refusing = self.refusing.load(Ordering::SeqCst);
        let inner = self.inner.clone();
        async move {
            if away {
                return Err(unavailable("away"));
            }
            if refusing {
                return Err(StoreError::new(StoreErrorKind::Other, "no counter here"));
            }
            if slow {
                tokio::time::sleep(Duration::from_secs(1)).await;
                return Err(StoreError::new(StoreErrorKind::Timeout, "hung"));
            }
            if hold {
                std::future::pending::<()>().await;
            }
            inner.settle_debt(now, debt).await
        }
    }
    fn identity(&self) -> Option<usize> {
        if self.elsewhere {
            return None;
        }
        self.inner.identity()
    }
    fn max_count(&self) -> u64 {
        self.most.unwrap_or_else(|| self.inner.max_count())
    }
}

/// A support reset while the ledger's settle of the caller's counter is on
/// its way, and fails: what the reset forgot is not sent again into the
/// fresh counter.
#[tokio::test(start_paused = true)]
async fn a_support_reset_during_a_settle_that_fails_forgets_it_too() {
    let clock = clock();
    let store = Gate::default();
    store.failing.store(true, Ordering::SeqCst);
    store.slow.store(true, Ordering::SeqCst);
    let policy = policy(store.clone(), &clock).build();
    let app = daily_app(&policy, 10);
    for _ in 0..3 {
        assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
    }
    // The settle is on its way.
    tokio::time::sleep(Duration::from_millis(100)).await;
    policy
        .handle()
        .reset(&Subject::account("acme"))
        .await
        .unwrap();
    store.failing.store(false, Ordering::SeqCst);
    store.slow.store(false, Ordering::SeqCst);
    settled(&policy).await;
    assert_eq!(used(&policy, "acme", "default-day").await, 0, "afresh");
}

/// A policy on a `Gate` store that is away (charges and settles fail),
/// whose ledger owes three requests of `acme` on a daily quota of 100.
async fn owing_three() -> (Gate, QuotaPolicy<FromHeader, Gate>) {
    let store = Gate::default();
    store.failing.store(true, Ordering::SeqCst);
    store.away.store(true, Ordering::SeqCst);
    let policy = policy(store.clone(), &clock()).build();
    let app = daily_app(&policy, 100);
    for _ in 0..3 {
        assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
    }
    assert_eq!(policy.owed().units, 3);
    (store, policy)
}

/// A support reset that fails (the store is away, as it is while the
/// ledger owes) changes nothing: what the ledger owes is still settled.
#[tokio::test(start_paused = true)]
async fn a_failed_reset_forgets_nothing_the_ledger_owes() {
    let (store, policy) = owing_three().await;
    store.resets_fail.store(true, Ordering::SeqCst);
    let reset = policy.handle().reset(&Subject::account("acme")).await;
    assert!(reset.is_err());
    assert_eq!(
        policy.owed().units,
        3,
        "a reset that failed forgets nothing"
    );
    for flag in [&store.resets_fail, &store.away, &store.failing] {
        flag.store(false, Ordering::SeqCst);
    }
    assert_eq!(policy.settle_owed(Duration::from_secs(10)).await.units, 0);
    assert_eq!(used(&policy, "acme", "default-day").await, 3);
}

/// A reset the store applied but answered too late (a timeout, not a call
/// never sent) forgets what the ledger owed the counter, as one answered
/// in time: the debts of before it do not land in the fresh counter.
#[tokio::test(start_paused = true)]
async fn a_reset_applied_but_answered_late_forgets_what_was_owed() {
    let (store, policy) = owing_three().await;
    store.resets_late.store(true, Ordering::SeqCst);
    let reset = policy.handle().reset(&Subject::account("acme")).await;
    assert!(reset.is_err());
    for flag in [&store.resets_late, &store.away, &store.failing] {
        flag.store(false, Ordering::SeqCst);
    }
    assert_eq!(policy.settle_owed(Duration::from_secs(10)).await.units, 0);
    assert_eq!(
        used(&policy, "acme", "default-day").await,
        0,
        "the counter was reset: what was owed before it is not counted in the fresh one"
    );
}

/// A reset whose future is dropped once the store applied it (support's
/// client gone before the answer) forgets what the ledger owed the
/// counter, as one answered: the debts of before it do not land in the
/// fresh counter.
#[tokio::test(start_paused = true)]
async fn a_reset_dropped_on_its_way_forgets_what_was_owed() {
    let (store, policy) = owing_three().await;
    store.resets_slow.store(true, Ordering::SeqCst);
    let handle = policy.handle();
    let subject = Subject::account("acme");
    let dropped = tokio::time::timeout(Duration::from_millis(10), handle.reset(&subject)).await;
    assert!(dropped.is_err(), "dropped before its answer");
    for flag in [&store.resets_slow, &store.away, &store.failing] {
        flag.store(false, Ordering::SeqCst);
    }
    assert_eq!(policy.settle_owed(Duration::from_secs(10)).await.units, 0);
    assert_eq!(used(&policy, "acme", "default-day").await, 0);
}

/// No settle starts while a reset is on its way (the counter deleted, its
/// answer not yet in): the debts of before it would land in the fresh
/// counter.
#[tokio::test(start_paused = true)]
async fn no_settle_starts_while_a_reset_is_on_its_way() {
    let (store, policy) = owing_three().await;
    store.resets_slow.store(true, Ordering::SeqCst);
    let handle = policy.handle();
    let subject = Subject::account("acme");
    // The store comes back while the reset is on its way.
    let (reset, ()) = tokio::join!(handle.reset(&subject), async {
        tokio::time::sleep(Duration::from_millis(10)).await;
        store.away.store(false, Ordering::SeqCst);
        store.failing.store(false, Ordering::SeqCst);
    });
    reset.unwrap();
    store.resets_slow.store(false, Ordering::SeqCst);
    assert_eq!(policy.settle_owed(Duration::from_secs(10)).await.units, 0);
    assert_eq!(used(&policy, "acme", "default-day").await, 0);
}

/// A support reset while the ledger's settle is on its way, whose runtime
/// then shuts down (the settle dropped before it answered): what the reset
/// forgot stays forgotten, as when the settle fails, and is not settled
/// into the fresh counter from the next runtime.
#[test]
fn a_reset_during_a_settle_whose_runtime_shuts_down_stays_forgotten() {
    let clock = clock();
    let store = Gate::default();
    store.failing.store(true, Ordering::SeqCst);
    store.holding.store(true, Ordering::SeqCst);
    let policy = policy(store.clone(), &clock).store_timeout(None).build();
    let app = daily_app(&policy, 100);
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap()
    };
    runtime().block_on(async {
        for _ in 0..3 {
            assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
        }
        // The settle is on its way, and never answers.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(policy.owed().units, 3);
        policy
            .handle()
            .reset(&Subject::account("acme"))
            .await
            .unwrap();
    });
    store.failing.store(false, Ordering::SeqCst);
    store.holding.store(false, Ordering::SeqCst);
    runtime().block_on(async {
        assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
        settled(&policy).await;
        assert_eq!(
            used(&policy, "acme", "default-day").await,
            1,
            "only the request after the reset counts in the fresh counter"
        );
    });
}

/// Another instance's debt, settled after a support reset, makes the
/// fresh counter: a handler's `refund_request` of a request charged to the
/// counter before the reset must not take that admission off.
#[tokio::test(start_paused = true)]
async fn refund_request_never_lands_on_a_counter_made_anew_by_a_settle() {
    let clock = clock();
    let memory = MemoryStore::new();
    let away = Gate {
        inner: memory.clone(),
        elsewhere: true,
        ..Gate::default()
    };
    away.failing.store(true, Ordering::SeqCst);
    away.away.store(true, Ordering::SeqCst);
    let a = policy(memory.clone(), &clock).build();
    let b = policy(away.clone(), &clock).build();
    let kept: Arc<Mutex<Option<QuotaStatus>>> = Arc::default();
    let a_app = {
        let kept = Arc::clone(&kept);
        let handler = move |status: QuotaStatus| {
            *kept.lock().unwrap() = Some(status);
            async { "ok" }
        };
        Router::new()
            .route("/", get(handler))
            .layer(a.layer(Quota::daily(100)))
    };
    let b_app = daily_app(&b, 100);
    // B's request passes on a failed charge; a second later A's request
    // makes the counter; support resets it.
    assert_eq!(send(&b_app, call("/", "acme")).await, StatusCode::OK);
    assert_eq!(b.owed().units, 1);
    clock.advance(Duration::from_secs(1));
    assert_eq!(send(&a_app, call("/", "acme")).await, StatusCode::OK);
    a.handle().reset(&Subject::account("acme")).await.unwrap();
    // A moment later B's store is back: its debt makes the fresh counter.
    clock.advance(Duration::from_millis(1));
    away.away.store(false, Ordering::SeqCst);
    away.failing.store(false, Ordering::SeqCst);
    settled(&b).await;
    assert_eq!(used(&a, "acme", "default-day").await, 1);
    let status = kept.lock().unwrap().take().unwrap();
    let refunded = a.handle().refund_request(&status).await.unwrap();
    assert_eq!(
        refunded,
        [None],
        "the counter A's request was charged to is gone"
    );
    assert_eq!(
        used(&a, "acme", "default-day").await,
        1,
        "B's admission stays counted"
    );
}

/// A handler that keeps its `QuotaStatus` past the request (an audit task,
/// a cache): what a fail-open layer nested in a charging one owes goes to
/// the ledger once the response went out all the same.
#[tokio::test(start_paused = true)]
async fn a_nested_debt_is_owed_once_the_response_went_out_whoever_keeps_the_status() {
    let clock = clock();
    let outer = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(MemoryStore::new())
        .clock(clock.clone())
        .namespace("outer")
        .build();
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, None);
    store.away.store(true, Ordering::Relaxed);
    let inner = policy(store, &clock).namespace("inner").build();
    let kept: Arc<Mutex<Vec<QuotaStatus>>> = Arc::default();
    let app = Router::new()
        .route(
            "/",
            get({
                let kept = Arc::clone(&kept);
                move |status: QuotaStatus| async move {
                    kept.lock().unwrap().push(status);
                    "ok"
                }
            }),
        )
        .route_layer(inner.layer(Quota::daily(10).allowance("read")))
        .route_layer(outer.layer(Quota::daily(100).allowance("big")));
    for _ in 0..3 {
        assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
    }
    assert_eq!(inner.owed().units, 3, "owed while the statuses are kept");
    assert_eq!(kept.lock().unwrap().len(), 3);
}

/// A middleware between two layers that works on after the inner one
/// answered, with the outer layer failed open (it owes, charges nothing):
/// dropped there, the request was not served, and the inner layer's debt
/// or charge goes too.
#[tokio::test(start_paused = true)]
async fn a_drop_inside_a_layer_that_failed_open_leaves_nothing_further_in() {
    let clock = clock();
    let outer_store = Rigged::new(MemoryStore::new(), Rig::Fail, None);
    outer_store.away.store(true, Ordering::Relaxed);
    let outer = policy(outer_store.clone(), &clock)
        .namespace("outer")
        .build();
    let failing = Rigged::new(MemoryStore::new(), Rig::Fail, None);
    let owing_inside = policy(failing.clone(), &clock).namespace("inner").build();
    let charging_inside = policy(MemoryStore::new(), &clock)
        .namespace("charged")
        .build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(charging_inside.layer(Quota::daily(10).allowance("write")))
        .route_layer(owing_inside.layer(Quota::daily(10).allowance("read")))
        .route_layer(axum::middleware::from_fn(rigged::slow_after))
        .route_layer(outer.layer(Quota::daily(100).allowance("big")));
    let timed_out =
        tokio::time::timeout(Duration::from_millis(100), app.oneshot(call("/", "acme"))).await;
    assert!(timed_out.is_err());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        used(&charging_inside, "acme", "write-day").await,
        0,
        "given back"
    );
    outer_store.away.store(false, Ordering::Relaxed);
    outer.settle_owed(Duration::from_secs(1)).await;
    owing_inside.settle_owed(Duration::from_secs(1)).await;
    assert_eq!(owing_inside.owed().units, 0);
    assert_eq!(
        used(&owing_inside, "acme", "read-day").await,
        0,
        "owes nothing"
    );
    assert_eq!(used(&outer, "acme", "big-day").await, 0, "owes nothing");
}

/// The same layers, the request served: the inner charge stays, and every
/// layer that failed open owes its charge.
#[tokio::test(start_paused = true)]
async fn a_request_served_inside_a_layer_that_failed_open_counts_everywhere() {
    let clock = clock();
    let outer_store = Rigged::new(MemoryStore::new(), Rig::Fail, None);
    outer_store.away.store(true, Ordering::Relaxed);
    let outer = policy(outer_store.clone(), &clock)
        .namespace("outer")
        .build();
    let failing = Rigged::new(MemoryStore::new(), Rig::Fail, None);
    failing.away.store(true, Ordering::Relaxed);
    let owing_inside = policy(failing.clone(), &clock).namespace("inner").build();
    let charging_inside = policy(MemoryStore::new(), &clock)
        .namespace("charged")
        .build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(charging_inside.layer(Quota::daily(10).allowance("write")))
        .route_layer(owing_inside.layer(Quota::daily(10).allowance("read")))
        .route_layer(outer.layer(Quota::daily(100).allowance("big")));
    assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
    assert_eq!(used(&charging_inside, "acme", "write-day").await, 1);
    assert_eq!(owing_inside.owed().units, 1);
    assert_eq!(outer.owed().units, 1);
    outer_store.away.store(false, Ordering::Relaxed);
    failing.away.store(false, Ordering::Relaxed);
    settled(&outer).await;
    settled(&owing_inside).await;
    assert_eq!(used(&owing_inside, "acme", "read-day").await, 1);
    assert_eq!(used(&outer, "acme", "big-day").await, 1);
}

/// A support reset forgets what requests made before it owe, whether they
/// were answered before it or are answered after it: a request in flight
/// across the reset is not settled into the counter made since.
#[tokio::test(start_paused = true)]
async fn a_request_made_before_a_reset_and_answered_after_it_owes_nothing() {
    let clock = clock();
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, None);
    store.away.store(true, Ordering::Relaxed);
    let policy = policy(store.clone(), &clock).build();
    let gate = Arc::new(Notify::new());
    let slow = {
        let gate = Arc::clone(&gate);
        move || async move {
            gate.notified().await;
            "ok"
        }
    };
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/slow", get(slow))
        .layer(policy.layer(Quota::daily(10)));
    assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
    let pending = tokio::spawn(app.clone().oneshot(call("/slow", "acme")));
    tokio::time::sleep(Duration::from_millis(10)).await;
    clock.advance(Duration::from_secs(1));
    policy
        .handle()
        .reset(&Subject::account("acme"))
        .await
        .unwrap();
    assert_eq!(policy.owed().units, 0, "the answered request is forgotten");
    gate.notify_one();
    assert_eq!(pending.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(
        policy.owed().units,
        0,
        "so is the one answered after the reset"
    );
    // A request made after the reset owes its charge.
    assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
    store.away.store(false, Ordering::Relaxed);
    policy.settle_owed(Duration::from_secs(5)).await;
    assert_eq!(used(&policy, "acme", "default-day").await, 1);
}

/// A support reset applied at once and answered a second later: a request
/// made meanwhile (after the reset was sent) passes on a failed charge. It
/// was not made before the reset: what it owes is settled into the fresh
/// counter, and does not go with what requests of before the reset owed.
#[tokio::test(start_paused = true)]
async fn a_request_made_while_a_reset_is_on_its_way_owes_its_charge() {
    let clock = clock();
    let store = Gate::default();
    store.failing.store(true, Ordering::SeqCst);
    store.away.store(true, Ordering::SeqCst);
    let policy = policy(store.clone(), &clock).build();
    let app = daily_app(&policy, 100);
    for _ in 0..3 {
        assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
    }
    assert_eq!(policy.owed().units, 3);
    clock.advance(Duration::from_secs(1));
    store.resets_slow.store(true, Ordering::SeqCst);
    let handle = policy.handle();
    let reset = tokio::spawn(async move { handle.reset(&Subject::account("acme")).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    clock.advance(Duration::from_millis(100));
    // Made after the reset was sent: fail open.
    assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
    reset.await.unwrap().unwrap();
    assert_eq!(
        policy.owed().units,
        1,
        "what requests of before the reset owed is forgotten, not the one made since"
    );
    for flag in [&store.away, &store.failing] {
        flag.store(false, Ordering::SeqCst);
    }
    assert_eq!(policy.settle_owed(Duration::from_secs(10)).await.units, 0);
    assert_eq!(used(&policy, "acme", "default-day").await, 1);
}

/// A debt the store refuses for good (an error that is no outage) is
/// dropped as `refused`, not retried, and not counted as a period that
/// ended.
#[test]
fn a_debt_the_store_refuses_is_dropped_as_refused() {
    let (_, metrics) = observed(|| async {
        let store = Gate::default();
        store.failing.store(true, Ordering::SeqCst);
        store.away.store(true, Ordering::SeqCst);
        let policy = policy(store.clone(), &clock()).build();
        let app = daily_app(&policy, 100);
        for _ in 0..3 {
            assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
        }
        store.refusing.store(true, Ordering::SeqCst);
        store.away.store(false, Ordering::SeqCst);
        settled(&policy).await;
        assert_eq!(used(&policy, "acme", "default-day").await, 0);
    });
    if cfg!(feature = "metrics") {
        assert_eq!(
            metrics,
            Ledger {
                owed: 3,
                refused: 3,
                counters: 0,
                ..Ledger::default()
            }
        );
    }
}

/// A debt beyond what the store counts exactly (a deferred cost past
/// `max_count`, owed while the store was away): what the store can hold is
/// settled, the rest owed and dropped as `refused` at once, so that
/// `owed = settled + dropped` still holds.
#[test]
fn a_debt_past_what_the_store_counts_is_owed_and_dropped_in_part() {
    let (logs, metrics) = observed(|| async {
        let store = Gate {
            most: Some(100),
            ..Gate::default()
        };
        store.failing.store(true, Ordering::SeqCst);
        let policy = policy(store.clone(), &clock()).build();
        let app = Router::new()
            .route(
                "/",
                get(|| async { ([("x-tokens-used", "150")], "generated").into_response() }),
            )
            .route_layer(
                policy
                    .layer(Quota::daily(100))
                    .deferred_cost(1, |response| {
                        response
                            .headers
                            .get("x-tokens-used")
                            .and_then(|v| v.to_str().ok()?.parse().ok())
                            .unwrap_or(1)
                    }),
            );
        assert_eq!(send(&app, call("/", "acme")).await, StatusCode::OK);
        assert_eq!(policy.owed().units, 100, "what the store counts");
        settled(&policy).await;
        assert_eq!(used(&policy, "acme", "default-day").await, 100);
    });
    assert!(
        logs.iter()
            .any(|l| l.contains("owes more than the store counts")),
        "{logs:#?}"
    );
    if cfg!(feature = "metrics") {
        assert_eq!(
            metrics,
            Ledger {
                owed: 101,
                settled: 100,
                refused: 1,
                counters: 0,
                ..Ledger::default()
            }
        );
    }
}
