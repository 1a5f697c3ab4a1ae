use std::cmp::Reverse;
use std::collections::BinaryHeap;

use foldhash::fast::RandomState;
use hashbrown::HashTable;
use smallvec::SmallVec;
use std::fmt;
use std::future::{ready, Future};
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::task::{Context, Poll};

use jiff::{SignedDuration, Timestamp};

use super::slot_key::MapKey;
use super::{
    ChargeAnswer, ChargeLine, ChargeOutcome, ChargeRequest, Debt, Lifetime, Made, Store,
    StoreError, StoreErrorKind, Usage,
};
use crate::key::PeriodKey;

/// Expired counters reclaimed per shard visit: bounded so one request never
/// pays for a whole period's worth of reclaiming.
pub(super) const SWEEP_BUDGET: usize = 32;

/// How long a counter outlives its deadline before a sweep reclaims it. A
/// request is stamped once, by its policy's outermost layer, and each layer
/// charges it at that instant: a layer further in (behind a queue, an
/// authentication call) may reach the store well after the window it
/// charges ended, and after charges stamped since. The grace keeps the
/// ended window's counter for the late one, which then finds it spent, not
/// a fresh counter to be admitted on. (The Redis store's default grace is
/// the same.) A store at its bound reclaims them sooner: [`ROOM_GRACE`].
pub(super) const RECLAIM_GRACE: SignedDuration = SignedDuration::from_secs(60);

/// How long a counter outlives its deadline when the store needs its room
/// for a new one: at a calendar boundary, a store near its bound would
/// otherwise refuse the new window's subjects for the whole
/// [`RECLAIM_GRACE`]. A charge stamped before the deadline that reaches the
/// store later than this then finds a fresh counter.
pub(super) const ROOM_GRACE: SignedDuration = SignedDuration::from_secs(1);

/// Deadlines a purge goes through each time it holds a shard's lock.
const PURGE_STEP: usize = 512;

/// Deadlines one charge goes through, at most, to make room in a full store
/// (beyond the sweeps every charge does).
pub(super) const ROOM_BUDGET: usize = 256;

/// Counters in this process's memory: the default store.
///
/// - Exact: one shard lock is held from check to commit, so concurrent
///   requests of one subject never overspend.
/// - Sharded by subject: all counters of a subject live in one shard (chosen
///   from the key's hash tag), so a charge takes a single lock, and requests of
///   different subjects rarely wait on each other.
/// - One hash lookup per quota and charge. Creating a counter also files its
///   deadline in the shard's deadline heap (logarithmic in the shard's size).
/// - Bounded memory: a counter is reclaimed a minute after its deadline at
///   the earliest (a charge stamped before the deadline that reaches the
///   store late still finds it), or a second after it when the store is
///   at its bound; every charge reclaims up to 32 such counters of its
///   own shard, and every eighth charge of a shard as many of another shard
///   in turn (skipped when that shard is busy), so expired counters go away
///   without traffic to them as long as the store sees any traffic, and
///   memory follows the subjects active in the current periods.
///   [`MemoryStore::purge_expired`] reclaims everything expired at once, e.g.
///   from a timer in an application that can go quiet for long.
/// - A bound on the counters held ([`MemoryStore::DEFAULT_MAX_COUNTERS`], about
///   220 MB with keys of about 50 bytes; [`MemoryStore::max_counters`] sets
///   another): one client inventing ids cannot grow the process without end,
///   and concurrent charges never take it past the bound. A charge that would
///   create a counter beyond the bound first reclaims expired counters of its
///   own shard, then lets go of it and reclaims in the other shards (those
///   busy at that moment last, once free), in turn from where the last such
///   charge stopped, then tries once more. It goes through 256 deadlines at
///   most (and 64 shards), so no charge pays for a whole store's worth of
///   reclaiming; while such visits find nothing, the next ones wait 10 ms,
///   so that a flood of new ids costs little each. If the store is still full, the
///   charge fails with [`StoreErrorKind::Full`](super::StoreErrorKind::Full)
///   and creates nothing, so the layer's fail-open or fail-closed policy
///   decides, while subjects that have a counter keep being charged as
///   before.
///
/// - Instants in nanoseconds, in 64 bits: from 1677-09-21 to 2262-04-11.
///   A charge (or a settle) at an instant beyond, or one that would make a
///   counter ending beyond (a first-use period opened late in 2262), fails
///   with [`StoreErrorKind::Other`](super::StoreErrorKind::Other) and
///   charges nothing: reachable only with a [`Clock`](crate::Clock) of
///   the application's own (or a [`ManualClock`](crate::ManualClock)) set
///   there.
/// - One clock for every caller: the store keeps no clock of its own and
///   judges every counter it sweeps by the instant of the call that sweeps.
///   Policies that share one store should read one clock (the system's, by
///   default); a caller whose clock runs far ahead of the others' ends
///   their counters early, as a shared store's server would if its clock
///   jumped.
///
/// Clones share the counters. Counters are lost when the process exits; use
/// a shared store when several instances enforce one quota.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    /// Counters in the shards' maps, live or not yet reclaimed.
    held: Arc<AtomicUsize>,
    max: AtomicUsize,
    /// When (in the charges' time, ns) a full store last went through all
    /// the shards one charge visits and found no room: new subjects refused
    /// soon after do not repeat it (on a machine with many cores, such a
    /// visit per refused request would make a flood of new ids dear).
    fruitless: AtomicI64,
    /// The shard where the next charge that makes room starts reclaiming.
    room_cursor: AtomicUsize,
}

/// `Inner::fruitless` before any fruitless visit.
const NEVER: i64 = i64::MIN;

/// How long after a fruitless visit (of all the shards one charge visits)
/// the next one waits.
const FRUITLESS_PAUSE: u64 = 10_000_000;

/// Shards one charge visits, at most, to make room in a full store.
const ROOM_SHARDS: usize = 64;

struct Shard {
    counters: HashTable<Entry>,
    /// Hashes `counters`' keys.
    hasher: RandomState,
    /// Each counter's deadline, with its key's hash: what `sweep` goes by.
    deadlines: BinaryHeap<Reverse<(Nanos, u64)>>,
    /// The store's count of counters, kept as this shard adds and removes.
    held: Arc<AtomicUsize>,
    /// Charges that locked this shard (first): every eighth reclaims in
    /// another shard, in turn. Kept under the shard's lock, so charges on
    /// different shards never contend on it.
    turns: usize,
}

/// A counter in a shard's map, with its key.
struct Entry {
    key: MapKey,
    counter: Counter,
}

/// 32 bytes, so that more counters share the cache: with many subjects, a
/// charge's time is mostly the wait for its counter's memory.
#[derive(Clone, Copy, Debug)]
struct Counter {
    used: u64,
    first_call: Nanos,
    deadline: Nanos,
    first_use: bool,
    /// Whether a refund of another kind than a give-back at its first call
    /// (support's) lowered it: its count then no longer tells what the
    /// requests charged on it hold, and no give-back closes its period.
    kept: bool,
}

