//! Where counters live.
//!
//! A [`Store`] keeps one counter per [`PeriodKey`] and charges, peeks,
//! refunds, adds to and resets them. [`MemoryStore`] keeps them in the
//! process, the default for a single instance and for tests; a store shared
//! by many instances implements the same trait.
//!
//! # The contract
//!
//! - [`Store::charge`] is all-or-nothing over the request's lines: if any line
//!   would go over its limit, nothing is charged on any line (check, then
//!   commit, atomically with respect to other charges).
//! - A counter is created by the first charge that spends on its key, with a
//!   deadline fixed at creation: [`Lifetime::FirstUse`] gives it the period's
//!   end, and that deadline *is* the reset. Nothing may push a deadline
//!   forward afterwards (a deadline that every hit extends means an active
//!   subject never gets its allowance back), and nothing may leave a counter
//!   without one (a first-use counter without a deadline locks its subject
//!   out for good).
//! - [`Lifetime::Calendar`] counters are named by their window, so their
//!   deadline is only housekeeping, and the reset reported is the window's
//!   end.
//! - A calendar counter outlives its window for the charges stamped in it:
//!   a request is stamped once, by its policy's outermost layer, and a
//!   layer further in (behind an authentication call, a queue) charges it
//!   at that instant, after calls stamped since; an instance's clock may be
//!   behind another's. A charge stamped before the window's end that
//!   reaches the store late must still find the window's counter, or it is
//!   admitted on a fresh one, past the window's limit: the memory store
//!   keeps a counter a minute past its end (a second when it needs the
//!   room), the Redis store a minute by default. A store that drops a
//!   counter at its end (a sweep at the latest call's instant, a
//!   time-to-live at the end) serves such requests past the limit.
//! - A charge with a line whose lifetime is over at the charge's instant (a
//!   window that ends at it or before, a deadline not after it) is an error,
//!   and charges nothing: a counter made for it would be over as soon as
//!   made, and the next charge would find none, so such lines would be
//!   admitted however often they came.
//! - [`Store::refund`] never creates a counter and never touches a deadline;
//!   a give-back at a first-use counter's first call of all it holds
//!   ([`Store::refund_made_at`]) deletes it, unless a refund of another kind
//!   lowered it before, so that a period runs from the first request that
//!   spends.
//! - [`Store::add`] (a cost known only once the response is, charged after
//!   the fact) never checks a limit, never creates a counter and never
//!   touches a deadline: an add to a counter that expired in the meantime
//!   finds nothing, rather than open a new period.
//! - [`Store::settle_debt`] (what requests admitted while the store failed
//!   owe, added once it answers again) never checks a limit and never
//!   touches the deadline of a live counter; where there is none, it creates
//!   the counter with the debt's lifetime, the one the requests had. A debt
//!   whose lifetime ended writes nothing, so it never opens a new period. A
//!   live counter takes the debt whatever period it counts: a first-use key
//!   names no period, so a debt may land in a period opened after its
//!   requests (never one opened at or past the debt's deadline, one period
//!   after its earliest request).
//! - A charge that fails, or whose future is dropped before it answers,
//!   leaves nothing charged once the store is done with it (not applied, or
//!   applied and given back): the layer counts a request that passed on a
//!   failed charge under `OnStoreError::FailOpen` with a settle of its own.
//!   A store that may keep a failed charge counts such a request twice. A
//!   store keeps this as far as it learns what became of a call: one that
//!   fails on the wire after it was sent (its connection lost before the
//!   answer; for the Redis store also one applied more than 30 s late) may
//!   have been applied without the store knowing, and then stays: its
//!   request counts twice (or, refused under `OnStoreError::FailClosed`,
//!   counts though it was not served).
//! - A settle that fails counts once in all when the ledger sends it again
//!   under its [`Debt::id`]: either it left nothing added (as a charge), or
//!   the store adds nothing for an id it has added (the Redis store, whose
//!   settles may be lost on the wire too, keeps a mark per settle).
//!
//! # Example: a store of your own
//!
//! A store that wraps another one and counts charges, e.g. for metrics:
//!
//! ```
//! use std::sync::{atomic::{AtomicU64, Ordering}, Arc};
//! use std::future::Future;
//! use jiff::Timestamp;
//! use tower_quota::store::{ChargeOutcome, ChargeRequest, Debt, Store, StoreError, Usage};
//! use tower_quota::{MemoryStore, PeriodKey, QuotaPolicy};
//!
//! #[derive(Clone, Default)]
//! struct Counting { inner: MemoryStore, charges: Arc<AtomicU64> }
//!
//! impl Store for Counting {
//!     type ChargeFuture = <MemoryStore as Store>::ChargeFuture;
//!
//!     fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
//!         self.charges.fetch_add(1, Ordering::Relaxed);
//!         self.inner.charge(request)
//!     }
//!     fn peek(&self, request: ChargeRequest) -> impl Future<Output = Result<Vec<Usage>, StoreError>> + Send {
//!         self.inner.peek(request)
//!     }
//!     fn refund(&self, now: Timestamp, key: PeriodKey, amount: u64) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
//!         self.inner.refund(now, key, amount)
//!     }
//!     fn refund_made_by(&self, now: Timestamp, key: PeriodKey, amount: u64, made_by: Timestamp) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
//!         self.inner.refund_made_by(now, key, amount, made_by)
//!     }
//!     fn refund_made_at(&self, now: Timestamp, key: PeriodKey, amount: u64, first_call: Timestamp) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
//!         self.inner.refund_made_at(now, key, amount, first_call)
//!     }
//!     fn add(&self, now: Timestamp, key: PeriodKey, amount: u64) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
//!         self.inner.add(now, key, amount)
//!     }
//!     fn add_made_by(&self, now: Timestamp, key: PeriodKey, amount: u64, made_by: Timestamp) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
//!         self.inner.add_made_by(now, key, amount, made_by)
//!     }
//!     fn add_made_at(&self, now: Timestamp, key: PeriodKey, amount: u64, first_call: Timestamp) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
//!         self.inner.add_made_at(now, key, amount, first_call)
//!     }
//!     fn reset(&self, key: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
//!         self.inner.reset(key)
//!     }
//!     fn settle_debt(&self, now: Timestamp, debt: Debt) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
//!         self.inner.settle_debt(now, debt)
//!     }
//!     fn identity(&self) -> Option<usize> {
//!         self.inner.identity()
//!     }
//!     fn max_count(&self) -> u64 {
//!         self.inner.max_count()
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use axum::{body::Body, routing::get, Router};
//! use http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_quota::{FromHeader, Quota};
//!
//! let store = Counting::default();
//! let app = Router::new()
//!     .route("/", get(|| async { "hi" }))
//!     .layer(QuotaPolicy::builder(FromHeader::account("x-account-id")).store(store.clone()).build().layer(Quota::daily(5)));
//! let request = Request::get("/").header("x-account-id", "acme").body(Body::empty()).unwrap();
//! let response = app.oneshot(request).await.unwrap();
//! assert_eq!(response.status(), StatusCode::OK);
//! assert_eq!(store.charges.load(Ordering::Relaxed), 1);
//! # }
//! ```

