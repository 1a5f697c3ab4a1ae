//! Per-subject quotas for tower and axum: "1 000 calls per day per
//! customer", enforced exactly and explained to the client.
//!
//! Add one layer to an axum app:
//!
//! ```
//! use axum::{routing::get, Router};
//! use tower_quota::{FromHeader, QuotaLayer};
//!
//! let app: Router = Router::new()
//!     .route("/", get(|| async { "hello" }))
//!     .layer(QuotaLayer::daily(1_000, FromHeader::account("x-account-id")));
//! ```
//!
//! Each request is charged to a [`Subject`] (an account, user, device or a
//! kind of your own) on every [`Quota`] of the layer, all or nothing. A quota
//! is an allowance tag (`read`, `write`, ...), a limit, a [`Period`] and an
//! [`Anchor`]:
//!
//! - **calendar**: periods are named windows of a shared clock (the day
//!   2026-12-02 in UTC, the month 2026-12 in Europe/Berlin). The window's
//!   stamp is part of the counter's key, and every subject's allowance
//!   returns at the same boundary.
//! - **first use**: the period starts at the subject's first call, and the
//!   counter's deadline, fixed when the counter is created, is the reset.
//!   Later calls never move it.
//!
//! Responses carry the IETF `RateLimit-Policy` and `RateLimit` fields; a
//! refused request gets `429 Too Many Requests`, `Retry-After` and an
//! `application/problem+json` body naming the quotas it exceeded.
//!
//! Counters live in a [`Store`]: [`MemoryStore`] in the process by default.
//!
//! An application with several quotas (a daily one on every route, a burst
//! limit on some, reads apart from writes) makes one [`QuotaPolicy`]: it owns
//! every setting (store, clock, namespace, subject extractor, plans, time
//! zones) and hands out the layers, which carry only quotas and costs. A
//! request passing several layers of one policy is charged once on each
//! quota, and a layer that refuses gives back what the others charged.
//! [`QuotaHandle`] is the policy's support handle: usage, resets and
//! refunds per subject.
//!
//! # Features
//!
//! - `axum` (default): the [`QuotaStatus`] extractor for handlers, the
//!   `unrouted` handlers (405 and 404 answers no quota charges),
//!   `QuotaHandle::router` (the support handle over HTTP), and [`ClientIp`]
//!   reading axum's `ConnectInfo`.
//! - `redis`: `store::RedisStore`, counters in Redis shared by every
//!   instance.
//! - `redis-cluster`: the Redis store on a Redis Cluster.
//! - `metrics`: the layer's decisions, charge times and refunds through the
//!   `metrics` facade; the `metrics` module lists the names and labels.
//! - `testing`: the `testing` module, the conformance suite every store must
//!   pass.
//!
//! # gRPC
//!
//! A tonic server takes the layer like any tower layer
//! (`Server::builder().layer(..)`), on every call of every service; to
//! charge one service or method only, `skip_if` on `parts.uri.path()`,
//! which is `/package.Service/Method` (`examples/grpc.rs`).
//!
//! - A refusal is a `RESOURCE_EXHAUSTED` status whose message is the
//!   problem's detail, with `ratelimit-policy` and `ratelimit` metadata,
//!   and `retry-after` when waiting helps (not for a call that costs more
//!   than a whole period allows); a missing or malformed subject is
//!   `UNAUTHENTICATED` or `INVALID_ARGUMENT`, a refused plan
//!   `PERMISSION_DENIED`, a store failure `UNAVAILABLE`. A customer at its
//!   limit is refused before the server looks the method up:
//!   `RESOURCE_EXHAUSTED` for a method it does not have too.
//! - Under `refund_server_errors`, `UNKNOWN`, `INTERNAL`, `UNAVAILABLE` and
//!   `DATA_LOSS` in the response head are given back; a status in trailers
//!   is not read (a stream's error, even as its first item: tonic sends
//!   the head before it polls the stream). A deferred cost is read from the
//!   head, so a stream's cost known only at its end cannot be charged that
//!   way: give it a fixed or priced cost.
//! - A call dropped before its head, such as one tonic's server ends at the
//!   client's `grpc-timeout` outside the layer, is not charged. A call to a
//!   method the server does not have (`UNIMPLEMENTED`, gRPC's 404) is never
//!   charged; nor is a handler's own `UNIMPLEMENTED`, which the layer
//!   cannot tell from it: answer another code (`FAILED_PRECONDITION`, say)
//!   for a call that ran and should count.
//! - A subject read from a `-bin` key is its base64 text as sent.
//! - [`ClientIp`] reads the peer's `SocketAddr` from the request's
//!   extensions, and tonic's server puts a `TcpConnectInfo` there instead:
//!   without a layer that copies its address in, outside the quota layer,
//!   every call is `INTERNAL` (the server cannot tell who it is from).
//!
//! ```
//! /// `Server::builder().layer(MapRequestLayer::new(peer_from_tonic)).layer(policy.layer(..))`
//! fn peer_from_tonic<B>(mut request: http::Request<B>) -> http::Request<B> {
//!     let peer = request
//!         .extensions()
//!         .get::<tonic::transport::server::TcpConnectInfo>()
//!         .and_then(|info| info.remote_addr());
//!     if let Some(peer) = peer {
//!         request.extensions_mut().insert(peer);
//!     }
//!     request
//! }
//! ```

#![deny(unsafe_code)]
#![warn(
    missing_docs,
    unreachable_pub,
    rust_2018_idioms,
    missing_debug_implementations
)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod body;
mod handle;
pub mod key;
mod ledger;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
// Without the feature: the same calls, doing nothing.
#[cfg(not(feature = "metrics"))]
#[allow(dead_code, unreachable_pub, unused_imports)]
mod metrics;
mod middleware;
pub mod period;
mod policy;
mod quota;
pub mod response;
mod status;
pub mod store;
pub mod subject;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
mod text;
mod throttle;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub mod unrouted;

pub use ipnet;
pub use jiff;

pub use crate::body::ResponseBody;
pub use crate::handle::{QuotaHandle, StandingError};
pub use crate::key::{Namespace, PeriodKey};
pub use crate::ledger::Owed;
pub use crate::middleware::{QuotaLayer, QuotaService, ResponseFuture};
pub use crate::period::{Anchor, Clock, ManualClock, Period, SystemClock, Window};
pub use crate::policy::{
    zone_from_header, CallerInfo, InvalidRequest, OnStoreError, QuotaPolicy, QuotaPolicyBuilder,
    SubjectPolicy, UnknownPlan,
};
pub use crate::quota::{Quota, DEFAULT_ALLOWANCE};
#[cfg(feature = "axum")]
pub use crate::status::MissingQuotaStatus;
pub use crate::status::{QuotaStatus, QuotaUsage};
pub use crate::store::{LeasedStore, MemoryStore, Store, StoreError, Usage};
pub use crate::subject::{
    ClientIp, FromExtension, FromHeader, IntoSubjectId, MapExtension, Or, ProxyHeader, Subject,
    SubjectError, SubjectExtractor, SubjectKind,
};

/// The README's examples, compiled and run as doctests (they use axum, and
/// one the Redis store).
#[cfg(all(doctest, feature = "axum", feature = "redis"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
