//! Per-VM cgroups: CPU and memory limits from the sandbox size.
//!
//! Layout:
//! - cgroup v2 (a `cgroup2` mount whose `cgroup.controllers` has `cpu` and `memory`):
//!   `<mount>/strata/<vm>/` with `cpu.max` and `memory.max`; `cpu` and `memory` are
//!   enabled in `<mount>/cgroup.subtree_control` and `<mount>/strata/cgroup.subtree_control`.
//! - cgroup v1 (hybrid or legacy hosts: separate `cpu` and `memory` hierarchies):
//!   `<cpu mount>/<own>/strata/<vm>/` with `cpu.cfs_period_us` + `cpu.cfs_quota_us`, and
//!   `<memory mount>/<own>/strata/<vm>/` with `memory.limit_in_bytes`, where `<own>` is
//!   this process's cgroup in that hierarchy (v1 has no "no internal processes" rule,
//!   so nesting under our own cgroup keeps QEMU inside whatever limits we run under).
//!
//! The hierarchy is detected once per process from `/proc/self/mountinfo`. QEMU is
//! put into its cgroup between `fork` and `exec` (the child writes `0` to
//! `cgroup.procs` files the parent opened), so all of its memory is charged there
//! from the first page. The cgroup is removed when the VM's exit is observed.

use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Name of the parent cgroup of all VM cgroups.
pub const CGROUP_PARENT: &str = "strata";

/// The CPU weight a VM has unless told otherwise (cgroup v2's default).
pub const DEFAULT_CPU_WEIGHT: u32 = 100;

/// CFS period written for every VM, in microseconds.
pub const CPU_PERIOD_US: u64 = 100_000;

/// Memory allowed on top of guest RAM: QEMU's own resident memory (about 110 MiB
/// beyond guest RAM under TCG with a 64 MiB translation cache) plus slack for the
/// page cache of the guest RAM file, which is charged to the VM's cgroup too.
pub const MEMORY_OVERHEAD_BYTES: u64 = 512 << 20;

/// CPU and memory limits of one VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// CPU time per wall-clock second, in thousandths of a CPU (1000 = one full CPU).
    pub cpu_millis: u64,
    /// Memory ceiling of the whole QEMU process (guest RAM + overhead), in bytes.
    pub memory_bytes: u64,
    /// Refuse to start the VM when the limits cannot be applied (default: start
    /// anyway, log a warning and report `limits_applied = false`).
    #[serde(default)]
    pub required: bool,
    /// CPU weight among the host's VMs ([`VmCgroup::set_cpu_weight`]);
    /// unset: the default ([`DEFAULT_CPU_WEIGHT`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_weight: Option<u32>,
}

impl Limits {
    /// The limits for a guest of `vcpus` and `memory_mib`: one full CPU per vCPU, and
    /// guest RAM plus [`MEMORY_OVERHEAD_BYTES`].
    pub fn for_guest(vcpus: u32, memory_mib: u64) -> Self {
        Limits {
            cpu_millis: u64::from(vcpus) * 1000,
            memory_bytes: (memory_mib << 20).saturating_add(MEMORY_OVERHEAD_BYTES),
            required: false,
            cpu_weight: None,
        }
    }

    /// The CFS quota per [`CPU_PERIOD_US`], in microseconds.
    pub fn cpu_quota_us(&self) -> u64 {
        self.cpu_millis.saturating_mul(CPU_PERIOD_US) / 1000
    }

    /// Checks the values make sense.
    pub fn validate(&self) -> Result<(), String> {
        if self.cpu_millis < 10 {
            return Err(format!("cpu_millis must be >= 10, got {}", self.cpu_millis));
        }
        if self.memory_bytes < 64 << 20 {
            return Err(format!(
                "memory_bytes must be >= 64 MiB, got {}",
                self.memory_bytes
            ));
        }
        Ok(())
    }
}

/// Which cgroup hierarchy VM cgroups are created in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Hierarchy {
    /// Unified hierarchy; `root` is the cgroup2 mount point.
    V2 {
        /// The cgroup2 mount point.
        root: PathBuf,
    },
    /// Legacy hierarchies; the directories under which `strata/` is created.
    V1 {
        /// This process's cgroup directory in the `cpu` hierarchy.
        cpu: PathBuf,
        /// This process's cgroup directory in the `memory` hierarchy.
        memory: PathBuf,
    },
}

