//! What the counters script writes, watched on a real `redis-server`
//! through keyspace notifications: every write to a key (`HSET`, `HINCRBY`,
//! `PEXPIRE`, `DEL`, ...) is an event naming the key and the command, made
//! inside the script as well, in the order the writes happen. With each
//! key's TTL before and after, they show what each call does to a counter,
//! whatever the script's text.

#![cfg(feature = "redis")]

mod redis_support;

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use deadpool_redis::redis::{self, AsyncCommands};
use tower_quota::jiff::{SignedDuration, Timestamp};
use tower_quota::store::{ChargeLine, ChargeRequest, Lifetime, RedisStore, Store};
use tower_quota::{Namespace, PeriodKey, Subject};

use redis_support::RedisServer;

/// The writes a server makes, key by key, as keyspace notifications tell
/// them.
struct Writes {
    events: Receiver<(String, String)>,
    fence: redis::Connection,
    fences: u64,
}

impl Writes {
    /// Turns on keyspace notifications of every write and starts listening.
    fn watch(server: &RedisServer) -> Self {
        let client = redis::Client::open(server.url()).unwrap();
        let mut fence = client.get_connection().unwrap();
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("notify-keyspace-events")
            .arg("KA")
            .query(&mut fence)
            .unwrap();
        let (sender, events) = std::sync::mpsc::channel();
        let (ready, subscribed) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut conn = client.get_connection().unwrap();
            let mut pubsub = conn.as_pubsub();
            pubsub.psubscribe("__keyspace@0__:*").unwrap();
            pubsub.subscribe("fence").unwrap();
            ready.send(()).unwrap();
            // Ends when the server goes away with its test.
            while let Ok(message) = pubsub.get_message() {
                let channel = message.get_channel_name().to_owned();
                let key = channel
                    .strip_prefix("__keyspace@0__:")
                    .unwrap_or(&channel)
                    .to_owned();
                let payload: String = message.get_payload().unwrap();
                if sender.send((key, payload)).is_err() {
                    return;
                }
            }
        });
        subscribed
            .recv_timeout(Duration::from_secs(5))
            .expect("subscribed to keyspace notifications");
        Self {
            events,
            fence,
            fences: 0,
        }
    }

    /// Every write made since the last call, as (key, command), in order.
    /// A message published after them marks their end.
    fn take(&mut self) -> Vec<(String, String)> {
        self.fences += 1;
        let mark = self.fences.to_string();
        let _receivers: i64 = redis::cmd("PUBLISH")
            .arg("fence")
            .arg(&mark)
            .query(&mut self.fence)
            .unwrap();
        let mut writes = Vec::new();
        loop {
            match self.events.recv_timeout(Duration::from_secs(5)) {
                Ok((channel, payload)) if channel == "fence" => {
                    if payload == mark {
                        return writes;
                    }
                }
                Ok(write) => writes.push(write),
                Err(RecvTimeoutError::Timeout) => panic!("no fence after {writes:?}"),
                Err(RecvTimeoutError::Disconnected) => panic!("the listener stopped"),
            }
        }
    }

    /// The commands written to `key` since the last call; writes to other
    /// keys are left out.
    fn on(&mut self, key: &PeriodKey) -> Vec<String> {
        self.take()
            .into_iter()
            .filter(|(k, _)| k == key.as_str())
            .map(|(_, command)| command)
            .collect()
    }
}

/// A store on `server`, with batches of charges or without (then every
/// charge is one call of the script's charge operation; with them, a lone
/// one-line charge takes the script's short path).
fn store(server: &RedisServer, batch: bool) -> RedisStore {
    RedisStore::builder(server.url())
        .timeout(Duration::from_secs(2))
        .batch_charges(batch)
        .build()
        .expect("a Redis store")
}

