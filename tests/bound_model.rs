//! A seeded random walk at the memory store's bound: a tiny store (1 to 8
//! counters, 1 to 4 shards), many subjects, calendar and first-use quotas
//! of a few seconds, requests through the axum layer (fail closed or fail
//! open) and charges, refunds, adds and resets straight to the store, the
//! clock stepped so counters end at various times. Checked after each
//! step against a model of the live counters: no subject is admitted past
//! its limit within a period; a store full of live counters refuses a new
//! subject (503, or admitted and owed under fail open) and never drops a
//! live counter to make room; once enough counters are over (past the
//! second a full store keeps them), a new subject gets room.
//!
//! `BOUND_MODEL_CASES` sets how many cases run (default 40),
//! `BOUND_MODEL_SEED` the first seed.

mod seeded;

use seeded::Rng;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use jiff::{SignedDuration, Timestamp};
use tower::ServiceExt;
use tower_quota::store::{ChargeRequest, StoreErrorKind};
use tower_quota::{
    FromHeader, ManualClock, MemoryStore, Namespace, OnStoreError, Quota, QuotaPolicy, Store,
    Subject,
};

#[derive(Clone, Copy, Debug)]
struct Ctr {
    /// `None` once a debt of fail open may have landed on it.
    used: Option<u64>,
    deadline: Timestamp,
}

struct Q {
    quota: Quota,
    secs: i64,
    rolling: bool,
    limit: u64,
}

impl Q {
    fn deadline_from(&self, now: Timestamp) -> Timestamp {
        if self.rolling {
            now + SignedDuration::from_secs(self.secs)
        } else {
            Timestamp::from_second((now.as_second().div_euclid(self.secs) + 1) * self.secs).unwrap()
        }
    }
    /// The model's key: the window's start for a calendar quota.
    fn window(&self, now: Timestamp) -> i64 {
        if self.rolling {
            0
        } else {
            now.as_second().div_euclid(self.secs)
        }
    }
}

type Key = (usize, usize, i64);

/// What the runs went through: a full store's refusals of new subjects,
/// new subjects given room reclaimed from ended counters, refusals at the
/// limit.
static FULL: AtomicUsize = AtomicUsize::new(0);
static RECLAIMED: AtomicUsize = AtomicUsize::new(0);
static AT_LIMIT: AtomicUsize = AtomicUsize::new(0);

