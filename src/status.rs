//! What a request carries once quota layers have seen it: for each policy,
//! who was charged and on which counters ([`Ticket`]), and the handler's view
//! of it ([`QuotaStatus`]).

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use http::Extensions;
use jiff::tz::TimeZone;
use jiff::Timestamp;
use smallvec::SmallVec;

use crate::key::PeriodKey;
use crate::period::Anchor;
use crate::quota::Quota;
use crate::response::PolicyCache;
use crate::store::Usage;
use crate::subject::Subject;

/// Where one subject stands on one quota: what [`QuotaStatus`] lists for a
/// request, and [`QuotaHandle::usage`](crate::QuotaHandle::usage) for support
/// tools.
#[derive(Clone, Debug)]
pub struct QuotaUsage {
    quota: Quota,
    key: PeriodKey,
    usage: Usage,
}

impl QuotaUsage {
    pub(crate) fn new(quota: Quota, key: PeriodKey, usage: Usage) -> Self {
        Self { quota, key, usage }
    }

    /// The quota, in the time zone it was counted in.
    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// The counter's key.
    pub fn key(&self) -> &PeriodKey {
        &self.key
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

    /// The call that opened a first-use period, if one is open; `None` for
    /// a calendar quota.
    pub fn first_call(&self) -> Option<Timestamp> {
        match self.quota.anchor() {
            Anchor::FirstUse => self.usage.first_call,
            Anchor::Calendar => None,
        }
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
            "anchor": self.quota().anchor().as_str(),
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

/// Where the caller stands: one entry per quota that applied to the request,
/// whatever layers the request passed: policy by policy, in the order the
/// request met the policies, and within a policy outer layers first. A request no quota counted (a
/// skip rule, a request without a subject let through) has no entries.
///
/// Quota layers insert it into the request's extensions; with the `axum`
/// feature it is an extractor (answering 500 with `MissingQuotaStatus`
/// behind no quota layer; `Option<QuotaStatus>` answers `None` there
/// instead). It is also how the layers recognise a
/// request they already charged: a request built with another request's
/// extensions (a sub-request of a batch endpoint) passes those layers
/// uncharged, and a refusal or a drop inside it leaves the request's charge
/// as it is, as long as the request is served (a refusal inside marks the
/// request's lines: answered with an error itself, a 4xx, a 5xx or a gRPC
/// status other than OK, the request is given back as refused, unless the
/// quota layer that refused it let a request carrying the status through
/// since, as a retry's next attempt). Remove
/// `QuotaStatus` from the extensions you copy when the sub-request must be
/// charged on its own.
///
/// It holds the layers that charged the request (their policy and store
/// with them), as the request does while it is served: keep what you need
/// of it ([`entries`](Self::entries), [`charged_at`](Self::charged_at)),
/// not the status itself, past the request.
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
#[derive(Clone, Default)]
pub struct QuotaStatus {
    /// One per policy whose layers the request passed, in the order it met
    /// them (nearly always one).
    tickets: SmallVec<[Ticket; 1]>,
}

impl QuotaStatus {
    /// One entry per quota that applied to the request, outer layers first,
    /// as the request leaves its counters now: as charged, less what was
    /// given back since (by
    /// [`QuotaHandle::refund_request`](crate::QuotaHandle::refund_request)).
    /// A quota whose charge the request owes (it passed on a failed charge
    /// under [`OnStoreError::FailOpen`](crate::OnStoreError::FailOpen)) has
    /// none: the store did not say where the caller stands.
    pub fn entries(&self) -> Vec<QuotaUsage> {
        self.lines().map(entry).collect()
    }

    /// The entry of the quota named `name`, as [`entries`](Self::entries)
    /// has it.
    pub fn get(&self, name: &str) -> Option<QuotaUsage> {
        self.lines()
            .find(|(quota, _)| quota.name() == name)
            .map(entry)
    }

    /// Every line charged, with its quota, outer layers first.
    fn lines(&self) -> impl Iterator<Item = (&Quota, &Line)> {
        self.tickets
            .iter()
            .flat_map(|ticket| ticket.charges.iter())
            .flat_map(|lines| lines.with_quotas())
    }

    /// The instant the request was first charged (by the first policy that
    /// counted it): what
    /// [`QuotaHandle::refund_at`](crate::QuotaHandle::refund_at) takes to
    /// undo it later, with a handle in the caller's zone
    /// ([`QuotaHandle::in_zone`](crate::QuotaHandle::in_zone)) when the
    /// policy reads one per caller. While the request is served,
    /// [`QuotaHandle::refund_request`](crate::QuotaHandle::refund_request)
    /// undoes it with neither. `None` when nothing was charged. With
    /// several policies on the route, each charges at its own instant:
    /// [`QuotaHandle::charged_at`](crate::QuotaHandle::charged_at) tells a
    /// policy's own.
    ///
    /// A request that passed on a failed charge under
    /// [`OnStoreError::FailOpen`](crate::OnStoreError::FailOpen) owes its
    /// charge, counted once the policy's ledger settles it: this is its
    /// instant all the same (a refund made before the ledger settled may
    /// find no counter to give back to).
    pub fn charged_at(&self) -> Option<Timestamp> {
        self.tickets.iter().find(|t| t.counted()).map(|t| t.now)
    }

    /// Whether no quota counted the request: nothing charged, and nothing
    /// owed (a request that passed on a failed charge under
    /// [`OnStoreError::FailOpen`](crate::OnStoreError::FailOpen) is counted
    /// once the policy's ledger settles it).
    pub fn is_exempt(&self) -> bool {
        !self.tickets.iter().any(Ticket::counted)
    }

    /// The ticket of policy `policy`, if one of its layers saw the request.
    pub(crate) fn ticket(&self, policy: u64) -> Option<&Ticket> {
        self.tickets.iter().find(|t| t.policy == policy)
    }

    /// Whether a line on the counter at `key` of the store with identity
    /// `store` counts already: one of policy `policy`'s own, or of another
    /// policy on the same store. A policy on another store (or one without
    /// an identity) has counters of its own, whatever their keys.
    pub(crate) fn counts(&self, key: &PeriodKey, policy: u64, store: Option<usize>) -> bool {
        self.tickets.iter().any(|ticket| {
            (ticket.policy == policy || (store.is_some() && ticket.store == store))
                && ticket.counts(key)
        })
    }

    /// The instants, other than `now`, at which other policies than
    /// `policy` on the store with identity `store` counted the request:
    /// each charges at its own instant, which may be in another calendar
    /// window, where a quota the policies share was counted for it.
    pub(crate) fn instants_of_others(
        &self,
        policy: u64,
        store: Option<usize>,
        now: Timestamp,
    ) -> impl Iterator<Item = Timestamp> + '_ {
        self.tickets
            .iter()
            .filter(move |ticket| {
                store.is_some()
                    && ticket.store == store
                    && ticket.policy != policy
                    && ticket.now != now
                    && ticket.counted()
            })
            .map(|ticket| ticket.now)
    }

    /// As [`QuotaStatus::put_in`], answering the lines the layers further
    /// out charged (or owe) for the request, of every policy: those the
    /// layer of `ticket`, which charged it too, tells what it keeps (see
    /// [`GiveBack`]). Empty, without an allocation, for the outermost.
    /// `layer` is the charging layer's [`layer_id`].
    pub(crate) fn put_in_charged(
        extensions: &mut Extensions,
        ticket: Ticket,
        layer: usize,
    ) -> Vec<Arc<Lines>> {
        match extensions.get_mut::<QuotaStatus>() {
            Some(status) => {
                // Let through further in by the layer that refused an
                // earlier attempt of the request (a retry, which clones
                // the request with its status): that refusal no longer
                // speaks for the answer. A refusal by another layer (a
                // sibling call of a fan-out) still does.
                let outer = status
                    .outer_lines()
                    .inspect(|lines| lines.let_through(layer))
                    .cloned()
                    .collect();
                status.put(ticket);
                outer
            }
            None => {
                extensions.insert(QuotaStatus::of(ticket));
                Vec::new()
            }
        }
    }

    /// The lines the layers charged (or owe) for the request, of every
    /// policy.
    fn outer_lines(&self) -> impl Iterator<Item = &Arc<Lines>> {
        self.tickets
            .iter()
            .flat_map(|ticket| ticket.charges.iter().chain(&ticket.owing))
    }

    /// The layer `layer` (its [`layer_id`]) lets the request with these
    /// `extensions` through without a charge of its own (nothing left to
    /// charge, a skip rule, a failed charge let through uncounted): as
    /// when it charges it (see [`QuotaStatus::put_in_charged`]), a refusal
    /// it marked before (an earlier attempt of a retry) no longer speaks
    /// for the answer.
    pub(crate) fn let_through_in(extensions: &Extensions, layer: usize) {
        if let Some(status) = extensions.get::<QuotaStatus>() {
            for lines in status.outer_lines() {
                lines.let_through(layer);
            }
        }
    }

    /// A layer refuses the request with these `extensions`: the lines the
    /// layers further out charged (or owe) for it, of every policy, are
    /// marked, and their layers give them back when the answer they see is
    /// an error, whatever became of the refusal's response on its way out
    /// (a middleware between that builds a response of its own).
    /// `layer` is the refusing layer's [`layer_id`].
    pub(crate) fn refuse_in(extensions: &Extensions, layer: usize) {
        if let Some(status) = extensions.get::<QuotaStatus>() {
            for ticket in &status.tickets {
                for lines in ticket.charges.iter().chain(&ticket.owing) {
                    lines.refuse(layer);
                }
            }
        }
    }

    /// Puts an empty status in `extensions` when there is none: a request
    /// a layer passes without a ticket of its policy (a layer of shadow
    /// quotas that could not charge it) still finds one in the handler,
    /// and the policy's layers further in decide as they would alone.
    pub(crate) fn ensure_in(extensions: &mut Extensions) {
        if extensions.get::<QuotaStatus>().is_none() {
            extensions.insert(QuotaStatus::default());
        }
    }

    /// Records `ticket` in the status in `extensions`, made if there is
    /// none yet.
    pub(crate) fn put_in(extensions: &mut Extensions, ticket: Ticket) {
        match extensions.get_mut::<QuotaStatus>() {
            Some(status) => status.put(ticket),
            None => {
                extensions.insert(QuotaStatus::of(ticket));
            }
        }
    }

    /// The status of a request one policy's layers saw, as `ticket` says.
    fn of(ticket: Ticket) -> Self {
        QuotaStatus {
            tickets: smallvec::smallvec![ticket],
        }
    }

    /// Records `ticket`, replacing what its policy knew before.
    pub(crate) fn put(&mut self, ticket: Ticket) {
        match self.tickets.iter_mut().find(|t| t.policy == ticket.policy) {
            Some(known) => *known = ticket,
            None => self.tickets.push(ticket),
        }
    }
}

/// The entry of `line`, charged on `quota`, as the request leaves it.
fn entry((quota, line): (&Quota, &Line)) -> QuotaUsage {
    QuotaUsage::new(quota.clone(), line.key.clone(), line.standing())
}

impl fmt::Debug for QuotaStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuotaStatus")
            .field("entries", &self.entries())
            .finish()
    }
}

