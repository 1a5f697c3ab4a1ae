//! Leased counting: see [`LeasedStore`].

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use hashbrown::HashTable;
use jiff::{SignedDuration, Timestamp};
use smallvec::SmallVec;
use tokio::time::Instant;

use super::slot_key::MapKey;
use super::{
    ChargeAnswer, ChargeLine, ChargeOutcome, ChargeRequest, Debt, Lifetime, Made, Store,
    StoreError, StoreErrorKind, Usage,
};
use crate::key::PeriodKey;
use crate::throttle::Throttle;

/// Give-backs that failed, logged a few times per second at most.
static GIVE_BACK_ERRORS: Throttle = Throttle::new(5);

/// Leased counting: blocks of a subject's allowance taken from a shared
/// store in one charge and spent locally.
///
/// Every charge through a store shared by many instances (Redis) is a round
/// trip. [`LeasedStore`] wraps such a store: when a subject calls often on
/// this instance, a charge takes a few more units than the request costs (a
/// *block*), and the next requests of that subject spend the block here,
/// without asking the store. The units of a block are charged in the store
/// the moment they are taken, so the store's count is never below what the
/// instances admitted, and no instance can admit more than the limit
/// however many share it: the limit holds exactly across instances.
///
/// # What a block is
///
/// - **Its size follows the subject's rate on this instance**: about what
///   the subject spends here in four fifths of a lease time (so that a
///   steady subject spends it before the lease time ends), growing at most
///   fourfold from one block to the next (the first at most 8 units). A
///   subject that calls once in a while takes no block at all: each of its
///   requests is one charge, as without leases, and so is the first
///   request of a subject back after a pause. A subject that took blocks
///   is remembered for six lease times after it went quiet (while this
///   instance tracks fewer than half its bound of counters): the block its
///   second request back takes is at least the last block's size.
/// - **The next block is taken when a block runs out**, within 10 ms of
///   the request that spent its last unit, without waiting for the
///   subject's next request, and together with the next blocks of the
///   subjects whose blocks ran out meanwhile: with a store that batches
///   concurrent charges (as the Redis store does), one call takes many
///   subjects' blocks. A request that comes before (a subject calling more
///   than a hundred times a second here) takes the block with its own
///   charge instead, as does a subject's first request back after a pause.
///   (Not for a first-use quota: a charge made for no request could open a
///   period, if its counter was reset elsewhere meanwhile.)
/// - **It shrinks as the allowance runs low**: a block is at most a quarter
///   of what the counter had left when last seen, so near the limit blocks
///   are single units and every request is a charge of its own (exact, as
///   without leases). A request's block is taken with its charge as far as
///   it fits ([`Store::charge_taking`]; when other instances spent
///   meanwhile, a quarter of what is left is kept, the rest goes straight
///   back), in the one call: the block never refuses the request. (A
///   subject's next block taken without a request, sent with other
///   subjects', is taken whole or not at all.) A request the store
///   refuses because it counted a block on its way to this instance (taken
///   by another request's charge a moment before) waits for the block, 25
///   ms at most, and is served from it. A shadow
///   quota's blocks shrink by its limit ([`ChargeLine::shadow_limit`]) as
///   an enforced quota's do, so the count told near it is as exact.
/// - **Unused units go back** to the store, with a refund (which never
///   creates a counter and never moves a deadline, and goes only to the
///   counter the units were taken from, by its first call: never to one
///   made since, after a reset, whatever its first call; one that takes
///   back all a first-use counter holds deletes it, as every give-back
///   does, unless a support refund marked it; see
///   [`Store::refund_made_at`]), when the subject has
///   been idle on this instance for the idle bound (1 s by default), when a
///   block is older than the lease time (10 s by default, whatever the
///   subject does), and on [`LeasedStore::shutdown`]. The store counts
///   them until they land: a request it refuses meanwhile, on the instance
///   that gives them back, waits for them (25 ms at most) and is sent
///   again, rather than being refused while they are on their way.
/// - **A block of a period that has ended is dropped**, not given back: a
///   calendar window that closed, or a first-use period past its deadline.
///   Blocks taken near a period's end hold what the subject spends until
///   then at its rate here, so a subject that slows down or stops just
///   before the end leaves the ended period counting a few units it was
///   not served (bill from what was served if that matters).
///   A support [`reset`](Store::reset) through this store lets go of this
///   instance's block of that counter, given back before the counter is
///   deleted (so that a reset that fails leaves nothing charged that
///   nothing served), and takes no block of it until the delete is
///   answered, whether or not this instance knew the subject.
///
/// # What leases cost
///
/// - While this instance holds a block, other instances see its unused
///   units as spent: a subject can be refused on one instance while
///   another holds units of it, until that one's idle bound passes (or its
///   lease time, if the subject keeps calling there). Such a refusal tells
///   the client so: its `Retry-After` is the idle bound, not the wait until
///   the reset (see [`Usage::held_elsewhere_until`] and the lease marks
///   below), while its `RateLimit` field tells the window's reset and
///   `r=0`, what the store counts now.
/// - A reset or a refund made elsewhere reaches this instance when it next
///   asks the store: within the lease time at most, since no block is spent
///   past it. So does a plan changed while other instances served the
///   caller: units this instance took under a plan are spent under that
///   plan or a higher one while it holds them, though other instances
///   served the caller on a higher plan meanwhile and the count passed the
///   lower limit (at most one block, for at most the lease time; a
///   request under a lower plan than the block's gives the block back
///   first and asks the store). The layer's give-back of a request this
///   instance served goes into its block (at the first call of the counter
///   the request was counted on, and only while no request was charged here
///   on that counter under a higher limit than the block was taken under:
///   the units of a request on a higher plan, spent under the block's lower
///   limit, would pass it, and such a give-back goes to the store; a request
///   served from a block of a counter reset elsewhere since, whose answer
///   tells the new counter's later first call, goes by the instant the block
///   was taken, [`Usage::counted_at`], to the store, where it finds nothing:
///   so does one paid in part by the store too, whose store part then stays
///   charged). So does any other give-back at the counter's first call
///   ([`Store::refund_made_at`]), as far as the block has room for it: other
///   instances see it once the block goes back. (A first-use counter's
///   period opened by a request that took a block and was then not served
///   stays open when a request is served from that block: it then runs
///   from the block's take, at most the lease time before the first
///   request served.) Any other refund
///   ([`Store::refund`], [`Store::refund_made_by`]: support's,
///   [`QuotaHandle::refund`](crate::QuotaHandle::refund) and
///   [`QuotaHandle::refund_at`](crate::QuotaHandle::refund_at)) goes to the
///   store, which then knows that no give-back closes the counter's period
///   (see [`Store::refund_made_at`]). A support refund larger than what was spent takes the count
///   below the units instances hold, which they then spend on top of the
///   limit: refund at most what the subject was charged.
/// - An instance that stops without [`LeasedStore::shutdown`] (a crash, a
///   kill) leaves its unused units charged until the counter's period ends:
///   at most one block per subject it served in the last lease time, each
///   at most [`LeasedStoreBuilder::max_block`] units and a quarter of what
///   was left.
/// - A give-back goes only to a counter made by the instant its block was
///   taken (never to one made anew after a reset), as the instance that
///   made the counter dated it. Instances whose clocks differ by `d` may
///   then find a block taken within `d` of its counter's making refused
///   back: its unused units stay charged until the period ends. Keep the
///   instances' clocks synchronised (NTP keeps them within milliseconds),
///   or give every policy the Redis server's (`RedisStore::server_clock`).
/// - Answers are taken in by the order their charges were sent (numbered
///   as they go to the store, after any wait for an old block's return):
///   one that lands after the answer to a later charge and tells of another
///   counter is of a counter gone (reset elsewhere, or a first-use period
///   that ended): a block it took goes back to that counter by its first
///   call, exactly, and so lands nowhere, the counter being gone; or,
///   should the store have applied the two charges in the other order than
///   they were sent, across that reset or period's end (one round trip
///   apart), on the live counter, of which nobody here holds those units.
///   Likewise, a block held here when a later answer tells of another
///   counter, or of none (the store applied that charge before the earlier
///   one that made the counter), goes back to the counter it was taken
///   from, by that counter's first call. (From a store that tells no first
///   calls, such blocks are dropped: their units stay charged until the
///   period ends.)
/// - A give-back of an idle or old block that the store never got (it was
///   away, or had no room for the call) puts the block back with this
///   instance, if nothing changed there since (no answer of the store
///   taken in, no reset, the same period): it is spent while fresh, and
///   given back when next idle or old, or on a shutdown. Otherwise (and
///   for the rest of a block cut short, which no entry holds) it is sent
///   again, 100 ms later, then twice as long each time up to every 3.2 s,
///   until the store gets it, for 10 minutes at most (so an outage of that
///   long leaves none of its units charged, while the process lives).
///   [`LeasedStore::shutdown`] sends its own give-backs again the same way,
///   and waits for those still being sent again, for a lease time at most
///   (10 s by default): a store back within it gets every unused unit. A
///   give-back that failed after it was sent (a timeout: it may have
///   landed), or never got through within those bounds, or was still on
///   its way when the process exited, leaves its units charged until the
///   period ends.
/// - The usage a leased charge reports counts this instance's unused units
///   as not spent (they are not, yet), and other instances' as spent.
/// - Store calls beyond the charges: a give-back per block that was not
///   spent, and for the lease marks one call when an instance stops
///   holding units of a counter before its mark ends, and one when it
///   still holds units of it once its mark ended (it joins a new one).
///   Each charge sent to
///   the store reads the marks of its counters (one more line per counter,
///   in the same call), and a charge that takes a block joins its mark in
///   that same line.
///
/// # Lease marks
///
/// Beside each counter it leases from, the store keeps a *lease mark*: how
/// many instances hold a block of it. It is a counter of its own (the
/// counter's key with `%held` after the allowance, in the same hash tag),
/// living one lease time from when it was made, so the mark of an instance
/// that died ends on its own. An instance joins it (one more) with the
/// charge that makes it a holder: the mark's line in that charge costs one
/// instead of nothing, and never refuses, so it is counted exactly when the
/// block is taken. It leaves it (a guarded refund) when it holds nothing
/// any more: its block went back, was dropped, or was spent and no new one
/// came; that is a call of its own, in a task of its own, never waited for
/// by a request. A mark never changes whether a request is admitted.
/// (A mark is a counter, though: on a memory store with a bound it takes
/// room as one; a charge that finds no room for it is sent again without
/// joining.)
/// Every charge sent to the store reads the marks of its counters, in the
/// same call, with lines that cost nothing (they never make a counter nor
/// refuse): when other instances are marked on a counter that refused, the
/// refusal tells a wait of this instance's idle bound (or until the mark
/// ends, if sooner).
///
/// The mark is a hint for clients, never a count: a holder whose subject
/// keeps calling keeps its block up to the lease time, instances may set
/// other idle bounds, an instance that holds units when the mark it is
/// counted in ends (a block taken while the mark counted it joins nothing,
/// and a mark lives one lease time from its making) joins a new one only
/// at its next sweep (a quarter of the shorter of its idle bound and lease
/// time later), and while this instance's own joining or
/// leaving is on its way, or after one failed, it takes the mark to count
/// it (so it may tell the full wait where a short one was due, but never a
/// short wait because of its own part).
///
/// Giving back runs in a task on the tokio runtime, started with the first
/// block; outside a tokio runtime no block is taken.
///
/// ```
/// use tower_quota::store::LeasedStore;
/// use tower_quota::{FromHeader, MemoryStore, Quota, QuotaPolicy};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// // A shared store (here a memory store, to keep the example small).
/// let store = LeasedStore::new(MemoryStore::new());
/// let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
///     .store(store.clone())
///     .build();
/// let layer = policy.layer(Quota::daily(1_000));
/// // ... serve with `layer` ...
/// # drop(layer);
/// // On the way out, give the unused units back.
/// store.shutdown().await;
/// # }
/// ```
///
/// Clones share the blocks.
pub struct LeasedStore<St> {
    inner: St,
    shared: Arc<Shared>,
}

impl<St: Clone> Clone for LeasedStore<St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<St: fmt::Debug> fmt::Debug for LeasedStore<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeasedStore")
            .field("inner", &self.inner)
            .field("settings", &self.shared.settings)
            .finish()
    }
}

/// Builds a [`LeasedStore`]; see [`LeasedStore::builder`].
#[derive(Debug)]
pub struct LeasedStoreBuilder<St> {
    inner: St,
    settings: Settings,
}

#[derive(Clone, Copy, Debug)]
struct Settings {
    idle: Duration,
    lease_time: Duration,
    max_block: u64,
    max_counters: usize,
}

impl Settings {
    /// How long this instance remembers that an idle subject was busy: six
    /// lease times.
    fn rate_memory(&self) -> Duration {
        self.lease_time.saturating_mul(6)
    }

    /// How near its end a lease mark is left alone, not left with a refund
    /// (see `Mark::leave`).
    fn mark_margin(&self) -> SignedDuration {
        span(self.lease_time / 10)
    }

    /// The lease time, to add to an instant.
    fn lease(&self) -> SignedDuration {
        span(self.lease_time)
    }
}

/// `duration` as a span of time to add to an instant.
fn span(duration: Duration) -> SignedDuration {
    SignedDuration::try_from(duration).unwrap_or(SignedDuration::MAX)
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            idle: Duration::from_secs(1),
            lease_time: Duration::from_secs(10),
            max_block: 1_000,
            max_counters: 100_000,
        }
    }
}

impl<St: Store> LeasedStoreBuilder<St> {
    /// How long a subject may go without a request on this instance before
    /// its unused units go back to the store. 1 s by default.
    ///
    /// # Panics
    ///
    /// When `idle` is zero.
    #[must_use]
    pub fn idle(mut self, idle: Duration) -> Self {
        assert!(!idle.is_zero(), "the idle bound of leases must not be zero");
        self.settings.idle = idle;
        self
    }

    /// The longest a block is spent from: its unused units go back once it
    /// is this old, even while its subject keeps calling, so a reset or a
    /// refund made elsewhere reaches this instance within it. 10 s by
    /// default.
    ///
    /// # Panics
    ///
    /// When `lease_time` is zero, or longer than 100 years: a lease's mark
    /// would outlive every instant its store counts (the years 1678 to
    /// 2262 on a [`MemoryStore`](crate::MemoryStore)), which would fail
    /// every charge.
    #[must_use]
    pub fn lease_time(mut self, lease_time: Duration) -> Self {
        assert!(
            !lease_time.is_zero(),
            "the lease time of leases must not be zero"
        );
        assert!(
            lease_time.as_secs() <= crate::period::MAX_FIXED_SECONDS,
            "the lease time of leases is at most 100 years (got {lease_time:?})"
        );
        self.settings.lease_time = lease_time;
        self
    }

    /// The most units one block takes beyond the request's own cost. 1 000
    /// by default; `0` turns leasing off (every request is a charge).
    #[must_use]
    pub fn max_block(mut self, max_block: u64) -> Self {
        self.settings.max_block = max_block;
        self
    }

    /// The most counters this instance keeps track of (their rate and
    /// block); past it, new subjects are charged request by request until
    /// some go idle. 100 000 by default. (Charges that land at the same
    /// moment on different cores may each add one past it.)
    #[must_use]
    pub fn max_counters(mut self, max_counters: usize) -> Self {
        self.settings.max_counters = max_counters;
        self
    }

    /// The store.
    pub fn build(self) -> LeasedStore<St> {
        LeasedStore {
            inner: self.inner.clone(),
            shared: Arc::new(Shared {
                settings: self.settings,
                shards: (0..shard_count()).map(|_| Mutex::default()).collect(),
                hasher: foldhash::fast::RandomState::default(),
                entries: AtomicUsize::new(0),
                closed: AtomicBool::new(false),
                sweeping: AtomicBool::new(false),
                generations: AtomicU64::new(0),
                prefetch: Mutex::default(),
                busy: AtomicUsize::new(0),
                resending: Arc::default(),
                setting_aside: AtomicUsize::new(0),
                sent: AtomicU64::new(0),
                resets: Mutex::default(),
                orphans: orphans(self.inner),
            }),
        }
    }
}

