use std::sync::Arc;

use crate::store::Usage;

/// Where the caller stands after its request was admitted, inserted into the
/// request's extensions for the handler (with the `axum` feature, usable
/// directly as an extractor).
///
/// ```
/// use axum::{routing::get, Router};
/// use tower_quota::{FromHeader, QuotaLayer, QuotaStatus};
///
/// async fn handler(status: QuotaStatus) -> String {
///     format!("{} calls left today", status.entries()[0].usage.remaining())
/// }
///
/// let app: Router = Router::new()
///     .route("/", get(handler))
///     .layer(QuotaLayer::daily(1_000, FromHeader::account("x-account-id")));
/// ```
#[derive(Clone, Debug)]
pub struct QuotaStatus {
    entries: Arc<[StatusEntry]>,
}

/// One quota in a [`QuotaStatus`].
#[derive(Clone, Debug)]
pub struct StatusEntry {
    /// The quota's name.
    pub name: Arc<str>,
    /// The counter after this request's charge.
    pub usage: Usage,
}

impl QuotaStatus {
    pub(crate) fn new(entries: Arc<[StatusEntry]>) -> Self {
        Self { entries }
    }

    /// One entry per quota of the layer, in the layer's order.
    pub fn entries(&self) -> &[StatusEntry] {
        &self.entries
    }
}

#[cfg(feature = "axum")]
mod axum_impl {
    use axum_core::extract::FromRequestParts;
    use http::request::Parts;
    use http::StatusCode;

    use super::QuotaStatus;

    impl<S: Send + Sync> FromRequestParts<S> for QuotaStatus {
        type Rejection = (StatusCode, &'static str);

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Self, Self::Rejection> {
            parts.extensions.get::<QuotaStatus>().cloned().ok_or((
                StatusCode::INTERNAL_SERVER_ERROR,
                "QuotaStatus is only available behind a QuotaLayer that charged the request",
            ))
        }
    }
}
