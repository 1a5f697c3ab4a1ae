//! The ledger's book, and its settling task on a store that comes and goes.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use jiff::SignedDuration;

use super::*;
use crate::store::{ChargeOutcome, ChargeRequest, MemoryStore, Usage};
use crate::{ManualClock, Namespace, Subject};

fn at(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn key(subject: &str, period: &str) -> PeriodKey {
    Namespace::default().key(&Subject::account(subject), "default", period)
}

fn minutes(n: i64) -> SignedDuration {
    SignedDuration::from_mins(n)
}

fn calendar(key: &PeriodKey, amount: u64, since: Timestamp) -> Debt {
    Debt {
        key: key.clone(),
        amount,
        lifetime: Lifetime::Calendar {
            start: at("2026-12-02T00:00:00Z"),
            end: at("2026-12-03T00:00:00Z"),
        },
        since,
        id: 0,
    }
}

/// A debt of a first-use quota of an hour, for a request at `since`.
fn first_use(key: &PeriodKey, amount: u64, since: Timestamp) -> Debt {
    Debt {
        key: key.clone(),
        amount,
        lifetime: Lifetime::FirstUse {
            deadline: since + minutes(60),
        },
        since,
        id: 0,
    }
}

/// What a policy's settings tell its ledger.
#[derive(Clone)]
struct Settings {
    clock: Arc<dyn Clock>,
    max_owed: usize,
}

impl Settings {
    fn ledger(&self) -> Terms<'_> {
        Terms {
            clock: &self.clock,
            max_owed: self.max_owed,
            store_timeout: None,
        }
    }
}

/// A policy's settings at `now` for the ledger: a bound of 10 counters, no
/// timeout.
fn settings(now: Timestamp) -> Settings {
    Settings {
        clock: Arc::new(ManualClock::new(now)),
        max_owed: 10,
    }
}

/// The queue names each entry of the book once, and nothing else.
fn assert_queue_holds_every_entry_once(book: &Book) {
    let mut queued: Vec<_> = book.queue.iter().cloned().collect();
    let mut held: Vec<_> = book
        .owed
        .iter()
        .flat_map(|(key, entries)| entries.iter().map(|e| (key.clone(), e.id)))
        .collect();
    queued.sort_by(|x, y| (x.0.as_str(), x.1).cmp(&(y.0.as_str(), y.1)));
    held.sort_by(|x, y| (x.0.as_str(), x.1).cmp(&(y.0.as_str(), y.1)));
    assert_eq!(queued, held);
}

const NOON: &str = "2026-12-02T12:00:00Z";

/// Debts that together pass what the store counts go in entries of their
/// own: the store would refuse one settle of the sum whole.
#[test]
fn an_entry_never_grows_past_what_the_store_counts() {
    let mut book = Book::default();
    let now = at(NOON);
    let acme = key("acme", "2026-12-02");
    assert!(book.record_within(calendar(&acme, 8, now), now, 10, 10));
    assert!(book.record_within(calendar(&acme, 2, now), now, 10, 10));
    assert!(book.record_within(calendar(&acme, 5, now), now, 10, 10));
    assert_eq!((book.queue.len(), book.units), (2, 15));
    let amounts: Vec<u64> = book.owed[&acme].iter().map(|e| e.amount).collect();
    assert_eq!(amounts, [10, 5]);
    assert_queue_holds_every_entry_once(&book);
}

#[test]
fn debts_on_one_calendar_counter_add_up_in_one_entry() {
    let mut book = Book::default();
    let now = at(NOON);
    let acme = key("acme", "2026-12-02");
    let other = key("other", "2026-12-02");
    assert!(book.record(calendar(&acme, 1, now), now, 10));
    assert!(book.record(calendar(&acme, 2, now + minutes(1)), now, 10));
    assert!(book.record(calendar(&other, 1, now), now, 10));
    assert_eq!((book.queue.len(), book.units), (2, 4));
    let (_, _, debt) = book.next(now).settle().unwrap();
    assert_eq!(
        Debt { id: 0, ..debt },
        calendar(&acme, 3, now),
        "the earliest request's instant"
    );
}

