//! The Redis store on a real three-node Redis Cluster on loopback.

#![cfg(all(feature = "redis-cluster", feature = "testing"))]

mod redis_support;

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_quota::store::RedisStore;
use tower_quota::testing::{self, Verdict};
use tower_quota::{FromHeader, Namespace, Quota, QuotaLayer, Subject};

use redis_support::{redis_available, RedisCluster, Stopped};

fn store(cluster: &RedisCluster) -> RedisStore {
    RedisStore::cluster_builder(cluster.urls())
        .wait_timeout(Duration::from_secs(2))
        .connect_timeout(Duration::from_secs(2))
        .response_timeout(Duration::from_secs(2))
        .build()
        .expect("a Redis Cluster store")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_keeps_every_rule_on_a_cluster() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let store = store(&cluster);

    // The keys of one subject share a slot; different subjects spread.
    let namespace = Namespace::default();
    let slot = |key: String| cluster.nodes[0].cli(&["cluster", "keyslot", &key]);
    let acme = Subject::account("acme");
    let read = slot(namespace.key(&acme, "read", "2026-12-02").into_string());
    assert_eq!(
        read,
        slot(namespace.key(&acme, "write", "PT24H").into_string())
    );
    let slots: std::collections::HashSet<String> = (0..20)
        .map(|i| {
            slot(
                namespace
                    .key(&Subject::account(format!("s{i}")), "read", "2026-12-02")
                    .into_string(),
            )
        })
        .collect();
    assert!(slots.len() > 10, "subjects spread over slots: {slots:?}");

    for (name, verdict) in testing::run_all(&store).await {
        assert_eq!(verdict, Verdict::Passed, "{name}");
    }

    // Subjects on every node, each with a daily and a rolling quota.
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaLayer::new(FromHeader::account("x-account-id"))
            .quota(Quota::daily(3))
            .quota(Quota::rolling(10, Duration::from_secs(3600)))
            .store(store)
            .store_timeout(Some(Duration::from_secs(2))),
    );
    for subject in 0..12 {
        let statuses: Vec<StatusCode> = statuses_of(&app, &format!("cluster-{subject}"), 5).await;
        assert_eq!(
            statuses.iter().filter(|s| **s == StatusCode::OK).count(),
            3,
            "subject {subject}: {statuses:?}"
        );
    }
    let keys: usize = cluster
        .nodes
        .iter()
        .filter(|n| n.cli(&["dbsize"]).parse::<usize>().unwrap() > 0)
        .count();
    assert_eq!(keys, 3, "counters live on every node");
}

async fn statuses_of(app: &Router, account: &str, n: usize) -> Vec<StatusCode> {
    let mut statuses = Vec::new();
    for _ in 0..n {
        let request = Request::get("/")
            .header("x-account-id", account)
            .body(Body::empty())
            .unwrap();
        statuses.push(app.clone().oneshot(request).await.unwrap().status());
    }
    statuses
}

/// Which node of `cluster` serves `key`'s slot.
fn node_of(cluster: &RedisCluster, key: &str) -> usize {
    let slot: u16 = cluster.nodes[0]
        .cli(&["cluster", "keyslot", key])
        .parse()
        .expect("a slot");
    let owner = cluster.nodes[0]
        .cli(&["cluster", "nodes"])
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let serves = fields.get(8..)?.iter().any(|range| {
                let (low, high) = range.split_once('-').unwrap_or((range, range));
                match (low.parse::<u16>(), high.parse::<u16>()) {
                    (Ok(low), Ok(high)) => (low..=high).contains(&slot),
                    _ => false,
                }
            });
            serves.then(|| fields[0].to_owned())
        })
        .expect("a node serves every slot");
    cluster
        .nodes
        .iter()
        .position(|node| node.cli(&["cluster", "myid"]) == owner)
        .expect("the slot's node is one of the cluster's")
}

