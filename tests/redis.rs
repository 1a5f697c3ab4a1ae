//! The Redis store against a real `redis-server` of its own.

#![cfg(feature = "redis")]

mod redis_support;

mod interest;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use deadpool_redis::redis::{self, AsyncCommands};
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_quota::jiff::{SignedDuration, Timestamp};
use tower_quota::store::{ChargeLine, ChargeRequest, Lifetime, RedisStore, Store, StoreErrorKind};
use tower_quota::{
    FromHeader, Namespace, OnStoreError, PeriodKey, Quota, QuotaLayer, QuotaPolicy, Subject,
};

use redis_support::RedisServer;

fn store(server: &RedisServer) -> RedisStore {
    RedisStore::builder(server.url())
        .wait_timeout(Duration::from_secs(1))
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(1))
        .build()
        .expect("a Redis store")
}

async fn client(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("a plain connection to the test server")
}

fn key(allowance: &str) -> PeriodKey {
    Namespace::default().key(&Subject::account("acme"), allowance, "PT1H")
}

/// Whether `text` names `key` with its subject's id hidden, as logs show
/// keys: `quota:{account:#1a2b3c4d}:read:PT1H`.
fn names_hidden(text: &str, key: &PeriodKey) -> bool {
    let key = key.as_str();
    let (open, close) = (key.find('{').unwrap(), key.find('}').unwrap());
    let kind_end = open + key[open..].find(':').unwrap() + 1;
    let id = &key[kind_end..close];
    let hidden = format!("{}#", &key[..kind_end]);
    !text.contains(id)
        && text
            .find(&hidden)
            .is_some_and(|at| text[at + hidden.len() + 8..].starts_with(&key[close..]))
}

fn first_use(
    key: &PeriodKey,
    limit: u64,
    cost: u64,
    now: Timestamp,
    period: SignedDuration,
) -> ChargeRequest {
    ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![ChargeLine {
            key: key.clone(),
            limit,
            cost,
            lifetime: Lifetime::FirstUse {
                deadline: now + period,
            },
            shadow_limit: None,
        }],
    }
}

fn calendar(
    key: &PeriodKey,
    limit: u64,
    cost: u64,
    now: Timestamp,
    end: Timestamp,
) -> ChargeRequest {
    ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![ChargeLine {
            key: key.clone(),
            limit,
            cost,
            lifetime: Lifetime::Calendar { start: now, end },
            shadow_limit: None,
        }],
    }
}

fn hour() -> SignedDuration {
    SignedDuration::from_hours(1)
}

/// Charges `request`, which must be admitted.
async fn admit(store: &RedisStore, request: ChargeRequest) {
    assert!(store.charge(request).await.unwrap().admitted);
}

/// A charge's instant, its window's end and an hour's ttl, in milliseconds,
/// as a test passes them to the script by hand.
fn raw_times(now: Timestamp, end: Timestamp) -> (String, String, String) {
    (
        now.as_millisecond().to_string(),
        end.as_millisecond().to_string(),
        hour().as_millis().to_string(),
    )
}

#[tokio::test]
async fn a_first_use_counter_is_a_hash_of_count_and_first_call_with_a_fixed_deadline() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let mut redis = client(&server).await;
    let key = key("read");
    // Redis keeps the first call to the millisecond.
    let t0 = Timestamp::from_millisecond(Timestamp::now().as_millisecond()).unwrap();
    store
        .charge(first_use(&key, 10, 1, t0, hour()))
        .await
        .unwrap();

    let kind: String = redis::cmd("TYPE")
        .arg(key.as_str())
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(kind, "hash");
    let fields: Vec<(String, i64)> = redis.hgetall(key.as_str()).await.unwrap();
    assert!(fields.contains(&("n".into(), 1)), "{fields:?}");
    assert!(
        fields.contains(&("t".into(), t0.as_millisecond())),
        "{fields:?}"
    );
    let ttl0: i64 = redis.pttl(key.as_str()).await.unwrap();
    assert!(
        (3_599_000..=3_600_000).contains(&ttl0),
        "deadline set at creation: {ttl0}"
    );

    // Later hits, each asking for a deadline an hour from its own now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..3 {
        let outcome = store
            .charge(first_use(&key, 10, 1, Timestamp::now(), hour()))
            .await
            .unwrap();
        assert_eq!(outcome.usage[0].first_call, Some(t0));
    }
    let ttl1: i64 = redis.pttl(key.as_str()).await.unwrap();
    assert!(
        ttl1 <= ttl0 - 250,
        "hits must not push the deadline: {ttl0} then {ttl1}"
    );
    let usage = store
        .peek(first_use(&key, 10, 0, Timestamp::now(), hour()))
        .await
        .unwrap();
    assert_eq!(usage[0].used, 4);
    assert_eq!(usage[0].first_call, Some(t0), "peek returns the first call");
    let off = usage[0].resets_at.duration_since(t0 + hour()).abs();
    assert!(
        off < SignedDuration::from_millis(250),
        "reset from the remaining life, off by {off:?}"
    );
}

#[tokio::test]
async fn a_string_counter_from_another_tool_is_counted_in_place_and_dated() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let mut redis = client(&server).await;
    let key = key("legacy");
    let () = redis.set(key.as_str(), 5).await.unwrap();

    let outcome = store
        .charge(first_use(&key, 10, 1, Timestamp::now(), hour()))
        .await
        .unwrap();
    assert!(outcome.admitted);
    assert_eq!(outcome.usage[0].used, 6);
    assert_eq!(outcome.usage[0].first_call, None);
    let kind: String = redis::cmd("TYPE")
        .arg(key.as_str())
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(
        kind, "string",
        "the counter is charged in place, not rewritten"
    );
    let ttl: i64 = redis.pttl(key.as_str()).await.unwrap();
    assert!(
        (3_599_000..=3_600_000).contains(&ttl),
        "healed to one period from now: {ttl}"
    );

    assert_eq!(
        store
            .refund(Timestamp::now(), key.clone(), 10)
            .await
            .unwrap(),
        Some(0)
    );
    let after: i64 = redis.pttl(key.as_str()).await.unwrap();
    assert!(
        after <= ttl && after > ttl - 1_000,
        "a refund keeps the deadline: {ttl} then {after}"
    );
}

#[tokio::test]
async fn calendar_counters_live_past_their_window_by_grace_and_jitter() {
    let server = redis_server_or_skip!();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(1))
        .calendar_grace(Duration::from_secs(10))
        .calendar_jitter(Duration::from_secs(5))
        .build()
        .unwrap();
    let mut redis = client(&server).await;
    let now = Timestamp::now();
    let end = now + SignedDuration::from_secs(60);
    let mut ttls = Vec::new();
    for i in 0..20 {
        let key =
            Namespace::default().key(&Subject::account(format!("c{i}")), "read", "2026-12-02");
        let outcome = store.charge(calendar(&key, 10, 1, now, end)).await.unwrap();
        assert_eq!(
            outcome.usage[0].resets_at, end,
            "the reset comes from the calendar"
        );
        let ttl: i64 = redis.pttl(key.as_str()).await.unwrap();
        assert!(
            (69_000..=75_000).contains(&ttl),
            "end + grace + jitter: {ttl}"
        );
        ttls.push(ttl / 100);
        // A second charge keeps the deadline.
        store
            .charge(calendar(&key, 10, 1, Timestamp::now(), end))
            .await
            .unwrap();
        let again: i64 = redis.pttl(key.as_str()).await.unwrap();
        assert!(again <= ttl, "set only when missing: {ttl} then {again}");
    }
    ttls.sort_unstable();
    ttls.dedup();
    assert!(ttls.len() > 5, "jitter spreads the deadlines: {ttls:?}");
}

#[tokio::test]
async fn a_refund_never_creates_a_counter_nor_moves_its_deadline() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let mut redis = client(&server).await;
    let missing = key("never");
    assert_eq!(
        store
            .refund(Timestamp::now(), missing.clone(), 3)
            .await
            .unwrap(),
        None
    );
    let exists: bool = redis.exists(missing.as_str()).await.unwrap();
    assert!(!exists, "a refund must not create a counter");

    let key = key("refund");
    store
        .charge(first_use(&key, 10, 4, Timestamp::now(), hour()))
        .await
        .unwrap();
    let before: i64 = redis.pttl(key.as_str()).await.unwrap();
    assert_eq!(
        store
            .refund(Timestamp::now(), key.clone(), 3)
            .await
            .unwrap(),
        Some(1)
    );
    assert_eq!(
        store
            .refund(Timestamp::now(), key.clone(), 3)
            .await
            .unwrap(),
        Some(0),
        "never below zero"
    );
    let after: i64 = redis.pttl(key.as_str()).await.unwrap();
    assert!(
        after <= before,
        "a refund must not push the deadline: {before} then {after}"
    );
    assert!(after > 0, "a refund must not strip the deadline");
}

#[tokio::test]
async fn preload_loads_the_script_and_reports_an_unreachable_server() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    assert_eq!(server.cli(&["script", "exists", store.script_sha()]), "0");
    store.preload().await.unwrap();
    assert_eq!(server.cli(&["script", "exists", store.script_sha()]), "1");

    let (dead, _reserved) = redis_support::dead_address();
    let nowhere = RedisStore::new(format!("redis://{dead}/")).unwrap();
    let error = nowhere.preload().await.unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{error}");
}

#[tokio::test]
async fn the_script_is_loaded_again_after_a_flush() {
    let server = redis_server_or_skip!();
    for batched in [true, false] {
        let store = RedisStore::builder(server.url())
            .batch_charges(batched)
            .build()
            .unwrap();
        let key = key(&format!("flush-{batched}"));
        store
            .charge(first_use(&key, 10, 1, Timestamp::now(), hour()))
            .await
            .unwrap();
        assert_eq!(server.cli(&["script", "flush"]), "OK");
        let exists = server.cli(&["script", "exists", store.script_sha()]);
        assert_eq!(exists, "0");
        let outcome = store
            .charge(first_use(&key, 10, 1, Timestamp::now(), hour()))
            .await
            .unwrap();
        assert_eq!(outcome.usage[0].used, 2, "batched {batched}");
        assert_eq!(server.cli(&["script", "exists", store.script_sha()]), "1");
    }
}

#[tokio::test]
async fn a_charge_that_times_out_is_an_error_and_is_not_sent_again() {
    let server = redis_server_or_skip!();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let key = key("slow");
    store
        .charge(first_use(&key, 10, 1, Timestamp::now(), hour()))
        .await
        .unwrap();

    // Hold every client's commands for 600 ms, as a busy server would.
    assert_eq!(server.cli(&["client", "pause", "600", "all"]), "OK");
    let started = Instant::now();
    let error = store
        .charge(first_use(&key, 10, 1, Timestamp::now(), hour()))
        .await
        .expect_err("a server that does not answer in time is an error");
    assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
    assert!(
        started.elapsed() < Duration::from_millis(400),
        "timed out after {:?}",
        started.elapsed()
    );

    tokio::time::sleep(Duration::from_millis(900)).await;
    let used = server.cli(&["hget", key.as_str(), "n"]);
    assert_eq!(
        used, "1",
        "the timed-out charge ran once, after the pause, and was given back"
    );
    let outcome = store
        .charge(first_use(&key, 10, 0, Timestamp::now(), hour()))
        .await
        .unwrap();
    assert_eq!(
        outcome.usage[0].used.to_string(),
        used,
        "the store works again after a timeout"
    );
}

#[tokio::test]
async fn requests_succeed_again_after_a_restart() {
    let mut server = redis_server_or_skip!();
    let store = RedisStore::new(server.url()).unwrap();
    let key = key("restart");
    store
        .charge(first_use(&key, 10, 1, Timestamp::now(), hour()))
        .await
        .unwrap();

    server.kill();
    let started = Instant::now();
    let error = store
        .charge(first_use(&key, 10, 1, Timestamp::now(), hour()))
        .await
        .expect_err("a dead server is an error");
    assert!(
        matches!(
            error.kind(),
            StoreErrorKind::Unavailable | StoreErrorKind::Timeout
        ),
        "{error}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "failed after {:?}",
        started.elapsed()
    );
    let error = store
        .charge(first_use(&key, 10, 1, Timestamp::now(), hour()))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{error}");

    server.restart();
    let outcome = store
        .charge(first_use(&key, 10, 1, Timestamp::now(), hour()))
        .await
        .expect("the first charge after the restart succeeds");
    // Nothing was persisted: the restart lost the counter.
    assert_eq!(outcome.usage[0].used, 1);
}

#[tokio::test]
async fn out_of_memory_under_noeviction_is_a_store_error() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let key = key("oom");
    store
        .charge(first_use(&key, 10, 1, Timestamp::now(), hour()))
        .await
        .unwrap();
    assert_eq!(server.cli(&["config", "set", "maxmemory", "1"]), "OK");
    let error = store
        .charge(first_use(&key, 10, 1, Timestamp::now(), hour()))
        .await
        .expect_err("a full server refuses the charge");
    assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{error}");
    assert_eq!(server.cli(&["config", "set", "maxmemory", "0"]), "OK");
    let outcome = store
        .charge(first_use(&key, 10, 1, Timestamp::now(), hour()))
        .await
        .unwrap();
    assert_eq!(outcome.usage[0].used, 2, "the refused charge spent nothing");
}

/// A refund or an add Redis refuses for now (out of memory under
/// `noeviction`) applied nothing: its error says so (never sent), and the
/// layer sends it again once Redis takes writes again, so that a request
/// not served does not stay charged.
#[tokio::test]
async fn a_change_refused_for_now_is_sent_again() {
    use axum::{body::Body, http::Request, routing::get, Router};
    use tower::ServiceExt;
    use tower_quota::{FromHeader, Quota, QuotaPolicy, Subject};

    let server = redis_server_or_skip!();
    let store = store(&server);
    let key = key("for-now");
    admit(&store, first_use(&key, 10, 1, Timestamp::now(), hour())).await;
    assert_eq!(server.cli(&["config", "set", "maxmemory", "1"]), "OK");
    let refund = store.refund(Timestamp::now(), key.clone(), 1).await;
    let error = refund.expect_err("a full server refuses the refund");
    assert!(error.is_unsent(), "{error}");
    let add = store.add(Timestamp::now(), key.clone(), 1).await;
    assert!(add.expect_err("and the add").is_unsent());
    assert_eq!(server.cli(&["config", "set", "maxmemory", "0"]), "OK");

    // Through the layer: a 500 given back while Redis is full.
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .refund_server_errors(true)
        .build();
    let port = server.port();
    let app = Router::new()
        .route(
            "/",
            get(move || async move {
                let _ = redis_support::cli(port, &["config", "set", "maxmemory", "1"]);
                http::StatusCode::INTERNAL_SERVER_ERROR
            }),
        )
        .layer(policy.layer(Quota::daily(10)));
    let request = Request::get("/")
        .header("x-account-id", "acme")
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), http::StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(server.cli(&["config", "set", "maxmemory", "0"]), "OK");
    let handle = policy.handle();
    let mut used = u64::MAX;
    for _ in 0..50 {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let usage = handle.usage(&Subject::account("acme")).await.unwrap();
        used = usage
            .iter()
            .find(|u| u.name() == "default-day")
            .unwrap()
            .used();
        if used == 0 {
            break;
        }
    }
    assert_eq!(used, 0, "given back once Redis took writes again");
}

