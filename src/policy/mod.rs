//! One quota policy per application: every setting, the store, the clock and
//! the subject extractor, owned once. Its layers (see the middleware) carry
//! only their quotas and cost.

mod settings;

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use http::request::Parts;
use http::HeaderValue;
use jiff::tz::TimeZone;

use crate::key::Namespace;
use crate::ledger::{Ledger, Owed};
use crate::period::Clock;
use crate::quota::Quota;
use crate::response::Refusal;
use crate::store::{MemoryStore, Store};
use crate::subject::Subject;

pub(crate) use self::settings::Settings;
pub use self::settings::{CallerInfo, InvalidRequest, OnStoreError, SubjectPolicy, UnknownPlan};

/// A reader of each caller's time zone, for
/// [`QuotaPolicyBuilder::time_zone`], from the request header `name`
/// (case-insensitive): an IANA name (`Asia/Tokyo`; its aliases count as it,
/// `Japan` too). No such header: `Ok(None)`, each quota's own zone applies.
/// The header sent twice, or naming no zone of the IANA list (nor any zone
/// at all): a 400 that says so, and nothing is charged.
///
/// Each zone counts on counters of its own: take the header from a layer
/// the caller cannot get around (an API gateway, the application's
/// authentication), which sets it from the account's settings, never from
/// what the client sent.
///
/// ```
/// use tower_quota::{zone_from_header, FromHeader, Quota, QuotaPolicy};
///
/// let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
///     .time_zone(zone_from_header("x-account-zone"))
///     .build();
/// let daily = policy.layer(Quota::daily(1_000));
/// # let _ = daily;
/// ```
///
/// # Panics
///
/// When `name` is not a valid header name.
pub fn zone_from_header(
    name: &str,
) -> impl Fn(&Parts) -> Result<Option<TimeZone>, InvalidRequest> + Clone + Send + Sync + 'static {
    let header = http::HeaderName::from_bytes(name.as_bytes())
        .unwrap_or_else(|_| panic!("{name:?} is not a valid header name"));
    move |parts: &Parts| {
        let mut values = parts.headers.get_all(&header).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(InvalidRequest::new(format!(
                "The header {header} is sent more than once."
            )));
        }
        let unknown = || {
            InvalidRequest::new(format!(
                "The header {header} names no time zone of the IANA list."
            ))
        };
        // The longest IANA name is 32 bytes: a longer value is no zone,
        // and is not looked up in the database.
        let zone_name = value
            .to_str()
            .ok()
            .filter(|zone| !zone.is_empty() && zone.len() <= 64)
            .ok_or_else(unknown)?;
        let zone = TimeZone::get(zone_name).map_err(|_| unknown())?;
        // A file of the system's database that is no zone of the list
        // (`localtime`, `posixrules`) has no primary name: its rules differ
        // from host to host.
        if zone.primary_iana_name().is_none() {
            return Err(unknown());
        }
        Ok(Some(zone))
    }
}

/// The quotas of one application: one store, one clock, one namespace, one
/// way to name the subject, its plan and its time zone, and every layer of
/// the app made from it with [`QuotaPolicy::layer`].
///
/// Each layer charges the quotas of its own that the request has not been
/// charged on yet, in one call to the store: a router-wide daily quota and a
/// burst quota on `/search` cost two calls for a search (one per layer), and
/// one layer with several quotas stays one call. A layer that refuses gives
/// back what the layers further out charged for the request before the
/// refusal is answered, so a request refused by the burst quota spends
/// nothing of the daily one. The handler sees one
/// [`QuotaStatus`](crate::QuotaStatus) listing every quota that applied.
///
/// Two different quotas of one policy that would count on the same counter
/// (same allowance, period and anchor) are refused when the second layer is
/// made; the same quota handed to two layers shares one budget.
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
/// let read = usage.iter().find(|u| u.name() == "read-day").unwrap();
/// assert_eq!(read.used(), 1);
/// # }
/// ```
pub struct QuotaPolicy<E, St = MemoryStore> {
    pub(crate) core: Arc<Policy<E, St>>,
}

/// What a policy's layers, services and handles share.
pub(crate) struct Policy<E, St> {
    /// Unique in the process: a request's status keeps one ticket per
    /// policy.
    pub(crate) id: u64,
    pub(crate) settings: Settings,
    pub(crate) extractor: E,
    pub(crate) store: St,
    /// What requests that passed on a failed charge owe the store.
    pub(crate) ledger: Arc<Ledger>,
    /// Every quota of the policy's layers, in the order they were made.
    quotas: Mutex<Vec<Quota>>,
    /// The plans there are: declared, and named by some quota.
    plans: RwLock<Arc<[Arc<str>]>>,
    /// Whether some quota spreads the resets it tells clients: only then
    /// is a subject's spread worked out.
    spreads: AtomicBool,
}

