//! A configurable demo server, for trying the layer by hand and for black-box
//! and load tests.
//!
//! ```text
//! cargo run --release --example server -- --listen 127.0.0.1:8080 --limit 1000 --period 1d \
//!     --anchor calendar [--tz UTC] [--subject account|user|device] [--store memory] \
//!     [--on-store-error open|closed] [--quota on|off|fields|governor] [--burst 10] [--plans free=100,pro=10000] \
//!     [--admin-token T | --admin-token-file PATH] [--shadow] [--metrics] [--zone-header NAME] [--lease] [--lease-idle MS]
//!     [--store-timeout MS]
//! ```
//!
//! With `--features redis`, `--store redis://127.0.0.1:6379/` keeps the
//! counters in Redis, so several server processes enforce one quota; a
//! Redis on the same host can also be reached on its Unix socket,
//! `--store redis+unix:///run/redis/redis.sock`.
//!
//! Routes (the subject comes from `x-account-id`, `x-user-id` or
//! `x-device-id`, per `--subject`):
//! - `GET /read`: allowance `read`, cost 1.
//! - `POST /write`: allowance `write`, cost 1.
//! - `POST /bulk?n=K`: costs K (above 0) of `write`.
//! - `GET /search`: allowance `read`, and a burst quota of its own
//!   (allowance `search`, `--burst` per calendar minute); a search refused by
//!   the burst quota spends nothing of `read`.
//! - `GET /fail`: allowance `read`, answers 500 and is refunded.
//! - `GET /healthz`: never charged, no subject needed.
//! - `GET /quota`: where the caller stands on each allowance, as JSON;
//!   charges nothing.
//! - With `--admin-token T`, the support routes under `/admin` (`GET
//!   /admin/quota/{kind}/{id}`, `POST /admin/reset/{kind}/{id}/{allowance}`,
//!   `POST /admin/refund/{kind}/{id}/{allowance}?amount=N`), for requests
//!   with `Authorization: Bearer T`. `--admin-token-file PATH` reads the
//!   token from a file instead (its first line), where other users of the
//!   machine cannot read it in the process list.
//!
//! - With `--metrics` (a build with `--features metrics`), `GET /metrics`:
//!   the layer's metrics in the Prometheus text format; never charged.
//!
//! Unknown paths (404) and wrong methods (405) are never charged. With
//! `--plans free=100,pro=10000`, the caller's plan comes from the `x-plan`
//! header (absent: the first plan listed; unknown, or two named: 403) and its number
//! replaces `--limit` for `read` and `write`. With `--shadow`, every quota
//! is counted and reported but never refuses. With `--zone-header NAME`,
//! each caller's calendar days (weeks, months) turn at midnight in the IANA
//! zone its `NAME` header names (absent: `--tz`; unknown or malformed: 400,
//! nothing charged; not the subject's header nor `x-plan`). A
//! demonstration: each zone has counters of its own, so a client that
//! chooses its zone can spend a day's allowance in each; a real API reads
//! the zone from the authenticated account.
//!
//! `--quota off` serves the same routes without a quota, `--quota fields`
//! writes the two `RateLimit` fields on them and counts nothing, `--quota
//! governor` puts tower_governor's layer in front, keyed by the same header
//! with a limit nothing reaches: the references of the benchmarks.
//!
//! `--store-timeout MS` sets how long a call to the store is waited for
//! before it counts as failed (100 ms by default; above 25 with `--lease`,
//! the longest a leased store waits on purpose before it answers), while
//! the store answers nothing: a Redis that keeps answering other calls is
//! waited for up to ten times as long. A Redis
//! store gives up on its own call at four fifths of it (80 ms of the
//! default), so that its own error reaches the layer; as a Redis store
//! waits 10 s at most, `--store-timeout` is then at most 12500.
//!
//! With `--lease`, the store is wrapped in a `LeasedStore`: a busy subject's
//! requests are counted from blocks taken from the store (Redis) in one
//! charge, and the unused units go back when the subject has been idle for
//! `--lease-idle` milliseconds (1000 by default). On Ctrl-C or SIGTERM the
//! server stops taking requests, finishes those under way (for 5 s at
//! most, or until a second signal), settles what the fail-open ledger owes
//! (5 s at most), gives every unused unit back, waits for the Redis calls
//! still in flight (5 s at most), and exits; a signal during any of those
//! stops it at once.

