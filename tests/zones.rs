//! Per-caller time zones: a policy reads each caller's zone, and the
//! caller's calendar quotas turn at the caller's midnight, on counters of
//! that zone, DST days included.

mod demo_server;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, Response, StatusCode};
use tower::ServiceExt;
use tower_quota::jiff::tz::TimeZone;
use tower_quota::jiff::{SignedDuration, Timestamp};
use tower_quota::{
    zone_from_header, FromHeader, InvalidRequest, ManualClock, Quota, QuotaPolicy, QuotaStatus,
    Subject,
};

fn at(s: &str) -> Timestamp {
    s.parse().unwrap()
}

/// A daily quota of 2 per account, each caller's day in the zone its
/// `x-time-zone` header names (absent: UTC).
fn app(clock: &ManualClock) -> (Router, QuotaPolicy<FromHeader>) {
    app_with(clock, Quota::daily(2))
}

/// `quota` per account, each caller's calendar in the zone its
/// `x-time-zone` header names (absent: UTC).
fn app_with(clock: &ManualClock, quota: Quota) -> (Router, QuotaPolicy<FromHeader>) {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock.clone())
        .time_zone(|parts| {
            let Some(value) = parts.headers.get("x-time-zone") else {
                return Ok(None);
            };
            let name = value
                .to_str()
                .map_err(|_| InvalidRequest::new("x-time-zone is not text"))?;
            TimeZone::get(name)
                .map(Some)
                .map_err(|_| InvalidRequest::new(format!("unknown time zone {name:?}")))
        })
        .build();
    let names = |status: QuotaStatus| async move {
        status
            .entries()
            .iter()
            .map(|e| e.key().as_str().to_owned())
            .collect::<Vec<_>>()
            .join(",")
    };
    let app = Router::new()
        .route("/", get(names))
        .layer(policy.layer(quota));
    (app, policy)
}

async fn send(app: &Router, account: &str, zone: Option<&str>) -> Response<Body> {
    let mut request = Request::get("/").header("x-account-id", account);
    if let Some(zone) = zone {
        request = request.header("x-time-zone", zone);
    }
    app.clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap()
}

fn field<'a>(response: &'a Response<Body>, name: &str) -> &'a str {
    response.headers()[name].to_str().unwrap()
}

