//! README claims, each over real HTTP through axum on a `ManualClock`.

#[allow(dead_code)] // Not every rig is used here.
mod rigged;

use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::routing::get;
use axum::Router;
use http::{Request, Response, StatusCode};
use rigged::{Rig, Rigged};
use tower::ServiceExt;
use tower_quota::jiff::Timestamp;
use tower_quota::{
    zone_from_header, FromHeader, ManualClock, MemoryStore, OnStoreError, Quota, QuotaHandle,
    QuotaPolicy, QuotaPolicyBuilder, QuotaStatus, QuotaUsage, Store, Subject,
};

const NOW: &str = "2026-12-02T10:00:00Z";

fn call(path: &str) -> Request<Body> {
    Request::get(path)
        .header("x-account-id", "acme")
        .body(Body::empty())
        .unwrap()
}

fn header(response: &Response<Body>, name: &str) -> String {
    response
        .headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

fn policy<St: Store>(store: St, clock: &ManualClock) -> QuotaPolicyBuilder<FromHeader, St> {
    QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .clock(clock.clone())
}

async fn usage_of<St: Store>(policy: &QuotaPolicy<FromHeader, St>, name: &str) -> QuotaUsage {
    let usage = policy
        .handle()
        .usage(&Subject::account("acme"))
        .await
        .unwrap();
    usage
        .into_iter()
        .find(|u| u.name() == name || u.allowance() == name)
        .unwrap()
}

fn clock() -> ManualClock {
    ManualClock::new(NOW.parse().unwrap())
}

/// README: "on a layer with a deferred cost the cost the response reports
/// is then not charged either" (after `refund_request`).
#[tokio::test]
async fn a_deferred_cost_after_refund_request_charges_nothing() {
    let clock = clock();
    let policy = policy(MemoryStore::new(), &clock).build();
    async fn handler(State(handle): State<QuotaHandle>, status: QuotaStatus) -> Response<Body> {
        handle.refund_request(&status).await.unwrap();
        Response::builder()
            .header("x-tokens-used", "5")
            .body(Body::from("failed on our side"))
            .unwrap()
    }
    let app = Router::new()
        .route("/", get(handler))
        .with_state(policy.handle())
        .layer(
            policy
                .layer(Quota::daily(100).allowance("tokens"))
                .deferred_cost(1, |response| {
                    response
                        .headers
                        .get("x-tokens-used")
                        .and_then(|v| v.to_str().ok()?.parse().ok())
                        .unwrap_or(1)
                }),
        );
    let response = app.oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(usage_of(&policy, "tokens-day").await.used(), 0);
}

/// README: a deferred cost's report of 0 costs nothing; one past the
/// limit is charged past it.
#[tokio::test]
async fn a_deferred_cost_of_zero_costs_nothing_and_past_the_limit_counts() {
    let clock = clock();
    let policy = policy(MemoryStore::new(), &clock).build();
    let app = Router::new()
        .route(
            "/",
            get(|request: Request<Body>| async move {
                let used = request.uri().query().unwrap_or("1").to_owned();
                Response::builder()
                    .header("x-tokens-used", used)
                    .body(Body::empty())
                    .unwrap()
            }),
        )
        .layer(
            policy
                .layer(Quota::daily(10).allowance("tokens"))
                .deferred_cost(1, |response| {
                    response
                        .headers
                        .get("x-tokens-used")
                        .and_then(|v| v.to_str().ok()?.parse().ok())
                        .unwrap_or(1)
                }),
        );
    let r = app.clone().oneshot(call("/?0")).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(usage_of(&policy, "tokens-day").await.used(), 0);
    let r = app.clone().oneshot(call("/?25")).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert!(header(&r, "ratelimit").contains("r=0"), "{r:?}");
    assert_eq!(usage_of(&policy, "tokens-day").await.used(), 25);
    let r = app.clone().oneshot(call("/?1")).await.unwrap();
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
}

/// README: `refund_request` in a handler that answers 5xx under
/// `refund_server_errors` gives back once.
#[tokio::test]
async fn refund_request_and_a_refunded_5xx_give_back_once() {
    let clock = clock();
    let policy = policy(MemoryStore::new(), &clock)
        .refund_server_errors(true)
        .build();
    async fn fails(State(handle): State<QuotaHandle>, status: QuotaStatus) -> StatusCode {
        handle.refund_request(&status).await.unwrap();
        StatusCode::INTERNAL_SERVER_ERROR
    }
    let app = Router::new()
        .route("/fail", get(fails))
        .route("/ok", get(|| async { "ok" }))
        .with_state(policy.handle())
        .layer(policy.layer(Quota::daily(10).allowance("calls")));
    assert_eq!(
        app.clone().oneshot(call("/ok")).await.unwrap().status(),
        200
    );
    assert_eq!(
        app.clone().oneshot(call("/fail")).await.unwrap().status(),
        500
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(usage_of(&policy, "calls-day").await.used(), 1);
}

/// README: "A rolling period whose only spending is given back this way
/// (or refused further in, or dropped) closes with it: the next request
/// that spends opens the period. A support refund never closes one."
#[tokio::test]
async fn a_rolling_period_closes_with_its_only_spending_given_back() {
    let clock = clock();
    let policy = policy(MemoryStore::new(), &clock).build();
    async fn undo(State(handle): State<QuotaHandle>, status: QuotaStatus) -> &'static str {
        handle.refund_request(&status).await.unwrap();
        "undone"
    }
    let rolling = Quota::rolling(10, Duration::from_secs(3600)).allowance("calls");
    let app = Router::new()
        .route("/undo", get(undo))
        .route("/ok", get(|| async { "ok" }))
        .with_state(policy.handle())
        .merge(
            Router::new()
                .route("/burst", get(|| async { "ok" }))
                .route_layer(policy.layer(Quota::per_minute(0).allowance("burst"))),
        )
        .layer(policy.layer(rolling));
    let name = usage_of(&policy, "calls").await;
    assert_eq!(name.first_call(), None);

    // Given back by the handler: closed.
    assert_eq!(
        app.clone().oneshot(call("/undo")).await.unwrap().status(),
        200
    );
    let u = usage_of(&policy, "calls").await;
    assert_eq!(
        (u.used(), u.first_call()),
        (0, None),
        "after refund_request"
    );

    // Refused further in: closed.
    clock.advance(Duration::from_secs(60));
    assert_eq!(
        app.clone().oneshot(call("/burst")).await.unwrap().status(),
        429
    );
    let u = usage_of(&policy, "calls").await;
    assert_eq!(
        (u.used(), u.first_call()),
        (0, None),
        "after a refusal further in"
    );

    // The next request that spends opens it.
    clock.advance(Duration::from_secs(60));
    let opened: Timestamp = "2026-12-02T10:02:00Z".parse().unwrap();
    assert_eq!(
        app.clone().oneshot(call("/ok")).await.unwrap().status(),
        200
    );
    let u = usage_of(&policy, "calls").await;
    assert_eq!((u.used(), u.first_call()), (1, Some(opened)));

    // A support refund keeps it open.
    clock.advance(Duration::from_secs(60));
    policy
        .handle()
        .refund_allowance(&Subject::account("acme"), "calls", 1)
        .await
        .unwrap();
    let u = usage_of(&policy, "calls").await;
    assert_eq!(
        (u.used(), u.first_call()),
        (0, Some(opened)),
        "after support's refund"
    );
}

/// README: "a minute, or an hour at a whole-hour offset, is the same
/// instants everywhere, and one counter in every zone".
#[tokio::test]
async fn an_hour_at_a_whole_hour_offset_is_one_counter_in_every_zone() {
    let clock = clock();
    let policy = policy(MemoryStore::new(), &clock)
        .time_zone(zone_from_header("x-zone"))
        .build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(policy.layer(Quota::hourly(1).allowance("h")))
        .layer(policy.layer(Quota::per_minute(2).allowance("m")));
    let zoned = |zone: &str| {
        Request::get("/")
            .header("x-account-id", "acme")
            .header("x-zone", zone)
            .body(Body::empty())
            .unwrap()
    };
    assert_eq!(app.clone().oneshot(call("/")).await.unwrap().status(), 200);
    let berlin = app.clone().oneshot(zoned("Europe/Berlin")).await.unwrap();
    assert_eq!(berlin.status(), 429, "{:?}", berlin.headers());
    let tokyo = app.clone().oneshot(zoned("Asia/Tokyo")).await.unwrap();
    assert_eq!(tokyo.status(), 429);
    // Kolkata's hour is its own; its minute is everyone's (2 of 2 spent
    // now: the two refusals above spent none).
    let kolkata = app.clone().oneshot(zoned("Asia/Kolkata")).await.unwrap();
    assert_eq!(kolkata.status(), 200, "{:?}", kolkata.headers());
    let kolkata = app.clone().oneshot(zoned("Asia/Kathmandu")).await.unwrap();
    assert_eq!(kolkata.status(), 429, "{:?}", kolkata.headers());
    assert!(header(&kolkata, "ratelimit").contains("\"m-minute\";r=0"));
}

/// README: skipped requests "pass uncounted, without fields".
#[tokio::test]
async fn a_skipped_request_passes_uncounted_without_fields() {
    let clock = clock();
    let policy = policy(MemoryStore::new(), &clock)
        .skip_if(|parts| parts.method == http::Method::OPTIONS)
        .build();
    let app = Router::new()
        .route(
            "/",
            get(|| async { "ok" }).options(|| async { "preflight" }),
        )
        .layer(policy.layer(Quota::daily(1)));
    let preflight = Request::options("/")
        .header("x-account-id", "acme")
        .body(Body::empty())
        .unwrap();
    let r = app.clone().oneshot(preflight).await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(!r.headers().contains_key("ratelimit"));
    assert!(!r.headers().contains_key("ratelimit-policy"));
    assert_eq!(usage_of(&policy, "default-day").await.used(), 0);
}

/// README: "A layer whose quotas are all shadow quotas never refuses: when
/// the store fails, its request passes and owes its charge, whichever rule
/// the policy has."; fail closed is a 503 with `Retry-After: 1`.
#[tokio::test]
async fn a_shadow_layer_passes_a_failed_store_and_owes() {
    let clock = clock();
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("enforced"));
    let policy = policy(store, &clock)
        .on_store_error(OnStoreError::FailClosed {
            retry_after: Duration::from_secs(1),
        })
        .build();
    let app = Router::new()
        .route("/shadow", get(|| async { "ok" }))
        .route_layer(policy.layer(Quota::daily(1).allowance("watched").shadow()));
    let enforced = Router::new()
        .route("/enforced", get(|| async { "ok" }))
        .route_layer(policy.layer(Quota::daily(1).allowance("enforced")));
    let app = app.merge(enforced);
    let r = app.clone().oneshot(call("/enforced")).await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(header(&r, "retry-after"), "1");
    assert_eq!(policy.owed().units, 0);
    // The shadow layer's store works: rig it too.
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, None);
    let clock = ManualClock::new(NOW.parse().unwrap());
    let failing = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .namespace("all-failing")
        .clock(clock)
        .build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(failing.layer(Quota::daily(1).allowance("watched").shadow()));
    let r = app.clone().oneshot(call("/")).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(failing.owed().units, 1);
}

