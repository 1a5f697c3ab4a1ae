//! A Redis Cluster with replicas (three masters, three replicas) through a
//! failover, under open-loop HTTP load, failing closed: a graceful one
//! (`CLUSTER FAILOVER` sent to a replica), and one of a master killed (its
//! replica promoted once the cluster votes it failed); every subject's
//! counter, read from its master after the failover, against what it was
//! served, and the 503s, when and on which master's subjects (run with
//! `--nocapture` for the figures). Then a master that hangs past the node
//! timeout: its subjects served by its replica once promoted, and what
//! it ran late, once back, given back to no one. And a leased store shut
//! down while a killed master's replica takes over.

#![cfg(all(feature = "redis-cluster", feature = "testing"))]

mod redis_support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_quota::jiff::Timestamp;
use tower_quota::store::RedisStore;
use tower_quota::{
    FromHeader, LeasedStore, ManualClock, Namespace, Quota, QuotaPolicy, Store, Subject,
};

use redis_support::{redis_available, ReplicatedCluster};

/// Routes and their daily limits: reached early, reached late, never.
const GROUPS: [(&str, u64); 3] = [("a", 15), ("b", 45), ("c", 1_000_000)];
const SUBJECTS: usize = 60;
/// Three requests every 10 ms: 300 a second, open loop.
const PER_TICK: usize = 3;
const TICK: Duration = Duration::from_millis(10);

fn quota(group: usize) -> Quota {
    let (name, limit) = GROUPS[group];
    Quota::daily(limit).allowance(name)
}

#[derive(Clone)]
struct Account {
    name: String,
    group: usize,
    key: String,
    /// Its master before the failover.
    master: usize,
}

#[derive(Clone, Copy, Debug)]
struct Outcome {
    subject: usize,
    /// Since the load began.
    sent: Duration,
    took: Duration,
    status: StatusCode,
}

/// The app on `store`, failing closed (the default) when it fails.
fn app<St: Store>(store: St, clock: &ManualClock) -> (QuotaPolicy<FromHeader, St>, Router) {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .clock(clock.clone())
        .build();
    let mut app = Router::new();
    for (group, (name, _)) in GROUPS.iter().enumerate() {
        app = app.merge(
            Router::new()
                .route(&format!("/{name}"), get(|| async { "ok" }))
                .route_layer(policy.layer(quota(group))),
        );
    }
    (policy, app)
}

async fn request(app: &Router, account: &Account) -> StatusCode {
    let request = Request::get(format!("/{}", GROUPS[account.group].0))
        .header("x-account-id", &account.name)
        .body(Body::empty())
        .unwrap();
    app.clone().oneshot(request).await.unwrap().status()
}

struct Rig {
    cluster: ReplicatedCluster,
    accounts: Arc<Vec<Account>>,
    clock: ManualClock,
    store: RedisStore,
}

fn rig(node_timeout_ms: u32, prefix: &str) -> Rig {
    let cluster = ReplicatedCluster::start(node_timeout_ms);
    let now = Timestamp::now().as_second();
    // Noon of today, UTC: the day's window holds the whole test.
    let at = Timestamp::from_second(now - now.rem_euclid(86_400) + 43_200).unwrap();
    let clock = ManualClock::new(at);
    let accounts: Vec<Account> = (0..SUBJECTS)
        .map(|i| {
            let name = format!("{prefix}-{i}");
            let group = i % GROUPS.len();
            let key = quota(group).key(&Namespace::default(), &Subject::account(name.as_str()), at);
            let master = cluster.master_of(key.as_str());
            Account {
                name,
                group,
                key: key.as_str().to_owned(),
                master,
            }
        })
        .collect();
    // Every node as a seed (the stopped one too).
    let seeds: Vec<String> = cluster.nodes.iter().map(|n| n.url()).collect();
    let store = RedisStore::cluster_builder(seeds)
        .build()
        .expect("a Redis Cluster store");
    Rig {
        cluster,
        accounts: Arc::new(accounts),
        clock,
        store,
    }
}