#[tokio::test(flavor = "current_thread")]
async fn the_memory_store_at_its_bound_never_drops_a_live_counter_nor_refuses_room_it_has() {
    let cases: u64 = std::env::var("BOUND_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let first: u64 = std::env::var("BOUND_MODEL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let mut steps = 0;
    for seed in first..first + cases {
        steps += run(seed).await;
    }
    eprintln!(
        "bound model: {cases} cases, {steps} steps; {} refused as full, {} given reclaimed room, {} refused at the limit",
        FULL.load(Ordering::Relaxed),
        RECLAIMED.load(Ordering::Relaxed),
        AT_LIMIT.load(Ordering::Relaxed)
    );
}

async fn run(seed: u64) -> usize {
    let mut rng = Rng(seed);
    let shards = 1 + rng.below(4) as usize;
    let max = 1 + rng.below(8) as usize;
    let open = rng.below(2) == 1;
    let subjects = 4 + rng.below(12) as usize;
    let cal_secs = 2 + rng.below(4) as i64;
    let roll_secs = 1 + rng.below(4) as i64;
    let qs = [
        Q {
            quota: Quota::fixed_window(3, Duration::from_secs(cal_secs as u64)).allowance("cal"),
            secs: cal_secs,
            rolling: false,
            limit: 3,
        },
        Q {
            quota: Quota::rolling(2, Duration::from_secs(roll_secs as u64)).allowance("roll"),
            secs: roll_secs,
            rolling: true,
            limit: 2,
        },
    ];
    let mut now: Timestamp = "2026-12-02T10:00:00.300Z".parse().unwrap();
    let clock = ManualClock::new(now);
    let store = MemoryStore::with_shards(shards).max_counters(max);
    let mut builder = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store.clone())
        .clock(clock.clone());
    if open {
        builder = builder.on_store_error(OnStoreError::FailOpen);
    }
    let policy = builder.build();
    let app = Router::new()
        .route("/cal", get(|| async { "hi" }))
        .route_layer(policy.layer(qs[0].quota.clone()))
        .merge(
            Router::new()
                .route("/roll", get(|| async { "hi" }))
                .route_layer(policy.layer(qs[1].quota.clone())),
        )
        .merge(
            Router::new()
                .route("/both", get(|| async { "hi" }))
                .route_layer(policy.layer(qs[0].quota.clone()).quota(qs[1].quota.clone())),
        );
    let ns = Namespace::default();
    let subject = |s: usize| Subject::account(format!("u{s}"));
    let mut model: HashMap<Key, Ctr> = HashMap::new();
    let n = 60 + rng.below(120) as usize;
    let ctx = |step: usize, what: &str| {
        format!("seed {seed} step {step} ({what}); shards {shards}, max {max}, open {open}")
    };
    for step in 0..n {
        // Counters ended a second ago or more are the model's no more: a
        // full store may reclaim them.
        let room_by = now - SignedDuration::from_secs(1);
        model.retain(|_, c| c.deadline > room_by);
        let op = rng.below(10);
        if op < 2 {
            let ms = [0, 100, 300, 700, 1000, 1500, 2500][rng.below(7) as usize];
            now += SignedDuration::from_millis(ms);
            clock.set(now);
            continue;
        }
        let q = rng.below(2) as usize;
        let s = rng.below(subjects as u64) as usize;
        let key = (q, s, qs[q].window(now));
        let pkey = qs[q].quota.key(&ns, &subject(s), now);
        let live = model.get(&key).copied().filter(|c| c.deadline > now);
        match op {
            2..=6 => {
                // A charge of 1 per line: through the layer or straight to
                // the store.
                let via_layer = op <= 4;
                let what = if via_layer { "request" } else { "charge" };
                let lines: Vec<(usize, usize)> = if via_layer {
                    match rng.below(3) {
                        2 => vec![(0, s), (1, s)],
                        _ => vec![(q, s)],
                    }
                } else {
                    let mut lines = vec![(q, s)];
                    if rng.below(2) == 1 {
                        let s2 = if rng.below(2) == 1 {
                            s
                        } else {
                            rng.below(subjects as u64) as usize
                        };
                        lines.push((rng.below(2) as usize, s2));
                    }
                    lines
                };
                let keys: Vec<Key> = lines
                    .iter()
                    .map(|&(q, s)| (q, s, qs[q].window(now)))
                    .collect();
                let mut distinct = keys.clone();
                distinct.sort_unstable();
                distinct.dedup();
                let lives: Vec<Option<Ctr>> = distinct
                    .iter()
                    .map(|k| model.get(k).copied().filter(|c| c.deadline > now))
                    .collect();
                // Live counters known to be held (not a debt's that may
                // not have landed).
                let live_count = model
                    .values()
                    .filter(|c| c.deadline > now && c.used.is_some())
                    .count();
                // Counters the store may hold besides those of the keys with
                // no live counter.
                let held_bound = model
                    .iter()
                    .filter(|(k, c)| !distinct.contains(k) || c.deadline > now)
                    .count();
                let full_before = store.len() >= max;
                // Some(true) admitted and counted, Some(false) refused,
                // None a store failure (full).
                let counted: Option<bool> = if via_layer {
                    let path = match lines.as_slice() {
                        [_, _] => "/both",
                        [(0, _)] => "/cal",
                        _ => "/roll",
                    };
                    let response = app
                        .clone()
                        .oneshot(
                            Request::get(path)
                                .header("x-account-id", format!("u{s}"))
                                .body(Body::empty())
                                .unwrap(),
                        )
                        .await
                        .unwrap();
                    let header = response.headers().contains_key("ratelimit");
                    match response.status() {
                        StatusCode::OK if header => Some(true),
                        StatusCode::OK => {
                            assert!(
                                open,
                                "{}: 200 without RateLimit fails closed",
                                ctx(step, what)
                            );
                            None
                        }
                        StatusCode::TOO_MANY_REQUESTS => Some(false),
                        StatusCode::SERVICE_UNAVAILABLE => {
                            assert!(!open, "{}: 503 under fail open", ctx(step, what));
                            None
                        }
                        other => panic!("{}: status {other}", ctx(step, what)),
                    }
                } else {
                    let charge_lines: Vec<_> = lines
                        .iter()
                        .map(|&(q, s)| qs[q].quota.line(&ns, &subject(s), now, 1))
                        .collect();
                    match store
                        .charge(ChargeRequest {
                            charged_at: None,
                            now,
                            lines: charge_lines.into(),
                        })
                        .await
                    {
                        Ok(outcome) => Some(outcome.admitted),
                        Err(e) => {
                            assert_eq!(e.kind(), StoreErrorKind::Full, "{}", ctx(step, what));
                            None
                        }
                    }
                };
                let told = format!(
                    "{}: lines {lines:?}, counters {lives:?}, {live_count} live of {max}, at most {held_bound} held besides; got {counted:?}",
                    ctx(step, what)
                );
                let known = lives.iter().all(|c| c.is_none_or(|c| c.used.is_some()));
                if known {
                    let over = distinct.iter().zip(&lives).any(|(k, c)| {
                        let cnt = keys.iter().filter(|x| *x == k).count() as u64;
                        c.map_or(0, |c| c.used.unwrap()) + cnt > qs[k.0].limit
                    });
                    let new = lives.iter().filter(|c| c.is_none()).count();
                    if over {
                        AT_LIMIT.fetch_add(1, Ordering::Relaxed);
                        assert_eq!(counted, Some(false), "{told}: past the limit");
                    } else if new == 0 {
                        assert_eq!(
                            counted,
                            Some(true),
                            "{told}: live counters within their limits (one dropped to make room?)"
                        );
                    } else {
                        if live_count + new > max {
                            FULL.fetch_add(1, Ordering::Relaxed);
                            assert_eq!(
                                counted, None,
                                "{told}: no room without dropping a live counter"
                            );
                        }
                        if held_bound + new <= max {
                            if full_before {
                                RECLAIMED.fetch_add(1, Ordering::Relaxed);
                            }
                            assert_eq!(counted, Some(true), "{told}: room to be reclaimed");
                        }
                    }
                }
                match counted {
                    Some(true) => {
                        for (i, k) in keys.iter().enumerate() {
                            let deadline = qs[k.0].deadline_from(now);
                            match model.get_mut(k) {
                                Some(c) if c.deadline > now => {
                                    if let Some(u) = c.used.as_mut() {
                                        *u += 1;
                                    } else {
                                        c.deadline = c.deadline.max(deadline);
                                    }
                                }
                                _ => {
                                    let _ = i;
                                    model.insert(
                                        *k,
                                        Ctr {
                                            used: Some(1),
                                            deadline,
                                        },
                                    );
                                }
                            }
                        }
                    }
                    Some(false) => {}
                    None if via_layer && open => {
                        // Owed: the ledger may make the counters, or add to
                        // them.
                        for k in &keys {
                            let deadline = qs[k.0].deadline_from(now);
                            let c = model.entry(*k).or_insert(Ctr {
                                used: None,
                                deadline,
                            });
                            c.used = None;
                            c.deadline = c.deadline.max(deadline);
                        }
                    }
                    None => {}
                }
            }
            7 => {
                let got = store.refund(now, pkey, 1).await.unwrap();
                let expect = live.map(|c| c.used.map(|u| u.saturating_sub(1)));
                match expect {
                    None => assert_eq!(got, None, "{}", ctx(step, "refund")),
                    Some(Some(u)) => {
                        assert_eq!(got, Some(u), "{}", ctx(step, "refund"));
                        model.get_mut(&key).unwrap().used = Some(u);
                    }
                    Some(None) => {}
                }
            }
            8 => {
                let got = store.add(now, pkey, 1).await.unwrap();
                match live.map(|c| c.used) {
                    None => assert_eq!(got, None, "{}", ctx(step, "add")),
                    Some(Some(u)) => {
                        assert_eq!(got, Some(u + 1), "{}", ctx(step, "add"));
                        model.get_mut(&key).unwrap().used = Some(u + 1);
                    }
                    Some(None) => {}
                }
            }
            _ => {
                let _ = store.reset(pkey).await.unwrap();
                if model.get(&key).is_some_and(|c| c.used.is_some()) {
                    model.remove(&key);
                }
            }
        }
        // Every live counter of the model is in the store, as the model
        // counts it.
        for (&(q, s, _), c) in &model {
            if c.deadline <= now {
                continue;
            }
            let usage = store
                .peek(ChargeRequest {
                    charged_at: None,
                    now,
                    lines: vec![qs[q].quota.line(&ns, &subject(s), now, 0)].into(),
                })
                .await
                .unwrap();
            if let Some(used) = c.used {
                assert_eq!(
                    usage[0].used,
                    used,
                    "{}: u{s} quota {q}'s live counter",
                    ctx(step, "check")
                );
            }
        }
        assert!(store.len() <= max, "{}", ctx(step, "len"));
    }
    n
}