mod either;
mod leased;
mod memory;
pub(crate) mod patience;
#[cfg(feature = "redis")]
pub mod redis;
pub(crate) mod resend;
mod slot_key;
#[cfg(test)]
mod tests;

#[cfg(test)]
mod label_tests {
    #[test]
    fn stores_are_told_apart_by_type() {
        assert_eq!(super::metrics_label::<super::MemoryStore>(), "memory");
        #[cfg(feature = "redis")]
        assert_eq!(super::metrics_label::<super::RedisStore>(), "redis");
        assert_eq!(super::metrics_label::<String>(), "other");
    }
}

use std::borrow::Cow;
use std::error::Error as StdError;
use std::fmt;
use std::future::Future;

use jiff::Timestamp;
use smallvec::SmallVec;

use crate::key::PeriodKey;

pub use self::either::{EitherChargeFuture, EitherStore};
pub use self::leased::{LeasedChargeFuture, LeasedStore, LeasedStoreBuilder};
pub use self::memory::{MemoryChargeFuture, MemoryStore};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use self::redis::{RedisChargeFuture, RedisStore, RedisStoreBuilder, ServerClock};

type BoxError = Box<dyn StdError + Send + Sync>;

/// The `store` label of `St` in the metrics: the type's name is no stable
/// interface, its identity is.
pub(crate) fn metrics_label<St: 'static>() -> &'static str {
    use std::any::TypeId;
    let id = TypeId::of::<St>();
    if id == TypeId::of::<MemoryStore>() {
        return crate::metrics::store::MEMORY;
    }
    #[cfg(feature = "redis")]
    if id == TypeId::of::<RedisStore>() {
        return crate::metrics::store::REDIS;
    }
    crate::metrics::store::OTHER
}

/// How long a counter lives and what its reset is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lifetime {
    /// A counter of the calendar window `[start, end)`. The reset is `end`;
    /// the counter may be reclaimed after it. (Not at once: a charge
    /// stamped just before `end` can reach the store after one stamped
    /// later, and must still find the window's counter, or it is admitted
    /// on a fresh one. The memory store keeps a counter a minute past its
    /// end (a second when it needs the room), the Redis store a minute by
    /// default.)
    Calendar {
        /// The window's first instant.
        start: Timestamp,
        /// The window's end: the reset.
        end: Timestamp,
    },
    /// A counter of a period that starts at the first call. If the charge
    /// creates the counter, its deadline is `deadline`, for good; an existing
    /// counter keeps the deadline it was created with.
    FirstUse {
        /// The end of a period opened by this request.
        deadline: Timestamp,
    },
}

