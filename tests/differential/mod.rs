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
use tower_quota::{FromHeader, QuotaHandle, QuotaLayer, QuotaStatus, QuotaUsage, Store};

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