/// README: "a local day is 82 800 or 90 000 on the days clocks change".
#[tokio::test]
async fn a_local_day_is_told_as_long_as_it_is() {
    let clock = ManualClock::new("2026-03-29T10:00:00Z".parse().unwrap());
    let berlin = tower_quota::jiff::tz::TimeZone::get("Europe/Berlin").unwrap();
    let policy = policy(MemoryStore::new(), &clock).build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(policy.layer(Quota::daily(5).in_time_zone(berlin)));
    let r = app.clone().oneshot(call("/")).await.unwrap();
    assert!(
        header(&r, "ratelimit-policy").ends_with(";w=82800"),
        "{r:?}"
    );
    clock.set("2026-10-25T10:00:00Z".parse().unwrap());
    let r = app.clone().oneshot(call("/")).await.unwrap();
    assert!(
        header(&r, "ratelimit-policy").ends_with(";w=90000"),
        "{r:?}"
    );
}

/// README: an id longer than `max_subject_len` (256 bytes by default) is a
/// 400 with a problem document, not charged.
#[tokio::test]
async fn the_longest_id_is_256_bytes_by_default() {
    let clock = clock();
    let policy = policy(MemoryStore::new(), &clock).build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(policy.layer(Quota::daily(5)));
    let with = |id: String| {
        Request::get("/")
            .header("x-account-id", id)
            .body(Body::empty())
            .unwrap()
    };
    let r = app.clone().oneshot(with("a".repeat(256))).await.unwrap();
    assert_eq!(r.status(), 200);
    let r = app.clone().oneshot(with("a".repeat(257))).await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(header(&r, "content-type"), "application/problem+json");
}

