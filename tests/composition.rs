//! How layers compose, through real axum routers on both stores: a layer
//! hidden behind `Handler::layer`, a shared service, a `Buffer`, a route
//! service, a `Steer` or a nested service answers as a visible one; policies
//! interleaved on one route charge their own customers only; a refusal
//! anywhere, by any policy, leaves nothing charged anywhere, and so does a
//! request dropped while a charge is pending.

#[cfg(feature = "redis")]
mod redis_support;

mod rigged;
mod seeded;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::error_handling::HandleError;
use axum::handler::Handler;
use axum::response::IntoResponse;
use axum::routing::{get, get_service};
use axum::Router;
use http::request::Parts;
use http::{Request, Response, StatusCode};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use rigged::{Rig, Rigged};
use seeded::Rng;
use tokio::sync::Notify;
use tower::buffer::Buffer;
use tower::steer::Steer;
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service, ServiceExt};
use tower_quota::jiff::tz::TimeZone;
use tower_quota::jiff::Timestamp;
use tower_quota::{
    unrouted, FromHeader, ManualClock, Quota, QuotaHandle, QuotaLayer, QuotaPolicy,
    QuotaPolicyBuilder, QuotaStatus, Store, Subject,
};

/// Every policy's clock: 10:00 UTC, 11:00 in Berlin, 19:00 in Tokyo.
const NOW: &str = "2026-12-02T10:00:00Z";

const ACME: &[(&str, &str)] = &[("x-account-id", "acme")];

fn at(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn call(path: &str, headers: &[(&str, &str)]) -> Request<Body> {
    let mut request = Request::get(path);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.body(Body::empty()).unwrap()
}

async fn send(app: &Router, request: Request<Body>) -> Response<Body> {
    app.clone().oneshot(request).await.unwrap()
}

async fn body(response: Response<Body>) -> String {
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

fn header(response: &Response<Body>, name: &str) -> String {
    response
        .headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

/// A policy on `store` with its own namespace, at [`NOW`].
fn policy<St: Store>(store: St, namespace: &str) -> QuotaPolicyBuilder<FromHeader, St> {
    QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .namespace(namespace)
        .clock(ManualClock::new(at(NOW)))
        // Generous: a loaded machine must not turn a slow Redis into a 503.
        .store_timeout(Some(Duration::from_secs(5)))
}

/// What `account` has spent on the quota `name` of `policy`.
async fn used<St: Store>(policy: &QuotaPolicy<FromHeader, St>, account: &str, name: &str) -> u64 {
    let usage = policy
        .handle()
        .usage(&Subject::account(account))
        .await
        .unwrap();
    usage
        .iter()
        .find(|u| u.name() == name)
        .unwrap_or_else(|| panic!("no quota {name} in {usage:?}"))
        .used()
}

/// Waits (a few seconds at most) until `account` has spent `expected` on
/// `name`: a give-back of a dropped request runs as a task of its own.
async fn settles_at<St: Store>(
    policy: &QuotaPolicy<FromHeader, St>,
    account: &str,
    name: &str,
    expected: u64,
) -> u64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let now = used(policy, account, name).await;
        if now == expected || tokio::time::Instant::now() > deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The handler: every entry of its status as `name:used/limit`, in order.
async fn entries(status: QuotaStatus) -> String {
    status
        .entries()
        .iter()
        .map(|e| format!("{}:{}/{}", e.name(), e.used(), e.limit()))
        .collect::<Vec<_>>()
        .join(",")
}

/// A service shared behind a lock: its clones share one inner service, so
/// nothing outside can see what it wraps. Each call readies a clone of it
/// first (as a `Buffer`'s worker does): readiness is per instance in tower,
/// and one shared by every clone would let a clone call it unreadied.
struct Shared<S>(Arc<Mutex<S>>);

impl<S> Shared<S> {
    fn new(inner: S) -> Self {
        Self(Arc::new(Mutex::new(inner)))
    }
}

impl<S> Clone for Shared<S> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<S, R> Service<R> for Shared<S>
where
    S: Service<R> + Clone + Send + 'static,
    S::Future: Send,
    R: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: R) -> Self::Future {
        let inner = self.0.lock().unwrap().clone();
        Box::pin(inner.oneshot(request))
    }
}

/// A `Steer` made `Sync` (it holds a `PhantomData` of its request, which
/// is not): each clone its own, as the `Steer` itself.
struct Synced<S>(Mutex<S>);

impl<S: Clone> Clone for Synced<S> {
    fn clone(&self) -> Self {
        Self(Mutex::new(self.0.lock().unwrap().clone()))
    }
}

impl<S: Service<R>, R> Service<R> for Synced<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.get_mut().unwrap().poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        self.0.get_mut().unwrap().call(request)
    }
}

type Boxed = BoxCloneSyncService<Request<Body>, axum::response::Response, Infallible>;

fn boxed<S>(service: S) -> Boxed
where
    S: Service<Request<Body>, Error = Infallible> + Clone + Send + Sync + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
{
    BoxCloneSyncService::new(service.map_response(IntoResponse::into_response))
}

async fn buffer_failed(error: tower::BoxError) -> (StatusCode, String) {
    (StatusCode::INTERNAL_SERVER_ERROR, error.to_string())
}

/// How the `search` burst layer is applied to `/search`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hiding {
    /// (a) `route_layer`, in plain sight.
    RouteLayer,
    /// (b) `get(handler.layer(..))`.
    HandlerLayer,
    /// (c) behind a service whose clones share one `Arc<Mutex<_>>`.
    Shared,
    /// (d) behind `tower::buffer::Buffer`.
    Buffered,
    /// (e) the layered service given to `Router::route_service`.
    RouteService,
    /// (f) one of the services of a `tower::steer::Steer`.
    Steered,
    /// (g) the layered service given to `Router::nest_service`.
    NestedService,
}

/// A router-wide daily `read` quota around a per-minute `search` burst
/// quota on `/search`, the burst layer applied as `hiding` says.
fn search_app<St: Store>(
    store: St,
    namespace: &str,
    hiding: Hiding,
    read: u64,
    burst: u64,
) -> (Router, QuotaPolicy<FromHeader, St>) {
    let policy = policy(store, namespace).build();
    let burst = policy.layer(Quota::per_minute(burst).allowance("search"));
    let searching = |burst: &QuotaLayer<FromHeader, St>| burst.layer(get(entries).with_state(()));
    let search = match hiding {
        Hiding::RouteLayer => Router::new()
            .route("/search", get(entries))
            .route_layer(burst),
        Hiding::HandlerLayer => Router::new().route("/search", get(entries.layer(burst))),
        Hiding::Shared => {
            Router::new().route("/search", get_service(Shared::new(searching(&burst))))
        }
        Hiding::Buffered => Router::new().route_service(
            "/search",
            HandleError::new(Buffer::new(searching(&burst), 16), buffer_failed),
        ),
        Hiding::RouteService => Router::new().route_service("/search", searching(&burst)),
        Hiding::Steered => {
            let nowhere = boxed(tower::service_fn(|_: Request<Body>| async {
                Ok::<_, Infallible>(StatusCode::NOT_FOUND.into_response())
            }));
            let steer = Steer::new(
                [boxed(searching(&burst)), nowhere],
                |request: &Request<Body>, _: &[Boxed]| {
                    usize::from(request.uri().path() != "/search")
                },
            );
            Router::new().route_service("/search", Synced(Mutex::new(steer)))
        }
        Hiding::NestedService => Router::new().nest_service("/search", searching(&burst)),
    };
    let app = Router::new()
        .route("/read", get(entries))
        .merge(search)
        .route_layer(policy.layer(Quota::daily(read).allowance("read")))
        .method_not_allowed_fallback(unrouted::MethodNotAllowed);
    (app, policy)
}

/// Three searches and a read by acme on the app with `hiding`, a daily
/// `read` of 10 and a burst of 2: each answer (status, fields, body: the
/// handler's status entries or the problem document) and both counters
/// after it.
async fn observe<St: Store>(store: St, namespace: &str, hiding: Hiding) -> Vec<String> {
    let (app, policy) = search_app(store, namespace, hiding, 10, 2);
    let mut seen = Vec::new();
    for path in ["/search", "/search", "/search", "/read"] {
        let response = send(&app, call(path, ACME)).await;
        let status = response.status();
        let fields = header(&response, "ratelimit");
        let policies = header(&response, "ratelimit-policy");
        let retry = header(&response, "retry-after");
        let text = body(response).await;
        let read = used(&policy, "acme", "read-day").await;
        let search = used(&policy, "acme", "search-minute").await;
        seen.push(format!(
            "GET {path} -> {status}; ratelimit: {fields}; ratelimit-policy: {policies}; \
             retry-after: {retry}; body: {text}; spent: read-day={read} search-minute={search}"
        ));
    }
    seen
}

