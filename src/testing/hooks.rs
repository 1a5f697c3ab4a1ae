//! What the suite needs from a store beyond the `Store` trait, and its verdicts.

use std::future::Future;
use std::time::Duration;

use jiff::Timestamp;

use crate::key::PeriodKey;
use crate::store::{MemoryStore, Store, StoreError};

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

    /// Another store of this type, with counters of its own (not a clone):
    /// [`clones_share_an_identity_no_other_store_has`](super::clones_share_an_identity_no_other_store_has)
    /// checks that its identity differs from this one's. Default: `None`,
    /// and only clones are checked.
    fn another_store(&self) -> Option<Self> {
        None
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
/// [`undated_counter_is_healed`](super::undated_counter_is_healed) does not apply. Its counters end when a
/// call's `now` reaches their deadline.
impl ConformanceHooks for MemoryStore {
    fn another_store(&self) -> Option<Self> {
        Some(MemoryStore::new())
    }
}

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
                ms => StoredDeadline::At(now + jiff::SignedDuration::from_millis(ms)),
            })
        }
    }
}

/// Either store answers as the store it holds: its hooks are that store's.
impl<A: ConformanceHooks, B: ConformanceHooks> ConformanceHooks
    for crate::store::EitherStore<A, B>
{
    fn expiry(&self) -> Expiry {
        match self {
            Self::Left(store) => store.expiry(),
            Self::Right(store) => store.expiry(),
        }
    }

    fn another_store(&self) -> Option<Self> {
        match self {
            Self::Left(store) => store.another_store().map(Self::Left),
            Self::Right(store) => store.another_store().map(Self::Right),
        }
    }

    async fn plant_undated(
        &self,
        key: PeriodKey,
        used: u64,
        first_call: Option<Timestamp>,
    ) -> Result<Planted, StoreError> {
        match self {
            Self::Left(store) => store.plant_undated(key, used, first_call).await,
            Self::Right(store) => store.plant_undated(key, used, first_call).await,
        }
    }

    async fn stored_deadline(&self, key: PeriodKey) -> Result<StoredDeadline, StoreError> {
        match self {
            Self::Left(store) => store.stored_deadline(key).await,
            Self::Right(store) => store.stored_deadline(key).await,
        }
    }
}

/// A leased store answers as the store it leases from: its hooks are that
/// store's.
impl<St: ConformanceHooks> ConformanceHooks for crate::store::LeasedStore<St> {
    fn expiry(&self) -> Expiry {
        self.inner().expiry()
    }

    fn another_store(&self) -> Option<Self> {
        self.inner()
            .another_store()
            .map(crate::store::LeasedStore::new)
    }

    fn plant_undated(
        &self,
        key: PeriodKey,
        used: u64,
        first_call: Option<Timestamp>,
    ) -> impl Future<Output = Result<Planted, StoreError>> + Send {
        self.inner().plant_undated(key, used, first_call)
    }

    fn stored_deadline(
        &self,
        key: PeriodKey,
    ) -> impl Future<Output = Result<StoredDeadline, StoreError>> + Send {
        self.inner().stored_deadline(key)
    }
}
