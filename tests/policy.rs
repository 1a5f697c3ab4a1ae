//! One policy per application, through real axum routers, on both stores:
//! nested layers decide once, unrouted requests are free, plans, refunds of
//! server errors, deferred costs and the support router.

#[cfg(feature = "redis")]
mod redis_support;

use axum::body::Body;
use axum::extract::Path;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use http::{Method, Request, Response, StatusCode};
use tower::ServiceExt;
use tower_quota::jiff::{SignedDuration, Timestamp};
use tower_quota::{
    unrouted, FromHeader, ManualClock, MemoryStore, Quota, QuotaPolicy, QuotaStatus, Store,
    Subject, UnknownPlan,
};

fn at(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn call(method: Method, path: &str, headers: &[(&str, &str)]) -> Request<Body> {
    let mut request = Request::builder().method(method).uri(path);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.body(Body::empty()).unwrap()
}

const ACME: &[(&str, &str)] = &[("x-account-id", "acme")];

async fn send(app: &Router, request: Request<Body>) -> Response<Body> {
    app.clone().oneshot(request).await.unwrap()
}

async fn body(response: Response<Body>) -> String {
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

async fn used<St: Store>(policy: &QuotaPolicy<FromHeader, St>, name: &str) -> u64 {
    let usage = policy
        .handle()
        .usage(&Subject::account("acme"))
        .await
        .unwrap();
    usage
        .iter()
        .find(|u| u.name() == name)
        .unwrap_or_else(|| panic!("no quota {name} in {usage:?}"))
        .used()
}

/// A router-wide `read` quota around a route-scoped `search` burst quota.
fn search_app<St: Store>(
    store: St,
    read: u64,
    burst: u64,
) -> (Router, QuotaPolicy<FromHeader, St>) {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .clock(ManualClock::new(at("2026-12-02T10:00:00Z")))
        .build();
    let names = |status: QuotaStatus| async move {
        status
            .entries()
            .iter()
            .map(|e| e.name().to_owned())
            .collect::<Vec<_>>()
            .join(",")
    };
    let app = Router::new()
        .route("/read", get(names))
        .merge(
            Router::new()
                .route("/search", get(names))
                .route_layer(policy.layer(Quota::per_minute(burst).allowance("search"))),
        )
        .route_layer(policy.layer(Quota::daily(read).allowance("read")))
        .method_not_allowed_fallback(unrouted::MethodNotAllowed);
    (app, policy)
}

async fn nested_layers_refused_inside_spend_nothing_outside<St: Store>(store: St) {
    let (app, policy) = search_app(store, 10, 1);
    let first = send(&app, call(Method::GET, "/search", ACME)).await;
    assert_eq!(first.status(), StatusCode::OK);
    let fields = first.headers()["ratelimit"].to_str().unwrap().to_owned();
    assert!(fields.starts_with("\"read-day\";r=9;"), "{fields}");
    assert!(fields.contains("\"search-minute\";r=0;"), "{fields}");
    // One status per request, listing both quotas.
    assert_eq!(body(first).await, "read-day,search-minute");

    let refused = send(&app, call(Method::GET, "/search", ACME)).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(body(refused)
        .await
        .contains("\"violated-policies\":[\"search-minute\"]"));
    assert_eq!(
        used(&policy, "read-day").await,
        1,
        "the refused search spent no read"
    );
    assert_eq!(used(&policy, "search-minute").await, 1);

    // A route without the burst layer sees the read quota only.
    let read = send(&app, call(Method::GET, "/read", ACME)).await;
    assert_eq!(body(read).await, "read-day");
    assert_eq!(used(&policy, "read-day").await, 2);
}

async fn nested_layers_refused_outside_spend_nothing_inside<St: Store>(store: St) {
    let (app, policy) = search_app(store, 1, 5);
    assert_eq!(
        send(&app, call(Method::GET, "/read", ACME)).await.status(),
        StatusCode::OK
    );
    let refused = send(&app, call(Method::GET, "/search", ACME)).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(body(refused)
        .await
        .contains("\"violated-policies\":[\"read-day\"]"));
    assert_eq!(
        used(&policy, "search-minute").await,
        0,
        "the refused search spent no burst"
    );
}

async fn unrouted_requests_are_free_and_need_no_subject<St: Store>(store: St) {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .build();
    let app = Router::new()
        .route("/write", post(|| async { "written" }))
        .route_layer(policy.layer(Quota::daily(1).allowance("write")))
        .method_not_allowed_fallback(unrouted::MethodNotAllowed);
    for headers in [ACME, &[]] {
        let wrong = send(&app, call(Method::GET, "/write", headers)).await;
        assert_eq!(wrong.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert!(!wrong.headers().contains_key("ratelimit"));
        let unknown = send(&app, call(Method::GET, "/nowhere", headers)).await;
        assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
    }
    assert_eq!(used(&policy, "write-day").await, 0);
    assert_eq!(
        send(&app, call(Method::POST, "/write", ACME))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&app, call(Method::POST, "/write", &[])).await.status(),
        StatusCode::UNAUTHORIZED
    );
}

async fn skipped_requests_pass_uncounted<St: Store>(store: St) {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .skip_if(|parts| parts.method == Method::OPTIONS)
        .build();
    let app = Router::new()
        .route(
            "/",
            get(|| async { "hi" }).options(|status: QuotaStatus| async move {
                format!("exempt={}", status.is_exempt())
            }),
        )
        .route_layer(policy.layer(Quota::daily(1)));
    let preflight = send(&app, call(Method::OPTIONS, "/", &[])).await;
    assert_eq!(preflight.status(), StatusCode::OK);
    assert!(!preflight.headers().contains_key("ratelimit"));
    assert_eq!(body(preflight).await, "exempt=true");
    assert_eq!(used(&policy, "default-day").await, 0);
}

async fn a_plan_change_keeps_the_count<St: Store>(store: St) {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .plan(|parts| Some(parts.headers.get("x-plan")?.to_str().ok()?.to_owned()))
        .on_unknown_plan(UnknownPlan::Reject)
        .build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(policy.layer(Quota::daily(2).plan("free", 2).plan("pro", 4)));
    let free: &[(&str, &str)] = &[("x-account-id", "acme"), ("x-plan", "free")];
    let pro: &[(&str, &str)] = &[("x-account-id", "acme"), ("x-plan", "pro")];
    for _ in 0..2 {
        assert_eq!(
            send(&app, call(Method::GET, "/", free)).await.status(),
            StatusCode::OK
        );
    }
    assert_eq!(
        send(&app, call(Method::GET, "/", free)).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // Upgraded mid-day: the two spent still count, against the new limit.
    let upgraded = send(&app, call(Method::GET, "/", pro)).await;
    assert_eq!(upgraded.status(), StatusCode::OK);
    assert_eq!(
        upgraded.headers()["ratelimit-policy"],
        "\"default-day\";q=4;w=86400"
    );
    assert!(upgraded.headers()["ratelimit"]
        .to_str()
        .unwrap()
        .starts_with("\"default-day\";r=1;"));
    assert_eq!(
        send(&app, call(Method::GET, "/", pro)).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&app, call(Method::GET, "/", pro)).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // No plan: the quota's own limit. An unknown plan: a clear 403.
    assert_eq!(
        send(&app, call(Method::GET, "/", ACME)).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let gold: &[(&str, &str)] = &[("x-account-id", "acme"), ("x-plan", "gold")];
    let unknown = send(&app, call(Method::GET, "/", gold)).await;
    assert_eq!(unknown.status(), StatusCode::FORBIDDEN);
    assert!(body(unknown).await.contains("gold"));
    // A plan read empty (a header sent empty) is no plan, not an unknown
    // one: the quota's own limit.
    let empty: &[(&str, &str)] = &[("x-account-id", "acme"), ("x-plan", "")];
    let none = send(&app, call(Method::GET, "/", empty)).await;
    assert_eq!(none.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        none.headers()["ratelimit-policy"],
        "\"default-day\";q=2;w=86400"
    );
}

/// A gRPC trailers-only answer with status `code`.
fn grpc_status(code: u16) -> impl IntoResponse {
    (
        [
            ("content-type", "application/grpc".to_string()),
            ("grpc-status", code.to_string()),
        ],
        (),
    )
}

async fn server_errors_are_refunded_to_the_counter_charged<St: Store>(store: St) {
    let clock = ManualClock::new(at("2026-12-02T23:59:59Z"));
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .clock(clock.clone())
        .refund_server_errors(true)
        .build();
    let late = clock.clone();
    let app = Router::new()
        .route("/fail", get(|| async { StatusCode::INTERNAL_SERVER_ERROR }))
        .route(
            "/grpc/{code}",
            get(|Path(code): Path<u16>| async move { grpc_status(code) }),
        )
        .route(
            "/plain-grpc-status",
            get(|| async { ([("grpc-status", "13")], "ok") }),
        )
        .route(
            "/slow-fail",
            get(move || {
                let late = late.clone();
                async move {
                    // The response comes after midnight.
                    late.advance(SignedDuration::from_secs(2));
                    StatusCode::BAD_GATEWAY
                }
            }),
        )
        .route("/", get(|| async { "ok" }))
        .route_layer(policy.layer(Quota::daily(10)));
    let failed = send(&app, call(Method::GET, "/fail", ACME)).await;
    assert_eq!(failed.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(failed.headers()["ratelimit"]
        .to_str()
        .unwrap()
        .starts_with("\"default-day\";r=10;"));
    assert_eq!(used(&policy, "default-day").await, 0);
    // A gRPC call's status is in `grpc-status` (a trailers-only answer, as
    // tonic gives a failed unary call): the codes of the server's failures
    // are refunded, the others charged.
    for code in [2, 12, 13, 14, 15] {
        let failed = send(&app, call(Method::GET, &format!("/grpc/{code}"), ACME)).await;
        assert_eq!(failed.headers()["grpc-status"], code.to_string().as_str());
        assert_eq!(used(&policy, "default-day").await, 0, "grpc-status {code}");
    }
    let not_found = send(&app, call(Method::GET, "/grpc/5", ACME)).await;
    assert_eq!(not_found.status(), StatusCode::OK);
    assert_eq!(used(&policy, "default-day").await, 1, "grpc-status 5");
    // The client sets the deadline: DEADLINE_EXCEEDED is charged.
    send(&app, call(Method::GET, "/grpc/4", ACME)).await;
    assert_eq!(used(&policy, "default-day").await, 2, "grpc-status 4");
    // Only a gRPC answer's status counts: a plain answer that passes the
    // header on from elsewhere is charged.
    send(&app, call(Method::GET, "/plain-grpc-status", ACME)).await;
    assert_eq!(used(&policy, "default-day").await, 3);
    assert_eq!(
        send(&app, call(Method::GET, "/", ACME)).await.status(),
        StatusCode::OK
    );

    // Charged on the 2nd, answered on the 3rd: the refund never credits the
    // 3rd's counter.
    assert_eq!(
        send(&app, call(Method::GET, "/slow-fail", ACME))
            .await
            .status(),
        StatusCode::BAD_GATEWAY
    );
    assert_eq!(
        send(&app, call(Method::GET, "/", ACME)).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        used(&policy, "default-day").await,
        1,
        "the 3rd's counter holds only its own call"
    );
}

/// A request's charge goes back to the counter it was charged to, even when
/// a concurrent request with a later instant made that counter first.
async fn a_give_back_reaches_a_counter_a_later_request_made<St: Store>(store: St) {
    let clock = ManualClock::new(at("2026-12-02T10:00:00Z"));
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .clock(clock.clone())
        .refund_server_errors(true)
        .build();
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let held = std::sync::Arc::clone(&gate);
    let app = Router::new()
        .route("/fail", get(|| async { StatusCode::INTERNAL_SERVER_ERROR }))
        .route("/", get(|| async { "ok" }))
        .route_layer(policy.layer(Quota::daily(10).allowance("inner")))
        .layer(axum::middleware::from_fn(
            move |request: Request<Body>, next: axum::middleware::Next| {
                let held = std::sync::Arc::clone(&held);
                async move {
                    if request.headers().contains_key("x-hold") {
                        held.notified().await;
                    }
                    next.run(request).await
                }
            },
        ))
        .layer(policy.layer(Quota::daily(10)));
    // The first request passes the outer layer at 10:00:00 and is held
    // before the inner one.
    let first = tokio::spawn(app.clone().oneshot(call(
        Method::GET,
        "/fail",
        &[("x-account-id", "acme"), ("x-hold", "1")],
    )));
    while used(&policy, "default-day").await == 0 {
        tokio::task::yield_now().await;
    }
    // A second later, another request makes the inner counter.
    clock.advance(SignedDuration::from_secs(1));
    assert_eq!(
        send(&app, call(Method::GET, "/", ACME)).await.status(),
        StatusCode::OK
    );
    assert_eq!(used(&policy, "inner-day").await, 1);
    // The first is charged on that counter, fails, and is given back on
    // both quotas.
    gate.notify_one();
    let failed = first.await.unwrap().unwrap();
    assert_eq!(failed.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(used(&policy, "default-day").await, 1);
    assert_eq!(
        used(&policy, "inner-day").await,
        1,
        "the inner charge went back"
    );
}

async fn deferred_costs_are_charged_after_the_response<St: Store>(store: St) {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .build();
    let app = Router::new()
        .route(
            "/complete",
            get(|request: Request<Body>| async move {
                let tokens =
                    request.uri().query().unwrap_or("tokens=1")["tokens=".len()..].to_owned();
                ([("x-tokens", tokens)], "done")
            }),
        )
        .route_layer(
            policy
                .layer(Quota::daily(10).allowance("tokens"))
                .deferred_cost(1, |response| {
                    response.headers["x-tokens"]
                        .to_str()
                        .unwrap()
                        .parse()
                        .unwrap()
                }),
        );
    let done = send(&app, call(Method::GET, "/complete?tokens=4", ACME)).await;
    assert!(done.headers()["ratelimit"]
        .to_str()
        .unwrap()
        .starts_with("\"tokens-day\";r=6;"));
    assert_eq!(used(&policy, "tokens-day").await, 4);
    // Cheaper than the up-front cost: the difference comes back.
    send(&app, call(Method::GET, "/complete?tokens=0", ACME)).await;
    assert_eq!(used(&policy, "tokens-day").await, 4);
    // Admitted while its up-front cost fits, charged in full after.
    send(&app, call(Method::GET, "/complete?tokens=5", ACME)).await;
    assert_eq!(
        send(&app, call(Method::GET, "/complete?tokens=2", ACME))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(used(&policy, "tokens-day").await, 11);
    assert_eq!(
        send(&app, call(Method::GET, "/complete?tokens=1", ACME))
            .await
            .status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

async fn the_support_router_lists_resets_and_refunds<St: Store>(store: St) {
    let (app, policy) = search_app(store, 10, 5);
    for _ in 0..3 {
        send(&app, call(Method::GET, "/search", ACME)).await;
    }
    let admin = Router::new().nest("/admin", policy.handle().router());
    let shown = send(&admin, call(Method::GET, "/admin/quota/account/acme", &[])).await;
    assert_eq!(shown.status(), StatusCode::OK);
    let json: serde_json::Value = serde_json::from_str(&body(shown).await).unwrap();
    assert_eq!(
        json["subject"],
        serde_json::json!({"kind": "account", "id": "acme"})
    );
    let read = &json["allowances"][1];
    assert_eq!(read["allowance"], "read");
    assert_eq!(read["name"], "read-day");
    assert_eq!(read["limit"], 10);
    assert_eq!(read["used"], 3);
    assert_eq!(read["remaining"], 7);
    assert_eq!(read["resets_at"], "2026-12-03T00:00:00Z");
    assert_eq!(read["anchor"], "calendar");
    assert_eq!(read["first_call"], serde_json::Value::Null);
    assert!(read["reset"]
        .as_str()
        .unwrap()
        .starts_with("every day at 00:00 UTC"));

    let reset = send(
        &admin,
        call(Method::POST, "/admin/reset/account/acme/search", &[]),
    )
    .await;
    assert_eq!(reset.status(), StatusCode::OK);
    assert_eq!(used(&policy, "search-minute").await, 0);
    assert_eq!(
        used(&policy, "read-day").await,
        3,
        "only the allowance named is reset"
    );
    let refund = send(
        &admin,
        call(
            Method::POST,
            "/admin/refund/account/acme/read?amount=2",
            &[],
        ),
    )
    .await;
    assert_eq!(refund.status(), StatusCode::OK);
    assert_eq!(used(&policy, "read-day").await, 1);

    for (method, path, status) in [
        (
            Method::POST,
            "/admin/reset/account/acme/nothing",
            StatusCode::NOT_FOUND,
        ),
        (
            Method::GET,
            "/admin/quota/Not%20A%20Kind/acme",
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            "/admin/refund/account/acme/read?amount=x",
            StatusCode::BAD_REQUEST,
        ),
    ] {
        let response = send(&admin, call(method, path, &[])).await;
        assert_eq!(response.status(), status, "{path}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
    }
}

macro_rules! on_every_store {
    ($($case:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case(tower_quota::MemoryStore::new()).await;
                }
            )*
        }

        #[cfg(feature = "redis")]
        mod redis {
            use crate::redis_server_or_skip;

            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let server = redis_server_or_skip!();
                    let store = tower_quota::store::RedisStore::builder(server.url())
                        .wait_timeout(std::time::Duration::from_secs(2))
                        .timeout(std::time::Duration::from_secs(2))
                        .build()
                        .unwrap();
                    super::$case(store).await;
                }
            )*
        }
    };
}

on_every_store!(
    nested_layers_refused_inside_spend_nothing_outside,
    nested_layers_refused_outside_spend_nothing_inside,
    unrouted_requests_are_free_and_need_no_subject,
    skipped_requests_pass_uncounted,
    a_plan_change_keeps_the_count,
    server_errors_are_refunded_to_the_counter_charged,
    a_give_back_reaches_a_counter_a_later_request_made,
    deferred_costs_are_charged_after_the_response,
    the_support_router_lists_resets_and_refunds,
);

#[test]
#[should_panic(expected = "would count on one counter")]
fn two_different_quotas_on_one_counter_are_refused() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let _a = Router::<()>::new()
        .route("/a", get(|| async {}))
        .route_layer(policy.layer(Quota::daily(10).allowance("read")));
    let _b = Router::<()>::new()
        .route("/b", get(|| async {}))
        .route_layer(policy.layer(Quota::daily(20).allowance("read")));
}

/// A minute (or an hour) counts on the counters of UTC's minutes in every
/// zone whose offset is whole: two minute quotas of one policy, one in
/// Berlin and one in UTC, would count on one counter. And an hour in
/// Kolkata is not the same quota as an hour in UTC, though both are named
/// `default-hour` and have the same limit.
#[test]
#[should_panic(expected = "would count on one counter")]
fn minutes_in_two_zones_are_refused_as_one_counter() {
    use tower_quota::jiff::tz::TimeZone;
    let berlin = TimeZone::get("Europe/Berlin").unwrap();
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let _utc = policy.layer(Quota::per_minute(10));
    let _berlin = policy.layer(Quota::per_minute(20).in_time_zone(berlin));
}

#[test]
#[should_panic(expected = "two different quotas of one policy")]
fn an_hour_in_kolkata_is_not_the_same_quota_as_an_hour_in_utc() {
    use tower_quota::jiff::tz::TimeZone;
    let kolkata = TimeZone::get("Asia/Kolkata").unwrap();
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let _utc = policy.layer(Quota::hourly(10));
    let _kolkata = policy.layer(Quota::hourly(10).in_time_zone(kolkata));
}

#[tokio::test]
async fn the_same_quota_on_two_routers_is_one_budget() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let daily = || policy.layer(Quota::daily(2).allowance("read"));
    let app = Router::new()
        .route("/a", get(|| async {}))
        .route_layer(daily())
        .merge(
            Router::new()
                .route("/b", get(|| async {}))
                .route_layer(daily()),
        );
    assert_eq!(
        send(&app, call(Method::GET, "/a", ACME)).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&app, call(Method::GET, "/b", ACME)).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&app, call(Method::GET, "/a", ACME)).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&app, call(Method::GET, "/b", ACME)).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// The README's recipe for reads and writes on one path: a router per
/// allowance, merged.
#[tokio::test]
async fn reads_and_writes_on_one_path_spend_their_own_allowances() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let app = Router::new()
        .route("/items", get(|| async { "items" }))
        .route_layer(policy.layer(Quota::daily(2).allowance("read")))
        .merge(
            Router::new()
                .route("/items", post(|| async { "created" }))
                .route_layer(policy.layer(Quota::daily(1).allowance("write"))),
        )
        .method_not_allowed_fallback(unrouted::MethodNotAllowed);
    for expected in [
        StatusCode::OK,
        StatusCode::OK,
        StatusCode::TOO_MANY_REQUESTS,
    ] {
        let response = send(&app, call(Method::GET, "/items", ACME)).await;
        assert_eq!(response.status(), expected);
    }
    let created = send(&app, call(Method::POST, "/items", ACME)).await;
    assert_eq!(created.status(), StatusCode::OK);
    let told = created.headers()["ratelimit"].to_str().unwrap();
    assert!(told.starts_with("\"write-day\";r=0;t="), "{told}");
    assert_eq!(
        send(&app, call(Method::POST, "/items", ACME))
            .await
            .status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    // A method neither router serves: 405, and neither allowance spent.
    let deleted = send(&app, call(Method::DELETE, "/items", ACME)).await;
    assert_eq!(deleted.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(used(&policy, "read-day").await, 2);
    assert_eq!(used(&policy, "write-day").await, 1);
}

/// A service shared behind a lock: cloning it does not clone what is inside,
/// so the layers around it cannot see the layers within.
struct Opaque<S>(std::sync::Arc<std::sync::Mutex<S>>);

impl<S> Clone for Opaque<S> {
    fn clone(&self) -> Self {
        Self(std::sync::Arc::clone(&self.0))
    }
}

impl<S, R> tower::Service<R> for Opaque<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.lock().unwrap().poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        self.0.lock().unwrap().call(request)
    }
}

#[tokio::test]
async fn a_hidden_inner_layer_that_refuses_gives_the_outer_charge_back() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let search = tower::Layer::layer(
        &policy.layer(Quota::per_minute(1).allowance("search")),
        axum::routing::get(|status: QuotaStatus| async move { status.entries().len().to_string() })
            .with_state::<()>(()),
    );
    let app = Router::new()
        .route_service(
            "/search",
            Opaque(std::sync::Arc::new(std::sync::Mutex::new(search))),
        )
        .route_layer(policy.layer(Quota::daily(10).allowance("read")));
    let first = send(&app, call(Method::GET, "/search", ACME)).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(body(first).await, "2", "the status lists both quotas");
    let refused = send(&app, call(Method::GET, "/search", ACME)).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        used(&policy, "read-day").await,
        1,
        "the read charge was given back"
    );
}

