//! The QEMU `microvm` driver.
//!
//! Process model: QEMU is spawned in its own session (`setsid`), stdin from
//! `/dev/null`, stdout and stderr appended to `<run>/qemu.stderr`, its pid written to
//! `<run>/qemu.pid`. Nothing ties it to the starting process, so it keeps running
//! when that process dies (even by `kill -9`), and a later process adopts it.
//! Exit detection: a child is reaped (exit code or signal); an adopted VM is watched
//! through a pidfd. Either way the reason is completed from the QMP events seen
//! (`SHUTDOWN` with its reason, `GUEST_PANICKED`), the tail of `qemu.stderr` and of
//! the console.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata_core::Accel;
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::cgroup::{self, CgroupError, Limits, VmCgroup};
use crate::cmdline::qemu_args;
use crate::console;
use crate::probe::{probe_kvm_cached, DEFAULT_PROBE_TIMEOUT};
use crate::process::{
    find_binary, host_tsc_khz, last_lines, lookup_user, pid_exists, pidfd_open, pidfd_send_signal,
    proc_cmdline, rss_info, tail_file, DEFAULT_VM_USER,
};
use crate::qmp::{QmpClient, QmpError};
use crate::spec::{ResolvedAccel, VmSpec};
use crate::{
    Confinement, RssInfo, SaveMethod, SaveStats, Vm, VmExit, VmStatus, VmmDriver, VmmError,
};

