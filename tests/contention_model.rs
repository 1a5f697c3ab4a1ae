//! Concurrent bursts through nested layers of one policy: an outer daily
//! quota on every route, inner per-route quotas (one with a deferred cost),
//! 5xx refunds, handler refunds and requests dropped mid-flight, on a
//! `MemoryStore`, one `LeasedStore` over one, and 2-3 `LeasedStore`s over
//! one `MemoryStore`. Once quiet (leased stores shut down), what stays
//! charged must be exactly what was served as admitted, never over a hard
//! limit; a burst of plain calls over the limit admits exactly the limit.
//! A multi-thread runtime, real (millisecond) time.

mod seeded;

use std::collections::HashMap;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::routing::get;
use axum::Router;
use http::{HeaderValue, Request, StatusCode};
use jiff::Timestamp;
use seeded::Rng;
use tower::ServiceExt;
use tower_quota::store::LeasedStore;
use tower_quota::{
    FromHeader, ManualClock, MemoryStore, Quota, QuotaHandle, QuotaPolicy, QuotaStatus, Store,
    Subject,
};

const SUBJECTS: [&str; 3] = ["acme", "globex", "initech"];
const ALL: u64 = 60;
const A: u64 = 15;
const B: u64 = 10;
const TOKENS: u64 = 30;

fn app<St: Store>(store: St, clock: ManualClock) -> (Router, QuotaHandle<St>) {
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store)
        .clock(clock)
        .refund_server_errors(true)
        .build();
    let all = policy.layer(Quota::daily(ALL).allowance("all").named("all-day"));
    let a = policy.layer(Quota::hourly(A).allowance("a").named("a-hour"));
    let b = policy.layer(Quota::daily(B).allowance("b").named("b-day"));
    let tokens = policy
        .layer(Quota::daily(TOKENS).allowance("tokens").named("tokens-day"))
        .deferred_cost(1, |response| {
            response
                .headers
                .get("x-tokens-used")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(1)
        });
    let handle = policy.handle();
    async fn serve<St: Store>(
        State(handle): State<QuotaHandle<St>>,
        Path((outcome, sleep_us, tokens)): Path<(String, u64, u64)>,
        status: QuotaStatus,
    ) -> axum::response::Response {
        use axum::response::IntoResponse;
        tokio::time::sleep(Duration::from_micros(sleep_us)).await;
        match outcome.as_str() {
            "ok" => {
                let mut r = "ok".into_response();
                r.headers_mut()
                    .insert("x-tokens-used", HeaderValue::from(tokens));
                r
            }
            "err" => {
                let mut r = StatusCode::INTERNAL_SERVER_ERROR.into_response();
                r.headers_mut()
                    .insert("x-tokens-used", HeaderValue::from(tokens));
                r
            }
            "undoerr" => {
                handle.refund_request(&status).await.unwrap();
                StatusCode::BAD_GATEWAY.into_response()
            }
            "undostall" => {
                handle.refund_request(&status).await.unwrap();
                tokio::time::sleep(Duration::from_secs(5)).await;
                "late".into_response()
            }
            "undo" => {
                handle.refund_request(&status).await.unwrap();
                tokio::time::sleep(Duration::from_micros(sleep_us)).await;
                "undone".into_response()
            }
            "stall" => {
                tokio::time::sleep(Duration::from_secs(5)).await;
                "late".into_response()
            }
            _ => unreachable!(),
        }
    }
    let router = Router::new()
        .route("/a/{o}/{s}/{t}", get(serve::<St>).route_layer(a))
        .route("/b/{o}/{s}/{t}", get(serve::<St>).route_layer(b))
        .route("/t/{o}/{s}/{t}", get(serve::<St>).route_layer(tokens))
        .route_layer(all)
        .with_state(handle.clone());
    (router, handle)
}

#[derive(Default, Debug, Clone, PartialEq)]
struct Tally {
    all: u64,
    a: u64,
    b: u64,
    tokens: u64,
}

