//! A tonic service of its own (one unary and one server-streaming method,
//! written as tonic's generated code is) behind quota layers the way the
//! crate documentation's gRPC section says to add them: on
//! `Server::builder().layer(..)`, one quota per method by `skip_if` on the
//! path, plans from metadata, `refund_server_errors`, a deferred cost, a
//! `-bin` key, a `LeasedStore` over a `MemoryStore`; called with a real
//! tonic client over a loopback port. Each claim of that section is checked
//! against the status the client sees and what the counters hold.

#[allow(dead_code)] // Not every rig is used here.
mod rigged;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rigged::{Rig, Rigged};
use tonic::codec::ProstCodec;
use tonic::codegen::tokio_stream::{self, Stream, StreamExt};
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::transport::server::TcpIncoming;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tower_quota::{
    FromHeader, LeasedStore, ManualClock, MemoryStore, Quota, QuotaHandle, QuotaPolicy, Subject,
    SubjectKind, UnknownPlan,
};

const CALL: &str = "/quota.v1.Demo/Call";
const WATCH: &str = "/quota.v1.Demo/Watch";

type BoxFuture<T> = Pin<Box<dyn Future<Output = Result<T, Status>> + Send>>;
type Messages = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

fn serving() -> HealthCheckResponse {
    HealthCheckResponse { status: 1 }
}

/// What the handlers do, from the call's `x-do` metadata: `ok`, `code:N`
/// (that status, trailers-only), `sleep` (answers after 10 s); for `Watch`
/// also `stream:N` (N messages), `tail:N` (a message, then status N),
/// `open` (a message, then held open). `x-tokens` comes back as
/// `x-tokens-used`.
fn what(metadata: &MetadataMap) -> (String, u32) {
    let what = metadata.get("x-do").unwrap().to_str().unwrap().to_owned();
    let (verb, arg) = what.split_once(':').unwrap_or((&what, "0"));
    (verb.to_owned(), arg.parse().unwrap())
}

fn answer<T>(metadata: &MetadataMap, message: T) -> tonic::Response<T> {
    let mut response = tonic::Response::new(message);
    if let Some(tokens) = metadata.get("x-tokens") {
        response
            .metadata_mut()
            .insert("x-tokens-used", tokens.clone());
    }
    response
}

struct CallSvc;

impl tonic::server::UnaryService<HealthCheckRequest> for CallSvc {
    type Response = HealthCheckResponse;
    type Future = BoxFuture<tonic::Response<HealthCheckResponse>>;
    fn call(&mut self, request: tonic::Request<HealthCheckRequest>) -> Self::Future {
        Box::pin(async move {
            let metadata = request.metadata();
            match what(metadata) {
                (verb, code) if verb == "code" => {
                    Err(Status::new(Code::from_i32(code as i32), "handler"))
                }
                (verb, _) if verb == "sleep" => {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                    Ok(answer(metadata, serving()))
                }
                _ => Ok(answer(metadata, serving())),
            }
        })
    }
}

struct WatchSvc;

// tonic's `Status` is the stream's error type, large as it is.
#[allow(clippy::result_large_err)]
impl tonic::server::ServerStreamingService<HealthCheckRequest> for WatchSvc {
    type Response = HealthCheckResponse;
    type ResponseStream = Messages;
    type Future = BoxFuture<tonic::Response<Messages>>;
    fn call(&mut self, request: tonic::Request<HealthCheckRequest>) -> Self::Future {
        Box::pin(async move {
            let metadata = request.metadata();
            let (verb, arg) = what(metadata);
            let messages: Messages = match verb.as_str() {
                "code" => return Err(Status::new(Code::from_i32(arg as i32), "handler")),
                "sleep" => {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                    Box::pin(tokio_stream::empty())
                }
                "stream" => Box::pin(tokio_stream::iter((0..arg).map(|_| Ok(serving())))),
                "tail" => Box::pin(tokio_stream::iter([
                    Ok(serving()),
                    Err(Status::new(Code::from_i32(arg as i32), "handler")),
                ])),
                "open" => {
                    Box::pin(tokio_stream::iter([Ok(serving())]).chain(tokio_stream::pending()))
                }
                _ => Box::pin(tokio_stream::iter([Ok(serving())])),
            };
            Ok(answer(metadata, messages))
        })
    }
}

