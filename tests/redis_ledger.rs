//! Every admission counted on a real `redis-server`: requests that pass on
//! a failed charge (fail open) through a stall and through an outage are
//! counted once Redis answers, a fail-closed refusal stays uncharged, and
//! debts keep to their periods.

#![cfg(feature = "redis")]

mod demo_server;
mod redis_support;

use std::future::IntoFuture;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_quota::jiff::{SignedDuration, Timestamp};
use tower_quota::store::{Debt, LeasedStore, Lifetime, RedisStore, Store, StoreErrorKind};
use tower_quota::{
    FromHeader, ManualClock, Namespace, OnStoreError, PeriodKey, Quota, QuotaPolicy, Subject,
};

use redis_support::{redis_available, RedisServer, Stopped};

fn account() -> FromHeader {
    FromHeader::account("x-account-id")
}

fn call(account: &str) -> Request<Body> {
    Request::get("/")
        .header("x-account-id", account)
        .body(Body::empty())
        .unwrap()
}

async fn send(app: &Router, account: &str) -> StatusCode {
    app.clone().oneshot(call(account)).await.unwrap().status()
}

/// An app whose one route `policy` charges on `quota`.
fn served<St: tower_quota::store::Store>(
    policy: &QuotaPolicy<FromHeader, St>,
    quota: &Quota,
) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(policy.layer(quota.clone()))
}

/// The key of `quota`'s counter for `account` at `at`, in the default
/// namespace.
fn key_of(quota: &Quota, account: &str, at: Timestamp) -> PeriodKey {
    quota.key(&Namespace::default(), &Subject::account(account), at)
}

/// The counter's count as Redis holds it ("" when there is none).
fn used(server: &RedisServer, key: &PeriodKey) -> String {
    server.cli(&["hget", key.as_str(), "n"])
}

