//! Counters in Redis, shared by every instance of an app.

// By role: the store and its calls (`store`), its settings (`builder`),
// the counters script and its replies (`script`), calls followed after
// their callers stopped waiting (`late`), charges sent together (`batch`),
// connections (`connection`), when each node of a cluster last answered
// (`nodes`), the server's clock (`clock`), Redis's
// failures as store errors (`errors`), and hashes (`hash`).

use std::time::Duration;

mod batch;
mod builder;
mod clock;
mod connection;
mod errors;
mod hash;
mod late;
#[cfg(feature = "redis-cluster")]
mod nodes;
mod script;
mod store;

pub use self::builder::RedisStoreBuilder;
pub use self::clock::ServerClock;
pub use self::store::{RedisChargeFuture, RedisStore};

#[cfg(all(feature = "testing", feature = "redis-cluster"))]
pub(crate) use self::connection::cluster_is_complete;

// What the batch and connection modules take from their parent.
use self::connection::{Connection, Fault};
use self::errors::{came_back, retires};
use self::late::{refund_lines, wait_for, LATE};
use self::script::{COUNTERS_LUA, FIELDS, SCRIPT};
use self::store::Inner;

/// Default time within which a call must be answered, all included (room
/// among the calls in flight, a connection, the round trip): 80 ms, below
/// the layer's default [store
/// timeout](crate::QuotaPolicyBuilder::store_timeout) of 100 ms, so that the
/// store's own error reaches the layer.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(80);
/// Default most calls one store has in flight at once.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 4096;
/// Default number of connections a store built from URLs keeps; each carries
/// any number of concurrent calls.
pub const DEFAULT_POOL_SIZE: usize = 2;
/// Default wait for room among the calls in flight: the whole
/// [budget](DEFAULT_TIMEOUT).
pub const DEFAULT_WAIT_TIMEOUT: Duration = DEFAULT_TIMEOUT;
/// Default time to open a connection. A connection still opening when its
/// caller's budget runs out is opened for the next callers.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Default time Redis has to answer: the whole [budget](DEFAULT_TIMEOUT).
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = DEFAULT_TIMEOUT;
/// Default time a calendar counter outlives its window.
pub const DEFAULT_CALENDAR_GRACE: Duration = Duration::from_secs(60);
/// Default spread of calendar counters' deadlines past the grace.
pub const DEFAULT_CALENDAR_JITTER: Duration = Duration::from_secs(60);

/// How long a call is followed after its caller stopped waiting, for its
/// answer (and, for a charge Redis applied, its refund). A connection that
/// stays silent this long is dropped.
const FOLLOW_THROUGH: Duration = Duration::from_secs(30);

/// How long a call waits with nothing at all back on its connection before
/// the connection is taken for silent (half-open, or the server stopped)
/// and new calls go to fresh ones. (Or the store's timeout, if longer.) A
/// connection merely busy keeps answering the calls sent before.
const SILENCE: Duration = Duration::from_secs(1);