/// A middleware between two layers that answers a refusal with a response
/// of its own (an application's own 429 body, say) drops the refusal's
/// mark: the layer further in refused all the same, and the request was
/// not served, so the layer further out gives its charge back, and its
/// fields tell what is truly left. So does a refusal before any charge (a
/// request another policy further in cannot charge).
#[tokio::test]
async fn a_refusal_rebuilt_on_its_way_out_gives_the_outer_charge_back() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let other = QuotaPolicy::builder(FromHeader::account("x-partner-id")).build();
    // Builds a response of its own for every error: the extensions of the
    // layer's answer are not in it.
    let rebuild = axum::middleware::map_response(|response: axum::response::Response| async move {
        if response.status().is_success() {
            return response;
        }
        let (status, headers) = (response.status(), response.headers().clone());
        (status, headers, "try again later").into_response()
    });
    let app = Router::new()
        .merge(
            Router::new()
                .route("/search", get(|| async { "found" }))
                .route_layer(policy.layer(Quota::per_minute(1).allowance("search")))
                .layer(rebuild.clone()),
        )
        .merge(
            Router::new()
                .route("/partner", get(|| async { "partner" }))
                .route_layer(other.layer(Quota::daily(10).allowance("partner")))
                .layer(rebuild),
        )
        .route_layer(policy.layer(Quota::daily(10).allowance("read")));
    let first = send(&app, call(Method::GET, "/search", ACME)).await;
    assert_eq!(first.status(), StatusCode::OK);
    let refused = send(&app, call(Method::GET, "/search", ACME)).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let fields = refused.headers()["ratelimit"].to_str().unwrap().to_owned();
    assert!(fields.starts_with("\"read-day\";r=9;"), "{fields}");
    assert_eq!(
        used(&policy, "read-day").await,
        1,
        "the refused search spent no read"
    );
    // No partner id: the partner policy refuses with 401 before any charge.
    let unauthorized = send(&app, call(Method::GET, "/partner", ACME)).await;
    assert_eq!(unauthorized.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        used(&policy, "read-day").await,
        1,
        "the refused partner call spent no read"
    );
}

