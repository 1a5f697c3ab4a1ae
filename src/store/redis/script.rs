//! The counters script, what it takes and what its replies mean.

use std::sync::LazyLock;
use std::time::Duration;

use deadpool_redis::redis::{
    self, ErrorKind, FromRedisValue, Script, ServerErrorKind, ToRedisArgs, Value,
};
use jiff::{SignedDuration, Timestamp};

use smallvec::SmallVec;

use super::connection::{Connection, Redirect};
use crate::key::PeriodKey;
use crate::store::{
    ChargeOutcome, ChargeRequest, Lifetime, Made, StoreError, StoreErrorKind, Usage,
};

/// The counters script: check-then-commit for charges, plus peek, refund,
/// add and the server's time, so that one SHA serves every call.
pub(super) const COUNTERS_LUA: &str = include_str!("counters.lua");

/// The script, for every store: calls hold it in tasks of their own.
pub(super) static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(COUNTERS_LUA));

/// A call of the counters script: its keys and arguments, as
/// `redis::ScriptInvocation` takes them, sent as `EVALSHA`. A server that
/// does not know the script (restarted, flushed) is sent `EVAL` with its
/// text, which runs it and keeps it: routed by the keys, as `EVALSHA` is,
/// so that on a cluster only the node that holds them is asked. (redis-rs
/// sends a `SCRIPT LOAD` to every node instead, which one node that does
/// not answer fails for all.)
#[derive(Clone, Default)]
pub(super) struct Invocation {
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Invocation {
    /// A call on `key`.
    pub(super) fn on(key: &str) -> Self {
        let mut call = Self::default();
        call.key(key);
        call
    }

    pub(super) fn key(&mut self, key: &str) -> &mut Self {
        self.keys.push(key.as_bytes().to_vec());
        self
    }

    pub(super) fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        arg.write_redis_args(&mut self.args);
        self
    }

    /// A refund (`op` `r`) or an add (`a`) of `amount` at `now` on the
    /// counter at `key` that `made` names, as the script takes it.
    pub(super) fn change(
        op: &str,
        key: &PeriodKey,
        amount: u64,
        now: Timestamp,
        made: Made,
    ) -> Self {
        let mut call = Self::on(key.as_str());
        call.arg(op).arg(amount).arg(now.as_millisecond());
        match made {
            Made::Any => {}
            Made::By(made_by) => {
                // Whole milliseconds, rounded up: a counter made within the
                // same millisecond is the one charged.
                let ms = made_by
                    .round(
                        jiff::TimestampRound::new()
                            .smallest(jiff::Unit::Millisecond)
                            .mode(jiff::RoundMode::Ceil),
                    )
                    .unwrap_or(made_by);
                call.arg(ms.as_millisecond().max(0));
            }
            // A first call the script reported: whole milliseconds.
            Made::At(first_call) => {
                call.arg(first_call.as_millisecond().max(0)).arg("exact");
            }
        }
        call
    }

    fn command(&self, verb: &str, script: &str) -> redis::Cmd {
        let mut command = redis::cmd(verb);
        command
            .arg(script)
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
        command
    }

    /// Runs the script on `conn`, whose node knows it as `SCRIPT` or not
    /// at all. On a cluster whose slot of the call's keys moves (a
    /// resharding), the call goes where the slot's node tells it to go
    /// (`MOVED`, `ASK`; [`MAX_REDIRECTS`] in a row at most), and is sent
    /// again a moment later while its keys are on both nodes (`TRYAGAIN`,
    /// for [`TRY_AGAIN_FOR`] at most, or until the caller stops waiting): a
    /// node answers those before it runs anything, so a call sent again is
    /// never applied twice.
    pub(super) async fn invoke_async<T: FromRedisValue>(
        &self,
        conn: &mut Connection,
    ) -> redis::RedisResult<T> {
        let mut redirect = None;
        let mut redirects = 0;
        let mut wait = FIRST_TRY_AGAIN_WAIT;
        let mut waited = Duration::ZERO;
        loop {
            let error = match self.run(conn, redirect.as_ref()).await {
                Err(error) if conn.is_cluster() => error,
                reply => return Ok(T::from_redis_value(reply?)?),
            };
            match Redirect::of(&error) {
                Some(to) if redirects < MAX_REDIRECTS => {
                    redirects += 1;
                    redirect = Some(to);
                }
                None if error.kind() == ErrorKind::Server(ServerErrorKind::TryAgain)
                    && waited < TRY_AGAIN_FOR =>
                {
                    // The slot's node says again where the call goes.
                    redirect = None;
                    redirects = 0;
                    tokio::time::sleep(wait).await;
                    waited += wait;
                    wait = (wait * 2).min(MAX_TRY_AGAIN_WAIT);
                }
                _ => return Err(error),
            }
        }
    }

