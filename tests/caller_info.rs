//! The support router on a customer counted on a plan and in a zone of
//! its own: what the policy's `caller_info` gives for the subject stands in
//! for the `?plan=` and `?zone=` a call does not name, so support staff
//! reach the counters the layers charge without knowing either.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, Response, StatusCode};
use tower::ServiceExt;
use tower_quota::jiff::tz::TimeZone;
use tower_quota::jiff::Timestamp;
use tower_quota::{
    CallerInfo, FromHeader, ManualClock, Quota, QuotaPolicy, QuotaPolicyBuilder, StandingError,
    Subject, UnknownPlan,
};

/// An account's settings, as the application keeps them.
#[derive(Clone)]
struct Account {
    plan: &'static str,
    zone: &'static str,
}

fn accounts() -> HashMap<&'static str, Account> {
    HashMap::from([
        (
            "tokyo-co",
            Account {
                plan: "pro",
                zone: "Asia/Tokyo",
            },
        ),
        (
            "posix-co",
            Account {
                plan: "free",
                zone: "EST5EDT,M3.2.0,M11.1.0",
            },
        ),
        (
            "gold-co",
            Account {
                plan: "gold",
                zone: "UTC",
            },
        ),
    ])
}

/// A zone by name, or a POSIX TZ string.
fn zone(name: &str) -> TimeZone {
    TimeZone::get(name).unwrap_or_else(|_| TimeZone::posix(name).unwrap())
}

/// A policy whose layers read each account's plan and zone from its
/// settings (found by the `x-account-id` header, as an authentication
/// layer would), with `info` telling support the same.
fn policy(clock: &ManualClock) -> QuotaPolicyBuilder<FromHeader> {
    let (by_plan, by_zone) = (accounts(), accounts());
    QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock.clone())
        .plan(move |parts| {
            let id = parts.headers.get("x-account-id")?.to_str().ok()?;
            Some(by_plan.get(id)?.plan.to_owned())
        })
        .plans(["free", "pro"])
        .on_unknown_plan(UnknownPlan::Reject)
        .time_zone(move |parts| {
            let id = parts
                .headers
                .get("x-account-id")
                .and_then(|v| v.to_str().ok());
            Ok(id.and_then(|id| by_zone.get(id)).map(|a| zone(a.zone)))
        })
}

/// `info` from the accounts' settings, counting its calls; an account
/// named `down` fails.
fn with_info(
    builder: QuotaPolicyBuilder<FromHeader>,
    calls: &Arc<AtomicUsize>,
) -> QuotaPolicy<FromHeader> {
    let (accounts, calls) = (accounts(), Arc::clone(calls));
    builder
        .caller_info(move |subject| {
            calls.fetch_add(1, Ordering::Relaxed);
            let id = String::from_utf8_lossy(subject.id()).into_owned();
            let account = accounts.get(id.as_str()).cloned();
            async move {
                if id == "down" {
                    return Err("the accounts database is away".into());
                }
                if id == "plain-co" {
                    // Known, with no plan or zone of its own.
                    return Ok(Some(CallerInfo::new()));
                }
                Ok(account.map(|account| {
                    CallerInfo::new()
                        .plan(account.plan)
                        .zone(zone(account.zone))
                }))
            }
        })
        .build()
}

fn app(policy: &QuotaPolicy<FromHeader>) -> Router {
    Router::new()
        .route("/read", get(|| async { "read" }))
        .route_layer(policy.layer(Quota::daily(2).plan("pro", 3).allowance("read")))
        .nest("/admin", policy.handle().router())
}

async fn send(app: &Router, method: &str, uri: &str, account: Option<&str>) -> Response<Body> {
    let mut request = Request::builder().method(method).uri(uri);
    if let Some(account) = account {
        request = request.header("x-account-id", account);
    }
    app.clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap()
}

async fn json(response: Response<Body>) -> (StatusCode, serde_json::Value) {
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), 1 << 16)
        .await
        .unwrap();
    (status, serde_json::from_slice(&body).unwrap())
}

/// 10:00 UTC: 19:00 in Tokyo, whose day is not UTC's.
fn clock() -> ManualClock {
    ManualClock::new("2026-12-02T10:00:00Z".parse::<Timestamp>().unwrap())
}

