//! The rules of the request path, as plain functions a test calls without a
//! runtime: what a layer charges, what the store's answer means, and what a
//! response changes. The future only moves between their results.

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{Response, StatusCode};
use jiff::Timestamp;
use smallvec::SmallVec;

use super::layer::{Bound, Cost, Scope};
use crate::policy::{OnStoreError, Policy, Settings, SubjectPolicy};
use crate::quota::Quota;
use crate::response::{self, RateLimitFields, Refusal};
use crate::status::{Caller, Line, OtherQuotas, QuotaSet, QuotaStatus, Ticket};
use crate::store::{ChargeOutcome, ChargeRequest, StoreError, Usage};
use crate::subject::{Subject, SubjectError, SubjectExtractor};
use crate::throttle::Throttle;

/// Store failures logged per second at most: during an outage every request
/// fails, and the log should say so, not drown.
static STORE_ERRORS: Throttle = Throttle::new(5);

/// Shadow refusals logged per second at most.
static SHADOW_REFUSALS: Throttle = Throttle::new(5);

/// What a layer does with a request before the store is asked.
pub(crate) enum Step {
    /// Nothing of this layer's to charge (let through uncounted further
    /// out, or charged there already): pass the request on.
    Pass,
    /// The policy lets the request through uncounted: record that, so its
    /// inner layers pass it too, and pass it on.
    PassUncounted(Ticket),
    /// Refused before any charge (no usable subject, an unknown plan, a cost
    /// or zone that cannot be worked out).
    Reject(Response<Bytes>),
    /// Charge these lines.
    Charge(Charge),
    /// Owe these lines, without asking the store: a layer further out of
    /// the policy failed open on the request.
    Owe(Charge),
}

/// One layer's charge for one request.
#[derive(Debug)]
pub(crate) struct Charge {
    /// The policy's ticket as the layer found it (or made it, for the
    /// outermost layer): the caller and the lines charged further out.
    pub(crate) ticket: Ticket,
    /// Which quotas the lines of `request` count, one per line, in the
    /// caller's zone (see [`Charge::quotas`]).
    pub(crate) quotas: QuotaSet,
    /// What the store is asked (a shadow quota's line has no limit): each
    /// line's key, and its lifetime, which a request that passes on a
    /// failed charge owes to.
    pub(crate) request: ChargeRequest,
    /// The decision's span (disabled unless the crate's debug logs are on):
    /// subject kind and hash, allowances, anchors, outcome.
    pub(crate) span: tracing::Span,
}

/// An empty charge: what a step that passes a charge on by reference
/// leaves in its place when it gives the charge away (see
/// `future::send`), so that the common path moves no charge at all.
impl Default for Charge {
    fn default() -> Self {
        Self {
            ticket: Ticket::default(),
            quotas: QuotaSet::Own,
            request: ChargeRequest {
                charged_at: None,
                now: Timestamp::UNIX_EPOCH,
                lines: SmallVec::new(),
            },
            span: tracing::Span::none(),
        }
    }
}

impl Charge {
    /// What the request costs, on each line alike (a charge has one line
    /// at least).
    pub(crate) fn cost(&self) -> u64 {
        self.request.lines.first().map_or(0, |line| line.cost)
    }

    pub(crate) fn caller(&self) -> &Caller {
        self.ticket.caller.as_ref().expect("a charge has a caller")
    }

    /// One quota per line, in the caller's zone: those of the charge, or
    /// the layer's (of `scope`).
    pub(crate) fn quotas<'a>(&'a self, scope: &'a Scope) -> &'a [Quota] {
        self.quotas.quotas(scope)
    }

    /// The same charge without the lines at `left_out` (by index), made by
    /// a layer of `scope`; `None` when no line is left.
    pub(crate) fn without(self, left_out: &[usize], scope: &Scope) -> Option<Self> {
        let kept = |i: &usize| !left_out.contains(i);
        let all = self.quotas(scope);
        if !(0..all.len()).any(|i| kept(&i)) {
            return None;
        }
        let quotas = (0..all.len())
            .filter(kept)
            .map(|i| all[i].clone())
            .collect();
        let quotas = QuotaSet::Other(Arc::new(OtherQuotas::uncached(quotas)));
        let Charge {
            ticket,
            request,
            span,
            ..
        } = self;
        let lines = request
            .lines
            .into_iter()
            .enumerate()
            .filter(|(i, _)| kept(i))
            .map(|(_, line)| line)
            .collect();
        Some(Charge {
            ticket,
            quotas,
            request: ChargeRequest {
                charged_at: request.charged_at,
                now: request.now,
                lines,
            },
            span,
        })
    }
}

