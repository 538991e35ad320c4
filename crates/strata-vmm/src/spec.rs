//! What a VM is made of: [`VmSpec`], its network rules, and the resolved accelerator.

use std::fmt;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use strata_core::Accel;

use crate::cgroup::Limits;

/// Longest path a unix socket can bind to (`sun_path` is 108 bytes incl. the NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// Default QEMU binary.
pub const DEFAULT_QEMU: &str = "qemu-system-x86_64";

/// Default cap of `console.log`.
pub const DEFAULT_CONSOLE_LOG_MAX: u64 = 1024 * 1024;

/// An accelerator that was resolved (no `auto` left).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResolvedAccel {
    /// Software emulation.
    Tcg,
    /// KVM.
    Kvm,
}

impl ResolvedAccel {
    /// The same accelerator as a [`strata_core::Accel`].
    pub fn as_accel(self) -> Accel {
        match self {
            ResolvedAccel::Tcg => Accel::Tcg,
            ResolvedAccel::Kvm => Accel::Kvm,
        }
    }

    /// The name QEMU's `-accel` takes.
    pub fn qemu_name(self) -> &'static str {
        match self {
            ResolvedAccel::Tcg => "tcg",
            ResolvedAccel::Kvm => "kvm",
        }
    }
}

impl fmt::Display for ResolvedAccel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.qemu_name())
    }
}

/// Transport of a forwarded port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum FwdProto {
    /// TCP.
    #[default]
    Tcp,
    /// UDP.
    Udp,
}

impl FwdProto {
    fn as_str(self) -> &'static str {
        match self {
            FwdProto::Tcp => "tcp",
            FwdProto::Udp => "udp",
        }
    }
}

/// A host port forwarded into the guest (`hostfwd=`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostFwd {
    /// Transport.
    #[serde(default)]
    pub proto: FwdProto,
    /// Host address to listen on (e.g. 127.0.0.1).
    pub host_addr: Ipv4Addr,
    /// Host port (0 is not allowed: QEMU would not tell which port it chose).
    pub host_port: u16,
    /// Guest port.
    pub guest_port: u16,
}

/// Where a guest connection to a [`GuestFwd`] address goes on the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GuestFwdTarget {
    /// A command run by QEMU per connection, talking on its stdio (`cmd:`).
    Cmd(String),
    /// A unix socket on the host (e.g. the daemon's egress proxy).
    Unix(PathBuf),
    /// A TCP `host:port` on the host.
    Tcp(String),
}

/// A guest address whose TCP connections are forwarded to the host (`guestfwd=`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestFwd {
    /// Guest-visible address (inside 10.0.2.0/24).
    pub guest_addr: Ipv4Addr,
    /// Guest-visible port.
    pub guest_port: u16,
    /// Host-side target.
    pub target: GuestFwdTarget,
}

/// User-mode networking of the guest. Always `restrict=on`: the guest reaches
/// nothing but what these rules open. Keep it identical between a VM and the VMs
/// restored from its device state (slirp state is part of the migration stream).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetSpec {
    /// Host ports forwarded into the guest.
    #[serde(default)]
    pub hostfwd: Vec<HostFwd>,
    /// Guest addresses forwarded to host targets.
    #[serde(default)]
    pub guestfwd: Vec<GuestFwd>,
}

/// Format of the root disk image (QEMU's `format=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DiskFormat {
    /// A raw image: what strata uses (btrfs does the copy-on-write).
    #[default]
    Raw,
    /// A qcow2 image: QEMU's own copy-on-write format, which can also hold
    /// internal snapshots (`savevm`). Used by benchmarks of stock QEMU.
    Qcow2,
}

impl DiskFormat {
    /// The name QEMU's `format=` takes.
    pub fn qemu_name(self) -> &'static str {
        match self {
            DiskFormat::Raw => "raw",
            DiskFormat::Qcow2 => "qcow2",
        }
    }
}

/// What backs guest RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RamBacking {
    /// `memory-backend-file,share=on` at [`VmSpec::mem_path`]: RAM is a file in the
    /// sandbox's subvolume, so device state alone (with `x-ignore-shared`) plus a
    /// snapshot of the file captures the VM. strata's snapshots rely on it.
    #[default]
    File,
    /// `memory-backend-ram`: plain anonymous memory, as a stock QEMU user has it.
    /// [`VmSpec::mem_path`] is unused; such a VM cannot be restored from device
    /// state (its RAM is in no file), and a device-state save carries all of RAM.
    /// For benchmarks of the alternatives.
    Anonymous,
}