#[path = "shared/period.rs"]
mod period;
#[path = "shared/stop_signal.rs"]
mod stop_signal;

// Only its `RateLimit` value, for `--quota fields`.
#[allow(dead_code)]
#[path = "shared/floor.rs"]
mod floor;

use std::net::SocketAddr;
use std::process::exit;
use std::time::Duration;

use period::parse_period;
use stop_signal::Stops;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http::request::Parts;
use http::StatusCode;
use serde_json::{json, Value};
use tower_quota::jiff::tz::TimeZone;
use tower_quota::{
    response, Anchor, FromHeader, InvalidRequest, LeasedStore, MemoryStore, OnStoreError, Period,
    Quota, QuotaHandle, QuotaPolicy, Store, UnknownPlan,
};

const USAGE: &str =
    "usage: server [--listen ADDR] [--limit N] [--period 10s|1m|1h|1d|1w|1mo|Ns|Nm|Nh] \
[--anchor calendar|first-use] [--tz ZONE] [--subject account|user|device] [--store memory|redis://HOST:PORT/|redis+unix:///PATH] \
[--on-store-error open|closed] [--quota on|off|fields|governor] [--burst N] [--plans NAME=N,NAME=N] [--admin-token T | --admin-token-file PATH] \
[--shadow] [--metrics] [--zone-header NAME] [--lease] [--lease-idle MS] [--store-timeout MS]";

struct Options {
    listen: SocketAddr,
    limit: u64,
    period: Period,
    anchor: Anchor,
    subject: FromHeader,
    store: String,
    on_store_error: OnStoreError,
    quota: Mode,
    burst: u64,
    plans: Vec<(String, u64)>,
    admin_token: Option<String>,
    shadow: bool,
    metrics: bool,
    zone_header: Option<http::HeaderName>,
    lease: bool,
    lease_idle: Duration,
    store_timeout: Duration,
}

/// `--quota`: this crate's layer, none, the fields alone, or
/// tower_governor's.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    On,
    Off,
    Fields,
    Governor,
}

/// tower_governor's key: the subject header's bytes, as the quota reads
/// them.
#[derive(Clone, Debug)]
struct SubjectHeader(http::HeaderName);

impl tower_governor::key_extractor::KeyExtractor for SubjectHeader {
    type Key = Box<[u8]>;

    fn extract<T>(
        &self,
        request: &http::Request<T>,
    ) -> Result<Self::Key, tower_governor::GovernorError> {
        let mut values = request.headers().get_all(&self.0).iter();
        match (values.next(), values.next()) {
            (Some(value), None) => Ok(value.as_bytes().into()),
            // A problem document, as every other error of the server.
            _ => {
                let refused = response::problem(
                    StatusCode::BAD_REQUEST,
                    &format!("send one {} header", self.0),
                );
                let (parts, body) = refused.into_parts();
                Err(tower_governor::GovernorError::Other {
                    code: parts.status,
                    msg: Some(String::from_utf8_lossy(&body).into_owned()),
                    headers: Some(parts.headers),
                })
            }
        }
    }
}

fn fail(message: &str) -> ! {
    eprintln!("error: {message}\n{USAGE}");
    exit(2)
}

fn parse_plans(text: &str) -> Result<Vec<(String, u64)>, String> {
    let mut plans: Vec<(String, u64)> = Vec::new();
    for item in text.split(',') {
        // Spaces around a name or a number are no part of it (`free=100,
        // pro=10000`): HTTP strips those around a header's value, so no
        // `x-plan` header could send them.
        let (name, limit) = item
            .split_once('=')
            .map(|(name, limit)| {
                (
                    name.trim_matches([' ', '\t']),
                    limit.trim_matches([' ', '\t']),
                )
            })
            .filter(|(name, _)| !name.is_empty())
            .ok_or_else(|| format!("--plans {text:?}: expected NAME=N,NAME=N"))?;
        let limit = limit
            .parse()
            .map_err(|_| format!("--plans {text:?}: {limit:?} is not a whole number"))?;
        // The server reads an `x-plan` value that is not visible ASCII as
        // no plan it knows: a plan named so could never be chosen.
        if !name.bytes().all(|b| b == b' ' || b.is_ascii_graphic()) {
            return Err(format!(
                "--plans {text:?}: plan {name:?} is no name an x-plan header can send (visible \
                 ASCII and inner spaces only)"
            ));
        }
        if plans.iter().any(|(n, _)| n == name) {
            return Err(format!("--plans {text:?}: plan {name:?} is listed twice"));
        }
        plans.push((name.to_owned(), limit));
    }
    Ok(plans)
}

