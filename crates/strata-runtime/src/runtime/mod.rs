//! [`Runtime`]: the sandboxes of one host.
//!
//! Contract:
//! - One operation at a time per sandbox (and per template build): every
//!   public operation that changes a sandbox takes its [`Runtime::op_lock`]
//!   first; `*_locked` helpers expect it held.
//! - The runtime keeps only the live VMs of this host ([`vms`]); the daemon
//!   owns the records and says what to do. A failed operation leaves the
//!   sandbox as it was (running if it was running).
//! - Every state subvolume (sandbox, snapshot, template) carries a
//!   `meta.json` ([`crate::meta`]); it is opened in one place,
//!   [`Runtime::open_state`], which says "not found" or "unusable" the same
//!   way for every caller.
//! - QMP stays below this module: the daemon asks the runtime (e.g.
//!   [`Runtime::adopt`] continues a VM left stopped), never QEMU.
//!
//! The rooms: [`vms`] (the live VM table, its death watcher, pause, resume,
//! delete, teardown), [`agent`] (connecting the guest agent, egress, the
//! post-restore sync), [`templates`] (the only cold boot), [`snapshot`]
//! (live snapshots, hibernate, snapshot space), [`start`] (create, fork,
//! create hibernated: a sandbox from a state), [`rewind`] (a sandbox back to
//! one of its states: rewind, restore, wake), [`discovery`] (what survived a
//! restart of the controlling process, and adopting it).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_core::{SandboxId, SnapshotId, TemplateId};
use strata_image::BuiltImage;
use strata_storage::{Pool, PoolConfig};
use strata_vmm::{QemuDriver, ResolvedAccel, VmSpec, VmmDriver};
use tokio::sync::mpsc;

use crate::api::{PoolSetting, RuntimeConfig, Source};
use crate::error::{io_err, storage_err, RuntimeError};
use crate::meta::{files, StateMeta};
use crate::signing::StateHashes;

mod agent;
mod boost;
mod discovery;
mod ports;
mod rewind;
mod signatures;
mod snapshot;
mod start;
mod templates;
mod transfer;
mod usage;
mod vms;
mod warm;

pub use agent::EgressResolver;
pub use boost::{CallBoost, CALL_CPU_WEIGHT};
pub use ports::PortOpenError;
pub use signatures::Adoption;
pub use templates::{TemplateBuilt, SYSTEM_CA_BUNDLE, TRUSTED_CA_PATH};
pub use transfer::{MoveError, ReceivedSnapshot, ReceivedTemplate};
pub use usage::{CpuSource, DiskWrites, VmUsage};
pub use vms::VmDied;
pub use warm::WARM_CPU_WEIGHT;

use vms::Live;

type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// The sandboxes of one host: their VMs, their subvolumes, their agents.
pub struct Runtime {
    cfg: RuntimeConfig,
    /// The network namespace file every QEMU joins (`cfg.netns`).
    netns: Option<PathBuf>,
    pool: Arc<Pool>,
    driver: QemuDriver,
    accel: tokio::sync::OnceCell<ResolvedAccel>,
    qemu_version: String,
    vms: Mutex<HashMap<SandboxId, Arc<Live>>>,
    ops: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    died_tx: mpsc::UnboundedSender<VmDied>,
    died_rx: Mutex<Option<mpsc::UnboundedReceiver<VmDied>>>,
    egress: std::sync::RwLock<Option<EgressResolver>>,
    /// Slots for guests stopped by a snapshot (`cfg.max_concurrent_pauses`).
    pauses: snapshot::PauseGate,
    /// Whether the agent handshake re-sends Hello as soon as QMP reports
    /// the agent port open ([`Runtime::set_hello_on_port_open`]).
    hello_cue: std::sync::atomic::AtomicBool,
    /// Whether a snapshot saves the device state while the btrfs snapshot
    /// is taken (see [`Runtime::set_overlapped_state_save`]).
    overlap_save: std::sync::atomic::AtomicBool,
    /// See [`Runtime::set_commit_before_pause`].
    commit_before_pause: std::sync::atomic::AtomicBool,
    /// See [`Runtime::set_copies_in_pause`].
    copies_in_pause: std::sync::atomic::AtomicBool,
    /// See [`Runtime::set_copies_into_snapshot`].
    copies_into_snapshot: std::sync::atomic::AtomicBool,
    /// Pauses by copies hold it shared while a guest is stopped; the btrfs
    /// commits a snapshot makes after `cont` hold it exclusively, so no
    /// commit of ours runs beside a pause ([`Runtime::set_copies_in_pause`]).
    commit_gate: tokio::sync::RwLock<()>,
    /// See [`Runtime::set_seal_at_snapshot`].
    seal_at_snapshot: std::sync::atomic::AtomicBool,
    /// CPU weight of a VM with a call in flight ([`Runtime::call_boost`]).
    call_weight: std::sync::atomic::AtomicU32,
    /// See [`Runtime::set_pause_boost`].
    pause_boost: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("pool", &self.pool.root())
            .field("qemu", &self.qemu_version)
            .finish()
    }
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

