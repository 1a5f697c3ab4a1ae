use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::StatusCode;
use jiff::tz::TimeZone;
use tower_layer::Layer;

use crate::handle::QuotaHandle;
use crate::key::Namespace;
use crate::period::{Clock, SystemClock};
use crate::quota::Quota;
use crate::response::PolicyCache;
use crate::service::QuotaService;
use crate::store::{MemoryStore, Store};
use crate::subject::SubjectExtractor;

/// What to do with a request whose subject is missing or malformed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SubjectPolicy {
    /// Answer with this status and a problem document; the inner service is
    /// not called. A status that is not a 4xx or 5xx falls back to the
    /// default (401 for a missing subject, 400 for a malformed one).
    Reject(StatusCode),
    /// Let the request through without charging any quota (and without
    /// rate-limit fields). Unidentified requests never share a counter: they
    /// are simply not counted.
    Allow,
}

/// What to do when the store fails or does not answer in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnStoreError {
    /// Let the request through uncharged, and log the failure. Availability
    /// over enforcement.
    FailOpen,
    /// Answer 503 with a problem document and `Retry-After` (in seconds).
    /// Enforcement over availability.
    FailClosed {
        /// The `Retry-After` sent with the 503.
        retry_after: Duration,
    },
}

/// Why a request's cost could not be worked out; answered with 400.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidCost(pub Cow<'static, str>);

impl InvalidCost {
    /// A cost error with a reason the client may read.
    pub fn new(reason: impl Into<Cow<'static, str>>) -> Self {
        Self(reason.into())
    }
}

impl fmt::Display for InvalidCost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvalidCost {}

type CostFn = dyn Fn(&Parts) -> Result<u64, InvalidCost> + Send + Sync;

#[derive(Clone)]
pub(crate) enum Cost {
    Fixed(u64),
    Computed(Arc<CostFn>),
}

impl Cost {
    pub(crate) fn of(&self, parts: &Parts) -> Result<u64, InvalidCost> {
        match self {
            Cost::Fixed(n) => Ok(*n),
            Cost::Computed(f) => f(parts),
        }
    }
}

/// Everything a layer decides, shared by its services.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) quotas: Arc<[Quota]>,
    pub(crate) namespace: Namespace,
    pub(crate) cost: Cost,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) on_missing: SubjectPolicy,
    pub(crate) on_malformed: SubjectPolicy,
    pub(crate) max_subject_len: usize,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) store_timeout: Option<Duration>,
    pub(crate) policy_cache: Arc<PolicyCache>,
}

/// Enforces per-subject quotas on the services it wraps.
///
/// Each request is charged to the [`Subject`](crate::Subject) its extractor
/// names, on every quota of the layer at once: if one quota has no room
/// left, the request is refused with `429 Too Many Requests` and nothing is
/// spent on any quota. Every charged response, admitted or refused, carries
/// the `RateLimit-Policy` and `RateLimit` fields. Responses that charged
/// nothing carry none: a request without a usable subject (there is no
/// counter to report) and a request let through or refused because the store
/// failed (its counters are unknown).
///
/// Quota names should be unique across nested layers too: clients tell the
/// items of the fields apart by name.
///
/// # Example
///
/// ```
/// use axum::{body::Body, routing::get, Router};
/// use http::{Request, StatusCode};
/// use tower::ServiceExt;
/// use tower_quota::{FromHeader, QuotaLayer};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let app = Router::new()
///     .route("/", get(|| async { "hello" }))
///     .layer(QuotaLayer::daily(2, FromHeader::account("x-account-id")));
///
/// let call = || Request::get("/").header("x-account-id", "acme").body(Body::empty()).unwrap();
/// let first = app.clone().oneshot(call()).await.unwrap();
/// assert_eq!(first.status(), StatusCode::OK);
/// assert!(first.headers()["ratelimit"].to_str().unwrap().starts_with("\"default-day\";r=1;t="));
/// assert_eq!(app.clone().oneshot(call()).await.unwrap().status(), StatusCode::OK);
/// let third = app.clone().oneshot(call()).await.unwrap();
/// assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
/// assert_eq!(third.headers()["content-type"], "application/problem+json");
/// assert!(third.headers().contains_key("retry-after"));
/// # }
/// ```
pub struct QuotaLayer<E, St = MemoryStore> {
    quotas: Vec<Quota>,
    config: Config,
    extractor: Arc<E>,
    store: St,
}