/// What the visible nest answers.
fn check_visible(seen: &[String]) {
    let expect = [
        "GET /search -> 200 OK; ratelimit: \"read-day\";r=9;t=50400, \"search-minute\";r=1;t=60; \
         ratelimit-policy: \"read-day\";q=10;w=86400, \"search-minute\";q=2;w=60; retry-after: ; \
         body: read-day:1/10,search-minute:1/2; spent: read-day=1 search-minute=1",
        "GET /search -> 200 OK; ratelimit: \"read-day\";r=8;t=50400, \"search-minute\";r=0;t=60; \
         ratelimit-policy: \"read-day\";q=10;w=86400, \"search-minute\";q=2;w=60; retry-after: ; \
         body: read-day:2/10,search-minute:2/2; spent: read-day=2 search-minute=2",
    ];
    assert_eq!(seen[..2], expect);
    let refused = &seen[2];
    assert!(
        refused.starts_with(
            "GET /search -> 429 Too Many Requests; \
             ratelimit: \"read-day\";r=8;t=50400, \"search-minute\";r=0;t=60; \
             ratelimit-policy: \"read-day\";q=10;w=86400, \"search-minute\";q=2;w=60; \
             retry-after: 60; body: {"
        ),
        "{refused}"
    );
    assert!(
        refused.contains("\"violated-policies\":[\"search-minute\"]"),
        "{refused}"
    );
    assert!(
        refused.ends_with("spent: read-day=2 search-minute=2"),
        "the refused search spent no read: {refused}"
    );
    assert_eq!(
        seen[3],
        "GET /read -> 200 OK; ratelimit: \"read-day\";r=7;t=50400; \
         ratelimit-policy: \"read-day\";q=10;w=86400; retry-after: ; \
         body: read-day:3/10; spent: read-day=3 search-minute=2"
    );
}

/// The app with `hiding` answers exactly as the one with a visible
/// `route_layer`, on the same store.
async fn answers_as_visible<St: Store>(store: St, hiding: Hiding) {
    let visible = observe(store.clone(), "visible", Hiding::RouteLayer).await;
    check_visible(&visible);
    let hidden = observe(store, "hidden", hiding).await;
    for (i, (hidden, visible)) in hidden.iter().zip(&visible).enumerate() {
        assert_eq!(hidden, visible, "request {i}, burst layer {hiding:?}");
    }
}

async fn a_visible_nest_answers_as_documented<St: Store>(store: St) {
    check_visible(&observe(store, "visible", Hiding::RouteLayer).await);
}

async fn a_handler_layer_answers_as_a_route_layer<St: Store>(store: St) {
    answers_as_visible(store, Hiding::HandlerLayer).await;
}

async fn a_shared_service_answers_as_a_route_layer<St: Store>(store: St) {
    answers_as_visible(store, Hiding::Shared).await;
}

async fn a_buffer_answers_as_a_route_layer<St: Store>(store: St) {
    answers_as_visible(store, Hiding::Buffered).await;
}

async fn a_route_service_answers_as_a_route_layer<St: Store>(store: St) {
    answers_as_visible(store, Hiding::RouteService).await;
}

async fn a_steer_answers_as_a_route_layer<St: Store>(store: St) {
    answers_as_visible(store, Hiding::Steered).await;
}

async fn a_nested_service_answers_as_a_route_layer<St: Store>(store: St) {
    answers_as_visible(store, Hiding::NestedService).await;
}

/// Skips requests whose `x-region` is not `region`.
fn not_from(region: &'static str) -> impl Fn(&Parts) -> bool + Send + Sync + 'static {
    move |parts| {
        parts
            .headers
            .get("x-region")
            .is_none_or(|v| v.as_bytes() != region.as_bytes())
    }
}

async fn interleaved_policies_charge_their_own_customers<St: Store>(store: St) {
    // One policy per region, each counting days in its customers' zone;
    // on /search the EU's burst layer sits inside the APAC's read layer.
    let eu = policy(store.clone(), "eu").skip_if(not_from("eu")).build();
    let apac = policy(store, "apac").skip_if(not_from("apac")).build();
    let berlin = TimeZone::get("Europe/Berlin").unwrap();
    let tokyo = TimeZone::get("Asia/Tokyo").unwrap();
    let app = Router::new()
        .route("/search", get(entries))
        .route_layer(eu.layer(Quota::per_minute(2).allowance("eu-search")))
        .route("/read", get(entries))
        .route_layer(apac.layer(Quota::daily(100).allowance("apac-read").in_time_zone(tokyo)))
        .route_layer(eu.layer(Quota::daily(100).allowance("eu-read").in_time_zone(berlin)));
    let acme: &[(&str, &str)] = &[("x-account-id", "acme"), ("x-region", "eu")];
    let globex: &[(&str, &str)] = &[("x-account-id", "globex"), ("x-region", "apac")];

    for n in 1..=2 {
        let admitted = send(&app, call("/search", acme)).await;
        assert_eq!(admitted.status(), StatusCode::OK);
        assert_eq!(
            header(&admitted, "ratelimit"),
            format!(
                "\"eu-read-day\";r={};t=46800, \"eu-search-minute\";r={};t=60",
                100 - n,
                2 - n
            )
        );
        assert_eq!(
            body(admitted).await,
            format!("eu-read-day:{n}/100,eu-search-minute:{n}/2"),
            "the status lists the quotas that charged acme, no other"
        );
    }
    let refused = send(&app, call("/search", acme)).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        header(&refused, "ratelimit"),
        "\"eu-read-day\";r=98;t=46800, \"eu-search-minute\";r=0;t=60"
    );
    assert!(body(refused)
        .await
        .contains("\"violated-policies\":[\"eu-search-minute\"]"));
    assert_eq!(
        used(&eu, "acme", "eu-read-day").await,
        2,
        "the refusal spent nothing"
    );
    assert_eq!(used(&eu, "acme", "eu-search-minute").await, 2);

    // APAC's customers pass the EU's burst layer uncounted.
    for n in 1..=3 {
        let admitted = send(&app, call("/search", globex)).await;
        assert_eq!(admitted.status(), StatusCode::OK);
        assert_eq!(
            header(&admitted, "ratelimit"),
            format!("\"apac-read-day\";r={};t=18000", 100 - n)
        );
        assert_eq!(body(admitted).await, format!("apac-read-day:{n}/100"));
    }
    let read = send(&app, call("/read", acme)).await;
    assert_eq!(body(read).await, "eu-read-day:3/100");

    assert_eq!(used(&eu, "acme", "eu-read-day").await, 3);
    assert_eq!(used(&eu, "acme", "eu-search-minute").await, 2);
    assert_eq!(used(&apac, "acme", "apac-read-day").await, 0);
    assert_eq!(used(&apac, "globex", "apac-read-day").await, 3);
    assert_eq!(used(&eu, "globex", "eu-read-day").await, 0);
    assert_eq!(used(&eu, "globex", "eu-search-minute").await, 0);

    // A customer of neither region is nobody's.
    let nobody = send(&app, call("/search", ACME)).await;
    assert_eq!(nobody.status(), StatusCode::OK);
    assert!(!nobody.headers().contains_key("ratelimit"));
    assert_eq!(body(nobody).await, "");
    assert_eq!(used(&eu, "acme", "eu-read-day").await, 3);
}

async fn a_nested_refusal_tells_what_is_truly_left<St: Store>(store: St) {
    let (app, policy) = search_app(store, "fields", Hiding::RouteLayer, 100, 2);
    for _ in 0..2 {
        assert_eq!(
            send(&app, call("/search", ACME)).await.status(),
            StatusCode::OK
        );
    }
    let refused = send(&app, call("/search", ACME)).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    // Before the give-back the read counter held 3: the field tells 98.
    assert_eq!(
        header(&refused, "ratelimit"),
        "\"read-day\";r=98;t=50400, \"search-minute\";r=0;t=60"
    );
    assert_eq!(
        header(&refused, "ratelimit-policy"),
        "\"read-day\";q=100;w=86400, \"search-minute\";q=2;w=60"
    );
    assert_eq!(header(&refused, "retry-after"), "60");
    assert_eq!(used(&policy, "acme", "read-day").await, 2);
}

async fn another_policys_refusal_gives_the_outer_charge_back<St: Store>(store: St) {
    // An account's daily reads around a partner's burst limit, in plain
    // sight and with the partner's layer hidden.
    for hidden in [false, true] {
        let account = policy(store.clone(), &format!("account-{hidden}")).build();
        let partner = policy(store.clone(), &format!("partner-{hidden}")).build();
        let burst = partner.layer(Quota::per_minute(1).allowance("burst"));
        let search = if hidden {
            Router::new().route_service(
                "/search",
                Shared::new(burst.layer(get(entries).with_state(()))),
            )
        } else {
            Router::new()
                .route("/search", get(entries))
                .route_layer(burst)
        };
        let app = search.route_layer(account.layer(Quota::daily(10).allowance("read")));
        let admitted = send(&app, call("/search", ACME)).await;
        assert_eq!(admitted.status(), StatusCode::OK);
        assert_eq!(body(admitted).await, "read-day:1/10,burst-minute:1/1");
        let refused = send(&app, call("/search", ACME)).await;
        assert_eq!(
            refused.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "hidden: {hidden}"
        );
        // The account's layer writes its own field, once given back.
        assert_eq!(
            header(&refused, "ratelimit"),
            "\"read-day\";r=9;t=50400, \"burst-minute\";r=0;t=60",
            "hidden: {hidden}"
        );
        assert!(body(refused)
            .await
            .contains("\"violated-policies\":[\"burst-minute\"]"));
        assert_eq!(
            used(&account, "acme", "read-day").await,
            1,
            "the partner's refusal spent no read (hidden: {hidden})"
        );
        assert_eq!(used(&partner, "acme", "burst-minute").await, 1);
    }
}

