//! Leased counting over the memory store, step by step: the runtime's time
//! paused and moved by hand, the layer's instants given in each request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use tower_quota::store::{
    ChargeLine, ChargeOutcome, ChargeRequest, LeasedStore, Lifetime, Store, StoreError, Usage,
};
use tower_quota::{MemoryStore, PeriodKey};

/// The units each line of a charge took beyond its cost.
type Taken = smallvec::SmallVec<[u64; 2]>;

/// A store that counts the charges sent to it, and the give-backs.
#[derive(Clone, Default)]
struct Counting {
    inner: MemoryStore,
    charges: Arc<AtomicU64>,
    give_backs: Arc<AtomicU64>,
}

impl Store for Counting {
    type ChargeFuture = <MemoryStore as Store>::ChargeFuture;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        self.charges.fetch_add(1, Ordering::Relaxed);
        self.inner.charge(request)
    }
    fn charge_taking(
        &self,
        request: ChargeRequest,
        extra: smallvec::SmallVec<[u64; 2]>,
    ) -> impl std::future::Future<Output = Result<(ChargeOutcome, Taken), StoreError>> + Send {
        self.charges.fetch_add(1, Ordering::Relaxed);
        self.inner.charge_taking(request, extra)
    }
    fn peek(
        &self,
        request: ChargeRequest,
    ) -> impl std::future::Future<Output = Result<Vec<Usage>, StoreError>> + Send {
        self.inner.peek(request)
    }
    fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl std::future::Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.inner.refund(now, key, amount)
    }
    fn refund_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> impl std::future::Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.give_backs.fetch_add(1, Ordering::Relaxed);
        self.inner.refund_made_by(now, key, amount, made_by)
    }
    fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl std::future::Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.inner.add(now, key, amount)
    }
    fn reset(
        &self,
        key: PeriodKey,
    ) -> impl std::future::Future<Output = Result<bool, StoreError>> + Send {
        self.inner.reset(key)
    }
}

/// A memory store that takes `delay` milliseconds of the runtime's time to
/// answer anything (none by default; a test may change it on the way),
/// answers a charge `late` milliseconds after it applied it, and takes
/// `slow_refunds` milliseconds more for a refund; while `away`, a give-back
/// fails without reaching it (never sent).
#[derive(Clone, Default)]
struct Slow {
    inner: MemoryStore,
    delay: Arc<AtomicU64>,
    late: Arc<AtomicU64>,
    slow_refunds: Arc<AtomicU64>,
    slow_resets: Arc<AtomicU64>,
    away: Arc<std::sync::atomic::AtomicBool>,
}

impl Slow {
    fn new(inner: MemoryStore, delay_ms: u64) -> Self {
        Self {
            inner,
            delay: Arc::new(AtomicU64::new(delay_ms)),
            late: Arc::default(),
            slow_refunds: Arc::default(),
            slow_resets: Arc::default(),
            away: Arc::default(),
        }
    }

    fn delay(&self) -> Duration {
        Duration::from_millis(self.delay.load(Ordering::Relaxed))
    }

    /// What a give-back waits before it reaches the memory store: the
    /// delay, and the refunds' own; while away, the error of one never
    /// sent.
    async fn refund_waits(&self) -> Result<(), StoreError> {
        let slow = Duration::from_millis(self.slow_refunds.load(Ordering::Relaxed));
        tokio::time::sleep(self.delay() + slow).await;
        if self.away.load(Ordering::Relaxed) {
            let away = tower_quota::store::StoreErrorKind::Unavailable;
            return Err(StoreError::new(away, "away").unsent());
        }
        Ok(())
    }
}

impl Store for Slow {
    type ChargeFuture = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<ChargeOutcome, StoreError>> + Send>,
    >;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        let (inner, delay) = (self.inner.clone(), self.delay());
        let late = Duration::from_millis(self.late.load(Ordering::Relaxed));
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            let answer = inner.charge(request).await;
            tokio::time::sleep(late).await;
            answer
        })
    }
    async fn charge_taking(
        &self,
        request: ChargeRequest,
        extra: smallvec::SmallVec<[u64; 2]>,
    ) -> Result<(ChargeOutcome, Taken), StoreError> {
        let late = Duration::from_millis(self.late.load(Ordering::Relaxed));
        tokio::time::sleep(self.delay()).await;
        let answer = self.inner.charge_taking(request, extra).await;
        tokio::time::sleep(late).await;
        answer
    }
    async fn peek(&self, request: ChargeRequest) -> Result<Vec<Usage>, StoreError> {
        tokio::time::sleep(self.delay()).await;
        self.inner.peek(request).await
    }
    async fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        tokio::time::sleep(self.delay()).await;
        self.inner.refund(now, key, amount).await
    }
    async fn refund_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.refund_waits().await?;
        self.inner.refund_made_by(now, key, amount, made_by).await
    }
    async fn refund_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.refund_waits().await?;
        self.inner
            .refund_made_at(now, key, amount, first_call)
            .await
    }
    async fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        tokio::time::sleep(self.delay()).await;
        self.inner.add(now, key, amount).await
    }
    async fn reset(&self, key: PeriodKey) -> Result<bool, StoreError> {
        let slow = Duration::from_millis(self.slow_resets.load(Ordering::Relaxed));
        tokio::time::sleep(self.delay() + slow).await;
        self.inner.reset(key).await
    }
}

fn t0() -> Timestamp {
    "2026-12-04T10:00:00Z".parse().unwrap()
}

fn day_key() -> PeriodKey {
    key_of("acme")
}

/// The key of `subject`'s counter for the test's day.
fn key_of(subject: &str) -> PeriodKey {
    PeriodKey::from_string(format!("quota:{{account:{subject}}}:default:2026-12-04"))
}

/// A line of `subject`'s counter for the test's day, costing one.
fn line_of(subject: &str, limit: u64) -> ChargeLine {
    ChargeLine {
        key: key_of(subject),
        limit,
        cost: 1,
        lifetime: day(),
        shadow_limit: None,
    }
}

fn day() -> Lifetime {
    Lifetime::Calendar {
        start: "2026-12-04T00:00:00Z".parse().unwrap(),
        end: "2026-12-05T00:00:00Z".parse().unwrap(),
    }
}

/// A charge of `lines` at `now`.
fn charge_at(now: Timestamp, lines: smallvec::SmallVec<[ChargeLine; 2]>) -> ChargeRequest {
    ChargeRequest {
        charged_at: None,
        now,
        lines,
    }
}

fn request(now: Timestamp, limit: u64) -> ChargeRequest {
    ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![line_of("acme", limit)],
    }
}

/// What the store counts on the day's counter at `now`.
async fn counted<St: Store>(store: &St, now: Timestamp) -> u64 {
    counted_for(store, "acme", now).await
}

/// What the store counts on `subject`'s counter of the day at `now`.
async fn counted_for<St: Store>(store: &St, subject: &str, now: Timestamp) -> u64 {
    let lines = smallvec::smallvec![line_of(subject, u64::MAX)];
    store.peek(charge_at(now, lines)).await.unwrap()[0].used
}

/// One request at `now` on `leased`.
async fn call<St: Store>(leased: &St, now: Timestamp, limit: u64) -> ChargeOutcome {
    leased.charge(request(now, limit)).await.unwrap()
}

/// `n` requests on `leased`, each admitted, `every_ms` apart (on the
/// runtime's time and on `now`).
async fn busy<St: Store>(leased: &St, now: &mut Timestamp, n: u64, limit: u64, every_ms: u64) {
    for _ in 0..n {
        assert!(call(leased, *now, limit).await.admitted);
        tokio::time::advance(Duration::from_millis(every_ms)).await;
        *now += SignedDuration::from_millis(every_ms as i64);
    }
}

#[tokio::test(start_paused = true)]
async fn a_subject_that_calls_once_in_a_while_takes_no_block() {
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    for _ in 0..5 {
        assert!(call(&leased, now, 100).await.admitted);
        tokio::time::advance(Duration::from_secs(2)).await;
        now += SignedDuration::from_secs(2);
    }
    assert_eq!(leased.held(), 0);
    assert_eq!(inner.charges.load(Ordering::Relaxed), 5, "one charge each");
    assert_eq!(counted(&inner, now).await, 5);
}

#[tokio::test(start_paused = true)]
async fn a_busy_subject_spends_blocks_locally_and_the_store_counts_every_admission() {
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    for i in 0..1_000u64 {
        let outcome = call(&leased, now, 100_000).await;
        assert!(outcome.admitted);
        assert_eq!(
            outcome.usage[0].used,
            i + 1,
            "the usage told counts what was served"
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
    }
    let charges = inner.charges.load(Ordering::Relaxed);
    assert!(charges <= 30, "{charges} charges for 1 000 requests");
    // The store counts what was served and what this instance holds.
    assert_eq!(counted(&inner, now).await, 1_000 + leased.held());
    assert!(leased.held() > 0);
    // Idle: the units go back.
    tokio::time::advance(Duration::from_millis(1_300)).await;
    tokio::task::yield_now().await;
    assert_eq!(leased.held(), 0);
    now += SignedDuration::from_millis(1_300);
    assert_eq!(counted(&inner, now).await, 1_000);
}

/// A leased store waits up to 25 ms for units on their way back before it
/// answers a refusal: a policy whose `store_timeout` is no longer would turn
/// each such wait into a failure (a 503, or under fail open an admission
/// past the limit), and is refused when it is built.
#[test]
fn a_store_timeout_within_the_leased_wait_is_refused_when_the_policy_is_built() {
    let policy = |ms: u64| {
        tower_quota::QuotaPolicy::builder(tower_quota::FromHeader::account("x-account-id"))
            .store(LeasedStore::new(MemoryStore::new()))
            .store_timeout(Some(Duration::from_millis(ms)))
            .build()
    };
    let _ = policy(26);
    let refused = std::panic::catch_unwind(|| policy(25)).expect_err("refused");
    let message = refused.downcast_ref::<String>().expect("a message");
    assert!(
        message.contains("must be longer than the 25ms"),
        "{message}"
    );
}

/// A request refused while a block of its counter is on its way here, which
/// costs more than that block, is served once the block lands: from the
/// block, and the rest from the store's room, as it would be without leases.
#[tokio::test(start_paused = true)]
async fn a_request_costing_more_than_the_block_on_its_way_is_served_from_it_and_the_store() {
    let slow = Slow::default();
    let a = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&a, &mut now, 40, 100, 1).await;
    let served = 40 + spend_what_is_held(&a, now, 100).await;
    assert_eq!(counted(&slow.inner, now).await, served);
    let left = 100 - served;
    slow.delay.store(5, Ordering::Relaxed);
    slow.late.store(10, Ordering::Relaxed);
    let a0 = a.clone();
    let r0 = tokio::spawn(async move { call(&a0, now, 100).await });
    tokio::task::yield_now().await;
    slow.late.store(0, Ordering::Relaxed);
    tokio::time::advance(Duration::from_millis(1)).await;
    let mut big = request(now, 100);
    big.lines[0].cost = left - 1;
    let r1 = a.charge(big).await.unwrap();
    let r0 = r0.await.unwrap();
    assert!(r0.admitted);
    assert!(
        r1.admitted,
        "room for it: the block here and the store's rest"
    );
    assert_eq!(
        counted(&slow.inner, now).await - a.held(),
        100,
        "every unit admitted, none more"
    );
}

/// Blocks follow the units a subject spends, not its requests: a subject
/// whose requests cost 10 units each is served from blocks as one whose
/// requests cost 1, and the store counts every unit.
#[tokio::test(start_paused = true)]
async fn costly_requests_are_served_from_blocks_too() {
    for cost in [1u64, 10] {
        let inner = Counting::default();
        let leased = LeasedStore::new(inner.clone());
        let mut now = t0();
        for _ in 0..1_000 {
            let mut costly = request(now, 100_000_000);
            costly.lines[0].cost = cost;
            assert!(leased.charge(costly).await.unwrap().admitted);
            tokio::time::advance(Duration::from_millis(1)).await;
            now += SignedDuration::from_millis(1);
        }
        let charges = inner.charges.load(Ordering::Relaxed);
        assert!(
            charges <= 20,
            "cost {cost}: {charges} store charges for 1000 requests"
        );
        leased.shutdown().await;
        assert_eq!(counted(&inner.inner, now).await, 1_000 * cost);
    }
}

#[tokio::test(start_paused = true)]
async fn a_busy_subjects_next_block_is_taken_when_its_block_runs_out() {
    // 20 requests a second: the next request comes 50 ms after the one
    // that spends a block's last unit, long after the next block was taken
    // in the background (10 ms later).
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    let mut served = 0;
    let mut prefetched = 0;
    for _ in 0..400 {
        let before = inner.charges.load(Ordering::Relaxed);
        assert!(call(&leased, now, 100_000).await.admitted);
        served += 1;
        let ran_out = leased.held() == 0 && inner.charges.load(Ordering::Relaxed) == before;
        background_takes_its_blocks().await;
        if ran_out && leased.held() > 0 {
            prefetched += 1;
            assert_eq!(
                inner.charges.load(Ordering::Relaxed),
                before + 1,
                "one charge, no request"
            );
        }
        // Every admission is counted, and so is what this instance holds.
        assert_eq!(counted(&inner, now).await, served + leased.held());
        tokio::time::advance(Duration::from_millis(30)).await;
        now += SignedDuration::from_millis(50);
    }
    assert!(
        prefetched >= 2,
        "{prefetched} blocks taken in the background"
    );
    // 400 requests, nearly all of them answered here.
    let charges = inner.charges.load(Ordering::Relaxed);
    assert!(charges <= 20, "{charges} charges for 400 requests");
}

/// Lets the next blocks queued in the background be taken: the task that
/// takes them starts, its wait (10 ms) passes, and their charges land.
async fn background_takes_its_blocks() {
    tokio::task::yield_now().await;
    tokio::time::advance(Duration::from_millis(20)).await;
    for _ in 0..4 {
        tokio::task::yield_now().await;
    }
}

/// Requests of "acme" at `now` on `leased`, each admitted, until it holds
/// no unit any more; how many were served.
async fn spend_what_is_held<St: Store>(
    leased: &LeasedStore<St>,
    now: Timestamp,
    limit: u64,
) -> u64 {
    let mut served = 0;
    while leased.held() > 0 {
        assert!(call(leased, now, limit).await.admitted);
        served += 1;
    }
    served
}

/// Requests of "acme" on `leased`, 50 ms apart, until a block that was
/// held ran out with one of them; how many were served.
async fn until_a_block_runs_out<St: Store>(leased: &LeasedStore<St>, now: &mut Timestamp) -> u64 {
    let mut served = 0;
    let mut held = false;
    loop {
        assert!(call(leased, *now, 100_000).await.admitted);
        served += 1;
        if held && leased.held() == 0 {
            return served;
        }
        held |= leased.held() > 0;
        tokio::time::advance(Duration::from_millis(50)).await;
        *now += SignedDuration::from_millis(50);
        assert!(served < 1_000, "no block ran out");
    }
}

#[tokio::test(start_paused = true)]
async fn a_shutdown_waits_for_a_next_block_on_its_way_and_gives_it_back() {
    let inner = Slow::new(MemoryStore::new(), 0);
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    let served = until_a_block_runs_out(&leased, &mut now).await;
    // The next block is taken 10 ms later; its answer comes 100 ms after
    // the store counted it.
    inner.late.store(100, Ordering::Relaxed);
    background_takes_its_blocks().await;
    assert!(
        counted(&inner, now).await > served,
        "the next block is counted in the store"
    );
    assert_eq!(leased.held(), 0, "and not here yet");
    // The server stopped: the shutdown waits for that block, and gives it
    // back before it returns.
    leased.shutdown().await;
    assert_eq!(counted(&inner, now).await, served);
}

#[tokio::test(start_paused = true)]
async fn a_reset_drops_a_next_block_not_taken_yet() {
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    until_a_block_runs_out(&leased, &mut now).await;
    let charges = inner.charges.load(Ordering::Relaxed);
    // A support reset through this store, before the next block is taken.
    assert!(leased.reset(key_of("acme")).await.unwrap());
    background_takes_its_blocks().await;
    assert_eq!(
        inner.charges.load(Ordering::Relaxed),
        charges,
        "no block taken"
    );
    assert_eq!(leased.held(), 0);
    assert_eq!(counted(&inner, now).await, 0);
    // The subject goes on, from a fresh counter (with a block again).
    assert!(call(&leased, now, 100_000).await.admitted);
    assert_eq!(counted(&inner, now).await, 1 + leased.held());
}

#[tokio::test(start_paused = true)]
async fn a_next_block_queued_before_a_reset_leaves_the_new_entrys_alone() {
    // Within the 10 ms a next block waits: a block runs out, a reset makes
    // the counter anew, and the new entry's first block runs out too. The
    // block queued for the old entry is not taken, and the new entry's is.
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    until_a_block_runs_out(&leased, &mut now).await;
    assert!(leased.reset(key_of("acme")).await.unwrap());
    // No time passes: the new entry's first block, spent to its end.
    let mut held = false;
    loop {
        assert!(call(&leased, now, 100_000).await.admitted);
        if held && leased.held() == 0 {
            break;
        }
        held |= leased.held() > 0;
        assert!(counted(&inner, now).await < 100, "no block ran out");
    }
    let served = counted(&inner, now).await;
    background_takes_its_blocks().await;
    assert!(leased.held() > 0, "the new entry's next block is taken");
    assert_eq!(counted(&inner, now).await, served + leased.held());
}

#[test]
fn a_runtime_stopped_with_a_next_block_queued_leaves_no_queue_behind() {
    let paused = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    };
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    // A block runs out, and the runtime stops before its next one is
    // taken: the task that would take it is dropped with the runtime.
    let before = paused().block_on(until_a_block_runs_out(&leased, &mut now));
    // On another runtime, the next block that runs out is taken in the
    // background again.
    paused().block_on(async {
        let served = before + until_a_block_runs_out(&leased, &mut now).await;
        assert_eq!(leased.held(), 0);
        background_takes_its_blocks().await;
        assert!(leased.held() > 0, "the next block is taken");
        assert_eq!(counted(&inner, now).await, served + leased.held());
    });
}

#[tokio::test(start_paused = true)]
async fn a_first_use_counter_takes_no_block_for_no_request() {
    // A charge made for no request could open a first-use period (were
    // the counter reset elsewhere): a first-use quota's next block comes
    // with the subject's next request, as without prefetching.
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    let line = |now: Timestamp| ChargeLine {
        key: PeriodKey::from_string("quota:{account:acme}:trial".into()),
        limit: 100_000,
        cost: 1,
        lifetime: Lifetime::FirstUse {
            deadline: now + SignedDuration::from_hours(24),
        },
        shadow_limit: None,
    };
    let mut held = false;
    let mut ran_out = 0;
    for _ in 0..400 {
        let request = ChargeRequest {
            charged_at: None,
            now,
            lines: smallvec::smallvec![line(now)],
        };
        let before = inner.charges.load(Ordering::Relaxed);
        assert!(leased.charge(request).await.unwrap().admitted);
        let local = inner.charges.load(Ordering::Relaxed) == before;
        if held && local && leased.held() == 0 {
            ran_out += 1;
            background_takes_its_blocks().await;
            assert_eq!(inner.charges.load(Ordering::Relaxed), before, "no charge");
        }
        held |= leased.held() > 0;
        tokio::time::advance(Duration::from_millis(50)).await;
        now += SignedDuration::from_millis(50);
    }
    assert!(ran_out >= 2, "{ran_out} blocks ran out");
}

