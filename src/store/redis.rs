//! Counters in Redis, shared by every instance of an app.

use std::fmt;
use std::future::Future;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use deadpool::managed::{PoolConfig, PoolError, Timeouts};
use deadpool::Runtime;
use deadpool_redis::redis::{self, ErrorKind, RedisError, Script};
use deadpool_redis::Pool;
use jiff::{SignedDuration, Timestamp};

use super::{ChargeOutcome, ChargeRequest, Lifetime, Store, StoreError, StoreErrorKind, Usage};
use crate::key::PeriodKey;
use crate::period::Clock;

use self::connection::{Connection, Connections, ServerManager};

mod connection;

/// The counters script: check-then-commit for charges, plus peek, refund,
/// add and the server's time, so that one SHA serves every call.
const COUNTERS_LUA: &str = include_str!("redis/counters.lua");

/// Fields per line in the script's reply.
const FIELDS: usize = 5;

/// The key that routes the server-time call on a cluster; never written.
const CLOCK_KEY: &str = "tower-quota:{clock}";

/// Default wait for a free pooled connection.
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_millis(50);
/// Default number of connections a store built from a URL may open.
pub const DEFAULT_POOL_SIZE: usize = 32;
/// Default time to open a connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_millis(50);
/// Default time to wait for Redis to answer a command.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_millis(50);
/// Default time a calendar counter outlives its window.
pub const DEFAULT_CALENDAR_GRACE: Duration = Duration::from_secs(60);
/// Default spread of calendar counters' deadlines past the grace.
pub const DEFAULT_CALENDAR_JITTER: Duration = Duration::from_secs(60);

/// Counters in Redis (or Valkey, 6.2 and later), so that any number of app
/// instances enforce one quota exactly.
///
/// # How counters are kept
///
/// - **One round trip, atomic.** Every charge is one `EVALSHA` of one Lua
///   script (loaded again if the server answers `NOSCRIPT`), which checks
///   every line of the request and then commits all of them or none. All
///   keys of a subject share the key's `{subject}` hash tag, so the script
///   is valid on a cluster too.
/// - **First-use counters keep their deadline.** A counter is a hash of the
///   count and the first call's instant. Its deadline is set with `PEXPIRE`
///   only in the script that creates it, and every later write is a
///   `HINCRBY`, which keeps it: hits never re-date a counter. A counter
///   found without a deadline (written by another tool, or restored without
///   one) is healed by the next charge, to first call + period when the
///   first call is known, else to one period from now, and the healing is
///   logged at `warn`. The reset reported to clients is the counter's
///   remaining life.
/// - **Calendar counters** carry the window's stamp in their key. Their
///   deadline is housekeeping only: the window's end plus
///   [a grace](RedisStoreBuilder::calendar_grace) plus [a
///   jitter](RedisStoreBuilder::calendar_jitter) drawn from the key, so that
///   the counters of all subjects are not reclaimed in one instant. It is set
///   only when missing. The reset reported is the window's end.
/// - **Refunds** (`HINCRBY` by a negative amount, in a script that checks the
///   counter exists) never create a counter and never touch a deadline.
/// - **Adds** after the fact ([`Store::add`]) are the same `HINCRBY` the
///   other way: a missing counter stays missing, the deadline stays as it
///   was, and a count that would go beyond 2^53 (what the script counts
///   exactly) is refused with a [`StoreError`] before anything is written.
///
/// # Faults
///
/// Waiting for a pooled connection, opening one and waiting for an answer
/// are each bounded ([defaults](RedisStoreBuilder) in tens of milliseconds).
/// A lost connection, a restarting server, `OOM` under `noeviction` and a
/// timeout all become a [`StoreError`], which the layer's
/// [`OnStoreError`](crate::OnStoreError) policy answers. Nothing is queued
/// beyond the pool's size plus the callers waiting for it, and a charge that
/// failed or timed out is never sent again (it may have been applied).
/// A connection whose command failed on the wire is closed instead of going
/// back to the pool, and so are the idle ones, which most likely broke with
/// it; one that sat idle for a second is pinged before it is used again. So
/// requests succeed again as soon as Redis is back.
///
/// # Connections
///
/// A store built from a URL keeps a deadpool pool of its own: a connection
/// used within the last second is handed out without the `PING` that
/// deadpool-redis's stock pool sends on every checkout (a second round trip
/// per charge, which halves the store's throughput). On a cluster, the
/// client never retries a request by itself, so a charge is never applied
/// twice; a request caught by a slot migration fails, and the next one goes
/// to the slot's new node. A store built from an existing
/// `deadpool_redis::Pool` keeps that pool's behaviour.
///
/// # What the quota depends on
///
/// - `maxmemory-policy noeviction`: an evicted counter gives its subject a
///   fresh allowance. With `noeviction` a full server refuses charges
///   instead, which the layer reports as a store error.
/// - Persistence (AOF or RDB) and replication decide what a restart or a
///   failover loses: counters written after the last save, or not yet
///   replicated, are lost, and their subjects are charged from zero.
/// - No other writer on the keys of the layer's namespace.
///
/// # Time
///
/// Keys and deadlines are computed from the layer's clock (by default each
/// instance's own). Deadlines are sent as durations (`PEXPIRE`), so a skewed
/// instance never shortens or lengthens a period; but instances whose clocks
/// disagree may name different calendar windows around a boundary. Where
/// that matters, give the layer [`RedisStore::server_clock`], which reads the
/// server's `TIME`.
///
/// # Example
///
/// ```no_run
/// use axum::{routing::get, Router};
/// use tower_quota::store::RedisStore;
/// use tower_quota::{FromHeader, QuotaLayer};
///
/// # async fn run() -> Result<(), tower_quota::StoreError> {
/// let store = RedisStore::new("redis://127.0.0.1:6379/")?;
/// let app: Router = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .layer(QuotaLayer::daily(1_000, FromHeader::account("x-account-id")).store(store));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    connections: Connections,
    script: Script,
    wait_timeout: Duration,
    connect_timeout: Duration,
    response_timeout: Duration,
    calendar_grace: Duration,
    calendar_jitter: Duration,
}