async fn another_policys_store_failure_gives_the_outer_charge_back<St: Store>(store: St) {
    let account = policy(store.clone(), "account").build();
    let partner = policy(Rigged::new(store, Rig::Fail, None), "partner").build();
    let app = Router::new()
        .route("/search", get(entries))
        .route_layer(partner.layer(Quota::per_minute(5).allowance("burst")))
        .route_layer(account.layer(Quota::daily(10).allowance("read")));
    let unavailable = send(&app, call("/search", ACME)).await;
    assert_eq!(unavailable.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        used(&account, "acme", "read-day").await,
        0,
        "the partner's 503 spent no read"
    );
}

async fn a_store_failure_inside_gives_back_what_the_policy_charged<St: Store>(store: St) {
    let policy = policy(Rigged::new(store, Rig::Fail, Some("search")), "failing").build();
    let app = Router::new()
        .route("/search", get(entries))
        .route_layer(policy.layer(Quota::per_minute(5).allowance("search")))
        .route_layer(policy.layer(Quota::daily(10).allowance("read")));
    let unavailable = send(&app, call("/search", ACME)).await;
    assert_eq!(unavailable.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        used(&policy, "acme", "read-day").await,
        0,
        "the inner layer's 503 spent no read"
    );
}

async fn a_refusal_inside_two_policies_gives_both_back<St: Store>(store: St) {
    // The account's read layer, the partner's layer, then the account's
    // burst layer, which refuses.
    let account = policy(store.clone(), "account").build();
    let partner = policy(store, "partner").build();
    let app = Router::new()
        .route("/search", get(entries))
        .route_layer(account.layer(Quota::per_minute(1).allowance("search")))
        .route_layer(partner.layer(Quota::daily(10).allowance("partner")))
        .route_layer(account.layer(Quota::daily(10).allowance("read")));
    let admitted = send(&app, call("/search", ACME)).await;
    assert_eq!(admitted.status(), StatusCode::OK);
    let refused = send(&app, call("/search", ACME)).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(used(&account, "acme", "read-day").await, 1);
    assert_eq!(used(&account, "acme", "search-minute").await, 1);
    assert_eq!(
        used(&partner, "acme", "partner-day").await,
        1,
        "the partner's layer gave its charge back"
    );
}

/// Sends a search to `app` and drops its response future once the rigged
/// store met the charge it stalls.
async fn dropped_while_charging(app: &Router, met: &Notify) {
    let pending = tokio::spawn(app.clone().oneshot(call("/search", ACME)));
    met.notified().await;
    pending.abort();
    assert!(pending.await.unwrap_err().is_cancelled());
}

async fn a_dropped_request_gives_back_what_its_policy_charged<St: Store>(store: St) {
    let rigged = Rigged::new(store, Rig::Stall, Some("search"));
    let met = Arc::clone(&rigged.met);
    let policy = policy(rigged, "dropped").store_timeout(None).build();
    let app = Router::new()
        .route("/search", get(entries))
        .route_layer(policy.layer(Quota::per_minute(5).allowance("search")))
        .route_layer(policy.layer(Quota::daily(10).allowance("read")));
    dropped_while_charging(&app, &met).await;
    assert_eq!(
        settles_at(&policy, "acme", "read-day", 0).await,
        0,
        "the read charge of a request never admitted is given back"
    );
}

async fn a_dropped_request_gives_back_what_another_policy_charged<St: Store>(store: St) {
    let account = policy(store.clone(), "account").build();
    let rigged = Rigged::new(store, Rig::Stall, None);
    let met = Arc::clone(&rigged.met);
    let partner = policy(rigged, "partner").store_timeout(None).build();
    let app = Router::new()
        .route("/search", get(entries))
        .route_layer(partner.layer(Quota::per_minute(5).allowance("burst")))
        .route_layer(account.layer(Quota::daily(10).allowance("read")));
    dropped_while_charging(&app, &met).await;
    assert_eq!(
        settles_at(&account, "acme", "read-day", 0).await,
        0,
        "the read charge of a request never admitted is given back"
    );
}

