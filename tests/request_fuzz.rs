//! Random hostile request input over real HTTP (a loopback TCP listener,
//! `axum::serve`, requests written byte by byte): subject headers of four
//! kinds, forwarding headers behind a trusted proxy, plan and zone
//! headers, gRPC calls, methods, and the support router's paths and
//! parameters, each full of separators, percent signs, look-alikes,
//! non-UTF-8 bytes, whitespace and long runs. No answer is a 5xx or a
//! dropped connection; every refusal of the layer and of the support router
//! is a short problem document (or a gRPC status); and a model of every
//! counter (kind, id, zone) must match what the support router and the
//! caller's standing read: two ids never share a counter, and support
//! reaches the counter the layer charges whichever way a path encodes its
//! id.
//!
//! `REQUEST_FUZZ_CASES` sets how many seeds run (default 3),
//! `REQUEST_FUZZ_SEED` the first, `REQUEST_FUZZ_STEPS` the requests per
//! seed (default 120), `REQUEST_FUZZ_TRACE` prints every request.

mod redis_support;
mod seeded;
mod zone_names;

use redis_support::{redis_available, RedisServer};
use seeded::Rng;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use axum::routing::get;
use axum::Router;
use http::request::Parts;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower_quota::jiff::tz::TimeZone;
use tower_quota::{
    unrouted, zone_from_header, ClientIp, FromHeader, ManualClock, MemoryStore, ProxyHeader, Quota,
    QuotaHandle, QuotaPolicy, Store, SubjectExtractor, SubjectKind, UnknownPlan,
};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn trace() -> bool {
    std::env::var_os("REQUEST_FUZZ_TRACE").is_some()
}

/// One answer, as read off the wire.
struct Reply {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| &v[..])
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }
}

/// Serves `app` on a free loopback port, with the peer's address.
async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    addr
}

/// Sends one request, its bytes as given, on a fresh connection.
async fn send(
    addr: SocketAddr,
    method: &str,
    target: &[u8],
    headers: &[(String, Vec<u8>)],
) -> Reply {
    let mut request = Vec::new();
    request.extend_from_slice(method.as_bytes());
    request.push(b' ');
    request.extend_from_slice(target);
    request.extend_from_slice(b" HTTP/1.1\r\nhost: test\r\nconnection: close\r\n");
    for (name, value) in headers {
        request.extend_from_slice(name.as_bytes());
        request.extend_from_slice(b": ");
        request.extend_from_slice(value);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"\r\n");
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(&request).await.unwrap();
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw).await;
    let shown = || String::from_utf8_lossy(&request).into_owned();
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no answer (a panic?) to {:?}", shown()));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, Vec<u8>)> = lines
        .filter_map(|line| {
            let (n, v) = line.split_once(':')?;
            Some((n.to_ascii_lowercase(), v.trim().as_bytes().to_vec()))
        })
        .collect();
    let mut body = raw[end + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.eq_ignore_ascii_case(b"chunked"));
    if chunked && method != "HEAD" {
        let mut out = Vec::new();
        let mut rest = &body[..];
        while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
            let len = usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap().trim(), 16)
                .unwrap();
            if len == 0 {
                break;
            }
            out.extend_from_slice(&rest[eol + 2..eol + 2 + len]);
            rest = &rest[eol + 4 + len..];
        }
        body = out;
    }
    Reply {
        status,
        headers,
        body,
    }
}

/// Pieces of ids, full of what could imitate a key's separators, an
/// escape, or another id.
const FRAGMENTS: &[&[u8]] = &[
    b"acme",
    b"ACME",
    b"a",
    b"A",
    b"a:b",
    b"a%3Ab",
    b"a%3ab",
    b"a%253Ab",
    b"{a}",
    b"a}:read:x",
    b"}",
    b"{",
    b"*",
    b"a*",
    b"%",
    b"%%",
    b"%zz",
    b"+",
    b"a+b",
    b"a b",
    b"a/b",
    b"a?b",
    b"a#b",
    b".",
    b"..",
    b"~",
    b"@",
    b"a\tb",
    b"\xff",
    b"\xfe\xff",
    b"\xc3\xbc",
    b"u\xcc\x88",
    b"\xfc",
    b"\xd0\xb0",
    b"\xef\xbc\xa1",
    b"\xe2\x80\x8b",
    b"\xc2\xa0",
    b"\"",
    b"'",
    b"\\",
    b";",
    b",",
    b"=",
    b"&",
    b"account:acme",
    b"user",
    b"quota:{",
    b"%00",
    b"%0A",
    b"%2F",
    b"0",
    b"00",
];

