//! A seeded random walk of gRPC calls over real HTTP/2 (a tonic server and
//! client) through nested quota layers: unary, server-streaming and
//! client-streaming calls; handlers that answer OK, an error in a
//! trailers-only answer or in trailers after a body, UNIMPLEMENTED, server
//! failures under `refund_server_errors`, deferred costs; calls the client
//! cancels before the answer or mid-stream, calls the server's deadline
//! (`grpc-timeout`) ends; subjects from metadata (a `-bin` key among
//! them), plans and a shadow quota; an inner layer whose store fails or
//! stalls (UNAVAILABLE); clock steps across period ends. Checked against a
//! model: the gRPC status and metadata the client sees, and what every
//! counter holds.
//!
//! `GRPC_MODEL_CASES` sets how many cases run per store (default 2),
//! `GRPC_MODEL_STEPS` the calls per case (default 60), `GRPC_MODEL_SEED`
//! the first seed, `GRPC_MODEL_TRACE` prints each step.

mod fields;
mod rigged;
mod seeded;

use rigged::{Rig, Rigged};
use seeded::Rng;

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, Response};
use http_body::Frame;
use jiff::Timestamp;
use tokio::sync::mpsc;
use tonic::codec::ProstCodec;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::transport::server::TcpIncoming;
use tonic::transport::Channel;
use tonic::Code;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower_quota::{
    FromHeader, LeasedStore, ManualClock, MemoryStore, Quota, QuotaPolicy, Store, Subject,
    SubjectKind, UnknownPlan,
};

/// A quota of the model: name, period in seconds, own limit, plan limits,
/// shadow.
struct Q {
    name: &'static str,
    secs: i64,
    limit: u64,
    pro: Option<u64>,
    shadow: bool,
}

impl Q {
    fn quota(&self) -> Quota {
        let allowance = self.name.split('-').next().unwrap();
        let mut q = match self.secs {
            60 => Quota::per_minute(self.limit),
            3600 => Quota::hourly(self.limit),
            86400 => Quota::daily(self.limit),
            _ => unreachable!(),
        }
        .allowance(allowance);
        if let Some(pro) = self.pro {
            q = q.plan("pro", pro);
        }
        if self.shadow {
            q = q.shadow();
        }
        q
    }
    fn limit_for(&self, plan: Option<&str>) -> u64 {
        match (plan, self.pro) {
            (Some("pro"), Some(pro)) => pro,
            _ => self.limit,
        }
    }
}

// The outer layer (policy A, per account).
const CALLS: Q = Q {
    name: "calls-day",
    secs: 86400,
    limit: 6,
    pro: Some(9),
    shadow: false,
};
const BURST: Q = Q {
    name: "burst-minute",
    secs: 60,
    limit: 2,
    pro: None,
    shadow: true,
};
// The middle layer (policy B, per device key from a `-bin` entry).
const KEYS: Q = Q {
    name: "keys-hour",
    secs: 3600,
    limit: 3,
    pro: None,
    shadow: false,
};
// The `Tokens` method's own layer (policy A, deferred cost).
const TOKENS: Q = Q {
    name: "tokens-day",
    secs: 86400,
    limit: 12,
    pro: Some(20),
    shadow: false,
};

const ACCOUNTS: [&str; 2] = ["acme", "globex"];
/// The bytes of the `x-key-bin` entries (the empty one is malformed).
const KEY_BYTES: [&[u8]; 4] = [b"k1", b"\xff\x00k", b"k1\n", b""];
const PLANS: [Option<&str>; 4] = [None, Some("free"), Some("pro"), Some("gold")];
const SERVICE: &str = "/quota.v1.Model/";

/// The text a `-bin` entry carrying `bytes` sends: its subject's id.
fn key_text(bytes: &[u8]) -> String {
    let value = MetadataValue::from_bytes(bytes);
    String::from_utf8(value.as_encoded_bytes().to_vec()).unwrap()
}

/// A response body fed frame by frame.
struct Frames(mpsc::UnboundedReceiver<Frame<Bytes>>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|frame| frame.map(Ok))
    }
}

