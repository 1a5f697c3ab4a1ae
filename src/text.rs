//! Text written on the stack, key parts percent-encoded, and the keyed
//! hash that logs show in place of subject ids.
//!
//! A key part is percent-encoded (every byte but ASCII letters, digits and
//! `-._~@`), so that no id can imitate a key's separators.

use std::fmt::{self, Write as _};

use percent_encoding::{percent_encode, AsciiSet, NON_ALPHANUMERIC};

/// What a key part percent-encodes: every byte but ASCII letters, digits
/// and `-._~@`.
const PART: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~')
    .remove(b'@');

/// The bytes a key part keeps as they are: ASCII letters, digits and
/// `-_.~@` (what `PART` leaves unescaped).
const PLAIN: [bool; 256] = {
    let mut plain = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        plain[b] = c.is_ascii_alphanumeric()
            || c == b'-'
            || c == b'_'
            || c == b'.'
            || c == b'~'
            || c == b'@';
        b += 1;
    }
    plain
};

/// Writes `bytes` as a key part, percent-encoded.
pub(crate) fn push_encoded(out: &mut Text, bytes: &[u8]) {
    // Most ids need no escaping at all; plain bytes are ASCII.
    if bytes.iter().all(|&b| PLAIN[usize::from(b)]) {
        out.push_ascii(bytes);
        return;
    }
    write!(out, "{}", percent_encode(bytes, PART)).expect("writing a key cannot fail")
}

/// Text being written (a key, a field value): on the stack while it is
/// short (nearly always), so that its only allocation is the final copy, of
/// its exact size.
pub(crate) struct Text {
    short: [u8; 192],
    len: usize,
    long: Option<String>,
}

impl Default for Text {
    fn default() -> Self {
        Self {
            short: [0; 192],
            len: 0,
            long: None,
        }
    }
}

impl Text {
    #[inline]
    pub(crate) fn push_str(&mut self, text: &str) {
        self.push_ascii_or_utf8(text.as_bytes());
    }

    /// Bytes that are ASCII (plain key parts).
    #[inline]
    pub(crate) fn push_ascii(&mut self, bytes: &[u8]) {
        debug_assert!(bytes.is_ascii());
        self.push_ascii_or_utf8(bytes);
    }

    /// Only the bytes of whole UTF-8 strings, or ASCII bytes, come in, so
    /// the text stays UTF-8 (and `as_str` checks it).
    #[inline]
    pub(crate) fn push_ascii_or_utf8(&mut self, bytes: &[u8]) {
        let end = self.len + bytes.len();
        if self.long.is_none() && end <= self.short.len() {
            self.short[self.len..end].copy_from_slice(bytes);
            self.len = end;
        } else {
            self.push_long(bytes);
        }
    }

    /// Past the stack's room: the text moves to the heap.
    #[cold]
    fn push_long(&mut self, bytes: &[u8]) {
        let text = std::str::from_utf8(bytes).expect("keys are UTF-8");
        match &mut self.long {
            Some(long) => long.push_str(text),
            None => {
                let mut long = String::with_capacity((self.len + bytes.len()) * 2);
                long.push_str(self.as_str());
                long.push_str(text);
                self.long = Some(long);
            }
        }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        match &self.long {
            Some(long) => long.as_bytes(),
            None => &self.short[..self.len],
        }
    }

    pub(crate) fn as_str(&self) -> &str {
        match &self.long {
            Some(long) => long,
            // Only whole `&str`s and ASCII are copied in: the bytes are UTF-8.
            None => std::str::from_utf8(&self.short[..self.len]).expect("keys are UTF-8"),
        }
    }
}

impl fmt::Write for Text {
    fn write_str(&mut self, text: &str) -> std::fmt::Result {
        self.push_str(text);
        Ok(())
    }
}

/// A hash of `tag`, 32 bits, keyed with a secret drawn from the operating
/// system's randomness when the process first logs one (SipHash, the
/// standard library's keyed hash).
pub(crate) fn secret_hash(tag: &str) -> u64 {
    use std::hash::BuildHasher;
    static SECRET: std::sync::OnceLock<std::hash::RandomState> = std::sync::OnceLock::new();
    SECRET.get_or_init(Default::default).hash_one(tag) >> 32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plain_bytes_are_those_the_encoding_keeps() {
        for b in 0..=255u8 {
            let kept = percent_encode(&[b], PART).to_string() == char::from(b).to_string();
            assert_eq!(PLAIN[usize::from(b)], kept, "byte {b}");
        }
    }
}
