//! The layer driven as users drive it: an axum `Router`, real requests through
//! `oneshot`, and a manual clock to cross period boundaries.

mod interest;

use std::collections::BTreeMap;
use std::future::{pending, ready, Future};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::{get, post};
use axum::Router;
use http::request::Parts;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use jiff::tz::TimeZone;
use jiff::{SignedDuration, Timestamp};
use serde_json::Value;
use tower::{service_fn, Layer, Service, ServiceBuilder, ServiceExt};
use tower_quota::store::{ChargeOutcome, ChargeRequest, StoreErrorKind};
use tower_quota::{
    Anchor, FromExtension, FromHeader, InvalidRequest, ManualClock, MemoryStore, OnStoreError,
    Period, PeriodKey, Quota, QuotaLayer, QuotaPolicy, QuotaStatus, Store, StoreError,
    SubjectExtractor, SubjectPolicy, Usage,
};

fn at(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn berlin() -> TimeZone {
    TimeZone::get("Europe/Berlin").unwrap()
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .unwrap_or_else(|| panic!("no {name} header"))
            .to_str()
            .unwrap()
    }

    /// `RateLimit` parsed as a Structured Field list: name -> (r, t).
    fn ratelimit(&self) -> BTreeMap<String, (i64, i64)> {
        parse_list(&self.headers, "ratelimit")
            .into_iter()
            .map(|(name, params)| (name, (params["r"], params["t"])))
            .collect()
    }

    /// `RateLimit-Policy` parsed: name -> (q, w).
    fn policy(&self) -> BTreeMap<String, (i64, i64)> {
        parse_list(&self.headers, "ratelimit-policy")
            .into_iter()
            .map(|(name, params)| (name, (params["q"], params["w"])))
            .collect()
    }
}

/// Parses every field line of `name` as one Structured Field list of String
/// items with Integer parameters.
fn parse_list(headers: &HeaderMap, name: &str) -> Vec<(String, BTreeMap<String, i64>)> {
    let joined = headers
        .get_all(name)
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect::<Vec<_>>()
        .join(", ");
    let list: sfv::List = sfv::Parser::new(&joined)
        .parse()
        .unwrap_or_else(|e| panic!("{name}: {joined:?} is not a valid Structured Field list: {e}"));
    list.into_iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => {
                let name = item
                    .bare_item
                    .as_string()
                    .expect("the item is a String")
                    .as_str()
                    .to_owned();
                let params = item
                    .params
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.as_str().to_owned(),
                            i64::from(v.as_integer().expect("integer parameter")),
                        )
                    })
                    .collect();
                (name, params)
            }
            sfv::ListEntry::InnerList(_) => panic!("{name} holds an inner list"),
        })
        .collect()
}

async fn send(app: &Router, request: Request<Body>) -> Reply {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let body = response
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec();
    Reply {
        status,
        headers,
        body,
    }
}

async fn get_as(app: &Router, path: &str, account: &str) -> Reply {
    send(
        app,
        Request::get(path)
            .header("x-account-id", account)
            .body(Body::empty())
            .unwrap(),
    )
    .await
}

fn hello(layer: QuotaLayer<FromHeader, MemoryStore>) -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer)
}

fn account() -> FromHeader {
    FromHeader::account("x-account-id")
}

// --- calendar anchor -------------------------------------------------------

#[tokio::test]
async fn calendar_day_resets_at_midnight_utc() {
    let clock = ManualClock::new(at("2026-12-02T23:59:58Z"));
    let app = hello(
        QuotaPolicy::builder(account())
            .clock(clock.clone())
            .build()
            .layer(Quota::daily(2)),
    );

    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
    let second = get_as(&app, "/", "acme").await;
    assert_eq!(second.status, StatusCode::OK);
    assert_eq!(second.ratelimit()["default-day"], (0, 2));
    assert_eq!(second.policy()["default-day"], (2, 86_400));

    clock.set(at("2026-12-02T23:59:59.999Z"));
    let refused = get_as(&app, "/", "acme").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.header("retry-after"), "1");

    clock.set(at("2026-12-03T00:00:00Z"));
    let next_day = get_as(&app, "/", "acme").await;
    assert_eq!(next_day.status, StatusCode::OK);
    assert_eq!(next_day.ratelimit()["default-day"], (1, 86_400));
}

/// Exhausts a Berlin daily quota just after local midnight and checks that it
/// stays refused until the next local midnight, `hours` later.
async fn berlin_day(local_midnight: &str, hours: i64) {
    let start = at(local_midnight);
    let clock = ManualClock::new(start);
    let app = hello(
        QuotaPolicy::builder(account())
            .clock(clock.clone())
            .build()
            .layer(Quota::daily(1).in_time_zone(berlin())),
    );

    let first = get_as(&app, "/", "acme").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.policy()["default-day"], (1, hours * 3600));
    assert_eq!(first.ratelimit()["default-day"], (0, hours * 3600));

    let end = start
        .checked_add(SignedDuration::from_hours(hours))
        .unwrap();
    clock.set(end.checked_sub(SignedDuration::from_millis(1)).unwrap());
    let refused = get_as(&app, "/", "acme").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.header("retry-after"), "1");

    clock.set(end);
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
}

#[tokio::test]
async fn berlin_day_of_23_hours() {
    // 2026-03-29 00:00 CET; clocks jump from 02:00 to 03:00.
    berlin_day("2026-03-28T23:00:00Z", 23).await;
}

#[tokio::test]
async fn berlin_day_of_25_hours() {
    // 2026-10-25 00:00 CEST; clocks fall back from 03:00 to 02:00.
    berlin_day("2026-10-24T22:00:00Z", 25).await;
}

#[tokio::test]
async fn month_ends() {
    for (last_instant, next_month, days) in [
        ("2026-01-31T23:59:59.999Z", "2026-02-01T00:00:00Z", 31),
        ("2026-02-28T23:59:59.999Z", "2026-03-01T00:00:00Z", 28),
        ("2028-02-29T23:59:59.999Z", "2028-03-01T00:00:00Z", 29),
        ("2026-04-30T23:59:59.999Z", "2026-05-01T00:00:00Z", 30),
        ("2026-12-31T23:59:59.999Z", "2027-01-01T00:00:00Z", 31),
    ] {
        let clock = ManualClock::new(at(last_instant));
        let app = hello(
            QuotaPolicy::builder(account())
                .clock(clock.clone())
                .build()
                .layer(Quota::monthly(1)),
        );
        let first = get_as(&app, "/", "acme").await;
        assert_eq!(first.status, StatusCode::OK, "{last_instant}");
        assert_eq!(
            first.policy()["default-month"],
            (1, days * 86_400),
            "{last_instant}"
        );
        assert_eq!(
            get_as(&app, "/", "acme").await.status,
            StatusCode::TOO_MANY_REQUESTS
        );
        clock.set(at(next_month));
        assert_eq!(
            get_as(&app, "/", "acme").await.status,
            StatusCode::OK,
            "{next_month}"
        );
    }
}

