//! The Redis server's time, for the layer's clock.

use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};

use super::store::RedisStore;
use crate::period::Clock;

/// A [`Clock`] that follows the Redis server's time; from
/// [`RedisStore::server_clock`].
#[derive(Clone)]
pub struct ServerClock {
    pub(super) offset: Arc<AtomicI64>,
}

impl ServerClock {
    /// The server's time minus the local time, as last measured.
    pub fn offset(&self) -> SignedDuration {
        SignedDuration::from_micros(self.offset.load(Ordering::Relaxed))
    }
}

impl Clock for ServerClock {
    fn now(&self) -> Timestamp {
        let local = Timestamp::now();
        local.saturating_add(self.offset()).unwrap_or(local)
    }
}

impl fmt::Debug for ServerClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerClock")
            .field("offset", &self.offset())
            .finish()
    }
}

pub(super) async fn refresh_offset(store: RedisStore, offset: Weak<AtomicI64>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        if offset.strong_count() == 0 {
            return;
        }
        match store.server_offset().await {
            Ok(measured) => match offset.upgrade() {
                Some(offset) => offset.store(measured, Ordering::Relaxed),
                None => return,
            },
            Err(error) => {
                tracing::debug!(%error, "could not refresh the Redis clock offset; keeping the last one")
            }
        }
    }
}
