use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use jiff::Timestamp;
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use super::charge::{self, Adjust, Charge, Decision, Outcome};
use super::layer::Bound;
use super::owing::Owing;
use crate::body::ResponseBody;
use crate::response::RateLimitFields;
use crate::status::{GiveBack, LayerQuotas, Lines, QuotaSet, QuotaStatus};
use crate::store::patience::{Patience, PatientTimer};
use crate::store::resend::Resend;
use crate::store::{ChargeAnswer, Made, Store, StoreError, StoreErrorKind, Usage};
use crate::subject::SubjectExtractor;
use crate::throttle::Throttle;

/// What the store answers to a batch of changes: per change, what the
/// counter holds afterwards (`None`: no live counter, or the store failed).
type Adjusting = Pin<Box<dyn Future<Output = Vec<Option<u64>>> + Send>>;

/// Told once every change of an [`Adjusting`] had its first answer, if the
/// store never sent some of them: those are sent again, and a response does
/// not wait for them.
type Resending = tokio::sync::oneshot::Receiver<()>;

pin_project! {
    /// The response future of [`QuotaService`](crate::QuotaService).
    pub struct ResponseFuture<S, E, St, ReqBody>
    where
        S: Service<Request<ReqBody>>,
        St: Store,
    {
        #[pin]
        state: State<S, E, St, ReqBody>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, E, St, ReqBody>
    where
        S: Service<Request<ReqBody>>,
        St: Store,
    {
        // Waiting for the store's answer: the charge was sent when the
        // layer made it (see `QuotaService::call`), and was not answered at
        // once. Boxed, as the other states but `Calling`: the future of
        // every request stays as small as the one state most take, and is
        // cheap to move.
        Charging {
            waiting: Box<Waiting<S, E, St, ReqBody>>,
        },
        // The inner service answers; `charged` is what this layer charged
        // (nothing, for a request it let pass), given back if the request
        // is dropped before the answer: it was not served.
        Calling {
            #[pin]
            future: S::Future,
            charged: Unanswered<E, St>,
            // What a request that passed on a failed charge owes, once
            // answered (fail open).
            owing: Option<Box<Owing<E, St>>>,
        },
        // The store applies what the response changes before the fields are
        // written.
        Settling {
            settling: Box<Settling<E, St, Result<S::Response, S::Error>>>,
        },
        Rejected {
            response: Option<Box<Response<Bytes>>>,
        },
    }
}

/// A request waiting for the store's answer to its charge.
pub(crate) struct Waiting<S, E, St: Store, ReqBody> {
    charge: St::ChargeFuture,
    // Armed only for a store that does not answer at once: the policy's
    // `store_timeout`, waited for longer while the store answers others.
    timeout: Option<PatientTimer>,
    timer: crate::metrics::ChargeTimer,
    pending: Option<Pending<S, E, St, ReqBody>>,
}

/// A response waiting for the store to apply what it changes.
pub(crate) struct Settling<E, St: Store, R> {
    settle: Settle<E, St>,
    // Armed once the store does not answer at once: past the store's
    // timeout the response goes out with the fields as charged, and the
    // changes carry on in their task.
    timeout: Option<Pin<Box<Sleep>>>,
    // Told when the store never sent some changes, which are sent again:
    // the response goes out then, as past the timeout.
    resending: Option<Resending>,
    // Whether the response gets the fields (not when no route served it).
    fields: bool,
    result: Option<R>,
}

/// A request waiting for its charge.
pub(crate) struct Pending<S, E, St: Store, ReqBody> {
    inner: S,
    request: Request<ReqBody>,
    charge: Charge,
    bound: Arc<Bound<E, St>>,
}

/// What a layer charged for an admitted request, for the response path.
pub(crate) struct Charged<E, St> {
    bound: Arc<Bound<E, St>>,
    lines: Arc<Lines>,
    now: Timestamp,
    spread: u64,
    /// The lines the layers further out charged for the request: told what
    /// this layer keeps once it answered (see [`GiveBack`]).
    outer: Vec<Arc<Lines>>,
}

impl<E, St: Store> Charged<E, St> {
    /// Whether a quota layer further out charged the request too: this
    /// one then tells it what it keeps once it answered.
    #[inline]
    fn is_nested(&self) -> bool {
        !self.outer.is_empty()
    }

    /// What the response with head `response` (`None`: the inner service
    /// failed) changes for the lines charged.
    fn outcome(&self, response: Option<&http::response::Parts>) -> Outcome {
        let bound = &self.bound;
        charge::outcome(
            &self.lines,
            &bound.scope.cost,
            &bound.policy.settings,
            bound.policy.store.max_count(),
            self.lines.is_refused_inside(),
            response,
        )
    }
}

impl<S, E, St, ReqBody> ResponseFuture<S, E, St, ReqBody>
where
    S: Service<Request<ReqBody>> + Clone,
    E: SubjectExtractor,
    St: Store,
{
    /// Sends `charge` to the store (see [`send`]).
    pub(crate) fn sent(
        inner: &mut S,
        request: Request<ReqBody>,
        charge: &mut Charge,
        bound: &Arc<Bound<E, St>>,
    ) -> Self {
        Self {
            state: send(inner, request, charge, bound),
        }
    }

    /// The inner service's answer, untouched by this layer.
    pub(crate) fn passing(future: S::Future) -> Self {
        Self::owing(future, None)
    }

    /// The inner service's answer, untouched by this layer, which records
    /// what the request owes once it is known.
    pub(crate) fn owing(future: S::Future, owing: Option<Box<Owing<E, St>>>) -> Self {
        Self {
            state: State::Calling {
                future,
                charged: Unanswered(None),
                owing,
            },
        }
    }

    pub(crate) fn rejected(response: Response<Bytes>) -> Self {
        Self {
            state: State::Rejected {
                response: Some(Box::new(response)),
            },
        }
    }
}

/// Sends `charge` to the store, and the state that follows: the store's
/// answer decided at once when it answers at once (or its future does, on
/// a first poll), then `inner` called; otherwise a wait for the answer with
/// `inner`, the instance `poll_ready` readied (a clone stays in its place).
#[inline]
fn send<S, E, St, ReqBody>(
    inner: &mut S,
    request: Request<ReqBody>,
    charge: &mut Charge,
    bound: &Arc<Bound<E, St>>,
) -> State<S, E, St, ReqBody>
where
    S: Service<Request<ReqBody>> + Clone,
    E: SubjectExtractor,
    St: Store,
{
    let timer = crate::metrics::ChargeTimer::start();
    // Read where it lies: a store's answer is a few hundred bytes.
    let mut at_once = bound.policy.store.charge_at_once(&charge.request);
    let mut first_poll = None;
    let answer = match &mut at_once {
        ChargeAnswer::Now(answer) => answer,
        ChargeAnswer::Later(future) => {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            match Pin::new(&mut *future).poll(&mut cx) {
                Poll::Ready(answer) => first_poll.insert(answer),
                Poll::Pending => {
                    let ChargeAnswer::Later(future) = at_once else {
                        unreachable!("matched above")
                    };
                    let clone = inner.clone();
                    return State::Charging {
                        waiting: Box::new(Waiting {
                            charge: future,
                            timeout: None,
                            timer,
                            pending: Some(Pending {
                                inner: std::mem::replace(inner, clone),
                                request,
                                charge: std::mem::take(charge),
                                bound: Arc::clone(bound),
                            }),
                        }),
                    };
                }
            }
        }
    };
    timer.stop(crate::store::metrics_label::<St>());
    decided(inner, request, charge, bound, answer)
}

/// The state that follows the store's `answer` to `charge`.
fn decided<S, E, St, ReqBody>(
    inner: &mut S,
    mut request: Request<ReqBody>,
    charge: &mut Charge,
    bound: &Arc<Bound<E, St>>,
    answer: &mut Result<crate::store::ChargeOutcome, StoreError>,
) -> State<S, E, St, ReqBody>
where
    S: Service<Request<ReqBody>> + Clone,
    E: SubjectExtractor,
    St: Store,
{
    let settings = &bound.policy.settings;
    match charge::decide(charge, &bound.scope, settings, answer) {
        Decision::Admit(lines) => {
            let now = charge.ticket.now;
            let spread = charge.caller().spread;
            // The same allocation as `bound`: one reference count.
            let layer: Arc<dyn LayerQuotas> = Arc::clone(bound) as _;
            let quotas = std::mem::replace(&mut charge.quotas, QuotaSet::Own);
            let lines = Arc::new(Lines::new(layer, quotas, lines));
            charge.ticket.charges.push(Arc::clone(&lines));
            let outer = QuotaStatus::put_in_charged(
                request.extensions_mut(),
                std::mem::take(&mut charge.ticket),
                crate::status::layer_id(bound),
            );
            // Made before the inner service is called: if its `call`
            // panics, dropping it gives the charge back.
            let charged = Unanswered(Some(Charged {
                bound: Arc::clone(bound),
                lines,
                now,
                spread,
                outer,
            }));
            State::Calling {
                future: inner.call(request),
                charged,
                owing: None,
            }
        }
        Decision::Saturated(left_out) => {
            // Shadow quotas at the most their store counts never refuse:
            // the charge goes again without them, or, with nothing left,
            // the request passes this layer uncounted.
            let Some(mut charge) = std::mem::take(charge).without(&left_out, &bound.scope) else {
                QuotaStatus::let_through_in(request.extensions(), crate::status::layer_id(bound));
                QuotaStatus::ensure_in(request.extensions_mut());
                return State::Calling {
                    future: inner.call(request),
                    charged: Unanswered(None),
                    owing: None,
                };
            };
            send(inner, request, &mut charge, bound)
        }
        Decision::PassUncounted => {
            // The store is failing: the request owes its charge, and the
            // policy's inner layers owe theirs without asking the store.
            let owing = super::owing::owe(bound, std::mem::take(charge), request.extensions_mut());
            State::Calling {
                future: inner.call(request),
                charged: Unanswered(None),
                owing,
            }
        }
        // The layers further out give their own charges back when they see
        // the refusal go by (see `charge::outcome`).
        Decision::Refuse(usage) => {
            QuotaStatus::refuse_in(request.extensions(), crate::status::layer_id(bound));
            let grpc = crate::response::grpc_content_type(request.headers());
            // The waits told are counted from the refusal's own instant.
            let told = settings.clock.now().max(charge.ticket.now);
            let refusal = charge::refusal(charge, &bound.scope, &usage, told, grpc);
            State::Rejected {
                response: Some(Box::new(charge::refused(
                    settings,
                    &refusal,
                    charge,
                    &bound.scope,
                    &usage,
                    told,
                ))),
            }
        }
        Decision::Unavailable(retry_after) => {
            QuotaStatus::refuse_in(request.extensions(), crate::status::layer_id(bound));
            let grpc = crate::response::grpc_content_type(request.headers());
            let refusal = crate::response::Refusal::store_unavailable(retry_after, grpc);
            State::Rejected {
                response: Some(Box::new(charge::refused(
                    settings,
                    &refusal,
                    charge,
                    &bound.scope,
                    &[],
                    charge.ticket.now,
                ))),
            }
        }
    }
}

/// One change [`apply`] sends to a counter of a line.
struct Change {
    key: crate::key::PeriodKey,
    adjust: Adjust,
    /// The counter the line was charged on: the change goes to it only,
    /// not to one made anew since.
    made: Made,
    /// When that counter's period ends: a change the store never sent is
    /// sent again until then.
    resets_at: Timestamp,
    /// The line's index in the response's lines, when the change is one of
    /// a layer's response (see [`apply`]).
    line: Option<usize>,
}

/// Refunds and adds that failed, logged a few times per second at most.
static ADJUST_ERRORS: Throttle = Throttle::new(5);

/// Applies `ops` in the store: at once when the store answers at once,
/// otherwise in a task of its own when a tokio runtime is at hand, so a
/// response future dropped meanwhile does not cut a refund short. A change
/// goes only to the counter the request was charged on, named beside it
/// (see [`Line::charged_counter`](crate::status::Line::charged_counter)):
/// not to one made anew since (a reset while the request was served). A
/// change the store never sent is sent again
/// within its counter's period (the counter's reset beside it): past it, a
/// counter with the same key is another period's.
fn apply<St: Store>(
    store: St,
    now: Timestamp,
    ops: Vec<Change>,
    // The lines the ops name (see `Change::line`): an add that never lands
    // is recorded on its line.
    lines: Option<Arc<Lines>>,
) -> (Adjusting, Resending) {
    let (first_answers, resending) = tokio::sync::oneshot::channel();
    // When the changes are first sent, on the runtime's clock: what they
    // are sent again until counts from here.
    let started = tokio::time::Instant::now();
    // A shutdown waits for these changes until they are over (see
    // `QuotaPolicy::settle_owed`).
    let applying = crate::store::resend::Applying::new();
    let work = async move {
        let _applying = applying;
        let send = |key: &crate::key::PeriodKey, op: Adjust, made: Made| {
            let (store, key) = (store.clone(), key.clone());
            async move {
                match op {
                    Adjust::Refund(amount) => made.refund(&store, now, key, amount).await,
                    Adjust::Add(amount) => made.add(&store, now, key, amount).await,
                }
            }
        };
        let mut answers = Vec::with_capacity(ops.len());
        for change in &ops {
            answers.push(send(&change.key, change.adjust, change.made).await);
        }
        // A change the store never sent applied nothing: sent again a while
        // later, within the counter's period, so that an outage does not
        // leave a request charged that was not served, nor one served
        // under-counted. The response does not wait for it (see
        // `Settling`).
        let resends: Vec<_> = answers
            .iter()
            .zip(&ops)
            .map(|(answer, change)| {
                let unsent = matches!(answer, Err(error) if error.is_unsent());
                unsent
                    .then(|| Resend::until(started, now, change.resets_at))
                    .flatten()
            })
            .collect();
        if resends.iter().any(Option::is_some) {
            let _ = first_answers.send(());
        }
        for ((answer, resend), change) in answers.iter_mut().zip(resends).zip(&ops) {
            if let Some(resend) = resend {
                let again = resend.send(|| send(&change.key, change.adjust, change.made));
                if let Some(again) = again.await {
                    *answer = again;
                }
            }
        }
        // An add answered: one that never landed (failed, or no counter to
        // add to) is no part of what a give-back of the request takes from
        // the counter; one that landed after the handler gave the request
        // back (it was on its way then, and left out) goes back now, as any
        // change (sent again if the store never got it), in a task of its
        // own: the response does not wait for it.
        if let Some(lines) = &lines {
            let back: Vec<Change> = answers
                .iter()
                .zip(&ops)
                .filter_map(|(answer, change)| {
                    let (Adjust::Add(amount), Some(line)) = (change.adjust, change.line) else {
                        return None;
                    };
                    let back = lines[line].add_answered(amount, matches!(answer, Ok(Some(_))));
                    (back > 0).then(|| Change {
                        key: change.key.clone(),
                        adjust: Adjust::Refund(back),
                        made: change.made,
                        resets_at: change.resets_at,
                        line: None,
                    })
                })
                .collect();
            if !back.is_empty() {
                let since = jiff::SignedDuration::try_from(started.elapsed()).unwrap_or_default();
                let later = now.checked_add(since).unwrap_or(now);
                detach(apply(store.clone(), later, back, None).0);
            }
        }
        answers
            .into_iter()
            .zip(&ops)
            .map(|(answer, change)| {
                let op = &change.adjust;
                if let (Adjust::Refund(_), Ok(Some(_))) = (op, &answer) {
                    crate::metrics::refunded();
                }
                answer.unwrap_or_else(|error| {
                    match *op {
                        Adjust::Refund(units) => {
                            crate::metrics::change_lost(crate::metrics::change::REFUND, units)
                        }
                        Adjust::Add(units) => {
                            crate::metrics::change_lost(crate::metrics::change::ADD, units)
                        }
                    }
                    if let Some(suppressed) = ADJUST_ERRORS.admit() {
                        let error = charge::hidden(&error);
                        tracing::warn!(
                            error,
                            ?op,
                            suppressed,
                            "quota store failed to adjust a charge after the response"
                        );
                    }
                    None
                })
            })
            .collect()
    };
    // A store that answers at once (the memory store) is done here.
    let mut work: Adjusting = Box::pin(work);
    if let Poll::Ready(results) = work
        .as_mut()
        .poll(&mut Context::from_waker(std::task::Waker::noop()))
    {
        return (Box::pin(std::future::ready(results)), resending);
    }
    let work: Adjusting = match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            let task = runtime.spawn(work);
            Box::pin(async move { task.await.unwrap_or_default() })
        }
        Err(_) => work,
    };
    (work, resending)
}