#[tokio::test]
async fn month_in_berlin_starts_at_local_midnight() {
    let clock = ManualClock::new(at("2026-11-30T22:59:59Z"));
    let app = hello(
        QuotaPolicy::builder(account())
            .clock(clock.clone())
            .build()
            .layer(Quota::monthly(1).in_time_zone(berlin())),
    );
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
    assert_eq!(
        get_as(&app, "/", "acme").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // 2026-12-01 00:00 in Berlin is 23:00 UTC on November 30.
    clock.set(at("2026-11-30T23:00:00Z"));
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
}

#[tokio::test]
async fn fixed_windows_are_aligned_to_the_epoch() {
    let clock = ManualClock::new(at("2026-12-02T13:33:29.500Z"));
    let layer = QuotaPolicy::builder(account())
        .clock(clock.clone())
        .build()
        .layer(Quota::fixed_window(1, Duration::from_secs(10)));
    let app = hello(layer);
    let first = get_as(&app, "/", "acme").await;
    assert_eq!(first.ratelimit()["default-10s"], (0, 1));
    assert_eq!(
        get_as(&app, "/", "acme").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    clock.set(at("2026-12-02T13:33:30Z"));
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
}

// --- first-use anchor ------------------------------------------------------

#[tokio::test]
async fn first_use_resets_one_period_after_the_first_call_however_often_the_subject_calls() {
    let first_call = at("2026-12-02T10:00:00Z");
    let clock = ManualClock::new(first_call);
    let app = hello(
        QuotaPolicy::builder(account())
            .clock(clock.clone())
            .build()
            .layer(Quota::rolling(5, Duration::from_secs(60))),
    );

    let mut admitted = 0;
    let deadline = first_call
        .checked_add(SignedDuration::from_secs(60))
        .unwrap();
    // Call every 7 ms for the whole minute: an access-extended deadline would
    // never arrive.
    while clock.now() < deadline {
        let reply = get_as(&app, "/", "acme").await;
        if reply.status == StatusCode::OK {
            admitted += 1;
        } else {
            assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
            let (remaining, reset) = reply.ratelimit()["default-rolling-1m"];
            assert_eq!(remaining, 0);
            let expected = deadline.duration_since(clock.now()).as_secs_f64().ceil() as i64;
            assert_eq!(
                reset, expected,
                "the reset stays where the first call put it"
            );
        }
        clock.advance(SignedDuration::from_millis(7));
    }
    assert_eq!(admitted, 5);

    clock.set(deadline);
    let fresh = get_as(&app, "/", "acme").await;
    assert_eq!(fresh.status, StatusCode::OK);
    // A new period opened at the deadline.
    assert_eq!(fresh.ratelimit()["default-rolling-1m"], (4, 60));
}

#[tokio::test]
async fn first_use_periods_are_per_subject() {
    let clock = ManualClock::new(at("2026-12-02T10:00:00Z"));
    let app = hello(
        QuotaPolicy::builder(account())
            .clock(clock.clone())
            .build()
            .layer(Quota::rolling(1, Duration::from_secs(3600))),
    );
    assert_eq!(get_as(&app, "/", "early").await.status, StatusCode::OK);
    clock.advance(SignedDuration::from_mins(30));
    assert_eq!(get_as(&app, "/", "late").await.status, StatusCode::OK);
    clock.advance(SignedDuration::from_mins(30));
    // The early subject's hour is over, the late subject's is not.
    assert_eq!(get_as(&app, "/", "early").await.status, StatusCode::OK);
    assert_eq!(
        get_as(&app, "/", "late").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

// --- concurrency -------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_of_one_subject_admit_exactly_the_limit() {
    let clock = ManualClock::new(at("2026-12-02T12:00:00Z"));
    let app = hello(
        QuotaPolicy::builder(account())
            .clock(clock)
            .build()
            .layer(Quota::daily(100)),
    );
    let tasks: Vec<_> = (0..1_000)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { get_as(&app, "/", "acme").await.status })
        })
        .collect();
    let mut ok = 0;
    for task in tasks {
        match task.await.unwrap() {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(ok, 100);
}

/// Many concurrent requests on two quotas: exactly the binding limit is
/// admitted, and the other quota was charged for exactly those requests.
async fn concurrent_two_quotas(minute: u64, day: u64) {
    let clock = ManualClock::new(at("2026-12-02T12:00:10Z"));
    let layer = QuotaPolicy::builder(account())
        .clock(clock)
        .build()
        .layer(Quota::per_minute(minute))
        .quota(Quota::daily(day));
    let handle = layer.handle();
    let app = hello(layer);
    let tasks: Vec<_> = (0..400)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { get_as(&app, "/", "acme").await.status })
        })
        .collect();
    let mut ok = 0;
    for task in tasks {
        if task.await.unwrap() == StatusCode::OK {
            ok += 1;
        }
    }
    let binding = minute.min(day);
    assert_eq!(ok, binding);
    let usage = handle
        .usage(&tower_quota::Subject::account("acme"))
        .await
        .unwrap();
    assert_eq!(usage[0].used(), binding, "minute counter");
    assert_eq!(usage[1].used(), binding, "day counter");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_never_overspend_when_the_minute_binds() {
    concurrent_two_quotas(30, 50).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_never_overspend_when_the_day_binds() {
    concurrent_two_quotas(50, 30).await;
}

// --- several quotas, cost, allowances, kinds ------------------------------

#[tokio::test]
async fn quotas_are_charged_all_or_nothing() {
    let clock = ManualClock::new(at("2026-12-02T10:00:00Z"));
    let app = hello(
        QuotaPolicy::builder(account())
            .clock(clock.clone())
            .build()
            .layer(Quota::per_minute(2))
            .quota(Quota::daily(3)),
    );
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
    let refused = get_as(&app, "/", "acme").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        refused.json()["violated-policies"],
        serde_json::json!(["default-minute"])
    );
    // The minute refused it, so the day was not charged: one left.
    assert_eq!(refused.ratelimit()["default-day"].0, 1);

    clock.advance(SignedDuration::from_mins(1));
    let third = get_as(&app, "/", "acme").await;
    assert_eq!(third.status, StatusCode::OK);
    assert_eq!(third.ratelimit()["default-day"].0, 0);
    let refused = get_as(&app, "/", "acme").await;
    assert_eq!(
        refused.json()["violated-policies"],
        serde_json::json!(["default-day"])
    );
    // The day refused it, so the minute was not charged either.
    assert_eq!(refused.ratelimit()["default-minute"].0, 1);
}

fn bulk_cost(parts: &Parts) -> Result<u64, InvalidRequest> {
    let query = parts.uri.query().unwrap_or("");
    let n = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("n="))
        .ok_or_else(|| InvalidRequest::new("missing ?n="))?;
    n.parse()
        .map_err(|_| InvalidRequest::new("n must be a whole number"))
}

#[tokio::test]
async fn per_request_cost() {
    let app = Router::new()
        .route("/bulk", post(|| async { "done" }))
        .layer(QuotaLayer::daily(5, account()).cost_fn(bulk_cost));
    let bulk = |n: &str| {
        Request::post(format!("/bulk?n={n}"))
            .header("x-account-id", "acme")
            .body(Body::empty())
            .unwrap()
    };
    let reply = send(&app, bulk("3")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.ratelimit()["default-day"].0, 2);
    let refused = send(&app, bulk("3")).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        refused.ratelimit()["default-day"].0,
        2,
        "a refused request spends nothing"
    );
    assert_eq!(send(&app, bulk("2")).await.status, StatusCode::OK);

    let too_big = send(&app, bulk("6")).await;
    assert_eq!(too_big.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        !too_big.headers.contains_key("retry-after"),
        "waiting cannot help a request that costs more than the limit"
    );
    assert!(too_big.json()["detail"]
        .as_str()
        .unwrap()
        .contains("more than quota"));

    let bad = send(&app, bulk("many")).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad.header("content-type"), "application/problem+json");
    assert_eq!(bad.json()["detail"], "n must be a whole number");
}