/// An id as a request sends it, whitespace around it included at times.
fn random_id(rng: &mut Rng) -> Vec<u8> {
    let mut id = Vec::new();
    match rng.below(12) {
        0 => id = vec![b'x'; [255, 256, 257, 300, 5000][rng.below(5) as usize]],
        1 => {
            for _ in 0..rng.below(40) {
                // Any byte a header value carries.
                let b = loop {
                    let b = rng.below(256) as u8;
                    if b == b'\t' || (0x20..0x7f).contains(&b) || b >= 0x80 {
                        break b;
                    }
                };
                id.push(b);
            }
        }
        _ => {
            for _ in 0..1 + rng.below(3) {
                id.extend_from_slice(rng.pick::<&[u8]>(FRAGMENTS));
            }
        }
    }
    match rng.below(8) {
        0 => id.insert(0, b' '),
        1 => id.push(b'\t'),
        2 => id.clear(),
        3 => id = b"   ".to_vec(),
        _ => {}
    }
    id
}

/// `bytes` as a path segment, each byte escaped in upper or lower case,
/// or kept when a path may carry it as it is.
fn encode_segment(rng: &mut Rng, bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for &b in bytes {
        let plain = b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@".contains(&b);
        match rng.below(4) {
            0 | 1 if plain => out.push(b),
            0 | 2 => out.extend_from_slice(format!("%{b:02X}").as_bytes()),
            _ => out.extend_from_slice(format!("%{b:02x}").as_bytes()),
        }
    }
    out
}

/// `text` as a query value: as a form writes it.
fn encode_query(text: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for &b in text {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b);
        } else if b == b' ' {
            out.push(b'+');
        } else {
            out.extend_from_slice(format!("%{b:02X}").as_bytes());
        }
    }
    out
}

const ZONES: &[&str] = &[
    "Europe/Berlin",
    "europe/berlin",
    "US/Eastern",
    "America/New_York",
    "Asia/Calcutta",
    "Asia/Kolkata",
    "UTC",
    "Etc/UTC",
    "utc",
    "GMT",
    "Zulu",
    "Etc/GMT-14",
    "Arctic/Longyearbyen",
    "Asia/Tokyo",
    "localtime",
    "posixrules",
    "Factory",
    "",
    "Europe/Berlin ",
    "../../../etc/passwd",
    "Europe/Nowhere",
    "EST5EDT",
    "+01:00",
    "Europe%2FBerlin",
    "Europe/Berlin:",
    "{Europe/Berlin}",
];

/// The zone part of a caller's counters, as the crate's zone names label
/// them: `Some(None)` for the quotas' own zone (UTC), `Some(name)` for
/// another, `None` for a zone a request may not name.
fn zone_label(name: &str) -> Option<Option<String>> {
    let name = name.trim_matches([' ', '\t']);
    if name.is_empty() || name.len() > 64 {
        return None;
    }
    let zone = TimeZone::get(name).ok()?;
    let primary = zone.primary_iana_name()?.to_owned();
    Some(if zone_names::UTC_NAMES.contains(&primary.as_str()) {
        None
    } else {
        Some(primary)
    })
}

/// A counter of the model: kind, id, zone label.
type Counter = (String, Vec<u8>, Option<String>);

/// The header extractors of the fuzzed policy, in the order `or` asks them.
const KINDS: &[(&str, &str)] = &[
    ("account", "x-account-id"),
    ("user", "x-user-id"),
    ("device", "x-device-id"),
    ("api-key", "x-api-key"),
];

fn header_policy<St: Store>(
    clock: ManualClock,
    store: St,
) -> QuotaPolicy<impl SubjectExtractor, St> {
    let extractor = FromHeader::account("x-account-id")
        .or(FromHeader::user("x-user-id"))
        .or(FromHeader::device("x-device-id"))
        .or(FromHeader::new(SubjectKind::custom("api-key"), "x-api-key"));
    QuotaPolicy::builder(extractor)
        .clock(clock)
        .store(store)
        .plan(|parts: &Parts| {
            parts
                .headers
                .get("x-plan")
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        })
        .plans(["free", "pro"])
        .on_unknown_plan(UnknownPlan::Reject)
        .time_zone(zone_from_header("x-zone"))
        .build()
}

/// The app: `/read` charged, `/me` telling the caller's standing, support
/// under `/admin`.
fn app<E: SubjectExtractor, St: Store>(policy: &QuotaPolicy<E, St>, quota: Quota) -> Router {
    async fn me<St: Store>(
        axum::extract::State(handle): axum::extract::State<QuotaHandle<St>>,
        parts: Parts,
    ) -> axum::response::Response {
        use axum::response::IntoResponse;
        match handle.standing(&parts).await {
            Ok(usage) => axum::Json(
                usage
                    .iter()
                    .map(tower_quota::QuotaUsage::to_json)
                    .collect::<Vec<_>>(),
            )
            .into_response(),
            Err(error) => error.into_response(),
        }
    }
    Router::new()
        .route("/read", get(|| async { "read" }))
        .route_layer(policy.layer(quota))
        .route("/me", get(me::<St>).with_state(policy.handle()))
        .nest("/admin", policy.handle().router())
        .method_not_allowed_fallback(unrouted::MethodNotAllowed)
        .fallback(unrouted::NotFound)
}