#[test]
fn first_use_debts_share_an_entry_within_the_earliest_ones_period() {
    let mut book = Book::default();
    let t0 = at(NOON);
    let acme = key("acme", "PT1H");
    assert!(book.record(first_use(&acme, 1, t0 + minutes(10)), t0, 10));
    // Within its period: the same entry.
    assert!(book.record(first_use(&acme, 1, t0 + minutes(40)), t0, 10));
    // Answered later, but earlier: the period is the one it opened.
    assert!(book.record(first_use(&acme, 1, t0), t0, 10));
    // Past that period: an entry of its own.
    assert!(book.record(first_use(&acme, 1, t0 + minutes(65)), t0, 10));
    assert_eq!((book.queue.len(), book.units), (2, 4));
    let (key, id, debt) = book.next(t0).settle().unwrap();
    assert_eq!(Debt { id: 0, ..debt }, first_use(&acme, 3, t0));
    book.paid(&key, id, 3);
    let (_, _, debt) = book.next(t0).settle().unwrap();
    assert_eq!(
        Debt { id: 0, ..debt },
        first_use(&acme, 1, t0 + minutes(65))
    );
}

/// An earlier request, answered late, shares an entry only if its period
/// holds every request of the entry: otherwise the entry would take its
/// period, and be dropped with it while later requests of the entry are in
/// a period that is not over.
#[test]
fn an_earlier_debt_joins_only_a_period_that_holds_the_whole_entry() {
    let mut book = Book::default();
    let t0 = at(NOON);
    let acme = key("acme", "PT1H");
    // B at 40 min: [40, 100); C at 90 min joins it.
    assert!(book.record(first_use(&acme, 1, t0 + minutes(40)), t0, 10));
    assert!(book.record(first_use(&acme, 1, t0 + minutes(90)), t0, 10));
    assert_eq!(book.queue.len(), 1);
    // A at 0, answered at 92 min: its period [0, 60) holds B, not C.
    let late = t0 + minutes(92);
    assert!(book.record(first_use(&acme, 1, t0), late, 10));
    assert_eq!(book.queue.len(), 2, "A in an entry of its own");
    assert_queue_holds_every_entry_once(&book);
    assert_eq!(book.units, 3);
    // At 92 min A's period is over: A goes, B and C are settled.
    let (key, id, debt) = book.next(late).settle().expect("B and C still owed");
    assert_eq!(
        Debt { id: 0, ..debt },
        Debt {
            key: acme.clone(),
            amount: 2,
            lifetime: Lifetime::FirstUse {
                deadline: t0 + minutes(100),
            },
            since: t0 + minutes(40),
            id: 0,
        }
    );
    book.paid(&key, id, 2);
    assert!(book.next(late).settle().is_none());
    assert_eq!(book.units, 0);
}

/// A request at the very deadline of an entry's period is in the next
/// period: it opens an entry of its own, which is settled once the first
/// one's period is over and dropped.
#[test]
fn a_debt_at_an_entrys_deadline_opens_an_entry_of_its_own() {
    let mut book = Book::default();
    let t0 = at(NOON);
    let acme = key("acme", "PT1H");
    assert!(book.record(first_use(&acme, 1, t0), t0, 10));
    let deadline = t0 + minutes(60);
    assert!(book.record(first_use(&acme, 1, deadline), deadline, 10));
    assert_eq!(
        book.queue.len(),
        2,
        "the later request opens the next period"
    );
    assert_queue_holds_every_entry_once(&book);
    // At the deadline the first period is over: its entry goes.
    let (key, id, debt) = book
        .next(deadline)
        .settle()
        .expect("the later request's debt");
    assert_eq!(Debt { id: 0, ..debt }, first_use(&acme, 1, deadline));
    assert_eq!(book.units, 1);
    book.paid(&key, id, 1);
    assert!(book.next(deadline).settle().is_none());
}

/// At the bound, an entry whose period ends at the very instant a debt on
/// a new counter is recorded is over, and makes room for it.
#[test]
fn an_entry_whose_period_ends_now_makes_room_at_the_bound() {
    let mut book = Book::default();
    let now = at(NOON);
    let (a, b) = (key("a", "PT1H"), key("b", "PT1H"));
    assert!(book.record(first_use(&a, 2, now), now, 1));
    let end = now + minutes(60);
    assert!(
        book.record(first_use(&b, 1, end), end, 1),
        "a's period is over at its end"
    );
    assert_eq!((book.queue.len(), book.units), (1, 1));
    assert_queue_holds_every_entry_once(&book);
    assert_eq!(book.next(end).settle().unwrap().2.key, b);
}