/// An instant in nanoseconds since the Unix epoch, held in an `i64` (the
/// years 1678 to 2262; instants beyond saturate, and a charge or a settle
/// at one, or making a counter that ends at one, fails: see
/// [`beyond_its_years`]): half a `Timestamp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Nanos(i64);

impl Nanos {
    fn of(at: Timestamp) -> Self {
        Self::exact(at).unwrap_or(Self(if at.as_second() < 0 {
            i64::MIN
        } else {
            i64::MAX
        }))
    }

    /// `at`, if an `i64` of nanoseconds holds it.
    fn exact(at: Timestamp) -> Option<Self> {
        // In `i64` arithmetic (every charge converts its instant).
        at.as_second()
            .checked_mul(1_000_000_000)
            .and_then(|n| n.checked_add(i64::from(at.subsec_nanosecond())))
            .map(Self)
    }

    fn timestamp(self) -> Timestamp {
        let nanos = i32::try_from(self.0.rem_euclid(1_000_000_000)).expect("below 10^9");
        Timestamp::new(self.0.div_euclid(1_000_000_000), nanos)
            .expect("an i64 of nanoseconds is a valid timestamp")
    }
}

/// The error of a charge or a settle at one of `instants` (its own, and
/// the ends of the counters it may make) that the store cannot hold
/// exactly, beyond the years 1678 to 2262: a counter would end at once, or
/// too early. `None` when it holds them all.
fn beyond_its_years(instants: impl IntoIterator<Item = Timestamp>) -> Option<StoreError> {
    instants
        .into_iter()
        .any(|at| Nanos::exact(at).is_none())
        .then(|| {
            StoreError::new(
                StoreErrorKind::Other,
                "the memory store counts instants from 1677-09-21 to 2262-04-11 only: nothing charged",
            )
        })
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

/// The error of a charge the store refuses as it is asked, whatever its
/// counters hold: a line whose period is over at its instant, or an
/// instant the store cannot hold.
fn refused_as_asked(request: &ChargeRequest) -> Result<(), StoreError> {
    if let Some(error) = super::past_its_period(request) {
        return Err(error);
    }
    let ends = request.lines.iter().map(|line| line.lifetime.end());
    match beyond_its_years(std::iter::once(request.now).chain(ends)) {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

impl MemoryStore {
    /// The most counters a store holds unless told otherwise: a million,
    /// about 220 MB with keys of about 50 bytes.
    pub const DEFAULT_MAX_COUNTERS: usize = 1_000_000;

    /// An empty store with a shard count fitted to the machine.
    pub fn new() -> Self {
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        Self::with_shards((cores * 16).next_power_of_two())
    }

    /// An empty store with `shards` shards.
    ///
    /// # Panics
    ///
    /// When `shards` is zero.
    pub fn with_shards(shards: usize) -> Self {
        assert!(shards > 0, "a memory store needs at least one shard");
        let held = Arc::new(AtomicUsize::new(0));
        Self {
            inner: Arc::new(Inner {
                shards: (0..shards)
                    .map(|_| {
                        Mutex::new(Shard {
                            counters: HashTable::new(),
                            hasher: RandomState::default(),
                            deadlines: BinaryHeap::new(),
                            held: Arc::clone(&held),
                            turns: 0,
                        })
                    })
                    .collect(),
                hasher: RandomState::default(),
                held,
                max: AtomicUsize::new(Self::DEFAULT_MAX_COUNTERS),
                fruitless: AtomicI64::new(NEVER),
                room_cursor: AtomicUsize::new(0),
            }),
        }
    }

    /// Holds at most `max` counters (default
    /// [`MemoryStore::DEFAULT_MAX_COUNTERS`]); for this store and every
    /// clone of it.
    ///
    /// A counter is held until a minute after its period ends, for charges
    /// stamped before the end that reach the store late, or until a second
    /// after it when the store needs its room: at a calendar boundary the
    /// ended windows' counters still count for that second beside the new
    /// window's. Size the bound for the subjects of a period and those that
    /// start the next one within a second.
    ///
    /// ```
    /// use tower_quota::MemoryStore;
    ///
    /// let store = MemoryStore::new().max_counters(50_000);
    /// # let _ = store;
    /// ```
    ///
    /// # Panics
    ///
    /// When `max` is zero: every charge would fail.
    #[must_use]
    pub fn max_counters(self, max: usize) -> Self {
        assert!(
            max > 0,
            "a memory store holds at least one counter: with none, every charge fails"
        );
        self.inner.max.store(max, Ordering::Relaxed);
        self
    }

    /// Makes room for `new` more counters in the store's count, to be
    /// created by the charge that holds `locked` (and nothing else between).
    /// When they do not fit, reclaims expired counters of the charge's own
    /// shards, within what is left of its `budget` of deadlines; whether
    /// they fit then. The count never goes beyond the bound, however many
    /// charges make room at once.
    fn room_in(
        &self,
        locked: &mut [&mut Shard],
        new: usize,
        now: Timestamp,
        budget: &mut usize,
    ) -> bool {
        if new == 0 || self.reserve(new) {
            return true;
        }
        for shard in locked.iter_mut() {
            if *budget == 0 {
                break;
            }
            *budget -= shard.sweep(room_by(now), *budget).0;
            if self.reserve(new) {
                return true;
            }
        }
        false
    }

    /// Reclaims expired counters in the shards, for a charge that found no
    /// room for `new` counters and holds no shard's lock: shards busy at
    /// the moment are gone through last, once their lock is free, if the
    /// others did not make room; the visit goes through what is left of the
    /// charge's `budget` of deadlines and [`ROOM_SHARDS`] shards at most,
    /// starting where the last one stopped. Whether they fit now (the
    /// charge then tries again).
    ///
    /// Not again within a pause (either way: concurrent charges read the
    /// clock in any order) after a visit that went through all the shards it
    /// may visit and found nothing.
    fn make_room(&self, new: usize, now: Timestamp, budget: &mut usize) -> bool {
        let at = Nanos::of(now).0;
        let last = self.inner.fruitless.load(Ordering::Relaxed);
        if last != NEVER && at.abs_diff(last) < FRUITLESS_PAUSE {
            return false;
        }
        let shards = &self.inner.shards;
        let visits = shards.len().min(ROOM_SHARDS);
        let start = self.inner.room_cursor.load(Ordering::Relaxed);
        let mut reclaimed = 0;
        let mut visited: usize = 0;
        let mut stopped = false;
        // Shards busy at the moment: they may hold expired counters, and a
        // visit that left them out would not have gone through its share.
        let mut busy: SmallVec<[usize; 4]> = SmallVec::new();
        for i in 0..visits {
            if *budget == 0 || self.fits(new) {
                stopped = true;
                break;
            }
            visited += 1;
            let index = start.wrapping_add(i) % shards.len();
            match try_lock(&shards[index]) {
                Some(mut shard) => {
                    let (gone_through, removed) = shard.sweep(room_by(now), *budget);
                    *budget -= gone_through;
                    reclaimed += removed;
                }
                None => busy.push(index),
            }
        }
        // Waited for, as a charge of theirs waits: this charge holds no lock.
        for index in busy {
            if *budget == 0 || self.fits(new) {
                stopped = true;
                break;
            }
            let (gone_through, removed) = lock(&shards[index]).sweep(room_by(now), *budget);
            *budget -= gone_through;
            reclaimed += removed;
        }
        // The next visit starts at the last shard of this one if this one
        // stopped short (it may hold more), else after it.
        let advance = if stopped {
            visited.saturating_sub(1)
        } else {
            visited
        };
        self.inner.room_cursor.fetch_add(advance, Ordering::Relaxed);
        // A visit of its whole share of shards (all of them, or the most one
        // charge visits) that found nothing pauses the next ones.
        if reclaimed == 0 && visited == visits && *budget > 0 {
            self.inner.fruitless.store(at, Ordering::Relaxed);
        }
        self.fits(new)
    }

    /// Whether `new` more counters fit within the bound now.
    fn fits(&self, new: usize) -> bool {
        let max = self.inner.max.load(Ordering::Relaxed);
        self.inner
            .held
            .load(Ordering::Relaxed)
            .checked_add(new)
            .is_some_and(|total| total <= max)
    }

    /// The error of a charge that found no room.
    fn full(&self) -> StoreError {
        StoreError::new(
            StoreErrorKind::Full,
            format!(
                "the memory store holds its maximum of {} counters",
                self.inner.max.load(Ordering::Relaxed)
            ),
        )
    }

    /// Brings the store's count to what the shards hold after a charge that
    /// made room for `reserved` counters and added `grown`.
    fn settle(&self, reserved: usize, grown: usize) {
        let held = &self.inner.held;
        match reserved.cmp(&grown) {
            std::cmp::Ordering::Greater => {
                held.fetch_sub(reserved - grown, Ordering::Relaxed);
            }
            std::cmp::Ordering::Less => {
                held.fetch_add(grown - reserved, Ordering::Relaxed);
            }
            std::cmp::Ordering::Equal => {}
        }
    }

    /// Counts `new` more counters if they fit within the bound.
    fn reserve(&self, new: usize) -> bool {
        let max = self.inner.max.load(Ordering::Relaxed);
        self.inner
            .held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                held.checked_add(new).filter(|&total| total <= max)
            })
            .is_ok()
    }

    /// Live and not yet reclaimed counters. Counters past their deadline count
    /// until they are reclaimed. Read shard by shard, not at one instant:
    /// while other threads charge, it may count a counter twice (or miss
    /// one) and read above `max_counters`, which the store itself never
    /// holds more than.
    pub fn len(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|s| lock(s).counters.len())
            .sum()
    }

    /// Deadlines filed, over every shard (what sweeps go through).
    #[cfg(test)]
    pub(super) fn filed_deadlines(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|s| lock(s).deadlines.len())
            .sum()
    }

    /// Whether the store holds no counter.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Changes what the live counter at `key` holds with `change`, and
    /// returns the new count; `None` when there is no live counter (one at
    /// or past its deadline is over, even before it is reclaimed). Never
    /// creates a counter, never touches a deadline: refunds and adds.
    fn change_live(
        &self,
        now: Timestamp,
        key: &PeriodKey,
        change: impl FnOnce(u64) -> u64,
    ) -> Option<u64> {
        self.change_live_made(now, key, Made::Any, change)
    }

    /// As `change_live`, only on a counter `made` names.
    fn change_live_made(
        &self,
        now: Timestamp,
        key: &PeriodKey,
        made: Made,
        change: impl FnOnce(u64) -> u64,
    ) -> Option<u64> {
        let mut shard = lock(&self.inner.shards[self.shard_of(key)]);
        let counter = shard.live_made(key, now, made)?;
        let before = counter.used;
        counter.used = change(before);
        counter.kept |= counter.used < before;
        Some(counter.used)
    }

    /// A give-back of `amount` to the live counter at `key` whose first
    /// call was `first_call` (see [`Store::refund_made_at`]): when it is a
    /// first-use counter that holds `amount` exactly, and no other refund
    /// lowered it, nothing else is spent in the period it opened, and the
    /// counter goes.
    fn give_back_at(
        &self,
        now: Timestamp,
        key: &PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> Option<u64> {
        let mut shard = lock(&self.inner.shards[self.shard_of(key)]);
        let counter = shard.live_made(key, now, Made::At(first_call))?;
        if counter.first_use && !counter.kept && amount > 0 && counter.used == amount {
            shard.remove(key.as_str());
            return Some(0);
        }
        counter.used = counter.used.saturating_sub(amount);
        Some(counter.used)
    }

    /// Reclaims every counter whose deadline is a minute or more before
    /// `now` (a counter outlives its deadline by a minute, for the charges
    /// stamped before it that reach the store late).
    ///
    /// Each shard is reclaimed a few hundred counters at a time, letting go
    /// of its lock between them, so charges wait little on a purge.
    pub fn purge_expired(&self, now: Timestamp) {
        for shard in self.inner.shards.iter() {
            while lock(shard).sweep(reclaimed_by(now), PURGE_STEP).0 == PURGE_STEP {}
        }
    }

    fn shard_of(&self, key: &PeriodKey) -> usize {
        (self.inner.hasher.hash_one(key.hash_tag()) as usize) % self.inner.shards.len()
    }

    /// Runs `f` with the shards of every line locked. A request's lines
    /// normally share one subject and so one shard; lines of several shards
    /// lock them in index order, so two requests never wait on each other in
    /// a cycle.
    fn locked<R>(
        &self,
        lines: &[ChargeLine],
        now: Timestamp,
        f: impl FnOnce(&mut Locked<'_, '_>) -> R,
    ) -> R {
        let first = lines.first().map_or(0, |l| self.shard_of(&l.key));
        let mut another = None;
        let result = if lines.iter().skip(1).all(|l| self.shard_of(&l.key) == first) {
            let mut guard = lock(&self.inner.shards[first]);
            guard.sweep(reclaimed_by(now), SWEEP_BUDGET);
            another = self.turn(&mut guard, first);
            f(&mut Locked::One(&mut guard))
        } else {
            let line_shards: Vec<usize> = lines.iter().map(|l| self.shard_of(&l.key)).collect();
            let mut indices = line_shards.clone();
            indices.sort_unstable();
            indices.dedup();
            let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> = indices
                .into_iter()
                .map(|i| (i, lock(&self.inner.shards[i])))
                .collect();
            for (_, guard) in &mut guards {
                guard.sweep(reclaimed_by(now), SWEEP_BUDGET);
            }
            if let Some((index, guard)) = guards.first_mut() {
                another = self.turn(guard, *index);
            }
            f(&mut Locked::Many {
                guards: &mut guards,
                line_shards: &line_shards,
            })
        };
        self.sweep_another(another, now);
        result
    }

    /// Counts a charge that locked shard `index`, `shard`: every eighth, the
    /// shard whose expired counters it reclaims once it let go of its own
    /// (the other shards in turn). This is what bounds memory when a
    /// shard's subjects stop calling.
    fn turn(&self, shard: &mut Shard, index: usize) -> Option<usize> {
        let others = self.inner.shards.len() - 1;
        shard.turns = shard.turns.wrapping_add(1);
        // Every eighth charge of a shard is plenty to keep up: each visit
        // reclaims up to SWEEP_BUDGET counters.
        if others == 0 || !shard.turns.is_multiple_of(8) {
            return None;
        }
        Some((index + 1 + (shard.turns / 8) % others) % self.inner.shards.len())
    }

    /// Reclaims a few expired counters of shard `another`, if it is free.
    /// Called with no shard locked.
    fn sweep_another(&self, another: Option<usize>, now: Timestamp) {
        if let Some(mut shard) = another.and_then(|i| try_lock(&self.inner.shards[i])) {
            shard.sweep(reclaimed_by(now), SWEEP_BUDGET);
        }
    }

    /// One quota, the common case: a single lookup that checks and commits.
    fn charge_one(&self, line: &ChargeLine, now: Timestamp) -> Result<ChargeOutcome, StoreError> {
        let index = self.shard_of(&line.key);
        let mut budget = ROOM_BUDGET;
        let mut another = None;
        let mut tried = false;
        let outcome = loop {
            let mut shard = lock(&self.inner.shards[index]);
            shard.sweep(reclaimed_by(now), SWEEP_BUDGET);
            if !tried {
                another = self.turn(&mut shard, index);
            }
            let outcome = match shard.get_mut(line.key.as_str()) {
                Some(counter) if counter.deadline > Nanos::of(now) => {
                    // A sum beyond `u64` is beyond any limit: refused, never
                    // wrapped.
                    let after = counter.used.checked_add(line.cost);
                    if let Some(used) = after.filter(|&used| used <= line.limit) {
                        counter.used = used;
                        Some((true, Some(*counter)))
                    } else {
                        Some((false, Some(*counter)))
                    }
                }
                _ if line.cost > line.limit => Some((false, None)),
                _ if line.cost == 0 => Some((true, None)),
                existing => {
                    // An expired counter is replaced where it is; a new key
                    // grows the store.
                    let new = usize::from(existing.is_none());
                    if self.room_in(&mut [&mut shard], new, now, &mut budget) {
                        let (counter, grown) = shard.spend(line, now);
                        self.settle(new, usize::from(grown));
                        Some((true, Some(counter)))
                    } else {
                        None
                    }
                }
            };
            drop(shard);
            match outcome {
                Some(outcome) => break Ok(outcome),
                // Room made in the other shards, without holding this one:
                // one more try.
                None if !tried && self.make_room(1, now, &mut budget) => tried = true,
                None => break Err(self.full()),
            }
        };
        self.sweep_another(another, now);
        let (admitted, counter) = outcome?;
        Ok(ChargeOutcome {
            admitted,
            usage: smallvec::smallvec![usage_of(line, counter)],
        })
    }

    fn charge_now(&self, request: &ChargeRequest) -> Result<ChargeOutcome, StoreError> {
        refused_as_asked(request)?;
        let now = request.now;
        let lines = &request.lines;
        if let [line] = lines.as_slice() {
            return self.charge_one(line, now);
        }
        self.charge_all(lines, now, |locked, budget| {
            self.charge_locked(locked, lines, now, budget)
        })
    }

    /// [`Store::charge_taking`] at once: each line's extra units as many
    /// as fit, read and charged under the same locks as the request.
    fn charge_taking_now(
        &self,
        request: &ChargeRequest,
        extra: &[u64],
    ) -> Result<(ChargeOutcome, SmallVec<[u64; 2]>), StoreError> {
        let extra = super::takeable(request, extra);
        if extra.iter().all(|&units| units == 0) {
            return self.charge_now(request).map(|outcome| (outcome, extra));
        }
        refused_as_asked(request)?;
        let now = request.now;
        let lines = &request.lines;
        self.charge_all(lines, now, |locked, budget| {
            // A line with extra units names a key no other line does: its
            // room is its counter's alone.
            let taken: SmallVec<[u64; 2]> = lines
                .iter()
                .zip(&extra)
                .enumerate()
                .map(|(i, (line, &units))| {
                    if units == 0 {
                        return 0;
                    }
                    let used = locked.live(i, &line.key, now).map_or(0, |c| c.used);
                    let room = line.limit.saturating_sub(used);
                    room.checked_sub(line.cost)
                        .map_or(0, |left| left.min(units))
                })
                .collect();
            let with_taken: SmallVec<[ChargeLine; 2]> = lines
                .iter()
                .zip(&taken)
                .map(|(line, &units)| ChargeLine {
                    cost: line.cost + units,
                    ..line.clone()
                })
                .collect();
            let outcome = self.charge_locked(locked, &with_taken, now, budget)?;
            let taken = if outcome.admitted {
                taken
            } else {
                smallvec::smallvec![0; lines.len()]
            };
            Ok((outcome, taken))
        })
    }

    /// Runs `charge` on the locked shards of `lines`; when it finds no room
    /// for the `n` counters it would create (`Err(n)`, nothing charged),
    /// makes room in the other shards and runs it once more.
    fn charge_all<R>(
        &self,
        lines: &[ChargeLine],
        now: Timestamp,
        mut charge: impl FnMut(&mut Locked<'_, '_>, &mut usize) -> Result<R, usize>,
    ) -> Result<R, StoreError> {
        let mut budget = ROOM_BUDGET;
        let mut tried = false;
        loop {
            let charged = self.locked(lines, now, |locked| charge(locked, &mut budget));
            match charged {
                Ok(outcome) => return Ok(outcome),
                // Room made in the other shards, without holding this
                // charge's: one more try.
                Err(new) if !tried && self.make_room(new, now, &mut budget) => tried = true,
                Err(_) => return Err(self.full()),
            }
        }
    }

    /// Checks and commits the lines of a charge on their locked shards; no
    /// room for the `n` counters it would create is `Err(n)`, and nothing is
    /// charged then.
    fn charge_locked(
        &self,
        locked: &mut Locked<'_, '_>,
        lines: &[ChargeLine],
        now: Timestamp,
        budget: &mut usize,
    ) -> Result<ChargeOutcome, usize> {
        let mut admitted = true;
        for (i, line) in lines.iter().enumerate() {
            let used = locked.live(i, &line.key, now).map_or(0, |c| c.used);
            // A key listed twice is charged twice. A sum beyond `u64`
            // is beyond any limit: refused, never wrapped.
            let after = lines[..i]
                .iter()
                .filter(|l| l.key == line.key)
                .try_fold(used, |sum, l| sum.checked_add(l.cost))
                .and_then(|earlier| earlier.checked_add(line.cost));
            if after.is_none_or(|after| after > line.limit) {
                admitted = false;
            }
        }
        // Counters this charge adds, each key once: those with no counter.
        // One that ended is replaced where it is, as a charge of one line
        // replaces it, unless making room for the new ones reclaims it
        // first: then it needs room too.
        let mut reserved = 0;
        if admitted {
            let new = |locked: &mut Locked<'_, '_>| {
                lines
                    .iter()
                    .enumerate()
                    .filter(|(i, line)| {
                        line.cost > 0
                            && !lines[..*i].iter().any(|l| l.key == line.key && l.cost > 0)
                            && locked.has_none(*i, &line.key)
                    })
                    .count()
            };
            let before = new(locked);
            // The list of shards is built only when the charge adds a
            // counter, not for every charge of counters that exist.
            if before > 0 {
                if !self.room_in(&mut locked.shards(), before, now, budget) {
                    return Err(before);
                }
                reserved = before;
                let reclaimed = new(locked) - before;
                if reclaimed > 0 && !self.reserve(reclaimed) {
                    self.settle(reserved, 0);
                    return Err(before + reclaimed);
                }
                reserved += reclaimed;
            }
        }
        let mut grown = 0;
        let usage = lines
            .iter()
            .enumerate()
            .map(|(i, line)| {
                if admitted && line.cost > 0 {
                    let (counter, grew) = locked.spend(i, line, now);
                    grown += usize::from(grew);
                    usage_of(line, Some(counter))
                } else {
                    usage_of(line, locked.live(i, &line.key, now))
                }
            })
            .collect();
        self.settle(reserved, grown);
        Ok(ChargeOutcome { admitted, usage })
    }
}