#[tokio::test]
async fn an_unreachable_server_fails_fast() {
    let (dead, _reserved) = redis_support::dead_address();
    let store = RedisStore::new(format!("redis://{dead}/")).unwrap();
    let started = Instant::now();
    let error = store
        .charge(first_use(&key("x"), 10, 1, Timestamp::now(), hour()))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{error}");
    assert!(started.elapsed() < Duration::from_millis(500));
}

#[tokio::test]
async fn the_server_clock_follows_redis() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let clock = store.server_clock(Duration::from_millis(50)).await.unwrap();
    // Same machine, same clock: the offset is the measuring error only.
    assert!(
        clock.offset().abs() < SignedDuration::from_millis(200),
        "{clock:?}"
    );
    use tower_quota::Clock;
    let off = clock.now().duration_since(Timestamp::now()).abs();
    assert!(off < SignedDuration::from_millis(200));
}

fn app(store: RedisStore, limit: u64) -> Router {
    Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store)
            .store_timeout(Some(Duration::from_secs(2)))
            .build()
            .layer(Quota::daily(limit))
            .quota(Quota::rolling(limit * 10, Duration::from_secs(3600))),
    )
}

fn call(account: &str) -> Request<Body> {
    Request::get("/")
        .header("x-account-id", account)
        .body(Body::empty())
        .unwrap()
}

/// A shadow counter at the most Redis counts exactly (2^53 - 1) takes no
/// more and refuses nothing: beside an enforced quota, the charge goes again
/// without it (a second call, answered later), and the enforced quota
/// counts and refuses as it would alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_counter_at_the_most_redis_counts_refuses_nothing() {
    let server = redis_server_or_skip!();
    let most = store(&server).max_count();
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store(&server))
        .store_timeout(Some(Duration::from_secs(2)))
        .build();
    let cost = |parts: &http::request::Parts| {
        Ok(parts
            .headers
            .get("x-cost")
            .map_or(1, |v| v.to_str().unwrap().parse().unwrap()))
    };
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        policy
            .layer(Quota::monthly(most).allowance("trial").shadow())
            .cost_fn(cost),
    );
    let heavy = Request::get("/")
        .header("x-account-id", "acme")
        .header("x-cost", most.to_string())
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        app.clone().oneshot(heavy).await.unwrap().status(),
        StatusCode::OK
    );
    for _ in 0..3 {
        let reply = app.clone().oneshot(call("acme")).await.unwrap();
        assert_eq!(reply.status(), StatusCode::OK);
    }
    let both = Router::new().route("/", get(|| async { "ok" })).layer(
        policy
            .layer(Quota::daily(2).allowance("read"))
            .quota(Quota::monthly(most).allowance("trial").shadow()),
    );
    for _ in 0..2 {
        let reply = both.clone().oneshot(call("acme")).await.unwrap();
        assert_eq!(reply.status(), StatusCode::OK);
    }
    let refused = both.clone().oneshot(call("acme")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let usage = policy
        .handle()
        .usage(&tower_quota::Subject::account("acme"))
        .await
        .unwrap();
    let used = |name: &str| usage.iter().find(|u| u.name() == name).unwrap().used();
    assert_eq!(used("read-day"), 2);
    assert_eq!(used("trial-month"), most);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_one_redis_enforce_one_quota_exactly() {
    let server = redis_server_or_skip!();
    let instances = [app(store(&server), 25), app(store(&server), 25)];
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..80 {
        let app = instances[i % 2].clone();
        calls.spawn(async move { app.oneshot(call("shared")).await.unwrap().status() });
    }
    let mut ok = 0;
    let mut refused = 0;
    while let Some(status) = calls.join_next().await {
        match status.unwrap() {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!((ok, refused), (25, 55));
    let other = instances[0].clone().oneshot(call("other")).await.unwrap();
    assert_eq!(
        other.status(),
        StatusCode::OK,
        "subjects do not share counters"
    );
}

#[tokio::test]
async fn a_dead_server_is_answered_by_the_layer_policy() {
    let mut server = redis_server_or_skip!();
    let closed = app(RedisStore::new(server.url()).unwrap(), 5);
    let open = Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(RedisStore::new(server.url()).unwrap())
            .on_store_error(OnStoreError::FailOpen)
            .build()
            .layer(Quota::daily(5)),
    );
    assert_eq!(
        closed.clone().oneshot(call("a")).await.unwrap().status(),
        StatusCode::OK
    );
    server.kill();
    let refused = closed.clone().oneshot(call("a")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(refused.headers().contains_key("retry-after"));
    assert_eq!(
        open.clone().oneshot(call("a")).await.unwrap().status(),
        StatusCode::OK
    );
    server.restart();
    assert_eq!(
        closed.oneshot(call("a")).await.unwrap().status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn a_store_on_an_existing_pool_charges_and_times_out_the_same() {
    let server = redis_server_or_skip!();
    let pool = deadpool_redis::Config::from_url(server.url())
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap();
    let store = RedisStore::builder_from_pool(pool)
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let key = key("pooled");
    let outcome = store
        .charge(first_use(&key, 2, 2, Timestamp::now(), hour()))
        .await
        .unwrap();
    assert!(outcome.admitted);
    let refused = store
        .charge(first_use(&key, 2, 1, Timestamp::now(), hour()))
        .await
        .unwrap();
    assert!(!refused.admitted);

    assert_eq!(server.cli(&["client", "pause", "500", "all"]), "OK");
    let error = store
        .charge(first_use(&key, 2, 0, Timestamp::now(), hour()))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
}

#[tokio::test]
async fn a_key_listed_twice_is_charged_twice_as_in_memory() {
    let server = redis_server_or_skip!();
    let redis = store(&server);
    let memory = tower_quota::MemoryStore::new();
    let key = key("twice");
    let now = Timestamp::now();
    let request = |cost| ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![
            first_use(&key, 3, cost, now, hour()).lines.remove(0),
            first_use(&key, 3, cost, now, hour()).lines.remove(0),
        ],
    };
    for cost in [1, 1, 0] {
        let a = redis.charge(request(cost)).await.unwrap();
        let b = memory.charge(request(cost)).await.unwrap();
        assert_eq!(a.admitted, b.admitted);
        assert_eq!(
            a.usage.iter().map(|u| u.used).collect::<Vec<_>>(),
            b.usage.iter().map(|u| u.used).collect::<Vec<_>>()
        );
    }
}

/// A server restarted within the second in which a connection used since
/// is not pinged: the store's connections to the old process are closed,
/// and a charge queued on one would fail as one lost on the wire (a 503
/// under fail closed, with the server back and healthy). Each is checked
/// first, having been quiet, and the charges go on fresh connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quick_restart_costs_no_request() {
    let mut server = redis_server_or_skip!();
    let store = RedisStore::builder(server.url())
        .pool_size(8)
        .wait_timeout(Duration::from_secs(1))
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let key = key("quick");
    // Open several connections at once.
    let mut charges = tokio::task::JoinSet::new();
    for _ in 0..32 {
        let store = store.clone();
        let key = key.clone();
        charges.spawn(async move {
            store
                .charge(first_use(&key, 100, 1, Timestamp::now(), hour()))
                .await
        });
    }
    while let Some(result) = charges.join_next().await {
        result.unwrap().unwrap();
    }
    assert!(format!("{store:?}").contains("pool_size: 8"));

    // Back within the second in which idle connections are not pinged.
    server.restart();
    // A read, likewise.
    store
        .peek(first_use(&key, 100, 0, Timestamp::now(), hour()))
        .await
        .unwrap();
    for i in 0..10 {
        if let Err(error) = store
            .charge(first_use(&key, 100, 1, Timestamp::now(), hour()))
            .await
        {
            panic!("charge {i} after the restart failed: {error}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_idle_for_a_second_is_checked_before_a_charge_is_sent_on_it() {
    let mut server = redis_server_or_skip!();
    let store = RedisStore::builder(server.url())
        .pool_size(2)
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let key = key("idle");
    // Both connections open, and used.
    for _ in 0..4 {
        store
            .charge(first_use(&key, 100, 1, Timestamp::now(), hour()))
            .await
            .unwrap();
    }
    server.restart();
    // Both connections are now dead, and idle for more than a second: the
    // first one used is pinged before a charge is sent on it, found dead,
    // and both are replaced.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    for i in 0..10 {
        let outcome = store
            .charge(first_use(&key, 100, 1, Timestamp::now(), hour()))
            .await
            .unwrap_or_else(|e| panic!("charge {i} after the idle second failed: {e}"));
        // Nothing was persisted: the restart lost the counter.
        assert_eq!(outcome.usage[0].used, i + 1);
    }
}

/// Records the message and key of every event.
#[derive(Clone, Default)]
struct Recorder(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl tracing::Subscriber for Recorder {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Text(String);
        impl tracing::field::Visit for Text {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push_str(&format!("{}={:?} ", field.name(), value));
            }
        }
        let mut text = Text(format!("{} ", event.metadata().level()));
        event.record(&mut text);
        self.0.lock().unwrap().push(text.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[tokio::test]
async fn healing_an_undated_counter_is_logged() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let mut redis = client(&server).await;
    // Ids are often API keys: logs name the subject by a hash only.
    let key = Namespace::default().key(&Subject::account("sk_live_secret"), "undated-log", "PT1H");
    let first_call = Timestamp::now() - SignedDuration::from_mins(10);
    let () = redis
        .hset_multiple(
            key.as_str(),
            &[("n", 2), ("t", first_call.as_millisecond())],
        )
        .await
        .unwrap();

    let recorder = Recorder::default();
    let _guard = tracing::subscriber::set_default(recorder.clone());
    let _interest = interest::every_subscriber_asked();
    // A peek writes nothing: it logs that the counter is undated.
    store
        .peek(first_use(&key, 10, 0, Timestamp::now(), hour()))
        .await
        .unwrap();
    let outcome = store
        .charge(first_use(&key, 10, 1, Timestamp::now(), hour()))
        .await
        .unwrap();
    assert_eq!(outcome.usage[0].used, 3);
    let ttl: i64 = redis.pttl(key.as_str()).await.unwrap();
    // First call ten minutes ago, a period of an hour: fifty minutes left.
    assert!(
        (2_999_000..=3_000_000).contains(&ttl),
        "first call + period: {ttl}"
    );
    let events = recorder.0.lock().unwrap().clone();
    let logged = |what: &str| {
        events.iter().any(|e| {
            e.starts_with("WARN")
                && e.contains("key=\"quota:{account:#")
                && e.contains("}:undated-log:PT1H\"")
                && e.contains(what)
        })
    };
    assert!(logged("the next charge heals it"), "{events:?}");
    assert!(logged("first call plus one period"), "{events:?}");
    assert!(
        events.iter().all(|e| !e.contains("sk_live_secret")),
        "a log names the subject's id: {events:?}"
    );
}

#[tokio::test]
async fn a_value_that_is_no_counter_is_refused_before_any_line_is_charged() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let mut redis = client(&server).await;
    let now = Timestamp::now();
    let fresh = key("fresh");
    for (name, setup) in [
        ("text", vec!["SET", "abc"]),
        ("fraction", vec!["SET", "5.5"]),
        ("negative", vec!["SET", "-3"]),
        ("hash without n", vec!["HSET", "x", "1"]),
        ("list", vec!["RPUSH", "a"]),
    ] {
        let foreign = key(name);
        let mut command = redis::cmd(setup[0]);
        command.arg(foreign.as_str());
        for arg in &setup[1..] {
            command.arg(*arg);
        }
        let () = command.query_async(&mut redis).await.unwrap();
        let () = redis.pexpire(foreign.as_str(), 5_000).await.unwrap();

        let mut request = first_use(&fresh, 10, 1, now, hour());
        request
            .lines
            .extend(first_use(&foreign, 10, 1, now, hour()).lines);
        let error = store.charge(request).await.expect_err(name);
        assert_eq!(error.kind(), StoreErrorKind::Other, "{name}");
        assert!(
            error.to_string().contains("not a counter"),
            "{name}: {error}"
        );
        // Keys name subjects, and errors are logged: the id is hidden.
        assert!(
            !error.to_string().contains("acme") && error.to_string().contains("{account:#"),
            "{name}: {error}"
        );
        let exists: bool = redis.exists(fresh.as_str()).await.unwrap();
        assert!(
            !exists,
            "{name}: the first line was charged although the request failed"
        );
        let ttl: i64 = redis.pttl(foreign.as_str()).await.unwrap();
        assert!(
            (1..=5_000).contains(&ttl),
            "{name}: the foreign key's deadline moved to {ttl}"
        );
        let refund = store.refund(now, foreign.clone(), 1).await;
        assert!(refund.is_err(), "{name}: a refund on it must fail too");
    }
}

#[tokio::test]
async fn limits_beyond_what_lua_counts_exactly_are_unlimited() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let key = key("huge");
    let outcome = store
        .charge(first_use(&key, u64::MAX, 1_000, Timestamp::now(), hour()))
        .await
        .unwrap();
    assert!(outcome.admitted);
    assert_eq!(outcome.usage[0].used, 1_000);
    assert_eq!(outcome.usage[0].remaining(), u64::MAX - 1_000);
}

/// The key's deadline as Redis holds it (ms since the epoch; -1 none, -2 no
/// key; `None` before Redis 7, which has no `PEXPIRETIME`), and its remaining
/// life (`PTTL`).
async fn deadline_of(
    redis: &mut redis::aio::MultiplexedConnection,
    key: &str,
) -> (Option<i64>, i64) {
    let at: Option<i64> = redis::cmd("PEXPIRETIME")
        .arg(key)
        .query_async(redis)
        .await
        .ok();
    let pttl: i64 = redis.pttl(key).await.unwrap();
    (at, pttl)
}

/// The key's value in Redis's serialization, to tell whether it changed.
async fn dump(redis: &mut redis::aio::MultiplexedConnection, key: &str) -> Vec<u8> {
    redis::cmd("DUMP")
        .arg(key)
        .query_async(redis)
        .await
        .unwrap()
}

#[tokio::test]
async fn an_add_keeps_the_exact_deadline_and_never_creates_a_counter() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let mut redis = client(&server).await;

    let missing = key("add-never");
    assert_eq!(
        store
            .add(Timestamp::now(), missing.clone(), 3)
            .await
            .unwrap(),
        None
    );
    let exists: bool = redis.exists(missing.as_str()).await.unwrap();
    assert!(!exists, "an add must not create a counter");

    // A hash counter, taken past its limit.
    let hash = key("add-hash");
    let t0 = Timestamp::now();
    store
        .charge(first_use(&hash, 10, 4, t0, hour()))
        .await
        .unwrap();
    let (at, before) = deadline_of(&mut redis, hash.as_str()).await;
    assert!(before > 0, "a dated counter: {before}");
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        store.add(Timestamp::now(), hash.clone(), 3).await.unwrap(),
        Some(7)
    );
    assert_eq!(
        store
            .add(Timestamp::now(), hash.clone(), 100)
            .await
            .unwrap(),
        Some(107),
        "an add is not checked against the limit"
    );
    let (at_after, after) = deadline_of(&mut redis, hash.as_str()).await;
    assert_eq!(at_after, at, "an add must not move the deadline");
    assert!(
        after <= before - 20 && after > 0,
        "the remaining life only runs down: {before} then {after}"
    );
    let fields: Vec<(String, i64)> = redis.hgetall(hash.as_str()).await.unwrap();
    assert!(fields.contains(&("n".into(), 107)), "{fields:?}");
    assert!(
        fields.contains(&("t".into(), t0.as_millisecond())),
        "an add keeps the first call: {fields:?}"
    );

    // A string counter from another tool, dated and undated.
    let string = key("add-string");
    let () = redis.pset_ex(string.as_str(), 5, 60_000).await.unwrap();
    let (at, before) = deadline_of(&mut redis, string.as_str()).await;
    assert_eq!(
        store
            .add(Timestamp::now(), string.clone(), 2)
            .await
            .unwrap(),
        Some(7)
    );
    let kind: String = redis::cmd("TYPE")
        .arg(string.as_str())
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(kind, "string", "the counter is added to in place");
    let count: i64 = redis.get(string.as_str()).await.unwrap();
    assert_eq!(count, 7);
    let (at_after, after) = deadline_of(&mut redis, string.as_str()).await;
    assert_eq!(at_after, at, "an add must not move the deadline");
    assert!(
        after <= before && after > 0,
        "the remaining life only runs down: {before} then {after}"
    );
    let undated = key("add-undated");
    let () = redis.set(undated.as_str(), 5).await.unwrap();
    assert_eq!(
        store
            .add(Timestamp::now(), undated.clone(), 1)
            .await
            .unwrap(),
        Some(6)
    );
    assert_eq!(
        deadline_of(&mut redis, undated.as_str()).await.1,
        -1,
        "an add leaves dating a counter to the next charge"
    );

    // An expired counter stays expired.
    let short = key("add-expired");
    store
        .charge(first_use(
            &short,
            10,
            1,
            Timestamp::now(),
            SignedDuration::from_millis(50),
        ))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        store.add(Timestamp::now(), short.clone(), 1).await.unwrap(),
        None
    );
    let exists: bool = redis.exists(short.as_str()).await.unwrap();
    assert!(!exists, "an add must not bring an expired counter back");
}

#[tokio::test]
async fn an_add_to_a_value_that_is_no_counter_is_an_error_and_writes_nothing() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let mut redis = client(&server).await;
    for (name, setup) in [
        ("text", vec!["SET", "abc"]),
        ("fraction", vec!["SET", "5.5"]),
        ("negative", vec!["SET", "-3"]),
        ("hash without n", vec!["HSET", "x", "1"]),
        ("list", vec!["RPUSH", "a"]),
    ] {
        let foreign = key(name);
        let mut command = redis::cmd(setup[0]);
        command.arg(foreign.as_str());
        for arg in &setup[1..] {
            command.arg(*arg);
        }
        let () = command.query_async(&mut redis).await.unwrap();
        let () = redis.pexpire(foreign.as_str(), 60_000).await.unwrap();
        let value = dump(&mut redis, foreign.as_str()).await;
        let (at, before) = deadline_of(&mut redis, foreign.as_str()).await;

        let error = store
            .add(Timestamp::now(), foreign.clone(), 1)
            .await
            .expect_err(name);
        assert_eq!(error.kind(), StoreErrorKind::Other, "{name}");
        assert!(
            error.to_string().contains("not a counter"),
            "{name}: {error}"
        );
        // Keys name subjects, and errors are logged: the id is hidden.
        assert!(
            !error.to_string().contains("acme") && error.to_string().contains("{account:#"),
            "{name}: {error}"
        );
        assert_eq!(
            dump(&mut redis, foreign.as_str()).await,
            value,
            "{name}: the value changed"
        );
        let (at_after, after) = deadline_of(&mut redis, foreign.as_str()).await;
        assert_eq!(at_after, at, "{name}: the deadline moved");
        assert!(
            after <= before && after > 0,
            "{name}: the deadline moved: {before} then {after}"
        );
    }
}

