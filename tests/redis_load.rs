//! The Redis store under load and through stalls, against a real
//! `redis-server` of its own: load alone is never a store error, and a
//! charge whose caller stopped waiting never stays charged.

#![cfg(feature = "redis")]

mod redis_support;

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_quota::jiff::{SignedDuration, Timestamp};
use tower_quota::store::{
    ChargeLine, ChargeRequest, Lifetime, RedisStore, RedisStoreBuilder, Store, StoreErrorKind,
};
use tower_quota::{FromHeader, Namespace, OnStoreError, PeriodKey, Quota, QuotaPolicy, Subject};

use redis_support::{RedisServer, SlowProxy, Stopped};

fn key(allowance: &str) -> PeriodKey {
    Namespace::default().key(&Subject::account("acme"), allowance, "PT1H")
}

fn charge(key: &PeriodKey, limit: u64) -> ChargeRequest {
    let now = Timestamp::now();
    ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![ChargeLine {
            key: key.clone(),
            limit,
            cost: 1,
            lifetime: Lifetime::FirstUse {
                deadline: now + SignedDuration::from_hours(1),
            },
            shadow_limit: None,
        }],
    }
}

/// The counter's count, as Redis holds it.
fn used(server: &RedisServer, key: &PeriodKey) -> String {
    server.cli(&["hget", key.as_str(), "n"])
}

