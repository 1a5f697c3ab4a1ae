//! Charges per second through the Redis store with 1, 16, 64 and 256
//! concurrent callers, beside `redis-benchmark -c 64 -P 1` running `EVALSHA`
//! of the same script with the same arguments, against the same server, in
//! the same run.
//!
//! ```text
//! cargo bench --features redis --bench redis
//! ```
//!
//! Environment: `BENCH_N` charges per round and caller count (default
//! 200000; a tenth of it with one caller), `BENCH_ROUNDS` rounds of each
//! (default 5), `BENCH_CALLERS` the caller counts (default `1,16,64,256`),
//! `BENCH_POOL` the store's number of multiplexed connections (default: the
//! store's default, 2), `BENCH_STOCK_POOL=1` to run the store on
//! deadpool-redis's stock pool instead (one pooled connection per charge;
//! give it `BENCH_POOL=64`), `BENCH_THREADS` the client runtime's worker
//! threads (default one per core; 1 is a current-thread runtime).

#[path = "../tests/redis_support/mod.rs"]
mod redis_support;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::{SignedDuration, Timestamp};
use tower_quota::store::{ChargeLine, ChargeRequest, Lifetime, RedisStore, Store};
use tower_quota::PeriodKey;

/// The concurrency of `redis-benchmark`, and the store's figure compared
/// with it.
const CALLERS: usize = 64;
const SUBJECTS: u64 = 10_000;
const LIMIT: u64 = 1_000_000_000_000;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not, and
    // only checks that the benchmark builds.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    if !redis_support::redis_available() {
        return;
    }
    let n = env("BENCH_N", 200_000);
    let rounds = env("BENCH_ROUNDS", 5);
    let pool = env("BENCH_POOL", tower_quota::store::redis::DEFAULT_POOL_SIZE);
    let callers: Vec<usize> = std::env::var("BENCH_CALLERS")
        .unwrap_or_else(|_| "1,16,64,256".into())
        .split(',')
        .filter_map(|c| c.trim().parse().ok())
        .collect();
    let charges = |callers: usize| if callers == 1 { (n / 10).max(1) } else { n };
    let server = redis_support::RedisServer::start();
    // BENCH_THREADS: the client's tokio worker threads (default: one per
    // core); 1 is a current-thread runtime.
    let threads = env("BENCH_THREADS", 0);
    let runtime = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        if threads > 1 {
            builder.worker_threads(threads);
        }
        builder
    }
    .enable_all()
    .build()
    .unwrap();
    // BENCH_STOCK_POOL=1: on deadpool-redis's stock pool, which pings every
    // connection it hands out, for comparison.
    let stock = std::env::var_os("BENCH_STOCK_POOL").is_some();
    let builder = if stock {
        let mut config = deadpool_redis::Config::from_url(server.url());
        config.pool = Some(deadpool_redis::PoolConfig::new(pool));
        let pool = config
            .create_pool(Some(deadpool_redis::Runtime::Tokio1))
            .unwrap();
        RedisStore::builder_from_pool(pool)
    } else {
        RedisStore::builder(server.url()).pool_size(pool)
    };
    let store = builder.timeout(Duration::from_secs(1)).build().unwrap();
    runtime.block_on(store.preload()).unwrap();

    // Every charge: one calendar line of one of SUBJECTS subjects, ending an
    // hour from now, always with room.
    let now = Timestamp::now();
    let end = now + SignedDuration::from_hours(1);
    let ttl_ms = end.as_millisecond() - now.as_millisecond() + 60_000 + 60_000;
    runtime.block_on(charge_all(&store, CALLERS, now, end, 1_000));

    let redis_benchmark_args: Vec<String> = [
        "-h",
        "127.0.0.1",
        "-p",
        &server.port().to_string(),
        "-c",
        &CALLERS.to_string(),
        "-P",
        "1",
        "-n",
        &n.to_string(),
        "-r",
        &SUBJECTS.to_string(),
        "--csv",
        "EVALSHA",
        store.script_sha(),
        "1",
        "quota:{account:__rand_int__}:default:2026-12-02",
        "c",
        &now.as_millisecond().to_string(),
        &LIMIT.to_string(),
        "1",
        "c",
        // The store adds grace and jitter from the key; a fixed TTL of the
        // same size here.
        &ttl_ms.to_string(),
        // The window's end, recorded in a new calendar counter.
        &end.as_millisecond().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();

    println!(
        "redis-server {}",
        server
            .cli(&["info", "server"])
            .lines()
            .find(|l| l.starts_with("redis_version"))
            .unwrap_or("")
    );
    let kind = if stock {
        "a stock deadpool-redis pool of"
    } else {
        "multiplexed connections:"
    };
    println!(
        "store: {callers:?} concurrent callers, {kind} {pool}, {n} charges per round ({} with one caller)",
        charges(1)
    );
    println!("redis-benchmark {}", redis_benchmark_args.join(" "));
    let mut store_rates: Vec<Vec<f64>> = vec![Vec::new(); callers.len()];
    let mut store_rates_64 = Vec::new();
    let mut baseline_rates = Vec::new();
    let server_pid = server.pid().expect("the server runs");
    for round in 1..=rounds {
        let mut store_rate = f64::NAN;
        let (mut cpu0, mut cpu1, mut server0, mut server1) = (0.0, 0.0, 0.0, 0.0);
        for (i, &c) in callers.iter().enumerate() {
            let count = charges(c);
            let (c0, s0) = (
                cpu_seconds("self", Own),
                cpu_seconds(&server_pid.to_string(), Own),
            );
            let calls0 = server.script_calls();
            let started = Instant::now();
            runtime.block_on(charge_all(&store, c, now, end, count));
            let rate = count as f64 / started.elapsed().as_secs_f64();
            let calls = server.script_calls() - calls0;
            let (c1, s1) = (
                cpu_seconds("self", Own),
                cpu_seconds(&server_pid.to_string(), Own),
            );
            println!(
                "round {round}: RedisStore, {c:>3} callers: {rate:>9.0} charges/s, {:.1} charges per script call",
                count as f64 / calls.max(1) as f64
            );
            store_rates[i].push(rate);
            if c == CALLERS {
                (store_rate, cpu0, cpu1, server0, server1) = (rate, c0, c1, s0, s1);
            }
        }
        if store_rate.is_nan() {
            continue;
        }

        let (child0, server2) = (
            cpu_seconds("self", Children),
            cpu_seconds(&server_pid.to_string(), Own),
        );
        let output = Command::new("redis-benchmark")
            .args(&redis_benchmark_args)
            .output()
            .expect("redis-benchmark runs");
        let (child1, server3) = (
            cpu_seconds("self", Children),
            cpu_seconds(&server_pid.to_string(), Own),
        );
        let per = |cpu: f64| cpu / n as f64 * 1e6;
        println!(
            "round {round}: CPU per request, µs: store client ({CALLERS} callers) {:.1}, its server {:.1}; redis-benchmark {:.1}, its server {:.1}",
            per(cpu1 - cpu0),
            per(server1 - server0),
            per(child1 - child0),
            per(server3 - server2)
        );
        let text = String::from_utf8_lossy(&output.stdout);
        let baseline_rate = parse_rps(&text)
            .unwrap_or_else(|| panic!("no rate in redis-benchmark's output: {text}"));
        println!(
            "round {round}: RedisStore ({CALLERS} callers) {store_rate:>9.0} charges/s   redis-benchmark EVALSHA {baseline_rate:>9.0} req/s   ratio {:.2}",
            store_rate / baseline_rate
        );
        store_rates_64.push(store_rate);
        baseline_rates.push(baseline_rate);
    }
    for (&c, rates) in callers.iter().zip(store_rates) {
        println!(
            "median: RedisStore, {c:>3} callers: {:.0} charges/s",
            median(rates)
        );
    }
    if store_rates_64.is_empty() {
        return;
    }
    // Rounds are paired (store, then redis-benchmark, back to back), so the
    // median of the per-round ratios discounts load that comes and goes.
    let ratios: Vec<f64> = store_rates_64
        .iter()
        .zip(&baseline_rates)
        .map(|(s, b)| s / b)
        .collect();
    let (store_rate, baseline_rate) = (median(store_rates_64), median(baseline_rates));
    println!(
        "median: RedisStore ({CALLERS} callers) {store_rate:.0} charges/s, redis-benchmark {baseline_rate:.0} req/s, ratio of medians {:.2}, median ratio {:.2}",
        store_rate / baseline_rate,
        median(ratios)
    );
    let keys = server.cli(&["dbsize"]);
    println!("counters in the server: {keys}");
}

