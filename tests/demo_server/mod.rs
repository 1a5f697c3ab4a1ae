//! Starting the demo server example and speaking HTTP/1.1 to it over TCP.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A running demo server, killed when dropped.
pub struct Server {
    child: Child,
    /// The rest of what the server prints, after its first line.
    stdout: BufReader<ChildStdout>,
    pub addr: String,
}

impl Server {
    /// Sends `signal` (`TERM`, `KILL`, `INT`) and waits for the process to
    /// end; returns what it printed since it started listening.
    pub fn stop(&mut self, signal: &str) -> String {
        let status = Command::new("kill")
            .args(["-s", signal, &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -s {signal}");
        let _ = self.child.wait();
        let mut rest = String::new();
        let _ = self.stdout.read_to_string(&mut rest);
        rest
    }
}

impl Server {
    /// Sends `signal` without waiting for the process.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args(["-s", signal, &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -s {signal}");
    }

    /// Waits `within` at most for the process to end; whether it did.
    pub fn ended_within(&mut self, within: std::time::Duration) -> bool {
        self.exit_within(within).is_some()
    }

    /// Waits `within` at most for the process to end; how it did.
    pub fn exit_within(&mut self, within: std::time::Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + within;
        while std::time::Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().ok().flatten() {
                return Some(status);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The demo server's binary, which `cargo test` builds beside the test
/// binaries.
pub fn binary() -> PathBuf {
    example("server")
}

/// The binary of example `name` (`cargo build --example NAME` first when
/// running one test alone).
pub fn example(name: &str) -> PathBuf {
    // Integration tests live in target/<profile>/deps; examples beside it.
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: `cargo test` builds the examples",
        path.display()
    );
    path
}

/// Starts the demo server on a free loopback port with `args`.
pub fn start(args: &[&str]) -> Server {
    start_example("server", args)
}

/// Starts example `name` on a free loopback port with `args`; it prints
/// `listening on http://ADDR` first.
pub fn start_example(name: &str, args: &[&str]) -> Server {
    let mut child = Command::new(example(name))
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    stdout.read_line(&mut line).unwrap();
    let Some(addr) = line
        .strip_prefix("listening on http://")
        .and_then(|rest| rest.split_whitespace().next())
    else {
        // Its error is on stderr, above.
        panic!("the {name} example did not start (first line {line:?}); with --store redis:// it needs the `redis` feature, which `cargo test --all-features` builds it with");
    };
    let addr = addr.to_owned();
    Server {
        child,
        stdout,
        addr,
    }
}

/// One response.
pub struct Reply {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Reply {
    /// The value of header `name`, if sent.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// Sends one request on a fresh connection.
pub async fn call(addr: &str, method: &str, path: &str, headers: &[(&str, &str)]) -> Reply {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\ncontent-length: 0\r\n"
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    Reply {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    }
}