/// The store `builder` builds, its script loaded and a connection open: a
/// few tries, as a connection made within a short budget on a busy machine
/// (the tests' own timeouts are tens of milliseconds) may take longer.
async fn ready(builder: RedisStoreBuilder) -> RedisStore {
    let store = builder.build().expect("a Redis store");
    let mut tries = 0;
    while let Err(error) = store.preload().await {
        tries += 1;
        assert!(tries < 10, "the test server answers: {error}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    store
}

/// Held by each test of this file while it runs: each makes its own load
/// and times it, and two at once on a small machine would starve each
/// other's store of the CPU that reads its answers (a connection answering
/// all along then looks silent, and a call waits past its budget).
async fn alone() -> tokio::sync::MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    ONE_AT_A_TIME.lock().await
}

/// How many connections the server has taken since it started.
fn opened(server: &RedisServer) -> u64 {
    server
        .cli(&["info", "stats"])
        .lines()
        .find_map(|line| line.strip_prefix("total_connections_received:"))
        .expect("INFO stats counts connections")
        .trim()
        .parse()
        .unwrap()
}

/// Waits until the store has no call in flight: every queued script has
/// been answered and every charge whose caller stopped waiting given back.
async fn quiet(store: &RedisStore) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.in_flight() > 0 {
        assert!(
            Instant::now() < deadline,
            "the store is still busy: {store:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn call(account: &str) -> Request<Body> {
    Request::get("/")
        .header("x-account-id", account)
        .body(Body::empty())
        .unwrap()
}

/// 1 000 concurrent requests of one subject with a limit of 500, through a
/// layer on a store with its default connections (two) and bound on calls
/// in flight.
///
/// At the default timeouts (80 ms for the store, 100 ms for the layer), in
/// an unoptimised build too: a queue of charges on a Redis that answers is
/// waited for.
async fn a_thousand_concurrent_requests(policy: OnStoreError) {
    let server = redis_server_or_skip!();
    let store = RedisStore::new(server.url()).unwrap();
    store.preload().await.unwrap();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store.clone())
            .on_store_error(policy)
            .build()
            .layer(Quota::daily(500)),
    );
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..1_000 {
        let app = app.clone();
        calls.spawn(async move { app.oneshot(call("crowd")).await.unwrap().status() });
    }
    let (mut ok, mut refused, mut other) = (0, 0, Vec::new());
    while let Some(status) = calls.join_next().await {
        match status.unwrap() {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            status => other.push(status),
        }
    }
    assert_eq!(
        (ok, refused, other),
        (500, 500, vec![]),
        "load alone is no store error"
    );
    assert_eq!(server.cli(&["dbsize"]), "1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_requests_admit_exactly_the_limit_failing_open() {
    let _alone = alone().await;
    a_thousand_concurrent_requests(OnStoreError::FailOpen).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_requests_admit_exactly_the_limit_failing_closed() {
    let _alone = alone().await;
    a_thousand_concurrent_requests(OnStoreError::FailClosed {
        retry_after: Duration::from_secs(1),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_that_failed_during_a_stall_are_not_charged_after_it() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    let budget = Duration::from_millis(100);
    let store = ready(RedisStore::builder(server.url()).timeout(budget)).await;
    let key = key("stall");
    assert!(store.charge(charge(&key, 100)).await.unwrap().admitted);

    let mut stopped = Stopped::new(&server);
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..150 {
        let store = store.clone();
        let key = key.clone();
        calls.spawn(async move {
            let started = Instant::now();
            let result = store.charge(charge(&key, 100)).await;
            (result.map(|o| o.admitted), started.elapsed())
        });
    }
    while let Some(answer) = calls.join_next().await {
        let (result, took) = answer.unwrap();
        let error = result.expect_err("a stopped server answers nothing");
        assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
        assert!(took < budget * 2, "answered after {took:?}");
    }
    // Those sent are still followed; those never sent left no trace.
    assert!(store.in_flight() >= 1, "{store:?}");

    // The queued scripts run now: every charge they apply is given back.
    // Charges still waiting for a batch when their callers gave up were
    // never sent; those sent before the stall was noticed were applied, and
    // are given back.
    stopped.resume();
    quiet(&store).await;
    assert_eq!(used(&server, &key), "1", "only the admitted request counts");
    let given_back = given_back(&store);
    assert!((1..=99).contains(&given_back), "{store:?}");

    for i in 0..99 {
        let outcome = store.charge(charge(&key, 100)).await.unwrap();
        assert!(outcome.admitted, "charge {i} after the stall");
    }
    let outcome = store.charge(charge(&key, 100)).await.unwrap();
    assert!(!outcome.admitted);
    assert_eq!(outcome.usage[0].used, 100);
}

/// A store on a pool built elsewhere, whose connections give up on an
/// answer after 500 ms (deadpool-redis's default): charges held up longer
/// than that are still followed, and given back once Redis applies them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_on_a_pool_are_followed_past_its_own_response_timeout() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    let pool = deadpool_redis::Config::from_url(server.url())
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap();
    for batched in [true, false] {
        let store = ready(
            RedisStore::builder_from_pool(pool.clone())
                .timeout(Duration::from_millis(100))
                .batch_charges(batched),
        )
        .await;
        let key = key(&format!("pooled-{batched}"));
        assert!(store.charge(charge(&key, 100)).await.unwrap().admitted);

        // Scripts wait for a second and a half; the pool's pings pass.
        server.cli(&["client", "pause", "1500", "write"]);
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let store = store.clone();
            let key = key.clone();
            calls.spawn(async move { store.charge(charge(&key, 100)).await });
        }
        while let Some(result) = calls.join_next().await {
            let error = result.unwrap().expect_err("paused scripts answer late");
            assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
        }
        // A write waits for the pause to end, after the scripts before it.
        let port = server.port();
        tokio::task::spawn_blocking(move || redis_support::cli(port, &["set", "fence", "1"]))
            .await
            .unwrap();
        quiet(&store).await;
        assert_eq!(
            used(&server, &key),
            "1",
            "batched {batched}: only the admitted charge counts"
        );
        assert!(given_back(&store) >= 1, "batched {batched}: {store:?}");
    }
}

/// A refund or an add that times out was sent: its error says it may still
/// be applied, and it is once the server answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_that_timed_out_says_it_may_still_apply() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    let store = ready(RedisStore::builder(server.url()).timeout(Duration::from_millis(100))).await;
    let key = key("late-refund");
    for _ in 0..3 {
        assert!(store.charge(charge(&key, 10)).await.unwrap().admitted);
    }

    let mut stopped = Stopped::new(&server);
    let now = tower_quota::jiff::Timestamp::now();
    // Both sent at once, on the connections open before the stall.
    let (refund, add) = tokio::join!(
        store.refund(now, key.clone(), 1),
        store.add(now, key.clone(), 5)
    );
    for error in [refund.unwrap_err(), add.unwrap_err()] {
        assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
        assert!(
            error.to_string().contains("may still be applied"),
            "{error}"
        );
    }
    stopped.resume();
    quiet(&store).await;
    assert_eq!(used(&server, &key), "7", "3 charged, 1 refunded, 5 added");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_charge_never_stays_charged() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    let store = ready(RedisStore::builder(server.url()).timeout(Duration::from_secs(5))).await;
    let key = key("dropped");
    assert!(store.charge(charge(&key, 10)).await.unwrap().admitted);

    let mut stopped = Stopped::new(&server);
    for _ in 0..5 {
        // The caller gives up long before the store's own timeout.
        let gave_up =
            tokio::time::timeout(Duration::from_millis(5), store.charge(charge(&key, 10)))
                .await
                .is_err();
        assert!(gave_up);
    }
    // A layer whose own timeout is shorter than the store's.
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store.clone())
            .store_timeout(Some(Duration::from_millis(20)))
            .build()
            .layer(Quota::daily(10)),
    );
    let response = app.oneshot(call("acme")).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);

    stopped.resume();
    quiet(&store).await;
    assert_eq!(
        used(&server, &key),
        "1",
        "the abandoned charges were given back"
    );
    // The layer's own counter, if its charge reached Redis, holds nothing.
    for other in server.cli(&["keys", "*"]).lines() {
        if other != key.as_str() {
            assert_eq!(server.cli(&["hget", other, "n"]), "0", "{other}");
        }
    }
    let outcome = store.charge(charge(&key, 10)).await.unwrap();
    assert_eq!(outcome.usage[0].used, 2, "charges work again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_beyond_max_in_flight_fail_within_the_budget_and_send_nothing() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    let budget = Duration::from_millis(100);
    // One by one, each of the ten below is sent and followed. (In a batch,
    // a charge still queued when its caller leaves is never sent, and frees
    // its room.)
    let store = ready(
        RedisStore::builder(server.url())
            .timeout(budget)
            .max_in_flight(10)
            .batch_charges(false),
    )
    .await;
    let key = key("bound");
    assert!(store.charge(charge(&key, 100)).await.unwrap().admitted);

    let mut stopped = Stopped::new(&server);
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..10 {
        let store = store.clone();
        let key = key.clone();
        calls.spawn(async move { store.charge(charge(&key, 100)).await });
    }
    // The ten are sent and followed; the next finds no room.
    let deadline = Instant::now() + Duration::from_secs(5);
    while store.in_flight() < 10 {
        assert!(Instant::now() < deadline, "{store:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let started = Instant::now();
    let error = store.charge(charge(&key, 100)).await.unwrap_err();
    assert!(started.elapsed() < budget * 2, "{:?}", started.elapsed());
    assert_eq!(error.kind(), StoreErrorKind::Timeout);
    assert!(error.to_string().contains("max_in_flight"), "{error}");
    while let Some(result) = calls.join_next().await {
        assert_eq!(result.unwrap().unwrap_err().kind(), StoreErrorKind::Timeout);
    }

    stopped.resume();
    quiet(&store).await;
    assert_eq!(used(&server, &key), "1");
    let outcome = store.charge(charge(&key, 100)).await.unwrap();
    assert_eq!(outcome.usage[0].used, 2);
}

/// How many charges `store` gave back after their callers stopped waiting.
fn given_back(store: &RedisStore) -> u64 {
    let debug = format!("{store:?}");
    let count = debug
        .split("given_back: ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .unwrap_or_else(|| panic!("no given_back in {debug}"));
    count.parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_sent_together_are_each_decided_on_their_own() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    let store = ready(RedisStore::builder(server.url()).timeout(Duration::from_secs(5))).await;
    let subjects: Vec<PeriodKey> = (0..40)
        .map(|i| Namespace::default().key(&Subject::account(i), "batch", "PT1H"))
        .collect();
    // Subject 0 is at its limit of 3; subject 1's counter holds a value
    // that is no counter.
    for _ in 0..3 {
        assert!(
            store
                .charge(charge(&subjects[0], 3))
                .await
                .unwrap()
                .admitted
        );
    }
    server.cli(&["hset", subjects[1].as_str(), "n", "1.0"]);
    server.cli(&["config", "resetstat"]);

    // While the server is stopped, the charges queue up behind the first
    // few; they leave together once it answers again.
    let mut stopped = Stopped::new(&server);
    let mut calls = tokio::task::JoinSet::new();
    for (i, key) in subjects.iter().enumerate() {
        let store = store.clone();
        let key = key.clone();
        calls.spawn(async move { (i, store.charge(charge(&key, 3)).await) });
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    stopped.resume();
    while let Some(answer) = calls.join_next().await {
        match answer.unwrap() {
            (0, Ok(outcome)) => {
                assert!(!outcome.admitted);
                assert_eq!(outcome.usage[0].used, 3);
            }
            (1, Err(error)) => {
                assert_eq!(error.kind(), StoreErrorKind::Other, "{error}");
                assert!(format!("{error:#}").contains("not a counter"), "{error:#}");
            }
            (i, Ok(outcome)) if i > 1 => {
                assert!(outcome.admitted, "subject {i}");
                assert_eq!(outcome.usage[0].used, 1, "subject {i}");
            }
            (i, other) => panic!("subject {i}: {other:?}"),
        }
    }
    assert_eq!(used(&server, &subjects[0]), "3");
    assert_eq!(used(&server, &subjects[1]), "1.0", "nothing written");
    for key in &subjects[2..] {
        assert_eq!(used(&server, key), "1");
    }
    // Fewer script calls than charges: they were sent in batches.
    let calls = server.script_calls();
    assert!(
        calls > 0 && calls < subjects.len() as u64 / 2,
        "{calls} calls for {} charges",
        subjects.len()
    );
}

/// Charges of one quota on counters that exist travel in a batch in their
/// short form (the quota's arguments once, Redis's answer in three or four
/// values); each is told what a charge sent alone would be told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_charges_on_existing_counters_are_told_what_a_lone_charge_is() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    let store = ready(RedisStore::builder(server.url()).timeout(Duration::from_secs(5))).await;
    let t0 = Timestamp::now();
    let end = t0 + SignedDuration::from_hours(1);
    let calendar = |key: &PeriodKey, limit: u64, now: Timestamp| ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![ChargeLine {
            key: key.clone(),
            limit,
            cost: 1,
            lifetime: Lifetime::Calendar { start: t0, end },
            shadow_limit: None,
        }],
    };
    let keys = |anchor: &str| -> Vec<PeriodKey> {
        (0..12)
            .map(|i| Namespace::default().key(&Subject::account(i), anchor, "PT1H"))
            .collect()
    };
    let (daily, rolling) = (keys("calendar"), keys("first-use"));
    // One charge each, alone: every counter exists, and the first of each
    // kind is at its limit of 1.
    let mut first_calls = Vec::new();
    for (i, key) in daily.iter().enumerate() {
        let limit = if i == 0 { 1 } else { 5 };
        assert!(
            store
                .charge(calendar(key, limit, t0))
                .await
                .unwrap()
                .admitted
        );
    }
    for (i, key) in rolling.iter().enumerate() {
        let request = charge(key, if i == 0 { 1 } else { 5 });
        first_calls.push(Timestamp::from_millisecond(request.now.as_millisecond()).unwrap());
        assert!(store.charge(request).await.unwrap().admitted);
    }
    server.cli(&["config", "resetstat"]);

    for (anchor, keys) in [("calendar", &daily), ("first use", &rolling)] {
        // Queued behind the first few while the server is stopped, they
        // leave together once it answers again.
        let mut stopped = Stopped::new(&server);
        let mut calls = tokio::task::JoinSet::new();
        for (i, key) in keys.iter().enumerate() {
            let store = store.clone();
            let limit = if i == 0 { 1 } else { 5 };
            let request = if anchor == "calendar" {
                calendar(key, limit, Timestamp::now())
            } else {
                charge(key, limit)
            };
            calls.spawn(async move { (i, store.charge(request).await.unwrap()) });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        stopped.resume();
        while let Some(answer) = calls.join_next().await {
            let (i, outcome) = answer.unwrap();
            let usage = &outcome.usage[0];
            if i == 0 {
                assert!(!outcome.admitted, "{anchor}");
                assert_eq!((usage.used, usage.remaining()), (1, 0), "{anchor}");
            } else {
                assert!(outcome.admitted, "{anchor} {i}");
                assert_eq!((usage.used, usage.remaining()), (2, 3), "{anchor} {i}");
            }
            if anchor == "calendar" {
                assert_eq!(usage.resets_at, end, "{i}");
                // The charge alone, at t0, made it.
                let made = Timestamp::from_millisecond(t0.as_millisecond()).unwrap();
                assert_eq!(usage.first_call, Some(made), "{i}");
            } else {
                // The counter's deadline, read back from its remaining
                // life: an hour after its first call.
                let deadline = first_calls[i] + SignedDuration::from_hours(1);
                let off = (usage.resets_at - deadline).abs();
                assert!(off < SignedDuration::from_secs(2), "{i}: {off:?} off");
                assert_eq!(usage.first_call, Some(first_calls[i]), "{i}");
            }
        }
        drop(stopped);
        for (i, key) in keys.iter().enumerate() {
            assert_eq!(
                used(&server, key),
                if i == 0 { "1" } else { "2" },
                "{anchor} {i}"
            );
        }
    }
    let calls = server.script_calls();
    assert!(calls < 12, "{calls} calls for 24 charges");
}

/// Charges of one quota but of different costs, sent together in a batch:
/// each counter is charged its own charge's cost, not the cost of the
/// charge before it in the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_charges_of_different_costs_are_each_charged_their_own() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    let store = ready(RedisStore::builder(server.url()).timeout(Duration::from_secs(5))).await;
    let subjects: Vec<(PeriodKey, u64)> = (0..24)
        .map(|i| {
            let key = Namespace::default().key(&Subject::account(i), "costs", "PT1H");
            (key, 1 + i % 3)
        })
        .collect();
    server.cli(&["config", "resetstat"]);
    // While the server is stopped, the charges queue up behind the first
    // few; they leave together once it answers again.
    let mut stopped = Stopped::new(&server);
    let mut calls = tokio::task::JoinSet::new();
    for (key, cost) in &subjects {
        let (store, key, cost) = (store.clone(), key.clone(), *cost);
        calls.spawn(async move {
            let mut request = charge(&key, 100);
            request.lines[0].cost = cost;
            (cost, store.charge(request).await)
        });
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    stopped.resume();
    while let Some(answer) = calls.join_next().await {
        let (cost, outcome) = answer.unwrap();
        let outcome = outcome.unwrap();
        assert!(outcome.admitted);
        assert_eq!(outcome.usage[0].used, cost, "told its own cost");
    }
    for (key, cost) in &subjects {
        assert_eq!(used(&server, key), cost.to_string(), "{key:?}");
    }
    let calls = server.script_calls();
    assert!(
        calls > 0 && calls < subjects.len() as u64 / 2,
        "{calls} calls for {} charges: sent in batches",
        subjects.len()
    );
}

#[test]
fn a_store_outlives_a_runtime_that_shut_down_in_the_middle_of_a_batch() {
    let server = redis_server_or_skip!();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let key = key("runtimes");
    {
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        first.block_on(store.preload()).unwrap();
        let _stopped = Stopped::new(&server);
        // Charges on their way, or queued behind them, when the runtime
        // goes away.
        first.block_on(async {
            for _ in 0..20 {
                let store = store.clone();
                let key = key.clone();
                tokio::spawn(async move { store.charge(charge(&key, 100)).await });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        });
        drop(first);
    }
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        // The connection opened on the first runtime went with it: the
        // first call may find it broken, and drops it.
        let first = tokio::time::timeout(Duration::from_secs(2), store.charge(charge(&key, 100)))
            .await
            .expect("charges are sent again");
        if let Err(error) = first {
            assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{error}");
        }
        for _ in 0..3 {
            let outcome =
                tokio::time::timeout(Duration::from_secs(2), store.charge(charge(&key, 100)))
                    .await
                    .expect("charges are sent again")
                    .unwrap();
            assert!(outcome.admitted);
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_go_one_by_one_when_batches_are_off() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    let store = ready(
        RedisStore::builder(server.url())
            .timeout(Duration::from_secs(5))
            .batch_charges(false),
    )
    .await;
    server.cli(&["config", "resetstat"]);
    {
        let mut stopped = Stopped::new(&server);
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..20 {
            let store = store.clone();
            let key = Namespace::default().key(&Subject::account(i), "alone", "PT1H");
            calls.spawn(async move { store.charge(charge(&key, 3)).await });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        stopped.resume();
        while let Some(result) = calls.join_next().await {
            assert!(result.unwrap().unwrap().admitted);
        }
    }
    assert_eq!(server.script_calls(), 20, "one script call per charge");
}

/// A TCP proxy in front of a server whose connections can be made to go
/// silent, as after a network fault that leaves them half-open: bytes sent
/// on them are swallowed, nothing comes back, and nothing is closed.
/// Connections opened afterwards pass.
struct Silencer {
    addr: std::net::SocketAddr,
    generation: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Silencer {
    async fn start(server: &RedisServer) -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let target = format!("127.0.0.1:{}", server.port());
        let generation = std::sync::Arc::new(AtomicU64::new(0));
        let current = std::sync::Arc::clone(&generation);
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let Ok(upstream) = tokio::net::TcpStream::connect(&target).await else {
                    continue;
                };
                let born = current.load(Ordering::SeqCst);
                let (client_read, client_write) = client.into_split();
                let (upstream_read, upstream_write) = upstream.into_split();
                for (mut from, mut to) in [
                    (
                        Box::new(client_read) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                        Box::new(upstream_write) as Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
                    ),
                    (Box::new(upstream_read), Box::new(client_write)),
                ] {
                    let current = std::sync::Arc::clone(&current);
                    tokio::spawn(async move {
                        let mut buffer = vec![0; 64 * 1024];
                        loop {
                            let read = match from.read(&mut buffer).await {
                                Ok(0) | Err(_) => return,
                                Ok(read) => read,
                            };
                            if current.load(Ordering::SeqCst) != born {
                                // Silenced: swallowed, and the socket kept.
                                continue;
                            }
                            if to.write_all(&buffer[..read]).await.is_err() {
                                return;
                            }
                        }
                    });
                }
            }
        });
        Self { addr, generation }
    }

    fn url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// Silences every connection open now.
    fn silence(&self) {
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A connection that goes silent (half-open) holds up charges for about a
/// second, not the 30 s a call is followed: the store stops using it once a
/// call has waited that long with nothing back on it, and charges go on on
/// fresh connections, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_holds_up_only_the_calls_already_on_it() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    let proxy = Silencer::start(&server).await;
    for batched in [true, false] {
        let budget = Duration::from_millis(300);
        let store = ready(
            RedisStore::builder(proxy.url())
                .timeout(budget)
                .batch_charges(batched),
        )
        .await;
        let key = key(&format!("silent-{batched}"));
        for _ in 0..4 {
            assert!(store.charge(charge(&key, 1_000)).await.unwrap().admitted);
        }

        proxy.silence();
        let started = Instant::now();
        let (mut admitted, mut failed) = (0, 0);
        for i in 0..40 {
            let at = started.elapsed();
            match store.charge(charge(&key, 1_000)).await {
                Ok(outcome) => {
                    assert!(outcome.admitted);
                    admitted += 1;
                }
                Err(error) => {
                    assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
                    // A connection that answers nothing for a second is
                    // left for fresh ones.
                    assert!(
                        at < Duration::from_secs(1) + budget * 2,
                        "charge {i}, {at:?} after the fault: {error}"
                    );
                    failed += 1;
                }
            }
        }
        let took = started.elapsed();
        assert!(
            failed >= 1,
            "batched {batched}: the silent connection was used"
        );
        assert!(
            took < Duration::from_secs(10),
            "batched {batched}: 40 charges took {took:?}"
        );
        // The swallowed charges never reached Redis.
        assert_eq!(used(&server, &key), (4 + admitted).to_string());
    }
}

/// A connection gone silent beside one that answers: the calls sent on the
/// silent one fail after about one budget, as on a Redis that stalled. The
/// answers on the other connection tell nothing of theirs (they would
/// otherwise be waited for up to ten budgets).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_on_a_silent_connection_beside_an_answering_one_fail_after_a_budget() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    for batched in [true, false] {
        let proxy = Silencer::start(&server).await;
        let budget = Duration::from_millis(80);
        let store = RedisStore::builder(proxy.url())
            .pool_size(2)
            .timeout(budget)
            .batch_charges(batched)
            .build()
            .unwrap();
        let key = key(&format!("beside-{batched}"));
        // The first slot's connection opens for a first charge, and goes
        // silent; the second opens afterwards, and answers.
        store.charge(charge(&key, 1_000)).await.unwrap();
        proxy.silence();
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..20 {
            let (store, key) = (store.clone(), key.clone());
            calls.spawn(async move {
                let started = Instant::now();
                let outcome = store.charge(charge(&key, 1_000)).await;
                (outcome.is_ok(), started.elapsed())
            });
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let answers = calls.join_all().await;
        let failed: Vec<Duration> = answers
            .iter()
            .filter(|(ok, _)| !ok)
            .map(|(_, waited)| *waited)
            .collect();
        assert!(
            answers.iter().any(|(ok, _)| *ok),
            "batched {batched}: the other connection answers: {answers:?}"
        );
        assert!(
            !failed.is_empty(),
            "batched {batched}: the silent connection was used: {answers:?}"
        );
        assert!(
            failed.iter().all(|waited| *waited < budget * 9 / 4),
            "batched {batched}: failed after about a budget: {answers:?}"
        );
    }
}

/// A connection that went silent during a lull (half-open: the network
/// dropped it without a word) is pinged before it is used again, found
/// silent, and left for a fresh one: the first charges after the lull are
/// served, none is sent on the silent connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_gone_silent_during_a_lull_costs_no_charge() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    let proxy = Silencer::start(&server).await;
    let store = ready(
        RedisStore::builder(proxy.url())
            .pool_size(1)
            .connect_timeout(Duration::from_millis(100))
            .timeout(Duration::from_millis(500)),
    )
    .await;
    let key = key("silent-lull");
    assert!(store.charge(charge(&key, 1_000)).await.unwrap().admitted);
    proxy.silence();
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    for i in 0..3 {
        let outcome = store
            .charge(charge(&key, 1_000))
            .await
            .unwrap_or_else(|e| panic!("charge {i} after the lull failed: {e}"));
        assert!(outcome.admitted);
    }
    assert_eq!(used(&server, &key), "4");
}

/// A connection whose answers keep coming is kept when a call on it waits
/// past the second after which one that answers nothing is left: Redis
/// slow under load (the proxy passes one answer every 300 ms) and five
/// charges 90 ms apart, each a batch of its own behind the others, the
/// last answered about 1.1 s after it was sent. The charge after them
/// goes on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_slow_past_a_second_but_answering_is_kept() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    let proxy = SlowProxy::start(server.port()).await;
    let store = ready(
        RedisStore::builder(proxy.url())
            .pool_size(1)
            .timeout(Duration::from_millis(80)),
    )
    .await;
    let key = key("slow-kept");
    store.charge(charge(&key, 1_000)).await.unwrap();
    let before = opened(&server);
    proxy.slow(Duration::from_millis(300));
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..5 {
        let (store, key) = (store.clone(), key.clone());
        // Of no cost: a charge its caller stopped waiting for has nothing
        // to give back, which would be one more slow call.
        let mut free = charge(&key, 1_000);
        free.lines[0].cost = 0;
        calls.spawn(async move { store.charge(free).await.is_ok() });
        tokio::time::sleep(Duration::from_millis(90)).await;
    }
    let answered = calls.join_all().await.into_iter().filter(|ok| *ok).count();
    quiet(&store).await;
    proxy.slow(Duration::ZERO);
    assert!(store.charge(charge(&key, 1_000)).await.unwrap().admitted);
    // One connection more: the `redis-cli` that reads the count.
    assert_eq!(
        opened(&server),
        before + 1,
        "{answered} of 5 answered; the connection answering all along was dropped"
    );
}

/// Connections that keep answering are kept, however long the queue on
/// them: calls that wait past the budget on a busy connection fail on their
/// own and open no new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_connection_is_kept() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    for batched in [true, false] {
        let store = ready(
            RedisStore::builder(server.url())
                .timeout(Duration::from_millis(20))
                .batch_charges(batched),
        )
        .await;
        let before = opened(&server);
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..3_000 {
            let store = store.clone();
            calls.spawn(async move {
                let key = key(&format!("busy-{batched}-{}", i % 100));
                store.charge(charge(&key, 1_000_000)).await.is_ok()
            });
        }
        let answered = calls.join_all().await.into_iter().filter(|ok| *ok).count();
        quiet(&store).await;
        // One connection more: the `redis-cli` that reads the count.
        assert_eq!(
            opened(&server),
            before + 1,
            "batched {batched}: {answered} of 3 000 answered in time"
        );
    }
}