/// An earlier request that joins an entry brings the entry's end forward:
/// at the bound, the entry makes room for a new counter once that end is
/// past, though its later request's own period is not over.
#[test]
fn an_entry_brought_forward_by_an_earlier_request_makes_room_once_over() {
    let mut book = Book::default();
    let t0 = at(NOON);
    let (a, b) = (key("a", "PT1H"), key("b", "PT1H"));
    // B at 40 min: [40, 100); A at 0, answered after, joins it: [0, 60).
    let b_at = t0 + minutes(40);
    assert!(book.record(first_use(&a, 1, b_at), b_at, 1));
    assert!(book.record(first_use(&a, 1, t0), t0 + minutes(41), 1));
    assert_eq!((book.queue.len(), book.units), (1, 2));
    // At 70 min a's entry is over: it makes room for b.
    let later = t0 + minutes(70);
    assert!(book.record(first_use(&b, 1, later), later, 1));
    assert_eq!((book.queue.len(), book.units), (1, 1));
    assert_queue_holds_every_entry_once(&book);
}

/// A settling task is taken to be silent once it has shown no sign of life
/// for 30 s on the policy's clock, not before.
#[test]
fn a_task_is_silent_after_thirty_seconds_without_a_beat() {
    let now = at(NOON);
    let ledger = Ledger::default();
    assert!(!ledger.silent(now), "no task: none is silent");
    ledger.beat(now);
    assert!(!ledger.silent(now + SignedDuration::from_secs(SILENT_SECS - 1)));
    assert!(ledger.silent(now + SignedDuration::from_secs(SILENT_SECS)));
}

#[test]
fn past_the_bound_a_new_counter_is_refused_and_ended_ones_make_room() {
    let mut book = Book::default();
    let now = at(NOON);
    let (a, b, c) = (key("a", "PT1H"), key("b", "PT1H"), key("c", "PT1H"));
    assert!(book.record(first_use(&a, 1, now), now, 2));
    assert!(book.record(first_use(&b, 1, now + minutes(30)), now, 2));
    assert!(
        !book.record(first_use(&c, 1, now), now, 2),
        "past the bound"
    );
    assert!(
        book.record(first_use(&a, 5, now + minutes(1)), now, 2),
        "an owed counter takes more past the bound"
    );
    assert_eq!((book.queue.len(), book.units), (2, 7));
    // a's period is over: its entry goes, and c gets its place.
    let later = now + minutes(61);
    assert!(book.record(first_use(&c, 1, later), later, 2));
    assert_eq!((book.queue.len(), book.units), (2, 2));
    assert_queue_holds_every_entry_once(&book);
    assert_eq!(book.next(later).settle().unwrap().2.key, b);
}

#[test]
fn the_next_debt_skips_periods_that_are_over_and_what_joins_meanwhile_stays() {
    let mut book = Book::default();
    let now = at(NOON);
    let (a, b) = (key("a", "PT1H"), key("b", "PT1H"));
    book.record(first_use(&a, 2, now), now, 10);
    book.record(first_use(&b, 3, now + minutes(30)), now, 10);
    let later = now + minutes(70);
    let (key, id, debt) = book.next(later).settle().unwrap();
    assert_eq!(debt.key, b, "a's period is over: dropped");
    assert_eq!((book.queue.len(), book.units), (1, 3));
    // A request joins b while its debt is on its way.
    book.record(first_use(&b, 1, now + minutes(31)), later, 10);
    book.paid(&key, id, debt.amount);
    assert_eq!((book.queue.len(), book.units), (1, 1));
    let (key, id, debt) = book.next(later).settle().unwrap();
    assert_eq!(debt.amount, 1);
    book.paid(&key, id, 1);
    assert!(book.next(later).settle().is_none());
    assert!(!book.settling);
    assert!(book.owed.is_empty() && book.queue.is_empty());
}

#[test]
fn the_entry_being_settled_is_not_let_go_of() {
    let mut book = Book::default();
    let now = at(NOON);
    let (a, b) = (key("a", "PT1H"), key("b", "PT1H"));
    book.record(first_use(&a, 2, now), now, 1);
    let (key, id, _) = book.next(now).settle().unwrap();
    // The bound is reached and a's period ends while its settle is on its
    // way: it stays until the store answers.
    let later = now + minutes(61);
    assert!(!book.record(first_use(&b, 1, later), later, 1));
    book.paid(&key, id, 2);
    assert_eq!((book.queue.len(), book.units), (0, 0));
}

/// A support reset while an entry's settle is on its way, after more debts
/// joined the entry: once the settle lands, what joined before the reset
/// is forgotten too, not settled into the counter made since.
#[test]
fn a_reset_forgets_what_joined_an_entry_being_settled() {
    let ledger = Ledger::default();
    let now = at(NOON);
    let acme = key("acme", "2026-12-02");
    let (key, id) = {
        let mut book = ledger.lock();
        book.record(calendar(&acme, 5, now), now, 10);
        let (key, id, debt) = book.next(now).settle().unwrap();
        assert_eq!(debt.amount, 5);
        book.record(calendar(&acme, 3, now + minutes(1)), now, 10);
        (key, id)
    };
    ledger.forget(&acme, now + minutes(1));
    let since = now + minutes(2);
    ledger.lock().record(calendar(&acme, 2, since), since, 10);
    ledger.lock().paid(&key, id, 5);
    let book = ledger.lock();
    assert_eq!(book.units, 2, "only what was owed since the reset");
    assert_queue_holds_every_entry_once(&book);
}

