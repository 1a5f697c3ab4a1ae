//! Counter keys: namespace, subject, allowance and period in one string.
//!
//! A key reads `{namespace}:{{{kind}:{id}}}:{allowance}:{period}`, for example
//! `quota:{account:acme}:read:2026-12-02` for a calendar day or
//! `quota:{user:42}:write:PT24H` for a rolling 24 hours. The subject sits in a
//! Redis Cluster hash tag, so every counter of one subject lands in one slot
//! (and, in the memory store, in one shard).
//!
//! The subject's kind and id and the allowance are percent-encoded (every byte
//! but ASCII letters, digits and `-._~@`), so `:`, `{`, `}`, `%`, control bytes
//! and non-UTF-8 bytes in an id can never imitate a separator. The period
//! comes last and is taken whole. Reading a key from the left therefore gives
//! back exactly one (kind, id, allowance, period): two different tuples never
//! share a counter.

use std::fmt::{self, Write as _};
use std::sync::Arc;

use crate::subject::Subject;
use crate::text::{push_encoded, secret_hash, Text};

/// The prefix every key of a layer starts with. The default is `quota`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Namespace {
    prefix: Arc<str>,
}

impl Namespace {
    /// A namespace with this prefix, e.g. `myapp:quota`.
    ///
    /// # Panics
    ///
    /// When `prefix` contains `{` or `}`: a brace there would become the
    /// key's Redis Cluster hash tag instead of the subject.
    pub fn new(prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        assert!(
            !prefix.contains(['{', '}']),
            "a key namespace must not contain braces (got {prefix:?}): the subject part is the key's hash tag"
        );
        Self {
            prefix: prefix.into(),
        }
    }

    /// The prefix.
    pub fn as_str(&self) -> &str {
        &self.prefix
    }

    /// The key of one counter.
    pub fn key(&self, subject: &Subject, allowance: &str, period: &str) -> PeriodKey {
        self.key_with_period(subject, &KeyPart::new(allowance), period.as_bytes())
    }

    /// [`Namespace::key`], with the allowance encoded already, and `period`
    /// the bytes of a `str` (a period stamp read back from a cache, whose
    /// reader need not check them again: the key is checked whole).
    pub(crate) fn key_with_period(
        &self,
        subject: &Subject,
        allowance: &KeyPart,
        period: &[u8],
    ) -> PeriodKey {
        let mut key = Text::default();
        key.push_str(&self.prefix);
        key.push_str(":{");
        subject.push_tag(&mut key);
        key.push_str("}:");
        key.push_str(&allowance.0);
        key.push_str(":");
        key.push_ascii_or_utf8(period);
        PeriodKey(Arc::from(key.as_str()))
    }
}

impl Default for Namespace {
    fn default() -> Self {
        Self::new("quota")
    }
}

/// A part of a key percent-encoded once, where it is made (a quota's
/// allowance), rather than on every request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KeyPart(Arc<str>);

impl KeyPart {
    pub(crate) fn new(part: &str) -> Self {
        let mut text = Text::default();
        push_encoded(&mut text, part.as_bytes());
        Self(text.as_str().into())
    }
}

/// The key of one counter: one subject, one allowance, one period. Cheap to
/// clone: clones share the text.
///
/// Its text (`as_str`, `Display`) holds the subject's id, often an API key;
/// its `Debug` hides the id behind a short keyed hash:
/// `PeriodKey("quota:{account:#1a2b3c4d}:read:2026-12-02")`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeriodKey(Arc<str>);

impl fmt::Debug for PeriodKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PeriodKey").field(&self.logged()).finish()
    }
}

/// Writes the hash tag `tag` (`kind:id`) as `kind:#1a2b3c4d`.
pub(crate) fn push_hidden(out: &mut String, tag: &str) {
    if let Some((kind, _)) = tag.split_once(':') {
        out.push_str(kind);
        out.push(':');
    }
    write!(out, "#{:08x}", secret_hash(tag)).expect("writing to a String cannot fail");
}

/// `text` (an error a store sent, which may name keys) with every
/// `{subject}` part of a key in it hidden as [`PeriodKey::logged`] hides
/// it.
pub(crate) fn scrubbed(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 10);
    let mut rest = text;
    while let Some(open) = rest.find('{') {
        let Some(len) = rest[open + 1..].find('}') else {
            break;
        };
        out.push_str(&rest[..=open]);
        push_hidden(&mut out, &rest[open + 1..open + 1 + len]);
        rest = &rest[open + 1 + len..];
    }
    out.push_str(rest);
    out
}

