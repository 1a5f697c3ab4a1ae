//! The support router: what it logs, what it accepts, how it answers errors.

mod interest;

use std::sync::{Arc, Mutex};

#[allow(dead_code)]
mod rigged;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Method, Request, Response, StatusCode};
use std::time::Duration;
use tower::ServiceExt;

use jiff::tz::TimeZone;
use tower_quota::{FromHeader, ManualClock, Quota, QuotaPolicy, Subject};
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
    let _interest = interest::every_subscriber_asked();
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

/// Every support route (standing, reset, refund of `read`) answers a
/// problem 400 for the subject of `kind` named `id` (as in the path).
async fn every_route_refuses(admin: &Router, kind: &str, id: &str) {
    for (method, uri) in [
        (Method::GET, format!("/admin/quota/{kind}/{id}")),
        (Method::POST, format!("/admin/reset/{kind}/{id}/read")),
        (
            Method::POST,
            format!("/admin/refund/{kind}/{id}/read?amount=1"),
        ),
    ] {
        let response = send(admin, method, &uri).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{uri}");
        assert_eq!(problem(response).await["status"], 400, "{uri}");
    }
}

async fn problem(response: Response<Body>) -> serde_json::Value {
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json",
        "{response:?}"
    );
    let body = axum::body::to_bytes(response.into_body(), 1 << 16)
        .await
        .unwrap();
    serde_json::from_slice(&body).unwrap()
}

/// What `method` on `uri` answers in its problem document's `detail`,
/// once its status is checked.
async fn detail_of(admin: &Router, method: Method, uri: &str, status: StatusCode) -> String {
    let response = send(admin, method, uri).await;
    assert_eq!(response.status(), status, "{uri}");
    problem(response).await["detail"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[tokio::test(flavor = "current_thread")]
async fn support_router_refuses_the_ids_the_layer_refuses() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .max_subject_len(8)
        .build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(policy.layer(Quota::daily(10).allowance("read")));
    let admin = Router::new().nest("/admin", policy.handle().router());
    let layer = |id: &'static str| {
        let request = Request::get("/")
            .header("x-account-id", id)
            .body(Body::empty())
            .unwrap();
        let app = app.clone();
        async move { app.oneshot(request).await.unwrap().status() }
    };
    for (id, path) in [("  ", "%20%20"), ("\t", "%09"), ("123456789", "123456789")] {
        assert_eq!(layer(id).await, StatusCode::BAD_REQUEST, "{id:?}");
        every_route_refuses(&admin, "account", path).await;
    }
    // Spaces around an id are not part of it (HTTP strips them): the layer
    // counts " a " as "a", and support names it so, never as " a ".
    assert_eq!(layer(" a ").await, StatusCode::OK);
    let around = send(&admin, Method::GET, "/admin/quota/account/%20a%20").await;
    assert_eq!(around.status(), StatusCode::BAD_REQUEST);
    let shown = send(&admin, Method::GET, "/admin/quota/account/a").await;
    assert_eq!(shown.status(), StatusCode::OK);
    // Spaces inside an id are the layer's business, not a malformed id.
    assert_eq!(layer("a b").await, StatusCode::OK);
    let inside = send(&admin, Method::GET, "/admin/quota/account/a%20b").await;
    assert_eq!(inside.status(), StatusCode::OK);
}

#[tokio::test(flavor = "current_thread")]
async fn every_support_error_is_a_problem_document() {
    let (_, admin) = apps();
    for (method, uri, status) in [
        (Method::GET, "/admin/quota/account/%20", 400),
        (Method::GET, "/admin/quota/%FF/acme", 400),
        (Method::GET, "/admin/quota/Account/acme", 400),
        (Method::POST, "/admin/reset/account/%01/read", 400),
        (Method::POST, "/admin/reset/account/acme/%FF", 400),
        (
            Method::POST,
            "/admin/refund/account/acme/%C3%28?amount=1",
            400,
        ),
        (
            Method::POST,
            "/admin/refund/account/acme/read?amount=x",
            400,
        ),
        // A parameter given twice: which one was meant is anyone's guess.
        (
            Method::POST,
            "/admin/refund/account/acme/read?amount=1&amount=2",
            400,
        ),
        (
            Method::GET,
            "/admin/quota/account/acme?plan=free&plan=pro",
            400,
        ),
        (
            Method::POST,
            "/admin/refund/account/acme/nope?amount=1",
            404,
        ),
        (Method::POST, "/admin/reset/account/acme/nope", 404),
        // Empty or missing segments, other paths.
        (Method::GET, "/admin/quota/account/", 404),
        (Method::GET, "/admin/quota/account", 404),
        (Method::POST, "/admin/reset/account/acme/", 404),
        (Method::GET, "/admin/nothing", 404),
        // A kind the policy's extractor never answers: a typo resets
        // nothing a layer charges.
        (Method::GET, "/admin/quota/acount/acme", 404),
        (Method::POST, "/admin/reset/acount/acme/read", 404),
        (Method::POST, "/admin/quota/account/acme", 405),
        (Method::GET, "/admin/reset/account/acme/read", 405),
        (
            Method::DELETE,
            "/admin/refund/account/acme/read?amount=1",
            405,
        ),
    ] {
        let response = send(&admin, method.clone(), uri).await;
        assert_eq!(response.status().as_u16(), status, "{method} {uri}");
        if status == 405 {
            assert!(response.headers().contains_key("allow"), "{uri}");
        }
        let problem = problem(response).await;
        assert_eq!(problem["status"], status, "{method} {uri}: {problem}");
        assert!(problem["detail"].is_string(), "{problem}");
    }
}

