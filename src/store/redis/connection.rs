//! Pooled connections to a server or a cluster.
//!
//! The store's own pools differ from deadpool-redis's stock managers in two
//! ways, both for charges:
//!
//! - A connection used within the last second is handed out again without
//!   a `PING`: the stock managers ping on every checkout, a second round
//!   trip per charge. A connection that fails is discarded instead of going
//!   back to the pool, together with the idle ones, and a connection idle
//!   for longer is still pinged, so a restarted server is noticed.
//! - The cluster client never retries a request by itself (redis-rs retries
//!   up to 16 times by default, after connection errors too, which could
//!   apply a charge twice). A redirect after a resharding fails that one
//!   request and refreshes the slot map for the next.
//!
//! Pools built elsewhere (`deadpool_redis::Pool`, and its cluster kind) are
//! used as they are.

use std::time::Duration;

use deadpool::managed::{self, Metrics, Object, PoolError, RecycleError, RecycleResult, Timeouts};
use deadpool_redis::redis::aio::{ConnectionLike, MultiplexedConnection};
use deadpool_redis::redis::{self, RedisError, Value};

/// Connections used within this long are handed out without a `PING`.
const FRESH: Duration = Duration::from_secs(1);

pub(super) struct ServerManager {
    pub(super) client: redis::Client,
    pub(super) config: redis::AsyncConnectionConfig,
}

impl managed::Manager for ServerManager {
    type Type = MultiplexedConnection;
    type Error = RedisError;

    async fn create(&self) -> Result<MultiplexedConnection, RedisError> {
        self.client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await
    }

    async fn recycle(
        &self,
        conn: &mut MultiplexedConnection,
        metrics: &Metrics,
    ) -> RecycleResult<RedisError> {
        if metrics.last_used() < FRESH {
            return Ok(());
        }
        ping(conn).await
    }
}

#[cfg(feature = "redis-cluster")]
pub(super) struct ClusterManager {
    pub(super) client: redis::cluster::ClusterClient,
}

#[cfg(feature = "redis-cluster")]
impl managed::Manager for ClusterManager {
    type Type = redis::cluster_async::ClusterConnection;
    type Error = RedisError;

    async fn create(&self) -> Result<Self::Type, RedisError> {
        self.client.get_async_connection().await
    }

    async fn recycle(&self, conn: &mut Self::Type, metrics: &Metrics) -> RecycleResult<RedisError> {
        if metrics.last_used() < FRESH {
            return Ok(());
        }
        ping(conn).await
    }
}

async fn ping(conn: &mut impl ConnectionLike) -> RecycleResult<RedisError> {
    let pong: String = redis::cmd("PING").query_async(conn).await?;
    if pong == "PONG" {
        Ok(())
    } else {
        Err(RecycleError::message("unexpected answer to PING"))
    }
}

pub(super) enum Connections {
    Server(managed::Pool<ServerManager>),
    Pool(deadpool_redis::Pool),
    #[cfg(feature = "redis-cluster")]
    Cluster(managed::Pool<ClusterManager>),
    #[cfg(feature = "redis-cluster")]
    ClusterPool(deadpool_redis::cluster::Pool),
}

impl Connections {
    pub(super) async fn get(
        &self,
        timeouts: &Timeouts,
    ) -> Result<Connection, PoolError<RedisError>> {
        // A pool built without a runtime cannot time its own waits; the
        // store's timeout around this call bounds them instead.
        macro_rules! get {
            ($pool:expr, $variant:ident) => {
                match $pool.timeout_get(timeouts).await {
                    Err(PoolError::NoRuntimeSpecified) => {
                        $pool.get().await.map(Connection::$variant)
                    }
                    other => other.map(Connection::$variant),
                }
            };
        }
        match self {
            Connections::Server(pool) => get!(pool, Server),
            Connections::Pool(pool) => get!(pool, Pool),
            #[cfg(feature = "redis-cluster")]
            Connections::Cluster(pool) => get!(pool, Cluster),
            #[cfg(feature = "redis-cluster")]
            Connections::ClusterPool(pool) => get!(pool, ClusterPool),
        }
    }

    /// Closes every idle connection of the store's own pools. After one
    /// connection broke (a server restart, a failover), the idle ones are
    /// most likely broken too, and each would fail one request before the
    /// pool noticed. A pool the application handed over is left alone.
    pub(super) fn close_idle(&self) {
        match self {
            Connections::Server(pool) => drop(pool.retain(|_, _| false)),
            // A pool handed to the store may serve the rest of the
            // application too: it is not the store's to empty.
            Connections::Pool(_) => {}
            #[cfg(feature = "redis-cluster")]
            Connections::Cluster(pool) => drop(pool.retain(|_, _| false)),
            #[cfg(feature = "redis-cluster")]
            Connections::ClusterPool(_) => {}
        }
    }

    /// Whether the connections time out their own answers.
    pub(super) fn time_their_answers(&self) -> bool {
        match self {
            Connections::Server(_) => true,
            #[cfg(feature = "redis-cluster")]
            Connections::Cluster(_) => true,
            _ => false,
        }
    }

    /// Whether this is a cluster, and the pool's status.
    pub(super) fn status(&self) -> (bool, deadpool::Status) {
        match self {
            Connections::Server(pool) => (false, pool.status()),
            Connections::Pool(pool) => (false, pool.status()),
            #[cfg(feature = "redis-cluster")]
            Connections::Cluster(pool) => (true, pool.status()),
            #[cfg(feature = "redis-cluster")]
            Connections::ClusterPool(pool) => (true, pool.status()),
        }
    }
}

pub(super) enum Connection {
    Server(Object<ServerManager>),
    Pool(deadpool_redis::Connection),
    #[cfg(feature = "redis-cluster")]
    Cluster(Object<ClusterManager>),
    #[cfg(feature = "redis-cluster")]
    ClusterPool(deadpool_redis::cluster::Connection),
}

impl Connection {
    /// Closes a connection that failed, instead of returning it to the pool.
    pub(super) fn discard(self) {
        match self {
            Connection::Server(conn) => drop(Object::take(conn)),
            Connection::Pool(conn) => drop(deadpool_redis::Connection::take(conn)),
            #[cfg(feature = "redis-cluster")]
            Connection::Cluster(conn) => drop(Object::take(conn)),
            #[cfg(feature = "redis-cluster")]
            Connection::ClusterPool(conn) => drop(deadpool_redis::cluster::Connection::take(conn)),
        }
    }
}

macro_rules! each {
    ($self:expr, $conn:ident => $body:expr) => {
        match $self {
            Connection::Server($conn) => $body,
            Connection::Pool($conn) => $body,
            #[cfg(feature = "redis-cluster")]
            Connection::Cluster($conn) => $body,
            #[cfg(feature = "redis-cluster")]
            Connection::ClusterPool($conn) => $body,
        }
    };
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        each!(self, conn => conn.req_packed_command(cmd))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        each!(self, conn => conn.req_packed_commands(cmd, offset, count))
    }

    fn get_db(&self) -> i64 {
        each!(self, conn => conn.get_db())
    }
}
