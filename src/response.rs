//! What clients are told: the IETF `RateLimit-Policy` and `RateLimit` fields,
//! `Retry-After`, and RFC 9457 problem documents.

use std::fmt::Write as _;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use jiff::{RoundMode, Timestamp, TimestampRound, Unit};
use serde_json::{json, Value};

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

/// Whole seconds from `now` until `at`, rounded up: a client that waits this
/// long never comes back before `at`.
pub(crate) fn seconds_until(now: Timestamp, at: Timestamp) -> u64 {
    let nanos = at.as_nanosecond() - now.as_nanosecond();
    if nanos <= 0 {
        0
    } else {
        u64::try_from((nanos + 999_999_999) / 1_000_000_000).unwrap_or(u64::MAX)
    }
}

/// The pair of fields for one response.
#[derive(Clone, Debug)]
pub(crate) struct RateLimitFields {
    policy: HeaderValue,
    limit: HeaderValue,
}

impl RateLimitFields {
    /// `windows[i]` is quota `i`'s window length in seconds.
    pub(crate) fn new(quotas: &[Quota], usage: &[Usage], windows: &[u64], now: Timestamp) -> Self {
        let mut policy = String::with_capacity(48 * quotas.len());
        let mut limit = String::with_capacity(40 * quotas.len());
        for (i, ((quota, usage), window)) in quotas.iter().zip(usage).zip(windows).enumerate() {
            let window = usage
                .first_call
                .map_or(*window, |first| seconds_until(first, usage.resets_at))
                .max(1);
            if i > 0 {
                policy.push_str(", ");
                limit.push_str(", ");
            }
            write_sf_string(&mut policy, quota.name());
            write!(policy, ";q={};w={}", quota.limit(), window).expect("infallible");
            write_sf_string(&mut limit, quota.name());
            write!(
                limit,
                ";r={};t={}",
                usage.remaining(),
                seconds_until(now, usage.resets_at)
            )
            .expect("infallible");
        }
        Self {
            policy: HeaderValue::try_from(policy).expect("quota names are printable ASCII"),
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

fn write_sf_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
}

/// An `application/problem+json` response.
pub(crate) fn problem(status: StatusCode, detail: &str) -> Response<Bytes> {
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

/// The 429 for a refused charge.
pub(crate) fn quota_exceeded(
    quotas: &[Quota],
    usage: &[Usage],
    cost: u64,
    now: Timestamp,
) -> Response<Bytes> {
    let mut violated = Vec::new();
    let mut detail = String::new();
    let mut retry_after = 1;
    for (quota, usage) in quotas.iter().zip(usage) {
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
        retry_after = retry_after.max(seconds_until(now, usage.resets_at));
    }
    let mut response = problem_of_type(
        StatusCode::TOO_MANY_REQUESTS,
        QUOTA_EXCEEDED_TYPE,
        "Quota Exceeded",
        &detail,
        Some(("violated-policies", Value::Array(violated))),
    );
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(retry_after));
    response
}
