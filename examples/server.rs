//! A configurable demo server, for trying the layer by hand and for black-box
//! and load tests.
//!
//! ```text
//! cargo run --release --example server -- --listen 127.0.0.1:8080 --limit 1000 --period 1d \
//!     --anchor calendar [--tz UTC] [--subject account|user|device] [--store memory] \
//!     [--on-store-error open|closed] [--quota off]
//! ```
//!
//! With `--features redis`, `--store redis://127.0.0.1:6379/` keeps the
//! counters in Redis, so several server processes enforce one quota.
//!
//! Routes (the subject comes from `x-account-id`, `x-user-id` or
//! `x-device-id`, per `--subject`):
//! - `GET /read`: allowance `read`, cost 1.
//! - `POST /write`: allowance `write`, cost 1.
//! - `POST /bulk?n=K`: costs K of `write`.
//! - `GET /quota`: where the caller stands on each allowance, as JSON;
//!   charges nothing.

use std::net::SocketAddr;
use std::process::exit;
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http::request::Parts;
use http::{HeaderMap, StatusCode};
use serde_json::{json, Value};
use tower_quota::jiff::tz::TimeZone;
use tower_quota::{
    Anchor, FromHeader, InvalidCost, MemoryStore, OnStoreError, Period, Quota, QuotaHandle,
    QuotaLayer, Store, Subject, SubjectError, SubjectExtractor,
};

const USAGE: &str =
    "usage: server [--listen ADDR] [--limit N] [--period 10s|1m|1h|1d|1w|1mo|Ns|Nm|Nh] \
[--anchor calendar|first-use] [--tz ZONE] [--subject account|user|device] [--store memory|redis://HOST:PORT/] \
[--on-store-error open|closed] [--quota on|off]";

struct Options {
    listen: SocketAddr,
    limit: u64,
    period: Period,
    anchor: Anchor,
    subject: FromHeader,
    store: String,
    on_store_error: OnStoreError,
    quota: bool,
}

fn fail(message: &str) -> ! {
    eprintln!("error: {message}\n{USAGE}");
    exit(2)
}

fn parse_period(text: &str) -> Result<Period, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 =
        number.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
            format!("--period {text:?}: expected a positive whole number and a unit")
        })?;
    let fixed = |n: u64, unit: u64| match n.checked_mul(unit) {
        Some(secs) if secs <= 100 * 31_557_600 => Ok(Period::fixed(Duration::from_secs(secs))),
        _ => Err(format!("--period {text:?}: at most 100 years")),
    };
    match (n, unit) {
        (1, "m") => Ok(Period::minute()),
        (1, "h") => Ok(Period::hour()),
        (1, "d") => Ok(Period::day()),
        (1, "w") => Ok(Period::week()),
        (1, "mo") => Ok(Period::month()),
        (n, "s") => fixed(n, 1),
        (n, "m") => fixed(n, 60),
        (n, "h") => fixed(n, 3600),
        _ => Err(format!(
            "--period {text:?}: use 10s, 1m, 1h, 1d, 1w, 1mo, or any whole number of s, m or h"
        )),
    }
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
        quota: true,
    };
    let mut tz = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            exit(0);
        }
        let value = args
            .next()
            .unwrap_or_else(|| fail(&format!("{flag} needs a value")));
        match flag.as_str() {
            "--listen" => {
                options.listen = value
                    .parse()
                    .unwrap_or_else(|_| fail(&format!("--listen {value:?}: expected ADDR:PORT")))
            }
            "--limit" => {
                options.limit = value.parse().unwrap_or_else(|_| {
                    fail(&format!("--limit {value:?}: expected a whole number"))
                })
            }
            "--period" => options.period = parse_period(&value).unwrap_or_else(|e| fail(&e)),
            "--anchor" => {
                options.anchor = match value.as_str() {
                    "calendar" => Anchor::Calendar,
                    "first-use" => Anchor::FirstUse,
                    _ => fail("--anchor takes calendar or first-use"),
                }
            }
            "--tz" => {
                tz = Some(
                    TimeZone::get(&value).unwrap_or_else(|e| fail(&format!("--tz {value:?}: {e}"))),
                )
            }
            "--subject" => {
                options.subject = match value.as_str() {
                    "account" => FromHeader::account("x-account-id"),
                    "user" => FromHeader::user("x-user-id"),
                    "device" => FromHeader::device("x-device-id"),
                    _ => fail("--subject takes account, user or device"),
                }
            }
            "--store" => options.store = value,
            "--on-store-error" => {
                options.on_store_error = match value.as_str() {
                    "open" => OnStoreError::FailOpen,
                    "closed" => OnStoreError::FailClosed {
                        retry_after: Duration::from_secs(1),
                    },
                    _ => fail("--on-store-error takes open or closed"),
                }
            }
            "--quota" => {
                options.quota = match value.as_str() {
                    "on" => true,
                    "off" => false,
                    _ => fail("--quota takes on or off"),
                }
            }
            _ => fail(&format!("unknown flag {flag}")),
        }
    }
    if let Some(tz) = tz {
        options.period = options.period.in_time_zone(tz);
    }
    options
}

