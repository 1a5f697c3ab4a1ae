//! What to answer once the store has: a plain function over the store's
//! answer, so that every outcome can be tested without a runtime.

use bytes::Bytes;
use http::Response;
use jiff::Timestamp;

use crate::config::OnStoreError;
use crate::config::RefusalFn;
use crate::quota::Quota;
use crate::response::{PolicyCache, RateLimitFields, Refusal};
use crate::store::{ChargeOutcome, StoreError, Usage};
use crate::throttle::Throttle;

/// Store failures logged per second at most: during an outage every request
/// fails, and the log should say so, not drown.
const STORE_ERRORS_PER_SECOND: u32 = 5;

static STORE_ERRORS: Throttle = Throttle::new(STORE_ERRORS_PER_SECOND);

/// How a refusal is answered: the policy's hook, if any, and whether the
/// request is a gRPC call.
#[derive(Clone, Copy)]
pub(crate) struct Answer<'a> {
    pub(crate) hook: Option<&'a RefusalFn>,
    pub(crate) grpc: bool,
    /// The subject's hash, for spread resets.
    pub(crate) subject: u64,
}

impl Answer<'_> {
    fn answer(&self, refusal: &Refusal) -> Response<Bytes> {
        match self.hook {
            Some(hook) => hook(refusal),
            None => refusal.standard(),
        }
    }
}

/// What the layer does with a request the store has answered for.
#[derive(Debug)]
pub(crate) enum Decision {
    /// Every quota had room and was charged: call the inner service.
    Admit { usage: Vec<Usage> },
    /// Some quota had no room; nothing was charged. The 429, with its fields.
    Refuse(Response<Bytes>),
    /// The store failed and the policy is to let the request through,
    /// uncharged and without fields.
    PassUncharged,
    /// The store failed and the policy is to refuse: the 503.
    Unavailable(Response<Bytes>),
}

