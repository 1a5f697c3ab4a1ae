//! The lease metrics against what the store saw: a `LeasedStore` over a
//! counting wrapper of a `MemoryStore`, sent random scripts of requests
//! (several subjects, calendar and first-use quotas, one near its limit),
//! idle gaps past the idle bound, lease times passing, support resets and
//! shutdowns. The wrapper counts each charge that takes a block (a line
//! costing more than its request's part), each give-back of unused units
//! and its units, and each request that reached the store; at each quiet
//! point `tower_quota_lease_blocks_total`,
//! `tower_quota_lease_units_returned_total` and
//! `tower_quota_lease_local_charges_total` equal what it saw.
//!
//! `LEASE_METRICS_CASES=n` runs `n` seeds.

#![cfg(feature = "metrics")]

mod seeded;

use seeded::Rng;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tower_quota::jiff::{SignedDuration, Timestamp};
use tower_quota::metrics::{LEASE_BLOCKS, LEASE_LOCAL_CHARGES, LEASE_UNITS_RETURNED};
use tower_quota::store::{ChargeOutcome, ChargeRequest, Debt, LeasedStore, StoreError};
use tower_quota::{MemoryStore, Namespace, PeriodKey, Quota, Store, Subject, Usage};

tokio::task_local! {
    /// Set while the script's own request is charged: a charge seen then is
    /// that request's (one of cost 1), any other a block taken ahead.
    static IN_REQUEST: Arc<Mutex<bool>>;
}

#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    /// Admitted charges that took a block.
    blocks: u64,
    /// Give-backs of unused units the store took, and their units.
    give_backs: u64,
    returned: u64,
}

/// A memory store that counts what a leased store asks of it, after an
/// optional delay on each charge.
#[derive(Clone)]
struct Counting {
    inner: MemoryStore,
    seen: Arc<Mutex<Seen>>,
    delay: Arc<Mutex<Duration>>,
    /// A delay after a charge is applied, before it is answered.
    after: Arc<Mutex<Duration>>,
}

fn is_mark(key: &PeriodKey) -> bool {
    key.as_str().contains("%held")
}

impl Store for Counting {
    type ChargeFuture =
        std::pin::Pin<Box<dyn Future<Output = Result<ChargeOutcome, StoreError>> + Send>>;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        let in_request = IN_REQUEST.try_with(Arc::clone).ok();
        let (inner, seen, delay, after) = (
            self.inner.clone(),
            Arc::clone(&self.seen),
            *self.delay.lock().unwrap(),
            *self.after.lock().unwrap(),
        );
        Box::pin(async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let answer = inner.charge(request.clone()).await;
            if !after.is_zero() {
                tokio::time::sleep(after).await;
            }
            let lines: Vec<_> = request.lines.iter().filter(|l| !is_mark(&l.key)).collect();
            if let Some(asked) = &in_request {
                if !lines.is_empty() {
                    *asked.lock().unwrap() = true;
                }
            }
            if let Ok(outcome) = &answer {
                if outcome.admitted {
                    // The script's requests are of one line of cost 1.
                    let part = u64::from(in_request.is_some());
                    let took = lines.iter().filter(|l| l.cost > part).count() as u64;
                    seen.lock().unwrap().blocks += took;
                }
            }
            answer
        })
    }
    fn peek(
        &self,
        request: ChargeRequest,
    ) -> impl Future<Output = Result<Vec<Usage>, StoreError>> + Send {
        self.inner.peek(request)
    }
    fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        assert!(is_mark(&key), "only marks are refunded so: {key:?}");
        self.inner.refund(now, key, amount)
    }
    fn refund_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.inner.refund_made_by(now, key, amount, made_by)
    }
    fn refund_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        let (inner, seen) = (self.inner.clone(), Arc::clone(&self.seen));
        async move {
            let mark = is_mark(&key);
            let answer = inner.refund_made_at(now, key, amount, first_call).await;
            if !mark && matches!(answer, Ok(Some(_))) {
                let mut seen = seen.lock().unwrap();
                seen.give_backs += 1;
                seen.returned += amount;
            }
            answer
        }
    }
    fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.inner.add(now, key, amount)
    }
    fn settle_debt(
        &self,
        now: Timestamp,
        debt: Debt,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.inner.settle_debt(now, debt)
    }
    fn reset(&self, key: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.inner.reset(key)
    }
    fn max_count(&self) -> u64 {
        self.inner.max_count()
    }
}

