use std::fmt;
use std::mem;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::task::{Context, Poll};

use http::request::Parts;
use http::{Request, Response, StatusCode};
use tower_service::Service;

use crate::body::ResponseBody;
use crate::config::{Costs, Layout, Scope, Settings, Shared, SubjectPolicy, UnknownPlan};
use crate::future::{Admission, ResponseFuture};
use crate::probe;
use crate::response;
use crate::status::{QuotaStatus, Ticket};
use crate::store::{ChargeRequest, Store};
use crate::subject::{Subject, SubjectError, SubjectExtractor};

/// The service of a [`QuotaLayer`](crate::QuotaLayer): charges each request
/// before calling the inner service.
pub struct QuotaService<S, E, St> {
    inner: S,
    // One reference count for the whole service: routers clone their
    // services for every request, on every worker thread.
    bound: Arc<Bound<E, St>>,
}

/// A service's policy and what it charges, shared by its clones.
pub(crate) struct Bound<E, St> {
    pub(crate) shared: Arc<Shared<E, St>>,
    pub(crate) charges: Charges,
}

/// What one service charges: its own layer's scope and the scopes of the
/// layers of its policy it found inside the service it wraps.
pub(crate) struct Charges {
    own: Arc<Scope>,
    /// Charged when this is the first layer of the policy on the request.
    full: Arc<Layout>,
    /// Charged when an outer layer of the policy could not see this one.
    alone: Arc<Layout>,
}

impl Charges {
    /// # Panics
    ///
    /// When two quotas of the scopes would count on one counter: a request
    /// passing these layers would be charged twice on it.
    pub(crate) fn new(own: Arc<Scope>, found: probe::Found, settings: &Settings) -> Self {
        let mut scopes = vec![Arc::clone(&own)];
        scopes.extend(found.scopes.into_iter().filter(|s| s.id != own.id));
        // An unrouted answer inside means charges to give back.
        let unrouted = found.unrouted;
        Self {
            full: Arc::new(Layout::new(scopes, settings, unrouted)),
            alone: Arc::new(Layout::new(vec![Arc::clone(&own)], settings, unrouted)),
            own,
        }
    }
}

impl<S, E, St> QuotaService<S, E, St> {
    pub(crate) fn new(inner: S, bound: Arc<Bound<E, St>>) -> Self {
        Self { inner, bound }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped service, by value.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, E, St> Clone for QuotaService<S, E, St> {
    fn clone(&self) -> Self {
        // An outer layer of the policy being built looks for this one.
        probe::announce_scope(self.bound.shared.id, &self.bound.charges.own);
        Self {
            inner: self.inner.clone(),
            bound: Arc::clone(&self.bound),
        }
    }
}

impl<S: fmt::Debug, E, St: fmt::Debug> fmt::Debug for QuotaService<S, E, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaService")
            .field("inner", &self.inner)
            .field("quotas", &self.bound.charges.full.quotas)
            .field("store", &self.bound.shared.store)
            .finish_non_exhaustive()
    }
}