/// What the layer of `bound` does with the request with head `parts`.
pub(crate) fn plan<E: SubjectExtractor, St: crate::store::Store>(
    bound: &Bound<E, St>,
    parts: &Parts,
) -> Step {
    let policy = &*bound.policy;
    let settings = &policy.settings;
    let known = parts
        .extensions
        .get::<QuotaStatus>()
        .and_then(|status| status.ticket(policy.id));
    // A ticket found was made by a layer further out, at its instant:
    // this layer may charge later (see `ChargeRequest::charged_at`).
    let further_in = known.is_some();
    let ticket = match known {
        // Let through uncounted further out (counted there as skipped, or
        // as a store error under fail open without a ledger).
        Some(ticket) if ticket.caller.is_none() => return Step::Pass,
        Some(ticket) => ticket.clone(),
        None => {
            // A ledger left owing without a task (its runtime shut down)
            // settles again from a request on a runtime.
            policy.ledger.wake(&policy.store, settings.ledger());
            let now = settings.clock.now();
            if settings.skips(parts) {
                skipped(&bound.scope.quotas);
                tracing::trace!("request passes uncounted: a skip rule");
                return Step::PassUncounted(uncounted(policy.id, now));
            }
            // Asked only of a request that cannot be charged: a look at
            // every quota of the layer, kept off the path of the others.
            let only_shadow = || bound.scope.only_shadow();
            match identify(policy, parts, only_shadow) {
                // A layer of shadow quotas never refuses: the policy's other
                // layers, if any, decide as they would alone. Not counted in
                // the metrics, as a request refused before any charge is
                // not; nor logged as refused, as it is not.
                Err(response) if only_shadow() => {
                    tracing::trace!(
                        would_be = %response.status(),
                        "request passes a layer of shadow quotas uncounted: it cannot be charged"
                    );
                    return Step::Pass;
                }
                Ok(Some(caller)) => Ticket {
                    policy: policy.id,
                    store: policy.store.identity(),
                    now,
                    caller: Some(caller),
                    charges: Default::default(),
                    owed: Vec::new(),
                    owing: Vec::new(),
                },
                Ok(None) => {
                    skipped(&bound.scope.quotas);
                    return Step::PassUncounted(uncounted(policy.id, now));
                }
                Err(response) => return Step::Reject(response),
            }
        }
    };
    lines(
        &bound.scope,
        settings,
        policy.store.max_count(),
        ticket,
        parts,
        further_in,
    )
}

/// Counts a request a layer of `quotas` lets through uncounted.
fn skipped(quotas: &[Quota]) {
    crate::metrics::decisions(
        crate::metrics::outcome::SKIPPED,
        quotas.iter().map(Quota::allowance_shared),
    );
}

/// The ticket of a request the policy lets through uncounted.
pub(crate) fn uncounted(policy: u64, now: Timestamp) -> Ticket {
    Ticket {
        policy,
        store: None,
        now,
        caller: None,
        charges: Default::default(),
        owed: Vec::new(),
        owing: Vec::new(),
    }
}