/// What one policy knows of a request its layers saw: who is charged, on
/// which plan and in which zone, and the lines its layers charged so far.
/// (`Default`: an empty ticket, what a charge leaves in place of the one it
/// gave away.)
#[derive(Clone, Debug, Default)]
pub(crate) struct Ticket {
    /// The policy's identity.
    pub(crate) policy: u64,
    /// Its store's ([`Store::identity`](crate::Store::identity)).
    pub(crate) store: Option<usize>,
    /// The request's instant: every layer of the policy charges it at the
    /// same one, so a request near a boundary counts in one period.
    pub(crate) now: Timestamp,
    /// `None` when the policy lets the request through uncounted (a skip
    /// rule, no usable subject under `SubjectPolicy::Allow`, a store failure
    /// under fail-open when the policy keeps no ledger): its inner layers
    /// pass it too.
    pub(crate) caller: Option<Caller>,
    /// What the policy's layers charged, one entry per layer, outer layers
    /// first (seldom more than two).
    pub(crate) charges: Charges,
    /// The keys the policy's layers owe for the request: a charge failed
    /// under fail-open, and the ledger counts it once the store answers.
    /// Not empty: the layers further in owe their quotas too, without
    /// asking the store.
    pub(crate) owed: Vec<PeriodKey>,
    /// The lines of the policy's layers that owe their charges for the
    /// request (their store failed, fail open), one entry per layer: what
    /// the layers further in keep is told to them too (see [`GiveBack`]).
    pub(crate) owing: Vec<Arc<Lines>>,
}

