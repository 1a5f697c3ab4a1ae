//! A `NOSCRIPT` is an answer: a charge that Redis answers slowly but
//! steadily, script cache emptied (a `SCRIPT FLUSH`, a restart, a
//! failover), is waited for through its two round trips.

#![cfg(feature = "redis")]

mod demo_server;
mod redis_support;

use std::future::IntoFuture;
use std::io::{Read, Write};
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use tower_quota::store::RedisStore;
use tower_quota::{FromHeader, Quota, QuotaPolicy};

/// Redis answers each call 150 ms after it came, well within the store's
/// 250 ms of silence: slow, not stalled. Its scripts were flushed, so a
/// charge's `EVALSHA` is answered `NOSCRIPT` (at 150 ms) and sent again as
/// an `EVAL` (answered at 300 ms, past the budget counted from when the
/// charge was sent, within it counted from Redis's last answer). Redis answered all along: the request
/// is served, not refused with a 503 (rule 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_after_a_script_flush_on_a_slow_redis_is_waited_for() {
    flushed_then_slow(Source::Url { batched: true }).await;
}

/// The same, charges sent each on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_not_batched_after_a_script_flush_on_a_slow_redis_is_waited_for() {
    flushed_then_slow(Source::Url { batched: false }).await;
}

/// The same, on a pool the app made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_on_an_apps_pool_after_a_script_flush_on_a_slow_redis_is_waited_for() {
    flushed_then_slow(Source::Pool).await;
}

enum Source {
    Url { batched: bool },
    Pool,
}

async fn flushed_then_slow(source: Source) {
    let server = redis_server_or_skip!();
    let proxy = redis_support::SlowProxy::start(server.port()).await;
    let builder = match source {
        Source::Url { batched } => RedisStore::builder(proxy.url())
            .pool_size(1)
            .batch_charges(batched),
        Source::Pool => RedisStore::builder_from_pool(
            deadpool_redis::Config::from_url(proxy.url())
                .builder()
                .unwrap()
                .max_size(1)
                .runtime(deadpool_redis::Runtime::Tokio1)
                .build()
                .unwrap(),
        ),
    };
    let store = builder.timeout(Duration::from_millis(250)).build().unwrap();
    store.preload().await.unwrap();
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .store_timeout(Some(Duration::from_millis(400)))
        .build();
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(policy.layer(Quota::daily(1_000)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(axum::serve(listener, app).into_future());
    let mut flush = std::net::TcpStream::connect(("127.0.0.1", server.port())).unwrap();

    let mut statuses = Vec::new();
    for _ in 0..5 {
        proxy.slow(Duration::ZERO);
        let before = demo_server::call(&addr, "GET", "/", &[("x-account-id", "acme")]).await;
        assert_eq!(before.status, 200);
        // Redis slows down, and forgets the script.
        proxy.slow(Duration::from_millis(150));
        flush
            .write_all(b"*2\r\n$6\r\nSCRIPT\r\n$5\r\nFLUSH\r\n")
            .unwrap();
        let mut reply = [0u8; 5];
        flush.read_exact(&mut reply).unwrap();
        assert_eq!(&reply, b"+OK\r\n");
        let reply = demo_server::call(&addr, "GET", "/", &[("x-account-id", "acme")]).await;
        statuses.push(reply.status);
        // The slow answers drain before the next round.
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    assert_eq!(
        statuses, [200; 5],
        "503s while Redis answered every call within 150 ms"
    );
}
