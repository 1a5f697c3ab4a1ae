//! Support tools and handlers: where a subject stands, resets and refunds,
//! without rebuilding any layer.

#[cfg(feature = "axum")]
mod router;

use std::fmt;
use std::sync::Arc;

use http::request::Parts;
use jiff::tz::TimeZone;
use jiff::{SignedDuration, Timestamp};

use crate::middleware::QuotaLayer;
use crate::policy::{CallerInfo, InvalidRequest, Policy, QuotaPolicy, Settings};
use crate::quota::Quota;
use crate::status::{QuotaStatus, QuotaUsage};
use crate::store::{ChargeLine, ChargeRequest, MemoryStore, Store, StoreError};
use crate::subject::{Subject, SubjectError, SubjectExtractor, SubjectKind};

/// A handle on the counters of a [`QuotaPolicy`](crate::QuotaPolicy) (from
/// [`QuotaPolicy::handle`](crate::QuotaPolicy::handle), every quota of its
/// layers) or of one layer ([`QuotaLayer::handle`](crate::QuotaLayer::handle)):
/// where a subject stands, resets and refunds. It uses the policy's clock,
/// namespace, store and subject extractor, and charges nothing. With the
/// `axum` feature, [`QuotaHandle::router`] serves it over HTTP.
///
/// ```
/// use tower_quota::{FromHeader, QuotaLayer, Subject};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let layer = QuotaLayer::daily(1_000, FromHeader::account("x-account-id"));
/// let handle = layer.handle();
/// let acme = Subject::account("acme");
/// let usage = handle.usage(&acme).await.unwrap();
/// assert_eq!(usage[0].remaining(), 1_000);
/// assert_eq!(usage[0].quota().describe_reset(), "every day at 00:00 UTC");
/// # }
/// ```
pub struct QuotaHandle<St = MemoryStore> {
    shared: Arc<dyn PolicyView<St>>,
    only: Option<Arc<[Quota]>>,
    /// A caller's own zone, for its calendar quotas.
    zone: Option<TimeZone>,
    /// A caller's plan, for [`QuotaHandle::usage`] (from
    /// [`QuotaHandle::for_caller`]).
    plan: Option<String>,
}

/// What a handle needs of its policy, whatever its subject extractor.
trait PolicyView<St>: Send + Sync {
    fn settings(&self) -> &Settings;
    fn store(&self) -> &St;
    fn quotas(&self) -> Vec<Quota>;
    fn extract(&self, parts: &Parts) -> Result<Subject, SubjectError>;
    fn kinds(&self) -> Option<Vec<SubjectKind>>;
    fn subject_named(&self, kind: &SubjectKind, id: &[u8]) -> Result<Subject, SubjectError>;
    fn challenge(&self) -> Option<http::HeaderValue>;
    fn plan_as_charged(&self, plan: Option<String>) -> Result<Option<String>, String>;
    /// Forgets what the policy's ledger (and those of the other policies
    /// on its store, which may share the counter) owes the counter at `key`
    /// for requests made by `at`, when its reset was sent.
    fn forget_owed(&self, key: &crate::key::PeriodKey, at: Timestamp);
    /// Holds back the ledgers' settles of what is owed to the counter at
    /// `key` while support resets it with a call sent at `at`.
    fn hold_owed(&self, key: &crate::key::PeriodKey, at: Timestamp) -> Vec<crate::ledger::Hold>;
    /// The policy's identity, as its tickets carry it.
    fn id(&self) -> u64;
}

impl<E: SubjectExtractor, St: Send + Sync> PolicyView<St> for Policy<E, St> {
    fn settings(&self) -> &Settings {
        &self.settings
    }
    fn store(&self) -> &St {
        &self.store
    }
    fn quotas(&self) -> Vec<Quota> {
        Policy::quotas(self)
    }
    fn extract(&self, parts: &Parts) -> Result<Subject, SubjectError> {
        self.extractor.extract(parts)
    }
    fn kinds(&self) -> Option<Vec<SubjectKind>> {
        self.extractor.kinds()
    }
    fn subject_named(&self, kind: &SubjectKind, id: &[u8]) -> Result<Subject, SubjectError> {
        self.extractor.subject_named(kind, id)
    }
    fn challenge(&self) -> Option<http::HeaderValue> {
        Policy::challenge(self)
    }
    fn plan_as_charged(&self, plan: Option<String>) -> Result<Option<String>, String> {
        Policy::plan_as_charged(self, plan)
    }
    fn forget_owed(&self, key: &crate::key::PeriodKey, at: Timestamp) {
        for ledger in self.ledger.sharing() {
            ledger.forget(key, at);
        }
    }
    fn hold_owed(&self, key: &crate::key::PeriodKey, at: Timestamp) -> Vec<crate::ledger::Hold> {
        self.ledger
            .sharing()
            .iter()
            .map(|ledger| ledger.hold(key, at))
            .collect()
    }
    fn id(&self) -> u64 {
        self.id
    }
}

