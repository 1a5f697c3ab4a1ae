//! What clients are told: the IETF `RateLimit-Policy` and `RateLimit` fields,
//! `Retry-After`, and RFC 9457 problem documents.

use std::fmt::Write as _;
use std::sync::RwLock;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use jiff::{RoundMode, Timestamp, TimestampRound, Unit};
use serde_json::{json, Value};

use crate::period::seconds_until;
use crate::quota::Quota;
use crate::store::Usage;

/// `RateLimit-Policy`: each quota's name, limit (`q`) and window in seconds
/// (`w`), as a Structured Field list.
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`: what is left of each quota (`r`) and the seconds until it
/// returns (`t`), as a Structured Field list.
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The problem type of a refused request.
pub const QUOTA_EXCEEDED_TYPE: &str =
    "https://iana.org/assignments/http-problem-types#quota-exceeded";

const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// The pair of fields for one response.
#[derive(Clone, Debug)]
pub(crate) struct RateLimitFields {
    policy: HeaderValue,
    limit: HeaderValue,
}

/// The last `RateLimit-Policy` value a layer sent, with the window lengths
/// and limits it was built for: it changes only when one of them does (a
/// window of another length, a subject on another plan).
#[derive(Default, Debug)]
pub(crate) struct PolicyCache {
    last: RwLock<Option<CachedPolicy>>,
    /// The value, when it can never change: no lock to take.
    constant: Option<HeaderValue>,
}

/// Per quota, the window's length and the limit; and the field built for
/// them.
type CachedPolicy = (Box<[(u64, u64)]>, HeaderValue);

impl PolicyCache {
    /// The cache for `quotas`, with the value built once when every quota's
    /// window and limit are constant.
    pub(crate) fn for_quotas(quotas: &[Quota]) -> Self {
        let windows: Option<Vec<u64>> = quotas.iter().map(Quota::constant_window).collect();
        let constant = windows.map(|windows| {
            let windows = quotas.iter().zip(windows).map(|(q, w)| (w, q.limit()));
            policy_value(quotas, windows)
        });
        Self {
            last: RwLock::default(),
            constant,
        }
    }
}

/// The `RateLimit-Policy` value of `quotas` with these windows and limits.
fn policy_value(quotas: &[Quota], windows: impl Iterator<Item = (u64, u64)>) -> HeaderValue {
    let mut digits = itoa::Buffer::new();
    let mut policy = String::with_capacity(48 * quotas.len());
    for (i, (quota, (window, limit))) in quotas.iter().zip(windows).enumerate() {
        if i > 0 {
            policy.push_str(", ");
        }
        policy.push_str(quota.quoted_name());
        policy.push_str(";q=");
        policy.push_str(digits.format(limit));
        policy.push_str(";w=");
        policy.push_str(digits.format(window));
    }
    HeaderValue::try_from(policy).expect("quota names are printable ASCII")
}

impl RateLimitFields {
    pub(crate) fn new(
        quotas: &[Quota],
        usage: &[Usage],
        now: Timestamp,
        cache: &PolicyCache,
    ) -> Self {
        let windows = || {
            quotas
                .iter()
                .zip(usage)
                .map(move |(q, u)| (q.window_seconds(now, u.first_call), u.limit))
        };
        let policy = match &cache.constant {
            Some(value) => value.clone(),
            None => {
                let cached = {
                    let guard = cache.last.read().unwrap_or_else(|e| e.into_inner());
                    guard
                        .as_ref()
                        .filter(|(ws, _)| ws.iter().copied().eq(windows()))
                        .map(|(_, value)| value.clone())
                };
                cached.unwrap_or_else(|| {
                    let value = policy_value(quotas, windows());
                    *cache.last.write().unwrap_or_else(|e| e.into_inner()) =
                        Some((windows().collect(), value.clone()));
                    value
                })
            }
        };
        let mut digits = itoa::Buffer::new();
        let mut limit = String::with_capacity(40 * quotas.len());
        for (i, (quota, usage)) in quotas.iter().zip(usage).enumerate() {
            if i > 0 {
                limit.push_str(", ");
            }
            limit.push_str(quota.quoted_name());
            limit.push_str(";r=");
            limit.push_str(digits.format(usage.remaining()));
            limit.push_str(";t=");
            limit.push_str(digits.format(seconds_until(now, usage.resets_at)));
        }
        Self {
            policy,
            limit: HeaderValue::try_from(limit).expect("quota names are printable ASCII"),
        }
    }

    /// Appends the fields, so the fields of nested quota layers add up to one
    /// list each.
    pub(crate) fn append_to(self, headers: &mut http::HeaderMap) {
        headers.append(RATELIMIT_POLICY.clone(), self.policy);
        headers.append(RATELIMIT.clone(), self.limit);
    }
}

/// An `application/problem+json` response with the `about:blank` type.
pub fn problem(status: StatusCode, detail: &str) -> Response<Bytes> {
    problem_of_type(
        status,
        "about:blank",
        status.canonical_reason().unwrap_or("Error"),
        detail,
        None,
    )
}

fn problem_of_type(
    status: StatusCode,
    kind: &str,
    title: &str,
    detail: &str,
    members: Option<(&str, Value)>,
) -> Response<Bytes> {
    let mut body = json!({
        "type": kind,
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    if let Some((name, value)) = members {
        body[name] = value;
    }
    let mut response = Response::new(Bytes::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, PROBLEM_JSON);
    response
}

/// The 429 for a refused charge: `cost_of_line` is what the request would
/// have spent on each quota.
pub(crate) fn quota_exceeded(
    quotas: &[Quota],
    usage: &[Usage],
    cost_of_line: impl Fn(usize) -> u64,
    now: Timestamp,
) -> Response<Bytes> {
    let mut violated = Vec::new();
    let mut detail = String::new();
    let mut retry_after = Some(1);
    for (line, (quota, usage)) in quotas.iter().zip(usage).enumerate() {
        let cost = cost_of_line(line);
        if usage.used.saturating_add(cost) <= usage.limit {
            continue;
        }
        violated.push(Value::from(quota.name()));
        if !detail.is_empty() {
            detail.push(' ');
        }
        if cost > usage.limit {
            write!(
                detail,
                "This request costs {cost}, more than quota {:?} allows in a whole period ({}).",
                quota.name(),
                usage.limit
            )
        } else {
            write!(
                detail,
                "Quota {:?} allows {} per {}; {} used, this request costs {}; it resets at {}.",
                quota.name(),
                usage.limit,
                quota.period().name(),
                usage.used,
                cost,
                usage
                    .resets_at
                    .round(
                        TimestampRound::new()
                            .smallest(Unit::Second)
                            .mode(RoundMode::Ceil)
                    )
                    .unwrap_or(usage.resets_at),
            )
        }
        .expect("infallible");
        // A request that costs more than a whole period allows can never be
        // admitted: waiting would not help, so no Retry-After is sent.
        retry_after = if cost > usage.limit {
            None
        } else {
            retry_after.map(|r| r.max(seconds_until(now, usage.resets_at)))
        };
    }
    let mut response = problem_of_type(
        StatusCode::TOO_MANY_REQUESTS,
        QUOTA_EXCEEDED_TYPE,
        "Quota Exceeded",
        &detail,
        Some(("violated-policies", Value::Array(violated))),
    );
    if let Some(seconds) = retry_after {
        response
            .headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}
