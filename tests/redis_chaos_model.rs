//! Every admission counted, no charge without one, on a real `redis-server`
//! that misbehaves at random: one or two policies of one or two layers
//! each, nested (fail open with the ledger, or fail closed; a `RedisStore`
//! or a `LeasedStore` over one; daily and first-use quotas; fixed and
//! deferred costs; 5xx refunded) serve bursts of concurrent requests over
//! HTTP while Redis stays healthy, answers slowly (`DEBUG SLEEP`s well
//! within the store's timeout), stalls (SIGSTOP for shorter and longer than
//! the timeout, past the 1 s after which a connection counts as silent), or
//! is killed and started again (appendonly, every write on disk: the
//! counters survive). A step starts once the one before settled, or at
//! once (its debts settled and its late charges given back meanwhile).
//!
//! Once everything settles (`settle_owed`, nothing in flight, leases shut
//! down), each counter holds exactly what the 200s cost on it: the 429s,
//! the 503s and the refunded 500s nothing. The README's cases that count
//! otherwise are kept out, not tolerated: Redis is killed only when no call
//! is on its way (nothing in flight, nothing owed, no lease returning in
//! the background), stalls are far shorter than the 30 s a late call is
//! followed, and the policy's clock stands still (a first-use debt lands in
//! the one period). (`tower_quota_changes_lost_total` counts a change
//! Redis answered late all the same: it is not checked through stalls.)
//! While Redis is healthy (and with `REDIS_CHAOS_STRICT=1`, only slow), no
//! request is refused with a 503, passes on a failed charge, or loses a
//! change (rule 3).
//!
//! `REDIS_CHAOS_CASES=n` runs `n` seeds (default 1), from
//! `REDIS_CHAOS_SEED` (default 0); `REDIS_CHAOS_VERBOSE` prints each step.

#![cfg(all(feature = "redis", feature = "metrics"))]

mod demo_server;
mod redis_support;
mod seeded;

use std::collections::HashMap;
use std::future::IntoFuture;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::extract::Path;
use axum::routing::get;
use axum::Router;
use http::StatusCode;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tower_quota::jiff::Timestamp;
use tower_quota::metrics::{outcome, CHANGES_LOST, DECISIONS};
use tower_quota::store::{EitherStore, LeasedStore, RedisStore};
use tower_quota::{FromHeader, ManualClock, OnStoreError, Quota, QuotaPolicy, Subject};

use redis_support::{redis_available, RedisServer, Stopped};
use seeded::Rng;

const SUBJECTS: [&str; 3] = ["acme", "globex", "initech"];

type Store = EitherStore<RedisStore, LeasedStore<RedisStore>>;

/// One policy of a run, with its one or two layers.
struct Policy {
    policy: QuotaPolicy<FromHeader, Store>,
    redis: RedisStore,
    leased: Option<LeasedStore<RedisStore>>,
    /// Outermost first: each layer's quota and cost (`None`: the cost is
    /// the response's `x-tokens`).
    layers: Vec<(Quota, Option<u64>)>,
    fail_open: bool,
    label: String,
}