/// Plans over the support routes and `standing`: as the layers read them,
/// on every route; an unknown plan refused as the layers refuse it.
#[tokio::test(flavor = "current_thread")]
async fn support_reads_plans_as_the_layers_do() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .plan(|parts| Some(parts.headers.get("x-plan")?.to_str().ok()?.to_owned()))
        .on_unknown_plan(tower_quota::UnknownPlan::Reject)
        .build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(policy.layer(Quota::daily(10).plan("pro", 100).allowance("read")));
    let admin = Router::new().nest("/admin", policy.handle().router());
    let charge = Request::get("/")
        .header("x-account-id", "acme")
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        app.clone().oneshot(charge).await.unwrap().status(),
        StatusCode::OK
    );
    // A refund or reset with a refused plan changes nothing.
    for uri in [
        "/admin/refund/account/acme/read?amount=1&plan=gold",
        "/admin/reset/account/acme/read?plan=gold",
    ] {
        let refused = send(&admin, Method::POST, uri).await;
        assert_eq!(refused.status(), StatusCode::FORBIDDEN, "{uri}");
    }
    assert_eq!(
        policy
            .handle()
            .usage(&Subject::account("acme"))
            .await
            .unwrap()[0]
            .used(),
        1
    );
    let limit = |body: &serde_json::Value| body["allowances"][0]["limit"].clone();
    for (method, uri) in [
        (Method::GET, "/admin/quota/account/acme?plan=pro"),
        (Method::POST, "/admin/reset/account/acme/read?plan=pro"),
        (
            Method::POST,
            "/admin/refund/account/acme/read?amount=1&plan=pro",
        ),
    ] {
        let response = send(&admin, method.clone(), uri).await;
        assert_eq!(response.status(), StatusCode::OK, "{method} {uri}");
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(limit(&body), 100, "{method} {uri}");
    }
    let refused = send(&admin, Method::GET, "/admin/quota/account/acme?plan=gold").await;
    assert_eq!(refused.status(), StatusCode::FORBIDDEN);
    // A query as forms and `URLSearchParams` write it: `+` is a space, and
    // a name may be percent-encoded too.
    let spaced = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .plan(|parts| Some(parts.headers.get("x-plan")?.to_str().ok()?.to_owned()))
        .on_unknown_plan(tower_quota::UnknownPlan::Reject)
        .build();
    let _layer = spaced.layer(Quota::daily(10).plan("pro plus", 100).allowance("read"));
    let spaced_admin = Router::new().nest("/admin", spaced.handle().router());
    for uri in [
        "/admin/quota/account/acme?plan=pro%20plus",
        "/admin/quota/account/acme?plan=pro+plus",
        "/admin/quota/account/acme?%70lan=pro+plus",
    ] {
        let response = send(&spaced_admin, Method::GET, uri).await;
        assert_eq!(response.status(), StatusCode::OK, "{uri}");
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(limit(&body), 100, "{uri}");
    }
    assert!(problem(refused).await["detail"]
        .as_str()
        .unwrap()
        .contains("gold"));

    let handle = policy.handle();
    let parts = Request::get("/")
        .header("x-account-id", "acme")
        .header("x-plan", "gold")
        .body(())
        .unwrap()
        .into_parts()
        .0;
    let refused = handle.standing(&parts).await;
    assert!(matches!(
        &refused,
        Err(tower_quota::StandingError::Plan(plan)) if plan == "gold"
    ));
    // In the layer's words.
    let gold = Request::get("/")
        .header("x-account-id", "acme")
        .header("x-plan", "gold")
        .body(Body::empty())
        .unwrap();
    let layer_said = problem(app.oneshot(gold).await.unwrap()).await;
    assert_eq!(
        refused.unwrap_err().to_string(),
        layer_said["detail"].as_str().unwrap()
    );
}

/// What a client sends is echoed short in a problem document.
#[tokio::test(flavor = "current_thread")]
async fn a_long_allowance_is_echoed_short() {
    let (_, admin) = apps();
    let long = "x".repeat(60_000);
    let uri = format!("/admin/reset/account/acme/{long}");
    let detail = detail_of(&admin, Method::POST, &uri, StatusCode::NOT_FOUND).await;
    assert!(detail.len() < 200, "{} bytes", detail.len());
}

