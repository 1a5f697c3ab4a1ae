//! The settings of a policy, read by every layer, service and handle of it.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::StatusCode;
use jiff::tz::TimeZone;

use crate::key::Namespace;
use crate::ledger::Terms;
use crate::period::{Clock, SystemClock};
use crate::response::Refusal;
use crate::subject::Subject;

/// What to do with a request whose subject is missing or malformed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SubjectPolicy {
    /// Answer with this status (a 4xx or 5xx: the builder refuses any
    /// other) and a problem document; the inner service is not called.
    Reject(StatusCode),
    /// Let the request through without charging any quota (and without
    /// rate-limit fields). Unidentified requests never share a counter: they
    /// are simply not counted.
    Allow,
}

/// What to do when the store fails or does not answer in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnStoreError {
    /// Let the request through, and log the failure. Availability over
    /// enforcement: the request is served without a charge, and owes it.
    /// Once its answer is known (what it costs; nothing if it was not served
    /// after all), its debt goes to the policy's ledger, which adds it to the
    /// store once the store answers again, past the limit if need be: every
    /// request served is counted. The ledger holds a bound of counters
    /// ([`QuotaPolicyBuilder::max_owed_counters`](crate::QuotaPolicyBuilder::max_owed_counters));
    /// a debt past it, or owed to a period that is over before the store
    /// answers, goes uncounted, logged and counted in the metrics. Its
    /// response carries no `RateLimit` fields for the quotas it owes (where
    /// the subject stands is not known), and its handler's
    /// [`QuotaStatus`](crate::QuotaStatus) no entries for them.
    FailOpen,
    /// Answer 503 with a problem document and `Retry-After` (in seconds).
    /// Enforcement over availability. A layer of shadow quotas only, which
    /// never refuses, lets the request through as under `FailOpen`
    /// ([`Quota::shadow`](crate::Quota::shadow)).
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

/// Why a request's head cannot be charged: a cost or a time zone that
/// cannot be worked out. Answered with 400 and the reason; nothing is
/// charged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidRequest(Cow<'static, str>);

impl InvalidRequest {
    /// An error with a reason the client may read.
    pub fn new(reason: impl Into<Cow<'static, str>>) -> Self {
        Self(reason.into())
    }

    /// The reason.
    pub fn reason(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for InvalidRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvalidRequest {}

pub(crate) type SkipFn = dyn Fn(&Parts) -> bool + Send + Sync;
pub(crate) type PlanFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
pub(crate) type ZoneFn = dyn Fn(&Parts) -> Result<Option<TimeZone>, InvalidRequest> + Send + Sync;
pub(crate) type RefusalFn = dyn Fn(&Refusal) -> http::Response<bytes::Bytes> + Send + Sync;
pub(crate) type CallerInfoFn = dyn Fn(&Subject) -> Pin<Box<dyn Future<Output = Result<Option<CallerInfo>, BoxError>> + Send>>
    + Send
    + Sync;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the application knows of a caller outside its requests: the plan
/// and the calendar zone the policy's readers
/// ([`plan`](crate::QuotaPolicyBuilder::plan),
/// [`time_zone`](crate::QuotaPolicyBuilder::time_zone)) find in its
/// requests. The support router reads it
/// ([`QuotaPolicyBuilder::caller_info`](crate::QuotaPolicyBuilder::caller_info))
/// for a call that names no `?plan=` or `?zone=`, and
/// [`QuotaHandle::for_caller`](crate::QuotaHandle::for_caller) for the
/// handle in a caller's zone and on its plan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CallerInfo {
    pub(crate) plan: Option<String>,
    pub(crate) zone: Option<TimeZone>,
}

impl CallerInfo {
    /// A caller on the quotas' own limits, in their own zones.
    pub fn new() -> Self {
        Self::default()
    }

