use std::fmt::{self, Display};
use std::marker::PhantomData;

use http::request::Parts;

use super::{MaybeSubjectId, Subject, SubjectError, SubjectExtractor, SubjectKind};

/// Reads the subject from a typed request extension, as an authentication
/// layer in front of the quota layer inserts it.
///
/// The id is the extension's [`Display`] text. A request without the
/// extension is [`SubjectError::Missing`]. To take the id from a field of the
/// extension instead, see [`FromExtension::map`].
///
/// ```
/// use std::fmt;
/// use http::Request;
/// use tower_quota::{FromExtension, SubjectExtractor};
///
/// #[derive(Clone)]
/// struct UserId(u64);
///
/// impl fmt::Display for UserId {
///     fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
///         self.0.fmt(f)
///     }
/// }
///
/// let mut request = Request::get("/").body(()).unwrap();
/// request.extensions_mut().insert(UserId(42));
/// let (parts, ()) = request.into_parts();
/// let subject = FromExtension::<UserId>::user().extract(&parts).unwrap();
/// assert_eq!(subject.id(), b"42");
/// ```
pub struct FromExtension<T> {
    kind: SubjectKind,
    _extension: PhantomData<fn() -> T>,
}

impl<T> FromExtension<T> {
    /// A subject of `kind` from extension `T`.
    pub fn new(kind: SubjectKind) -> Self {
        Self {
            kind,
            _extension: PhantomData,
        }
    }

    /// An account from extension `T`.
    pub fn account() -> Self {
        Self::new(SubjectKind::ACCOUNT)
    }

    /// A user from extension `T`.
    pub fn user() -> Self {
        Self::new(SubjectKind::USER)
    }

    /// A device from extension `T`.
    pub fn device() -> Self {
        Self::new(SubjectKind::DEVICE)
    }

    /// A subject of `kind` whose id `f` picks out of extension `T`, which
    /// then need not be [`Display`].
    ///
    /// `f` answers an id ([`IntoSubjectId`](super::IntoSubjectId): text,
    /// bytes, an integer), an [`Option`] of one, where `None` (a token
    /// without the claim) is [`SubjectError::Missing`], or a [`Result`] to
    /// call the extension malformed. It answers an owned value: clone the
    /// field. A request without the extension is [`SubjectError::Missing`].
    ///
    /// ```
    /// use http::Request;
    /// use tower_quota::{FromExtension, Subject, SubjectError, SubjectExtractor, SubjectKind};
    ///
    /// // What an authentication layer in front inserts.
    /// #[derive(Clone)]
    /// struct Claims {
    ///     sub: u64,
    ///     org: Option<String>,
    /// }
    ///
    /// let by_org = FromExtension::<Claims>::map(SubjectKind::custom("org"), |c| c.org.clone());
    /// let by_user = FromExtension::<Claims>::user_from(|c| c.sub);
    ///
    /// let request = |claims: Claims| {
    ///     let mut request = Request::get("/").body(()).unwrap();
    ///     request.extensions_mut().insert(claims);
    ///     request.into_parts().0
    /// };
    /// let member = request(Claims { sub: 42, org: Some("acme".into()) });
    /// assert_eq!(by_org.extract(&member).unwrap().id(), b"acme");
    /// assert_eq!(by_user.extract(&member), Ok(Subject::user(42)));
    ///
    /// let loner = request(Claims { sub: 7, org: None });
    /// assert_eq!(by_org.extract(&loner), Err(SubjectError::Missing));
    /// ```
    pub fn map<F, R>(kind: SubjectKind, f: F) -> MapExtension<T, F>
    where
        F: Fn(&T) -> R + Send + Sync + 'static,
        R: MaybeSubjectId,
    {
        MapExtension {
            kind,
            f,
            _extension: PhantomData,
        }
    }

    /// An account whose id `f` picks out of extension `T`. See
    /// [`FromExtension::map`].
    pub fn account_from<F, R>(f: F) -> MapExtension<T, F>
    where
        F: Fn(&T) -> R + Send + Sync + 'static,
        R: MaybeSubjectId,
    {
        Self::map(SubjectKind::ACCOUNT, f)
    }

    /// A user whose id `f` picks out of extension `T`. See
    /// [`FromExtension::map`].
    pub fn user_from<F, R>(f: F) -> MapExtension<T, F>
    where
        F: Fn(&T) -> R + Send + Sync + 'static,
        R: MaybeSubjectId,
    {
        Self::map(SubjectKind::USER, f)
    }

    /// A device whose id `f` picks out of extension `T`. See
    /// [`FromExtension::map`].
    pub fn device_from<F, R>(f: F) -> MapExtension<T, F>
    where
        F: Fn(&T) -> R + Send + Sync + 'static,
        R: MaybeSubjectId,
    {
        Self::map(SubjectKind::DEVICE, f)
    }
}

impl<T> Clone for FromExtension<T> {
    fn clone(&self) -> Self {
        Self::new(self.kind.clone())
    }
}

impl<T> fmt::Debug for FromExtension<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FromExtension")
            .field("kind", &self.kind)
            .field("extension", &std::any::type_name::<T>())
            .finish()
    }
}