async fn body(response: Response<Body>) -> String {
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// The caller's day in Berlin on a day of `hours` hours that starts at
/// `start` (UTC): its window, its counter, its reset.
async fn a_berlin_day(start: &str, hours: i64) {
    let start = at(start);
    let clock = ManualClock::new(start + SignedDuration::from_mins(30));
    let (app, _) = app(&clock);
    let berlin = Some("Europe/Berlin");

    let first = send(&app, "acme", berlin).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(
        field(&first, "ratelimit-policy"),
        format!("\"default-day\";q=2;w={}", hours * 3_600)
    );
    let left = hours * 3_600 - 30 * 60;
    assert_eq!(
        field(&first, "ratelimit"),
        format!("\"default-day\";r=1;t={left}")
    );
    assert!(body(first).await.ends_with("[Europe/Berlin]"));
    assert_eq!(send(&app, "acme", berlin).await.status(), StatusCode::OK);
    assert_eq!(
        send(&app, "acme", berlin).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    // A second before the caller's midnight: still the same day.
    clock.set(start + SignedDuration::from_hours(hours) - SignedDuration::from_secs(1));
    let refused = send(&app, "acme", berlin).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "1");
    // The caller's midnight: a fresh day.
    clock.set(start + SignedDuration::from_hours(hours));
    assert_eq!(send(&app, "acme", berlin).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_callers_day_of_23_hours_when_clocks_go_forward() {
    // 2026-03-29 in Berlin: from 00:00 CET (23:00 UTC the day before) to
    // 00:00 CEST (22:00 UTC).
    a_berlin_day("2026-03-28T23:00:00Z", 23).await;
}

#[tokio::test]
async fn a_callers_day_of_25_hours_when_clocks_go_back() {
    // 2026-10-25 in Berlin: from 00:00 CEST (22:00 UTC the day before) to
    // 00:00 CET (23:00 UTC).
    a_berlin_day("2026-10-24T22:00:00Z", 25).await;
}

#[tokio::test]
async fn a_callers_policy_field_follows_the_length_of_each_of_their_days() {
    // One layer through three Berlin days: 24, 23 (clocks go forward on
    // 2026-03-29) and 24 hours. The layer keeps the caller's zone's quotas
    // and the `RateLimit-Policy` values it sent for them: each day's value
    // is its own.
    let clock = ManualClock::new(at("2026-03-28T10:00:00Z"));
    let (app, _) = app(&clock);
    let berlin = Some("Europe/Berlin");
    for (instant, hours) in [
        ("2026-03-28T10:00:00Z", 24),
        ("2026-03-29T10:00:00Z", 23),
        ("2026-03-30T10:00:00Z", 24),
        ("2026-03-29T21:59:59Z", 23),
    ] {
        clock.set(at(instant));
        let response = send(&app, "acme", berlin).await;
        assert_eq!(response.status(), StatusCode::OK, "at {instant}");
        assert_eq!(
            field(&response, "ratelimit-policy"),
            format!("\"default-day\";q=2;w={}", hours * 3_600),
            "at {instant}"
        );
    }
    // A caller in UTC on the same layer meanwhile: a day of 24 hours.
    let utc = send(&app, "other", None).await;
    assert_eq!(
        field(&utc, "ratelimit-policy"),
        "\"default-day\";q=2;w=86400"
    );
}

#[tokio::test]
async fn callers_in_different_zones_turn_at_their_own_midnight() {
    // 23:30 UTC: already the 3rd in Tokyo, still the 2nd in UTC and New
    // York.
    let clock = ManualClock::new(at("2026-12-02T23:30:00Z"));
    let (app, policy) = app(&clock);
    for _ in 0..2 {
        assert_eq!(
            send(&app, "tokyo-co", Some("Asia/Tokyo")).await.status(),
            StatusCode::OK
        );
        assert_eq!(send(&app, "utc-co", None).await.status(), StatusCode::OK);
    }
    let tokyo = send(&app, "tokyo-co", Some("Asia/Tokyo")).await;
    assert_eq!(tokyo.status(), StatusCode::TOO_MANY_REQUESTS);
    // Tokyo's next midnight is 15:00 UTC on the 3rd.
    assert_eq!(
        tokyo.headers()["retry-after"],
        (15 * 3_600 + 30 * 60).to_string()
    );
    let utc = send(&app, "utc-co", None).await;
    assert_eq!(utc.headers()["retry-after"], (30 * 60).to_string());

    // Past UTC midnight: the UTC caller's day turned, Tokyo's did not.
    clock.advance(SignedDuration::from_mins(30));
    assert_eq!(send(&app, "utc-co", None).await.status(), StatusCode::OK);
    assert_eq!(
        send(&app, "tokyo-co", Some("Asia/Tokyo")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    // Support sees the caller's own counter in the caller's zone.
    let tokyo_zone = TimeZone::get("Asia/Tokyo").unwrap();
    let usage = policy
        .handle()
        .in_zone(tokyo_zone.clone())
        .usage(&Subject::account("tokyo-co"))
        .await
        .unwrap();
    assert_eq!(usage[0].used(), 2);
    assert!(usage[0].key().as_str().ends_with(":2026-12-03[Asia/Tokyo]"));
    assert!(
        usage[0].explain_reset().contains("+09:00[Asia/Tokyo]"),
        "{}",
        usage[0].explain_reset()
    );
    // A reset in the caller's zone gives the caller its day back.
    policy
        .handle()
        .in_zone(tokyo_zone)
        .reset(&Subject::account("tokyo-co"))
        .await
        .unwrap();
    assert_eq!(
        send(&app, "tokyo-co", Some("Asia/Tokyo")).await.status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn an_unknown_or_malformed_zone_is_a_400_and_charges_nothing() {
    let clock = ManualClock::new(at("2026-12-02T10:00:00Z"));
    let (app, policy) = app(&clock);
    for zone in [
        "Mars/Olympus_Mons",
        "../../etc/passwd",
        "",
        "Europe/Berlin\u{0}",
        // Files of the system's zone database that are no zone of the IANA
        // list: their rules differ from host to host (`localtime` is each
        // host's own zone), so instances sharing a store would count
        // different days under one name.
        "localtime",
        "posixrules",
        "posix/Asia/Tokyo",
        "right/Asia/Tokyo",
    ] {
        let mut request = Request::get("/").header("x-account-id", "acme");
        if let Ok(value) = http::HeaderValue::from_str(zone) {
            request = request.header("x-time-zone", value);
        } else {
            continue;
        }
        let response = app
            .clone()
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{zone:?}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        assert!(!response.headers().contains_key("ratelimit"));
    }
    let latin1 = Request::get("/")
        .header("x-account-id", "acme")
        .header(
            "x-time-zone",
            http::HeaderValue::from_bytes(b"Europe/Z\xfcrich").unwrap(),
        )
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(latin1).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let usage = policy
        .handle()
        .usage(&Subject::account("acme"))
        .await
        .unwrap();
    assert_eq!(usage[0].used(), 0, "nothing charged");
}

#[test]
#[should_panic(expected = "would count on one counter")]
fn quotas_that_only_their_zones_tell_apart_are_refused_when_callers_name_zones() {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .time_zone(|_| Ok(None))
        .build();
    let _utc = policy.layer(Quota::daily(10));
    let _berlin =
        policy.layer(Quota::daily(20).in_time_zone(TimeZone::get("Europe/Berlin").unwrap()));
}

#[tokio::test]
async fn the_demo_server_reads_the_callers_zone_from_a_header() {
    let server = demo_server::start(&[
        "--limit",
        "2",
        "--period",
        "1d",
        "--tz",
        "America/New_York",
        "--zone-header",
        "x-time-zone",
    ]);
    let call = |headers: &'static [(&'static str, &'static str)]| {
        let addr = server.addr.clone();
        async move { demo_server::call(&addr, "GET", "/read", headers).await }
    };
    let tokyo: &[(&str, &str)] = &[("x-account-id", "acme"), ("x-time-zone", "Asia/Tokyo")];
    let first = call(tokyo).await;
    assert_eq!(first.status, 200);
    let quota = demo_server::call(&server.addr, "GET", "/quota", tokyo).await;
    let json: serde_json::Value = serde_json::from_str(&quota.body).unwrap();
    assert!(
        json["read"]["resets_at"]
            .as_str()
            .unwrap()
            .ends_with("T15:00:00Z"),
        "Tokyo's midnight: {}",
        json["read"]["resets_at"]
    );
    assert_eq!(json["read"]["used"], 1);

    // Absent: --tz, New York's midnight, a counter of its own.
    let new_york =
        demo_server::call(&server.addr, "GET", "/quota", &[("x-account-id", "acme")]).await;
    let json: serde_json::Value = serde_json::from_str(&new_york.body).unwrap();
    assert_eq!(json["read"]["used"], 0);
    let resets_at = json["read"]["resets_at"].as_str().unwrap();
    assert!(
        resets_at.ends_with("T05:00:00Z") || resets_at.ends_with("T04:00:00Z"),
        "New York's midnight: {resets_at}"
    );

    // Unknown, or two zones: 400, a problem document, nothing charged.
    // So are the files of the zone database that name no zone of their own
    // (this server's zone, the POSIX rules, the copies).
    for name in [
        "Mars/Base",
        "localtime",
        "LocalTime",
        "posixrules",
        "PosixRules",
        "posix/Asia/Tokyo",
        "right/Asia/Tokyo",
    ] {
        let headers = vec![("x-account-id", "acme"), ("x-time-zone", name)];
        let headers: &'static [(&str, &str)] = Vec::leak(headers);
        let unknown = call(headers).await;
        assert_eq!(unknown.status, 400, "{name}");
        assert_eq!(
            unknown.header("content-type"),
            Some("application/problem+json")
        );
    }
    let two = call(&[
        ("x-account-id", "acme"),
        ("x-time-zone", "Asia/Tokyo"),
        ("x-time-zone", "Europe/Berlin"),
    ])
    .await;
    assert_eq!(two.status, 400);
    assert_eq!(two.header("content-type"), Some("application/problem+json"));
    let json: serde_json::Value = serde_json::from_str(
        &demo_server::call(&server.addr, "GET", "/quota", tokyo)
            .await
            .body,
    )
    .unwrap();
    assert_eq!(json["read"]["used"], 1);
}

/// A handle in a zone tells a request that names none where it stands in
/// the quotas' own zone, where the layer counted it.
#[tokio::test]
async fn a_handle_in_a_zone_reads_a_request_without_one_in_the_quotas_zone() {
    let clock = ManualClock::new(at("2026-12-02T10:00:00Z"));
    let (app, policy) = app(&clock);
    assert_eq!(send(&app, "acme", None).await.status(), StatusCode::OK);
    let tokyo = policy
        .handle()
        .in_zone(TimeZone::get("Asia/Tokyo").unwrap());
    let (parts, ()) = Request::get("/")
        .header("x-account-id", "acme")
        .body(())
        .unwrap()
        .into_parts();
    let standing = tokyo.standing(&parts).await.unwrap();
    assert_eq!(standing[0].used(), 1);
}

/// The support router's `?zone=` reaches the caller's own counters.
#[tokio::test]
async fn the_support_router_sees_and_resets_a_callers_day_in_their_zone() {
    let clock = ManualClock::new(at("2026-12-02T10:00:00Z"));
    let (app, policy) = app(&clock);
    for _ in 0..2 {
        assert_eq!(
            send(&app, "tokyo-co", Some("Asia/Tokyo")).await.status(),
            StatusCode::OK
        );
    }
    let admin = Router::new().nest("/admin", policy.handle().router());
    let call = |method: &str, uri: &str| {
        Request::builder()
            .method(method)
            .uri(uri)
            .body(Body::empty())
            .unwrap()
    };
    let shown = admin
        .clone()
        .oneshot(call("GET", "/admin/quota/account/tokyo-co?zone=Asia/Tokyo"))
        .await
        .unwrap();
    assert_eq!(shown.status(), StatusCode::OK);
    let json: serde_json::Value = serde_json::from_str(&body(shown).await).unwrap();
    assert_eq!(json["allowances"][0]["used"], 2, "{json}");
    let reset = admin
        .clone()
        .oneshot(call(
            "POST",
            "/admin/reset/account/tokyo-co/default?zone=Asia/Tokyo",
        ))
        .await
        .unwrap();
    assert_eq!(reset.status(), StatusCode::OK);
    assert_eq!(
        send(&app, "tokyo-co", Some("Asia/Tokyo")).await.status(),
        StatusCode::OK
    );

    // A zone the layer refuses is refused here too: its counters are ones
    // no layer writes.
    for zone in ["localtime", "posixrules", "right/Asia/Tokyo", "Mars/Base"] {
        for (method, path) in [
            ("GET", "/admin/quota/account/tokyo-co"),
            ("POST", "/admin/reset/account/tokyo-co/default"),
        ] {
            let refused = admin
                .clone()
                .oneshot(call(method, &format!("{path}?zone={zone}")))
                .await
                .unwrap();
            assert_eq!(refused.status(), StatusCode::BAD_REQUEST, "{method} {zone}");
            assert_eq!(
                refused.headers()["content-type"],
                "application/problem+json"
            );
        }
    }
}

/// `?zone=Etc/GMT+12` written as is (a `+` a query decodes to a space, and
/// the zone's name holds no space) names the zone, as `%2B` does.
#[tokio::test]
async fn the_support_router_reads_a_plus_in_a_zone_written_as_is() {
    let clock = ManualClock::new(at("2026-12-02T10:00:00Z"));
    let (app, policy) = app(&clock);
    for zone in ["Etc/GMT+12", "Etc/GMT-14"] {
        assert_eq!(
            send(&app, "far-co", Some(zone)).await.status(),
            StatusCode::OK
        );
    }
    let admin = Router::new().nest("/admin", policy.handle().router());
    let used = |query: &'static str| {
        let admin = admin.clone();
        async move {
            let uri = format!("/admin/quota/account/far-co?zone={query}");
            let request = Request::get(uri).body(Body::empty()).unwrap();
            let response = admin.oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK, "{query}");
            let json: serde_json::Value = serde_json::from_str(&body(response).await).unwrap();
            json["allowances"][0]["used"].clone()
        }
    };
    assert_eq!(used("Etc/GMT%2B12").await, 1);
    assert_eq!(used("Etc/GMT+12").await, 1);
    assert_eq!(used("Etc/GMT-14").await, 1);
    assert_eq!(used("UTC").await, 0);
}

/// A minute is the same instants in every zone (and an hour in every zone
/// at a whole-hour offset): a caller that names another zone, or another
/// name of its zone, spends the same burst allowance, where a counter per
/// zone name would let it spend one per name.
#[tokio::test]
async fn a_minute_or_a_whole_hour_is_one_counter_whatever_zone_the_caller_names() {
    let clock = ManualClock::new(at("2026-12-02T13:05:10Z"));
    let (minute, _) = app_with(&clock, Quota::per_minute(1));
    let first = send(&minute, "acme", None).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(
        body(first).await,
        "quota:{account:acme}:default:2026-12-02T13:05"
    );
    for zone in [
        "Europe/Berlin",
        "Asia/Tokyo",
        "America/New_York",
        "US/Eastern",
        "Asia/Kolkata",
    ] {
        let response = send(&minute, "acme", Some(zone)).await;
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS, "{zone}");
    }
    // Another account's minute is its own.
    assert_eq!(
        send(&minute, "globex", Some("Asia/Tokyo")).await.status(),
        StatusCode::OK
    );

    let (hour, _) = app_with(&clock, Quota::hourly(1));
    assert_eq!(
        send(&hour, "acme", Some("Europe/Berlin")).await.status(),
        StatusCode::OK
    );
    for zone in ["Asia/Tokyo", "US/Eastern"] {
        let response = send(&hour, "acme", Some(zone)).await;
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS, "{zone}");
    }
    // At +05:30 the hours turn at half past: a window of its own.
    let kolkata = send(&hour, "acme", Some("Asia/Kolkata")).await;
    assert_eq!(kolkata.status(), StatusCode::OK);
    assert_eq!(
        body(kolkata).await,
        "quota:{account:acme}:default:2026-12-02T18+05:30[Asia/Kolkata]"
    );
}

/// A handler that undoes its request gives back what was charged on the
/// caller's own counter (its zone's day), once; neither the quotas' own
/// zone's counter nor a second call changes anything.
#[tokio::test]
async fn a_handler_undoes_its_request_on_the_callers_own_counter() {
    use axum::extract::State;
    use tower_quota::QuotaHandle;

    let clock = ManualClock::new(at("2026-12-02T20:00:00Z"));
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock.clone())
        .time_zone(|parts| {
            Ok(parts
                .headers
                .get("x-time-zone")
                .and_then(|v| v.to_str().ok())
                .and_then(|name| TimeZone::get(name).ok()))
        })
        .build();
    let layer = policy.layer(Quota::daily(1));
    // Undoes its request when asked to, and answers what each of two
    // calls gave back.
    async fn undo(State(handle): State<QuotaHandle>, status: QuotaStatus) -> String {
        let first = handle.refund_request(&status).await.unwrap();
        let again = handle.refund_request(&status).await.unwrap();
        format!("{first:?} {again:?}")
    }
    let app = Router::new()
        .route("/", get(|| async { "served" }))
        .route("/undo", get(undo))
        .with_state(layer.handle())
        .layer(layer);
    let send_to = |path: &'static str, zone: Option<&'static str>| {
        let app = app.clone();
        async move {
            let mut request = Request::get(path).header("x-account-id", "acme");
            if let Some(zone) = zone {
                request = request.header("x-time-zone", zone);
            }
            app.oneshot(request.body(Body::empty()).unwrap())
                .await
                .unwrap()
        }
    };
    // The UTC day: spent.
    assert_eq!(send_to("/", None).await.status(), StatusCode::OK);
    // Tokyo's day (already 2026-12-03 there): charged, then undone.
    let undone = send_to("/undo", Some("Asia/Tokyo")).await;
    assert_eq!(undone.status(), StatusCode::OK);
    assert_eq!(body(undone).await, "[Some(0)] [None]");
    // Tokyo's allowance is whole again; UTC's is still spent.
    assert_eq!(
        send_to("/", Some("Asia/Tokyo")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send_to("/", Some("Asia/Tokyo")).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send_to("/", None).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// Aliases of one zone count on one counter, and what callers are told
/// names the zone by its primary name, whichever alias reached the layer
/// first.
#[tokio::test]
async fn a_refusal_names_the_zone_alike_for_every_alias() {
    let clock = ManualClock::new(at("2026-12-02T20:00:00Z"));
    let (app, _policy) = app_with(&clock, Quota::daily(1));
    assert_eq!(
        send(&app, "beta", Some("US/Eastern")).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        send(&app, "acme", Some("America/New_York")).await.status(),
        StatusCode::OK
    );
    for alias in ["America/New_York", "US/Eastern"] {
        let refused = send(&app, "acme", Some(alias)).await;
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS, "{alias}");
        let text = body(refused).await;
        assert!(text.contains("[America/New_York]"), "{alias}: {text}");
    }
}

/// A support handle in a zone an alias names tells the reset as the layer
/// tells it to a caller who names that alias: in the zone's primary name,
/// on the counter they share.
#[tokio::test]
async fn a_handle_in_an_aliased_zone_names_the_zone_as_the_layer_does() {
    let clock = ManualClock::new(at("2026-12-02T20:00:00Z"));
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock.clone())
        .time_zone(zone_from_header("x-time-zone"))
        .build();
    let told = |status: QuotaStatus| async move { status.entries()[0].explain_reset() };
    let app = Router::new()
        .route("/", get(told))
        .layer(policy.layer(Quota::daily(5)));
    let by_layer = body(send(&app, "acme", Some("US/Eastern")).await).await;
    assert!(by_layer.contains("America/New_York"), "{by_layer}");

    let handle = policy
        .handle()
        .in_zone(TimeZone::get("US/Eastern").unwrap());
    let usage = handle.usage(&Subject::account("acme")).await.unwrap();
    assert_eq!(usage[0].used(), 1, "the same counter");
    assert_eq!(usage[0].explain_reset(), by_layer);
}

/// A handle for a caller whose `caller_info` names its zone by an alias
/// tells the reset as the layer tells that caller: in the zone's primary
/// name, as a handle `in_zone` of the alias does.
#[tokio::test]
async fn a_handle_for_a_caller_in_an_aliased_zone_names_the_zone_as_the_layer_does() {
    let clock = ManualClock::new(at("2026-12-02T20:00:00Z"));
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock.clone())
        .time_zone(zone_from_header("x-time-zone"))
        .caller_info(|_subject| async move {
            Ok(Some(
                tower_quota::CallerInfo::new().zone(TimeZone::get("US/Eastern")?),
            ))
        })
        .build();
    let told = |status: QuotaStatus| async move { status.entries()[0].explain_reset() };
    let app = Router::new()
        .route("/", get(told))
        .layer(policy.layer(Quota::daily(5)));
    let by_layer = body(send(&app, "acme", Some("US/Eastern")).await).await;
    assert!(by_layer.contains("America/New_York"), "{by_layer}");

    let acme = Subject::account("acme");
    let handle = policy.handle().for_caller(&acme).await.unwrap();
    assert_eq!(
        handle.zone().and_then(|zone| zone.iana_name()),
        Some("America/New_York")
    );
    let usage = handle.usage(&acme).await.unwrap();
    assert_eq!(usage[0].used(), 1, "the same counter");
    assert_eq!(usage[0].explain_reset(), by_layer);

    // The support router, which asks the caller info for the zone.
    let admin = policy.handle().router::<()>();
    let response = admin
        .oneshot(
            Request::get("/quota/account/acme")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let shown: serde_json::Value = serde_json::from_str(&body(response).await).unwrap();
    assert_eq!(shown["allowances"][0]["reset"], by_layer.as_str());
}

/// `zone_from_header` reads an IANA name, its aliases as it; no header is
/// the quotas' own zone; a header sent twice, a name of no IANA zone, a
/// file of the database that is none, bytes that are not text, or a name
/// too long to be one, are 400 problem documents that charge nothing.
#[tokio::test]
async fn a_zone_read_from_a_header_counts_its_aliases_as_it_and_refuses_the_rest() {
    let clock = ManualClock::new(at("2026-12-02T16:00:00Z"));
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock.clone())
        .time_zone(zone_from_header("X-Account-Zone"))
        .build();
    let app = Router::new()
        .route(
            "/",
            get(|status: QuotaStatus| async move { status.entries()[0].key().to_string() }),
        )
        .layer(policy.layer(Quota::daily(10)));
    let ask = |zones: Vec<&'static [u8]>| {
        let app = app.clone();
        async move {
            let mut request = Request::get("/").header("x-account-id", "acme");
            for zone in zones {
                request = request.header("x-account-zone", zone);
            }
            app.oneshot(request.body(Body::empty()).unwrap())
                .await
                .unwrap()
        }
    };
    // 16:00 UTC is 01:00 on the 3rd in Tokyo.
    let tokyo = body(ask(vec![b"Asia/Tokyo"]).await).await;
    assert!(
        tokyo.contains("2026-12-03") && tokyo.contains("Asia/Tokyo"),
        "{tokyo}"
    );
    assert_eq!(body(ask(vec![b"Japan"]).await).await, tokyo);
    let utc = body(ask(vec![]).await).await;
    assert!(
        utc.contains("2026-12-02") && !utc.contains("Tokyo"),
        "{utc}"
    );

    let long = "Asia/".repeat(20).into_bytes().leak() as &'static [u8];
    for zones in [
        vec![b"Asia/Tokyo" as &[u8], b"Europe/Berlin"],
        vec![b"Mars/Base"],
        vec![b"localtime"],
        vec![b"posixrules"],
        vec![b"EST5EDT,M3.2.0,M11.1.0"],
        vec![b""],
        vec![b"Asia/T\xF6kyo"],
        vec![long],
    ] {
        let response = ask(zones.clone()).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{zones:?}");
        assert_eq!(field(&response, "content-type"), "application/problem+json");
        let detail = body(response).await;
        assert!(detail.contains("x-account-zone"), "{detail}");
    }
    let used = policy
        .handle()
        .in_zone(TimeZone::get("Asia/Tokyo").unwrap())
        .usage(&Subject::account("acme"))
        .await
        .unwrap()[0]
        .used();
    assert_eq!(used, 2, "the refusals charged nothing");
}