/// The lines a policy's layers charged for a request, one entry per layer.
pub(crate) type Charges = SmallVec<[Arc<Lines>; 2]>;

impl Ticket {
    /// Every line charged, outer layers first.
    pub(crate) fn lines(&self) -> impl Iterator<Item = &Line> {
        self.charges.iter().flat_map(|charge| charge.iter())
    }

    /// Whether a line of this ticket counts on `key`, charged or owed.
    pub(crate) fn counts(&self, key: &PeriodKey) -> bool {
        self.lines().any(|line| line.key == *key) || self.owed.contains(key)
    }

    /// Whether the policy's layers charged or owe anything for the request.
    pub(crate) fn counted(&self) -> bool {
        self.lines().next().is_some() || self.owes()
    }

    /// Whether the policy's layers owe their charges for the request
    /// rather than ask the store.
    pub(crate) fn owes(&self) -> bool {
        !self.owed.is_empty()
    }
}

/// Who a request is charged to, as the first layer of a policy found.
#[derive(Clone, Debug)]
pub(crate) struct Caller {
    pub(crate) subject: Subject,
    pub(crate) plan: Option<Box<str>>,
    /// The caller's own time zone, when the policy reads one.
    pub(crate) zone: Option<TimeZone>,
    /// A hash of the subject every instance computes alike: it spreads the
    /// resets told to subjects.
    pub(crate) spread: u64,
}

