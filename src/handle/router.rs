//! The support handle over HTTP, for an application to mount behind its own
//! admin authentication.

use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use http::header::CONTENT_TYPE;
use http::{StatusCode, Uri};
use serde_json::json;

use super::{QuotaHandle, StandingError};
use crate::policy::CallerInfo;
use crate::response;
use crate::status::QuotaUsage;
use crate::store::Store;
use crate::subject::{Subject, SubjectKind};

impl<St: Store> QuotaHandle<St> {
    /// The handle as an axum router, to mount behind the application's own
    /// admin authentication (it checks none itself):
    ///
    /// - `GET /quota/{kind}/{id}[?plan=P][&zone=Z]`: every allowance of the subject,
    ///   as `{"subject":{"kind","id"},"allowances":[{"allowance","name",
    ///   "limit","used","remaining","resets_at","anchor","first_call",
    ///   "reset"}]}`, with RFC 3339 instants, `anchor` `calendar` or
    ///   `first-use`, `first_call` `null` unless a first-use period is open,
    ///   and `reset` saying how and when the allowance returns
    ///   ([`QuotaUsage::explain_reset`]: `every day at 00:00 Europe/Berlin;
    ///   next at 2026-12-05T00:00:00+01:00[Europe/Berlin]`).
    /// - `POST /reset/{kind}/{id}/{allowance}[?plan=P]`: gives that
    ///   allowance back (its current counters are deleted); answers the
    ///   subject's standing (on plan `P`'s limits, if given).
    /// - `POST /refund/{kind}/{id}/{allowance}?amount=N[&plan=P]`: gives
    ///   back `N` units of it; answers the subject's standing. A refund
    ///   that fails part-way (the store failing between two quotas of the
    ///   allowance) keeps what it gave back: check the standing before
    ///   sending it again.
    /// - Every route takes `?zone=Z` (an IANA name; a `+` in it, as in
    ///   `Etc/GMT+12`, may be written as is or as `%2B`), the caller's own zone
    ///   for a policy that reads one: the calendar counters of that zone
    ///   are the ones shown, reset or refunded. A policy that reads no
    ///   caller's zone answers it 400: no layer writes such counters. (A
    ///   caller the policy counts in a fixed offset, not an IANA zone, is
    ///   reached through [`QuotaHandle::in_zone`] instead.)
    /// - A call that names no `?plan=` (or no `?zone=`) is answered on the
    ///   plan (in the zone) the policy's
    ///   [`caller_info`](crate::QuotaPolicyBuilder::caller_info) gives for
    ///   the subject, if the policy has one (503 when it fails, 500 when it
    ///   gives a plan the policy refuses or a zone no key can name, nothing
    ///   changed either way); otherwise on the quotas' own limits and in
    ///   their own zones, which are not the counters of a customer counted
    ///   on a plan or in a zone of its own.
    /// - `{id}` names the subject as a request sends it, percent-encoded,
    ///   and reaches the counter the layers charge it to
    ///   ([`QuotaHandle::subject`]): for `ClientIp`, an address or a
    ///   network (`%2F` for its `/`) is grouped as requests are, so
    ///   `2001:db8:1:2::9` is its /64. An id that is not UTF-8 (a header
    ///   may carry any bytes) is reached with its bytes percent-encoded
    ///   (`ac%FFme`), and its answer's `subject` adds `id_encoded`, that
    ///   form, beside an `id` that cannot show it.
    ///
    /// Errors are `application/problem+json`: 400 for a malformed kind, id or
    /// amount (an id the layers would refuse: all whitespace, longer
    /// than the policy's `max_subject_len`, one no request could send, such
    /// as a control character in a header's id or a network wider than
    /// `ClientIp` groups; a kind or allowance that is not UTF-8), and for a
    /// query parameter given twice or one the route does not take (a
    /// misspelt `?Zone=` would otherwise reach the counters of another
    /// zone), 403 for a plan the policy refuses
    /// ([`UnknownPlan::Reject`](crate::UnknownPlan::Reject)), 404 for an
    /// allowance no quota charges, a kind of subject the policy's extractor
    /// never answers ([`SubjectExtractor::kinds`](crate::SubjectExtractor::kinds))
    /// or any other path, 405 for a route called with another method, 503
    /// when the store fails.
    ///
    /// It fits a router of any state (`Router<S>`): nest it before or after
    /// the application's `with_state`.
    ///
    /// Mount it with `Router::nest` under a prefix of its own, as below: its
    /// 404 answers only the paths under that prefix. (`Router::merge` would
    /// make it the application's 404, and panics when the application has
    /// a fallback of its own.) Put the admin authentication on it with
    /// `Router::layer`, which covers its 404 and 405 too, not
    /// `route_layer`.
    ///
    /// ```
    /// use axum::{body::Body, Router};
    /// use http::{Request, StatusCode};
    /// use tower::ServiceExt;
    /// use tower_quota::{FromHeader, QuotaPolicy, Quota};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let policy = QuotaPolicy::builder(FromHeader::account("x-account-id")).build();
    /// let app: Router = Router::new()
    ///     .route("/read", axum::routing::get(|| async { "read" }))
    ///     .route_layer(policy.layer(Quota::daily(100).allowance("read")))
    ///     // Behind the application's own admin authentication in real life.
    ///     .nest("/admin", policy.handle().router());
    ///
    /// let request = Request::get("/admin/quota/account/acme").body(Body::empty()).unwrap();
    /// let response = app.oneshot(request).await.unwrap();
    /// assert_eq!(response.status(), StatusCode::OK);
    /// let body = axum::body::to_bytes(response.into_body(), 1 << 16).await.unwrap();
    /// let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    /// assert_eq!(body["allowances"][0]["name"], "read-day");
    /// assert_eq!(body["allowances"][0]["remaining"], 100);
    /// # }
    /// ```
    pub fn router<S>(&self) -> Router<S>
    where
        S: Clone + Send + Sync + 'static,
    {
        Router::new()
            .route("/quota/{kind}/{id}", get(show::<St>))
            .route("/reset/{kind}/{id}/{allowance}", post(reset::<St>))
            .route("/refund/{kind}/{id}/{allowance}", post(refund::<St>))
            .method_not_allowed_fallback(method_not_allowed)
            .fallback(not_found)
            .with_state(self.clone())
    }
}