/// A refusal is a short problem document with a detail (or, for a gRPC
/// call, a status with a short message), never a 5xx.
fn check_answer(reply: &Reply, method: &str, grpc: bool, what: &str) {
    // The app's own 404 and 405 (`unrouted`), which carry no body.
    if matches!(reply.status, 404 | 405) && reply.body.is_empty() && !what.contains("/admin") {
        return;
    }
    assert!(
        reply.status < 500,
        "{what}: {} {:?}",
        reply.status,
        String::from_utf8_lossy(&reply.body)
    );
    if grpc && reply.status == 200 {
        if let Some(message) = reply.header("grpc-message") {
            assert!(
                message.len() <= 600,
                "{what}: a long grpc-message {}",
                message.len()
            );
        }
        return;
    }
    if reply.status < 400 || method == "HEAD" {
        return;
    }
    assert_eq!(
        reply.header("content-type"),
        Some(&b"application/problem+json"[..]),
        "{what}: {}",
        reply.status
    );
    let problem = reply.json();
    assert_eq!(problem["status"], reply.status, "{what}: {problem}");
    let detail = problem["detail"]
        .as_str()
        .unwrap_or_else(|| panic!("{what}: no detail: {problem}"));
    assert!(!detail.is_empty(), "{what}");
    assert!(
        detail.len() <= 400,
        "{what}: a detail of {} bytes: {detail}",
        detail.len()
    );
}

/// What the model says of a request's headers: its counter, or the
/// statuses it may be refused with.
fn expected(headers: &[(String, Vec<u8>)]) -> Result<Counter, Vec<u16>> {
    let mut refusals = Vec::new();
    let mut counter = None;
    for (kind, name) in KINDS {
        let values: Vec<&Vec<u8>> = headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v)
            .collect();
        match values.as_slice() {
            [] => continue,
            [value] => {
                let id = value.trim_ascii().to_vec();
                if id.is_empty() || id.len() > 256 {
                    refusals.push(400);
                } else {
                    counter = Some(((*kind).to_owned(), id));
                }
            }
            _ => refusals.push(400),
        }
        break;
    }
    if counter.is_none() && refusals.is_empty() {
        refusals.push(401);
    }
    let plans: Vec<&Vec<u8>> = headers
        .iter()
        .filter(|(n, _)| n == "x-plan")
        .map(|(_, v)| v)
        .collect();
    if let Some(plan) = plans.first() {
        // An empty plan is no plan.
        if !matches!(plan.trim_ascii(), b"" | b"free" | b"pro") {
            refusals.push(403);
        }
    }
    let zones: Vec<&Vec<u8>> = headers
        .iter()
        .filter(|(n, _)| n == "x-zone")
        .map(|(_, v)| v)
        .collect();
    let label = match zones.as_slice() {
        [] => None,
        [zone] => match std::str::from_utf8(zone).ok().and_then(zone_label) {
            Some(label) => label,
            None => {
                refusals.push(400);
                None
            }
        },
        _ => {
            refusals.push(400);
            None
        }
    };
    match counter {
        Some((kind, id)) if refusals.is_empty() => Ok((kind, id, label)),
        _ => Err(refusals),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_subject_plan_and_zone_headers_never_share_a_counter() {
    let first = env("REQUEST_FUZZ_SEED", 1);
    for seed in first..first + env("REQUEST_FUZZ_CASES", 3) {
        let clock = ManualClock::new("2026-12-02T12:00:00Z".parse().unwrap());
        headers_case(seed, header_policy(clock, MemoryStore::new())).await;
    }
}

/// The same on a real `redis-server`. A counter's lifetime is sent as a
/// duration from the layer's clock, which stands still: it outlives the
/// test on Redis's own clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_headers_on_redis_never_share_a_counter() {
    if !redis_available() {
        return;
    }
    let server = RedisServer::start();
    let first = env("REQUEST_FUZZ_SEED", 1);
    for seed in first..first + env("REQUEST_FUZZ_REDIS_CASES", 1) {
        let clock = ManualClock::new("2026-12-02T12:00:00Z".parse().unwrap());
        let store = tower_quota::store::RedisStore::new(server.url()).unwrap();
        server.cli(&["FLUSHALL"]);
        headers_case(seed, header_policy(clock, store)).await;
    }
}

