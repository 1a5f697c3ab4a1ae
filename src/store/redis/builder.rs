//! The settings of a store, and the store they build.

use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::redis::{self, RedisError};
use deadpool_redis::Pool;
use tokio::sync::Semaphore;

use super::batch::Batches;
use super::connection::{Connections, ServerConnector, Shared};
use super::script::SCRIPT;
use super::store::{Inner, RedisStore};
use super::{
    DEFAULT_CALENDAR_GRACE, DEFAULT_CALENDAR_JITTER, DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_IN_FLIGHT, DEFAULT_POOL_SIZE, DEFAULT_TIMEOUT,
};
use crate::store::{StoreError, StoreErrorKind};

pub(super) enum Source {
    Url(String),
    Pool(Pool),
    #[cfg(feature = "redis-cluster")]
    ClusterUrls(Vec<String>),
    #[cfg(feature = "redis-cluster")]
    ClusterPool(deadpool_redis::cluster::Pool),
}

/// Settings of a [`RedisStore`]; from [`RedisStore::builder`] and friends.
///
/// | setting | default |
/// |---|---|
/// | [`timeout`](Self::timeout) | 80 ms |
/// | [`max_in_flight`](Self::max_in_flight) | 4096 |
/// | [`pool_size`](Self::pool_size) | 2 multiplexed connections |
/// | [`wait_timeout`](Self::wait_timeout) | the whole timeout |
/// | [`connect_timeout`](Self::connect_timeout) | 1 s |
/// | [`calendar_grace`](Self::calendar_grace) | 60 s |
/// | [`calendar_jitter`](Self::calendar_jitter) | 60 s |
///
/// The TCP connections the store opens itself (from a URL, plain or
/// cluster) send each request at once (`TCP_NODELAY`), probe a silent peer
/// after 5 s (keepalive), and on Linux fail when what they sent stays
/// unacknowledged for 3 s (`TCP_USER_TIMEOUT`): calls on a connection whose
/// peer vanished fail within seconds and free their room in
/// [`max_in_flight`](Self::max_in_flight), where they waited for their
/// follow-through. A pool made by the application keeps its own settings.
#[must_use]
pub struct RedisStoreBuilder {
    source: Source,
    pool_size: Option<usize>,
    timeout: Duration,
    wait_timeout: Option<Duration>,
    connect_timeout: Duration,
    max_in_flight: usize,
    calendar_grace: Duration,
    calendar_jitter: Duration,
    batch_charges: bool,
}

/// The longest budget a store takes: well within the time a call is
/// followed after its caller stopped waiting.
pub(super) const MAX_TIMEOUT: Duration = Duration::from_secs(10);

impl RedisStoreBuilder {
    pub(super) fn new(source: Source) -> Self {
        Self {
            source,
            pool_size: None,
            timeout: DEFAULT_TIMEOUT,
            wait_timeout: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            calendar_grace: DEFAULT_CALENDAR_GRACE,
            calendar_jitter: DEFAULT_CALENDAR_JITTER,
            batch_charges: true,
        }
    }

