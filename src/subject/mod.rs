//! Who a request is charged to.
//!
//! A [`SubjectExtractor`] reads the request head (never the body) and names
//! the [`Subject`] whose allowance pays for the request: an account, a user, a
//! device, or a kind of your own. Per-account and per-user quotas are
//! different quotas: the kind is part of every counter key.
//!
//! Built-in extractors:
//! - [`FromHeader`]: the raw value of a header such as `x-account-id`.
//! - [`FromExtension`]: a typed request extension, as an authentication layer
//!   inserts it; [`FromExtension::map`] (or `account_from`, `user_from`,
//!   `device_from`) picks the id out of a field, such as the account of a
//!   `Claims` struct.
//! - [`ClientIp`]: the client's IP address, from the connection or, behind
//!   proxies you trust, from `Forwarded` / `X-Forwarded-For`; IPv6 grouped by
//!   /64.
//! - [`from_fn`]: any closure over [`http::request::Parts`].
//!
//! [`SubjectExtractor::or`] falls back from one to another when the first
//! finds no subject: "the token's account, or else the `x-api-key` header".
//! Ids are anything [`IntoSubjectId`]: text, bytes, header values, integers.
//!
//! # Example
//!
//! ```
//! use axum::{routing::get, Router, body::Body};
//! use http::{request::Parts, Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_quota::{subject, QuotaLayer, Subject, SubjectError};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! // Charge the tenant named in the first path segment: /t/{tenant}/...,
//! // decoded as axum decodes it for the handler: left encoded, each
//! // spelling of one tenant (`acme`, `%61cme`) would be counted apart.
//! let tenant = subject::from_fn(|parts: &Parts| {
//!     let mut segments = parts.uri.path().split('/').skip(1);
//!     match (segments.next(), segments.next()) {
//!         (Some("t"), Some(id)) if !id.is_empty() => {
//!             let id = percent_encoding::percent_decode_str(id)
//!                 .decode_utf8()
//!                 .map_err(|_| SubjectError::malformed("a tenant is UTF-8"))?;
//!             Ok(Subject::account(id.as_ref()))
//!         }
//!         _ => Err(SubjectError::Missing),
//!     }
//! });
//!
//! let app = Router::new()
//!     .route("/t/{tenant}/report", get(|| async { "report" }))
//!     .layer(QuotaLayer::daily(1, tenant));
//!
//! let call = |uri| Request::get(uri).body(Body::empty()).unwrap();
//! let status = |uri| {
//!     let app = app.clone();
//!     async move { app.oneshot(call(uri)).await.unwrap().status() }
//! };
//! assert_eq!(status("/t/acme/report").await, StatusCode::OK);
//! assert_eq!(status("/t/acme/report").await, StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(status("/t/%61cme/report").await, StatusCode::TOO_MANY_REQUESTS);
//! # }
//! ```

mod extension;
mod header;
mod id;
mod ip;
mod or;

use bytes::Bytes;
use http::HeaderValue;
use std::borrow::Cow;
use std::fmt;

use http::request::Parts;

use crate::text::{push_encoded, secret_hash, Text};

pub use self::extension::{FromExtension, MapExtension};
pub use self::header::FromHeader;
pub use self::id::{IntoSubjectId, MaybeSubjectId};
pub use self::ip::{ClientIp, ProxyHeader};
pub use self::or::Or;

/// The granularity an allowance is written in: account, user, device, or a
/// kind of your own.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SubjectKind(Cow<'static, str>);

impl SubjectKind {
    /// A customer account (every user and device of the account shares it).
    pub const ACCOUNT: Self = Self(Cow::Borrowed("account"));
    /// One user.
    pub const USER: Self = Self(Cow::Borrowed("user"));
    /// One device.
    pub const DEVICE: Self = Self(Cow::Borrowed("device"));
    /// A client IP address or IPv6 network, as [`ClientIp`] charges it.
    pub const IP: Self = Self(Cow::Borrowed("ip"));