async fn show<St: Store>(
    State(handle): State<QuotaHandle<St>>,
    uri: Uri,
    RawQuery(query): RawQuery,
) -> Response {
    let Target { subject, named, .. } = match target(&handle, &uri, query.as_deref(), PLAN_ZONE) {
        Ok(target) => target,
        Err(response) => return response,
    };
    let plan = match planned(&named.handle, query.as_deref()) {
        Ok(plan) => plan,
        Err(response) => return response,
    };
    let (handle, plan) = match caller(named, plan, &subject).await {
        Ok(caller) => caller,
        Err(response) => return response,
    };
    standing(&handle, &subject, plan.as_deref()).await
}

/// What a support path names: its subject, its allowance if the route has
/// one, and the handle to answer with, in the zone `?zone=` names.
struct Target<St> {
    subject: Subject,
    allowance: Option<String>,
    named: Zoned<St>,
}

/// The handle in the zone `?zone=` names, or as it is when it names none.
struct Zoned<St> {
    handle: QuotaHandle<St>,
    named: bool,
}

/// The [`Target`] of `uri` and `query`, or the problem document that says
/// what is wrong with them.
#[allow(clippy::result_large_err)]
fn target<St>(
    handle: &QuotaHandle<St>,
    uri: &Uri,
    query: Option<&str>,
    known: &[&str],
) -> Result<Target<St>, Response> {
    only_known(query, known)?;
    let (kind, id, allowance) = segments(uri)?;
    let subject = subject(handle, &kind, &id)?;
    let named = zoned(handle, query)?;
    Ok(Target {
        subject,
        allowance,
        named,
    })
}