/// How much later than the instant of a charge `refund_at` undoes its
/// counter may have been made: by a request stamped a moment later that
/// reached the store first, or by an instance whose clock is ahead.
const MADE_BY_SLACK: SignedDuration = SignedDuration::from_secs(1);

impl<St: Send + Sync + 'static> QuotaHandle<St> {
    fn of_policy<E: SubjectExtractor>(policy: Arc<Policy<E, St>>) -> Self {
        Self {
            shared: policy,
            only: None,
            zone: None,
            plan: None,
        }
    }
}

impl<E: SubjectExtractor, St: Store> QuotaPolicy<E, St> {
    /// A handle for support tools and handlers on every quota of the
    /// policy's layers: where a subject stands, resets and refunds.
    pub fn handle(&self) -> QuotaHandle<St> {
        QuotaHandle::of_policy(Arc::clone(&self.core))
    }
}

impl<E: SubjectExtractor, St: Store> QuotaLayer<E, St> {
    /// A handle on the layer's quotas for support tools and handlers: where
    /// a subject stands, refunds and resets.
    pub fn handle(&self) -> QuotaHandle<St> {
        QuotaHandle::of_policy(Arc::clone(&self.bound.policy))
            .only(Arc::clone(&self.bound.scope.quotas))
    }
}

impl<St> QuotaHandle<St> {
    /// The handle on `quotas` only.
    pub(crate) fn only(self, quotas: Arc<[Quota]>) -> Self {
        Self {
            only: Some(quotas),
            ..self
        }
    }

    /// The same handle for a caller in `zone`: its calendar quotas counted
    /// in that zone, as the layers count them for a caller who names it
    /// (see [`QuotaPolicyBuilder::time_zone`](crate::QuotaPolicyBuilder::time_zone)).
    ///
    /// # Panics
    ///
    /// When `zone` is neither a zone of the IANA list (with a primary name)
    /// nor a fixed offset: no layer counts a caller in it.
    #[must_use]
    pub fn in_zone(&self, zone: TimeZone) -> Self {
        assert!(
            crate::period::is_nameable(&zone),
            "a caller's time zone is a zone of the IANA list or a fixed offset, got {zone:?}"
        );
        // Under its primary name, as the layers count a caller who names
        // an alias: what the handle tells names the zone as the layer told
        // the caller.
        let zone = crate::period::under_primary_name(&zone);
        Self {
            zone: Some(zone),
            ..self.clone()
        }
    }

    /// Whether the policy reads a calendar zone per caller
    /// ([`QuotaPolicyBuilder::time_zone`](crate::QuotaPolicyBuilder::time_zone)):
    /// otherwise every caller counts in the quotas' own zones, and a handle
    /// [`in_zone`](Self::in_zone) names counters no layer writes.
    pub fn reads_caller_zones(&self) -> bool {
        self.settings().zone.is_some()
    }

