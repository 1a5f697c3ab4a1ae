//! The ledger: what requests admitted while the store could not count them
//! owe, kept per counter until the store answers again.
//!
//! Under [`OnStoreError::FailOpen`](crate::OnStoreError::FailOpen) a request
//! whose charge failed (the store did not answer within `store_timeout`, or
//! could not be reached) is served all the same. Served, it is counted: once
//! its answer is known (what it costs, or nothing if it was not served after
//! all), the layer records its debt here, one per counter it would have
//! charged, and the policy's ledger adds it to the store when the store
//! answers again ([`Store::settle_debt`]): without a limit check, so the
//! count may pass the limit and then says what was served.
//!
//! # Exactly once
//!
//! The charge that failed may still reach the store: the Redis store follows
//! a charge whose caller stopped waiting, and Redis may apply it late. Two
//! designs give one count per request: let that late charge stand and owe
//! nothing, or give it back and owe the whole charge. The first needs the
//! layer to learn, long after it answered, whether Redis applied the charge,
//! and to owe it after all when Redis refused it late (the count had reached
//! the limit meanwhile) or never ran it; the second needs nothing new. So
//! here a failed charge charges nothing, whatever became of it (the store's
//! contract: the Redis store gives back a charge it applied after its
//! caller stopped waiting, and the memory store never fails a charge it
//! made), and the request owes its whole charge:
//!
//! - never applied (the store was down, or the charge never left): 0 + the
//!   debt = 1;
//! - applied late and given back: 1 - 1 + the debt = 1, in whichever order
//!   the give-back and the settle reach Redis (the give-back is a refund,
//!   which never takes a counter below zero, and the counter holds the
//!   late charge when the give-back comes);
//! - refused late (the settle, or other requests, had filled the counter):
//!   0 + the debt = 1.
//!
//! A settle needs no give-back: each carries an id ([`Debt::id`]), and one
//! whose answer the ledger never got (it failed, timed out, or its future
//! was dropped) is sent again as it was, under its id and with the same
//! units, until the store answers it; what the entry came to owe since goes
//! in the settle after it. The store adds the debt of one id once: the
//! Redis store leaves a mark per settle beside the counter, and adds
//! nothing when a settle finds its own mark, whether the first was applied
//! on time, late, or with its answer lost on the wire. (A store that cannot
//! tell gives back a settle applied after its caller stopped waiting, as a
//! charge.)
//!
//! # Known limits
//!
//! - **A charge lost on the wire counts twice if it was applied.** The
//!   above holds as far as the store learns what became of a charge. One
//!   may fail after it was sent with no answer ever to follow (the
//!   connection breaks before Redis answers), be applied more than the
//!   Redis store's follow-through (30 s) after it was sent, or be applied
//!   late with the connection failing before its give-back. If Redis
//!   applied it, it stays, and its request, owed as well, counts twice.
//!   Telling a charge applied from one never run would take a mark per
//!   charge in the store, a write on every request; settles, rare, have
//!   one (see above).
//! - **A first-use debt counts in the counter live when it is settled.** A
//!   first-use key names no period, so the store adds a debt to whatever
//!   counter lives at the key at the settle, which need not hold the period
//!   the requests fell in: a period opened after them (a charge made once
//!   the store answered, before the settle) takes their units; and where
//!   their own period was opened before the outage and has ended, the settle
//!   creates a counter with the debt's lifetime, a period from the debt's
//!   earliest request, which then counts the subject's calls until its
//!   deadline. Either way each unit counts once, and the bound holds: a debt
//!   is never settled at or past its deadline (one period after its earliest
//!   request), so the counter it lands in started before that deadline;
//!   at worst a subject finds the debt's units in the period after their
//!   own, or a period that starts at a request that did not open one.
//!   Calendar debts are exact: the window is in the key.
//! - **A request made at the very instant of a support reset is on either
//!   side of it.** The ledger tells requests made before a reset from
//!   those made after it by their instants: one made at the reset's own
//!   instant (two readings of the policy's clock alike to the nanosecond: a
//!   `ManualClock` standing still, or a coarse system clock) is forgotten
//!   if it is answered before the reset, and owed, in the fresh counter, if
//!   it is answered after it.
//!
//! # The bound
//!
//! A policy's ledger holds at most
//! [`max_owed_counters`](crate::QuotaPolicyBuilder::max_owed_counters)
//! counters (10 000 by default; an entry is a key and a few numbers, some
//! 250 bytes with the key and the map, so a few MB at the bound). A debt on a counter
//! the ledger owes already is added to it; a debt on a new counter past the
//! bound is dropped (after the debts of periods that are over are let go to
//! make room), logged a few times a second at most and counted in the
//! metrics: that admission goes uncounted. First-use debts of one key are
//! one entry per period: a request within the period of an entry's earliest
//! request joins it, and so does an earlier one whose own period holds every
//! request of the entry (the entry's period is then that one); any other
//! opens an entry of its own.
//!
//! # Settling
//!
//! The first debt starts a task on the tokio runtime (none runs while
//! nothing is owed) that settles the entries one by one, oldest first. An
//! entry the store fails to settle (a timeout, the store unreachable or
//! full) goes to the back of the line, and the others are tried: a key the
//! store keeps failing (a cluster node that is down, a new counter in a full
//! store) holds up no other. Once every entry owed has failed in a row, the
//! task waits before the next try, 100 ms then twice as long after each
//! such round, up to 5 s; a settle that goes through starts the waits
//! afresh. A debt whose period is over by the time it would be settled is
//! dropped, logged and counted: never added once its own window or
//! first-use deadline is past (a first-use debt may still land in a period
//! opened after its requests: see the known limits above). So is one the
//! store refuses (a key that holds no counter, a sum beyond what it counts
//! exactly). Units dropped so, or abandoned below, while a settle of theirs
//! that failed is unanswered may be in the counter all the same: that
//! settle may have landed (the metrics count them as dropped). The task
//! ends when nothing is owed, or when the policy is dropped: what the ledger
//! still owes then is lost with it, logged and counted as abandoned.
//!
//! The task runs on the runtime of the request that started it. If that
//! runtime stops being driven (a current-thread runtime kept for a call
//! that never comes), the task shows no sign of life, and after 30 s (on
//! the policy's clock) a request on another runtime starts one in its
//! place; the silent one ends at its next step, if it ever runs. Not while
//! a settle of the silent task is on its way: it may still land, and
//! settling its entry again could count it twice, so the ledger waits for
//! that answer (a store whose answers the idle runtime drives, as Redis's
//! are, leaves the ledger waiting until that runtime runs again or is
//! dropped).

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use jiff::Timestamp;
use smallvec::SmallVec;

