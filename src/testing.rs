//! The conformance suite: what every [`Store`] must do, as tests you can run
//! against your own store.
//!
//! Each check drives the store through the [`Store`] trait alone and panics
//! with a sentence naming the broken rule:
//!
//! - [`hits_never_extend_a_first_use_deadline`]: every write path (admitted,
//!   refused and zero-cost charges, refunds) keeps a first-use counter's
//!   deadline, and the period ends when it says.
//! - [`refund_after_expiry_does_not_resurrect`]: a refund never creates a
//!   counter.
//! - [`add_never_creates_nor_moves_a_deadline`]: an add after the fact
//!   ([`Store::add`]) goes past the limit if it must, but never creates a
//!   counter, never brings an expired one back and never moves a deadline.
//! - [`exactly_the_limit_under_concurrency`]: many tasks charging one subject
//!   at once get exactly the limit admitted.
//! - [`all_or_nothing_across_quotas`]: a request refused on one quota is
//!   charged on none.
//! - [`a_refused_charge_writes_nothing`]: a refused request leaves every
//!   counter it names exactly as it was (count, first call, deadline, and
//!   an undated counter undated), and creates none.
//! - [`an_abandoned_charge_spends_nothing`]: a charge whose future is
//!   dropped before it answered ends either not applied, or applied and
//!   given back.
//! - [`undated_counter_is_healed`]: a counter found without a deadline gets
//!   one from the next admitted charge.
//! - [`calendar_counters_are_distinct_per_period_and_dated`]: each calendar
//!   window has its own counter, and that counter has a deadline.
//! - [`counts_never_pass_the_limit_nor_wrap`]: at the top of `u64`, a charge
//!   that would pass its limit is refused and an add never leaves a smaller
//!   count: nothing wraps.
//!
//! A store tells the suite what it cannot be driven to do through the trait
//! through [`ConformanceHooks`]: how its deadlines pass ([`Expiry`]), how to
//! plant a counter without a deadline, and how to read a stored deadline.
//! Every hook has a default, so `impl ConformanceHooks for MyStore {}` is
//! enough to start.
//!
//! # Example
//!
//! ```
//! use tower_quota::testing::{self, Verdict};
//! use tower_quota::MemoryStore;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let verdicts = testing::run_all(&MemoryStore::new()).await;
//! assert!(verdicts.iter().any(|(_, v)| *v == Verdict::Passed));
//! # }
//! ```

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};

use crate::key::{Namespace, PeriodKey};
use crate::store::{ChargeLine, ChargeRequest, Lifetime, MemoryStore, Store, StoreError, Usage};
use crate::subject::Subject;

/// How a store's deadlines pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    /// A counter is live while the `now` of the calls that reach it is
    /// before its deadline (as in [`MemoryStore`]). The suite moves a clock
    /// of its own through the calls and never sleeps.
    FollowsRequests,
    /// Deadlines pass on the store's own clock (as in Redis). The suite
    /// uses the system clock, periods of a few seconds, and sleeps; times
    /// the store reports may be off by up to `tolerance`.
    RealTime {
        /// How far a reported reset or deadline may be from the exact one.
        tolerance: Duration,
    },
}

/// What [`ConformanceHooks::plant_undated`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Planted {
    /// The counter is stored, without a deadline.
    Planted,
    /// The store cannot hold a counter without a deadline, so it cannot
    /// meet one; the check does not apply.
    NotApplicable,
}

/// A counter's deadline as the store holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredDeadline {
    /// There is no counter at the key.
    NoCounter,
    /// The counter has no deadline.
    Undated,
    /// The counter's deadline.
    At(Timestamp),
    /// The store cannot tell.
    Unknown,
}

/// The result of one check. A broken rule panics instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The store keeps the rule.
    Passed,
    /// The rule cannot be checked on this store; the reason says why.
    NotApplicable(&'static str),
}

/// What the suite needs from a store beyond [`Store`].
pub trait ConformanceHooks: Store {
    /// How the store's deadlines pass. Default: [`Expiry::FollowsRequests`].
    fn expiry(&self) -> Expiry {
        Expiry::FollowsRequests
    }

    /// Stores a counter at `key` holding `used` units and no deadline, as
    /// another tool or an older version could have left it; `first_call` is
    /// the period's first call if the counter records one. Default:
    /// [`Planted::NotApplicable`].
    fn plant_undated(
        &self,
        key: PeriodKey,
        used: u64,
        first_call: Option<Timestamp>,
    ) -> impl Future<Output = Result<Planted, StoreError>> + Send {
        let _ = (key, used, first_call);
        async { Ok(Planted::NotApplicable) }
    }

    /// The deadline the store holds for the counter at `key`. Default:
    /// [`StoredDeadline::Unknown`], in which case the suite checks deadlines
    /// through what the store reports and when counters end.
    fn stored_deadline(
        &self,
        key: PeriodKey,
    ) -> impl Future<Output = Result<StoredDeadline, StoreError>> + Send {
        let _ = key;
        async { Ok(StoredDeadline::Unknown) }
    }
}

/// The memory store keeps every counter with the deadline it is created
/// with, and nothing else writes to it, so it cannot hold an undated counter:
/// [`undated_counter_is_healed`] does not apply. Its counters end when a
/// call's `now` reaches their deadline.
impl ConformanceHooks for MemoryStore {}