macro_rules! on_every_store {
    ($($(#[$meta:meta])* $case:ident),* $(,)?) => {
        mod memory {
            $(
                $(#[$meta])*
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
                $(#[$meta])*
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let server = redis_server_or_skip!();
                    super::$case(crate::redis_store(&server)).await;
                }
            )*
        }
    };
}

#[cfg(feature = "redis")]
fn redis_store(server: &redis_support::RedisServer) -> tower_quota::store::RedisStore {
    tower_quota::store::RedisStore::builder(server.url())
        .wait_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

on_every_store!(
    a_visible_nest_answers_as_documented,
    a_handler_layer_answers_as_a_route_layer,
    a_shared_service_answers_as_a_route_layer,
    a_buffer_answers_as_a_route_layer,
    a_route_service_answers_as_a_route_layer,
    a_steer_answers_as_a_route_layer,
    a_nested_service_answers_as_a_route_layer,
    interleaved_policies_charge_their_own_customers,
    a_nested_refusal_tells_what_is_truly_left,
    another_policys_refusal_gives_the_outer_charge_back,
    another_policys_store_failure_gives_the_outer_charge_back,
    a_store_failure_inside_gives_back_what_the_policy_charged,
    a_refusal_inside_two_policies_gives_both_back,
    a_dropped_request_gives_back_what_its_policy_charged,
    a_dropped_request_gives_back_what_another_policy_charged,
);

#[tokio::test]
async fn layers_on_two_stores_each_count_on_their_own_whatever_their_keys() {
    // Two quick layers, each with a store of its own: the same key in
    // each store (default namespace and allowance), two counters.
    let app = Router::new()
        .route("/", get(entries))
        .route_layer(QuotaLayer::daily(1, FromHeader::account("x-account-id")))
        .layer(QuotaLayer::daily(100, FromHeader::account("x-account-id")));
    let admitted = send(&app, call("/", ACME)).await;
    assert_eq!(admitted.status(), StatusCode::OK);
    // The system clock's: only what is left is compared.
    let left = |field: String| -> Vec<String> {
        field
            .split(", ")
            .map(|item| item.split(";t=").next().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        left(header(&admitted, "ratelimit")),
        ["\"default-day\";r=99", "\"default-day\";r=0"]
    );
    let refused = send(&app, call("/", ACME)).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    // The inner store's refusal gave the outer charge back.
    assert_eq!(
        left(header(&refused, "ratelimit")),
        ["\"default-day\";r=99", "\"default-day\";r=0"]
    );
}

#[tokio::test]
async fn a_counter_charged_further_out_counts_once_after_a_failure_in_between() {
    // Two policies on one store share the daily `read` counter. Between
    // them, a layer of the outer policy fails open, without a ledger: the
    // read charged further out still counts for the inner policy.
    let memory = tower_quota::MemoryStore::new();
    let outer = policy(
        Rigged::new(memory.clone(), Rig::Fail, Some("burst")),
        "shared",
    )
    .on_store_error(tower_quota::OnStoreError::FailOpen)
    .max_owed_counters(0)
    .build();
    let inner = policy(memory.clone(), "shared").build();
    let app = Router::new()
        .route("/search", get(entries))
        .route_layer(inner.layer(Quota::daily(10).allowance("read")))
        .route_layer(outer.layer(Quota::per_minute(5).allowance("burst")))
        .route_layer(outer.layer(Quota::daily(10).allowance("read")));
    let admitted = send(&app, call("/search", ACME)).await;
    assert_eq!(admitted.status(), StatusCode::OK);
    assert_eq!(
        used(&inner, "acme", "read-day").await,
        1,
        "one request, one unit"
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_dropped_while_an_inner_layer_settles_spends_nothing_anywhere() {
    // The outer policy on a memory store; the inner one on a store whose
    // changes take 200 ms, with a cost known from the response (3, for 1
    // up front). A timeout around both drops the request while the inner
    // layer waits for its add: the client got no answer, so neither
    // policy keeps a charge.
    let rigged = Rigged::new(tower_quota::MemoryStore::new(), Rig::Fail, Some("never"));
    rigged.slow_changes.store(200, Ordering::Relaxed);
    let inner = policy(rigged, "inner").build();
    let outer = policy(tower_quota::MemoryStore::new(), "outer").build();
    let app = Router::new()
        .route("/search", get(entries))
        .route_layer(
            inner
                .layer(Quota::daily(10).allowance("tokens"))
                .deferred_cost(1, |_| 3),
        )
        .route_layer(outer.layer(Quota::daily(10).allowance("read")));
    let answer = tokio::time::timeout(Duration::from_millis(50), send(&app, call("/search", ACME)));
    assert!(answer.await.is_err(), "dropped before the answer");
    // The add lands, then what the inner layer charged goes back.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(used(&outer, "acme", "read-day").await, 0);
    assert_eq!(used(&inner, "acme", "tokens-day").await, 0);
}

#[tokio::test]
async fn status_entries_come_policy_by_policy() {
    let account = policy(tower_quota::MemoryStore::new(), "account").build();
    let partner = policy(tower_quota::MemoryStore::new(), "partner").build();
    let app = Router::new()
        .route("/search", get(entries))
        .route_layer(account.layer(Quota::per_minute(5).allowance("search")))
        .route_layer(partner.layer(Quota::daily(10).allowance("partner")))
        .route_layer(account.layer(Quota::daily(10).allowance("read")));
    let admitted = send(&app, call("/search", ACME)).await;
    assert_eq!(
        header(&admitted, "ratelimit"),
        "\"read-day\";r=9;t=50400, \"partner-day\";r=9;t=50400, \"search-minute\";r=4;t=60"
    );
    assert_eq!(
        body(admitted).await,
        "read-day:1/10,search-minute:1/5,partner-day:1/10",
        "policy by policy, in the order the request met them; outer layers first within one"
    );
}

/// One layer of a random nest, outer first.
#[derive(Clone, Debug)]
struct Level {
    /// Of the second policy (else of the first).
    other: bool,
    /// 0: per minute, 1: hourly, 2: daily.
    period: usize,
    limit: u64,
    cost: u64,
    /// Behind a [`Shared`] service.
    hidden: bool,
}

/// A nest and what is sent through it: per request, the account (0 or 1)
/// and how many layers it passes before a handler answers it.
#[derive(Clone, Debug)]
struct Nest {
    levels: Vec<Level>,
    requests: Vec<(usize, usize)>,
}

fn nests() -> impl Strategy<Value = Nest> {
    let level = || (0..3usize, 1..=4u64, 1..=2u64, any::<bool>());
    (
        prop::collection::vec(level(), 1..=4),
        prop::option::of((level(), 0..5usize)),
        prop::collection::vec((0..2usize, 0..5usize), 1..=10),
    )
        .prop_map(|(own, other, requests)| {
            let mut levels: Vec<Level> = own
                .into_iter()
                .map(|(period, limit, cost, hidden)| Level {
                    other: false,
                    period,
                    limit,
                    cost,
                    hidden,
                })
                .collect();
            if let Some(((period, limit, cost, hidden), at)) = other {
                let at = at % (levels.len() + 1);
                levels.insert(
                    at,
                    Level {
                        other: true,
                        period,
                        limit,
                        cost,
                        hidden,
                    },
                );
            }
            let depth = levels.len();
            let requests = requests
                .into_iter()
                .map(|(account, passes)| (account, 1 + passes % depth))
                .collect();
            Nest { levels, requests }
        })
}

/// How many layers a request passes: its `x-depth`.
fn depth(request: &Request<Body>) -> usize {
    request.headers()["x-depth"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// Builds the nest: level `k` answers a request of depth `k + 1` with the
/// handler and passes deeper ones on. Returns the service and each level's
/// quota name.
fn build_nest<St: Store>(
    levels: &[Level],
    own: &QuotaPolicy<FromHeader, St>,
    other: &QuotaPolicy<FromHeader, St>,
) -> (Boxed, Vec<String>) {
    let handler = boxed(get(entries).with_state(()));
    let quotas: Vec<Quota> = levels
        .iter()
        .enumerate()
        .map(|(k, level)| {
            let quota = match level.period {
                0 => Quota::per_minute(level.limit),
                1 => Quota::hourly(level.limit),
                _ => Quota::daily(level.limit),
            };
            quota.allowance(format!("level{k}"))
        })
        .collect();
    let names = quotas.iter().map(|q| q.name().to_owned()).collect();
    let mut service: Option<Boxed> = None;
    for (k, (level, quota)) in levels.iter().zip(quotas).enumerate().rev() {
        let inner = match service.take() {
            None => handler.clone(),
            Some(deeper) => boxed(Synced(Mutex::new(Steer::new(
                [handler.clone(), deeper],
                move |request: &Request<Body>, _: &[Boxed]| usize::from(depth(request) > k + 1),
            )))),
        };
        let policy = if level.other { other } else { own };
        let layered = policy.layer(quota).cost(level.cost).layer(inner);
        service = Some(if level.hidden {
            boxed(Shared::new(layered))
        } else {
            boxed(layered)
        });
    }
    (service.expect("at least one level"), names)
}

const ACCOUNTS: [&str; 2] = ["acme", "globex"];

/// Sends the nest's requests, and after each checks every counter against
/// a model: an admitted request spends each layer's cost on each layer it
/// passed; a refused one spends nothing anywhere.
async fn check_nest<St: Store>(store: St, case: usize, nest: Nest) -> Result<(), TestCaseError> {
    let own = policy(store.clone(), &format!("nest{case}-own")).build();
    let other = policy(store, &format!("nest{case}-other")).build();
    let (service, names) = build_nest(&nest.levels, &own, &other);
    let mut spent = vec![[0u64; 2]; nest.levels.len()];
    for (i, &(account, depth)) in nest.requests.iter().enumerate() {
        let passed = &nest.levels[..depth];
        let refuser = passed
            .iter()
            .enumerate()
            .find(|(k, level)| spent[*k][account] + level.cost > level.limit)
            .map(|(k, _)| k);
        let request = Request::get("/")
            .header("x-account-id", ACCOUNTS[account])
            .header("x-depth", depth.to_string())
            .body(Body::empty())
            .unwrap();
        let response = service.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let text = body(response).await;
        match refuser {
            None => {
                prop_assert_eq!(status, StatusCode::OK, "request {}: {}", i, text);
                for (k, level) in passed.iter().enumerate() {
                    spent[k][account] += level.cost;
                }
                let mut listed: Vec<&str> = text
                    .split(',')
                    .map(|entry| entry.split(':').next().unwrap())
                    .collect();
                let mut expected: Vec<&str> = names[..depth].iter().map(String::as_str).collect();
                listed.sort_unstable();
                expected.sort_unstable();
                prop_assert_eq!(
                    listed,
                    expected,
                    "request {}: the status lists the quotas charged",
                    i
                );
            }
            Some(k) => {
                prop_assert_eq!(
                    status,
                    StatusCode::TOO_MANY_REQUESTS,
                    "request {}: {}",
                    i,
                    text
                );
                let violated = format!("\"violated-policies\":[\"{}\"]", names[k]);
                prop_assert!(text.contains(&violated), "request {}: {}", i, text);
            }
        }
        for (k, level) in nest.levels.iter().enumerate() {
            let policy = if level.other { &other } else { &own };
            for (a, name) in ACCOUNTS.iter().enumerate() {
                prop_assert_eq!(
                    used(policy, name, &names[k]).await,
                    spent[k][a],
                    "after request {}, {}'s counter of level {}",
                    i,
                    name,
                    k
                );
            }
        }
    }
    Ok(())
}

fn run_nests<St: Store>(runtime: &tokio::runtime::Runtime, store: St) {
    let mut runner = TestRunner::new(Config {
        cases: 48,
        failure_persistence: None,
        ..Config::default()
    });
    let cases = AtomicUsize::new(0);
    runner
        .run(&nests(), |nest| {
            let case = cases.fetch_add(1, Ordering::Relaxed);
            runtime.block_on(check_nest(store.clone(), case, nest))
        })
        .unwrap();
}

#[test]
fn random_nests_charge_exactly_the_admitted_requests_on_the_memory_store() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    run_nests(&runtime, tower_quota::MemoryStore::new());
}

#[cfg(feature = "redis")]
#[test]
fn random_nests_charge_exactly_the_admitted_requests_on_redis() {
    let server = crate::redis_server_or_skip!();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store = {
        let _entered = runtime.enter();
        redis_store(&server)
    };
    run_nests(&runtime, store);
}

/// The same quota in two layers of one policy counts once, at the cost of
/// the outer layer: the inner layer's cost (fixed or deferred) is not
/// charged on top.
#[tokio::test]
async fn the_same_quota_in_two_layers_counts_at_the_outer_layers_cost() {
    let p = policy(tower_quota::MemoryStore::new(), "outer-cost").build();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route_layer(p.layer(Quota::daily(10)).cost(8))
        .route_layer(p.layer(Quota::daily(10)).deferred_cost(1, |_| 1))
        .layer(p.layer(Quota::daily(10)).cost(2));
    for left in [8, 6, 4] {
        let response = send(&app, call("/", ACME)).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            header(&response, "ratelimit"),
            format!("\"default-day\";r={left};t=50400")
        );
    }
    assert_eq!(used(&p, "acme", "default-day").await, 6);
}

/// A wrong method spends nothing however the layer is applied: also where
/// it wraps a whole method router (`route_service`, `nest_service`), which
/// answers the 405 inside the layer, out of reach of the router's
/// `method_not_allowed_fallback`, given its own. (Such a layer sees the
/// request before the method router does: without a subject it answers
/// 401, where a `route_layer` never sees a wrong method.)
#[tokio::test]
async fn a_wrong_method_spends_nothing_however_the_layer_is_applied() {
    async fn entries(status: QuotaStatus) -> String {
        format!("{}", status.entries().len())
    }
    for hidden in 0..4 {
        let policy = policy(tower_quota::MemoryStore::new(), "method").build();
        let burst = policy.layer(Quota::per_minute(2).allowance("search"));
        let whole = || {
            get(entries)
                .fallback(unrouted::MethodNotAllowed)
                .with_state(())
        };
        let search = match hidden {
            0 => Router::new()
                .route("/search", get(entries))
                .route_layer(burst),
            1 => Router::new().route("/search", get(entries.layer(burst))),
            2 => Router::new().route_service("/search", burst.layer(whole())),
            _ => Router::new().nest_service("/search", burst.layer(whole())),
        };
        let app = Router::new()
            .route("/read", get(entries))
            .merge(search)
            .route_layer(policy.layer(Quota::daily(10).allowance("read")))
            .method_not_allowed_fallback(unrouted::MethodNotAllowed);
        let post = Request::post("/search")
            .header("x-account-id", "acme")
            .body(Body::empty())
            .unwrap();
        let response = send(&app, post).await;
        assert_eq!(
            response.status(),
            StatusCode::METHOD_NOT_ALLOWED,
            "{hidden}"
        );
        assert_eq!(header(&response, "ratelimit"), "", "{hidden}");
        assert_eq!(used(&policy, "acme", "read-day").await, 0, "{hidden}");
        assert_eq!(used(&policy, "acme", "search-minute").await, 0, "{hidden}");
        // The search itself is charged on both.
        let found = send(&app, call("/search", ACME)).await;
        assert_eq!(found.status(), StatusCode::OK, "{hidden}");
        assert_eq!(body(found).await, "2", "{hidden}");
        assert_eq!(used(&policy, "acme", "read-day").await, 1, "{hidden}");
    }
}

/// A handler that does its work and answers 405 (the resource no longer
/// allows the operation) is charged, as for its own 404: only the
/// router's answers, marked by the `unrouted` handlers, are given back.
#[tokio::test]
async fn a_handlers_own_405_is_charged() {
    let served = Arc::new(AtomicUsize::new(0));
    let policy = policy(tower_quota::MemoryStore::new(), "own405").build();
    let work = {
        let served = Arc::clone(&served);
        move || {
            let served = Arc::clone(&served);
            async move {
                served.fetch_add(1, Ordering::SeqCst);
                (
                    StatusCode::METHOD_NOT_ALLOWED,
                    "this job can no longer be cancelled",
                )
            }
        }
    };
    let app = Router::new()
        .route("/jobs/7/cancel", get(work))
        .route_layer(policy.layer(Quota::daily(2).allowance("jobs")));
    for _ in 0..5 {
        send(&app, call("/jobs/7/cancel", ACME)).await;
    }
    assert_eq!(
        (
            served.load(Ordering::SeqCst),
            used(&policy, "acme", "jobs-day").await
        ),
        (2, 2),
        "(times the handler ran, units counted) with a limit of 2"
    );
}

/// Two policies on a route charge at their own instants: an
/// authentication call between their layers that takes the inner one past
/// midnight has it charge the next day, and its handle tells that instant,
/// which undoes the request on its counters.
#[tokio::test]
async fn each_policy_tells_the_instant_it_charged() {
    let clock = ManualClock::new(at("2026-12-02T23:59:59.900Z"));
    let outer = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .namespace("ip")
        .clock(clock.clone())
        .build();
    let inner = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .namespace("acct")
        .clock(clock.clone())
        .build();
    let (slow, handle) = (clock.clone(), inner.handle());
    let undo = move |status: QuotaStatus| {
        let handle = handle.clone();
        async move {
            let at = handle.charged_at(&status).unwrap();
            let back = handle
                .refund_at(&Subject::account("acme"), at, 1)
                .await
                .unwrap();
            format!("{at} {back:?} {}", status.charged_at().unwrap())
        }
    };
    let app = Router::new()
        .route("/", get(undo))
        .route_layer(inner.layer(Quota::daily(10).allowance("calls")))
        .route_layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                slow.advance(Duration::from_millis(200));
                next.run(request)
            },
        ))
        .route_layer(outer.layer(Quota::daily(10).allowance("ip")));
    let response = send(&app, call("/", ACME)).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        body(response).await,
        "2026-12-03T00:00:00.1Z [Some(0)] 2026-12-02T23:59:59.9Z"
    );
    // Read on the day the inner policy charged.
    assert_eq!(used(&inner, "acme", "calls-day").await, 0);
}

/// As above, the outer policy skipping the request (a skip rule): the
/// request's instant is the one the inner policy charged at, the first
/// that counted it, not the outer policy's.
#[tokio::test]
async fn the_request_is_charged_at_the_first_policy_that_counted_it() {
    let clock = ManualClock::new(at("2026-12-02T23:59:59.900Z"));
    let outer = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .namespace("ip")
        .clock(clock.clone())
        .skip_if(|_| true)
        .build();
    let inner = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .namespace("acct")
        .clock(clock.clone())
        .build();
    let slow = clock.clone();
    let app = Router::new()
        .route(
            "/",
            get(|status: QuotaStatus| async move { format!("{:?}", status.charged_at()) }),
        )
        .route_layer(inner.layer(Quota::daily(10).allowance("calls")))
        .route_layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                slow.advance(Duration::from_millis(200));
                next.run(request)
            },
        ))
        .route_layer(outer.layer(Quota::daily(10).allowance("ip")));
    let response = send(&app, call("/", ACME)).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(body(response).await, "Some(2026-12-03T00:00:00.1Z)");
    assert_eq!(used(&inner, "acme", "calls-day").await, 1);
}