/// A Redis slow under load answers every call, each 50 ms after the one
/// before: charges sent 2 ms apart wait longer and longer (the tenth about
/// 480 ms), far past the store's 80 ms, while Redis answers others all
/// along. They are waited for, not failed: load alone is no store error.
/// (A charge just before the proxy slows down keeps the connection from
/// looking quiet, which would cost a check of its own.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_behind_others_on_a_slow_redis_are_waited_for() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    for batched in [true, false] {
        let proxy = SlowProxy::start(server.port()).await;
        let store = ready(
            RedisStore::builder(proxy.url())
                .pool_size(1)
                .timeout(Duration::from_millis(80))
                .batch_charges(batched),
        )
        .await;
        let key = key(&format!("slow-{batched}"));
        let slowest = all_served_on_a_slow_redis(&server, &proxy, &store, &key, 10).await;
        assert!(
            slowest > Duration::from_millis(80),
            "batched {batched}: {slowest:?}: slow enough"
        );
    }
}

/// Charges `n` charges on `key`, sent 2 ms apart once `proxy` slowed down
/// (after one charge before, which keeps the connection from looking quiet):
/// every one admitted, and counted once `store` is quiet. What the slowest
/// waited.
async fn all_served_on_a_slow_redis(
    server: &RedisServer,
    proxy: &SlowProxy,
    store: &RedisStore,
    key: &PeriodKey,
    n: usize,
) -> Duration {
    store.charge(charge(key, 1_000)).await.unwrap();
    proxy.slow(Duration::from_millis(50));
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (store, key) = (store.clone(), key.clone());
        calls.spawn(async move {
            let started = Instant::now();
            let outcome = store.charge(charge(&key, 1_000)).await;
            (outcome.map(|outcome| outcome.admitted), started.elapsed())
        });
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let answers = calls.join_all().await;
    assert!(
        answers
            .iter()
            .all(|(outcome, _)| matches!(outcome, Ok(true))),
        "{answers:?}"
    );
    quiet(store).await;
    assert_eq!(used(server, key), (n + 1).to_string());
    answers.iter().map(|(_, waited)| *waited).max().unwrap()
}

