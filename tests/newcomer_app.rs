//! A paid API as a newcomer writes it from the README: authentication
//! inserting the account, a daily quota on every route, a per-minute burst on
//! an expensive route, read and write budgets on one path, plans and zones
//! from the account, refunds of server errors, a deferred cost, the caller's
//! standing, the support router behind admin authentication, CORS outside.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::request::Parts;
use axum::http::{HeaderValue, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{middleware, Json, Router};
use tower::ServiceExt;
use tower_http::cors::CorsLayer;
use tower_quota::jiff::tz::TimeZone;
use tower_quota::jiff::Timestamp;
use tower_quota::{
    unrouted, CallerInfo, FromExtension, ManualClock, MapExtension, Quota, QuotaHandle,
    QuotaPolicy, QuotaStatus, QuotaUsage, UnknownPlan,
};

#[derive(Clone, Debug)]
struct Account {
    id: String,
    plan: String,
    zone: TimeZone,
}

fn account_id(account: &Account) -> String {
    account.id.clone()
}

type Policy = QuotaPolicy<MapExtension<Account, fn(&Account) -> String>>;

/// The application's accounts, by bearer token.
fn accounts() -> Arc<HashMap<&'static str, Account>> {
    let zone = |name| TimeZone::get(name).unwrap();
    Arc::new(HashMap::from([
        (
            "tok-acme",
            Account {
                id: "acme".into(),
                plan: "free".into(),
                zone: zone("Europe/Berlin"),
            },
        ),
        (
            "tok-globex",
            Account {
                id: "globex".into(),
                plan: "pro".into(),
                zone: zone("America/New_York"),
            },
        ),
    ]))
}

fn policy(clock: impl tower_quota::Clock) -> Policy {
    let known = accounts();
    QuotaPolicy::builder(FromExtension::<Account>::account_from(
        account_id as fn(&Account) -> String,
    ))
    .challenge(HeaderValue::from_static("Bearer"))
    .clock(clock)
    .skip_if(|parts| parts.method == Method::OPTIONS)
    .plan(|parts| parts.extensions.get::<Account>().map(|a| a.plan.clone()))
    .plans(["free", "pro"])
    .on_unknown_plan(UnknownPlan::Reject)
    .time_zone(|parts| Ok(parts.extensions.get::<Account>().map(|a| a.zone.clone())))
    .caller_info(move |subject| {
        let found = known
            .values()
            .find(|a| a.id.as_bytes() == subject.id())
            .cloned();
        async move { Ok(found.map(|a| CallerInfo::new().plan(a.plan).zone(a.zone))) }
    })
    .refund_server_errors(true)
    .build()
}

async fn authenticate(mut request: axum::extract::Request, next: middleware::Next) -> Response {
    let token = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    if let Some(token) = token {
        match accounts().get(token.as_str()) {
            Some(account) => {
                request.extensions_mut().insert(account.clone());
            }
            None => return StatusCode::UNAUTHORIZED.into_response(),
        }
    }
    next.run(request).await
}

async fn admin_auth(request: axum::extract::Request, next: middleware::Next) -> Response {
    if request
        .headers()
        .get("x-admin-key")
        .is_some_and(|k| k == "s3cret")
    {
        next.run(request).await
    } else {
        StatusCode::UNAUTHORIZED.into_response()
    }
}

#[derive(Clone, Copy)]
struct TokensUsed(u64);

async fn generate() -> Response {
    let mut response = "generated".into_response();
    response.extensions_mut().insert(TokensUsed(400));
    response
}

async fn status(status: QuotaStatus) -> Json<serde_json::Value> {
    let day = status.get("calls-day").expect("calls-day charged");
    Json(serde_json::json!({
        "entries": status.entries().iter().map(QuotaUsage::to_json).collect::<Vec<_>>(),
        "calls_left": day.remaining(),
    }))
}