/// A `HealthCheckResponse { status: SERVING }` as a gRPC message.
fn message() -> Frame<Bytes> {
    Frame::data(Bytes::from_static(&[0, 0, 0, 0, 2, 0x08, 0x01]))
}

fn status_trailers(code: u32) -> Frame<Bytes> {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", code.into());
    trailers.insert("grpc-message", "handler".parse().unwrap());
    Frame::trailers(trailers)
}

/// Told when a call starts, and when an answer is abandoned (the handler's
/// future dropped, or its body).
#[derive(Clone)]
struct Signals {
    entered: mpsc::UnboundedSender<()>,
    gone: mpsc::UnboundedSender<()>,
}

struct Gone(mpsc::UnboundedSender<()>);

impl Drop for Gone {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

/// Answers as `x-do` says: `ok`, `head:C` (trailers-only status C),
/// `tail:C` (a message, then status C in trailers), `stream:N` (N
/// messages, then OK), `open` (a message, then the stream held open),
/// `hang` (no answer; `drop` too, a call the client cancels at a random
/// moment). `x-tokens` comes back as `x-tokens-used`.
async fn handler(State(signals): State<Signals>, headers: HeaderMap) -> Response<Body> {
    let _ = signals.entered.send(());
    let what = headers["x-do"].to_str().unwrap().to_owned();
    let (tx, rx) = mpsc::unbounded_channel();
    let mut response = Response::new(Body::new(Frames(rx)));
    response
        .headers_mut()
        .insert("content-type", "application/grpc".parse().unwrap());
    if let Some(tokens) = headers.get("x-tokens") {
        response
            .headers_mut()
            .insert("x-tokens-used", tokens.clone());
    }
    let (verb, arg) = what.split_once(':').unwrap_or((&what, "0"));
    let arg: u32 = arg.parse().unwrap();
    match verb {
        "ok" => {
            tx.send(message()).unwrap();
            tx.send(status_trailers(0)).unwrap();
        }
        "head" => {
            let headers = response.headers_mut();
            headers.insert("grpc-status", arg.into());
            headers.insert("grpc-message", "handler".parse().unwrap());
        }
        "tail" => {
            tx.send(message()).unwrap();
            tx.send(status_trailers(arg)).unwrap();
        }
        "stream" => {
            for _ in 0..arg {
                tx.send(message()).unwrap();
            }
            tx.send(status_trailers(0)).unwrap();
        }
        "open" => {
            tx.send(message()).unwrap();
            let gone = signals.gone.clone();
            tokio::spawn(async move {
                tx.closed().await;
                let _ = gone.send(());
            });
        }
        "hang" | "drop" => {
            let _gone = Gone(signals.gone.clone());
            std::future::pending::<()>().await;
        }
        _ => unreachable!("{what}"),
    }
    response
}

/// What the server answers a method it does not have: UNIMPLEMENTED.
async fn unimplemented() -> Response<Body> {
    let mut response = Response::new(Body::empty());
    let headers = response.headers_mut();
    headers.insert("content-type", "application/grpc".parse().unwrap());
    headers.insert("grpc-status", 12.into());
    response
}

#[derive(Default)]
struct Model {
    /// (quota name, subject id, window) -> count
    counts: HashMap<(&'static str, String, i64), u64>,
}

impl Model {
    fn key(q: &Q, subject: &str, now: Timestamp) -> (&'static str, String, i64) {
        (
            q.name,
            subject.to_owned(),
            now.as_second().div_euclid(q.secs),
        )
    }
    fn used(&self, q: &Q, subject: &str, now: Timestamp) -> u64 {
        self.counts
            .get(&Self::key(q, subject, now))
            .copied()
            .unwrap_or(0)
    }
    fn add(&mut self, q: &Q, subject: &str, now: Timestamp, by: i64) {
        let count = self.counts.entry(Self::key(q, subject, now)).or_default();
        *count = count.checked_add_signed(by).unwrap();
    }
}

/// What the client saw of a call.
#[derive(Debug)]
struct Seen {
    code: Code,
    message: String,
    /// The head's metadata (a trailers-only status's included).
    head: HeaderMap,
}

/// A call made in the model's terms, what the handler does aside.
struct Call {
    account: Option<&'static str>,
    plan: Option<&'static str>,
    keys: Vec<&'static [u8]>,
    method: &'static str,
    what: String,
    tokens: Option<u64>,
    /// 0: unary, 1: server streaming, 2: client streaming.
    shape: u8,
    /// A deadline the server enforces (`grpc-timeout`).
    deadline: bool,
    /// For `drop`: when the client cancels (in quarters of a millisecond).
    drop_after: u64,
}

type Grpc = tonic::client::Grpc<Channel>;

fn codec() -> ProstCodec<HealthCheckRequest, HealthCheckResponse> {
    ProstCodec::default()
}

fn metadata(call: &Call) -> MetadataMap {
    let mut md = MetadataMap::new();
    if let Some(account) = call.account {
        md.insert("x-account-id", account.parse().unwrap());
    }
    if let Some(plan) = call.plan {
        md.insert("x-plan", plan.parse().unwrap());
    }
    for key in &call.keys {
        md.append_bin("x-key-bin", MetadataValue::from_bytes(key));
    }
    md.insert("x-do", call.what.parse().unwrap());
    if let Some(tokens) = call.tokens {
        md.insert("x-tokens", tokens.to_string().parse().unwrap());
    }
    md
}

fn request<T>(call: &Call, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    *request.metadata_mut() = metadata(call);
    if call.deadline {
        request.set_timeout(Duration::from_millis(30));
    }
    request
}

fn status_seen(status: tonic::Status) -> Seen {
    Seen {
        code: status.code(),
        message: status.message().to_owned(),
        head: status.metadata().clone().into_headers(),
    }
}

/// Makes `call`; `None` when the client abandoned it (a `hang`), once the
/// server dropped it.
async fn make(
    grpc: &mut Grpc,
    call: &Call,
    entered: &mut mpsc::UnboundedReceiver<()>,
    gone: &mut mpsc::UnboundedReceiver<()>,
) -> Option<Seen> {
    grpc.ready().await.unwrap();
    let path: http::uri::PathAndQuery = format!("{SERVICE}{}", call.method).parse().unwrap();
    let check = HealthCheckRequest {
        service: String::new(),
    };
    let within = Duration::from_secs(10);
    while entered.try_recv().is_ok() || gone.try_recv().is_ok() {}
    if call.what == "drop" {
        // Cancelled a moment after it was sent: wherever the server is
        // with it (charging, in the handler), it is not served.
        let mut unary = Box::pin(grpc.unary(request(call, check), path, codec()));
        let moment = Duration::from_micros(250 * call.drop_after);
        if let Ok(done) = tokio::time::timeout(moment, unary.as_mut()).await {
            return Some(match done {
                Ok(response) => panic!("a hanging call answered: {response:?}"),
                Err(status) => status_seen(status),
            });
        }
        drop(unary);
        if tokio::time::timeout(Duration::from_millis(300), entered.recv())
            .await
            .is_ok()
        {
            tokio::time::timeout(within, gone.recv())
                .await
                .expect("the server drops a call its client cancelled");
        }
        return None;
    }
    if call.what == "hang" && !call.deadline {
        let mut unary = Box::pin(grpc.unary(request(call, check), path, codec()));
        tokio::select! {
            // Refused, or no such method: answered without the handler.
            done = unary.as_mut() => return Some(match done {
                Ok(response) => panic!("a hanging call answered: {response:?}"),
                Err(status) => status_seen(status),
            }),
            _ = entered.recv() => {}
        }
        drop(unary);
        tokio::time::timeout(within, gone.recv())
            .await
            .expect("the server drops a call its client cancelled");
        return None;
    }
    let seen = match call.shape {
        0 => match grpc.unary(request(call, check), path, codec()).await {
            Ok(response) => Seen {
                code: Code::Ok,
                message: String::new(),
                head: response.metadata().clone().into_headers(),
            },
            Err(status) => status_seen(status),
        },
        1 => match grpc
            .server_streaming(request(call, check), path, codec())
            .await
        {
            Ok(response) => {
                let head = response.metadata().clone().into_headers();
                let mut stream = response.into_inner();
                let mut code = Code::Ok;
                let mut message = String::new();
                if call.what == "open" {
                    assert!(stream.message().await.unwrap().is_some());
                    drop(stream);
                    tokio::time::timeout(within, gone.recv())
                        .await
                        .expect("the server drops a stream its client cancelled");
                } else {
                    loop {
                        match stream.message().await {
                            Ok(Some(_)) => {}
                            Ok(None) => break,
                            Err(status) => {
                                code = status.code();
                                message = status.message().to_owned();
                                break;
                            }
                        }
                    }
                }
                Seen {
                    code,
                    message,
                    head,
                }
            }
            Err(status) => status_seen(status),
        },
        _ => {
            let sent = tonic::codegen::tokio_stream::iter(vec![check.clone(), check]);
            match grpc
                .client_streaming(request(call, sent), path, codec())
                .await
            {
                Ok(response) => Seen {
                    code: Code::Ok,
                    message: String::new(),
                    head: response.metadata().clone().into_headers(),
                },
                Err(status) => status_seen(status),
            }
        }
    };
    if call.what == "hang" && entered.try_recv().is_ok() {
        // Ended by the server's deadline: dropped there.
        tokio::time::timeout(within, gone.recv())
            .await
            .expect("the server drops a call past its deadline");
    }
    Some(seen)
}

fn tokens_used(response: &http::response::Parts) -> u64 {
    response
        .headers
        .get("x-tokens-used")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(1)
}

struct Policies<St: Store> {
    a: QuotaPolicy<FromHeader, St>,
    b: QuotaPolicy<FromHeader, Rigged<St>>,
}

fn policies<St: Store + Clone>(
    store: St,
    clock: &ManualClock,
    reject_unknown: bool,
    refund_a: bool,
    refund_b: bool,
    keys_rig: Option<Rig>,
) -> Policies<St> {
    let a = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store.clone())
        .clock(clock.clone())
        .plan(|parts| {
            parts
                .headers
                .get("x-plan")
                .map(|v| v.to_str().unwrap().to_owned())
        })
        .plans(["free", "pro"])
        .on_unknown_plan(if reject_unknown {
            UnknownPlan::Reject
        } else {
            UnknownPlan::DefaultLimits
        })
        .refund_server_errors(refund_a)
        .build();
    // Policy B's store fails or stalls its charges, or none.
    let rigged = match keys_rig {
        Some(rig) => Rigged::new(store, rig, Some("keys")),
        None => Rigged::new(store, Rig::Fail, Some("none")),
    };
    let b = QuotaPolicy::builder(FromHeader::device("x-key-bin"))
        .store(rigged)
        .store_timeout(Some(Duration::from_millis(5)))
        .clock(clock.clone())
        .skip_if(|parts| !parts.headers.contains_key("x-key-bin"))
        .refund_server_errors(refund_b)
        .build();
    Policies { a, b }
}

/// The counters of every subject, as support reads them, against the
/// model's.
async fn check_counters<St: Store>(
    policies: &Policies<St>,
    model: &Model,
    now: Timestamp,
    ctx: &str,
) {
    let (a, b) = (policies.a.handle(), policies.b.handle());
    for account in ACCOUNTS {
        let usage = a.usage(&Subject::account(account)).await.unwrap();
        for q in [&CALLS, &BURST, &TOKENS] {
            let u = usage.iter().find(|u| u.name() == q.name).unwrap();
            let want = model.used(q, account, now);
            assert_eq!(u.used(), want, "{ctx}: {} of {account}", q.name);
        }
    }
    for key in KEY_BYTES.iter().filter(|k| !k.is_empty()) {
        let text = key_text(key);
        let usage = b
            .usage(&Subject::new(SubjectKind::DEVICE, text.as_str()))
            .await
            .unwrap();
        let want = model.used(&KEYS, &text, now);
        assert_eq!(usage[0].used(), want, "{ctx}: keys of {text}");
    }
}

async fn run_case<St: Store + Clone>(
    seed: u64,
    steps: usize,
    store: St,
    leased: Option<&LeasedStore<MemoryStore>>,
) {
    let mut rng = Rng(seed);
    let trace = std::env::var_os("GRPC_MODEL_TRACE").is_some();
    let clock = ManualClock::new("2026-12-02T23:58:30Z".parse().unwrap());
    let reject_unknown = rng.below(2) == 0;
    let (refund_a, refund_b) = (rng.below(2) == 0, rng.below(2) == 0);
    let keys_rig = match rng.below(6) {
        0 => Some(Rig::Fail),
        1 => Some(Rig::Stall),
        _ => None,
    };
    let policies = policies(store, &clock, reject_unknown, refund_a, refund_b, keys_rig);
    let (a, b) = (&policies.a, &policies.b);

    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let (gone_tx, mut gone) = mpsc::unbounded_channel();
    let signals = Signals {
        entered: entered_tx,
        gone: gone_tx,
    };
    let tokens = a.layer(TOKENS.quota()).deferred_cost(1, tokens_used);
    let router = Router::new()
        .route(&format!("{SERVICE}Call"), post(handler))
        .route(&format!("{SERVICE}Stream"), post(handler))
        .merge(
            Router::new()
                .route(&format!("{SERVICE}Tokens"), post(handler))
                .route_layer(tokens),
        )
        .fallback(unimplemented)
        .with_state(signals);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut builder = tonic::transport::Server::builder()
        .layer(a.layer(CALLS.quota()).quota(BURST.quota()))
        .layer(b.layer(KEYS.quota()));
    let serving = builder
        .add_routes(tonic::service::Routes::from(router))
        .serve_with_incoming(TcpIncoming::from(listener));
    let server = tokio::spawn(serving);
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);

