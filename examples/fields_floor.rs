//! The least a layer that tells each client where it stands can cost: a
//! reference for the demo server's figures over HTTP, not a quota.
//!
//! `GET /read` answers as the demo server does, through a middleware that
//! reads the subject from `x-account-id` (refusing a request without one)
//! and writes the two fields the quota layer writes on every answer:
//! `RateLimit-Policy` (the same value for every request) and `RateLimit`
//! (formatted per request). Nothing is counted: what is left is the cost of
//! reading the subject and of the fields themselves, over the wire too.
//!
//! With `--count`, the middleware is a tower layer of its own (as the quota
//! layer is, without the boxed future of `from_fn`) that does the least a
//! quota layer does per request: reads the subject, builds its counter's
//! key (namespace, subject, day, allowance; on the stack), counts it in a
//! map under a lock, puts where the subject stands in the request's
//! extensions, for the handler, and writes the two fields. No plans, zones,
//! refunds or nested layers: a floor under any quota layer that counts and
//! tells.
//!
//! ```sh
//! cargo run --release --example fields_floor -- --listen 127.0.0.1:3001 [--count]
//! ```
//!
//! `scripts/http-bench.sh` measures it with `--count` beside the demo
//! server (`BENCH_STORES=off,layer-floor,memory`).
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tower::Service;

use axum::{
    extract::Request,
    http::{HeaderName, HeaderValue, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};

#[path = "shared/floor.rs"]
mod floor;

const USAGE: &str = "usage: fields_floor --listen ADDR:PORT [--count]";

static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const POLICY: HeaderValue = HeaderValue::from_static("\"default\";q=1000000000;w=86400");

/// A number that changes per request, as a remaining count does.
static SERVED: AtomicU64 = AtomicU64::new(0);

async fn fields(request: Request, next: Next) -> Response {
    let mut ids = request.headers().get_all("x-account-id").iter();
    if !matches!((ids.next(), ids.next()), (Some(_), None)) {
        return (StatusCode::UNAUTHORIZED, "send one x-account-id header\n").into_response();
    }
    let response = next.run(request).await;
    let served = SERVED.fetch_add(1, Ordering::Relaxed);
    with_fields(
        response,
        1_000_000_000 - served % 1_000_000_000,
        86_400 - served % 86_400,
    )
}

/// The middleware of `--count`, as a tower layer (no boxed future): see
/// the module's docs.
#[derive(Clone)]
struct Counted<S> {
    inner: S,
    counts: Arc<floor::Counts>,
}

impl<S> Service<Request> for Counted<S>
where
    S: Service<Request, Response = Response, Error = Infallible>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = CountedFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request) -> Self::Future {
        let mut ids = request.headers().get_all("x-account-id").iter();
        let standing = match (ids.next(), ids.next()) {
            (Some(id), None) => floor::count(&self.counts, id.as_bytes()),
            _ => None,
        };
        let Some(standing) = standing else {
            let refused =
                (StatusCode::UNAUTHORIZED, "send one x-account-id header\n").into_response();
            return CountedFuture::Refused {
                response: Some(refused),
            };
        };
        request.extensions_mut().insert(standing);
        CountedFuture::Called {
            inner: self.inner.call(request),
            remaining: 1_000_000_000 - standing.used,
            resets_in: standing.resets_in,
        }
    }
}

pin_project_lite::pin_project! {
    #[project = CountedProj]
    enum CountedFuture<F> {
        Called {
            #[pin]
            inner: F,
            remaining: u64,
            resets_in: u64,
        },
        Refused {
            response: Option<Response>,
        },
    }
}

impl<F> Future for CountedFuture<F>
where
    F: Future<Output = Result<Response, Infallible>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            CountedProj::Called {
                inner,
                remaining,
                resets_in,
            } => {
                let response = ready!(inner.poll(cx))?;
                Poll::Ready(Ok(with_fields(response, *remaining, *resets_in)))
            }
            CountedProj::Refused { response } => {
                Poll::Ready(Ok(response.take().expect("polled after completion")))
            }
        }
    }
}

/// `response` with the two fields, for `remaining` calls left and a reset
/// in `resets_in` seconds.
fn with_fields(mut response: Response, remaining: u64, resets_in: u64) -> Response {
    let value = floor::ratelimit_value(remaining, resets_in);
    let headers = response.headers_mut();
    headers.insert(RATELIMIT_POLICY.clone(), POLICY);
    headers.insert(RATELIMIT.clone(), value);
    response
}

fn fail(message: &str) -> ! {
    eprintln!("fields_floor: {message}\n{USAGE}");
    std::process::exit(2)
}

#[tokio::main]
async fn main() {
    let mut listen: SocketAddr = ([127, 0, 0, 1], 3001).into();
    let mut count = false;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--count" => count = true,
            "--listen" => {
                let value = args
                    .next()
                    .unwrap_or_else(|| fail("--listen needs a value"));
                listen = value
                    .parse()
                    .unwrap_or_else(|_| fail(&format!("--listen {value:?}: expected ADDR:PORT")));
            }
            other => fail(&format!("unknown argument {other:?}")),
        }
    }
    let app = Router::new().route("/read", get(|| async { "read\n" }));
    let app = if count {
        let counts = Arc::new(floor::Counts::default());
        app.route_layer(tower::layer::layer_fn(move |inner| Counted {
            inner,
            counts: Arc::clone(&counts),
        }))
    } else {
        app.route_layer(middleware::from_fn(fields))
    };
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .unwrap_or_else(|e| fail(&format!("--listen {listen}: {e}")));
    println!(
        "listening on {}",
        listener.local_addr().expect("a bound listener")
    );
    axum::serve(listener, app).await.expect("the server runs");
}
