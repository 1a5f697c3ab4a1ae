//! The metrics the layer records (the `metrics` feature), read back from a
//! debugging recorder after real requests through an axum `Router`.

#![cfg(feature = "metrics")]

#[cfg(feature = "redis")]
mod redis_support;

use std::future::{ready, Future};

use axum::body::Body;
use axum::routing::get;
use axum::Router;
use http::{Request, StatusCode};
use jiff::Timestamp;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tower::ServiceExt;
use tower_quota::metrics::{
    ABANDONED_CHARGES_REFUNDED, CHARGE_DURATION, COUNTERS_HEALED, DECISIONS,
};
use tower_quota::store::{ChargeOutcome, ChargeRequest, StoreErrorKind};
use tower_quota::{
    FromHeader, OnStoreError, PeriodKey, Quota, QuotaLayer, QuotaPolicy, Store, StoreError,
    SubjectPolicy, Usage,
};

/// A subject id no label may ever carry.
const SUBJECT: &str = "subject-7f3a9c";

/// Label pairs, sorted.
type Labels = Vec<(String, String)>;

/// What the recorder saw: (name, sorted labels, value).
struct Seen(Vec<(String, Labels, DebugValue)>);

impl Seen {
    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.0
            .iter()
            .filter(|(n, l, _)| n == name && same_labels(l, labels))
            .map(|(_, _, v)| match v {
                DebugValue::Counter(n) => *n,
                other => panic!("{name} is not a counter: {other:?}"),
            })
            .sum()
    }

    fn observations(&self, name: &str, labels: &[(&str, &str)]) -> usize {
        self.0
            .iter()
            .filter(|(n, l, _)| n == name && same_labels(l, labels))
            .map(|(_, _, v)| match v {
                DebugValue::Histogram(values) => values.len(),
                other => panic!("{name} is not a histogram: {other:?}"),
            })
            .sum()
    }

    fn assert_no_subject_in_labels(&self) {
        for (name, labels, _) in &self.0 {
            for (key, value) in labels {
                assert!(
                    !value.contains(SUBJECT) && !value.contains("acme"),
                    "{name}{{{key}={value:?}}} carries a subject id"
                );
            }
        }
    }
}

fn same_labels(seen: &[(String, String)], wanted: &[(&str, &str)]) -> bool {
    let mut wanted: Labels = wanted
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    wanted.sort();
    seen == wanted.as_slice()
}

/// Runs `work` on a current-thread runtime with a recorder of its own (so
/// tests running side by side do not see each other's metrics), and returns
/// what it recorded.
fn recorded<F: Future<Output = ()>>(work: impl FnOnce() -> F) -> Seen {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            work().await;
            // Refunds run as tasks of their own: let them finish.
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
        })
    });
    let seen = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let key = key.key();
            let mut labels: Labels = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            (key.name().to_owned(), labels, value)
        })
        .collect();
    Seen(seen)
}

