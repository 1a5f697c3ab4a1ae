//! Throttled log lines never lose, nor make up, the count of the lines
//! they left out.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_quota::{FromHeader, Quota, QuotaPolicy};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// The `suppressed` field of each warning about nested quotas of one name.
#[derive(Clone, Default)]
struct SameNames(Arc<Mutex<Vec<u64>>>);

#[derive(Default)]
struct Fields {
    same_names: bool,
    suppressed: Option<u64>,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.same_names = format!("{value:?}").contains("two quotas of one name");
        }
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "suppressed" {
            self.suppressed = Some(value);
        }
    }
}

impl Subscriber for SameNames {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.target().starts_with("tower_quota")
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        if fields.same_names {
            let suppressed = fields.suppressed.expect("a count of the lines left out");
            self.0.lock().unwrap().push(suppressed);
        }
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// Nested layers of two policies whose quotas share a name are logged at
/// most once a second, each line with the count of those left out since
/// the last: every request that told clients two quotas of one name is
/// either logged or counted in a later line. A request whose nested
/// quotas have names of their own is neither: it is no such line.
#[tokio::test(flavor = "current_thread")]
async fn nested_quotas_of_one_name_are_logged_or_counted_each_time() {
    let names = SameNames::default();
    let _guard = tracing::subscriber::set_default(names.clone());
    let outer = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let inner = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let app = Router::new()
        .merge(
            Router::new()
                .route("/same", get(|| async { "same" }))
                .route_layer(inner.layer(Quota::daily(100).named("day"))),
        )
        .merge(
            Router::new()
                .route("/own", get(|| async { "own" }))
                .route_layer(inner.layer(Quota::hourly(100).named("hour"))),
        )
        .route_layer(outer.layer(Quota::daily(100).named("day")));
    let call = |path: &str| {
        let request = Request::get(path)
            .header("x-account-id", "acme")
            .body(Body::empty())
            .unwrap();
        let app = app.clone();
        async move {
            assert_eq!(app.oneshot(request).await.unwrap().status(), StatusCode::OK);
        }
    };
    let mut same = 0;
    for _ in 0..3 {
        call("/same").await;
        same += 1;
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    call("/own").await;
    call("/same").await;
    same += 1;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // The next second's first line tells what was left out before it.
    call("/same").await;
    same += 1;
    let logged = names.0.lock().unwrap().clone();
    let told = logged.len() as u64 + logged.iter().sum::<u64>();
    assert_eq!(
        told, same,
        "{same} requests with two quotas of one name, lines with suppressed = {logged:?}"
    );
}
