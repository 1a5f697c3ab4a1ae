//! What is given back, and when: a counter charged once per request across
//! policies, drops with and without a runtime, timeouts around and between
//! layers, and mistakes refused when a layer is made.

mod rigged;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use http::{Request, Response, StatusCode};
use rigged::{Rig, Rigged};
use tower::ServiceExt;
use tower_quota::{
    FromHeader, ManualClock, MemoryStore, OnStoreError, Quota, QuotaPolicy, QuotaPolicyBuilder,
    QuotaUsage, Store, Subject,
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

fn policy<St: Store>(store: St, namespace: &str) -> QuotaPolicyBuilder<FromHeader, St> {
    QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .namespace(namespace)
        .clock(ManualClock::new(NOW.parse().unwrap()))
}

/// Where acme stands on the quota `name`.
async fn usage_of<St: Store>(policy: &QuotaPolicy<FromHeader, St>, name: &str) -> QuotaUsage {
    let usage = policy
        .handle()
        .usage(&Subject::account("acme"))
        .await
        .unwrap();
    usage.into_iter().find(|u| u.name() == name).unwrap()
}

async fn used<St: Store>(policy: &QuotaPolicy<FromHeader, St>, name: &str) -> u64 {
    usage_of(policy, name).await.used()
}

async fn settles<St: Store>(
    policy: &QuotaPolicy<FromHeader, St>,
    name: &str,
    expected: u64,
) -> u64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        let now = used(policy, name).await;
        if now == expected || tokio::time::Instant::now() > deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn ok() -> &'static str {
    "ok"
}

/// Two policies on one store and namespace with the same quota: one budget,
/// and a request through both counts once.
#[tokio::test]
async fn the_same_quota_of_two_policies_on_one_store_counts_once() {
    let store = MemoryStore::new();
    let a = policy(store.clone(), "quota").build();
    let b = policy(store, "quota").build();
    let app = Router::new()
        .route("/", get(ok))
        .route_layer(b.layer(Quota::daily(10)))
        .route_layer(a.layer(Quota::daily(10)));
    let response = app.oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        header(&response, "ratelimit"),
        "\"default-day\";r=9;t=50400"
    );
    assert_eq!(used(&a, "default-day").await, 1, "one admission");
}

/// Each policy charges at its own instant: a middleware between the two
/// policies' layers that takes the request past midnight leaves the inner
/// policy in the next day. The quota they share still counts the request
/// once, on the day the outer policy charged it, not once on each day.
#[tokio::test]
async fn the_same_quota_of_two_policies_counts_once_across_midnight() {
    use axum::extract::Request as AxumRequest;
    use axum::middleware::{from_fn, Next};
    use tower_quota::QuotaStatus;

    let clock = ManualClock::new("2026-12-02T23:59:59Z".parse().unwrap());
    let store = MemoryStore::new();
    let policy = || {
        QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store.clone())
            .namespace("quota")
            .clock(clock.clone())
            .build()
    };
    let (a, b) = (policy(), policy());
    let slow = clock.clone();
    async fn entries(status: QuotaStatus) -> String {
        let entries = status.entries();
        let names: Vec<_> = entries.iter().map(|e| e.key().as_str()).collect();
        names.join(" ")
    }
    let app = Router::new()
        .route("/", get(entries))
        .route_layer(b.layer(Quota::daily(10)))
        // An authentication call, say, that takes two seconds.
        .route_layer(from_fn(move |request: AxumRequest, next: Next| {
            let clock = slow.clone();
            async move {
                clock.advance(Duration::from_secs(2));
                next.run(request).await
            }
        }))
        .route_layer(a.layer(Quota::daily(10)));
    let response = app.oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        header(&response, "ratelimit"),
        "\"default-day\";r=9;t=0",
        "one member: the day the request was charged in"
    );
    let body = axum::body::to_bytes(response.into_body(), 1 << 16)
        .await
        .unwrap();
    let keys = String::from_utf8(body.to_vec()).unwrap();
    assert!(
        keys.ends_with(":default:2026-12-02") && !keys.contains(' '),
        "charged once, on 2 December: {keys}"
    );
    assert_eq!(
        used(&b, "default-day").await,
        0,
        "nothing charged on 3 December"
    );
}

/// The same quota in two policies on one store, one reading each caller's
/// zone and the other not, would count a caller on two counters (the
/// caller's day and the quota's): refused where the second layer is made.
#[test]
#[should_panic(expected = "one reading each caller's time zone and the other not")]
fn the_same_quota_of_two_policies_keyed_in_different_zones_is_refused() {
    let store = MemoryStore::new();
    let zoned = policy(store.clone(), "quota")
        .time_zone(|_| Ok(None))
        .build();
    let plain = policy(store, "quota").build();
    let _a = zoned.layer(Quota::daily(10));
    let _b = plain.layer(Quota::daily(10));
}

/// A policy whose store fails further in lets the request through (fail
/// open); dropped later while another policy's store stalls, the request
/// gets its outer charge back: it was never answered.
#[tokio::test]
async fn a_drop_after_a_fail_open_inside_gives_the_outer_charge_back() {
    let store = MemoryStore::new();
    let account = policy(
        Rigged::new(store.clone(), Rig::Fail, Some("search")),
        "account",
    )
    .on_store_error(OnStoreError::FailOpen)
    .build();
    let stalled = Rigged::new(store, Rig::Stall, None);
    let met = Arc::clone(&stalled.met);
    let partner = policy(stalled, "partner").store_timeout(None).build();
    let app = Router::new()
        .route("/search", get(ok))
        .route_layer(partner.layer(Quota::per_minute(5).allowance("burst")))
        .route_layer(account.layer(Quota::per_minute(5).allowance("search")))
        .route_layer(account.layer(Quota::daily(10).allowance("read")));
    let pending = tokio::spawn(app.clone().oneshot(call("/search")));
    met.notified().await;
    pending.abort();
    assert!(pending.await.unwrap_err().is_cancelled());
    assert_eq!(settles(&account, "read-day", 0).await, 0, "never admitted");
}

/// A request dropped while a store stalls, outside a tokio runtime: a
/// store that answers at once takes the give-back at once.
#[test]
fn a_drop_outside_a_runtime_gives_back_at_once() {
    let store = MemoryStore::new();
    let account = policy(store.clone(), "account").build();
    let partner = policy(Rigged::new(store, Rig::Stall, None), "partner")
        .store_timeout(None)
        .build();
    let app = Router::new()
        .route("/", get(ok))
        .route_layer(partner.layer(Quota::per_minute(5).allowance("burst")))
        .route_layer(account.layer(Quota::daily(10).allowance("read")));
    let mut future = Box::pin(app.oneshot(call("/")));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(future.as_mut().poll(&mut cx).is_pending());
    drop(future);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        assert_eq!(settles(&account, "read-day", 0).await, 0, "never admitted");
    });
}

/// A timeout between two layers (a 408, as tower-http's timeout answers):
/// the inner layer, dropped while it waits for its store, charged nothing;
/// the outer layer got an answer, and its charge stays, as for any timeout
/// inside the layers.
#[tokio::test]
async fn a_timeout_between_layers_keeps_the_outer_charge() {
    let store = MemoryStore::new();
    let account = policy(store.clone(), "account").build();
    let partner = policy(Rigged::new(store, Rig::Stall, None), "partner")
        .store_timeout(None)
        .build();
    let timeout = axum::middleware::from_fn(
        |request: axum::extract::Request, next: axum::middleware::Next| async move {
            match tokio::time::timeout(Duration::from_millis(50), next.run(request)).await {
                Ok(response) => response,
                Err(_) => StatusCode::REQUEST_TIMEOUT.into_response(),
            }
        },
    );
    let app = Router::new()
        .route("/", get(ok))
        .route_layer(partner.layer(Quota::per_minute(5).allowance("burst")))
        .route_layer(timeout)
        .route_layer(account.layer(Quota::daily(10).allowance("read")));
    let response = app.oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::REQUEST_TIMEOUT);
    assert_eq!(used(&account, "read-day").await, 1);
    assert_eq!(header(&response, "ratelimit"), "\"read-day\";r=9;t=50400");
}