    /// A kind of your own, e.g. `api-key` or `tenant`. A kind is its name:
    /// `custom("user")` is [`SubjectKind::USER`], `custom("ip")` is
    /// [`SubjectKind::IP`].
    ///
    /// # Panics
    ///
    /// When `name` is empty, longer than 64 bytes, or holds anything but
    /// lowercase ASCII letters, digits, `-`, `_` and `.`.
    pub fn custom(name: impl Into<String>) -> Self {
        let name = name.into();
        assert!(
            !name.is_empty()
                && name.len() <= 64
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b)),
            "a subject kind is 1 to 64 of a-z, 0-9, '-', '_', '.' (got {name:?})"
        );
        match name.as_str() {
            "account" => Self::ACCOUNT,
            "user" => Self::USER,
            "device" => Self::DEVICE,
            "ip" => Self::IP,
            _ => Self(Cow::Owned(name)),
        }
    }

    /// The kind's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SubjectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whose allowance pays for a request: a kind and an id.
///
/// Ids are bytes: header values need not be UTF-8, and every byte is kept
/// (and escaped in keys), so two different ids never share a counter.
///
/// Ids are often credentials (API keys), so a subject's [`Debug`](fmt::Debug)
/// shows its kind and a short hash keyed with a secret drawn when the
/// process starts, never the id: `Subject(account:#1f2e3d4c)`. Within one
/// process one subject always shows the same hash. Read the id with
/// [`Subject::id`] where printing it is safe.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Subject {
    kind: SubjectKind,
    id: Id,
}

/// A subject's id: its own bytes, or those of the header it was read from,
/// shared with the request (a header value's bytes are kept without a
/// copy).
#[derive(Clone)]
enum Id {
    Bytes(Bytes),
    Header(HeaderValue),
}

impl Id {
    fn as_bytes(&self) -> &[u8] {
        match self {
            Id::Bytes(bytes) => bytes,
            Id::Header(value) => value.as_bytes(),
        }
    }
}

impl PartialEq for Id {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for Id {}

impl std::hash::Hash for Id {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl Subject {
    /// A subject of `kind` with this id: text, bytes, a header value or an
    /// integer (its decimal text), see [`IntoSubjectId`].
    ///
    /// ```
    /// use tower_quota::{Subject, SubjectKind};
    ///
    /// let tenant = Subject::new(SubjectKind::custom("tenant"), "t-1");
    /// assert_eq!(tenant.kind().as_str(), "tenant");
    /// assert_eq!(tenant.id(), b"t-1");
    /// ```
    pub fn new(kind: SubjectKind, id: impl IntoSubjectId) -> Self {
        Self {
            kind,
            id: Id::Bytes(id.into_subject_id()),
        }
    }

    /// A subject of `kind` whose id is the bytes of `value`, shared with it.
    pub(crate) fn from_header(kind: SubjectKind, value: &HeaderValue) -> Self {
        Self {
            kind,
            id: Id::Header(value.clone()),
        }
    }

    /// An account.
    ///
    /// ```
    /// use tower_quota::Subject;
    ///
    /// let name = String::from("acme");
    /// assert_eq!(Subject::account(&name).id(), b"acme");
    /// ```
    pub fn account(id: impl IntoSubjectId) -> Self {
        Self::new(SubjectKind::ACCOUNT, id)
    }

    /// A user.
    ///
    /// ```
    /// use tower_quota::Subject;
    ///
    /// assert_eq!(Subject::user(42_u64).id(), b"42");
    /// assert_eq!(Subject::user(42).id(), b"42");
    /// ```
    pub fn user(id: impl IntoSubjectId) -> Self {
        Self::new(SubjectKind::USER, id)
    }

    /// A device.
    ///
    /// ```
    /// use tower_quota::Subject;
    ///
    /// assert_eq!(Subject::device(b"x").id(), b"x");
    /// ```
    pub fn device(id: impl IntoSubjectId) -> Self {
        Self::new(SubjectKind::DEVICE, id)
    }

    /// The kind.
    pub fn kind(&self) -> &SubjectKind {
        &self.kind
    }

    /// The id's bytes.
    pub fn id(&self) -> &[u8] {
        self.id.as_bytes()
    }

    /// What logs name the subject by, with its kind, in place of its id:
    /// ids can be API keys, so this is a hash keyed with a secret drawn when
    /// the process starts, cut to 32 bits (eight hex digits), the one the
    /// subject's keys show in logs. The same subject has the same hash
    /// throughout the process, and only there.
    pub(crate) fn log_hash(&self) -> LogHash {
        let mut tag = Text::default();
        self.push_tag(&mut tag);
        LogHash(secret_hash(tag.as_str()) as u32)
    }

