//! The middleware: [`QuotaLayer`], its [`QuotaService`] and their
//! [`ResponseFuture`].
//!
//! A request meets the layers of a policy one after the other. Each layer
//! reads the policy's ticket from the request's [`QuotaStatus`]
//! (crate::QuotaStatus) (the outermost makes it: subject, plan, zone and the
//! request's instant), charges the quotas of its own that the ticket does
//! not count yet in one call to the store, and adds the lines it charged.
//! Nothing is discovered when layers are built: nesting, `Handler::layer`,
//! an `Arc` or a `Buffer` around a layer change nothing. A layer that
//! refuses gives back what the layers further out charged for the request
//! before the refusal is answered; on the way out, each layer settles its
//! own lines (refunds, deferred costs) and puts its fields in front of those
//! of the layers further in.
//!
//! The rules are plain functions in `charge`; the future only moves between
//! their results.

mod charge;
mod future;
mod layer;
mod owing;
mod service;

pub use self::future::ResponseFuture;
pub use self::layer::QuotaLayer;
pub use self::service::QuotaService;
