use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::charge::{self, Step};
use super::future::ResponseFuture;
use super::layer::Bound;
use crate::body::ResponseBody;
use crate::status::QuotaStatus;
use crate::store::Store;
use crate::subject::SubjectExtractor;

/// The service of a [`QuotaLayer`](crate::QuotaLayer): charges each request
/// before calling the inner service.
pub struct QuotaService<S, E, St> {
    inner: S,
    bound: Arc<Bound<E, St>>,
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
            .field("quotas", &self.bound.scope.quotas)
            .field("store", &self.bound.policy.store)
            .finish()
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
    type Future = ResponseFuture<S, E, St, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    /// Decides what this layer charges (see `charge::plan`), then passes,
    /// rejects, or charges: when the store answers at once, the inner
    /// service is called here; otherwise the future calls it once the store
    /// answered.
    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let (mut parts, body) = request.into_parts();
        match charge::plan(&self.bound, &parts) {
            Step::Pass => {
                let layer = crate::status::layer_id(&self.bound);
                QuotaStatus::let_through_in(&parts.extensions, layer);
                QuotaStatus::ensure_in(&mut parts.extensions);
                ResponseFuture::passing(self.inner.call(Request::from_parts(parts, body)))
            }
            Step::PassUncounted(ticket) => {
                let layer = crate::status::layer_id(&self.bound);
                QuotaStatus::let_through_in(&parts.extensions, layer);
                QuotaStatus::put_in(&mut parts.extensions, ticket);
                ResponseFuture::passing(self.inner.call(Request::from_parts(parts, body)))
            }
            Step::Owe(charge) => {
                let owing = super::owing::owe(&self.bound, charge, &mut parts.extensions);
                let future = self.inner.call(Request::from_parts(parts, body));
                ResponseFuture::owing(future, owing)
            }
            Step::Reject(response) => {
                QuotaStatus::refuse_in(&parts.extensions, crate::status::layer_id(&self.bound));
                ResponseFuture::rejected(charge::marked(response))
            }
            Step::Charge(ref mut charge) => {
                let request = Request::from_parts(parts, body);
                ResponseFuture::sent(&mut self.inner, request, charge, &self.bound)
            }
        }
    }
}