/// A quota of a policy on a store with an identity: what other policies
/// on the same store must not contradict.
struct Claim {
    store: usize,
    namespace: Namespace,
    policy: u64,
    any_zone: bool,
    quota: Quota,
}

/// Panics when `policy` rejects with a status that is no error.
fn check_rejection(policy: &SubjectPolicy) {
    if let SubjectPolicy::Reject(status) = policy {
        assert!(
            status.is_client_error() || status.is_server_error(),
            "a request without a usable subject is rejected with a 4xx or 5xx status (got {status})"
        );
    }
}

/// The claims of every live policy on a store with an identity.
static CLAIMS: Mutex<Vec<Claim>> = Mutex::new(Vec::new());

impl<E, St: Store> Policy<E, St> {
    /// Adds a layer's quota to the policy's.
    ///
    /// # Panics
    ///
    /// When it would count on the counter of a different quota of the
    /// policy, or of another policy on the same store and namespace, or
    /// carries the name of a different quota of the policy.
    pub(crate) fn register(&self, quota: &Quota) {
        let declared = &self.settings.plans;
        for (plan, _) in quota.plans() {
            assert!(
                self.settings.plan.is_some(),
                "quota {:?} has a limit for plan {plan:?}, but the policy reads no plan (QuotaPolicyBuilder::plan): every caller would get the quota's own limit",
                quota.name()
            );
            assert!(
                declared.is_empty() || declared.iter().any(|d| **d == *plan),
                "quota {:?} has a limit for plan {plan:?}, which the policy's declared plans (QuotaPolicyBuilder::plans) do not name",
                quota.name()
            );
        }
        let max = self.store.max_count();
        let limits = std::iter::once(quota.limit()).chain(quota.plans().map(|(_, l)| l));
        for limit in limits {
            assert!(
                limit <= max,
                "quota {:?} has a limit of {limit}, more than its store counts exactly ({max})",
                quota.name()
            );
        }
        // The policy's own checks come first, under its lock: a quota it
        // refuses (a name or a counter of another of its quotas) claims
        // nothing on the store, which would refuse another policy's quota
        // for one this policy does not have.
        let mut quotas = self.quotas.lock().unwrap_or_else(|e| e.into_inner());
        let known = self.check_own(&quotas, quota);
        self.claim(quota);
        if !known {
            self.record_own(&mut quotas, quota);
        }
    }

    /// Checks `quota` against the quotas of the other policies on the same
    /// store, and records it.
    fn claim(&self, quota: &Quota) {
        let Some(store) = self.store.identity() else {
            return;
        };
        let any_zone = self.settings.zone.is_some();
        let mut claims = CLAIMS.lock().unwrap_or_else(|e| e.into_inner());
        for claim in claims.iter() {
            if claim.store != store
                || claim.policy == self.id
                || claim.namespace != self.settings.namespace
            {
                continue;
            }
            if claim.quota.same_as(quota) {
                // One budget, counted once per request, only if both
                // policies key a caller's calendar counters alike.
                assert!(
                    claim.any_zone == any_zone || quota.anchor() != crate::Anchor::Calendar,
                    "the same quota {:?} in two policies on one store and namespace, one reading each caller's time zone and the other not, would count a caller on two counters; give both policies the same time_zone, or the quota its own allowance in one of them",
                    quota.name(),
                );
                continue;
            }
            assert!(
                !claim.quota.shares_counters_with(quota, any_zone || claim.any_zone),
                "two different quotas of two policies on one store and namespace would count on one counter: {:?} and {quota:?} have the same allowance ({:?}), period and anchor; give one of them its own allowance, or the policies namespaces of their own",
                claim.quota,
                quota.allowance_tag(),
            );
        }
        // Once per quota of the policy, however many layers carry it (an
        // application that builds its routers anew from one policy).
        let claimed = claims
            .iter()
            .any(|claim| claim.policy == self.id && claim.quota.same_as(quota));
        if !claimed {
            claims.push(Claim {
                store,
                namespace: self.settings.namespace.clone(),
                policy: self.id,
                any_zone,
                quota: quota.clone(),
            });
        }
    }
}

impl<E, St> Drop for Policy<E, St> {
    fn drop(&mut self) {
        CLAIMS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|claim| claim.policy != self.id);
    }
}

