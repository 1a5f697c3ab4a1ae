//! Changes the store never sent (it was away), sent again while their
//! counter's period lasts: a give-back that never lands leaves a request
//! charged that was not served, an add that never lands leaves a served
//! one under-counted.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use jiff::Timestamp;
use tokio::time::Instant;

use super::StoreError;
use crate::throttle::Throttle;

/// The wait before a change the store never sent is sent again; doubled
/// after each try, up to [`MAX_WAIT`].
const FIRST_WAIT: Duration = Duration::from_millis(100);
const MAX_WAIT: Duration = Duration::from_secs(5);

/// The most changes sent again at once, in the process: past it (an outage
/// under heavy traffic), a change the store never sent is dropped, and
/// logged, rather than waited on in a task of its own.
pub(crate) const MAX_WAITING: usize = 10_000;

/// The process's room for changes sent again.
static WAITING: Pool = Pool::new(MAX_WAITING);

/// Shutdowns waiting for the changes sent again ([`sent_all`]): while one
/// waits, a change is sent again 100 ms apart at most, not after the
/// growing waits.
static HURRIED: AtomicUsize = AtomicUsize::new(0);

/// Wakes the changes waiting to be sent again (see [`sent_all`]).
static HURRY: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Sends the changes of the process waiting to be sent again now, and
/// again 100 ms apart while the store answers that it never sent them,
/// and waits until none waits or is on its way ([`Applying`]), or
/// `deadline` (`None`: as long as it takes); how many still wait or are
/// on their way. What a graceful shutdown awaits
/// ([`QuotaPolicy::settle_owed`](crate::QuotaPolicy::settle_owed)): a
/// change still waiting when the process exits is lost, a request not
/// served left charged or a served one under-counted.
pub(crate) async fn sent_all(deadline: Option<Instant>) -> usize {
    WAITING.sent_all(deadline).await
}

/// Changes dropped for want of room, logged a few times a second.
static DROPPED: Throttle = Throttle::new(5);

/// Room for at most `most` changes sent again at once, and the count of
/// changes on their way ([`Applying`]).
pub(crate) struct Pool {
    waiting: AtomicUsize,
    applying: AtomicUsize,
    most: usize,
}

impl Pool {
    pub(crate) const fn new(most: usize) -> Self {
        Self {
            waiting: AtomicUsize::new(0),
            applying: AtomicUsize::new(0),
            most,
        }
    }

    /// Changes waiting to be sent again, or on their way.
    fn pending(&self) -> usize {
        self.waiting.load(Ordering::SeqCst) + self.applying.load(Ordering::SeqCst)
    }