/// Everything needed to start (or adopt) one VM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmSpec {
    /// Human name (shown by QEMU as `-name`).
    pub name: String,
    /// Directory for `qmp.sock`, `agent.sock`, `console.sock`, `qemu.pid`,
    /// `console.log`, `qemu.stderr`, `cgroup.json`. Keep it short: socket paths must
    /// fit 107 bytes. The driver makes it mode 0700, owned by the daemon's user: the
    /// sockets in it are reachable by nobody else (QEMU opens them before `run_as`).
    pub run_dir: PathBuf,
    /// Guest kernel (bzImage, or an uncompressed PVH `vmlinux`).
    pub kernel: PathBuf,
    /// Initramfs, if any.
    pub initrd: Option<PathBuf>,
    /// Kernel command line. Under TCG the driver appends `tsc_early_khz=<host TSC>
    /// tsc=reliable` unless present (PIT calibration is unreliable on a loaded host).
    pub cmdline: String,
    /// Virtual CPUs.
    pub vcpus: u32,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// Guest RAM file (`memory-backend-file,share=on`), normally inside the sandbox's
    /// btrfs subvolume. Created by QEMU if absent; taken as-is on restore.
    pub mem_path: PathBuf,
    /// What backs guest RAM: the file at `mem_path` (default) or anonymous memory.
    #[serde(default)]
    pub ram: RamBacking,
    /// Root disk (`virtio-blk-device`).
    pub disk_path: PathBuf,
    /// Format of the root disk (default raw).
    #[serde(default)]
    pub disk_format: DiskFormat,
    /// Resolved accelerator.
    pub accel: ResolvedAccel,
    /// Size of TCG's translation block cache, MiB (ignored under KVM; not
    /// part of the device layout). Default
    /// [`crate::cmdline::TCG_TB_SIZE_MIB`].
    #[serde(default = "default_tb_size")]
    pub tcg_tb_size_mib: u32,
    /// Whether the guest's disk flushes reach the host's disk (on by
    /// default). Off, QEMU completes them at once (`cache.no-flush=on`): on
    /// a btrfs pool such a flush can commit the pool's whole transaction.
    /// Host-side only: not in the device layout.
    #[serde(default = "default_true")]
    pub guest_disk_flush: bool,
    /// Device-state file to restore from (`-incoming defer` + `migrate-incoming`).
    #[serde(default)]
    pub incoming: Option<PathBuf>,
    /// Leave the vCPUs stopped after boot or restore (caller issues `resume`).
    #[serde(default)]
    pub start_paused: bool,
    /// User networking rules.
    #[serde(default)]
    pub net: NetSpec,
    /// Cap of `console.log` in bytes.
    pub console_log_max_bytes: u64,
    /// QEMU binary (name on `PATH` or absolute path).
    pub qemu_binary: PathBuf,
    /// Run QEMU under its seccomp filter (`-sandbox on,spawn=deny,...`).
    #[serde(default = "default_true")]
    pub seccomp: bool,
    /// Unprivileged user QEMU switches to (`-runas`) once it has opened its files
    /// (RAM file, disk, kernel, initrd, sockets) as the starting user. `None`: QEMU
    /// keeps the starting user. See [`crate::default_vm_user`].
    #[serde(default)]
    pub run_as: Option<String>,
    /// CPU and memory limits, enforced through a per-VM cgroup (see [`crate::cgroup`]).
    #[serde(default)]
    pub limits: Option<Limits>,
    /// Device layout version the command line is built for: the newest
    /// ([`crate::cmdline::MACHINE_LAYOUT_VERSION`]) for a new VM, the one its
    /// state was made under for a restore (see [`crate::cmdline::qemu_args`]).
    /// Absent in a spec written before versions existed: 1.
    #[serde(default = "first_layout")]
    pub layout: u32,
    /// Network namespace file QEMU joins before exec (`setns`, see
    /// [`crate::netns`]); `None`: the starting process's namespace. Host-side
    /// only: not on the command line, not in the device layout.
    #[serde(default)]
    pub netns: Option<PathBuf>,
    /// I/O limits of the root disk (QEMU block throttling on `-drive`);
    /// `None`: unthrottled. Host-side only: not in the device layout.
    #[serde(default)]
    pub disk_throttle: Option<DiskThrottle>,
}

