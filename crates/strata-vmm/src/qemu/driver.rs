//! [`QemuDriver`]: starting a VM, and adopting one another process started.
//!
//! Contract of a start ([`QemuDriver::start_vm`]): the spec and its input files are
//! checked; the run dir is made owner-only (0700) and must hold no live QEMU; the stale
//! sockets are removed; QEMU is spawned in its own session with umask 077, inside its
//! cgroup (`confine`) and its network namespace (`spec.netns`), and its pid is written to `<run>/qemu.pid`; the driver waits for
//! the QMP socket, restores the device state when `spec.incoming` is set and runs the
//! vCPUs unless `spec.start_paused`. Until that returns, a failure kills the process
//! and removes its cgroup (`KillGuard`): a failed start leaves nothing running.
//!
//! Contract of an adoption ([`QemuDriver::adopt_vm`]): the pid comes from
//! `<run>/qemu.pid` and counts only if its command line names `<run>/qmp.sock` (see
//! [`qemu_in_run_dir`]); the process is held by a pidfd from then on, so a reused pid
//! cannot be mistaken for it. QMP accepts one client: a VM is adopted by one process
//! at a time.

use std::os::fd::{AsRawFd as _, OwnedFd};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_core::Accel;
use tokio::sync::watch;

use super::confine;
use super::error_chain;
use super::exit::Exiter;
use super::vm::QemuVm;
use crate::cgroup::{self, VmCgroup};
use crate::cmdline::qemu_args;
use crate::probe::{probe_kvm_cached, DEFAULT_PROBE_TIMEOUT};
use crate::process::{
    find_binary, host_tsc_khz, last_lines, lookup_user, pidfd_open, pidfd_send_signal,
    proc_cmdline, tail_file, DEFAULT_VM_USER,
};
use crate::qmp::{QmpClient, QmpError};
use crate::spec::{ResolvedAccel, VmSpec};
use crate::{StartTimings, Vm, VmmDriver, VmmError};

/// How long QEMU may take to create its QMP socket.
const SOCKET_TIMEOUT: Duration = Duration::from_secs(15);

/// Settings of the QEMU driver.
#[derive(Debug, Clone)]
pub struct QemuDriver {
    /// Default timeout of QMP commands.
    pub qmp_timeout: Duration,
    /// Time the KVM probe boot may take.
    pub probe_timeout: Duration,
}

impl Default for QemuDriver {
    fn default() -> Self {
        QemuDriver {
            qmp_timeout: Duration::from_secs(30),
            probe_timeout: DEFAULT_PROBE_TIMEOUT,
        }
    }
}

impl QemuDriver {
    /// A driver with default settings.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts a VM and returns the concrete handle (see [`VmmDriver::start`]).
    pub async fn start_vm(&self, spec: &VmSpec) -> Result<QemuVm, VmmError> {
        let called = Instant::now();
        spec.validate().map_err(VmmError::InvalidSpec)?;
        let binary = find_binary(&spec.qemu_binary).ok_or_else(|| VmmError::QemuNotFound {
            binary: spec.qemu_binary.clone(),
        })?;
        check_inputs(spec)?;
        if let Some(user) = &spec.run_as {
            if lookup_user(user).is_none() {
                return Err(VmmError::InvalidSpec(format!(
                    "run_as user {user:?} does not exist on this host (scripts/setup.sh creates {DEFAULT_VM_USER:?})"
                )));
            }
        }
        std::fs::create_dir_all(&spec.run_dir).map_err(|e| VmmError::io(&spec.run_dir, e))?;
        secure_run_dir(&spec.run_dir)?;
        if let Some(pid) = live_qemu_in(spec) {
            return Err(VmmError::InvalidSpec(format!(
                "a QEMU (pid {pid}) already runs in {:?}",
                spec.run_dir
            )));
        }
        for sock in [
            spec.qmp_socket(),
            spec.agent_socket(),
            spec.console_socket(),
        ] {
            match std::fs::remove_file(&sock) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(VmmError::io(sock, e)),
            }
        }

