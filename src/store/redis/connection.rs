//! Shared connections to a server or a cluster.
//!
//! A store built from URLs keeps a small fixed set of multiplexed
//! connections (`MultiplexedConnection`, or the cluster's connection, which
//! multiplexes per node). Every call clones one, round robin, and sends its
//! command at once: concurrent calls are pipelined on the same sockets, and
//! nobody waits for a connection to be free. A connection is opened on first
//! use, by one caller at a time per slot; the others wait for it.
//!
//! After a command failed on the wire (the server restarted, the network
//! broke), or a connection could not be opened, every connection opened
//! before is dropped, not only the one that failed: the others most likely
//! broke with it, and each would fail one more call before it was noticed.
//! The next calls open fresh ones. So it goes, too, when a call has waited a
//! second (or the store's timeout, if longer) with nothing at all back on
//! its connection: a socket gone silent (half-open after a network fault)
//! would otherwise hold every call sent on it until the follow-through
//! gives up. The calls already on it are still followed, and a connection
//! merely busy, answering the calls sent before, is kept. A server's
//! connection idle for a second is pinged before it is used again, so that
//! a restart during a lull costs no call (a cluster's: below). One used
//! within that second is not pinged, but it is checked for a socket the
//! server closed already (a restart within the second) before a call is
//! sent on it, when it was unused for a few milliseconds (as no connection
//! is under load), and before every change (a give-back, an add): a call
//! queued on it would fail as one lost on the wire, a charge refused or
//! uncounted, a change that may have been applied and is never sent again.
//! The call then goes on a fresh connection (see `Connection::closed`).
//!
//! A cluster's connection spans every node, and what failed is most likely
//! one node: the others still answer on it. So a cluster's connection that
//! failed goes on serving calls while a replacement is opened in a task of
//! its own, and gives way only to one that reaches every master: one opened
//! while a node is stopped or unreachable would lack that node, and the
//! cluster client would stop every call while it looks for the node again.
//! Tries are a second apart, twice as long after each failed one, up to
//! 8 s. Calls for the subjects of the other nodes never wait for a
//! replacement. Nor do they wait for a check: an idle cluster connection
//! is checked (every master the cluster names answers a `PING` sent to its
//! address) in a task of its own while it goes on serving, and so is a
//! slot's first connection once it is open, which a caller had to wait
//! for. So after a restart during a lull, the restarted node's subjects
//! lose their first call, where a server's lose none.
//!
//! The cluster client never retries a request by itself (redis-rs retries up
//! to 16 times by default, after connection errors too, which could apply a
//! charge twice). A call of the counters script (a charge, refund, add,
//! settle or reset) that a node redirects while its slot moves (a resharding:
//! `MOVED`, `ASK`) is sent where it is told, and one answered `TRYAGAIN`
//! (its keys on both nodes of a moving slot) is sent again a moment later:
//! a node answers those before it runs anything (see
//! `Invocation::invoke_async`). A redirected call goes through a
//! connection of its own to the node named (`Outside`): the cluster's
//! connection, asked for a node it does not reach (a master that serves no
//! slot yet, added for a scale-out), would connect to every node anew. The
//! slot map is read again after a `MOVED`, for the next calls. While a
//! slot moves, its old node answers `TRYAGAIN` to a call of several keys
//! of which some are still there and some are not (not yet made, or moved
//! already), until those it holds have moved: a charge of several quotas
//! on a subject's first call of a period (a day's counter to make beside
//! a month's that exists), and every charge of a `LeasedStore` (a counter
//! and its lease mark, which seldom exists). Such a call is tried again
//! for a second, then fails: the charges of the subjects of a slot that
//! moves fail (as a store error: the policy's fail open or closed) until
//! its keys have moved, which a resharding tool does slot by slot, its
//! keys in batches. A cluster pool built elsewhere follows redirects as
//! its own client does.
//!
//! Pools built elsewhere (`deadpool_redis::Pool`, and its cluster kind) are
//! used as they are: one pooled connection per call (or batch of charges),
//! held for its round trip; one that failed on the wire is closed instead of
//! going back.

use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use deadpool::managed::{PoolError, Timeouts};
use deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use deadpool_redis::redis::{self, RedisError, Value};

use super::late::Sends;
use crate::store::patience::LastAnswer;
use crate::throttle::Throttle;

/// A connection idle for this long is pinged before it is used again.
const IDLE: Duration = Duration::from_secs(1);

/// A server's connection unused for this long is checked for a socket the
/// server closed meanwhile (a restart) before a call is sent on it: queued
/// on it, the call would fail as one lost on the wire (see
/// [`Connection::closed`]). Shorter than any restart, and far longer than
/// the gaps between calls under load, which then cost no check.
const QUIET: Duration = Duration::from_millis(5);

/// How long the answer of a check for a closed socket is waited for, in
/// its task (see [`Connection::closed`]).
const PROBE_ANSWER: Duration = Duration::from_secs(1);

/// Lets a few warnings a second through about replacements that could not
/// be opened (during an outage, one per call).
static REPLACING: Throttle = Throttle::new(5);

/// Opens one connection of a shared set.
pub(super) trait Connect: Send + Sync + 'static {
    type Conn: ConnectionLike + Clone + Send + Sync + 'static;

    /// Whether a connection that failed still serves calls until its
    /// replacement is open: one that spans nodes, of which one failed.
    const SERVES_WHILE_REPLACED: bool = false;

    fn connect(&self) -> impl Future<Output = Result<Self::Conn, RedisError>> + Send;

    /// Whether a replacement for a connection that serves while replaced
    /// can take its place: it reaches everything the old one did.
    fn complete(_conn: &mut Self::Conn) -> impl Future<Output = bool> + Send {
        std::future::ready(true)
    }
}

pub(super) struct ServerConnector {
    pub(super) client: redis::Client,
    pub(super) config: redis::AsyncConnectionConfig,
}

impl Connect for ServerConnector {
    type Conn = MultiplexedConnection;

    async fn connect(&self) -> Result<MultiplexedConnection, RedisError> {
        self.client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await
    }
}

#[cfg(feature = "redis-cluster")]
pub(super) struct ClusterConnector {
    pub(super) client: redis::cluster::ClusterClient,
    pub(super) outside: Arc<Outside>,
}

/// Connections of their own to the nodes redirected calls go to (see the
/// module's docs): the cluster's connection, asked for a node by address,
/// reaches only the nodes that serve slots, and connects to every node
/// anew for one that serves none yet (a master a slot is moving to, in a
/// scale-out).
#[cfg(feature = "redis-cluster")]
pub(super) struct Outside {
    /// The first URL's: credentials and TLS, its address replaced.
    seed: redis::ConnectionInfo,
    config: redis::AsyncConnectionConfig,
    nodes: Mutex<std::collections::HashMap<(String, u16), MultiplexedConnection>>,
}