async fn get_as(
    app: &Router,
    path: &str,
    subject: Option<&str>,
    extra: &[(&str, &str)],
) -> StatusCode {
    let mut request = Request::get(path);
    if let Some(subject) = subject {
        request = request.header("x-account-id", subject);
    }
    for (name, value) in extra {
        request = request.header(*name, *value);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    response.status()
}

fn account() -> FromHeader {
    FromHeader::account("x-account-id")
}

#[test]
fn admitted_and_refused_requests_are_counted_per_allowance_and_timed() {
    let seen = recorded(|| async {
        let app = Router::new()
            .route("/", get(|| async { "hello" }))
            .layer(QuotaLayer::new(
                Quota::daily(2).allowance("read"),
                account(),
            ));
        for expected in [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
        ] {
            assert_eq!(get_as(&app, "/", Some(SUBJECT), &[]).await, expected);
        }
    });
    let read = |outcome| [("outcome", outcome), ("allowance", "read")];
    assert_eq!(seen.counter(DECISIONS, &read("admitted")), 2);
    assert_eq!(seen.counter(DECISIONS, &read("refused")), 1);
    assert_eq!(seen.counter(DECISIONS, &read("store_error")), 0);
    // One observation per charge, refused ones included.
    assert_eq!(
        seen.observations(CHARGE_DURATION, &[("store", "memory")]),
        3
    );
    assert_eq!(seen.counter(COUNTERS_HEALED, &[]), 0);
    seen.assert_no_subject_in_labels();
}

#[test]
fn skipped_requests_are_counted_and_never_timed() {
    let seen = recorded(|| async {
        let layer = QuotaPolicy::builder(account())
            .skip_if(|parts| parts.headers.contains_key("x-internal"))
            .on_missing_subject(SubjectPolicy::Allow)
            .build()
            .layer(Quota::daily(1).allowance("read"));
        let app = Router::new()
            .route("/", get(|| async { "hello" }))
            .layer(layer);
        // A skip rule, then a request without a subject; both pass.
        for _ in 0..3 {
            let internal = [("x-internal", "1")];
            assert_eq!(
                get_as(&app, "/", Some(SUBJECT), &internal).await,
                StatusCode::OK
            );
        }
        assert_eq!(get_as(&app, "/", None, &[]).await, StatusCode::OK);
    });
    assert_eq!(
        seen.counter(DECISIONS, &[("outcome", "skipped"), ("allowance", "read")]),
        4
    );
    assert_eq!(
        seen.counter(DECISIONS, &[("outcome", "admitted"), ("allowance", "read")]),
        0
    );
    assert_eq!(
        seen.observations(CHARGE_DURATION, &[("store", "memory")]),
        0
    );
    seen.assert_no_subject_in_labels();
}

/// A request a skip rule lets through is counted as skipped once, by the
/// policy's outermost layer: the layers further in take no decision of
/// their own on it.
#[test]
fn a_skipped_request_is_counted_once_by_the_outermost_layer() {
    let seen = recorded(|| async {
        let policy = QuotaPolicy::builder(account())
            .skip_if(|parts| parts.headers.contains_key("x-internal"))
            .build();
        let app = Router::new()
            .route(
                "/search",
                get(|| async { "found" })
                    .layer(policy.layer(Quota::per_minute(1).allowance("search"))),
            )
            .layer(policy.layer(Quota::daily(1).allowance("read")));
        for _ in 0..2 {
            let internal = [("x-internal", "1")];
            assert_eq!(
                get_as(&app, "/search", Some(SUBJECT), &internal).await,
                StatusCode::OK
            );
        }
    });
    let skipped = |allowance| {
        seen.counter(
            DECISIONS,
            &[("outcome", "skipped"), ("allowance", allowance)],
        )
    };
    assert_eq!(skipped("read"), 2);
    assert_eq!(skipped("search"), 0);
}

#[test]
fn requests_without_a_subject_are_not_decisions() {
    let seen = recorded(|| async {
        let app = Router::new()
            .route("/", get(|| async { "hello" }))
            .layer(QuotaLayer::daily(1, account()));
        assert_eq!(get_as(&app, "/", None, &[]).await, StatusCode::UNAUTHORIZED);
    });
    assert!(
        seen.0.iter().all(|(name, _, _)| name != DECISIONS),
        "a 401 is not a quota decision"
    );
}

/// A store that fails every call.
#[derive(Clone)]
struct Broken;

fn down<T>() -> std::future::Ready<Result<T, StoreError>> {
    ready(Err(StoreError::new(StoreErrorKind::Unavailable, "down")))
}

impl Store for Broken {
    type ChargeFuture = std::future::Ready<Result<ChargeOutcome, StoreError>>;

    fn charge(&self, _: ChargeRequest) -> Self::ChargeFuture {
        down()
    }
    fn peek(
        &self,
        _: ChargeRequest,
    ) -> impl Future<Output = Result<Vec<Usage>, StoreError>> + Send {
        down()
    }
    fn refund(
        &self,
        _: Timestamp,
        _: PeriodKey,
        _: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        down()
    }
    fn add(
        &self,
        _: Timestamp,
        _: PeriodKey,
        _: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        down()
    }
    fn reset(&self, _: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        down()
    }
}

#[test]
fn store_errors_are_counted_whether_failing_open_or_closed() {
    let seen = recorded(|| async {
        for (policy, expected) in [
            (OnStoreError::FailOpen, StatusCode::OK),
            (
                OnStoreError::FailClosed {
                    retry_after: std::time::Duration::from_secs(1),
                },
                StatusCode::SERVICE_UNAVAILABLE,
            ),
        ] {
            let app = Router::new().route("/", get(|| async { "hello" })).layer(
                QuotaPolicy::builder(account())
                    .store(Broken)
                    .on_store_error(policy)
                    .build()
                    .layer(Quota::daily(1).allowance("write")),
            );
            assert_eq!(get_as(&app, "/", Some(SUBJECT), &[]).await, expected);
        }
    });
    assert_eq!(
        seen.counter(
            DECISIONS,
            &[("outcome", "store_error"), ("allowance", "write")]
        ),
        2
    );
    // A store of its own is `other`.
    assert_eq!(seen.observations(CHARGE_DURATION, &[("store", "other")]), 2);
    assert_eq!(
        seen.observations(CHARGE_DURATION, &[("store", "memory")]),
        0
    );
    seen.assert_no_subject_in_labels();
}

/// A store that charges as the memory store does and fails every refund
/// and add: the store is there, but cannot take the changes.
#[derive(Clone, Default)]
struct NoChanges(tower_quota::MemoryStore);

impl Store for NoChanges {
    type ChargeFuture = <tower_quota::MemoryStore as Store>::ChargeFuture;

    fn charge(&self, request: ChargeRequest) -> Self::ChargeFuture {
        self.0.charge(request)
    }
    fn peek(
        &self,
        request: ChargeRequest,
    ) -> impl Future<Output = Result<Vec<Usage>, StoreError>> + Send {
        self.0.peek(request)
    }
    fn refund(
        &self,
        _: Timestamp,
        _: PeriodKey,
        _: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        down()
    }
    fn add(
        &self,
        _: Timestamp,
        _: PeriodKey,
        _: u64,
    ) -> impl Future<Output = Result<Option<u64>, StoreError>> + Send {
        down()
    }
    fn reset(&self, key: PeriodKey) -> impl Future<Output = Result<bool, StoreError>> + Send {
        self.0.reset(key)
    }
}

#[test]
fn refunds_and_adds_the_store_never_applied_are_counted_lost() {
    use tower_quota::metrics::CHANGES_LOST;

    let seen = recorded(|| async {
        let policy = QuotaPolicy::builder(account())
            .store(NoChanges::default())
            .refund_server_errors(true)
            .build();
        let app = Router::new()
            .route("/read", get(|| async { "read" }))
            .route(
                "/fail",
                get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "failed") }),
            )
            .route_layer(
                policy
                    .layer(Quota::daily(100).allowance("read"))
                    .deferred_cost(2, |_| 7),
            );
        assert_eq!(
            get_as(&app, "/read", Some(SUBJECT), &[]).await,
            StatusCode::OK
        );
        assert_eq!(
            get_as(&app, "/fail", Some(SUBJECT), &[]).await,
            StatusCode::INTERNAL_SERVER_ERROR
        );
    });
    // The served request's 5 units beyond the 2 up front; the failed
    // one's 2 up front, to give back.
    assert_eq!(seen.counter(CHANGES_LOST, &[("change", "add")]), 5);
    assert_eq!(seen.counter(CHANGES_LOST, &[("change", "refund")]), 2);
    assert_eq!(seen.counter(ABANDONED_CHARGES_REFUNDED, &[]), 0);
    seen.assert_no_subject_in_labels();
}