#[tokio::test]
async fn an_add_beyond_what_lua_counts_exactly_is_an_error_and_writes_nothing() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let mut redis = client(&server).await;
    const EXACT: u64 = 1 << 53;

    let huge = key("add-huge");
    store
        .charge(first_use(
            &huge,
            u64::MAX,
            EXACT - 10,
            Timestamp::now(),
            hour(),
        ))
        .await
        .unwrap();
    let (at, before) = deadline_of(&mut redis, huge.as_str()).await;
    assert_eq!(
        store.add(Timestamp::now(), huge.clone(), 10).await.unwrap(),
        Some(EXACT),
        "up to 2^53 is counted"
    );
    for amount in [1, EXACT, u64::MAX] {
        let error = store
            .add(Timestamp::now(), huge.clone(), amount)
            .await
            .expect_err("beyond 2^53");
        assert_eq!(error.kind(), StoreErrorKind::Other, "{error}");
        assert!(error.to_string().contains("2^53"), "{error}");
    }
    let count: i64 = redis.hget(huge.as_str(), "n").await.unwrap();
    assert_eq!(count, EXACT as i64, "a refused add writes nothing");
    let (at_after, after) = deadline_of(&mut redis, huge.as_str()).await;
    assert_eq!(at_after, at, "an add must not move the deadline");
    assert!(after <= before && after > 0, "{before} then {after}");

    // From zero: an amount a double would round down to 2^53 is refused too.
    let empty = key("add-from-zero");
    store
        .charge(first_use(&empty, 10, 1, Timestamp::now(), hour()))
        .await
        .unwrap();
    assert_eq!(
        store
            .refund(Timestamp::now(), empty.clone(), 1)
            .await
            .unwrap(),
        Some(0)
    );
    for amount in [EXACT + 1, EXACT, u64::MAX] {
        let error = store
            .add(Timestamp::now(), empty.clone(), amount)
            .await
            .expect_err("beyond 2^53");
        assert!(error.to_string().contains("2^53"), "{amount}: {error}");
    }
    let count: i64 = redis.hget(empty.as_str(), "n").await.unwrap();
    assert_eq!(count, 0, "a refused add writes nothing");
    assert_eq!(
        store
            .add(Timestamp::now(), empty.clone(), EXACT - 1)
            .await
            .unwrap(),
        Some(EXACT - 1)
    );
}

#[tokio::test]
async fn a_settle_beyond_what_lua_counts_exactly_is_an_error_and_writes_nothing() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let mut redis = client(&server).await;
    const EXACT: u64 = 1 << 53;
    let debt = |key: &PeriodKey, amount: u64| tower_quota::store::Debt {
        key: key.clone(),
        amount,
        lifetime: Lifetime::FirstUse {
            deadline: Timestamp::now() + hour(),
        },
        since: Timestamp::now(),
        id: redis_support::settle_id(),
    };

    let live = key("settle-huge");
    store
        .charge(first_use(
            &live,
            u64::MAX,
            EXACT - 10,
            Timestamp::now(),
            hour(),
        ))
        .await
        .unwrap();
    assert_eq!(
        store
            .settle_debt(Timestamp::now(), debt(&live, 10))
            .await
            .unwrap(),
        Some(EXACT),
        "up to 2^53 is counted"
    );
    for amount in [1, EXACT, u64::MAX] {
        let error = store
            .settle_debt(Timestamp::now(), debt(&live, amount))
            .await
            .expect_err("beyond 2^53");
        assert!(error.to_string().contains("2^53"), "{amount}: {error}");
    }
    let count: i64 = redis.hget(live.as_str(), "n").await.unwrap();
    assert_eq!(count, EXACT as i64, "a refused settle writes nothing");

    // No counter yet: a debt of 2^53 or more makes none.
    let none = key("settle-from-nothing");
    for amount in [EXACT, u64::MAX] {
        assert!(store
            .settle_debt(Timestamp::now(), debt(&none, amount))
            .await
            .is_err());
    }
    let exists: bool = redis.exists(none.as_str()).await.unwrap();
    assert!(!exists, "a refused settle creates nothing");
    assert_eq!(
        store
            .settle_debt(Timestamp::now(), debt(&none, EXACT - 1))
            .await
            .unwrap(),
        Some(EXACT - 1)
    );
}

/// Everything Redis holds about a key: its value, its deadline and its
/// remaining life.
async fn snapshot(
    redis: &mut redis::aio::MultiplexedConnection,
    key: &str,
) -> (Option<Vec<u8>>, Option<i64>, i64) {
    let value: Option<Vec<u8>> = redis::cmd("DUMP")
        .arg(key)
        .query_async(redis)
        .await
        .unwrap();
    let (at, pttl) = deadline_of(redis, key).await;
    (value, at, pttl)
}

/// Whether `after` is `before`, the remaining life having only run down.
#[track_caller]
fn unchanged(
    before: &(Option<Vec<u8>>, Option<i64>, i64),
    after: &(Option<Vec<u8>>, Option<i64>, i64),
    what: &str,
) {
    assert_eq!(after.0, before.0, "{what}: the value changed");
    assert_eq!(after.1, before.1, "{what}: the deadline changed");
    if before.2 < 0 {
        assert_eq!(after.2, before.2, "{what}: the remaining life changed");
    } else {
        assert!(
            after.2 <= before.2 && after.2 > 0,
            "{what}: the deadline moved: {} then {}",
            before.2,
            after.2
        );
    }
}

/// The latest instant, in milliseconds, that a timestamp takes
/// (9999-12-30T22:00:00Z), and one millisecond past it.
const LAST_INSTANT: i64 = 253_402_207_200_000;
const PAST_THE_LAST_INSTANT: &str = "253402207200001";

/// Values that are no counter, each as the commands that plant it.
fn foreign_values() -> Vec<(String, Vec<Vec<String>>)> {
    let owned = |args: &[&str]| args.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let mut values = vec![
        ("list".to_string(), vec![owned(&["RPUSH", "a"])]),
        ("set".to_string(), vec![owned(&["SADD", "a"])]),
        ("zset".to_string(), vec![owned(&["ZADD", "1", "a"])]),
        ("stream".to_string(), vec![owned(&["XADD", "*", "f", "v"])]),
        (
            "hash without n".to_string(),
            vec![owned(&["HSET", "x", "1"])],
        ),
        (
            "hash with another field".to_string(),
            vec![owned(&["HSET", "n", "1", "t", "5", "x", "1"])],
        ),
        (
            "hash with a fractional first call".to_string(),
            vec![owned(&["HSET", "n", "1", "t", "1.5"])],
        ),
        (
            "hash with a negative first call".to_string(),
            vec![owned(&["HSET", "n", "1", "t", "-5"])],
        ),
        (
            "hash with a window end in words".to_string(),
            vec![owned(&["HSET", "n", "1", "e", "soon"])],
        ),
        (
            "hash with a first call after the latest instant".to_string(),
            vec![owned(&["HSET", "n", "0", "t", PAST_THE_LAST_INSTANT])],
        ),
        (
            "hash with a window end after the latest instant".to_string(),
            vec![owned(&["HSET", "n", "0", "e", PAST_THE_LAST_INSTANT])],
        ),
        (
            "hash with a first call in the year 11475".to_string(),
            vec![owned(&["HSET", "n", "0", "t", "300000000000000"])],
        ),
    ];
    for number in [
        "1.0",
        "1e0",
        "0x1",
        " 1",
        "1 ",
        "+1",
        "-1",
        "-0",
        "01",
        "",
        "inf",
        "nan",
        "12345678901234567",
        "9007199254740993",
        "9223372036854775807",
        "abc",
    ] {
        values.push((
            format!("hash with n = {number:?}"),
            vec![owned(&["HSET", "n", number])],
        ));
        values.push((format!("string {number:?}"), vec![owned(&["SET", number])]));
    }
    values
}

async fn plant(redis: &mut redis::aio::MultiplexedConnection, key: &str, setup: &[Vec<String>]) {
    let _: () = redis.del(key).await.unwrap();
    for step in setup {
        let mut command = redis::cmd(&step[0]);
        command.arg(key);
        for arg in &step[1..] {
            command.arg(arg);
        }
        let _: redis::Value = command.query_async(redis).await.unwrap();
    }
}

