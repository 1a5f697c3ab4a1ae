//! Tests that read what the crate logs, with a subscriber of their own
//! (`tracing::subscriber::set_default`), while other tests of the same file
//! run on other threads.

/// Keep it while a test's own subscriber (`set_default`) must see every
/// log line. With one subscriber registered, tracing works out a log line's
/// interest from the default subscriber of the thread that meets it first:
/// another test of this file, on another thread without one, would make
/// the line's interest "never" for every thread. With a second one
/// registered (this one, which takes nothing), every registered subscriber
/// is asked. The lines met already are asked again.
pub fn every_subscriber_asked() -> tracing::Dispatch {
    let second = tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());
    tracing::callsite::rebuild_interest_cache();
    second
}
