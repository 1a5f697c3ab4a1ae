//! Counters in Redis, shared by every instance of an app.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::Duration;

use deadpool::managed::{PoolError, Timeouts};
use deadpool_redis::redis::{self, ErrorKind, RedisError, Script};
use deadpool_redis::Pool;
use jiff::{SignedDuration, Timestamp};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{
    ChargeLine, ChargeOutcome, ChargeRequest, Lifetime, Store, StoreError, StoreErrorKind, Usage,
};
use crate::key::PeriodKey;
use crate::period::Clock;
use crate::throttle::Throttle;

use self::batch::{Batches, LineArgs, Lines, Pending};
use self::connection::{Connection, Connections, Fault, Lost, ServerConnector, Shared};

mod batch;
mod connection;
mod hash;

#[cfg(all(feature = "testing", feature = "redis-cluster"))]
pub(crate) use self::connection::cluster_is_complete;

/// The counters script: check-then-commit for charges, plus peek, refund,
/// add and the server's time, so that one SHA serves every call.
const COUNTERS_LUA: &str = include_str!("redis/counters.lua");

/// The script, for every store: calls hold it in tasks of their own.
static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(COUNTERS_LUA));

/// Fields per line in the script's reply.
const FIELDS: usize = 5;

/// The key that routes the server-time call on a cluster; never written.
const CLOCK_KEY: &str = "tower-quota:{clock}";

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

