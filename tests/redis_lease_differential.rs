//! Leased counting on Redis against plain counting on the same Redis,
//! through the layer: random scripts of requests (three subjects; calendar
//! and first-use quotas, two plans, a shadow quota, a deferred cost, a cost
//! the request asks for, 500s refunded, requests undone by their handler),
//! steps of time (past the idle bound, past the lease time, past a
//! first-use minute and hour, to a calendar midnight, to a first-use
//! deadline and to the second before it) and support calls (refunds,
//! resets), on a real three-master Redis Cluster and on a single
//! `redis-server`. A plain app (a `RedisStore`, namespace `plain`) and
//! several leased instances (each its own `RedisStore` and `LeasedStore`,
//! namespace `quota`) share one `ManualClock`: every status, field and
//! body, every support answer and every standing must be the same.
//!
//! # Time
//!
//! The runtime's time is paused, and never moves on its own: a blocking
//! task held for the whole case keeps tokio from advancing it while the
//! runtime waits on Redis. It moves only with the layer's clock, together,
//! so the leases' idle bound and lease time follow the `ManualClock`
//! exactly. After each step of time the test waits (in real time) until
//! Redis has nothing more to run (give-backs on their way), then keeps
//! Redis's deadlines of first-use counters and lease marks on the layer's
//! clock (`align`: Redis expires them on its own): a new one gets its first
//! call plus its period, the others move by what the layer's clock moved
//! less what Redis's did. Requests come at whole seconds, so a first-use
//! reset told from a remaining life that real time shortened (by less than
//! a second) is the same once rounded up to the second.
//!
//! # Several instances
//!
//! While one instance holds a block, another may refuse its subject, and a
//! reset made elsewhere reaches it within the lease time (both documented):
//! so a subject served (or reset, or refunded) through another instance
//! than the last one first idles past the idle bound, and its standing is
//! read through the instance that served it last.
//!
//! `REDIS_LEASE_DIFF_CASES` sets the number of cases per backend, of up to
//! 100 steps each (by default one of up to 16 steps, beside the 2 s a
//! cluster takes to start; 100 cases take about seven minutes per
//! backend). Skipped without `redis-server`, except under `CI=true`.

#![cfg(feature = "redis-cluster")]

mod redis_support;

#[path = "differential/mod.rs"]
mod differential;

use differential::{route, Route};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use deadpool_redis::redis;
use jiff::{RoundMode, SignedDuration, Timestamp, TimestampRound, Unit};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tower_quota::store::{LeasedStore, RedisStore};
use tower_quota::{
    Anchor, FromHeader, ManualClock, QuotaHandle, QuotaPolicy, QuotaUsage, Store, Subject,
};

use redis_support::{redis_available, RedisCluster, RedisServer};

const SUBJECTS: [&str; 3] = ["acme", "globex", "initech"];
const ALLOWANCES: [&str; 4] = ["read", "write", "tokens", "bulk"];
const PLANS: [Option<&str>; 3] = [None, Some("free"), Some("pro")];
const INSTANCES: usize = 3;
const IDLE: Duration = Duration::from_secs(1);
const LEASE_TIME: Duration = Duration::from_secs(3);

static REFUSED: AtomicU64 = AtomicU64::new(0);
static STEPS_WITH_BLOCKS: AtomicU64 = AtomicU64::new(0);
static DOCUMENTED: AtomicU64 = AtomicU64::new(0);

fn whole_second(at: Timestamp) -> Timestamp {
    let up = TimestampRound::new()
        .smallest(Unit::Second)
        .mode(RoundMode::Ceil);
    at.round(up).unwrap_or(at)
}

fn describe(entries: &[QuotaUsage]) -> String {
    describe_as(entries, false)
}

