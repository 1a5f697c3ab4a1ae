//! Redis's failures as store errors.

use deadpool::managed::PoolError;
use deadpool_redis::redis::{ErrorKind, RedisError};

use super::connection::Fault;
use crate::store::{StoreError, StoreErrorKind};

/// Whether `error` is an answer Redis sent (a refusal, a script's error),
/// rather than a connection that failed or a wait that ran out.
pub(super) fn came_back(error: &RedisError) -> bool {
    !broken(error) && !error.is_timeout()
}

/// Whether `error` leaves its connection unusable.
pub(super) fn broken(error: &RedisError) -> bool {
    !error.is_timeout() && (error.is_unrecoverable_error() || error.is_io_error())
}

/// Whether the store opens a new connection after `error`: its connection
/// is broken, or it reaches a server that is no master any more (a
/// failover moved the address the store was given to another server, and
/// the old master, now a replica, refuses every write with `READONLY`
/// while it answers pings). A refusal writes nothing: it still came back.
pub(super) fn retires(error: &RedisError) -> bool {
    broken(error) || error.code() == Some("READONLY")
}

pub(super) fn fault_error(fault: Fault) -> StoreError {
    match fault {
        Fault::Redis(error) => redis_error(error),
        Fault::Pool(error) => pool_error(error),
    }
}

pub(super) fn pool_error(error: PoolError<RedisError>) -> StoreError {
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

pub(super) fn redis_error(error: RedisError) -> StoreError {
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
    if came_back(&error) {
        // An answer from Redis (a script's error) may name the request's
        // keys, and a key names its subject: hidden, as in every log.
        let shown = crate::key::scrubbed(&error.to_string());
        return StoreError::new(kind, format!("Redis failed: {shown}"));
    }
    StoreError::new(kind, "Redis failed").with_source(error)
}