    let mut model = Model::default();
    for step in 0..steps {
        let now = clock.now();
        if rng.below(10) == 0 {
            let secs = *rng.pick(&[1u64, 30, 61, 3600, 86_400]);
            clock.advance(Duration::from_secs(secs));
            if trace {
                eprintln!("seed {seed} step {step}: advance {secs}");
            }
            continue;
        }
        let method = *rng.pick(&["Call", "Call", "Stream", "Tokens", "Tokens", "Nope"]);
        let what = match rng.below(20) {
            0..=6 => "ok".to_owned(),
            7..=10 => format!("head:{}", rng.pick(&[2u32, 3, 4, 8, 9, 12, 13, 14, 15])),
            11..=12 => format!("tail:{}", rng.pick(&[3u32, 12, 13, 14])),
            13..=14 => format!("stream:{}", rng.below(3)),
            15..=16 => "open".to_owned(),
            17..=18 => "hang".to_owned(),
            _ => "drop".to_owned(),
        };
        let shape = match what.as_str() {
            "open" => 1,
            w if w.starts_with("stream") => 1,
            "hang" | "drop" => 0,
            _ => rng.below(3) as u8,
        };
        let call = Call {
            account: (rng.below(15) != 0).then(|| *rng.pick(&ACCOUNTS)),
            plan: *rng.pick(&PLANS),
            keys: match rng.below(8) {
                0..=2 => Vec::new(),
                3 => vec![*rng.pick(&KEY_BYTES), *rng.pick(&KEY_BYTES)],
                _ => vec![*rng.pick(&KEY_BYTES)],
            },
            method,
            deadline: what == "hang" && rng.below(3) == 0,
            drop_after: rng.below(5),
            what,
            tokens: (rng.below(3) != 0).then(|| *rng.pick(&[0u64, 1, 2, 5, 9])),
            shape,
        };
        let ctx = format!(
            "seed {seed} step {step} at {now}: {} {} {:?} plan {:?} keys {:?} tokens {:?} shape {} deadline {} (refunds {refund_a}/{refund_b}, reject {reject_unknown}, keys {keys_rig:?})",
            call.method, call.what, call.account, call.plan, call.keys, call.tokens, call.shape, call.deadline
        );
        let seen = make(&mut grpc, &call, &mut entered, &mut gone).await;
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        if trace {
            eprintln!("{ctx}: {seen:?}");
        }

        // The model: which layer answers, and what each charged keeps.
        let known_plan = match call.plan {
            Some(p @ ("free" | "pro")) => Ok(Some(p)),
            None => Ok(None),
            Some(_) if reject_unknown => Err(()),
            Some(_) => Ok(None),
        };
        // (quota, subject, cost charged, layer: 0 outer, 1 keys, 2 tokens)
        let mut charged: Vec<(&Q, String, u64, usize)> = Vec::new();
        // The code the layers answer with, and the quota that refused.
        let mut refused: Option<(Code, Option<&Q>)> = None;
        let account = call.account;
        match (account, known_plan) {
            (None, _) => refused = Some((Code::Unauthenticated, None)),
            (Some(_), Err(())) => refused = Some((Code::PermissionDenied, None)),
            (Some(account), Ok(plan)) => {
                let mut layers: Vec<(Vec<&Q>, Option<String>)> =
                    vec![(vec![&CALLS, &BURST], Some(account.to_owned()))];
                match call.keys.as_slice() {
                    [] => layers.push((Vec::new(), None)),
                    [key] if !key.is_empty() => layers.push((vec![&KEYS], Some(key_text(key)))),
                    _ => layers.push((Vec::new(), Some(String::new()))),
                }
                if call.method == "Tokens" {
                    layers.push((vec![&TOKENS], Some(account.to_owned())));
                }
                for (layer, (quotas, subject)) in layers.into_iter().enumerate() {
                    let Some(subject) = subject else { continue };
                    if quotas.is_empty() {
                        // Two keys, or an empty one: malformed.
                        refused = Some((Code::InvalidArgument, None));
                        break;
                    }
                    if layer == 1 && keys_rig.is_some() {
                        // Its store fails (fail closed).
                        refused = Some((Code::Unavailable, None));
                        break;
                    }
                    let full = quotas.iter().copied().find(|q| {
                        !q.shadow && model.used(q, &subject, now) + 1 > q.limit_for(plan)
                    });
                    if let Some(q) = full {
                        refused = Some((Code::ResourceExhausted, Some(q)));
                        break;
                    }
                    for q in quotas {
                        model.add(q, &subject, now, 1);
                        charged.push((q, subject.clone(), 1, layer));
                    }
                }
            }
        }
        let plan = known_plan.ok().flatten();
        let (verb, arg) = call.what.split_once(':').unwrap_or((&call.what, "0"));
        let arg: i32 = arg.parse().unwrap();
        let handler_code = match verb {
            "head" | "tail" => Code::from_i32(arg),
            _ => Code::Ok,
        };
        let unrouted = call.method == "Nope" || (verb == "head" && arg == 12);
        let hangs = verb == "hang" || verb == "drop";
        let unserved = hangs && refused.is_none() && call.method != "Nope";
        let failure = verb == "head" && [2, 13, 14, 15].contains(&arg);
        // What each layer gives back or adds once the answer is known.
        let refund_of = |layer: usize| if layer == 1 { refund_b } else { refund_a };
        let back: Vec<bool> = charged
            .iter()
            .map(|&(_, _, _, layer)| {
                refused.is_some() || unrouted || unserved || (failure && refund_of(layer))
            })
            .collect();
        for ((q, subject, cost, _), back) in charged.iter().zip(&back) {
            if *back {
                model.add(q, subject, now, -(*cost as i64));
            } else if q.name == TOKENS.name {
                let real = call.tokens.unwrap_or(1);
                model.add(q, subject, now, real as i64 - 1);
            }
        }

        // What the client sees.
        let Some(seen) = seen else {
            assert!(unserved || verb == "drop", "{ctx}: abandoned");
            check_counters_if(leased.is_none(), &policies, &model, now, &ctx).await;
            continue;
        };
        // The server's deadline (wall-clock time) may end a call a slow
        // charge holds as well as one its handler holds: nothing is
        // charged either way.
        if call.deadline && seen.code == Code::Cancelled {
            assert!(refused.is_some() || unserved, "{ctx}: {seen:?}");
            check_counters_if(leased.is_none(), &policies, &model, now, &ctx).await;
            continue;
        }
        match refused {
            Some((code, quota)) => {
                assert_eq!(seen.code, code, "{ctx}: {seen:?}");
                if code == Code::Unavailable {
                    let retry: u64 = seen.head["retry-after"].to_str().unwrap().parse().unwrap();
                    assert!(retry >= 1, "{ctx}: {seen:?}");
                }
                if let Some(q) = quota {
                    assert!(seen.message.contains(q.name), "{ctx}: {seen:?}");
                    let retry: u64 = seen.head["retry-after"].to_str().unwrap().parse().unwrap();
                    assert!(retry >= 1, "{ctx}: {seen:?}");
                    let r = fields::remaining(&seen.head);
                    assert_eq!(r.get(q.name), Some(&0), "{ctx}: {seen:?}");
                }
            }
            None if call.method == "Nope" => {
                assert_eq!(seen.code, Code::Unimplemented, "{ctx}: {seen:?}")
            }
            None if hangs => {
                assert!(
                    matches!(seen.code, Code::Cancelled | Code::DeadlineExceeded),
                    "{ctx}: {seen:?}"
                )
            }
            None => assert_eq!(seen.code, handler_code, "{ctx}: {seen:?}"),
        }
        // The fields of the head: each layer that charged tells where its
        // quotas stand; none past an unrouted answer.
        let trailers_after_body = verb == "tail" || (verb == "stream" && refused.is_none());
        if !trailers_after_body && !hangs {
            let r = fields::remaining(&seen.head);
            if unrouted && refused.is_none() {
                assert!(r.is_empty(), "{ctx}: fields of an unrouted call {r:?}");
            }
            if !unrouted || refused.is_some() {
                for (q, subject, _, _) in &charged {
                    let want = q
                        .limit_for(plan)
                        .saturating_sub(model.used(q, subject, now));
                    assert_eq!(r.get(q.name), Some(&want), "{ctx}: r of {}", q.name);
                }
            }
        }
        check_counters_if(leased.is_none(), &policies, &model, now, &ctx).await;
    }
    server.abort();
    if let Some(leased) = leased {
        leased.shutdown().await;
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        // Once every unit is back, the store under the lease holds what the
        // model says.
        let inner = policies_of_inner(leased.inner().clone(), &clock);
        check_counters(
            &inner,
            &model,
            clock.now(),
            &format!("seed {seed} after shutdown"),
        )
        .await;
    }
}

