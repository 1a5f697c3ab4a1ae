//! Changes the store never sent (it was away), sent again while their
//! counter's period lasts: a give-back that never lands leaves a request
//! charged that was not served, an add that never lands leaves a served
//! one under-counted.

use std::future::Future;
use std::time::Duration;

use jiff::Timestamp;

use super::StoreError;

/// The wait before a change the store never sent is sent again; doubled
/// after each try, up to [`MAX_WAIT`].
const FIRST_WAIT: Duration = Duration::from_millis(100);
const MAX_WAIT: Duration = Duration::from_secs(5);

/// How long a change of a counter that resets at `resets_at`, first sent
/// at `now`, is sent again: while its last wait still ends before the
/// reset. Past it, a counter with the same key is another period's, which
/// the request never spent.
pub(crate) fn window(now: Timestamp, resets_at: Timestamp) -> Duration {
    let left = Duration::try_from(resets_at.duration_since(now)).unwrap_or_default();
    left.saturating_sub(MAX_WAIT)
}

/// The answer of `send`, sent again after a growing wait (100 ms, doubled
/// up to 5 s) while the store answers that it never sent it, for as long
/// as `window`. Not sent again without a tokio runtime to wait on.
pub(crate) async fn resending<T, F, Fut>(window: Duration, mut send: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut wait = FIRST_WAIT;
    let mut waited = Duration::ZERO;
    loop {
        match send().await {
            Err(error)
                if error.is_unsent()
                    && waited < window
                    && tokio::runtime::Handle::try_current().is_ok() =>
            {
                tokio::time::sleep(wait).await;
                waited += wait;
                wait = (wait * 2).min(MAX_WAIT);
            }
            answer => return answer,
        }
    }
}