#[tokio::test(start_paused = true)]
async fn a_request_that_comes_before_the_next_block_takes_it_itself() {
    // 1 000 requests a second: the request after the one that spent a
    // block's last unit comes 1 ms later, before the next block would be
    // taken in the background, and takes it with its own charge; none is
    // taken in the background then.
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    let mut served = 0;
    let mut held = false;
    let mut checked = 0;
    while checked < 3 {
        assert!(served < 5_000, "no block ran out");
        let before = inner.charges.load(Ordering::Relaxed);
        assert!(call(&leased, now, 100_000).await.admitted);
        served += 1;
        let ran_out = held && leased.held() == 0 && inner.charges.load(Ordering::Relaxed) == before;
        held |= leased.held() > 0;
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
        if !ran_out {
            continue;
        }
        // The next request, 1 ms later: one charge, with its block.
        assert!(call(&leased, now, 100_000).await.admitted);
        served += 1;
        assert_eq!(inner.charges.load(Ordering::Relaxed), before + 1);
        assert!(leased.held() > 0);
        // Nothing more once the background's time has come.
        background_takes_its_blocks().await;
        assert_eq!(inner.charges.load(Ordering::Relaxed), before + 1);
        assert_eq!(counted(&inner, now).await, served + leased.held());
        now += SignedDuration::from_millis(20);
        checked += 1;
    }
}