impl Policy {
    fn new(rng: &mut Rng, i: usize, url: &str, clock: &ManualClock, restarts: bool) -> Self {
        let redis = RedisStore::new(url).unwrap();
        let leased = (rng.below(2) == 0).then(|| {
            let builder = LeasedStore::builder(redis.clone());
            // A lease that returns units in the background could be on its
            // way when Redis is killed: a return lost on the wire.
            if restarts {
                builder
                    .idle(Duration::from_secs(600))
                    .lease_time(Duration::from_secs(600))
                    .build()
            } else {
                builder.lease_time(Duration::from_millis(700)).build()
            }
        });
        let store = match &leased {
            Some(leased) => EitherStore::Right(leased.clone()),
            None => EitherStore::Left(redis.clone()),
        };
        let fail_open = rng.below(2) == 0;
        let mut label = format!(
            "p{i} {} {}:",
            if fail_open { "open" } else { "closed" },
            if leased.is_some() { "leased" } else { "plain" },
        );
        let layers = (0..1 + rng.below(2))
            .map(|j| {
                let limit = *rng.pick(&[20, 60, 1_000_000]);
                let rolling = rng.below(2) == 0;
                let quota = if rolling {
                    Quota::rolling(limit, Duration::from_secs(3_600))
                } else {
                    Quota::daily(limit)
                }
                .allowance(format!("a{j}"));
                let cost = (rng.below(3) > 0).then(|| 1 + rng.below(3));
                label += &format!(
                    " {} {limit} cost {cost:?};",
                    if rolling { "rolling" } else { "daily" }
                );
                (quota, cost)
            })
            .collect();
        let builder = QuotaPolicy::builder(FromHeader::account("x-account-id"))
            .store(store)
            .clock(clock.clone())
            .namespace(&format!("p{i}"))
            .refund_server_errors(true);
        let policy = match fail_open {
            true => builder.on_store_error(OnStoreError::FailOpen),
            false => builder, // fail closed
        }
        .build();
        Self {
            policy,
            redis,
            leased,
            layers,
            fail_open,
            label,
        }
    }

    fn layer(&self, j: usize) -> tower_quota::QuotaLayer<FromHeader, Store> {
        let (quota, cost) = &self.layers[j];
        let layer = self.policy.layer(quota.clone());
        match cost {
            Some(cost) => layer.cost(*cost),
            None => layer.deferred_cost(1, |response| {
                response
                    .headers
                    .get("x-tokens")
                    .and_then(|v| v.to_str().ok()?.parse().ok())
                    .unwrap_or(1)
            }),
        }
    }

    /// Nothing owed, nothing in flight.
    fn quiet(&self) -> bool {
        self.policy.owed().units == 0 && self.redis.in_flight() == 0
    }
}

/// Serves `/{status}/{tokens}/{delay ms}`: the status asked for, after the
/// delay, its cost in `x-tokens`.
fn app(policies: &[Policy]) -> Router {
    let mut router = Router::new().route(
        "/{status}/{tokens}/{delay}",
        get(
            |Path((status, tokens, delay)): Path<(u16, u64, u64)>| async move {
                tokio::time::sleep(Duration::from_millis(delay)).await;
                (
                    StatusCode::from_u16(status).unwrap(),
                    [("x-tokens", tokens.to_string())],
                    "done",
                )
            },
        ),
    );
    // The first policy's first layer outermost.
    for policy in policies.iter().rev() {
        for j in (0..policy.layers.len()).rev() {
            router = router.route_layer(policy.layer(j));
        }
    }
    router
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Event {
    Healthy,
    Slow,
    ShortStall,
    LongStall,
    Restart,
}

/// The metrics, each snapshot what was recorded since the last.
fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::set_global_recorder(recorder).expect("the only recorder");
        snapshotter
    })
}

/// Store errors decided, and units of changes lost, since the last call.
fn store_errors_and_lost() -> (u64, u64) {
    let (mut errors, mut lost) = (0, 0);
    for (key, _, _, value) in snapshotter().snapshot().into_vec() {
        let DebugValue::Counter(n) = value else {
            continue;
        };
        let key = key.key();
        if key.name() == DECISIONS
            && key
                .labels()
                .any(|l| l.key() == "outcome" && l.value() == outcome::STORE_ERROR)
        {
            errors += n;
        } else if key.name() == CHANGES_LOST {
            lost += n;
        }
    }
    (errors, lost)
}