/// The [`Target`] of a route that names an allowance: its subject, the
/// allowance, and the handle.
#[allow(clippy::result_large_err)]
fn allowance_target<St>(
    handle: &QuotaHandle<St>,
    uri: &Uri,
    query: Option<&str>,
    known: &[&str],
) -> Result<(Subject, String, Zoned<St>), Response> {
    let Target {
        subject,
        allowance,
        named,
    } = target(handle, uri, query, known)?;
    let allowance = allowance.ok_or_else(no_route)?;
    Ok((subject, allowance, named))
}

/// The plan `?plan=` names, as the layers read it (see
/// `QuotaHandle::known_plan`); `None` when it names none.
#[allow(clippy::result_large_err)]
fn planned<St>(
    handle: &QuotaHandle<St>,
    query: Option<&str>,
) -> Result<Option<Option<String>>, Response> {
    let Some(plan) = param(query, "plan")? else {
        return Ok(None);
    };
    handle
        .known_plan(Some(plan))
        .map(Some)
        .map_err(IntoResponse::into_response)
}

/// The handle (in the caller's zone) and the plan a call on `subject`
/// answers with: those `?zone=` and `?plan=` name (`zoned`, `plan`),
/// checked already; for one not named, what the policy's
/// [`caller_info`](crate::QuotaPolicyBuilder::caller_info) gives for the
/// subject, if it has one; otherwise the quotas' own zones and limits.
/// Asked last, once nothing else refuses the call, and only for what the
/// call does not name and the policy reads (a zone, a plan).
#[allow(clippy::result_large_err)]
async fn caller<St>(
    zoned: Zoned<St>,
    plan: Option<Option<String>>,
    subject: &Subject,
) -> Result<(QuotaHandle<St>, Option<String>), Response> {
    let Zoned { handle, named } = zoned;
    // Asked for what the call does not name and the policy reads.
    let asks = (!named && handle.reads_caller_zones()) || (plan.is_none() && handle.reads_plans());
    let mut info = if asks {
        match handle.caller_info(subject).await {
            Ok(info) => info,
            Err(StandingError::UnknownCaller) => {
                return Err(problem(
                    StatusCode::NOT_FOUND,
                    "the application knows no such caller; nothing was changed",
                ))
            }
            Err(_) => {
                return Err(retry_soon(problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the caller's plan and zone could not be read; nothing was changed",
                )))
            }
        }
    } else {
        CallerInfo::default()
    };
    // What the call names stands over what the info gives.
    if named {
        info.zone = None;
    }
    if plan.is_some() {
        info.plan = None;
    }
    let caller = handle.with_info(subject, info).map_err(|error| {
        let what = match error {
            StandingError::Plan(_) => "a plan this policy refuses",
            _ => "a zone no key can name (neither of the IANA list nor a fixed offset)",
        };
        problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("the caller info gives {what}; nothing was changed"),
        )
    })?;
    let plan = plan.unwrap_or_else(|| caller.plan.clone());
    Ok((caller, plan))
}

/// The handle in the caller's zone that `?zone=` names (an IANA name), or
/// as it is.
#[allow(clippy::result_large_err)]
fn zoned<St>(handle: &QuotaHandle<St>, query: Option<&str>) -> Result<Zoned<St>, Response> {
    let Some(name) = param(query, "zone")? else {
        return Ok(Zoned {
            handle: handle.clone(),
            named: false,
        });
    };
    if !handle.reads_caller_zones() {
        // Its counters would be ones no layer writes: a reset or refund
        // there would change nothing the caller sees.
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "?zone= names a caller's zone, and this policy counts every caller in its quotas' own zones",
        ));
    }
    // A `+` written as is in a query is a space once decoded, and no zone's
    // name holds a space: `?zone=Etc/GMT+12` names `Etc/GMT+12`.
    let name = name.replace(' ', "+");
    match jiff::tz::TimeZone::get(&name) {
        Ok(zone) if crate::period::is_nameable(&zone) => Ok(Zoned {
            handle: handle.in_zone(zone),
            named: true,
        }),
        _ => Err(problem(
            StatusCode::BAD_REQUEST,
            "?zone= names an IANA time zone, e.g. Europe/Berlin",
        )),
    }
}