use crate::key::PeriodKey;
use crate::period::Clock;
use crate::store::{Debt, Lifetime, Store, StoreError, StoreErrorKind};
use crate::throttle::Throttle;

/// The first wait after a settle failed.
const FIRST_RETRY: Duration = Duration::from_millis(100);

/// The longest wait between tries while the store fails.
const LAST_RETRY: Duration = Duration::from_secs(5);

/// The default bound of counters a policy's ledger owes at once.
pub(crate) const DEFAULT_MAX_OWED: usize = 10_000;

/// What a ledger reads of its policy's settings, which own them.
#[derive(Clone, Copy)]
pub(crate) struct Terms<'a> {
    /// The policy's clock.
    pub(crate) clock: &'a Arc<dyn Clock>,
    /// The most counters owed at once.
    pub(crate) max_owed: usize,
    /// How long a settle is waited for.
    pub(crate) store_timeout: Option<Duration>,
}

/// Debts dropped, and ledgers that cannot settle, logged a few times a
/// second at most: during an outage there may be one per request. Each
/// reason on a throttle of its own, so that a flood of one does not hide
/// another.
static FULL: Throttle = Throttle::new(5);
static ENDED: Throttle = Throttle::new(5);
static REFUSED: Throttle = Throttle::new(5);
static TOO_LARGE: Throttle = Throttle::new(5);
static ABANDONED: Throttle = Throttle::new(5);
static NO_RUNTIME: Throttle = Throttle::new(5);

/// What a policy's ledger owes its store: requests that passed on a failed
/// charge under [`OnStoreError::FailOpen`](crate::OnStoreError::FailOpen),
/// not counted yet. See [`QuotaPolicy::owed`](crate::QuotaPolicy::owed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Owed {
    /// Counters owed (per key, and per period of a first-use key).
    pub counters: usize,
    /// Units owed, over every counter.
    pub units: u64,
    /// Of `units`, those of settles the store may have added without
    /// answering (one on its way, or one that timed out or lost its
    /// connection; not one the store says it never sent): sent again under
    /// their id, they count once. A process that exits owing leaves at
    /// least `units - unanswered` uncounted, and at most `units`.
    pub unanswered: u64,
}

/// A policy's ledger. Its bound is the policy's setting (`max_owed`).
pub(crate) struct Ledger {
    book: Mutex<Book>,
    /// Set while the ledger owes and no task settles it, because the last
    /// one could not start (no tokio runtime) or ended without finishing
    /// (its runtime shut down): the next request of the policy starts one
    /// (see [`Ledger::wake`]), not only the next debt.
    stranded: AtomicBool,
    /// The settling task's last sign of life, in seconds on the policy's
    /// clock ([`IDLE`] while none settles): a task whose runtime went idle
    /// or is blocked (a current-thread runtime made for one call and kept)
    /// shows none, and a request on a runtime starts another in its place
    /// (see [`Ledger::wake`]).
    beat: AtomicI64,
}

impl Default for Ledger {
    fn default() -> Self {
        Self {
            book: Mutex::new(Book {
                next_settle: random_u64(),
                ..Book::default()
            }),
            stranded: AtomicBool::new(false),
            beat: AtomicI64::new(IDLE),
        }
    }
}

/// `Ledger::beat` while no task settles the ledger.
const IDLE: i64 = i64::MIN;

/// How long, on the policy's clock, a settling task may show no sign of
/// life (it shows one at each try, and every [`PAUSE_STEP`] while it waits)
/// with no settle of its on the way, before a request starts another in
/// its place: far beyond its longest wait, [`LAST_RETRY`].
const SILENT_SECS: i64 = 30;

/// What the ledger owes, and whether a task settles it.
#[derive(Default)]
struct Book {
    /// The entries of each key: one for a calendar key (its window is in the
    /// key), one per period for a first-use key.
    owed: HashMap<PeriodKey, SmallVec<[Entry; 1]>>,
    /// Every entry, by key and id, in the order the settling task takes
    /// them (the order they were opened, but for those the store failed to
    /// settle, which went to the back): one item per entry, so its length is
    /// the number of counters owed.
    queue: VecDeque<(PeriodKey, u64)>,
    units: u64,
    next_id: u64,
    /// The id of the next settle ([`Debt::id`]): from a random start, so
    /// that the settles of the instances sharing a store never share one.
    next_settle: u64,
    /// The earliest end of an entry's period (or earlier), the entry being
    /// settled left out: no other entry is over before it.
    earliest_end: Option<Timestamp>,
    /// Whether a task settles the ledger.
    settling: bool,
    /// The number of the task that settles it (or last did): one that was
    /// taken over (see [`Ledger::start`]) ends at its next step, and leaves
    /// the book to the task that took over.
    task: u64,
    /// Whether someone waits for the ledger to be settled
    /// ([`QuotaPolicy::settle_owed`](crate::QuotaPolicy::settle_owed)): the
    /// task then tries again soon while the store fails, not after its
    /// growing waits.
    hurry: u32,
    /// The entry the task is settling: kept while the store answers.
    in_flight: Option<InFlight>,
    /// The keys whose counters support is resetting, each with the
    /// instants the resets on their way were sent at: their entries are not
    /// settled meanwhile (see [`Ledger::hold`]), and a debt of a request
    /// made after such an instant never joins an entry of requests made
    /// before it (the reset forgets the one, not the other).
    held: HashMap<PeriodKey, SmallVec<[Timestamp; 1]>>,
    /// The instant of each key's last support reset, kept a day (resets
    /// are rare): a request made before it and answered after it owes
    /// nothing, as the reset forgot what requests made before it owed.
    resets: HashMap<PeriodKey, Timestamp>,
}

