//! The whole `QuotaLayer` (one daily quota, the memory store, the subject
//! from `x-account-id`, the system clock) around a service that answers at
//! once, against that bare service as a baseline: the layer's cost per
//! request is `layer - baseline`.
//!
//! The timing covers building a request, `ready().await`,
//! `call(request).await` and dropping the response, one request after the
//! other on a current-thread tokio runtime.
//!
//! A second baseline, "baseline, RateLimit fields written", is the bare
//! service writing the two fields the layer writes on every answer
//! (`RateLimit-Policy`, the same value each time, and `RateLimit`, formatted
//! per request) into its response, which has no other header: what writing
//! the fields costs by itself, a floor under any layer that writes them.
//!
//! A third baseline, "floor of a quota layer", is the least a quota layer
//! does per request, written by hand around the bare service: read the
//! subject, build its counter's key (on the stack), count it in a map under
//! a lock, put where the subject stands in the request's extensions (what
//! the handler reads), and write the two fields. No plans, zones, refunds,
//! nested layers or policies: what no layer that counts and tells can go
//! below, and what this crate's layer adds above it is its own machinery.
//!
//! For comparison, `tower_governor`'s layer (a GCRA per key in memory,
//! keyed by the same header, a limit nothing reaches) around a service that
//! answers at once with axum's body type, which it needs, against that bare
//! service: governor's cost is `governor - baseline (axum body)`.
//!
//! `cargo bench --bench layer`; with `--features metrics`, the layer records
//! its metrics (into no recorder: the facade's no-op), and a variant runs
//! with a Prometheus recorder (built, not serving) as the recorder of the
//! thread.

use std::convert::Infallible;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use http::{HeaderValue, Request, Response, StatusCode};
use tokio::runtime::Runtime;
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_quota::{FromHeader, QuotaLayer};

#[path = "../examples/shared/floor.rs"]
mod floor;
#[path = "../examples/shared/floor_layer.rs"]
mod floor_layer;

use floor_layer::{Floor, HEADER, LIMIT, POLICY, RATELIMIT, RATELIMIT_POLICY};

async fn trivial(_: Request<()>) -> Result<Response<String>, Infallible> {
    Ok(Response::new(String::new()))
}

async fn trivial_body(_: Request<()>) -> Result<Response<axum::body::Body>, Infallible> {
    Ok(Response::new(axum::body::Body::empty()))
}

/// tower_governor's key: the subject header's bytes.
#[derive(Clone)]
struct SubjectHeader;

impl tower_governor::key_extractor::KeyExtractor for SubjectHeader {
    type Key = Box<[u8]>;

    fn extract<T>(&self, request: &Request<T>) -> Result<Self::Key, tower_governor::GovernorError> {
        request
            .headers()
            .get(HEADER)
            .map(|id| id.as_bytes().into())
            .ok_or(tower_governor::GovernorError::UnableToExtractKey)
    }
}

/// `trivial`, answering with the two fields a quota layer writes.
async fn with_fields(request: Request<()>) -> Result<Response<String>, Infallible> {
    let mut response = Response::new(String::new());
    // A value that changes per request, as a remaining count does.
    let id = request
        .headers()
        .get(HEADER)
        .map_or(0, |id| id.len() as u64);
    let value = floor::ratelimit_value(LIMIT - id, 86_400 - id);
    let headers = response.headers_mut();
    headers.insert(RATELIMIT_POLICY.clone(), POLICY);
    headers.insert(RATELIMIT.clone(), value);
    Ok(response)
}

/// Requests naming the subjects in turn, from where the last batch stopped.
struct Subjects {
    ids: Vec<HeaderValue>,
    next: usize,
}

impl Subjects {
    fn new(count: usize) -> Self {
        let ids = (0..count)
            .map(|i| HeaderValue::try_from(format!("account-{i:06}")).expect("a header value"))
            .collect();
        Self { ids, next: 0 }
    }

