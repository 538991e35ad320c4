//! Samples and their percentiles.
//!
//! Percentiles are nearest-rank: p-th percentile of n sorted samples is the
//! sample at rank ⌈p·n⌉ (1-based). With n < 100 the p99 is the maximum, and the
//! report always prints `n` next to it so nobody reads more into a tail than
//! the samples carry.

use std::time::Duration;

use serde::Serialize;

/// Latency samples in milliseconds (or any other unit the caller names).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Samples(pub Vec<f64>);

impl Samples {
    /// No samples yet.
    pub fn new() -> Self {
        Samples(Vec::new())
    }

    /// Adds one value.
    pub fn push(&mut self, v: f64) {
        self.0.push(v);
    }

    /// Adds one duration, in milliseconds.
    pub fn push_dur(&mut self, d: Duration) {
        self.0.push(d.as_secs_f64() * 1000.0);
    }

    /// How many values.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// No values at all.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The values, sorted ascending.
    pub fn sorted(&self) -> Vec<f64> {
        let mut v: Vec<f64> = self.0.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        v
    }

    /// p50/p95/p99/max/mean of the values.
    pub fn summary(&self) -> Summary {
        Summary::of(&self.0)
    }
}

impl From<Vec<f64>> for Samples {
    fn from(v: Vec<f64>) -> Self {
        Samples(v)
    }
}

/// Nearest-rank percentile `p` (0..=100) of ascending `sorted` values; NaN when empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The figures the report prints for a set of samples.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// Minimum.
    pub min: f64,
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Maximum.
    pub max: f64,
    /// Arithmetic mean.
    pub mean: f64,
}

impl Summary {
    /// Summary of `values` (non-finite values are ignored).
    pub fn of(values: &[f64]) -> Summary {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        let mean = if v.is_empty() {
            f64::NAN
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        };
        Summary {
            n: v.len(),
            min: v.first().copied().unwrap_or(f64::NAN),
            p50: percentile(&v, 50.0),
            p95: percentile(&v, 95.0),
            p99: percentile(&v, 99.0),
            max: v.last().copied().unwrap_or(f64::NAN),
            mean,
        }
    }
}

/// A number for a table cell: 3 significant figures-ish, `–` for NaN.
pub fn fmt_num(v: f64) -> String {
    if !v.is_finite() {
        return "–".into();
    }
    let a = v.abs();
    if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// Milliseconds for humans: `734 µs`, `12.4 ms`, `1.32 s`.
pub fn fmt_ms(ms: f64) -> String {
    if !ms.is_finite() {
        "–".into()
    } else if ms < 1.0 {
        format!("{:.0} µs", ms * 1000.0)
    } else if ms < 1000.0 {
        format!("{} ms", fmt_num(ms))
    } else {
        format!("{:.2} s", ms / 1000.0)
    }
}

/// Bytes for humans (binary units).
pub fn fmt_bytes(b: f64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    if !b.is_finite() {
        return "–".into();
    }
    let mut v = b;
    let mut i = 0;
    while v.abs() >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{v:.0} B")
    } else {
        format!("{} {}", fmt_num(v), U[i])
    }
}

/// `a / b` as `12.3×`, `–` when either is missing.
pub fn fmt_ratio(a: f64, b: f64) -> String {
    if !a.is_finite() || !b.is_finite() || b == 0.0 {
        "–".into()
    } else {
        format!("{}×", fmt_num(a / b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 95.0), 95.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        let small = [3.0, 1.0, 2.0];
        let s = Summary::of(&small);
        assert_eq!((s.n, s.p50, s.p99, s.max, s.min), (3, 2.0, 3.0, 3.0, 1.0));
        assert!(Summary::of(&[]).p50.is_nan());
        assert!(Summary::of(&[f64::NAN, 1.0]).n == 1);
    }

    #[test]
    fn formatting() {
        assert_eq!(fmt_ms(0.5), "500 µs");
        assert_eq!(fmt_ms(12.345), "12.35 ms");
        assert_eq!(fmt_ms(1500.0), "1.50 s");
        assert_eq!(fmt_bytes(1536.0), "1.50 KiB");
        assert_eq!(fmt_ratio(10.0, 2.0), "5.00×");
        assert_eq!(fmt_ratio(1.0, 0.0), "–");
    }
}
