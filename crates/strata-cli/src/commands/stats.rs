//! `strata stats`: latency percentiles of the daemon (`GET /v1/stats`);
//! `strata stats ID`: one sandbox's usage, its latest sample and a short
//! history (`GET /v1/sandboxes/{id}/metrics`).

use serde::Deserialize;

use super::Ctx;
use crate::human;
use crate::views::{view, Stats, Summary};

/// `strata stats [ID]`
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A sandbox: show its CPU, memory and disk use instead of the daemon's latencies.
    pub id: Option<String>,
    /// Samples of history to show with ID.
    #[arg(long, default_value_t = 12)]
    pub last: usize,
}

/// Runs `strata stats`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    if let Some(id) = &a.id {
        let v = ctx
            .client()?
            .get(&["v1", "sandboxes", id, "metrics"], &[])
            .await?;
        ctx.emit(&v, || Ok(render_usage(&view(&v)?, a.last)))?;
        return Ok(0);
    }
    let v = ctx.client()?.get(&["v1", "stats"], &[]).await?;
    ctx.emit(&v, || Ok(render(&view(&v)?)))?;
    Ok(0)
}

/// One sample of `GET /v1/sandboxes/{id}/metrics`.
#[derive(Debug, Clone, Deserialize)]
pub struct UsageSample {
    /// When.
    pub at: chrono::DateTime<chrono::Utc>,
    /// CPU in percent of the sandbox's vCPUs.
    pub cpu_pct: f64,
    /// vCPUs.
    pub cpu_count: u32,
    /// Guest RAM resident on the host.
    pub mem_used_bytes: u64,
    /// Guest RAM.
    pub mem_total_bytes: u64,
    /// QEMU's resident set.
    #[serde(default)]
    pub host_rss_bytes: u64,
    /// Root disk allocated.
    pub disk_used_bytes: u64,
    /// Root disk size.
    pub disk_total_bytes: u64,
}

/// `GET /v1/sandboxes/{id}/metrics`.
#[derive(Debug, Clone, Deserialize)]
pub struct Usage {
    /// The sandbox.
    pub sandbox: String,
    /// Seconds between samples.
    pub interval_s: u64,
    /// Samples, oldest first.
    pub samples: Vec<UsageSample>,
    /// Seconds `recent` covers.
    #[serde(default)]
    pub recent_window_s: u64,
    /// Mean and peak over the last `recent_window_s`.
    #[serde(default)]
    pub recent: Option<Recent>,
}

/// `GET /v1/sandboxes/{id}/metrics` `recent`.
#[derive(Debug, Clone, Deserialize)]
pub struct Recent {
    /// Mean CPU, percent of its vCPUs.
    pub cpu_pct_avg: f64,
    /// Peak CPU, percent of its vCPUs.
    pub cpu_pct_peak: f64,
    /// Peak CPU, cores.
    pub cpu_cores_peak: f64,
    /// Peak QEMU resident set.
    pub host_rss_peak_bytes: u64,
}

impl Usage {
    /// "cpu 2.1 % mean, 4.0 % peak (0.04 cores) over 60 s; QEMU resident ≤ 90 MiB".
    pub fn describe_recent(&self) -> Option<String> {
        let r = self.recent.as_ref()?;
        Some(format!(
            "cpu {:.1} % mean, {:.1} % peak ({:.2} cores) over {} s; resident up to {}",
            r.cpu_pct_avg,
            r.cpu_pct_peak,
            r.cpu_cores_peak,
            self.recent_window_s,
            human::bytes(r.host_rss_peak_bytes)
        ))
    }
}

/// The human report of one sandbox's usage: the latest sample, then the
/// last `last` samples, newest last.
pub fn render_usage(u: &Usage, last: usize) -> String {
    let Some(s) = u.samples.last() else {
        return format!(
            "{}: no samples yet (the daemon samples every {}s; a sandbox needs two samples, and a running VM)\n",
            u.sandbox, u.interval_s
        );
    };
    let mut out = format!(
        "{}: cpu {:.1}% of {} vCPU{}, memory {} / {}, disk {} / {} (QEMU resident {}), at {}\n\n",
        u.sandbox,
        s.cpu_pct,
        s.cpu_count,
        if s.cpu_count == 1 { "" } else { "s" },
        human::bytes(s.mem_used_bytes),
        human::bytes(s.mem_total_bytes),
        human::bytes(s.disk_used_bytes),
        human::bytes(s.disk_total_bytes),
        human::bytes(s.host_rss_bytes),
        human::local_time(s.at),
    );
    if let Some(r) = u.describe_recent() {
        out.push_str(&format!("recent: {r}\n\n"));
    }
    let from = u.samples.len().saturating_sub(last.max(1));
    let rows: Vec<Vec<String>> = u.samples[from..]
        .iter()
        .map(|s| {
            vec![
                human::local_time(s.at),
                format!("{:.1}", s.cpu_pct),
                human::bytes(s.mem_used_bytes),
                human::bytes(s.disk_used_bytes),
            ]
        })
        .collect();
    out.push_str(&human::table(
        &["TIME", ">CPU %", ">MEMORY", ">DISK"],
        &rows,
    ));
    out
}