    fn request(&mut self) -> Request<()> {
        let mut request = Request::new(());
        request
            .headers_mut()
            .insert(HEADER, self.ids[self.next].clone());
        self.next = (self.next + 1) % self.ids.len();
        request
    }
}

/// Sends `iters` requests through `service`, one after the other, and
/// returns how long that took. Building each request (a header map with one
/// entry) is timed too, in the baseline as in the layer, so it cancels out in
/// `layer - baseline`; building them all beforehand would instead time cold
/// memory and page faults.
fn drive<S>(runtime: &Runtime, service: &mut S, subjects: &mut Subjects, iters: u64) -> Duration
where
    S: Service<Request<()>, Error = Infallible>,
{
    runtime.block_on(async {
        let start = Instant::now();
        for _ in 0..iters {
            let request = subjects.request();
            let response = service.ready().await.unwrap().call(request).await.unwrap();
            black_box(response);
        }
        start.elapsed()
    })
}

fn layer(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let mut group = c.benchmark_group("layer");
    group
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));

    let mut bare = service_fn(trivial);
    let mut subjects = Subjects::new(1);
    group.bench_function("baseline (no layer)", |b| {
        b.iter_custom(|iters| drive(&runtime, &mut bare, &mut subjects, iters));
    });
    let mut fields = service_fn(with_fields);
    group.bench_function("baseline, RateLimit fields written", |b| {
        b.iter_custom(|iters| drive(&runtime, &mut fields, &mut subjects, iters));
    });

    for (count, name) in [(1, "1 subject"), (100_000, "100000 subjects")] {
        let mut floor = Floor::new(service_fn(trivial));
        let mut subjects = Subjects::new(count);
        drive(&runtime, &mut floor, &mut subjects, count as u64);
        group.bench_function(format!("floor of a quota layer, {name}"), |b| {
            b.iter_custom(|iters| drive(&runtime, &mut floor, &mut subjects, iters));
        });
    }

    let mut bare_body = service_fn(trivial_body);
    group.bench_function("baseline (no layer), axum body", |b| {
        b.iter_custom(|iters| drive(&runtime, &mut bare_body, &mut subjects, iters));
    });

    for (count, name) in [(1, "1 subject"), (100_000, "100000 subjects")] {
        let config = tower_governor::governor::GovernorConfigBuilder::default()
            .key_extractor(SubjectHeader)
            .burst_size(1_000_000_000)
            .period(Duration::from_nanos(1))
            .finish()
            .expect("a burst and a period above zero");
        let mut governor =
            tower_governor::GovernorLayer::new(config).layer(service_fn(trivial_body));
        let mut subjects = Subjects::new(count);
        group.bench_function(format!("tower_governor, {name}"), |b| {
            b.iter_custom(|iters| drive(&runtime, &mut governor, &mut subjects, iters));
        });
    }

    for (count, name) in [(1, "1 subject"), (100_000, "100000 subjects")] {
        let mut service =
            QuotaLayer::daily(LIMIT, FromHeader::account(HEADER)).layer(service_fn(trivial));
        let mut subjects = Subjects::new(count);
        // Every counter exists already: the steady state of a busy day.
        runtime.block_on(async {
            for _ in 0..count {
                let response = service
                    .ready()
                    .await
                    .unwrap()
                    .call(subjects.request())
                    .await
                    .unwrap();
                assert_eq!(response.status(), StatusCode::OK);
                assert!(response.headers().contains_key("ratelimit"));
            }
        });
        group.bench_function(name, |b| {
            b.iter_custom(|iters| drive(&runtime, &mut service, &mut subjects, iters));
        });
        #[cfg(feature = "metrics")]
        {
            let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            group.bench_function(format!("{name}, Prometheus recorder"), |b| {
                b.iter_custom(|iters| {
                    let elapsed = metrics::with_local_recorder(&recorder, || {
                        drive(&runtime, &mut service, &mut subjects, iters)
                    });
                    // Drains the histograms, outside the timing.
                    handle.run_upkeep();
                    elapsed
                });
            });
        }
    }
    group.finish();
}

