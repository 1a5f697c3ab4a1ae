//! Changes the store never sent (it was away), sent again while their
//! counter's period lasts: a give-back that never lands leaves a request
//! charged that was not served, an add that never lands leaves a served
//! one under-counted.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use jiff::Timestamp;

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

/// Changes being sent again now.
static WAITING: AtomicUsize = AtomicUsize::new(0);

/// Changes dropped past [`MAX_WAITING`], logged a few times a second.
static DROPPED: Throttle = Throttle::new(5);

/// How long a change of a counter that resets at `resets_at`, first sent
/// at `now`, is sent again: while its last wait still ends before the
/// reset. Past it, a counter with the same key is another period's, which
/// the request never spent.
pub(crate) fn window(now: Timestamp, resets_at: Timestamp) -> Duration {
    let left = Duration::try_from(resets_at.duration_since(now)).unwrap_or_default();
    left.saturating_sub(MAX_WAIT)
}

/// Sends again, with `send`, a change the store answered it never sent:
/// after a wait (100 ms, doubled up to 5 s), again while the store answers
/// so, until `window` from now has passed. The last answer; `None` when it
/// was not sent again: no window, no tokio runtime to wait on, or
/// [`MAX_WAITING`] changes waiting already.
pub(crate) async fn again<T, F, Fut>(window: Duration, mut send: F) -> Option<Result<T, StoreError>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    if window.is_zero() || tokio::runtime::Handle::try_current().is_err() {
        return None;
    }
    let _waiting = Waiting::join()?;
    let deadline = tokio::time::Instant::now() + window;
    let mut wait = FIRST_WAIT;
    loop {
        tokio::time::sleep(wait).await;
        let answer = send().await;
        wait = (wait * 2).min(MAX_WAIT);
        let unsent = matches!(&answer, Err(error) if error.is_unsent());
        if !unsent || tokio::time::Instant::now() + wait >= deadline {
            return Some(answer);
        }
    }
}

/// One change among those sent again, while it is.
struct Waiting;

impl Waiting {
    fn join() -> Option<Self> {
        if WAITING.fetch_add(1, Ordering::Relaxed) < MAX_WAITING {
            return Some(Waiting);
        }
        WAITING.fetch_sub(1, Ordering::Relaxed);
        if let Some(suppressed) = DROPPED.admit() {
            tracing::warn!(
                suppressed,
                "{MAX_WAITING} changes wait for the quota store already: one it never sent is dropped"
            );
        }
        None
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        WAITING.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreErrorKind;

    fn unsent() -> StoreError {
        StoreError::new(StoreErrorKind::Unavailable, "away").unsent()
    }

    /// Sent again until the window ends, counting the time each try takes,
    /// not only the waits between them.
    #[tokio::test(start_paused = true)]
    async fn the_window_counts_the_tries_too() {
        let start = tokio::time::Instant::now();
        let mut tries = 0;
        let answer = again(Duration::from_secs(60), || {
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

    /// An answer other than "never sent" ends the tries.
    #[tokio::test(start_paused = true)]
    async fn an_answer_ends_the_tries() {
        let mut tries = 0;
        let answer = again(Duration::from_secs(60), || {
            tries += 1;
            let answer = if tries < 3 { Err(unsent()) } else { Ok(tries) };
            std::future::ready(answer)
        })
        .await;
        assert_eq!(answer.map(Result::ok), Some(Some(3)));
    }

    /// Nothing is sent again without a window, nor past the most changes
    /// waiting at once.
    #[tokio::test(start_paused = true)]
    async fn not_sent_again_without_a_window_or_room() {
        let never = || async { Ok::<_, StoreError>(()) };
        assert!(again(Duration::ZERO, never).await.is_none());
        let held: Vec<_> = std::iter::from_fn(Waiting::join)
            .take(MAX_WAITING + 1)
            .collect();
        assert!(held.len() <= MAX_WAITING);
        assert!(again(Duration::from_secs(60), never).await.is_none());
        drop(held);
        assert!(again(Duration::from_secs(60), never).await.is_some());
    }
}