// A seeded random model of composed policies: two or three policies (own
// or shared memory stores, namespaces of their own; skip rules, plans,
// per-caller zones, shadow quotas, 5xx refunds or not), their layers
// applied every way there is around one handler, with fixed and deferred
// costs and a middleware rebuilding error answers between layers. After
// each request: the status, every RateLimit and RateLimit-Policy member,
// the handler's QuotaStatus, and every counter through the handles.
//
// `COMPOSITION_MODEL_CASES` sets how many cases run (default 12),
// `COMPOSITION_MODEL_SEED` the first seed, `COMPOSITION_MODEL_TRACE`
// prints each request.

/// How a level's layer is applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Apply {
    RouteLayer,
    RouterLayer,
    /// `Handler::layer`: the innermost level only (else a `route_layer`).
    HandlerLayer,
    NestService,
    Steered,
    Buffered,
    Shared,
}

const APPLY: [Apply; 7] = [
    Apply::RouteLayer,
    Apply::RouterLayer,
    Apply::HandlerLayer,
    Apply::NestService,
    Apply::Steered,
    Apply::Buffered,
    Apply::Shared,
];

/// A policy of the model.
#[derive(Clone, Debug)]
struct MPolicy {
    /// Its store: 0 is shared with the other policies that say 0.
    store: usize,
    /// Its namespace: that of the policy with this index (which then has
    /// the same quotas, read the same way).
    ns: usize,
    /// A request without its subject passes uncounted (else 401).
    allow_missing: bool,
    /// Keyed on `x-user-id` (a user, absent at times), else `x-account-id`.
    user: bool,
    zones: bool,
    plans: bool,
    reject_unknown: bool,
    refund: bool,
}

/// A quota of the model.
#[derive(Clone, Debug)]
struct MQuota {
    allowance: String,
    /// 0: per minute, 1: hourly, 2: daily.
    period: usize,
    limit: u64,
    pro: Option<u64>,
    shadow: bool,
}

impl MQuota {
    fn quota(&self) -> Quota {
        let mut quota = match self.period {
            0 => Quota::per_minute(self.limit),
            1 => Quota::hourly(self.limit),
            _ => Quota::daily(self.limit),
        }
        .allowance(self.allowance.clone());
        if let Some(pro) = self.pro {
            quota = quota.plan("pro", pro);
        }
        if self.shadow {
            quota = quota.shadow();
        }
        quota
    }

    fn name(&self) -> String {
        let period = ["minute", "hour", "day"][self.period];
        format!("{}-{period}", self.allowance)
    }

    fn limit_for(&self, plan: Option<&str>) -> u64 {
        match (plan, self.pro) {
            (Some("pro"), Some(pro)) => pro,
            _ => self.limit,
        }
    }

    /// The counter a caller in `zone` (none: UTC) counts on at `now`: a
    /// minute, or an hour at a whole-hour offset, is one counter in every
    /// zone; a day is its zone's own.
    fn window(&self, zone: Option<&str>, now: Timestamp) -> (String, i64) {
        self.window_and_end(zone, now).0
    }

    /// As [`MQuota::window`], with the instant the window ends.
    fn window_and_end(&self, zone: Option<&str>, now: Timestamp) -> ((String, i64), i64) {
        let tz = zone.map_or(TimeZone::UTC, |z| TimeZone::get(z).unwrap());
        let offset = i64::from(tz.to_offset(now).seconds());
        let local = now.as_second() + offset;
        let len = [60, 3_600, 86_400][self.period];
        let start = local.div_euclid(len) * len - offset;
        let own = match self.period {
            0 => false,
            1 => offset % 3_600 != 0,
            _ => true,
        };
        let zone = if own { zone.unwrap_or("UTC") } else { "" };
        ((zone.to_owned(), start), start + len)
    }
}

#[derive(Clone, Copy, Debug)]
enum MCost {
    Fixed(u64),
    Deferred(u64),
    /// From the request's `x-cost-{level}`: a 400 when it is no number.
    Computed,
}

#[derive(Clone, Debug)]
struct MLevel {
    policy: usize,
    /// Indices into the policy's quotas.
    quotas: Vec<usize>,
    cost: MCost,
    apply: Apply,
    /// A middleware between this layer and what it wraps rebuilds every
    /// error answer (status and fields kept, extensions lost).
    rewrap: bool,
}