/// Sends back units that no entry here holds any more, in a task of their
/// own on a tokio runtime (a shutdown waits for it): units set aside for a
/// request whose entry was let go of meanwhile (a reset through this
/// instance, which may fail; a shutdown's drain). A guarded give-back, as
/// every one: nothing once their counter is gone or made anew.
fn orphans<St: Store>(inner: St) -> Orphans {
    Box::new(move |shared: &Arc<Shared>, backs: Vec<GiveBack>| {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let inner = inner.clone();
                let busy = Busy::new(shared);
                drop(runtime.spawn(async move {
                    for back in backs {
                        back.send(&inner, &busy.shared).await;
                    }
                }));
            }
            Err(_) => {
                if let Some(suppressed) = GIVE_BACK_ERRORS.admit() {
                    let units: u64 = backs.iter().map(|back| back.units).sum();
                    tracing::warn!(
                        units,
                        suppressed,
                        "leased units set aside for a request were let go of outside a tokio runtime: they stay charged"
                    );
                }
            }
        }
    })
}

/// See [`orphans`].
type Orphans = Box<dyn Fn(&Arc<Shared>, Vec<GiveBack>) + Send + Sync>;

/// Shards of the counters an instance knows: enough that requests of
/// different subjects on different cores seldom wait for each other.
fn shard_count() -> usize {
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    (cores * 4).next_power_of_two()
}

/// One shard of the counters an instance knows.
type Map = HashTable<Entry>;

/// A counter with its key, kept in the map's slot when short (see
/// [`MapKey`]): a lookup then compares the key beside its counter, without
/// a read from another allocation.
struct Entry {
    key: MapKey,
    counter: Counter,
}

/// What the clones of one leased store share.
struct Shared {
    settings: Settings,
    /// The counters this instance knows, sharded by key: a request locks
    /// the shards of its keys (one, nearly always), and requests on other
    /// keys go on meanwhile.
    shards: Box<[Mutex<Map>]>,
    /// Picks a key's shard.
    hasher: foldhash::fast::RandomState,
    /// The counters in all shards, against `max_counters`.
    entries: AtomicUsize,
    /// Set by `shutdown`: no block is taken any more.
    closed: AtomicBool,
    /// Whether the task that gives idle blocks back runs.
    sweeping: AtomicBool,
    /// The last counter entry's generation.
    generations: AtomicU64,
    /// The next blocks of busy subjects whose block ran out, taken together
    /// once [`PREFETCH_DELAY`] has passed since the first of them.
    prefetch: Mutex<Vec<Prefetch>>,
    /// Work in tasks of its own that takes or gives back units (the next
    /// blocks taken, and what their answers give back): a shutdown waits
    /// for it.
    busy: AtomicUsize,
    /// Give-backs the store never got, sent again in tasks of their own
    /// while it is away: a shutdown waits for them, a lease time at most.
    resending: Arc<AtomicUsize>,
    /// Requests on their way with units set aside from a block: a shutdown
    /// lets them land (their units back in the block, or spent) before it
    /// gives the blocks back.
    setting_aside: AtomicUsize,
    /// The charges sent to the store so far: each is numbered as it goes
    /// to the store (again, when it is sent again), so that their answers
    /// are known in the order they were sent, however they land.
    sent: AtomicU64,
    /// The counters whose resets are on their way through this instance,
    /// with how many: until the store deleted a counter, no block of it is
    /// taken, which would be taken from the counter about to go and
    /// outlive it here. Kept apart from the entries: a reset guards a
    /// counter this instance does not know yet, or forgets meanwhile (once
    /// its subject is idle) and meets again. Nearly always empty.
    resets: Mutex<Vec<(PeriodKey, u32)>>,
    /// Sends back units no entry holds any more (see [`orphans`]).
    orphans: Orphans,
}

/// One piece of the work a shutdown waits for, while it lives.
struct Busy {
    shared: Arc<Shared>,
}