#[test]
fn nested_layers_count_once_per_allowance_and_refunds_are_counted() {
    let seen = recorded(|| async {
        let policy = QuotaPolicy::builder(account())
            .refund_server_errors(true)
            .build();
        let app = Router::new()
            .route("/read", get(|| async { "read" }))
            .route(
                "/fail",
                get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "failed") }),
            )
            .merge(
                Router::new()
                    .route("/search", get(|| async { "found" }))
                    .route_layer(policy.layer(Quota::per_minute(1).allowance("search"))),
            )
            // Two quotas of one allowance count once.
            .route_layer(policy.layer(Quota::daily(100).allowance("read")))
            .route_layer(policy.layer(Quota::per_minute(100).allowance("read")));
        assert_eq!(
            get_as(&app, "/read", Some(SUBJECT), &[]).await,
            StatusCode::OK
        );
        assert_eq!(
            get_as(&app, "/search", Some(SUBJECT), &[]).await,
            StatusCode::OK
        );
        assert_eq!(
            get_as(&app, "/search", Some(SUBJECT), &[]).await,
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(
            get_as(&app, "/fail", Some(SUBJECT), &[]).await,
            StatusCode::INTERNAL_SERVER_ERROR
        );
    });
    let count = |outcome, allowance| {
        seen.counter(DECISIONS, &[("outcome", outcome), ("allowance", allowance)])
    };
    // One decision per layer that charges: each counts once per allowance
    // of its own quotas. /read and /fail pass both `read` layers (2
    // decisions each); each /search passes both and the `search` layer (3).
    // The second /search is admitted by both `read` layers and refused by
    // the `search` layer, which gives both `read` charges back.
    assert_eq!(count("admitted", "read"), 2 + 2 + 2 + 2);
    assert_eq!(count("admitted", "search"), 1);
    assert_eq!(count("refused", "search"), 1);
    assert_eq!(count("refused", "read"), 0);
    // One observation per charge: one per layer a request passed.
    assert_eq!(
        seen.observations(CHARGE_DURATION, &[("store", "memory")]),
        2 + 3 + 3 + 2
    );
    // Given back: the 500's two `read` counters, and the two `read`
    // charges of the refused search.
    assert_eq!(seen.counter(ABANDONED_CHARGES_REFUNDED, &[]), 4);
    seen.assert_no_subject_in_labels();
}