/// Charges that find every room among the calls in flight taken
/// (`max_in_flight` 2) wait for it while Redis answers the calls that hold
/// it, slowly (the proxy passes one chunk every 50 ms: a call is answered
/// about every 100 ms): the last of six waits about 400 ms for room, far
/// past the store's 80 ms, and is served all the same. (A stalled Redis fails them
/// after one budget: `calls_beyond_max_in_flight_fail_within_the_budget_and_send_nothing`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_waiting_for_room_on_a_slow_redis_are_waited_for() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    let proxy = SlowProxy::start(server.port()).await;
    let store = ready(
        RedisStore::builder(proxy.url())
            .pool_size(1)
            .max_in_flight(2)
            .batch_charges(false)
            .timeout(Duration::from_millis(80)),
    )
    .await;
    let key = key("slow-room");
    let slowest = all_served_on_a_slow_redis(&server, &proxy, &store, &key, 6).await;
    assert!(
        slowest > Duration::from_millis(160),
        "{slowest:?}: slow enough"
    );
}

/// The same through the layer, at its defaults (100 ms, and the store's
/// 80 ms): requests behind others on a slow Redis are served, none is
/// answered 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_behind_others_on_a_slow_redis_are_served() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    let proxy = SlowProxy::start(server.port()).await;
    let store = ready(RedisStore::builder(proxy.url()).pool_size(1)).await;
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store.clone())
            .build()
            .layer(Quota::daily(1_000)),
    );
    let first = app.clone().oneshot(call("queued")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    proxy.slow(Duration::from_millis(50));
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..10 {
        let app = app.clone();
        calls.spawn(async move {
            let started = Instant::now();
            let response = app.oneshot(call("queued")).await.unwrap();
            let status = response.status();
            let body = axum::body::to_bytes(response.into_body(), usize::MAX)
                .await
                .unwrap();
            (
                status,
                started.elapsed(),
                String::from_utf8_lossy(&body).into_owned(),
            )
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let statuses = calls.join_all().await;
    assert!(
        statuses
            .iter()
            .all(|(status, _, _)| *status == StatusCode::OK),
        "{statuses:?}"
    );
}

/// A burst on a store that opened one of its two connections yet, while
/// the next takes 300 ms to open: the charges go on the open one while the
/// other opens beside, and none waits for it past the store's 80 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_go_on_an_open_connection_while_the_next_opens() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    for batched in [true, false] {
        let proxy = SlowProxy::start(server.port()).await;
        let store = RedisStore::builder(proxy.url())
            .pool_size(2)
            .timeout(Duration::from_millis(80))
            .batch_charges(batched)
            .build()
            .unwrap();
        let key = key(&format!("opening-{batched}"));
        // The first slot's connection opens for a first charge.
        store.charge(charge(&key, 1_000)).await.unwrap();
        proxy.slow_to_connect(Duration::from_millis(300));
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..10 {
            let (store, key) = (store.clone(), key.clone());
            calls.spawn(async move { store.charge(charge(&key, 1_000)).await.map(|o| o.admitted) });
        }
        let answers = calls.join_all().await;
        assert!(
            answers.iter().all(|answer| matches!(answer, Ok(true))),
            "batched {batched}: {answers:?}"
        );
        quiet(&store).await;
        assert_eq!(used(&server, &key), "11");
    }
}

/// A restart while only one of four connections was open: a burst after
/// it is served on fresh connections, none of it failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_after_a_quick_restart_with_one_connection_open_is_served() {
    let _alone = alone().await;
    let mut server = redis_server_or_skip!();
    let store = RedisStore::builder(server.url())
        .pool_size(4)
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let key = key("beside-restart");
    store.charge(charge(&key, 1_000_000)).await.unwrap();
    server.restart();
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let (store, key) = (store.clone(), key.clone());
        calls.spawn(async move {
            store
                .charge(charge(&key, 1_000_000))
                .await
                .map(|o| o.admitted)
        });
    }
    let answers = calls.join_all().await;
    let failed: Vec<_> = answers.iter().filter(|a| !matches!(a, Ok(true))).collect();
    quiet(&store).await;
    assert!(failed.is_empty(), "{failed:?}");
}