#[derive(Clone, Debug)]
struct MCase {
    policies: Vec<MPolicy>,
    quotas: Vec<Vec<MQuota>>,
    levels: Vec<MLevel>,
}

fn random_case(rng: &mut Rng) -> MCase {
    let n = 2 + rng.below(2) as usize;
    let mut policies: Vec<MPolicy> = (0..n)
        .map(|p| MPolicy {
            store: rng.below(2) as usize * (p + 1),
            ns: p,
            allow_missing: rng.below(3) == 0,
            user: p == 2 || rng.below(4) == 0,
            zones: rng.below(2) == 0,
            plans: rng.below(2) == 0,
            reject_unknown: rng.below(2) == 0,
            refund: rng.below(2) == 0,
        })
        .collect();
    // Now and then the second policy shares the first one's store and
    // namespace, and so its quotas: a counter one charged for a request
    // the other does not charge again.
    if rng.below(3) == 0 {
        let first = policies[0].clone();
        let second = &mut policies[1];
        second.store = first.store;
        second.ns = 0;
        second.user = first.user;
        second.zones = first.zones;
        second.plans = first.plans;
    }
    let mut quotas: Vec<Vec<MQuota>> = policies
        .iter()
        .enumerate()
        .map(|(p, policy)| {
            (0..3)
                .map(|j| {
                    let period = rng.below(3) as usize;
                    let limit = [2 + rng.below(4), 3 + rng.below(6), 4 + rng.below(9)][period];
                    MQuota {
                        allowance: format!("p{p}q{j}"),
                        period,
                        limit,
                        pro: (policy.plans && rng.below(2) == 0).then(|| limit * 2),
                        shadow: rng.below(4) == 0,
                    }
                })
                .collect()
        })
        .collect();
    for p in 0..n {
        let ns = policies[p].ns;
        quotas[p] = quotas[ns].clone();
    }
    let depth = 2 + rng.below(5) as usize;
    let levels = (0..depth)
        .map(|k| {
            // Each policy has a layer at least.
            let policy = if k < n {
                k
            } else {
                rng.below(n as u64) as usize
            };
            let first = rng.below(3) as usize;
            let mut picked = vec![first];
            if rng.below(3) == 0 {
                picked.push((first + 1 + rng.below(2) as usize) % 3);
            }
            MLevel {
                policy,
                quotas: picked,
                cost: match rng.below(6) {
                    0 | 1 => MCost::Deferred(1 + rng.below(2)),
                    2 => MCost::Computed,
                    _ => MCost::Fixed(1 + rng.below(2)),
                },
                apply: *rng.pick(&APPLY),
                rewrap: rng.below(5) == 0,
            }
        })
        .collect::<Vec<_>>();
    // Shuffle the levels so that a policy's first layer is not always
    // outermost.
    let mut levels = levels;
    for i in (1..levels.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        levels.swap(i, j);
    }
    MCase {
        policies,
        quotas,
        levels,
    }
}

fn model_policies<St: Store>(
    case: &MCase,
    seed: u64,
    clock: &ManualClock,
    shared: &St,
    own: &dyn Fn() -> St,
) -> Vec<QuotaPolicy<FromHeader, St>> {
    let mut stores: std::collections::HashMap<usize, St> = std::collections::HashMap::new();
    stores.insert(0, shared.clone());
    case.policies
        .iter()
        .enumerate()
        .map(|(p, m)| {
            let store = stores.entry(m.store).or_insert_with(own).clone();
            let extractor = if m.user {
                FromHeader::user("x-user-id")
            } else {
                FromHeader::account("x-account-id")
            };
            let flag = format!("x-skip-{p}");
            let mut builder = QuotaPolicy::builder(extractor)
                .store(store)
                .namespace(&format!("model{seed}-p{}", m.ns))
                .clock(clock.clone())
                .store_timeout(Some(Duration::from_secs(5)))
                .skip_if(move |parts| parts.headers.contains_key(flag.as_str()))
                .refund_server_errors(m.refund);
            if m.allow_missing {
                builder = builder.on_missing_subject(tower_quota::SubjectPolicy::Allow);
            }
            if m.zones {
                builder = builder.time_zone(tower_quota::zone_from_header("x-zone"));
            }
            if m.plans {
                builder = builder
                    .plan(|parts| {
                        parts
                            .headers
                            .get("x-plan")
                            .map(|v| v.to_str().unwrap().to_owned())
                    })
                    .plans(["pro", "team"])
                    .on_unknown_plan(if m.reject_unknown {
                        tower_quota::UnknownPlan::Reject
                    } else {
                        tower_quota::UnknownPlan::DefaultLimits
                    });
            }
            builder.build()
        })
        .collect()
}

type Answer = Pin<Box<dyn Future<Output = axum::response::Response> + Send>>;

/// The model's handler: gives the request back on the policy its
/// `x-undo` names (through `handles`), answers its `x-status`, echoes its
/// `x-real-*` (the deferred costs) and lists its status entries as
/// `name:used/limit/remaining`.
fn model_handler<St: Store>(
    handles: Vec<QuotaHandle<St>>,
) -> impl Fn(http::HeaderMap, QuotaStatus) -> Answer + Clone + Send + Sync + 'static {
    move |headers, status| Box::pin(model_answer(handles.clone(), headers, status))
}

async fn model_answer<St: Store>(
    handles: Vec<QuotaHandle<St>>,
    headers: http::HeaderMap,
    status: QuotaStatus,
) -> axum::response::Response {
    if let Some(undo) = headers.get("x-undo") {
        let p: usize = undo.to_str().unwrap().parse().unwrap();
        handles[p].refund_request(&status).await.unwrap();
    }
    let code = headers.get("x-status").map_or(StatusCode::OK, |v| {
        StatusCode::from_bytes(v.as_bytes()).unwrap()
    });
    let text = status
        .entries()
        .iter()
        .map(|e| format!("{}:{}/{}/{}", e.name(), e.used(), e.limit(), e.remaining()))
        .collect::<Vec<_>>()
        .join(",");
    let mut response = (code, text).into_response();
    for (name, value) in &headers {
        if name.as_str().starts_with("x-real-") {
            response.headers_mut().insert(name.clone(), value.clone());
        }
    }
    response
}

/// An error answer rebuilt: status, headers and body kept, extensions lost.
fn rebuilt(response: axum::response::Response) -> axum::response::Response {
    if !(response.status().is_client_error() || response.status().is_server_error()) {
        return response;
    }
    let (parts, body) = response.into_parts();
    let mut fresh = axum::response::Response::new(body);
    *fresh.status_mut() = parts.status;
    *fresh.headers_mut() = parts.headers;
    fresh
}

fn model_layer<St: Store>(
    case: &MCase,
    policies: &[QuotaPolicy<FromHeader, St>],
    k: usize,
) -> QuotaLayer<FromHeader, St> {
    let level = &case.levels[k];
    let quotas = &case.quotas[level.policy];
    let policy = &policies[level.policy];
    let mut layer = policy.layer(quotas[level.quotas[0]].quota());
    for &q in &level.quotas[1..] {
        layer = layer.quota(quotas[q].quota());
    }
    let real = format!("x-real-{k}");
    match level.cost {
        MCost::Fixed(cost) => layer.cost(cost),
        MCost::Computed => {
            let asked = format!("x-cost-{k}");
            layer.cost_fn(move |parts| {
                parts
                    .headers
                    .get(asked.as_str())
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .ok_or_else(|| tower_quota::InvalidRequest::new("no cost"))
            })
        }
        MCost::Deferred(upfront) => layer.deferred_cost(upfront, move |response| {
            response
                .headers
                .get(real.as_str())
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(upfront)
        }),
    }
}

/// The app: the levels around the handler, outer first; requests go to
/// [`MODEL_PATH`].
fn model_app<St: Store>(case: &MCase, policies: &[QuotaPolicy<FromHeader, St>]) -> Boxed {
    let last = case.levels.len() - 1;
    let handler = model_handler(policies.iter().map(QuotaPolicy::handle).collect());
    let mut service: Option<Boxed> = None;
    for k in (0..=last).rev() {
        let level = &case.levels[k];
        let layer = model_layer(case, policies, k);
        let inner = match service.take() {
            None if level.apply == Apply::HandlerLayer => {
                service = Some(boxed(
                    Router::new().route("/{*rest}", get(handler.clone().layer(layer))),
                ));
                continue;
            }
            None => boxed(Router::new().route("/{*rest}", get(handler.clone()))),
            Some(inner) => inner,
        };
        let inner = if level.rewrap {
            boxed(inner.map_response(rebuilt as fn(_) -> _))
        } else {
            inner
        };
        service = Some(match level.apply {
            Apply::RouteLayer | Apply::HandlerLayer => boxed(
                Router::new()
                    .route_service("/{*rest}", inner)
                    .route_layer(layer),
            ),
            Apply::RouterLayer => {
                boxed(Router::new().route_service("/{*rest}", inner).layer(layer))
            }
            // (A nest under a route of another router trips an assertion
            // of axum's on the outer route's matched path: dropped first.)
            Apply::NestService => boxed(
                Router::new()
                    .nest_service("/x", layer.layer(inner))
                    .map_request(|mut request: Request<Body>| {
                        request
                            .extensions_mut()
                            .remove::<axum::extract::MatchedPath>();
                        request
                    }),
            ),
            Apply::Steered => {
                let nowhere = boxed(tower::service_fn(|_: Request<Body>| async {
                    Ok::<_, Infallible>(StatusCode::NOT_FOUND.into_response())
                }));
                let steer = Steer::new(
                    [boxed(layer.layer(inner)), nowhere],
                    |request: &Request<Body>, _: &[Boxed]| {
                        usize::from(request.headers().contains_key("x-nowhere"))
                    },
                );
                boxed(Synced(Mutex::new(steer)))
            }
            Apply::Buffered => boxed(HandleError::new(
                Buffer::new(layer.layer(inner), 16),
                buffer_failed,
            )),
            Apply::Shared => boxed(Shared::new(layer.layer(inner))),
        });
    }
    service.expect("a level at least")
}

