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
use tower_quota::{FromHeader, Namespace, Quota, QuotaPolicy, Subject};

use redis_support::{redis_available, RedisCluster, Stopped};

fn store(cluster: &RedisCluster) -> RedisStore {
    RedisStore::cluster_builder(cluster.urls())
        .wait_timeout(Duration::from_secs(2))
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2))
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
        if name == "a_first_use_counter_ends_at_its_deadline" {
            // Deadlines on the server's clock: no call at their very instant.
            assert!(matches!(verdict, Verdict::NotApplicable(_)), "{name}");
        } else {
            assert_eq!(verdict, Verdict::Passed, "{name}");
        }
    }

    // Subjects on every node, each with a daily and a rolling quota.
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store)
            .store_timeout(Some(Duration::from_secs(2)))
            .build()
            .layer(Quota::daily(3))
            .quota(Quota::rolling(10, Duration::from_secs(3600))),
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

/// An app with a daily quota of `limit` on a cluster reached through
/// `seeds`, with short budgets.
fn app_on(seeds: Vec<String>, limit: u64) -> Router {
    let store = RedisStore::cluster_builder(seeds)
        .timeout(Duration::from_millis(300))
        .connect_timeout(Duration::from_millis(300))
        .build()
        .expect("a Redis Cluster store");
    Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store)
            .store_timeout(Some(Duration::from_millis(500)))
            .build()
            .layer(Quota::daily(limit)),
    )
}

/// Requests for `accounts` from two callers without a pause, until `until`
/// has passed since `since`; their statuses.
fn traffic(
    app: &Router,
    accounts: &[String],
    since: Instant,
    until: Duration,
) -> Vec<tokio::task::JoinHandle<Vec<StatusCode>>> {
    (0..2)
        .map(|_| {
            let app = app.clone();
            let accounts = accounts.to_vec();
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                while since.elapsed() < until {
                    for account in &accounts {
                        statuses.push(request(&app, account).await.0);
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                statuses
            })
        })
        .collect()
}

/// Waits for `callers` and asserts that every request they made was
/// admitted.
async fn all_admitted(callers: Vec<tokio::task::JoinHandle<Vec<StatusCode>>>) {
    let mut statuses = Vec::new();
    for caller in callers {
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
}

/// Asserts that a request for `account` is refused for want of a store
/// (503), in time.
async fn refused_in_time(app: &Router, account: &str) {
    let started = Instant::now();
    let (status, _) = request(app, account).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        started.elapsed() < Duration::from_millis(800),
        "answered after {:?}",
        started.elapsed()
    );
}

