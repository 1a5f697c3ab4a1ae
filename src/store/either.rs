//! One of two stores, chosen when the application starts.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use jiff::Timestamp;
use smallvec::SmallVec;

use super::{ChargeAnswer, ChargeOutcome, ChargeRequest, Debt, Store, StoreError, Usage};
use crate::key::PeriodKey;

/// One of two stores, chosen when the application starts (from its
/// configuration: the memory store on a developer's machine, Redis in
/// production), behind one type: the policy, its layers and its handle are
/// then of one type whichever runs, with no generic code in the
/// application. Every call goes to the store it holds.
///
/// ```
/// use tower_quota::store::{EitherStore, LeasedStore};
/// use tower_quota::{FromHeader, MemoryStore, Quota, QuotaHandle, QuotaPolicy};
///
/// /// The memory store, or one shared by several instances in production
/// /// (a `RedisStore` in real life).
/// type AppStore = EitherStore<MemoryStore, LeasedStore<MemoryStore>>;
///
/// fn policy(shared: bool) -> QuotaPolicy<FromHeader, AppStore> {
///     let store = if shared {
///         EitherStore::Right(LeasedStore::new(MemoryStore::new()))
///     } else {
///         EitherStore::Left(MemoryStore::new())
///     };
///     QuotaPolicy::builder(FromHeader::account("x-account-id"))
///         .store(store)
///         .build()
/// }
///
/// # async fn run() {
/// let policy = policy(std::env::var_os("QUOTA_SHARED").is_some());
/// let layer = policy.layer(Quota::daily(1_000));
/// let handle: QuotaHandle<AppStore> = policy.handle();
/// // ... serve, then on a graceful shutdown:
/// if let EitherStore::Right(leased) = policy.store() {
///     leased.shutdown().await; // the unused units go back
/// }
/// # let _ = (layer, handle);
/// # }
/// ```
#[derive(Clone, Debug)]
pub enum EitherStore<A, B> {
    /// The first kind of store.
    Left(A),
    /// The second kind of store.
    Right(B),
}

/// The future of [`EitherStore`]'s charge: that of the store it holds.
#[derive(Debug)]
pub enum EitherChargeFuture<A, B> {
    /// The first store's charge.
    Left(A),
    /// The second store's charge.
    Right(B),
}

impl<A, B> Future for EitherChargeFuture<A, B>
where
    A: Future<Output = Result<ChargeOutcome, StoreError>> + Unpin,
    B: Future<Output = Result<ChargeOutcome, StoreError>> + Unpin,
{
    type Output = Result<ChargeOutcome, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            Self::Left(future) => Pin::new(future).poll(cx),
            Self::Right(future) => Pin::new(future).poll(cx),
        }
    }
}

/// `answer`, its future (if it has one) made that of `EitherStore` by `wrap`.
fn later<F, G>(answer: ChargeAnswer<F>, wrap: impl FnOnce(F) -> G) -> ChargeAnswer<G> {
    match answer {
        ChargeAnswer::Now(answer) => ChargeAnswer::Now(answer),
        ChargeAnswer::Later(future) => ChargeAnswer::Later(wrap(future)),
    }
}

impl<A: Store, B: Store> Store for EitherStore<A, B> {
    type ChargeFuture = EitherChargeFuture<A::ChargeFuture, B::ChargeFuture>;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        match self {
            Self::Left(store) => EitherChargeFuture::Left(store.charge(request)),
            Self::Right(store) => EitherChargeFuture::Right(store.charge(request)),
        }
    }

    fn charge_at_once(&self, request: &ChargeRequest) -> ChargeAnswer<Self::ChargeFuture> {
        match self {
            Self::Left(store) => later(store.charge_at_once(request), EitherChargeFuture::Left),
            Self::Right(store) => later(store.charge_at_once(request), EitherChargeFuture::Right),
        }
    }

    async fn charge_taking(
        &self,
        request: ChargeRequest,
        extra: SmallVec<[u64; 2]>,
    ) -> Result<(ChargeOutcome, SmallVec<[u64; 2]>), StoreError> {
        match self {
            Self::Left(store) => store.charge_taking(request, extra).await,
            Self::Right(store) => store.charge_taking(request, extra).await,
        }
    }

    async fn peek(&self, request: ChargeRequest) -> Result<Vec<Usage>, StoreError> {
        match self {
            Self::Left(store) => store.peek(request).await,
            Self::Right(store) => store.peek(request).await,
        }
    }

    async fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        match self {
            Self::Left(store) => store.refund(now, key, amount).await,
            Self::Right(store) => store.refund(now, key, amount).await,
        }
    }

    async fn refund_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        match self {
            Self::Left(store) => store.refund_made_by(now, key, amount, made_by).await,
            Self::Right(store) => store.refund_made_by(now, key, amount, made_by).await,
        }
    }

    async fn refund_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        match self {
            Self::Left(store) => store.refund_made_at(now, key, amount, first_call).await,
            Self::Right(store) => store.refund_made_at(now, key, amount, first_call).await,
        }
    }

    async fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        match self {
            Self::Left(store) => store.add(now, key, amount).await,
            Self::Right(store) => store.add(now, key, amount).await,
        }
    }

    async fn add_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        match self {
            Self::Left(store) => store.add_made_by(now, key, amount, made_by).await,
            Self::Right(store) => store.add_made_by(now, key, amount, made_by).await,
        }
    }

    async fn add_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        match self {
            Self::Left(store) => store.add_made_at(now, key, amount, first_call).await,
            Self::Right(store) => store.add_made_at(now, key, amount, first_call).await,
        }
    }

    async fn settle_debt(&self, now: Timestamp, debt: Debt) -> Result<Option<u64>, StoreError> {
        match self {
            Self::Left(store) => store.settle_debt(now, debt).await,
            Self::Right(store) => store.settle_debt(now, debt).await,
        }
    }

    async fn reset(&self, key: PeriodKey) -> Result<bool, StoreError> {
        match self {
            Self::Left(store) => store.reset(key).await,
            Self::Right(store) => store.reset(key).await,
        }
    }

    fn identity(&self) -> Option<usize> {
        match self {
            Self::Left(store) => store.identity(),
            Self::Right(store) => store.identity(),
        }
    }

    fn max_count(&self) -> u64 {
        match self {
            Self::Left(store) => store.max_count(),
            Self::Right(store) => store.max_count(),
        }
    }

    fn call_budget(&self) -> Option<std::time::Duration> {
        match self {
            Self::Left(store) => store.call_budget(),
            Self::Right(store) => store.call_budget(),
        }
    }

    fn last_answer(&self) -> Option<tokio::time::Instant> {
        match self {
            Self::Left(store) => store.last_answer(),
            Self::Right(store) => store.last_answer(),
        }
    }

    fn longest_wait(&self) -> std::time::Duration {
        match self {
            Self::Left(store) => store.longest_wait(),
            Self::Right(store) => store.longest_wait(),
        }
    }

    fn charges_in_flight(&self) -> usize {
        match self {
            Self::Left(store) => store.charges_in_flight(),
            Self::Right(store) => store.charges_in_flight(),
        }
    }
}
