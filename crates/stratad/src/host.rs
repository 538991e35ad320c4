//! What the host has and uses: CPU busy time (`/proc/stat`), memory
//! (`/proc/meminfo`), pressure stall information (`/proc/pressure/*`),
//! and the storage pool's space ([`PoolSpace`], from the engine).
//!
//! One [`HostReader`] turns two readings into rates: CPU busy in cores over
//! the time between them, and the share of that time some (or all) tasks
//! stalled on CPU or memory — from PSI's cumulative `total` counters, so a
//! rate covers exactly the interval asked about instead of the kernel's
//! 10-second average, which lags a sudden load by seconds.
//!
//! The parsers are pure (tested on text); a host without PSI (kernels
//! before 4.20, or `psi=0`) reports no pressure, and admission and the
//! pressure monitor then go by CPU and memory use alone.

use std::time::Instant;

use serde::{Deserialize, Serialize};

/// Cumulative counters read at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    /// Jiffies the CPUs spent busy (everything but idle and iowait).
    pub busy_jiffies: u64,
    /// All jiffies of all CPUs.
    pub total_jiffies: u64,
    /// PSI `some` stall time on CPU, µs (`None`: no PSI).
    pub cpu_some_us: Option<u64>,
    /// PSI `some` stall time on memory, µs.
    pub mem_some_us: Option<u64>,
    /// PSI `full` stall time on memory, µs.
    pub mem_full_us: Option<u64>,
}

/// The host over the interval between two readings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HostSample {
    /// When it was taken (end of the interval).
    pub at: chrono::DateTime<chrono::Utc>,
    /// Online CPUs.
    pub cpus: u32,
    /// CPU busy over the interval, in cores (0..=cpus): everything on the
    /// host, sandboxes and the rest.
    pub cpu_busy_cores: f64,
    /// `MemTotal`, bytes.
    pub mem_total_bytes: u64,
    /// `MemAvailable` (free plus what the kernel can reclaim), bytes.
    pub mem_available_bytes: u64,
    /// Share of the interval at least one task waited for a CPU, percent
    /// (`None`: the kernel has no PSI).
    pub cpu_pressure_pct: Option<f64>,
    /// Share of the interval at least one task stalled on memory, percent.
    pub mem_pressure_pct: Option<f64>,
    /// Share of the interval all non-idle tasks stalled on memory, percent.
    pub mem_full_pressure_pct: Option<f64>,
}

/// The storage pool's space, from `statvfs` on its root
/// ([`strata_storage::Pool::usage`]): what `/metrics`
/// (`strata_host_pool_bytes`), `/v1/stats` `host.pool` and `strata stats`
/// show per host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolSpace {
    /// Size of the pool's file system, bytes.
    pub size_bytes: u64,
    /// Bytes in use (data and metadata, as btrfs reports them to statfs).
    pub used_bytes: u64,
    /// Bytes still available for new data; the space reserve never counts
    /// (see [`strata_storage::Pool::usage`]).
    pub available_bytes: u64,
}

impl From<strata_storage::PoolUsage> for PoolSpace {
    fn from(u: strata_storage::PoolUsage) -> Self {
        PoolSpace {
            size_bytes: u.total_bytes,
            used_bytes: u.used_bytes,
            available_bytes: u.free_bytes,
        }
    }
}

/// `(busy, total)` jiffies of the aggregate `cpu` line of `/proc/stat`.
pub fn parse_stat(text: &str) -> Option<(u64, u64)> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal [guest guest_nice]:
    // guest time is already inside user, so only the first eight count.
    if v.len() < 4 {
        return None;
    }
    let total: u64 = v.iter().take(8).sum();
    let idle = v[3] + v.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

/// Online CPUs: the `cpuN` lines of `/proc/stat`.
pub fn parse_cpus(text: &str) -> u32 {
    let n = text
        .lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .count();
    u32::try_from(n).unwrap_or(u32::MAX).max(1)
}

/// A `/proc/meminfo` field, bytes.
pub fn meminfo_field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace()
            .next()?
            .parse::<u64>()
            .ok()
            .map(|kb| kb.saturating_mul(1024))
    })
}

/// The cumulative `total=` of the `some` or `full` line of a PSI file, µs.
pub fn parse_psi_total(text: &str, kind: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(kind))?;
    line.split_whitespace()
        .find_map(|f| f.strip_prefix("total="))
        .and_then(|v| v.parse().ok())
}

/// Reads the host's counters and turns successive readings into
/// [`HostSample`]s.
#[derive(Debug, Default)]
pub struct HostReader {
    prev: Option<(Instant, Counters)>,
}

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

impl HostReader {
    /// A reader with no baseline.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads the counters now; `None` when `/proc/stat` cannot be read.
    pub fn counters() -> Option<(Counters, u32, u64, u64)> {
        let stat = read("/proc/stat")?;
        let (busy, total) = parse_stat(&stat)?;
        let cpus = parse_cpus(&stat);
        let mem = read("/proc/meminfo").unwrap_or_default();
        let psi_cpu = read("/proc/pressure/cpu");
        let psi_mem = read("/proc/pressure/memory");
        Some((
            Counters {
                busy_jiffies: busy,
                total_jiffies: total,
                cpu_some_us: psi_cpu.as_deref().and_then(|t| parse_psi_total(t, "some")),
                mem_some_us: psi_mem.as_deref().and_then(|t| parse_psi_total(t, "some")),
                mem_full_us: psi_mem.as_deref().and_then(|t| parse_psi_total(t, "full")),
            },
            cpus,
            meminfo_field(&mem, "MemTotal").unwrap_or(0),
            meminfo_field(&mem, "MemAvailable").unwrap_or(0),
        ))
    }