    /// The script's reply from the node `at` alone: a redirect it answers
    /// is not followed, but returned as the error it is.
    pub(super) async fn invoke_at<T: FromRedisValue>(
        &self,
        conn: &mut Connection,
        at: &Redirect,
    ) -> redis::RedisResult<T> {
        Ok(T::from_redis_value(self.run(conn, Some(at)).await?)?)
    }

    /// The script's reply on `conn`, sent where `redirect` says, or by its
    /// keys.
    async fn run(
        &self,
        conn: &mut Connection,
        redirect: Option<&Redirect>,
    ) -> redis::RedisResult<Value> {
        let sha = self.command("EVALSHA", SCRIPT.get_hash());
        match send(conn, &sha, redirect).await {
            Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                send(conn, &self.command("EVAL", COUNTERS_LUA), redirect).await
            }
            other => other,
        }
    }
}

async fn send(
    conn: &mut Connection,
    command: &redis::Cmd,
    redirect: Option<&Redirect>,
) -> redis::RedisResult<Value> {
    match redirect {
        None => command.query_async(conn).await,
        Some(to) => conn.redirected(command, to).await,
    }
}

/// Redirects in a row a call follows; the next answer is its own. (A slot
/// moves once at a time: one `ASK` or `MOVED` is the usual case.)
const MAX_REDIRECTS: usize = 4;

/// How long a call answered `TRYAGAIN` is sent again: the keys of a slot
/// move in batches, the rest follow in milliseconds; a move stuck half
/// way (its tool stopped) is the operator's to finish.
pub(super) const TRY_AGAIN_FOR: Duration = Duration::from_secs(1);

/// The wait before a call answered `TRYAGAIN` is sent again, twice as long
/// each time up to `MAX_TRY_AGAIN_WAIT`.
const FIRST_TRY_AGAIN_WAIT: Duration = Duration::from_millis(1);
const MAX_TRY_AGAIN_WAIT: Duration = Duration::from_millis(10);

/// Fields per line in the script's reply.
pub(super) const FIELDS: usize = 5;

/// The key that routes the server-time call on a cluster; never written.
pub(super) const CLOCK_KEY: &str = "tower-quota:{clock}";

/// The outcome of `request` from the script's reply to operation `op`.
pub(super) fn outcome(
    op: &str,
    request: &ChargeRequest,
    reply: &[i64],
) -> Result<ChargeOutcome, StoreError> {
    let charged = request.charged();
    if reply.len() != 1 + FIELDS * request.lines.len() {
        return Err(unexpected(format!(
            "{} values for {} lines",
            reply.len(),
            request.lines.len()
        )));
    }
    let admitted = match reply[0] {
        1 => true,
        0 => false,
        other => return Err(unexpected(format!("{other} as the admission"))),
    };
    let usage = request
        .lines
        .iter()
        .zip(reply[1..].chunks_exact(FIELDS))
        .map(|(line, fields)| {
            // `remaining` is for other readers of the script's reply;
            // `Usage` works it out from the limit.
            let &[used, _remaining, pttl, first_call, heal] = fields else {
                unreachable!("chunks of {FIELDS}")
            };
            let key = &line.key;
            let used = u64::try_from(used)
                .map_err(|_| unexpected(format!("{used} as the count of {}", key.logged())))?;
            if !(0..=4).contains(&heal) {
                return Err(unexpected(format!(
                    "{heal} as the heal of {}",
                    key.logged()
                )));
            }
            if heal != 0 {
                log_heal(key, heal, op == "c");
            }
            // -3: a calendar counter's deadline, not read.
            let calendar = matches!(line.lifetime, Lifetime::Calendar { .. });
            if pttl < 0 && pttl != -2 && !(pttl == -3 && calendar) {
                return Err(unexpected(format!(
                    "{pttl} as the life of {}",
                    key.logged()
                )));
            }
            let first_call = match first_call {
                -1 => None,
                ms => Some(Timestamp::from_millisecond(ms).map_err(|_| {
                    unexpected(format!("{ms} as the first call of {}", key.logged()))
                })?),
            };
            Ok(match line.lifetime {
                Lifetime::Calendar { end, .. } => Usage {
                    held_elsewhere_until: None,
                    counted_at: None,
                    limit: line.limit,
                    used,
                    resets_at: end,
                    first_call,
                },
                Lifetime::FirstUse { deadline } => Usage {
                    held_elsewhere_until: None,
                    counted_at: None,
                    limit: line.limit,
                    used,
                    // The life left when Redis ran the charge, counted from
                    // when it was made.
                    resets_at: if pttl >= 0 {
                        charged
                            .saturating_add(SignedDuration::from_millis(pttl))
                            .unwrap_or(deadline)
                    } else {
                        deadline
                    },
                    first_call,
                },
            })
        })
        .collect::<Result<_, StoreError>>()?;
    Ok(ChargeOutcome { admitted, usage })
}

