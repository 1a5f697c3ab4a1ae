//! Real `redis-server` processes on free loopback ports, for tests.
//!
//! When `redis-server` is not installed, [`redis_available`] prints a notice
//! and the tests skip, except under `CI=true`, where a missing server fails
//! the run: CI must never pass without running the Redis tests.

#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Whether `redis-server` can be run. Panics under `CI=true` when it cannot.
pub fn redis_available() -> bool {
    let found = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "redis-server is not installed, and CI=true: the Redis tests must run (apt-get install -y redis-server)"
        );
        // Straight to stderr: the test harness captures eprintln!.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "NOTICE: redis-server is not installed; skipping this Redis test (apt-get install -y redis-server)"
        );
    }
    found
}

/// Starts a server, or returns from the calling test when none can run.
#[macro_export]
macro_rules! redis_server_or_skip {
    () => {
        match $crate::redis_support::redis_available() {
            true => $crate::redis_support::RedisServer::start(),
            false => return,
        }
    };
}

/// A free loopback port (free when asked; the server binds it next).
/// A settle id (`Debt::id`) no other settle of this test binary has: each
/// debt a test settles is a new one, unless it sends one again on purpose.
pub fn settle_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// A loopback address where nothing answers, for as long as the returned
/// socket lives: the port is bound but never listened on, so connections are
/// refused and no other test's server can take it meanwhile.
pub fn dead_address() -> (std::net::SocketAddr, tokio::net::TcpSocket) {
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket
        .bind("127.0.0.1:0".parse().unwrap())
        .expect("a loopback port");
    let addr = socket.local_addr().expect("its address");
    (addr, socket)
}

/// A `redis-server` of its own, stopped and cleaned up on drop.
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
    extra: Vec<String>,
}