    /// The store's budget: the time within which every call is answered, all
    /// included (room among the calls in flight, a connection, the round
    /// trip). Default 80 ms. A call not answered in time fails with
    /// [`StoreErrorKind::Timeout`]; a charge that did is given back if Redis
    /// applies it later, so it charges nothing. While Redis keeps answering
    /// other calls of the store (slow under load, not stalled), a round trip
    /// is waited for until the budget has passed since Redis last answered,
    /// up to ten budgets (and 10 s) in all: load alone is not a failure. (On
    /// a cluster, a call once sent waits with its own node's answers.
    /// Answers on other connections do not count for a call sent on a
    /// connection that gave nothing back since: one gone silent, half-open
    /// beside others, fails its calls a budget after they left.)
    ///
    /// Keep it below the layer's [store
    /// timeout](crate::QuotaPolicyBuilder::store_timeout) (100 ms by
    /// default), which stays an outer bound: past it the layer answers
    /// without the store's own error.
    ///
    /// # Panics
    ///
    /// When `timeout` is longer than 10 s: a call is followed for 30 s
    /// from when it was sent, to give its charge back if Redis applies it
    /// late, and that must leave time past the budget.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        assert!(
            timeout <= MAX_TIMEOUT,
            "a Redis store's timeout is at most {MAX_TIMEOUT:?} (got {timeout:?})"
        );
        self.timeout = timeout;
        self
    }

    /// The most calls the store has in flight at once (default 4096): sent
    /// to Redis or about to be, and not yet answered, including charges
    /// followed after their callers stopped waiting. A call waits for room
    /// while Redis answers the calls in flight; one that finds none after
    /// Redis answered nothing for its [wait](Self::wait_timeout) fails with
    /// [`StoreErrorKind::Timeout`] and sends nothing: this sheds only load
    /// that Redis does not answer, such as during a stall.
    ///
    /// The budget is the whole store's. A followed call keeps its room for
    /// up to 30 s, so on a cluster, a node that stalls (without being
    /// declared failed) and whose subjects are sent many calls would fill
    /// it, and starve the nodes that answer. So the calls of one node hold
    /// at most half of it, whether they came one by one or in a burst
    /// before the node was known to stall: past that, a call to the node
    /// waits for one of them to end, as long as the node answers (a busy
    /// node's calls wait, never fail), and fails with
    /// [`StoreErrorKind::Timeout`], sending nothing, once the node has
    /// answered nothing for the store's [timeout](Self::timeout). A node
    /// silent that long since a call of its own was given up on (an idle
    /// node is not silent) is sent nothing: its calls fail at once, within
    /// its half or not. The other nodes' calls find room.
    ///
    /// # Panics
    ///
    /// When `max` is zero.
    pub fn max_in_flight(mut self, max: usize) -> Self {
        assert!(max > 0, "a Redis store needs room for one call");
        self.max_in_flight = max.min(Semaphore::MAX_PERMITS);
        self
    }

    /// How many multiplexed connections the store keeps (default 2; for a
    /// cluster, cluster connections, each multiplexing per node; ignored for
    /// an existing pool). Every call uses one of them, round robin, at the
    /// same time as any others: this is not a bound on concurrent calls
    /// ([`max_in_flight`](Self::max_in_flight) is). More than a few rarely
    /// helps.
    ///
    /// # Panics
    ///
    /// When `size` is zero.
    pub fn pool_size(mut self, size: usize) -> Self {
        assert!(size > 0, "a Redis store needs at least one connection");
        self.pool_size = Some(size);
        self
    }

    /// Part of the [budget](Self::timeout): how long a call waits for room
    /// among the calls in flight while Redis answers none of them, or, on an
    /// existing pool, for a pooled connection (default: the whole budget; a
    /// longer wait is the whole budget too). As with the budget, a wait
    /// goes on while Redis answers other calls, up to ten times this.
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = Some(timeout);
        self
    }

    /// How long opening a connection may take (default 1 s). A caller waits
    /// for a connection within its [budget](Self::timeout) only; one still
    /// opening when the budget runs out is opened for the next calls.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long a calendar counter outlives its window (default 60 s), so an
    /// instance whose clock lags a little still finds the window's real
    /// count instead of a fresh counter.
    pub fn calendar_grace(mut self, grace: Duration) -> Self {
        self.calendar_grace = grace;
        self
    }

    /// The most a calendar counter's deadline is pushed past the grace
    /// (default 60 s), drawn per key so that the counters of all subjects are
    /// not reclaimed in the same instant. Zero disables it.
    pub fn calendar_jitter(mut self, jitter: Duration) -> Self {
        self.calendar_jitter = jitter;
        self
    }

    /// Whether concurrent charges on a single server leave in batches (the
    /// default), one `EVALSHA` for many subjects' charges. Turn it off when
    /// the URL is not one Redis server but a proxy or a sharded endpoint
    /// that routes each command by its first key (twemproxy, Envoy, a
    /// sharded managed database): each charge then goes on its own, as on a
    /// cluster, where batches are never used.
    pub fn batch_charges(mut self, batch: bool) -> Self {
        self.batch_charges = batch;
        self
    }

    /// The store.
    ///
    /// # Errors
    ///
    /// When the URL is not a Redis URL.
    pub fn build(self) -> Result<RedisStore, StoreError> {
        let invalid = |what: &str, e: RedisError| {
            StoreError::new(StoreErrorKind::Other, format!("invalid Redis {what}")).with_source(e)
        };
        let size = self.pool_size.unwrap_or(DEFAULT_POOL_SIZE);
        let last_answer = Arc::new(crate::store::patience::LastAnswer::new());
        let connections = match self.source {
            Source::Url(url) => {
                let info = redis::IntoConnectionInfo::into_connection_info(url.as_str())
                    .map_err(|e| invalid("URL", e))?
                    .set_tcp_settings(tcp_settings());
                let connector = ServerConnector {
                    client: redis::Client::open(info).map_err(|e| invalid("URL", e))?,
                    // No response timeout: each call is followed to its
                    // answer (see `follow_through`).
                    config: redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(self.connect_timeout))
                        .set_response_timeout(None),
                };
                Connections::Server(Arc::new(Shared::new(
                    connector,
                    size,
                    self.connect_timeout,
                    Some(Arc::clone(&last_answer)),
                )))
            }
            Source::Pool(pool) => Connections::Pool(pool, Arc::clone(&last_answer)),
            #[cfg(feature = "redis-cluster")]
            Source::ClusterUrls(urls) => {
                let first = urls.first().cloned().unwrap_or_default();
                let client = redis::cluster::ClusterClientBuilder::new(urls)
                    // A charge is never sent twice; see the connection module.
                    .retries(0)
                    .tcp_settings(tcp_settings())
                    .connection_timeout(self.connect_timeout)
                    .response_timeout(super::FOLLOW_THROUGH)
                    .build()
                    .map_err(|e| invalid("cluster URLs", e))?;
                // How to reach a node a redirect names, as the first URL
                // says (credentials, TLS).
                let seed = redis::IntoConnectionInfo::into_connection_info(first.as_str())
                    .map_err(|e| invalid("cluster URLs", e))?
                    .set_tcp_settings(tcp_settings());
                let outside = super::connection::Outside::new(
                    seed,
                    redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(self.connect_timeout))
                        .set_response_timeout(Some(super::FOLLOW_THROUGH)),
                );
                Connections::Cluster(Arc::new(Shared::new(
                    super::connection::ClusterConnector {
                        client,
                        outside: Arc::new(outside),
                    },
                    size,
                    self.connect_timeout,
                    // A check's answer names no node (see `Inner::heard`).
                    None,
                )))
            }
            #[cfg(feature = "redis-cluster")]
            Source::ClusterPool(pool) => Connections::ClusterPool(pool),
        };
        // A cluster keeps each charge on its own: the keys of one batch would
        // live on many nodes.
        let (cluster, size) = connections.status();
        let batches = match &connections {
            _ if cluster || !self.batch_charges => None,
            // A pooled connection carries one batch at a time.
            Connections::Pool(..) => Some(Batches::new(size.min(16))),
            _ => Some(Batches::new((2 * size).min(16))),
        };
        Ok(RedisStore {
            inner: Arc::new(Inner {
                connections,
                batches,
                script: &SCRIPT,
                timeout: self.timeout,
                // Within the budget: a longer wait (`Duration::MAX` for no
                // bound of its own) is the whole budget, never an instant
                // past the end of the clock.
                wait_timeout: self
                    .wait_timeout
                    .map_or(self.timeout, |wait| wait.min(self.timeout)),
                connect_timeout: self.connect_timeout,
                max_in_flight: self.max_in_flight,
                in_flight: Arc::new(Semaphore::new(self.max_in_flight)),
                charges: Arc::default(),
                given_back: AtomicU64::new(0),
                calendar_grace: self.calendar_grace,
                calendar_jitter: self.calendar_jitter,
                last_answer,
                unanswered: Default::default(),
                #[cfg(feature = "redis-cluster")]
                nodes: cluster.then(super::nodes::NodeAnswers::new),
            }),
        })
    }
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match &self.source {
            Source::Url(_) => "url",
            Source::Pool(_) => "pool",
            #[cfg(feature = "redis-cluster")]
            Source::ClusterUrls(_) => "cluster urls",
            #[cfg(feature = "redis-cluster")]
            Source::ClusterPool(_) => "cluster pool",
        };
        f.debug_struct("RedisStoreBuilder")
            .field("source", &source)
            .field("pool_size", &self.pool_size)
            .field("timeout", &self.timeout)
            .field("wait_timeout", &self.wait_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("max_in_flight", &self.max_in_flight)
            .field("calendar_grace", &self.calendar_grace)
            .field("calendar_jitter", &self.calendar_jitter)
            .finish()
    }
}