/// A settle that failed (the store may have applied it, its answer lost) is
/// sent again as it was, under its id and with its units, though more was
/// owed meanwhile: the store adds one id once. Once it is answered, what
/// was owed since goes under a new id.
#[test]
fn a_failed_settle_is_sent_again_as_it_was_then_the_rest_under_a_new_id() {
    let mut book = Book::default();
    let now = at(NOON);
    let acme = key("acme", "2026-12-02");
    book.record(calendar(&acme, 5, now), now, 10);
    let (key, id, first) = book.next(now).settle().unwrap();
    assert_eq!(first.amount, 5);
    assert_eq!(book.unanswered(), 5, "on its way");
    book.record(calendar(&acme, 3, now + minutes(1)), now, 10);
    // Never sent (no connection): nothing of it may have been added.
    book.postpone(&key, id, true);
    assert_eq!((book.units, book.unanswered()), (8, 0));
    let (_, _, again) = book.next(now).settle().unwrap();
    assert_eq!(again, first, "the same settle: its id and its units");
    // Timed out: it may have been added.
    book.postpone(&key, id, false);
    assert_eq!((book.units, book.unanswered()), (8, 5));
    let (_, _, again) = book.next(now).settle().unwrap();
    assert_eq!(again, first);
    // Dropped on its way this time (its task ended): the same again.
    book.unsettled(true);
    assert_eq!(book.unanswered(), 5);
    let (key, id, third) = book.next(now).settle().unwrap();
    assert_eq!(third, first);
    book.paid(&key, id, third.amount);
    assert_eq!((book.units, book.unanswered()), (3, 0));
    let (key, id, rest) = book.next(now).settle().unwrap();
    assert_eq!(rest.amount, 3, "what was owed since");
    assert_ne!(rest.id, first.id, "a new settle");
    book.paid(&key, id, rest.amount);
    assert_eq!((book.queue.len(), book.units), (0, 0));
}

/// A support reset while a settle is on its way, which then fails: what it
/// carried is forgotten, not sent again (under its id or another); what was
/// owed since the reset goes under a new id.
#[test]
fn a_settle_that_fails_after_a_reset_is_not_sent_again() {
    let ledger = Ledger::default();
    let now = at(NOON);
    let acme = key("acme", "2026-12-02");
    let first = {
        let mut book = ledger.lock();
        book.record(calendar(&acme, 5, now), now, 10);
        book.next(now).settle().unwrap().2
    };
    ledger.forget(&acme, now + minutes(1));
    let since = now + minutes(2);
    ledger.lock().record(calendar(&acme, 2, since), since, 10);
    let mut book = ledger.lock();
    book.unsettled(true);
    let (_, _, next) = book.next(since).settle().unwrap();
    assert_eq!(next.amount, 2, "only what was owed since the reset");
    assert_ne!(next.id, first.id);
}

/// Two ledgers (two instances, or two policies on one store) never give
/// their settles the same ids: each starts at a number drawn at random.
#[test]
fn ledgers_draw_their_settle_ids_apart() {
    let now = at(NOON);
    let acme = key("acme", "2026-12-02");
    let ids: Vec<u64> = (0..2)
        .map(|_| {
            let ledger = Ledger::default();
            let mut book = ledger.lock();
            book.record(calendar(&acme, 1, now), now, 10);
            book.next(now).settle().unwrap().2.id
        })
        .collect();
    assert_ne!(ids[0], ids[1]);
}

/// At the bound, with the entry being settled over, a debt on a new counter
/// does not go through the book again for it; once the settle failed, the
/// entry is let go of as any other.
#[test]
fn the_entry_being_settled_starts_no_search_for_ended_ones() {
    let mut book = Book::default();
    let now = at(NOON);
    let (a, b) = (key("a", "PT1H"), key("b", "PT1H"));
    book.record(first_use(&a, 2, now), now, 1);
    let (key, id, _) = book.next(now).settle().unwrap();
    let later = now + minutes(61);
    assert!(!book.record(first_use(&b, 1, later), later, 1));
    assert!(
        book.earliest_end.is_none_or(|end| end > later),
        "no entry but the one being settled is over: {:?}",
        book.earliest_end
    );
    // The settle failed: a is over, and makes room for b.
    book.postpone(&key, id, false);
    assert_queue_holds_every_entry_once(&book);
    assert_eq!(book.earliest_end, Some(now + minutes(60)));
    assert!(book.record(first_use(&b, 1, later), later, 1));
    assert_eq!(book.units, 1);
    assert_eq!(book.next(later).settle().unwrap().2.key, b);
}

