use std::borrow::Cow;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http::request::Parts;
use jiff::tz::TimeZone;
use tower_layer::Layer;

use super::service::QuotaService;
use crate::policy::{InvalidRequest, Policy, QuotaPolicy};
use crate::quota::Quota;
use crate::response::PolicyCache;
use crate::status::{LayerQuotas, OtherQuotas, QuotaSet};
use crate::store::{MemoryStore, Store};
use crate::subject::SubjectExtractor;

/// Enforces per-subject quotas on the services it wraps.
///
/// A layer carries quotas and what a request costs on them; every other
/// setting is its [`QuotaPolicy`]'s. Each request is charged to the
/// [`Subject`](crate::Subject) the policy's extractor names, on every quota
/// of the layer at once: if one quota has no room left, the request is
/// refused with `429 Too Many Requests` and nothing is spent on any quota.
/// Every charged response, admitted or refused, carries the
/// `RateLimit-Policy` and `RateLimit` fields.
///
/// A request that is not served spends nothing: a refusal further in, or a
/// request dropped before the response left the outermost quota layer (a
/// timeout around the layers, a client gone), gives the layer's charge
/// back. A timeout inside
/// the layer answers, and the request stays charged.
///
/// A layer made with [`QuotaLayer::daily`] (or `hourly`, `new`, ...) is a
/// policy of its own, on a fresh [`MemoryStore`] with the default settings.
/// To choose the store, clock or anything else, or to share a budget between
/// layers, make a [`QuotaPolicy`] and take its layers from
/// [`QuotaPolicy::layer`].
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
    pub(crate) bound: Arc<Bound<E, St>>,
}

/// A layer's policy and scope, shared by its services and their clones.
///
/// Aligned so that its fields start on a cache line of their own, after
/// the `Arc`'s reference counts: requests on every core add to the count
/// (a service clone per request in axum, a request's lines, its response),
/// and a field read beside it would wait for the core that wrote it last.
#[repr(align(128))]
pub(crate) struct Bound<E, St> {
    pub(crate) policy: Arc<Policy<E, St>>,
    pub(crate) scope: Scope,
}

impl<E: SubjectExtractor, St: Store> LayerQuotas for Bound<E, St> {
    fn quotas(&self) -> &[Quota] {
        self.scope.quotas()
    }

    fn fields(&self) -> &PolicyCache {
        self.scope.fields()
    }

    fn zoned(&self, slot: usize) -> &OtherQuotas {
        self.scope.zoned(slot)
    }
}

/// What one layer charges: its quotas, what a request costs on them, and
/// what it keeps to answer fast.
pub(crate) struct Scope {
    pub(crate) quotas: Arc<[Quota]>,
    pub(crate) cost: Cost,
    /// The last `RateLimit-Policy` values this layer sent.
    pub(crate) fields: PolicyCache,
    /// The quotas as callers in other zones count them, with the
    /// `RateLimit-Policy` values sent for them: [`MAX_ZONES`] slots, made
    /// for the first caller in another zone, each filled once, for one
    /// zone, and read without a lock.
    zones: OnceLock<Box<[OnceLock<Box<ZoneSlot>>]>>,
    /// Picks a zone's first slot: seeded per layer, so that no caller
    /// can choose zones that crowd the same slots.
    zone_hasher: foldhash::fast::RandomState,
}

/// A layer's quotas in one zone.
struct ZoneSlot {
    /// The zone (see `zone_key`).
    name: Box<str>,
    quotas: OtherQuotas,
}

/// Callers' zones a layer keeps its quotas for; beyond, they are made per
/// request. A power of two: the slot a zone looks in first is its hash's
/// low bits.
const MAX_ZONES: usize = 1_024;

/// The slots a zone looks in, from its first: a zone that finds none of
/// them its own or free has its quotas made per request.
const ZONE_PROBES: usize = 32;

impl LayerQuotas for Scope {
    fn quotas(&self) -> &[Quota] {
        &self.quotas
    }

    fn fields(&self) -> &PolicyCache {
        &self.fields
    }

    fn zoned(&self, slot: usize) -> &OtherQuotas {
        let slot = self
            .zones
            .get()
            .and_then(|zones| zones[slot].get())
            .expect("a zone's slot is filled before a charge names it");
        &slot.quotas
    }
}

