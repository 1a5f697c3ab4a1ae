//! A subject extractor of one's own, as a newcomer writes it from the
//! documentation: a bearer token naming one of several kinds (built-in and
//! custom), behind `.or(FromHeader)` and `.or(ClientIp)`, in several layers
//! of one policy, with the support router nested under `/admin`. Hostile ids
//! (separators, percent signs, unicode, bytes that are not UTF-8, ids that
//! differ only in case or normalisation) each land on a counter of their own,
//! which support reaches through a percent-encoded path, and no log line
//! carries one.
//!
//! `CUSTOM_SUBJECTS_MODEL_CASES` sets how many random cases
//! `random_subjects_match_a_model` runs (default 4),
//! `CUSTOM_SUBJECTS_MODEL_SEED` the first seed.

mod interest;
mod redis_support;
mod seeded;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use axum::Router;
use http::header::AUTHORIZATION;
use http::request::Parts;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use tower::ServiceExt;
use tower_quota::store::Store;
use tower_quota::{
    unrouted, ClientIp, FromHeader, ManualClock, Quota, QuotaPolicy, Subject, SubjectError,
    SubjectExtractor, SubjectKind,
};

/// `authorization: Bearer <kind>.<id>`, the id percent-encoded in the
/// token (so it may carry any bytes), the kind one of four.
struct Token;

fn org() -> SubjectKind {
    SubjectKind::custom("org")
}

fn api_key() -> SubjectKind {
    SubjectKind::custom("api-key")
}

impl SubjectExtractor for Token {
    fn extract(&self, parts: &Parts) -> Result<Subject, SubjectError> {
        let value = parts
            .headers
            .get(AUTHORIZATION)
            .ok_or(SubjectError::Missing)?;
        let token = value
            .as_bytes()
            .strip_prefix(b"Bearer ")
            .ok_or_else(|| SubjectError::malformed("expected `Bearer <kind>.<id>`"))?;
        let dot = token
            .iter()
            .position(|&b| b == b'.')
            .ok_or_else(|| SubjectError::malformed("expected `<kind>.<id>`"))?;
        let kind = match &token[..dot] {
            b"account" => SubjectKind::ACCOUNT,
            b"user" => SubjectKind::USER,
            b"org" => org(),
            b"api-key" => api_key(),
            _ => return Err(SubjectError::malformed("unknown kind")),
        };
        let id: Vec<u8> = percent_encoding::percent_decode(&token[dot + 1..]).collect();
        Ok(Subject::new(kind, id))
    }

    fn kinds(&self) -> Option<Vec<SubjectKind>> {
        Some(vec![
            SubjectKind::ACCOUNT,
            SubjectKind::USER,
            org(),
            api_key(),
        ])
    }

    fn challenge(&self) -> Option<HeaderValue> {
        Some(HeaderValue::from_static("Bearer"))
    }
}

/// What a path segment percent-encodes.
const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

fn encoded(id: &[u8]) -> String {
    percent_encoding::percent_encode(id, SEGMENT).to_string()
}

/// Ids that must each have a counter of their own; every one holds
/// `sk_` so that a log line carrying one is seen.
fn hostile_ids() -> Vec<Vec<u8>> {
    let mut ids: Vec<Vec<u8>> = [
        &b"sk_acme"[..],
        b"sk_ACME",
        b"sk_a:b",
        b"sk_a%3Ab",
        b"sk_{x}",
        b"sk_x}:read:2026-12-02",
        b"sk_100%",
        b"sk_100%25",
        b"sk_a/b",
        b"sk_a b",
        b"sk_a+b",
        "sk_caf\u{e9}".as_bytes(),
        "sk_cafe\u{301}".as_bytes(),
        b"sk_\xff\xfe",
        b"sk_\xc3",
        b"sk_.",
        b"sk_..",
        b"sk_~@",
    ]
    .iter()
    .map(|id| id.to_vec())
    .collect();
    // The longest id the layer charges (256 bytes by default).
    let mut long = b"sk_".to_vec();
    long.resize(256, b'%');
    ids.push(long);
    ids
}