impl<S, E, St, ReqBody, ResBody> Service<Request<ReqBody>> for QuotaService<S, E, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    E: SubjectExtractor,
    St: Store,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, St, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    /// The request path: a decision made further out → exemptions → the
    /// subject → its plan → the lines of every quota that applies → one
    /// charge, decided on and answered by the future.
    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let (parts, body) = request.into_parts();
        let bound = &*self.bound;
        let shared = &*bound.shared;
        let settings = &shared.settings;
        let charges = &bound.charges;
        let now = settings.clock.now();

        let outer = parts
            .extensions
            .get::<QuotaStatus>()
            .filter(|status| status.ticket().policy == shared.id)
            .cloned();
        match &outer {
            Some(status) if status.is_exempt() || status.ticket().reach(charges.own.id) => {
                return ResponseFuture::passing(self.call_inner(parts, body));
            }
            Some(status) if charges.own.quotas.iter().all(|q| status.ticket().counts(q)) => {
                // Hidden, but the layer around already charged the same
                // counters: they count once.
                return ResponseFuture::passing(self.call_inner(parts, body));
            }
            Some(_) => tracing::debug!(
                quotas = ?charges.own.quotas,
                "a quota layer hidden from the layer around it charges on its own"
            ),
            None if settings.skips(&parts) => {
                return self.pass_uncounted(parts, body, now);
            }
            None => {}
        }

        let subject = match extract(&shared.extractor, &parts, settings.max_subject_len) {
            Ok(subject) => subject,
            Err(error) => {
                let (policy, default_status) = match &error {
                    SubjectError::Missing => (settings.on_missing, StatusCode::UNAUTHORIZED),
                    SubjectError::Malformed(_) => (settings.on_malformed, StatusCode::BAD_REQUEST),
                };
                return match policy {
                    SubjectPolicy::Allow => {
                        tracing::trace!(%error, "request without a usable subject passes uncharged");
                        self.pass_uncounted(parts, body, now)
                    }
                    SubjectPolicy::Reject(status) => {
                        let status = if status.is_client_error() || status.is_server_error() {
                            status
                        } else {
                            default_status
                        };
                        tracing::debug!(%error, %status, "request rejected: no usable subject");
                        ResponseFuture::rejected(response::early(
                            status,
                            &error.to_string(),
                            &parts,
                        ))
                    }
                };
            }
        };

        let plan = match settings.plan.as_ref().and_then(|plan| plan(&parts)) {
            Some(plan) if !shared.knows_plan(&plan) => match settings.unknown_plan {
                UnknownPlan::DefaultLimits => None,
                UnknownPlan::Reject => {
                    tracing::debug!(plan, "request rejected: unknown plan");
                    return ResponseFuture::rejected(response::early(
                        StatusCode::FORBIDDEN,
                        &format!("The plan {plan:?} has no quota here."),
                        &parts,
                    ));
                }
            },
            plan => plan,
        };

        let hidden_layout;
        let layout = match &outer {
            Some(status) if charges.own.quotas.iter().any(|q| status.ticket().counts(q)) => {
                // Hidden, and partly charged already: the rest only.
                let own = &charges.own;
                let rest = own
                    .quotas
                    .iter()
                    .filter(|q| !status.ticket().counts(q))
                    .cloned()
                    .collect::<Vec<_>>();
                let scope = Scope {
                    id: own.id,
                    quotas: rest.into(),
                    cost: own.cost.clone(),
                    deferred: own.deferred.clone(),
                };
                hidden_layout = Arc::new(Layout::new(vec![Arc::new(scope)], settings, false));
                &hidden_layout
            }
            Some(_) => &charges.alone,
            None => &charges.full,
        };
        let costs = match Costs::of(&layout.scopes, &parts) {
            Ok(costs) => costs,
            Err(error) => {
                tracing::debug!(%error, "request rejected: invalid cost");
                return ResponseFuture::rejected(response::early(
                    StatusCode::BAD_REQUEST,
                    &error.0,
                    &parts,
                ));
            }
        };
        let mut limits = Vec::new();
        let lines = layout
            .quotas
            .iter()
            .zip(&layout.line_scope)
            .map(|(quota, &scope)| {
                let mut limit = quota.limit_for(plan.as_deref());
                if layout.shadows {
                    limits.push(limit);
                    if quota.is_shadow() {
                        // Counted, never refusing: the real limit is
                        // reported, not enforced.
                        limit = u64::MAX;
                    }
                }
                quota.line_with_limit(&settings.namespace, &subject, now, costs.get(scope), limit)
            })
            .collect();
        let subject_hash = if layout.spreads {
            subject_hash(&subject)
        } else {
            0
        };
        // Nothing to format when no one listens.
        let span = if tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug_span!(
                "quota",
                subject.kind = %subject.kind(),
                subject.hash = %short_hash(&subject),
                allowance = %Allowances(&layout.quotas),
                anchor = %Anchors(&layout.quotas),
                outcome = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
        let charge = ChargeRequest { now, lines };
        // Whether the charge can change once the store has answered (and
        // so needs the store again): after the response, or a hidden outer
        // layer's charge given back.
        let adjustable = layout.adjustable || outer.is_some();
        let admission = Admission {
            store: shared.store.clone(),
            adjustable,
            span,
            status: QuotaStatus::new(Ticket {
                policy: shared.id,
                layout: Some(Arc::clone(layout)),
                costs,
                outer,
                subject: Some(subject),
                usage: Vec::new(),
                subject_hash,
                limits,
                entries: std::sync::OnceLock::new(),
                // The charging layer is where the request is.
                reached: AtomicU64::new(1),
                refunded: AtomicBool::new(false),
                charged_at: now,
            }),
        };

        let request = Request::from_parts(parts, body);
        ResponseFuture::charging(charge, self.take_ready(), request, admission)
    }
}