/// README (fail open): "Its response carries no `RateLimit` fields for the
/// quotas it owes".
#[tokio::test]
async fn a_fail_open_response_tells_no_fields_for_what_it_owes() {
    let clock = clock();
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("owed"));
    let policy = policy(store, &clock)
        .on_store_error(OnStoreError::FailOpen)
        .build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(policy.layer(Quota::daily(5).allowance("owed")))
        .layer(policy.layer(Quota::daily(5).allowance("fine")));
    let r = app.clone().oneshot(call("/")).await.unwrap();
    assert_eq!(r.status(), 200);
    let fields = header(&r, "ratelimit");
    assert!(fields.contains("fine-day"), "{fields}");
    assert!(!fields.contains("owed-day"), "{fields}");
    assert!(!header(&r, "ratelimit-policy").contains("owed-day"));
    assert_eq!(policy.owed().units, 1);
}

/// README: "a first-use counter the ledger creates ends when the request's
/// period does"; `settle_owed` answers what it could not settle.
#[tokio::test]
async fn a_first_use_debt_lands_in_a_period_of_the_requests_own() {
    let clock = clock();
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("calls"));
    store.away.store(true, std::sync::atomic::Ordering::SeqCst);
    let policy = policy(store.clone(), &clock)
        .on_store_error(OnStoreError::FailOpen)
        .build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(policy.layer(Quota::rolling(10, Duration::from_secs(3600)).allowance("calls")));
    assert_eq!(app.clone().oneshot(call("/")).await.unwrap().status(), 200);
    assert_eq!(policy.owed().units, 1);
    let unsettled = policy.settle_owed(Duration::from_millis(300)).await;
    assert_eq!(unsettled.units, 1, "the store is away");
    clock.advance(Duration::from_secs(1800));
    store.away.store(false, std::sync::atomic::Ordering::SeqCst);
    let unsettled = policy.settle_owed(Duration::from_secs(2)).await;
    assert_eq!(unsettled.units, 0);
    let u = usage_of(&policy, "calls").await;
    let t0: Timestamp = NOW.parse().unwrap();
    assert_eq!(u.used(), 1);
    assert_eq!(u.resets_at(), t0 + Duration::from_secs(3600), "{u:?}");
}

