use std::borrow::Cow;
use std::sync::Arc;

use bytes::Bytes;
use http::HeaderValue;

use super::SubjectError;

/// A value that can be a subject's id: text, bytes, a header value or an
/// integer.
///
/// [`Subject::new`](super::Subject::new), [`Subject::account`](super::Subject::account),
/// [`Subject::user`](super::Subject::user) and [`Subject::device`](super::Subject::device)
/// take any of them. Text and bytes are kept as they are; integers are their
/// decimal text, so `Subject::user(42)` and `Subject::user("42")` are the same
/// subject.
///
/// ```
/// use tower_quota::Subject;
///
/// let name = String::from("acme");
/// assert_eq!(Subject::account(&name).id(), b"acme");
/// assert_eq!(Subject::account(name).id(), b"acme");
/// assert_eq!(Subject::user(42_u64).id(), b"42");
/// assert_eq!(Subject::user(42), Subject::user("42"));
/// assert_eq!(Subject::user(-7_i64).id(), b"-7");
/// assert_eq!(Subject::device(b"x").id(), b"x");
/// assert_eq!(Subject::device(vec![0xff, 0]).id(), b"\xff\0");
/// ```
///
/// Implement it for an id type of your own:
///
/// ```
/// use bytes::Bytes;
/// use tower_quota::{subject::IntoSubjectId, Subject};
///
/// struct AccountId(u32);
///
/// impl IntoSubjectId for AccountId {
///     fn into_subject_id(self) -> Bytes {
///         self.0.into_subject_id()
///     }
/// }
///
/// assert_eq!(Subject::account(AccountId(7)).id(), b"7");
/// ```
pub trait IntoSubjectId {
    /// The id's bytes. A [`Bytes`] is kept as it is, without a copy.
    fn into_subject_id(self) -> Bytes;
}

impl IntoSubjectId for Vec<u8> {
    fn into_subject_id(self) -> Bytes {
        self.into()
    }
}

impl IntoSubjectId for String {
    fn into_subject_id(self) -> Bytes {
        self.into()
    }
}

impl IntoSubjectId for Box<str> {
    fn into_subject_id(self) -> Bytes {
        self.into_string().into()
    }
}

impl IntoSubjectId for Box<[u8]> {
    fn into_subject_id(self) -> Bytes {
        self.into()
    }
}

impl IntoSubjectId for Cow<'_, str> {
    fn into_subject_id(self) -> Bytes {
        self.into_owned().into()
    }
}

impl IntoSubjectId for Cow<'_, [u8]> {
    fn into_subject_id(self) -> Bytes {
        self.into_owned().into()
    }
}

impl<const N: usize> IntoSubjectId for [u8; N] {
    fn into_subject_id(self) -> Bytes {
        Bytes::copy_from_slice(&self)
    }
}

impl IntoSubjectId for Bytes {
    fn into_subject_id(self) -> Bytes {
        self
    }
}

impl IntoSubjectId for HeaderValue {
    fn into_subject_id(self) -> Bytes {
        Bytes::copy_from_slice(self.as_bytes())
    }
}

/// Borrowed ids are copied.
macro_rules! by_copy {
    ($([$($param:tt)*] $ty:ty => |$id:ident| $bytes:expr;)*) => {$(
        impl<$($param)*> IntoSubjectId for $ty {
            fn into_subject_id(self) -> Bytes {
                let $id = self;
                Bytes::copy_from_slice($bytes)
            }
        }
    )*};
}

by_copy! {
    [] &str => |id| id.as_bytes();
    [] &String => |id| id.as_bytes();
    [] Arc<str> => |id| id.as_bytes();
    [] &[u8] => |id| id;
    [const N: usize] &[u8; N] => |id| id.as_slice();
    [] &Vec<u8> => |id| id.as_slice();
    [] Arc<[u8]> => |id| &id[..];
    [] &HeaderValue => |id| id.as_bytes();
}

macro_rules! decimal {
    ($($int:ty)*) => {$(
        impl IntoSubjectId for $int {
            fn into_subject_id(self) -> Bytes {
                Bytes::copy_from_slice(itoa::Buffer::new().format(self).as_bytes())
            }
        }
    )*};
}

