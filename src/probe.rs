//! What a layer finds inside the service it wraps, when it is built.
//!
//! A layer must know, before it calls the service it wraps, whether the
//! request will pass more layers of its policy on the way to the handler:
//! then it charges their quotas too, in the same charge. Services are opaque
//! (axum boxes every route), but they are cloned through: cloning an axum
//! route clones the layers and handler inside it. So a layer, when it is
//! built, clones the service it wraps once while a probe is open on the
//! thread, and every quota service of the policy cloned meanwhile announces
//! its scope. The `unrouted` handlers announce themselves too: a layer
//! around them keeps its store at hand to give their charge back.
//!
//! A service whose clone does not reach inside (one shared behind an `Arc`)
//! hides its layers: they then charge on their own (see
//! the service's module), which is correct but no longer one decision.

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use crate::config::Scope;

thread_local! {
    // How many probes are open on this thread: cloning a quota service
    // checks it on every request, so it is a plain counter.
    static OPEN: Cell<u32> = const { Cell::new(0) };
    static FOUND: RefCell<Vec<Found>> = const { RefCell::new(Vec::new()) };
}

/// What one probe found.
#[derive(Clone, Default)]
pub(crate) struct Found {
    policy: u64,
    pub(crate) scopes: Vec<Arc<Scope>>,
    pub(crate) unrouted: bool,
}

impl Found {
    /// Whether two probes found the same.
    pub(crate) fn same_as(&self, other: &Found) -> bool {
        self.unrouted == other.unrouted
            && self.scopes.len() == other.scopes.len()
            && self
                .scopes
                .iter()
                .zip(&other.scopes)
                .all(|(a, b)| a.id == b.id)
    }
}

/// Runs `clone` (which should clone the wrapped service) with a probe open
/// for `policy`, and returns what announced itself.
pub(crate) fn discover(policy: u64, clone: impl FnOnce()) -> Found {
    FOUND.with(|found| {
        found.borrow_mut().push(Found {
            policy,
            ..Found::default()
        })
    });
    OPEN.with(|open| open.set(open.get() + 1));
    // Closes the probe even when `clone` panics.
    struct Close;
    impl Drop for Close {
        fn drop(&mut self) {
            OPEN.with(|open| open.set(open.get() - 1));
            FOUND.with(|found| {
                found.borrow_mut().pop();
            });
        }
    }
    let close = Close;
    clone();
    let found = FOUND.with(|found| {
        let mut found = found.borrow_mut();
        let top = found.last_mut().expect("the probe is open");
        std::mem::take(top)
    });
    drop(close);
    found
}

/// Called by a quota service of `policy` being cloned.
pub(crate) fn announce_scope(policy: u64, scope: &Arc<Scope>) {
    if OPEN.with(Cell::get) == 0 {
        return;
    }
    FOUND.with(|found| {
        for probe in found.borrow_mut().iter_mut() {
            if probe.policy == policy && !probe.scopes.iter().any(|s| s.id == scope.id) {
                probe.scopes.push(Arc::clone(scope));
            }
        }
    });
}

/// Called by a handler of the router's "no such route" answers being cloned.
#[cfg_attr(not(feature = "axum"), allow(dead_code))]
pub(crate) fn announce_unrouted() {
    if OPEN.with(Cell::get) == 0 {
        return;
    }
    FOUND.with(|found| {
        for probe in found.borrow_mut().iter_mut() {
            probe.unrouted = true;
        }
    });
}
