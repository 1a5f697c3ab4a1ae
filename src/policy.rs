//! One quota policy per application: the store, clock, namespace, subject
//! extractor and plans, owned once, and the layers handed out from them.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;

use crate::config::{OnStoreError, PolicyParts, RefusalHook, Shared, SubjectPolicy, UnknownPlan};
use crate::handle::QuotaHandle;
use crate::key::Namespace;
use crate::layer::QuotaLayer;
use crate::period::Clock;
use crate::quota::Quota;
use crate::store::{MemoryStore, Store};
use crate::subject::SubjectExtractor;

/// The quotas of one application: one store, one clock, one namespace, one
/// way to name the subject and its plan, and every layer of the app handed
/// out from it.
///
/// Whatever layers of one policy a request passes (a router-wide one and a
/// route-scoped one inside it, say), it is charged once, on every quota of
/// every layer it passes, all or nothing: a request refused by the burst
/// quota of `/search` spends nothing of the daily quota either, and on Redis
/// the whole charge is one round trip. The handler sees one
/// [`QuotaStatus`](crate::QuotaStatus) listing every quota that applied.
///
/// Two different quotas of one policy that would count on the same counter
/// (same allowance, period and anchor) are refused when the layers are
/// built; the same quota handed to two layers shares one budget.
///
/// ```
/// use axum::{body::Body, routing::get, Router};
/// use http::{Request, StatusCode};
/// use tower::ServiceExt;
/// use tower_quota::{FromHeader, Quota, QuotaPolicy};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
///
/// let app = Router::new()
///     .route("/search", get(|| async { "found" }))
///     .route_layer(policy.layer(Quota::per_minute(1).allowance("search")))
///     .route("/read", get(|| async { "read" }))
///     .route_layer(policy.layer(Quota::daily(1_000).allowance("read")));
///
/// let call = |path: &str| Request::get(path).header("x-account-id", "acme").body(Body::empty()).unwrap();
/// assert_eq!(app.clone().oneshot(call("/search")).await.unwrap().status(), StatusCode::OK);
/// // Refused by the per-minute quota: nothing spent on the daily one.
/// assert_eq!(app.clone().oneshot(call("/search")).await.unwrap().status(), StatusCode::TOO_MANY_REQUESTS);
///
/// let acme = tower_quota::Subject::account("acme");
/// let usage = policy.handle().usage(&acme).await.unwrap();
/// let read = usage.iter().find(|u| u.quota.name() == "read-day").unwrap();
/// assert_eq!(read.usage.used, 1);
/// # }
/// ```
pub struct QuotaPolicy<E, St = MemoryStore> {
    pub(crate) shared: Arc<Shared<E, St>>,
}

impl<E, St> QuotaPolicy<E, St> {
    /// A layer charging `quota` (more with [`QuotaLayer::quota`]), on this
    /// policy's store, clock and subjects. Apply it router-wide or to some
    /// routes only: a request passing several layers of one policy is
    /// charged once, on all of them.
    pub fn layer(&self, quota: Quota) -> QuotaLayer<E, St> {
        QuotaLayer::of_policy(Arc::clone(&self.shared)).quota(quota)
    }

    /// A layer with no quota of its own yet: add them with
    /// [`QuotaLayer::quota`].
    pub fn empty_layer(&self) -> QuotaLayer<E, St> {
        QuotaLayer::of_policy(Arc::clone(&self.shared))
    }

    /// The store.
    pub fn store(&self) -> &St {
        &self.shared.store
    }

    /// The namespace of every key.
    pub fn namespace(&self) -> &Namespace {
        &self.shared.settings.namespace
    }
}

impl<E, St: Store> QuotaPolicy<E, St> {
    /// A handle for support tools and handlers on every quota of the
    /// policy's layers: where a subject stands, resets and refunds.
    pub fn handle(&self) -> QuotaHandle<St>
    where
        E: SubjectExtractor,
    {
        QuotaHandle::of_policy(Arc::clone(&self.shared))
    }
}

impl<E> QuotaPolicy<E, MemoryStore> {
    /// A policy naming subjects with `extractor`; configure it, then
    /// [`QuotaPolicyBuilder::build`].
    pub fn builder(extractor: E) -> QuotaPolicyBuilder<E, MemoryStore> {
        QuotaPolicyBuilder::new(extractor)
    }
}

impl<E, St> Clone for QuotaPolicy<E, St> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<E, St: fmt::Debug> fmt::Debug for QuotaPolicy<E, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaPolicy")
            .field("settings", &self.shared.settings)
            .field("store", &self.shared.store)
            .field("quotas", &self.shared.quotas())
            .finish_non_exhaustive()
    }
}

/// Configures a [`QuotaPolicy`]. Every setting applies to every layer of the
/// policy, whatever the order of the calls.
#[must_use]
pub struct QuotaPolicyBuilder<E, St = MemoryStore>(PolicyParts<E, St>);

impl<E> QuotaPolicyBuilder<E, MemoryStore> {
    fn new(extractor: E) -> Self {
        Self(PolicyParts::new(extractor))
    }
}

impl<E, St> QuotaPolicyBuilder<E, St> {
    /// Keeps counters in `store` (default: a fresh [`MemoryStore`]).
    pub fn store<St2: Store>(self, store: St2) -> QuotaPolicyBuilder<E, St2> {
        QuotaPolicyBuilder(self.0.with_store(store))
    }