    /// This handle for `subject` as the policy's layers count it: in the
    /// calendar zone, and with [`usage`](Self::usage) on the plan, that the
    /// policy's [`caller_info`](crate::QuotaPolicyBuilder::caller_info)
    /// gives for it. What it gives no zone or plan for (and every caller,
    /// without `caller_info`) is counted as a request that names none is:
    /// in the quotas' own zones, on their own limits. A zone is used only
    /// by a policy that [reads callers' zones](Self::reads_caller_zones),
    /// a plan only by one that reads plans.
    /// Resets and refunds through the handle reach the counters the layers
    /// charge that caller, which a handle outside its zone does not name.
    ///
    /// ```
    /// use tower_quota::jiff::tz::TimeZone;
    /// use tower_quota::{zone_from_header, CallerInfo, FromHeader, Quota, QuotaPolicy, Subject};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
    ///     .plan(|parts| Some(parts.headers.get("x-plan")?.to_str().ok()?.to_owned()))
    ///     .time_zone(zone_from_header("x-account-zone"))
    ///     .caller_info(|subject| {
    ///         // The application's own account settings.
    ///         let known = subject.id() == b"acme";
    ///         async move {
    ///             let tokyo = TimeZone::get("Asia/Tokyo")?;
    ///             Ok(known.then(|| CallerInfo::new().plan("pro").zone(tokyo)))
    ///         }
    ///     })
    ///     .build();
    /// let _layer = policy.layer(Quota::daily(100).plan("pro", 10_000));
    ///
    /// let acme = Subject::account("acme");
    /// let handle = policy.handle().for_caller(&acme).await.unwrap();
    /// assert_eq!(handle.plan(), Some("pro"));
    /// assert_eq!(handle.zone().and_then(|z| z.iana_name()), Some("Asia/Tokyo"));
    /// let usage = handle.usage(&acme).await.unwrap();
    /// assert_eq!(usage[0].limit(), 10_000);
    /// // A caller the application does not know:
    /// assert!(policy.handle().for_caller(&Subject::account("nobody")).await.is_err());
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`StandingError::UnknownCaller`] when `caller_info` answers that the
    /// application knows no such caller; [`StandingError::CallerInfo`] when
    /// it fails (logged at warn, with the subject's kind and hash) or gives
    /// a zone no key can name; [`StandingError::Plan`] when it gives a
    /// plan the policy refuses.
    pub async fn for_caller(&self, subject: &Subject) -> Result<Self, StandingError> {
        let info = self.caller_info(subject).await?;
        Self {
            zone: None,
            plan: None,
            ..self.clone()
        }
        .with_info(subject, info)
    }

    /// This handle in the zone and on the plan `info` gives for `subject`:
    /// a zone for a policy that reads callers' zones, a plan for one that
    /// reads plans; what it gives none of stays as this handle has it.
    pub(crate) fn with_info(
        &self,
        subject: &Subject,
        info: CallerInfo,
    ) -> Result<Self, StandingError> {
        let mut handle = self.clone();
        if let Some(zone) = info.zone.filter(|_| self.reads_caller_zones()) {
            if !crate::period::is_nameable(&zone) {
                tracing::warn!(
                    subject.kind = %subject.kind(),
                    subject.hash = %subject.log_hash(),
                    ?zone,
                    "the policy's caller info gives a zone no key can name"
                );
                return Err(StandingError::CallerInfo(
                    "the caller info gives a zone no key can name (neither of the IANA list nor \
                     a fixed offset)"
                        .into(),
                ));
            }
            handle.zone = Some(crate::period::under_primary_name(&zone));
        }
        // A policy that reads no plan charges every caller on the quotas'
        // own limits, whatever the info says.
        if let Some(plan) = info.plan.filter(|_| self.reads_plans()) {
            handle.plan = self.known_plan(Some(plan))?;
        }
        Ok(handle)
    }

    /// Whether the policy reads a plan per request
    /// ([`QuotaPolicyBuilder::plan`](crate::QuotaPolicyBuilder::plan)).
    pub(crate) fn reads_plans(&self) -> bool {
        self.settings().plan.is_some()
    }

    /// What the policy's [`caller_info`](crate::QuotaPolicyBuilder::caller_info)
    /// gives for `subject`: nothing without one.
    pub(crate) async fn caller_info(&self, subject: &Subject) -> Result<CallerInfo, StandingError> {
        let Some(info) = &self.settings().caller_info else {
            return Ok(CallerInfo::default());
        };
        match info(subject).await {
            Ok(Some(info)) => Ok(info),
            Ok(None) => Err(StandingError::UnknownCaller),
            Err(error) => {
                tracing::warn!(
                    subject.kind = %subject.kind(),
                    subject.hash = %subject.log_hash(),
                    %error,
                    "the policy's caller info failed: the caller's plan and zone are not known"
                );
                Err(StandingError::CallerInfo(error))
            }
        }
    }

    /// The caller's plan this handle reads [`usage`](Self::usage) on, from
    /// [`for_caller`](Self::for_caller); `None` for the quotas' own limits.
    pub fn plan(&self) -> Option<&str> {
        self.plan.as_deref()
    }

    /// The caller's own zone this handle counts calendar quotas in
    /// ([`in_zone`](Self::in_zone), [`for_caller`](Self::for_caller));
    /// `None` for the quotas' own zones.
    pub fn zone(&self) -> Option<&TimeZone> {
        self.zone.as_ref()
    }

    /// The quotas this handle sees: for a policy's handle, those of every
    /// layer built so far; in the handle's zone, if it has one.
    pub fn quotas(&self) -> Vec<Quota> {
        let quotas = match &self.only {
            Some(quotas) => quotas.to_vec(),
            None => self.shared.quotas(),
        };
        match &self.zone {
            Some(zone) => quotas.iter().map(|q| q.in_callers_zone(zone)).collect(),
            None => quotas,
        }
    }

    fn settings(&self) -> &Settings {
        self.shared.settings()
    }

    /// The subject the policy would charge a request with head `parts`, so a
    /// handler can look up its caller's standing without being charged.
    ///
    /// # Errors
    ///
    /// When the request names no usable subject.
    pub fn subject_of(&self, parts: &Parts) -> Result<Subject, SubjectError> {
        self.shared
            .extract(parts)?
            .checked(self.settings().max_subject_len)
    }

    /// The subject the policy charges a request naming `id` as its subject
    /// of kind `kind`: `id` as the extractor rewrites it
    /// ([`SubjectExtractor::subject_named`]; `ClientIp` groups an address
    /// into its network), checked as a request's subject is. What support
    /// tools look up, reset and refund.
    ///
    /// # Errors
    ///
    /// When no request could be charged as `id` (empty, too long, not an
    /// address for `ClientIp`), or as a subject of `kind` (the extractor
    /// tells its kinds, and `kind` is not one of them).
    pub fn subject(
        &self,
        kind: &SubjectKind,
        id: impl AsRef<[u8]>,
    ) -> Result<Subject, SubjectError> {
        if let Some(kinds) = self.subject_kinds() {
            if !kinds.contains(kind) {
                return Err(SubjectError::Malformed(
                    format!("the policy charges no subject of kind {kind}").into(),
                ));
            }
        }
        self.shared
            .subject_named(kind, id.as_ref())?
            .checked(self.settings().max_subject_len)
    }

    /// The plan the policy reads from a request with head `parts`, if any.
    pub fn plan_of(&self, parts: &Parts) -> Option<String> {
        self.settings().plan.as_ref().and_then(|plan| plan(parts))
    }

    /// The kinds of subject the policy's extractor answers, if it tells
    /// ([`SubjectExtractor::kinds`]).
    pub fn subject_kinds(&self) -> Option<Vec<SubjectKind>> {
        self.shared.kinds()
    }

    /// `plan` as the layers charge it: itself when a quota of the policy
    /// names it or it was declared; else no plan (the quotas' own limits),
    /// or an error when the policy refuses unknown plans
    /// ([`UnknownPlan::Reject`]).
    pub(crate) fn known_plan(&self, plan: Option<String>) -> Result<Option<String>, StandingError> {
        self.shared
            .plan_as_charged(plan)
            .map_err(StandingError::Plan)
    }

    fn lines(
        &self,
        quotas: &[Quota],
        subject: &Subject,
        at: Timestamp,
        plan: Option<&str>,
    ) -> Vec<ChargeLine> {
        let namespace = &self.settings().namespace;
        quotas
            .iter()
            // Not kept for requests: `at` may be anywhere in time (a
            // charge's instant given back, a caller's bogus one).
            .map(|q| q.line_not_kept(namespace, subject, at, q.limit_for(plan)))
            .collect()
    }
}