#[cfg(feature = "redis")]
impl ConformanceHooks for crate::store::RedisStore {
    fn expiry(&self) -> Expiry {
        Expiry::RealTime {
            tolerance: Duration::from_millis(250),
        }
    }

    fn plant_undated(
        &self,
        key: PeriodKey,
        used: u64,
        first_call: Option<Timestamp>,
    ) -> impl Future<Output = Result<Planted, StoreError>> + Send {
        let store = self.clone();
        async move {
            use deadpool_redis::redis;
            let mut hset = redis::cmd("HSET");
            hset.arg(key.as_str()).arg("n").arg(used);
            if let Some(first_call) = first_call {
                hset.arg("t").arg(first_call.as_millisecond());
            }
            let () = store.command::<redis::Value>(hset).await.map(drop)?;
            let () = store
                .command::<redis::Value>(redis::cmd("PERSIST").arg(key.as_str()).clone())
                .await
                .map(drop)?;
            Ok(Planted::Planted)
        }
    }

    fn stored_deadline(
        &self,
        key: PeriodKey,
    ) -> impl Future<Output = Result<StoredDeadline, StoreError>> + Send {
        let store = self.clone();
        async move {
            use deadpool_redis::redis;
            let now = Timestamp::now();
            let pttl: i64 = store
                .command(redis::cmd("PTTL").arg(key.as_str()).clone())
                .await?;
            Ok(match pttl {
                -2 => StoredDeadline::NoCounter,
                -1 => StoredDeadline::Undated,
                ms => StoredDeadline::At(now + SignedDuration::from_millis(ms)),
            })
        }
    }
}

/// Runs every check, in order, and returns each one's name and verdict.
///
/// # Panics
///
/// When the store breaks a rule, or fails to answer.
pub async fn run_all<S: ConformanceHooks>(store: &S) -> Vec<(&'static str, Verdict)> {
    vec![
        (
            "hits_never_extend_a_first_use_deadline",
            hits_never_extend_a_first_use_deadline(store).await,
        ),
        (
            "refund_after_expiry_does_not_resurrect",
            refund_after_expiry_does_not_resurrect(store).await,
        ),
        (
            "add_never_creates_nor_moves_a_deadline",
            add_never_creates_nor_moves_a_deadline(store).await,
        ),
        (
            "exactly_the_limit_under_concurrency",
            exactly_the_limit_under_concurrency(store).await,
        ),
        (
            "all_or_nothing_across_quotas",
            all_or_nothing_across_quotas(store).await,
        ),
        (
            "a_refused_charge_writes_nothing",
            a_refused_charge_writes_nothing(store).await,
        ),
        (
            "an_abandoned_charge_spends_nothing",
            an_abandoned_charge_spends_nothing(store).await,
        ),
        (
            "undated_counter_is_healed",
            undated_counter_is_healed(store).await,
        ),
        (
            "calendar_counters_are_distinct_per_period_and_dated",
            calendar_counters_are_distinct_per_period_and_dated(store).await,
        ),
        (
            "counts_never_pass_the_limit_nor_wrap",
            counts_never_pass_the_limit_nor_wrap(store).await,
        ),
    ]
}

/// Hits never extend a first-use deadline, whatever the write path, and the
/// period ends at that deadline.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn hits_never_extend_a_first_use_deadline<S: ConformanceHooks>(store: &S) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    let period = time.period();
    let key = fresh_key("first-use");
    let t0 = time.now();
    let deadline = t0 + period;

    let first = charge(
        store,
        time.now(),
        vec![first_use(&key, 100, 1, time.now() + period)],
    )
    .await;
    assert!(
        first.0,
        "a first charge on an empty counter must be admitted"
    );
    time.assert_near(
        first.1[0].resets_at,
        deadline,
        "the reset of a new first-use counter is its deadline",
    );
    time.assert_near_opt(
        first.1[0].first_call,
        t0,
        "a new first-use counter records its first call",
    );
    expect_deadline(store, &time, &key, deadline, "after the creating charge").await;

    time.pass(period / 3).await;
    let hit = charge(
        store,
        time.now(),
        vec![first_use(&key, 100, 1, time.now() + period)],
    )
    .await;
    assert!(hit.0, "a charge with room must be admitted");
    assert_eq!(hit.1[0].used, 2, "a later hit adds to the open period");
    time.assert_near(
        hit.1[0].resets_at,
        deadline,
        "a later hit must not move the first-use deadline",
    );
    time.assert_near_opt(hit.1[0].first_call, t0, "a later hit keeps the first call");
    expect_deadline(store, &time, &key, deadline, "after a later hit").await;

    let refused = charge(
        store,
        time.now(),
        vec![first_use(&key, 100, 1_000, time.now() + period)],
    )
    .await;
    assert!(!refused.0, "a charge over the limit must be refused");
    assert_eq!(refused.1[0].used, 2, "a refused charge spends nothing");
    time.assert_near(
        refused.1[0].resets_at,
        deadline,
        "a refused charge must not move the deadline",
    );
    expect_deadline(store, &time, &key, deadline, "after a refused charge").await;

    let free = charge(
        store,
        time.now(),
        vec![first_use(&key, 100, 0, time.now() + period)],
    )
    .await;
    assert!(
        free.0,
        "a zero-cost charge within the limit must be admitted"
    );
    time.assert_near(
        free.1[0].resets_at,
        deadline,
        "a zero-cost charge must not move the deadline",
    );

    let left = refund(store, time.now(), &key, 1).await;
    assert_eq!(left, Some(1), "a refund gives units back to a live counter");
    expect_deadline(store, &time, &key, deadline, "after a refund").await;
    let peeked = peek(
        store,
        time.now(),
        vec![first_use(&key, 100, 0, time.now() + period)],
    )
    .await;
    assert_eq!(peeked[0].used, 1, "peek sees the refund");
    time.assert_near(
        peeked[0].resets_at,
        deadline,
        "a refund must not move the deadline",
    );

    time.pass_beyond(deadline).await;
    let after = peek(
        store,
        time.now(),
        vec![first_use(&key, 100, 0, time.now() + period)],
    )
    .await;
    assert_eq!(
        after[0].used, 0,
        "a first-use period must end at its deadline"
    );
    let reopened_at = time.now();
    let reopened = charge(
        store,
        reopened_at,
        vec![first_use(&key, 100, 1, reopened_at + period)],
    )
    .await;
    assert!(
        reopened.0,
        "the first charge of a new period must be admitted"
    );
    assert_eq!(reopened.1[0].used, 1, "a new period starts from zero");
    time.assert_near(
        reopened.1[0].resets_at,
        reopened_at + period,
        "a new period's deadline is one period from its first call",
    );
    Verdict::Passed
}

