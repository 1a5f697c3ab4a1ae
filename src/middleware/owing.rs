//! Requests that pass on a failed charge (fail open): what they owe the
//! policy's ledger once their answer is known (see the ledger module).

use std::sync::{Arc, Mutex};

use http::{Extensions, Response};
use jiff::Timestamp;
use smallvec::SmallVec;

use super::charge::{self, Adjust, Charge, Outcome};
use super::layer::Bound;
use crate::policy::OnStoreError;
use crate::status::{GiveBack, LayerQuotas, Line, Lines, QuotaStatus};
use crate::store::{Debt, Lifetime, Store, Usage};
use crate::subject::SubjectExtractor;

/// What a layer's lines owe for a request that passed on a failed charge,
/// recorded once its answer is known: the request was served, and owes
/// what it would have been charged (the response may change that as it
/// changes a charge: a refund of a server error, a deferred cost). A request
/// dropped before its answer, or that no route served, owes nothing.
pub(crate) struct Owing<E, St> {
    bound: Arc<Bound<E, St>>,
    /// The lines as if charged (the usage is not known, and not used); the
    /// layers further in tell them what they keep, as they tell a
    /// charging layer's.
    lines: Arc<Lines>,
    /// Whether the inner service answered.
    answered: bool,
    /// Each line's lifetime, as its charge line had it.
    lifetimes: SmallVec<[Lifetime; 2]>,
    /// The request's instant.
    now: Timestamp,
    /// The lines the layers further out charged for the request: the debt
    /// waits in them until they know the request was served (see
    /// [`PendingDebts`]).
    outer: Vec<Arc<Lines>>,
}

/// Lets the request of `charge` through without a charge, its ticket in
/// `extensions`: owing the charge, so that the policy's layers further in
/// owe theirs too without asking the store; or, when the policy keeps no
/// ledger, uncounted, so that they pass.
pub(crate) fn owe<E: SubjectExtractor, St: Store>(
    bound: &Arc<Bound<E, St>>,
    charge: Charge,
    extensions: &mut Extensions,
) -> Option<Box<Owing<E, St>>> {
    let policy = &bound.policy;
    let Charge {
        mut ticket,
        quotas,
        request,
        ..
    } = charge;
    if policy.settings.max_owed == 0 {
        // Let through uncounted: a refusal this layer marked before (an
        // earlier attempt of a retry) no longer speaks for the answer.
        QuotaStatus::let_through_in(extensions, crate::status::layer_id(bound));
        if policy.settings.on_store_error != OnStoreError::FailOpen {
            // A layer of shadow quotas under fail closed: it alone lets the
            // request through uncounted; the policy's other layers ask the
            // store.
            QuotaStatus::put_in(extensions, ticket);
            return None;
        }
        let mut uncounted = charge::uncounted(policy.id, ticket.now);
        // What layers further out charged stays theirs to give back, and
        // counted on their store.
        uncounted.charges = ticket.charges;
        uncounted.owing = ticket.owing;
        uncounted.store = ticket.store;
        QuotaStatus::put_in(extensions, uncounted);
        return None;
    }
    let now = ticket.now;
    let lines = quotas
        .quotas(&bound.scope)
        .iter()
        .zip(&request.lines)
        .map(|(quota, line)| {
            let usage = Usage {
                held_elsewhere_until: None,
                counted_at: None,
                limit: 0,
                used: 0,
                resets_at: now,
                first_call: None,
            };
            Line::new(quota, line.key.clone(), line.cost, usage)
        })
        .collect();
    // The same allocation as `bound`: one reference count.
    let layer: Arc<dyn LayerQuotas> = Arc::clone(bound) as _;
    let lines = Arc::new(Lines::new(layer, quotas, lines));
    let lifetimes = request.lines.iter().map(|line| line.lifetime).collect();
    ticket
        .owed
        .extend(request.lines.into_iter().map(|line| line.key));
    ticket.owing.push(Arc::clone(&lines));
    let outer = QuotaStatus::put_in_charged(extensions, ticket, crate::status::layer_id(bound));
    // Boxed: the response future stays small for the requests that owe
    // nothing.
    Some(Box::new(Owing {
        bound: Arc::clone(bound),
        lines,
        answered: false,
        lifetimes,
        now,
        outer,
    }))
}

