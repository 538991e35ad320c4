//! VMM drivers for strata: the driver trait and the QEMU microvm driver (process, QMP, accel probe, console).
//!
//! - [`VmmDriver`] starts (cold boot or restore from device state) and adopts VMs;
//!   [`Vm`] is a handle on one running VM. Both are object-safe (`Box<dyn ..>`).
//! - [`QemuDriver`] is the QEMU `microvm` implementation; [`QmpClient`] its QMP client.
//! - A VM's QEMU runs in its own session: it survives the death of the process that
//!   started it, and a later process can [`VmmDriver::adopt`] it from its run dir.
//! - Hardening (see `docs/hardening.md`): QEMU runs under its seccomp filter, switches
//!   to an unprivileged user (`VmSpec::run_as`, `-runas`), lives in a per-VM cgroup
//!   with CPU and memory limits (`VmSpec::limits`, [`cgroup`]), and its run dir (the
//!   agent, QMP and console sockets) is mode 0700, reachable only by the daemon's user.
//!   QEMU joins an empty network namespace (`VmSpec::netns`, [`netns`]) and its disk
//!   may be throttled (`VmSpec::disk_throttle`).

pub mod cgroup;
pub mod cmdline;
pub mod console;
mod error;
pub mod netns;
pub mod probe;
pub mod process;
pub mod qemu;
pub mod qmp;
pub mod spec;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use strata_core::Accel;

pub use cgroup::{Limits, VmCgroup};
pub use error::VmmError;
pub use probe::KvmProbe;
pub use process::{
    default_vm_user, lookup_user, qemus_under, self_rss, RssInfo, UserIds, DEFAULT_VM_USER,
};
pub use qemu::{qemu_in_run_dir, QemuDriver, QemuVm};
pub use qmp::{QmpClient, QmpError, QmpEvent};
pub use spec::{
    DiskFormat, DiskThrottle, FwdProto, GuestFwd, GuestFwdTarget, HostFwd, NetSpec, RamBacking,
    ResolvedAccel, VmSpec, DEFAULT_CONSOLE_LOG_MAX, DEFAULT_QEMU,
};

/// How a VM's process ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmExit {
    /// One-line explanation, fit to mark a sandbox failed with.
    pub reason: String,
    /// Exit code, when QEMU was our child and exited normally.
    pub code: Option<i32>,
    /// Terminating signal, when QEMU was our child and was killed.
    pub signal: Option<i32>,
    /// Whether the exit was asked for through this handle (`shutdown`/`kill`).
    pub expected: bool,
    /// Names of the QMP events seen last (e.g. `SHUTDOWN`, `GUEST_PANICKED`).
    pub events: Vec<String>,
    /// The last lines of `qemu.stderr`.
    pub stderr_tail: String,
    /// The last lines of `console.log`.
    pub console_tail: String,
}

/// How a VM is confined beyond seccomp: its user and its cgroup limits.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Confinement {
    /// The user QEMU was asked to switch to (`VmSpec::run_as`).
    pub run_as: Option<String>,
    /// The limits asked for (`VmSpec::limits`).
    pub limits: Option<Limits>,
    /// Whether QEMU is in its cgroup with those limits written.
    pub limits_applied: bool,
    /// The VM's cgroup directories, when it has any.
    pub cgroup_dirs: Vec<PathBuf>,
    /// Why the limits are not applied, when they were asked for and are not.
    pub error: Option<String>,
}

impl Confinement {
    /// What `spec` asks for, with nothing applied yet.
    pub(crate) fn asked(spec: &VmSpec) -> Self {
        Confinement {
            run_as: spec.run_as.clone(),
            limits: spec.limits,
            ..Confinement::default()
        }
    }
}