#[tokio::test(start_paused = true)]
async fn a_busy_subject_back_after_a_pause_takes_a_large_block_with_its_second_request() {
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    let mut largest = 0;
    for _ in 0..5 {
        busy(&leased, &mut now, 100, 1_000_000, 1).await;
        largest = largest.max(leased.held());
    }
    assert!(largest > 8);
    // A pause: the block goes back.
    tokio::time::advance(Duration::from_secs(5)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_secs(5);
    assert_eq!(leased.held(), 0);
    // Back: the first request goes alone (it may be the only one); the
    // second takes a block that grows from the last one's size, not from 8.
    let before = inner.charges.load(Ordering::Relaxed);
    assert!(call(&leased, now, 1_000_000).await.admitted);
    assert_eq!(leased.held(), 0);
    // Its second request, a while later (the rate read from it alone is
    // low), takes at least the last block's size.
    tokio::time::advance(Duration::from_millis(200)).await;
    now += SignedDuration::from_millis(200);
    busy(&leased, &mut now, 1, 1_000_000, 1).await;
    assert!(
        leased.held() >= largest / 2,
        "{} of {largest}",
        leased.held()
    );
    busy(&leased, &mut now, 99, 1_000_000, 1).await;
    // The two charges; the second joins the lease mark too, in the same
    // call.
    assert_eq!(inner.charges.load(Ordering::Relaxed) - before, 2);
    // A subject that became rare: one call per pause, never a block.
    for _ in 0..10 {
        tokio::time::advance(Duration::from_secs(5)).await;
        tokio::task::yield_now().await;
        now += SignedDuration::from_secs(5);
        assert!(call(&leased, now, 1_000_000).await.admitted);
        assert_eq!(leased.held(), 0);
    }
    assert_eq!(counted(&inner, now).await, 500 + 1 + 100 + 10);
}

#[tokio::test(start_paused = true)]
async fn a_rate_is_not_read_from_the_milliseconds_after_a_charge() {
    // Back from a pause, two requests 5 ms apart: the second takes a block
    // of about the last one's size, not one sized as if the subject called
    // every 5 ms.
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    let mut last = 0;
    for _ in 0..50 {
        busy(&leased, &mut now, 1, 1_000_000, 20).await;
        last = last.max(leased.held());
    }
    assert!(last > 8, "{last}");
    tokio::time::advance(Duration::from_secs(5)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_secs(5);
    assert_eq!(leased.held(), 0);
    busy(&leased, &mut now, 2, 1_000_000, 5).await;
    let held = leased.held();
    assert!(held > 0 && held <= last + 8, "{held} after {last}");
}

#[tokio::test(start_paused = true)]
async fn a_steady_subject_keeps_its_blocks_growing_past_the_idle_bound() {
    // 200 requests a second: a block lasts longer than the idle bound, and
    // the next one still follows the rate, up to the largest block.
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    let mut largest = 0;
    for _ in 0..6_000 {
        assert!(call(&leased, now, 1_000_000).await.admitted);
        largest = largest.max(leased.held());
        tokio::time::advance(Duration::from_millis(5)).await;
        now += SignedDuration::from_millis(5);
    }
    assert!(largest >= 999, "{largest}");
    // 30 s of requests: a handful of blocks (and of mark calls).
    let charges = inner.charges.load(Ordering::Relaxed);
    assert!(charges <= 20, "{charges} charges");
}

#[tokio::test(start_paused = true)]
async fn near_the_limit_every_request_is_a_charge_and_exactly_the_limit_is_admitted() {
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    let mut admitted = 0;
    for _ in 0..300 {
        if call(&leased, now, 200).await.admitted {
            admitted += 1;
        }
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
    }
    assert_eq!(admitted, 200);
    assert_eq!(leased.held(), 0, "nothing left to lease");
    assert_eq!(counted(&inner, now).await, 200);
}

#[tokio::test(start_paused = true)]
async fn another_instance_gets_the_units_once_the_holder_is_idle() {
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let b = LeasedStore::new(shared.clone());
    let mut now = t0();
    // A spends 70 of 100 at a good pace: it holds a block.
    busy(&a, &mut now, 70, 100, 1).await;
    let held = a.held();
    assert!(held > 0, "a block is held");
    // B gets what nobody holds, then is refused while A holds the rest.
    let mut b_admitted = 0;
    while call(&b, now, 100).await.admitted {
        b_admitted += 1;
    }
    assert_eq!(b_admitted, 30 - held);
    // B's own joining and leaving of the mark land (a store call each).
    tokio::task::yield_now().await;
    // The refusal says the units come back within A's idle bound.
    let refused = call(&b, now, 100).await;
    assert!(!refused.admitted);
    assert_eq!(
        refused.usage[0].held_elsewhere_until,
        Some(now + SignedDuration::from_secs(1))
    );
    // B took a block on the way, spent it, and left the mark once refused.
    tokio::task::yield_now().await;
    assert_eq!(holders(&shared, now).await, 1);
    // A goes idle: its units come back, and B spends them.
    tokio::time::advance(Duration::from_millis(1_300)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(1_300);
    assert_eq!(a.held(), 0);
    assert_eq!(holders(&shared, now).await, 0, "A left the mark");
    let mut more = 0;
    while call(&b, now, 100).await.admitted {
        more += 1;
    }
    assert_eq!(more, held);
    assert_eq!(counted(&shared, now).await, 100);
    // Spent for good: the refusal waits for the reset.
    let refused = call(&b, now, 100).await;
    assert!(!refused.admitted);
    assert_eq!(refused.usage[0].held_elsewhere_until, None);
}

/// A give-back of an idle block that never reaches the store (it is away
/// a moment) puts the block back with its instance, not charged in the
/// store for nobody: it goes back once the store is there again, or on a
/// shutdown.
#[tokio::test(start_paused = true)]
async fn an_idle_block_the_store_never_got_back_stays_until_it_does() {
    for shut_down in [false, true] {
        let shared = MemoryStore::new();
        let store = Slow::new(shared.clone(), 0);
        let away = Arc::clone(&store.away);
        let a = LeasedStore::new(store);
        let mut now = t0();
        busy(&a, &mut now, 70, 100, 1).await;
        let held = a.held();
        assert!(held > 0, "a block is held");
        assert_eq!(counted(&shared, now).await, 70 + held);
        away.store(true, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        now += SignedDuration::from_millis(1_300);
        assert_eq!(a.held(), held, "still here: the store never got it");
        assert_eq!(counted(&shared, now).await, 70 + held);
        assert_eq!(
            holders(&shared, now).await,
            1,
            "in the lease mark again: another instance tells a short wait"
        );
        away.store(false, Ordering::Relaxed);
        if shut_down {
            assert_eq!(a.shutdown().await, held);
        } else {
            tokio::time::sleep(Duration::from_millis(1_300)).await;
            now += SignedDuration::from_millis(1_300);
            assert_eq!(a.held(), 0);
        }
        assert_eq!(counted(&shared, now).await, 70, "what was served");
    }
}

/// A block whose give-back the store never got does not go back into its
/// entry once the store told a count since (which holds the block): the
/// count stays as the store tells it, never the block twice. The
/// give-back is sent again for as long as the store stays away (here
/// 20 s more, past the first pauses' 6 s): once it answers, the block
/// lands, and the store counts what was served.
#[tokio::test(start_paused = true)]
async fn a_block_never_given_back_is_not_put_back_past_a_newer_answer() {
    let (_a, shared, away, mut now, held) = a_block_sent_again().await;
    tokio::time::sleep(Duration::from_secs(20)).await;
    now += SignedDuration::from_secs(20);
    assert_eq!(counted(&shared, now).await, 71 + held, "still away");
    away.store(false, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(4)).await;
    now += SignedDuration::from_secs(4);
    assert_eq!(counted(&shared, now).await, 71, "what was served");
}

/// A shutdown waits for a give-back of a block let go of before, sent
/// again while the store is away: the store back, the block lands before
/// the shutdown ends.
#[tokio::test(start_paused = true)]
async fn a_shutdown_waits_for_a_block_being_sent_again() {
    let (a, shared, away, now, _) = a_block_sent_again().await;
    back_in(&away, Duration::from_secs(4));
    assert_eq!(a.shutdown().await, 0, "no block held");
    assert_eq!(counted(&shared, now).await, 71, "what was served");
}

/// A leased store whose store is away (see [`Slow::away`]); its store,
/// the switch, the instant, and the units of a block.
type Away = (
    LeasedStore<Slow>,
    MemoryStore,
    Arc<std::sync::atomic::AtomicBool>,
    Timestamp,
    u64,
);

/// A at 71 of 100 with its block given back while the store is away, the
/// entry changed since (a newer answer, which counts the block), so the
/// give-back is being sent again. Returns A, the store, A's store's
/// switch, the instant, and the units of the block.
async fn a_block_sent_again() -> Away {
    let shared = MemoryStore::new();
    let store = Slow::new(shared.clone(), 0);
    let away = Arc::clone(&store.away);
    let slow_refunds = Arc::clone(&store.slow_refunds);
    let a = LeasedStore::builder(store)
        .idle(Duration::from_secs(3))
        .build();
    let mut now = t0();
    busy(&a, &mut now, 70, 100, 1).await;
    let held = a.held();
    assert!(held > 0);
    away.store(true, Ordering::Relaxed);
    // The give-back takes a while to fail: a request meanwhile goes to the
    // store, whose answer counts the block.
    slow_refunds.store(1_000, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(6_300)).await;
    now += SignedDuration::from_millis(6_300);
    assert_eq!(a.held(), 0, "on its way back");
    let answer = call(&a, now, 100).await;
    assert!(answer.admitted);
    assert_eq!(
        answer.usage[0].used,
        71 + held,
        "the store's count, the block in it"
    );
    // The give-back failed; the next idle give-back is seconds away.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    now += SignedDuration::from_millis(1_200);
    assert_eq!(a.held(), 0, "not put back past the newer answer");
    slow_refunds.store(0, Ordering::Relaxed);
    (a, shared, away, now, held)
}

/// Sets `away` back to false once `after` has passed.
fn back_in(away: &Arc<std::sync::atomic::AtomicBool>, after: Duration) {
    let away = Arc::clone(away);
    tokio::spawn(async move {
        tokio::time::sleep(after).await;
        away.store(false, Ordering::Relaxed);
    });
}

/// A shutdown while the store is away sends its give-backs again until
/// the store is back, within the lease time: every unused unit lands.
#[tokio::test(start_paused = true)]
async fn a_shutdown_while_the_store_is_away_gives_every_unit_back_once_it_is_back() {
    let (a, shared, away, now, held) = holding_while_away(Duration::from_secs(10)).await;
    back_in(&away, Duration::from_secs(9));
    assert_eq!(a.shutdown().await, held);
    assert_eq!(counted(&shared, now).await, 100, "what was served");
}

/// A store away for longer than the lease time: the shutdown ends then,
/// the units it never got stay charged.
#[tokio::test(start_paused = true)]
async fn a_shutdown_waits_for_a_store_away_a_lease_time_at_most() {
    let (a, shared, _away, now, held) = holding_while_away(Duration::from_secs(5)).await;
    let started = tokio::time::Instant::now();
    assert_eq!(a.shutdown().await, 0);
    assert_eq!(started.elapsed(), Duration::from_secs(5));
    assert_eq!(counted(&shared, now).await, 100 + held, "left charged");
}

/// A, of `lease_time`, holding a block after 100 requests, and its store
/// away since. Returns A, the store, A's store's switch, the instant, and
/// the units held.
async fn holding_while_away(lease_time: Duration) -> Away {
    let shared = MemoryStore::new();
    let store = Slow::new(shared.clone(), 0);
    let away = Arc::clone(&store.away);
    let a = LeasedStore::builder(store).lease_time(lease_time).build();
    let mut now = t0();
    busy(&a, &mut now, 100, 10_000, 1).await;
    let held = a.held();
    assert!(held > 0);
    away.store(true, Ordering::Relaxed);
    (a, shared, away, now, held)
}

#[tokio::test(start_paused = true)]
async fn a_shadow_limit_sizes_blocks_as_an_enforced_one_does() {
    // A spends 70 of 100 at a good pace, then B calls: B's count is off by
    // the units A holds, as few near a shadow limit as near an enforced
    // one, so B tells the shadow quota passed no earlier than it would
    // refuse an enforced one.
    async fn run(shadow: bool) -> (u64, u64) {
        let shared = MemoryStore::new();
        let a = LeasedStore::new(shared.clone());
        let b = LeasedStore::new(shared.clone());
        let mut now = t0();
        let charge = |leased: &LeasedStore<MemoryStore>, now: Timestamp| {
            let mut request = request(now, 100);
            if shadow {
                request.lines[0].limit = u64::MAX;
                request.lines[0].shadow_limit = Some(100);
            }
            leased.charge(request)
        };
        for _ in 0..70 {
            assert!(charge(&a, now).await.unwrap().admitted);
            tokio::time::advance(Duration::from_millis(1)).await;
            now += SignedDuration::from_millis(1);
        }
        let mut within = 0;
        loop {
            let outcome = charge(&b, now).await.unwrap();
            if !outcome.admitted || outcome.usage[0].used > 100 {
                break;
            }
            within += 1;
        }
        (a.held(), within)
    }
    let (held, within) = run(false).await;
    assert!(held > 0, "a block is held");
    assert_eq!(within, 30 - held);
    assert_eq!(run(true).await, (held, within));
}

/// Two instances on a limit of 100: A spends 70 and holds a block, B
/// spends the rest; then A goes idle, and its block is on its way back,
/// taking `slow_ms` to land. Returns A, the store, the instant, and what
/// was served.
async fn a_block_on_its_way_back(slow_ms: u64) -> (LeasedStore<Slow>, MemoryStore, Timestamp, u64) {
    let shared = MemoryStore::new();
    let slow = Slow::new(shared.clone(), 0);
    let a = LeasedStore::new(slow.clone());
    let b = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&a, &mut now, 70, 100, 1).await;
    let held = a.held();
    assert!(held > 0, "a block is held");
    let mut served = 70;
    while call(&b, now, 100).await.admitted {
        served += 1;
    }
    assert_eq!(served, 100 - held);
    slow.slow_refunds.store(slow_ms, Ordering::Relaxed);
    tokio::time::advance(Duration::from_millis(1_250)).await;
    for _ in 0..5 {
        tokio::task::yield_now().await;
    }
    now += SignedDuration::from_millis(1_250);
    assert_eq!(a.held(), 0, "the block is on its way back");
    assert_eq!(counted(&shared, now).await, 100, "not landed yet");
    (a, shared, now, served)
}

#[tokio::test(start_paused = true)]
async fn a_request_refused_while_its_instances_units_are_on_their_way_back_waits_for_them() {
    // The store refuses A's next request, counting the units on their way:
    // it waits for them, and is sent again.
    let (a, shared, mut now, mut served) = a_block_on_its_way_back(10).await;
    let outcome = call(&a, now, 100).await;
    assert!(outcome.admitted, "{outcome:?}");
    served += 1;
    assert_eq!(outcome.usage[0].used, served);
    tokio::time::advance(Duration::from_millis(1_300)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(1_300);
    assert_eq!(counted(&shared, now).await, served);
}

#[tokio::test(start_paused = true)]
async fn a_refusal_waits_for_units_on_their_way_back_a_bounded_time() {
    // Units that take longer to land than the wait: refused once waited,
    // not sent again.
    let (a, _, now, _) = a_block_on_its_way_back(200).await;
    let sent = tokio::time::Instant::now();
    let outcome = call(&a, now, 100).await;
    let waited = sent.elapsed();
    assert!(!outcome.admitted);
    assert!(
        waited >= Duration::from_millis(25) && waited < Duration::from_millis(50),
        "{waited:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn requests_refused_while_a_block_is_on_its_way_here_are_served_from_it() {
    // Near the limit, A's block runs out and a burst comes: the first
    // request takes the next block, those after it are charged alone
    // meanwhile, and the store, counting the block, refuses the last ones.
    // Without leases exactly the rest of the limit would be admitted: so
    // it is, the last ones served from the block once it landed.
    let slow = Slow::default();
    let a = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&a, &mut now, 40, 100, 1).await;
    let mut served = 40 + spend_what_is_held(&a, now, 100).await;
    // The first takes the block, answered 10 ms after the store applied
    // it; the others are answered at once, refused before it landed.
    slow.delay.store(5, Ordering::Relaxed);
    slow.late.store(10, Ordering::Relaxed);
    let spawn = || {
        let a = a.clone();
        tokio::spawn(async move { call(&a, now, 100).await })
    };
    let mut burst = vec![spawn()];
    tokio::task::yield_now().await;
    slow.late.store(0, Ordering::Relaxed);
    burst.extend((1..(100 - served + 5)).map(|_| spawn()));
    for request in burst {
        if request.await.unwrap().admitted {
            served += 1;
        }
    }
    assert_eq!(served, 100);
    tokio::time::advance(Duration::from_millis(1_300)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(1_300);
    assert_eq!(a.held(), 0);
    assert_eq!(counted(&slow.inner, now).await, 100);
}

#[tokio::test(start_paused = true)]
async fn a_lower_limit_is_never_passed_by_units_taken_under_a_higher_one() {
    // Two instances busy on a plan of 1 000; the caller moves to a plan of
    // 45. Without leases, exactly 45 would be admitted in all.
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let b = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&a, &mut now, 20, 1_000, 1).await;
    busy(&b, &mut now, 20, 1_000, 1).await;
    assert!(a.held() > 0 && b.held() > 0, "both hold a block");
    let mut admitted = 40;
    for _ in 0..50 {
        for leased in [&a, &b] {
            if call(leased, now, 45).await.admitted {
                admitted += 1;
            }
        }
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
    }
    assert!(
        admitted <= 45,
        "{admitted} admitted, none past the new limit"
    );
    // Once every block went back, the rest is admitted, and no more.
    tokio::time::advance(Duration::from_millis(1_300)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(1_300);
    while call(&a, now, 45).await.admitted {
        admitted += 1;
    }
    assert_eq!(admitted, 45);
    tokio::time::advance(Duration::from_millis(1_300)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(1_300);
    assert_eq!(counted(&shared, now).await, 45);
}

#[tokio::test(start_paused = true)]
async fn a_block_taken_under_a_higher_limit_is_back_before_a_lower_limits_charge() {
    // One instance busy on a plan of 1 000, holding a block; the caller
    // moves to a lower plan, with room for the block still. The block goes
    // back before the charge: the store counts what was served, and says
    // so (not the units nobody spent).
    let inner = MemoryStore::new();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    busy(&leased, &mut now, 40, 1_000, 1).await;
    let held = leased.held();
    assert!(held > 0, "a block is held");
    let outcome = call(&leased, now, 50 + held).await;
    assert!(outcome.admitted);
    assert_eq!(outcome.usage[0].used, 41, "what was served, no unit held");
}

/// How many instances the lease mark of the day's counter counts at `now`.
async fn holders<St: Store>(store: &St, now: Timestamp) -> u64 {
    let mark = ChargeLine {
        key: PeriodKey::from_string("quota:{account:acme}:default%held:2026-12-04".into()),
        limit: u64::MAX,
        cost: 0,
        lifetime: Lifetime::FirstUse {
            deadline: now + SignedDuration::from_secs(10),
        },
        shadow_limit: None,
    };
    let request = ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![mark],
    };
    store.peek(request).await.unwrap()[0].used
}

#[tokio::test(start_paused = true)]
async fn a_refusal_takes_one_round_trip_however_the_marks_stand() {
    // Reading the marks rides on the charge, and joining or leaving one is
    // never waited for: a refusal is as quick as without leases, so no
    // store time budget turns it into a failure (or, failing open, into an
    // admission).
    let delay = Duration::from_millis(60);
    let shared = MemoryStore::new();
    let a = LeasedStore::new(Slow::new(shared.clone(), 60));
    let b = LeasedStore::new(Slow::new(shared.clone(), 60));
    let mut now = t0();
    busy(&a, &mut now, 70, 100, 1).await;
    assert!(a.held() > 0);
    let mut slowest = Duration::ZERO;
    loop {
        let started = tokio::time::Instant::now();
        let outcome = call(&b, now, 100).await;
        slowest = slowest.max(started.elapsed());
        if !outcome.admitted {
            break;
        }
    }
    for _ in 0..5 {
        let started = tokio::time::Instant::now();
        assert!(!call(&b, now, 100).await.admitted);
        slowest = slowest.max(started.elapsed());
    }
    assert!(slowest < delay * 2, "{slowest:?}");
    // Once B's own part in the mark landed, its refusals tell the wait.
    tokio::time::advance(delay * 3).await;
    tokio::task::yield_now().await;
    let refused = call(&b, now, 100).await;
    assert!(!refused.admitted);
    assert!(refused.usage[0].held_elsewhere_until.is_some());
}

/// A request whose block no longer fits (other instances spent meanwhile)
/// but which fits itself is served in one round trip, with part of what
/// is left as its block: never refused and sent again, which a slow
/// store's timeout would turn into a failure; nor holding all that is left,
/// which other instances would be refused for.
#[tokio::test(start_paused = true)]
async fn a_request_whose_block_no_longer_fits_is_served_in_one_round_trip() {
    let delay = Duration::from_millis(60);
    let shared = MemoryStore::new();
    let slow = Slow::new(shared.clone(), 0);
    let a = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&a, &mut now, 200, 1_000, 1).await;
    assert!(a.held() > 0, "a busy subject holds a block");
    // Another instance spends all but 10 of what nobody holds.
    while counted(&shared, now).await < 990 {
        assert!(call(&shared, now, 1_000).await.admitted);
    }
    slow.delay
        .store(delay.as_millis() as u64, Ordering::Relaxed);
    let mut served = 0;
    let mut slowest = Duration::ZERO;
    loop {
        let started = tokio::time::Instant::now();
        let outcome = call(&a, now, 1_000).await;
        let took = started.elapsed();
        slowest = slowest.max(took);
        if !outcome.admitted {
            break;
        }
        if took >= delay {
            // Asked the store: a block of at most a quarter of what is left.
            assert!(a.held() <= 3, "{} held", a.held());
        }
        served += 1;
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
    }
    assert!(slowest < delay * 2, "a request took {slowest:?}");
    a.shutdown().await;
    assert_eq!(counted(&shared, now).await, 1_000, "{served} served here");
}

#[tokio::test(start_paused = true)]
async fn the_mark_of_an_instance_that_died_ends_with_its_lease_time() {
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let b = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&a, &mut now, 70, 100, 1).await;
    let held = a.held();
    assert!(held > 0);
    // A dies: no shutdown, no give-back.
    drop(a);
    while call(&b, now, 100).await.admitted {}
    tokio::task::yield_now().await;
    let refused = call(&b, now, 100).await;
    assert!(refused.usage[0].held_elsewhere_until.is_some());
    // Past the lease time the mark is gone: A's units stay charged (the
    // documented bound), and refusals wait for the reset.
    tokio::time::advance(Duration::from_secs(11)).await;
    now += SignedDuration::from_secs(11);
    let refused = call(&b, now, 100).await;
    assert!(!refused.admitted);
    assert_eq!(refused.usage[0].held_elsewhere_until, None);
    assert_eq!(refused.usage[0].used, 100);
    assert_eq!(holders(&shared, now).await, 0);
}

#[tokio::test(start_paused = true)]
async fn an_instance_counts_once_in_the_mark_and_leaves_it_when_it_holds_nothing() {
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let b = LeasedStore::new(shared.clone());
    let mut now = t0();
    // Many blocks in a row: still one holder.
    busy(&a, &mut now, 2_000, 1_000_000, 1).await;
    assert_eq!(holders(&shared, now).await, 1);
    busy(&b, &mut now, 50, 1_000_000, 1).await;
    assert_eq!(holders(&shared, now).await, 2);
    assert!(b.shutdown().await > 0);
    assert_eq!(holders(&shared, now).await, 1);
    assert!(a.shutdown().await > 0);
    assert_eq!(holders(&shared, now).await, 0);
    // C spends its blocks to the end near the limit: it leaves the mark
    // with the first charge that takes no new block.
    let c = LeasedStore::new(shared.clone());
    let used = counted(&shared, now).await;
    busy(&c, &mut now, 200, used + 200, 1).await;
    assert_eq!(c.held(), 0);
    tokio::task::yield_now().await;
    assert_eq!(holders(&shared, now).await, 0);
}

#[tokio::test(start_paused = true)]
async fn a_block_taken_while_leaving_the_mark_joins_it_again_once_left() {
    // A holds a block, goes idle: the block goes back, then A leaves the
    // mark, slowly. Its subject is back meanwhile, and A takes a block
    // again: A is a holder once its leaving landed, as other instances'
    // refusals should tell.
    let slow = Slow::default();
    let shared = slow.inner.clone();
    let a = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&a, &mut now, 50, 1_000_000, 1).await;
    assert_eq!(holders(&shared, now).await, 1);
    slow.delay.store(30, Ordering::Relaxed);
    tokio::time::advance(Duration::from_millis(1_250)).await;
    for _ in 0..5 {
        tokio::task::yield_now().await;
    }
    // The block lands back; the leaving is sent.
    tokio::time::advance(Duration::from_millis(30)).await;
    for _ in 0..5 {
        tokio::task::yield_now().await;
    }
    now += SignedDuration::from_millis(1_280);
    assert_eq!(a.held(), 0);
    assert_eq!(holders(&shared, now).await, 1, "the leaving is on its way");
    slow.delay.store(0, Ordering::Relaxed);
    busy(&a, &mut now, 5, 1_000_000, 1).await;
    assert!(a.held() > 0, "a block again");
    // The leaving lands.
    tokio::time::advance(Duration::from_millis(30)).await;
    for _ in 0..5 {
        tokio::task::yield_now().await;
    }
    now += SignedDuration::from_millis(30);
    assert!(a.held() > 0);
    assert_eq!(holders(&shared, now).await, 1, "A holds a block");
}

#[tokio::test(start_paused = true)]
async fn a_block_charge_dropped_on_its_way_leaves_no_joining_hanging() {
    // A charge that takes a block joins the lease mark in the same call.
    // Dropped on its way, it may or may not have landed: the instance takes
    // the mark to count it for a lease time, then joins again with its
    // next block.
    let shared = MemoryStore::new();
    let slow = Slow::new(shared.clone(), 0);
    let a = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&a, &mut now, 100, 1_000_000, 1).await;
    assert!(a.held() > 0);
    assert_eq!(holders(&shared, now).await, 1);
    // Idle: the block goes back, and A leaves the mark.
    tokio::time::advance(Duration::from_secs(2)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_secs(2);
    assert_eq!(a.held(), 0);
    assert_eq!(holders(&shared, now).await, 0);
    // Back, on a slow store: the first request alone, then one that takes
    // a block and joins, dropped before the store answers.
    slow.delay.store(60, Ordering::Relaxed);
    assert!(call(&a, now, 1_000_000).await.admitted);
    let dropped =
        tokio::time::timeout(Duration::from_millis(10), a.charge(request(now, 1_000_000))).await;
    assert!(dropped.is_err(), "the store answers in 60 ms");
    assert_eq!(holders(&shared, now).await, 0);
    // Past a lease time, with a quick store again: A takes blocks and is
    // counted in the mark once more.
    slow.delay.store(0, Ordering::Relaxed);
    tokio::time::advance(Duration::from_secs(11)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_secs(11);
    busy(&a, &mut now, 100, 1_000_000, 1).await;
    assert!(a.held() > 0);
    assert_eq!(holders(&shared, now).await, 1);
    a.shutdown().await;
    assert_eq!(counted(&shared, now).await, 100 + 1 + 100);
}

#[tokio::test(start_paused = true)]
async fn a_mark_joined_by_a_charge_that_lands_after_shutdown_is_left() {
    // A block's charge joins the lease mark; the store shuts down while it
    // is on its way. The block goes straight back when it lands, and so
    // does this instance's part in the mark: no holder is left marked.
    let shared = MemoryStore::new();
    let slow = Slow::new(shared.clone(), 0);
    let a = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&a, &mut now, 100, 1_000_000, 1).await;
    tokio::time::advance(Duration::from_secs(2)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_secs(2);
    assert_eq!(holders(&shared, now).await, 0);
    // Back: the first request alone, the second takes a block and joins.
    slow.delay.store(60, Ordering::Relaxed);
    assert!(call(&a, now, 1_000_000).await.admitted);
    let charging = tokio::spawn({
        let a = a.clone();
        async move { a.charge(request(now, 1_000_000)).await }
    });
    tokio::time::advance(Duration::from_millis(10)).await;
    tokio::task::yield_now().await;
    a.shutdown().await;
    assert!(charging.await.unwrap().unwrap().admitted);
    tokio::time::advance(Duration::from_millis(500)).await;
    tokio::task::yield_now().await;
    assert_eq!(holders(&shared, now).await, 0);
    assert_eq!(counted(&shared, now).await, 100 + 2);
}

#[tokio::test(start_paused = true)]
async fn shutdown_gives_every_unused_unit_back() {
    let shared = MemoryStore::new();
    let leased = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&leased, &mut now, 100, 10_000, 1).await;
    let held = leased.held();
    assert!(held > 0);
    assert_eq!(leased.shutdown().await, held);
    assert_eq!(counted(&shared, now).await, 100);
    // After shutdown, requests are charged one by one.
    busy(&leased, &mut now, 10, 10_000, 1).await;
    assert_eq!(leased.held(), 0);
    assert_eq!(counted(&shared, now).await, 110);
}

#[tokio::test(start_paused = true)]
async fn a_block_is_not_spent_past_the_lease_time() {
    let shared = MemoryStore::new();
    let leased = LeasedStore::builder(shared.clone())
        .lease_time(Duration::from_millis(500))
        .idle(Duration::from_secs(10))
        .max_block(20)
        .build();
    let mut now = t0();
    busy(&leased, &mut now, 3_000, 1_000_000, 1).await;
    assert!(leased.held() > 0, "a block is held at the reset");
    // A support reset elsewhere, and the lease time passes: the block
    // taken before the reset is given back (to no counter: a give-back
    // creates none), never spent.
    shared.reset(day_key()).await.unwrap();
    tokio::time::advance(Duration::from_millis(600)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(600);
    // From then on, every request is counted on the new counter.
    busy(&leased, &mut now, 300, 1_000_000, 1).await;
    assert_eq!(counted(&shared, now).await, 300 + leased.held());
}

#[tokio::test(start_paused = true)]
async fn a_block_of_a_window_that_ended_is_dropped_not_given_back() {
    let shared = MemoryStore::new();
    let leased = LeasedStore::new(shared.clone());
    // The last second of the day.
    let mut now: Timestamp = "2026-12-04T23:59:59Z".parse().unwrap();
    busy(&leased, &mut now, 500, 10_000, 1).await;
    let held = leased.held();
    assert!(held > 0);
    // The window ends while the block is held, and the subject goes
    // quiet: the block is dropped, not given back.
    tokio::time::advance(Duration::from_secs(2)).await;
    tokio::task::yield_now().await;
    assert_eq!(leased.held(), 0, "the ended window's block is dropped");
    // Nothing was given back to the ended window's counter.
    let old = shared
        .peek(request("2026-12-04T23:59:59.9Z".parse().unwrap(), u64::MAX))
        .await
        .unwrap()[0]
        .used;
    assert_eq!(old, 500 + held);
}

/// A busy subject's blocks near the end of its window hold what it spends
/// until the end, at its rate: the window's counter, whose last block is
/// dropped once it ends, counts what was served, not a block more.
#[tokio::test(start_paused = true)]
async fn a_block_taken_near_the_windows_end_holds_what_the_rest_of_it_spends() {
    let shared = MemoryStore::new();
    let leased = LeasedStore::new(shared.clone());
    // The last two seconds of the day, a request a millisecond, steady.
    let mut now: Timestamp = "2026-12-04T23:59:58Z".parse().unwrap();
    busy(&leased, &mut now, 2_000, 1_000_000, 1).await;
    let counted = counted_once_the_day_ended(&leased, &shared).await;
    // Each block rounds up to a whole unit, and the rate is read from
    // whole requests.
    assert!(
        (2_000..=2_010).contains(&counted),
        "{counted} counted for 2000 served"
    );
}

/// What the shared store counts for 2026-12-04 once that day ended (two
/// seconds from now) and the leased store dropped its block of it.
async fn counted_once_the_day_ended(
    leased: &LeasedStore<MemoryStore>,
    shared: &MemoryStore,
) -> u64 {
    tokio::time::advance(Duration::from_secs(2)).await;
    tokio::task::yield_now().await;
    assert_eq!(leased.held(), 0, "the ended window's block is dropped");
    shared
        .peek(request("2026-12-04T23:59:59.9Z".parse().unwrap(), u64::MAX))
        .await
        .unwrap()[0]
        .used
}

/// The layer's clock says when a window ends, and so how much a busy
/// subject spends before it does: near the end, its blocks are sized by
/// its rate on that clock, whatever the runtime's time does meanwhile (a
/// `ManualClock` a test moves, the runtime's time standing still).
#[tokio::test(start_paused = true)]
async fn a_block_near_the_windows_end_is_sized_on_the_layers_clock() {
    let shared = MemoryStore::new();
    let leased = LeasedStore::new(shared.clone());
    // The last two seconds of the day, a request a millisecond on the
    // layer's clock; the runtime's time does not move.
    let mut now: Timestamp = "2026-12-04T23:59:58Z".parse().unwrap();
    for _ in 0..2_000 {
        assert!(call(&leased, now, 1_000_000).await.admitted);
        tokio::task::yield_now().await;
        now += SignedDuration::from_millis(1);
    }
    let counted = counted_once_the_day_ended(&leased, &shared).await;
    assert!(
        (2_000..=2_010).contains(&counted),
        "{counted} counted for 2000 served"
    );
}

/// A layer's clock standing still (a `ManualClock` a test does not move)
/// a moment before a window's end, while the runtime's time moves: on
/// that clock the window does not end, and a busy subject keeps taking
/// blocks, not a store call per request.
#[tokio::test(start_paused = true)]
async fn a_clock_standing_still_before_the_windows_end_leaves_blocks_their_size() {
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let now: Timestamp = "2026-12-04T23:59:59.999Z".parse().unwrap();
    for _ in 0..2_000 {
        assert!(call(&leased, now, 1_000_000).await.admitted);
        tokio::time::advance(Duration::from_millis(1)).await;
    }
    let charges = inner.charges.load(Ordering::Relaxed);
    // Blocks growing by what the subject spent from the last one (a
    // millisecond left, read at the rate of a millisecond at least), not
    // a store call every other request.
    assert!(charges <= 100, "{charges} charges for 2 000 requests");
}

#[tokio::test(start_paused = true)]
async fn a_reset_through_the_leased_store_drops_its_block() {
    let shared = MemoryStore::new();
    let leased = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&leased, &mut now, 200, 10_000, 1).await;
    assert!(leased.held() > 0);
    assert!(leased.reset(day_key()).await.unwrap());
    assert_eq!(leased.held(), 0);
    let outcome = call(&leased, now, 10_000).await;
    assert_eq!(outcome.usage[0].used, 1, "a fresh count");
    assert_eq!(counted(&shared, now).await, 1 + leased.held());
}

/// A slow reset through an instance that does not know the subject yet
/// (or forgot it, idle), while the subject calls it: no block is taken
/// from the counter about to go, and every request served after the
/// delete is counted on the counter made since.
#[tokio::test(start_paused = true)]
async fn a_slow_reset_guards_a_counter_this_instance_meets_meanwhile() {
    for knows_it in [false, true] {
        let shared = MemoryStore::new();
        let slow = Slow::new(shared.clone(), 0);
        let a = LeasedStore::new(slow.clone());
        let mut now = t0();
        for _ in 0..100 {
            assert!(call(&shared, now, 10_000).await.admitted);
        }
        if knows_it {
            // A met the subject once, then forgets it: quiet past the
            // idle bound while the reset is on its way.
            assert!(call(&a, now, 10_000).await.admitted);
            slow.slow_resets.store(3_000, Ordering::Relaxed);
        } else {
            slow.slow_resets.store(300, Ordering::Relaxed);
        }
        let reset = tokio::spawn({
            let a = a.clone();
            async move { a.reset(day_key()).await }
        });
        tokio::task::yield_now().await;
        if knows_it {
            for _ in 0..150 {
                tokio::time::advance(Duration::from_millis(10)).await;
                tokio::task::yield_now().await;
            }
            now += SignedDuration::from_millis(1_500);
        }
        // The subject calls A while the delete is on its way.
        busy(&a, &mut now, 3, 10_000, 10).await;
        assert_eq!(a.held(), 0, "no block of the counter about to go");
        assert!(reset.await.unwrap().unwrap());
        busy(&a, &mut now, 20, 10_000, 10).await;
        a.shutdown().await;
        assert_eq!(
            counted(&shared, now).await,
            20,
            "served after the delete (knows it: {knows_it})"
        );
    }
}

/// A reset through the leased store that does not land (it fails, or its
/// caller stops waiting) leaves the counter, and the block it let go of
/// goes back to it: no unit stays charged that nothing served. One that
/// lands leaves nothing for the block to go back to.
#[tokio::test(start_paused = true)]
async fn a_reset_that_never_lands_gives_its_block_back() {
    let shared = MemoryStore::new();
    let slow = Slow::new(shared.clone(), 0);
    let a = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&a, &mut now, 200, 10_000, 1).await;
    assert!(a.held() > 0);
    slow.delay.store(500, Ordering::Relaxed);
    let dropped = tokio::time::timeout(Duration::from_millis(50), a.reset(day_key())).await;
    assert!(dropped.is_err(), "the reset's caller stopped waiting");
    assert_eq!(a.held(), 0);
    tokio::time::advance(Duration::from_secs(12)).await;
    for _ in 0..5 {
        tokio::task::yield_now().await;
    }
    now += SignedDuration::from_secs(12);
    assert_eq!(a.shutdown().await, 0);
    assert_eq!(counted(&shared, now).await, 200, "what was served, no more");
}

#[tokio::test(start_paused = true)]
async fn units_held_across_a_reset_made_elsewhere_never_go_back_to_the_new_counter() {
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&a, &mut now, 200, 10_000, 1).await;
    let held = a.held();
    assert!(held > 0);
    // Support resets the counter through another instance, and the
    // subject starts afresh there.
    tokio::time::advance(Duration::from_millis(10)).await;
    now += SignedDuration::from_millis(10);
    assert!(shared.reset(day_key()).await.unwrap());
    for _ in 0..5 {
        assert!(call(&shared, now, 10_000).await.admitted);
    }
    // A goes idle: what it held was taken from the counter that was
    // reset, and does not come off the new one.
    tokio::time::advance(Duration::from_millis(1_300)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(1_300);
    assert_eq!(a.held(), 0);
    assert_eq!(counted(&shared, now).await, 5);
}

/// After a reset made elsewhere, an instance whose clock is behind makes
/// the counter again with a first call before the old one's: the units
/// this instance held of the old counter, given back once it is idle, go
/// to that counter alone, and not off the new one, whose requests were
/// served.
#[tokio::test(start_paused = true)]
async fn units_held_across_a_reset_never_go_to_a_counter_made_since_by_a_clock_behind() {
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&a, &mut now, 200, 10_000, 1).await;
    let held = a.held();
    assert!(held > 0);
    assert!(shared.reset(day_key()).await.unwrap());
    for _ in 0..500 {
        let behind = now - SignedDuration::from_secs(2);
        assert!(call(&shared, behind, 10_000).await.admitted);
    }
    // A goes idle and gives its block back.
    tokio::time::advance(Duration::from_millis(1_500)).await;
    for _ in 0..5 {
        tokio::task::yield_now().await;
    }
    now += SignedDuration::from_millis(1_500);
    assert_eq!(a.held(), 0);
    assert_eq!(
        counted(&shared, now).await,
        500,
        "the {held} units held came off the new counter"
    );
}