async fn used<St: Store>(handle: &QuotaHandle<St>, who: &str) -> Tally {
    let usage = handle.usage(&Subject::account(who)).await.unwrap();
    let get = |name: &str| usage.iter().find(|u| u.name() == name).unwrap().used();
    Tally {
        all: get("all-day"),
        a: get("a-hour"),
        b: get("b-day"),
        tokens: get("tokens-day"),
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Mixed,
    Plain,
}

/// One case: the apps (one per instance), a burst of requests spread over
/// them; returns per subject what was served as admitted, and checks
/// statuses.
async fn burst(
    apps: &[Router],
    rng: &mut Rng,
    kind: Kind,
    n: usize,
) -> HashMap<&'static str, (Tally, Tally, u64, Vec<&'static str>)> {
    let mut tasks = Vec::new();
    let one = rng.below(4) == 0;
    for _ in 0..n {
        // One subject in a quarter of the bursts: the most contention.
        let who = if one {
            SUBJECTS[0]
        } else {
            *rng.pick(&SUBJECTS)
        };
        let route = *rng.pick(&["a", "b", "t"]);
        let outcome = match kind {
            Kind::Plain => "ok",
            Kind::Mixed => *rng.pick(&[
                "ok",
                "ok",
                "ok",
                "ok",
                "err",
                "undo",
                "undoerr",
                "undostall",
                "stall",
                "drop",
                "drop",
            ]),
        };
        let sleep_us = if outcome == "drop" {
            1000 + rng.below(5000)
        } else {
            rng.below(3000)
        };
        // A deferred cost below the upfront unit gives back: not in plain
        // bursts, whose counters only grow.
        let tokens = match (route, kind) {
            ("t", Kind::Plain) => 1 + rng.below(3),
            ("t", Kind::Mixed) => rng.below(4),
            _ => 1,
        };
        let app = apps[rng.below(apps.len() as u64) as usize].clone();
        let (path_outcome, timeout) = match outcome {
            "stall" | "undostall" => (outcome, Duration::from_millis(20)),
            // Dropped anywhere: while the store charges, or in the handler.
            "drop" => ("ok", {
                let span = if rng.below(2) == 0 { 1000 } else { 5000 };
                Duration::from_micros(rng.below(span))
            }),
            o => (o, Duration::from_secs(10)),
        };
        let uri = format!("/{route}/{path_outcome}/{sleep_us}/{tokens}");
        tasks.push(tokio::spawn(async move {
            let request = Request::get(uri)
                .header("x-account-id", who)
                .body(Body::empty())
                .unwrap();
            let answer = tokio::time::timeout(timeout, app.oneshot(request)).await;
            let status = answer.map(|r| {
                let r = r.unwrap();
                let late = r
                    .headers()
                    .get("ratelimit")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.split(", ").find(|f| f.starts_with("\"a-hour\"")))
                    .and_then(|f| f.rsplit("t=").next()?.parse::<u64>().ok())
                    .is_some_and(|t| t > 1800);
                (r.status(), late)
            });
            (who, route, outcome, tokens, status)
        }));
    }
    // (served as admitted and still charged, admitted at all) per subject.
    let mut out: HashMap<&'static str, (Tally, Tally, u64, Vec<&'static str>)> = HashMap::new();
    let mut mix: std::collections::BTreeMap<String, u32> = Default::default();
    for task in tasks {
        let (who, route, outcome, tokens, status) = task.await.unwrap();
        *mix.entry(format!(
            "{outcome}:{:?}",
            status.as_ref().map(|s| s.0.as_u16()).ok()
        ))
        .or_default() += 1;
        let entry = out.entry(who).or_default();
        let Ok((status, late)) = status else {
            assert!(
                matches!(outcome, "stall" | "undostall" | "drop"),
                "{outcome} timed out"
            );
            continue;
        };
        assert!(
            status == StatusCode::OK
                || status == StatusCode::TOO_MANY_REQUESTS
                || (status == StatusCode::INTERNAL_SERVER_ERROR && outcome == "err")
                || (status == StatusCode::BAD_GATEWAY && outcome == "undoerr"),
            "{who} {route} {outcome}: {status}"
        );
        if status.is_server_error() {
            continue;
        }
        if status == StatusCode::TOO_MANY_REQUESTS {
            entry.3.push(route);
        }
        if status != StatusCode::OK {
            continue;
        }
        let admitted = &mut entry.1;
        admitted.all += 1;
        match route {
            "a" => admitted.a += 1,
            "b" => admitted.b += 1,
            _ => admitted.tokens += 1,
        }
        if outcome == "undo" {
            continue;
        }
        let kept = &mut entry.0;
        kept.all += 1;
        match route {
            "a" => kept.a += 1,
            "b" => kept.b += 1,
            _ => kept.tokens += tokens,
        }
        if route == "a" && late {
            entry.2 += 1;
        }
    }
    if std::env::var_os("CONTENTION_VERBOSE").is_some() {
        eprintln!("n={n} {mix:?}");
    }
    out
}

