//! The one-line quota: 1 000 calls per calendar day (UTC) per account.
//!
//! ```text
//! cargo run --example daily
//! curl -i -H 'x-account-id: acme' http://127.0.0.1:3000/
//! ```

use axum::{routing::get, Router};
use tower_quota::{FromHeader, QuotaLayer};

#[tokio::main]
async fn main() {
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(QuotaLayer::daily(
            1_000,
            FromHeader::account("x-account-id"),
        ));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000")
        .await
        .unwrap();
    println!("listening on http://{}", listener.local_addr().unwrap());
    axum::serve(listener, app).await.unwrap();
}