#[cfg(feature = "redis-cluster")]
impl Outside {
    /// Nodes kept at most: a cluster adds a few at a time.
    const MAX_NODES: usize = 16;

    pub(super) fn new(seed: redis::ConnectionInfo, config: redis::AsyncConnectionConfig) -> Self {
        Self {
            seed,
            config,
            nodes: Mutex::default(),
        }
    }

    /// `cmd` on the node `to` names (after `ASKING`, for an `ASK`).
    async fn send(&self, to: &Redirect, cmd: &redis::Cmd) -> redis::RedisResult<Value> {
        let (host, port) = (to.host.as_str(), to.port);
        let mut conn = self.connection(host, port).await?;
        let result = if to.ask {
            let mut pipe = redis::pipe();
            pipe.cmd("ASKING").add_command(cmd.clone());
            conn.req_packed_commands(&pipe, 1, 1)
                .await
                .and_then(|mut replies| {
                    replies.pop().ok_or_else(|| {
                        RedisError::from((
                            redis::ErrorKind::UnexpectedReturnType,
                            "no reply to a call sent after ASKING",
                        ))
                    })
                })
        } else {
            conn.req_packed_command(cmd).await
        };
        if result.as_ref().is_err_and(|e| !super::came_back(e)) {
            // Lost on the wire: opened anew for the next call.
            self.nodes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&(host.to_owned(), port));
        }
        result.and_then(Value::extract_error)
    }

    async fn connection(&self, host: &str, port: u16) -> redis::RedisResult<MultiplexedConnection> {
        let node = (host.to_owned(), port);
        if let Some(conn) = self
            .nodes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&node)
        {
            return Ok(conn.clone());
        }
        let addr = match self.seed.addr() {
            redis::ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => redis::ConnectionAddr::TcpTls {
                host: node.0.clone(),
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => redis::ConnectionAddr::Tcp(node.0.clone(), port),
        };
        let client = redis::Client::open(self.seed.clone().set_addr(addr))?;
        let conn = client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        let mut nodes = self.nodes.lock().unwrap_or_else(|e| e.into_inner());
        if nodes.len() >= Self::MAX_NODES {
            nodes.clear();
        }
        nodes.insert(node, conn.clone());
        Ok(conn)
    }
}

#[cfg(feature = "redis-cluster")]
impl Connect for ClusterConnector {
    type Conn = redis::cluster_async::ClusterConnection;

    const SERVES_WHILE_REPLACED: bool = true;

    async fn connect(&self) -> Result<Self::Conn, RedisError> {
        self.client.get_async_connection().await
    }

    /// Every master the cluster names answers a `PING` sent to its own
    /// address. (A `PING` routed to all masters would leave out one the
    /// connection never reached.)
    async fn complete(conn: &mut Self::Conn) -> bool {
        use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
        let any = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);
        let mut cluster_slots = redis::cmd("CLUSTER");
        cluster_slots.arg("SLOTS");
        let Ok(slots) = conn.route_command(cluster_slots, any).await else {
            return false;
        };
        let masters = masters(&slots);
        if masters.is_empty() {
            return false;
        }
        for (host, port) in masters {
            let node = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port });
            if conn.route_command(redis::cmd("PING"), node).await.is_err() {
                return false;
            }
        }
        true
    }
}

/// The masters' addresses in a `CLUSTER SLOTS` reply, each once.
#[cfg(feature = "redis-cluster")]
fn masters(slots: &Value) -> Vec<(String, u16)> {
    let mut masters: Vec<(String, u16)> = Vec::new();
    for (_, _, master) in super::nodes::slot_ranges(slots) {
        if !masters.contains(&master) {
            masters.push(master);
        }
    }
    masters
}

/// A fixed set of connections that every call uses concurrently.
pub(super) struct Shared<C: Connect> {
    connector: C,
    slots: Box<[Slot<C::Conn>]>,
    next: AtomicUsize,
    /// The instant `Slot::used` counts from.
    origin: Instant,
    /// How long a ping may take.
    ping_timeout: Duration,
    /// Bumped when a connection fails on the wire: connections opened in an
    /// earlier epoch are not handed out again.
    epoch: AtomicU64,
    /// Where the answers to checks of idle connections are noted.
    /// None on a cluster, whose answers move no wait (see `Inner::heard`).
    last_answer: Option<Arc<LastAnswer>>,
}

struct Slot<T> {
    /// The slot's connection, the epoch it was opened in, and how many
    /// answers came back on it.
    current: Mutex<Option<(u64, T, Arc<AtomicU64>)>>,
    /// When the slot was last used, in milliseconds from `Shared::origin`.
    used: AtomicU64,
    /// When a call was last sent on the slot's connection known open then
    /// (used a moment before, pinged, opened or checked), in milliseconds
    /// from `Shared::origin`. Not moved by a caller handed it quiet, before
    /// its check: callers handed it meanwhile are checked too.
    sent: AtomicU64,
    /// Held while this slot's connection is being opened.
    connecting: Arc<tokio::sync::Mutex<()>>,
    /// Replacements in a row that could not be opened (see
    /// `Shared::replace`).
    failures: AtomicU32,
}

impl<T> Slot<T> {
    /// Whether the slot's connection, handed to a call at `now`, is quiet
    /// (no call sent on it known open for [`QUIET`]): the call checks it
    /// first. One that is not counts as known open for this call too.
    fn quiet(&self, now: u64) -> bool {
        let quiet =
            now.saturating_sub(self.sent.load(Ordering::Acquire)) >= QUIET.as_millis() as u64;
        if !quiet {
            self.sent.fetch_max(now, Ordering::Release);
        }
        quiet
    }
}

impl<T: Clone> Slot<T> {
    /// The slot's connection and its count of answers, if it was opened in
    /// `epoch`. A stale one (opened before) is dropped here, so that its
    /// socket closes once the calls still on it are answered.
    fn current(&self, epoch: u64) -> Option<(T, Arc<AtomicU64>)> {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        match &*current {
            Some((opened, conn, answers)) if *opened == epoch => {
                Some((conn.clone(), Arc::clone(answers)))
            }
            Some(_) => {
                *current = None;
                None
            }
            None => None,
        }
    }

    /// The slot's connection, current or stale, the epoch it was opened in,
    /// and its count of answers.
    fn any(&self) -> Option<(u64, T, Arc<AtomicU64>)> {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        current
            .as_ref()
            .map(|(opened, conn, answers)| (*opened, conn.clone(), Arc::clone(answers)))
    }
}

/// A slot's connection as handed to one call.
pub(super) struct Handed<T> {
    /// The slot it is of.
    slot: usize,
    /// The epoch it was opened in.
    epoch: u64,
    conn: T,
    /// How many answers came back on it.
    answers: Arc<AtomicU64>,
    /// Unused for [`QUIET`] (and not pinged since): the server may have
    /// closed it meanwhile (see [`Connection::closed`]).
    quiet: bool,
}