impl Busy {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.busy.fetch_add(1, Ordering::SeqCst);
        Self {
            shared: Arc::clone(shared),
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.shared.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A give-back the store never got, sent again in a task of its own,
/// counted in [`Shared::resending`] while it lives. It holds the count
/// alone: the task may outlive every handle of the store, and keeps none
/// of its entries alive.
struct Resending(Arc<AtomicUsize>);

impl Resending {
    fn new(shared: &Shared) -> Self {
        shared.resending.fetch_add(1, Ordering::SeqCst);
        Self(Arc::clone(&shared.resending))
    }
}

impl Drop for Resending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A reset of a counter on its way through this instance (see
/// [`Shared::resets`]), over when dropped: answered, or given up.
struct Resetting {
    shared: Arc<Shared>,
    key: PeriodKey,
}

impl Resetting {
    fn new(shared: &Arc<Shared>, key: &PeriodKey) -> Self {
        let mut resets = shared
            .resets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match resets.iter_mut().find(|(k, _)| k == key) {
            Some((_, n)) => *n += 1,
            None => resets.push((key.clone(), 1)),
        }
        Self {
            shared: Arc::clone(shared),
            key: key.clone(),
        }
    }
}

impl Drop for Resetting {
    fn drop(&mut self) {
        let mut resets = self
            .shared
            .resets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(at) = resets.iter().position(|(k, _)| *k == self.key) {
            resets[at].1 -= 1;
            if resets[at].1 == 0 {
                resets.swap_remove(at);
            }
        }
    }
}

/// The queued next blocks, for the task that drains them: when that task
/// is dropped before it took them (its runtime shut down), they are
/// dropped, so that the next block that runs out starts a task again.
struct Queued(Option<Arc<Shared>>);

impl Queued {
    /// The queued next blocks, now to be taken.
    fn take(mut self) -> Vec<Prefetch> {
        self.0
            .take()
            .map_or_else(Vec::new, |shared| shared.drain_prefetch())
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        let Some(shared) = self.0.take() else {
            return;
        };
        for prefetch in shared.drain_prefetch() {
            let key = &prefetch.line.key;
            if let Some(counter) = shared
                .counter(key)
                .get_mut(key)
                .filter(|c| c.generation == prefetch.generation)
            {
                counter.prefetching = false;
            }
        }
    }
}

/// How long, in all, a request the store refused waits for units of its
/// counters on their way back from this instance, and then for a block on
/// its way here (one store call each, nearly always), before it is sent
/// again: a refusal that waits longer might pass the layer's store
/// timeout.
const RETURN_WAIT: Duration = Duration::from_millis(25);

/// How long a busy subject's next block waits to be taken once its block
/// ran out, so that the takes of the subjects whose blocks run out meanwhile
/// go to the store together: one call for them all with a store that
/// batches concurrent charges (as `RedisStore` does), instead of one each.
const PREFETCH_DELAY: Duration = Duration::from_millis(10);

/// The longest pause between two sends of a give-back the store never got
/// (and that no entry holds again): 100 ms, then twice as long each time,
/// up to this.
const RESEND_UNTIL: Duration = Duration::from_millis(3_200);

/// How long a give-back the store never got, and no entry holds again, is
/// sent again (every [`RESEND_UNTIL`] once its pauses grew that long): an
/// outage up to this long leaves none of its units charged.
const RESEND_UNSENT_FOR: Duration = Duration::from_secs(600);

/// A busy subject's next block, to take without waiting for its next
/// request: the counter's line (costing nothing), and the instant its
/// block ran out, by the layer's clock and the runtime's.
struct Prefetch {
    line: ChargeLine,
    now: Timestamp,
    at: Instant,
    /// The counter's entry when its block ran out: a reset meanwhile makes
    /// a new one, which takes no block of the old one's.
    generation: u64,
}

impl Shared {
    /// The queued next blocks, the queue left empty.
    fn drain_prefetch(&self) -> Vec<Prefetch> {
        std::mem::take(
            &mut *self
                .prefetch
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// The number of a charge sent now.
    fn next_sent(&self) -> u64 {
        self.sent.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// A new counter entry's generation.
    fn next_generation(&self) -> u64 {
        self.generations.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The hash of `key`, which picks its shard and its slot there.
    fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The shard of the key hashed to `hash`: bits a shard's table does
    /// not use for the slot (the lowest) nor for its tag (the highest), so
    /// the keys of one shard spread over its slots. The shard count is a
    /// power of two.
    fn shard_of(&self, hash: u64) -> usize {
        ((hash >> 32) as usize) & (self.shards.len() - 1)
    }

    fn lock(&self, shard: usize) -> MutexGuard<'_, Map> {
        self.shards[shard]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The counters at `keys`, their shards locked in index order, so that
    /// two callers never wait for each other in a cycle (a request has one
    /// key nearly always).
    fn counters<'a>(&self, keys: impl IntoIterator<Item = &'a PeriodKey>) -> Counters<'_> {
        let mut shards = SmallVec::<[usize; 2]>::new();
        for key in keys {
            let shard = self.shard_of(self.hash(key.as_str().as_bytes()));
            if !shards.contains(&shard) {
                shards.push(shard);
            }
        }
        shards.sort_unstable();
        let mut guards = SmallVec::new();
        for shard in shards {
            guards.push((shard, self.lock(shard)));
        }
        Counters {
            shared: self,
            guards,
        }
    }

    /// Whether a reset of the counter at `key` is on its way through this
    /// instance (see [`Shared::resets`]).
    fn is_resetting(&self, key: &PeriodKey) -> bool {
        self.resets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .any(|(k, _)| k == key)
    }

    /// The counter at `key`, its shard locked.
    fn counter(&self, key: &PeriodKey) -> Counters<'_> {
        self.counters(std::iter::once(key))
    }

    /// Waits while units of the counters at `keys` are on their way back
    /// to the store from here, until `deadline` at most; whether there were
    /// some, and they all landed.
    async fn wait_for_returns(&self, keys: &[&PeriodKey], deadline: Instant) -> bool {
        let returning = || {
            keys.iter().any(|key| {
                self.counter(key)
                    .get_mut(key)
                    .is_some_and(|counter| counter.returning > 0)
            })
        };
        // Waited for on a runtime only: without one, nothing gives units
        // back in a task of its own.
        if keys.is_empty() || tokio::runtime::Handle::try_current().is_err() || !returning() {
            return false;
        }
        while returning() {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        true
    }

    /// Waits while a block is on its way here, or units of its block are
    /// set aside for another request, for a line of `lines` that had no
    /// room (`full`) and whose block cannot pay for it, until
    /// `deadline` at most; whether every such line's block can now (units
    /// enough, and room under the line's limit for what was served).
    async fn wait_for_blocks(
        &self,
        lines: &[ChargeLine],
        full: &[bool],
        deadline: Instant,
    ) -> bool {
        let lines: SmallVec<[&ChargeLine; 2]> = lines
            .iter()
            .zip(full)
            .filter(|(line, &full)| full && line.cost > 0)
            .map(|(line, _)| line)
            .collect();
        if lines.is_empty() {
            return false;
        }
        // Whether every line's block can pay for it, with the store's room
        // for the rest of its cost (as the request sent again pays: from
        // the block, then the store), and whether one is on its way for a
        // line whose block cannot.
        let state = || {
            let mut counters = self.counters(lines.iter().map(|line| &line.key));
            let (mut held, mut taking) = (true, false);
            for line in &lines {
                let counter = counters.get_mut(&line.key);
                let lease_time = self.settings.lease_time;
                let pays = counter.as_ref().is_some_and(|c| {
                    c.units > 0
                        && super::has_room(c.usage().used, line.cost, line.limit)
                        && line.limit >= c.block_limit
                        && c.block_since
                            .is_some_and(|since| since.elapsed() < lease_time)
                });
                if !pays {
                    held = false;
                    // A block on its way here, or units set aside for
                    // another request, which come back if it is refused.
                    taking |= counter.is_some_and(|c| c.taking || c.reserved > 0);
                }
            }
            (held, taking)
        };
        if tokio::runtime::Handle::try_current().is_err() {
            return false;
        }
        loop {
            match state() {
                (true, _) => return true,
                (false, false) => return false,
                (false, true) if Instant::now() >= deadline => return false,
                (false, true) => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        }
    }

    /// Runs `f` on every shard in turn, each locked while `f` runs on it.
    fn each_shard(&self, mut f: impl FnMut(&mut Map)) {
        for shard in 0..self.shards.len() {
            let mut map = self.lock(shard);
            let before = map.len();
            f(&mut map);
            let after = map.len();
            if after > before {
                self.entries.fetch_add(after - before, Ordering::Relaxed);
            } else if after < before {
                self.entries.fetch_sub(before - after, Ordering::Relaxed);
            }
        }
    }
}

/// The counters at some keys, their shards locked: see
/// [`Shared::counters`].
struct Counters<'a> {
    shared: &'a Shared,
    guards: SmallVec<[(usize, MutexGuard<'a, Map>); 1]>,
}

impl Counters<'_> {
    /// The hash of `key`, and where the guard of its shard is; `key` must
    /// be one of the keys asked for.
    fn find(&self, key: &PeriodKey) -> (u64, usize) {
        let hash = self.shared.hash(key.as_str().as_bytes());
        // One shard locked (nearly always): it is the key's.
        if self.guards.len() == 1 {
            debug_assert_eq!(
                self.guards[0].0,
                self.shared.shard_of(hash),
                "a key not asked for"
            );
            return (hash, 0);
        }
        let shard = self.shared.shard_of(hash);
        let guard = self
            .guards
            .iter()
            .position(|(s, _)| *s == shard)
            .expect("the shard of a key asked for is locked");
        (hash, guard)
    }

    fn get(&self, key: &PeriodKey) -> Option<&Counter> {
        let (hash, guard) = self.find(key);
        self.guards[guard]
            .1
            .find(hash, |entry| {
                entry.key.as_bytes() == key.as_str().as_bytes()
            })
            .map(|entry| &entry.counter)
    }

    fn get_mut(&mut self, key: &PeriodKey) -> Option<&mut Counter> {
        let (hash, guard) = self.find(key);
        self.guards[guard]
            .1
            .find_mut(hash, |entry| {
                entry.key.as_bytes() == key.as_str().as_bytes()
            })
            .map(|entry| &mut entry.counter)
    }

    /// The counter at `key`, made with `make` when there is none.
    fn get_or_insert_with(
        &mut self,
        key: &PeriodKey,
        make: impl FnOnce() -> Counter,
    ) -> &mut Counter {
        let (hash, guard) = self.find(key);
        let shared = self.shared;
        let entry = self.guards[guard].1.entry(
            hash,
            |entry| entry.key.as_bytes() == key.as_str().as_bytes(),
            |entry| shared.hash(entry.key.as_bytes()),
        );
        let entry = match entry {
            hashbrown::hash_table::Entry::Occupied(entry) => entry.into_mut(),
            hashbrown::hash_table::Entry::Vacant(entry) => {
                shared.entries.fetch_add(1, Ordering::Relaxed);
                entry
                    .insert(Entry {
                        key: MapKey::new(key),
                        counter: make(),
                    })
                    .into_mut()
            }
        };
        &mut entry.counter
    }
}

/// What this instance knows of one counter: where it stood when the store
/// last answered, the units it holds, and the subject's rate here.
#[derive(Clone, Copy, Debug)]
struct Counter {
    /// Units charged in the store and not spent yet: the block.
    units: u64,
    /// When the oldest of `units` was taken, by the runtime's clock and
    /// by the layer's: a give-back goes only to a counter made by then.
    block_since: Option<Instant>,
    taken_at: Option<Timestamp>,
    /// The highest limit a unit of the block was charged under, as the
    /// store checked it (a shadow quota's: the most the store counts, not
    /// its shadow limit): a request under a lower one (its caller's plan
    /// changed, or the quota is enforced now) spends nothing from it, whose
    /// units the store admitted under a limit it no longer has.
    block_limit: u64,
    /// The highest limit a request was charged under here on this counter
    /// (its caller's plan's): a give-back goes into the block only when
    /// this is no higher than the block's limit, since the units of a
    /// request given back may have been charged under it.
    limit_seen: u64,
    /// The counter's limit and count (this instance's units included) as
    /// the store last told, and its reset.
    limit: u64,
    store_used: u64,
    resets_at: Timestamp,
    first_call: Option<Timestamp>,
    /// The last request's instant, by the layer's clock and by the
    /// runtime's: what the give-back task takes "now" to be.
    seen: Timestamp,
    seen_at: Instant,
    /// The time between the last two requests here: a subject back after
    /// a pause takes no block with its first request.
    gap: Duration,
    /// Whether the subject came back from a pause since its last block.
    back: bool,
    /// Which entry this is: a reset makes a new one, and what was on its
    /// way for the old one (units to put back, a mark's joining) does not
    /// land on it.
    generation: u64,
    /// Units requested since the last charge sent, and when it was sent:
    /// the rate (in units: a block follows what the subject spends). By
    /// the runtime's clock, and by the layer's, on which the period ends.
    hits: u64,
    charged_at: Instant,
    charged_now: Timestamp,
    /// The number of the charge whose answer the entry last took in whole
    /// (see [`Shared::sent`]).
    learned: u64,
    /// The last block's size.
    block: u64,
    /// Whether a charge with a block is on its way (one at a time).
    taking: bool,
    /// Whether the block ran out and the next one is to be taken shortly
    /// (see [`PREFETCH_DELAY`]): a request that comes first takes it.
    prefetching: bool,
    /// Units taken from the block for requests whose other lines the store
    /// is asked for: spent or put back once it answers.
    reserved: u64,
    /// The counter's lease mark (see "Lease marks" above) as far as this
    /// instance's own joining and leaving go.
    mark: Mark,
    /// Give-backs of this counter's units on their way to the store (see
    /// [`GiveBack`]): the store counts them until they land, so a request
    /// it refuses meanwhile waits for them and is sent again.
    returning: u32,
    /// Answers of the store to calls other than charges (a refund, an add)
    /// taken in: each sets `store_used` as the store told it, which a
    /// block's give-back the store never got may not add to again (see
    /// [`GiveBack::put_back`]).
    told: u32,
    /// The number of the last call other than a charge (numbered as
    /// charges are, see [`Shared::sent`]) whose answer set `store_used`: an
    /// answer to a charge sent before it tells an older count, which may
    /// only raise the one known (as an older charge's answer does).
    told_sent: u64,
}

/// One instance's part in a counter's lease mark. Joining goes with the
/// charge that takes a block (or, rarely, in a call of its own); leaving is
/// a call of its own, in a task of its own. While one is on its way, or
/// when one failed (a timeout may still have applied it), this instance
/// takes the mark to count it: a short wait is told only for holders
/// beyond this one, never because of this one.
#[derive(Clone, Copy, Debug, Default)]
struct Mark {
    /// The end of the mark the store counts this instance in, as its last
    /// joining or leaving that landed says.
    counted_until: Option<Timestamp>,
    /// Until when the store may count this instance after a joining or a
    /// leaving that failed.
    unsure_until: Option<Timestamp>,
    joining: bool,
    /// To leave once the joining on its way lands: the block is gone.
    leave_when_joined: bool,
    leaving: bool,
    /// To join once the leaving on its way lands: a block came meanwhile.
    join_when_left: bool,
}

impl Counter {
    /// Lets go of the block: the entry holds none of its units, which the
    /// store's count here no longer includes. Its units, when they were
    /// taken, by the layer's clock and the runtime's.
    fn let_go(&mut self) -> (u64, Option<Timestamp>, Option<Instant>) {
        let units = std::mem::take(&mut self.units);
        self.store_used = self.store_used.saturating_sub(units);
        (units, self.taken_at.take(), self.block_since.take())
    }

    fn usage(&self) -> Usage {
        Usage {
            held_elsewhere_until: None,
            counted_at: None,
            limit: self.limit,
            used: self.store_used.saturating_sub(self.units),
            resets_at: self.resets_at,
            first_call: self.first_call,
        }
    }

    /// Where a request under `limit` (its plan's) stands on this counter.
    fn usage_under(&self, limit: u64) -> Usage {
        Usage {
            limit,
            ..self.usage()
        }
    }

    /// The instant now, by the layer's clock as this counter last saw it.
    fn now(&self, at: Instant) -> Timestamp {
        let elapsed = span(at.saturating_duration_since(self.seen_at));
        self.seen.saturating_add(elapsed).unwrap_or(self.seen)
    }

    /// Whether `usage` is of the counter this one knows, not of a later
    /// period on the same key or a counter made anew after a reset: a
    /// counter is known by its first call when the store tells it (a
    /// first-use counter's reset is read from its remaining life, which
    /// moves by a millisecond here and there), else by its reset.
    fn same_period(&self, usage: &Usage) -> bool {
        same_counter(self.first_call, self.resets_at, usage)
    }

    /// Whether the counter's period is over at `now`: its units are
    /// dropped, not given back.
    fn ended(&self, now: Timestamp) -> bool {
        now >= self.resets_at
    }
}

/// A millisecond's wait of a shutdown for work on its way (see [`sleep`]).
async fn pause() {
    sleep(Duration::from_millis(1)).await;
}

/// Waits `duration`: on the tokio runtime's timer, or, awaited outside a
/// runtime (a shutdown, while tasks of one run elsewhere), with the thread
/// blocked.
async fn sleep(duration: Duration) {
    if tokio::runtime::Handle::try_current().is_ok() {
        tokio::time::sleep(duration).await;
    } else {
        std::thread::sleep(duration);
    }
}

/// Whether `usage` is of the counter known by `first_call` (when the store
/// told it) and `resets_at`: see [`Counter::same_period`].
fn same_counter(first_call: Option<Timestamp>, resets_at: Timestamp, usage: &Usage) -> bool {
    match (first_call, usage.first_call) {
        (Some(known), Some(told)) => known == told,
        // The store told this counter's first call, and tells none now:
        // the counter is gone (reset elsewhere, or its period over),
        // whatever its reset would be.
        (Some(_), None) => false,
        _ => same_reset(resets_at, usage.resets_at),
    }
}

/// Whether two resets a store that does not tell first calls reported are
/// of one counter: a first-use counter's is read from its remaining life,
/// which moves by a millisecond here and there.
fn same_reset(known: Timestamp, told: Timestamp) -> bool {
    known.duration_since(told).abs() <= SignedDuration::from_secs(1)
}

impl Mark {
    /// Whether the store counts this instance in the mark at `now`.
    fn counted(&self, now: Timestamp) -> bool {
        self.counted_until.is_some_and(|until| until > now)
    }

    /// Whether the store's count of the mark may include this instance at
    /// `now`.
    fn may_count(&self, now: Timestamp) -> bool {
        self.counted(now)
            || self.joining
            || self.leaving
            || self.unsure_until.is_some_and(|until| until > now)
    }

    /// Whether a holder of a new block joins the mark now.
    fn join(&mut self, now: Timestamp) -> bool {
        self.leave_when_joined = false;
        if self.leaving {
            // Joined again once the leaving landed (see `left`).
            self.join_when_left = true;
            return false;
        }
        if self.joining || self.counted(now) {
            return false;
        }
        self.joining = true;
        true
    }

    /// The joining landed: counted until `until` (`Ok(None)`: the store
    /// made no mark; `Err(unsure)`: it failed, and may count this instance
    /// until `unsure`). Whether to leave at once (the block went
    /// meanwhile).
    fn joined(&mut self, result: Result<Option<Timestamp>, Timestamp>) -> bool {
        self.joining = false;
        match result {
            Ok(until) => self.counted_until = until,
            Err(unsure) => {
                self.counted_until = None;
                self.unsure_until = Some(unsure);
            }
        }
        let leave = std::mem::take(&mut self.leave_when_joined) && self.counted_until.is_some();
        self.leaving |= leave;
        leave
    }

    /// This instance holds nothing any more: whether to leave the mark in
    /// the store now. Not when the mark ends within `margin`: it ends on
    /// its own, and a refund landing after that could take one from a new
    /// mark.
    fn leave(&mut self, now: Timestamp, margin: SignedDuration) -> bool {
        self.join_when_left = false;
        if self.joining {
            self.leave_when_joined = true;
            return false;
        }
        let ends_later = self
            .counted_until
            .is_some_and(|until| now.saturating_add(margin).is_ok_and(|soon| until > soon));
        if self.leaving || !ends_later {
            return false;
        }
        self.leaving = true;
        true
    }

    /// The leaving landed (`ok`: the store took it). Whether to join
    /// again now, in a call of its own: a block came while it was on its
    /// way, and the instance is `holding` units still.
    fn left(&mut self, ok: bool, holding: bool) -> bool {
        self.leaving = false;
        if !ok {
            self.unsure_until = self.counted_until.max(self.unsure_until);
        }
        self.counted_until = None;
        let join = std::mem::take(&mut self.join_when_left) && holding;
        self.joining |= join;
        join
    }
}

impl<St: Store> LeasedStore<St> {
    /// Leases from `inner` with the default bounds (idle 1 s, lease time
    /// 10 s, blocks of at most 1 000 units, 100 000 counters tracked).
    pub fn new(inner: St) -> Self {
        Self::builder(inner).build()
    }

    /// A builder to set the bounds.
    pub fn builder(inner: St) -> LeasedStoreBuilder<St> {
        LeasedStoreBuilder {
            inner,
            settings: Settings::default(),
        }
    }

    /// The store leased from.
    pub fn inner(&self) -> &St {
        &self.inner
    }

    /// The unused units this instance holds, over all counters.
    pub fn held(&self) -> u64 {
        let mut held = 0;
        self.shared
            .each_shard(|counters| held += counters.iter().map(|e| e.counter.units).sum::<u64>());
        held
    }

    /// Gives every unused unit back to the store and takes no block from
    /// now on (requests are then charged one by one). Await it on a
    /// graceful shutdown, once the server stopped taking requests: what an
    /// instance holds when it stops without it stays charged until the
    /// counters' periods end. Requests still on their way with units of a
    /// block set aside (a request of several lines whose others the store
    /// is asked for) are waited for first, a lease time at most. A store
    /// that is away (a give-back it never got) is waited for, the units
    /// sent again until it takes them, for a lease time at most from the
    /// start of the shutdown; so are give-backs of blocks let go of before
    /// (an idle subject's) that the store never got: bound the wait with
    /// the lease time, or with a timeout of your own around this future.
    /// Returns the units given back. Awaited outside a tokio runtime, it
    /// blocks its thread while it waits for such work, done in tasks of one.
    pub async fn shutdown(&self) -> u64 {
        self.shared.closed.store(true, Ordering::SeqCst);
        // Units set aside for requests on their way come back into their
        // block if the store refuses them: let those land first, for a
        // lease time at most (a request whose store never answers). A store
        // away is waited for as long.
        let started = tokio::time::Instant::now();
        let deadline = started
            .checked_add(self.shared.settings.lease_time)
            .unwrap_or_else(|| started + Duration::from_secs(3_600));
        while self.shared.setting_aside.load(Ordering::SeqCst) > 0
            && tokio::time::Instant::now() < deadline
        {
            pause().await;
        }
        let at = Instant::now();
        let mut drained = Vec::new();
        self.shared.each_shard(|counters| {
            drained.extend(
                counters
                    .drain()
                    .map(|Entry { key, counter: c }| (key.to_period_key(), c, c.now(at)))
                    .filter(|(_, c, now)| c.units > 0 || c.mark.counted(*now) || c.mark.joining),
            );
        });
        let margin = self.shared.settings.mark_margin();
        let mut returned = 0;
        // Counters together, a bounded number at a time, as the sweep
        // gives back: one after the other, a shutdown under a grace period
        // would be cut short with most blocks still charged. (One after the
        // other without a tokio runtime, which tasks need.)
        let on_runtime = tokio::runtime::Handle::try_current().is_ok();
        let mut returning = tokio::task::JoinSet::new();
        for (key, mut counter, now) in drained {
            let units = if counter.ended(now) { 0 } else { counter.units };
            let taken_at = counter.taken_at.unwrap_or(now);
            let leaving = counter.mark.leave(now, margin);
            let back = return_one(
                self.inner.clone(),
                now,
                key,
                units,
                taken_at,
                leaving,
                deadline,
            );
            returned += if on_runtime {
                spawn_bounded(&mut returning, back).await.unwrap_or(0)
            } else {
                back.await
            };
        }
        while let Some(back) = returning.join_next().await {
            returned += back.unwrap_or(0);
        }
        // A next block taken in the background may still be on its way:
        // it goes back as soon as it lands (see `learn`).
        while self.shared.busy.load(Ordering::SeqCst) > 0 {
            pause().await;
        }
        // Give-backs of blocks let go of before, which the store never got,
        // are sent again while it is away.
        while self.shared.resending.load(Ordering::SeqCst) > 0
            && tokio::time::Instant::now() < deadline
        {
            pause().await;
        }
        returned
    }

    /// The block to ask for beyond `line_cost` on `key` at `at`, and
    /// whether this charge takes it (only one at a time per counter).
    fn block_for(
        &self,
        counters: &mut Counters<'_>,
        line: &ChargeLine,
        now: Timestamp,
        at: Instant,
        runtime: bool,
    ) -> u64 {
        let settings = &self.shared.settings;
        if !runtime || settings.max_block == 0 || self.shared.closed.load(Ordering::Relaxed) {
            return 0;
        }
        let Some(counter) = counters.get_mut(&line.key) else {
            return 0;
        };
        // A subject calling less often than the idle bound would have its
        // block given back before spending it, and one back after a pause
        // may be back for one request: no block.
        if counter.taking
            || self.shared.is_resetting(&line.key)
            || counter.ended(now)
            || counter.gap >= settings.idle
        {
            return 0;
        }
        // The rate (units) since the last charge sent, over four fifths of a lease
        // time: a steady subject spends its block before the lease time
        // ends, and takes the next one when it runs out (one store call),
        // instead of giving back what is left at the end of the lease and
        // taking a new block (two).
        // The rate is read over at least the idle bound: the requests since
        // a charge sent a moment ago (the first request back after a pause,
        // or one sent alone while a block was on its way) say little of it,
        // and over a few milliseconds would make it look hundreds of times
        // higher than it is.
        let elapsed = at
            .saturating_duration_since(counter.charged_at)
            .max(settings.idle)
            .as_secs_f64();
        let horizon = settings.lease_time.as_secs_f64() * 0.8;
        let rate = if elapsed > 0.0 {
            (counter.hits as f64 * horizon / elapsed).ceil() as u64
        } else {
            u64::MAX
        };
        // Back from a pause, the rate is read from a request or two: a
        // subject that took blocks before takes at least the last one's
        // size.
        let wanted = if counter.back {
            rate.max(counter.block)
        } else {
            rate
        };
        // No more than the subject spends before the period ends: a block
        // of a period that ended is dropped, and what it held stays counted
        // in that period, never served. At its rate since the last charge
        // sent, over the time that really passed (a millisecond at least):
        // read over the idle bound, as above, the rate of a subject whose
        // blocks last less than it would look lower than it is, and its
        // blocks would shrink to single units, a store call per request,
        // for the last second of every period. Both on the layer's clock,
        // which ends the period: a `ManualClock` moved by a test while the
        // runtime's time stands still (or the reverse) sizes blocks as
        // its own time passes.
        let until_end = counter.resets_at.duration_since(now).as_secs_f64();
        let since_charge = now
            .duration_since(counter.charged_now)
            .as_secs_f64()
            .max(0.001);
        let until_end = if until_end > 0.0 {
            (counter.hits as f64 * until_end / since_charge).ceil() as u64
        } else {
            0
        };
        let left = sized_by(line).saturating_sub(counter.store_used);
        let block = [
            wanted,
            until_end,
            settings.max_block,
            counter.block.saturating_mul(4).saturating_add(8),
            left.saturating_sub(line.cost) / 4,
        ]
        .into_iter()
        .min()
        .unwrap_or(0);
        if block > 0 {
            counter.taking = true;
            counter.prefetching = false;
        }
        block
    }

    /// Spends `request` from this instance's blocks if every line has one
    /// with room. Otherwise the request goes to the store: the lines whose
    /// block has room are spent from it (and restored if the store refuses
    /// the rest), the others are charged there, each asking for a block
    /// when its subject is busy here. A request answered from the blocks
    /// counts as a local charge if `first`: not when it is sent again, once
    /// the store refused it (it asked the store).
    fn spend_locally(
        &self,
        request: &ChargeRequest,
        at: Instant,
        first: bool,
    ) -> Result<ChargeOutcome, Box<Plan>> {
        // Blocks held here go back once idle, by a sweep: started again
        // if the runtime that ran it stopped (a load, nearly always).
        self.start_sweeping();
        // Before the shards' guards: a give-back dropped locks its shard.
        let mut stale = Vec::new();
        let mut counters = self
            .shared
            .counters(request.lines.iter().map(|line| &line.key));
        let lease_time = self.shared.settings.lease_time;
        let margin = self.shared.settings.mark_margin();
        // Per line, the units taken from a fresh block here: all of its
        // cost, part of it, or none. Taken as the lines come, so a key
        // listed twice takes from its block twice.
        let mut taken: SmallVec<[u64; 2]> = SmallVec::with_capacity(request.lines.len());
        // Per line paid from a block, when its units were charged in the
        // store (the block's oldest): what a give-back of them goes by.
        let mut counted: SmallVec<[Option<Timestamp>; 2]> =
            SmallVec::with_capacity(request.lines.len());
        // Per line paid from a block, the first call of the counter the
        // block was taken from: the counter the line was charged on.
        let mut counted_on: SmallVec<[Option<Timestamp>; 2]> =
            SmallVec::with_capacity(request.lines.len());
        let mut stale_first = false;
        let mut unmarked = Vec::new();
        let mut alone = None;
        // A line whose counter this instance does not know (a first
        // charge, or one that costs nothing), or that has no room for what
        // it costs (nothing, too: the store refuses a line over its limit
        // whatever it costs), is the store's to answer.
        let mut to_store = false;
        for line in &request.lines {
            let Some(counter) = counters.get_mut(&line.key) else {
                taken.push(0);
                counted.push(None);
                counted_on.push(None);
                to_store = true;
                continue;
            };
            counter.hits = counter.hits.saturating_add(line.cost);
            counter.limit_seen = counter.limit_seen.max(line.limit);
            counter.seen = request.now;
            counter.gap = at.saturating_duration_since(counter.seen_at);
            counter.back |= counter.gap >= self.shared.settings.idle;
            counter.seen_at = at;
            if counter.units > 0 && counter.ended(request.now) {
                // The period is over: its block is dropped.
                counter.units = 0;
                counter.block_since = None;
                counter.taken_at = None;
                if counter.mark.leave(request.now, margin) {
                    unmarked.push((line.key.clone(), counter.generation));
                }
            }
            let fresh = counter
                .block_since
                .is_some_and(|since| at.saturating_duration_since(since) < lease_time);
            let over = line.limit < counter.block_limit;
            if counter.units > 0 && (!fresh || over) {
                stale_first |= over;
                // Past its lease time, or taken under a higher limit than
                // this request's: given back beside the charge (see `send`),
                // which is sent again if the store refused it before the
                // units were back. (Units taken under a higher limit, spent
                // here, could pass the lower one with other instances'.)
                stale.push(GiveBack::all_of(
                    &self.shared,
                    counter,
                    line.key.clone(),
                    request.now,
                ));
                if counter.mark.leave(request.now, margin) {
                    unmarked.push((line.key.clone(), counter.generation));
                }
            }
            // A line of nothing is answered here only while this instance
            // holds a fresh block of its counter: its view of the counter is
            // then no older than the lease time (a counter passed its limit
            // elsewhere, or a first-use period over, is the store's to tell).
            to_store |= line.cost == 0 && !(fresh && counter.units > 0);
            // Only as far as what was served leaves room under this
            // request's limit (a caller's plan may change while a block is
            // held).
            let room = super::has_room(counter.usage().used, line.cost, line.limit);
            let units = if room {
                counter.units.min(line.cost)
            } else {
                0
            };
            to_store |= !room;
            let counted_at = counter.taken_at.filter(|_| units > 0);
            counted.push(counted_at);
            counted_on.push(counter.first_call.filter(|_| units > 0));
            counter.units -= units;
            taken.push(units);
            // A request of one line, paid from the block, is answered
            // without looking its counter up again.
            if request.lines.len() == 1 && room && units == line.cost && counter.units > 0 {
                alone = Some(Usage {
                    counted_at,
                    ..counter.usage_under(line.limit)
                });
            }
        }
        if let Some(usage) = alone.filter(|_| stale.is_empty() && unmarked.is_empty()) {
            if first {
                crate::metrics::lease_local();
            }
            return Ok(ChargeOutcome {
                admitted: true,
                usage: smallvec::smallvec![usage],
            });
        }
        let local = !request.lines.is_empty()
            && !to_store
            && stale.is_empty()
            && unmarked.is_empty()
            && request
                .lines
                .iter()
                .zip(&taken)
                .all(|(line, &units)| units == line.cost);
        if local {
            let mut ran_out = SmallVec::<[&ChargeLine; 1]>::new();
            let usage = request
                .lines
                .iter()
                .zip(&taken)
                .zip(&counted)
                .map(|((line, &units), &counted_at)| {
                    let counter = counters.get_mut(&line.key).expect("a block was spent");
                    if counter.units == 0 {
                        counter.block_since = None;
                        counter.taken_at = None;
                        if units > 0 {
                            ran_out.push(line);
                        }
                    }
                    Usage {
                        counted_at,
                        ..counter.usage_under(line.limit)
                    }
                })
                .collect();
            for line in ran_out {
                self.take_next_block(&mut counters, line, request.now, at);
            }
            if first {
                crate::metrics::lease_local();
            }
            return Ok(ChargeOutcome {
                admitted: true,
                usage,
            });
        }
        // Units set aside while the store is asked: a shutdown waits for
        // them (see `shutdown`); once one began, they stay in their blocks
        // and the store is asked for all of it. (Counted before `closed` is
        // read, as `shutdown` sets it before it reads the count: one of the
        // two sees the other.)
        if taken.iter().any(|&units| units > 0) {
            self.shared.setting_aside.fetch_add(1, Ordering::SeqCst);
            if self.shared.closed.load(Ordering::SeqCst) {
                self.shared.setting_aside.fetch_sub(1, Ordering::SeqCst);
                for (line, units) in request.lines.iter().zip(taken.iter_mut()) {
                    if let Some(counter) = counters.get_mut(&line.key) {
                        counter.units += *units;
                    }
                    *units = 0;
                }
            }
        }
        let runtime = tokio::runtime::Handle::try_current().is_ok();
        let mut reserved = Vec::new();
        let mut blocks = Vec::with_capacity(request.lines.len());
        let mut known = Vec::with_capacity(request.lines.len());
        let mut joins = SmallVec::with_capacity(request.lines.len());
        for (line, &units) in request.lines.iter().zip(&taken) {
            let block = if units < line.cost {
                self.block_for(&mut counters, line, request.now, at, runtime)
            } else {
                0
            };
            blocks.push(block);
            let mut counter = counters.get_mut(&line.key);
            // A charge that takes a block joins the counter's lease mark in
            // the same call, unless the mark counts this instance already.
            let join = block > 0
                && line.key.lease_mark().is_some()
                && counter
                    .as_mut()
                    .is_some_and(|counter| counter.mark.join(request.now));
            joins.push(join);
            known.push(counter.as_ref().map(|c| Known {
                generation: c.generation,
                in_mark: c.mark.may_count(request.now),
            }));
            if units > 0 {
                let counter = counter.expect("a block was spent");
                // Kept while the store is asked, however long that takes.
                counter.reserved += units;
                reserved.push(Aside {
                    key: line.key.clone(),
                    units,
                    generation: counter.generation,
                    limit: counter.block_limit,
                    first_call: counter.first_call,
                    block_since: counter.block_since,
                    taken_at: counter.taken_at,
                });
            }
        }
        // Boxed: the store is asked next, and the plan waits for it.
        Err(Box::new(Plan {
            blocks,
            joins,
            known,
            taken,
            counted,
            counted_on,
            stale,
            stale_first,
            unmarked,
            reserved: Reserved::new(&self.shared, reserved),
        }))
    }

    /// The block of the counter at `line`'s key ran out with a request at
    /// `now` (`at`): its next block is to be taken after [`PREFETCH_DELAY`]
    /// without waiting for the subject's next request (unless that request
    /// comes first, and takes it), together with those of the subjects
    /// whose blocks run out meanwhile.
    fn take_next_block(
        &self,
        counters: &mut Counters<'_>,
        line: &ChargeLine,
        now: Timestamp,
        at: Instant,
    ) {
        // A charge made for no request must not open a first-use period:
        // one would if the store's counter is gone (reset elsewhere).
        if matches!(line.lifetime, Lifetime::FirstUse { .. }) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Some(counter) = counters.get_mut(&line.key) else {
            return;
        };
        if counter.taking || counter.prefetching {
            return;
        }
        counter.prefetching = true;
        let generation = counter.generation;
        let line = ChargeLine {
            cost: 0,
            ..line.clone()
        };
        let first = {
            let mut queue = self
                .shared
                .prefetch
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            queue.push(Prefetch {
                line,
                now,
                at,
                generation,
            });
            queue.len() == 1
        };
        if first {
            let store = self.clone();
            let queued = Queued(Some(Arc::clone(&self.shared)));
            runtime.spawn(async move {
                tokio::time::sleep(PREFETCH_DELAY).await;
                // Counted before `prefetched` reads whether the store shut
                // down: a shutdown either waits for this, or is seen.
                let busy = Busy::new(&store.shared);
                let taken = queued.take();
                // Each in a task of its own, so the store sees them at
                // once and can send them together.
                for prefetch in taken {
                    if let Some(charge) = store.prefetched(prefetch) {
                        let busy = Busy::new(&store.shared);
                        tokio::spawn(async move {
                            let _busy = busy;
                            // The subject's next request goes to the store.
                            if let Err(error) = charge.await {
                                tracing::debug!(
                                    error = crate::key::scrubbed(&error.to_string()),
                                    "a busy subject's next block was not taken"
                                );
                            }
                        });
                    }
                }
                drop(busy);
            });
        }
    }

    /// The charge that takes the next block of `prefetch`'s counter, unless
    /// none is to be taken: a request took it first, the counter was reset
    /// or its period ended, the store shut down, or its subject is not busy
    /// enough for a block.
    fn prefetched(&self, prefetch: Prefetch) -> Option<RemoteCharge> {
        let Prefetch {
            line,
            now,
            at: then,
            generation,
        } = prefetch;
        let at = Instant::now();
        let now = now
            .saturating_add(span(at.saturating_duration_since(then)))
            .unwrap_or(now);
        let request = ChargeRequest {
            charged_at: None,
            now,
            lines: smallvec::smallvec![line],
        };
        let key = &request.lines[0].key;
        let mut counters = self.shared.counter(key);
        // Gone: forgotten, with the store shut down.
        let counter = counters.get_mut(key)?;
        // A reset since made a new entry, whose flag is its own.
        if counter.generation != generation
            || !std::mem::take(&mut counter.prefetching)
            || counter.units > 0
            || self.shared.closed.load(Ordering::SeqCst)
            || super::past_its_period(&request).is_some()
        {
            return None;
        }
        let block = self.block_for(&mut counters, &request.lines[0], now, at, true);
        if block == 0 {
            return None;
        }
        let counter = counters.get_mut(key).expect("looked up above");
        // The charge that takes a block joins the counter's lease mark, as
        // in `spend_locally`.
        let join = key.lease_mark().is_some() && counter.mark.join(now);
        let known = Known {
            generation,
            in_mark: counter.mark.may_count(now),
        };
        drop(counters);
        let plan = Plan {
            blocks: vec![block],
            joins: smallvec::smallvec![join],
            known: vec![Some(known)],
            unmarked: Vec::new(),
            taken: smallvec::smallvec![0],
            counted: smallvec::smallvec![None],
            counted_on: smallvec::smallvec![None],
            stale: Vec::new(),
            stale_first: false,
            reserved: Reserved::new(&self.shared, Vec::new()),
        };
        Some(self.send(request, plan, at, false))
    }

    /// Spends `request` from this instance's blocks, or sends it to the
    /// store: the charge sent, which runs when polled. (Copied only when it
    /// is sent.)
    fn start(&self, request: Cow<'_, ChargeRequest>) -> Result<ChargeOutcome, RemoteCharge> {
        self.start_with(request, true)
    }

    /// As [`start`](Self::start); a refusal waits for a block on its way
    /// here only if `wait`.
    fn start_with(
        &self,
        request: Cow<'_, ChargeRequest>,
        wait: bool,
    ) -> Result<ChargeOutcome, RemoteCharge> {
        // Never spent from a block either: a first-use key names every
        // period of its subject, and a block of the live one may be held.
        if let Some(error) = super::past_its_period(&request) {
            return Err(Box::pin(std::future::ready(Err(error))));
        }
        let at = Instant::now();
        // Sent again (`!wait`) once the store refused it: it asked the
        // store, and is no local charge if a block answers it now.
        self.spend_locally(&request, at, wait)
            .map_err(|plan| self.send(request.into_owned(), *plan, at, wait))
    }

    /// The charge of `request` through the store, as `plan` says.
    fn send(
        &self,
        mut request: ChargeRequest,
        plan: Plan,
        at: Instant,
        wait: bool,
    ) -> RemoteCharge {
        let Plan {
            blocks,
            joins,
            known,
            taken,
            counted,
            counted_on,
            stale,
            stale_first,
            unmarked,
            mut reserved,
        } = plan;
        let joining = Joining {
            shared: Arc::clone(&self.shared),
            lines: request
                .lines
                .iter()
                .zip(&joins)
                .zip(&known)
                .filter(|((_, join), _)| **join)
                .filter_map(|((line, _), known)| {
                    Some((line.key.clone(), known.as_ref()?.generation))
                })
                .collect(),
            unsure: request
                .now
                .saturating_add(self.shared.settings.lease())
                .unwrap_or(request.now),
        };
        let taking = Taking {
            shared: Arc::clone(&self.shared),
            keys: request
                .lines
                .iter()
                .zip(&blocks)
                .filter(|(_, block)| **block > 0)
                .map(|(line, _)| line.key.clone())
                .collect(),
        };
        // What the blocks here pay is not charged again.
        for (line, units) in request.lines.iter_mut().zip(&taken) {
            line.cost -= units;
        }
        // A line paid whole from a block here is not the store's to refuse:
        // its units were charged when the block was taken, and the store's
        // count, which holds them, may be past the limit (a deferred cost
        // or a debt added since) while what was served is not. Sent with
        // the most the store counts as its limit; its own limit told again
        // in the answer.
        let paid: SmallVec<[Option<u64>; 2]> = request
            .lines
            .iter()
            .zip(&taken)
            .map(|(line, &units)| (units > 0 && line.cost == 0).then_some(line.limit))
            .collect();
        let max = self.inner.max_count();
        for (line, paid) in request.lines.iter_mut().zip(&paid) {
            if paid.is_some() {
                line.limit = max;
            }
        }
        // Leaving a mark is nothing to wait for.
        self.spawn_leaves(request.now, unmarked);
        // Each line's counter's lease mark, read with the charge.
        let marks: Vec<Option<PeriodKey>> =
            request.lines.iter().map(|l| l.key.lease_mark()).collect();
        // Blocks past their lease time go back beside the charge, in a task
        // of their own: a request dropped meanwhile does not cut them short,
        // and the charge does not wait for them (it is sent again once they
        // landed, if the store refused it), unless one was taken under a
        // higher limit than the request's (`stale_first`): the store would
        // count its units against the lower one.
        //
        // Beside the charge, they are sent once the store answered it (or
        // it failed, or was dropped): the answer then counts their units
        // for sure, which the usage told is taken off (`beside`), as this
        // instance's unused units are. Sent at the same time, the store
        // could apply either first, and a count that includes them would
        // be told to the client as spent (and kept as the store's count
        // until its next answer).
        let mut beside: SmallVec<[(PeriodKey, u64, Left); 1]> = SmallVec::new();
        let mut release = None;
        let (mut stale, mut giving_back) = match tokio::runtime::Handle::try_current() {
            Ok(runtime) if !stale.is_empty() => {
                let inner = self.inner.clone();
                let busy = Busy::new(&self.shared);
                let gate = if stale_first {
                    None
                } else {
                    beside = stale
                        .iter()
                        .filter_map(|back| Some((back.key.clone(), back.units, back.left?)))
                        .collect();
                    let (answered, gate) = tokio::sync::oneshot::channel::<()>();
                    release = Some(answered);
                    Some(gate)
                };
                let task = runtime.spawn(async move {
                    if let Some(gate) = gate {
                        let _ = gate.await;
                    }
                    for back in stale {
                        back.send(&inner, &busy.shared).await;
                    }
                });
                (Vec::new(), Some(task))
            }
            _ => (stale, None),
        };
        let store = self.clone();
        Box::pin(async move {
            // Without a runtime, before the charge, as they must land first.
            for back in stale.drain(..) {
                back.send(&store.inner, &store.shared).await;
            }
            if stale_first {
                if let Some(giving_back) = giving_back.take() {
                    let _ = giving_back.await;
                }
            }
            let costs: Vec<u64> = request.lines.iter().map(|line| line.cost).collect();
            // A request's blocks are taken with it as far as they fit
            // ([`Store::charge_taking`]): one call, which refuses only a
            // request that has no room itself. A charge that costs nothing
            // beyond its blocks (the next block of a busy subject) takes
            // them whole or not at all, as a plain charge the store may
            // send with others'.
            let with_request = blocks.iter().any(|&b| b > 0) && costs.iter().any(|&cost| cost > 0);
            if !with_request {
                for (line, block) in request.lines.iter_mut().zip(&blocks) {
                    line.cost = line.cost.saturating_add(*block);
                }
            }
            let inner = &store.inner;
            let charge = |joins: &[bool]| {
                let sent = store.reading(&marks, joins, &request);
                let blocks: SmallVec<[u64; 2]> = blocks.iter().copied().collect();
                async move {
                    if with_request {
                        return inner.charge_taking(sent, blocks).await;
                    }
                    let outcome = inner.charge(sent).await?;
                    let taken = if outcome.admitted {
                        blocks
                    } else {
                        smallvec::smallvec![0; blocks.len()]
                    };
                    Ok((outcome, taken))
                }
            };
            let tried = joins.clone();
            let mut joins = joins;
            // Numbered as it goes to the store, not as it was planned: one
            // that waited first (for an old block's give-back) goes after
            // charges planned later, and its answer, of the counter made
            // since a reset elsewhere meanwhile, is the live counter's, not
            // an older one's whose block would be dropped (and stay
            // charged, nothing holding it, until the period ends).
            let mut sent = store.shared.next_sent();
            let (mut outcome, taken_here) = match charge(&joins).await {
                // No room for a new mark (a memory store at its bound): the
                // charge again, without joining.
                Err(error) if error.kind() == StoreErrorKind::Full && joins.contains(&true) => {
                    joins.iter_mut().for_each(|j| *j = false);
                    sent = store.shared.next_sent();
                    charge(&joins).await?
                }
                answer => answer?,
            };
            // The old blocks' units beside the charge: counted in this
            // answer (of the counter they were taken from), on their way
            // back from now on.
            for (line, usage) in request.lines.iter().zip(outcome.usage.iter_mut()) {
                for (key, units, left) in &beside {
                    if line.key == *key && same_counter(left.first_call, left.resets_at, usage) {
                        usage.used = usage.used.saturating_sub(*units);
                    }
                }
            }
            drop(release.take());
            // What the store gave of each block: never more than asked, and
            // nothing with a refusal, whatever a store of one's own answers
            // (units counted as held here that the store never charged
            // would be admitted past the limit).
            let planned = blocks;
            let mut blocks: Vec<u64> = planned
                .iter()
                .enumerate()
                .map(|(i, &asked)| {
                    let taken = taken_here.get(i).copied().unwrap_or(0);
                    if outcome.admitted {
                        taken.min(asked)
                    } else {
                        0
                    }
                })
                .collect();
            // A charge that costs nothing beyond its blocks (the next block
            // of a busy subject) has no request to send alone.
            let refused = !outcome.admitted && costs.iter().any(|&cost| cost > 0);
            // Refused while the old blocks' units were not back yet: the
            // request again, once they are. (A request refused with its
            // blocks had no room itself: the blocks never refuse it.)
            let mut again = refused && giving_back.is_some();
            // What a refusal waits for (units on their way back, then a
            // block on its way here) it waits for this long in all, and
            // once: not again when the request is sent again.
            let deadline = Instant::now() + RETURN_WAIT;
            if refused {
                if let Some(giving_back) = giving_back {
                    let _ = giving_back.await;
                }
                // Units on their way back from here (an idle block, an old
                // one, another request's) of the counters without room,
                // which the store still counted: likewise, if they landed.
                let full: SmallVec<[&PeriodKey; 2]> = request
                    .lines
                    .iter()
                    .zip(&costs)
                    .zip(&outcome.usage)
                    .filter(|((_, &cost), usage)| !super::has_room(usage.used, cost, usage.limit))
                    .map(|((line, _), _)| &line.key)
                    .collect();
                again |= wait && store.shared.wait_for_returns(&full, deadline).await;
            }
            if again {
                for (line, cost) in request.lines.iter_mut().zip(&costs) {
                    line.cost = *cost;
                }
                blocks.iter_mut().for_each(|b| *b = 0);
                joins.iter_mut().for_each(|j| *j = false);
                sent = store.shared.next_sent();
                outcome = store
                    .inner
                    .charge(store.reading(&marks, &joins, &request))
                    .await?;
            }
            // The lines without room, if refused.
            let full: SmallVec<[bool; 2]> = request
                .lines
                .iter()
                .zip(&outcome.usage)
                .map(|(line, usage)| {
                    !outcome.admitted && !super::has_room(usage.used, line.cost, usage.limit)
                })
                .collect();
            let marks = split_marks(&marks, &mut outcome);
            drop(taking);
            // Per line that tried to join: the end of the mark it joined,
            // if the joining went with the charge (`None`: it did not).
            let joined: SmallVec<[Option<Option<Timestamp>>; 2]> = tried
                .iter()
                .zip(&joins)
                .zip(&marks)
                .map(|((&tried, &join), mark)| {
                    tried.then(|| {
                        let until = mark.as_ref().map(|mark| mark.resets_at);
                        until.filter(|_| join && outcome.admitted)
                    })
                })
                .collect();
            joining.landed();
            if outcome.admitted {
                reserved.spent = true;
            }
            // Restored before the usage is read, if the store refused.
            drop(reserved);
            // The lines paid from a block here, with their own limits again.
            for ((line, usage), paid) in request
                .lines
                .iter_mut()
                .zip(outcome.usage.iter_mut())
                .zip(&paid)
            {
                if let Some(limit) = *paid {
                    line.limit = limit;
                    usage.limit = limit;
                }
            }
            let mut outcome = store.learn(
                &request, &planned, &blocks, &joined, &known, &marks, outcome, at, sent,
            );
            if outcome.admitted {
                // A line paid from a block here was counted when the block
                // was taken, on the counter it was taken from: its
                // give-back goes by then (part of it paid by the store
                // too, the earlier instant: never to a counter made since,
                // at the cost of that part's give-back, refused by one).
                for ((usage, counted_at), on) in
                    outcome.usage.iter_mut().zip(&counted).zip(&counted_on)
                {
                    if counted_at.is_some() {
                        usage.counted_at = *counted_at;
                        // And on the counter the block was taken from,
                        // whatever counter the answer tells of since (one
                        // made anew after a reset elsewhere, whose first
                        // call a clock behind may date before the block's
                        // take): the give-back goes to that counter alone.
                        if on.is_some() {
                            usage.first_call = *on;
                        }
                    }
                }
            }
            if !refused || outcome.admitted || !wait {
                return Ok(outcome);
            }
            // Refused while a block of its counters was on its way here
            // (taken by another request's charge), which the store counted:
            // the request again, from the block, once it landed.
            for (line, (&cost, &units)) in request.lines.iter_mut().zip(costs.iter().zip(&taken)) {
                line.cost = cost + units;
            }
            if !store
                .shared
                .wait_for_blocks(&request.lines, &full, deadline)
                .await
            {
                return Ok(outcome);
            }
            match store.start_with(Cow::Owned(request), false) {
                Ok(outcome) => Ok(outcome),
                Err(remote) => remote.await,
            }
        })
    }

    /// `request` as sent to the store: its lines, then the lease `marks`
    /// of their counters, read with lines that cost nothing (which never
    /// make a counter, nor refuse), or joined (one holder more, never
    /// refused) for the lines of `joins`.
    fn reading(
        &self,
        marks: &[Option<PeriodKey>],
        joins: &[bool],
        request: &ChargeRequest,
    ) -> ChargeRequest {
        let deadline = request
            .now
            .saturating_add(self.shared.settings.lease())
            .unwrap_or(request.now);
        let max = self.inner.max_count();
        let mut sent = request.clone();
        sent.lines
            .extend(marks.iter().zip(joins).filter_map(|(mark, &join)| {
                let mark = mark.as_ref()?;
                Some(mark_line(mark.clone(), u64::from(join), deadline, max))
            }));
        sent
    }

    /// Leaves the lease marks of `unmarked` (key, entry generation) in a
    /// task of its own.
    fn spawn_leaves(&self, now: Timestamp, unmarked: Vec<(PeriodKey, u64)>) {
        if unmarked.is_empty() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let inner = self.inner.clone();
                let shared = Arc::clone(&self.shared);
                runtime.spawn(async move {
                    for (key, generation) in unmarked {
                        leave(&inner, &shared, now, key, generation).await;
                    }
                });
            }
            // No runtime, no leaving: the mark ends on its own.
            Err(_) => {
                let mut counters = self.shared.counters(unmarked.iter().map(|(key, _)| key));
                for (key, generation) in &unmarked {
                    if let Some(counter) = counters
                        .get_mut(key)
                        .filter(|c| c.generation == *generation)
                    {
                        // Nor joining again, for the same reason.
                        counter.mark.left(false, false);
                    }
                }
            }
        }
    }

    /// When the units other instances hold of a counter whose mark stood at
    /// `mark` are expected back, if any do; `counted`: whether the mark may
    /// count this instance.
    fn held_elsewhere(
        &self,
        mark: Option<&Usage>,
        counted: bool,
        now: Timestamp,
    ) -> Option<Timestamp> {
        let mark = mark?;
        let others = mark.used.saturating_sub(u64::from(counted));
        if others == 0 || mark.resets_at <= now {
            return None;
        }
        let idled = now
            .saturating_add(span(self.shared.settings.idle))
            .unwrap_or(mark.resets_at);
        Some(idled.min(mark.resets_at))
    }

    /// Records what the store answered to `request` (whose lines took
    /// `blocks` beyond their costs, of the `planned`; their counters' lease
    /// marks stood at `seen`, read for a refusal), and the outcome as the
    /// layer sees it.
    #[allow(clippy::too_many_arguments)]
    fn learn(
        &self,
        request: &ChargeRequest,
        planned: &[u64],
        blocks: &[u64],
        joined: &[Option<Option<Timestamp>>],
        known: &[Option<Known>],
        seen: &[Option<Usage>],
        mut outcome: ChargeOutcome,
        at: Instant,
        sent: u64,
    ) -> ChargeOutcome {
        // Before the shards' guards: a give-back dropped locks its shard.
        let mut back = Vec::new();
        let mut counters = self
            .shared
            .counters(request.lines.iter().map(|line| &line.key));
        let room = self.shared.entries.load(Ordering::Relaxed) < self.shared.settings.max_counters;
        let closed = self.shared.closed.load(Ordering::SeqCst);
        let now = request.now;
        let mut sweep = false;
        let margin = self.shared.settings.mark_margin();
        let lease = self.shared.settings.lease();
        let mut unmarked = Vec::new();
        let mut joins = Vec::new();
        for (i, (line, usage)) in request.lines.iter().zip(&mut outcome.usage).enumerate() {
            let (mut block, mark, known) = (blocks[i], seen[i].as_ref(), known[i]);
            // Units of a block cut short that go straight back.
            let mut cut = 0;
            if outcome.admitted && block > 0 && block < planned.get(i).copied().unwrap_or(0) {
                // The store gave less than planned: all it had left (other
                // instances spent meanwhile). Kept as a planned block is
                // sized, a quarter of that; the rest straight back (below,
                // counted by the entry while on its way, as a refusal here
                // waits for it), so that near the limit blocks stay small,
                // and other instances are not refused for units this one
                // holds.
                let keep = block / 4;
                cut = block - keep;
                usage.used = usage.used.saturating_sub(cut);
                block = keep;
            }
            if outcome.admitted && block > 0 {
                // Taken from the store, whatever becomes of it here: kept,
                // or given straight back (the store shut down, the entry
                // was reset or is gone, the counter is another), whose
                // units then count as returned.
                crate::metrics::lease_block();
            }
            // Units of this charge's block go back only to a counter made
            // by then.
            let made_by = usage.made_by(now);
            // A mark joined for an entry that is gone, or was made anew
            // meanwhile (a shutdown, a reset here): left at once.
            let joined_for = |counter: Option<&Counter>| match (joined[i], known) {
                (Some(Some(_)), Some(known))
                    if counter.is_none_or(|c| c.generation != known.generation) =>
                {
                    Some((line.key.clone(), known.generation))
                }
                _ => None,
            };
            let counter = match counters.get_mut(&line.key) {
                Some(counter) => counter,
                // Nothing new is tracked once the store shut down.
                None if room && line.cost > 0 && !closed => {
                    sweep = true;
                    counters.get_or_insert_with(&line.key, || Counter {
                        units: 0,
                        block_since: None,
                        taken_at: None,
                        block_limit: line.limit,
                        limit_seen: line.limit,
                        limit: usage.limit,
                        store_used: usage.used,
                        resets_at: usage.resets_at,
                        first_call: usage.first_call,
                        seen: request.now,
                        seen_at: at,
                        gap: Duration::MAX,
                        back: false,
                        generation: self.shared.next_generation(),
                        hits: 0,
                        charged_at: at,
                        charged_now: request.now,
                        learned: sent,
                        block: 0,
                        taking: false,
                        prefetching: false,
                        reserved: 0,
                        mark: Mark::default(),
                        returning: 0,
                        told: 0,
                        told_sent: 0,
                    })
                }
                None => {
                    if cut > 0 {
                        back.push(GiveBack::untracked(line.key.clone(), now, cut, made_by));
                    }
                    if outcome.admitted && block > 0 {
                        // Taken while the store shut down, its entry gone
                        // with the others, or for an entry gone meanwhile
                        // (forgotten once idle) or never made (no room for
                        // it): straight back.
                        back.push(GiveBack::untracked(
                            line.key.clone(),
                            request.now,
                            block,
                            made_by,
                        ));
                        usage.used = usage.used.saturating_sub(block);
                    }
                    unmarked.extend(joined_for(None));
                    if !outcome.admitted {
                        let counted = known.is_some_and(|k| k.in_mark);
                        usage.held_elsewhere_until = self.held_elsewhere(mark, counted, now);
                    }
                    continue;
                }
            };
            unmarked.extend(joined_for(Some(counter)));
            if cut > 0 {
                back.push(GiveBack::tracked(
                    &self.shared,
                    counter,
                    line.key.clone(),
                    now,
                    cut,
                    made_by,
                ));
            }
            // (A request with no entry here when it was sent.)
            counter.limit_seen = counter.limit_seen.max(line.limit);
            // Units of a block taken here and given back at once.
            let mut returned = 0;
            // An answer to a charge sent before the last one this entry
            // learned from (several on their way, answered out of order)
            // tells less than the entry knows: an older count, which may
            // only raise the one known (units it took are counted in it,
            // or in the later one); or, of another counter, one gone (the
            // charge was sent before a reset made elsewhere, or before a
            // first-use period ended), which changes nothing of what the
            // entry knows of the live one. (By the order the charges were
            // sent, not by the counters' first calls: instances' clocks
            // may differ.)
            let fresh = sent >= counter.learned;
            let older = !fresh
                && match (counter.first_call, usage.first_call) {
                    (Some(known), Some(told)) => known != told,
                    // Undated (a store that does not tell first calls): by
                    // its reset, past the jitter of a first-use counter's,
                    // read from its remaining life.
                    _ => !same_reset(counter.resets_at, usage.resets_at),
                };
            if older {
                // The block it took is of another counter than the live one
                // this entry knows: most likely one gone (reset elsewhere,
                // or a first-use period that ended), its units gone with
                // it. Unless the store applied this charge after the later
                // one (across that reset or period's end): then it is the
                // live counter's, which nobody here holds. Either way it
                // goes back to that counter by its first call, exactly: it
                // lands there if the counter lives, and nowhere otherwise.
                // (A store that tells no first call: dropped.)
                if let (true, Some(first_call)) = (outcome.admitted && block > 0, usage.first_call)
                {
                    back.push(GiveBack::untracked(
                        line.key.clone(),
                        now,
                        block,
                        first_call,
                    ));
                }
                block = 0;
            } else if known.is_some_and(|k| k.generation != counter.generation) {
                // Reset here while the charge was on its way: the block it
                // took is not this entry's. Given back to the counter it
                // was charged to, if that one was made by the charge (it
                // landed after the reset deleted the counter); a counter
                // made since, or none (it landed before), takes nothing.
                if outcome.admitted && block > 0 {
                    back.push(GiveBack::tracked(
                        &self.shared,
                        counter,
                        line.key.clone(),
                        request.now,
                        block,
                        made_by,
                    ));
                    returned = block;
                }
                block = 0;
            }
            let same_entry = known.is_some_and(|k| k.generation == counter.generation);
            if let Some(landed) = joined[i].filter(|_| same_entry) {
                // The joining sent with the charge landed, or did not (a
                // reset here meanwhile made the entry anew, which the
                // store's mark may count, until the old entry's part ends).
                if counter.mark.joined(Ok(landed)) {
                    unmarked.push((line.key.clone(), counter.generation));
                }
            }
            // Whether the mark read may count this instance: as things
            // stood when the charge was sent, or stand now.
            let counted = known.is_some_and(|k| k.in_mark) || counter.mark.may_count(now);
            if older {
                // Nothing of the live counter.
            } else if fresh {
                if !counter.same_period(usage) && counter.units > 0 {
                    // Another counter (a first-use period that ended and
                    // opened again, or one made anew after a reset
                    // elsewhere), or none (the store applied this charge
                    // before an earlier one that made the counter, which
                    // lives): the old block goes back to the counter it was
                    // taken from, by its first call exactly, which finds
                    // nothing if that counter is gone (never one made since).
                    if let Some(taken_at) = counter.taken_at {
                        let units = counter.units;
                        back.push(GiveBack::untracked(line.key.clone(), now, units, taken_at));
                    }
                    counter.units = 0;
                    counter.block_since = None;
                    counter.taken_at = None;
                }
                counter.limit = usage.limit;
                counter.store_used = if sent >= counter.told_sent {
                    usage.used.saturating_sub(returned)
                } else {
                    counter.store_used.max(usage.used.saturating_sub(returned))
                };
                counter.resets_at = usage.resets_at;
                counter.first_call = usage.first_call;
            } else {
                counter.store_used = counter.store_used.max(usage.used.saturating_sub(returned));
                // An entry made from an answer that told of no counter (a
                // refusal before any charge) learns its making from the
                // first answer of the same period that tells it.
                if counter.first_call.is_none() && same_reset(counter.resets_at, usage.resets_at) {
                    counter.first_call = usage.first_call;
                }
            }
            if fresh {
                counter.learned = sent;
                counter.charged_at = at;
                counter.charged_now = now;
                counter.hits = 0;
            }
            // (`seen` and `seen_at` are the last request's, set as it came:
            // an answer landing after later requests does not move them
            // back.)
            let took = outcome.admitted && block > 0;
            if took && closed {
                // Taken while the store shut down: straight back, and out of
                // the mark it joined.
                counter.store_used = counter.store_used.saturating_sub(block);
                back.push(GiveBack::tracked(
                    &self.shared,
                    counter,
                    line.key.clone(),
                    request.now,
                    block,
                    made_by,
                ));
                if counter.mark.leave(now, margin) {
                    unmarked.push((line.key.clone(), counter.generation));
                }
            } else if took {
                if counter.units == 0 {
                    // A block of its own, whatever an emptied one left
                    // (units set aside for a request on its way, which go
                    // back only into a block of the same counter).
                    counter.block_limit = line.limit;
                    counter.block_since = Some(at);
                    counter.taken_at = Some(made_by);
                } else {
                    counter.block_limit = counter.block_limit.max(line.limit);
                    counter.block_since.get_or_insert(at);
                    counter.taken_at.get_or_insert(made_by);
                }
                counter.units += block;
                counter.block = block;
                counter.back = false;
                // A holder now. The charge joined the mark already, unless
                // it could not (no room for a new mark in the store): then
                // it joins in a call of its own, after the charge. A key
                // that names no mark has none to join.
                if line.key.lease_mark().is_some() && counter.mark.join(now) {
                    joins.push((line.key.clone(), counter.generation));
                }
            }
            // Holding nothing any more (the block was spent, and no new one
            // is on its way): this instance leaves the mark.
            let holding = counter.units > 0 || counter.reserved > 0 || counter.taking;
            if !took && !holding && counter.mark.leave(now, margin) {
                unmarked.push((line.key.clone(), counter.generation));
            }
            let told = *usage;
            *usage = counter.usage();
            // The counter charged is the one the store's answer tells of:
            // a give-back of the request goes by its making.
            usage.first_call = usage.first_call.or(told.first_call);
            if older {
                // Of the counter gone: what the request was charged on, so
                // that its refund or its deferred cost, guarded by the
                // counter's making, never lands in the live one.
                usage.first_call = told.first_call;
                usage.resets_at = told.resets_at;
            }
            if !outcome.admitted {
                usage.held_elsewhere_until = self.held_elsewhere(mark, counted, now);
            }
        }
        drop(counters);
        if sweep {
            self.start_sweeping();
        }
        self.spawn_leaves(now, unmarked);
        if back.is_empty() && joins.is_empty() {
            return outcome;
        }
        // Blocks are taken only on a runtime (see `block_for`).
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let inner = self.inner.clone();
            let shared = Arc::clone(&self.shared);
            let max = self.inner.max_count();
            let busy = Busy::new(&self.shared);
            runtime.spawn(async move {
                let _busy = busy;
                for back in back {
                    back.send(&inner, &shared).await;
                }
                for (key, generation) in joins {
                    join(&inner, &shared, now, key, generation, lease, max).await;
                }
            });
        }
        outcome
    }

    /// Makes `counter` a new entry, of a counter reset at `now`: no block,
    /// nothing reserved, a generation of its own. The store's lease mark
    /// may count this instance until the old entry's part in it ends or is
    /// left: the time and generation to leave it with, if it is to be left.
    fn renew(&self, counter: &mut Counter, now: Timestamp) -> Option<(Timestamp, u64)> {
        let margin = self.shared.settings.mark_margin();
        let lease = self.shared.settings.lease();
        let old = counter.generation;
        let leave = counter.mark.leave(now, margin);
        let mark = counter.mark;
        let on_its_way = (mark.joining || mark.leaving)
            .then(|| now.saturating_add(lease).ok())
            .flatten();
        let unsure = [mark.counted_until, mark.unsure_until, on_its_way]
            .into_iter()
            .flatten()
            .max();
        counter.generation = self.shared.next_generation();
        counter.units = 0;
        counter.block_since = None;
        counter.taken_at = None;
        counter.block = 0;
        counter.prefetching = false;
        counter.hits = 0;
        counter.reserved = 0;
        counter.store_used = 0;
        counter.mark = Mark {
            unsure_until: unsure,
            ..Mark::default()
        };
        leave.then_some((now, old))
    }

    /// What the store told a refund, an add or a settle on `key` (the count after,
    /// this instance's units included), recorded and answered with this
    /// instance's unused units counted as not spent.
    /// An answer to a call sent before the last charge, refund, add or
    /// settle whose answer the entry took in (`sent`, numbered as charges
    /// are) tells an older count, which may only raise the one known: the
    /// later answer counts what this call changed, or the call landed
    /// after it.
    fn told(&self, key: &PeriodKey, result: Option<u64>, sent: u64) -> Option<u64> {
        let used = result?;
        match self.shared.counter(key).get_mut(key) {
            Some(counter) => {
                if sent >= counter.learned && sent >= counter.told_sent {
                    counter.store_used = used;
                    counter.told_sent = sent;
                } else {
                    counter.store_used = counter.store_used.max(used);
                }
                counter.told = counter.told.wrapping_add(1);
                Some(used.saturating_sub(counter.units))
            }
            None => Some(used),
        }
    }

    /// A refund (guarded by `made` in the store). A give-back at the
    /// counter's first call (what the layer gives back of a request this
    /// instance served, at most what it charged) goes into this instance's
    /// block of `key` when it holds one. Any other (a support refund, of
    /// units any instance may have spent) goes to the store: this
    /// instance's view of the count is as old as its last answer, and
    /// crediting its block from it would give back units others gave back
    /// already, or fewer than asked; and the store learns from it that no
    /// give-back closes the counter's period.
    async fn refund_to(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made: Made,
    ) -> Result<Option<u64>, StoreError> {
        let mut amount = amount;
        // What went into the block, of which entry: taken back if the store
        // never gets the rest, so that the refund is sent again whole.
        let mut in_block = None;
        if matches!(made, Made::At(_)) {
            let mut counters = self.shared.counter(&key);
            if let Some(counter) = counters.get_mut(&key) {
                // Into the block only when it is of the counter charged: not
                // of one made since (after a reset), which takes nothing.
                let same_counter = counter.first_call.is_none_or(|first| made.names(first));
                // Nor when a request was charged here under a higher limit
                // than the block was taken under (its caller's plan
                // changed): the units given back may be that request's,
                // which the block's limit left no room for; spent from the
                // block under it, they would pass it.
                let same_limit = counter.limit_seen <= counter.block_limit;
                if counter.units > 0 && !counter.ended(now) && same_counter && same_limit {
                    // As much as this instance last heard was spent, and
                    // never more than the block held when taken, units set
                    // aside for a request on its way included (a large
                    // deferred cost given back would otherwise grow it past
                    // its bound: units other instances wait for, and that
                    // stay charged if this instance dies); the rest goes to
                    // the store.
                    let room = counter.store_used.saturating_sub(counter.units).min(
                        counter
                            .block
                            .saturating_sub(counter.units.saturating_add(counter.reserved)),
                    );
                    let into_block = amount.min(room);
                    counter.units += into_block;
                    amount -= into_block;
                    if amount == 0 {
                        return Ok(Some(counter.usage().used));
                    }
                    in_block = Some((into_block, counter.generation)).filter(|(n, _)| *n > 0);
                }
            }
        }
        let sent = self.shared.next_sent();
        let result = made.refund(&self.inner, now, key.clone(), amount).await;
        match result {
            Ok(result) => Ok(self.told(&key, result, sent)),
            Err(error) if error.is_unsent() => Err(self.take_back(&key, in_block, error)),
            Err(error) => Err(error),
        }
    }

    /// An add of `amount` in the store, to the counter at `key` that `made`
    /// names, numbered among this instance's calls so that a later answer
    /// told first is not set back by it (see [`LeasedStore::told`]).
    async fn add_to(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made: Made,
    ) -> Result<Option<u64>, StoreError> {
        let sent = self.shared.next_sent();
        let result = made.add(&self.inner, now, key.clone(), amount).await?;
        Ok(self.told(&key, result, sent))
    }

    /// `error`, a refund's the store never sent, once what the refund put
    /// into the block of `key` (`in_block`: units, and the entry's
    /// generation) is taken back off it: the refund is then sent again
    /// whole, as if nothing of it was applied. Units spent from the block
    /// meanwhile cannot be taken back: the error then says the refund may
    /// have been applied in part, so that it is not sent again whole (the
    /// rest stays charged, rather than admissions go uncounted).
    fn take_back(
        &self,
        key: &PeriodKey,
        in_block: Option<(u64, u64)>,
        error: StoreError,
    ) -> StoreError {
        let Some((units, generation)) = in_block else {
            return error;
        };
        let mut counters = self.shared.counter(key);
        let taken = match counters.get_mut(key) {
            Some(counter) if counter.generation == generation && counter.units >= units => {
                counter.units -= units;
                true
            }
            _ => false,
        };
        if taken {
            return error;
        }
        StoreError::new(
            error.kind(),
            "a refund went in part into a leased block, whose units were spent since, and the \
             store never got the rest: not sent again",
        )
    }

    /// Starts the task that gives idle and old blocks back and forgets idle
    /// counters, once.
    fn start_sweeping(&self) {
        if self.shared.sweeping.load(Ordering::Acquire)
            || self.shared.sweeping.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.shared.sweeping.store(false, Ordering::Release);
            return;
        };
        let shared = Arc::downgrade(&self.shared);
        let inner = self.inner.clone();
        let settings = self.shared.settings;
        runtime.spawn(sweep(shared, inner, settings));
    }
}

/// The sweep, while its task lives.
struct Sweeping(Weak<Shared>);

impl Drop for Sweeping {
    fn drop(&mut self) {
        if let Some(shared) = self.0.upgrade() {
            shared.sweeping.store(false, Ordering::Release);
        }
    }
}

/// Gives `units` of `key` taken at `taken_at` back at `now`, then leaves
/// its lease mark if `leaving`: the units first, never a holder's units
/// charged with no holder marked. The units given back.
async fn return_one<St: Store>(
    inner: St,
    now: Timestamp,
    key: PeriodKey,
    units: u64,
    taken_at: Timestamp,
    leaving: bool,
    until: tokio::time::Instant,
) -> u64 {
    let back = units > 0 && {
        let block = GiveBack::untracked(key.clone(), now, units, taken_at);
        match block.try_send(&inner).await {
            Err(error) => block.resend(&inner, error, until).await,
            sent => sent,
        }
        .unwrap_or_else(|error| {
            stay_charged(&error, units);
            false
        })
    };
    if leaving {
        unmark(&inner, now, &key).await;
    }
    if back {
        units
    } else {
        0
    }
}

/// Give-backs a sweep has on their way at most.
const SWEEP_GIVE_BACKS: usize = 64;

/// Spawns `work` on `set` once fewer than [`SWEEP_GIVE_BACKS`] are on their
/// way there: what the one that ended to make room answered, if any.
async fn spawn_bounded<T: Send + 'static>(
    set: &mut tokio::task::JoinSet<T>,
    work: impl Future<Output = T> + Send + 'static,
) -> Option<T> {
    let ended = if set.len() >= SWEEP_GIVE_BACKS {
        set.join_next().await.and_then(Result::ok)
    } else {
        None
    };
    set.spawn(work);
    ended
}

/// Gives idle and old blocks back every quarter of the shorter bound, until
/// the store is dropped.
async fn sweep<St: Store>(shared: Weak<Shared>, inner: St, settings: Settings) {
    // Dropped with the task (its runtime stopped): the next charge starts a
    // sweep again, on its own runtime.
    let _sweeping = Sweeping(shared.clone());
    let tick = (settings.idle.min(settings.lease_time) / 4).max(Duration::from_millis(5));
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        // A shutdown waits for what this pass takes off the counters, until
        // it is given back.
        let busy = Busy::new(&shared);
        let at = Instant::now();
        let mut back = Vec::new();
        let mut unmarked = Vec::new();
        let mut rejoins = Vec::new();
        // Room is kept for new subjects: past half the bound, a subject idle
        // here is forgotten at once.
        let roomy = shared.entries.load(Ordering::Relaxed) < settings.max_counters / 2;
        shared.each_shard(|counters| {
            counters.retain(|Entry { key, counter }| {
                let quiet = at.saturating_duration_since(counter.seen_at);
                let idle = quiet >= settings.idle;
                let old = counter.block_since.is_some_and(|since| {
                    at.saturating_duration_since(since) >= settings.lease_time
                });
                let now = counter.now(at);
                if (idle || old) && counter.units > 0 {
                    if counter.ended(now) {
                        counter.let_go();
                    } else {
                        back.push(GiveBack::all_of(&shared, counter, key.to_period_key(), now));
                    }
                }
                let holding = counter.units > 0 || counter.taking || counter.reserved > 0;
                if (idle || old) && !holding && counter.mark.leave(now, settings.mark_margin()) {
                    unmarked.push((key.to_period_key(), now, counter.generation));
                }
                // Units still held past the end of the mark that counted
                // this instance (one lease time from its making: a block
                // taken while it counted this instance joined nothing):
                // joined again, a new mark, so that other instances'
                // refusals keep telling the short wait while they are held.
                // (Not while a joining or leaving is on its way, nor after
                // one failed: the mark may count this instance then.)
                if counter.units > 0 && !counter.mark.may_count(now) {
                    let key = key.to_period_key();
                    if key.lease_mark().is_some() && counter.mark.join(now) {
                        rejoins.push((key, now, counter.generation));
                    }
                }
                // A counter idle here is forgotten, unless its subject took
                // blocks (it was busy: its next block may grow from the
                // last one's size) and has been quiet for less than the
                // memory of rates. One with a block or reserved units on
                // their way stays until the store answers; so does one the
                // store's lease mark may still count.
                let remembered = roomy && counter.block > 0 && quiet < settings.rate_memory();
                !idle
                    || remembered
                    || counter.taking
                    || counter.reserved > 0
                    || counter.returning > 0
                    || counter.mark.may_count(now)
            });
        });
        // Together, a bounded number at a time: one at a time, a pass over
        // many idle subjects would keep the last ones' units from other
        // instances for as many round trips.
        let mut giving = tokio::task::JoinSet::new();
        for back in back {
            let (inner, shared) = (inner.clone(), Arc::clone(&shared));
            spawn_bounded(&mut giving, async move { back.send(&inner, &shared).await }).await;
        }
        while giving.join_next().await.is_some() {}
        // The marks left after the units, together too.
        for (key, now, generation) in unmarked {
            let inner = inner.clone();
            let shared = Arc::clone(&shared);
            let leaving = async move { leave(&inner, &shared, now, key, generation).await };
            spawn_bounded(&mut giving, leaving).await;
        }
        while giving.join_next().await.is_some() {}
        // The marks joined again by holders whose mark ended, together too.
        for (key, now, generation) in rejoins {
            let inner = inner.clone();
            let shared = Arc::clone(&shared);
            let (lease, max) = (settings.lease(), inner.max_count());
            let joining =
                async move { join(&inner, &shared, now, key, generation, lease, max).await };
            spawn_bounded(&mut giving, joining).await;
        }
        while giving.join_next().await.is_some() {}
        drop(busy);
        drop(shared);
    }
}