/// Waits until a request for `account` is admitted again, for `within` at
/// most.
async fn admitted_again(app: &Router, account: &str, within: Duration) {
    let since = Instant::now();
    loop {
        let (status, _) = request(app, account).await;
        if status == StatusCode::OK {
            return;
        }
        assert!(
            since.elapsed() < within,
            "the node's subject is still refused: {status}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A cluster connection is complete (every master the cluster names answers
/// on it, what a replacement must be) only while every master answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_connection_is_complete_only_while_every_master_answers() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let seed = cluster.nodes[1].url();
    let within = Duration::from_secs(1);
    assert!(
        testing::redis_cluster_is_complete(seed.clone(), within).await,
        "a healthy cluster"
    );
    // Learned from the seed, the stopped master is named but not reached.
    let stopped = Stopped::new(&cluster.nodes[0]);
    assert!(
        !testing::redis_cluster_is_complete(seed.clone(), within).await,
        "a master stopped"
    );
    drop(stopped);
    assert!(
        testing::redis_cluster_is_complete(seed, within).await,
        "the master back"
    );
}

/// A node that stops answering (`SIGSTOP`) fails the subjects it holds, and
/// only them, under traffic and after lulls: the cluster's connection that
/// waited on it goes on serving the other nodes, and no replacement takes
/// its place while the node is stopped. Once the node answers again its subjects are served, and their
/// counters hold only the admitted requests: the charges it ran late were
/// given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_node_fails_only_the_subjects_it_holds() {
    const LIMIT: u64 = 1_000_000;
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    // One seed, not the node to stop: a new connection learns the other
    // nodes from it, and would lack the stopped one.
    let app = app_on(vec![cluster.nodes[1].url()], LIMIT);
    let [stalled, first, second] = cluster.subject_per_node("node-fault");
    let healthy = [first, second];
    for account in std::iter::once(&stalled).chain(&healthy) {
        assert_eq!(request(&app, account).await.0, StatusCode::OK);
    }

    let mut stopped = Stopped::new(&cluster.nodes[0]);
    // After lulls, with none of the node's subjects asking: the idle
    // connections are checked before they are used again, a check the
    // stopped node fails, but not in the callers' time.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        for account in &healthy {
            let started = Instant::now();
            assert_eq!(request(&app, account).await.0, StatusCode::OK);
            assert!(
                started.elapsed() < Duration::from_millis(200),
                "answered after {:?}",
                started.elapsed()
            );
        }
    }
    // Under traffic, with the node's subject asking too.
    let stall = Instant::now();
    let callers = traffic(&app, &healthy, stall, Duration::from_secs(4));
    while stall.elapsed() < Duration::from_millis(3_500) {
        refused_in_time(&app, &stalled).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    all_admitted(callers).await;

    stopped.resume();
    let resumed = Instant::now();
    admitted_again(&app, &stalled, Duration::from_secs(5)).await;
    // The charges the node ran late are given back: what it counts is the
    // two admitted requests and the ones below.
    let mut admitted = 2;
    loop {
        let (status, remaining) = request(&app, &stalled).await;
        assert_eq!(status, StatusCode::OK);
        admitted += 1;
        if remaining == Some(LIMIT - admitted) {
            break;
        }
        assert!(
            resumed.elapsed() < Duration::from_secs(10),
            "{admitted} admitted, and {remaining:?} left of {LIMIT}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for account in &healthy {
        assert_eq!(request(&app, account).await.0, StatusCode::OK);
    }
}

/// A node slow under load (behind a proxy that passes its answers on one
/// every 50 ms) answers every call, each after the one before: requests for
/// its subject sent 10 ms apart wait longer and longer (the tenth about
/// 400 ms), far past the store's 80 ms and the policy's 100 ms (both
/// defaults), while the node answers others all along. They are waited
/// for and served, as on a single server: load alone is no store error.
/// The other nodes' subjects are served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_behind_others_on_a_slow_node_are_served() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let proxy = cluster.slow_proxy(0).await;
    // One connection: the calls to the slow node queue on one socket.
    let store = RedisStore::cluster_builder(vec![cluster.nodes[1].url()])
        .pool_size(1)
        .build()
        .expect("a Redis Cluster store");
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store)
            .build()
            .layer(Quota::daily(1_000)),
    );
    let [slow, first, second] = cluster.subject_per_node("node-fault");
    // The first calls open the cluster's connection (which may take longer
    // than the store's 80 ms) and read which node serves each slot.
    for account in [&slow, &first, &second] {
        admitted_again(&app, account, Duration::from_secs(5)).await;
    }
    proxy.slow(Duration::from_millis(50));
    let since = Instant::now();
    let others = traffic(&app, &[first, second], since, Duration::from_millis(800));
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..10 {
        let (app, slow) = (app.clone(), slow.clone());
        calls.spawn(async move {
            let started = Instant::now();
            (request(&app, &slow).await.0, started.elapsed())
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let answers = calls.join_all().await;
    assert!(
        answers.iter().all(|(status, _)| *status == StatusCode::OK),
        "{answers:?}"
    );
    let slowest = answers.iter().map(|(_, waited)| *waited).max().unwrap();
    assert!(
        slowest > Duration::from_millis(200),
        "{slowest:?}: slow enough"
    );
    all_admitted(others).await;
}

/// With the store's room for two calls and eight calls to a node slow
/// under load (a proxy passing one answer every 50 ms), the slow node's
/// calls hold one place at most: past it, they wait for their node's
/// answers, longer than the store's 80 ms and the policy's 100 ms, and are
/// all admitted (load, not a failure). A request for another node's
/// subject meanwhile takes the other place, not queued behind them, and
/// its own node (which answers at once, 10 ms behind a proxy of its own) is
/// given the time to answer it. Through the policy at its defaults (its
/// `store_timeout` waits while any node answers), and with a long
/// `store_timeout` (the store's own wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_beside_a_slow_node_is_not_queued_behind_it_and_is_served_by_its_own_node() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let proxy = cluster.slow_proxy(0).await;
    let other_proxy = cluster.slow_proxy(1).await;
    other_proxy.slow(Duration::from_millis(10));
    let [slow, other, _] = cluster.subject_per_node("node-fault");
    for store_timeout in [None, Some(Duration::from_secs(2))] {
        proxy.slow(Duration::ZERO);
        let store = RedisStore::cluster_builder(vec![cluster.nodes[2].url()])
            .pool_size(1)
            .max_in_flight(2)
            .build()
            .expect("a Redis Cluster store");
        let mut policy =
            QuotaPolicy::builder(FromHeader::account("x-account-id")).store(store.clone());
        if store_timeout.is_some() {
            policy = policy.store_timeout(store_timeout);
        }
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(policy.build().layer(Quota::daily(1_000)));
        for account in [&slow, &other] {
            admitted_again(&app, account, Duration::from_secs(5)).await;
        }
        // The map of slots read (the first calls asked for it).
        tokio::time::sleep(Duration::from_millis(200)).await;
        proxy.slow(Duration::from_millis(50));
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let (app, slow) = (app.clone(), slow.clone());
            calls.spawn(async move { request(&app, &slow).await.0 });
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let started = Instant::now();
        let (status, _) = request(&app, &other).await;
        let waited = started.elapsed();
        let slow_statuses = calls.join_all().await;
        assert!(
            slow_statuses.iter().all(|status| *status == StatusCode::OK),
            "{store_timeout:?}: {slow_statuses:?}"
        );
        assert!(
            waited < Duration::from_millis(300),
            "{store_timeout:?}: {waited:?}: queued behind the slow node's calls"
        );
        assert_eq!(
            status,
            StatusCode::OK,
            "{store_timeout:?}: refused after {waited:?} while every node answered ({} calls \
             given back)",
            store.given_back()
        );
    }
}

/// A node that goes down and comes back (killed, restarted on its port)
/// fails the subjects it holds while it is down, and only them; they are
/// served again once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_fails_only_the_subjects_it_holds() {
    if !redis_available() {
        return;
    }
    let mut cluster = RedisCluster::start();
    let app = app_on(cluster.urls(), 1_000_000);
    let [restarted, first, second] = cluster.subject_per_node("node-fault");
    let healthy = [first, second];
    for account in std::iter::once(&restarted).chain(&healthy) {
        assert_eq!(request(&app, account).await.0, StatusCode::OK);
    }

    cluster.nodes[0].kill();
    let down = Instant::now();
    let callers = traffic(&app, &healthy, down, Duration::from_secs(4));
    while down.elapsed() < Duration::from_millis(1_500) {
        refused_in_time(&app, &restarted).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cluster.nodes[0].restart();
    admitted_again(&app, &restarted, Duration::from_secs(5)).await;
    all_admitted(callers).await;
    for account in &healthy {
        assert_eq!(request(&app, account).await.0, StatusCode::OK);
    }
}

/// A node that lost the script (restarted, flushed) is sent it with the
/// charge that needs it, while another node does not answer: only the
/// node that holds the subject is asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_lost_the_script_gets_it_while_another_is_stalled() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let app = app_on(vec![cluster.nodes[1].url()], 1_000);
    let [stalled, _, flushed] = cluster.subject_per_node("node-fault");
    for account in [&stalled, &flushed] {
        assert_eq!(request(&app, account).await.0, StatusCode::OK);
    }
    let _stopped = Stopped::new(&cluster.nodes[0]);
    assert_eq!(cluster.nodes[2].cli(&["script", "flush"]), "OK");
    let started = Instant::now();
    assert_eq!(request(&app, &flushed).await.0, StatusCode::OK);
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "answered after {:?}",
        started.elapsed()
    );
}