/// Runs `adjusting` to the end without waiting for it: in a task of its own
/// (spawned by `apply`) on a tokio runtime; without one, at once, which a
/// store that answers at once (the memory store) finishes.
fn detach(mut adjusting: Adjusting) {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    if adjusting.as_mut().poll(&mut cx).is_pending()
        && tokio::runtime::Handle::try_current().is_err()
    {
        if let Some(suppressed) = ADJUST_ERRORS.admit() {
            tracing::warn!(
                suppressed,
                "a charge to give back was dropped: its store does not answer at once, and no tokio runtime runs it"
            );
        }
    }
}

/// A layer's charge while the inner service has not answered.
pub(crate) struct Unanswered<E, St: Store>(Option<Charged<E, St>>);

impl<E, St: Store> Unanswered<E, St> {
    /// The charge, now that the inner service answered: it stays.
    fn answered(&mut self) -> Option<Charged<E, St>> {
        self.0.take()
    }
}

impl<E, St: Store> Drop for Unanswered<E, St> {
    /// Dropped before the inner service answered (a timeout further out, a
    /// client gone): the request was not served, and its charge goes back.
    fn drop(&mut self) {
        if let Some(charged) = self.0.take() {
            charged.lines.give_back_inside();
            let now = charged.bound.policy.settings.clock.now();
            detach(adjust(&charged, now, &charge::refund_all(&charged.lines)));
        }
    }
}