    /// The caller's plan, as the policy's plan reader finds it.
    pub fn plan(mut self, plan: impl Into<String>) -> Self {
        self.plan = Some(plan.into());
        self
    }

    /// The caller's own calendar zone, as the policy's zone reader finds
    /// it.
    pub fn zone(mut self, zone: TimeZone) -> Self {
        self.zone = Some(zone);
        self
    }
}

/// Every setting of a policy, in one place.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) namespace: Namespace,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) on_missing: SubjectPolicy,
    pub(crate) on_malformed: SubjectPolicy,
    pub(crate) max_subject_len: usize,
    /// The `WWW-Authenticate` value of a 401 for a missing or malformed
    /// subject, over the extractor's.
    pub(crate) challenge: Option<http::HeaderValue>,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) store_timeout: Option<Duration>,
    pub(crate) skip: Vec<Arc<SkipFn>>,
    pub(crate) plan: Option<Arc<PlanFn>>,
    /// Plans declared up front, beside those the quotas name.
    pub(crate) plans: Vec<Arc<str>>,
    pub(crate) unknown_plan: UnknownPlan,
    pub(crate) zone: Option<Arc<ZoneFn>>,
    pub(crate) refund_server_errors: bool,
    pub(crate) refusal: Option<Arc<RefusalFn>>,
    /// What the application knows of a caller's plan and zone, for the
    /// support router.
    pub(crate) caller_info: Option<Arc<CallerInfoFn>>,
    /// The most counters the policy's ledger owes at once; 0: the ledger
    /// is off (a request that passes on a failed charge goes uncounted).
    pub(crate) max_owed: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            namespace: Namespace::default(),
            clock: Arc::new(SystemClock),
            on_missing: SubjectPolicy::Reject(StatusCode::UNAUTHORIZED),
            on_malformed: SubjectPolicy::Reject(StatusCode::BAD_REQUEST),
            max_subject_len: 256,
            challenge: None,
            on_store_error: OnStoreError::FailClosed {
                retry_after: Duration::from_secs(1),
            },
            store_timeout: Some(Duration::from_millis(100)),
            skip: Vec::new(),
            plan: None,
            plans: Vec::new(),
            unknown_plan: UnknownPlan::DefaultLimits,
            zone: None,
            refund_server_errors: false,
            refusal: None,
            caller_info: None,
            max_owed: crate::ledger::DEFAULT_MAX_OWED,
        }
    }
}

impl Settings {
    /// What the policy's ledger reads of these settings.
    pub(crate) fn ledger(&self) -> Terms<'_> {
        Terms {
            clock: &self.clock,
            max_owed: self.max_owed,
            store_timeout: self.store_timeout,
        }
    }

    /// The caller's own time zone for the request with head `parts`, when
    /// the policy reads one and the request names one that can name
    /// calendar windows in keys.
    pub(crate) fn caller_zone(&self, parts: &Parts) -> Result<Option<TimeZone>, InvalidRequest> {
        match self.zone.as_ref().map(|zone| zone(parts)) {
            None | Some(Ok(None)) => Ok(None),
            Some(Ok(Some(zone))) if crate::period::is_nameable(&zone) => Ok(Some(zone)),
            Some(Ok(Some(_))) => Err(InvalidRequest::new(
                "The time zone is neither a zone of the IANA list nor a fixed offset.",
            )),
            Some(Err(error)) => Err(error),
        }
    }

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
            .field("challenge", &self.challenge)
            .field("on_store_error", &self.on_store_error)
            .field("store_timeout", &self.store_timeout)
            .field("skip_rules", &self.skip.len())
            .field("plans", &self.plan.is_some())
            .field("unknown_plan", &self.unknown_plan)
            .field("time_zone_per_caller", &self.zone.is_some())
            .field("caller_info", &self.caller_info.is_some())
            .field("refund_server_errors", &self.refund_server_errors)
            .field("max_owed_counters", &self.max_owed)
            .finish_non_exhaustive()
    }
}