async fn headers_case<E: SubjectExtractor, St: Store>(seed: u64, policy: QuotaPolicy<E, St>) {
    let mut rng = Rng(seed);
    let quota = Quota::daily(1_000).plan("pro", 2_000).allowance("read");
    let addr = serve(app(&policy, quota)).await;
    let mut model: HashMap<Counter, u64> = HashMap::new();
    // Every zone name a counter was charged under, to name it to support.
    let mut zone_names: HashMap<Option<String>, Vec<String>> = HashMap::new();
    let mut ids: Vec<Vec<u8>> = Vec::new();
    for step in 0..env("REQUEST_FUZZ_STEPS", 120) {
        let what = format!("seed {seed} step {step}");
        let mut headers: Vec<(String, Vec<u8>)> = Vec::new();
        for (_, name) in KINDS {
            match rng.below(6) {
                0 => headers.push((name.to_string(), random_id(&mut rng))),
                1 if !ids.is_empty() => headers.push((name.to_string(), rng.pick(&ids).clone())),
                2 if rng.below(4) == 0 => {
                    headers.push((name.to_string(), random_id(&mut rng)));
                    headers.push((name.to_string(), random_id(&mut rng)));
                }
                _ => {}
            }
        }
        if rng.below(4) == 0 {
            let plan = *rng.pick::<&[u8]>(&[
                &b"free"[..],
                b"pro",
                b"Pro",
                b"pro ",
                b"\xffpro",
                b"",
                &[b'p'; 3000],
            ]);
            headers.push(("x-plan".into(), plan.to_vec()));
        }
        if rng.below(2) == 0 {
            headers.push(("x-zone".into(), rng.pick(ZONES).as_bytes().to_vec()));
            if rng.below(10) == 0 {
                headers.push(("x-zone".into(), b"UTC".to_vec()));
            }
        }
        let grpc = rng.below(6) == 0;
        if grpc {
            headers.push(("content-type".into(), b"application/grpc".to_vec()));
        }
        let method = *rng.pick(&["GET", "GET", "GET", "HEAD", "POST", "DELETE", "get", "FOO"]);
        let target = *rng.pick::<&[u8]>(&[
            &b"/read"[..],
            b"/read",
            b"/read?x=%FF&n=-1",
            b"/read/",
            b"/READ",
            b"//read",
        ]);
        let want = expected(&headers);
        let routed = target.starts_with(b"/read") && !target.starts_with(b"/read/");
        let charged = routed && matches!(method, "GET" | "HEAD");
        let reply = send(addr, method, target, &headers).await;
        if trace() {
            eprintln!(
                "{what}: {method} {:?} {headers:?} -> {} ({want:?})",
                String::from_utf8_lossy(target),
                reply.status
            );
        }
        check_answer(&reply, method, grpc, &what);
        match (&want, charged) {
            (Ok(counter), true) => {
                assert_eq!(reply.status, 200, "{what}: {headers:?}");
                assert!(reply.header("grpc-status").is_none(), "{what}");
                *model.entry(counter.clone()).or_default() += 1;
                if !ids.contains(&counter.1) {
                    ids.push(counter.1.clone());
                }
                if let Some((_, zone)) = headers.iter().find(|(n, _)| n == "x-zone") {
                    let names = zone_names.entry(counter.2.clone()).or_default();
                    let zone = String::from_utf8(zone.clone()).unwrap().trim().to_owned();
                    if !names.contains(&zone) {
                        names.push(zone);
                    }
                }
            }
            (Err(statuses), true) if grpc => {
                assert_eq!(reply.status, 200, "{what}");
                let code = reply
                    .header("grpc-status")
                    .unwrap_or_else(|| panic!("{what}: no grpc-status"));
                assert!(
                    matches!(code, b"3" | b"7" | b"16"),
                    "{what}: {statuses:?} {:?}",
                    String::from_utf8_lossy(code)
                );
            }
            (Err(statuses), true) => {
                assert!(
                    statuses.contains(&reply.status),
                    "{what}: {} not in {statuses:?}: {headers:?} {:?}",
                    reply.status,
                    String::from_utf8_lossy(&reply.body)
                );
            }
            (_, false) => assert!(
                [404, 405, 400, 401, 403].contains(&reply.status) || (grpc && reply.status == 200),
                "{what}: {method} {:?}: {}",
                String::from_utf8_lossy(target),
                reply.status
            ),
        }
        // The caller's standing, as the layer would charge it.
        if rng.below(3) == 0 && !grpc {
            let reply = send(addr, "GET", b"/me", &headers).await;
            check_answer(&reply, "GET", false, &format!("{what} /me"));
            match &want {
                Ok(counter) => {
                    assert_eq!(reply.status, 200, "{what} /me");
                    let used = reply.json()[0]["used"].as_u64().unwrap();
                    assert_eq!(
                        used,
                        model.get(counter).copied().unwrap_or(0),
                        "{what} /me: {headers:?}"
                    );
                }
                Err(statuses) => assert!(
                    statuses.contains(&reply.status),
                    "{what} /me: {} not in {statuses:?}",
                    reply.status
                ),
            }
        }
        // Support, on a counter of the model or another id.
        if rng.below(2) == 0 {
            support_step(&mut rng, addr, &mut model, &zone_names, &ids, &what).await;
        }
    }
    // Every counter, read through support, as the model has it.
    let counters: Vec<Counter> = model.keys().cloned().collect();
    for counter in counters {
        let reply = support_show(&mut rng, addr, &counter, &zone_names).await;
        check_answer(&reply, "GET", false, &format!("seed {seed} end"));
        assert_eq!(reply.status, 200, "seed {seed}: {counter:?}");
        let used = reply.json()["allowances"][0]["used"].as_u64().unwrap();
        assert_eq!(used, model[&counter], "seed {seed}: {counter:?}");
    }
}