/// How long the ledger remembers a support reset, for requests made before
/// it that are answered after it.
const RESET_MEMORY: jiff::SignedDuration = jiff::SignedDuration::from_hours(24);

/// What the settling task does next.
enum Next {
    /// Settle entry `id` of the key, this debt.
    Settle(PeriodKey, u64, Debt),
    /// Every entry owed is of a counter support is resetting: wait.
    Held,
    /// Nothing is owed: the task ends.
    Done,
}

#[cfg(test)]
impl Next {
    /// The entry to settle, if there is one to settle now.
    fn settle(self) -> Option<(PeriodKey, u64, Debt)> {
        match self {
            Next::Settle(key, id, debt) => Some((key, id, debt)),
            Next::Held | Next::Done => None,
        }
    }
}

/// The entry being settled, and the units its settle carries.
#[derive(Clone)]
struct InFlight {
    key: PeriodKey,
    id: u64,
    amount: u64,
    /// What support's reset of the counter forgot of the entry while its
    /// settle was on its way: dropped if the settle fails, rather than
    /// sent again into the fresh counter.
    forgotten: u64,
}

impl InFlight {
    fn is(&self, key: &PeriodKey, id: u64) -> bool {
        self.key == *key && self.id == id
    }
}

/// A support reset's hold on the settles of one key (see
/// [`Ledger::hold`]).
pub(crate) struct Hold {
    ledger: Arc<Ledger>,
    key: PeriodKey,
    /// The instant the reset was sent at.
    at: Timestamp,
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut book = self.ledger.lock();
        if let Some(holds) = book.held.get_mut(&self.key) {
            if let Some(i) = holds.iter().position(|at| *at == self.at) {
                holds.remove(i);
            }
            if holds.is_empty() {
                book.held.remove(&self.key);
            }
        }
    }
}

/// What requests owe one counter in one period.
#[derive(Clone, Copy, Debug)]
struct Entry {
    id: u64,
    lifetime: Lifetime,
    /// The earliest of the requests.
    since: Timestamp,
    /// The latest of the requests: every request of the entry is within
    /// its period, which starts at `since`.
    latest: Timestamp,
    amount: u64,
    /// The settle of the entry the store may have applied without an
    /// answer (it failed, or its future was dropped): sent again as it
    /// was, under its id, until the store answers it; what joined the
    /// entry since waits for the settle after it.
    sent: Option<Sent>,
}

/// A settle sent: its id ([`Debt::id`]) and the units it carries.
#[derive(Clone, Copy, Debug)]
struct Sent {
    id: u64,
    amount: u64,
    /// Whether the store may have applied it: a send of it failed after it
    /// left (a timeout, a lost connection) or was dropped on its way (not
    /// one that failed unsent).
    unanswered: bool,
}

impl Entry {
    /// Whether `debt` (of the same key) counts in this entry's period.
    fn covers(&self, debt: &Debt) -> bool {
        match (self.lifetime, debt.lifetime) {
            // The window is in the key: one entry per key.
            (Lifetime::Calendar { .. }, Lifetime::Calendar { .. }) => true,
            // A later request joins within the entry's period; an earlier
            // one opens a period of its own, which it shares only if that
            // period holds every request of the entry.
            (Lifetime::FirstUse { deadline }, Lifetime::FirstUse { deadline: other }) => {
                if self.since <= debt.since {
                    debt.since < deadline
                } else {
                    self.latest < other
                }
            }
            _ => false,
        }
    }

    /// Adds `debt`, which it covers; its period is the earlier request's.
    fn join(&mut self, debt: &Debt) {
        if debt.since < self.since {
            self.since = debt.since;
            self.lifetime = debt.lifetime;
        }
        self.latest = self.latest.max(debt.since);
        self.amount = self.amount.saturating_add(debt.amount);
    }
}

/// The ledgers of the live policies on each store with an identity
/// ([`Store::identity`]): policies that share a quota share its counters,
/// and a support reset through one policy's handle forgets what any of
/// them owes the counter.
static ON_STORE: Mutex<Vec<(usize, Weak<Ledger>)>> = Mutex::new(Vec::new());

impl Ledger {
    /// A policy's ledger on the store with identity `store`: known to the
    /// other policies' on the same store (see [`Ledger::sharing`]).
    pub(crate) fn on_store(store: Option<usize>) -> Arc<Self> {
        let ledger = Arc::new(Self::default());
        if let Some(store) = store {
            let mut all = ON_STORE.lock().unwrap_or_else(|e| e.into_inner());
            all.retain(|(_, other)| other.strong_count() > 0);
            all.push((store, Arc::downgrade(&ledger)));
        }
        ledger
    }

    /// This ledger, and those of the other live policies on its store: what
    /// a support reset of a counter forgets, whichever of them owes it.
    pub(crate) fn sharing(self: &Arc<Self>) -> Vec<Arc<Ledger>> {
        let mut ledgers = vec![Arc::clone(self)];
        let all = ON_STORE.lock().unwrap_or_else(|e| e.into_inner());
        let mine = Arc::downgrade(self);
        let Some(store) = all
            .iter()
            .find(|(_, ledger)| ledger.ptr_eq(&mine))
            .map(|(store, _)| *store)
        else {
            return ledgers;
        };
        ledgers.extend(
            all.iter()
                .filter(|(at, ledger)| *at == store && !ledger.ptr_eq(&mine))
                .filter_map(|(_, ledger)| ledger.upgrade()),
        );
        ledgers
    }

