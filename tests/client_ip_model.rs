//! A seeded random walk of requests keyed by `ClientIp`: peers (over a
//! loopback listener served with `into_make_service_with_connect_info`, or
//! put in the request as `ConnectInfo`, `SocketAddr` or `IpAddr`) behind
//! trusted proxies or not, with `X-Forwarded-For` or RFC 7239 `Forwarded`
//! chains (ports, brackets, quoted values, escapes, obfuscated ids,
//! `unknown`, several lines, hostile entries, chains past the hop limit),
//! IPv4-mapped and NAT64 forms, random IPv4 and IPv6 groupings and trusted
//! networks written in IPv4, IPv6, mapped and NAT64 form. A model written
//! from the rustdoc alone says which counter each request is charged to (or
//! that it is refused 400); the support router, asked for an address or a
//! network (`%2F`) in any form, must show the model's count for the counter
//! the model says that name reaches.
//!
//! `CLIENT_IP_MODEL_CASES` sets how many cases run (default 6),
//! `CLIENT_IP_MODEL_SEED` the first seed, `CLIENT_IP_MODEL_STEPS` the
//! requests per case (default 60), `CLIENT_IP_MODEL_TRACE` prints each step.

mod seeded;

use seeded::Rng;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::Router;
use http::{HeaderValue, Request};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;
use tower_quota::{ClientIp, ManualClock, ProxyHeader, Quota, QuotaPolicy};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// The documented canonical form: IPv4-mapped and NAT64 (`64:ff9b::/96`)
/// addresses are the IPv4 address they carry.
fn canonical(addr: IpAddr) -> IpAddr {
    let IpAddr::V6(v6) = addr else { return addr };
    let s = v6.segments();
    let o = v6.octets();
    if s[..6] == [0, 0, 0, 0, 0, 0xffff] || s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        IpAddr::V4(Ipv4Addr::new(o[12], o[13], o[14], o[15]))
    } else {
        addr
    }
}

/// `addr` with all but its first `bits` bits cleared.
fn masked(addr: IpAddr, bits: u8) -> IpAddr {
    match addr {
        IpAddr::V4(v4) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(bits)).unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from(u32::from(v4) & mask))
        }
        IpAddr::V6(v6) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(bits)).unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask))
        }
    }
}

fn contains(net: (IpAddr, u8), addr: IpAddr) -> bool {
    net.0.is_ipv4() == addr.is_ipv4() && masked(addr, net.1) == net.0
}

/// One case's configuration, as the model reads it.
struct Config {
    v4: u8,
    v6: u8,
    header: ProxyHeader,
    /// The trusted networks, canonical (what the rustdoc says they mean).
    trusted: Vec<(IpAddr, u8)>,
}

impl Config {
    fn trusts(&self, addr: IpAddr) -> bool {
        let addr = canonical(addr);
        self.trusted.iter().any(|&net| contains(net, addr))
    }

    /// The counter a client at `addr` is charged to.
    fn id(&self, addr: IpAddr) -> String {
        self.group(canonical(addr))
    }

    /// The id of the network of `addr`, as grouped.
    fn group(&self, addr: IpAddr) -> String {
        let (full, group) = if addr.is_ipv4() {
            (32, self.v4)
        } else {
            (128, self.v6)
        };
        if group == full {
            addr.to_string()
        } else {
            format!("{}/{group}", masked(addr, group))
        }
    }

    /// What a support call naming the network `addr/bits` reaches: its
    /// counter, or `None` (a 400) when it spans several.
    fn named_net(&self, addr: IpAddr, bits: u8) -> Option<String> {
        let (addr, bits) = match (addr, canonical(masked(addr, bits))) {
            (IpAddr::V6(_), IpAddr::V4(v4)) if bits >= 96 => (IpAddr::V4(v4), bits - 96),
            _ => (masked(addr, bits), bits),
        };
        let group = if addr.is_ipv4() { self.v4 } else { self.v6 };
        // Narrower than the grouping but wider than a /96 of IPv4 clients
        // it holds (IPv4-mapped, NAT64): those and its IPv6 clients are on
        // different counters.
        let holds_ipv4_clients = addr.is_ipv6()
            && bits < 96
            && ["::ffff:0:0", "64:ff9b::"]
                .iter()
                .any(|folded| masked(folded.parse().unwrap(), bits) == addr);
        if bits > group && holds_ipv4_clients {
            return None;
        }
        (bits >= group).then(|| self.group(addr))
    }
}