impl<E, St> Policy<E, St> {
    /// Checks `quota` against the policy's quotas `quotas`: whether it is
    /// one of them already.
    ///
    /// # Panics
    ///
    /// When it would count on the counter of a different one, or carries
    /// its name.
    fn check_own(&self, quotas: &[Quota], quota: &Quota) -> bool {
        let per_caller = self.settings.zone.is_some();
        for known in quotas {
            if known.same_as(quota) {
                return true;
            }
            assert!(
                !known.shares_counters_with(quota, per_caller),
                "two different quotas of one policy would count on one counter: {known:?} and {quota:?} have the same allowance ({:?}), period and anchor{}; give one of them its own allowance",
                quota.allowance_tag(),
                if per_caller { " (the policy reads each caller's time zone, so their zones do not tell them apart)" } else { "" },
            );
            assert!(
                known.name() != quota.name(),
                "two different quotas of one policy are named {:?}; name them apart with Quota::named",
                quota.name()
            );
        }
        false
    }

    /// Adds `quota`, checked, to the policy's quotas `quotas`.
    fn record_own(&self, quotas: &mut Vec<Quota>, quota: &Quota) {
        quotas.push(quota.clone());
        if quota.spreads() {
            self.spreads.store(true, Ordering::Relaxed);
        }
        let named: Vec<&str> = quota.plans().map(|(plan, _)| plan).collect();
        if !named.is_empty() {
            let mut plans = self.plans.write().unwrap_or_else(|e| e.into_inner());
            let mut all = plans.to_vec();
            for plan in named {
                if !all.iter().any(|p| **p == *plan) {
                    all.push(plan.into());
                }
            }
            *plans = all.into();
        }
    }

    /// Whether some quota of the policy spreads the resets it tells.
    pub(crate) fn spreads(&self) -> bool {
        self.spreads.load(Ordering::Relaxed)
    }

    /// Every quota of the policy's layers, in the order they were made.
    pub(crate) fn quotas(&self) -> Vec<Quota> {
        self.quotas
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The `WWW-Authenticate` challenge of a 401 for a missing subject:
    /// the policy's, or else its extractor's.
    pub(crate) fn challenge(&self) -> Option<HeaderValue>
    where
        E: crate::SubjectExtractor,
    {
        self.settings
            .challenge
            .clone()
            .or_else(|| self.extractor.challenge())
    }

    /// `plan` as the layers charge it: itself when the policy knows it;
    /// else no plan (the quotas' own limits), or `Err` with the plan when the
    /// policy refuses unknown plans ([`UnknownPlan::Reject`]).
    pub(crate) fn plan_as_charged(&self, plan: Option<String>) -> Result<Option<String>, String> {
        match plan {
            // No plan is named so (see `Quota::plan`): no plan at all.
            Some(plan) if plan.is_empty() => Ok(None),
            Some(plan) if !self.knows_plan(&plan) => match self.settings.unknown_plan {
                UnknownPlan::DefaultLimits => Ok(None),
                UnknownPlan::Reject => Err(plan),
            },
            plan => Ok(plan),
        }
    }

    /// Whether `plan` is declared or named by some quota of the policy.
    pub(crate) fn knows_plan(&self, plan: &str) -> bool {
        self.plans
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|p| **p == *plan)
    }
}

impl<E, St> QuotaPolicy<E, St> {
    /// The store.
    pub fn store(&self) -> &St {
        &self.core.store
    }

    /// The namespace of every key.
    pub fn namespace(&self) -> &Namespace {
        &self.core.settings.namespace
    }

    /// Every quota of the policy's layers so far.
    pub fn quotas(&self) -> Vec<Quota> {
        self.core.quotas()
    }

    /// What the policy's ledger owes the store now: requests that passed on
    /// a failed charge under [`OnStoreError::FailOpen`], not counted yet.
    /// Nothing, unless the store failed; back to nothing once it answers and
    /// the ledger has settled (in a task of its own on the tokio runtime).
    /// What is still owed when the policy is dropped goes uncounted (logged,
    /// and counted in the metrics as abandoned): an application that shuts
    /// down can wait a moment for this to be empty.
    ///
    /// ```
    /// use tower_quota::{FromHeader, QuotaPolicy};
    ///
    /// let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    /// assert_eq!(policy.owed().units, 0);
    /// ```
    pub fn owed(&self) -> Owed {
        self.core.ledger.owed()
    }