impl Scope {
    fn new(quotas: Arc<[Quota]>, cost: Cost) -> Self {
        Self {
            fields: PolicyCache::for_quotas(&quotas),
            quotas,
            cost,
            zones: OnceLock::new(),
            zone_hasher: foldhash::fast::RandomState::default(),
        }
    }

    /// Whether every quota of the layer is a shadow quota: it then never
    /// refuses a request.
    pub(crate) fn only_shadow(&self) -> bool {
        self.quotas.iter().all(Quota::is_shadow)
    }

    /// The layer's quotas as a caller in `zone` counts them: its own, as
    /// they are, for none.
    pub(crate) fn quotas_in(&self, zone: Option<&TimeZone>) -> QuotaSet {
        let Some(zone) = zone else {
            return QuotaSet::Own;
        };
        let name = zone_key(zone);
        let zones = self
            .zones
            .get_or_init(|| (0..MAX_ZONES).map(|_| OnceLock::new()).collect());
        let first = self.zone_hasher.hash_one(name.as_ref()) as usize;
        // Open addressing: a zone's slot is the first, from its hash's,
        // that is its own or empty (then filled for it, unless another
        // zone fills it first).
        for probe in 0..ZONE_PROBES {
            let slot = (first + probe) & (MAX_ZONES - 1);
            let kept = zones[slot].get_or_init(|| {
                Box::new(ZoneSlot {
                    name: name.as_ref().into(),
                    quotas: OtherQuotas::cached(self.in_zone(zone)),
                })
            });
            if *kept.name == *name {
                return QuotaSet::Zoned(slot);
            }
        }
        QuotaSet::Other(Arc::new(OtherQuotas::uncached(self.in_zone(zone))))
    }

    /// The layer's quotas in `zone`: under the zone's primary name, which
    /// its aliases share, so that what callers are told (a refusal's
    /// detail, `QuotaUsage::explain_reset`) names the zone alike whichever
    /// alias reached the layer first.
    fn in_zone(&self, zone: &TimeZone) -> Box<[Quota]> {
        let zone = crate::period::under_primary_name(zone);
        self.quotas
            .iter()
            .map(|q| q.in_callers_zone(&zone))
            .collect()
    }
}

/// What tells zones apart: the primary IANA name, which aliases share
/// (borrowed: nothing to allocate for the request), or the fixed offset.
fn zone_key(zone: &TimeZone) -> Cow<'_, str> {
    match crate::period::zone_name(zone) {
        Some(name) => Cow::Borrowed(name),
        None => Cow::Owned(format!("{:?}", zone.to_fixed_offset().ok())),
    }
}

type CostFn = dyn Fn(&Parts) -> Result<u64, InvalidRequest> + Send + Sync;
type DeferredFn = dyn Fn(&http::response::Parts) -> u64 + Send + Sync;

/// What a request costs.
#[derive(Clone)]
pub(crate) enum Cost {
    Fixed(u64),
    Computed(Arc<CostFn>),
    /// Admitted when `upfront` fits; the real cost is read from the
    /// response's head, and the difference charged or given back.
    Deferred {
        upfront: u64,
        real: Arc<DeferredFn>,
    },
}

impl Cost {
    /// What the request with head `parts` is charged before it is served.
    #[inline]
    pub(crate) fn upfront(&self, parts: &Parts) -> Result<u64, InvalidRequest> {
        match self {
            Cost::Fixed(n) | Cost::Deferred { upfront: n, .. } => Ok(*n),
            Cost::Computed(f) => f(parts),
        }
    }

    /// The real cost, once the response's head is known; `None` when it was
    /// known up front.
    pub(crate) fn real(&self, response: &http::response::Parts) -> Option<u64> {
        match self {
            Cost::Deferred { real, .. } => Some(real(response)),
            _ => None,
        }
    }
}