/// The fields of a response whose deferred cost the store applied before it
/// went out tell the counter as the store answered, with what others
/// charged on it while the handler ran: not as the layer reckons from its
/// own charge.
#[tokio::test]
async fn the_fields_after_a_deferred_cost_are_as_the_store_answered() {
    let policy = policy(MemoryStore::new(), "settled").build();
    // Another request charged on the same counter while the handler runs.
    let other: Router = Router::new()
        .route("/other", get(ok))
        .route_layer(policy.layer(Quota::daily(100).allowance("tokens")));
    let handler = move || {
        let other = other.clone();
        async move {
            let response = other.oneshot(call("/other")).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            Response::builder()
                .header("x-tokens", "5")
                .body(Body::empty())
                .unwrap()
        }
    };
    let tokens = |response: &http::response::Parts| {
        response.headers["x-tokens"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap()
    };
    let app = Router::new().route("/", get(handler)).layer(
        policy
            .layer(Quota::daily(100).allowance("tokens"))
            .deferred_cost(1, tokens),
    );
    let response = app.oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(used(&policy, "tokens-day").await, 6, "5 and the other's 1");
    assert_eq!(
        header(&response, "ratelimit"),
        "\"tokens-day\";r=94;t=50400"
    );
}

/// A fixed cost the store cannot count exactly is refused when the layer
/// is made.
#[test]
#[should_panic(expected = "more than the layer's store counts exactly")]
fn a_fixed_cost_past_max_count_is_refused_when_the_layer_is_made() {
    let mut store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("never"));
    store.max = Some(100);
    let p = policy(store, "cost").build();
    let _layer = p.layer(Quota::daily(100)).cost(1_000);
}

/// A deferred cost of nothing up front would never count (its real cost
/// goes only to counters the request was charged on): refused when the
/// layer is made.
#[test]
#[should_panic(expected = "a deferred cost of 0 up front would never count")]
fn a_deferred_cost_of_nothing_up_front_is_refused_when_the_layer_is_made() {
    let p = policy(MemoryStore::new(), "deferred").build();
    let _layer = p.layer(Quota::daily(3)).deferred_cost(0, |_| 5);
}

/// A shadow quota and an enforced one on one counter are two different
/// quotas: refused when the second layer is made.
#[test]
fn a_shadow_and_an_enforced_quota_on_one_counter_are_refused() {
    let p = policy(MemoryStore::new(), "shadow").build();
    let _a = p.layer(Quota::daily(10));
    let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        p.layer(Quota::daily(10).shadow())
    }));
    assert!(made.is_err(), "two different quotas on one counter");
}

/// A timeout around the quota layer (the request's future dropped while the
/// handler works): the request was not served, and spends nothing.
#[tokio::test]
async fn a_timeout_around_the_layer_gives_the_charge_back() {
    let account = policy(MemoryStore::new(), "slow").build();
    let app = Router::new()
        .route(
            "/",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                "late"
            }),
        )
        .route_layer(account.layer(Quota::daily(10).allowance("read")));
    let timed_out = tokio::time::timeout(Duration::from_millis(50), app.oneshot(call("/"))).await;
    assert!(timed_out.is_err());
    assert_eq!(settles(&account, "read-day", 0).await, 0, "not served");
}

/// A sub-request given the request's status, dropped while a layer of
/// another policy waits for its store: the request, served, stays charged.
#[tokio::test]
async fn a_dropped_sub_request_leaves_the_served_request_charged() {
    let store = MemoryStore::new();
    let account = policy(store.clone(), "account").build();
    let partner = policy(Rigged::new(store, Rig::Stall, None), "partner")
        .store_timeout(None)
        .build();
    let backend: Router = Router::new()
        .route("/sub", get(ok))
        .route_layer(partner.layer(Quota::per_minute(5).allowance("burst")));
    let app = Router::new()
        .route(
            "/",
            get(move |status: tower_quota::QuotaStatus| {
                let backend = backend.clone();
                async move {
                    let mut sub = Request::get("/sub")
                        .header("x-account-id", "acme")
                        .body(Body::empty())
                        .unwrap();
                    sub.extensions_mut().insert(status);
                    let sub = backend.oneshot(sub);
                    let _ = tokio::time::timeout(Duration::from_millis(20), sub).await;
                    "served"
                }
            }),
        )
        .route_layer(account.layer(Quota::daily(10).allowance("read")));
    let response = app.oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        used(&account, "read-day").await,
        1,
        "a served request is counted"
    );
}

/// A store that charges but answers without the usage of the lines (it
/// breaks the contract: one entry per line) gets its request served, with
/// the fields the layer can tell: never a panic in the response.
#[tokio::test]
async fn a_store_answering_without_usage_never_panics_the_response() {
    let account = policy(
        Rigged::new(MemoryStore::new(), Rig::ShortUsage, None),
        "account",
    )
    .build();
    let app = Router::new()
        .route("/search", get(ok))
        .route_layer(account.layer(Quota::daily(10).allowance("read")));
    let response = app.oneshot(call("/search")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}

/// A give-back the store does not answer holds the response no longer than
/// the store's timeout: it goes out with the fields as the give-back, which
/// carries on in its task, will leave the counter.
#[tokio::test(start_paused = true)]
async fn a_give_back_the_store_does_not_answer_delays_the_response_by_the_store_timeout_at_most() {
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("nothing"));
    let stalled = Arc::clone(&store.stalled);
    let policy = policy(store, "stalled")
        .refund_server_errors(true)
        .store_timeout(Some(Duration::from_millis(100)))
        .build();
    let app = Router::new()
        .route(
            "/",
            get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "failed") }),
        )
        .layer(policy.layer(Quota::daily(10)));
    stalled.store(true, std::sync::atomic::Ordering::Relaxed);
    let started = tokio::time::Instant::now();
    let response = tokio::time::timeout(Duration::from_secs(5), app.oneshot(call("/")))
        .await
        .expect("the response comes within the store's timeout")
        .unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(started.elapsed() <= Duration::from_millis(150));
    assert_eq!(
        header(&response, "ratelimit"),
        "\"default-day\";r=10;t=50400"
    );
}

/// A give-back the store never sent (it was away) is sent again once it is
/// back: a request refused further in leaves nothing charged further out.
#[tokio::test]
async fn a_give_back_the_store_never_sent_is_sent_again_when_it_is_back() {
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("inner"));
    let unsent = Arc::clone(&store.unsent);
    let policy = policy(store, "unsent")
        .on_store_error(OnStoreError::FailClosed {
            retry_after: Duration::from_secs(1),
        })
        .build();
    let app = Router::new()
        .route("/", get(ok))
        .route_layer(policy.layer(Quota::daily(10).allowance("inner")))
        .layer(policy.layer(Quota::daily(10).allowance("outer")));
    unsent.store(true, std::sync::atomic::Ordering::Relaxed);
    let response = app.oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(used(&policy, "outer-day").await, 1, "not given back yet");
    unsent.store(false, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(settles(&policy, "outer-day", 0).await, 0);
}

/// Serves `/slow` (answering `slow` once released) through `layer` while
/// support resets the subject and its next request, `after` later (earlier
/// when negative: an instance whose clock is behind, a request that
/// waited), makes the counter anew; checks that the new counter holds that
/// request's own charge only once `/slow` answered.
async fn served_across_a_reset<R>(
    policy: &QuotaPolicy<FromHeader>,
    clock: &ManualClock,
    layer: tower_quota::QuotaLayer<FromHeader>,
    slow: R,
    after: tower_quota::jiff::SignedDuration,
) where
    R: axum::response::IntoResponse + Clone + Send + Sync + 'static,
{
    let release = Arc::new(tokio::sync::Notify::new());
    let app = Router::new()
        .route(
            "/slow",
            get({
                let release = Arc::clone(&release);
                move || async move {
                    release.notified().await;
                    slow
                }
            }),
        )
        .route("/", get(ok))
        .layer(layer);
    let pending = tokio::spawn(app.clone().oneshot(call("/slow")));
    while used(policy, "default-day").await == 0 {
        tokio::task::yield_now().await;
    }
    policy
        .handle()
        .reset(&Subject::account("acme"))
        .await
        .unwrap();
    clock.advance(after);
    let response = app.clone().oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(used(policy, "default-day").await, 1);
    release.notify_one();
    pending.await.unwrap().unwrap();
    assert_eq!(
        used(policy, "default-day").await,
        1,
        "the new counter's own charge, nothing of the request charged before the reset"
    );
}

/// A request's charge goes back to the counter it was charged to only: a
/// support reset while it was served, and a charge that made the counter
/// anew (after the request, or before it by a clock behind), leave the new
/// counter as it is when the request fails.
#[tokio::test]
async fn a_give_back_after_a_reset_leaves_the_new_counter_alone() {
    let clock = ManualClock::new(NOW.parse().unwrap());
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock.clone())
        .refund_server_errors(true)
        .build();
    let layer = policy.layer(Quota::daily(10));
    for after in [1, -1] {
        let after = tower_quota::jiff::SignedDuration::from_secs(after);
        let slow = StatusCode::INTERNAL_SERVER_ERROR;
        served_across_a_reset(&policy, &clock, layer.clone(), slow, after).await;
        policy
            .handle()
            .reset(&Subject::account("acme"))
            .await
            .unwrap();
    }
}