#[tokio::test]
async fn allowances_do_not_spend_each_other() {
    let store = MemoryStore::new();
    let app = Router::new()
        .route("/read", get(|| async { "r" }))
        .route_layer(
            QuotaPolicy::builder(account())
                .store(store.clone())
                .build()
                .layer(Quota::daily(1).allowance("read")),
        )
        .merge(
            Router::new()
                .route("/write", post(|| async { "w" }))
                .route_layer(
                    QuotaPolicy::builder(account())
                        .store(store.clone())
                        .build()
                        .layer(Quota::daily(1).allowance("write")),
                ),
        );
    let write = || {
        Request::post("/write")
            .header("x-account-id", "acme")
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(get_as(&app, "/read", "acme").await.status, StatusCode::OK);
    assert_eq!(
        get_as(&app, "/read", "acme").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    let w = send(&app, write()).await;
    assert_eq!(w.status, StatusCode::OK);
    assert_eq!(w.ratelimit()["write-day"].0, 0);
    assert_eq!(
        send(&app, write()).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn subject_kinds_do_not_share_counters() {
    let store = MemoryStore::new();
    let per_account = QuotaPolicy::builder(FromHeader::account("x-id"))
        .store(store.clone())
        .build()
        .layer(Quota::daily(1));
    let per_user = QuotaPolicy::builder(FromHeader::user("x-id"))
        .store(store.clone())
        .build()
        .layer(Quota::daily(1));
    let app = Router::new()
        .route("/a", get(|| async { "a" }))
        .route_layer(per_account)
        .merge(
            Router::new()
                .route("/u", get(|| async { "u" }))
                .route_layer(per_user),
        );
    let call = |path: &str| {
        Request::get(path)
            .header("x-id", "7")
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(send(&app, call("/a")).await.status, StatusCode::OK);
    assert_eq!(send(&app, call("/u")).await.status, StatusCode::OK);
    assert_eq!(
        send(&app, call("/a")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&app, call("/u")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn subject_from_an_extension_set_by_an_auth_layer() {
    #[derive(Clone)]
    struct UserId(u64);
    impl std::fmt::Display for UserId {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{}", self.0)
        }
    }
    // A stand-in for an authentication layer: it trusts `x-token` as the user.
    async fn auth(
        mut request: Request<Body>,
        next: axum::middleware::Next,
    ) -> axum::response::Response {
        if let Some(id) = request
            .headers()
            .get("x-token")
            .and_then(|v| v.to_str().ok()?.parse().ok())
        {
            request.extensions_mut().insert(UserId(id));
        }
        next.run(request).await
    }
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .layer(QuotaLayer::daily(1, FromExtension::<UserId>::user()))
        .layer(axum::middleware::from_fn(auth));
    let call = |token: &str| {
        Request::get("/")
            .header("x-token", token)
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(send(&app, call("1")).await.status, StatusCode::OK);
    assert_eq!(
        send(&app, call("1")).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(send(&app, call("2")).await.status, StatusCode::OK);
    let anonymous = send(&app, Request::get("/").body(Body::empty()).unwrap()).await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
}

// --- hostile input ---------------------------------------------------------

#[tokio::test]
async fn missing_subject_is_401_with_a_problem_document() {
    let app = hello(QuotaLayer::daily(1, account()));
    let reply = send(&app, Request::get("/").body(Body::empty()).unwrap()).await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    assert_eq!(reply.header("content-type"), "application/problem+json");
    let body = reply.json();
    assert_eq!(body["status"], 401);
    assert_eq!(body["title"], "Unauthorized");
    assert!(body["detail"].is_string());
    // HTTP requires a challenge on every 401: the header to send.
    assert_eq!(
        reply.header("www-authenticate"),
        "ApiKey header=\"x-account-id\""
    );
}

#[tokio::test]
async fn a_401_carries_the_policys_challenge_over_the_extractors() {
    let app = hello(
        QuotaPolicy::builder(account())
            .challenge(http::HeaderValue::from_static("Bearer realm=\"api\""))
            .on_malformed_subject(SubjectPolicy::Reject(StatusCode::UNAUTHORIZED))
            .build()
            .layer(Quota::daily(1)),
    );
    let missing = send(&app, Request::get("/").body(Body::empty()).unwrap()).await;
    assert_eq!(missing.status, StatusCode::UNAUTHORIZED);
    assert_eq!(missing.header("www-authenticate"), "Bearer realm=\"api\"");
    // A malformed subject answered with 401 carries it too.
    let malformed = get_as(&app, "/", "  ").await;
    assert_eq!(malformed.status, StatusCode::UNAUTHORIZED);
    assert_eq!(malformed.header("www-authenticate"), "Bearer realm=\"api\"");
}

#[tokio::test]
async fn only_a_401_carries_a_challenge() {
    let app = hello(QuotaLayer::daily(1, account()));
    let malformed = get_as(&app, "/", "   ").await;
    assert_eq!(malformed.status, StatusCode::BAD_REQUEST);
    assert!(malformed.headers.get("www-authenticate").is_none());
    assert_eq!(get_as(&app, "/", "a").await.status, StatusCode::OK);
    let refused = get_as(&app, "/", "a").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.headers.get("www-authenticate").is_none());
    // A gRPC call is told by its status (UNAUTHENTICATED), not a challenge.
    let grpc = Request::post("/")
        .header("content-type", "application/grpc")
        .body(Body::empty())
        .unwrap();
    let grpc = send(&app, grpc).await;
    assert_eq!(grpc.header("grpc-status"), "16");
    assert!(grpc.headers.get("www-authenticate").is_none());
    // An extractor that cannot tell, and no challenge set: none.
    let nobody = tower_quota::subject::from_fn(|_: &Parts| Err(tower_quota::SubjectError::Missing));
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(QuotaLayer::daily(1, nobody));
    let missing = send(&app, Request::get("/").body(Body::empty()).unwrap()).await;
    assert_eq!(missing.status, StatusCode::UNAUTHORIZED);
    assert!(missing.headers.get("www-authenticate").is_none());
}

#[tokio::test]
async fn chained_extractors_list_both_challenges() {
    let either = FromHeader::account("x-account-id").or(FromHeader::user("x-user-id"));
    assert_eq!(
        either.challenge().unwrap(),
        "ApiKey header=\"x-account-id\", ApiKey header=\"x-user-id\""
    );
    let same = FromHeader::account("x-id").or(FromHeader::user("x-id"));
    assert_eq!(same.challenge().unwrap(), "ApiKey header=\"x-id\"");
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(QuotaLayer::daily(1, either));
    let missing = send(&app, Request::get("/").body(Body::empty()).unwrap()).await;
    assert_eq!(
        missing.header("www-authenticate"),
        "ApiKey header=\"x-account-id\", ApiKey header=\"x-user-id\""
    );
}

#[tokio::test]
async fn malformed_subjects_are_400() {
    let app = hello(QuotaLayer::daily(1, account()));
    let long = "a".repeat(257);
    for id in ["", "   ", long.as_str()] {
        let reply = get_as(&app, "/", id).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{id:?}");
        assert_eq!(reply.json()["status"], 400);
    }
    let twice = Request::get("/")
        .header("x-account-id", "a")
        .header("x-account-id", "b")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&app, twice).await.status, StatusCode::BAD_REQUEST);
    // The bound itself is accepted.
    assert_eq!(
        get_as(&app, "/", &"a".repeat(256)).await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn unidentified_traffic_can_be_let_through_uncounted() {
    let app = hello(
        QuotaPolicy::builder(account())
            .on_missing_subject(SubjectPolicy::Allow)
            .on_malformed_subject(SubjectPolicy::Reject(StatusCode::FORBIDDEN))
            .build()
            .layer(Quota::daily(1)),
    );
    for _ in 0..3 {
        let reply = send(&app, Request::get("/").body(Body::empty()).unwrap()).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert!(
            !reply.headers.contains_key("ratelimit"),
            "uncounted requests get no fields"
        );
    }
    assert_eq!(get_as(&app, "/", "").await.status, StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn hostile_ids_never_share_a_counter() {
    let app = hello(QuotaLayer::daily(1, account()));
    let ids: Vec<&[u8]> = vec![
        b"acme",
        b"acme}",
        b"{acme}",
        b"acme:read",
        b"acme%7D",
        b"ac\tme",
        b"acme\xff",
        b"acme\xfe",
        b"%",
        b"%25",
        b"a b",
        b"a+b",
    ];
    for id in &ids {
        let request = Request::get("/")
            .header("x-account-id", http::HeaderValue::from_bytes(id).unwrap())
            .body(Body::empty())
            .unwrap();
        let reply = send(&app, request).await;
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "{:?} shares a counter with an earlier id",
            id
        );
    }
}

// --- what clients are told -------------------------------------------------

#[tokio::test]
async fn refusal_is_a_problem_document_with_retry_after() {
    let clock = ManualClock::new(at("2026-12-02T13:00:00.250Z"));
    let app = hello(
        QuotaPolicy::builder(account())
            .clock(clock)
            .build()
            .layer(Quota::daily(1).allowance("read")),
    );
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
    let reply = get_as(&app, "/", "acme").await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(reply.header("content-type"), "application/problem+json");
    // 10 h 59 min 59.75 s to midnight, rounded up: never before the reset.
    assert_eq!(reply.header("retry-after"), "39600");
    let body = reply.json();
    assert_eq!(
        body["type"],
        "https://iana.org/assignments/http-problem-types#quota-exceeded"
    );
    assert_eq!(body["title"], "Quota Exceeded");
    assert_eq!(body["status"], 429);
    assert_eq!(body["violated-policies"], serde_json::json!(["read-day"]));
    assert!(body["detail"]
        .as_str()
        .unwrap()
        .contains("2026-12-03T00:00:00Z"));
    assert_eq!(reply.ratelimit()["read-day"], (0, 39600));
    assert_eq!(reply.policy()["read-day"], (1, 86_400));
}

/// Over a real connection, every answer the layer writes itself (401,
/// 400, 429) is sent whole: the `Content-Length` the server sends is the
/// length of the problem document that follows.
#[tokio::test]
async fn the_layers_own_answers_are_sent_whole_over_a_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let app = hello(QuotaLayer::daily(1, account()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    for (headers, status) in [
        ("", "401"),
        ("x-account-id: a\r\nx-account-id: b\r\n", "400"),
        ("x-account-id: acme\r\n", "200"),
        ("x-account-id: acme\r\n", "429"),
    ] {
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        let head = format!("GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{headers}\r\n");
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut answer))
            .await
            .expect("the answer ends")
            .unwrap();
        let answer = String::from_utf8(answer).unwrap();
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status}")),
            "{answer}"
        );
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        let length: usize = head
            .lines()
            .find_map(|line| {
                let (name, value) = line.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse().unwrap())
            })
            .unwrap_or_else(|| panic!("no content-length: {answer}"));
        assert_eq!(body.len(), length, "{answer}");
        assert!(!body.is_empty(), "{answer}");
    }
}

/// A clock that moves on by `step` each time it is read, as a real clock
/// moves on while a charge is on its way to the store and back.
#[derive(Clone)]
struct Moving(ManualClock, SignedDuration);

impl tower_quota::Clock for Moving {
    fn now(&self) -> Timestamp {
        let now = self.0.now();
        self.0.advance(self.1);
        now
    }
}

/// A request charged just before midnight and refused, whose refusal is
/// told once midnight has passed (the store answered across it), is told
/// a wait of a second, as `Retry-After` says, never a `t` of 0 beside
/// `r=0`: a 429 tells no reset that has already come.
#[tokio::test]
async fn a_refusal_told_past_its_reset_tells_a_wait_of_a_second_at_least() {
    let clock = ManualClock::new(at("2026-12-02T23:59:58Z"));
    let app = hello(
        QuotaPolicy::builder(account())
            .clock(Moving(clock.clone(), SignedDuration::from_millis(700)))
            .build()
            .layer(Quota::daily(1).allowance("read"))
            .quota(Quota::per_minute(5).allowance("burst")),
    );
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
    // Charged at 23:59:59.5, told at 00:00:00.2.
    clock.set(at("2026-12-02T23:59:59.5Z"));
    let reply = get_as(&app, "/", "acme").await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(reply.header("retry-after"), "1");
    let (r, t) = reply.ratelimit()["read-day"];
    assert_eq!((r, t), (0, 1), "{}", reply.header("ratelimit"));
    // The quota with room is told as it stands: its minute turned too.
    assert_eq!(reply.ratelimit()["burst-minute"], (4, 0));
}

#[tokio::test]
async fn fields_of_several_quotas_and_nested_layers_form_one_list() {
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .route_layer(
            QuotaLayer::new(Quota::daily(10).allowance("read"), account())
                .quota(Quota::per_minute(3).allowance("burst")),
        )
        .layer(QuotaLayer::monthly(100, account()));
    let reply = get_as(&app, "/", "acme").await;
    assert_eq!(reply.status, StatusCode::OK);
    let names: Vec<String> = reply.ratelimit().into_keys().collect();
    assert_eq!(names, ["burst-minute", "default-month", "read-day"]);
    assert_eq!(reply.policy()["burst-minute"].0, 3);
    assert_eq!(reply.ratelimit()["default-month"].0, 99);
}

#[tokio::test]
async fn handlers_see_where_the_caller_stands() {
    let app = Router::new()
        .route(
            "/",
            get(|status: QuotaStatus| async move { status.entries()[0].remaining().to_string() }),
        )
        .layer(QuotaLayer::daily(10, account()));
    let reply = get_as(&app, "/", "acme").await;
    assert_eq!(reply.body, b"9");
}

#[tokio::test]
async fn works_with_any_tower_service() {
    let mut service = ServiceBuilder::new()
        .layer(QuotaLayer::daily(1, account()))
        .service(service_fn(|_: Request<String>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                bytes::Bytes::from("ok"),
            )))
        }));
    let call = || {
        Request::get("/")
            .header("x-account-id", "a")
            .body(String::new())
            .unwrap()
    };
    let ok = service.ready().await.unwrap().call(call()).await.unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    assert_eq!(ok.into_body().collect().await.unwrap().to_bytes(), "ok");
    let refused = service.ready().await.unwrap().call(call()).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn the_inner_service_readied_by_poll_ready_is_the_one_called() {
    // A concurrency limit hands its permit to the instance that `poll_ready`
    // readied, and panics when a clone without one is called: the layer must
    // call the readied instance, not its clone.
    let mut service = ServiceBuilder::new()
        .layer(QuotaLayer::daily(10, account()))
        .concurrency_limit(1)
        .service(service_fn(|_: Request<Body>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(Body::empty()))
        }));
    for _ in 0..3 {
        let request = Request::get("/")
            .header("x-account-id", "acme")
            .body(Body::empty())
            .unwrap();
        let response = service.ready().await.unwrap().call(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
}

// --- store failures --------------------------------------------------------

/// A store that fails every charge, or never answers.
#[derive(Clone)]
struct Broken {
    hang: bool,
}

impl Store for Broken {
    type ChargeFuture =
        std::pin::Pin<Box<dyn Future<Output = Result<ChargeOutcome, StoreError>> + Send>>;

    fn charge(&self, _: ChargeRequest) -> Self::ChargeFuture {
        if self.hang {
            Box::pin(pending())
        } else {
            Box::pin(ready(Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "connection refused",
            ))))
        }
    }
    fn peek(
        &self,
        _: ChargeRequest,
    ) -> impl Future<Output = Result<Vec<Usage>, StoreError>> + Send {
        ready(Err(StoreError::new(StoreErrorKind::Unavailable, "down")))
    }
    fn refund(
        &self,
        _: Timestamp,
        _: PeriodKey,
        _: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        ready(Err(StoreError::new(StoreErrorKind::Unavailable, "down")))
    }
    fn add(
        &self,
        _: Timestamp,
        _: PeriodKey,
        _: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        ready(Err(StoreError::new(StoreErrorKind::Unavailable, "down")))
    }
    fn reset(&self, _: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        ready(Err(StoreError::new(StoreErrorKind::Unavailable, "down")))
    }
}

