//! Black-box tests of the gRPC example: the built `grpc` example binary,
//! called with tonic's generated `grpc.health.v1.Health` client.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::{Code, Request};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// The running example, killed when dropped.
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

/// The example's binary, which `cargo test` builds beside the test binaries
/// (`cargo build --example grpc` first when running this test alone).
fn binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("grpc");
    assert!(
        path.exists(),
        "{} is missing: `cargo test` builds the examples",
        path.display()
    );
    path
}

/// Starts the example on a free loopback port with `args`.
fn start(args: &[&str]) -> Server {
    let mut child = Command::new(binary())
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .strip_prefix("listening on http://")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("the gRPC example did not start (first line {line:?})"))
        .to_owned();
    Server { child, addr }
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
