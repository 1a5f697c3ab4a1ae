//! What a subject may spend: an allowance, a limit, a period and an anchor.

use std::fmt;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use jiff::tz::TimeZone;
use jiff::Timestamp;

use crate::key::{Namespace, PeriodKey};
use crate::period::{Anchor, Period, Window};
use crate::response::seconds_until;
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
pub struct Quota {
    limit: u64,
    allowance: Arc<str>,
    period: Period,
    anchor: Anchor,
    name: Arc<str>,
    // The name as a Structured Field string, quotes and escapes included.
    quoted_name: Arc<str>,
    named: bool,
    // The period part of first-use keys, e.g. `PT24H`.
    first_use_label: Arc<str>,
    // The calendar window of the last request, shared by clones: computing a
    // window formats a stamp, and consecutive requests nearly always fall in
    // the same one.
    current: Arc<RwLock<Option<Window>>>,
}

impl Quota {
    /// `limit` per `period`, anchored by `anchor`, for the default allowance.
    pub fn new(limit: u64, period: Period, anchor: Anchor) -> Self {
        let mut quota = Self {
            limit,
            allowance: DEFAULT_ALLOWANCE.into(),
            period,
            anchor,
            name: "".into(),
            quoted_name: "".into(),
            named: false,
            first_use_label: "".into(),
            current: Arc::default(),
        };
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
    /// # Panics
    ///
    /// When `length` is shorter than a second or not a whole number of
    /// seconds.
    pub fn rolling(limit: u64, length: Duration) -> Self {
        Self::new(limit, Period::fixed(length), Anchor::FirstUse)
    }

    /// `limit` per `length`, in windows cut at multiples of `length` since the
    /// Unix epoch (e.g. every 10 seconds).
    ///
    /// # Panics
    ///
    /// When `length` is shorter than a second or not a whole number of
    /// seconds.
    pub fn fixed_window(limit: u64, length: Duration) -> Self {
        Self::new(limit, Period::fixed(length), Anchor::Calendar)
    }

    /// Charges allowance `tag` (e.g. `read`, `write`).
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
        self.allowance = tag.into();
        self.rename();
        self
    }

    /// Counts calendar periods in time zone `tz` (default UTC).
    ///
    /// # Panics
    ///
    /// When `tz` has neither an IANA name nor a fixed offset.
    #[must_use]
    pub fn in_time_zone(mut self, tz: TimeZone) -> Self {
        self.period = self.period.in_time_zone(tz);
        self.current = Arc::default();
        self.rename();
        self
    }

    /// Anchors the period with `anchor`.
    #[must_use]
    pub fn anchored(mut self, anchor: Anchor) -> Self {
        self.anchor = anchor;
        self.current = Arc::default();
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
        self.name = name.into();
        self.named = true;
        self.quoted_name = sf_string(&self.name).into();
        self
    }

    fn rename(&mut self) {
        self.first_use_label = self.period.first_use_label().into();
        if !self.named {
            self.name = match self.anchor {
                Anchor::Calendar => format!("{}-{}", self.allowance, self.period.name()),
                Anchor::FirstUse => format!("{}-rolling-{}", self.allowance, self.period.name()),
            }
            .into();
            self.quoted_name = sf_string(&self.name).into();
        }
    }

    /// The most a subject may spend per period.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The allowance tag.
    pub fn allowance_tag(&self) -> &str {
        &self.allowance
    }

    /// The period.
    pub fn period(&self) -> &Period {
        &self.period
    }

    /// The anchor.
    pub fn anchor(&self) -> Anchor {
        self.anchor
    }

    /// The name clients see.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn quoted_name(&self) -> &str {
        &self.quoted_name
    }

    /// The length in whole seconds of the period a client is in: the
    /// calendar window at `now`, the first-use period that started at
    /// `first_call`, or one that would start now.
    pub(crate) fn window_seconds(&self, now: Timestamp, first_call: Option<Timestamp>) -> u64 {
        let seconds = match (self.anchor, first_call) {
            (Anchor::Calendar, _) => self.with_window(now, |w| seconds_until(w.start(), w.end())),
            (Anchor::FirstUse, Some(first)) => {
                seconds_until(first, self.period.end_of_first_use(first))
            }
            (Anchor::FirstUse, None) => seconds_until(now, self.period.end_of_first_use(now)),
        };
        seconds.max(1)
    }

    pub(crate) fn shared_name(&self) -> Arc<str> {
        Arc::clone(&self.name)
    }

    /// The calendar window containing `at` (for [`Anchor::FirstUse`], the
    /// window a counter created at `at` would have).
    pub fn window(&self, at: Timestamp) -> Window {
        match self.anchor {
            Anchor::Calendar => self.with_window(at, Window::clone),
            Anchor::FirstUse => {
                Window::first_use(at, self.period.end_of_first_use(at), &self.first_use_label)
            }
        }
    }

    fn with_window<R>(&self, at: Timestamp, f: impl FnOnce(&Window) -> R) -> R {
        {
            let current = self.current.read().unwrap_or_else(|e| e.into_inner());
            if let Some(window) = current.as_ref().filter(|w| w.contains(at)) {
                return f(window);
            }
        }
        let window = self.period.window(at);
        let result = f(&window);
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        // Keep the later window when requests race across a boundary.
        if current.as_ref().is_none_or(|w| w.start() < window.start()) {
            *current = Some(window);
        }
        result
    }

    /// The key of `subject`'s counter for this quota at `at`.
    pub fn key(&self, namespace: &Namespace, subject: &Subject, at: Timestamp) -> PeriodKey {
        self.line(namespace, subject, at, 0).key
    }

    /// What the store is asked to charge for `subject` at `at`.
    pub fn line(
        &self,
        namespace: &Namespace,
        subject: &Subject,
        at: Timestamp,
        cost: u64,
    ) -> ChargeLine {
        match self.anchor {
            Anchor::Calendar => self.with_window(at, |window| ChargeLine {
                key: namespace.key(subject, &self.allowance, window.stamp()),
                limit: self.limit,
                cost,
                lifetime: Lifetime::Calendar {
                    start: window.start(),
                    end: window.end(),
                },
            }),
            Anchor::FirstUse => ChargeLine {
                key: namespace.key(subject, &self.allowance, &self.first_use_label),
                limit: self.limit,
                cost,
                lifetime: Lifetime::FirstUse {
                    deadline: self.period.end_of_first_use(at),
                },
            },
        }
    }

    /// Whether two quotas would count on the same keys.
    pub(crate) fn shares_counters_with(&self, other: &Quota) -> bool {
        self.allowance == other.allowance && self.counter_space() == other.counter_space()
    }

    /// What a key says about the period, beyond the allowance: the first-use
    /// label, or which calendar the stamps come from. Quotas that agree here
    /// write the same keys.
    fn counter_space(&self) -> String {
        match self.anchor {
            Anchor::FirstUse => self.first_use_label.to_string(),
            Anchor::Calendar => self.period.calendar_identity(),
        }
    }
}

impl fmt::Debug for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Quota")
            .field("name", &self.name)
            .field("allowance", &self.allowance)
            .field("limit", &self.limit)
            .field("period", &self.period)
            .field("anchor", &self.anchor)
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