/// `?zone=` naming the counter's zone, or none for the quotas' own.
fn zone_query(
    rng: &mut Rng,
    label: &Option<String>,
    names: &HashMap<Option<String>, Vec<String>>,
) -> Vec<u8> {
    let mut choices: Vec<Vec<u8>> = names
        .get(label)
        .into_iter()
        .flatten()
        .map(|n| n.as_bytes().to_vec())
        .collect();
    match label {
        None => {
            choices.push(Vec::new());
            choices.push(b"UTC".to_vec());
        }
        Some(name) => choices.push(name.as_bytes().to_vec()),
    }
    let name = rng.pick(&choices).clone();
    if name.is_empty() {
        return Vec::new();
    }
    let mut query = b"zone=".to_vec();
    query.extend(encode_query(&name));
    query
}

fn support_path(
    rng: &mut Rng,
    route: &str,
    kind: &str,
    id: &[u8],
    allowance: Option<&str>,
    query: &[u8],
) -> Vec<u8> {
    let mut path = format!("/admin/{route}/").into_bytes();
    path.extend(encode_segment(rng, kind.as_bytes()));
    path.push(b'/');
    path.extend(encode_segment(rng, id));
    if let Some(allowance) = allowance {
        path.push(b'/');
        path.extend(encode_segment(rng, allowance.as_bytes()));
    }
    if !query.is_empty() {
        path.push(b'?');
        path.extend_from_slice(query);
    }
    path
}

async fn support_show(
    rng: &mut Rng,
    addr: SocketAddr,
    counter: &Counter,
    names: &HashMap<Option<String>, Vec<String>>,
) -> Reply {
    let query = zone_query(rng, &counter.2, names);
    let path = support_path(rng, "quota", &counter.0, &counter.1, None, &query);
    send(addr, "GET", &path, &[]).await
}

/// Amounts as a query sends them, and what the router should read.
const AMOUNTS: &[(&str, Option<u64>)] = &[
    ("1", Some(1)),
    ("%31", Some(1)),
    ("%2B1", Some(1)),
    ("0", Some(0)),
    ("3", Some(3)),
    ("18446744073709551615", Some(u64::MAX)),
    ("18446744073709551616", None),
    ("-1", None),
    ("1e3", None),
    ("", None),
    ("+1", None),
    ("1%00", None),
    ("%FF", None),
    ("0x1", None),
];

