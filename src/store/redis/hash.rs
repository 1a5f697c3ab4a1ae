//! A hash every instance computes alike, in every build: FNV-1a, 64 bits.
//!
//! What decides where a counter lives or how long it does, on every
//! instance that shares the store, must not depend on the process or on the
//! Rust release: `std`'s `DefaultHasher` is keyed by nothing yet documented
//! to change between releases, and `RandomState` differs per process. FNV-1a
//! is fixed by its specification (the offset basis and prime below, one
//! `xor` then one multiplication per byte), and the tests pin its outputs,
//! so a change is caught.

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

#[cfg(test)]
mod tests {
    use super::fnv1a_64;

    /// The specification's test vectors: a change to the hash, and so to
    /// every instance's jitter, fails here.
    #[test]
    fn fnv1a_64_gives_the_reference_values() {
        assert_eq!(fnv1a_64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
