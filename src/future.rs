use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use jiff::Timestamp;
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use crate::body::ResponseBody;
use crate::config::{Costs, Layout};
use crate::decision::{decide, Answer, Decision};
use crate::key::PeriodKey;
use crate::response::{PolicyCache, RateLimitFields};
use crate::status::{QuotaStatus, Ticket};
use crate::store::{ChargeRequest, Store, StoreError, StoreErrorKind, Usage};
use crate::throttle::Throttle;

type Adjusting = Pin<Box<dyn Future<Output = Vec<Option<u64>>> + Send>>;

pin_project! {
    /// The response future of [`QuotaService`](crate::QuotaService).
    pub struct ResponseFuture<S, St, ReqBody>
    where
        S: Service<Request<ReqBody>>,
        St: Store,
    {
        #[pin]
        state: State<S, St, ReqBody>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, St, ReqBody>
    where
        S: Service<Request<ReqBody>>,
        St: Store,
    {
        // Waiting for the store's answer to the charge. The charge is sent
        // when the future is first polled (`start` holds it until then), so
        // a response future dropped before it ran spends nothing.
        Charging {
            start: Option<ChargeRequest>,
            #[pin]
            charge: Option<St::ChargeFuture>,
            #[pin]
            timeout: Option<Sleep>,
            pending: Option<Pending<S, St, ReqBody>>,
            timer: crate::metrics::ChargeTimer,
        },
        // Admitted (or passing uncounted when `after` is `None`): the inner
        // service answers.
        Calling {
            #[pin]
            future: S::Future,
            after: Option<After<St>>,
        },
        // The response changes the charge (a refund, a deferred cost): the
        // store applies it before the fields are written.
        Settling {
            adjust: Adjusting,
            result: Option<Result<S::Response, S::Error>>,
            after: Option<After<St>>,
        },
        // Refused here after a hidden outer layer charged: its charge is
        // given back first.
        Refunding {
            adjust: Adjusting,
            response: Option<Response<Bytes>>,
        },
        Rejected {
            response: Option<Response<Bytes>>,
        },
    }
}

/// What a charging request needs once the store has answered.
pub(crate) struct Pending<S, St, ReqBody> {
    inner: S,
    request: Request<ReqBody>,
    admission: Admission<St>,
}

/// One request's charge: its ticket (the status the request will carry,
/// still held by this charge alone) and the settings that decide what
/// follows the store's answer.
pub(crate) struct Admission<St> {
    /// The store charged, and changed after its answer when that can
    /// happen.
    pub(crate) store: St,
    /// Whether the charge can change after the store's answer (refunds of
    /// server errors, deferred costs, inner layers that may not be reached,
    /// a hidden outer layer's charge given back).
    pub(crate) adjustable: bool,
    pub(crate) status: QuotaStatus,
    /// The decision's span (disabled unless debug logs of the crate are
    /// on): subject kind and hash, allowances, anchors, outcome.
    pub(crate) span: tracing::Span,
}

/// An admitted request: its charge, for the response path.
pub(crate) struct After<St> {
    admission: Admission<St>,
    /// What the counters hold once the response changed the charge.
    settled: Option<Vec<Usage>>,
    /// The adjustments the store is applying.
    pending: Vec<(usize, Adjust)>,
}

/// A change of a charged line once the response is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Adjust {
    Refund(u64),
    Add(u64),
}

impl<St: Store> Admission<St> {
    fn layout(&self) -> &Layout {
        self.status
            .ticket()
            .layout
            .as_deref()
            .expect("a charge has a layout")
    }

    /// The ticket once admitted with `usage`.
    fn admit(&mut self, usage: Vec<Usage>) {
        let ticket = self
            .status
            .ticket_mut()
            .expect("the request does not carry its status before it is admitted");
        ticket.usage = usage;
    }