fn parse_args() -> Options {
    let mut options = Options {
        listen: "127.0.0.1:8080".parse().unwrap(),
        limit: 1000,
        period: Period::day(),
        anchor: Anchor::Calendar,
        subject: FromHeader::account("x-account-id"),
        store: "memory".into(),
        on_store_error: OnStoreError::FailClosed {
            retry_after: Duration::from_secs(1),
        },
        quota: Mode::On,
        burst: 10,
        plans: Vec::new(),
        admin_token: None,
        shadow: false,
        metrics: false,
        zone_header: None,
        lease: false,
        lease_idle: Duration::from_secs(1),
        store_timeout: Duration::from_millis(100),
    };
    let mut tz = None;
    let mut lease_idle_given = false;
    // Flags that shape the quota, refused when there is none.
    let mut quota_flags: Vec<String> = Vec::new();
    let mut calendar_period = true;
    // Each flag once: a second value would silently replace the first
    // (`--limit 100 ... --limit 10`); the two token flags name one token.
    let mut given: Vec<String> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let one_of = |f: &str| ["--admin-token", "--admin-token-file"].contains(&f);
        if let Some(earlier) = given
            .iter()
            .find(|seen| **seen == flag || one_of(seen) && one_of(&flag))
        {
            if *earlier == flag {
                fail(&format!("{flag} is given more than once"));
            }
            fail(&format!("{earlier} and {flag} are given: one token, once"));
        }
        if flag.starts_with("--") {
            given.push(flag.clone());
        }
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            exit(0);
        }
        if flag == "--shadow" {
            // Every quota counted and reported, none enforced.
            options.shadow = true;
            continue;
        }
        if flag == "--metrics" {
            options.metrics = true;
            continue;
        }
        if flag == "--lease" {
            options.lease = true;
            continue;
        }
        // Taken by the flag's arm below: an unknown flag given last is
        // reported as unknown, not as one that needs a value.
        let next = args.next();
        let value = || {
            next.clone()
                .unwrap_or_else(|| fail(&format!("{flag} needs a value")))
        };
        if [
            "--burst",
            "--on-store-error",
            "--plans",
            "--admin-token",
            "--admin-token-file",
            "--zone-header",
            "--store-timeout",
        ]
        .contains(&flag.as_str())
        {
            quota_flags.push(flag.clone());
        }
        let whole = |value: &str| -> u64 {
            value
                .parse()
                .unwrap_or_else(|_| fail(&format!("{flag} {value:?}: expected a whole number")))
        };
        match flag.as_str() {
            "--listen" => {
                let value = value();
                options.listen = value
                    .parse()
                    .unwrap_or_else(|_| fail(&format!("--listen {value:?}: expected ADDR:PORT")))
            }
            "--limit" => options.limit = whole(&value()),
            "--lease-idle" => match whole(&value()) {
                0 => fail("--lease-idle takes a number of milliseconds above 0"),
                ms => {
                    options.lease_idle = Duration::from_millis(ms);
                    lease_idle_given = true;
                }
            },
            "--store-timeout" => match whole(&value()) {
                0 => fail("--store-timeout takes a number of milliseconds above 0"),
                ms => options.store_timeout = Duration::from_millis(ms),
            },
            "--burst" => options.burst = whole(&value()),
            "--period" => {
                let value = value();
                options.period = parse_period(&value).unwrap_or_else(|e| fail(&e));
                // `01d` is a day as `1d` is: what was parsed says.
                calendar_period = ["minute", "hour", "day", "week", "month"]
                    .contains(&options.period.name().as_str());
            }
            "--anchor" => {
                options.anchor = match value().as_str() {
                    "calendar" => Anchor::Calendar,
                    "first-use" => Anchor::FirstUse,
                    _ => fail("--anchor takes calendar or first-use"),
                }
            }
            "--tz" => {
                let value = value();
                let zone =
                    TimeZone::get(&value).unwrap_or_else(|e| fail(&format!("--tz {value:?}: {e}")));
                // One of the IANA list, the same on every host that shares
                // the store (what the quota requires of its zone).
                if !tower_quota::period::is_nameable(&zone) {
                    fail(&format!("--tz {value:?}: not a zone of the IANA list"));
                }
                tz = Some(zone);
            }
            "--subject" => {
                options.subject = match value().as_str() {
                    "account" => FromHeader::account("x-account-id"),
                    "user" => FromHeader::user("x-user-id"),
                    "device" => FromHeader::device("x-device-id"),
                    _ => fail("--subject takes account, user or device"),
                }
            }
            "--store" => options.store = value(),
            "--on-store-error" => {
                options.on_store_error = match value().as_str() {
                    "open" => OnStoreError::FailOpen,
                    "closed" => OnStoreError::FailClosed {
                        retry_after: Duration::from_secs(1),
                    },
                    _ => fail("--on-store-error takes open or closed"),
                }
            }
            "--quota" => {
                options.quota = match value().as_str() {
                    "on" => Mode::On,
                    "off" => Mode::Off,
                    "fields" => Mode::Fields,
                    "governor" => Mode::Governor,
                    _ => fail("--quota takes on, off, fields or governor"),
                }
            }
            "--plans" => options.plans = parse_plans(&value()).unwrap_or_else(|e| fail(&e)),
            "--admin-token" => options.admin_token = Some(admin_token(&value(), "--admin-token")),
            "--admin-token-file" => {
                let value = value();
                let text = std::fs::read_to_string(&value)
                    .unwrap_or_else(|e| fail(&format!("--admin-token-file {value:?}: {e}")));
                let line = text.lines().next().unwrap_or("").trim();
                options.admin_token = Some(admin_token(
                    line,
                    &format!("--admin-token-file {value:?}: the file's first line"),
                ));
            }
            "--zone-header" => {
                let value = value();
                options.zone_header = Some(
                    http::HeaderName::try_from(value.as_str()).unwrap_or_else(|_| {
                        fail(&format!("--zone-header {value:?}: not a header name"))
                    }),
                )
            }
            _ => fail(&format!("unknown flag {flag}")),
        }
    }
    if let Some(tz) = tz {
        options.period = options.period.in_time_zone(tz);
    }
    // A caller without a plan is on the first one listed: its number is the
    // quotas' own limit, which support tells for a subject without a plan.
    if let Some((_, first)) = options.plans.first() {
        options.limit = *first;
    }
    if lease_idle_given && !options.lease {
        fail("--lease-idle sets the idle bound of --lease, which is not given");
    }
    if options.shadow {
        quota_flags.push("--shadow".into());
    }
    if options.lease {
        quota_flags.push("--lease".into());
    }
    if options.quota != Mode::On && !quota_flags.is_empty() {
        fail(&format!(
            "{} shape the quota, which --quota off, fields or governor leaves out",
            quota_flags.join(", ")
        ));
    }
    if options.store.starts_with("redis") && redis_budget(options.store_timeout) > MAX_REDIS_BUDGET
    {
        fail(&format!(
            "--store-timeout {} ms: at most {} ms with a Redis store, which waits {} s at most",
            options.store_timeout.as_millis(),
            (MAX_REDIS_BUDGET * 5 / 4).as_millis(),
            MAX_REDIS_BUDGET.as_secs()
        ));
    }
    if options.lease && options.store == "memory" {
        fail("--lease takes blocks of a store many servers share (a redis:// URL); the memory store is this process's own");
    }
    if options.zone_header.is_some() && (options.anchor == Anchor::FirstUse || !calendar_period) {
        fail("--zone-header sets where each caller's calendar days turn: it needs --anchor calendar and a calendar --period (1m, 1h, 1d, 1w, 1mo)");
    }
    if let Some(header) = &options.zone_header {
        let taken = [options.subject.header_name().as_str(), "x-plan"];
        if taken.contains(&header.as_str()) {
            fail(&format!(
                "--zone-header {header}: the server reads that header for something else (the subject, or the plan)"
            ));
        }
    }
    options
}