fn broken_app(hang: bool, policy: OnStoreError) -> Router {
    Router::new().route("/", get(|| async { "hello" })).layer(
        QuotaPolicy::builder(account())
            .store(Broken { hang })
            .on_store_error(policy)
            .build()
            .layer(Quota::daily(1)),
    )
}

/// Counts the events logged at `level` while it is the default subscriber.
#[derive(Clone)]
struct CountEvents(tracing::Level, Arc<std::sync::atomic::AtomicUsize>);

impl tracing::Subscriber for CountEvents {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        if *event.metadata().level() == self.0 {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// During an outage, every request fails on the store: the layer and the
/// support router each log it a few times a second, not once per request.
#[tokio::test(flavor = "current_thread")]
async fn a_store_outage_is_logged_a_few_times_a_second() {
    let errors = CountEvents(tracing::Level::ERROR, Arc::default());
    let _guard = tracing::subscriber::set_default(errors.clone());
    let _interest = interest::every_subscriber_asked();
    let policy = tower_quota::QuotaPolicy::builder(account())
        .store(Broken { hang: false })
        .build();
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .route_layer(policy.layer(Quota::daily(5).allowance("read")));
    let started = std::time::Instant::now();
    for _ in 0..200 {
        let reply = get_as(&app, "/", "acme").await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    }
    // The layer's throttle is shared with the other tests of this process,
    // so its seconds need not start with this loop: one more may begin.
    let seconds = started.elapsed().as_secs() as usize + 2;
    let logged = errors.1.swap(0, std::sync::atomic::Ordering::Relaxed);
    assert!(logged <= 5 * seconds, "{logged} lines in {seconds} s");

    let support: axum::Router = policy.handle().router();
    let started = std::time::Instant::now();
    for _ in 0..200 {
        let reply = get_as(&support, "/quota/account/acme", "acme").await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    }
    // This throttle's seconds start with this loop: nothing else uses it.
    let seconds = started.elapsed().as_secs() as usize + 1;
    let logged = errors.1.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        (1..=5 * seconds).contains(&logged),
        "{logged} lines in {seconds} s"
    );
}

#[tokio::test]
async fn store_failure_fails_closed_by_default_with_503() {
    let app = Router::new().route("/", get(|| async { "hello" })).layer(
        QuotaPolicy::builder(account())
            .store(Broken { hang: false })
            .build()
            .layer(Quota::daily(1)),
    );
    let reply = get_as(&app, "/", "acme").await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.header("retry-after"), "1");
    assert_eq!(reply.header("content-type"), "application/problem+json");
    assert_eq!(reply.json()["status"], 503);
}