fn kinds() -> Vec<SubjectKind> {
    vec![SubjectKind::ACCOUNT, SubjectKind::USER, org(), api_key()]
}

struct App {
    app: Router,
    clock: ManualClock,
}

fn app<St: Store + Clone>(store: St) -> (App, tower_quota::QuotaHandle<St>) {
    let clock = ManualClock::new("2026-12-02T10:00:00Z".parse().unwrap());
    let policy = QuotaPolicy::builder(
        Token
            .or(FromHeader::new(api_key(), "x-api-key"))
            .or(ClientIp::new()),
    )
    .clock(clock.clone())
    .store(store)
    .build();
    let handle = policy.handle();
    let app = Router::new()
        .route("/read", get(|| async { "read" }))
        .merge(
            Router::new()
                .route("/search", get(|| async { "found" }))
                .route_layer(policy.layer(Quota::per_minute(1_000).allowance("search"))),
        )
        .route_layer(policy.layer(Quota::daily(1_000).allowance("read")))
        .nest("/admin", handle.router())
        .method_not_allowed_fallback(unrouted::MethodNotAllowed);
    (App { app, clock }, handle)
}

fn token(kind: &SubjectKind, id: &[u8]) -> HeaderValue {
    let token = format!("Bearer {}.{}", kind.as_str(), encoded(id));
    HeaderValue::try_from(token).unwrap()
}

impl App {
    async fn call(&self, request: Request<Body>) -> Response<Body> {
        let mut request = request;
        let peer: SocketAddr = "203.0.113.7:4000".parse().unwrap();
        request.extensions_mut().insert(ConnectInfo(peer));
        self.app.clone().oneshot(request).await.unwrap()
    }

    async fn charge(&self, path: &str, kind: &SubjectKind, id: &[u8]) -> StatusCode {
        let request = Request::get(path)
            .header(AUTHORIZATION, token(kind, id))
            .body(Body::empty())
            .unwrap();
        self.call(request).await.status()
    }

    async fn admin(&self, method: Method, path: &str) -> (StatusCode, serde_json::Value) {
        let request = Request::builder()
            .method(method.clone())
            .uri(path)
            .body(Body::empty())
            .unwrap();
        let response = self.call(request).await;
        let status = response.status();
        let content_type = response.headers().get(http::header::CONTENT_TYPE).cloned();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        let json = serde_json::from_slice(&body).unwrap_or_else(|_| {
            panic!(
                "{method} {path}: {status} {content_type:?} {}",
                String::from_utf8_lossy(&body)
            )
        });
        (status, json)
    }
}

fn used(json: &serde_json::Value, name: &str) -> u64 {
    json["allowances"]
        .as_array()
        .unwrap_or_else(|| panic!("{json}"))
        .iter()
        .find(|a| a["name"] == name)
        .unwrap_or_else(|| panic!("no {name} in {json}"))["used"]
        .as_u64()
        .unwrap()
}