impl<St: Store> QuotaHandle<St> {
    /// Where the caller of a request with head `parts` stands on every
    /// quota, on its plan's limits, as the policy's layers would charge it:
    /// the subject and plan are read as the layers read them. Charges
    /// nothing. With the `axum` feature the error answers itself (401, 400,
    /// 403 for an unknown plan, or 503, as `application/problem+json`, with
    /// the layer's words).
    ///
    /// ```
    /// use axum::{extract::State, response::{IntoResponse, Response}, Json};
    /// use http::request::Parts;
    /// use tower_quota::QuotaHandle;
    ///
    /// async fn my_quota(State(handle): State<QuotaHandle>, parts: Parts) -> Response {
    ///     match handle.standing(&parts).await {
    ///         Ok(usage) => Json(usage.iter().map(|u| u.to_json()).collect::<Vec<_>>()).into_response(),
    ///         Err(error) => error.into_response(),
    ///     }
    /// }
    /// ```
    pub async fn standing(&self, parts: &Parts) -> Result<Vec<QuotaUsage>, StandingError> {
        let subject = self
            .subject_of(parts)
            .map_err(|error| StandingError::Subject {
                challenge: self.shared.challenge(),
                error,
            })?;
        let plan = self.known_plan(self.plan_of(parts))?;
        let zone = self.zone_of(parts).map_err(StandingError::Zone)?;
        // A request that names no zone counts in the quotas' own, whatever
        // zone this handle is in.
        let handle = match zone {
            Some(zone) => self.in_zone(zone),
            None => Self {
                zone: None,
                ..self.clone()
            },
        };
        handle
            .usage_on_plan(&subject, plan.as_deref())
            .await
            .map_err(StandingError::Store)
    }

    /// The caller's own time zone the policy reads from a request with head
    /// `parts`, if it reads one and the request names one.
    ///
    /// # Errors
    ///
    /// When the request names a zone that cannot be used (the layers answer
    /// 400).
    pub fn zone_of(&self, parts: &Parts) -> Result<Option<TimeZone>, InvalidRequest> {
        self.settings().caller_zone(parts)
    }