/// Trusted networks as configured, and what they mean.
const TRUSTABLE: &[(&str, &str, u8)] = &[
    ("10.0.0.0/8", "10.0.0.0", 8),
    ("fd00::/8", "fd00::", 8),
    ("192.0.2.1", "192.0.2.1", 32),
    ("::ffff:198.51.100.0/120", "198.51.100.0", 24),
    ("64:ff9b::a00:0/104", "10.0.0.0", 8),
    ("127.0.0.0/8", "127.0.0.0", 8),
    ("::1", "::1", 128),
    ("2001:db8:1::/48", "2001:db8:1::", 48),
    ("::ffff:203.0.113.64/122", "203.0.113.64", 26),
];

/// Addresses to draw from: few, so that groups collide.
fn address(rng: &mut Rng) -> IpAddr {
    let v4 = |rng: &mut Rng| {
        let bases = [
            [203, 0, 113, 0],
            [198, 51, 100, 0],
            [10, 0, 0, 0],
            [192, 0, 2, 0],
            [127, 0, 0, 0],
            [203, 0, 112, 0],
        ];
        let mut o = *rng.pick(&bases);
        o[3] = *rng.pick(&[1, 2, 7, 64, 65, 130, 255]);
        if rng.below(6) == 0 {
            o[2] ^= 1 << rng.below(8);
        }
        Ipv4Addr::from(o)
    };
    match rng.below(8) {
        0..=2 => IpAddr::V4(v4(rng)),
        3 => IpAddr::V6(v4(rng).to_ipv6_mapped()),
        4 => IpAddr::V6(Ipv6Addr::from(
            (0x64_ff9b_u128 << 96) | u128::from(u32::from(v4(rng))),
        )),
        _ => {
            let bases = [
                "2001:db8:1:2::",
                "2001:db8:1:3::",
                "2001:db8:2::",
                "fd00::",
                "::",
                "64:ff9b:1::",
            ];
            let base = u128::from(rng.pick(&bases).parse::<Ipv6Addr>().unwrap());
            // A few bits set anywhere: inside or outside of the groups.
            let mut n = base | u128::from(rng.below(4) as u8);
            for _ in 0..rng.below(3) {
                n ^= 1 << rng.below(128);
            }
            IpAddr::V6(Ipv6Addr::from(n))
        }
    }
}

/// An address the case trusts, mostly.
fn trusted_address(rng: &mut Rng, cfg: &Config) -> IpAddr {
    let mut addr = address(rng);
    for _ in 0..30 {
        if cfg.trusts(addr) {
            break;
        }
        addr = address(rng);
    }
    addr
}

/// `addr` as an entry may write it: with a port, in brackets, upper case.
fn written(rng: &mut Rng, addr: IpAddr) -> String {
    let port = *rng.pick(&["4711", "1", "65535", "_x1", "_a.b-c"]);
    match addr {
        IpAddr::V4(v4) => match rng.below(3) {
            0 => format!("{v4}:{port}"),
            _ => v4.to_string(),
        },
        IpAddr::V6(v6) => {
            let text = match rng.below(3) {
                0 => v6.to_string().to_uppercase(),
                1 => {
                    let s = v6.segments();
                    s.map(|s| format!("{s:04x}")).join(":")
                }
                _ => v6.to_string(),
            };
            match rng.below(3) {
                0 => format!("[{text}]:{port}"),
                1 => format!("[{text}]"),
                _ => text,
            }
        }
    }
}

/// How list elements are put together.
const SEPARATORS: [&str; 3] = [",", ", ", " ,\t"];

/// What an entry is, for the model.
#[derive(Clone, Debug)]
enum Entry {
    Client(IpAddr),
    /// Refused when read.
    Bad,
    /// Nothing at all (an empty list element).
    Empty,
}