async fn client(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

fn key(id: &str, allowance: &str) -> PeriodKey {
    Namespace::new("script").key(&Subject::account(id), allowance, "PT1H")
}

fn first_use(key: &PeriodKey, limit: u64, cost: u64, now: Timestamp) -> ChargeLine {
    ChargeLine {
        key: key.clone(),
        limit,
        cost,
        lifetime: Lifetime::FirstUse {
            deadline: now + SignedDuration::from_hours(1),
        },
        shadow_limit: None,
    }
}

fn calendar(
    key: &PeriodKey,
    limit: u64,
    cost: u64,
    start: Timestamp,
    end: Timestamp,
) -> ChargeLine {
    ChargeLine {
        key: key.clone(),
        limit,
        cost,
        lifetime: Lifetime::Calendar { start, end },
        shadow_limit: None,
    }
}

async fn charge(store: &RedisStore, now: Timestamp, lines: Vec<ChargeLine>) -> bool {
    store
        .charge(ChargeRequest {
            charged_at: None,
            now,
            lines: lines.into(),
        })
        .await
        .expect("the charge is answered")
        .admitted
}

async fn pttl(redis: &mut redis::aio::MultiplexedConnection, key: &PeriodKey) -> i64 {
    redis.pttl(key.as_str()).await.unwrap()
}

/// Every counter a charge creates gets its deadline in the same call, and
/// the charges after write nothing but the count: no deadline set, moved
/// or dropped, on the short path, in a batch, and in a charge of several
/// lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_creates_a_counter_with_its_deadline_and_then_writes_only_the_count() {
    let server = redis_server_or_skip!();
    let mut redis = client(&server).await;
    let mut writes = Writes::watch(&server);
    for batch in [true, false] {
        let store = store(&server, batch);
        let id = format!("create-{batch}");
        let (once, daily, other) = (key(&id, "once"), key(&id, "daily"), key(&id, "other"));
        let now = Timestamp::now();
        let end = now + SignedDuration::from_hours(2);

        // Created: the count and first call or window end, then the
        // deadline, in the call that creates it.
        assert!(charge(&store, now, vec![first_use(&once, 10, 1, now)]).await);
        assert_eq!(writes.on(&once), ["hset", "expire"], "batch {batch}");
        let once_ttl = pttl(&mut redis, &once).await;
        assert!((3_590_000..=3_600_000).contains(&once_ttl), "{once_ttl}");
        assert!(charge(&store, now, vec![calendar(&daily, 10, 1, now, end)]).await);
        assert_eq!(writes.on(&daily), ["hset", "expire"], "batch {batch}");
        let daily_ttl = pttl(&mut redis, &daily).await;
        assert!(daily_ttl >= 7_190_000, "past the window's end: {daily_ttl}");

        // Charged again, alone: the count only.
        assert!(charge(&store, now, vec![first_use(&once, 10, 2, now)]).await);
        assert_eq!(writes.on(&once), ["hincrby"], "batch {batch}");
        assert!(charge(&store, now, vec![calendar(&daily, 10, 2, now, end)]).await);
        assert_eq!(writes.on(&daily), ["hincrby"], "batch {batch}");

        // Together, with a counter to create: each existing one is written
        // its count, the new one its fields and deadline.
        let lines = vec![
            first_use(&once, 10, 1, now),
            calendar(&daily, 10, 1, now, end),
            first_use(&other, 10, 1, now),
        ];
        assert!(charge(&store, now, lines).await);
        let mut by_key = writes.take();
        by_key.sort_by(|a, b| a.0.cmp(&b.0));
        let expected = |key: &PeriodKey, commands: &[&str]| {
            commands
                .iter()
                .map(|c| (key.as_str().to_owned(), (*c).to_owned()))
                .collect::<Vec<_>>()
        };
        let mut wanted = [
            expected(&once, &["hincrby"]),
            expected(&daily, &["hincrby"]),
            expected(&other, &["hset", "expire"]),
        ]
        .concat();
        wanted.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(by_key, wanted, "batch {batch}");

        // Deadlines as set at creation, never pushed forward.
        assert!(pttl(&mut redis, &once).await <= once_ttl);
        assert!(pttl(&mut redis, &daily).await <= daily_ttl);
        let fields: Vec<(String, i64)> = redis.hgetall(once.as_str()).await.unwrap();
        assert!(fields.contains(&("n".to_owned(), 4)), "{fields:?}");
    }

    // Many charges at once, sent in batches: still the count only.
    let store = store(&server, true);
    let now = Timestamp::now();
    let keys: Vec<PeriodKey> = (0..8).map(|i| key(&format!("many-{i}"), "read")).collect();
    for key in &keys {
        assert!(charge(&store, now, vec![first_use(key, 1_000, 1, now)]).await);
    }
    writes.take();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..64 {
        let (store, key) = (store.clone(), keys[i % keys.len()].clone());
        tasks.spawn(async move { charge(&store, now, vec![first_use(&key, 1_000, 1, now)]).await });
    }
    while let Some(admitted) = tasks.join_next().await {
        assert!(admitted.unwrap());
    }
    let written = writes.take();
    assert_eq!(written.len(), 64, "{written:?}");
    assert!(written.iter().all(|(_, c)| c == "hincrby"), "{written:?}");
}

