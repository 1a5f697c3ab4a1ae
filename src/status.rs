use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use jiff::Timestamp;

use crate::config::{Costs, Layout};
use crate::key::PeriodKey;
use crate::period::Anchor;
use crate::quota::Quota;
use crate::store::Usage;
use crate::subject::Subject;

/// Where one subject stands on one quota: the quota, its counter's key and
/// the counter's state. What [`QuotaStatus`] lists for a request and
/// [`QuotaHandle::usage`](crate::QuotaHandle::usage) for support tools.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct QuotaUsage {
    /// The quota.
    pub quota: Quota,
    /// The counter's key.
    pub key: PeriodKey,
    /// The counter's state (its limit is the subject's plan's).
    pub usage: Usage,
}

impl QuotaUsage {
    pub(crate) fn new(quota: Quota, key: PeriodKey, usage: Usage) -> Self {
        Self { quota, key, usage }
    }

    /// The quota's name, as clients see it.
    pub fn name(&self) -> &str {
        self.quota.name()
    }

    /// The quota's allowance tag.
    pub fn allowance(&self) -> &str {
        self.quota.allowance_tag()
    }

    /// The limit this period (the subject's plan's).
    pub fn limit(&self) -> u64 {
        self.usage.limit
    }

    /// What has been spent this period.
    pub fn used(&self) -> u64 {
        self.usage.used
    }

    /// What is left to spend this period.
    pub fn remaining(&self) -> u64 {
        self.usage.remaining()
    }

    /// When the allowance returns.
    pub fn resets_at(&self) -> Timestamp {
        self.usage.resets_at
    }

    /// The call that opened a first-use period, if one is open.
    pub fn first_call(&self) -> Option<Timestamp> {
        self.usage.first_call
    }

    /// As JSON: `{"allowance","name","limit","used","remaining",
    /// "resets_at","anchor","first_call","reset"}`, instants in RFC 3339,
    /// `anchor` `calendar` or `first-use`, `reset` from
    /// [`QuotaUsage::explain_reset`]. What the support router answers.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "allowance": self.allowance(),
            "name": self.name(),
            "limit": self.limit(),
            "used": self.used(),
            "remaining": self.remaining(),
            "resets_at": self.resets_at().to_string(),
            "anchor": self.quota.anchor().as_str(),
            "first_call": self.first_call().map(|t| t.to_string()),
            "reset": self.explain_reset(),
        })
    }

    /// How and when the allowance returns, in words, with instants in the
    /// quota's time zone: `every day at 00:00 Europe/Berlin; next at
    /// 2026-12-05T00:00:00+01:00[Europe/Berlin]`, `every day at 00:00 UTC;
    /// next at 2026-12-05T00:00:00Z`, or for a first-use quota `24h after the
    /// first call (2026-12-02T10:00:00Z), at 2026-12-03T10:00:00Z`.
    pub fn explain_reset(&self) -> String {
        let rule = self.quota.describe_reset();
        let period = self.quota.period();
        let resets_at = period.format_instant(self.usage.resets_at);
        match (self.quota.anchor(), self.usage.first_call) {
            (Anchor::FirstUse, Some(first)) => {
                let first = period.format_instant(first);
                format!("{rule} ({first}), at {resets_at}")
            }
            (Anchor::FirstUse, None) => format!("{rule}; no period is open"),
            (Anchor::Calendar, _) => format!("{rule}; next at {resets_at}"),
        }
    }
}

/// Where the caller stands, inserted into the request's extensions once per
/// request for the handler (with the `axum` feature, usable directly as an
/// extractor): one entry per quota that applied, whichever layers of the
/// policy the request passed. A request that was let through uncounted (a
/// skip rule, an unknown route) carries a status with no entries.
///
/// The status is also how the layers of a policy recognise a request they
/// already charged: a request built with another request's extensions (a
/// sub-request of a batch endpoint) passes those layers uncharged. Remove
/// `QuotaStatus` from the extensions you copy when the sub-request must be
/// charged on its own.
///
/// ```
/// use axum::{routing::get, Router};
/// use tower_quota::{FromHeader, QuotaLayer, QuotaStatus};
///
/// async fn handler(status: QuotaStatus) -> String {
///     format!("{} calls left today", status.entries()[0].remaining())
/// }
///
/// let app: Router = Router::new()
///     .route("/", get(handler))
///     .layer(QuotaLayer::daily(1_000, FromHeader::account("x-account-id")));
/// ```
#[derive(Clone, Debug)]
pub struct QuotaStatus {
    inner: Arc<Ticket>,
}

/// What the layers of one policy know about a request they charged: the
/// status the handler reads, and what inner layers and the response path
/// need.
#[derive(Debug)]
pub(crate) struct Ticket {
    pub(crate) policy: u64,
    /// What was charged; `None` for a request let through uncounted.
    pub(crate) layout: Option<Arc<Layout>>,
    pub(crate) costs: Costs,
    /// A hidden outer layer's charge, whose entries come first.
    pub(crate) outer: Option<QuotaStatus>,
    /// Who was charged: the keys follow from it.
    pub(crate) subject: Option<Subject>,
    /// What the store answered, one per line of the layout.
    pub(crate) usage: Vec<Usage>,
    /// The subject's hash, for spread resets (0 when nothing spreads).
    pub(crate) subject_hash: u64,
    /// The real limits of the lines, when some quota is in shadow mode
    /// (the store is asked to charge those without a limit).
    pub(crate) limits: Vec<u64>,
    /// What the handler reads, built on first use: most handlers never look.
    pub(crate) entries: OnceLock<Vec<QuotaUsage>>,
    /// Bit `i`: the request reached the layer of scope `i` of the layout.
    pub(crate) reached: AtomicU64,
    /// Set when the charge was given back (an inner layer refused).
    pub(crate) refunded: AtomicBool,
    /// The instant of the charge.
    pub(crate) charged_at: Timestamp,
}