impl<E: SubjectExtractor> QuotaLayer<E, MemoryStore> {
    /// A layer with no quota yet, charging the subjects `extractor` names,
    /// on a fresh [`MemoryStore`]. Add quotas with [`QuotaLayer::quota`].
    pub fn new(extractor: E) -> Self {
        Self {
            quotas: Vec::new(),
            config: Config {
                quotas: Arc::new([]),
                namespace: Namespace::default(),
                cost: Cost::Fixed(1),
                clock: Arc::new(SystemClock),
                on_missing: SubjectPolicy::Reject(StatusCode::UNAUTHORIZED),
                on_malformed: SubjectPolicy::Reject(StatusCode::BAD_REQUEST),
                max_subject_len: 256,
                on_store_error: OnStoreError::FailClosed {
                    retry_after: Duration::from_secs(1),
                },
                store_timeout: Some(Duration::from_millis(100)),
                policy_cache: Arc::default(),
            },
            extractor: Arc::new(extractor),
            store: MemoryStore::new(),
        }
    }

    /// `limit` requests per calendar day (UTC), per subject: the one-liner.
    ///
    /// ```
    /// use axum::{body::Body, routing::get, Router};
    /// use http::{Request, StatusCode};
    /// use tower::ServiceExt;
    /// use tower_quota::{FromHeader, QuotaLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let app = Router::new()
    ///     .route("/", get(|| async { "hello" }))
    ///     .layer(QuotaLayer::daily(1, FromHeader::account("x-account-id")));
    ///
    /// let call = |account: &str| {
    ///     Request::get("/").header("x-account-id", account).body(Body::empty()).unwrap()
    /// };
    /// let ok = app.clone().oneshot(call("acme")).await.unwrap();
    /// assert_eq!(ok.status(), StatusCode::OK);
    /// assert_eq!(ok.headers()["ratelimit-policy"], "\"default-day\";q=1;w=86400");
    /// // acme has spent its day; another account has not.
    /// let refused = app.clone().oneshot(call("acme")).await.unwrap();
    /// assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    /// assert_eq!(app.clone().oneshot(call("globex")).await.unwrap().status(), StatusCode::OK);
    /// # }
    /// ```
    pub fn daily(limit: u64, extractor: E) -> Self {
        Self::new(extractor).quota(Quota::daily(limit))
    }

    /// `limit` requests per calendar hour, per subject.
    pub fn hourly(limit: u64, extractor: E) -> Self {
        Self::new(extractor).quota(Quota::hourly(limit))
    }

    /// `limit` requests per calendar minute, per subject.
    pub fn per_minute(limit: u64, extractor: E) -> Self {
        Self::new(extractor).quota(Quota::per_minute(limit))
    }

    /// `limit` requests per ISO week, per subject.
    pub fn weekly(limit: u64, extractor: E) -> Self {
        Self::new(extractor).quota(Quota::weekly(limit))
    }

    /// `limit` requests per calendar month, per subject.
    pub fn monthly(limit: u64, extractor: E) -> Self {
        Self::new(extractor).quota(Quota::monthly(limit))
    }

    /// `limit` requests per `length` from each subject's first call.
    ///
    /// # Panics
    ///
    /// When `length` is shorter than a second or not a whole number of
    /// seconds.
    pub fn rolling(limit: u64, length: Duration, extractor: E) -> Self {
        Self::new(extractor).quota(Quota::rolling(limit, length))
    }
}

impl<E, St> QuotaLayer<E, St> {
    /// Adds a quota. A request must have room on every quota of the layer.
    #[must_use]
    pub fn quota(mut self, quota: Quota) -> Self {
        self.quotas.push(quota);
        self
    }

    /// Sets the allowance tag of every quota added so far (e.g. `read`).
    ///
    /// # Panics
    ///
    /// When `tag` is empty.
    #[must_use]
    pub fn allowance(mut self, tag: &str) -> Self {
        self.quotas = self.quotas.into_iter().map(|q| q.allowance(tag)).collect();
        self
    }

    /// Counts the calendar periods of every quota added so far in time zone
    /// `tz`.
    ///
    /// # Panics
    ///
    /// When `tz` has neither an IANA name nor a fixed offset.
    #[must_use]
    pub fn time_zone(mut self, tz: TimeZone) -> Self {
        self.quotas = self
            .quotas
            .into_iter()
            .map(|q| q.in_time_zone(tz.clone()))
            .collect();
        self
    }

    /// Every request costs `cost` units (default 1).
    #[must_use]
    pub fn cost(mut self, cost: u64) -> Self {
        self.config.cost = Cost::Fixed(cost);
        self
    }