#[test]
fn descriptions_go_to_the_recorder() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        tower_quota::metrics::describe();
        metrics::counter!(DECISIONS).increment(1);
    });
    let described = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .find(|(key, ..)| key.key().name() == DECISIONS)
        .and_then(|(_, unit, description, _)| Some((unit?, description?)));
    let (unit, description) = described.expect("described");
    assert_eq!(unit, metrics::Unit::Count);
    assert!(description.contains("outcome"));
}

#[cfg(feature = "redis")]
#[test]
fn redis_charges_are_timed_and_healed_counters_counted() {
    use std::time::Duration;
    use tower_quota::store::RedisStore;

    let server = redis_server_or_skip!();
    let seen = recorded(|| async {
        let store = RedisStore::new(server.url()).unwrap();
        let app = Router::new().route("/", get(|| async { "hello" })).layer(
            QuotaPolicy::builder(account())
                .store(store)
                .build()
                .layer(Quota::rolling(10, Duration::from_secs(3_600))),
        );
        assert_eq!(get_as(&app, "/", Some(SUBJECT), &[]).await, StatusCode::OK);
        // Someone takes the counter's deadline away; the next charge heals it.
        let keys = server.cli(&["KEYS", "*"]);
        let key = keys.lines().next().expect("the counter's key");
        assert_eq!(server.cli(&["PERSIST", key]), "1");
        assert_eq!(get_as(&app, "/", Some(SUBJECT), &[]).await, StatusCode::OK);
        assert_ne!(server.cli(&["PTTL", key]), "-1");
    });
    assert_eq!(seen.counter(COUNTERS_HEALED, &[]), 1);
    assert_eq!(seen.observations(CHARGE_DURATION, &[("store", "redis")]), 2);
    assert_eq!(
        seen.counter(
            DECISIONS,
            &[("outcome", "admitted"), ("allowance", "default")]
        ),
        2
    );
    seen.assert_no_subject_in_labels();
}