    /// Gives back what a hidden outer layer charged, when this layer refuses
    /// the request.
    fn refund_outer(&self) -> Option<Adjusting> {
        let outer = self.status.ticket().outer.as_ref()?.ticket();
        // Every layer further out gave its lines to this one ticket: none of
        // them may change them again.
        let mut chain = Some(outer);
        let mut already = false;
        while let Some(ticket) = chain {
            already |= ticket.refunded.swap(true, Ordering::Relaxed);
            chain = ticket.outer.as_ref().map(QuotaStatus::ticket);
        }
        if already {
            return None;
        }
        if !self.adjustable {
            return None;
        }
        let now = self.layout().clock.now();
        let ops = (0..outer.lines())
            .filter(|i| outer.line_live(*i, now))
            .map(|i| (outer.key(i), Adjust::Refund(outer.line_cost(i))))
            .collect();
        Some(settle(self.store.clone(), now, ops))
    }

    /// When the store refused the charge only for quotas of inner layers,
    /// which this request may never reach: charges this layer's own quotas
    /// alone; the inner layers then decide for themselves if the request
    /// reaches them (and give this charge back if they refuse).
    fn alone(&self, usage: &[Usage]) -> Option<(Self, ChargeRequest)> {
        let ticket = self.status.ticket();
        let layout = ticket.layout.as_deref()?;
        let subject = ticket.subject.clone()?;
        if !self.adjustable {
            return None;
        }
        let alone = layout.alone();
        let own_lines = alone.quotas.len();
        let cost = ticket.costs.get(0);
        let lines = alone
            .quotas
            .iter()
            .zip(usage)
            .map(|(quota, usage)| {
                let limit = if quota.is_shadow() {
                    u64::MAX
                } else {
                    usage.limit
                };
                quota.line_with_limit(&alone.namespace, &subject, ticket.charged_at, cost, limit)
            })
            .collect();
        let request = ChargeRequest {
            now: ticket.charged_at,
            lines,
        };
        let status = QuotaStatus::new(Ticket {
            policy: ticket.policy,
            layout: Some(Arc::new(alone)),
            costs: Costs::one(cost),
            outer: ticket.outer.clone(),
            subject: Some(subject),
            usage: Vec::new(),
            subject_hash: ticket.subject_hash,
            limits: ticket.limits.iter().take(own_lines).copied().collect(),
            entries: OnceLock::new(),
            reached: AtomicU64::new(1),
            refunded: AtomicBool::new(false),
            charged_at: ticket.charged_at,
        });
        let admission = Self {
            store: self.store.clone(),
            adjustable: true,
            status,
            span: self.span.clone(),
        };
        Some((admission, request))
    }
}

impl<St: Store> After<St> {
    /// How the response changes the charge: refunds for layers the request
    /// never reached and, when the rule is on, for a server error; the
    /// difference to a deferred cost otherwise. Indices are the ticket's
    /// entries.
    fn adjustments(
        &self,
        failed: bool,
        response: Option<&http::response::Parts>,
    ) -> Vec<(usize, Adjust)> {
        let ticket = self.admission.status.ticket();
        if ticket.refunded.load(Ordering::Relaxed) {
            return Vec::new();
        }
        let layout = self.admission.layout();
        let offset = ticket.outer_lines();
        let refund_all = unrouted(response) || (failed && layout.refund_server_errors);
        let mut ops = Vec::new();
        for (line, &scope) in layout.line_scope.iter().enumerate() {
            let cost = ticket.costs.get(scope);
            let unreached = scope != 0 && !ticket.reached(scope);
            if unreached || refund_all {
                if cost > 0 {
                    ops.push((offset + line, Adjust::Refund(cost)));
                }
                continue;
            }
            let (Some(response), Some(deferred)) = (response, &layout.scopes[scope].deferred)
            else {
                continue;
            };
            let real = (deferred.0)(response);
            match real.cmp(&cost) {
                std::cmp::Ordering::Greater => ops.push((offset + line, Adjust::Add(real - cost))),
                std::cmp::Ordering::Less => ops.push((offset + line, Adjust::Refund(cost - real))),
                std::cmp::Ordering::Equal => {}
            }
        }
        ops
    }

    fn settle(&mut self, ops: Vec<(usize, Adjust)>) -> Adjusting {
        let ticket = self.admission.status.ticket();
        debug_assert!(self.admission.adjustable, "only a charge that can change");
        let now = self.admission.layout().clock.now();
        // A first-use counter whose period ended since is not the one that
        // was charged any more, even if a new one has the same key.
        let ops: Vec<(usize, Adjust)> = ops
            .into_iter()
            .filter(|(i, _)| ticket.line_live(*i, now))
            .collect();
        let keyed = ops.iter().map(|(i, op)| (ticket.key(*i), *op)).collect();
        self.pending = ops;
        settle(self.admission.store.clone(), now, keyed)
    }

