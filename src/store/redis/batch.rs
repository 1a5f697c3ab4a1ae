//! Charges sent together.
//!
//! On a single server (not a cluster, whose keys live on many nodes), the
//! charges of concurrent callers are queued and sent in batches: one
//! `EVALSHA` of the counters script's batch operation runs each queued
//! charge in turn, each one checked and committed on its own as if it had
//! come alone. A few batches are on their way at once; while they are,
//! new charges wait in the queue and leave together with the next batch.
//! So a lone charge leaves at once, and under load a round trip carries
//! many: Redis reads, runs and answers one command for all of them.
//!
//! The caller whose charge starts a batch drives it until its own answer
//! comes (a lone charge takes no detour through another task); from then
//! on, or as soon as that caller goes away, the batch goes on in a task of
//! its own. So a caller that stops waiting (its budget ran out, its future
//! was dropped) never cuts short a batch that carries other callers'
//! charges. Its own charge is then either not sent (it was still queued) or
//! given back once Redis applied it: the answer finds nobody to take it, or
//! is dropped untaken.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};

use deadpool::managed::Timeouts;
use deadpool_redis::redis::aio::ConnectionLike;
use deadpool_redis::redis::{self, ErrorKind, FromRedisValue, RedisError, ServerErrorKind, Value};
use jiff::Timestamp;
use smallvec::SmallVec;
use tokio::sync::oneshot;

use super::late::Sends;
use super::late::{first_call_of, Refund};
use super::{refund_lines, retires, wait_for, Inner, COUNTERS_LUA, FOLLOW_THROUGH, LATE};
use crate::key::PeriodKey;

/// The most charges in one batch.
const MAX_CHARGES: usize = 128;

/// The queue of charges waiting for a batch, and how many batches are on
/// their way.
pub(super) struct Batches {
    queue: Mutex<Queue>,
    /// The most batches on their way at once.
    max_sending: usize,
}

struct Queue {
    waiting: VecDeque<Pending>,
    sending: usize,
}

/// A charge's lines: a charge of one line, the common case, keeps it in
/// place.
pub(super) type Lines = SmallVec<[LineArgs; 1]>;

/// One charge's reply in the charge operation's form: one line's fits in
/// place, so that handing a charge its answer allocates nothing.
pub(super) type Reply = SmallVec<[i64; 1 + super::FIELDS]>;

/// One charge's line, as the script takes it.
pub(super) struct LineArgs {
    pub(super) key: PeriodKey,
    pub(super) limit: i64,
    pub(super) cost: i64,
    pub(super) anchor: &'static str,
    pub(super) ttl: i64,
    pub(super) end: i64,
}

impl LineArgs {
    /// Whether `other` has the same arguments but for the key and the ttl.
    fn same_quota(&self, other: &LineArgs) -> bool {
        self.limit == other.limit
            && self.cost == other.cost
            && self.anchor == other.anchor
            && self.end == other.end
    }
}

/// A charge waiting for its batch.
pub(super) struct Pending {
    pub(super) now: Timestamp,
    pub(super) lines: Lines,
    pub(super) answer: oneshot::Sender<Answer>,
    /// Keeps the charge counted in flight until it is over.
    pub(super) permit: super::late::Room,
    /// Set when its batch is sent: what the connection answers from then
    /// on (see `Inner::last_answer_for`).
    pub(super) sent: Arc<std::sync::OnceLock<super::connection::AnswersAfter>>,
}

/// Redis's answer to one charge: the script's reply, or why there is none.
/// An applied charge carries what gives it back if the answer is dropped
/// before its caller [took](Answer::take) it.
pub(super) struct Answer {
    reply: Result<Reply, RedisError>,
    give_back: Option<GiveBack>,
}

impl Answer {
    /// The reply, not yet taken: dropped without [`take`](Self::take), an
    /// applied charge is given back.
    pub(super) fn reply(&self) -> &Result<Reply, RedisError> {
        &self.reply
    }