impl<T> Handed<T> {
    /// A connection in use a moment ago, just pinged, or just opened.
    fn new(slot: usize, epoch: u64, conn: T, answers: Arc<AtomicU64>) -> Self {
        Self {
            slot,
            epoch,
            conn,
            answers,
            quiet: false,
        }
    }
}

impl<C: Connect> Shared<C> {
    /// `last_answer` notes the answers to the checks of idle connections
    /// (see `Patience`).
    pub(super) fn new(
        connector: C,
        size: usize,
        ping_timeout: Duration,
        last_answer: Option<Arc<LastAnswer>>,
    ) -> Self {
        let slots = (0..size.max(1))
            .map(|_| Slot {
                current: Mutex::new(None),
                used: AtomicU64::new(0),
                sent: AtomicU64::new(0),
                connecting: Arc::new(tokio::sync::Mutex::new(())),
                failures: AtomicU32::new(0),
            })
            .collect();
        Self {
            connector,
            slots,
            next: AtomicUsize::new(0),
            origin: Instant::now(),
            ping_timeout,
            epoch: AtomicU64::new(0),
            last_answer,
        }
    }

    /// Milliseconds since `origin`.
    fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The connection of slot `index` that may serve a call in `epoch`, the
    /// epoch it was opened in, and its count of answers: one opened in
    /// `epoch`; or, when connections serve while replaced, one opened
    /// before, whose replacement is then being opened.
    fn usable(
        self: &Arc<Self>,
        index: usize,
        epoch: u64,
    ) -> Option<(u64, C::Conn, Arc<AtomicU64>)> {
        let slot = &self.slots[index];
        if !C::SERVES_WHILE_REPLACED {
            return slot
                .current(epoch)
                .map(|(conn, answers)| (epoch, conn, answers));
        }
        let (opened, conn, answers) = slot.any()?;
        if opened != epoch {
            self.replace(index);
        }
        Some((opened, conn, answers))
    }

    /// Opens a replacement for slot `index`'s connection in a task of its
    /// own, unless one is being opened already; it takes the slot only if
    /// it is [complete](Connect::complete). After a try that failed, the
    /// next waits a second, twice as long after each failure in a row, up
    /// to 8 s.
    fn replace(self: &Arc<Self>, index: usize) {
        let slot = &self.slots[index];
        let Ok(connecting) = Arc::clone(&slot.connecting).try_lock_owned() else {
            return;
        };
        let epoch = self.epoch.load(Ordering::Acquire);
        if slot.any().is_some_and(|(opened, ..)| opened == epoch) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let shared = Arc::clone(self);
        drop(runtime.spawn(async move {
            let _connecting = connecting;
            let opening = async {
                let mut conn = shared.connector.connect().await?;
                Ok::<_, RedisError>(C::complete(&mut conn).await.then_some(conn))
            };
            let why = match tokio::time::timeout(2 * shared.ping_timeout, opening).await {
                Ok(Ok(Some(conn))) => {
                    let slot = &shared.slots[index];
                    *slot.current.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some((epoch, conn, Arc::new(AtomicU64::new(0))));
                    slot.failures.store(0, Ordering::Relaxed);
                    return;
                }
                Ok(Ok(None)) => "a node did not answer on it".to_owned(),
                Ok(Err(error)) => error.to_string(),
                Err(_) => "it did not open in time".to_owned(),
            };
            if let Some(suppressed) = REPLACING.admit() {
                tracing::warn!(
                    why,
                    suppressed,
                    "could not replace a Redis connection that failed; the one before goes on \
                     serving the nodes that answer"
                );
            }
            // The lock held a while: the next try comes that much later.
            // (The store is not kept alive meanwhile.)
            let failures = shared.slots[index].failures.fetch_add(1, Ordering::Relaxed);
            drop(shared);
            tokio::time::sleep(IDLE * (1 << failures.min(3))).await;
        }));
    }