fn rows(m: &std::collections::BTreeMap<String, Summary>) -> Vec<Vec<String>> {
    m.iter()
        .map(|(k, s)| {
            vec![
                k.clone(),
                s.count.to_string(),
                human::ms(s.p50_ms),
                human::ms(s.p95_ms),
                human::ms(s.p99_ms),
                human::ms(s.max_ms),
            ]
        })
        .collect()
}

/// The host's lines of `strata stats` (an operator's token).
pub fn render_host(h: &crate::views::HostStats) -> String {
    let mut out = String::new();
    if let Some(p) = &h.latest {
        let pct = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.0} %"));
        out.push_str(&format!(
            "host: cpu {:.2} of {} cores busy ({:.2} by {} VMs), memory {} available of {}, pressure cpu {} memory {}\n",
            p.cpu_busy_cores,
            p.cpus,
            p.vm_cores,
            p.vms,
            human::bytes(p.mem_available_bytes),
            human::bytes(p.mem_total_bytes),
            pct(p.cpu_pressure_pct),
            pct(p.mem_pressure_pct),
        ));
    }
    if let Some(p) = &h.pool {
        out.push_str(&format!(
            "pool: {} used of {}, {} available\n",
            human::bytes(p.used_bytes),
            human::bytes(p.size_bytes),
            human::bytes(p.available_bytes),
        ));
    }
    if let Some(b) = &h.budget {
        out.push_str(&format!(
            "admission ({}): {:.2} of {:.2} cores counted (sandboxes at their recent peak together {:.2}, other load {:.2} of {:.2}), {} VMs\n",
            h.admission,
            b.cpu_demand_cores,
            b.cpu_budget_cores,
            b.sandbox_cores,
            b.other_counted_cores,
            b.other_cores,
            b.vms
        ));
    }
    if let Some(p) = &h.pressure {
        out.push_str(&format!(
            "pressure: {}; {} hibernated for pressure\n",
            if p.active {
                format!("acting ({})", p.over.join(", "))
            } else if p.over.is_empty() {
                "none".to_owned()
            } else {
                format!("rising ({})", p.over.join(", "))
            },
            p.hibernated
        ));
    }
    if !out.is_empty() {
        out.push('\n');
    }
    out
}