    /// The reply, taken by the charge's caller: from here on, the charge is
    /// the caller's.
    pub(super) fn take(self) -> Result<Reply, RedisError> {
        let Answer { reply, give_back } = self;
        if let Some(mut give_back) = give_back {
            give_back.lines.clear();
        }
        reply
    }
}

/// Gives an applied charge back when dropped armed (with lines).
struct GiveBack {
    inner: Arc<Inner>,
    now: Timestamp,
    /// When the batch was sent (see [`Refund::made_at`]).
    sent: Option<tokio::time::Instant>,
    /// Each line's counter's first call (ms), when the charge was applied
    /// and the reply told: its give-back goes to a counter made by then
    /// (see [`made_by`]).
    first_calls: SmallVec<[Option<i64>; 2]>,
    /// The applied charge's lines; none once it is taken, or when it was
    /// not applied.
    lines: Lines,
    /// Held until the charge is over: taken, or given back.
    permit: Option<super::late::Room>,
}

impl Drop for GiveBack {
    fn drop(&mut self) {
        // The lines worth a refund, listed only now: an answer taken (the
        // common case) lists nothing.
        let now = self.now;
        let lines: Vec<Refund> = std::mem::take(&mut self.lines)
            .into_iter()
            .enumerate()
            .filter(|(_, line)| line.cost > 0)
            .map(|(i, line)| {
                let first_call = self.first_calls.get(i).copied().flatten();
                let refund = Refund::new(line.key, line.cost.unsigned_abs(), now, first_call);
                // A first-use line's ttl: from when it was charged to its
                // deadline.
                let period = (line.anchor == "f")
                    .then(|| std::time::Duration::from_millis(line.ttl.unsigned_abs()));
                match self.sent {
                    Some(sent) => refund.made_at(now, period, sent),
                    None => refund,
                }
            })
            .collect();
        if lines.is_empty() {
            return;
        }
        let inner = Arc::clone(&self.inner);
        let permit = self.permit.take();
        let give_back = async move {
            let _permit = permit;
            let timeouts = Timeouts {
                wait: Some(FOLLOW_THROUGH),
                create: Some(inner.connect_timeout),
                recycle: Some(inner.timeout),
            };
            let deadline = tokio::time::Instant::now() + FOLLOW_THROUGH;
            match inner
                .connections
                .ready_or_get(&timeouts, deadline, Sends::Write)
                .await
            {
                Some(Ok(mut conn)) => refund_lines(&inner, &mut conn, lines, now, None).await,
                _ => {
                    if let Some(suppressed) = LATE.admit() {
                        tracing::warn!(
                            lines = lines.len(),
                            suppressed,
                            "could not give back a charge Redis applied after its caller \
                             stopped waiting: no connection"
                        );
                    }
                }
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(give_back)),
            Err(_) => tracing::warn!(
                "a charge Redis applied after its caller stopped waiting was dropped outside a \
                 tokio runtime and cannot be given back"
            ),
        }
    }
}

impl Batches {
    pub(super) fn new(max_sending: usize) -> Self {
        Self {
            queue: Mutex::new(Queue {
                waiting: VecDeque::new(),
                sending: 0,
            }),
            max_sending: max_sending.max(1),
        }
    }

    /// Queues a charge. When fewer than the most batches are on their way,
    /// returns what sends the next one (and the ones after it while charges
    /// wait): the caller drives it until its own answer comes, and it goes
    /// on in a task of its own from there (see [`Detached`]).
    pub(super) fn push(
        inner: &Arc<Inner>,
        pending: Pending,
    ) -> Option<Detached<impl Future<Output = ()> + Send + 'static>> {
        let batches = inner.batches.as_ref().expect("a store that batches");
        let batch = {
            let mut queue = batches.lock();
            queue.waiting.push_back(pending);
            if queue.sending == batches.max_sending {
                return None;
            }
            queue.sending += 1;
            queue.take()
        };
        let sender = Sender {
            inner: Arc::clone(inner),
            done: false,
        };
        Some(Detached(Some(Box::pin(sender.run(batch)))))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next batch, or none: then one fewer is on its way.
    fn next(&self) -> Option<Vec<Pending>> {
        let mut queue = self.lock();
        if queue.waiting.is_empty() {
            queue.sending -= 1;
            return None;
        }
        Some(queue.take())
    }
}