#[test]
fn a_shadow_quota_over_its_limit_is_counted_as_shadow_refused() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let app = axum::Router::new()
                .route("/", axum::routing::get(|| async { "hi" }))
                .route_layer(tower_quota::QuotaLayer::new(
                    tower_quota::Quota::daily(1).shadow(),
                    tower_quota::FromHeader::account("x-account-id"),
                ));
            for _ in 0..3 {
                let request = http::Request::get("/")
                    .header("x-account-id", "acme")
                    .body(axum::body::Body::empty())
                    .unwrap();
                let response = tower::ServiceExt::oneshot(app.clone(), request)
                    .await
                    .unwrap();
                assert_eq!(response.status(), http::StatusCode::OK);
            }
        });
    });
    let shadow = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| {
            key.key().name() == tower_quota::metrics::DECISIONS
                && key.key().labels().any(|l| l.value() == "shadow_refused")
        })
        .count();
    assert_eq!(shadow, 1, "one series, for the two requests over the limit");
}

/// A request an enforced quota refuses was not let through by a shadow
/// quota beside it: not counted as the shadow quota's refusal.
#[test]
fn a_request_refused_is_no_shadow_refusal() {
    let seen = recorded(|| async {
        let app = Router::new().route("/", get(|| async { "hi" })).layer(
            QuotaLayer::new(Quota::per_minute(2).allowance("read"), account())
                .quota(Quota::per_minute(1).allowance("trial").shadow()),
        );
        for expected in [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
        ] {
            assert_eq!(get_as(&app, "/", Some(SUBJECT), &[]).await, expected);
        }
    });
    let trial = [("outcome", "shadow_refused"), ("allowance", "trial")];
    assert_eq!(
        seen.counter(DECISIONS, &trial),
        1,
        "the second request only"
    );
}

/// A shadow quota refuses nothing: when an enforced quota beside it
/// refuses, only the enforced quota's allowance is counted as refused.
#[test]
fn a_shadow_quota_is_never_counted_as_refused() {
    let seen = recorded(|| async {
        let app = Router::new().route("/", get(|| async { "hi" })).layer(
            QuotaLayer::new(Quota::per_minute(2).allowance("read"), account())
                .quota(Quota::per_minute(100).allowance("trial").shadow()),
        );
        for _ in 0..2 {
            assert_eq!(get_as(&app, "/", Some(SUBJECT), &[]).await, StatusCode::OK);
        }
        for _ in 0..3 {
            assert_eq!(
                get_as(&app, "/", Some(SUBJECT), &[]).await,
                StatusCode::TOO_MANY_REQUESTS
            );
        }
    });
    let count = |outcome, allowance| {
        seen.counter(DECISIONS, &[("outcome", outcome), ("allowance", allowance)])
    };
    assert_eq!(count("refused", "read"), 3);
    assert_eq!(count("refused", "trial"), 0, "the shadow quota had room");
    assert_eq!(count("admitted", "read"), 2);
    assert_eq!(count("admitted", "trial"), 2);
    assert_eq!(count("shadow_refused", "trial"), 0);
}

