//! The store: its shared state, its calls and the [`Store`] trait.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool::managed::Timeouts;
use deadpool_redis::redis::{RedisError, Script};
use deadpool_redis::Pool;
use jiff::Timestamp;
use smallvec::SmallVec;
use tokio::sync::Semaphore;

use super::batch::{Batches, LineArgs, Lines, Pending};
use super::builder::{RedisStoreBuilder, Source};
use super::clock::{refresh_offset, ServerClock};
use super::connection::{AnswersAfter, Connection, Connections, Unanswered};
use super::errors::{applied_nothing, came_back, fault_error, redis_error, retires};
use super::hash::jitter;
use super::late::{give_back, give_back_taking, refund_lines, Call, GiveBack, Room, Sends};
use super::script::{
    as_millis, clamp, live_count, millis_until, outcome, taken_outcome, unexpected, Invocation,
    CLOCK_KEY, COUNTERS_LUA, MAX_EXACT,
};
use crate::key::PeriodKey;
use crate::store::patience::{LastAnswer, Patience};
use crate::store::{
    ChargeLine, ChargeOutcome, ChargeRequest, Debt, Lifetime, Made, Store, StoreError,
    StoreErrorKind, Usage,
};

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
/// - **First-use counters keep their deadline.** A counter is a hash at its
///   key (see the [`key`](crate::key) module: ids and allowances
///   percent-encoded) of the count (field `n`) and the first call's instant
///   (`t`); keys whose allowance part ends in `%held` are a
///   [`LeasedStore`](crate::LeasedStore)'s lease marks, and those whose
///   allowance part ends in `%settled-` and 16 hex digits are marks of the
///   settles of a ledger (see Debts below), not counters. Its
///   deadline is set with `PEXPIRE` only in the script that creates it
///   (a give-back or a settle may shorten it: below), and every later
///   write is a `HINCRBY`, which keeps it: hits never re-date a counter.
///   The life set runs from when Redis runs that script: a charge sent
///   while Redis stalled, and run once it resumed, makes a counter that
///   would end as much later than a period after its first call as it ran
///   late. Its give-back (its caller stopped waiting) ends that counter a
///   period after the charge was sent (by the sending process's own
///   monotonic clock), and a settle of the debt of the request whose
///   charge made it ends it at the debt's deadline (see Debts); a charge
///   run later than the store follows it (30 s) is neither given back nor
///   trimmed. A layer a request reached late (behind a slow
///   authentication call or a queue, inside another quota layer of its
///   policy) counts it at the instant the outermost one read, which a
///   first-use counter it makes records as its first call, and tells the
///   store when it charges ([`ChargeRequest::charged_at`]): the counter
///   lives from then to its deadline, and ends at the reset its client was
///   told, as on the memory store. A counter
///   found without a deadline (written by another tool, or restored without
///   one) is healed by the next charge, admitted or refused, to its first
///   call plus one period when the first call is known, else to one period
///   from now (one whose period is over is deleted), and the healing is logged at
///   `warn`: an undated counter at its limit refuses charges until that
///   deadline, not for ever. A refused charge counts nothing; a peek writes
///   nothing (it logs that the counter is undated). The reset reported to
///   clients is the counter's remaining life. That life runs on Redis's own
///   clock: a policy clock that does not follow real time (a
///   [`ManualClock`](crate::ManualClock) in tests) moves calendar windows,
///   never a first-use deadline, which a test crosses on the memory store.
/// - **Calendar counters** carry the window's stamp in their key. Their
///   deadline is housekeeping only: the window's end plus
///   [a grace](RedisStoreBuilder::calendar_grace) plus [a
///   jitter](RedisStoreBuilder::calendar_jitter) drawn from the key, so that
///   the counters of all subjects are not reclaimed in one instant, and it
///   is set in the call that creates the counter. The reset reported is the
///   window's end. The counter also records that end, once, when it is
///   created: from then on, through the grace, it is over, so a charge,
///   peek, refund or add at an instant past the end finds no live counter
///   (as [`MemoryStore`](crate::store::MemoryStore) does). Since the end, not the
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
/// - **Debts** ([`Store::settle_debt`], what requests that passed on a
///   failed charge owe) are one script call on the debt's key: an add to a
///   live counter, past its limit if need be (a first-use one whose first
///   call is the debt's first request then ends at the debt's deadline at
///   the latest, reckoned on the settling instance's clock alone: made by
///   a call Redis ran late, as it stalled, it would end that much later);
///   where there is none, the
///   counter a charge of the debt's requests would have created (its first
///   call the earliest request's, its deadline the debt's first-use deadline
///   or the window's end plus grace and jitter), in the same call; and
///   nothing, answered as such, for a window that is over. The call leaves
///   a mark of the settle ([`Debt::id`]) beside the counter, in its hash
///   tag, for as long as a counter it created would live and a minute
///   more: a settle sent
///   again under the same id (the ledger's, after one whose answer was
///   lost) adds nothing, and answers what the counter holds.
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
///   and the round trip all fit in it. The budget is Redis's silence, not
///   a call's age: while Redis answers other calls, a call behind them is
///   waited for until a budget has passed since the last answer, up to ten
///   budgets in all, so that a machine too busy to read the answers at once
///   does not fail its charges. On a cluster, whose nodes answer apart, a
///   call waits for room and a connection while any node answers, and once
///   sent to a node, with that node's answers (from its send at the
///   earliest): the store reads which node serves each slot (`CLUSTER
///   SLOTS`) on its first call and every 2 s while it makes calls, and a
///   call sent to a slot it does not know yet has one budget from its
///   send.
/// - **A bound on load.** At most
///   [`max_in_flight`](RedisStoreBuilder::max_in_flight) calls (4096 by
///   default) are in flight at once; a call waits for room while Redis
///   answers them, and one that finds none after a budget of Redis's
///   silence fails with [`StoreErrorKind::Timeout`] and sends nothing. That
///   sheds only load Redis does not answer.
/// - **No charge without an admission.** Each call (or batch) is followed
///   to its end, in a task of its own, even after its caller stopped waiting
///   (the store's timeout, the layer's, a dropped future). A charge Redis
///   applied after its caller was told it failed is given back, line by
///   line, with the same refund as [`Store::refund`] (which never creates a
///   counter nor moves a deadline), and logged at `debug`. So a charge that
///   timed out is a [`StoreErrorKind::Timeout`] that charges nothing, and a
///   stall of Redis leaves no charge behind once the queued scripts ran, as
///   long as the connection holds. A connection known silent (a call on
///   it given up on, and nothing back on it for the store's timeout since)
///   is sent nothing more: calls that would go on it fail at once, sending
///   nothing, until it answers or is left for a fresh one. So a stalled
///   server is sent about a budget's worth of calls, far fewer than fill
///   its sockets' buffers at the rates a server serves, and the connection
///   holds through a stall past 3 s. A burst of calls enough to fill those
///   buffers (some thousands), sent before the stall was noticed, leaves
///   data the kernel cannot deliver, and past 3 s it fails the connection
///   (Linux's `TCP_USER_TIMEOUT`, which also fails one whose host
///   vanished): the calls on it are failures on the wire, below.
///   (A request a layer lets through on such a charge under
///   [`OnStoreError::FailOpen`](crate::OnStoreError::FailOpen) owes it, and
///   its policy's ledger adds it with [`Store::settle_debt`] once Redis
///   answers: one count for the request, whether the charge was never
///   applied, or applied late and given back. A settle is not given back:
///   the ledger sends it again under its id, which Redis adds once, whether
///   the first was applied, late, or lost on the wire. A charge that fails
///   on the wire after it was sent, as below, has no answer to follow: if
///   Redis applied it, its request counts twice; under fail closed, it
///   counts though its request was refused.) A
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
///   as soon as Redis is back (on a cluster, see below). A connection the
///   server closed while no call was on it (a restart during a lull, or
///   between two calls) fails no call: one unused for a second is pinged
///   before it serves again, and one unused for a few milliseconds (or
///   about to carry a give-back or an add) is checked for a closed socket
///   first, a `PING` nobody waits for; no connection under load is.
/// - **One node of a cluster.** A cluster node that stops answering fails
///   the subjects it holds, and only them: the cluster connection that
///   waited on it goes on serving the other nodes while a replacement is
///   tried in the background (a second apart, doubling after each failure
///   up to 8 s), and gives way only to one that reaches every master. An
///   idle cluster connection is checked in the background too, never in a
///   caller's time (after a restart during a lull, the restarted node's
///   subjects lose their first call). Once the node answers again, its
///   subjects are served and the charges it ran late are given back. The
///   calls it leaves unanswered, followed for up to 30 s, hold at most half
///   of [`max_in_flight`](RedisStoreBuilder::max_in_flight), even those of
///   a burst sent before it was known to stall: past that, its subjects'
///   calls fail, sending nothing, and the other nodes' calls find room.
///   Once it is known silent (a call of its own given up on, and nothing
///   answered for the store's timeout since), its subjects' calls fail at
///   once, sending nothing, within that half or not: a stalled node is sent
///   about a budget's worth of calls, far fewer than fill its sockets'
///   buffers at the rates a node serves (the kernel would fail those
///   connections, and the cluster client, repairing them, would hold up
///   every node's calls while it waits on the stalled node). The map of
///   slots is read from the node that answered last. (A node that answers,
///   however busy, has its calls past that half wait for its answers.)
///   This holds until the cluster itself declares the node failed
///   (`cluster-node-timeout`): without a replica to take over, a cluster
///   that requires full coverage (the default) then refuses every request.
/// - **A failover.** With replicas, a master declared failed is replaced by
///   its replica. Between the vote and the promotion (about a second),
///   every node answers `CLUSTERDOWN`: every subject's charges are store
///   errors, not only the failed master's. A stalled master's subjects are
///   then served by the new master within seconds of the promotion,
///   however long the old one stays stalled: the map of slots is never
///   read from a node known silent, and a map in which a master serves no
///   slot any more has the cluster's connection opened anew. A charge
///   given back (its caller stopped waiting, and Redis applied it late) goes
///   to the node that ran it (the node a redirect sent it to last, or the
///   one the store's map named), never to another that took its slot over:
///   a stalled master failed over runs the calls queued on it once it
///   resumes, on data it drops when it turns replica, which the new master
///   never held. So a charge a master applied late just before a graceful
///   failover (`CLUSTER FAILOVER`), which reached its replica, stays
///   counted, though its request was refused; so does one applied late by
///   a new master that the cluster client sent it to straight away, in the
///   moment before the store's map, read again after the first `MOVED`,
///   named it. A change (a refund, a give-back of a
///   [`LeasedStore`](crate::LeasedStore)'s block, an add) is sent to its
///   node only once a `PING` to that node answered: to a master killed
///   (its connection closed, or refused when opened anew) or silent, it
///   fails as never sent, so a give-back is sent again until the promoted
///   replica takes it, rather than left charged as one that may have
///   landed.
/// - **A slot on the move.** While a resharding moves a slot, the charges of
///   its subjects that name several keys (a layer with several quotas, and
///   every charge of a [`LeasedStore`](crate::LeasedStore), which reads its
///   lease marks) are store errors until the slot's keys have moved.
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
/// instance never shortens or lengthens a first-use period; but instances
/// whose clocks disagree may name different calendar windows around a
/// boundary, and the instance that makes a calendar window's counter times
/// its end (plus the grace and jitter) by its own clock: one ahead by more
/// than the grace ends the counter early, and the window's later requests
/// count afresh. Where that matters, give the layer
/// [`RedisStore::server_clock`], which reads the server's `TIME`.
///
/// # Example
///
/// ```no_run
/// use axum::{routing::get, Router};
/// use tower_quota::store::RedisStore;
/// use tower_quota::{FromHeader, Quota, QuotaPolicy};
///
/// # async fn run() -> Result<(), tower_quota::StoreError> {
/// let store = RedisStore::new("redis://127.0.0.1:6379/")?;
/// let app: Router = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .layer(QuotaPolicy::builder(FromHeader::account("x-account-id")).store(store).build().layer(Quota::daily(1_000)));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) connections: Connections,
    /// Charges sent together; on a single server only.
    pub(super) batches: Option<Batches>,
    pub(super) script: &'static Script,
    pub(super) timeout: Duration,
    pub(super) wait_timeout: Duration,
    pub(super) connect_timeout: Duration,
    pub(super) max_in_flight: usize,
    pub(super) in_flight: Arc<Semaphore>,
    /// Charges (and settles without a mark) on their way, until answered
    /// or given back (see [`Room`]).
    pub(super) charges: Arc<std::sync::atomic::AtomicUsize>,
    /// Charges given back after their callers stopped waiting.
    pub(super) given_back: AtomicU64,
    pub(super) calendar_grace: Duration,
    pub(super) calendar_jitter: Duration,
    /// When Redis last answered a call (see [`Patience`]); on a cluster,
    /// any node.
    pub(super) last_answer: Arc<LastAnswer>,
    /// A single server's connections known silent: sent nothing.
    pub(super) unanswered: Unanswered,
    /// On a cluster, when each node last answered: a call waits for its
    /// own node's answers.
    #[cfg(feature = "redis-cluster")]
    pub(super) nodes: Option<super::nodes::NodeAnswers>,
}

