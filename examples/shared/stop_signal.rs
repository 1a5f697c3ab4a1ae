//! What tells the example servers to stop.

use tokio::sync::watch;

/// Ctrl-C and, on Unix, SIGTERM, counted from the moment they are listened
/// for: the handlers are in place at once, so a signal sent as soon as a
/// server says it listens stops it as gracefully as a later one (without
/// them, SIGTERM's default action would kill it on the spot).
#[derive(Clone)]
pub struct Stops(watch::Receiver<u32>);

impl Stops {
    /// Listens for the signals from now on, in a task of its own (within a
    /// tokio runtime).
    pub fn listen() -> Self {
        let (told, stops) = watch::channel(0u32);
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let mut term = signal(SignalKind::terminate()).expect("a SIGTERM handler");
            let mut interrupt = signal(SignalKind::interrupt()).expect("a SIGINT handler");
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = interrupt.recv() => {}
                    }
                    told.send_modify(|n| *n += 1);
                }
            });
        }
        #[cfg(not(unix))]
        tokio::spawn(async move {
            while tokio::signal::ctrl_c().await.is_ok() {
                told.send_modify(|n| *n += 1);
            }
        });
        Self(stops)
    }

    /// How many signals came so far.
    pub fn count(&self) -> u32 {
        *self.0.borrow()
    }

    /// Once `n` signals came in all.
    pub async fn reached(&self, n: u32) {
        let mut stops = self.0.clone();
        let _ = stops.wait_for(|&count| count >= n).await;
    }

    /// Once a signal comes after those counted so far.
    pub async fn another(&self) {
        self.reached(self.count() + 1).await;
    }
}