#[tokio::test]
async fn quotas_of_a_layer_the_request_never_reached_are_given_back() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    // The burst layer guards GET only; the read layer wraps the whole method
    // router, so it cannot tell which method will pass the burst layer.
    let names = |status: QuotaStatus| async move {
        let entries = status.entries();
        let names: Vec<&str> = entries.iter().map(|e| e.name()).collect();
        names.join(",")
    };
    let methods = get(|| async { "found" })
        .route_layer(policy.layer(Quota::per_minute(1).allowance("search")))
        .post(names);
    let app = Router::new()
        .route_service("/search", methods.with_state::<()>(()))
        .route_layer(policy.layer(Quota::daily(10).allowance("read")));
    assert_eq!(
        send(&app, call(Method::POST, "/search", ACME))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(used(&policy, "search-minute").await, 0);
    assert_eq!(used(&policy, "read-day").await, 1);
    assert_eq!(
        send(&app, call(Method::GET, "/search", ACME))
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(used(&policy, "search-minute").await, 1);
    assert_eq!(used(&policy, "read-day").await, 2);
}

#[tokio::test]
async fn client_ips_through_a_router_with_and_without_trusted_proxies() {
    use axum::extract::ConnectInfo;
    use std::net::SocketAddr;
    use tower_quota::{ClientIp, SubjectKind};

    let policy = QuotaPolicy::builder(ClientIp::new().trust_proxy_cidrs(["10.0.0.0/8"])).build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(policy.layer(Quota::daily(2)));
    let from = |peer: &str, forwarded: Option<&str>| {
        let mut request = Request::get("/");
        if let Some(forwarded) = forwarded {
            request = request.header("x-forwarded-for", forwarded);
        }
        let mut request = request.body(Body::empty()).unwrap();
        let peer: SocketAddr = peer.parse().unwrap();
        request.extensions_mut().insert(ConnectInfo(peer));
        request
    };
    let used_by = |ip: &str| {
        let handle = policy.handle();
        let subject = Subject::new(SubjectKind::IP, ip);
        async move { handle.usage(&subject).await.unwrap()[0].used() }
    };

    // An untrusted peer cannot name another client.
    let spoofed = send(&app, from("203.0.113.7:5000", Some("198.51.100.9"))).await;
    assert_eq!(spoofed.status(), StatusCode::OK);
    assert_eq!(used_by("203.0.113.7").await, 1);
    assert_eq!(used_by("198.51.100.9").await, 0);
    // Behind a trusted proxy, the client it names is charged.
    send(&app, from("10.1.2.3:443", Some("198.51.100.9, 10.9.9.9"))).await;
    assert_eq!(used_by("198.51.100.9").await, 1);
    // IPv6 clients of one /64 share a counter; another /64 does not.
    send(&app, from("[2001:db8:1:2::1]:1", None)).await;
    send(&app, from("[2001:db8:1:2:ffff::9]:1", None)).await;
    let third = send(&app, from("[2001:db8:1:2::7]:1", None)).await;
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        send(&app, from("[2001:db8:1:3::1]:1", None)).await.status(),
        StatusCode::OK
    );
    // Garbage from a trusted proxy is a 400, never the proxy's own address.
    let garbage = send(&app, from("10.1.2.3:443", Some("not-an-address"))).await;
    assert_eq!(garbage.status(), StatusCode::BAD_REQUEST);
    // No connection address at all: the server was set up without it.
    let nobody = send(&app, Request::get("/").body(Body::empty()).unwrap()).await;
    assert_eq!(nobody.status(), StatusCode::INTERNAL_SERVER_ERROR);
}