enum Source {
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
/// | [`pool_size`](Self::pool_size) | 32 |
/// | [`wait_timeout`](Self::wait_timeout) | 50 ms |
/// | [`connect_timeout`](Self::connect_timeout) | 50 ms |
/// | [`response_timeout`](Self::response_timeout) | 50 ms |
/// | [`calendar_grace`](Self::calendar_grace) | 60 s |
/// | [`calendar_jitter`](Self::calendar_jitter) | 60 s |
#[must_use]
pub struct RedisStoreBuilder {
    source: Source,
    pool_size: Option<usize>,
    wait_timeout: Duration,
    connect_timeout: Duration,
    response_timeout: Duration,
    calendar_grace: Duration,
    calendar_jitter: Duration,
}

impl RedisStore {
    /// A store on the Redis server at `url` (e.g. `redis://127.0.0.1:6379/`)
    /// with default settings. No connection is opened until the first call.
    ///
    /// # Errors
    ///
    /// When `url` is not a Redis URL.
    pub fn new(url: impl Into<String>) -> Result<Self, StoreError> {
        Self::builder(url).build()
    }

    /// Settings for a store on the Redis server at `url`.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder::new(Source::Url(url.into()))
    }

    /// A store on an existing pool, with default settings. The pool's own
    /// size and timeouts apply, bounded by the store's timeouts. Note that
    /// deadpool-redis's pools ping every connection they hand out.
    pub fn from_pool(pool: Pool) -> Self {
        Self::builder_from_pool(pool)
            .build()
            .expect("a store on an existing pool has nothing to fail on")
    }

    /// Settings for a store on an existing pool.
    pub fn builder_from_pool(pool: Pool) -> RedisStoreBuilder {
        RedisStoreBuilder::new(Source::Pool(pool))
    }

    /// Settings for a store on the Redis Cluster reached through `urls` (any
    /// of its nodes).
    #[cfg(feature = "redis-cluster")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis-cluster")))]
    pub fn cluster_builder<I, U>(urls: I) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = U>,
        U: Into<String>,
    {
        RedisStoreBuilder::new(Source::ClusterUrls(
            urls.into_iter().map(Into::into).collect(),
        ))
    }