/// `quota.v1.Demo`, as tonic's generated server code routes it.
#[derive(Clone)]
struct Demo;

impl tonic::server::NamedService for Demo {
    const NAME: &'static str = "quota.v1.Demo";
}

impl tower::Service<http::Request<tonic::body::Body>> for Demo {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        match request.uri().path() {
            CALL => Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(ProstCodec::default());
                Ok(grpc.unary(CallSvc, request).await)
            }),
            WATCH => Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(ProstCodec::default());
                Ok(grpc.server_streaming(WatchSvc, request).await)
            }),
            _ => Box::pin(async move {
                let mut response = http::Response::new(tonic::body::Body::default());
                let headers = response.headers_mut();
                headers.insert(Status::GRPC_STATUS, (Code::Unimplemented as i32).into());
                headers.insert(
                    http::header::CONTENT_TYPE,
                    tonic::metadata::GRPC_CONTENT_TYPE,
                );
                Ok(response)
            }),
        }
    }
}

struct Rig4 {
    call: QuotaHandle<LeasedStore<MemoryStore>>,
    watch: QuotaHandle<LeasedStore<MemoryStore>>,
    keys: QuotaHandle<LeasedStore<MemoryStore>>,
    grpc: tonic::client::Grpc<Channel>,
    server: tokio::task::JoinHandle<()>,
}

/// The server: `Call` on a quota of 5 a day (7 on plan `pro`), `Watch` on
/// 20 a day at a deferred cost, a device key (`x-key-bin`) on 4 a day on
/// every call that sends one, and calls sending `x-broken` on a store that
/// fails.
async fn start(store: LeasedStore<MemoryStore>, clock: &ManualClock) -> Rig4 {
    let call = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store.clone())
        .clock(clock.clone())
        .skip_if(|parts| parts.uri.path() != CALL)
        .plan(|parts| {
            let plan = parts.headers.get("x-plan")?;
            Some(plan.to_str().ok()?.to_owned())
        })
        .plans(["free", "pro"])
        .on_unknown_plan(UnknownPlan::Reject)
        .refund_server_errors(true)
        .build();
    let watch = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store.clone())
        .clock(clock.clone())
        .skip_if(|parts| parts.uri.path() != WATCH)
        .refund_server_errors(true)
        .build();
    let keys = QuotaPolicy::builder(FromHeader::device("x-key-bin"))
        .store(store.clone())
        .clock(clock.clone())
        .skip_if(|parts| !parts.headers.contains_key("x-key-bin"))
        .refund_server_errors(true)
        .build();
    let broken = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(Rigged::new(MemoryStore::new(), Rig::Fail, None))
        .clock(clock.clone())
        .skip_if(|parts| !parts.headers.contains_key("x-broken"))
        .build();
    let tokens = |response: &http::response::Parts| {
        response
            .headers
            .get("x-tokens-used")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(1)
    };
    let (server, grpc) = on_loopback(|incoming| {
        tonic::transport::Server::builder()
            .layer(call.layer(Quota::daily(5).allowance("call").plan("pro", 7)))
            .layer(
                watch
                    .layer(Quota::daily(20).allowance("watch"))
                    .deferred_cost(1, tokens),
            )
            .layer(keys.layer(Quota::daily(4).allowance("keys")))
            .layer(broken.layer(Quota::daily(3).allowance("broken")))
            .add_service(Demo)
            .serve_with_incoming(incoming)
    })
    .await;
    Rig4 {
        call: call.handle(),
        watch: watch.handle(),
        keys: keys.handle(),
        grpc,
        server,
    }
}