#[tokio::test]
async fn a_full_memory_store_is_a_store_error_for_new_subjects_only() {
    for open in [false, true] {
        let mut builder = QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(MemoryStore::new().max_counters(1));
        if open {
            builder = builder.on_store_error(tower_quota::OnStoreError::FailOpen);
        }
        let policy = builder.build();
        let app = Router::new()
            .route("/", get(|| async { "hi" }))
            .route_layer(policy.layer(Quota::daily(5)));
        assert_eq!(
            send(&app, call(Method::GET, "/", ACME)).await.status(),
            StatusCode::OK
        );
        let newcomer = send(&app, call(Method::GET, "/", &[("x-account-id", "globex")])).await;
        if open {
            assert_eq!(newcomer.status(), StatusCode::OK);
            assert!(!newcomer.headers().contains_key("ratelimit"));
        } else {
            assert_eq!(newcomer.status(), StatusCode::SERVICE_UNAVAILABLE);
            let text = body(newcomer).await;
            assert!(
                !text.contains("counters"),
                "the store's detail stays in the logs: {text}"
            );
        }
        let known = send(&app, call(Method::GET, "/", ACME)).await;
        assert!(known.headers()["ratelimit"]
            .to_str()
            .unwrap()
            .starts_with("\"default-day\";r=3;"));
    }
}