    /// See [`sent_all`].
    async fn sent_all(&self, deadline: Option<Instant>) -> usize {
        struct Hurried;
        impl Drop for Hurried {
            fn drop(&mut self) {
                HURRIED.fetch_sub(1, Ordering::SeqCst);
            }
        }
        if self.pending() == 0 {
            return 0;
        }
        HURRIED.fetch_add(1, Ordering::SeqCst);
        let _hurried = Hurried;
        // Those that wait now are sent at once; those about to wait read
        // `HURRIED` first (see `Resend::send`).
        HURRY.notify_waiters();
        loop {
            let pending = self.pending();
            if pending == 0 || deadline.is_some_and(|d| Instant::now() >= d) {
                return pending;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn take(&'static self) -> Option<Slot> {
        if self.waiting.fetch_add(1, Ordering::Relaxed) < self.most {
            return Some(Slot(self));
        }
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        if let Some(suppressed) = DROPPED.admit() {
            tracing::warn!(
                suppressed,
                "{} changes wait for the quota store already: one it never sent is dropped",
                self.most
            );
        }
        None
    }
}

/// One change's room in a [`Pool`], while it is sent again.
struct Slot(&'static Pool);

/// Held by a response's changes from their first send until they are over
/// (sent again if the store never got them, and what follows from their
/// answers), so that [`sent_all`] waits for a change whose first send is
/// still on its way, which may yet come back unsent and wait to be sent
/// again.
pub(crate) struct Applying(&'static Pool);

impl Applying {
    pub(crate) fn new() -> Self {
        Self::in_pool(&WAITING)
    }

    fn in_pool(pool: &'static Pool) -> Self {
        pool.applying.fetch_add(1, Ordering::SeqCst);
        Self(pool)
    }
}

impl Drop for Applying {
    fn drop(&mut self) {
        self.0.applying.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A change the store never sent, to send again until a deadline, with its
/// room taken.
pub(crate) struct Resend {
    deadline: Instant,
    _slot: Slot,
}

impl Resend {
    /// Room to send again a change of a counter that resets at
    /// `resets_at`, first sent at `now` (the policy's clock), which was
    /// `started` on the runtime's: until its last wait still ends before
    /// the reset (past it, a counter with the same key is another
    /// period's, which the request never spent). `None` when no time is
    /// left, there is no tokio runtime to wait on, or [`MAX_WAITING`]
    /// changes wait already.
    pub(crate) fn until(started: Instant, now: Timestamp, resets_at: Timestamp) -> Option<Self> {
        Self::in_pool(&WAITING, started, now, resets_at)
    }

    fn in_pool(
        pool: &'static Pool,
        started: Instant,
        now: Timestamp,
        resets_at: Timestamp,
    ) -> Option<Self> {
        let left = Duration::try_from(resets_at.duration_since(now)).unwrap_or_default();
        let window = left.saturating_sub(MAX_WAIT);
        let deadline = started + window;
        if window.is_zero()
            || Instant::now() >= deadline
            || tokio::runtime::Handle::try_current().is_err()
        {
            return None;
        }
        Some(Self {
            deadline,
            _slot: pool.take()?,
        })
    }

    /// Sends the change again with `send`: after a wait (100 ms, doubled
    /// up to 5 s), again while the store answers that it never sent it,
    /// each time only if the wait ends before the deadline. The last
    /// answer; `None` when the deadline came before any (the change waited
    /// its turn behind others).
    pub(crate) async fn send<T, F, Fut>(self, mut send: F) -> Option<Result<T, StoreError>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let mut wait = FIRST_WAIT;
        let mut last = None;
        loop {
            // A shutdown waits for it (see `sent_all`): 100 ms at most. The
            // wake-up is taken before `HURRIED` is read, so that one that
            // begins after the read wakes it.
            let hurry = HURRY.notified();
            let hurried = HURRIED.load(Ordering::SeqCst) > 0;
            let this_wait = if hurried { wait.min(FIRST_WAIT) } else { wait };
            if Instant::now() + this_wait >= self.deadline {
                return last;
            }
            // Woken early by a shutdown that begins meanwhile.
            let _ = tokio::time::timeout(this_wait, hurry).await;
            let answer = send().await;
            if !matches!(&answer, Err(error) if error.is_unsent()) {
                return Some(answer);
            }
            last = Some(answer);
            wait = (wait * 2).min(MAX_WAIT);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreErrorKind;

    fn unsent() -> StoreError {
        StoreError::new(StoreErrorKind::Unavailable, "away").unsent()
    }

    fn at(text: &str) -> Timestamp {
        text.parse().unwrap()
    }

    /// Sent again until the window ends, counting the time each try takes,
    /// not only the waits between them.
    #[tokio::test(start_paused = true)]
    async fn the_window_counts_the_tries_too() {
        static POOL: Pool = Pool::new(1);
        let start = Instant::now();
        let (now, reset) = (at("2026-12-02T10:00:00Z"), at("2026-12-02T10:01:05Z"));
        let resend = Resend::in_pool(&POOL, start, now, reset).expect("a minute left");
        let mut tries = 0;
        let answer = resend
            .send(|| {
                tries += 1;
                async {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                    Err::<(), _>(unsent())
                }
            })
            .await;
        assert!(matches!(answer, Some(Err(error)) if error.is_unsent()));
        let took = start.elapsed();
        assert!(
            took <= Duration::from_secs(70),
            "{took:?} over {tries} tries"
        );
        assert!(
            took >= Duration::from_secs(50),
            "{took:?} over {tries} tries"
        );
    }

    /// The deadline runs from when the change was first sent: time spent
    /// before it is sent again (other changes' tries) counts.
    #[tokio::test(start_paused = true)]
    async fn the_window_runs_from_the_first_try() {
        static POOL: Pool = Pool::new(1);
        let start = Instant::now();
        let (now, reset) = (at("2026-12-02T10:00:00Z"), at("2026-12-02T10:01:05Z"));
        tokio::time::advance(Duration::from_secs(61)).await;
        assert!(Resend::in_pool(&POOL, start, now, reset).is_none());
    }

    /// A shutdown waits for a change on its way (its first send not over:
    /// it may yet come back unsent, to be sent again), and returns once it
    /// is over; or at its deadline, telling it.
    #[tokio::test(start_paused = true)]
    async fn a_shutdown_waits_for_changes_on_their_way() {
        static POOL: Pool = Pool::new(1);
        let applying = Applying::in_pool(&POOL);
        let deadline = Instant::now() + Duration::from_secs(1);
        assert_eq!(POOL.sent_all(Some(deadline)).await, 1);
        assert!(Instant::now() >= deadline);
        let shutdown = tokio::spawn(POOL.sent_all(None));
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(!shutdown.is_finished());
        drop(applying);
        assert_eq!(shutdown.await.unwrap(), 0);
    }

    /// An answer other than "never sent" ends the tries.
    #[tokio::test(start_paused = true)]
    async fn an_answer_ends_the_tries() {
        static POOL: Pool = Pool::new(1);
        let (now, reset) = (at("2026-12-02T10:00:00Z"), at("2026-12-03T00:00:00Z"));
        let resend = Resend::in_pool(&POOL, Instant::now(), now, reset).unwrap();
        let mut tries = 0;
        let answer = resend
            .send(|| {
                tries += 1;
                let answer = if tries < 3 { Err(unsent()) } else { Ok(tries) };
                std::future::ready(answer)
            })
            .await;
        assert_eq!(answer.and_then(Result::ok), Some(3));
    }

    /// A change whose deadline passed while it waited its turn is not sent.
    #[tokio::test(start_paused = true)]
    async fn a_change_past_its_deadline_is_not_sent() {
        static POOL: Pool = Pool::new(1);
        let (now, reset) = (at("2026-12-02T10:00:00Z"), at("2026-12-02T10:01:05Z"));
        let resend = Resend::in_pool(&POOL, Instant::now(), now, reset).unwrap();
        tokio::time::advance(Duration::from_secs(60)).await;
        let answer: Option<Result<(), _>> = resend
            .send(|| async { panic!("sent past its deadline") })
            .await;
        assert!(answer.is_none());
    }

    /// A change whose next wait would end past its deadline is not sent,
    /// though the deadline has not come yet.
    #[tokio::test(start_paused = true)]
    async fn a_change_whose_wait_ends_past_its_deadline_is_not_sent() {
        static POOL: Pool = Pool::new(1);
        let (now, reset) = (at("2026-12-02T10:00:00Z"), at("2026-12-02T10:01:05Z"));
        let resend = Resend::in_pool(&POOL, Instant::now(), now, reset).unwrap();
        // The deadline is 60 s on; the first wait (100 ms) would end past it.
        tokio::time::advance(Duration::from_millis(59_950)).await;
        let answer: Option<Result<(), _>> = resend
            .send(|| async { panic!("sent after its deadline") })
            .await;
        assert!(answer.is_none());
    }

    /// Nothing is sent again without time before the reset, nor past the
    /// most changes waiting at once; room comes back as changes end.
    #[tokio::test(start_paused = true)]
    async fn not_sent_again_without_time_or_room() {
        static POOL: Pool = Pool::new(2);
        let now = at("2026-12-02T10:00:00Z");
        let soon = at("2026-12-02T10:00:04Z");
        let later = at("2026-12-03T00:00:00Z");
        assert!(Resend::in_pool(&POOL, Instant::now(), now, soon).is_none());
        let first = Resend::in_pool(&POOL, Instant::now(), now, later).unwrap();
        let second = Resend::in_pool(&POOL, Instant::now(), now, later).unwrap();
        assert!(Resend::in_pool(&POOL, Instant::now(), now, later).is_none());
        drop(first);
        assert!(Resend::in_pool(&POOL, Instant::now(), now, later).is_some());
        drop(second);
    }
}