fn bulk_cost(parts: &Parts) -> Result<u64, InvalidRequest> {
    if parts.uri.path() != "/bulk" {
        return Ok(1);
    }
    // Read as forms write a query; `n` once, in digits.
    let query = parts.uri.query().unwrap_or("");
    let mut given = form_urlencoded::parse(query.as_bytes()).filter(|(name, _)| name == "n");
    let n = given
        .next()
        .ok_or_else(|| InvalidRequest::new("POST /bulk needs ?n=K"))?
        .1;
    if given.next().is_some() {
        return Err(InvalidRequest::new("?n= is given more than once"));
    }
    let digits = !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
    match n.parse() {
        // Nothing to write is not a free pass past a spent allowance.
        Ok(n) if digits && n > 0 => Ok(n),
        _ => Err(InvalidRequest::new("n must be a whole number above 0")),
    }
}

fn problem(status: StatusCode, detail: &str) -> Response {
    response::problem(status, detail)
        .map(axum::body::Body::from)
        .into_response()
}

/// `GET /quota`: where the caller stands on each allowance; charges nothing.
async fn quota_status<St: Store>(State(handle): State<QuotaHandle<St>>, parts: Parts) -> Response {
    // Read as the layers read it: the subject, its plan; charges nothing.
    let usage = match handle.standing(&parts).await {
        Ok(usage) => usage,
        Err(error) => return error.into_response(),
    };
    let mut body = serde_json::Map::new();
    for entry in usage {
        body.insert(
            entry.allowance().to_owned(),
            json!({
                "quota": entry.name(),
                "limit": entry.limit(),
                "used": entry.used(),
                "remaining": entry.remaining(),
                "resets_at": entry.resets_at().to_string(),
                "first_call": entry.first_call().map(|t| t.to_string()),
                "anchor": entry.quota().anchor().as_str(),
                "reset": entry.explain_reset(),
            }),
        );
    }
    Json(Value::Object(body)).into_response()
}