    /// Where `subject` stands on every quota now, against each quota's own
    /// limit, or the limits of the handle's [`plan`](Self::plan) (see
    /// [`for_caller`](Self::for_caller); [`usage_on_plan`](Self::usage_on_plan)
    /// names one). Charges nothing.
    pub async fn usage(&self, subject: &Subject) -> Result<Vec<QuotaUsage>, StoreError> {
        self.usage_on_plan(subject, self.plan.as_deref()).await
    }

    /// Where `subject` stands on every quota now, on `plan`'s limits.
    /// Charges nothing.
    pub async fn usage_on_plan(
        &self,
        subject: &Subject,
        plan: Option<&str>,
    ) -> Result<Vec<QuotaUsage>, StoreError> {
        let quotas = self.quotas();
        let now = self.settings().clock.now();
        let lines = self.lines(&quotas, subject, now, plan);
        let keys: Vec<_> = lines.iter().map(|l| l.key.clone()).collect();
        let usage = self
            .shared
            .store()
            .peek(ChargeRequest {
                charged_at: None,
                now,
                lines: lines.into(),
            })
            .await?;
        Ok(quotas
            .into_iter()
            .zip(keys)
            .zip(usage)
            .map(|((quota, key), usage)| QuotaUsage::new(quota, key, usage))
            .collect())
    }

    /// Gives `amount` back to `subject` on every quota's current counter,
    /// whenever it was made: a support gesture. Creates nothing and moves no
    /// deadline. To undo a request's own charge (it failed on the server's
    /// side), use [`QuotaHandle::refund_request`], which gives back what was
    /// charged on the very counters charged.
    pub async fn refund(
        &self,
        subject: &Subject,
        amount: u64,
    ) -> Result<Vec<Option<u64>>, StoreError> {
        let quotas = self.quotas();
        let now = self.settings().clock.now();
        self.refund_quotas(&quotas, subject, now, None, amount)
            .await
    }

    /// The instant this handle's policy charged the request whose status is
    /// `status`: what [`QuotaHandle::refund_at`] takes to undo it later.
    /// Each policy on a route charges at its own instant (a policy further
    /// in, behind an authentication call, may charge the next period), so
    /// with several policies this is the one of the policy whose counters
    /// the refund goes to, where [`QuotaStatus::charged_at`] is the first
    /// policy's. `None` when this policy did not count the request.
    pub fn charged_at(&self, status: &QuotaStatus) -> Option<Timestamp> {
        status
            .ticket(self.shared.id())
            .filter(|ticket| ticket.counted())
            .map(|ticket| ticket.now)
    }

    /// Gives `amount` back to `subject` on the counters of the periods that
    /// were open at `charged_at`, the instant of the charge being undone, so a
    /// refund made after a boundary never credits the next period. The
    /// counters are those of the handle's zone: for a caller counted in
    /// a zone of its own ([`QuotaPolicyBuilder::time_zone`](crate::QuotaPolicyBuilder::time_zone)),
    /// a handle [`in_zone`](Self::in_zone) of the caller's zone. To undo a
    /// request the handler holds, [`QuotaHandle::refund_request`] needs
    /// neither the instant nor the zone.
    ///
    /// Returns, per quota, what the counter holds afterwards, or `None` when
    /// nothing was refunded: that period has ended (calendar), or the
    /// counter was made more than a second after `charged_at` (the
    /// subject's first-use period started later, or support reset the
    /// counter and a later charge made it anew), by
    /// [`Store::refund_made_by`]: a support refund never closes a period,
    /// even one it empties, and from then on no give-back of a request
    /// closes that period either (see [`Store::refund_made_at`]). The
    /// second tolerates a
    /// counter that a request stamped a moment later made first (requests
    /// at once, instances' clocks apart), which the request being undone
    /// was charged to; by the same second, a first-use period opened
    /// within it after the charge's own ended (or after a reset) takes the
    /// refund, which an instant cannot tell apart.
    /// [`QuotaHandle::refund_request`], which knows the counters charged,
    /// never gives back to another.
    ///
    /// # Errors
    ///
    /// When the store fails, with a [`LeasedStore`](crate::LeasedStore) too
    /// (a support refund goes to its store, never into a block). Nothing is
    /// sent again: call again once the store is back.
    pub async fn refund_at(
        &self,
        subject: &Subject,
        charged_at: Timestamp,
        amount: u64,
    ) -> Result<Vec<Option<u64>>, StoreError> {
        let quotas = self.quotas();
        // No period of a charge centuries away from now is open: nothing
        // to refund (and no window to compute near the end of time).
        let now = self.settings().clock.now();
        if charged_at.duration_since(now).abs() > SignedDuration::from_hours(100 * 366 * 24) {
            return Ok(vec![None; quotas.len()]);
        }
        let made_by = charged_at
            .saturating_add(MADE_BY_SLACK)
            .unwrap_or(charged_at);
        self.refund_quotas(&quotas, subject, charged_at, Some(made_by), amount)
            .await
    }