/// How long QEMU may take to create its QMP socket.
const SOCKET_TIMEOUT: Duration = Duration::from_secs(15);
/// Upper bound of a device-state save or load.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(120);
const FD_OUT: &str = "strata-state-out";
const FD_IN: &str = "strata-state-in";

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
        let mut confinement = Confinement {
            run_as: spec.run_as.clone(),
            limits: spec.limits,
            ..Confinement::default()
        };
        // The cgroup is made (limits written) before the spawn; the child joins it
        // between fork and exec, so every page QEMU touches is charged to it.
        let mut cgroup: Option<(VmCgroup, Vec<std::fs::File>)> = None;
        if let Some(limits) = &spec.limits {
            match prepare_cgroup(&spec.name, limits) {
                Ok(c) => cgroup = Some(c),
                Err(e) if limits.required => return Err(e.into()),
                Err(e) => {
                    let msg = error_chain(&e);
                    tracing::warn!(name = %spec.name, error = %msg, "VM starts without cgroup limits");
                    confinement.error = Some(msg);
                }
            }
        }
        let procs_fds: Vec<libc::c_int> = cgroup
            .as_ref()
            .map(|(_, files)| files.iter().map(|f| f.as_raw_fd()).collect())
            .unwrap_or_default();
        let args = qemu_args(spec, host_tsc_khz());
        tracing::debug!(name = %spec.name, ?args, "starting QEMU");
        let mut cmd = std::process::Command::new(&binary);
        cmd.args(&args)
            .current_dir(&spec.run_dir)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        // SAFETY: the closure runs between fork and exec and only makes the
        // async-signal-safe calls setsid(2), umask(2) and write(2) (in `join_self`, on
        // fds opened before the fork, from a vector it only reads); it allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
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
        let pid = child.id().ok_or_else(|| VmmError::SpawnFailed {
            reason: "QEMU exited immediately".into(),
        })?;
        let pidfd = pidfd_open(pid).map_err(|e| VmmError::SpawnFailed {
            reason: format!("pidfd_open({pid}): {e}"),
        })?;
        let pidfd = Arc::new(pidfd);
        // From here on, any failure must not leave the process (or its cgroup) behind.
        let mut guard = KillGuard(Some(pidfd.clone()), None);
        let cgroup = match cgroup {
            Some((cg, files)) => {
                drop(files);
                guard.1 = Some(cg.clone());
                match join_cgroup(&cg, pid) {
                    Ok(()) => confinement.limits_applied = true,
                    Err(e) if spec.limits.is_some_and(|l| l.required) => return Err(e.into()),
                    Err(e) => {
                        let msg = error_chain(&e);
                        tracing::warn!(name = %spec.name, pid, error = %msg, "QEMU runs without cgroup limits");
                        confinement.error = Some(msg);
                    }
                }
                confinement.cgroup_dirs = cg.dirs.clone();
                // Recorded for adopters, which may run in another cgroup than we do.
                let record = spec.cgroup_file();
                if let Ok(json) = serde_json::to_vec(&cg) {
                    std::fs::write(&record, json).map_err(|e| VmmError::io(&record, e))?;
                }
                Some(cg)
            }
            None => None,
        };
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
            (confinement, cgroup),
        )
        .await?;
        let vm = match &spec.incoming {
            Some(state) => {
                vm.load_device_state(state).await?;
                vm
            }
            None => vm,
        };
        if !spec.start_paused {
            vm.resume().await?;
        }
        guard.disarm();
        Ok(vm)
    }

    /// Adopts a running VM and returns the concrete handle (see [`VmmDriver::adopt`]).
    pub async fn adopt_vm(&self, spec: &VmSpec) -> Result<QemuVm, VmmError> {
        let fail = |reason: String| VmmError::AdoptFailed {
            run_dir: spec.run_dir.clone(),
            reason,
        };
        let pid_text = std::fs::read_to_string(spec.pid_file())
            .map_err(|e| fail(format!("cannot read {:?}: {e}", spec.pid_file())))?;
        let pid: u32 = pid_text
            .trim()
            .parse()
            .map_err(|_| fail(format!("pid file holds {:?}", pid_text.trim())))?;
        let pidfd = match pidfd_open(pid) {
            Ok(fd) => fd,
            Err(e) => {
                // The VM died while nobody watched it: its cgroup is empty, drop it.
                if let Some(cg) = std::fs::read(spec.cgroup_file())
                    .ok()
                    .and_then(|b| serde_json::from_slice::<VmCgroup>(&b).ok())
                {
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
        let confined = adopt_confinement(spec, pid);
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

fn check_inputs(spec: &VmSpec) -> Result<(), VmmError> {
    if !spec.kernel.is_file() {
        return Err(VmmError::KernelMissing {
            path: spec.kernel.clone(),
        });
    }
    if let Some(initrd) = &spec.initrd {
        if !initrd.is_file() {
            return Err(VmmError::InitrdMissing {
                path: initrd.clone(),
            });
        }
    }
    if !spec.disk_path.is_file() {
        return Err(VmmError::DiskMissing {
            path: spec.disk_path.clone(),
        });
    }
    if let Some(state) = &spec.incoming {
        if !state.is_file() {
            return Err(VmmError::StateMissing {
                path: state.clone(),
            });
        }
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

/// Creates the VM's cgroup with `limits` and opens its `cgroup.procs` files.
fn prepare_cgroup(
    name: &str,
    limits: &Limits,
) -> Result<(VmCgroup, Vec<std::fs::File>), CgroupError> {
    let cg = VmCgroup::locate(&cgroup::detect()?, name);
    cg.create(limits)?;
    let files = cg.open_procs()?;
    Ok((cg, files))
}

/// Checks the child joined its cgroup before exec; moves it from here if not.
fn join_cgroup(cg: &VmCgroup, pid: u32) -> Result<(), CgroupError> {
    if cg.check_member(pid).is_ok() {
        return Ok(());
    }
    cg.attach(pid)?;
    cg.check_member(pid)
}

/// The confinement of an adopted VM: its cgroup (recorded in `cgroup.json` of the
/// run dir, else located from its name) must already hold the pid.
fn adopt_confinement(spec: &VmSpec, pid: u32) -> (Confinement, Option<VmCgroup>) {
    let mut c = Confinement {
        run_as: spec.run_as.clone(),
        limits: spec.limits,
        ..Confinement::default()
    };
    let Some(limits) = spec.limits else {
        return (c, None);
    };
    let recorded: Option<VmCgroup> = std::fs::read(spec.cgroup_file())
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let cg = match recorded {
        Some(cg) => cg,
        None => match cgroup::detect() {
            Ok(h) => VmCgroup::locate(&h, &spec.name),
            Err(e) => {
                c.error = Some(error_chain(&e));
                return (c, None);
            }
        },
    };
    if let Err(e) = cg.check_member(pid) {
        c.error = Some(error_chain(&e));
        return (c, None);
    }
    c.cgroup_dirs = cg.dirs.clone();
    match cg.read_limits() {
        Ok((cpu, mem)) if cpu == Some(limits.cpu_millis) && mem == Some(limits.memory_bytes) => {
            c.limits_applied = true;
        }
        Ok((cpu, mem)) => {
            c.error = Some(format!(
                "cgroup holds cpu_millis {cpu:?}, memory_bytes {mem:?}; the spec says {}, {}",
                limits.cpu_millis, limits.memory_bytes
            ));
        }
        Err(e) => c.error = Some(error_chain(&e)),
    }
    (c, Some(cg))
}

/// An error and its sources on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// The pid of a QEMU that still runs for this run dir, if any.
fn live_qemu_in(spec: &VmSpec) -> Option<u32> {
    qemu_in_run_dir(&spec.run_dir)
}

/// The pid of the QEMU whose run dir is `run_dir`, if it still runs: read from
/// `qemu.pid` and confirmed by its command line naming `<run_dir>/qmp.sock`
/// (a reused pid or a zombie, whose command line is empty, does not count).
pub fn qemu_in_run_dir(run_dir: &Path) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(run_dir.join("qemu.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let cmdline = proc_cmdline(pid).ok()?;
    cmdline
        .contains(run_dir.join("qmp.sock").to_string_lossy().as_ref())
        .then_some(pid)
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
struct KillGuard(Option<Arc<OwnedFd>>, Option<VmCgroup>);

impl KillGuard {
    fn disarm(mut self) {
        self.0 = None;
        self.1 = None;
    }
}

impl Drop for KillGuard {
    fn drop(&mut self) {
        if let Some(fd) = &self.0 {
            let _ = pidfd_send_signal(fd, libc::SIGKILL);
            if let (Some(cg), Ok(rt)) = (self.1.take(), tokio::runtime::Handle::try_current()) {
                rt.spawn(async move {
                    if let Err(e) = cg.remove().await {
                        tracing::warn!(error = %error_chain(&e), "cgroup of a failed start left behind");
                    }
                });
            }
        }
    }
}

enum Exiter {
    Child(tokio::process::Child),
    Adopted,
}

/// A running QEMU VM.
pub struct QemuVm {
    spec: VmSpec,
    pid: u32,
    pidfd: Arc<OwnedFd>,
    qmp: Arc<QmpClient>,
    expected: Arc<AtomicBool>,
    exit_rx: watch::Receiver<Option<VmExit>>,
    tasks: Vec<JoinHandle<()>>,
    confinement: Confinement,
}

impl std::fmt::Debug for QemuVm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QemuVm")
            .field("name", &self.spec.name)
            .field("pid", &self.pid)
            .field("run_dir", &self.spec.run_dir)
            .finish_non_exhaustive()
    }
}

impl Drop for QemuVm {
    fn drop(&mut self) {
        // The VM keeps running; only this process's watchers stop.
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl QemuVm {
    #[allow(clippy::too_many_arguments)]
    async fn assemble(
        spec: VmSpec,
        pid: u32,
        pidfd: Arc<OwnedFd>,
        qmp: Arc<QmpClient>,
        expected: Arc<AtomicBool>,
        exit_rx: watch::Receiver<Option<VmExit>>,
        exiter: Exiter,
        exit_tx: watch::Sender<Option<VmExit>>,
        (confinement, cgroup): (Confinement, Option<VmCgroup>),
    ) -> Result<Self, VmmError> {
        let mut tasks = Vec::new();
        let stream = console::connect(&spec.console_socket(), Duration::from_secs(5))
            .await
            .map_err(|e| VmmError::io(spec.console_socket(), e))?;
        tasks.push(tokio::spawn(console::copier(
            stream,
            spec.console_log(),
            spec.console_log_max_bytes,
        )));
        tasks.push(tokio::spawn(monitor(
            spec.clone(),
            pidfd.clone(),
            qmp.clone(),
            expected.clone(),
            exiter,
            exit_tx,
            cgroup,
        )));
        Ok(QemuVm {
            spec,
            pid,
            pidfd,
            qmp,
            expected,
            exit_rx,
            tasks,
            confinement,
        })
    }

    /// The QMP client of this VM.
    pub fn qmp_client(&self) -> &QmpClient {
        &self.qmp
    }

    async fn exec(&self, command: &str, args: Option<Value>) -> Result<Value, VmmError> {
        match self.qmp.execute(command, args).await {
            Ok(v) => Ok(v),
            Err(QmpError::Closed) => Err(self.died().await),
            Err(e) => Err(e.into()),
        }
    }

    async fn died(&self) -> VmmError {
        // QMP closed: the process is exiting; give the monitor a moment to say why.
        let exit = tokio::time::timeout(Duration::from_secs(2), self.wait_exit_inner()).await;
        VmmError::ProcessDied {
            reason: match exit {
                Ok(e) => e.reason,
                Err(_) => "QMP connection closed".into(),
            },
        }
    }

    async fn wait_exit_inner(&self) -> VmExit {
        let mut rx = self.exit_rx.clone();
        loop {
            if let Some(e) = rx.borrow_and_update().clone() {
                return e;
            }
            if rx.changed().await.is_err() {
                // The monitor task is gone without a result: only when this handle was dropped.
                return VmExit {
                    reason: "exit watcher stopped".into(),
                    code: None,
                    signal: None,
                    expected: false,
                    events: vec![],
                    stderr_tail: String::new(),
                    console_tail: String::new(),
                };
            }
        }
    }

    async fn migrate_caps(&self) -> Result<(), VmmError> {
        self.exec(
            "migrate-set-capabilities",
            Some(json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]})),
        )
        .await
        .map(|_| ())
    }

    /// Saves device state with an explicit [`SaveMethod`].
    pub async fn save_device_state_with(
        &self,
        path: &Path,
        method: SaveMethod,
    ) -> Result<SaveStats, VmmError> {
        if method == SaveMethod::Exec && self.spec.seccomp {
            // QEMU's seccomp filter (spawn=deny) kills the whole process on fork.
            return Err(VmmError::Migration {
                reason: "exec: migration spawns a process, which this VM's seccomp filter forbids; use SaveMethod::Fd".into(),
            });
        }
        let st = self.status().await?;
        if st.running {
            return Err(VmmError::WrongState {
                status: st.status,
                needed: "paused",
            });
        }
        self.migrate_caps().await?;
        let t0 = Instant::now();
        match method {
            SaveMethod::Fd => {
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(path)
                    .map_err(|e| VmmError::io(path, e))?;
                self.qmp
                    .execute_with_fd("getfd", Some(json!({"fdname": FD_OUT})), file.as_fd())
                    .await?;
                drop(file);
                self.exec("migrate", Some(json!({"uri": format!("fd:{FD_OUT}")})))
                    .await?;
            }
            SaveMethod::Exec => {
                let quoted = shell_quote(&path.to_string_lossy());
                self.exec(
                    "migrate",
                    Some(json!({"uri": format!("exec:cat > {quoted}")})),
                )
                .await?;
            }
        }
        self.wait_migration("save").await?;
        let elapsed = t0.elapsed();
        let bytes = std::fs::metadata(path)
            .map_err(|e| VmmError::io(path, e))?
            .len();
        Ok(SaveStats {
            bytes,
            elapsed,
            method,
        })
    }

    async fn wait_migration(&self, what: &str) -> Result<(), VmmError> {
        let t0 = Instant::now();
        let mut delay = Duration::from_micros(500);
        loop {
            let info = self
                .exec("query-migrate", None)
                .await
                .map_err(|e| match e {
                    VmmError::ProcessDied { reason } => VmmError::Migration {
                        reason: format!("{what}: QEMU died: {reason}"),
                    },
                    other => other,
                })?;
            match info.get("status").and_then(Value::as_str).unwrap_or("none") {
                "completed" => return Ok(()),
                "failed" | "cancelled" => {
                    let desc = info
                        .get("error-desc")
                        .and_then(Value::as_str)
                        .unwrap_or("no description");
                    return Err(VmmError::Migration {
                        reason: format!("{what}: {desc}"),
                    });
                }
                _ => {}
            }
            if t0.elapsed() > MIGRATION_TIMEOUT {
                return Err(VmmError::Migration {
                    reason: format!(
                        "{what}: not completed after {} s",
                        MIGRATION_TIMEOUT.as_secs()
                    ),
                });
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(10));
        }
    }

    async fn load_device_state(&self, state: &Path) -> Result<(), VmmError> {
        self.migrate_caps().await?;
        let file = std::fs::File::open(state).map_err(|e| VmmError::io(state, e))?;
        self.qmp
            .execute_with_fd("getfd", Some(json!({"fdname": FD_IN})), file.as_fd())
            .await?;
        drop(file);
        self.exec(
            "migrate-incoming",
            Some(json!({"uri": format!("fd:{FD_IN}")})),
        )
        .await?;
        // The destination shows the incoming migration in query-migrate; once it is
        // completed the VM is in the run state the source had (paused).
        let t0 = Instant::now();
        loop {
            let st = match self.status().await {
                Ok(s) => s,
                Err(VmmError::ProcessDied { reason }) => {
                    return Err(VmmError::Migration {
                        reason: format!("restore from {state:?}: {reason}"),
                    })
                }
                Err(e) => return Err(e),
            };
            if st.status != "inmigrate" {
                let info = self.exec("query-migrate", None).await?;
                let status = info.get("status").and_then(Value::as_str).unwrap_or("none");
                if status == "failed" {
                    return Err(VmmError::Migration {
                        reason: format!(
                            "restore from {state:?}: {}",
                            info.get("error-desc")
                                .and_then(Value::as_str)
                                .unwrap_or("failed")
                        ),
                    });
                }
                return Ok(());
            }
            if t0.elapsed() > MIGRATION_TIMEOUT {
                return Err(VmmError::Migration {
                    reason: format!(
                        "restore from {state:?}: still loading after {} s",
                        MIGRATION_TIMEOUT.as_secs()
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Waits until `marker` appears in the console log (BootTimeout otherwise).
    pub async fn wait_console(&self, marker: &str, timeout: Duration) -> Result<(), VmmError> {
        let t0 = Instant::now();
        loop {
            if tail_file(&self.spec.console_log(), 64 * 1024).contains(marker) {
                return Ok(());
            }
            if let Some(exit) = self.exited() {
                return Err(VmmError::ProcessDied {
                    reason: exit.reason,
                });
            }
            if t0.elapsed() > timeout {
                return Err(VmmError::BootTimeout {
                    what: format!("console marker {marker:?}"),
                    secs: timeout.as_secs_f64(),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn wait_exit_for(&self, d: Duration) -> Option<VmExit> {
        tokio::time::timeout(d, self.wait_exit_inner()).await.ok()
    }
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[async_trait::async_trait]
impl Vm for QemuVm {
    fn pid(&self) -> u32 {
        self.pid
    }

    fn spec(&self) -> &VmSpec {
        &self.spec
    }

    async fn pause(&self) -> Result<(), VmmError> {
        self.exec("stop", None).await.map(|_| ())
    }

    async fn resume(&self) -> Result<(), VmmError> {
        self.exec("cont", None).await.map(|_| ())
    }

    async fn status(&self) -> Result<VmStatus, VmmError> {
        let v = self.exec("query-status", None).await?;
        Ok(VmStatus {
            status: v
                .get("status")
                .and_then(Value::as_str)
                .unwrap_or("unknown")
                .to_owned(),
            running: v.get("running").and_then(Value::as_bool).unwrap_or(false),
        })
    }

    async fn save_device_state(&self, path: &Path) -> Result<SaveStats, VmmError> {
        self.save_device_state_with(path, SaveMethod::Fd).await
    }

    async fn block_resize(&self, bytes: u64) -> Result<(), VmmError> {
        self.exec(
            "block_resize",
            Some(json!({"device": "disk0", "size": bytes})),
        )
        .await
        .map(|_| ())
    }

    async fn shutdown(&self, timeout: Duration) -> Result<VmExit, VmmError> {
        self.expected.store(true, Ordering::SeqCst);
        let step = timeout / 2;
        if self.exited().is_none() {
            let _ = self.qmp.execute("system_powerdown", None).await;
            if let Some(e) = self.wait_exit_for(step).await {
                return Ok(e);
            }
            let _ = self.qmp.execute("quit", None).await;
            if let Some(e) = self.wait_exit_for(step).await {
                return Ok(e);
            }
        }
        self.kill().await
    }

    async fn kill(&self) -> Result<VmExit, VmmError> {
        self.expected.store(true, Ordering::SeqCst);
        if self.exited().is_none() {
            pidfd_send_signal(&self.pidfd, libc::SIGKILL)
                .map_err(|e| VmmError::io(format!("/proc/{}", self.pid), e))?;
        }
        Ok(self.wait_exit_inner().await)
    }

    fn rss_bytes(&self) -> Result<RssInfo, VmmError> {
        rss_info(self.pid, &self.spec.mem_path)
            .map_err(|e| VmmError::io(format!("/proc/{}", self.pid), e))
    }

    fn agent_socket(&self) -> PathBuf {
        self.spec.agent_socket()
    }

    fn console_tail(&self, n: usize) -> String {
        tail_file(&self.spec.console_log(), n)
    }

    async fn wait_exit(&self) -> VmExit {
        self.wait_exit_inner().await
    }

    fn exited(&self) -> Option<VmExit> {
        self.exit_rx.borrow().clone()
    }

    fn confinement(&self) -> Confinement {
        self.confinement.clone()
    }

    async fn qmp(&self, command: &str, arguments: Option<Value>) -> Result<Value, VmmError> {
        self.exec(command, arguments).await
    }
}

/// Waits for the process to end, then publishes a [`VmExit`].
async fn monitor(
    spec: VmSpec,
    pidfd: Arc<OwnedFd>,
    qmp: Arc<QmpClient>,
    expected: Arc<AtomicBool>,
    exiter: Exiter,
    tx: watch::Sender<Option<VmExit>>,
    cgroup: Option<VmCgroup>,
) {
    let (code, signal) = match exiter {
        Exiter::Child(mut child) => match child.wait().await {
            Ok(st) => {
                use std::os::unix::process::ExitStatusExt;
                (st.code(), st.signal())
            }
            Err(_) => (None, None),
        },
        Exiter::Adopted => {
            wait_pidfd(&pidfd, spec.pid_file().as_path()).await;
            (None, None)
        }
    };
    // QEMU sends SHUTDOWN before it exits; let the QMP reader drain it.
    let t0 = Instant::now();
    while !qmp.is_closed() && t0.elapsed() < Duration::from_millis(500) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The process is gone: its cgroup goes before anyone hears of the exit.
    if let Some(cg) = cgroup {
        if let Err(e) = cg.remove().await {
            tracing::warn!(name = %spec.name, error = %error_chain(&e), "cannot remove the VM's cgroup");
        }
    }
    let events = qmp.events();
    let stderr_tail = last_lines(&tail_file(&spec.stderr_file(), 4096), 5);
    let console_text = tail_file(&spec.console_log(), 32 * 1024);
    let mut console_tail = last_lines(&console_text, 5);
    // A panic's backtrace pushes its headline out of the last lines: keep the headline.
    if let Some(line) = console_text
        .lines()
        .rev()
        .find(|l| l.contains("Kernel panic"))
    {
        if !console_tail.contains("Kernel panic") {
            console_tail = format!("{} | ... | {console_tail}", line.trim());
        }
    }
    let expected = expected.load(Ordering::SeqCst);
    let reason = exit_reason(&events, code, signal, expected, &stderr_tail, &console_tail);
    if expected {
        tracing::info!(name = %spec.name, %reason, "VM exited");
    } else {
        tracing::warn!(name = %spec.name, %reason, "VM exited unexpectedly");
    }
    let _ = tx.send(Some(VmExit {
        reason,
        code,
        signal,
        expected,
        events: events
            .iter()
            .rev()
            .take(16)
            .rev()
            .map(|e| e.event.clone())
            .collect(),
        stderr_tail,
        console_tail,
    }));
}

async fn wait_pidfd(pidfd: &OwnedFd, pid_file: &Path) {
    let registered = pidfd.try_clone().ok().and_then(|fd| {
        // SAFETY: `fd` is an owned, open pidfd that moves into the AsyncFd and stays
        // open, referring to the same process, until the AsyncFd is dropped.
        unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }.ok()
    });
    match registered {
        Some(afd) => {
            let _ = afd.readable().await;
        }
        _ => {
            // No epoll for this fd: poll the pid file's process instead.
            let pid: Option<u32> = std::fs::read_to_string(pid_file)
                .ok()
                .and_then(|s| s.trim().parse().ok());
            while pid.is_some_and(pid_exists) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let _ = pidfd.as_raw_fd();
        }
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGINT => "SIGINT",
        libc::SIGHUP => "SIGHUP",
        libc::SIGSYS => "SIGSYS (seccomp)",
        _ => "signal",
    }
}

fn exit_reason(
    events: &[crate::QmpEvent],
    code: Option<i32>,
    signal: Option<i32>,
    expected: bool,
    stderr_tail: &str,
    console_tail: &str,
) -> String {
    let mut parts = Vec::new();
    let panicked =
        events.iter().any(|e| e.event == "GUEST_PANICKED") || console_tail.contains("Kernel panic");
    if let Some(sd) = events.iter().rev().find(|e| e.event == "SHUTDOWN") {
        let r = sd
            .data
            .get("reason")
            .and_then(Value::as_str)
            .unwrap_or("unknown");
        parts.push(match r {
            "guest-shutdown" => "guest powered off".to_owned(),
            "guest-reset" if panicked => "guest kernel panicked (and reset)".to_owned(),
            "guest-reset" => "guest rebooted (QEMU runs with -no-reboot)".to_owned(),
            "guest-panic" => "guest kernel panicked".to_owned(),
            "host-qmp-quit" => "QEMU quit on host request".to_owned(),
            "host-signal" => "QEMU got a termination signal".to_owned(),
            other => format!("QEMU shut down ({other})"),
        });
    } else if panicked {
        parts.push("guest kernel panicked".to_owned());
    }
    match (code, signal) {
        (_, Some(sig)) => parts.push(format!("QEMU killed by {} ({sig})", signal_name(sig))),
        (Some(0), None) if parts.is_empty() => parts.push("QEMU exited with code 0".into()),
        (Some(0), None) => {}
        (Some(c), None) => parts.push(format!("QEMU exited with code {c}")),
        (None, None) if parts.is_empty() => parts.push(
            "QEMU process disappeared (adopted process: no exit status, no SHUTDOWN event seen)"
                .into(),
        ),
        (None, None) => {}
    }
    if expected {
        parts.push("as requested".into());
    } else if !stderr_tail.is_empty() {
        parts.push(format!("stderr: {stderr_tail}"));
    }
    if panicked && !console_tail.is_empty() {
        parts.push(format!("console: {console_tail}"));
    }
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::QmpEvent;

    fn ev(name: &str, data: Value) -> QmpEvent {
        QmpEvent {
            event: name.into(),
            data,
        }
    }

    #[test]
    fn exit_reasons_read_well() {
        assert_eq!(
            exit_reason(&[], None, Some(9), false, "", ""),
            "QEMU killed by SIGKILL (9)"
        );
        let r = exit_reason(
            &[ev(
                "SHUTDOWN",
                json!({"guest": true, "reason": "guest-reset"}),
            )],
            Some(0),
            None,
            false,
            "",
            "[ 1.0] Kernel panic - not syncing: Attempted to kill init!",
        );
        assert!(
            r.starts_with("guest kernel panicked (and reset); console: "),
            "{r}"
        );
        let r = exit_reason(&[], None, None, false, "qemu: error xyz", "");
        assert!(
            r.contains("no exit status") && r.contains("stderr: qemu: error xyz"),
            "{r}"
        );
        let r = exit_reason(
            &[ev("SHUTDOWN", json!({"reason": "host-qmp-quit"}))],
            Some(0),
            None,
            true,
            "",
            "",
        );
        assert_eq!(r, "QEMU quit on host request; as requested");
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("/a b/it's"), r"'/a b/it'\''s'");
    }
}