    /// Settles what the policy's ledger owes (see [`owed`](Self::owed))
    /// now, and waits `within` at most (`Duration::MAX`: as long as it
    /// takes) until nothing is owed: what an
    /// application that shuts down awaits, once it stopped taking
    /// requests, so that no admission made while the store was away goes
    /// uncounted. While it waits, a store that fails is tried again every
    /// 100 ms, not after the growing waits (up to 5 s) of the ledger's
    /// task. Answers what is still owed (nothing, once settled; a settle
    /// on its way when the time is up, or one the store did not answer,
    /// counts as owed though it may land: [`Owed::unanswered`] tells its
    /// units).
    /// Once nothing is owed, it waits too (within the same time) for the
    /// store's charges still on their way ([`Store::charges_in_flight`]): the
    /// Redis store follows a charge or a settle it did not answer in time,
    /// to give it back if Redis applied it late, and a process that exits
    /// before that give-back leaves the request counted twice. And for the
    /// changes responses made (a give-back, a deferred cost's add) that are
    /// still on their way, or that the store never got (refused while it
    /// was away or full) and wait to be sent again: those are sent at once,
    /// and again every 100 ms while the store fails (the process's,
    /// whichever policy made them). A process that exits before they land
    /// leaves a request that was not served charged, or a served one
    /// under-counted. With `Duration::MAX`, a store that stays away holds
    /// the settle for as long as such a change may still land: until a
    /// little before its counter resets.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use std::time::Duration;
    /// use tower_quota::{FromHeader, QuotaPolicy};
    ///
    /// let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    /// // ... serve, until a shutdown signal ...
    /// let owed = policy.settle_owed(Duration::from_secs(5)).await;
    /// assert_eq!(owed.units, 0);
    /// // Nothing owed, no change on its way: no wait, however long it may be.
    /// assert_eq!(policy.settle_owed(Duration::MAX).await.units, 0);
    /// # }
    /// ```
    pub async fn settle_owed(&self, within: Duration) -> Owed
    where
        St: Store,
    {
        let core = &self.core;
        let start = tokio::time::Instant::now();
        let owed = core
            .ledger
            .settle_now(&core.store, core.settings.ledger(), within)
            .await;
        if owed.counters > 0 || tokio::runtime::Handle::try_current().is_err() {
            return owed;
        }
        // The store's follow-ups of charges and settles Redis may apply
        // late: their give-backs land before the caller exits.
        let deadline = start.checked_add(within);
        while core.store.charges_in_flight() > 0
            && deadline.is_none_or(|d| tokio::time::Instant::now() < d)
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The changes of responses (a give-back, a deferred cost's add) on
        // their way, or that the store never got (refused while it was away
        // or full) and wait to be sent again: sent now, before the process
        // exits.
        let pending = crate::store::resend::sent_all(deadline).await;
        if pending > 0 {
            tracing::warn!(
                changes = pending,
                "changes of responses (give-backs, deferred costs' adds) are still on their way \
                 or wait to be sent again at the end of the settle; lost if the process exits now"
            );
        }
        owed
    }
}

impl<E> QuotaPolicy<E, MemoryStore> {
    /// A policy naming subjects with `extractor`, on a fresh
    /// [`MemoryStore`], with every setting at its default.
    pub fn new(extractor: E) -> Self {
        Self::builder(extractor).build()
    }

    /// A policy naming subjects with `extractor`; configure it, then
    /// [`QuotaPolicyBuilder::build`].
    pub fn builder(extractor: E) -> QuotaPolicyBuilder<E, MemoryStore> {
        QuotaPolicyBuilder {
            settings: Settings::default(),
            extractor,
            store: MemoryStore::new(),
        }
    }
}

impl<E, St> Clone for QuotaPolicy<E, St> {
    fn clone(&self) -> Self {
        Self {
            core: Arc::clone(&self.core),
        }
    }
}

impl<E, St: fmt::Debug> fmt::Debug for QuotaPolicy<E, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaPolicy")
            .field("settings", &self.core.settings)
            .field("store", &self.core.store)
            .field("quotas", &self.core.quotas())
            .finish_non_exhaustive()
    }
}

/// Configures a [`QuotaPolicy`]: every setting of every layer of the policy
/// is made here, whatever the order of the calls.
#[must_use]
pub struct QuotaPolicyBuilder<E, St = MemoryStore> {
    settings: Settings,
    extractor: E,
    store: St,
}

impl<E, St> QuotaPolicyBuilder<E, St> {
    /// Keeps counters in `store` (default: a fresh [`MemoryStore`]).
    pub fn store<St2: Store>(self, store: St2) -> QuotaPolicyBuilder<E, St2> {
        QuotaPolicyBuilder {
            settings: self.settings,
            extractor: self.extractor,
            store,
        }
    }

