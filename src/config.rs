//! What a policy and its layers are configured with: the settings shared by
//! every layer of a policy, and the scope (quotas and cost) of one layer.
//! Below the layer, the service, the future and the handle, which all read
//! it.

use std::borrow::Cow;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use http::request::Parts;
use http::StatusCode;

use crate::key::Namespace;
use crate::period::{Clock, SystemClock};
use crate::quota::Quota;
use crate::store::MemoryStore;

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

/// What to do with a request whose plan no quota of the policy names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnknownPlan {
    /// Charge it against each quota's own limit, as a request without a
    /// plan.
    DefaultLimits,
    /// Answer `403 Forbidden` with a problem document naming the plan; the
    /// request is not charged.
    Reject,
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
type DeferredFn = dyn Fn(&http::response::Parts) -> u64 + Send + Sync;
pub(crate) type SkipFn = dyn Fn(&Parts) -> bool + Send + Sync;
pub(crate) type PlanFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
pub(crate) type RefusalFn =
    dyn Fn(&crate::response::Refusal) -> http::Response<bytes::Bytes> + Send + Sync;

/// A policy's clock, where a charge's layout keeps it.
#[derive(Clone)]
pub(crate) struct PolicyClock(pub(crate) Arc<dyn Clock>);

impl PolicyClock {
    pub(crate) fn now(&self) -> jiff::Timestamp {
        self.0.now()
    }
}

impl fmt::Debug for PolicyClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PolicyClock")
    }
}

/// A policy's refusal hook.
#[derive(Clone)]
pub(crate) struct RefusalHook(pub(crate) Arc<RefusalFn>);

impl fmt::Debug for RefusalHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RefusalHook")
    }
}

/// What one request costs before it is served.
#[derive(Clone)]
pub(crate) enum Cost {
    Fixed(u64),
    Computed(Arc<CostFn>),
}

impl Cost {
    #[inline]
    pub(crate) fn of(&self, parts: &Parts) -> Result<u64, InvalidCost> {
        match self {
            Cost::Fixed(n) => Ok(*n),
            Cost::Computed(f) => f(parts),
        }
    }
}

/// A cost known only once the response is: the request is admitted when
/// its up-front cost fits, then the difference to the real cost is charged
/// (or given back) after the response.
#[derive(Clone)]
pub(crate) struct DeferredCost(pub(crate) Arc<DeferredFn>);

/// The settings every layer of one policy shares.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) namespace: Namespace,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) on_missing: SubjectPolicy,
    pub(crate) on_malformed: SubjectPolicy,
    pub(crate) max_subject_len: usize,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) store_timeout: Option<Duration>,
    pub(crate) skip: Vec<Arc<SkipFn>>,
    pub(crate) plan: Option<Arc<PlanFn>>,
    /// Plans known from the start, beside those the quotas name.
    pub(crate) plans: Vec<Arc<str>>,
    pub(crate) unknown_plan: UnknownPlan,
    pub(crate) refund_server_errors: bool,
    pub(crate) refusal: Option<RefusalHook>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            namespace: Namespace::default(),
            clock: Arc::new(SystemClock),
            on_missing: SubjectPolicy::Reject(StatusCode::UNAUTHORIZED),
            on_malformed: SubjectPolicy::Reject(StatusCode::BAD_REQUEST),
            max_subject_len: 256,
            on_store_error: OnStoreError::FailClosed {
                retry_after: Duration::from_secs(1),
            },
            store_timeout: Some(Duration::from_millis(100)),
            skip: Vec::new(),
            plan: None,
            plans: Vec::new(),
            unknown_plan: UnknownPlan::DefaultLimits,
            refund_server_errors: false,
            refusal: None,
        }
    }
}

impl Settings {
    /// Whether a request passes every layer of the policy uncounted.
    #[inline]
    pub(crate) fn skips(&self, parts: &Parts) -> bool {
        self.skip.iter().any(|skip| skip(parts))
    }
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("namespace", &self.namespace)
            .field("on_missing_subject", &self.on_missing)
            .field("on_malformed_subject", &self.on_malformed)
            .field("max_subject_len", &self.max_subject_len)
            .field("on_store_error", &self.on_store_error)
            .field("store_timeout", &self.store_timeout)
            .field("skip_rules", &self.skip.len())
            .field("plans", &self.plan.is_some())
            .field("unknown_plan", &self.unknown_plan)
            .field("refund_server_errors", &self.refund_server_errors)
            .finish_non_exhaustive()
    }
}

/// What one layer adds to a request's charge: its quotas and what a request
/// costs on them.
pub(crate) struct Scope {
    /// Unique in the process: tells layers apart in a request's ticket.
    pub(crate) id: u64,
    pub(crate) quotas: Arc<[Quota]>,
    pub(crate) cost: Cost,
    pub(crate) deferred: Option<DeferredCost>,
}