fn bulk_cost(parts: &Parts) -> Result<u64, InvalidCost> {
    if parts.uri.path() != "/bulk" {
        return Ok(1);
    }
    let n = parts
        .uri
        .query()
        .unwrap_or("")
        .split('&')
        .find_map(|pair| pair.strip_prefix("n="))
        .ok_or_else(|| InvalidCost::new("POST /bulk needs ?n=K"))?;
    n.parse()
        .map_err(|_| InvalidCost::new("n must be a whole number"))
}

#[derive(Clone)]
struct Handles<St> {
    subject: FromHeader,
    read: QuotaHandle<St>,
    write: QuotaHandle<St>,
}

async fn quota_status<St: Store>(
    State(handles): State<Handles<St>>,
    headers: HeaderMap,
) -> Response {
    let (parts, ()) = {
        let mut request = http::Request::new(());
        *request.headers_mut() = headers;
        request.into_parts()
    };
    let problem = |status: StatusCode, detail: String| {
        let body = json!({
            "type": "about:blank",
            "title": status.canonical_reason(),
            "status": status.as_u16(),
            "detail": detail,
        });
        (
            status,
            [(http::header::CONTENT_TYPE, "application/problem+json")],
            body.to_string(),
        )
            .into_response()
    };
    let subject: Subject = match handles.subject.extract(&parts) {
        Ok(subject) if !subject.id().is_empty() && subject.id().len() <= 256 => subject,
        Ok(_) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "the subject id is empty or too long".into(),
            )
        }
        Err(error @ SubjectError::Malformed(_)) => {
            return problem(StatusCode::BAD_REQUEST, error.to_string())
        }
        Err(SubjectError::Missing) => {
            return problem(
                StatusCode::UNAUTHORIZED,
                format!("send the {} header", handles.subject.header_name()),
            )
        }
    };
    let mut body = serde_json::Map::new();
    for (allowance, handle) in [("read", &handles.read), ("write", &handles.write)] {
        let usage = match handle.usage(&subject).await {
            Ok(usage) => usage,
            Err(error) => return problem(StatusCode::SERVICE_UNAVAILABLE, error.to_string()),
        };
        let entry = &usage[0];
        body.insert(
            allowance.into(),
            json!({
                "quota": entry.quota.name(),
                "limit": entry.usage.limit,
                "used": entry.usage.used,
                "remaining": entry.usage.remaining(),
                "resets_at": entry.usage.resets_at.to_string(),
                "first_call": entry.usage.first_call.map(|t| t.to_string()),
                "anchor": entry.quota.anchor().as_str(),
            }),
        );
    }
    Json(Value::Object(body)).into_response()
}

fn app<St: Store>(options: &Options, store: St) -> Router {
    let read_routes = Router::new().route("/read", get(|| async { "read\n" }));
    let write_routes = Router::new()
        .route("/write", post(|| async { "written\n" }))
        .route("/bulk", post(|| async { "bulk written\n" }));
    if !options.quota {
        return read_routes
            .merge(write_routes)
            .route("/quota", get(|| async { Json(json!({})) }));
    }
    let quota = |tag: &str| {
        Quota::new(options.limit, options.period.clone(), options.anchor).allowance(tag)
    };
    let layer = |tag: &str| {
        QuotaLayer::new(options.subject.clone())
            .quota(quota(tag))
            .store(store.clone())
            .on_store_error(options.on_store_error)
    };
    let read = layer("read");
    let write = layer("write").cost_fn(bulk_cost);
    let handles = Handles {
        subject: options.subject.clone(),
        read: read.handle(),
        write: write.handle(),
    };
    read_routes
        .route_layer(read)
        .merge(write_routes.route_layer(write))
        .merge(
            Router::new()
                .route("/quota", get(quota_status::<St>))
                .with_state(handles),
        )
}

async fn serve(options: Options) {
    let app = match options.store.as_str() {
        "memory" => app(&options, MemoryStore::new()),
        #[cfg(feature = "redis")]
        url if url.starts_with("redis://") || url.starts_with("rediss://") => {
            let store = tower_quota::store::RedisStore::new(url)
                .unwrap_or_else(|e| fail(&format!("--store {url:?}: {e}")));
            // Open a connection and load the script now, so the first
            // requests do not pay for it (and a wrong URL shows at once).
            if let Err(e) = store.preload().await {
                eprintln!("warning: {url} is not answering yet: {e}");
            }
            app(&options, store)
        }
        other => fail(&format!(
            "--store {other:?}: use `memory`{}",
            if cfg!(feature = "redis") {
                " or a redis:// URL"
            } else {
                " (build with --features redis for a redis:// URL)"
            }
        )),
    };
    let listener = tokio::net::TcpListener::bind(options.listen)
        .await
        .unwrap_or_else(|e| fail(&format!("cannot listen on {}: {e}", options.listen)));
    println!(
        "listening on http://{} ({} per {} {}, store {}, quota {})",
        listener.local_addr().unwrap(),
        options.limit,
        options.period.name(),
        options.anchor,
        options.store,
        if options.quota { "on" } else { "off" },
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .unwrap();
}

#[tokio::main]
async fn main() {
    serve(parse_args()).await;
}