/// QEMU block throttling of a VM's root disk (`throttling.*` on `-drive`):
/// applied by QEMU to every request the guest makes, whatever the page
/// cache does on the host (cgroup v1's blkio throttle misses buffered
/// writes). `0` leaves that limit off.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskThrottle {
    /// Read plus write operations per second.
    #[serde(default)]
    pub iops: u64,
    /// Read plus write bytes per second.
    #[serde(default)]
    pub bps: u64,
}

impl DiskThrottle {
    /// The limits, or `None` when both are off.
    pub fn new(iops: u64, bps: u64) -> Option<Self> {
        (iops > 0 || bps > 0).then_some(DiskThrottle { iops, bps })
    }

    /// The `-drive` options, each with its leading comma.
    pub fn drive_options(&self) -> String {
        let mut s = String::new();
        if self.iops > 0 {
            s.push_str(&format!(",throttling.iops-total={}", self.iops));
        }
        if self.bps > 0 {
            s.push_str(&format!(",throttling.bps-total={}", self.bps));
        }
        s
    }
}

fn default_true() -> bool {
    true
}

fn default_tb_size() -> u32 {
    crate::cmdline::TCG_TB_SIZE_MIB
}

fn first_layout() -> u32 {
    crate::cmdline::OLDEST_LAYOUT_VERSION
}

impl VmSpec {
    /// A spec with the defaults filled in (1 vCPU, 256 MiB, file-backed RAM, raw
    /// disk, TCG, no network rules, 1 MiB console log, `qemu-system-x86_64`, seccomp on, no `run_as`, no limits).
    pub fn new(
        name: impl Into<String>,
        run_dir: impl Into<PathBuf>,
        kernel: impl Into<PathBuf>,
        mem_path: impl Into<PathBuf>,
        disk_path: impl Into<PathBuf>,
    ) -> Self {
        VmSpec {
            name: name.into(),
            run_dir: run_dir.into(),
            kernel: kernel.into(),
            initrd: None,
            cmdline: "console=ttyS0 panic=-1".into(),
            vcpus: 1,
            memory_mib: 256,
            mem_path: mem_path.into(),
            ram: RamBacking::File,
            disk_path: disk_path.into(),
            disk_format: DiskFormat::Raw,
            accel: ResolvedAccel::Tcg,
            tcg_tb_size_mib: crate::cmdline::TCG_TB_SIZE_MIB,
            guest_disk_flush: true,
            incoming: None,
            start_paused: false,
            net: NetSpec::default(),
            console_log_max_bytes: DEFAULT_CONSOLE_LOG_MAX,
            qemu_binary: PathBuf::from(DEFAULT_QEMU),
            seccomp: true,
            run_as: None,
            limits: None,
            layout: crate::cmdline::MACHINE_LAYOUT_VERSION,
            netns: None,
            disk_throttle: None,
        }
    }

    /// `<run_dir>/qmp.sock`.
    pub fn qmp_socket(&self) -> PathBuf {
        self.run_dir.join("qmp.sock")
    }
    /// `<run_dir>/agent.sock`: the guest agent's virtio-serial port.
    pub fn agent_socket(&self) -> PathBuf {
        self.run_dir.join("agent.sock")
    }
    /// `<run_dir>/console.sock`: the serial console (read by the driver's copier).
    pub fn console_socket(&self) -> PathBuf {
        self.run_dir.join("console.sock")
    }
    /// `<run_dir>/console.log`: the size-capped serial console log.
    pub fn console_log(&self) -> PathBuf {
        self.run_dir.join("console.log")
    }
    /// `<run_dir>/qemu.pid`.
    pub fn pid_file(&self) -> PathBuf {
        self.run_dir.join("qemu.pid")
    }
    /// `<run_dir>/cgroup.json`: the VM's cgroup directories, for adopters.
    pub fn cgroup_file(&self) -> PathBuf {
        self.run_dir.join("cgroup.json")
    }
    /// `<run_dir>/qemu.stderr`: QEMU's stdout and stderr.
    pub fn stderr_file(&self) -> PathBuf {
        self.run_dir.join("qemu.stderr")
    }