/// Counters in Redis (or Valkey, 6.2 and later), so that any number of app
/// instances enforce one quota exactly.
///
/// # How counters are kept
///
/// - **Atomic, and sent together.** Every charge is run by one Lua script
///   (loaded again if the server answers `NOSCRIPT`), which checks every
///   line of the request and then commits all of them or none. On a single
///   server the charges of concurrent callers leave in batches, one
///   `EVALSHA` for many charges, each still checked and committed on its
///   own (see [Connections](#connections)). All keys of a subject share the
///   key's `{subject}` hash tag, so the script is valid on a cluster too,
///   where each charge is one `EVALSHA` of its own.
/// - **First-use counters keep their deadline.** A counter is a hash of the
///   count and the first call's instant. Its deadline is set with `PEXPIRE`
///   only in the script that creates it, and every later write is a
///   `HINCRBY`, which keeps it: hits never re-date a counter. A counter
///   found without a deadline (written by another tool, or restored without
///   one) is healed by the next admitted charge, to first call + period when
///   the first call is known, else to one period from now, and the healing
///   is logged at `warn`. A peek or a refused charge writes nothing, so it
///   heals nothing either (it logs that the counter is undated): an undated
///   counter without a first call that is at its limit refuses every charge
///   until it is [reset](Store::reset). The reset reported to clients is the
///   counter's remaining life.
/// - **Calendar counters** carry the window's stamp in their key. Their
///   deadline is housekeeping only: the window's end plus
///   [a grace](RedisStoreBuilder::calendar_grace) plus [a
///   jitter](RedisStoreBuilder::calendar_jitter) drawn from the key, so that
///   the counters of all subjects are not reclaimed in one instant, and it
///   is set in the call that creates the counter. The reset reported is the
///   window's end. The counter also records that end, once, when it is
///   created: from then on, through the grace, it is over, so a charge,
///   peek, refund or add at an instant past the end finds no live counter
///   (as [`MemoryStore`](super::MemoryStore) does). Since the end, not the
///   deadline, decides when such a counter counts, a charge does not read
///   its deadline. Counters created by earlier versions, without that
///   record, stay live until their deadline, and get one if they lack it.
/// - **Refunds** (`HINCRBY` by a negative amount, in a script that checks the
///   counter is live at the refund's instant) never create a counter and
///   never touch a deadline.
/// - **Adds** after the fact ([`Store::add`]) are the same `HINCRBY` the
///   other way: a missing counter stays missing, the deadline stays as it
///   was, and a count that would go beyond 2^53 (what the script counts
///   exactly) is refused with a [`StoreError`] before anything is written.
///
/// - **Strict values.** A counter is a whole number from 0 to 2^53 (what the
///   script counts exactly), written as Redis writes integers. A key of
///   another type, a hash with other fields, or a count such as `1.0`,
///   `1e0`, `-1` or `9223372036854775807` is no counter: the charge, peek,
///   refund or add is a [`StoreError`] naming the key (for logs), checked
///   before anything is written on any key of the request, never an
///   admission or a refusal.
///
/// # Connections
///
/// A store built from URLs keeps a few multiplexed connections ([two by
/// default](RedisStoreBuilder::pool_size)) that every call uses at once:
/// concurrent calls are pipelined on the same sockets, so no call waits for
/// a connection to be free, and load alone is never an error. On a single
/// server, charges go in batches: a lone charge leaves at once, and while a
/// few batches are on their way (two per connection, 16 at most), new charges
/// queue and leave together in the next one, so under load one round trip
/// and one script call carry many charges. The caller that starts a batch
/// drives it until its own answer comes, then a task of its own takes it
/// over, so a batch is never cut short by one caller going away; a charge
/// whose caller left before its batch was sent is not sent. A batch holds
/// the keys of many subjects: behind a proxy or a sharded endpoint that
/// routes each command by its first key, turn batches off with
/// [`batch_charges(false)`](RedisStoreBuilder::batch_charges). On a
/// cluster, each charge goes on its own; the cluster connection multiplexes
/// per node; its client never retries a request by itself, so a charge is
/// never applied twice, and a request caught by a slot migration fails
/// while the next one goes to the slot's new node. A store built from an
/// existing `deadpool_redis::Pool` holds one pooled connection per call or
/// batch for its round trip (as many batches on their way as the pool has
/// connections).
///
/// # Faults
///
/// - **One budget.** Every call is answered within the store's
///   [`timeout`](RedisStoreBuilder::timeout) (80 ms by default, below the
///   layer's 100 ms [store
///   timeout](crate::QuotaPolicyBuilder::store_timeout), so the layer sees
///   the store's own error): room among the calls in flight, a connection
///   and the round trip all fit in it.
/// - **A bound on load.** At most
///   [`max_in_flight`](RedisStoreBuilder::max_in_flight) calls (4096 by
///   default) are in flight at once; a call that finds no room within the
///   budget fails with [`StoreErrorKind::Timeout`] and sends nothing. That
///   sheds only load Redis cannot answer.
/// - **No charge without an admission.** Each call (or batch) is followed
///   to its end, in a task of its own, even after its caller stopped waiting
///   (the store's timeout, the layer's, a dropped future). A charge Redis
///   applied after its caller was told it failed is given back, line by
///   line, with the same refund as [`Store::refund`] (which never creates a
///   counter nor moves a deadline), and logged at `debug`. So a charge that
///   timed out is a [`StoreErrorKind::Timeout`] that charges nothing, and a
///   stall of Redis leaves no charge behind once the queued scripts ran. A
///   call is followed for 30 s at most; a connection silent that long is
///   dropped. A connection that answers nothing at all for a second while
///   a call waits on it (half-open after a network fault) takes no new
///   calls from then on: they go to fresh connections (on a cluster, see
///   below).
/// - A lost connection, a restarting server and `OOM` under `noeviction`
///   become a [`StoreError`] too, which the layer's
///   [`OnStoreError`](crate::OnStoreError) policy answers. A charge is never
///   sent twice: one that failed on the wire may have been applied. After a
///   command failed on the wire, every connection opened before it is
///   dropped and the next calls open fresh ones, so requests succeed again
///   as soon as Redis is back (on a cluster, see below).
/// - **One node of a cluster.** A cluster node that stops answering fails
///   the subjects it holds, and only them: the cluster connection that
///   waited on it goes on serving the other nodes while a replacement is
///   tried in the background (a second apart, doubling after each failure
///   up to 8 s), and gives way only to one that reaches every master. An
///   idle cluster connection is checked in the background too, never in a
///   caller's time (after a restart during a lull, the restarted node's
///   subjects lose their first call). Once the node answers again, its
///   subjects are served and the charges it ran late are given back. This
///   holds until the cluster itself declares the node failed
///   (`cluster-node-timeout`): without a replica to take over, a cluster
///   that requires full coverage (the default) then refuses every request.
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
    /// Charges sent together; on a single server only.
    batches: Option<Batches>,
    script: &'static Script,
    timeout: Duration,
    wait_timeout: Duration,
    connect_timeout: Duration,
    max_in_flight: usize,
    in_flight: Arc<Semaphore>,
    /// Charges given back after their callers stopped waiting.
    given_back: AtomicU64,
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
/// | [`timeout`](Self::timeout) (also [`response_timeout`](Self::response_timeout)) | 80 ms |
/// | [`max_in_flight`](Self::max_in_flight) | 4096 |
/// | [`pool_size`](Self::pool_size) | 2 multiplexed connections |
/// | [`wait_timeout`](Self::wait_timeout) | the whole timeout |
/// | [`connect_timeout`](Self::connect_timeout) | 1 s |
/// | [`calendar_grace`](Self::calendar_grace) | 60 s |
/// | [`calendar_jitter`](Self::calendar_jitter) | 60 s |
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

    /// A store on an existing pool, with default settings: one pooled
    /// connection per call, held for its round trip, as before the store
    /// multiplexed its own connections (so it is slower than a store built
    /// from a URL). The pool's own size and timeouts apply, within the
    /// store's timeout. (deadpool-redis's pools ping every connection they
    /// hand out, and their connections give up on an answer after 500 ms by
    /// default; the store waits on its own handle of the connection, so a
    /// charge held up longer is still followed and given back.)
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

    /// Opens the store's connections and loads the counters script, so that
    /// the first requests pay for neither; call it at startup to learn at
    /// once whether Redis can be reached. (On an existing pool, it opens
    /// one.)
    ///
    /// # Errors
    ///
    /// When Redis cannot be reached or refuses the script.
    pub async fn preload(&self) -> Result<(), StoreError> {
        let script: &'static Script = self.inner.script;
        // Calls go to the connections in turn: one call each opens them all.
        let connections = match &self.inner.connections {
            Connections::Pool(_) => 1,
            #[cfg(feature = "redis-cluster")]
            Connections::ClusterPool(_) => 1,
            other => other.status().1,
        };
        for _ in 0..connections {
            let sha: String = self
                .exchange(Sends::Read, move |mut conn| async move {
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
            .exchange(Sends::Read, |mut conn| async move {
                let result = invocation.invoke_async(&mut conn).await;
                (conn, result)
            })
            .await?;
        let after = Timestamp::now();
        let local = (before.as_microsecond() + after.as_microsecond()) / 2;
        Ok(secs * 1_000_000 + micros - local)
    }

    /// How many calls of this store are in flight: sent or about to be, and
    /// not yet answered (or, for a charge whose caller stopped waiting, not
    /// yet given back). At most [`max_in_flight`](RedisStoreBuilder::max_in_flight).
    pub fn in_flight(&self) -> usize {
        self.inner.max_in_flight - self.inner.in_flight.available_permits()
    }

    /// Room for one call among the calls in flight, found within the wait:
    /// its permit, the call's deadline, and the end of its wait.
    async fn room(
        &self,
    ) -> Result<
        (
            OwnedSemaphorePermit,
            tokio::time::Instant,
            tokio::time::Instant,
        ),
        StoreError,
    > {
        let inner = &self.inner;
        let started = tokio::time::Instant::now();
        let deadline = started + inner.timeout;
        let room = deadline.min(started + inner.wait_timeout);
        match tokio::time::timeout_at(room, Arc::clone(&inner.in_flight).acquire_owned()).await {
            Ok(Ok(permit)) => Ok((permit, deadline, room)),
            Ok(Err(_)) => Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "the Redis store is closed",
            )),
            Err(_) => Err(StoreError::new(
                StoreErrorKind::Timeout,
                format!(
                    "the Redis store has {} calls in flight, its max_in_flight, and none \
                     finished in time; nothing was sent",
                    inner.max_in_flight
                ),
            )),
        }
    }

    /// Runs `f` on a connection, answered within the store's timeout. Nothing
    /// is sent again.
    async fn exchange<T, F, Fut>(&self, sends: Sends, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(Connection) -> Fut + Send + 'static,
        Fut: Future<Output = (Connection, Result<T, RedisError>)> + Send + 'static,
    {
        self.follow(sends, None, f, Ok).await
    }

    /// Runs `f` on a connection and waits for its answer within the store's
    /// timeout. A call whose caller stops waiting once it was sent (the
    /// store's timeout, a dropped future) is followed to its end in a task of
    /// its own: then a charge that Redis applied is given back
    /// (`give_back`). So is one whose answer `read` refuses: its caller is
    /// told an error, and nothing stays charged.
    async fn follow<T, R, F, Fut>(
        &self,
        sends: Sends,
        give_back: Option<GiveBack<T>>,
        f: F,
        read: impl FnOnce(T) -> Result<R, StoreError>,
    ) -> Result<R, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(Connection) -> Fut + Send + 'static,
        Fut: Future<Output = (Connection, Result<T, RedisError>)> + Send + 'static,
    {
        let inner = &self.inner;
        let (permit, deadline, room) = self.room().await?;
        let timeouts = Timeouts {
            wait: Some(room.saturating_duration_since(tokio::time::Instant::now())),
            create: Some(inner.connect_timeout),
            recycle: Some(inner.timeout),
        };
        let conn = match inner.connections.ready_or_get(&timeouts, deadline).await {
            Some(Ok(conn)) => conn,
            Some(Err(fault)) => return Err(fault_error(fault)),
            None => {
                return Err(StoreError::new(
                    StoreErrorKind::Timeout,
                    "no Redis connection could be had within the store's timeout; nothing was \
                     sent",
                ))
            }
        };
        let mut call = Call {
            inner: Arc::clone(inner),
            lost: conn.lost(),
            sent: tokio::time::Instant::now(),
            trip: Some(Box::pin(f(conn))),
            permit: Some(permit),
            give_back,
        };
        let trip = call.trip.as_mut().expect("the call is on its way");
        match tokio::time::timeout_at(deadline, trip).await {
            Ok((mut conn, Ok(value))) => {
                call.trip = None;
                let give_back = call.give_back.take().filter(|back| (back.applied)(&value));
                let read = read(value);
                if let (Err(_), Some(back)) = (&read, give_back) {
                    // Applied, but not an answer this store can stand by.
                    let inner = Arc::clone(inner);
                    let permit = call.permit.take();
                    tokio::spawn(async move {
                        let _permit = permit;
                        refund_lines(&inner, &mut conn, back.lines, back.now).await;
                    });
                }
                read
            }
            Ok((conn, Err(error))) => {
                call.trip = None;
                // A broken connection is not used again, nor are the others
                // opened before it; a refusal by the server spoils nothing.
                if broken(&error) {
                    inner.connections.failed(conn.failed());
                }
                Err(redis_error(error))
            }
            // Dropping `call` hands the round trip over to a task that
            // follows it to its end.
            Err(_) => Err(StoreError::new(
                StoreErrorKind::Timeout,
                match sends {
                    Sends::Charge => {
                        "Redis did not answer within the store's timeout; nothing is charged (a \
                         charge Redis applies later is given back)"
                    }
                    Sends::Read => "Redis did not answer within the store's timeout",
                    Sends::Write => {
                        "Redis did not answer within the store's timeout; the change was sent \
                         and may still be applied (sending it again may apply it twice)"
                    }
                },
            )),
        }
    }

    /// Refunds (`op` `r`) or adds (`a`) `amount` on the live counter at
    /// `key`: the script never creates a counter and never touches a
    /// deadline, and `now` decides whether a calendar counter kept through
    /// its grace is still live (past its window's end it is not).
    async fn change_live(
        self,
        op: &'static str,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        what: &str,
    ) -> Result<Option<u64>, StoreError> {
        let mut invocation = self.inner.script.key(key.as_str());
        invocation.arg(op).arg(amount).arg(now.as_millisecond());
        let count: i64 = self
            .exchange(Sends::Write, |mut conn| async move {
                let result = invocation.invoke_async(&mut conn).await;
                (conn, result)
            })
            .await?;
        live_count(&key, what, count)
    }

    /// Runs `command` on the counters' connection; for tests and tools.
    #[cfg(feature = "testing")]
    pub(crate) async fn command<T: redis::FromRedisValue + Send + 'static>(
        &self,
        command: redis::Cmd,
    ) -> Result<T, StoreError> {
        self.exchange(Sends::Write, |mut conn| async move {
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
        let args: Vec<LineArgs> = request
            .lines
            .iter()
            .map(|line| self.line_args(now, line))
            .collect();
        let mut invocation = self.inner.script.prepare_invoke();
        invocation.arg(op).arg(now.as_millisecond());
        for line in &args {
            invocation
                .key(line.key.as_str())
                .arg(line.limit)
                .arg(line.cost)
                .arg(line.anchor)
                .arg(line.ttl)
                .arg(line.end);
        }
        self.follow(
            if op == "c" {
                Sends::Charge
            } else {
                Sends::Read
            },
            give_back(op, &request),
            |mut conn| async move {
                let result = invocation.invoke_async(&mut conn).await;
                (conn, result)
            },
            |reply: Vec<i64>| outcome(op, &request, &reply),
        )
        .await
    }

    /// What the script takes for `line`, charged at `now`.
    fn line_args(&self, now: Timestamp, line: &ChargeLine) -> LineArgs {
        let (anchor, ttl, end) = match line.lifetime {
            Lifetime::FirstUse { deadline } => ("f", millis_until(now, deadline), 0),
            Lifetime::Calendar { end, .. } => {
                let housekeeping = millis_until(now, end)
                    .saturating_add(as_millis(self.inner.calendar_grace))
                    .saturating_add(jitter(&line.key, self.inner.calendar_jitter));
                // Stored in a new counter (`e`), so that refunds and adds,
                // which know only the key, can tell when its window ends.
                ("c", housekeeping, end.as_millisecond())
            }
        };
        // A deadline Redis can hold: `PEXPIRE` refuses one past i64::MAX ms
        // from now, and the script counts exactly up to 2^53.
        let ttl = ttl.clamp(1, (1_i64 << 53) - now.as_millisecond().max(0));
        LineArgs {
            key: line.key.clone(),
            limit: clamp(line.limit),
            cost: clamp(line.cost),
            anchor,
            ttl,
            end,
        }
    }

    /// A charge sent in a batch with other callers' (see the batch module),
    /// answered within the store's timeout; one whose caller stops waiting
    /// is not sent, or given back once Redis applied it.
    async fn charge_in_batch(
        &self,
        request: ChargeRequest,
        lines: Lines,
    ) -> Result<ChargeOutcome, StoreError> {
        let (permit, deadline, _) = self.room().await?;
        let (answer, mut answered) = tokio::sync::oneshot::channel();
        let mut sender = Batches::push(
            &self.inner,
            Pending {
                now: request.now,
                lines,
                answer,
                permit,
            },
        );
        // Drives the batch this call started, if any, until the answer
        // comes; dropping `sender` then leaves the rest to a task.
        let answer = std::future::poll_fn(|cx| {
            if let Some(batch) = sender.as_mut() {
                if Pin::new(batch).poll(cx).is_ready() {
                    sender = None;
                }
            }
            Pin::new(&mut answered).poll(cx)
        });
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(Ok(answer)) => {
                // Read before it is taken: a reply that cannot be read drops
                // the answer untaken, and an applied charge is given back.
                let outcome = match answer.reply() {
                    Ok(fields) => outcome("c", &request, fields),
                    Err(error) => Err(redis_error(error.clone())),
                };
                if outcome.is_ok() {
                    let _ = answer.take();
                }
                outcome
            }
            Ok(Err(_)) => Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "the Redis store's batch of charges was dropped before its answer (its \
                     runtime shut down); this charge may have been applied",
            )),
            Err(_) => Err(StoreError::new(
                StoreErrorKind::Timeout,
                "Redis did not answer within the store's timeout; nothing is charged (a \
                     charge Redis applies later is given back)",
            )),
        }
    }
}

