use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use http::request::Parts;
use jiff::tz::TimeZone;
use tower_layer::Layer;

use crate::config::{
    Cost, DeferredCost, InvalidCost, OnStoreError, PolicyParts, Scope, Settings, Shared,
    SubjectPolicy, UnknownPlan,
};
use crate::handle::QuotaHandle;
use crate::key::Namespace;
use crate::period::Clock;
use crate::probe;
use crate::quota::Quota;
use crate::service::{Bound, Charges, QuotaService};
use crate::store::{MemoryStore, Store};
use crate::subject::SubjectExtractor;

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
/// A layer made with [`QuotaLayer::new`] (or `daily`, `hourly`, ...) is a
/// policy of its own, with its own store. The layers of an application that
/// should decide together (a router-wide quota and a burst quota on some
/// routes) come from one [`QuotaPolicy`](crate::QuotaPolicy).
///
/// Builder methods mean the same whatever order they are called in:
/// [`QuotaLayer::allowance`] and [`QuotaLayer::time_zone`] are the defaults
/// of every quota of the layer that does not choose its own.
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
    policy: Source<E, St>,
    quotas: Vec<Quota>,
    allowance: Option<String>,
    zone: Option<TimeZone>,
    cost: Option<Cost>,
    deferred: Option<(u64, DeferredCost)>,
    // Built once, on first use, for every service of the layer and its
    // clones: the scope's identity is what nested layers recognise.
    built: Arc<OnceLock<Built<E, St>>>,
}

enum Source<E, St> {
    /// A layer that is a policy of its own.
    Own(PolicyParts<E, St>),
    /// A layer of a shared policy.
    Of(Arc<Shared<E, St>>),
}

struct Built<E, St> {
    shared: Arc<Shared<E, St>>,
    scope: Arc<Scope>,
    // The charges of the services built so far, by what their probe found:
    // axum builds a route's layers again for every connection (or request),
    // and most find the same.
    charges: Mutex<Vec<Known<E, St>>>,
}

/// What a probe found inside a wrapped service, and what a service built
/// around it charges.
type Known<E, St> = (probe::Found, Arc<Bound<E, St>>);

