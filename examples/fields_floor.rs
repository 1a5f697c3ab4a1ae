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
//! ```sh
//! cargo run --release --example fields_floor -- --listen 127.0.0.1:3001
//! ```
//!
//! `scripts/http-bench.sh` measures it beside the demo server
//! (`BENCH_STORES=off,fields,memory`).
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::{
    extract::Request,
    http::{HeaderName, HeaderValue, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};

const USAGE: &str = "usage: fields_floor --listen ADDR:PORT";

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
    let mut response = next.run(request).await;
    let served = SERVED.fetch_add(1, Ordering::Relaxed);
    let mut digits = itoa::Buffer::new();
    let mut value = Vec::with_capacity(48);
    value.extend_from_slice(b"\"default\";r=");
    value.extend_from_slice(
        digits
            .format(1_000_000_000 - served % 1_000_000_000)
            .as_bytes(),
    );
    value.extend_from_slice(b";t=");
    value.extend_from_slice(digits.format(86_400 - served % 86_400).as_bytes());
    let value = HeaderValue::from_maybe_shared(bytes::Bytes::from(value))
        .expect("digits and quotes are a valid field value");
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
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match flag.as_str() {
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
    let app = Router::new()
        .route("/read", get(|| async { "read\n" }))
        .route_layer(middleware::from_fn(fields));
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .unwrap_or_else(|e| fail(&format!("--listen {listen}: {e}")));
    println!(
        "listening on {}",
        listener.local_addr().expect("a bound listener")
    );
    axum::serve(listener, app).await.expect("the server runs");
}