#[tokio::test]
async fn a_foreign_value_on_any_line_fails_the_request_before_anything_is_written() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let mut redis = client(&server).await;
    let now = Timestamp::now();
    let dated = key("dated");
    store
        .charge(first_use(&dated, 10, 2, now, hour()))
        .await
        .unwrap();
    // An undated counter an admitted charge would heal.
    let undated = key("undated");
    let () = redis
        .hset_multiple(
            undated.as_str(),
            &[
                ("n", 2),
                ("t", (now - SignedDuration::from_mins(10)).as_millisecond()),
            ],
        )
        .await
        .unwrap();
    // A calendar counter, and a key never charged.
    let daily = key("daily");
    let end = now + hour();
    store
        .charge(calendar(&daily, 10, 1, now, end))
        .await
        .unwrap();
    let fresh = key("fresh");
    let foreign = key("foreign");

    for (name, setup) in foreign_values() {
        plant(&mut redis, foreign.as_str(), &setup).await;
        let () = redis.pexpire(foreign.as_str(), 60_000).await.unwrap();
        let mut before = Vec::new();
        for key in [&dated, &undated, &daily, &fresh, &foreign] {
            before.push(snapshot(&mut redis, key.as_str()).await);
        }
        assert_eq!(before[1].2, -1, "{name}: the planted counter is undated");

        let mut request = first_use(&dated, 10, 1, now, hour());
        request
            .lines
            .extend(first_use(&undated, 10, 1, now, hour()).lines);
        request
            .lines
            .extend(calendar(&daily, 10, 1, now, end).lines);
        request
            .lines
            .extend(first_use(&fresh, 10, 1, now, hour()).lines);
        request
            .lines
            .extend(first_use(&foreign, 10, 1, now, hour()).lines);
        let peek = store.peek(request.clone()).await.expect_err(&name);
        let error = store.charge(request).await.expect_err(&name);
        for error in [&peek, &error] {
            assert_eq!(error.kind(), StoreErrorKind::Other, "{name}: {error}");
            let text = error.to_string();
            assert!(text.contains("not a counter"), "{name}: {text}");
            assert!(
                names_hidden(&text, &foreign),
                "{name}: names the key, its subject hidden: {text}"
            );
        }
        let refund = store.refund(now, foreign.clone(), 1).await;
        assert!(
            refund.is_err(),
            "{name}: a refund on it fails too: {refund:?}"
        );
        let add = store.add(now, foreign.clone(), 1).await;
        assert!(add.is_err(), "{name}: an add on it fails too: {add:?}");

        for (key, before) in [&dated, &undated, &daily, &fresh, &foreign]
            .into_iter()
            .zip(&before)
        {
            let after = snapshot(&mut redis, key.as_str()).await;
            unchanged(before, &after, &format!("{name}, {}", key.as_str()));
        }
    }
}

/// A counter whose first call no timestamp can hold is refused before the
/// charge writes, on its own and in a batch: its caller is told an error and
/// nothing is charged. The latest instant a timestamp holds is a first call
/// like any other.
#[tokio::test]
async fn a_first_call_past_the_latest_instant_is_an_error_that_charges_nothing() {
    let server = redis_server_or_skip!();
    let mut redis = client(&server).await;
    let now = Timestamp::now();
    let last = LAST_INSTANT;
    assert!(Timestamp::from_millisecond(last).is_ok());
    assert!(Timestamp::from_millisecond(last + 1).is_err());
    assert_eq!((last + 1).to_string(), PAST_THE_LAST_INSTANT);
    for batched in [true, false] {
        let store = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(1))
            .batch_charges(batched)
            .build()
            .unwrap();
        let far = key(&format!("far-{batched}"));
        for t in [PAST_THE_LAST_INSTANT, "300000000000000"] {
            plant(
                &mut redis,
                far.as_str(),
                &[vec![
                    "HSET".into(),
                    "n".into(),
                    "0".into(),
                    "t".into(),
                    t.into(),
                ]],
            )
            .await;
            let () = redis.pexpire(far.as_str(), 60_000).await.unwrap();
            let before = snapshot(&mut redis, far.as_str()).await;
            for _ in 0..3 {
                let error = store
                    .charge(first_use(&far, 10, 1, now, hour()))
                    .await
                    .expect_err("a first call no timestamp holds");
                assert_eq!(error.kind(), StoreErrorKind::Other, "{error}");
                assert!(error.to_string().contains("not a counter"), "{error}");
            }
            let after = snapshot(&mut redis, far.as_str()).await;
            unchanged(&before, &after, &format!("batched {batched}, t {t}"));
        }

        let edge = key(&format!("edge-{batched}"));
        let () = redis
            .hset_multiple(edge.as_str(), &[("n", 0), ("t", last)])
            .await
            .unwrap();
        let () = redis.pexpire(edge.as_str(), 60_000).await.unwrap();
        let outcome = store
            .charge(first_use(&edge, 10, 1, now, hour()))
            .await
            .unwrap();
        assert!(outcome.admitted);
        assert_eq!(outcome.usage[0].used, 1);
        assert_eq!(
            outcome.usage[0].first_call.map(|t| t.as_millisecond()),
            Some(last)
        );
    }
}

#[tokio::test]
async fn a_refused_charge_heals_deadlines_and_counts_nothing() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let mut redis = client(&server).await;
    let now = Timestamp::now();
    let tight = key("tight");
    store
        .charge(first_use(&tight, 1, 1, now, hour()))
        .await
        .unwrap();
    let known = key("undated-known");
    let () = redis
        .hset_multiple(
            known.as_str(),
            &[
                ("n", 2),
                ("t", (now - SignedDuration::from_mins(10)).as_millisecond()),
            ],
        )
        .await
        .unwrap();
    let unknown = key("undated-unknown");
    let () = redis.set(unknown.as_str(), 3).await.unwrap();
    let over = key("undated-over");
    let () = redis
        .hset_multiple(
            over.as_str(),
            &[
                ("n", 2),
                ("t", (now - SignedDuration::from_hours(5)).as_millisecond()),
            ],
        )
        .await
        .unwrap();
    let daily = key("undated-calendar");
    let () = redis.hset(daily.as_str(), "n", 4).await.unwrap();
    let keys = [&known, &unknown, &over, &daily];
    let request = |tight_cost| {
        let mut request = first_use(&known, 10, 1, now, hour());
        request
            .lines
            .extend(first_use(&unknown, 10, 1, now, hour()).lines);
        request
            .lines
            .extend(first_use(&over, 10, 1, now, hour()).lines);
        request
            .lines
            .extend(calendar(&daily, 10, 1, now, now + hour()).lines);
        request
            .lines
            .extend(first_use(&tight, 1, tight_cost, now, hour()).lines);
        request
    };
    let mut before = Vec::new();
    for key in keys {
        before.push(snapshot(&mut redis, key.as_str()).await);
    }

    let peeked = store.peek(request(1)).await.unwrap();
    assert_eq!(
        peeked.iter().map(|u| u.used).collect::<Vec<_>>(),
        [2, 3, 0, 4, 1]
    );
    let refused = store.charge(request(1)).await.unwrap();
    assert!(!refused.admitted);
    assert_eq!(
        refused.usage.iter().map(|u| u.used).collect::<Vec<_>>(),
        [2, 3, 0, 4, 1]
    );
    // Healed, counts as they were: the one whose period was over is gone.
    for (key, before) in keys.into_iter().zip(&before) {
        let after = snapshot(&mut redis, key.as_str()).await;
        if key == &over {
            assert_eq!(after.0, None, "ended: deleted");
            continue;
        }
        assert_eq!(after.0, before.0, "{}: the value changed", key.as_str());
        assert!(after.2 > 0, "{}: dated", key.as_str());
    }
    let peeked = store.peek(request(1)).await.unwrap();
    assert_eq!(
        peeked.iter().map(|u| u.used).collect::<Vec<_>>(),
        [2, 3, 0, 4, 1]
    );

    let admitted = store.charge(request(0)).await.unwrap();
    assert!(admitted.admitted);
    assert_eq!(
        admitted.usage.iter().map(|u| u.used).collect::<Vec<_>>(),
        [3, 4, 1, 5, 1]
    );
    let ttl = |key: &PeriodKey| {
        let key = key.as_str().to_owned();
        let mut redis = redis.clone();
        async move { redis.pttl::<_, i64>(key).await.unwrap() }
    };
    let known_ttl = ttl(&known).await;
    assert!((2_999_000..=3_000_000).contains(&known_ttl), "{known_ttl}");
    let unknown_ttl = ttl(&unknown).await;
    assert!(
        (3_599_000..=3_600_000).contains(&unknown_ttl),
        "{unknown_ttl}"
    );
    let over_ttl = ttl(&over).await;
    assert!((3_599_000..=3_600_000).contains(&over_ttl), "{over_ttl}");
    let daily_ttl = ttl(&daily).await;
    assert!(daily_ttl >= 3_599_000, "{daily_ttl}");
}

/// The trap of a first-use counter that lost its deadline: at its limit, it
/// refuses every charge, and an admitted charge never comes to heal it. A
/// refused charge dates it: the subject is refused until one period from
/// now, not for ever.
#[tokio::test]
async fn an_undated_counter_at_its_limit_locks_no_one_out_for_ever() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let mut redis = client(&server).await;
    let now = Timestamp::now();
    let stuck = key("undated-at-limit");
    let () = redis.set(stuck.as_str(), 10).await.unwrap();
    let refused = store
        .charge(first_use(&stuck, 10, 1, now, hour()))
        .await
        .unwrap();
    assert!(!refused.admitted);
    assert_eq!(refused.usage[0].used, 10);
    let ttl: i64 = redis.pttl(stuck.as_str()).await.unwrap();
    assert!(
        (3_599_000..=3_600_000).contains(&ttl),
        "one period from now: {ttl}"
    );
    let count: i64 = redis.get(stuck.as_str()).await.unwrap();
    assert_eq!(count, 10, "a refused charge counts nothing");
}

#[tokio::test]
async fn a_count_beyond_what_the_store_holds_fails_closed_and_is_never_reported_as_zero() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let mut redis = client(&server).await;
    let layer = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .build()
        .layer(Quota::daily(5));
    let handle = layer.handle();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let acme = Subject::account("acme");
    let key = handle.usage(&acme).await.unwrap()[0].key().clone();

    for (name, setup) in [
        ("hash", ["HSET", "n", "9223372036854775807"]),
        ("string", ["SET", "9223372036854775807", ""]),
        ("negative hash", ["HSET", "n", "-3"]),
        ("beyond 2^53", ["HSET", "n", "9007199254740993"]),
    ] {
        let setup: Vec<String> = setup
            .iter()
            .filter(|a| !a.is_empty())
            .map(|a| a.to_string())
            .collect();
        plant(&mut redis, key.as_str(), &[setup]).await;
        let () = redis.pexpire(key.as_str(), 60_000).await.unwrap();
        let before = snapshot(&mut redis, key.as_str()).await;

        let response = app.clone().oneshot(call("acme")).await.unwrap();
        assert_eq!(
            response.status(),
            StatusCode::SERVICE_UNAVAILABLE,
            "{name}: fail closed, neither admitted nor refused"
        );
        let body = axum::body::to_bytes(response.into_body(), 64 * 1024)
            .await
            .unwrap();
        let body = String::from_utf8_lossy(&body);
        for secret in [key.as_str(), "ERR", "tower-quota:", "not a counter", "2^53"] {
            assert!(
                !body.contains(secret),
                "{name}: the body shows {secret:?}: {body}"
            );
        }
        let usage = handle.usage(&acme).await;
        let error = usage.expect_err("a count the store cannot hold is no usage");
        assert_eq!(error.kind(), StoreErrorKind::Other, "{name}: {error}");
        assert!(names_hidden(&error.to_string(), &key), "{name}: {error}");
        let refund = handle.refund(&acme, 1).await;
        assert!(refund.is_err(), "{name}: {refund:?}");
        unchanged(&before, &snapshot(&mut redis, key.as_str()).await, name);
    }
}

#[tokio::test]
async fn a_calendar_counter_in_its_grace_takes_no_refund_nor_add() {
    let server = redis_server_or_skip!();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(1))
        .calendar_grace(Duration::from_secs(60))
        .build()
        .unwrap();
    let memory = tower_quota::MemoryStore::new();
    let mut redis = client(&server).await;
    let key = key("grace");
    let now = Timestamp::from_millisecond(Timestamp::now().as_millisecond()).unwrap();
    let end = now + SignedDuration::from_secs(30);
    for cost in [4, 0] {
        let a = store
            .charge(calendar(&key, 10, cost, now, end))
            .await
            .unwrap();
        let b = memory
            .charge(calendar(&key, 10, cost, now, end))
            .await
            .unwrap();
        assert_eq!(a, b);
    }
    let fields: Vec<(String, i64)> = redis.hgetall(key.as_str()).await.unwrap();
    assert!(
        fields.contains(&("e".into(), end.as_millisecond())),
        "the counter records its window's end: {fields:?}"
    );

    // Within the window: live.
    let during = end - SignedDuration::from_millis(1);
    assert_eq!(store.refund(during, key.clone(), 1).await.unwrap(), Some(3));
    assert_eq!(
        memory.refund(during, key.clone(), 1).await.unwrap(),
        Some(3)
    );
    assert_eq!(store.add(during, key.clone(), 2).await.unwrap(), Some(5));
    assert_eq!(memory.add(during, key.clone(), 2).await.unwrap(), Some(5));

    // At and past the end, in the grace: over, and left as it is.
    let before = snapshot(&mut redis, key.as_str()).await;
    for at in [end, end + SignedDuration::from_secs(10)] {
        assert_eq!(store.refund(at, key.clone(), 1).await.unwrap(), None);
        assert_eq!(memory.refund(at, key.clone(), 1).await.unwrap(), None);
        assert_eq!(store.add(at, key.clone(), 1).await.unwrap(), None);
        assert_eq!(memory.add(at, key.clone(), 1).await.unwrap(), None);
        let peek = calendar(&key, 10, 0, at, end);
        let a = store.peek(peek.clone()).await.unwrap();
        assert_eq!(a, memory.peek(peek).await.unwrap());
        assert_eq!(a[0].used, 0, "a window that is over counts nothing");
    }
    unchanged(
        &before,
        &snapshot(&mut redis, key.as_str()).await,
        "in the grace",
    );
    // A lagging instance, still in the window, sees the count.
    let lagging = store
        .peek(calendar(&key, 10, 0, during, end))
        .await
        .unwrap();
    assert_eq!(lagging[0].used, 5);

    // A counter of an earlier version, without its end, lives until its
    // deadline as before.
    let old = self::key("grace-old");
    let () = redis.hset(old.as_str(), "n", 3).await.unwrap();
    let () = redis.pexpire(old.as_str(), 60_000).await.unwrap();
    assert_eq!(
        store
            .refund(end + SignedDuration::from_secs(10), old.clone(), 1)
            .await
            .unwrap(),
        Some(2)
    );
}