#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
struct LeaseMetrics {
    blocks: u64,
    local: u64,
    returned: u64,
}

impl LeaseMetrics {
    fn read(&mut self, snapshotter: &Snapshotter) {
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let DebugValue::Counter(n) = value else {
                continue;
            };
            match key.key().name() {
                LEASE_BLOCKS => self.blocks += n,
                LEASE_LOCAL_CHARGES => self.local += n,
                LEASE_UNITS_RETURNED => self.returned += n,
                _ => {}
            }
        }
    }
}

struct World {
    leased: LeasedStore<Counting>,
    seen: Arc<Mutex<Seen>>,
    delay: Arc<Mutex<Duration>>,
    after: Arc<Mutex<Duration>>,
    t0: Timestamp,
    start: tokio::time::Instant,
    quotas: Vec<Quota>,
    ns: Namespace,
    /// Requests charged, and those the store was not asked for.
    requests: u64,
    local: u64,
    admitted: u64,
}

impl World {
    fn new() -> Self {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let delay = Arc::new(Mutex::new(Duration::ZERO));
        let after = Arc::new(Mutex::new(Duration::ZERO));
        let store = Counting {
            inner: MemoryStore::new(),
            seen: Arc::clone(&seen),
            delay: Arc::clone(&delay),
            after: Arc::clone(&after),
        };
        Self {
            leased: LeasedStore::new(store),
            seen,
            delay,
            after,
            t0: "2026-12-04T10:00:00Z".parse().unwrap(),
            start: tokio::time::Instant::now(),
            // Subjects 0 and 1: a busy calendar quota; 2: one near its
            // limit; 3: a first-use one (no block taken ahead).
            quotas: vec![
                Quota::per_minute(1_000_000),
                Quota::daily(1_000_000),
                Quota::per_minute(60),
                Quota::rolling(1_000_000, Duration::from_secs(90)),
            ],
            ns: Namespace::new("quota"),
            requests: 0,
            local: 0,
            admitted: 0,
        }
    }

    fn now(&self) -> Timestamp {
        let elapsed = tokio::time::Instant::now() - self.start;
        self.t0
            .checked_add(SignedDuration::try_from(elapsed).unwrap())
            .unwrap()
    }

    fn key(&self, subject: usize) -> PeriodKey {
        let who = Subject::account(format!("s{subject}"));
        self.quotas[subject].line(&self.ns, &who, self.now(), 1).key
    }

    fn charge_of(&self, subject: usize) -> ChargeRequest {
        let who = Subject::account(format!("s{subject}"));
        ChargeRequest {
            charged_at: None,
            now: self.now(),
            lines: smallvec::smallvec![self.quotas[subject].line(&self.ns, &who, self.now(), 1)],
        }
    }

    async fn request(&mut self, subject: usize) {
        let request = self.charge_of(subject);
        let asked = Arc::new(Mutex::new(false));
        let outcome = IN_REQUEST
            .scope(Arc::clone(&asked), self.leased.charge(request))
            .await
            .unwrap();
        self.requests += 1;
        self.admitted += u64::from(outcome.admitted);
        if !*asked.lock().unwrap() {
            assert!(outcome.admitted, "refused without the store");
            self.local += 1;
        }
    }

    async fn pass(&self, time: Duration) {
        tokio::time::sleep(time).await;
    }

    fn check(&self, snapshotter: &Snapshotter, got: &mut LeaseMetrics, ctx: &str) {
        got.read(snapshotter);
        let seen = *self.seen.lock().unwrap();
        let want = LeaseMetrics {
            blocks: seen.blocks,
            local: self.local,
            returned: seen.returned,
        };
        assert_eq!(
            *got, want,
            "{ctx}: metrics (left) against what the store saw (right); {seen:?}, {} requests",
            self.requests
        );
    }
}