/// Two threads (each with a runtime of its own, as a server's workers)
/// sending requests for 10 000 subjects at random through one shared layer,
/// through a layer each (each with a store of its own), and through one
/// shared layer whose callers are all in a zone of their own: what the layer
/// costs when cores share it, beside what it costs alone. The time is per
/// request on one thread (the elapsed time, times the threads, over the
/// requests). On a machine whose two cores share their caches (two threads
/// of one core) the two are close; on cores apart, every write to memory
/// the other core wrote last waits for it.
type LayerOf<'a> = Box<dyn Fn(u64) -> Option<QuotaLayer<FromHeader>> + 'a>;

fn two_threads(c: &mut Criterion) {
    const THREADS: u64 = 2;
    let mut group = c.benchmark_group("layer, 2 threads");
    group
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    let ids: Arc<[HeaderValue]> = (0..10_000)
        .map(|i| HeaderValue::try_from(format!("account-{i:06}")).expect("a header value"))
        .collect();
    let layer = || QuotaLayer::daily(LIMIT, FromHeader::account(HEADER));
    let shared = layer();
    let own: Vec<_> = (0..THREADS).map(|_| layer()).collect();
    // Every caller in Berlin, the quota's day in UTC: each request counts
    // the layer's quotas as kept for that zone.
    let berlin = tower_quota::jiff::tz::TimeZone::get("Europe/Berlin").expect("a zone");
    let zoned = tower_quota::QuotaPolicy::builder(FromHeader::account(HEADER))
        .time_zone(move |_| Ok(Some(berlin.clone())))
        .build()
        .layer(tower_quota::Quota::daily(LIMIT));
    let cases: [(&str, LayerOf<'_>); 4] = [
        ("bare service", Box::new(|_| None)),
        ("one shared layer", Box::new(|_| Some(shared.clone()))),
        (
            "a layer per thread",
            Box::new(|t| Some(own[t as usize].clone())),
        ),
        (
            "one shared layer, callers in another zone",
            Box::new(|_| Some(zoned.clone())),
        ),
    ];
    for (name, layer_of) in &cases {
        group.bench_function(*name, |b| {
            b.iter_custom(|iters| {
                let per_thread = iters.div_ceil(THREADS);
                let start = Instant::now();
                std::thread::scope(|scope| {
                    for t in 0..THREADS {
                        let layer = layer_of(t);
                        let ids = Arc::clone(&ids);
                        scope.spawn(move || {
                            let runtime = tokio::runtime::Builder::new_current_thread()
                                .enable_all()
                                .build()
                                .expect("a tokio runtime");
                            runtime.block_on(async {
                                let mut bare = service_fn(trivial);
                                let mut layered = layer.map(|l| l.layer(service_fn(trivial)));
                                // xorshift: the subjects in a random order.
                                let mut x = t * 7_919 + 1;
                                for _ in 0..per_thread {
                                    x ^= x << 13;
                                    x ^= x >> 7;
                                    x ^= x << 17;
                                    let mut request = Request::new(());
                                    request.headers_mut().insert(
                                        HEADER,
                                        ids[(x % ids.len() as u64) as usize].clone(),
                                    );
                                    match &mut layered {
                                        Some(service) => black_box(
                                            service.ready().await.unwrap().call(request).await,
                                        )
                                        .map(drop),
                                        None => black_box(
                                            bare.ready().await.unwrap().call(request).await,
                                        )
                                        .map(drop),
                                    }
                                    .unwrap();
                                }
                            });
                        });
                    }
                });
                start.elapsed() * THREADS as u32
            });
        });
    }
    group.finish();
}

criterion_group!(benches, layer, two_threads);
criterion_main!(benches);
