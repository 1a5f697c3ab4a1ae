//! Log lines that would repeat once per request (a store outage, a stream of
//! late answers) let through a few times per second, with a count of the
//! ones left out.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// Lets a few log lines through per second and counts the others.
pub(crate) struct Throttle {
    per_second: u32,
    /// The second (since the process's first failure) being counted, and
    /// the lines let through in it.
    second: AtomicU64,
    emitted: AtomicU32,
    suppressed: AtomicU64,
    start: OnceLock<Instant>,
}

impl Throttle {
    pub(crate) const fn new(per_second: u32) -> Self {
        Self {
            per_second,
            second: AtomicU64::new(0),
            emitted: AtomicU32::new(0),
            suppressed: AtomicU64::new(0),
            start: OnceLock::new(),
        }
    }

    /// Whether to log this one; if so, how many were suppressed since the
    /// last line.
    pub(crate) fn admit(&self) -> Option<u64> {
        self.admit_at(self.start.get_or_init(Instant::now).elapsed().as_secs())
    }

    fn admit_at(&self, second: u64) -> Option<u64> {
        if self.second.swap(second, Ordering::Relaxed) != second {
            self.emitted.store(0, Ordering::Relaxed);
        }
        if self.emitted.fetch_add(1, Ordering::Relaxed) < self.per_second {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_failures_are_logged_a_few_times_per_second_with_a_count() {
        let throttle = Throttle::new(2);
        assert_eq!(throttle.admit_at(7), Some(0));
        assert_eq!(throttle.admit_at(7), Some(0));
        for _ in 0..10 {
            assert_eq!(throttle.admit_at(7), None);
        }
        // The next second's first line says how many were left out.
        assert_eq!(throttle.admit_at(8), Some(10));
        assert_eq!(throttle.admit_at(8), Some(0));
        assert_eq!(throttle.admit_at(8), None);
    }
}