/// How long data sent to Redis may stay unacknowledged before the kernel
/// fails the connection (Linux's `TCP_USER_TIMEOUT`).
#[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(3);

/// The TCP settings of the connections the store opens itself: requests
/// leave at once (no Nagle delay behind an unanswered one), and a connection
/// whose peer vanished without a word (a host gone, a NAT that forgot it)
/// fails within seconds, where the calls on it would wait for their follow
/// through (30 s) holding their room in `max_in_flight`: keepalive probes
/// after 5 s of silence, and on Linux a bound on unacknowledged data. A
/// Redis that is stalled but alive still acknowledges what it is sent, as
/// long as its socket's buffers hold it: a stall past the bound with some
/// thousands of calls queued fails the connection too, and what Redis runs
/// of them later has no answer to follow (the store's docs, Faults).
fn tcp_settings() -> redis::io::tcp::TcpSettings {
    let keepalive = redis::io::tcp::socket2::TcpKeepalive::new().with_time(Duration::from_secs(5));
    #[cfg(any(target_os = "linux", target_os = "macos", target_os = "windows"))]
    let keepalive = keepalive.with_interval(Duration::from_secs(1));
    let settings = redis::io::tcp::TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive);
    #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
    let settings = settings.set_user_timeout(TCP_USER_TIMEOUT);
    settings
}

#[cfg(test)]
mod timeout_tests {
    use std::time::Duration;

    use crate::store::RedisStore;

    #[test]
    fn a_budget_of_ten_seconds_is_taken() {
        let _ = RedisStore::builder("redis://127.0.0.1:1").timeout(Duration::from_secs(10));
    }

    /// A charge Redis applies after its caller stopped waiting is followed
    /// for 30 s from when it was sent: a budget near that would leave it
    /// unfollowed, and charged.
    #[test]
    #[should_panic(expected = "timeout is at most")]
    fn a_budget_near_the_follow_through_is_refused() {
        let _ = RedisStore::builder("redis://127.0.0.1:1").timeout(Duration::from_secs(31));
    }
}