#[tokio::test]
async fn an_unrouted_answer_beside_real_routes_exempts_only_itself() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let methods = get(|| async { "ok" }).fallback(unrouted::MethodNotAllowed);
    let app = Router::new()
        .route_service("/x", methods.with_state::<()>(()))
        .route_layer(policy.layer(Quota::daily(1)));
    let wrong = send(&app, call(Method::DELETE, "/x", ACME)).await;
    assert_eq!(wrong.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert!(!wrong.headers().contains_key("ratelimit"));
    assert_eq!(
        used(&policy, "default-day").await,
        0,
        "the 405 was given back"
    );
    assert_eq!(
        send(&app, call(Method::GET, "/x", ACME)).await.status(),
        StatusCode::OK
    );
    assert_eq!(used(&policy, "default-day").await, 1, "the GET was charged");
    assert_eq!(
        send(&app, call(Method::GET, "/x", ACME)).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn not_found_under_a_router_wide_layer_is_given_back() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .fallback(unrouted::NotFound)
        .layer(policy.layer(Quota::daily(1)));
    let missing = send(&app, call(Method::GET, "/nowhere", ACME)).await;
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    assert!(!missing.headers().contains_key("ratelimit"));
    assert_eq!(used(&policy, "default-day").await, 0);
    assert_eq!(
        send(&app, call(Method::GET, "/", ACME)).await.status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn not_found_gets_no_fields_even_when_it_cost_nothing() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .fallback(unrouted::NotFound)
        .layer(policy.layer(Quota::daily(1)).cost(0));
    let missing = send(&app, call(Method::GET, "/nowhere", ACME)).await;
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    assert!(!missing.headers().contains_key("ratelimit"));
    assert!(!missing.headers().contains_key("ratelimit-policy"));
    let found = send(&app, call(Method::GET, "/", ACME)).await;
    assert!(found.headers().contains_key("ratelimit"));
}

#[tokio::test]
async fn the_same_quota_hidden_inside_is_charged_once() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let daily = || policy.layer(Quota::daily(10).allowance("read"));
    let inner = tower::Layer::layer(&daily(), get(|| async { "ok" }).with_state::<()>(()));
    let app = Router::new()
        .route_service(
            "/",
            Opaque(std::sync::Arc::new(std::sync::Mutex::new(inner))),
        )
        .route_layer(daily());
    assert_eq!(
        send(&app, call(Method::GET, "/", ACME)).await.status(),
        StatusCode::OK
    );
    assert_eq!(used(&policy, "read-day").await, 1, "one request, one unit");
}

#[tokio::test]
async fn a_late_refund_never_credits_a_later_first_use_period() {
    let clock = ManualClock::new(at("2026-12-02T10:00:00Z"));
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock.clone())
        .refund_server_errors(true)
        .build();
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let opened = gate.clone();
    let app = Router::new()
        .route(
            "/slow",
            get(move || {
                let opened = opened.clone();
                async move {
                    opened.notified().await;
                    StatusCode::INTERNAL_SERVER_ERROR
                }
            }),
        )
        .route("/ok", get(|| async { "ok" }))
        .route_layer(policy.layer(Quota::rolling(5, std::time::Duration::from_secs(60))));
    let slow = tokio::spawn({
        let app = app.clone();
        async move { app.oneshot(call(Method::GET, "/slow", ACME)).await.unwrap() }
    });
    tokio::task::yield_now().await;
    while used(&policy, "default-rolling-1m").await == 0 {
        tokio::task::yield_now().await;
    }
    clock.advance(SignedDuration::from_secs(61));
    for _ in 0..3 {
        assert_eq!(
            send(&app, call(Method::GET, "/ok", ACME)).await.status(),
            StatusCode::OK
        );
    }
    gate.notify_one();
    assert_eq!(
        slow.await.unwrap().status(),
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        used(&policy, "default-rolling-1m").await,
        3,
        "the new period keeps its count"
    );
}

