//! The Redis store on a real three-node Redis Cluster on loopback.

#![cfg(all(feature = "redis-cluster", feature = "testing"))]

mod redis_support;

use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_quota::store::RedisStore;
use tower_quota::testing::{self, Verdict};
use tower_quota::{FromHeader, Namespace, Quota, QuotaLayer, Subject};

use redis_support::{redis_available, RedisCluster};

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
