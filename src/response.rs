//! What clients are told: the IETF `RateLimit-Policy` and `RateLimit` fields,
//! `Retry-After`, and RFC 9457 problem documents.

use std::fmt::Write as _;
use std::sync::OnceLock;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use jiff::{RoundMode, SignedDuration, Timestamp, TimestampRound, Unit};
use serde_json::{json, Value};

use crate::period::{seconds_until, seconds_until_turn};
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

/// The `RateLimit-Policy` values a layer sent, by the window lengths and
/// limits they were built for: a value changes only with one of them (a
/// window of another length, a subject on another plan), and a layer sees
/// few of those. They are kept in slots filled once each, in turn, and read
/// without a lock: a request on one core writes nothing another reads.
#[derive(Debug)]
pub(crate) struct PolicyCache {
    known: [OnceLock<Box<CachedPolicy>>; MAX_CACHED_POLICIES],
    /// The value, when it can never change.
    constant: Option<HeaderValue>,
}

impl Default for PolicyCache {
    fn default() -> Self {
        Self {
            known: [const { OnceLock::new() }; MAX_CACHED_POLICIES],
            constant: None,
        }
    }
}

/// Per quota, the window's length and the limit; and the field built for
/// them.
type CachedPolicy = (Box<[(u64, u64)]>, HeaderValue);

/// Values a layer keeps at most, for the life of the layer (e.g. 16 plans
/// of a monthly quota, each in months of four lengths); past this, each is
/// built when sent.
const MAX_CACHED_POLICIES: usize = 64;

impl PolicyCache {
    /// The cache for `quotas`, with the value built once when every quota's
    /// window and limit are constant.
    pub(crate) fn for_quotas(quotas: &[Quota]) -> Self {
        let windows: Option<Vec<u64>> = quotas.iter().map(Quota::constant_window).collect();
        let constant = windows.map(|windows| {
            let windows = quotas.iter().zip(windows).map(|(q, w)| (w, q.limit()));
            interned(policy_value(quotas.iter(), windows))
        });
        Self {
            constant,
            ..Self::default()
        }
    }

    /// The value for `quotas` with these windows, from the cache when it
    /// has it.
    fn value<'a>(
        &self,
        quotas: impl Iterator<Item = &'a Quota> + Clone,
        windows: &[(u64, u64)],
    ) -> HeaderValue {
        for slot in &self.known {
            // The first slot that holds these windows, or is empty (then
            // filled with them, unless another request fills it first).
            let (kept, value) = &**slot.get_or_init(|| {
                let value = policy_value(quotas.clone(), windows.iter().copied());
                Box::new((windows.into(), interned(value)))
            });
            if **kept == *windows {
                return value.clone();
            }
        }
        policy_value(quotas, windows.iter().copied())
    }
}

/// `value` with static text, when the process has few such values: a clone
/// for every response then touches no reference count, which the worker
/// threads would otherwise pass between them. Values are kept for the
/// process's lifetime, each text once, up to a bound; beyond it, `value`
/// itself.
fn interned(value: HeaderValue) -> HeaderValue {
    use std::collections::HashSet;
    use std::sync::Mutex;

    /// Distinct texts kept at most; each is one policy's field.
    const MAX: usize = 256;
    static TEXTS: Mutex<Option<HashSet<&'static [u8]>>> = Mutex::new(None);

    let mut texts = TEXTS.lock().unwrap_or_else(|e| e.into_inner());
    let texts = texts.get_or_insert_with(HashSet::new);
    let text = match texts.get(value.as_bytes()) {
        Some(text) => *text,
        None if texts.len() < MAX => {
            let text: &'static [u8] = Box::leak(value.as_bytes().into());
            texts.insert(text);
            text
        }
        None => return value,
    };
    HeaderValue::from_maybe_shared(Bytes::from_static(text)).unwrap_or(value)
}

/// The `RateLimit-Policy` value of `quotas` with these windows and limits.
fn policy_value<'a>(
    quotas: impl Iterator<Item = &'a Quota>,
    windows: impl Iterator<Item = (u64, u64)>,
) -> HeaderValue {
    let mut digits = itoa::Buffer::new();
    let mut policy = String::with_capacity(48);
    for (i, (quota, (window, limit))) in quotas.zip(windows).enumerate() {
        if i > 0 {
            policy.push_str(", ");
        }
        policy.push_str(quota.quoted_name());
        policy.push_str(";q=");
        policy.push_str(digits.format(sf_integer(limit)));
        policy.push_str(";w=");
        policy.push_str(digits.format(sf_integer(window)));
    }
    HeaderValue::try_from(policy).expect("quota names are printable ASCII")
}

impl RateLimitFields {
    /// The fields of `entries` (each quota, and where the subject stands on
    /// it) charged at `now`, told at `told` (the seconds until each reset
    /// are counted from then: a response goes out after its handler ran),
    /// for the subject hashed to `subject` (for spread resets). `cache`
    /// keeps the policy field of one layer's quotas, which must then be the
    /// quotas of `entries`, in their order.
    pub(crate) fn new<'a>(
        entries: impl Iterator<Item = (&'a Quota, Usage)> + Clone,
        now: Timestamp,
        told: Timestamp,
        cache: Option<&PolicyCache>,
        subject: u64,
    ) -> Self {
        Self::build(entries, now, told, cache, subject, None)
    }

    /// The fields of a refusal of a request costing `cost`, as
    /// [`RateLimitFields::new`] makes them, but that each enforced quota
    /// without room for it is told a wait of a second at least, as
    /// `Retry-After` is: a refusal told once that quota's reset has come
    /// (the store answered across it) would otherwise say `t=0`, a reset
    /// already there, beside the request it refused.
    pub(crate) fn refused<'a>(
        entries: impl Iterator<Item = (&'a Quota, Usage)> + Clone,
        now: Timestamp,
        told: Timestamp,
        subject: u64,
        cost: u64,
    ) -> Self {
        Self::build(entries, now, told, None, subject, Some(cost))
    }

