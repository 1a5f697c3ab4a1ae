//! The routes both differential tests (`lease_differential.rs`,
//! `redis_differential.rs`) serve on each of their two apps: the handlers
//! answer the request's `QuotaStatus` entries as the test reads them.

use axum::extract::State;
use axum::routing::{get, MethodRouter};
use axum::Router;
use http::{HeaderMap, StatusCode};
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