impl<E> QuotaLayer<E, MemoryStore> {
    /// A layer charging `quota` (more with [`QuotaLayer::quota`]) to the
    /// subjects `extractor` names, as a policy of its own on a fresh
    /// [`MemoryStore`].
    ///
    /// # Panics
    ///
    /// When `quota` names a plan ([`Quota::plan`]): a policy of its own
    /// reads no plan, so every caller would get the quota's own limit. Make
    /// a [`QuotaPolicy`] that reads the plan
    /// ([`QuotaPolicyBuilder::plan`](crate::QuotaPolicyBuilder::plan)) and
    /// take the layer from it.
    pub fn new(quota: Quota, extractor: E) -> Self {
        QuotaPolicy::new(extractor).layer(quota)
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
        Self::new(Quota::daily(limit), extractor)
    }

    /// `limit` requests per calendar hour, per subject.
    pub fn hourly(limit: u64, extractor: E) -> Self {
        Self::new(Quota::hourly(limit), extractor)
    }

    /// `limit` requests per calendar minute, per subject.
    pub fn per_minute(limit: u64, extractor: E) -> Self {
        Self::new(Quota::per_minute(limit), extractor)
    }

    /// `limit` requests per ISO week, per subject.
    pub fn weekly(limit: u64, extractor: E) -> Self {
        Self::new(Quota::weekly(limit), extractor)
    }

    /// `limit` requests per calendar month, per subject.
    pub fn monthly(limit: u64, extractor: E) -> Self {
        Self::new(Quota::monthly(limit), extractor)
    }

    /// `limit` requests per `length` from each subject's first call.
    ///
    /// # Panics
    ///
    /// When `length` is shorter than a second, longer than 100 years, or
    /// not a whole number of seconds.
    pub fn rolling(limit: u64, length: Duration, extractor: E) -> Self {
        Self::new(Quota::rolling(limit, length), extractor)
    }
}

impl<E, St: Store> QuotaPolicy<E, St> {
    /// A layer charging `quota` (more with [`QuotaLayer::quota`]), on this
    /// policy's store, clock and subjects. Apply it router-wide or to some
    /// routes only: a request passing several layers of one policy is
    /// charged once on each quota, and a refusal by any of them gives back
    /// what the others charged.
    ///
    /// # Panics
    ///
    /// When `quota` would count on the counter of a different quota of the
    /// policy (or of another policy on the same store and namespace), has
    /// the name of a different quota of the policy, or has a limit (or a
    /// plan's) above what the store counts exactly
    /// ([`Store::max_count`](crate::Store::max_count)); when it names a
    /// plan ([`Quota::plan`]) and the policy reads none
    /// ([`QuotaPolicyBuilder::plan`](crate::QuotaPolicyBuilder::plan)), or
    /// one its declared plans
    /// ([`QuotaPolicyBuilder::plans`](crate::QuotaPolicyBuilder::plans))
    /// do not name; or when it is a calendar quota that another policy on
    /// the same store and namespace has too, and one of the two policies
    /// reads each caller's time zone
    /// ([`QuotaPolicyBuilder::time_zone`](crate::QuotaPolicyBuilder::time_zone))
    /// and the other does not.
    pub fn layer(&self, quota: Quota) -> QuotaLayer<E, St> {
        self.core.register(&quota);
        QuotaLayer {
            bound: Arc::new(Bound {
                policy: Arc::clone(&self.core),
                scope: Scope::new(Arc::from([quota]), Cost::Fixed(1)),
            }),
        }
    }
}

impl<E, St: Store> QuotaLayer<E, St> {
    /// The same layer with its scope changed by `f`.
    fn with_scope(self, f: impl FnOnce(&mut Vec<Quota>, &mut Cost)) -> Self {
        let mut quotas = self.bound.scope.quotas.to_vec();
        let mut cost = self.bound.scope.cost.clone();
        f(&mut quotas, &mut cost);
        Self {
            bound: Arc::new(Bound {
                policy: Arc::clone(&self.bound.policy),
                scope: Scope::new(quotas.into(), cost),
            }),
        }
    }