impl PeriodKey {
    /// The key as logs show it: the subject's id (often an API key) is
    /// replaced by a short hash, keyed with a secret drawn when the process
    /// starts (as the layer's spans name subjects), so that a log tells one
    /// subject's counters apart from another's without revealing the id:
    /// `quota:{account:#1a2b3c4d}:read:2026-12-02`. A key without a
    /// `{subject}` part is a hash of its own, `#1a2b3c4d`.
    pub(crate) fn logged(&self) -> String {
        let text = self.as_str();
        if self.hash_tag().len() == text.len() {
            return format!("#{:08x}", secret_hash(text));
        }
        scrubbed(text)
    }

    /// Wraps a key built elsewhere (e.g. read back from a store).
    pub fn from_string(key: String) -> Self {
        Self(key.into())
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The subject part between the first `{` and the next `}`: what Redis
    /// Cluster hashes, and what the memory store shards on. The whole key when
    /// there is no such part.
    pub fn hash_tag(&self) -> &str {
        let key: &str = &self.0;
        // Keys are short and `{` comes early: a plain scan of the bytes
        // beats a searcher's setup. Both braces are ASCII, so the slice
        // falls on character boundaries.
        let bytes = key.as_bytes();
        if let Some(open) = bytes.iter().position(|&b| b == b'{') {
            if let Some(len) = bytes[open + 1..].iter().position(|&b| b == b'}') {
                if len > 0 {
                    return &key[open + 1..open + 1 + len];
                }
            }
        }
        key
    }

    /// The key of this counter's lease mark (see
    /// [`LeasedStore`](crate::store::LeasedStore)): the key with `%held`
    /// after its allowance, `quota:{account:acme}:read%held:2026-12-02`.
    /// No counter's key can be a mark's: an allowance is percent-encoded,
    /// and its escapes are `%` and two hex digits. In the same hash tag as
    /// the counter. `None` for a key not built by a [`Namespace`].
    pub(crate) fn lease_mark(&self) -> Option<PeriodKey> {
        self.mark(format_args!("held"))
    }

    /// The key of the mark a settle of a debt on this counter leaves (see
    /// [`Debt::id`](crate::store::Debt::id)): the key with `%settled-` and
    /// the settle's id in hex after its allowance,
    /// `quota:{account:acme}:read%settled-00000000000000ff:2026-12-02`. A
    /// lease mark's twin: no counter's key, nor a lease mark's, can be one;
    /// in the same hash tag as the counter; `None` for a key not built by
    /// a [`Namespace`].
    #[cfg(feature = "redis")]
    pub(crate) fn settle_mark(&self, id: u64) -> Option<PeriodKey> {
        self.mark(format_args!("settled-{id:016x}"))
    }

    /// The key with `%` and `what` after its allowance.
    fn mark(&self, what: fmt::Arguments<'_>) -> Option<PeriodKey> {
        let key: &str = &self.0;
        let open = key.find('{')?;
        let close = open + key[open..].find("}:")?;
        let allowance = close + 2;
        let end = allowance + key[allowance..].find(':')?;
        Some(PeriodKey(
            format!("{}%{what}{}", &key[..end], &key[end..]).into(),
        ))
    }

    /// The key as an owned `String`.
    pub fn into_string(self) -> String {
        self.0.to_string()
    }

    /// The key whose text is `key`, shared.
    pub(crate) fn from_shared(key: Arc<str>) -> Self {
        Self(key)
    }

    /// The key's shared text.
    pub(crate) fn shared(&self) -> &Arc<str> {
        &self.0
    }
}

impl fmt::Display for PeriodKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for PeriodKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// Splits a key back into (kind, id, allowance, period); used by tests to show
/// the encoding is injective.
#[cfg(test)]
pub(crate) fn decode(
    namespace: &Namespace,
    key: &str,
) -> Option<(String, Vec<u8>, String, String)> {
    use percent_encoding::percent_decode_str;
    let rest = key.strip_prefix(namespace.as_str())?.strip_prefix(":{")?;
    let (kind, rest) = rest.split_once(':')?;
    let (id, rest) = rest.split_once("}:")?;
    let (allowance, period) = rest.split_once(':')?;
    Some((
        percent_decode_str(kind).decode_utf8().ok()?.into_owned(),
        percent_decode_str(id).collect(),
        percent_decode_str(allowance)
            .decode_utf8()
            .ok()?
            .into_owned(),
        period.to_owned(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::subject::SubjectKind;
    use proptest::prelude::*;

    #[test]
    fn logged_keys_name_no_subject() {
        let key = |id: &str| Namespace::default().key(&Subject::account(id), "read", "2026-12-02");
        let secret = key("sk_live_secret").logged();
        assert!(!secret.contains("sk_live_secret"), "{secret}");
        let (head, tail) = secret.split_once('#').unwrap();
        assert_eq!(head, "quota:{account:");
        assert_eq!(tail.len(), "1a2b3c4d}:read:2026-12-02".len(), "{secret}");
        assert!(tail.ends_with("}:read:2026-12-02"), "{secret}");
        // One subject, one name; two subjects, two.
        assert_eq!(secret, key("sk_live_secret").logged());
        assert_ne!(secret, key("sk_live_other").logged());
        let other = Namespace::default().key(&Subject::account("sk_live_secret"), "write", "PT1H");
        assert_eq!(
            other.logged()[..secret.find('}').unwrap() + 1],
            secret[..secret.find('}').unwrap() + 1]
        );
        // Keys of another shape.
        let bare = PeriodKey::from_string("sk_live_secret".into()).logged();
        assert!(bare.starts_with('#') && bare.len() == 9, "{bare}");
        let untyped = PeriodKey::from_string("q:{sk_live_secret}:x".into()).logged();
        assert!(
            untyped.starts_with("q:{#") && untyped.ends_with("}:x"),
            "{untyped}"
        );
    }

    #[test]
    fn errors_name_keys_as_logs_do() {
        let key = Namespace::default().key(&Subject::account("sk_live_secret"), "read", "PT1H");
        let error = format!(
            "ERR tower-quota: {} holds a value that is not a counter",
            key.as_str()
        );
        let shown = scrubbed(&error);
        assert!(!shown.contains("sk_live_secret"), "{shown}");
        assert_eq!(
            shown,
            format!(
                "ERR tower-quota: {} holds a value that is not a counter",
                key.logged()
            )
        );
        assert_eq!(scrubbed("no key {here"), "no key {here");
        assert_eq!(scrubbed("plain"), "plain");
    }

    /// An error that names several keys (a charge of several quotas, a
    /// subject's keys listed) shows none of their ids, not only the first's.
    #[test]
    fn an_error_naming_several_keys_hides_every_id() {
        let key = |id: &str| Namespace::default().key(&Subject::account(id), "read", "PT1H");
        let (first, second) = (key("sk_live_secret"), key("sk_live_other"));
        let error = format!(
            "ERR {} and {} are not counters; {}",
            first.as_str(),
            second.as_str(),
            first.as_str()
        );
        let shown = scrubbed(&error);
        assert!(!shown.contains("sk_live"), "{shown}");
        assert_eq!(
            shown,
            format!(
                "ERR {} and {} are not counters; {}",
                first.logged(),
                second.logged(),
                first.logged()
            )
        );
    }

    #[test]
    fn debug_hides_the_subjects_id() {
        let key =
            Namespace::default().key(&Subject::account("sk_live_secret"), "read", "2026-12-02");
        let shown = format!("{key:?}");
        assert!(!shown.contains("sk_live_secret"), "{shown}");
        assert!(shown.starts_with("PeriodKey(\"quota:{account:#"), "{shown}");
        assert!(shown.ends_with("}:read:2026-12-02\")"), "{shown}");
        assert_eq!(key.to_string(), key.as_str(), "the text keeps the id");
    }

    #[test]
    fn a_lease_mark_follows_the_allowance() {
        let key = Namespace::new("app:q").key(&Subject::account("a:b"), "read", "2026-12-02");
        assert_eq!(
            key.lease_mark().unwrap().as_str(),
            "app:q:{account:a%3Ab}:read%held:2026-12-02"
        );
        assert_eq!(PeriodKey::from_string("plain".into()).lease_mark(), None);
    }

    #[test]
    #[cfg(feature = "redis")]
    fn a_settle_mark_names_its_settle_after_the_allowance() {
        let key = Namespace::new("app:q").key(&Subject::account("a:b"), "read", "2026-12-02");
        let mark = key.settle_mark(255).unwrap();
        assert_eq!(
            mark.as_str(),
            "app:q:{account:a%3Ab}:read%settled-00000000000000ff:2026-12-02"
        );
        assert_eq!(mark.hash_tag(), key.hash_tag());
        assert_ne!(key.settle_mark(256), Some(mark));
        assert_eq!(PeriodKey::from_string("plain".into()).settle_mark(1), None);
    }

    #[test]
    fn readable_for_ordinary_ids() {
        let ns = Namespace::default();
        let key = ns.key(&Subject::account("acme-corp"), "read", "2026-12-02");
        assert_eq!(key.as_str(), "quota:{account:acme-corp}:read:2026-12-02");
        assert_eq!(key.hash_tag(), "account:acme-corp");
    }

    #[test]
    fn separators_in_ids_are_escaped() {
        let ns = Namespace::default();
        let a = ns.key(&Subject::account("a}:read:x"), "read", "2026-12-02");
        let b = ns.key(&Subject::account("a"), "read", "x}:read:2026-12-02");
        assert_ne!(a, b);
        assert_eq!(
            a.as_str(),
            "quota:{account:a%7D%3Aread%3Ax}:read:2026-12-02"
        );
        assert_eq!(a.hash_tag(), "account:a%7D%3Aread%3Ax");
    }

    #[test]
    fn non_utf8_and_control_bytes_are_escaped() {
        let ns = Namespace::default();
        let key = ns.key(&Subject::device(&b"\xff\x00\n%"[..]), "w", "P");
        assert_eq!(key.as_str(), "quota:{device:%FF%00%0A%25}:w:P");
    }

    /// An empty `{}` is no hash tag (Redis Cluster then hashes the whole
    /// key, as `slot_of` does): not the empty string, nor a later `{...}`.
    #[test]
    fn an_empty_brace_pair_is_no_hash_tag() {
        for text in ["q:{}:x", "foo{}{bar}", "{}"] {
            let key = PeriodKey::from_string(text.into());
            assert_eq!(key.hash_tag(), text);
        }
        assert_eq!(PeriodKey::from_string("a{b}{c}".into()).hash_tag(), "b");
    }

    #[test]
    fn kinds_do_not_share_keys() {
        let ns = Namespace::default();
        let account = ns.key(&Subject::account("7"), "read", "2026-12-02");
        let user = ns.key(&Subject::user("7"), "read", "2026-12-02");
        assert_ne!(account, user);
    }

    #[test]
    #[should_panic(expected = "must not contain braces")]
    fn braces_in_namespace_are_refused() {
        let _ = Namespace::new("app{x}");
    }

    fn kind() -> impl Strategy<Value = SubjectKind> {
        prop_oneof![
            Just(SubjectKind::ACCOUNT),
            Just(SubjectKind::USER),
            Just(SubjectKind::DEVICE),
            "[a-z][a-z0-9_.-]{0,8}".prop_map(SubjectKind::custom),
        ]
    }

    fn tuple() -> impl Strategy<Value = (SubjectKind, Vec<u8>, String, String)> {
        // Ids and allowances are drawn from a small alphabet full of
        // separators so that near-collisions are common.
        let id = proptest::collection::vec(
            prop_oneof![
                Just(b':'),
                Just(b'{'),
                Just(b'}'),
                Just(b'%'),
                Just(b'a'),
                Just(b'3'),
                Just(b'A'),
                Just(0u8),
                Just(0xffu8),
                any::<u8>()
            ],
            0..12,
        );
        let allowance = "[:{}%a-c ]{1,6}";
        let period = "[:{}%0-9TW/-]{0,12}";
        (kind(), id, allowance, period)
    }

    proptest! {
        #[test]
        fn keys_decode_to_what_built_them((kind, id, allowance, period) in tuple()) {
            let ns = Namespace::new("quota:v1");
            let key = ns.key(&Subject::new(kind.clone(), id.clone()), &allowance, &period);
            let decoded = decode(&ns, key.as_str()).expect("every key decodes");
            prop_assert_eq!(decoded, (kind.as_str().to_owned(), id, allowance, period));
        }

        #[test]
        fn different_tuples_give_different_keys(a in tuple(), b in tuple()) {
            let ns = Namespace::default();
            let ka = ns.key(&Subject::new(a.0.clone(), a.1.clone()), &a.2, &a.3);
            let kb = ns.key(&Subject::new(b.0.clone(), b.1.clone()), &b.2, &b.3);
            prop_assert_eq!(a == b, ka == kb);
        }

        #[test]
        fn a_lease_mark_is_no_counter_of_any_tuple(a in tuple(), b in tuple()) {
            let ns = Namespace::default();
            let ka = ns.key(&Subject::new(a.0.clone(), a.1.clone()), &a.2, &a.3);
            let kb = ns.key(&Subject::new(b.0.clone(), b.1.clone()), &b.2, &b.3);
            let mark = ka.lease_mark().expect("a namespace's key has a mark");
            prop_assert_ne!(&mark, &kb);
            prop_assert_eq!(mark.hash_tag(), ka.hash_tag());
            prop_assert_eq!(a == b, Some(mark) == kb.lease_mark());
        }

        #[test]
        fn hash_tag_is_the_whole_subject(kind in kind(), id in proptest::collection::vec(any::<u8>(), 0..20)) {
            let ns = Namespace::default();
            let subject = Subject::new(kind, id);
            let a = ns.key(&subject, "read", "2026-12-02");
            let b = ns.key(&subject, "write", "PT24H");
            prop_assert_eq!(a.hash_tag(), b.hash_tag());
            prop_assert!(!a.hash_tag().contains(['{', '}']), "the hash tag holds a brace");
        }
    }
}
