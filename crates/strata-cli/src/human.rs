//! Human-readable formatting (sizes, ages, durations, tables) and the
//! duration syntax of `--ago` / `--idle-timeout`.

use std::time::Duration;

use chrono::{DateTime, Utc};

pub use strata_core::duration::parse_duration;

/// A clap value parser that checks the syntax and keeps the original text
/// (the daemon parses it again).
pub fn duration_arg(s: &str) -> Result<String, String> {
    parse_duration(s)
        .map(|_| s.trim().to_owned())
        .map_err(|e| e.to_string())
}

/// `1.5 GiB`, `512 B`, `3.0 KiB` (binary units, one decimal above bytes).
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// A short duration: `850ms`, `12s`, `5m`, `3h20m`, `2d4h`.
pub fn duration_short(d: Duration) -> String {
    let s = d.as_secs();
    if s == 0 {
        return format!("{}ms", d.as_millis());
    }
    if s < 60 {
        return format!("{s}s");
    }
    let (d_, h, m) = (s / 86_400, (s % 86_400) / 3_600, (s % 3_600) / 60);
    match (d_, h, m) {
        (0, 0, m) => format!("{m}m"),
        (0, h, 0) => format!("{h}h"),
        (0, h, m) => format!("{h}h{m}m"),
        (d_, 0, _) => format!("{d_}d"),
        (d_, h, _) => format!("{d_}d{h}h"),
    }
}

/// How long ago `t` was, relative to `now`: `12s ago`, `3h20m ago`; `just now`
/// under a second; `in 5s` for a time in the future (clock skew).
pub fn age(t: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let delta = now.signed_duration_since(t);
    match delta.to_std() {
        Ok(d) if d < Duration::from_secs(1) => "just now".into(),
        Ok(d) => format!("{} ago", duration_short(d)),
        Err(_) => match (-delta).to_std() {
            Ok(d) => format!("in {}", duration_short(d)),
            Err(_) => "just now".into(),
        },
    }
}

/// Milliseconds with a sensible precision: `0.42`, `14.8`, `1234`.
pub fn ms(v: f64) -> String {
    if v < 1.0 {
        format!("{v:.2}")
    } else if v < 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

/// A local time for tables: `2025-11-29 23:19:34`.
pub fn local_time(t: DateTime<Utc>) -> String {
    t.with_timezone(&chrono::Local)
        .format("%Y-%m-%d %H:%M:%S")
        .to_string()
}

/// Renders rows as a left-aligned table with a header line; columns are
/// separated by two spaces and padded to their widest cell (in chars).
/// Columns whose header starts with `>` are right-aligned (the `>` is dropped).
/// Cells hold names a guest or a tenant chose (file names, labels,
/// reasons): their control characters are escaped (one row per item, no
/// terminal escapes).
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            r.iter()
                .map(|c| strata_core::text::escape(c).into_owned())
                .collect()
        })
        .collect();
    let rows = &rows;
    let right: Vec<bool> = headers.iter().map(|h| h.starts_with('>')).collect();
    let heads: Vec<&str> = headers.iter().map(|h| h.trim_start_matches('>')).collect();
    let mut widths: Vec<usize> = heads.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut s = String::new();
        for (i, cell) in cells.enumerate() {
            let w = widths.get(i).copied().unwrap_or(0);
            let pad = w.saturating_sub(cell.chars().count());
            if i > 0 {
                s.push_str("  ");
            }
            if right.get(i).copied().unwrap_or(false) {
                s.push_str(&" ".repeat(pad));
                s.push_str(cell);
            } else {
                s.push_str(cell);
                s.push_str(&" ".repeat(pad));
            }
        }
        s.truncate(s.trim_end().len());
        s.push('\n');
        s
    };
    let mut out = line(&mut heads.iter().copied());
    for row in rows {
        out.push_str(&line(&mut row.iter().map(String::as_str)));
    }
    out
}

/// [`table`] with one row per item of `list`, made by `row`.
pub fn table_of<T>(headers: &[&str], list: &[T], row: impl FnMut(&T) -> Vec<String>) -> String {
    let rows: Vec<Vec<String>> = list.iter().map(row).collect();
    table(headers, &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_like_the_daemon() {
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(
            parse_duration("7d").unwrap(),
            Duration::from_secs(7 * 86400)
        );
        assert_eq!(parse_duration(" 90s ").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        for bad in [
            "",
            "10",
            "m",
            "10x",
            "-5m",
            "1.5h",
            "10 m",
            "9999999999999s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should not parse");
        }
        assert!(parse_duration("10x")
            .unwrap_err()
            .to_string()
            .contains("10m"));
        assert_eq!(duration_arg(" 10m").unwrap(), "10m");
        assert!(duration_arg("ten minutes").is_err());
    }

    #[test]
    fn sizes_are_binary_units() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1024), "1.0 KiB");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(256 << 20), "256.0 MiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
        assert_eq!(bytes(u64::MAX), "16.0 EiB");
    }

    #[test]
    fn ages_and_short_durations() {
        let now = Utc::now();
        let s = chrono::TimeDelta::seconds;
        assert_eq!(age(now, now), "just now");
        assert_eq!(age(now - s(12), now), "12s ago");
        assert_eq!(age(now - s(600), now), "10m ago");
        assert_eq!(age(now - s(3600 * 3 + 1200), now), "3h20m ago");
        assert_eq!(age(now - s(7200), now), "2h ago");
        assert_eq!(age(now - s(86400 * 2 + 3600 * 4), now), "2d4h ago");
        assert_eq!(age(now + s(5), now), "in 5s");
        assert_eq!(duration_short(Duration::from_millis(850)), "850ms");
        assert_eq!(duration_short(Duration::from_secs(86400)), "1d");
    }

    #[test]
    fn milliseconds_precision() {
        assert_eq!(ms(0.4231), "0.42");
        assert_eq!(ms(14.83), "14.8");
        assert_eq!(ms(1234.4), "1234");
    }

    #[test]
    fn tables_align_columns() {
        let t = table(
            &["ID", ">SIZE", "STATE"],
            &[
                vec!["sb-1".into(), "1.0 KiB".into(), "running".into()],
                vec!["sb-long-id".into(), "5 B".into(), "".into()],
            ],
        );
        assert_eq!(
            t,
            "ID             SIZE  STATE\n\
             sb-1        1.0 KiB  running\n\
             sb-long-id      5 B\n"
        );
        assert_eq!(table(&["A"], &[]), "A\n");
    }
}