/// Two calls of `acme` through `layer`, then the handle on it.
async fn charged_twice<St: Store>(
    layer: QuotaLayer<FromHeader, St>,
) -> tower_quota::QuotaHandle<St> {
    let handle = layer.handle();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    for _ in 0..2 {
        let response = app.clone().oneshot(call("acme")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    handle
}

#[tokio::test]
async fn refund_at_after_a_calendar_window_ended_credits_nothing() {
    let server = redis_server_or_skip!();
    let mut redis = client(&server).await;
    let t0 = Timestamp::now();
    let clock = tower_quota::ManualClock::new(t0);
    let quotas = |layer: QuotaLayer<FromHeader, _>| {
        layer.quota(Quota::rolling(50, Duration::from_secs(7_200)))
    };
    let on_redis = charged_twice(quotas(
        QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .clock(clock.clone())
            .store(store(&server))
            .build()
            .layer(Quota::hourly(5)),
    ))
    .await;
    let on_memory = charged_twice(
        QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .clock(clock.clone())
            .build()
            .layer(Quota::hourly(5))
            .quota(Quota::rolling(50, Duration::from_secs(7_200))),
    )
    .await;
    let acme = Subject::account("acme");
    let usage = on_redis.usage(&acme).await.unwrap();
    let hourly = usage[0].key().clone();
    let hour_end = usage[0].resets_at();

    // During the window: both counters take the refund.
    clock.set(t0 + SignedDuration::from_millis(1));
    assert_eq!(
        on_redis.refund_at(&acme, t0, 1).await.unwrap(),
        [Some(1), Some(1)]
    );
    assert_eq!(
        on_memory.refund_at(&acme, t0, 1).await.unwrap(),
        [Some(1), Some(1)]
    );

    // Past the hour, while Redis keeps the counter through its grace: the
    // calendar counter takes nothing, the first-use one still does.
    clock.set(hour_end + SignedDuration::from_secs(1));
    let before = snapshot(&mut redis, hourly.as_str()).await;
    assert_eq!(
        on_redis.refund_at(&acme, t0, 1).await.unwrap(),
        [None, Some(0)]
    );
    assert_eq!(
        on_memory.refund_at(&acme, t0, 1).await.unwrap(),
        [None, Some(0)]
    );
    unchanged(
        &before,
        &snapshot(&mut redis, hourly.as_str()).await,
        "the ended window's counter",
    );
    let count: i64 = redis.hget(hourly.as_str(), "n").await.unwrap();
    assert_eq!(count, 1);
}

/// The script decides a one-line charge on a live counter it created in
/// short, and every other charge in full: both read a counter alike. A peek
/// (always in full) predicts each charge, for counters in every state.
#[tokio::test]
async fn a_charge_is_decided_as_a_peek_reads_the_counter() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let mut redis = client(&server).await;
    let now = Timestamp::now();
    let end = now + hour();
    let ms = now.as_millisecond();
    let past = ms - 1_000;

    let calendar_live = key("calendar-live");
    let calendar_full = key("calendar-full");
    let calendar_over = key("calendar-over");
    let calendar_legacy = key("calendar-legacy");
    let first_live = key("first-live");
    let first_undated = key("first-undated");
    let string = key("string");
    let fresh = key("fresh");
    for (key, n) in [(&calendar_live, 2), (&calendar_full, 5)] {
        for _ in 0..n {
            assert!(
                store
                    .charge(calendar(key, 5, 1, now, end))
                    .await
                    .unwrap()
                    .admitted
            );
        }
    }
    assert!(
        store
            .charge(first_use(&first_live, 5, 2, now, hour()))
            .await
            .unwrap()
            .admitted
    );
    let () = redis
        .hset_multiple(
            calendar_over.as_str(),
            &[("n", 2), ("t", past), ("e", past)],
        )
        .await
        .unwrap();
    let () = redis.pexpire(calendar_over.as_str(), 60_000).await.unwrap();
    let () = redis
        .hset_multiple(calendar_legacy.as_str(), &[("n", 1), ("t", past)])
        .await
        .unwrap();
    let () = redis
        .pexpire(calendar_legacy.as_str(), 60_000)
        .await
        .unwrap();
    let () = redis
        .hset_multiple(first_undated.as_str(), &[("n", 1), ("t", past)])
        .await
        .unwrap();
    let () = redis.set_ex(string.as_str(), 3, 60).await.unwrap();

    let cases = [
        (calendar(&calendar_live, 5, 1, now, end), "live calendar"),
        (
            calendar(&calendar_live, 5, 0, now, end),
            "live calendar, cost 0",
        ),
        (
            calendar(&calendar_full, 5, 1, now, end),
            "calendar at its limit",
        ),
        (
            calendar(&calendar_over, 5, 1, now, end),
            "calendar window over",
        ),
        (
            calendar(&calendar_legacy, 5, 1, now, end),
            "calendar without e",
        ),
        (first_use(&first_live, 5, 2, now, hour()), "live first use"),
        (
            first_use(&first_live, 5, 2, now, hour()),
            "first use, then full",
        ),
        (
            first_use(&first_undated, 5, 1, now, hour()),
            "undated first use",
        ),
        (first_use(&string, 5, 1, now, hour()), "string counter"),
        (calendar(&fresh, 5, 1, now, end), "no counter"),
    ];
    for (request, case) in cases {
        let line = &request.lines[0];
        let (cost, limit) = (line.cost, line.limit);
        let peeked = store.peek(request.clone()).await.unwrap().remove(0);
        let charged = store.charge(request).await.unwrap();
        let admitted = peeked.used + cost <= limit;
        assert_eq!(charged.admitted, admitted, "{case}");
        let usage = &charged.usage[0];
        let expected = peeked.used + if admitted { cost } else { 0 };
        assert_eq!(usage.used, expected, "{case}");
        match peeked.first_call {
            Some(first) => assert_eq!(usage.first_call, Some(first), "{case}"),
            // A counter the charge made is dated by it.
            None => assert!(
                usage
                    .first_call
                    .is_none_or(|made| made.as_millisecond() == now.as_millisecond()),
                "{case}"
            ),
        }
        let drift = (usage.resets_at - peeked.resets_at).abs();
        assert!(
            drift < SignedDuration::from_millis(200),
            "{case}: {drift:?}"
        );
    }
}

/// In a batch, `=` repeats the quota of the one-line charge before it with
/// an instant and a deadline of its own; a charge that took the common
/// path is answered in its short form. `=` anywhere else makes the batch
/// malformed, and nothing in it runs.
#[tokio::test]
async fn a_repeated_quota_in_a_batch_keeps_its_own_instant_and_deadline() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    store.preload().await.unwrap();
    let sha = store.script_sha();
    let now = Timestamp::now();
    let (first, second) = (key("repeat-first"), key("repeat-second"));
    let ms = now.as_millisecond();
    let end = (now + hour()).as_millisecond().to_string();
    let (t1, t2) = (ms.to_string(), (ms + 10_000).to_string());
    let (ttl1, ttl2) = ("3600000", "3590000");
    let reply = server.cli(&[
        "evalsha",
        sha,
        "3",
        first.as_str(),
        second.as_str(),
        first.as_str(),
        "b",
        "1",
        &t1,
        "10",
        "1",
        "c",
        ttl1,
        &end,
        "=",
        &t2,
        ttl2,
        "=",
        &t2,
        ttl2,
    ]);
    let values: Vec<&str> = reply.lines().collect();
    // Two new counters (the full form), then the first again (short: 2 +
    // admitted, used, first call).
    assert_eq!(values.len(), 6 + 6 + 3, "{reply}");
    assert_eq!(&values[..3], ["1", "1", "9"], "{reply}");
    assert_eq!(&values[6..9], ["1", "1", "9"], "{reply}");
    assert_eq!(&values[12..], ["3", "2", t1.as_str()], "{reply}");
    // The second counter has its own first call and deadline.
    assert_eq!(server.cli(&["hget", first.as_str(), "t"]), t1);
    assert_eq!(server.cli(&["hget", second.as_str(), "t"]), t2);
    let pttl = |key: &PeriodKey| server.cli(&["pttl", key.as_str()]).parse::<i64>().unwrap();
    assert!(
        (3_590_000..=3_600_000).contains(&pttl(&first)),
        "{}",
        pttl(&first)
    );
    assert!(
        (3_580_000..=3_590_000).contains(&pttl(&second)),
        "{}",
        pttl(&second)
    );

    let fresh = key("repeat-malformed");
    let line = ["10", "1", "c", ttl1, end.as_str()];
    let two = [fresh.as_str(), fresh.as_str()];
    let malformed: Vec<Vec<&str>> = vec![
        // First in the batch: no charge before it.
        [&["1", fresh.as_str(), "b", "=", &t1, ttl1][..]].concat(),
        // After a charge of two lines.
        [
            &["3"][..],
            &[fresh.as_str(); 3],
            &["b", "2", &t1],
            &line,
            &line,
            &["=", &t1, ttl1],
        ]
        .concat(),
        // Without its deadline.
        [&["2"][..], &two, &["b", "1", &t1], &line, &["=", &t1]].concat(),
        // More charges than keys.
        [
            &["1"][..],
            &[fresh.as_str()],
            &["b", "1", &t1],
            &line,
            &["=", &t1, ttl1],
        ]
        .concat(),
    ];
    for args in malformed {
        let reply = server.cli(&[&["evalsha", sha][..], &args].concat());
        assert!(reply.contains("a malformed batch"), "{args:?}: {reply}");
    }
    assert_eq!(
        server.cli(&["exists", fresh.as_str()]),
        "0",
        "nothing written"
    );
}

/// live counter the script created (the short path), a missing or
/// The script takes the instant of a charge on trust from no one: on a
/// malformed instant, alone or in a batch, is an error reply and nothing
/// is written.
#[tokio::test]
async fn a_malformed_instant_is_an_error_reply_on_every_path() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let now = Timestamp::now();
    let end = now + hour();
    let daily = key("instant");
    admit(&store, calendar(&daily, 10, 1, now, end)).await;
    let hourly = key("instant-first-use");
    admit(&store, first_use(&hourly, 10, 1, now, hour())).await;
    let sha = store.script_sha();
    let (ms, end_ms, ttl) = raw_times(now, end);
    let instants = [
        "",
        "1e3",
        " 1",
        "-1",
        "01",
        "1.0",
        "99999999999999999",
        PAST_THE_LAST_INSTANT,
    ];
    for instant in instants {
        let calendar_line = ["10", "1", "c", ttl.as_str(), end_ms.as_str()];
        let first_use_line = ["10", "1", "f", ttl.as_str(), "0"];
        for (key, line) in [(&daily, calendar_line), (&hourly, first_use_line)] {
            let mut charge = vec!["evalsha", sha, "1", key.as_str(), "c", instant];
            charge.extend(line);
            let reply = server.cli(&charge);
            assert!(reply.contains("an instant"), "{instant:?}: {reply}");
            // In a batch, after a well-formed charge of the same key.
            let mut batch = vec!["evalsha", sha, "2", key.as_str(), key.as_str(), "b"];
            batch.extend(["1", ms.as_str()]);
            batch.extend(line);
            batch.extend(["1", instant]);
            batch.extend(line);
            let reply = server.cli(&batch);
            assert!(reply.contains("an instant"), "{instant:?}: {reply}");
        }
    }
    // A charge with no instant at all, and nothing else.
    let reply = server.cli(&["evalsha", sha, "1", daily.as_str(), "c"]);
    assert!(reply.contains("an instant"), "{reply}");
    // A calendar window ending past the latest instant: no counter could
    // record it, so none is created.
    let fresh = key("window-past-the-end");
    let reply = server.cli(&[
        "evalsha",
        sha,
        "1",
        fresh.as_str(),
        "c",
        ms.as_str(),
        "10",
        "1",
        "c",
        ttl.as_str(),
        PAST_THE_LAST_INSTANT,
    ]);
    assert!(reply.contains("a window end"), "{reply}");
    assert_eq!(server.cli(&["exists", fresh.as_str()]), "0");
    // The same on a counter that exists, on its own and in a batch.
    let mut line = vec!["10", "1", "c", ttl.as_str(), PAST_THE_LAST_INSTANT];
    let mut charge = vec!["evalsha", sha, "1", daily.as_str(), "c", ms.as_str()];
    charge.append(&mut line.clone());
    let reply = server.cli(&charge);
    assert!(reply.contains("a window end"), "{reply}");
    let mut batch = vec!["evalsha", sha, "1", daily.as_str(), "b", "1", ms.as_str()];
    batch.append(&mut line);
    let reply = server.cli(&batch);
    assert!(reply.contains("a window end"), "{reply}");
    // Each batch charged its first charge, and nothing else was written.
    let charges = 1 + instants.len();
    for key in [&daily, &hourly] {
        assert_eq!(
            server.cli(&["hget", key.as_str(), "n"]),
            charges.to_string(),
            "{key}"
        );
    }
}

/// A limit or a cost that Lua reads as a number but is none (`nan`) refuses
/// the charge and writes nothing, whichever path of the script takes it:
/// the short one (one line on a live counter the script made), the full one
/// (two lines), and a batch.
#[tokio::test]
async fn a_limit_or_cost_that_is_not_a_number_refuses_on_every_path() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let now = Timestamp::now();
    let end = now + hour();
    let daily = key("nan");
    admit(&store, calendar(&daily, 10, 1, now, end)).await;
    let sha = store.script_sha();
    let (ms, end_ms, ttl) = raw_times(now, end);
    for (limit, cost) in [("nan", "1"), ("10", "nan"), ("nan", "nan")] {
        let line = [limit, cost, "c", ttl.as_str(), end_ms.as_str()];
        let mut short = vec!["evalsha", sha, "1", daily.as_str(), "c", ms.as_str()];
        short.extend(line);
        let reply = server.cli(&short);
        assert_eq!(reply.lines().next(), Some("0"), "{limit}/{cost}: {reply}");
        let mut full = vec!["evalsha", sha, "2", daily.as_str(), daily.as_str()];
        full.extend(["c", ms.as_str()]);
        full.extend(line);
        full.extend(line);
        let reply = server.cli(&full);
        assert_eq!(reply.lines().next(), Some("0"), "{limit}/{cost}: {reply}");
        let mut batch = vec!["evalsha", sha, "1", daily.as_str(), "b", "1", ms.as_str()];
        batch.extend(line);
        let reply = server.cli(&batch);
        // Refused, in the short form: 2 + admitted, the count, the first
        // call.
        assert_eq!(reply.lines().next(), Some("2"), "{limit}/{cost}: {reply}");
    }
    assert_eq!(server.cli(&["hget", daily.as_str(), "n"]), "1");
}