#[tokio::test]
async fn store_failure_can_fail_open() {
    let reply = get_as(&broken_app(false, OnStoreError::FailOpen), "/", "acme").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, b"hello");
    assert!(!reply.headers.contains_key("ratelimit"));
}

#[tokio::test(start_paused = true)]
async fn a_store_that_never_answers_is_bounded_by_the_timeout() {
    let closed = broken_app(
        true,
        OnStoreError::FailClosed {
            retry_after: Duration::from_secs(5),
        },
    );
    let started = tokio::time::Instant::now();
    let reply = get_as(&closed, "/", "acme").await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.header("retry-after"), "5");
    assert_eq!(started.elapsed(), Duration::from_millis(100));

    let open = broken_app(true, OnStoreError::FailOpen);
    assert_eq!(get_as(&open, "/", "acme").await.status, StatusCode::OK);
}

/// A layer of shadow quotas never refuses, not even when the store fails
/// under fail closed: the request passes, owing its charge to the ledger.
/// The policy's enforced layers still refuse when the store fails.
#[tokio::test]
async fn a_layer_of_shadow_quotas_passes_when_the_store_fails() {
    for max_owed in [10_000, 0] {
        let policy = QuotaPolicy::builder(account())
            .store(Broken { hang: false })
            .max_owed_counters(max_owed)
            .build();
        let shadow_only = Router::new()
            .route("/", get(|| async { "hello" }))
            .layer(policy.layer(Quota::daily(1).allowance("trial").shadow()));
        let reply = get_as(&shadow_only, "/", "acme").await;
        assert_eq!(reply.status, StatusCode::OK, "max_owed {max_owed}");
        assert_eq!(reply.body, b"hello");
        assert_eq!(
            policy.owed().units,
            if max_owed == 0 { 0 } else { 1 },
            "max_owed {max_owed}"
        );

        // Inside it, an enforced layer of the policy asks the store itself,
        // and refuses, as fail closed says; nothing is owed for a request
        // refused.
        let policy = QuotaPolicy::builder(account())
            .store(Broken { hang: false })
            .max_owed_counters(max_owed)
            .build();
        let both = Router::new()
            .route("/", get(|| async { "hello" }))
            .route_layer(policy.layer(Quota::daily(1).allowance("read")))
            .layer(policy.layer(Quota::daily(1).allowance("trial").shadow()));
        let reply = get_as(&both, "/", "acme").await;
        assert_eq!(
            reply.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "max_owed {max_owed}"
        );
        assert_eq!(policy.owed().units, 0, "max_owed {max_owed}");
    }
}

