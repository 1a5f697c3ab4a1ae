//! What a subject may spend: an allowance, a limit, a period and an anchor.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use jiff::tz::TimeZone;
use jiff::Timestamp;

use crate::key::{KeyPart, Namespace, PeriodKey};
use crate::period::cache::WindowCache;
use crate::period::seconds_until;
use crate::period::{Anchor, Period, Window};
use crate::store::{ChargeLine, Lifetime};
use crate::subject::Subject;

/// The allowance tag of quotas built without one.
pub const DEFAULT_ALLOWANCE: &str = "default";

/// One quota: `limit` units of allowance `allowance` per `period`, anchored on
/// the calendar or on first use.
///
/// Quotas with different allowance tags never spend each other's budget:
/// `read` and `write` have counters of their own. The quota's name is what
/// clients see in the `RateLimit-Policy` and `RateLimit` fields and in
/// `violated-policies`; by default it is `{allowance}-{period}` (e.g.
/// `read-day`, `write-rolling-24h`).
///
/// ```
/// use std::time::Duration;
/// use tower_quota::{Anchor, Quota};
///
/// let daily = Quota::daily(1_000).allowance("read");
/// assert_eq!(daily.name(), "read-day");
/// assert_eq!(daily.anchor(), Anchor::Calendar);
///
/// let rolling = Quota::rolling(100, Duration::from_secs(24 * 3600)).allowance("write");
/// assert_eq!(rolling.name(), "write-rolling-24h");
/// ```
#[derive(Clone)]
pub struct Quota(Arc<Inner>);

#[derive(Clone)]
struct Inner {
    limit: u64,
    // Limits of named plans; a plan not listed here gets `limit`.
    plans: Vec<(Arc<str>, u64)>,
    allowance: Arc<str>,
    // The allowance as its keys write it.
    allowance_part: KeyPart,
    period: Period,
    anchor: Anchor,
    name: Arc<str>,
    // The name as a Structured Field string, quotes and escapes included.
    quoted_name: Arc<str>,
    named: bool,
    // Counted and reported, never refusing.
    shadow: bool,
    // The most seconds added to the reset a client is told, per subject.
    spread: u64,
    // The period part of first-use keys, e.g. `PT24H`.
    first_use_label: Arc<str>,
    // The calendar window of the last request, shared by clones: computing a
    // window formats a stamp, and consecutive requests nearly always fall in
    // the same one.
    current: Arc<WindowCache>,
}

impl Quota {
    /// `limit` per `period`, anchored by `anchor`, for the default allowance.
    pub fn new(limit: u64, period: Period, anchor: Anchor) -> Self {
        let mut quota = Self(Arc::new(Inner {
            limit,
            plans: Vec::new(),
            allowance: DEFAULT_ALLOWANCE.into(),
            allowance_part: KeyPart::new(DEFAULT_ALLOWANCE),
            period,
            anchor,
            name: "".into(),
            quoted_name: "".into(),
            named: false,
            shadow: false,
            spread: 0,
            first_use_label: "".into(),
            current: Arc::default(),
        }));
        quota.rename();
        quota
    }

    /// `limit` per calendar minute.
    pub fn per_minute(limit: u64) -> Self {
        Self::new(limit, Period::minute(), Anchor::Calendar)
    }

    /// `limit` per calendar hour.
    pub fn hourly(limit: u64) -> Self {
        Self::new(limit, Period::hour(), Anchor::Calendar)
    }

    /// `limit` per calendar day (UTC unless [`Quota::in_time_zone`]).
    pub fn daily(limit: u64) -> Self {
        Self::new(limit, Period::day(), Anchor::Calendar)
    }

    /// `limit` per ISO week, Monday to Monday.
    pub fn weekly(limit: u64) -> Self {
        Self::new(limit, Period::week(), Anchor::Calendar)
    }

    /// `limit` per calendar month.
    pub fn monthly(limit: u64) -> Self {
        Self::new(limit, Period::month(), Anchor::Calendar)
    }

    /// `limit` per `length`, counted from each subject's first call.
    ///
    /// The first call that spends opens the period. One whose charge is
    /// given back whole (refused by a layer further in, not served, a 5xx
    /// under `refund_server_errors`, undone by its handler, a deferred
    /// cost of 0) opens none: the period its charge opened closes with the
    /// give-back when nothing else is spent in it by then. A support
    /// refund never closes a period, and once one lowered the count, no
    /// give-back closes that period either.
    ///
    /// # Panics
    ///
    /// When `length` is shorter than a second, longer than 100 years, or not
    /// a whole number of seconds.
    pub fn rolling(limit: u64, length: Duration) -> Self {
        Self::new(limit, Period::fixed(length), Anchor::FirstUse)
    }