impl Lifetime {
    /// Whether a charge at `at` goes to the same counter: one of the same
    /// calendar window; a first-use counter's key has no instant in it.
    pub(crate) fn covers(&self, at: Timestamp) -> bool {
        match *self {
            Lifetime::Calendar { start, end } => start <= at && at < end,
            Lifetime::FirstUse { .. } => true,
        }
    }

    /// When a counter of this lifetime is over: the calendar window's end,
    /// or the first-use deadline.
    pub fn end(&self) -> Timestamp {
        match *self {
            Lifetime::Calendar { end, .. } => end,
            Lifetime::FirstUse { deadline } => deadline,
        }
    }
}

/// One counter to charge: the key, its limit, what this request costs on it,
/// and its lifetime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChargeLine {
    /// The counter.
    pub key: PeriodKey,
    /// The most the counter may reach.
    pub limit: u64,
    /// What the request spends.
    pub cost: u64,
    /// The counter's lifetime.
    pub lifetime: Lifetime,
    /// A shadow quota's limit: told to the client, never enforced (`limit`
    /// is then `u64::MAX`, so the store never refuses the line). A store
    /// that counts the line as charged needs nothing else; one that takes
    /// units ahead of requests ([`LeasedStore`])
    /// sizes them by it as by an enforced limit, so the count near it stays
    /// as exact as near an enforced one.
    pub shadow_limit: Option<u64>,
}

/// What [`Store::charge_at_once`] gives: the charge's answer, or the future
/// that will give it.
#[derive(Debug)]
#[must_use = "the charge is made: its answer says whether it was admitted"]
// The answer given at once is the one on every request's path: boxed, it
// would cost each an allocation, to save a few bytes of a value that lives
// for one call.
#[allow(clippy::large_enum_variant)]
pub enum ChargeAnswer<F> {
    /// The store answered at once.
    Now(Result<ChargeOutcome, StoreError>),
    /// The store answers when this future completes.
    Later(F),
}

/// All counters one request spends on, charged together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChargeRequest {
    /// The instant of the request, from the layer's clock (every quota
    /// layer of a policy counts a request at the instant the outermost one
    /// read).
    pub now: Timestamp,
    /// When the charge is made, from the same clock, if later than `now`:
    /// a layer the request reached late (behind a slow authentication call
    /// or a queue, inside another quota layer of its policy). A store whose
    /// counters' lives run from when it applies a charge (the Redis store's
    /// time to live) reckons a first-use deadline's life from here, so that
    /// the counter ends at the deadline, as one that records the deadline
    /// does. `None`: at `now`.
    pub charged_at: Option<Timestamp>,
    /// The counters, one per quota, in the layer's order (inline up to two:
    /// a request's charge allocates no list; build one with `.into()` from a
    /// `Vec`, or `smallvec::smallvec![...]`).
    pub lines: SmallVec<[ChargeLine; 2]>,
}

impl ChargeRequest {
    /// When the charge is made: [`charged_at`](Self::charged_at), or `now`.
    pub fn charged(&self) -> Timestamp {
        self.charged_at.unwrap_or(self.now)
    }
}

/// What requests admitted while the store could not count them owe one
/// counter, for [`Store::settle_debt`]: the layer records a debt when a
/// charge fails under [`OnStoreError::FailOpen`](crate::OnStoreError), and
/// its policy's ledger settles it once the store answers again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Debt {
    /// The counter.
    pub key: PeriodKey,
    /// What is owed: the requests' costs, added up.
    pub amount: u64,
    /// The lifetime the requests' charges had: a counter the settle creates
    /// gets it (a calendar window's end, or the deadline of the first-use
    /// period the earliest of the requests opened).
    pub lifetime: Lifetime,
    /// The instant of the earliest of the requests: the first call of a
    /// first-use counter the settle creates (a calendar one records the
    /// settle's instant).
    pub since: Timestamp,
    /// The settle's identity: the ledger gives every settle an id of its
    /// own, and sends a settle whose answer it never got again under the
    /// same id, with the same amount (what was owed since goes in a later
    /// settle). A store whose answers can be lost after it applied a call
    /// (over a network) adds the debt of one id at most once: the Redis
    /// store leaves a mark per settle beside the counter. See
    /// [`Store::settle_debt`].
    pub id: u64,
}

/// The error of a charge with a line whose lifetime is over at its instant
/// (see [`Store::charge`]), if it has one.
pub(crate) fn past_its_period(request: &ChargeRequest) -> Option<StoreError> {
    request
        .lines
        .iter()
        .any(|line| line.lifetime.end() <= request.now)
        .then(|| {
            StoreError::new(
                StoreErrorKind::Other,
                "a charge line whose period is over at the charge's instant: nothing charged",
            )
        })
}