impl<E, St: Store> Charged<E, St> {
    /// Puts the fields of this layer's quotas (standing at `usage`, or as
    /// charged) in the response's `headers`, in front of those of layers
    /// further in.
    #[inline]
    fn finish(&self, headers: &mut http::HeaderMap, usage: Option<&[Usage]>) {
        // A line per quota, as far as the store answered for them.
        let entries = self
            .lines
            .with_quotas()
            .enumerate()
            .map(|(i, (quota, line))| {
                let usage = usage.and_then(|usage| usage.get(i).copied());
                (quota, usage.unwrap_or_else(|| line.standing()))
            });
        let cache = self.lines.policy_cache();
        // The seconds until each reset, counted from the response's own
        // instant: a handler may have run a while since the charge.
        let told = self.bound.policy.settings.clock.now().max(self.now);
        RateLimitFields::new(entries, self.now, told, cache, self.spread).prepend_to(headers);
    }
}

impl<S, E, St, ReqBody, ResBody> Future for ResponseFuture<S, E, St, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    E: SubjectExtractor,
    St: Store,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Charging { waiting } => {
                    let Waiting {
                        charge,
                        timeout,
                        timer,
                        pending,
                    } = &mut **waiting;
                    let answer = match Pin::new(charge).poll(cx) {
                        Poll::Ready(answer) => answer,
                        Poll::Pending => {
                            let policy = &pending
                                .as_ref()
                                .expect("polled after completion")
                                .bound
                                .policy;
                            if let (None, Some(limit)) =
                                (timeout.as_ref(), policy.settings.store_timeout)
                            {
                                if tokio::runtime::Handle::try_current().is_ok() {
                                    let started = tokio::time::Instant::now();
                                    let patience = Patience::new(started, limit, Duration::MAX);
                                    *timeout = Some(PatientTimer::new(
                                        patience,
                                        policy.store.last_answer(),
                                    ));
                                }
                            }
                            let Some(timer) = timeout.as_mut() else {
                                return Poll::Pending;
                            };
                            ready!(timer.poll_expired(cx, || policy.store.last_answer()));
                            Err(StoreError::new(
                                StoreErrorKind::Timeout,
                                "the quota store did not answer in time",
                            ))
                        }
                    };
                    timer.stop(crate::store::metrics_label::<St>());
                    let Pending {
                        mut inner,
                        request,
                        charge,
                        bound,
                    } = pending.take().expect("polled after completion");
                    let (mut charge, mut answer) = (charge, answer);
                    this.state.set(decided(
                        &mut inner,
                        request,
                        &mut charge,
                        &bound,
                        &mut answer,
                    ));
                }
                StateProj::Calling {
                    future,
                    charged,
                    owing,
                } => {
                    let mut result = ready!(future.poll(cx));
                    if let Some(owing) = owing.take() {
                        result = owing.answered(result);
                    }
                    // What the response changes, worked out while the charge
                    // is still given back if this panics (the application's
                    // deferred cost runs here): the response would not go out.
                    let Some(answered) = charged.0.as_ref() else {
                        return Poll::Ready(result.map(|r| r.map(ResponseBody::inner)));
                    };
                    let (result, outcome) = match result {
                        Ok(response) => {
                            let (parts, body) = response.into_parts();
                            let outcome = answered.outcome(Some(&parts));
                            (Ok(Response::from_parts(parts, body)), outcome)
                        }
                        Err(error) => {
                            let outcome = answered.outcome(None);
                            (Err(error), outcome)
                        }
                    };
                    let charged = charged.answered().expect("looked at above");
                    let settings = &charged.bound.policy.settings;
                    let (ops, fields) = match outcome {
                        Outcome::Unrouted => (charge::refund_all(&charged.lines), false),
                        Outcome::Served(ops) => (ops, true),
                    };
                    if ops.is_empty() {
                        let result = result.map(|mut response| {
                            if fields {
                                charged.finish(response.headers_mut(), None);
                            }
                            response.map(ResponseBody::inner)
                        });
                        Kept::went_out(charged, Vec::new(), Vec::new(), Some(Vec::new()), None);
                        return Poll::Ready(result);
                    }
                    let now = settings.clock.now();
                    let (adjust, kept, resending) = adjust_kept(&charged, now, &ops);
                    this.state.set(State::Settling {
                        settling: Box::new(Settling {
                            settle: Settle {
                                adjust: Some(adjust),
                                ops,
                                kept,
                                charged: Some(charged),
                            },
                            timeout: None,
                            resending: Some(resending),
                            fields,
                            result: Some(result),
                        }),
                    });
                }
                StateProj::Settling { settling } => {
                    let Settling {
                        settle,
                        timeout,
                        resending,
                        fields,
                        result,
                    } = &mut **settling;
                    let Settle {
                        adjust,
                        ops,
                        kept,
                        charged,
                    } = settle;
                    let adjusting = adjust.as_mut().expect("polled after completion");
                    let results = match adjusting.as_mut().poll(cx) {
                        Poll::Ready(results) => Some(results),
                        Poll::Pending if sent_again(resending, cx) => None,
                        Poll::Pending => {
                            let bound = &charged.as_ref().expect("polled after completion").bound;
                            let store_timeout = bound.policy.settings.store_timeout;
                            if let (None, Some(limit)) = (timeout.as_ref(), store_timeout) {
                                if tokio::runtime::Handle::try_current().is_ok() {
                                    *timeout = Some(Box::pin(tokio::time::sleep(limit)));
                                }
                            }
                            let Some(sleep) = timeout.as_mut() else {
                                return Poll::Pending;
                            };
                            ready!(sleep.as_mut().poll(cx));
                            None
                        }
                    };
                    // The response goes out: what the store has yet to
                    // apply carries on in its task.
                    let pending = adjust.take().filter(|_| results.is_none());
                    let charged = charged.take().expect("polled after completion");
                    let result = result.take().expect("polled after completion");
                    let (ops, kept) = (std::mem::take(ops), std::mem::take(kept));
                    if !*fields {
                        Kept::went_out(charged, ops, kept, results, pending);
                        return Poll::Ready(result.map(|r| r.map(ResponseBody::inner)));
                    }
                    // As the store answered, or, past its timeout, as the
                    // changes will leave the counters once they land.
                    let usage = match &results {
                        Some(results) => charge::settled(&charged.lines, &ops, &kept, results),
                        None => charge::expected(&charged.lines, &ops, &kept),
                    };
                    let result = result.map(|mut response| {
                        charged.finish(response.headers_mut(), Some(&usage));
                        response.map(ResponseBody::inner)
                    });
                    Kept::went_out(charged, ops, kept, results, pending);
                    return Poll::Ready(result);
                }
                StateProj::Rejected { response } => {
                    let response = response.take().expect("polled after completion");
                    return Poll::Ready(Ok((*response).map(ResponseBody::full)));
                }
            }
        }
    }
}