        let stderr_path = spec.stderr_file();
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&stderr_path)
            .map_err(|e| VmmError::io(&stderr_path, e))?;
        let stdout = stderr
            .try_clone()
            .map_err(|e| VmmError::io(&stderr_path, e))?;
        // Opened before the fork: the child only calls setns(2) on it.
        let netns = spec.netns.as_deref().map(crate::netns::open).transpose()?;
        let netns_fd = netns.as_ref().map(|f| f.as_raw_fd());
        let pending = confine::prepare(spec)?;
        let procs_fds = pending.procs_fds();
        let args = qemu_args(spec, host_tsc_khz());
        tracing::debug!(name = %spec.name, ?args, "starting QEMU");
        let mut cmd = std::process::Command::new(&binary);
        cmd.args(&args)
            .current_dir(&spec.run_dir)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        // SAFETY: the closure runs between fork and exec and only makes the
        // async-signal-safe calls setsid(2), setns(2) (on a descriptor opened before
        // the fork and kept open until the spawn returns), umask(2) and write(2) (in
        // `join_self`, on fds opened before the fork, from a vector it only reads);
        // it allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The VMs' empty network namespace: no host network for QEMU.
                if let Some(fd) = netns_fd {
                    if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                // Sockets and the RAM file QEMU creates: owner only.
                libc::umask(0o077);
                cgroup::join_self(&procs_fds);
                Ok(())
            });
        }
        let mut child = tokio::process::Command::from(cmd)
            .kill_on_drop(false)
            .spawn()
            .map_err(|e| VmmError::SpawnFailed {
                reason: format!("cannot execute {binary:?}: {e}"),
            })?;
        drop(netns);
        let spawned = Instant::now();
        let pid = child.id().ok_or_else(|| VmmError::SpawnFailed {
            reason: "QEMU exited immediately".into(),
        })?;
        let pidfd = pidfd_open(pid).map_err(|e| VmmError::SpawnFailed {
            reason: format!("pidfd_open({pid}): {e}"),
        })?;
        let pidfd = Arc::new(pidfd);
        // From here on, any failure must not leave the process (or its cgroup) behind.
        let mut guard = KillGuard {
            pidfd: Some(pidfd.clone()),
            cgroup: None,
        };
        let confined = pending.settle(spec, pid, &mut guard.cgroup)?;
        write_pid_file(spec, pid)?;

        let qmp = match wait_qmp(spec, self.qmp_timeout, || {
            child.try_wait().ok().flatten().is_some()
        })
        .await
        {
            Ok(q) => q,
            Err(e) => {
                let _ = child.wait().await;
                return Err(VmmError::SpawnFailed {
                    reason: format!(
                        "{e}; stderr: {}",
                        last_lines(&tail_file(&stderr_path, 2048), 3)
                    ),
                });
            }
        };
        let qmp_ready = Instant::now();
        let expected = Arc::new(AtomicBool::new(false));
        let (exit_tx, exit_rx) = watch::channel(None);
        let vm = QemuVm::assemble(
            spec.clone(),
            pid,
            pidfd,
            Arc::new(qmp),
            expected,
            exit_rx,
            Exiter::Child(child),
            exit_tx,
            confined,
        )
        .await?;
        let assembled = Instant::now();
        let incoming_done = match &spec.incoming {
            Some(state) => {
                vm.load_device_state(state).await?;
                Some(Instant::now())
            }
            None => None,
        };
        let running = if spec.start_paused {
            None
        } else {
            vm.resume().await?;
            Some(Instant::now())
        };
        let timings = StartTimings {
            called,
            spawned,
            qmp_ready,
            assembled,
            incoming_done,
            running,
        };
        let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1000.0;
        tracing::debug!(
            name = %spec.name,
            spawn_ms = ms(called, spawned),
            qmp_ms = ms(spawned, qmp_ready),
            assemble_ms = ms(qmp_ready, assembled),
            incoming_ms = incoming_done.map(|t| ms(assembled, t)),
            cont_ms = running.map(|t| ms(incoming_done.unwrap_or(assembled), t)),
            "VM started"
        );
        *vm.timings.lock().unwrap_or_else(|p| p.into_inner()) = Some(timings);
        guard.disarm();
        Ok(vm)
    }

    /// Adopts a running VM and returns the concrete handle (see [`VmmDriver::adopt`]).
    pub async fn adopt_vm(&self, spec: &VmSpec) -> Result<QemuVm, VmmError> {
        let fail = |reason: String| VmmError::AdoptFailed {
            run_dir: spec.run_dir.clone(),
            reason,
        };
        // The pid file, or the process whose command line names this run
        // dir (a pid file the previous process never wrote).
        let Some(pid) = qemu_in_run_dir(&spec.run_dir) else {
            // The VM died while nobody watched it: its cgroup is empty, drop it.
            if let Some(cg) = confine::recorded(spec) {
                let _ = cg.remove().await;
            }
            return Err(fail(format!("no live QEMU for {:?}", spec.run_dir)));
        };
        let pidfd = match pidfd_open(pid) {
            Ok(fd) => fd,
            Err(e) => {
                // The VM died while nobody watched it: its cgroup is empty, drop it.
                if let Some(cg) = confine::recorded(spec) {
                    let _ = cg.remove().await;
                }
                return Err(fail(format!("process {pid} is gone ({e})")));
            }
        };
        let cmdline = proc_cmdline(pid).map_err(|e| fail(format!("process {pid}: {e}")))?;
        let qmp_path = spec.qmp_socket().to_string_lossy().into_owned();
        if !cmdline.contains(&qmp_path) {
            return Err(fail(format!(
                "pid {pid} is not the QEMU of this run dir (its command line lacks {qmp_path})"
            )));
        }
        let qmp = QmpClient::connect(&spec.qmp_socket(), self.qmp_timeout)
            .await
            .map_err(|e| fail(format!("QMP: {e} (is another process attached?)")))?;
        let confined = confine::adopt_confinement(spec, pid);
        let (exit_tx, exit_rx) = watch::channel(None);
        let vm = QemuVm::assemble(
            spec.clone(),
            pid,
            Arc::new(pidfd),
            Arc::new(qmp),
            Arc::new(AtomicBool::new(false)),
            exit_rx,
            Exiter::Adopted,
            exit_tx,
            confined,
        )
        .await?;
        Ok(vm)
    }
}