/// Runs blocking pool work off the async threads.
async fn blocking<T, F>(f: F) -> Result<T>
where
    F: FnOnce() -> Result<T> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RuntimeError::Other(format!("blocking task failed: {e}")))?
}

/// First line of `qemu --version`.
pub fn qemu_version(binary: &Path) -> Result<String> {
    let out = std::process::Command::new(binary)
        .arg("--version")
        .output()
        .map_err(|e| {
            io_err(
                format!(
                    "cannot run {} --version (install qemu-system-x86)",
                    binary.display()
                ),
                e,
            )
        })?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned())
}

/// Loads the guest image the runtime boots templates from.
pub fn load_image(dir: &Path) -> Result<BuiltImage> {
    strata_image::load(dir).map_err(|e| {
        RuntimeError::Invalid(format!(
            "no usable guest image in {} ({e}); run `strata image build`",
            dir.display()
        ))
    })
}

/// A state subvolume of the pool, by what it is.
#[derive(Debug, Clone, Copy)]
enum StateRef<'a> {
    /// `sandboxes/<id>`: the writable state of a sandbox.
    Sandbox(&'a SandboxId),
    /// `snapshots/<id>`.
    Snapshot(&'a SnapshotId),
    /// `templates/<id>`.
    Template(&'a TemplateId),
}

impl<'a> From<&'a Source> for StateRef<'a> {
    fn from(s: &'a Source) -> Self {
        match s {
            Source::Template(t) => StateRef::Template(t),
            Source::Snapshot(s) => StateRef::Snapshot(s),
        }
    }
}

impl StateRef<'_> {
    fn name(&self) -> &str {
        match self {
            StateRef::Sandbox(id) => id.as_str(),
            StateRef::Snapshot(id) => id.as_str(),
            StateRef::Template(id) => id.as_str(),
        }
    }
}

/// A state subvolume whose `meta.json` was read.
#[derive(Debug)]
struct OpenState {
    /// Its directory.
    dir: PathBuf,
    /// Its id, as errors name it.
    name: String,
    /// Its metadata.
    meta: StateMeta,
    /// The bytes `meta` was parsed from (what its signature covers).
    meta_bytes: Vec<u8>,
    /// Where a signature outside the subvolume would be (a state made
    /// before signing, adopted); `None` for a sandbox's own subvolume.
    sidecar: Option<PathBuf>,
}

impl OpenState {
    /// Reads the metadata of state `state` in `dir`. A snapshot or template
    /// whose directory is missing is [`RuntimeError::SnapshotNotFound`]; a
    /// metadata file that cannot be read is [`RuntimeError::SnapshotUnusable`].
    /// A sandbox's own subvolume is only opened for a VM running from it
    /// (adopt): there a missing one is unusable state, not an unknown id.
    fn open(dir: PathBuf, state: StateRef<'_>) -> Result<OpenState> {
        let name = state.name().to_owned();
        if !matches!(state, StateRef::Sandbox(_)) && !dir.exists() {
            return Err(RuntimeError::SnapshotNotFound(name));
        }
        match StateMeta::read_with_bytes(&dir) {
            Ok((meta, meta_bytes)) => Ok(OpenState {
                dir,
                name,
                meta,
                meta_bytes,
                sidecar: None,
            }),
            Err(e) => Err(RuntimeError::SnapshotUnusable {
                id: name,
                reason: e.0,
            }),
        }
    }

