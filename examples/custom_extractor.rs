//! A subject extractor of your own: charge the API key sent as a bearer
//! token, and tell apart a missing key (401) from a malformed one (400).
//!
//! ```text
//! cargo run --example custom_extractor
//! curl -i -H 'authorization: Bearer key_live_123' http://127.0.0.1:3000/
//! ```

use axum::{routing::get, Router};
use http::{header::AUTHORIZATION, request::Parts, HeaderValue};
use tower_quota::{Quota, QuotaLayer, Subject, SubjectError, SubjectExtractor, SubjectKind};

/// Charges the key in `authorization: Bearer key_...` to a subject kind of
/// its own, `api-key`.
struct BearerKey;

impl SubjectExtractor for BearerKey {
    fn extract(&self, parts: &Parts) -> Result<Subject, SubjectError> {
        let header = parts
            .headers
            .get(AUTHORIZATION)
            .ok_or(SubjectError::Missing)?;
        let key = header
            .as_bytes()
            .strip_prefix(b"Bearer ")
            .ok_or_else(|| SubjectError::malformed("expected `authorization: Bearer <key>`"))?;
        if !key.starts_with(b"key_") {
            return Err(SubjectError::malformed("API keys start with `key_`"));
        }
        Ok(Subject::new(SubjectKind::custom("api-key"), key))
    }

    // The kinds it answers: the support router refuses (404) any other, so
    // a typo in an admin tool resets nothing by mistake.
    fn kinds(&self) -> Option<Vec<SubjectKind>> {
        Some(vec![SubjectKind::custom("api-key")])
    }

    // What the 401 for a missing key tells the client to send
    // (`WWW-Authenticate`).
    fn challenge(&self) -> Option<HeaderValue> {
        Some(HeaderValue::from_static("Bearer"))
    }
}

#[tokio::main]
async fn main() {
    // 10 calls per minute and 1 000 per day, charged together.
    let layer = QuotaLayer::new(Quota::per_minute(10), BearerKey).quota(Quota::daily(1_000));
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(layer);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000")
        .await
        .unwrap();
    println!("listening on http://{}", listener.local_addr().unwrap());
    axum::serve(listener, app).await.unwrap();
}
