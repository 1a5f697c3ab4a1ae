//! How long a caller waits for a store's answer: a store that answers
//! nothing is failed quickly, one that answers slowly is waited for.
//!
//! A call's budget (a policy's `store_timeout`, the Redis store's own
//! timeout) bounds the time the store may go *without answering anything*,
//! not the age of the call. Under load (the machine's cores saturated, a
//! queue of charges ahead of this one) a call can be older than its budget
//! while the store answers others all along: failing it would turn load
//! alone into a 503, or under fail open into an admission the ledger owes.
//! So a call fails once its budget has passed since it started and since
//! the store's last answer to any call, or once [`PATIENCE`] budgets have
//! passed since it started, whatever the store answered meanwhile. A store
//! that stalled (a frozen server, a network gone silent) answers nothing,
//! and its calls fail after one budget, as before.

use std::future::Future;
use std::pin::Pin;
#[cfg(any(feature = "redis", test))]
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// How many budgets a call waits in all while its store keeps answering
/// other calls.
pub(crate) const PATIENCE: u32 = 10;

/// The wait for one call: see the module's documentation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Patience {
    started: Instant,
    budget: Duration,
    cap: Instant,
}

impl Patience {
    /// The wait of a call that started at `started`, with `budget`, for at
    /// most [`PATIENCE`] budgets in all, and never more than `longest`
    /// (nor less than one budget).
    pub(crate) fn new(started: Instant, budget: Duration, longest: Duration) -> Self {
        let cap = budget.saturating_mul(PATIENCE).min(longest).max(budget);
        Self {
            started,
            budget,
            cap: started.checked_add(cap).unwrap_or_else(far_future),
        }
    }

    /// The instant past which the call fails, whatever the store answered.
    #[cfg(feature = "redis")]
    pub(crate) fn cap(&self) -> Instant {
        self.cap
    }

    /// When the call fails unless it is answered first, the store having
    /// last answered at `last_answer`.
    pub(crate) fn deadline(&self, last_answer: Option<Instant>) -> Instant {
        let quiet_since = last_answer.map_or(self.started, |at| at.max(self.started));
        quiet_since
            .checked_add(self.budget)
            .unwrap_or_else(far_future)
            .min(self.cap)
    }

    /// Waits for `call` with this patience, `last_answer` telling when the
    /// store last answered: `None` once the call failed.
    #[cfg(any(feature = "redis", test))]
    pub(crate) async fn wait<F: Future>(
        self,
        last_answer: impl Fn() -> Option<Instant>,
        call: F,
    ) -> Option<F::Output> {
        let mut call = std::pin::pin!(call);
        loop {
            if let Ok(answer) =
                tokio::time::timeout_at(self.deadline(last_answer()), call.as_mut()).await
            {
                return Some(answer);
            }
            // Answers that came while this process did not run (a machine
            // too busy to run it for a while) are read before the call is
            // failed: tokio runs this task again once its drivers have been
            // polled, and the tasks they woke have run.
            tokio::task::yield_now().await;
            let deadline = self.deadline(last_answer());
            if Instant::now() >= deadline {
                // One last look at the call (a timeout polls it first).
                return tokio::time::timeout_at(deadline, call).await.ok();
            }
        }
    }
}

/// A [`Patience`] kept in a future's state, for a `poll` that waits for a
/// call beside it: a sleep to the deadline, moved on while the store
/// answers others, and one yield before the call is failed.
pub(crate) struct PatientTimer {
    patience: Patience,
    sleep: Pin<Box<Sleep>>,
    yielding: Option<Pin<Box<dyn Future<Output = ()> + Send + Sync>>>,
}

impl PatientTimer {
    pub(crate) fn new(patience: Patience, last_answer: Option<Instant>) -> Self {
        Self {
            patience,
            sleep: Box::pin(tokio::time::sleep_until(patience.deadline(last_answer))),
            yielding: None,
        }
    }

    /// Ready once the call is to fail. The caller polls the call first:
    /// after the yield, that poll is the last look at it.
    pub(crate) fn poll_expired(
        &mut self,
        cx: &mut Context<'_>,
        last_answer: impl Fn() -> Option<Instant>,
    ) -> Poll<()> {
        loop {
            if let Some(yielding) = self.yielding.as_mut() {
                ready!(yielding.as_mut().poll(cx));
                self.yielding = None;
                let deadline = self.patience.deadline(last_answer());
                if Instant::now() >= deadline {
                    return Poll::Ready(());
                }
                self.sleep.as_mut().reset(deadline);
            }
            ready!(self.sleep.as_mut().poll(cx));
            let deadline = self.patience.deadline(last_answer());
            if deadline > Instant::now() {
                self.sleep.as_mut().reset(deadline);
            } else {
                // See `Patience::wait`.
                self.yielding = Some(Box::pin(tokio::task::yield_now()));
            }
        }
    }
}