/// Unused units of a block on their way back to the store. While one is,
/// the entry of its counter here counts it (see [`Counter::returning`]),
/// unless there is none.
struct GiveBack {
    key: PeriodKey,
    now: Timestamp,
    units: u64,
    taken_at: Timestamp,
    /// Whose entry of `key` counts it, until it landed or failed.
    tracked_by: Option<Arc<Shared>>,
    /// The entry as the block left it, to put the block back if the store
    /// never gets it (see [`GiveBack::put_back`]).
    left: Option<Left>,
}

/// An entry as a whole block left it: what [`GiveBack::put_back`] finds
/// again before it puts the block back.
#[derive(Clone, Copy, Debug)]
struct Left {
    generation: u64,
    learned: u64,
    told: u32,
    store_used: u64,
    resets_at: Timestamp,
    first_call: Option<Timestamp>,
    block_since: Option<Instant>,
    block_limit: u64,
}

impl GiveBack {
    /// `units` of `counter`, the entry at `key`, taken at `taken_at`, to
    /// give back at `now`.
    fn tracked(
        shared: &Arc<Shared>,
        counter: &mut Counter,
        key: PeriodKey,
        now: Timestamp,
        units: u64,
        taken_at: Timestamp,
    ) -> Self {
        counter.returning += 1;
        Self {
            key,
            now,
            units,
            taken_at,
            tracked_by: Some(Arc::clone(shared)),
            left: None,
        }
    }