/// A deferred cost's rest goes to the counter the request was charged to
/// only: a support reset while it was served, and a charge that made the
/// counter anew, leave the new counter as it is when the cost is known (50
/// here, where the new counter's request cost 1), whether that charge was
/// made after the request or, by a clock behind, before it.
#[tokio::test]
async fn a_deferred_cost_after_a_reset_leaves_the_new_counter_alone() {
    let clock = ManualClock::new(NOW.parse().unwrap());
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .clock(clock.clone())
        .build();
    let layer = policy
        .layer(Quota::daily(100))
        .deferred_cost(1, |response| {
            response
                .headers
                .get("x-cost")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(1)
        });
    for after in [1, -1] {
        let after = tower_quota::jiff::SignedDuration::from_secs(after);
        served_across_a_reset(&policy, &clock, layer.clone(), [("x-cost", "50")], after).await;
        policy
            .handle()
            .reset(&Subject::account("acme"))
            .await
            .unwrap();
    }
}

/// An inner service whose `call` panics.
#[derive(Clone)]
struct Panics;

impl tower::Service<Request<Body>> for Panics {
    type Response = Response<Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Response<Body>, std::convert::Infallible>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<Body>) -> Self::Future {
        panic!("the inner service panics in call");
    }
}

/// A request whose inner service panics in `call` (caught further out)
/// was never served: its charge goes back.
#[tokio::test]
async fn a_panic_in_the_inner_call_gives_the_charge_back() {
    let policy = policy(MemoryStore::new(), "quota").build();
    let mut service = tower::Layer::layer(&policy.layer(Quota::daily(10)), Panics);
    tower::ServiceExt::ready(&mut service).await.unwrap();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        tower::Service::call(&mut service, call("/"))
    }));
    assert!(caught.is_err());
    assert_eq!(used(&policy, "default-day").await, 0);
}

/// A deferred cost that panics (a header it unwraps is missing) takes the
/// response down: the request does not go out, and its charge goes back.
#[tokio::test]
async fn a_deferred_cost_that_panics_leaves_nothing_charged() {
    let policy = policy(MemoryStore::new(), "panics").build();
    let app = Router::new().route("/", get(ok)).layer(
        policy
            .layer(Quota::daily(10))
            .deferred_cost(1, |_| panic!("no cost header")),
    );
    let served = tokio::spawn(app.oneshot(call("/")));
    assert!(served.await.unwrap_err().is_panic());
    assert_eq!(settles(&policy, "default-day", 0).await, 0);
}

/// The same in a layer that owes its charge (its store failed, fail open):
/// the response does not go out, so the layers further in, which charged
/// the request, give their charges back.
#[tokio::test]
async fn a_deferred_cost_that_panics_in_an_owing_layer_gives_inner_charges_back() {
    let outer = policy(
        Rigged::new(MemoryStore::new(), Rig::Fail, Some("big")),
        "outer",
    )
    .on_store_error(OnStoreError::FailOpen)
    .build();
    let inner = policy(MemoryStore::new(), "inner").build();
    let app = Router::new()
        .route("/", get(ok))
        .route_layer(inner.layer(Quota::daily(10).allowance("read")))
        .layer(
            outer
                .layer(Quota::daily(100).allowance("big"))
                .deferred_cost(1, |_| panic!("no cost header")),
        );
    let served = tokio::spawn(app.oneshot(call("/")));
    assert!(served.await.unwrap_err().is_panic());
    assert_eq!(settles(&inner, "read-day", 0).await, 0, "not served");
}

/// A deferred cost's add the store never sent is sent again only within
/// its counter's period: past it, a counter with the same key (a first-use
/// one made anew) is another period's, which the request never spent.
#[tokio::test(start_paused = true)]
async fn an_add_never_sent_is_not_sent_again_into_the_next_period() {
    let clock = ManualClock::new(NOW.parse().unwrap());
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("none"));
    let unsent = Arc::clone(&store.unsent);
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .clock(clock.clone())
        .build();
    let quota = Quota::per_minute(100).anchored(tower_quota::Anchor::FirstUse);
    let name = quota.name().to_owned();
    let app = Router::new()
        .route("/", get(ok))
        .layer(policy.layer(quota).deferred_cost(1, |_| 3));
    unsent.store(true, std::sync::atomic::Ordering::Relaxed);
    let response = app.clone().oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    // The store away for the whole period: the add of 2 is never sent.
    let step = |seconds: u64| {
        let clock = clock.clone();
        async move {
            for _ in 0..seconds * 10 {
                tokio::time::advance(Duration::from_millis(100)).await;
                clock.advance(tower_quota::jiff::SignedDuration::from_millis(100));
                tokio::task::yield_now().await;
            }
        }
    };
    step(58).await;
    unsent.store(false, std::sync::atomic::Ordering::Relaxed);
    step(3).await;
    // A new period: its first request makes the counter anew.
    let response = app.oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    step(5).await;
    assert_eq!(used(&policy, &name).await, 3, "this period's alone");
}

/// Drops `app`'s answer to `/` while its outermost layer (of `outer`, a
/// store whose changes land a second late) waits for the store to apply
/// the request's deferred cost: the response never went out, so nothing
/// stays charged, inner layers' quotas (`inner`'s `read-day`) included.
async fn dropped_while_the_outer_layer_settles<St: Store>(
    app: Router,
    outer: &QuotaPolicy<FromHeader, Rigged<MemoryStore>>,
    inner: &QuotaPolicy<FromHeader, St>,
) {
    outer
        .store()
        .slow_changes
        .store(1_000, std::sync::atomic::Ordering::Relaxed);
    let timed_out = tokio::time::timeout(Duration::from_millis(100), app.oneshot(call("/"))).await;
    assert!(timed_out.is_err(), "dropped while the deferred cost lands");
    assert_eq!(settles(outer, "big-day", 0).await, 0, "outer: not served");
    assert_eq!(settles(inner, "read-day", 0).await, 0, "inner: not served");
}

/// A deferred cost that the store applies late.
fn costly(
    layer: tower_quota::QuotaLayer<FromHeader, Rigged<MemoryStore>>,
) -> tower_quota::QuotaLayer<FromHeader, Rigged<MemoryStore>> {
    layer.deferred_cost(1, |_| 5)
}

/// Nested layers of one policy: the inner layer answered and kept its
/// charge, the outer one was dropped before the response went out.
#[tokio::test(start_paused = true)]
async fn a_drop_while_the_outer_layer_settles_gives_inner_charges_back() {
    let policy = policy(
        Rigged::new(MemoryStore::new(), Rig::Fail, Some("never")),
        "one",
    )
    .store_timeout(None)
    .build();
    let app = Router::new()
        .route("/", get(ok))
        .route_layer(policy.layer(Quota::daily(10).allowance("read")))
        .layer(costly(policy.layer(Quota::daily(100).allowance("big"))));
    dropped_while_the_outer_layer_settles(app, &policy, &policy).await;
}

/// The same with the inner layer of another policy, on a store of its own.
#[tokio::test(start_paused = true)]
async fn a_drop_while_the_outer_layer_settles_gives_another_policys_charges_back() {
    let outer = policy(
        Rigged::new(MemoryStore::new(), Rig::Fail, Some("never")),
        "outer",
    )
    .store_timeout(None)
    .build();
    let inner = policy(MemoryStore::new(), "inner").build();
    let app = Router::new()
        .route("/", get(ok))
        .route_layer(inner.layer(Quota::daily(10).allowance("read")))
        .layer(costly(outer.layer(Quota::daily(100).allowance("big"))));
    dropped_while_the_outer_layer_settles(app, &outer, &inner).await;
}

/// A middleware between two layers that works on after the inner layer
/// answered (an audit log, a body rewritten) is dropped with the request:
/// the inner layer's charge goes back with the outer one's.
#[tokio::test(start_paused = true)]
async fn a_drop_in_a_middleware_between_layers_gives_inner_charges_back() {
    let outer = policy(MemoryStore::new(), "outer").build();
    let inner = policy(MemoryStore::new(), "inner").build();
    let app = Router::new()
        .route("/", get(ok))
        .route_layer(inner.layer(Quota::daily(10).allowance("read")))
        .route_layer(axum::middleware::from_fn(rigged::slow_after))
        .route_layer(outer.layer(Quota::daily(100).allowance("big")));
    let timed_out = tokio::time::timeout(Duration::from_millis(100), app.oneshot(call("/"))).await;
    assert!(timed_out.is_err(), "dropped while the middleware works");
    assert_eq!(settles(&outer, "big-day", 0).await, 0, "outer: not served");
    assert_eq!(settles(&inner, "read-day", 0).await, 0, "inner: not served");
}

