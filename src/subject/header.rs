use http::header::{HeaderName, HeaderValue};
use http::request::Parts;

use super::{Subject, SubjectError, SubjectExtractor, SubjectKind};

/// Reads the subject from one header, such as `x-account-id`.
///
/// The header's raw bytes are the id, without spaces or tabs around them
/// (HTTP's field values have none: HTTP/1.1 parsers strip them, and a
/// client sending them over HTTP/2 names the same subject). A missing header is
/// [`SubjectError::Missing`]; the header sent twice is malformed, never
/// resolved by picking one.
///
/// The header is trusted as sent: put this extractor behind a gateway or an
/// authentication layer that sets or checks the header, or a client can spend
/// any other subject's allowance by naming it.
#[derive(Clone, Debug)]
pub struct FromHeader {
    kind: SubjectKind,
    name: HeaderName,
}

impl FromHeader {
    /// A subject of `kind` from header `name` (case-insensitive).
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name.
    pub fn new(kind: SubjectKind, name: &str) -> Self {
        let name = HeaderName::from_bytes(name.as_bytes())
            .unwrap_or_else(|_| panic!("{name:?} is not a valid header name"));
        Self { kind, name }
    }

    /// An account from header `name`.
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name.
    pub fn account(name: &str) -> Self {
        Self::new(SubjectKind::ACCOUNT, name)
    }

    /// A user from header `name`.
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name.
    pub fn user(name: &str) -> Self {
        Self::new(SubjectKind::USER, name)
    }

    /// A device from header `name`.
    ///
    /// # Panics
    ///
    /// When `name` is not a valid header name.
    pub fn device(name: &str) -> Self {
        Self::new(SubjectKind::DEVICE, name)
    }

    /// The header read.
    pub fn header_name(&self) -> &HeaderName {
        &self.name
    }
}

impl SubjectExtractor for FromHeader {
    fn extract(&self, parts: &Parts) -> Result<Subject, SubjectError> {
        let mut values = parts.headers.get_all(&self.name).iter();
        let value = values.next().ok_or(SubjectError::Missing)?;
        if values.next().is_some() {
            return Err(SubjectError::Malformed(
                format!("the {} header is sent more than once", self.name).into(),
            ));
        }
        // A field's value has no whitespace around it (RFC 9110, 5.5):
        // HTTP/1.1 parsers strip it, and an HTTP/2 request that sends some
        // names the same subject. The header value's bytes, shared: no
        // copy, but for such a value.
        // (A header value holds no other whitespace than spaces and tabs.)
        let trimmed = value.as_bytes().trim_ascii();
        if trimmed.len() == value.len() {
            return Ok(Subject::from_header(self.kind.clone(), value));
        }
        Ok(Subject::new(self.kind.clone(), trimmed))
    }

    fn kinds(&self) -> Option<Vec<SubjectKind>> {
        Some(vec![self.kind.clone()])
    }

    /// The id as a request sends it in the header: refused when a header
    /// value cannot carry it (control characters other than tab), or the
    /// layer would never see it (spaces or tabs around it, which it trims).
    fn subject_named(&self, kind: &SubjectKind, id: &[u8]) -> Result<Subject, SubjectError> {
        if id.trim_ascii().len() != id.len() {
            return Err(SubjectError::Malformed(
                format!(
                    "no request can send this id: the spaces or tabs around a {} header's value are not part of it",
                    self.name
                )
                .into(),
            ));
        }
        match HeaderValue::from_bytes(id) {
            Ok(_) => Ok(Subject::new(kind.clone(), id)),
            Err(_) => Err(SubjectError::Malformed(
                format!(
                    "no request can send this id: the {} header cannot carry control characters",
                    self.name
                )
                .into(),
            )),
        }
    }

    /// `ApiKey header="<name>"`: send the header.
    fn challenge(&self) -> Option<HeaderValue> {
        // A header name is lowercase token characters: nothing to escape.
        HeaderValue::try_from(format!("ApiKey header=\"{}\"", self.name)).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(headers: &[(&str, &[u8])]) -> Parts {
        let mut request = Request::get("/");
        for (name, value) in headers {
            request = request.header(*name, http::HeaderValue::from_bytes(value).unwrap());
        }
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn reads_raw_bytes() {
        let ex = FromHeader::account("X-Account-Id");
        let subject = ex
            .extract(&parts(&[("x-account-id", b"acme\xff")]))
            .unwrap();
        assert_eq!(subject.kind(), &SubjectKind::ACCOUNT);
        assert_eq!(subject.id(), b"acme\xff");
    }

    /// Spaces and tabs around a value are not part of the id (HTTP/1.1
    /// parsers strip them; an HTTP/2 request may send them): one subject,
    /// whichever way the header came. Support cannot name such an id.
    #[test]
    fn whitespace_around_a_value_is_not_part_of_the_id() {
        let ex = FromHeader::account("x-account-id");
        for value in [&b"ws"[..], b"ws ", b" ws", b"\tws \t", b"  ws  "] {
            let subject = ex.extract(&parts(&[("x-account-id", value)])).unwrap();
            assert_eq!(subject, Subject::account("ws"), "{value:?}");
        }
        let inner = ex.extract(&parts(&[("x-account-id", b" w s ")])).unwrap();
        assert_eq!(inner, Subject::account("w s"));
        let blank = ex.extract(&parts(&[("x-account-id", b"   ")])).unwrap();
        assert!(blank.checked(256).is_err(), "refused as empty");
        let kind = SubjectKind::ACCOUNT;
        assert!(ex.subject_named(&kind, b"ws").is_ok());
        for id in [&b"ws "[..], b" ws", b"\tws"] {
            assert!(ex.subject_named(&kind, id).is_err(), "{id:?}");
        }
    }

    #[test]
    fn missing_header_is_missing() {
        let ex = FromHeader::user("x-user-id");
        assert_eq!(ex.extract(&parts(&[])), Err(SubjectError::Missing));
    }

    #[test]
    fn repeated_header_is_malformed() {
        let ex = FromHeader::device("x-device-id");
        let err = ex
            .extract(&parts(&[("x-device-id", b"a"), ("x-device-id", b"b")]))
            .unwrap_err();
        assert!(matches!(err, SubjectError::Malformed(_)), "{err:?}");
    }
}