/// A server that `serve` runs on a loopback port (its `serve_with_incoming`
/// on `incoming`), and a client connected to it.
async fn on_loopback<F>(
    serve: impl FnOnce(TcpIncoming) -> F,
) -> (tokio::task::JoinHandle<()>, tonic::client::Grpc<Channel>)
where
    F: Future<Output = Result<(), tonic::transport::Error>> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = serve(TcpIncoming::from(listener));
    let server = tokio::spawn(async move { serving.await.unwrap() });
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    (server, tonic::client::Grpc::new(channel))
}

fn request(
    account: Option<&str>,
    what: &str,
    extra: &[(&'static str, &str)],
) -> tonic::Request<HealthCheckRequest> {
    let mut request = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    let md = request.metadata_mut();
    if let Some(account) = account {
        md.insert("x-account-id", account.parse().unwrap());
    }
    md.insert("x-do", what.parse().unwrap());
    for (name, value) in extra {
        md.insert(*name, value.parse().unwrap());
    }
    request
}

fn path(p: &str) -> http::uri::PathAndQuery {
    p.parse().unwrap()
}

fn codec() -> ProstCodec<HealthCheckRequest, HealthCheckResponse> {
    ProstCodec::default()
}

impl Rig4 {
    async fn unary(
        &mut self,
        method: &str,
        request: tonic::Request<HealthCheckRequest>,
    ) -> Result<MetadataMap, Status> {
        self.grpc.ready().await.unwrap();
        self.grpc
            .unary(request, path(method), codec())
            .await
            .map(|r| r.metadata().clone())
    }

    /// A server-streaming call read to its end: the head's metadata, the
    /// messages, and the status at the end.
    async fn stream(
        &mut self,
        request: tonic::Request<HealthCheckRequest>,
    ) -> Result<(MetadataMap, usize, Code), Status> {
        self.grpc.ready().await.unwrap();
        let response = self
            .grpc
            .server_streaming(request, path(WATCH), codec())
            .await?;
        let head = response.metadata().clone();
        let mut stream = response.into_inner();
        let mut n = 0;
        loop {
            match stream.message().await {
                Ok(Some(_)) => n += 1,
                Ok(None) => return Ok((head, n, Code::Ok)),
                Err(status) => return Ok((head, n, status.code())),
            }
        }
    }

    async fn used(&self, which: &str, subject: &Subject) -> u64 {
        // Answers under way settle.
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        let handle = match which {
            "call" => &self.call,
            "watch" => &self.watch,
            _ => &self.keys,
        };
        handle.usage(subject).await.unwrap()[0].used()
    }
}

fn acme() -> Subject {
    Subject::account("acme")
}

#[tokio::test]
async fn a_tonic_service_behind_per_method_quotas_answers_and_counts_as_documented() {
    let clock = ManualClock::new("2026-12-02T10:00:00Z".parse().unwrap());
    let store = LeasedStore::new(MemoryStore::new());
    let mut rig = start(store.clone(), &clock).await;

    // Admitted: the fields as metadata, on `Call`'s quota alone.
    let head = rig
        .unary(CALL, request(Some("acme"), "ok", &[]))
        .await
        .unwrap();
    assert!(
        head.get("ratelimit")
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("\"call-day\";r=4;"),
        "{head:?}"
    );
    assert_eq!(rig.used("call", &acme()).await, 1);
    assert_eq!(rig.used("watch", &acme()).await, 0);

    // Server failures in the head are given back; other codes are not.
    for code in [
        Code::Unknown,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
    ] {
        let what = format!("code:{}", code as i32);
        let status = rig
            .unary(CALL, request(Some("acme"), &what, &[]))
            .await
            .unwrap_err();
        assert_eq!(status.code(), code, "{status:?}");
        assert_eq!(rig.used("call", &acme()).await, 1, "{code:?} was charged");
    }
    for (code, used) in [(Code::InvalidArgument, 2), (Code::DeadlineExceeded, 3)] {
        let what = format!("code:{}", code as i32);
        let status = rig
            .unary(CALL, request(Some("acme"), &what, &[]))
            .await
            .unwrap_err();
        assert_eq!(status.code(), code, "{status:?}");
        assert_eq!(rig.used("call", &acme()).await, used, "{code:?}");
    }
    // The handler's own UNIMPLEMENTED: not charged (documented).
    let status = rig
        .unary(CALL, request(Some("acme"), "code:12", &[]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented);
    assert_eq!(rig.used("call", &acme()).await, 3);

    // A call the server ends at the client's grpc-timeout before its head.
    let mut late = request(Some("acme"), "sleep", &[]);
    late.set_timeout(Duration::from_millis(100));
    let status = rig.unary(CALL, late).await.unwrap_err();
    assert!(
        matches!(status.code(), Code::Cancelled | Code::DeadlineExceeded),
        "{status:?}"
    );
    assert_eq!(
        rig.used("call", &acme()).await,
        3,
        "a timed-out call was charged"
    );

    // Plans from metadata: an unknown plan is PERMISSION_DENIED, `pro` has
    // 7.
    let status = rig
        .unary(CALL, request(Some("acme"), "ok", &[("x-plan", "gold")]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    for _ in 0..2 {
        rig.unary(CALL, request(Some("acme"), "ok", &[]))
            .await
            .unwrap();
    }
    assert_eq!(rig.used("call", &acme()).await, 5);
    let refused = rig
        .unary(CALL, request(Some("acme"), "ok", &[]))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(
        refused
            .message()
            .starts_with("Quota \"call-day\" allows 5 per day"),
        "{refused:?}"
    );
    let md = refused.metadata();
    let retry: u64 = md
        .get("retry-after")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=50_400).contains(&retry), "{retry}");
    assert_eq!(
        md.get("ratelimit-policy").unwrap(),
        "\"call-day\";q=5;w=86400"
    );
    assert!(md
        .get("ratelimit")
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("\"call-day\";r=0;"));
    rig.unary(CALL, request(Some("acme"), "ok", &[("x-plan", "pro")]))
        .await
        .unwrap();
    assert_eq!(rig.used("call", &acme()).await, 6);

    // No subject, a malformed one.
    let status = rig.unary(CALL, request(None, "ok", &[])).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    let long = "a".repeat(300);
    let status = rig
        .unary(CALL, request(Some(&long), "ok", &[]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    // A store failure.
    let status = rig
        .unary(CALL, request(Some("globex"), "ok", &[("x-broken", "1")]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.metadata().get("retry-after").is_some(), "{status:?}");
    assert_eq!(rig.used("call", &Subject::account("globex")).await, 0);

    // Streams: charged from the head, at the deferred cost it tells.
    let (head, n, code) = rig
        .stream(request(Some("acme"), "stream:3", &[("x-tokens", "4")]))
        .await
        .unwrap();
    assert_eq!((n, code), (3, Code::Ok));
    assert!(
        head.get("ratelimit")
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("\"watch-day\";r=16;"),
        "{head:?}"
    );
    assert_eq!(rig.used("watch", &acme()).await, 4);
    // A failure in the head is given back; in trailers after a message, not.
    let status = rig
        .stream(request(Some("acme"), "code:13", &[("x-tokens", "4")]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Internal);
    assert_eq!(rig.used("watch", &acme()).await, 4);
    let (_, n, code) = rig
        .stream(request(Some("acme"), "tail:13", &[("x-tokens", "2")]))
        .await
        .unwrap();
    assert_eq!((n, code), (1, Code::Internal));
    assert_eq!(rig.used("watch", &acme()).await, 6);
    // A stream the client drops after its first message stays charged.
    rig.grpc.ready().await.unwrap();
    let open = rig
        .grpc
        .server_streaming(request(Some("acme"), "open", &[]), path(WATCH), codec())
        .await
        .unwrap();
    let mut open = open.into_inner();
    assert!(open.message().await.unwrap().is_some());
    drop(open);
    assert_eq!(rig.used("watch", &acme()).await, 7);
    // A stream whose head the grpc-timeout comes before: not charged.
    let mut late = request(Some("acme"), "sleep", &[("x-tokens", "3")]);
    late.set_timeout(Duration::from_millis(100));
    let status = rig.stream(late).await.unwrap_err();
    assert!(
        matches!(status.code(), Code::Cancelled | Code::DeadlineExceeded),
        "{status:?}"
    );
    assert_eq!(rig.used("watch", &acme()).await, 7);
    assert_eq!(
        rig.used("call", &acme()).await,
        6,
        "Watch charged Call's quota"
    );
    // A real cost of 0 gives the unit charged up front back; a store
    // failure further in gives Watch's charge back.
    rig.stream(request(Some("acme"), "stream:1", &[("x-tokens", "0")]))
        .await
        .unwrap();
    assert_eq!(rig.used("watch", &acme()).await, 7);
    let status = rig
        .stream(request(Some("acme"), "stream:1", &[("x-broken", "1")]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(rig.used("watch", &acme()).await, 7);

    // A `-bin` key: its base64 text as sent is the subject; a method the
    // server does not have is never charged, until the key is at its
    // limit, when it is RESOURCE_EXHAUSTED.
    let key = MetadataValue::from_bytes(b"\xffkey\x00");
    let key_text = String::from_utf8(key.as_encoded_bytes().to_vec()).unwrap();
    let device = Subject::new(SubjectKind::DEVICE, key_text.as_str());
    let with_key = |what: &str| {
        let mut r = request(Some("acme"), what, &[]);
        r.metadata_mut().insert_bin("x-key-bin", key.clone());
        r
    };
    for _ in 0..3 {
        let status = rig
            .unary("/quota.v1.Demo/Nope", with_key("ok"))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
        let status = rig
            .unary("/quota.v1.Other/Call", with_key("ok"))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
    }
    assert_eq!(
        rig.used("keys", &device).await,
        0,
        "UNIMPLEMENTED was charged"
    );
    for _ in 0..4 {
        rig.stream(with_key("stream:1")).await.unwrap();
    }
    assert_eq!(rig.used("keys", &device).await, 4);
    assert_eq!(rig.used("watch", &acme()).await, 11);
    let status = rig
        .unary("/quota.v1.Demo/Nope", with_key("ok"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    // Refused by the key: Watch's own charge is given back.
    let status = rig.stream(with_key("stream:1")).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(rig.used("watch", &acme()).await, 11);
    assert_eq!(rig.used("keys", &device).await, 4);

    // A real cost past what is left is charged whole: the stream was
    // served.
    let (head, _, _) = rig
        .stream(request(Some("acme"), "stream:1", &[("x-tokens", "15")]))
        .await
        .unwrap();
    assert!(
        head.get("ratelimit")
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("\"watch-day\";r=0;"),
        "{head:?}"
    );
    assert_eq!(rig.used("watch", &acme()).await, 26);
    let status = rig
        .stream(request(Some("acme"), "stream:1", &[]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(rig.used("watch", &acme()).await, 26);
    assert_eq!(rig.used("call", &acme()).await, 6);

    rig.server.abort();
    store.shutdown().await;
    drop(Arc::new(()));
}

/// A deferred cost whose rest the store applies late: a call the client's
/// grpc-timeout ends while the layer waits for it never went out and keeps
/// nothing; one that waits past the store's timeout goes out and keeps its
/// real cost.
#[tokio::test]
async fn a_call_ended_by_its_deadline_while_its_real_cost_lands_keeps_nothing() {
    let clock = ManualClock::new("2026-12-02T10:00:00Z".parse().unwrap());
    let leased = LeasedStore::new(MemoryStore::new());
    let store = Rigged::new(leased.clone(), Rig::Fail, Some("none"));
    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
        .store(store.clone())
        .clock(clock.clone())
        .refund_server_errors(true)
        .build();
    let tokens = |response: &http::response::Parts| {
        response
            .headers
            .get("x-tokens-used")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(1)
    };
    let (server, mut grpc) = on_loopback(|incoming| {
        tonic::transport::Server::builder()
            .layer(
                policy
                    .layer(Quota::daily(100).allowance("tokens"))
                    .deferred_cost(1, tokens),
            )
            .add_service(Demo)
            .serve_with_incoming(incoming)
    })
    .await;
    let handle = policy.handle();
    let used = || async { handle.usage(&acme()).await.unwrap()[0].used() };
    store
        .slow_changes
        .store(150, std::sync::atomic::Ordering::Relaxed);

    for (what, tokens) in [("ok", "5"), ("code:13", "5"), ("ok", "0")] {
        let mut call = request(Some("acme"), what, &[("x-tokens", tokens)]);
        call.set_timeout(Duration::from_millis(40));
        grpc.ready().await.unwrap();
        let status = grpc.unary(call, path(CALL), codec()).await.unwrap_err();
        assert_eq!(
            status.code(),
            Code::Cancelled,
            "{what} {tokens}: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(
            used().await,
            0,
            "{what} {tokens}: a call never answered kept units"
        );
    }

    // Past the store's timeout, the call goes out with its real cost.
    let call = request(Some("acme"), "ok", &[("x-tokens", "5")]);
    grpc.ready().await.unwrap();
    let head = grpc
        .unary(call, path(CALL), codec())
        .await
        .unwrap()
        .metadata()
        .clone();
    assert!(
        head.get("ratelimit")
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("\"tokens-day\";r=95;"),
        "{head:?}"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(used().await, 5);
    server.abort();
}

/// tonic's server puts the peer in a `TcpConnectInfo`, not the `SocketAddr`
/// that `ClientIp` reads: without a layer that copies it (as the crate
/// documentation's gRPC section shows), every call is `INTERNAL`, and with
/// it, calls are counted per client address.
#[tokio::test]
async fn client_ip_behind_tonic_counts_the_peer_the_documented_copy_puts_in() {
    fn peer_from_tonic<B>(mut request: http::Request<B>) -> http::Request<B> {
        let peer = request
            .extensions()
            .get::<tonic::transport::server::TcpConnectInfo>()
            .and_then(|info| info.remote_addr());
        if let Some(peer) = peer {
            request.extensions_mut().insert(peer);
        }
        request
    }
    for copied in [false, true] {
        let policy = QuotaPolicy::builder(tower_quota::ClientIp::new()).build();
        let copy = tower::util::option_layer(
            copied.then(|| tower::util::MapRequestLayer::new(peer_from_tonic)),
        );
        let (server, mut grpc) = on_loopback(|incoming| {
            tonic::transport::Server::builder()
                .layer(copy)
                .layer(policy.layer(Quota::daily(2).allowance("call")))
                .add_service(Demo)
                .serve_with_incoming(incoming)
        })
        .await;
        let mut codes = Vec::new();
        for _ in 0..3 {
            grpc.ready().await.unwrap();
            let call = request(None, "ok", &[]);
            let code = match grpc.unary(call, path(CALL), codec()).await {
                Ok(_) => Code::Ok,
                Err(status) => status.code(),
            };
            codes.push(code);
        }
        if copied {
            assert_eq!(
                codes,
                [Code::Ok, Code::Ok, Code::ResourceExhausted],
                "counted per peer"
            );
            let peer = policy
                .handle()
                .subject(&SubjectKind::IP, "127.0.0.1")
                .unwrap();
            assert_eq!(policy.handle().usage(&peer).await.unwrap()[0].used(), 2);
        } else {
            assert_eq!(codes, [Code::Internal; 3], "no peer to count");
        }
        server.abort();
    }
}
