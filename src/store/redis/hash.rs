//! The Redis store's hash that every instance computes alike, in every
//! build (FNV-1a, 64 bits). (Keys in logs are hidden by `PeriodKey::logged`,
//! with a hash no log reader can compute.)
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

    use super::{fnv1a_64, jitter};
    use crate::key::PeriodKey;

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