/// A layer of shadow quotas lets through what it cannot charge (no subject,
/// an unknown plan, a cost it cannot read), where an enforced layer of the
/// policy refuses it.
#[tokio::test]
async fn a_layer_of_shadow_quotas_never_refuses_a_request_it_cannot_charge() {
    let policy = || {
        QuotaPolicy::builder(account())
            .plan(|parts| Some(parts.headers.get("x-plan")?.to_str().ok()?.to_owned()))
            .on_unknown_plan(tower_quota::UnknownPlan::Reject)
            .build()
    };
    let cost = |parts: &Parts| {
        parts.headers.get("x-cost").map_or(Ok(1), |v| {
            v.to_str()
                .ok()
                .and_then(|v| v.parse().ok())
                .ok_or(tower_quota::InvalidRequest::new("x-cost is not a number"))
        })
    };
    let shadow = policy();
    // The handler finds a status all the same (without entries).
    let hello = |status: QuotaStatus| async move {
        assert!(status.entries().is_empty() && status.is_exempt());
        "hello"
    };
    let shadow_only = Router::new().route("/", get(hello)).layer(
        shadow
            .layer(Quota::daily(10).plan("pro", 100).shadow())
            .cost_fn(cost),
    );
    let enforced = policy();
    let both = Router::new()
        .route("/", get(|_: QuotaStatus| async { "hello" }))
        .route_layer(enforced.layer(Quota::daily(10).plan("pro", 100).allowance("read")))
        .layer(
            enforced
                .layer(Quota::daily(10).plan("pro", 100).shadow())
                .cost_fn(cost),
        );
    let requests: [(&[(&str, &str)], StatusCode); 3] = [
        (&[], StatusCode::UNAUTHORIZED),
        (
            &[("x-account-id", "acme"), ("x-plan", "gold")],
            StatusCode::FORBIDDEN,
        ),
        (
            &[("x-account-id", "acme"), ("x-cost", "lots")],
            StatusCode::OK,
        ),
    ];
    for (headers, inner) in requests {
        let request = || {
            let mut request = Request::get("/");
            for (name, value) in headers {
                request = request.header(*name, *value);
            }
            request.body(Body::empty()).unwrap()
        };
        let reply = send(&shadow_only, request()).await;
        assert_eq!(reply.status, StatusCode::OK, "{headers:?}");
        assert!(!reply.headers.contains_key("ratelimit"), "{headers:?}");
        let reply = send(&both, request()).await;
        assert_eq!(reply.status, inner, "{headers:?}");
    }
}

/// A shadow quota's counter at the most its store counts takes no more, and
/// still refuses nothing: alone in its layer, the request passes it
/// uncounted; beside an enforced quota, the charge goes again without it,
/// and the enforced quota counts and refuses as it would alone.
#[tokio::test]
async fn a_shadow_counter_at_the_stores_most_refuses_nothing() {
    let clock = ManualClock::new(at("2026-12-02T10:00:00Z"));
    let store = MemoryStore::new();
    let policy = QuotaPolicy::builder(account())
        .store(store.clone())
        .clock(clock.clone())
        .build();
    let cost = |parts: &Parts| {
        Ok(parts
            .headers
            .get("x-cost")
            .map_or(1, |v| v.to_str().unwrap().parse().unwrap()))
    };
    let shadow_only = Router::new()
        .route("/", get(|_: QuotaStatus| async { "hello" }))
        .layer(
            policy
                .layer(Quota::daily(2).allowance("trial").shadow())
                .cost_fn(cost),
        );
    let most = Request::get("/")
        .header("x-account-id", "acme")
        .header("x-cost", u64::MAX.to_string())
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&shadow_only, most).await.status, StatusCode::OK);
    for _ in 0..3 {
        let reply = get_as(&shadow_only, "/", "acme").await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.body, b"hello");
    }

    // Beside an enforced quota: the enforced one counts, and refuses at its
    // limit; the shadow one stays at the most.
    let keys = |status: QuotaStatus| async move {
        status
            .entries()
            .iter()
            .map(|e| e.key().as_str().to_owned())
            .collect::<Vec<_>>()
            .join(" ")
    };
    let both = Router::new().route("/", get(keys)).layer(
        policy
            .layer(Quota::daily(3).allowance("read"))
            .quota(Quota::monthly(5).allowance("trial-month").shadow()),
    );
    let first = get_as(&both, "/", "globex").await;
    assert_eq!(first.status, StatusCode::OK);
    let body = String::from_utf8(first.body.to_vec()).unwrap();
    let month = body.split(' ').find(|k| k.contains("trial-month")).unwrap();
    let month = tower_quota::PeriodKey::from_string(month.to_owned());
    let now = clock.now();
    assert_eq!(
        store.add(now, month.clone(), u64::MAX - 1).await.unwrap(),
        Some(u64::MAX)
    );
    for _ in 0..2 {
        let reply = get_as(&both, "/", "globex").await;
        assert_eq!(reply.status, StatusCode::OK);
        assert!(
            reply.header("ratelimit").contains("\"read-day\";r="),
            "{}",
            reply.header("ratelimit")
        );
    }
    let refused = get_as(&both, "/", "globex").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        refused.json()["violated-policies"],
        serde_json::json!(["read-day"])
    );
    let usage = policy
        .handle()
        .usage(&tower_quota::Subject::account("globex"))
        .await
        .unwrap();
    let used = |name: &str| usage.iter().find(|u| u.name() == name).unwrap().used();
    assert_eq!(used("read-day"), 3);
    assert_eq!(used("trial-month-month"), u64::MAX);

    // An admitted charge that fills a shadow counter to the most exactly is
    // an admission like any other: charged once.
    let first = get_as(&both, "/", "initech").await;
    assert_eq!(first.status, StatusCode::OK);
    let key = |subject: &str| {
        tower_quota::PeriodKey::from_string(month.as_str().replace("globex", subject))
    };
    assert_eq!(
        store.add(now, key("initech"), u64::MAX - 2).await.unwrap(),
        Some(u64::MAX - 1)
    );
    let filling = get_as(&both, "/", "initech").await;
    assert_eq!(filling.status, StatusCode::OK);
    let usage = policy
        .handle()
        .usage(&tower_quota::Subject::account("initech"))
        .await
        .unwrap();
    let used = |name: &str| usage.iter().find(|u| u.name() == name).unwrap().used();
    assert_eq!(used("read-day"), 2, "charged once");
    assert_eq!(used("trial-month-month"), u64::MAX);
}

/// A layer further in refuses a while after the request's first charge
/// (middleware between took 30 s): its `Retry-After` and its `RateLimit`
/// member count the wait from the refusal, as the outer member does from
/// the response.
#[tokio::test]
async fn a_refusal_further_in_counts_its_wait_from_its_own_instant() {
    let clock = ManualClock::new(at("2026-12-02T10:00:00Z"));
    let policy = QuotaPolicy::builder(account()).clock(clock.clone()).build();
    let slow = {
        let clock = clock.clone();
        axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                clock.advance(SignedDuration::from_secs(30));
                next.run(request)
            },
        )
    };
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .route_layer(policy.layer(Quota::daily(1).allowance("inner")))
        .layer(slow)
        .layer(policy.layer(Quota::hourly(100).allowance("outer")));
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
    // Charged at 10:00:30 further out, refused at 10:01:00 further in.
    let refused = get_as(&app, "/", "acme").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    let day_left = (at("2026-12-03T00:00:00Z") - at("2026-12-02T10:01:00Z")).as_secs();
    assert_eq!(refused.header("retry-after"), day_left.to_string());
    assert_eq!(
        refused.header("ratelimit"),
        format!("\"outer-hour\";r=99;t=3540, \"inner-day\";r=0;t={day_left}")
    );
}