/// A middleware between two layers that runs the rest of the request in a
/// task of its own: dropped with the request, it leaves the task running,
/// and the inner layer answers after the outer one gave its charge back.
/// What the inner layer tells it then goes back at once: the response
/// never went out.
#[tokio::test(start_paused = true)]
async fn an_inner_layer_that_answers_after_the_outer_one_gave_back_gives_back_too() {
    let outer = policy(MemoryStore::new(), "outer").build();
    let inner = policy(MemoryStore::new(), "inner").build();
    let spawned = axum::middleware::from_fn(
        |request: axum::extract::Request, next: axum::middleware::Next| async move {
            tokio::spawn(next.run(request)).await.unwrap()
        },
    );
    let slow = || async {
        tokio::time::sleep(Duration::from_secs(5)).await;
        "served late"
    };
    let app = Router::new()
        .route("/", get(slow))
        .route_layer(inner.layer(Quota::daily(10).allowance("read")))
        .route_layer(spawned)
        .route_layer(outer.layer(Quota::daily(100).allowance("big")));
    let timed_out = tokio::time::timeout(Duration::from_secs(1), app.oneshot(call("/"))).await;
    assert!(timed_out.is_err(), "dropped while the handler works");
    assert_eq!(settles(&outer, "big-day", 0).await, 0, "outer: not served");
    // The task runs on: the inner layer answers, and tells the outer one.
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(settles(&inner, "read-day", 0).await, 0, "inner: not served");
}

/// A middleware between two layers that answers with a response of its
/// own (the inner response's extensions lost): the request was served, and
/// both charges stay, also once the response is dropped.
#[tokio::test]
async fn a_new_response_between_layers_leaves_both_charges() {
    let outer = policy(MemoryStore::new(), "outer").build();
    let inner = policy(MemoryStore::new(), "inner").build();
    let rebuilt = axum::middleware::from_fn(
        |request: axum::extract::Request, next: axum::middleware::Next| async move {
            let response = next.run(request).await;
            (response.status(), "rebuilt").into_response()
        },
    );
    let app = Router::new()
        .route("/", get(ok))
        .route_layer(inner.layer(Quota::daily(10).allowance("read")))
        .route_layer(rebuilt)
        .route_layer(outer.layer(Quota::daily(100).allowance("big")));
    let response = app.oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    drop(response);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(used(&outer, "big-day").await, 1);
    assert_eq!(used(&inner, "read-day").await, 1);
}

/// An inner layer whose deferred cost its store applied past its timeout
/// (the response went on without waiting), then an outer layer dropped
/// while its own cost lands: the inner layer's whole charge goes back,
/// the late add included.
#[tokio::test(start_paused = true)]
async fn a_drop_after_an_inner_layer_settled_late_gives_its_late_add_back() {
    let outer = policy(
        Rigged::new(MemoryStore::new(), Rig::Fail, Some("never")),
        "outer",
    )
    .store_timeout(None)
    .build();
    let inner = policy(
        Rigged::new(MemoryStore::new(), Rig::Fail, Some("never")),
        "inner",
    )
    .store_timeout(Some(Duration::from_millis(50)))
    .build();
    inner
        .store()
        .slow_changes
        .store(1_000, std::sync::atomic::Ordering::Relaxed);
    let app = Router::new()
        .route("/", get(ok))
        .route_layer(costly(inner.layer(Quota::daily(10).allowance("read"))))
        .layer(costly(outer.layer(Quota::daily(100).allowance("big"))));
    dropped_while_the_outer_layer_settles(app, &outer, &inner).await;
}

/// Nested layers whose outer one settles past its store's timeout: the
/// response goes out, and every charge stays, the costs included.
#[tokio::test(start_paused = true)]
async fn a_nested_request_served_past_the_outer_timeout_keeps_its_charges() {
    let outer = policy(
        Rigged::new(MemoryStore::new(), Rig::Fail, Some("never")),
        "outer",
    )
    .store_timeout(Some(Duration::from_millis(50)))
    .build();
    outer
        .store()
        .slow_changes
        .store(1_000, std::sync::atomic::Ordering::Relaxed);
    let inner = policy(MemoryStore::new(), "inner").build();
    let app = Router::new()
        .route("/", get(ok))
        .route_layer(inner.layer(Quota::daily(10).allowance("read")))
        .layer(costly(outer.layer(Quota::daily(100).allowance("big"))));
    let response = app.oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    drop(response);
    assert_eq!(settles(&outer, "big-day", 5).await, 5);
    assert_eq!(used(&inner, "read-day").await, 1);
}

/// A request its handler undid (`QuotaHandle::refund_request`) is given
/// back once: not again by the layer for its 5xx under
/// `refund_server_errors`, nor by a nested layer for the same request, nor
/// by the drop of a request whose handler undid it and then stalled.
#[tokio::test(start_paused = true)]
async fn a_request_its_handler_undid_is_not_given_back_again() {
    use axum::extract::State;
    use tower_quota::{QuotaHandle, QuotaStatus};

    let policy = policy(MemoryStore::new(), "undone")
        .refund_server_errors(true)
        .build();
    async fn fails(State(handle): State<QuotaHandle>, status: QuotaStatus) -> StatusCode {
        assert_eq!(status.entries()[0].used(), 2);
        assert_eq!(handle.refund_request(&status).await.unwrap(), [Some(1)]);
        assert_eq!(
            status.get("default-day").map(|usage| usage.used()),
            Some(1),
            "the status tells the counter as the handler left it"
        );
        assert_eq!(status.entries()[0].remaining(), 9);
        StatusCode::INTERNAL_SERVER_ERROR
    }
    async fn stalls(State(handle): State<QuotaHandle>, status: QuotaStatus) -> StatusCode {
        assert_eq!(handle.refund_request(&status).await.unwrap(), [Some(1)]);
        tokio::time::sleep(Duration::from_secs(60)).await;
        StatusCode::OK
    }
    let app = Router::new()
        .route("/", get(|| async { "served" }))
        .route("/fails", get(fails))
        .route("/stalls", get(stalls))
        .with_state(policy.handle())
        .layer(policy.layer(Quota::daily(10)));
    let response = app.clone().oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(used(&policy, "default-day").await, 1);

    let response = app.clone().oneshot(call("/fails")).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        header(&response, "ratelimit"),
        "\"default-day\";r=9;t=50400",
        "the fields tell the counter as the handler left it"
    );
    assert_eq!(used(&policy, "default-day").await, 1, "given back once");

    let dropped =
        tokio::time::timeout(Duration::from_secs(1), app.clone().oneshot(call("/stalls"))).await;
    assert!(dropped.is_err(), "dropped while the handler stalls");
    tokio::task::yield_now().await;
    assert_eq!(used(&policy, "default-day").await, 1, "given back once");
}

/// A handler's give-back is sent in a task of its own: the request dropped
/// while the store answers it (a client gone) is given back all the same,
/// once.
#[tokio::test(start_paused = true)]
async fn a_handlers_give_back_lands_when_the_request_is_dropped_meanwhile() {
    use axum::extract::State;
    use tower_quota::{QuotaHandle, QuotaStatus};

    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("nothing"));
    let slow = Arc::clone(&store.slow_changes);
    let policy = policy(store, "undone").build();
    async fn undo(State(handle): State<QuotaHandle<Rigged<MemoryStore>>>, status: QuotaStatus) {
        handle.refund_request(&status).await.unwrap();
    }
    let app = Router::new()
        .route("/", get(undo))
        .with_state(policy.handle())
        .layer(policy.layer(Quota::daily(10)));
    slow.store(5_000, std::sync::atomic::Ordering::Relaxed);
    let dropped = tokio::time::timeout(Duration::from_secs(1), app.oneshot(call("/"))).await;
    assert!(dropped.is_err(), "dropped while the store gives back");
    assert_eq!(used(&policy, "default-day").await, 1, "on its way");
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(used(&policy, "default-day").await, 0, "given back once");
}

/// A handler's give-back the store never sent is sent again: the 5xx
/// that follows gives nothing back twice.
#[tokio::test]
async fn a_handlers_give_back_never_sent_is_sent_again() {
    use axum::extract::State;
    use tower_quota::{QuotaHandle, QuotaStatus};

    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("nothing"));
    let unsent = Arc::clone(&store.unsent);
    let policy = policy(store, "undone").refund_server_errors(true).build();
    type Handle = QuotaHandle<Rigged<MemoryStore>>;
    let fails = move |State(handle): State<Handle>, status: QuotaStatus| async move {
        unsent.store(true, std::sync::atomic::Ordering::Relaxed);
        let error = handle.refund_request(&status).await.unwrap_err();
        assert!(error.is_unsent());
        unsent.store(false, std::sync::atomic::Ordering::Relaxed);
        StatusCode::BAD_GATEWAY
    };
    let app = Router::new()
        .route("/", get(fails))
        .with_state(policy.handle())
        .layer(policy.layer(Quota::daily(10)));
    let response = app.oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(settles(&policy, "default-day", 0).await, 0);
}