impl Queue {
    fn take(&mut self) -> Vec<Pending> {
        let count = self.waiting.len().min(MAX_CHARGES);
        self.waiting.drain(..count).collect()
    }
}

/// A future driven by whoever holds it, and run to its end in a task of its
/// own if dropped before: a batch is never cut short by one caller.
pub(super) struct Detached<F: Future<Output = ()> + Send + 'static>(Option<Pin<Box<F>>>);

impl<F: Future<Output = ()> + Send + 'static> Future for Detached<F> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(future) = self.0.as_mut() else {
            return Poll::Ready(());
        };
        ready!(future.as_mut().poll(cx));
        self.0 = None;
        Poll::Ready(())
    }
}

impl<F: Future<Output = ()> + Send + 'static> Drop for Detached<F> {
    fn drop(&mut self) {
        let Some(future) = self.0.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(future)),
            Err(_) => tracing::warn!(
                "a batch of Redis charges was dropped outside a tokio runtime and cannot be \
                 followed; a charge it carried may be applied without an admission"
            ),
        }
    }
}

/// One of the batches on their way: sends batch after batch while charges
/// are waiting.
struct Sender {
    inner: Arc<Inner>,
    /// Whether it ran out of batches, rather than being dropped on the way
    /// (a panic, or the runtime shutting down).
    done: bool,
}

impl Sender {
    async fn run(mut self, mut batch: Vec<Pending>) {
        loop {
            // A caller that stopped waiting before its charge was sent: the
            // charge is never sent.
            batch.retain(|pending| !pending.answer.is_closed());
            if !batch.is_empty() {
                send(&self.inner, batch).await;
            }
            batch = match self.inner.batches.as_ref().and_then(Batches::next) {
                Some(batch) => batch,
                None => {
                    self.done = true;
                    return;
                }
            };
            // Lets others run between batches.
            tokio::task::yield_now().await;
        }
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        // Dropped on its way: one fewer is, and the next push starts
        // another for the charges still waiting. (Those of the batch it
        // carried are dropped with it: their callers hear that it was lost.)
        if !self.done {
            if let Some(batches) = &self.inner.batches {
                batches.lock().sending -= 1;
            }
        }
    }
}

/// Sends one batch and hands each charge its answer.
async fn send(inner: &Arc<Inner>, batch: Vec<Pending>) {
    let timeouts = Timeouts {
        wait: Some(inner.timeout),
        create: Some(inner.connect_timeout),
        recycle: Some(inner.timeout),
    };
    let deadline = tokio::time::Instant::now() + FOLLOW_THROUGH;
    let mut conn = match inner
        .connections
        .ready_or_get(&timeouts, deadline, Sends::Charge)
        .await
    {
        Some(Ok(conn)) => conn,
        Some(Err(fault)) => {
            let error = match fault {
                super::Fault::Redis(error) => error,
                super::Fault::Pool(error) => RedisError::from(std::io::Error::other(format!(
                    "no Redis connection: {error}"
                ))),
            };
            return fail(batch, &error);
        }
        None => {
            return fail(
                batch,
                &RedisError::from(std::io::Error::other("no Redis connection in time")),
            )
        }
    };
    // Callers that left while the connection was had (a ping, a reconnect)
    // are not sent either.
    let batch: Vec<Pending> = batch
        .into_iter()
        .filter(|pending| !pending.answer.is_closed())
        .collect();
    if batch.is_empty() {
        return;
    }
    let command = command(&batch);
    let mut lost = conn.lost();
    let sent = tokio::time::Instant::now();
    if let Some(after) = conn.answers_after(sent) {
        for pending in &batch {
            let _ = pending.sent.set(after.clone());
        }
    }
    let mut trip = Box::pin(async move {
        let result = eval(&mut conn, &command).await;
        (conn, result)
    });
    let (conn, result) = match tokio::time::timeout_at(sent + inner.timeout, trip.as_mut()).await {
        Ok(answer) => answer,
        Err(_) => {
            // The batch is followed in a task of its own, so that the next
            // one leaves at once (and does not wait behind a connection gone
            // silent); its callers that still wait (Redis answering others
            // meanwhile: see `Patience`) get their answers from there.
            let inner = Arc::clone(inner);
            tokio::spawn(async move {
                match wait_for(&inner, &mut trip, sent, &mut lost).await {
                    Ok((conn, result)) => answer(&inner, batch, conn, result),
                    Err(_) => {
                        if let Some(lost) = lost {
                            inner.connections.failed(lost.failed);
                        }
                        unanswered(batch);
                    }
                }
            });
            return;
        }
    };
    answer(inner, batch, conn, result);
}

