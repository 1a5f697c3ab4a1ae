//! A burst of requests on a Redis Cluster node that just stalled, on a real
//! three-node cluster on loopback: the calls it leaves unanswered hold at
//! most half of the store's room (`RedisStore` docs, "One node of a
//! cluster"), and the other nodes' calls find room; a node that answers,
//! however busy, has its calls past that half wait, never fail.

#![cfg(all(feature = "redis-cluster", feature = "testing"))]

mod redis_support;

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_quota::store::RedisStore;
use tower_quota::{FromHeader, Quota, QuotaPolicy};

use redis_support::{redis_available, RedisCluster, SlowProxy, Stopped};

async fn request(app: &Router, account: &str) -> StatusCode {
    let request = Request::get("/")
        .header("x-account-id", account)
        .body(Body::empty())
        .unwrap();
    app.clone().oneshot(request).await.unwrap().status()
}

/// With room for four calls, four requests at once for the subject of a
/// node that has just stalled: all four are sent before any was given up
/// on (the node is not known silent yet), time out, and are followed,
/// holding the whole room. A request of another node's subject then finds
/// none: refused, though its node answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_on_a_node_that_just_stalled_leaves_the_other_nodes_room() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let store = RedisStore::cluster_builder(vec![cluster.nodes[1].url()])
        .timeout(Duration::from_millis(300))
        .connect_timeout(Duration::from_millis(300))
        .max_in_flight(4)
        .build()
        .expect("a Redis Cluster store");
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store.clone())
        .store_timeout(Some(Duration::from_secs(2)))
        .build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(policy.layer(Quota::daily(1_000_000)));
    let [stalled, first, second] = cluster.subject_per_node("burst");
    for account in [&stalled, &first, &second] {
        let since = Instant::now();
        while request(&app, account).await != StatusCode::OK {
            assert!(since.elapsed() < Duration::from_secs(5));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // The map of slots read (the first calls asked for it).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _stopped = Stopped::new(&cluster.nodes[0]);
    let mut burst = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let (app, stalled) = (app.clone(), stalled.clone());
        burst.spawn(async move { request(&app, &stalled).await });
    }
    let statuses = burst.join_all().await;
    assert!(statuses
        .iter()
        .all(|s| *s == StatusCode::SERVICE_UNAVAILABLE));
    for account in [&first, &second] {
        let started = Instant::now();
        let status = request(&app, account).await;
        assert_eq!(
            status,
            StatusCode::OK,
            "refused after {:?}, with {} calls of the stalled node followed in a room of 4",
            started.elapsed(),
            store.in_flight()
        );
    }
}

/// With room for two calls (one per node), a node that answers every call
/// but slowly (100 ms each, under the 300 ms budget) gets six requests at
/// once: past its half of the room they wait for its answers, one after
/// the other, and every one is admitted; another node's subject is served
/// meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_node_past_its_half_of_the_room_has_its_calls_wait_not_fail() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let proxy = SlowProxy::start(cluster.nodes[0].port()).await;
    cluster.announce(0, proxy.port());
    let store = RedisStore::cluster_builder(vec![cluster.nodes[2].url()])
        .timeout(Duration::from_millis(300))
        .connect_timeout(Duration::from_millis(300))
        .max_in_flight(2)
        .build()
        .expect("a Redis Cluster store");
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store.clone())
        .store_timeout(Some(Duration::from_secs(5)))
        .build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(policy.layer(Quota::daily(1_000_000)));
    let [busy, other, _] = cluster.subject_per_node("busy-node");
    for account in [&busy, &other] {
        let since = Instant::now();
        while request(&app, account).await != StatusCode::OK {
            assert!(since.elapsed() < Duration::from_secs(5));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.slow(Duration::from_millis(100));
    let mut burst = tokio::task::JoinSet::new();
    for _ in 0..6 {
        let (app, busy) = (app.clone(), busy.clone());
        burst.spawn(async move { request(&app, &busy).await });
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(request(&app, &other).await, StatusCode::OK);
    let statuses = burst.join_all().await;
    assert_eq!(statuses, vec![StatusCode::OK; 6]);
    assert_eq!(store.in_flight(), 0);
}
