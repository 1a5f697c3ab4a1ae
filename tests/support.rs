//! The support router: what it logs, what it accepts, how it answers errors.

use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Method, Request, Response, StatusCode};
use tower::ServiceExt;
use tower_quota::{FromHeader, Quota, QuotaPolicy};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// One event's or span's fields, as text (an event's message is its
/// `message` field).
type Fields = Vec<(String, String)>;

/// Every event and span of the crate, with its level.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<(tracing::Level, Fields)>>>);

struct Collect<'a>(&'a mut Fields);

impl Visit for Collect<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name().to_owned(), value.to_owned()));
    }
}

impl Subscriber for Logs {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.target().starts_with("tower_quota")
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut logs = self.0.lock().unwrap();
        let mut fields = Vec::new();
        span.record(&mut Collect(&mut fields));
        logs.push((*span.metadata().level(), fields));
        Id::from_u64(logs.len() as u64)
    }
    fn record(&self, span: &Id, values: &Record<'_>) {
        let mut logs = self.0.lock().unwrap();
        let index = span.into_u64() as usize - 1;
        values.record(&mut Collect(&mut logs[index].1));
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = Vec::new();
        event.record(&mut Collect(&mut fields));
        self.0
            .lock()
            .unwrap()
            .push((*event.metadata().level(), fields));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

fn field<'a>(fields: &'a Fields, name: &str) -> Option<&'a str> {
    fields
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// An app charging `read` per account, and the support router of its policy
/// under `/admin`.
fn apps() -> (Router, Router) {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(policy.layer(Quota::daily(10).allowance("read")));
    let admin = Router::new().nest("/admin", policy.handle().router());
    (app, admin)
}

async fn send(app: &Router, method: Method, uri: &str) -> Response<Body> {
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .header("x-account-id", "sk_live_secret_key")
        .body(Body::empty())
        .unwrap();
    app.clone().oneshot(request).await.unwrap()
}

#[tokio::test(flavor = "current_thread")]
async fn support_logs_name_the_subject_by_kind_and_hash_never_by_id() {
    let logs = Logs::default();
    let _guard = tracing::subscriber::set_default(logs.clone());
    let (app, admin) = apps();
    for _ in 0..3 {
        assert_eq!(send(&app, Method::GET, "/").await.status(), StatusCode::OK);
    }
    let reset = "/admin/reset/account/sk_live_secret_key/read";
    assert_eq!(
        send(&admin, Method::POST, reset).await.status(),
        StatusCode::OK
    );
    send(&app, Method::GET, "/").await;
    let refund = "/admin/refund/account/sk_live_secret_key/read?amount=1";
    assert_eq!(
        send(&admin, Method::POST, refund).await.status(),
        StatusCode::OK
    );

    let logs = logs.0.lock().unwrap();
    for (_, fields) in logs.iter() {
        assert!(
            fields.iter().all(|(_, v)| !v.contains("secret")),
            "{fields:?}"
        );
    }
    let support: Vec<_> = logs
        .iter()
        .filter(|(level, fields)| {
            *level == tracing::Level::INFO
                && field(fields, "message").is_some_and(|m| m.contains("by support"))
        })
        .map(|(_, fields)| fields)
        .collect();
    assert_eq!(support.len(), 2, "{logs:?}");
    let hashes: Vec<_> = support
        .iter()
        .map(|fields| {
            assert_eq!(field(fields, "subject.kind"), Some("account"), "{fields:?}");
            assert_eq!(field(fields, "allowance"), Some("read"), "{fields:?}");
            let hash = field(fields, "subject.hash").expect("a subject.hash field");
            assert_eq!(hash.len(), 8, "{hash}");
            assert!(hash.bytes().all(|b| b.is_ascii_hexdigit()), "{hash}");
            hash
        })
        .collect();
    assert_eq!(hashes[0], hashes[1]);
    assert_eq!(field(support[1], "amount"), Some("1"));
}
