//! The routes both differential tests (`lease_differential.rs`,
//! `redis_differential.rs`) serve on each of their two apps: the handlers
//! answer the request's `QuotaStatus` entries as the test reads them.

use axum::body::Body;
use axum::extract::State;
use axum::routing::{get, MethodRouter};
use axum::Router;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use proptest::prelude::*;
use tower::ServiceExt;
use tower_quota::{
    Anchor, FromHeader, InvalidRequest, Period, Quota, QuotaHandle, QuotaLayer, QuotaPolicyBuilder,
    QuotaStatus, QuotaUsage, Store, UnknownPlan,
};

/// How a test writes a request's entries.
pub type Describe = fn(&[QuotaUsage]) -> String;

/// A route that answers the request's entries, as `describe` writes them.
pub fn entries<St: Store>(describe: Describe) -> MethodRouter<QuotaHandle<St>> {
    get(move |status: QuotaStatus| async move { describe(&status.entries()) })
}

/// `base`'s routes and `/read`, `/fail` (a 500), `/undo` and `/undo-fail`
/// (the handler gives the request back) and `/write` (behind `write` too),
/// all behind `read`; then `/tokens` behind `tokens` (a deferred cost: the
/// handler reports the request's `x-cost`). Served with `handle`.
pub fn routes<St: Store>(
    base: Router<QuotaHandle<St>>,
    read: QuotaLayer<FromHeader, St>,
    write: QuotaLayer<FromHeader, St>,
    tokens: QuotaLayer<FromHeader, St>,
    handle: QuotaHandle<St>,
    describe: Describe,
) -> Router {
    base.route("/read", entries(describe))
        .route(
            "/fail",
            get(move |status: QuotaStatus| async move {
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    describe(&status.entries()),
                )
            }),
        )
        .route(
            "/undo",
            get(
                move |State(handle): State<QuotaHandle<St>>, status: QuotaStatus| async move {
                    let undone = handle.refund_request(&status).await;
                    format!("{undone:?} {}", describe(&status.entries()))
                },
            ),
        )
        .route(
            "/undo-fail",
            get(
                move |State(handle): State<QuotaHandle<St>>, status: QuotaStatus| async move {
                    let undone = handle.refund_request(&status).await;
                    (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("{undone:?} {}", describe(&status.entries())),
                    )
                },
            ),
        )
        .route("/write", entries(describe).route_layer(write))
        .route_layer(read)
        .route(
            "/tokens",
            get(move |headers: HeaderMap, status: QuotaStatus| async move {
                let used = headers
                    .get("x-cost")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("1")
                    .to_owned();
                ([("x-tokens-used", used)], describe(&status.entries()))
            })
            .route_layer(tokens),
        )
        .with_state(handle)
}

/// The limits of a differential app's quotas: each test sizes them to
/// what its scripts reach.
pub struct Limits {
    /// `read-day`: its own, `free`'s and `pro`'s.
    pub read_day: [u64; 3],
    /// `read-fu` (first use, a minute): its own and `pro`'s.
    pub read_fu: [u64; 2],
    /// `read-shadow` (hourly, never enforced).
    pub read_shadow: u64,
    /// `write-fu` (first use, an hour): its own and `pro`'s.
    pub write_fu: [u64; 2],
    /// `tokens-day` (a deferred cost).
    pub tokens_day: u64,
    /// `/bulk`, if served (a cost the request asks for in `x-units`):
    /// `bulk-fu`'s own and `pro`'s (first use, an hour), and `bulk-day`.
    pub bulk: Option<([u64; 2], u64)>,
}