/// `token` as the support routes' token, or the server stops: a token a
/// request can send (not empty, no whitespace nor control characters, which
/// HTTP would strip or refuse).
fn admin_token(token: &str, what: &str) -> String {
    if token.is_empty() {
        fail(&format!("{what}: an empty token"));
    }
    if token
        .bytes()
        .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
    {
        fail(&format!(
            "{what}: a token with whitespace or control characters"
        ));
    }
    token.to_owned()
}

/// Lets through only requests with `Authorization: Bearer <token>`.
async fn bearer(token: &str, request: Request, next: Next) -> Response {
    // The scheme is case-insensitive, and one or more spaces follow it
    // (RFC 9110). One field: with two, which one a proxy or the server
    // behind it reads is anyone's guess (the layer refuses a subject
    // header sent twice alike).
    let mut fields = request
        .headers()
        .get_all(http::header::AUTHORIZATION)
        .iter();
    let sent = fields
        .next()
        .filter(|_| fields.next().is_none())
        .map(|v| v.as_bytes())
        .filter(|v| v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer "))
        .map(|v| v[7..].trim_ascii_start());
    // Compared over the token's length, whatever the token sent and its
    // first difference: timing tells nothing of the token's bytes, nor of
    // its length.
    let matches = sent.is_some_and(|sent| {
        let token = token.as_bytes();
        let differ = (0..token.len()).fold(u8::from(sent.len() != token.len()), |acc, i| {
            acc | (sent.get(i).copied().unwrap_or(0) ^ token[i])
        });
        differ == 0
    });
    if matches {
        next.run(request).await
    } else {
        let mut response = problem(
            StatusCode::UNAUTHORIZED,
            "send Authorization: Bearer <admin token>",
        );
        response.headers_mut().insert(
            http::header::WWW_AUTHENTICATE,
            http::HeaderValue::from_static("Bearer"),
        );
        response
    }
}

fn routes() -> (Router, Router, Router) {
    let read = Router::new()
        .route("/read", get(|| async { "read\n" }))
        .route(
            "/fail",
            get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "failed\n") }),
        );
    let search = Router::new().route("/search", get(|| async { "found\n" }));
    let write = Router::new()
        .route("/write", post(|| async { "written\n" }))
        .route("/bulk", post(|| async { "bulk written\n" }));
    (read, search, write)
}