/// A leased store over a bounded memory store, itself bounded in the
/// counters it tracks (1 to 4): calendar windows of a few seconds, many
/// subjects. No subject is admitted past its limit within a window, and
/// the store counts at least what was admitted.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_leased_store_at_its_bounds_never_admits_past_a_limit() {
    let cases: u64 = std::env::var("BOUND_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let first: u64 = std::env::var("BOUND_MODEL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let (mut admitted_total, mut refused, mut failed) = (0, 0, 0);
    for seed in first..first + cases {
        let mut rng = Rng(seed);
        let shards = 1 + rng.below(4) as usize;
        let max = 1 + rng.below(8) as usize;
        let lease_max = 1 + rng.below(4) as usize;
        let subjects = 3 + rng.below(8) as usize;
        let secs = 2 + rng.below(4) as i64;
        let limit = 3 + rng.below(8);
        let quota = Quota::fixed_window(limit, Duration::from_secs(secs as u64));
        let mut now: Timestamp = "2026-12-02T10:00:00.300Z".parse().unwrap();
        let clock = ManualClock::new(now);
        let memory = MemoryStore::with_shards(shards).max_counters(max);
        let store = tower_quota::LeasedStore::builder(memory.clone())
            .max_counters(lease_max)
            .build();
        let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store.clone())
            .clock(clock.clone())
            .build();
        let app = Router::new()
            .route("/", get(|| async { "hi" }))
            .route_layer(policy.layer(quota.clone()));
        let ns = Namespace::default();
        let mut admitted: HashMap<(usize, i64), u64> = HashMap::new();
        for step in 0..(80 + rng.below(160)) {
            if rng.below(6) == 0 {
                let ms = [0, 100, 300, 700, 1000, 1500, 2500][rng.below(7) as usize];
                now += SignedDuration::from_millis(ms);
                clock.set(now);
                tokio::time::advance(Duration::from_millis(ms as u64)).await;
                continue;
            }
            let s = rng.below(subjects as u64) as usize;
            let window = now.as_second().div_euclid(secs);
            let response = app
                .clone()
                .oneshot(
                    Request::get("/")
                        .header("x-account-id", format!("u{s}"))
                        .body(Body::empty())
                        .unwrap(),
                )
                .await
                .unwrap();
            match response.status() {
                StatusCode::OK => {
                    admitted_total += 1;
                    let n = admitted.entry((s, window)).or_default();
                    *n += 1;
                    assert!(
                        *n <= limit,
                        "seed {seed} step {step}: u{s} admitted {n} times in window {window}, limit {limit} (shards {shards}, max {max}, lease max {lease_max})"
                    );
                    let usage = memory
                        .peek(ChargeRequest {
                            charged_at: None,
                            now,
                            lines: vec![quota.line(
                                &ns,
                                &Subject::account(format!("u{s}")),
                                now,
                                0,
                            )]
                            .into(),
                        })
                        .await
                        .unwrap();
                    assert!(
                        usage[0].used >= *n,
                        "seed {seed} step {step}: u{s} admitted {n} times in window {window}, the store counts {}",
                        usage[0].used
                    );
                }
                StatusCode::TOO_MANY_REQUESTS => refused += 1,
                StatusCode::SERVICE_UNAVAILABLE => {
                    failed += 1;
                    assert!(
                        memory.len() >= max,
                        "seed {seed} step {step}: u{s} got 503 while the memory store holds {} of {max} counters",
                        memory.len()
                    );
                }
                other => panic!("seed {seed} step {step}: status {other}"),
            }
            tokio::task::yield_now().await;
        }
        store.shutdown().await;
    }
    eprintln!("leased bound model: {cases} cases; {admitted_total} admitted, {refused} refused, {failed} store failures");
}