    /// Writes the part of a key that names the subject, `kind:id`, each
    /// percent-encoded: the key's hash tag, and what logs hash. (A kind is
    /// encoded as it is: its bytes are all plain, see
    /// [`SubjectKind::custom`].)
    pub(crate) fn push_tag(&self, out: &mut Text) {
        out.push_ascii(self.kind().as_str().as_bytes());
        out.push_str(":");
        push_encoded(out, self.id());
    }

    /// The subject, if a layer would charge it: an id that is not empty,
    /// not all ASCII whitespace, and at most `max_len` bytes.
    pub(crate) fn checked(self, max_len: usize) -> Result<Self, SubjectError> {
        let id = self.id();
        if id.is_empty() || id.iter().all(u8::is_ascii_whitespace) {
            Err(SubjectError::malformed("the subject id is empty"))
        } else if id.len() > max_len {
            Err(SubjectError::Malformed(
                format!("the subject id is longer than {max_len} bytes").into(),
            ))
        } else {
            Ok(self)
        }
    }
}

impl fmt::Debug for Subject {
    /// The kind and a short keyed hash, never the id.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Subject({}:#{})", self.kind, self.log_hash())
    }
}

/// A subject's keyed hash for logs: see [`Subject::log_hash`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct LogHash(u32);

impl fmt::Display for LogHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:08x}", self.0)
    }
}

/// Why no subject could be read from a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SubjectError {
    /// The request does not say who it is (401 by default).
    Missing,
    /// The request says who it is, but not in a usable way (400 by default):
    /// an empty id, one longer than the layer's bound, a repeated header.
    Malformed(Cow<'static, str>),
    /// The server cannot tell who the request is from: a setup mistake, not
    /// the client's (`ClientIp` where the server hands over no peer
    /// address). Answered with 500 whatever the policy says of missing
    /// subjects, and logged as an error.
    Unavailable(Cow<'static, str>),
}

impl SubjectError {
    /// A malformed subject, with a reason the client may read.
    pub fn malformed(reason: impl Into<Cow<'static, str>>) -> Self {
        Self::Malformed(reason.into())
    }
}

impl fmt::Display for SubjectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing => f.write_str("the request does not identify who it is charged to"),
            Self::Malformed(reason) => write!(f, "the request's subject is malformed: {reason}"),
            Self::Unavailable(reason) => {
                write!(
                    f,
                    "the server cannot tell who the request is from: {reason}"
                )
            }
        }
    }
}

impl std::error::Error for SubjectError {}

