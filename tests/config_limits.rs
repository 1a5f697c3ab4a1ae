//! Settings at the edges of their ranges: each is refused when it is made,
//! or works; a request never panics.

use std::time::Duration;

#[allow(dead_code)]
mod rigged;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use tower::ServiceExt;
use tower_quota::jiff::Timestamp;
use tower_quota::{
    Clock, FromHeader, LeasedStore, MemoryStore, Period, Quota, QuotaLayer, QuotaPolicy, Store,
};

fn at(s: &str) -> Timestamp {
    s.parse().unwrap()
}

/// A clock stopped at any instant jiff holds (a `ManualClock` covers the
/// years 1678 to 2262 only).
#[derive(Clone, Copy)]
struct Stopped(Timestamp);

impl Clock for Stopped {
    fn now(&self) -> Timestamp {
        self.0
    }
}

fn account() -> FromHeader {
    FromHeader::account("x-account-id")
}

fn app<St: Store>(layer: QuotaLayer<FromHeader, St>) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

/// The status of one request, or the message of the panic it caused.
async fn status(app: &Router) -> Result<StatusCode, String> {
    let request = Request::get("/")
        .header("x-account-id", "acme")
        .body(Body::empty())
        .unwrap();
    let app = app.clone();
    match tokio::spawn(async move { app.oneshot(request).await.unwrap() }).await {
        Ok(response) => Ok(response.status()),
        Err(error) => {
            let panic = error.into_panic();
            Err(panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default())
        }
    }
}

/// A clock near the ends of the range of instants jiff holds: the memory
/// store counts no such instant, so the request is answered as a store
/// failure (503 under the default fail closed), never with a panic.
#[tokio::test]
async fn a_clock_at_the_ends_of_time_is_answered_never_a_panic() {
    for (now, quota) in [
        ("9999-12-30T12:00:00Z", Quota::daily(10)),
        ("9999-12-28T12:00:00Z", Quota::weekly(10)),
        ("9999-12-15T12:00:00Z", Quota::monthly(10)),
        ("9999-12-30T22:00:00Z", Quota::hourly(10)),
        ("9999-12-30T22:00:00Z", Quota::per_minute(10)),
        (
            "9999-12-30T12:00:00Z",
            Quota::rolling(10, Duration::from_secs(86_400)),
        ),
        (
            "9950-01-01T00:00:00Z",
            Quota::rolling(10, Duration::from_secs(100 * 31_557_600)),
        ),
        ("-009999-01-02T02:00:00Z", Quota::daily(10)),
        ("-009999-01-02T02:00:00Z", Quota::weekly(10)),
        ("-009999-01-02T02:00:00Z", Quota::monthly(10)),
    ] {
        let name = quota.name().to_owned();
        let policy = QuotaPolicy::builder(account())
            .clock(Stopped(at(now)))
            .build();
        let app = app(policy.layer(quota));
        assert_eq!(
            status(&app).await,
            Ok(StatusCode::SERVICE_UNAVAILABLE),
            "{name} at {now}"
        );
    }
}

/// A calendar window that would end past the last instant jiff holds is
/// cut there, as a fixed window is.
#[test]
fn a_calendar_window_at_the_end_of_time_is_cut_there() {
    let window = Period::day().window(at("9999-12-30T12:00:00Z"));
    assert_eq!(window.stamp(), "9999-12-30");
    assert_eq!(window.start(), at("9999-12-30T00:00:00Z"));
    assert_eq!(window.end(), Timestamp::MAX);
    let window = Period::month().window(at("-009999-01-02T02:00:00Z"));
    assert_eq!(window.stamp(), "-9999-01");
    assert_eq!(window.start(), Timestamp::MIN);
    assert_eq!(window.end(), at("-009999-02-01T00:00:00Z"));
}

/// A lease time so long that a lease's mark would outlive every instant
/// the store counts fails every charge: refused when the store is made.
#[test]
#[should_panic(expected = "lease time")]
fn a_lease_time_of_centuries_is_refused_when_made() {
    let _ = LeasedStore::builder(MemoryStore::new()).lease_time(Duration::MAX);
}

/// A memory store that may hold no counter fails every charge: refused
/// when it is made.
#[test]
#[should_panic(expected = "at least one counter")]
fn a_memory_store_of_no_counters_is_refused_when_made() {
    let _ = MemoryStore::new().max_counters(0);
}

/// A Redis store whose wait for room is `Duration::MAX` (no bound of its
/// own: the whole budget) waits within its budget: a request on a server
/// that does not answer is a 503, never a panic.
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_redis_wait_timeout_of_duration_max_is_the_whole_budget() {
    use tower_quota::store::RedisStore;

    // Nothing listens on port 1.
    let store = RedisStore::builder("redis://127.0.0.1:1/")
        .wait_timeout(Duration::MAX)
        .build()
        .unwrap();
    let policy = QuotaPolicy::builder(account()).store(store).build();
    let app = app(policy.layer(Quota::daily(3)));
    assert_eq!(status(&app).await, Ok(StatusCode::SERVICE_UNAVAILABLE));
}