/// A peek, a refused charge and a charge that fails count nothing, on any
/// key of the request: no count, no counter created. A peek and a failed
/// charge write nothing at all; a refused charge writes one thing: the
/// deadline of an undated counter it found (healed, so that one at its
/// limit does not refuse for ever).
#[tokio::test]
async fn a_peek_a_refused_charge_and_a_failed_one_write_nothing() {
    let server = redis_server_or_skip!();
    let mut redis = client(&server).await;
    let mut writes = Writes::watch(&server);
    for batch in [true, false] {
        let store = store(&server, batch);
        let id = format!("refused-{batch}");
        let (roomy, tight, fresh, undated, daily) = (
            key(&id, "roomy"),
            key(&id, "tight"),
            key(&id, "fresh"),
            key(&id, "undated"),
            key(&id, "daily"),
        );
        let now = Timestamp::now();
        let end = now + SignedDuration::from_hours(2);
        assert!(charge(&store, now, vec![first_use(&roomy, 10, 1, now)]).await);
        assert!(charge(&store, now, vec![first_use(&tight, 1, 1, now)]).await);
        assert!(charge(&store, now, vec![calendar(&daily, 10, 1, now, end)]).await);
        let first_call = (now - SignedDuration::from_mins(10)).as_millisecond();
        let () = redis
            .hset_multiple(undated.as_str(), &[("n", 1), ("t", first_call)])
            .await
            .unwrap();
        writes.take();

        let lines = |cost| {
            vec![
                first_use(&roomy, 10, cost, now),
                calendar(&daily, 10, cost, now, end),
                first_use(&fresh, 10, cost, now),
                first_use(&undated, 10, cost, now),
                first_use(&tight, 1, cost, now),
            ]
        };
        let peeked = store
            .peek(ChargeRequest {
                charged_at: None,
                now,
                lines: lines(1).into(),
            })
            .await
            .unwrap();
        assert_eq!(peeked.len(), 5);
        assert!(writes.take().is_empty(), "a peek wrote");

        assert!(!charge(&store, now, lines(1)).await);
        assert_eq!(
            writes.take(),
            [(undated.as_str().to_owned(), "expire".to_owned())],
            "a refused charge wrote more than the undated counter's heal"
        );
        assert!(!charge(&store, now, vec![first_use(&tight, 1, 1, now)]).await);
        assert!(writes.take().is_empty(), "a refused one-line charge wrote");
        let over = first_use(&fresh, 1, 2, now);
        assert!(!charge(&store, now, vec![over]).await);
        assert!(
            writes.take().is_empty(),
            "a charge over the limit of a new counter wrote"
        );
        let exists: bool = redis.exists(fresh.as_str()).await.unwrap();
        assert!(!exists, "a refused charge created a counter");
        let healed = pttl(&mut redis, &undated).await;
        assert!(
            (2_999_000..=3_000_000).contains(&healed),
            "a refused charge dates the undated counter to its first call plus one period: {healed}"
        );

        // A value that is no counter, on the last line: an error, and
        // nothing written on the lines before it.
        let foreign = key(&id, "foreign");
        let () = redis.set(foreign.as_str(), "text").await.unwrap();
        writes.take();
        let mut failing = lines(0);
        failing.truncate(4);
        for line in &mut failing {
            line.cost = 1;
        }
        failing.push(first_use(&foreign, 10, 1, now));
        let failed = store
            .charge(ChargeRequest {
                charged_at: None,
                now,
                lines: failing.into(),
            })
            .await;
        assert!(failed.is_err(), "{failed:?}");
        assert!(writes.take().is_empty(), "a failed charge wrote");

        // Admitted: each line written (the undated counter, healed by the
        // refusal, is counted on).
        let mut admitted = lines(1);
        admitted.pop();
        assert!(charge(&store, now, admitted).await);
        let written = writes.take();
        let on = |key: &PeriodKey| {
            written
                .iter()
                .filter(|(k, _)| k == key.as_str())
                .map(|(_, c)| c.as_str())
                .collect::<Vec<_>>()
        };
        assert_eq!(on(&roomy), ["hincrby"]);
        assert_eq!(on(&daily), ["hincrby"]);
        assert_eq!(on(&fresh), ["hset", "expire"]);
        assert_eq!(on(&undated), ["hincrby"], "{written:?}");
        let healed = pttl(&mut redis, &undated).await;
        // First call ten minutes ago, a period of an hour.
        assert!((2_990_000..=3_000_000).contains(&healed), "{healed}");
    }
}