async fn run(seed: u64, steps: usize, snapshotter: &Snapshotter) -> (u64, u64) {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x1EA5E);
    let mut world = World::new();
    let mut got = LeaseMetrics::default();
    let mut shutdowns = 0;
    for step in 0..steps {
        match rng.below(100) {
            0..=49 => {
                // A burst of one subject's requests, a few ms apart.
                let subject = rng.below(4) as usize;
                for _ in 0..1 + rng.below(40) {
                    world.pass(Duration::from_millis(rng.below(30))).await;
                    world.request(subject).await;
                }
            }
            50..=64 => {
                // Busy past the lease time.
                let subject = rng.below(4) as usize;
                for _ in 0..60 {
                    world
                        .pass(Duration::from_millis(150 + rng.below(100)))
                        .await;
                    world.request(subject).await;
                }
            }
            65..=79 => {
                // Idle past the idle bound, or for longer.
                let ms = if rng.below(3) == 0 {
                    20_000 + rng.below(100_000)
                } else {
                    1_000 + rng.below(3_000)
                };
                world.pass(Duration::from_millis(ms)).await;
            }
            80..=87 => {
                let subject = rng.below(4) as usize;
                let key = world.key(subject);
                world.leased.reset(key).await.unwrap();
            }
            88..=89 => {
                let before = world.seen.lock().unwrap().returned;
                let returned = world.leased.shutdown().await;
                let after = world.seen.lock().unwrap().returned;
                assert!(
                    returned <= after - before,
                    "seed {seed} step {step}: shutdown returned {returned}, the store took {}",
                    after - before
                );
                shutdowns += 1;
                // A new instance, on the same store.
                world.leased = LeasedStore::new(world.leased.inner().clone());
            }
            _ => {
                world.pass(Duration::from_millis(rng.below(800))).await;
            }
        }
        world.pass(Duration::from_millis(20)).await;
        world.check(snapshotter, &mut got, &format!("seed {seed} step {step}"));
    }
    let before = world.seen.lock().unwrap().returned;
    let returned = world.leased.shutdown().await;
    world.pass(Duration::from_millis(50)).await;
    let after = world.seen.lock().unwrap().returned;
    assert_eq!(returned, after - before, "seed {seed}: the last shutdown");
    world.check(snapshotter, &mut got, &format!("seed {seed} at the end"));
    assert_eq!(world.leased.held(), 0);
    let _ = &world.delay;
    (world.requests, shutdowns)
}

fn with_recorder<T>(work: impl FnOnce(&Snapshotter) -> T) -> T {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || work(&snapshotter))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}