    /// Checks slot `index`'s connection, opened in `epoch`, in a task of
    /// its own: one that is not [complete](Connect::complete) is failed,
    /// and goes on serving while a replacement is tried.
    fn check(self: &Arc<Self>, index: usize, epoch: u64, mut conn: C::Conn) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let shared = Arc::clone(self);
        drop(runtime.spawn(async move {
            let complete = C::complete(&mut conn);
            if !matches!(
                tokio::time::timeout(shared.ping_timeout, complete).await,
                Ok(true)
            ) {
                shared.failed(epoch);
                shared.replace(index);
            }
        }));
    }

    /// The next slot's connection when it can be had without waiting: open
    /// in the current epoch (or serving while replaced) and used within
    /// [`IDLE`]. Otherwise nothing, and the slot is left for
    /// [`get`](Self::get), which pings, opens or reopens it.
    fn ready(self: &Arc<Self>) -> Option<Handed<C::Conn>> {
        let now = self.now();
        let mut next = self.next.load(Ordering::Relaxed);
        // A few tries: callers that race for one turn each take the next.
        for _ in 0..4 {
            let slot = &self.slots[next % self.slots.len()];
            // Acquire: pairs with the Release of `get`'s swap. A `get` that
            // marked this slot used (and may be pinging it) took its turn
            // before: the exchange below then fails, and the connection it
            // checks is not handed out unchecked.
            let idle = now.saturating_sub(slot.used.load(Ordering::Acquire));
            if idle >= IDLE.as_millis() as u64 {
                return None;
            }
            let epoch = self.epoch.load(Ordering::Acquire);
            // Missing or stale: the turn is left for `get`, which opens it.
            let (opened, conn, answers) = self.usable(next % self.slots.len(), epoch)?;
            match self.next.compare_exchange(
                next,
                next.wrapping_add(1),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    slot.used.fetch_max(now, Ordering::Relaxed);
                    return Some(Handed {
                        slot: next % self.slots.len(),
                        epoch: opened,
                        conn,
                        answers,
                        quiet: slot.quiet(now),
                    });
                }
                Err(current) => next = current,
            }
        }
        None
    }

    /// A connection, opened first if need be. A connection is opened in a
    /// task of its own, so it is opened for the next callers even when this
    /// one stops waiting.
    async fn get(self: &Arc<Self>) -> Result<Handed<C::Conn>, RedisError> {
        let index = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let slot = &self.slots[index];
        let now = self.now();
        // Release: see `ready`.
        let idle = now.saturating_sub(slot.used.swap(now, Ordering::AcqRel));
        let epoch = self.epoch.load(Ordering::Acquire);
        if let Some((opened, mut conn, answers)) = self.usable(index, epoch) {
            if opened != epoch {
                // Serving while its replacement opens.
                return Ok(Handed::new(index, opened, conn, answers));
            }
            if idle < IDLE.as_millis() as u64 {
                return Ok(Handed {
                    quiet: slot.quiet(now),
                    ..Handed::new(index, epoch, conn, answers)
                });
            }
            if C::SERVES_WHILE_REPLACED {
                // A node that does not answer would hold this caller for
                // nothing: the connection serves the others either way.
                self.check(index, epoch, conn.clone());
                return Ok(Handed::new(index, epoch, conn, answers));
            }
            if self.ping(&mut conn).await {
                answers.fetch_add(1, Ordering::Relaxed);
                if let Some(last_answer) = &self.last_answer {
                    last_answer.heard();
                }
                self.sent(index);
                return Ok(Handed::new(index, epoch, conn, answers));
            }
            // This caller waits for a fresh connection: after a restart
            // during a lull, the old one would fail every call.
            self.failed(epoch);
        }
        if !C::SERVES_WHILE_REPLACED {
            // Read again: a failed ping above ended the epoch it read.
            let epoch = self.epoch.load(Ordering::Acquire);
            if let Some(open) = self.open_beside(index, epoch, now) {
                return Ok(open);
            }
        }
        let connecting = Arc::clone(&slot.connecting).lock_owned().await;
        let epoch = self.epoch.load(Ordering::Acquire);
        if C::SERVES_WHILE_REPLACED {
            // Opened meanwhile by the caller before: it serves, replaced in
            // the background if it is stale already.
            if let Some((opened, conn, answers)) = slot.any() {
                drop(connecting);
                if opened != epoch {
                    self.replace(index);
                }
                return Ok(Handed::new(index, opened, conn, answers));
            }
        } else if let Some((conn, answers)) = slot.current(epoch) {
            self.sent(index);
            return Ok(Handed::new(index, epoch, conn, answers));
        }
        let shared = Arc::clone(self);
        let opening = tokio::spawn(async move {
            let _connecting = connecting;
            let opened = shared.open(index, epoch).await;
            if let (true, Ok((conn, _))) = (C::SERVES_WHILE_REPLACED, &opened) {
                // Opened while a node may have been away: the callers had
                // to wait for it, but it is replaced if it lacks a node.
                shared.check(index, epoch, conn.clone());
            }
            opened
        });
        match opening.await {
            Ok(opened) => opened.map(|(conn, answers)| {
                self.sent(index);
                Handed::new(index, epoch, conn, answers)
            }),
            Err(error) => Err(RedisError::from(std::io::Error::other(format!(
                "opening a Redis connection failed: {error}"
            )))),
        }
    }

    /// Another slot's connection, open in `epoch` and used within the
    /// second, for a caller whose slot `index` has none: that one opens in a
    /// task of its own (unless it is being opened already), and no caller
    /// waits for a connection while another is open (a burst on a store
    /// that opened one connection yet, on a machine too busy to open the
    /// next at once, would otherwise fail charges while Redis answers).
    fn open_beside(
        self: &Arc<Self>,
        index: usize,
        epoch: u64,
        now: u64,
    ) -> Option<Handed<C::Conn>> {
        let count = self.slots.len();
        let (other, conn, answers) = (1..count).map(|k| (index + k) % count).find_map(|other| {
            let slot = &self.slots[other];
            let idle = now.saturating_sub(slot.used.load(Ordering::Acquire));
            if idle >= IDLE.as_millis() as u64 {
                return None;
            }
            let (conn, answers) = slot.current(epoch)?;
            Some((other, conn, answers))
        })?;
        if let Ok(connecting) = Arc::clone(&self.slots[index].connecting).try_lock_owned() {
            let shared = Arc::clone(self);
            drop(tokio::spawn(async move {
                let _connecting = connecting;
                // The epoch when it runs: one that ended meanwhile opens
                // nothing of its own.
                let epoch = shared.epoch.load(Ordering::Acquire);
                if shared.slots[index].current(epoch).is_none() {
                    // A failure is the store's whole (see `open`); the next
                    // caller of this slot tries again.
                    let _ = shared.open(index, epoch).await;
                }
            }));
        }
        let slot = &self.slots[other];
        slot.used.fetch_max(now, Ordering::Relaxed);
        Some(Handed {
            quiet: slot.quiet(now),
            ..Handed::new(other, epoch, conn, answers)
        })
    }

    /// Opens the connection of slot `index`, in `epoch`.
    async fn open(
        &self,
        index: usize,
        epoch: u64,
    ) -> Result<(C::Conn, Arc<AtomicU64>), RedisError> {
        let conn = match self.connector.connect().await {
            Ok(conn) => conn,
            Err(error) => {
                // The server is gone or unreachable: so are the connections
                // opened before.
                self.failed(epoch);
                return Err(error);
            }
        };
        let answers = Arc::new(AtomicU64::new(0));
        *self.slots[index]
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some((epoch, conn.clone(), Arc::clone(&answers)));
        Ok((conn, answers))
    }

    /// Whether `conn` answers a `PING` in time.
    async fn ping(&self, conn: &mut C::Conn) -> bool {
        let cmd = redis::cmd("PING");
        let ping = cmd.query_async::<String>(conn);
        matches!(tokio::time::timeout(self.ping_timeout, ping).await, Ok(Ok(pong)) if pong == "PONG")
    }

    /// A call goes on slot `index`'s connection, known open now (just
    /// opened, pinged or checked): the callers handed it next need not
    /// check it.
    fn sent(&self, index: usize) {
        self.slots[index]
            .sent
            .fetch_max(self.now(), Ordering::Release);
    }

    /// A connection of `epoch` failed on the wire: that epoch is over.
    fn failed(&self, epoch: u64) {
        let _ = self
            .epoch
            .compare_exchange(epoch, epoch + 1, Ordering::AcqRel, Ordering::Relaxed);
    }
}

/// Why no connection was had.
pub(super) enum Fault {
    Redis(RedisError),
    Pool(PoolError<RedisError>),
}

pub(super) enum Connections {
    Server(Arc<Shared<ServerConnector>>),
    /// A pool made by the app, and where the store notes Redis's answers
    /// (see `counted`).
    Pool(deadpool_redis::Pool, Arc<LastAnswer>),
    #[cfg(feature = "redis-cluster")]
    Cluster(Arc<Shared<ClusterConnector>>),
    #[cfg(feature = "redis-cluster")]
    ClusterPool(deadpool_redis::cluster::Pool),
}

impl Connections {
    /// A shared connection that can be had at once (see `Shared::ready`),
    /// without the future of [`get`](Self::get), which is large (a pool's
    /// wait is in it): the common case costs no allocation. `None` for a
    /// pool, or when the connection must be pinged or opened first.
    pub(super) fn ready(&self) -> Option<Connection> {
        match self {
            Connections::Server(shared) => shared
                .ready()
                .map(|handed| Connection::server(handed, shared.last_answer.clone())),
            #[cfg(feature = "redis-cluster")]
            Connections::Cluster(shared) => {
                shared
                    .ready()
                    .map(|Handed { epoch, conn, .. }| Connection::Cluster {
                        epoch,
                        conn,
                        outside: Arc::clone(&shared.connector.outside),
                        failed_outside: false,
                        sent_to: None,
                    })
            }
            _ => None,
        }
    }

