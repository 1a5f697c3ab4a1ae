//! The Redis store against the memory store, through the layer: random
//! scripts of requests (five subjects; calendar and first-use quotas, two
//! allowances, one with a deferred cost and one with a cost the request
//! asks for, two plans and an unknown one, a shadow quota, 500s refunded,
//! requests undone by their handler; alone, or in bursts of different
//! subjects, which the Redis store sends in batches), steps of
//! time (whole seconds, past a first-use minute, past an hour, to a
//! calendar midnight, to a first-use deadline and to the second before it)
//! and support calls (usage, refunds, resets), run on two apps built the
//! same but for the store: a `MemoryStore`, and a `RedisStore` on a real
//! `redis-server` of its own. One instance, a healthy Redis: every status,
//! `RateLimit`, `RateLimit-Policy` and `Retry-After` field, every body (the
//! handler's `QuotaStatus` entries, the problem details of a refusal), and
//! every answer of the support handle must be the same.
//!
//! # Time
//!
//! Both apps read one `ManualClock`, at whole seconds only. Calendar
//! counters follow it as they are (their key names the window, and the
//! counter records its end), but Redis expires first-use counters on its
//! own clock (`PEXPIRE`): so after every step the test moves the deadline
//! of every counter in Redis by what the layer's clock moved less what real
//! time passed since the step before (see `ALIGN`), a Redis clock that
//! follows the layer's. Counters made since the last step are moved a bias
//! of `BIAS_MS` further: Redis then sees every deadline a few hundred
//! milliseconds ahead of the memory store, never behind. That is the
//! documented difference left: the Redis store reports a first-use reset
//! as the counter's remaining life (`PTTL`), which real time shortens; with
//! deadlines at whole seconds, a reset told in whole seconds rounded up
//! (`RateLimit`'s `t`, `Retry-After`, the problem details) is the same, and
//! the handler's entries tell a first-use reset rounded up to the second.
//! And since every instant is a whole second, a counter Redis ends a little
//! early is one the memory store ends at that very instant.
//!
//! `REDIS_DIFF_CASES` sets the number of cases (12 by default, a few
//! seconds; more for a longer search). Skipped without `redis-server`,
//! except under `CI=true`.

#![cfg(feature = "redis")]

mod redis_support;

#[path = "differential/mod.rs"]
mod differential;

use differential::{route, Route};

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use deadpool_redis::redis;
use jiff::{RoundMode, SignedDuration, Timestamp, TimestampRound, Unit};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tower_quota::store::RedisStore;
use tower_quota::{
    Anchor, FromHeader, ManualClock, MemoryStore, QuotaHandle, QuotaPolicy, QuotaUsage, Store,
    Subject,
};

use redis_support::{redis_available, RedisServer};

const SUBJECTS: [&str; 5] = ["acme", "globex", "initech", "umbrella", "hooli"];
const ALLOWANCES: [&str; 4] = ["read", "write", "tokens", "bulk"];
const PLANS: [Option<&str>; 4] = [None, Some("free"), Some("pro"), Some("gold")];

/// Requests refused (both apps), first-use deadlines reached, and bursts
/// sent: what the cases went through.
static REFUSED: AtomicU64 = AtomicU64::new(0);
static DEADLINES: AtomicU64 = AtomicU64::new(0);
static BURSTS: AtomicU64 = AtomicU64::new(0);

/// How far ahead of the layer's clock Redis is kept on counters made since
/// the step before (ms): more than a step takes in real time, less than a
/// second.
const BIAS_MS: i64 = 400;

/// Moves the deadline of every counter (`quota:*`) by what the layer's
/// clock (ARGV[1], ms) moved less what Redis's own moved since the last
/// call, and that of a counter made since then (whose deadline is not the
/// one the last call set, kept in `rdiff:marks`) ARGV[2] ms further; one
/// whose deadline is then past is deleted, as Redis would expire it.
const ALIGN: &str = r"
local clock, bias = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local off = now - clock
local last = tonumber(redis.call('GET', 'rdiff:off') or 'x')
if last ~= nil then
  for _, k in ipairs(redis.call('KEYS', 'quota:*')) do
    local x = redis.call('PEXPIRETIME', k)
    if x > 0 then
      local nx = x + (off - last)
      if tonumber(redis.call('HGET', 'rdiff:marks', k) or 'x') ~= x then
        nx = nx - bias
      end
      if nx <= now then
        redis.call('DEL', k)
        redis.call('HDEL', 'rdiff:marks', k)
      else
        redis.call('PEXPIREAT', k, nx)
        redis.call('HSET', 'rdiff:marks', k, nx)
      end
    end
  end