/// Decides on the store's answer to a charge on `quotas` (one line each,
/// costing `cost_of_line`) at `now`.
#[inline]
pub(crate) fn decide(
    quotas: &[Quota],
    cost_of_line: impl Fn(usize) -> u64,
    now: Timestamp,
    on_store_error: OnStoreError,
    cache: &PolicyCache,
    how: Answer<'_>,
    answer: Result<ChargeOutcome, StoreError>,
) -> Decision {
    crate::metrics::decided(quotas, &answer);
    match answer {
        Ok(ChargeOutcome {
            admitted: true,
            usage,
        }) => Decision::Admit { usage },
        Ok(ChargeOutcome {
            admitted: false,
            usage,
        }) => {
            let refusal =
                Refusal::quota_exceeded(quotas, &usage, cost_of_line, now, how.subject, how.grpc);
            let mut response = how.answer(&refusal);
            RateLimitFields::new(quotas, &usage, now, cache, how.subject)
                .append_to(response.headers_mut());
            Decision::Refuse(response)
        }
        Err(error) => match on_store_error {
            OnStoreError::FailOpen => {
                if let Some(suppressed) = STORE_ERRORS.admit() {
                    tracing::warn!(%error, suppressed, "quota store failed; request passes uncharged (fail open)");
                }
                Decision::PassUncharged
            }
            OnStoreError::FailClosed { retry_after } => {
                if let Some(suppressed) = STORE_ERRORS.admit() {
                    tracing::error!(%error, suppressed, "quota store failed; request refused (fail closed)");
                }
                let refusal = Refusal::store_unavailable(retry_after, how.grpc);
                Decision::Unavailable(how.answer(&refusal))
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::{StoreErrorKind, Usage};
    use http::header::RETRY_AFTER;
    use http::StatusCode;

    const PLAIN: Answer<'static> = Answer {
        hook: None,
        grpc: false,
        subject: 0,
    };

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn usage(limit: u64, used: u64, resets_at: &str) -> Usage {
        Usage {
            limit,
            used,
            resets_at: at(resets_at),
            first_call: None,
        }
    }

    #[test]
    fn a_refusal_names_the_quota_without_room_and_waits_for_its_reset() {
        let quotas = [Quota::per_minute(10), Quota::daily(100)];
        let now = at("2026-12-02T10:00:30Z");
        let answer = Ok(ChargeOutcome {
            admitted: false,
            usage: vec![
                usage(10, 3, "2026-12-02T10:01:00Z"),
                usage(100, 100, "2026-12-03T00:00:00Z"),
            ],
        });
        let Decision::Refuse(response) = decide(
            &quotas,
            |_| 1,
            now,
            OnStoreError::FailOpen,
            &PolicyCache::default(),
            PLAIN,
            answer,
        ) else {
            panic!("a full quota refuses");
        };
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[RETRY_AFTER], "50370");
        let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
        assert_eq!(
            body["violated-policies"],
            serde_json::json!(["default-day"])
        );
        assert_eq!(
            response.headers()["ratelimit"],
            "\"default-minute\";r=7;t=30, \"default-day\";r=0;t=50370"
        );
    }

    #[test]
    fn a_store_error_follows_the_policy() {
        let error = || Err(StoreError::new(StoreErrorKind::Unavailable, "down"));
        let quotas = [Quota::daily(1)];
        let now = at("2026-12-02T10:00:00Z");
        let cache = PolicyCache::default();
        assert!(matches!(
            decide(
                &quotas,
                |_| 1,
                now,
                OnStoreError::FailOpen,
                &cache,
                PLAIN,
                error()
            ),
            Decision::PassUncharged
        ));
        let closed = OnStoreError::FailClosed {
            retry_after: Duration::from_millis(1_500),
        };
        let Decision::Unavailable(response) =
            decide(&quotas, |_| 1, now, closed, &cache, PLAIN, error())
        else {
            panic!("fail closed answers 503");
        };
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[RETRY_AFTER], "2");
        assert!(!response.headers().contains_key("ratelimit"));
    }

    #[test]
    fn a_plan_limit_is_what_the_policy_field_says() {
        let quotas = [Quota::daily(100).plan("pro", 10_000)];
        let now = at("2026-12-02T10:00:00Z");
        let cache = PolicyCache::default();
        let usage = [usage(10_000, 10_000, "2026-12-03T00:00:00Z")];
        let fields = RateLimitFields::new(&quotas, &usage, now, &cache, 0);
        let mut headers = http::HeaderMap::new();
        fields.append_to(&mut headers);
        assert_eq!(
            headers["ratelimit-policy"],
            "\"default-day\";q=10000;w=86400"
        );
        let usage = [Usage {
            limit: 100,
            ..usage[0]
        }];
        let mut headers = http::HeaderMap::new();
        RateLimitFields::new(&quotas, &usage, now, &cache, 0).append_to(&mut headers);
        assert_eq!(headers["ratelimit-policy"], "\"default-day\";q=100;w=86400");
    }

    #[test]
    fn a_constant_policy_field_is_the_one_computed_per_request() {
        let berlin = jiff::tz::TimeZone::get("Europe/Berlin").unwrap();
        let now = at("2026-03-29T10:00:00Z");
        for quotas in [
            vec![Quota::daily(5), Quota::per_minute(2).allowance("burst")],
            vec![Quota::rolling(5, Duration::from_secs(3_600))],
            vec![Quota::daily(5).in_time_zone(berlin.clone())],
            vec![Quota::monthly(5)],
            vec![Quota::daily(5).plan("pro", 50)],
        ] {
            let usage: Vec<Usage> = quotas
                .iter()
                .map(|q| usage(q.limit(), 1, "2026-03-30T00:00:00Z"))
                .collect();
            let field = |cache: &PolicyCache| {
                let mut headers = http::HeaderMap::new();
                RateLimitFields::new(&quotas, &usage, now, cache, 0).append_to(&mut headers);
                headers["ratelimit-policy"].clone()
            };
            assert_eq!(
                field(&PolicyCache::for_quotas(&quotas)),
                field(&PolicyCache::default()),
                "{quotas:?}"
            );
        }
        // A Berlin day is 23 hours long that Sunday: never a constant.
        let berlin_day = [Quota::daily(5).in_time_zone(berlin)];
        let usage = [usage(5, 1, "2026-03-29T22:00:00Z")];
        let mut headers = http::HeaderMap::new();
        RateLimitFields::new(
            &berlin_day,
            &usage,
            now,
            &PolicyCache::for_quotas(&berlin_day),
            0,
        )
        .append_to(&mut headers);
        assert_eq!(headers["ratelimit-policy"], "\"default-day\";q=5;w=82800");
    }
}