#[test]
fn lease_metrics_equal_what_the_store_saw() {
    let cases = std::env::var("LEASE_METRICS_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40u64);
    let (mut requests, mut shutdowns) = (0, 0);
    for seed in 0..cases {
        let (r, s) = with_recorder(|snapshotter| runtime().block_on(run(seed, 60, snapshotter)));
        requests += r;
        shutdowns += s;
    }
    eprintln!("{cases} seeds, {requests} requests, {shutdowns} shutdowns mid-run");
}

/// A block on its way when the store shuts down is given back as it
/// lands: it was taken from the store all the same, and its units count as
/// returned; the blocks counted say so.
#[test]
fn a_block_that_lands_after_a_shutdown_counts_as_taken() {
    let (got, seen) = with_recorder(|snapshotter| {
        runtime().block_on(async {
            let mut world = World::new();
            // Busy enough for a block.
            for _ in 0..30 {
                world.pass(Duration::from_millis(5)).await;
                world.request(0).await;
            }
            world.pass(Duration::from_secs(5)).await;
            let held_before = world.leased.held();
            assert_eq!(held_before, 0, "given back once idle");
            // Back from the pause: the first request takes no block.
            world.pass(Duration::from_millis(5)).await;
            world.request(0).await;
            assert_eq!(world.leased.held(), 0);
            // The next charge takes a block, and the store answers late;
            // the store shuts down meanwhile.
            *world.delay.lock().unwrap() = Duration::from_millis(50);
            let who = Subject::account("s0");
            let request = ChargeRequest {
                charged_at: None,
                now: world.now(),
                lines: smallvec::smallvec![world.quotas[0].line(&world.ns, &who, world.now(), 1)],
            };
            let asked = Arc::new(Mutex::new(false));
            let charge = IN_REQUEST.scope(asked, world.leased.charge(request));
            let shutdown = async {
                world.pass(Duration::from_millis(10)).await;
                world.leased.shutdown().await
            };
            let (outcome, _) = tokio::join!(charge, shutdown);
            assert!(outcome.unwrap().admitted);
            world.pass(Duration::from_millis(100)).await;
            let mut got = LeaseMetrics::default();
            got.read(snapshotter);
            let seen = *world.seen.lock().unwrap();
            (got, seen)
        })
    });
    assert!(seen.blocks >= 2, "{seen:?}");
    assert_eq!(got.returned, seen.returned, "{got:?} {seen:?}");
    assert_eq!(
        got.blocks, seen.blocks,
        "blocks counted (left) against blocks the store charged (right); {got:?} {seen:?}"
    );
}

/// A support reset through the leased store while a charge that takes a
/// block is on its way: the block goes straight back (it is not the new
/// entry's), its units count as returned, and the block as taken.
#[test]
fn a_block_that_lands_after_a_reset_here_counts_as_taken() {
    let (got, seen) = with_recorder(|snapshotter| {
        runtime().block_on(async {
            let mut world = World::new();
            for _ in 0..30 {
                world.pass(Duration::from_millis(5)).await;
                world.request(0).await;
            }
            world.pass(Duration::from_secs(5)).await;
            world.pass(Duration::from_millis(5)).await;
            world.request(0).await;
            assert_eq!(world.leased.held(), 0);
            *world.delay.lock().unwrap() = Duration::from_millis(50);
            let charge = IN_REQUEST.scope(
                Arc::new(Mutex::new(false)),
                world.leased.charge(world.charge_of(0)),
            );
            let reset = async {
                world.pass(Duration::from_millis(10)).await;
                let key = world.key(0);
                world.leased.reset(key).await.unwrap()
            };
            let (outcome, _) = tokio::join!(charge, reset);
            assert!(outcome.unwrap().admitted);
            world.pass(Duration::from_millis(100)).await;
            let mut got = LeaseMetrics::default();
            got.read(snapshotter);
            let seen = *world.seen.lock().unwrap();
            (got, seen)
        })
    });
    assert_eq!(got.returned, seen.returned, "{got:?} {seen:?}");
    assert_eq!(
        got.blocks, seen.blocks,
        "blocks counted (left) against blocks the store charged (right); {got:?} {seen:?}"
    );
}

/// A request the store refused while a block of its counter was on its
/// way here, served from that block once it landed, asked its store: it
/// is no local charge (the share of requests that took no round trip is
/// local charges over all charges).
#[test]
fn a_request_refused_then_served_from_a_block_on_its_way_is_no_local_charge() {
    let (got, local, requests, seen) = with_recorder(|snapshotter| {
        runtime().block_on(async {
            let mut world = World::new();
            world.quotas[0] = Quota::per_minute(200);
            // Another instance on the same store (charging it directly).
            let other = world.leased.inner().inner.clone();
            for _ in 0..30 {
                world.pass(Duration::from_millis(5)).await;
                world.request(0).await;
            }
            world.pass(Duration::from_secs(5)).await;
            world.pass(Duration::from_millis(5)).await;
            world.request(0).await;
            assert_eq!(world.leased.held(), 0);
            // The next charge takes a block: applied at once, answered
            // 10 ms later.
            *world.after.lock().unwrap() = Duration::from_millis(10);
            let asked_a = Arc::new(Mutex::new(false));
            let a = IN_REQUEST.scope(
                Arc::clone(&asked_a),
                world.leased.charge(world.charge_of(0)),
            );
            let asked_b = Arc::new(Mutex::new(false));
            let rest = async {
                world.pass(Duration::from_millis(1)).await;
                *world.after.lock().unwrap() = Duration::ZERO;
                // The other instance spends what is left.
                let mut spent = 0;
                loop {
                    let outcome = other.charge(world.charge_of(0)).await.unwrap();
                    if !outcome.admitted {
                        break;
                    }
                    spent += 1;
                    assert!(spent < 1_000);
                }
                // This instance's next request: refused by the store, which
                // counts the block on its way here.
                IN_REQUEST
                    .scope(
                        Arc::clone(&asked_b),
                        world.leased.charge(world.charge_of(0)),
                    )
                    .await
            };
            let (a, b) = tokio::join!(a, rest);
            assert!(a.unwrap().admitted);
            let b = b.unwrap();
            assert!(b.admitted, "served from the block that landed");
            assert!(*asked_b.lock().unwrap(), "the store was asked");
            let local = world.local;
            let requests = world.requests + 2;
            world.pass(Duration::from_millis(100)).await;
            let mut got = LeaseMetrics::default();
            got.read(snapshotter);
            let seen = *world.seen.lock().unwrap();
            (got, local, requests, seen)
        })
    });
    assert_eq!(
        got.local, local,
        "local charges counted (left) against requests that never reached the store (right) of \
         {requests}; {got:?} {seen:?}"
    );
}