/// The quotas of a layer, for the lines it charged: what a request keeps
/// of the layer that charged it.
pub(crate) trait LayerQuotas: Send + Sync + 'static {
    /// The layer's quotas.
    fn quotas(&self) -> &[Quota];
    /// The `RateLimit-Policy` values the layer sent for them.
    fn fields(&self) -> &PolicyCache;
    /// The layer's quotas as callers in one zone count them, kept in the
    /// layer's slot `slot` (see [`QuotaSet::Zoned`]).
    fn zoned(&self, slot: usize) -> &OtherQuotas;
}

/// Which quotas the lines of a charge count, one per line.
#[derive(Clone, Debug, Default)]
pub(crate) enum QuotaSet {
    /// The layer's own, as it has them.
    #[default]
    Own,
    /// The layer's quotas in a caller's zone, kept by the layer: a slot of
    /// its, so that a request reaches them without a reference count of
    /// their own, which every core would write.
    Zoned(usize),
    /// Made for the request: some of the layer's quotas (a layer further
    /// out charged the others), or those of a zone the layer keeps no more.
    Other(Arc<OtherQuotas>),
}

impl QuotaSet {
    /// The quotas, of `layer` when they are its own or kept in its slot.
    pub(crate) fn quotas<'a, L: LayerQuotas + ?Sized>(&'a self, layer: &'a L) -> &'a [Quota] {
        match self {
            Self::Own => layer.quotas(),
            Self::Zoned(slot) => &layer.zoned(*slot).quotas,
            Self::Other(other) => &other.quotas,
        }
    }

    /// The `RateLimit-Policy` values sent for the quotas, when kept.
    pub(crate) fn fields<'a, L: LayerQuotas + ?Sized>(
        &'a self,
        layer: &'a L,
    ) -> Option<&'a PolicyCache> {
        match self {
            Self::Own => Some(layer.fields()),
            Self::Zoned(slot) => layer.zoned(*slot).fields.as_ref(),
            Self::Other(other) => other.fields.as_ref(),
        }
    }
}