/// Reads the subject of a request from its head.
///
/// Implement it for your own type, or wrap a closure with [`from_fn`]. The
/// layer then rejects empty ids and ids longer than its bound
/// ([`QuotaPolicyBuilder::max_subject_len`](crate::QuotaPolicyBuilder::max_subject_len)), so an
/// extractor need not check those.
///
/// ```
/// use http::{request::Parts, Request};
/// use tower_quota::{Subject, SubjectError, SubjectExtractor, SubjectKind};
///
/// /// Charges the API key in `authorization: ApiKey <key>`.
/// struct ApiKey;
///
/// impl SubjectExtractor for ApiKey {
///     fn extract(&self, parts: &Parts) -> Result<Subject, SubjectError> {
///         let value = parts.headers.get(http::header::AUTHORIZATION).ok_or(SubjectError::Missing)?;
///         let key = value
///             .as_bytes()
///             .strip_prefix(b"ApiKey ")
///             .ok_or_else(|| SubjectError::malformed("expected `ApiKey <key>`"))?;
///         Ok(Subject::new(SubjectKind::custom("api-key"), key))
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let (parts, ()) = Request::get("/").header("authorization", "ApiKey k-1").body(()).unwrap().into_parts();
/// assert_eq!(ApiKey.extract(&parts).unwrap().id(), b"k-1");
///
/// // Behind the layer: a missing key is 401, a malformed one 400.
/// use axum::{body::Body, routing::get, Router};
/// use http::StatusCode;
/// use tower::ServiceExt;
/// use tower_quota::QuotaLayer;
///
/// let app = Router::new().route("/", get(|| async { "hi" })).layer(QuotaLayer::daily(10, ApiKey));
/// let send = |auth: Option<&str>| {
///     let mut request = Request::get("/");
///     if let Some(auth) = auth {
///         request = request.header("authorization", auth);
///     }
///     app.clone().oneshot(request.body(Body::empty()).unwrap())
/// };
/// assert_eq!(send(Some("ApiKey k-1")).await.unwrap().status(), StatusCode::OK);
/// assert_eq!(send(None).await.unwrap().status(), StatusCode::UNAUTHORIZED);
/// assert_eq!(send(Some("Basic eA==")).await.unwrap().status(), StatusCode::BAD_REQUEST);
/// # }
/// ```
pub trait SubjectExtractor: Send + Sync + 'static {
    /// The subject charged for the request with this head.
    fn extract(&self, parts: &Parts) -> Result<Subject, SubjectError>;

    /// The kinds of subject this extractor can answer, when it knows them
    /// before any request; `None` (the default) when it does not (a
    /// closure's). The support router answers 404 for a subject of any
    /// other kind: a reset of a kind no layer charges would change nothing.
    fn kinds(&self) -> Option<Vec<SubjectKind>> {
        None
    }

    /// The challenge a client that sent no subject is told how to send one
    /// with: the `WWW-Authenticate` value of the layer's 401 (HTTP requires
    /// one on every 401). `None` (the default) when the extractor cannot
    /// tell (the subject comes from the application's own authentication);
    /// [`QuotaPolicyBuilder::challenge`](crate::QuotaPolicyBuilder::challenge)
    /// sets it for the policy, over the extractor's.
    fn challenge(&self) -> Option<HeaderValue> {
        None
    }

    /// The subject this extractor charges a request that names `id` as its
    /// subject of kind `kind`: the subject a support call naming them
    /// addresses ([`QuotaHandle::subject`](crate::QuotaHandle::subject), the
    /// support router). The default takes the id as it is. An extractor
    /// that rewrites what requests send rewrites `id` the same way
    /// ([`ClientIp`] groups addresses into networks), and one that can tell
    /// refuses an id no request could be charged as
    /// ([`SubjectError::Malformed`]): a reset of it would change nothing.
    fn subject_named(&self, kind: &SubjectKind, id: &[u8]) -> Result<Subject, SubjectError> {
        Ok(Subject::new(kind.clone(), id))
    }

    /// Asks `self`, and `other` when `self` finds no subject
    /// ([`SubjectError::Missing`]): "the token's account, or else the
    /// `x-api-key` header".
    ///
    /// A malformed answer from `self` is the answer: a request that sends a
    /// broken credential is refused (400), never charged to whatever the next
    /// extractor finds. Chains read left to right: `a.or(b).or(c)`.
    ///
    /// The subjects may be of different kinds; each kind has its own
    /// counters, so a client that sends both identities is charged to the
    /// first one only.
    ///
    /// ```
    /// use http::Request;
    /// use tower_quota::{FromExtension, FromHeader, Subject, SubjectError, SubjectExtractor, SubjectKind};
    ///
    /// // What an authentication layer in front inserts.
    /// #[derive(Clone)]
    /// struct Claims {
    ///     account_id: Option<String>,
    /// }
    ///
    /// let subject = FromExtension::<Claims>::account_from(|claims| claims.account_id.clone())
    ///     .or(FromHeader::new(SubjectKind::custom("api-key"), "x-api-key"));
    ///
    /// // A token with an account: the account pays.
    /// let mut request = Request::get("/").header("x-api-key", "k-1").body(()).unwrap();
    /// request.extensions_mut().insert(Claims { account_id: Some("acme".into()) });
    /// assert_eq!(subject.extract(&request.into_parts().0), Ok(Subject::account("acme")));
    ///
    /// // A token without one, or no token: the API key pays.
    /// let mut request = Request::get("/").header("x-api-key", "k-1").body(()).unwrap();
    /// request.extensions_mut().insert(Claims { account_id: None });
    /// let api_key = Subject::new(SubjectKind::custom("api-key"), "k-1");
    /// assert_eq!(subject.extract(&request.into_parts().0), Ok(api_key));
    ///
    /// // Neither: missing (401 behind the layer).
    /// let (parts, ()) = Request::get("/").body(()).unwrap().into_parts();
    /// assert_eq!(subject.extract(&parts), Err(SubjectError::Missing));
    /// ```
    fn or<B>(self, other: B) -> Or<Self, B>
    where
        Self: Sized,
        B: SubjectExtractor,
    {
        Or::new(self, other)
    }
}

impl<E: SubjectExtractor + ?Sized> SubjectExtractor for std::sync::Arc<E> {
    fn extract(&self, parts: &Parts) -> Result<Subject, SubjectError> {
        (**self).extract(parts)
    }