impl QuotaStatus {
    #[inline]
    pub(crate) fn new(ticket: Ticket) -> Self {
        Self {
            inner: Arc::new(ticket),
        }
    }

    /// The status of a request let through uncounted.
    pub(crate) fn exempt(policy: u64, now: Timestamp) -> Self {
        Self::new(Ticket {
            policy,
            layout: None,
            costs: Costs::none(),
            outer: None,
            subject: None,
            usage: Vec::new(),
            subject_hash: 0,
            limits: Vec::new(),
            entries: OnceLock::new(),
            reached: AtomicU64::new(0),
            refunded: AtomicBool::new(false),
            charged_at: now,
        })
    }

    pub(crate) fn ticket(&self) -> &Ticket {
        &self.inner
    }

    /// The ticket, while this status is its only holder (before the request
    /// carries it).
    pub(crate) fn ticket_mut(&mut self) -> Option<&mut Ticket> {
        Arc::get_mut(&mut self.inner)
    }

    /// One entry per quota that applied to the request, outer layers first.
    pub fn entries(&self) -> &[QuotaUsage] {
        self.inner.entries()
    }

    /// The entry of the quota named `name`.
    pub fn get(&self, name: &str) -> Option<&QuotaUsage> {
        self.entries().iter().find(|e| e.quota.name() == name)
    }

    /// The instant the request was charged: what
    /// [`QuotaHandle::refund_at`](crate::QuotaHandle::refund_at) takes to
    /// undo it later.
    pub fn charged_at(&self) -> Timestamp {
        self.inner.charged_at
    }

    /// Whether the request was let through uncounted.
    pub fn is_exempt(&self) -> bool {
        self.inner.layout.is_none()
    }
}

impl Ticket {
    fn entries(&self) -> &[QuotaUsage] {
        self.entries.get_or_init(|| {
            let outer = self.outer.as_ref().map(|o| o.entries()).unwrap_or_default();
            let mut entries = outer.to_vec();
            if let Some(layout) = &self.layout {
                // Only the layers the request passed, so far.
                for (line, (quota, usage)) in layout.quotas.iter().zip(&self.usage).enumerate() {
                    if self.reached(layout.line_scope[line]) {
                        entries.push(QuotaUsage::new(quota.clone(), self.own_key(line), *usage));
                    }
                }
            }
            entries
        })
    }

    /// The key of line `line` of this charge's layout.
    fn own_key(&self, line: usize) -> PeriodKey {
        let (Some(layout), Some(subject)) = (&self.layout, &self.subject) else {
            unreachable!("only a charge has lines")
        };
        layout.quotas[line].key(&layout.namespace, subject, self.charged_at)
    }

    /// The key of entry `i`: a hidden outer layer's lines first.
    pub(crate) fn key(&self, i: usize) -> PeriodKey {
        let offset = self.outer_lines();
        match &self.outer {
            Some(outer) if i < offset => outer.ticket().key(i),
            _ => self.own_key(i - offset),
        }
    }

    /// Marks the layer of `scope` as reached; whether this charge (or a
    /// hidden outer one) covered its quotas.
    pub(crate) fn reach(&self, scope: u64) -> bool {
        let Some(layout) = &self.layout else {
            return false;
        };
        match layout.scopes.iter().position(|s| s.id == scope) {
            Some(i) => {
                self.reached.fetch_or(1 << i, Ordering::Relaxed);
                true
            }
            None => self.outer.as_ref().is_some_and(|o| o.ticket().reach(scope)),
        }
    }

    /// Whether the request reached the layer of scope `i` of the layout.
    pub(crate) fn reached(&self, i: usize) -> bool {
        self.reached.load(Ordering::Relaxed) & (1 << i) != 0
    }

    /// Whether this charge (or one further out) counts on `quota`'s counter.
    pub(crate) fn counts(&self, quota: &Quota) -> bool {
        self.layout
            .as_ref()
            .is_some_and(|l| l.quotas.iter().any(|q| q.shares_counters_with(quota)))
            || self
                .outer
                .as_ref()
                .is_some_and(|o| o.ticket().counts(quota))
    }

    /// How many entries come from a hidden outer layer's charge.
    pub(crate) fn outer_lines(&self) -> usize {
        self.outer.as_ref().map_or(0, |o| o.ticket().lines())
    }

    /// How many entries the status lists.
    pub(crate) fn lines(&self) -> usize {
        self.outer_lines() + self.layout.as_ref().map_or(0, |l| l.quotas.len())
    }

    /// Whether the counter of entry `i` is still the one that was charged
    /// at `now`: a first-use counter whose period has ended is not, even if
    /// a new one has the same key.
    pub(crate) fn line_live(&self, i: usize, now: Timestamp) -> bool {
        let offset = self.outer_lines();
        match (&self.outer, &self.layout) {
            (Some(outer), _) if i < offset => outer.ticket().line_live(i, now),
            (_, Some(layout)) => {
                let line = i - offset;
                layout.quotas[line].anchor() != Anchor::FirstUse
                    || self
                        .usage
                        .get(line)
                        .is_none_or(|usage| usage.resets_at > now)
            }
            (_, None) => false,
        }
    }

    /// What entry `i` was charged.
    pub(crate) fn line_cost(&self, i: usize) -> u64 {
        let offset = self.outer_lines();
        match (&self.outer, &self.layout) {
            (Some(outer), _) if i < offset => outer.ticket().line_cost(i),
            (_, Some(layout)) => self.costs.get(layout.line_scope[i - offset]),
            (_, None) => 0,
        }
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
                "QuotaStatus is only available behind a quota layer",
            ))
        }
    }
}