/// One list element of the chosen header, and what it is. `opens` tells an
/// element that leaves a quote open (it swallows the rest of its line).
fn element(rng: &mut Rng, cfg: &Config, addr: Option<IpAddr>) -> (String, Entry, bool) {
    let forwarded = cfg.header == ProxyHeader::Forwarded;
    if let Some(addr) = addr {
        let text = written(rng, addr);
        if !forwarded {
            return (text, Entry::Client(addr), false);
        }
        let name = *rng.pick(&["for", "For", "FOR"]);
        let quote = text.contains([':', '[']) || rng.below(3) == 0;
        let node = if quote && rng.below(3) == 0 {
            format!(
                "{name}=\"{}\"",
                text.replace('[', "\\[").replace(']', "\\]")
            )
        } else if quote {
            format!("{name}=\"{text}\"")
        } else {
            format!("{name}={text}")
        };
        let text = match rng.below(5) {
            0 => format!("proto=https;{node}"),
            1 => format!("{node};by=\"[fd00::1]:80\";host=\"a,b;c\""),
            2 => format!("{node} ; proto=http"),
            _ => node,
        };
        return (text, Entry::Client(addr), false);
    }
    if rng.below(4) == 0 {
        return (" ".repeat(rng.below(3) as usize), Entry::Empty, false);
    }
    // Hostile: never an address, whatever else it is.
    let mut garbage: String = (0..1 + rng.below(12))
        .map(|_| char::from(*rng.pick(b"0123456789abcdefghz.:[]/%- ")))
        .collect();
    garbage.insert(rng.below(garbage.len() as u64 + 1) as usize, 'g');
    let garbage = garbage.trim().to_owned();
    let common = [
        "unknown",
        "UNKNOWN",
        "_hidden",
        "1.2.3",
        "300.1.1.1",
        "203.0.113.7:",
        "203.0.113.7:123456",
        "[2001:db8::1",
        "[203.0.113.7]",
        "fe80::1%eth0",
        "01.2.3.4",
        "2001:db8::1:4711:x",
    ];
    if !forwarded {
        let text = match rng.below(4) {
            0 => garbage,
            1 => "\"203.0.113.7\"".to_owned(),
            _ => rng.pick(&common).to_string(),
        };
        return (text, Entry::Bad, false);
    }
    match rng.below(6) {
        0 => (format!("for=\"{garbage}\""), Entry::Bad, false),
        1 => (format!("for={}", rng.pick(&common)), Entry::Bad, false),
        2 => {
            let bad = [
                "proto=https",
                "for=203.0.113.7;for=203.0.113.8",
                "for",
                "for=203.0.113.7;a b=1",
                "for=203.0.113.7;=1",
                "for=\"_x\"",
                "for=\"\"",
                ";",
            ];
            (rng.pick(&bad).to_string(), Entry::Bad, false)
        }
        _ => {
            let open = [
                "for=203.0.113.7;x=\"",
                "for=\"203.0.113.7",
                "for=6.6.6.6;\"x",
                "for=\"[2001:db8::1]\\\"",
                "\"for=6.6.6.6",
            ];
            (rng.pick(&open).to_string(), Entry::Bad, true)
        }
    }
}

/// The request's answer by the model: the counter, or `None` for a 400.
fn model(cfg: &Config, peer: IpAddr, lines: &[Vec<Entry>]) -> Option<String> {
    if !cfg.trusts(peer) {
        return Some(cfg.id(peer));
    }
    let entries: Vec<&Entry> = lines
        .iter()
        .flatten()
        .filter(|e| !matches!(e, Entry::Empty))
        .collect();
    let mut leftmost = None;
    for entry in entries.iter().rev().take(64) {
        match entry {
            Entry::Client(addr) if cfg.trusts(*addr) => leftmost = Some(*addr),
            Entry::Client(addr) => return Some(cfg.id(*addr)),
            _ => return None,
        }
    }
    if entries.len() > 64 {
        return None;
    }
    Some(cfg.id(leftmost.unwrap_or(peer)))
}

/// Sends a request on a fresh loopback connection, as its bytes; the status.
async fn over_http(addr: SocketAddr, headers: &[(&str, Vec<u8>)]) -> u16 {
    let mut request = b"GET /read HTTP/1.1\r\nhost: t\r\nconnection: close\r\n".to_vec();
    for (name, value) in headers {
        request.extend_from_slice(format!("{name}: ").as_bytes());
        request.extend_from_slice(value);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"\r\n");
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(&request).await.unwrap();
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw).await;
    let head = String::from_utf8_lossy(&raw);
    head.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no answer (a panic?): {head:?}"))
}