/// Where one counter stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// The counter's limit.
    pub limit: u64,
    /// What has been spent this period (after the charge, if it was admitted).
    pub used: u64,
    /// When the allowance returns.
    pub resets_at: Timestamp,
    /// The call that made the counter: for a first-use counter, the call
    /// that opened the period; for a calendar counter, the window's first
    /// call (since a reset, if any), or the settle of a debt that made it
    /// ([`Store::settle_debt`]). `None` when no period is open, or from a
    /// store that does not date its counters.
    ///
    /// The layer gives a request's charge back, and adds its deferred
    /// cost, only to the counter whose first call this is
    /// ([`Store::refund_made_at`], [`Store::add_made_at`]; but for a leased
    /// block's charge, when this is later than
    /// [`counted_at`](Self::counted_at): then to a counter made by that
    /// instant): a store reports exactly the instant it compares there (not
    /// one rounded down from it), or the request's give-back is refused.
    pub first_call: Option<Timestamp>,
    /// With leased counting ([`LeasedStore`]), in a refusal: when the
    /// unused units that other instances hold of this counter are expected
    /// back (this instance's idle bound), if another instance is marked as
    /// holding a block of it. A refusal is worth retrying then, before
    /// `resets_at`; it is a hint, not a promise (see the lease marks in
    /// [`LeasedStore`]). `None` from every other store.
    pub held_elsewhere_until: Option<Timestamp>,
    /// When the store counted the charge, if before the charge's own
    /// instant: a [`LeasedStore`] that admits from a block answers with
    /// the instant the block was taken, when the store counted its units.
    /// A give-back of the charge goes only to a counter made by then: not
    /// to one made anew since (a reset elsewhere while this instance still
    /// held the block), even when this usage tells its first call. `None`
    /// from every other store: it counted the charge at its instant.
    pub counted_at: Option<Timestamp>,
}

impl Usage {
    /// What is left to spend this period.
    pub fn remaining(&self) -> u64 {
        self.limit.saturating_sub(self.used)
    }

    /// The instant a give-back of a charge made at `charged_at`, answered
    /// with this usage, goes by ([`Store::refund_made_by`]): only to a
    /// counter made by then. The first call of the counter charged, when
    /// the store tells it (earlier than the charge's instant, it keeps out
    /// a counter made anew after a reset at that very instant; later, a
    /// concurrent charge with a later instant made the counter first), or
    /// the charge's instant; for a charge the store counted earlier
    /// ([`counted_at`](Self::counted_at): a leased block's take, which went
    /// by the first call of the counter it was taken from already), never
    /// later than that instant, whatever counter this usage tells of
    /// since. A counter made anew after a reset is younger than both.
    pub(crate) fn made_by(&self, charged_at: Timestamp) -> Timestamp {
        let made = made_by(charged_at, self.first_call);
        self.counted_at.map_or(made, |counted| counted.min(made))
    }

    /// The counter a give-back (or a deferred cost) of a charge made at
    /// `charged_at`, answered with this usage, goes to: the one whose
    /// first call the store told, exactly ([`Store::refund_made_at`],
    /// which also closes the first-use period that a give-back empties).
    /// From a store that told none, or of a counter made after the store
    /// counted the charge (a leased block taken from a counter reset
    /// since), one made by [`made_by`](Self::made_by).
    pub(crate) fn charged_counter(&self, charged_at: Timestamp) -> Made {
        match self.first_call {
            Some(first_call) if self.counted_at.is_none_or(|counted| first_call <= counted) => {
                Made::At(first_call)
            }
            _ => Made::By(self.made_by(charged_at)),
        }
    }
}

/// The units each line of `request` may take beside its cost, of those
/// asked (`extra`, 0 past its end): none on a line whose key the request
/// lists more than once (see [`Store::charge_taking`]).
pub(crate) fn takeable(request: &ChargeRequest, extra: &[u64]) -> SmallVec<[u64; 2]> {
    let lines = &request.lines;
    lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let once = lines.iter().filter(|l| l.key == line.key).count() == 1;
            if once {
                extra.get(i).copied().unwrap_or(0)
            } else {
                0
            }
        })
        .collect()
}

/// Whether a counter at `used` has room for `cost` under `limit`. A sum
/// beyond `u64` is beyond any limit: no room, never wrapped or saturated
/// (a limit of `u64::MAX` would otherwise fit any cost).
pub(crate) fn has_room(used: u64, cost: u64, limit: u64) -> bool {
    used.checked_add(cost).is_some_and(|after| after <= limit)
}

/// Which counter a refund or an add goes to, by its first call: see
/// [`Store::refund_made_by`] and [`Store::refund_made_at`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Made {
    /// Whichever lives at the key.
    Any,
    /// One made at or before this instant.
    By(Timestamp),
    /// The one made at this instant.
    At(Timestamp),
}