/// Quotas a charge counts that are not its layer's own, all of them, as it
/// has them: the layer's quotas as a caller in another zone counts them
/// (kept by the layer, zone by zone, with the `RateLimit-Policy` values
/// sent for them), or those of its quotas that a layer further out did not
/// charge already (made for the request).
#[derive(Debug)]
pub(crate) struct OtherQuotas {
    pub(crate) quotas: Box<[Quota]>,
    /// The `RateLimit-Policy` values sent for `quotas`, when kept.
    pub(crate) fields: Option<PolicyCache>,
}

impl OtherQuotas {
    /// `quotas`, with a cache of the values sent for them.
    pub(crate) fn cached(quotas: Box<[Quota]>) -> Self {
        Self {
            fields: Some(PolicyCache::for_quotas(&quotas)),
            quotas,
        }
    }

    /// `quotas` for one request: each value is made when sent.
    pub(crate) fn uncached(quotas: Box<[Quota]>) -> Self {
        Self {
            quotas,
            fields: None,
        }
    }
}

/// The lines one layer charged for a request: the `i`-th line counts the
/// `i`-th of their quotas.
pub(crate) struct Lines {
    /// The layer, for its quotas. One reference to the allocation that the
    /// layer's services and the request's response future hold too: a
    /// request then adds to one reference count that every core shares,
    /// where a clone of each quota would add to one per quota, each a write
    /// that the next request on another core waits for.
    layer: Arc<dyn LayerQuotas>,
    /// The quotas of the lines.
    quotas: QuotaSet,
    lines: SmallVec<[Line; 1]>,
    /// What the layers further in kept charged for the same request, told
    /// when they answered: given back if this layer is dropped before its
    /// response goes out (the request was not served after all).
    inside: Mutex<Vec<Arc<dyn GiveBack>>>,
    /// Where `inside` stands: nothing told yet (most requests pass one
    /// layer), told, or closed (given back, or the response went out), after
    /// which what is told late (a layer further in that a spawned task
    /// polled on) follows at once.
    state: AtomicU8,
    /// Whether a layer further in refused the request and has not let it
    /// through since: whether `refused_by` names one (read without its
    /// lock, on every nested admission).
    refused_inside: AtomicBool,
    /// The [`layer_id`]s of the layers further in that refused the request
    /// (see [`QuotaStatus::refuse_in`]) and have not let it through since:
    /// each clears its own mark only, so one layer's admission (a sibling
    /// call's) leaves another's refusal marked.
    refused_by: Mutex<SmallVec<[usize; 1]>>,
}

/// A quota layer's identity while it lives, as refusal marks tell it (see
/// [`Lines::let_through`]): the address of what its services share, never
/// 0.
pub(crate) fn layer_id<T: ?Sized>(layer: &Arc<T>) -> usize {
    Arc::as_ptr(layer).cast::<()>().addr()
}

/// The states of [`Lines::state`].
const OPEN: u8 = 0;
const TOLD: u8 = 1;
const GIVEN_BACK: u8 = 2;
const WENT_OUT: u8 = 3;

/// What a layer kept charged for a request it answered, told to the layers
/// further out that charged the request too (of any policy): the response
/// may still not go out (one of them, or a middleware between, dropped
/// before it answers: a timeout around the layers, a client gone), and the
/// request then spends nothing. Told on the request's side, so a
/// middleware that builds a new response loses nothing.
pub(crate) trait GiveBack: Send + Sync {
    /// Gives back what is still charged of it; once, however often it is
    /// called (a layer is told by every layer further out).
    fn give_back(&self);

    /// The response went out from the outermost layer that charged the
    /// request: the request was served, and what it kept stays.
    fn went_out(&self) {}
}