/// Who the request is charged to: its subject, plan and zone, or the answer
/// when it cannot be charged; `None` when the policy lets it through.
/// `passes`: whether the request passes whatever this answers (a layer of
/// shadow quotas), so that a refusal is not logged as one.
// The error is the answer itself, made once for a refused request.
#[allow(clippy::result_large_err)]
fn identify<E: SubjectExtractor, St>(
    policy: &Policy<E, St>,
    parts: &Parts,
    passes: impl Fn() -> bool,
) -> Result<Option<Caller>, Response<Bytes>> {
    let settings = &policy.settings;
    let subject = match subject(&policy.extractor, parts, settings.max_subject_len) {
        Ok(subject) => subject,
        Err(error) => {
            let (choice, default) = match &error {
                SubjectError::Missing => (settings.on_missing, StatusCode::UNAUTHORIZED),
                SubjectError::Malformed(_) => (settings.on_malformed, StatusCode::BAD_REQUEST),
                SubjectError::Unavailable(_) => {
                    response::unidentifiable(&error, passes());
                    let status = StatusCode::INTERNAL_SERVER_ERROR;
                    return Err(response::early(status, response::UNIDENTIFIABLE, parts));
                }
            };
            return match choice {
                SubjectPolicy::Allow => {
                    tracing::trace!(%error, "request without a usable subject passes uncounted");
                    Ok(None)
                }
                SubjectPolicy::Reject(status) => {
                    let status = if status.is_client_error() || status.is_server_error() {
                        status
                    } else {
                        default
                    };
                    if !passes() {
                        tracing::debug!(%error, %status, "request refused: no usable subject");
                    }
                    let answer = response::early(status, &error.to_string(), parts);
                    Err(response::challenged(answer, || policy.challenge()))
                }
            };
        }
    };
    let plan = match policy.plan_as_charged(settings.plan.as_ref().and_then(|plan| plan(parts))) {
        Ok(plan) => plan.map(String::into_boxed_str),
        Err(plan) => {
            if !passes() {
                tracing::debug!("request refused: unknown plan");
            }
            let detail = format!("The plan {:?} has no quota here.", response::echo(&plan));
            return Err(response::early(StatusCode::FORBIDDEN, &detail, parts));
        }
    };
    let zone = match settings.caller_zone(parts) {
        Ok(zone) => zone,
        Err(error) => {
            if !passes() {
                tracing::debug!(%error, "request refused: invalid time zone");
            }
            return Err(response::early(
                StatusCode::BAD_REQUEST,
                error.reason(),
                parts,
            ));
        }
    };
    let spread = if policy.spreads() {
        spread_hash(&subject)
    } else {
        0
    };
    Ok(Some(Caller {
        subject,
        plan,
        zone,
        spread,
    }))
}

/// The subject the request names, if usable.
fn subject<E: SubjectExtractor>(
    extractor: &E,
    parts: &Parts,
    max_len: usize,
) -> Result<Subject, SubjectError> {
    extractor.extract(parts)?.checked(max_len)
}

/// A hash of `subject` that every instance, platform and release computes
/// alike: it spreads the resets told to subjects. FNV-1a of the kind, a
/// zero byte and the id.
fn spread_hash(subject: &Subject) -> u64 {
    let kind = crate::quota::fnv1a_64_from(
        crate::quota::fnv1a_64(subject.kind().as_str().as_bytes()),
        &[0],
    );
    crate::quota::fnv1a_64_from(kind, subject.id())
}