/// Charges every (kind, id) a number of times of its own, then reads,
/// refunds and resets each through the support router.
async fn every_subject_its_own_counter(app: &App) {
    let mut pairs = Vec::new();
    for kind in kinds() {
        for id in hostile_ids() {
            pairs.push((kind.clone(), id));
        }
    }
    for (n, (kind, id)) in pairs.iter().enumerate() {
        for _ in 0..(n % 3 + 1) {
            assert_eq!(
                app.charge("/read", kind, id).await,
                StatusCode::OK,
                "{kind} {id:?}"
            );
        }
        if n % 2 == 0 {
            assert_eq!(
                app.charge("/search", kind, id).await,
                StatusCode::OK,
                "{kind} {id:?}"
            );
        }
    }
    for (n, (kind, id)) in pairs.iter().enumerate() {
        let path = format!("/admin/quota/{kind}/{}", encoded(id));
        let (status, json) = app.admin(Method::GET, &path).await;
        assert_eq!(status, StatusCode::OK, "{path}: {json}");
        let read = (n % 3 + 1) as u64 + u64::from(n % 2 == 0);
        assert_eq!(used(&json, "read-day"), read, "{path}: {json}");
        assert_eq!(
            used(&json, "search-minute"),
            u64::from(n % 2 == 0),
            "{path}: {json}"
        );
        assert_eq!(json["subject"]["kind"], kind.as_str(), "{path}: {json}");
    }
    app.clock.advance(Duration::from_secs(1));
    for (n, (kind, id)) in pairs.iter().enumerate() {
        let path = format!("/admin/refund/{kind}/{}/read?amount=1", encoded(id));
        let (status, json) = app.admin(Method::POST, &path).await;
        assert_eq!(status, StatusCode::OK, "{path}: {json}");
        let read = (n % 3 + 1) as u64 + u64::from(n % 2 == 0) - 1;
        assert_eq!(used(&json, "read-day"), read, "{path}: {json}");
    }
    for (kind, id) in pairs.iter().step_by(2) {
        let path = format!("/admin/reset/{kind}/{}/read", encoded(id));
        let (status, json) = app.admin(Method::POST, &path).await;
        assert_eq!(status, StatusCode::OK, "{path}: {json}");
        assert_eq!(used(&json, "read-day"), 0, "{path}: {json}");
    }
    for (n, (kind, id)) in pairs.iter().enumerate() {
        let path = format!("/admin/quota/{kind}/{}", encoded(id));
        let (_, json) = app.admin(Method::GET, &path).await;
        let read = if n % 2 == 0 {
            0
        } else {
            (n % 3 + 1) as u64 - 1
        };
        assert_eq!(
            used(&json, "read-day"),
            read,
            "after the resets, {path}: {json}"
        );
    }
}

#[tokio::test(flavor = "current_thread")]
async fn hostile_ids_of_custom_kinds_each_have_a_counter_support_reaches() {
    let (app, _) = app(tower_quota::store::MemoryStore::new());
    every_subject_its_own_counter(&app).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "current_thread")]
async fn hostile_ids_on_redis_have_one_key_per_counter() {
    let server = redis_server_or_skip!();
    let store = tower_quota::store::RedisStore::new(server.url()).unwrap();
    let (app, _) = app(store);
    every_subject_its_own_counter(&app).await;
    let keys = server.cli(&["--raw", "KEYS", "*"]);
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    let subjects = kinds().len() * hostile_ids().len();
    // A read counter for every other subject (the rest reset), a search
    // counter for every other one.
    let reads = keys.iter().filter(|k| k.contains("}:read:")).count();
    let searches = keys.iter().filter(|k| k.contains("}:search:")).count();
    assert_eq!((reads, searches), (subjects / 2, subjects / 2), "{keys:#?}");
}

/// The handle's own methods reach the subjects the layers charge.
#[tokio::test(flavor = "current_thread")]
async fn the_handle_reaches_what_the_layers_charge() {
    let (app, handle) = app(tower_quota::store::MemoryStore::new());
    for kind in kinds() {
        for id in hostile_ids() {
            assert_eq!(app.charge("/read", &kind, &id).await, StatusCode::OK);
            let subject = handle.subject(&kind, &id).unwrap();
            let caller = handle.for_caller(&subject).await.unwrap();
            let usage = caller.usage(&subject).await.unwrap();
            let day = usage.iter().find(|u| u.name() == "read-day").unwrap();
            assert_eq!(day.used(), 1, "{kind} {id:?}");
            app.clock.advance(Duration::from_millis(10));
            assert!(handle.reset_allowance(&subject, "read").await.unwrap() > 0);
            let usage = handle.usage(&subject).await.unwrap();
            let day = usage.iter().find(|u| u.name() == "read-day").unwrap();
            assert_eq!(day.used(), 0, "{kind} {id:?}");
        }
    }
}

