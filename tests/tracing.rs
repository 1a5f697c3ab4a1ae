//! One debug span per decision, naming the subject only by a short hash.

use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_quota::{FromHeader, Quota, QuotaPolicy};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// One span's fields, as text.
type SpanFields = Vec<(String, String)>;

/// The fields of every `quota` span, and the span of each event.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<SpanFields>>>, Arc<Mutex<Vec<Option<u64>>>>);

struct Fields<'a>(&'a mut Vec<(String, String)>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name().to_owned(), value.to_owned()));
    }
}

impl Subscriber for Spans {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.target().starts_with("tower_quota")
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut spans = self.0.lock().unwrap();
        let mut fields = Vec::new();
        span.record(&mut Fields(&mut fields));
        spans.push(fields);
        Id::from_u64(spans.len() as u64)
    }
    fn record(&self, span: &Id, values: &Record<'_>) {
        let mut spans = self.0.lock().unwrap();
        let index = span.into_u64() as usize - 1;
        values.record(&mut Fields(&mut spans[index]));
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let parent = event.parent().map(Id::into_u64);
        self.1.lock().unwrap().push(parent);
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[tokio::test(flavor = "current_thread")]
async fn every_decision_has_a_span_without_the_subject_id() {
    let spans = Spans::default();
    let _guard = tracing::subscriber::set_default(spans.clone());
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(policy.layer(Quota::daily(1).allowance("read")));
    let call = || {
        Request::get("/")
            .header("x-account-id", "sk_live_secret_key")
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(
        app.clone().oneshot(call()).await.unwrap().status(),
        StatusCode::OK
    );
    assert_eq!(
        app.clone().oneshot(call()).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let events = Arc::clone(&spans.1);
    let spans = spans.0.lock().unwrap();
    assert_eq!(spans.len(), 2, "{spans:?}");
    let field = |span: &SpanFields, name: &str| {
        span.iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("no {name} in {span:?}"))
    };
    assert_eq!(field(&spans[0], "outcome"), "admitted");
    assert_eq!(field(&spans[1], "outcome"), "refused");
    for span in spans.iter() {
        assert_eq!(field(span, "subject.kind"), "account");
        assert_eq!(field(span, "allowance"), "read");
        assert_eq!(field(span, "anchor"), "calendar");
        let hash = field(span, "subject.hash");
        assert_eq!(hash.len(), 8, "{hash}");
        assert!(span.iter().all(|(_, v)| !v.contains("secret")), "{span:?}");
    }
    assert_eq!(
        field(&spans[0], "subject.hash"),
        field(&spans[1], "subject.hash")
    );
    // Each decision is an event in its span: what a log of events (a
    // plain `fmt` subscriber) prints the span by.
    let events = events.lock().unwrap();
    for span in [1, 2] {
        assert_eq!(
            events
                .iter()
                .filter(|&&parent| parent == Some(span))
                .count(),
            1,
            "{events:?}"
        );
    }
}

/// Every event's message and level.
#[derive(Clone, Default)]
struct Messages(Arc<Mutex<Vec<(tracing::Level, String)>>>);

impl Subscriber for Messages {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.target().starts_with("tower_quota")
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = Vec::new();
        event.record(&mut Fields(&mut fields));
        let message = fields
            .into_iter()
            .find(|(name, _)| name == "message")
            .map(|(_, m)| m)
            .unwrap_or_default();
        let level = *event.metadata().level();
        self.0.lock().unwrap().push((level, message));
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// A layer of shadow quotas passes a request it cannot charge: the logs say
/// it passed, never that it was refused (an operator watching a shadow
/// rollout at `debug` would count refusals that never happened).
#[tokio::test(flavor = "current_thread")]
async fn a_shadow_layer_logs_no_refusal_for_a_request_it_passes() {
    let messages = Messages::default();
    let _guard = tracing::subscriber::set_default(messages.clone());
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(policy.layer(Quota::daily(1).allowance("read").shadow()));
    for request in [
        Request::get("/").body(Body::empty()).unwrap(),
        Request::get("/")
            .header("x-account-id", " ")
            .body(Body::empty())
            .unwrap(),
    ] {
        assert_eq!(
            app.clone().oneshot(request).await.unwrap().status(),
            StatusCode::OK
        );
    }
    let logged = messages.0.lock().unwrap().clone();
    assert!(
        logged
            .iter()
            .all(|(_, message)| !message.contains("refused")),
        "{logged:?}"
    );
    assert_eq!(logged.len(), 2, "{logged:?}");
}

/// A layer of shadow quotas that cannot tell who a request is from (no
/// `ConnectInfo` for `ClientIp`) lets it through: the setup mistake is
/// logged, but never as a 500 the client did not get.
#[tokio::test(flavor = "current_thread")]
async fn a_shadow_layer_without_subjects_does_not_log_500s_it_never_answers() {
    let messages = Messages::default();
    let _guard = tracing::subscriber::set_default(messages.clone());
    let policy = QuotaPolicy::builder(tower_quota::subject::ClientIp::new()).build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(policy.layer(Quota::daily(1).shadow()));
    let request = Request::get("/").body(Body::empty()).unwrap();
    assert_eq!(app.oneshot(request).await.unwrap().status(), StatusCode::OK);
    let logged = messages.0.lock().unwrap().clone();
    assert!(!logged.is_empty(), "the setup mistake is logged");
    assert!(
        logged
            .iter()
            .all(|(_, message)| !message.contains("500") && !message.contains("refused")),
        "{logged:?}"
    );
}