/// `CLUSTER MYID` of `node`.
fn id_of(node: &redis_support::RedisServer) -> String {
    node.cli(&["cluster", "myid"])
}

/// Moves `keys` from `from` to `to` (both in loopback), as
/// `redis-cli --cluster reshard` does, their counts and deadlines with them.
fn migrate(from: &redis_support::RedisServer, to: &redis_support::RedisServer, keys: &[&str]) {
    let port = to.port().to_string();
    let mut args = vec![
        "migrate",
        "127.0.0.1",
        port.as_str(),
        "",
        "0",
        "5000",
        "keys",
    ];
    args.extend_from_slice(keys);
    assert_eq!(from.cli(&args), "OK", "MIGRATE of {keys:?}");
}

/// A slot moved to another node while its subject is charged (a
/// resharding): every request is served and counted once. While the slot
/// migrates, its node answers `ASK` for the keys already moved and
/// `TRYAGAIN` for a charge whose keys are on both nodes; once it moved,
/// `MOVED`. None of them ran the charge, which is sent where it is told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_is_charged_exactly_while_its_slot_moves() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    charged_exactly_while_its_slot_moves(&cluster, 1).await;
}

/// As above, to a master added to the cluster for it (a scale-out), which
/// the cluster's connection does not reach until it serves a slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_is_charged_exactly_while_its_slot_moves_to_a_new_master() {
    if !redis_available() {
        return;
    }
    let mut cluster = RedisCluster::start();
    let added = cluster.add_master();
    charged_exactly_while_its_slot_moves(&cluster, added).await;
}