/// The handle and plan of a call on `subject`'s `allowance`: the plan it
/// names checked, and the allowance one a quota charges, before the
/// [`caller`] is asked.
#[allow(clippy::result_large_err)]
async fn allowance_caller<St>(
    named: Zoned<St>,
    query: Option<&str>,
    allowance: &str,
    subject: &Subject,
) -> Result<(QuotaHandle<St>, Option<String>), Response> {
    let plan = planned(&named.handle, query)?;
    if !charges(&named.handle, allowance) {
        return Err(unknown_allowance(allowance));
    }
    caller(named, plan, subject).await
}

/// Whether a quota of the handle charges `allowance`.
fn charges<St>(handle: &QuotaHandle<St>, allowance: &str) -> bool {
    handle
        .quotas()
        .iter()
        .any(|q| q.allowance_tag() == allowance)
}

async fn reset<St: Store>(
    State(handle): State<QuotaHandle<St>>,
    uri: Uri,
    RawQuery(query): RawQuery,
) -> Response {
    let (subject, allowance, named) =
        match allowance_target(&handle, &uri, query.as_deref(), PLAN_ZONE) {
            Ok(target) => target,
            Err(response) => return response,
        };
    // Checked before anything is written: a refused plan changes nothing.
    let (handle, plan) = match allowance_caller(named, query.as_deref(), &allowance, &subject).await
    {
        Ok(caller) => caller,
        Err(response) => return response,
    };
    match handle.reset_allowance(&subject, &allowance).await {
        Ok(0) => unknown_allowance(&allowance),
        Ok(_) => {
            tracing::info!(
                subject.kind = %subject.kind(),
                subject.hash = %subject.log_hash(),
                allowance,
                "quota allowance reset by support"
            );
            standing(&handle, &subject, plan.as_deref()).await
        }
        Err(error) => unavailable(&error),
    }
}

async fn refund<St: Store>(
    State(handle): State<QuotaHandle<St>>,
    uri: Uri,
    RawQuery(query): RawQuery,
) -> Response {
    let (subject, allowance, named) =
        match allowance_target(&handle, &uri, query.as_deref(), AMOUNT_PLAN_ZONE) {
            Ok(target) => target,
            Err(response) => return response,
        };
    let amount = match param(query.as_deref(), "amount") {
        Ok(amount) => amount.and_then(|a| a.parse::<u64>().ok()),
        Err(response) => return response,
    };
    let Some(amount) = amount else {
        return problem(StatusCode::BAD_REQUEST, "send ?amount=N, a whole number");
    };
    // Checked before anything is written: a refused plan changes nothing.
    let (handle, plan) = match allowance_caller(named, query.as_deref(), &allowance, &subject).await
    {
        Ok(caller) => caller,
        Err(response) => return response,
    };
    match handle.refund_allowance(&subject, &allowance, amount).await {
        Ok(_) => {
            tracing::info!(
                subject.kind = %subject.kind(),
                subject.hash = %subject.log_hash(),
                allowance,
                amount,
                "quota refunded by support"
            );
            standing(&handle, &subject, plan.as_deref()).await
        }
        Err(error) => unavailable(&error),
    }
}

/// The segments of a support path after its route's name, percent-decoded:
/// the kind, the id, and the allowance if the route has one. The id is
/// bytes, as a header may carry any (an id that is not UTF-8 is reached
/// with its bytes percent-encoded); the kind and the allowance are UTF-8,
/// or the answer is a problem document.
#[allow(clippy::result_large_err)]
fn segments(uri: &Uri) -> Result<(String, Vec<u8>, Option<String>), Response> {
    let mut decoded = uri
        .path()
        .split('/')
        .skip(2)
        .map(|segment| percent_encoding::percent_decode_str(segment).collect::<Vec<u8>>());
    let utf8 = |bytes: Vec<u8>| {
        String::from_utf8(bytes).map_err(|_| {
            problem(
                StatusCode::BAD_REQUEST,
                "the kind and allowance of a support path are percent-encoded UTF-8",
            )
        })
    };
    let kind = utf8(decoded.next().unwrap_or_default())?;
    let id = decoded.next().unwrap_or_default();
    let allowance = decoded.next().map(utf8).transpose()?;
    Ok((kind, id, allowance))
}