impl Lines {
    /// `lines`, counting `quotas` of `layer`.
    #[inline]
    pub(crate) fn new(
        layer: Arc<dyn LayerQuotas>,
        quotas: QuotaSet,
        lines: SmallVec<[Line; 1]>,
    ) -> Self {
        Self {
            layer,
            quotas,
            lines,
            inside: Mutex::default(),
            state: AtomicU8::new(OPEN),
            refused_inside: AtomicBool::new(false),
            refused_by: Mutex::default(),
        }
    }

    /// A layer further in refused the request these lines were charged
    /// for: it was not served.
    pub(crate) fn refuse(&self, layer: usize) {
        let mut by = self.refused_by.lock().unwrap_or_else(|e| e.into_inner());
        if !by.contains(&layer) {
            by.push(layer);
        }
        self.refused_inside.store(true, Ordering::Release);
    }

    /// `layer`, further in, let the request these lines were charged for
    /// through (charged, or owing): a refusal it marked before (an earlier
    /// attempt of a retry) is not what answers it. One another layer
    /// marked (a sibling call's) still is.
    #[inline]
    pub(crate) fn let_through(&self, layer: usize) {
        if !self.refused_inside.load(Ordering::Relaxed) {
            return;
        }
        let mut by = self.refused_by.lock().unwrap_or_else(|e| e.into_inner());
        by.retain(|refused| *refused != layer);
        self.refused_inside.store(!by.is_empty(), Ordering::Release);
    }

    /// Whether a layer further in refused the request.
    pub(crate) fn is_refused_inside(&self) -> bool {
        self.refused_inside.load(Ordering::Acquire)
    }

    /// Tells these lines' layer what a layer further in kept: kept until
    /// the layer's response goes out or it is dropped; told after either,
    /// it follows at once (served, or given back).
    pub(crate) fn tell(&self, kept: Arc<dyn GiveBack>) {
        let mut inside = self.inside.lock().unwrap_or_else(|e| e.into_inner());
        match self
            .state
            .compare_exchange(OPEN, TOLD, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) | Err(TOLD) => inside.push(kept),
            Err(GIVEN_BACK) => {
                drop(inside);
                kept.give_back();
            }
            Err(_) => {
                drop(inside);
                kept.went_out();
            }
        }
    }

    /// The response of these lines' layer, the outermost that charged the
    /// request, went out: what the layers further in kept was served.
    #[inline]
    pub(crate) fn went_out(&self) {
        if self.state.swap(WENT_OUT, Ordering::AcqRel) == TOLD {
            let inside =
                std::mem::take(&mut *self.inside.lock().unwrap_or_else(|e| e.into_inner()));
            for kept in inside {
                kept.went_out();
            }
        }
    }

    /// Gives back what the layers further in kept, and what they tell
    /// later: these lines' layer is dropped before its response went out.
    pub(crate) fn give_back_inside(&self) {
        let inside = {
            let mut inside = self.inside.lock().unwrap_or_else(|e| e.into_inner());
            self.state.store(GIVEN_BACK, Ordering::Release);
            std::mem::take(&mut *inside)
        };
        for kept in inside {
            kept.give_back();
        }
    }

    /// The quotas the lines count, in their order.
    pub(crate) fn quotas(&self) -> &[Quota] {
        self.quotas.quotas(&*self.layer)
    }

    /// The `RateLimit-Policy` values sent for the lines' quotas, if kept.
    #[inline]
    pub(crate) fn policy_cache(&self) -> Option<&PolicyCache> {
        self.quotas.fields(&*self.layer)
    }

    /// Each line with its quota.
    pub(crate) fn with_quotas(&self) -> impl Iterator<Item = (&Quota, &Line)> + Clone {
        self.quotas().iter().zip(self.lines.iter())
    }
}

impl std::ops::Deref for Lines {
    type Target = [Line];

    fn deref(&self) -> &[Line] {
        &self.lines
    }
}

impl fmt::Debug for Lines {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.with_quotas()).finish()
    }
}

