//! Calls followed after their callers stopped waiting: their answers
//! awaited, and the charges Redis applied late given back.
//!
//! A give-back goes to the counter charged, by its first call when the
//! reply told it: one that takes back all a first-use counter holds
//! deletes it (see [`Store::refund_made_at`](crate::store::Store::refund_made_at)),
//! so a late charge for a request that was not served leaves no period
//! open behind it.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::redis::RedisError;
use jiff::Timestamp;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use super::connection::{Connection, Lost, Redirect};
use super::errors::{for_now, retires};
use super::store::Inner;
use super::{FOLLOW_THROUGH, SILENCE};
use crate::key::PeriodKey;
use crate::store::{ChargeLine, ChargeRequest, Lifetime, Made};
use crate::throttle::Throttle;

/// A call's room among the calls in flight, held until it is over; a
/// charge's (a settle's without a mark too) also counts it among the charges a shutdown
/// waits for ([`Store::charges_in_flight`](crate::store::Store::charges_in_flight)):
/// until it was answered, or given back if Redis applied it late. A read or
/// a change has nothing to give back, and a process may exit while one is
/// on its way.
pub(super) struct Room {
    _permit: OwnedSemaphorePermit,
    charge: Option<Charging>,
    /// On a cluster, the call counted among its node's.
    #[cfg(feature = "redis-cluster")]
    _node: Option<super::nodes::NodeHold>,
}

impl Room {
    pub(super) fn new(permit: OwnedSemaphorePermit) -> Self {
        Self {
            _permit: permit,
            charge: None,
            #[cfg(feature = "redis-cluster")]
            _node: None,
        }
    }

    /// The room of a call counted among its node's until it is over.
    #[cfg(feature = "redis-cluster")]
    pub(super) fn on_node(mut self, node: Option<super::nodes::NodeHold>) -> Self {
        self._node = node;
        self
    }

    /// Its caller stopped waiting (see [`NodeHold::given_up`]).
    ///
    /// [`NodeHold::given_up`]: super::nodes::NodeHold::given_up
    fn given_up(&mut self, sent: tokio::time::Instant) {
        #[cfg(feature = "redis-cluster")]
        if let Some(node) = &mut self._node {
            node.given_up(sent);
        }
        let _ = sent;
    }

    /// The node answered the call: its room among the node's calls is
    /// free (a give-back that follows is a call of its own, sent where the
    /// charge was; a slow node's next calls need not wait for it).
    #[cfg(feature = "redis-cluster")]
    fn answered(&mut self) {
        self._node = None;
    }

    /// The room of a charge, counted in `charges` until it is over.
    pub(super) fn charging(mut self, charges: &Arc<AtomicUsize>) -> Self {
        charges.fetch_add(1, Ordering::Relaxed);
        self.charge = Some(Charging(Arc::clone(charges)));
        self
    }
}

/// One charge counted on its way.
struct Charging(Arc<AtomicUsize>);