/// Waits until the policy's ledger owes nothing and the store has no call
/// in flight (every late charge given back), both at once.
async fn settled<E>(policy: &QuotaPolicy<E, RedisStore>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if policy.owed().units == 0 && policy.store().in_flight() == 0 {
            // Once more after a moment: a give-back may start a settle.
            tokio::time::sleep(Duration::from_millis(50)).await;
            if policy.owed().units == 0 && policy.store().in_flight() == 0 {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "still owed {:?}, {} calls in flight",
            policy.owed(),
            policy.store().in_flight()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What 20 callers saw, each sending requests over HTTP (a connection per
/// request) until told to stop.
#[derive(Debug, Default)]
struct Seen {
    ok: u64,
    refused: u64,
    unavailable: u64,
    other: Vec<u16>,
}

/// Serves `app` over HTTP on a loopback port, sends from 20 callers while
/// Redis stalls for 1.5 s (`DEBUG SLEEP`, far past the store's timeouts)
/// in the middle, and returns what they saw and the most the policy's
/// ledger owed meanwhile.
async fn twenty_callers_through_a_stall<E>(
    server: &RedisServer,
    policy: &QuotaPolicy<E, RedisStore>,
    app: Router,
) -> (Seen, u64) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let serving = tokio::spawn(axum::serve(listener, app).into_future());
    let stop = Arc::new(AtomicBool::new(false));
    let mut callers = tokio::task::JoinSet::new();
    for _ in 0..20 {
        let stop = Arc::clone(&stop);
        let addr = addr.clone();
        callers.spawn(async move {
            let mut seen = Seen::default();
            while !stop.load(Ordering::Relaxed) {
                let reply = demo_server::call(&addr, "GET", "/", &[("x-account-id", "acme")]).await;
                match reply.status {
                    200 => seen.ok += 1,
                    429 => seen.refused += 1,
                    503 => seen.unavailable += 1,
                    other => seen.other.push(other),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            seen
        });
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let port = server.port();
    let stall =
        tokio::task::spawn_blocking(move || redis_support::cli(port, &["debug", "sleep", "1.5"]));
    let mut owed = 0;
    while !stall.is_finished() {
        owed = owed.max(policy.owed().units);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(stall.await.unwrap(), "OK");
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let mut seen = Seen::default();
    while let Some(one) = callers.join_next().await {
        let one = one.unwrap();
        seen.ok += one.ok;
        seen.refused += one.refused;
        seen.unavailable += one.unavailable;
        seen.other.extend(one.other);
    }
    serving.abort();
    (seen, owed)
}

fn stalling_server() -> Option<RedisServer> {
    redis_available().then(|| RedisServer::start_with(&["--enable-debug-command", "yes"]))
}

/// A Redis store of `server`, its script loaded.
async fn preloaded(server: &RedisServer) -> RedisStore {
    let store = RedisStore::new(server.url()).unwrap();
    store.preload().await.unwrap();
    store
}

/// A fail-open policy on a Redis store of `server`, its script loaded.
async fn fail_open_on(server: &RedisServer) -> QuotaPolicy<FromHeader, RedisStore> {
    QuotaPolicy::builder(account())
        .store(preloaded(server).await)
        .on_store_error(OnStoreError::FailOpen)
        .build()
}

/// Fail open through a stall, on a daily quota of `limit`: afterwards the
/// counter holds the 200s, exactly. What the callers saw, and the store.
async fn fail_open_through_a_stall(limit: u64) -> (Seen, RedisStore) {
    let server = stalling_server().expect("checked by the caller");
    let policy = fail_open_on(&server).await;
    let quota = Quota::daily(limit);
    let app = served(&policy, &quota);
    let (seen, owed) = twenty_callers_through_a_stall(&server, &policy, app).await;
    assert!(seen.other.is_empty(), "{seen:?}");
    assert!(owed > 0, "requests passed on failed charges: {seen:?}");

    settled(&policy).await;
    let key = key_of(&quota, "acme", Timestamp::now());
    assert_eq!(
        used(&server, &key),
        seen.ok.to_string(),
        "every admission counted, once: {seen:?}, {:?}",
        policy.store()
    );
    (seen, policy.store().clone())
}

/// The charges that timed out during the stall had room: Redis applies
/// them late, and they are given back while their requests' debts are
/// settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_through_a_stall_counts_every_admission() {
    if !redis_available() {
        return;
    }
    let (seen, store) = fail_open_through_a_stall(1_000_000).await;
    assert_eq!(seen.refused, 0, "{seen:?}");
    assert!(
        store.given_back() > 0,
        "late charges were given back: {store:?}"
    );
}

/// The limit is reached before the stall: what passes during it takes the
/// count past the limit, which then says what was served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_through_a_stall_at_the_limit_counts_past_it() {
    if !redis_available() {
        return;
    }
    let (seen, _) = fail_open_through_a_stall(100).await;
    assert!(seen.refused > 0, "{seen:?}");
    assert!(seen.ok > 100, "past the limit during the stall: {seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_through_a_stall_leaves_its_refusals_uncharged() {
    let Some(server) = stalling_server() else {
        return;
    };
    let store = RedisStore::new(server.url()).unwrap();
    store.preload().await.unwrap();
    let policy = QuotaPolicy::builder(account()).store(store).build();
    let quota = Quota::daily(1_000_000);
    let app = served(&policy, &quota);
    let (seen, owed) = twenty_callers_through_a_stall(&server, &policy, app).await;
    assert!(seen.other.is_empty() && seen.refused == 0, "{seen:?}");
    assert!(seen.unavailable > 0, "503s during the stall: {seen:?}");
    assert_eq!(owed, 0, "a refusal owes nothing");

    settled(&policy).await;
    let key = key_of(&quota, "acme", Timestamp::now());
    assert_eq!(
        used(&server, &key),
        seen.ok.to_string(),
        "the 200s only: {seen:?}, {:?}",
        policy.store()
    );
}

/// A settle sent into a stall, which times out, may have been added:
/// `owed()` tells its units apart (`unanswered`) until Redis, resumed,
/// counts them once, the settle sent again finding its mark. A settle
/// that never left (Redis down, the connection refused) is not among
/// them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_without_an_answer_is_owed_as_unanswered() {
    let Some(server) = stalling_server() else {
        return;
    };
    let policy = fail_open_on(&server).await;
    let quota = Quota::daily(100);
    let app = served(&policy, &quota);
    let port = server.port();
    let stall =
        tokio::task::spawn_blocking(move || redis_support::cli(port, &["debug", "sleep", "2"]));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(send(&app, "acme").await, StatusCode::OK, "fail open");
    let deadline = Instant::now() + Duration::from_millis(1_500);
    while policy.owed().unanswered == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let owed = policy.owed();
    assert_eq!(
        (owed.units, owed.unanswered),
        (1, 1),
        "a settle timed out: {owed:?}"
    );
    assert_eq!(send(&app, "acme").await, StatusCode::OK, "fail open");
    let owed = policy.owed();
    assert_eq!(
        (owed.units, owed.unanswered),
        (2, 1),
        "owed since the settle left, not in it: {owed:?}"
    );
    assert_eq!(stall.await.unwrap(), "OK");
    settled(&policy).await;
    let key = key_of(&quota, "acme", Timestamp::now());
    assert_eq!(used(&server, &key), "2", "counted once");

    // No server on the port at all: every settle fails unsent. (One sent
    // on a connection a killed server broke may have landed.)
    let nowhere = format!("redis://127.0.0.1:{}/", redis_support::free_port());
    let policy = QuotaPolicy::builder(account())
        .store(RedisStore::new(&nowhere).unwrap())
        .on_store_error(OnStoreError::FailOpen)
        .build();
    let app = served(&policy, &quota);
    assert_eq!(send(&app, "acme").await, StatusCode::OK, "fail open");
    let mut owed = policy.settle_owed(Duration::from_millis(300)).await;
    // Read between two tries: one on its way (for a moment) may land.
    for _ in 0..50 {
        if owed.unanswered == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(7)).await;
        owed = policy.owed();
    }
    assert_eq!(
        (owed.units, owed.unanswered),
        (1, 0),
        "Redis unreachable: no settle reached it: {owed:?}"
    );
}

/// What the README's graceful shutdown awaits (`settle_owed`, then the
/// process exits) leaves no charge behind: requests answered while Redis
/// stalled (503, fail closed; fail open, settled) have charges Redis
/// applies once it resumes, and their give-backs land before
/// `settle_owed` returns, not after the process is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_owed_returns_once_late_charges_are_given_back() {
    let Some(server) = stalling_server() else {
        return;
    };
    let closed = OnStoreError::FailClosed {
        retry_after: Duration::from_secs(1),
    };
    // Batched, and each charge on its own (as behind a proxy, or on a
    // cluster).
    let runs = [
        ("closed", closed, true),
        ("open", OnStoreError::FailOpen, true),
        ("alone", OnStoreError::FailOpen, false),
    ];
    for (id, rule, batched) in runs {
        let store = RedisStore::builder(server.url())
            .batch_charges(batched)
            .build()
            .unwrap();
        store.preload().await.unwrap();
        let policy = QuotaPolicy::builder(account())
            .store(store)
            .on_store_error(rule)
            .build();
        let quota = Quota::daily(1_000);
        let app = served(&policy, &quota);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let serving = tokio::spawn(axum::serve(listener, app).into_future());
        let mut stopped = Stopped::new(&server);
        let mut served = 0;
        for _ in 0..3 {
            let reply = demo_server::call(&addr, "GET", "/", &[("x-account-id", id)]).await;
            served += u64::from(reply.status == 200);
        }
        serving.abort();
        // Followed after their callers stopped waiting: what a shutdown
        // waits for.
        assert!(
            policy.store().charges_in_flight() > 0,
            "{rule:?}, batched {batched}: charges on their way while Redis stalls"
        );
        stopped.resume();
        // The shutdown: then the process exits, and its tasks with it.
        assert_eq!(policy.settle_owed(Duration::from_secs(5)).await.units, 0);
        // Read at once: nothing left on its way to give back later.
        let in_flight = policy.store().in_flight();
        let key = key_of(&quota, id, Timestamp::now());
        assert_eq!(
            (in_flight, used(&server, &key)),
            (0, served.to_string()),
            "{rule:?}, batched {batched}: calls in flight and Redis's count when settle_owed returned"
        );
    }
}

/// What `settle_owed` waits for once nothing is owed is the give-backs of
/// charges (and settles) Redis may run late: a read has none. A server
/// clock refreshed while Redis stalls always has a read on its way; with
/// nothing owed and nothing charged, a shutdown does not wait on them (with
/// `Duration::MAX`, it would never end while Redis stalls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_owed_waits_on_no_read() {
    let Some(server) = stalling_server() else {
        return;
    };
    let store = RedisStore::new(server.url()).unwrap();
    store.preload().await.unwrap();
    let _clock = store.server_clock(Duration::from_millis(50)).await.unwrap();
    let policy = QuotaPolicy::builder(account()).store(store).build();
    let _stopped = Stopped::new(&server);
    // The clock's reads go unanswered, each followed for up to 30 s.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(policy.store().in_flight() > 0, "a read is on its way");
    let settled =
        tokio::time::timeout(Duration::from_secs(3), policy.settle_owed(Duration::MAX)).await;
    assert!(
        matches!(settled, Ok(owed) if owed.units == 0),
        "settle_owed(MAX), nothing owed nor charged, Redis stalled: {settled:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_through_an_outage_counts_every_admission() {
    if !redis_available() {
        return;
    }
    // Every write on disk before it is answered: the counter outlives the
    // restart.
    let mut server = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let policy = QuotaPolicy::builder(account())
        .store(RedisStore::new(server.url()).unwrap())
        .on_store_error(OnStoreError::FailOpen)
        .build();
    let quota = Quota::daily(10);
    let app = served(&policy, &quota);
    for _ in 0..5 {
        assert_eq!(send(&app, "acme").await, StatusCode::OK);
    }
    let key = key_of(&quota, "acme", Timestamp::now());
    assert_eq!(used(&server, &key), "5");

    server.kill();
    for _ in 0..20 {
        assert_eq!(send(&app, "acme").await, StatusCode::OK, "fail open");
    }
    let owed = policy.owed();
    assert_eq!((owed.counters, owed.units), (1, 20), "one counter owes 20");
    // Still down a while: the ledger waits between tries.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(policy.owed().units, 20);

    server.restart();
    assert_eq!(used(&server, &key), "5", "the counter outlived the restart");
    settled(&policy).await;
    assert_eq!(used(&server, &key), "25", "every admission counted");
    assert_eq!(
        send(&app, "acme").await,
        StatusCode::TOO_MANY_REQUESTS,
        "past the limit, as served"
    );
}

/// The demo server, failing open through an outage, is stopped with
/// SIGTERM as soon as Redis is back, while its ledger waits seconds between
/// tries: it settles what it owes before it goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_stopped_after_an_outage_counts_every_admission_before_it_goes() {
    if !redis_available() {
        return;
    }
    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let mut server = demo_server::start(&[
        "--limit",
        "100",
        "--store",
        &redis.url(),
        "--on-store-error",
        "open",
    ]);
    let read = || demo_server::call(&server.addr, "GET", "/read", &[("x-account-id", "gone")]);
    for _ in 0..3 {
        assert_eq!(read().await.status, 200);
    }
    redis.kill();
    for _ in 0..5 {
        assert_eq!(read().await.status, 200, "fail open");
    }
    // Down for a while: the ledger now waits 1.6 s and more between tries.
    tokio::time::sleep(Duration::from_secs(3)).await;
    redis.restart();
    server.stop("TERM");
    let keys = redis.cli(&["KEYS", "quota:{account:gone}:read:*"]);
    let key = keys.lines().next().expect("a counter");
    assert_eq!(
        redis.cli(&["HGET", key, "n"]),
        "8",
        "every admission counted"
    );
}

/// Told to stop again while it waits for the store to take what it owes,
/// the demo server stops at once, and says what goes uncounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_stops_a_server_waiting_to_settle() {
    if !redis_available() {
        return;
    }
    let mut redis = RedisServer::start();
    let mut server = demo_server::start(&[
        "--limit",
        "100",
        "--store",
        &redis.url(),
        "--on-store-error",
        "open",
    ]);
    redis.kill();
    let read = || demo_server::call(&server.addr, "GET", "/read", &[("x-account-id", "gone")]);
    for _ in 0..2 {
        assert_eq!(read().await.status, 200, "fail open");
    }
    server.signal("TERM");
    // The drain ends at once (no connection open); the settle waits for a
    // store that is away, up to 5 s.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !server.ended_within(Duration::from_millis(50)),
        "waiting to settle"
    );
    server.signal("TERM");
    assert!(
        server.ended_within(Duration::from_secs(2)),
        "stopped at once by the second signal"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_use_counter_the_ledger_creates_ends_with_the_requests_period() {
    if !redis_available() {
        return;
    }
    let mut server = RedisServer::start();
    let t0 = Timestamp::now();
    let clock = ManualClock::new(t0);
    let policy = QuotaPolicy::builder(account())
        .store(RedisStore::new(server.url()).unwrap())
        .clock(clock.clone())
        .on_store_error(OnStoreError::FailOpen)
        .build();
    let quota = Quota::rolling(10, Duration::from_secs(3_600));
    let app = served(&policy, &quota);

    server.kill();
    assert_eq!(send(&app, "acme").await, StatusCode::OK);
    clock.advance(SignedDuration::from_mins(5));
    assert_eq!(send(&app, "acme").await, StatusCode::OK);
    let owed = policy.owed();
    assert_eq!((owed.counters, owed.units), (1, 2), "one period owed");

    // Redis comes back (empty) ten minutes after the first request.
    clock.advance(SignedDuration::from_mins(5));
    server.restart();
    settled(&policy).await;
    let key = key_of(&quota, "acme", t0);
    assert_eq!(used(&server, &key), "2");
    assert_eq!(
        server.cli(&["hget", key.as_str(), "t"]),
        t0.as_millisecond().to_string(),
        "the first call is the first request's"
    );
    let pttl: i64 = server.cli(&["pttl", key.as_str()]).parse().unwrap();
    let left = 50 * 60 * 1_000;
    assert!(
        (left - 10_000..=left).contains(&pttl),
        "the period opened by the first request ends in 50 minutes, not later: {pttl} ms"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debt_of_a_day_that_ended_is_not_charged_to_the_next_day() {
    if !redis_available() {
        return;
    }
    let mut server = RedisServer::start();
    let clock = ManualClock::new("2026-12-02T23:59:50Z".parse().unwrap());
    let policy = QuotaPolicy::builder(account())
        .store(RedisStore::new(server.url()).unwrap())
        .clock(clock.clone())
        .on_store_error(OnStoreError::FailOpen)
        .build();
    let quota = Quota::daily(10);
    let app = served(&policy, &quota);

    server.kill();
    assert_eq!(send(&app, "acme").await, StatusCode::OK);
    assert_eq!(policy.owed().units, 1);
    // Redis answers again after midnight.
    clock.advance(SignedDuration::from_secs(20));
    server.restart();
    settled(&policy).await;
    assert_eq!(server.cli(&["dbsize"]), "0", "nothing written");

    assert_eq!(send(&app, "acme").await, StatusCode::OK);
    let today = key_of(&quota, "acme", clock.now());
    assert!(today.as_str().ends_with("2026-12-03"), "{today:?}");
    assert_eq!(used(&server, &today), "1", "the new day counts its own");
    assert_eq!(server.cli(&["dbsize"]), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_bound_the_ledger_counts_the_counters_it_owes_only() {
    if !redis_available() {
        return;
    }
    let mut server = RedisServer::start();
    let policy = QuotaPolicy::builder(account())
        .store(RedisStore::new(server.url()).unwrap())
        .on_store_error(OnStoreError::FailOpen)
        .max_owed_counters(2)
        .build();
    let quota = Quota::daily(10);
    let app = served(&policy, &quota);
    server.kill();
    for account in ["a", "b", "c", "a"] {
        assert_eq!(send(&app, account).await, StatusCode::OK);
    }
    let owed = policy.owed();
    assert_eq!((owed.counters, owed.units), (2, 3));
    server.restart();
    settled(&policy).await;
    let now = Timestamp::now();
    assert_eq!(used(&server, &key_of(&quota, "a", now)), "2");
    assert_eq!(used(&server, &key_of(&quota, "b", now)), "1");
    assert_eq!(
        used(&server, &key_of(&quota, "c", now)),
        "",
        "past the bound"
    );
}

/// A settle that times out, and that Redis applies later, stands: the
/// ledger sends it again under its id, and Redis, finding its mark, adds
/// nothing more. A settle under another id adds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_redis_applies_late_counts_once_when_sent_again() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let store = store_answering_in_100_ms(&server).await;
    let now = Timestamp::now();
    let key = Namespace::default().key(&Subject::account("acme"), "late", "PT1H");
    let debt = debt_of_an_hour(&key, 3, now);

    settle_applied_late(&server, &store, now, &debt).await;
    assert_eq!(used(&server, &key), "3", "applied late, and kept");

    assert_eq!(store.settle_debt(now, debt.clone()).await.unwrap(), Some(3));
    assert_eq!(used(&server, &key), "3", "counted once");
    let next = Debt {
        id: redis_support::settle_id(),
        ..debt
    };
    assert_eq!(store.settle_debt(now, next).await.unwrap(), Some(6));
}

/// A settle Redis applied with its answer lost on the wire (the connection
/// broke after the call was sent) counts once: sent again under its id, it
/// finds its mark. The mark lives in the counter's hash tag, as long as a
/// counter the settle made would, and a minute more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_whose_answer_was_lost_counts_once_when_sent_again() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let proxy = redis_support::Wire::start(server.port()).await;
    let store = RedisStore::builder(proxy.url())
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    store.preload().await.unwrap();
    let now = Timestamp::now();
    let key = Namespace::default().key(&Subject::account("acme"), "lost", "PT1H");
    let debt = debt_of_an_hour(&key, 3, now);

    proxy.lose_next(b's');
    let error = store.settle_debt(now, debt.clone()).await.unwrap_err();
    assert_ne!(
        error.kind(),
        StoreErrorKind::Other,
        "worth another try: {error}"
    );
    assert_eq!(proxy.lost(), 1);
    assert_eq!(used(&server, &key), "3", "Redis applied it");

    assert_eq!(store.settle_debt(now, debt.clone()).await.unwrap(), Some(3));
    assert_eq!(used(&server, &key), "3", "counted once");

    let marks = server.cli(&["keys", "*%settled-*"]);
    let mark = format!("quota:{{account:acme}}:lost%settled-{:016x}:PT1H", debt.id);
    assert_eq!(marks, mark);
    let left: i64 = server.cli(&["pttl", &mark]).parse().unwrap();
    let counter: i64 = server.cli(&["pttl", key.as_str()]).parse().unwrap();
    assert!(
        (counter + 59_000..=counter + 61_000).contains(&left),
        "the mark lives {left} ms, the counter {counter} ms"
    );
}

/// Through an outage of the network, under fail open, with the answer to
/// the ledger's first settle lost on the wire once Redis can be reached
/// again: the ledger sends that settle again under its id, and the counter
/// ends at what was served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_then_a_settle_lost_on_the_wire_counts_every_admission_once() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let wire = redis_support::Wire::start(server.port()).await;
    let policy = QuotaPolicy::builder(account())
        .store(RedisStore::new(wire.url()).unwrap())
        .on_store_error(OnStoreError::FailOpen)
        .build();
    let quota = Quota::daily(100);
    let app = served(&policy, &quota);
    assert_eq!(send(&app, "acme").await, StatusCode::OK);
    let key = key_of(&quota, "acme", Timestamp::now());

    wire.cut(true);
    for _ in 0..20 {
        assert_eq!(send(&app, "acme").await, StatusCode::OK, "fail open");
    }
    assert_eq!(policy.owed().units, 20);
    assert_eq!(used(&server, &key), "1", "nothing passed the cut");
    wire.lose_next(b's');
    wire.cut(false);
    settled(&policy).await;
    assert_eq!(wire.lost(), 1, "the first settle's answer was lost");
    assert_eq!(used(&server, &key), "21", "every admission counted, once");
}

/// A key built by no namespace has no mark: a settle on it that Redis
/// applies late, to a counter a charge with a later instant made first (a
/// subject back after the outage, its first request stamped after the
/// ledger's settle), is given back, as a charge is: by the counter's first
/// call, not only the settle's.
#[tokio::test]
async fn a_settle_without_a_mark_applied_late_is_given_back() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let store = store_answering_in_100_ms(&server).await;
    let now = Timestamp::now();
    let key = PeriodKey::from_string("late-settle:acme".into());
    let lifetime = Lifetime::FirstUse {
        deadline: now + SignedDuration::from_hours(1),
    };
    let later = now + SignedDuration::from_millis(50);
    let charge = tower_quota::store::ChargeRequest {
        charged_at: None,
        now: later,
        lines: smallvec::smallvec![tower_quota::store::ChargeLine {
            key: key.clone(),
            limit: 100,
            cost: 1,
            lifetime: Lifetime::FirstUse {
                deadline: later + SignedDuration::from_hours(1),
            },
            shadow_limit: None,
        }],
    };
    assert!(store.charge(charge).await.unwrap().admitted);
    let debt = Debt {
        key: key.clone(),
        amount: 3,
        lifetime,
        since: now,
        id: redis_support::settle_id(),
    };

    settle_applied_late(&server, &store, now, &debt).await;
    assert_eq!(used(&server, &key), "1", "applied late, and given back");

    assert_eq!(store.settle_debt(now, debt).await.unwrap(), Some(4));
    assert_eq!(used(&server, &key), "4", "counted once");
}

/// A debt of `amount` on the first-use counter at `key`, of an hour from
/// `now`, under a settle id of its own.
fn debt_of_an_hour(key: &PeriodKey, amount: u64, now: Timestamp) -> Debt {
    Debt {
        key: key.clone(),
        amount,
        lifetime: Lifetime::FirstUse {
            deadline: now + SignedDuration::from_hours(1),
        },
        since: now,
        id: redis_support::settle_id(),
    }
}

/// A store on `server` that waits 100 ms for an answer, its script loaded.
async fn store_answering_in_100_ms(server: &RedisServer) -> RedisStore {
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    store.preload().await.unwrap();
    store
}

/// Settles `debt` at `now` while `server` is stopped (the store stops
/// waiting), then lets it go on: Redis applies the settle late, and the
/// store follows it to its answer.
async fn settle_applied_late(
    server: &RedisServer,
    store: &RedisStore,
    now: Timestamp,
    debt: &Debt,
) {
    let mut stopped = Stopped::new(server);
    let error = store.settle_debt(now, debt.clone()).await.unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
    stopped.resume();
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.in_flight() > 0 {
        assert!(Instant::now() < deadline, "{store:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// What the store cannot take is an error, and nothing is written.
#[tokio::test]
async fn a_settle_on_what_is_no_counter_or_beyond_2_53_writes_nothing() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let store = RedisStore::new(server.url()).unwrap();
    let now = Timestamp::now();
    let debt = |key: &PeriodKey, amount: u64| Debt {
        key: key.clone(),
        amount,
        lifetime: Lifetime::FirstUse {
            deadline: now + SignedDuration::from_hours(1),
        },
        since: now,
        id: redis_support::settle_id(),
    };
    let text = Namespace::default().key(&Subject::account("acme"), "text", "PT1H");
    server.cli(&["set", text.as_str(), "abc"]);
    let error = store.settle_debt(now, debt(&text, 1)).await.unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Other, "{error}");
    assert_eq!(server.cli(&["get", text.as_str()]), "abc");

    let full = Namespace::default().key(&Subject::account("acme"), "full", "PT1H");
    server.cli(&["hset", full.as_str(), "n", "9007199254740990"]);
    let error = store.settle_debt(now, debt(&full, 5)).await.unwrap_err();
    assert!(error.to_string().contains("2^53"), "{error}");
    assert_eq!(used(&server, &full), "9007199254740990");
    assert_eq!(
        store.settle_debt(now, debt(&full, 2)).await.unwrap(),
        Some(9_007_199_254_740_992)
    );
}

/// Support resets a subject while Redis stalls (SIGSTOP): the reset is
/// sent, and times out. A request made after the reset was sent passes on
/// its failed charge (fail open); Redis runs that charge after the reset
/// (one connection: in the order sent), and it is given back, its caller
/// having stopped waiting. The request was not made before the reset:
/// what it owes is counted in the fresh counter once Redis answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_made_after_a_stalled_reset_was_sent_is_counted() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .pool_size(1)
        .build()
        .unwrap();
    store.preload().await.unwrap();
    let policy = QuotaPolicy::builder(account())
        .store(store)
        .on_store_error(OnStoreError::FailOpen)
        .build();
    let quota = Quota::daily(10);
    let app = served(&policy, &quota);
    let key = key_of(&quota, "acme", Timestamp::now());
    assert_eq!(send(&app, "acme").await, StatusCode::OK);
    assert_eq!(used(&server, &key), "1");

    let stopped = Stopped::new(&server);
    let handle = policy.handle();
    let reset = tokio::spawn(async move { handle.reset(&Subject::account("acme")).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    // Made after the reset was sent.
    assert_eq!(send(&app, "acme").await, StatusCode::OK, "fail open");
    let reset = reset.await.unwrap();
    assert!(reset.is_err(), "the reset timed out: {reset:?}");
    drop(stopped);

    settled(&policy).await;
    assert_eq!(
        server.cli(&["exists", key.as_str()]),
        "1",
        "the fresh counter, made by the late charge after the reset"
    );
    assert_eq!(
        used(&server, &key),
        "1",
        "the request made after the reset was sent is counted"
    );
}

/// Two policies on one store share a quota. A request through the second
/// passes on a failed charge (Redis is away) and is answered after support
/// reset its subject through the first policy's handle: made before the
/// reset, it owes nothing, as it would through the first policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_forgets_what_every_policy_sharing_the_quota_owes() {
    if !redis_available() {
        return;
    }
    let mut server = RedisServer::start();
    let store = RedisStore::new(server.url()).unwrap();
    let quota = Quota::daily(100);
    let policy = || {
        QuotaPolicy::builder(account())
            .store(store.clone())
            .on_store_error(OnStoreError::FailOpen)
            .build()
    };
    let (a, b) = (policy(), policy());
    let reached = Arc::new(tokio::sync::Notify::new());
    let answer = Arc::new(tokio::sync::Notify::new());
    let slow = {
        let (reached, answer) = (Arc::clone(&reached), Arc::clone(&answer));
        move || async move {
            reached.notify_one();
            answer.notified().await;
            "b"
        }
    };
    let through_b = Router::new()
        .route("/", get(slow))
        .layer(b.layer(quota.clone()));
    assert_eq!(send(&served(&a, &quota), "acme").await, StatusCode::OK);
    server.kill();
    // Passes on a failed charge, and waits in its handler.
    let pending = tokio::spawn(through_b.oneshot(call("acme")));
    reached.notified().await;
    server.restart();
    a.handle().reset(&Subject::account("acme")).await.unwrap();
    answer.notify_one();
    assert_eq!(pending.await.unwrap().unwrap().status(), StatusCode::OK);
    let owed_a = a.settle_owed(Duration::from_secs(5)).await;
    let owed_b = b.settle_owed(Duration::from_secs(5)).await;
    assert_eq!((owed_a.units, owed_b.units), (0, 0));
    assert_eq!(
        used(&server, &key_of(&quota, "acme", Timestamp::now())),
        "",
        "the reset gave a fresh allowance: a request made before it takes none of it"
    );
}

/// First use (5 per 3 s), leased, fail open, across a stall of 2 s
/// (SIGSTOP) that covers busy's deadline and opens a newcomer's period.
/// Once the ledger settled what the stall's requests owe (past the limit),
/// each subject is admitted again a period after its counter's first call:
/// no counter outlives it, though Redis ran late the charges and settles
/// sent as it stalled (each would have ended as much later as Redis ran
/// the call that made it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_stall_every_first_use_counter_ends_a_period_after_its_first_call() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let store = LeasedStore::builder(RedisStore::new(server.url()).unwrap())
        .idle(Duration::from_millis(300))
        .build();
    let policy = QuotaPolicy::builder(account())
        .store(store.clone())
        .on_store_error(OnStoreError::FailOpen)
        .build();
    let period = Duration::from_secs(3);
    let quota = Quota::rolling(5, period);
    let app = served(&policy, &quota);
    let start = Instant::now();
    let epoch = Timestamp::now().as_millisecond();
    let ms = || start.elapsed().as_millis() as i64;
    // busy opens its period (ending at 3 s).
    for _ in 0..5 {
        assert_eq!(send(&app, "busy").await, StatusCode::OK);
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut stopped = Stopped::new(&server);
    while start.elapsed() < Duration::from_millis(3500) {
        send(&app, "busy").await;
        assert_eq!(send(&app, "newcomer").await, StatusCode::OK, "fail open");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(policy.owed().units > 5);
    stopped.resume();
    assert_eq!(policy.settle_owed(Duration::from_secs(3)).await.units, 0);

    // Each counter's first call, and when it ends.
    let now = ms();
    let mut due = Vec::new();
    let mut stretched = Vec::new();
    for subject in ["busy", "newcomer"] {
        let key = key_of(&quota, subject, Timestamp::now());
        let Ok(t) = server.cli(&["hget", key.as_str(), "t"]).parse::<i64>() else {
            continue;
        };
        let first = t - epoch;
        let pttl: i64 = server.cli(&["pttl", key.as_str()]).parse().unwrap();
        let ends = now + pttl;
        let period = period.as_millis() as i64;
        if ends > first + period + 100 {
            stretched.push(format!(
                "{subject}: first call at {first} ms, ends at {ends} ms"
            ));
        }
        due.push((first + period + 300, subject));
    }
    due.sort();
    for (at, subject) in due {
        tokio::time::sleep(Duration::from_millis(at as u64).saturating_sub(start.elapsed())).await;
        assert_eq!(
            send(&app, subject).await,
            StatusCode::OK,
            "{subject} at {} ms, a period and 300 ms after its counter's first call; \
             counters that outlive their period: {stretched:?}",
            ms(),
        );
    }
    assert!(stretched.is_empty(), "{stretched:?}");
    store.shutdown().await;
}

/// A settle sent to a Redis that stalls, run once it resumes (2 s later),
/// makes the debt's first-use counter with the debt's deadline once the
/// ledger sends it again (it got no answer): one period from the debt's
/// first request, not from when the settle was sent plus the stall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_run_late_ends_its_counter_at_the_debts_deadline() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let store = preloaded(&server).await;
    let now = Timestamp::now();
    let deadline = now + SignedDuration::from_secs(10);
    let key = PeriodKey::from_string("quota:{account:late}:default:PT10S".into());
    let debt = Debt {
        key: key.clone(),
        amount: 3,
        lifetime: Lifetime::FirstUse { deadline },
        since: now,
        id: redis_support::settle_id(),
    };
    let mut stopped = Stopped::new(&server);
    store.settle_debt(now, debt.clone()).await.unwrap_err();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stopped.resume();
    // The settle runs now; sent again under its id, it adds nothing more.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        store.settle_debt(Timestamp::now(), debt).await.unwrap(),
        Some(3)
    );
    assert_eq!(used(&server, &key), "3");
    let pttl: i64 = server.cli(&["pttl", key.as_str()]).parse().unwrap();
    let ends = Timestamp::now() + SignedDuration::from_millis(pttl);
    assert!(
        ends <= deadline + SignedDuration::from_millis(100),
        "the counter ends at {ends}, {} after the debt's deadline {deadline}",
        ends.duration_since(deadline)
    );
}

/// A debt of a first-use month lands in the subject's counter, made by a
/// request before the debt's: the settle leaves its deadline alone (that
/// month, from another day, is longer than the debt's 28 days).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_leaves_a_month_from_another_first_call_alone() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let store = preloaded(&server).await;
    let now = Timestamp::now();
    let day = SignedDuration::from_hours(24);
    let key = PeriodKey::from_string("quota:{account:month}:default:P1M".into());
    // Made a day ago, for a month of 31 days: 30 days left.
    let t = (now - day).as_millisecond().to_string();
    server.cli(&["hset", key.as_str(), "n", "5", "t", &t]);
    let left = (30 * day).as_millis().to_string();
    server.cli(&["pexpire", key.as_str(), &left]);
    let since = now - SignedDuration::from_hours(1);
    let debt = Debt {
        key: key.clone(),
        amount: 1,
        lifetime: Lifetime::FirstUse {
            deadline: since + 28 * day,
        },
        since,
        id: redis_support::settle_id(),
    };
    assert_eq!(store.settle_debt(now, debt).await.unwrap(), Some(6));
    let pttl: i64 = server.cli(&["pttl", key.as_str()]).parse().unwrap();
    assert!(
        pttl > (29 * day).as_millis() as i64,
        "the counter's month kept: {pttl} ms left"
    );
}

/// Two instances on one Redis, B's clock 10 minutes ahead of A's. A's
/// request opens a subject's first-use hour (a period from its first call,
/// by Redis's own clock: `PEXPIRE`); B's ledger then settles a debt of the
/// subject's into that counter. The store's docs: "Deadlines are sent as
/// durations (`PEXPIRE`), so a skewed instance never shortens or
/// lengthens a first-use period".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_from_a_skewed_instance_leaves_a_first_use_period_as_it_is() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let store = preloaded(&server).await;
    let hour = SignedDuration::from_hours(1);
    let key = Namespace::default().key(&Subject::account("skew"), "default", "PT1H");
    // Instance A, its clock right: the subject's first call.
    let a_now = Timestamp::now();
    let charged = store
        .charge(tower_quota::store::ChargeRequest {
            charged_at: None,
            now: a_now,
            lines: vec![tower_quota::store::ChargeLine {
                key: key.clone(),
                limit: 100,
                cost: 1,
                lifetime: Lifetime::FirstUse {
                    deadline: a_now + hour,
                },
                shadow_limit: None,
            }]
            .into(),
        })
        .await;
    assert!(charged.is_ok(), "{charged:?}");
    // Instance B, 10 minutes ahead: a request it served while its charge
    // failed (fail open), settled a second later.
    let b_now = Timestamp::now() + SignedDuration::from_mins(10);
    let since = b_now - SignedDuration::from_secs(1);
    let debt = Debt {
        key: key.clone(),
        amount: 1,
        lifetime: Lifetime::FirstUse {
            deadline: since + hour,
        },
        since,
        id: redis_support::settle_id(),
    };
    assert_eq!(store.settle_debt(b_now, debt).await.unwrap(), Some(2));
    let pttl: i64 = server.cli(&["pttl", key.as_str()]).parse().unwrap();
    assert!(
        pttl > SignedDuration::from_mins(59).as_millis() as i64,
        "the hour A's first call opened ends in {} s, not ~3600 s: cut by B's skew",
        pttl / 1000
    );
}