/// A handler's give-back that fails as never sent after its request was
/// dropped (the layer found the line claimed, and left it) is sent again:
/// the request that was not served spends nothing.
#[tokio::test(start_paused = true)]
async fn a_handlers_give_back_never_sent_after_a_drop_is_sent_again() {
    use axum::extract::State;
    use std::sync::atomic::Ordering::Relaxed;
    use tower_quota::{QuotaHandle, QuotaStatus};

    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("nothing"));
    let (unsent, slow) = (Arc::clone(&store.unsent), Arc::clone(&store.slow_changes));
    let policy = policy(store, "dropped-undo").build();
    type Handle = QuotaHandle<Rigged<MemoryStore>>;
    let undo = {
        let (unsent, slow) = (Arc::clone(&unsent), Arc::clone(&slow));
        move |State(handle): State<Handle>, status: QuotaStatus| async move {
            // The store is away: the refund fails, as never sent, 2 s on.
            unsent.store(true, Relaxed);
            slow.store(2_000, Relaxed);
            let _ = handle.refund_request(&status).await;
            "undone"
        }
    };
    let app = Router::new()
        .route("/", get(undo))
        .with_state(policy.handle())
        .layer(policy.layer(Quota::daily(10)));
    let dropped = tokio::time::timeout(Duration::from_secs(1), app.oneshot(call("/"))).await;
    assert!(dropped.is_err(), "dropped while the handler's refund waits");
    unsent.store(false, Relaxed);
    slow.store(0, Relaxed);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(used(&policy, "default-day").await, 0, "not served");
}

/// A give-back the store never sent while it was away for minutes is
/// sent once it is back: within the counter's period, not for a minute.
#[tokio::test(start_paused = true)]
async fn a_give_back_is_sent_again_after_a_long_outage() {
    use std::sync::atomic::Ordering::Relaxed;

    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("nothing"));
    let unsent = Arc::clone(&store.unsent);
    let policy = policy(store, "long-outage").build();
    let slow = || async {
        tokio::time::sleep(Duration::from_secs(5)).await;
        "late"
    };
    let app = Router::new()
        .route("/", get(slow))
        .layer(policy.layer(Quota::daily(100)));
    unsent.store(true, Relaxed);
    let dropped = tokio::time::timeout(Duration::from_secs(1), app.oneshot(call("/"))).await;
    assert!(dropped.is_err(), "dropped: not served");
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert_eq!(
        used(&policy, "default-day").await,
        1,
        "the store still away"
    );
    unsent.store(false, Relaxed);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(used(&policy, "default-day").await, 0, "given back");
}

/// A deferred cost's add the store never sent while it was away for
/// minutes is sent once it is back: the served request counts what it
/// cost.
#[tokio::test(start_paused = true)]
async fn an_add_is_sent_again_after_a_long_outage() {
    use std::sync::atomic::Ordering::Relaxed;

    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("nothing"));
    let unsent = Arc::clone(&store.unsent);
    let policy = policy(store, "long-add").build();
    let app = Router::new()
        .route("/", get(ok))
        .layer(policy.layer(Quota::daily(100)).deferred_cost(1, |_| 5));
    unsent.store(true, Relaxed);
    let response = app.oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert_eq!(
        used(&policy, "default-day").await,
        1,
        "the store still away"
    );
    unsent.store(false, Relaxed);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(used(&policy, "default-day").await, 5, "what it cost");
}

/// A response does not wait for the changes the store never sent, which
/// are sent again for as long as their counter's period lasts: not even
/// under a policy that waits for its store without a timeout.
#[tokio::test(start_paused = true)]
async fn a_response_does_not_wait_for_changes_sent_again() {
    use std::sync::atomic::Ordering::Relaxed;

    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("nothing"));
    let unsent = Arc::clone(&store.unsent);
    let policy = policy(store, "no-wait").store_timeout(None).build();
    let app = Router::new()
        .route("/", get(ok))
        .layer(policy.layer(Quota::daily(100)).deferred_cost(1, |_| 5));
    unsent.store(true, Relaxed);
    let answered = tokio::time::timeout(Duration::from_secs(1), app.oneshot(call("/"))).await;
    let response = answered.expect("answered at once").unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    // As the add will leave the counter once it lands.
    assert_eq!(
        header(&response, "ratelimit"),
        "\"default-day\";r=95;t=50400"
    );
    unsent.store(false, Relaxed);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(used(&policy, "default-day").await, 5, "what it cost");
}

/// Changes the store never sent are sent again one after another, each
/// only within its own counter's period counted from when it was first
/// sent: an add of a minute's counter that waited behind a day's is
/// dropped once its minute is over, not added to the next minute's
/// counter (a store that does not date its counters could not tell).
#[tokio::test(start_paused = true)]
async fn a_change_sent_again_keeps_to_its_own_period() {
    use std::sync::atomic::Ordering::Relaxed;

    let clock = ManualClock::new(NOW.parse().unwrap());
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("nothing"));
    let unsent = Arc::clone(&store.unsent);
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .clock(clock.clone())
        .build();
    let minute = Quota::rolling(100, Duration::from_secs(60));
    let name = minute.name().to_owned();
    let app = Router::new().route("/", get(ok)).layer(
        policy
            .layer(Quota::daily(100))
            .quota(minute)
            .deferred_cost(1, |_| 5),
    );
    let step = |seconds: u64| {
        let clock = clock.clone();
        async move {
            for _ in 0..seconds {
                tokio::time::advance(Duration::from_secs(1)).await;
                clock.advance(tower_quota::jiff::SignedDuration::from_secs(1));
                tokio::task::yield_now().await;
            }
        }
    };
    unsent.store(true, Relaxed);
    let response = app.clone().oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    step(600).await;
    // A request of a later minute, while the store still takes no change.
    let response = app.oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    step(5).await;
    unsent.store(false, Relaxed);
    step(30).await;
    assert_eq!(
        used(&policy, "default-day").await,
        10,
        "both days' adds landed"
    );
    assert_eq!(used(&policy, &name).await, 5, "this minute's request alone");
}

/// A rolling period opens with the first request served. Three requests
/// that were not (refused by a burst quota further in, a 5xx given back
/// under `refund_server_errors`, one its handler undid) each have their
/// charge given back: the period their charge opened goes with it, and
/// the next request served, ten minutes later, opens its own.
#[tokio::test]
async fn a_charge_given_back_leaves_no_rolling_period_open() {
    use axum::extract::State;
    use tower_quota::jiff::SignedDuration;
    use tower_quota::{QuotaHandle, QuotaStatus};

    async fn undone(State(handle): State<QuotaHandle>, status: QuotaStatus) -> &'static str {
        handle.refund_request(&status).await.unwrap();
        "undone"
    }
    async fn fails() -> StatusCode {
        StatusCode::INTERNAL_SERVER_ERROR
    }
    let start: tower_quota::jiff::Timestamp = NOW.parse().unwrap();
    for path in ["/refused", "/fails", "/undone"] {
        let clock = ManualClock::new(start);
        let store = MemoryStore::new();
        let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store)
            .clock(clock.clone())
            .refund_server_errors(true)
            .build();
        let hour = Quota::rolling(100, Duration::from_secs(3600)).named("hour");
        let burst = Quota::per_minute(1).allowance("burst");
        // `/warm` spends the burst quota alone; `/refused` then passes the
        // rolling quota and is refused by the burst one.
        let warm = Router::new()
            .route("/warm", get(ok))
            .route_layer(policy.layer(burst.clone()));
        let counted = Router::new()
            .route("/refused", get(ok))
            .route_layer(policy.layer(burst))
            .route("/fails", get(fails))
            .route("/undone", get(undone))
            .route("/served", get(ok))
            .with_state(policy.handle())
            .route_layer(policy.layer(hour));
        let app = warm.merge(counted);
        if path == "/refused" {
            let response = app.clone().oneshot(call("/warm")).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
        }
        let response = app.clone().oneshot(call(path)).await.unwrap();
        // `/undone` answers 200, its charge undone by its handler.
        assert_eq!(
            response.status() == StatusCode::OK,
            path == "/undone",
            "{path}"
        );
        assert_eq!(settles(&policy, "hour", 0).await, 0, "{path}: given back");
        clock.advance(SignedDuration::from_mins(10));
        let response = app.oneshot(call("/served")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let hour = usage_of(&policy, "hour").await;
        let served_at = start + SignedDuration::from_mins(10);
        assert_eq!(hour.used(), 1, "{path}");
        assert_eq!(
            hour.first_call(),
            Some(served_at),
            "{path}: the period opens with the request served"
        );
        assert_eq!(
            hour.resets_at(),
            served_at + SignedDuration::from_hours(1),
            "{path}: and ends an hour after it"
        );
    }
}