impl Made {
    /// Whether a counter whose first call was `first_call` is one of those.
    pub(crate) fn names(self, first_call: Timestamp) -> bool {
        match self {
            Made::Any => true,
            Made::By(by) => first_call <= by,
            Made::At(at) => first_call == at,
        }
    }

    /// Refunds `amount` to the counter at `key` that this names, with the
    /// store's refund for it (one `At` a first call deletes the first-use
    /// counter it empties: see [`Store::refund_made_at`]).
    pub(crate) async fn refund<St: Store>(
        self,
        store: &St,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        match self {
            Made::Any => store.refund(now, key, amount).await,
            Made::By(by) => store.refund_made_by(now, key, amount, by).await,
            Made::At(at) => store.refund_made_at(now, key, amount, at).await,
        }
    }

    /// Adds `amount` to the counter at `key` that this names, with the
    /// store's add for it.
    pub(crate) async fn add<St: Store>(
        self,
        store: &St,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        match self {
            Made::Any => store.add(now, key, amount).await,
            Made::By(by) => store.add_made_by(now, key, amount, by).await,
            Made::At(at) => store.add_made_at(now, key, amount, at).await,
        }
    }
}

/// The instant a give-back of a charge made at `charged_at`, to a counter
/// whose first call was `first_call`, goes by: see [`Usage::made_by`].
pub(crate) fn made_by(charged_at: Timestamp, first_call: Option<Timestamp>) -> Timestamp {
    first_call.unwrap_or(charged_at)
}

/// The answer to a charge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChargeOutcome {
    /// Whether every line had room and was charged. When `false`, nothing was
    /// charged.
    pub admitted: bool,
    /// One entry per line, in the request's order (inline up to two).
    pub usage: SmallVec<[Usage; 2]>,
}

/// What went wrong in a store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The store did not answer in time. A refund, an add or a reset that
    /// timed out may still be applied: sending it again may apply it twice
    /// (unless the error is [`unsent`](StoreError::unsent): the call never
    /// left, and the layer sends a refund or an add that failed so again).
    /// (A store's own docs say what becomes of a charge that timed out;
    /// the Redis store gives back one that Redis applies later, as the
    /// layer's ledger counts on: see the [module documentation](self).)
    Timeout,
    /// The store could not be reached or refused to work (connection lost,
    /// out of memory, restarting).
    Unavailable,
    /// The store holds as many counters as it may: a subject without a
    /// counter cannot be counted until some are reclaimed.
    Full,
    /// Anything else, such as an unexpected reply.
    Other,
}

/// A store failed to answer.
#[derive(Debug)]
pub struct StoreError {
    kind: StoreErrorKind,
    message: Cow<'static, str>,
    source: Option<BoxError>,
    unsent: bool,
}

impl StoreError {
    /// An error of `kind` with a message for logs.
    pub fn new(kind: StoreErrorKind, message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
            unsent: false,
        }
    }

    /// Marks the error as one of a call the store never sent (no
    /// connection could be had, no room for another call): nothing of it
    /// was applied, so the layer may send a give-back or an add that failed
    /// so again later, without applying it twice.
    #[must_use]
    pub fn unsent(mut self) -> Self {
        self.unsent = true;
        self
    }

    /// Whether the call was never sent (see [`StoreError::unsent`]).
    pub fn is_unsent(&self) -> bool {
        self.unsent
    }

    /// Attaches the underlying error.
    #[must_use]
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl StdError for StoreError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