/// Limits and costs the script cannot decide on exactly (2^53 and past it:
/// Lua adds in doubles) are refused where they are made, never admitted
/// past a limit nor left as a count Redis then reads as foreign.
#[tokio::test]
async fn limits_and_costs_past_what_redis_counts_exactly_are_refused() {
    let server = redis_server_or_skip!();
    let max = store(&server).max_count();
    assert_eq!(max, (1 << 53) - 1);
    let too_large = std::panic::catch_unwind(|| {
        QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store(&server))
            .build()
            .layer(Quota::daily(1 << 53))
    });
    let Err(message) = too_large else {
        panic!("a limit of 2^53 is refused");
    };
    let message = message.downcast_ref::<String>().expect("a message").clone();
    assert!(
        message.contains("more than its store counts exactly"),
        "{message}"
    );

    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store(&server))
        .build();
    let layer = policy.layer(Quota::daily(max)).cost_fn(|parts| {
        let n = parts.uri.query().unwrap_or("n=1")["n=".len()..].to_owned();
        n.parse()
            .map_err(|_| tower_quota::InvalidRequest::new("n is a whole number"))
    });
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let call = |n: u64| {
        Request::get(format!("/?n={n}"))
            .header("x-account-id", "acme")
            .body(Body::empty())
            .unwrap()
    };
    let past = app.clone().oneshot(call(1 << 53)).await.unwrap();
    assert_eq!(past.status(), StatusCode::BAD_REQUEST);
    let body = axum::body::to_bytes(past.into_body(), 1 << 16)
        .await
        .unwrap();
    assert!(
        String::from_utf8_lossy(&body).contains("more than the quota store counts exactly"),
        "{body:?}"
    );
    // The whole allowance at once, then one more: refused, with a reason.
    assert_eq!(
        app.clone().oneshot(call(max)).await.unwrap().status(),
        StatusCode::OK
    );
    let over = app.clone().oneshot(call(1)).await.unwrap();
    assert_eq!(over.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = axum::body::to_bytes(over.into_body(), 1 << 16)
        .await
        .unwrap();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        body["violated-policies"],
        serde_json::json!(["default-day"])
    );
    assert!(!body["detail"].as_str().unwrap().is_empty());
    let usage = policy
        .handle()
        .usage(&Subject::account("acme"))
        .await
        .unwrap();
    assert_eq!(
        usage[0].used(),
        max,
        "the count is the limit, read back exactly"
    );
}

#[tokio::test]
async fn a_late_charge_goes_back_to_the_counter_it_was_charged_to_only() {
    let server = redis_server_or_skip!();
    let (store, other) = impatient_and_patient(&server);
    let key = key("late-reset");
    let t0 = Timestamp::now();
    admit(&store, first_use(&key, 10, 1, t0, hour())).await;
    admit(&other, first_use(&key, 10, 0, t0, hour())).await;
    // A charge that times out, a reset of its counter, and a charge a
    // second later that makes it anew; then the late charge is given back,
    // which must not come off the new counter.
    let late = first_use(&key, 10, 1, t0, hour());
    let anew = first_use(&key, 10, 1, t0 + SignedDuration::from_secs(1), hour());
    late_then_reset_then_anew(&server, (&store, late), &key, (&other, anew)).await;
    assert_eq!(
        server.cli(&["hget", key.as_str(), "n"]),
        "1",
        "the new counter's own charge"
    );
}

/// The same with the new counter made by a charge dated before the late
/// one (another instance's clock, a request that waited): it is still not
/// the counter the late charge was applied to, and keeps its own charge.
#[tokio::test]
async fn a_late_charge_goes_back_not_to_a_counter_made_since_with_an_earlier_instant() {
    let server = redis_server_or_skip!();
    let (store, other) = impatient_and_patient(&server);
    let key = key("late-reset-earlier");
    let t0 = Timestamp::now();
    admit(&store, first_use(&key, 10, 1, t0, hour())).await;
    admit(&other, first_use(&key, 10, 0, t0, hour())).await;
    let late = first_use(&key, 10, 1, t0, hour());
    let anew = first_use(&key, 10, 1, t0 - SignedDuration::from_millis(5), hour());
    late_then_reset_then_anew(&server, (&store, late), &key, (&other, anew)).await;
    assert_eq!(
        server.cli(&["hget", key.as_str(), "n"]),
        "1",
        "the new counter's own charge"
    );
}

/// Two stores on `server`: one that gives up on a call after 100 ms, and
/// one that waits 3 s.
fn impatient_and_patient(server: &RedisServer) -> (RedisStore, RedisStore) {
    let store = |timeout| {
        RedisStore::builder(server.url())
            .timeout(timeout)
            .build()
            .unwrap()
    };
    (
        store(Duration::from_millis(100)),
        store(Duration::from_secs(3)),
    )
}

/// While Redis holds every command: the `late` charge (its store stops
/// waiting for it), a reset of `reset` from a client of its own, and the
/// `anew` charge, admitted. Redis runs them in that order once it resumes;
/// returns once the late charge's give-back had time to land.
async fn late_then_reset_then_anew(
    server: &RedisServer,
    late: (&RedisStore, ChargeRequest),
    reset: &PeriodKey,
    anew: (&RedisStore, ChargeRequest),
) {
    assert_eq!(server.cli(&["client", "pause", "600", "all"]), "OK");
    let error = late
        .0
        .charge(late.1)
        .await
        .expect_err("held past the store's timeout");
    assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
    let port = server.port();
    let deleting = {
        let key = reset.as_str().to_owned();
        std::thread::spawn(move || redis_support::cli(port, &["del", &key]))
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(anew.0.charge(anew.1).await.unwrap().admitted);
    assert_eq!(deleting.join().unwrap(), "1");
    tokio::time::sleep(Duration::from_millis(500)).await;
}

#[tokio::test]
async fn a_guarded_refund_takes_from_a_counter_that_records_no_first_call() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let key = key("undated");
    // A counter written by another tool: a hash with `n` only.
    assert_eq!(server.cli(&["hset", key.as_str(), "n", "5"]), "1");
    assert_eq!(server.cli(&["pexpire", key.as_str(), "60000"]), "1");
    let now = Timestamp::now();
    let refunded = store
        .refund_made_by(now, key.clone(), 1, now)
        .await
        .unwrap();
    assert_eq!(refunded, Some(4));
}

/// A deferred cost's rest goes to the counter the request was charged to
/// only: one reset and made anew since takes none of it.
#[tokio::test]
async fn a_guarded_add_leaves_a_counter_made_since_alone() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    for (name, first_use_anchor) in [("add-first-use", true), ("add-calendar", false)] {
        let request = |key: &PeriodKey, now: Timestamp| {
            if first_use_anchor {
                first_use(key, 100, 1, now, hour())
            } else {
                calendar(key, 100, 1, now, now + hour())
            }
        };
        let key = key(name);
        let t0 = Timestamp::now();
        admit(&store, request(&key, t0)).await;
        assert_eq!(
            store.add_made_by(t0, key.clone(), 4, t0).await.unwrap(),
            Some(5),
            "{name}: the counter charged"
        );
        assert!(store.reset(key.clone()).await.unwrap());
        let later = t0 + SignedDuration::from_secs(1);
        admit(&store, request(&key, later)).await;
        assert_eq!(
            store.add_made_by(later, key.clone(), 49, t0).await.unwrap(),
            None,
            "{name}: a counter made since"
        );
        assert_eq!(server.cli(&["hget", key.as_str(), "n"]), "1", "{name}");
    }
}

/// A late charge of two lines goes back line by line, each to the counter
/// it was charged to: a line whose counter was reset and made anew in
/// between is left alone, though the other line's counter was made later
/// still.
#[tokio::test]
async fn a_late_charge_of_two_lines_goes_back_to_each_lines_own_counter() {
    let server = redis_server_or_skip!();
    let (store, other) = impatient_and_patient(&server);
    let (a, b) = (key("late-two-a"), key("late-two-b"));
    let t0 = Timestamp::now();
    // B made first, by a charge with a later instant.
    let b_first = t0 + SignedDuration::from_millis(50);
    admit(&other, first_use(&b, 10, 1, b_first, hour())).await;
    admit(&other, first_use(&a, 10, 0, t0, hour())).await;
    // The two-line charge, which times out; a reset of A; a charge of A
    // that makes it anew, dated between the charge's instant and B's first
    // call.
    let mut late = first_use(&a, 10, 1, t0, hour());
    late.lines
        .push(first_use(&b, 10, 1, t0, hour()).lines[0].clone());
    let anew = first_use(&a, 10, 1, t0 + SignedDuration::from_millis(20), hour());
    late_then_reset_then_anew(&server, (&store, late), &a, (&other, anew)).await;
    assert_eq!(
        server.cli(&["hget", a.as_str(), "n"]),
        "1",
        "A's new counter: its own charge"
    );
    assert_eq!(
        server.cli(&["hget", b.as_str(), "n"]),
        "1",
        "B: the late charge given back"
    );
}

/// A TCP proxy whose target can be switched: new connections go to the
/// new target, as a name or a virtual address moves after a failover.
async fn switchable_proxy(target: Arc<Mutex<u16>>) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (mut inbound, _) = listener.accept().await.unwrap();
            let to = *target.lock().unwrap();
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    port
}

/// A failover that leaves the store's connections open to the old master,
/// now a replica (a managed endpoint or a virtual address moved, without
/// the old connections killed): it refuses every write with `READONLY`
/// and answers pings. The store opens new connections, which reach the
/// new master, instead of failing every charge until it restarts.
#[tokio::test(flavor = "multi_thread")]
async fn a_store_on_a_demoted_master_reconnects_to_the_new_one() {
    let old = RedisServer::start();
    let new = RedisServer::start();
    let target = Arc::new(Mutex::new(old.port()));
    let port = switchable_proxy(Arc::clone(&target)).await;
    for batched in [true, false] {
        *target.lock().unwrap() = old.port();
        old.cli(&["replicaof", "no", "one"]);
        let store = RedisStore::builder(format!("redis://127.0.0.1:{port}/"))
            .batch_charges(batched)
            .build()
            .unwrap();
        let charge = || {
            let now = Timestamp::now();
            ChargeRequest {
                charged_at: None,
                now,
                lines: smallvec::smallvec![ChargeLine {
                    key: Namespace::default().key(&Subject::account("acme"), "failover", "PT1H"),
                    limit: 1_000,
                    cost: 1,
                    lifetime: Lifetime::FirstUse {
                        deadline: now + SignedDuration::from_hours(1),
                    },
                    shadow_limit: None,
                }],
            }
        };
        for _ in 0..4 {
            assert!(store.charge(charge()).await.unwrap().admitted);
        }
        old.cli(&["replicaof", "127.0.0.1", &new.port().to_string()]);
        *target.lock().unwrap() = new.port();
        let mut failed = 0;
        for _ in 0..20 {
            if store.charge(charge()).await.is_err() {
                failed += 1;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The connections opened before the failover fail once each (two
        // by default) at most.
        assert!(
            failed <= 2,
            "batched {batched}: {failed} of 20 charges failed"
        );
    }
}

/// A first-use counter without its deadline and without its first call
/// (another tool wrote it) is dated a period from now by a settle, as by a
/// charge: not by what is left of the debt's period, which would end it,
/// and every unit it holds, within moments.
#[tokio::test]
async fn a_settle_dates_a_counter_without_first_call_a_period_from_now() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let (by_charge, by_settle) = (key("undated-charge"), key("undated-settle"));
    for key in [&by_charge, &by_settle] {
        assert_eq!(server.cli(&["hset", key.as_str(), "n", "10"]), "1");
    }
    let now = Timestamp::now();
    let refused = store
        .charge(first_use(&by_charge, 10, 1, now, hour()))
        .await
        .unwrap();
    assert!(!refused.admitted);
    // A debt whose period ends in 200 ms.
    let deadline = now + SignedDuration::from_millis(200);
    let debt = tower_quota::store::Debt {
        key: by_settle.clone(),
        amount: 1,
        lifetime: Lifetime::FirstUse { deadline },
        since: deadline - hour(),
        id: redis_support::settle_id(),
    };
    assert_eq!(store.settle_debt(now, debt).await.unwrap(), Some(11));
    let pttl = |key: &PeriodKey| server.cli(&["pttl", key.as_str()]).parse::<i64>().unwrap();
    let (charged, settled) = (pttl(&by_charge), pttl(&by_settle));
    assert!(
        settled > 3_500_000 && charged > 3_500_000,
        "dated by a charge to {charged} ms, by a settle to {settled} ms"
    );
}

/// A debt of nothing writes nothing: not even the replacement of a
/// calendar counter past the window end it records, which a settle of more
/// makes.
#[tokio::test]
async fn a_settle_of_nothing_writes_nothing() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let key = Namespace::default().key(&Subject::account("acme"), "nothing", "2026-10-25");
    let t0 = Timestamp::from_millisecond(Timestamp::now().as_millisecond()).unwrap();
    let end = t0 + SignedDuration::from_secs(1);
    admit(&store, calendar(&key, 3, 2, t0, end)).await;
    // Past the window the counter records; the debt's window outlasts it.
    let t1 = t0 + SignedDuration::from_secs(2);
    let debt = tower_quota::store::Debt {
        key: key.clone(),
        amount: 0,
        lifetime: Lifetime::Calendar {
            start: t1,
            end: t1 + hour(),
        },
        since: t1,
        id: redis_support::settle_id(),
    };
    let settled = store.settle_debt(t1, debt).await.unwrap();
    assert_eq!(settled, Some(0), "the counter counts nothing at t1");
    assert_eq!(
        server.cli(&["hget", key.as_str(), "n"]),
        "2",
        "nothing written"
    );
}

/// A settle that meets a first-use counter without its deadline (another
/// tool took it) heals it as a charge does: a counter whose period is long
/// over is as good as expired, and the debt opens a counter of its own,
/// rather than adding to the dead one, which the next charge deletes with
/// the debt in it.
#[tokio::test]
async fn a_settle_heals_a_first_use_counter_that_lost_its_deadline() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let live = key("settle-undated-live");
    let key = key("settle-undated");
    let period = SignedDuration::from_millis(1_000);
    for _ in 0..2 {
        admit(&store, first_use(&key, 10, 1, Timestamp::now(), period)).await;
    }
    assert_eq!(server.cli(&["persist", key.as_str()]), "1");
    tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;
    let now = Timestamp::now();
    let debt = tower_quota::store::Debt {
        key: key.clone(),
        amount: 2,
        lifetime: Lifetime::FirstUse {
            deadline: now + period,
        },
        since: now,
        id: redis_support::settle_id(),
    };
    let settled = store.settle_debt(now, debt).await.unwrap();
    assert_eq!(
        settled,
        Some(2),
        "the old period is over: a counter of the debt's own"
    );
    let next = store
        .charge(first_use(&key, 10, 1, Timestamp::now(), period))
        .await
        .unwrap();
    assert_eq!(next.usage[0].used, 3, "the debt counted");

    // Within its period: dated again, by its first call, and the debt added.
    let hour_long = hour();
    admit(&store, first_use(&live, 10, 1, Timestamp::now(), hour_long)).await;
    assert_eq!(server.cli(&["persist", live.as_str()]), "1");
    let now = Timestamp::now();
    let debt = tower_quota::store::Debt {
        key: live.clone(),
        amount: 2,
        lifetime: Lifetime::FirstUse {
            deadline: now + hour_long,
        },
        since: now,
        id: redis_support::settle_id(),
    };
    assert_eq!(store.settle_debt(now, debt).await.unwrap(), Some(3));
    let pttl: i64 = server.cli(&["pttl", live.as_str()]).parse().unwrap();
    assert!(pttl > 0 && pttl <= 3_600_000, "dated again: {pttl}");

    // A settle past what the script counts exactly writes nothing, heal
    // included.
    assert_eq!(server.cli(&["persist", live.as_str()]), "1");
    let huge = tower_quota::store::Debt {
        key: live.clone(),
        amount: 1 << 53,
        lifetime: Lifetime::FirstUse {
            deadline: now + hour_long,
        },
        since: now,
        id: redis_support::settle_id(),
    };
    assert!(store.settle_debt(now, huge).await.is_err());
    assert_eq!(
        server.cli(&["pttl", live.as_str()]),
        "-1",
        "nothing written"
    );
}