#[async_trait::async_trait]
impl VmmDriver for QemuDriver {
    fn name(&self) -> &'static str {
        "qemu"
    }

    async fn resolve_accel(&self, requested: Accel, probe_kernel: &Path) -> ResolvedAccel {
        match requested {
            Accel::Tcg => ResolvedAccel::Tcg,
            Accel::Kvm => ResolvedAccel::Kvm,
            Accel::Auto => {
                let qemu = find_binary(Path::new(crate::DEFAULT_QEMU))
                    .unwrap_or_else(|| PathBuf::from(crate::DEFAULT_QEMU));
                probe_kvm_cached(&qemu, probe_kernel, self.probe_timeout)
                    .await
                    .accel()
            }
        }
    }

    async fn start(&self, spec: &VmSpec) -> Result<Box<dyn Vm>, VmmError> {
        Ok(Box::new(self.start_vm(spec).await?))
    }

    async fn adopt(&self, spec: &VmSpec) -> Result<Box<dyn Vm>, VmmError> {
        Ok(Box::new(self.adopt_vm(spec).await?))
    }
}

/// Checks that the files the spec names exist: kernel, initrd, disk, and for a restore
/// the device state and a RAM file of the guest's size.
fn check_inputs(spec: &VmSpec) -> Result<(), VmmError> {
    require_file(&spec.kernel, |path| VmmError::KernelMissing { path })?;
    if let Some(initrd) = &spec.initrd {
        require_file(initrd, |path| VmmError::InitrdMissing { path })?;
    }
    require_file(&spec.disk_path, |path| VmmError::DiskMissing { path })?;
    if let Some(state) = &spec.incoming {
        require_file(state, |path| VmmError::StateMissing { path })?;
        let mem_len = std::fs::metadata(&spec.mem_path)
            .map(|m| m.len())
            .map_err(|_| {
                VmmError::InvalidSpec(format!(
                    "restore needs the guest RAM file {:?}, which does not exist",
                    spec.mem_path
                ))
            })?;
        if mem_len != spec.memory_mib << 20 {
            return Err(VmmError::InvalidSpec(format!(
                "guest RAM file {:?} has {mem_len} bytes, the spec says {} MiB",
                spec.mem_path, spec.memory_mib
            )));
        }
    }
    if let (crate::spec::RamBacking::File, Some(parent)) = (spec.ram, spec.mem_path.parent()) {
        if !parent.as_os_str().is_empty() && !parent.is_dir() {
            return Err(VmmError::InvalidSpec(format!(
                "directory of mem_path {parent:?} does not exist"
            )));
        }
    }
    Ok(())
}