/// A refund after a counter's deadline does not bring the counter back.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn refund_after_expiry_does_not_resurrect<S: ConformanceHooks>(store: &S) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    let period = time.period();
    let key = fresh_key("refund");
    let t0 = time.now();
    let deadline = t0 + period;
    let charged = charge(store, t0, vec![first_use(&key, 10, 3, deadline)]).await;
    assert!(
        charged.0,
        "a first charge on an empty counter must be admitted"
    );

    time.pass_beyond(deadline).await;
    let left = refund(store, time.now(), &key, 1).await;
    assert_eq!(
        left, None,
        "a refund after the deadline must find no counter"
    );
    let peeked = peek(
        store,
        time.now(),
        vec![first_use(&key, 10, 0, time.now() + period)],
    )
    .await;
    assert_eq!(
        peeked[0].used, 0,
        "a refund must not bring an expired counter back"
    );
    assert_eq!(
        peeked[0].first_call, None,
        "a refund must not open a period"
    );
    match stored(store, &key).await {
        StoredDeadline::At(at) if at > time.now() => {
            panic!(
                "a refund after the deadline must not create a counter (found one, deadline {at})"
            )
        }
        StoredDeadline::Undated => {
            panic!("a refund after the deadline must not create a counter (found one, undated)")
        }
        _ => {}
    }
    let again = charge(
        store,
        time.now(),
        vec![first_use(&key, 10, 1, time.now() + period)],
    )
    .await;
    assert_eq!(again.1[0].used, 1, "the next charge opens a fresh period");

    let never = fresh_key("refund-never-charged");
    assert_eq!(
        refund(store, time.now(), &never, 5).await,
        None,
        "a refund on a key never charged must find no counter"
    );
    assert!(
        matches!(
            stored(store, &never).await,
            StoredDeadline::NoCounter | StoredDeadline::Unknown
        ),
        "a refund must never create a counter"
    );
    Verdict::Passed
}