impl<S: Clone, E, St> QuotaService<S, E, St> {
    /// The instance that `poll_ready` readied; a clone stays for the next
    /// request.
    fn take_ready(&mut self) -> S {
        let clone = self.inner.clone();
        mem::replace(&mut self.inner, clone)
    }

    fn call_inner<ReqBody>(&mut self, parts: Parts, body: ReqBody) -> S::Future
    where
        S: Service<Request<ReqBody>>,
    {
        self.inner.call(Request::from_parts(parts, body))
    }

    /// Lets a request through every layer of the policy without counting it.
    fn pass_uncounted<ReqBody, ResBody>(
        &mut self,
        mut parts: Parts,
        body: ReqBody,
        now: jiff::Timestamp,
    ) -> ResponseFuture<S, St, ReqBody>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>>,
        St: Store,
    {
        crate::metrics::skipped(&self.bound.charges.full.quotas);
        if tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug_span!(
                "quota",
                allowance = %Allowances(&self.bound.charges.own.quotas),
                outcome = "skipped",
            )
            .in_scope(|| tracing::trace!("request passes uncounted"));
        }
        parts
            .extensions
            .insert(QuotaStatus::exempt(self.bound.shared.id, now));
        ResponseFuture::passing(self.call_inner(parts, body))
    }
}

/// A short hash of `subject` for logs: ids can be API keys, so the hash is
/// keyed with a secret drawn when the process starts, and cut to 32 bits.
fn short_hash(subject: &Subject) -> impl std::fmt::Display {
    use std::hash::BuildHasher;
    static KEY: std::sync::OnceLock<foldhash::fast::RandomState> = std::sync::OnceLock::new();
    let hash = KEY.get_or_init(Default::default).hash_one(subject);
    format!("{:08x}", hash >> 32)
}

/// The allowances of `quotas`, comma-separated, for logs.
struct Allowances<'a>(&'a [crate::quota::Quota]);

impl std::fmt::Display for Allowances<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, quota) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(quota.allowance_tag())?;
        }
        Ok(())
    }
}

/// The anchors of `quotas`, comma-separated, for logs.
struct Anchors<'a>(&'a [crate::quota::Quota]);

impl std::fmt::Display for Anchors<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, quota) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(quota.anchor().as_str())?;
        }
        Ok(())
    }
}

/// A hash of `subject` that every instance computes alike: it spreads the
/// resets told to subjects.
fn subject_hash(subject: &Subject) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0x0071_756f_7461).hash_one(subject)
}

fn extract<E: SubjectExtractor>(
    extractor: &E,
    parts: &Parts,
    max_len: usize,
) -> Result<Subject, SubjectError> {
    let subject = extractor.extract(parts)?;
    let id = subject.id();
    if id.is_empty() || id.iter().all(u8::is_ascii_whitespace) {
        Err(SubjectError::malformed("the subject id is empty"))
    } else if id.len() > max_len {
        Err(SubjectError::Malformed(
            format!("the subject id is longer than {max_len} bytes").into(),
        ))
    } else {
        Ok(subject)
    }
}