const MODEL_PATH: &str = "/x/x/x/x/x/x/x/x";
const MODEL_ACCOUNTS: [&str; 2] = ["acme", "globex"];
const MODEL_USERS: [Option<&str>; 4] = [Some("ann"), Some("bob"), Some("ann"), None];
const MODEL_PLANS: [Option<&str>; 5] = [None, Some("pro"), Some("team"), Some("gold"), Some("pro")];
const MODEL_ZONES: [Option<&str>; 6] = [
    None,
    Some("Europe/Berlin"),
    Some("Asia/Tokyo"),
    Some("Asia/Kolkata"),
    None,
    Some("Nowhere/Bogus"),
];

/// One request of the model.
#[derive(Clone, Debug)]
struct MRequest {
    account: &'static str,
    user: Option<&'static str>,
    plan: Option<&'static str>,
    zone: Option<&'static str>,
    skip: Vec<bool>,
    status: u16,
    /// Per level, the real cost the handler reports.
    real: Vec<u64>,
    /// Per level, the cost asked (`None`: one that is no number).
    cost: Vec<Option<u64>>,
    /// The policy whose handle the handler gives the request back on.
    undo: Option<usize>,
}

/// A counter of the model: store, namespace, allowance, subject, zone and
/// window.
type MKey = (usize, usize, String, String, (String, i64));

/// Who a policy charges a request to: subject, plan, zone.
type MCaller = (String, Option<&'static str>, Option<&'static str>);

/// A refusal: its status, the refusing layer's lines (policy, quota,
/// counter), the quotas it names as violated.
type MRefusal = (u16, Vec<(usize, usize, u64)>, Vec<String>);

/// One layer's charge for a request, as the model reckons it.
struct MCharged {
    level: usize,
    /// Quota index, key, cost, counter after the charge.
    lines: Vec<(usize, MKey, u64, u64)>,
}

/// What the model expects of one request.
struct MExpect {
    status: u16,
    /// `RateLimit` members, in order: name, remaining, seconds to reset.
    fields: Vec<(String, u64, u64)>,
    /// `RateLimit-Policy` members, in order: name and limit.
    limits: Vec<(String, u64)>,
    /// The handler's body, when it ran.
    body: Option<String>,
    /// The quotas a 429 names as violated.
    violated: Vec<String>,
}

struct Model {
    counters: std::collections::HashMap<MKey, u64>,
}

impl Model {
    fn used(&self, key: &MKey) -> u64 {
        self.counters.get(key).copied().unwrap_or(0)
    }

    fn add(&mut self, key: &MKey, by: i64) -> u64 {
        let counter = self.counters.entry(key.clone()).or_default();
        *counter = counter.saturating_add_signed(by);
        *counter
    }

    /// Sends `request` through the model of `case` at `now`.
    fn run(&mut self, case: &MCase, request: &MRequest, now: Timestamp) -> MExpect {
        // Per policy: not met, met and uncounted (None), or its caller.
        let mut tickets: Vec<Option<Option<MCaller>>> = vec![None; case.policies.len()];
        let mut order: Vec<usize> = Vec::new();
        let mut charged: Vec<MCharged> = Vec::new();
        let mut refused: Option<MRefusal> = None;
        for (k, level) in case.levels.iter().enumerate() {
            let p = level.policy;
            let policy = &case.policies[p];
            let quotas = &case.quotas[p];
            let only_shadow = level.quotas.iter().all(|&q| quotas[q].shadow);
            let caller = match &tickets[p] {
                Some(None) => continue,
                Some(Some(caller)) => caller.clone(),
                None => {
                    if request.skip[p] {
                        tickets[p] = Some(None);
                        order.push(p);
                        continue;
                    }
                    let subject = if policy.user {
                        request.user
                    } else {
                        Some(request.account)
                    };
                    if subject.is_none() && policy.allow_missing {
                        tickets[p] = Some(None);
                        order.push(p);
                        continue;
                    }
                    let error = match subject {
                        None => Some(401),
                        Some(_)
                            if policy.plans
                                && policy.reject_unknown
                                && request.plan == Some("gold") =>
                        {
                            Some(403)
                        }
                        Some(_) if policy.zones && request.zone == Some("Nowhere/Bogus") => {
                            Some(400)
                        }
                        Some(_) => None,
                    };
                    if let Some(error) = error {
                        if only_shadow {
                            continue;
                        }
                        refused = Some((error, Vec::new(), Vec::new()));
                        break;
                    }
                    let plan = if policy.plans { request.plan } else { None };
                    let zone = if policy.zones { request.zone } else { None };
                    (subject.unwrap().to_owned(), plan, zone)
                }
            };
            // Charged further out, by this policy or another on its store.
            let counted: Vec<MKey> = charged
                .iter()
                .flat_map(|c| c.lines.iter().map(|line| line.1.clone()))
                .collect();
            let lines: Vec<(usize, MKey)> = level
                .quotas
                .iter()
                .map(|&q| {
                    let key = (
                        policy.store,
                        policy.ns,
                        quotas[q].allowance.clone(),
                        caller.0.clone(),
                        quotas[q].window(caller.2, now),
                    );
                    (q, key)
                })
                .filter(|(_, key)| !counted.contains(key))
                .collect();
            // A new ticket with nothing to charge (every quota counted by
            // another policy on the store) is not kept.
            if lines.is_empty() {
                continue;
            }
            let cost = match level.cost {
                MCost::Fixed(cost) | MCost::Deferred(cost) => Some(cost),
                MCost::Computed => request.cost[k],
            };
            let Some(cost) = cost else {
                // Shadow quotas never refuse: the layer lets it pass.
                if lines.iter().all(|(q, _)| quotas[*q].shadow) {
                    continue;
                }
                refused = Some((400, Vec::new(), Vec::new()));
                break;
            };
            if tickets[p].is_none() {
                tickets[p] = Some(Some(caller.clone()));
                order.push(p);
            }
            let full: Vec<String> = lines
                .iter()
                .filter(|(q, key)| {
                    !quotas[*q].shadow && self.used(key) + cost > quotas[*q].limit_for(caller.1)
                })
                .map(|(q, _)| quotas[*q].name())
                .collect();
            if !full.is_empty() {
                let fields = lines
                    .iter()
                    .map(|(q, key)| (p, *q, self.used(key)))
                    .collect();
                refused = Some((429, fields, full));
                break;
            }
            let lines = lines
                .into_iter()
                .map(|(q, key)| {
                    let after = self.add(&key, cost as i64);
                    (q, key, cost, after)
                })
                .collect();
            charged.push(MCharged { level: k, lines });
        }
        let caller_of = |p: usize| match &tickets[p] {
            Some(Some(caller)) => (caller.1, caller.2),
            _ => (None, None),
        };
        let plan_of = |p: usize| caller_of(p).0;
        let member = |p: usize, q: usize, used: u64| {
            let quota = &case.quotas[p][q];
            let (plan, zone) = caller_of(p);
            let limit = quota.limit_for(plan);
            let reset = quota.window_and_end(zone, now).1 - now.as_second();
            (
                (quota.name(), limit.saturating_sub(used), reset as u64),
                (quota.name(), limit),
            )
        };
        let mut fields = Vec::new();
        let mut limits = Vec::new();
        if let Some((status, own, violated)) = refused {
            // Everything charged goes back; the layers further out tell
            // what is left after.
            for c in &charged {
                let p = case.levels[c.level].policy;
                for (q, key, cost, _) in &c.lines {
                    let after = self.add(key, -(*cost as i64));
                    let (f, l) = member(p, *q, after);
                    fields.push(f);
                    limits.push(l);
                }
            }
            for (p, q, used) in own {
                let (f, l) = member(p, q, used);
                fields.push(f);
                limits.push(l);
            }
            return MExpect {
                status,
                fields,
                limits,
                body: None,
                violated,
            };
        }
        // The handler gives the request back on one policy's counters:
        // its layers change them no more.
        let undone = |c: &MCharged| Some(case.levels[c.level].policy) == request.undo;
        for c in charged.iter_mut().filter(|c| undone(c)) {
            for (_, key, cost, after) in &mut c.lines {
                self.add(key, -(*cost as i64));
                *after -= *cost;
            }
        }
        let mut body = Vec::new();
        for &p in &order {
            for c in charged.iter().filter(|c| case.levels[c.level].policy == p) {
                for (q, _, _, after) in &c.lines {
                    let quota = &case.quotas[p][*q];
                    let limit = quota.limit_for(plan_of(p));
                    body.push(format!(
                        "{}:{after}/{limit}/{}",
                        quota.name(),
                        limit.saturating_sub(*after)
                    ));
                }
            }
        }
        // The way out, inner layers first; each puts its fields in front.
        for c in charged.iter().rev() {
            let level = &case.levels[c.level];
            let p = level.policy;
            let refund = request.status >= 500 && case.policies[p].refund && !undone(c);
            let mut members = Vec::new();
            let mut members_limits = Vec::new();
            for (q, key, cost, after) in &c.lines {
                let now_used = if refund {
                    self.add(key, -(*cost as i64))
                } else if undone(c) {
                    *after
                } else if let MCost::Deferred(upfront) = level.cost {
                    let real = request.real[c.level];
                    if real == upfront {
                        *after
                    } else {
                        self.add(key, real as i64 - upfront as i64)
                    }
                } else {
                    *after
                };
                let (f, l) = member(p, *q, now_used);
                members.push(f);
                members_limits.push(l);
            }
            members.extend(fields);
            members_limits.extend(limits);
            fields = members;
            limits = members_limits;
        }
        MExpect {
            status: request.status,
            fields,
            limits,
            body: Some(body.join(",")),
            violated: Vec::new(),
        }
    }
}