impl Drop for Charging {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a call does to what Redis holds: what a caller that stopped waiting
/// is told.
#[derive(Clone, Copy)]
pub(super) enum Sends {
    Read,
    /// A change that is not given back (a refund, an add, a reset).
    Write,
    /// A charge: given back if Redis applies it after all.
    Charge,
}

/// What a charge gives back when Redis applied it after its caller stopped
/// waiting: one refund per line, by the line's key and cost.
pub(super) struct GiveBack<T> {
    /// Whether the answer says the charge was applied.
    pub(super) applied: fn(&T) -> bool,
    /// The first call (ms) of the counter the line at an index of the
    /// charge was charged to, if the answer tells.
    pub(super) first_call: fn(&T, usize) -> Option<i64>,
    /// The units the line at an index of the charge took beyond its cost,
    /// as the answer tells ([`Store::charge_taking`](crate::store::Store::charge_taking)).
    pub(super) taken: fn(&T, usize) -> u64,
    /// The lines worth a refund: each one's index in the charge, key and
    /// cost, and for a first-use line its period (see [`Refund::ends`]).
    pub(super) lines: Vec<(usize, PeriodKey, u64, Option<Duration>)>,
    /// The instant of the charge: the refund goes to the counters live then.
    pub(super) now: Timestamp,
    /// On a cluster, the node the charge was sent to, as the store's map
    /// named it then (its index there: an index names one address for
    /// good): the give-back goes there, unless a redirect sent the charge
    /// elsewhere, and to no node that took its slot over in a failover
    /// (see [`refund_line`]).
    pub(super) node: Option<u16>,
}

impl<T> GiveBack<T> {
    /// The refunds of a charge sent at `sent` and answered with `value`:
    /// each line's key and cost, to the counter the line was charged to
    /// (see [`Refund::new`]).
    pub(super) fn refunds(self, value: &T, sent: Instant) -> Vec<Refund> {
        self.lines
            .into_iter()
            .map(|(i, key, cost, period)| {
                let cost = cost.saturating_add((self.taken)(value, i));
                let first_call = (self.first_call)(value, i);
                Refund::new(key, cost, self.now, first_call).made_at(self.now, period, sent)
            })
            .filter(|refund| refund.cost > 0)
            .collect()
    }
}

/// A line of a charge Redis applied after its caller stopped waiting, to
/// give back.
pub(super) struct Refund {
    pub(super) key: PeriodKey,
    pub(super) cost: u64,
    /// Only to the counter whose first call (ms) this is, as the charge's
    /// reply told; or, when it told none, to a counter made by the
    /// charge's instant (a counter made anew after a reset is younger).
    pub(super) counter: Made,
    /// When the first-use counter the charge made ends at the latest: what
    /// was left of its period when the charge was made, after it was sent.
    /// Redis, which ran the charge late, reckoned its time to live from
    /// then, and the give-back shortens it to this (see `counters.lua`,
    /// `r`). `None` for any other line.
    pub(super) ends: Option<Instant>,
}

impl Refund {
    /// The give-back of `cost` on `key`, charged at `now` to the counter
    /// whose first call (ms) the reply told, if it did.
    pub(super) fn new(key: PeriodKey, cost: u64, now: Timestamp, first_call: Option<i64>) -> Self {
        let counter = match first_call.and_then(|ms| Timestamp::from_millisecond(ms).ok()) {
            Some(first_call) => Made::At(first_call),
            None => Made::By(now),
        };
        Self {
            key,
            cost,
            counter,
            ends: None,
        }
    }

