use std::fmt;
use std::mem;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response, StatusCode};
use tower_service::Service;

use crate::body::ResponseBody;
use crate::future::ResponseFuture;
use crate::layer::{Config, SubjectPolicy};
use crate::response;
use crate::store::{ChargeRequest, Store};
use crate::subject::{Subject, SubjectError, SubjectExtractor};

/// The service of a [`QuotaLayer`](crate::QuotaLayer): charges each request
/// before calling the inner service.
pub struct QuotaService<S, E, St> {
    inner: S,
    config: Arc<Config>,
    extractor: Arc<E>,
    store: St,
}

impl<S, E, St> QuotaService<S, E, St> {
    pub(crate) fn new(inner: S, config: Arc<Config>, extractor: Arc<E>, store: St) -> Self {
        Self {
            inner,
            config,
            extractor,
            store,
        }
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

impl<S: Clone, E, St: Clone> Clone for QuotaService<S, E, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: Arc::clone(&self.config),
            extractor: Arc::clone(&self.extractor),
            store: self.store.clone(),
        }
    }
}

impl<S: fmt::Debug, E, St: fmt::Debug> fmt::Debug for QuotaService<S, E, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaService")
            .field("inner", &self.inner)
            .field("quotas", &self.config.quotas)
            .field("store", &self.store)
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

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let config = &self.config;
        let (parts, body) = request.into_parts();

        let subject = match self
            .extractor
            .extract(&parts)
            .and_then(|s| check_len(s, config.max_subject_len))
        {
            Ok(subject) => subject,
            Err(error) => {
                let (policy, default_status) = match &error {
                    SubjectError::Missing => (config.on_missing, StatusCode::UNAUTHORIZED),
                    SubjectError::Malformed(_) => (config.on_malformed, StatusCode::BAD_REQUEST),
                };
                return match policy {
                    SubjectPolicy::Allow => {
                        tracing::trace!(%error, "request without a usable subject passes uncharged");
                        ResponseFuture::calling(
                            self.inner.call(Request::from_parts(parts, body)),
                            None,
                        )
                    }
                    SubjectPolicy::Reject(status) => {
                        let status = if status.is_client_error() || status.is_server_error() {
                            status
                        } else {
                            default_status
                        };
                        tracing::debug!(%error, %status, "request rejected: no usable subject");
                        ResponseFuture::rejected(response::problem(status, &error.to_string()))
                    }
                };
            }
        };

        let cost = match config.cost.of(&parts) {
            Ok(cost) => cost,
            Err(error) => {
                tracing::debug!(%error, "request rejected: invalid cost");
                return ResponseFuture::rejected(response::problem(
                    StatusCode::BAD_REQUEST,
                    &error.0,
                ));
            }
        };

        let now = config.clock.now();
        let lines = config
            .quotas
            .iter()
            .map(|quota| quota.line(&config.namespace, &subject, now, cost))
            .collect();
        let charge = self.store.charge(ChargeRequest { now, lines });

        let request = Request::from_parts(parts, body);
        // Call the instance that `poll_ready` readied, and keep a clone for
        // the next request.
        let clone = self.inner.clone();
        let inner = mem::replace(&mut self.inner, clone);
        ResponseFuture::charging(charge, inner, request, Arc::clone(config), now, cost)
    }
}

fn check_len(subject: Subject, max: usize) -> Result<Subject, SubjectError> {
    let id = subject.id();
    if id.is_empty() || id.iter().all(u8::is_ascii_whitespace) {
        Err(SubjectError::malformed("the subject id is empty"))
    } else if id.len() > max {
        Err(SubjectError::Malformed(
            format!("the subject id is longer than {max} bytes").into(),
        ))
    } else {
        Ok(subject)
    }
}