    fn kinds(&self) -> Option<Vec<SubjectKind>> {
        (**self).kinds()
    }

    fn challenge(&self) -> Option<HeaderValue> {
        (**self).challenge()
    }

    fn subject_named(&self, kind: &SubjectKind, id: &[u8]) -> Result<Subject, SubjectError> {
        (**self).subject_named(kind, id)
    }
}

/// A subject extractor from a closure. See [`from_fn`].
#[derive(Clone)]
pub struct FromFn<F> {
    f: F,
}

impl<F> fmt::Debug for FromFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FromFn").finish_non_exhaustive()
    }
}

/// Uses `f` to read the subject from the request head.
pub fn from_fn<F>(f: F) -> FromFn<F>
where
    F: Fn(&Parts) -> Result<Subject, SubjectError> + Send + Sync + 'static,
{
    FromFn { f }
}

impl<F> SubjectExtractor for FromFn<F>
where
    F: Fn(&Parts) -> Result<Subject, SubjectError> + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Result<Subject, SubjectError> {
        (self.f)(parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_hash_is_eight_hex_digits_and_stable_in_the_process() {
        let key = Subject::new(SubjectKind::custom("api-key"), "sk_live_secret");
        let hash = key.log_hash().to_string();
        assert_eq!(hash.len(), 8, "{hash}");
        assert!(hash.bytes().all(|b| b.is_ascii_hexdigit()), "{hash}");
        assert_eq!(key.clone().log_hash().to_string(), hash);
        assert!(
            (0..16).any(|i| Subject::account(i).log_hash() != Subject::account(i + 16).log_hash())
        );
        // The kind is part of what is hashed.
        assert!((0..16).any(|i| Subject::account(i).log_hash() != Subject::user(i).log_hash()));
    }

    /// A decision's span and a warning naming one of the subject's keys
    /// name the subject alike, whatever bytes its id holds.
    #[test]
    fn log_hash_is_the_one_its_keys_show() {
        for subject in [
            Subject::account("acme"),
            Subject::user(&b"sk_live\xff:{x}%"[..]),
            Subject::new(SubjectKind::custom("api-key"), "a b"),
        ] {
            let key = crate::key::Namespace::default().key(&subject, "read", "2026-12-02");
            let shown = format!("{}:#{}", subject.kind(), subject.log_hash());
            assert!(key.logged().contains(&shown), "{} / {shown}", key.logged());
        }
    }

    #[test]
    fn debug_shows_the_kind_and_hash_never_the_id() {
        let key = Subject::new(SubjectKind::custom("api-key"), "sk_live_secret");
        let debug = format!("{key:?}");
        assert_eq!(debug, format!("Subject(api-key:#{})", key.log_hash()));
        assert!(!debug.contains("secret"), "{debug}");
    }

    /// A kind is 1 to 64 of a-z, 0-9, `-`, `_`, `.`: 64 bytes pass, 65
    /// do not, and nothing else (an upper-case letter, a separator of keys)
    /// is a kind.
    #[test]
    fn custom_kinds_are_checked() {
        let longest = "k".repeat(64);
        assert_eq!(SubjectKind::custom(longest.as_str()).as_str(), longest);
        assert_eq!(SubjectKind::custom("a-b_c.9").as_str(), "a-b_c.9");
        for bad in [
            String::new(),
            "k".repeat(65),
            "Org".into(),
            "a:b".into(),
            "{a}".into(),
            "a b".into(),
            "a%b".into(),
        ] {
            let refused = std::panic::catch_unwind(|| SubjectKind::custom(bad.clone()));
            assert!(refused.is_err(), "{bad:?} taken as a kind");
        }
    }

    #[test]
    fn checked_refuses_what_the_layer_refuses() {
        let check = |id: &[u8]| Subject::account(id).checked(8);
        assert_eq!(check(b"acme"), Ok(Subject::account("acme")));
        assert_eq!(check(b" a "), Ok(Subject::account(" a ")));
        assert_eq!(check(b"\xff"), Ok(Subject::account(b"\xff")));
        assert_eq!(check(b"12345678"), Ok(Subject::account("12345678")));
        for bad in [&b""[..], b" ", b"  \t\r\n", b"123456789"] {
            assert!(
                matches!(check(bad), Err(SubjectError::Malformed(_))),
                "{bad:?}"
            );
        }
    }
}