/// `GET /quota` answers each allowance with the fields the router's docs
/// name: `anchor` `calendar` or `first-use`, `first_call` `null` unless a
/// first-use period is open, instants in RFC 3339.
#[tokio::test(flavor = "current_thread")]
async fn the_standing_answers_the_documented_fields() {
    let clock = ManualClock::new("2026-12-02T10:00:00Z".parse().unwrap());
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock.clone())
        .build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(
            policy
                .layer(Quota::daily(10).allowance("read"))
                .quota(Quota::rolling(5, Duration::from_secs(3_600)).allowance("burst")),
        );
    let admin = Router::new().nest("/admin", policy.handle().router());
    assert_eq!(send(&app, Method::GET, "/").await.status(), StatusCode::OK);
    let shown = problem_or_json(
        send(
            &admin,
            Method::GET,
            "/admin/quota/account/sk_live_secret_key",
        )
        .await,
    )
    .await;
    assert_eq!(shown["subject"]["kind"], "account", "{shown}");
    assert_eq!(shown["subject"]["id"], "sk_live_secret_key", "{shown}");
    let fields = [
        "allowance",
        "name",
        "limit",
        "used",
        "remaining",
        "resets_at",
        "anchor",
        "first_call",
        "reset",
    ];
    for allowance in shown["allowances"].as_array().unwrap() {
        let mut names: Vec<&str> = allowance
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        names.sort_unstable();
        let mut expected = fields.to_vec();
        expected.sort_unstable();
        assert_eq!(names, expected, "{allowance}");
    }
    let [day, burst] = [&shown["allowances"][0], &shown["allowances"][1]];
    assert_eq!(day["allowance"], "read");
    assert_eq!(day["anchor"], "calendar");
    assert_eq!(day["first_call"], serde_json::Value::Null);
    assert_eq!(day["resets_at"], "2026-12-03T00:00:00Z");
    assert_eq!(burst["allowance"], "burst");
    assert_eq!(burst["anchor"], "first-use");
    assert_eq!(burst["first_call"], "2026-12-02T10:00:00Z");
    assert_eq!(burst["resets_at"], "2026-12-02T11:00:00Z");
    assert_eq!(
        (burst["used"].clone(), burst["remaining"].clone()),
        (1.into(), 4.into())
    );
}

/// A long text of characters of many bytes is cut at a character's
/// boundary where it is echoed, never inside one (a panic).
#[tokio::test(flavor = "current_thread")]
async fn a_long_text_of_many_byte_characters_is_echoed_short() {
    let (_, admin) = apps();
    // Byte 64 falls inside an `é`: the echo ends a byte earlier.
    let long = format!("a{}", "\u{e9}".repeat(40));
    let echoed = format!("a{}\u{2026}", "\u{e9}".repeat(31));
    let encoded = percent_encoding::utf8_percent_encode(&long, percent_encoding::NON_ALPHANUMERIC)
        .to_string();
    for (method, uri, status) in [
        (
            Method::POST,
            format!("/admin/reset/account/acme/{encoded}"),
            StatusCode::NOT_FOUND,
        ),
        (
            Method::GET,
            format!("/admin/quota/account/acme?{encoded}=1"),
            StatusCode::BAD_REQUEST,
        ),
    ] {
        let detail = detail_of(&admin, method, &uri, status).await;
        assert!(detail.contains(&echoed), "{detail}");
        assert!(!detail.contains(&long), "{detail}");
    }
    // A text of 64 bytes is echoed whole, with no mark of a cut.
    let whole = "y".repeat(64);
    let uri = format!("/admin/reset/account/acme/{whole}");
    let detail = detail_of(&admin, Method::POST, &uri, StatusCode::NOT_FOUND).await;
    assert!(detail.contains(&format!("{whole:?}")), "{detail}");
}

#[tokio::test(flavor = "current_thread")]
async fn a_handle_reads_the_subjects_the_layer_charges() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .max_subject_len(8)
        .build();
    let _layer = policy.layer(Quota::daily(10).allowance("read"));
    let handle = policy.handle();
    let parts = |id: &str| {
        Request::get("/")
            .header("x-account-id", id)
            .body(())
            .unwrap()
            .into_parts()
            .0
    };
    assert_eq!(handle.subject_of(&parts(" a ")), Ok(Subject::account("a")));
    for id in ["", "  ", "\t", "123456789"] {
        assert!(
            matches!(
                handle.subject_of(&parts(id)),
                Err(tower_quota::SubjectError::Malformed(_))
            ),
            "{id:?}"
        );
        assert!(handle.standing(&parts(id)).await.is_err(), "{id:?}");
    }
}