/// The outcome of `request` from the script's reply to operation `op`.
fn outcome(op: &str, request: &ChargeRequest, reply: &[i64]) -> Result<ChargeOutcome, StoreError> {
    let now = request.now;
    if reply.len() != 1 + FIELDS * request.lines.len() {
        return Err(unexpected(format!(
            "{} values for {} lines",
            reply.len(),
            request.lines.len()
        )));
    }
    let admitted = match reply[0] {
        1 => true,
        0 => false,
        other => return Err(unexpected(format!("{other} as the admission"))),
    };
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
            let key = &line.key;
            let used = u64::try_from(used)
                .map_err(|_| unexpected(format!("{used} as the count of {key}")))?;
            if !(0..=4).contains(&heal) {
                return Err(unexpected(format!("{heal} as the heal of {key}")));
            }
            if heal != 0 {
                log_heal(key, heal, op == "c" && admitted);
            }
            // -3: a calendar counter's deadline, not read.
            let calendar = matches!(line.lifetime, Lifetime::Calendar { .. });
            if pttl < 0 && pttl != -2 && !(pttl == -3 && calendar) {
                return Err(unexpected(format!("{pttl} as the life of {key}")));
            }
            let first_call = match first_call {
                -1 => None,
                ms => Some(
                    Timestamp::from_millisecond(ms)
                        .map_err(|_| unexpected(format!("{ms} as the first call of {key}")))?,
                ),
            };
            Ok(match line.lifetime {
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
                    first_call,
                },
            })
        })
        .collect::<Result<_, StoreError>>()?;
    Ok(ChargeOutcome { admitted, usage })
}