    /// A connection for one call.
    pub(super) async fn get(&self, timeouts: &Timeouts) -> Result<Connection, Fault> {
        // A pool built without a runtime cannot time its own waits; the
        // store's timeout around this call bounds them instead.
        macro_rules! get {
            ($pool:expr, $variant:expr) => {
                match $pool.timeout_get(timeouts).await {
                    Err(PoolError::NoRuntimeSpecified) => $pool.get().await.map($variant),
                    other => other.map($variant),
                }
                .map_err(Fault::Pool)
            };
        }
        match self {
            Connections::Server(shared) => shared
                .get()
                .await
                .map(|handed| Connection::server(handed, shared.last_answer.clone()))
                .map_err(Fault::Redis),
            // The pool pings a connection before it hands it over, and one
            // it opens has had its setup answered (`CLIENT SETINFO`, unless
            // the app's connection info skips it and sets no password,
            // database or protocol: then opening it was a TCP connect only,
            // taken for an answer here). Noted as the store's own answers.
            Connections::Pool(pool, heard) => get!(pool, |pooled| {
                heard.heard();
                Connection::pooled(pooled, Arc::clone(heard))
            }),
            #[cfg(feature = "redis-cluster")]
            Connections::Cluster(shared) => shared
                .get()
                .await
                .map(|Handed { epoch, conn, .. }| Connection::Cluster {
                    epoch,
                    conn,
                    outside: Arc::clone(&shared.connector.outside),
                    failed_outside: false,
                    sent_to: None,
                })
                .map_err(Fault::Redis),
            #[cfg(feature = "redis-cluster")]
            Connections::ClusterPool(pool) => get!(pool, Connection::ClusterPool),
        }
    }

    /// A connection for one call by `deadline`: a [ready](Self::ready) one
    /// at once, or else the wait for one ([`get`](Self::get)), boxed: a
    /// large future that a call only needs at times. Checked for a socket
    /// the server closed already (see [`Connection::closed`]), and a fresh
    /// one had in its place: before a change (`sends` a write: lost on the
    /// wire, it may have been applied and is never sent again), and before
    /// a charge or a read on a connection quiet for a while (which would
    /// otherwise fail after a restart during a lull). `None` when none came
    /// in time.
    pub(super) async fn ready_or_get(
        &self,
        timeouts: &Timeouts,
        deadline: tokio::time::Instant,
        sends: Sends,
    ) -> Option<Result<Connection, Fault>> {
        let conn = match self.ready() {
            Some(conn) => conn,
            None => match self.wait_for(timeouts, deadline).await? {
                Ok(conn) => conn,
                Err(fault) => return Some(Err(fault)),
            },
        };
        if !matches!(sends, Sends::Write) && !conn.quiet() {
            return Some(Ok(conn));
        }
        // Only a server's connections are checked (see `Connection::closed`).
        let closed = match self {
            Connections::Server(shared) => Box::pin(conn.closed(shared.last_answer.as_ref())).await,
            _ => false,
        };
        if !closed {
            // Known open: the callers handed it next need not check it.
            if let (Connections::Server(shared), Connection::Server { slot, .. }) = (self, &conn) {
                shared.sent(*slot);
            }
            return Some(Ok(conn));
        }
        self.failed(conn.failed());
        match self.ready() {
            Some(conn) => Some(Ok(conn)),
            None => self.wait_for(timeouts, deadline).await,
        }
    }

    /// A connection by `deadline` ([`get`](Self::get), boxed); `None` when
    /// none came in time.
    async fn wait_for(
        &self,
        timeouts: &Timeouts,
        deadline: tokio::time::Instant,
    ) -> Option<Result<Connection, Fault>> {
        tokio::time::timeout_at(deadline, Box::pin(self.get(timeouts)))
            .await
            .ok()
    }

    /// `conn` failed on the wire (or never answered): it is not used again,
    /// and neither are the store's other connections opened before.
    pub(super) fn failed(&self, conn: Failed) {
        match (self, conn) {
            (Connections::Server(shared), Failed::Epoch(epoch)) => shared.failed(epoch),
            #[cfg(feature = "redis-cluster")]
            (Connections::Cluster(shared), Failed::Epoch(epoch)) => shared.failed(epoch),
            (_, Failed::Pooled(conn)) => conn.discard(),
            _ => {}
        }
    }