    fn lock(&self) -> MutexGuard<'_, Book> {
        // Every change to the book is made whole before anything can panic.
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Settles what the ledger owes in `store` now, trying again soon while
    /// the store fails, and waits `within` at most until nothing is owed;
    /// what is owed then.
    pub(crate) async fn settle_now<St: Store>(
        self: &Arc<Self>,
        store: &St,
        terms: Terms<'_>,
        within: Duration,
    ) -> Owed {
        /// The hurry taken back however the wait ends (its future dropped
        /// included).
        struct Hurry<'a>(&'a Ledger);
        impl Drop for Hurry<'_> {
            fn drop(&mut self) {
                self.0.lock().hurry -= 1;
            }
        }
        if tokio::runtime::Handle::try_current().is_err() {
            // Nothing settles without a runtime.
            return self.owed();
        }
        self.lock().hurry += 1;
        let _hurry = Hurry(self);
        // `None`: a wait past any instant the clock holds, no limit.
        let deadline = tokio::time::Instant::now().checked_add(within);
        loop {
            // The counters alone while waiting: `owed` reads every entry.
            let counters = self.lock().queue.len();
            if counters == 0 || deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
                return self.owed();
            }
            // Started again if its task ended (its runtime stopped).
            self.start(store, terms);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Forgets what is owed to the counters at `key`, which support reset
    /// with a call sent at `at`: the caller starts afresh, and requests
    /// made before the reset (at `at` or before) count no more than those
    /// the store counted, whether they were answered before it or are
    /// answered after it. Requests made after `at`, while the reset was on
    /// its way, stay owed: the store may run their charges after the
    /// reset. A settle on its way lands, before or after the reset, as the
    /// store runs them; if it fails, what it carried is forgotten then.
    /// So does one that failed before the reset, if it is still on the
    /// wire: it is not given back (see the module's docs), and lands in
    /// the fresh counter if Redis runs it after the reset.
    pub(crate) fn forget(&self, key: &PeriodKey, at: Timestamp) {
        let mut book = self.lock();
        let kept_since = at.saturating_sub(RESET_MEMORY).unwrap_or(at);
        book.resets.retain(|_, reset| *reset >= kept_since);
        let last = book.resets.entry(key.clone()).or_insert(at);
        *last = (*last).max(at);
        let entries: Vec<(u64, u64)> = book
            .owed
            .get(key)
            .into_iter()
            .flatten()
            // An entry of requests made after the reset was sent (none
            // joins one of before it while the reset is on its way) stays.
            .filter(|entry| entry.since <= at)
            .map(|entry| (entry.id, entry.amount))
            .collect();
        let mut units = 0u64;
        for (id, amount) in entries {
            match &mut book.in_flight {
                Some(sent) if sent.is(key, id) => sent.forgotten = amount,
                _ => units = units.saturating_add(book.take_off(key, id, amount)),
            }
        }
        drop(book);
        forgotten(key, units);
    }

    /// Holds back the settles of what is owed to the counters at `key`
    /// while support resets them, until the guard is dropped: a settle that
    /// started meanwhile could land in the fresh counter. The reset then
    /// [forgets](Ledger::forget) what is owed, unless the store never got
    /// it: then the debts are settled as before.
    pub(crate) fn hold(self: &Arc<Self>, key: &PeriodKey, at: Timestamp) -> Hold {
        self.lock().held.entry(key.clone()).or_default().push(at);
        Hold {
            ledger: Arc::clone(self),
            key: key.clone(),
            at,
        }
    }

    /// What the ledger owes now.
    pub(crate) fn owed(&self) -> Owed {
        let book = self.lock();
        Owed {
            counters: book.queue.len(),
            units: book.units,
            unanswered: book.unanswered(),
        }
    }

    /// Records `debts` at the policy's now within its bound (`terms`, of a
    /// policy whose ledger is on: a request owes only then), and starts a task on
    /// the tokio runtime that settles them in `store` (each settle waited
    /// for the policy's `store_timeout` at most), unless one runs already.
    pub(crate) fn owe<St: Store>(
        self: &Arc<Self>,
        store: &St,
        terms: Terms<'_>,
        debts: impl IntoIterator<Item = Debt>,
    ) {
        let max = terms.max_owed;
        let most = store.max_count();
        let now = terms.clock.now();
        let mut book = self.lock();
        let mut forgot = Vec::new();
        for mut debt in debts {
            if debt.amount == 0 {
                continue;
            }
            if book
                .resets
                .get(&debt.key)
                .is_some_and(|reset| debt.since < *reset)
            {
                // Made before a support reset of its counter, answered
                // after it: forgotten, as the reset forgot what was owed.
                crate::metrics::ledger_owed(debt.amount);
                forgot.push((debt.key, debt.amount));
                continue;
            }
            if debt.amount > most {
                // More than the store counts: it would refuse the whole
                // settle. What it can hold is owed; the rest goes uncounted,
                // owed and dropped at once (so that owed is what was
                // settled and dropped).
                crate::metrics::ledger_owed(debt.amount - most);
                crate::metrics::ledger_dropped(
                    crate::metrics::dropped::REFUSED,
                    debt.amount - most,
                );
                if let Some(suppressed) = TOO_LARGE.admit() {
                    tracing::warn!(
                        amount = debt.amount,
                        most,
                        suppressed,
                        "a request that passed on a failed charge (fail open) owes more than \
                         the store counts: the rest goes uncounted"
                    );
                }
                debt.amount = most;
            }
            let amount = debt.amount;
            if book.record_within(debt, now, max, most) {
                crate::metrics::ledger_owed(amount);
            } else {
                crate::metrics::ledger_dropped(crate::metrics::dropped::FULL, amount);
                if let Some(suppressed) = FULL.admit() {
                    tracing::warn!(
                        amount,
                        max_owed_counters = max,
                        suppressed,
                        "quota ledger owes its maximum of counters: a request that passed on a \
                         failed charge (fail open) goes uncounted"
                    );
                }
            }
        }
        drop(book);
        for (key, units) in forgot {
            forgotten(&key, units);
        }
        self.start(store, terms);
    }

    /// Starts a task on the tokio runtime that settles what the ledger
    /// owes in `store`, unless one runs already or nothing is owed.
    pub(crate) fn start<St: Store>(self: &Arc<Self>, store: &St, terms: Terms<'_>) {
        let mut book = self.lock();
        let now = terms.clock.now();
        // Nothing owed (a reset forgot it), or a task settles it; unless
        // that task has shown no sign of life for a while, with no settle
        // of its on the way: its runtime went idle or is blocked, and this
        // one takes over (that one ends at its next step, if it ever runs).
        if book.queue.is_empty()
            || (book.settling && (book.in_flight.is_some() || !self.silent(now)))
        {
            if !book.settling {
                // No task to watch (a beat left by one taken over).
                self.beat.store(IDLE, Ordering::Relaxed);
            } else if book.in_flight.is_some() {
                // A silent task's settle on its way is waited for: looked
                // at again after another while, not on every request.
                self.beat(now);
            }
            self.stranded.store(false, Ordering::Relaxed);
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.stranded.store(true, Ordering::Relaxed);
            if let Some(suppressed) = NO_RUNTIME.admit() {
                tracing::warn!(
                    suppressed,
                    "quota ledger cannot settle what it owes: no tokio runtime here; it tries \
                     again with the policy's next request on one"
                );
            }
            return;
        };
        book.settling = true;
        book.task = book.task.wrapping_add(1);
        let task = book.task;
        self.beat(now);
        self.stranded.store(false, Ordering::Relaxed);
        drop(book);
        let guard = Settling {
            ledger: Some(Arc::downgrade(self)),
            sent: None,
            task,
        };
        let (clock, timeout) = (Arc::clone(terms.clock), terms.store_timeout);
        drop(runtime.spawn(settle(guard, store.clone(), clock, timeout)));
    }

    /// Starts the settling task if the ledger owes and none runs since the
    /// last one could not start or ended unfinished, or shows no sign of
    /// life (its runtime went idle or is blocked): called on every request
    /// of the policy, so that debts settle once a runtime serves requests
    /// again, though no new debt is recorded (the store is back).
    #[inline]
    pub(crate) fn wake<St: Store>(self: &Arc<Self>, store: &St, terms: Terms<'_>) {
        if self.stranded.load(Ordering::Relaxed)
            || (self.beat.load(Ordering::Relaxed) != IDLE && self.silent(terms.clock.now()))
        {
            self.start(store, terms);
        }
    }

    /// The settling task shows a sign of life at `now`.
    fn beat(&self, now: Timestamp) {
        self.beat.store(now.as_second(), Ordering::Relaxed);
    }

    /// Whether a settling task has shown no sign of life for
    /// [`SILENT_SECS`] at `now`.
    fn silent(&self, now: Timestamp) -> bool {
        let beat = self.beat.load(Ordering::Relaxed);
        beat != IDLE && now.as_second().saturating_sub(beat) >= SILENT_SECS
    }
}