/// README: `max_owed_counters(0)`: fail-open admissions go uncounted.
#[tokio::test]
async fn without_a_ledger_fail_open_admissions_go_uncounted() {
    let clock = clock();
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("calls"));
    let policy = policy(store, &clock)
        .on_store_error(OnStoreError::FailOpen)
        .max_owed_counters(0)
        .build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(policy.layer(Quota::daily(10).allowance("calls")));
    assert_eq!(app.clone().oneshot(call("/")).await.unwrap().status(), 200);
    assert_eq!(policy.owed().units, 0);
    assert_eq!(policy.settle_owed(Duration::from_secs(1)).await.units, 0);
    assert_eq!(usage_of(&policy, "calls").await.used(), 0);
}

/// README: the same quota in two layers counts once per request, at the
/// cost of the outer layer.
#[tokio::test]
async fn the_same_quota_in_two_layers_counts_at_the_outer_cost() {
    let clock = clock();
    let policy = policy(MemoryStore::new(), &clock).build();
    let quota = Quota::daily(100).allowance("calls");
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(policy.layer(quota.clone()).cost(5))
        .layer(policy.layer(quota).cost(2));
    assert_eq!(app.clone().oneshot(call("/")).await.unwrap().status(), 200);
    assert_eq!(usage_of(&policy, "calls").await.used(), 2);
}

