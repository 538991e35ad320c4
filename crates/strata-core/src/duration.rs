//! Human durations: `90s`, `10m`, `1h`, `7d`, `1h30m`, `250ms`.
//!
//! One syntax everywhere: the daemon's configuration (`snapshot_interval =
//! "60s"`), the API (`rewind {"ago": "10m"}`) and the CLI (`--ago 10m`).

use std::time::Duration;

/// A string that is not a duration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration {0:?}: expected e.g. 250ms, 90s, 10m, 1h30m or 7d")]
pub struct DurationError(pub String);

/// Parses `[<number><unit>]+` with units `ms`, `s`, `m`, `h`, `d`; a bare `0` is zero.
pub fn parse_duration(input: &str) -> Result<Duration, DurationError> {
    let err = || DurationError(input.chars().take(40).collect());
    let s = input.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() {
        return Err(err());
    }
    let mut total: u64 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 || digits > 12 {
            return Err(err());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| err())?;
        rest = &rest[digits..];
        let (unit_ms, len) = if rest.starts_with("ms") {
            (1, 2)
        } else if rest.starts_with('s') {
            (1_000, 1)
        } else if rest.starts_with('m') {
            (60_000, 1)
        } else if rest.starts_with('h') {
            (3_600_000, 1)
        } else if rest.starts_with('d') {
            (86_400_000, 1)
        } else {
            return Err(err());
        };
        rest = &rest[len..];
        total = n
            .checked_mul(unit_ms)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(err)?;
    }
    Ok(Duration::from_millis(total))
}

/// Formats a duration the way [`parse_duration`] reads it (largest units first).
pub fn format_duration(d: Duration) -> String {
    let mut ms = d.as_millis() as u64;
    if ms == 0 {
        return "0s".into();
    }
    let mut out = String::new();
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms >= size {
            out.push_str(&format!("{}{unit}", ms / size));
            ms %= size;
        }
    }
    if ms > 0 {
        out.push_str(&format!("{ms}ms"));
    }
    out
}

/// Serde helpers for `Duration` fields written as human strings.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_compounds() {
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(
            parse_duration("7d").unwrap(),
            Duration::from_secs(7 * 86400)
        );
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "m", "10", "-5m", "10x", "1.5h", "99999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn formats_round_trip() {
        for s in ["1h30m", "10m", "7d", "250ms", "0s"] {
            assert_eq!(format_duration(parse_duration(s).unwrap()), s);
        }
    }
}
