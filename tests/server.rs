//! Black-box tests of the demo server: the built example, spoken to over TCP.

mod demo_server;
#[cfg(feature = "redis")]
mod redis_support;

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
    // Nothing to write is no free pass past a spent allowance.
    assert_eq!(call(&server, "POST", "/bulk?n=0", ACME).await.status, 400);
    // `n` once, in digits.
    for query in ["n=1&n=2", "n=%2B1", "n=", "n=-1", "n=1.0"] {
        let reply = call(&server, "POST", &format!("/bulk?{query}"), ACME).await;
        assert_eq!(reply.status, 400, "{query}");
    }

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

    let unnamed = call(&server, "GET", "/read", &[]).await;
    assert_eq!(unnamed.status, 401);
    let challenge = Some("ApiKey header=\"x-account-id\"");
    assert_eq!(unnamed.header("www-authenticate"), challenge);
    let anonymous = call(&server, "GET", "/quota", &[]).await;
    assert_eq!(anonymous.status, 401);
    assert_eq!(
        anonymous.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(anonymous.header("www-authenticate"), challenge);
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

/// Under `--quota governor` too, a request the governor cannot key (no
/// subject header, or two) is refused with a problem document, as every
/// other error of the demo server, not a bare text without a content type.
#[tokio::test]
async fn demo_server_with_governor_refuses_with_problems() {
    let server = start(&["--quota", "governor"]);
    for headers in [&[][..], &[("x-account-id", "a"), ("x-account-id", "b")]] {
        let reply = call(&server, "GET", "/read", headers).await;
        assert_eq!(reply.status, 400, "{headers:?}");
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json"),
            "{headers:?}: {}",
            reply.body
        );
        let problem: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
        assert_eq!(problem["status"], 400, "{problem}");
        assert!(problem["detail"].is_string(), "{problem}");
    }
    assert_eq!(call(&server, "GET", "/read", ACME).await.status, 200);
}

#[tokio::test]
async fn demo_server_with_fields_only_writes_them_and_counts_nothing() {
    let server = start(&["--quota", "fields", "--limit", "1"]);
    let mut left = Vec::new();
    for _ in 0..3 {
        let reply = call(&server, "GET", "/read", ACME).await;
        assert_eq!(reply.status, 200);
        assert_eq!(
            reply.header("ratelimit-policy"),
            Some("\"default\";q=1000000000;w=86400")
        );
        let field = reply.header("ratelimit").unwrap().to_owned();
        let r: u64 = field
            .split(";r=")
            .nth(1)
            .and_then(|rest| rest.split(';').next())
            .unwrap()
            .parse()
            .unwrap();
        left.push(r);
    }
    assert!(left.windows(2).all(|w| w[1] < w[0]), "{left:?}");
    // No subject needed, nothing refused.
    assert_eq!(call(&server, "GET", "/read", &[]).await.status, 200);
}

#[test]
fn demo_server_refuses_bad_flags() {
    for args in [
        &["--period", "2d"][..],
        &["--anchor", "sometimes"],
        &["--limit", "many"],
        &["--period", "100000000000h"],
        &["--tz", "Mars/Olympus"],
        &["--tz", "localtime"],
        &["--burst", "-1"],
        &["--plans", "free"],
        &["--plans", "free=1,free=2"],
        &["--admin-token", ""],
        &["--admin-token", " s3cret"],
        &["--admin-token", "s3 cret"],
        &["--admin-token-file", "/nonexistent/token"],
        &["--lease-idle", "500"],
        &["--store-timeout", "0"],
        &["--store-timeout", "soon"],
        // More than a Redis store waits for its own call.
        &[
            "--store",
            "redis://127.0.0.1:1/",
            "--store-timeout",
            "12501",
        ],
        &["--quota", "count"],
        // Flags of a quota, with none, or where they would do nothing.
        &["--quota", "off", "--admin-token", "s3cret"],
        &["--quota", "fields", "--plans", "a=1"],
        &["--quota", "governor", "--shadow"],
        &["--quota", "off", "--store-timeout", "50"],
        &["--lease"],
        &["--anchor", "first-use", "--zone-header", "x-tz"],
        &["--period", "10s", "--zone-header", "x-tz"],
        // An unknown flag, last or not.
        &["--limit", "5", "--bogus"],
        &["--bogus", "5"],
    ] {
        let output = Command::new(server_binary()).args(args).output().unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("error:"), "{args:?}");
        if args.contains(&"--bogus") {
            assert!(
                stderr.contains("unknown flag --bogus"),
                "{args:?}: {stderr}"
            );
        }
    }
}