/// The idle connection is pinged, found dead after a restart; the other,
/// used within the second, is of the epoch now over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_ping_takes_no_connection_of_the_epoch_over() {
    let _alone = alone().await;
    let mut server = redis_server_or_skip!();
    let store = RedisStore::builder(server.url())
        .pool_size(2)
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let key = key("ping-beside");
    store.preload().await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    for i in 0..2 {
        store.charge(charge(&key, 1_000_000)).await.unwrap();
        if i == 0 {
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
    }
    server.restart();
    tokio::time::sleep(Duration::from_millis(500)).await;
    for i in 0..10 {
        if let Err(error) = store.charge(charge(&key, 1_000_000)).await {
            panic!("charge {i} after the restart failed: {error}");
        }
    }
    quiet(&store).await;
}

/// A stopped Redis while the second connection opens beside the first:
/// every charge fails within about a budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_redis_fails_charges_while_a_connection_opens_beside() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    for batched in [true, false] {
        let store = RedisStore::builder(server.url())
            .pool_size(2)
            .timeout(Duration::from_millis(80))
            .batch_charges(batched)
            .build()
            .unwrap();
        let key = key(&format!("stopped-beside-{batched}"));
        store.charge(charge(&key, 1_000_000)).await.unwrap();
        let stopped = Stopped::new(&server);
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..20 {
            let (store, key) = (store.clone(), key.clone());
            calls.spawn(async move {
                let started = Instant::now();
                let result = store.charge(charge(&key, 1_000_000)).await;
                (result.is_ok(), started.elapsed())
            });
        }
        let answers = calls.join_all().await;
        drop(stopped);
        let slowest = answers.iter().map(|(_, took)| *took).max().unwrap();
        assert!(
            answers.iter().all(|(ok, _)| !ok),
            "batched {batched}: {answers:?}"
        );
        assert!(
            slowest < Duration::from_millis(300),
            "batched {batched}: {answers:?}"
        );
    }
}

