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

/// Whether `error` is Redis's answer that it cannot run a call for now (out
/// of memory under `noeviction`, loading, busy with a script, a slot on
/// the move, a cluster down or a slot no node serves): a reply (it came
/// back) that applied nothing.
pub(super) fn for_now(error: &RedisError) -> bool {
    matches!(
        error.code(),
        Some(
            "OOM"
                | "LOADING"
                | "BUSY"
                | "MASTERDOWN"
                | "MISCONF"
                | "NOREPLICAS"
                | "TRYAGAIN"
                | "CLUSTERDOWN"
        )
    )
}

/// Whether `error` is a reply that applied nothing and may not be the
/// answer a moment later: Redis cannot run the call for now
/// ([`for_now`]), or the server is no master any more (a failover). A
/// change so refused is as one never sent: sent again, on a fresh
/// connection.
pub(super) fn applied_nothing(error: &RedisError) -> bool {
    for_now(error) || is_read_only(error) || error.to_string().contains("OOM command not allowed")
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
    broken(error) || is_read_only(error)
}

/// Whether `error` is a write refused by a server that is no master: a
/// `READONLY` reply, or, before Redis 7, a script's error that carries one.
fn is_read_only(error: &RedisError) -> bool {
    error.code() == Some("READONLY") || error.to_string().contains("READONLY You can't write")
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
        || applied_nothing(&error)
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

#[cfg(test)]
mod tests {
    use deadpool_redis::redis::{self, Value};

    use super::*;

    /// `reply`, an error on the wire, as the client hands it over.
    fn error_of(reply: &[u8]) -> RedisError {
        match redis::parse_redis_value(reply).expect("a reply") {
            Value::ServerError(error) => error.into(),
            other => panic!("not an error: {other:?}"),
        }
    }

    /// A write refused by a replica retires the connection, as Redis 7
    /// answers it and as a script's error carried it before.
    #[test]
    fn a_replica_refusing_a_write_retires_the_connection() {
        for reply in [
            &b"-READONLY You can't write against a read only replica.\r\n"[..],
            b"-ERR Error running script (call to f_0123): @user_script:12: -READONLY You can't \
              write against a read only replica.\r\n",
        ] {
            let error = error_of(reply);
            assert!(retires(&error), "{error}");
            assert!(came_back(&error), "nothing was written: {error}");
            assert_eq!(redis_error(error).kind(), StoreErrorKind::Unavailable);
        }
        let refused = error_of(b"-ERR tower-quota: an amount is not a number\r\n");
        assert!(!retires(&refused));
    }

    /// Redis's answers that it cannot run a call for now applied nothing:
    /// a give-back answered so is worth sending again; a script's own
    /// error is not.
    #[test]
    fn answers_for_now_are_told_apart() {
        for reply in [
            &b"-OOM command not allowed when used memory > 'maxmemory'.\r\n"[..],
            b"-BUSY Redis is busy running a script.\r\n",
            b"-LOADING Redis is loading the dataset in memory\r\n",
            b"-CLUSTERDOWN The cluster is down\r\n",
            b"-CLUSTERDOWN Hash slot not served\r\n",
        ] {
            let error = error_of(reply);
            assert!(for_now(&error) && came_back(&error), "{error}");
            assert!(applied_nothing(&error), "{error}");
        }
        let refused = error_of(b"-ERR tower-quota: an amount is not a number\r\n");
        assert!(!for_now(&refused));
    }
}