async fn my_quota(State(handle): State<QuotaHandle>, parts: Parts) -> Response {
    match handle.standing(&parts).await {
        Ok(usage) => {
            Json(usage.iter().map(QuotaUsage::to_json).collect::<Vec<_>>()).into_response()
        }
        Err(error) => error.into_response(),
    }
}

fn app(policy: &Policy) -> Router {
    let handle = policy.handle();
    let calls = Quota::daily(100).plan("pro", 1_000).allowance("calls");
    let read = Quota::daily(5).plan("pro", 50).allowance("read");
    let write = Quota::daily(2).plan("pro", 20).allowance("write");
    let burst = Quota::per_minute(3).allowance("search");
    let tokens = Quota::monthly(1_000)
        .plan("pro", 100_000)
        .allowance("tokens");

    let items = Router::new()
        .route("/items", get(|| async { "items" }))
        .route_layer(policy.layer(read))
        .merge(
            Router::new()
                .route(
                    "/items",
                    post(|| async { (StatusCode::CREATED, "created") }),
                )
                .route_layer(policy.layer(write)),
        );
    let search = Router::new()
        .route("/search", get(|| async { "found" }))
        .route_layer(policy.layer(burst));
    let generate = Router::new()
        .route("/generate", post(generate))
        .route_layer(policy.layer(tokens).deferred_cost(1, |response| {
            response.extensions.get::<TokensUsed>().map_or(1, |t| t.0)
        }));

    let api: Router<QuotaHandle> = Router::new()
        .route("/status", get(status))
        .route("/boom", get(|| async { StatusCode::INTERNAL_SERVER_ERROR }))
        .merge(items)
        .merge(search)
        .merge(generate)
        .route_layer(policy.layer(calls))
        .route("/me/quota", get(my_quota)) // authenticated, never charged
        .route_layer(middleware::from_fn(authenticate))
        .route("/healthz", get(|| async { "ok" }));

    Router::new()
        .merge(api)
        .nest(
            "/admin",
            handle.router().layer(middleware::from_fn(admin_auth)),
        )
        .with_state(handle)
        .fallback(unrouted::NotFound)
        .method_not_allowed_fallback(unrouted::MethodNotAllowed)
        .layer(
            CorsLayer::new()
                .allow_origin(HeaderValue::from_static("https://app.example"))
                .allow_methods([Method::GET, Method::POST])
                .allow_headers([axum::http::header::AUTHORIZATION])
                .expose_headers([
                    "ratelimit".parse().unwrap(),
                    "ratelimit-policy".parse().unwrap(),
                    "retry-after".parse().unwrap(),
                ]),
        )
}

fn at(ts: &str) -> Timestamp {
    ts.parse().unwrap()
}

fn call(method: Method, path: &str, token: Option<&str>) -> Request<Body> {
    let mut builder = Request::builder()
        .method(method)
        .uri(path)
        .header("origin", "https://app.example");
    if let Some(token) = token {
        builder = builder.header("authorization", format!("Bearer {token}"));
    }
    builder.body(Body::empty()).unwrap()
}

async fn send(app: &Router, request: Request<Body>) -> Response {
    app.clone().oneshot(request).await.unwrap()
}

async fn json(response: Response) -> serde_json::Value {
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null)
}

/// A parameter (`r`, `t`, `q`, `w`) of the named item of a structured field.
fn item(response: &Response, field: &str, name: &str, param: &str) -> Option<u64> {
    let value = response.headers().get(field)?.to_str().ok()?;
    let quoted = format!("\"{name}\"");
    value
        .split(',')
        .map(str::trim)
        .find(|i| i.starts_with(&quoted))
        .and_then(|i| {
            i.split(';')
                .skip(1)
                .find_map(|p| p.strip_prefix(&format!("{param}=")))
                .and_then(|v| v.parse().ok())
        })
}