enum Locked<'a, 'g> {
    One(&'a mut Shard),
    Many {
        guards: &'a mut Vec<(usize, MutexGuard<'g, Shard>)>,
        line_shards: &'a [usize],
    },
}

impl Locked<'_, '_> {
    fn shard(&mut self, line: usize) -> &mut Shard {
        match self {
            Locked::One(shard) => shard,
            Locked::Many {
                guards,
                line_shards,
            } => {
                let index = line_shards[line];
                let (_, guard) = guards
                    .iter_mut()
                    .find(|(i, _)| *i == index)
                    .expect("every line's shard is locked");
                guard
            }
        }
    }

    fn live(&mut self, line: usize, key: &PeriodKey, now: Timestamp) -> Option<Counter> {
        self.shard(line).live(key.as_str(), now)
    }

    /// Whether the shard of line `line` has no counter at `key`, live or
    /// not.
    fn has_none(&mut self, line: usize, key: &PeriodKey) -> bool {
        self.shard(line).get(key.as_str()).is_none()
    }

    fn shards(&mut self) -> Vec<&mut Shard> {
        match self {
            Locked::One(shard) => vec![&mut **shard],
            Locked::Many { guards, .. } => guards.iter_mut().map(|(_, g)| &mut **g).collect(),
        }
    }