async fn check<St: Store>(
    label: &str,
    handle: &QuotaHandle<St>,
    served: &HashMap<&'static str, (Tally, Tally, u64, Vec<&'static str>)>,
    kind: Kind,
    n: usize,
    turn: Option<(&ManualClock, Timestamp, Timestamp)>,
) {
    for who in SUBJECTS {
        let (kept, admitted, late, _) = served.get(who).cloned().unwrap_or_default();
        let now = if let Some((clock, before, after)) = turn {
            // The hour turned during the burst: the later hour exactly,
            // the earlier one within its limit.
            clock.set(after);
            let late_used = used(handle, who).await;
            clock.set(before);
            let early_used = used(handle, who).await;
            clock.set(after);
            assert_eq!(late_used.a, late, "{label}: {who} a-hour after the turn");
            assert!(
                early_used.a <= A && early_used.a >= kept.a - late,
                "{label}: {who} a-hour before the turn {early_used:?} kept {kept:?} late {late}"
            );
            Tally {
                a: kept.a,
                ..late_used
            }
        } else {
            used(handle, who).await
        };
        assert_eq!(
            now,
            kept,
            "{label}: {who} store vs served ({kind_s} n={n}), admitted {admitted:?}",
            kind_s = if kind == Kind::Plain {
                "plain"
            } else {
                "mixed"
            }
        );
        assert!(
            kept.all <= ALL && (kept.a <= A || turn.is_some()) && kept.b <= B,
            "{label}: {who} over a limit {kept:?}"
        );
    }
}

async fn run_case(seed: u64, instances: usize, leased: bool) {
    let mut rng = Rng(seed);
    let clock = ManualClock::new("2026-12-04T10:00:00Z".parse::<Timestamp>().unwrap());
    let memory = MemoryStore::new();
    let (_, plain_handle) = app(memory.clone(), clock.clone());
    let kind = if rng.below(3) == 0 {
        Kind::Plain
    } else {
        Kind::Mixed
    };
    let n = 50 + rng.below(251) as usize;
    let label = format!("seed {seed} instances {instances} leased {leased}");
    let turns = rng.below(2) == 0;
    let before: Timestamp = "2026-12-04T10:59:59.9Z".parse().unwrap();
    let after: Timestamp = "2026-12-04T11:00:00.5Z".parse().unwrap();
    if turns {
        clock.set(before);
        let clock = clock.clone();
        let at = Duration::from_micros(rng.below(4000));
        tokio::spawn(async move {
            tokio::time::sleep(at).await;
            clock.set(after);
        });
    }
    let served = if leased {
        let stores: Vec<_> = (0..instances)
            .map(|_| LeasedStore::new(memory.clone()))
            .collect();
        let apps: Vec<_> = stores
            .iter()
            .map(|s| app(s.clone(), clock.clone()).0)
            .collect();
        let served = burst(&apps, &mut rng, kind, n).await;
        // Quiet: the stalled handlers are dropped; give-backs land.
        tokio::time::sleep(Duration::from_millis(30)).await;
        for s in &stores {
            s.shutdown().await;
        }
        served
    } else {
        let apps = vec![app(memory.clone(), clock.clone()).0];
        let served = burst(&apps, &mut rng, kind, n).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
        served
    };
    check(
        &label,
        &plain_handle,
        &served,
        kind,
        n,
        turns.then_some((&clock, before, after)),
    )
    .await;
    if kind == Kind::Plain && instances == 1 && !turns {
        // Nothing refunded, counters only grow: a refusal means one of its
        // quotas was full, and stays so.
        for who in SUBJECTS {
            let (_, _, _, refused) = served.get(who).cloned().unwrap_or_default();
            let now = used(&plain_handle, who).await;
            for route in refused {
                let full = now.all >= ALL
                    || match route {
                        "a" => now.a >= A,
                        "b" => now.b >= B,
                        _ => now.tokens >= TOKENS,
                    };
                assert!(full, "{label}: {who} refused on {route} with room: {now:?}");
            }
        }
    }
}