    /// `limit` per `length`, in windows cut at multiples of `length` since the
    /// Unix epoch (e.g. every 10 seconds).
    ///
    /// # Panics
    ///
    /// When `length` is shorter than a second, longer than 100 years, or not
    /// a whole number of seconds.
    pub fn fixed_window(limit: u64, length: Duration) -> Self {
        Self::new(limit, Period::fixed(length), Anchor::Calendar)
    }

    fn inner(&mut self) -> &mut Inner {
        Arc::make_mut(&mut self.0)
    }

    /// Charges allowance `tag` (e.g. `read`, `write`; default `default`).
    ///
    /// # Panics
    ///
    /// When `tag` is empty or holds anything but printable ASCII: it is part
    /// of the quota's default name, which travels in response fields.
    #[must_use]
    pub fn allowance(mut self, tag: impl Into<String>) -> Self {
        let tag = tag.into();
        assert!(
            !tag.is_empty() && tag.bytes().all(|b| (0x20..0x7f).contains(&b)),
            "an allowance tag is non-empty printable ASCII (got {tag:?})"
        );
        let inner = self.inner();
        inner.allowance_part = KeyPart::new(&tag);
        inner.allowance = tag.into();
        self.rename();
        self
    }

    /// Counts calendar periods in time zone `tz` (default UTC). A policy
    /// that reads each caller's zone
    /// ([`QuotaPolicyBuilder::time_zone`](crate::QuotaPolicyBuilder::time_zone))
    /// counts a caller who names one in theirs instead.
    ///
    /// # Panics
    ///
    /// When `tz` is neither a zone of the IANA list nor a fixed offset (see
    /// [`Period::in_time_zone`]).
    #[must_use]
    pub fn in_time_zone(mut self, tz: TimeZone) -> Self {
        let inner = self.inner();
        inner.period = inner.period.clone().in_time_zone(tz);
        inner.current = Arc::default();
        self.rename();
        self
    }

    /// Anchors the period with `anchor`.
    #[must_use]
    pub fn anchored(mut self, anchor: Anchor) -> Self {
        let inner = self.inner();
        inner.anchor = anchor;
        inner.current = Arc::default();
        self.rename();
        self
    }

    /// Names the quota in response fields, e.g. `free-tier-daily`.
    ///
    /// # Panics
    ///
    /// When `name` is empty or holds anything but printable ASCII: it travels
    /// in a Structured Field string.
    #[must_use]
    pub fn named(mut self, name: impl Into<String>) -> Self {
        let name = name.into();
        assert!(
            !name.is_empty() && name.bytes().all(|b| (0x20..0x7f).contains(&b)),
            "a quota name is non-empty printable ASCII (got {name:?})"
        );
        let inner = self.inner();
        inner.quoted_name = sf_string(&name).into();
        inner.name = name.into();
        inner.named = true;
        self
    }

    /// Subjects on plan `plan` get `limit` instead of the quota's own limit,
    /// which stays the limit of every plan not listed. The plan is read per
    /// request (see [`QuotaPolicyBuilder::plan`](crate::QuotaPolicyBuilder::plan))
    /// and is not part of the counter's key: a subject whose plan changes
    /// keeps what it spent this period, measured against the new limit.
    ///
    /// ```
    /// use tower_quota::Quota;
    ///
    /// let daily = Quota::daily(100).plan("pro", 10_000).plan("enterprise", 1_000_000);
    /// assert_eq!(daily.limit_for(Some("pro")), 10_000);
    /// assert_eq!(daily.limit_for(Some("free")), 100);
    /// assert_eq!(daily.limit_for(None), 100);
    /// ```
    ///
    /// # Panics
    ///
    /// When `plan` is empty.
    #[must_use]
    pub fn plan(mut self, plan: impl Into<String>, limit: u64) -> Self {
        let plan = plan.into();
        assert!(!plan.is_empty(), "a plan name is not empty");
        let inner = self.inner();
        inner.plans.retain(|(p, _)| **p != *plan);
        inner.plans.push((plan.into(), limit));
        self
    }