    /// The whole block of `counter`, the entry at `key`, to give back at
    /// `now` (it was idle here, or old); the entry holds none of it from
    /// now on, unless the store never gets it.
    fn all_of(shared: &Arc<Shared>, counter: &mut Counter, key: PeriodKey, now: Timestamp) -> Self {
        let (units, taken_at, block_since) = counter.let_go();
        let taken_at = taken_at.unwrap_or(now);
        let left = Left {
            generation: counter.generation,
            learned: counter.learned,
            told: counter.told,
            store_used: counter.store_used,
            resets_at: counter.resets_at,
            first_call: counter.first_call,
            block_since,
            block_limit: counter.block_limit,
        };
        let mut back = Self::tracked(shared, counter, key, now, units, taken_at);
        back.left = Some(left);
        back
    }

    /// Units no entry here counts (its entry is gone).
    fn untracked(key: PeriodKey, now: Timestamp, units: u64, taken_at: Timestamp) -> Self {
        Self {
            key,
            now,
            units,
            taken_at,
            tracked_by: None,
            left: None,
        }
    }

    /// Gives the units back (see [`give_back`]). A whole block the store
    /// never got (it was away, or had no room for the call: nothing of it
    /// applied) goes back into its entry if nothing changed there since
    /// (see [`GiveBack::put_back`]): this instance holds it again, spends
    /// it while it is fresh, gives it back when next idle or old, and on a
    /// shutdown. Otherwise its units stay charged until the period ends.
    async fn send<St: Store>(mut self, inner: &St, shared: &Shared) {
        let Err(error) = self.try_send(inner).await else {
            return;
        };
        match self.put_back() {
            // Never sent, and held by no entry here (the rest of a block cut
            // short, a block of an entry changed since): sent again a
            // moment later, in a task of its own (a charge may be waiting
            // for this give-back), or its units would stay charged, never
            // served.
            // (A shutdown waits for it, a lease time at most.)
            PutBack::No => match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    let resending = Resending::new(shared);
                    let inner = inner.clone();
                    let until = tokio::time::Instant::now() + RESEND_UNSENT_FOR;
                    // No entry counts it on its way (this one is let go of).
                    let again =
                        Self::untracked(self.key.clone(), self.now, self.units, self.taken_at);
                    runtime.spawn(async move {
                        let _resending = resending;
                        if let Err(error) = again.resend(&inner, error, until).await {
                            stay_charged(&error, again.units);
                        }
                    });
                }
                Err(_) => stay_charged(&error, self.units),
            },
            PutBack::Held => {}
            PutBack::Join(now, generation) => {
                if let Some(shared) = &self.tracked_by {
                    let (lease, max) = (shared.settings.lease(), inner.max_count());
                    join(inner, shared, now, self.key.clone(), generation, lease, max).await;
                }
            }
        }
    }

    /// Sends the give-back once (see [`give_back`]).
    async fn try_send<St: Store>(&self, inner: &St) -> Result<bool, StoreError> {
        give_back(inner, self.now, self.key.clone(), self.units, self.taken_at).await
    }

    /// Sends the give-back again while the store never gets it (`error`,
    /// the last such failure: only those come back from [`give_back`]), for
    /// as long as an outage lasts, until `until`: 100 ms after the last
    /// try, then twice as long each time up to [`RESEND_UNTIL`], and once
    /// more at `until`. Never applied, it cannot land twice. Whether the
    /// store took the units, or the last failure if it never got them.
    async fn resend<St: Store>(
        &self,
        inner: &St,
        mut error: StoreError,
        until: tokio::time::Instant,
    ) -> Result<bool, StoreError> {
        let mut pause = Duration::from_millis(100);
        loop {
            let now = tokio::time::Instant::now();
            if now >= until {
                return Err(error);
            }
            sleep(pause.min(until - now)).await;
            match self.try_send(inner).await {
                Err(again) => error = again,
                sent => return sent,
            }
            pause = (pause * 2).min(RESEND_UNTIL);
        }
    }

    /// Puts the block back into its entry, if the entry is as the block
    /// left it: the same entry (no reset here since), no answer of the
    /// store taken in since (its count would include the block already),
    /// the same period, not over, and the store not shut down. The entry
    /// holds the block again, and so joins the lease mark again, which it
    /// left for the block's sake: once the leaving on its way landed, or
    /// now (the caller sends the joining).
    fn put_back(&mut self) -> PutBack {
        let (Some(left), Some(shared)) = (self.left, self.tracked_by.as_ref()) else {
            return PutBack::No;
        };
        if shared.closed.load(Ordering::SeqCst) {
            return PutBack::No;
        }
        let mut counters = shared.counter(&self.key);
        let Some(counter) = counters.get_mut(&self.key) else {
            return PutBack::No;
        };
        let unchanged = counter.generation == left.generation
            && counter.learned == left.learned
            && counter.told == left.told
            && counter.store_used == left.store_used
            && counter.resets_at == left.resets_at
            && counter.first_call == left.first_call
            && counter.units == 0
            && !counter.taking;
        let now = counter.now(Instant::now());
        if !unchanged || counter.ended(now) {
            return PutBack::No;
        }
        counter.units = self.units;
        counter.store_used = counter.store_used.saturating_add(self.units);
        counter.block_since = left.block_since;
        counter.taken_at = Some(self.taken_at);
        counter.block_limit = left.block_limit;
        if counter.mark.join(now) {
            PutBack::Join(now, counter.generation)
        } else {
            PutBack::Held
        }
    }
}