    fn build<'a>(
        entries: impl Iterator<Item = (&'a Quota, Usage)> + Clone,
        now: Timestamp,
        told: Timestamp,
        cache: Option<&PolicyCache>,
        subject: u64,
        refused_cost: Option<u64>,
    ) -> Self {
        let quotas = entries.clone().map(|(q, _)| q);
        let windows = || {
            entries
                .clone()
                .map(|(q, u)| (q.window_seconds(now, u.first_call), u.limit))
        };
        let policy = match cache {
            Some(PolicyCache {
                constant: Some(value),
                ..
            }) => value.clone(),
            Some(cache) => {
                let windows: smallvec::SmallVec<[(u64, u64); 4]> = windows().collect();
                cache.value(quotas, &windows)
            }
            None => policy_value(quotas, windows()),
        };
        let mut digits = itoa::Buffer::new();
        let mut limit = crate::text::Text::default();
        for (i, (quota, usage)) in entries.enumerate() {
            if i > 0 {
                limit.push_str(", ");
            }
            limit.push_str(quota.quoted_name());
            limit.push_str(";r=");
            limit.push_str(digits.format(sf_integer(usage.remaining())));
            limit.push_str(";t=");
            let mut wait = seconds_until_turn(told, usage.resets_at, quota.spread_for(subject));
            if refused_cost.is_some_and(|cost| refuses(quota, &usage, cost)) {
                wait = wait.max(1);
            }
            limit.push_str(digits.format(sf_integer(wait)));
        }
        // One allocation, of the value's exact size.
        let limit = HeaderValue::from_maybe_shared(Bytes::copy_from_slice(limit.as_bytes()))
            .expect("quota names are printable ASCII");
        Self { policy, limit }
    }

    /// Puts the fields in front of those already in `headers` (written by
    /// quota layers further in), so the fields of nested layers form one
    /// list each, outer layers first.
    pub(crate) fn prepend_to(self, headers: &mut http::HeaderMap) {
        prepend(headers, &RATELIMIT_POLICY, self.policy);
        prepend(headers, &RATELIMIT, self.limit);
    }
}

/// Whether `quota`, standing at `usage`, refuses a request costing `cost`
/// (a shadow quota never refuses).
fn refuses(quota: &Quota, usage: &Usage, cost: u64) -> bool {
    !quota.is_shadow() && !crate::store::has_room(usage.used, cost, usage.limit)
}

/// The largest Integer a Structured Field carries (15 digits, RFC 9651).
const MAX_SF_INTEGER: u64 = 999_999_999_999_999;

/// `n` as a Structured Field Integer holds it: a larger one (a limit of
/// `u64::MAX` meaning "unlimited") is told as the largest, where its
/// digits would make a strict client drop the whole field.
fn sf_integer(n: u64) -> u64 {
    n.min(MAX_SF_INTEGER)
}

/// Nested layers whose quotas share a name, logged a few times per second
/// at most.
static SAME_NAMES: crate::throttle::Throttle = crate::throttle::Throttle::new(1);

/// The names (quoted, as written) of the members of a `RateLimit` or
/// `RateLimit-Policy` value: each member opens with its name, a String.
fn member_names(value: &[u8]) -> impl Iterator<Item = &[u8]> + Clone {
    let mut at = Some(0);
    std::iter::from_fn(move || {
        let start = at.take()?;
        if value.get(start) != Some(&b'"') {
            return None;
        }
        // The closing quote: the first one not escaped.
        let mut end = start + 1;
        while end < value.len() && value[end] != b'"' {
            end += if value[end] == b'\\' { 2 } else { 1 };
        }
        let name = value.get(start..=end)?;
        // The next member, past this one's parameters.
        at = value[end..]
            .windows(2)
            .position(|w| w == b", ")
            .map(|next| end + next + 2);
        Some(name)
    })
}

/// `value`, then the values `headers` has for `name`, as one list.
fn prepend(headers: &mut http::HeaderMap, name: &HeaderName, value: HeaderValue) {
    match headers.entry(name) {
        http::header::Entry::Vacant(entry) => {
            entry.insert(value);
        }
        http::header::Entry::Occupied(mut entry) => {
            // Layers of different policies nested, with quotas of one name
            // (two `QuotaLayer::daily` are both "default-day"): a client
            // tells policies apart by name only.
            if *name == RATELIMIT_POLICY {
                // Read in place: nested layers pass here on every request.
                let outer = member_names(value.as_bytes());
                let repeated = entry
                    .iter()
                    .flat_map(|inner| member_names(inner.as_bytes()))
                    .find(|inner| outer.clone().any(|name| name == *inner))
                    .map(|name| String::from_utf8_lossy(name).into_owned());
                // Asked only for a line to log: the throttle counts each
                // call it lets not through as a line left out.
                if let Some(repeated) = repeated {
                    if let Some(suppressed) = SAME_NAMES.admit() {
                        tracing::warn!(
                            name = repeated,
                            suppressed,
                            "nested quota layers tell clients two quotas of one name: give them \
                             names of their own (Quota::named), or clients cannot tell them apart"
                        );
                    }
                }
            }
            let mut list = value.as_bytes().to_vec();
            for inner in entry.iter() {
                list.extend_from_slice(b", ");
                list.extend_from_slice(inner.as_bytes());
            }
            let joined = HeaderValue::from_maybe_shared(Bytes::from(list))
                .expect("joined field values are valid");
            // Replaces every value the entry had.
            entry.insert(joined);
        }
    }
}

/// What a client is told when the server cannot tell who it is (its setup
/// is wrong; the reason goes to the logs).
pub(crate) const UNIDENTIFIABLE: &str = "The server cannot tell who this request is from.";

/// Setup mistakes that leave a server unable to tell who requests are
/// from, logged once a second at most.
static UNIDENTIFIABLE_LOGGED: crate::throttle::Throttle = crate::throttle::Throttle::new(1);