    fn spend(&mut self, line: usize, charge: &ChargeLine, now: Timestamp) -> (Counter, bool) {
        self.shard(line).spend(charge, now)
    }
}

impl Shard {
    fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key.as_bytes())
    }

    fn get(&self, key: &str) -> Option<&Counter> {
        self.counters
            .find(self.hash(key), |entry| {
                entry.key.as_bytes() == key.as_bytes()
            })
            .map(|entry| &entry.counter)
    }

    fn get_mut(&mut self, key: &str) -> Option<&mut Counter> {
        let hash = self.hash(key);
        self.counters
            .find_mut(hash, |entry| entry.key.as_bytes() == key.as_bytes())
            .map(|entry| &mut entry.counter)
    }

    fn live(&self, key: &str, now: Timestamp) -> Option<Counter> {
        self.get(key)
            .copied()
            .filter(|c| c.deadline > Nanos::of(now))
    }

    /// The live counter at `key` at `now`, if `made` names it: what a
    /// refund or an add may change.
    fn live_made(&mut self, key: &PeriodKey, now: Timestamp, made: Made) -> Option<&mut Counter> {
        self.get_mut(key.as_str())
            .filter(|c| c.deadline > Nanos::of(now) && made.names(c.first_call.timestamp()))
    }

    /// Charges `line` at `now`, and whether that added a key to the map (the
    /// store's count of counters is the caller's to keep).
    fn spend(&mut self, line: &ChargeLine, now: Timestamp) -> (Counter, bool) {
        if let Some(counter) = self.get_mut(line.key.as_str()) {
            if counter.deadline > Nanos::of(now) {
                // The deadline stays as it was set at creation.
                counter.used = counter.used.saturating_add(line.cost);
                return (*counter, false);
            }
        }
        self.create(&line.key, line.cost, now, line.lifetime)
    }

    /// Creates the counter at `key` (replacing an expired one) holding
    /// `used`, with its first call and the deadline of `lifetime`; and
    /// whether that added a key to the map (the store's count of counters
    /// is the caller's to keep).
    fn create(
        &mut self,
        key: &PeriodKey,
        used: u64,
        first_call: Timestamp,
        lifetime: Lifetime,
    ) -> (Counter, bool) {
        let (deadline, first_use) = match lifetime {
            Lifetime::Calendar { end, .. } => (end, false),
            Lifetime::FirstUse { deadline } => (deadline, true),
        };
        let deadline = Nanos::of(deadline);
        let counter = Counter {
            used,
            first_call: Nanos::of(first_call),
            deadline,
            first_use,
            kept: false,
        };
        let hash = self.hash(key.as_str());
        self.deadlines.push(Reverse((deadline, hash)));
        let hasher = &self.hasher;
        let grew = match self.counters.entry(
            hash,
            |entry| entry.key.as_bytes() == key.as_str().as_bytes(),
            |entry| hasher.hash_one(entry.key.as_bytes()),
        ) {
            hashbrown::hash_table::Entry::Occupied(mut entry) => {
                entry.get_mut().counter = counter;
                false
            }
            hashbrown::hash_table::Entry::Vacant(entry) => {
                entry.insert(Entry {
                    key: MapKey::new(key),
                    counter,
                });
                true
            }
        };
        // Once the counter is in the map: its deadline is filed anew too.
        if self.deadlines.len() > 2 * self.counters.len() + 64 {
            self.refile_deadlines();
        }
        (counter, grew)
    }

    /// Files the deadline of every counter held anew, dropping those of
    /// counters gone: a counter reset and made again before its deadline
    /// (a support tool's resets, over and over) leaves its old deadline
    /// filed until then, which would otherwise grow the heap beyond the
    /// bound on counters. Once the heap holds twice the counters: its cost
    /// is that of the pushes since the last time.
    #[cold]
    fn refile_deadlines(&mut self) {
        let hasher = &self.hasher;
        self.deadlines = self
            .counters
            .iter()
            .map(|entry| {
                Reverse((
                    entry.counter.deadline,
                    hasher.hash_one(entry.key.as_bytes()),
                ))
            })
            .collect();
    }

    /// Removes the counter at `key`; whether there was one.
    fn remove(&mut self, key: &str) -> bool {
        let hash = self.hash(key);
        let removed = self
            .counters
            .find_entry(hash, |entry| entry.key.as_bytes() == key.as_bytes())
            .map(|entry| entry.remove())
            .is_ok();
        if removed {
            self.held.fetch_sub(1, Ordering::Relaxed);
        }
        removed
    }

    /// Reclaims the counters whose deadline is `cutoff` or before (at `now`,
    /// [`reclaimed_by`] it; to make room, [`room_by`] it), going through
    /// `budget` deadlines at most: how many it went through, and how many
    /// counters it removed.
    fn sweep(&mut self, cutoff: Nanos, budget: usize) -> (usize, usize) {
        let (mut gone_through, mut removed) = (0, 0);
        while gone_through < budget {
            match self.deadlines.peek() {
                Some(Reverse((deadline, _))) if *deadline <= cutoff => {}
                _ => break,
            }
            let Some(Reverse((deadline, hash))) = self.deadlines.pop() else {
                break;
            };
            gone_through += 1;
            // The counter may have been reset and created again since this
            // deadline was filed; only the counter it belongs to goes. (Any
            // counter whose key shares the hash and that ends then has
            // expired too.)
            let hasher = &self.hasher;
            if let Ok(entry) = self.counters.find_entry(hash, |entry| {
                entry.counter.deadline == deadline && hasher.hash_one(entry.key.as_bytes()) == hash
            }) {
                entry.remove();
                self.held.fetch_sub(1, Ordering::Relaxed);
                removed += 1;
            }
        }
        (gone_through, removed)
    }
}