/// A batch whose round trip never came back.
fn unanswered(batch: Vec<Pending>) {
    if let Some(suppressed) = LATE.admit() {
        tracing::warn!(
            charges = batch.len(),
            suppressed,
            "Redis did not answer a batch of charges in {FOLLOW_THROUGH:?}; dropping its \
             connection (the charges may have been applied without an admission)"
        );
    }
    fail(
        batch,
        &RedisError::from(std::io::Error::other("Redis did not answer")),
    );
}

/// Hands each charge of `batch` its answer from the batch's reply.
fn answer(
    inner: &Arc<Inner>,
    batch: Vec<Pending>,
    conn: super::Connection,
    result: Result<Value, RedisError>,
) {
    // A batch is a single server's (no cluster slot).
    inner.heard(&result, None);
    let values = match result {
        Ok(Value::Array(values)) => values,
        Ok(other) => {
            let error = RedisError::from(std::io::Error::other(format!(
                "the counters script answered a batch of {} charges with {other:?}",
                batch.len()
            )));
            return fail(batch, &error);
        }
        Err(error) => {
            if retires(&error) {
                inner.connections.failed(conn.failed());
            }
            return fail(batch, &error);
        }
    };
    let mut values = values.into_iter();
    for pending in batch {
        let (applied, reply) = split(&mut values, &pending.lines);
        let pending_lines = pending.lines.len();
        let Pending {
            now,
            lines,
            answer,
            permit,
            sent,
        } = pending;
        let give_back = GiveBack {
            inner: Arc::clone(inner),
            now,
            sent: sent.get().map(|answers| answers.sent),
            first_calls: match (&reply, applied) {
                (Ok(reply), true) => (0..pending_lines)
                    .map(|i| first_call_of(reply, i))
                    .collect(),
                _ => SmallVec::new(),
            },
            lines: if applied { lines } else { Lines::new() },
            permit: Some(permit),
        };
        // A caller gone by now drops the answer here, and with it gives
        // the charge back.
        let _ = answer.send(Answer {
            reply,
            give_back: Some(give_back),
        });
    }
    if values.len() != 0 {
        tracing::warn!(
            left_over = values.len(),
            "the counters script answered a batch of charges with more values than it holds"
        );
    }
}