/// What a ledger still owes when its policy is dropped goes uncounted:
/// logged, and counted as abandoned (but for a settle on its way, which its
/// task accounts for once the store answers).
impl Drop for Ledger {
    fn drop(&mut self) {
        let book = self.book.get_mut().unwrap_or_else(|e| e.into_inner());
        let counters = book.queue.len();
        if counters == 0 {
            return;
        }
        crate::metrics::ledger_counters(-(counters as i64));
        let sent = book.in_flight.as_ref().map_or(0, |sent| sent.amount);
        let units = book.units.saturating_sub(sent);
        if units > 0 {
            abandoned(units, counters);
        }
    }
}

impl Book {
    /// [`record_within`](Self::record_within) a store that counts any sum.
    #[cfg(test)]
    fn record(&mut self, debt: Debt, now: Timestamp, max: usize) -> bool {
        self.record_within(debt, now, max, u64::MAX)
    }

    /// Adds `debt` recorded at `now` to its entry, or opens one within the
    /// bound `max`; `false` when there is no room. For a store that counts
    /// up to `most`, an entry never grows past it (the store would refuse
    /// its settle whole): a debt that would take it there opens an entry of
    /// its own.
    fn record_within(&mut self, debt: Debt, now: Timestamp, max: usize, most: u64) -> bool {
        // The instants resets of the key on their way were sent at: a debt
        // joins only an entry on its side of each (see `Ledger::forget`).
        let resets = self.held.get(&debt.key);
        let same_side = |e: &Entry| {
            resets.into_iter().flatten().all(|at| {
                let before = debt.since <= *at;
                (e.since <= *at) == before && (e.latest <= *at) == before
            })
        };
        if let Some(entry) = self.owed.get_mut(&debt.key).and_then(|entries| {
            entries.iter_mut().find(|e| {
                e.covers(&debt)
                    && same_side(e)
                    && e.amount
                        .checked_add(debt.amount)
                        .is_some_and(|sum| sum <= most)
            })
        }) {
            entry.join(&debt);
            // An earlier request may have brought the entry's end forward.
            let (id, end) = (entry.id, entry.lifetime.end());
            let busy = self
                .in_flight
                .as_ref()
                .is_some_and(|sent| sent.is(&debt.key, id));
            if !busy {
                self.earliest(end);
            }
            self.units = self.units.saturating_add(debt.amount);
            return true;
        }
        if self.queue.len() >= max {
            self.let_go_of_ended(now);
            if self.queue.len() >= max {
                return false;
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.earliest(debt.lifetime.end());
        self.queue.push_back((debt.key.clone(), id));
        self.owed.entry(debt.key).or_default().push(Entry {
            id,
            lifetime: debt.lifetime,
            since: debt.since,
            latest: debt.since,
            amount: debt.amount,
            sent: None,
        });
        self.units = self.units.saturating_add(debt.amount);
        crate::metrics::ledger_counters(1);
        true
    }

    /// Counts `end`, an entry's, in the earliest end.
    fn earliest(&mut self, end: Timestamp) {
        self.earliest_end = Some(self.earliest_end.map_or(end, |e| e.min(end)));
    }

    /// Drops every entry whose period is over at `now` (but the one being
    /// settled, which the earliest end leaves out: at the bound, a debt on a
    /// new counter does not go through the book again for it), when there
    /// can be one.
    fn let_go_of_ended(&mut self, now: Timestamp) {
        if self.earliest_end.is_none_or(|end| end > now) {
            return;
        }
        let mut dropped = 0u64;
        let mut earliest: Option<Timestamp> = None;
        let mut removed = 0usize;
        let in_flight = self.in_flight.clone();
        self.owed.retain(|key, entries| {
            entries.retain(|entry| {
                let busy = in_flight
                    .as_ref()
                    .is_some_and(|sent| sent.is(key, entry.id));
                if busy {
                    return true;
                }
                let end = entry.lifetime.end();
                if end <= now {
                    dropped = dropped.saturating_add(entry.amount);
                    removed += 1;
                    return false;
                }
                earliest = Some(earliest.map_or(end, |e| e.min(end)));
                true
            });
            !entries.is_empty()
        });
        self.earliest_end = earliest;
        if removed == 0 {
            return;
        }
        let owed = &self.owed;
        self.queue.retain(|(key, id)| {
            owed.get(key)
                .is_some_and(|entries| entries.iter().any(|e| e.id == *id))
        });
        self.units = self.units.saturating_sub(dropped);
        crate::metrics::ledger_counters(-(removed as i64));
        ended(dropped, removed);
    }

    /// The entry `id` of `key`.
    fn entry(&mut self, key: &PeriodKey, id: u64) -> Option<&mut Entry> {
        self.owed.get_mut(key)?.iter_mut().find(|e| e.id == id)
    }

    /// The next debt to settle at `now`: the oldest entry of a counter
    /// support is not resetting, once the entries before it whose period is
    /// over are dropped. With none, the task waits while entries of
    /// counters being reset remain ([`Next::Held`]), and ends when nothing
    /// is owed.
    fn next(&mut self, now: Timestamp) -> Next {
        loop {
            // The oldest entry of a counter support is not resetting.
            let free = if self.held.is_empty() {
                self.queue.front()
            } else {
                self.queue
                    .iter()
                    .find(|(key, _)| !self.held.contains_key(key))
            };
            let Some((key, id)) = free.cloned() else {
                if self.queue.is_empty() {
                    self.settling = false;
                    return Next::Done;
                }
                return Next::Held;
            };
            let entry = *self
                .entry(&key, id)
                .expect("the queue and the book hold the same entries");
            if entry.lifetime.end() <= now {
                self.remove(&key, id);
                self.units = self.units.saturating_sub(entry.amount);
                ended(entry.amount, 1);
                continue;
            }
            // The settle the store may have applied goes again as it was;
            // otherwise a new one carries all the entry owes.
            let sent = entry.sent.unwrap_or_else(|| {
                let sent = Sent {
                    id: self.next_settle,
                    amount: entry.amount,
                    unanswered: false,
                };
                self.next_settle = self.next_settle.wrapping_add(1);
                sent
            });
            if let Some(entry) = self.entry(&key, id) {
                entry.sent = Some(sent);
            }
            self.in_flight = Some(InFlight {
                key: key.clone(),
                id,
                amount: sent.amount,
                forgotten: 0,
            });
            let debt = Debt {
                key: key.clone(),
                amount: sent.amount,
                lifetime: entry.lifetime,
                since: entry.since,
                id: sent.id,
            };
            return Next::Settle(key, id, debt);
        }
    }

    /// The store failed to settle entry `id` of `key`: it goes to the back
    /// of the queue, so that the others are tried before it again. How many
    /// entries are owed that the task may try now.
    fn postpone(&mut self, key: &PeriodKey, id: u64, unsent: bool) -> usize {
        self.unsettled(!unsent);
        if let Some(at) = self.queue.iter().position(|(k, i)| k == key && *i == id) {
            let entry = self.queue.remove(at).expect("found in the queue");
            self.queue.push_back(entry);
        }
        // Those of counters support is resetting wait: not tried now.
        self.queue
            .iter()
            .filter(|(key, _)| !self.held.contains_key(key))
            .count()
    }

    /// `amount` of entry `id` of `key` is settled (or dropped): what was
    /// added to it meanwhile stays owed, unless a support reset forgot it
    /// meanwhile too.
    fn paid(&mut self, key: &PeriodKey, id: u64, amount: u64) {
        let forgot = self
            .in_flight
            .as_ref()
            .filter(|sent| sent.is(key, id))
            .map_or(0, |sent| sent.forgotten);
        if let Some(entry) = self.entry(key, id) {
            entry.sent = None;
        }
        self.take_off(key, id, amount);
        if forgot > amount {
            // What joined the entry before the reset, beyond what this
            // settle carried.
            let dropped = self.take_off(key, id, forgot - amount);
            forgotten(key, dropped);
        }
        self.release();
    }

    /// Takes up to `amount` off entry `id` of `key`, removed once nothing
    /// is left of it: what was taken.
    fn take_off(&mut self, key: &PeriodKey, id: u64, amount: u64) -> u64 {
        let Some(entry) = self.entry(key, id) else {
            return 0;
        };
        let taken = amount.min(entry.amount);
        entry.amount -= taken;
        let left = entry.amount;
        self.units = self.units.saturating_sub(taken);
        if left == 0 {
            self.remove(key, id);
        }
        taken
    }

    /// The settle on its way failed, or was dropped before it answered
    /// (`left`: after it may have reached the store): its entry is back
    /// among the others, to be sent again as it was (see [`Entry::sent`]),
    /// less what support's reset of the counter forgot meanwhile, which is
    /// not sent again into the fresh counter (what was owed since stays,
    /// for a settle of its own).
    fn unsettled(&mut self, left: bool) {
        if let Some(InFlight {
            key,
            id,
            forgotten: forgot,
            ..
        }) = self.in_flight.clone()
        {
            if left {
                if let Some(sent) = self.entry(&key, id).and_then(|e| e.sent.as_mut()) {
                    sent.unanswered = true;
                }
            }
            if forgot > 0 {
                if let Some(entry) = self.entry(&key, id) {
                    entry.sent = None;
                }
                let dropped = self.take_off(&key, id, forgot);
                forgotten(&key, dropped);
            }
        }
        self.release();
    }

    /// The entry being settled is back among the others, if it is still
    /// owed: its end counts in the earliest end again.
    fn release(&mut self) {
        let Some(InFlight { key, id, .. }) = self.in_flight.take() else {
            return;
        };
        if let Some(end) = self.entry(&key, id).map(|e| e.lifetime.end()) {
            self.earliest(end);
        }
    }

    /// The units of the settles the store may have applied without an
    /// answer: those that failed after they left, and the one on its way.
    fn unanswered(&self) -> u64 {
        self.owed
            .iter()
            .flat_map(|(key, entries)| entries.iter().map(move |entry| (key, entry)))
            .filter_map(|(key, entry)| {
                let sent = entry.sent?;
                let on_its_way = self
                    .in_flight
                    .as_ref()
                    .is_some_and(|flight| flight.is(key, entry.id));
                (sent.unanswered || on_its_way).then_some(sent.amount.min(entry.amount))
            })
            .fold(0, u64::saturating_add)
    }

    /// Removes entry `id` of `key`.
    fn remove(&mut self, key: &PeriodKey, id: u64) {
        let Some(entries) = self.owed.get_mut(key) else {
            return;
        };
        let before = entries.len();
        entries.retain(|e| e.id != id);
        if entries.len() == before {
            return;
        }
        if entries.is_empty() {
            self.owed.remove(key);
        }
        if self
            .queue
            .front()
            .is_some_and(|(k, front)| k == key && *front == id)
        {
            self.queue.pop_front();
        } else {
            self.queue.retain(|(k, i)| !(k == key && *i == id));
        }
        crate::metrics::ledger_counters(-1);
    }
}

/// Logs and counts `units` owed to the counters at `key`, which support
/// reset before the store took them.
fn forgotten(key: &PeriodKey, units: u64) {
    if units == 0 {
        return;
    }
    crate::metrics::ledger_dropped(crate::metrics::dropped::RESET, units);
    tracing::info!(
        units,
        key = key.logged(),
        "quota ledger forgets what requests that passed on a failed charge (fail open) owed to \
         a counter support reset"
    );
}

/// Logs and counts `units` owed on `counters` counters whose periods were
/// over before the store answered.
fn ended(units: u64, counters: usize) {
    crate::metrics::ledger_dropped(crate::metrics::dropped::ENDED, units);
    if let Some(suppressed) = ENDED.admit() {
        tracing::warn!(
            units,
            counters,
            suppressed,
            "quota ledger drops what requests that passed on a failed charge (fail open) owe to \
             periods that were over before the store answered again: they go uncounted"
        );
    }
}

/// Logs and counts `units` owed on `counters` counters by a ledger dropped
/// with its policy.
fn abandoned(units: u64, counters: usize) {
    crate::metrics::ledger_dropped(crate::metrics::dropped::ABANDONED, units);
    if let Some(suppressed) = ABANDONED.admit() {
        tracing::warn!(
            units,
            counters,
            suppressed,
            "quota ledger dropped with its policy: what requests that passed on a failed charge \
             (fail open) still owed goes uncounted"
        );
    }
}

/// The settling task's claim on the ledger: if the task ends without
/// saying so (its runtime shut down), the policy's next request starts
/// another.
struct Settling {
    ledger: Option<Weak<Ledger>>,
    /// The units of the settle on its way: the task's to account for if
    /// the ledger is dropped meanwhile (abandoned, if the task ends first).
    sent: Option<u64>,
    /// The task's number (`Book::task`).
    task: u64,
}

impl Settling {
    fn ledger(&self) -> Option<Arc<Ledger>> {
        self.ledger.as_ref().and_then(Weak::upgrade)
    }

    /// The task ended having found nothing owed (`Book::next` cleared the
    /// flag).
    fn done(mut self) {
        self.ledger = None;
    }
}

impl Drop for Settling {
    fn drop(&mut self) {
        match self.ledger() {
            Some(ledger) => {
                let mut book = ledger.lock();
                if book.task != self.task {
                    // Taken over: the book is the other task's.
                    return;
                }
                book.settling = false;
                ledger.beat.store(IDLE, Ordering::Relaxed);
                // A settle dropped on its way is one that failed.
                book.unsettled(true);
                if !book.queue.is_empty() {
                    ledger.stranded.store(true, Ordering::Relaxed);
                }
            }
            None => {
                if let Some(units) = self.sent.take() {
                    abandoned(units, 1);
                }
            }
        }
    }
}

/// Settles what the ledger owes in `store`, entry by entry, until nothing
/// is owed; waits between tries while the store fails.
async fn settle<St: Store>(
    mut claim: Settling,
    store: St,
    clock: Arc<dyn Clock>,
    timeout: Option<Duration>,
) {
    let mut wait = FIRST_RETRY;
    let (mut units, mut counters) = (0u64, 0usize);
    // Entries the store failed to settle in a row: once each entry owed has
    // failed, the store is taken to fail for all, and the task waits.
    let mut failures = 0usize;
    loop {
        let Some(ledger) = claim.ledger() else {
            return;
        };
        let now = clock.now();
        let next = {
            let mut book = ledger.lock();
            if book.task != claim.task {
                // Taken over while its runtime was idle: the other settles.
                return;
            }
            let next = book.next(now);
            match next {
                Next::Done => ledger.beat.store(IDLE, Ordering::Relaxed),
                _ => ledger.beat(now),
            }
            next
        };
        drop(ledger);
        let (key, id, debt) = match next {
            Next::Settle(key, id, debt) => (key, id, debt),
            Next::Held => {
                // A support reset takes one call of the store.
                pause(&claim, &*clock, FIRST_RETRY).await;
                continue;
            }
            Next::Done => {
                claim.done();
                if units > 0 {
                    tracing::info!(
                        units,
                        counters,
                        "quota ledger settled what requests that passed on a failed charge \
                         (fail open) owed"
                    );
                }
                return;
            }
        };
        let amount = debt.amount;
        claim.sent = Some(amount);
        let result = caught(|| within(timeout, store.settle_debt(now, debt))).await;
        // A failure worth another try (a timeout, the store unreachable or
        // full, or a call the store never sent, whatever its kind) leaves
        // the entry owed, behind the others; any other answer settles it or
        // drops it.
        let failed = matches!(&result, Err(error) if error.kind() != StoreErrorKind::Other || error.is_unsent());
        let ledger = claim.ledger();
        // Accounted for below, whatever became of the ledger.
        claim.sent = None;
        // Decided under the lock, which is let go before any wait.
        let owed = ledger.as_ref().map_or(0, |ledger| {
            let mut book = ledger.lock();
            if failed {
                book.postpone(&key, id, result.as_ref().is_err_and(StoreError::is_unsent))
            } else {
                book.paid(&key, id, amount);
                0
            }
        });
        // The policy was dropped while the store answered: its ledger
        // counted what it owed as abandoned, but for this settle.
        let gone = ledger.is_none();
        drop(ledger);
        if !failed {
            failures = 0;
        }
        match result {
            Ok(Some(_)) => {
                crate::metrics::ledger_settled(amount);
                units = units.saturating_add(amount);
                counters += 1;
                wait = FIRST_RETRY;
            }
            Ok(None) => ended(amount, 1),
            Err(error) if !failed => {
                crate::metrics::ledger_dropped(crate::metrics::dropped::REFUSED, amount);
                // The store's message may name the key, and with it the
                // subject's id.
                let error =
                    crate::key::scrubbed(&error.to_string().replace(key.as_str(), "the counter"));
                if let Some(suppressed) = REFUSED.admit() {
                    tracing::warn!(
                        amount,
                        error,
                        suppressed,
                        "quota store refused a debt of requests that passed on a failed charge \
                         (fail open): they go uncounted"
                    );
                }
            }
            Err(_) if gone => abandoned(amount, 1),
            Err(error) => {
                failures += 1;
                if failures < owed {
                    // Another entry may settle (another key, another node of
                    // a cluster): tried at once, after letting other tasks
                    // run.
                    tokio::task::yield_now().await;
                    continue;
                }
                let error =
                    crate::key::scrubbed(&error.to_string().replace(key.as_str(), "the counter"));
                tracing::debug!(
                    error,
                    counters = owed,
                    retry_in = ?wait,
                    "quota ledger could not settle any counter it owes; the store still fails"
                );
                failures = 0;
                pause(&claim, &*clock, wait).await;
                wait = (wait * 2).min(LAST_RETRY);
            }
        }
        if gone {
            return;
        }
    }
}

/// The answer of the future `settling` makes, or an error if making or
/// polling it panics (a store of the application's own with a bug): the
/// debt is then dropped as one the store refuses, and the task goes on
/// with the others, where a task that panicked would leave them to wait.
async fn caught<F>(settling: impl FnOnce() -> F) -> Result<Option<u64>, StoreError>
where
    F: Future<Output = Result<Option<u64>, StoreError>>,
{
    use std::panic::{catch_unwind, AssertUnwindSafe};
    let panicked = || {
        Err(StoreError::new(
            StoreErrorKind::Other,
            "the quota store panicked while settling a debt",
        ))
    };
    let Ok(future) = catch_unwind(AssertUnwindSafe(settling)) else {
        return panicked();
    };
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(|cx| {
        catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx)))
            .unwrap_or_else(|_| std::task::Poll::Ready(panicked()))
    })
    .await
}

