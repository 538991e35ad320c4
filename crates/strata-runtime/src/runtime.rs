//! [`Runtime`]: the sandboxes of one host.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use rand::RngCore;
use strata_core::{SandboxId, SandboxSize, SnapshotId, TemplateId};
use strata_image::BuiltImage;
use strata_proto::client::{AgentClient, AgentError, ExecRequest, TunnelHandler};
use strata_proto::msg::RestoreSync;
use strata_storage::{Pool, PoolConfig, StorageError, UsageMethod};
use strata_vmm::{QemuDriver, ResolvedAccel, Vm, VmSpec, VmmDriver, VmmError};
use tokio::sync::mpsc;

use crate::api::{PoolSetting, RuntimeConfig, SnapshotInfo, Source, SpaceUsage, VmInfo};
use crate::error::RuntimeError;
use crate::meta::{files, layout_hash, StateMeta, SNAPSHOT_FORMAT_VERSION};

type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// Free pool space below which snapshots and new sandboxes are refused (`PoolFull`).
pub const MIN_FREE_BYTES: u64 = 256 << 20;

/// A VM that died without being asked to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmDied {
    /// Its sandbox.
    pub id: SandboxId,
    /// What is known about the death.
    pub reason: String,
}

/// A live VM of this host.
struct Live {
    vm: Box<dyn Vm>,
    agent: tokio::sync::Mutex<Option<AgentClient>>,
    size: SandboxSize,
    /// Set before the runtime itself stops the VM, so the watcher stays quiet.
    stopping: AtomicBool,
}

/// Figures of a template build.
#[derive(Debug, Clone)]
pub struct TemplateBuilt {
    /// Template id.
    pub id: TemplateId,
    /// Size the template guest runs with.
    pub size: SandboxSize,
    /// Accelerator.
    pub accel: String,
    /// Cold boot to agent-ready, in ms.
    pub boot_ms: f64,
    /// Whole build, in ms.
    pub build_ms: f64,
}

/// The sandboxes of one host: their VMs, their subvolumes, their agents.
pub struct Runtime {
    cfg: RuntimeConfig,
    pool: Arc<Pool>,
    driver: QemuDriver,
    accel: tokio::sync::OnceCell<ResolvedAccel>,
    qemu_version: String,
    vms: Mutex<HashMap<SandboxId, Arc<Live>>>,
    ops: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    died_tx: mpsc::UnboundedSender<VmDied>,
    died_rx: Mutex<Option<mpsc::UnboundedReceiver<VmDied>>>,
    egress: std::sync::RwLock<Option<EgressResolver>>,
}

/// Finds the egress target (the host's policy proxy) of one sandbox; `None`
/// leaves its egress closed. Called whenever the host (re)connects to a
/// sandbox's agent, e.g. after every restore.
pub type EgressResolver = Arc<
    dyn Fn(
            SandboxId,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Option<std::net::SocketAddr>> + Send>,
        > + Send
        + Sync,
>;

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("pool", &self.pool.root())
            .field("qemu", &self.qemu_version)
            .finish()
    }
}

fn storage_err(e: StorageError) -> RuntimeError {
    if e.is_no_space() {
        RuntimeError::PoolFull
    } else {
        RuntimeError::Other(format!("storage: {e}"))
    }
}

fn vmm_err(id: &str, e: VmmError) -> RuntimeError {
    RuntimeError::VmFailed {
        id: id.to_owned(),
        reason: e.to_string(),
    }
}

fn io_err(what: &str, e: std::io::Error) -> RuntimeError {
    if e.raw_os_error() == Some(libc::ENOSPC) {
        RuntimeError::PoolFull
    } else {
        RuntimeError::Other(format!("{what}: {e}"))
    }
}

