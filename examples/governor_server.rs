//! Another rate limiter behind the same route: a reference for the demo
//! server's figures over HTTP, not a quota.
//!
//! `GET /read` answers as the demo server does, behind a
//! [`tower_governor`] layer (a GCRA per key in memory) keyed, as the demo
//! server's subject, by the raw bytes of the `x-account-id` header: a
//! missing header is 401, the header sent twice 400, as behind the quota
//! layer. The runtime is the demo server's (`#[tokio::main]`, one worker
//! per core), and so is the serving (graceful shutdown on Ctrl-C).
//!
//! ```sh
//! cargo run --release --example governor_server -- \
//!     --listen 127.0.0.1:3002 [--burst 1000000000] [--replenish-ns 1]
//! ```
//!
//! Each account may send `--burst` requests at once, and one more every
//! `--replenish-ns` nanoseconds; the defaults are far beyond what a
//! benchmark sends, so nothing is refused. A refused request is 429.
//!
//! `scripts/http-bench.sh` measures it beside the demo server
//! (`BENCH_STORES=off,memory,governor`).
use std::net::SocketAddr;
use std::process::exit;
use std::time::Duration;

use axum::{routing::get, Router};
use http::{Request, StatusCode};
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::KeyExtractor;
use tower_governor::{GovernorError, GovernorLayer};

const USAGE: &str = "usage: governor_server [--listen ADDR:PORT] [--burst N] [--replenish-ns N]";

/// The key: the raw bytes of the `x-account-id` header.
#[derive(Clone, Copy, Debug)]
struct AccountHeader;

impl KeyExtractor for AccountHeader {
    type Key = Box<[u8]>;

    fn extract<T>(&self, request: &Request<T>) -> Result<Self::Key, GovernorError> {
        let refuse = |code, msg: &str| GovernorError::Other {
            code,
            msg: Some(msg.to_owned()),
            headers: None,
        };
        let mut values = request.headers().get_all("x-account-id").iter();
        let value = values
            .next()
            .ok_or_else(|| refuse(StatusCode::UNAUTHORIZED, "send x-account-id\n"))?;
        if values.next().is_some() {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                "the x-account-id header is sent more than once\n",
            ));
        }
        Ok(value.as_bytes().into())
    }
}

fn fail(message: &str) -> ! {
    eprintln!("governor_server: {message}\n{USAGE}");
    exit(2)
}

#[tokio::main]
async fn main() {
    let mut listen: SocketAddr = ([127, 0, 0, 1], 3002).into();
    let mut burst: u32 = 1_000_000_000;
    let mut replenish_ns: u64 = 1;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            exit(0);
        }
        let value = args
            .next()
            .unwrap_or_else(|| fail(&format!("{flag} needs a value")));
        let positive =
            |value: &str| -> u64 {
                value.parse().ok().filter(|&n| n > 0).unwrap_or_else(|| {
                    fail(&format!("{flag} {value:?}: expected a positive number"))
                })
            };
        match flag.as_str() {
            "--listen" => {
                listen = value
                    .parse()
                    .unwrap_or_else(|_| fail(&format!("--listen {value:?}: expected ADDR:PORT")))
            }
            "--burst" => {
                burst = positive(&value)
                    .try_into()
                    .unwrap_or_else(|_| fail(&format!("--burst {value:?}: at most {}", u32::MAX)))
            }
            "--replenish-ns" => replenish_ns = positive(&value),
            _ => fail(&format!("unknown flag {flag}")),
        }
    }

    let config = GovernorConfigBuilder::default()
        .key_extractor(AccountHeader)
        .burst_size(burst)
        .period(Duration::from_nanos(replenish_ns))
        .finish()
        .expect("a burst and a period above zero");
    // A quiet server still gives back the memory of keys back to a full
    // burst, as the demo server purges its ended periods.
    let limiter = config.limiter().clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(10));
        loop {
            every.tick().await;
            limiter.retain_recent();
        }
    });

    let app = Router::new()
        .route("/read", get(|| async { "read\n" }))
        .route_layer(GovernorLayer::new(config));
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .unwrap_or_else(|e| fail(&format!("cannot listen on {listen}: {e}")));
    println!(
        "listening on http://{} ({burst} at once per account, one more every {replenish_ns} ns)",
        listener.local_addr().expect("a bound listener"),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .expect("the server runs");
}
