//! Two demo server processes sharing one real `redis-server` enforce one
//! quota exactly.

#![cfg(feature = "redis")]

mod redis_support;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(args: &[&str]) -> Server {
    // Integration tests live in target/<profile>/deps; examples beside it.
    let exe = std::env::current_exe().unwrap();
    let binary: PathBuf = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("server");
    assert!(
        binary.exists(),
        "{} is missing: `cargo test` builds the examples",
        binary.display()
    );
    let mut child = Command::new(binary)
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let Some(addr) = line
        .strip_prefix("listening on http://")
        .and_then(|rest| rest.split_whitespace().next())
    else {
        // Its error is on stderr, above.
        panic!(
            "the demo server did not start; it needs the `redis` feature, which \
             `cargo test --all-features` builds it with (first line {line:?})"
        );
    };
    let addr = addr.to_owned();
    Server { child, addr }
}

async fn status(addr: String, account: &str) -> u16 {
    let mut stream = TcpStream::connect(&addr).await.unwrap();
    let request = format!(
        "GET /read HTTP/1.1\r\nhost: test\r\nconnection: close\r\nx-account-id: {account}\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8_lossy(&raw);
    raw.split_whitespace().nth(1).unwrap().parse().unwrap()
}

async fn shared_quota_is_exact(anchor: &str) {
    let redis = redis_server_or_skip!();
    let url = redis.url();
    let args = [
        "--limit", "20", "--period", "1d", "--anchor", anchor, "--store", &url,
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