    /// The same refund, which for a first-use line whose counter the
    /// charge at `now`, sent at `sent`, made (its first call is the
    /// charge's instant) ends that counter `period` (what was left of the
    /// line's period when the charge was made) after `sent` at the latest.
    pub(super) fn made_at(
        mut self,
        now: Timestamp,
        period: Option<Duration>,
        sent: Instant,
    ) -> Self {
        if self.counter == Made::At(whole_milliseconds(now)) {
            self.ends = period.and_then(|period| sent.checked_add(period));
        }
        self
    }
}

/// `at` in whole milliseconds, as the script records a first call.
fn whole_milliseconds(at: Timestamp) -> Timestamp {
    Timestamp::from_millisecond(at.as_millisecond()).unwrap_or(at)
}

/// What is left of a first-use line's period when the charge is made at
/// `charged` (see [`ChargeRequest::charged_at`]).
pub(super) fn first_use_period(line: &ChargeLine, charged: Timestamp) -> Option<Duration> {
    match line.lifetime {
        Lifetime::FirstUse { deadline } => charged.duration_until(deadline).try_into().ok(),
        Lifetime::Calendar { .. } => None,
    }
}

/// The first call (ms) of the counter of line `i` in a charge's reply in
/// the script's form (the admission, then five values per line, the fourth
/// the counter's first call, -1 when it has none).
pub(super) fn first_call_of(reply: &[i64], i: usize) -> Option<i64> {
    reply
        .get(1 + i * super::FIELDS + 3)
        .copied()
        .filter(|&ms| ms >= 0)
}

/// The give-back of a charge (`op` `c`); other calls have none.
pub(super) fn give_back(op: &str, request: &ChargeRequest) -> Option<GiveBack<Vec<i64>>> {
    (op == "c").then(|| GiveBack {
        // The script's reply opens with 1 when every line was charged.
        applied: |reply: &Vec<i64>| reply.first() == Some(&1),
        first_call: |reply: &Vec<i64>, i| first_call_of(reply, i),
        taken: |_, _| 0,
        lines: request
            .lines
            .iter()
            .enumerate()
            .filter(|(_, line)| line.cost > 0)
            .map(|(i, line)| {
                let period = first_use_period(line, request.charged());
                (i, line.key.clone(), line.cost, period)
            })
            .collect(),
        now: request.now,
        node: None,
    })
}

/// The give-back of a charge taking units beyond its costs (`op` `x`): each
/// line's cost and the units the reply says it took.
pub(super) fn give_back_taking(request: &ChargeRequest, extra: &[u64]) -> GiveBack<Vec<i64>> {
    GiveBack {
        applied: |reply: &Vec<i64>| reply.first() == Some(&1),
        first_call: |reply: &Vec<i64>, i| first_call_of(reply, i),
        // After the lines' fields, one figure per line.
        taken: |reply: &Vec<i64>, i| {
            let lines = reply.len().saturating_sub(1) / (super::FIELDS + 1);
            reply
                .get(1 + super::FIELDS * lines + i)
                .and_then(|&units| u64::try_from(units).ok())
                .unwrap_or(0)
        },
        lines: request
            .lines
            .iter()
            .zip(extra)
            .enumerate()
            .filter(|(_, (line, &units))| line.cost > 0 || units > 0)
            .map(|(i, (line, _))| {
                let period = first_use_period(line, request.charged());
                (i, line.key.clone(), line.cost, period)
            })
            .collect(),
        now: request.now,
        node: None,
    }
}

pub(super) type RoundTrip<T> =
    Pin<Box<dyn Future<Output = (Connection, Result<T, RedisError>)> + Send>>;

/// A call on its way. Dropped before its answer came (its caller timed out
/// or went away), it hands its round trip to a task that follows it to the
/// end.
pub(super) struct Call<T: Send + 'static> {
    pub(super) inner: Arc<Inner>,
    pub(super) trip: Option<RoundTrip<T>>,
    /// What to close if the round trip never comes back.
    pub(super) lost: Option<Lost>,
    /// The cluster slot it went to, if any (see `Inner::slot`).
    pub(super) slot: super::store::Slot,
    /// When it was sent.
    pub(super) sent: tokio::time::Instant,
    /// Keeps the call counted in flight until it is over.
    pub(super) permit: Option<Room>,
    pub(super) give_back: Option<GiveBack<T>>,
}

impl<T: Send + 'static> Drop for Call<T> {
    fn drop(&mut self) {
        let Some(trip) = self.trip.take() else {
            return;
        };
        if let Some(room) = &mut self.permit {
            room.given_up(self.sent);
        }
        let follow = follow_through(
            Arc::clone(&self.inner),
            trip,
            self.lost.take(),
            self.slot,
            self.sent,
            self.permit.take(),
            self.give_back.take(),
        );
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(follow)),
            Err(_) => tracing::warn!(
                "a Redis call was dropped outside a tokio runtime and cannot be followed; a \
                 charge it carried may be applied without an admission"
            ),
        }
    }
}

/// Waits for `trip`, sent at `sent`, until `FOLLOW_THROUGH` from then. If
/// nothing at all came back on its connection within `SILENCE` (or the
/// store's timeout, if longer; on a cluster, plus the time a call is sent
/// again while its slot moves: [`Lost::patience`]), the connection went
/// silent (a socket left half-open would hold every call sent on it): it
/// takes no new calls, while this one is still waited for.
pub(super) async fn wait_for<F: Future + Unpin>(
    inner: &Inner,
    trip: &mut F,
    sent: tokio::time::Instant,
    lost: &mut Option<Lost>,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    if let Some(lost) = lost.as_ref() {
        inner.unanswered.given_up(lost, sent);
    }
    let patience = lost
        .as_ref()
        .map_or(std::time::Duration::ZERO, Lost::patience);
    let silence = sent + SILENCE.max(inner.timeout) + patience;
    if let Ok(answer) = tokio::time::timeout_at(silence, &mut *trip).await {
        return Ok(answer);
    }
    if lost.as_ref().is_some_and(Lost::silent) {
        if let Some(lost) = lost.take() {
            inner.connections.failed(lost.failed);
        }
    }
    tokio::time::timeout_at(sent + FOLLOW_THROUGH, trip).await
}