    /// Refuses a state a VM of this host (`qemu_version`, `accel`) cannot
    /// restore, or one missing a file a restore needs.
    fn check_restorable(&self, qemu_version: &str, accel: ResolvedAccel) -> Result<()> {
        self.meta
            .check_restorable(&self.dir, qemu_version, accel.qemu_name())
            .map_err(|e| RuntimeError::SnapshotUnusable {
                id: self.name.clone(),
                reason: e.0,
            })
    }
}

impl Runtime {
    /// Opens the pool (creating and mounting it in image mode) and checks QEMU.
    pub async fn open(cfg: RuntimeConfig) -> Result<Arc<Runtime>> {
        let pool_cfg = match &cfg.pool {
            PoolSetting::Path(p) => PoolConfig::Path(p.clone()),
            PoolSetting::Image {
                image,
                size_bytes,
                mount_point,
            } => PoolConfig::Image {
                image: image.clone(),
                size_bytes: *size_bytes,
                mount_point: mount_point.clone(),
            },
        };
        check_vm_user(&cfg)?;
        let netns = match &cfg.netns {
            Some(name) => {
                let name = name.clone();
                Some(
                    blocking(move || {
                        strata_vmm::netns::ensure(&name)
                            .map_err(|e| RuntimeError::Invalid(format!("network namespace: {e}")))
                    })
                    .await?,
                )
            }
            None => {
                tracing::warn!("netns is off: QEMU runs in the host's network namespace");
                None
            }
        };
        if cfg.cgroups && !cfg.cgroups_required {
            tracing::warn!("cgroups are not required: a VM whose cgroup cannot be set up runs without CPU and memory limits");
        } else if !cfg.cgroups {
            tracing::warn!("cgroups are off: VMs run without CPU and memory limits");
        }
        let pool = blocking(move || Pool::open(&pool_cfg).map_err(storage_err)).await?;
        std::fs::create_dir_all(&cfg.run_dir).map_err(|e| io_err("create run dir", e))?;
        let qemu_version = qemu_version(&cfg.qemu_binary)?;
        let (died_tx, died_rx) = mpsc::unbounded_channel();
        let pauses = snapshot::PauseGate::new(cfg.max_concurrent_pauses);
        Ok(Arc::new(Runtime {
            pauses,
            cfg,
            netns,
            pool: Arc::new(pool),
            driver: QemuDriver::new(),
            accel: tokio::sync::OnceCell::new(),
            qemu_version,
            vms: Mutex::new(HashMap::new()),
            ops: Mutex::new(HashMap::new()),
            died_tx,
            died_rx: Mutex::new(Some(died_rx)),
            egress: std::sync::RwLock::new(None),
            hello_cue: std::sync::atomic::AtomicBool::new(true),
            overlap_save: std::sync::atomic::AtomicBool::new(true),
            commit_before_pause: std::sync::atomic::AtomicBool::new(true),
            copies_in_pause: std::sync::atomic::AtomicBool::new(true),
            copies_into_snapshot: std::sync::atomic::AtomicBool::new(true),
            commit_gate: tokio::sync::RwLock::new(()),
            seal_at_snapshot: std::sync::atomic::AtomicBool::new(false),
            call_weight: std::sync::atomic::AtomicU32::new(boost::CALL_CPU_WEIGHT),
            pause_boost: std::sync::atomic::AtomicBool::new(true),
        }))
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The configuration.
    pub fn config(&self) -> &RuntimeConfig {
        &self.cfg
    }

    /// QEMU version string recorded in snapshots.
    pub fn qemu_version(&self) -> &str {
        &self.qemu_version
    }

    /// The accelerator, resolved once (KVM probe with the image's kernel for `auto`).
    pub async fn accel(&self) -> Result<ResolvedAccel> {
        let requested = self.cfg.accel;
        let image_dir = self.cfg.image_dir.clone();
        self.accel
            .get_or_try_init(|| async {
                let probe_kernel = match requested {
                    strata_core::Accel::Tcg => return Ok(ResolvedAccel::Tcg),
                    strata_core::Accel::Kvm => return Ok(ResolvedAccel::Kvm),
                    strata_core::Accel::Auto => {
                        let img = load_image(&image_dir)?;
                        img.kernel.clone()
                    }
                };
                Ok(self.driver.resolve_accel(requested, &probe_kernel).await)
            })
            .await
            .copied()
    }

    fn sandbox_dir(&self, id: &SandboxId) -> PathBuf {
        self.pool.sandboxes_dir().join(id.as_str())
    }

    fn snapshot_dir(&self, id: &SnapshotId) -> PathBuf {
        self.pool.snapshots_dir().join(id.as_str())
    }

    fn template_dir(&self, id: &TemplateId) -> PathBuf {
        self.pool.templates_dir().join(id.as_str())
    }

    fn state_dir(&self, state: StateRef<'_>) -> PathBuf {
        match state {
            StateRef::Sandbox(id) => self.sandbox_dir(id),
            StateRef::Snapshot(id) => self.snapshot_dir(id),
            StateRef::Template(id) => self.template_dir(id),
        }
    }

    fn run_dir(&self, name: &str) -> PathBuf {
        self.cfg.run_dir.join(name)
    }

    /// Waits for and holds the lock of one sandbox (or template build):
    /// one operation at a time; released when the guard drops.
    async fn op_lock(&self, key: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
            ops.entry(key.to_owned()).or_default().clone()
        };
        lock.lock_owned().await
    }