/// One request for `account`: its status and what its `RateLimit` field
/// says remains.
async fn request(app: &Router, account: &str) -> (StatusCode, Option<u64>) {
    let request = Request::get("/")
        .header("x-account-id", account)
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let remaining = response
        .headers()
        .get("ratelimit")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(";r=").nth(1))
        .and_then(|rest| rest.split(';').next())
        .and_then(|digits| digits.parse().ok());
    (response.status(), remaining)
}

/// A node that stops answering (`SIGSTOP`) fails the subjects it holds, and
/// only them. The cluster's connection that waited on it is replaced, but
/// the other nodes' subjects never wait for the replacement, which cannot
/// open while the node is stopped. Once the node answers again its
/// subjects are served, and their counters hold only the admitted
/// requests: the charges it ran late were given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_node_fails_only_the_subjects_it_holds() {
    const LIMIT: u64 = 1_000_000;
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let store = RedisStore::cluster_builder(cluster.urls())
        .timeout(Duration::from_millis(300))
        .connect_timeout(Duration::from_millis(300))
        .build()
        .expect("a Redis Cluster store");
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaLayer::new(FromHeader::account("x-account-id"))
            .quota(Quota::daily(LIMIT))
            .store(store)
            .store_timeout(Some(Duration::from_millis(500))),
    );

    // One subject on the node to stop, one on each of the others.
    let namespace = Namespace::default();
    let mut on: [Option<String>; 3] = Default::default();
    for i in 0.. {
        let account = format!("node-fault-{i}");
        // The slot is the subject's alone, whatever the allowance and period.
        let key = namespace.key(&Subject::account(account.as_str()), "read", "any");
        on[node_of(&cluster, key.as_str())].get_or_insert(account);
        if on.iter().all(Option::is_some) {
            break;
        }
    }
    let [Some(stalled), Some(first), Some(second)] = on else {
        unreachable!("every node has a subject")
    };
    let healthy = [first, second];
    let mut admitted_stalled = 0;
    for account in std::iter::once(&stalled).chain(&healthy) {
        assert_eq!(request(&app, account).await.0, StatusCode::OK);
    }
    admitted_stalled += 1;

    let mut stopped = Stopped::new(&cluster.nodes[0]);
    let stall = Instant::now();
    // The other nodes' subjects, from two callers without a pause, for the
    // whole stall.
    let traffic: Vec<_> = (0..2)
        .map(|_| {
            let app = app.clone();
            let healthy = healthy.clone();
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                while stall.elapsed() < Duration::from_secs(4) {
                    for account in &healthy {
                        statuses.push(request(&app, account).await.0);
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                statuses
            })
        })
        .collect();
    // The stopped node's subject: refused for want of a store, in time.
    while stall.elapsed() < Duration::from_millis(3_500) {
        let started = Instant::now();
        let (status, _) = request(&app, &stalled).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            started.elapsed() < Duration::from_millis(800),
            "answered after {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut statuses = Vec::new();
    for caller in traffic {
        statuses.extend(caller.await.unwrap());
    }
    let failed: Vec<_> = statuses.iter().filter(|s| **s != StatusCode::OK).collect();
    assert!(statuses.len() > 100, "{} requests", statuses.len());
    assert!(
        failed.is_empty(),
        "{} of {} requests of the other nodes' subjects failed: {failed:?}",
        failed.len(),
        statuses.len()
    );

    stopped.resume();
    // Served again once the node answers...
    let resumed = Instant::now();
    loop {
        let (status, _) = request(&app, &stalled).await;
        if status == StatusCode::OK {
            admitted_stalled += 1;
            break;
        }
        assert!(
            resumed.elapsed() < Duration::from_secs(5),
            "the node's subject is still refused: {status}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // ...and the charges it ran late are given back.
    loop {
        let (status, remaining) = request(&app, &stalled).await;
        assert_eq!(status, StatusCode::OK);
        admitted_stalled += 1;
        if remaining == Some(LIMIT - admitted_stalled) {
            break;
        }
        assert!(
            resumed.elapsed() < Duration::from_secs(10),
            "{admitted_stalled} admitted, and {remaining:?} left of {LIMIT}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for account in &healthy {
        assert_eq!(request(&app, account).await.0, StatusCode::OK);
    }
}