impl RedisServer {
    /// A standalone server.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// A server with extra `--option value` arguments.
    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_with_ports(extra, |_| Vec::new())
    }

    /// A server with extra arguments, some of which depend on the port it
    /// is given (e.g. a cluster bus port).
    pub fn start_with_ports(extra: &[&str], per_port: impl Fn(u16) -> Vec<String>) -> Self {
        // A free port may be taken by another test's server before this one
        // binds it: then try another.
        for _ in 0..10 {
            let port = free_port();
            let dir = std::env::temp_dir()
                .join(format!("tower-quota-redis-{}-{port}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("a scratch directory for redis-server");
            let mut extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
            extra.extend(per_port(port));
            let mut server = Self {
                port,
                dir,
                child: None,
                extra,
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("redis-server could not start on a free port in ten tries");
    }

    /// Starts the server; false when the port was taken.
    fn spawn(&mut self) -> bool {
        let mut command = Command::new("redis-server");
        command
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--maxmemory-policy", "noeviction", "--protected-mode", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut child = command.spawn().expect("redis-server starts");
        let pid = child.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if child.try_wait().ok().flatten().is_some() {
                return false;
            }
            if self.answers_ping() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} did not come up",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // The server that answered must be this one, not another test's.
        if !cli(self.port, &["info", "server"]).contains(&format!("process_id:{pid}")) {
            let _ = child.kill();
            let _ = child.wait();
            return false;
        }
        self.child = Some(child);
        true
    }

    fn answers_ping(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
        let mut reply = [0u8; 7];
        stream.write_all(b"PING\r\n").is_ok()
            && stream.read_exact(&mut reply).is_ok()
            && &reply == b"+PONG\r\n"
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// How many scripts (`EVALSHA`) the server has run since it started or
    /// its statistics were last reset.
    pub fn script_calls(&self) -> u64 {
        self.cli(&["info", "commandstats"])
            .lines()
            .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:{port}/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Kills the server at once (no save, no goodbye to clients).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port.
    pub fn restart(&mut self) {
        self.kill();
        assert!(
            self.spawn(),
            "redis-server could not start again on port {}",
            self.port
        );
    }

    /// Runs `redis-cli` against the server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Stops the server's process (SIGSTOP) until dropped or resumed: it
/// accepts bytes on its sockets but answers nothing.
pub struct Stopped {
    pid: u32,
    running: bool,
}

impl Stopped {
    pub fn new(server: &RedisServer) -> Self {
        let pid = server.pid().expect("the server runs");
        signal("-STOP", pid);
        Self {
            pid,
            running: false,
        }
    }

    pub fn resume(&mut self) {
        if !self.running {
            signal("-CONT", self.pid);
            self.running = true;
        }
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        self.resume();
    }
}

fn signal(which: &str, pid: u32) {
    let status = Command::new("kill")
        .args([which, &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill {which} {pid}");
}

/// Runs `redis-cli -p port args..` and returns its trimmed output.
pub fn cli(port: u16, args: &[&str]) -> String {
    let output = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// `count` cluster nodes on loopback, made one cluster with `replicas`
/// replicas per master, each voted failed after `node_timeout_ms` of
/// silence; returned once every node says the cluster is ok.
fn cluster_nodes(count: usize, replicas: usize, node_timeout_ms: u32) -> Vec<RedisServer> {
    let timeout = node_timeout_ms.to_string();
    let nodes: Vec<RedisServer> = (0..count)
        .map(|_| {
            RedisServer::start_with_ports(
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    &timeout,
                ],
                // The default bus port, port + 10000, may be taken or
                // past 65535.
                |_| vec!["--cluster-port".into(), free_port().to_string()],
            )
        })
        .collect();
    let addresses: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port()))
        .collect();
    let output = Command::new("redis-cli")
        .arg("--cluster")
        .arg("create")
        .args(&addresses)
        .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
        .output()
        .expect("redis-cli --cluster create runs");
    assert!(
        output.status.success(),
        "redis-cli --cluster create failed: {}",
        String::from_utf8_lossy(&output.stdout)
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    for node in &nodes {
        while !node.cli(&["cluster", "info"]).contains("cluster_state:ok") {
            assert!(
                Instant::now() < deadline,
                "the cluster did not become ready"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    nodes
}

/// The id of the node serving `key`'s slot, as node `ask` sees it.
fn slot_owner(ask: &RedisServer, key: &str) -> String {
    let slot: u16 = ask
        .cli(&["cluster", "keyslot", key])
        .parse()
        .expect("a slot");
    ask.cli(&["cluster", "nodes"])
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let serves = fields.get(8..)?.iter().any(|range| {
                let (low, high) = range.split_once('-').unwrap_or((range, range));
                match (low.parse::<u16>(), high.parse::<u16>()) {
                    (Ok(low), Ok(high)) => (low..=high).contains(&slot),
                    _ => false,
                }
            });
            serves.then(|| fields[0].to_owned())
        })
        .expect("a node serves every slot")
}

/// Three masters on loopback, slots spread over them, no replicas.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> Self {
        // Long enough that a node stopped for a few seconds is not voted
        // failed (which, without replicas, takes the whole cluster down).
        Self {
            nodes: cluster_nodes(3, 0, 15_000),
        }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// Which node serves `key`'s slot (its index in `nodes`).
    pub fn node_of(&self, key: &str) -> usize {
        let owner = slot_owner(&self.nodes[0], key);
        self.nodes
            .iter()
            .position(|node| node.cli(&["cluster", "myid"]) == owner)
            .expect("the slot's node is one of the cluster's")
    }

    /// An account held by each of the first three nodes, in their order,
    /// named `{prefix}-{n}` (its slot is the subject's alone, whatever the
    /// allowance and period).
    pub fn subject_per_node(&self, prefix: &str) -> [String; 3] {
        let namespace = tower_quota::Namespace::default();
        let mut on: [Option<String>; 3] = Default::default();
        for i in 0.. {
            let account = format!("{prefix}-{i}");
            let subject = tower_quota::Subject::account(account.as_str());
            let key = namespace.key(&subject, "read", "any");
            if let Some(node) = on.get_mut(self.node_of(key.as_str())) {
                node.get_or_insert(account);
            }
            if on.iter().all(Option::is_some) {
                break;
            }
        }
        on.map(|subject| subject.expect("every node holds a subject"))
    }

    /// Has node `node` announce `port` to clients (`cluster-announce-port`,
    /// e.g. a proxy's in front of it), and waits until every node names
    /// it there: clients learn the port from any of them.
    pub fn announce(&self, node: usize, port: u16) {
        let port = port.to_string();
        let set = self.nodes[node].cli(&["config", "set", "cluster-announce-port", &port]);
        assert_eq!(set, "OK");
        let id = self.nodes[node].cli(&["cluster", "myid"]);
        let address = format!(":{port}@");
        let deadline = Instant::now() + Duration::from_secs(20);
        for known in &self.nodes {
            while !known
                .cli(&["cluster", "nodes"])
                .lines()
                .any(|line| line.starts_with(&id) && line.contains(&address))
            {
                assert!(Instant::now() < deadline, "the new port was not announced");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// A [`SlowProxy`] in front of node `node`, which the node announces to
    /// clients (see [`announce`](Self::announce)).
    pub async fn slow_proxy(&self, node: usize) -> SlowProxy {
        let proxy = SlowProxy::start(self.nodes[node].port()).await;
        self.announce(node, proxy.port());
        proxy
    }

    /// A master joined to the cluster with no slot (as `redis-cli --cluster
    /// add-node` leaves it, before a resharding gives it some); its index.
    pub fn add_master(&mut self) -> usize {
        let node = RedisServer::start_with_ports(
            &[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "15000",
            ],
            |_| vec!["--cluster-port".into(), free_port().to_string()],
        );
        // `127.0.0.1:port@bus-port`: the bus port is not the default one.
        let seed = self.nodes[0].cli(&["cluster", "nodes"]);
        let myself = seed
            .lines()
            .find(|line| line.contains("myself"))
            .expect("a node lists itself");
        let address = myself.split_whitespace().nth(1).expect("an address");
        let (port, bus) = address
            .rsplit_once(':')
            .and_then(|(_, ports)| ports.split(',').next()?.split_once('@'))
            .expect("port@bus-port");
        assert_eq!(node.cli(&["cluster", "meet", "127.0.0.1", port, bus]), "OK");
        let id = node.cli(&["cluster", "myid"]);
        let deadline = Instant::now() + Duration::from_secs(20);
        for known in self.nodes.iter().chain([&node]) {
            while known.cli(&["cluster", "nodes"]).lines().count() < self.nodes.len() + 1
                || !known.cli(&["cluster", "nodes"]).contains(&id)
            {
                assert!(Instant::now() < deadline, "the new master was not met");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        while !node.cli(&["cluster", "info"]).contains("cluster_state:ok") {
            assert!(
                Instant::now() < deadline,
                "the new master did not learn the slots"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.nodes.push(node);
        self.nodes.len() - 1
    }
}

/// A TCP proxy in front of a server that answers slowly, one answer at a
/// time, once `slow` is called on it: each chunk of bytes from the server
/// is passed on `pace` after it came, and `pace` after the one before it,
/// as from a Redis whose every call takes that long to run. A call behind
/// others then waits for theirs first, while answers keep coming.
pub struct SlowProxy {
    addr: std::net::SocketAddr,
    pace_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
    connect_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl SlowProxy {
    /// A proxy to the server on `port`, passing answers on at once until
    /// `slow` is called.
    pub async fn start(port: u16) -> Self {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let target = format!("127.0.0.1:{port}");
        let pace_ms = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let pace = std::sync::Arc::clone(&pace_ms);
        let connect_ms = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let connect = std::sync::Arc::clone(&connect_ms);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let delay = Duration::from_millis(connect.load(Ordering::SeqCst));
                tokio::time::sleep(delay).await;
                let Ok(upstream) = tokio::net::TcpStream::connect(&target).await else {
                    continue;
                };
                // A large call (an `EVAL` with the script's text) is not
                // held back by Nagle's algorithm meeting a delayed ACK.
                let _ = client.set_nodelay(true);
                let _ = upstream.set_nodelay(true);
                let (mut client_read, mut client_write) = client.into_split();
                let (mut upstream_read, mut upstream_write) = upstream.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_read, &mut upstream_write).await;
                });
                let (chunks, mut paced) = tokio::sync::mpsc::unbounded_channel();
                tokio::spawn(async move {
                    let mut buffer = vec![0; 64 * 1024];
                    while let Ok(read @ 1..) = upstream_read.read(&mut buffer).await {
                        let came = tokio::time::Instant::now();
                        let _ = chunks.send((came, buffer[..read].to_vec()));
                    }
                });
                let pace = std::sync::Arc::clone(&pace);
                tokio::spawn(async move {
                    let mut last = tokio::time::Instant::now();
                    while let Some((came, chunk)) = paced.recv().await {
                        let pace = Duration::from_millis(pace.load(Ordering::SeqCst));
                        last = (came + pace).max(last + pace);
                        tokio::time::sleep_until(last).await;
                        if client_write.write_all(&chunk).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self {
            addr,
            pace_ms,
            connect_ms,
        }
    }

    /// The proxy's port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// From now on, one answer every `pace`.
    pub fn slow(&self, pace: Duration) {
        let pace = u64::try_from(pace.as_millis()).unwrap();
        self.pace_ms
            .store(pace, std::sync::atomic::Ordering::SeqCst);
    }

    /// From now on, a new connection reaches the server `delay` after it
    /// was accepted (a machine too busy to open one at once).
    pub fn slow_to_connect(&self, delay: Duration) {
        let delay = u64::try_from(delay.as_millis()).unwrap();
        self.connect_ms
            .store(delay, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A TCP proxy in front of a server, for the network between a store and
/// Redis: it can be cut (an outage: connections close, calls on them are
/// not passed on, new ones are closed at once) while the server and what it
/// holds (its scripts too) stay, and, once armed, loses the answer to the
/// next call of one operation of the counters script (`s` a settle, `r` a
/// refund...): it passes the call on, swallows whatever the server answers
/// on that connection from then on, and closes it, as a connection that
/// breaks after a call was sent. Redis runs the call; its caller never
/// learns it.
pub struct Wire {
    addr: std::net::SocketAddr,
    /// The operation whose next call loses its answer (0: none).
    armed: std::sync::Arc<std::sync::atomic::AtomicU8>,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    lost: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Wire {
    pub async fn start(port: u16) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
        use std::sync::Arc;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let target = format!("127.0.0.1:{port}");
        let armed = Arc::new(AtomicU8::new(0));
        let cut = Arc::new(AtomicBool::new(false));
        let lost = Arc::new(AtomicU64::new(0));
        let wire = Self {
            addr,
            armed: Arc::clone(&armed),
            cut: Arc::clone(&cut),
            lost: Arc::clone(&lost),
        };
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if cut.load(Ordering::SeqCst) {
                    continue;
                }
                let Ok(upstream) = tokio::net::TcpStream::connect(&target).await else {
                    continue;
                };
                let (mut client_read, mut client_write) = client.into_split();
                let (mut upstream_read, mut upstream_write) = upstream.into_split();
                let deaf = Arc::new(AtomicBool::new(false));
                let (armed, cut, lost) = (Arc::clone(&armed), Arc::clone(&cut), Arc::clone(&lost));
                let deafened = Arc::clone(&deaf);
                tokio::spawn(async move {
                    let mut buffer = vec![0; 64 * 1024];
                    while let Ok(read @ 1..) = client_read.read(&mut buffer).await {
                        if cut.load(Ordering::SeqCst) {
                            // Not passed on; the server closes its end.
                            return;
                        }
                        let chunk = &buffer[..read];
                        // The operation, as the call carries it.
                        let op = armed.load(Ordering::SeqCst);
                        let call = [b'\r', b'\n', b'$', b'1', b'\r', b'\n', op, b'\r', b'\n'];
                        if op != 0
                            && chunk.windows(call.len()).any(|w| w == call)
                            && armed.swap(0, Ordering::SeqCst) == op
                        {
                            deafened.store(true, Ordering::SeqCst);
                            lost.fetch_add(1, Ordering::SeqCst);
                        }
                        if upstream_write.write_all(chunk).await.is_err() {
                            return;
                        }
                    }
                });
                tokio::spawn(async move {
                    let mut buffer = vec![0; 64 * 1024];
                    while let Ok(read @ 1..) = upstream_read.read(&mut buffer).await {
                        if deaf.load(Ordering::SeqCst) {
                            // Swallowed, and the connection closed.
                            let _ = client_write.shutdown().await;
                            return;
                        }
                        if client_write.write_all(&buffer[..read]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        wire
    }

    pub fn url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// Cuts the wire (`true`) or mends it.
    pub fn cut(&self, cut: bool) {
        self.cut.store(cut, std::sync::atomic::Ordering::SeqCst);
    }

    /// Loses the answer to the next call of the script's operation `op`
    /// (`b's'` a settle, `b'r'` a refund).
    pub fn lose_next(&self, op: u8) {
        self.armed.store(op, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many answers it lost.
    pub fn lost(&self) -> u64 {
        self.lost.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Three masters and three replicas on loopback (`--cluster-replicas 1`),
/// each node voted failed after `node_timeout_ms` of silence: a master
/// that dies is replaced by its replica.
pub struct ReplicatedCluster {
    pub nodes: Vec<RedisServer>,
}

impl ReplicatedCluster {
    pub fn start(node_timeout_ms: u32) -> Self {
        let cluster = Self {
            nodes: cluster_nodes(6, 1, node_timeout_ms),
        };
        // Every replica in sync with its master.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = cluster.nodes.iter().all(|node| {
                let info = node.cli(&["info", "replication"]);
                info.contains("role:master") && info.contains("connected_slaves:1")
                    || info.contains("master_link_status:up")
            });
            if ready && cluster.masters().len() == 3 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not become ready"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        cluster
    }

    /// A running node (to ask the cluster things).
    fn live(&self) -> &RedisServer {
        self.nodes
            .iter()
            .find(|n| n.pid().is_some())
            .expect("a running node")
    }

    /// The indexes of the nodes that are masters (serving slots), as a
    /// running node sees them.
    pub fn masters(&self) -> Vec<usize> {
        let view = self.live().cli(&["cluster", "nodes"]);
        let mut masters: Vec<usize> = view
            .lines()
            .filter(|line| {
                line.contains("master")
                    && !line.contains("fail")
                    && line.split_whitespace().count() > 8
            })
            .filter_map(|line| {
                let id = line.split_whitespace().next()?;
                self.index_of(id)
            })
            .collect();
        masters.sort();
        masters
    }

    fn index_of(&self, id: &str) -> Option<usize> {
        self.nodes
            .iter()
            .position(|n| n.pid().is_some() && n.cli(&["cluster", "myid"]) == id)
    }

    /// The replica of master `master` (its index).
    pub fn replica_of(&self, master: usize) -> usize {
        let id = self.nodes[master].cli(&["cluster", "myid"]);
        let view = self.live().cli(&["cluster", "nodes"]);
        let replica = view
            .lines()
            .find(|line| line.split_whitespace().nth(3) == Some(id.as_str()))
            .and_then(|line| line.split_whitespace().next())
            .expect("the master has a replica");
        self.index_of(replica).expect("a known replica")
    }

    /// The master serving `key`'s slot (its index).
    pub fn master_of(&self, key: &str) -> usize {
        let owner = slot_owner(self.live(), key);
        self.index_of(&owner).expect("a known master")
    }

    /// `HGET key field` on the master serving `key` (following redirects).
    pub fn hget(&self, key: &str, field: &str) -> String {
        let node = self.live();
        let output = Command::new("redis-cli")
            .args(["-c", "-h", "127.0.0.1", "-p", &node.port().to_string()])
            .args(["hget", key, field])
            .output()
            .expect("redis-cli runs");
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }
}