    /// What the counters hold after the adjustments.
    fn settled(&mut self, ops: &[(usize, Adjust)], results: Vec<Option<u64>>) {
        let ticket = self.admission.status.ticket();
        let offset = ticket.outer_lines();
        let usage = self.settled.get_or_insert_with(|| ticket.usage.clone());
        for ((i, _), result) in ops.iter().zip(results) {
            if let Some(used) = result {
                usage[i - offset].used = used;
            }
        }
    }

    /// The fields of the quotas of the layers the request passed.
    fn fields(&self) -> RateLimitFields {
        let ticket = self.admission.status.ticket();
        let layout = self.admission.layout();
        let usage = match &self.settled {
            Some(usage) => usage,
            None => &ticket.usage,
        };
        let now = ticket.charged_at;
        if layout.line_scope.iter().all(|&scope| ticket.reached(scope)) {
            return RateLimitFields::new(
                &layout.quotas,
                usage,
                now,
                &layout.cache,
                ticket.subject_hash,
            );
        }
        let (quotas, usage): (Vec<_>, Vec<_>) = layout
            .quotas
            .iter()
            .zip(usage)
            .zip(&layout.line_scope)
            .filter(|(_, &scope)| ticket.reached(scope))
            .map(|((quota, usage), _)| (quota.clone(), *usage))
            .unzip();
        RateLimitFields::new(
            &quotas,
            &usage,
            now,
            &PolicyCache::default(),
            ticket.subject_hash,
        )
    }
}

/// Applies `ops` in the store, to the counters live at `charged_at` (those
/// the request was charged on). Runs as a task of its own when a tokio
/// runtime is at hand, so a response future dropped meanwhile does not cut
/// a refund short.
fn settle<St: Store>(store: St, charged_at: Timestamp, ops: Vec<(PeriodKey, Adjust)>) -> Adjusting {
    let work = async move {
        let mut results = Vec::with_capacity(ops.len());
        for (key, op) in ops {
            let result = match op {
                Adjust::Refund(amount) => store.refund(charged_at, key.clone(), amount).await,
                Adjust::Add(amount) => store.add(charged_at, key.clone(), amount).await,
            };
            if let (Adjust::Refund(_), Ok(Some(_))) = (op, &result) {
                crate::metrics::refunded();
            }
            results.push(result.unwrap_or_else(|error| {
                if let Some(suppressed) = ADJUST_ERRORS.admit() {
                    tracing::warn!(
                        %error,
                        key = key.as_str(),
                        ?op,
                        suppressed,
                        "quota store failed to adjust a charge after the response"
                    );
                }
                None
            }));
        }
        results
    };
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            let task = runtime.spawn(work);
            Box::pin(async move { task.await.unwrap_or_default() })
        }
        Err(_) => Box::pin(work),
    }
}

impl<S, St, ReqBody> ResponseFuture<S, St, ReqBody>
where
    S: Service<Request<ReqBody>>,
    St: Store,
{
    /// Charges `charge` in the admission's store once first polled.
    pub(crate) fn charging(
        charge: ChargeRequest,
        inner: S,
        request: Request<ReqBody>,
        admission: Admission<St>,
    ) -> Self {
        Self {
            state: State::Charging {
                start: Some(charge),
                charge: None,
                timeout: None,
                timer: crate::metrics::ChargeTimer::start(),
                pending: Some(Pending {
                    inner,
                    request,
                    admission,
                }),
            },
        }
    }

    pub(crate) fn passing(future: S::Future) -> Self {
        Self {
            state: State::Calling {
                future,
                after: None,
            },
        }
    }

    pub(crate) fn rejected(response: Response<Bytes>) -> Self {
        Self {
            state: State::Rejected {
                response: Some(response),
            },
        }
    }
}