/// The latest deadline a sweep at `now` reclaims: [`RECLAIM_GRACE`] before.
fn reclaimed_by(now: Timestamp) -> Nanos {
    before(now, RECLAIM_GRACE)
}

/// The latest deadline a charge at `now` that needs room reclaims:
/// [`ROOM_GRACE`] before.
fn room_by(now: Timestamp) -> Nanos {
    before(now, ROOM_GRACE)
}

fn before(now: Timestamp, grace: SignedDuration) -> Nanos {
    let grace = grace.as_nanos() as i64;
    Nanos(Nanos::of(now).0.saturating_sub(grace))
}

fn usage_of(line: &ChargeLine, counter: Option<Counter>) -> Usage {
    match line.lifetime {
        Lifetime::Calendar { end, .. } => Usage {
            held_elsewhere_until: None,
            counted_at: None,
            limit: line.limit,
            used: counter.map_or(0, |c| c.used),
            resets_at: end,
            first_call: counter.map(|c| c.first_call.timestamp()),
        },
        Lifetime::FirstUse { deadline } => Usage {
            held_elsewhere_until: None,
            counted_at: None,
            limit: line.limit,
            used: counter.map_or(0, |c| c.used),
            resets_at: counter.map_or(deadline, |c| c.deadline.timestamp()),
            first_call: counter
                .filter(|c| c.first_use)
                .map(|c| c.first_call.timestamp()),
        },
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while a shard was locked cannot leave a counter half-written
    // (every update is a single assignment), so the data stays usable.
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The shard's lock if no one holds it now; a poisoned shard is as usable as
/// with [`lock`].
fn try_lock(shard: &Mutex<Shard>) -> Option<MutexGuard<'_, Shard>> {
    match shard.try_lock() {
        Ok(guard) => Some(guard),
        Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.inner.shards.len())
            .finish_non_exhaustive()
    }
}