impl Inner {
    /// How long a call that started at `started` waits for its answer: the
    /// store's timeout with nothing at all from Redis, up to ten while
    /// Redis answers other calls (see [`Patience`]).
    pub(super) fn patience(&self, started: tokio::time::Instant) -> Patience {
        Patience::new(started, self.timeout, super::builder::MAX_TIMEOUT)
    }

    /// The slot of the key `at` on a cluster: the call that names it goes
    /// to the slot's node, and waits for that node's answers. `None` on a
    /// single server, or for a call that names no key.
    pub(super) fn slot(&self, at: Option<&str>) -> Slot {
        #[cfg(feature = "redis-cluster")]
        if self.nodes.is_some() {
            return at.map(|key| super::nodes::slot_of(key.as_bytes()));
        }
        let _ = at;
        None
    }

    /// When the server that answers a call to `slot` last answered any
    /// call: on a single server, any answer; on a cluster, the slot's
    /// node's (none for a call that names no key, or a node not known).
    pub(super) fn answered(&self, slot: Slot) -> Option<tokio::time::Instant> {
        #[cfg(feature = "redis-cluster")]
        if let Some(nodes) = &self.nodes {
            return slot.and_then(|slot| nodes.last(slot));
        }
        let _ = slot;
        self.last_answer.last()
    }