    /// Replaces a cluster's connections (their epoch is over), and waits
    /// until each serves anew, `within` at most.
    #[cfg(feature = "redis-cluster")]
    pub(super) async fn renew(&self, within: Duration) {
        let Connections::Cluster(shared) = self else {
            return;
        };
        shared.failed(shared.epoch.load(Ordering::Acquire));
        let deadline = Instant::now() + within;
        loop {
            let epoch = shared.epoch.load(Ordering::Acquire);
            let mut renewed = true;
            for index in 0..shared.slots.len() {
                if let Some((opened, ..)) = shared.slots[index].any() {
                    if opened != epoch {
                        renewed = false;
                        shared.replace(index);
                    }
                }
            }
            if renewed || Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether this is a cluster's: its nodes answer apart, and one
    /// node's answers tell nothing of another's silence.
    pub(super) fn cluster(&self) -> bool {
        match self {
            Connections::Server(_) | Connections::Pool(..) => false,
            #[cfg(feature = "redis-cluster")]
            Connections::Cluster(_) | Connections::ClusterPool(_) => true,
        }
    }

    /// Whether this is a cluster, and how many connections it keeps (or
    /// the most the pool opens).
    pub(super) fn status(&self) -> (bool, usize) {
        let size = match self {
            Connections::Server(shared) => shared.slots.len(),
            Connections::Pool(pool, _) => pool.status().max_size,
            #[cfg(feature = "redis-cluster")]
            Connections::Cluster(shared) => shared.slots.len(),
            #[cfg(feature = "redis-cluster")]
            Connections::ClusterPool(pool) => pool.status().max_size,
        };
        (self.cluster(), size)
    }
}

/// One call's connection: a clone of a shared one, or one checked out of a
/// pool.
pub(super) enum Connection {
    Server {
        /// The slot it is of.
        slot: usize,
        epoch: u64,
        conn: MultiplexedConnection,
        /// Answers that came back on this connection, whoever sent them
        /// (counted as they come, see `counted`).
        answers: Arc<AtomicU64>,
        /// Where every answer on it is noted as it comes (see `counted`):
        /// one a call reads on its way (a `NOSCRIPT` before the script is
        /// sent again) moves the call's wait as the call's own does.
        heard: Option<Arc<LastAnswer>>,
        /// Unused for a while before this call (see [`Handed::quiet`]).
        quiet: bool,
    },
    Pool {
        /// Checked out of the pool for the call's round trip.
        pooled: deadpool_redis::Connection,
        /// A handle on the same socket that waits for Redis's answer as
        /// long as the call is followed. (deadpool-redis's connections give
        /// up after 500 ms by default, and a charge cut off that way could
        /// be applied later without being given back.) The pooled
        /// connection's own setting is left as it is.
        conn: MultiplexedConnection,
        /// Where every answer on it is noted as it comes (see `counted`).
        heard: Arc<LastAnswer>,
    },
    #[cfg(feature = "redis-cluster")]
    Cluster {
        epoch: u64,
        conn: redis::cluster_async::ClusterConnection,
        outside: Arc<Outside>,
        /// The call was redirected to a node outside the cluster's
        /// connection, and failed there: that node's, not this
        /// connection's, failure.
        failed_outside: bool,
        /// The node a redirect last sent the call to: the node that ran it,
        /// if it was run (see `RedisStore::follow`).
        sent_to: Option<Redirect>,
    },
    #[cfg(feature = "redis-cluster")]
    ClusterPool(deadpool_redis::cluster::Connection),
}

/// A shared connection a call was sent on, as it was then.
pub(super) struct Lost {
    pub(super) failed: Failed,
    /// The connection's count of answers, and what it was when the call
    /// was sent; none on a cluster, whose one connection answers for every
    /// node (one node gone silent would hide behind the others' answers).
    answers: Option<(Arc<AtomicU64>, u64)>,
}

impl Lost {
    /// Whether nothing at all came back on the connection since the call
    /// was sent: it went silent (half-open, or the server stopped), unlike
    /// one that is merely busy answering the calls sent before. On a
    /// cluster, whether the call itself is still unanswered.
    pub(super) fn silent(&self) -> bool {
        self.answers
            .as_ref()
            .is_none_or(|(answers, seen)| answers.load(Ordering::Relaxed) == *seen)
    }

    /// How much longer than [`SILENCE`](super::SILENCE) a call waits before
    /// its connection is taken for silent: on a cluster, where the call
    /// itself is watched, the time a call answered `TRYAGAIN` is sent again
    /// (a slot on the move is not a node gone silent, and would otherwise
    /// make every node's connection anew).
    pub(super) fn patience(&self) -> std::time::Duration {
        if self.answers.is_some() {
            std::time::Duration::ZERO
        } else {
            super::script::TRY_AGAIN_FOR
        }
    }
}

/// The connections of a single server on which a call was given up on by
/// its caller while nothing came back since it was sent: each one's count
/// of answers, that count when the call was sent, and when. A connection
/// that answered nothing for the store's timeout since is known silent
/// (its server stalled, or the socket is half-open), and is sent nothing
/// more (see `RedisStore::follow_to`) until it answers or is left for a
/// fresh one (see `late::wait_for`): sent on, calls at the rates a server
/// serves would fill its socket's buffers within a second, and past a
/// stall of 3 s the kernel would fail the connection (`TCP_USER_TIMEOUT`),
/// the calls on it lost on the wire (a charge Redis applies once it
/// resumes never given back).
#[derive(Default)]
pub(super) struct Unanswered {
    /// How many connections are noted: none, no lock on a call's way.
    noted: AtomicUsize,
    silent: Mutex<Vec<(Arc<AtomicU64>, u64, tokio::time::Instant)>>,
}

impl Unanswered {
    /// Notes a call sent at `sent` on the connection `lost` names, which
    /// its caller gave up on.
    pub(super) fn given_up(&self, lost: &Lost, sent: tokio::time::Instant) {
        let Some((answers, seen)) = &lost.answers else {
            return;
        };
        if answers.load(Ordering::Relaxed) != *seen {
            return;
        }
        let mut silent = self.noted_now(tokio::time::Instant::now());
        if !silent.iter().any(|(noted, ..)| Arc::ptr_eq(noted, answers)) {
            silent.push((Arc::clone(answers), *seen, sent));
        }
        self.noted.store(silent.len(), Ordering::Relaxed);
    }

    /// Whether `conn` answered nothing for `budget` since a call on it
    /// was given up on.
    pub(super) fn silent(&self, conn: &Connection, budget: Duration) -> bool {
        if self.noted.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let Connection::Server { answers, .. } = conn else {
            return false;
        };
        let now = tokio::time::Instant::now();
        let silent = self.noted_now(now);
        silent.iter().any(|(noted, _, at)| {
            Arc::ptr_eq(noted, answers) && now.saturating_duration_since(*at) >= budget
        })
    }

    /// The connections noted, locked, without those that answered since or
    /// were noted longer than `FOLLOW_THROUGH` before `now`: once none is
    /// left, calls take no lock.
    fn noted_now(
        &self,
        now: tokio::time::Instant,
    ) -> std::sync::MutexGuard<'_, Vec<(Arc<AtomicU64>, u64, tokio::time::Instant)>> {
        let mut silent = self
            .silent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        silent.retain(|(noted, seen, at)| {
            noted.load(Ordering::Relaxed) == *seen
                && now.saturating_duration_since(*at) < super::FOLLOW_THROUGH
        });
        self.noted.store(silent.len(), Ordering::Relaxed);
        silent
    }
}

/// What a connection answers after a call was sent on it at `sent` (a
/// single server's; a cluster's connection answers for every node, and a
/// pool's is the call's own): whether it went silent since, for the call's
/// wait (see `Inner::last_answer_for`).
#[derive(Clone, Debug)]
pub(super) struct AnswersAfter {
    answers: Arc<AtomicU64>,
    seen: u64,
    pub(super) sent: tokio::time::Instant,
}

impl AnswersAfter {
    /// Whether anything came back on the connection since the call was
    /// sent.
    pub(super) fn any(&self) -> bool {
        self.answers.load(Ordering::Relaxed) != self.seen
    }
}

/// What to close after a failure.
pub(super) enum Failed {
    /// Nothing of this store's: a side connection, dropped already.
    #[cfg(feature = "redis-cluster")]
    Nothing,
    Epoch(u64),
    Pooled(Connection),
}

impl Connection {
    fn server(handed: Handed<MultiplexedConnection>, heard: Option<Arc<LastAnswer>>) -> Self {
        let Handed {
            slot,
            epoch,
            conn,
            answers,
            quiet,
        } = handed;
        Connection::Server {
            slot,
            epoch,
            conn,
            answers,
            heard,
            quiet,
        }
    }

    /// Whether the connection was unused for a while before this call
    /// (see [`Handed::quiet`]).
    fn quiet(&self) -> bool {
        matches!(self, Connection::Server { quiet: true, .. })
    }