/// README: a zone the policy's reader answers that is neither of the IANA
/// list nor a fixed offset is a 400 (nothing charged); a fixed offset
/// counts; `in_zone` reaches it.
#[tokio::test]
async fn a_readers_posix_zone_is_a_400_and_a_fixed_offset_counts() {
    use tower_quota::jiff::tz::{offset, TimeZone};
    let clock = clock();
    let policy = policy(MemoryStore::new(), &clock)
        .time_zone(|parts| {
            Ok(match parts.headers.get("x-zone").map(|v| v.as_bytes()) {
                Some(b"posix") => Some(TimeZone::posix("EST5EDT,M3.2.0,M11.1.0").unwrap()),
                Some(b"fixed") => Some(TimeZone::fixed(offset(5))),
                _ => None,
            })
        })
        .build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(policy.layer(Quota::daily(10).allowance("calls")));
    let zoned = |zone: &str| {
        Request::get("/")
            .header("x-account-id", "acme")
            .header("x-zone", zone)
            .body(Body::empty())
            .unwrap()
    };
    let r = app.clone().oneshot(zoned("posix")).await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(header(&r, "content-type"), "application/problem+json");
    let r = app.clone().oneshot(zoned("fixed")).await.unwrap();
    assert_eq!(r.status(), 200);
    let fixed = policy.handle().in_zone(TimeZone::fixed(offset(5)));
    let u = fixed.usage(&Subject::account("acme")).await.unwrap();
    assert_eq!(u[0].used(), 1);
    assert_eq!(
        usage_of(&policy, "calls").await.used(),
        0,
        "own zone: not counted there"
    );
}

/// README: `refund_request` "answers what each counter holds afterwards".
#[tokio::test]
async fn refund_request_answers_what_each_counter_holds() {
    let clock = clock();
    let policy = policy(MemoryStore::new(), &clock).build();
    async fn undo(State(handle): State<QuotaHandle>, status: QuotaStatus) -> String {
        format!("{:?}", handle.refund_request(&status).await.unwrap())
    }
    let app = Router::new()
        .route("/undo", get(undo))
        .route("/ok", get(|| async { "ok" }))
        .with_state(policy.handle())
        .layer(
            policy
                .layer(Quota::daily(10).allowance("a"))
                .quota(Quota::hourly(10).allowance("b")),
        );
    assert_eq!(
        app.clone().oneshot(call("/ok")).await.unwrap().status(),
        200
    );
    let r = app.clone().oneshot(call("/undo")).await.unwrap();
    let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
    assert_eq!(&body[..], b"[Some(1), Some(1)]");
}

/// README: spread resets: "Clients are told resets up to 10 minutes apart,
/// never too early."
#[tokio::test]
async fn spread_resets_are_never_told_too_early() {
    let clock = ManualClock::new("2026-12-02T23:50:00Z".parse().unwrap());
    let policy = policy(MemoryStore::new(), &clock).build();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        policy.layer(
            Quota::daily(1)
                .allowance("read")
                .spread_reset(Duration::from_secs(600)),
        ),
    );
    let mut waits = Vec::new();
    for i in 0..40 {
        let who = format!("c{i}");
        let req = |who: &str| {
            Request::get("/")
                .header("x-account-id", who)
                .body(Body::empty())
                .unwrap()
        };
        let ok = app.clone().oneshot(req(&who)).await.unwrap();
        let t: u64 = header(&ok, "ratelimit")
            .rsplit("t=")
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let refused = app.clone().oneshot(req(&who)).await.unwrap();
        assert_eq!(refused.status(), 429);
        let retry: u64 = header(&refused, "retry-after").parse().unwrap();
        assert!((600..=1200).contains(&t), "t={t}");
        assert!((600..=1200).contains(&retry), "retry-after={retry}");
        waits.push(t);
    }
    waits.sort();
    waits.dedup();
    assert!(waits.len() > 5, "spread: {waits:?}");
}

