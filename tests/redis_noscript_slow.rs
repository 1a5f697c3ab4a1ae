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

/// A TCP proxy in front of Redis that passes each chunk of its answers on
/// `pace` after it came and `pace` after the one before (as
/// `redis_support::SlowProxy`), with `TCP_NODELAY` on both sides: a large
/// call (an `EVAL` with the script's text) is not held back by Nagle's
/// algorithm meeting a delayed ACK (some 40 ms).
struct Paced {
    addr: std::net::SocketAddr,
    pace_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Paced {
    async fn start(port: u16) -> Self {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let pace_ms = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let pace = std::sync::Arc::clone(&pace_ms);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(upstream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                    continue;
                };
                client.set_nodelay(true).unwrap();
                upstream.set_nodelay(true).unwrap();
                let (mut client_read, mut client_write) = client.into_split();
                let (mut upstream_read, mut upstream_write) = upstream.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut upstream_write).await;
                });
                let (chunks, mut paced) = tokio::sync::mpsc::unbounded_channel();
                tokio::spawn(async move {
                    let mut buffer = vec![0; 64 * 1024];
                    while let Ok(read @ 1..) = upstream_read.read(&mut buffer).await {
                        let came = tokio::time::Instant::now();
                        let _ = chunks.send((came, buffer[..read].to_vec()));
                    }
                });
                let pace = std::sync::Arc::clone(&pace);
                tokio::spawn(async move {
                    let mut last = tokio::time::Instant::now();
                    while let Some((came, chunk)) = paced.recv().await {
                        let pace = Duration::from_millis(pace.load(Ordering::SeqCst));
                        last = (came + pace).max(last + pace);
                        tokio::time::sleep_until(last).await;
                        if client_write.write_all(&chunk).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self { addr, pace_ms }
    }

    fn url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    fn slow(&self, pace: Duration) {
        let pace = u64::try_from(pace.as_millis()).unwrap();
        self.pace_ms
            .store(pace, std::sync::atomic::Ordering::SeqCst);
    }
}

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
    let proxy = Paced::start(server.port()).await;
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