    /// When Redis last answered, as a call to `slot` waits for it once
    /// sent (while it waits to be sent, any answer moves the queue ahead of
    /// it): its server's answers (see [`Inner::answered`]), and once `sent`
    /// on a connection that gave nothing back since (gone silent, half-open
    /// beside others that answer), only those before it was sent.
    pub(super) fn last_answer_for(
        &self,
        sent: Option<&AnswersAfter>,
        slot: Slot,
    ) -> Option<tokio::time::Instant> {
        let last = self.answered(slot);
        match sent {
            Some(sent) if !sent.any() => last.map(|at| at.min(sent.sent)),
            _ => last,
        }
    }

    /// Notes a reply from Redis to a call to `slot`, if `result` is one (an
    /// error Redis answered is one; a broken connection is not). On a
    /// cluster, the reply is noted for the slot's node too: one node's
    /// answers say nothing of another that stalled, whose subjects' calls
    /// must still fail after one budget. A single server's replies are
    /// noted as they come, on its connection (see `connection::counted`):
    /// nothing to do here.
    pub(super) fn heard<T>(&self, result: &Result<T, RedisError>, slot: Slot) {
        if !self.connections.cluster() || !result.as_ref().map_or_else(came_back, |_| true) {
            return;
        }
        self.last_answer.heard();
        #[cfg(feature = "redis-cluster")]
        if let (Some(nodes), Some(slot)) = (&self.nodes, slot) {
            nodes.heard(slot);
        }
        let _ = slot;
    }
}

/// The cluster slot a call goes to (see [`Inner::slot`]).
pub(super) type Slot = Option<u16>;

/// How long a failover's new connection is waited for before the map of
/// slots is taken anyway (see `RedisStore::read_nodes`).
#[cfg(feature = "redis-cluster")]
const RENEW_WITHIN: Duration = Duration::from_secs(10);