// --- support handle --------------------------------------------------------

#[tokio::test]
async fn support_can_read_refund_and_reset() {
    let clock = ManualClock::new(at("2026-12-02T10:00:00Z"));
    let layer = QuotaPolicy::builder(account())
        .clock(clock.clone())
        .build()
        .layer(Quota::rolling(2, Duration::from_secs(3600)));
    let handle = layer.handle();
    let app = hello(layer);
    let acme = tower_quota::Subject::account("acme");

    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
    clock.advance(SignedDuration::from_mins(10));
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
    let status = handle.usage(&acme).await.unwrap();
    assert_eq!(status[0].used(), 2);
    assert_eq!(status[0].first_call(), Some(at("2026-12-02T10:00:00Z")));
    assert_eq!(status[0].resets_at(), at("2026-12-02T11:00:00Z"));

    handle.refund(&acme, 1).await.unwrap();
    let status = handle.usage(&acme).await.unwrap();
    assert_eq!(status[0].used(), 1);
    assert_eq!(
        status[0].resets_at(),
        at("2026-12-02T11:00:00Z"),
        "a refund keeps the deadline"
    );

    handle.reset(&acme).await.unwrap();
    assert_eq!(handle.usage(&acme).await.unwrap()[0].used(), 0);
    clock.advance(SignedDuration::from_mins(5));
    let fresh = get_as(&app, "/", "acme").await;
    assert_eq!(
        fresh.ratelimit()["default-rolling-1h"],
        (1, 3600),
        "a reset opens a new period"
    );
}

#[test]
#[should_panic(expected = "would count on one counter")]
fn two_quotas_on_the_same_counters_are_refused() {
    let _ = QuotaLayer::daily(1, account())
        .quota(Quota::daily(2).named("other"))
        .layer(service_fn(|_: Request<Body>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(Body::empty()))
        }));
}

#[tokio::test]
async fn an_extractor_behind_an_arc_works() {
    let shared = Arc::new(account());
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .layer(QuotaLayer::daily(1, Arc::clone(&shared)));
    assert_eq!(get_as(&app, "/", "x").await.status, StatusCode::OK);
    assert_eq!(
        get_as(&app, "/", "x").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

fn layered(layer: QuotaLayer<FromHeader, MemoryStore>) {
    let _ = layer.layer(service_fn(|_: Request<Body>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(Body::empty()))
    }));
}

#[test]
#[should_panic(expected = "would count on one counter")]
fn a_rolling_minute_and_a_rolling_60_seconds_share_counters() {
    layered(
        QuotaLayer::new(Quota::new(5, Period::minute(), Anchor::FirstUse), account())
            .quota(Quota::rolling(10, Duration::from_secs(60))),
    );
}

#[test]
#[should_panic(expected = "would count on one counter")]
fn fixed_windows_in_two_zones_share_counters() {
    layered(
        QuotaLayer::new(Quota::fixed_window(5, Duration::from_secs(10)), account()).quota(
            Quota::fixed_window(9, Duration::from_secs(10))
                .in_time_zone(berlin())
                .named("b"),
        ),
    );
}

#[tokio::test]
async fn days_in_two_zones_have_counters_of_their_own() {
    let clock = ManualClock::new(at("2026-12-02T23:30:00Z"));
    let layer = QuotaPolicy::builder(account())
        .clock(clock)
        .build()
        .layer(Quota::daily(1))
        .quota(Quota::daily(1).in_time_zone(berlin()).named("berlin-day"));
    let app = hello(layer);
    let first = get_as(&app, "/", "acme").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.ratelimit()["default-day"].0, 0);
    assert_eq!(first.ratelimit()["berlin-day"].0, 0);
}

#[test]
#[should_panic(expected = "printable ASCII")]
fn allowance_tags_must_be_printable_ascii() {
    let _ = Quota::daily(1).allowance("lesen\n");
}

/// Undoing a request's charge after support reset the counter and a later
/// request made it anew leaves the new counter alone, as the layer's own
/// give-backs do; a support refund goes to the current counter.
#[tokio::test]
async fn a_refund_of_a_charge_made_before_a_reset_leaves_the_new_counter_alone() {
    let t0 = at("2026-12-02T10:00:00Z");
    let clock = ManualClock::new(t0);
    let layer = QuotaPolicy::builder(account())
        .clock(clock.clone())
        .build()
        .layer(Quota::daily(5));
    let handle = layer.handle();
    let app = hello(layer);
    let acme = tower_quota::Subject::account("acme");
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
    handle.reset(&acme).await.unwrap();
    clock.set(at("2026-12-02T10:00:02Z"));
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
    assert_eq!(handle.refund_at(&acme, t0, 1).await.unwrap(), [None]);
    assert_eq!(handle.usage(&acme).await.unwrap()[0].used(), 1);
    assert_eq!(handle.refund(&acme, 1).await.unwrap(), [Some(0)]);
}

/// A counter made first by a request stamped a moment later (requests at
/// once) is the one an earlier-stamped request was charged to: undoing
/// that request's charge reaches it.
#[tokio::test]
async fn a_refund_reaches_a_counter_a_request_stamped_later_made() {
    let t0 = at("2026-12-02T10:00:00Z");
    let clock = ManualClock::new(t0 + SignedDuration::from_millis(5));
    let layer = QuotaPolicy::builder(account())
        .clock(clock.clone())
        .build()
        .layer(Quota::daily(5))
        .quota(Quota::rolling(5, std::time::Duration::from_secs(3_600)));
    let handle = layer.handle();
    let app = hello(layer);
    let acme = tower_quota::Subject::account("acme");
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
    clock.set(t0);
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
    assert_eq!(
        handle.refund_at(&acme, t0, 1).await.unwrap(),
        [Some(1), Some(1)]
    );
}

/// A charge's instant at the end of time has no open period: nothing to
/// refund, and no panic computing one.
#[tokio::test]
async fn a_refund_at_the_end_of_time_refunds_nothing() {
    let layer = QuotaPolicy::builder(account())
        .build()
        .layer(Quota::daily(5))
        .quota(Quota::rolling(5, std::time::Duration::from_secs(3_600)));
    let handle = layer.handle();
    let acme = tower_quota::Subject::account("acme");
    for at in [
        tower_quota::jiff::Timestamp::MAX,
        tower_quota::jiff::Timestamp::MIN,
    ] {
        assert_eq!(handle.refund_at(&acme, at, 1).await.unwrap(), [None, None]);
    }
}

#[tokio::test]
async fn a_refund_after_midnight_does_not_credit_the_new_day() {
    let clock = ManualClock::new(at("2026-12-02T23:59:59Z"));
    let layer = QuotaPolicy::builder(account())
        .clock(clock.clone())
        .build()
        .layer(Quota::daily(5));
    let handle = layer.handle();
    let app = hello(layer);
    let acme = tower_quota::Subject::account("acme");
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
    clock.set(at("2026-12-03T00:00:01Z"));
    assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);

    let refunded = handle
        .refund_at(&acme, at("2026-12-02T23:59:59Z"), 1)
        .await
        .unwrap();
    assert_eq!(
        refunded,
        [None],
        "yesterday's counter is gone; nothing to refund"
    );
    assert_eq!(
        handle.usage(&acme).await.unwrap()[0].used(),
        1,
        "today untouched"
    );
    assert_eq!(handle.refund(&acme, 1).await.unwrap(), [Some(0)]);
}