impl<E, St> Drop for Owing<E, St> {
    /// Dropped before the inner service answered: the request was not
    /// served, and what the layers further in kept goes back.
    fn drop(&mut self) {
        if !self.answered {
            self.lines.give_back_inside();
        }
    }
}

impl<E: SubjectExtractor, St: Store> Owing<E, St> {
    /// The inner service's answer (`Err`: it failed): the debts it leaves
    /// go to the ledger, and it goes on untouched.
    pub(crate) fn answered<B, Er>(
        mut self,
        result: Result<Response<B>, Er>,
    ) -> Result<Response<B>, Er> {
        let policy = &self.bound.policy;
        let settings = &policy.settings;
        let cost = &self.bound.scope.cost;
        let most = policy.store.max_count();
        // Worked out first: the application's deferred cost runs in it,
        // and if it panics, dropping `self` gives back what the layers
        // further in kept, as for any request not served.
        let (result, outcome) = match result {
            Ok(response) => {
                let (parts, body) = response.into_parts();
                let marked = self.lines.is_refused_inside();
                let outcome =
                    charge::outcome(&self.lines, cost, settings, most, marked, Some(&parts));
                (Ok(Response::from_parts(parts, body)), outcome)
            }
            Err(error) => (
                Err(error),
                charge::outcome(&self.lines, cost, settings, most, false, None),
            ),
        };
        self.answered = true;
        if self.outer.is_empty() {
            // The outermost layer that charged or owes: the response goes
            // out, and what the layers further in kept was served.
            self.lines.went_out();
        }
        let Outcome::Served(ops) = outcome else {
            // No route served it: nothing owed.
            return result;
        };
        let debts = self.lines.iter().enumerate().map(|(i, line)| {
            let amount = ops
                .iter()
                .filter(|(j, _)| *j == i)
                .fold(line.cost, |amount, (_, op)| match op {
                    Adjust::Refund(back) => amount.saturating_sub(*back),
                    Adjust::Add(more) => amount.saturating_add(*more),
                });
            Debt {
                key: line.key.clone(),
                amount,
                lifetime: self.lifetimes[i],
                since: self.now,
                // Each settle's own, given by the ledger when it sends one.
                id: 0,
            }
        });
        if self.outer.is_empty() {
            policy.ledger.owe(&policy.store, settings.ledger(), debts);
        } else {
            // A layer further out may still be dropped before the response
            // goes out: the request was then not served, and owes nothing.
            let pending: Arc<dyn GiveBack> = Arc::new(PendingDebts {
                bound: Arc::clone(&self.bound),
                debts: Mutex::new(Some(debts.collect())),
            });
            for lines in &self.outer {
                lines.tell(Arc::clone(&pending));
            }
        }
        result
    }
}

/// What a request that passed on a failed charge owes, while a layer
/// further out (which charged the request) has yet to send the response:
/// forgiven if that layer is dropped before (the request was not served),
/// owed to the ledger once its response went out (or, failing word of
/// either, once the lines that hold it let go of it).
struct PendingDebts<E, St: Store> {
    bound: Arc<Bound<E, St>>,
    debts: Mutex<Option<Vec<Debt>>>,
}

impl<E, St: Store> PendingDebts<E, St> {
    /// The debts, unless forgiven or owed already.
    fn take(&self) -> Option<Vec<Debt>> {
        self.debts.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Owes the debts to the ledger, unless forgiven or owed already.
    fn owe(&self) {
        if let Some(debts) = self.take() {
            let policy = &self.bound.policy;
            policy
                .ledger
                .owe(&policy.store, policy.settings.ledger(), debts);
        }
    }
}

impl<E: SubjectExtractor, St: Store> GiveBack for PendingDebts<E, St> {
    fn give_back(&self) {
        drop(self.take());
    }

    fn went_out(&self) {
        self.owe();
    }
}

impl<E, St: Store> Drop for PendingDebts<E, St> {
    fn drop(&mut self) {
        self.owe();
    }
}