async fn support_step(
    rng: &mut Rng,
    addr: SocketAddr,
    model: &mut HashMap<Counter, u64>,
    names: &HashMap<Option<String>, Vec<String>>,
    ids: &[Vec<u8>],
    what: &str,
) {
    let counters: Vec<&Counter> = model.keys().collect();
    let counter: Counter = if !counters.is_empty() && rng.below(3) != 0 {
        (*rng.pick(&counters)).clone()
    } else {
        // Another kind of a known id, or a fresh id: nothing charged.
        let kind = rng.pick(KINDS).0.to_owned();
        let id = if !ids.is_empty() && rng.below(2) == 0 {
            rng.pick(ids).clone()
        } else {
            random_id(rng)
        };
        let label = rng.pick(&[None, Some("Asia/Tokyo".to_owned())]).clone();
        (kind, id, label)
    };
    let chargeable = !counter.1.is_empty()
        && counter.1.len() <= 256
        && counter.1.trim_ascii().len() == counter.1.len()
        && counter
            .1
            .iter()
            .all(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f));
    let used = model.get(&counter).copied().unwrap_or(0);
    let zone = zone_query(rng, &counter.2, names);
    let (method, path, after): (&str, Vec<u8>, Option<u64>) = match rng.below(4) {
        0 => {
            let path = support_path(rng, "reset", &counter.0, &counter.1, Some("read"), &zone);
            ("POST", path, Some(0))
        }
        1 => {
            let (amount, value) = *rng.pick(AMOUNTS);
            let mut query = format!("amount={amount}").into_bytes();
            if !zone.is_empty() {
                query.push(b'&');
                query.extend_from_slice(&zone);
            }
            let path = support_path(rng, "refund", &counter.0, &counter.1, Some("read"), &query);
            match value {
                Some(amount) => ("POST", path, Some(used.saturating_sub(amount))),
                None => {
                    let reply = send(addr, "POST", &path, &[]).await;
                    check_answer(&reply, "POST", false, what);
                    assert_eq!(reply.status, 400, "{what}: ?amount={amount}");
                    return;
                }
            }
        }
        2 => {
            // Hostile paths and methods: a problem document, never a 5xx.
            garbage_support_call(rng, addr, &counter, what).await;
            return;
        }
        _ => {
            let (plan, limit) = *rng.pick(&[
                ("", Some(1_000)),
                ("plan=pro", Some(2_000)),
                ("plan=free", Some(1_000)),
                ("plan=", Some(1_000)),
                ("plan=%70ro", Some(2_000)),
                ("plan=xyz", None),
                ("plan=pro&plan=pro", None),
            ]);
            let mut query = zone.clone();
            if !plan.is_empty() {
                if !query.is_empty() {
                    query.push(b'&');
                }
                query.extend_from_slice(plan.as_bytes());
            }
            let path = support_path(rng, "quota", &counter.0, &counter.1, None, &query);
            if chargeable {
                let reply = send(addr, "GET", &path, &[]).await;
                let shown = String::from_utf8_lossy(&path).into_owned();
                check_answer(&reply, "GET", false, &format!("{what}: GET {shown}"));
                match limit {
                    Some(limit) => {
                        assert_eq!(reply.status, 200, "{what}: GET {shown}");
                        assert_eq!(
                            reply.json()["allowances"][0]["limit"],
                            limit,
                            "{what}: GET {shown}"
                        );
                    }
                    None => assert!(
                        matches!(reply.status, 400 | 403),
                        "{what}: GET {shown}: {}",
                        reply.status
                    ),
                }
                if limit.is_none() {
                    return;
                }
            }
            ("GET", path, None)
        }
    };
    let reply = send(addr, method, &path, &[]).await;
    let shown = String::from_utf8_lossy(&path).into_owned();
    check_answer(&reply, method, false, &format!("{what}: {method} {shown}"));
    if counter.1.is_empty() {
        // An empty segment: no route, or an empty id.
        assert!(
            matches!(reply.status, 400 | 404),
            "{what}: {method} {shown}"
        );
        return;
    }
    if !chargeable {
        assert_eq!(
            reply.status,
            400,
            "{what}: {method} {shown}: {:?}",
            String::from_utf8_lossy(&reply.body)
        );
        return;
    }
    // A reset of a subject never charged answers as any other.
    assert_eq!(
        reply.status,
        200,
        "{what}: {method} {shown}: {:?}",
        String::from_utf8_lossy(&reply.body)
    );
    let body = reply.json();
    let shown_used = body["allowances"][0]["used"].as_u64().unwrap();
    let want = after.unwrap_or(used);
    assert_eq!(
        shown_used, want,
        "{what}: {method} {shown}: {counter:?}: {body}"
    );
    assert_eq!(body["subject"]["kind"], counter.0.as_str(), "{what}");
    if after.is_some() {
        if want == 0 {
            model.remove(&counter);
        } else {
            model.insert(counter, want);
        }
    }
}