/// A request served from a block taken before a reset made elsewhere was
/// charged when the block was taken, on the counter that was reset: its
/// answer says so (`counted_at`), and its give-back, which goes by that
/// instant, never comes off the counter made since, whatever this
/// instance has learned of it meanwhile.
#[tokio::test(start_paused = true)]
async fn a_request_served_from_a_block_taken_before_a_reset_is_never_refunded_to_the_new_counter() {
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&a, &mut now, 200, 10_000, 1).await;
    assert!(a.held() > 0);
    // Support resets the counter through another instance, and the
    // subject starts afresh there.
    let reset_at = now;
    assert!(shared.reset(day_key()).await.unwrap());
    tokio::time::advance(Duration::from_millis(1)).await;
    now += SignedDuration::from_millis(1);
    for _ in 0..5 {
        assert!(call(&shared, now, 10_000).await.admitted);
    }
    // A serves a request from its old block.
    tokio::time::advance(Duration::from_millis(5)).await;
    now += SignedDuration::from_millis(5);
    let served = call(&a, now, 10_000).await;
    assert!(served.admitted);
    let usage = served.usage[0];
    let counted_at = usage.counted_at.expect("served from a block");
    assert!(counted_at < reset_at, "charged when the block was taken");
    // What the layer gives back by (`Usage::made_by`): the earlier of the
    // two instants.
    let made_by = counted_at.min(now);
    // A goes idle (its old block is refused back), then charges once and
    // learns of the new counter.
    tokio::time::advance(Duration::from_millis(1_300)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(1_300);
    assert_eq!(a.held(), 0);
    assert!(call(&a, now, 10_000).await.admitted);
    assert_eq!(counted(&shared, now).await, 6);
    let refunded = a.refund_made_by(now, day_key(), 1, made_by).await.unwrap();
    assert_eq!(refunded, None, "the counter charged is gone");
    assert_eq!(a.shutdown().await, 0);
    assert_eq!(counted(&shared, now).await, 6);
}

/// A reset through the leased store gives its block back before it
/// deletes the counter: however slow the give-back, it never lands on a
/// counter made after the delete (one whose first call an earlier clock
/// dated before the block was taken).
#[tokio::test(start_paused = true)]
async fn a_resets_block_goes_back_before_the_delete() {
    let shared = MemoryStore::new();
    let slow = Slow::new(shared.clone(), 0);
    let a = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&a, &mut now, 200, 10_000, 1).await;
    assert!(a.held() > 0);
    slow.slow_refunds.store(50, Ordering::Relaxed);
    assert!(a.reset(day_key()).await.unwrap());
    // A new counter, made by requests whose clock reads the day's start.
    for _ in 0..20 {
        assert!(call(&shared, t0(), 10_000).await.admitted);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    now += SignedDuration::from_secs(1);
    assert_eq!(
        counted(&shared, now).await,
        20,
        "nothing came off the new counter"
    );
}

/// A request of two lines, one paid from a block taken before a reset
/// made elsewhere and one sent to the store: the line paid from the block
/// is told as counted when the block was taken, and its give-back never
/// comes off the counter made since.
#[tokio::test(start_paused = true)]
async fn a_line_paid_from_an_old_block_beside_one_the_store_charged_is_told_when_it_was_counted() {
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&a, &mut now, 200, 10_000, 1).await;
    assert!(a.held() > 0);
    let reset_at = now;
    assert!(shared.reset(day_key()).await.unwrap());
    tokio::time::advance(Duration::from_millis(1)).await;
    now += SignedDuration::from_millis(1);
    for _ in 0..5 {
        assert!(call(&shared, now, 10_000).await.admitted);
    }
    let both = ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![line_of("acme", 10_000), line_of("beta", 10_000)],
    };
    let outcome = a.charge(both).await.unwrap();
    assert!(outcome.admitted);
    let usage = outcome.usage[0];
    let counted_at = usage.counted_at.expect("paid from a block");
    assert!(counted_at < reset_at);
    assert_eq!(outcome.usage[1].counted_at, None, "charged by the store");
    let made_by = counted_at.min(now);
    let refunded = a.refund_made_by(now, day_key(), 1, made_by).await.unwrap();
    assert_eq!(refunded, None, "the counter charged is gone");
    assert_eq!(counted(&shared, now).await, 5);
}

/// A block kept across a reset made elsewhere goes with its counter once an
/// answer tells this instance that the counter is gone (here, to a line the
/// block paid, which costs the store nothing and makes no counter): a
/// request served from it before is given back by the block's instant, to
/// the counter gone, not to the one made since; the requests after are
/// charged on the new counter.
#[tokio::test(start_paused = true)]
async fn a_block_of_a_counter_reset_elsewhere_goes_once_an_answer_tells_it_is_gone() {
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&a, &mut now, 200, 10_000, 1).await;
    assert!(a.held() > 0);
    let reset_at = now;
    assert!(shared.reset(day_key()).await.unwrap());
    let both = |now| ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![line_of("acme", 10_000), line_of("beta", 10_000)],
    };
    tokio::time::advance(Duration::from_millis(1)).await;
    now += SignedDuration::from_millis(1);
    let outcome = a.charge(both(now)).await.unwrap();
    assert!(outcome.admitted);
    let counted_at = outcome.usage[0]
        .counted_at
        .expect("paid from the old block");
    assert!(counted_at < reset_at);
    assert_eq!(a.held(), 0, "the old block went with its counter");
    let refunded = a
        .refund_made_by(now, day_key(), 1, counted_at.min(now))
        .await
        .unwrap();
    assert_eq!(refunded, None, "the counter charged is gone");
    // The counter made anew elsewhere.
    for _ in 0..5 {
        assert!(call(&shared, now, 10_000).await.admitted);
    }
    tokio::time::advance(Duration::from_millis(1)).await;
    now += SignedDuration::from_millis(1);
    let served = call(&a, now, 10_000).await;
    assert!(served.admitted);
    assert!(served.usage[0].counted_at.is_none_or(|at| at >= reset_at));
    assert_eq!(counted(&shared, now).await - a.held(), 6);
}

/// A refund of a request charged before a reset lands neither in a block
/// of the counter made since nor on that counter.
#[tokio::test(start_paused = true)]
async fn a_late_answer_of_a_counter_reset_since_leaves_the_new_counters_block_alone() {
    // A request on A is applied to the day's counter and answered late.
    // Meanwhile the counter is reset elsewhere, and A's subject, busy,
    // takes a block of the counter made anew. The late answer, of the
    // counter gone, neither drops that block nor changes what A knows.
    let slow = Slow::default();
    let shared = slow.inner.clone();
    let a = LeasedStore::new(slow.clone());
    let mut now = t0();
    slow.late.store(50, Ordering::Relaxed);
    let late = tokio::spawn({
        let a = a.clone();
        async move { call(&a, now, 10_000).await }
    });
    tokio::task::yield_now().await;
    assert_eq!(counted(&shared, now).await, 1, "applied at once");
    slow.late.store(0, Ordering::Relaxed);
    tokio::time::advance(Duration::from_millis(5)).await;
    now += SignedDuration::from_millis(5);
    assert!(shared.reset(day_key()).await.unwrap());
    busy(&a, &mut now, 20, 10_000, 1).await;
    let held = a.held();
    assert!(held > 0, "a block of the new counter");
    assert!(late.await.unwrap().admitted);
    assert_eq!(a.held(), held, "the block is the new counter's");
    // Idle: every unit not served goes back to the new counter.
    tokio::time::advance(Duration::from_millis(1_300)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(1_300);
    assert_eq!(a.held(), 0);
    assert_eq!(counted(&shared, now).await, 20, "what was served since");
}

#[tokio::test(start_paused = true)]
async fn an_answer_sent_before_the_last_one_learned_never_moves_the_count_back() {
    // Two charges of one counter on their way from A: the first takes a
    // block and is applied first but answered late, after the second.
    let slow = Slow::default();
    let a = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&a, &mut now, 20, 10_000, 1).await;
    let mut served = 20 + spend_what_is_held(&a, now, 10_000).await;
    slow.late.store(50, Ordering::Relaxed);
    let late = tokio::spawn({
        let a = a.clone();
        async move { call(&a, now, 10_000).await }
    });
    tokio::task::yield_now().await;
    slow.late.store(0, Ordering::Relaxed);
    tokio::time::advance(Duration::from_millis(1)).await;
    now += SignedDuration::from_millis(1);
    assert!(call(&a, now, 10_000).await.admitted);
    assert!(late.await.unwrap().admitted);
    served += 2;
    assert!(a.held() > 0, "the first charge took a block");
    // The late answer's count is older than the second's: the block's
    // next request is told every one served.
    let next = call(&a, now, 10_000).await;
    assert!(next.admitted);
    served += 1;
    assert_eq!(next.usage[0].used, served);
    // A refund lands in the block, whole.
    a.refund(now, day_key(), 3).await.unwrap();
    served -= 3;
    tokio::time::advance(Duration::from_millis(1_300)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(1_300);
    assert_eq!(a.held(), 0);
    assert_eq!(counted(&slow.inner, now).await, served);
}

#[tokio::test(start_paused = true)]
async fn a_counter_made_anew_by_an_instance_whose_clock_is_behind_is_taken_up() {
    // A knows the day's counter, made at 10:00. It is reset elsewhere, and
    // made anew by an instance whose clock is 5 s behind: its first call
    // says 09:59:55, earlier than the counter it replaces.
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&a, &mut now, 20, 10_000, 1).await;
    assert!(shared.reset(day_key()).await.unwrap());
    assert!(
        call(&shared, now - SignedDuration::from_secs(5), 10_000)
            .await
            .admitted
    );
    let mut served = 1;
    // A spends what it held of the old counter, then charges the new one
    // and leases from it as from any.
    spend_what_is_held(&a, now, 10_000).await;
    for _ in 0..40 {
        let outcome = call(&a, now, 10_000).await;
        assert!(outcome.admitted);
        served += 1;
        assert_eq!(outcome.usage[0].used, served);
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
    }
    assert!(a.held() > 0, "a block of the new counter");
    tokio::time::advance(Duration::from_millis(1_300)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(1_300);
    assert_eq!(a.held(), 0);
    assert_eq!(counted(&shared, now).await, served);
}

#[tokio::test(start_paused = true)]
async fn a_refund_made_before_a_reset_never_lands_in_a_block_of_the_new_counter() {
    let shared = MemoryStore::new();
    let leased = LeasedStore::new(shared.clone());
    let mut now = t0();
    let charged = call(&leased, now, 10_000).await;
    assert!(charged.admitted);
    // What the layer gives back at: the first call the charge told.
    let first_call = charged.usage[0].first_call.expect("a dated counter");
    assert!(leased.reset(day_key()).await.unwrap());
    tokio::time::advance(Duration::from_millis(10)).await;
    now += SignedDuration::from_millis(10);
    busy(&leased, &mut now, 200, 10_000, 1).await;
    let held = leased.held();
    assert!(held > 0);
    let refunded = leased
        .refund_made_at(now, day_key(), 1, first_call)
        .await
        .unwrap();
    assert_eq!(refunded, None, "the counter charged is gone");
    assert_eq!(leased.held(), held);
    assert_eq!(leased.shutdown().await, held);
    assert_eq!(counted(&shared, now).await, 200);
}

/// A request's own give-back (what the layer gives back for a request this
/// instance served, at the counter's first call) goes into its block; a
/// support refund by a charge's instant goes to the store.
#[tokio::test(start_paused = true)]
async fn a_requests_refund_lands_in_the_block_and_goes_back_with_it() {
    let shared = MemoryStore::new();
    let leased = LeasedStore::new(shared.clone());
    let mut now = t0();
    let served_at = now;
    busy(&leased, &mut now, 200, 10_000, 1).await;
    let held = leased.held();
    let first_call = shared.peek(request(now, 10_000)).await.unwrap()[0]
        .first_call
        .expect("the memory store dates its counters");
    let refunded = leased
        .refund_made_at(now, day_key(), 5, first_call)
        .await
        .unwrap();
    assert_eq!(refunded, Some(195));
    assert_eq!(leased.held(), held + 5);
    let refunded = leased
        .refund_made_by(now, day_key(), 2, served_at)
        .await
        .unwrap();
    assert_eq!(refunded, Some(193));
    assert_eq!(leased.held(), held + 5, "a support refund is the store's");
    assert_eq!(leased.shutdown().await, held + 5);
    assert_eq!(counted(&shared, now).await, 193);
}

/// Serves 5 requests of the day on a leased instance, which takes a block,
/// lets another instance spend 500, then has `refund` give 300 back
/// through the leased instance: whatever part of it goes into the block,
/// the store counts the 505 served less the 300 refunded once the
/// instance shut down.
async fn refund_after_others_spent<F, R>(refund: F)
where
    F: FnOnce(LeasedStore<MemoryStore>, Timestamp, Timestamp) -> R,
    R: std::future::Future<Output = Result<Option<u64>, StoreError>>,
{
    const LIMIT: u64 = 1_000;
    let shared = MemoryStore::new();
    let leased = LeasedStore::new(shared.clone());
    let mut now = t0();
    let served_at = now;
    busy(&leased, &mut now, 5, LIMIT, 1).await;
    assert!(leased.held() > 0, "a block held");
    for _ in 0..500 {
        assert!(call(&shared, now, LIMIT).await.admitted);
    }
    refund(leased.clone(), now, served_at).await.unwrap();
    leased.shutdown().await;
    assert_eq!(counted(&shared, now).await, 205);
}

/// A support refund (any amount, of units any instance spent) goes to the
/// store: credited to this instance's block from what it last heard of
/// the count, it was cut to what this instance had seen spent, and the
/// rest was lost.
#[tokio::test(start_paused = true)]
async fn a_support_refund_goes_to_the_store_whatever_an_instance_holds() {
    refund_after_others_spent(
        |leased, now, _| async move { leased.refund(now, day_key(), 300).await },
    )
    .await;
}

/// A guarded refund of more than this instance heard was spent (support
/// undoing requests other instances served, through the handle) puts what
/// it can into the block and the rest in the store: none of it is lost.
#[tokio::test(start_paused = true)]
async fn a_guarded_refund_larger_than_the_block_takes_goes_on_to_the_store() {
    refund_after_others_spent(|leased, now, served_at| async move {
        leased.refund_made_by(now, day_key(), 300, served_at).await
    })
    .await;
}

/// A request's own refund larger than the block (a deferred cost's
/// estimate given back) fills the block up to what it held when taken, and
/// sends the rest to the store: a block never grows past its bound, which
/// is what an instance that dies leaves charged.
#[tokio::test(start_paused = true)]
async fn a_large_refund_of_a_request_never_grows_the_block_past_its_size() {
    let shared = MemoryStore::new();
    let leased = LeasedStore::builder(shared.clone()).max_block(10).build();
    let mut now = t0();
    busy(&leased, &mut now, 30, 100_000, 5).await;
    let mut costly = request(now, 100_000);
    costly.lines[0].cost = 500;
    let charged = leased.charge(costly).await.unwrap();
    assert!(charged.admitted);
    let first_call = charged.usage[0].first_call.unwrap();
    leased
        .refund_made_at(now, day_key(), 480, first_call)
        .await
        .unwrap();
    assert!(leased.held() <= 10, "{} units held", leased.held());
    // Dies without giving back: what stays charged beyond the 30 served
    // and the 20 kept of the costly one is its block at most.
    let counted = counted(&shared, now).await;
    drop(leased);
    assert!(counted <= 30 + 20 + 10, "counted {counted}");
}

/// The same while units of the block are set aside for a request on its
/// way (its other line asked of the store): refused there, they come back
/// into the block, which must still hold no more than it was taken with.
#[tokio::test(start_paused = true)]
async fn a_refund_while_units_are_set_aside_never_grows_the_block_past_its_size() {
    let shared = MemoryStore::new();
    let slow = Slow::new(shared.clone(), 0);
    let leased = LeasedStore::builder(slow.clone()).max_block(10).build();
    let mut now = t0();
    busy(&leased, &mut now, 200, 100_000, 1).await;
    let mut first = call(&leased, now, 100_000).await;
    for _ in 0..1000 {
        if leased.held() >= 8 {
            break;
        }
        first = call(&leased, now, 100_000).await;
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
    }
    let first_call = first.usage[0].first_call.expect("a dated counter");
    slow.delay.store(50, Ordering::Relaxed);
    // Two lines: acme's from the block (set aside), other's asked of the
    // (slow) store, where it is refused.
    let two = ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![line_of("acme", 100_000), line_of("other", 0)],
    };
    let pending = tokio::spawn({
        let leased = leased.clone();
        async move { leased.charge(two).await }
    });
    tokio::task::yield_now().await;
    tokio::time::advance(Duration::from_millis(1)).await;
    // A request's own refund (a deferred cost's estimate given back).
    leased
        .refund_made_at(now, day_key(), 100, first_call)
        .await
        .unwrap();
    let outcome = pending.await.unwrap().unwrap();
    assert!(!outcome.admitted, "refused on the other line");
    assert!(leased.held() <= 10, "{} units held", leased.held());
}

