//! Where "now" comes from.

use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use jiff::{SignedDuration, Timestamp};

/// A source of the current instant.
///
/// The layer asks its clock once per request and hands that instant to the
/// store, so one request sees one "now" from window selection to counter
/// expiry. Tests swap in a [`ManualClock`] to cross period boundaries without
/// sleeping.
pub trait Clock: Send + Sync + 'static {
    /// The current instant.
    fn now(&self) -> Timestamp;
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

/// The operating system's wall clock. The default.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// A clock that only moves when told to.
///
/// Clones share the same instant, so a test keeps one handle and gives a clone
/// to the layer.
///
/// ```
/// use tower_quota::ManualClock;
/// use jiff::{SignedDuration, Timestamp};
///
/// let start: Timestamp = "2026-12-02T23:59:59Z".parse().unwrap();
/// let clock = ManualClock::new(start);
/// clock.advance(SignedDuration::from_secs(1));
/// assert_eq!(clock.now().to_string(), "2026-12-03T00:00:00Z");
/// ```
#[derive(Clone)]
pub struct ManualClock {
    // Nanoseconds since the Unix epoch; i64 covers the years 1678 to 2262.
    nanos: Arc<AtomicI64>,
}

impl ManualClock {
    /// A clock stopped at `at`.
    ///
    /// # Panics
    ///
    /// When `at` lies outside what an `i64` of nanoseconds holds: before
    /// 1677-09-21T00:12:43.145224192Z or after
    /// 2262-04-11T23:47:16.854775807Z.
    pub fn new(at: Timestamp) -> Self {
        Self {
            nanos: Arc::new(AtomicI64::new(to_nanos(at))),
        }
    }

    /// The instant the clock shows.
    pub fn now(&self) -> Timestamp {
        Timestamp::from_nanosecond(i128::from(self.nanos.load(Ordering::SeqCst)))
            .expect("an i64 of nanoseconds is always a valid timestamp")
    }

    /// Moves the clock to `at` (backwards too).
    ///
    /// # Panics
    ///
    /// When `at` lies outside the range [`new`](Self::new) takes.
    pub fn set(&self, at: Timestamp) {
        self.nanos.store(to_nanos(at), Ordering::SeqCst);
    }

    /// Moves the clock forward by `by`: a [`std::time::Duration`], as the
    /// crate's settings and tokio's `time::advance` take, or a jiff
    /// [`SignedDuration`] (backwards when negative).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_quota::ManualClock;
    ///
    /// let clock = ManualClock::new("2026-12-02T23:59:00Z".parse().unwrap());
    /// clock.advance(Duration::from_secs(60));
    /// clock.advance(jiff::SignedDuration::from_mins(-2));
    /// assert_eq!(clock.now().to_string(), "2026-12-02T23:58:00Z");
    /// ```
    ///
    /// # Panics
    ///
    /// When the clock would leave the range [`new`](Self::new) and
    /// [`set`](Self::set) take (about the years 1678 to 2262): it never
    /// wraps around.
    pub fn advance<D>(&self, by: D)
    where
        D: TryInto<SignedDuration>,
        D::Error: fmt::Debug,
    {
        let by: SignedDuration = by.try_into().expect("advance by less than 292 years");
        let by = i64::try_from(by.as_nanos()).expect("advance by less than 292 years");
        self.nanos
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |nanos| {
                nanos.checked_add(by)
            })
            .expect("ManualClock covers the years 1678 to 2262");
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        ManualClock::now(self)
    }
}

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ManualClock").field(&self.now()).finish()
    }
}

fn to_nanos(at: Timestamp) -> i64 {
    i64::try_from(at.as_nanosecond()).expect("ManualClock covers the years 1678 to 2262")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "covers the years 1678 to 2262")]
    fn a_manual_clock_never_wraps_around() {
        let clock = ManualClock::new("2262-01-01T00:00:00Z".parse().unwrap());
        clock.advance(SignedDuration::from_hours(24 * 365));
    }

    #[test]
    fn a_manual_clock_moves_both_ways() {
        let start: Timestamp = "2026-12-05T00:00:00Z".parse().unwrap();
        let clock = ManualClock::new(start);
        clock.advance(SignedDuration::from_secs(90));
        assert_eq!(clock.now(), "2026-12-05T00:01:30Z".parse().unwrap());
        clock.advance(SignedDuration::from_secs(-120));
        assert_eq!(clock.now(), "2026-12-04T23:59:30Z".parse().unwrap());
    }
}