/// A request served whose deferred cost comes to nothing spent nothing:
/// as a free request, it opens no rolling period.
#[tokio::test]
async fn a_request_whose_deferred_cost_is_nothing_opens_no_rolling_period() {
    let policy = policy(MemoryStore::new(), "free").build();
    let hour = Quota::rolling(100, Duration::from_secs(3600)).named("hour");
    let app = Router::new()
        .route("/", get(ok))
        .layer(policy.layer(hour).deferred_cost(1, |_| 0));
    let response = app.oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let hour = usage_of(&policy, "hour").await;
    assert_eq!((hour.used(), hour.first_call()), (0, None));
}

/// A handler's `refund_request` made once its response went out through
/// the layer (from a task it spawned, or a body that fails while it
/// streams) gives back what the request holds then: its cost with the
/// deferred cost's add or refund the layer made meanwhile, so that the
/// request spends nothing.
#[tokio::test]
async fn a_refund_after_the_response_gives_back_the_deferred_cost_too() {
    type Kept = Arc<std::sync::Mutex<Option<tower_quota::QuotaStatus>>>;
    for (up_front, real) in [(1, 5), (5, 2)] {
        let policy = policy(MemoryStore::new(), "after").build();
        let kept: Kept = Arc::default();
        let handler = {
            let kept = Arc::clone(&kept);
            move |status: tower_quota::QuotaStatus| async move {
                *kept.lock().unwrap() = Some(status);
                Response::builder()
                    .header("x-tokens", real.to_string())
                    .body(Body::empty())
                    .unwrap()
            }
        };
        let tokens = |response: &http::response::Parts| {
            response.headers["x-tokens"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap()
        };
        let app = Router::new().route("/", get(handler)).layer(
            policy
                .layer(Quota::daily(100))
                .deferred_cost(up_front, tokens),
        );
        let response = app.oneshot(call("/")).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(used(&policy, "default-day").await, real, "the real cost");
        let status = kept.lock().unwrap().take().unwrap();
        let refunded = policy.handle().refund_request(&status).await.unwrap();
        assert_eq!(refunded, vec![Some(0)], "up front {up_front}, real {real}");
        assert_eq!(used(&policy, "default-day").await, 0, "nothing spent");
        // Once.
        let again = policy.handle().refund_request(&status).await.unwrap();
        assert_eq!(again, vec![None]);
    }
}

/// A memory store whose adds fail: sent, answered with an error, nothing
/// written (a store failing past its count, a connection lost).
#[derive(Clone, Debug)]
struct FailingAdds(MemoryStore);

impl Store for FailingAdds {
    type ChargeFuture = <MemoryStore as Store>::ChargeFuture;

    fn charge(&self, request: tower_quota::store::ChargeRequest) -> Self::ChargeFuture {
        self.0.charge(request)
    }
    fn charge_at_once(
        &self,
        request: &tower_quota::store::ChargeRequest,
    ) -> tower_quota::store::ChargeAnswer<Self::ChargeFuture> {
        self.0.charge_at_once(request)
    }
    fn peek(
        &self,
        request: tower_quota::store::ChargeRequest,
    ) -> impl Future<Output = Result<Vec<tower_quota::Usage>, tower_quota::StoreError>> + Send {
        self.0.peek(request)
    }
    fn refund(
        &self,
        now: tower_quota::jiff::Timestamp,
        key: tower_quota::PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, tower_quota::StoreError>> + Send {
        self.0.refund(now, key, amount)
    }
    fn refund_made_by(
        &self,
        now: tower_quota::jiff::Timestamp,
        key: tower_quota::PeriodKey,
        amount: u64,
        made_by: tower_quota::jiff::Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, tower_quota::StoreError>> + Send {
        self.0.refund_made_by(now, key, amount, made_by)
    }
    fn refund_made_at(
        &self,
        now: tower_quota::jiff::Timestamp,
        key: tower_quota::PeriodKey,
        amount: u64,
        first_call: tower_quota::jiff::Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, tower_quota::StoreError>> + Send {
        self.0.refund_made_at(now, key, amount, first_call)
    }
    fn add(
        &self,
        _: tower_quota::jiff::Timestamp,
        _: tower_quota::PeriodKey,
        _: u64,
    ) -> impl Future<Output = Result<Option<u64>, tower_quota::StoreError>> + Send {
        std::future::ready(Err(tower_quota::StoreError::new(
            tower_quota::store::StoreErrorKind::Other,
            "adds fail here",
        )))
    }
    fn reset(
        &self,
        key: tower_quota::PeriodKey,
    ) -> impl Future<Output = Result<bool, tower_quota::StoreError>> + Send {
        self.0.reset(key)
    }
    fn identity(&self) -> Option<usize> {
        self.0.identity()
    }
    fn max_count(&self) -> u64 {
        self.0.max_count()
    }
}

/// A handler's `refund_request` made after the response, once the layer's
/// add of a deferred cost failed (nothing written), gives back what the
/// request was charged: not the add that never landed, which would take
/// the units of requests truly served.
#[tokio::test]
async fn a_refund_after_a_failed_add_gives_back_only_what_was_charged() {
    let (app, policy, kept) = costly_app(FailingAdds(MemoryStore::new()), "lost-add");
    // A request served at its cost of 1.
    let response = app.clone().oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(used(&policy, "default-day").await, 1);
    // One charged 1 up front, whose add of 4 more fails.
    let response = app.clone().oneshot(call("/costly")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        used(&policy, "default-day").await,
        2,
        "the add never landed"
    );
    let status = kept.lock().unwrap().take().unwrap();
    let refunded = policy.handle().refund_request(&status).await.unwrap();
    assert_eq!(
        used(&policy, "default-day").await,
        1,
        "the first request was served: only the 1 charged is given back"
    );
    assert_eq!(refunded, vec![Some(1)]);
}

/// A retry between two layers, as `tower::retry` makes it: each attempt a
/// clone of the request, extensions (its `QuotaStatus`) and all. The first
/// attempt is refused further in (a per-minute burst), the second, once
/// the refusal's wait is over, is served: the application answers it with
/// a 404 of its own (no such item), which is charged as any 4xx. The
/// refusal of the first attempt must not give the served request back.
async fn retried_after_a_refusal_inside<St: Store>(
    account: QuotaPolicy<FromHeader, St>,
    clock: ManualClock,
) -> (StatusCode, StatusCode) {
    let burst = policy(MemoryStore::new(), "burst")
        .clock(clock.clone())
        .build();
    let wait = move || clock.advance(Duration::from_secs(60));
    retried_inside(account, burst, wait).await
}

/// As [`retried_after_a_refusal_inside`], with `burst` further in and
/// `between` done between the two attempts.
async fn retried_inside<St: Store, Bt: Store>(
    account: QuotaPolicy<FromHeader, St>,
    burst: QuotaPolicy<FromHeader, Bt>,
    between: impl Fn() + Clone + Send + 'static,
) -> (StatusCode, StatusCode) {
    let inner: Router = Router::new()
        .route(
            "/item",
            get(|| async { (StatusCode::NOT_FOUND, "no such item") }),
        )
        .route_layer(burst.layer(Quota::per_minute(1).allowance("burst")));
    // Retries once on a 429, after `between`.
    let retry = tower::service_fn(move |request: Request<Body>| {
        let (inner, between) = (inner.clone(), between.clone());
        async move {
            let (parts, _) = request.into_parts();
            let attempt = || {
                let mut again = Request::builder()
                    .method(parts.method.clone())
                    .uri(parts.uri.clone())
                    .body(Body::empty())
                    .unwrap();
                *again.headers_mut() = parts.headers.clone();
                *again.extensions_mut() = parts.extensions.clone();
                again
            };
            let first = inner.clone().oneshot(attempt()).await?;
            if first.status() != StatusCode::TOO_MANY_REQUESTS {
                return Ok::<_, std::convert::Infallible>(first);
            }
            between();
            inner.oneshot(attempt()).await
        }
    });
    let app = tower::ServiceBuilder::new()
        .layer(account.layer(Quota::daily(10).allowance("read")))
        .service(retry);
    // Served at once (404), then served on the second attempt (404).
    let first = app.clone().oneshot(call("/item")).await.unwrap().status();
    let second = app.oneshot(call("/item")).await.unwrap().status();
    (first, second)
}

#[tokio::test]
async fn a_request_served_on_a_retry_after_a_refusal_inside_stays_charged() {
    let clock = ManualClock::new(NOW.parse().unwrap());
    let account = policy(MemoryStore::new(), "account")
        .clock(clock.clone())
        .build();
    let statuses = retried_after_a_refusal_inside(account.clone(), clock).await;
    assert_eq!(statuses, (StatusCode::NOT_FOUND, StatusCode::NOT_FOUND));
    assert_eq!(
        used(&account, "read-day").await,
        2,
        "both requests were served (404): the second, retried after a refusal inside, was given back"
    );
}

/// As above, the outer layer owing its charge (its store fails, fail
/// open): the served request's debt must not be forgiven.
#[tokio::test]
async fn a_request_served_on_a_retry_after_a_refusal_inside_stays_owed() {
    let clock = ManualClock::new(NOW.parse().unwrap());
    let account = policy(
        Rigged::new(MemoryStore::new(), Rig::Fail, Some("read")),
        "account",
    )
    .clock(clock.clone())
    .on_store_error(OnStoreError::FailOpen)
    .build();
    let statuses = retried_after_a_refusal_inside(account.clone(), clock).await;
    assert_eq!(statuses, (StatusCode::NOT_FOUND, StatusCode::NOT_FOUND));
    account.settle_owed(Duration::from_secs(2)).await;
    assert_eq!(
        used(&account, "read-day").await,
        2,
        "both requests were served (404): the second's debt, retried after a refusal inside, was forgiven"
    );
}

/// As above, the inner layer letting the second attempt through uncounted
/// (fail open without a ledger, its store down for a moment) rather than
/// charged: it let the retry through all the same, so its refusal of the
/// first attempt no longer speaks for the answer, and the request, served
/// (a 404 of the handler's own), stays charged further out.
#[tokio::test]
async fn a_retry_let_through_uncounted_after_a_refusal_inside_stays_charged() {
    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("none-such"));
    let down = Arc::clone(&store.down);
    let burst = policy(store, "burst")
        .on_store_error(OnStoreError::FailOpen)
        .max_owed_counters(0)
        .build();
    let account = policy(MemoryStore::new(), "account").build();
    let store_down = move || down.store(true, std::sync::atomic::Ordering::Relaxed);
    let statuses = retried_inside(account.clone(), burst, store_down).await;
    assert_eq!(statuses, (StatusCode::NOT_FOUND, StatusCode::NOT_FOUND));
    assert_eq!(
        used(&account, "read-day").await,
        2,
        "both requests were served (404): the second, let through uncounted on its retry, was given back"
    );
}

/// A router whose `/part` is refused: its quota of one is spent already.
async fn spent_part() -> Router {
    let spent = policy(MemoryStore::new(), "spent").build();
    let refusing: Router = Router::new()
        .route("/part", get(ok))
        .route_layer(spent.layer(Quota::daily(1).allowance("spent")));
    let first = refusing.clone().oneshot(call("/part")).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    refusing
}

/// A part of a request with `extensions` (its `QuotaStatus` among them),
/// costing `cost` where a layer prices it.
fn part(extensions: &http::Extensions, cost: u64) -> Request<Body> {
    let mut part = Request::get("/part")
        .header("x-account-id", "acme")
        .header("x-cost", cost.to_string())
        .body(Body::empty())
        .unwrap();
    *part.extensions_mut() = extensions.clone();
    part
}

/// A part's refusal rebuilt by its handler: a 429 of the handler's own.
fn a_part_refused() -> Result<axum::response::Response, std::convert::Infallible> {
    Ok((StatusCode::TOO_MANY_REQUESTS, "a part was refused").into_response())
}

/// `fan_out`, which answers with a part's refusal, behind a daily quota
/// further out: the request is given back.
async fn outer_charge_given_back<S>(fan_out: S)
where
    S: tower::Service<
            Request<Body>,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    let account = policy(MemoryStore::new(), "account").build();
    let app = tower::ServiceBuilder::new()
        .layer(account.layer(Quota::daily(10).allowance("read")))
        .service(fan_out);
    let response = app.oneshot(call("/batch")).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        used(&account, "read-day").await,
        0,
        "answered with the refusal of a part: the outer charge stayed"
    );
}

/// Not a retry: a handler (a fan-out, a batch endpoint) calls two inner
/// services with the request's extensions, its `QuotaStatus` with them. The
/// first, behind a quota of its own, refuses; the second, behind another
/// quota, lets its call through. The handler answers the whole request
/// with an error of its own (the refusal rebuilt): the outer charge goes
/// back, as for any refusal rebuilt between two layers. The second
/// service's admission must not clear the mark the first one's refusal set.
#[tokio::test]
async fn a_sibling_admitted_after_a_refusal_inside_does_not_keep_the_outer_charge() {
    let roomy = policy(MemoryStore::new(), "roomy").build();
    let refusing = spent_part().await;
    let admitting: Router = Router::new()
        .route("/part", get(ok))
        .route_layer(roomy.layer(Quota::daily(10).allowance("roomy")));
    let fan_out = tower::service_fn(move |request: Request<Body>| {
        let (refusing, admitting) = (refusing.clone(), admitting.clone());
        async move {
            let (parts, _) = request.into_parts();
            let one = refusing.oneshot(part(&parts.extensions, 1)).await?;
            let two = admitting.oneshot(part(&parts.extensions, 1)).await?;
            assert_eq!(
                (one.status(), two.status()),
                (StatusCode::TOO_MANY_REQUESTS, StatusCode::OK)
            );
            a_part_refused()
        }
    });
    outer_charge_given_back(fan_out).await;
}

/// As above, with a third part: one part refused by one layer, a second
/// refused by another layer, which then lets a third through. The first
/// layer's refusal still speaks for the answer (that layer let nothing
/// through since): answered with a part's refusal, the request is given
/// back, as it is without the later parts.
#[tokio::test]
async fn a_refusal_inside_stays_marked_when_another_layer_refuses_and_admits_after_it() {
    let priced = policy(MemoryStore::new(), "priced").build();
    let refusing = spent_part().await;
    let cost = |parts: &http::request::Parts| {
        Ok(parts
            .headers
            .get("x-cost")
            .map_or(1, |v| v.to_str().unwrap().parse().unwrap()))
    };
    let pricing: Router = Router::new().route("/part", get(ok)).route_layer(
        priced
            .layer(Quota::daily(10).allowance("priced"))
            .cost_fn(cost),
    );
    let fan_out = tower::service_fn(move |request: Request<Body>| {
        let (refusing, pricing) = (refusing.clone(), pricing.clone());
        async move {
            let (parts, _) = request.into_parts();
            let one = refusing.oneshot(part(&parts.extensions, 1)).await?;
            // Too dear for the other layer, then one it lets through.
            let two = pricing
                .clone()
                .oneshot(part(&parts.extensions, 100))
                .await?;
            let three = pricing.oneshot(part(&parts.extensions, 1)).await?;
            assert_eq!(
                (one.status(), two.status(), three.status()),
                (
                    StatusCode::TOO_MANY_REQUESTS,
                    StatusCode::TOO_MANY_REQUESTS,
                    StatusCode::OK
                )
            );
            a_part_refused()
        }
    });
    outer_charge_given_back(fan_out).await;
}

/// As [`a_sibling_admitted_after_a_refusal_inside_does_not_keep_the_outer_charge`],
/// the layer further out owing its charge (its store failing, fail open)
/// rather than charging it: the refusal inside marks what it owes, and the
/// request, answered with a part's refusal, owes nothing.
#[tokio::test]
async fn a_refusal_inside_forgives_the_debt_further_out() {
    let account = policy(
        Rigged::new(MemoryStore::new(), Rig::Fail, Some("read")),
        "account",
    )
    .on_store_error(OnStoreError::FailOpen)
    .build();
    let refusing = spent_part().await;
    let fan_out = tower::service_fn(move |request: Request<Body>| {
        let refusing = refusing.clone();
        async move {
            let (parts, _) = request.into_parts();
            let one = refusing.oneshot(part(&parts.extensions, 1)).await?;
            assert_eq!(one.status(), StatusCode::TOO_MANY_REQUESTS);
            a_part_refused()
        }
    });
    let app = tower::ServiceBuilder::new()
        .layer(account.layer(Quota::daily(10).allowance("read")))
        .service(fan_out);
    let response = app.oneshot(call("/batch")).await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    account.settle_owed(Duration::from_secs(2)).await;
    assert_eq!(
        used(&account, "read-day").await,
        0,
        "answered with the refusal of a part: the debt further out stayed"
    );
}

/// The status of the last request to `/costly`, kept by its handler.
type Kept = Arc<std::sync::Mutex<Option<tower_quota::QuotaStatus>>>;

/// `/`, served at its cost of 1, and `/costly`, charged 1 up front and 5 in
/// all once it answered (a deferred cost), whose handler keeps the
/// request's status; a daily quota of 100 on `store`, in `namespace`.
fn costly_app<St: Store>(
    store: St,
    namespace: &str,
) -> (Router, QuotaPolicy<FromHeader, St>, Kept) {
    let policy = policy(store, namespace).build();
    let kept: Kept = Arc::default();
    let handler = {
        let kept = Arc::clone(&kept);
        move |status: tower_quota::QuotaStatus| async move {
            *kept.lock().unwrap() = Some(status);
            Response::builder()
                .header("x-tokens", "5")
                .body(Body::empty())
                .unwrap()
        }
    };
    let tokens = |response: &http::response::Parts| {
        response
            .headers
            .get("x-tokens")
            .map_or(1, |v| v.to_str().unwrap().parse().unwrap())
    };
    let app = Router::new()
        .route("/", get(ok))
        .route("/costly", get(handler))
        .layer(policy.layer(Quota::daily(100)).deferred_cost(1, tokens));
    (app, policy, kept)
}

/// A handler's `refund_request` made while the layer's add of a deferred
/// cost is being sent again (the store was away when the response went
/// out) gives back what the request holds on the counter: the add that
/// lands afterwards is not left charged to the request undone, and the
/// refund takes nothing of another request's units meanwhile.
#[tokio::test(start_paused = true)]
async fn a_refund_while_an_add_is_sent_again_leaves_nothing_charged() {
    use std::sync::atomic::Ordering::Relaxed;

    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("nothing"));
    let unsent = Arc::clone(&store.unsent);
    let (app, policy, kept) = costly_app(store, "add-then-undo");
    // A request served at its cost of 1.
    let response = app.clone().oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    // One charged 1 up front, whose add of 4 more the store never sent:
    // it is sent again, and the response does not wait for it.
    unsent.store(true, Relaxed);
    let response = app.clone().oneshot(call("/costly")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    unsent.store(false, Relaxed);
    assert_eq!(
        used(&policy, "default-day").await,
        2,
        "the add not landed yet"
    );
    // The handler undoes its request (a task it spawned, say).
    let status = kept.lock().unwrap().take().unwrap();
    policy.handle().refund_request(&status).await.unwrap();
    assert_eq!(
        used(&policy, "default-day").await,
        1,
        "the first request's unit is not taken"
    );
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        used(&policy, "default-day").await,
        1,
        "the request undone holds nothing once the add landed"
    );
}