/// Why a call to a cluster node known silent fails.
#[cfg(feature = "redis-cluster")]
const SILENT_NODE: &str = "the Redis Cluster node of this call answered nothing for the store's \
                           timeout since one of its calls was given up on; nothing was sent";

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
            Connections::Pool(..) => 1,
            #[cfg(feature = "redis-cluster")]
            Connections::ClusterPool(_) => 1,
            other => other.status().1,
        };
        for _ in 0..connections {
            let sha: String = self
                .exchange(Sends::Read, None, move |mut conn| async move {
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
    /// `refresh`. Give it to the policy ([`QuotaPolicyBuilder::clock`]) so that all
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
    /// When the first reading fails, or the server's time is more than a
    /// day away from this host's (a refresh that reads such a time keeps
    /// the last offset): a clock that far off is a fault, not a skew.
    ///
    /// [`QuotaPolicyBuilder::clock`]: crate::QuotaPolicyBuilder::clock
    pub async fn server_clock(&self, refresh: Duration) -> Result<ServerClock, StoreError> {
        let offset = Arc::new(AtomicI64::new(self.server_offset().await?));
        let weak = Arc::downgrade(&offset);
        let store = self.clone();
        let refresh = refresh.max(Duration::from_millis(10));
        tokio::spawn(refresh_offset(store, weak, refresh));
        Ok(ServerClock { offset })
    }

    /// The server's time minus the local time, in microseconds: the local
    /// time is the middle of the round trip alone, not of the wait for room
    /// or a connection before it (which would put it early by half that
    /// wait).
    pub(super) async fn server_offset(&self) -> Result<i64, StoreError> {
        let mut invocation = Invocation::on(CLOCK_KEY);
        invocation.arg("t");
        let (secs, micros, local) = self
            .exchange(Sends::Read, Some(CLOCK_KEY), |mut conn| async move {
                let before = Timestamp::now();
                let result = invocation.invoke_async::<(i64, i64)>(&mut conn).await;
                let after = Timestamp::now();
                let local = (before.as_microsecond() + after.as_microsecond()) / 2;
                (conn, result.map(|(secs, micros)| (secs, micros, local)))
            })
            .await?;
        server_offset(secs, micros, local)
    }

    /// How many calls of this store are in flight: sent or about to be, and
    /// not yet answered (or, for a charge whose caller stopped waiting, not
    /// yet given back). At most [`max_in_flight`](RedisStoreBuilder::max_in_flight).
    pub fn in_flight(&self) -> usize {
        self.inner.max_in_flight - self.inner.in_flight.available_permits()
    }

    /// How many calls Redis applied after their callers stopped waiting (a
    /// charge, a settle without a mark) this store gave back (or tried to:
    /// a give-back that fails is logged), since it was made. Its clones
    /// share the count.
    pub fn given_back(&self) -> u64 {
        self.inner.given_back.load(Ordering::Relaxed)
    }

    /// Room for one call among the calls in flight, found within the wait:
    /// its permit, when the call started, and the end of its wait. The wait
    /// counts Redis's silence, as a call's budget does (see
    /// [`Patience`]): while Redis answers the calls in flight, their room
    /// frees up, and a call waiting for it is load, not a failure.
    async fn room(&self) -> Result<(Room, tokio::time::Instant, tokio::time::Instant), StoreError> {
        let inner = &self.inner;
        let started = tokio::time::Instant::now();
        let patience = Patience::new(
            started,
            inner.wait_timeout.min(inner.timeout),
            super::builder::MAX_TIMEOUT,
        );
        let last_answer = || inner.last_answer.last();
        let acquire = Arc::clone(&inner.in_flight).acquire_owned();
        match patience.wait(last_answer, acquire).await {
            Some(Ok(permit)) => Ok((Room::new(permit), started, patience.deadline(last_answer()))),
            Some(Err(_)) => Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "the Redis store is closed",
            )
            .unsent()),
            None => Err(StoreError::new(
                StoreErrorKind::Timeout,
                format!(
                    "the Redis store has {} calls in flight, its max_in_flight, and Redis \
                     answered none of them in time; nothing was sent",
                    inner.max_in_flight
                ),
            )
            .unsent()),
        }
    }

    /// Runs `f` on a connection, answered within the store's timeout. Nothing
    /// is sent again.
    async fn exchange<T, F, Fut>(
        &self,
        sends: Sends,
        at: Option<&str>,
        f: F,
    ) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(Connection) -> Fut + Send + 'static,
        Fut: Future<Output = (Connection, Result<T, RedisError>)> + Send + 'static,
    {
        self.follow(sends, at, None, f, Ok).await
    }

    /// Runs `f` on a connection and waits for its answer within the store's
    /// timeout. A call whose caller stops waiting once it was sent (the
    /// store's timeout, a dropped future) is followed to its end in a task of
    /// its own: then a charge that Redis applied is given back
    /// (`give_back`). So is one whose answer `read` refuses: its caller is
    /// told an error, and nothing stays charged. `at`: a key the call names
    /// (on a cluster, its slot's node is the one whose answers it waits
    /// with).
    async fn follow<T, R, F, Fut>(
        &self,
        sends: Sends,
        at: Option<&str>,
        give_back: Option<GiveBack<T>>,
        f: F,
        read: impl FnOnce(T) -> Result<R, StoreError>,
    ) -> Result<R, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(Connection) -> Fut + Send + 'static,
        Fut: Future<Output = (Connection, Result<T, RedisError>)> + Send + 'static,
    {
        let slot = self.inner.slot(at);
        self.follow_to(sends, slot, give_back, f, read).await
    }

    /// [`RedisStore::follow`], for a call that goes to the node of `slot`
    /// (on a cluster; `None`: any node, or a single server).
    async fn follow_to<T, R, F, Fut>(
        &self,
        sends: Sends,
        slot: Slot,
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
        #[cfg(feature = "redis-cluster")]
        if inner.nodes.as_ref().is_some_and(|nodes| nodes.due()) {
            tokio::spawn(self.clone().read_nodes());
        }
        // On a cluster, a node holds at most half the room with its calls
        // (waited for, or followed after their callers gave up, for up to
        // 30 s): past that, a call to it waits for one of them to end while
        // the node answers. A node known silent is sent nothing. So the
        // other nodes' calls find room when one stalls.
        #[cfg(feature = "redis-cluster")]
        let node = match (&inner.nodes, slot) {
            (Some(nodes), Some(slot)) => {
                let most = (inner.max_in_flight / 2).max(1);
                match nodes.hold(slot, most, inner.timeout).await {
                    Ok(hold) => hold,
                    Err(super::nodes::NodeFull::Silent) => {
                        return Err(StoreError::new(StoreErrorKind::Timeout, SILENT_NODE).unsent())
                    }
                    Err(super::nodes::NodeFull::Waited) => {
                        return Err(StoreError::new(
                            StoreErrorKind::Timeout,
                            "the Redis Cluster node of this call holds half the room for calls \
                             and answered none of them while this call waited; nothing was sent",
                        )
                        .unsent())
                    }
                }
            }
            _ => None,
        };
        let (permit, started, room) = self.room().await?;
        #[cfg(feature = "redis-cluster")]
        let permit = permit.on_node(node);
        // Room, a connection and the round trip, waited for as one call.
        let patience = inner.patience(started);
        let permit = match &give_back {
            Some(_) => permit.charging(&inner.charges),
            None => permit,
        };
        let timeouts = Timeouts {
            wait: Some(room.saturating_duration_since(tokio::time::Instant::now())),
            create: Some(inner.connect_timeout),
            recycle: Some(inner.timeout),
        };
        let connection = inner
            .connections
            .ready_or_get(&timeouts, patience.cap(), sends);
        let conn = match patience
            .wait(|| inner.last_answer.last(), connection)
            .await
            .flatten()
        {
            Some(Ok(conn)) => conn,
            Some(Err(fault)) => return Err(fault_error(fault).unsent()),
            None => return Err(no_connection()),
        };
        // Room and a connection took the whole budget: a call sent now
        // would be abandoned as it leaves, and a charge it carried would
        // hold units from other requests until its give-back lands.
        if tokio::time::Instant::now() >= patience.deadline(inner.last_answer.last()) {
            return Err(StoreError::new(
                StoreErrorKind::Timeout,
                "room for the call and a Redis connection took the store's timeout; nothing was \
                 sent",
            )
            .unsent());
        }
        // A connection known silent is sent nothing (see `Unanswered`).
        if inner.unanswered.silent(&conn, inner.timeout) {
            return Err(StoreError::new(
                StoreErrorKind::Timeout,
                "Redis answered nothing on its connection for the store's timeout since a call \
                 on it was given up on; nothing was sent",
            )
            .unsent());
        }
        // On a cluster, a change (a give-back, a refund, an add) goes only
        // to a node whose connection answers: the cluster's connection
        // serves on while one node's is closed (a master killed, before its
        // replica's promotion), and a call queued on a closed one fails as
        // one lost on the wire, never sent again, though it was never
        // written. A `PING` to the slot's master first: one that fails
        // without an answer from Redis, or none in the call's budget, fails
        // the change as never sent.
        #[cfg(feature = "redis-cluster")]
        let mut conn = conn;
        #[cfg(feature = "redis-cluster")]
        if let (Sends::Write, Some(slot)) = (sends, slot) {
            let deadline = patience.deadline(inner.last_answer.last());
            match tokio::time::timeout_at(deadline, conn.ping_slot(slot)).await {
                Ok(None | Some(Ok(_))) => {}
                Ok(Some(Err(error))) if came_back(&error) => {}
                Ok(Some(Err(error))) => {
                    if retires(&error) {
                        inner.connections.failed(conn.failed());
                    }
                    return Err(redis_error(error).unsent());
                }
                Err(_) => {
                    return Err(StoreError::new(
                        StoreErrorKind::Timeout,
                        "the Redis Cluster node of this change answered no PING within the \
                         store's timeout; nothing was sent",
                    )
                    .unsent())
                }
            }
        }
        // On a cluster, a charge Redis applies late is given back to the
        // node that ran it: the one the map names now, unless a redirect
        // sends the call elsewhere (see `follow_through`, `refund_line`).
        // Its index only, read without a lock: its address is looked up
        // if a give-back is ever needed.
        #[cfg(feature = "redis-cluster")]
        let give_back = give_back.map(|mut back| {
            back.node = slot.and_then(|slot| inner.nodes.as_ref()?.node_of(slot));
            back
        });
        let sent = tokio::time::Instant::now();
        let answers_after = conn.answers_after(sent);
        let mut call = Call {
            inner: Arc::clone(inner),
            lost: conn.lost(),
            slot,
            sent,
            trip: Some(Box::pin(f(conn))),
            permit: Some(permit),
            give_back,
        };
        let trip = call.trip.as_mut().expect("the call is on its way");
        // On a cluster, room and a connection were waited for with every
        // node's answers (the calls ahead of this one are every node's);
        // once sent, the call waits with its own node's, from when it
        // reached it at the earliest: a node that had no call to answer
        // while this one waited for room is not silent.
        let reached = slot.map(|_| sent);
        let answer = patience
            .wait(
                || {
                    inner
                        .last_answer_for(answers_after.as_ref(), slot)
                        .max(reached)
                },
                trip,
            )
            .await;
        if let Some((_, result)) = &answer {
            inner.heard(result, slot);
        }
        match answer.ok_or(()) {
            Ok((mut conn, Ok(value))) => {
                call.trip = None;
                let give_back = call
                    .give_back
                    .take()
                    .filter(|back| (back.applied)(&value))
                    .map(|back| (back.now, back.refunds(&value, call.sent)));
                let read = read(value);
                if let (Err(_), Some((now, refunds))) = (&read, give_back) {
                    // Applied, but not an answer this store can stand by.
                    let inner = Arc::clone(inner);
                    let permit = call.permit.take();
                    tokio::spawn(async move {
                        let _permit = permit;
                        refund_lines(&inner, &mut conn, refunds, now, None).await;
                    });
                }
                read
            }
            Ok((conn, Err(error))) => {
                call.trip = None;
                // A broken connection (or one to a server that is no master
                // any more) is not used again, nor are the others
                // opened before it; a refusal by the server spoils nothing.
                if retires(&error) {
                    inner.connections.failed(conn.failed());
                }
                // A change Redis refused for now applied nothing: the
                // caller may send it again, as one never sent (a give-back
                // of a request not served, or a deferred cost, would
                // otherwise be lost).
                // So did one whose connection could not even be opened (a
                // node killed: the cluster's connection opens a new one to
                // it for the call, which the dead node refuses).
                let again = matches!(sends, Sends::Write)
                    && (applied_nothing(&error) || error.is_connection_refusal());
                let error = redis_error(error);
                Err(if again { error.unsent() } else { error })
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
        made: Made,
        what: &str,
    ) -> Result<Option<u64>, StoreError> {
        let invocation = Invocation::change(op, &key, amount, now, made);
        let count: i64 = self
            .exchange(Sends::Write, Some(key.as_str()), |mut conn| async move {
                let result = invocation.invoke_async(&mut conn).await;
                (conn, result)
            })
            .await?;
        live_count(&key, what, count)
    }

    /// Refunds `amount` on the live counter at `key` that `made` names, if
    /// given (see [`RedisStore::change_live`]).
    async fn refund_to(
        self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made: Made,
    ) -> Result<Option<u64>, StoreError> {
        let amount = super::script::refund_amount(amount);
        self.change_live("r", now, key, amount, made, "a refund")
            .await
    }

    /// Settles `debt` at `now` (see [`Store::settle_debt`]): one script call
    /// on the debt's key and its settle's mark, which Redis adds once
    /// however often the ledger sends it (a settle that failed may have
    /// been applied, late or with its answer lost). A key built by no
    /// [`Namespace`](crate::Namespace) has no mark: the settle is then sent
    /// as a charge is, followed and given back if Redis applies it after
    /// its caller stopped waiting (one lost on the wire counts twice).
    async fn settle(self, now: Timestamp, debt: Debt) -> Result<Option<u64>, StoreError> {
        if debt.lifetime.end() <= now {
            return Ok(None);
        }
        let line = ChargeLine {
            key: debt.key,
            limit: 0,
            cost: debt.amount,
            lifetime: debt.lifetime,
            shadow_limit: None,
        };
        let args = self.line_args(now, now, &line);
        let key = line.key;
        let mark = key.settle_mark(debt.id);
        let mut invocation = Invocation::on(key.as_str());
        if let Some(mark) = &mark {
            invocation.key(mark.as_str());
        }
        invocation
            .arg("s")
            // Exact, not clamped: the script refuses a count beyond 2^53.
            .arg(debt.amount)
            .arg(now.as_millisecond())
            .arg(args.anchor)
            .arg(args.ttl)
            // The window's end, or the first-use deadline: a counter
            // opened at or past it takes none of the debt.
            .arg(debt.lifetime.end().as_millisecond().max(0))
            .arg(debt.since.as_millisecond().max(0));
        // Without a mark only: with one, the ledger's next try finds it.
        let give_back = mark.is_none().then(|| GiveBack {
            // The count afterwards (-1 when the debt's period is over and
            // nothing was written), and the counter's first call.
            applied: |reply: &Vec<i64>| reply.first().is_some_and(|&count| count >= 0),
            // A give-back goes to the counter the settle added to, though a
            // charge with a later instant made it first.
            first_call: |reply: &Vec<i64>, _| reply.get(1).copied().filter(|&ms| ms >= 0),
            taken: |_, _| 0,
            // As for a charge, a line of nothing has nothing to give back.
            // (A counter the settle made has its first request's instant,
            // not `now`: the give-back leaves its deadline alone.)
            lines: (debt.amount > 0)
                .then(|| (0, key.clone(), debt.amount, None))
                .into_iter()
                .collect(),
            now,
            node: None,
        });
        self.follow(
            Sends::Charge,
            Some(key.as_str()),
            give_back,
            |mut conn| async move {
                let result = invocation.invoke_async(&mut conn).await;
                (conn, result)
            },
            |reply: Vec<i64>| match reply.as_slice() {
                [count, _] => live_count(&key, "a settle", *count),
                _ => Err(unexpected(format!(
                    "{reply:?} as the answer to a settle on {}",
                    key.logged()
                ))),
            },
        )
        .await
    }

    /// Reads which node serves each slot of the cluster (see the `nodes`
    /// module), in a task of its own: a read that fails leaves the map as
    /// it was, to be read again later. Once the map is known, the read
    /// goes to the node that answered last, and holds room among that
    /// node's calls: sent to any node, a read that reached a node that
    /// stalled would hold room for 30 s outside that node's half, and
    /// reads every 2 s would fill the room the other nodes' calls need.
    /// (Boxed, its type named: a call may start it, and it makes a call.)
    #[cfg(feature = "redis-cluster")]
    fn read_nodes(self) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let to = self
                .inner
                .nodes
                .as_ref()
                .and_then(|nodes| nodes.answering_slot(self.inner.timeout));
            let reply = self
                .follow_to(
                    Sends::Read,
                    to,
                    None,
                    move |mut conn| async move {
                        let result = conn.cluster_slots(to).await;
                        (conn, result)
                    },
                    Ok,
                )
                .await;
            if let (Some(nodes), Ok(reply)) = (&self.inner.nodes, &reply) {
                if nodes.vanished(reply) {
                    // A master's slots went to another node (a failover):
                    // the cluster's connection, which learns of it from a
                    // `MOVED` or a failure on the wire, may still send their
                    // calls to the old master, hung, which answers neither.
                    // A fresh one reads the slots anew. Until it serves, the
                    // map stays as it was: the old master's subjects fail at
                    // once (it is silent), where calls sent to the new
                    // master's entry would go to the old one and leave the
                    // new one taken for silent.
                    tracing::info!(
                        "a Redis Cluster master's slots went to another node; reconnecting"
                    );
                    self.inner.connections.renew(RENEW_WITHIN).await;
                }
                nodes.read(reply);
            }
        })
    }

    /// Runs `command` on the counters' connection; for tests and tools.
    #[cfg(feature = "testing")]
    pub(crate) async fn command<T: deadpool_redis::redis::FromRedisValue + Send + 'static>(
        &self,
        command: deadpool_redis::redis::Cmd,
    ) -> Result<T, StoreError> {
        self.exchange(Sends::Write, None, |mut conn| async move {
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
                usage: SmallVec::new(),
            });
        }
        let invocation = self.invocation(op, &request);
        self.follow(
            if op == "c" {
                Sends::Charge
            } else {
                Sends::Read
            },
            Some(request.lines[0].key.as_str()),
            give_back(op, &request),
            |mut conn| async move {
                let result = invocation.invoke_async(&mut conn).await;
                (conn, result)
            },
            |reply: Vec<i64>| outcome(op, &request, &reply),
        )
        .await
    }

    /// [`Store::charge_taking`] in one call of the script (`x`), never
    /// batched with other callers' charges: a leased store's, a few per
    /// second per busy subject.
    async fn taking(
        self,
        request: ChargeRequest,
        extra: SmallVec<[u64; 2]>,
    ) -> Result<(ChargeOutcome, SmallVec<[u64; 2]>), StoreError> {
        let mut invocation = self.invocation("x", &request);
        for &units in &extra {
            invocation.arg(clamp(units));
        }
        self.follow(
            Sends::Charge,
            Some(request.lines[0].key.as_str()),
            Some(give_back_taking(&request, &extra)),
            |mut conn| async move {
                let result = invocation.invoke_async(&mut conn).await;
                (conn, result)
            },
            |reply: Vec<i64>| taken_outcome(&request, &extra, &reply),
        )
        .await
    }

    /// The script's call `op` on the lines of `request`: its instant, then
    /// each line's key and five arguments.
    fn invocation(&self, op: &str, request: &ChargeRequest) -> Invocation {
        let now = request.now;
        let mut invocation = Invocation::default();
        invocation.arg(op).arg(now.as_millisecond());
        for line in &request.lines {
            let line = self.line_args(now, request.charged(), line);
            invocation
                .key(line.key.as_str())
                .arg(line.limit)
                .arg(line.cost)
                .arg(line.anchor)
                .arg(line.ttl)
                .arg(line.end);
        }
        invocation
    }

    /// What the script takes for `line` of a request at `now`, charged at
    /// `charged` (see [`ChargeRequest::charged_at`]): a first-use counter
    /// it makes lives from the charge to its deadline.
    fn line_args(&self, now: Timestamp, charged: Timestamp, line: &ChargeLine) -> LineArgs {
        let (anchor, ttl, end) = match line.lifetime {
            Lifetime::FirstUse { deadline } => ("f", millis_until(charged, deadline), 0),
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
        let (permit, started, _) = self.room().await?;
        let permit = permit.charging(&self.inner.charges);
        let (answer, mut answered) = tokio::sync::oneshot::channel();
        let sent = Arc::new(std::sync::OnceLock::new());
        let mut sender = Batches::push(
            &self.inner,
            Pending {
                now: request.now,
                lines,
                answer,
                permit,
                sent: Arc::clone(&sent),
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
        let inner = &self.inner;
        match inner
            .patience(started)
            .wait(|| inner.last_answer_for(sent.get(), None), answer)
            .await
            .ok_or(())
        {
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

/// The error of a charge with a cost the store cannot count exactly, if it
/// has one. (A limit past it is sent as the largest exact one, a shadow
/// quota's, as good as unlimited; a cost past it would be charged short.)
fn beyond_exact(request: &ChargeRequest) -> Option<StoreError> {
    let line = request.lines.iter().find(|line| line.cost > MAX_EXACT)?;
    Some(StoreError::new(
        StoreErrorKind::Other,
        format!(
            "a cost of {} is beyond {MAX_EXACT}, the most the Redis store counts exactly: nothing charged",
            line.cost
        ),
    ))
}

/// The future of [`RedisStore::charge`].
pub type RedisChargeFuture =
    Pin<Box<dyn Future<Output = Result<ChargeOutcome, StoreError>> + Send>>;

impl Store for RedisStore {
    type ChargeFuture = RedisChargeFuture;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        if let Some(error) = crate::store::past_its_period(&request) {
            return Box::pin(std::future::ready(Err(error)));
        }
        if let Some(error) = beyond_exact(&request) {
            return Box::pin(std::future::ready(Err(error)));
        }
        if self.inner.batches.is_none() || request.lines.is_empty() {
            return Box::pin(self.clone().lines("c", request));
        }
        // A future of its own, a fraction of the size of `lines`'s.
        let store = self.clone();
        let lines = request
            .lines
            .iter()
            .map(|line| store.line_args(request.now, request.charged(), line))
            .collect();
        Box::pin(async move { store.charge_in_batch(request, lines).await })
    }

    /// In one call: each line takes as many of its extra units as fit.
    fn charge_taking(
        &self,
        request: ChargeRequest,
        extra: SmallVec<[u64; 2]>,
    ) -> impl Future<Output = Result<(ChargeOutcome, SmallVec<[u64; 2]>), StoreError>> + Send {
        let extra = crate::store::takeable(&request, &extra);
        let store = self.clone();
        async move {
            if extra.iter().all(|&units| units == 0) || request.lines.is_empty() {
                return store.charge(request).await.map(|outcome| (outcome, extra));
            }
            if let Some(error) = crate::store::past_its_period(&request) {
                return Err(error);
            }
            if let Some(error) = beyond_exact(&request) {
                return Err(error);
            }
            store.taking(request, extra).await
        }
    }

    fn peek(
        &self,
        request: ChargeRequest,
    ) -> impl Future<Output = Result<Vec<Usage>, StoreError>> + Send {
        let store = self.clone();
        async move {
            store
                .lines("p", request)
                .await
                .map(|outcome| outcome.usage.into_vec())
        }
    }

    fn refund(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.clone().refund_to(now, key, amount, Made::Any)
    }

    fn refund_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.clone().refund_to(now, key, amount, Made::By(made_by))
    }

    fn refund_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.clone()
            .refund_to(now, key, amount, Made::At(first_call))
    }

    fn add(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        // The exact amount, not clamped: the script refuses a count beyond
        // 2^53 instead of storing one that says less.
        self.clone()
            .change_live("a", now, key, amount, Made::Any, "an add")
    }

    fn add_made_by(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        made_by: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.clone()
            .change_live("a", now, key, amount, Made::By(made_by), "an add")
    }

    fn add_made_at(
        &self,
        now: Timestamp,
        key: PeriodKey,
        amount: u64,
        first_call: Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.clone()
            .change_live("a", now, key, amount, Made::At(first_call), "an add")
    }

    fn reset(&self, key: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let store = self.clone();
        async move {
            // Through the script, as every call of the counters: on a
            // cluster whose slot moves, it follows the redirects.
            let mut invocation = Invocation::on(key.as_str());
            invocation.arg("d");
            let deleted: i64 = store
                .exchange(Sends::Write, Some(key.as_str()), |mut conn| async move {
                    let result = invocation.invoke_async(&mut conn).await;
                    (conn, result)
                })
                .await?;
            Ok(deleted > 0)
        }
    }

    fn settle_debt(
        &self,
        now: Timestamp,
        debt: Debt,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        self.clone().settle(now, debt)
    }

    fn identity(&self) -> Option<usize> {
        Some(Arc::as_ptr(&self.inner) as usize)
    }

    /// 2^53 - 1: the script adds and compares in Lua's doubles, exact below
    /// 2^53, so that a count never passes a limit by a rounding.
    fn max_count(&self) -> u64 {
        super::script::MAX_EXACT
    }

    /// The charges (and settles without a mark) on their way (answered, or
    /// given back if Redis applied them late), not the reads, changes and
    /// marked settles, which have nothing to give back
    /// ([`in_flight`](Self::in_flight) counts every call).
    fn charges_in_flight(&self) -> usize {
        self.inner.charges.load(Ordering::Relaxed)
    }

    /// Its budget ([`RedisStoreBuilder::timeout`], 80 ms by default).
    fn call_budget(&self) -> Option<Duration> {
        Some(self.inner.timeout)
    }

    /// When Redis last answered a call of this store: on a cluster, any
    /// node. (A charge waiting for room waits behind every node's calls;
    /// once sent, the store fails it after one of its budgets of silence
    /// from its own node.)
    fn last_answer(&self) -> Option<tokio::time::Instant> {
        self.inner.last_answer.last()
    }
}

/// The error of a call that found no Redis connection in time.
fn no_connection() -> StoreError {
    StoreError::new(
        StoreErrorKind::Timeout,
        "no Redis connection could be had within the store's timeout; nothing was sent",
    )
    .unsent()
}

/// The most the server's clock may be from this host's, in microseconds.
const MAX_CLOCK_OFFSET: i64 = 86_400 * 1_000_000;

/// The offset of a server time `secs`.`micros` (Redis's `TIME`) from the
/// local instant `local` (µs), if it is a time and within a day of it.
fn server_offset(secs: i64, micros: i64, local: i64) -> Result<i64, StoreError> {
    let offset = (0..1_000_000)
        .contains(&micros)
        .then(|| {
            secs.checked_mul(1_000_000)?
                .checked_add(micros)?
                .checked_sub(local)
        })
        .flatten()
        .filter(|offset| offset.abs() <= MAX_CLOCK_OFFSET);
    offset.ok_or_else(|| {
        StoreError::new(
            StoreErrorKind::Other,
            format!(
                "the Redis server's time ({secs} s, {micros} µs) is not within a day of this host's: not followed"
            ),
        )
    })
}

#[cfg(test)]
mod clock_tests {
    use super::server_offset;

    #[test]
    fn a_server_time_far_off_or_malformed_is_refused() {
        let local = 1_796_000_000_000_000;
        assert_eq!(
            server_offset(1_796_000_001, 500_000, local).unwrap(),
            1_500_000
        );
        assert!(server_offset(i64::MAX, 0, local).is_err());
        assert!(server_offset(1_796_000_000 + 2 * 86_400, 0, local).is_err());
        assert!(server_offset(1_796_000_000, -1, local).is_err());
        assert!(server_offset(1_796_000_000, 1_000_000, local).is_err());
    }
}