/// Waits `wait` before the settling task tries again, or [`FIRST_RETRY`]
/// at most while someone waits for the ledger to be settled.
async fn pause(claim: &Settling, clock: &dyn Clock, wait: Duration) {
    let start = tokio::time::Instant::now();
    loop {
        let Some(ledger) = claim.ledger() else {
            // The policy is gone: nothing to try again.
            return;
        };
        let hurry = {
            let book = ledger.lock();
            if book.task != claim.task {
                // Taken over: this task ends, and leaves the beat alone.
                return;
            }
            // Under the lock, as every beat: a task that ended since
            // (`IDLE`) is never made to look alive.
            ledger.beat(clock.now());
            book.hurry > 0
        };
        drop(ledger);
        let wait = if hurry { wait.min(FIRST_RETRY) } else { wait };
        let left = wait.saturating_sub(start.elapsed());
        if left.is_zero() {
            return;
        }
        tokio::time::sleep(left.min(PAUSE_STEP)).await;
    }
}

/// How often a settling task waiting to try again looks whether someone
/// waits for the ledger to be settled.
const PAUSE_STEP: Duration = Duration::from_millis(20);

/// `settle`, answered within `timeout`: the timer is armed only for a
/// store that does not answer at once (as the layer's charge).
async fn within<F>(timeout: Option<Duration>, settle: F) -> Result<Option<u64>, StoreError>
where
    F: Future<Output = Result<Option<u64>, StoreError>>,
{
    let mut settle = std::pin::pin!(settle);
    let first = std::future::poll_fn(|cx| std::task::Poll::Ready(settle.as_mut().poll(cx))).await;
    if let std::task::Poll::Ready(answer) = first {
        return answer;
    }
    let Some(limit) = timeout else {
        return settle.await;
    };
    tokio::time::timeout(limit, settle)
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::new(
                StoreErrorKind::Timeout,
                "the quota store did not answer in time",
            ))
        })
}

/// A number no other process draws, nor this one again: the hash of a
/// fresh `RandomState` (keyed at random per process, and differently for
/// each one made) of the instant.
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

#[cfg(test)]
mod tests;