    fn pooled(pooled: deadpool_redis::Connection, heard: Arc<LastAnswer>) -> Self {
        let mut conn = MultiplexedConnection::clone(&pooled);
        conn.set_response_timeout(super::FOLLOW_THROUGH);
        Connection::Pool {
            pooled,
            conn,
            heard,
        }
    }

    /// What to close when this connection failed.
    pub(super) fn failed(self) -> Failed {
        match self {
            Connection::Server { epoch, .. } => Failed::Epoch(epoch),
            #[cfg(feature = "redis-cluster")]
            Connection::Cluster {
                failed_outside: true,
                ..
            } => Failed::Nothing,
            #[cfg(feature = "redis-cluster")]
            Connection::Cluster { epoch, .. } => Failed::Epoch(epoch),
            pooled => Failed::Pooled(pooled),
        }
    }

    /// Whether this connection is known to be closed already: its driver
    /// ended (the server closed the socket: a restart, within the second in
    /// which a connection used since is not pinged), so that a command
    /// queued on it now would never be written, and fail as one lost on the
    /// wire. Costs a `PING` queued on a live connection, whose answer
    /// nobody waits for but a task that notes it in `last_answer` (behind
    /// the calls sent before it, it is an answer from Redis: see
    /// `Patience`). Pooled connections are pinged when checked out, and a
    /// cluster's serves while replaced: for them, false.
    pub(super) async fn closed(&self, last_answer: Option<&Arc<LastAnswer>>) -> bool {
        match self {
            Connection::Server { conn, answers, .. } => {
                let mut probe = conn.clone();
                probe.set_response_timeout(PROBE_ANSWER);
                let (answers, last_answer) = (Arc::clone(answers), last_answer.cloned());
                let mut ping = Box::pin(async move {
                    let answer = redis::cmd("PING").query_async::<Value>(&mut probe).await;
                    if answer.as_ref().map_or_else(super::came_back, |_| true) {
                        answers.fetch_add(1, Ordering::Relaxed);
                        if let Some(last_answer) = &last_answer {
                            last_answer.heard();
                        }
                    }
                    answer
                });
                // Queued at once on a live connection, whose answer is then
                // awaited in a task; refused by one whose driver ended. The
                // connection's driver must have run to see a socket the
                // server closed (a restart while this thread was busy): the
                // zero timeout waits for the timer's next tick, and a yield
                // lets the tasks the I/O driver woke meanwhile (the
                // connection's driver among them) run first. Polled once and
                // left at once, the probe would miss the closed socket, and
                // the call would go out on it.
                if let Ok(answer) = tokio::time::timeout(Duration::ZERO, ping.as_mut()).await {
                    return answer.is_err_and(|error| super::errors::broken(&error));
                }
                tokio::task::yield_now().await;
                if let Ok(answer) = tokio::time::timeout(Duration::ZERO, ping.as_mut()).await {
                    return answer.is_err_and(|error| super::errors::broken(&error));
                }
                drop(tokio::spawn(ping));
                false
            }
            _ => false,
        }
    }

    /// What this connection answers after a call sent on it now.
    pub(super) fn answers_after(&self, sent: tokio::time::Instant) -> Option<AnswersAfter> {
        match self {
            Connection::Server { answers, .. } => Some(AnswersAfter {
                seen: answers.load(Ordering::Relaxed),
                answers: Arc::clone(answers),
                sent,
            }),
            _ => None,
        }
    }

    /// What to close when a call about to be sent on this connection never
    /// comes back; a pooled connection is in the lost call's hands.
    pub(super) fn lost(&self) -> Option<Lost> {
        match self {
            Connection::Server { epoch, answers, .. } => Some(Lost {
                failed: Failed::Epoch(*epoch),
                answers: Some((Arc::clone(answers), answers.load(Ordering::Relaxed))),
            }),
            #[cfg(feature = "redis-cluster")]
            Connection::Cluster { epoch, .. } => Some(Lost {
                failed: Failed::Epoch(*epoch),
                answers: None,
            }),
            _ => None,
        }
    }

    /// Closes a pooled connection that failed, instead of returning it to
    /// the pool.
    fn discard(self) {
        match self {
            Connection::Pool { pooled, .. } => drop(deadpool_redis::Connection::take(pooled)),
            #[cfg(feature = "redis-cluster")]
            Connection::ClusterPool(conn) => drop(deadpool_redis::cluster::Connection::take(conn)),
            _ => {}
        }
    }
}

/// Where a cluster node told a call to go instead: the call was not run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Redirect {
    host: String,
    port: u16,
    /// `ASK`: the slot is moving to that node, which takes the call once
    /// told `ASKING`. Else `MOVED`: the slot is served by that node now.
    ask: bool,
}

impl Redirect {
    /// A call sent to the node at `host:port`, as a `MOVED` would send it.
    #[cfg(feature = "redis-cluster")]
    pub(super) fn to_node((host, port): (String, u16)) -> Self {
        Redirect {
            host,
            port,
            ask: false,
        }
    }

    /// The redirect `error` tells, if it is one.
    pub(super) fn of(error: &RedisError) -> Option<Self> {
        use redis::{ErrorKind, ServerErrorKind};

        let (address, _slot) = error.redirect_node()?;
        let (host, port) = address.rsplit_once(':')?;
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = port.parse().ok()?;
        // (`redirect_node` answers only for a `MOVED` or an `ASK`.)
        let ask = error.kind() == ErrorKind::Server(ServerErrorKind::Ask);
        Some(Redirect { host, port, ask })
    }
}

impl Connection {
    /// Whether this is a cluster's connection, whose nodes may redirect a
    /// call.
    pub(super) fn is_cluster(&self) -> bool {
        match self {
            Connection::Server { .. } | Connection::Pool { .. } => false,
            #[cfg(feature = "redis-cluster")]
            Connection::Cluster { .. } => true,
            // A pool built elsewhere follows redirects as its client was
            // built to (redis-rs retries them by default).
            #[cfg(feature = "redis-cluster")]
            Connection::ClusterPool(_) => false,
        }
    }

    /// `cmd` sent to the node `redirect` names (after `ASKING`, for an
    /// `ASK`), on a connection of its own to that node: the cluster's
    /// connection is asked for no node by address (one it does not reach,
    /// a master that serves no slot yet, would make it connect to every
    /// node anew). A failure there is that node's, not this connection's.
    pub(super) async fn redirected(
        &mut self,
        cmd: &redis::Cmd,
        redirect: &Redirect,
    ) -> redis::RedisResult<Value> {
        #[cfg(feature = "redis-cluster")]
        if let Connection::Cluster {
            outside,
            failed_outside,
            sent_to,
            ..
        } = self
        {
            *sent_to = Some(redirect.clone());
            let result = outside.send(redirect, cmd).await;
            *failed_outside = result.as_ref().is_err_and(|e| !super::came_back(e));
            return result;
        }
        let _ = (cmd, redirect);
        Err(RedisError::from((
            redis::ErrorKind::Client,
            "only this store's own cluster connection follows redirects",
        )))
    }
}

