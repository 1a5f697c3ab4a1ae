//! Leased counting against a real `redis-server`: instances in this process
//! (each its own `RedisStore` and `LeasedStore`), and demo server processes
//! stopped with SIGTERM and SIGKILL.

#![cfg(feature = "redis")]

mod redis_support;
mod rigged;

mod demo_server;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use redis_support::RedisServer;
use rigged::{Rig, Rigged};
use tower_quota::store::{
    ChargeLine, ChargeRequest, LeasedStore, Lifetime, RedisStore, Store, StoreErrorKind,
};
use tower_quota::PeriodKey;

fn redis_store(url: String) -> RedisStore {
    RedisStore::builder(url)
        .wait_timeout(Duration::from_secs(2))
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2))
        .build()
        .expect("a Redis store")
}

fn key(subject: &str) -> PeriodKey {
    PeriodKey::from_string(format!("quota:{{account:{subject}}}:read:lease-test"))
}

/// One request of `subject` at the system clock's now, on a first-use
/// counter of a day.
fn request(subject: &str, limit: u64) -> ChargeRequest {
    let now = Timestamp::now();
    ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![ChargeLine {
            key: key(subject),
            limit,
            cost: 1,
            lifetime: Lifetime::FirstUse {
                deadline: now + jiff::SignedDuration::from_hours(24),
            },
            shadow_limit: None,
        }],
    }
}