    /// Shadow mode: the quota is counted and reported (fields, logs,
    /// metrics) but never refuses a request, so a new limit can be watched
    /// before it is enforced. A request over a shadow quota's limit is
    /// logged at info level, a few times per second at most.
    ///
    /// Nor does a layer whose quotas are all shadow quotas refuse for any
    /// other reason: when the store fails, even under
    /// [`OnStoreError::FailClosed`](crate::OnStoreError::FailClosed), the
    /// request passes and owes its charge to the policy's ledger, as under
    /// fail open; a request it cannot charge (no usable subject, an unknown
    /// plan, a cost or zone it cannot read) passes it uncounted. The
    /// policy's enforced layers still decide for themselves, and refuse
    /// what they refuse.
    ///
    /// A shadow quota counts until its counter holds the most its store
    /// counts (`u64::MAX` on the memory store, 2^53 - 1 on Redis); then it
    /// takes no more until it resets: the request's charge goes to the
    /// store again without it (a second call, with a `store_timeout` of its
    /// own), and the quota is left out of that request's fields and
    /// [`QuotaStatus`](crate::QuotaStatus). It is logged, and counted as
    /// `shadow_refused`.
    ///
    /// It counts what was served: every request, those over its limit
    /// too. Enforced, it would not have counted those, so where requests
    /// cost alike the shadow refusals are the refusals enforcing it would
    /// make; where costs differ (a cheap request after a refused expensive
    /// one), requests past the first over the limit count as shadow
    /// refusals until the reset, some an enforced quota would have admitted.
    ///
    /// ```
    /// use tower_quota::Quota;
    ///
    /// let trial = Quota::per_minute(100).allowance("search").shadow();
    /// assert!(trial.is_shadow());
    /// ```
    #[must_use]
    pub fn shadow(mut self) -> Self {
        self.inner().shadow = true;
        self
    }

    /// Whether the quota is in shadow mode.
    pub fn is_shadow(&self) -> bool {
        self.0.shadow
    }

    /// Spreads the reset clients are told for a calendar quota: each subject
    /// is told a reset up to `spread` later than the real one (the same for
    /// a subject throughout a window, different across subjects), in the
    /// `RateLimit` field's `t` and in `Retry-After`, so refused clients do
    /// not all come back in the same second when the window turns. Never
    /// earlier than the real reset. No effect on first-use quotas, whose
    /// resets are spread already. The bound below is half the nominal
    /// period: where a window is shorter than that (the 15 minutes left of
    /// an hour when a zone's clocks move by 45, as Pacific/Chatham's do), a
    /// subject may be told a reset past the next window's end, later than
    /// needed, never earlier.
    ///
    /// # Panics
    ///
    /// When `spread` is not a whole number of seconds, or longer than half
    /// the period (12 hours for a day, 30 seconds for a minute, 15 days for
    /// a month): a reset told later would pass the next window's, in which
    /// the allowance has come back already.
    #[must_use]
    pub fn spread_reset(mut self, spread: Duration) -> Self {
        let most = self.0.period.nominal_seconds() / 2;
        assert!(
            spread.subsec_nanos() == 0 && spread.as_secs() <= most,
            "a reset spread is a whole number of seconds, at most half the period: {most} s for {} (got {spread:?})",
            self.0.period.name()
        );
        self.inner().spread = spread.as_secs();
        self
    }

    /// Whether the quota spreads the resets it tells clients.
    pub(crate) fn spreads(&self) -> bool {
        self.0.spread > 0 && self.0.anchor == Anchor::Calendar
    }

    /// Seconds added to the reset told to the subject whose hash is
    /// `subject`: at most the quota's spread.
    pub(crate) fn spread_for(&self, subject: u64) -> u64 {
        if self.0.spread == 0 || self.0.anchor == Anchor::FirstUse {
            return 0;
        }
        // A different draw per quota for one subject, the same on every
        // instance: a hash of the name that no process or release changes.
        let mixed = subject ^ fnv1a_64(self.0.name.as_bytes());
        mixed.wrapping_mul(0xbf58_476d_1ce4_e5b9).rotate_left(31) % self.0.spread.saturating_add(1)
    }