impl RedisStoreBuilder {
    fn new(source: Source) -> Self {
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
    /// applies it later, so it charges nothing.
    ///
    /// Keep it below the layer's [store
    /// timeout](crate::QuotaPolicyBuilder::store_timeout) (100 ms by
    /// default), which stays an outer bound: past it the layer answers
    /// without the store's own error.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The same budget as [`timeout`](Self::timeout), under its former name:
    /// how long Redis may take to answer, now all of a call.
    pub fn response_timeout(self, timeout: Duration) -> Self {
        self.timeout(timeout)
    }

    /// The most calls the store has in flight at once (default 4096): sent
    /// to Redis or about to be, and not yet answered, including charges
    /// followed after their callers stopped waiting. A call that finds no
    /// room within its [wait](Self::wait_timeout) fails with
    /// [`StoreErrorKind::Timeout`] and sends nothing: this sheds only load
    /// that Redis does not answer, such as during a stall.
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

    /// Part of the [budget](Self::timeout): the longest a call waits for
    /// room among the calls in flight, or, on an existing pool, for a pooled
    /// connection (default: the whole budget).
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
        let connections = match self.source {
            Source::Url(url) => {
                let connector = ServerConnector {
                    client: redis::Client::open(url.as_str()).map_err(|e| invalid("URL", e))?,
                    // No response timeout: each call is followed to its
                    // answer (see `follow_through`).
                    config: redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(self.connect_timeout))
                        .set_response_timeout(None),
                };
                Connections::Server(Arc::new(Shared::new(connector, size, self.connect_timeout)))
            }
            Source::Pool(pool) => Connections::Pool(pool),
            #[cfg(feature = "redis-cluster")]
            Source::ClusterUrls(urls) => {
                let client = redis::cluster::ClusterClientBuilder::new(urls)
                    // A charge is never sent twice; see the connection module.
                    .retries(0)
                    .connection_timeout(self.connect_timeout)
                    .response_timeout(FOLLOW_THROUGH)
                    .build()
                    .map_err(|e| invalid("cluster URLs", e))?;
                Connections::Cluster(Arc::new(Shared::new(
                    self::connection::ClusterConnector { client },
                    size,
                    self.connect_timeout,
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
            Connections::Pool(_) => Some(Batches::new(size.min(16))),
            _ => Some(Batches::new((2 * size).min(16))),
        };
        Ok(RedisStore {
            inner: Arc::new(Inner {
                connections,
                batches,
                script: &SCRIPT,
                timeout: self.timeout,
                wait_timeout: self.wait_timeout.unwrap_or(self.timeout),
                connect_timeout: self.connect_timeout,
                max_in_flight: self.max_in_flight,
                in_flight: Arc::new(Semaphore::new(self.max_in_flight)),
                given_back: AtomicU64::new(0),
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
            .field("timeout", &self.timeout)
            .field("wait_timeout", &self.wait_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("max_in_flight", &self.max_in_flight)
            .field("calendar_grace", &self.calendar_grace)
            .field("calendar_jitter", &self.calendar_jitter)
            .finish()
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &self.inner;
        let (cluster, size) = inner.connections.status();
        f.debug_struct("RedisStore")
            .field("cluster", &cluster)
            .field("pool_size", &size)
            .field("script_sha", &inner.script.get_hash())
            .field("timeout", &inner.timeout)
            .field("wait_timeout", &inner.wait_timeout)
            .field("connect_timeout", &inner.connect_timeout)
            .field("max_in_flight", &inner.max_in_flight)
            .field("in_flight", &self.in_flight())
            .field("given_back", &inner.given_back.load(Ordering::Relaxed))
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
        if self.inner.batches.is_none() || request.lines.is_empty() {
            return Box::pin(self.clone().lines("c", request));
        }
        // A future of its own, a fraction of the size of `lines`'s.
        let store = self.clone();
        let lines = request
            .lines
            .iter()
            .map(|line| store.line_args(request.now, line))
            .collect();
        Box::pin(async move { store.charge_in_batch(request, lines).await })
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
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        // Clamped: a refund of more than a counter can hold empties it.
        self.clone()
            .change_live("r", now, key, amount.min(1 << 53), "a refund")
    }

    fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        // The exact amount, not clamped: the script refuses a count beyond
        // 2^53 instead of storing one that says less.
        self.clone().change_live("a", now, key, amount, "an add")
    }

    fn reset(&self, key: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let store = self.clone();
        async move {
            let deleted: i64 = store
                .exchange(Sends::Write, |mut conn| async move {
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

/// Logs a counter found without a deadline; by its key without the
/// subject's id (see the hash module).
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
        tracing::warn!(
            key = hash::logged(key),
            "quota counter had no deadline; {what}"
        );
    } else {
        tracing::warn!(
            key = hash::logged(key),
            "quota counter has no deadline; the next admitted charge heals it"
        );
    }
}

/// A reply of the counters script that makes no sense: a store error, never
/// a guess.
fn unexpected(what: String) -> StoreError {
    StoreError::new(
        StoreErrorKind::Other,
        format!("unexpected reply from the counters script: {what}"),
    )
}

/// The script's answer to a refund or an add: the count afterwards, or -1
/// when there is no live counter.
fn live_count(key: &PeriodKey, op: &str, reply: i64) -> Result<Option<u64>, StoreError> {
    match reply {
        -1 => Ok(None),
        n => u64::try_from(n)
            .map(Some)
            .map_err(|_| unexpected(format!("{n} as the count of {key} after {op}"))),
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
/// picks the same one, whatever its build (see the hash module).
fn jitter(key: &PeriodKey, spread: Duration) -> i64 {
    let spread = as_millis(spread);
    if spread == 0 {
        return 0;
    }
    (hash::fnv1a_64(key.as_str().as_bytes()) % (spread as u64 + 1)) as i64
}

/// Counts travel as Redis integers.
/// Lua counts in doubles, exact up to 2^53: a limit or cost that large is as
/// good as unlimited, and is sent as 2^53.
fn clamp(n: u64) -> i64 {
    i64::try_from(n.min(1 << 53)).expect("2^53 fits in an i64")
}

/// What a call does to what Redis holds: what a caller that stopped waiting
/// is told.
#[derive(Clone, Copy)]
enum Sends {
    Read,
    /// A change that is not given back (a refund, an add, a reset).
    Write,
    /// A charge: given back if Redis applies it after all.
    Charge,
}

/// What a charge gives back when Redis applied it after its caller stopped
/// waiting: one refund per line, by the line's key and cost.
struct GiveBack<T> {
    /// Whether the answer says the charge was applied.
    applied: fn(&T) -> bool,
    lines: Vec<(PeriodKey, u64)>,
    /// The instant of the charge: the refund goes to the counters live then.
    now: Timestamp,
}

/// The give-back of a charge (`op` `c`); other calls have none.
fn give_back(op: &str, request: &ChargeRequest) -> Option<GiveBack<Vec<i64>>> {
    (op == "c").then(|| GiveBack {
        // The script's reply opens with 1 when every line was charged.
        applied: |reply: &Vec<i64>| reply.first() == Some(&1),
        lines: request
            .lines
            .iter()
            .filter(|line| line.cost > 0)
            .map(|line| (line.key.clone(), line.cost))
            .collect(),
        now: request.now,
    })
}

type RoundTrip<T> = Pin<Box<dyn Future<Output = (Connection, Result<T, RedisError>)> + Send>>;

/// A call on its way. Dropped before its answer came (its caller timed out
/// or went away), it hands its round trip to a task that follows it to the
/// end.
struct Call<T: Send + 'static> {
    inner: Arc<Inner>,
    trip: Option<RoundTrip<T>>,
    /// What to close if the round trip never comes back.
    lost: Option<Lost>,
    /// When it was sent.
    sent: tokio::time::Instant,
    /// Keeps the call counted in flight until it is over.
    permit: Option<OwnedSemaphorePermit>,
    give_back: Option<GiveBack<T>>,
}

impl<T: Send + 'static> Drop for Call<T> {
    fn drop(&mut self) {
        let Some(trip) = self.trip.take() else {
            return;
        };
        let follow = follow_through(
            Arc::clone(&self.inner),
            trip,
            self.lost.take(),
            self.sent,
            self.permit.take(),
            self.give_back.take(),
        );
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(follow)),
            Err(_) => tracing::warn!(
                "a Redis call was dropped outside a tokio runtime and cannot be followed; a \
                 charge it carried may be applied without an admission"
            ),
        }
    }
}

/// Waits for `trip`, sent at `sent`, until `FOLLOW_THROUGH` from then. If
/// nothing at all came back on its connection within `SILENCE` (or the
/// store's timeout, if longer), the connection went silent (a socket left
/// half-open would hold every call sent on it): it takes no new calls,
/// while this one is still waited for.
async fn wait_for<F: Future + Unpin>(
    inner: &Inner,
    trip: &mut F,
    sent: tokio::time::Instant,
    lost: &mut Option<Lost>,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    let silence = sent + SILENCE.max(inner.timeout);
    if let Ok(answer) = tokio::time::timeout_at(silence, &mut *trip).await {
        return Ok(answer);
    }
    if lost.as_ref().is_some_and(Lost::silent) {
        if let Some(lost) = lost.take() {
            inner.connections.failed(lost.failed);
        }
    }
    tokio::time::timeout_at(sent + FOLLOW_THROUGH, trip).await
}

/// Follows a round trip whose caller stopped waiting to its end: a charge
/// Redis applied is given back.
async fn follow_through<T>(
    inner: Arc<Inner>,
    mut trip: RoundTrip<T>,
    mut lost: Option<Lost>,
    sent: tokio::time::Instant,
    _permit: Option<OwnedSemaphorePermit>,
    give_back: Option<GiveBack<T>>,
) {
    let (mut conn, value) = match wait_for(&inner, &mut trip, sent, &mut lost).await {
        Ok((conn, Ok(value))) => (conn, value),
        Ok((conn, Err(error))) => {
            if broken(&error) {
                inner.connections.failed(conn.failed());
            }
            return;
        }
        Err(_) => {
            if let Some(lost) = lost {
                inner.connections.failed(lost.failed);
            }
            if let Some(suppressed) = LATE.admit() {
                tracing::warn!(
                    suppressed,
                    "Redis did not answer a call in {FOLLOW_THROUGH:?}; dropping its connection \
                     (a charge it carried may have been applied without an admission)"
                );
            }
            return;
        }
    };
    let Some(give_back) = give_back else {
        return;
    };
    if !(give_back.applied)(&value) {
        return;
    }
    refund_lines(&inner, &mut conn, give_back.lines, give_back.now).await;
}

/// Gives back an applied charge whose caller stopped waiting, line by line,
/// with the refund of [`Store::refund`] at the charge's instant.
async fn refund_lines(
    inner: &Inner,
    conn: &mut Connection,
    lines: Vec<(PeriodKey, u64)>,
    now: Timestamp,
) {
    let (mut refunded, mut missed) = (0, 0);
    let mut first_miss: Option<(PeriodKey, String)> = None;
    let mut answering = true;
    for (key, cost) in lines {
        if !answering {
            // The connection stopped answering: the rest waits no longer.
            missed += 1;
            continue;
        }
        let mut invocation = inner.script.key(key.as_str());
        invocation
            .arg("r")
            .arg(clamp(cost))
            .arg(now.as_millisecond());
        let refund = invocation.invoke_async::<i64>(conn);
        let why = match tokio::time::timeout(FOLLOW_THROUGH, refund).await {
            Ok(Ok(_)) => {
                refunded += 1;
                continue;
            }
            Ok(Err(error)) => error.to_string(),
            Err(_) => {
                answering = false;
                format!("no answer in {FOLLOW_THROUGH:?}")
            }
        };
        missed += 1;
        first_miss.get_or_insert((key, why));
    }
    if let Some((key, why)) = first_miss {
        // Redis's answer may name the key: the log names it without its
        // subject's id.
        let why = why.replace(key.as_str(), &hash::logged(&key));
        if let Some(suppressed) = LATE.admit() {
            tracing::warn!(
                lines = missed,
                key = hash::logged(&key),
                error = why,
                suppressed,
                "could not give back a charge Redis applied after its caller stopped waiting"
            );
        }
    }
    let total = inner.given_back.fetch_add(1, Ordering::Relaxed) + 1;
    tracing::debug!(
        lines = refunded,
        total,
        "gave back a charge Redis applied after its caller stopped waiting"
    );
}

/// Lets a few warnings a second through about calls followed after their
/// callers stopped waiting (during an outage, there is one per call).
pub(super) static LATE: Throttle = Throttle::new(5);

/// Whether `error` is an answer Redis sent (a refusal, a script's error),
/// rather than a connection that failed or a wait that ran out.
fn came_back(error: &RedisError) -> bool {
    !broken(error) && !error.is_timeout()
}

/// Whether `error` leaves its connection unusable.
fn broken(error: &RedisError) -> bool {
    !error.is_timeout() && (error.is_unrecoverable_error() || error.is_io_error())
}

fn fault_error(fault: Fault) -> StoreError {
    match fault {
        Fault::Redis(error) => redis_error(error),
        Fault::Pool(error) => pool_error(error),
    }
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

    /// Every instance, of any build, draws the same jitter for a key: the
    /// values are pinned.
    #[test]
    fn jitter_is_the_same_in_every_build() {
        let key = PeriodKey::from_string("quota:{account:acme}:read:2026-12-02".into());
        let draws = [1, 1_000, 60_000].map(|ms| jitter(&key, Duration::from_millis(ms)));
        assert_eq!(
            hash::fnv1a_64(key.as_str().as_bytes()),
            0x34b2_ed80_6a2c_668b
        );
        assert_eq!(draws, [1, 944, 38_223]);
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