    /// Adds a quota. A request must have room on every quota of the layer,
    /// and is charged on all of them in one call to the store.
    ///
    /// # Panics
    ///
    /// When the layer has this quota already, or for any reason
    /// [`QuotaPolicy::layer`] panics: `quota` would count on the counter of
    /// a different quota of the policy (or of another policy on the same
    /// store and namespace), has the name of one, has a limit (or a plan's)
    /// above what the store counts exactly
    /// ([`Store::max_count`](crate::Store::max_count)), names a plan the
    /// policy does not read or declare, or shares its counters with another
    /// policy's that reads callers' zones where this one does not (or the
    /// other way round).
    #[must_use]
    pub fn quota(self, quota: Quota) -> Self {
        assert!(
            !self.bound.scope.quotas.iter().any(|q| q.same_as(&quota)),
            "the layer has quota {:?} already",
            quota.name()
        );
        self.bound.policy.register(&quota);
        self.with_scope(|quotas, _| quotas.push(quota))
    }

    /// Every request costs `cost` units (default 1).
    ///
    /// A quota that a layer further out charged for the request already is
    /// not charged again here: it counts once, at that layer's cost (and
    /// deferred cost). To price one route higher on a router-wide quota,
    /// work the cost out in the router-wide layer ([`QuotaLayer::cost_fn`],
    /// from the path), or give the route's layer a quota of its own.
    ///
    /// # Panics
    ///
    /// When `cost` is more than the policy's store counts exactly
    /// ([`Store::max_count`]).
    #[must_use]
    pub fn cost(self, cost: u64) -> Self {
        self.check_cost(cost);
        self.with_scope(|_, c| *c = Cost::Fixed(cost))
    }

    fn check_cost(&self, cost: u64) {
        let max = self.bound.policy.store.max_count();
        assert!(
            cost <= max,
            "a cost of {cost} is more than the layer's store counts exactly ({max})"
        );
    }

    /// Works out each request's cost from its head, e.g. from a `?n=` query
    /// parameter. An error is answered with 400 and the error's text. A
    /// cost of 0 is admitted while the count is at most the limit, nothing
    /// left included: refuse it (or make it 1) where such a request does
    /// work.
    #[must_use]
    pub fn cost_fn<F>(self, f: F) -> Self
    where
        F: Fn(&Parts) -> Result<u64, InvalidRequest> + Send + Sync + 'static,
    {
        self.with_scope(|_, c| *c = Cost::Computed(Arc::new(f)))
    }

    /// A cost known only from the response (tokens generated, rows
    /// returned): a request is admitted when `upfront` fits, and once the
    /// response's head is known, `real` reads the real cost from it (a
    /// header or a response extension the handler set). The difference is
    /// then charged, past the limit if need be (the request was served), or
    /// given back, never below zero. It goes to the counters the request was
    /// charged on, creating none and moving no deadline; the fields sent
    /// with the response count it. A response answered once its request's
    /// period is over (a calendar window that ended, a rolling period past
    /// its deadline) changes nothing: the ended period's counter takes no
    /// more, and the next period is not charged for it. Replaces
    /// [`QuotaLayer::cost`] and [`QuotaLayer::cost_fn`]: the last of the
    /// three called is the cost.
    ///
    /// ```
    /// use tower_quota::{FromHeader, QuotaLayer};
    ///
    /// let layer = QuotaLayer::daily(100_000, FromHeader::account("x-account-id"))
    ///     .deferred_cost(1, |response| {
    ///         response.headers.get("x-tokens-used")
    ///             .and_then(|v| v.to_str().ok()?.parse().ok())
    ///             .unwrap_or(1)
    ///     });
    /// # let _ = layer;
    /// ```
    ///
    /// # Panics
    ///
    /// When `upfront` is 0 (a request charged nothing up front has no
    /// counter for its real cost to go to: the quota would never count),
    /// or more than the policy's store counts exactly
    /// ([`Store::max_count`]).
    #[must_use]
    pub fn deferred_cost<F>(self, upfront: u64, real: F) -> Self
    where
        F: Fn(&http::response::Parts) -> u64 + Send + Sync + 'static,
    {
        assert!(
            upfront > 0,
            "a deferred cost of 0 up front would never count: the real cost goes only to the \
             counters the request was charged on (charge at least 1 up front)"
        );
        self.check_cost(upfront);
        self.with_scope(|_, c| {
            *c = Cost::Deferred {
                upfront,
                real: Arc::new(real),
            }
        })
    }

    /// The layer's quotas.
    pub fn quotas(&self) -> &[Quota] {
        &self.bound.scope.quotas
    }
}