#[tokio::test(flavor = "current_thread")]
async fn resets_are_explained_with_instants_in_the_quota_zone() {
    let berlin = TimeZone::get("Europe/Berlin").unwrap();
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(ManualClock::new("2026-12-04T10:00:00Z".parse().unwrap()))
        .build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(
            policy
                .layer(
                    Quota::daily(10)
                        .allowance("read")
                        .in_time_zone(berlin.clone()),
                )
                .quota(Quota::daily(10).allowance("write"))
                .quota(
                    Quota::rolling(10, Duration::from_secs(24 * 3600))
                        .allowance("burst")
                        .in_time_zone(berlin),
                )
                .quota(Quota::rolling(10, Duration::from_secs(3600)).allowance("hour")),
        );
    let handle = policy.handle();
    let explained = |usage: &[tower_quota::QuotaUsage]| -> Vec<String> {
        usage.iter().map(|u| u.explain_reset()).collect()
    };
    let acme = Subject::account("sk_live_secret_key");
    assert_eq!(
        explained(&handle.usage(&acme).await.unwrap()),
        [
            "every day at 00:00 Europe/Berlin; next at 2026-12-05T00:00:00+01:00[Europe/Berlin]",
            "every day at 00:00 UTC; next at 2026-12-05T00:00:00Z",
            "24h after the first call; no period is open",
            "1h after the first call; no period is open",
        ]
    );
    assert_eq!(send(&app, Method::GET, "/").await.status(), StatusCode::OK);
    let usage = handle.usage(&acme).await.unwrap();
    assert_eq!(
        explained(&usage)[2..],
        [
            "24h after the first call (2026-12-04T11:00:00+01:00[Europe/Berlin]), \
             at 2026-12-05T11:00:00+01:00[Europe/Berlin]",
            "1h after the first call (2026-12-04T10:00:00Z), at 2026-12-04T11:00:00Z",
        ]
    );

    // The support router's `reset` is the same text.
    let admin = Router::new().nest("/admin", handle.router());
    let shown = send(
        &admin,
        Method::GET,
        "/admin/quota/account/sk_live_secret_key",
    )
    .await;
    assert_eq!(shown.status(), StatusCode::OK);
    let body = axum::body::to_bytes(shown.into_body(), 1 << 16)
        .await
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let resets: Vec<_> = json["allowances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["reset"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(resets, explained(&usage));
    assert_eq!(json["allowances"][0]["resets_at"], "2026-12-04T23:00:00Z");
}

/// `?zone=` names a caller's zone: for a policy that reads none, it would
/// name counters no layer writes, and a reset there would change nothing
/// the caller sees. Refused, and the counter stays as it was.
#[tokio::test]
async fn a_zone_for_a_policy_that_reads_none_is_refused() {
    let (app, admin) = apps();
    for _ in 0..10 {
        assert_eq!(send(&app, Method::GET, "/").await.status(), StatusCode::OK);
    }
    for (method, uri) in [
        (
            Method::GET,
            "/admin/quota/account/sk_live_secret_key?zone=Europe/Berlin",
        ),
        (
            Method::POST,
            "/admin/reset/account/sk_live_secret_key/read?zone=Europe/Berlin",
        ),
        (
            Method::POST,
            "/admin/refund/account/sk_live_secret_key/read?amount=1&zone=Europe/Berlin",
        ),
    ] {
        let response = send(&admin, method, uri).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{uri}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json",
            "{uri}"
        );
    }
    assert_eq!(
        send(&app, Method::GET, "/").await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "nothing was reset"
    );
}

/// A query parameter a route does not take is refused, not ignored: a
/// misspelt `?Zone=` or `?plans=` would otherwise reset or refund the
/// counters of the default zone or plan, which support did not mean. The
/// counter stays as it was; the parameters each route takes still work.
#[tokio::test]
async fn a_query_parameter_a_route_does_not_take_is_refused() {
    let (app, admin) = apps();
    for _ in 0..10 {
        assert_eq!(send(&app, Method::GET, "/").await.status(), StatusCode::OK);
    }
    let id = "sk_live_secret_key";
    let long = "x".repeat(60_000);
    for (method, uri) in [
        (Method::GET, format!("/admin/quota/account/{id}?Zone=UTC")),
        (
            Method::GET,
            format!("/admin/quota/account/{id}?plan=&amount=1"),
        ),
        (
            Method::POST,
            format!("/admin/reset/account/{id}/read?Zone=Asia/Tokyo"),
        ),
        (
            Method::POST,
            format!("/admin/reset/account/{id}/read?amount=3"),
        ),
        (
            Method::POST,
            format!("/admin/refund/account/{id}/read?amount=1&plans=pro"),
        ),
        (
            Method::POST,
            format!("/admin/refund/account/{id}/read?amount=1&{long}=1"),
        ),
    ] {
        let response = send(&admin, method, &uri).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{uri:.80}");
        let problem = problem(response).await;
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains("no parameter of this route"), "{detail}");
        assert!(detail.len() < 300, "{detail:.300}");
    }
    assert_eq!(
        send(&app, Method::GET, "/").await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "nothing was reset or refunded"
    );
    for (method, uri) in [
        (Method::GET, format!("/admin/quota/account/{id}?plan=")),
        (
            Method::POST,
            format!("/admin/refund/account/{id}/read?amount=1"),
        ),
        (Method::POST, format!("/admin/reset/account/{id}/read?")),
    ] {
        let response = send(&admin, method, &uri).await;
        assert_eq!(response.status(), StatusCode::OK, "{uri}");
    }
    assert_eq!(send(&app, Method::GET, "/").await.status(), StatusCode::OK);
}