/// Logs `error`: the server cannot tell who a request is from. `passes`:
/// the request passes all the same (a layer of shadow quotas), uncounted,
/// not answered 500.
pub(crate) fn unidentifiable(error: &crate::subject::SubjectError, passes: bool) {
    if let Some(suppressed) = UNIDENTIFIABLE_LOGGED.admit() {
        if passes {
            tracing::error!(
                %error,
                suppressed,
                "quota layer cannot tell who requests are from: a layer of shadow quotas lets \
                 them through uncounted"
            );
        } else {
            tracing::error!(
                %error,
                suppressed,
                "quota layer cannot tell who requests are from: they are answered 500"
            );
        }
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

/// A refused request, and everything the layer knows about why: what a
/// refusal hook ([`QuotaPolicyBuilder::refusal`](crate::QuotaPolicyBuilder::refusal))
/// builds the response from. The `RateLimit` fields are added to whatever
/// the hook answers, for a quota without room; `Retry-After` is the hook's
/// to send ([`Refusal::retry_after`]).
///
/// ```
/// use bytes::Bytes;
/// use http::{header::RETRY_AFTER, Response, StatusCode};
/// use tower_quota::{response::Refusal, FromHeader, QuotaPolicy};
///
/// // A plain-text 429; the standard answers for the rest.
/// let policy = QuotaPolicy::builder(FromHeader::account("x-account-id"))
///     .refusal(|refusal: &Refusal| {
///         if refusal.status == StatusCode::TOO_MANY_REQUESTS && !refusal.grpc {
///             let mut response = Response::new(Bytes::from(format!("slow down: {}", refusal.detail)));
///             *response.status_mut() = refusal.status;
///             if let Some(seconds) = refusal.retry_after {
///                 response.headers_mut().insert(RETRY_AFTER, seconds.into());
///             }
///             response
///         } else {
///             refusal.standard()
///         }
///     })
///     .build();
/// # let _ = policy;
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Refusal {
    /// `429 Too Many Requests` for a quota without room, `503 Service
    /// Unavailable` when the store failed (under fail-closed).
    pub status: StatusCode,
    /// The quotas without room, where the subject stands on each, and what
    /// the request would have cost on it. Empty for a store failure.
    pub violated: Vec<(Quota, Usage, u64)>,
    /// When the request could succeed: the last reset among the violated
    /// quotas (or, for a quota whose units another instance holds unused
    /// under leased counting, when those come back), `None` when no wait
    /// helps (a request costing more than a whole period allows) or the
    /// store failed.
    pub resets_at: Option<Timestamp>,
    /// Seconds to wait before trying again (`Retry-After`), rounded up;
    /// `None` when no wait helps.
    pub retry_after: Option<u64>,
    /// A sentence for people: which quota, how much, when it resets.
    pub detail: String,
    /// Whether the request is a gRPC call (`content-type: application/grpc`
    /// and its variants).
    pub grpc: bool,
    /// The gRPC call's content type, which the answer to it repeats (a
    /// client checks it before it reads the status).
    grpc_content_type: Option<HeaderValue>,
}

impl Refusal {
    /// The refusal of a charge on `quotas` (one line each, costing
    /// `cost_of_line`) that the store answered with `usage` at `now`.
    pub(crate) fn quota_exceeded(
        quotas: &[Quota],
        usage: &[Usage],
        cost_of_line: impl Fn(usize) -> u64,
        now: Timestamp,
        subject: u64,
        grpc: Option<HeaderValue>,
    ) -> Self {
        let mut violated = Vec::new();
        let mut detail = String::new();
        let mut retry_after = Some(1);
        let mut resets_at: Option<Timestamp> = None;
        for (line, (quota, usage)) in quotas.iter().zip(usage).enumerate() {
            let cost = cost_of_line(line);
            if !refuses(quota, usage, cost) {
                continue;
            }
            violated.push((quota.clone(), *usage, cost));
            if !detail.is_empty() {
                detail.push(' ');
            }
            // A request that costs more than a whole period allows can never
            // be admitted: waiting would not help, so no Retry-After is sent.
            if cost > usage.limit {
                write!(
                    detail,
                    "This request costs {cost}, more than quota {:?} allows in a whole period ({}).",
                    quota.name(),
                    usage.limit
                )
                .expect("infallible");
                retry_after = None;
                continue;
            }
            let whole = |at: Timestamp| {
                let rounded = TimestampRound::new()
                    .smallest(Unit::Second)
                    .mode(RoundMode::Ceil);
                quota
                    .period()
                    .format_instant(at.round(rounded).unwrap_or(at))
            };
            write!(
                detail,
                "Quota {:?} allows {} per {}; {} used, this request costs {}; it resets at {}",
                quota.name(),
                usage.limit,
                quota.period().name(),
                usage.used,
                cost,
                whole(usage.resets_at),
            )
            .expect("infallible");
            // Units another instance holds unused come back soon (leased
            // counting): worth a try then, before the reset. Otherwise the
            // subject's turn after the reset, when resets are spread.
            let (back_at, wait) = match usage.held_elsewhere_until {
                Some(until) if until < usage.resets_at => {
                    write!(
                        detail,
                        ". Other instances hold unused units of it, back within {} s.",
                        seconds_until(now, until)
                    )
                    .expect("infallible");
                    (until, seconds_until(now, until))
                }
                _ => {
                    let spread = quota.spread_for(subject);
                    let turn = i64::try_from(spread)
                        .ok()
                        .and_then(|s| {
                            usage
                                .resets_at
                                .checked_add(SignedDuration::from_secs(s))
                                .ok()
                        })
                        .filter(|_| spread > 0);
                    match turn {
                        Some(turn) => write!(detail, "; retry from {}.", whole(turn)),
                        None => detail.write_str("."),
                    }
                    .expect("infallible");
                    (
                        usage.resets_at,
                        seconds_until_turn(now, usage.resets_at, spread),
                    )
                }
            };
            retry_after = retry_after.map(|r| r.max(wait));
            resets_at = Some(resets_at.map_or(back_at, |r| r.max(back_at)));
        }
        if violated.is_empty() {
            // A store that refused a charge its own answer shows room for
            // (one of the application's own, breaking its contract).
            detail.push_str("The quota store refused this request; try again shortly.");
        }
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            resets_at: retry_after.and(resets_at),
            violated,
            retry_after,
            detail,
            grpc: grpc.is_some(),
            grpc_content_type: grpc,
        }
    }

    /// The refusal of a request whose store failed, under fail-closed.
    pub(crate) fn store_unavailable(
        retry_after: std::time::Duration,
        grpc: Option<HeaderValue>,
    ) -> Self {
        let secs = retry_after
            .as_secs()
            .saturating_add(u64::from(retry_after.subsec_nanos() > 0));
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            violated: Vec::new(),
            resets_at: None,
            retry_after: Some(secs.max(1)),
            detail: "The quota service is unavailable; try again later.".to_owned(),
            grpc: grpc.is_some(),
            grpc_content_type: grpc,
        }
    }

    /// The answer the layer gives by default: [`Refusal::grpc_status`] to a
    /// gRPC call, [`Refusal::problem_json`] otherwise.
    pub fn standard(&self) -> Response<Bytes> {
        if self.grpc {
            self.grpc_status()
        } else {
            self.problem_json()
        }
    }

    /// An RFC 9457 `application/problem+json` answer with `Retry-After`: the
    /// quota-exceeded problem type with `violated-policies` for a 429, an
    /// `about:blank` problem for a 503.
    pub fn problem_json(&self) -> Response<Bytes> {
        let mut response = if self.status == StatusCode::TOO_MANY_REQUESTS {
            let violated = self
                .violated
                .iter()
                .map(|(quota, _, _)| Value::from(quota.name()))
                .collect();
            problem_of_type(
                self.status,
                QUOTA_EXCEEDED_TYPE,
                "Quota Exceeded",
                &self.detail,
                Some(("violated-policies", Value::Array(violated))),
            )
        } else {
            problem(self.status, &self.detail)
        };
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }

    /// A gRPC answer: HTTP 200 with `grpc-status` 8 (`RESOURCE_EXHAUSTED`)
    /// for a quota without room or 14 (`UNAVAILABLE`) for a store failure, a
    /// `grpc-message` naming the quota and its reset, and `retry-after` in
    /// the metadata. gRPC clients read a refused call's status from these
    /// headers (a trailers-only response); the `RateLimit` fields travel as
    /// metadata too.
    pub fn grpc_status(&self) -> Response<Bytes> {
        let code: u16 = if self.status == StatusCode::TOO_MANY_REQUESTS {
            8
        } else {
            14
        };
        grpc_answer(
            code,
            &self.detail,
            self.retry_after,
            self.grpc_content_type.as_ref(),
        )
    }
}

