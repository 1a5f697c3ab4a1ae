use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::header::{HeaderValue, RETRY_AFTER};
use http::{Request, Response, StatusCode};
use jiff::Timestamp;
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use crate::body::ResponseBody;
use crate::layer::{Config, OnStoreError};
use crate::response::{self, RateLimitFields};
use crate::status::{QuotaStatus, StatusEntry};
use crate::store::{ChargeOutcome, Store, StoreError, StoreErrorKind};

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
        Charging {
            #[pin]
            charge: St::ChargeFuture,
            #[pin]
            timeout: Option<Sleep>,
            pending: Option<Pending<S, ReqBody>>,
        },
        Calling {
            #[pin]
            future: S::Future,
            fields: Option<RateLimitFields>,
        },
        Rejected {
            response: Option<Response<Bytes>>,
        },
    }
}

/// What a charging request needs once the store has answered.
pub(crate) struct Pending<S, ReqBody> {
    inner: S,
    request: Request<ReqBody>,
    config: Arc<Config>,
    now: Timestamp,
    cost: u64,
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
        config: Arc<Config>,
        now: Timestamp,
        cost: u64,
    ) -> Self {
        Self {
            state: State::Charging {
                charge,
                timeout: None,
                pending: Some(Pending {
                    inner,
                    request,
                    config,
                    now,
                    cost,
                }),
            },
        }
    }

    pub(crate) fn calling(future: S::Future, fields: Option<RateLimitFields>) -> Self {
        Self {
            state: State::Calling { future, fields },
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
                    let result = match charge.poll(cx) {
                        Poll::Ready(result) => result,
                        Poll::Pending => {
                            let config = &pending.as_ref().expect("polled after completion").config;
                            // Stores that answer at once never arm a timer.
                            if timeout.is_none() {
                                if let Some(limit) = config.store_timeout {
                                    if tokio::runtime::Handle::try_current().is_ok() {
                                        timeout.set(Some(tokio::time::sleep(limit)));
                                    }
                                }
                            }
                            match timeout.as_pin_mut() {
                                Some(sleep) => {
                                    ready!(sleep.poll(cx));
                                    Err(StoreError::new(
                                        StoreErrorKind::Timeout,
                                        "the quota store did not answer in time",
                                    ))
                                }
                                None => return Poll::Pending,
                            }
                        }
                    };
                    let Pending {
                        mut inner,
                        mut request,
                        config,
                        now,
                        cost,
                    } = pending.take().expect("polled after completion");
                    let next = match result {
                        Ok(ChargeOutcome { admitted, usage }) => {
                            let fields = RateLimitFields::new(
                                &config.quotas,
                                &usage,
                                now,
                                &config.policy_cache,
                            );
                            if admitted {
                                let entries = config
                                    .quotas
                                    .iter()
                                    .zip(usage)
                                    .map(|(q, usage)| StatusEntry {
                                        name: q.shared_name(),
                                        usage,
                                    })
                                    .collect::<Arc<[StatusEntry]>>();
                                request.extensions_mut().insert(QuotaStatus::new(entries));
                                State::Calling {
                                    future: inner.call(request),
                                    fields: Some(fields),
                                }
                            } else {
                                let mut response =
                                    response::quota_exceeded(&config.quotas, &usage, cost, now);
                                fields.append_to(response.headers_mut());
                                State::Rejected {
                                    response: Some(response),
                                }
                            }
                        }
                        Err(error) => match config.on_store_error {
                            OnStoreError::FailOpen => {
                                tracing::warn!(%error, "quota store failed; request passes uncharged (fail open)");
                                State::Calling {
                                    future: inner.call(request),
                                    fields: None,
                                }
                            }
                            OnStoreError::FailClosed { retry_after } => {
                                tracing::error!(%error, "quota store failed; request refused (fail closed)");
                                let mut response = response::problem(
                                    StatusCode::SERVICE_UNAVAILABLE,
                                    "The quota service is unavailable; try again later.",
                                );
                                let secs = retry_after.as_secs()
                                    + u64::from(retry_after.subsec_nanos() > 0);
                                response
                                    .headers_mut()
                                    .insert(RETRY_AFTER, HeaderValue::from(secs.max(1)));
                                State::Rejected {
                                    response: Some(response),
                                }
                            }
                        },
                    };
                    this.state.set(next);
                }
                StateProj::Calling { future, fields } => {
                    let mut response = ready!(future.poll(cx))?;
                    if let Some(fields) = fields.take() {
                        fields.append_to(response.headers_mut());
                    }
                    return Poll::Ready(Ok(response.map(ResponseBody::inner)));
                }
                StateProj::Rejected { response } => {
                    let response = response.take().expect("polled after completion");
                    return Poll::Ready(Ok(response.map(ResponseBody::full)));
                }
            }
        }
    }
}