/// A memory store that fails every settle while `away`, and every settle
/// on `broken`, counting the tries, and panics on a settle on `panics` (as
/// it is called) or on `panics_later` (as its future is polled); while
/// `held`, a settle waits for `release` first.
#[derive(Clone, Default)]
struct Away {
    inner: MemoryStore,
    away: Arc<AtomicBool>,
    broken: Arc<std::sync::Mutex<Option<PeriodKey>>>,
    panics: Arc<std::sync::Mutex<Option<PeriodKey>>>,
    panics_later: Arc<std::sync::Mutex<Option<PeriodKey>>>,
    tries: Arc<AtomicUsize>,
    held: Arc<AtomicBool>,
    release: Arc<tokio::sync::Notify>,
    /// Settles fail with an error of no kind worth another try, which the
    /// store says it never sent (credentials refused to a new connection).
    unsent: Arc<AtomicBool>,
    /// The most the store counts exactly (`None`: any sum).
    most: Option<u64>,
}

impl Store for Away {
    type ChargeFuture = <MemoryStore as Store>::ChargeFuture;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        self.inner.charge(request)
    }
    fn peek(
        &self,
        request: ChargeRequest,
    ) -> impl Future<Output = Result<Vec<Usage>, StoreError>> + Send {
        self.inner.peek(request)
    }
    fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.inner.refund(now, key, amount)
    }
    fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.inner.add(now, key, amount)
    }
    fn reset(&self, key: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.inner.reset(key)
    }
    fn settle_debt(
        &self,
        now: Timestamp,
        debt: Debt,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.tries.fetch_add(1, Ordering::Relaxed);
        assert!(
            self.panics.lock().unwrap().as_ref() != Some(&debt.key),
            "the store panics on this debt"
        );
        let away = self.away.load(Ordering::Relaxed)
            || self.broken.lock().unwrap().as_ref() == Some(&debt.key);
        let inner = self.inner.clone();
        let held = self.held.load(Ordering::Relaxed);
        let release = Arc::clone(&self.release);
        let panics = self.panics_later.lock().unwrap().as_ref() == Some(&debt.key);
        let unsent = self.unsent.load(Ordering::Relaxed);
        async move {
            assert!(!panics, "the store panics on this debt, later");
            if held {
                release.notified().await;
            }
            if unsent {
                return Err(StoreError::new(StoreErrorKind::Other, "credentials refused").unsent());
            }
            if away {
                return Err(StoreError::new(StoreErrorKind::Unavailable, "away"));
            }
            inner.settle_debt(now, debt).await
        }
    }
    fn max_count(&self) -> u64 {
        self.most.unwrap_or(u64::MAX)
    }
}

/// A debt of more than the store counts exactly (a deferred cost past it)
/// is owed as far as the store counts: a settle of the whole would be
/// refused, and nothing of it counted.
#[test]
fn a_debt_past_what_the_store_counts_is_owed_up_to_it() {
    let now = at(NOON);
    let settings = settings(now);
    let store = Away {
        most: Some(10),
        ..Away::default()
    };
    let ledger = Arc::new(Ledger::default());
    let a = key("a", "PT1H");
    ledger.owe(&store, settings.ledger(), [first_use(&a, 15, now)]);
    assert_eq!(
        ledger.owed(),
        Owed {
            counters: 1,
            units: 10,
            unanswered: 0
        }
    );
}

async fn used(store: &MemoryStore, key: &PeriodKey, now: Timestamp) -> u64 {
    let request = ChargeRequest {
        charged_at: None,
        now,
        lines: smallvec::smallvec![crate::store::ChargeLine {
            key: key.clone(),
            limit: 10,
            cost: 0,
            lifetime: Lifetime::FirstUse {
                deadline: now + minutes(60),
            },
            shadow_limit: None,
        }],
    };
    let outcome: ChargeOutcome = store.charge(request).await.unwrap();
    outcome.usage[0].used
}