/// What became of a block whose give-back the store never got.
enum PutBack {
    /// Its units stay charged in the store (the entry changed since).
    No,
    /// Back in its entry, which is (or will be) in the lease mark.
    Held,
    /// Back in its entry, which joins the lease mark now, at this instant,
    /// as its entry of this generation.
    Join(Timestamp, u64),
}

impl Drop for GiveBack {
    fn drop(&mut self) {
        if let Some(shared) = self.tracked_by.take() {
            if let Some(counter) = shared.counter(&self.key).get_mut(&self.key) {
                counter.returning = counter.returning.saturating_sub(1);
            }
        }
    }
}

/// Refunds `units` unused units, taken at `taken_at`, to the live counter
/// at `key` if it was made by then (not to one made since, after a reset);
/// whether the store took them, or the error of a refund it never got
/// (see [`StoreError::is_unsent`]). Any other failure is logged: the
/// units stay charged.
async fn give_back<St: Store>(
    inner: &St,
    now: Timestamp,
    key: PeriodKey,
    units: u64,
    taken_at: Timestamp,
) -> Result<bool, StoreError> {
    match inner.refund_made_at(now, key, units, taken_at).await {
        Ok(Some(_)) => {
            crate::metrics::lease_returned(units);
            Ok(true)
        }
        Ok(None) => Ok(false),
        Err(error) if error.is_unsent() => Err(error),
        Err(error) => {
            stay_charged(&error, units);
            Ok(false)
        }
    }
}