impl Scope {
    pub(crate) fn new(quotas: Vec<Quota>, cost: Cost, deferred: Option<DeferredCost>) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            quotas: quotas.into(),
            cost,
            deferred,
        }
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scope")
            .field("quotas", &self.quotas)
            .field("deferred_cost", &self.deferred.is_some())
            .finish_non_exhaustive()
    }
}

/// A policy's settings, subject extractor and store, before it is shared.
pub(crate) struct PolicyParts<E, St> {
    pub(crate) settings: Settings,
    pub(crate) extractor: Arc<E>,
    pub(crate) store: St,
}

impl<E> PolicyParts<E, MemoryStore> {
    pub(crate) fn new(extractor: E) -> Self {
        Self {
            settings: Settings::default(),
            extractor: Arc::new(extractor),
            store: MemoryStore::new(),
        }
    }
}

impl<E, St> PolicyParts<E, St> {
    /// The same parts on another store.
    pub(crate) fn with_store<St2>(self, store: St2) -> PolicyParts<E, St2> {
        PolicyParts {
            settings: self.settings,
            extractor: self.extractor,
            store,
        }
    }

    /// The policy of these parts.
    pub(crate) fn into_shared(self) -> Shared<E, St> {
        Shared::new(self.settings, self.extractor, self.store)
    }

    /// A policy of these parts; each call a policy of its own.
    pub(crate) fn shared(&self) -> Shared<E, St>
    where
        St: Clone,
    {
        Shared::new(
            self.settings.clone(),
            Arc::clone(&self.extractor),
            self.store.clone(),
        )
    }
}

impl<E, St: Clone> Clone for PolicyParts<E, St> {
    fn clone(&self) -> Self {
        Self {
            settings: self.settings.clone(),
            extractor: Arc::clone(&self.extractor),
            store: self.store.clone(),
        }
    }
}

/// What a policy's layers, services and handles share.
pub(crate) struct Shared<E, St> {
    /// Unique in the process: a request's ticket names the policy it
    /// belongs to.
    pub(crate) id: u64,
    pub(crate) settings: Settings,
    pub(crate) extractor: Arc<E>,
    pub(crate) store: St,
    registry: Mutex<Vec<Quota>>,
    plans: RwLock<Arc<[Arc<str>]>>,
}

impl<E, St> Shared<E, St> {
    fn new(settings: Settings, extractor: Arc<E>, store: St) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let plans: Arc<[Arc<str>]> = settings.plans.clone().into();
        Self {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            settings,
            extractor,
            store,
            registry: Mutex::default(),
            plans: RwLock::new(plans),
        }
    }

    /// Adds a layer's quotas to the policy's.
    ///
    /// # Panics
    ///
    /// When one of them would count on the counter of a different quota of
    /// the policy.
    pub(crate) fn register(&self, scope: &Scope) {
        let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        for quota in scope.quotas.iter() {
            if let Some(known) = registry.iter().find(|k| k.shares_counters_with(quota)) {
                assert!(
                    known.same_as(quota),
                    "two different quotas of one policy would count on one counter: {known:?} and {quota:?} have the same allowance ({:?}), period and anchor; give one of them its own allowance",
                    quota.allowance_tag(),
                );
            } else {
                registry.push(quota.clone());
            }
        }
        let mut plans: Vec<Arc<str>> = self
            .plans
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .to_vec();
        for quota in scope.quotas.iter() {
            for (plan, _) in quota.plans() {
                if !plans.iter().any(|p| **p == *plan) {
                    plans.push(plan.into());
                }
            }
        }
        *self.plans.write().unwrap_or_else(|e| e.into_inner()) = plans.into();
    }

    /// Every quota of the policy's layers, in the order they were built.
    pub(crate) fn quotas(&self) -> Vec<Quota> {
        self.registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether some quota of the policy names `plan`.
    pub(crate) fn knows_plan(&self, plan: &str) -> bool {
        self.plans
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|p| **p == *plan)
    }
}

/// What one charge covers: the scopes of the layers it charges for (the
/// charging layer's own first) and one line per quota of them.
#[derive(Debug)]
pub(crate) struct Layout {
    pub(crate) scopes: Vec<Arc<Scope>>,
    /// One per line.
    pub(crate) quotas: Vec<Quota>,
    /// Per line, the index of its scope in `scopes`.
    pub(crate) line_scope: Vec<usize>,
    pub(crate) namespace: Namespace,
    /// "Now" for changes of a charge after the store's answer.
    pub(crate) clock: PolicyClock,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) store_timeout: Option<Duration>,
    pub(crate) refund_server_errors: bool,
    pub(crate) refusal: Option<RefusalHook>,
    /// Whether some quota spreads its reset, or is in shadow mode.
    pub(crate) spreads: bool,
    pub(crate) shadows: bool,
    /// Whether a charge can change once the store has answered: a refund
    /// rule, a deferred cost, inner layers the request may not reach, or an
    /// unrouted answer inside.
    pub(crate) adjustable: bool,
    pub(crate) cache: crate::response::PolicyCache,
}