/// The one-liners panic, where they do, as their docs say: a rolling
/// period past 100 years, and a quota naming a plan in a layer that is a
/// policy of its own (which reads no plan).
#[test]
#[should_panic(expected = "from one second to 100 years")]
fn a_rolling_layer_of_centuries_is_refused_when_made() {
    let _ = QuotaLayer::rolling(1, Duration::from_secs(101 * 31_557_600), account());
}

#[test]
#[should_panic(expected = "the policy reads no plan")]
fn a_layer_of_its_own_with_a_plan_is_refused_when_made() {
    let _ = QuotaLayer::new(Quota::daily(10).plan("pro", 100), account());
}

#[test]
#[should_panic(expected = "declared plans")]
fn a_quota_naming_an_undeclared_plan_is_refused_when_its_layer_is_made() {
    let policy = QuotaPolicy::builder(account())
        .plan(|_| None)
        .plans(["free"])
        .build();
    let _ = policy.layer(Quota::daily(10).plan("pro", 100));
}

#[test]
#[should_panic(expected = "one reading each caller's time zone and the other not")]
fn a_quota_shared_by_a_zoned_and_an_unzoned_policy_is_refused() {
    let store = MemoryStore::new();
    let plain = QuotaPolicy::builder(account()).store(store.clone()).build();
    let zoned = QuotaPolicy::builder(account())
        .store(store)
        .time_zone(|_| Ok(None))
        .build();
    let _a = plain.layer(Quota::daily(10));
    let _b = zoned.layer(Quota::daily(10));
}

/// A `ManualClock` takes what an `i64` of nanoseconds holds, as its docs
/// say: 1677-09-21 is in, 2262-04-12 is out, through `new` and `set`.
#[test]
fn a_manual_clock_takes_the_range_its_docs_name() {
    use tower_quota::ManualClock;
    let first = at("1677-09-21T00:12:43.145224192Z");
    let last = at("2262-04-11T23:47:16.854775807Z");
    let clock = ManualClock::new(first);
    assert_eq!(clock.now(), first);
    clock.set(last);
    assert_eq!(clock.now(), last);
    let out = |f: fn()| std::panic::catch_unwind(f).is_err();
    assert!(out(|| {
        let _ = ManualClock::new(at("2262-04-12T00:00:00Z"));
    }));
    assert!(out(|| {
        ManualClock::new(at("2026-01-01T00:00:00Z")).set(at("1677-09-21T00:00:00Z"));
    }));
}

/// A store that counts up to 1 000 exactly takes a quota (and a plan's
/// limit) of 1 000, and refuses 1 001 when the layer is made, never during
/// a request.
#[test]
fn a_limit_up_to_what_the_store_counts_is_taken() {
    let mut store = rigged::Rigged::new(MemoryStore::new(), rigged::Rig::Fail, Some("none"));
    store.max = Some(1_000);
    let policy = QuotaPolicy::builder(account())
        .plan(|_| None)
        .store(store)
        .build();
    let _ = policy.layer(Quota::daily(1_000).plan("pro", 1_000));
    // The memory store counts all of a u64.
    let _ = QuotaLayer::daily(u64::MAX, account());
}

#[test]
#[should_panic(expected = "more than its store counts exactly (1000)")]
fn a_limit_past_what_the_store_counts_is_refused_when_made() {
    let mut store = rigged::Rigged::new(MemoryStore::new(), rigged::Rig::Fail, Some("none"));
    store.max = Some(1_000);
    let policy = QuotaPolicy::builder(account()).store(store).build();
    let _ = policy.layer(Quota::daily(1_001));
}

#[test]
#[should_panic(expected = "more than its store counts exactly (1000)")]
fn a_plan_limit_past_what_the_store_counts_is_refused_when_made() {
    let mut store = rigged::Rigged::new(MemoryStore::new(), rigged::Rig::Fail, Some("none"));
    store.max = Some(1_000);
    let policy = QuotaPolicy::builder(account())
        .plan(|_| None)
        .store(store)
        .build();
    let _ = policy.layer(Quota::daily(10).plan("pro", 1_001));
}

/// A server error is an answer a request without a subject may get.
#[test]
fn a_subject_rejection_with_a_server_error_is_taken() {
    let _ = QuotaPolicy::builder(account())
        .on_missing_subject(tower_quota::SubjectPolicy::Reject(
            StatusCode::SERVICE_UNAVAILABLE,
        ))
        .build();
}

/// Names and tags travel in response fields: DEL, an empty name or an
/// empty plan are refused when the quota is made.
#[test]
#[should_panic(expected = "an allowance tag is non-empty printable ASCII")]
fn an_allowance_tag_with_del_is_refused() {
    let _ = Quota::daily(1).allowance("read\u{7f}");
}

#[test]
#[should_panic(expected = "a quota name is non-empty printable ASCII")]
fn an_empty_quota_name_is_refused() {
    let _ = Quota::daily(1).named("");
}

#[test]
#[should_panic(expected = "a plan name is not empty")]
fn an_empty_plan_name_is_refused() {
    let _ = Quota::daily(1).plan("", 10);
}