fn agent_err(id: &str, e: AgentError, timeout: Duration) -> RuntimeError {
    match e {
        AgentError::ConnectTimeout(_) | AgentError::Timeout => RuntimeError::AgentTimeout {
            id: id.to_owned(),
            timeout_ms: timeout.as_millis() as u64,
        },
        other => RuntimeError::Agent {
            id: id.to_owned(),
            source: other,
        },
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
            RuntimeError::Other(format!(
                "cannot run {} --version ({e}); install qemu-system-x86",
                binary.display()
            ))
        })?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned())
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
        let pool = blocking(move || Pool::open(&pool_cfg).map_err(storage_err)).await?;
        std::fs::create_dir_all(&cfg.run_dir).map_err(|e| io_err("create run dir", e))?;
        let qemu_version = qemu_version(&cfg.qemu_binary)?;
        let (died_tx, died_rx) = mpsc::unbounded_channel();
        Ok(Arc::new(Runtime {
            cfg,
            pool: Arc::new(pool),
            driver: QemuDriver::new(),
            accel: tokio::sync::OnceCell::new(),
            qemu_version,
            vms: Mutex::new(HashMap::new()),
            ops: Mutex::new(HashMap::new()),
            died_tx,
            died_rx: Mutex::new(Some(died_rx)),
            egress: std::sync::RwLock::new(None),
        }))
    }

    /// Sets the per-sandbox egress target lookup (it takes precedence over
    /// `RuntimeConfig::egress_proxy`). Applies from the next agent connection.
    pub fn set_egress_resolver(&self, resolver: EgressResolver) {
        *self.egress.write().unwrap_or_else(|p| p.into_inner()) = Some(resolver);
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

    /// VMs that die unexpectedly; can be taken once.
    pub fn take_died_events(&self) -> Option<mpsc::UnboundedReceiver<VmDied>> {
        self.died_rx.lock().ok().and_then(|mut g| g.take())
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

    fn run_dir(&self, name: &str) -> PathBuf {
        self.cfg.run_dir.join(name)
    }

    fn op_lock(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        ops.entry(key.to_owned()).or_default().clone()
    }

    fn live(&self, id: &SandboxId) -> Result<Arc<Live>> {
        let vms = self.vms.lock().unwrap_or_else(|p| p.into_inner());
        vms.get(id)
            .cloned()
            .ok_or_else(|| RuntimeError::NotRunning { id: id.to_string() })
    }

    fn take_live(&self, id: &SandboxId) -> Option<Arc<Live>> {
        let mut vms = self.vms.lock().unwrap_or_else(|p| p.into_inner());
        vms.remove(id)
    }

    /// Sandboxes with a live VM in this runtime.
    pub fn running(&self) -> Vec<(SandboxId, u32)> {
        let vms = self.vms.lock().unwrap_or_else(|p| p.into_inner());
        vms.iter().map(|(k, v)| (k.clone(), v.vm.pid())).collect()
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
        spec.net = meta.net.clone();
        spec.console_log_max_bytes = self.cfg.console_log_max_bytes;
        spec.qemu_binary = self.cfg.qemu_binary.clone();
        spec.run_as = self.cfg.run_as.clone();
        if self.cfg.cgroups {
            spec.limits = Some(strata_vmm::Limits::for_guest(
                meta.size.vcpus,
                u64::from(meta.size.memory_mib),
            ));
        }
        spec
    }

    fn agent_timeout(&self) -> Duration {
        Duration::from_millis(self.cfg.agent_timeout_ms)
    }

    /// Registers a started VM, connects its agent and watches for its death.
    async fn register(
        self: &Arc<Self>,
        id: &SandboxId,
        vm: Box<dyn Vm>,
        size: SandboxSize,
    ) -> Result<Arc<Live>> {
        let spec_path = vm.spec().run_dir.join("spec.json");
        if let Ok(json) = serde_json::to_vec_pretty(vm.spec()) {
            let _ = std::fs::write(&spec_path, json);
        }
        let live = Arc::new(Live {
            vm,
            agent: tokio::sync::Mutex::new(None),
            size,
            stopping: AtomicBool::new(false),
        });
        {
            let mut vms = self.vms.lock().unwrap_or_else(|p| p.into_inner());
            vms.insert(id.clone(), live.clone());
        }
        let me = Arc::downgrade(self);
        let watched = live.clone();
        let wid = id.clone();
        tokio::spawn(async move {
            let exit = watched.vm.wait_exit().await;
            if exit.expected || watched.stopping.load(Ordering::SeqCst) {
                return;
            }
            let Some(rt) = me.upgrade() else { return };
            let current = {
                let mut vms = rt.vms.lock().unwrap_or_else(|p| p.into_inner());
                match vms.get(&wid) {
                    Some(l) if Arc::ptr_eq(l, &watched) => vms.remove(&wid).is_some(),
                    _ => false,
                }
            };
            if current {
                tracing::warn!(sandbox = %wid, reason = %exit.reason, "VM died");
                let _ = rt.died_tx.send(VmDied {
                    id: wid,
                    reason: exit.reason,
                });
            }
        });
        Ok(live)
    }

    /// The agent of a live sandbox, connecting (or reconnecting) if needed.
    pub async fn agent(&self, id: &SandboxId) -> Result<AgentClient> {
        let live = self.live(id)?;
        self.agent_of(id, &live).await
    }

    async fn agent_of(&self, id: &SandboxId, live: &Live) -> Result<AgentClient> {
        let mut slot = live.agent.lock().await;
        if let Some(a) = slot.as_ref() {
            if !a.is_closed() {
                return Ok(a.clone());
            }
        }
        let t = self.agent_timeout();
        // With an egress target, the client enables egress in this agent
        // session (again after every reconnect, e.g. after a restore) and
        // serves the guest's tunnels by connecting to the target.
        let resolver = self
            .egress
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let target = match resolver {
            Some(r) => r(id.clone()).await,
            None => None,
        }
        .or(self.cfg.egress_proxy);
        let egress = target.map(TunnelHandler::tcp);
        let client = AgentClient::connect_unix_with(&live.vm.agent_socket(), t, egress)
            .await
            .map_err(|e| agent_err(id.as_str(), e, t))?;
        *slot = Some(client.clone());
        Ok(client)
    }

    /// Fresh entropy, the host clock and (for a new identity) hostname + machine-id.
    async fn sync_guest(&self, id: &SandboxId, live: &Live, new_identity: bool) -> Result<()> {
        let t0 = Instant::now();
        let agent = self.agent_of(id, live).await?;
        tracing::debug!(sandbox = %id, connect_ms = ms(t0), "agent connected");
        let mut entropy = vec![0u8; 256];
        rand::rngs::OsRng.fill_bytes(&mut entropy);
        let (hostname, machine_id) = if new_identity {
            let mut mid = [0u8; 16];
            rand::rngs::OsRng.fill_bytes(&mut mid);
            (Some(id.to_string()), Some(hex::encode(mid)))
        } else {
            (None, None)
        };
        let unix_time_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        agent
            .restore_sync(RestoreSync {
                entropy,
                unix_time_ns,
                hostname,
                machine_id,
            })
            .await
            .map_err(|e| agent_err(id.as_str(), e, self.agent_timeout()))
    }

    // ------------------------------------------------------------------ templates

    /// Boots the image once (cold), waits for its agent, and snapshots it as template
    /// `tpl`. The template's subvolume carries kernel, initrd, RAM, disk and device state.
    pub async fn build_template(
        self: &Arc<Self>,
        tpl: &TemplateId,
        size: SandboxSize,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<TemplateBuilt> {
        size.validate()
            .map_err(|e| RuntimeError::Invalid(e.to_string()))?;
        let lock = self.op_lock(tpl.as_str());
        let _g = lock.lock().await;
        let t0 = Instant::now();
        let final_dir = self.template_dir(tpl);
        if final_dir.exists() {
            return Err(RuntimeError::Invalid(format!(
                "template {tpl} already exists"
            )));
        }
        let image = load_image(&self.cfg.image_dir)?;
        let accel = self.accel().await?;
        progress(&format!("accelerator: {}", accel.qemu_name()));
        // Build in a scratch sandbox subvolume, then snapshot it read-only.
        let build_id = format!("build-{}", tpl.as_str());
        let work = self.pool.sandboxes_dir().join(&build_id);
        let pool = self.pool.clone();
        let w = work.clone();
        blocking(move || {
            if pool.is_subvolume(&w).unwrap_or(false) {
                pool.delete_subvolume(&w).map_err(storage_err)?;
            }
            pool.create_subvolume(&w).map_err(storage_err).map(|_| ())
        })
        .await?;
        let result = self
            .build_template_in(tpl, &image, accel, size, &build_id, &work, progress)
            .await;
        let pool = self.pool.clone();
        let w = work.clone();
        let _ = blocking(move || pool.trash(&w).map_err(storage_err)).await;
        let boot_ms = result?;
        progress("template ready");
        Ok(TemplateBuilt {
            id: tpl.clone(),
            size,
            accel: accel.qemu_name().to_owned(),
            boot_ms,
            build_ms: ms(t0),
        })
    }

    #[allow(clippy::too_many_arguments)]
    async fn build_template_in(
        self: &Arc<Self>,
        tpl: &TemplateId,
        image: &BuiltImage,
        accel: ResolvedAccel,
        size: SandboxSize,
        build_id: &str,
        work: &Path,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<f64> {
        progress("copying kernel, initrd and root disk into the pool");
        let kernel_src = match (accel, &image.kernel_pvh) {
            (ResolvedAccel::Tcg, Some(pvh)) => pvh.clone(),
            _ => image.kernel.clone(),
        };
        let copies = [
            (kernel_src, work.join(files::KERNEL)),
            (image.initrd.clone(), work.join(files::INITRD)),
            (image.rootfs.clone(), work.join(files::DISK)),
        ];
        let disk_bytes = size.disk_bytes();
        blocking(move || {
            for (src, dst) in &copies {
                copy_sparse(src, dst).map_err(|e| io_err("copy image file", e))?;
            }
            grow_ext4(&copies[2].1, disk_bytes)
        })
        .await?;
        let meta = StateMeta {
            format_version: SNAPSHOT_FORMAT_VERSION,
            strata_version: strata_core::STRATA_VERSION.to_owned(),
            qemu_version: self.qemu_version.clone(),
            accel: accel.qemu_name().to_owned(),
            machine_layout: String::new(),
            size,
            cmdline: image.cmdline.clone(),
            image_hash: image.hash.clone(),
            kernel_version: image.kernel_version.clone(),
            net: strata_vmm::NetSpec::default(),
            sandbox: None,
            template: Some(tpl.to_string()),
            hostname: Some("strata".into()),
            first_start: None,
            written_at: Utc::now(),
        };
        let mut spec = self.spec_for(build_id, work, &meta, accel);
        let meta = StateMeta {
            machine_layout: layout_hash(&spec),
            ..meta
        };
        meta.write(work).map_err(|e| io_err("write meta.json", e))?;
        progress("booting the guest (cold boot; only templates do this)");
        let t_boot = Instant::now();
        spec.start_paused = false;
        let vm = self
            .driver
            .start(&spec)
            .await
            .map_err(|e| vmm_err(build_id, e))?;
        let live = Arc::new(Live {
            vm,
            agent: tokio::sync::Mutex::new(None),
            size,
            stopping: AtomicBool::new(true),
        });
        let fake_id: SandboxId = format!("sb-{}", build_id.replace('_', "-"))
            .parse()
            .map_err(|e: strata_core::id::IdError| RuntimeError::Other(e.to_string()))?;
        let outcome = async {
            let agent = self.agent_of(&fake_id, &live).await?;
            let boot_ms = ms(t_boot);
            progress(&format!("agent ready after {boot_ms:.0} ms"));
            // Let the guest settle (udev-less, but the page cache and timers calm down).
            let _ = agent
                .exec_collect(ExecRequest::shell(
                    "sync; echo 1 > /proc/sys/vm/drop_caches || true",
                ))
                .await;
            drop(agent);
            progress("snapshotting the booted guest");
            live.vm.pause().await.map_err(|e| vmm_err(build_id, e))?;
            self.save_state(build_id, &live, work).await?;
            let pool = self.pool.clone();
            let w = work.to_path_buf();
            let dst = self.template_dir(tpl);
            blocking(move || {
                pool.snapshot(&w, &dst, true)
                    .map_err(storage_err)
                    .map(|_| ())
            })
            .await?;
            Ok::<f64, RuntimeError>(boot_ms)
        }
        .await;
        let _ = live.vm.kill().await;
        let _ = std::fs::remove_dir_all(self.run_dir(build_id));
        outcome
    }

    /// Removes a template. Idempotent.
    pub async fn delete_template(&self, tpl: &TemplateId) -> Result<()> {
        let dir = self.template_dir(tpl);
        let pool = self.pool.clone();
        blocking(move || {
            if dir.exists() {
                pool.trash(&dir).map_err(storage_err)?;
            }
            Ok(())
        })
        .await
    }

    /// Metadata of a template.
    pub fn template_meta(&self, tpl: &TemplateId) -> Result<StateMeta> {
        let dir = self.template_dir(tpl);
        if !dir.exists() {
            return Err(RuntimeError::SnapshotNotFound(tpl.to_string()));
        }
        StateMeta::read(&dir).map_err(|e| RuntimeError::SnapshotUnusable {
            id: tpl.to_string(),
            reason: e.0,
        })
    }

    /// Metadata of a snapshot.
    pub fn snapshot_meta(&self, snap: &SnapshotId) -> Result<StateMeta> {
        let dir = self.snapshot_dir(snap);
        if !dir.exists() {
            return Err(RuntimeError::SnapshotNotFound(snap.to_string()));
        }
        StateMeta::read(&dir).map_err(|e| RuntimeError::SnapshotUnusable {
            id: snap.to_string(),
            reason: e.0,
        })
    }

    // ------------------------------------------------------------------ snapshot

    /// Writes the device state of a paused VM into `dir/device.state` (atomically).
    async fn save_state(&self, id: &str, live: &Live, dir: &Path) -> Result<u64> {
        let tmp = dir.join(".device.state.tmp");
        let stats = match live.vm.save_device_state(&tmp).await {
            Ok(s) => s,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(vmm_err(id, e));
            }
        };
        std::fs::rename(&tmp, dir.join(files::DEVICE_STATE))
            .map_err(|e| io_err("rename device state", e))?;
        Ok(stats.bytes)
    }

    /// Snapshots a running or paused sandbox as `snap`: stop vCPUs, save device state
    /// only, one read-only btrfs snapshot of RAM + disk + state, continue. A paused
    /// sandbox stays paused. On failure nothing is listed and the VM runs on.
    pub async fn snapshot(&self, id: &SandboxId, snap: &SnapshotId) -> Result<SnapshotInfo> {
        let lock = self.op_lock(id.as_str());
        let _g = lock.lock().await;
        self.snapshot_locked(id, snap).await
    }

    async fn snapshot_locked(&self, id: &SandboxId, snap: &SnapshotId) -> Result<SnapshotInfo> {
        let live = self.live(id)?;
        let dir = self.sandbox_dir(id);
        let dst = self.snapshot_dir(snap);
        if dst.exists() {
            return Err(RuntimeError::Invalid(format!(
                "snapshot {snap} already exists"
            )));
        }
        self.check_free_space()?;
        let was_running = live
            .vm
            .status()
            .await
            .map_err(|e| vmm_err(id.as_str(), e))?
            .running;
        let t0 = Instant::now();
        if was_running {
            live.vm.pause().await.map_err(|e| vmm_err(id.as_str(), e))?;
        }
        let result = async {
            let bytes = self.save_state(id.as_str(), &live, &dir).await?;
            let t_state = ms(t0);
            let pool = self.pool.clone();
            let (src, d) = (dir.clone(), dst.clone());
            blocking(move || {
                pool.snapshot(&src, &d, true)
                    .map_err(storage_err)
                    .map(|_| ())
            })
            .await?;
            Ok::<(u64, f64), RuntimeError>((bytes, t_state))
        }
        .await;
        if was_running {
            if let Err(e) = live.vm.resume().await {
                tracing::error!(sandbox = %id, error = %e, "resume after snapshot failed");
                if result.is_ok() {
                    return Err(vmm_err(id.as_str(), e));
                }
            }
        }
        let pause_ms = ms(t0);
        let (bytes, t_state) = result?;
        tracing::info!(sandbox = %id, snapshot = %snap, pause_ms, device_state_ms = t_state, bytes, "snapshot taken");
        Ok(SnapshotInfo {
            id: snap.clone(),
            pause_ms,
            device_state_bytes: bytes,
            created_at: Utc::now(),
        })
    }

    /// Refuses new state when the pool is nearly full: a snapshot writes the guest's
    /// dirty pages and btrfs needs room for metadata; failing up front leaves the
    /// sandbox untouched instead of failing half-way with the VM stopped.
    fn check_free_space(&self) -> Result<()> {
        let usage = self.pool.usage().map_err(storage_err)?;
        if usage.free_bytes < MIN_FREE_BYTES {
            tracing::warn!(free = usage.free_bytes, "storage pool is full");
            return Err(RuntimeError::PoolFull);
        }
        Ok(())
    }

    /// Removes a snapshot. Idempotent.
    pub async fn delete_snapshot(&self, snap: &SnapshotId) -> Result<()> {
        let dir = self.snapshot_dir(snap);
        let pool = self.pool.clone();
        blocking(move || {
            if dir.exists() {
                pool.trash(&dir).map_err(storage_err)?;
            }
            Ok(())
        })
        .await
    }

    /// Exclusive and referenced bytes of a snapshot (an extent walk: not the hot path).
    pub async fn snapshot_usage(&self, snap: &SnapshotId) -> Result<SpaceUsage> {
        let dir = self.snapshot_dir(snap);
        if !dir.exists() {
            return Err(RuntimeError::SnapshotNotFound(snap.to_string()));
        }
        let pool = self.pool.clone();
        blocking(move || {
            let u = pool
                .subvolume_usage(&dir, UsageMethod::Auto)
                .map_err(storage_err)?;
            Ok(SpaceUsage {
                exclusive_bytes: u.exclusive_bytes,
                referenced_bytes: u.referenced_bytes,
            })
        })
        .await
    }

    // ------------------------------------------------------------------ create / fork

    /// Starts sandbox `id` from a template or a snapshot (never a cold boot): a
    /// writable btrfs snapshot becomes its subvolume, QEMU restores the device state,
    /// the agent gets fresh entropy, the clock and a new identity. `size.disk_gib`
    /// may exceed the source's (the disk grows); vCPUs and memory are the source's.
    pub async fn create(
        self: &Arc<Self>,
        id: &SandboxId,
        source: &Source,
        size: Option<SandboxSize>,
    ) -> Result<VmInfo> {
        let lock = self.op_lock(id.as_str());
        let _g = lock.lock().await;
        let (src_dir, src_name) = match source {
            Source::Template(t) => (self.template_dir(t), t.to_string()),
            Source::Snapshot(s) => (self.snapshot_dir(s), s.to_string()),
        };
        self.start_from(id, &src_dir, &src_name, size, true, false)
            .await
    }

    /// Checks a state dir, makes `sandboxes/<id>` a writable snapshot of it (replacing
    /// what is there when `replace`), starts the VM and syncs the guest.
    async fn start_from(
        self: &Arc<Self>,
        id: &SandboxId,
        src_dir: &Path,
        src_name: &str,
        size: Option<SandboxSize>,
        new_identity: bool,
        replace: bool,
    ) -> Result<VmInfo> {
        let t0 = Instant::now();
        if !src_dir.exists() {
            return Err(RuntimeError::SnapshotNotFound(src_name.to_owned()));
        }
        let meta = StateMeta::read(src_dir).map_err(|e| RuntimeError::SnapshotUnusable {
            id: src_name.to_owned(),
            reason: e.0,
        })?;
        let accel = self.accel().await?;
        meta.check_restorable(src_dir, &self.qemu_version, accel.qemu_name())
            .map_err(|e| RuntimeError::SnapshotUnusable {
                id: src_name.to_owned(),
                reason: e.0,
            })?;
        // A sandbox created hibernated starts for the first time here: it gets
        // its identity now, and the size it was created with.
        let new_identity = new_identity || meta.first_start.is_some();
        let want = wanted_size(&meta, src_name, size.or(meta.first_start))?;
        if self.live(id).is_ok() {
            return Err(RuntimeError::Invalid(format!(
                "sandbox {id} already has a VM"
            )));
        }
        self.check_free_space()?;
        let dir = self.sandbox_dir(id);
        let pool = self.pool.clone();
        let (s, d) = (src_dir.to_path_buf(), dir.clone());
        let t_snap = Instant::now();
        blocking(move || {
            if replace && d.exists() {
                pool.trash(&d).map_err(storage_err)?;
            } else if d.exists() {
                return Err(RuntimeError::Invalid(format!(
                    "{} already exists",
                    d.display()
                )));
            }
            pool.snapshot(&s, &d, false)
                .map_err(storage_err)
                .map(|_| ())
        })
        .await?;
        let clone_ms = ms(t_snap);
        let mut new_meta = StateMeta {
            sandbox: Some(id.to_string()),
            first_start: None,
            written_at: Utc::now(),
            ..meta.clone()
        };
        if new_identity {
            new_meta.hostname = Some(id.to_string());
        }
        let started = async {
            new_meta
                .write(&dir)
                .map_err(|e| io_err("write meta.json", e))?;
            let mut spec = self.spec_for(id.as_str(), &dir, &meta, accel);
            spec.incoming = Some(dir.join(files::DEVICE_STATE));
            let _ = std::fs::remove_dir_all(&spec.run_dir);
            let t_vm = Instant::now();
            let vm = self
                .driver
                .start(&spec)
                .await
                .map_err(|e| vmm_err(id.as_str(), e))?;
            let restore_ms = ms(t_vm);
            let live = self.register(id, vm, want).await?;
            let t_agent = Instant::now();
            let synced = self.sync_guest(id, &live, new_identity).await;
            if let Err(e) = synced {
                live.stopping.store(true, Ordering::SeqCst);
                self.take_live(id);
                let _ = live.vm.kill().await;
                return Err(e);
            }
            let agent_ms = ms(t_agent);
            if want.disk_gib > meta.size.disk_gib {
                self.grow_disk(id, &live, want.disk_bytes()).await?;
            }
            tracing::info!(sandbox = %id, from = src_name, clone_ms, restore_ms, agent_ms, "sandbox started");
            Ok::<u32, RuntimeError>(live.vm.pid())
        }
        .await;
        match started {
            Ok(pid) => Ok(VmInfo {
                pid,
                accel: accel.qemu_name().to_owned(),
                size: want,
                ready_ms: ms(t0),
            }),
            Err(e) => {
                if !replace {
                    let pool = self.pool.clone();
                    let _ = blocking(move || pool.trash(&dir).map_err(storage_err)).await;
                }
                Err(e)
            }
        }
    }

    /// Creates sandbox `id` hibernated, without starting a VM: its wake
    /// snapshot `snap` is a read-only btrfs snapshot of the source whose
    /// metadata names the sandbox and asks the first start for a new identity
    /// (hostname, machine-id, entropy) and `size` (the disk grows then). Costs
    /// one snapshot ioctl and a metadata file; no QEMU, no guest RAM.
    /// [`Runtime::wake`] from `snap` then starts it as [`Runtime::create`]
    /// would have. The source is checked as a create checks it, so a snapshot
    /// this host cannot restore is refused now rather than at the first wake.
    pub async fn create_hibernated(
        &self,
        id: &SandboxId,
        source: &Source,
        snap: &SnapshotId,
        size: Option<SandboxSize>,
    ) -> Result<SnapshotInfo> {
        let lock = self.op_lock(id.as_str());
        let _g = lock.lock().await;
        let (src_dir, src_name) = match source {
            Source::Template(t) => (self.template_dir(t), t.to_string()),
            Source::Snapshot(s) => (self.snapshot_dir(s), s.to_string()),
        };
        if !src_dir.exists() {
            return Err(RuntimeError::SnapshotNotFound(src_name));
        }
        let meta = StateMeta::read(&src_dir).map_err(|e| RuntimeError::SnapshotUnusable {
            id: src_name.clone(),
            reason: e.0,
        })?;
        let accel = self.accel().await?;
        meta.check_restorable(&src_dir, &self.qemu_version, accel.qemu_name())
            .map_err(|e| RuntimeError::SnapshotUnusable {
                id: src_name.clone(),
                reason: e.0,
            })?;
        let want = wanted_size(&meta, &src_name, size)?;
        if self.live(id).is_ok() || self.sandbox_dir(id).exists() {
            return Err(RuntimeError::Invalid(format!(
                "sandbox {id} already exists"
            )));
        }
        let dst = self.snapshot_dir(snap);
        if dst.exists() {
            return Err(RuntimeError::Invalid(format!(
                "snapshot {snap} already exists"
            )));
        }
        self.check_free_space()?;
        let new_meta = StateMeta {
            sandbox: Some(id.to_string()),
            hostname: Some(id.to_string()),
            first_start: Some(want),
            written_at: Utc::now(),
            ..meta
        };
        let pool = self.pool.clone();
        let device_state_bytes = blocking(move || {
            pool.snapshot(&src_dir, &dst, false).map_err(storage_err)?;
            let made = new_meta
                .write(&dst)
                .map_err(|e| io_err("write meta.json", e))
                .and_then(|()| pool.set_readonly(&dst, true).map_err(storage_err));
            if let Err(e) = made {
                let _ = pool.trash(&dst);
                return Err(e);
            }
            Ok(std::fs::metadata(dst.join(files::DEVICE_STATE))
                .map(|m| m.len())
                .unwrap_or(0))
        })
        .await?;
        tracing::info!(sandbox = %id, snapshot = %snap, from = %src_name, "sandbox created hibernated");
        Ok(SnapshotInfo {
            id: snap.clone(),
            pause_ms: 0.0,
            device_state_bytes,
            created_at: Utc::now(),
        })
    }

    async fn grow_disk(&self, id: &SandboxId, live: &Live, bytes: u64) -> Result<()> {
        live.vm
            .block_resize(bytes)
            .await
            .map_err(|e| vmm_err(id.as_str(), e))?;
        let agent = self.agent_of(id, live).await?;
        let out = agent
            .exec_collect(ExecRequest::argv(["resize2fs", "/dev/vda"]))
            .await
            .map_err(|e| agent_err(id.as_str(), e, self.agent_timeout()))?;
        if !out.status.success() {
            return Err(RuntimeError::Other(format!(
                "resize2fs in the guest failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(())
    }

    /// Snapshots running sandbox `src` as `snap` and starts `new_id` from it.
    pub async fn fork_live(
        self: &Arc<Self>,
        src: &SandboxId,
        snap: &SnapshotId,
        new_id: &SandboxId,
        size: Option<SandboxSize>,
    ) -> Result<(SnapshotInfo, VmInfo)> {
        let info = self.snapshot(src, snap).await?;
        let vm = self
            .create(new_id, &Source::Snapshot(snap.clone()), size)
            .await?;
        Ok((info, vm))
    }

    // ------------------------------------------------------------------ rewind / restore

    /// Returns `id` in place to its snapshot `to`. With `pre_rewind`, the present
    /// state is snapshotted first (under that id) so the rewind can be undone.
    /// The caller checks that `to` belongs to `id`; the runtime checks it too
    /// through the snapshot's metadata.
    pub async fn rewind(
        self: &Arc<Self>,
        id: &SandboxId,
        to: &SnapshotId,
        pre_rewind: Option<&SnapshotId>,
    ) -> Result<(Option<SnapshotInfo>, VmInfo)> {
        let lock = self.op_lock(id.as_str());
        let _g = lock.lock().await;
        let to_dir = self.snapshot_dir(to);
        let meta = StateMeta::read(&to_dir).map_err(|e| {
            if to_dir.exists() {
                RuntimeError::SnapshotUnusable {
                    id: to.to_string(),
                    reason: e.0,
                }
            } else {
                RuntimeError::SnapshotNotFound(to.to_string())
            }
        })?;
        if meta.sandbox.as_deref() != Some(id.as_str()) {
            return Err(RuntimeError::Invalid(format!(
                "snapshot {to} belongs to {}, not to {id}",
                meta.sandbox.as_deref().unwrap_or("a template")
            )));
        }
        let accel = self.accel().await?;
        meta.check_restorable(&to_dir, &self.qemu_version, accel.qemu_name())
            .map_err(|e| RuntimeError::SnapshotUnusable {
                id: to.to_string(),
                reason: e.0,
            })?;
        let pre = match pre_rewind {
            Some(p) if self.live(id).is_ok() => Some(self.snapshot_locked(id, p).await?),
            _ => None,
        };
        self.stop_vm(id).await;
        let vm = self
            .start_from(id, &to_dir, to.as_str(), None, false, true)
            .await?;
        Ok((pre, vm))
    }

    /// Restores `id` in place from `from` without a pre-rewind snapshot (recovery of
    /// a sandbox whose VM died, wake from hibernation).
    pub async fn restore(self: &Arc<Self>, id: &SandboxId, from: &SnapshotId) -> Result<VmInfo> {
        let lock = self.op_lock(id.as_str());
        let _g = lock.lock().await;
        self.stop_vm(id).await;
        let dir = self.snapshot_dir(from);
        self.start_from(id, &dir, from.as_str(), None, false, true)
            .await
    }

    /// Ends the sandbox's VM: the one this runtime holds, or else one that
    /// survived a restart of the controlling process and was never adopted
    /// (found by its pid file), so no QEMU runs on with its subvolume gone.
    async fn stop_vm(&self, id: &SandboxId) {
        if let Some(live) = self.take_live(id) {
            live.stopping.store(true, Ordering::SeqCst);
            let _ = live.vm.kill().await;
            return;
        }
        let run_dir = self.run_dir(id.as_str());
        let Some(pid) = strata_vmm::qemu_in_run_dir(&run_dir) else {
            return;
        };
        tracing::warn!(sandbox = %id, pid, "killing a VM that was never adopted");
        // SAFETY: kill(2) on the pid of this sandbox's QEMU, confirmed by its command line.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        for _ in 0..100 {
            if strata_vmm::qemu_in_run_dir(&run_dir).is_none() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // ------------------------------------------------------------------ pause / hibernate

    /// Stops the vCPUs (RAM kept). Idempotent.
    pub async fn pause(&self, id: &SandboxId) -> Result<()> {
        let live = self.live(id)?;
        live.vm.pause().await.map_err(|e| vmm_err(id.as_str(), e))
    }

    /// Continues the vCPUs. Idempotent.
    pub async fn resume(&self, id: &SandboxId) -> Result<()> {
        let live = self.live(id)?;
        live.vm
            .resume()
            .await
            .map_err(|e| vmm_err(id.as_str(), e))?;
        Ok(())
    }

    /// Snapshots (as `snap`) and ends the VM process: no CPU, no RAM.
    pub async fn hibernate(&self, id: &SandboxId, snap: &SnapshotId) -> Result<SnapshotInfo> {
        let lock = self.op_lock(id.as_str());
        let _g = lock.lock().await;
        let live = self.live(id)?;
        live.vm.pause().await.map_err(|e| vmm_err(id.as_str(), e))?;
        let info = match self.snapshot_locked(id, snap).await {
            Ok(i) => i,
            Err(e) => {
                let _ = live.vm.resume().await;
                return Err(e);
            }
        };
        self.stop_vm(id).await;
        let _ = std::fs::remove_dir_all(self.run_dir(id.as_str()));
        Ok(info)
    }

    /// Starts a hibernated sandbox again from its hibernation snapshot.
    pub async fn wake(self: &Arc<Self>, id: &SandboxId, snap: &SnapshotId) -> Result<VmInfo> {
        self.restore(id, snap).await
    }

    /// Ends the VM (if any) and removes the sandbox's subvolume. Idempotent.
    pub async fn delete(&self, id: &SandboxId) -> Result<()> {
        let lock = self.op_lock(id.as_str());
        let _g = lock.lock().await;
        self.stop_vm(id).await;
        let _ = std::fs::remove_dir_all(self.run_dir(id.as_str()));
        let dir = self.sandbox_dir(id);
        let pool = self.pool.clone();
        blocking(move || {
            if dir.exists() {
                pool.trash(&dir).map_err(storage_err)?;
            }
            Ok(())
        })
        .await
    }

    // ------------------------------------------------------------------ discovery

    /// QEMU processes found under the run dir (alive and really that sandbox's
    /// QEMU), by sandbox id.
    pub fn find_vms(&self) -> Vec<(SandboxId, u32)> {
        let Ok(rd) = std::fs::read_dir(&self.cfg.run_dir) else {
            return Vec::new();
        };
        rd.flatten()
            .filter_map(|e| {
                let id = e.file_name().to_string_lossy().parse::<SandboxId>().ok()?;
                let pid = strata_vmm::qemu_in_run_dir(&e.path())?;
                Some((id, pid))
            })
            .collect()
    }

    /// Names of the subvolumes under `sandboxes/`, `snapshots/` and `templates/`.
    pub fn list_state_dirs(&self) -> (Vec<String>, Vec<String>, Vec<String>) {
        let names = |dir: PathBuf| -> Vec<String> {
            std::fs::read_dir(dir)
                .map(|rd| {
                    rd.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .filter(|n| !n.starts_with('.'))
                        .collect()
                })
                .unwrap_or_default()
        };
        (
            names(self.pool.sandboxes_dir()),
            names(self.pool.snapshots_dir()),
            names(self.pool.templates_dir()),
        )
    }

    /// Takes over a VM that survived a restart of the controlling process.
    pub async fn adopt(self: &Arc<Self>, id: &SandboxId) -> Result<VmInfo> {
        let lock = self.op_lock(id.as_str());
        let _g = lock.lock().await;
        if let Ok(live) = self.live(id) {
            return Ok(VmInfo {
                pid: live.vm.pid(),
                accel: live.vm.spec().accel.qemu_name().to_owned(),
                size: live.size,
                ready_ms: 0.0,
            });
        }
        let t0 = Instant::now();
        let run = self.run_dir(id.as_str());
        let spec: VmSpec = std::fs::read(run.join("spec.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| RuntimeError::SandboxNotFound(id.to_string()))?;
        let meta =
            StateMeta::read(&self.sandbox_dir(id)).map_err(|e| RuntimeError::SnapshotUnusable {
                id: id.to_string(),
                reason: e.0,
            })?;
        let vm = self
            .driver
            .adopt(&spec)
            .await
            .map_err(|e| vmm_err(id.as_str(), e))?;
        let accel = spec.accel.qemu_name().to_owned();
        // The agent is connected on first use: the VM may be paused (by the
        // user, or stopped by a snapshot the previous process did not finish),
        // and a paused guest cannot answer a handshake.
        let live = self.register(id, vm, meta.size).await?;
        Ok(VmInfo {
            pid: live.vm.pid(),
            accel,
            size: meta.size,
            ready_ms: ms(t0),
        })
    }

    /// Runs a raw QMP command on a sandbox's VM (benchmarks and diagnostics).
    pub async fn qmp(
        &self,
        id: &SandboxId,
        command: &str,
        arguments: Option<serde_json::Value>,
    ) -> Result<serde_json::Value> {
        let live = self.live(id)?;
        live.vm
            .qmp(command, arguments)
            .await
            .map_err(|e| vmm_err(id.as_str(), e))
    }

    /// Resident memory of a sandbox's QEMU beyond its guest RAM, in bytes.
    pub fn vm_overhead_bytes(&self, id: &SandboxId) -> Result<u64> {
        let live = self.live(id)?;
        live.vm
            .rss_bytes()
            .map(|r| r.beyond_guest_ram())
            .map_err(|e| vmm_err(id.as_str(), e))
    }

    /// The last `n` bytes of a sandbox's console log.
    pub fn console_tail(&self, id: &SandboxId, n: usize) -> Result<String> {
        Ok(self.live(id)?.vm.console_tail(n))
    }

    /// SIGKILLs every VM this runtime holds and forgets them, and any other QEMU
    /// running from its run dir (a template build's boot, a restore not yet
    /// answering); synchronous, for process exit paths such as test and
    /// benchmark teardown. Returns how many were signalled.
    pub fn kill_all(&self) -> usize {
        let mut vms = self.vms.lock().unwrap_or_else(|p| p.into_inner());
        let n = vms.len();
        for live in vms.values() {
            live.stopping.store(true, Ordering::SeqCst);
            let pid = live.vm.pid() as i32;
            // SAFETY: kill(2) on the pid of a QEMU this runtime started or adopted.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        vms.clear();
        drop(vms);
        // VMs not (yet) in the table: a template build's cold boot, a restore
        // still waiting for its agent. Each runs from its own directory under
        // this runtime's run dir, which names them.
        let stray = std::fs::read_dir(&self.cfg.run_dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| strata_vmm::qemu_in_run_dir(&e.path()));
        let mut extra = 0;
        for pid in stray {
            // SAFETY: kill(2) on a QEMU whose pid file and command line name a
            // directory of this runtime's run dir: one this runtime started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            extra += 1;
        }
        n + extra
    }

    /// Pauses every live VM's watcher and forgets the VMs without stopping them
    /// (used when the controlling process exits but the VMs must keep running).
    pub fn detach_all(&self) {
        let mut vms = self.vms.lock().unwrap_or_else(|p| p.into_inner());
        for live in vms.values() {
            live.stopping.store(true, Ordering::SeqCst);
        }
        vms.clear();
    }
}

/// The size a sandbox made from state `meta` (named `src_name`) runs with:
/// `asked` when given (same vCPUs and memory as the state, a disk at least as
/// large), else the state's own.
fn wanted_size(
    meta: &StateMeta,
    src_name: &str,
    asked: Option<SandboxSize>,
) -> Result<SandboxSize> {
    let Some(s) = asked else {
        return Ok(meta.size);
    };
    s.validate()
        .map_err(|e| RuntimeError::Invalid(e.to_string()))?;
    if s.vcpus != meta.size.vcpus || s.memory_mib != meta.size.memory_mib {
        return Err(RuntimeError::Invalid(format!(
            "{src_name} was taken with {} vCPU(s) and {} MiB; a sandbox made from it keeps them (asked {} vCPU(s), {} MiB)",
            meta.size.vcpus, meta.size.memory_mib, s.vcpus, s.memory_mib
        )));
    }
    if s.disk_gib < meta.size.disk_gib {
        return Err(RuntimeError::Invalid(format!(
            "disk_gib {} is smaller than the source's {} GiB; disks only grow",
            s.disk_gib, meta.size.disk_gib
        )));
    }
    Ok(s)
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

/// Copies a file keeping holes (reflink where the file systems allow).
fn copy_sparse(src: &Path, dst: &Path) -> std::io::Result<()> {
    let status = std::process::Command::new("cp")
        .arg("--reflink=auto")
        .arg("--sparse=always")
        .arg(src)
        .arg(dst)
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "cp {} {} failed ({status})",
            src.display(),
            dst.display()
        )))
    }
}

/// Grows a raw ext4 image to `bytes` (file and file system), offline.
fn grow_ext4(path: &Path, bytes: u64) -> Result<()> {
    let len = std::fs::metadata(path)
        .map_err(|e| io_err("stat disk", e))?
        .len();
    if bytes <= len {
        return Ok(());
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| io_err("open disk", e))?;
    f.set_len(bytes).map_err(|e| io_err("grow disk", e))?;
    drop(f);
    let run = |prog: &str, args: &[&std::ffi::OsStr]| -> Result<()> {
        let out = std::process::Command::new(prog)
            .args(args)
            .output()
            .map_err(|e| {
                RuntimeError::Other(format!("cannot run {prog} ({e}); install e2fsprogs"))
            })?;
        // e2fsck exits 1 when it fixed something harmless.
        if out.status.success() || (prog == "e2fsck" && out.status.code() == Some(1)) {
            Ok(())
        } else {
            Err(RuntimeError::Other(format!(
                "{prog} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )))
        }
    };
    run("e2fsck", &["-fy".as_ref(), path.as_os_str()])?;
    run("resize2fs", &[path.as_os_str()])
}