/// The lines of `scope`'s quotas that `ticket` does not count yet, on a
/// store that decides on costs up to `max_count` exactly; `further_in`:
/// the ticket was made by a layer further out, at its own instant.
fn lines(
    scope: &Scope,
    settings: &Settings,
    max_count: u64,
    ticket: Ticket,
    parts: &Parts,
    further_in: bool,
) -> Step {
    let status = parts.extensions.get::<QuotaStatus>();
    let caller = ticket
        .caller
        .as_ref()
        .expect("a charged ticket has a caller");
    let zoned = scope.quotas_in(caller.zone.as_ref());
    let all = zoned.quotas(scope);
    let mut lines = SmallVec::<[_; 2]>::new();
    // Quotas a layer further out charged already (the same quota in two
    // layers, or a sub-request): rare, so no allocation until one is met.
    let mut counted = Vec::new();
    for (i, quota) in all.iter().enumerate() {
        let limit = quota.limit_for(caller.plan.as_deref());
        let mut line =
            quota.line_with_limit(&settings.namespace, &caller.subject, ticket.now, 0, limit);
        // A shadow quota is counted, never refusing: its limit is reported,
        // not enforced. Its line has no limit but the most the store counts,
        // where its counter stops (see `saturated`).
        if quota.is_shadow() {
            line.limit = max_count;
            line.shadow_limit = Some(limit);
        }
        // A counter charged for this request by a layer further out, of this
        // policy or another on the same store, counts once: another policy
        // charged at its own instant, whose window (a calendar quota's) may
        // not be this one's, as when a middleware between took the request
        // past midnight.
        let charged_already = status.is_some_and(|s| {
            s.counts(&line.key, ticket.policy, ticket.store)
                || s.instants_of_others(ticket.policy, ticket.store, ticket.now)
                    .filter(|at| !line.lifetime.covers(*at))
                    .any(|at| {
                        let key = quota
                            .line_not_kept(&settings.namespace, &caller.subject, at, limit)
                            .key;
                        s.counts(&key, ticket.policy, ticket.store)
                    })
        });
        if charged_already {
            counted.push(i);
        } else {
            lines.push(line);
        }
    }
    if lines.is_empty() {
        return Step::Pass;
    }
    let quotas = if counted.is_empty() {
        zoned
    } else {
        QuotaSet::Other(Arc::new(OtherQuotas::uncached(
            all.iter()
                .enumerate()
                .filter(|(i, _)| !counted.contains(i))
                .map(|(_, quota)| quota.clone())
                .collect(),
        )))
    };
    let charged = quotas.quotas(scope);
    // Shadow quotas never refuse (see `plan`): nor does a layer whose
    // quotas left to charge are shadow quotas only (the others counted
    // further out).
    let only_shadow = charged.iter().all(Quota::is_shadow);
    let cost = match scope.cost.upfront(parts) {
        Ok(cost) if cost > max_count && only_shadow => return Step::Pass,
        Err(_) if only_shadow => return Step::Pass,
        Ok(cost) if cost > max_count => {
            let detail = format!(
                "This request costs {cost}, more than the quota store counts exactly ({max_count})."
            );
            return Step::Reject(response::early(StatusCode::BAD_REQUEST, &detail, parts));
        }
        Ok(cost) => cost,
        Err(error) => {
            tracing::debug!(%error, "request refused: invalid cost");
            return Step::Reject(response::early(
                StatusCode::BAD_REQUEST,
                error.reason(),
                parts,
            ));
        }
    };
    for line in &mut lines {
        line.cost = cost;
    }
    let span = if tracing::enabled!(tracing::Level::DEBUG) {
        tracing::debug_span!(
            "quota",
            subject.kind = %caller.subject.kind(),
            subject.hash = %caller.subject.log_hash(),
            allowance = %Allowances(charged),
            anchor = %Anchors(charged),
            outcome = tracing::field::Empty,
        )
    } else {
        tracing::Span::none()
    };
    // Under fail open, a layer further out that failed on the store decides
    // for the policy: this one owes as it does. Under fail closed only a
    // layer of shadow quotas owes (it never refuses): this one asks the
    // store, and refuses if it fails.
    let owes = ticket.owes() && settings.on_store_error == OnStoreError::FailOpen;
    let charge = Charge {
        span,
        request: ChargeRequest {
            // Never before the instant the request is counted at.
            charged_at: further_in.then(|| settings.clock.now().max(ticket.now)),
            now: ticket.now,
            lines,
        },
        ticket,
        quotas,
    };
    if owes {
        // The store failed for a layer further out: this one owes its
        // charge as that one does, without a call that would fail too.
        let outcome = crate::metrics::outcome::STORE_ERROR;
        crate::metrics::decisions(
            outcome,
            charge.quotas(scope).iter().map(Quota::allowance_shared),
        );
        decided(&charge.span, outcome);
        return Step::Owe(charge);
    }
    Step::Charge(charge)
}

/// The allowances of `quotas`, comma-separated, for logs.
struct Allowances<'a>(&'a [Quota]);

impl std::fmt::Display for Allowances<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, quota) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(quota.allowance_tag())?;
        }
        Ok(())
    }
}

/// The anchors of `quotas`, comma-separated, for logs.
struct Anchors<'a>(&'a [Quota]);

impl std::fmt::Display for Anchors<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, quota) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(quota.anchor().as_str())?;
        }
        Ok(())
    }
}