/// A store that counts its round trips.
#[derive(Clone, Default)]
struct Counting {
    inner: MemoryStore,
    charges: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Store for Counting {
    type ChargeFuture = <MemoryStore as Store>::ChargeFuture;

    fn charge(&self, request: tower_quota::store::ChargeRequest) -> Self::ChargeFuture {
        self.charges
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.charge(request)
    }
    fn peek(
        &self,
        request: tower_quota::store::ChargeRequest,
    ) -> impl std::future::Future<Output = Result<Vec<tower_quota::Usage>, tower_quota::StoreError>> + Send
    {
        self.inner.peek(request)
    }
    fn refund(
        &self,
        now: Timestamp,
        key: tower_quota::PeriodKey,
        amount: u64,
    ) -> impl std::future::Future<Output = Result<Option<u64>, tower_quota::StoreError>> + Send
    {
        self.inner.refund(now, key, amount)
    }
    fn add(
        &self,
        now: Timestamp,
        key: tower_quota::PeriodKey,
        amount: u64,
    ) -> impl std::future::Future<Output = Result<Option<u64>, tower_quota::StoreError>> + Send
    {
        self.inner.add(now, key, amount)
    }
    fn reset(
        &self,
        key: tower_quota::PeriodKey,
    ) -> impl std::future::Future<Output = Result<bool, tower_quota::StoreError>> + Send {
        self.inner.reset(key)
    }
    fn settle_debt(
        &self,
        now: Timestamp,
        debt: tower_quota::store::Debt,
    ) -> impl std::future::Future<Output = Result<Option<u64>, tower_quota::StoreError>> + Send
    {
        self.inner.settle_debt(now, debt)
    }
}

#[tokio::test]
async fn each_layer_that_adds_quotas_takes_one_round_trip() {
    let store = Counting::default();
    let (app, _policy) = search_app(store.clone(), 10, 5);
    for _ in 0..3 {
        assert_eq!(
            send(&app, call(Method::GET, "/search", ACME))
                .await
                .status(),
            StatusCode::OK
        );
    }
    // Two layers: two calls per search.
    assert_eq!(store.charges.load(std::sync::atomic::Ordering::Relaxed), 6);

    // One layer with two quotas: one call.
    let store = Counting::default();
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store.clone())
        .build();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        policy
            .layer(Quota::daily(10))
            .quota(Quota::per_minute(5).allowance("burst")),
    );
    send(&app, call(Method::GET, "/", ACME)).await;
    assert_eq!(store.charges.load(std::sync::atomic::Ordering::Relaxed), 1);
}

#[tokio::test]
async fn a_response_future_dropped_before_it_ran_spends_nothing() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let mut service = tower::Layer::layer(
        &policy.layer(Quota::daily(5)),
        tower::service_fn(|_: Request<Body>| async {
            Ok::<_, std::convert::Infallible>(Response::new(Body::empty()))
        }),
    );
    let future = tower::Service::call(&mut service, call(Method::GET, "/", ACME));
    drop(future);
    assert_eq!(used(&policy, "default-day").await, 0);
}

#[tokio::test]
async fn declared_plans_are_known_before_their_layers_are_built() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .plan(|parts| Some(parts.headers.get("x-plan")?.to_str().ok()?.to_owned()))
        .plans(["free", "pro"])
        .on_unknown_plan(UnknownPlan::Reject)
        .build();
    // This layer names no plan at all; "pro" is still a plan.
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(policy.layer(Quota::daily(2)));
    let pro: &[(&str, &str)] = &[("x-account-id", "acme"), ("x-plan", "pro")];
    assert_eq!(
        send(&app, call(Method::GET, "/", pro)).await.status(),
        StatusCode::OK
    );
    let gold: &[(&str, &str)] = &[("x-account-id", "acme"), ("x-plan", "gold")];
    assert_eq!(
        send(&app, call(Method::GET, "/", gold)).await.status(),
        StatusCode::FORBIDDEN
    );
}

