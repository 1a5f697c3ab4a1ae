//! A store that stalls or fails chosen charges, around a real one: for
//! tests of what a request spends when a store does not answer.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tower_quota::jiff::Timestamp;
use tower_quota::store::{ChargeOutcome, ChargeRequest, Debt, StoreErrorKind};
use tower_quota::{PeriodKey, Store, StoreError, Usage};

/// What a rigged store does with the charges it is rigged for.
#[derive(Clone, Copy, Debug)]
pub enum Rig {
    /// Never answers.
    // Not every test file that includes this module uses it.
    #[allow(dead_code)]
    Stall,
    /// Fails at once.
    Fail,
    /// Charges, and answers without the usage of the lines (a store that
    /// breaks the contract: one entry per line).
    // Not every test file that includes this module uses it.
    #[allow(dead_code)]
    ShortUsage,
}

/// A store that stalls or fails the charges of one allowance (of every
/// allowance: `None`), and tells when it met one.
#[derive(Clone)]
pub struct Rigged<St> {
    inner: St,
    rig: Rig,
    allowance: Option<&'static str>,
    /// Notified when a rigged charge arrives.
    pub met: Arc<Notify>,
    /// The largest count the store says it decides on (the inner store's
    /// by default).
    pub max: Option<u64>,
    /// While set, settles of debts and reads (`peek`) fail too (the store
    /// is away); otherwise they reach the inner store.
    pub away: Arc<AtomicBool>,
    /// While set, refunds and adds never answer.
    // Not every test file that includes this module uses it.
    #[allow(dead_code)]
    pub stalled: Arc<AtomicBool>,
    /// While set, refunds and adds fail as calls the store never sent.
    #[allow(dead_code)]
    pub unsent: Arc<AtomicBool>,
    /// While set, every charge fails at once, rigged or not (a store away
    /// for a moment).
    #[allow(dead_code)]
    pub down: Arc<AtomicBool>,
    /// While above 0, refunds and adds are made and answered (or fail, as
    /// never sent) this many milliseconds of the runtime's time late.
    #[allow(dead_code)]
    pub slow_changes: Arc<AtomicU64>,
    /// While above 0, refunds and adds are made at once and answered this
    /// many milliseconds of the runtime's time late (their answer on its
    /// way, while other calls are answered).
    #[allow(dead_code)]
    pub late_answers: Arc<AtomicU64>,
}

impl<St> Rigged<St> {
    pub fn new(inner: St, rig: Rig, allowance: Option<&'static str>) -> Self {
        Self {
            inner,
            rig,
            allowance,
            met: Arc::new(Notify::new()),
            max: None,
            away: Arc::default(),
            stalled: Arc::default(),
            unsent: Arc::default(),
            down: Arc::default(),
            slow_changes: Arc::default(),
            late_answers: Arc::default(),
        }
    }

    fn rigged(&self, key: &PeriodKey) -> bool {
        self.allowance
            .is_none_or(|allowance| key.as_str().contains(&format!("}}:{allowance}:")))
    }
}

impl<St> Rigged<St> {
    /// A refund or an add, made by `make` unless the store is stalled (then
    /// it never answers) or sends nothing (then it fails unsent). Not even
    /// made then: the memory store applies a change when it is made.
    fn change<F>(
        &self,
        make: impl FnOnce() -> F + Send,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send
    where
        F: Future<Output = Result<Option<u64>, StoreError>> + Send,
    {
        let stalled = self.stalled.load(Ordering::Relaxed);
        let sent = !stalled && !self.unsent.load(Ordering::Relaxed);
        let slow = Duration::from_millis(self.slow_changes.load(Ordering::Relaxed));
        let late = Duration::from_millis(self.late_answers.load(Ordering::Relaxed));
        let mut make = Some(make);
        // Made at once, unless slow.
        let mut change = (sent && slow.is_zero())
            .then(|| make.take().map(|make| make()))
            .flatten();
        async move {
            if stalled {
                std::future::pending::<()>().await;
            }
            if !slow.is_zero() {
                tokio::time::sleep(slow).await;
                if sent {
                    change = make.take().map(|make| make());
                }
            }
            let answer = match change {
                Some(change) => change.await,
                None => Err(never_sent()),
            };
            tokio::time::sleep(late).await;
            answer
        }
    }
}

/// The error of a call the store never sent.
fn never_sent() -> StoreError {
    StoreError::new(StoreErrorKind::Unavailable, "rigged: not sent").unsent()
}

type Charging = Pin<Box<dyn Future<Output = Result<ChargeOutcome, StoreError>> + Send>>;

impl<St: Store> Store for Rigged<St> {
    type ChargeFuture = Charging;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        if self.down.load(Ordering::Relaxed) {
            return Box::pin(std::future::ready(Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "rigged: down",
            ))));
        }
        if !request.lines.iter().any(|line| self.rigged(&line.key)) {
            return Box::pin(self.inner.charge(request));
        }
        self.met.notify_one();
        match self.rig {
            Rig::Stall => Box::pin(std::future::pending()),
            // Naming the key, as a store of an application's own may.
            Rig::Fail => Box::pin(std::future::ready(Err(StoreError::new(
                StoreErrorKind::Unavailable,
                format!("rigged to fail on {}", request.lines[0].key),
            )))),
            Rig::ShortUsage => {
                let charge = self.inner.charge(request);
                Box::pin(async move {
                    let mut outcome = charge.await?;
                    outcome.usage.clear();
                    Ok(outcome)
                })
            }
        }
    }
    fn peek(
        &self,
        request: ChargeRequest,
    ) -> impl Future<Output = Result<Vec<Usage>, StoreError>> + Send {
        let away = self.away.load(Ordering::Relaxed);
        let peek = self.inner.peek(request);
        async move {
            if away {
                return Err(StoreError::new(StoreErrorKind::Unavailable, "rigged: away"));
            }
            peek.await
        }
    }
    fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.change(move || self.inner.refund(now, key, amount))
    }
    fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.change(move || self.inner.add(now, key, amount))
    }
    fn reset(&self, key: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.inner.reset(key)
    }
    fn settle_debt(
        &self,
        now: Timestamp,
        debt: Debt,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        // Not sent while away: a settle that fails must add nothing.
        let settle =
            (!self.away.load(Ordering::Relaxed)).then(|| self.inner.settle_debt(now, debt));
        async move {
            match settle {
                Some(settle) => settle.await,
                None => Err(StoreError::new(StoreErrorKind::Unavailable, "rigged away")),
            }
        }
    }
    fn identity(&self) -> Option<usize> {
        self.inner.identity()
    }
    fn max_count(&self) -> u64 {
        self.max.unwrap_or_else(|| self.inner.max_count())
    }
}

/// A middleware that works on for 5 s after the layers further in
/// answered (an audit log, a body rewritten): a request dropped meanwhile
/// was answered inside, and never served.
// Not every test file that includes this module uses it.
#[allow(dead_code)]
pub async fn slow_after(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let response = next.run(request).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    response
}