/// A refund and an add write the count of a live counter and nothing else
/// (but the mark a refund leaves on a first-use counter that records its
/// first call): no deadline set, moved or dropped (an undated counter stays undated),
/// and on a key without a live counter (none, or a calendar counter whose
/// window ended, kept through its grace) they write nothing at all.
#[tokio::test]
async fn a_refund_and_an_add_write_only_the_count_of_a_live_counter() {
    let server = redis_server_or_skip!();
    let store = store(&server, true);
    let mut redis = client(&server).await;
    let mut writes = Writes::watch(&server);
    let now = Timestamp::now();
    let end = now + SignedDuration::from_hours(2);
    let (hash, string, undated, daily, missing) = (
        key("change", "hash"),
        key("change", "string"),
        key("change", "undated"),
        key("change", "daily"),
        key("change", "missing"),
    );
    assert!(charge(&store, now, vec![first_use(&hash, 10, 5, now)]).await);
    assert!(charge(&store, now, vec![calendar(&daily, 10, 5, now, end)]).await);
    let () = redis.pset_ex(string.as_str(), 5, 3_600_000).await.unwrap();
    let () = redis.hset(undated.as_str(), "n", 5).await.unwrap();
    writes.take();

    for (key, written) in [
        // A first-use counter is marked by a refund (see the script's `k`).
        (&hash, &["hset", "hincrby", "hincrby"][..]),
        (&daily, &["hincrby", "hincrby"]),
        (&string, &["incrby", "incrby"]),
        (&undated, &["hincrby", "hincrby"]),
    ] {
        let before = pttl(&mut redis, key).await;
        assert_eq!(store.refund(now, key.clone(), 2).await.unwrap(), Some(3));
        assert_eq!(store.add(now, key.clone(), 4).await.unwrap(), Some(7));
        assert_eq!(writes.on(key), written, "{key}");
        let after = pttl(&mut redis, key).await;
        if before == -1 {
            assert_eq!(after, -1, "{key}: a deadline was set");
        } else {
            assert!(
                (0..=before).contains(&after),
                "{key}: {before} then {after}"
            );
        }
    }

    // No live counter: nothing written, nothing created.
    assert_eq!(store.refund(now, missing.clone(), 1).await.unwrap(), None);
    assert_eq!(store.add(now, missing.clone(), 1).await.unwrap(), None);
    let exists: bool = redis.exists(missing.as_str()).await.unwrap();
    assert!(!exists, "a refund or an add created a counter");
    let past_the_end = end + SignedDuration::from_secs(1);
    assert_eq!(
        store.refund(past_the_end, daily.clone(), 1).await.unwrap(),
        None
    );
    assert_eq!(
        store.add(past_the_end, daily.clone(), 1).await.unwrap(),
        None
    );
    // Beyond what the script counts exactly: refused before writing.
    assert!(store.add(now, hash.clone(), 1 << 53).await.is_err());
    assert!(writes.take().is_empty(), "wrote without a live counter");
}