/// Flags whose meaning would be silently other than written: each refused
/// with exit code 2 and the message `told`.
#[test]
fn demo_server_refuses_flags_whose_meaning_would_be_other_than_written() {
    for (args, told) in [
        // The server reads an `x-plan` value that is not visible ASCII as
        // no plan it knows: a plan named so could never be chosen, every
        // request naming it answered 403.
        (&["--plans", "free=1,pr\u{f3}=2"][..], "x-plan header"),
        (&["--plans", "free=1,pro\u{7f}=2"], "x-plan header"),
        (&["--plans", "free=1,a\tb=2"], "x-plan header"),
        // The second value would silently replace the first.
        (
            &["--limit", "5", "--limit", "6"],
            "--limit is given more than once",
        ),
        (
            &["--shadow", "--shadow"],
            "--shadow is given more than once",
        ),
        // Two flags that name one token.
        (
            &["--admin-token", "s3cret", "--admin-token-file", "/dev/null"],
            "--admin-token and --admin-token-file are given",
        ),
        // A zone read from the subject's header, or the plan's: every
        // request would be a 400.
        (
            &["--zone-header", "X-Account-Id"],
            "the server reads that header for something else",
        ),
        (
            &["--subject", "user", "--zone-header", "x-user-id"],
            "the server reads that header for something else",
        ),
        (
            &["--zone-header", "x-plan"],
            "the server reads that header for something else",
        ),
    ] {
        // Each of these starts a server where the flag is not refused:
        // waited for a while, then stopped.
        let mut child = Command::new(server_binary())
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if std::time::Instant::now() > deadline {
                child.kill().unwrap();
                child.wait().unwrap();
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert_eq!(
            status.and_then(|s| s.code()),
            Some(2),
            "{args:?} started a server"
        );
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
        assert!(stderr.contains(told), "{args:?}: {stderr}");
    }
}

#[tokio::test]
async fn demo_server_plans_listed_with_spaces_are_named_without_them() {
    // HTTP strips the spaces around a header's value: `x-plan: pro` names
    // the plan listed as ` pro`.
    let server = start(&["--plans", "free=1, pro = 2 ,\tteam=3"]);
    for (plan, limit) in [("free", 1), ("pro", 2), ("team", 3)] {
        let reply = call(
            &server,
            "GET",
            "/read",
            &[("x-account-id", plan), ("x-plan", plan)],
        )
        .await;
        assert_eq!(reply.status, 200, "{plan}: {}", reply.body);
        assert_eq!(
            reply.header("ratelimit-policy"),
            Some(format!("\"read-day\";q={limit};w=86400").as_str()),
            "{plan}"
        );
    }
}

fn quota(reply: &Reply) -> serde_json::Value {
    assert_eq!(reply.status, 200, "{}", reply.body);
    serde_json::from_str(&reply.body).unwrap()
}

#[tokio::test]
async fn demo_server_search_refused_by_its_burst_spends_no_read() {
    let server = start(&["--limit", "10", "--burst", "2"]);
    for _ in 0..2 {
        let found = call(&server, "GET", "/search", ACME).await;
        assert_eq!(found.status, 200);
        let fields = found.header("ratelimit").unwrap();
        assert!(
            fields.contains("\"read-day\"") && fields.contains("\"search-minute\""),
            "{fields}"
        );
    }
    let refused = call(&server, "GET", "/search", ACME).await;
    assert_eq!(refused.status, 429);
    assert!(refused
        .body
        .contains("\"violated-policies\":[\"search-minute\"]"));
    let json = quota(&call(&server, "GET", "/quota", ACME).await);
    assert_eq!(json["read"]["used"], 2);
    assert_eq!(json["search"]["used"], 2);
    assert_eq!(json["search"]["limit"], 2);
}

#[tokio::test]
async fn demo_server_never_charges_health_unknown_paths_or_wrong_methods() {
    let server = start(&["--limit", "1"]);
    for headers in [ACME, &[]] {
        let health = call(&server, "GET", "/healthz", headers).await;
        assert_eq!(health.status, 200);
        assert_eq!(health.header("ratelimit"), None);
        let wrong = call(&server, "GET", "/write", headers).await;
        assert_eq!(wrong.status, 405);
        assert_eq!(wrong.header("allow"), Some("POST"));
        assert_eq!(wrong.header("ratelimit"), None);
        assert_eq!(call(&server, "DELETE", "/read", headers).await.status, 405);
        assert_eq!(call(&server, "GET", "/nowhere", headers).await.status, 404);
    }
    let json = quota(&call(&server, "GET", "/quota", ACME).await);
    assert_eq!(json["read"]["used"], 0);
    assert_eq!(json["write"]["used"], 0);
    assert_eq!(call(&server, "GET", "/read", ACME).await.status, 200);
}

#[tokio::test]
async fn demo_server_refunds_server_errors() {
    let server = start(&["--limit", "1"]);
    for _ in 0..3 {
        let failed = call(&server, "GET", "/fail", ACME).await;
        assert_eq!(failed.status, 500);
        assert!(failed
            .header("ratelimit")
            .unwrap()
            .starts_with("\"read-day\";r=1;"));
    }
    assert_eq!(
        quota(&call(&server, "GET", "/quota", ACME).await)["read"]["used"],
        0
    );
    assert_eq!(call(&server, "GET", "/read", ACME).await.status, 200);
}

#[tokio::test]
async fn demo_server_plans_set_the_limit() {
    let server = start(&[
        "--limit",
        "1000",
        "--plans",
        "free=2,pro=3",
        "--admin-token",
        "s3cret",
    ]);
    let pro: &[(&str, &str)] = &[("x-account-id", "acme"), ("x-plan", "pro")];
    // No plan header: the first plan listed.
    let first = call(&server, "GET", "/read", ACME).await;
    assert_eq!(
        first.header("ratelimit-policy"),
        Some("\"read-day\";q=2;w=86400")
    );
    assert_eq!(call(&server, "GET", "/read", ACME).await.status, 200);
    assert_eq!(call(&server, "GET", "/read", ACME).await.status, 429);
    // Support tells a subject without a plan the first plan's limit, as the
    // layers count it; `?plan=` another's.
    let admin: &[(&str, &str)] = &[("authorization", "Bearer s3cret")];
    for (path, limit) in [
        ("/admin/quota/account/acme", 2),
        ("/admin/quota/account/acme?plan=pro", 3),
    ] {
        let json = quota(&call(&server, "GET", path, admin).await);
        let read = json["allowances"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["allowance"] == "read")
            .unwrap()
            .clone();
        assert_eq!(
            (read["limit"].clone(), read["used"].clone()),
            (limit.into(), 2.into()),
            "{path}"
        );
    }
    // Upgraded: the two spent still count.
    let upgraded = call(&server, "GET", "/read", pro).await;
    assert_eq!(upgraded.status, 200);
    assert_eq!(
        upgraded.header("ratelimit-policy"),
        Some("\"read-day\";q=3;w=86400")
    );
    assert_eq!(call(&server, "GET", "/read", pro).await.status, 429);
    assert_eq!(
        quota(&call(&server, "GET", "/quota", pro).await)["read"]["limit"],
        3
    );
    let gold: &[(&str, &str)] = &[("x-account-id", "acme"), ("x-plan", "gold")];
    let unknown = call(&server, "GET", "/read", gold).await;
    assert_eq!(unknown.status, 403);
    assert_eq!(
        unknown.header("content-type"),
        Some("application/problem+json")
    );
    // Two plans named: refused, not charged on the first.
    let free: &[(&str, &str)] = &[("x-account-id", "zeta"), ("x-plan", "free")];
    let both: &[(&str, &str)] = &[
        ("x-account-id", "zeta"),
        ("x-plan", "pro"),
        ("x-plan", "free"),
    ];
    let ambiguous = call(&server, "GET", "/read", both).await;
    assert_eq!(ambiguous.status, 403);
    assert!(ambiguous.body.contains("pro, free"), "{}", ambiguous.body);
    assert_eq!(
        quota(&call(&server, "GET", "/quota", free).await)["read"]["used"],
        0
    );
}

#[tokio::test]
async fn demo_server_support_routes_need_the_token() {
    let server = start(&["--limit", "5", "--admin-token", "s3cret"]);
    for _ in 0..2 {
        assert_eq!(call(&server, "GET", "/read", ACME).await.status, 200);
    }
    let path = "/admin/quota/account/acme";
    for headers in [
        &[][..],
        &[("authorization", "Bearer wrong")],
        &[("authorization", "Bearer s3cret2")],
        &[("authorization", "Bearer s3cre")],
        &[("authorization", "s3cret")],
    ] {
        let refused = call(&server, "GET", path, headers).await;
        assert_eq!(refused.status, 401);
        assert_eq!(
            refused.header("content-type"),
            Some("application/problem+json")
        );
    }
    // The scheme is case-insensitive.
    let lower: &[(&str, &str)] = &[("authorization", "bearer s3cret")];
    assert_eq!(call(&server, "GET", path, lower).await.status, 200);
    let admin: &[(&str, &str)] = &[("authorization", "Bearer s3cret")];
    let json = quota(&call(&server, "GET", path, admin).await);
    assert_eq!(
        json["subject"],
        serde_json::json!({"kind": "account", "id": "acme"})
    );
    let read = json["allowances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["allowance"] == "read")
        .unwrap();
    assert_eq!(read["name"], "read-day");
    assert_eq!(
        (
            read["limit"].clone(),
            read["used"].clone(),
            read["remaining"].clone()
        ),
        (5.into(), 2.into(), 3.into())
    );
    assert_eq!(read["anchor"], "calendar");
    assert!(read["resets_at"].as_str().unwrap().ends_with("T00:00:00Z"));
    assert!(read["first_call"].is_null());
    for allowance in ["write", "search"] {
        assert!(json["allowances"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["allowance"] == allowance));
    }

    assert_eq!(
        call(&server, "POST", "/admin/reset/account/acme/read", &[])
            .await
            .status,
        401
    );
    let reset = call(&server, "POST", "/admin/reset/account/acme/read", admin).await;
    assert_eq!(reset.status, 200);
    assert_eq!(
        quota(&call(&server, "GET", "/quota", ACME).await)["read"]["used"],
        0
    );
}

/// `Authorization` is a field sent once (RFC 9110, 11.6.2): a request
/// with two is refused, whichever of them holds the token, as the layer
/// refuses a subject header sent twice. The token first and another after
/// is no admin request.
#[tokio::test]
async fn demo_server_refuses_two_authorization_fields() {
    let server = start(&["--admin-token", "s3cret"]);
    let path = "/admin/reset/account/acme/read";
    for headers in [
        &[
            ("authorization", "Bearer s3cret"),
            ("authorization", "Bearer wrong"),
        ][..],
        &[
            ("authorization", "Bearer wrong"),
            ("authorization", "Bearer s3cret"),
        ],
        &[
            ("authorization", "Bearer s3cret"),
            ("authorization", "Bearer s3cret"),
        ],
    ] {
        let refused = call(&server, "POST", path, headers).await;
        assert_eq!(refused.status, 401, "{headers:?}");
        assert_eq!(
            refused.header("content-type"),
            Some("application/problem+json"),
            "{headers:?}"
        );
    }
    let admin: &[(&str, &str)] = &[("authorization", "Bearer s3cret")];
    assert_eq!(call(&server, "POST", path, admin).await.status, 200);
}

#[tokio::test]
async fn demo_server_reads_the_admin_token_from_a_file() {
    let dir = std::env::temp_dir().join(format!("tower-quota-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("token");
    std::fs::write(&file, "s3cret\n").unwrap();
    let server = start(&["--admin-token-file", file.to_str().unwrap()]);
    let path = "/admin/quota/account/acme";
    let admin: &[(&str, &str)] = &[("authorization", "Bearer s3cret")];
    assert_eq!(call(&server, "GET", path, admin).await.status, 200);
    let wrong: &[(&str, &str)] = &[("authorization", "Bearer s3cret2")];
    assert_eq!(call(&server, "GET", path, wrong).await.status, 401);
    let short: &[(&str, &str)] = &[("authorization", "Bearer s3cre")];
    assert_eq!(call(&server, "GET", path, short).await.status, 401);
    // More than one space after the scheme (RFC 9110), and the scheme in
    // any case.
    let spaced: &[(&str, &str)] = &[("authorization", "bearer   s3cret")];
    assert_eq!(call(&server, "GET", path, spaced).await.status, 200);
    // A file whose first line is empty is refused, not a token "".
    let empty = dir.join("empty");
    std::fs::write(&empty, "\nsecond line\n").unwrap();
    let output = Command::new(server_binary())
        .args(["--admin-token-file", empty.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn demo_server_without_admin_token_has_no_support_routes() {
    let server = start(&[]);
    let admin: &[(&str, &str)] = &[("authorization", "Bearer anything")];
    assert_eq!(
        call(&server, "GET", "/admin/quota/account/acme", admin)
            .await
            .status,
        404
    );
}

#[tokio::test]
async fn demo_server_in_shadow_mode_counts_and_never_refuses() {
    let server = start(&["--limit", "1", "--shadow"]);
    let mut last = None;
    for _ in 0..3 {
        let reply = call(&server, "GET", "/read", ACME).await;
        assert_eq!(reply.status, 200);
        last = Some(reply);
    }
    assert!(last
        .unwrap()
        .header("ratelimit")
        .unwrap()
        .starts_with("\"read-day\";r=0;"));
    assert_eq!(
        quota(&call(&server, "GET", "/quota", ACME).await)["read"]["used"],
        3
    );
}

/// The value of the Prometheus sample `name{..}` whose labels include all of
/// `labels`, if the text has one.
#[cfg(feature = "metrics")]
fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?.strip_prefix('{')?;
        let (set, value) = rest.split_once("} ")?;
        let set: Vec<&str> = set.split(',').collect();
        labels
            .iter()
            .all(|l| set.contains(l))
            .then(|| value.trim().parse().unwrap())
    })
}

#[cfg(feature = "metrics")]
#[tokio::test]
async fn demo_server_serves_its_metrics_uncharged() {
    let server = start(&["--limit", "2", "--metrics"]);
    for _ in 0..3 {
        call(&server, "GET", "/read", ACME).await;
    }
    // Asked without a subject, twice: never charged, never a decision.
    for _ in 0..2 {
        let metrics = call(&server, "GET", "/metrics", &[]).await;
        assert_eq!(metrics.status, 200);
        assert!(metrics.header("ratelimit").is_none());
    }
    let metrics = call(&server, "GET", "/metrics", &[]).await;
    assert!(metrics
        .header("content-type")
        .unwrap()
        .starts_with("text/plain"));
    let text = &metrics.body;
    assert!(text.contains("tower_quota_decisions_total{"), "{text}");
    let decisions = |outcome: &str| {
        sample(
            text,
            "tower_quota_decisions_total",
            &[&format!("outcome=\"{outcome}\""), "allowance=\"read\""],
        )
    };
    assert_eq!(decisions("admitted"), Some(2.0), "{text}");
    assert_eq!(decisions("refused"), Some(1.0), "{text}");
    assert_eq!(decisions("skipped"), None, "{text}");
    // A histogram, with buckets: what dashboards aggregate across instances.
    assert!(
        text.contains("# TYPE tower_quota_charge_duration_seconds histogram"),
        "{text}"
    );
    assert!(
        text.contains("tower_quota_charge_duration_seconds_bucket{"),
        "{text}"
    );
    assert!(text.contains("store=\"memory\""), "{text}");
    assert!(!text.contains("acme"), "no subject id in the metrics");
    // The quota still answers as before.
    assert_eq!(call(&server, "GET", "/quota", ACME).await.status, 200);
    let status = call(&server, "GET", "/quota", ACME).await;
    let json: serde_json::Value = serde_json::from_str(&status.body).unwrap();
    assert_eq!(json["read"]["used"], 2);
}

/// A client that never finishes sending its request does not hold the
/// server once it is told to stop: it stops within its drain time, or at
/// once on a second signal.
#[test]
fn a_stalled_client_does_not_hold_a_stopping_server() {
    use std::io::Write;
    use std::time::Duration;

    for second_signal in [false, true] {
        let mut server = start(&[]);
        let mut stalled = std::net::TcpStream::connect(&server.addr).unwrap();
        stalled
            .write_all(b"GET /read HTTP/1.1\r\nhost: test\r\n")
            .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        server.signal("TERM");
        if second_signal {
            std::thread::sleep(Duration::from_millis(200));
            server.signal("TERM");
            assert!(
                server.ended_within(Duration::from_secs(2)),
                "a second signal stops the server at once"
            );
        } else {
            assert!(
                !server.ended_within(Duration::from_secs(1)),
                "the open request is given time to finish"
            );
            assert!(
                server.ended_within(Duration::from_secs(8)),
                "the server stops within its drain time"
            );
        }
        drop(stalled);
    }
}

/// The password of a Redis URL is never printed: the first line shows the
/// store with its user part hidden, and so does the warning that it does
/// not answer.
#[cfg(feature = "redis")]
#[test]
fn demo_server_hides_the_password_of_its_redis_url() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    for (url, shown) in [
        (
            "redis://admin:hunter2@127.0.0.1:1/",
            "redis://***@127.0.0.1:1/",
        ),
        (
            "redis+unix:///nonexistent/redis.sock?pass=hunter2",
            "redis+unix:///nonexistent/redis.sock?***",
        ),
    ] {
        let mut child = Command::new(server_binary())
            .args(["--listen", "127.0.0.1:0"])
            .args(["--store", url])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let _ = child.kill();
        let output = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(line.contains(shown), "{line}");
        assert!(!line.contains("hunter2"), "{line}");
        assert!(!stderr.contains("hunter2"), "{stderr}");
    }
}

/// A password holding a `/` or a `?` (unescaped: the URL is invalid) is
/// not printed either, in the error that tells the URL is wrong.
#[cfg(feature = "redis")]
#[test]
fn demo_server_hides_a_password_with_a_slash_or_a_question_mark() {
    for url in [
        "redis://admin:hun/ter2@127.0.0.1:1/",
        "redis://admin:hun?ter2@127.0.0.1:1/",
    ] {
        let output = Command::new(server_binary())
            .args(["--listen", "127.0.0.1:0"])
            .args(["--store", url])
            .output()
            .unwrap();
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(!output.status.success(), "{url}: {printed}");
        assert!(
            !printed.contains("hun") && !printed.contains("ter2"),
            "{url}: {printed}"
        );
        assert!(printed.contains("redis://***@127.0.0.1:1/"), "{printed}");
    }
}

/// A SIGTERM sent as soon as the server says it listens stops it
/// gracefully (exit 0), as a later one does: the handlers are in place
/// before the line is printed.
#[cfg(unix)]
#[test]
fn a_sigterm_right_after_the_ready_line_stops_the_server_gracefully() {
    for round in 0..10 {
        let mut server = start(&[]);
        server.signal("TERM");
        let status = server
            .exit_within(std::time::Duration::from_secs(10))
            .expect("the server stops");
        assert_eq!(status.code(), Some(0), "round {round}: {status:?}");
    }
}

/// Every error of the demo server is a problem document: an unknown path
/// (under `/admin` too) and a wrong method as well, uncharged as before.
#[tokio::test]
async fn demo_server_answers_unknown_paths_and_wrong_methods_with_problems() {
    let server = start(&["--limit", "1", "--admin-token", "s3cret"]);
    let admin: &[(&str, &str)] = &[("authorization", "Bearer s3cret")];
    for (method, path, headers, status) in [
        ("GET", "/nowhere", ACME, 404),
        ("GET", "/nowhere", &[][..], 404),
        ("GET", "/admin/", admin, 404),
        ("DELETE", "/read", ACME, 405),
        ("GET", "/write", &[][..], 405),
        ("POST", "/quota", ACME, 405),
    ] {
        let reply = call(&server, method, path, headers).await;
        assert_eq!(reply.status, status, "{method} {path}");
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json"),
            "{method} {path}"
        );
        assert!(
            reply.body.contains(&format!("\"status\":{status}")),
            "{method} {path}: {}",
            reply.body
        );
        assert_eq!(reply.header("ratelimit"), None, "{method} {path}");
    }
    assert_eq!(
        call(&server, "GET", "/write", ACME).await.header("allow"),
        Some("POST")
    );
    assert_eq!(
        quota(&call(&server, "GET", "/quota", ACME).await)["read"]["used"],
        0
    );
}

/// Told to stop again while it waits to settle with a Redis that hangs
/// (stopped, not gone: its calls stay in flight), the demo server stops at
/// once, as its documentation says, not after the 5 s it gives calls in
/// flight.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_stops_a_server_settling_with_a_hung_redis() {
    second_signal_with_a_hung_redis(false).await;
}

/// A second signal that cuts the drain short (a client holds its request
/// open) stops the server at once, as one during the settling does: it
/// does not go on to wait for a hung Redis to settle and for its calls in
/// flight (10 s more), which would take a third signal to cut.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_during_the_drain_stops_a_server_with_a_hung_redis_at_once() {
    second_signal_with_a_hung_redis(true).await;
}