/// A support call on a hostile path, kind, allowance or method: an answer
/// that is a short problem document, never a 5xx, and nothing changed
/// (the next support read checks the model).
async fn garbage_support_call(rng: &mut Rng, addr: SocketAddr, counter: &Counter, what: &str) {
    let kinds: &[&[u8]] = &[
        b"Account",
        b"ip",
        b"",
        b"a/b",
        b"%FF",
        b"account%00",
        &[b'k'; 65],
        b"acc%2Fount",
        b"..",
        b"%2E%2E",
    ];
    let allowances: &[&[u8]] = &[
        b"write",
        b"READ",
        b"read%00",
        b"%FF",
        b"",
        b"read/x",
        &[b'r'; 5000],
        b"read%2F",
        b"re%3Aad",
    ];
    let mut path = b"/admin/".to_vec();
    let route = *rng.pick(&["quota", "reset", "refund", "quotas", "QUOTA", ""]);
    path.extend_from_slice(route.as_bytes());
    path.push(b'/');
    let kind: Vec<u8> = if rng.below(2) == 0 {
        counter.0.as_bytes().to_vec()
    } else {
        rng.pick(kinds).to_vec()
    };
    path.extend(encode_segment(rng, &kind));
    path.push(b'/');
    path.extend(encode_segment(rng, &counter.1));
    if rng.below(2) == 0 {
        path.push(b'/');
        let allowance = rng.pick(allowances).to_vec();
        path.extend(encode_segment(rng, &allowance));
    }
    if rng.below(4) == 0 {
        path.push(b'/');
    }
    if rng.below(2) == 0 {
        let query = *rng.pick::<&[u8]>(&[
            &b"amount=1&amount=2"[..],
            b"zone=Nowhere/Zone",
            b"zone=",
            b"zone=%FF",
            b"plan=%FF",
            b"amount=99999999999999999999999",
            b"%FF=%FF",
            b"&&&=",
            b"zone=Europe/Berlin&zone=UTC",
        ]);
        path.push(b'?');
        path.extend_from_slice(query);
    }
    let method = *rng.pick(&["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"]);
    let reply = send(addr, method, &path, &[]).await;
    let shown = String::from_utf8_lossy(&path).into_owned();
    check_answer(&reply, method, false, &format!("{what}: {method} {shown}"));
    let is_write = matches!(route, "reset" | "refund") && method == "POST";
    if is_write && reply.status == 200 {
        // Only a reset or refund of the model's own counter may succeed:
        // a hostile kind or allowance must not.
        panic!(
            "{what}: {method} {shown} answered 200: {:?}",
            String::from_utf8_lossy(&reply.body)
        );
    }
}

/// The client behind the trusted proxy a forwarding entry names, as the
/// model reads it: an address (IPv4-mapped and NAT64 as IPv4), or none for
/// an entry that is not one.
fn entry_ip(entry: &str, forwarded: bool) -> Option<IpAddr> {
    let entry = if forwarded {
        entry
    } else {
        entry.trim_matches([' ', '\t'])
    };
    let ip = if let Ok(ip) = entry.parse::<IpAddr>() {
        ip
    } else if let Some(rest) = entry.strip_prefix('[') {
        let (host, port) = rest.split_once(']')?;
        if !(port.is_empty()
            || port.strip_prefix(':').is_some_and(|p| {
                (1..=5).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit())
            }))
        {
            return None;
        }
        IpAddr::V6(host.parse().ok()?)
    } else {
        let (host, port) = entry.split_once(':')?;
        if !((1..=5).contains(&port.len()) && port.bytes().all(|b| b.is_ascii_digit())) {
            return None;
        }
        IpAddr::V4(host.parse().ok()?)
    };
    Some(match ip {
        IpAddr::V6(v6) => {
            let s = v6.segments();
            if let Some(v4) = v6.to_ipv4_mapped() {
                IpAddr::V4(v4)
            } else if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                let o = v6.octets();
                IpAddr::V4(Ipv4Addr::new(o[12], o[13], o[14], o[15]))
            } else {
                ip
            }
        }
        v4 => v4,
    })
}

fn ip_id(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => {
            let mut s = v6.segments();
            s[4..].fill(0);
            format!("{}/64", Ipv6Addr::from(s))
        }
    }
}