    /// Works out each request's cost from its head, e.g. from a `?n=` query
    /// parameter. An error is answered with 400 and the error's text.
    #[must_use]
    pub fn cost_fn<F>(mut self, f: F) -> Self
    where
        F: Fn(&Parts) -> Result<u64, InvalidCost> + Send + Sync + 'static,
    {
        self.config.cost = Cost::Computed(Arc::new(f));
        self
    }

    /// Keeps counters in `store` instead.
    pub fn store<St2: Store>(self, store: St2) -> QuotaLayer<E, St2> {
        QuotaLayer {
            quotas: self.quotas,
            config: self.config,
            extractor: self.extractor,
            store,
        }
    }

    /// Takes "now" from `clock` instead of the system clock.
    #[must_use]
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.config.clock = Arc::new(clock);
        self
    }

    /// Starts every key with `prefix` (default `quota`).
    ///
    /// # Panics
    ///
    /// When `prefix` contains `{` or `}`.
    #[must_use]
    pub fn namespace(mut self, prefix: &str) -> Self {
        self.config.namespace = Namespace::new(prefix);
        self
    }

    /// What to do when the request names no subject. Default: 401.
    #[must_use]
    pub fn on_missing_subject(mut self, policy: SubjectPolicy) -> Self {
        self.config.on_missing = policy;
        self
    }

    /// What to do when the request's subject is malformed. Default: 400.
    #[must_use]
    pub fn on_malformed_subject(mut self, policy: SubjectPolicy) -> Self {
        self.config.on_malformed = policy;
        self
    }

    /// The longest subject id accepted, in bytes (default 256). Longer ids are
    /// malformed.
    #[must_use]
    pub fn max_subject_len(mut self, bytes: usize) -> Self {
        self.config.max_subject_len = bytes;
        self
    }

    /// What to do when the store fails. Default: fail closed, 503 with
    /// `Retry-After: 1`.
    #[must_use]
    pub fn on_store_error(mut self, policy: OnStoreError) -> Self {
        self.config.on_store_error = policy;
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
    #[must_use]
    pub fn store_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.config.store_timeout = timeout;
        self
    }

    /// The layer's quotas.
    pub fn quotas(&self) -> &[Quota] {
        &self.quotas
    }

    fn config(&self) -> Config {
        assert!(
            !self.quotas.is_empty(),
            "a QuotaLayer needs at least one quota"
        );
        for (i, a) in self.quotas.iter().enumerate() {
            for b in &self.quotas[..i] {
                assert!(
                    a.name() != b.name(),
                    "two quotas of one layer are named {:?}; name them apart with Quota::named",
                    a.name()
                );
                assert!(
                    !a.shares_counters_with(b),
                    "quotas {:?} and {:?} have the same allowance, period and anchor, so they would share counters",
                    a.name(),
                    b.name()
                );
            }
        }
        Config {
            quotas: self.quotas.clone().into(),
            policy_cache: Arc::default(),
            ..self.config.clone()
        }
    }
}

impl<E, St: Store> QuotaLayer<E, St> {
    /// A handle on the layer's counters for support tools and handlers: where
    /// a subject stands, refunds and resets.
    ///
    /// # Panics
    ///
    /// As [`Layer::layer`].
    pub fn handle(&self) -> QuotaHandle<St> {
        QuotaHandle::new(Arc::new(self.config()), self.store.clone())
    }
}

impl<S, E, St> Layer<S> for QuotaLayer<E, St>
where
    St: Store,
{
    type Service = QuotaService<S, E, St>;

    /// # Panics
    ///
    /// When the layer has no quota, or two quotas that share a name or would
    /// share counters (same allowance, period and anchor).
    fn layer(&self, inner: S) -> Self::Service {
        QuotaService::new(
            inner,
            Arc::new(self.config()),
            Arc::clone(&self.extractor),
            self.store.clone(),
        )
    }
}

impl<E, St: Clone> Clone for QuotaLayer<E, St> {
    fn clone(&self) -> Self {
        Self {
            quotas: self.quotas.clone(),
            config: self.config.clone(),
            extractor: Arc::clone(&self.extractor),
            store: self.store.clone(),
        }
    }
}

impl<E, St: fmt::Debug> fmt::Debug for QuotaLayer<E, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaLayer")
            .field("quotas", &self.quotas)
            .field("namespace", &self.config.namespace)
            .field("store", &self.store)
            .field("on_missing_subject", &self.config.on_missing)
            .field("on_malformed_subject", &self.config.on_malformed)
            .field("max_subject_len", &self.config.max_subject_len)
            .field("on_store_error", &self.config.on_store_error)
            .field("store_timeout", &self.config.store_timeout)
            .finish_non_exhaustive()
    }
}
