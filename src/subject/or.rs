use http::request::Parts;
use http::HeaderValue;

use super::{Subject, SubjectError, SubjectExtractor, SubjectKind};

/// Asks one extractor, then another when the first finds no subject. See
/// [`SubjectExtractor::or`].
#[derive(Clone, Debug)]
pub struct Or<A, B> {
    first: A,
    second: B,
}

impl<A, B> Or<A, B> {
    pub(super) fn new(first: A, second: B) -> Self {
        Self { first, second }
    }
}

impl<A, B> SubjectExtractor for Or<A, B>
where
    A: SubjectExtractor,
    B: SubjectExtractor,
{
    fn extract(&self, parts: &Parts) -> Result<Subject, SubjectError> {
        match self.first.extract(parts) {
            Err(SubjectError::Missing) => self.second.extract(parts),
            answer => answer,
        }
    }

    fn kinds(&self) -> Option<Vec<SubjectKind>> {
        let mut kinds = self.first.kinds()?;
        for kind in self.second.kinds()? {
            if !kinds.contains(&kind) {
                kinds.push(kind);
            }
        }
        Some(kinds)
    }

    /// As the extractor that answers subjects of `kind` names them: the
    /// first, unless it tells it never answers that kind, or it could never
    /// charge `id` (it refuses it as malformed) and the second may answer
    /// that kind (a header's id that is not text, behind an extension's).
    /// An extractor that does not tell its kinds (a closure's) may answer
    /// any; where the first tells nothing and the second tells it answers
    /// `kind`, the second names the subject (it may rewrite ids, as
    /// [`ClientIp`](crate::ClientIp) groups addresses), and the first only
    /// ids the second refuses.
    fn subject_named(&self, kind: &SubjectKind, id: &[u8]) -> Result<Subject, SubjectError> {
        let first = self.first.kinds();
        let second = self.second.kinds();
        let may_answer = |kinds: &Option<Vec<SubjectKind>>| {
            kinds.as_ref().is_none_or(|kinds| kinds.contains(kind))
        };
        if !may_answer(&first) {
            return self.second.subject_named(kind, id);
        }
        if first.is_none() && second.as_ref().is_some_and(|kinds| kinds.contains(kind)) {
            return match self.second.subject_named(kind, id) {
                Err(SubjectError::Malformed(_)) => self.first.subject_named(kind, id),
                answer => answer,
            };
        }
        match self.first.subject_named(kind, id) {
            Err(SubjectError::Malformed(_)) if may_answer(&second) => {
                self.second.subject_named(kind, id)
            }
            answer => answer,
        }
    }

    /// Both challenges, as one list (either alone when the other has none).
    fn challenge(&self) -> Option<HeaderValue> {
        match (self.first.challenge(), self.second.challenge()) {
            (Some(first), Some(second)) if first != second => {
                let mut both = first.as_bytes().to_vec();
                both.extend_from_slice(b", ");
                both.extend_from_slice(second.as_bytes());
                HeaderValue::from_bytes(&both).ok()
            }
            (first, second) => first.or(second),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::subject::{from_fn, FromHeader};
    use http::Request;

    /// An id the first extractor could never charge, which the second can,
    /// is the second's to name: support reaches every subject the layer
    /// charges.
    #[test]
    fn an_id_only_the_second_can_charge_is_named_by_the_second() {
        let both =
            crate::FromExtension::<String>::account().or(FromHeader::account("x-account-id"));
        let kind = SubjectKind::ACCOUNT;
        assert_eq!(
            both.subject_named(&kind, b"ac\xffme"),
            Ok(Subject::account(&b"ac\xffme"[..]))
        );
        assert_eq!(
            both.subject_named(&kind, b"acme"),
            Ok(Subject::account("acme"))
        );
        // The other way round: spaces around an extension's id.
        let header_first =
            FromHeader::account("x-account-id").or(crate::FromExtension::<String>::account());
        assert_eq!(
            header_first.subject_named(&kind, b" acme"),
            Ok(Subject::account(" acme"))
        );
        // Refused by both.
        assert!(matches!(
            header_first.subject_named(&kind, b" ac\xffme"),
            Err(SubjectError::Malformed(_))
        ));
    }

    /// A closure tells no kinds: it may answer any, and charge ids the other
    /// extractor would refuse, which support then reaches too.
    #[test]
    fn a_closure_that_tells_no_kinds_may_answer_any() {
        let token = from_fn(|_: &Parts| Ok(Subject::account(" acme")));
        let kind = SubjectKind::ACCOUNT;
        let closure_first = token.clone().or(FromHeader::account("x-account-id"));
        assert_eq!(
            closure_first.subject_named(&kind, b" acme"),
            Ok(Subject::account(" acme"))
        );
        assert_eq!(
            closure_first.subject_named(&kind, b"a\x01b"),
            Ok(Subject::account(&b"a\x01b"[..]))
        );
        // Behind a header the closure's ids are reached too, once the
        // header refuses them.
        let header_first = FromHeader::account("x-account-id").or(token.clone());
        assert_eq!(
            header_first.subject_named(&kind, b" acme"),
            Ok(Subject::account(" acme"))
        );
        // A kind the header never answers is the closure's.
        let user = SubjectKind::USER;
        assert_eq!(
            header_first.subject_named(&user, b"u"),
            Ok(Subject::user("u"))
        );
        assert_eq!(closure_first.kinds(), None);

        // Before an extractor that rewrites ids, a closure leaves the
        // naming to it: a support call reaches the network's counter.
        let ip = from_fn(|_: &Parts| Err(SubjectError::Missing)).or(crate::ClientIp::new());
        let named = ip.subject_named(&SubjectKind::IP, b"2001:db8:1:2::9");
        assert_eq!(
            named,
            Ok(Subject::new(SubjectKind::IP, "2001:db8:1:2::/64"))
        );
    }

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut request = Request::get("/");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(()).unwrap().into_parts().0
    }

    fn three() -> impl SubjectExtractor {
        FromHeader::account("x-account-id")
            .or(FromHeader::user("x-user-id"))
            .or(FromHeader::device("x-device-id"))
    }

    #[test]
    fn first_answer_wins() {
        let both = parts(&[("x-account-id", "a"), ("x-user-id", "u")]);
        assert_eq!(three().extract(&both), Ok(Subject::account("a")));
    }

    #[test]
    fn missing_falls_through_each_level() {
        let user = parts(&[("x-user-id", "u"), ("x-device-id", "d")]);
        assert_eq!(three().extract(&user), Ok(Subject::user("u")));
        let device = parts(&[("x-device-id", "d")]);
        assert_eq!(three().extract(&device), Ok(Subject::device("d")));
        assert_eq!(three().extract(&parts(&[])), Err(SubjectError::Missing));
    }

    #[test]
    fn malformed_is_never_replaced() {
        // A repeated account header is malformed: the user header is not asked.
        let first = parts(&[
            ("x-account-id", "a"),
            ("x-account-id", "b"),
            ("x-user-id", "u"),
        ]);
        assert!(matches!(
            three().extract(&first),
            Err(SubjectError::Malformed(_))
        ));
        // Nor at the second level.
        let second = parts(&[("x-user-id", "u"), ("x-user-id", "v"), ("x-device-id", "d")]);
        assert!(matches!(
            three().extract(&second),
            Err(SubjectError::Malformed(_))
        ));
        // The last one's malformed answer is the answer too.
        let last = parts(&[("x-device-id", "d"), ("x-device-id", "e")]);
        assert!(matches!(
            three().extract(&last),
            Err(SubjectError::Malformed(_))
        ));
    }

    /// A server that hands over no peer address is at fault (500): the
    /// next extractor is not asked, as it is only for a missing subject,
    /// and a header the client picks does not pay instead.
    #[test]
    fn unavailable_is_never_replaced() {
        let ex = crate::ClientIp::new().or(FromHeader::account("x-account-id"));
        let request = parts(&[("x-account-id", "a")]);
        assert!(matches!(
            ex.extract(&request),
            Err(SubjectError::Unavailable(_))
        ));
    }

    #[test]
    fn an_id_is_named_by_the_extractor_of_its_kind() {
        let ex = FromHeader::account("x-account-id").or(crate::ClientIp::new());
        assert_eq!(
            ex.subject_named(&SubjectKind::IP, b"2001:db8:1:2::9"),
            Ok(Subject::new(SubjectKind::IP, "2001:db8:1:2::/64"))
        );
        assert_eq!(
            ex.subject_named(&SubjectKind::ACCOUNT, b"2001:db8:1:2::9"),
            Ok(Subject::account("2001:db8:1:2::9"))
        );
        assert!(ex.subject_named(&SubjectKind::ACCOUNT, b"a\nb").is_err());
    }

    #[test]
    fn second_is_not_asked_when_the_first_answers() {
        let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = asked.clone();
        let second = from_fn(move |_: &Parts| {
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(Subject::user("fallback"))
        });
        let ex = FromHeader::account("x-account-id").or(second);
        assert_eq!(
            ex.extract(&parts(&[("x-account-id", "a")])),
            Ok(Subject::account("a"))
        );
        assert_eq!(asked.load(std::sync::atomic::Ordering::Relaxed), 0);
        assert_eq!(ex.extract(&parts(&[])), Ok(Subject::user("fallback")));
        assert_eq!(asked.load(std::sync::atomic::Ordering::Relaxed), 1);
    }
}