/// Shadow quotas were charged without a limit: their usage gets the limit
/// the client is told, and a request over it is logged.
fn shadow_limits<St: Store>(admission: &Admission<St>, usage: &mut [Usage]) {
    let ticket = admission.status.ticket();
    if ticket.limits.is_empty() {
        return;
    }
    let layout = admission.layout();
    for ((quota, usage), &limit) in layout.quotas.iter().zip(usage).zip(&ticket.limits) {
        if !quota.is_shadow() {
            continue;
        }
        usage.limit = limit;
        if usage.used > limit {
            crate::metrics::shadow_refused(quota);
            if let Some(suppressed) = SHADOW_REFUSALS.admit() {
                tracing::info!(
                    quota = quota.name(),
                    limit,
                    used = usage.used,
                    suppressed,
                    "shadow quota exceeded: enforced, it would have refused this request"
                );
            }
        }
    }
}

/// Shadow refusals logged per second at most.
static SHADOW_REFUSALS: Throttle = Throttle::new(5);

/// Lets a few warnings a second through about refunds and adds that failed
/// (during a store outage, one per request).
static ADJUST_ERRORS: Throttle = Throttle::new(5);

/// Whether every quota without room belongs to an inner layer, which the
/// request may never reach.
fn refused_only_inside<St: Store>(admission: &Admission<St>, usage: &[Usage]) -> bool {
    let ticket = admission.status.ticket();
    let layout = admission.layout();
    let mut inner_full = false;
    for (quota, (usage, &scope)) in layout
        .quotas
        .iter()
        .zip(usage.iter().zip(&layout.line_scope))
    {
        let cost = ticket.costs.get(scope);
        if !quota.is_shadow() && usage.used.saturating_add(cost) > usage.limit {
            if scope == 0 {
                return false;
            }
            inner_full = true;
        }
    }
    inner_full
}

/// The state that follows the store's answer.
fn decided<S, St, ReqBody>(
    pending: Pending<S, St, ReqBody>,
    answer: Result<crate::store::ChargeOutcome, StoreError>,
) -> State<S, St, ReqBody>
where
    S: Service<Request<ReqBody>>,
    St: Store,
{
    let Pending {
        mut inner,
        mut request,
        mut admission,
    } = pending;
    let mut answer = answer;
    if let Ok(outcome) = &mut answer {
        shadow_limits(&admission, &mut outcome.usage);
    }
    if let Ok(outcome) = &answer {
        if !outcome.admitted && refused_only_inside(&admission, &outcome.usage) {
            if let Some((alone, charge)) = admission.alone(&outcome.usage) {
                return State::Charging {
                    start: None,
                    charge: Some(alone.store.charge(charge)),
                    timeout: None,
                    timer: crate::metrics::ChargeTimer::start(),
                    pending: Some(Pending {
                        inner,
                        request,
                        admission: alone,
                    }),
                };
            }
        }
    }
    let ticket = admission.status.ticket();
    let layout = admission.layout();
    let decision = decide(
        &layout.quotas,
        |line| ticket.costs.get(layout.line_scope[line]),
        ticket.charged_at,
        layout.on_store_error,
        &layout.cache,
        Answer {
            hook: layout.refusal.as_ref().map(|hook| &*hook.0),
            // Looked up only for an answer that may refuse.
            grpc: !matches!(&answer, Ok(outcome) if outcome.admitted) && is_grpc(&request),
            subject: ticket.subject_hash,
        },
        answer,
    );
    let outcome = match &decision {
        Decision::Admit { .. } => "admitted",
        Decision::Refuse(_) => "refused",
        Decision::PassUncharged | Decision::Unavailable(_) => "store_error",
    };
    admission.span.record("outcome", outcome);
    match decision {
        Decision::Admit { usage } => {
            admission.admit(usage);
            request.extensions_mut().insert(admission.status.clone());
            State::Calling {
                future: inner.call(request),
                after: Some(After {
                    admission,
                    settled: None,
                    pending: Vec::new(),
                }),
            }
        }
        Decision::PassUncharged => {
            let ticket = admission.status.ticket();
            request
                .extensions_mut()
                .insert(QuotaStatus::exempt(ticket.policy, ticket.charged_at));
            State::Calling {
                future: inner.call(request),
                after: None,
            }
        }
        Decision::Refuse(response) | Decision::Unavailable(response) => {
            match admission.refund_outer() {
                Some(adjust) => State::Refunding {
                    adjust,
                    response: Some(response),
                },
                None => State::Rejected {
                    response: Some(response),
                },
            }
        }
    }
}