/// An instant no wait reaches (about thirty years from now).
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400 * 365 * 30)
}

/// When a store last had an answer from what it calls, kept without a lock.
#[cfg(any(feature = "redis", test))]
#[derive(Debug)]
pub(crate) struct LastAnswer {
    epoch: Instant,
    /// Microseconds from `epoch` to the last answer, plus one; zero: none
    /// yet.
    micros: AtomicU64,
}

#[cfg(any(feature = "redis", test))]
impl LastAnswer {
    pub(crate) fn new() -> Self {
        Self {
            epoch: Instant::now(),
            micros: AtomicU64::new(0),
        }
    }

    /// Notes an answer now.
    pub(crate) fn heard(&self) {
        let since = Instant::now().saturating_duration_since(self.epoch);
        let micros = u64::try_from(since.as_micros())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1);
        self.micros.fetch_max(micros, Ordering::Relaxed);
    }

    /// When the last answer came, if one did.
    pub(crate) fn last(&self) -> Option<Instant> {
        match self.micros.load(Ordering::Relaxed) {
            0 => None,
            micros => self
                .epoch
                .checked_add(Duration::from_micros(micros - 1))
                .or(Some(self.epoch)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUDGET: Duration = Duration::from_millis(80);

    #[tokio::test(start_paused = true)]
    async fn a_silent_store_fails_a_call_after_one_budget() {
        let started = Instant::now();
        let patience = Patience::new(started, BUDGET, Duration::MAX);
        assert_eq!(patience.deadline(None), started + BUDGET);
        // An answer before the call started tells nothing of it.
        let before = started.checked_sub(Duration::from_millis(5)).unwrap();
        assert_eq!(patience.deadline(Some(before)), started + BUDGET);
        let answer = patience.wait(|| None, std::future::pending::<()>()).await;
        assert_eq!(answer, None);
        assert_eq!(started.elapsed(), BUDGET);
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_that_keeps_answering_is_waited_for_up_to_ten_budgets() {
        let started = Instant::now();
        let patience = Patience::new(started, BUDGET, Duration::MAX);
        let answered = started + Duration::from_millis(70);
        assert_eq!(patience.deadline(Some(answered)), answered + BUDGET);
        let late = started + Duration::from_secs(5);
        assert_eq!(patience.deadline(Some(late)), started + BUDGET * PATIENCE);

        // Answers every 50 ms: the call is answered at 300 ms, past its
        // budget, and waited for.
        let last = LastAnswer::new();
        let call = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            "answered"
        };
        let others = async {
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                last.heard();
            }
        };
        let answer = tokio::select! {
            answer = patience.wait(|| last.last(), call) => answer,
            _ = others => unreachable!(),
        };
        assert_eq!(answer, Some("answered"));

        // Answers all along, never this call's: failed at ten budgets.
        let started = Instant::now();
        let patience = Patience::new(started, BUDGET, Duration::MAX);
        let answer = tokio::select! {
            answer = patience.wait(|| last.last(), std::future::pending::<()>()) => answer,
            _ = async {
                loop {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    last.heard();
                }
            } => unreachable!(),
        };
        assert_eq!(answer, None);
        assert_eq!(started.elapsed(), BUDGET * PATIENCE);
    }

    #[tokio::test(start_paused = true)]
    async fn answers_stop_and_the_call_fails_a_budget_after_the_last() {
        let started = Instant::now();
        let patience = Patience::new(started, BUDGET, Duration::MAX);
        let last = LastAnswer::new();
        let answer = tokio::select! {
            answer = patience.wait(|| last.last(), std::future::pending::<()>()) => answer,
            _ = async {
                for _ in 0..3 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    last.heard();
                }
                std::future::pending().await
            } => unreachable!(),
        };
        assert_eq!(answer, None);
        assert_eq!(started.elapsed(), Duration::from_millis(150) + BUDGET);
    }

    #[test]
    fn the_wait_is_capped_by_the_longest_and_never_shorter_than_a_budget() {
        let started = Instant::now();
        let late = Some(started + Duration::from_secs(60));
        let capped = Patience::new(started, BUDGET, Duration::from_millis(200));
        assert_eq!(capped.deadline(late), started + Duration::from_millis(200));
        let one = Patience::new(started, BUDGET, Duration::from_millis(10));
        assert_eq!(one.deadline(late), started + BUDGET);
        let huge = Patience::new(started, Duration::MAX, Duration::MAX);
        assert!(huge.deadline(None) > started + Duration::from_secs(86_400 * 365));
    }

    #[test]
    fn the_last_answer_is_kept() {
        let last = LastAnswer::new();
        assert_eq!(last.last(), None);
        last.heard();
        let first = last.last().expect("an answer");
        assert!(first <= Instant::now());
        assert!(first >= last.epoch);
    }
}