/// The app, and its quota policy (none unless `--quota on`), whose ledger
/// a shutdown settles.
fn app<St: Store>(options: &Options, store: St) -> (Router, Option<QuotaPolicy<FromHeader, St>>) {
    let (read, search, write) = routes();
    let health = Router::new().route("/healthz", get(|| async { "ok\n" }));
    match options.quota {
        Mode::On => {
            let max = store.max_count();
            let largest = options
                .plans
                .iter()
                .map(|(_, n)| *n)
                .chain([options.limit, options.burst])
                .max();
            if largest.is_some_and(|n| n > max) {
                fail(&format!(
                    "--limit, --plans or --burst: this store counts exactly up to {max}, a limit may not pass it"
                ));
            }
        }
        Mode::Off => {
            let app = read
                .merge(search)
                .merge(write)
                .merge(health)
                .route("/quota", get(|| async { Json(json!({})) }));
            return (app, None);
        }
        Mode::Fields => {
            // What telling clients where they stand costs by itself: the
            // two fields a quota writes, on the same routes, counting
            // nothing (what is "left" goes down by one per request).
            let app = read
                .merge(search)
                .merge(write)
                .route_layer(tower::util::MapResponseLayer::new(with_fields))
                .merge(health)
                .route("/quota", get(|| async { Json(json!({})) }));
            return (app, None);
        }
        Mode::Governor => {
            // Another rate limiter on the same routes, keyed by the same
            // header, with a limit nothing reaches: a point of comparison.
            let config = tower_governor::governor::GovernorConfigBuilder::default()
                .key_extractor(SubjectHeader(options.subject.header_name().clone()))
                .burst_size(1_000_000_000)
                .period(Duration::from_nanos(1))
                .finish()
                .expect("a burst and a period above zero");
            let limiter = config.limiter().clone();
            tokio::spawn(async move {
                let mut every = tokio::time::interval(Duration::from_secs(10));
                loop {
                    every.tick().await;
                    limiter.retain_recent();
                }
            });
            let app = read
                .merge(search)
                .merge(write)
                .route_layer(tower_governor::GovernorLayer::new(config))
                .merge(health)
                .route("/quota", get(|| async { Json(json!({})) }));
            return (app, None);
        }
    }

    let mut policy = QuotaPolicy::builder(options.subject.clone())
        .store(store)
        .on_store_error(options.on_store_error)
        .store_timeout(Some(options.store_timeout))
        .refund_server_errors(true);
    if let Some((first, _)) = options.plans.first() {
        let first = first.clone();
        policy = policy
            .plan(move |parts| {
                // Two plans named is no plan: all of them are told back in
                // the 403, as one unknown plan.
                let named: Vec<_> = parts
                    .headers
                    .get_all("x-plan")
                    .iter()
                    .map(|v| v.to_str().unwrap_or("\u{fffd}"))
                    .collect();
                Some(match named.as_slice() {
                    [] => first.clone(),
                    [plan] => (*plan).to_owned(),
                    several => several.join(", "),
                })
            })
            .plans(options.plans.iter().map(|(name, _)| name.clone()))
            .on_unknown_plan(UnknownPlan::Reject);
    }
    if let Some(header) = options.zone_header.clone() {
        policy = policy.time_zone(tower_quota::zone_from_header(header.as_str()));
    }
    let policy = policy.build();

    let shadow = |quota: Quota| {
        if options.shadow {
            quota.shadow()
        } else {
            quota
        }
    };
    let quota = |tag: &str| {
        let mut quota =
            Quota::new(options.limit, options.period.clone(), options.anchor).allowance(tag);
        for (plan, limit) in &options.plans {
            quota = quota.plan(plan, *limit);
        }
        shadow(quota)
    };
    let burst = shadow(Quota::per_minute(options.burst).allowance("search"));

    let read = read
        .merge(search.route_layer(policy.layer(burst)))
        .route_layer(policy.layer(quota("read")));
    let write = write.route_layer(policy.layer(quota("write")).cost_fn(bulk_cost));
    let handle = policy.handle();
    let mut app = read
        .merge(write)
        .merge(health)
        .route("/quota", get(quota_status::<St>).with_state(handle.clone()));
    if let Some(token) = options.admin_token.clone() {
        let admin = handle
            .router()
            .layer(middleware::from_fn(move |request, next| {
                let token = token.clone();
                async move { bearer(&token, request, next).await }
            }));
        app = app.nest("/admin", admin);
    }
    (app, Some(policy))
}

/// `response` with the `RateLimit-Policy` and `RateLimit` fields of a
/// quota of a billion a day that nothing counts (`--quota fields`).
fn with_fields(mut response: Response) -> Response {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SERVED: AtomicU64 = AtomicU64::new(0);
    const LIMIT: u64 = 1_000_000_000;
    let served = SERVED.fetch_add(1, Ordering::Relaxed) % LIMIT;
    let value = floor::ratelimit_value(LIMIT - 1 - served, 86_400 - served % 86_400);
    let headers = response.headers_mut();
    headers.insert(
        response::RATELIMIT_POLICY.clone(),
        http::HeaderValue::from_static("\"default\";q=1000000000;w=86400"),
    );
    headers.insert(response::RATELIMIT.clone(), value);
    response
}