/// A server failing open on a Redis that hangs, owing two requests, told
/// to stop and, half a second later (still draining for a request a client
/// holds open, if `draining`; otherwise settling), told again: it exits at
/// once, successfully.
#[cfg(feature = "redis")]
async fn second_signal_with_a_hung_redis(draining: bool) {
    use std::io::Write;
    use std::time::Duration;

    if !redis_support::redis_available() {
        return;
    }
    let redis = redis_support::RedisServer::start();
    let mut server = start(&[
        "--limit",
        "100",
        "--store",
        &redis.url(),
        "--on-store-error",
        "open",
    ]);
    assert_eq!(call(&server, "GET", "/read", ACME).await.status, 200);
    let _hung = redis_support::Stopped::new(&redis);
    for _ in 0..2 {
        assert_eq!(
            call(&server, "GET", "/read", ACME).await.status,
            200,
            "fail open"
        );
    }
    // A request that never finishes: the server drains for it.
    let stalled = draining.then(|| {
        let mut stalled = std::net::TcpStream::connect(&server.addr).unwrap();
        stalled
            .write_all(b"GET /read HTTP/1.1\r\nhost: test\r\n")
            .unwrap();
        stalled
    });
    if draining {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    server.signal("TERM");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !server.ended_within(Duration::from_millis(50)),
        "draining or waiting to settle"
    );
    server.signal("TERM");
    let status = server.exit_within(Duration::from_secs(2));
    assert!(
        status.is_some_and(|s| s.success()),
        "stopped at once by the second signal: {status:?}"
    );
    drop(stalled);
}

/// `--store-timeout` is how long a call to the store is waited for, on
/// Redis too: not the Redis store's own default budget (80 ms).
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_timeout_is_how_long_a_redis_call_is_waited_for() {
    use std::time::Duration;

    if !redis_support::redis_available() {
        return;
    }
    let redis = redis_support::RedisServer::start();
    let server = start(&[
        "--limit",
        "10",
        "--store",
        &redis.url(),
        "--store-timeout",
        "3000",
    ]);
    assert_eq!(call(&server, "GET", "/read", ACME).await.status, 200);
    // Redis answers 300 ms late: well within the 3 s the server waits.
    let mut stalled = redis_support::Stopped::new(&redis);
    let addr = server.addr.clone();
    let slow = tokio::spawn(async move { demo_server::call(&addr, "GET", "/read", ACME).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    stalled.resume();
    let reply = slow.await.unwrap();
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply
        .header("ratelimit")
        .unwrap()
        .starts_with("\"read-day\";r=8;"));
}