/// The API key from the header and from the token are one subject; the
/// client's address, when neither is sent, is charged and reached as `ip`.
#[tokio::test(flavor = "current_thread")]
async fn fallbacks_share_what_they_should_and_nothing_else() {
    let (app, _) = app(tower_quota::store::MemoryStore::new());
    let header = Request::get("/read")
        .header("x-api-key", "sk_a:b")
        .body(Body::empty())
        .unwrap();
    assert_eq!(app.call(header).await.status(), StatusCode::OK);
    assert_eq!(
        app.charge("/read", &api_key(), b"sk_a:b").await,
        StatusCode::OK
    );
    let (_, json) = app
        .admin(Method::GET, "/admin/quota/api-key/sk_a%3Ab")
        .await;
    assert_eq!(used(&json, "read-day"), 2, "{json}");
    let (_, json) = app
        .admin(Method::GET, "/admin/quota/account/sk_a%3Ab")
        .await;
    assert_eq!(used(&json, "read-day"), 0, "{json}");

    let anonymous = Request::get("/read").body(Body::empty()).unwrap();
    assert_eq!(app.call(anonymous).await.status(), StatusCode::OK);
    let (status, json) = app.admin(Method::GET, "/admin/quota/ip/203.0.113.7").await;
    assert_eq!(status, StatusCode::OK, "{json}");
    assert_eq!(used(&json, "read-day"), 1, "{json}");
    let (status, json) = app
        .admin(Method::GET, "/admin/quota/ip/%3A%3Affff%3A203.0.113.7")
        .await;
    assert_eq!(status, StatusCode::OK, "{json}");
    assert_eq!(used(&json, "read-day"), 1, "{json}");
}

/// What the layer and the router refuse: problem documents, 400, 401 or
/// 404, never a 5xx or plain text.
#[tokio::test(flavor = "current_thread")]
async fn hostile_requests_get_problem_documents() {
    let (app, _) = app(tower_quota::store::MemoryStore::new());
    let problem = |response: Response<Body>| async move {
        let status = response.status();
        let content_type = response.headers()[http::header::CONTENT_TYPE].clone();
        assert_eq!(content_type, "application/problem+json", "{status}");
        status
    };
    // Empty, blank and overlong ids; an unknown kind in the token.
    for id in [&b""[..], b" ", b"\t"] {
        assert_eq!(
            app.charge("/read", &org(), id).await,
            StatusCode::BAD_REQUEST
        );
    }
    assert_eq!(
        app.charge("/read", &org(), &[b'x'; 257]).await,
        StatusCode::BAD_REQUEST
    );
    let request = |value: &'static [u8]| {
        Request::get("/read")
            .header(AUTHORIZATION, HeaderValue::from_bytes(value).unwrap())
            .body(Body::empty())
            .unwrap()
    };
    for value in [
        &b"Bearer ip.1.2.3.4"[..],
        b"Bearer Account.x",
        b"Basic x",
        b"Bearer",
    ] {
        let response = app.call(request(value)).await;
        assert_eq!(
            problem(response).await,
            StatusCode::BAD_REQUEST,
            "{value:?}"
        );
    }
    // Support paths naming what no layer charges, or nothing usable.
    for (path, want) in [
        ("/admin/quota/device/sk_x", StatusCode::NOT_FOUND),
        ("/admin/quota/Org/sk_x", StatusCode::BAD_REQUEST),
        ("/admin/quota/org%3Ax/sk_x", StatusCode::BAD_REQUEST),
        ("/admin/quota/%FF/sk_x", StatusCode::BAD_REQUEST),
        ("/admin/quota/org/%20", StatusCode::BAD_REQUEST),
        ("/admin/quota/ip/sk_x", StatusCode::BAD_REQUEST),
        ("/admin/quota/org/sk_x/extra", StatusCode::NOT_FOUND),
        ("/admin/reset/org/sk_x/nothing", StatusCode::NOT_FOUND),
        ("/admin/reset/org/sk_x/%FF", StatusCode::BAD_REQUEST),
        ("/admin/refund/org/sk_x/read", StatusCode::BAD_REQUEST),
        ("/admin/quota/org", StatusCode::NOT_FOUND),
    ] {
        let method = if path.contains("/quota/") {
            Method::GET
        } else {
            Method::POST
        };
        let response = app
            .call(
                Request::builder()
                    .method(method)
                    .uri(path)
                    .body(Body::empty())
                    .unwrap(),
            )
            .await;
        assert_eq!(problem(response).await, want, "{path}");
    }
    let long = format!("/admin/quota/org/{}", "x".repeat(257));
    let (status, _) = app.admin(Method::GET, &long).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