    fn agent_timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.agent_timeout_ms)
    }

    /// Reads the metadata of a state subvolume ([`OpenState::open`]).
    fn open_state(&self, state: StateRef<'_>) -> Result<OpenState> {
        let mut st = OpenState::open(self.state_dir(state), state)?;
        st.sidecar = self.sidecar_path(state);
        Ok(st)
    }

    /// [`Runtime::open_state`], then refuses a state this host cannot
    /// restore or whose signature does not verify; what every start from a
    /// state checks first. Also returns the verified state's hashes.
    async fn open_restorable(
        &self,
        state: StateRef<'_>,
    ) -> Result<(OpenState, ResolvedAccel, Option<StateHashes>)> {
        let st = self.open_state(state)?;
        let accel = self.accel().await?;
        st.check_restorable(&self.qemu_version, accel)?;
        let hashes = self.check_signature(&st, &st.dir)?;
        Ok((st, accel, hashes))
    }

    /// Moves a subvolume to the pool's trash if it exists. Idempotent.
    async fn trash_if_exists(&self, dir: PathBuf) -> Result<()> {
        let pool = self.pool.clone();
        blocking(move || {
            if dir.exists() {
                pool.trash(&dir).map_err(storage_err)?;
            }
            Ok(())
        })
        .await
    }

    /// The VM spec of a state directory `dir` running as `name`.
    fn spec_for(&self, name: &str, dir: &Path, meta: &StateMeta, accel: ResolvedAccel) -> VmSpec {
        let mut spec = VmSpec::new(
            name,
            self.run_dir(name),
            dir.join(files::KERNEL),
            dir.join(files::MEM),
            dir.join(files::DISK),
        );
        spec.initrd = Some(dir.join(files::INITRD));
        spec.cmdline = meta.cmdline.clone();
        spec.vcpus = meta.size.vcpus;
        spec.memory_mib = u64::from(meta.size.memory_mib);
        spec.accel = accel;
        spec.tcg_tb_size_mib = self.cfg.tcg_tb_size_mib;
        spec.guest_disk_flush = self.cfg.guest_disk_flush;
        spec.layout = meta.layout_version;
        spec.net = meta.net.clone();
        spec.console_log_max_bytes = self.cfg.console_log_max_bytes;
        spec.qemu_binary = self.cfg.qemu_binary.clone();
        spec.run_as = self.cfg.run_as.clone();
        if self.cfg.cgroups {
            let mut limits =
                strata_vmm::Limits::for_guest(meta.size.vcpus, u64::from(meta.size.memory_mib));
            limits.required = self.cfg.cgroups_required;
            spec.limits = Some(limits);
        }
        // Host-side only (not in the device layout): any state restores with them.
        spec.netns = self.netns.clone();
        spec.disk_throttle = self.cfg.disk_throttle;
        spec
    }
}

