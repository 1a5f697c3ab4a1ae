//! Two demo server processes sharing one real `redis-server` enforce one
//! quota exactly.

#![cfg(feature = "redis")]

mod redis_support;

mod demo_server;

use demo_server::start;

async fn status(addr: String, account: &str) -> u16 {
    demo_server::call(&addr, "GET", "/read", &[("x-account-id", account)])
        .await
        .status
}

async fn shared_quota_is_exact(anchor: &str) {
    let redis = redis_server_or_skip!();
    let url = redis.url();
    // A store timeout no busy machine reaches: exactness is the point, and
    // a charge that ran late would fail closed (a 503) and count nothing.
    let args = [
        "--limit",
        "20",
        "--period",
        "1d",
        "--anchor",
        anchor,
        "--store",
        &url,
        "--store-timeout",
        "5000",
    ];
    let servers = [start(&args), start(&args)];
    // Each server's first call loads the script and opens a connection.
    for server in &servers {
        assert_eq!(status(server.addr.clone(), "warm-up").await, 200);
    }
    // Interleaved calls, ten at a time: exactness is the point here, not
    // how a debug build copes with a cold burst on a two-core machine.
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(10));
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..60 {
        let gate = std::sync::Arc::clone(&gate);
        let addr = servers[i % 2].addr.clone();
        calls.spawn(async move {
            let _permit = gate.acquire_owned().await.unwrap();
            status(addr, "shared").await
        });
    }
    let statuses = calls.join_all().await;
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let refused = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!((ok, refused), (20, 40), "{statuses:?}");
    // Each process sees the other's spending.
    assert_eq!(status(servers[0].addr.clone(), "shared").await, 429);
    assert_eq!(status(servers[1].addr.clone(), "shared").await, 429);
    assert_eq!(status(servers[1].addr.clone(), "someone-else").await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_share_a_calendar_quota_exactly() {
    shared_quota_is_exact("calendar").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_share_a_first_use_quota_exactly() {
    shared_quota_is_exact("first-use").await;
}

/// `--store redis+unix://PATH`: the counters in a Redis reached on its Unix
/// socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_reaches_redis_on_its_unix_socket() {
    let socket = std::env::temp_dir().join(format!(
        "tower-quota-{}-{}.sock",
        std::process::id(),
        redis_support::free_port()
    ));
    let socket_arg = socket.to_str().expect("a UTF-8 temp path").to_owned();
    let redis = match redis_support::redis_available() {
        true => redis_support::RedisServer::start_with(&["--unixsocket", &socket_arg]),
        false => return,
    };
    let url = format!("redis+unix://{socket_arg}");
    let server = start(&["--limit", "2", "--period", "1d", "--store", &url]);
    let statuses = [
        status(server.addr.clone(), "by-socket").await,
        status(server.addr.clone(), "by-socket").await,
        status(server.addr.clone(), "by-socket").await,
    ];
    assert_eq!(statuses, [200, 200, 429]);
    // The counter is the one Redis holds, seen over TCP too.
    let keys = redis.cli(&["--scan", "--pattern", "*by-socket*"]);
    let key = keys
        .lines()
        .next()
        .expect("a counter for the subject")
        .trim();
    assert_eq!(redis.cli(&["HGET", key, "n"]).trim(), "2");
    drop(server);
    drop(redis);
    let _ = std::fs::remove_file(&socket);
}