/// README: "a handler can report in `response.extensions` instead of a
/// header the client would see".
#[tokio::test]
async fn a_deferred_cost_travels_in_the_response_extensions() {
    #[derive(Clone)]
    struct Tokens(u64);
    let clock = clock();
    let policy = policy(MemoryStore::new(), &clock).build();
    let app = Router::new()
        .route(
            "/",
            get(|| async {
                let mut response = Response::new(Body::from("done"));
                response.extensions_mut().insert(Tokens(7));
                response
            }),
        )
        .layer(
            policy
                .layer(Quota::daily(100).allowance("tokens"))
                .deferred_cost(1, |response| {
                    response.extensions.get::<Tokens>().map_or(1, |t| t.0)
                }),
        );
    let r = app.clone().oneshot(call("/")).await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(header(&r, "ratelimit").contains("r=93"), "{r:?}");
    assert_eq!(usage_of(&policy, "tokens").await.used(), 7);
}

/// README: `QuotaStatus` tells the quotas as the request leaves them,
/// "less what the handler gave back", by name with `status.get`.
#[tokio::test]
async fn quota_status_tells_what_the_handler_gave_back() {
    let clock = clock();
    let policy = policy(MemoryStore::new(), &clock).build();
    async fn undo(State(handle): State<QuotaHandle>, status: QuotaStatus) -> String {
        let before = status.get("read-day").unwrap().used();
        handle.refund_request(&status).await.unwrap();
        let after = status.get("read-day").unwrap().used();
        format!("{before} {after}")
    }
    let app = Router::new()
        .route("/undo", get(undo))
        .with_state(policy.handle())
        .layer(policy.layer(Quota::daily(10).allowance("read")));
    let r = app.clone().oneshot(call("/undo")).await.unwrap();
    let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
    assert_eq!(&body[..], b"1 0");
}

/// README: a refunded 5xx is given back once, also when the handler's own
/// `refund_request` comes after the response went out.
#[tokio::test]
async fn a_refund_request_after_a_refunded_5xx_gives_back_nothing_more() {
    let clock = clock();
    let policy = policy(MemoryStore::new(), &clock)
        .refund_server_errors(true)
        .build();
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let done = std::sync::Arc::new(tokio::sync::Notify::new());
    let (g, d) = (gate.clone(), done.clone());
    let app = Router::new()
        .route(
            "/fail",
            get(
                move |State(handle): State<QuotaHandle>, status: QuotaStatus| {
                    let (g, d) = (g.clone(), d.clone());
                    async move {
                        tokio::spawn(async move {
                            g.notified().await;
                            let _ = handle.refund_request(&status).await;
                            d.notify_one();
                        });
                        StatusCode::INTERNAL_SERVER_ERROR
                    }
                },
            ),
        )
        .route("/ok", get(|| async { "ok" }))
        .with_state(policy.handle())
        .layer(policy.layer(Quota::daily(10).allowance("calls")));
    assert_eq!(
        app.clone().oneshot(call("/ok")).await.unwrap().status(),
        200
    );
    let r = app.clone().oneshot(call("/fail")).await.unwrap();
    assert_eq!(r.status(), 500);
    drop(r);
    tokio::time::sleep(Duration::from_millis(50)).await;
    gate.notify_one();
    done.notified().await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(usage_of(&policy, "calls").await.used(), 1);
}