/// The answer to a request refused before any charge (no usable subject,
/// an unknown plan, a cost that cannot be worked out): a problem document
/// with `status`, or for a gRPC call the matching gRPC status
/// (UNAUTHENTICATED for 401, PERMISSION_DENIED for 403, INVALID_ARGUMENT for
/// other 4xx, UNAVAILABLE for 503, INTERNAL for any other 5xx: a server that
/// cannot tell who a call is from fails every call, which a client's retry
/// policy should not take for a passing outage).
pub(crate) fn early(
    status: StatusCode,
    detail: &str,
    parts: &http::request::Parts,
) -> Response<Bytes> {
    if !is_grpc(&parts.headers) {
        return problem(status, detail);
    }
    let code: u16 = match status {
        StatusCode::UNAUTHORIZED => 16,
        StatusCode::FORBIDDEN => 7,
        StatusCode::TOO_MANY_REQUESTS => 8,
        s if s.is_client_error() => 3,
        StatusCode::SERVICE_UNAVAILABLE => 14,
        _ => 13,
    };
    grpc_answer(
        code,
        detail,
        None,
        grpc_content_type(&parts.headers).as_ref(),
    )
}

/// Puts `challenge()` in `response`'s `WWW-Authenticate` when the response
/// is a 401, as HTTP requires of every 401. (A gRPC answer is an HTTP 200:
/// its status says it.)
pub(crate) fn challenged<B>(
    mut response: Response<B>,
    challenge: impl FnOnce() -> Option<HeaderValue>,
) -> Response<B> {
    if response.status() == StatusCode::UNAUTHORIZED {
        if let Some(challenge) = challenge() {
            response
                .headers_mut()
                .insert(http::header::WWW_AUTHENTICATE, challenge);
        }
    }
    response
}

/// Whether a request with these headers is a gRPC call
/// (`content-type: application/grpc` and its variants), answered as one if
/// refused.
pub(crate) fn is_grpc(headers: &http::HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| grpc_variant(v.as_bytes()))
        .is_some()
}

/// What follows `application/grpc` in a gRPC content type (`+proto`,
/// `-web`, `-web-text`, parameters), case aside; `None` for any other
/// media type (`application/grpcx` included).
fn grpc_variant(value: &[u8]) -> Option<&[u8]> {
    const GRPC: &[u8] = b"application/grpc";
    let start = value.get(..GRPC.len())?;
    // A media type is case-insensitive.
    if !start.eq_ignore_ascii_case(GRPC) {
        return None;
    }
    let rest = &value[GRPC.len()..];
    let web = rest.len() >= 4 && rest[..4].eq_ignore_ascii_case(b"-web");
    (rest.is_empty() || rest[0] == b'+' || rest[0] == b';' || web).then_some(rest)
}

/// The longest content type a gRPC answer echoes: a longer one is answered
/// with the plain one of its protocol.
const MAX_ECHOED_CONTENT_TYPE: usize = 64;

/// The content type of the answer to a gRPC call with these headers, if it
/// is one: the call's own, when short.
pub(crate) fn grpc_content_type(headers: &http::HeaderMap) -> Option<HeaderValue> {
    let value = headers.get(CONTENT_TYPE)?;
    let variant = grpc_variant(value.as_bytes())?;
    if value.len() <= MAX_ECHOED_CONTENT_TYPE {
        return Some(value.clone());
    }
    let web = variant.len() >= 4 && variant[..4].eq_ignore_ascii_case(b"-web");
    Some(HeaderValue::from_static(if web {
        "application/grpc-web"
    } else {
        "application/grpc"
    }))
}