/// What the layer does once the store has answered.
#[derive(Debug)]
pub(crate) enum Decision {
    /// Every quota had room and was charged: the lines charged, one per
    /// quota of the charge.
    Admit(SmallVec<[Line; 1]>),
    /// Some quota had no room; nothing was charged. Where each line stands.
    Refuse(SmallVec<[Usage; 2]>),
    /// Nothing was charged, and only shadow quotas had no room: their
    /// counters hold the most the store counts, and take no more. The
    /// charge goes again without these lines (see [`Charge::without`]):
    /// a shadow quota never refuses.
    Saturated(SmallVec<[usize; 1]>),
    /// The store failed and the policy lets the request through (fail
    /// open, or shadow quotas only): it owes its charge to the policy's
    /// ledger (uncounted, without one).
    PassUncounted,
    /// The store failed and the policy refuses: the 503's `Retry-After`.
    Unavailable(std::time::Duration),
}

/// What the store's `answer` to `charge`, made by a layer of `scope`, means
/// under `settings`.
pub(crate) fn decide(
    charge: &Charge,
    scope: &Scope,
    settings: &Settings,
    answer: &mut Result<ChargeOutcome, StoreError>,
) -> Decision {
    let quotas = charge.quotas(scope);
    if let Some(refusal) = answer.as_ref().ok().filter(|outcome| !outcome.admitted) {
        if let Some(saturated) = saturated(quotas, &charge.request.lines, &refusal.usage) {
            if let Some(suppressed) = SATURATED.admit() {
                let subject = &charge.caller().subject;
                tracing::warn!(
                    subject.kind = %subject.kind(),
                    subject.hash = %subject.log_hash(),
                    suppressed,
                    "a shadow quota's counter holds the most its store counts: it counts this subject's requests no further until it resets"
                );
            }
            // Over its limit, as enforced it would have refused.
            crate::metrics::decisions(
                crate::metrics::outcome::SHADOW_REFUSED,
                saturated.iter().map(|&i| quotas[i].allowance_shared()),
            );
            return Decision::Saturated(saturated);
        }
    }
    let outcome = match answer {
        Ok(outcome) if outcome.admitted => crate::metrics::outcome::ADMITTED,
        Ok(_) => crate::metrics::outcome::REFUSED,
        Err(_) => crate::metrics::outcome::STORE_ERROR,
    };
    match answer {
        Ok(refusal) if !refusal.admitted => {
            let refusing = refusing(quotas, &charge.request.lines, &refusal.usage);
            crate::metrics::decisions(outcome, refusing.into_iter().map(Quota::allowance_shared));
        }
        _ => crate::metrics::decisions(outcome, quotas.iter().map(Quota::allowance_shared)),
    }
    decided(&charge.span, outcome);
    match answer {
        Ok(outcome) => {
            shadow_limits(charge, quotas, &mut outcome.usage, outcome.admitted);
            if !outcome.admitted {
                return Decision::Refuse(std::mem::take(&mut outcome.usage));
            }
            let lines = quotas
                .iter()
                .zip(&charge.request.lines)
                .zip(&outcome.usage)
                .map(|((quota, line), usage)| Line::new(quota, line.key.clone(), line.cost, *usage))
                .collect();
            Decision::Admit(lines)
        }
        Err(error) => match settings.on_store_error {
            // Shadow quotas never refuse, not even for a failed store: the
            // request passes, owing their charge.
            OnStoreError::FailClosed { .. } if quotas.iter().all(Quota::is_shadow) => {
                if let Some(suppressed) = STORE_ERRORS.admit() {
                    let error = hidden(error);
                    tracing::warn!(error, suppressed, "quota store failed; request passes, as its quotas are shadow quotas, its charge owed until the store answers");
                }
                Decision::PassUncounted
            }
            OnStoreError::FailOpen => {
                if let Some(suppressed) = STORE_ERRORS.admit() {
                    let error = hidden(error);
                    tracing::warn!(error, suppressed, "quota store failed; request passes, its charge owed until the store answers (fail open)");
                }
                Decision::PassUncounted
            }
            OnStoreError::FailClosed { retry_after } => {
                if let Some(suppressed) = STORE_ERRORS.admit() {
                    let error = hidden(error);
                    tracing::error!(
                        error,
                        suppressed,
                        "quota store failed; request refused (fail closed)"
                    );
                }
                Decision::Unavailable(retry_after)
            }
        },
    }
}