    /// Settings for a store on an existing cluster pool. Note that
    /// deadpool-redis's cluster client retries failed requests (after a
    /// connection error too, when a charge may already have been applied);
    /// [`RedisStore::cluster_builder`] builds one that does not.
    #[cfg(feature = "redis-cluster")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis-cluster")))]
    pub fn cluster_builder_from_pool(pool: deadpool_redis::cluster::Pool) -> RedisStoreBuilder {
        RedisStoreBuilder::new(Source::ClusterPool(pool))
    }

    /// Opens a connection and loads the counters script, so that the first
    /// requests pay for neither; call it at startup to learn at once whether
    /// Redis can be reached.
    ///
    /// # Errors
    ///
    /// When Redis cannot be reached or refuses the script.
    pub async fn preload(&self) -> Result<(), StoreError> {
        let script = &self.inner.script;
        let sha: String = self
            .exchange(|mut conn| async move {
                let result = script.load_async(&mut conn).await;
                (conn, result)
            })
            .await?;
        if sha != script.get_hash() {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                format!(
                    "Redis loaded the counters script as {sha}, expected {}",
                    script.get_hash()
                ),
            ));
        }
        Ok(())
    }

    /// The SHA1 of the counters script, as used with `EVALSHA`.
    pub fn script_sha(&self) -> &str {
        self.inner.script.get_hash()
    }

    /// The counters script's source.
    pub fn script_source() -> &'static str {
        COUNTERS_LUA
    }

    /// A clock that reads the Redis server's time: the local clock plus the
    /// offset to the server's `TIME`, measured now and again every
    /// `refresh`. Give it to the layer ([`QuotaLayer::clock`]) so that all
    /// instances agree on calendar windows even when their own clocks are
    /// skewed.
    ///
    /// The local clock stays the default: it costs no round trip, keeps
    /// working while Redis is unreachable (so a fail-open layer still names
    /// the right window), and synchronised hosts differ by far less than a
    /// period. Use the server's clock when instance clocks cannot be trusted.
    ///
    /// The offset is refreshed in a tokio task that ends when the last clone
    /// of the clock is dropped; a failed refresh keeps the last offset.
    ///
    /// # Errors
    ///
    /// When the first reading fails.
    ///
    /// [`QuotaLayer::clock`]: crate::QuotaLayer::clock
    pub async fn server_clock(&self, refresh: Duration) -> Result<ServerClock, StoreError> {
        let offset = Arc::new(AtomicI64::new(self.server_offset().await?));
        let weak = Arc::downgrade(&offset);
        let store = self.clone();
        let refresh = refresh.max(Duration::from_millis(10));
        tokio::spawn(refresh_offset(store, weak, refresh));
        Ok(ServerClock { offset })
    }

    /// The server's time minus the local time, in microseconds.
    async fn server_offset(&self) -> Result<i64, StoreError> {
        let before = Timestamp::now();
        let mut invocation = self.inner.script.key(CLOCK_KEY);
        invocation.arg("t");
        let (secs, micros): (i64, i64) = self
            .exchange(|mut conn| async move {
                let result = invocation.invoke_async(&mut conn).await;
                (conn, result)
            })
            .await?;
        let after = Timestamp::now();
        let local = (before.as_microsecond() + after.as_microsecond()) / 2;
        Ok(secs * 1_000_000 + micros - local)
    }

    /// Takes a connection and runs `f` on it, each step within its timeout.
    /// A connection whose command failed on the wire is closed rather than
    /// returned to the pool; nothing is sent again.
    async fn exchange<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(Connection) -> Fut,
        Fut: Future<Output = (Connection, Result<T, RedisError>)>,
    {
        let inner = &self.inner;
        let timeouts = Timeouts {
            wait: Some(inner.wait_timeout),
            create: Some(inner.connect_timeout),
            recycle: Some(inner.response_timeout),
        };
        let get = inner.wait_timeout + inner.connect_timeout + inner.response_timeout;
        let conn = match tokio::time::timeout(get, inner.connections.get(&timeouts)).await {
            Ok(conn) => conn.map_err(pool_error)?,
            Err(_) => {
                return Err(StoreError::new(
                    StoreErrorKind::Timeout,
                    "no Redis connection could be had in time",
                ))
            }
        };
        // The store's own pools give each connection the response timeout;
        // others are bounded here.
        let answer = if inner.connections.time_their_answers() {
            f(conn).await
        } else {
            match tokio::time::timeout(inner.response_timeout, f(conn)).await {
                Ok(answer) => answer,
                Err(_) => {
                    return Err(StoreError::new(
                        StoreErrorKind::Timeout,
                        "Redis did not answer in time",
                    ))
                }
            }
        };
        match answer {
            (_, Ok(value)) => Ok(value),
            (conn, Err(error)) => {
                // A late answer does not spoil a multiplexed connection; a
                // broken one is closed so the pool opens a fresh one.
                if !error.is_timeout() && (error.is_unrecoverable_error() || error.is_io_error()) {
                    conn.discard();
                    inner.connections.close_idle();
                }
                Err(redis_error(error))
            }
        }
    }

    /// Runs `command` on the counters' connection; for tests and tools.
    #[cfg(feature = "testing")]
    pub(crate) async fn command<T: redis::FromRedisValue>(
        &self,
        command: redis::Cmd,
    ) -> Result<T, StoreError> {
        self.exchange(|mut conn| async move {
            let result = command.query_async(&mut conn).await;
            (conn, result)
        })
        .await
    }

    async fn lines(
        self,
        op: &'static str,
        request: ChargeRequest,
    ) -> Result<ChargeOutcome, StoreError> {
        if request.lines.is_empty() {
            return Ok(ChargeOutcome {
                admitted: true,
                usage: Vec::new(),
            });
        }
        let now = request.now;
        let now_ms = now.as_millisecond();
        let mut invocation = self.inner.script.prepare_invoke();
        invocation.arg(op).arg(now_ms);
        for line in &request.lines {
            let (anchor, ttl) = match line.lifetime {
                Lifetime::FirstUse { deadline } => ("f", millis_until(now, deadline)),
                Lifetime::Calendar { end, .. } => {
                    let housekeeping = millis_until(now, end)
                        .saturating_add(as_millis(self.inner.calendar_grace))
                        .saturating_add(jitter(&line.key, self.inner.calendar_jitter));
                    ("c", housekeeping)
                }
            };
            invocation
                .key(line.key.as_str())
                .arg(clamp(line.limit))
                .arg(clamp(line.cost))
                .arg(anchor)
                .arg(ttl);
        }
        let reply: Vec<i64> = self
            .exchange(|mut conn| async move {
                let result = invocation.invoke_async(&mut conn).await;
                (conn, result)
            })
            .await?;
        if reply.len() != 1 + FIELDS * request.lines.len() {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                format!("unexpected reply from the counters script: {reply:?}"),
            ));
        }
        let admitted = reply[0] == 1;
        let usage = request
            .lines
            .iter()
            .zip(reply[1..].chunks_exact(FIELDS))
            .map(|(line, fields)| {
                // `remaining` is for other readers of the script's reply;
                // `Usage` works it out from the limit.
                let &[used, _remaining, pttl, first_call, heal] = fields else {
                    unreachable!("chunks of {FIELDS}")
                };
                if heal != 0 {
                    log_heal(&line.key, heal, op == "c");
                }
                let used = u64::try_from(used).unwrap_or(0);
                match line.lifetime {
                    Lifetime::Calendar { end, .. } => Usage {
                        limit: line.limit,
                        used,
                        resets_at: end,
                        first_call: None,
                    },
                    Lifetime::FirstUse { deadline } => Usage {
                        limit: line.limit,
                        used,
                        resets_at: if pttl >= 0 {
                            now.saturating_add(SignedDuration::from_millis(pttl))
                                .unwrap_or(deadline)
                        } else {
                            deadline
                        },
                        first_call: (first_call >= 0)
                            .then(|| Timestamp::from_millisecond(first_call).ok())
                            .flatten(),
                    },
                }
            })
            .collect();
        Ok(ChargeOutcome { admitted, usage })
    }
}