async fn run_case(seed: u64, steps: u64, trace: bool) -> u64 {
    let mut rng = Rng(seed);
    let header = if rng.below(2) == 0 {
        ProxyHeader::XForwardedFor
    } else {
        ProxyHeader::Forwarded
    };
    let any_v4 = 1 + rng.below(32) as u8;
    let v4 = *rng.pick(&[32, 32, 24, 16, any_v4]);
    let any_v6 = 1 + rng.below(128) as u8;
    let v6 = *rng.pick(&[64, 64, 128, 48, 56, 96, any_v6]);
    let mut extractor = ClientIp::new()
        .proxy_header(header)
        .ipv4_prefix(v4)
        .ipv6_prefix(v6);
    let mut trusted = Vec::new();
    for &(text, net, bits) in TRUSTABLE {
        if rng.below(2) == 0 {
            extractor = extractor.trust_proxy_cidrs([text]);
            trusted.push((ip(net), bits));
        }
    }
    let cfg = Config {
        v4,
        v6,
        header,
        trusted,
    };
    let clock = ManualClock::new("2026-12-02T12:00:00Z".parse().unwrap());
    let policy = QuotaPolicy::builder(extractor).clock(clock).build();
    let app = Router::new()
        .route("/read", get(|| async { "read" }))
        .route_layer(policy.layer(Quota::daily(100_000).allowance("read")));
    let admin = Router::new().nest("/admin", policy.handle().router());
    // Served on IPv4 loopback, and on IPv6 loopback where the host has one.
    let mut served = Vec::new();
    for at in ["127.0.0.1:0", "[::1]:0"] {
        let Ok(listener) = TcpListener::bind(at).await else {
            continue;
        };
        served.push(listener.local_addr().unwrap());
        let server = app.clone();
        tokio::spawn(async move {
            axum::serve(
                listener,
                server.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
            .unwrap()
        });
    }
    let name = match header {
        ProxyHeader::XForwardedFor => "x-forwarded-for",
        _ => "forwarded",
    };
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut seen: Vec<IpAddr> = Vec::new();
    for step in 0..steps {
        let what = format!(
            "seed {seed} step {step} ({header:?}, /{v4}, /{v6}, {:?})",
            cfg.trusted
        );
        // The chain, right to left: trusted hops, the client, the
        // client's own inventions; hostile entries anywhere.
        let long = rng.below(12) == 0;
        let mut chain: Vec<Option<IpAddr>> = Vec::new();
        let hops = if long {
            60 + rng.below(10)
        } else {
            rng.below(3)
        };
        for _ in 0..hops {
            let hop = if long || rng.below(2) == 0 {
                trusted_address(&mut rng, &cfg)
            } else {
                address(&mut rng)
            };
            chain.push(if rng.below(20) == 0 { None } else { Some(hop) });
        }
        for _ in 0..rng.below(4) {
            chain.push(if rng.below(5) == 0 {
                None
            } else {
                Some(address(&mut rng))
            });
        }
        chain.reverse();
        // Laid out on one to three lines.
        let mut lines: Vec<(String, Vec<Entry>, bool)> = vec![(String::new(), Vec::new(), false)];
        for hop in chain {
            if !lines.last().unwrap().1.is_empty() && rng.below(5) == 0 && lines.len() < 3 {
                lines.push((String::new(), Vec::new(), false));
            }
            let (text, entry, opens) = element(&mut rng, &cfg, hop);
            let (line, entries, open) = lines.last_mut().unwrap();
            *open = opens;
            if !entries.is_empty() || rng.below(4) == 0 {
                let separator = *rng.pick(&SEPARATORS);
                line.push_str(separator);
            }
            line.push_str(&text);
            entries.push(entry);
            if opens {
                // The rest of this line is inside its quote.
                lines.push((String::new(), Vec::new(), false));
            }
        }
        let mut values: Vec<Vec<u8>> = Vec::new();
        let mut read: Vec<Vec<Entry>> = Vec::new();
        for (line, entries, open) in lines {
            if line.trim().is_empty() && rng.below(2) == 0 {
                continue;
            }
            let mut value = line.into_bytes();
            let mut entries = entries;
            if rng.below(25) == 0 && !open {
                value.extend_from_slice(b", \xff\xfe");
                entries.push(Entry::Bad);
            }
            values.push(value);
            read.push(entries);
        }
        // The peer, and how it is handed over.
        let via = rng.below(5);
        let over = *rng.pick(&served);
        let peer = match via {
            0 => over.ip(),
            _ if rng.below(3) > 0 => trusted_address(&mut rng, &cfg),
            _ => address(&mut rng),
        };
        let want = model(&cfg, peer, &read);
        let status = if via == 0 {
            let headers: Vec<(&str, Vec<u8>)> = values.iter().map(|v| (name, v.clone())).collect();
            over_http(over, &headers).await
        } else {
            let mut request = Request::get("/read").body(Body::empty()).unwrap();
            for value in &values {
                request
                    .headers_mut()
                    .append(name, HeaderValue::from_bytes(value).unwrap());
            }
            let socket = SocketAddr::new(peer, 4711);
            let other = SocketAddr::new(address(&mut rng), 1);
            match via {
                1 => {
                    request.extensions_mut().insert(ConnectInfo(socket));
                    // ConnectInfo comes first.
                    request.extensions_mut().insert(other);
                }
                2 => {
                    request.extensions_mut().insert(socket);
                    request.extensions_mut().insert(other.ip());
                }
                3 => {
                    request.extensions_mut().insert(peer);
                }
                _ => {
                    request.extensions_mut().insert(ConnectInfo(socket));
                }
            }
            app.clone()
                .oneshot(request)
                .await
                .unwrap()
                .status()
                .as_u16()
        };
        if trace {
            let shown: Vec<_> = values.iter().map(|v| String::from_utf8_lossy(v)).collect();
            eprintln!("{what}: {peer} {shown:?} -> {status} ({want:?})");
        }
        let shown = || {
            values
                .iter()
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .collect::<Vec<_>>()
        };
        match &want {
            Some(id) => {
                assert_eq!(status, 200, "{what}: peer {peer} {:?}: want {id}", shown());
                *counts.entry(id.clone()).or_default() += 1;
            }
            None => assert_eq!(status, 400, "{what}: peer {peer} {:?}", shown()),
        }
        seen.push(peer);
        seen.extend(read.iter().flatten().filter_map(|e| match e {
            Entry::Client(a) => Some(*a),
            _ => None,
        }));
        // Read a counter through the support router by some name.
        for _ in 0..rng.below(3) {
            let addr = if rng.below(4) == 0 {
                address(&mut rng)
            } else {
                *rng.pick(&seen)
            };
            let full = if addr.is_ipv4() { 32 } else { 128 };
            let (text, reaches) = match rng.below(4) {
                0 => {
                    let (addr, full) = match canonical(addr) {
                        IpAddr::V4(v4) if rng.below(3) == 0 => {
                            (IpAddr::V6(v4.to_ipv6_mapped()), 128)
                        }
                        IpAddr::V4(v4) if rng.below(2) == 0 => (
                            IpAddr::V6(Ipv6Addr::from(
                                (0x64_ff9b_u128 << 96) | u128::from(u32::from(v4)),
                            )),
                            128,
                        ),
                        _ => (addr, full),
                    };
                    let bits = if full == 128 && addr.is_ipv6() && rng.below(2) == 0 {
                        (96 + rng.below(33)) as u8
                    } else {
                        rng.below(full + 1) as u8
                    };
                    let net = masked(addr, bits);
                    (format!("{net}%2F{bits}"), cfg.named_net(net, bits))
                }
                1 => {
                    let text = match canonical(addr) {
                        IpAddr::V4(v4) if rng.below(2) == 0 => format!("::ffff:{v4}"),
                        IpAddr::V4(v4) => format!("64:ff9b::{v4}"),
                        v6 => v6.to_string().to_uppercase(),
                    };
                    (text.replace(':', "%3A"), Some(cfg.id(addr)))
                }
                _ => (addr.to_string(), Some(cfg.id(addr))),
            };
            let request = Request::get(format!("/admin/quota/ip/{text}"))
                .body(Body::empty())
                .unwrap();
            let response = admin.clone().oneshot(request).await.unwrap();
            let status = response.status().as_u16();
            let body = axum::body::to_bytes(response.into_body(), 1 << 16)
                .await
                .unwrap();
            let body = String::from_utf8_lossy(&body);
            match reaches {
                None => assert_eq!(status, 400, "{what}: support {text}: {body}"),
                Some(id) => {
                    assert_eq!(status, 200, "{what}: support {text} ({id}): {body}");
                    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
                    assert_eq!(body["subject"]["id"], id.as_str(), "{what}: support {text}");
                    let used = counts.get(&id).copied().unwrap_or(0);
                    assert_eq!(
                        body["allowances"][0]["used"], used,
                        "{what}: support {text} ({id}): {body}"
                    );
                }
            }
        }
    }
    counts.values().sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_ip_charges_the_network_the_rustdoc_names() {
    let first = env("CLIENT_IP_MODEL_SEED", 1);
    let cases = env("CLIENT_IP_MODEL_CASES", 6);
    let steps = env("CLIENT_IP_MODEL_STEPS", 60);
    let trace = std::env::var_os("CLIENT_IP_MODEL_TRACE").is_some();
    let mut charged = 0;
    for seed in first..first + cases {
        charged += run_case(seed, steps, trace).await;
    }
    eprintln!("{cases} cases, {charged} requests charged");
}