/// One counter a layer charged for a request.
#[derive(Debug)]
pub(crate) struct Line {
    pub(crate) key: PeriodKey,
    pub(crate) cost: u64,
    /// What the store answered (with a shadow quota's real limit).
    pub(crate) usage: Usage,
    /// Whether the quota is anchored at first use.
    first_use: bool,
    /// What the request holds on the line's counter, as the layer's
    /// changes after the response were decided (its cost, plus a deferred
    /// cost's add, less a deferred cost's refund), with [`GIVEN_BACK_BIT`] set
    /// by whoever gives the line back first: a line is given back at most
    /// once, however many layers see the request fail, and whatever the
    /// layer changed of it before.
    held: AtomicU64,
    /// What of `held` the layer's adds have not put on the counter: a
    /// deferred cost's add on its way (sent again, say, after the store
    /// was away) or one the store failed (or found no counter for), which
    /// a give-back of the request must not take from the counter.
    adds: Mutex<Adds>,
}

/// The adds of a deferred cost on a line, as far as the store answered.
#[derive(Debug, Default)]
struct Adds {
    /// Decided (counted in `held`), not answered yet.
    pending: u64,
    /// Answered without landing.
    unlanded: u64,
    /// Of `pending`, what the handler's give-back left out when it claimed
    /// the line (see [`Line::claim_request`]): given back once it lands.
    excluded: u64,
    /// What was given back so, since that claim.
    followed: u64,
}

/// The bit of [`Line::held`] set once the line is given back.
const GIVEN_BACK_BIT: u64 = 1 << 63;

impl Line {
    /// A line of `quota`.
    pub(crate) fn new(quota: &Quota, key: PeriodKey, cost: u64, usage: Usage) -> Self {
        Self {
            first_use: quota.anchor() == Anchor::FirstUse,
            key,
            cost,
            usage,
            held: AtomicU64::new(cost.min(!GIVEN_BACK_BIT)),
            adds: Mutex::default(),
        }
    }

    fn adds(&self) -> std::sync::MutexGuard<'_, Adds> {
        self.adds.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records an add of `amount` (a deferred cost) in what the request
    /// holds, on its way to the store, unless the line was given back
    /// (`false`: then it is not sent).
    pub(crate) fn decide_add(&self, amount: u64) -> bool {
        let mut adds = self.adds();
        let decided = self.change_held(|held| held.saturating_add(amount));
        if decided {
            adds.pending = adds.pending.saturating_add(amount);
        }
        decided
    }

    /// The store answered an add of `amount` decided by
    /// [`decide_add`](Self::decide_add): it `landed` on the counter, or
    /// not. Answers what of it goes back now: what the handler's give-back
    /// left out, as it had not landed when the line was claimed.
    pub(crate) fn add_answered(&self, amount: u64, landed: bool) -> u64 {
        let mut adds = self.adds();
        adds.pending = adds.pending.saturating_sub(amount);
        let excluded = adds.excluded.min(amount);
        adds.excluded -= excluded;
        if !landed {
            adds.unlanded = adds.unlanded.saturating_add(amount);
            return 0;
        }
        adds.followed = adds.followed.saturating_add(excluded);
        excluded
    }

    /// Claims the line's give-back for the handler
    /// ([`QuotaHandle::refund_request`](crate::QuotaHandle::refund_request)):
    /// what the request holds, and what of it to take from the counter
    /// now (less the adds that have not landed: one that lands later goes
    /// back then, see [`add_answered`](Self::add_answered)).
    pub(crate) fn claim_request(&self) -> Option<(u64, u64)> {
        let mut adds = self.adds();
        let held = self.claim_give_back()?;
        let amount = held
            .saturating_sub(adds.unlanded)
            .saturating_sub(adds.pending);
        adds.excluded = adds.pending;
        adds.followed = 0;
        Some((held, amount))
    }

    /// Releases a claim of [`claim_request`](Self::claim_request) whose
    /// give-back never reached the store: what went back of the adds
    /// since is held no more.
    pub(crate) fn unclaim_request(&self, held: u64) {
        let mut adds = self.adds();
        adds.excluded = 0;
        let followed = std::mem::take(&mut adds.followed);
        self.unclaim_give_back(held.saturating_sub(followed));
    }

