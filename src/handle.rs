use std::fmt;
use std::sync::Arc;

use jiff::Timestamp;

use crate::key::PeriodKey;
use crate::layer::Config;
use crate::quota::Quota;
use crate::store::{ChargeRequest, Store, StoreError, Usage};
use crate::subject::Subject;

/// The counters of a [`QuotaLayer`](crate::QuotaLayer), for support tools and
/// handlers: where a subject stands, refunds and resets. Made with
/// [`QuotaLayer::handle`](crate::QuotaLayer::handle); uses the layer's
/// clock, namespace and store.
///
/// ```
/// use tower_quota::{FromHeader, QuotaLayer, Subject};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let layer = QuotaLayer::daily(1_000, FromHeader::account("x-account-id"));
/// let handle = layer.handle();
/// let acme = Subject::account("acme");
/// let status = handle.usage(&acme).await.unwrap();
/// assert_eq!(status[0].usage.remaining(), 1_000);
/// # }
/// ```
pub struct QuotaHandle<St> {
    config: Arc<Config>,
    store: St,
}

/// Where one subject stands on one quota.
#[derive(Clone, Debug)]
pub struct QuotaUsage {
    /// The quota.
    pub quota: Quota,
    /// The counter's key.
    pub key: PeriodKey,
    /// The counter's state.
    pub usage: Usage,
}

impl<St: Store> QuotaHandle<St> {
    pub(crate) fn new(config: Arc<Config>, store: St) -> Self {
        Self { config, store }
    }

    /// The quotas.
    pub fn quotas(&self) -> &[Quota] {
        &self.config.quotas
    }

    fn request(&self, subject: &Subject) -> ChargeRequest {
        let now = self.config.clock.now();
        let lines = self
            .config
            .quotas
            .iter()
            .map(|q| q.line(&self.config.namespace, subject, now, 0))
            .collect();
        ChargeRequest { now, lines }
    }

    /// Where `subject` stands on every quota now. Charges nothing.
    pub async fn usage(&self, subject: &Subject) -> Result<Vec<QuotaUsage>, StoreError> {
        let request = self.request(subject);
        let keys: Vec<PeriodKey> = request.lines.iter().map(|l| l.key.clone()).collect();
        let usage = self.store.peek(request).await?;
        Ok(self
            .config
            .quotas
            .iter()
            .zip(keys)
            .zip(usage)
            .map(|((quota, key), usage)| QuotaUsage {
                quota: quota.clone(),
                key,
                usage,
            })
            .collect())
    }

    /// Gives `amount` back to `subject` on every quota's current counter,
    /// e.g. after a request failed on the server's side. Creates nothing and
    /// moves no deadline. Same as [`QuotaHandle::refund_at`] at the clock's
    /// current instant.
    pub async fn refund(
        &self,
        subject: &Subject,
        amount: u64,
    ) -> Result<Vec<Option<u64>>, StoreError> {
        self.refund_at(subject, self.config.clock.now(), amount)
            .await
    }

    /// Gives `amount` back to `subject` on the counters of the periods that
    /// were open at `charged_at`, the instant of the charge being undone, so a
    /// refund made after a boundary never credits the next period.
    ///
    /// Returns, per quota, what the counter holds afterwards, or `None` when
    /// nothing was refunded: that period has ended (calendar), or the
    /// subject's first-use period started after `charged_at`.
    ///
    /// A first-use counter is read, then refunded, in two calls to the
    /// store: if its period ends and a new one opens in between, the new
    /// period gets the refund.
    pub async fn refund_at(
        &self,
        subject: &Subject,
        charged_at: Timestamp,
        amount: u64,
    ) -> Result<Vec<Option<u64>>, StoreError> {
        let now = self.config.clock.now();
        let lines: Vec<_> = self
            .config
            .quotas
            .iter()
            .map(|q| q.line(&self.config.namespace, subject, charged_at, 0))
            .collect();
        let current = self
            .store
            .peek(ChargeRequest {
                now,
                lines: lines.clone(),
            })
            .await?;
        let mut refunded = Vec::with_capacity(lines.len());
        for (line, usage) in lines.into_iter().zip(current) {
            let later_period = usage.first_call.is_some_and(|first| first > charged_at);
            refunded.push(if later_period {
                None
            } else {
                self.store.refund(now, line.key, amount).await?
            });
        }
        Ok(refunded)
    }

    /// Gives `subject` a fresh allowance on every quota: the current counters
    /// are deleted (a first-use period restarts at the next call).
    pub async fn reset(&self, subject: &Subject) -> Result<(), StoreError> {
        for line in self.request(subject).lines {
            self.store.reset(line.key).await?;
        }
        Ok(())
    }
}

impl<St: Clone> Clone for QuotaHandle<St> {
    fn clone(&self) -> Self {
        Self {
            config: Arc::clone(&self.config),
            store: self.store.clone(),
        }
    }
}

impl<St: fmt::Debug> fmt::Debug for QuotaHandle<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaHandle")
            .field("quotas", &self.config.quotas)
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}