    /// Gives back what the handle's quotas charged the request of `status`:
    /// each line's cost, on the very counter charged (the caller's zone,
    /// plan and allowances, as the layers counted them), only while that
    /// counter is the one charged (a calendar window not over, a counter
    /// not made anew since, as [`refund_at`](Self::refund_at)). What a
    /// handler calls to undo the request it serves when it fails on its
    /// side:
    ///
    /// ```
    /// use axum::{extract::State, http::StatusCode, routing::post, Router};
    /// use tower_quota::{FromHeader, QuotaHandle, QuotaLayer, QuotaStatus};
    ///
    /// async fn send(State(quota): State<QuotaHandle>, status: QuotaStatus) -> StatusCode {
    ///     let delivered = false; // the upstream failed
    ///     if !delivered {
    ///         let _ = quota.refund_request(&status).await;
    ///     }
    ///     StatusCode::ACCEPTED
    /// }
    ///
    /// let layer = QuotaLayer::daily(1_000, FromHeader::account("x-account-id"));
    /// let app: Router = Router::new()
    ///     .route("/send", post(send))
    ///     .with_state(layer.handle())
    ///     .layer(layer);
    /// ```
    ///
    /// Once per line: a line given back already (by an earlier call, or by
    /// the layer, for a response it refunds) is not given back again, nor
    /// does the layer give it back later, or add a deferred cost to it. A
    /// call made once the response went out through the layer (from a task
    /// the handler spawned, or a body that fails while it streams) gives
    /// back what the request holds then: its cost, with a deferred cost's
    /// add or refund if the layer made it already.
    /// Returns, per line of the handle's quotas that charged the request
    /// (a layer's handle: that layer's quotas; a policy's: every layer's,
    /// outer layers first), what the counter holds afterwards, or `None`
    /// when nothing was given back. A request that owes its charge (it
    /// passed on a failed charge under
    /// [`OnStoreError::FailOpen`](crate::OnStoreError::FailOpen)) has no
    /// line: its debt is counted as served.
    ///
    /// The refunds are sent in a task of their own on a tokio runtime, so
    /// that a handler dropped while the store answers (a client gone)
    /// gives back all the same.
    ///
    /// # Errors
    ///
    /// When the store fails. A refund that never reached it (the store was
    /// away) is sent again in the background, within its counter's period,
    /// and counts as given back meanwhile: no later call or layer gives the
    /// line back twice. (Without a tokio runtime it is not sent again, and
    /// a later call, or the layer, gives it back.) One that may have landed
    /// (a timeout) counts as given back.
    pub async fn refund_request(
        &self,
        status: &crate::QuotaStatus,
    ) -> Result<Vec<Option<u64>>, StoreError>
    where
        St: Store,
    {
        let Some(ticket) = status.ticket(self.shared.id()) else {
            return Ok(Vec::new());
        };
        let names: Option<Vec<&str>> = self
            .only
            .as_ref()
            .map(|only| only.iter().map(Quota::name).collect());
        let now = self.settings().clock.now();
        let started = tokio::time::Instant::now();
        // Claimed here: from now on no layer gives these lines back.
        let mut claimed = Vec::new();
        for lines in &ticket.charges {
            for (i, (quota, line)) in lines.with_quotas().enumerate() {
                if names
                    .as_ref()
                    .is_some_and(|names| !names.contains(&quota.name()))
                {
                    continue;
                }
                // What the request holds: its cost, with what the layer
                // changed of it after the response (a deferred cost).
                // Less what of a deferred cost's add has not landed: one
                // on its way goes back once it lands (see `apply`).
                let held = if line.is_live(now) && line.held() > 0 {
                    line.claim_request()
                } else {
                    None
                };
                claimed.push(held.map(|(held, amount)| {
                    (
                        Arc::clone(lines),
                        i,
                        held,
                        amount,
                        line.charged_counter(ticket.now),
                    )
                }));
            }
        }
        if claimed.iter().all(Option::is_none) {
            return Ok(vec![None; claimed.len()]);
        }
        let store = self.shared.store().clone();
        let work = async move {
            let mut refunded = Vec::with_capacity(claimed.len());
            let mut failed = None;
            for claim in claimed {
                let Some((lines, i, held, amount, made)) = claim else {
                    refunded.push(None);
                    continue;
                };
                let line = &lines[i];
                match made.refund(&store, now, line.key.clone(), amount).await {
                    Ok(count) => refunded.push(count),
                    Err(error) => {
                        if error.is_unsent() {
                            resend_later(&store, started, now, &lines, i, (held, amount), made);
                        }
                        refunded.push(None);
                        failed.get_or_insert(error);
                    }
                }
            }
            match failed {
                Some(error) => Err(error),
                None => Ok(refunded),
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => runtime.spawn(work).await.unwrap_or_else(|_| {
                Err(StoreError::new(
                    crate::store::StoreErrorKind::Other,
                    "the quota store panicked while giving a request back",
                ))
            }),
            Err(_) => work.await,
        }
    }

    /// Refunds `amount` on the counters of `quotas` for `subject` in the
    /// periods open at `at`; only to counters made by `made_by`, if given.
    async fn refund_quotas(
        &self,
        quotas: &[Quota],
        subject: &Subject,
        at: Timestamp,
        made_by: Option<Timestamp>,
        amount: u64,
    ) -> Result<Vec<Option<u64>>, StoreError> {
        let now = self.settings().clock.now();
        let store = self.shared.store();
        let mut refunded = Vec::with_capacity(quotas.len());
        for line in self.lines(quotas, subject, at, None) {
            refunded.push(match made_by {
                Some(made_by) => store.refund_made_by(now, line.key, amount, made_by).await?,
                None => store.refund(now, line.key, amount).await?,
            });
        }
        Ok(refunded)
    }

    /// Gives `subject` a fresh allowance on every quota: the current counters
    /// are deleted (a first-use period restarts at the next call), and so is
    /// what this instance's fail-open ledgers owe them (requests made before
    /// the reset, uncounted yet: the policy's, and those of the other
    /// policies on the same store, which may share the quota), unless the
    /// store never got the reset (an error that [was never
    /// sent](StoreError::is_unsent): the debts are settled as before).
    /// Another instance's ledger settles what it owes into the fresh
    /// counters.
    pub async fn reset(&self, subject: &Subject) -> Result<(), StoreError> {
        let quotas = self.quotas();
        self.reset_quotas(&quotas, subject).await.map(drop)
    }

    /// Gives `subject` a fresh allowance on every quota of `allowance` (e.g.
    /// `read`), leaving its other allowances as they are. Returns how many
    /// quotas the allowance has: zero means no quota charges it.
    pub async fn reset_allowance(
        &self,
        subject: &Subject,
        allowance: &str,
    ) -> Result<usize, StoreError> {
        let quotas = self.quotas_of(allowance);
        self.reset_quotas(&quotas, subject).await?;
        Ok(quotas.len())
    }

    /// Gives `amount` back to `subject` on the current counters of
    /// `allowance`'s quotas. Returns, per quota, what the counter holds
    /// afterwards (`None`: no live counter, nothing refunded).
    pub async fn refund_allowance(
        &self,
        subject: &Subject,
        allowance: &str,
        amount: u64,
    ) -> Result<Vec<Option<u64>>, StoreError> {
        let quotas = self.quotas_of(allowance);
        let now = self.settings().clock.now();
        // The current counters, whoever made them and when.
        self.refund_quotas(&quotas, subject, now, None, amount)
            .await
    }

    fn quotas_of(&self, allowance: &str) -> Vec<Quota> {
        self.quotas()
            .into_iter()
            .filter(|q| q.allowance_tag() == allowance)
            .collect()
    }

    async fn reset_quotas(&self, quotas: &[Quota], subject: &Subject) -> Result<(), StoreError> {
        let now = self.settings().clock.now();
        for line in self.lines(quotas, subject, now, None) {
            // What requests of before the reset owe (they passed on a failed
            // charge) goes with their counter, not into the fresh one: no
            // settle of it starts while the reset is on its way, and once
            // the reset may have reached the store it is forgotten (a
            // settle on its way then lands, before or after the reset, as
            // the store runs them). A reset the store never sent (it is
            // away) forgets nothing: the debts are settled as before.
            // The reset's instant is when it is sent: a request made after
            // it, while it is on its way, may be charged after it in the
            // store, and what it owes is not forgotten.
            let at = self.settings().clock.now();
            let _held = self.shared.hold_owed(&line.key, at);
            // Dropped after the hold: it forgets while no settle can start,
            // also when the reset's future is dropped on its way.
            let mut forget = ForgetOwed {
                shared: &*self.shared,
                key: &line.key,
                at,
                armed: true,
            };
            if let Err(error) = self.shared.store().reset(line.key.clone()).await {
                forget.armed = !error.is_unsent();
                return Err(error);
            }
        }
        Ok(())
    }
}

/// Forgets what the policy's ledger owes the counter at `key` when dropped,
/// unless disarmed: the reset of the counter may have reached the store.
struct ForgetOwed<'a, St> {
    shared: &'a dyn PolicyView<St>,
    key: &'a crate::key::PeriodKey,
    /// When the reset was sent.
    at: Timestamp,
    armed: bool,
}