/// A store's error that names a key is logged with the subject's id hidden,
/// fail-open and fail-closed alike.
#[tokio::test(flavor = "current_thread")]
async fn store_errors_are_logged_without_the_subject_id() {
    for fail_open in [true, false] {
        let logs = Logs::default();
        let _guard = tracing::subscriber::set_default(logs.clone());
        let _interest = interest::every_subscriber_asked();
        let store = rigged::Rigged::new(tower_quota::MemoryStore::new(), rigged::Rig::Fail, None);
        let on_error = if fail_open {
            tower_quota::OnStoreError::FailOpen
        } else {
            tower_quota::OnStoreError::FailClosed {
                retry_after: std::time::Duration::from_secs(1),
            }
        };
        let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store)
            .on_store_error(on_error)
            .build();
        let app = Router::new()
            .route("/", get(|| async { "hi" }))
            .route_layer(policy.layer(Quota::daily(10)));
        send(&app, Method::GET, "/").await;
        let logs = logs.0.lock().unwrap();
        let errors: Vec<&str> = logs.iter().filter_map(|(_, f)| field(f, "error")).collect();
        assert!(!errors.is_empty(), "the failure is logged");
        for error in errors {
            assert!(!error.contains("sk_live_secret_key"), "{error}");
            assert!(
                error.contains("rigged to fail on quota:{account:#"),
                "{error}"
            );
        }
    }
}

/// An app charging each client address `daily(1)` of `read` with
/// `extractor`, and its policy's support router under `/admin`.
fn client_ip_apps(
    extractor: tower_quota::ClientIp,
) -> (QuotaPolicy<tower_quota::ClientIp>, Router, Router) {
    let policy = QuotaPolicy::builder(extractor).build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(policy.layer(Quota::daily(1).allowance("read")));
    let admin = Router::new().nest("/admin", policy.handle().router());
    (policy, app, admin)
}

/// What `app` answers a request from the peer at `peer`.
async fn from_peer(app: &Router, peer: &str) -> StatusCode {
    let mut request = Request::get("/").body(Body::empty()).unwrap();
    let peer: std::net::SocketAddr = peer.parse().unwrap();
    request
        .extensions_mut()
        .insert(axum::extract::ConnectInfo(peer));
    app.clone().oneshot(request).await.unwrap().status()
}

/// A support call names a client as its address or network, written any
/// way: it reaches the counter the layer charges that client to (its /64,
/// its IPv4 address), and refuses what no client is charged as.
#[tokio::test(flavor = "current_thread")]
async fn support_calls_reach_the_counter_a_client_ip_is_charged_to() {
    let (policy, app, admin) = client_ip_apps(tower_quota::ClientIp::new().ipv4_prefix(24));
    let from = |peer| from_peer(&app, peer);
    for (client, named) in [
        ("[2001:db8:1:2::9]:1", "2001:db8:1:2::9"),
        ("[2001:db8:1:2::9]:1", "2001:DB8:1:2::%2F64"),
        ("[2001:db8:1:2::9]:1", "2001:db8:1:2:abcd::%2F80"),
        ("203.0.113.7:1", "203.0.113.99"),
        ("203.0.113.7:1", "::ffff:203.0.113.7"),
        ("203.0.113.7:1", "203.0.113.0%2F24"),
    ] {
        assert_eq!(from(client).await, StatusCode::OK, "{client}");
        assert_eq!(
            from(client).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{client}"
        );
        let shown = send(&admin, Method::GET, &format!("/admin/quota/ip/{named}")).await;
        assert_eq!(shown.status(), StatusCode::OK, "{named}");
        let shown = problem_or_json(shown).await;
        assert_eq!(shown["allowances"][0]["used"], 1, "{named}: {shown}");
        let reset = send(
            &admin,
            Method::POST,
            &format!("/admin/reset/ip/{named}/read"),
        )
        .await;
        assert_eq!(reset.status(), StatusCode::OK, "{named}");
        assert_eq!(from(client).await, StatusCode::OK, "{client} after {named}");
        let refund = format!("/admin/refund/ip/{named}/read?amount=1");
        assert_eq!(
            send(&admin, Method::POST, &refund).await.status(),
            StatusCode::OK
        );
        assert_eq!(from(client).await, StatusCode::OK, "{client} refunded");
        let reset = send(
            &admin,
            Method::POST,
            &format!("/admin/reset/ip/{named}/read"),
        )
        .await;
        assert_eq!(reset.status(), StatusCode::OK, "{named}");
    }
    // The handle names only subjects of kinds its extractor charges.
    let handle = policy.handle();
    assert_eq!(
        handle
            .subject(&tower_quota::SubjectKind::IP, "2001:db8:1:2::9")
            .map(|s| s.id().to_vec()),
        Ok(b"2001:db8:1:2::/64".to_vec())
    );
    assert!(matches!(
        handle.subject(&tower_quota::SubjectKind::ACCOUNT, "2001:db8:1:2::9"),
        Err(tower_quota::SubjectError::Malformed(_))
    ));
    for named in ["2001:db8::%2F48", "203.0.0.0%2F16", "not-an-address", "%00"] {
        for (method, uri) in [
            (Method::GET, format!("/admin/quota/ip/{named}")),
            (Method::POST, format!("/admin/reset/ip/{named}/read")),
        ] {
            let response = send(&admin, method, &uri).await;
            assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{uri}");
            assert_eq!(problem(response).await["status"], 400, "{uri}");
        }
    }
}

