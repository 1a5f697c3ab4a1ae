//! Black-box tests of the demo server: the built example, spoken to over TCP.

mod demo_server;

use std::process::Command;

use demo_server::{binary as server_binary, start, Reply, Server};

async fn call(server: &Server, method: &str, path: &str, headers: &[(&str, &str)]) -> Reply {
    demo_server::call(&server.addr, method, path, headers).await
}

const ACME: &[(&str, &str)] = &[("x-account-id", "acme")];

#[tokio::test]
async fn demo_server_enforces_read_and_write_allowances() {
    let server = start(&["--limit", "3", "--period", "1d", "--anchor", "calendar"]);
    for _ in 0..3 {
        assert_eq!(call(&server, "GET", "/read", ACME).await.status, 200);
    }
    let refused = call(&server, "GET", "/read", ACME).await;
    assert_eq!(refused.status, 429);
    assert_eq!(
        refused.header("content-type"),
        Some("application/problem+json")
    );
    assert!(refused.header("retry-after").is_some());
    assert!(refused
        .body
        .contains("\"violated-policies\":[\"read-day\"]"));

    // Writes have their own allowance; bulk spends several units of it.
    let bulk = call(&server, "POST", "/bulk?n=2", ACME).await;
    assert_eq!(bulk.status, 200);
    assert!(bulk
        .header("ratelimit")
        .unwrap()
        .starts_with("\"write-day\";r=1;"));
    assert_eq!(call(&server, "POST", "/bulk?n=2", ACME).await.status, 429);
    assert_eq!(call(&server, "POST", "/write", ACME).await.status, 200);
    assert_eq!(call(&server, "POST", "/bulk?n=x", ACME).await.status, 400);

    let status = call(&server, "GET", "/quota", ACME).await;
    assert_eq!(status.status, 200);
    let json: serde_json::Value = serde_json::from_str(&status.body).unwrap();
    assert_eq!(json["read"]["used"], 3);
    assert_eq!(json["read"]["remaining"], 0);
    assert_eq!(json["write"]["used"], 3);
    assert_eq!(json["write"]["anchor"], "calendar");
    assert!(json["read"]["resets_at"]
        .as_str()
        .unwrap()
        .ends_with("T00:00:00Z"));
    // Asking charges nothing.
    let again: serde_json::Value =
        serde_json::from_str(&call(&server, "GET", "/quota", ACME).await.body).unwrap();
    assert_eq!(again["read"]["used"], 3);

    assert_eq!(call(&server, "GET", "/read", &[]).await.status, 401);
    let anonymous = call(&server, "GET", "/quota", &[]).await;
    assert_eq!(anonymous.status, 401);
    assert_eq!(
        anonymous.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(
        call(&server, "GET", "/read", &[("x-account-id", "other")])
            .await
            .status,
        200
    );
}

#[tokio::test]
async fn demo_server_first_use_and_user_subjects() {
    let server = start(&[
        "--limit",
        "1",
        "--period",
        "1h",
        "--anchor",
        "first-use",
        "--subject",
        "user",
        "--tz",
        "Europe/Berlin",
    ]);
    let user = &[("x-user-id", "u-1")];
    let first = call(&server, "GET", "/read", user).await;
    assert_eq!(first.status, 200);
    assert_eq!(
        first.header("ratelimit-policy"),
        Some("\"read-rolling-hour\";q=1;w=3600")
    );
    assert_eq!(call(&server, "GET", "/read", user).await.status, 429);
    // The account header means nothing to a per-user quota.
    assert_eq!(call(&server, "GET", "/read", ACME).await.status, 401);
    let json: serde_json::Value =
        serde_json::from_str(&call(&server, "GET", "/quota", user).await.body).unwrap();
    assert_eq!(json["read"]["anchor"], "first-use");
    assert!(json["read"]["first_call"].is_string());
}

#[tokio::test]
async fn demo_server_without_quota_is_a_baseline() {
    let server = start(&["--quota", "off"]);
    for _ in 0..5 {
        let reply = call(&server, "GET", "/read", &[]).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("ratelimit"), None);
    }
}

#[test]
fn demo_server_refuses_bad_flags() {
    for args in [
        &["--period", "2d"][..],
        &["--anchor", "sometimes"],
        &["--limit", "many"],
        &["--period", "100000000000h"],
        &["--tz", "Mars/Olympus"],
    ] {
        let output = Command::new(server_binary()).args(args).output().unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&output.stderr).contains("error:"),
            "{args:?}"
        );
    }
}