/// The answer to a charge taking units beyond its costs (`x`): the
/// charge's, then the units each line took, none when refused, never more
/// than asked.
pub(super) fn taken_outcome(
    request: &ChargeRequest,
    extra: &[u64],
    reply: &[i64],
) -> Result<(ChargeOutcome, SmallVec<[u64; 2]>), StoreError> {
    let n = request.lines.len();
    if reply.len() != 1 + (FIELDS + 1) * n {
        return Err(unexpected(format!(
            "{} values for {n} lines taking units",
            reply.len()
        )));
    }
    let (charge, taken) = reply.split_at(1 + FIELDS * n);
    let outcome = outcome("c", request, charge)?;
    let taken = taken
        .iter()
        .zip(extra)
        .map(|(&units, &asked)| match u64::try_from(units) {
            Ok(units) if units <= asked && (outcome.admitted || units == 0) => Ok(units),
            _ => Err(unexpected(format!("{units} units taken of {asked}"))),
        })
        .collect::<Result<_, StoreError>>()?;
    Ok((outcome, taken))
}

/// Logs a counter found without a deadline; by its key without the
/// subject's id (see the hash module).
pub(super) fn log_heal(key: &PeriodKey, heal: i64, charging: bool) {
    let what = match heal {
        1 => "dated to its first call plus one period",
        2 => "dated to one period from now (its first call is unknown)",
        3 => "ended (its period was over)",
        4 => "given its housekeeping deadline",
        _ => "healed",
    };
    if charging {
        crate::metrics::healed();
        tracing::warn!(key = key.logged(), "quota counter had no deadline; {what}");
    } else {
        tracing::warn!(
            key = key.logged(),
            "quota counter has no deadline; the next charge heals it"
        );
    }
}

/// A reply of the counters script that makes no sense: a store error, never
/// a guess.
pub(super) fn unexpected(what: String) -> StoreError {
    StoreError::new(
        StoreErrorKind::Other,
        format!("unexpected reply from the counters script: {what}"),
    )
}

/// The script's answer to a refund or an add: the count afterwards, or -1
/// when there is no live counter.
pub(super) fn live_count(key: &PeriodKey, op: &str, reply: i64) -> Result<Option<u64>, StoreError> {
    match reply {
        -1 => Ok(None),
        n => u64::try_from(n)
            .map(Some)
            .map_err(|_| unexpected(format!("{n} as the count of {} after {op}", key.logged()))),
    }
}

pub(super) fn millis_until(now: Timestamp, then: Timestamp) -> i64 {
    // PEXPIRE needs a positive duration; a deadline in the past ends the
    // counter at once.
    (then.as_millisecond() - now.as_millisecond()).max(1)
}

pub(super) fn as_millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The largest limit and cost the script decides on exactly: Lua adds and
/// compares in doubles, and `used + cost <= limit` holds exactly while the
/// limit is below 2^53 (a sum past it rounds to at least 2^53, still over
/// the limit).
pub(crate) const MAX_EXACT: u64 = (1 << 53) - 1;

/// What a refund of `amount` sends: at most 2^53, as more than a counter
/// can hold empties it all the same.
pub(super) fn refund_amount(amount: u64) -> u64 {
    amount.min(1 << 53)
}

/// Counts travel as Redis integers. Larger limits and costs are refused
/// before they reach the store, but for a shadow quota's, which has none:
/// sent as the largest exact one, as good as unlimited.
pub(super) fn clamp(n: u64) -> i64 {
    i64::try_from(n.min(MAX_EXACT)).expect("2^53 fits in an i64")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_invocation_names_its_keys_then_its_arguments() {
        let mut call = Invocation::on("a{x}");
        call.arg("c").arg(5_i64).key("b{x}").arg("r");
        let packed = call
            .command("EVALSHA", SCRIPT.get_hash())
            .get_packed_command();
        let text = String::from_utf8(packed).unwrap();
        let words: Vec<&str> = text
            .split("\r\n")
            .filter(|w| !w.starts_with(['*', '$']))
            .collect();
        assert_eq!(
            words,
            [
                "EVALSHA",
                SCRIPT.get_hash(),
                "2",
                "a{x}",
                "b{x}",
                "c",
                "5",
                "r",
                ""
            ]
        );
    }

    #[test]
    fn deadlines_in_the_past_end_at_once() {
        let now = Timestamp::from_second(1_000).unwrap();
        assert_eq!(millis_until(now, Timestamp::from_second(999).unwrap()), 1);
        assert_eq!(
            millis_until(now, Timestamp::from_second(1_002).unwrap()),
            2_000
        );
    }
}