impl RedisStoreBuilder {
    fn new(source: Source) -> Self {
        Self {
            source,
            pool_size: None,
            wait_timeout: DEFAULT_WAIT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            calendar_grace: DEFAULT_CALENDAR_GRACE,
            calendar_jitter: DEFAULT_CALENDAR_JITTER,
        }
    }

    /// The most connections the store opens (default 32; ignored for an
    /// existing pool). Each call holds one for its round trip, so this is how
    /// many calls can be in flight; the others wait up to the
    /// [wait timeout](Self::wait_timeout).
    ///
    /// # Panics
    ///
    /// When `size` is zero.
    pub fn pool_size(mut self, size: usize) -> Self {
        assert!(size > 0, "a Redis store needs at least one connection");
        self.pool_size = Some(size);
        self
    }

    /// How long a call waits for a free pooled connection before it fails
    /// with [`StoreErrorKind::Timeout`] (default 50 ms). This bounds the queue
    /// in front of the pool.
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = timeout;
        self
    }

    /// How long opening a connection may take (default 50 ms).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long Redis may take to answer a command (default 50 ms). A charge
    /// that times out fails with [`StoreErrorKind::Timeout`] and is not sent
    /// again.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
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

    /// The store.
    ///
    /// # Errors
    ///
    /// When the URL is not a Redis URL, or the pool cannot be built.
    pub fn build(self) -> Result<RedisStore, StoreError> {
        let timeouts = Timeouts {
            wait: Some(self.wait_timeout),
            create: Some(self.connect_timeout),
            recycle: Some(self.response_timeout),
        };
        let pool_config = |size: Option<usize>| {
            let mut config = PoolConfig::new(size.unwrap_or(DEFAULT_POOL_SIZE));
            config.timeouts = timeouts;
            config
        };
        let invalid = |what: &str, e: RedisError| {
            StoreError::new(StoreErrorKind::Other, format!("invalid Redis {what}")).with_source(e)
        };
        let unbuilt = |e: deadpool::managed::BuildError| {
            StoreError::new(StoreErrorKind::Other, "cannot build the Redis pool").with_source(e)
        };
        let connections = match self.source {
            Source::Url(url) => {
                let manager = ServerManager {
                    client: redis::Client::open(url.as_str()).map_err(|e| invalid("URL", e))?,
                    config: redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(self.connect_timeout))
                        .set_response_timeout(Some(self.response_timeout)),
                };
                let pool = deadpool::managed::Pool::builder(manager)
                    .config(pool_config(self.pool_size))
                    .runtime(Runtime::Tokio1)
                    .build()
                    .map_err(unbuilt)?;
                Connections::Server(pool)
            }
            Source::Pool(pool) => Connections::Pool(pool),
            #[cfg(feature = "redis-cluster")]
            Source::ClusterUrls(urls) => {
                let client = redis::cluster::ClusterClientBuilder::new(urls)
                    // A charge is never sent twice; see the connection module.
                    .retries(0)
                    .connection_timeout(self.connect_timeout)
                    .response_timeout(self.response_timeout)
                    .build()
                    .map_err(|e| invalid("cluster URLs", e))?;
                let pool =
                    deadpool::managed::Pool::builder(self::connection::ClusterManager { client })
                        .config(pool_config(self.pool_size))
                        .runtime(Runtime::Tokio1)
                        .build()
                        .map_err(unbuilt)?;
                Connections::Cluster(pool)
            }
            #[cfg(feature = "redis-cluster")]
            Source::ClusterPool(pool) => Connections::ClusterPool(pool),
        };
        Ok(RedisStore {
            inner: Arc::new(Inner {
                connections,
                script: Script::new(COUNTERS_LUA),
                wait_timeout: self.wait_timeout,
                connect_timeout: self.connect_timeout,
                response_timeout: self.response_timeout,
                calendar_grace: self.calendar_grace,
                calendar_jitter: self.calendar_jitter,
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
            .field("wait_timeout", &self.wait_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("calendar_grace", &self.calendar_grace)
            .field("calendar_jitter", &self.calendar_jitter)
            .finish()
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        let (cluster, status) = inner.connections.status();
        f.debug_struct("RedisStore")
            .field("cluster", &cluster)
            .field("pool_size", &status.max_size)
            .field("script_sha", &inner.script.get_hash())
            .field("wait_timeout", &inner.wait_timeout)
            .field("connect_timeout", &inner.connect_timeout)
            .field("response_timeout", &inner.response_timeout)
            .field("calendar_grace", &inner.calendar_grace)
            .field("calendar_jitter", &inner.calendar_jitter)
            .finish()
    }
}

/// The future of [`RedisStore::charge`].
pub type RedisChargeFuture =
    Pin<Box<dyn Future<Output = Result<ChargeOutcome, StoreError>> + Send>>;

impl Store for RedisStore {
    type ChargeFuture = RedisChargeFuture;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        Box::pin(self.clone().lines("c", request))
    }

    fn peek(
        &self,
        request: ChargeRequest,
    ) -> impl Future<Output = Result<Vec<Usage>, StoreError>> + Send {
        let store = self.clone();
        async move { store.lines("p", request).await.map(|outcome| outcome.usage) }
    }

    fn refund(
        &self,
        _now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        let store = self.clone();
        async move {
            let mut invocation = store.inner.script.key(key.as_str());
            invocation.arg("r").arg(clamp(amount));
            let left: i64 = store
                .exchange(|mut conn| async move {
                    let result = invocation.invoke_async(&mut conn).await;
                    (conn, result)
                })
                .await?;
            Ok(u64::try_from(left).ok())
        }
    }

    fn add(
        &self,
        _now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        let store = self.clone();
        async move {
            let mut invocation = store.inner.script.key(key.as_str());
            // The exact amount, not clamped: the script refuses a count
            // beyond 2^53 instead of storing one that says less.
            invocation.arg("a").arg(amount);
            let total: i64 = store
                .exchange(|mut conn| async move {
                    let result = invocation.invoke_async(&mut conn).await;
                    (conn, result)
                })
                .await?;
            Ok(u64::try_from(total).ok())
        }
    }

    fn reset(&self, key: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let store = self.clone();
        async move {
            let deleted: i64 = store
                .exchange(|mut conn| async move {
                    let result = redis::cmd("DEL")
                        .arg(key.as_str())
                        .query_async(&mut conn)
                        .await;
                    (conn, result)
                })
                .await?;
            Ok(deleted > 0)
        }
    }
}

/// A [`Clock`] that follows the Redis server's time; from
/// [`RedisStore::server_clock`].
#[derive(Clone)]
pub struct ServerClock {
    offset: Arc<AtomicI64>,
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

async fn refresh_offset(store: RedisStore, offset: Weak<AtomicI64>, every: Duration) {
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

fn log_heal(key: &PeriodKey, heal: i64, charging: bool) {
    let what = match heal {
        1 => "dated to its first call plus one period",
        2 => "dated to one period from now (its first call is unknown)",
        3 => "ended (its period was over)",
        4 => "given its housekeeping deadline",
        _ => "healed",
    };
    if charging {
        crate::metrics::healed();
        tracing::warn!(key = %key, "quota counter had no deadline; {what}");
    } else {
        tracing::warn!(key = %key, "quota counter has no deadline; the next charge heals it");
    }
}

fn millis_until(now: Timestamp, then: Timestamp) -> i64 {
    // PEXPIRE needs a positive duration; a deadline in the past ends the
    // counter at once.
    (then.as_millisecond() - now.as_millisecond()).max(1)
}

fn as_millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A deadline offset in `[0, spread]` drawn from the key, so every instance
/// picks the same one.
fn jitter(key: &PeriodKey, spread: Duration) -> i64 {
    let spread = as_millis(spread);
    if spread == 0 {
        return 0;
    }
    let mut hasher = DefaultHasher::new();
    key.as_str().hash(&mut hasher);
    (hasher.finish() % (spread as u64 + 1)) as i64
}

/// Counts travel as Redis integers.
/// Lua counts in doubles, exact up to 2^53: a limit or cost that large is as
/// good as unlimited, and is sent as 2^53.
fn clamp(n: u64) -> i64 {
    i64::try_from(n.min(1 << 53)).expect("2^53 fits in an i64")
}

fn pool_error(error: PoolError<RedisError>) -> StoreError {
    match error {
        PoolError::Timeout(_) => StoreError::new(
            StoreErrorKind::Timeout,
            "no Redis connection could be had in time",
        ),
        PoolError::Backend(e) => redis_error(e),
        PoolError::Closed => {
            StoreError::new(StoreErrorKind::Unavailable, "the Redis pool is closed")
        }
        other => {
            StoreError::new(StoreErrorKind::Unavailable, "no Redis connection").with_source(other)
        }
    }
}

fn redis_error(error: RedisError) -> StoreError {
    let kind = if error.is_timeout() {
        StoreErrorKind::Timeout
    } else if error.is_io_error()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || error.is_cluster_error()
        || matches!(error.kind(), ErrorKind::ClusterConnectionNotFound)
        || matches!(
            error.code(),
            Some(
                "OOM"
                    | "LOADING"
                    | "BUSY"
                    | "MASTERDOWN"
                    | "MISCONF"
                    | "READONLY"
                    | "NOREPLICAS"
                    | "TRYAGAIN"
            )
        )
        || error.to_string().contains("OOM command not allowed")
    {
        StoreErrorKind::Unavailable
    } else {
        StoreErrorKind::Other
    };
    StoreError::new(kind, "Redis failed").with_source(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_its_spread_and_varies_by_key() {
        let spread = Duration::from_secs(60);
        let draws: Vec<i64> = (0..200)
            .map(|i| {
                jitter(
                    &PeriodKey::from_string(format!("quota:{{account:{i}}}:read:2026-12-02")),
                    spread,
                )
            })
            .collect();
        assert!(draws.iter().all(|&j| (0..=60_000).contains(&j)));
        let distinct: std::collections::HashSet<_> = draws.iter().collect();
        assert!(
            distinct.len() > 150,
            "jitter should spread keys, got {} distinct",
            distinct.len()
        );
        assert_eq!(
            jitter(&PeriodKey::from_string("k".into()), Duration::ZERO),
            0
        );
    }

    #[test]
    fn the_script_uses_no_command_that_drops_a_deadline() {
        let code = script_code();
        for command in [
            "'SET'",
            "'GETSET'",
            "'RESTORE'",
            "'SETEX'",
            "'PSETEX'",
            "'PERSIST'",
            "'GETDEL'",
            "'RENAME'",
        ] {
            assert!(
                !code.contains(command),
                "the counters script uses {command}"
            );
        }
        // Every counter the script creates gets its deadline in the same call.
        assert_eq!(code.matches("'HSET'").count(), 1);
        let create = code.find("'HSET'").unwrap();
        assert!(
            code[create..].find("'PEXPIRE'").unwrap() < 80,
            "HSET is followed by PEXPIRE"
        );
    }

    /// The script without its comments.
    fn script_code() -> String {
        COUNTERS_LUA
            .lines()
            .filter(|l| !l.trim_start().starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The top-level block of the script that opens with the line `opening`,
    /// up to its `end`.
    fn block<'a>(code: &'a str, opening: &str) -> &'a str {
        let start = code
            .find(&format!("\n{opening}\n"))
            .unwrap_or_else(|| panic!("the counters script has `{opening}`"));
        let end = start + code[start..].find("\nend\n").expect("the block ends");
        &code[start..end]
    }

    /// The Redis commands `code` calls, in order.
    fn commands(code: &str) -> Vec<&str> {
        code.split("redis.call('")
            .skip(1)
            .map(|rest| &rest[..rest.find('\'').expect("a quoted command")])
            .collect()
    }

    #[test]
    fn refund_and_add_only_change_the_count() {
        let code = script_code();
        // The read both start with writes nothing.
        assert_eq!(
            commands(block(&code, "local function read(key)")),
            ["TYPE", "HMGET", "GET"]
        );
        // No PEXPIRE, HSET, SET or DEL: neither creates a counter nor sets,
        // moves or drops a deadline.
        assert_eq!(
            commands(block(&code, "if op == 'r' then")),
            ["HINCRBY", "DECRBY"]
        );
        let add = block(&code, "if op == 'a' then");
        assert_eq!(commands(add), ["HINCRBY", "INCRBY"]);
        // An add checks the bound before it writes.
        assert!(add.find("EXACT").unwrap() < add.find("'HINCRBY'").unwrap());
    }

    #[test]
    fn deadlines_in_the_past_end_at_once() {
        let now = Timestamp::from_second(1_000).unwrap();
        assert_eq!(millis_until(now, Timestamp::from_second(999).unwrap()), 1);
        assert_eq!(
            millis_until(now, Timestamp::from_second(1_002).unwrap()),
            2_000
        );
    }
}