/// Units set aside for a request on its way (its other line asked of the
/// store) when a reset through this instance lets go of their entry, and
/// the reset never lands: refused, the request's units go back to the
/// counter that survived, as the block does. Nothing stays charged that
/// nothing served.
#[tokio::test(start_paused = true)]
async fn units_set_aside_across_a_reset_that_never_lands_go_back() {
    let shared = MemoryStore::new();
    let slow = Slow::new(shared.clone(), 0);
    let a = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&a, &mut now, 200, 100_000, 1).await;
    assert!(a.held() > 0);
    slow.delay.store(50, Ordering::Relaxed);
    // Two lines: acme's from the block (set aside), other's asked of the
    // (slow) store, where it is refused.
    let two = ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![line_of("acme", 100_000), line_of("other", 0)],
    };
    let pending = tokio::spawn({
        let a = a.clone();
        async move { a.charge(two).await }
    });
    tokio::task::yield_now().await;
    // A reset through A whose caller stops waiting before it lands.
    let dropped = tokio::time::timeout(Duration::from_millis(10), a.reset(day_key())).await;
    assert!(dropped.is_err());
    let outcome = pending.await.unwrap().unwrap();
    assert!(!outcome.admitted, "refused on the other line");
    tokio::time::sleep(Duration::from_secs(1)).await;
    now += SignedDuration::from_secs(1);
    assert_eq!(a.held(), 0);
    assert_eq!(counted(&shared, now).await, 200, "what was served, no more");
}

/// A store that dates no counter (no first calls told), and reads a
/// first-use counter's reset from its remaining life: a millisecond apart
/// from call to call.
#[derive(Clone, Default)]
struct Undated {
    inner: MemoryStore,
    calls: Arc<AtomicU64>,
}

impl Store for Undated {
    type ChargeFuture = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<ChargeOutcome, StoreError>> + Send>,
    >;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        let jitter = (self.calls.fetch_add(1, Ordering::Relaxed) % 2) as i64;
        let lifetimes: Vec<_> = request.lines.iter().map(|line| line.lifetime).collect();
        let charged = self.inner.charge(request);
        Box::pin(async move {
            let mut outcome = charged.await?;
            for (usage, lifetime) in outcome.usage.iter_mut().zip(lifetimes) {
                usage.first_call = None;
                if matches!(lifetime, Lifetime::FirstUse { .. }) {
                    usage.resets_at -= SignedDuration::from_millis(jitter);
                }
            }
            Ok(outcome)
        })
    }
    async fn peek(&self, request: ChargeRequest) -> Result<Vec<Usage>, StoreError> {
        self.inner.peek(request).await
    }
    async fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.refund(now, key, amount).await
    }
    async fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.add(now, key, amount).await
    }
    async fn reset(&self, key: PeriodKey) -> Result<bool, StoreError> {
        self.inner.reset(key).await
    }
}

/// On a store that dates no counter, an answer about a first-use counter
/// whose reset reads a millisecond off is of the same counter: the block
/// held stays (it was dropped, its units charged and never served).
#[tokio::test(start_paused = true)]
async fn an_undated_first_use_counter_keeps_its_block_through_jittered_answers() {
    let store = Undated::default();
    let leased = LeasedStore::new(store.clone());
    let start = t0();
    let hour = ChargeLine {
        key: PeriodKey::from_string("quota:{account:acme}:hour:PT1H".to_owned()),
        limit: 10_000,
        cost: 1,
        lifetime: Lifetime::FirstUse {
            deadline: start + SignedDuration::from_hours(1),
        },
        shadow_limit: None,
    };
    let mut now = start;
    let mut served = 0;
    for _ in 0..40 {
        let alone = ChargeRequest {
            charged_at: None,
            now,
            lines: smallvec::smallvec![hour.clone()],
        };
        assert!(leased.charge(alone).await.unwrap().admitted);
        served += 1;
        tokio::time::advance(Duration::from_millis(5)).await;
        now += SignedDuration::from_millis(5);
    }
    assert!(leased.held() > 0, "a block held");
    // The hour from the block, the day asked of the store.
    let both = ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![hour.clone(), line_of("acme", 10_000)],
    };
    assert!(leased.charge(both).await.unwrap().admitted);
    served += 1;
    let alone = ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![hour],
    };
    let counted = store.inner.peek(alone).await.unwrap()[0].used;
    assert_eq!(counted, served + leased.held(), "every unit served or held");
}

/// An answer that lands after a later charge's and is of a counter gone
/// (reset elsewhere meanwhile) tells that counter's first call: the
/// request's refund, guarded by it, does not land in the live counter,
/// which never counted the request.
#[tokio::test(start_paused = true)]
async fn a_late_answer_of_a_counter_gone_tells_its_own_first_call() {
    let shared = MemoryStore::new();
    let slow = Slow::new(shared.clone(), 0);
    let leased = LeasedStore::new(slow.clone());
    let now = t0();
    let first = call(&leased, now, 100).await.usage[0].first_call;
    // Charged on the first counter, answered late.
    slow.late.store(50, Ordering::Relaxed);
    let at = now + SignedDuration::from_millis(1);
    let late = tokio::spawn({
        let leased = leased.clone();
        async move { leased.charge(request(at, 100)).await }
    });
    tokio::task::yield_now().await;
    slow.late.store(0, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(1)).await;
    // Reset elsewhere; another instance makes the counter anew.
    shared.reset(day_key()).await.unwrap();
    let made = now + SignedDuration::from_millis(2);
    assert!(call(&shared, made, 100).await.admitted);
    // This instance hears of the new counter first.
    let _ = call(&leased, now + SignedDuration::from_millis(3), 100).await;
    let late = late.await.unwrap().unwrap();
    assert_eq!(
        late.usage[0].first_call, first,
        "the counter it was charged on"
    );
    let made_by = late.usage[0].first_call.map_or(at, |first| first.max(at));
    let later = now + SignedDuration::from_millis(4);
    let (before, held) = (counted(&shared, later).await, leased.held());
    leased
        .refund_made_by(later, day_key(), 1, made_by)
        .await
        .unwrap();
    assert_eq!(
        (counted(&shared, later).await, leased.held()),
        (before, held),
        "nothing of the live counter given back"
    );
}

/// A memory store whose charges wait at a gate while it is closed.
#[derive(Clone)]
struct Gated {
    inner: MemoryStore,
    closed: Arc<std::sync::atomic::AtomicBool>,
    waiting: Arc<AtomicU64>,
    gate: Arc<tokio::sync::Semaphore>,
}

impl Gated {
    fn new() -> Self {
        Self {
            inner: MemoryStore::new(),
            closed: Arc::default(),
            waiting: Arc::default(),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
        }
    }

    fn open(&self) {
        self.closed.store(false, Ordering::SeqCst);
        self.gate.add_permits(1 << 20);
    }
}

impl Store for Gated {
    type ChargeFuture = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<ChargeOutcome, StoreError>> + Send>,
    >;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        let (inner, gate) = (self.inner.clone(), Arc::clone(&self.gate));
        let closed = self.closed.load(Ordering::SeqCst);
        if closed {
            self.waiting.fetch_add(1, Ordering::SeqCst);
        }
        Box::pin(async move {
            if closed {
                let _ = gate.acquire().await;
            }
            inner.charge(request).await
        })
    }
    async fn peek(&self, request: ChargeRequest) -> Result<Vec<Usage>, StoreError> {
        self.inner.peek(request).await
    }
    async fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.refund(now, key, amount).await
    }
    async fn refund_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.refund_made_by(now, key, amount, made_by).await
    }
    async fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        self.inner.add(now, key, amount).await
    }
    async fn reset(&self, key: PeriodKey) -> Result<bool, StoreError> {
        self.inner.reset(key).await
    }
}

/// A shutdown awaited outside any runtime (an executor of its own) while a
/// busy subject's next block is on its way in a task of the runtime: it
/// waits for the block, and gives it back, without a timer of tokio's.
#[test]
fn a_shutdown_outside_a_runtime_waits_for_a_block_on_its_way() {
    const LIMIT: u64 = 100_000;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let store = Gated::new();
    let leased = LeasedStore::new(store.clone());
    let mut now = t0();
    let served = runtime.block_on(async {
        let mut served = 0;
        while leased.held() == 0 {
            assert!(call(&leased, now, LIMIT).await.admitted);
            served += 1;
            now += SignedDuration::from_millis(1);
        }
        store.closed.store(true, Ordering::SeqCst);
        while leased.held() > 0 {
            assert!(call(&leased, now, LIMIT).await.admitted);
            served += 1;
        }
        // The next block is taken in the background, and waits at the gate.
        while store.waiting.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        served
    });
    let opener = std::thread::spawn({
        let store = store.clone();
        move || {
            std::thread::sleep(Duration::from_millis(50));
            store.open();
        }
    });
    let mut shutdown = std::pin::pin!(leased.shutdown());
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    while std::future::Future::poll(shutdown.as_mut(), &mut cx).is_pending() {
        std::thread::sleep(Duration::from_millis(1));
    }
    opener.join().unwrap();
    assert_eq!(leased.held(), 0);
    let counted = runtime.block_on(counted(&store.inner, now));
    assert_eq!(counted, served, "the block taken at the end went back");
}