/// Failures while setting up or tearing down a VM's cgroup.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// No usable hierarchy on this host.
    #[error("no usable cgroup hierarchy: {0}")]
    Unavailable(String),
    /// A cgroup file operation failed.
    #[error("{what} {path:?}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The process did not end up in the cgroup.
    #[error("process {pid} is not in {dir:?}")]
    NotMember {
        /// The process.
        pid: u32,
        /// The cgroup directory.
        dir: PathBuf,
    },
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError {
    let path = path.to_path_buf();
    move |source| CgroupError::Io { what, path, source }
}

/// The hierarchy of this host, detected once per process.
pub fn detect() -> Result<Hierarchy, CgroupError> {
    static H: OnceLock<Result<Hierarchy, String>> = OnceLock::new();
    H.get_or_init(|| {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("/proc/self/cgroup: {e}"))?;
        detect_from(&mountinfo, &own, |dir| {
            std::fs::read_to_string(dir.join("cgroup.controllers")).ok()
        })
    })
    .clone()
    .map_err(CgroupError::Unavailable)
}

/// One line of `/proc/self/mountinfo`, the parts that matter here.
#[derive(Debug, PartialEq, Eq)]
struct Mount {
    root: String,
    mount_point: PathBuf,
    fstype: String,
    super_opts: Vec<String>,
}

/// Undoes mountinfo's octal escapes (`\040` for a space, ...).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 4 <= b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = b[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
            if let Ok(v) = u8::try_from(v) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_mountinfo(text: &str) -> Vec<Mount> {
    let mut mounts = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        if sep < 6 || fields.len() < sep + 4 {
            continue;
        }
        mounts.push(Mount {
            root: unescape(fields[3]),
            mount_point: PathBuf::from(unescape(fields[4])),
            fstype: fields[sep + 1].to_owned(),
            super_opts: fields[sep + 3].split(',').map(str::to_owned).collect(),
        });
    }
    mounts
}

/// This process's cgroup path in the v1 hierarchy with `controller`, from `/proc/self/cgroup`.
fn own_v1_path<'a>(self_cgroup: &'a str, controller: &str) -> Option<&'a str> {
    self_cgroup.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let _id = parts.next()?;
        let ctrls = parts.next()?;
        let path = parts.next()?;
        ctrls.split(',').any(|c| c == controller).then_some(path)
    })
}

/// `mount_point` + (`own` relative to the mount's root), or the mount point itself
/// when `own` lies outside what the mount shows.
fn join_own(m: &Mount, own: Option<&str>) -> PathBuf {
    let Some(own) = own else {
        return m.mount_point.clone();
    };
    let root = m.root.trim_end_matches('/');
    match own.strip_prefix(root) {
        Some(rest) if rest.is_empty() || rest.starts_with('/') => {
            let rest = rest.trim_start_matches('/');
            if rest.is_empty() {
                m.mount_point.clone()
            } else {
                m.mount_point.join(rest)
            }
        }
        _ => m.mount_point.clone(),
    }
}

/// Detection from the text of `/proc/self/mountinfo` and `/proc/self/cgroup`;
/// `controllers_of(dir)` reads `dir/cgroup.controllers`. Prefers a cgroup2 mount
/// that offers both `cpu` and `memory`; otherwise needs v1 `cpu` and `memory` mounts.
pub fn detect_from(
    mountinfo: &str,
    self_cgroup: &str,
    controllers_of: impl Fn(&Path) -> Option<String>,
) -> Result<Hierarchy, String> {
    let mounts = parse_mountinfo(mountinfo);
    let mut notes = Vec::new();
    for m in mounts.iter().filter(|m| m.fstype == "cgroup2") {
        let ctrls = controllers_of(&m.mount_point).unwrap_or_default();
        let has = |c: &str| ctrls.split_whitespace().any(|x| x == c);
        if has("cpu") && has("memory") {
            return Ok(Hierarchy::V2 {
                root: m.mount_point.clone(),
            });
        }
        notes.push(format!(
            "cgroup2 at {:?} lacks cpu/memory (controllers: {:?})",
            m.mount_point,
            ctrls.trim()
        ));
    }
    let v1 = |controller: &str| {
        mounts
            .iter()
            .find(|m| m.fstype == "cgroup" && m.super_opts.iter().any(|o| o == controller))
            .map(|m| join_own(m, own_v1_path(self_cgroup, controller)))
    };
    match (v1("cpu"), v1("memory")) {
        (Some(cpu), Some(memory)) => Ok(Hierarchy::V1 { cpu, memory }),
        (cpu, memory) => {
            if cpu.is_none() {
                notes.push("no cgroup v1 cpu hierarchy".into());
            }
            if memory.is_none() {
                notes.push("no cgroup v1 memory hierarchy".into());
            }
            Err(notes.join("; "))
        }
    }
}

