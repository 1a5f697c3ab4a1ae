//! The period syntax of the example servers' `--period` flag.

use std::time::Duration;

use tower_quota::Period;

/// `1m`, `1h`, `1d`, `1w`, `1mo` are calendar periods; any other whole
/// number of `s`, `m` or `h` is a fixed window (at most 100 years).
pub fn parse_period(text: &str) -> Result<Period, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 =
        number.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
            format!("--period {text:?}: expected a positive whole number and a unit")
        })?;
    let fixed = |n: u64, unit: u64| match n.checked_mul(unit) {
        Some(secs) if secs <= 100 * 31_557_600 => Ok(Period::fixed(Duration::from_secs(secs))),
        _ => Err(format!("--period {text:?}: at most 100 years")),
    };
    match (n, unit) {
        (1, "m") => Ok(Period::minute()),
        (1, "h") => Ok(Period::hour()),
        (1, "d") => Ok(Period::day()),
        (1, "w") => Ok(Period::week()),
        (1, "mo") => Ok(Period::month()),
        (n, "s") => fixed(n, 1),
        (n, "m") => fixed(n, 60),
        (n, "h") => fixed(n, 3600),
        _ => Err(format!(
            "--period {text:?}: use 10s, 1m, 1h, 1d, 1w, 1mo, or any whole number of s, m or h"
        )),
    }
}