    /// The counter a give-back of this line, charged at `charged_at`,
    /// goes to (see [`Usage::charged_counter`]).
    pub(crate) fn charged_counter(&self, charged_at: Timestamp) -> crate::store::Made {
        self.usage.charged_counter(charged_at)
    }

    /// Where the line's counter stands as far as the request knows: as
    /// charged, less the line's cost once it was given back (by the
    /// handler, say: [`QuotaHandle::refund_request`](crate::QuotaHandle::refund_request)).
    pub(crate) fn standing(&self) -> Usage {
        let mut usage = self.usage;
        if self.is_given_back() {
            usage.used = usage.used.saturating_sub(self.cost);
        }
        usage
    }

    /// Claims the line's give-back: for the first caller only, what the
    /// request holds on the counter, to give back.
    pub(crate) fn claim_give_back(&self) -> Option<u64> {
        let held = self.held.swap(GIVEN_BACK_BIT, Ordering::AcqRel);
        (held & GIVEN_BACK_BIT == 0).then_some(held)
    }

    /// Releases a claim of `held` whose give-back failed before it reached
    /// the store: a later give-back may claim the line.
    pub(crate) fn unclaim_give_back(&self, held: u64) {
        self.held.store(held & !GIVEN_BACK_BIT, Ordering::Release);
    }

    /// Records a change of what the request holds (a deferred cost's add
    /// or refund) before it is sent, unless the line was given back: then
    /// the change is left out (`false`). What it holds stops at the most
    /// the bits below [`GIVEN_BACK_BIT`] carry.
    pub(crate) fn change_held(&self, change: impl Fn(u64) -> u64) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                (held & GIVEN_BACK_BIT == 0).then(|| change(held).min(!GIVEN_BACK_BIT))
            })
            .is_ok()
    }

    /// What the request holds on the counter, as far as the changes decided
    /// go (0 once given back).
    pub(crate) fn held(&self) -> u64 {
        let held = self.held.load(Ordering::Acquire);
        if held & GIVEN_BACK_BIT == 0 {
            held
        } else {
            0
        }
    }

    /// Whether the line was given back.
    pub(crate) fn is_given_back(&self) -> bool {
        self.held.load(Ordering::Acquire) & GIVEN_BACK_BIT != 0
    }

    /// Whether the counter at the line's key is still the one charged, at
    /// `now`: a first-use counter whose period ended is not, even if a new
    /// one has the same key.
    pub(crate) fn is_live(&self, now: Timestamp) -> bool {
        !self.first_use || self.usage.resets_at > now
    }
}

#[cfg(feature = "axum")]
mod axum_impl {
    use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum_core::response::{IntoResponse, Response};
    use http::request::Parts;
    use http::StatusCode;

    use super::QuotaStatus;

    /// The [`QuotaStatus`] extractor's rejection: the handler is not behind a
    /// quota layer. Answers 500, as a problem document: the app is wired
    /// wrong, not the request.
    #[derive(Debug)]
    #[non_exhaustive]
    pub struct MissingQuotaStatus;

    impl std::fmt::Display for MissingQuotaStatus {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("QuotaStatus is only available behind a quota layer")
        }
    }

    impl std::error::Error for MissingQuotaStatus {}

    impl IntoResponse for MissingQuotaStatus {
        fn into_response(self) -> Response {
            let problem =
                crate::response::problem(StatusCode::INTERNAL_SERVER_ERROR, &self.to_string());
            problem.map(axum_core::body::Body::from)
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for QuotaStatus {
        type Rejection = MissingQuotaStatus;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Self, Self::Rejection> {
            parts
                .extensions
                .get::<QuotaStatus>()
                .cloned()
                .ok_or(MissingQuotaStatus)
        }
    }

    /// `Option<QuotaStatus>`: `None` for a handler no quota layer is in
    /// front of, for one handler served both behind a quota layer and
    /// without one.
    impl<S: Send + Sync> OptionalFromRequestParts<S> for QuotaStatus {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _state: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<QuotaStatus>().cloned())
        }
    }
}

#[cfg(feature = "axum")]
pub use axum_impl::MissingQuotaStatus;