impl<S, E, St> Layer<S> for QuotaLayer<E, St>
where
    E: SubjectExtractor,
    St: Store,
{
    type Service = QuotaService<S, E, St>;

    fn layer(&self, inner: S) -> Self::Service {
        QuotaService::new(inner, Arc::clone(&self.bound))
    }
}

impl<E, St> Clone for QuotaLayer<E, St> {
    fn clone(&self) -> Self {
        Self {
            bound: Arc::clone(&self.bound),
        }
    }
}

impl<E, St: fmt::Debug> fmt::Debug for QuotaLayer<E, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaLayer")
            .field("quotas", &self.bound.scope.quotas)
            .field("policy", &self.bound.policy.settings)
            .field("store", &self.bound.policy.store)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use jiff::tz::{Offset, TimeZone};
    use jiff::Timestamp;

    use super::*;

    fn scope() -> Scope {
        Scope::new(Arc::from([Quota::daily(10)]), Cost::Fixed(1))
    }

    /// The start of the day a caller in `zone` is in at `at`, as `set`
    /// counts it.
    fn day_start(scope: &Scope, set: &QuotaSet, at: Timestamp) -> String {
        format!("{:?}", set.quotas(scope)[0].window(at))
    }

    fn offset_zone(minutes: i32) -> TimeZone {
        TimeZone::fixed(Offset::from_seconds(minutes * 60).unwrap())
    }

    #[test]
    fn a_callers_zone_gets_a_slot_of_its_own_read_again_by_the_next_caller() {
        let scope = scope();
        let at: Timestamp = "2026-12-04T23:30:00Z".parse().unwrap();
        assert!(matches!(scope.quotas_in(None), QuotaSet::Own));
        let tokyo = TimeZone::get("Asia/Tokyo").unwrap();
        let berlin = TimeZone::get("Europe/Berlin").unwrap();
        let (QuotaSet::Zoned(a), QuotaSet::Zoned(b)) = (
            scope.quotas_in(Some(&tokyo)),
            scope.quotas_in(Some(&berlin)),
        ) else {
            panic!("each zone is kept");
        };
        assert_ne!(a, b);
        assert!(matches!(scope.quotas_in(Some(&tokyo)), QuotaSet::Zoned(s) if s == a));
        for (zone, set) in [(&tokyo, QuotaSet::Zoned(a)), (&berlin, QuotaSet::Zoned(b))] {
            let expected = format!("{:?}", Quota::daily(10).in_callers_zone(zone).window(at));
            assert_eq!(day_start(&scope, &set, at), expected);
        }
        // The cached `RateLimit-Policy` values come with a zone's slot.
        assert!(QuotaSet::Zoned(a).fields(&scope).is_some());
    }

    #[test]
    fn past_the_zones_a_layer_keeps_a_callers_quotas_are_made_for_the_request() {
        let scope = scope();
        let at: Timestamp = "2026-12-04T12:00:00Z".parse().unwrap();
        // More distinct fixed offsets, a minute apart, than the layer has
        // slots: each caller's quotas are its zone's, kept or not.
        let zones: Vec<TimeZone> = (0..MAX_ZONES as i32 + 64)
            .map(|minutes| offset_zone(minutes - 600))
            .collect();
        let mut kept = std::collections::HashMap::new();
        let mut made = 0;
        for (i, zone) in zones.iter().enumerate() {
            let set = scope.quotas_in(Some(zone));
            let expected = format!("{:?}", Quota::daily(10).in_callers_zone(zone).window(at));
            assert_eq!(day_start(&scope, &set, at), expected, "zone {i}");
            match set {
                QuotaSet::Zoned(slot) => {
                    assert!(!kept.values().any(|&s| s == slot), "slot {slot} twice");
                    kept.insert(i, slot);
                }
                QuotaSet::Other(_) => made += 1,
                QuotaSet::Own => panic!("zone {i} counted as the layer's own"),
            }
        }
        assert!(kept.len() >= MAX_ZONES * 3 / 4, "{} zones kept", kept.len());
        assert!(made >= 64, "{made} zones made per request");
        // A kept zone is found again, in its slot.
        for (i, slot) in kept {
            assert!(matches!(scope.quotas_in(Some(&zones[i])), QuotaSet::Zoned(s) if s == slot));
        }
    }
}