/// Each entry as a client or support tool reads it, a first-use reset
/// rounded up to the second; if `leniently`, a first-use quota's period
/// where nothing is spent is not told.
fn describe_as(entries: &[QuotaUsage], leniently: bool) -> String {
    entries
        .iter()
        .map(|u| {
            let first_use = u.quota().anchor() == Anchor::FirstUse;
            if leniently && first_use && u.used() == 0 {
                return format!("[{} limit={} used=0]", u.name(), u.limit());
            }
            let resets_at = if first_use {
                whole_second(u.resets_at())
            } else {
                u.resets_at()
            };
            format!(
                "[{} limit={} used={} remaining={} resets_at={} first_call={:?}]",
                u.name(),
                u.limit(),
                u.used(),
                u.remaining(),
                resets_at,
                u.first_call().map(|t| t.to_string()),
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn app<St: Store>(store: St, clock: ManualClock, namespace: &str) -> (Router, QuotaHandle<St>) {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .clock(clock)
        .namespace(namespace)
        // The runtime's time stands still during a request.
        .store_timeout(Some(Duration::from_secs(5)));
    let limits = differential::Limits {
        read_day: [20, 12, 30],
        read_fu: [12, 18],
        read_shadow: 10,
        write_fu: [6, 9],
        tokens_day: 40,
        bulk: Some(([14, 20], 24)),
    };
    differential::app(policy, &limits, describe)
}

#[derive(Clone, Copy, Debug)]
enum Wait {
    /// Past the idle bound.
    Idle,
    /// Past the lease time.
    Lease,
    /// Past the first-use minute.
    FirstUse,
    /// Past the first-use hour and the shadow quota's window.
    Hour,
    /// To the next midnight (UTC), exactly.
    Midnight,
    /// To the earliest first-use deadline ahead, exactly (on the plain
    /// app's word).
    Deadline,
    /// To the second before it.
    BeforeDeadline,
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Call {
        who: usize,
        on: usize,
        route: Route,
        plan: usize,
        gap_s: u8,
    },
    Wait(Wait),
    /// Requests of different subjects at once through one instance (one
    /// batch of charges, across slots on a cluster).
    Burst {
        calls: [(Route, usize); SUBJECTS.len()],
        on: usize,
        first: usize,
        len: usize,
    },
    Refund {
        who: usize,
        on: usize,
        amount: u64,
    },
    RefundAllowance {
        who: usize,
        on: usize,
        allowance: usize,
        amount: u64,
    },
    Reset {
        who: usize,
        on: usize,
    },
    ResetAllowance {
        who: usize,
        on: usize,
        allowance: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let who = 0..SUBJECTS.len();
    let on = prop_oneof![6 => Just(0usize), 1 => 1..INSTANCES];
    prop_oneof![
        40 => (who.clone(), on.clone(), route(true), 0..PLANS.len(), prop_oneof![10 => Just(0u8), 2 => Just(1u8), 1 => 2u8..5])
            .prop_map(|(who, on, route, plan, gap_s)| Op::Call { who, on, route, plan, gap_s }),
        6 => prop_oneof![
            2 => Just(Wait::Idle),
            2 => Just(Wait::Lease),
            1 => Just(Wait::FirstUse),
            1 => Just(Wait::Hour),
            1 => Just(Wait::Midnight),
            1 => Just(Wait::Deadline),
            1 => Just(Wait::BeforeDeadline),
        ]
        .prop_map(Op::Wait),
        4 => (proptest::array::uniform3((route(true), 0..PLANS.len())), on.clone(), 0..SUBJECTS.len(), 2..=SUBJECTS.len())
            .prop_map(|(calls, on, first, len)| Op::Burst { calls, on, first, len }),
        1 => (who.clone(), on.clone(), 0u64..8).prop_map(|(who, on, amount)| Op::Refund { who, on, amount }),
        1 => (who.clone(), on.clone(), 0..ALLOWANCES.len(), 0u64..8)
            .prop_map(|(who, on, allowance, amount)| Op::RefundAllowance { who, on, allowance, amount }),
        1 => (who.clone(), on.clone()).prop_map(|(who, on)| Op::Reset { who, on }),
        1 => (who, on, 0..ALLOWANCES.len()).prop_map(|(who, on, allowance)| Op::ResetAllowance { who, on, allowance }),
    ]
}

/// `calls[i]` for `whos[i]`, all at once; their answers in that order.
async fn burst(app: &Router, calls: &[(Route, usize)], whos: &[usize]) -> String {
    let tasks: Vec<_> = whos
        .iter()
        .zip(calls)
        .map(|(&who, &(route, plan))| {
            let app = app.clone();
            tokio::spawn(
                async move { differential::ask(&app, route, SUBJECTS[who], PLANS[plan]).await },
            )
        })
        .collect();
    let mut seen = Vec::new();
    for task in tasks {
        seen.push(task.await.unwrap());
    }
    seen.join(" || ")
}

/// Where `who` stands, on the default limits and on each plan's.
async fn standing<St: Store>(handle: &QuotaHandle<St>, who: usize, leniently: bool) -> String {
    let subject = Subject::account(SUBJECTS[who]);
    let mut seen = String::new();
    for plan in PLANS {
        match handle.usage_on_plan(&subject, plan).await {
            Ok(usage) => seen.push_str(&format!("{plan:?}: {} ", describe_as(&usage, leniently))),
            Err(error) => seen.push_str(&format!("{plan:?}: error {error} ")),
        }
    }
    seen
}

/// The least `who` has spent on the quotas of `allowance` (every quota's
/// if `None`), on the plain app: what a support refund may give back.
async fn spent<St: Store>(handle: &QuotaHandle<St>, who: usize, allowance: Option<&str>) -> u64 {
    let usage = handle
        .usage(&Subject::account(SUBJECTS[who]))
        .await
        .unwrap();
    usage
        .iter()
        .filter(|u| allowance.is_none_or(|a| u.allowance() == a))
        .map(QuotaUsage::used)
        .min()
        .unwrap_or(0)
}

/// The earliest first-use deadline ahead of `now`, of any subject.
async fn next_deadline<St: Store>(handle: &QuotaHandle<St>, now: Timestamp) -> Option<Timestamp> {
    let mut next: Option<Timestamp> = None;
    for who in SUBJECTS {
        for usage in handle.usage(&Subject::account(who)).await.unwrap() {
            let end = whole_second(usage.resets_at());
            if usage.quota().anchor() == Anchor::FirstUse
                && usage.first_call().is_some()
                && end > now
            {
                next = Some(next.map_or(end, |n| n.min(end)));
            }
        }
    }
    next
}

/// Waits `ms` of real time (the runtime's stands still).
async fn real_sleep(ms: u64) {
    tokio::task::spawn_blocking(move || std::thread::sleep(Duration::from_millis(ms)))
        .await
        .unwrap();
}

/// Plain connections to every Redis node, to see when it is quiet and to
/// keep its deadlines on the layer's clock.
struct Nodes {
    conns: Vec<redis::aio::MultiplexedConnection>,
    /// Per node: Redis's clock less the layer's at the last alignment, and
    /// the first call and deadline it set on each key.
    offsets: Vec<Option<i64>>,
    deadlines: Vec<HashMap<String, (i64, i64)>>,
}

impl Nodes {
    async fn new(urls: &[String]) -> Self {
        let mut conns = Vec::new();
        for url in urls {
            let client = redis::Client::open(url.as_str()).unwrap();
            conns.push(client.get_multiplexed_async_connection().await.unwrap());
        }
        let n = conns.len();
        Self {
            conns,
            offsets: vec![None; n],
            deadlines: vec![HashMap::new(); n],
        }
    }

    async fn flush(&mut self) {
        for conn in &mut self.conns {
            let _: () = redis::cmd("FLUSHALL").query_async(conn).await.unwrap();
        }
    }

    async fn commands(&mut self) -> u64 {
        let mut total = 0;
        for conn in &mut self.conns {
            let info: String = redis::cmd("INFO")
                .arg("stats")
                .query_async(conn)
                .await
                .unwrap();
            total += info
                .lines()
                .find_map(|l| l.strip_prefix("total_commands_processed:"))
                .and_then(|n| n.trim().parse::<u64>().ok())
                .unwrap();
        }
        total
    }

    /// Lets spawned work run, until Redis has run nothing but these checks
    /// twice in a row.
    async fn quiesce(&mut self) {
        let mut last = self.commands().await;
        let mut quiet = 0;
        while quiet < 2 {
            for _ in 0..16 {
                tokio::task::yield_now().await;
            }
            real_sleep(1).await;
            let now = self.commands().await;
            // Each check runs one INFO per node.
            if now == last + self.conns.len() as u64 {
                quiet += 1;
            } else {
                quiet = 0;
            }
            last = now;
        }
    }

    /// Keeps Redis's deadlines on the layer's clock: a first-use counter
    /// or lease mark first seen here gets its first call plus its period
    /// (on `clock`); one seen before moves by what the layer's clock moved
    /// less what Redis's own did since (so a deadline the store moved stays
    /// moved). One whose deadline is then past is deleted, as Redis would
    /// expire it.
    async fn align(&mut self, clock: &ManualClock) {
        let manual = clock.now().as_millisecond();
        for (node, conn) in self.conns.iter_mut().enumerate() {
            let time: (i64, i64) = redis::cmd("TIME").query_async(conn).await.unwrap();
            let real = time.0 * 1000 + time.1 / 1000;
            let shift = self.offsets[node].map_or(0, |last| (real - manual) - last);
            self.offsets[node] = Some(real - manual);
            let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(conn).await.unwrap();
            let mut seen = HashMap::new();
            for key in keys {
                let (t, e): (Option<i64>, Option<i64>) = redis::cmd("HMGET")
                    .arg(&key)
                    .arg("t")
                    .arg("e")
                    .query_async(conn)
                    .await
                    .unwrap();
                let (Some(t), None) = (t, e) else { continue };
                let expires: i64 = redis::cmd("PEXPIRETIME")
                    .arg(&key)
                    .query_async(conn)
                    .await
                    .unwrap();
                let at = match self.deadlines[node].get(&key) {
                    Some(&(first, set)) if first == t && set == expires => expires + shift,
                    _ => {
                        let period = if key.contains("%held") {
                            LEASE_TIME.as_millis() as i64
                        } else {
                            let stamp = key.rsplit(':').next().unwrap();
                            let Ok(period) = stamp.parse::<SignedDuration>() else {
                                panic!("a first-use key without a period: {key}");
                            };
                            period.as_millis() as i64
                        };
                        real + (t + period - manual)
                    }
                };
                if at <= real {
                    let _: () = redis::cmd("DEL").arg(&key).query_async(conn).await.unwrap();
                } else {
                    let _: () = redis::cmd("PEXPIREAT")
                        .arg(&key)
                        .arg(at)
                        .query_async(conn)
                        .await
                        .unwrap();
                    seen.insert(key, (t, at));
                }
            }
            self.deadlines[node] = seen;
        }
    }
}

struct Backend {
    urls: Vec<String>,
    cluster: bool,
}

impl Backend {
    fn store(&self) -> RedisStore {
        let builder = if self.cluster {
            RedisStore::cluster_builder(self.urls.clone())
        } else {
            RedisStore::builder(self.urls[0].clone())
        };
        builder
            .timeout(Duration::from_secs(2))
            .wait_timeout(Duration::from_secs(2))
            .connect_timeout(Duration::from_secs(2))
            .build()
            .expect("a Redis store")
    }
}

fn run(backend: &Backend, ops: &[Op]) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let (release, held) = std::sync::mpsc::channel::<()>();
    let result = runtime.block_on(async {
        // Held for the whole case: tokio never advances its paused time
        // on its own while a blocking task runs.
        let hold = tokio::task::spawn_blocking(move || {
            let _ = held.recv();
        });
        let result = case(backend, ops).await;
        drop(release);
        hold.await.unwrap();
        result
    });
    drop(runtime);
    result
}

async fn case(backend: &Backend, ops: &[Op]) -> Result<(), String> {
    let mut nodes = Nodes::new(&backend.urls).await;
    nodes.flush().await;
    let start: Timestamp = "2026-12-04T23:58:30Z".parse().unwrap();
    let clock = ManualClock::new(start);
    let (plain, plain_handle) = app(backend.store(), clock.clone(), "plain");
    let mut stores = Vec::new();
    let mut leased = Vec::new();
    for _ in 0..INSTANCES {
        let store = LeasedStore::builder(backend.store())
            .idle(IDLE)
            .lease_time(LEASE_TIME)
            .build();
        leased.push(app(store.clone(), clock.clone(), "quota"));
        stores.push(store);
    }
    nodes.align(&clock).await;
    // The instance that served each subject last.
    let mut owner: [Option<usize>; SUBJECTS.len()] = [None; SUBJECTS.len()];
    macro_rules! advance {
        ($by:expr) => {{
            let by: Duration = $by;
            let mut left = by;
            while !left.is_zero() {
                let step = if by - left < LEASE_TIME + Duration::from_secs(1) {
                    left.min(Duration::from_millis(250))
                } else {
                    left
                };
                clock.advance(SignedDuration::try_from(step).unwrap());
                tokio::time::advance(step).await;
                nodes.quiesce().await;
                nodes.align(&clock).await;
                left -= step;
            }
        }};
    }
    // A subject about to be served through `on`: if another instance
    // served it last, it first idles there.
    macro_rules! serve_on {
        ($who:expr, $on:expr) => {{
            let (who, on): (usize, usize) = ($who, $on);
            if owner[who].is_some_and(|last| last != on) {
                advance!(IDLE + Duration::from_secs(1));
            }
            owner[who] = Some(on);
        }};
    }
    for (step, op) in ops.iter().enumerate() {
        let (a, b) = match *op {
            Op::Call {
                who,
                on,
                route,
                plan,
                gap_s,
            } => {
                serve_on!(who, on);
                let a = differential::ask(&plain, route, SUBJECTS[who], PLANS[plan]).await;
                let b = differential::ask(&leased[on].0, route, SUBJECTS[who], PLANS[plan]).await;
                nodes.quiesce().await;
                if gap_s > 0 {
                    advance!(Duration::from_secs(u64::from(gap_s)));
                }
                (a, b)
            }
            Op::Wait(wait) => {
                let now = clock.now();
                let to = match wait {
                    Wait::Idle => Some(
                        now + SignedDuration::try_from(IDLE).unwrap()
                            + SignedDuration::from_secs(1),
                    ),
                    Wait::Lease => Some(
                        now + SignedDuration::try_from(LEASE_TIME).unwrap()
                            + SignedDuration::from_secs(1),
                    ),
                    Wait::FirstUse => Some(now + SignedDuration::from_secs(61)),
                    Wait::Hour => Some(now + SignedDuration::from_secs(3_601)),
                    Wait::Midnight => {
                        let day = now.as_second().div_euclid(86_400);
                        Some(Timestamp::from_second((day + 1) * 86_400).unwrap())
                    }
                    Wait::Deadline => next_deadline(&plain_handle, now).await,
                    Wait::BeforeDeadline => next_deadline(&plain_handle, now)
                        .await
                        .map(|at| at - SignedDuration::from_secs(1))
                        .filter(|&at| at > now),
                };
                if let Some(to) = to {
                    advance!(Duration::try_from(to.duration_since(now)).unwrap());
                }
                (String::new(), String::new())
            }
            Op::Burst {
                calls,
                on,
                first,
                len,
            } => {
                let whos: Vec<usize> = (0..len).map(|i| (first + i) % SUBJECTS.len()).collect();
                for &who in &whos {
                    serve_on!(who, on);
                }
                let a = burst(&plain, &calls, &whos).await;
                let b = burst(&leased[on].0, &calls, &whos).await;
                (a, b)
            }
            Op::Refund { who, on, amount } => {
                serve_on!(who, on);
                let amount = amount.min(spent(&plain_handle, who, None).await);
                let subject = Subject::account(SUBJECTS[who]);
                let a = plain_handle.refund(&subject, amount).await;
                let b = leased[on].1.refund(&subject, amount).await;
                (
                    format!("refund {amount}: {a:?}"),
                    format!("refund {amount}: {b:?}"),
                )
            }
            Op::RefundAllowance {
                who,
                on,
                allowance,
                amount,
            } => {
                serve_on!(who, on);
                let tag = ALLOWANCES[allowance];
                let amount = amount.min(spent(&plain_handle, who, Some(tag)).await);
                let subject = Subject::account(SUBJECTS[who]);
                let a = plain_handle.refund_allowance(&subject, tag, amount).await;
                let b = leased[on].1.refund_allowance(&subject, tag, amount).await;
                (
                    format!("refund {tag} {amount}: {a:?}"),
                    format!("refund {tag} {amount}: {b:?}"),
                )
            }
            Op::Reset { who, on } => {
                serve_on!(who, on);
                let subject = Subject::account(SUBJECTS[who]);
                let a = plain_handle.reset(&subject).await;
                let b = leased[on].1.reset(&subject).await;
                (format!("{:?}", a.is_ok()), format!("{:?}", b.is_ok()))
            }
            Op::ResetAllowance { who, on, allowance } => {
                serve_on!(who, on);
                let subject = Subject::account(SUBJECTS[who]);
                let tag = ALLOWANCES[allowance];
                let a = plain_handle.reset_allowance(&subject, tag).await;
                let b = leased[on].1.reset_allowance(&subject, tag).await;
                (format!("{a:?}"), format!("{b:?}"))
            }
        };
        nodes.quiesce().await;
        nodes.align(&clock).await;
        REFUSED.fetch_add(
            a.matches("429 Too Many Requests").count() as u64,
            Ordering::Relaxed,
        );
        if a != b {
            return Err(format!(
                "step {step} {op:?} at {}:\n  plain:  {a}\n  leased: {b}",
                clock.now()
            ));
        }
        if stores.iter().any(|s| s.held() > 0) {
            STEPS_WITH_BLOCKS.fetch_add(1, Ordering::Relaxed);
        }
        for who in 0..SUBJECTS.len() {
            let handle = &leased[owner[who].unwrap_or(0)].1;
            let (mut a, mut b) = (
                standing(&plain_handle, who, false).await,
                standing(handle, who, false).await,
            );
            if a != b
                && standing(&plain_handle, who, true).await == standing(handle, who, true).await
            {
                // The documented difference (see lease_differential.rs): a
                // first-use period opened by a request that took a block
                // and was given back whole stays open while the block is
                // held.
                DOCUMENTED.fetch_add(1, Ordering::Relaxed);
                advance!(IDLE + Duration::from_secs(1));
                a = standing(&plain_handle, who, false).await;
                b = standing(handle, who, false).await;
            }
            if a != b {
                return Err(format!(
                    "step {step} {op:?} at {}: {}'s standing (on {:?})\n  plain:  {a}\n  leased: {b}",
                    clock.now(),
                    SUBJECTS[who],
                    owner[who],
                ));
            }
        }
    }
    for store in &stores {
        store.shutdown().await;
    }
    nodes.quiesce().await;
    nodes.align(&clock).await;
    for (who, subject) in SUBJECTS.iter().enumerate() {
        let (a, b) = (
            standing(&plain_handle, who, false).await,
            standing(&leased[0].1, who, false).await,
        );
        if a != b {
            return Err(format!(
                "after shutdown: {subject}'s standing\n  plain:  {a}\n  leased: {b}"
            ));
        }
    }
    Ok(())
}

fn differ(backend: &Backend) {
    // By default one short script per backend (a few seconds in all).
    let cases = std::env::var("REDIS_LEASE_DIFF_CASES")
        .ok()
        .and_then(|n| n.parse().ok());
    let (cases, steps) = match cases {
        Some(cases) => (cases, 100),
        None => (1, 16),
    };
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&proptest::collection::vec(op(), 1..steps), |ops| {
        run(backend, &ops).map_err(TestCaseError::fail)
    });
    if let Err(error) = result {
        panic!("{error}");
    }
    eprintln!(
        "refused: {}; steps with blocks held: {}; first-use periods kept open by a block: {}",
        REFUSED.load(Ordering::Relaxed),
        STEPS_WITH_BLOCKS.load(Ordering::Relaxed),
        DOCUMENTED.load(Ordering::Relaxed),
    );
}

#[test]
fn leased_instances_see_the_same_as_plain_counting_on_a_cluster() {
    if !redis_available() {
        return;
    }
    let cluster = RedisCluster::start();
    differ(&Backend {
        urls: cluster.urls(),
        cluster: true,
    });
}

#[test]
fn leased_instances_see_the_same_as_plain_counting_on_one_server() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    differ(&Backend {
        urls: vec![server.url()],
        cluster: false,
    });
}