/// Whether `resending` tells that changes the store never sent are being
/// sent again (they carry on in their task: the response does not wait).
fn sent_again(resending: &mut Option<Resending>, cx: &mut Context<'_>) -> bool {
    let Some(receiver) = resending.as_mut() else {
        return false;
    };
    match Pin::new(receiver).poll(cx) {
        Poll::Ready(told) => {
            *resending = None;
            told.is_ok()
        }
        Poll::Pending => false,
    }
}

/// Applies `ops` to the lines of `charged`: refunds claim their line, so a
/// line is never given back twice.
fn adjust<E, St: Store>(
    charged: &Charged<E, St>,
    now: Timestamp,
    ops: &[(usize, Adjust)],
) -> Adjusting {
    adjust_kept(charged, now, ops).0
}

/// As [`adjust`], with which of `ops` were kept (a refund whose line was
/// given back already, or a change of a first-use counter that ended, is
/// left out), and what tells that some are being sent again.
fn adjust_kept<E, St: Store>(
    charged: &Charged<E, St>,
    now: Timestamp,
    ops: &[(usize, Adjust)],
) -> (Adjusting, Vec<bool>, Resending) {
    let mut kept = Vec::with_capacity(ops.len());
    let keyed: Vec<_> = ops
        .iter()
        .filter(|(i, op)| {
            let line = &charged.lines[*i];
            // A refund of all the line's cost gives the line back; a
            // deferred cost's refund of part of it, or its add, changes
            // what the request holds, which a give-back later (the
            // handler's, say) gives back whole.
            // A first-use counter whose period ended since is not the one
            // that was charged any more, even if a new one has the same key.
            let live = line.is_live(now);
            let claimed = match *op {
                Adjust::Refund(n) if n >= line.cost => line.claim_give_back().is_some(),
                Adjust::Refund(n) => line.change_held(|held| held.saturating_sub(n)),
                // On its way until the store answers it (see `apply`).
                Adjust::Add(n) if live => line.decide_add(n),
                Adjust::Add(n) => line.change_held(|held| held.saturating_add(n)),
            };
            let keep = claimed && live;
            kept.push(keep);
            keep
        })
        .map(|(i, op)| (*i, charged.lines[*i].key.clone(), *op))
        .collect();
    let (applied, resending) = apply(
        charged.bound.policy.store.clone(),
        now,
        keyed
            .iter()
            .map(|(i, key, op)| {
                let line = &charged.lines[*i];
                Change {
                    key: key.clone(),
                    adjust: *op,
                    made: line.charged_counter(charged.now),
                    resets_at: line.usage.resets_at,
                    line: Some(*i),
                }
            })
            .collect(),
        Some(Arc::clone(&charged.lines)),
    );
    let all: Vec<usize> = ops.iter().map(|(i, _)| *i).collect();
    let adjusting = Box::pin(async move {
        let results = applied.await;
        // Per op, in `ops`' order; `None` for an op left out.
        all.iter()
            .map(|i| {
                keyed
                    .iter()
                    .zip(&results)
                    .find(|((j, _, _), _)| j == i)
                    .and_then(|(_, r)| *r)
            })
            .collect()
    });
    (adjusting, kept, resending)
}