/// A network wider than a /96 that holds the IPv4-mapped (`::ffff:0:0/96`)
/// or NAT64 (`64:ff9b::/96`) addresses spans many counters: its IPv4
/// clients are each charged as their IPv4 address. A support call naming
/// one is refused, as one naming `::ffff:0:0/96` is, and never reaches the
/// counter of the IPv6 clients whose /64 holds it (`::1`'s here).
#[tokio::test(flavor = "current_thread")]
async fn support_refuses_a_network_of_ipv4_clients_wider_than_their_mapping() {
    let (_policy, app, admin) = client_ip_apps(tower_quota::ClientIp::new());
    let from = |peer| from_peer(&app, peer);
    // `::1` is charged to `::/64`, `64:ff9b::1:0:0` (outside the NAT64 /96) to `64:ff9b::/64`.
    for client in ["[::1]:1", "[64:ff9b::1:0:0]:1"] {
        assert_eq!(from(client).await, StatusCode::OK, "{client}");
        assert_eq!(
            from(client).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{client}"
        );
    }
    for named in [
        "%3A%3Affff%3A0%3A0%2F96",
        "%3A%3Affff%3A0%3A0%2F80",
        "%3A%3Affff%3A0%3A0%2F95",
        "64%3Aff9b%3A%3A%2F80",
    ] {
        every_route_refuses(&admin, "ip", named).await;
    }
    for client in ["[::1]:1", "[64:ff9b::1:0:0]:1"] {
        assert_eq!(
            from(client).await,
            StatusCode::TOO_MANY_REQUESTS,
            "{client}: spent, whatever support named"
        );
    }
    // The counters' own ids, and addresses in them, still reach them.
    for named in ["%3A%3A%2F64", "%3A%3A1", "64%3Aff9b%3A%3A%2F64"] {
        let shown = send(&admin, Method::GET, &format!("/admin/quota/ip/{named}")).await;
        assert_eq!(shown.status(), StatusCode::OK, "{named}");
        assert_eq!(
            problem_or_json(shown).await["allowances"][0]["used"],
            1,
            "{named}"
        );
    }
}

/// A header carries no control character: a support call naming an id
/// with one is refused, as no request could be charged as it.
#[tokio::test(flavor = "current_thread")]
async fn support_calls_refuse_ids_a_header_cannot_carry() {
    let (_, admin) = apps();
    for uri in [
        "/admin/quota/account/acme%0A",
        "/admin/reset/account/%00/read",
    ] {
        let method = if uri.contains("reset") {
            Method::POST
        } else {
            Method::GET
        };
        let response = send(&admin, method, uri).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{uri}");
        assert_eq!(problem(response).await["status"], 400, "{uri}");
    }
}

async fn problem_or_json(response: Response<Body>) -> serde_json::Value {
    let body = axum::body::to_bytes(response.into_body(), 1 << 16)
        .await
        .unwrap();
    serde_json::from_slice(&body).unwrap()
}