impl<St> Drop for ForgetOwed<'_, St> {
    fn drop(&mut self) {
        if self.armed {
            self.shared.forget_owed(self.key, self.at);
        }
    }
}

/// Give-backs that never reached the store, logged a few times per second
/// at most.
static GIVE_BACK_ERRORS: crate::throttle::Throttle = crate::throttle::Throttle::new(5);

/// Sends line `i` of `lines`' refund again in the background, after the
/// store answered that it never sent it (first sent at `now`, `started` on
/// the runtime's clock): within the counter's period, and with the line
/// still claimed, so that no layer gives it back twice meanwhile (a
/// request dropped, a 5xx). When it cannot be sent again (no time left, no
/// tokio runtime, too many changes waiting), the claim is released at once
/// for a later give-back.
fn resend_later<St: Store>(
    store: &St,
    started: tokio::time::Instant,
    now: Timestamp,
    lines: &Arc<crate::status::Lines>,
    i: usize,
    (held, amount): (u64, u64),
    made: crate::store::Made,
) {
    let resend = crate::store::resend::Resend::until(started, now, lines[i].usage.resets_at);
    let (Some(resend), Ok(runtime)) = (resend, tokio::runtime::Handle::try_current()) else {
        lines[i].unclaim_request(held);
        return;
    };
    let (store, lines) = (store.clone(), Arc::clone(lines));
    runtime.spawn(async move {
        let line = &lines[i];
        let resent = resend
            .send(|| made.refund(&store, now, line.key.clone(), amount))
            .await;
        match resent {
            Some(Ok(_)) => {}
            Some(Err(error)) => {
                if let Some(suppressed) = GIVE_BACK_ERRORS.admit() {
                    tracing::warn!(
                        error = crate::key::scrubbed(&error.to_string()),
                        suppressed,
                        "a request's give-back never reached the quota store: it stays charged"
                    );
                }
            }
            // Not sent again: the period ends before a try would.
            None => line.unclaim_request(held),
        }
    });
}