/// What a layer applies once its inner service answered, before the
/// response goes out. Dropped before that (a timeout further out, a client
/// gone), the response never went out and the request was not served:
/// what the layer charged goes back, changes included, once the changes
/// on their way landed.
pub(crate) struct Settle<E, St: Store> {
    adjust: Option<Adjusting>,
    ops: Vec<(usize, Adjust)>,
    /// Per op, whether `adjust` applies it.
    kept: Vec<bool>,
    charged: Option<Charged<E, St>>,
}

impl<E, St: Store> Drop for Settle<E, St> {
    fn drop(&mut self) {
        let (Some(charged), Some(adjusting)) = (self.charged.take(), self.adjust.take()) else {
            return;
        };
        charged.lines.give_back_inside();
        give_back_unserved(
            &charged,
            std::mem::take(&mut self.ops),
            &self.kept,
            adjusting,
        );
    }
}

/// Gives back what `charged` still holds of a request that turns out not
/// served, once `adjusting` (the changes `ops` of which `kept` were sent)
/// answered: per line, its cost less what was refunded, with what the
/// store says was added.
fn give_back_unserved<E, St: Store>(
    charged: &Charged<E, St>,
    ops: Vec<(usize, Adjust)>,
    kept: &[bool],
    adjusting: Adjusting,
) {
    let now = charged.bound.policy.settings.clock.now();
    // Claimed now, so that no other layer gives them back too.
    let lines: Vec<_> = charge::unserved(&charged.lines, &ops, kept, now)
        .into_iter()
        .map(|(i, amount)| {
            let line = &charged.lines[i];
            let refund = Change {
                key: line.key.clone(),
                adjust: Adjust::Refund(amount),
                made: line.charged_counter(charged.now),
                resets_at: line.usage.resets_at,
                line: None,
            };
            (i, amount, refund)
        })
        .collect();
    if lines.is_empty() {
        return;
    }
    let store = charged.bound.policy.store.clone();
    let clock = charged.bound.policy.settings.clock.clone();
    let work = async move {
        // After the changes: a refund before an add would leave the add.
        let results = adjusting.await;
        // Sent now, and sent again (if the store never sent it) within
        // what is left of the period from now.
        let now = clock.now();
        let back = lines
            .into_iter()
            .filter_map(|(i, amount, refund)| {
                let amount = amount.saturating_add(charge::added(&ops, &results, i));
                (amount > 0).then_some(Change {
                    adjust: Adjust::Refund(amount),
                    ..refund
                })
            })
            .collect();
        apply(store, now, back, None).0.await
    };
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn(work)),
        // Finished at once by a store that answers at once; logged
        // otherwise.
        Err(_) => detach(Box::pin(work)),
    }
}