/// When the steps of a VM's start ended (for latency breakdowns; see
/// [`Vm::start_timings`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartTimings {
    /// The driver's `start` was called.
    pub called: Instant,
    /// The QEMU process was spawned (fork + exec returned).
    pub spawned: Instant,
    /// QMP answered its handshake (greeting + `qmp_capabilities`).
    pub qmp_ready: Instant,
    /// The handle was assembled (console attached, monitors running).
    pub assembled: Instant,
    /// The device state was loaded (`migrate-incoming` completed), for a
    /// restore.
    pub incoming_done: Option<Instant>,
    /// `cont` was answered: the vCPUs run (unless started paused).
    pub running: Option<Instant>,
}

/// QEMU's run state (`query-status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmStatus {
    /// QEMU's run state name: `running`, `paused`, `postmigrate`, `inmigrate`, ...
    pub status: String,
    /// Whether vCPUs are running.
    pub running: bool,
}

/// The block-layer id of every VM's root disk (`-drive id=disk0`, its
/// virtio device `vda`).
pub const ROOT_DRIVE: &str = "disk0";

/// What a VM's root disk was written since its QEMU process started: the
/// cumulative counters of QMP `query-blockstats` (they restart at zero with
/// every new process: a restore, a wake). Discards count too (`fstrim`
/// changes what the disk holds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockWrites {
    /// Write requests.
    pub wr_operations: u64,
    /// Bytes written.
    pub wr_bytes: u64,
    /// Discard (unmap) requests.
    pub unmap_operations: u64,
    /// Bytes discarded.
    pub unmap_bytes: u64,
}

impl BlockWrites {
    /// The counters of drive `device` (its block-layer id, or its qdev id
    /// such as `vda`) in a `query-blockstats` answer; `None` when the
    /// answer has no such drive or no write counters for it.
    pub fn from_blockstats(answer: &serde_json::Value, device: &str) -> Option<Self> {
        let entry = answer.as_array()?.iter().find(|e| {
            let named = |k: &str| e.get(k).and_then(serde_json::Value::as_str) == Some(device);
            named("device") || named("qdev")
        })?;
        let stats = entry.get("stats")?;
        let n = |k: &str| stats.get(k).and_then(serde_json::Value::as_u64);
        Some(BlockWrites {
            wr_operations: n("wr_operations")?,
            wr_bytes: n("wr_bytes")?,
            // Older QEMUs have no discard counters: zero, as nothing is known.
            unmap_operations: n("unmap_operations").unwrap_or(0),
            unmap_bytes: n("unmap_bytes").unwrap_or(0),
        })
    }
}

/// How device state is written to a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SaveMethod {
    /// The driver opens the file and passes it with `getfd` (`SCM_RIGHTS`), then
    /// `migrate fd:`. No extra process; works under QEMU's seccomp filter.
    #[default]
    Fd,
    /// `migrate exec:cat > file`: QEMU spawns a shell. Needs `seccomp: false`.
    Exec,
    /// No migration: QEMU writes every device's section in its main loop
    /// (`xen-save-devices-state` into a file passed with `add-fd`), and the
    /// driver completes the file into what `migrate` would have written
    /// without the RAM module's sections: this VM's `configuration` (from
    /// its first `migrate` save), the run state `paused`, an empty
    /// description. It loads with `migrate-incoming` like the others; the
    /// VM stays `paused`, not `postmigrate`. Needs an earlier
    /// [`SaveMethod::Fd`] save of the same VM (see
    /// `strata_vmm::qemu::set_direct_save`).
    Direct,
}

/// Figures of one device-state save.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SaveStats {
    /// Bytes written.
    pub bytes: u64,
    /// Wall time from `migrate` to `completed`.
    pub elapsed: Duration,
    /// Method used.
    pub method: SaveMethod,
    /// Where the save's time went, step by step.
    #[serde(default)]
    pub steps: SaveSteps,
}