/// The members of the `name` fields of `response`: each member's name and
/// its `params` (`r` and `t`, or `q`), in that order.
fn members(response: &Response<Body>, name: &str, params: &[&str]) -> Vec<(String, Vec<u64>)> {
    let mut out = Vec::new();
    for value in response.headers().get_all(name) {
        for item in value.to_str().unwrap().split(',') {
            let mut parts = item.trim().split(';');
            let name = parts.next().unwrap().trim_matches('"').to_owned();
            let parts: Vec<&str> = parts.collect();
            let values = params
                .iter()
                .map(|param| {
                    parts
                        .iter()
                        .find_map(|p| p.strip_prefix(&format!("{param}=")))
                        .unwrap()
                        .parse()
                        .unwrap()
                })
                .collect();
            out.push((name, values));
        }
    }
    out
}

fn random_request(rng: &mut Rng, case: &MCase) -> MRequest {
    MRequest {
        account: MODEL_ACCOUNTS[rng.below(MODEL_ACCOUNTS.len() as u64) as usize],
        user: *rng.pick(&MODEL_USERS),
        plan: *rng.pick(&MODEL_PLANS),
        zone: *rng.pick(&MODEL_ZONES),
        skip: case.policies.iter().map(|_| rng.below(10) == 0).collect(),
        status: *rng.pick(&[200, 200, 200, 200, 500, 503]),
        real: case.levels.iter().map(|_| rng.below(5)).collect(),
        cost: case
            .levels
            .iter()
            .map(|_| (rng.below(10) != 0).then(|| rng.below(3)))
            .collect(),
        undo: (rng.below(6) == 0).then(|| rng.below(case.policies.len() as u64) as usize),
    }
}

async fn model_case<St: Store>(
    seed: u64,
    steps: usize,
    trace: bool,
    shared: &St,
    own: &dyn Fn() -> St,
) {
    let mut rng = Rng(seed);
    let case = random_case(&mut rng);
    let clock = ManualClock::new(at("2026-12-02T22:58:30Z"));
    let policies = model_policies(&case, seed, &clock, shared, own);
    let app = model_app(&case, &policies);
    let mut model = Model {
        counters: std::collections::HashMap::new(),
    };
    if trace {
        eprintln!("seed {seed}: {case:#?}");
    }
    for step in 0..steps {
        if rng.below(8) == 0 {
            let secs = *rng.pick(&[20u64, 40, 61, 600, 3_600, 5 * 3_600, 86_400]);
            clock.advance(Duration::from_secs(secs));
            continue;
        }
        let request = random_request(&mut rng, &case);
        let now = clock.now();
        let expect = model.run(&case, &request, now);
        let mut http = Request::get(MODEL_PATH).header("x-account-id", request.account);
        if let Some(user) = request.user {
            http = http.header("x-user-id", user);
        }
        if let Some(plan) = request.plan {
            http = http.header("x-plan", plan);
        }
        if let Some(zone) = request.zone {
            http = http.header("x-zone", zone);
        }
        for (p, skip) in request.skip.iter().enumerate() {
            if *skip {
                http = http.header(format!("x-skip-{p}"), "1");
            }
        }
        http = http.header("x-status", request.status.to_string());
        for (k, real) in request.real.iter().enumerate() {
            http = http.header(format!("x-real-{k}"), real.to_string());
        }
        for (k, cost) in request.cost.iter().enumerate() {
            let cost = cost.map_or("x".to_owned(), |c| c.to_string());
            http = http.header(format!("x-cost-{k}"), cost);
        }
        if let Some(p) = request.undo {
            http = http.header("x-undo", p.to_string());
        }
        let response = app
            .clone()
            .oneshot(http.body(Body::empty()).unwrap())
            .await
            .unwrap();
        let ctx = format!("seed {seed} step {step} at {now}: {request:?}");
        let fields = members(&response, "ratelimit", &["r", "t"]);
        let limits = members(&response, "ratelimit-policy", &["q"]);
        let status = response.status().as_u16();
        let text = body(response).await;
        if trace {
            eprintln!("{ctx}\n  -> {status} {fields:?} {text}");
        }
        assert_eq!(status, expect.status, "{ctx}: {text}");
        let expected: Vec<(String, Vec<u64>)> = expect
            .fields
            .iter()
            .map(|(name, r, t)| (name.clone(), vec![*r, *t]))
            .collect();
        assert_eq!(fields, expected, "{ctx}: RateLimit, {text}");
        let expected: Vec<(String, Vec<u64>)> = expect
            .limits
            .iter()
            .map(|(name, q)| (name.clone(), vec![*q]))
            .collect();
        assert_eq!(limits, expected, "{ctx}: RateLimit-Policy");
        if let Some(expected) = &expect.body {
            assert_eq!(&text, expected, "{ctx}: the handler's status");
        }
        for name in &expect.violated {
            assert!(text.contains(&format!("\"{name}\"")), "{ctx}: {text}");
        }
        // Every counter, through the handles.
        for (p, policy) in policies.iter().enumerate() {
            let m = &case.policies[p];
            let subjects: Vec<(Subject, String)> = if m.user {
                ["ann", "bob"]
                    .iter()
                    .map(|u| (Subject::user(*u), (*u).to_owned()))
                    .collect()
            } else {
                MODEL_ACCOUNTS
                    .iter()
                    .map(|a| (Subject::account(*a), (*a).to_owned()))
                    .collect()
            };
            let zones: &[Option<&str>] = if m.zones {
                &[
                    None,
                    Some("Europe/Berlin"),
                    Some("Asia/Tokyo"),
                    Some("Asia/Kolkata"),
                ]
            } else {
                &[None]
            };
            for zone in zones {
                let handle = match zone {
                    Some(z) => policy.handle().in_zone(TimeZone::get(z).unwrap()),
                    None => policy.handle(),
                };
                for (subject, id) in &subjects {
                    for usage in handle.usage(subject).await.unwrap() {
                        let quota = case.quotas[p]
                            .iter()
                            .find(|q| q.name() == usage.name())
                            .unwrap();
                        let key = (
                            m.store,
                            m.ns,
                            quota.allowance.clone(),
                            id.clone(),
                            quota.window(*zone, now),
                        );
                        assert_eq!(
                            usage.used(),
                            model.used(&key),
                            "{ctx}: after it, policy {p}'s {} for {id} in {zone:?}",
                            usage.name()
                        );
                    }
                }
            }
        }
    }
}

/// The seeds to run (`COMPOSITION_MODEL_CASES`, `COMPOSITION_MODEL_SEED`)
/// and whether to trace them.
fn model_seeds(default_cases: u64) -> (std::ops::Range<u64>, bool) {
    let var = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
    let cases: u64 = var("COMPOSITION_MODEL_CASES").unwrap_or(default_cases);
    let first: u64 = var("COMPOSITION_MODEL_SEED").unwrap_or(1);
    let trace = std::env::var_os("COMPOSITION_MODEL_TRACE").is_some();
    (first..first + cases, trace)
}

#[test]
fn random_compositions_of_policies_answer_as_the_model_on_memory_stores() {
    let (seeds, trace) = model_seeds(12);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let own = tower_quota::MemoryStore::new;
    for seed in seeds {
        runtime.block_on(model_case(seed, 60, trace, &own(), &own));
    }
}

#[cfg(feature = "redis")]
#[test]
fn random_compositions_of_policies_answer_as_the_model_on_redis_and_memory_stores() {
    use tower_quota::store::EitherStore;
    let server = crate::redis_server_or_skip!();
    let (seeds, trace) = model_seeds(3);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let redis = {
        let _entered = runtime.enter();
        EitherStore::Right(redis_store(&server))
    };
    let own = || EitherStore::Left(tower_quota::MemoryStore::new());
    for seed in seeds {
        runtime.block_on(model_case(seed, 60, trace, &redis, &own));
    }
}