/// README: a rolling period whose only spending is dropped closes with it;
/// `refund_at` (a support refund) never closes one.
#[tokio::test]
async fn a_dropped_request_closes_its_rolling_period_and_refund_at_does_not() {
    let clock = clock();
    let policy = policy(MemoryStore::new(), &clock).build();
    let app = Router::new()
        .route("/hang", get(std::future::pending::<&'static str>))
        .route("/ok", get(|| async { "ok" }))
        .layer(policy.layer(Quota::rolling(10, Duration::from_secs(3600)).allowance("calls")));
    let hanging = tokio::spawn(app.clone().oneshot(call("/hang")));
    while usage_of(&policy, "calls").await.used() == 0 {
        tokio::task::yield_now().await;
    }
    hanging.abort();
    let _ = hanging.await;
    let mut u = usage_of(&policy, "calls").await;
    for _ in 0..100 {
        if u.used() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        u = usage_of(&policy, "calls").await;
    }
    assert_eq!((u.used(), u.first_call()), (0, None), "after a drop");

    let t0: Timestamp = NOW.parse().unwrap();
    assert_eq!(
        app.clone().oneshot(call("/ok")).await.unwrap().status(),
        200
    );
    clock.advance(Duration::from_secs(10));
    policy
        .handle()
        .refund_at(&Subject::account("acme"), t0, 1)
        .await
        .unwrap();
    let u = usage_of(&policy, "calls").await;
    assert_eq!((u.used(), u.first_call()), (0, Some(t0)), "after refund_at");
}

/// README (fail open): a request owes "what it costs once its answer is
/// known; nothing if it was not served after all": a deferred cost owes
/// the real cost, a 5xx refunded owes nothing.
#[tokio::test]
async fn a_fail_open_request_owes_what_its_answer_costs() {
    let clock = clock();
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, None);
    store.away.store(true, std::sync::atomic::Ordering::SeqCst);
    let policy = policy(store, &clock)
        .on_store_error(OnStoreError::FailOpen)
        .refund_server_errors(true)
        .build();
    let app = Router::new()
        .route(
            "/",
            get(|request: Request<Body>| async move {
                let used = request.uri().query().unwrap_or("1").to_owned();
                Response::builder()
                    .header("x-tokens-used", used)
                    .body(Body::empty())
                    .unwrap()
            }),
        )
        .route("/fail", get(|| async { StatusCode::INTERNAL_SERVER_ERROR }))
        .layer(
            policy
                .layer(Quota::daily(100).allowance("tokens"))
                .deferred_cost(1, |response| {
                    response
                        .headers
                        .get("x-tokens-used")
                        .and_then(|v| v.to_str().ok()?.parse().ok())
                        .unwrap_or(1)
                }),
        );
    assert_eq!(
        app.clone().oneshot(call("/fail")).await.unwrap().status(),
        500
    );
    assert_eq!(policy.owed().units, 0, "a refunded 5xx owes nothing");
    assert_eq!(
        app.clone().oneshot(call("/?7")).await.unwrap().status(),
        200
    );
    assert_eq!(policy.owed().units, 7);
    assert_eq!(
        app.clone().oneshot(call("/?0")).await.unwrap().status(),
        200
    );
    assert_eq!(policy.owed().units, 7, "a report of 0 costs nothing");
}

/// README: "While an instance holds units, another may refuse the same
/// subject for up to that bound, with `Retry-After: 1` (the idle bound)".
/// Also for a holder whose subject called it steadily for longer than a
/// lease time (10 s), whose first lease mark has ended.
#[tokio::test(start_paused = true)]
async fn a_refusal_while_a_steady_holder_keeps_units_tells_retry_after_the_idle_bound() {
    use tower_quota::store::LeasedStore;
    const LIMIT: u64 = 3_000;
    let clock = clock();
    let shared = MemoryStore::new();
    let app = |store: LeasedStore<MemoryStore>| {
        let policy = policy(store, &clock).build();
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(policy.layer(Quota::daily(LIMIT)))
    };
    let (a_store, b_store) = (
        LeasedStore::new(shared.clone()),
        LeasedStore::new(shared.clone()),
    );
    let (a, b) = (app(a_store.clone()), app(b_store));
    let step = |ms: u64| {
        let clock = clock.clone();
        async move {
            tokio::time::advance(Duration::from_millis(ms)).await;
            clock.advance(Duration::from_millis(ms));
        }
    };
    // The subject calls A every 10 ms for 10.3 s.
    for _ in 0..1_030 {
        let response = a.clone().oneshot(call("/")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        step(10).await;
    }
    // Then B, a little later, until refused (B's own blocks are spent).
    step(100).await;
    let held = a_store.held();
    assert!(held > 0, "A holds units");
    let refused = loop {
        let response = b.clone().oneshot(call("/")).await.unwrap();
        if response.status() != StatusCode::OK {
            break response;
        }
    };
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(a_store.held() > 0, "A still holds units");
    assert_eq!(
        header(&refused, "retry-after"),
        "1",
        "refused while A holds {} units",
        a_store.held()
    );
}