/// Follows a round trip whose caller stopped waiting to its end: a charge
/// Redis applied is given back.
pub(super) async fn follow_through<T>(
    inner: Arc<Inner>,
    mut trip: RoundTrip<T>,
    mut lost: Option<Lost>,
    slot: super::store::Slot,
    sent: tokio::time::Instant,
    mut _permit: Option<Room>,
    give_back: Option<GiveBack<T>>,
) {
    let answer = wait_for(&inner, &mut trip, sent, &mut lost).await;
    if let Ok((_, result)) = &answer {
        inner.heard(result, slot);
    }
    let (mut conn, value) = match answer {
        Ok((conn, Ok(value))) => (conn, value),
        Ok((conn, Err(error))) => {
            if retires(&error) {
                inner.connections.failed(conn.failed());
            }
            return;
        }
        Err(_) => {
            if let Some(lost) = lost {
                inner.connections.failed(lost.failed);
            }
            if let Some(suppressed) = LATE.admit() {
                tracing::warn!(
                    suppressed,
                    "Redis did not answer a call in {FOLLOW_THROUGH:?}; dropping its connection \
                     (a charge it carried may have been applied without an admission)"
                );
            }
            return;
        }
    };
    let Some(mut give_back) = give_back else {
        return;
    };
    if !(give_back.applied)(&value) {
        return;
    }
    let now = give_back.now;
    // The node that ran the charge: where a redirect sent it last (the
    // store's map may lag the cluster client's, which a `MOVED` updated),
    // or the node the map named.
    #[cfg(feature = "redis-cluster")]
    let node = conn.sent_to().cloned().or_else(|| {
        let index = give_back.node.take()?;
        inner
            .nodes
            .as_ref()?
            .address_of(index)
            .map(Redirect::to_node)
    });
    // (Set on a cluster only.)
    #[cfg(not(feature = "redis-cluster"))]
    let node: Option<Redirect> = give_back.node.take().and(None);
    #[cfg(feature = "redis-cluster")]
    if node.is_some() {
        if let Some(room) = &mut _permit {
            room.answered();
        }
    }
    refund_lines(
        &inner,
        &mut conn,
        give_back.refunds(&value, sent),
        now,
        node.as_ref(),
    )
    .await;
}

/// Gives back an applied charge whose caller stopped waiting, line by line,
/// at the charge's instant `now`, each to the counter it was charged to
/// (see [`Refund::counter`]): by its first call, exactly, as
/// [`Store::refund_made_at`] does, or made by an instant, as
/// [`Store::refund_made_by`] does.
pub(super) async fn refund_lines(
    inner: &Inner,
    conn: &mut Connection,
    lines: Vec<Refund>,
    now: Timestamp,
    node: Option<&Redirect>,
) {
    let (mut refunded, mut missed, mut refused) = (0, 0, 0);
    let mut first_miss: Option<(PeriodKey, String)> = None;
    let mut answering = true;
    for Refund {
        key,
        cost,
        counter,
        ends,
    } in lines
    {
        if !answering {
            // The connection stopped answering: the rest waits no longer.
            missed += 1;
            continue;
        }
        // Only to the counter charged: not to one made since (the counter
        // reset or expired, and a new charge made it).
        let amount = super::script::refund_amount(cost);
        let mut invocation = super::script::Invocation::change("r", &key, amount, now, counter);
        if let Some(ends) = ends {
            // At least a millisecond: a counter whose period is over goes
            // at once.
            let left = ends.saturating_duration_since(Instant::now());
            invocation.arg(left.as_millis().max(1) as u64);
        }
        let refund = refund_line(&invocation, conn, node);
        let why = match tokio::time::timeout(FOLLOW_THROUGH, refund).await {
            // No live counter charged: gone since, or never charged.
            Ok(Ok(-1)) => {
                refused += 1;
                continue;
            }
            Ok(Ok(_)) => {
                refunded += 1;
                continue;
            }
            Ok(Err(error)) => error.to_string(),
            Err(_) => {
                answering = false;
                format!("no answer in {FOLLOW_THROUGH:?}")
            }
        };
        missed += 1;
        first_miss.get_or_insert((key, why));
    }
    if let Some((key, why)) = first_miss {
        // Redis's answer may name the key: the log names it without its
        // subject's id.
        let why = why.replace(key.as_str(), &key.logged());
        if let Some(suppressed) = LATE.admit() {
            tracing::warn!(
                lines = missed,
                key = key.logged(),
                error = why,
                suppressed,
                "could not give back a charge Redis applied after its caller stopped waiting"
            );
        }
    }
    let total = inner.given_back.fetch_add(1, Ordering::Relaxed) + 1;
    tracing::debug!(
        lines = refunded,
        refused,
        total,
        "gave back a charge Redis applied after its caller stopped waiting"
    );
}

