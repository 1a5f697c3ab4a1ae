use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use jiff::Timestamp;
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use crate::body::ResponseBody;
use crate::config::{DeferredCost, OnStoreError, Scope, Settings};
use crate::decision::{decide, Decision};
use crate::key::PeriodKey;
use crate::period::Clock;
use crate::quota::Quota;
use crate::response::{PolicyCache, RateLimitFields};
use crate::status::{QuotaStatus, QuotaUsage, Ticket};
use crate::store::{Store, StoreError, StoreErrorKind, Usage};

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
        // Waiting for the store's answer to the charge.
        Charging {
            #[pin]
            charge: St::ChargeFuture,
            #[pin]
            timeout: Option<Sleep>,
            pending: Option<Pending<S, St, ReqBody>>,
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

/// What one request is charged: one line per quota, and what to do with the
/// charge once the response is known.
pub(crate) struct Admission<St> {
    store: St,
    policy: u64,
    /// One per line.
    quotas: Arc<[Quota]>,
    keys: Vec<PeriodKey>,
    costs: Vec<u64>,
    scopes: Vec<u64>,
    /// The scopes charged; the first is the charging layer's own.
    covered: Vec<u64>,
    deferred: Vec<(u64, DeferredCost, u64)>,
    now: Timestamp,
    clock: Arc<dyn Clock>,
    on_store_error: OnStoreError,
    store_timeout: Option<Duration>,
    refund_server_errors: bool,
    cache: Arc<PolicyCache>,
    /// The status of an outer layer that charged without knowing this one.
    outer: Option<QuotaStatus>,
}

/// An admitted request: its charge and status, for the response path.
pub(crate) struct After<St> {
    admission: Admission<St>,
    usage: Vec<Usage>,
    status: QuotaStatus,
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
    pub(crate) fn new(
        store: St,
        policy: u64,
        quotas: Arc<[Quota]>,
        now: Timestamp,
        settings: &Settings,
        cache: Arc<PolicyCache>,
        outer: Option<QuotaStatus>,
    ) -> Self {
        let lines = quotas.len();
        Self {
            store,
            policy,
            quotas,
            keys: Vec::with_capacity(lines),
            costs: Vec::with_capacity(lines),
            scopes: Vec::with_capacity(lines),
            covered: Vec::new(),
            deferred: Vec::new(),
            now,
            clock: Arc::clone(&settings.clock),
            on_store_error: settings.on_store_error,
            store_timeout: settings.store_timeout,
            refund_server_errors: settings.refund_server_errors,
            cache,
            outer,
        }
    }

    /// Charges `scope`'s quotas `cost` each.
    pub(crate) fn add_scope(&mut self, scope: &Scope, cost: u64) {
        self.covered.push(scope.id);
        for _ in scope.quotas.iter() {
            self.costs.push(cost);
            self.scopes.push(scope.id);
        }
        if let Some(deferred) = &scope.deferred {
            self.deferred.push((scope.id, deferred.clone(), cost));
        }
    }

    /// The key of the next line.
    pub(crate) fn add_key(&mut self, key: PeriodKey) {
        self.keys.push(key);
    }

    /// The request's status once admitted with `usage`: this charge's lines,
    /// after those of a hidden outer layer's.
    fn admit(&mut self, usage: &[Usage]) -> QuotaStatus {
        let own = self.covered.first().copied();
        let keys = std::mem::take(&mut self.keys);
        let mut ticket = Ticket {
            policy: self.policy,
            entries: Vec::with_capacity(usage.len()),
            scopes: Vec::with_capacity(usage.len()),
            costs: Vec::with_capacity(usage.len()),
            covered: Vec::with_capacity(self.covered.len()),
            charged_at: self.now,
            refunded: AtomicBool::new(false),
            exempt: false,
        };
        if let Some(outer) = &self.outer {
            let outer = outer.ticket();
            ticket.entries.extend(outer.entries.iter().cloned());
            ticket.scopes.extend(&outer.scopes);
            ticket.costs.extend(&outer.costs);
            ticket.covered.extend(
                outer
                    .covered
                    .iter()
                    .map(|(id, reached)| (*id, AtomicBool::new(reached.load(Ordering::Relaxed)))),
            );
        }
        ticket.entries.extend(
            self.quotas
                .iter()
                .zip(keys)
                .zip(usage)
                .map(|((quota, key), usage)| QuotaUsage::new(quota.clone(), key, *usage)),
        );
        ticket.scopes.extend(&self.scopes);
        ticket.costs.extend(&self.costs);
        ticket.covered.extend(
            self.covered
                .iter()
                .map(|id| (*id, AtomicBool::new(Some(*id) == own))),
        );
        QuotaStatus::new(ticket)
    }

    /// Gives back what a hidden outer layer charged, when this layer refuses
    /// the request.
    fn refund_outer(&self) -> Option<Adjusting> {
        let outer = self.outer.as_ref()?.ticket();
        if outer.refunded.swap(true, Ordering::Relaxed) {
            return None;
        }
        let ops = outer
            .entries
            .iter()
            .zip(&outer.costs)
            .map(|(entry, cost)| (entry.key.clone(), Adjust::Refund(*cost)))
            .collect();
        Some(settle(self.store.clone(), self.clock.now(), ops))
    }
}

impl<St: Store> After<St> {
    /// How the response changes the charge: refunds for layers the request
    /// never reached and, when the rule is on, for a server error; the
    /// difference to a deferred cost otherwise.
    fn adjustments(
        &self,
        failed: bool,
        response: Option<&http::response::Parts>,
    ) -> Vec<(usize, Adjust)> {
        let ticket = self.status.ticket();
        if ticket.refunded.load(Ordering::Relaxed) {
            return Vec::new();
        }
        let admission = &self.admission;
        let own = admission.covered.first().copied();
        // This charge's lines follow a hidden outer layer's in the ticket.
        let offset = ticket.entries.len() - admission.scopes.len();
        let refund_all = failed && admission.refund_server_errors;
        let mut ops = Vec::new();
        for (i, (scope, cost)) in admission.scopes.iter().zip(&admission.costs).enumerate() {
            let unreached = Some(*scope) != own && !ticket.reached(*scope);
            if unreached || refund_all {
                if *cost > 0 {
                    ops.push((offset + i, Adjust::Refund(*cost)));
                }
                continue;
            }
            let Some(response) = response else { continue };
            if let Some((_, deferred, upfront)) =
                admission.deferred.iter().find(|(id, _, _)| id == scope)
            {
                let real = (deferred.0)(response);
                match real.cmp(upfront) {
                    std::cmp::Ordering::Greater => {
                        ops.push((offset + i, Adjust::Add(real - upfront)))
                    }
                    std::cmp::Ordering::Less => {
                        ops.push((offset + i, Adjust::Refund(upfront - real)))
                    }
                    std::cmp::Ordering::Equal => {}
                }
            }
        }
        ops
    }

    fn settle(&self, ops: &[(usize, Adjust)]) -> Adjusting {
        let entries = &self.status.ticket().entries;
        let ops = ops
            .iter()
            .map(|(i, op)| (entries[*i].key.clone(), *op))
            .collect();
        settle(
            self.admission.store.clone(),
            self.admission.clock.now(),
            ops,
        )
    }

    /// What the counters hold after the adjustments.
    fn settled(&mut self, ops: &[(usize, Adjust)], results: Vec<Option<u64>>) {
        let offset = self.status.ticket().entries.len() - self.usage.len();
        for ((i, _), result) in ops.iter().zip(results) {
            if let Some(used) = result {
                self.usage[i - offset].used = used;
            }
        }
    }

    fn fields(&self) -> RateLimitFields {
        let admission = &self.admission;
        RateLimitFields::new(
            &admission.quotas,
            &self.usage,
            admission.now,
            &admission.cache,
        )
    }
}

/// Applies `ops` in the store. Runs as a task of its own when a tokio
/// runtime is at hand, so a response future dropped meanwhile does not cut
/// a refund short.
fn settle<St: Store>(store: St, now: Timestamp, ops: Vec<(PeriodKey, Adjust)>) -> Adjusting {
    let work = async move {
        let mut results = Vec::with_capacity(ops.len());
        for (key, op) in ops {
            let result = match op {
                Adjust::Refund(amount) => store.refund(now, key.clone(), amount).await,
                Adjust::Add(amount) => store.add(now, key.clone(), amount).await,
            };
            results.push(result.unwrap_or_else(|error| {
                tracing::warn!(%error, key = key.as_str(), ?op, "quota store failed to adjust a charge after the response");
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
    pub(crate) fn charging(
        charge: St::ChargeFuture,
        inner: S,
        request: Request<ReqBody>,
        admission: Admission<St>,
    ) -> Self {
        Self {
            state: State::Charging {
                charge,
                timeout: None,
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
    let decision = decide(
        &admission.quotas,
        &admission.costs,
        admission.now,
        admission.on_store_error,
        &admission.cache,
        answer,
    );
    match decision {
        Decision::Admit { usage } => {
            let status = admission.admit(&usage);
            request.extensions_mut().insert(status.clone());
            State::Calling {
                future: inner.call(request),
                after: Some(After {
                    admission,
                    usage,
                    status,
                    pending: Vec::new(),
                }),
            }
        }
        Decision::PassUncharged => {
            request
                .extensions_mut()
                .insert(QuotaStatus::exempt(admission.policy, admission.now));
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
                    charge,
                    mut timeout,
                    pending,
                } => {
                    let answer = match charge.poll(cx) {
                        Poll::Ready(answer) => answer,
                        Poll::Pending => {
                            let limit = pending
                                .as_ref()
                                .expect("polled after completion")
                                .admission
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
                    let pending = pending.take().expect("polled after completion");
                    let next = decided(pending, answer);
                    this.state.set(next);
                }
                StateProj::Calling { future, after } => {
                    let result = ready!(future.poll(cx));
                    let Some(mut after) = after.take() else {
                        return Poll::Ready(result.map(|r| r.map(ResponseBody::inner)));
                    };
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
                    let adjust = after.settle(&ops);
                    after.pending = ops;
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

/// The admitted request's answer, with the fields of every quota charged.
fn finish<St: Store, ResBody, Error>(
    after: &After<St>,
    result: Result<Response<ResBody>, Error>,
) -> Result<Response<ResponseBody<ResBody>>, Error> {
    let mut response = result?;
    after.fields().append_to(response.headers_mut());
    Ok(response.map(ResponseBody::inner))
}