async fn charge_all(store: &RedisStore, callers: usize, now: Timestamp, end: Timestamp, n: usize) {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = callers;
    let mut callers = tokio::task::JoinSet::new();
    for caller in 0..count {
        let store = store.clone();
        let next = Arc::clone(&next);
        callers.spawn(async move {
            let mut subject = (caller as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < n {
                subject = subject
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let key = PeriodKey::from_string(format!(
                    "quota:{{account:{:012}}}:default:2026-12-02",
                    (subject >> 33) % SUBJECTS
                ));
                let request = ChargeRequest {
                    charged_at: None,
                    now,
                    lines: smallvec::smallvec![ChargeLine {
                        key,
                        limit: LIMIT,
                        cost: 1,
                        lifetime: Lifetime::Calendar { start: now, end },
                        shadow_limit: None,
                    }],
                };
                let outcome = store.charge(request).await.expect("a charge");
                assert!(outcome.admitted);
            }
        });
    }
    while let Some(result) = callers.join_next().await {
        result.unwrap();
    }
}

#[derive(Clone, Copy)]
enum Cpu {
    Own,
    Children,
}
use Cpu::{Children, Own};

/// User plus system CPU seconds of a process (or of its waited-for
/// children), from `/proc`; zero where there is no `/proc`.
fn cpu_seconds(pid: &str, which: Cpu) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name, which is in parentheses.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let (user, system) = match which {
        Cpu::Own => (11, 12),
        Cpu::Children => (13, 14),
    };
    let ticks: f64 = [user, system]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<f64>().ok())
        .sum();
    ticks / 100.0
}

/// The rate in `redis-benchmark --csv` output: the line after the header,
/// second field.
fn parse_rps(csv: &str) -> Option<f64> {
    let line = csv.lines().find(|l| l.starts_with("\"EVALSHA"))?;
    line.split(',').nth(1)?.trim_matches('"').parse().ok()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
