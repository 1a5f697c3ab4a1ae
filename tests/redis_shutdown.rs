//! A graceful shutdown after Redis was away: what `settle_owed` leaves
//! behind once the process exits.

#![cfg(feature = "redis")]

mod demo_server;
mod redis_support;

use std::future::IntoFuture;
use std::time::Duration;

use axum::extract::Path;
use axum::routing::get;
use axum::Router;
use http::StatusCode;
use tower_quota::jiff::Timestamp;
use tower_quota::store::RedisStore;
use tower_quota::{FromHeader, Quota, QuotaPolicy, Subject};

use redis_support::RedisServer;

/// A request served (200, its deferred cost 5 where 1 was charged up
/// front) and one answered 500 (given back: `refund_server_errors`), each
/// while Redis refused writes (out of memory under `noeviction`: the
/// change after the response is refused, unsent, and waits to be sent
/// again). Redis takes writes again, and the application shuts down as
/// the README says: `settle_owed`, then the process exits (its runtime
/// goes). The counter then holds the 200's 5 units and nothing of the
/// 500, as it does when the process lives on a few seconds more: a change
/// waiting to be sent again is not lost with the process.
#[test]
fn changes_waiting_to_be_sent_again_land_before_settle_owed_returns() {
    if !redis_support::redis_available() {
        return;
    }
    let server = RedisServer::start();
    let port = server.port();
    let quota = Quota::daily(1_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (policy, statuses) = runtime.block_on(async {
        let store = RedisStore::new(server.url()).unwrap();
        let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store)
            .refund_server_errors(true)
            .build();
        let app = Router::new()
            .route(
                "/{status}/{tokens}",
                get(move |Path((status, tokens)): Path<(u16, u64)>| async move {
                    // Redis fills up while the request is served.
                    tokio::task::spawn_blocking(move || {
                        redis_support::cli(port, &["config", "set", "maxmemory", "1"])
                    })
                    .await
                    .unwrap();
                    (
                        StatusCode::from_u16(status).unwrap(),
                        [("x-tokens", tokens.to_string())],
                    )
                }),
            )
            .route_layer(policy.layer(quota.clone()).deferred_cost(1, |response| {
                response
                    .headers
                    .get("x-tokens")
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .unwrap_or(1)
            }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(axum::serve(listener, app).into_future());
        let mut statuses = Vec::new();
        for path in ["/200/5", "/500/1"] {
            let reply = demo_server::call(&addr, "GET", path, &[("x-account-id", "acme")]).await;
            statuses.push(reply.status);
            // The fault clears.
            assert_eq!(server.cli(&["config", "set", "maxmemory", "0"]), "OK");
        }
        // The graceful shutdown.
        let owed = policy.settle_owed(Duration::from_secs(5)).await;
        assert_eq!(owed.units, 0);
        (policy, statuses)
    });
    assert_eq!(statuses, [200, 500]);
    // The process exits.
    runtime.shutdown_timeout(Duration::ZERO);
    std::thread::sleep(Duration::from_millis(500));
    let key = quota.key(
        policy.namespace(),
        &Subject::account("acme"),
        Timestamp::now(),
    );
    let held: u64 = server
        .cli(&["hget", key.as_str(), "n"])
        .parse()
        .unwrap_or(0);
    assert_eq!(
        held, 5,
        "the 200 counts its 5 units, the 500 nothing: held {held}"
    );
}
