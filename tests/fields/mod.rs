//! The `RateLimit` fields of a response, as the model tests read them.

#![allow(dead_code)] // Each test uses some of it.

use std::collections::HashMap;

use http::HeaderMap;

/// Each quota's `(r, t)` in `headers`' `RateLimit` fields, by name.
pub fn ratelimit(headers: &HeaderMap) -> HashMap<String, (u64, u64)> {
    let mut out = HashMap::new();
    for value in headers.get_all("ratelimit") {
        for item in value.to_str().unwrap().split(',') {
            let mut parts = item.trim().split(';');
            let name = parts.next().unwrap().trim_matches('"').to_owned();
            let (mut r, mut t) = (None, None);
            for p in parts {
                if let Some(v) = p.strip_prefix("r=") {
                    r = Some(v.parse().unwrap());
                }
                if let Some(v) = p.strip_prefix("t=") {
                    t = Some(v.parse().unwrap());
                }
            }
            out.insert(name, (r.unwrap(), t.unwrap()));
        }
    }
    out
}

/// Each quota's `r` in `headers`' `RateLimit` fields, by name.
pub fn remaining(headers: &HeaderMap) -> HashMap<String, u64> {
    ratelimit(headers)
        .into_iter()
        .map(|(name, (r, _))| (name, r))
        .collect()
}