#[tokio::test(start_paused = true)]
async fn the_ledger_settles_once_the_store_is_back_and_waits_longer_between_tries() {
    let now = at(NOON);
    let settings = settings(now);
    let store = Away::default();
    let ledger = Arc::new(Ledger::default());
    assert!(!ledger.lock().settling, "nothing owed, nothing running");
    ledger.owe(
        &store,
        settings.ledger(),
        [first_use(&key("a", "PT1H"), 0, now)],
    );
    assert!(!ledger.lock().settling, "a debt of nothing starts nothing");

    store.away.store(true, Ordering::Relaxed);
    let a = key("a", "PT1H");
    ledger.owe(&store, settings.ledger(), [first_use(&a, 2, now)]);
    assert!(ledger.lock().settling);
    // Ten seconds of failures: tries 100 ms, then 200, 400 ... 5 s apart.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let tries = store.tries.load(Ordering::Relaxed);
    assert!((5..=9).contains(&tries), "{tries} tries in 10 s");
    assert_eq!(
        ledger.owed(),
        Owed {
            counters: 1,
            units: 2,
            unanswered: 2
        },
        "a settle that failed after it left may have been added"
    );

    store.away.store(false, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(ledger.owed(), Owed::default());
    assert!(!ledger.lock().settling, "the task ended");
    assert_eq!(used(&store.inner, &a, now).await, 2);
}

/// A settle that goes through starts the waits afresh: a key the store
/// still fails after a long outage is tried again soon, not after the
/// longest wait the outage grew to.
#[tokio::test(start_paused = true)]
async fn a_settle_that_goes_through_starts_the_waits_afresh() {
    let now = at(NOON);
    let settings = settings(now);
    let store = Away::default();
    let ledger = Arc::new(Ledger::default());
    store.away.store(true, Ordering::Relaxed);
    let (a, b) = (key("a", "PT1H"), key("b", "PT1H"));
    ledger.owe(
        &store,
        settings.ledger(),
        [first_use(&a, 1, now), first_use(&b, 1, now)],
    );
    // Ten seconds of failures: the waits grow to seconds.
    tokio::time::sleep(Duration::from_secs(10)).await;
    // The store is back, but for b's key.
    *store.broken.lock().unwrap() = Some(b.clone());
    store.away.store(false, Ordering::Relaxed);
    while ledger.owed().counters > 1 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(used(&store.inner, &a, now).await, 1);
    let tries = store.tries.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let more = store.tries.load(Ordering::Relaxed) - tries;
    assert!(more >= 3, "{more} tries of b in the second after a settled");
}

/// A settle the store never sent applied nothing, whatever its error's
/// kind: the debt stays owed until the store takes it.
#[tokio::test(start_paused = true)]
async fn a_settle_never_sent_keeps_its_debt_whatever_the_errors_kind() {
    let now = at(NOON);
    let settings = settings(now);
    let store = Away::default();
    let ledger = Arc::new(Ledger::default());
    store.unsent.store(true, Ordering::Relaxed);
    let a = key("a", "PT1H");
    ledger.owe(&store, settings.ledger(), [first_use(&a, 2, now)]);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(store.tries.load(Ordering::Relaxed) > 0);
    assert_eq!(
        ledger.owed(),
        Owed {
            counters: 1,
            units: 2,
            unanswered: 0
        },
        "a settle the store never sent was not added"
    );
    store.unsent.store(false, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(ledger.owed(), Owed::default());
    assert_eq!(used(&store.inner, &a, now).await, 2);
}

/// A shutdown settles what the ledger owes as soon as the store is back,
/// not after the task's growing wait, and says what it could not.
#[tokio::test(start_paused = true)]
async fn settling_now_tries_again_soon_and_tells_what_is_still_owed() {
    let now = at(NOON);
    let settings = settings(now);
    let store = Away::default();
    store.away.store(true, Ordering::Relaxed);
    let a = key("a", "PT1H");
    let ledger = Arc::new(Ledger::default());
    ledger.owe(&store, settings.ledger(), [first_use(&a, 2, now)]);
    // Ten seconds of failures: the task now waits 5 s between tries.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let owed = Owed {
        counters: 1,
        units: 2,
        unanswered: 2,
    };
    // Still away: owed after the wait, tried every 100 ms meanwhile.
    let tries = store.tries.load(Ordering::Relaxed);
    let left = ledger
        .settle_now(&store, settings.ledger(), Duration::from_secs(1))
        .await;
    assert_eq!(left, owed);
    let more = store.tries.load(Ordering::Relaxed) - tries;
    assert!((8..=11).contains(&more), "{more} tries in 1 s");
    // Back 300 ms into the wait: settled within 100 ms, not 5 s.
    store.away.store(true, Ordering::Relaxed);
    let back = {
        let away = Arc::clone(&store.away);
        async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            away.store(false, Ordering::Relaxed);
        }
    };
    let start = tokio::time::Instant::now();
    let (left, ()) = tokio::join!(
        ledger.settle_now(&store, settings.ledger(), Duration::from_secs(5)),
        back
    );
    assert_eq!(left, Owed::default());
    let took = start.elapsed();
    assert!(took <= Duration::from_millis(450), "{took:?}");
    assert_eq!(used(&store.inner, &a, now).await, 2);
    assert_eq!(ledger.lock().hurry, 0);
    // Nothing owed: answered at once.
    let left = ledger
        .settle_now(&store, settings.ledger(), Duration::from_secs(5))
        .await;
    assert_eq!(left, Owed::default());
}