impl Layout {
    /// The most layers one charge covers.
    pub(crate) const MAX_SCOPES: usize = 64;

    /// # Panics
    ///
    /// When two quotas of the scopes would count on one counter, or share a
    /// name: a request passing these layers would be charged twice on it.
    pub(crate) fn new(scopes: Vec<Arc<Scope>>, settings: &Settings, unrouted: bool) -> Self {
        assert!(
            scopes.len() <= Self::MAX_SCOPES,
            "a request passes more than {} quota layers of one policy",
            Self::MAX_SCOPES
        );
        let mut quotas = Vec::new();
        let mut line_scope = Vec::new();
        for (i, scope) in scopes.iter().enumerate() {
            for quota in scope.quotas.iter() {
                for other in &quotas {
                    assert!(
                        !quota.shares_counters_with(other),
                        "quotas {:?} and {:?} would count on one counter for the same request (same allowance, period and anchor) in nested layers; give one of them its own allowance",
                        other.name(),
                        quota.name()
                    );
                    assert!(
                        quota.name() != other.name(),
                        "two quotas applying to one request are named {:?}; name them apart with Quota::named",
                        quota.name()
                    );
                }
                quotas.push(quota.clone());
                line_scope.push(i);
            }
        }
        let cache = crate::response::PolicyCache::for_quotas(&quotas);
        let spreads = quotas.iter().any(Quota::spreads);
        let shadows = quotas.iter().any(Quota::is_shadow);
        let adjustable = settings.refund_server_errors
            || unrouted
            || scopes.len() > 1
            || scopes.iter().any(|s| s.deferred.is_some());
        Self {
            scopes,
            quotas,
            line_scope,
            namespace: settings.namespace.clone(),
            clock: PolicyClock(Arc::clone(&settings.clock)),
            on_store_error: settings.on_store_error,
            store_timeout: settings.store_timeout,
            refund_server_errors: settings.refund_server_errors,
            refusal: settings.refusal.clone(),
            spreads,
            shadows,
            adjustable,
            cache,
        }
    }
}

impl Layout {
    /// The charge of the first scope alone, with the same settings.
    pub(crate) fn alone(&self) -> Self {
        let own = Arc::clone(&self.scopes[0]);
        let quotas: Vec<Quota> = own.quotas.to_vec();
        let cache = crate::response::PolicyCache::for_quotas(&quotas);
        let spreads = quotas.iter().any(Quota::spreads);
        let shadows = quotas.iter().any(Quota::is_shadow);
        Self {
            line_scope: vec![0; quotas.len()],
            adjustable: self.adjustable,
            quotas,
            scopes: vec![own],
            namespace: self.namespace.clone(),
            clock: self.clock.clone(),
            on_store_error: self.on_store_error,
            store_timeout: self.store_timeout,
            refund_server_errors: self.refund_server_errors,
            refusal: self.refusal.clone(),
            spreads,
            shadows,
            cache,
        }
    }
}

/// What a request costs on each scope of its charge; one scope needs no
/// allocation.
#[derive(Debug)]
pub(crate) struct Costs {
    first: u64,
    rest: Vec<u64>,
}

impl Costs {
    /// One scope's cost.
    pub(crate) fn one(cost: u64) -> Self {
        Self {
            first: cost,
            rest: Vec::new(),
        }
    }

    /// No cost at all (nothing charged).
    pub(crate) fn none() -> Self {
        Self {
            first: 0,
            rest: Vec::new(),
        }
    }

    /// The costs of `scopes` for the request with head `parts`.
    #[inline]
    pub(crate) fn of(scopes: &[Arc<Scope>], parts: &Parts) -> Result<Self, InvalidCost> {
        if let [scope] = scopes {
            return Ok(Self {
                first: scope.cost.of(parts)?,
                rest: Vec::new(),
            });
        }
        let mut costs = Self {
            first: 0,
            rest: Vec::new(),
        };
        for (i, scope) in scopes.iter().enumerate() {
            let cost = scope.cost.of(parts)?;
            if i == 0 {
                costs.first = cost;
            } else {
                costs.rest.push(cost);
            }
        }
        Ok(costs)
    }

    /// The cost on scope `i`.
    #[inline]
    pub(crate) fn get(&self, i: usize) -> u64 {
        match i {
            0 => self.first,
            i => self.rest[i - 1],
        }
    }
}