#[tokio::test]
async fn a_grpc_call_is_refused_with_resource_exhausted() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(ManualClock::new(at("2026-12-02T23:59:00Z")))
        .build();
    let app = Router::new()
        .route(
            "/grpc.health.v1.Health/Check",
            axum::routing::post(|| async { "ok" }),
        )
        .route_layer(policy.layer(Quota::daily(1)));
    let grpc = || {
        Request::post("/grpc.health.v1.Health/Check")
            .header("x-account-id", "acme")
            .header("content-type", "application/grpc+proto")
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(send(&app, grpc()).await.status(), StatusCode::OK);
    let refused = send(&app, grpc()).await;
    assert_eq!(
        refused.status(),
        StatusCode::OK,
        "gRPC carries its status in grpc-status"
    );
    let headers = refused.headers();
    assert_eq!(headers["grpc-status"], "8");
    assert_eq!(
        headers["content-type"], "application/grpc+proto",
        "the call's own"
    );
    assert_eq!(headers["retry-after"], "60");
    let message = headers["grpc-message"].to_str().unwrap();
    assert!(
        message.contains("default-day") && message.contains("2026-12-03T00:00:00Z"),
        "{message}"
    );
    assert!(headers["ratelimit"]
        .to_str()
        .unwrap()
        .starts_with("\"default-day\";r=0;t=60"));
    assert!(body(refused).await.is_empty());
}

/// `grpc-message` is percent-encoded, `%` included: a client decodes it
/// back to the detail, whatever the quota's name holds.
#[tokio::test]
async fn a_grpc_refusal_message_decodes_back_to_the_detail() {
    let clock = ManualClock::new("2026-12-02T10:00:00Z".parse().unwrap());
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock)
        .build();
    let app = Router::new()
        .route(
            "/grpc.health.v1.Health/Check",
            axum::routing::post(|| async { "ok" }),
        )
        .route_layer(policy.layer(Quota::daily(1).named("tier-%41%2F")));
    let call = |content_type: &str| {
        Request::post("/grpc.health.v1.Health/Check")
            .header("x-account-id", "acme")
            .header("content-type", content_type)
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(
        send(&app, call("application/grpc")).await.status(),
        StatusCode::OK
    );
    let refused = send(&app, call("application/grpc")).await;
    assert_eq!(refused.headers()["grpc-status"], "8");
    let message = refused.headers()["grpc-message"]
        .to_str()
        .unwrap()
        .to_owned();
    let decoded = percent_encoding::percent_decode_str(&message)
        .decode_utf8()
        .unwrap()
        .into_owned();
    // The same refusal as a problem document tells the detail as is.
    let problem = send(&app, call("application/json")).await;
    assert_eq!(problem.status(), StatusCode::TOO_MANY_REQUESTS);
    let problem: serde_json::Value = serde_json::from_str(&body(problem).await).unwrap();
    assert!(decoded.contains("\"tier-%41%2F\""), "{decoded}");
    assert_eq!(decoded, problem["detail"].as_str().unwrap());
}

#[tokio::test]
async fn a_refusal_hook_shapes_the_answer_and_keeps_the_fields() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .refusal(|refusal| {
            let text = format!(
                "{} over: {}",
                refusal.status.as_u16(),
                refusal
                    .violated
                    .iter()
                    .map(|(q, _, _)| q.name())
                    .collect::<Vec<_>>()
                    .join(",")
            );
            let mut response = Response::new(bytes::Bytes::from(text));
            *response.status_mut() = refusal.status;
            response
        })
        .build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(policy.layer(Quota::daily(1)));
    send(&app, call(Method::GET, "/", ACME)).await;
    let refused = send(&app, call(Method::GET, "/", ACME)).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.headers().contains_key("ratelimit"));
    assert_eq!(body(refused).await, "429 over: default-day");
}

async fn shadow_quotas_count_and_never_refuse<St: Store>(store: St) {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(
            policy
                .layer(Quota::daily(1).shadow())
                .quota(Quota::per_minute(10).allowance("burst")),
        );
    let mut last = None;
    for _ in 0..3 {
        let response = send(&app, call(Method::GET, "/", ACME)).await;
        assert_eq!(response.status(), StatusCode::OK);
        last = Some(response);
    }
    let last = last.unwrap();
    assert!(last.headers()["ratelimit"]
        .to_str()
        .unwrap()
        .starts_with("\"default-day\";r=0;"));
    assert!(last.headers()["ratelimit-policy"]
        .to_str()
        .unwrap()
        .starts_with("\"default-day\";q=1;"));
    assert_eq!(used(&policy, "default-day").await, 3, "counted");
}

/// A layer whose quotas left to charge are shadow quotas only (its other
/// quota was charged by a layer further out) never refuses, as a layer of
/// shadow quotas never does: a cost it cannot work out lets the request
/// through uncounted by it, not a 400.
#[tokio::test]
async fn a_layer_left_with_shadow_quotas_only_never_refuses() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let daily = Quota::daily(10).allowance("read");
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(
            policy
                .layer(daily.clone())
                .quota(Quota::per_minute(10).allowance("burst").shadow())
                .cost_fn(|_| Err(tower_quota::InvalidRequest::new("no cost"))),
        )
        .route_layer(policy.layer(daily));
    let response = send(&app, call(Method::GET, "/", ACME)).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(used(&policy, "read-day").await, 1, "charged further out");
}

#[tokio::test]
async fn shadow_quotas_on_the_memory_store() {
    shadow_quotas_count_and_never_refuse(MemoryStore::new()).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_quotas_on_redis() {
    let server = redis_server_or_skip!();
    let store = tower_quota::store::RedisStore::builder(server.url())
        .timeout(std::time::Duration::from_secs(2))
        .build()
        .unwrap();
    shadow_quotas_count_and_never_refuse(store).await;
}

#[tokio::test]
async fn a_refusal_names_only_enforced_quotas() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(
            policy
                .layer(Quota::daily(1).shadow())
                .quota(Quota::per_minute(2).allowance("burst")),
        );
    for _ in 0..2 {
        assert_eq!(
            send(&app, call(Method::GET, "/", ACME)).await.status(),
            StatusCode::OK
        );
    }
    let refused = send(&app, call(Method::GET, "/", ACME)).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(body(refused)
        .await
        .contains("\"violated-policies\":[\"burst-minute\"]"));
}

