//! What each live VM uses right now, read from the host without asking the
//! guest: cumulative CPU time, guest RAM resident on the host, QEMU's whole
//! resident set, and the root disk's allocated bytes. The daemon's sampler
//! (`stratad::service::sampler`) turns these counters into a time series.
//!
//! Every read is O(1) in the guest's size except one `smaps` walk per VM
//! every [`SMAPS_EVERY`] calls (it walks the guest RAM's page tables: ~3 ms
//! for 512 MiB here), which calibrates the cheap `/proc/<pid>/status`
//! counters in between.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use strata_core::SandboxId;

use super::Runtime;
use crate::meta::files;

/// A full `smaps` walk per VM once every this many [`Runtime::usage`] calls.
pub const SMAPS_EVERY: u32 = 60;

/// Where a VM's CPU time was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuSource {
    /// The VM's cgroup (`cpu.stat usage_usec` under v2, `cpuacct.usage` under v1).
    Cgroup,
    /// `/proc/<pid>/stat` `utime + stime` of the QEMU process (all its threads).
    Proc,
}

/// What one live VM uses, as counters read at one instant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmUsage {
    /// The sandbox.
    pub id: SandboxId,
    /// Its QEMU process (a new pid means the counters restarted).
    pub pid: u32,
    /// CPU time the VM has used since its process started, in µs.
    pub cpu_usec: u64,
    /// Where `cpu_usec` came from.
    pub cpu_source: CpuSource,
    /// vCPUs it runs with.
    pub vcpus: u32,
    /// Whether its vCPUs run (false: paused, or stopped for a snapshot).
    pub running: bool,
    /// Guest RAM size, in bytes.
    pub mem_total_bytes: u64,
    /// Guest RAM resident on the host (pages the guest has touched), in bytes.
    pub mem_used_bytes: u64,
    /// QEMU's whole resident set (guest RAM + its own), in bytes.
    pub host_rss_bytes: u64,
    /// Bytes allocated to the root disk file (what the guest wrote, shared
    /// extents included), in bytes.
    pub disk_used_bytes: u64,
    /// Size of the root disk, in bytes.
    pub disk_total_bytes: u64,
    /// Calls in flight on its agent connection (exec, files, egress and
    /// port tunnels; [`strata_proto::client::AgentClient::open_calls`]);
    /// a connection being set up or replaced counts as one.
    #[serde(default)]
    pub open_calls: u32,
}

/// Calls in flight on a VM's agent connection; one while the connection
/// is being set up or replaced (its lock is held).
fn open_calls_of(live: &super::vms::Live) -> u32 {
    match live.agent.try_lock() {
        Ok(g) => g
            .as_ref()
            .map_or(0, |a| u32::try_from(a.open_calls()).unwrap_or(u32::MAX)),
        Err(_) => 1,
    }
}

/// What one live VM's root disk was written since its QEMU process
/// started ([`Runtime::disk_writes`]): a new `pid` means the counters
/// restarted (a restore, a wake), so they compare only within one pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskWrites {
    /// The QEMU process the counters are of.
    pub pid: u32,
    /// Its root disk's write counters.
    pub writes: strata_vmm::BlockWrites,
}

/// Per QEMU pid: file-backed resident bytes that are not guest RAM
/// (binaries, libraries), and how many calls ago that was measured.
static NOT_GUEST: Mutex<Option<HashMap<u32, (u64, u32)>>> = Mutex::new(None);

/// `VmRSS`, `RssFile + RssShmem` of `/proc/<pid>/status`, in bytes.
fn status_rss(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|r| r.split_whitespace().next()?.parse::<u64>().ok())
            .map(|v| v * 1024)
    };
    Some((
        kb("VmRSS")?,
        kb("RssFile").unwrap_or(0) + kb("RssShmem").unwrap_or(0),
    ))
}

/// `utime + stime` of `/proc/<pid>/stat`, in µs.
pub fn proc_cpu_usec(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat_ticks(&text).map(|t| t.saturating_mul(1_000_000) / clock_ticks())
}

/// `utime + stime` (fields 14 and 15) of a `/proc/<pid>/stat` line, in
/// clock ticks. The command name (field 2) may hold spaces and parentheses:
/// fields are counted after its last `)`.
fn parse_stat_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    // After ")": field 3 (state) is the first; utime is field 14.
    let utime: u64 = f.nth(11)?.parse().ok()?;
    let stime: u64 = f.next()?.parse().ok()?;
    Some(utime + stime)
}