/// The subject a support path names, checked as a request's would be.
#[allow(clippy::result_large_err)]
fn subject<St>(handle: &QuotaHandle<St>, kind: &str, id: &[u8]) -> Result<Subject, Response> {
    let valid_kind = !kind.is_empty()
        && kind.len() <= 64
        && kind
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b));
    if !valid_kind {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "a subject kind is 1 to 64 of a-z, 0-9, '-', '_', '.'",
        ));
    }
    let kind = SubjectKind::custom(kind);
    if let Some(kinds) = handle.subject_kinds() {
        if !kinds.contains(&kind) {
            let known: Vec<&str> = kinds.iter().map(SubjectKind::as_str).collect();
            return Err(problem(
                StatusCode::NOT_FOUND,
                &format!(
                    "this policy charges no subject of kind {:?}; it charges: {}",
                    kind.as_str(),
                    known.join(", ")
                ),
            ));
        }
    }
    handle
        .subject(&kind, id)
        .map_err(IntoResponse::into_response)
}

/// What a path segment percent-encodes: all but the unreserved characters.
const PATH_SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// The subject's standing on `plan`'s limits, if it has one.
async fn standing<St: Store>(
    handle: &QuotaHandle<St>,
    subject: &Subject,
    plan: Option<&str>,
) -> Response {
    match handle.usage_on_plan(subject, plan).await {
        Ok(usage) => {
            let mut shown = json!({
                "kind": subject.kind().as_str(),
                "id": String::from_utf8_lossy(subject.id()),
            });
            // An id that is not UTF-8, which `id` cannot show apart from
            // others: its bytes as a support path names them.
            if std::str::from_utf8(subject.id()).is_err() {
                let encoded = percent_encoding::percent_encode(subject.id(), PATH_SEGMENT);
                shown["id_encoded"] = encoded.to_string().into();
            }
            let body = json!({
                "subject": shown,
                "allowances": usage.iter().map(QuotaUsage::to_json).collect::<Vec<_>>(),
            });
            ([(CONTENT_TYPE, "application/json")], body.to_string()).into_response()
        }
        Err(error) => unavailable(&error),
    }
}

/// A path no support route serves: marked, as `unrouted::NotFound`
/// marks its answer, so that a quota layer around the application
/// (`Router::layer`) gives back what it charged.
async fn not_found() -> Response {
    unrouted(no_route())
}

/// `response`, marked as no route's answer: a quota layer wrapping it
/// gives its charge back and sends no fields (see `crate::unrouted`).
fn unrouted(mut response: Response) -> Response {
    response.extensions_mut().insert(crate::unrouted::Unrouted);
    response
}

/// The answer to a path that names no support route.
fn no_route() -> Response {
    problem(
        StatusCode::NOT_FOUND,
        "no support route here: GET /quota/{kind}/{id}, POST /reset/{kind}/{id}/{allowance}, \
         POST /refund/{kind}/{id}/{allowance}?amount=N",
    )
}

/// A route called with another method; axum adds the `Allow` field.
/// Marked as no route's answer, as `not_found`'s.
async fn method_not_allowed() -> Response {
    unrouted(problem(
        StatusCode::METHOD_NOT_ALLOWED,
        "this support route takes another method",
    ))
}

fn unknown_allowance(allowance: &str) -> Response {
    problem(
        StatusCode::NOT_FOUND,
        &format!(
            "no quota charges the allowance {:?}",
            response::echo(allowance)
        ),
    )
}

/// Lets a few errors a second through while the store is down.
static STORE_ERRORS: crate::throttle::Throttle = crate::throttle::Throttle::new(5);

fn unavailable(error: &crate::store::StoreError) -> Response {
    if let Some(suppressed) = STORE_ERRORS.admit() {
        let error = crate::key::scrubbed(&error.to_string());
        tracing::error!(
            error,
            suppressed,
            "quota store failed answering a support request"
        );
    }
    retry_soon(problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "The quota store is unavailable; try again later.",
    ))
}

