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

    /// The hash logs show is keyed with a secret of the process: this test
    /// binary run again hashes the same tag otherwise, and SipHash with its
    /// well-known zero key hashes it otherwise too, so that nobody can hash
    /// guessed ids (a user's number, a short key) to find whom a log names.
    #[test]
    fn the_log_hash_is_keyed_with_a_secret_of_the_process() {
        use std::hash::{BuildHasher, BuildHasherDefault};
        const CHILD: &str = "TOWER_QUOTA_TEST_PRINT_LOG_HASH";
        let tag = "user:42";
        if std::env::var_os(CHILD).is_some() {
            println!("log-hash={:08x};", secret_hash(tag));
            return;
        }
        let ours = secret_hash(tag);
        assert_eq!(ours, secret_hash(tag), "one tag, one hash in a process");
        #[allow(deprecated)]
        let unkeyed = [
            BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default()
                .hash_one(tag),
            BuildHasherDefault::<std::hash::SipHasher>::default().hash_one(tag),
        ];
        for unkeyed in unkeyed {
            assert_ne!(ours, unkeyed >> 32, "a hash anyone can compute");
        }
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "text::tests::the_log_hash_is_keyed_with_a_secret_of_the_process",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&child.stdout);
        let theirs = stdout
            .split("log-hash=")
            .nth(1)
            .and_then(|rest| rest.split(';').next())
            .unwrap_or_else(|| panic!("no hash printed: {stdout}"));
        assert_ne!(
            format!("{ours:08x}"),
            theirs,
            "the same secret in two processes"
        );
    }

    #[test]
    fn the_plain_bytes_are_those_the_encoding_keeps() {
        for b in 0..=255u8 {
            let kept = percent_encode(&[b], PART).to_string() == char::from(b).to_string();
            assert_eq!(PLAIN[usize::from(b)], kept, "byte {b}");
        }
    }
}