#[tokio::test]
async fn support_reads_and_resets_a_customers_own_counters_without_naming_them() {
    let clock = clock();
    let calls = Arc::new(AtomicUsize::new(0));
    let app = app(&with_info(policy(&clock), &calls));
    for _ in 0..3 {
        let served = send(&app, "GET", "/read", Some("tokyo-co")).await;
        assert_eq!(served.status(), StatusCode::OK);
    }
    assert_eq!(
        send(&app, "GET", "/read", Some("tokyo-co")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    // Its plan's limit, its zone's counter.
    let (status, shown) =
        json(send(&app, "GET", "/admin/quota/account/tokyo-co", None).await).await;
    assert_eq!(status, StatusCode::OK, "{shown}");
    let read = &shown["allowances"][0];
    assert_eq!(
        (read["limit"].as_u64(), read["used"].as_u64()),
        (Some(3), Some(3)),
        "{shown}"
    );
    assert!(
        read["reset"].as_str().unwrap().contains("Asia/Tokyo"),
        "{shown}"
    );

    // A reset reaches the counter the customer is refused on.
    let (status, reset) =
        json(send(&app, "POST", "/admin/reset/account/tokyo-co/read", None).await).await;
    assert_eq!(status, StatusCode::OK, "{reset}");
    assert_eq!(reset["allowances"][0]["used"], 0, "{reset}");
    assert_eq!(
        send(&app, "GET", "/read", Some("tokyo-co")).await.status(),
        StatusCode::OK
    );

    // A refund too.
    let (status, refunded) = json(
        send(
            &app,
            "POST",
            "/admin/refund/account/tokyo-co/read?amount=1",
            None,
        )
        .await,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{refunded}");
    assert_eq!(refunded["allowances"][0]["used"], 0, "{refunded}");
    assert_eq!(calls.load(Ordering::Relaxed), 3);

    // A customer known with no plan or zone of its own: the quotas' own.
    let (status, plain) =
        json(send(&app, "GET", "/admin/quota/account/plain-co", None).await).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(plain["allowances"][0]["limit"], 2, "{plain}");
    assert!(plain["allowances"][0]["reset"]
        .as_str()
        .unwrap()
        .contains("UTC"));
    // One it does not know: 404, nothing changed.
    for (method, path) in [
        ("GET", "/admin/quota/account/nobody"),
        ("POST", "/admin/reset/account/nobody/read"),
        ("POST", "/admin/refund/account/nobody/read?amount=1"),
    ] {
        let response = send(&app, method, path, None).await;
        assert_eq!(response.status(), StatusCode::NOT_FOUND, "{method} {path}");
        let (_, problem) = json(response).await;
        assert!(
            problem["detail"]
                .as_str()
                .unwrap()
                .contains("knows no such caller"),
            "{problem}"
        );
    }
}

#[tokio::test]
async fn what_a_call_names_stands_over_the_caller_info() {
    let clock = clock();
    let calls = Arc::new(AtomicUsize::new(0));
    let app = app(&with_info(policy(&clock), &calls));
    for _ in 0..2 {
        assert_eq!(
            send(&app, "GET", "/read", Some("tokyo-co")).await.status(),
            StatusCode::OK
        );
    }
    // Both named: the info is not asked.
    let (_, utc) = json(
        send(
            &app,
            "GET",
            "/admin/quota/account/tokyo-co?zone=UTC&plan=free",
            None,
        )
        .await,
    )
    .await;
    assert_eq!(utc["allowances"][0]["used"], 0, "{utc}");
    assert_eq!(utc["allowances"][0]["limit"], 2, "{utc}");
    assert_eq!(calls.load(Ordering::Relaxed), 0);
    // One named: the info gives the other.
    let (_, free) =
        json(send(&app, "GET", "/admin/quota/account/tokyo-co?plan=free", None).await).await;
    assert_eq!(free["allowances"][0]["used"], 2, "{free}");
    assert_eq!(free["allowances"][0]["limit"], 2, "{free}");
    let (_, zoned) =
        json(send(&app, "GET", "/admin/quota/account/tokyo-co?zone=UTC", None).await).await;
    assert_eq!(zoned["allowances"][0]["used"], 0, "{zoned}");
    assert_eq!(zoned["allowances"][0]["limit"], 3, "{zoned}");
    assert_eq!(calls.load(Ordering::Relaxed), 2);
}

#[tokio::test]
async fn caller_info_that_fails_or_names_what_no_layer_charges_changes_nothing() {
    let clock = clock();
    let calls = Arc::new(AtomicUsize::new(0));
    let app = app(&with_info(policy(&clock), &calls));
    for (account, status) in [
        ("down", StatusCode::SERVICE_UNAVAILABLE),
        // A POSIX TZ string names no key; a plan the policy refuses.
        ("posix-co", StatusCode::INTERNAL_SERVER_ERROR),
        ("gold-co", StatusCode::INTERNAL_SERVER_ERROR),
    ] {
        for (method, path) in [
            ("GET", format!("/admin/quota/account/{account}")),
            ("POST", format!("/admin/reset/account/{account}/read")),
            (
                "POST",
                format!("/admin/refund/account/{account}/read?amount=1"),
            ),
        ] {
            let response = send(&app, method, &path, None).await;
            assert_eq!(response.status(), status, "{method} {path}");
            if status == StatusCode::SERVICE_UNAVAILABLE {
                assert_eq!(response.headers()["retry-after"], "1");
            }
            assert_eq!(
                response.headers()["content-type"],
                "application/problem+json"
            );
            let (_, problem) = json(response).await;
            let detail = problem["detail"].as_str().unwrap();
            assert!(detail.contains("nothing was changed"), "{detail}");
            // The error's own text (the application's) is logged, not told.
            assert!(!detail.contains("database"), "{detail}");
        }
    }
}

#[tokio::test]
async fn without_caller_info_a_call_naming_nothing_reads_the_quotas_own() {
    let clock = clock();
    let app = app(&policy(&clock).build());
    for _ in 0..2 {
        assert_eq!(
            send(&app, "GET", "/read", Some("tokyo-co")).await.status(),
            StatusCode::OK
        );
    }
    let (_, shown) = json(send(&app, "GET", "/admin/quota/account/tokyo-co", None).await).await;
    assert_eq!(shown["allowances"][0]["used"], 0, "{shown}");
    assert_eq!(shown["allowances"][0]["limit"], 2, "{shown}");
}

/// A policy that reads each request's plan (`x-plan`) and no caller's
/// zone.
fn plans_only(clock: &ManualClock) -> QuotaPolicyBuilder<FromHeader> {
    QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock.clone())
        .plan(|parts| Some(parts.headers.get("x-plan")?.to_str().ok()?.to_owned()))
}

/// A zone the info gives is used only by a policy that reads callers'
/// zones: its counters are the ones the layers charge.
#[tokio::test]
async fn a_policy_that_reads_no_callers_zone_keeps_the_quotas_zone() {
    let clock = clock();
    let calls = Arc::new(AtomicUsize::new(0));
    let app = app(&with_info(plans_only(&clock), &calls));
    assert_eq!(
        send(&app, "GET", "/read", Some("tokyo-co")).await.status(),
        StatusCode::OK
    );
    let (status, shown) =
        json(send(&app, "GET", "/admin/quota/account/tokyo-co", None).await).await;
    // In UTC, where the layer charged it; on its plan.
    assert_eq!(status, StatusCode::OK, "{shown}");
    assert_eq!(shown["allowances"][0]["used"], 1, "{shown}");
    assert_eq!(shown["allowances"][0]["limit"], 3, "{shown}");
}

/// A policy that reads plans and no caller's zone: a call that names the
/// plan names all the info would give, and does not ask it, so a caller
/// the application no longer knows (its counters live on) is reached.
#[tokio::test]
async fn a_call_naming_all_the_policy_reads_does_not_ask_the_info() {
    let clock = clock();
    let calls = Arc::new(AtomicUsize::new(0));
    let app = app(&with_info(plans_only(&clock), &calls));
    let request = Request::get("/read")
        .header("x-account-id", "gone-co")
        .header("x-plan", "pro")
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        app.clone().oneshot(request).await.unwrap().status(),
        StatusCode::OK
    );
    let (status, shown) =
        json(send(&app, "GET", "/admin/quota/account/gone-co?plan=pro", None).await).await;
    assert_eq!(status, StatusCode::OK, "{shown}");
    assert_eq!(shown["allowances"][0]["used"], 1, "{shown}");
    assert_eq!(shown["allowances"][0]["limit"], 3, "{shown}");
    let reset = send(
        &app,
        "POST",
        "/admin/reset/account/gone-co/read?plan=pro",
        None,
    )
    .await;
    assert_eq!(reset.status(), StatusCode::OK);
    assert_eq!(calls.load(Ordering::Relaxed), 0, "the info was not asked");
    // Naming no plan, the info is asked, and knows no such caller.
    let unnamed = send(&app, "GET", "/admin/quota/account/gone-co", None).await;
    assert_eq!(unnamed.status(), StatusCode::NOT_FOUND);
}

/// A call refused for what it names (a zone no key can name, a plan the
/// policy refuses, an allowance no quota charges) is refused as it is
/// without caller info, and the info is not asked: its failure, or a plan
/// it gives that the policy refuses, does not turn the caller's 400, 403 or
/// 404 into a 503 or a 500.
#[tokio::test]
async fn a_call_refused_for_what_it_names_does_not_ask_the_info() {
    let clock = clock();
    let calls = Arc::new(AtomicUsize::new(0));
    let zoned = app(&with_info(policy(&clock), &calls));
    let mut wrong = Vec::new();
    for account in ["down", "gold-co", "tokyo-co"] {
        for (method, path, status) in [
            ("GET", "/admin/quota/account/{}?zone=Not/AZone", 400),
            ("POST", "/admin/reset/account/{}/read?zone=Not/AZone", 400),
            (
                "POST",
                "/admin/refund/account/{}/read?amount=1&zone=Not/AZone",
                400,
            ),
            ("GET", "/admin/quota/account/{}?plan=gold", 403),
            ("POST", "/admin/reset/account/{}/read?plan=gold", 403),
            (
                "POST",
                "/admin/refund/account/{}/read?amount=1&plan=gold",
                403,
            ),
            ("POST", "/admin/reset/account/{}/nope", 404),
            ("POST", "/admin/refund/account/{}/nope?amount=1", 404),
        ] {
            let path = path.replace("{}", account);
            let got = send(&zoned, method, &path, None).await.status().as_u16();
            if got != status {
                wrong.push(format!("{method} {path}: {got}, not {status}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert_eq!(calls.load(Ordering::Relaxed), 0);

    // A policy that reads no caller's zone refuses any ?zone=, as before.
    let builder = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock.clone())
        .plan(|parts| Some(parts.headers.get("x-plan")?.to_str().ok()?.to_owned()));
    let unzoned = app(&with_info(builder, &calls));
    let response = send(&unzoned, "GET", "/admin/quota/account/down?zone=UTC", None).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(calls.load(Ordering::Relaxed), 0);
}

/// The handle for a caller (`for_caller`): in its zone and on its plan, as
/// the layers count it, so a handler or a support tool of the
/// application's own reads, resets and refunds the counters the caller is
/// refused on, without knowing its zone or plan.
#[tokio::test]
async fn the_handle_for_a_caller_reaches_its_own_counters() {
    let clock = clock();
    let calls = Arc::new(AtomicUsize::new(0));
    let policy = with_info(policy(&clock), &calls);
    let app = app(&policy);
    for _ in 0..3 {
        let served = send(&app, "GET", "/read", Some("tokyo-co")).await;
        assert_eq!(served.status(), StatusCode::OK);
    }
    let tokyo = Subject::account("tokyo-co");
    let handle = policy.handle().for_caller(&tokyo).await.unwrap();
    assert_eq!(handle.plan(), Some("pro"));
    assert_eq!(
        handle.zone().and_then(|zone| zone.iana_name()),
        Some("Asia/Tokyo")
    );
    let usage = handle.usage(&tokyo).await.unwrap();
    assert_eq!((usage[0].limit(), usage[0].used()), (3, 3));
    // The handle alone reads the quotas' own zone and limits.
    let own = policy.handle().usage(&tokyo).await.unwrap();
    assert_eq!((own[0].limit(), own[0].used()), (2, 0));

    // A reset through it reaches the counter the caller is refused on.
    assert_eq!(
        send(&app, "GET", "/read", Some("tokyo-co")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    handle.reset_allowance(&tokyo, "read").await.unwrap();
    assert_eq!(
        send(&app, "GET", "/read", Some("tokyo-co")).await.status(),
        StatusCode::OK
    );
    assert_eq!(handle.usage(&tokyo).await.unwrap()[0].used(), 1);

    // Known, with no plan or zone of its own: the quotas' own.
    let plain = policy
        .handle()
        .for_caller(&Subject::account("plain-co"))
        .await
        .unwrap();
    assert_eq!((plain.plan(), plain.zone()), (None, None));
    // A handle in a zone already, for a caller of no zone of its own:
    // the quotas' zone, as the layers count that caller.
    let elsewhere = policy.handle().in_zone(zone("Asia/Tokyo"));
    let plain = elsewhere
        .for_caller(&Subject::account("plain-co"))
        .await
        .unwrap();
    assert_eq!(plain.zone(), None);
}

#[tokio::test]
async fn the_handle_for_a_caller_the_info_cannot_tell_is_an_error() {
    let clock = clock();
    let calls = Arc::new(AtomicUsize::new(0));
    let with_info = with_info(policy(&clock), &calls);
    let handle = with_info.handle();
    let cases = [
        ("nobody", StatusCode::NOT_FOUND),
        ("down", StatusCode::SERVICE_UNAVAILABLE),
        ("posix-co", StatusCode::SERVICE_UNAVAILABLE),
        ("gold-co", StatusCode::FORBIDDEN),
    ];
    for (account, status) in cases {
        let error = match handle.for_caller(&Subject::account(account)).await {
            Ok(_) => panic!("{account}: a handle"),
            Err(error) => error,
        };
        match (account, &error) {
            ("nobody", StandingError::UnknownCaller)
            | ("down" | "posix-co", StandingError::CallerInfo(_))
            | ("gold-co", StandingError::Plan(_)) => {}
            _ => panic!("{account}: {error:?}"),
        }
        let response = axum::response::IntoResponse::into_response(error);
        assert_eq!(response.status(), status, "{account}");
        if status == StatusCode::SERVICE_UNAVAILABLE {
            assert_eq!(response.headers()["retry-after"], "1");
        }
        let (_, problem) = json(response).await;
        // The application's own error text is not told.
        let detail = problem["detail"].as_str().unwrap();
        assert!(!detail.contains("database"), "{detail}");
    }

    // Without caller info, every caller as its requests would count it
    // naming no plan or zone.
    let plain = policy(&clock).build();
    let handle = plain
        .handle()
        .for_caller(&Subject::account("nobody"))
        .await
        .unwrap();
    assert_eq!((handle.plan(), handle.zone()), (None, None));
}

/// A plan the info gives is used only by a policy that reads plans: one
/// that reads none charges every caller on the quotas' own limits, and
/// refuses no caller for it, whatever its rule for unknown plans.
#[tokio::test]
async fn a_policy_that_reads_no_plan_keeps_the_quotas_limits() {
    let clock = clock();
    let calls = Arc::new(AtomicUsize::new(0));
    let builder = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock.clone())
        .on_unknown_plan(UnknownPlan::Reject);
    let policy = with_info(builder, &calls);
    let app = Router::new()
        .route("/read", get(|| async { "read" }))
        .route_layer(policy.layer(Quota::daily(2).allowance("read")))
        .nest("/admin", policy.handle().router());
    assert_eq!(
        send(&app, "GET", "/read", Some("gold-co")).await.status(),
        StatusCode::OK
    );
    let gold = Subject::account("gold-co");
    let handle = policy.handle().for_caller(&gold).await.unwrap();
    assert_eq!(handle.plan(), None);
    let usage = handle.usage(&gold).await.unwrap();
    assert_eq!((usage[0].limit(), usage[0].used()), (2, 1));
    let (status, shown) = json(send(&app, "GET", "/admin/quota/account/gold-co", None).await).await;
    assert_eq!(status, StatusCode::OK, "{shown}");
    assert_eq!(shown["allowances"][0]["used"], 1, "{shown}");
}

/// A plan the call names stands over the info's, also when the info's is
/// one the policy refuses: the call is answered on the plan it names.
#[tokio::test]
async fn a_named_plan_stands_over_a_refused_one_from_the_info() {
    let clock = clock();
    let calls = Arc::new(AtomicUsize::new(0));
    let app = app(&with_info(policy(&clock), &calls));
    let (status, body) =
        json(send(&app, "GET", "/admin/quota/account/gold-co?plan=free", None).await).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["allowances"][0]["limit"], 2, "{body}");
    let response = send(
        &app,
        "POST",
        "/admin/reset/account/gold-co/read?plan=pro",
        None,
    )
    .await;
    assert_eq!(response.status(), StatusCode::OK);
}