/// The give-back of a deferred cost's add that lands after the handler's
/// `refund_request` left it out (it was on its way then) is sent again when
/// the store never sent it, as the handler's own give-back is: the request
/// undone is not left holding the add.
#[tokio::test(start_paused = true)]
async fn the_give_back_of_an_add_that_landed_late_is_sent_again() {
    use std::sync::atomic::Ordering::Relaxed;

    let store = Rigged::new(MemoryStore::new(), Rig::Fail, Some("nothing"));
    let (unsent, slow) = (Arc::clone(&store.unsent), Arc::clone(&store.slow_changes));
    let (app, policy, kept) = costly_app(store, "late-add-back");
    let response = app.clone().oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    // Charged 1 up front; its add of 4 more the store never sent: sent
    // again 100 ms later.
    unsent.store(true, Relaxed);
    let response = app.clone().oneshot(call("/costly")).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    unsent.store(false, Relaxed);
    let status = kept.lock().unwrap().take().unwrap();
    policy.handle().refund_request(&status).await.unwrap();
    assert_eq!(used(&policy, "default-day").await, 1);
    // The add sent again lands (50 ms after it is sent); the store is away
    // again when its give-back is sent, and back a moment later.
    slow.store(50, Relaxed);
    tokio::time::sleep(Duration::from_millis(120)).await;
    unsent.store(true, Relaxed);
    tokio::time::sleep(Duration::from_millis(100)).await;
    unsent.store(false, Relaxed);
    slow.store(0, Relaxed);
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(
        used(&policy, "default-day").await,
        1,
        "the request undone holds nothing once the add landed"
    );
}

