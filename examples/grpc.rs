//! A gRPC server behind a quota: the standard `grpc.health.v1.Health`
//! service (tonic-health), each call charged to the account named by the
//! `x-account-id` metadata entry.
//!
//! ```text
//! cargo run --example grpc -- --listen 127.0.0.1:50051 --limit 1000 --period 1d \
//!     [--anchor calendar|first-use]
//! ```
//!
//! gRPC metadata travels as HTTP/2 headers, so `FromHeader::account` reads
//! it. The layer sees `content-type: application/grpc` and answers a refused
//! call as gRPC: status `RESOURCE_EXHAUSTED` (8), a message naming the quota
//! and its reset, `retry-after` and the `ratelimit` fields in the metadata.
//! A call without `x-account-id` gets status `UNAUTHENTICATED` (16), the
//! reason in its message.
//!
//! Try it with grpcurl, given the health service's `.proto` (the server
//! offers no reflection):
//!
//! ```text
//! grpcurl -plaintext -proto health.proto -H 'x-account-id: acme' \
//!     127.0.0.1:50051 grpc.health.v1.Health/Check
//! ```
//!
//! `tests/grpc.rs` calls it with tonic's generated `HealthClient`.
//!
//! On Ctrl-C or SIGTERM the server stops taking connections, lets the calls
//! under way finish (5 s at most, or until a second signal), and exits.

#[path = "shared/period.rs"]
mod period;
// The first two signals only: the demo server uses the rest.
#[allow(dead_code)]
#[path = "shared/stop_signal.rs"]
mod stop_signal;

use std::net::SocketAddr;
use std::process::exit;
use std::time::Duration;

use period::parse_period;
use stop_signal::Stops;

use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;
use tower_quota::{Anchor, FromHeader, Period, Quota, QuotaLayer};

const USAGE: &str = "usage: grpc [--listen ADDR] [--limit N] \
[--period 10s|1m|1h|1d|1w|1mo|Ns|Nm|Nh] [--anchor calendar|first-use]";

struct Options {
    listen: SocketAddr,
    limit: u64,
    period: Period,
    anchor: Anchor,
}

fn fail(message: &str) -> ! {
    eprintln!("error: {message}\n{USAGE}");
    exit(2)
}

fn parse_args() -> Options {
    let mut options = Options {
        listen: "127.0.0.1:50051".parse().unwrap(),
        limit: 1000,
        period: Period::day(),
        anchor: Anchor::Calendar,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            exit(0);
        }
        if !["--listen", "--limit", "--period", "--anchor"].contains(&flag.as_str()) {
            fail(&format!("unknown flag {flag}"));
        }
        let value = args
            .next()
            .unwrap_or_else(|| fail(&format!("{flag} needs a value")));
        match flag.as_str() {
            "--listen" => {
                options.listen = value
                    .parse()
                    .unwrap_or_else(|_| fail(&format!("--listen {value:?}: expected ADDR:PORT")))
            }
            "--limit" => {
                options.limit = value.parse().unwrap_or_else(|_| {
                    fail(&format!("--limit {value:?}: expected a whole number"))
                })
            }
            "--period" => options.period = parse_period(&value).unwrap_or_else(|e| fail(&e)),
            "--anchor" => {
                options.anchor = match value.as_str() {
                    "calendar" => Anchor::Calendar,
                    "first-use" => Anchor::FirstUse,
                    _ => fail("--anchor takes calendar or first-use"),
                }
            }
            _ => unreachable!("{flag} is a known flag"),
        }
    }
    options
}

#[tokio::main]
async fn main() {
    // A signal from now on stops the server gracefully.
    let stops = Stops::listen();
    let options = parse_args();
    // Reports every service as SERVING.
    let (_reporter, health) = tonic_health::server::health_reporter();

    let quota = Quota::new(options.limit, options.period.clone(), options.anchor);
    let layer = QuotaLayer::new(quota, FromHeader::account("x-account-id"));

    let listener = tokio::net::TcpListener::bind(options.listen)
        .await
        .unwrap_or_else(|e| fail(&format!("cannot listen on {}: {e}", options.listen)));
    println!(
        "listening on http://{} ({} per {} {}, gRPC health service)",
        listener.local_addr().unwrap(),
        options.limit,
        options.period.name(),
        options.anchor,
    );
    // The layer wraps the whole tonic router: every call of every service is
    // charged.
    let serving = Server::builder()
        .layer(layer)
        .add_service(health)
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), stops.reached(1));
    // On a signal, calls under way finish: for `DRAIN` at most (a `Watch`
    // stream never ends, a stalled client never finishes its request), or
    // until a second signal.
    tokio::select! {
        served = serving => served.unwrap_or_else(|e| fail(&format!("server failed: {e}"))),
        () = async {
            stops.reached(1).await;
            tokio::select! {
                () = tokio::time::sleep(DRAIN) => {}
                () = stops.reached(2) => {}
            }
        } => eprintln!("calls still open when the server stopped were ended"),
    }
}

/// How long the server waits, once told to stop, for the calls under way
/// to finish.
const DRAIN: Duration = Duration::from_secs(5);