/// An add after the fact ([`Store::add`]) changes only the count of a live
/// counter: it finds nothing on a key never charged and creates nothing
/// there, keeps a first-use counter's deadline and first call while it takes
/// the count past the limit, and after the deadline finds nothing and brings
/// nothing back, so the next charge opens a period of its own.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn add_never_creates_nor_moves_a_deadline<S: ConformanceHooks>(store: &S) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    let period = time.period();

    let never = fresh_key("add-never-charged");
    assert_eq!(
        add(store, time.now(), &never, 5).await,
        None,
        "an add on a key never charged must find no counter"
    );
    assert!(
        matches!(
            stored(store, &never).await,
            StoredDeadline::NoCounter | StoredDeadline::Unknown
        ),
        "an add must never create a counter"
    );
    let peeked = peek(
        store,
        time.now(),
        vec![first_use(&never, 10, 0, time.now() + period)],
    )
    .await;
    assert_eq!(peeked[0].used, 0, "an add must never create a counter");
    assert_eq!(peeked[0].first_call, None, "an add must not open a period");
    let opened_at = time.now();
    let opened = charge(
        store,
        opened_at,
        vec![first_use(&never, 10, 1, opened_at + period)],
    )
    .await;
    assert_eq!(
        opened.1[0].used, 1,
        "after an add found no counter, the first charge starts from zero"
    );
    time.assert_near(
        opened.1[0].resets_at,
        opened_at + period,
        "after an add found no counter, the first charge opens the period",
    );

    let key = fresh_key("add");
    let t0 = time.now();
    let deadline = t0 + period;
    let first = charge(store, t0, vec![first_use(&key, 10, 3, deadline)]).await;
    assert!(
        first.0,
        "a first charge on an empty counter must be admitted"
    );
    time.pass(period / 3).await;
    assert_eq!(
        add(store, time.now(), &key, 4).await,
        Some(7),
        "an add adds to a live counter"
    );
    expect_deadline(store, &time, &key, deadline, "after an add").await;
    assert_eq!(
        add(store, time.now(), &key, 20).await,
        Some(27),
        "an add is not checked against the limit"
    );
    assert_eq!(
        add(store, time.now(), &key, 0).await,
        Some(27),
        "an add of nothing reports the count"
    );
    expect_deadline(store, &time, &key, deadline, "after an add past the limit").await;
    let peeked = peek(
        store,
        time.now(),
        vec![first_use(&key, 10, 0, time.now() + period)],
    )
    .await;
    assert_eq!(peeked[0].used, 27, "peek sees what was added");
    time.assert_near(
        peeked[0].resets_at,
        deadline,
        "an add must not move the deadline",
    );
    time.assert_near_opt(peeked[0].first_call, t0, "an add keeps the first call");
    let refused = charge(
        store,
        time.now(),
        vec![first_use(&key, 10, 1, time.now() + period)],
    )
    .await;
    assert!(
        !refused.0,
        "a counter an add took past its limit refuses charges"
    );
    assert_eq!(refused.1[0].used, 27, "a refused charge spends nothing");
    time.assert_near(
        refused.1[0].resets_at,
        deadline,
        "an add must not move the deadline",
    );

    time.pass_beyond(deadline).await;
    assert_eq!(
        add(store, time.now(), &key, 1).await,
        None,
        "an add after the deadline must find no counter"
    );
    let peeked = peek(
        store,
        time.now(),
        vec![first_use(&key, 10, 0, time.now() + period)],
    )
    .await;
    assert_eq!(
        peeked[0].used, 0,
        "an add must not bring an expired counter back"
    );
    assert_eq!(peeked[0].first_call, None, "an add must not open a period");
    match stored(store, &key).await {
        StoredDeadline::At(at) if at > time.now() => {
            panic!("an add after the deadline must not create a counter (found one, deadline {at})")
        }
        StoredDeadline::Undated => {
            panic!("an add after the deadline must not create a counter (found one, undated)")
        }
        _ => {}
    }
    let reopened_at = time.now();
    let reopened = charge(
        store,
        reopened_at,
        vec![first_use(&key, 10, 1, reopened_at + period)],
    )
    .await;
    assert!(
        reopened.0,
        "the first charge of a new period must be admitted"
    );
    assert_eq!(
        reopened.1[0].used, 1,
        "the next charge opens a fresh period"
    );
    time.assert_near(
        reopened.1[0].resets_at,
        reopened_at + period,
        "a new period's deadline is one period from its first call",
    );
    Verdict::Passed
}

/// Many tasks charging one subject at once: exactly the limit is admitted.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn exactly_the_limit_under_concurrency<S: ConformanceHooks>(store: &S) -> Verdict {
    const LIMIT: u64 = 50;
    const TASKS: usize = 64;
    const EACH: usize = 4;
    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let keys = Keys::new();
    let key = keys.key("concurrent");
    let calendar = keys.key("concurrent-calendar");
    let start = time.now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..TASKS {
        let store = store.clone();
        let key = key.clone();
        let calendar = calendar.clone();
        tasks.spawn(async move {
            let mut admitted = 0u64;
            for _ in 0..EACH {
                let request = ChargeRequest {
                    now: start,
                    lines: vec![
                        first_use(&key, LIMIT, 1, start + period),
                        calendar_line(&calendar, LIMIT * 2, 1, start, start + period),
                    ],
                };
                let outcome = store
                    .charge(request)
                    .await
                    .unwrap_or_else(|e| panic!("the store failed under concurrency: {e}"));
                if outcome.admitted {
                    admitted += 1;
                }
            }
            admitted
        });
    }
    let mut admitted = 0;
    while let Some(result) = tasks.join_next().await {
        admitted += result.expect("a charging task panicked");
    }
    assert_eq!(
        admitted, LIMIT,
        "exactly the limit must be admitted under concurrency"
    );
    let usage = peek(
        store,
        start,
        vec![
            first_use(&key, LIMIT, 0, start + period),
            calendar_line(&calendar, LIMIT * 2, 0, start, start + period),
        ],
    )
    .await;
    assert_eq!(
        usage[0].used, LIMIT,
        "the counter holds exactly the admitted charges"
    );
    assert_eq!(
        usage[1].used, LIMIT,
        "a quota with room is charged only with the requests admitted on all quotas"
    );
    Verdict::Passed
}

