//! Fail open on a real three-node Redis Cluster: a node that stalls owes
//! its subjects' admissions, settled once it answers; the other nodes'
//! subjects are charged as usual all along. With a daily quota and a
//! per-minute burst (two keys of one slot per charge), over the Redis store
//! and over a `LeasedStore` of it.

#![cfg(all(feature = "redis-cluster", feature = "testing"))]

mod redis_support;

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_quota::jiff::Timestamp;
use tower_quota::store::{LeasedStore, RedisStore, RedisStoreBuilder, Store};
use tower_quota::{FromHeader, ManualClock, Namespace, OnStoreError, Quota, QuotaPolicy, Subject};

use redis_support::{redis_available, RedisCluster, Stopped};

async fn request(app: &Router, account: &str) -> StatusCode {
    let request = Request::get("/")
        .header("x-account-id", account)
        .body(Body::empty())
        .unwrap();
    app.clone().oneshot(request).await.unwrap().status()
}

fn quotas() -> [Quota; 2] {
    [Quota::daily(1_000_000), Quota::per_minute(1_000_000)]
}

/// The counts of `account`'s counters of both quotas at `at`.
fn counts(cluster: &RedisCluster, account: &str, at: Timestamp) -> Vec<String> {
    quotas()
        .iter()
        .map(|quota| {
            let key = quota.key(&Namespace::default(), &Subject::account(account), at);
            cluster.nodes[cluster.node_of(key.as_str())].cli(&["hget", key.as_str(), "n"])
        })
        .collect()
}

/// A store on `cluster`, seeded by its second node, with 300 ms budgets.
fn cluster_builder(cluster: &RedisCluster) -> RedisStoreBuilder {
    RedisStore::cluster_builder(vec![cluster.nodes[1].url()])
        .timeout(Duration::from_millis(300))
        .connect_timeout(Duration::from_millis(300))
}

fn cluster_store(cluster: &RedisCluster) -> RedisStore {
    cluster_builder(cluster)
        .build()
        .expect("a Redis Cluster store")
}

/// A policy failing open on `store`, with `clock` and `store_timeout`, and
/// an app whose one route it charges on both quotas.
fn fail_open_app<St: Store>(
    store: St,
    clock: &ManualClock,
    store_timeout: Duration,
) -> (QuotaPolicy<FromHeader, St>, Router) {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .clock(clock.clone())
        .on_store_error(OnStoreError::FailOpen)
        .store_timeout(Some(store_timeout))
        .build();
    let [q0, q1] = quotas();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(policy.layer(q0).quota(q1));
    (policy, app)
}

