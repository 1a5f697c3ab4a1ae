//! The least a quota layer does per request, beside its HTTP plumbing:
//! build the subject's counter key (namespace, subject, day, allowance; on
//! the stack), count it in a map under a lock, and make the `RateLimit`
//! value. Shared by the `fields_floor` example (`--count`), the floor in
//! `benches/layer.rs`, and the demo server's `--quota fields` (the value).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::SystemTime;

use http::HeaderValue;

/// The longest subject id counted: with it, the key fits its buffer.
const MAX_ID: usize = 128;

/// The counters, by key, under one lock.
pub type Counts = Mutex<HashMap<Box<[u8]>, u64>>;

/// Where a subject stands once a request is counted: what a quota layer
/// hands the handler.
#[derive(Clone, Copy, Debug)]
pub struct Standing {
    pub used: u64,
    pub resets_in: u64,
}

/// Counts one request of the subject `id` on its counter of the day (UTC);
/// `None` for an id longer than 128 bytes.
pub fn count(counts: &Counts, id: &[u8]) -> Option<Standing> {
    if id.len() > MAX_ID {
        return None;
    }
    let seconds = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    let mut digits = itoa::Buffer::new();
    let mut key = [0u8; MAX_ID + 64];
    let mut len = 0;
    for part in [
        b"quota:account:".as_slice(),
        id,
        b":",
        digits.format(seconds / 86_400).as_bytes(),
        b":default",
    ] {
        key[len..len + part.len()].copy_from_slice(part);
        len += part.len();
    }
    let mut counts = counts.lock().expect("not poisoned");
    let used = match counts.get_mut(&key[..len]) {
        Some(count) => {
            *count += 1;
            *count
        }
        None => {
            counts.insert(key[..len].into(), 1);
            1
        }
    };
    Some(Standing {
        used,
        resets_in: 86_400 - seconds % 86_400,
    })
}

/// The `RateLimit` value of the default quota, `remaining` left and a
/// reset in `resets_in` seconds.
pub fn ratelimit_value(remaining: u64, resets_in: u64) -> HeaderValue {
    let mut digits = itoa::Buffer::new();
    let mut value = Vec::with_capacity(48);
    value.extend_from_slice(b"\"default\";r=");
    value.extend_from_slice(digits.format(remaining).as_bytes());
    value.extend_from_slice(b";t=");
    value.extend_from_slice(digits.format(resets_in).as_bytes());
    HeaderValue::from_maybe_shared(bytes::Bytes::from(value))
        .expect("digits and quotes are a valid field value")
}
