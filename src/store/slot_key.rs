//! A counter's key as a store's map holds it.

use std::sync::Arc;

use crate::key::PeriodKey;

/// A counter's key as a map holds it: in the map's own slot when short
/// (nearly always), so that a lookup finds the key beside its counter
/// instead of in an allocation of its own, one more read from memory. With
/// many subjects, a charge's time is mostly those reads.
pub(super) enum MapKey {
    Inline { len: u8, bytes: [u8; INLINE_KEY] },
    Shared(Arc<str>),
}

/// The longest key kept in the slot: the key and its tag fill 64 bytes.
const INLINE_KEY: usize = 62;

impl MapKey {
    pub(super) fn new(key: &PeriodKey) -> Self {
        let text = key.as_str().as_bytes();
        if text.len() <= INLINE_KEY {
            let mut bytes = [0; INLINE_KEY];
            bytes[..text.len()].copy_from_slice(text);
            let len = u8::try_from(text.len()).expect("INLINE_KEY fits in a u8");
            Self::Inline { len, bytes }
        } else {
            Self::Shared(Arc::clone(key.shared()))
        }
    }

    /// The key, as requests name it.
    pub(super) fn to_period_key(&self) -> PeriodKey {
        match self {
            Self::Inline { .. } => {
                let text = std::str::from_utf8(self.as_bytes()).expect("kept from a key's text");
                PeriodKey::from_string(text.to_owned())
            }
            Self::Shared(key) => PeriodKey::from_shared(Arc::clone(key)),
        }
    }

    pub(super) fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Self::Shared(key) => key.as_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_comes_back_as_it_went_in_whatever_its_length() {
        for len in [0, 1, 61, 62, 63, 200] {
            let text = "k".repeat(len);
            let key = PeriodKey::from_string(text.clone());
            let kept = MapKey::new(&key);
            assert_eq!(kept.as_bytes(), text.as_bytes());
            assert_eq!(kept.to_period_key(), key);
            assert_eq!(matches!(kept, MapKey::Inline { .. }), len <= INLINE_KEY);
        }
    }
}