/// Records a decision's `outcome` in its span, with the span's one event:
/// what a log of events prints the span by.
fn decided(span: &tracing::Span, outcome: &'static str) {
    span.record("outcome", outcome);
    tracing::debug!(parent: span, "quota decision");
}

/// Shadow quotas at the most their store counts, logged a few times per
/// second at most.
static SATURATED: Throttle = Throttle::new(1);

/// The lines of a refused charge to go again without, when the only lines
/// without room (for their cost, at what the store answered) are of shadow
/// quotas, whose lines have no limit of their own: their counters hold
/// the most the store counts. `None` when an enforced quota had no room
/// (a refusal), or none at all (a store refusing for a reason of its own).
fn saturated(
    quotas: &[Quota],
    lines: &[crate::store::ChargeLine],
    usage: &[Usage],
) -> Option<SmallVec<[usize; 1]>> {
    let mut saturated = SmallVec::new();
    for (i, ((quota, line), usage)) in quotas.iter().zip(lines).zip(usage).enumerate() {
        if crate::store::has_room(usage.used, line.cost, usage.limit) {
            continue;
        }
        if !quota.is_shadow() {
            return None;
        }
        saturated.push(i);
    }
    (!saturated.is_empty()).then_some(saturated)
}

/// The quotas a refusal is counted against: the enforced ones without room
/// for the request (a shadow quota refuses nothing, and one with room did
/// not refuse it), or every enforced one when the store's answer shows
/// none full (a store refusing for a reason of its own).
fn refusing<'a>(
    quotas: &'a [Quota],
    lines: &[crate::store::ChargeLine],
    usage: &[Usage],
) -> SmallVec<[&'a Quota; 2]> {
    let enforced = || quotas.iter().filter(|quota| !quota.is_shadow());
    let full: SmallVec<[&Quota; 2]> = quotas
        .iter()
        .zip(lines)
        .zip(usage)
        .filter(|((quota, line), usage)| {
            !quota.is_shadow() && !crate::store::has_room(usage.used, line.cost, usage.limit)
        })
        .map(|((quota, _), _)| quota)
        .collect();
    if full.is_empty() {
        enforced().collect()
    } else {
        full
    }
}

/// `error`'s text with every key in it shown as logs show keys, without
/// the subject's id: a store of the application's own may name them.
pub(crate) fn hidden(error: &StoreError) -> String {
    crate::key::scrubbed(&error.to_string())
}

/// Shadow quotas were charged without a limit: their usage gets the limit
/// the client is told, and a request `admitted` over it is logged and
/// counted (one refused by an enforced quota was not let through by the
/// shadow one).
fn shadow_limits(charge: &Charge, quotas: &[Quota], usage: &mut [Usage], admitted: bool) {
    let plan = charge.caller().plan.as_deref();
    // Counted once per allowance, however many of its quotas are over.
    let mut over = SmallVec::<[&Quota; 2]>::new();
    for (quota, usage) in quotas.iter().zip(usage) {
        if !quota.is_shadow() {
            continue;
        }
        let limit = quota.limit_for(plan);
        usage.limit = limit;
        if admitted && usage.used > limit {
            over.push(quota);
            if let Some(suppressed) = SHADOW_REFUSALS.admit() {
                let subject = &charge.caller().subject;
                tracing::info!(
                    quota = quota.name(),
                    limit,
                    used = usage.used,
                    subject.kind = %subject.kind(),
                    subject.hash = %subject.log_hash(),
                    suppressed,
                    "shadow quota exceeded: enforced, it would have refused this request"
                );
            }
        }
    }
    if !over.is_empty() {
        crate::metrics::decisions(
            crate::metrics::outcome::SHADOW_REFUSED,
            over.iter().map(|quota| quota.allowance_shared()),
        );
    }
}

/// The refusal of `charge`, made by a layer of `scope`, whose lines stand
/// at `usage`, told at `told` (the waits are counted from then: layers and
/// middleware further out may have taken a while since the charge's
/// instant).
pub(crate) fn refusal(
    charge: &Charge,
    scope: &Scope,
    usage: &[Usage],
    told: Timestamp,
    grpc: Option<http::HeaderValue>,
) -> Refusal {
    Refusal::quota_exceeded(
        charge.quotas(scope),
        usage,
        |_| charge.cost(),
        told,
        charge.caller().spread,
        grpc,
    )
}