/// Plain burst, one app and one subject, one route: exactly the limit.
async fn exact_case(seed: u64, leased: bool) {
    let mut rng = Rng(seed);
    let clock = ManualClock::new("2026-12-04T10:00:00Z".parse::<Timestamp>().unwrap());
    let memory = MemoryStore::new();
    let (_, plain_handle) = app(memory.clone(), clock.clone());
    let lstore = LeasedStore::new(memory.clone());
    let router = if leased {
        app(lstore.clone(), clock.clone()).0
    } else {
        app(memory.clone(), clock.clone()).0
    };
    let route = *rng.pick(&["a", "b"]);
    let n = 60 + rng.below(200) as usize;
    let mut tasks = Vec::new();
    for _ in 0..n {
        let app = router.clone();
        let uri = format!("/{route}/ok/{}/1", rng.below(3000));
        tasks.push(tokio::spawn(async move {
            let request = Request::get(uri)
                .header("x-account-id", "acme")
                .body(Body::empty())
                .unwrap();
            app.oneshot(request).await.unwrap().status()
        }));
    }
    let mut ok = 0;
    for t in tasks {
        let s = t.await.unwrap();
        assert!(
            s == StatusCode::OK || s == StatusCode::TOO_MANY_REQUESTS,
            "{s}"
        );
        ok += u64::from(s == StatusCode::OK);
    }
    let limit = if route == "a" { A } else { B };
    assert_eq!(
        ok,
        limit.min(n as u64),
        "seed {seed} leased {leased} route {route} n {n}"
    );
    if leased {
        lstore.shutdown().await;
    }
    let now = used(&plain_handle, "acme").await;
    assert_eq!(now.all, ok, "seed {seed} leased {leased}");
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap()
}

fn cases() -> u64 {
    std::env::var("CONTENTION_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6)
}

fn base_seed() -> u64 {
    std::env::var("CONTENTION_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed)
}

#[test]
fn memory_store_under_contention() {
    let rt = runtime();
    for i in 0..cases() {
        rt.block_on(run_case(base_seed() + i, 1, false));
    }
}

#[test]
fn one_leased_store_under_contention() {
    let rt = runtime();
    for i in 0..cases() {
        rt.block_on(run_case(base_seed() + 1000 + i, 1, true));
    }
}

#[test]
fn several_leased_stores_under_contention() {
    let rt = runtime();
    for i in 0..cases() {
        let seed = base_seed() + 2000 + i;
        rt.block_on(run_case(seed, 2 + (seed % 2) as usize, true));
    }
}

#[test]
fn exactly_the_limit_is_admitted() {
    let rt = runtime();
    for i in 0..cases() {
        rt.block_on(exact_case(base_seed() + 3000 + i, false));
        rt.block_on(exact_case(base_seed() + 4000 + i, true));
    }
}