end
redis.call('SET', 'rdiff:off', off)
return 0
";

fn whole_second(at: Timestamp) -> Timestamp {
    let up = TimestampRound::new()
        .smallest(Unit::Second)
        .mode(RoundMode::Ceil);
    at.round(up).unwrap_or(at)
}

/// Each entry as a client or support tool reads it; a first-use reset
/// rounded up to the second (see the module's docs).
fn describe(entries: &[QuotaUsage]) -> String {
    entries
        .iter()
        .map(|u| {
            let resets_at = match u.quota().anchor() {
                Anchor::FirstUse => whole_second(u.resets_at()),
                _ => u.resets_at(),
            };
            format!(
                "[{} limit={} used={} remaining={} resets_at={} first_call={:?}]",
                u.name(),
                u.limit(),
                u.used(),
                u.remaining(),
                resets_at,
                u.first_call().map(|t| t.to_string()),
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn app<St: Store>(store: St, clock: ManualClock) -> (Router, QuotaHandle<St>) {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .clock(clock)
        // Redis on a loaded CI machine, unoptimised: no store timeout
        // should decide anything here.
        .store_timeout(Some(Duration::from_secs(5)));
    let limits = differential::Limits {
        read_day: [14, 9, 20],
        read_fu: [7, 11],
        read_shadow: 6,
        write_fu: [4, 6],
        tokens_day: 30,
        bulk: Some(([10, 16], 18)),
    };
    differential::app(policy, &limits, describe)
}

#[derive(Clone, Copy, Debug)]
enum Wait {
    /// Past the first-use minute.
    FirstUse,
    /// Past the first-use hour and the shadow quota's window.
    Hour,
    /// To the next midnight (UTC), exactly.
    Midnight,
    /// To the end of the hour (the shadow quota's window), exactly.
    HourEnd,
    /// To the earliest first-use deadline ahead, exactly (on the memory
    /// app's word).
    Deadline,
    /// To the second before it.
    BeforeDeadline,
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Call {
        who: usize,
        route: Route,
        plan: usize,
        gap_s: u8,
    },
    Wait(Wait),
    /// Requests of different subjects at once (one batch of charges on
    /// Redis): each subject's in its place whatever the order.
    Burst {
        calls: [(Route, usize); 5],
        first: usize,
        len: usize,
    },
    Refund {
        who: usize,
        amount: u64,
    },
    RefundAllowance {
        who: usize,
        allowance: usize,
        amount: u64,
    },
    Reset {
        who: usize,
    },
    ResetAllowance {
        who: usize,
        allowance: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let who = 0..SUBJECTS.len();
    prop_oneof![
        40 => (who.clone(), route(true), 0..PLANS.len(), prop_oneof![8 => Just(0u8), 2 => 1u8..3, 1 => 5u8..40])
            .prop_map(|(who, route, plan, gap_s)| Op::Call { who, route, plan, gap_s }),
        6 => prop_oneof![
            Just(Wait::FirstUse),
            Just(Wait::Hour),
            Just(Wait::Midnight),
            Just(Wait::HourEnd),
            Just(Wait::Deadline),
            Just(Wait::BeforeDeadline),
        ]
        .prop_map(Op::Wait),
        4 => (proptest::array::uniform5((route(true), 0..PLANS.len())), 0..SUBJECTS.len(), 2..=SUBJECTS.len())
            .prop_map(|(calls, first, len)| Op::Burst { calls, first, len }),
        1 => (who.clone(), 0u64..8).prop_map(|(who, amount)| Op::Refund { who, amount }),
        1 => (who.clone(), 0..ALLOWANCES.len(), 0u64..8).prop_map(|(who, allowance, amount)| Op::RefundAllowance { who, allowance, amount }),
        1 => who.clone().prop_map(|who| Op::Reset { who }),
        1 => (who, 0..ALLOWANCES.len()).prop_map(|(who, allowance)| Op::ResetAllowance { who, allowance }),
    ]
}

/// `calls[i]` for `whos[i]`, all at once; their answers in that order.
async fn burst(app: &Router, calls: &[(Route, usize); 5], whos: &[usize]) -> String {
    let tasks: Vec<_> = whos
        .iter()
        .zip(calls)
        .map(|(&who, &(route, plan))| {
            let app = app.clone();
            tokio::spawn(async move { ask(&app, route, who, plan).await })
        })
        .collect();
    let mut seen = Vec::new();
    for task in tasks {
        seen.push(task.await.unwrap());
    }
    seen.join(" || ")
}

/// The status, the fields a client reads, and the body.
async fn ask(app: &Router, route: Route, who: usize, plan: usize) -> String {
    differential::ask(app, route, SUBJECTS[who], PLANS[plan]).await
}

/// Where `who` stands, on the default limits and on each plan's.
async fn standing<St: Store>(handle: &QuotaHandle<St>, who: usize) -> String {
    let subject = Subject::account(SUBJECTS[who]);
    let mut seen = String::new();
    for plan in PLANS {
        match handle.usage_on_plan(&subject, plan).await {
            Ok(usage) => seen.push_str(&format!("{plan:?}: {} ", describe(&usage))),
            Err(error) => seen.push_str(&format!("{plan:?}: error {error} ")),
        }
    }
    seen
}

/// The earliest first-use deadline ahead of `now`, of any subject.
async fn next_deadline(handle: &QuotaHandle<MemoryStore>, now: Timestamp) -> Option<Timestamp> {
    let mut next: Option<Timestamp> = None;
    for who in SUBJECTS {
        for usage in handle.usage(&Subject::account(who)).await.unwrap() {
            if usage.quota().anchor() == Anchor::FirstUse
                && usage.first_call().is_some()
                && usage.resets_at() > now
            {
                next = Some(next.map_or(usage.resets_at(), |n| n.min(usage.resets_at())));
            }
        }
    }
    next
}

/// A Redis clock that follows the layer's: see `ALIGN`.
struct Follower {
    conn: redis::aio::MultiplexedConnection,
    script: redis::Script,
    /// When the last step ended, in real time: a step that takes longer
    /// than the bias would let Redis's deadlines fall behind.
    since: Instant,
    longest: Duration,
}

impl Follower {
    async fn align(&mut self, clock: &ManualClock) {
        let longest = self.since.elapsed();
        self.longest = self.longest.max(longest);
        let _: i64 = self
            .script
            .arg(clock.now().as_millisecond())
            .arg(BIAS_MS)
            .invoke_async(&mut self.conn)
            .await
            .expect("the alignment script runs");
        self.since = Instant::now();
    }

    /// A note, when a step took so long that Redis's deadlines may have
    /// fallen behind (the bias no longer covers it): the difference may be
    /// the test's, not the store's.
    fn slow(&self) -> String {
        let bound = Duration::from_millis(BIAS_MS.unsigned_abs());
        if self.longest >= bound {
            format!(
                "\n  (a step took {:?}, past the bias: Redis's deadlines may lag)",
                self.longest
            )
        } else {
            String::new()
        }
    }
}

fn redis_store(url: &str) -> RedisStore {
    // One connection: a burst of more than two charges queues, and leaves
    // in a batch of several.
    RedisStore::builder(url)
        .pool_size(1)
        .timeout(Duration::from_secs(2))
        .wait_timeout(Duration::from_secs(2))
        .connect_timeout(Duration::from_secs(2))
        .build()
        .expect("a Redis store")
}

async fn run(url: &str, ops: &[Op]) -> Result<Duration, String> {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("a plain connection to the test server");
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut conn)
        .await
        .expect("FLUSHALL");
    let mut follower = Follower {
        conn,
        script: redis::Script::new(ALIGN),
        since: Instant::now(),
        longest: Duration::ZERO,
    };
    let start: Timestamp = "2026-12-04T23:58:30Z".parse().unwrap();
    let clock = ManualClock::new(start);
    follower.align(&clock).await;
    let (plain, plain_handle) = app(MemoryStore::new(), clock.clone());
    let (redis_app, redis_handle) = app(redis_store(url), clock.clone());
    for (step, op) in ops.iter().enumerate() {
        let (a, b, who) = match *op {
            Op::Call {
                who,
                route,
                plan,
                gap_s,
            } => {
                let a = ask(&plain, route, who, plan).await;
                let b = ask(&redis_app, route, who, plan).await;
                clock.advance(SignedDuration::from_secs(i64::from(gap_s)));
                (a, b, Some(who))
            }
            Op::Wait(wait) => {
                let now = clock.now();
                let to = match wait {
                    Wait::FirstUse => Some(now + SignedDuration::from_secs(61)),
                    Wait::Hour => Some(now + SignedDuration::from_secs(3_601)),
                    Wait::Midnight => {
                        let day = now.as_second().div_euclid(86_400);
                        Some(Timestamp::from_second((day + 1) * 86_400).unwrap())
                    }
                    Wait::HourEnd => {
                        let hour = now.as_second().div_euclid(3_600);
                        Some(Timestamp::from_second((hour + 1) * 3_600).unwrap())
                    }
                    Wait::Deadline => next_deadline(&plain_handle, now).await,
                    Wait::BeforeDeadline => next_deadline(&plain_handle, now)
                        .await
                        .map(|at| at - SignedDuration::from_secs(1))
                        .filter(|&at| at > now),
                };
                if let Some(to) = to {
                    if matches!(wait, Wait::Deadline) {
                        DEADLINES.fetch_add(1, Ordering::Relaxed);
                    }
                    clock.set(to);
                }
                (String::new(), String::new(), None)
            }
            Op::Burst { calls, first, len } => {
                let whos: Vec<usize> = (0..len).map(|i| (first + i) % SUBJECTS.len()).collect();
                let a = burst(&plain, &calls, &whos).await;
                let b = burst(&redis_app, &calls, &whos).await;
                BURSTS.fetch_add(1, Ordering::Relaxed);
                (a, b, None)
            }
            Op::Refund { who, amount } => {
                let subject = Subject::account(SUBJECTS[who]);
                let a = plain_handle.refund(&subject, amount).await;
                let b = redis_handle.refund(&subject, amount).await;
                (
                    format!("refund {amount}: {a:?}"),
                    format!("refund {amount}: {b:?}"),
                    Some(who),
                )
            }
            Op::RefundAllowance {
                who,
                allowance,
                amount,
            } => {
                let tag = ALLOWANCES[allowance];
                let subject = Subject::account(SUBJECTS[who]);
                let a = plain_handle.refund_allowance(&subject, tag, amount).await;
                let b = redis_handle.refund_allowance(&subject, tag, amount).await;
                (
                    format!("refund {tag} {amount}: {a:?}"),
                    format!("refund {tag} {amount}: {b:?}"),
                    Some(who),
                )
            }
            Op::Reset { who } => {
                let subject = Subject::account(SUBJECTS[who]);
                let a = plain_handle.reset(&subject).await;
                let b = redis_handle.reset(&subject).await;
                (
                    format!("{:?}", a.is_ok()),
                    format!("{:?}", b.is_ok()),
                    Some(who),
                )
            }
            Op::ResetAllowance { who, allowance } => {
                let subject = Subject::account(SUBJECTS[who]);
                let tag = ALLOWANCES[allowance];
                let a = plain_handle.reset_allowance(&subject, tag).await;
                let b = redis_handle.reset_allowance(&subject, tag).await;
                (format!("{a:?}"), format!("{b:?}"), Some(who))
            }
        };
        follower.align(&clock).await;
        let refused = a.matches("429 Too Many Requests").count();
        REFUSED.fetch_add(refused as u64, Ordering::Relaxed);
        if a != b {
            return Err(format!(
                "step {step} {op:?} at {}:\n  memory: {a}\n  redis:  {b}{}",
                clock.now(),
                follower.slow()
            ));
        }
        for who in who.into_iter().chain(0..SUBJECTS.len()) {
            let (a, b) = (
                standing(&plain_handle, who).await,
                standing(&redis_handle, who).await,
            );
            if a != b {
                return Err(format!(
                    "step {step} {op:?} at {}: {}'s standing\n  memory: {a}\n  redis:  {b}{}",
                    clock.now(),
                    SUBJECTS[who],
                    follower.slow()
                ));
            }
        }
    }
    Ok(follower.longest)
}

#[test]
fn one_instance_sees_the_same_on_redis_as_in_memory() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let url = server.url();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cases = std::env::var("REDIS_DIFF_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(12);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let longest = std::cell::Cell::new(Duration::ZERO);
    let result = runner.run(&proptest::collection::vec(op(), 1..120), |ops| {
        let step = runtime
            .block_on(run(&url, &ops))
            .map_err(TestCaseError::fail)?;
        longest.set(longest.get().max(step));
        Ok(())
    });
    if let Err(error) = result {
        panic!("{error}");
    }
    let (refused, deadlines) = (
        REFUSED.load(Ordering::Relaxed),
        DEADLINES.load(Ordering::Relaxed),
    );
    assert!(refused > 0, "requests were refused");
    eprintln!(
        "refused: {refused}; first-use deadlines reached: {deadlines}; bursts: {}; longest step: {:?}",
        BURSTS.load(Ordering::Relaxed),
        longest.get()
    );
}
