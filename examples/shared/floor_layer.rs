//! The floor of a quota layer as a tower service, written by hand around
//! an inner service: read the subject from `x-account-id`, build its
//! counter's key (on the stack), count it in a map under a lock, put where
//! the subject stands in the request's extensions for the handler, and
//! write the two fields into the response (the counting and the value are
//! `floor.rs`'s). No plans, zones, refunds, nested layers or policies: a
//! floor under any layer that counts and tells. Shared by `benches/layer.rs`
//! (its time) and `examples/layer_instructions.rs` (its instructions); the
//! including crate declares `floor.rs` as its module `floor`.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use http::{HeaderName, HeaderValue, Request, Response};
use tower::Service;

use crate::floor;

/// The header that names the subject.
pub const HEADER: &str = "x-account-id";

/// The limit of the floor's quota: more than a run ever spends on one
/// subject.
pub const LIMIT: u64 = 1 << 40;

pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// The `RateLimit-Policy` value of a daily quota of `LIMIT`.
pub const POLICY: HeaderValue = HeaderValue::from_static("\"default\";q=1099511627776;w=86400");

/// The floor around `inner` (see the module's docs).
#[derive(Clone)]
pub struct Floor<S> {
    inner: S,
    counts: Arc<floor::Counts>,
}

impl<S> Floor<S> {
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            counts: Arc::default(),
        }
    }
}

impl<S> Service<Request<()>> for Floor<S>
where
    S: Service<Request<()>, Response = Response<String>, Error = Infallible>,
{
    type Response = Response<String>;
    type Error = Infallible;
    type Future = FloorFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<()>) -> Self::Future {
        let id = request.headers().get(HEADER).expect("a subject");
        let standing = floor::count(&self.counts, id.as_bytes()).expect("a short id");
        request.extensions_mut().insert(standing);
        FloorFuture {
            inner: self.inner.call(request),
            remaining: LIMIT - standing.used,
            resets_in: standing.resets_in,
        }
    }
}

pin_project_lite::pin_project! {
    pub struct FloorFuture<F> {
        #[pin]
        inner: F,
        remaining: u64,
        resets_in: u64,
    }
}

impl<F> Future for FloorFuture<F>
where
    F: Future<Output = Result<Response<String>, Infallible>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut response = ready!(this.inner.poll(cx))?;
        let value = floor::ratelimit_value(*this.remaining, *this.resets_in);
        let headers = response.headers_mut();
        headers.insert(RATELIMIT_POLICY.clone(), POLICY);
        headers.insert(RATELIMIT.clone(), value);
        Poll::Ready(Ok(response))
    }
}
