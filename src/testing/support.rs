//! The suite's tools: its clock, its calls to the store, its keys.

use std::sync::atomic::{AtomicU64, Ordering};

use jiff::{SignedDuration, Timestamp};

use super::hooks::{ConformanceHooks, Expiry, StoredDeadline};
use crate::key::{Namespace, PeriodKey};
use crate::store::{ChargeLine, ChargeRequest, Debt, Lifetime, Store, StoreError, Usage};
use crate::subject::Subject;

/// The suite's view of time: its own clock for stores whose deadlines follow
/// the calls, the system clock and real sleeps for the others.
pub(super) struct Timeline {
    pub(super) expiry: Expiry,
    now: Timestamp,
}

impl Timeline {
    pub(super) fn new(expiry: Expiry) -> Self {
        Self {
            expiry,
            now: Timestamp::now(),
        }
    }

    pub(super) fn now(&self) -> Timestamp {
        match self.expiry {
            Expiry::FollowsRequests => self.now,
            Expiry::RealTime { .. } => Timestamp::now(),
        }
    }

    pub(super) fn period(&self) -> SignedDuration {
        match self.expiry {
            Expiry::FollowsRequests => SignedDuration::from_hours(24),
            Expiry::RealTime { tolerance } => {
                SignedDuration::from_millis(1_000)
                    + SignedDuration::try_from(tolerance * 4).unwrap_or_default()
            }
        }
    }

    pub(super) fn tolerance(&self) -> SignedDuration {
        match self.expiry {
            Expiry::FollowsRequests => SignedDuration::ZERO,
            Expiry::RealTime { tolerance } => {
                SignedDuration::try_from(tolerance).unwrap_or_default()
            }
        }
    }

    pub(super) async fn pass(&mut self, by: SignedDuration) {
        match self.expiry {
            Expiry::FollowsRequests => self.now += by,
            Expiry::RealTime { .. } => tokio::time::sleep(by.unsigned_abs()).await,
        }
    }

    /// Moves time to just after `deadline` (with the tolerance on top).
    pub(super) async fn pass_beyond(&mut self, deadline: Timestamp) {
        let target = deadline + self.tolerance() + SignedDuration::from_millis(1);
        let by = target.duration_since(self.now());
        if by.is_positive() {
            self.pass(by).await;
        }
    }

    #[track_caller]
    pub(super) fn assert_near(&self, actual: Timestamp, expected: Timestamp, rule: &str) {
        let off = actual.duration_since(expected).abs();
        assert!(
            off <= self.tolerance(),
            "{rule} (expected {expected}, got {actual}, off by {off:#})"
        );
    }

    #[track_caller]
    pub(super) fn assert_near_opt(
        &self,
        actual: Option<Timestamp>,
        expected: Timestamp,
        rule: &str,
    ) {
        match actual {
            Some(actual) => self.assert_near(actual, expected, rule),
            None => panic!("{rule} (expected {expected}, got none)"),
        }
    }
}

pub(super) async fn expect_deadline<S: ConformanceHooks>(
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

pub(super) async fn stored<S: ConformanceHooks>(store: &S, key: &PeriodKey) -> StoredDeadline {
    answered(
        store.stored_deadline(key.clone()).await,
        "report a deadline",
    )
}

/// What the store answered to a call (`what` names it: "refund", "add"),
/// or a panic that says it failed.
pub(super) fn answered<T>(result: Result<T, StoreError>, what: &str) -> T {
    result.unwrap_or_else(|e| panic!("the store failed to {what}: {e}"))
}

pub(super) async fn charge<S: Store>(
    store: &S,
    now: Timestamp,
    lines: Vec<ChargeLine>,
) -> (bool, Vec<Usage>) {
    let outcome = answered(
        store
            .charge(ChargeRequest {
                charged_at: None,
                now,
                lines: lines.into(),
            })
            .await,
        "charge",
    );
    (outcome.admitted, outcome.usage.into_vec())
}

pub(super) async fn peek<S: Store>(
    store: &S,
    now: Timestamp,
    lines: Vec<ChargeLine>,
) -> Vec<Usage> {
    answered(
        store
            .peek(ChargeRequest {
                charged_at: None,
                now,
                lines: lines.into(),
            })
            .await,
        "peek",
    )
}

pub(super) async fn refund<S: Store>(
    store: &S,
    now: Timestamp,
    key: &PeriodKey,
    amount: u64,
) -> Option<u64> {
    answered(store.refund(now, key.clone(), amount).await, "refund")
}

pub(super) async fn add<S: Store>(
    store: &S,
    now: Timestamp,
    key: &PeriodKey,
    amount: u64,
) -> Option<u64> {
    answered(store.add(now, key.clone(), amount).await, "add")
}

pub(super) async fn settle<S: Store>(store: &S, now: Timestamp, debt: Debt) -> Option<u64> {
    answered(store.settle_debt(now, debt).await, "settle a debt")
}

pub(super) fn first_use(key: &PeriodKey, limit: u64, cost: u64, deadline: Timestamp) -> ChargeLine {
    ChargeLine {
        key: key.clone(),
        limit,
        cost,
        lifetime: Lifetime::FirstUse { deadline },
        shadow_limit: None,
    }
}

pub(super) fn calendar_line(
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
        shadow_limit: None,
    }
}

/// A namespace no earlier run used, so the suite can run against a store
/// that holds other counters.
pub(super) fn fresh_namespace() -> Namespace {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    Namespace::new(format!(
        "conformance:{}:{run}",
        Timestamp::now().as_nanosecond()
    ))
}

/// Counters of one fresh subject; the keys of one request share it, as the
/// layer's do (a store may require that, e.g. Redis Cluster's hash slots).
pub(super) struct Keys {
    namespace: Namespace,
    subject: Subject,
}

impl Keys {
    pub(super) fn new() -> Self {
        Self {
            namespace: fresh_namespace(),
            subject: Subject::account("conformance"),
        }
    }

    pub(super) fn key(&self, allowance: &str) -> PeriodKey {
        self.namespace.key(&self.subject, allowance, "PT1S")
    }
}

/// A settle id ([`Debt::id`]) no other settle of the suite's has: each
/// debt the suite settles is a new one.
pub(super) fn settle_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

pub(super) fn fresh_key(name: &str) -> PeriodKey {
    Keys::new().key(name)
}
