use std::fmt::{self, Display};
use std::marker::PhantomData;

use http::request::Parts;

use super::{Subject, SubjectError, SubjectExtractor, SubjectKind};

/// Reads the subject from a typed request extension, as an authentication
/// layer in front of the quota layer inserts it.
///
/// The id is the extension's [`Display`] text. A request without the
/// extension is [`SubjectError::Missing`].
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
}