/// Refuses a configuration that would run QEMU as root without `allow_root`,
/// and a `run_as` user that does not exist.
fn check_vm_user(cfg: &RuntimeConfig) -> Result<()> {
    match &cfg.run_as {
        Some(user) if strata_vmm::lookup_user(user).is_none() => Err(RuntimeError::Invalid(format!(
            "run_as user {user:?} does not exist on this host (scripts/setup.sh creates {:?})",
            strata_vmm::DEFAULT_VM_USER
        ))),
        Some(_) => Ok(()),
        // SAFETY: geteuid has no arguments and cannot fail.
        None if unsafe { libc::geteuid() } == 0 && !cfg.allow_root => Err(RuntimeError::Invalid(format!(
            "QEMU would run as root: create the user {:?} (scripts/setup.sh) or allow it explicitly ([vm] allow_root = true)",
            strata_vmm::DEFAULT_VM_USER
        ))),
        None => {
            // SAFETY: as above.
            if unsafe { libc::geteuid() } == 0 {
                tracing::warn!("[vm] allow_root: QEMU runs as root; a guest that escapes QEMU owns this host");
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::tests::{meta, populated};

    #[test]
    fn open_state_says_not_found_or_unusable_the_same_way_for_all() {
        let snap = SnapshotId::generate();
        let tpl = TemplateId::generate();
        let sb = SandboxId::generate();
        let gone = std::path::Path::new("/nonexistent/strata-state");
        let e = OpenState::open(gone.into(), StateRef::Snapshot(&snap)).unwrap_err();
        assert!(
            matches!(e, RuntimeError::SnapshotNotFound(ref n) if n == snap.as_str()),
            "{e}"
        );
        let e = OpenState::open(gone.into(), StateRef::Template(&tpl)).unwrap_err();
        assert!(matches!(e, RuntimeError::SnapshotNotFound(_)), "{e}");
        // A sandbox's own state that is missing is unusable, not unknown.
        let e = OpenState::open(gone.into(), StateRef::Sandbox(&sb)).unwrap_err();
        assert!(
            matches!(e, RuntimeError::SnapshotUnusable { ref id, .. } if id == sb.as_str()),
            "{e}"
        );

        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(files::META), b"{").unwrap();
        let e = OpenState::open(d.path().into(), StateRef::Snapshot(&snap)).unwrap_err();
        assert!(matches!(e, RuntimeError::SnapshotUnusable { .. }), "{e}");
    }

    #[test]
    fn open_state_reads_and_checks_restorable() {
        let d = populated();
        meta().write(d.path()).unwrap();
        let snap = SnapshotId::generate();
        let st = OpenState::open(d.path().into(), StateRef::Snapshot(&snap)).unwrap();
        assert_eq!(st.name, snap.as_str());
        assert_eq!(st.meta.size, meta().size);
        st.check_restorable("QEMU 7.2", ResolvedAccel::Tcg).unwrap();
        let e = st
            .check_restorable("QEMU 7.2", ResolvedAccel::Kvm)
            .unwrap_err();
        assert!(
            matches!(e, RuntimeError::SnapshotUnusable { ref id, ref reason } if id == snap.as_str() && reason.contains("kvm")),
            "{e}"
        );
    }

    #[test]
    fn qemu_never_runs_as_root_unless_allowed() {
        let mut cfg = RuntimeConfig::new(PoolSetting::Path("/p".into()), "/r", "/i");
        cfg.run_as = None;
        // SAFETY: geteuid has no arguments and cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            let e = check_vm_user(&cfg).unwrap_err();
            assert!(e.to_string().contains("allow_root"), "{e}");
        }
        cfg.allow_root = true;
        check_vm_user(&cfg).unwrap();
        cfg.run_as = Some("no-such-user-strata".into());
        let e = check_vm_user(&cfg).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
        // The defaults: cgroups required, the named empty network namespace.
        let d = RuntimeConfig::new(PoolSetting::Path("/p".into()), "/r", "/i");
        assert!(d.cgroups && d.cgroups_required && !d.allow_root);
        assert_eq!(d.netns.as_deref(), Some(strata_vmm::netns::DEFAULT_NETNS));
        assert_eq!(d.disk_throttle, None);
    }

    #[test]
    fn sources_name_their_state() {
        let t = TemplateId::generate();
        let src = Source::Template(t.clone());
        let r = StateRef::from(&src);
        assert!(matches!(r, StateRef::Template(_)));
        assert_eq!(r.name(), t.as_str());
    }
}