/// A give-back at a first-use counter's first call of all it holds
/// deletes the counter, whether the script reads it on its short path
/// (fields in the order it writes them) or its full one (another order):
/// the period it opened spent nothing. A calendar counter, a hash without
/// a first call, a first-use counter given back more than it holds, and
/// one emptied by a plain refund stay.
#[tokio::test]
async fn an_exact_give_back_that_empties_a_first_use_counter_deletes_it() {
    let server = redis_server_or_skip!();
    let store = store(&server, true);
    let mut redis = client(&server).await;
    let now = Timestamp::now();
    let ms = now.as_millisecond();
    let at = Timestamp::from_millisecond(ms).unwrap();
    let end = now + SignedDuration::from_hours(2);
    let (short, full, daily, untimed, refunded) = (
        key("emptied", "short"),
        key("emptied", "full"),
        key("emptied", "daily"),
        key("emptied", "untimed"),
        key("emptied", "refunded"),
    );
    assert!(charge(&store, now, vec![first_use(&short, 10, 2, now)]).await);
    assert!(charge(&store, now, vec![first_use(&refunded, 10, 2, now)]).await);
    assert!(charge(&store, now, vec![calendar(&daily, 10, 2, now, end)]).await);
    let () = redis
        .hset_multiple(full.as_str(), &[("t", ms), ("n", 2)])
        .await
        .unwrap();
    let () = redis.pexpire(full.as_str(), 3_600_000).await.unwrap();
    let () = redis.hset(untimed.as_str(), "n", 2).await.unwrap();
    for key in [&short, &full] {
        assert_eq!(
            store.refund_made_at(now, key.clone(), 1, at).await.unwrap(),
            Some(1)
        );
        let exists: bool = redis.exists(key.as_str()).await.unwrap();
        assert!(exists, "{key}: units still spent");
        assert_eq!(
            store.refund_made_at(now, key.clone(), 1, at).await.unwrap(),
            Some(0)
        );
        let exists: bool = redis.exists(key.as_str()).await.unwrap();
        assert!(
            !exists,
            "{key}: a first-use counter given back all it holds stays"
        );
    }
    // More than it holds: a refund capped at zero, which leaves it.
    let () = redis
        .hset_multiple(full.as_str(), &[("n", 1), ("t", ms)])
        .await
        .unwrap();
    let () = redis.pexpire(full.as_str(), 3_600_000).await.unwrap();
    for key in [&daily, &untimed, &full] {
        assert_eq!(
            store.refund_made_at(now, key.clone(), 2, at).await.unwrap(),
            Some(0)
        );
        let exists: bool = redis.exists(key.as_str()).await.unwrap();
        assert!(
            exists,
            "{key}: a calendar counter, one without a first call, or one given back more than it holds, went"
        );
    }
    assert_eq!(
        store
            .refund_made_by(now, refunded.clone(), 2, at)
            .await
            .unwrap(),
        Some(0)
    );
    let exists: bool = redis.exists(refunded.as_str()).await.unwrap();
    assert!(exists, "a plain refund deleted the counter it emptied");
}

/// What a charge answers, as a test compares it: admitted, and per line
/// the limit, the count and the first call.
type Answer = (bool, Vec<(u64, u64, Option<Timestamp>)>);

async fn answer(store: &RedisStore, now: Timestamp, lines: Vec<ChargeLine>) -> Answer {
    let outcome = store
        .charge(ChargeRequest {
            charged_at: None,
            now,
            lines: lines.into(),
        })
        .await
        .expect("the charge is answered");
    let usage = outcome
        .usage
        .iter()
        .map(|u| (u.limit, u.used, u.first_call))
        .collect();
    (outcome.admitted, usage)
}

