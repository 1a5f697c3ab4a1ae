//! Black-box tests of the gRPC example: the built `grpc` example binary,
//! called with tonic's generated `grpc.health.v1.Health` client.

mod demo_server;

use demo_server::Server;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::{Code, Request};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

fn start(args: &[&str]) -> Server {
    demo_server::start_example("grpc", args)
}

async fn client(server: &Server) -> HealthClient<Channel> {
    let channel = Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
}

fn check(account: Option<&str>) -> Request<HealthCheckRequest> {
    let mut request = Request::new(HealthCheckRequest {
        service: String::new(),
    });
    if let Some(account) = account {
        request
            .metadata_mut()
            .insert("x-account-id", MetadataValue::try_from(account).unwrap());
    }
    request
}

#[tokio::test]
async fn calls_past_the_quota_are_resource_exhausted_with_retry_after() {
    let server = start(&["--limit", "3", "--period", "1d"]);
    let mut health = client(&server).await;

    for remaining in (0..3).rev() {
        let response = health.check(check(Some("acme"))).await.unwrap();
        assert_eq!(response.get_ref().status(), ServingStatus::Serving);
        // An admitted call carries the fields in its metadata too.
        let ratelimit = response.metadata().get("ratelimit").unwrap();
        assert!(
            ratelimit
                .to_str()
                .unwrap()
                .starts_with(&format!("\"default-day\";r={remaining};")),
            "{ratelimit:?}"
        );
    }

    let refused = health.check(check(Some("acme"))).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("default-day"), "{refused:?}");
    let metadata = refused.metadata();
    let retry_after: u64 = metadata
        .get("retry-after")
        .expect("retry-after in the metadata")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=86_400).contains(&retry_after), "{retry_after}");
    assert!(metadata
        .get("ratelimit")
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("\"default-day\";r=0;"));
    assert_eq!(
        metadata.get("ratelimit-policy").unwrap(),
        "\"default-day\";q=3;w=86400"
    );

    // Another account has its own allowance.
    let other = health.check(check(Some("globex"))).await.unwrap();
    assert_eq!(other.get_ref().status(), ServingStatus::Serving);
}

#[tokio::test]
async fn a_call_without_the_account_is_unauthenticated() {
    let server = start(&["--limit", "3"]);
    let mut health = client(&server).await;
    let refused = health.check(check(None)).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    assert!(refused.message().contains("charged to"), "{refused:?}");
}

/// SIGTERM (what a container runtime sends) stops the server as Ctrl-C
/// does: it exits cleanly, once its clients' connections are closed. (Two
/// worker threads: the client's connection closes while the test waits.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_grpc_example_cleanly() {
    let mut server = start(&[]);
    let mut health = client(&server).await;
    assert!(health.check(check(Some("acme"))).await.is_ok());
    drop(health);
    server.signal("TERM");
    let status = server.exit_within(std::time::Duration::from_secs(5));
    assert!(
        status.is_some_and(|status| status.success()),
        "exited {status:?}"
    );
}

/// A call that never ends (a `Watch` stream, which a health checker keeps
/// open) does not hold a stopping server: it stops within its drain time,
/// or at once on a second signal, and exits cleanly, as the demo server
/// does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_watch_stream_does_not_hold_a_stopping_grpc_example() {
    for second_signal in [false, true] {
        let mut server = start(&[]);
        let mut health = client(&server).await;
        let mut watch = health
            .watch(check(Some("acme")))
            .await
            .unwrap()
            .into_inner();
        assert!(watch.message().await.unwrap().is_some());
        server.signal("TERM");
        if second_signal {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            server.signal("TERM");
        }
        let within = if second_signal { 2 } else { 8 };
        let status = server.exit_within(std::time::Duration::from_secs(within));
        assert!(
            status.is_some_and(|status| status.success()),
            "second signal {second_signal}: exited {status:?}"
        );
        drop(watch);
    }
}

/// A call to a method the server does not have (tonic answers
/// UNIMPLEMENTED, gRPC's 404) is not charged, as an unknown path never is.
#[tokio::test(flavor = "current_thread")]
async fn a_call_to_an_unknown_method_is_not_charged() {
    use tonic_health::pb::HealthCheckResponse;
    use tower_quota::{FromHeader, Quota, QuotaPolicy, Subject};

    let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    let (_reporter, health) = tonic_health::server::health_reporter();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = tonic::transport::Server::builder()
        .layer(policy.layer(Quota::daily(3)))
        .add_service(health)
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    let server = tokio::spawn(serving);
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    for _ in 0..2 {
        grpc.ready().await.unwrap();
        let codec = tonic::codec::ProstCodec::<HealthCheckRequest, HealthCheckResponse>::default();
        let path = http::uri::PathAndQuery::from_static("/nope.v1.Nope/Call");
        let refused = grpc
            .unary(check(Some("acme")), path, codec)
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::Unimplemented, "{refused:?}");
    }
    let usage = policy
        .handle()
        .usage(&Subject::account("acme"))
        .await
        .unwrap();
    assert_eq!(usage[0].used(), 0, "calls to no method were charged");
    server.abort();
}