    /// A sample over the time since the previous call (`None` on the first
    /// call, which only sets the baseline, or when `/proc` cannot be read).
    pub fn sample(&mut self, at: chrono::DateTime<chrono::Utc>) -> Option<HostSample> {
        self.sample_over(at).map(|(s, _)| s)
    }

    /// [`HostReader::sample`] with the time it covers.
    pub fn sample_over(
        &mut self,
        at: chrono::DateTime<chrono::Utc>,
    ) -> Option<(HostSample, std::time::Duration)> {
        let (now, cpus, mem_total, mem_avail) = Self::counters()?;
        let mono = Instant::now();
        let out = self
            .prev
            .map(|(t, prev)| (prev, mono.saturating_duration_since(t)))
            .and_then(|(prev, dt)| rates(&prev, &now, dt, cpus).map(|r| (r, dt)))
            .map(|((busy, cpu_p, mem_p, mem_f), dt)| {
                (
                    HostSample {
                        at,
                        cpus,
                        cpu_busy_cores: busy,
                        mem_total_bytes: mem_total,
                        mem_available_bytes: mem_avail,
                        cpu_pressure_pct: cpu_p,
                        mem_pressure_pct: mem_p,
                        mem_full_pressure_pct: mem_f,
                    },
                    dt,
                )
            });
        self.prev = Some((mono, now));
        out
    }
}

/// CPU busy cores, then the CPU `some`, memory `some` and memory `full`
/// pressure percentages.
pub type Rates = (f64, Option<f64>, Option<f64>, Option<f64>);

/// [`Rates`] between two readings `dt` apart; `None` when no time passed.
pub fn rates(prev: &Counters, now: &Counters, dt: std::time::Duration, cpus: u32) -> Option<Rates> {
    let dt_us = dt.as_micros() as f64;
    let dj = now.total_jiffies.saturating_sub(prev.total_jiffies) as f64;
    if dt_us <= 0.0 || dj <= 0.0 {
        return None;
    }
    let busy = now.busy_jiffies.saturating_sub(prev.busy_jiffies) as f64 / dj * f64::from(cpus);
    let pct = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) => Some((b.saturating_sub(a) as f64 * 100.0 / dt_us).clamp(0.0, 100.0)),
        _ => None,
    };
    Some((
        busy.clamp(0.0, f64::from(cpus)),
        pct(prev.cpu_some_us, now.cpu_some_us),
        pct(prev.mem_some_us, now.mem_some_us),
        pct(prev.mem_full_us, now.mem_full_us),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const STAT: &str = "cpu  100 5 50 800 20 3 2 0 40 0\ncpu0 50 2 25 400 10 1 1 0 20 0\ncpu1 50 3 25 400 10 2 1 0 20 0\nintr 1 2 3\n";

    #[test]
    fn stat_busy_excludes_idle_iowait_and_guest() {
        assert_eq!(parse_stat(STAT), Some((160, 980)));
        assert_eq!(parse_cpus(STAT), 2);
        assert_eq!(parse_stat("intr 1\n"), None);
    }

    #[test]
    fn meminfo_and_psi() {
        let m = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   12000000 kB\n";
        assert_eq!(meminfo_field(m, "MemTotal"), Some(24_000_000 * 1024));
        assert_eq!(meminfo_field(m, "MemAvailable"), Some(12_000_000 * 1024));
        assert_eq!(meminfo_field(m, "Mem"), None);
        let psi = "some avg10=35.15 avg60=35.78 avg300=13.54 total=2277714575\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=17\n";
        assert_eq!(parse_psi_total(psi, "some"), Some(2_277_714_575));
        assert_eq!(parse_psi_total(psi, "full"), Some(17));
    }

    #[test]
    fn rates_over_an_interval() {
        let a = Counters {
            busy_jiffies: 100,
            total_jiffies: 1000,
            cpu_some_us: Some(0),
            mem_some_us: Some(0),
            mem_full_us: None,
        };
        // One second; half the jiffies busy on 2 CPUs = 1 core; 250 ms of
        // CPU stall = 25 %.
        let b = Counters {
            busy_jiffies: 200,
            total_jiffies: 1200,
            cpu_some_us: Some(250_000),
            mem_some_us: Some(10_000),
            mem_full_us: None,
        };
        let (busy, cpu, mem, full) = rates(&a, &b, Duration::from_secs(1), 2).unwrap();
        assert!((busy - 1.0).abs() < 1e-9);
        assert_eq!(cpu, Some(25.0));
        assert_eq!(mem, Some(1.0));
        assert_eq!(full, None);
        assert!(rates(&a, &a, Duration::from_secs(1), 2).is_none());
    }

    #[test]
    fn this_host_reads() {
        let mut r = HostReader::new();
        assert!(
            r.sample(chrono::Utc::now()).is_none(),
            "first call: baseline"
        );
        std::thread::sleep(Duration::from_millis(50));
        let s = r.sample(chrono::Utc::now()).expect("/proc is readable");
        assert!(s.cpus >= 1 && s.mem_total_bytes > 0 && s.mem_available_bytes > 0);
        assert!(s.cpu_busy_cores >= 0.0 && s.cpu_busy_cores <= f64::from(s.cpus));
    }
}