/// The instant on the test's day (`t0`) as far past it as real time is past
/// `start`: instants that move with the runtime, whatever the date.
fn on_the_day(start: std::time::Instant) -> Timestamp {
    t0() + SignedDuration::try_from(start.elapsed()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_instances_under_concurrency_admit_exactly_the_limit() {
    let shared = MemoryStore::new();
    let instances: Vec<_> = (0..3)
        .map(|_| {
            LeasedStore::builder(shared.clone())
                .idle(Duration::from_millis(20))
                .build()
        })
        .collect();
    let admitted = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    // Far more callers than the limit, until the limit is spent or two
    // seconds passed (units held by an instance come back once it idles).
    let start = std::time::Instant::now();
    let until = start + Duration::from_secs(2);
    for task in 0..24 {
        let leased = instances[task % 3].clone();
        let admitted = Arc::clone(&admitted);
        let refused = Arc::clone(&refused);
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while admitted.load(Ordering::SeqCst) < 1_000 && std::time::Instant::now() < until {
                if leased
                    .charge(request(on_the_day(start), 1_000))
                    .await
                    .unwrap()
                    .admitted
                {
                    admitted.fetch_add(1, Ordering::SeqCst);
                } else {
                    refused.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                i += 1;
                if i.is_multiple_of(3) {
                    tokio::task::yield_now().await;
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(admitted.load(Ordering::SeqCst), 1_000);
    assert!(refused.load(Ordering::Relaxed) > 0, "the limit was reached");
    for leased in &instances {
        leased.shutdown().await;
    }
    assert_eq!(counted(&shared, on_the_day(start)).await, 1_000);
    // Every instance left the lease mark, whatever the interleaving of its
    // joinings and leavings.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(holders(&shared, on_the_day(start)).await, 0);
}

#[tokio::test(start_paused = true)]
async fn a_full_memory_store_charges_a_leased_subject_as_before() {
    // Room for the subject's counter and nothing else: the lease mark,
    // a counter of its own, cannot be made, and admits nothing less.
    let shared = MemoryStore::new().max_counters(1);
    let leased = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&leased, &mut now, 300, 10_000, 1).await;
    assert!(leased.held() > 0, "blocks are taken all the same");
    assert_eq!(counted(&shared, now).await, 300 + leased.held());
}

#[tokio::test(start_paused = true)]
async fn a_key_listed_twice_takes_from_its_block_twice() {
    let shared = MemoryStore::new();
    let leased = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&leased, &mut now, 200, 10_000, 1).await;
    // A fresh instance with a small block: a request listing the key
    // twice takes from it for both lines, then from the store.
    leased.shutdown().await;
    let leased = LeasedStore::new(shared.clone());
    busy(&leased, &mut now, 20, 10_000, 1).await;
    let held = leased.held();
    assert!(held > 0);
    let mut twice = request(now, 10_000);
    twice.lines.push(twice.lines[0].clone());
    for _ in 0..held + 3 {
        assert!(leased.charge(twice.clone()).await.unwrap().admitted);
    }
    leased.shutdown().await;
    assert_eq!(counted(&shared, now).await, 220 + 2 * (held + 3));
}

/// Sends `leased` a request of the day's line and a line the store refuses
/// (a quota without room), while the store takes `delay_ms` to answer: the
/// day's line is paid from the block meanwhile, where it can be. Returns
/// once the request is on its way; the store answers at once again after.
async fn with_a_refused_line(
    slow: &Slow,
    leased: &LeasedStore<Slow>,
    now: Timestamp,
    delay_ms: u64,
) -> tokio::task::JoinHandle<Result<ChargeOutcome, StoreError>> {
    slow.delay.store(delay_ms, Ordering::Relaxed);
    let mut both = request(now, 10_000);
    both.lines.push(ChargeLine {
        key: PeriodKey::from_string("quota:{account:acme}:other:2026-12-04".into()),
        limit: 0,
        cost: 1,
        lifetime: day(),
        shadow_limit: None,
    });
    let waiting = tokio::spawn(leased.charge(both));
    tokio::time::sleep(Duration::from_millis(5)).await;
    slow.delay.store(0, Ordering::Relaxed);
    waiting
}

#[tokio::test(start_paused = true)]
async fn units_taken_for_a_request_the_store_refuses_late_come_back_to_the_block() {
    let slow = Slow::default();
    let shared = slow.inner.clone();
    let leased = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&leased, &mut now, 200, 10_000, 10).await;
    let held = leased.held();
    assert!(held > 0);
    // The day's line could be paid from the block; the other line, a quota
    // without room, must be asked of the store, which answers only after
    // the idle bound passed, and refuses.
    let waiting = with_a_refused_line(&slow, &leased, now, 3_000).await;
    assert!(leased.held() < held, "a unit is set aside meanwhile");
    let outcome = waiting.await.unwrap().unwrap();
    assert!(!outcome.admitted);
    // Meanwhile the subject was idle: the rest of its block went back,
    // and the unit set aside is back in the block, not lost.
    assert_eq!(leased.held(), 1, "the unit set aside is back in the block");
    leased.shutdown().await;
    assert_eq!(counted(&shared, now).await, 200);
}

#[tokio::test(start_paused = true)]
async fn a_shutdown_gives_back_units_set_aside_for_a_request_refused_meanwhile() {
    let slow = Slow::default();
    let shared = slow.inner.clone();
    let leased = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&leased, &mut now, 200, 10_000, 10).await;
    let held = leased.held();
    let waiting = with_a_refused_line(&slow, &leased, now, 50).await;
    // The shutdown begins while the request waits on its other line, and
    // gives back the unit set aside for it too, once it came back.
    assert_eq!(leased.shutdown().await, held);
    assert!(!waiting.await.unwrap().unwrap().admitted);
    assert_eq!(leased.held(), 0);
    assert_eq!(
        counted(&shared, now).await,
        200,
        "what was served, no unit left"
    );
}

#[tokio::test(start_paused = true)]
async fn units_set_aside_go_back_by_their_blocks_instant_after_the_block_went_back() {
    // As above, the rest of the block goes back while a unit is set aside;
    // the unit comes back into the block once the request is refused. Then
    // the counter is reset and made anew elsewhere: the unit's give-back
    // goes by its block's instant, and the new counter keeps its count.
    let slow = Slow::default();
    let shared = slow.inner.clone();
    let leased = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&leased, &mut now, 200, 10_000, 10).await;
    let waiting = with_a_refused_line(&slow, &leased, now, 3_000).await;
    assert!(!waiting.await.unwrap().unwrap().admitted);
    assert_eq!(leased.held(), 1, "the unit set aside is back in the block");
    assert_eq!(counted(&shared, now).await, 201);
    // Reset and made anew elsewhere, later than the block was taken.
    now += SignedDuration::from_secs(3);
    assert!(shared.reset(day_key()).await.unwrap());
    assert!(shared.charge(request(now, 10_000)).await.unwrap().admitted);
    // Idle: the unit goes back, guarded by its block's instant.
    tokio::time::advance(Duration::from_millis(1_300)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(1_300);
    assert_eq!(leased.held(), 0);
    assert_eq!(
        counted(&shared, now).await,
        1,
        "the new counter keeps its count"
    );
}

#[tokio::test(start_paused = true)]
async fn units_set_aside_never_go_back_into_a_block_of_a_counter_made_since() {
    let slow = Slow::default();
    let shared = slow.inner.clone();
    let leased = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&leased, &mut now, 200, 10_000, 10).await;
    while leased.held() > 1 {
        assert!(call(&leased, now, 10_000).await.admitted);
    }
    assert_eq!(leased.held(), 1);
    // A request of two lines sets the block's last unit aside, and waits
    // for the store on its other line, which it will refuse.
    let waiting = with_a_refused_line(&slow, &leased, now, 50).await;
    assert_eq!(leased.held(), 0, "the last unit is set aside");
    // Meanwhile the counter is reset in the store itself (not through this
    // instance), and a request makes it anew, under a limit of 10.
    assert!(shared.reset(day_key()).await.unwrap());
    let mut admitted = 0;
    while leased.held() == 0 {
        assert!(call(&leased, now, 10).await.admitted);
        admitted += 1;
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
    }
    assert!(
        admitted < 10,
        "{admitted}: a block of the new counter is taken early"
    );
    // The refusal puts the unit set aside back: not into the new counter's
    // block, whose store never counted it. And the new block goes back
    // (guarded) by its own instant, not by the old block's.
    assert!(!waiting.await.unwrap().unwrap().admitted);
    // Idle: the new block goes back, to the counter it was taken from.
    tokio::time::advance(Duration::from_millis(1_300)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(1_300);
    assert_eq!(leased.held(), 0);
    assert_eq!(counted(&shared, now).await, admitted, "what was served");
    while call(&leased, now, 10).await.admitted {
        admitted += 1;
    }
    assert_eq!(admitted, 10, "the new counter's limit, every unit served");
    leased.shutdown().await;
    assert_eq!(counted(&shared, now).await, 10);
}

mod through_the_layer {
    //! The same requests through the same app, once on a memory store and
    //! once on a leased one: every answer, and every count the support
    //! handle reads, is the same.

    use std::time::Duration;

    use axum::body::Body;
    use axum::routing::get;
    use axum::Router;
    use http::{Request, StatusCode};
    use jiff::SignedDuration;
    use tower::ServiceExt;
    use tower_quota::store::LeasedStore;
    use tower_quota::{
        Anchor, FromHeader, ManualClock, MemoryStore, Period, Quota, QuotaHandle, QuotaPolicy,
        Store, Subject, UnknownPlan,
    };

    fn app<St: Store>(store: St, clock: ManualClock) -> (Router, QuotaHandle<St>) {
        let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store)
            .clock(clock)
            .plan(|parts| Some(parts.headers.get("x-plan")?.to_str().ok()?.to_owned()))
            .on_unknown_plan(UnknownPlan::DefaultLimits)
            .refund_server_errors(true)
            .build();
        let read = policy
            .layer(Quota::daily(300).plan("pro", 400).allowance("read"))
            .quota(
                Quota::new(40, Period::minute(), Anchor::FirstUse)
                    .allowance("read-minute")
                    .shadow(),
            );
        let burst = policy.layer(Quota::per_minute(25).allowance("search"));
        let tokens = policy
            .layer(Quota::daily(2_000).allowance("tokens"))
            .deferred_cost(1, |response| {
                response
                    .headers
                    .get("x-tokens-used")
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .unwrap_or(1)
            });
        let router = Router::new()
            .route("/read", get(|| async { "r" }))
            .route("/fail", get(|| async { StatusCode::INTERNAL_SERVER_ERROR }))
            .route("/search", get(|| async { "s" }).route_layer(burst))
            .route_layer(read)
            .route(
                "/tokens",
                get(|| async { ([("x-tokens-used", "7")], "t") }).route_layer(tokens),
            );
        (router, policy.handle())
    }

    /// Each quota's name, count and reset.
    fn counts(usage: &[tower_quota::QuotaUsage]) -> Vec<(String, u64, jiff::Timestamp)> {
        usage
            .iter()
            .map(|u| (u.name().to_owned(), u.used(), u.resets_at()))
            .collect()
    }

    /// The answer's status and every field the client reads.
    async fn ask(app: &Router, path: &str, account: &str, plan: Option<&str>) -> String {
        let mut request = Request::get(path).header("x-account-id", account);
        if let Some(plan) = plan {
            request = request.header("x-plan", plan);
        }
        let response = app
            .clone()
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap();
        let mut seen = response.status().to_string();
        for name in ["ratelimit", "ratelimit-policy", "retry-after"] {
            for value in response.headers().get_all(name) {
                seen.push_str(&format!(" {name}: {}", value.to_str().unwrap()));
            }
        }
        seen
    }

    #[tokio::test(start_paused = true)]
    async fn every_answer_and_count_is_the_same_as_without_leases() {
        let start = "2026-12-04T23:50:00Z".parse().unwrap();
        let (plain_clock, leased_clock) = (ManualClock::new(start), ManualClock::new(start));
        let (plain, plain_handle) = app(MemoryStore::new(), plain_clock.clone());
        let leased_store = LeasedStore::builder(MemoryStore::new())
            .idle(Duration::from_millis(400))
            .lease_time(Duration::from_secs(3))
            .build();
        let (leased, leased_handle) = app(leased_store.clone(), leased_clock.clone());
        // A fixed pseudo-random script: paths, accounts, plans, steps of
        // time, support refunds and resets, across a calendar midnight and
        // first-use minutes.
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let accounts = ["acme", "globex", "initech"];
        let mut leased_locally = false;
        for step in 0..3_000 {
            let account = accounts[next(3) as usize];
            let plan = [None, Some("pro"), Some("free")][next(3) as usize];
            let path = ["/read", "/read", "/read", "/search", "/fail", "/tokens"][next(6) as usize];
            match next(200) {
                0 => {
                    let subject = Subject::account(account);
                    let a = plain_handle
                        .refund_allowance(&subject, "read", 3)
                        .await
                        .unwrap();
                    let b = leased_handle
                        .refund_allowance(&subject, "read", 3)
                        .await
                        .unwrap();
                    assert_eq!(a, b, "step {step}: a support refund");
                }
                1 => {
                    let subject = Subject::account(account);
                    let a = plain_handle
                        .reset_allowance(&subject, "search")
                        .await
                        .unwrap();
                    let b = leased_handle
                        .reset_allowance(&subject, "search")
                        .await
                        .unwrap();
                    assert_eq!(a, b, "step {step}: a support reset");
                }
                _ => {
                    let a = ask(&plain, path, account, plan).await;
                    let b = ask(&leased, path, account, plan).await;
                    assert_eq!(a, b, "step {step}: {path} of {account} on {plan:?}");
                }
            }
            leased_locally |= leased_store.held() > 0;
            let subject = Subject::account(account);
            assert_eq!(
                counts(&plain_handle.usage(&subject).await.unwrap()),
                counts(&leased_handle.usage(&subject).await.unwrap()),
                "step {step}: {account}'s counts after {path} on {plan:?}"
            );
            let pause = [1, 1, 2, 5, 20, 700][next(6) as usize];
            plain_clock.advance(SignedDuration::from_millis(pause));
            leased_clock.advance(SignedDuration::from_millis(pause));
            tokio::time::advance(Duration::from_millis(pause as u64)).await;
        }
        assert!(leased_locally, "blocks were taken");
        for account in accounts {
            let subject = Subject::account(account);
            let a = plain_handle.usage(&subject).await.unwrap();
            let b = leased_handle.usage(&subject).await.unwrap();
            assert_eq!(counts(&a), counts(&b), "{account}");
        }
    }
}

/// A counter whose key names no lease mark (made by hand, not by a
/// `Namespace`) takes blocks, and is forgotten once idle like any other:
/// no joining of a mark that cannot be joined keeps its entry, and its
/// room, forever.
#[tokio::test(start_paused = true)]
async fn a_key_without_a_lease_mark_is_forgotten_once_idle() {
    let inner = Counting::default();
    let leased = LeasedStore::builder(inner.clone()).max_counters(1).build();
    let plain = PeriodKey::from_string("plain".into());
    assert!(plain.as_str().len() < 10, "no `{{subject}}:allowance` part");
    let mut now = t0();
    for _ in 0..200 {
        let request = ChargeRequest {
            charged_at: None,
            now,
            lines: smallvec::smallvec![ChargeLine {
                key: plain.clone(),
                limit: 100_000,
                cost: 1,
                lifetime: day(),
                shadow_limit: None,
            }],
        };
        assert!(leased.charge(request).await.unwrap().admitted);
        tokio::time::advance(Duration::from_millis(10)).await;
        now += SignedDuration::from_millis(10);
    }
    assert!(leased.held() > 0, "a busy subject takes blocks");
    // Idle past the bound: its units go back, and its entry goes.
    tokio::time::advance(Duration::from_secs(3)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_secs(3);
    assert_eq!(leased.held(), 0);
    // The only room there is goes to the next busy subject, which takes
    // blocks in turn.
    let before = inner.charges.load(Ordering::Relaxed);
    busy(&leased, &mut now, 200, 100_000, 10).await;
    let charges = inner.charges.load(Ordering::Relaxed) - before;
    assert!(charges < 40, "{charges} charges for 200 requests");
    assert!(leased.held() > 0);
}

#[test]
fn charges_over_two_subjects_in_either_order_are_exact_and_never_wait_on_each_other() {
    // Run on a thread of its own: a charge that waits forever on another's
    // lock fails the test when the time is up instead of hanging it.
    let (done, finished) = std::sync::mpsc::channel();
    let run = std::thread::spawn(move || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap()
            .block_on(charges_over_two_subjects());
        done.send(()).unwrap();
    });
    match finished.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => run.join().unwrap(),
        // The run panicked: its assertion is the failure.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(panic) = run.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("charges over two subjects waited on each other for a minute")
        }
    }
}

async fn charges_over_two_subjects() {
    // The subjects' counters sit in different shards (with many subjects,
    // some pair does): charges naming both lock both, from many tasks at
    // once, half naming them in one order and half in the other.
    const LIMIT: u64 = 500;
    let inner = MemoryStore::new();
    let leased = LeasedStore::new(inner.clone());
    let now = t0();
    let subjects: Vec<String> = (0..16).map(|i| format!("s{i}")).collect();
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..16usize {
        let leased = leased.clone();
        let (a, b) = (subjects[task % 4].clone(), subjects[4 + task % 4].clone());
        tasks.spawn(async move {
            let mut admitted = 0;
            for i in 0..300 {
                let lines = if (task + i) % 2 == 0 {
                    smallvec::smallvec![line_of(&a, LIMIT), line_of(&b, LIMIT)]
                } else {
                    smallvec::smallvec![line_of(&b, LIMIT), line_of(&a, LIMIT)]
                };
                let outcome = leased.charge(charge_at(now, lines)).await.unwrap();
                if outcome.admitted {
                    admitted += 1;
                }
            }
            (task % 4, admitted)
        });
    }
    let mut admitted = [0u64; 4];
    while let Some(result) = tasks.join_next().await {
        let (pair, n) = result.unwrap();
        admitted[pair] += n;
    }
    leased.shutdown().await;
    for pair in 0..4 {
        // Four tasks of 300 charges each on the pair: the limit, exactly.
        assert_eq!(admitted[pair], LIMIT, "pair {pair}");
        for subject in [&subjects[pair], &subjects[4 + pair]] {
            assert_eq!(
                counted_for(&inner, subject, now).await,
                LIMIT,
                "counted for {subject}"
            );
        }
    }
}

#[tokio::test]
async fn a_charge_made_at_once_gives_back_an_old_block_even_when_its_future_is_dropped() {
    use tower_quota::store::ChargeAnswer;
    let inner = MemoryStore::new();
    let (leased, start, mut admitted) = holding_an_old_block(inner.clone()).await;
    // The next charge finds the block past its lease time: it goes back as
    // the charge is made, even though its future is dropped unpolled.
    match leased.charge_at_once(&request(on_the_day(start), 10_000)) {
        ChargeAnswer::Now(answer) => {
            if answer.unwrap().admitted {
                admitted += 1;
            }
        }
        ChargeAnswer::Later(future) => drop(future),
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    leased.shutdown().await;
    assert_eq!(counted(&inner, on_the_day(start)).await, admitted);
}

#[tokio::test(start_paused = true)]
async fn a_charge_of_nothing_is_answered_for_a_subject_this_instance_never_saw() {
    let shared = MemoryStore::new();
    let leased = LeasedStore::new(shared.clone());
    let now = t0();
    let free = || ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![ChargeLine {
            cost: 0,
            ..line_of("acme", 10)
        }],
    };
    let outcome = leased.charge(free()).await.unwrap();
    assert!(outcome.admitted);
    assert_eq!(outcome.usage[0].used, 0);
    // And once the subject has a counter here, as the store counts it.
    assert!(call(&leased, now, 10).await.admitted);
    let outcome = leased.charge(free()).await.unwrap();
    assert!(outcome.admitted);
    assert_eq!(outcome.usage[0].used, 1);
    assert_eq!(counted(&shared, now).await, 1);
}

#[tokio::test(start_paused = true)]
async fn a_shutdown_waits_for_what_the_idle_sweep_is_giving_back() {
    let inner = Slow::new(MemoryStore::new(), 0);
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    busy(&leased, &mut now, 100, 10_000, 1).await;
    assert!(leased.held() > 0);
    // The subject goes quiet; the sweep takes its block off and gives it
    // back, which the store answers 60 ms later.
    inner.delay.store(60, Ordering::Relaxed);
    tokio::time::advance(Duration::from_millis(1_300)).await;
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(leased.held(), 0, "the sweep has the block");
    // The server stops meanwhile: the shutdown returns once the block is
    // back.
    leased.shutdown().await;
    inner.delay.store(0, Ordering::Relaxed);
    now += SignedDuration::from_millis(1_300);
    assert_eq!(counted(&inner, now).await, 100);
}

#[tokio::test(start_paused = true)]
async fn the_idle_sweep_gives_many_subjects_back_together() {
    let inner = Slow::new(MemoryStore::new(), 0);
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    let subjects: Vec<String> = (0..20).map(|i| format!("s{i}")).collect();
    let mut admitted = 0;
    for _ in 0..40 {
        for subject in &subjects {
            let lines = smallvec::smallvec![line_of(subject, 10_000)];
            let outcome = leased.charge(charge_at(now, lines)).await.unwrap();
            assert!(outcome.admitted);
            admitted += 1;
            tokio::time::advance(Duration::from_millis(1)).await;
            now += SignedDuration::from_millis(1);
        }
    }
    assert!(leased.held() > 0);
    // Every subject goes quiet; each give-back takes the store 60 ms.
    inner.delay.store(60, Ordering::Relaxed);
    for _ in 0..14 {
        tokio::time::advance(Duration::from_millis(100)).await;
        tokio::task::yield_now().await;
    }
    now += SignedDuration::from_millis(1_400);
    inner.delay.store(0, Ordering::Relaxed);
    let mut counted = 0;
    for subject in &subjects {
        counted += counted_for(&inner, subject, now).await;
    }
    assert_eq!(
        counted, admitted,
        "every block back within a round trip or two"
    );
}

#[tokio::test(start_paused = true)]
async fn no_block_taken_while_a_reset_is_on_its_way_outlives_it() {
    let inner = Slow::new(MemoryStore::new(), 0);
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    busy(&leased, &mut now, 200, 100_000, 1).await;
    assert!(leased.held() > 0);
    // Every store call now takes 50 ms: the reset's counter is deleted
    // 100 ms on (its mark left first), and requests keep coming meanwhile.
    inner.delay.store(50, Ordering::Relaxed);
    let reset = tokio::spawn({
        let leased = leased.clone();
        async move { leased.reset(day_key()).await.unwrap() }
    });
    let mut calls = Vec::new();
    for _ in 0..40 {
        let leased = leased.clone();
        let at = now;
        calls.push(tokio::spawn(
            async move { call(&leased, at, 100_000).await },
        ));
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
    }
    for _ in 0..30 {
        tokio::time::advance(Duration::from_millis(10)).await;
        tokio::task::yield_now().await;
    }
    assert!(reset.await.unwrap());
    for call in calls {
        assert!(call.await.unwrap().admitted);
    }
    inner.delay.store(0, Ordering::Relaxed);
    // What this instance holds was taken from the counter there is now,
    // not from the one deleted.
    assert!(
        counted(&inner, now).await >= leased.held(),
        "{} units held, {} counted",
        leased.held(),
        counted(&inner, now).await
    );
}

#[tokio::test(start_paused = true)]
async fn a_next_block_that_lands_after_a_reset_goes_back() {
    let inner = Slow::new(MemoryStore::new(), 0);
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    until_a_block_runs_out(&leased, &mut now).await;
    // The next block's charge takes 50 ms to land; the reset, none: the
    // counter is deleted before the block lands, and the block makes it
    // anew.
    inner.delay.store(50, Ordering::Relaxed);
    background_takes_its_blocks().await;
    inner.delay.store(0, Ordering::Relaxed);
    assert!(leased.reset(day_key()).await.unwrap());
    for _ in 0..10 {
        tokio::time::advance(Duration::from_millis(10)).await;
        tokio::task::yield_now().await;
    }
    assert_eq!(leased.held(), 0);
    assert_eq!(
        counted(&inner, now).await,
        0,
        "nothing admitted since the reset"
    );
}

/// `leased` over `inner`, with blocks that pass their lease time in 200 ms
/// of real time, and a busy subject holding one.
async fn holding_an_old_block<St: Store>(inner: St) -> (LeasedStore<St>, std::time::Instant, u64) {
    let leased = LeasedStore::builder(inner)
        .lease_time(Duration::from_millis(200))
        .idle(Duration::from_secs(10))
        .max_block(50)
        .build();
    let start = std::time::Instant::now();
    let mut admitted = 0;
    for _ in 0..300 {
        assert!(call(&leased, on_the_day(start), 10_000).await.admitted);
        admitted += 1;
    }
    assert!(leased.held() > 0, "a busy subject holds a block");
    // The block passes its lease time while no sweep can run (this thread
    // runs the runtime).
    std::thread::sleep(Duration::from_millis(250));
    (leased, start, admitted)
}

#[tokio::test]
async fn an_old_block_goes_back_beside_the_charge_not_before_it() {
    let inner = Slow::new(MemoryStore::new(), 0);
    let (leased, start, _) = holding_an_old_block(inner.clone()).await;
    // Every store call now takes 150 ms: the request waits for its charge,
    // not for the give-back first.
    inner.delay.store(150, Ordering::Relaxed);
    let outcome = tokio::time::timeout(
        Duration::from_millis(250),
        leased.charge(request(on_the_day(start), 10_000)),
    )
    .await
    .expect("one round trip, not two");
    assert!(outcome.unwrap().admitted);
}

#[tokio::test]
async fn a_charge_refused_before_an_old_block_is_back_is_sent_again() {
    let inner = Slow::new(MemoryStore::new(), 0);
    let (leased, start, admitted) = holding_an_old_block(inner.clone()).await;
    let now = on_the_day(start);
    let held = leased.held();
    let limit = admitted + held + 5;
    // Another instance spends all that nobody holds (a memory store
    // answers at once: no sweep runs meanwhile).
    let mut elsewhere = 0;
    while call(&inner.inner, now, limit).await.admitted {
        elsewhere += 1;
    }
    assert_eq!(elsewhere, 5);
    // The old block's units make room for the request, but come back
    // 100 ms after its charge landed: refused, then sent again.
    inner.slow_refunds.store(100, Ordering::Relaxed);
    assert!(call(&leased, now, limit).await.admitted);
    leased.shutdown().await;
    assert_eq!(counted(&inner, now).await, admitted + 5 + 1);
}

#[test]
fn a_runtime_stopped_while_its_sweep_ran_leaves_the_next_runtime_a_sweep() {
    let paused = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    };
    let shared = MemoryStore::new();
    let leased = LeasedStore::new(shared.clone());
    let mut now = t0();
    // The sweep starts on the first runtime, which stops.
    paused().block_on(busy(&leased, &mut now, 100, 10_000, 1));
    // On another one, a subject holding a block goes quiet: a sweep runs
    // there and gives the block back.
    paused().block_on(async {
        busy(&leased, &mut now, 100, 10_000, 1).await;
        assert!(leased.held() > 0);
        tokio::time::advance(Duration::from_millis(1_300)).await;
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        now += SignedDuration::from_millis(1_300);
        assert_eq!(leased.held(), 0, "given back on the second runtime");
        assert_eq!(counted(&shared, now).await, 200);
    });
}