/// A request refused on one quota is charged on none.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn all_or_nothing_across_quotas<S: ConformanceHooks>(store: &S) -> Verdict {
    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let now = time.now();
    let keys = Keys::new();
    let roomy = keys.key("roomy");
    let tight = keys.key("tight");
    let daily = keys.key("calendar");
    let lines = |cost| {
        vec![
            first_use(&roomy, 10, cost, now + period),
            calendar_line(&daily, 10, cost, now, now + period),
            first_use(&tight, 1, cost, now + period),
        ]
    };
    let first = charge(store, now, lines(1)).await;
    assert!(
        first.0,
        "a request with room on every quota must be admitted"
    );
    assert_eq!(
        first.1.iter().map(|u| u.used).collect::<Vec<_>>(),
        [1, 1, 1],
        "an admitted request is charged on every quota"
    );
    let second = charge(store, now, lines(1)).await;
    assert!(!second.0, "a request over one quota must be refused");
    assert_eq!(
        second.1.iter().map(|u| u.used).collect::<Vec<_>>(),
        [1, 1, 1],
        "a refused request must be charged on no quota"
    );
    let peeked = peek(store, now, lines(0)).await;
    assert_eq!(
        peeked.iter().map(|u| u.used).collect::<Vec<_>>(),
        [1, 1, 1],
        "a refused request must leave every counter as it was"
    );
    let fresh = keys.key("never-created");
    let refused_fresh = charge(
        store,
        now,
        vec![
            first_use(&fresh, 10, 1, now + period),
            first_use(&tight, 1, 1, now + period),
        ],
    )
    .await;
    assert!(!refused_fresh.0, "a request over one quota must be refused");
    assert_eq!(
        peek(store, now, vec![first_use(&fresh, 10, 0, now + period)]).await[0].used,
        0,
        "a refused request must not create the counters of its other quotas"
    );
    assert!(
        matches!(
            stored(store, &fresh).await,
            StoredDeadline::NoCounter | StoredDeadline::Unknown
        ),
        "a refused request must not create the counters of its other quotas"
    );
    Verdict::Passed
}

/// A refused charge writes nothing: every counter of the request keeps its
/// count, its first call and its deadline, a counter without a deadline
/// stays without one (healing it is a write, left to the next admitted
/// charge), and the request creates no counter. Peeks write nothing either.
///
/// The request names a first-use counter and a calendar counter with room, a
/// key never charged, an undated counter (when the store can hold one, see
/// [`ConformanceHooks::plant_undated`]) and, last, a counter at its limit.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn a_refused_charge_writes_nothing<S: ConformanceHooks>(store: &S) -> Verdict {
    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let now = time.now();
    let keys = Keys::new();
    let roomy = keys.key("roomy");
    let daily = keys.key("calendar");
    let fresh = keys.key("never-created");
    let undated = keys.key("undated");
    let tight = keys.key("tight");
    let set_up = charge(
        store,
        now,
        vec![
            first_use(&roomy, 10, 2, now + period),
            calendar_line(&daily, 10, 1, now, now + period),
            first_use(&tight, 1, 1, now + period),
        ],
    )
    .await;
    assert!(
        set_up.0,
        "a request with room on every quota must be admitted"
    );
    let planted = store
        .plant_undated(undated.clone(), 3, Some(now - period / 2))
        .await
        .unwrap_or_else(|e| panic!("the store failed to plant an undated counter: {e}"));

    let mut lines = vec![
        first_use(&roomy, 10, 1, now + period),
        calendar_line(&daily, 10, 1, now, now + period),
        first_use(&fresh, 10, 1, now + period),
    ];
    if planted == Planted::Planted {
        lines.push(first_use(&undated, 10, 1, now + period));
    }
    lines.push(first_use(&tight, 1, 1, now + period));
    let costless: Vec<ChargeLine> = lines
        .iter()
        .map(|l| ChargeLine {
            cost: 0,
            ..l.clone()
        })
        .collect();

    let before = peek(store, now, costless.clone()).await;
    let mut deadlines = Vec::with_capacity(lines.len());
    for line in &lines {
        deadlines.push(stored(store, &line.key).await);
    }
    let refused = charge(store, now, lines.clone()).await;
    assert!(!refused.0, "a request over one quota must be refused");
    let after = peek(store, now, costless).await;
    for (i, line) in lines.iter().enumerate() {
        let key = line.key.as_str();
        for (usage, what) in [(&refused.1[i], "reported"), (&after[i], "peeked")] {
            assert_eq!(
                usage.used, before[i].used,
                "a refused charge must write nothing: the count of {key} changed ({what})"
            );
            assert_eq!(
                usage.first_call, before[i].first_call,
                "a refused charge must write nothing: the first call of {key} changed ({what})"
            );
            time.assert_near(
                usage.resets_at,
                before[i].resets_at,
                &format!("a refused charge must write nothing: the reset of {key} moved ({what})"),
            );
        }
        match (deadlines[i], stored(store, &line.key).await) {
            (StoredDeadline::At(was), StoredDeadline::At(is)) => time.assert_near(
                is,
                was,
                &format!("a refused charge must write nothing: the deadline of {key} moved"),
            ),
            (was, is) => assert_eq!(
                is, was,
                "a refused charge must write nothing: the deadline of {key} changed"
            ),
        }
    }
    Verdict::Passed
}