decimal!(u8 u16 u32 u64 u128 usize i8 i16 i32 i64 i128 isize);

/// What a closure that picks an id may answer: an id, an [`Option`] of one
/// (`None` is [`SubjectError::Missing`]), or a [`Result`] with a
/// [`SubjectError`].
///
/// [`FromExtension::map`](super::FromExtension::map) takes such closures.
pub trait MaybeSubjectId {
    /// The id's bytes, or why there is none.
    fn try_into_subject_id(self) -> Result<Bytes, SubjectError>;
}

impl<I: IntoSubjectId> MaybeSubjectId for I {
    fn try_into_subject_id(self) -> Result<Bytes, SubjectError> {
        Ok(self.into_subject_id())
    }
}

impl<I: IntoSubjectId> MaybeSubjectId for Option<I> {
    fn try_into_subject_id(self) -> Result<Bytes, SubjectError> {
        self.map(I::into_subject_id).ok_or(SubjectError::Missing)
    }
}

impl<I: IntoSubjectId> MaybeSubjectId for Result<I, SubjectError> {
    fn try_into_subject_id(self) -> Result<Bytes, SubjectError> {
        self.map(I::into_subject_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(value: impl IntoSubjectId) -> Vec<u8> {
        value.into_subject_id().to_vec()
    }

    #[test]
    fn text_and_bytes_are_kept() {
        let s = String::from("acme");
        assert_eq!(id("acme"), b"acme");
        assert_eq!(id(&s), b"acme");
        assert_eq!(id(s.clone()), b"acme");
        assert_eq!(id(Box::<str>::from("acme")), b"acme");
        assert_eq!(id(Cow::Borrowed("acme")), b"acme");
        assert_eq!(id(Cow::<str>::Owned(s)), b"acme");
        assert_eq!(id(Arc::<str>::from("acme")), b"acme");
        let v = vec![0xff, 0, b'a'];
        assert_eq!(id(&v), b"\xff\0a");
        assert_eq!(id(&v[..]), b"\xff\0a");
        assert_eq!(id(v.clone().into_boxed_slice()), b"\xff\0a");
        assert_eq!(id(Arc::<[u8]>::from(&v[..])), b"\xff\0a");
        assert_eq!(id(Cow::Borrowed(&v[..])), b"\xff\0a");
        assert_eq!(id(Bytes::from(v.clone())), b"\xff\0a");
        assert_eq!(id(v), b"\xff\0a");
        assert_eq!(id(b"xy"), b"xy");
        assert_eq!(id(*b"xy"), b"xy");
        let header = HeaderValue::from_bytes(b"k\xff").unwrap();
        assert_eq!(id(&header), b"k\xff");
        assert_eq!(id(header), b"k\xff");
    }

    #[test]
    fn integers_are_decimal() {
        assert_eq!(id(0_u8), b"0");
        assert_eq!(id(u16::MAX), b"65535");
        assert_eq!(id(42_u32), b"42");
        assert_eq!(id(u64::MAX), b"18446744073709551615");
        assert_eq!(id(u128::MAX), u128::MAX.to_string().as_bytes());
        assert_eq!(id(7_usize), b"7");
        assert_eq!(id(i8::MIN), b"-128");
        assert_eq!(id(-1_i16), b"-1");
        assert_eq!(id(42), b"42");
        assert_eq!(id(i64::MIN), i64::MIN.to_string().as_bytes());
        assert_eq!(id(i128::MIN), i128::MIN.to_string().as_bytes());
        assert_eq!(id(-3_isize), b"-3");
    }

    #[test]
    fn maybe_ids() {
        assert_eq!("a".try_into_subject_id(), Ok(Bytes::from_static(b"a")));
        assert_eq!(
            Some(5_u32).try_into_subject_id(),
            Ok(Bytes::from_static(b"5"))
        );
        assert_eq!(
            None::<String>.try_into_subject_id(),
            Err(SubjectError::Missing)
        );
        let bad: Result<String, _> = Err(SubjectError::malformed("no"));
        assert_eq!(
            bad.try_into_subject_id(),
            Err(SubjectError::malformed("no"))
        );
        let good: Result<&str, SubjectError> = Ok("g");
        assert_eq!(good.try_into_subject_id(), Ok(Bytes::from_static(b"g")));
    }
}
