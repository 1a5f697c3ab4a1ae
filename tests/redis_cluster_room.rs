//! The room for calls a Redis Cluster node takes, on a real three-node
//! cluster on loopback: a node that stalled holds at most half of it with
//! its calls, and one that answers (slow, or back from a stall) is never
//! taken for a stalled one. A burst of calls to a node that just stalled,
//! sent before any was given up on, holds no more than half either; a node
//! that answers, however busy, has its calls past that half wait, never
//! fail.

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

use redis_support::{redis_available, RedisCluster, Stopped};

async fn request(app: &Router, account: &str) -> StatusCode {
    let request = Request::get("/")
        .header("x-account-id", account)
        .body(Body::empty())
        .unwrap();
    app.clone().oneshot(request).await.unwrap().status()
}

/// Waits until a request for `account` is admitted, 5 s at most.
async fn admitted_again(app: &Router, account: &str) {
    let since = Instant::now();
    loop {
        let status = request(app, account).await;
        if status == StatusCode::OK {
            return;
        }
        assert!(since.elapsed() < Duration::from_secs(5), "still {status}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A store on `cluster` seeded by node `seed`, with 300 ms budgets and room
/// for two calls, and an app charging a daily quota on it.
fn app_on(cluster: &RedisCluster, seed: usize) -> (RedisStore, Router) {
    app_with_room(cluster, seed, 2)
}

/// As [`app_on`], with room for `room` calls.
fn app_with_room(cluster: &RedisCluster, seed: usize, room: usize) -> (RedisStore, Router) {
    let store = RedisStore::cluster_builder(vec![cluster.nodes[seed].url()])
        .timeout(Duration::from_millis(300))
        .connect_timeout(Duration::from_millis(300))
        .max_in_flight(room)
        .build()
        .expect("a Redis Cluster store");
    (store.clone(), app_of(store))
}

/// An app charging a daily quota on `store`.
fn app_of(store: RedisStore) -> Router {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .store_timeout(Some(Duration::from_secs(2)))
        .build();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(policy.layer(Quota::daily(1_000_000)))
}

/// Stops node 0 of `cluster` for `stall` while `stalled`'s subject is sent
/// `per_tick` requests every `tick`, and asks for `other`'s subject every
/// 100 ms meanwhile: what `other` was answered other than at once with a
/// 200 (since the stop, status, wait, calls in flight). Once the node is
/// back, `stalled`'s subject is served again.
async fn stall_under_load(
    cluster: &RedisCluster,
    (store, app): (&RedisStore, &Router),
    [stalled, other]: [&str; 2],
    (per_tick, tick): (usize, Duration),
    stall: Duration,
) -> Vec<(Duration, StatusCode, Duration, usize)> {
    for node in &cluster.nodes {
        // Not voted failed during the stall.
        assert_eq!(
            node.cli(&["config", "set", "cluster-node-timeout", "60000"]),
            "OK"
        );
    }
    for account in [stalled, other] {
        admitted_again(app, account).await;
    }
    // The map of slots read (the first calls asked for it).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut stopped = Stopped::new(&cluster.nodes[0]);
    let since = Instant::now();
    let load = {
        let (app, stalled) = (app.clone(), stalled.to_owned());
        tokio::spawn(async move {
            while since.elapsed() < stall {
                for _ in 0..per_tick {
                    let (app, stalled) = (app.clone(), stalled.clone());
                    tokio::spawn(async move { request(&app, &stalled).await });
                }
                tokio::time::sleep(tick).await;
            }
        })
    };
    let mut refused = Vec::new();
    while since.elapsed() < stall {
        let started = Instant::now();
        let status = request(app, other).await;
        if status != StatusCode::OK || started.elapsed() > Duration::from_secs(1) {
            refused.push((
                since.elapsed(),
                status,
                started.elapsed(),
                store.in_flight(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    load.await.unwrap();
    stopped.resume();
    admitted_again(app, stalled).await;
    refused
}

/// With room for two calls, a stalled node's subject has one call sent,
/// which times out and is followed (holding its room); the next ones fail
/// at once, sending nothing: the node holds half the room, never all of
/// it, and the other nodes' subjects are served at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_node_holds_at_most_half_of_a_small_room() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let (store, app) = app_on(&cluster, 1);
    let [stalled, first, second] = cluster.subject_per_node("half-room");
    for account in [&stalled, &first, &second] {
        admitted_again(&app, account).await;
    }
    // The map of slots read (the first calls asked for it).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _stopped = Stopped::new(&cluster.nodes[0]);
    for _ in 0..3 {
        assert_eq!(
            request(&app, &stalled).await,
            StatusCode::SERVICE_UNAVAILABLE
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for account in [&first, &second] {
        let started = Instant::now();
        assert_eq!(request(&app, account).await, StatusCode::OK);
        assert!(
            started.elapsed() < Duration::from_millis(200),
            "served after {:?}",
            started.elapsed()
        );
    }
    assert_eq!(
        store.in_flight(),
        1,
        "one call of the stalled node followed"
    );
}

/// A node that stalled, with a call given up, and came back: once that
/// call ended, the node is as any other. Idle past the store's timeout,
/// then two requests at once on it (behind a proxy that passes an answer
/// every 50 ms): load on a healthy node, both served, neither failed at
/// once as if the node still stalled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_back_from_a_stall_is_not_taken_for_stalled_later() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let proxy = cluster.slow_proxy(0).await;
    let [node, other, _] = cluster.subject_per_node("back-from-stall");
    let (store, app) = app_on(&cluster, 2);
    for account in [&node, &other] {
        admitted_again(&app, account).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut stopped = Stopped::new(&cluster.nodes[0]);
    assert_eq!(request(&app, &node).await, StatusCode::SERVICE_UNAVAILABLE);
    stopped.resume();
    admitted_again(&app, &node).await;
    let since = Instant::now();
    while store.in_flight() > 0 {
        assert!(
            since.elapsed() < Duration::from_secs(5),
            "a call still followed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.slow(Duration::from_millis(50));
    // Idle past the store's timeout.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let both = tokio::join!(request(&app, &node), request(&app, &node));
    assert_eq!(both, (StatusCode::OK, StatusCode::OK));
}

/// A node slow under load (a proxy passing an answer every 250 ms) whose
/// callers went away from two calls, 20 ms apart: 400 ms after the first
/// was sent, the second is still on its way, and the node answered the
/// first 150 ms ago. It answers: a request then is load, waited for and
/// served, not failed at once as one to a node silent since the first
/// call given up was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_answers_is_not_silent_while_calls_given_up_are_on_their_way() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let proxy = cluster.slow_proxy(0).await;
    let [node, other, _] = cluster.subject_per_node("answering-node");
    let (_store, app) = app_on(&cluster, 2);
    for account in [&node, &other] {
        admitted_again(&app, account).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.slow(Duration::from_millis(250));
    let start = Instant::now();
    for _ in 0..2 {
        let gone = tokio::time::timeout(Duration::from_millis(20), request(&app, &node)).await;
        assert!(gone.is_err(), "the node answers in 250 ms");
    }
    tokio::time::sleep_until((start + Duration::from_millis(400)).into()).await;
    let started = Instant::now();
    assert_eq!(
        request(&app, &node).await,
        StatusCode::OK,
        "refused after {:?} while the node answers",
        started.elapsed()
    );
}

/// With room for four calls, four requests at once for the subject of a
/// node that has just stalled: all four come before any was given up on
/// (the node is not known silent yet). Two are sent, time out and are
/// followed, holding half the room; the other two wait for the node's
/// room and fail once it answered nothing for a budget, sending nothing.
/// A request of another node's subject then finds room: served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_on_a_node_that_just_stalled_leaves_the_other_nodes_room() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let (store, app) = app_with_room(&cluster, 1, 4);
    let [stalled, first, second] = cluster.subject_per_node("burst");
    for account in [&stalled, &first, &second] {
        admitted_again(&app, account).await;
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
    assert_eq!(statuses, vec![StatusCode::SERVICE_UNAVAILABLE; 4]);
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
    assert_eq!(store.in_flight(), 2, "half the room, followed");
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
    let proxy = cluster.slow_proxy(0).await;
    let (store, app) = app_on(&cluster, 2);
    let [busy, other, _] = cluster.subject_per_node("busy-node");
    for account in [&busy, &other] {
        admitted_again(&app, account).await;
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

/// With room for two calls, a node stalled for 12 s while its subject is
/// sent a request every 50 ms: it holds one place, and its calls past it
/// fail at once. Meanwhile the store reads the map of slots every 2 s, a
/// call that names no key: sent to any node, it may reach the stalled one
/// and hold the other place for 30 s, and the other nodes' subjects find
/// no room. Sent to the node that answered last, it holds none past its
/// answer: the other node's subject is served all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_map_reads_during_a_stall_leave_the_other_nodes_room() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let (store, app) = app_on(&cluster, 1);
    let [stalled, other, _] = cluster.subject_per_node("map-reads");
    let refused = stall_under_load(
        &cluster,
        (&store, &app),
        [&stalled, &other],
        (1, Duration::from_millis(50)),
        Duration::from_secs(12),
    )
    .await;
    assert!(
        refused.is_empty(),
        "the other node's subject refused or slow during the stall (since the stop, status, \
         wait, calls in flight in a room of 2): {refused:?}"
    );
}

/// A node stalled under sustained load on its subject (1 000 requests a
/// second), with the default room (4096: the node's half is 2048): once it
/// is known silent, its subject's calls fail at once, sending nothing.
/// Were they sent until its half is full, they would fill its sockets'
/// buffers; the kernel then fails those connections (after 3 s), and the
/// cluster client, repairing them, sends the node's next calls to another
/// node, reads the slots again on the `MOVED` it gets, and waits on the
/// stalled node while it does, holding up every node's calls: the other
/// nodes' subjects would be refused though their nodes answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_stalled_under_load_is_not_sent_what_fills_its_sockets() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let store = RedisStore::cluster_builder(vec![cluster.nodes[1].url()])
        .timeout(Duration::from_millis(100))
        .connect_timeout(Duration::from_millis(300))
        .build()
        .expect("a Redis Cluster store");
    let app = app_of(store.clone());
    let [stalled, other, _] = cluster.subject_per_node("loaded-stall");
    let refused = stall_under_load(
        &cluster,
        (&store, &app),
        [&stalled, &other],
        (10, Duration::from_millis(10)),
        Duration::from_secs(11),
    )
    .await;
    assert!(
        refused.is_empty(),
        "the other node's subject refused or slow during the stall (since the stop, status, \
         wait, calls in flight): {} of them, first {:?}",
        refused.len(),
        refused.first()
    );
}
