//! Hashes of the Redis store: one every instance computes alike, in every
//! build (FNV-1a, 64 bits), and one no log reader can compute (for keys in
//! logs).
//!
//! What decides where a counter lives or how long it does, on every
//! instance that shares the store, must not depend on the process or on the
//! Rust release: `std`'s `DefaultHasher` is keyed by nothing yet documented
//! to change between releases, and `RandomState` differs per process. FNV-1a
//! is fixed by its specification (the offset basis and prime below, one
//! `xor` then one multiplication per byte), and the tests pin its outputs,
//! so a change is caught.

use std::time::Duration;

use super::script::as_millis;

use crate::key::PeriodKey;

/// FNV-1a's 64-bit offset basis.
const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a's 64-bit prime, 2^40 + 2^8 + 0xb3.
const PRIME: u64 = 0x0000_0100_0000_01b3;

/// The 64-bit FNV-1a hash of `bytes`.
pub(super) fn fnv1a_64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(OFFSET_BASIS, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(PRIME)
    })
}

/// `key` as logs show it: see [`PeriodKey::logged`].
pub(super) fn logged(key: &PeriodKey) -> String {
    key.logged()
}

/// `text` with every `{subject}` part of a key in it hidden: see
/// [`crate::key::scrubbed`].
pub(super) fn scrubbed(text: &str) -> String {
    crate::key::scrubbed(text)
}

/// A deadline offset in `[0, spread]` drawn from the key, so every instance
/// picks the same one, whatever its build (see the hash module).
pub(super) fn jitter(key: &PeriodKey, spread: Duration) -> i64 {
    let spread = as_millis(spread);
    if spread == 0 {
        return 0;
    }
    (fnv1a_64(key.as_str().as_bytes()) % (spread as u64 + 1)) as i64
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{fnv1a_64, jitter, logged, scrubbed};
    use crate::key::{Namespace, PeriodKey};
    use crate::subject::Subject;

    #[test]
    fn logged_keys_name_no_subject() {
        let key = |id: &str| Namespace::default().key(&Subject::account(id), "read", "2026-12-02");
        let secret = logged(&key("sk_live_secret"));
        assert!(!secret.contains("sk_live_secret"), "{secret}");
        let (head, tail) = secret.split_once('#').unwrap();
        assert_eq!(head, "quota:{account:");
        assert_eq!(tail.len(), "1a2b3c4d}:read:2026-12-02".len(), "{secret}");
        assert!(tail.ends_with("}:read:2026-12-02"), "{secret}");
        // One subject, one name; two subjects, two.
        assert_eq!(secret, logged(&key("sk_live_secret")));
        assert_ne!(secret, logged(&key("sk_live_other")));
        let other = Namespace::default().key(&Subject::account("sk_live_secret"), "write", "PT1H");
        assert_eq!(
            logged(&other)[..secret.find('}').unwrap() + 1],
            secret[..secret.find('}').unwrap() + 1]
        );
        // Keys of another shape.
        let bare = logged(&PeriodKey::from_string("sk_live_secret".into()));
        assert!(bare.starts_with('#') && bare.len() == 9, "{bare}");
        let untyped = logged(&PeriodKey::from_string("q:{sk_live_secret}:x".into()));
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
                logged(&key)
            )
        );
        assert_eq!(scrubbed("no key {here"), "no key {here");
        assert_eq!(scrubbed("plain"), "plain");
    }

    /// The specification's test vectors: a change to the hash, and so to
    /// every instance's jitter, fails here.
    #[test]
    fn fnv1a_64_gives_the_reference_values() {
        assert_eq!(fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn jitter_stays_within_its_spread_and_varies_by_key() {
        let spread = Duration::from_secs(60);
        let draws: Vec<i64> = (0..200)
            .map(|i| {
                jitter(
                    &PeriodKey::from_string(format!("quota:{{account:{i}}}:read:2026-12-02")),
                    spread,
                )
            })
            .collect();
        assert!(draws.iter().all(|&j| (0..=60_000).contains(&j)));
        let distinct: std::collections::HashSet<_> = draws.iter().collect();
        assert!(
            distinct.len() > 150,
            "jitter should spread keys, got {} distinct",
            distinct.len()
        );
        assert_eq!(
            jitter(&PeriodKey::from_string("k".into()), Duration::ZERO),
            0
        );
    }

    /// Every instance, of any build, draws the same jitter for a key: the
    /// values are pinned.
    #[test]
    fn jitter_is_the_same_in_every_build() {
        let key = PeriodKey::from_string("quota:{account:acme}:read:2026-12-02".into());
        let draws = [1, 1_000, 60_000].map(|ms| jitter(&key, Duration::from_millis(ms)));
        assert_eq!(fnv1a_64(key.as_str().as_bytes()), 0x34b2_ed80_6a2c_668b);
        assert_eq!(draws, [1, 944, 38_223]);
    }
}