/// Sends `PER_TICK` requests every `TICK` for `run`, whatever the answers
/// (open loop), round the subjects; every outcome, once all are answered.
fn load(
    app: Router,
    accounts: Arc<Vec<Account>>,
    run: Duration,
) -> tokio::task::JoinHandle<Vec<Outcome>> {
    tokio::spawn(async move {
        let start = Instant::now();
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let mut sent = Vec::new();
        let mut ticks = tokio::time::interval(TICK);
        let mut next = 0usize;
        while start.elapsed() < run {
            ticks.tick().await;
            for _ in 0..PER_TICK {
                let subject = next % accounts.len();
                next += 1;
                let (app, accounts, outcomes) =
                    (app.clone(), Arc::clone(&accounts), Arc::clone(&outcomes));
                sent.push(tokio::spawn(async move {
                    let at = Instant::now();
                    let status = request(&app, &accounts[subject]).await;
                    outcomes.lock().unwrap().push(Outcome {
                        subject,
                        sent: at - start,
                        took: at.elapsed(),
                        status,
                    });
                }));
            }
        }
        for request in sent {
            request.await.unwrap();
        }
        let outcomes = outcomes.lock().unwrap().clone();
        outcomes
    })
}

/// Polls `done` every 10 ms (in a blocking task) until it holds, `within`
/// at most; how long it took.
async fn until(within: Duration, done: impl Fn() -> bool + Send + 'static) -> Duration {
    let start = Instant::now();
    tokio::task::spawn_blocking(move || {
        while !done() {
            assert!(start.elapsed() < within, "not within {within:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    })
    .await
    .unwrap();
    start.elapsed()
}

struct Figures {
    /// Per subject: 200s, 429s, 503s, others.
    per_subject: Vec<[u64; 4]>,
    outcomes: Vec<Outcome>,
}

fn figures(outcomes: Vec<Outcome>) -> Figures {
    let mut per_subject = vec![[0u64; 4]; SUBJECTS];
    for o in &outcomes {
        let slot = match o.status {
            StatusCode::OK => 0,
            StatusCode::TOO_MANY_REQUESTS => 1,
            StatusCode::SERVICE_UNAVAILABLE => 2,
            _ => 3,
        };
        per_subject[o.subject][slot] += 1;
    }
    Figures {
        per_subject,
        outcomes,
    }
}

/// Prints the 503s of the subjects of each master: how many, the first and
/// the last sent (from the load's start), the longest wait of any request.
fn print_refusals(label: &str, rig: &Rig, f: &Figures, event_at: Duration) {
    let total = f.outcomes.len();
    println!("[{label}] {total} requests; event at {event_at:?}");
    let mut masters: Vec<usize> = rig.accounts.iter().map(|a| a.master).collect();
    masters.sort();
    masters.dedup();
    for master in masters {
        let mine: Vec<&Outcome> = f
            .outcomes
            .iter()
            .filter(|o| rig.accounts[o.subject].master == master)
            .collect();
        let refused: Vec<&&Outcome> = mine
            .iter()
            .filter(|o| o.status == StatusCode::SERVICE_UNAVAILABLE)
            .collect();
        let other: usize = mine
            .iter()
            .filter(|o| {
                ![
                    StatusCode::OK,
                    StatusCode::TOO_MANY_REQUESTS,
                    StatusCode::SERVICE_UNAVAILABLE,
                ]
                .contains(&o.status)
            })
            .count();
        let slowest = mine.iter().map(|o| o.took).max().unwrap_or_default();
        let first = refused.iter().map(|o| o.sent).min();
        let last = refused.iter().map(|o| o.sent).max();
        println!(
            "[{label}]   master {master}: {} requests, {} 503 (first sent {:?}, last sent {:?}), {other} other, slowest {slowest:?}",
            mine.len(),
            refused.len(),
            first,
            last
        );
    }
}

/// The 503s of the subjects of masters other than `master`.
fn refused_beside(rig: &Rig, f: &Figures, master: usize) -> usize {
    f.outcomes
        .iter()
        .filter(|o| {
            o.status == StatusCode::SERVICE_UNAVAILABLE && rig.accounts[o.subject].master != master
        })
        .count()
}

/// Every subject's counter, read from its master now, against its 200s;
/// prints the differences; returns (subject, counted, admitted) of those
/// that differ.
async fn counted_vs_admitted(label: &str, rig: &Rig, f: &Figures) -> Vec<(String, u64, u64)> {
    let deadline = Instant::now() + Duration::from_secs(40);
    while rig.store.in_flight() > 0 {
        assert!(Instant::now() < deadline, "calls still in flight");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut differ = Vec::new();
    let mut over = Vec::new();
    let (mut counted_total, mut admitted_total) = (0, 0);
    for (i, account) in rig.accounts.iter().enumerate() {
        let counted: u64 = rig.cluster.hget(&account.key, "n").parse().unwrap_or(0);
        let admitted = f.per_subject[i][0];
        counted_total += counted;
        admitted_total += admitted;
        if counted != admitted {
            differ.push((account.name.clone(), counted, admitted));
        }
        if admitted > GROUPS[account.group].1 {
            over.push((account.name.clone(), admitted));
        }
    }
    println!(
        "[{label}] counted {counted_total}, admitted {admitted_total}; {} subjects differ: {differ:?}; over the limit: {over:?}; given back {}",
        differ.len(),
        rig.store.given_back()
    );
    differ
}

/// After the load: every subject is answered (200 or 429, not 503) within
/// 5 s; those answers join the outcomes.
async fn everyone_served_again(app: &Router, rig: &Rig, outcomes: &mut Vec<Outcome>) {
    for (subject, account) in rig.accounts.iter().enumerate() {
        let start = Instant::now();
        loop {
            let status = request(app, account).await;
            outcomes.push(Outcome {
                subject,
                sent: Duration::MAX,
                took: Duration::ZERO,
                status,
            });
            if status != StatusCode::SERVICE_UNAVAILABLE {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "{} still refused",
                account.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A rig under load, 2 s into it.
struct Loaded {
    rig: Rig,
    policy: QuotaPolicy<FromHeader, RedisStore>,
    app: Router,
    /// Subject 0's master, and its replica.
    master: usize,
    replica: usize,
    /// The load, sent for its run from `start`.
    load: tokio::task::JoinHandle<Vec<Outcome>>,
    start: Instant,
    /// When the load had run 2 s, since `start`.
    event_at: Duration,
}

/// A rig of `node_timeout_ms` named `label`, its app under load for `run`,
/// 2 s into it.
async fn loaded(label: &str, node_timeout_ms: u32, run: Duration) -> Loaded {
    let rig = rig(node_timeout_ms, label);
    let (policy, app) = app(rig.store.clone(), &rig.clock);
    let master = rig.accounts[0].master;
    let replica = rig.cluster.replica_of(master);
    let load = load(app.clone(), Arc::clone(&rig.accounts), run);
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let event_at = start.elapsed();
    Loaded {
        rig,
        policy,
        app,
        master,
        replica,
        load,
        start,
        event_at,
    }
}

/// Waits until node `replica` of `rig` says it is a master, `within` at
/// most; how long it took.
async fn promoted(rig: &Rig, replica: usize, within: Duration) -> Duration {
    let port = rig.cluster.nodes[replica].port();
    until(within, move || {
        redis_support::cli(port, &["role"]).lines().next() == Some("master")
    })
    .await
}

/// Graceful failover of the master of subject 0 while 300 requests a
/// second run: the other masters' subjects never refused; every subject
/// counted exactly as admitted, none past its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_graceful_failover_counts_every_admission_exactly() {
    if !redis_available() {
        return;
    }
    let label = "graceful";
    let Loaded {
        rig,
        policy,
        app,
        master,
        replica,
        load,
        event_at,
        ..
    } = loaded(label, 5_000, Duration::from_secs(6)).await;
    assert_eq!(
        rig.cluster.nodes[replica].cli(&["cluster", "failover"]),
        "OK"
    );
    let took = promoted(&rig, replica, Duration::from_secs(10)).await;
    println!(
        "[{label}] replica {replica} of master {master} promoted {took:?} after CLUSTER FAILOVER"
    );
    let mut outcomes = load.await.unwrap();
    everyone_served_again(&app, &rig, &mut outcomes).await;
    let owed = policy.settle_owed(Duration::from_secs(10)).await;
    assert_eq!(owed.units, 0, "everything owed settled");
    let f = figures(outcomes);
    print_refusals(label, &rig, &f, event_at);
    let differ = counted_vs_admitted(label, &rig, &f).await;
    assert_eq!(
        refused_beside(&rig, &f, master),
        0,
        "other masters' subjects refused"
    );
    for (i, account) in rig.accounts.iter().enumerate() {
        assert!(
            f.per_subject[i][0] <= GROUPS[account.group].1,
            "{} admitted past its limit",
            account.name
        );
    }
    assert!(differ.is_empty(), "counted != admitted: {differ:?}");
}

/// The master of subject 0 killed under load (node timeout 2 s): its
/// replica is promoted; the killed master's subjects served again within
/// a few seconds of the promotion, none refused 5 s past it; everything
/// owed settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_master_fails_over_and_its_subjects_are_served_again() {
    if !redis_available() {
        return;
    }
    let label = "killed";
    let Loaded {
        mut rig,
        policy,
        app,
        master,
        replica,
        load,
        start,
        event_at,
    } = loaded(label, 2_000, Duration::from_secs(11)).await;
    rig.cluster.nodes[master].kill();
    let took = promoted(&rig, replica, Duration::from_secs(20)).await;
    let promoted_at = start.elapsed();
    let ok = until(Duration::from_secs(20), {
        let ports: Vec<u16> = rig
            .cluster
            .nodes
            .iter()
            .filter(|n| n.pid().is_some())
            .map(|n| n.port())
            .collect();
        move || {
            ports
                .iter()
                .all(|p| redis_support::cli(*p, &["cluster", "info"]).contains("cluster_state:ok"))
        }
    })
    .await;
    println!(
        "[{label}] master {master} killed at {event_at:?}; replica {replica} promoted {took:?} later (at {promoted_at:?}); cluster ok everywhere {ok:?} after that"
    );
    let mut outcomes = load.await.unwrap();
    // The requests of the killed master's subjects after the promotion
    // (plus 5 s): not one 503.
    let late: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| {
            o.status == StatusCode::SERVICE_UNAVAILABLE
                && o.sent > promoted_at + Duration::from_secs(5)
        })
        .collect();
    let last_refused = outcomes
        .iter()
        .filter(|o| o.status == StatusCode::SERVICE_UNAVAILABLE)
        .map(|o| o.sent)
        .max();
    println!(
        "[{label}] last 503 sent at {last_refused:?} ({:?} after the promotion); {} 503s sent 5 s after the promotion or later",
        last_refused.map(|l| l.saturating_sub(promoted_at)),
        late.len()
    );
    let late = late.len();
    everyone_served_again(&app, &rig, &mut outcomes).await;
    let owed = policy.settle_owed(Duration::from_secs(10)).await;
    let f = figures(outcomes);
    print_refusals(label, &rig, &f, event_at);
    let _differ = counted_vs_admitted(label, &rig, &f).await;
    println!("[{label}] still owed after settling: {owed:?}");
    // Between the vote that the master failed and the promotion, every
    // node answers CLUSTERDOWN: the other masters' subjects too.
    let beside = refused_beside(&rig, &f, master);
    println!("[{label}] 503s of the other masters' subjects: {beside}");
    assert_eq!(late, 0, "503s 5 s after the promotion");
    assert_eq!(owed.units, 0, "everything owed settled");
}

/// A master of `rig` stopped (SIGSTOP) past the node timeout with a charge
/// of each of its limit-15 subjects sent to it (fail closed: 503s, their
/// callers stopped waiting), after 5 admissions each; returns once its
/// replica is promoted: the master's subjects, their admissions, the
/// stopped master, the app.
async fn hung_master_failed_over(
    rig: &Rig,
) -> (
    Vec<Account>,
    Vec<u64>,
    redis_support::Stopped,
    usize,
    Router,
) {
    let (_policy, app) = app(rig.store.clone(), &rig.clock);
    let master = rig.accounts[0].master;
    let replica = rig.cluster.replica_of(master);
    let mine: Vec<Account> = rig
        .accounts
        .iter()
        .filter(|a| a.group == 0 && a.master == master)
        .cloned()
        .collect();
    let mut admitted = vec![0u64; mine.len()];
    for (i, account) in mine.iter().enumerate() {
        for _ in 0..5 {
            assert_eq!(request(&app, account).await, StatusCode::OK);
            admitted[i] += 1;
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stopped = redis_support::Stopped::new(&rig.cluster.nodes[master]);
    let refused = futures_of(&app, &mine).await;
    assert!(
        refused
            .iter()
            .all(|s| *s == StatusCode::SERVICE_UNAVAILABLE),
        "{refused:?}"
    );
    promoted(rig, replica, Duration::from_secs(20)).await;
    println!("master {master} stopped, replica {replica} promoted");
    (mine, admitted, stopped, master, app)
}

/// Requests for each of `accounts` until each was admitted up to `limit`
/// (`admitted` counts them), a 503 tried again 50 ms later; false if a
/// subject was still refused `within`.
async fn serve_up_to(
    app: &Router,
    accounts: &[Account],
    admitted: &mut [u64],
    limit: u64,
    within: Duration,
) -> bool {
    let since = Instant::now();
    for (i, account) in accounts.iter().enumerate() {
        while admitted[i] < limit {
            match request(app, account).await {
                StatusCode::OK => admitted[i] += 1,
                StatusCode::SERVICE_UNAVAILABLE => {
                    if since.elapsed() > within {
                        return false;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => panic!("{other} at {} admitted", admitted[i]),
            }
        }
    }
    println!(
        "served up to {limit} {:?} after the promotion",
        since.elapsed()
    );
    true
}

/// A master that hangs (SIGSTOP: its sockets still accept bytes, nothing
/// answers) is voted failed and its replica promoted: the cluster serves
/// its slots again (`cluster_state:ok` everywhere). The store must follow:
/// the hung master's subjects are served by the new master within a few
/// seconds, however long the old one hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hung_master_failed_over_has_its_subjects_served_by_the_new_one() {
    if !redis_available() {
        return;
    }
    // No traffic on the other masters' subjects: the hung master answered
    // last.
    let rig = rig(2_000, "hung-master");
    let (mine, mut admitted, _stopped, _, app) = hung_master_failed_over(&rig).await;
    assert!(
        serve_up_to(&app, &mine, &mut admitted, 15, Duration::from_secs(10)).await,
        "a subject of the hung master still refused 10 s after its replica's promotion"
    );
}

/// As above, the hung master resumed as soon as its replica is promoted: it
/// runs the charges queued on its socket (on its own data, which it throws
/// away when it resyncs as a replica) and answers them, and the store gives
/// those charges back, their callers refused. The give-backs must take
/// nothing from the new master's counters, which never held those
/// charges: each subject's counter says what it was served, and a subject
/// is refused past its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_give_back_after_a_failover_takes_nothing_from_the_new_master() {
    if !redis_available() {
        return;
    }
    let rig = rig(2_000, "give-back-failover");
    let (mine, mut admitted, mut stopped, master, app) = hung_master_failed_over(&rig).await;
    stopped.resume();
    let port = rig.cluster.nodes[master].port();
    until(Duration::from_secs(20), move || {
        redis_support::cli(port, &["info", "replication"]).contains("master_link_status:up")
    })
    .await;
    let deadline = Instant::now() + Duration::from_secs(40);
    while rig.store.in_flight() > 0 {
        assert!(Instant::now() < deadline, "calls still in flight");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let given_back = rig.store.given_back();
    assert!(serve_up_to(&app, &mine, &mut admitted, 15, Duration::from_secs(10)).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut counted = Vec::new();
    let mut past_limit = Vec::new();
    for account in &mine {
        counted.push(
            rig.cluster
                .hget(&account.key, "n")
                .parse::<u64>()
                .unwrap_or(0),
        );
        if request(&app, account).await == StatusCode::OK {
            past_limit.push(account.name.clone());
        }
    }
    assert_eq!(
        (counted, past_limit),
        (admitted, Vec::<String>::new()),
        "(counted, admitted past the limit of 15) after {given_back} give-backs"
    );
}

/// One request for each of `accounts`, at once.
async fn futures_of(app: &Router, accounts: &[Account]) -> Vec<StatusCode> {
    let handles: Vec<_> = accounts
        .iter()
        .cloned()
        .map(|account| {
            let app = app.clone();
            tokio::spawn(async move { request(&app, &account).await })
        })
        .collect();
    let mut statuses = Vec::new();
    for handle in handles {
        statuses.push(handle.await.unwrap());
    }
    statuses
}

/// A graceful failover that the store's map of slots has not caught up
/// with yet (it is read every 2 s): a charge of the old master's subject
/// reaches the new master (the old one, a replica now, answers `MOVED`),
/// is held up there past its caller's wait (`CLIENT PAUSE`), and is
/// applied once the pause ends. The new master holds it: its give-back
/// must reach the new master, and the count say what was served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_charge_the_new_master_ran_before_the_map_caught_up_is_given_back() {
    if !redis_available() {
        return;
    }
    let cluster = ReplicatedCluster::start(5_000);
    let now = Timestamp::now().as_second();
    let at = Timestamp::from_second(now - now.rem_euclid(86_400) + 43_200).unwrap();
    let clock = ManualClock::new(at);
    let seeds: Vec<String> = cluster.nodes.iter().map(|n| n.url()).collect();
    let store = RedisStore::cluster_builder(seeds)
        .timeout(Duration::from_millis(200))
        .build()
        .expect("a Redis Cluster store");
    let (_policy, app) = app(store.clone(), &clock);
    let group = 2;
    let name = "late-on-new-master".to_owned();
    let key = quota(group).key(&Namespace::default(), &Subject::account(name.as_str()), at);
    let master = cluster.master_of(key.as_str());
    let replica = cluster.replica_of(master);
    let account = Account {
        name,
        group,
        key: key.as_str().to_owned(),
        master,
    };
    // The first request reads the map: the old master serves the slot.
    let first = Instant::now();
    for _ in 0..3 {
        assert_eq!(request(&app, &account).await, StatusCode::OK);
    }
    assert_eq!(cluster.nodes[replica].cli(&["cluster", "failover"]), "OK");
    let rig_promoted = Instant::now();
    let port = cluster.nodes[replica].port();
    until(Duration::from_secs(10), move || {
        redis_support::cli(port, &["role"]).lines().next() == Some("master")
    })
    .await;
    println!(
        "promoted {:?} after the map was read, {:?} after the failover",
        first.elapsed(),
        rig_promoted.elapsed()
    );
    // The new master holds its writes for 2 s.
    assert_eq!(
        cluster.nodes[replica].cli(&["client", "pause", "2000", "write"]),
        "OK"
    );
    assert_eq!(
        request(&app, &account).await,
        StatusCode::SERVICE_UNAVAILABLE,
        "the caller stopped waiting"
    );
    println!("refused {:?} after the map was read", first.elapsed());
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let deadline = Instant::now() + Duration::from_secs(40);
    while store.in_flight() > 0 {
        assert!(Instant::now() < deadline, "calls still in flight");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        cluster.hget(&account.key, "n"),
        "3",
        "3 served; given back: {}",
        store.given_back()
    );
}

/// A master killed while a leased store holds a block of one of its subjects;
/// the store shuts down a moment later, while the master is away: its
/// replica is promoted within the shutdown's lease time (10 s), so the
/// store is back within it and must get every unused unit ("a store back
/// within it gets every unused unit"): the counter, read from the new
/// master, says what was served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shutdown_while_a_killed_master_fails_over_gives_every_unit_back() {
    if !redis_available() {
        return;
    }
    let mut rig = rig(2_000, "killed-shutdown");
    let leased = LeasedStore::new(rig.store.clone());
    let (_policy, app) = app(leased.clone(), &rig.clock);
    // A subject of limit 45, and its master.
    let account = rig.accounts.iter().find(|a| a.group == 1).unwrap().clone();
    let master = account.master;
    let replica = rig.cluster.replica_of(master);
    let mut admitted = 0u64;
    // A few calls 20 ms apart: the subject takes a block.
    for _ in 0..12 {
        assert_eq!(request(&app, &account).await, StatusCode::OK);
        admitted += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let held = leased.held();
    assert!(held > 0, "a block held");
    // The replica has every write of its master.
    let before: u64 = rig.cluster.hget(&account.key, "n").parse().unwrap();
    let (mport, rport) = (
        rig.cluster.nodes[master].port(),
        rig.cluster.nodes[replica].port(),
    );
    until(Duration::from_secs(5), move || {
        let offset = |port: u16, field: &str| {
            redis_support::cli(port, &["info", "replication"])
                .lines()
                .find_map(|l| l.strip_prefix(field).map(str::to_owned))
        };
        offset(mport, "master_repl_offset:") == offset(rport, "slave_repl_offset:")
    })
    .await;
    rig.cluster.nodes[master].kill();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let shutdown = tokio::spawn(async move {
        let t = Instant::now();
        (leased.shutdown().await, t.elapsed())
    });
    let took = promoted(&rig, replica, Duration::from_secs(20)).await;
    let (returned, shutdown_took) = shutdown.await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let counted: u64 = rig.cluster.hget(&account.key, "n").parse().unwrap();
    println!(
        "held {held} (counted {before} for {admitted} served); master killed, replica promoted {took:?} later; shutdown returned {returned} in {shutdown_took:?}; counted now {counted}"
    );
    assert_eq!(before, admitted + held, "the block was charged");
    assert_eq!(
        (counted, returned),
        (admitted, held),
        "(counted, given back) after the shutdown, for {admitted} served and {held} held"
    );
}