/// A memory store whose first give-back takes a while to come back
/// unsent (a connection that could not be opened in time), as a store
/// that was away: the change is then sent again.
#[derive(Clone, Debug)]
struct SlowUnsentRefund {
    inner: MemoryStore,
    first: Arc<std::sync::atomic::AtomicBool>,
}

impl SlowUnsentRefund {
    /// The inner store's answer, after the first give-back's slow failure
    /// (the memory store's refund applies when it is called: it is called
    /// only once the give-back is sent).
    async fn refund_after<T, Fut: Future<Output = Result<T, tower_quota::StoreError>>>(
        &self,
        refund: impl FnOnce() -> Fut,
    ) -> Result<T, tower_quota::StoreError> {
        if self.first.swap(false, std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(300)).await;
            return Err(tower_quota::StoreError::new(
                tower_quota::store::StoreErrorKind::Unavailable,
                "no connection in time; nothing was sent",
            )
            .unsent());
        }
        refund().await
    }
}

impl Store for SlowUnsentRefund {
    type ChargeFuture = <MemoryStore as Store>::ChargeFuture;

    fn charge(&self, request: tower_quota::store::ChargeRequest) -> Self::ChargeFuture {
        self.inner.charge(request)
    }
    fn charge_at_once(
        &self,
        request: &tower_quota::store::ChargeRequest,
    ) -> tower_quota::store::ChargeAnswer<Self::ChargeFuture> {
        self.inner.charge_at_once(request)
    }
    fn peek(
        &self,
        request: tower_quota::store::ChargeRequest,
    ) -> impl Future<Output = Result<Vec<tower_quota::Usage>, tower_quota::StoreError>> + Send {
        self.inner.peek(request)
    }
    fn refund(
        &self,
        now: tower_quota::jiff::Timestamp,
        key: tower_quota::PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, tower_quota::StoreError>> + Send {
        self.refund_after(move || self.inner.refund(now, key, amount))
    }
    fn refund_made_by(
        &self,
        now: tower_quota::jiff::Timestamp,
        key: tower_quota::PeriodKey,
        amount: u64,
        made_by: tower_quota::jiff::Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, tower_quota::StoreError>> + Send {
        self.refund_after(move || self.inner.refund_made_by(now, key, amount, made_by))
    }
    fn refund_made_at(
        &self,
        now: tower_quota::jiff::Timestamp,
        key: tower_quota::PeriodKey,
        amount: u64,
        first_call: tower_quota::jiff::Timestamp,
    ) -> impl Future<Output = Result<Option<u64>, tower_quota::StoreError>> + Send {
        self.refund_after(move || self.inner.refund_made_at(now, key, amount, first_call))
    }
    fn add(
        &self,
        now: tower_quota::jiff::Timestamp,
        key: tower_quota::PeriodKey,
        amount: u64,
    ) -> impl Future<Output = Result<Option<u64>, tower_quota::StoreError>> + Send {
        self.inner.add(now, key, amount)
    }
    fn reset(
        &self,
        key: tower_quota::PeriodKey,
    ) -> impl Future<Output = Result<bool, tower_quota::StoreError>> + Send {
        self.inner.reset(key)
    }
    fn identity(&self) -> Option<usize> {
        self.inner.identity()
    }
    fn max_count(&self) -> u64 {
        self.inner.max_count()
    }
}

/// A graceful shutdown right after a response whose give-back is still on
/// its first way (the response left after the store timeout): that first
/// send comes back unsent after the shutdown began, and is sent again.
/// `settle_owed` waits for it, so that a process exiting once it returns
/// leaves the request that was not served (a 500, given back) uncharged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_owed_waits_for_a_give_back_on_its_first_way() {
    let memory = MemoryStore::new();
    let store = SlowUnsentRefund {
        inner: memory.clone(),
        first: Arc::new(std::sync::atomic::AtomicBool::new(true)),
    };
    let account = policy(store, "account")
        .refund_server_errors(true)
        .store_timeout(Some(Duration::from_millis(50)))
        .build();
    let quota = Quota::daily(10);
    // What the store holds (the policy's view counts the give-back on its
    // way as landed).
    let held = || {
        let line = quota.line(
            account.namespace(),
            &Subject::account("acme"),
            NOW.parse().unwrap(),
            0,
        );
        let request = tower_quota::store::ChargeRequest {
            charged_at: None,
            now: NOW.parse().unwrap(),
            lines: vec![line].into(),
        };
        let peek = memory.peek(request);
        async move { peek.await.unwrap()[0].used }
    };
    let app = Router::new()
        .route("/", get(|| async { StatusCode::INTERNAL_SERVER_ERROR }))
        .layer(account.layer(quota.clone()));
    let response = app.oneshot(call("/")).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    // The response left while its give-back was on its way.
    assert_eq!(held().await, 1);
    let owed = account.settle_owed(Duration::from_secs(5)).await;
    assert_eq!(owed.units, 0);
    assert_eq!(
        held().await,
        0,
        "the 500 is given back before the settle returns: the process may exit now"
    );
}