/// `response` (a 503) with `Retry-After: 1`, as the layers' own 503: a
/// moment, not at once.
fn retry_soon(mut response: Response) -> Response {
    response.headers_mut().insert(
        http::header::RETRY_AFTER,
        http::HeaderValue::from_static("1"),
    );
    response
}

/// The query parameters of `GET /quota` and `POST /reset`.
const PLAN_ZONE: &[&str] = &["plan", "zone"];
/// The query parameters of `POST /refund`.
const AMOUNT_PLAN_ZONE: &[&str] = &["amount", "plan", "zone"];

/// A 400 for a query parameter the route does not read: a misspelt one
/// (`?Zone=`, `?plans=`) would otherwise be answered as if it were absent,
/// and a reset or a refund would change the counters of another zone or
/// plan than support meant.
#[allow(clippy::result_large_err)]
fn only_known(query: Option<&str>, known: &[&str]) -> Result<(), Response> {
    let Some(query) = query else {
        return Ok(());
    };
    let unknown =
        form_urlencoded::parse(query.as_bytes()).find(|(name, _)| !known.contains(&name.as_ref()));
    match unknown {
        None => Ok(()),
        Some((name, _)) => Err(problem(
            StatusCode::BAD_REQUEST,
            &format!(
                "?{}= is no parameter of this route, which takes ?{}=",
                response::echo(&name),
                known.join("=, ?")
            ),
        )),
    }
}

/// The value of `name` in a query string, decoded as forms and
/// `URLSearchParams` encode it (`+` is a space, names and values
/// percent-encoded); a 400 when it is given twice, which of the two a
/// support tool meant being anyone's guess.
#[allow(clippy::result_large_err)]
fn param(query: Option<&str>, name: &str) -> Result<Option<String>, Response> {
    let Some(query) = query else {
        return Ok(None);
    };
    let mut values = form_urlencoded::parse(query.as_bytes()).filter(|(key, _)| key == name);
    let value = values.next().map(|(_, value)| value.into_owned());
    if values.next().is_some() {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            &format!("?{name}= is given more than once"),
        ));
    }
    Ok(value)
}

fn problem(status: StatusCode, detail: &str) -> Response {
    response::problem(status, detail).map(axum::body::Body::from)
}

impl axum::response::IntoResponse for StandingError {
    /// 401 or 400 for the subject and 400 for the zone, as the layers
    /// answer; 403 for the plan; 404 for a caller the application does not
    /// know; 503 with `Retry-After: 1` for the store or the caller info,
    /// whose details go to the logs only.
    fn into_response(self) -> Response {
        match self {
            StandingError::Subject { error, challenge } => {
                response::challenged(error.into_response(), || challenge)
            }
            StandingError::Zone(error) => problem(StatusCode::BAD_REQUEST, error.reason()),
            StandingError::Plan(_) => problem(StatusCode::FORBIDDEN, &self.to_string()),
            StandingError::Store(error) => unavailable(&error),
            StandingError::UnknownCaller => problem(StatusCode::NOT_FOUND, &self.to_string()),
            // Logged where it failed.
            StandingError::CallerInfo(_) => retry_soon(problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "the caller's plan and zone could not be read",
            )),
        }
    }
}

impl axum::response::IntoResponse for crate::subject::SubjectError {
    /// 401 for a missing subject, 400 for a malformed one, 500 when the
    /// server cannot tell (its reason goes to the logs only), as
    /// `application/problem+json`.
    fn into_response(self) -> Response {
        let status = match self {
            crate::subject::SubjectError::Missing => StatusCode::UNAUTHORIZED,
            crate::subject::SubjectError::Malformed(_) => StatusCode::BAD_REQUEST,
            crate::subject::SubjectError::Unavailable(_) => {
                response::unidentifiable(&self, false);
                return problem(StatusCode::INTERNAL_SERVER_ERROR, response::UNIDENTIFIABLE);
            }
        };
        problem(status, &self.to_string())
    }
}
