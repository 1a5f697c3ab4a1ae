//! The least a request that waits on Redis can cost: a reference for the
//! demo server's figures over HTTP, not a quota.
//!
//! `GET /read` sends one command per request on a multiplexed redis-rs
//! connection (the client the Redis store is built on) and answers as the
//! demo server does. No layer, no script logic, no batching: what is left
//! is the round trip itself, as an async server pays for it. With `--eval`
//! the command is an `EVALSHA` of a one-line script (`INCR` inside Lua),
//! the cheapest a script-based counter can be; otherwise a plain `INCR`.
//!
//! ```sh
//! cargo run --release --features redis --example redis_floor -- \
//!     --listen 127.0.0.1:3001 --redis redis://127.0.0.1:6379/ [--eval]
//! ```
//!
//! `scripts/http-bench.sh` measures it beside the demo server
//! (`BENCH_STORES=off,redis,floor`).
use std::net::SocketAddr;

use axum::{http::HeaderMap, routing::get, Router};
use deadpool_redis::redis::{self, aio::MultiplexedConnection, Script};

const USAGE: &str = "usage: redis_floor --listen ADDR:PORT --redis URL [--eval]";

#[derive(Clone)]
struct Floor {
    conn: MultiplexedConnection,
    /// The one-line script, when `--eval`.
    script: Option<Script>,
}

impl Floor {
    async fn count(&self, headers: &HeaderMap) -> redis::RedisResult<i64> {
        let id = headers
            .get("x-account-id")
            .map(|value| value.as_bytes())
            .unwrap_or(b"anonymous");
        let mut key = Vec::with_capacity(6 + id.len());
        key.extend_from_slice(b"floor:");
        key.extend_from_slice(id);
        let mut conn = self.conn.clone();
        match &self.script {
            Some(script) => script.key(key).invoke_async(&mut conn).await,
            None => redis::cmd("INCR").arg(key).query_async(&mut conn).await,
        }
    }
}

fn fail(message: &str) -> ! {
    eprintln!("redis_floor: {message}\n{USAGE}");
    std::process::exit(2)
}

#[tokio::main]
async fn main() {
    let mut listen: SocketAddr = ([127, 0, 0, 1], 3001).into();
    let mut url = None;
    let mut eval = false;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--eval" => eval = true,
            "--listen" | "--redis" => {
                let value = args
                    .next()
                    .unwrap_or_else(|| fail(&format!("{flag} needs a value")));
                if flag == "--listen" {
                    listen = value.parse().unwrap_or_else(|_| {
                        fail(&format!("--listen {value:?}: expected ADDR:PORT"))
                    });
                } else {
                    url = Some(value);
                }
            }
            other => fail(&format!("unknown argument {other:?}")),
        }
    }
    let url = url.unwrap_or_else(|| fail("--redis is required"));
    let client = redis::Client::open(url.as_str())
        .unwrap_or_else(|e| fail(&format!("--redis {url:?}: {e}")));
    let conn = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| fail(&format!("{url}: {e}")));
    let floor = Floor {
        conn,
        script: eval.then(|| Script::new("return redis.call('INCR', KEYS[1])")),
    };
    let app = Router::new().route(
        "/read",
        get(move |headers: HeaderMap| {
            let floor = floor.clone();
            async move {
                match floor.count(&headers).await {
                    Ok(_) => (http::StatusCode::OK, "read\n"),
                    Err(_) => (http::StatusCode::SERVICE_UNAVAILABLE, "redis failed\n"),
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .unwrap_or_else(|e| fail(&format!("--listen {listen}: {e}")));
    println!(
        "listening on {}",
        listener.local_addr().expect("a bound listener")
    );
    axum::serve(listener, app).await.expect("the server runs");
}