fn clock_ticks() -> u64 {
    // SAFETY: sysconf only reads a configuration value.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

/// CPU time of a cgroup directory, in µs: `cpu.stat usage_usec` (v2) or
/// `cpuacct.usage` (v1 with `cpu,cpuacct` mounted together; nanoseconds).
fn cgroup_cpu_usec(dir: &Path) -> Option<u64> {
    if let Ok(text) = std::fs::read_to_string(dir.join("cpu.stat")) {
        if let Some(v) = text
            .lines()
            .find_map(|l| l.strip_prefix("usage_usec "))
            .and_then(|v| v.trim().parse().ok())
        {
            return Some(v);
        }
    }
    let ns: u64 = std::fs::read_to_string(dir.join("cpuacct.usage"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(ns / 1000)
}

impl Runtime {
    /// Calls in flight on sandbox `id`'s agent connection
    /// ([`VmUsage::open_calls`]); `None`: no live VM.
    pub fn open_calls(&self, id: &SandboxId) -> Option<u32> {
        let live = {
            let vms = self.vms.lock().unwrap_or_else(|p| p.into_inner());
            vms.get(id).cloned()
        }?;
        Some(open_calls_of(&live))
    }

    /// What every live VM of this runtime uses now. A VM whose process
    /// vanished between the table and the read is left out.
    pub fn usage(&self) -> Vec<VmUsage> {
        let lives: Vec<_> = {
            let vms = self.vms.lock().unwrap_or_else(|p| p.into_inner());
            vms.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        let mut cache = NOT_GUEST.lock().unwrap_or_else(|p| p.into_inner());
        let cache = cache.get_or_insert_with(HashMap::new);
        let pids: std::collections::HashSet<u32> = lives.iter().map(|(_, l)| l.vm.pid()).collect();
        // Forget VMs that are gone; bounded by the live table.
        cache.retain(|pid, _| pids.contains(pid));
        let mut out = Vec::with_capacity(lives.len());
        for (id, live) in lives {
            let pid = live.vm.pid();
            let Some((rss, file_rss)) = status_rss(pid) else {
                continue;
            };
            let cgroup = live
                .vm
                .confinement()
                .cgroup_dirs
                .first()
                .and_then(|d| cgroup_cpu_usec(d));
            let (cpu_usec, cpu_source) = match cgroup {
                Some(u) => (u, CpuSource::Cgroup),
                None => match proc_cpu_usec(pid) {
                    Some(u) => (u, CpuSource::Proc),
                    None => continue,
                },
            };
            let mem_total = u64::from(live.size.memory_mib) << 20;
            let entry = cache.entry(pid).or_insert((0, SMAPS_EVERY));
            if entry.1 >= SMAPS_EVERY {
                if let Ok(info) = live.vm.rss_bytes() {
                    let (_, file_now) = status_rss(pid).unwrap_or((rss, file_rss));
                    *entry = (file_now.saturating_sub(info.guest_ram), 0);
                }
            }
            entry.1 += 1;
            let mem_used = file_rss.saturating_sub(entry.0).min(mem_total);
            let disk = self.sandbox_dir(&id).join(files::DISK);
            let (disk_used, disk_total) = std::fs::metadata(&disk)
                .map(|m| {
                    use std::os::unix::fs::MetadataExt;
                    (m.blocks() * 512, m.len())
                })
                .unwrap_or((0, 0));
            out.push(VmUsage {
                id,
                pid,
                cpu_usec,
                cpu_source,
                vcpus: live.size.vcpus,
                running: live.running.load(std::sync::atomic::Ordering::SeqCst),
                mem_total_bytes: mem_total,
                mem_used_bytes: mem_used,
                host_rss_bytes: rss,
                disk_used_bytes: disk_used.min(disk_total),
                disk_total_bytes: disk_total,
                open_calls: open_calls_of(&live),
            });
        }
        out
    }
}

impl Runtime {
    /// The root disk's write counters of sandbox `id`'s VM (one QMP
    /// `query-blockstats`), with the pid they belong to.
    pub async fn disk_writes(&self, id: &SandboxId) -> super::Result<DiskWrites> {
        let live = self.live(id)?;
        let writes = live
            .vm
            .block_writes()
            .await
            .map_err(|e| crate::error::vmm_err(id.as_str(), e))?;
        Ok(DiskWrites {
            pid: live.vm.pid(),
            writes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_ticks_after_the_command_name() {
        // A command name with a space and a parenthesis.
        let line =
            "1234 (qemu) sys) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 5 0 100 0 0";
        assert_eq!(parse_stat_ticks(line), Some(325));
        assert_eq!(parse_stat_ticks("garbage"), None);
    }

    #[test]
    fn own_process_counters() {
        // Burn a little CPU so the counter is not zero.
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(50) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        assert!(x > 0);
        let me = std::process::id();
        assert!(proc_cpu_usec(me).unwrap() >= 10_000);
        let (rss, _) = status_rss(me).unwrap();
        assert!(rss > 0);
    }
}