/// Two layers of different policies nested, with quotas of one name (two
/// `QuotaLayer::daily` are both `default-day`): clients cannot tell them
/// apart in the fields, which is logged as a warning; quotas named apart
/// are not.
#[tokio::test(flavor = "current_thread")]
async fn nested_layers_telling_two_quotas_of_one_name_are_logged() {
    use tower_quota::{FromHeader, QuotaLayer};

    let warned = |outer: Quota| async move {
        let logs = Logs::default();
        let _guard = tracing::subscriber::set_default(logs.clone());
        let _interest = interest::every_subscriber_asked();
        let app = Router::new()
            .route("/", get(|| async { "hi" }))
            .route_layer(QuotaLayer::daily(1, FromHeader::account("x-account-id")))
            .layer(QuotaLayer::new(outer, FromHeader::account("x-account-id")));
        assert_eq!(send(&app, Method::GET, "/").await.status(), StatusCode::OK);
        let logs = logs.0.lock().unwrap();
        logs.iter().any(|(level, fields)| {
            *level == tracing::Level::WARN
                && field(fields, "message").is_some_and(|m| m.contains("of one name"))
                && field(fields, "name") == Some("\"default-day\"")
        })
    };
    assert!(warned(Quota::daily(100)).await);
    assert!(!warned(Quota::daily(100).named("ip-day")).await);
}

/// The support router nests in an application's router of any state, before
/// its `with_state`, as axum's own routers do.
#[tokio::test(flavor = "current_thread")]
async fn the_support_router_nests_in_a_router_with_state() {
    #[derive(Clone)]
    struct App {
        name: &'static str,
    }
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let app: Router = Router::new()
        .route(
            "/",
            get(|axum::extract::State(app): axum::extract::State<App>| async move { app.name }),
        )
        .route_layer(policy.layer(Quota::daily(10).allowance("read")))
        .nest("/admin", policy.handle().router())
        .with_state(App { name: "app" });
    assert_eq!(send(&app, Method::GET, "/").await.status(), StatusCode::OK);
    let shown = send(&app, Method::GET, "/admin/quota/account/acme").await;
    assert_eq!(shown.status(), StatusCode::OK);
}

/// An id that is not UTF-8 (a header may carry any bytes) is charged by
/// the layer and reached by support with its bytes percent-encoded: shown
/// (with `id_encoded` beside an `id` that cannot show it), refunded, reset.
#[tokio::test(flavor = "current_thread")]
async fn support_reaches_an_id_that_is_not_utf8() {
    let (app, admin) = apps();
    for _ in 0..3 {
        let request = Request::get("/")
            .header(
                "x-account-id",
                http::HeaderValue::from_bytes(b"ac\xffme").unwrap(),
            )
            .body(Body::empty())
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    let read = |json: &serde_json::Value| json["allowances"][0]["used"].clone();
    let shown =
        problem_or_json(send(&admin, Method::GET, "/admin/quota/account/ac%FFme").await).await;
    assert_eq!(shown["subject"]["id_encoded"], "ac%FFme");
    assert_eq!(read(&shown), 3);
    let other =
        problem_or_json(send(&admin, Method::GET, "/admin/quota/account/ac%FEme").await).await;
    assert_eq!(read(&other), 0, "another id");
    let refunded = send(
        &admin,
        Method::POST,
        "/admin/refund/account/ac%FFme/read?amount=1",
    )
    .await;
    assert_eq!(read(&problem_or_json(refunded).await), 2);
    let reset = send(&admin, Method::POST, "/admin/reset/account/ac%FFme/read").await;
    assert_eq!(read(&problem_or_json(reset).await), 0);
    let plain = problem_or_json(send(&admin, Method::GET, "/admin/quota/account/acme").await).await;
    assert!(plain["subject"].get("id_encoded").is_none(), "{plain}");
}

/// `id_encoded` is the path that reaches the id again: a `%` among its
/// bytes is encoded too, or the path would name another id.
#[tokio::test(flavor = "current_thread")]
async fn an_id_encoded_with_a_percent_sign_reaches_the_id_again() {
    let (app, admin) = apps();
    let request = Request::get("/")
        .header(
            "x-account-id",
            http::HeaderValue::from_bytes(b"ac%FF\xffme").unwrap(),
        )
        .body(Body::empty())
        .unwrap();
    assert_eq!(app.oneshot(request).await.unwrap().status(), StatusCode::OK);
    let shown =
        problem_or_json(send(&admin, Method::GET, "/admin/quota/account/ac%25FF%FFme").await).await;
    assert_eq!(shown["allowances"][0]["used"], 1);
    let encoded = shown["subject"]["id_encoded"].as_str().unwrap().to_owned();
    assert_eq!(encoded, "ac%25FF%FFme");
    let again = problem_or_json(
        send(
            &admin,
            Method::GET,
            &format!("/admin/quota/account/{encoded}"),
        )
        .await,
    )
    .await;
    assert_eq!(again["allowances"][0]["used"], 1, "{again}");
}

/// The store away: a support route answers 503 with `Retry-After`, as the
/// layers' own 503 does, in a problem document.
#[tokio::test(flavor = "current_thread")]
async fn support_tells_when_to_retry_while_the_store_is_away() {
    let store = rigged::Rigged::new(
        tower_quota::MemoryStore::new(),
        rigged::Rig::Fail,
        Some("none"),
    );
    let away = std::sync::Arc::clone(&store.away);
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .build();
    let _layer = policy.layer(Quota::daily(10).allowance("read"));
    let admin = Router::new().nest("/admin", policy.handle().router());
    away.store(true, std::sync::atomic::Ordering::Relaxed);
    let response = send(&admin, Method::GET, "/admin/quota/account/acme").await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()["retry-after"], "1");
    assert_eq!(problem(response).await["status"], 503);
}