/// `GET /metrics`, in the Prometheus text format, outside every quota layer.
#[cfg(feature = "metrics")]
fn with_metrics(app: Router) -> Router {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

    // The charge's duration as a Prometheus histogram (buckets from 50 µs
    // to 1 s), which dashboards aggregate across instances; without
    // buckets the exporter renders a summary.
    const CHARGE_SECONDS: &[f64] = &[
        0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
        0.5, 1.0,
    ];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(tower_quota::metrics::CHARGE_DURATION.to_owned()),
            CHARGE_SECONDS,
        )
        .expect("buckets")
        .install_recorder()
        .unwrap_or_else(|e| fail(&format!("--metrics: {e}")));
    tower_quota::metrics::describe();
    // Without the exporter's own listener, upkeep (draining histograms) is
    // the application's job.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    app.route(
        "/metrics",
        get(move || {
            let text = handle.render();
            async move {
                (
                    [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                    text,
                )
            }
        }),
    )
}

#[cfg(not(feature = "metrics"))]
fn with_metrics(_: Router) -> Router {
    fail("--metrics needs a build with `--features metrics`")
}

async fn serve(options: Options, stops: Stops) {
    match options.store.as_str() {
        "memory" => {
            let store = MemoryStore::new();
            // A quiet server still gives back the memory of ended periods.
            let purge = store.clone();
            tokio::spawn(async move {
                let mut every = tokio::time::interval(Duration::from_secs(10));
                loop {
                    every.tick().await;
                    purge.purge_expired(tower_quota::jiff::Timestamp::now());
                }
            });
            leased_or_not(&options, store, &stops).await;
        }
        #[cfg(feature = "redis")]
        // (No `rediss://`: the crate's Redis client is built without TLS.)
        url if url.starts_with("redis://") || url.starts_with("redis+unix://") => {
            let shown = without_password(url);
            // The store's own budget follows `--store-timeout` (its default,
            // 80 ms, is four fifths of the layer's default 100 ms).
            let store = tower_quota::store::RedisStore::builder(url)
                .timeout(redis_budget(options.store_timeout))
                .build()
                .unwrap_or_else(|e| fail(&format!("--store {shown:?}: {e}")));
            // Open a connection and load the script now, so the first
            // requests do not pay for it (and a wrong URL shows at once).
            if let Err(e) = store.preload().await {
                eprintln!("warning: {shown} is not answering yet: {e}");
            }
            let at_once = leased_or_not(&options, store.clone(), &stops).await;
            // Calls followed after their callers stopped waiting (a charge or
            // a settle Redis may apply late, then given back) finish first,
            // unless a signal said to stop at once.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            if !at_once {
                tokio::select! {
                    () = async {
                        while store.in_flight() > 0 && tokio::time::Instant::now() < deadline {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    } => {}
                    () = stops.another() => {}
                }
            }
        }
        other => fail(&format!(
            "--store {:?}: use `memory`{}",
            without_password(other),
            if cfg!(feature = "redis") {
                " or a redis:// or redis+unix:// URL"
            } else {
                " (build with --features redis for a redis:// URL)"
            }
        )),
    }
}

/// Serves on `store`, or with `--lease` on a `LeasedStore` of it, whose
/// unused units go back once the server stopped; whether a signal said to
/// stop at once meanwhile.
async fn leased_or_not<St: Store>(options: &Options, store: St, stops: &Stops) -> bool {
    if !options.lease {
        return run(options, store, stops).await;
    }
    let leased = LeasedStore::builder(store).idle(options.lease_idle).build();
    let wait = leased.longest_wait();
    if options.store_timeout <= wait {
        fail(&format!(
            "--store-timeout must be above {} ms with --lease: a leased store may wait that long \
             before it answers",
            wait.as_millis()
        ));
    }
    if run(options, leased.clone(), stops).await {
        eprintln!("stopped before the leased units went back");
        return true;
    }
    let stopping = stops.another();
    tokio::select! {
        units = leased.shutdown() => println!("gave back {units} leased units"),
        // Told to stop again: the units held stay charged until their
        // lease mark ends.
        () = stopping => {
            eprintln!("stopped before the leased units went back");
            return true;
        }
    }
    false
}

