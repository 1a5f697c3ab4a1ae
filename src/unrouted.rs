//! The router's answers to requests it has no route for, which no quota
//! charges.
//!
//! A layer applied with axum's `Router::route_layer` never sees a request
//! for an unknown path (404), but it wraps each route's answer to a method
//! the route does not serve (405), and `Router::layer` wraps the 404 too.
//! Neither request is served, so neither should cost anything. These
//! handlers answer the same as axum's own (axum adds `Allow` to the 405) and
//! mark their response, so a quota layer that charged the request gives the
//! charge back and sends no rate-limit fields.
//!
//! Set them last, after the quota layers: axum then puts them in place of
//! the answers the layers wrapped, so the layers never see these requests at
//! all, and they need no subject either. A method router that a quota layer
//! wraps whole (behind `route_service` or `nest_service`) answers a wrong
//! method inside the layer, out of the router's reach: give it its own,
//! `get(handler).fallback(unrouted::MethodNotAllowed)`, and the layer gives
//! the charge back. A handler's own 404 or 405 is charged: it ran.
//!
//! ```
//! use axum::{body::Body, routing::post, Router};
//! use http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_quota::{unrouted, FromHeader, QuotaLayer};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let app = Router::new()
//!     .route("/write", post(|| async { "written" }))
//!     .route_layer(QuotaLayer::daily(10, FromHeader::account("x-account-id")))
//!     .method_not_allowed_fallback(unrouted::MethodNotAllowed);
//!
//! // A wrong method needs no subject and costs nothing.
//! let wrong = Request::get("/write").body(Body::empty()).unwrap();
//! let response = app.oneshot(wrong).await.unwrap();
//! assert_eq!(response.status(), StatusCode::METHOD_NOT_ALLOWED);
//! assert_eq!(response.headers()["allow"], "POST");
//! # }
//! ```

use std::future::{ready, Ready};

use axum::handler::Handler;
use axum::response::{IntoResponse, Response};
use http::StatusCode;

/// Answers `405 Method Not Allowed` (axum adds the `Allow` field): use it
/// with `Router::method_not_allowed_fallback`. Quota layers wrapping it give
/// their charge back.
#[derive(Clone, Copy, Debug)]
pub struct MethodNotAllowed;

/// Answers `404 Not Found`: use it with `Router::fallback` when quota layers
/// are applied with `Router::layer`. Quota layers wrapping it give their
/// charge back.
#[derive(Clone, Copy, Debug)]
pub struct NotFound;

/// The mark of a response no route served.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Unrouted;

macro_rules! marker {
    ($name:ident, $status:expr) => {
        impl<S> Handler<(), S> for $name {
            type Future = Ready<Response>;

            fn call(self, _request: axum::extract::Request, _state: S) -> Self::Future {
                let mut response = $status.into_response();
                response.extensions_mut().insert(Unrouted);
                ready(response)
            }
        }
    };
}

marker!(MethodNotAllowed, StatusCode::METHOD_NOT_ALLOWED);
marker!(NotFound, StatusCode::NOT_FOUND);