/// Mounted in an application whose quota layer covers every route
/// (`Router::layer`, with `unrouted`'s answers set last, as the README
/// says), the support router's own 404 and 405 are not charged, as the
/// application's are not: no route served them.
#[tokio::test(flavor = "current_thread")]
async fn the_support_routers_404_and_405_are_never_charged() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .nest("/admin", policy.handle().router())
        .layer(policy.layer(Quota::daily(10)))
        .method_not_allowed_fallback(tower_quota::unrouted::MethodNotAllowed)
        .fallback(tower_quota::unrouted::NotFound);
    let subject = Subject::account("sk_live_secret_key");
    let used = || async { policy.handle().usage(&subject).await.unwrap()[0].used() };
    for (method, uri, status) in [
        (Method::GET, "/nothing", 404),
        (Method::POST, "/", 405),
        (Method::GET, "/admin/nothing", 404),
        (Method::POST, "/admin/quota/account/acme", 405),
        (Method::GET, "/admin/reset/account/acme/default", 405),
    ] {
        let response = send(&app, method.clone(), uri).await;
        assert_eq!(response.status().as_u16(), status, "{method} {uri}");
        assert!(
            !response.headers().contains_key("ratelimit"),
            "{method} {uri}: {:?}",
            response.headers()
        );
        assert_eq!(used().await, 0, "{method} {uri} was charged");
    }
}

/// A kind of 64 characters is well formed (a policy that charges none
/// answers 404); one of 65 is malformed (400).
#[tokio::test(flavor = "current_thread")]
async fn a_subject_kind_is_up_to_64_characters() {
    let (_, admin) = apps();
    let longest = "k".repeat(64);
    let response = send(&admin, Method::GET, &format!("/admin/quota/{longest}/acme")).await;
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    let too_long = "k".repeat(65);
    let response = send(
        &admin,
        Method::GET,
        &format!("/admin/quota/{too_long}/acme"),
    )
    .await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
}

/// A support refund of one allowance gives back to that allowance's
/// counters only: the subject's other allowances stay as they are.
#[tokio::test(flavor = "current_thread")]
async fn a_refund_of_one_allowance_leaves_the_others_alone() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let app = Router::new()
        .route(
            "/read",
            get(|| async { "read" }).route_layer(policy.layer(Quota::daily(10).allowance("read"))),
        )
        .route(
            "/write",
            get(|| async { "write" })
                .route_layer(policy.layer(Quota::daily(10).allowance("write"))),
        );
    let admin = Router::new().nest("/admin", policy.handle().router());
    for path in ["/read", "/read", "/write", "/write"] {
        assert_eq!(send(&app, Method::GET, path).await.status(), StatusCode::OK);
    }
    let response = send(
        &admin,
        Method::POST,
        "/admin/refund/account/sk_live_secret_key/read?amount=2",
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
    let handle = policy.handle();
    let usage = handle
        .usage(&Subject::account("sk_live_secret_key"))
        .await
        .unwrap();
    let used = |allowance: &str| {
        usage
            .iter()
            .find(|u| u.quota().allowance_tag() == allowance)
            .unwrap()
            .used()
    };
    assert_eq!(used("read"), 0);
    assert_eq!(used("write"), 2, "the write allowance is not refunded");
}

/// A layer's handle gives back what that layer charged a request, and
/// nothing the layer around it charged.
#[tokio::test(flavor = "current_thread")]
async fn a_layers_refund_request_gives_back_that_layers_charge_only() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let outer = policy.layer(Quota::daily(10).allowance("all"));
    let inner = policy.layer(Quota::daily(10).allowance("send"));
    let handle = inner.handle();
    let app = Router::new()
        .route(
            "/send",
            get(move |status: tower_quota::QuotaStatus| {
                let handle = handle.clone();
                async move {
                    let refunded = handle.refund_request(&status).await.unwrap();
                    assert_eq!(refunded, [Some(0)]);
                    "not sent"
                }
            })
            .layer(inner),
        )
        .layer(outer);
    assert_eq!(
        send(&app, Method::GET, "/send").await.status(),
        StatusCode::OK
    );
    let usage = policy
        .handle()
        .usage(&Subject::account("sk_live_secret_key"))
        .await
        .unwrap();
    let used = |allowance: &str| {
        usage
            .iter()
            .find(|u| u.quota().allowance_tag() == allowance)
            .unwrap()
            .used()
    };
    assert_eq!(used("send"), 0, "the inner layer's charge is given back");
    assert_eq!(used("all"), 1, "the outer layer's charge stays");
}