#[tokio::test]
async fn spread_resets_are_never_earlier_than_the_reset() {
    let clock = ManualClock::new(at("2026-12-02T23:59:00Z"));
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock)
        .build();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(
            policy.layer(Quota::daily(1).spread_reset(std::time::Duration::from_secs(300))),
        );
    let mut waits = std::collections::HashSet::new();
    for i in 0..40 {
        let account = format!("account-{i}");
        let headers: &[(&str, &str)] = &[("x-account-id", &account)];
        send(&app, call(Method::GET, "/", headers)).await;
        let refused = send(&app, call(Method::GET, "/", headers)).await;
        let retry: u64 = refused.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((60..=360).contains(&retry), "{retry}");
        let field = refused.headers()["ratelimit"].to_str().unwrap().to_owned();
        assert!(
            field.ends_with(&format!(";t={retry}")),
            "{field} vs {retry}"
        );
        waits.insert(retry);
    }
    assert!(waits.len() > 10, "subjects are spread: {waits:?}");
}

/// A batch endpoint sends sub-requests with its own extensions through a
/// router of the same policy: what the batch was charged stays charged,
/// whatever the sub-requests meet.
#[tokio::test]
async fn a_sub_request_refused_inside_leaves_the_batch_charged() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let inner = Router::new()
        .route("/search", get(|| async { "found" }))
        .route_layer(policy.layer(Quota::per_minute(1).allowance("search")));
    let batch = move |request: Request<Body>| {
        let inner = inner.clone();
        async move {
            let mut statuses = Vec::new();
            for _ in 0..2 {
                let mut sub = Request::get("/search").body(Body::empty()).unwrap();
                *sub.extensions_mut() = request.extensions().clone();
                let response = inner.clone().oneshot(sub).await.unwrap();
                statuses.push(response.status().as_u16().to_string());
            }
            statuses.join(",")
        }
    };
    let app = Router::new()
        .route("/batch", get(batch))
        .route_layer(policy.layer(Quota::daily(10).allowance("read")));
    let response = send(&app, call(Method::GET, "/batch", ACME)).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(body(response).await, "200,429");
    assert_eq!(
        used(&policy, "read-day").await,
        1,
        "the batch stays charged"
    );
    assert_eq!(used(&policy, "search-minute").await, 1);
}

/// A quota its policy refuses (the name of another quota of it) claims
/// nothing on the store: another policy on the store may count a quota of
/// its own on that allowance, which the first policy does not have.
#[test]
fn a_quota_refused_by_its_policy_claims_nothing_on_the_store() {
    let store = MemoryStore::new();
    let first = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store.clone())
        .build();
    let _read = first.layer(Quota::daily(10).allowance("read").named("calls"));
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        first.layer(Quota::daily(5).allowance("write").named("calls"))
    }));
    assert!(refused.is_err(), "two quotas named alike are refused");
    assert_eq!(first.quotas().len(), 1);
    let second = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .build();
    let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        second.layer(Quota::daily(7).allowance("write"))
    }));
    assert!(
        made.is_ok(),
        "refused for a quota the first policy does not have"
    );
}

#[test]
#[should_panic(expected = "two policies on one store and namespace would count on one counter")]
fn two_policies_on_one_store_never_give_different_quotas_one_counter() {
    let store = MemoryStore::new();
    let a = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store.clone())
        .build();
    let b = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .build();
    let _ten = a.layer(Quota::daily(10));
    let _hundred = b.layer(Quota::daily(100));
}

#[test]
fn policies_on_one_store_may_share_a_quota_or_keep_apart() {
    let store = MemoryStore::new();
    let policy = || {
        QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store.clone())
            .build()
    };
    // Two instances of one app in a test: the same quota, one budget.
    let (a, b) = (policy(), policy());
    let _a = a.layer(Quota::daily(10));
    let _b = b.layer(Quota::daily(10));
    // Another namespace keeps its counters apart.
    let other = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store.clone())
        .namespace("other")
        .build();
    let _other = other.layer(Quota::daily(100));
    // A policy gone leaves nothing behind.
    drop((a, b, _a, _b));
    let c = policy();
    let _c = c.layer(Quota::daily(1_000));
}

/// A layer has one cost: the last of `cost`, `cost_fn` and `deferred_cost`
/// called is the one charged.
#[tokio::test]
async fn the_last_cost_set_on_a_layer_is_its_cost() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(
            policy
                .layer(Quota::daily(10))
                .deferred_cost(1, |_| 5)
                .cost(3),
        );
    send(&app, call(Method::GET, "/", ACME)).await;
    assert_eq!(
        used(&policy, "default-day").await,
        3,
        "cost 3, no deferred cost"
    );

    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(
            policy
                .layer(Quota::daily(10))
                .cost(3)
                .deferred_cost(1, |_| 5),
        );
    send(&app, call(Method::GET, "/", ACME)).await;
    assert_eq!(
        used(&policy, "default-day").await,
        5,
        "admitted on 1, charged 5"
    );
}

#[test]
#[should_panic(expected = "at least one byte")]
fn a_longest_subject_id_of_zero_is_refused_when_the_policy_is_made() {
    let _ = QuotaPolicy::builder(FromHeader::account("x-account-id")).max_subject_len(0);
}

#[test]
#[should_panic(expected = "a store timeout of zero")]
fn a_store_timeout_of_zero_is_refused_when_the_policy_is_made() {
    let _ = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store_timeout(Some(std::time::Duration::ZERO));
}

/// A quota with a plan's limit on a policy that reads no plan would give
/// every caller the quota's own limit: refused where the layer is made.
#[test]
#[should_panic(expected = "the policy reads no plan")]
fn a_plan_limit_on_a_policy_that_reads_no_plan_is_refused() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let _ = policy.layer(Quota::daily(100).plan("pro", 10_000));
}

/// A quota's plan that the policy's declared plans do not name (a typo:
/// `Pro` for `pro`) is refused where the layer is made: its callers would
/// be charged the quota's own limit.
#[test]
#[should_panic(expected = "do not name")]
fn a_plan_limit_outside_the_declared_plans_is_refused() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .plan(|parts| Some(parts.headers.get("x-plan")?.to_str().ok()?.to_owned()))
        .plans(["free", "pro"])
        .build();
    let _ = policy.layer(Quota::daily(100).plan("Pro", 10_000));
}

/// A rejection with a status that is no error (a redirect) is refused
/// where it is set, not swapped for 401 at each request.
#[test]
#[should_panic(expected = "4xx or 5xx")]
fn a_subject_rejection_that_is_no_error_is_refused() {
    let _ = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .on_missing_subject(tower_quota::SubjectPolicy::Reject(StatusCode::FOUND));
}