/// Once no call of `redis` is in flight (every late charge given back),
/// each subject's counters of both quotas at `at` hold what it was served.
async fn counted_as_served(
    cluster: &RedisCluster,
    redis: &RedisStore,
    subjects: &[String; 3],
    served: [u64; 3],
    at: Timestamp,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while redis.in_flight() > 0 {
        assert!(Instant::now() < deadline, "calls still in flight");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    for (i, account) in subjects.iter().enumerate() {
        assert_eq!(
            counts(cluster, account, at),
            vec![served[i].to_string(); 2],
            "{account} (node {i}): every admission counted once, on both quotas ({} given back)",
            redis.given_back()
        );
    }
}

/// A minute's start: the per-minute window holds the whole test.
fn frozen_clock() -> ManualClock {
    let now = Timestamp::now().as_second();
    ManualClock::new(Timestamp::from_second(now - now.rem_euclid(60) + 5).unwrap())
}

/// Stops node 0 for 2.5 s under traffic for a subject on each node, fail
/// open; then settles. Every admission is counted on both quotas, and
/// only the stalled node's subject ever owed anything.
async fn through_a_stalled_node<St: Store>(
    cluster: &RedisCluster,
    redis: &RedisStore,
    store: St,
    store_timeout: Duration,
    prefix: &str,
    after: impl AsyncFnOnce(),
) {
    let clock = frozen_clock();
    let (policy, app) = fail_open_app(store, &clock, store_timeout);
    let subjects = cluster.subject_per_node(prefix);
    let mut served = [0u64; 3];
    for (i, account) in subjects.iter().enumerate() {
        let since = Instant::now();
        loop {
            // The first calls open the connection and read the slots.
            let status = request(&app, account).await;
            assert_eq!(status, StatusCode::OK);
            served[i] += 1;
            if policy.owed().units == 0 || since.elapsed() > Duration::from_secs(5) {
                break;
            }
        }
    }
    assert_eq!(policy.settle_owed(Duration::from_secs(5)).await.units, 0);
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut stopped = Stopped::new(&cluster.nodes[0]);
    let stall = Instant::now();
    let mut callers = tokio::task::JoinSet::new();
    for (i, account) in subjects.iter().enumerate().skip(1) {
        let (app, account) = (app.clone(), account.clone());
        callers.spawn(async move {
            let (mut ok, mut slowest, mut other) = (0u64, Duration::ZERO, Vec::new());
            while stall.elapsed() < Duration::from_millis(2_500) {
                let started = Instant::now();
                match request(&app, &account).await {
                    StatusCode::OK => ok += 1,
                    status => other.push(status),
                }
                slowest = slowest.max(started.elapsed());
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (i, ok, slowest, other)
        });
    }
    let mut most_owed = 0;
    while stall.elapsed() < Duration::from_millis(2_500) {
        assert_eq!(request(&app, &subjects[0]).await, StatusCode::OK);
        served[0] += 1;
        most_owed = most_owed.max(policy.owed().counters);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    while let Some(caller) = callers.join_next().await {
        let (i, ok, slowest, other) = caller.unwrap();
        assert!(other.is_empty(), "{}: {other:?}", subjects[i]);
        assert!(ok > 20, "{}: {ok} served", subjects[i]);
        assert!(
            slowest < Duration::from_millis(250),
            "{}: a request of a node that answers took {slowest:?}",
            subjects[i]
        );
        served[i] += ok;
    }
    assert!(
        (1..=2).contains(&most_owed),
        "the stalled node's subject's two counters owed, no other: {most_owed}"
    );

    stopped.resume();
    let owed = policy.settle_owed(Duration::from_secs(20)).await;
    assert_eq!(owed.units, 0, "{owed:?}");
    after().await;
    counted_as_served(cluster, redis, &subjects, served, clock.now()).await;
}

/// With the layer's `store_timeout` longer than the store's budget, and
/// shorter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_through_a_stalled_node_counts_every_admission() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    for (store_timeout, prefix) in [(500, "open"), (100, "short")] {
        let redis = cluster_store(&cluster);
        through_a_stalled_node(
            &cluster,
            &redis,
            redis.clone(),
            Duration::from_millis(store_timeout),
            prefix,
            async || {},
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_fail_open_through_a_stalled_node_counts_every_admission() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let redis = cluster_store(&cluster);
    let leased = LeasedStore::new(redis.clone());
    let shut = leased.clone();
    through_a_stalled_node(
        &cluster,
        &redis,
        leased,
        Duration::from_millis(500),
        "leased",
        async move || {
            shut.shutdown().await;
        },
    )
    .await;
}

/// A node killed and restarted (no persistence: its counters are lost),
/// fail open: what its subject was served while it was down is settled
/// into its fresh counters once it is back, the other subjects are
/// charged as usual all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_through_a_restarted_node_counts_every_admission() {
    if !redis_available() {
        return;
    }
    let mut cluster = RedisCluster::start();
    let redis = cluster_store(&cluster);
    let clock = frozen_clock();
    let (policy, app) = fail_open_app(redis.clone(), &clock, Duration::from_millis(500));
    let subjects = cluster.subject_per_node("restart");
    let mut served = [0u64; 3];
    for (i, account) in subjects.iter().enumerate() {
        for _ in 0..3 {
            assert_eq!(request(&app, account).await, StatusCode::OK);
            served[i] += 1;
        }
    }
    assert_eq!(policy.settle_owed(Duration::from_secs(5)).await.units, 0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Its counters go with it.
    cluster.nodes[0].kill();
    served[0] = 0;
    let down = Instant::now();
    let mut most_owed = 0;
    while down.elapsed() < Duration::from_millis(1_500) {
        for (i, account) in subjects.iter().enumerate() {
            let started = Instant::now();
            assert_eq!(request(&app, account).await, StatusCode::OK);
            if i > 0 {
                assert!(
                    started.elapsed() < Duration::from_millis(250),
                    "{account}: {:?}",
                    started.elapsed()
                );
            }
            served[i] += 1;
        }
        most_owed = most_owed.max(policy.owed().counters);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!((1..=2).contains(&most_owed), "{most_owed}");
    cluster.nodes[0].restart();
    let owed = policy.settle_owed(Duration::from_secs(20)).await;
    assert_eq!(owed.units, 0, "{owed:?}");
    for (i, account) in subjects.iter().enumerate() {
        for _ in 0..3 {
            assert_eq!(request(&app, account).await, StatusCode::OK);
            served[i] += 1;
        }
    }
    assert_eq!(policy.settle_owed(Duration::from_secs(20)).await.units, 0);
    counted_as_served(&cluster, &redis, &subjects, served, clock.now()).await;
}

/// Over a `LeasedStore`: the stalled node's subject holds a block when
/// the node stalls (its next requests spend it, then owe); a support reset
/// of another node's subject goes through meanwhile; once the node
/// answers, every admission is counted once on both quotas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_blocks_and_resets_through_a_stalled_node() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let redis = cluster_store(&cluster);
    let leased = LeasedStore::new(redis.clone());
    let clock = frozen_clock();
    let (policy, app) = fail_open_app(leased.clone(), &clock, Duration::from_millis(500));
    let subjects = cluster.subject_per_node("blocks");
    let mut served = [0u64; 3];
    // Busy: blocks grow.
    for _ in 0..60 {
        for (i, account) in subjects.iter().enumerate() {
            assert_eq!(request(&app, account).await, StatusCode::OK);
            served[i] += 1;
        }
    }
    assert_eq!(policy.settle_owed(Duration::from_secs(5)).await.units, 0);
    let mut stopped = Stopped::new(&cluster.nodes[0]);
    let stall = Instant::now();
    while stall.elapsed() < Duration::from_millis(2_000) {
        for (i, account) in subjects.iter().enumerate() {
            let started = Instant::now();
            assert_eq!(request(&app, account).await, StatusCode::OK);
            if i > 0 {
                assert!(
                    started.elapsed() < Duration::from_millis(250),
                    "{account}: {:?}",
                    started.elapsed()
                );
            }
            served[i] += 1;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    clock.advance(Duration::from_secs(1));
    let started = Instant::now();
    let reset = policy
        .handle()
        .reset_allowance(&Subject::account(subjects[1].as_str()), "default")
        .await;
    assert_eq!(reset.ok(), Some(2), "a reset of a node that answers");
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    served[1] = 0;
    clock.advance(Duration::from_secs(1));
    for _ in 0..5 {
        assert_eq!(request(&app, &subjects[1]).await, StatusCode::OK);
        served[1] += 1;
    }
    stopped.resume();
    let owed = policy.settle_owed(Duration::from_secs(20)).await;
    assert_eq!(owed.units, 0, "{owed:?}");
    leased.shutdown().await;
    counted_as_served(&cluster, &redis, &subjects, served, clock.now()).await;
}

/// The calls a stalled node's subjects leave behind (followed after their
/// callers gave up, to give back a charge the node runs late) take no room
/// from the other nodes' subjects: those are served while the node stalls,
/// however many of its subjects' requests failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_nodes_abandoned_calls_take_no_room_from_other_nodes() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let store = cluster_builder(&cluster)
        .max_in_flight(32)
        .build()
        .expect("a Redis Cluster store");
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store.clone())
        .store_timeout(Some(Duration::from_millis(500)))
        .build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(policy.layer(Quota::daily(1_000_000)));
    let subjects = cluster.subject_per_node("room");
    for account in &subjects {
        assert_eq!(request(&app, account).await, StatusCode::OK);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _stopped = Stopped::new(&cluster.nodes[0]);
    let stall = Instant::now();
    let until = Duration::from_millis(3_000);
    let mut stalled = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let (app, account) = (app.clone(), subjects[0].clone());
        stalled.spawn(async move {
            let mut refused = 0;
            while stall.elapsed() < until {
                if request(&app, &account).await == StatusCode::SERVICE_UNAVAILABLE {
                    refused += 1;
                }
                // A refusal at once never waits: without a pause, this loop
                // would hold its worker thread, as no client over a network
                // does.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            refused
        });
    }
    let mut healthy = Vec::new();
    while stall.elapsed() < until {
        for account in &subjects[1..] {
            let started = Instant::now();
            let status = request(&app, account).await;
            healthy.push((
                status,
                started.elapsed(),
                stall.elapsed(),
                store.in_flight(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused: u32 = stalled.join_all().await.into_iter().sum();
    assert!(
        refused > 32,
        "{refused} of the stalled node's requests refused"
    );
    let failed: Vec<_> = healthy
        .iter()
        .filter(|(status, _, _, _)| *status != StatusCode::OK)
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} requests of the nodes that answer failed (status, took, at, in flight): {:?}",
        failed.len(),
        healthy.len(),
        &failed[..failed.len().min(5)]
    );
}