/// The future of [`MemoryStore::charge`]: the charge is made when the future
/// is first polled, and the future is ready then. Dropped before that, it
/// charges nothing.
pub struct MemoryChargeFuture {
    store: MemoryStore,
    request: Option<ChargeRequest>,
}

impl Future for MemoryChargeFuture {
    type Output = Result<ChargeOutcome, StoreError>;

    fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let request = this
            .request
            .take()
            .expect("a MemoryChargeFuture polled after it was ready");
        Poll::Ready(this.store.charge_now(&request))
    }
}

impl fmt::Debug for MemoryChargeFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryChargeFuture")
            .field("charged", &self.request.is_none())
            .finish()
    }
}

impl Store for MemoryStore {
    type ChargeFuture = MemoryChargeFuture;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        MemoryChargeFuture {
            store: self.clone(),
            request: Some(request),
        }
    }

    /// Always at once: the counters are here.
    fn charge_at_once(&self, request: &ChargeRequest) -> ChargeAnswer<Self::ChargeFuture> {
        ChargeAnswer::Now(self.charge_now(request))
    }

    /// In one step: each line takes as many of its extra units as fit.
    fn charge_taking(
        &self,
        request: ChargeRequest,
        extra: SmallVec<[u64; 2]>,
    ) -> impl Future<Output = Result<(ChargeOutcome, SmallVec<[u64; 2]>), StoreError>> + Send {
        ready(self.charge_taking_now(&request, &extra))
    }

    fn peek(
        &self,
        request: ChargeRequest,
    ) -> impl Future<Output = Result<Vec<Usage>, StoreError>> + Send {
        let now = request.now;
        let usage = self.locked(&request.lines, now, |locked| {
            request
                .lines
                .iter()
                .enumerate()
                .map(|(i, line)| usage_of(line, locked.live(i, &line.key, now)))
                .collect()
        });
        ready(Ok(usage))
    }

    fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        ready(Ok(
            self.change_live(now, &key, |used| used.saturating_sub(amount))
        ))
    }

    fn refund_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        ready(Ok(self.change_live_made(
            now,
            &key,
            Made::By(made_by),
            |used| used.saturating_sub(amount),
        )))
    }

    fn refund_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        ready(Ok(self.give_back_at(now, &key, amount, first_call)))
    }

    fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        ready(Ok(
            self.change_live(now, &key, |used| used.saturating_add(amount))
        ))
    }

    fn add_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        ready(Ok(self.change_live_made(
            now,
            &key,
            Made::By(made_by),
            |used| used.saturating_add(amount),
        )))
    }

    fn add_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        ready(Ok(self.change_live_made(
            now,
            &key,
            Made::At(first_call),
            |used| used.saturating_add(amount),
        )))
    }

    fn reset(&self, key: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let mut shard = lock(&self.inner.shards[self.shard_of(&key)]);
        ready(Ok(shard.remove(key.as_str())))
    }

    fn identity(&self) -> Option<usize> {
        Some(Arc::as_ptr(&self.inner) as usize)
    }

    fn settle_debt(
        &self,
        now: Timestamp,
        debt: Debt,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        ready(self.settle_now(now, &debt))
    }
}