/// A give-back's refund on `conn`, sent again a moment later while Redis
/// answers that it cannot run it now (out of memory under `noeviction`,
/// loading, busy with a script, the cluster down: a reply that applied
/// nothing), for as long as the caller waits ([`FOLLOW_THROUGH`]): such a
/// refusal would otherwise leave the charge applied without an admission,
/// and sending it again is safe.
///
/// On a cluster, the refund goes to `node`, the node the charge was sent
/// to. One that answers that another node serves the slot now is asked
/// its role: a master (the slot moved in a resharding, its keys with it)
/// sends the refund on where the slot went; a replica (a failover) does
/// not: it ran the charge as a master that was failed over already (hung
/// past the cluster's node timeout, it ran the calls queued on it once
/// back, before it learned of its replica's promotion), on data it threw
/// away when it turned replica, and the new master never held the charge.
/// Given back there, the refund would take a unit from the requests it
/// admitted. The counter charged is gone: -1, as for a counter gone since.
/// (A charge a master ran late just before a graceful failover reached
/// its replica: it then stays counted, though its request was refused.)
async fn refund_line(
    invocation: &super::script::Invocation,
    conn: &mut Connection,
    node: Option<&Redirect>,
) -> Result<i64, RedisError> {
    let mut wait = std::time::Duration::from_millis(100);
    let mut node = node.filter(|_| conn.is_cluster()).cloned();
    loop {
        let answer = match &node {
            Some(at) => match invocation.invoke_at::<i64>(conn, at).await {
                // The node is gone (a master killed, its replica promoted):
                // it ran nothing it answers for; the slot's node now takes
                // the refund.
                Err(error) if error.is_connection_refusal() => {
                    node = None;
                    continue;
                }
                Err(error) if Redirect::of(&error).is_some() => {
                    if is_replica(conn, at).await {
                        if let Some(suppressed) = LATE.admit() {
                            tracing::warn!(
                                suppressed,
                                "a charge Redis applied after its caller stopped waiting was run \
                                 by a master failed over since: not given back to the new master, \
                                 which never held it"
                            );
                        }
                        return Ok(-1);
                    }
                    node = None;
                    continue;
                }
                answer => answer,
            },
            None => invocation.invoke_async::<i64>(conn).await,
        };
        match answer {
            Err(error) if for_now(&error) => {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(MAX_REFUND_WAIT);
            }
            answer => return answer,
        }
    }
}

/// Whether the node `at` says it is a replica (`ROLE`).
async fn is_replica(conn: &mut Connection, at: &Redirect) -> bool {
    use deadpool_redis::redis::Value;
    match conn
        .redirected(&deadpool_redis::redis::cmd("ROLE"), at)
        .await
    {
        Ok(Value::Array(role)) => matches!(
            role.first(),
            Some(Value::BulkString(name)) if name.as_slice() == b"slave"
        ),
        _ => false,
    }
}

/// The longest wait between two tries of a give-back's refund that Redis
/// cannot run for now: once it can, the charge is given back within it.
const MAX_REFUND_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Lets a few warnings a second through about calls followed after their
/// callers stopped waiting (during an outage, there is one per call).
pub(super) static LATE: Throttle = Throttle::new(5);