/// Logs `units` the store failed to take back with `error`.
fn stay_charged(error: &StoreError, units: u64) {
    if let Some(suppressed) = GIVE_BACK_ERRORS.admit() {
        tracing::warn!(
            error = crate::key::scrubbed(&error.to_string()),
            units,
            suppressed,
            "quota store failed to take back unused leased units: they stay charged"
        );
    }
}

/// Leaves the lease mark of the counter at `key`: one holder fewer. A
/// guarded refund, as every give-back: a mark that ended stays gone.
/// Whether the store took it.
async fn unmark<St: Store>(inner: &St, now: Timestamp, key: &PeriodKey) -> bool {
    let Some(mark) = key.lease_mark() else {
        return true;
    };
    match inner.refund(now, mark, 1).await {
        Ok(_) => true,
        Err(error) => {
            if let Some(suppressed) = GIVE_BACK_ERRORS.admit() {
                tracing::warn!(
                    error = crate::key::scrubbed(&error.to_string()),
                    suppressed,
                    "quota store failed to lift a lease mark: it ends on its own within the lease time"
                );
            }
            false
        }
    }
}

/// Per line, where its counter's lease mark (one of `marks`) stood, taken
/// off the end of `outcome` (`None`: no mark).
fn split_marks(marks: &[Option<PeriodKey>], outcome: &mut ChargeOutcome) -> Vec<Option<Usage>> {
    let lines = marks.len().min(outcome.usage.len());
    let mut read = outcome.usage.drain(lines..);
    marks
        .iter()
        .map(|mark| mark.as_ref().and_then(|_| read.next()))
        .collect()
}

/// The limit `line`'s blocks are sized by, and taken under: its own, or
/// a shadow quota's, which the store does not enforce but whose count near
/// it is told as exactly as an enforced one's.
fn sized_by(line: &ChargeLine) -> u64 {
    line.shadow_limit
        .map_or(line.limit, |shadow| shadow.min(line.limit))
}

/// The charge line of the lease mark at `key`: `cost` holders more, never
/// refused, living until `deadline` when it is made.
fn mark_line(key: PeriodKey, cost: u64, deadline: Timestamp, max: u64) -> ChargeLine {
    ChargeLine {
        key,
        limit: max,
        cost,
        lifetime: Lifetime::FirstUse { deadline },
        shadow_limit: None,
    }
}

/// Joins the lease mark of the counter at `key` for its entry of
/// `generation` (one holder more), and records how long it lives; leaves
/// it at once if the entry stopped holding, or is gone, meanwhile. A hint
/// only: a store that fails leaves no mark, or one that ends on its own.
async fn join<St: Store>(
    inner: &St,
    shared: &Shared,
    now: Timestamp,
    key: PeriodKey,
    generation: u64,
    lease: SignedDuration,
    max: u64,
) {
    let Some(mark) = key.lease_mark() else {
        return;
    };
    let deadline = now.saturating_add(lease).unwrap_or(now);
    let request = ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![mark_line(mark, 1, deadline, max)],
    };
    let result = match inner.charge(request).await {
        Ok(outcome) if outcome.admitted => Ok(outcome.usage.first().map(|u| u.resets_at)),
        Ok(_) => Ok(None),
        Err(_) => Err(deadline),
    };
    let leave_now = match shared.counter(&key).get_mut(&key) {
        Some(counter) if counter.generation == generation => counter.mark.joined(result),
        _ => matches!(result, Ok(Some(_))),
    };
    if leave_now {
        leave(inner, shared, now, key, generation).await;
    }
}

/// Leaves the lease mark of the counter at `key` for its entry of
/// `generation`, then notes that the leaving landed.
async fn leave<St: Store>(
    inner: &St,
    shared: &Shared,
    now: Timestamp,
    key: PeriodKey,
    generation: u64,
) {
    let ok = unmark(inner, now, &key).await;
    // A block came while the leaving was on its way: joined again, at the
    // counter's instant now.
    let rejoin = shared
        .counter(&key)
        .get_mut(&key)
        .filter(|c| c.generation == generation)
        .and_then(|counter| {
            let holding = counter.units > 0 || counter.reserved > 0 || counter.taking;
            counter
                .mark
                .left(ok, holding)
                .then(|| counter.now(Instant::now()))
        });
    if let Some(now) = rejoin {
        let (lease, max) = (shared.settings.lease(), inner.max_count());
        Box::pin(join(inner, shared, now, key, generation, lease, max)).await;
    }
}

/// How a request that is not answered from blocks alone goes to the store.
struct Plan {
    /// Per line, the block it asks for beyond its cost.
    blocks: Vec<u64>,
    /// Per line, whether the charge joins its counter's lease mark (one
    /// holder more, in the same call as the block).
    joins: SmallVec<[bool; 2]>,
    /// Per line, its counter's entry here when the charge was sent.
    known: Vec<Option<Known>>,
    /// Counters (and their entries' generations) whose lease mark this
    /// instance leaves.
    unmarked: Vec<(PeriodKey, u64)>,
    /// Per line, what blocks here pay of its cost.
    taken: SmallVec<[u64; 2]>,
    /// Per line paid from a block, when the store counted those units (the
    /// block's oldest): what a give-back of the line goes by, told in the
    /// answer ([`Usage::counted_at`]).
    counted: SmallVec<[Option<Timestamp>; 2]>,
    /// Per line paid from a block, the first call of the counter the block
    /// was taken from: told in the answer as the counter charged
    /// ([`Usage::first_call`]), whatever counter the store tells of since.
    counted_on: SmallVec<[Option<Timestamp>; 2]>,
    /// Blocks past their lease time, given back first.
    stale: Vec<GiveBack>,
    /// Whether the charge waits until `stale` is back: a block taken under
    /// a higher limit than the request's, whose units the store would
    /// otherwise count against it (the usage told would then count units
    /// nobody spent).
    stale_first: bool,
    /// The lines paid from blocks here.
    reserved: Reserved,
}

/// A counter's entry as a charge sent to the store found it.
#[derive(Clone, Copy, Debug)]
struct Known {
    generation: u64,
    /// Whether the store's lease mark may count this instance.
    in_mark: bool,
}

/// Units taken from blocks here for a request sent to the store: spent if
/// the store admits it, put back if it refuses, fails, or the charge is
/// dropped.
struct Reserved {
    shared: Arc<Shared>,
    lines: Vec<Aside>,
    spent: bool,
}

/// One request with units set aside less, once its units are back in their
/// block (or dropped with it).
struct SetAside<'a>(&'a Shared);