const ENTRIES: &[&str] = &[
    "203.0.113.7",
    "203.0.113.7:4711",
    "::ffff:203.0.113.7",
    "[::ffff:203.0.113.7]:1",
    "64:ff9b::cb00:7107",
    "203.0.113.8",
    "2001:db8:1:2::1",
    "2001:DB8:1:2::ffff",
    "[2001:db8:1:2::9]:80",
    "2001:db8:1:3::1",
    "2001:0db8:0001:0002:0000:0000:0000:0001",
    "127.0.0.5",
    "::1",
    "10.1.1.1",
    "0.0.0.0",
    "::",
    "unknown",
    "_hidden",
    "fe80::1%eth0",
    "203.0.113.7:",
    "203.0.113.7:99999",
    "[2001:db8::1",
    "1.2.3",
    "01.2.3.4",
    "garbage",
    "\u{ff}",
    "203.0.113.7 ",
    "",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_forwarding_headers_reach_the_counter_support_reads() {
    let first = env("REQUEST_FUZZ_SEED", 1);
    for seed in first..first + env("REQUEST_FUZZ_CASES", 3) {
        for header in [ProxyHeader::XForwardedFor, ProxyHeader::Forwarded] {
            ip_case(seed, header).await;
        }
    }
}

async fn ip_case(seed: u64, header: ProxyHeader) {
    let mut rng = Rng(seed);
    let clock = ManualClock::new("2026-12-02T12:00:00Z".parse().unwrap());
    let policy = QuotaPolicy::builder(
        ClientIp::new()
            .trust_proxy_cidrs(["127.0.0.0/8"])
            .proxy_header(header),
    )
    .clock(clock)
    .build();
    let addr = serve(app(&policy, Quota::daily(1_000).allowance("read"))).await;
    let mut model: HashMap<String, u64> = HashMap::new();
    let mut named: HashMap<String, Vec<String>> = HashMap::new();
    for step in 0..env("REQUEST_FUZZ_STEPS", 120) {
        let what = format!("seed {seed} {header:?} step {step}");
        let entries: Vec<&str> = (0..1 + rng.below(3)).map(|_| *rng.pick(ENTRIES)).collect();
        let quoted: Vec<bool> = entries
            .iter()
            .map(|e| e.contains([':', '[']) || rng.below(3) == 0)
            .collect();
        let value = match header {
            ProxyHeader::XForwardedFor => entries.join(*rng.pick(&[", ", ",", " , "])),
            _ => entries
                .iter()
                .zip(&quoted)
                .map(|(e, &quoted)| {
                    let node = if quoted {
                        format!("for=\"{e}\"")
                    } else {
                        format!("for={e}")
                    };
                    if rng.below(4) == 0 {
                        format!("proto=http;{node}")
                    } else {
                        node
                    }
                })
                .collect::<Vec<_>>()
                .join(", "),
        };
        // The model: the rightmost entry that is no trusted proxy (every
        // non-empty entry is read up to it).
        let mut want: Result<String, ()> = Ok("127.0.0.1".to_owned());
        let mut leftmost: Option<IpAddr> = None;
        let mut client = None;
        for (entry, &quoted) in entries.iter().zip(&quoted).rev() {
            // A quoted `for=` is read as it is; a token, trimmed.
            let forwarded = header == ProxyHeader::Forwarded && quoted;
            if entry.trim().is_empty() && header == ProxyHeader::XForwardedFor {
                continue;
            }
            match entry_ip(entry, forwarded) {
                None => {
                    want = Err(());
                    break;
                }
                Some(ip) if ip.is_loopback() && ip.is_ipv4() => leftmost = Some(ip),
                Some(ip) => {
                    client = Some(ip);
                    break;
                }
            }
        }
        if want.is_ok() {
            if let Some(ip) = client.or(leftmost) {
                want = Ok(ip_id(ip));
            }
        }
        let name = match header {
            ProxyHeader::XForwardedFor => "x-forwarded-for",
            _ => "forwarded",
        };
        let headers = vec![(name.to_owned(), value.as_bytes().to_vec())];
        let reply = send(addr, "GET", b"/read", &headers).await;
        if trace() {
            eprintln!("{what}: {value:?} -> {} ({want:?})", reply.status);
        }
        check_answer(&reply, "GET", false, &what);
        match &want {
            Ok(id) => {
                assert_eq!(reply.status, 200, "{what}: {value:?}");
                *model.entry(id.clone()).or_default() += 1;
                let client = entries
                    .iter()
                    .rev()
                    .find(|e| entry_ip(e, false).is_some_and(|ip| ip_id(ip) == *id));
                if let Some(client) = client {
                    let client = client.trim().trim_start_matches('[').to_owned();
                    let client = client
                        .split_once(']')
                        .map_or(client.clone(), |(h, _)| h.to_owned());
                    if client.parse::<IpAddr>().is_ok() {
                        named.entry(id.clone()).or_default().push(client);
                    }
                }
            }
            Err(()) => assert_eq!(reply.status, 400, "{what}: {value:?}"),
        }
        if rng.below(2) == 0 && !model.is_empty() {
            let ids: Vec<&String> = model.keys().collect();
            let id = (*rng.pick(&ids)).clone();
            let mut forms = named.get(&id).cloned().unwrap_or_default();
            forms.push(id.clone());
            forms.push(id.to_uppercase());
            let form = rng.pick(&forms).clone();
            let path = support_path(&mut rng, "quota", "ip", form.as_bytes(), None, b"");
            let reply = send(addr, "GET", &path, &[]).await;
            check_answer(&reply, "GET", false, &what);
            assert_eq!(reply.status, 200, "{what}: {form}");
            let body = reply.json();
            assert_eq!(body["subject"]["id"], id.as_str(), "{what}: {form}");
            assert_eq!(
                body["allowances"][0]["used"], model[&id],
                "{what}: {form}: {body}"
            );
        }
    }
}