impl MemoryStore {
    /// [`Store::settle_debt`]: adds to the live counter at the debt's key,
    /// or creates it with the debt's lifetime (and the first call
    /// [`settled_first_call`] gives), making room as a charge does;
    /// nothing when the debt's lifetime ended by `now`.
    fn settle_now(&self, now: Timestamp, debt: &Debt) -> Result<Option<u64>, StoreError> {
        if debt.lifetime.end() <= now {
            return Ok(None);
        }
        if let Some(error) = beyond_its_years([now, debt.lifetime.end(), debt.since]) {
            return Err(error);
        }
        let index = self.shard_of(&debt.key);
        let mut budget = ROOM_BUDGET;
        let mut tried = false;
        loop {
            let mut shard = lock(&self.inner.shards[index]);
            shard.sweep(reclaimed_by(now), SWEEP_BUDGET);
            let existing = match shard.get_mut(debt.key.as_str()) {
                // A first-use period opened at or past the debt's deadline
                // (by a charge with a later instant than the settle's):
                // never charged to a period after the debt's own.
                Some(counter)
                    if counter.deadline > Nanos::of(now)
                        && counter.first_use
                        && counter.first_call >= Nanos::of(debt.lifetime.end()) =>
                {
                    return Ok(None);
                }
                Some(counter) if counter.deadline > Nanos::of(now) => {
                    counter.used = counter.used.saturating_add(debt.amount);
                    return Ok(Some(counter.used));
                }
                existing => existing.is_some(),
            };
            if debt.amount == 0 {
                return Ok(Some(0));
            }
            // An expired counter is replaced where it is; a new key grows
            // the store.
            let new = usize::from(!existing);
            if self.room_in(&mut [&mut shard], new, now, &mut budget) {
                let first = settled_first_call(now, debt);
                let (_, grown) = shard.create(&debt.key, debt.amount, first, debt.lifetime);
                self.settle(new, usize::from(grown));
                return Ok(Some(debt.amount));
            }
            drop(shard);
            if tried || !self.make_room(1, now, &mut budget) {
                return Err(self.full());
            }
            tried = true;
        }
    }
}

/// The first call a counter a settle of `debt` creates at `now` records.
/// A first-use counter's is the debt's first request, which its period
/// runs from, as the requests' charges would have made it. A calendar
/// counter's period is its window, and its first call only tells when it
/// was made: now, so that a give-back of a charge made before (to a
/// counter support reset since) never lands on it.
fn settled_first_call(now: Timestamp, debt: &Debt) -> Timestamp {
    match debt.lifetime {
        Lifetime::Calendar { .. } => now,
        Lifetime::FirstUse { .. } => debt.since,
    }
}

#[cfg(test)]
mod nanos_tests {
    use jiff::Timestamp;

    use super::Nanos;

    /// Past 2262-04-11 a counter's deadline would be cut short (told too
    /// early), and at its last nanosecond every counter would end as it is
    /// made (every request admitted): such charges and settles fail.
    #[test]
    fn instants_beyond_its_years_are_refused_not_cut_short() {
        use crate::store::{ChargeLine, ChargeRequest, Debt, Lifetime, StoreErrorKind};
        use crate::{MemoryStore, PeriodKey};

        let at = |text: &str| -> Timestamp { text.parse().unwrap() };
        let store = MemoryStore::new();
        let key = PeriodKey::from_string("quota:{account:acme}:default:x".to_owned());
        let charge = |now: Timestamp, lifetime: Lifetime| {
            let line = ChargeLine {
                key: key.clone(),
                limit: 1,
                cost: 1,
                lifetime,
                shadow_limit: None,
            };
            let request = ChargeRequest {
                charged_at: None,
                now,
                lines: smallvec::smallvec![line],
            };
            store.charge_now(&request).map_err(|error| error.kind())
        };
        let first_use = |now: Timestamp| Lifetime::FirstUse {
            deadline: now + jiff::SignedDuration::from_hours(24),
        };
        for now in [
            at("2262-04-11T12:00:00Z"),
            at("2262-04-11T23:47:16.854775807Z"),
            at("2263-01-01T12:00:00Z"),
            at("1600-01-01T00:00:00Z"),
        ] {
            assert_eq!(
                charge(now, first_use(now)),
                Err(StoreErrorKind::Other),
                "{now}"
            );
        }
        let last_day = Lifetime::Calendar {
            start: at("2262-04-11T00:00:00Z"),
            end: at("2262-04-12T00:00:00Z"),
        };
        assert_eq!(
            charge(at("2262-04-11T23:47:16.854775807Z"), last_day),
            Err(StoreErrorKind::Other)
        );
        let debt = Debt {
            key: key.clone(),
            amount: 1,
            lifetime: last_day,
            since: at("2262-04-11T10:00:00Z"),
            id: 0,
        };
        let settled = store.settle_now(at("2262-04-11T12:00:00Z"), &debt);
        assert_eq!(settled.map_err(|e| e.kind()), Err(StoreErrorKind::Other));
        assert!(store.is_empty());
        // The last day it holds whole is counted as any other.
        let now = at("2262-04-10T12:00:00Z");
        let day = Lifetime::Calendar {
            start: at("2262-04-10T00:00:00Z"),
            end: at("2262-04-11T00:00:00Z"),
        };
        let admitted = charge(now, day).unwrap();
        assert!(admitted.admitted);
        assert_eq!(admitted.usage[0].resets_at, at("2262-04-11T00:00:00Z"));
        assert!(!charge(now, day).unwrap().admitted);
    }

    #[test]
    fn instants_convert_both_ways_and_saturate_beyond_i64() {
        for text in [
            "2026-12-04T23:00:00.123456789Z",
            "1970-01-01T00:00:00Z",
            "1969-12-31T23:59:59.999999999Z",
            "1700-03-01T12:00:00.5Z",
            "2262-04-11T23:47:16.854775807Z",
        ] {
            let at: Timestamp = text.parse().unwrap();
            let nanos = Nanos::of(at);
            assert_eq!(i128::from(nanos.0), at.as_nanosecond(), "{text}");
            assert_eq!(nanos.timestamp(), at, "{text}");
        }
        let late: Timestamp = "2300-01-01T00:00:00Z".parse().unwrap();
        assert_eq!(Nanos::of(late).0, i64::MAX);
        let early: Timestamp = "1600-01-01T00:00:00.5Z".parse().unwrap();
        assert_eq!(Nanos::of(early).0, i64::MIN);
        assert_eq!(
            Nanos(i64::MIN).timestamp().as_nanosecond(),
            i128::from(i64::MIN)
        );
    }
}

#[cfg(test)]
mod room_tests {
    use std::sync::atomic::Ordering;

    use jiff::{SignedDuration, Timestamp};

    use super::{MemoryStore, NEVER};
    use crate::key::Namespace;
    use crate::store::{ChargeLine, ChargeRequest, Lifetime, StoreErrorKind};
    use crate::subject::Subject;

    fn charge(store: &MemoryStore, now: Timestamp, id: &str) -> Result<bool, StoreErrorKind> {
        let line = ChargeLine {
            key: Namespace::default().key(&Subject::account(id), "read", "PT1H"),
            limit: 10,
            cost: 1,
            lifetime: Lifetime::FirstUse {
                deadline: now + SignedDuration::from_hours(1),
            },
            shadow_limit: None,
        };
        store
            .charge_now(&ChargeRequest {
                charged_at: None,
                now,
                lines: vec![line].into(),
            })
            .map(|outcome| outcome.admitted)
            .map_err(|e| e.kind())
    }