/// A charge Redis applies after its caller stopped waiting counts among
/// the charges a shutdown waits for until its give-back has landed, not
/// only until its late answer came: Redis slow (the proxy passes one answer
/// every 200 ms, past the store's 80 ms), the late charge's answer comes at
/// about 200 ms and its give-back's at about 400 ms. Batched, and each
/// charge on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_charge_counts_in_flight_until_its_give_back_landed() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    for batched in [true, false] {
        let proxy = SlowProxy::start(server.port()).await;
        let store = ready(
            RedisStore::builder(proxy.url())
                .batch_charges(batched)
                .timeout(Duration::from_millis(80)),
        )
        .await;
        let key = key(&format!("late-room-{batched}"));
        proxy.slow(Duration::from_millis(200));
        let error = store.charge(charge(&key, 10)).await.unwrap_err();
        assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
        let deadline = Instant::now() + Duration::from_secs(5);
        while store.charges_in_flight() > 0 {
            assert!(Instant::now() < deadline, "batched {batched}: {store:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            store.given_back(),
            1,
            "batched {batched}: no charge in flight once its give-back landed"
        );
        assert_eq!(
            used(&server, &key),
            "",
            "given back whole: the first-use counter it made goes with it"
        );
    }
}

/// A Redis stalled past 3 s while charges keep coming, each sent on its
/// own (as behind a proxy, `batch_charges(false)`): once Redis is known
/// silent the store sends nothing more on its connections, so their
/// sockets' buffers never fill, the kernel never fails them (Linux's
/// `TCP_USER_TIMEOUT`), and no charge is lost on the wire to be applied,
/// never given back, once Redis resumes: Redis counts the admitted
/// charges only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_under_sustained_load_charges_only_the_admitted() {
    let _alone = alone().await;
    let server = redis_server_or_skip!();
    let store = ready(RedisStore::builder(server.url()).batch_charges(false)).await;
    // Charges of some hundred bytes: a second of them at the rate below
    // fills a socket's buffers (on loopback, some hundred kilobytes) a few
    // times over; what is sent until Redis is known silent does not.
    let keys: Vec<PeriodKey> = (0..20)
        .map(|i| {
            let allowance = format!("{i}-{}", "x".repeat(100));
            Namespace::default().key(&Subject::account("acme"), &allowance, "PT1H")
        })
        .collect();
    let mut admitted = 0u64;
    for key in &keys {
        assert!(store.charge(charge(key, 1_000_000)).await.unwrap().admitted);
        admitted += 1;
    }

    let mut stopped = Stopped::new(&server);
    let stalled = Instant::now();
    // 2 000 charges a second for a second, as requests keep coming.
    let mut tick = tokio::time::interval(Duration::from_micros(500));
    let mut calls = tokio::task::JoinSet::new();
    let mut sent = 0;
    while stalled.elapsed() < Duration::from_secs(1) {
        tick.tick().await;
        let store = store.clone();
        let key = keys[sent % keys.len()].clone();
        sent += 1;
        calls.spawn(async move { store.charge(charge(&key, 1_000_000)).await });
    }
    while let Some(result) = calls.join_next().await {
        if result.unwrap().is_ok_and(|outcome| outcome.admitted) {
            admitted += 1;
        }
    }
    // Past the 3 s the kernel gives data it cannot deliver.
    tokio::time::sleep(Duration::from_millis(5_000).saturating_sub(stalled.elapsed())).await;
    stopped.resume();
    quiet(&store).await;
    let counted: u64 = keys
        .iter()
        .map(|key| used(&server, key).parse::<u64>().unwrap())
        .sum();
    assert_eq!(
        counted, admitted,
        "Redis counts the admitted charges only ({sent} sent during the stall): {store:?}"
    );
    // Served again at once.
    assert!(
        store
            .charge(charge(&keys[0], 1_000_000))
            .await
            .unwrap()
            .admitted
    );
}