async fn check_counters_if<St: Store>(
    on: bool,
    policies: &Policies<St>,
    model: &Model,
    now: Timestamp,
    ctx: &str,
) {
    if on {
        check_counters(policies, model, now, ctx).await;
    }
}

/// Policies with the same quotas over `store`, to read its counters.
fn policies_of_inner(store: MemoryStore, clock: &ManualClock) -> Policies<MemoryStore> {
    let policies = policies(store, clock, false, false, false, None);
    let _ = policies.a.layer(CALLS.quota()).quota(BURST.quota());
    policies.a.layer(TOKENS.quota());
    policies.b.layer(KEYS.quota());
    policies
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn cases() -> (u64, u64, usize) {
    (
        env("GRPC_MODEL_SEED", 1),
        env("GRPC_MODEL_CASES", 2),
        env("GRPC_MODEL_STEPS", 60) as usize,
    )
}

#[tokio::test]
async fn grpc_calls_match_the_model_on_the_memory_store() {
    let (first, n, steps) = cases();
    for seed in first..first + n {
        run_case(seed, steps, MemoryStore::new(), None).await;
    }
}

#[tokio::test]
async fn grpc_calls_match_the_model_on_a_leased_store() {
    let (first, n, steps) = cases();
    for seed in first..first + n {
        let leased = LeasedStore::new(MemoryStore::new());
        run_case(seed, steps, leased.clone(), Some(&leased)).await;
    }
}