impl<T> SubjectExtractor for FromExtension<T>
where
    T: Display + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Result<Subject, SubjectError> {
        let value = parts.extensions.get::<T>().ok_or(SubjectError::Missing)?;
        Ok(Subject::new(self.kind.clone(), value.to_string()))
    }

    fn kinds(&self) -> Option<Vec<SubjectKind>> {
        Some(vec![self.kind.clone()])
    }

    /// The id as is, if it is text: a value's `Display` writes nothing
    /// else, so no request is charged as an id that is not UTF-8.
    fn subject_named(&self, kind: &SubjectKind, id: &[u8]) -> Result<Subject, SubjectError> {
        if std::str::from_utf8(id).is_err() {
            return Err(SubjectError::malformed(
                "no request can send this id: the extension's ids are text (UTF-8)",
            ));
        }
        Ok(Subject::new(kind.clone(), id))
    }
}

/// Reads the subject from a field of a typed request extension. See
/// [`FromExtension::map`].
pub struct MapExtension<T, F> {
    kind: SubjectKind,
    f: F,
    _extension: PhantomData<fn() -> T>,
}

impl<T, F: Clone> Clone for MapExtension<T, F> {
    fn clone(&self) -> Self {
        Self {
            kind: self.kind.clone(),
            f: self.f.clone(),
            _extension: PhantomData,
        }
    }
}

impl<T, F> fmt::Debug for MapExtension<T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MapExtension")
            .field("kind", &self.kind)
            .field("extension", &std::any::type_name::<T>())
            .finish_non_exhaustive()
    }
}

impl<T, F, R> SubjectExtractor for MapExtension<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> R + Send + Sync + 'static,
    R: MaybeSubjectId,
{
    fn extract(&self, parts: &Parts) -> Result<Subject, SubjectError> {
        let value = parts.extensions.get::<T>().ok_or(SubjectError::Missing)?;
        let id = (self.f)(value).try_into_subject_id()?;
        Ok(Subject::new(self.kind.clone(), id))
    }

    fn kinds(&self) -> Option<Vec<SubjectKind>> {
        Some(vec![self.kind.clone()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    /// Support cannot name an id no request is charged as: the text of a
    /// value's `Display` is UTF-8.
    #[test]
    fn an_extensions_ids_are_text() {
        let ex = FromExtension::<String>::account();
        let kind = SubjectKind::ACCOUNT;
        assert_eq!(
            ex.subject_named(&kind, b"acme"),
            Ok(Subject::account("acme"))
        );
        assert!(matches!(
            ex.subject_named(&kind, b"ac\xffme"),
            Err(SubjectError::Malformed(_))
        ));
    }

    #[derive(Clone)]
    struct Claims {
        account: Option<String>,
        user: u32,
        device: &'static str,
    }

    fn parts(claims: Option<Claims>) -> Parts {
        let mut request = Request::get("/").body(()).unwrap();
        if let Some(claims) = claims {
            request.extensions_mut().insert(claims);
        }
        request.into_parts().0
    }

    fn claims(account: Option<&str>) -> Claims {
        Claims {
            account: account.map(str::to_owned),
            user: 9,
            device: "d-1",
        }
    }

    #[test]
    fn display_extension_is_the_id() {
        let mut request = Request::get("/").body(()).unwrap();
        request.extensions_mut().insert(42_u64);
        let parts = request.into_parts().0;
        assert_eq!(
            FromExtension::<u64>::account().extract(&parts),
            Ok(Subject::account("42"))
        );
    }

    #[test]
    fn maps_fields() {
        let with = parts(Some(claims(Some("acme"))));
        let account = FromExtension::<Claims>::account_from(|c| c.account.clone());
        let user = FromExtension::<Claims>::user_from(|c| c.user);
        let device = FromExtension::<Claims>::device_from(|c| c.device);
        assert_eq!(account.extract(&with), Ok(Subject::account("acme")));
        assert_eq!(user.extract(&with), Ok(Subject::user("9")));
        assert_eq!(device.extract(&with), Ok(Subject::device("d-1")));
    }

    #[test]
    fn none_and_no_extension_are_missing() {
        let account = FromExtension::<Claims>::account_from(|c| c.account.clone());
        assert_eq!(
            account.extract(&parts(Some(claims(None)))),
            Err(SubjectError::Missing)
        );
        assert_eq!(account.extract(&parts(None)), Err(SubjectError::Missing));
    }

    #[test]
    fn closure_may_call_it_malformed() {
        let account = FromExtension::<Claims>::map(SubjectKind::ACCOUNT, |c: &Claims| {
            match c.account.as_deref() {
                Some("") => Err(SubjectError::malformed("empty account claim")),
                Some(id) => Ok(id.to_owned()),
                None => Err(SubjectError::Missing),
            }
        });
        assert_eq!(
            account.extract(&parts(Some(claims(Some(""))))),
            Err(SubjectError::malformed("empty account claim"))
        );
        assert_eq!(
            account.extract(&parts(Some(claims(Some("a"))))),
            Ok(Subject::account("a"))
        );
    }

    #[test]
    fn clone_and_debug_need_no_bounds_on_the_extension() {
        struct NotCloneNorDebug;
        let ex = FromExtension::<NotCloneNorDebug>::user_from(|_| 1_u8);
        let copy = ex.clone();
        assert!(format!("{copy:?}").contains("NotCloneNorDebug"));
    }
}