/// Serves until a signal; whether another said to stop at once while the
/// ledger settled.
async fn run<St: Store>(options: &Options, store: St, stops: &Stops) -> bool {
    let (app, policy) = app(options, store);
    let app = if options.metrics {
        with_metrics(app)
    } else {
        app
    };
    // Unknown paths (404) and wrong methods (405, axum adds `Allow`) answer
    // problem documents, as every other error. Set last, over every route
    // and outside the quota layers: never charged, no subject needed.
    let app = app
        .method_not_allowed_fallback(|| async {
            problem(
                StatusCode::METHOD_NOT_ALLOWED,
                "this route takes another method",
            )
        })
        .fallback(|| async { problem(StatusCode::NOT_FOUND, "no route here") });
    let listener = tokio::net::TcpListener::bind(options.listen)
        .await
        .unwrap_or_else(|e| fail(&format!("cannot listen on {}: {e}", options.listen)));
    println!(
        "listening on http://{} ({} per {} {}, store {}{}, quota {})",
        listener.local_addr().unwrap(),
        options.limit,
        options.period.name(),
        options.anchor,
        without_password(&options.store),
        if options.lease { ", leased" } else { "" },
        match options.quota {
            Mode::On => "on",
            Mode::Off => "off",
            Mode::Fields => "fields",
            Mode::Governor => "governor",
        },
    );
    // On a signal, new connections stop and those open finish their
    // requests: for `DRAIN` at most (a client that never finishes sending
    // its request would hold the server forever), or until a second signal.
    let serving = axum::serve(listener, app).with_graceful_shutdown({
        let stops = stops.clone();
        // Any signal since start-up, this one's output included.
        async move { stops.reached(1).await }
    });
    tokio::select! {
        served = serving => served.unwrap(),
        () = async {
            stops.reached(1).await;
            tokio::select! {
                () = tokio::time::sleep(DRAIN) => {}
                () = stops.reached(2) => {}
            }
        } => eprintln!("connections still open when the server stopped were closed"),
    }
    // A second signal that cut the drain short (or came while it ended)
    // said to stop at once: nothing more is waited for.
    let mut at_once = stops.count() >= 2;
    // Admissions made while the store was away (`--on-store-error open`)
    // are counted before the server goes.
    if let Some(policy) = policy {
        let owed = if at_once {
            policy.owed()
        } else {
            tokio::select! {
                owed = policy.settle_owed(Duration::from_secs(5)) => owed,
                // Told to stop again: at once, what is owed uncounted.
                () = stops.reached(2) => {
                    at_once = true;
                    policy.owed()
                }
            }
        };
        if owed.units > 0 {
            eprintln!(
                "{} units owed on {} counters go uncounted: the store did not take them{}",
                owed.units,
                owed.counters,
                match owed.unanswered {
                    0 => String::new(),
                    n => format!(" ({n} of them may count: the store did not answer their settle)"),
                },
            );
        }
    }
    at_once
}

/// `url` with its user part (a name and password) and its query (where a
/// `redis+unix://` URL takes `pass=`), if any, shown as `***`: what the
/// server prints of a Redis URL.
fn without_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    // The user part runs to the last `@`: a password may hold a `/` or a
    // `?` (unescaped, the URL is invalid, and its error is where it shows).
    // An `@` further on hides more than the user part, never less.
    let (user, rest) = match rest.rsplit_once('@') {
        Some((_, host)) => ("***@", host),
        None => ("", rest),
    };
    let (rest, query) = match rest.split_once('?') {
        Some((rest, _)) => (rest, "?***"),
        None => (rest, ""),
    };
    format!("{scheme}://{user}{rest}{query}")
}

/// How long a Redis store waits for its own call at most (its builder's
/// bound).
const MAX_REDIS_BUDGET: Duration = Duration::from_secs(10);

/// The Redis store's own budget for a call: four fifths of `--store-timeout`,
/// below it, so that the store's own error (and its give-back of a charge
/// Redis applies late) reaches the layer before the layer stops waiting.
fn redis_budget(store_timeout: Duration) -> Duration {
    store_timeout / 5 * 4
}

/// How long the server waits, once told to stop, for the requests on its
/// connections to finish.
const DRAIN: Duration = Duration::from_secs(5);

#[tokio::main]
async fn main() {
    // The layer's warnings (a store failing, a ledger dropping a debt) on
    // stderr; `RUST_LOG=info` adds support's actions and shadow quotas
    // exceeded, `RUST_LOG=tower_quota=debug` each decision.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    // Before anything that may take a while: a signal from now on stops
    // the server gracefully.
    let stops = Stops::listen();
    serve(parse_args(), stops).await;
}