#[tokio::test(start_paused = true)]
async fn a_dropped_policy_stops_the_task() {
    let now = at(NOON);
    let settings = settings(now);
    let store = Away::default();
    store.away.store(true, Ordering::Relaxed);
    let ledger = Arc::new(Ledger::default());
    ledger.owe(
        &store,
        settings.ledger(),
        [first_use(&key("a", "PT1H"), 1, now)],
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(ledger);
    let tries = store.tries.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(
        store.tries.load(Ordering::Relaxed) <= tries + 1,
        "no tries once the ledger is gone"
    );
}

/// A key the store keeps failing (a cluster node that is down, a new
/// counter in a full store) holds up no other: the others are settled, and
/// the task waits between tries only once every entry failed.
#[tokio::test(start_paused = true)]
async fn a_key_the_store_keeps_failing_holds_up_no_other() {
    let now = at(NOON);
    let settings = settings(now);
    let store = Away::default();
    let (a, b, c) = (key("a", "PT1H"), key("b", "PT1H"), key("c", "PT1H"));
    *store.broken.lock().unwrap() = Some(a.clone());
    let ledger = Arc::new(Ledger::default());
    ledger.owe(
        &store,
        settings.ledger(),
        [first_use(&a, 1, now), first_use(&b, 2, now)],
    );
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(
        ledger.owed(),
        Owed {
            counters: 1,
            units: 1,
            unanswered: 1
        },
        "b settled at once, behind a that failed"
    );
    assert_eq!(used(&store.inner, &b, now).await, 2);

    // a alone: tries 100 ms, then 200, 400 ... apart.
    let tries = store.tries.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let more = store.tries.load(Ordering::Relaxed) - tries;
    assert!((5..=9).contains(&more), "{more} tries in 10 s");

    // A debt recorded meanwhile is settled on the task's next round.
    ledger.owe(&store, settings.ledger(), [first_use(&c, 3, now)]);
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(used(&store.inner, &c, now).await, 3);
    assert_eq!(ledger.owed().units, 1, "a still owed");

    *store.broken.lock().unwrap() = None;
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(ledger.owed(), Owed::default());
    assert_eq!(used(&store.inner, &a, now).await, 1);
}

/// A debt the store panics on (a bug in a store of the application's own)
/// is dropped, as one the store refuses: the task goes on with the others.
#[tokio::test(start_paused = true)]
async fn a_debt_the_store_panics_on_holds_up_no_other() {
    let now = at(NOON);
    let settings = settings(now);
    let store = Away::default();
    let (a, later, b) = (key("a", "PT1H"), key("later", "PT1H"), key("b", "PT1H"));
    *store.panics.lock().unwrap() = Some(a.clone());
    *store.panics_later.lock().unwrap() = Some(later.clone());
    let ledger = Arc::new(Ledger::default());
    ledger.owe(
        &store,
        settings.ledger(),
        [
            first_use(&a, 1, now),
            first_use(&later, 5, now),
            first_use(&b, 2, now),
        ],
    );
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(used(&store.inner, &b, now).await, 2);
    assert_eq!(ledger.owed(), Owed::default());
    let c = key("c", "PT1H");
    ledger.owe(&store, settings.ledger(), [first_use(&c, 3, now)]);
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(used(&store.inner, &c, now).await, 3);
}

/// A ledger dropped with its policy while a settle is on its way: the
/// ledger counts what it owes but that settle as abandoned, and the task
/// accounts for the settle once the store answers (or counts it as
/// abandoned, if the task ends first).
#[cfg(feature = "metrics")]
#[test]
fn a_settle_on_its_way_when_the_ledger_is_dropped_is_its_tasks_to_account() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let now = at(NOON);
    let settings = settings(now);
    let store = Away::default();
    store.held.store(true, Ordering::Relaxed);
    let (a, b, c) = (key("a", "PT1H"), key("b", "PT1H"), key("c", "PT1H"));
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async {
            let ledger = Arc::new(Ledger::default());
            ledger.owe(
                &store,
                settings.ledger(),
                [first_use(&a, 2, now), first_use(&b, 3, now)],
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
            assert_eq!(store.tries.load(Ordering::Relaxed), 1, "a on its way");
            drop(ledger);
            store.release.notify_one();
            tokio::time::sleep(Duration::from_secs(1)).await;
            assert_eq!(used(&store.inner, &a, now).await, 2, "a settled");
            assert_eq!(store.tries.load(Ordering::Relaxed), 1, "and no more");

            // This time the runtime ends before the store answers.
            let ledger = Arc::new(Ledger::default());
            ledger.owe(&store, settings.ledger(), [first_use(&c, 4, now)]);
            tokio::time::sleep(Duration::from_millis(1)).await;
            assert_eq!(store.tries.load(Ordering::Relaxed), 2, "c on its way");
            drop(ledger);
        });
        drop(runtime);
    });
    let (mut settled, mut abandoned, mut counters) = (0, 0, 0.0);
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let reason = key.labels().find(|l| l.key() == "reason");
        match (key.name(), value) {
            (crate::metrics::LEDGER_SETTLED, DebugValue::Counter(n)) => settled += n,
            (crate::metrics::LEDGER_DROPPED, DebugValue::Counter(n))
                if reason.is_some_and(|r| r.value() == "abandoned") =>
            {
                abandoned += n
            }
            (crate::metrics::LEDGER_COUNTERS, DebugValue::Gauge(n)) => counters = n.into_inner(),
            _ => {}
        }
    }
    assert_eq!(settled, 2, "a, by the task");
    assert_eq!(
        abandoned,
        3 + 4,
        "b by the ledger, c by the task that ended"
    );
    assert_eq!(counters, 0.0);
}