/// Turns a VM name into one safe path component (`[A-Za-z0-9._-]`, others become `_`).
pub fn cgroup_name(vm_name: &str) -> String {
    let mut s: String = vm_name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() || s.starts_with('.') {
        s.insert_str(0, "vm_");
    }
    s
}

/// The cgroup of one VM: one directory under v2, a `cpu` and a `memory` one under v1.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmCgroup {
    /// 1 or 2.
    pub version: u8,
    /// The VM's cgroup directories (v2: one; v1: cpu, memory).
    pub dirs: Vec<PathBuf>,
}

impl VmCgroup {
    /// Where the cgroup of `vm_name` lives in `h` (nothing is created).
    pub fn locate(h: &Hierarchy, vm_name: &str) -> Self {
        let leaf = cgroup_name(vm_name);
        match h {
            Hierarchy::V2 { root } => VmCgroup {
                version: 2,
                dirs: vec![root.join(CGROUP_PARENT).join(&leaf)],
            },
            Hierarchy::V1 { cpu, memory } => VmCgroup {
                version: 1,
                dirs: vec![
                    cpu.join(CGROUP_PARENT).join(&leaf),
                    memory.join(CGROUP_PARENT).join(&leaf),
                ],
            },
        }
    }

    /// The files to write and their contents, in order, to apply `limits`.
    pub fn limit_files(&self, limits: &Limits) -> Vec<(PathBuf, String)> {
        let mut files = self.ceiling_files(limits);
        if let Some(w) = limits.cpu_weight {
            files.extend(self.weight_file(w));
        }
        files
    }

    /// The file and value that set CPU weight `weight` (see
    /// [`VmCgroup::set_cpu_weight`]).
    fn weight_file(&self, weight: u32) -> Option<(PathBuf, String)> {
        let weight = weight.clamp(1, 10_000);
        match (self.version, self.dirs.as_slice()) {
            (2, [dir]) => Some((dir.join("cpu.weight"), weight.to_string())),
            (_, [cpu, _]) => {
                let shares = (u64::from(weight) * 1024 / 100).max(2);
                Some((cpu.join("cpu.shares"), shares.to_string()))
            }
            _ => None,
        }
    }

    fn ceiling_files(&self, limits: &Limits) -> Vec<(PathBuf, String)> {
        let quota = limits.cpu_quota_us();
        match (self.version, self.dirs.as_slice()) {
            (2, [dir]) => vec![
                (dir.join("cpu.max"), format!("{quota} {CPU_PERIOD_US}")),
                (dir.join("memory.max"), limits.memory_bytes.to_string()),
            ],
            (_, [cpu, memory]) => vec![
                (cpu.join("cpu.cfs_period_us"), CPU_PERIOD_US.to_string()),
                (cpu.join("cpu.cfs_quota_us"), quota.to_string()),
                (
                    memory.join("memory.limit_in_bytes"),
                    limits.memory_bytes.to_string(),
                ),
            ],
            _ => Vec::new(),
        }
    }

    /// Sets the VM's CPU weight relative to its siblings (cgroup v2
    /// `cpu.weight`, 1..=10000, default [`DEFAULT_CPU_WEIGHT`]; v1
    /// `cpu.shares`, scaled so 100 is its default 1024). It only matters
    /// when CPUs are contended; the `cpu.max` ceiling stays.
    pub fn set_cpu_weight(&self, weight: u32) -> Result<(), CgroupError> {
        match self.weight_file(weight) {
            Some((path, value)) => write_file(&path, &value),
            None => Ok(()),
        }
    }