/// The human report.
pub fn render(s: &Stats) -> String {
    let head = ["", ">COUNT", ">P50 MS", ">P95 MS", ">P99 MS", ">MAX MS"];
    let mut out = String::new();
    let states: Vec<String> = s
        .sandboxes
        .iter()
        .map(|(k, n)| format!("{n} {k}"))
        .collect();
    out.push_str(&format!(
        "sandboxes: {}; snapshots: {}\n\n",
        if states.is_empty() {
            "none".into()
        } else {
            states.join(", ")
        },
        s.snapshots
    ));
    if let Some(h) = &s.host {
        out.push_str(&render_host(h));
    }
    if !s.warm_pools.is_empty() {
        let pools: Vec<String> = s
            .warm_pools
            .iter()
            .map(|p| {
                format!(
                    "{} ({} vCPU, {} MiB): {} ready",
                    p.template, p.vcpus, p.memory_mib, p.ready
                )
            })
            .collect();
        out.push_str(&format!("warm pools: {}\n\n", pools.join("; ")));
    }
    for (title, m) in [("API OPERATION", &s.api), ("VM STEP", &s.steps)] {
        if m.is_empty() {
            out.push_str(&format!("{title}: no observations yet\n\n"));
            continue;
        }
        let mut h = head;
        h[0] = title;
        out.push_str(&human::table(&h, &rows(m)));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renders_a_sandbox_usage() {
        let sample = |cpu: f64, at: &str| {
            json!({"at": at, "cpu_pct": cpu, "cpu_count": 1, "mem_used_bytes": 104857600u64,
                   "mem_total_bytes": 268435456u64, "host_rss_bytes": 1, "disk_used_bytes": 1073741824u64,
                   "disk_total_bytes": 2147483648u64, "running": true})
        };
        let u: Usage = view(&json!({"sandbox": "sb-1", "interval_s": 5, "window_s": 3600,
            "samples": [sample(3.0, "2026-12-01T10:00:00Z"), sample(97.5, "2026-12-01T10:00:05Z")]}))
        .unwrap();
        let r = render_usage(&u, 1);
        assert!(r.starts_with("sb-1: cpu 97.5% of 1 vCPU, memory "), "{r}");
        assert!(
            r.contains("97.5") && !r.contains(" 3.0"),
            "only the last sample: {r}"
        );
        let empty: Usage =
            view(&json!({"sandbox": "sb-1", "interval_s": 5, "samples": []})).unwrap();
        assert!(render_usage(&empty, 12).contains("no samples yet"));
    }

    /// `strata stats` with an operator's token: the host lines from a
    /// `/v1/stats` `host` as the daemon answers it.
    #[test]
    fn renders_the_host_lines() {
        let s: Stats = view(&json!({
            "sandboxes": {"running": 3}, "snapshots": 1,
            "host": {
                "latest": {"at": "2026-12-01T10:00:00Z", "cpus": 2, "cpu_busy_cores": 1.25,
                           "mem_total_bytes": 8589934592u64, "mem_available_bytes": 4294967296u64,
                           "cpu_pressure_pct": 12.4, "mem_pressure_pct": null,
                           "mem_full_pressure_pct": null, "vm_cores": 0.5, "vms": 3},
                "pool": {"size_bytes": 107374182400u64, "used_bytes": 42949672960u64,
                         "available_bytes": 63350767616u64},
                "admission": "use",
                "budget": {"cores": 2.0, "cpu_budget_cores": 1.5, "cpu_demand_cores": 0.75,
                           "sandbox_cores": 0.5, "other_cores": 0.3, "other_counted_cores": 0.25,
                           "vms": 3},
                "pressure": {"host": {}, "over": ["cpu pressure 70 % >= 60 %"], "streak": 1,
                             "active": false, "hibernated": 4}
            }
        }))
        .unwrap();
        let r = render(&s);
        let lines: Vec<&str> = r.lines().collect();
        assert_eq!(lines[0], "sandboxes: 3 running; snapshots: 1", "{r}");
        assert_eq!(
            lines[2],
            "host: cpu 1.25 of 2 cores busy (0.50 by 3 VMs), memory 4.0 GiB available of 8.0 GiB, pressure cpu 12 % memory -",
            "{r}"
        );
        assert_eq!(
            lines[3], "pool: 40.0 GiB used of 100.0 GiB, 59.0 GiB available",
            "{r}"
        );
        assert_eq!(
            lines[4],
            "admission (use): 0.75 of 1.50 cores counted (sandboxes at their recent peak together 0.50, other load 0.25 of 0.30), 3 VMs",
            "{r}"
        );
        assert_eq!(
            lines[5], "pressure: rising (cpu pressure 70 % >= 60 %); 4 hibernated for pressure",
            "{r}"
        );
        // Acting, and an older daemon without `pool`: no pool line.
        let h: crate::views::HostStats = view(&json!({
            "latest": {"cpus": 2}, "admission": "use",
            "pressure": {"over": ["1 MiB available < 800 MiB kept free"], "active": true, "hibernated": 0}
        }))
        .unwrap();
        let r = render_host(&h);
        assert!(!r.contains("pool:"), "{r}");
        assert!(
            r.contains("pressure: acting (1 MiB available < 800 MiB kept free); 0 hibernated"),
            "{r}"
        );
        // A tenant's token: no host lines at all.
        let t: Stats = view(&json!({"sandboxes": {}, "snapshots": 0})).unwrap();
        assert!(!render(&t).contains("host:"), "{}", render(&t));
    }

    /// `strata info`'s usage row: the `recent` summary of
    /// `/v1/sandboxes/{id}/metrics`; none without it.
    #[test]
    fn describes_recent_use_for_info() {
        let u: Usage = view(&json!({"sandbox": "sb-1", "interval_s": 5, "window_s": 3600,
            "samples": [], "recent_window_s": 60,
            "recent": {"samples": 12, "cpu_pct_avg": 2.13, "cpu_pct_peak": 4.0,
                       "cpu_cores_peak": 0.04, "mem_used_peak_bytes": 1, "host_rss_peak_bytes": 94371840u64,
                       "disk_used_bytes": 1}}))
        .unwrap();
        assert_eq!(
            u.describe_recent().as_deref(),
            Some("cpu 2.1 % mean, 4.0 % peak (0.04 cores) over 60 s; resident up to 90.0 MiB")
        );
        let none: Usage =
            view(&json!({"sandbox": "sb-1", "interval_s": 5, "samples": []})).unwrap();
        assert_eq!(none.describe_recent(), None);
    }

    #[test]
    fn renders_both_tables() {
        let s: Stats = view(&json!({
            "api": {"POST /v1/sandboxes": {"count": 3, "p50_ms": 210.0, "p95_ms": 376.2, "p99_ms": 376.2, "max_ms": 376.2}},
            "steps": {"snapshot_pause": {"count": 10, "p50_ms": 14.2, "p95_ms": 19.0, "p99_ms": 19.0, "max_ms": 19.0}},
            "sandboxes": {"running": 2},
            "snapshots": 10
        }))
        .unwrap();
        let r = render(&s);
        assert!(r.starts_with("sandboxes: 2 running; snapshots: 10"), "{r}");
        assert!(!r.contains("warm pools"), "{r}");
        let w: Stats = view(&json!({
            "sandboxes": {}, "snapshots": 0,
            "warm_pools": [{"template": "tpl-default", "vcpus": 1, "memory_mib": 256, "ready": 2}]
        }))
        .unwrap();
        assert!(
            render(&w).contains("warm pools: tpl-default (1 vCPU, 256 MiB): 2 ready"),
            "{}",
            render(&w)
        );
        assert!(
            r.contains("POST /v1/sandboxes      3     210     376"),
            "{r}"
        );
        assert!(r.contains("snapshot_pause     10    14.2    19.0"), "{r}");
    }
}