/// Every event and span field the crate writes, as text.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<String>>>);

struct Collect<'a>(&'a mut Vec<String>);

impl tracing::field::Visit for Collect<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push(format!("{}={value:?}", field.name()));
    }
}

impl tracing::Subscriber for Logs {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let mut logs = self.0.lock().unwrap();
        span.record(&mut Collect(&mut logs));
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        values.record(&mut Collect(&mut self.0.lock().unwrap()));
    }
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        event.record(&mut Collect(&mut self.0.lock().unwrap()));
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[tokio::test(flavor = "current_thread")]
async fn no_log_line_carries_an_id() {
    let logs = Logs::default();
    let _guard = tracing::subscriber::set_default(logs.clone());
    let _interest = interest::every_subscriber_asked();
    let (app, _) = app(tower_quota::store::MemoryStore::new());
    every_subject_its_own_counter(&app).await;
    let anonymous = Request::get("/read").body(Body::empty()).unwrap();
    app.call(anonymous).await;
    let logs = logs.0.lock().unwrap();
    assert!(!logs.is_empty());
    for line in logs.iter() {
        assert!(!line.contains("sk_") && !line.contains("sk%5F"), "{line}");
        assert!(!line.contains("203.0.113"), "{line}");
    }
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Bytes that look like separators, escapes, whitespace, case twins and
/// pieces of UTF-8.
const ALPHABET: &[u8] = b":{}%/ \t+.~@_-aA3\x00\x7f\xc3\xa9\xff";

/// Random (kind, id) pairs, charged through the token or the `x-api-key`
/// header, on random routes; then read, refunded and reset through the
/// support router. Every answer matches a map from (kind, id) to its count.
#[tokio::test(flavor = "current_thread")]
async fn random_subjects_match_a_model() {
    let first = env("CUSTOM_SUBJECTS_MODEL_SEED", 1);
    let cases = env("CUSTOM_SUBJECTS_MODEL_CASES", 4);
    for seed in first..first + cases {
        let mut rng = seeded::Rng(seed);
        let (app, _) = app(tower_quota::store::MemoryStore::new());
        let mut subjects = Vec::new();
        for _ in 0..10 {
            let kind = rng.pick(&kinds()).clone();
            let len = rng.below(6);
            let id: Vec<u8> = (0..len).map(|_| *rng.pick(ALPHABET)).collect();
            subjects.push((kind, id));
        }
        // Now and then the same id under another kind.
        let (_, id) = subjects[0].clone();
        subjects.push((rng.pick(&kinds()).clone(), id));
        let mut model: HashMap<(SubjectKind, Vec<u8>), (u64, u64)> = HashMap::new();
        for _ in 0..60 {
            let (kind, id) = rng.pick(&subjects).clone();
            let search = rng.below(2) == 0;
            let path = if search { "/search" } else { "/read" };
            let by_header = kind == api_key()
                && id.trim_ascii().len() == id.len()
                && HeaderValue::from_bytes(&id).is_ok()
                && rng.below(2) == 0;
            let status = if by_header {
                let request = Request::get(path)
                    .header("x-api-key", HeaderValue::from_bytes(&id).unwrap())
                    .body(Body::empty())
                    .unwrap();
                app.call(request).await.status()
            } else {
                app.charge(path, &kind, &id).await
            };
            let usable = !id.iter().all(u8::is_ascii_whitespace);
            let want = if usable {
                StatusCode::OK
            } else {
                StatusCode::BAD_REQUEST
            };
            assert_eq!(status, want, "seed {seed}: {kind} {id:?} on {path}");
            if usable {
                let counts = model.entry((kind, id)).or_default();
                counts.0 += 1;
                counts.1 += u64::from(search);
            }
        }
        app.clock.advance(Duration::from_secs(1));
        for (kind, id) in &subjects {
            let usable = !id.iter().all(u8::is_ascii_whitespace);
            let path = format!("/admin/quota/{kind}/{}", encoded(id));
            if id.is_empty() {
                // No route names an empty segment: a 404 problem.
                let (status, _) = app.admin(Method::GET, &path).await;
                assert_eq!(status, StatusCode::NOT_FOUND, "seed {seed}: {path}");
                continue;
            }
            let (status, json) = app.admin(Method::GET, &path).await;
            if !usable {
                assert_eq!(
                    status,
                    StatusCode::BAD_REQUEST,
                    "seed {seed}: {path}: {json}"
                );
                continue;
            }
            assert_eq!(status, StatusCode::OK, "seed {seed}: {path}: {json}");
            let (read, search) = model
                .get(&(kind.clone(), id.clone()))
                .copied()
                .unwrap_or_default();
            assert_eq!(used(&json, "read-day"), read, "seed {seed}: {path}: {json}");
            assert_eq!(
                used(&json, "search-minute"),
                search,
                "seed {seed}: {path}: {json}"
            );
            let change = if rng.below(2) == 0 {
                let counts = model.entry((kind.clone(), id.clone())).or_default();
                counts.0 = counts.0.saturating_sub(1);
                format!("/admin/refund/{kind}/{}/read?amount=1", encoded(id))
            } else {
                model.entry((kind.clone(), id.clone())).or_default().0 = 0;
                format!("/admin/reset/{kind}/{}/read", encoded(id))
            };
            let (status, json) = app.admin(Method::POST, &change).await;
            assert_eq!(status, StatusCode::OK, "seed {seed}: {change}: {json}");
        }
        for ((kind, id), (read, _)) in &model {
            let path = format!("/admin/quota/{kind}/{}", encoded(id));
            let (_, json) = app.admin(Method::GET, &path).await;
            assert_eq!(
                used(&json, "read-day"),
                *read,
                "seed {seed}: {path}: {json}"
            );
        }
    }
}

/// Over a real connection: bytes a header may carry that are not UTF-8,
/// and support paths whose escapes are odd, reach the counter charged.
#[tokio::test(flavor = "current_thread")]
async fn over_http_odd_bytes_reach_their_counters() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (app, _) = app(tower_quota::store::MemoryStore::new());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let service = app.app.into_make_service_with_connect_info::<SocketAddr>();
    tokio::spawn(async move { axum::serve(listener, service).await.unwrap() });
    let send = |head: Vec<u8>| async move {
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        stream.write_all(&head).await.unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.unwrap();
        String::from_utf8_lossy(&answer).into_owned()
    };
    let get = |path: &str, header: &[u8]| {
        let mut head =
            format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n").into_bytes();
        head.extend_from_slice(header);
        head.extend_from_slice(b"\r\n");
        head
    };
    for _ in 0..2 {
        let answer = send(get("/read", b"x-api-key: sk_\xff\xfe%zz\r\n")).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    let answer = send(get(
        "/read",
        b"authorization: Bearer api-key.sk_%FF%FE%zz\r\n",
    ))
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    for path in [
        "/admin/quota/api-key/sk_%FF%FE%zz",
        "/admin/quota/api-key/sk_%ff%fe%25zz",
    ] {
        let answer = send(get(path, b"")).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{path}: {answer}");
        assert!(answer.contains(r#""used":3"#), "{path}: {answer}");
    }
}
