//! The calendar window a quota's last request fell in, read without a write.

use std::sync::atomic::{fence, AtomicI32, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use jiff::Timestamp;

use super::Window;

/// The longest stamp kept: a date, a time and the longest IANA zone name
/// fit with room to spare. A window with a longer stamp is not kept (each
/// request then computes it).
const MAX_STAMP: usize = 64;

/// Words of the stamp's bytes.
const WORDS: usize = MAX_STAMP / 8;

/// One calendar window, shared by every request of a quota (and by its
/// clones), which read it without writing anything: a read lock, or a
/// reference count, would be a write to memory that every core shares, and
/// a core writing what another just wrote waits for it, on every request.
///
/// A sequence lock: a writer makes the sequence odd, writes the window, and
/// makes it even again; a reader reads the sequence, the window and the
/// sequence again, and keeps what it read only when the sequence was even
/// and did not change. Every field is an atomic, so a read that overlaps a
/// write reads stale or mixed values, never undefined ones, and throws
/// them away. Writes come once per window (a day, an hour), one at a time.
#[derive(Default)]
pub(crate) struct WindowCache {
    sequence: AtomicU64,
    /// The window's bounds, in seconds and nanoseconds.
    start: (AtomicI64, AtomicI32),
    end: (AtomicI64, AtomicI32),
    /// The stamp's length (0: no window kept) and bytes.
    len: AtomicUsize,
    stamp: [AtomicU64; WORDS],
    /// One writer at a time.
    writer: Mutex<()>,
}

impl WindowCache {
    /// Runs `f` on the window kept (its start, end, and the bytes of its
    /// stamp, a `str` read back whole), if it contains `at`; gives `f` back
    /// otherwise.
    pub(crate) fn with<R, F>(&self, at: Timestamp, f: F) -> Result<R, F>
    where
        F: FnOnce(Timestamp, Timestamp, &[u8]) -> R,
    {
        let before = self.sequence.load(Ordering::Acquire);
        if before % 2 == 1 {
            return Err(f);
        }
        let len = self.len.load(Ordering::Relaxed).min(MAX_STAMP);
        let start = (
            self.start.0.load(Ordering::Relaxed),
            self.start.1.load(Ordering::Relaxed),
        );
        let end = (
            self.end.0.load(Ordering::Relaxed),
            self.end.1.load(Ordering::Relaxed),
        );
        let mut stamp = [0; MAX_STAMP];
        // The words that hold the stamp, no more.
        for (bytes, word) in stamp[..len.div_ceil(8) * 8]
            .chunks_exact_mut(8)
            .zip(&self.stamp)
        {
            bytes.copy_from_slice(&word.load(Ordering::Relaxed).to_ne_bytes());
        }
        // The loads above happen before the sequence is read again.
        fence(Ordering::Acquire);
        if self.sequence.load(Ordering::Relaxed) != before || len == 0 {
            return Err(f);
        }
        let (Ok(start), Ok(end)) = (
            Timestamp::new(start.0, start.1),
            Timestamp::new(end.0, end.1),
        ) else {
            return Err(f);
        };
        if start <= at && at < end {
            Ok(f(start, end, &stamp[..len]))
        } else {
            Err(f)
        }
    }

    /// Keeps `window`, unless the one kept starts later (requests racing
    /// across a boundary keep the later window) or its stamp is too long.
    pub(crate) fn put(&self, window: &Window) {
        let text = window.stamp().as_bytes();
        if text.is_empty() || text.len() > MAX_STAMP {
            return;
        }
        let _writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let kept = Timestamp::new(
            self.start.0.load(Ordering::Relaxed),
            self.start.1.load(Ordering::Relaxed),
        );
        if self.len.load(Ordering::Relaxed) > 0 && kept.is_ok_and(|kept| kept >= window.start()) {
            return;
        }
        let sequence = self.sequence.load(Ordering::Relaxed);
        self.sequence.store(sequence + 1, Ordering::Relaxed);
        // The odd sequence is seen before any of the stores below.
        fence(Ordering::Release);
        self.start
            .0
            .store(window.start().as_second(), Ordering::Relaxed);
        self.start
            .1
            .store(window.start().subsec_nanosecond(), Ordering::Relaxed);
        self.end
            .0
            .store(window.end().as_second(), Ordering::Relaxed);
        self.end
            .1
            .store(window.end().subsec_nanosecond(), Ordering::Relaxed);
        let mut bytes = [0; MAX_STAMP];
        bytes[..text.len()].copy_from_slice(text);
        for (word, chunk) in self.stamp.iter().zip(bytes.chunks_exact(8)) {
            let chunk: [u8; 8] = chunk.try_into().expect("chunks of 8 bytes");
            word.store(u64::from_ne_bytes(chunk), Ordering::Relaxed);
        }
        self.len.store(text.len(), Ordering::Relaxed);
        self.sequence.store(sequence + 2, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use jiff::tz::TimeZone;

    use super::*;
    use crate::period::Period;

    fn at(text: &str) -> Timestamp {
        text.parse().expect("an instant")
    }

    /// The window kept, if it contains `at`: its start, end and stamp.
    fn read(cache: &WindowCache, at: Timestamp) -> Option<(Timestamp, Timestamp, String)> {
        cache
            .with(at, |start, end, stamp| {
                let stamp = std::str::from_utf8(stamp).expect("a stamp read whole");
                (start, end, stamp.to_owned())
            })
            .ok()
    }

    #[test]
    fn a_window_kept_is_read_back_whole_while_it_contains_the_instant() {
        let cache = WindowCache::default();
        let day =
            Period::day().in_time_zone(TimeZone::get("America/Argentina/ComodRivadavia").unwrap());
        let window = day.window(at("2026-12-05T12:00:00Z"));
        assert!(
            read(&cache, at("2026-12-05T12:00:00Z")).is_none(),
            "nothing kept yet"
        );
        cache.put(&window);
        let kept = read(&cache, at("2026-12-05T12:00:00Z")).expect("the window kept");
        assert_eq!(
            kept,
            (window.start(), window.end(), window.stamp().to_owned())
        );
        assert!(read(&cache, window.end()).is_none(), "the end is outside");
        assert!(
            read(&cache, window.start()).is_some(),
            "the start is inside"
        );
    }

    #[test]
    fn an_earlier_window_never_replaces_a_later_one() {
        let cache = WindowCache::default();
        let day = Period::day();
        let today = day.window(at("2026-12-05T12:00:00Z"));
        let yesterday = day.window(at("2026-12-04T12:00:00Z"));
        cache.put(&today);
        cache.put(&yesterday);
        assert_eq!(
            read(&cache, at("2026-12-05T12:00:00Z")).unwrap().2,
            today.stamp()
        );
        assert!(read(&cache, at("2026-12-04T12:00:00Z")).is_none());
    }

    #[test]
    fn a_stamp_too_long_to_keep_is_not_kept() {
        let cache = WindowCache::default();
        let long = Window::new(
            at("2026-12-05T00:00:00Z"),
            at("2026-12-06T00:00:00Z"),
            "x".repeat(MAX_STAMP + 1),
        );
        cache.put(&long);
        assert!(read(&cache, at("2026-12-05T12:00:00Z")).is_none());
        let longest = Window::new(
            at("2026-12-05T00:00:00Z"),
            at("2026-12-06T00:00:00Z"),
            "y".repeat(MAX_STAMP),
        );
        cache.put(&longest);
        assert_eq!(
            read(&cache, at("2026-12-05T12:00:00Z")).unwrap().2,
            longest.stamp()
        );
    }

    #[test]
    fn readers_racing_a_writer_see_one_whole_window_or_none() {
        // Windows whose stamps differ in length and bytes, and whose bounds
        // say which stamp goes with them: a torn read would pair them wrong.
        let windows: Vec<Window> = (0..64)
            .map(|i| {
                let start = Timestamp::from_second(1_000 * i).unwrap();
                let end = Timestamp::from_second(1_000 * i + 1_000).unwrap();
                Window::new(start, end, format!("{i}:{}", "z".repeat(i as usize % 50)))
            })
            .collect();
        let cache = Arc::new(WindowCache::default());
        // The writer writes until both readers made their rounds, then
        // says so; each reader then probes every window once more (the last
        // one stays kept, so it reads one at least).
        let rounds_done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let written = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let cache = Arc::clone(&cache);
                let windows = windows.clone();
                let (rounds_done, written) = (Arc::clone(&rounds_done), Arc::clone(&written));
                std::thread::spawn(move || {
                    let (mut seen, mut round, mut after) = (0, 0, 0);
                    while after < windows.len() {
                        if round == 200_000 {
                            rounds_done.fetch_add(1, Ordering::Release);
                        }
                        if written.load(Ordering::Acquire) {
                            after += 1;
                        }
                        let i = round % windows.len();
                        round += 1;
                        let probe = windows[i].start();
                        if let Some(kept) = read(&cache, probe) {
                            let expected = &windows[i];
                            assert_eq!(
                                kept,
                                (
                                    expected.start(),
                                    expected.end(),
                                    expected.stamp().to_owned()
                                )
                            );
                            seen += 1;
                        }
                    }
                    seen
                })
            })
            .collect();
        // A reader that ends before the writer is done saw a torn window
        // (it panicked): the writer stops, and the join below fails.
        while rounds_done.load(Ordering::Acquire) < 2
            && !readers.iter().any(std::thread::JoinHandle::is_finished)
        {
            // Start over: a fresh cache takes the earliest window again.
            cache.len.store(0, Ordering::Relaxed);
            for window in &windows {
                cache.put(window);
            }
        }
        written.store(true, Ordering::Release);
        let seen: usize = readers
            .into_iter()
            .map(|reader| reader.join().expect("no reader saw a torn window"))
            .sum();
        assert!(seen > 0, "the readers read no window");
    }
}