    /// The `cgroup.procs` file of each directory.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// Creates the directories (enabling the controllers on the way under v2) and
    /// writes `limits`. An existing cgroup of the same name is reused.
    pub fn create(&self, limits: &Limits) -> Result<(), CgroupError> {
        if self.version == 2 {
            for dir in &self.dirs {
                // <root>/cgroup.subtree_control, then <root>/strata/cgroup.subtree_control.
                if let Some(parent) = dir.parent() {
                    if let Some(root) = parent.parent() {
                        enable_controllers(root)?;
                    }
                }
            }
        }
        for dir in &self.dirs {
            mkdir_all(dir)?;
        }
        if self.version == 2 {
            for dir in &self.dirs {
                if let Some(parent) = dir.parent() {
                    enable_controllers(parent)?;
                }
            }
        }
        for (path, value) in self.limit_files(limits) {
            write_file(&path, &value)?;
        }
        Ok(())
    }

    /// Opens the `cgroup.procs` files for writing (for `join_self` after `fork`).
    pub fn open_procs(&self) -> Result<Vec<File>, CgroupError> {
        self.procs_files()
            .iter()
            .map(|p| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(p)
                    .map_err(io_err("open", p))
            })
            .collect()
    }

    /// Moves `pid` into the cgroup.
    pub fn attach(&self, pid: u32) -> Result<(), CgroupError> {
        for p in self.procs_files() {
            write_file(&p, &pid.to_string())?;
        }
        Ok(())
    }

    /// Whether `pid` is listed in every directory's `cgroup.procs`.
    pub fn contains(&self, pid: u32) -> Result<bool, CgroupError> {
        for p in self.procs_files() {
            let text = std::fs::read_to_string(&p).map_err(io_err("read", &p))?;
            if !text
                .lines()
                .any(|l| l.trim().parse::<u32>().ok() == Some(pid))
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Checks that `pid` is a member, naming the first directory it is missing from.
    pub fn check_member(&self, pid: u32) -> Result<(), CgroupError> {
        for (dir, p) in self.dirs.iter().zip(self.procs_files()) {
            let text = std::fs::read_to_string(&p).map_err(io_err("read", &p))?;
            if !text
                .lines()
                .any(|l| l.trim().parse::<u32>().ok() == Some(pid))
            {
                return Err(CgroupError::NotMember {
                    pid,
                    dir: dir.clone(),
                });
            }
        }
        Ok(())
    }

    /// Reads the limits back from the files (`None` for "max" / unlimited values).
    pub fn read_limits(&self) -> Result<(Option<u64>, Option<u64>), CgroupError> {
        let read = |p: PathBuf| std::fs::read_to_string(&p).map_err(io_err("read", &p));
        match (self.version, self.dirs.as_slice()) {
            (2, [dir]) => {
                let cpu = parse_cpu_max(&read(dir.join("cpu.max"))?);
                let mem = read(dir.join("memory.max"))?.trim().parse().ok();
                Ok((cpu, mem))
            }
            (_, [cpu, memory]) => {
                let period: Option<u64> = read(cpu.join("cpu.cfs_period_us"))?.trim().parse().ok();
                let quota: Option<i64> = read(cpu.join("cpu.cfs_quota_us"))?.trim().parse().ok();
                let millis = match (quota, period) {
                    (Some(q), Some(p)) if q > 0 && p > 0 => Some(q as u64 * 1000 / p),
                    _ => None,
                };
                let mem = read(memory.join("memory.limit_in_bytes"))?
                    .trim()
                    .parse()
                    .ok();
                Ok((millis, mem))
            }
            _ => Ok((None, None)),
        }
    }

    /// Whether any of the directories still exists.
    pub fn exists(&self) -> bool {
        self.dirs.iter().any(|d| d.exists())
    }

    /// Removes the directories once the processes in them are gone (retrying while
    /// the kernel still counts an exiting process), then the `strata` parents if empty.
    pub async fn remove(&self) -> Result<(), CgroupError> {
        for dir in &self.dirs {
            let mut delay = Duration::from_millis(5);
            let mut waited = Duration::ZERO;
            loop {
                match std::fs::remove_dir(dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Err(e)
                        if e.raw_os_error() == Some(libc::EBUSY)
                            && waited < Duration::from_secs(3) =>
                    {
                        tokio::time::sleep(delay).await;
                        waited += delay;
                        delay = (delay * 2).min(Duration::from_millis(200));
                    }
                    Err(e) => return Err(io_err("remove", dir)(e)),
                }
            }
            // The shared parent goes too when this was its last VM, so that nothing
            // is left behind in a cgroup someone else may want to remove.
            if let Some(parent) = dir.parent() {
                let _ = std::fs::remove_dir(parent);
            }
        }
        Ok(())
    }
}

/// Writes `0` (the writing process itself) to each file: the child's half of putting a
/// new process into its cgroup, run between `fork` and `exec`. Only `write(2)`, which is
/// async-signal-safe; no allocation. Errors are left for the parent to detect.
pub(crate) fn join_self(fds: &[libc::c_int]) {
    for &fd in fds {
        // SAFETY: `fd` is an open descriptor the parent opened for this child; the
        // buffer is a static byte string that outlives the call.
        unsafe {
            libc::write(fd, b"0".as_ptr().cast(), 1);
        }
    }
}

fn parse_cpu_max(text: &str) -> Option<u64> {
    let mut it = text.split_whitespace();
    let quota: u64 = it.next()?.parse().ok()?;
    let period: u64 = it.next()?.parse().ok()?;
    (period > 0).then(|| quota * 1000 / period)
}

/// Enables `cpu` and `memory` for the children of `dir` (v2), if not on yet.
fn enable_controllers(dir: &Path) -> Result<(), CgroupError> {
    let path = dir.join("cgroup.subtree_control");
    let current = std::fs::read_to_string(&path).map_err(io_err("read", &path))?;
    let on = |c: &str| current.split_whitespace().any(|x| x == c);
    if on("cpu") && on("memory") {
        return Ok(());
    }
    write_file(&path, "+cpu +memory")
}

fn mkdir_all(dir: &Path) -> Result<(), CgroupError> {
    // A concurrent `remove` of the last other VM may drop the parent between the two
    // mkdirs of create_dir_all: try again.
    let mut last = None;
    for _ in 0..3 {
        match std::fs::create_dir_all(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => last = Some(e),
            Err(e) => return Err(io_err("create", dir)(e)),
        }
    }
    Err(io_err("create", dir)(last.unwrap_or_else(|| {
        std::io::Error::from(std::io::ErrorKind::NotFound)
    })))
}

fn write_file(path: &Path, value: &str) -> Result<(), CgroupError> {
    // One write(2) per value: cgroup files take a value per write.
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io_err("open", path))?;
    f.write_all(value.as_bytes()).map_err(io_err("write", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
    const HYBRID_SELF: &str = "\
4:memory:/process_api/6c3d
3:cpuset:/
2:cpuacct:/
1:cpu:/
0::/
";

    #[test]
    fn hybrid_host_uses_v1_under_own_cgroup() {
        let h = detect_from(HYBRID, HYBRID_SELF, |_| Some(String::new())).unwrap();
        assert_eq!(
            h,
            Hierarchy::V1 {
                cpu: "/sys/fs/cgroup/cpu".into(),
                memory: "/sys/fs/cgroup/memory/process_api/6c3d".into(),
            }
        );
        let cg = VmCgroup::locate(&h, "sb-1");
        assert_eq!(
            cg.dirs,
            vec![
                PathBuf::from("/sys/fs/cgroup/cpu/strata/sb-1"),
                PathBuf::from("/sys/fs/cgroup/memory/process_api/6c3d/strata/sb-1"),
            ]
        );
        let files = cg.limit_files(&Limits::for_guest(2, 256));
        assert_eq!(
            files,
            vec![
                (
                    "/sys/fs/cgroup/cpu/strata/sb-1/cpu.cfs_period_us".into(),
                    "100000".to_string()
                ),
                (
                    "/sys/fs/cgroup/cpu/strata/sb-1/cpu.cfs_quota_us".into(),
                    "200000".to_string()
                ),
                (
                    "/sys/fs/cgroup/memory/process_api/6c3d/strata/sb-1/memory.limit_in_bytes"
                        .into(),
                    ((256u64 << 20) + (512 << 20)).to_string()
                ),
            ]
        );
        let weighted = Limits {
            cpu_weight: Some(10),
            ..Limits::for_guest(2, 256)
        };
        assert_eq!(
            cg.limit_files(&weighted).last(),
            Some(&(
                PathBuf::from("/sys/fs/cgroup/cpu/strata/sb-1/cpu.shares"),
                "102".to_string()
            ))
        );
    }

    #[test]
    fn v2_with_controllers_wins_and_combined_v1_mounts_are_found() {
        let v2 = "\
30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
";
        let h = detect_from(v2, "0::/system.slice/x.service\n", |p| {
            assert_eq!(p, Path::new("/sys/fs/cgroup"));
            Some("cpuset cpu io memory pids\n".into())
        })
        .unwrap();
        assert_eq!(
            h,
            Hierarchy::V2 {
                root: "/sys/fs/cgroup".into()
            }
        );
        let cg = VmCgroup::locate(&h, "tpl/x y");
        assert_eq!(
            cg.dirs,
            vec![PathBuf::from("/sys/fs/cgroup/strata/tpl_x_y")]
        );
        assert_eq!(
            cg.limit_files(&Limits::for_guest(1, 512)),
            vec![
                (
                    "/sys/fs/cgroup/strata/tpl_x_y/cpu.max".into(),
                    "100000 100000".to_string()
                ),
                (
                    "/sys/fs/cgroup/strata/tpl_x_y/memory.max".into(),
                    (1024u64 << 20).to_string()
                ),
            ]
        );
        // A weight (a warm-pool guest's): cpu.weight under v2, cpu.shares
        // scaled from v2's range under v1.
        let weighted = Limits {
            cpu_weight: Some(10),
            ..Limits::for_guest(1, 512)
        };
        assert_eq!(
            cg.limit_files(&weighted).last(),
            Some(&(
                PathBuf::from("/sys/fs/cgroup/strata/tpl_x_y/cpu.weight"),
                "10".to_string()
            ))
        );
        // systemd-style v1: cpu and cpuacct share a mount; a container's mount root.
        let v1 = "\
40 31 0:37 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup rw,cpu,cpuacct
41 31 0:38 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
";
        let own = "5:cpu,cpuacct:/docker/abc/inner\n4:memory:/elsewhere\n";
        let h = detect_from(v1, own, |_| None).unwrap();
        assert_eq!(
            h,
            Hierarchy::V1 {
                cpu: "/sys/fs/cgroup/cpu,cpuacct/inner".into(),
                memory: "/sys/fs/cgroup/memory".into(),
            }
        );
    }

    #[test]
    fn no_hierarchy_is_explained() {
        let err = detect_from(
            "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
            "0::/\n",
            |_| Some("pids\n".into()),
        )
        .unwrap_err();
        assert!(
            err.contains("lacks cpu/memory") && err.contains("no cgroup v1 cpu"),
            "{err}"
        );
    }

    #[test]
    fn mountinfo_escapes_and_optional_fields() {
        let m = parse_mountinfo(
            "36 25 0:32 / /mnt/cg\\040x rw,relatime shared:5 master:1 - cgroup cgroup rw,memory\n",
        );
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].mount_point, PathBuf::from("/mnt/cg x"));
        assert_eq!(m[0].fstype, "cgroup");
        assert_eq!(m[0].super_opts, vec!["rw", "memory"]);
    }

    #[test]
    fn limits_and_names() {
        let l = Limits::for_guest(3, 1024);
        assert_eq!(l.cpu_millis, 3000);
        assert_eq!(l.cpu_quota_us(), 300_000);
        assert_eq!(l.memory_bytes, (1024 + 512) << 20);
        l.validate().unwrap();
        assert!(Limits { cpu_millis: 5, ..l }.validate().is_err());
        assert_eq!(cgroup_name("sb-abc_1.2"), "sb-abc_1.2");
        assert_eq!(cgroup_name(".."), "vm_..");
        assert_eq!(cgroup_name(""), "vm_");
        assert_eq!(cgroup_name("a/b\nc"), "a_b_c");
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        assert_eq!(parse_cpu_max("150000 100000\n"), Some(1500));
    }
}