impl Drop for SetAside<'_> {
    fn drop(&mut self) {
        self.0.setting_aside.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The earlier of two instants, either when the other is unknown.
fn older<T: Ord>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Units set aside from a counter's block for a request on its way.
struct Aside {
    key: PeriodKey,
    units: u64,
    /// The entry they came from: a reset through this instance meanwhile
    /// makes a new one, and drops them.
    generation: u64,
    /// The highest limit they were taken under.
    limit: u64,
    /// The counter they were charged on, as its first call tells: a reset
    /// made elsewhere meanwhile (the counter made anew) drops them too.
    first_call: Option<Timestamp>,
    /// When their block was taken: what they go back to the store by, once
    /// back in a block (the block's own instants may be gone meanwhile).
    block_since: Option<Instant>,
    taken_at: Option<Timestamp>,
}

impl Reserved {
    /// `lines` set aside, counted in `setting_aside` already when there
    /// are any (see `spend_locally`).
    fn new(shared: &Arc<Shared>, lines: Vec<Aside>) -> Self {
        Self {
            shared: Arc::clone(shared),
            lines,
            spent: false,
        }
    }
}

impl Aside {
    /// The units given back to the counter they were taken from, by its
    /// first call, at the instant their block's take was plus the time
    /// since; `None` if that is not known.
    fn give_back(&self) -> Option<GiveBack> {
        let (taken_at, since) = (self.taken_at?, self.block_since?);
        let elapsed = span(Instant::now().saturating_duration_since(since));
        let now = taken_at.saturating_add(elapsed).unwrap_or(taken_at);
        Some(GiveBack::untracked(
            self.key.clone(),
            now,
            self.units,
            taken_at,
        ))
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if self.lines.is_empty() {
            return;
        }
        let _landed = SetAside(&self.shared);
        let mut counters = self
            .shared
            .counters(self.lines.iter().map(|aside| &aside.key));
        // Units not spent whose entry is gone or was made anew here (a
        // reset through this instance, a shutdown): back to the store.
        let mut orphans = Vec::new();
        for aside in &self.lines {
            let entry = counters
                .get_mut(&aside.key)
                .filter(|c| c.generation == aside.generation);
            if entry.is_none() && !self.spent {
                orphans.extend(aside.give_back());
            }
            if let Some(counter) = entry {
                counter.reserved = counter.reserved.saturating_sub(aside.units);
                if self.spent {
                    if counter.units == 0 {
                        counter.block_since = None;
                        counter.taken_at = None;
                    }
                } else if aside.first_call.is_none() || counter.first_call == aside.first_call {
                    // Back with the limit and the instants they were taken
                    // under, whatever block was taken since: the older
                    // instants, which a counter made later never passes.
                    counter.block_limit = if counter.units == 0 {
                        aside.limit
                    } else {
                        counter.block_limit.max(aside.limit)
                    };
                    counter.block_since = older(counter.block_since, aside.block_since);
                    counter.taken_at = older(counter.taken_at, aside.taken_at);
                    counter.units += aside.units;
                } else {
                    // An answer told of another counter since they were set
                    // aside, or of none (a reset elsewhere, a first-use
                    // period that ended, or a charge the store applied
                    // before the one that made the counter): back to the
                    // counter they were taken from, by its first call, as a
                    // block held then went (see `learn`). Put back into the
                    // block, they would be spent as units of a counter that
                    // may be gone, and a block taken next (of the counter
                    // made since) would join them and go back by their first
                    // call, to nothing: its units charged until the period
                    // ends.
                    orphans.extend(aside.give_back());
                }
            }
        }
        drop(counters);
        if !orphans.is_empty() {
            (self.shared.orphans)(&self.shared, orphans);
        }
    }
}

/// Lease marks joined with a charge on its way (key, entry generation):
/// when the charge fails or is dropped, the store may have counted this
/// instance in them, until `unsure`.
struct Joining {
    shared: Arc<Shared>,
    lines: Vec<(PeriodKey, u64)>,
    unsure: Timestamp,
}

impl Joining {
    /// The charge was answered: what it joined is known.
    fn landed(mut self) {
        self.lines.clear();
    }
}

impl Drop for Joining {
    fn drop(&mut self) {
        if self.lines.is_empty() {
            return;
        }
        let mut counters = self.shared.counters(self.lines.iter().map(|(key, _)| key));
        for (key, generation) in &self.lines {
            if let Some(counter) = counters
                .get_mut(key)
                .filter(|c| c.generation == *generation)
            {
                counter.mark.joined(Err(self.unsure));
            }
        }
    }
}

/// The mark of counters whose block is on its way, lifted when the charge
/// is answered or dropped.
struct Taking {
    shared: Arc<Shared>,
    keys: Vec<PeriodKey>,
}

impl Drop for Taking {
    fn drop(&mut self) {
        if self.keys.is_empty() {
            return;
        }
        let mut counters = self.shared.counters(&self.keys);
        for key in &self.keys {
            if let Some(counter) = counters.get_mut(key) {
                counter.taking = false;
            }
        }
    }
}

type RemoteCharge = Pin<Box<dyn Future<Output = Result<ChargeOutcome, StoreError>> + Send>>;

/// The future of [`LeasedStore`]'s charge: spent locally when first polled
/// if this instance's blocks have room, else sent to the store then.
pub struct LeasedChargeFuture<St> {
    store: LeasedStore<St>,
    request: Option<ChargeRequest>,
    remote: Option<RemoteCharge>,
}

// Nothing is pinned in place: the remote charge is boxed.
impl<St> Unpin for LeasedChargeFuture<St> {}

impl<St> fmt::Debug for LeasedChargeFuture<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeasedChargeFuture")
            .field("sent", &self.remote.is_some())
            .finish()
    }
}

impl<St: Store> Future for LeasedChargeFuture<St> {
    type Output = Result<ChargeOutcome, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Some(request) = this.request.take() {
            match this.store.start(Cow::Owned(request)) {
                Ok(outcome) => return Poll::Ready(Ok(outcome)),
                Err(remote) => this.remote = Some(remote),
            }
        }
        this.remote
            .as_mut()
            .expect("polled after completion")
            .as_mut()
            .poll(cx)
    }
}

impl<St: Store> Store for LeasedStore<St> {
    type ChargeFuture = LeasedChargeFuture<St>;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        LeasedChargeFuture {
            store: self.clone(),
            request: Some(request),
            remote: None,
        }
    }

    /// At once when this instance's blocks have room for every line;
    /// otherwise the charge is sent to the store here (answered at once if
    /// the store answers at once), and the future gives the store's answer.
    fn charge_at_once(&self, request: &ChargeRequest) -> ChargeAnswer<Self::ChargeFuture> {
        match self.start(Cow::Borrowed(request)) {
            Ok(outcome) => ChargeAnswer::Now(Ok(outcome)),
            Err(remote) => {
                let mut future = LeasedChargeFuture {
                    store: self.clone(),
                    request: None,
                    remote: Some(remote),
                };
                // Started here, as `charge`'s future is by its first poll:
                // a block past its lease time that `spend_locally` took off
                // the counter is on its way back before the future is
                // handed out, so dropping it unpolled loses no units.
                let mut cx = Context::from_waker(std::task::Waker::noop());
                match Pin::new(&mut future).poll(&mut cx) {
                    Poll::Ready(answer) => ChargeAnswer::Now(answer),
                    Poll::Pending => ChargeAnswer::Later(future),
                }
            }
        }
    }

    /// Where each counter stands, this instance's unused units counted as
    /// not spent.
    async fn peek(&self, request: ChargeRequest) -> Result<Vec<Usage>, StoreError> {
        let keys: Vec<PeriodKey> = request.lines.iter().map(|l| l.key.clone()).collect();
        let mut usage = self.inner.peek(request).await?;
        let counters = self.shared.counters(&keys);
        for (key, usage) in keys.iter().zip(&mut usage) {
            if let Some(counter) = counters.get(key) {
                if counter.same_period(usage) {
                    usage.used = usage.used.saturating_sub(counter.units);
                }
            }
        }
        Ok(usage)
    }

    /// Gives `amount` back to this instance's block of `key` when it holds
    /// one (the units go back to the store with the block), else to the
    /// store.
    async fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        self.refund_to(now, key, amount, Made::Any).await
    }

    /// As [`refund`](Self::refund), guarded by `made_by` in the store.
    async fn refund_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.refund_to(now, key, amount, Made::By(made_by)).await
    }

    /// As [`refund`](Self::refund), only to the counter whose first call
    /// was `first_call`, in the store.
    async fn refund_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.refund_to(now, key, amount, Made::At(first_call)).await
    }

    /// Adds `amount` in the store (an add never checks a limit, so it
    /// takes nothing from a block).
    async fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> Result<Option<u64>, StoreError> {
        self.add_to(now, key, amount, Made::Any).await
    }

    /// Adds `amount` in the store, to the counter charged at `made_by` only.
    async fn add_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.add_to(now, key, amount, Made::By(made_by)).await
    }

    /// Adds `amount` in the store, to the counter whose first call was
    /// `first_call` only.
    async fn add_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.add_to(now, key, amount, Made::At(first_call)).await
    }

    /// Settles `debt` in the store (a settle never checks a limit, so it
    /// takes nothing from a block, as an add).
    async fn settle_debt(&self, now: Timestamp, debt: Debt) -> Result<Option<u64>, StoreError> {
        let key = debt.key.clone();
        let sent = self.shared.next_sent();
        let result = self.inner.settle_debt(now, debt).await?;
        Ok(self.told(&key, result, sent))
    }

    /// Lets go of this instance's block of `key` and of what is on its
    /// way for it (a block being taken, units to put back), and leaves its
    /// lease mark; then deletes the counter. The block is given back first,
    /// to the counter it was taken from: its units back if the reset fails
    /// or is dropped (they would stay charged otherwise), and nothing left
    /// to land on a counter made after the delete.
    fn reset(&self, key: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        // Before the entry is looked at: a block taken from here on waits
        // for the delete.
        let resetting = Resetting::new(&self.shared, &key);
        let mut block = None;
        let leaving = self.shared.counter(&key).get_mut(&key).and_then(|counter| {
            let now = counter.now(Instant::now());
            if let (units @ 1.., Some(taken_at)) = (counter.units, counter.taken_at) {
                block = Some(GiveBack::untracked(key.clone(), now, units, taken_at));
            }
            self.renew(counter, now)
        });
        let inner = self.inner.clone();
        let shared = Arc::clone(&self.shared);
        // In a task of its own on a runtime, which the delete waits for: a
        // reset dropped meanwhile does not cut it short.
        let (block, giving_back) = match (block, tokio::runtime::Handle::try_current()) {
            (Some(block), Ok(runtime)) => {
                let inner = inner.clone();
                // Work a shutdown waits for.
                let busy = Busy::new(&self.shared);
                let task = runtime.spawn(async move {
                    block.send(&inner, &busy.shared).await;
                });
                (None, Some(task))
            }
            (block, _) => (block, None),
        };
        async move {
            if let Some(block) = block {
                block.send(&inner, &shared).await;
            }
            if let Some(giving_back) = giving_back {
                let _ = giving_back.await;
            }
            if let Some((now, generation)) = leaving {
                leave(&inner, &shared, now, key.clone(), generation).await;
            }
            let reset = inner.reset(key).await;
            drop(resetting);
            reset
        }
    }

    fn identity(&self) -> Option<usize> {
        self.inner.identity()
    }

    fn max_count(&self) -> u64 {
        self.inner.max_count()
    }

    /// The wait for units on their way back, beside the inner store's.
    fn longest_wait(&self) -> Duration {
        RETURN_WAIT.saturating_add(self.inner.longest_wait())
    }

    fn charges_in_flight(&self) -> usize {
        self.inner.charges_in_flight()
    }

    fn call_budget(&self) -> Option<Duration> {
        self.inner.call_budget()
    }

    fn last_answer(&self) -> Option<tokio::time::Instant> {
        self.inner.last_answer()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    fn t0() -> Timestamp {
        "2026-12-04T10:00:00Z".parse().unwrap()
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
            lifetime: Lifetime::Calendar {
                start: "2026-12-04T00:00:00Z".parse().unwrap(),
                end: "2026-12-05T00:00:00Z".parse().unwrap(),
            },
            shadow_limit: None,
        }
    }

    fn one(subject: &str, now: Timestamp, limit: u64) -> ChargeRequest {
        ChargeRequest {
            charged_at: None,
            now,
            lines: smallvec::smallvec![line_of(subject, limit)],
        }
    }

    /// What the store counts on `subject`'s counter of the day at `now`.
    async fn counted<St: Store>(store: &St, subject: &str, now: Timestamp) -> u64 {
        store.peek(one(subject, now, u64::MAX)).await.unwrap()[0].used
    }

    /// `n` requests of `subject` on `leased`, each admitted, 1 ms apart.
    async fn busy<St: Store>(leased: &St, subject: &str, now: &mut Timestamp, n: u64, limit: u64) {
        for _ in 0..n {
            assert!(
                leased
                    .charge(one(subject, *now, limit))
                    .await
                    .unwrap()
                    .admitted
            );
            tokio::time::advance(Duration::from_millis(1)).await;
            *now += SignedDuration::from_millis(1);
        }
    }

    /// A request of two lines: "acme" paid from a block taken before a
    /// reset made elsewhere, "beta" charged by the store. The store's
    /// answer tells of acme's counter made anew since, by an instance whose
    /// clock is behind (a first call before the old counter's). The request
    /// is not served: the layer gives acme's line back to the counter its
    /// usage names (`Usage::charged_counter`, as `give_back_unserved` does).
    /// The line was counted on the counter gone, so nothing may come off
    /// the new one, whose five requests were all served.
    #[tokio::test(start_paused = true)]
    async fn a_line_paid_from_an_old_block_is_never_given_back_to_a_counter_made_since_by_a_clock_behind(
    ) {
        let shared = MemoryStore::new();
        let a = LeasedStore::new(shared.clone());
        let mut now = t0();
        busy(&a, "acme", &mut now, 200, 10_000).await;
        assert!(a.held() > 0);
        assert!(shared.reset(key_of("acme")).await.unwrap());
        let behind = now - SignedDuration::from_secs(2);
        for _ in 0..5 {
            let made_anew = shared.charge(one("acme", behind, 10_000)).await.unwrap();
            assert!(made_anew.admitted);
        }
        let both = ChargeRequest {
            charged_at: None,
            now,
            lines: smallvec::smallvec![line_of("acme", 10_000), line_of("beta", 10_000)],
        };
        let outcome = a.charge(both).await.unwrap();
        assert!(outcome.admitted);
        let usage = outcome.usage[0];
        assert!(
            usage.counted_at.is_some(),
            "acme's line paid from the block"
        );
        let made = usage.charged_counter(now);
        made.refund(&a, now, key_of("acme"), 1).await.unwrap();
        a.shutdown().await;
        assert_eq!(
            counted(&shared, "acme", now).await,
            5,
            "the give-back went by {made:?} (usage {usage:?}) onto the new counter"
        );
    }

    /// As above, for a request of one line costing more than the old block
    /// holds: paid from the block, and its last unit (with a new block)
    /// charged by the store on the counter made anew. Given back as the
    /// layer does, it must not take the new counter below what was served
    /// there (the store's part may stay charged; the block's part was never
    /// counted on the new counter).
    #[tokio::test(start_paused = true)]
    async fn a_line_paid_in_part_from_an_old_block_never_takes_a_counter_made_since_below_what_it_served(
    ) {
        let shared = MemoryStore::new();
        let a = LeasedStore::new(shared.clone());
        let mut now = t0();
        busy(&a, "acme", &mut now, 200, 10_000).await;
        let held = a.held();
        assert!(held > 0);
        assert!(shared.reset(key_of("acme")).await.unwrap());
        let behind = now - SignedDuration::from_secs(2);
        for _ in 0..5 {
            let made_anew = shared.charge(one("acme", behind, 10_000)).await.unwrap();
            assert!(made_anew.admitted);
        }
        let mut costly = one("acme", now, 10_000);
        costly.lines[0].cost = held + 1;
        let outcome = a.charge(costly).await.unwrap();
        assert!(outcome.admitted);
        let usage = outcome.usage[0];
        assert!(usage.counted_at.is_some(), "paid in part from the block");
        let made = usage.charged_counter(now);
        made.refund(&a, now, key_of("acme"), held + 1)
            .await
            .unwrap();
        a.shutdown().await;
        let counted = counted(&shared, "acme", now).await;
        assert!(
            counted >= 5,
            "{counted}: the give-back of {} went by {made:?} (usage {usage:?}) onto the new counter",
            held + 1
        );
    }
}