    /// Takes "now" from `clock` instead of the system clock.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.settings.clock = Arc::new(clock);
        self
    }

    /// Starts every key with `prefix` (default `quota`).
    ///
    /// # Panics
    ///
    /// When `prefix` contains `{` or `}`.
    pub fn namespace(mut self, prefix: &str) -> Self {
        self.settings.namespace = Namespace::new(prefix);
        self
    }

    /// What to do when the request names no subject. Default: 401.
    ///
    /// # Panics
    ///
    /// When `policy` rejects with a status that is not a client or server
    /// error (4xx, 5xx).
    pub fn on_missing_subject(mut self, policy: SubjectPolicy) -> Self {
        check_rejection(&policy);
        self.settings.on_missing = policy;
        self
    }

    /// What to do when the request's subject is malformed. Default: 400.
    ///
    /// # Panics
    ///
    /// When `policy` rejects with a status that is not a client or server
    /// error (4xx, 5xx).
    pub fn on_malformed_subject(mut self, policy: SubjectPolicy) -> Self {
        check_rejection(&policy);
        self.settings.on_malformed = policy;
        self
    }

    /// The `WWW-Authenticate` challenge of the layers' 401s (a missing
    /// subject, by default), telling the client how to name itself. Default:
    /// the extractor's ([`SubjectExtractor::challenge`](crate::SubjectExtractor::challenge):
    /// `ApiKey header="x-account-id"` for
    /// [`FromHeader`](crate::FromHeader)); a 401 goes without one when
    /// neither has one. gRPC answers carry none: their status says it.
    ///
    /// ```
    /// use http::HeaderValue;
    /// use tower_quota::{FromExtension, QuotaPolicy};
    ///
    /// # #[derive(Clone)] struct Claims { account: String }
    /// // The subject comes from the application's bearer tokens.
    /// let policy = QuotaPolicy::builder(FromExtension::<Claims>::account_from(|c| Some(c.account.clone())))
    ///     .challenge(HeaderValue::from_static("Bearer realm=\"api\""))
    ///     .build();
    /// ```
    pub fn challenge(mut self, challenge: HeaderValue) -> Self {
        self.settings.challenge = Some(challenge);
        self
    }

    /// The longest subject id accepted, in bytes (default 256). Longer ids are
    /// malformed.
    ///
    /// # Panics
    ///
    /// When `bytes` is 0: no subject would ever be accepted.
    pub fn max_subject_len(mut self, bytes: usize) -> Self {
        assert!(bytes > 0, "the longest subject id is at least one byte");
        self.settings.max_subject_len = bytes;
        self
    }

    /// What to do when the store fails. Default: fail closed, 503 with
    /// `Retry-After: 1`.
    pub fn on_store_error(mut self, policy: OnStoreError) -> Self {
        self.settings.on_store_error = policy;
        self
    }

    /// How long to wait for the store before treating it as failed (default
    /// 100 ms; `None` waits forever). The wait applies only to stores that do
    /// not answer at once (never to [`MemoryStore`]) and uses tokio's timer.
    /// It is the time a charge waits while the store answers *nothing*: a
    /// store that tells when it last had an answer from its server
    /// ([`Store::last_answer`]: the Redis store does) and keeps answering
    /// other calls is slow under load, not failing, and a charge then waits
    /// until the timeout has passed since the store's last answer, up to ten
    /// times the timeout in all. So load alone (saturated cores, a queue of
    /// charges) does not turn into 503s, while a store that stalls fails its
    /// calls after the timeout.
    ///
    /// It also bounds how long a response waits for what it changes after
    /// the handler answered (a give-back, a deferred cost's rest): past it,
    /// the response goes out with its fields as the change will leave the
    /// counters, and the change carries on in its own task.
    ///
    /// A store may give up on a call sooner on its own: the Redis store
    /// answers within its budget (`RedisStoreBuilder::timeout`, 80 ms by
    /// default, waited for the same way), so a longer timeout here waits for
    /// nothing more unless that budget grows with it (keep it a little below
    /// this one); [`build`](Self::build) logs a warning when this one is
    /// more than four such calls and the store's wait
    /// ([`Store::call_budget`]).
    ///
    /// It must be longer than what the store may wait on purpose before it
    /// answers ([`Store::longest_wait`]: 25 ms for a
    /// [`LeasedStore`](crate::LeasedStore)): [`build`](Self::build) checks.
    /// A `LeasedStore` may also send a request its first call refused again,
    /// once its own units on their way back landed (an old block's
    /// give-back among them): a refusal can take three calls in a row to
    /// the inner store, each an answer that moves the wait on.
    ///
    /// # Panics
    ///
    /// When `timeout` is zero. A request whose store does not answer at once
    /// panics when it runs on a tokio runtime built without its timer
    /// (`enable_time`). Runtimes made by `#[tokio::main]` have it; otherwise
    /// pass `None`.
    pub fn store_timeout(mut self, timeout: Option<Duration>) -> Self {
        assert!(
            timeout != Some(Duration::ZERO),
            "a store timeout of zero would fail every charge; pass None to wait forever"
        );
        self.settings.store_timeout = timeout;
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
        self.settings.skip.push(Arc::new(predicate));
        self
    }

    /// Reads the subject's plan from each request (e.g. from a value an
    /// authentication layer inserted); quotas give plans their limits with
    /// [`Quota::plan`]. `None` means no plan: each quota's own limit, and so
    /// does an empty name (no plan has one: a header sent empty, say). The
    /// plan is not part of any key, so a subject whose plan changes keeps
    /// its count.
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
        self.settings.plan = Some(Arc::new(plan));
        self
    }

    /// Declares the plans there are, so that a plan no quota names a limit
    /// for (the quota's own limit applies) is not taken for an unknown one.
    /// Plans that quotas name with [`Quota::plan`] are known anyway.
    pub fn plans<I, P>(mut self, plans: I) -> Self
    where
        I: IntoIterator<Item = P>,
        P: Into<String>,
    {
        self.settings
            .plans
            .extend(plans.into_iter().map(|p| Arc::from(p.into())));
        self
    }

    /// What to do with a plan no quota of the policy names. Default: each
    /// quota's own limit.
    pub fn on_unknown_plan(mut self, choice: UnknownPlan) -> Self {
        self.settings.unknown_plan = choice;
        self
    }

    /// Reads each caller's own time zone from the request (e.g. from the
    /// authenticated account): the caller's calendar quotas then turn at
    /// the caller's midnight (days, weeks, months), each zone on counters
    /// of its own. A minute, and an hour at a whole-hour offset, is the same
    /// instants in every zone and one counter whatever zone the caller
    /// names ([`Period::window`](crate::Period::window)); an hour at a
    /// half-hour offset (Kolkata) turns at half past, on a counter of its
    /// own. `Ok(None)` means the request names no zone: each quota's own
    /// zone applies ([`Quota::in_time_zone`], UTC by default). An error is
    /// answered with 400 and its text, and nothing is charged. Fixed
    /// windows do not depend on a zone, nor first-use quotas on the
    /// caller's (a first-use month ends on the same day and time of the
    /// month in the quota's own zone).
    ///
    /// The zone must be one of the IANA list (it has a primary name: its
    /// aliases count as it) or a fixed offset, as it names the calendar
    /// window in the counter's key; any other is refused with 400: a POSIX
    /// TZ string, or a file of the system's zone database that is no zone of
    /// the list (`localtime`, `posixrules`), whose rules differ from host to
    /// host.
    ///
    /// Each zone counts on counters of its own, so read the zone from what
    /// the caller cannot change at will (its account's settings, set by an
    /// authentication layer): a client free to name any zone per request
    /// could spend its daily allowance once in each zone. The support
    /// handle reaches a caller's counters with
    /// [`QuotaHandle::in_zone`](crate::QuotaHandle::in_zone).
    ///
    /// ```
    /// use tower_quota::jiff::tz::TimeZone;
    /// use tower_quota::{FromHeader, InvalidRequest, QuotaPolicy};
    ///
    /// // What the application's authentication layer puts in the request:
    /// // the account's own settings, which its owner does not change per
    /// // request.
    /// #[derive(Clone)]
    /// struct Account {
    ///     zone: Option<TimeZone>,
    /// }
    ///
    /// let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
    ///     .time_zone(|parts| {
    ///         let account = parts
    ///             .extensions
    ///             .get::<Account>()
    ///             .ok_or_else(|| InvalidRequest::new("not authenticated"))?;
    ///         Ok(account.zone.clone())
    ///     })
    ///     .build();
    /// # let _ = policy;
    /// ```
    pub fn time_zone<F>(mut self, zone: F) -> Self
    where
        F: Fn(&Parts) -> Result<Option<TimeZone>, InvalidRequest> + Send + Sync + 'static,
    {
        self.settings.zone = Some(Arc::new(zone));
        self
    }

    /// What the application knows of a caller's plan and zone outside its
    /// requests, for the [support router](crate::QuotaHandle::router) and
    /// [`QuotaHandle::for_caller`](crate::QuotaHandle::for_caller) (the
    /// handle's other methods take the zone and plan they are given:
    /// [`QuotaHandle::in_zone`](crate::QuotaHandle::in_zone),
    /// [`QuotaHandle::usage_on_plan`](crate::QuotaHandle::usage_on_plan)).
    /// A support call that names no `?plan=` (or no `?zone=`) is answered on
    /// the plan (in the zone) `info` gives for its subject, so that support
    /// staff reach the counters a customer with a plan or zone of its own
    /// is charged on without knowing either; one that names both does not
    /// ask. Read from the same data as the policy's [`plan`](Self::plan)
    /// and [`time_zone`](Self::time_zone) readers (the account's settings),
    /// by the subject's id and, with an extractor that answers several
    /// kinds, its kind. A zone is used only by a policy that reads callers'
    /// zones, a plan only by one that reads plans.
    ///
    /// `info` answers `Ok(None)` for a caller the application does not know:
    /// the router answers 404 and changes nothing (`Ok(Some(CallerInfo::new()))`
    /// is a known caller on the quotas' own limits and zones). When it
    /// fails, 503 with `Retry-After: 1` (the error is logged at warn, with
    /// the subject by its kind and hash: keep ids out of its text); when it
    /// gives a plan the policy refuses ([`UnknownPlan::Reject`]) or a zone
    /// no key can name (neither of the IANA list nor a fixed offset), 500;
    /// nothing is changed either way. A call the router refuses for what it
    /// names (its path, zone, plan, amount or allowance) is refused before
    /// `info` is asked. The router waits for `info` as long as it takes:
    /// bound the lookup in it (a database client's own timeout). Without
    /// `info`, a call that names neither is answered on the quotas' own
    /// limits and zones.
    ///
    /// ```
    /// use std::collections::HashMap;
    /// use std::sync::Arc;
    /// use tower_quota::jiff::tz::TimeZone;
    /// use tower_quota::{CallerInfo, FromHeader, QuotaPolicy};
    ///
    /// // The application's accounts: a plan and a zone each.
    /// let accounts: Arc<HashMap<Vec<u8>, (String, TimeZone)>> = Arc::default();
    /// let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
    ///     .caller_info(move |subject| {
    ///         let account = accounts.get(subject.id()).cloned();
    ///         async move {
    ///             Ok(account.map(|(plan, zone)| CallerInfo::new().plan(plan).zone(zone)))
    ///         }
    ///     })
    ///     .build();
    /// # let _ = policy;
    /// ```
    pub fn caller_info<F, Fut>(mut self, info: F) -> Self
    where
        F: Fn(&Subject) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<
                Output = Result<Option<CallerInfo>, Box<dyn std::error::Error + Send + Sync>>,
            > + Send
            + 'static,
    {
        self.settings.caller_info = Some(Arc::new(move |subject: &Subject| {
            Box::pin(info(subject))
                as std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>>
        }));
        self
    }

    /// The most counters the policy's ledger owes at once (default 10 000):
    /// under [`OnStoreError::FailOpen`], a request that passes on a failed
    /// charge owes it, per counter its layers charge, and the ledger adds
    /// it to the store once the store answers again. Debts on one counter
    /// (one key, and one period of a first-use quota) add up in one entry of
    /// some 250 bytes, so a few MB at the default bound. A debt on a new
    /// counter past the bound goes uncounted (logged a few times a second at
    /// most, and counted in the metrics), as does one owed to a period that
    /// is over before the store answers. 0 turns the ledger off: requests
    /// that pass on a failed charge go uncounted, as they did before it.
    ///
    /// ```
    /// use tower_quota::{FromHeader, OnStoreError, QuotaPolicy};
    ///
    /// let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
    ///     .on_store_error(OnStoreError::FailOpen)
    ///     .max_owed_counters(50_000)
    ///     .build();
    /// # let _ = policy;
    /// ```
    pub fn max_owed_counters(mut self, counters: usize) -> Self {
        self.settings.max_owed = counters;
        self
    }

    /// Gives the charge back when the response is a server error (5xx) or
    /// the inner service fails: the client is not billed for the server's
    /// failures. Off by default.
    ///
    /// A gRPC call (HTTP 200, `content-type: application/grpc*`) counts as
    /// failed when its response head carries a `grpc-status` of a server
    /// failure: 2 UNKNOWN, 13 INTERNAL, 14 UNAVAILABLE or 15 DATA_LOSS, the
    /// codes that map to a 5xx. (12 UNIMPLEMENTED, a method the server does
    /// not have, is gRPC's 404: never charged, this setting on or off.)
    /// That is a trailers-only
    /// answer, the way tonic answers a failed unary call; a status sent in
    /// trailers after a streamed body is not read, and stays charged.
    /// DEADLINE_EXCEEDED in the head stays charged too: the client sets
    /// the deadline, often after the work was done. (A call a server ends
    /// at its deadline outside the layer, as tonic's does for the client's
    /// `grpc-timeout`, is dropped before its head: not charged.) The refund
    /// goes to the counters that were charged while they live, and never to one made anew since (a
    /// support reset while the request was served): a calendar counter
    /// whose window ended meanwhile takes none (its period is over, and
    /// nothing in it is enforced any more; it keeps counting the request).
    /// Stores date counters by the clock of the instance that made
    /// them: keep the clocks of instances that share a store synchronised
    /// (or give the policy the Redis server's, `RedisStore::server_clock`),
    /// or a refund may find its counter dated after the request.
    pub fn refund_server_errors(mut self, refund: bool) -> Self {
        self.settings.refund_server_errors = refund;
        self
    }

    /// Builds the answer to a refused request (a quota without room, or the
    /// store failing under fail-closed) from what the layer knows: see
    /// [`Refusal`], whose [`standard`](Refusal::standard) answer is the
    /// default (`application/problem+json`, or a gRPC status for a gRPC
    /// call).
    pub fn refusal<F>(mut self, answer: F) -> Self
    where
        F: Fn(&Refusal) -> http::Response<bytes::Bytes> + Send + Sync + 'static,
    {
        self.settings.refusal = Some(Arc::new(answer));
        self
    }

    /// The policy.
    ///
    /// # Panics
    ///
    /// When `store_timeout` is no longer than the wait the store may take
    /// on purpose before it answers ([`Store::longest_wait`]: 25 ms for a
    /// [`LeasedStore`](crate::LeasedStore)).
    pub fn build(self) -> QuotaPolicy<E, St>
    where
        St: Store,
    {
        if let Some(timeout) = self.settings.store_timeout {
            let wait = self.store.longest_wait();
            assert!(
                timeout > wait,
                "store_timeout ({timeout:?}) must be longer than the {wait:?} its store may wait \
                 before it answers (a LeasedStore waits for units on their way back): each such \
                 wait would fail the request"
            );
            // A leased refusal may take three calls and its wait: a
            // timeout past four calls and the wait waits for nothing more.
            if let Some(budget) = self.store.call_budget() {
                if timeout > budget.saturating_mul(4).saturating_add(wait) {
                    tracing::warn!(
                        ?timeout,
                        ?budget,
                        "store_timeout is far longer than the store's own budget for a call: a \
                         slow store fails at its budget, not at store_timeout; raise the store's \
                         budget with it (RedisStoreBuilder::timeout)"
                    );
                }
            }
        }
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let plans: Arc<[Arc<str>]> = self.settings.plans.clone().into();
        QuotaPolicy {
            core: Arc::new(Policy {
                id: NEXT.fetch_add(1, Ordering::Relaxed),
                ledger: Ledger::on_store(self.store.identity()),
                settings: self.settings,
                extractor: self.extractor,
                store: self.store,
                quotas: Mutex::default(),
                plans: RwLock::new(plans),
                spreads: AtomicBool::new(false),
            }),
        }
    }
}

impl<E, St: fmt::Debug> fmt::Debug for QuotaPolicyBuilder<E, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaPolicyBuilder")
            .field("settings", &self.settings)
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

impl<E: Clone, St: Clone> Clone for QuotaPolicyBuilder<E, St> {
    fn clone(&self) -> Self {
        Self {
            settings: self.settings.clone(),
            extractor: self.extractor.clone(),
            store: self.store.clone(),
        }
    }
}

#[cfg(test)]
mod claim_tests {
    use super::*;
    use crate::{FromHeader, Quota};

    /// A policy claims each quota once, however many layers carry it.
    #[test]
    fn a_quota_is_claimed_once_per_policy() {
        let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
        let id = policy.core.id;
        let mine = || {
            CLAIMS
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .filter(|claim| claim.policy == id)
                .count()
        };
        for _ in 0..100 {
            let _ = policy.layer(Quota::daily(10));
        }
        assert_eq!(mine(), 1);
        let _ = policy.layer(Quota::hourly(10));
        assert_eq!(mine(), 2);
        drop(policy);
        assert_eq!(mine(), 0);
    }
}
