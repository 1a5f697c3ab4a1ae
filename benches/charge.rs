//! The memory store's charge: one request on one daily quota, for a single
//! subject charged over and over, and for 100 000 subjects in turn.
//!
//! Each request is cloned in the batch's setup, outside the timing; the
//! timing covers `Store::charge`, polling its ready future, and dropping the
//! request.
//!
//! `cargo bench --bench charge`

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use tower_quota::jiff::Timestamp;
use tower_quota::store::{ChargeRequest, Store};
use tower_quota::{MemoryStore, Namespace, Quota, Subject};

/// Polls a future that is ready at once, as the memory store's are.
fn now_or_never<F: Future>(future: F) -> F::Output {
    match pin!(future).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("the memory store answers without waiting"),
    }
}

/// One request per subject, as the layer builds them: one line on a daily
/// quota with room for every charge the benchmark makes.
fn requests(subjects: usize, now: Timestamp) -> Vec<ChargeRequest> {
    let quota = Quota::daily(1 << 40);
    let namespace = Namespace::default();
    (0..subjects)
        .map(|i| {
            let subject = Subject::account(format!("account-{i:06}"));
            ChargeRequest {
                charged_at: None,
                now,
                lines: smallvec::smallvec![quota.line(&namespace, &subject, now, 1)],
            }
        })
        .collect()
}

fn charge(c: &mut Criterion) {
    let now: Timestamp = "2026-12-02T13:05:00Z".parse().expect("a timestamp");
    let mut group = c.benchmark_group("charge");
    group
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for (subjects, name) in [(1, "1 subject"), (100_000, "100000 subjects")] {
        let store = MemoryStore::new();
        let requests = requests(subjects, now);
        // Every counter exists already: the steady state of a busy day.
        for request in &requests {
            let outcome =
                now_or_never(store.charge(request.clone())).expect("the memory store never fails");
            assert!(outcome.admitted);
        }
        assert_eq!(store.len(), subjects);
        let mut next = 0;
        group.bench_function(name, |b| {
            b.iter_batched(
                || {
                    let request = requests[next].clone();
                    next = (next + 1) % requests.len();
                    request
                },
                |request| now_or_never(store.charge(request)),
                BatchSize::SmallInput,
            );
        });
    }
    group.finish();
}

criterion_group!(benches, charge);
criterion_main!(benches);