/// A refusal is counted against the quotas without room, not against a
/// quota beside them that had room: an alert on a budget running out
/// fires for that budget alone.
#[test]
fn a_refusal_is_counted_against_the_quotas_without_room() {
    let seen = recorded(|| async {
        let app = Router::new().route("/", get(|| async { "hi" })).layer(
            QuotaLayer::new(Quota::daily(100).allowance("read"), account())
                .quota(Quota::per_minute(1).allowance("burst")),
        );
        assert_eq!(get_as(&app, "/", Some(SUBJECT), &[]).await, StatusCode::OK);
        assert_eq!(
            get_as(&app, "/", Some(SUBJECT), &[]).await,
            StatusCode::TOO_MANY_REQUESTS
        );
    });
    let count = |outcome, allowance| {
        seen.counter(DECISIONS, &[("outcome", outcome), ("allowance", allowance)])
    };
    assert_eq!(count("refused", "burst"), 1);
    assert_eq!(count("refused", "read"), 0, "the day had room");
    assert_eq!(count("admitted", "read"), 1);
    assert_eq!(count("admitted", "burst"), 1);
}

/// A leased store counts the blocks it takes, the charges it answers from
/// them, and the unused units it gives back.
#[test]
fn leases_are_counted() {
    use std::time::Duration;
    use tower_quota::metrics::{LEASE_BLOCKS, LEASE_LOCAL_CHARGES, LEASE_UNITS_RETURNED};
    use tower_quota::store::{ChargeLine, LeasedStore, Lifetime};
    use tower_quota::MemoryStore;

    let mut held = 0;
    let seen = recorded(|| async {
        tokio::time::pause();
        let leased = LeasedStore::new(MemoryStore::new());
        let mut now: Timestamp = "2026-12-04T10:00:00Z".parse().unwrap();
        let request = |now: Timestamp| ChargeRequest {
            charged_at: None,
            now,
            lines: smallvec::smallvec![ChargeLine {
                key: PeriodKey::from_string("quota:{account:x}:default:2026-12-04".into()),
                limit: 1_000_000,
                cost: 1,
                lifetime: Lifetime::Calendar {
                    start: "2026-12-04T00:00:00Z".parse().unwrap(),
                    end: "2026-12-05T00:00:00Z".parse().unwrap(),
                },
                shadow_limit: None,
            }],
        };
        for _ in 0..500 {
            assert!(leased.charge(request(now)).await.unwrap().admitted);
            tokio::time::advance(Duration::from_millis(1)).await;
            now += jiff::SignedDuration::from_millis(1);
        }
        held = leased.held();
        assert_eq!(leased.shutdown().await, held);
    });
    assert!(held > 0);
    let blocks = seen.counter(LEASE_BLOCKS, &[]);
    let local = seen.counter(LEASE_LOCAL_CHARGES, &[]);
    assert!(blocks > 0);
    assert!(local > 400, "{local} of 500 answered from blocks");
    // Every other charge went to the store (at most one block each).
    assert!(local + blocks <= 500);
    assert_eq!(seen.counter(LEASE_UNITS_RETURNED, &[]), held);
}

/// Two shadow quotas of one allowance, both over their limits, are one
/// `shadow_refused` decision for that allowance: each allowance counts
/// once per decision however many of its quotas applied (as `admitted`,
/// `refused` and a saturated shadow quota's `shadow_refused` do).
#[test]
fn two_shadow_quotas_of_one_allowance_over_their_limits_count_once() {
    let seen = recorded(|| async {
        let app = Router::new().route("/", get(|| async { "hi" })).layer(
            QuotaLayer::new(Quota::per_minute(1).allowance("trial").shadow(), account())
                .quota(Quota::daily(1).allowance("trial").shadow()),
        );
        for _ in 0..2 {
            assert_eq!(get_as(&app, "/", Some(SUBJECT), &[]).await, StatusCode::OK);
        }
    });
    let count = |outcome| seen.counter(DECISIONS, &[("outcome", outcome), ("allowance", "trial")]);
    assert_eq!(count("admitted"), 2, "one per request");
    assert_eq!(
        count("shadow_refused"),
        1,
        "the second request, once for its allowance"
    );
}