/// The steps of one device-state save, ms each (wall time; steps that
/// overlap on the QMP socket are timed together). A [`SaveMethod::Direct`]
/// save has one round trip (run-state check, `add-fd`, the save,
/// `remove-fd`), counted in `complete_ms`, and completes the file in
/// `finalize_ms`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SaveSteps {
    /// The run-state check, with the migration capabilities when they
    /// are (re)set on the same round trip.
    pub check_ms: f64,
    /// Handing QEMU the file (`getfd`) and starting `migrate`, until its
    /// reply.
    pub start_ms: f64,
    /// From `migrate`'s reply to the save's end (event or poll).
    pub complete_ms: f64,
    /// Until the VM has left `finish-migrate` (QEMU refuses `cont` before).
    pub finalize_ms: f64,
}

/// A VMM back end (QEMU today, Firecracker later).
#[async_trait::async_trait]
pub trait VmmDriver: Send + Sync {
    /// Short name (`qemu`).
    fn name(&self) -> &'static str;

    /// Turns `tcg|kvm|auto` into a concrete accelerator. `auto` boots `probe_kernel`
    /// under KVM with a timeout (once per process) and falls back to TCG.
    async fn resolve_accel(&self, requested: Accel, probe_kernel: &Path) -> ResolvedAccel;

    /// Starts a VM: cold boot, or restore when `spec.incoming` is set. Returns once
    /// the vCPUs run (or are paused, with `spec.start_paused`).
    async fn start(&self, spec: &VmSpec) -> Result<Box<dyn Vm>, VmmError>;

    /// Re-attaches to a VM started earlier (maybe by another process) in `spec.run_dir`.
    async fn adopt(&self, spec: &VmSpec) -> Result<Box<dyn Vm>, VmmError>;
}

/// A handle on one running VM.
#[async_trait::async_trait]
pub trait Vm: Send + Sync + std::fmt::Debug {
    /// QEMU's pid.
    fn pid(&self) -> u32;
    /// The spec the VM runs with.
    fn spec(&self) -> &VmSpec;
    /// Stops the vCPUs (QMP `stop`). RAM stays; no guest CPU time is used.
    async fn pause(&self) -> Result<(), VmmError>;
    /// Runs the vCPUs again (QMP `cont`); also valid after a device-state save.
    async fn resume(&self) -> Result<(), VmmError>;
    /// QEMU's run state.
    async fn status(&self) -> Result<VmStatus, VmmError>;
    /// Writes the device state (not RAM: it is shared in the RAM file) to `path`.
    /// The VM must be paused; it stays paused (`postmigrate` after a
    /// migration, `paused` after a direct save) until `resume`.
    async fn save_device_state(&self, path: &Path) -> Result<SaveStats, VmmError>;
    /// Saves the device state into memory and returns the complete file's
    /// bytes, for a caller that writes them once the VM runs again: no file
    /// system is touched while the VM is paused. `Ok(None)` when this VM
    /// cannot save that way now (QEMU: its first save, which migrates, or
    /// direct saves off): use [`Vm::save_device_state`]. The VM must be
    /// paused and stays paused (`paused`).
    async fn save_device_state_in_memory(&self) -> Result<Option<(Vec<u8>, SaveStats)>, VmmError> {
        Ok(None)
    }
    /// Grows the root disk to `bytes` (file and guest-visible capacity).
    async fn block_resize(&self, bytes: u64) -> Result<(), VmmError>;
    /// ACPI power-off, then QMP `quit`, then SIGKILL, within `timeout` overall.
    async fn shutdown(&self, timeout: Duration) -> Result<VmExit, VmmError>;
    /// SIGKILL now, and wait for the exit.
    async fn kill(&self) -> Result<VmExit, VmmError>;
    /// Resident memory of QEMU (see [`RssInfo::beyond_guest_ram`]).
    fn rss_bytes(&self) -> Result<RssInfo, VmmError>;
    /// The host end of the guest agent's channel.
    fn agent_socket(&self) -> PathBuf;
    /// The last `n` bytes of the console log.
    fn console_tail(&self, n: usize) -> String;
    /// Waits until the QEMU process is gone and says why.
    async fn wait_exit(&self) -> VmExit;
    /// The exit, if the process is already gone.
    fn exited(&self) -> Option<VmExit>;
    /// The VM's user and cgroup limits, as applied.
    fn confinement(&self) -> Confinement {
        Confinement::asked(self.spec())
    }
    /// Sets the VM's CPU weight among the VMs of this host
    /// ([`cgroup::DEFAULT_CPU_WEIGHT`] is everyone's default): `false` when
    /// it has no cgroup to set it in.
    fn set_cpu_weight(&self, weight: u32) -> Result<bool, VmmError> {
        let _ = weight;
        Ok(false)
    }
    /// The root disk's write counters ([`BlockWrites`], QMP
    /// `query-blockstats` of [`ROOT_DRIVE`]).
    async fn block_writes(&self) -> Result<BlockWrites, VmmError> {
        let answer = self.qmp("query-blockstats", None).await?;
        BlockWrites::from_blockstats(&answer, ROOT_DRIVE).ok_or_else(|| VmmError::WrongState {
            status: "without a root disk in query-blockstats".into(),
            needed: "drive disk0",
        })
    }
    /// When the steps of this VM's start ended; `None` for an adopted VM
    /// (or a driver that does not record them).
    fn start_timings(&self) -> Option<StartTimings> {
        None
    }
    /// A counter bumped every time QEMU reports the guest's end of the agent
    /// port open (QMP `VSERPORT_CHANGE`, also sent once right after a
    /// restored VM runs): the agent client's cue to send Hello at once.
    /// `None` when the driver cannot tell.
    fn agent_port_opens(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }
    /// A counter of the guest closing its end of the agent port (QMP
    /// `VSERPORT_CHANGE` open=false: the agent exited): the agent client's
    /// cue to drop the connection at once. `None` when the driver cannot
    /// tell.
    fn agent_port_closes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }
    /// When the guest's end of the agent port was last reported open.
    fn agent_port_opened_at(&self) -> Option<Instant> {
        None
    }
    /// Runs a raw QMP command (escape hatch for callers and benchmarks).
    async fn qmp(
        &self,
        command: &str,
        arguments: Option<serde_json::Value>,
    ) -> Result<serde_json::Value, VmmError>;
}