/// A debt recorded on a runtime that then goes idle (a current-thread
/// runtime made for one call and kept, not dropped) is settled from the
/// policy's requests on another runtime once the store is back: the task
/// spawned on the idle runtime never runs again, and its claim must not
/// keep every other runtime from settling.
#[tokio::test(start_paused = true)]
async fn a_debt_owed_on_a_runtime_gone_idle_is_settled_from_another() {
    let now = at(NOON);
    let clock = ManualClock::new(now);
    let settings = Settings {
        clock: Arc::new(clock.clone()),
        max_owed: 10,
    };
    let store = Away::default();
    store.away.store(true, Ordering::Relaxed);
    let ledger = Arc::new(Ledger::default());
    let a = key("a", "PT1H");
    // One call on a runtime of its own, while the store is away: the
    // settling task starts there, fails once and waits to try again.
    let side = {
        let (ledger, store, settings, a) = (
            Arc::clone(&ledger),
            store.clone(),
            settings.clone(),
            a.clone(),
        );
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                ledger.owe(&store, settings.ledger(), [first_use(&a, 2, now)]);
                tokio::time::sleep(Duration::from_millis(10)).await;
            });
            // Kept: the caller holds it for its next call, which never comes.
            runtime
        })
        .join()
        .unwrap()
    };
    assert!(
        store.tries.load(Ordering::Relaxed) >= 1,
        "tried on the side runtime"
    );
    // The store is back; the policy serves requests on this runtime for
    // two minutes.
    store.away.store(false, Ordering::Relaxed);
    for _ in 0..120 {
        ledger.wake(&store, settings.ledger());
        tokio::time::sleep(Duration::from_secs(1)).await;
        clock.advance(Duration::from_secs(1));
    }
    let owed = ledger.owed();
    std::thread::spawn(move || drop(side)).join().unwrap();
    assert_eq!(
        owed,
        Owed::default(),
        "still owed after two minutes of requests"
    );
    assert_eq!(used(&store.inner, &a, now).await, 2);
}

/// A beat left by a task that no longer settles (one taken over, whose
/// last step came after the task in its place ended) makes every request
/// look at the ledger under its lock: the first such look finds no task
/// and clears the beat, so the next requests pass with one atomic read.
#[tokio::test]
async fn a_beat_with_no_task_behind_it_is_cleared_by_the_first_request() {
    let now = at(NOON);
    let clock = ManualClock::new(now);
    let settings = Settings {
        clock: Arc::new(clock.clone()),
        max_owed: crate::ledger::DEFAULT_MAX_OWED,
    };
    let store = Away::default();
    let ledger = Arc::new(Ledger::default());
    ledger.beat(now);
    clock.advance(Duration::from_secs(60));
    ledger.wake(&store, settings.ledger());
    assert_eq!(ledger.beat.load(Ordering::Relaxed), IDLE);
    assert_eq!(ledger.owed(), Owed::default());
}