/// The `grpc-status` in the head of `response`, if it is a gRPC answer
/// (`content-type: application/grpc*`): a trailers-only answer, the way
/// tonic answers a failed unary call. Only the head is read: a status in
/// trailers, after a streamed body, is not seen.
fn grpc_status(response: &http::response::Parts) -> Option<&[u8]> {
    let status = response.headers.get(&GRPC_STATUS)?;
    is_grpc(&response.headers).then(|| status.as_bytes())
}

/// Whether `response` is a gRPC answer over HTTP 200 whose head carries a
/// `grpc-status` of the server's failure: UNKNOWN, INTERNAL, UNAVAILABLE
/// or DATA_LOSS, the codes that map to a 5xx (UNIMPLEMENTED is no route's
/// answer: see [`is_grpc_unimplemented`]). Not DEADLINE_EXCEEDED: the
/// client sets the deadline, often after the work was done.
pub(crate) fn is_grpc_server_failure(response: &http::response::Parts) -> bool {
    response.status == StatusCode::OK
        && grpc_status(response).is_some_and(|code| matches!(code, b"2" | b"13" | b"14" | b"15"))
}

/// Whether `response` is a gRPC answer over HTTP 200 whose head carries
/// `grpc-status` 12 (`UNIMPLEMENTED`): the server has no such method
/// (tonic's router answers a call to an unknown service or method so),
/// gRPC's 404, which no quota charges. A handler's own `UNIMPLEMENTED`
/// looks the same, and is not charged either (the README says so).
pub(crate) fn is_grpc_unimplemented(response: &http::response::Parts) -> bool {
    response.status == StatusCode::OK && grpc_status(response) == Some(b"12".as_slice())
}

/// Whether `response` is an error: a 4xx or 5xx status, or a gRPC answer
/// whose head carries a `grpc-status` other than OK (a trailers-only
/// refusal).
pub(crate) fn is_error_answer(response: &http::response::Parts) -> bool {
    response.status.is_client_error()
        || response.status.is_server_error()
        || grpc_status(response).is_some_and(|code| code != b"0")
}

/// What a client sent (a plan, an allowance) is echoed in an answer up to
/// this many bytes.
const MAX_ECHO: usize = 64;