async fn used(handle: &QuotaHandle, id: &str, name: &str) -> u64 {
    let subject = handle
        .subject(&tower_quota::SubjectKind::ACCOUNT, id)
        .unwrap();
    let handle = handle.for_caller(&subject).await.unwrap();
    let usage = handle.usage(&subject).await.unwrap();
    usage
        .iter()
        .find(|u| u.name() == name)
        .unwrap_or_else(|| panic!("no {name}"))
        .used()
}

#[tokio::test]
async fn the_daily_quota_the_burst_and_the_read_write_budgets() {
    let clock = ManualClock::new(at("2027-03-10T09:00:00Z"));
    let policy = policy(clock.clone());
    let handle = policy.handle();
    let app = app(&policy);

    // No credentials: 401 with the policy's challenge, nothing charged.
    let anonymous = send(&app, call(Method::GET, "/items", None)).await;
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(anonymous.headers()["www-authenticate"], "Bearer");
    assert_eq!(
        anonymous.headers()["access-control-allow-origin"],
        "https://app.example"
    );

    // Public route and unknown path and method: never charged.
    assert_eq!(
        send(&app, call(Method::GET, "/healthz", None))
            .await
            .status(),
        StatusCode::OK
    );
    let missing = send(&app, call(Method::GET, "/nope", Some("tok-acme"))).await;
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    let wrong = send(&app, call(Method::DELETE, "/items", Some("tok-acme"))).await;
    assert_eq!(wrong.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(used(&handle, "acme", "calls-day").await, 0);

    // Reads and writes on one path, each on its budget, both on the daily one.
    for _ in 0..5 {
        let ok = send(&app, call(Method::GET, "/items", Some("tok-acme"))).await;
        assert_eq!(ok.status(), StatusCode::OK);
    }
    let refused = send(&app, call(Method::GET, "/items", Some("tok-acme"))).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        refused.headers()["access-control-allow-origin"],
        "https://app.example"
    );
    let problem = json(refused).await;
    assert_eq!(
        problem["violated-policies"],
        serde_json::json!(["read-day"])
    );
    let created = send(&app, call(Method::POST, "/items", Some("tok-acme"))).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    assert_eq!(item(&created, "ratelimit", "write-day", "r"), Some(1));
    assert_eq!(item(&created, "ratelimit", "calls-day", "r"), Some(94));
    assert_eq!(used(&handle, "acme", "read-day").await, 5);
    assert_eq!(used(&handle, "acme", "write-day").await, 1);
    assert_eq!(used(&handle, "acme", "calls-day").await, 6);

    // The burst: the fourth search in a minute is refused, and its daily
    // charge goes back.
    for _ in 0..3 {
        assert_eq!(
            send(&app, call(Method::GET, "/search", Some("tok-acme")))
                .await
                .status(),
            StatusCode::OK
        );
    }
    let burst = send(&app, call(Method::GET, "/search", Some("tok-acme"))).await;
    assert_eq!(burst.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(item(&burst, "ratelimit", "calls-day", "r"), Some(91));
    assert_eq!(used(&handle, "acme", "calls-day").await, 9);
    clock.advance(Duration::from_secs(60));
    assert_eq!(
        send(&app, call(Method::GET, "/search", Some("tok-acme")))
            .await
            .status(),
        StatusCode::OK
    );

    // A server error is given back.
    let boom = send(&app, call(Method::GET, "/boom", Some("tok-acme"))).await;
    assert_eq!(boom.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(used(&handle, "acme", "calls-day").await, 10);
}

#[tokio::test]
async fn status_standing_plans_and_support() {
    let clock = ManualClock::new(at("2027-03-10T09:00:00Z"));
    let policy = policy(clock.clone());
    let app = app(&policy);

    // The handler reads what its request was charged on.
    let status = send(&app, call(Method::GET, "/status", Some("tok-globex"))).await;
    assert_eq!(status.status(), StatusCode::OK);
    assert_eq!(
        item(&status, "ratelimit-policy", "calls-day", "q"),
        Some(1_000)
    );
    let body = json(status).await;
    assert_eq!(body["calls_left"], 999);

    // The caller's standing: on its plan, charging nothing.
    let standing = send(&app, call(Method::GET, "/me/quota", Some("tok-globex"))).await;
    assert_eq!(standing.status(), StatusCode::OK);
    let body = json(standing).await;
    let calls = body
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == "calls-day")
        .unwrap()
        .clone();
    assert_eq!(calls["limit"], 1_000);
    assert_eq!(calls["used"], 1);
    let anonymous = send(&app, call(Method::GET, "/me/quota", None)).await;
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(anonymous.headers()["www-authenticate"], "Bearer");

    // Support, behind admin authentication, in the customer's zone and on
    // its plan from `caller_info`.
    let denied = send(&app, call(Method::GET, "/admin/quota/account/globex", None)).await;
    assert_eq!(denied.status(), StatusCode::UNAUTHORIZED);
    let mut request = call(Method::GET, "/admin/quota/account/globex", None);
    request
        .headers_mut()
        .insert("x-admin-key", HeaderValue::from_static("s3cret"));
    let support = send(&app, request).await;
    assert_eq!(support.status(), StatusCode::OK);
    let body = json(support).await;
    let calls = body["allowances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == "calls-day")
        .unwrap()
        .clone();
    assert_eq!(calls["limit"], 1_000, "{body}");
    assert_eq!(calls["used"], 1, "{body}");
    assert!(
        calls["reset"]
            .as_str()
            .unwrap()
            .contains("America/New_York"),
        "{body}"
    );

    let mut request = call(Method::POST, "/admin/reset/account/globex/calls", None);
    request
        .headers_mut()
        .insert("x-admin-key", HeaderValue::from_static("s3cret"));
    assert!(send(&app, request).await.status().is_success());
    assert_eq!(used(&policy.handle(), "globex", "calls-day").await, 0);

    let mut request = call(Method::GET, "/admin/quota/account/nobody", None);
    request
        .headers_mut()
        .insert("x-admin-key", HeaderValue::from_static("s3cret"));
    assert_eq!(send(&app, request).await.status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn cors_preflight_is_answered_before_any_quota() {
    let clock = ManualClock::new(at("2027-03-10T09:00:00Z"));
    let policy = policy(clock);
    let app = app(&policy);
    let preflight = Request::builder()
        .method(Method::OPTIONS)
        .uri("/items")
        .header("origin", "https://app.example")
        .header("access-control-request-method", "POST")
        .body(Body::empty())
        .unwrap();
    let response = send(&app, preflight).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()["access-control-allow-origin"],
        "https://app.example"
    );
    assert!(response.headers().get("ratelimit").is_none());
    let ok = send(&app, call(Method::GET, "/items", Some("tok-acme"))).await;
    let exposed = ok.headers()["access-control-expose-headers"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(exposed.contains("ratelimit"), "{exposed}");
}

#[tokio::test]
async fn a_23_hour_day_in_the_customers_zone() {
    // 00:30 in Berlin on 2027-03-28, the day clocks go forward.
    let clock = ManualClock::new(at("2027-03-27T23:30:00Z"));
    let policy = policy(clock.clone());
    let handle = policy.handle();
    let app = app(&policy);

    let ok = send(&app, call(Method::GET, "/items", Some("tok-acme"))).await;
    assert_eq!(ok.status(), StatusCode::OK);
    assert_eq!(
        item(&ok, "ratelimit-policy", "calls-day", "w"),
        Some(82_800)
    );
    assert_eq!(item(&ok, "ratelimit", "calls-day", "t"), Some(81_000));
    for _ in 0..4 {
        send(&app, call(Method::GET, "/items", Some("tok-acme"))).await;
    }
    let refused = send(&app, call(Method::GET, "/items", Some("tok-acme"))).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    // Midnight in Berlin is 22:00 UTC that day.
    clock.set(at("2027-03-28T21:59:59Z"));
    let refused = send(&app, call(Method::GET, "/items", Some("tok-acme"))).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "1");
    clock.advance(Duration::from_secs(1));
    let fresh = send(&app, call(Method::GET, "/items", Some("tok-acme"))).await;
    assert_eq!(fresh.status(), StatusCode::OK);
    assert_eq!(
        item(&fresh, "ratelimit-policy", "calls-day", "w"),
        Some(86_400)
    );
    assert_eq!(used(&handle, "acme", "read-day").await, 1);
    assert_eq!(used(&handle, "acme", "calls-day").await, 1);
}

#[tokio::test]
async fn a_deferred_cost_across_the_month_end_in_the_customers_zone() {
    // 23:59:58 in Berlin on 31 January.
    let clock = ManualClock::new(at("2027-01-31T22:59:58Z"));
    let policy = policy(clock.clone());
    let handle = policy.handle();
    let app = app(&policy);

    for expected in [400, 800, 1_200] {
        let ok = send(&app, call(Method::POST, "/generate", Some("tok-acme"))).await;
        assert_eq!(ok.status(), StatusCode::OK);
        assert_eq!(used(&handle, "acme", "tokens-month").await, expected);
    }
    let refused = send(&app, call(Method::POST, "/generate", Some("tok-acme"))).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "2");
    clock.advance(Duration::from_secs(2)); // February in Berlin
    let fresh = send(&app, call(Method::POST, "/generate", Some("tok-acme"))).await;
    assert_eq!(fresh.status(), StatusCode::OK);
    assert_eq!(
        item(&fresh, "ratelimit-policy", "tokens-month", "w"),
        Some(28 * 86_400)
    );
    assert_eq!(item(&fresh, "ratelimit", "tokens-month", "r"), Some(600));
    assert_eq!(used(&handle, "acme", "tokens-month").await, 400);
    // The daily quota turned at Berlin's midnight too.
    assert_eq!(used(&handle, "acme", "calls-day").await, 1);
}

fn as_account(mut request: Request<Body>, id: &str, plan: &str, zone: &str) -> Request<Body> {
    request.extensions_mut().insert(Account {
        id: id.into(),
        plan: plan.into(),
        zone: TimeZone::get(zone).unwrap(),
    });
    request
}

#[tokio::test]
async fn a_deferred_cost_reported_after_the_month_turned_goes_to_the_month_charged() {
    let clock = ManualClock::new(at("2027-01-31T22:59:59Z"));
    let policy = policy(clock.clone());
    let handle = policy.handle();
    let slow_clock = clock.clone();
    let app = Router::new()
        .route(
            "/slow",
            post(move || {
                let clock = slow_clock.clone();
                async move {
                    clock.advance(Duration::from_secs(2)); // the month turns meanwhile
                    let mut response = "done".into_response();
                    response.extensions_mut().insert(TokensUsed(400));
                    response
                }
            }),
        )
        .route_layer(
            policy
                .layer(Quota::monthly(1_000).allowance("slow-tokens"))
                .deferred_cost(1, |r| r.extensions.get::<TokensUsed>().map_or(1, |t| t.0)),
        );
    let request = as_account(
        call(Method::POST, "/slow", None),
        "acme",
        "free",
        "Europe/Berlin",
    );
    let response = send(&app, request).await;
    assert_eq!(response.status(), StatusCode::OK);
    // February's counter is fresh.
    assert_eq!(used(&handle, "acme", "slow-tokens-month").await, 0);
    // January's took the upfront unit only: an add never reaches a calendar
    // window that ended (Store::add), so the 399 tokens reported go uncounted.
    clock.set(at("2027-01-31T22:59:59Z"));
    assert_eq!(used(&handle, "acme", "slow-tokens-month").await, 1);
}

#[tokio::test]
async fn a_failed_generation_costs_nothing_and_a_handler_can_refund_itself() {
    let clock = ManualClock::new(at("2027-03-10T09:00:00Z"));
    let policy = policy(clock.clone());
    let handle = policy.handle();
    let app = Router::new()
        .route(
            "/fails",
            post(|| async {
                let mut response = StatusCode::BAD_GATEWAY.into_response();
                response.extensions_mut().insert(TokensUsed(300));
                response
            }),
        )
        .route(
            "/oops",
            get(
                |State(handle): State<QuotaHandle>, status: QuotaStatus| async move {
                    let after = handle.refund_request(&status).await.unwrap();
                    let mut response = (StatusCode::OK, format!("{after:?}")).into_response();
                    response.extensions_mut().insert(TokensUsed(300));
                    response
                },
            ),
        )
        .route_layer(
            policy
                .layer(Quota::daily(1_000).allowance("gen"))
                .deferred_cost(1, |r| r.extensions.get::<TokensUsed>().map_or(1, |t| t.0)),
        )
        .with_state(handle.clone());
    let request = as_account(
        call(Method::POST, "/fails", None),
        "acme",
        "free",
        "Europe/Berlin",
    );
    assert_eq!(send(&app, request).await.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(used(&handle, "acme", "gen-day").await, 0);
    let request = as_account(
        call(Method::GET, "/oops", None),
        "acme",
        "free",
        "Europe/Berlin",
    );
    let response = send(&app, request).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(used(&handle, "acme", "gen-day").await, 0);
}

#[tokio::test]
async fn a_25_hour_day_in_new_york_for_a_pro_customer() {
    // 00:30 in New York on 2027-11-07, the day clocks go back.
    let clock = ManualClock::new(at("2027-11-07T04:30:00Z"));
    let policy = policy(clock.clone());
    let app = app(&policy);
    let ok = send(&app, call(Method::GET, "/items", Some("tok-globex"))).await;
    assert_eq!(ok.status(), StatusCode::OK);
    assert_eq!(
        item(&ok, "ratelimit-policy", "calls-day", "w"),
        Some(90_000)
    );
    assert_eq!(item(&ok, "ratelimit-policy", "calls-day", "q"), Some(1_000));
    assert_eq!(item(&ok, "ratelimit", "calls-day", "t"), Some(88_200));
    let standing = json(send(&app, call(Method::GET, "/me/quota", Some("tok-globex"))).await).await;
    let calls = standing
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == "calls-day")
        .unwrap()
        .clone();
    assert_eq!(calls["resets_at"], "2027-11-08T05:00:00Z", "{standing}");
    // Support asks with the zone and plan of the account, unasked.
    let mut request = call(Method::GET, "/admin/quota/account/globex", None);
    request
        .headers_mut()
        .insert("x-admin-key", HeaderValue::from_static("s3cret"));
    let body = json(send(&app, request).await).await;
    let calls = body["allowances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == "calls-day")
        .unwrap()
        .clone();
    assert_eq!(calls["used"], 1, "{body}");
    assert_eq!(calls["resets_at"], "2027-11-08T05:00:00Z", "{body}");
    // HEAD is a GET: charged on the read budget.
    let head = send(&app, call(Method::HEAD, "/items", Some("tok-globex"))).await;
    assert_eq!(head.status(), StatusCode::OK);
    assert_eq!(item(&head, "ratelimit", "read-day", "r"), Some(48));
}

#[tokio::test]
async fn an_unknown_plan_is_refused_everywhere_alike() {
    let clock = ManualClock::new(at("2027-03-10T09:00:00Z"));
    let policy = policy(clock);
    let app = Router::new()
        .route("/x", get(|| async { "x" }))
        .route_layer(policy.layer(Quota::daily(10).allowance("x")))
        .route("/me", get(my_quota))
        .with_state(policy.handle());
    let request = as_account(
        call(Method::GET, "/x", None),
        "initech",
        "enterprise",
        "UTC",
    );
    let layer = send(&app, request).await;
    let request = as_account(
        call(Method::GET, "/me", None),
        "initech",
        "enterprise",
        "UTC",
    );
    let standing = send(&app, request).await;
    assert_eq!(layer.status(), StatusCode::FORBIDDEN);
    assert_eq!(standing.status(), StatusCode::FORBIDDEN);
    assert_eq!(
        layer.headers()["content-type"],
        standing.headers()["content-type"]
    );
}

#[tokio::test]
async fn zone_aliases_plan_changes_and_support_refunds() {
    let clock = ManualClock::new(at("2027-03-10T09:00:00Z"));
    let policy = policy(clock.clone());
    let handle = policy.handle();
    let app = Router::new()
        .route(
            "/search",
            get(|status: QuotaStatus| async move {
                let names: Vec<String> = status
                    .entries()
                    .iter()
                    .map(|u| u.name().to_owned())
                    .collect();
                names.join(",")
            }),
        )
        .route_layer(policy.layer(Quota::per_minute(3).allowance("burst")))
        .route_layer(policy.layer(Quota::daily(100).plan("pro", 1_000).allowance("all")))
        .nest("/admin", handle.router());
    // The same account, its zone named by an alias, then on another plan.
    let first = as_account(
        call(Method::GET, "/search", None),
        "globex",
        "pro",
        "America/New_York",
    );
    let response = send(&app, first).await;
    assert_eq!(response.status(), StatusCode::OK);
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    assert_eq!(body, "all-day,burst-minute");
    let second = as_account(
        call(Method::GET, "/search", None),
        "globex",
        "free",
        "US/Eastern",
    );
    let response = send(&app, second).await;
    assert_eq!(item(&response, "ratelimit", "all-day", "r"), Some(98));
    assert_eq!(used(&handle, "globex", "all-day").await, 2);

    // Support refunds in the customer's zone, named or not.
    let refund = call(
        Method::POST,
        "/admin/refund/account/globex/all?amount=1&zone=US/Eastern",
        None,
    );
    let response = send(&app, refund).await;
    assert_eq!(
        response.status(),
        StatusCode::OK,
        "{}",
        json(response).await
    );
    assert_eq!(used(&handle, "globex", "all-day").await, 1);
    let refund = call(
        Method::POST,
        "/admin/refund/account/globex/all?amount=1",
        None,
    );
    assert_eq!(send(&app, refund).await.status(), StatusCode::OK);
    assert_eq!(used(&handle, "globex", "all-day").await, 0);

    // A fixed offset as an account's zone.
    let offset = tower_quota::jiff::tz::TimeZone::fixed(tower_quota::jiff::tz::offset(5));
    let mut request = call(Method::GET, "/search", None);
    request.extensions_mut().insert(Account {
        id: "umbrella".into(),
        plan: "free".into(),
        zone: offset,
    });
    let response = send(&app, request).await;
    assert_eq!(response.status(), StatusCode::OK);
    // Midnight at +05 is 19:00 UTC: ten hours away.
    assert_eq!(item(&response, "ratelimit", "all-day", "t"), Some(36_000));
}

#[tokio::test]
async fn a_handler_that_refunds_itself_and_then_fails_is_given_back_once() {
    let clock = ManualClock::new(at("2027-03-10T09:00:00Z"));
    let policy = policy(clock.clone());
    let handle = policy.handle();
    let app = Router::new()
        .route("/ok", get(|| async { "ok" }))
        .route(
            "/fail",
            get(
                |State(handle): State<QuotaHandle>, status: QuotaStatus| async move {
                    handle.refund_request(&status).await.unwrap();
                    StatusCode::INTERNAL_SERVER_ERROR
                },
            ),
        )
        .route_layer(policy.layer(Quota::per_minute(3).allowance("inner")))
        .route_layer(policy.layer(Quota::daily(100).allowance("outer")))
        .with_state(handle.clone());
    let ok = as_account(
        call(Method::GET, "/ok", None),
        "acme",
        "free",
        "Europe/Berlin",
    );
    assert_eq!(send(&app, ok).await.status(), StatusCode::OK);
    let fail = as_account(
        call(Method::GET, "/fail", None),
        "acme",
        "free",
        "Europe/Berlin",
    );
    assert_eq!(
        send(&app, fail).await.status(),
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(used(&handle, "acme", "outer-day").await, 1);
    assert_eq!(used(&handle, "acme", "inner-minute").await, 1);
}

#[tokio::test]
async fn an_account_zone_no_key_can_name_is_a_400_everywhere_never_a_panic() {
    let clock = ManualClock::new(at("2027-03-10T09:00:00Z"));
    let posix = TimeZone::posix("EST5EDT,M3.2.0,M11.1.0").unwrap();
    let known = posix.clone();
    let policy = QuotaPolicy::builder(FromExtension::<Account>::account_from(
        account_id as fn(&Account) -> String,
    ))
    .clock(clock)
    .time_zone(|parts| Ok(parts.extensions.get::<Account>().map(|a| a.zone.clone())))
    .caller_info(move |_| {
        let zone = known.clone();
        async move { Ok(Some(CallerInfo::new().zone(zone))) }
    })
    .build();
    let handle = policy.handle();
    let app = Router::new()
        .route("/x", get(|| async { "x" }))
        .route_layer(policy.layer(Quota::daily(10)))
        .route("/me", get(my_quota))
        .nest("/admin", handle.router())
        .with_state(handle.clone());
    let request = |path: &str| {
        let mut request = call(Method::GET, path, None);
        request.extensions_mut().insert(Account {
            id: "acme".into(),
            plan: "free".into(),
            zone: posix.clone(),
        });
        request
    };
    assert_eq!(
        send(&app, request("/x")).await.status(),
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        send(&app, request("/me")).await.status(),
        StatusCode::BAD_REQUEST
    );
    let support = send(&app, request("/admin/quota/account/acme")).await;
    assert_eq!(support.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let subject = handle
        .subject(&tower_quota::SubjectKind::ACCOUNT, "acme")
        .unwrap();
    assert!(handle.for_caller(&subject).await.is_err());
}

#[tokio::test]
async fn hostile_support_calls_are_clear_4xx() {
    let clock = ManualClock::new(at("2027-03-10T09:00:00Z"));
    let policy = policy(clock);
    let app = app(&policy);
    let charged = send(&app, call(Method::GET, "/items", Some("tok-globex"))).await;
    assert_eq!(charged.status(), StatusCode::OK);
    for (method, path) in [
        (
            Method::GET,
            "/admin/quota/account/globex?zone=../../../../etc/passwd",
        ),
        (Method::GET, "/admin/quota/account/globex?zone=localtime"),
        (Method::GET, "/admin/quota/account/globex?zone=posixrules"),
        (Method::GET, "/admin/quota/account/globex?zone=%00"),
        (
            Method::GET,
            "/admin/quota/account/globex?zone=EST5EDT,M3.2.0,M11.1.0",
        ),
        (Method::GET, "/admin/quota/account/globex?plan=enterprise"),
        (Method::GET, "/admin/quota/account/%FF%FE"),
        (Method::GET, "/admin/quota/planet/globex"),
        (
            Method::POST,
            "/admin/refund/account/globex/calls?amount=18446744073709551616",
        ),
        (Method::POST, "/admin/refund/account/globex/calls?amount=-1"),
        (Method::POST, "/admin/refund/account/globex/nosuch?amount=1"),
        (Method::POST, "/admin/reset/account/globex/nosuch"),
        (
            Method::POST,
            "/admin/reset/account/globex/calls?zone=Mars/Olympus",
        ),
    ] {
        let mut request = call(method, path, None);
        request
            .headers_mut()
            .insert("x-admin-key", HeaderValue::from_static("s3cret"));
        let response = send(&app, request).await;
        let status = response.status();
        let body = json(response).await;
        assert!(status.is_client_error(), "{path}: {status} {body}");
    }
    assert_eq!(used(&policy.handle(), "globex", "calls-day").await, 1);
    assert_eq!(used(&policy.handle(), "globex", "read-day").await, 1);
}