/// Makes the run dir (the agent, QMP and console sockets, logs, pid file) reachable
/// by its owner only: mode 0700, owned by this process's user. A symlink is refused.
fn secure_run_dir(dir: &Path) -> Result<(), VmmError> {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let meta = std::fs::symlink_metadata(dir).map_err(|e| VmmError::io(dir, e))?;
    if !meta.is_dir() {
        return Err(VmmError::InvalidSpec(format!(
            "run_dir {dir:?} is not a directory (symlinks are refused)"
        )));
    }
    // SAFETY: geteuid/getegid have no arguments and cannot fail.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    if meta.uid() != uid {
        std::os::unix::fs::chown(dir, Some(uid), Some(gid)).map_err(|e| VmmError::io(dir, e))?;
    }
    if meta.mode() & 0o7777 != 0o700 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| VmmError::io(dir, e))?;
    }
    Ok(())
}

/// `Ok` if `path` is a file, else the error `missing` makes of it.
fn require_file(path: &Path, missing: fn(PathBuf) -> VmmError) -> Result<(), VmmError> {
    if path.is_file() {
        Ok(())
    } else {
        Err(missing(path.to_path_buf()))
    }
}

/// The pid of a QEMU that still runs for this run dir, if any.
fn live_qemu_in(spec: &VmSpec) -> Option<u32> {
    qemu_in_run_dir(&spec.run_dir)
}

/// The pid of the QEMU whose run dir is `run_dir`, if it still runs: read from
/// `qemu.pid` and confirmed by its command line naming `<run_dir>/qmp.sock`
/// (a reused pid or a zombie, whose command line is empty, does not count).
/// Without a usable pid file (a process killed between the spawn and the
/// file's write) the process table is searched for the QEMU whose command
/// line names this run dir's QMP socket.
pub fn qemu_in_run_dir(run_dir: &Path) -> Option<u32> {
    let by_file = std::fs::read_to_string(run_dir.join("qemu.pid"))
        .ok()
        .and_then(|t| t.trim().parse::<u32>().ok())
        .filter(|&pid| {
            proc_cmdline(pid)
                .is_ok_and(|c| c.contains(run_dir.join("qmp.sock").to_string_lossy().as_ref()))
        });
    by_file.or_else(|| {
        let root = run_dir.parent()?;
        crate::process::qemus_under(root)
            .into_iter()
            .find_map(|(dir, pid)| (dir == run_dir).then_some(pid))
    })
}

fn write_pid_file(spec: &VmSpec, pid: u32) -> Result<(), VmmError> {
    let path = spec.pid_file();
    let tmp = spec.run_dir.join("qemu.pid.tmp");
    std::fs::write(&tmp, format!("{pid}\n")).map_err(|e| VmmError::io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| VmmError::io(&path, e))
}

async fn wait_qmp(
    spec: &VmSpec,
    timeout: Duration,
    mut exited: impl FnMut() -> bool,
) -> Result<QmpClient, String> {
    let sock = spec.qmp_socket();
    let deadline = Instant::now() + SOCKET_TIMEOUT;
    loop {
        if exited() {
            return Err("QEMU exited during startup".into());
        }
        if sock.exists() {
            match QmpClient::connect(&sock, timeout).await {
                Ok(q) => return Ok(q),
                Err(QmpError::Connect { .. }) => {}
                Err(e) => return Err(format!("QMP handshake failed: {e}")),
            }
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "QMP socket {sock:?} did not appear within {} s",
                SOCKET_TIMEOUT.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Kills the process on drop unless disarmed (startup failures leave nothing behind),
/// and removes its cgroup once it is gone.
struct KillGuard {
    pidfd: Option<Arc<OwnedFd>>,
    cgroup: Option<VmCgroup>,
}

impl KillGuard {
    fn disarm(mut self) {
        self.pidfd = None;
        self.cgroup = None;
    }
}

impl Drop for KillGuard {
    fn drop(&mut self) {
        if let Some(fd) = &self.pidfd {
            let _ = pidfd_send_signal(fd, libc::SIGKILL);
            if let (Some(cg), Ok(rt)) = (self.cgroup.take(), tokio::runtime::Handle::try_current())
            {
                rt.spawn(async move {
                    if let Err(e) = cg.remove().await {
                        tracing::warn!(error = %error_chain(&e), "cgroup of a failed start left behind");
                    }
                });
            }
        }
    }
}