/// What Redis counts for `subject` (0 without a counter).
fn counted(redis: &RedisServer, subject: &str) -> u64 {
    let key = key(subject);
    redis.cli(&["HGET", key.as_str(), "n"]).parse().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_admit_exactly_the_limit_under_concurrency() {
    let redis = redis_server_or_skip!();
    let instances: Vec<_> = (0..3)
        .map(|_| {
            LeasedStore::builder(redis_store(redis.url()))
                .idle(Duration::from_millis(100))
                .build()
        })
        .collect();
    let admitted = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let until = std::time::Instant::now() + Duration::from_secs(20);
    let mut tasks = Vec::new();
    for task in 0..30 {
        let leased = instances[task % 3].clone();
        let (admitted, refused) = (Arc::clone(&admitted), Arc::clone(&refused));
        tasks.push(tokio::spawn(async move {
            while admitted.load(Ordering::SeqCst) < 500 && std::time::Instant::now() < until {
                let outcome = leased.charge(request("shared", 500)).await.unwrap();
                if outcome.admitted {
                    admitted.fetch_add(1, Ordering::SeqCst);
                } else {
                    refused.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(admitted.load(Ordering::SeqCst), 500);
    assert!(refused.load(Ordering::Relaxed) > 0);
    // The limit holds whatever the instances still hold: nothing more is
    // admitted anywhere.
    for leased in &instances {
        assert!(
            !leased
                .charge(request("shared", 500))
                .await
                .unwrap()
                .admitted
        );
    }
    for leased in &instances {
        leased.shutdown().await;
    }
    assert_eq!(counted(&redis, "shared"), 500, "counted equals admitted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_instance_gives_its_units_back_and_another_spends_them() {
    let redis = redis_server_or_skip!();
    let a = LeasedStore::builder(redis_store(redis.url()))
        .idle(Duration::from_millis(200))
        .build();
    let b = LeasedStore::builder(redis_store(redis.url()))
        .idle(Duration::from_millis(200))
        .build();
    for _ in 0..150 {
        assert!(a.charge(request("idle", 200)).await.unwrap().admitted);
    }
    let held = a.held();
    assert!(held > 0, "a busy subject holds a block");
    assert_eq!(counted(&redis, "idle"), 150 + held);
    let mut b_admitted = 0;
    while b.charge(request("idle", 200)).await.unwrap().admitted {
        b_admitted += 1;
    }
    assert_eq!(b_admitted + held, 50, "b is refused while a holds units");
    // A goes idle: its units come back, and b spends them.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(a.held(), 0);
    let mut more = 0;
    while b.charge(request("idle", 200)).await.unwrap().admitted {
        more += 1;
    }
    assert_eq!(more, held);
    b.shutdown().await;
    assert_eq!(counted(&redis, "idle"), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_reaches_every_instance_within_the_lease_time() {
    let redis = redis_server_or_skip!();
    let lease_time = Duration::from_millis(300);
    let a = LeasedStore::builder(redis_store(redis.url()))
        .lease_time(lease_time)
        .idle(Duration::from_secs(10))
        .build();
    let support = redis_store(redis.url());
    for _ in 0..200 {
        assert!(a.charge(request("reset", 100_000)).await.unwrap().admitted);
    }
    assert!(a.held() > 0);
    assert!(support.reset(key("reset")).await.unwrap());
    // Past the lease time, what a spends is counted on the new counter:
    // the block taken before the reset is no longer spent.
    tokio::time::sleep(lease_time + Duration::from_millis(200)).await;
    for _ in 0..50 {
        assert!(a.charge(request("reset", 100_000)).await.unwrap().admitted);
    }
    assert_eq!(counted(&redis, "reset"), 50 + a.held());
    a.shutdown().await;
    assert_eq!(counted(&redis, "reset"), 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_and_a_restart_mid_lease_keep_the_count_right() {
    let mut redis = redis_server_or_skip!();
    let leased = LeasedStore::builder(
        RedisStore::builder(redis.url())
            .wait_timeout(Duration::from_millis(200))
            .connect_timeout(Duration::from_millis(200))
            .timeout(Duration::from_millis(200))
            .build()
            .unwrap(),
    )
    .idle(Duration::from_millis(300))
    .build();
    let mut admitted = 0;
    for _ in 0..300 {
        assert!(
            leased
                .charge(request("stall", 100_000))
                .await
                .unwrap()
                .admitted
        );
        admitted += 1;
    }
    // A stall: what the block holds is still spent here; what needs Redis
    // fails (the layer's fail-open or fail-closed decides), and nothing is
    // counted twice.
    {
        let _stopped = redis_support::Stopped::new(&redis);
        for _ in 0..50 {
            match leased.charge(request("stall", 100_000)).await {
                Ok(outcome) => {
                    assert!(outcome.admitted);
                    admitted += 1;
                }
                Err(error) => assert!(
                    matches!(
                        error.kind(),
                        StoreErrorKind::Timeout | StoreErrorKind::Unavailable
                    ),
                    "{error}"
                ),
            }
        }
    }
    // Redis answers again.
    let mut answered = false;
    for _ in 0..50 {
        if let Ok(outcome) = leased.charge(request("stall", 100_000)).await {
            assert!(outcome.admitted);
            admitted += 1;
            answered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(answered);
    leased.shutdown().await;
    assert_eq!(counted(&redis, "stall"), admitted);

    // A restart that forgets every counter while a block is held: the
    // block's units go back to nothing (no counter is made by a give-back).
    let leased = LeasedStore::builder(redis_store(redis.url()))
        .idle(Duration::from_millis(200))
        .build();
    for _ in 0..300 {
        assert!(
            leased
                .charge(request("restart", 100_000))
                .await
                .unwrap()
                .admitted
        );
    }
    assert!(leased.held() > 0);
    redis.restart();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(leased.held(), 0);
    assert_eq!(
        redis.cli(&["EXISTS", key("restart").as_str()]),
        "0",
        "a give-back never creates a counter"
    );
}

/// The demo server with leases, on Redis: a daily first-use quota of
/// `limit`, and an idle bound of `idle_ms`.
fn leased_server(redis: &RedisServer, limit: &str, idle_ms: &str) -> demo_server::Server {
    demo_server::start(&[
        "--limit",
        limit,
        "--period",
        "1d",
        "--anchor",
        "first-use",
        "--store",
        &redis.url(),
        "--lease",
        "--lease-idle",
        idle_ms,
    ])
}

/// An idle bound that never passes during a test.
const NEVER_IDLE: &str = "60000";

/// What Redis counts for the demo server's `read` allowance of `account`.
fn served_count(redis: &RedisServer, account: &str) -> u64 {
    let keys = redis.cli(&["KEYS", &format!("quota:{{account:{account}}}:read:*")]);
    let key = keys.lines().next().expect("a counter");
    redis.cli(&["HGET", key, "n"]).parse().unwrap_or(0)
}

async fn read_many(server: &demo_server::Server, account: &str, n: u64) {
    for _ in 0..n {
        let reply =
            demo_server::call(&server.addr, "GET", "/read", &[("x-account-id", account)]).await;
        assert_eq!(reply.status, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_stopped_with_sigterm_gives_its_units_back_at_once() {
    let redis = redis_server_or_skip!();
    let mut server = leased_server(&redis, "100000", NEVER_IDLE);
    read_many(&server, "term", 200).await;
    let held = served_count(&redis, "term") - 200;
    assert!(held > 0, "the server holds a block");
    let printed = server.stop("TERM");
    assert!(
        printed.contains(&format!("gave back {held} leased units")),
        "{printed}"
    );
    assert_eq!(served_count(&redis, "term"), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_with_sigkill_leaves_at_most_its_block_charged() {
    let redis = redis_server_or_skip!();
    let mut server = leased_server(&redis, "100000", NEVER_IDLE);
    read_many(&server, "kill", 200).await;
    server.stop("KILL");
    let left = served_count(&redis, "kill") - 200;
    // The documented bound: one block per subject, at most `max_block`
    // (1 000) and a quarter of what was left.
    assert!(left > 0 && left <= 1_000, "{left}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_while_another_server_holds_units_tells_a_short_wait() {
    let redis = redis_server_or_skip!();
    let (a, b) = (
        leased_server(&redis, "200", "1000"),
        leased_server(&redis, "200", "1000"),
    );
    read_many(&a, "short", 100).await;
    let held = served_count(&redis, "short") - 100;
    assert!(held > 0, "a holds a block");
    // B spends what nobody holds, then is refused while A holds the rest.
    loop {
        let reply = demo_server::call(&b.addr, "GET", "/read", &[("x-account-id", "short")]).await;
        if reply.status == 429 {
            break;
        }
        assert_eq!(reply.status, 200);
    }
    // Once B's own part in the lease mark landed (B took blocks too), the
    // refusal tells the client to come back within A's idle bound.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let refusal = demo_server::call(&b.addr, "GET", "/read", &[("x-account-id", "short")]).await;
    assert_eq!(refusal.status, 429);
    assert_eq!(refusal.header("retry-after"), Some("1"), "{}", refusal.body);
    assert!(
        refusal.body.contains("Other instances hold unused units"),
        "{}",
        refusal.body
    );
    // A idles: its units come back, and B spends them.
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    let mut more = 0;
    let last = loop {
        let reply = demo_server::call(&b.addr, "GET", "/read", &[("x-account-id", "short")]).await;
        if reply.status != 200 {
            break reply;
        }
        more += 1;
    };
    assert_eq!(more, held);
    // Nothing held anywhere: the wait is the reset's.
    assert_eq!(last.status, 429);
    let wait: u64 = last.header("retry-after").unwrap().parse().unwrap();
    assert!(wait > 80_000, "{wait}");
    assert_eq!(served_count(&redis, "short"), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_held_across_a_reset_never_go_back_to_the_new_counter() {
    let redis = redis_server_or_skip!();
    let a = LeasedStore::builder(redis_store(redis.url()))
        .idle(Duration::from_millis(200))
        .build();
    let support = redis_store(redis.url());
    for _ in 0..200 {
        assert!(
            a.charge(request("reset-back", 100_000))
                .await
                .unwrap()
                .admitted
        );
    }
    assert!(a.held() > 0);
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert!(support.reset(key("reset-back")).await.unwrap());
    for _ in 0..5 {
        assert!(
            support
                .charge(request("reset-back", 100_000))
                .await
                .unwrap()
                .admitted
        );
    }
    // A idles and gives back: not to the counter made after the reset.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(a.held(), 0);
    assert_eq!(counted(&redis, "reset-back"), 5);
    // A refund to a counter made by then still goes through.
    let made_by = Timestamp::now();
    assert_eq!(
        support
            .refund_made_by(Timestamp::now(), key("reset-back"), 2, made_by)
            .await
            .unwrap(),
        Some(3)
    );
    assert_eq!(
        support
            .refund_made_by(
                Timestamp::now(),
                key("reset-back"),
                2,
                "2000-01-01T00:00:00Z".parse().unwrap()
            )
            .await
            .unwrap(),
        None,
        "a counter made since is left as it is"
    );
    assert_eq!(counted(&redis, "reset-back"), 3);
}

/// `--store-timeout` no longer than what a leased store may wait on
/// purpose before it answers is refused at start, naming that wait.
#[test]
fn a_leased_server_refuses_a_store_timeout_its_waits_would_pass() {
    let redis = redis_server_or_skip!();
    let output = std::process::Command::new(demo_server::binary())
        .args(["--store", &redis.url(), "--lease", "--store-timeout", "25"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--store-timeout must be above 25 ms with --lease"),
        "{stderr}"
    );
}

/// A Redis store whose refunds, while `unsent` is set, fail as calls it
/// never sent (Redis out of reach for them: no room among the calls in
/// flight during a stall, a connection refused while it restarts); every
/// other call reaches Redis.
#[derive(Clone)]
struct RefundsUnsent {
    inner: RedisStore,
    unsent: Arc<std::sync::atomic::AtomicBool>,
}

impl RefundsUnsent {
    fn check(&self) -> Result<(), tower_quota::StoreError> {
        match self.unsent.load(Ordering::SeqCst) {
            true => Err(tower_quota::StoreError::new(StoreErrorKind::Timeout, "not sent").unsent()),
            false => Ok(()),
        }
    }
}

impl Store for RefundsUnsent {
    type ChargeFuture = <RedisStore as Store>::ChargeFuture;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        self.inner.charge(request)
    }
    fn charge_taking(
        &self,
        request: ChargeRequest,
        extra: smallvec::SmallVec<[u64; 2]>,
    ) -> impl std::future::Future<
        Output = Result<
            (
                tower_quota::store::ChargeOutcome,
                smallvec::SmallVec<[u64; 2]>,
            ),
            tower_quota::StoreError,
        >,
    > + Send {
        self.inner.charge_taking(request, extra)
    }
    async fn peek(
        &self,
        request: ChargeRequest,
    ) -> Result<Vec<tower_quota::Usage>, tower_quota::StoreError> {
        self.inner.peek(request).await
    }
    async fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, tower_quota::StoreError> {
        self.check()?;
        self.inner.refund(now, key, amount).await
    }
    async fn refund_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> Result<Option<u64>, tower_quota::StoreError> {
        self.check()?;
        self.inner.refund_made_by(now, key, amount, made_by).await
    }
    async fn refund_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> Result<Option<u64>, tower_quota::StoreError> {
        self.check()?;
        self.inner
            .refund_made_at(now, key, amount, first_call)
            .await
    }
    async fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, tower_quota::StoreError> {
        self.inner.add(now, key, amount).await
    }
    async fn reset(&self, key: PeriodKey) -> Result<bool, tower_quota::StoreError> {
        self.inner.reset(key).await
    }
    async fn settle_debt(
        &self,
        now: Timestamp,
        debt: tower_quota::store::Debt,
    ) -> Result<Option<u64>, tower_quota::StoreError> {
        self.inner.settle_debt(now, debt).await
    }
    fn identity(&self) -> Option<usize> {
        self.inner.identity()
    }
    fn max_count(&self) -> u64 {
        self.inner.max_count()
    }
}

/// A block cut short (another instance spent meanwhile: the store gives
/// what is left, this instance keeps a quarter of it and gives the rest
/// straight back) whose give-back Redis never got: the units are this
/// instance's still, never served, and must not stay charged once
/// everything settled, as the units of an idle block that met the same
/// fate do not (they are put back, and given back on the shutdown).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rest_of_a_block_cut_short_is_not_left_charged_when_its_give_back_never_left() {
    let redis = redis_server_or_skip!();
    let unsent = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let a = LeasedStore::builder(RefundsUnsent {
        inner: redis_store(redis.url()),
        unsent: Arc::clone(&unsent),
    })
    .build();
    let limit = 1_000;
    let mut admitted = 0;
    for _ in 0..200 {
        assert!(a.charge(request("cut", limit)).await.unwrap().admitted);
        admitted += 1;
    }
    // (Its next block may be on its way.)
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(a.held() > 0, "a busy subject holds a block");
    // Another instance spends all but a few units of what Redis has left.
    let other = redis_store(redis.url());
    let mut spent = request("cut", limit);
    spent.lines[0].cost = limit - counted(&redis, "cut") - 40;
    let other_cost = spent.lines[0].cost;
    assert!(other.charge(spent).await.unwrap().admitted);
    // From now on Redis is out of reach for refunds.
    unsent.store(true, Ordering::SeqCst);
    for _ in 0..limit {
        if !a.charge(request("cut", limit)).await.unwrap().admitted {
            break;
        }
        admitted += 1;
    }
    unsent.store(false, Ordering::SeqCst);
    a.shutdown().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        counted(&redis, "cut"),
        admitted + other_cost,
        "counted equals what was served"
    );
}

/// An add (a deferred cost) whose answer lands after the answer of a charge
/// sent later (which took a new block, and counts the add already): the
/// count this instance keeps must not go back to the add's older one, or
/// the usage its requests report (their `RateLimit` fields) says less was
/// spent than Redis counts, for as long as the block lasts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_add_answered_after_a_later_charge_leaves_the_usage_told_right() {
    let redis = redis_server_or_skip!();
    // Charges of no allowance it is rigged for: they reach Redis as they are.
    let rigged = Rigged::new(redis_store(redis.url()), Rig::Fail, Some("none"));
    let late = Arc::clone(&rigged.late_answers);
    let a = LeasedStore::builder(rigged).build();
    let limit = 100_000;
    for _ in 0..200 {
        assert!(a.charge(request("late-add", limit)).await.unwrap().admitted);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(a.held() > 0, "a busy subject holds a block");
    // A deferred cost of 5, applied in Redis at once, answered 500 ms late.
    late.store(500, Ordering::SeqCst);
    let adding = {
        let a = a.clone();
        tokio::spawn(async move { a.add(Timestamp::now(), key("late-add"), 5).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    // The block runs out meanwhile: the next is taken, with a charge
    // answered now, whose count includes the add.
    let held = a.held();
    for _ in 0..held + 5 {
        assert!(a.charge(request("late-add", limit)).await.unwrap().admitted);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let outcome = a.charge(request("late-add", limit)).await.unwrap();
    assert_eq!(
        outcome.usage[0].used,
        counted(&redis, "late-add") - a.held(),
        "before the add's answer lands"
    );
    // The add's answer lands, with the count as it stood then.
    adding.await.unwrap().unwrap();
    let outcome = a.charge(request("late-add", limit)).await.unwrap();
    assert!(outcome.admitted);
    assert_eq!(
        outcome.usage[0].used,
        counted(&redis, "late-add") - a.held(),
        "the usage told once the add's answer landed: what Redis counts, less the units held here"
    );
    a.shutdown().await;
}