    /// The plans this quota names, with their limits.
    pub fn plans(&self) -> impl Iterator<Item = (&str, u64)> + '_ {
        self.0.plans.iter().map(|(p, l)| (&**p, *l))
    }

    /// The limit for a subject on `plan` (`None`: no plan, the quota's own
    /// limit).
    #[inline]
    pub fn limit_for(&self, plan: Option<&str>) -> u64 {
        plan.and_then(|plan| {
            self.0
                .plans
                .iter()
                .find(|(p, _)| **p == *plan)
                .map(|(_, l)| *l)
        })
        .unwrap_or(self.0.limit)
    }

    /// This quota as a caller in zone `tz` counts it: a calendar quota whose
    /// windows depend on the zone moves to it; any other is itself.
    pub(crate) fn in_callers_zone(&self, tz: &TimeZone) -> Self {
        if self.0.anchor != Anchor::Calendar || !self.0.period.depends_on_zone() {
            return self.clone();
        }
        self.clone().in_time_zone(tz.clone())
    }

    fn rename(&mut self) {
        let label = self.0.period.first_use_label();
        let inner = self.inner();
        inner.first_use_label = label.into();
        if !inner.named {
            inner.name = match inner.anchor {
                Anchor::Calendar => format!("{}-{}", inner.allowance, inner.period.name()),
                Anchor::FirstUse => format!("{}-rolling-{}", inner.allowance, inner.period.name()),
            }
            .into();
            inner.quoted_name = sf_string(&inner.name).into();
        }
    }

    /// The most a subject without a plan (or on a plan this quota does not
    /// name) may spend per period.
    pub fn limit(&self) -> u64 {
        self.0.limit
    }

    /// The allowance tag.
    pub fn allowance_tag(&self) -> &str {
        &self.0.allowance
    }

    /// The allowance tag, shared: a metrics label without a copy.
    pub(crate) fn allowance_shared(&self) -> &Arc<str> {
        &self.0.allowance
    }

    /// The period.
    pub fn period(&self) -> &Period {
        &self.0.period
    }

    /// The anchor.
    pub fn anchor(&self) -> Anchor {
        self.0.anchor
    }

    /// The name clients see.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// How the allowance returns, in words: `every day at 00:00
    /// Europe/Berlin`, `24h after the first call`.
    pub fn describe_reset(&self) -> String {
        self.0.period.describe_reset(self.0.anchor)
    }

    /// The window length every client of this quota sees, when it never
    /// changes, and the quota has one limit for every plan.
    pub(crate) fn constant_window(&self) -> Option<u64> {
        if !self.0.plans.is_empty() {
            return None;
        }
        self.0
            .period
            .constant_seconds(self.0.anchor)
            .map(|s| s.max(1))
    }

    pub(crate) fn quoted_name(&self) -> &str {
        &self.0.quoted_name
    }

    /// The length in whole seconds of the period a client is in: the
    /// calendar window at `now`, the first-use period that started at
    /// `first_call`, or one that would start now.
    pub(crate) fn window_seconds(&self, now: Timestamp, first_call: Option<Timestamp>) -> u64 {
        let period = &self.0.period;
        let seconds = match (self.0.anchor, first_call) {
            (Anchor::Calendar, _) => {
                self.with_window(now, true, |start, end, _| seconds_until(start, end))
            }
            // A first call the store reports near the end of time (written
            // by another tool): the period's length as one opened now.
            (Anchor::FirstUse, Some(first)) => match period.checked_end_of_first_use(first) {
                Some(end) => seconds_until(first, end),
                None => seconds_until(now, period.end_of_first_use(now)),
            },
            (Anchor::FirstUse, None) => seconds_until(now, period.end_of_first_use(now)),
        };
        seconds.max(1)
    }

    /// The calendar window containing `at` (for [`Anchor::FirstUse`], the
    /// window a counter created at `at` would have).
    pub fn window(&self, at: Timestamp) -> Window {
        match self.0.anchor {
            // Read from the windows kept for requests, never kept from here:
            // a look at a window to come (a status page's next reset) would
            // take the place of the current one until it starts.
            Anchor::Calendar => self.with_window(at, false, |start, end, stamp| {
                Window::new(start, end, String::from_utf8_lossy(stamp).into_owned())
            }),
            Anchor::FirstUse => Window::first_use(
                at,
                self.0.period.end_of_first_use(at),
                &self.0.first_use_label,
            ),
        }
    }

    /// Runs `f` on the calendar window containing `at` (its start, end and
    /// stamp, as the bytes of a `str`), computed once per window and shared
    /// by the quota's clones; a window computed here is kept for the next
    /// requests when `keep` (for a request's own instant, not for a look
    /// elsewhere in time).
    fn with_window<R, F>(&self, at: Timestamp, keep: bool, f: F) -> R
    where
        F: FnOnce(Timestamp, Timestamp, &[u8]) -> R,
    {
        match self.0.current.with(at, f) {
            Ok(result) => result,
            Err(f) => {
                let window = self.0.period.window(at);
                if keep {
                    self.0.current.put(&window);
                }
                f(window.start(), window.end(), window.stamp().as_bytes())
            }
        }
    }

    /// The key of `subject`'s counter for this quota at `at`.
    pub fn key(&self, namespace: &Namespace, subject: &Subject, at: Timestamp) -> PeriodKey {
        self.line(namespace, subject, at, 0).key
    }

    /// What the store is asked to charge for `subject` at `at`, against the
    /// quota's own limit.
    pub fn line(
        &self,
        namespace: &Namespace,
        subject: &Subject,
        at: Timestamp,
        cost: u64,
    ) -> ChargeLine {
        // Not kept: `at` may be anywhere in time (see `Quota::window`).
        self.line_kept(namespace, subject, at, cost, self.0.limit, false)
    }

    /// As [`Quota::line`], against `limit` (a plan's), for a request at
    /// `at` (its window is kept for the next requests).
    pub(crate) fn line_with_limit(
        &self,
        namespace: &Namespace,
        subject: &Subject,
        at: Timestamp,
        cost: u64,
        limit: u64,
    ) -> ChargeLine {
        self.line_kept(namespace, subject, at, cost, limit, true)
    }

    /// As [`Quota::line`], against `limit` (a plan's), at `at` anywhere in
    /// time: the window computed is not kept for requests (support's
    /// lookups).
    pub(crate) fn line_not_kept(
        &self,
        namespace: &Namespace,
        subject: &Subject,
        at: Timestamp,
        limit: u64,
    ) -> ChargeLine {
        self.line_kept(namespace, subject, at, 0, limit, false)
    }

    /// Whether the window containing `at` is the one kept for requests.
    #[cfg(test)]
    pub(crate) fn keeps_window_of(&self, at: Timestamp) -> bool {
        self.0.current.with(at, |_, _, _| ()).is_ok()
    }

    /// As [`Quota::line_with_limit`], keeping the window computed when
    /// `keep` (see [`Quota::with_window`]).
    #[inline]
    fn line_kept(
        &self,
        namespace: &Namespace,
        subject: &Subject,
        at: Timestamp,
        cost: u64,
        limit: u64,
        keep: bool,
    ) -> ChargeLine {
        let inner = &*self.0;
        match inner.anchor {
            Anchor::Calendar => self.with_window(at, keep, |start, end, stamp| ChargeLine {
                key: namespace.key_with_period(subject, &inner.allowance_part, stamp),
                limit,
                cost,
                lifetime: Lifetime::Calendar { start, end },
                shadow_limit: None,
            }),
            Anchor::FirstUse => ChargeLine {
                key: namespace.key_with_period(
                    subject,
                    &inner.allowance_part,
                    inner.first_use_label.as_bytes(),
                ),
                limit,
                cost,
                lifetime: Lifetime::FirstUse {
                    deadline: inner.period.end_of_first_use(at),
                },
                shadow_limit: None,
            },
        }
    }

    /// Whether two quotas may count on the same keys; with `any_zone`,
    /// whether they may for some caller, whose zone replaces theirs.
    pub(crate) fn shares_counters_with(&self, other: &Quota, any_zone: bool) -> bool {
        if self.0.allowance != other.0.allowance || self.0.anchor != other.0.anchor {
            return false;
        }
        match self.0.anchor {
            Anchor::FirstUse => self.0.first_use_label == other.0.first_use_label,
            Anchor::Calendar if any_zone => self.0.period.same_unit(&other.0.period),
            Anchor::Calendar => self.0.period.may_share_stamps(&other.0.period),
        }
    }

    /// Whether `other` is this very quota (built twice, e.g. by a helper
    /// that makes "the daily layer" for two routers): same counters, same
    /// name, same limits. Such quotas share one budget on purpose.
    pub(crate) fn same_as(&self, other: &Quota) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || (self.shares_counters_with(other, false)
                && (self.0.anchor == Anchor::FirstUse
                    || self.0.period.calendar_identity() == other.0.period.calendar_identity())
                && self.0.name == other.0.name
                && self.0.limit == other.0.limit
                && self.0.shadow == other.0.shadow
                && self.0.spread == other.0.spread
                && self.0.plans.len() == other.0.plans.len()
                && self.plans().all(|(p, l)| {
                    other.limit_for(Some(p)) == l && other.plans().any(|(q, _)| q == p)
                }))
    }
}