/// The next charge's reply from the batch's flat reply, as the script's
/// charge operation gives it (1 or 0, then five values per line), and
/// whether the charge was applied. The script answers a charge with one
/// error; or, when it took the common path (one line, healing nothing), in
/// a short form: `[2 + admitted, used, first call]` on a calendar counter, `[4 +
/// admitted, used, pttl, first call]` on a first-use one, which this
/// widens; or else 1 or 0 then five values per line of `lines`. Takes
/// exactly that many values whatever they hold, so the charges after it
/// stay in step; whether the charge was applied is read before the rest is
/// parsed, so that a charge applied with a reply that cannot be read is
/// still given back. A reply cut short comes out short, and [`outcome`]
/// refuses it.
///
/// [`outcome`]: super::script::outcome
fn split(
    values: &mut std::vec::IntoIter<Value>,
    lines: &[LineArgs],
) -> (bool, Result<Reply, RedisError>) {
    let first = match values.next() {
        Some(Value::ServerError(error)) => return (false, Err(RedisError::from(error))),
        first => first,
    };
    let tag = match &first {
        Some(Value::Int(tag)) => *tag,
        _ => -1,
    };
    let applied = matches!(tag, 1 | 3 | 5);
    let short = match tag {
        2 | 3 => Some(2),
        4 | 5 => Some(3),
        _ => None,
    };
    let mut error = None;
    let mut number = |value: &Value| {
        i64::from_redis_value_ref(value).unwrap_or_else(|e| {
            error.get_or_insert(RedisError::from(e));
            0
        })
    };
    let reply = match short {
        Some(count) => {
            let mut taken = [0; 3];
            let mut got = 0;
            for (slot, value) in taken.iter_mut().zip(values.take(count)) {
                *slot = number(&value);
                got += 1;
            }
            match (&taken[..got], lines) {
                (&[used, first_call], [line]) if tag < 4 => {
                    Reply::from_buf([tag & 1, used, left(line, used), -3, first_call, 0])
                }
                (&[used, pttl, first_call], [line]) => {
                    Reply::from_buf([tag & 1, used, left(line, used), pttl, first_call, 0])
                }
                // Cut short, or a short form for a charge of many lines:
                // [`outcome`] refuses it.
                (taken, _) => Reply::from_slice(taken),
            }
        }
        None => {
            let mut reply = Reply::with_capacity(1 + super::FIELDS * lines.len());
            if let Some(first) = &first {
                reply.push(number(first));
                for value in values.take(super::FIELDS * lines.len()) {
                    reply.push(number(&value));
                }
            }
            reply
        }
    };
    (applied, error.map_or(Ok(reply), Err))
}

/// What is left of `line`'s limit after `used`.
fn left(line: &LineArgs, used: i64) -> i64 {
    line.limit.saturating_sub(used).max(0)
}

/// Every charge of `batch` failed with `error`: none of them was applied
/// as far as anyone can tell.
fn fail(batch: Vec<Pending>, error: &RedisError) {
    for pending in batch {
        let _ = pending.answer.send(Answer {
            reply: Err(error.clone()),
            give_back: None,
        });
    }
}

/// The batch's `EVALSHA`. A one-line charge of the same quota as the
/// one-line charge before it (same limit, cost, anchor and window's end)
/// is sent as `=`, its instant and its ttl.
fn command(batch: &[Pending]) -> redis::Cmd {
    let keys: usize = batch.iter().map(|pending| pending.lines.len()).sum();
    // Sized once: EVALSHA, the hash, the key count and "b"; a key and five
    // numbers per line; the line count and the instant per charge.
    let args = 4 + 6 * keys + 2 * batch.len();
    let mut command = redis::Cmd::with_capacity(args, 64 + 96 * keys + 16 * batch.len());
    command
        .arg("EVALSHA")
        .arg(super::SCRIPT.get_hash())
        .arg(keys);
    for pending in batch {
        for line in &pending.lines {
            command.arg(line.key.as_str());
        }
    }
    command.arg("b");
    let mut before: Option<&LineArgs> = None;
    for pending in batch {
        let now = pending.now.as_millisecond();
        match (before, pending.lines.as_slice()) {
            (Some(before), [line]) if line.same_quota(before) => {
                command.arg("=").arg(now).arg(line.ttl);
                continue;
            }
            (_, [line]) => before = Some(line),
            _ => before = None,
        }
        command.arg(pending.lines.len()).arg(now);
        for line in &pending.lines {
            command
                .arg(line.limit)
                .arg(line.cost)
                .arg(line.anchor)
                .arg(line.ttl)
                .arg(line.end);
        }
    }
    command
}