/// What a layer kept charged once it answered, for the layers further out
/// (see [`GiveBack`]): its lines after `ops` (those `kept` were sent),
/// which the store answered with `results`, or, past the store's timeout,
/// will answer with `pending`.
struct Kept<E, St> {
    charged: Charged<E, St>,
    ops: Vec<(usize, Adjust)>,
    kept: Vec<bool>,
    results: Option<Vec<Option<u64>>>,
    pending: std::sync::Mutex<Option<Adjusting>>,
    given: std::sync::atomic::AtomicBool,
}

impl<E, St> Kept<E, St>
where
    E: SubjectExtractor,
    St: Store,
{
    /// The response of `charged`'s layer goes out, its lines after `ops`
    /// (see [`Kept`]): the layers further out that charged the request are
    /// told what it keeps; with none (the outermost), the layers further in
    /// learn that their request was served.
    #[inline]
    fn went_out(
        charged: Charged<E, St>,
        ops: Vec<(usize, Adjust)>,
        kept: Vec<bool>,
        results: Option<Vec<Option<u64>>>,
        pending: Option<Adjusting>,
    ) {
        if charged.is_nested() {
            Self::tell(charged, ops, kept, results, pending);
        } else {
            charged.lines.went_out();
        }
    }

    /// Tells the layers further out that charged the request what
    /// `charged` keeps. (What the layers further in told this one, each
    /// told those further out too.)
    #[cold]
    fn tell(
        mut charged: Charged<E, St>,
        ops: Vec<(usize, Adjust)>,
        kept: Vec<bool>,
        results: Option<Vec<Option<u64>>>,
        pending: Option<Adjusting>,
    ) {
        // Told to every layer further out, which each hold it: it holds
        // none of them.
        let outer = std::mem::take(&mut charged.outer);
        let kept: Arc<dyn GiveBack> = Arc::new(Kept {
            charged,
            ops,
            kept,
            results,
            pending: std::sync::Mutex::new(pending),
            given: std::sync::atomic::AtomicBool::new(false),
        });
        for lines in &outer {
            lines.tell(Arc::clone(&kept));
        }
    }
}

impl<E, St> GiveBack for Kept<E, St>
where
    E: SubjectExtractor,
    St: Store,
{
    fn give_back(&self) {
        if self.given.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        let pending = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let adjusting = match pending {
            Some(pending) => pending,
            None => Box::pin(std::future::ready(self.results.clone().unwrap_or_default())),
        };
        give_back_unserved(&self.charged, self.ops.clone(), &self.kept, adjusting);
    }
}