/// A limit past what a Structured Field Integer holds (15 digits), such as
/// `u64::MAX` for an unlimited plan, is told as the largest one: the fields
/// stay valid for strict clients.
#[tokio::test]
async fn limits_past_fifteen_digits_keep_the_fields_valid() {
    let app = hello(QuotaLayer::daily(
        u64::MAX,
        FromHeader::account("x-account-id"),
    ));
    let reply = get_as(&app, "/", "acme").await;
    assert_eq!(reply.status, StatusCode::OK);
    let (q, _) = reply.policy()["default-day"];
    let (r, _) = reply.ratelimit()["default-day"];
    assert_eq!(q, 999_999_999_999_999);
    assert_eq!(r, 999_999_999_999_999);
}

/// `ClientIp` on a server that hands over no peer address (axum served
/// without `into_make_service_with_connect_info`): a setup mistake, answered
/// 500 whatever the policy says of missing subjects, not a 401 to every
/// client, nor every request let through uncounted.
#[tokio::test]
async fn client_ip_without_the_peers_address_is_the_servers_mistake() {
    use tower_quota::{ClientIp, SubjectPolicy};

    for allow in [false, true] {
        let mut policy = QuotaPolicy::builder(ClientIp::new());
        if allow {
            policy = policy.on_missing_subject(SubjectPolicy::Allow);
        }
        let policy = policy.build();
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(policy.layer(Quota::daily(10)));
        let response = app
            .oneshot(Request::get("/").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        assert!(!response.headers().contains_key("www-authenticate"));
    }
}

/// The `QuotaStatus` extractor behind no quota layer: a setup mistake,
/// answered 500 as a problem document; `Option<QuotaStatus>` serves one
/// handler with a layer in front and without one.
#[tokio::test]
async fn the_status_extractor_behind_no_layer_is_a_500_and_optional_is_none() {
    let get_root = || {
        Request::get("/")
            .header("x-account-id", "acme")
            .body(Body::empty())
            .unwrap()
    };

    let app = Router::new().route("/", get(|_: QuotaStatus| async { "hello" }));
    let response = app.oneshot(get_root()).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );

    let optional = |status: Option<QuotaStatus>| async move {
        match status {
            Some(status) => format!("{} left", status.entries()[0].remaining()),
            None => "no quota".to_owned(),
        }
    };
    let bare = Router::new().route("/", get(optional));
    let response = bare.oneshot(get_root()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.into_body().collect().await.unwrap().to_bytes(),
        "no quota"
    );

    let counted = Router::new()
        .route("/", get(optional))
        .layer(QuotaLayer::daily(10, FromHeader::account("x-account-id")));
    let response = counted.oneshot(get_root()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.into_body().collect().await.unwrap().to_bytes(),
        "9 left"
    );
}

/// A store chosen at start-up (`EitherStore`) counts as the store it holds,
/// over HTTP: exactly the limit, then a 429, whichever it is.
#[tokio::test]
async fn a_store_chosen_at_start_up_counts_as_the_store_it_holds() {
    use tower_quota::store::EitherStore;
    type AppStore = EitherStore<MemoryStore, tower_quota::LeasedStore<MemoryStore>>;
    for store in [
        AppStore::Left(MemoryStore::new()),
        AppStore::Right(tower_quota::LeasedStore::new(MemoryStore::new())),
    ] {
        let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store)
            .build();
        let app = Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(policy.layer(Quota::daily(3)));
        for _ in 0..3 {
            assert_eq!(get_as(&app, "/", "acme").await.status, StatusCode::OK);
        }
        assert_eq!(
            get_as(&app, "/", "acme").await.status,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
}

/// A handler that answers once `clock` moved `by` (a model's answer, an
/// upstream call).
fn handler_taking(
    clock: &ManualClock,
    by: Duration,
) -> impl Fn() -> std::future::Ready<&'static str> + Clone + Send + Sync + 'static {
    let clock = clock.clone();
    move || {
        clock.advance(by);
        std::future::ready("answered")
    }
}

/// The seconds until a reset (`t`) are told from the instant the response
/// goes out: a handler that ran a while (a model's answer, an upstream
/// call) leaves the client less to wait than at the charge, and none once
/// the window ended meanwhile. The window (`w`) stays the one charged.
#[tokio::test]
async fn the_reset_is_told_from_the_responses_instant() {
    let clock = ManualClock::new(at("2026-12-02T10:00:10Z"));
    let policy = QuotaPolicy::builder(account()).clock(clock.clone()).build();
    let slow = handler_taking(&clock, Duration::from_secs(40));
    let app = Router::new()
        .route("/", get(slow))
        .layer(policy.layer(Quota::per_minute(2)));
    let answered = get_as(&app, "/", "acme").await;
    assert_eq!(answered.status, StatusCode::OK);
    assert_eq!(answered.ratelimit()["default-minute"], (1, 10));
    assert_eq!(answered.policy()["default-minute"], (2, 60));
    // Charged at 10:00:50, answered at 10:01:30: the minute is over.
    let late = get_as(&app, "/", "acme").await;
    assert_eq!(late.ratelimit()["default-minute"], (0, 0));
}

/// A window whose length changes (a month) is told as the one charged, by
/// a response that goes out in the next: January's 31 days, with the
/// standing of January's counter, not February's 28.
#[tokio::test]
async fn a_response_after_the_month_ended_tells_the_month_charged() {
    let clock = ManualClock::new(at("2027-01-31T23:59:50Z"));
    let policy = QuotaPolicy::builder(account()).clock(clock.clone()).build();
    let slow = handler_taking(&clock, Duration::from_secs(40));
    let app = Router::new()
        .route("/", get(slow))
        .layer(policy.layer(Quota::monthly(5)));
    let answered = get_as(&app, "/", "acme").await;
    assert_eq!(answered.status, StatusCode::OK);
    assert_eq!(answered.policy()["default-month"], (5, 31 * 86_400));
    assert_eq!(answered.ratelimit()["default-month"], (4, 0));
    // Charged in February: February's window.
    let next = get_as(&app, "/", "acme").await;
    assert_eq!(next.policy()["default-month"], (5, 28 * 86_400));
}

/// A limit of `u64::MAX`: a cost whose sum with what was spent passes
/// `u64` is refused as over the limit, and the refusal says so (the quota
/// it violates, and when to retry), not as a store's passing refusal.
#[tokio::test]
async fn a_sum_past_u64_is_refused_as_over_the_limit() {
    let app = Router::new().route("/", get(|| async { "hello" })).layer(
        QuotaPolicy::builder(account())
            .clock(ManualClock::new(at("2026-12-02T10:00:00Z")))
            .build()
            .layer(Quota::daily(u64::MAX))
            .cost_fn(|parts| {
                let n = parts.uri.query().and_then(|q| q.strip_prefix("n="));
                Ok(n.and_then(|n| n.parse().ok()).unwrap_or(1))
            }),
    );
    let bulk = format!("/?n={}", u64::MAX - 1);
    assert_eq!(get_as(&app, &bulk, "acme").await.status, StatusCode::OK);
    let refused = get_as(&app, "/?n=5", "acme").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        refused.json()["violated-policies"],
        serde_json::json!(["default-day"])
    );
    let retry_after = refused.headers["retry-after"].to_str().unwrap();
    assert_eq!(retry_after, "50400", "at the day's end");
}