impl<St> Clone for QuotaHandle<St> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
            only: self.only.clone(),
            zone: self.zone.clone(),
            plan: self.plan.clone(),
        }
    }
}

impl<St: fmt::Debug> fmt::Debug for QuotaHandle<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaHandle")
            .field("quotas", &self.quotas())
            .field("store", self.shared.store())
            .finish_non_exhaustive()
    }
}

/// Why [`QuotaHandle::standing`] or [`QuotaHandle::for_caller`] could not tell
/// where a caller stands.
#[derive(Debug)]
pub enum StandingError {
    /// The request names no usable subject; its answer (401 for a missing
    /// one) carries the policy's `challenge` in `WWW-Authenticate`.
    Subject {
        /// Why no subject could be read.
        error: SubjectError,
        /// The policy's challenge
        /// ([`QuotaPolicyBuilder::challenge`](crate::QuotaPolicyBuilder::challenge)).
        challenge: Option<http::HeaderValue>,
    },
    /// The request names a time zone that cannot be used.
    Zone(InvalidRequest),
    /// The request names a plan no quota has, and the policy refuses
    /// unknown plans (the layers answer 403).
    Plan(String),
    /// The store failed.
    Store(StoreError),
    /// The policy's [`caller_info`](crate::QuotaPolicyBuilder::caller_info)
    /// answers that the application knows no such caller
    /// ([`QuotaHandle::for_caller`]).
    UnknownCaller,
    /// The policy's [`caller_info`](crate::QuotaPolicyBuilder::caller_info)
    /// failed, or gave a zone no key can name
    /// ([`QuotaHandle::for_caller`]).
    CallerInfo(Box<dyn std::error::Error + Send + Sync>),
}

impl fmt::Display for StandingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Subject { error, .. } => error.fmt(f),
            Self::Zone(error) => error.fmt(f),
            // As the layer says it.
            Self::Plan(plan) => write!(
                f,
                "The plan {:?} has no quota here.",
                crate::response::echo(plan)
            ),
            Self::Store(error) => write!(f, "the quota store failed: {error}"),
            Self::UnknownCaller => f.write_str("the application knows no such caller"),
            Self::CallerInfo(error) => {
                write!(f, "the caller's plan and zone could not be read: {error}")
            }
        }
    }
}

impl std::error::Error for StandingError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Subject { error, .. } => Some(error),
            Self::Zone(error) => Some(error),
            Self::Plan(_) => None,
            Self::Store(error) => Some(error),
            Self::UnknownCaller => None,
            Self::CallerInfo(error) => Some(&**error),
        }
    }
}