    /// A shard whose lock was poisoned (a panic while it was held) is
    /// reclaimed in like the others when a full store makes room.
    #[test]
    fn a_full_store_reclaims_in_a_poisoned_shard() {
        let store = MemoryStore::with_shards(2).max_counters(1);
        let shard_of = |id: &str| {
            store.shard_of(&Namespace::default().key(&Subject::account(id), "read", "PT1H"))
        };
        let other = (0..)
            .map(|i| format!("s{i}"))
            .find(|id| shard_of(id) != shard_of("a"))
            .unwrap();
        let t0: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap();
        assert_eq!(charge(&store, t0, "a"), Ok(true));
        let poisoner = store.clone();
        let shard = shard_of("a");
        std::thread::spawn(move || {
            let _guard = poisoner.inner.shards[shard].lock().unwrap();
            panic!("poisons the shard");
        })
        .join()
        .unwrap_err();
        assert!(store.inner.shards[shard].is_poisoned());
        let later = t0 + SignedDuration::from_hours(2);
        assert_eq!(charge(&store, later, &other), Ok(true));
        assert_eq!(store.len(), 1);
    }

    /// A shard busy while a charge needs room is waited for, not left out:
    /// its expired counter makes the room, and no visit is taken for one
    /// that found nothing (which would refuse every new subject for a
    /// while).
    #[test]
    fn a_shard_busy_while_a_charge_needs_room_is_waited_for() {
        let store = MemoryStore::with_shards(2).max_counters(1);
        let shard_of = |id: &str| {
            store.shard_of(&Namespace::default().key(&Subject::account(id), "read", "PT1H"))
        };
        let mut others = (0..)
            .map(|i| format!("s{i}"))
            .filter(|id| shard_of(id) != shard_of("a"));
        let (b, c) = (others.next().unwrap(), others.next().unwrap());
        let t0: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap();
        assert_eq!(charge(&store, t0, "a"), Ok(true));
        // Two hours on, a's counter is long over; its shard is busy (held
        // by another thread for a moment) while b needs room.
        let later = t0 + SignedDuration::from_hours(2);
        let (held, release) = (
            std::sync::Barrier::new(2),
            std::time::Duration::from_millis(50),
        );
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let _busy = store.inner.shards[shard_of("a")].lock().unwrap();
                held.wait();
                std::thread::sleep(release);
            });
            held.wait();
            assert_eq!(
                charge(&store, later, &b),
                Ok(true),
                "a's expired counter made room"
            );
        });
        assert_eq!(
            charge(&store, later, &c),
            Err(StoreErrorKind::Full),
            "b's counter is live"
        );
    }

    /// With more shards than one charge visits, a full store whose visits
    /// find nothing still pauses them: a flood of new ids costs little each.
    #[test]
    fn a_fruitless_visit_pauses_the_next_with_many_shards() {
        let store = MemoryStore::with_shards(256).max_counters(2);
        let t0: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap();
        assert_eq!(charge(&store, t0, "a"), Ok(true));
        assert_eq!(charge(&store, t0, "b"), Ok(true));
        assert_eq!(charge(&store, t0, "c"), Err(StoreErrorKind::Full));
        assert_ne!(store.inner.fruitless.load(Ordering::Relaxed), NEVER);
        let cursor = store.inner.room_cursor.load(Ordering::Relaxed);
        assert_eq!(charge(&store, t0, "d"), Err(StoreErrorKind::Full));
        assert_eq!(
            store.inner.room_cursor.load(Ordering::Relaxed),
            cursor,
            "no visit within the pause"
        );
    }
}

#[cfg(test)]
mod bound_tests {
    use std::sync::atomic::Ordering;

    use jiff::{SignedDuration, Timestamp};
    use proptest::prelude::*;

    use super::MemoryStore;
    use crate::key::Namespace;
    use crate::store::{ChargeLine, ChargeRequest, Debt, Lifetime, Store};
    use crate::subject::Subject;

    /// Subject `subject`'s line of quota `quota` at `now`: a first-use one
    /// of 2 s, or a calendar one of 3 s windows.
    fn line(quota: usize, subject: u8, now: Timestamp, cost: u64) -> ChargeLine {
        let key = |period: &str| {
            Namespace::default().key(&Subject::account(format!("s{subject}")), "a", period)
        };
        if quota == 0 {
            return ChargeLine {
                key: key("PT2S"),
                limit: 5,
                cost,
                lifetime: Lifetime::FirstUse {
                    deadline: now + SignedDuration::from_secs(2),
                },
                shadow_limit: None,
            };
        }
        let start = now.as_second().div_euclid(3) * 3;
        ChargeLine {
            key: key(&format!("w{start}")),
            limit: 4,
            cost,
            lifetime: Lifetime::Calendar {
                start: Timestamp::from_second(start).unwrap(),
                end: Timestamp::from_second(start + 3).unwrap(),
            },
            shadow_limit: None,
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Advance(i64),
        Charge(u8, Vec<usize>, u64),
        Settle(u8, usize, u64, i64),
        Reset(u8, usize),
        Purge,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0i64..2500).prop_map(Op::Advance),
            (0u8..6, proptest::collection::vec(0usize..2, 1..4), 0u64..3)
                .prop_map(|(s, quotas, cost)| Op::Charge(s, quotas, cost)),
            (0u8..6, 0usize..2, 0u64..3, 0i64..3000)
                .prop_map(|(s, quota, amount, ago)| Op::Settle(s, quota, amount, ago)),
            (0u8..6, 0usize..2).prop_map(|(s, quota)| Op::Reset(s, quota)),
            Just(Op::Purge),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        /// Whatever the charges, settles, resets, sweeps and steps of the
        /// clock around the grace, the store's count of its counters is
        /// what it holds, and never past its bound.
        #[test]
        fn the_count_of_counters_is_what_the_store_holds_within_its_bound(
            ops in proptest::collection::vec(op(), 1..80),
            shards in 1usize..4,
            max in 1usize..6,
        ) {
            let store = MemoryStore::with_shards(shards).max_counters(max);
            let mut now: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap();
            for op in ops {
                match &op {
                    Op::Advance(ms) => now += SignedDuration::from_millis(*ms),
                    Op::Charge(s, quotas, cost) => {
                        let lines = quotas.iter().map(|&q| line(q, *s, now, *cost)).collect();
                        let _ = store.charge_now(&ChargeRequest { charged_at: None, now, lines });
                    }
                    Op::Settle(s, quota, amount, ago) => {
                        let since = now - SignedDuration::from_millis(*ago);
                        let line = line(*quota, *s, since, 0);
                        let debt = Debt {
                            key: line.key,
                            amount: *amount,
                            lifetime: line.lifetime,
                            since,
                            id: 0,
                        };
                        let _ = store.settle_now(now, &debt);
                    }
                    Op::Reset(s, quota) => {
                        let reset = store.reset(line(*quota, *s, now, 0).key);
                        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                        let _ = std::future::Future::poll(std::pin::pin!(reset), &mut cx);
                    }
                    Op::Purge => store.purge_expired(now),
                }
                let held = store.inner.held.load(Ordering::Relaxed);
                prop_assert_eq!(held, store.len(), "after {:?}", op);
                prop_assert!(held <= max, "{} held, bound {}", held, max);
            }
        }
    }
}