/// The app every differential test serves on each side: `policy` (its
/// store, clock and namespace set by the test) with plans from `x-plan`
/// (unknown ones on the quotas' own limits) and 5xx refunded, `read`,
/// `write` and `tokens` quotas of `limits` on [`routes`], and `/bulk` if
/// `limits` has it.
pub fn app<St: Store>(
    policy: QuotaPolicyBuilder<FromHeader, St>,
    limits: &Limits,
    describe: Describe,
) -> (Router, QuotaHandle<St>) {
    let policy = policy
        .plan(|parts| Some(parts.headers.get("x-plan")?.to_str().ok()?.to_owned()))
        .on_unknown_plan(UnknownPlan::DefaultLimits)
        .refund_server_errors(true)
        .build();
    let [day, free, pro] = limits.read_day;
    let read = policy
        .layer(
            Quota::daily(day)
                .plan("free", free)
                .plan("pro", pro)
                .allowance("read")
                .named("read-day"),
        )
        .quota(
            Quota::new(limits.read_fu[0], Period::minute(), Anchor::FirstUse)
                .plan("pro", limits.read_fu[1])
                .allowance("read")
                .named("read-fu"),
        )
        .quota(
            Quota::hourly(limits.read_shadow)
                .allowance("read")
                .named("read-shadow")
                .shadow(),
        );
    let write = policy.layer(
        Quota::new(limits.write_fu[0], Period::hour(), Anchor::FirstUse)
            .plan("pro", limits.write_fu[1])
            .allowance("write")
            .named("write-fu"),
    );
    let tokens = policy
        .layer(
            Quota::daily(limits.tokens_day)
                .allowance("tokens")
                .named("tokens-day"),
        )
        .deferred_cost(1, |response| {
            response
                .headers
                .get("x-tokens-used")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(1)
        });
    let handle = policy.handle();
    let base = match limits.bulk {
        None => Router::new(),
        Some(([fu, fu_pro], day)) => {
            // A cost from the request (0 too, and more than a whole period
            // allows).
            let bulk = policy
                .layer(
                    Quota::new(fu, Period::hour(), Anchor::FirstUse)
                        .plan("pro", fu_pro)
                        .allowance("bulk")
                        .named("bulk-fu"),
                )
                .quota(Quota::daily(day).allowance("bulk").named("bulk-day"))
                .cost_fn(|parts| {
                    Ok::<_, InvalidRequest>(
                        parts
                            .headers
                            .get("x-units")
                            .and_then(|v| v.to_str().ok()?.parse().ok())
                            .unwrap_or(1),
                    )
                });
            Router::new().route("/bulk", entries(describe).route_layer(bulk))
        }
    };
    let router = routes(base, read, write, tokens, handle.clone(), describe);
    (router, handle)
}

/// A request of a script, by the route it asks.
#[derive(Clone, Copy, Debug)]
pub enum Route {
    Read,
    Fail,
    Undo,
    UndoFail,
    Write,
    /// The cost the handler reports (the deferred cost).
    Tokens(u8),
    /// The cost the request asks for (`/bulk`, which a test's `base`
    /// routes serve).
    Bulk(u8),
}

/// The routes of a script, `/bulk` among them if `bulk`.
pub fn route(bulk: bool) -> BoxedStrategy<Route> {
    let bulk_weight = if bulk { 2 } else { 0 };
    prop_oneof![
        6 => Just(Route::Read),
        1 => Just(Route::Fail),
        1 => Just(Route::Undo),
        1 => Just(Route::UndoFail),
        2 => Just(Route::Write),
        2 => (0u8..12).prop_map(Route::Tokens),
        bulk_weight => prop_oneof![3 => 0u8..5, 1 => 5u8..20].prop_map(Route::Bulk),
    ]
    .boxed()
}

/// The status, the fields a client reads, and the body of `route` asked
/// for `subject` on `plan`.
pub async fn ask(app: &Router, route: Route, subject: &str, plan: Option<&str>) -> String {
    let path = match route {
        Route::Read => "/read",
        Route::Fail => "/fail",
        Route::Undo => "/undo",
        Route::UndoFail => "/undo-fail",
        Route::Write => "/write",
        Route::Tokens(_) => "/tokens",
        Route::Bulk(_) => "/bulk",
    };
    let mut request = Request::get(path).header("x-account-id", subject);
    if let Some(plan) = plan {
        request = request.header("x-plan", plan);
    }
    match route {
        Route::Tokens(cost) => request = request.header("x-cost", cost.to_string()),
        Route::Bulk(units) => request = request.header("x-units", units.to_string()),
        _ => {}
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    answer(response).await
}

/// What the differential tests compare of a response: its status, its
/// fields and `Retry-After`, its body.
pub async fn answer(response: http::Response<Body>) -> String {
    let mut seen = response.status().to_string();
    for name in ["ratelimit", "ratelimit-policy", "retry-after"] {
        for value in response.headers().get_all(name) {
            seen.push_str(&format!(" {name}: {}", value.to_str().unwrap()));
        }
    }
    let body = response.into_body().collect().await.unwrap().to_bytes();
    seen.push_str(" | ");
    seen.push_str(&String::from_utf8_lossy(&body));
    seen
}