/// Moves the slot of a subject of node 0 to node `to` while it is charged.
async fn charged_exactly_while_its_slot_moves(cluster: &RedisCluster, to: usize) {
    const LIMIT: u64 = 20;

    let store = RedisStore::cluster_builder(vec![cluster.nodes[2].url()])
        .timeout(Duration::from_millis(1_500))
        .connect_timeout(Duration::from_millis(300))
        .build()
        .expect("a Redis Cluster store");
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .store_timeout(Some(Duration::from_secs(2)))
        .build();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        policy
            .layer(Quota::daily(LIMIT))
            .quota(Quota::monthly(LIMIT)),
    );
    let [account, _, _] = cluster.subject_per_node("node-fault");
    let (source, target) = (&cluster.nodes[0], &cluster.nodes[to]);
    let left = std::cell::Cell::new(LIMIT);
    let served = |(status, remaining): (StatusCode, Option<u64>), step: &str| {
        assert_eq!(status, StatusCode::OK, "{step}");
        left.set(left.get() - 1);
        assert_eq!(remaining, Some(left.get()), "{step}");
    };
    served(request(&app, &account).await, "before the move");

    let keys_on = |node: &redis_support::RedisServer, slot: &str| {
        let keys = node.cli(&["cluster", "getkeysinslot", slot, "10"]);
        keys.lines().map(str::to_owned).collect::<Vec<_>>()
    };
    // Every counter of the subject is in its slot, whatever the period.
    let key = Namespace::default().key(&Subject::account(account.as_str()), "read", "any");
    let slot = source.cli(&["cluster", "keyslot", key.as_str()]);
    let keys = keys_on(source, &slot);
    assert_eq!(keys.len(), 2, "one counter per quota: {keys:?}");
    let ttls: Vec<String> = keys.iter().map(|k| source.cli(&["pttl", k])).collect();

    assert_eq!(
        target.cli(&["cluster", "setslot", &slot, "importing", &id_of(source)]),
        "OK"
    );
    assert_eq!(
        source.cli(&["cluster", "setslot", &slot, "migrating", &id_of(target)]),
        "OK"
    );
    served(request(&app, &account).await, "migrating, no key moved");

    // One key moved: the source answers TRYAGAIN until the other follows.
    migrate(source, target, &[keys[0].as_str()]);
    let pending = tokio::spawn({
        let app = app.clone();
        let account = account.clone();
        async move { request(&app, &account).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    migrate(source, target, &[keys[1].as_str()]);
    served(pending.await.unwrap(), "keys on both nodes, then moved");
    // Every key moved: the source answers ASK, every time, and nothing
    // connects anew for it (but the one connection to the target the
    // first `ASK` opened).
    let connections = || -> u64 {
        cluster
            .nodes
            .iter()
            .map(|node| {
                node.cli(&["info", "stats"])
                    .lines()
                    .find_map(|l| l.strip_prefix("total_connections_received:"))
                    .and_then(|n| n.trim().parse::<u64>().ok())
                    .expect("a count of connections")
            })
            .sum()
    };
    served(request(&app, &account).await, "every key moved");
    let before = connections();
    for _ in 0..5 {
        served(request(&app, &account).await, "every key moved, again");
    }
    // Each `cli` call above connects once per node.
    let cli_calls = cluster.nodes.len() as u64;
    assert!(
        connections() - before <= cli_calls,
        "charges redirected by ASK connected anew: {} connections",
        connections() - before - cli_calls
    );
    // A support reset is redirected too: the counters are deleted where
    // they are now, and the allowance starts again.
    let subject = Subject::account(account.as_str());
    let quotas = policy
        .handle()
        .reset_allowance(&subject, "default")
        .await
        .expect("a reset while the slot moves");
    assert_eq!(quotas, 2);
    assert_eq!(target.cli(&["cluster", "countkeysinslot", &slot]), "0");
    // (Redis refuses a call that would create keys of a moving slot on
    // the importing node, as `TRYAGAIN`, until the move ends.)
    left.set(LIMIT);

    for node in &cluster.nodes {
        assert_eq!(
            node.cli(&["cluster", "setslot", &slot, "node", &id_of(target)]),
            "OK"
        );
    }
    // The source answers MOVED, once: the slots are read again.
    served(request(&app, &account).await, "moved");
    served(request(&app, &account).await, "after the move");

    assert_eq!(source.cli(&["cluster", "countkeysinslot", &slot]), "0");
    for (key, before) in keys.iter().zip(&ttls) {
        let after: i64 = target.cli(&["pttl", key]).parse().unwrap();
        let before: i64 = before.parse().unwrap();
        assert!(
            after <= before && after > before - 60_000,
            "{key}'s deadline moved: {before} ms left before, {after} after"
        );
    }
    while left.get() > 0 {
        served(request(&app, &account).await, "up to the limit");
    }
    assert_eq!(
        request(&app, &account).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// A charge node 0 applied after its caller stopped waiting (its answer,
/// alone, held up 1.5 s on its way back), whose slot moved to node 1 meanwhile (a
/// resharding): node 0, a master still, answers the give-back with
/// `MOVED`, which the give-back follows to node 1, where the counter went.
/// The count then says what was served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_charge_whose_slot_moved_is_given_back_where_the_slot_went() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let proxy = cluster.slow_proxy(0).await;
    let [account, _, _] = cluster.subject_per_node("late-moved");
    let app = app_on(cluster.urls(), 100);
    for _ in 0..3 {
        assert_eq!(request(&app, &account).await.0, StatusCode::OK);
    }
    let (source, target) = (&cluster.nodes[0], &cluster.nodes[1]);
    let key = Namespace::default().key(&Subject::account(account.as_str()), "read", "any");
    let slot = source.cli(&["cluster", "keyslot", key.as_str()]);
    let counter = source.cli(&["cluster", "getkeysinslot", &slot, "10"]);
    assert_eq!(counter.lines().count(), 1, "one counter: {counter}");

    proxy.slow(Duration::from_millis(1_500));
    assert_eq!(
        request(&app, &account).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(source.cli(&["hget", &counter, "n"]), "4", "applied, late");
    // The answers after that one come at once.
    proxy.slow(Duration::ZERO);
    assert_eq!(
        target.cli(&["cluster", "setslot", &slot, "importing", &id_of(source)]),
        "OK"
    );
    assert_eq!(
        source.cli(&["cluster", "setslot", &slot, "migrating", &id_of(target)]),
        "OK"
    );
    migrate(source, target, &[counter.as_str()]);
    for node in &cluster.nodes {
        assert_eq!(
            node.cli(&["cluster", "setslot", &slot, "node", &id_of(target)]),
            "OK"
        );
    }
    let since = Instant::now();
    while target.cli(&["hget", &counter, "n"]) != "3" {
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "the late charge not given back where its counter went: {} counted for 3 served",
            target.cli(&["hget", &counter, "n"])
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A node that answers every call in 50 ms, idle for a while (its last
/// answer is older than the store's timeout), is not silent: a request
/// whose caller went away after its call was sent, and a second request
/// beside it, are two calls of load on a healthy node. The second waits for
/// room (the first's answer comes 50 ms after its send) and is served; it
/// is not failed at once as if the node had stalled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_healthy_node_with_a_call_given_up_is_not_silent() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    let proxy = cluster.slow_proxy(0).await;
    let [slow, other, _] = cluster.subject_per_node("idle-node");
    let store = RedisStore::cluster_builder(vec![cluster.nodes[2].url()])
        .timeout(Duration::from_millis(300))
        .connect_timeout(Duration::from_millis(300))
        .max_in_flight(2)
        .build()
        .expect("a Redis Cluster store");
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store.clone())
        .store_timeout(Some(Duration::from_secs(2)))
        .build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(policy.layer(Quota::daily(1_000)));
    for account in [&slow, &other] {
        admitted_again(&app, account, Duration::from_secs(5)).await;
    }
    // The map of slots read; then the node stays idle past the timeout.
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.slow(Duration::from_millis(50));
    let (status, _) = request(&app, &slow).await;
    assert_eq!(status, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(500)).await;
    // A client that goes away 10 ms after its request's call was sent.
    let gone = tokio::time::timeout(Duration::from_millis(10), request(&app, &slow)).await;
    assert!(gone.is_err(), "the node answers in 50 ms");
    let started = Instant::now();
    let (status, _) = request(&app, &slow).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "refused after {:?} while the node answers every call in 50 ms",
        started.elapsed()
    );
}