impl fmt::Display for Quota {
    /// The quota's name.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.name)
    }
}

impl fmt::Debug for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Quota")
            .field("name", &self.0.name)
            .field("allowance", &self.0.allowance)
            .field("limit", &self.0.limit)
            .field("plans", &self.0.plans)
            .field("period", &self.0.period)
            .field("anchor", &self.0.anchor)
            .field("shadow", &self.0.shadow)
            .field("spread_reset_secs", &self.0.spread)
            .finish()
    }
}

/// `s` as a Structured Field string.
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// FNV-1a, 64 bits: a hash of `bytes` that no process, platform or release
/// changes.
pub(crate) fn fnv1a_64(bytes: &[u8]) -> u64 {
    fnv1a_64_from(0xcbf2_9ce4_8422_2325, bytes)
}

/// FNV-1a, 64 bits, going on from `hash` (of what came before `bytes`).
pub(crate) fn fnv1a_64_from(hash: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(hash, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A first call a store reports at the end of time (another tool wrote
    /// it) tells the window of a period opened now, never a panic.
    #[test]
    fn a_first_call_at_the_end_of_time_tells_the_periods_length() {
        let now: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap();
        let last = Timestamp::MAX - jiff::SignedDuration::from_hours(1);
        for (quota, length) in [
            (Quota::rolling(10, Duration::from_secs(86_400)), 86_400),
            (Quota::monthly(10).anchored(Anchor::FirstUse), 31 * 86_400),
        ] {
            assert_eq!(quota.window_seconds(now, Some(last)), length);
        }
    }

    /// A look at a window to come (a status page's next reset) leaves the
    /// window kept for the requests of today as it is: they find it.
    #[test]
    fn a_look_at_tomorrow_keeps_todays_window_for_requests() {
        let today: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap();
        let tomorrow: Timestamp = "2026-12-03T10:00:00Z".parse().unwrap();
        let quota = Quota::daily(10);
        let subject = Subject::account("acme");
        let namespace = Namespace::default();
        let _ = quota.line_with_limit(&namespace, &subject, today, 1, 10);
        let kept = |at| quota.keeps_window_of(at);
        assert!(kept(today));
        assert_eq!(quota.window(tomorrow).stamp(), "2026-12-03");
        assert_eq!(
            quota.line(&namespace, &subject, tomorrow, 1).key,
            namespace.key(&subject, "default", "2026-12-03")
        );
        assert!(kept(today), "today's window is still kept");
    }

    /// Support's lookups at an instant anywhere in time (a refund of a
    /// charge at a bogus instant to come) leave the window kept for
    /// requests as it is: the layer would compute its window and key
    /// afresh on every request until then.
    #[tokio::test]
    async fn supports_lookups_keep_todays_window_for_requests() {
        let today: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap();
        let later: Timestamp = "2026-12-09T10:00:00Z".parse().unwrap();
        let policy = crate::QuotaPolicy::builder(crate::FromHeader::account("x-account-id"))
            .clock(crate::ManualClock::new(today))
            .build();
        let quota = Quota::daily(10);
        let _layer = policy.layer(quota.clone());
        let subject = Subject::account("acme");
        let _ = quota.line_with_limit(&Namespace::default(), &subject, today, 1, 10);
        assert!(quota.keeps_window_of(today));
        let handle = policy.handle();
        assert_eq!(handle.refund_at(&subject, later, 1).await.unwrap(), [None]);
        let _ = handle.usage(&subject).await.unwrap();
        assert!(quota.keeps_window_of(today), "today's window is still kept");
    }

    #[test]
    fn fnv1a_64_test_vectors() {
        assert_eq!(fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn quotas_with_names_of_one_length_draw_different_spreads() {
        let spread = Duration::from_secs(3_600);
        let read = Quota::daily(1).allowance("read").spread_reset(spread);
        let list = Quota::daily(1).allowance("list").spread_reset(spread);
        assert_eq!(read.name().len(), list.name().len());
        let differ = (0..64_u64)
            .filter(|&s| read.spread_for(s) != list.spread_for(s))
            .count();
        assert!(differ > 32, "{differ} of 64 subjects draw differently");
    }

    /// Every instance, of every release, tells a subject the same reset.
    #[test]
    fn a_subject_draws_the_same_spread_everywhere() {
        let read = Quota::daily(1)
            .allowance("read")
            .spread_reset(Duration::from_secs(3_600));
        let draws: Vec<u64> = [0, 1, 0x0123_4567_89ab_cdef]
            .into_iter()
            .map(|s| read.spread_for(s))
            .collect();
        assert_eq!(draws, [3_219, 2_267, 1_709]);
    }
}