    /// Takes "now" from `clock` instead of the system clock.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.0.settings.clock = Arc::new(clock);
        self
    }

    /// Starts every key with `prefix` (default `quota`).
    ///
    /// # Panics
    ///
    /// When `prefix` contains `{` or `}`.
    pub fn namespace(mut self, prefix: &str) -> Self {
        self.0.settings.namespace = Namespace::new(prefix);
        self
    }

    /// What to do when the request names no subject. Default: 401.
    pub fn on_missing_subject(mut self, policy: SubjectPolicy) -> Self {
        self.0.settings.on_missing = policy;
        self
    }

    /// What to do when the request's subject is malformed. Default: 400.
    pub fn on_malformed_subject(mut self, policy: SubjectPolicy) -> Self {
        self.0.settings.on_malformed = policy;
        self
    }

    /// The longest subject id accepted, in bytes (default 256). Longer ids are
    /// malformed.
    pub fn max_subject_len(mut self, bytes: usize) -> Self {
        self.0.settings.max_subject_len = bytes;
        self
    }

    /// What to do when the store fails. Default: fail closed, 503 with
    /// `Retry-After: 1`.
    pub fn on_store_error(mut self, policy: OnStoreError) -> Self {
        self.0.settings.on_store_error = policy;
        self
    }

    /// How long to wait for the store before treating it as failed (default
    /// 100 ms; `None` waits forever). The wait applies only to stores that do
    /// not answer at once (never to [`MemoryStore`]) and uses tokio's timer.
    ///
    /// # Panics
    ///
    /// A request whose store does not answer at once panics when it runs on
    /// a tokio runtime built without its timer (`enable_time`). Runtimes made
    /// by `#[tokio::main]` have it; otherwise pass `None`.
    pub fn store_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.0.settings.store_timeout = timeout;
        self
    }

    /// Lets requests for which `predicate` is true through every layer of the
    /// policy uncounted, without a subject and without rate-limit fields:
    /// health checks, `OPTIONS` preflight, internal callers. Several
    /// predicates add up: a request matching any of them is skipped.
    ///
    /// ```
    /// use http::Method;
    /// use tower_quota::{FromHeader, QuotaPolicy};
    ///
    /// let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
    ///     .skip_if(|parts| parts.method == Method::OPTIONS)
    ///     .skip_if(|parts| parts.headers.contains_key("x-internal-caller"))
    ///     .build();
    /// # let _ = policy;
    /// ```
    pub fn skip_if<F>(mut self, predicate: F) -> Self
    where
        F: Fn(&Parts) -> bool + Send + Sync + 'static,
    {
        self.0.settings.skip.push(Arc::new(predicate));
        self
    }

    /// Reads the subject's plan from each request (e.g. from a value an
    /// authentication layer inserted); quotas give plans their limits with
    /// [`Quota::plan`]. `None` means no plan: each quota's own limit. The plan
    /// is not part of any key, so a subject whose plan changes keeps its
    /// count.
    ///
    /// ```
    /// use tower_quota::{FromHeader, Quota, QuotaPolicy, UnknownPlan};
    ///
    /// #[derive(Clone)]
    /// struct Plan(String); // inserted by the authentication layer
    ///
    /// let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
    ///     .plan(|parts| parts.extensions.get::<Plan>().map(|p| p.0.clone()))
    ///     .on_unknown_plan(UnknownPlan::Reject)
    ///     .build();
    /// let layer = policy.layer(Quota::daily(100).plan("pro", 10_000));
    /// # let _ = layer;
    /// ```
    pub fn plan<F>(mut self, plan: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.0.settings.plan = Some(Arc::new(plan));
        self
    }

    /// Declares the plans there are, so that a plan no quota names a limit
    /// for (the quota's own limit applies) is not taken for an unknown one
    /// before every layer has been built. Plans that quotas name with
    /// [`Quota::plan`] are known anyway.
    pub fn plans<I, P>(mut self, plans: I) -> Self
    where
        I: IntoIterator<Item = P>,
        P: Into<String>,
    {
        self.0
            .settings
            .plans
            .extend(plans.into_iter().map(|p| Arc::from(p.into())));
        self
    }

    /// What to do with a plan no quota of the policy names. Default: each
    /// quota's own limit.
    pub fn on_unknown_plan(mut self, choice: UnknownPlan) -> Self {
        self.0.settings.unknown_plan = choice;
        self
    }

    /// Gives the charge back when the response is a server error (5xx) or
    /// the inner service fails: the client is not billed for the server's
    /// failures. Off by default. The refund goes to the counters that were
    /// charged, even when a calendar boundary passed meanwhile.
    pub fn refund_server_errors(mut self, refund: bool) -> Self {
        self.0.settings.refund_server_errors = refund;
        self
    }

    /// Builds the answer to a refused request (a quota without room, or the
    /// store failing under fail-closed) from what the layer knows: see
    /// [`Refusal`](crate::response::Refusal), whose
    /// [`standard`](crate::response::Refusal::standard) answer is the
    /// default (`application/problem+json`, or a gRPC status for a gRPC
    /// call).
    pub fn refusal<F>(mut self, answer: F) -> Self
    where
        F: Fn(&crate::response::Refusal) -> http::Response<bytes::Bytes> + Send + Sync + 'static,
    {
        self.0.settings.refusal = Some(RefusalHook(Arc::new(answer)));
        self
    }

    /// The policy.
    pub fn build(self) -> QuotaPolicy<E, St> {
        QuotaPolicy {
            shared: Arc::new(self.0.into_shared()),
        }
    }
}

impl<E, St: fmt::Debug> fmt::Debug for QuotaPolicyBuilder<E, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaPolicyBuilder")
            .field("settings", &self.0.settings)
            .field("store", &self.0.store)
            .finish_non_exhaustive()
    }
}

impl<E, St: Clone> Clone for QuotaPolicyBuilder<E, St> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}