/// Keeps the counters. See the [module documentation](self) for the contract
/// every implementation keeps, and an implementation of your own.
///
/// Swapping the store changes only the layer's type parameter: here two
/// layers share one [`MemoryStore`], and the test keeps a clone to look at.
///
/// ```
/// use axum::{body::Body, routing::get, Router};
/// use http::{Request, StatusCode};
/// use tower::ServiceExt;
/// use tower_quota::{FromHeader, MemoryStore, Quota, QuotaPolicy};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let store = MemoryStore::new();
/// let app = Router::new()
///     .route("/read", get(|| async { "r" }))
///     .route_layer(QuotaPolicy::builder(FromHeader::account("x-account-id")).store(store.clone()).build().layer(Quota::daily(1).allowance("read")));
///
/// let read = Request::get("/read").header("x-account-id", "acme").body(Body::empty()).unwrap();
/// assert_eq!(app.oneshot(read).await.unwrap().status(), StatusCode::OK);
/// assert_eq!(store.len(), 1, "one counter: acme's reads today");
/// # }
/// ```
pub trait Store: Clone + Send + Sync + 'static {
    /// The future of [`Store::charge`]; named so the layer's response future
    /// can hold it without boxing. `Unpin` (a boxed future is), so the layer
    /// polls it once as soon as it makes it: a store that answers at once
    /// (the memory store, a leased block) is answered before the inner
    /// service is called, and the request needs no future of its own.
    type ChargeFuture: Future<Output = Result<ChargeOutcome, StoreError>> + Send + Unpin + 'static;

    /// Charges every line of `request`, or none of them.
    ///
    /// A line whose lifetime is over at `request.now` (a calendar window
    /// that ends at or before it, a first-use deadline that is not after it)
    /// names no counter the request could count on: the charge is an error
    /// ([`StoreErrorKind::Other`]), and nothing is charged. (A layer never
    /// sends one: it charges the window that contains the request's
    /// instant.)
    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture;

    /// Charges `request` as [`Store::charge`] does, and on each line up to
    /// `extra[i]` units more, as many as its counter has room for under the
    /// line's limit once every line's cost is charged: a [`LeasedStore`]'s
    /// block, taken with the request it was planned for. The extras never
    /// refuse the request: it is admitted exactly when `charge` would admit
    /// it, and then answered with the units each line took beside its cost
    /// (counted in its `used`), none when refused. A line whose key the
    /// request lists more than once takes none, and `extra` is read as 0
    /// past its end.
    ///
    /// The default charges the request with all its extras and, when that
    /// is refused while each line has room for its own cost, the request
    /// alone: two calls, taking every extra unit or none. The memory store
    /// and the Redis store take what fits in one step.
    fn charge_taking(
        &self,
        request: ChargeRequest,
        extra: SmallVec<[u64; 2]>,
    ) -> impl Future<Output = Result<(ChargeOutcome, SmallVec<[u64; 2]>), StoreError>> + Send {
        async move {
            let extra = takeable(&request, &extra);
            if extra.iter().all(|&units| units == 0) {
                let outcome = self.charge(request).await?;
                return Ok((outcome, extra));
            }
            let mut with_extra = request.clone();
            for (line, &units) in with_extra.lines.iter_mut().zip(&extra) {
                line.cost = line.cost.saturating_add(units);
            }
            let outcome = self.charge(with_extra).await?;
            if outcome.admitted {
                return Ok((outcome, extra));
            }
            let fits_alone = request
                .lines
                .iter()
                .zip(&outcome.usage)
                .all(|(line, usage)| has_room(usage.used, line.cost, usage.limit));
            let none = smallvec::smallvec![0; request.lines.len()];
            if !fits_alone {
                return Ok((outcome, none));
            }
            Ok((self.charge(request).await?, none))
        }
    }

    /// Charges `request` as [`Store::charge`] does, answering at once when
    /// the store can: [`ChargeAnswer::Now`] with the answer, made without a
    /// future (nor the clones of the store and of the request a future
    /// holds), or [`ChargeAnswer::Later`] with the future of a charge that
    /// waits, which spends nothing if it is dropped before it answers. The
    /// layer charges through this; the default makes the future. [`MemoryStore`] always
    /// answers at once, [`LeasedStore`] when its blocks have room.
    fn charge_at_once(&self, request: &ChargeRequest) -> ChargeAnswer<Self::ChargeFuture> {
        ChargeAnswer::Later(self.charge(request.clone()))
    }

    /// Where each line's counter stands, charging nothing and creating
    /// nothing. Costs in `request` are ignored.
    fn peek(
        &self,
        request: ChargeRequest,
    ) -> impl Future<Output = Result<Vec<Usage>, StoreError>> + Send;

    /// Gives `amount` back to the live counter at `key` (never below zero).
    /// Returns what the counter holds afterwards, or `None` when there is no
    /// live counter: a refund never creates a counter and never changes a
    /// deadline. It does not say whose units it takes: a first-use counter
    /// it lowers is marked, and no give-back closes its period afterwards
    /// (see [`Store::refund_made_at`]).
    fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send;

    /// As [`Store::refund`], only to a counter made at or before
    /// `made_by`: units charged at `made_by` and refunded later (support's
    /// [`QuotaHandle::refund_at`](crate::QuotaHandle::refund_at)) must not
    /// land on a counter made since, after a reset. `None` when the live
    /// counter at `key` is younger, as when there is none. A counter's
    /// [`first_call`](Usage::first_call), as the store reported it, is
    /// `made_by` enough for that counter. As [`Store::refund`], it marks a
    /// first-use counter it lowers, whose period no give-back then closes
    /// (see [`Store::refund_made_at`]). The default, for a store that does
    /// not record when a counter was made, refunds as [`Store::refund`]
    /// does; [`MemoryStore`] and the Redis store check.
    fn refund_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        let _ = made_by;
        self.refund(now, key, amount)
    }

    /// As [`Store::refund_made_by`], only to the counter whose first call
    /// was `first_call`, exactly as the store reported it
    /// ([`Usage::first_call`]): units taken from one counter (the unused
    /// part of a [`LeasedStore`] block) go back to that counter alone,
    /// never to one made since with an earlier first call (after a reset,
    /// by a charge stamped earlier: an instance whose clock is behind, a
    /// request that waited). `None` when the live counter at `key` is
    /// another, as when there is none.
    ///
    /// What the layer gives back goes this way (a request not served, a
    /// 5xx refunded, a deferred cost below what was charged up front), and
    /// so does a block's unused part. A first-use counter that holds
    /// `amount` exactly (more than 0) is deleted (the answer is
    /// `Some(0)`): nothing else is spent in the period it opened, so the
    /// next charge opens a period, and a rolling period runs from the first
    /// request that spends, not from one refused further in. That holds
    /// while every unit that left the counter was given back this way: a
    /// refund of another kind ([`Store::refund`], [`Store::refund_made_by`]:
    /// support's), which says nothing of whose units it takes, marks a
    /// first-use counter it lowers, and no give-back deletes a marked
    /// counter. Nor does one of more than the counter holds (a request
    /// given back twice over): it takes it to zero and leaves it.
    ///
    /// The default refunds as `refund_made_by(now, key, amount,
    /// first_call)` does, and deletes nothing; [`MemoryStore`] and the
    /// Redis store check the first call, and delete.
    fn refund_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.refund_made_by(now, key, amount, first_call)
    }

    /// Adds `amount` to the live counter at `key`, without checking its limit:
    /// for a cost known only after the request was admitted and served.
    /// Returns what the counter holds afterwards, or `None` when there is no
    /// live counter: an add never creates a counter (one that expired in the
    /// meantime stays expired, so no new period opens) and never changes a
    /// deadline.
    ///
    /// A store fails rather than hold a count other than the sum: when the
    /// sum is beyond what it counts exactly (2^53 for the Redis store), the
    /// add is an error and nothing is written. [`MemoryStore`] counts up to
    /// `u64::MAX` and stays there.
    fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send;

    /// [`add`](Self::add), only to the counter a request charged at
    /// `made_by` was charged to (the instant [`refund_made_by`](Self::refund_made_by)
    /// takes): never to one made since (the counter reset by support and
    /// made anew by a later charge), which answers `None` and is left as
    /// it is. What the layer adds once a deferred cost is known. The
    /// default adds to whatever counter is live; a store that wraps another
    /// passes it on.
    fn add_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        let _ = made_by;
        self.add(now, key, amount)
    }

    /// As [`Store::add_made_by`], only to the counter whose first call was
    /// `first_call`, exactly as the store reported it ([`Usage::first_call`]):
    /// never to one made since with an earlier first call (after a support
    /// reset, by a charge stamped earlier: an instance whose clock is
    /// behind, a request that waited), which answers `None` and is left as
    /// it is. What the layer adds once a deferred cost is known, as
    /// [`Store::refund_made_at`] is what it gives back. The default adds as
    /// `add_made_by(now, key, amount, first_call)` does; [`MemoryStore`]
    /// and the Redis store check the first call.
    fn add_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.add_made_by(now, key, amount, first_call)
    }

    /// Adds `debt.amount` to the counter at `debt.key` without checking its
    /// limit: what requests admitted while the store could not count them
    /// (under [`OnStoreError::FailOpen`](crate::OnStoreError)) owe, settled
    /// by the policy's ledger once the store answers again. Returns what the
    /// counter holds afterwards, or `None` when the debt's lifetime ended by
    /// `now` (its calendar window is over, its first-use period has passed its
    /// deadline): then nothing is written, so a debt is never charged to a
    /// period after its own.
    ///
    /// A live counter keeps its deadline (and its first call), and takes
    /// the debt whatever period it counts: a first-use key names no period,
    /// so a debt whose requests fell in an earlier period (one that has
    /// ended, or that the store never held) goes to a period opened after
    /// them, by a charge made once the store answered; never to one opened
    /// at or past the debt's deadline: a settle then writes nothing and
    /// answers `None`, whether the deadline has passed by `now` or a charge
    /// with a later instant (another instance's clock ahead) opened the
    /// counter found live. Where there is none, the settle creates it as
    /// the requests' charges would have: with `debt.lifetime` (the window's
    /// end, or the first-use deadline computed at the requests' instant,
    /// never a later one). A first-use counter records `debt.since` as its
    /// first call, which may open a period at a request that fell in an
    /// earlier period (and a give-back of a charge made after that request
    /// but before a support reset of the key may then land on it); a
    /// calendar counter records `now` (its window is its period; made now,
    /// it takes no give-back of a charge made before, to a counter support
    /// reset since). A debt of nothing writes nothing, and answers what the
    /// counter holds (0 where there is none). A store fails rather than
    /// hold a count other than the sum, as [`Store::add`] does.
    ///
    /// The ledger sends a settle that failed again (an error of any kind but
    /// [`StoreErrorKind::Other`], or one [`StoreError::unsent`]; an `Other`
    /// error the store may have sent is its refusal, and the debt is
    /// dropped), under the same [`Debt::id`] and with the same amount, until
    /// one answers or the debt's period is over. So a settle that fails, or
    /// whose future is dropped before it answers, must count once in all:
    /// either it leaves nothing added once the store is done with it (as a
    /// charge), or it may have been applied and the store adds nothing when
    /// the same id comes again. The Redis store does the second: a call
    /// whose connection is lost after it was sent may have been applied
    /// with no answer ever to follow, and a mark per settle tells it the
    /// settle sent again from a new one.
    ///
    /// The default makes it a [`Store::charge`] of one line at `now`, with
    /// the largest limit the store counts exactly ([`Store::max_count`]): it
    /// adds to a live counter and creates a missing one with the debt's
    /// lifetime, but records `now` as a new first-use counter's first call.
    /// A store that can do better overrides it; a store that wraps another
    /// passes it on.
    fn settle_debt(
        &self,
        now: Timestamp,
        debt: Debt,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        let store = self.clone();
        async move {
            if debt.lifetime.end() <= now {
                return Ok(None);
            }
            let request = ChargeRequest {
                charged_at: None,
                now,
                lines: smallvec::smallvec![ChargeLine {
                    key: debt.key,
                    limit: store.max_count(),
                    cost: debt.amount,
                    lifetime: debt.lifetime,
                    shadow_limit: None,
                }],
            };
            let outcome = store.charge(request).await?;
            match (outcome.admitted, outcome.usage.first()) {
                (true, Some(usage)) => Ok(Some(usage.used)),
                (false, _) => Err(StoreError::new(
                    StoreErrorKind::Other,
                    "settling a debt would take the counter beyond what the store counts exactly",
                )),
                (true, None) => Err(StoreError::new(
                    StoreErrorKind::Other,
                    "the store answered a charge of one line without its usage",
                )),
            }
        }
    }

    /// Deletes the counter at `key`, so its subject starts afresh (for a
    /// first-use quota, the next call opens a new period). Returns whether
    /// there was one.
    fn reset(&self, key: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// An identity the clones of this store share, and no other live store
    /// has: policies on one store check, when their layers are made, that
    /// no two different quotas of theirs count on one counter (two policies
    /// on one store with the same namespace, say, a daily 10 and a daily
    /// 100). `None`, the default, leaves that unchecked; a store that wraps
    /// another returns the inner store's.
    fn identity(&self) -> Option<usize> {
        None
    }

    /// The largest limit and cost this store decides on exactly: a quota
    /// whose limit (or a plan's) is larger is refused when its layer is
    /// made, and a request that costs more is refused with 400 before any
    /// charge. `u64::MAX` by default (and for [`MemoryStore`]); the Redis
    /// store's script counts in doubles, exact below 2^53. A store that
    /// wraps another returns the inner store's.
    fn max_count(&self) -> u64 {
        u64::MAX
    }

    /// How long this store may wait on purpose before it answers a charge
    /// (a [`LeasedStore`] waits up to 25 ms for units on their way back
    /// before it answers a refusal): a policy's `store_timeout` must be
    /// longer, or each such wait would fail the request (a 503, or under
    /// fail open an admission past the limit), and the policy refuses one
    /// that is not when it is built. Zero by default; a store that wraps
    /// another adds its own to the inner store's.
    fn longest_wait(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }

    /// The longest this store waits for one call of its own before it
    /// fails it, if it bounds its calls (the Redis store's budget,
    /// [`RedisStoreBuilder::timeout`](crate::store::redis::RedisStoreBuilder::timeout)):
    /// a policy whose `store_timeout` is far longer waits for nothing more,
    /// which it logs when it is built. `None` by default; a store that
    /// wraps another answers the inner store's.
    fn call_budget(&self) -> Option<std::time::Duration> {
        None
    }

    /// When this store last had an answer from the server it calls, to any
    /// call, if it calls one and had one (the Redis store: any reply from
    /// Redis). A policy waits for a charge past its
    /// [`store_timeout`](crate::QuotaPolicyBuilder::store_timeout) while
    /// such answers keep coming: a store slow under load, not one that
    /// stalled. `None` by default (a store that answers at once, or tells
    /// nothing: its charges are waited for `store_timeout` at most); a store
    /// that wraps another answers the inner store's.
    fn last_answer(&self) -> Option<tokio::time::Instant> {
        None
    }

    /// How many charges (and settles it would give back) of this store are
    /// still on their way, followed after their callers stopped waiting
    /// included (a charge the Redis store gives back if Redis applied it
    /// late; a settle it marks has nothing to give back, and is sent again):
    /// what [`QuotaPolicy::settle_owed`](crate::QuotaPolicy::settle_owed)
    /// waits for, so that a process that exits after it leaves no such
    /// charge counted. Reads and changes, with nothing to give back, are
    /// not counted (a server clock's reads, or a leased store's give-backs,
    /// to a stalled Redis would hold a shutdown for its whole wait). Zero
    /// by default; a store that wraps another adds the inner store's.
    fn charges_in_flight(&self) -> usize {
        0
    }
}