/// A charge of two lines (a leased block's charge and its lease mark)
/// answers alike in a batch (the script's `b`) and on its own (`c`),
/// whatever the counters hold: both there, one missing and read for
/// nothing or created, a refusal, the limit reached, one key twice, a
/// first-use period over, a calendar window past its end, a first-use
/// counter without a deadline. The two stores charge twin counters
/// (another subject each), step by step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charge_of_two_lines_answers_alike_in_a_batch_and_alone() {
    let server = RedisServer::start();
    let stores = [store(&server, true), store(&server, false)];
    let mut redis = client(&server).await;
    let t0: Timestamp = "2026-12-04T10:00:00Z".parse().unwrap();
    let start: Timestamp = "2026-12-04T00:00:00Z".parse().unwrap();
    let end: Timestamp = "2026-12-05T00:00:00Z".parse().unwrap();
    // (seconds after t0, counter cost, mark cost, counter limit, same key)
    let steps: [(i64, u64, u64, u64, bool); 12] = [
        (0, 5, 0, 20, false),      // both missing: the counter is created, the mark read
        (1, 5, 1, 20, false),      // the mark is created
        (2, 5, 0, 20, false),      // both there
        (3, 4, 1, 20, false),      // both there, both counted
        (4, 5, 1, 20, false),      // refused: nothing written
        (5, 1, 0, 20, false),      // exactly the limit
        (6, 1, 0, 20, false),      // refused at the limit
        (7, 0, 0, 20, false),      // nothing to spend
        (8, 1, 1, 30, false),      // a higher limit
        (9, 1, 1, 30, true),       // one key twice
        (7_200, 1, 0, 30, false),  // the mark's period is over
        (90_000, 1, 1, 30, false), // past the counter's window: an error, nothing written
    ];
    for (step, &(at, cost, mark_cost, limit, twice)) in steps.iter().enumerate() {
        let now = t0 + SignedDuration::from_secs(at);
        let mut answers = Vec::new();
        for (s, store) in stores.iter().enumerate() {
            let counter = key(&format!("twin{s}"), "read");
            let mark = key(&format!("twin{s}"), "read%held");
            let second = if twice {
                calendar(&counter, limit, mark_cost, start, end)
            } else {
                first_use(&mark, u64::MAX >> 11, mark_cost, now)
            };
            let lines = vec![calendar(&counter, limit, cost, start, end), second];
            let answer = store
                .charge(ChargeRequest {
                    charged_at: None,
                    now,
                    lines: lines.into(),
                })
                .await
                .map(|outcome| {
                    let usage: Vec<_> = outcome
                        .usage
                        .iter()
                        .map(|u| (u.limit, u.used, u.first_call))
                        .collect();
                    (outcome.admitted, usage)
                })
                .map_err(|error| error.to_string());
            assert_eq!(answer.is_err(), now >= end, "step {step}: {answer:?}");
            let count: Option<String> = redis.hget(counter.as_str(), "n").await.unwrap();
            answers.push((answer, count));
        }
        assert_eq!(answers[0], answers[1], "step {step}");
    }
    // A first-use counter without a deadline (written by another tool):
    // dated alike.
    let mut answers = Vec::new();
    for (s, store) in stores.iter().enumerate() {
        let counter = key(&format!("undated{s}"), "read");
        let mark = key(&format!("undated{s}"), "read%held");
        let () = redis
            .hset_multiple(
                mark.as_str(),
                &[
                    ("n", "1".to_owned()),
                    ("t", t0.as_millisecond().to_string()),
                ],
            )
            .await
            .unwrap();
        let lines = vec![
            calendar(&counter, 10, 1, start, end),
            first_use(&mark, u64::MAX >> 11, 1, t0),
        ];
        let answer = answer(store, t0, lines).await;
        answers.push((answer, pttl(&mut redis, &mark).await > 0));
    }
    assert_eq!(answers[0], answers[1]);
    assert!(answers[0].1, "the counter is dated");
}