impl<E: SubjectExtractor> QuotaLayer<E, MemoryStore> {
    /// A layer with no quota yet, charging the subjects `extractor` names,
    /// on a fresh [`MemoryStore`]. Add quotas with [`QuotaLayer::quota`].
    pub fn new(extractor: E) -> Self {
        Self::with_source(Source::Own(PolicyParts::new(extractor)))
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
    fn with_source(policy: Source<E, St>) -> Self {
        Self {
            policy,
            quotas: Vec::new(),
            allowance: None,
            zone: None,
            cost: None,
            deferred: None,
            built: Arc::default(),
        }
    }

    pub(crate) fn of_policy(shared: Arc<Shared<E, St>>) -> Self {
        Self::with_source(Source::Of(shared))
    }

    /// The layer, changed by `f`, to be built afresh.
    fn changed(mut self, f: impl FnOnce(&mut Self)) -> Self {
        f(&mut self);
        self.built = Arc::default();
        self
    }

    /// The layer with its own policy's settings changed by `f`.
    ///
    /// # Panics
    ///
    /// When the layer comes from a shared [`QuotaPolicy`](crate::QuotaPolicy).
    fn own_policy(mut self, setting: &str, f: impl FnOnce(&mut Settings)) -> Self {
        let Source::Own(parts) = &mut self.policy else {
            panic!("this layer comes from a QuotaPolicy: set {setting} on the policy's builder, for all of its layers");
        };
        f(&mut parts.settings);
        self.built = Arc::default();
        self
    }

    /// Adds a quota. A request must have room on every quota of the layer.
    #[must_use]
    pub fn quota(self, quota: Quota) -> Self {
        self.changed(|layer| layer.quotas.push(quota))
    }

    /// The allowance tag (e.g. `read`) of every quota of the layer that does
    /// not set its own with [`Quota::allowance`], whenever it was added.
    ///
    /// # Panics
    ///
    /// When `tag` is empty or holds anything but printable ASCII.
    #[must_use]
    pub fn allowance(self, tag: &str) -> Self {
        // Checked now, where the mistake is.
        let _ = Quota::daily(0).allowance(tag);
        self.changed(|layer| layer.allowance = Some(tag.to_owned()))
    }

    /// The time zone of the calendar periods of every quota of the layer that
    /// does not set its own with [`Quota::in_time_zone`].
    ///
    /// # Panics
    ///
    /// When `tz` has neither an IANA name nor a fixed offset.
    #[must_use]
    pub fn time_zone(self, tz: TimeZone) -> Self {
        let _ = Quota::daily(0).in_time_zone(tz.clone());
        self.changed(|layer| layer.zone = Some(tz))
    }

    /// Every request costs `cost` units (default 1).
    #[must_use]
    pub fn cost(self, cost: u64) -> Self {
        self.changed(|layer| layer.cost = Some(Cost::Fixed(cost)))
    }

    /// Works out each request's cost from its head, e.g. from a `?n=` query
    /// parameter. An error is answered with 400 and the error's text.
    #[must_use]
    pub fn cost_fn<F>(self, f: F) -> Self
    where
        F: Fn(&Parts) -> Result<u64, InvalidCost> + Send + Sync + 'static,
    {
        self.changed(|layer| layer.cost = Some(Cost::Computed(Arc::new(f))))
    }

    /// A cost known only from the response (tokens generated, rows
    /// returned): a request is admitted when `upfront` fits, and once the
    /// response's head is known, `real` reads the real cost from it (a
    /// header or a response extension the handler set). The difference is
    /// then charged, past the limit if need be (the request was served), or
    /// given back, never below zero. It goes to the counters the request was
    /// charged on, creating none and moving no deadline; the fields sent
    /// with the response count it.
    ///
    /// ```
    /// use tower_quota::{FromHeader, QuotaLayer};
    ///
    /// let layer = QuotaLayer::daily(100_000, FromHeader::account("x-account-id"))
    ///     .allowance("tokens")
    ///     .deferred_cost(1, |response| {
    ///         response.headers.get("x-tokens-used")
    ///             .and_then(|v| v.to_str().ok()?.parse().ok())
    ///             .unwrap_or(1)
    ///     });
    /// # let _ = layer;
    /// ```
    ///
    /// A layer's cost is either known up front ([`QuotaLayer::cost`],
    /// [`QuotaLayer::cost_fn`]) or deferred: building a layer with both
    /// panics.
    #[must_use]
    pub fn deferred_cost<F>(self, upfront: u64, real: F) -> Self
    where
        F: Fn(&http::response::Parts) -> u64 + Send + Sync + 'static,
    {
        self.changed(|layer| layer.deferred = Some((upfront, DeferredCost(Arc::new(real)))))
    }

    /// Keeps counters in `store` instead.
    ///
    /// # Panics
    ///
    /// When the layer comes from a shared [`QuotaPolicy`](crate::QuotaPolicy),
    /// which owns the store.
    pub fn store<St2: Store>(self, store: St2) -> QuotaLayer<E, St2> {
        let Source::Own(parts) = self.policy else {
            panic!("this layer comes from a QuotaPolicy: set the store on the policy's builder, for all of its layers");
        };
        QuotaLayer {
            policy: Source::Own(parts.with_store(store)),
            quotas: self.quotas,
            allowance: self.allowance,
            zone: self.zone,
            cost: self.cost,
            deferred: self.deferred,
            built: Arc::default(),
        }
    }

    /// Takes "now" from `clock` instead of the system clock.
    ///
    /// # Panics
    ///
    /// When the layer comes from a shared [`QuotaPolicy`](crate::QuotaPolicy).
    #[must_use]
    pub fn clock(self, clock: impl Clock) -> Self {
        self.own_policy("the clock", |s| s.clock = Arc::new(clock))
    }

    /// Starts every key with `prefix` (default `quota`).
    ///
    /// # Panics
    ///
    /// When `prefix` contains `{` or `}`, or the layer comes from a shared
    /// [`QuotaPolicy`](crate::QuotaPolicy).
    #[must_use]
    pub fn namespace(self, prefix: &str) -> Self {
        self.own_policy("the namespace", |s| s.namespace = Namespace::new(prefix))
    }

    /// What to do when the request names no subject. Default: 401.
    ///
    /// # Panics
    ///
    /// When the layer comes from a shared [`QuotaPolicy`](crate::QuotaPolicy).
    #[must_use]
    pub fn on_missing_subject(self, policy: SubjectPolicy) -> Self {
        self.own_policy("on_missing_subject", |s| s.on_missing = policy)
    }

    /// What to do when the request's subject is malformed. Default: 400.
    ///
    /// # Panics
    ///
    /// When the layer comes from a shared [`QuotaPolicy`](crate::QuotaPolicy).
    #[must_use]
    pub fn on_malformed_subject(self, policy: SubjectPolicy) -> Self {
        self.own_policy("on_malformed_subject", |s| s.on_malformed = policy)
    }

    /// The longest subject id accepted, in bytes (default 256). Longer ids are
    /// malformed.
    ///
    /// # Panics
    ///
    /// When the layer comes from a shared [`QuotaPolicy`](crate::QuotaPolicy).
    #[must_use]
    pub fn max_subject_len(self, bytes: usize) -> Self {
        self.own_policy("max_subject_len", |s| s.max_subject_len = bytes)
    }

    /// What to do when the store fails. Default: fail closed, 503 with
    /// `Retry-After: 1`.
    ///
    /// # Panics
    ///
    /// When the layer comes from a shared [`QuotaPolicy`](crate::QuotaPolicy).
    #[must_use]
    pub fn on_store_error(self, policy: OnStoreError) -> Self {
        self.own_policy("on_store_error", |s| s.on_store_error = policy)
    }

    /// How long to wait for the store before treating it as failed (default
    /// 100 ms; `None` waits forever). See
    /// [`QuotaPolicyBuilder::store_timeout`](crate::QuotaPolicyBuilder::store_timeout).
    ///
    /// # Panics
    ///
    /// When the layer comes from a shared [`QuotaPolicy`](crate::QuotaPolicy);
    /// see also the policy builder's method.
    #[must_use]
    pub fn store_timeout(self, timeout: Option<Duration>) -> Self {
        self.own_policy("store_timeout", |s| s.store_timeout = timeout)
    }

    /// Lets requests for which `predicate` is true through uncounted. See
    /// [`QuotaPolicyBuilder::skip_if`](crate::QuotaPolicyBuilder::skip_if).
    ///
    /// # Panics
    ///
    /// When the layer comes from a shared [`QuotaPolicy`](crate::QuotaPolicy).
    #[must_use]
    pub fn skip_if<F>(self, predicate: F) -> Self
    where
        F: Fn(&Parts) -> bool + Send + Sync + 'static,
    {
        self.own_policy("skip_if", |s| s.skip.push(Arc::new(predicate)))
    }

    /// Reads the subject's plan from each request. See
    /// [`QuotaPolicyBuilder::plan`](crate::QuotaPolicyBuilder::plan).
    ///
    /// # Panics
    ///
    /// When the layer comes from a shared [`QuotaPolicy`](crate::QuotaPolicy).
    #[must_use]
    pub fn plan<F>(self, plan: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.own_policy("plan", |s| s.plan = Some(Arc::new(plan)))
    }

    /// What to do with a plan no quota names. Default: each quota's own
    /// limit.
    ///
    /// # Panics
    ///
    /// When the layer comes from a shared [`QuotaPolicy`](crate::QuotaPolicy).
    #[must_use]
    pub fn on_unknown_plan(self, choice: UnknownPlan) -> Self {
        self.own_policy("on_unknown_plan", |s| s.unknown_plan = choice)
    }

    /// Gives the charge back for server errors. See
    /// [`QuotaPolicyBuilder::refund_server_errors`](crate::QuotaPolicyBuilder::refund_server_errors).
    ///
    /// # Panics
    ///
    /// When the layer comes from a shared [`QuotaPolicy`](crate::QuotaPolicy).
    #[must_use]
    pub fn refund_server_errors(self, refund: bool) -> Self {
        self.own_policy("refund_server_errors", |s| s.refund_server_errors = refund)
    }

    /// The layer's quotas, with the layer's allowance and time zone applied.
    pub fn quotas(&self) -> Vec<Quota> {
        let allowance = self.allowance.as_deref();
        self.quotas
            .iter()
            .map(|q| q.with_defaults(allowance, self.zone.as_ref()))
            .collect()
    }
}

impl<E, St: Store> QuotaLayer<E, St> {
    /// The layer's policy and scope, built on first use.
    ///
    /// # Panics
    ///
    /// When the layer has no quota, two quotas that share a name, a quota
    /// that would count on the counter of another quota of the policy, or
    /// both an up-front and a deferred cost.
    fn built(&self) -> &Built<E, St> {
        self.built.get_or_init(|| {
            let quotas = self.quotas();
            assert!(!quotas.is_empty(), "a QuotaLayer needs at least one quota");
            for (i, a) in quotas.iter().enumerate() {
                for b in &quotas[..i] {
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
            let shared = match &self.policy {
                Source::Own(parts) => Arc::new(parts.shared()),
                Source::Of(shared) => Arc::clone(shared),
            };
            let (cost, deferred) = match (&self.cost, &self.deferred) {
                (Some(_), Some(_)) => panic!(
                    "a layer's cost is either up front (cost, cost_fn) or deferred (deferred_cost), not both"
                ),
                (Some(cost), None) => (cost.clone(), None),
                (None, Some((upfront, real))) => (Cost::Fixed(*upfront), Some(real.clone())),
                (None, None) => (Cost::Fixed(1), None),
            };
            let scope = Scope::new(quotas, cost, deferred);
            shared.register(&scope);
            Built {
                shared,
                scope: Arc::new(scope),
                charges: Mutex::default(),
            }
        })
    }

    /// A handle on the layer's counters for support tools and handlers: where
    /// a subject stands, refunds and resets, on this layer's quotas.
    ///
    /// # Panics
    ///
    /// As [`Layer::layer`].
    pub fn handle(&self) -> QuotaHandle<St>
    where
        E: SubjectExtractor,
    {
        let built = self.built();
        QuotaHandle::of_policy(Arc::clone(&built.shared)).only(Arc::clone(&built.scope.quotas))
    }
}

impl<S, E, St> Layer<S> for QuotaLayer<E, St>
where
    S: Clone,
    St: Store,
{
    type Service = QuotaService<S, E, St>;

    /// # Panics
    ///
    /// When the layer has no quota, two quotas that share a name, or quotas
    /// that would count on one counter: in one layer, in two layers of one
    /// policy, or in layers a request passes one inside the other.
    fn layer(&self, inner: S) -> Self::Service {
        let built = self.built();
        // Layers of the policy inside `inner` announce themselves when it is
        // cloned: their quotas are charged here, in the same charge.
        let found = probe::discover(built.shared.id, || drop(inner.clone()));
        let mut known = built.charges.lock().unwrap_or_else(|e| e.into_inner());
        let bound = match known.iter().find(|(f, _)| f.same_as(&found)) {
            Some((_, bound)) => Arc::clone(bound),
            None => {
                let bound = Arc::new(Bound {
                    shared: Arc::clone(&built.shared),
                    charges: Charges::new(
                        Arc::clone(&built.scope),
                        found.clone(),
                        &built.shared.settings,
                    ),
                });
                // Bounded: a layer wraps few kinds of services.
                if known.len() < 64 {
                    known.push((found, Arc::clone(&bound)));
                }
                bound
            }
        };
        drop(known);
        QuotaService::new(inner, bound)
    }
}

impl<E, St: Clone> Clone for QuotaLayer<E, St> {
    fn clone(&self) -> Self {
        Self {
            policy: match &self.policy {
                Source::Own(parts) => Source::Own(parts.clone()),
                Source::Of(shared) => Source::Of(Arc::clone(shared)),
            },
            quotas: self.quotas.clone(),
            allowance: self.allowance.clone(),
            zone: self.zone.clone(),
            cost: self.cost.clone(),
            deferred: self.deferred.clone(),
            built: Arc::clone(&self.built),
        }
    }
}

impl<E, St: fmt::Debug> fmt::Debug for QuotaLayer<E, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("QuotaLayer");
        debug.field("quotas", &self.quotas());
        match &self.policy {
            Source::Own(parts) => debug.field("policy", &parts.settings),
            Source::Of(shared) => debug.field("policy", &shared.settings),
        };
        debug.finish_non_exhaustive()
    }
}