/// The answer to a refused request: the policy's hook or the standard
/// answer, with the fields of this layer's quotas where they stand (`usage`,
/// none for a store failure) told at `told` (as the refusal), marked as a
/// refusal so that the layers further out give their charges back and put
/// their fields in front.
pub(crate) fn refused(
    settings: &Settings,
    refusal: &Refusal,
    charge: &Charge,
    scope: &Scope,
    usage: &[Usage],
    told: Timestamp,
) -> Response<Bytes> {
    let mut response = match &settings.refusal {
        Some(hook) => hook(refusal),
        None => refusal.standard(),
    };
    if refusal.status == StatusCode::TOO_MANY_REQUESTS {
        let entries = charge.quotas(scope).iter().zip(usage.iter().copied());
        let now = charge.ticket.now;
        RateLimitFields::refused(entries, now, told, charge.caller().spread, charge.cost())
            .prepend_to(response.headers_mut());
    }
    response.extensions_mut().insert(Refused);
    response
}

/// The mark of a response a quota layer refused, before or after a charge:
/// the request was not served, so the layers further out give their own
/// charges back when they see it go by.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Refused;

/// `response`, marked as a refusal.
pub(crate) fn marked(mut response: Response<Bytes>) -> Response<Bytes> {
    response.extensions_mut().insert(Refused);
    response
}

/// A change of a charged line once the response is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Adjust {
    Refund(u64),
    Add(u64),
}

/// What the response means for the lines a layer charged.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// No route served the request: every line is given back, and the
    /// response gets no fields.
    Unrouted,
    /// Served, or refused further in: these changes, then the fields.
    Served(Vec<(usize, Adjust)>),
}

/// What a response with head `response` (`None`: the inner service
/// failed) changes for `lines`, charged by a layer costing `cost` on a
/// store that counts up to `max_count` exactly.
pub(crate) fn outcome(
    lines: &[Line],
    cost: &Cost,
    settings: &Settings,
    max_count: u64,
    marked_refused: bool,
    response: Option<&http::response::Parts>,
) -> Outcome {
    let Some(response) = response else {
        let ops = if settings.refund_server_errors {
            refund_all(lines)
        } else {
            Vec::new()
        };
        return Outcome::Served(ops);
    };
    // No route served it: an unrouted answer, or a gRPC call to a method
    // the server does not have.
    if is_unrouted(&response.extensions) || response::is_grpc_unimplemented(response) {
        return Outcome::Unrouted;
    }
    // Refused further in: the refusal's response says so, or, if a
    // middleware between built an answer of its own, the request's lines
    // were marked and the answer is an error.
    let refused_inside = response.extensions.get::<Refused>().is_some()
        || (marked_refused && response::is_error_answer(response));
    if refused_inside || (settings.refund_server_errors && is_server_failure(response)) {
        return Outcome::Served(refund_all(lines));
    }
    let Some(real) = cost.real(response) else {
        return Outcome::Served(Vec::new());
    };
    let ops = lines
        .iter()
        .enumerate()
        .filter_map(|(i, line)| match real.cmp(&line.cost) {
            // What the store can hold of it (it refuses a count past
            // `max_count` whole): the counter at its most, not the request
            // nearly free.
            std::cmp::Ordering::Greater => {
                let room = max_count.saturating_sub(line.usage.used);
                Some((i, Adjust::Add((real - line.cost).min(room))))
            }
            std::cmp::Ordering::Less => Some((i, Adjust::Refund(line.cost - real))),
            std::cmp::Ordering::Equal => None,
        })
        .collect();
    Outcome::Served(ops)
}

/// Whether `response` tells of the server's failure: a 5xx status, or a
/// gRPC answer whose head says so.
fn is_server_failure(response: &http::response::Parts) -> bool {
    response.status.is_server_error() || response::is_grpc_server_failure(response)
}

pub(crate) fn refund_all(lines: &[Line]) -> Vec<(usize, Adjust)> {
    lines
        .iter()
        .enumerate()
        .filter(|(_, line)| line.cost > 0)
        .map(|(i, line)| (i, Adjust::Refund(line.cost)))
        .collect()
}