#[cfg(feature = "redis-cluster")]
impl Connection {
    /// The node a redirect last sent a call on this connection to, if any.
    pub(super) fn sent_to(&self) -> Option<&Redirect> {
        match self {
            Connection::Cluster { sent_to, .. } => sent_to.as_ref(),
            _ => None,
        }
    }

    /// `CLUSTER SLOTS`, sent to the master of `slot` when given (a
    /// cluster's connection routes it to any node otherwise).
    pub(super) async fn cluster_slots(&mut self, slot: Option<u16>) -> redis::RedisResult<Value> {
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        if let Some(slot) = slot {
            if let Some(reply) = self.send_to_master_of(cmd.clone(), slot).await {
                return reply;
            }
        }
        cmd.query_async::<Value>(self).await
    }

    /// `PING`, sent to the master of `slot` on a cluster's connection (to
    /// learn whether that node's connection is still open before a change
    /// is sent to it); `None` on any other connection.
    pub(super) async fn ping_slot(&mut self, slot: u16) -> Option<redis::RedisResult<Value>> {
        self.send_to_master_of(redis::cmd("PING"), slot).await
    }

    /// `cmd`, sent to the master of `slot` on a cluster's connection;
    /// `None` on any other connection (nothing sent).
    async fn send_to_master_of(
        &mut self,
        cmd: redis::Cmd,
        slot: u16,
    ) -> Option<redis::RedisResult<Value>> {
        use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
        let to = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
            slot,
            SlotAddr::Master,
        )));
        match self {
            Connection::Cluster { conn, .. } => Some(conn.route_command(cmd, to).await),
            Connection::ClusterPool(conn) => Some(conn.route_command(cmd, to).await),
            _ => None,
        }
    }
}

macro_rules! each {
    ($self:expr, $conn:ident => $body:expr) => {
        match $self {
            Connection::Server { conn: $conn, .. } => $body,
            Connection::Pool { conn: $conn, .. } => $body,
            #[cfg(feature = "redis-cluster")]
            Connection::Cluster { conn: $conn, .. } => $body,
            #[cfg(feature = "redis-cluster")]
            Connection::ClusterPool($conn) => $body,
        }
    };
}

/// `round_trip`, counting its answer on `answers` (a store's own
/// connection's) when it is one Redis sent (a reply, or an error of its
/// own), for [`Lost::silent`], and noting it in `heard`, the one place a
/// single server's replies are noted (see `Inner::heard`): an answer a
/// call reads before its own (a `NOSCRIPT`, after which the script is sent
/// again) tells that Redis answers, as the call's own answer does (see
/// `Patience`): a call of two round trips to a Redis slow but answering
/// is waited for.
fn counted<'a, T: Send + 'a>(
    answers: Option<&'a AtomicU64>,
    heard: Option<&'a LastAnswer>,
    round_trip: redis::RedisFuture<'a, T>,
) -> redis::RedisFuture<'a, T> {
    Box::pin(async move {
        let result = round_trip.await;
        if result.as_ref().map_or_else(super::came_back, |_| true) {
            if let Some(answers) = answers {
                answers.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(heard) = heard {
                heard.heard();
            }
        }
        result
    })
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Connection::Server {
                conn,
                answers,
                heard,
                ..
            } => counted(
                Some(answers),
                heard.as_deref(),
                conn.req_packed_command(cmd),
            ),
            Connection::Pool { conn, heard, .. } => {
                counted(None, Some(heard), conn.req_packed_command(cmd))
            }
            #[cfg(feature = "redis-cluster")]
            other => each!(other, conn => conn.req_packed_command(cmd)),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Server {
                conn,
                answers,
                heard,
                ..
            } => counted(
                Some(answers),
                heard.as_deref(),
                conn.req_packed_commands(cmd, offset, count),
            ),
            Connection::Pool { conn, heard, .. } => counted(
                None,
                Some(heard),
                conn.req_packed_commands(cmd, offset, count),
            ),
            #[cfg(feature = "redis-cluster")]
            other => each!(other, conn => conn.req_packed_commands(cmd, offset, count)),
        }
    }

    fn get_db(&self) -> i64 {
        each!(self, conn => conn.get_db())
    }
}

/// Whether a cluster connection opened through `seed` is [complete](Connect::complete)
/// within `within`: what a replacement must be to take a failed one's place.
#[cfg(all(feature = "testing", feature = "redis-cluster"))]
pub(crate) async fn cluster_is_complete(seed: String, within: Duration) -> bool {
    let Ok(client) = redis::cluster::ClusterClientBuilder::new(vec![seed.clone()])
        .retries(0)
        .connection_timeout(within)
        .build()
    else {
        return false;
    };
    let Ok(seed) = redis::IntoConnectionInfo::into_connection_info(seed.as_str()) else {
        return false;
    };
    let outside = Arc::new(Outside::new(seed, redis::AsyncConnectionConfig::new()));
    let connector = ClusterConnector { client, outside };
    let checked = async {
        let mut conn = connector.connect().await.ok()?;
        Some(ClusterConnector::complete(&mut conn).await)
    };
    matches!(tokio::time::timeout(within, checked).await, Ok(Some(true)))
}

#[cfg(all(test, feature = "redis-cluster"))]
mod tests {
    use super::*;

    #[test]
    fn the_masters_are_read_from_cluster_slots() {
        // Three ranges, two of them on one master, one with a replica; as
        // Redis 7 writes it (each node with its metadata, here empty).
        let reply = b"*3\r\n\
            *4\r\n:0\r\n:5460\r\n*4\r\n$9\r\n127.0.0.1\r\n:7000\r\n$2\r\nm1\r\n*0\r\n\
            *4\r\n$9\r\n127.0.0.1\r\n:7004\r\n$2\r\nr1\r\n*0\r\n\
            *3\r\n:5461\r\n:10922\r\n*4\r\n$9\r\n127.0.0.1\r\n:7001\r\n$2\r\nm2\r\n*0\r\n\
            *3\r\n:10923\r\n:16383\r\n*4\r\n$9\r\n127.0.0.1\r\n:7000\r\n$2\r\nm1\r\n*0\r\n";
        let slots = redis::parse_redis_value(reply).unwrap();
        assert_eq!(
            masters(&slots),
            [
                ("127.0.0.1".to_owned(), 7000),
                ("127.0.0.1".to_owned(), 7001)
            ]
        );
        // Nothing a cluster would answer: no master, so no connection is
        // taken for complete.
        assert!(masters(&Value::Nil).is_empty());
        assert!(
            masters(&redis::parse_redis_value(b"*1\r\n*2\r\n:0\r\n:1\r\n").unwrap()).is_empty()
        );
    }
}