/// At most [`MAX_ECHO`] bytes of `text`, cut at a character boundary.
pub(crate) fn echo(text: &str) -> String {
    if text.len() <= MAX_ECHO {
        return text.to_owned();
    }
    let mut end = MAX_ECHO;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// A gRPC trailers-only answer: HTTP 200, `grpc-status`, `grpc-message`,
/// and the call's `content_type` (its variant of `application/grpc`).
fn grpc_answer(
    code: u16,
    detail: &str,
    retry_after: Option<u64>,
    content_type: Option<&HeaderValue>,
) -> Response<Bytes> {
    let mut response = Response::new(Bytes::new());
    let headers = response.headers_mut();
    let content_type = content_type
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("application/grpc"));
    headers.insert(CONTENT_TYPE, content_type);
    headers.insert(GRPC_STATUS.clone(), HeaderValue::from(code));
    let message = percent_encoding::utf8_percent_encode(detail, GRPC_MESSAGE_ESCAPES);
    let message = HeaderValue::try_from(message.to_string())
        .expect("a percent-encoded message is a valid header value");
    headers.insert(GRPC_MESSAGE.clone(), message);
    if let Some(seconds) = retry_after {
        headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

/// `grpc-status`: the call's status code.
static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// `grpc-message`: the status's description, percent-encoded.
static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");

/// What gRPC's `grpc-message` escapes: everything but printable ASCII, and
/// `%` itself.
const GRPC_MESSAGE_ESCAPES: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b'%');

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn member_names_are_read_past_escapes_and_parameters() {
        let names = |value: &str| {
            member_names(value.as_bytes())
                .map(|n| String::from_utf8_lossy(n).into_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            names(r#""default-day";q=10;w=86400, "a \"b\", c";q=1;w=60"#),
            [r#""default-day""#, r#""a \"b\", c""#]
        );
        assert_eq!(names(""), Vec::<String>::new());
        assert_eq!(names(r#""unclosed"#), Vec::<String>::new());
    }

    proptest! {
        /// A spread reset is never told earlier than the real one, nor
        /// later than the spread allows.
        #[test]
        fn a_spread_reset_is_never_earlier(
            subject in any::<u64>(),
            spread in 0u64..=43_200,
            before in 1i64..200_000,
        ) {
            let quota = Quota::daily(1).spread_reset(Duration::from_secs(spread));
            let resets_at: Timestamp = "2026-12-03T00:00:00Z".parse().unwrap();
            let now = resets_at.checked_sub(jiff::SignedDuration::from_millis(before)).unwrap();
            let usage = [Usage { limit: 1, used: 1, resets_at, first_call: None, held_elsewhere_until: None, counted_at: None }];
            let real = seconds_until(now, resets_at);
            let refusal = Refusal::quota_exceeded(std::slice::from_ref(&quota), &usage, |_| 1, now, subject, None);
            let told = refusal.retry_after.unwrap();
            prop_assert!(told >= real && told <= real + spread, "{told} vs {real}+{spread}");
            let mut headers = http::HeaderMap::new();
            RateLimitFields::new([(&quota, usage[0])].into_iter(), now, now, None, subject)
                .prepend_to(&mut headers);
            let field = headers["ratelimit"].to_str().unwrap().to_owned();
            prop_assert!(field.ends_with(&format!(";t={told}")), "{}", field);
        }
    }

    /// A response that goes out after the window it was charged in ended
    /// tells the subject's turn as it still is: what is left of its spread,
    /// not the whole spread from now.
    #[test]
    fn a_response_after_the_reset_tells_what_is_left_of_the_spread() {
        let quota = Quota::daily(1).spread_reset(Duration::from_secs(600));
        let resets_at: Timestamp = "2026-12-03T00:00:00Z".parse().unwrap();
        let charged = resets_at - jiff::SignedDuration::from_millis(500);
        let usage = usage_of(1, 1, "2026-12-03T00:00:00Z");
        let subject = (0..)
            .find(|&s| quota.spread_for(s) > 100)
            .expect("a subject whose turn is past 100 s");
        let turn = quota.spread_for(subject);
        for (after_reset, t) in [(0, turn), (100, turn - 100), (turn + 5, 0)] {
            let told = resets_at + jiff::SignedDuration::from_secs(after_reset as i64);
            let mut headers = http::HeaderMap::new();
            RateLimitFields::new([(&quota, usage)].into_iter(), charged, told, None, subject)
                .prepend_to(&mut headers);
            let field = headers["ratelimit"].to_str().unwrap();
            assert!(
                field.ends_with(&format!(";t={t}")),
                "{after_reset}: {field}"
            );
        }
    }

    #[test]
    #[should_panic(expected = "at most half the period")]
    fn a_huge_spread_is_refused_where_the_quota_is_made() {
        let _ = Quota::daily(1).spread_reset(Duration::from_secs(u64::MAX));
    }

    /// A spread as long as the period would tell a subject refused in one
    /// window to wait past the next, whose allowance it could spend.
    #[test]
    fn a_spread_is_at_most_half_the_period() {
        let _ = Quota::daily(1).spread_reset(Duration::from_secs(43_200));
        let _ = Quota::per_minute(1).spread_reset(Duration::from_secs(30));
        let _ = Quota::monthly(1).spread_reset(Duration::from_secs(15 * 86_400));
        for quota in [
            Quota::daily(1),
            Quota::per_minute(1),
            Quota::fixed_window(1, Duration::from_secs(90)),
        ] {
            let most = quota.period().nominal_seconds() / 2;
            let refused =
                std::panic::catch_unwind(|| quota.spread_reset(Duration::from_secs(most + 1)));
            assert!(refused.is_err(), "a spread of {} s", most + 1);
        }
    }

    /// The longest spread, added to a wait until the end of time, fits.
    #[test]
    fn the_longest_spread_is_told_without_overflow() {
        let period = crate::period::MAX_FIXED_SECONDS;
        let spread = period / 2;
        let quota = Quota::fixed_window(1, Duration::from_secs(period))
            .spread_reset(Duration::from_secs(spread));
        let now: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap();
        let resets_at = Timestamp::MAX;
        let usage = [Usage {
            held_elsewhere_until: None,
            counted_at: None,
            limit: 1,
            used: 1,
            resets_at,
            first_call: None,
        }];
        let real = seconds_until(now, resets_at);
        for subject in 0..64 {
            let refusal = Refusal::quota_exceeded(
                std::slice::from_ref(&quota),
                &usage,
                |_| 1,
                now,
                subject,
                None,
            );
            let told = refusal.retry_after.unwrap();
            assert!(
                told >= real && told <= real + spread,
                "{told} vs {real}+{spread}"
            );
            let mut headers = http::HeaderMap::new();
            RateLimitFields::new([(&quota, usage[0])].into_iter(), now, now, None, subject)
                .prepend_to(&mut headers);
            assert!(headers["ratelimit"]
                .to_str()
                .unwrap()
                .ends_with(&format!(";t={told}")));
        }
    }

    /// The detail tells the reset in the quota's own zone, and, with resets
    /// spread, the subject's own turn, which `Retry-After` tells too.
    #[test]
    fn the_detail_tells_the_reset_in_the_quotas_zone_and_the_subjects_turn() {
        let berlin = jiff::tz::TimeZone::get("Europe/Berlin").unwrap();
        let now: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap();
        let usage = [usage_of(1, 1, "2026-12-02T23:00:00Z")];
        let quota = Quota::daily(1).in_time_zone(berlin);
        let refusal =
            Refusal::quota_exceeded(std::slice::from_ref(&quota), &usage, |_| 1, now, 0, None);
        assert!(
            refusal
                .detail
                .ends_with("it resets at 2026-12-03T00:00:00+01:00[Europe/Berlin]."),
            "{}",
            refusal.detail
        );
        let spread = Quota::daily(1).spread_reset(std::time::Duration::from_secs(3_600));
        let usage = [usage_of(1, 1, "2026-12-03T00:00:00Z")];
        let subject = 7;
        let turn = spread.spread_for(subject);
        assert!(turn > 0);
        let refusal = Refusal::quota_exceeded(
            std::slice::from_ref(&spread),
            &usage,
            |_| 1,
            now,
            subject,
            None,
        );
        assert_eq!(refusal.retry_after, Some(50_400 + turn));
        let expected = usage[0].resets_at + jiff::SignedDuration::from_secs(turn as i64);
        assert!(
            refusal.detail.ends_with(&format!(
                "it resets at 2026-12-03T00:00:00Z; retry from {expected}."
            )),
            "{}",
            refusal.detail
        );
    }

    /// A store that refuses while its answer shows room still gets a 429
    /// that says something.
    #[test]
    fn a_refusal_with_room_on_every_quota_has_a_detail() {
        let quota = Quota::daily(10);
        let now: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap();
        let usage = [usage_of(10, 1, "2026-12-03T00:00:00Z")];
        let refusal =
            Refusal::quota_exceeded(std::slice::from_ref(&quota), &usage, |_| 1, now, 0, None);
        assert!(refusal.violated.is_empty());
        assert!(!refusal.detail.is_empty());
        assert_eq!(refusal.retry_after, Some(1));
    }

    #[test]
    fn a_grpc_answer_repeats_the_calls_content_type_and_maps_the_status() {
        let call = |content_type: &str| {
            http::Request::post("/")
                .header(CONTENT_TYPE, content_type)
                .body(())
                .unwrap()
                .into_parts()
                .0
        };
        for content_type in [
            "application/grpc",
            "application/grpc+json",
            "application/grpc-web+proto",
            "Application/gRPC",
        ] {
            let parts = call(content_type);
            let answer = early(StatusCode::TOO_MANY_REQUESTS, "slow down", &parts);
            assert_eq!(answer.status(), StatusCode::OK, "{content_type}");
            assert_eq!(answer.headers()[CONTENT_TYPE], content_type);
            assert_eq!(answer.headers()[&GRPC_STATUS], "8", "RESOURCE_EXHAUSTED");
            let refusal = Refusal::store_unavailable(
                Duration::from_secs(1),
                grpc_content_type(&parts.headers),
            );
            assert!(refusal.grpc);
            assert_eq!(refusal.standard().headers()[CONTENT_TYPE], content_type);
        }
        let answer = early(StatusCode::UNAUTHORIZED, "who?", &call("application/grpc"));
        assert_eq!(answer.headers()[&GRPC_STATUS], "16", "UNAUTHENTICATED");
        // A server that cannot tell who calls fails every call: no passing
        // outage, which a client would retry.
        let answer = early(
            StatusCode::INTERNAL_SERVER_ERROR,
            UNIDENTIFIABLE,
            &call("application/grpc"),
        );
        assert_eq!(answer.headers()[&GRPC_STATUS], "13", "INTERNAL");
        let answer = early(
            StatusCode::SERVICE_UNAVAILABLE,
            "later",
            &call("application/grpc"),
        );
        assert_eq!(answer.headers()[&GRPC_STATUS], "14", "UNAVAILABLE");
        // Not gRPC: a problem document.
        let answer = early(
            StatusCode::TOO_MANY_REQUESTS,
            "slow",
            &call("application/json"),
        );
        assert_eq!(answer.status(), StatusCode::TOO_MANY_REQUESTS);
    }

    /// A store failure under fail closed with a wait of no time at all is
    /// still told as a wait of a second: `Retry-After: 0` would send every
    /// client straight back to a store that just failed.
    #[test]
    fn an_unavailable_store_tells_a_wait_of_a_second_at_least() {
        for wait in [Duration::ZERO, Duration::from_millis(1)] {
            let refusal = Refusal::store_unavailable(wait, None);
            assert_eq!(refusal.retry_after, Some(1), "{wait:?}");
        }
    }

    /// A request refused by two quotas without room can succeed once both
    /// have reset: `resets_at` is the later of the resets, whatever the
    /// order of the quotas, as `retry_after` is the longer wait.
    #[test]
    fn a_refusal_by_two_quotas_resets_at_the_later_reset() {
        let now: Timestamp = "2026-12-02T10:30:00Z".parse().unwrap();
        let (day, hour) = ("2026-12-03T00:00:00Z", "2026-12-02T11:00:00Z");
        for (quotas, usage) in [
            (
                [Quota::daily(10), Quota::hourly(5)],
                [usage_of(10, 10, day), usage_of(5, 5, hour)],
            ),
            (
                [Quota::hourly(5), Quota::daily(10)],
                [usage_of(5, 5, hour), usage_of(10, 10, day)],
            ),
        ] {
            let refusal = Refusal::quota_exceeded(&quotas, &usage, |_| 1, now, 0, None);
            assert_eq!(refusal.violated.len(), 2);
            assert_eq!(refusal.resets_at, Some(day.parse().unwrap()));
            assert_eq!(refusal.retry_after, Some(13 * 3600 + 30 * 60));
        }
    }

    /// A request no wait lets through (it costs more than one quota allows
    /// in a whole period) has no instant it could succeed at, even when
    /// another quota it lacks room on resets soon: `resets_at` is `None`,
    /// as `retry_after` is, whatever the order of the quotas.
    #[test]
    fn a_refusal_no_wait_helps_has_no_reset_even_beside_one_that_resets() {
        let now: Timestamp = "2026-12-02T10:30:00Z".parse().unwrap();
        let (day, hour) = ("2026-12-03T00:00:00Z", "2026-12-02T11:00:00Z");
        for (quotas, usage) in [
            (
                [Quota::daily(10), Quota::hourly(50)],
                [usage_of(10, 0, day), usage_of(50, 45, hour)],
            ),
            (
                [Quota::hourly(50), Quota::daily(10)],
                [usage_of(50, 45, hour), usage_of(10, 0, day)],
            ),
        ] {
            let refusal = Refusal::quota_exceeded(&quotas, &usage, |_| 20, now, 0, None);
            assert_eq!(refusal.violated.len(), 2);
            assert_eq!(refusal.retry_after, None);
            assert_eq!(refusal.resets_at, None);
            assert!(refusal.problem_json().headers().get(RETRY_AFTER).is_none());
        }
    }

    /// Only a gRPC answer over HTTP 200 is told by its `grpc-status`: an
    /// HTTP error that carries one (a proxy's, a handler's own) is neither
    /// a missing method (never charged) nor a gRPC failure.
    #[test]
    fn a_grpc_status_counts_only_in_an_answer_over_http_200() {
        let answer = |status: StatusCode, code: &'static str| {
            http::Response::builder()
                .status(status)
                .header(CONTENT_TYPE, "application/grpc")
                .header(&GRPC_STATUS, code)
                .body(())
                .unwrap()
                .into_parts()
                .0
        };
        assert!(is_grpc_unimplemented(&answer(StatusCode::OK, "12")));
        assert!(is_grpc_server_failure(&answer(StatusCode::OK, "13")));
        for status in [StatusCode::NOT_FOUND, StatusCode::BAD_GATEWAY] {
            assert!(!is_grpc_unimplemented(&answer(status, "12")), "{status}");
            assert!(!is_grpc_server_failure(&answer(status, "13")), "{status}");
        }
    }

    #[test]
    fn the_longest_retry_after_of_an_unavailable_store_saturates() {
        let refusal = Refusal::store_unavailable(Duration::MAX, None);
        assert_eq!(refusal.retry_after, Some(u64::MAX));
    }

    fn usage_of(limit: u64, used: u64, resets_at: &str) -> Usage {
        Usage {
            held_elsewhere_until: None,
            counted_at: None,
            limit,
            used,
            resets_at: resets_at.parse().unwrap(),
            first_call: None,
        }
    }

    fn policy_field(
        quotas: &[Quota],
        usage: &[Usage],
        now: Timestamp,
        cache: Option<&PolicyCache>,
    ) -> HeaderValue {
        let mut headers = http::HeaderMap::new();
        RateLimitFields::new(quotas.iter().zip(usage.iter().copied()), now, now, cache, 0)
            .prepend_to(&mut headers);
        headers[&RATELIMIT_POLICY].clone()
    }

    #[test]
    fn each_plans_limit_is_what_the_policy_field_says_from_one_cache() {
        let quotas = [Quota::daily(100).plan("pro", 10_000)];
        let now: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap();
        let cache = PolicyCache::for_quotas(&quotas);
        let pro = [usage_of(10_000, 10_000, "2026-12-03T00:00:00Z")];
        let free = [usage_of(100, 1, "2026-12-03T00:00:00Z")];
        // Mixed-plan traffic: each value comes back from the cache right.
        for _ in 0..3 {
            assert_eq!(
                policy_field(&quotas, &pro, now, Some(&cache)),
                "\"default-day\";q=10000;w=86400"
            );
            assert_eq!(
                policy_field(&quotas, &free, now, Some(&cache)),
                "\"default-day\";q=100;w=86400"
            );
        }
    }

    #[test]
    fn past_the_values_a_cache_keeps_each_is_built_when_sent() {
        // More plans than the cache has slots, each with a limit of its
        // own: every value is right, kept or not, however often it comes.
        let mut quota = Quota::daily(1);
        for plan in 0..MAX_CACHED_POLICIES as u64 * 2 {
            quota = quota.plan(format!("p{plan}"), 1_000 + plan);
        }
        let quotas = [quota];
        let now: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap();
        let cache = PolicyCache::for_quotas(&quotas);
        for _ in 0..2 {
            for plan in 0..MAX_CACHED_POLICIES as u64 * 2 {
                let limit = 1_000 + plan;
                let usage = [usage_of(limit, 1, "2026-12-03T00:00:00Z")];
                assert_eq!(
                    policy_field(&quotas, &usage, now, Some(&cache)),
                    format!("\"default-day\";q={limit};w=86400").as_str()
                );
            }
        }
        assert!(cache.known.iter().all(|slot| slot.get().is_some()));
    }

    #[test]
    fn a_constant_policy_field_is_the_one_computed_per_request() {
        let berlin = jiff::tz::TimeZone::get("Europe/Berlin").unwrap();
        let now: Timestamp = "2026-03-29T10:00:00Z".parse().unwrap();
        for quotas in [
            vec![Quota::daily(5), Quota::per_minute(2).allowance("burst")],
            vec![Quota::rolling(5, Duration::from_secs(3_600))],
            vec![Quota::daily(5).in_time_zone(berlin.clone())],
            vec![Quota::monthly(5)],
            vec![Quota::daily(5).plan("pro", 50)],
        ] {
            let usage: Vec<Usage> = quotas
                .iter()
                .map(|q| usage_of(q.limit(), 1, "2026-03-30T00:00:00Z"))
                .collect();
            assert_eq!(
                policy_field(
                    &quotas,
                    &usage,
                    now,
                    Some(&PolicyCache::for_quotas(&quotas))
                ),
                policy_field(&quotas, &usage, now, None),
                "{quotas:?}"
            );
        }
        // A Berlin day is 23 hours long that Sunday: never a constant.
        let berlin_day = [Quota::daily(5).in_time_zone(berlin)];
        let usage = [usage_of(5, 1, "2026-03-29T22:00:00Z")];
        assert_eq!(
            policy_field(
                &berlin_day,
                &usage,
                now,
                Some(&PolicyCache::for_quotas(&berlin_day))
            ),
            "\"default-day\";q=5;w=82800"
        );
    }

    #[test]
    fn fields_of_layers_further_out_come_first_in_one_list() {
        let now: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap();
        let inner = [Quota::per_minute(2).allowance("burst")];
        let outer = [Quota::daily(100).allowance("read")];
        let mut headers = http::HeaderMap::new();
        RateLimitFields::new(
            inner.iter().zip([usage_of(2, 1, "2026-12-02T10:01:00Z")]),
            now,
            now,
            None,
            0,
        )
        .prepend_to(&mut headers);
        RateLimitFields::new(
            outer.iter().zip([usage_of(100, 2, "2026-12-03T00:00:00Z")]),
            now,
            now,
            None,
            0,
        )
        .prepend_to(&mut headers);
        assert_eq!(headers.get_all(&RATELIMIT).iter().count(), 1);
        assert_eq!(
            headers[&RATELIMIT],
            "\"read-day\";r=98;t=50400, \"burst-minute\";r=1;t=60"
        );
        assert_eq!(
            headers[&RATELIMIT_POLICY],
            "\"read-day\";q=100;w=86400, \"burst-minute\";q=2;w=60"
        );
    }

    /// gRPC's content types are told apart from others that start alike,
    /// and a long one is not echoed back whole.
    #[test]
    fn a_grpc_call_is_known_by_its_content_type_and_answered_briefly() {
        let headers = |value: &str| {
            let mut headers = http::HeaderMap::new();
            headers.insert(CONTENT_TYPE, HeaderValue::try_from(value).unwrap());
            headers
        };
        for grpc in [
            "application/grpc",
            "Application/GRPC+proto",
            "application/grpc;charset=utf-8",
            "application/grpc-web",
            "application/grpc-web-text",
        ] {
            assert!(is_grpc(&headers(grpc)), "{grpc}");
            assert_eq!(grpc_content_type(&headers(grpc)).unwrap(), grpc);
        }
        for other in ["application/grpcx", "application/json", "application/grp"] {
            assert!(!is_grpc(&headers(other)), "{other}");
            assert!(grpc_content_type(&headers(other)).is_none(), "{other}");
        }
        let long = format!("application/grpc+{}", "a".repeat(20_000));
        assert_eq!(
            grpc_content_type(&headers(&long)).unwrap(),
            "application/grpc"
        );
        let long_web = format!("application/grpc-web+{}", "a".repeat(100));
        assert_eq!(
            grpc_content_type(&headers(&long_web)).unwrap(),
            "application/grpc-web"
        );
        let parts = http::Request::get("/")
            .header(CONTENT_TYPE, long.as_str())
            .body(())
            .unwrap()
            .into_parts()
            .0;
        let early = early(StatusCode::UNAUTHORIZED, "no account", &parts);
        assert_eq!(early.headers()[CONTENT_TYPE], "application/grpc");
    }
}