/// Runs `command`, with the script's text if the server does not know it
/// (an `EVAL`, which also loads it: no `SCRIPT LOAD` that a failover or a
/// `SCRIPT FLUSH` could undo before the call). An error reply to the whole
/// command is an error; errors of single charges stay in the reply.
async fn eval(conn: &mut super::Connection, command: &redis::Cmd) -> Result<Value, RedisError> {
    match top_level(conn.req_packed_command(command).await) {
        Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            top_level(conn.req_packed_command(&with_text(command)).await)
        }
        other => other,
    }
}

/// `command`, an `EVALSHA` of the counters script, as an `EVAL` of its
/// text.
fn with_text(command: &redis::Cmd) -> redis::Cmd {
    let mut eval = redis::cmd("EVAL");
    eval.arg(COUNTERS_LUA);
    for arg in command.args_iter().skip(2) {
        if let redis::Arg::Simple(bytes) = arg {
            eval.arg(bytes);
        }
    }
    eval
}

fn top_level(value: Result<Value, RedisError>) -> Result<Value, RedisError> {
    match value? {
        Value::ServerError(error) => Err(error.into()),
        value => Ok(value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::Semaphore;

    fn pending(lines: &[(&str, i64, &'static str, i64, i64)], now: i64) -> Pending {
        let permit = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        let permit = crate::store::redis::late::Room::new(permit);
        Pending {
            now: Timestamp::from_millisecond(now).unwrap(),
            lines: lines
                .iter()
                .map(|&(key, limit, anchor, ttl, end)| LineArgs {
                    key: PeriodKey::from_string(key.into()),
                    limit,
                    cost: 1,
                    anchor,
                    ttl,
                    end,
                })
                .collect(),
            answer: oneshot::channel().0,
            permit,
            sent: Arc::default(),
        }
    }

    fn args(command: &redis::Cmd) -> Vec<String> {
        command
            .args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                other => panic!("{other:?} in a batch"),
            })
            .collect()
    }

    #[test]
    fn a_charge_of_the_quota_before_is_sent_as_a_repeat() {
        let batch = [
            pending(&[("a", 10, "c", 900, 5000)], 100),
            // The same quota: its instant and ttl only.
            pending(&[("b", 10, "c", 899, 5000)], 101),
            // Two lines: whole, and no charge repeats it.
            pending(&[("c", 10, "c", 898, 5000), ("d", 3, "f", 60, 0)], 102),
            pending(&[("e", 10, "c", 897, 5000)], 103),
            // Another limit: whole; the next one repeats this one.
            pending(&[("f", 20, "c", 896, 5000)], 104),
            pending(&[("g", 20, "c", 895, 5000)], 105),
            // Another window's end.
            pending(&[("h", 20, "c", 894, 6000)], 106),
            // First use: the same anchor and end (0) as the one before.
            pending(&[("i", 20, "f", 60, 0)], 107),
            pending(&[("j", 20, "f", 60, 0)], 108),
        ];
        let got = args(&command(&batch));
        let expected: Vec<&str> = [
            &["EVALSHA", super::super::SCRIPT.get_hash(), "10"][..],
            &["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "b"],
            &["1", "100", "10", "1", "c", "900", "5000"],
            &["=", "101", "899"],
            &[
                "2", "102", "10", "1", "c", "898", "5000", "3", "1", "f", "60", "0",
            ],
            &["1", "103", "10", "1", "c", "897", "5000"],
            &["1", "104", "20", "1", "c", "896", "5000"],
            &["=", "105", "895"],
            &["1", "106", "20", "1", "c", "894", "6000"],
            &["1", "107", "20", "1", "f", "60", "0"],
            &["=", "108", "60"],
        ]
        .concat();
        assert_eq!(got, expected);
    }

    /// A batch the server does not know the script of goes again as an
    /// `EVAL` of the text, its arguments as they were: one call, which a
    /// `SCRIPT FLUSH` cannot come between.
    #[test]
    fn a_batch_goes_again_with_the_scripts_text() {
        let batch = [
            pending(&[("a", 10, "c", 900, 5000)], 100),
            pending(&[("b", 10, "c", 899, 5000)], 101),
        ];
        let sha = command(&batch);
        let text = with_text(&sha);
        let (sha, text) = (args(&sha), args(&text));
        assert_eq!(sha[0], "EVALSHA");
        assert_eq!(text[0], "EVAL");
        assert_eq!(text[1], COUNTERS_LUA);
        assert_eq!(sha[2..], text[2..]);
    }

    fn take(values: Vec<Value>, lines: &[LineArgs]) -> (bool, Result<Reply, RedisError>) {
        split(&mut values.into_iter(), lines)
    }

    #[test]
    fn short_replies_are_widened_to_the_charge_operations_form() {
        let calendar = pending(&[("a", 5, "c", 900, 5000)], 100).lines;
        let first_use = pending(&[("a", 5, "f", 60_000, 0)], 100).lines;
        let int = Value::Int;

        // Calendar, admitted and refused.
        let (applied, reply) = take(vec![int(3), int(2), int(1_796_318_523_929)], &calendar);
        assert!(applied);
        assert_eq!(
            reply.unwrap().as_slice(),
            [1, 2, 3, -3, 1_796_318_523_929, 0]
        );
        let (applied, reply) = take(vec![int(2), int(5), int(7)], &calendar);
        assert!(!applied);
        assert_eq!(reply.unwrap().as_slice(), [0, 5, 0, -3, 7, 0]);
        // First use, its first call as Redis's bulk string.
        let first_call = Value::BulkString(b"1796318523929".to_vec());
        let (applied, reply) = take(vec![int(5), int(1), int(59_000), first_call], &first_use);
        assert!(applied);
        assert_eq!(
            reply.unwrap().as_slice(),
            [1, 1, 4, 59_000, 1_796_318_523_929, 0]
        );
        // The full form, as before.
        let full = [1, 1, 4, 59_000, 7, 0].map(int).to_vec();
        assert_eq!(
            take(full, &first_use).1.unwrap().as_slice(),
            [1, 1, 4, 59_000, 7, 0]
        );
        // An error for the charge: one value, nothing applied.
        let error = redis::parse_redis_value(b"-ERR tower-quota: no counter\r\n").unwrap();
        assert!(matches!(error, Value::ServerError(_)));
        let (applied, reply) = take(vec![error], &calendar);
        assert!(!applied && reply.is_err());
    }

    #[test]
    fn a_short_reply_that_does_not_fit_is_left_for_the_outcome_to_refuse() {
        let calendar = pending(&[("a", 5, "c", 900, 5000)], 100).lines;
        let two = pending(&[("a", 5, "c", 900, 5000), ("b", 5, "c", 900, 5000)], 100).lines;
        let int = Value::Int;
        // Cut short: applied (so given back), and too short for a charge.
        let (applied, reply) = take(vec![int(3)], &calendar);
        assert!(applied);
        assert!(reply.unwrap().len() < 6);
        // A short form for a charge of two lines takes its three values
        // only, so the next charge's reply stays in step.
        let mut values = vec![int(3), int(1), int(7), int(1), int(1)].into_iter();
        let (_, reply) = split(&mut values, &two);
        assert_eq!(reply.unwrap().as_slice(), [1, 7]);
        assert_eq!(values.len(), 2);
        // A value that is no number.
        let (applied, reply) = take(vec![int(3), Value::Nil], &calendar);
        assert!(applied && reply.is_err());
    }
}