impl<S, St, ReqBody, ResBody> Future for ResponseFuture<S, St, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    St: Store,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Charging {
                    start,
                    mut charge,
                    mut timeout,
                    pending,
                    timer,
                } => {
                    if let Some(request) = start.take() {
                        let admission =
                            &pending.as_ref().expect("polled after completion").admission;
                        charge.set(Some(admission.store.charge(request)));
                    }
                    let charge = charge.as_pin_mut().expect("the charge is on its way");
                    let answer = match charge.poll(cx) {
                        Poll::Ready(answer) => answer,
                        Poll::Pending => {
                            let limit = pending
                                .as_ref()
                                .expect("polled after completion")
                                .admission
                                .layout()
                                .store_timeout;
                            // Stores that answer at once never arm a timer.
                            if let (None, Some(limit)) = (timeout.as_ref().as_pin_ref(), limit) {
                                if tokio::runtime::Handle::try_current().is_ok() {
                                    timeout.set(Some(tokio::time::sleep(limit)));
                                }
                            }
                            let Some(sleep) = timeout.as_pin_mut() else {
                                return Poll::Pending;
                            };
                            ready!(sleep.poll(cx));
                            Err(StoreError::new(
                                StoreErrorKind::Timeout,
                                "the quota store did not answer in time",
                            ))
                        }
                    };
                    timer.stop::<St>();
                    let pending = pending.take().expect("polled after completion");
                    let next = decided(pending, answer);
                    this.state.set(next);
                }
                StateProj::Calling { future, after } => {
                    let result = ready!(future.poll(cx));
                    let Some(mut after) = after.take() else {
                        return Poll::Ready(result.map(|r| r.map(ResponseBody::inner)));
                    };
                    if !after.admission.adjustable {
                        // Nothing can change this charge any more.
                        return Poll::Ready(finish(&after, result));
                    }
                    let (result, ops) = match result {
                        Ok(response) => {
                            let (parts, body) = response.into_parts();
                            let ops =
                                after.adjustments(parts.status.is_server_error(), Some(&parts));
                            (Ok(Response::from_parts(parts, body)), ops)
                        }
                        Err(error) => (Err(error), after.adjustments(true, None)),
                    };
                    if ops.is_empty() {
                        return Poll::Ready(finish(&after, result));
                    }
                    let adjust = after.settle(ops);
                    this.state.set(State::Settling {
                        adjust,
                        result: Some(result),
                        after: Some(after),
                    });
                }
                StateProj::Settling {
                    adjust,
                    result,
                    after,
                } => {
                    let results = ready!(adjust.as_mut().poll(cx));
                    let mut after = after.take().expect("polled after completion");
                    let ops = std::mem::take(&mut after.pending);
                    after.settled(&ops, results);
                    let result = result.take().expect("polled after completion");
                    return Poll::Ready(finish(&after, result));
                }
                StateProj::Refunding { adjust, response } => {
                    ready!(adjust.as_mut().poll(cx));
                    let response = response.take().expect("polled after completion");
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
                StateProj::Rejected { response } => {
                    let response = response.take().expect("polled after completion");
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
            }
        }
    }
}

/// The admitted request's answer, with the fields of every quota charged;
/// none for a request no route served.
fn finish<St: Store, ResBody, Error>(
    after: &After<St>,
    result: Result<Response<ResBody>, Error>,
) -> Result<Response<ResponseBody<ResBody>>, Error> {
    let mut response = result?;
    if !is_unrouted(response.extensions()) {
        after.fields().append_to(response.headers_mut());
    }
    Ok(response.map(ResponseBody::inner))
}

/// Whether `request` is a gRPC call (`content-type: application/grpc` and
/// its variants), answered as one if refused.
fn is_grpc<B>(request: &Request<B>) -> bool {
    request
        .headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// Whether no route served the response (see the `unrouted` handlers).
fn unrouted(response: Option<&http::response::Parts>) -> bool {
    response.is_some_and(|parts| is_unrouted(&parts.extensions))
}

#[cfg(feature = "axum")]
fn is_unrouted(extensions: &http::Extensions) -> bool {
    extensions.get::<crate::unrouted::Unrouted>().is_some()
}

#[cfg(not(feature = "axum"))]
fn is_unrouted(_: &http::Extensions) -> bool {
    false
}