/// Waits until every policy owes nothing and has nothing in flight.
async fn quiet(policies: &[Policy], context: &str) {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        if policies.iter().all(Policy::quiet) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if policies.iter().all(Policy::quiet) {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{context}: never quiet: {:?}",
            policies
                .iter()
                .map(|p| (p.policy.owed(), p.redis.in_flight()))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends `DEBUG SLEEP`s of 2-15 ms, 5-20 ms apart, until `stop`: far
/// within the store's 80 ms, on a busy machine too (with sleeps of up to
/// 30 ms, one charge in some hundred such steps timed out on a loaded
/// two-core machine).
fn slow(port: u16, seed: u64, stop: Arc<AtomicBool>) {
    let mut rng = Rng(seed);
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    while !stop.load(Ordering::Relaxed) {
        let secs = format!("0.{:03}", 2 + rng.below(14));
        let command = format!(
            "*3\r\n$5\r\nDEBUG\r\n$5\r\nSLEEP\r\n${}\r\n{secs}\r\n",
            secs.len()
        );
        stream.write_all(command.as_bytes()).unwrap();
        let mut reply = [0u8; 5];
        stream.read_exact(&mut reply).unwrap();
        assert_eq!(&reply, b"+OK\r\n");
        std::thread::sleep(Duration::from_millis(5 + rng.below(16)));
    }
}

/// A burst's request: its subject, the status and cost its handler
/// answers, and what came back.
struct Sent {
    subject: &'static str,
    asked: u16,
    tokens: u64,
    got: u16,
}

async fn run(seed: u64) {
    let mut rng = Rng(seed);
    let restarts = rng.below(2) == 0;
    let server = RedisServer::start_with(&[
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--enable-debug-command",
        "yes",
    ]);
    let server = Arc::new(Mutex::new(server));
    let url = server.lock().unwrap().url();
    let port = server.lock().unwrap().port();
    let clock = ManualClock::new(Timestamp::now());
    let policies: Vec<Policy> = (0..1 + rng.below(2) as usize)
        .map(|i| Policy::new(&mut rng, i, &url, &clock, restarts))
        .collect();
    let label = format!(
        "seed {seed}{}: {}",
        if restarts { " (restarts)" } else { "" },
        policies
            .iter()
            .map(|p| p.label.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let serving = tokio::spawn(axum::serve(listener, app(&policies)).into_future());
    let _ = store_errors_and_lost();

    let mut expected: HashMap<(usize, usize, &str), u64> = HashMap::new();
    let mut lost = 0;
    let steps = 3 + rng.below(3);
    for step in 0..steps {
        let mut events = vec![
            Event::Healthy,
            Event::Slow,
            Event::ShortStall,
            Event::LongStall,
        ];
        if restarts {
            events.push(Event::Restart);
        }
        let event = *rng.pick(&events);
        let context = format!("{label}, step {step} {event:?}");
        // Debts of the step before are settled, and its late calls given
        // back, while this one runs, unless it waits for them. Redis is
        // killed only when quiet.
        let waited = event == Event::Restart || rng.below(2) == 0;
        if waited {
            quiet(&policies, &context).await;
        }
        let (_, lost_before) = store_errors_and_lost();
        lost += lost_before;

        if event == Event::Restart {
            server.lock().unwrap().kill();
        }
        let stop = Arc::new(AtomicBool::new(false));
        let trouble = {
            let server = Arc::clone(&server);
            let stop = Arc::clone(&stop);
            let at = Duration::from_millis(rng.below(300));
            let long = Duration::from_millis(*rng.pick(&[150, 400, 900, 1_500]));
            let short = Duration::from_millis(10 + rng.below(40));
            let seed = rng.next();
            tokio::task::spawn_blocking(move || {
                std::thread::sleep(at);
                match event {
                    Event::Healthy => {}
                    Event::Slow => slow(port, seed, stop),
                    Event::ShortStall | Event::LongStall => {
                        let mut stopped = Stopped::new(&server.lock().unwrap());
                        std::thread::sleep(if event == Event::ShortStall {
                            short
                        } else {
                            long
                        });
                        stopped.resume();
                    }
                    Event::Restart => {
                        let mut server = server.lock().unwrap();
                        // `restart` kills first: nothing runs.
                        server.restart();
                    }
                }
            })
        };
        let n = 20 + rng.below(60);
        let mut burst = tokio::task::JoinSet::new();
        for _ in 0..n {
            let subject = *rng.pick(&SUBJECTS);
            let asked = if rng.below(5) == 0 { 500 } else { 200 };
            let tokens = rng.below(5);
            let delay = rng.below(30);
            let start = Duration::from_millis(rng.below(600));
            let addr = addr.clone();
            burst.spawn(async move {
                tokio::time::sleep(start).await;
                let path = format!("/{asked}/{tokens}/{delay}");
                let reply =
                    demo_server::call(&addr, "GET", &path, &[("x-account-id", subject)]).await;
                Sent {
                    subject,
                    asked,
                    tokens,
                    got: reply.status,
                }
            });
        }
        let mut unavailable = 0;
        let mut statuses: HashMap<u16, u64> = HashMap::new();
        while let Some(sent) = burst.join_next().await {
            let sent = sent.unwrap();
            *statuses.entry(sent.got).or_default() += 1;
            let allowed: &[u16] = match sent.asked {
                500 => &[500, 429, 503],
                _ => &[200, 429, 503],
            };
            assert!(
                allowed.contains(&sent.got),
                "{context}: asked {} got {}",
                sent.asked,
                sent.got
            );
            if sent.got == 503 {
                assert!(
                    policies.iter().any(|p| !p.fail_open),
                    "{context}: a 503 under fail open"
                );
                unavailable += 1;
            }
            if sent.got == 200 {
                for (i, policy) in policies.iter().enumerate() {
                    for (j, (_, cost)) in policy.layers.iter().enumerate() {
                        *expected.entry((i, j, sent.subject)).or_default() +=
                            cost.unwrap_or(sent.tokens);
                    }
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        trouble.await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (errors, lost_now) = store_errors_and_lost();
        lost += lost_now;
        if std::env::var_os("REDIS_CHAOS_VERBOSE").is_some() {
            eprintln!(
                "{context}: {statuses:?}, {errors} store errors, {lost_now} units of changes lost"
            );
        }
        // Rule 3: Redis answered every call within its timeout. A slow step
        // leaves a busy machine little room (its sleeps and a starved
        // process add up past the timeout now and then): checked on
        // request, `REDIS_CHAOS_STRICT=1`.
        let strict = std::env::var_os("REDIS_CHAOS_STRICT").is_some();
        if waited && (event == Event::Healthy || strict && event == Event::Slow) {
            assert_eq!(
                (unavailable, errors, lost_now),
                (0, 0, 0),
                "{context}: 503s, store errors and changes lost while Redis was healthy"
            );
        }
    }

    // Everything settles: debts paid, late charges given back, leases
    // returned.
    for policy in &policies {
        let unsettled = policy.policy.settle_owed(Duration::from_secs(10)).await;
        assert_eq!(unsettled.units, 0, "{label}: unsettled {unsettled:?}");
    }
    quiet(&policies, &label).await;
    for policy in &policies {
        if let Some(leased) = &policy.leased {
            leased.shutdown().await;
        }
    }
    quiet(&policies, &label).await;
    serving.abort();

    // A change never sent is sent again a moment later (up to 5 s apart).
    let deadline = Instant::now() + Duration::from_secs(12);
    loop {
        let mut differences = Vec::new();
        for (i, policy) in policies.iter().enumerate() {
            for (j, (quota, _)) in policy.layers.iter().enumerate() {
                for subject in SUBJECTS {
                    let key = quota.key(
                        policy.policy.namespace(),
                        &Subject::account(subject),
                        clock.now(),
                    );
                    let held = server.lock().unwrap().cli(&["hget", key.as_str(), "n"]);
                    let held: u64 = held.parse().unwrap_or(0);
                    let want = expected.get(&(i, j, subject)).copied().unwrap_or(0);
                    if held != want {
                        differences
                            .push(format!("p{i} a{j} {subject}: held {held}, served {want}"));
                    }
                }
            }
        }
        if differences.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            let (_, lost_now) = store_errors_and_lost();
            panic!(
                "{label}: counters differ from what was served: {differences:?} (changes lost: {})",
                lost + lost_now
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn every_admission_counted_through_a_misbehaving_redis() {
    if !redis_available() {
        return;
    }
    let cases: u64 = seeded::env_u64("REDIS_CHAOS_CASES", 1);
    let first: u64 = seeded::env_u64("REDIS_CHAOS_SEED", 0);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for seed in first..first + cases {
        runtime.block_on(run(seed));
    }
}