/// One request of `subject` at `now` on `leased`, admitted.
async fn served_for<St: Store>(leased: &St, subject: &str, now: Timestamp) {
    let lines = smallvec::smallvec![line_of(subject, 1_000_000)];
    let outcome = leased.charge(charge_at(now, lines)).await.unwrap();
    assert!(outcome.admitted, "{subject}");
}

/// Many subjects going idle together leave their lease marks together, as
/// their units go back: one after the other, a pass of the sweep took a
/// round trip per subject (2 s here), and a subject that went idle
/// meanwhile kept its units from other instances until the pass ended.
#[tokio::test(start_paused = true)]
async fn many_subjects_going_idle_together_keep_no_other_subjects_units() {
    let shared = MemoryStore::new();
    let slow = Slow::new(shared.clone(), 0);
    let leased = LeasedStore::new(slow.clone());
    let mut now = t0();
    let subjects: Vec<String> = (0..200).map(|i| format!("s{i}")).collect();
    let step = |now: &mut Timestamp| {
        *now += SignedDuration::from_millis(1);
        tokio::time::advance(Duration::from_millis(1))
    };
    for _ in 0..5 {
        for subject in &subjects {
            served_for(&leased, subject, now).await;
        }
        step(&mut now).await;
    }
    assert!(
        leased.held() >= 200,
        "every subject holds a block: {}",
        leased.held()
    );
    // Round trips of 10 ms from now on. The others go idle: their units
    // go back, then their marks are left.
    slow.delay.store(10, Ordering::Relaxed);
    for _ in 0..1_300 {
        step(&mut now).await;
    }
    assert_eq!(leased.held(), 0, "the others' units went back");
    // `z` is busy a while meanwhile, then goes idle.
    let mut served = 0;
    for _ in 0..5 {
        served_for(&leased, "z", now).await;
        served += 1;
        now += SignedDuration::from_millis(10);
    }
    // Its idle bound and a sweep later, `z`'s units are back.
    let since = tokio::time::Instant::now();
    while since.elapsed() < Duration::from_millis(1_500) {
        step(&mut now).await;
        tokio::task::yield_now().await;
    }
    assert_eq!(counted_for(&shared, "z", now).await, served);
}

/// A shutdown awaited outside any tokio runtime (the runtime that served
/// is gone) still gives every unit back, on a store that answers at once.
#[test]
fn a_shutdown_without_a_runtime_gives_every_unit_back() {
    use std::future::Future;

    let shared = MemoryStore::new();
    let leased = LeasedStore::new(shared.clone());
    let mut now = t0();
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
        .block_on(busy(&leased, &mut now, 200, 10_000, 1));
    let held = leased.held();
    assert!(held > 0, "a block held");
    let mut shutdown = std::pin::pin!(leased.shutdown());
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    let std::task::Poll::Ready(returned) = shutdown.as_mut().poll(&mut context) else {
        panic!("a store that answers at once is given back at once");
    };
    assert_eq!(returned, held);
    let lines = smallvec::smallvec![line_of("acme", u64::MAX)];
    let mut peek = std::pin::pin!(shared.peek(ChargeRequest {
        charged_at: None,
        now,
        lines
    }));
    let std::task::Poll::Ready(usage) = peek.as_mut().poll(&mut context) else {
        panic!("the memory store answers at once");
    };
    assert_eq!(usage.unwrap()[0].used, 200);
}

/// A request refused by a quota that is full whatever its block (a spent
/// daily quota, beside a per-minute one that takes blocks) is refused in
/// one charge, not sent again without its blocks: two round trips would
/// pass the layer's store timeout on a slow store.
#[tokio::test(start_paused = true)]
async fn a_request_refused_by_a_full_line_takes_one_charge() {
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    for _ in 0..10 {
        assert!(call(&inner.inner, now, 10).await.admitted);
    }
    let both = |now: Timestamp| {
        let mut both = request(now, 10);
        both.lines.push(ChargeLine {
            key: PeriodKey::from_string("quota:{account:acme}:burst:2026-12-04".into()),
            limit: 1_000_000,
            cost: 1,
            lifetime: day(),
            shadow_limit: None,
        });
        both
    };
    for _ in 0..20 {
        let before = inner.charges.load(Ordering::Relaxed);
        let refused = leased.charge(both(now)).await.unwrap();
        assert!(!refused.admitted);
        assert_eq!(
            inner.charges.load(Ordering::Relaxed) - before,
            1,
            "one charge for a refusal"
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
    }
}

/// A request refused while the block's last unit is set aside for another
/// request (of two lines, the other waiting on the store) waits for it:
/// that request refused, the unit comes back and pays for this one, which
/// the store, counting it, would have refused until the day ends.
#[tokio::test(start_paused = true)]
async fn a_request_refused_while_units_are_set_aside_is_served_from_them() {
    let slow = Slow::default();
    let shared = slow.inner.clone();
    let leased = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&leased, &mut now, 200, 10_000, 10).await;
    while leased.held() > 1 {
        assert!(call(&leased, now, 10_000).await.admitted);
    }
    let waiting = with_a_refused_line(&slow, &leased, now, 15).await;
    assert_eq!(leased.held(), 0, "the last unit is set aside");
    // Other instances spend the rest: as far as the store knows, full.
    let counted_now = counted(&shared, now).await;
    shared
        .add(now, day_key(), 10_000 - counted_now)
        .await
        .unwrap();
    let served = call(&leased, now, 10_000).await;
    assert!(served.admitted, "served from the unit that came back");
    assert!(!waiting.await.unwrap().unwrap().admitted);
    assert_eq!(leased.held(), 0);
}

/// A line that costs nothing is refused once its counter is over its limit
/// (a deferred cost added past it), as the store refuses it: not admitted
/// from a block for free.
#[tokio::test(start_paused = true)]
async fn a_line_of_nothing_over_its_limit_is_refused_as_the_store_does() {
    let shared = MemoryStore::new();
    let leased = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&leased, &mut now, 20, 100, 1).await;
    assert!(leased.held() > 0, "a block held");
    // Costs known after the responses take the counter past its limit.
    leased.add(now, day_key(), 200).await.unwrap();
    let mut free = request(now, 100);
    free.lines[0].cost = 0;
    let store = shared.charge(free.clone()).await.unwrap();
    assert!(!store.admitted, "the store refuses it");
    assert!(!leased.charge(free).await.unwrap().admitted);
}

/// A block whose charge was stamped at the very instant a reset elsewhere
/// and a new request made the counter anew goes back by the first call of
/// the counter it was taken from: not onto the new counter, which never
/// counted its units.
#[tokio::test(start_paused = true)]
async fn a_block_taken_at_the_instant_a_counter_is_made_anew_goes_back_to_the_old_one() {
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let b = LeasedStore::new(shared.clone());
    let mut now = t0();
    // B busy until one of its charges takes a block.
    let mut held = 0;
    for _ in 0..200 {
        assert!(call(&b, now, 1_000).await.admitted);
        if b.held() > held {
            break;
        }
        held = b.held();
        tokio::time::advance(Duration::from_millis(20)).await;
        now += SignedDuration::from_millis(20);
    }
    let block = b.held();
    assert!(block > 0, "B holds a block taken at {now}");
    // Support resets the counter elsewhere; A's request at the same instant
    // makes it anew.
    assert!(shared.reset(day_key()).await.unwrap());
    for _ in 0..3 {
        assert!(call(&shared, now, 1_000).await.admitted);
    }
    assert_eq!(
        counted(&shared, now).await,
        3,
        "the new counter counts A's three requests"
    );
    // B goes idle: its block goes back.
    tokio::time::sleep(Duration::from_secs(3)).await;
    a.shutdown().await;
    let later = now + SignedDuration::from_secs(3);
    assert_eq!(b.held(), 0);
    assert_eq!(
        counted(&shared, later).await,
        3,
        "B's block of the counter gone landed on the new counter (block {block})"
    );
}

fn fu_request(now: Timestamp, cost: u64) -> ChargeRequest {
    ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![ChargeLine {
            key: PeriodKey::from_string("quota:{account:acme}:fu:PT1M".to_string()),
            limit: 100,
            cost,
            lifetime: Lifetime::FirstUse {
                deadline: now + SignedDuration::from_secs(30),
            },
            shadow_limit: None,
        }],
    }
}

/// A line of nothing on a first-use counter whose period ended is
/// answered as the store answers it, not from this instance's view of the
/// period gone.
#[tokio::test(start_paused = true)]
async fn a_line_of_nothing_after_a_first_use_period_ended_is_the_stores() {
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let mut now = t0();
    for _ in 0..50 {
        assert!(a.charge(fu_request(now, 1)).await.unwrap().admitted);
        tokio::time::advance(Duration::from_millis(20)).await;
        now += SignedDuration::from_millis(20);
    }
    // The period ends; the subject comes back with a request of nothing.
    tokio::time::sleep(Duration::from_secs(31)).await;
    now += SignedDuration::from_secs(31);
    let store = shared.charge(fu_request(now, 0)).await.unwrap();
    let leased = a.charge(fu_request(now, 0)).await.unwrap();
    assert!(leased.admitted);
    assert_eq!(
        (leased.usage[0].used, leased.usage[0].resets_at),
        (store.usage[0].used, store.usage[0].resets_at),
        "as the store answers (reset in the past: {})",
        leased.usage[0].resets_at < now
    );
}

/// A line of nothing is refused, as the store refuses it, once another
/// instance's adds took the counter past its limit: this instance's view
/// is kept no longer than the block it holds, the lease time.
#[tokio::test(start_paused = true)]
async fn a_line_of_nothing_over_a_limit_passed_elsewhere_is_refused() {
    let shared = MemoryStore::new();
    let lease_time = Duration::from_secs(2);
    let a = LeasedStore::builder(shared.clone())
        .lease_time(lease_time)
        .build();
    let b = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&a, &mut now, 20, 100, 1).await;
    // B's deferred costs take the counter past its limit.
    assert!(call(&b, now, 100).await.admitted);
    b.add(now, day_key(), 200).await.unwrap();
    let mut free = request(now, 100);
    free.lines[0].cost = 0;
    assert!(
        !shared.charge(free.clone()).await.unwrap().admitted,
        "the store refuses it"
    );
    let mut admitted = Vec::new();
    for _ in 0..100 {
        tokio::time::advance(Duration::from_millis(100)).await;
        free.now += SignedDuration::from_millis(100);
        if a.charge(free.clone()).await.unwrap().admitted {
            admitted.push(free.now);
        }
    }
    let bound = now + SignedDuration::try_from(lease_time).unwrap();
    assert!(
        admitted.iter().all(|&at| at <= bound),
        "admitted {} of them, the last at {:?}, past {bound}",
        admitted.len(),
        admitted.last()
    );
}

/// An answer that lands after a later one, which told of no counter yet,
/// tells the request the making of the counter it was charged on: a
/// request stamped later made it, and the request's give-back goes by
/// that making, or the store refuses it and its unit stays charged.
#[tokio::test(start_paused = true)]
async fn a_late_answer_tells_the_making_of_the_counter_charged() {
    let shared = MemoryStore::new();
    let slow = Slow::new(shared.clone(), 50);
    let leased = LeasedStore::new(slow.clone());
    let first = t0();
    // Sent first, applied 50 ms on.
    let early = tokio::spawn({
        let leased = leased.clone();
        async move { leased.charge(request(first, 100)).await.unwrap() }
    });
    tokio::task::yield_now().await;
    // Sent next, applied at once: more than the limit, refused, no counter.
    slow.delay.store(0, Ordering::Relaxed);
    let mut over = request(first, 100);
    over.lines[0].cost = 101;
    let refused = leased.charge(over).await.unwrap();
    assert!(!refused.admitted);
    assert_eq!(refused.usage[0].first_call, None);
    // Another instance's request, stamped later, makes the counter.
    let later = first + SignedDuration::from_millis(10);
    tokio::time::advance(Duration::from_millis(10)).await;
    assert!(call(&shared, later, 100).await.admitted);
    let early = early.await.unwrap();
    assert!(early.admitted);
    assert_eq!(
        early.usage[0].first_call,
        Some(later),
        "the counter's making"
    );
    // Its give-back lands.
    let made_by = early.usage[0].first_call.unwrap();
    leased
        .refund_made_by(later, day_key(), 1, made_by)
        .await
        .unwrap();
    leased.shutdown().await;
    assert_eq!(
        counted(&shared, later).await,
        1,
        "the other instance's alone"
    );
}

/// A refund that goes in part into the block, and whose rest the store
/// never gets (it is away), is taken back off the block: sent again whole,
/// it is counted once, not the block's part twice.
#[tokio::test(start_paused = true)]
async fn a_refund_sent_again_after_the_store_was_away_counts_once() {
    let shared = MemoryStore::new();
    let slow = Slow::new(shared.clone(), 0);
    let leased = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&leased, &mut now, 70, 100, 20).await;
    assert!(leased.held() > 0, "a block held");
    let first_call = shared.peek(request(now, 100)).await.unwrap()[0]
        .first_call
        .expect("the memory store dates its counters");
    slow.away.store(true, Ordering::Relaxed);
    let refund = leased.refund_made_at(now, day_key(), 60, first_call).await;
    assert!(refund.expect_err("the store is away").is_unsent());
    slow.away.store(false, Ordering::Relaxed);
    leased
        .refund_made_at(now, day_key(), 60, first_call)
        .await
        .unwrap();
    leased.shutdown().await;
    assert_eq!(counted(&shared, now).await, 10, "70 served, 60 given back");
}

/// A block taken for a shadow quota was admitted by the store under the
/// most it counts, not under the shadow limit: once the quota is enforced
/// at that limit, the block goes back before a request spends from it, and
/// the store, which counted past the limit meanwhile, refuses.
#[tokio::test(start_paused = true)]
async fn a_shadow_quotas_block_is_not_spent_once_the_quota_is_enforced() {
    let memory = MemoryStore::new();
    let a = LeasedStore::new(memory.clone());
    let shadow = |now| {
        let mut request = request(now, u64::MAX);
        request.lines[0].shadow_limit = Some(60);
        request
    };
    let mut now = t0();
    for _ in 0..5 {
        assert!(a.charge(shadow(now)).await.unwrap().admitted);
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
    }
    assert!(a.held() > 0, "a block taken");
    // Another instance counts past the shadow limit.
    for _ in 0..100 {
        assert!(memory.charge(shadow(now)).await.unwrap().admitted);
    }
    let spent = counted(&memory, now).await - a.held();
    assert!(
        !call(&a, now, 60).await.admitted,
        "enforced at 60 with {spent} spent"
    );
    assert_eq!(a.held(), 0, "the block went back");
}

/// A calendar counter reset elsewhere while this instance holds a block of
/// it: a request paying its line from the block learns from the store that
/// the counter is gone, and the block goes with it; the block then taken
/// from the counter made anew goes back to that counter once the subject
/// idles, and the count is what was served on it.
#[tokio::test(start_paused = true)]
async fn a_block_of_a_counter_reset_elsewhere_is_not_merged_into_the_next() {
    let slow = Slow::new(MemoryStore::new(), 0);
    let a = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&a, &mut now, 40, 1_000, 1).await;
    background_takes_its_blocks().await;
    now += SignedDuration::from_millis(20);
    let held = a.held();
    assert!(held > 0);
    assert!(
        slow.inner.reset(day_key()).await.unwrap(),
        "reset elsewhere"
    );
    slow.delay.store(5, Ordering::Relaxed);
    // The whole block set aside for one request, whose other line the
    // store refuses.
    let mut first = request(now, 1_000);
    first.lines[0].cost = held;
    first.lines.push(line_of("other", 0));
    let first = tokio::spawn(a.charge(first));
    tokio::task::yield_now().await;
    tokio::time::advance(Duration::from_millis(1)).await;
    now += SignedDuration::from_millis(1);
    // A millisecond later, a request that takes a block of the new counter.
    let a2 = a.clone();
    let second = tokio::spawn(async move { call(&a2, now, 1_000).await });
    assert!(!first.await.unwrap().unwrap().admitted);
    assert!(second.await.unwrap().admitted);
    slow.delay.store(0, Ordering::Relaxed);
    // Idle: what is held goes back.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    now += SignedDuration::from_millis(1_500);
    assert_eq!(a.held(), 0);
    assert_eq!(
        counted(&slow.inner, now).await,
        1,
        "one request admitted on the new counter"
    );
}

#[tokio::test(start_paused = true)]
async fn a_charge_that_waited_for_an_old_blocks_give_back_keeps_the_block_it_takes_after_a_reset() {
    // A holds a block taken on a plan of 1 000; a request on a lower plan
    // gives it back first (slowly), and only then goes to the store. A
    // request planned after it goes at once, then support resets the
    // counter through B. The waiting request's charge makes the counter
    // anew and takes a block of it: A holds it and gives it back when
    // idle, and the store counts what was served, not units nobody holds.
    let shared = MemoryStore::new();
    let slow = Slow::new(shared.clone(), 0);
    let a = LeasedStore::new(slow.clone());
    let b = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&a, &mut now, 40, 1_000, 1).await;
    assert!(a.held() > 0, "a block is held");
    slow.slow_refunds.store(50, Ordering::Relaxed);
    let lower = tokio::spawn({
        let a = a.clone();
        async move { call(&a, now, 500).await }
    });
    for _ in 0..5 {
        tokio::task::yield_now().await;
    }
    assert!(
        call(&a, now, 1_000).await.admitted,
        "planned later, sent at once"
    );
    assert!(b.reset(day_key()).await.unwrap());
    tokio::time::advance(Duration::from_millis(100)).await;
    let outcome = lower.await.unwrap();
    assert!(outcome.admitted, "{outcome:?}");
    assert!(a.held() > 0, "the block taken of the new counter is held");
    // Idle: what A holds goes back (slowly).
    for _ in 0..4 {
        tokio::time::advance(Duration::from_secs(1)).await;
        for _ in 0..5 {
            tokio::task::yield_now().await;
        }
    }
    now += SignedDuration::from_secs(4);
    assert_eq!(a.held(), 0);
    assert_eq!(
        counted(&shared, now).await,
        1,
        "the one request served since the reset"
    );
}

/// A block cut short goes back as a block given back does: a request of
/// the same instance refused meanwhile, for units on their way back from
/// it, waits for them (as the README says) and is served, never refused
/// while the subject has room.
#[tokio::test(start_paused = true)]
async fn a_request_refused_while_a_cut_block_goes_back_waits_for_it() {
    let shared = MemoryStore::new();
    let slow = Slow::new(shared.clone(), 0);
    // A give-back takes a round trip (5 ms); a charge is answered at once.
    slow.slow_refunds.store(5, Ordering::Relaxed);
    let a = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&a, &mut now, 200, 1_000, 1).await;
    assert!(a.held() > 3, "a busy subject holds a block");
    // Another instance spends all but 3 of what nobody holds.
    while counted(&shared, now).await < 997 {
        assert!(call(&shared, now, 1_000).await.admitted);
    }
    let mut served = 0;
    loop {
        let outcome = call(&a, now, 1_000).await;
        if !outcome.admitted {
            break;
        }
        served += 1;
        now += SignedDuration::from_millis(1);
    }
    // Whatever was on its way back has landed.
    tokio::time::advance(Duration::from_millis(100)).await;
    tokio::task::yield_now().await;
    a.shutdown().await;
    assert_eq!(
        counted(&shared, now).await,
        1_000,
        "refused with room left ({served} served here, {} held)",
        a.held()
    );
}