/// A charge whose caller stopped waiting spends nothing: a charge future
/// dropped before its first poll, or after a first poll that left it
/// pending (sent, not yet answered), ends either not applied, or applied and
/// given back. The count comes back to what the answered charges made it,
/// and stays there. (A store whose charges answer on their first poll is
/// only checked on the first case.)
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn an_abandoned_charge_spends_nothing<S: ConformanceHooks>(store: &S) -> Verdict {
    use std::task::{Context, Poll, Waker};

    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let now = time.now();
    let keys = Keys::new();
    let key = keys.key("abandoned");
    let line = || first_use(&key, 1_000, 1, now + period);
    let (admitted, _) = charge(store, now, vec![line()]).await;
    assert!(admitted, "a charge with room must be admitted");
    let mut answered = 1;

    // Dropped before it was ever polled.
    drop(store.charge(ChargeRequest {
        now,
        lines: vec![line()],
    }));
    // Polled once, then dropped unless it answered at once.
    let mut pending = 0;
    for _ in 0..20 {
        let mut future = std::pin::pin!(store.charge(ChargeRequest {
            now,
            lines: vec![line()],
        }));
        match future
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
        {
            Poll::Ready(Ok(outcome)) => {
                assert!(outcome.admitted, "a charge with room must be admitted");
                answered += 1;
            }
            // A store that sheds load while earlier charges are given back
            // may refuse at once: that charge was never applied.
            Poll::Ready(Err(_)) | Poll::Pending => pending += 1,
        }
    }

    // Given back in time: the count comes back to the answered charges and
    // stays there a while.
    let costless = || vec![ChargeLine { cost: 0, ..line() }];
    // However the store's deadlines pass, it may give back in a task of its
    // own: a few seconds to settle, then a steady second.
    let settle = Duration::from_secs(10);
    let started = std::time::Instant::now();
    let mut steady = 0;
    loop {
        let used = peek(store, now, costless()).await[0].used;
        if used == answered {
            steady += 1;
            if steady == 10 {
                break;
            }
        } else {
            steady = 0;
            assert!(
                started.elapsed() < settle,
                "an abandoned charge must spend nothing: {used} units spent after {answered} \
                 answered charges ({pending} charges dropped while pending)"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Verdict::Passed
}

/// A counter found without a deadline gets one from the next admitted
/// charge: its first call plus one period when the first call is known, else
/// one period from now; and a counter whose period is long over starts
/// afresh.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn undated_counter_is_healed<S: ConformanceHooks>(store: &S) -> Verdict {
    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let now = time.now();

    let known = fresh_key("undated-known");
    let first_call = now - period / 2;
    if store
        .plant_undated(known.clone(), 3, Some(first_call))
        .await
        .unwrap_or_else(|e| panic!("the store failed to plant an undated counter: {e}"))
        == Planted::NotApplicable
    {
        return Verdict::NotApplicable("the store cannot hold a counter without a deadline");
    }
    assert_eq!(
        stored(store, &known).await,
        StoredDeadline::Undated,
        "plant_undated must leave the counter without a deadline"
    );
    let healed = charge(store, now, vec![first_use(&known, 10, 1, now + period)]).await;
    assert!(
        healed.0,
        "a charge with room on an undated counter must be admitted"
    );
    assert_eq!(healed.1[0].used, 4, "healing keeps the count");
    time.assert_near(
        healed.1[0].resets_at,
        first_call + period,
        "an undated counter is dated to its first call plus one period",
    );
    expect_deadline(store, &time, &known, first_call + period, "after healing").await;

    let unknown = fresh_key("undated-unknown");
    store
        .plant_undated(unknown.clone(), 5, None)
        .await
        .unwrap_or_else(|e| panic!("the store failed to plant an undated counter: {e}"));
    let healed = charge(store, now, vec![first_use(&unknown, 10, 1, now + period)]).await;
    assert_eq!(healed.1[0].used, 6, "healing keeps the count");
    time.assert_near(
        healed.1[0].resets_at,
        now + period,
        "an undated counter without a first call is dated to one period from now",
    );
    expect_deadline(store, &time, &unknown, now + period, "after healing").await;

    let over = fresh_key("undated-over");
    store
        .plant_undated(over.clone(), 10, Some(now - period * 2))
        .await
        .unwrap_or_else(|e| panic!("the store failed to plant an undated counter: {e}"));
    let fresh = charge(store, now, vec![first_use(&over, 10, 1, now + period)]).await;
    assert!(
        fresh.0,
        "an undated counter whose period is over must not lock its subject out"
    );
    assert_eq!(fresh.1[0].used, 1, "a period that is over starts afresh");
    time.assert_near(
        fresh.1[0].resets_at,
        now + period,
        "the new period ends one period from now",
    );

    let calendar = fresh_key("undated-calendar");
    store
        .plant_undated(calendar.clone(), 2, None)
        .await
        .unwrap_or_else(|e| panic!("the store failed to plant an undated counter: {e}"));
    let end = now + period;
    let charged = charge(store, now, vec![calendar_line(&calendar, 10, 1, now, end)]).await;
    assert_eq!(charged.1[0].used, 3, "healing keeps the count");
    match stored(store, &calendar).await {
        StoredDeadline::At(at) => assert!(
            at + time.tolerance() >= end,
            "an undated calendar counter gets a deadline no earlier than its window's end"
        ),
        StoredDeadline::Unknown => {}
        other => panic!("an undated calendar counter must get a deadline (found {other:?})"),
    }
    Verdict::Passed
}

/// Calendar counters are distinct per window, report the window's end as
/// their reset, and carry a deadline no earlier than that end.
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn calendar_counters_are_distinct_per_period_and_dated<S: ConformanceHooks>(
    store: &S,
) -> Verdict {
    let mut time = Timeline::new(store.expiry());
    let length = time.period();
    let namespace = fresh_namespace();
    let subject = Subject::account("calendar");
    let start = time.now();
    let end = start + length;
    let this = namespace.key(&subject, "read", "w1");
    let next = namespace.key(&subject, "read", "w2");
    assert_ne!(this, next, "two windows must have two keys");

    for _ in 0..2 {
        let outcome = charge(
            store,
            time.now(),
            vec![calendar_line(&this, 10, 1, start, end)],
        )
        .await;
        assert!(outcome.0, "a charge with room must be admitted");
        assert_eq!(
            outcome.1[0].resets_at, end,
            "a calendar counter resets at its window's end"
        );
        assert_eq!(
            outcome.1[0].first_call, None,
            "calendar counters report no first call"
        );
    }
    let later = charge(
        store,
        time.now(),
        vec![calendar_line(&next, 10, 1, end, end + length)],
    )
    .await;
    assert_eq!(later.1[0].used, 1, "the next window counts from zero");
    assert_eq!(later.1[0].resets_at, end + length);
    let both = peek(
        store,
        time.now(),
        vec![
            calendar_line(&this, 10, 0, start, end),
            calendar_line(&next, 10, 0, end, end + length),
        ],
    )
    .await;
    assert_eq!(
        (both[0].used, both[1].used),
        (2, 1),
        "each calendar window keeps its own count"
    );

    match stored(store, &this).await {
        StoredDeadline::At(at) => assert!(
            at + time.tolerance() >= end,
            "a calendar counter must live at least until its window's end (deadline {at}, end {end})"
        ),
        StoredDeadline::Unknown => {
            if time.expiry == Expiry::FollowsRequests {
                time.pass_beyond(end).await;
                let after = peek(store, time.now(), vec![calendar_line(&this, 10, 0, start, end)]).await;
                assert_eq!(after[0].used, 0, "a calendar counter must end after its window");
            }
        }
        other => panic!("a calendar counter must carry a deadline (found {other:?})"),
    }
    Verdict::Passed
}

/// Counts at the top of `u64` never wrap: with a limit of `u64::MAX`, a
/// charge of `u64::MAX - 1` is admitted, and one more of 5 is refused, alone
/// or with another line, and leaves the count as it was; an add of `u64::MAX`
/// either fails (a store that counts less far, see [`Store::add`]) or leaves
/// a count no smaller than before.
///
/// (A store may count less far than `u64` and treat a limit beyond its
/// range as unlimited: the check reads the count the store reports after
/// the first charge, not `u64::MAX - 1`.)
///
/// # Panics
///
/// When the store breaks the rule, or fails to answer.
pub async fn counts_never_pass_the_limit_nor_wrap<S: ConformanceHooks>(store: &S) -> Verdict {
    let time = Timeline::new(store.expiry());
    let period = time.period() * 10;
    let now = time.now();
    let keys = Keys::new();
    let top = keys.key("top");
    let other = keys.key("other");
    let line = |cost| first_use(&top, u64::MAX, cost, now + period);

    let first = charge(store, now, vec![line(u64::MAX - 1)]).await;
    assert!(
        first.0,
        "a charge within a limit of u64::MAX must be admitted"
    );
    let used = first.1[0].used;
    assert!(used > 0, "an admitted charge must count");

    let over = charge(store, now, vec![line(5)]).await;
    assert!(
        !over.0,
        "a charge past the limit must be refused, however large the count"
    );
    assert_eq!(
        over.1[0].used, used,
        "a charge past the limit must leave the count as it was, never wrapped"
    );
    let over = charge(
        store,
        now,
        vec![line(5), first_use(&other, 10, 1, now + period)],
    )
    .await;
    assert!(
        !over.0,
        "a charge past the limit must be refused, however large the count (two lines)"
    );
    assert_eq!(
        (over.1[0].used, over.1[1].used),
        (used, 0),
        "a charge past the limit must leave every count as it was, never wrapped (two lines)"
    );

    if let Ok(Some(after)) = store.add(now, top.clone(), u64::MAX).await {
        assert!(
            after >= used,
            "an add must never leave a smaller count (from {used} to {after}): it saturates"
        );
    }
    let peeked = peek(store, now, vec![line(0)]).await;
    assert!(
        peeked[0].used >= used,
        "a count must never wrap (from {used} to {})",
        peeked[0].used
    );
    assert!(
        !charge(store, now, vec![line(5)]).await.0,
        "a charge past the limit must be refused, however large the count"
    );
    Verdict::Passed
}

/// Whether a Redis Cluster connection opened through `seed` reaches every
/// master the cluster names, within `within`: what the Redis store requires
/// of a connection that takes a failed one's place. For the crate's own
/// tests of the Redis store on a cluster.
#[doc(hidden)]
#[cfg(feature = "redis-cluster")]
pub async fn redis_cluster_is_complete(seed: String, within: Duration) -> bool {
    crate::store::redis::cluster_is_complete(seed, within).await
}

/// The suite's view of time: its own clock for stores whose deadlines follow
/// the calls, the system clock and real sleeps for the others.
struct Timeline {
    expiry: Expiry,
    now: Timestamp,
}

impl Timeline {
    fn new(expiry: Expiry) -> Self {
        Self {
            expiry,
            now: Timestamp::now(),
        }
    }

    fn now(&self) -> Timestamp {
        match self.expiry {
            Expiry::FollowsRequests => self.now,
            Expiry::RealTime { .. } => Timestamp::now(),
        }
    }

    fn period(&self) -> SignedDuration {
        match self.expiry {
            Expiry::FollowsRequests => SignedDuration::from_hours(24),
            Expiry::RealTime { tolerance } => {
                SignedDuration::from_millis(1_000)
                    + SignedDuration::try_from(tolerance * 4).unwrap_or_default()
            }
        }
    }

    fn tolerance(&self) -> SignedDuration {
        match self.expiry {
            Expiry::FollowsRequests => SignedDuration::ZERO,
            Expiry::RealTime { tolerance } => {
                SignedDuration::try_from(tolerance).unwrap_or_default()
            }
        }
    }

    async fn pass(&mut self, by: SignedDuration) {
        match self.expiry {
            Expiry::FollowsRequests => self.now += by,
            Expiry::RealTime { .. } => tokio::time::sleep(by.unsigned_abs()).await,
        }
    }

    /// Moves time to just after `deadline` (with the tolerance on top).
    async fn pass_beyond(&mut self, deadline: Timestamp) {
        let target = deadline + self.tolerance() + SignedDuration::from_millis(1);
        let by = target.duration_since(self.now());
        if by.is_positive() {
            self.pass(by).await;
        }
    }

    #[track_caller]
    fn assert_near(&self, actual: Timestamp, expected: Timestamp, rule: &str) {
        let off = actual.duration_since(expected).abs();
        assert!(
            off <= self.tolerance(),
            "{rule} (expected {expected}, got {actual}, off by {off:#})"
        );
    }

    #[track_caller]
    fn assert_near_opt(&self, actual: Option<Timestamp>, expected: Timestamp, rule: &str) {
        match actual {
            Some(actual) => self.assert_near(actual, expected, rule),
            None => panic!("{rule} (expected {expected}, got none)"),
        }
    }
}

async fn expect_deadline<S: ConformanceHooks>(
    store: &S,
    time: &Timeline,
    key: &PeriodKey,
    expected: Timestamp,
    when: &str,
) {
    match stored(store, key).await {
        StoredDeadline::At(at) => time.assert_near(
            at,
            expected,
            &format!("the stored deadline must not move {when}"),
        ),
        StoredDeadline::Unknown => {}
        other => panic!("a first-use counter must keep its deadline {when} (found {other:?})"),
    }
}

async fn stored<S: ConformanceHooks>(store: &S, key: &PeriodKey) -> StoredDeadline {
    store
        .stored_deadline(key.clone())
        .await
        .unwrap_or_else(|e| panic!("the store failed to report a deadline: {e}"))
}

async fn charge<S: Store>(store: &S, now: Timestamp, lines: Vec<ChargeLine>) -> (bool, Vec<Usage>) {
    let outcome = store
        .charge(ChargeRequest { now, lines })
        .await
        .unwrap_or_else(|e| panic!("the store failed to charge: {e}"));
    (outcome.admitted, outcome.usage)
}

async fn peek<S: Store>(store: &S, now: Timestamp, lines: Vec<ChargeLine>) -> Vec<Usage> {
    store
        .peek(ChargeRequest { now, lines })
        .await
        .unwrap_or_else(|e| panic!("the store failed to peek: {e}"))
}

async fn refund<S: Store>(store: &S, now: Timestamp, key: &PeriodKey, amount: u64) -> Option<u64> {
    store
        .refund(now, key.clone(), amount)
        .await
        .unwrap_or_else(|e| panic!("the store failed to refund: {e}"))
}

async fn add<S: Store>(store: &S, now: Timestamp, key: &PeriodKey, amount: u64) -> Option<u64> {
    store
        .add(now, key.clone(), amount)
        .await
        .unwrap_or_else(|e| panic!("the store failed to add: {e}"))
}

fn first_use(key: &PeriodKey, limit: u64, cost: u64, deadline: Timestamp) -> ChargeLine {
    ChargeLine {
        key: key.clone(),
        limit,
        cost,
        lifetime: Lifetime::FirstUse { deadline },
    }
}

fn calendar_line(
    key: &PeriodKey,
    limit: u64,
    cost: u64,
    start: Timestamp,
    end: Timestamp,
) -> ChargeLine {
    ChargeLine {
        key: key.clone(),
        limit,
        cost,
        lifetime: Lifetime::Calendar { start, end },
    }
}

/// A namespace no earlier run used, so the suite can run against a store
/// that holds other counters.
fn fresh_namespace() -> Namespace {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    Namespace::new(format!(
        "conformance:{}:{run}",
        Timestamp::now().as_nanosecond()
    ))
}

/// Counters of one fresh subject; the keys of one request share it, as the
/// layer's do (a store may require that, e.g. Redis Cluster's hash slots).
struct Keys {
    namespace: Namespace,
    subject: Subject,
}

impl Keys {
    fn new() -> Self {
        Self {
            namespace: fresh_namespace(),
            subject: Subject::account("conformance"),
        }
    }

    fn key(&self, allowance: &str) -> PeriodKey {
        self.namespace.key(&self.subject, allowance, "PT1S")
    }
}

fn fresh_key(name: &str) -> PeriodKey {
    Keys::new().key(name)
}