    /// Checks what can be checked without touching the file system.
    pub fn validate(&self) -> Result<(), String> {
        if self.vcpus == 0 || self.vcpus > 64 {
            return Err(format!("vcpus must be 1..=64, got {}", self.vcpus));
        }
        if self.memory_mib < 16 {
            return Err(format!("memory_mib must be >= 16, got {}", self.memory_mib));
        }
        if self.incoming.is_some() && self.ram == RamBacking::Anonymous {
            return Err("a restore from device state needs file-backed RAM".into());
        }
        let layouts =
            crate::cmdline::OLDEST_LAYOUT_VERSION..=crate::cmdline::MACHINE_LAYOUT_VERSION;
        if !layouts.contains(&self.layout) {
            return Err(format!(
                "device layout version {} is not one this build makes ({}..={})",
                self.layout,
                layouts.start(),
                layouts.end()
            ));
        }
        if self.console_log_max_bytes < 4096 {
            return Err("console_log_max_bytes must be >= 4096".into());
        }
        for sock in [
            self.qmp_socket(),
            self.agent_socket(),
            self.console_socket(),
        ] {
            let len = sock.as_os_str().len();
            if len > MAX_SOCKET_PATH {
                return Err(format!(
                    "socket path {sock:?} is {len} bytes, max {MAX_SOCKET_PATH}: use a shorter run_dir"
                ));
            }
        }
        for (what, p) in [
            ("run_dir", &self.run_dir),
            ("mem_path", &self.mem_path),
            ("disk_path", &self.disk_path),
        ] {
            if p.to_str().is_none() {
                return Err(format!("{what} {p:?} is not UTF-8"));
            }
        }
        if let Some(user) = &self.run_as {
            if user.is_empty()
                || user.starts_with('-')
                || !user
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '$'))
            {
                return Err(format!("run_as {user:?} is not a valid user name"));
            }
        }
        if let Some(limits) = &self.limits {
            limits.validate()?;
        }
        for f in &self.net.hostfwd {
            if f.host_port == 0 || f.guest_port == 0 {
                return Err("hostfwd ports must be non-zero".into());
            }
        }
        Ok(())
    }
}

/// Escapes a value for QEMU's option syntax (a comma is written as two).
pub(crate) fn qemu_escape(s: &str) -> String {
    s.replace(',', ",,")
}

pub(crate) fn path_str(p: &Path) -> String {
    qemu_escape(&p.to_string_lossy())
}

/// The `-netdev user` option string for `net`.
pub(crate) fn netdev_arg(net: &NetSpec) -> String {
    let mut s = String::from("user,id=net0,restrict=on");
    for f in &net.hostfwd {
        s.push_str(&format!(
            ",hostfwd={}:{}:{}-:{}",
            f.proto.as_str(),
            f.host_addr,
            f.host_port,
            f.guest_port
        ));
    }
    for g in &net.guestfwd {
        let target = match &g.target {
            GuestFwdTarget::Cmd(c) => format!("cmd:{}", qemu_escape(c)),
            GuestFwdTarget::Unix(p) => format!("unix:{}", path_str(p)),
            GuestFwdTarget::Tcp(hp) => format!("tcp:{}", qemu_escape(hp)),
        };
        s.push_str(&format!(
            ",guestfwd=tcp:{}:{}-{}",
            g.guest_addr, g.guest_port, target
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netdev_string_escapes_and_lists_rules() {
        let net = NetSpec {
            hostfwd: vec![HostFwd {
                proto: FwdProto::Tcp,
                host_addr: Ipv4Addr::LOCALHOST,
                host_port: 2222,
                guest_port: 22,
            }],
            guestfwd: vec![
                GuestFwd {
                    guest_addr: Ipv4Addr::new(10, 0, 2, 100),
                    guest_port: 3128,
                    target: GuestFwdTarget::Unix("/run/s,x/proxy.sock".into()),
                },
                GuestFwd {
                    guest_addr: Ipv4Addr::new(10, 0, 2, 101),
                    guest_port: 80,
                    target: GuestFwdTarget::Cmd("nc -U /a,b".into()),
                },
            ],
        };
        assert_eq!(
            netdev_arg(&net),
            "user,id=net0,restrict=on,hostfwd=tcp:127.0.0.1:2222-:22,\
             guestfwd=tcp:10.0.2.100:3128-unix:/run/s,,x/proxy.sock,\
             guestfwd=tcp:10.0.2.101:80-cmd:nc -U /a,,b"
        );
    }

    #[test]
    fn long_run_dir_is_rejected() {
        let long = format!("/tmp/{}", "x".repeat(100));
        let spec = VmSpec::new("t", long, "/k", "/m", "/d");
        let err = spec.validate().unwrap_err();
        assert!(err.contains("shorter run_dir"), "{err}");
        let ok = VmSpec::new("t", "/tmp/r", "/k", "/m", "/d");
        ok.validate().unwrap();
    }
}