/// A steady holder takes its later blocks while the lease mark it made
/// still counts it, so they join nothing; the mark ends one lease time
/// after it was made, while such a block is still held. Another
/// instance's refusal then has to tell the short wait (the units come
/// back within the holder's idle bound), not the wait until the reset.
#[tokio::test(start_paused = true)]
async fn a_refusal_while_a_steady_holder_keeps_a_block_past_its_first_mark_tells_the_short_wait() {
    const LIMIT: u64 = 1_000_000;
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let b = LeasedStore::new(shared.clone());
    let mut now = t0();
    // A steady subject on A: a call every 10 ms for 9.9 s (past the first
    // block's mark by nothing yet).
    busy(&a, &mut now, 990, LIMIT, 10).await;
    // A's subject now calls elsewhere: A is idle, and gives its block back
    // within its idle bound (1 s).
    tokio::time::advance(Duration::from_millis(300)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(300);
    let held = a.held();
    assert!(held > 0, "A still holds units");
    // B asks for exactly what would be left once A's units are back.
    let counted_now = counted(&shared, now).await;
    let mut line = line_of("acme", LIMIT);
    line.cost = LIMIT - (counted_now - held);
    let ask = ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![line],
    };
    let refused = b.charge(ask.clone()).await.unwrap();
    assert!(!refused.admitted);
    eprintln!(
        "held {held}; holders in the mark {}; held_elsewhere_until {:?}",
        holders(&shared, now).await,
        refused.usage[0].held_elsewhere_until
    );
    // Within A's idle bound, the same request is admitted.
    tokio::time::advance(Duration::from_millis(1_300)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(1_300);
    assert_eq!(a.held(), 0);
    let again = ChargeRequest {
        charged_at: None,
        now,
        ..ask
    };
    assert!(
        b.charge(again).await.unwrap().admitted,
        "A's units came back"
    );
    // So the refusal had to tell that they would.
    assert!(
        refused.usage[0].held_elsewhere_until.is_some(),
        "refused while A held {held} units, told to wait for the reset"
    );
}

#[tokio::test(start_paused = true)]
async fn a_block_goes_back_at_its_lease_time_though_its_subject_is_not_idle_yet() {
    let shared = MemoryStore::new();
    let leased = LeasedStore::builder(shared.clone())
        .lease_time(Duration::from_millis(500))
        .idle(Duration::from_secs(10))
        .max_block(20)
        .build();
    let mut now = t0();
    busy(&leased, &mut now, 3_000, 1_000_000, 1).await;
    assert!(leased.held() > 0);
    // Quiet for longer than the lease time, far less than the idle bound:
    // the block is old, and goes back without waiting for the idle bound.
    tokio::time::advance(Duration::from_millis(800)).await;
    for _ in 0..5 {
        tokio::task::yield_now().await;
    }
    assert_eq!(leased.held(), 0, "an old block goes back by the sweep");
    assert_eq!(counted(&shared, now).await, 3_000);
}

#[tokio::test(start_paused = true)]
async fn a_block_past_its_lease_time_is_not_spent_while_the_sweep_is_held_up() {
    // The sweep gives back another subject's idle block, slowly: its pass
    // waits for that give-back, and gives nothing else back meanwhile.
    let slow = Slow::default();
    let shared = slow.inner.clone();
    let leased = LeasedStore::builder(slow.clone())
        .lease_time(Duration::from_secs(1))
        .idle(Duration::from_millis(200))
        .build();
    let mut now = t0();
    let other = |now| ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![line_of("other", 1_000_000)],
    };
    for _ in 0..100 {
        assert!(leased.charge(other(now)).await.unwrap().admitted);
        assert!(call(&leased, now, 1_000_000).await.admitted);
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
    }
    slow.slow_refunds.store(60_000, Ordering::Relaxed);
    // Only acme calls now: the other subject's block goes back once idle,
    // and the sweep waits a minute for it.
    busy(&leased, &mut now, 300, 1_000_000, 1).await;
    assert!(leased.held() > 0, "acme holds a block");
    // A reset elsewhere, then more than the lease time without a request.
    shared.reset(day_key()).await.unwrap();
    tokio::time::advance(Duration::from_millis(1_100)).await;
    now += SignedDuration::from_millis(1_100);
    // The block is past its lease time: the request is the store's, and
    // counted on the new counter.
    assert!(call(&leased, now, 1_000_000).await.admitted);
    assert_eq!(counted(&shared, now).await, 1 + leased.held());
}

#[tokio::test(start_paused = true)]
async fn a_charges_late_answer_never_takes_back_an_add_answered_before_it() {
    // A charge that takes a block is applied first but answered late; an
    // add through the same instance, sent after it, is answered first.
    let slow = Slow::default();
    let a = LeasedStore::new(slow.clone());
    let mut now = t0();
    busy(&a, &mut now, 20, 10_000, 1).await;
    let mut served = 20 + spend_what_is_held(&a, now, 10_000).await;
    slow.late.store(50, Ordering::Relaxed);
    let late = tokio::spawn({
        let a = a.clone();
        async move { call(&a, now, 10_000).await }
    });
    tokio::task::yield_now().await;
    slow.late.store(0, Ordering::Relaxed);
    a.add(now, day_key(), 100).await.unwrap();
    assert!(late.await.unwrap().admitted);
    served += 1 + 100;
    assert!(a.held() > 0, "the charge took a block");
    // The late answer's count is older than the add's: the block's next
    // request is told the units added too.
    let next = call(&a, now, 10_000).await;
    assert!(next.admitted);
    served += 1;
    assert_eq!(next.usage[0].used, served);
}

#[tokio::test(start_paused = true)]
async fn a_busy_subject_back_after_five_lease_times_still_takes_a_large_block() {
    let leased = LeasedStore::new(MemoryStore::new());
    let mut now = t0();
    let mut largest = 0;
    for _ in 0..5 {
        busy(&leased, &mut now, 100, 1_000_000, 1).await;
        largest = largest.max(leased.held());
    }
    assert!(largest > 8);
    // Quiet for five lease times (of 10 s), a sweep a second: remembered
    // for six.
    for _ in 0..50 {
        tokio::time::advance(Duration::from_secs(1)).await;
        tokio::task::yield_now().await;
        now += SignedDuration::from_secs(1);
    }
    assert_eq!(leased.held(), 0);
    assert!(call(&leased, now, 1_000_000).await.admitted);
    tokio::time::advance(Duration::from_millis(200)).await;
    now += SignedDuration::from_millis(200);
    busy(&leased, &mut now, 1, 1_000_000, 1).await;
    assert!(
        leased.held() >= largest / 2,
        "{} of {largest}",
        leased.held()
    );
}

#[tokio::test(start_paused = true)]
async fn a_block_of_a_window_that_ended_is_dropped_without_a_store_call() {
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    // The last second of the day.
    let mut now: Timestamp = "2026-12-04T23:59:59Z".parse().unwrap();
    busy(&leased, &mut now, 500, 10_000, 1).await;
    assert!(leased.held() > 0);
    // The window ends while the block is held, and the subject goes quiet:
    // the block is dropped, and no give-back is sent for it.
    tokio::time::advance(Duration::from_secs(2)).await;
    tokio::task::yield_now().await;
    assert_eq!(leased.held(), 0, "the ended window's block is dropped");
    assert_eq!(inner.give_backs.load(Ordering::Relaxed), 0);
}

#[tokio::test(start_paused = true)]
async fn a_shutdown_after_the_window_ended_gives_nothing_back() {
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now: Timestamp = "2026-12-04T23:59:59Z".parse().unwrap();
    busy(&leased, &mut now, 500, 10_000, 1).await;
    // The window ends, the subject not idle yet: its block is still held.
    tokio::time::advance(Duration::from_millis(600)).await;
    tokio::task::yield_now().await;
    assert!(leased.held() > 0);
    assert_eq!(leased.shutdown().await, 0);
    assert_eq!(
        inner.give_backs.load(Ordering::Relaxed),
        0,
        "the ended window's block is dropped, not given back"
    );
}

#[tokio::test(start_paused = true)]
async fn a_first_block_is_at_most_eight_units_however_costly_the_requests() {
    let leased = LeasedStore::new(MemoryStore::new());
    let now = t0();
    let mut costly = request(now, 1_000_000);
    costly.lines[0].cost = 50;
    assert!(leased.charge(costly.clone()).await.unwrap().admitted);
    assert_eq!(leased.held(), 0, "the first request takes no block");
    tokio::time::advance(Duration::from_millis(1)).await;
    assert!(leased.charge(costly).await.unwrap().admitted);
    let held = leased.held();
    assert!((1..=8).contains(&held), "a first block of {held}");
}

#[tokio::test(start_paused = true)]
async fn a_refusal_waits_no_longer_than_the_holders_mark_lives() {
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let b = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&a, &mut now, 70, 100, 1).await;
    assert!(a.held() > 0);
    // A dies holding its block; its mark, made with its first block, ends
    // a lease time (10 s) after it, less than B's idle bound from now.
    drop(a);
    tokio::time::advance(Duration::from_millis(9_500)).await;
    now += SignedDuration::from_millis(9_500);
    while call(&b, now, 100).await.admitted {}
    tokio::task::yield_now().await;
    let refused = call(&b, now, 100).await;
    assert!(!refused.admitted);
    let until = refused.usage[0]
        .held_elsewhere_until
        .expect("A holds units");
    assert!(until > now);
    assert!(
        until < now + SignedDuration::from_secs(1),
        "told {until}, past the end of the mark"
    );
}

#[tokio::test(start_paused = true)]
async fn past_its_bound_of_counters_a_subject_is_charged_request_by_request() {
    let inner = Counting::default();
    let leased = LeasedStore::builder(inner.clone()).max_counters(1).build();
    let mut now = t0();
    busy(&leased, &mut now, 100, 1_000_000, 1).await;
    let held = leased.held();
    assert!(held > 0, "the first subject is tracked, and takes blocks");
    let before = inner.charges.load(Ordering::Relaxed);
    for _ in 0..50 {
        let other = ChargeRequest {
            charged_at: None,
            now,
            lines: smallvec::smallvec![line_of("other", 1_000_000)],
        };
        assert!(leased.charge(other).await.unwrap().admitted);
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
    }
    assert_eq!(leased.held(), held, "no block of the second subject");
    assert_eq!(inner.charges.load(Ordering::Relaxed) - before, 50);
    assert_eq!(counted_for(&inner, "other", now).await, 50);
}

#[tokio::test(start_paused = true)]
async fn an_idle_holder_leaves_a_mark_that_ends_more_than_a_tenth_of_a_lease_time_later() {
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let mut now = t0();
    // A's mark is made with its first block and lives a lease time (10 s).
    busy(&a, &mut now, 600, 1_000_000, 10).await;
    assert_eq!(holders(&shared, now).await, 1);
    // Idle: its block goes back about 3 s before the mark ends, and it
    // leaves the mark.
    tokio::time::advance(Duration::from_secs(2)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_secs(2);
    assert_eq!(a.held(), 0);
    assert_eq!(holders(&shared, now).await, 0);
}

#[tokio::test(start_paused = true)]
async fn an_idle_holder_leaves_a_mark_that_ends_within_a_tenth_of_a_lease_time_alone() {
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&a, &mut now, 840, 1_000_000, 10).await;
    assert_eq!(holders(&shared, now).await, 1);
    // Idle: its block goes back less than a second before the mark ends:
    // the mark is left alone, and ends on its own.
    tokio::time::advance(Duration::from_millis(1_400)).await;
    tokio::task::yield_now().await;
    now += SignedDuration::from_millis(1_400);
    assert_eq!(a.held(), 0);
    assert_eq!(holders(&shared, now).await, 1);
    tokio::time::advance(Duration::from_millis(700)).await;
    now += SignedDuration::from_millis(700);
    assert_eq!(holders(&shared, now).await, 0);
}

#[tokio::test(start_paused = true)]
async fn a_block_goes_back_at_the_first_sweep_once_its_subject_was_idle_for_the_idle_bound() {
    // Sweeps every 5 ms (a quarter of the idle bound); five subjects stop
    // a millisecond apart, so that one of them was idle exactly the idle
    // bound at a sweep, whatever the sweeps' phase.
    let shared = MemoryStore::new();
    let leased = LeasedStore::builder(shared.clone())
        .idle(Duration::from_millis(20))
        .build();
    let subjects = ["s0", "s1", "s2", "s3", "s4"];
    let mut now = t0();
    let mut served = [0u64; 5];
    let mut last = [now; 5];
    for step in 0..35 {
        for (j, subject) in subjects.iter().enumerate() {
            if step < 30 + j {
                let line = line_of(subject, 1_000_000);
                let outcome = leased
                    .charge(ChargeRequest {
                        charged_at: None,
                        now,
                        lines: smallvec::smallvec![line],
                    })
                    .await
                    .unwrap();
                assert!(outcome.admitted);
                served[j] += 1;
                last[j] = now;
            }
        }
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
    }
    // Each subject's block is back within the idle bound and a sweep's
    // interval (less a millisecond) of its last request.
    for _ in 0..30 {
        for _ in 0..5 {
            tokio::task::yield_now().await;
        }
        for (j, subject) in subjects.iter().enumerate() {
            if now == last[j] + SignedDuration::from_millis(24) {
                assert_eq!(
                    counted_for(&shared, subject, now).await,
                    served[j],
                    "{subject}'s block is back"
                );
            }
        }
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
    }
}

#[tokio::test(start_paused = true)]
async fn a_shutdown_leaves_the_mark_of_a_block_spent_to_its_last_unit() {
    let shared = MemoryStore::new();
    let leased = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&leased, &mut now, 100, 1_000_000, 1).await;
    spend_what_is_held(&leased, now, 1_000_000).await;
    // Nothing held, still in the mark (it leaves with its next answer).
    assert_eq!(holders(&shared, now).await, 1);
    assert_eq!(leased.shutdown().await, 0);
    assert_eq!(holders(&shared, now).await, 0, "the shutdown left the mark");
}

/// Near the limit, a block is at most a quarter of what the counter had
/// left (its request's cost aside): a block of `b` taken when the store
/// counted `s` leaves `limit - s - cost - b >= 3b` to nobody, so that other
/// instances are refused for as few units as this one holds.
#[tokio::test(start_paused = true)]
async fn a_block_is_at_most_a_quarter_of_what_the_counter_had_left() {
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    let limit = 1_000;
    let (mut admitted, mut near) = (0, 0);
    loop {
        let before = leased.held();
        let outcome = call(&leased, now, limit).await;
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        if !outcome.admitted {
            break;
        }
        admitted += 1;
        let held = leased.held();
        if held > before {
            // A block landed: nothing else was charged since its charge.
            let left = limit - counted(&inner, now).await;
            assert!(
                3 * held <= left,
                "a block of {held} with {left} left to nobody"
            );
            near += u64::from(left < 400);
        }
        tokio::time::advance(Duration::from_millis(1)).await;
        now += SignedDuration::from_millis(1);
    }
    assert!(near >= 3, "{near} blocks taken near the limit");
    assert_eq!(admitted, limit);
    assert_eq!(counted(&inner, now).await, limit);
}

/// A steady subject's block is what it spends in about four fifths of a
/// lease time (50 a second here, a lease time of 10 s: 400 units, below
/// the largest block): it is spent before the lease time ends, so no block
/// ever goes back old, and the next one is taken as it runs out.
#[tokio::test(start_paused = true)]
async fn a_steady_subjects_block_is_what_it_spends_in_four_fifths_of_a_lease_time() {
    let inner = Counting::default();
    let leased = LeasedStore::new(inner.clone());
    let mut now = t0();
    let mut largest = 0;
    for _ in 0..3_000 {
        assert!(call(&leased, now, 1_000_000).await.admitted);
        largest = largest.max(leased.held());
        tokio::time::advance(Duration::from_millis(20)).await;
        now += SignedDuration::from_millis(20);
    }
    assert!((380..=402).contains(&largest), "a block of {largest}");
    assert_eq!(
        inner.give_backs.load(Ordering::Relaxed),
        0,
        "no block went back"
    );
    let charges = inner.charges.load(Ordering::Relaxed);
    assert!(charges <= 20, "{charges} charges for 3 000 requests");
}

/// A debt settled through an instance that holds a block of its counter
/// (the ledger's settle of fail-open admissions) is answered as an add is:
/// the count after it, this instance's unused units counted as not spent;
/// and the block's next request is told the debt too.
#[tokio::test(start_paused = true)]
async fn a_settle_through_a_block_holder_tells_the_count_without_its_units() {
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&a, &mut now, 20, 10_000, 1).await;
    let held = a.held();
    assert!(held > 1, "a block is held");
    let debt = tower_quota::store::Debt {
        key: day_key(),
        amount: 100,
        lifetime: day(),
        since: now,
        id: 7,
    };
    let told = a.settle_debt(now, debt).await.unwrap();
    assert_eq!(told, Some(20 + 100), "{held} held here");
    assert_eq!(counted(&shared, now).await, 20 + 100 + held);
    let next = call(&a, now, 10_000).await;
    assert!(next.admitted);
    assert_eq!(a.held(), held - 1, "served from the block");
    assert_eq!(next.usage[0].used, 20 + 100 + 1);
}

/// A request whose block no longer fits (another instance spent nearly all
/// that was left) keeps a quarter of what the store gave and sends the
/// rest straight back: the count it is told leaves that rest out, as the
/// store counts once it lands (what this instance holds aside).
#[tokio::test(start_paused = true)]
async fn the_usage_told_with_a_block_cut_short_leaves_out_what_goes_back() {
    let shared = MemoryStore::new();
    let a = LeasedStore::new(shared.clone());
    let mut now = t0();
    busy(&a, &mut now, 200, 1_000, 1).await;
    assert!(a.held() > 0, "a block is held");
    // Another instance spends all but 40 of what nobody holds, and this
    // one its block.
    while counted(&shared, now).await < 960 {
        assert!(call(&shared, now, 1_000).await.admitted);
    }
    spend_what_is_held(&a, now, 1_000).await;
    let outcome = call(&a, now, 1_000).await;
    assert!(outcome.admitted);
    // The rest of the block cut short lands.
    for _ in 0..4 {
        tokio::task::yield_now().await;
    }
    let held = a.held();
    assert!((1..=10).contains(&held), "a quarter kept: {held}");
    let counted = counted(&shared, now).await;
    assert!(counted < 1_000, "the rest went back: {counted}");
    assert_eq!(outcome.usage[0].used, counted - held);
}