/// A key of `allowance` whose stamp two instances read as two windows (one
/// day, two midnights), with a counter of 1 of a limit of 3 made on `store`
/// and on `memory` alike by the instance whose window ends first, a second
/// after the counter's first call; and an instant two seconds later, when
/// the other instance's window, of an hour from then, runs on.
async fn disagreed(
    store: &RedisStore,
    memory: &tower_quota::MemoryStore,
    allowance: &str,
) -> (PeriodKey, Timestamp) {
    let k = Namespace::default().key(&Subject::account("acme"), allowance, "2026-10-25[Europe/X]");
    let t0 = Timestamp::from_millisecond(Timestamp::now().as_millisecond()).unwrap();
    let early = calendar(&k, 3, 1, t0, t0 + SignedDuration::from_secs(1));
    assert!(store.charge(early.clone()).await.unwrap().admitted);
    assert!(memory.charge(early).await.unwrap().admitted);
    (k, t0 + SignedDuration::from_secs(2))
}

/// Two instances that disagree on the window of one stamp (time zone rules
/// of different releases: one day, two midnights): past the end the
/// counter records, a charge whose window runs on counts on a counter of
/// its own, as on the memory store, and never on none (every charge
/// admitted until the counter's grace ended).
#[tokio::test]
async fn a_counter_over_by_the_end_it_records_gives_way_to_the_lines_window() {
    let server = redis_server_or_skip!();
    for batch in [true, false] {
        let store = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(1))
            .batch_charges(batch)
            .build()
            .unwrap();
        let memory = tower_quota::MemoryStore::new();
        let (k, t1) = disagreed(&store, &memory, &format!("disagree-{batch}")).await;
        let late = calendar(&k, 3, 1, t1, t1 + hour());
        let mut admitted = (0, 0);
        for _ in 0..10 {
            admitted.0 += u32::from(store.charge(late.clone()).await.unwrap().admitted);
            admitted.1 += u32::from(memory.charge(late.clone()).await.unwrap().admitted);
        }
        assert_eq!(admitted, (3, 3), "batch {batch}");
        let peek = store.peek(late.clone()).await.unwrap();
        assert_eq!(peek, memory.peek(late).await.unwrap(), "batch {batch}");
        assert_eq!(peek[0].used, 3, "batch {batch}");
    }
}

/// A charge Redis applies after its caller stopped waiting is given back,
/// also when Redis answers the give-back "busy" (another client's slow
/// script) for seconds: such an answer applied nothing, and the give-back
/// is sent again until Redis runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_charge_is_given_back_through_seconds_of_busy_answers() {
    let server = redis_server_or_skip!();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let k = key("late-busy");
    let now = Timestamp::now();
    admit(&store, first_use(&k, 10, 1, now, hour())).await;
    assert_eq!(
        server.cli(&["config", "set", "busy-reply-threshold", "20"]),
        "OK"
    );
    // Redis runs the next charge only after its caller stopped waiting.
    assert_eq!(server.cli(&["client", "pause", "400", "all"]), "OK");
    let late = store.charge(first_use(&k, 10, 1, now, hour())).await;
    assert!(late.is_err(), "{late:?}");
    // Then another client's script keeps Redis busy for 2.5 s, from just
    // after the late charge ran: its give-back is answered BUSY meanwhile.
    let port = server.port();
    let busy = std::thread::spawn(move || {
        redis_support::cli(
            port,
            &[
                "eval",
                "local t = redis.call('TIME') local n repeat n = redis.call('TIME') \
                 until (n[1] - t[1]) * 1000000 + (n[2] - t[2]) > 2500000 return 1",
                "0",
            ],
        )
    });
    assert_eq!(busy.join().unwrap(), "1");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while server.cli(&["hget", k.as_str(), "n"]) != "1" && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        server.cli(&["hget", k.as_str(), "n"]),
        "1",
        "the late charge was not given back (given back: {})",
        store.given_back()
    );
}

/// A cost past the most the script counts exactly is refused whole, never
/// charged short (a limit past it is sent as the largest exact one).
#[tokio::test]
async fn a_cost_past_what_redis_counts_exactly_is_refused_not_cut() {
    let server = redis_server_or_skip!();
    for batch in [true, false] {
        let store = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(1))
            .batch_charges(batch)
            .build()
            .unwrap();
        let max = store.max_count();
        let k = key(&format!("past-exact-{batch}"));
        for limit in [max, u64::MAX] {
            let request = first_use(&k, limit, max + 1, Timestamp::now(), hour());
            let refused = store.charge(request).await;
            assert!(
                matches!(&refused, Err(e) if e.kind() == StoreErrorKind::Other),
                "batch {batch}, limit {limit}: {refused:?}"
            );
        }
        assert_eq!(server.cli(&["exists", k.as_str()]), "0", "batch {batch}");
    }
}

/// A first-use counter that lost its deadline is dated again by its first
/// call, but never more than one period from now: a first call ahead (an
/// instance whose clock is ahead wrote it) would lock the subject out for
/// longer than a period.
#[tokio::test]
async fn a_heal_never_dates_a_counter_past_one_period_from_now() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let mut redis = client(&server).await;
    let now = Timestamp::now();
    let ahead = (now + SignedDuration::from_mins(30)).as_millisecond();
    for (k, heal) in [
        (key("heal-ahead-charge"), "charge"),
        (key("heal-ahead-settle"), "settle"),
    ] {
        let () = redis::cmd("HSET")
            .arg(k.as_str())
            .arg("n")
            .arg(10)
            .arg("t")
            .arg(ahead)
            .query_async(&mut redis)
            .await
            .unwrap();
        if heal == "charge" {
            store
                .charge(first_use(&k, 10, 1, now, hour()))
                .await
                .unwrap();
        } else {
            let debt = tower_quota::store::Debt {
                key: k.clone(),
                amount: 1,
                lifetime: Lifetime::FirstUse {
                    deadline: now + hour(),
                },
                since: now,
                id: redis_support::settle_id(),
            };
            store.settle_debt(now, debt).await.unwrap();
        }
        let pttl: i64 = redis.pttl(k.as_str()).await.unwrap();
        assert!(
            (0..=hour().as_millis() as i64).contains(&pttl),
            "{heal}: healed to {pttl} ms"
        );
    }
}

/// A settle heals a first-use counter that lost its deadline by the
/// counter's own first call: a debt of requests made before it (a store
/// failing then) does not end it early.
#[tokio::test]
async fn a_settle_heal_keeps_the_counters_own_deadline() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let k = key("settle-heal-own");
    let now = Timestamp::now();
    admit(&store, first_use(&k, 10, 1, now, hour())).await;
    assert_eq!(server.cli(&["persist", k.as_str()]), "1");
    let since = now - SignedDuration::from_mins(30);
    let debt = tower_quota::store::Debt {
        key: k.clone(),
        amount: 1,
        lifetime: Lifetime::FirstUse {
            deadline: since + hour(),
        },
        since,
        id: redis_support::settle_id(),
    };
    assert_eq!(store.settle_debt(now, debt).await.unwrap(), Some(2));
    let pttl: i64 = server.cli(&["pttl", k.as_str()]).parse().unwrap();
    assert!(
        (3_500_000..=3_600_000).contains(&pttl),
        "healed to {pttl} ms: the counter opened now lasts an hour"
    );
}

/// As a charge, a settle past the end a counter records, of a debt whose
/// window runs on (instances that disagree on the window of one stamp),
/// counts on a counter of the debt's window, as on the memory store: the
/// requests owed are counted, not dropped.
#[tokio::test]
async fn a_settle_past_the_end_a_counter_records_counts_the_debt() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let memory = tower_quota::MemoryStore::new();
    let (k, t1) = disagreed(&store, &memory, "disagree-settle").await;
    let debt = tower_quota::store::Debt {
        key: k.clone(),
        amount: 2,
        lifetime: Lifetime::Calendar {
            start: t1,
            end: t1 + hour(),
        },
        since: t1,
        id: redis_support::settle_id(),
    };
    let settled = (
        store.settle_debt(t1, debt.clone()).await.unwrap(),
        memory.settle_debt(t1, debt).await.unwrap(),
    );
    let late = calendar(&k, 3, 1, t1, t1 + hour());
    let mut admitted = (0, 0);
    for _ in 0..10 {
        admitted.0 += u32::from(store.charge(late.clone()).await.unwrap().admitted);
        admitted.1 += u32::from(memory.charge(late.clone()).await.unwrap().admitted);
    }
    assert_eq!((settled, admitted), ((Some(2), Some(2)), (1, 1)));
}

/// A server restarted (its counters kept by its append-only file) within
/// the second in which a connection used since is not pinged: the store's
/// connection to the old process is closed before a change is sent on it,
/// so the change was never sent. It must say so (never sent), or find a
/// fresh connection: the layer sends again only a change never sent, and a
/// give-back lost so leaves a request that was not served charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_after_a_quick_restart_is_applied_or_sent_again() {
    if !redis_support::redis_available() {
        return;
    }
    let server = Arc::new(Mutex::new(RedisServer::start_with(&[
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
    ])));
    let (url, port) = {
        let server = server.lock().unwrap();
        (server.url(), server.port())
    };
    let store = RedisStore::builder(url)
        .pool_size(1)
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap();

    // The store alone: an add after the restart.
    let key = key("quick-change");
    let now = Timestamp::now();
    admit(&store, first_use(&key, 10, 1, now, hour())).await;
    server.lock().unwrap().restart();
    assert_eq!(redis_support::cli(port, &["hget", key.as_str(), "n"]), "1");
    match store.add(now, key.clone(), 5).await {
        Ok(Some(6)) => {}
        Err(error) if error.is_unsent() => {}
        other => panic!("an add never sent is neither applied nor said unsent: {other:?}"),
    }

    // Through the layer: a 500 given back, the server restarted while the
    // handler ran.
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .refund_server_errors(true)
        .build();
    let restarted = Arc::clone(&server);
    let app = Router::new()
        .route(
            "/",
            get(move || {
                let restarted = Arc::clone(&restarted);
                async move {
                    tokio::task::spawn_blocking(move || restarted.lock().unwrap().restart())
                        .await
                        .unwrap();
                    StatusCode::INTERNAL_SERVER_ERROR
                }
            }),
        )
        .layer(policy.layer(Quota::daily(10)));
    let response = app.oneshot(call("acme")).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        acme_used_once_given_back(&policy).await,
        0,
        "the request answered with a 500 stays charged"
    );
}

/// What `acme` has used of `default-day` once a give-back on its way had
/// time to land (up to 3 s; at once when it reaches 0).
async fn acme_used_once_given_back(policy: &QuotaPolicy<FromHeader, RedisStore>) -> u64 {
    let handle = policy.handle();
    let mut used = u64::MAX;
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let usage = handle.usage(&Subject::account("acme")).await.unwrap();
        used = usage
            .iter()
            .find(|u| u.name() == "default-day")
            .unwrap()
            .used();
        if used == 0 {
            break;
        }
    }
    used
}

/// A server restarted (its counters kept by its append-only file) behind
/// a layer whose `/fail` handler restarts it, blocking the runtime's one
/// thread while it does, as a busy thread would be.
fn restarting_app() -> (
    Arc<Mutex<RedisServer>>,
    QuotaPolicy<FromHeader, RedisStore>,
    Router,
) {
    let server = Arc::new(Mutex::new(RedisServer::start_with(&[
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
    ])));
    let url = server.lock().unwrap().url();
    let store = RedisStore::builder(url)
        .pool_size(1)
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .refund_server_errors(true)
        .build();
    let restarted = Arc::clone(&server);
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route(
            "/fail",
            get(move || {
                let restarted = Arc::clone(&restarted);
                async move {
                    restarted.lock().unwrap().restart();
                    StatusCode::INTERNAL_SERVER_ERROR
                }
            }),
        )
        .layer(policy.layer(Quota::daily(10)));
    (server, policy, app)
}

/// A restart within the second on a runtime of one thread: the old
/// process's socket is closed when the next charge comes, before the
/// connection's driver ran to read that (the restart blocked the thread).
/// The check of the quiet connection lets the driver run, finds it closed,
/// and the charge goes on a fresh connection: no 503 with Redis back.
#[tokio::test]
async fn a_quick_restart_on_a_single_thread_runtime_costs_no_request() {
    if !redis_support::redis_available() {
        return;
    }
    let (server, _policy, app) = restarting_app();
    assert_eq!(
        app.clone().oneshot(call("acme")).await.unwrap().status(),
        StatusCode::OK
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    server.lock().unwrap().restart();
    assert_eq!(
        app.clone().oneshot(call("acme")).await.unwrap().status(),
        StatusCode::OK,
        "a charge after a quick restart"
    );
}

/// Likewise for a give-back (a change, always checked first): the
/// handler restarts the server and answers 500, and the give-back of its
/// charge is applied or said unsent (and sent again), never lost on the
/// old socket: the request is charged nothing.
#[tokio::test]
async fn a_give_back_after_a_quick_restart_on_a_single_thread_runtime_is_not_lost() {
    if !redis_support::redis_available() {
        return;
    }
    let (_server, policy, app) = restarting_app();
    let failing = Request::get("/fail")
        .header("x-account-id", "acme")
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(failing).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        acme_used_once_given_back(&policy).await,
        0,
        "the request answered with a 500 stays charged"
    );
}