#[cfg(test)]
mod block_writes_tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn counters_of_the_root_drive() {
        // The shape QEMU 7.2 answers (trimmed), with another drive first.
        let answer = json!([
            {"device": "other", "qdev": "vdb", "stats": {"wr_operations": 9, "wr_bytes": 9}},
            {"device": "disk0", "qdev": "vda", "stats": {
                "wr_operations": 12, "wr_bytes": 49152, "unmap_operations": 2,
                "unmap_bytes": 8192, "rd_operations": 300}}
        ]);
        let want = BlockWrites {
            wr_operations: 12,
            wr_bytes: 49152,
            unmap_operations: 2,
            unmap_bytes: 8192,
        };
        assert_eq!(BlockWrites::from_blockstats(&answer, "disk0"), Some(want));
        assert_eq!(BlockWrites::from_blockstats(&answer, "vda"), Some(want));
        assert_eq!(BlockWrites::from_blockstats(&answer, "nope"), None);
        // No discard counters (older QEMU): zero; no write counters: unknown.
        let old = json!([{"device": "disk0", "stats": {"wr_operations": 1, "wr_bytes": 512}}]);
        assert_eq!(
            BlockWrites::from_blockstats(&old, ROOT_DRIVE).map(|w| w.unmap_operations),
            Some(0)
        );
        let bare = json!([{"device": "disk0", "stats": {}}]);
        assert_eq!(BlockWrites::from_blockstats(&bare, ROOT_DRIVE), None);
        assert_eq!(BlockWrites::from_blockstats(&json!({}), ROOT_DRIVE), None);
    }
}