/// Whether no route served the response (see the `unrouted` handlers).
#[cfg(feature = "axum")]
fn is_unrouted(extensions: &http::Extensions) -> bool {
    extensions.get::<crate::unrouted::Unrouted>().is_some()
}

#[cfg(not(feature = "axum"))]
fn is_unrouted(_: &http::Extensions) -> bool {
    false
}

/// What goes back of `lines` when their request turns out not served after
/// `ops` (those `kept` applied) were sent: per line, what the request holds
/// (its cost less a deferred refund, which may have landed though its
/// answer is lost: counted as if it did), before what the store says it
/// added (see [`added`]). Only lines this layer gives back (claimed now, or
/// by a refund of `ops` of all the line's cost: nothing more then), and
/// only counters still the one charged at `now`.
pub(crate) fn unserved(
    lines: &[Line],
    ops: &[(usize, Adjust)],
    kept: &[bool],
    now: Timestamp,
) -> Vec<(usize, u64)> {
    lines
        .iter()
        .enumerate()
        .filter_map(|(i, line)| {
            let mine = ops
                .iter()
                .zip(kept)
                .filter(|((j, _), &kept)| *j == i && kept)
                .map(|((_, op), _)| *op);
            let mut added = 0u64;
            for op in mine {
                match op {
                    Adjust::Refund(all) if all >= line.cost => {
                        return line.is_live(now).then_some((i, 0))
                    }
                    Adjust::Refund(_) => {}
                    Adjust::Add(more) => added = added.saturating_add(more),
                }
            }
            let held = line.claim_give_back()?;
            // The adds go back as far as they landed (see `added`).
            let amount = held.saturating_sub(added);
            line.is_live(now).then_some((i, amount))
        })
        .collect()
}

/// What `ops` added to line `line`, as far as the store answered them
/// (`results`, per op; an add whose answer is lost is taken as not made:
/// giving back what was not charged would uncount other requests).
pub(crate) fn added(ops: &[(usize, Adjust)], results: &[Option<u64>], line: usize) -> u64 {
    ops.iter()
        .zip(results)
        .filter(|((i, _), result)| *i == line && result.is_some())
        .map(|((_, op), _)| match op {
            Adjust::Add(more) => *more,
            Adjust::Refund(_) => 0,
        })
        .fold(0, u64::saturating_add)
}

/// Where each of `lines` stands once the store applied `ops` (those `kept`
/// were sent) and answered `results` (what the counter holds after,
/// `None`: no live counter, a failure, or an op left out).
pub(crate) fn settled(
    lines: &[Line],
    ops: &[(usize, Adjust)],
    kept: &[bool],
    results: &[Option<u64>],
) -> Vec<Usage> {
    let mut usage = before_ops(lines, ops, kept);
    for ((i, _), result) in ops.iter().zip(results) {
        if let Some(used) = result {
            usage[*i].used = *used;
        }
    }
    usage
}

/// Where `lines` stand once the `kept` ones of `ops` land, as the layer
/// reckons: for a response that goes out before the store answered them
/// (they carry on in their task).
pub(crate) fn expected(lines: &[Line], ops: &[(usize, Adjust)], kept: &[bool]) -> Vec<Usage> {
    let mut usage = before_ops(lines, ops, kept);
    for ((i, op), _) in ops.iter().zip(kept).filter(|(_, &kept)| kept) {
        let used = &mut usage[*i].used;
        *used = match op {
            Adjust::Refund(n) => used.saturating_sub(*n),
            Adjust::Add(n) => used.saturating_add(*n),
        };
    }
    usage
}

/// Where `lines` stand before the `kept` ones of `ops` apply: a line they
/// change as charged (claimed by this layer's refund, it is not given back
/// until the store says so); any other as the request knows it (given back
/// by its handler, say: see [`Line::standing`]).
fn before_ops(lines: &[Line], ops: &[(usize, Adjust)], kept: &[bool]) -> Vec<Usage> {
    lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let changed = ops.iter().zip(kept).any(|((j, _), &kept)| *j == i && kept);
            if changed {
                line.usage
            } else {
                line.standing()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests;