/// Through the layer, failing closed: many requests at once after a
/// restart within the second are all served (no 503 with Redis back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_at_once_after_a_quick_restart_get_no_503() {
    let mut server = redis_server_or_skip!();
    let app = app(store(&server), 10_000);
    for _ in 0..4 {
        assert_eq!(
            app.clone().oneshot(call("a")).await.unwrap().status(),
            StatusCode::OK
        );
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    server.restart();
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..32 {
        let app = app.clone();
        calls.spawn(async move {
            app.oneshot(call(&format!("acct{}", i % 5)))
                .await
                .unwrap()
                .status()
        });
    }
    let mut statuses = Vec::new();
    while let Some(status) = calls.join_next().await {
        statuses.push(status.unwrap());
    }
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
}

/// Many callers at once after a restart within the second, on one
/// connection and more worker threads than two: a caller handed the
/// connection just after another, which checks it, is checked too (the
/// connection is not known open yet), and none fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn callers_racing_for_a_quiet_connection_after_a_quick_restart_fail_none() {
    let mut server = redis_server_or_skip!();
    let store = RedisStore::builder(server.url())
        .pool_size(1)
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let key = key("quick-race");
    let mut failed = Vec::new();
    for round in 0..30 {
        admit(
            &store,
            first_use(&key, 1_000_000, 1, Timestamp::now(), hour()),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        server.restart();
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..64 {
            let store = store.clone();
            let key = key.clone();
            calls.spawn(async move {
                let request = first_use(&key, 1_000_000, 1, Timestamp::now(), hour());
                if i % 2 == 0 {
                    store.peek(request).await.map(|_| ())
                } else {
                    store.charge(request).await.map(|_| ())
                }
            });
        }
        while let Some(result) = calls.join_next().await {
            if let Err(error) = result.unwrap() {
                failed.push((round, error.to_string()));
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} calls failed: {failed:?}",
        failed.len()
    );
}

/// A charge taking extra units (a leased block with its request) takes as
/// many as fit in the one call of the script: what is left of a counter
/// nearly full, nothing when the request is refused.
#[tokio::test]
async fn a_charge_takes_the_extra_units_that_fit_in_one_call() {
    let server = redis_server_or_skip!();
    let store = store(&server);
    let (a, b) = (key("take-a"), key("take-b"));
    let now = Timestamp::now();
    let taking = |cost, extra: [u64; 2]| {
        let mut request = first_use(&a, 10, cost, now, hour());
        request
            .lines
            .push(first_use(&b, 100, cost, now, hour()).lines[0].clone());
        store.charge_taking(request, extra.into_iter().collect())
    };
    store.preload().await.unwrap();
    let before = server.cli(&["info", "commandstats"]);
    let (outcome, taken) = taking(2, [5, 5]).await.unwrap();
    assert!(outcome.admitted);
    assert_eq!(taken.as_slice(), [5, 5]);
    assert_eq!((outcome.usage[0].used, outcome.usage[1].used), (7, 7));
    let (outcome, taken) = taking(2, [5, 5]).await.unwrap();
    assert!(outcome.admitted);
    assert_eq!(taken.as_slice(), [1, 5]);
    assert_eq!((outcome.usage[0].used, outcome.usage[1].used), (10, 14));
    let (outcome, taken) = taking(1, [5, 5]).await.unwrap();
    assert!(!outcome.admitted);
    assert_eq!(taken.as_slice(), [0, 0]);
    assert_eq!(server.cli(&["hget", a.as_str(), "n"]), "10");
    assert_eq!(server.cli(&["hget", b.as_str(), "n"]), "14");
    let calls = |stats: &str| {
        stats
            .lines()
            .filter(|line| {
                line.starts_with("cmdstat_evalsha:") || line.starts_with("cmdstat_eval:")
            })
            .filter_map(|line| {
                line.split("calls=")
                    .nth(1)?
                    .split(',')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum::<u64>()
    };
    let after = server.cli(&["info", "commandstats"]);
    assert_eq!(
        calls(&after) - calls(&before),
        3,
        "one call of the script each"
    );
}

/// A charge taking extra units that Redis runs after its caller stopped
/// waiting is given back whole: its cost and the units it took; a line of
/// no cost too (a block taken beside a request that costs nothing there).
#[tokio::test]
async fn a_late_charge_taking_units_gives_them_back_with_its_cost() {
    let server = redis_server_or_skip!();
    for (name, cost) in [("take-late", 2), ("take-late-free", 0)] {
        // A store of its own: the last one's connection is left behind,
        // and a new one would not open while Redis is paused.
        let store = RedisStore::builder(server.url())
            .timeout(Duration::from_millis(100))
            .build()
            .unwrap();
        let key = key(name);
        admit(&store, first_use(&key, 100, 1, Timestamp::now(), hour())).await;

        assert_eq!(server.cli(&["client", "pause", "600", "all"]), "OK");
        let error = store
            .charge_taking(
                first_use(&key, 100, cost, Timestamp::now(), hour()),
                smallvec::smallvec![10],
            )
            .await
            .expect_err("a server that does not answer in time is an error");
        assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert_eq!(
            server.cli(&["hget", key.as_str(), "n"]),
            "1",
            "cost {cost}: the late charge and the units it took were given back"
        );
    }
}

/// A policy whose `store_timeout` is far longer than the Redis store's own
/// budget for a call waits for nothing more: its build says so, and says
/// nothing when the two are set together.
#[test]
fn a_store_timeout_far_past_the_stores_budget_is_logged_when_built() {
    let recorder = Recorder::default();
    let _guard = tracing::subscriber::set_default(recorder.clone());
    let _interest = interest::every_subscriber_asked();
    let build = |budget: Option<Duration>, timeout: Duration| {
        let mut store = RedisStore::builder("redis://127.0.0.1:1/");
        if let Some(budget) = budget {
            store = store.timeout(budget);
        }
        let store = store.build().unwrap();
        // A leased store over it has the same budget for a call.
        assert_eq!(
            tower_quota::LeasedStore::new(store.clone()).call_budget(),
            store.call_budget()
        );
        let _ = QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store)
            .store_timeout(Some(timeout))
            .build();
        let warned = recorder
            .0
            .lock()
            .unwrap()
            .drain(..)
            .any(|event| event.contains("far longer than the store's own budget"));
        warned
    };
    assert!(build(None, Duration::from_secs(3)), "80 ms against 3 s");
    assert!(!build(None, Duration::from_millis(100)), "the defaults");
    assert!(!build(
        Some(Duration::from_millis(2_500)),
        Duration::from_secs(3)
    ));
}

/// A refund whose answer was lost on the wire (Redis ran it, the connection
/// broke before its answer came back) may have been applied: its error
/// never says it was not sent, for the layer sends again only a change
/// never sent, and a give-back sent twice hands back a unit never spent.
#[tokio::test]
async fn a_change_lost_on_the_wire_is_never_said_unsent() {
    let server = redis_server_or_skip!();
    let wire = redis_support::Wire::start(server.port()).await;
    let store = RedisStore::builder(wire.url())
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let key = key("lost-change");
    admit(&store, first_use(&key, 10, 3, Timestamp::now(), hour())).await;
    wire.lose_next(b'r');
    let error = store
        .refund(Timestamp::now(), key.clone(), 1)
        .await
        .expect_err("the refund's answer was lost");
    assert!(
        !error.is_unsent(),
        "a refund Redis ran is said never sent: {error}"
    );
    assert_eq!(
        server.cli(&["hget", key.as_str(), "n"]),
        "2",
        "Redis ran it"
    );
}

/// The same failover under a store on a pool built elsewhere: a pooled
/// connection to the old master, which refuses every write with `READONLY`
/// and answers the pool's pings, is closed, not put back, and the next
/// charges reach the new master.
#[tokio::test(flavor = "multi_thread")]
async fn a_store_on_a_pool_drops_a_connection_to_a_demoted_master() {
    let old = RedisServer::start();
    let new = RedisServer::start();
    let target = Arc::new(Mutex::new(old.port()));
    let port = switchable_proxy(Arc::clone(&target)).await;
    let pool = deadpool_redis::Config::from_url(format!("redis://127.0.0.1:{port}/"))
        .create_pool(Some(deadpool_redis::Runtime::Tokio1))
        .unwrap();
    let store = RedisStore::builder_from_pool(pool)
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let key = key("pool-failover");
    for _ in 0..4 {
        admit(&store, first_use(&key, 1_000, 1, Timestamp::now(), hour())).await;
    }
    old.cli(&["replicaof", "127.0.0.1", &new.port().to_string()]);
    *target.lock().unwrap() = new.port();
    let mut failed = 0;
    for _ in 0..20 {
        if store
            .charge(first_use(&key, 1_000, 1, Timestamp::now(), hour()))
            .await
            .is_err()
        {
            failed += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(failed <= 2, "{failed} of 20 charges failed");
}

/// A charge Redis runs late (its caller stopped waiting) makes a first-use
/// counter whose time to live, reckoned when it was sent, runs from when
/// Redis ran it; another instance's charge lands in it before the
/// give-back. The give-back ends the counter a period after the late
/// charge was sent, as its first call says, not as much later as Redis ran
/// it: its subject is not refused past its period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_charge_that_made_a_first_use_counter_gives_back_its_lateness_too() {
    let server = redis_server_or_skip!();
    for batch in [true, false] {
        late_charge_that_made_a_counter(&server, batch, SignedDuration::ZERO).await;
    }
}

/// As `a_late_charge_that_made_a_first_use_counter_gives_back_its_lateness_too`,
/// for a charge of a layer the request reached 3 s late (`charged_at`): its
/// counter's time to live runs from the charge to the deadline, and the
/// give-back ends it by the deadline, on a store that batches charges or
/// not (a cluster's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_charge_of_a_layer_reached_late_ends_its_counter_by_the_deadline() {
    let server = redis_server_or_skip!();
    for batch in [true, false] {
        late_charge_that_made_a_counter(&server, batch, SignedDuration::from_secs(3)).await;
    }
}

/// See `a_late_charge_that_made_a_first_use_counter_gives_back_its_lateness_too`;
/// the late charge is made `reached_late` after its request's instant.
async fn late_charge_that_made_a_counter(
    server: &RedisServer,
    batch: bool,
    reached_late: SignedDuration,
) {
    let late = RedisStore::builder(server.url())
        .timeout(Duration::from_millis(100))
        .batch_charges(batch)
        .build()
        .unwrap();
    let other = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    late.preload().await.unwrap();
    other.preload().await.unwrap();
    let k = key(&format!("late-made-{batch}-{}", reached_late.as_millis()));
    let period = SignedDuration::from_secs(10);
    // Redis runs nothing for 1.5 s: the late charge, then the other
    // instance's, in the order sent.
    assert_eq!(server.cli(&["client", "pause", "1500", "all"]), "OK");
    let sent = tokio::time::Instant::now();
    let charged = Timestamp::now();
    let mut request = first_use(&k, 10, 1, charged - reached_late, period);
    request.charged_at = (!reached_late.is_zero()).then_some(charged);
    let charge = late.charge(request).await;
    assert!(charge.is_err(), "batch {batch}: {charge:?}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let request = first_use(&k, 10, 1, Timestamp::now(), period);
    assert!(other.charge(request).await.unwrap().admitted);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while late.given_back() == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(late.given_back(), 1, "batch {batch}");
    let n = server.cli(&["hget", k.as_str(), "n"]);
    assert_eq!(n, "1", "batch {batch}: the other's only");
    let pttl: u64 = server.cli(&["pttl", k.as_str()]).parse().unwrap();
    // The deadline: a period after the request's instant.
    let most = (period - reached_late)
        .unsigned_abs()
        .saturating_sub(sent.elapsed());
    assert!(
        Duration::from_millis(pttl) <= most + Duration::from_millis(50),
        "batch {batch}: the counter lives {pttl} ms more, a period from the late charge {} ms",
        most.as_millis()
    );
}

/// A request to `/` for acme, held 1 s between the quota layers of
/// [`two_layers_around_a_slow_one`] when `slow`.
fn held(slow: bool) -> Request<Body> {
    let mut request = Request::get("/").header("x-account-id", "acme");
    if slow {
        request = request.header("x-slow", "1");
    }
    request.body(Body::empty()).unwrap()
}

/// Two layers of one policy on `store`: a daily quota outside, a rolling
/// one (1 per 2 s) inside, and between them a middleware that holds a
/// request asking for it 1 s (an authentication call, a queue).
fn two_layers_around_a_slow_one<St: Store>(store: St) -> Router {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .build();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(policy.layer(Quota::rolling(1, Duration::from_secs(2)).allowance("burst")))
        .route_layer(axum::middleware::from_fn(
            |request: axum::extract::Request, next: axum::middleware::Next| async move {
                if request.headers().contains_key("x-slow") {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                next.run(request).await
            },
        ))
        .route_layer(policy.layer(Quota::daily(1_000).allowance("read")))
}

/// What `store` answers through [`two_layers_around_a_slow_one`]: the
/// first request (held between the layers), a second at once (refused),
/// its `Retry-After`, and a third once a period from the first call and
/// 500 ms are past.
async fn held_then_after_a_period<St: Store>(
    store: St,
) -> (StatusCode, StatusCode, u64, StatusCode) {
    let app = two_layers_around_a_slow_one(store);
    let start = Instant::now();
    let first = app.clone().oneshot(held(true)).await.unwrap().status();
    let refused = app.clone().oneshot(held(false)).await.unwrap();
    let retry_after: u64 = refused
        .headers()
        .get("retry-after")
        .map_or(0, |v| v.to_str().unwrap().parse().unwrap());
    let due = start + Duration::from_millis(2_500);
    tokio::time::sleep(due.saturating_duration_since(Instant::now())).await;
    let again = app.clone().oneshot(held(false)).await.unwrap().status();
    (first, refused.status(), retry_after, again)
}

/// A first-use counter made by a layer the request reached late (1 s
/// behind a slow middleware, inside another quota layer) records the
/// request's instant as its first call, and ends a period after it on
/// Redis as in memory: its time to live runs from the charge. The refusal
/// meanwhile tells the same wait on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_use_counter_made_by_a_layer_reached_late_ends_a_period_after_its_first_call() {
    let server = redis_server_or_skip!();
    let (memory, redis) = tokio::join!(
        held_then_after_a_period(tower_quota::MemoryStore::new()),
        held_then_after_a_period(RedisStore::new(server.url()).unwrap())
    );
    let expected = (
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
        StatusCode::OK,
    );
    assert_eq!(
        (memory.0, memory.1, memory.3),
        expected,
        "memory: {memory:?}"
    );
    assert_eq!((redis.0, redis.1, redis.3), expected, "Redis: {redis:?}");
    assert_eq!(redis.2, memory.2, "Retry-After on Redis and in memory");
}
