//! A sandbox from a state: create, fork, create hibernated, and the start
//! that rewind, restore and wake share ([`Runtime::start_from`]).
//!
//! Contract:
//! - No cold boot but from a disk-only state (a hibernation without
//!   memory, [`StateMeta::disk_only`]): `sandboxes/<id>` becomes a writable
//!   btrfs snapshot of a template or snapshot, QEMU restores its device
//!   state (a disk-only state boots its kernel on a fresh `mem`), and the
//!   agent gets fresh entropy and the clock (a new sandbox also a new
//!   identity) before the sandbox counts as started.
//! - vCPUs and memory are the source's; the disk may grow
//!   ([`wanted_size`]), never shrink.
//! - A new sandbox that fails to start leaves no subvolume; a sandbox
//!   started again in place keeps the subvolume it was given.

use std::sync::Arc;
use std::time::Instant;

use chrono::Utc;
use strata_core::{SandboxId, SandboxSize, SnapshotId};
use strata_proto::ExecRequest;
use strata_vmm::VmmDriver;

use super::agent::Identity;
use super::vms::Live;
use super::{blocking, ms, OpenState, Result, Runtime, StateRef};
use crate::api::{SnapshotInfo, Source, StartTimeline, VmInfo};
use crate::error::{agent_err, io_err, storage_err, vmm_err, RuntimeError};
use crate::meta::{files, StateMeta};

/// How much of a guest's console a failed start logs.
const START_FAILURE_CONSOLE_BYTES: usize = 3000;

/// How a sandbox starts from a state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Start {
    /// A new sandbox (create, fork): `sandboxes/<id>` must not exist and is
    /// removed again when the start fails; the guest gets a new identity.
    New,
    /// The sandbox again, from one of its own states (rewind, restore,
    /// wake): `sandboxes/<id>` is replaced, and left when the start fails;
    /// the guest keeps its identity, unless this is the first start of a
    /// sandbox created hibernated.
    InPlace,
    /// A new sandbox started ahead of its owner (a warm-pool guest): as
    /// [`Start::New`], its cgroup at [`super::warm::WARM_CPU_WEIGHT`] from
    /// the first instruction.
    Warm,
}

impl Start {
    /// A new sandbox (its subvolume made here, a new identity).
    fn is_new(self) -> bool {
        matches!(self, Start::New | Start::Warm)
    }
}

impl Runtime {
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
        let _g = self.op_lock(id.as_str()).await;
        self.start_from(id, source.into(), size, Start::New).await
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

    /// Checks a state and starts `id` from it ([`Runtime::start_opened`]).
    pub(super) async fn start_from(
        self: &Arc<Self>,
        id: &SandboxId,
        state: StateRef<'_>,
        size: Option<SandboxSize>,
        mode: Start,
    ) -> Result<VmInfo> {
        let t0 = Instant::now();
        let (src, accel, _) = self.open_restorable(state).await?;
        self.start_opened(id, src, accel, size, mode, t0).await
    }

    /// Makes `sandboxes/<id>` a writable snapshot of the checked state `src`
    /// (replacing what is there for [`Start::InPlace`]), starts the VM and
    /// syncs the guest. `t0` is when the request began (for `ready_ms`).
    pub(super) async fn start_opened(
        self: &Arc<Self>,
        id: &SandboxId,
        src: OpenState,
        accel: strata_vmm::ResolvedAccel,
        size: Option<SandboxSize>,
        mode: Start,
        t0: Instant,
    ) -> Result<VmInfo> {
        let opened = Instant::now();
        let src_dir = src.dir.clone();
        let src_name = src.name.clone();
        let meta = src.meta.clone();
        // A sandbox created hibernated starts for the first time here: it gets
        // its identity now, and the size it was created with.
        let identity = if mode.is_new() || meta.first_start.is_some() {
            Identity::New
        } else if meta.disk_only {
            Identity::Reboot
        } else {
            Identity::Keep
        };
        // A disk-only state cold-boots (no device state to restore).
        let cold = meta.disk_only;
        let want = wanted_size(&meta, &src_name, size.or(meta.first_start))?;
        // A cold boot may change vCPUs and memory: the VM runs with the size
        // wanted, and its metadata says so (layout included).
        let boot_meta = if cold {
            StateMeta {
                size: SandboxSize {
                    disk_gib: meta.size.disk_gib,
                    ..want
                },
                // No device state to match: it boots with the newest devices.
                layout_version: strata_vmm::cmdline::MACHINE_LAYOUT_VERSION,
                ..meta.clone()
            }
        } else {
            meta.clone()
        };
        if self.live(id).is_ok() {
            return Err(RuntimeError::Invalid(format!(
                "sandbox {id} already has a VM"
            )));
        }
        self.check_free_space()?;
        let dir = self.sandbox_dir(id);
        let pool = self.pool.clone();
        let d = dir.clone();
        let t_snap = Instant::now();
        blocking(move || {
            if mode == Start::InPlace && d.exists() {
                pool.trash(&d).map_err(storage_err)?;
            } else if d.exists() {
                return Err(RuntimeError::Invalid(format!(
                    "{} already exists",
                    d.display()
                )));
            }
            pool.snapshot(&src_dir, &d, false)
                .map_err(storage_err)
                .map(|_| ())
        })
        .await?;
        let clone_ms = ms(t_snap);
        let cloned = Instant::now();
        let mut new_meta = StateMeta {
            sandbox: Some(id.to_string()),
            first_start: None,
            written_at: Utc::now(),
            ..boot_meta.clone()
        };
        if cold {
            // Running, it is a memory state again (RAM in `mem`).
            new_meta.disk_only = false;
            new_meta.format_version = crate::meta::SNAPSHOT_FORMAT_VERSION;
        }
        if identity == Identity::New {
            new_meta.hostname = Some(id.to_string());
        }
        let started = async {
            let mut spec = self.spec_for(id.as_str(), &dir, &boot_meta, accel);
            if cold {
                new_meta.machine_layout = crate::meta::layout_hash(&spec);
            }
            new_meta
                .write(&dir)
                .map_err(|e| io_err("write meta.json", e))?;
            if mode == Start::Warm {
                if let Some(l) = spec.limits.as_mut() {
                    l.cpu_weight = Some(super::warm::WARM_CPU_WEIGHT);
                }
            }
            if cold {
                let mem = std::fs::File::create(dir.join(files::MEM))
                    .map_err(|e| io_err("create mem", e))?;
                mem.set_len(boot_meta.size.memory_bytes())
                    .map_err(|e| io_err("size mem", e))?;
                spec.start_paused = false;
            } else {
                spec.incoming = Some(dir.join(files::DEVICE_STATE));
            }
            // The state's signature, on the meta it was opened with and the
            // device state of the new subvolume, right before QEMU reads it.
            self.check_signature(&src, &dir)?;
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
            let synced = match self.sync_guest(id, &live, identity).await {
                Ok(s) => s,
                Err(e) => {
                    // What the guest printed last is the only account of a
                    // boot that never reached its agent (a kernel stall, a
                    // file system check): log it before the VM goes.
                    tracing::warn!(
                        sandbox = %id, cold, error = %e,
                        console_tail = %live.vm.console_tail(START_FAILURE_CONSOLE_BYTES),
                        "the guest did not come up; its console's last lines"
                    );
                    live.stopping
                        .store(true, std::sync::atomic::Ordering::SeqCst);
                    self.take_live(id);
                    let _ = live.vm.kill().await;
                    return Err(e);
                }
            };
            let agent_ms = ms(t_agent);
            if want.disk_gib > meta.size.disk_gib {
                self.grow_disk(id, &live, want.disk_bytes()).await?;
            }
            let tl = timeline(t0, [opened, cloned, t_vm], live.vm.as_ref(), &synced);
            tracing::debug!(sandbox = %id, timeline = ?tl, "start timeline");
            *live.timeline.lock().unwrap_or_else(|p| p.into_inner()) = Some(tl);
            tracing::info!(sandbox = %id, from = %src_name, clone_ms, restore_ms, agent_ms, cold, "sandbox started");
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
                if mode.is_new() {
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
        let _g = self.op_lock(id.as_str()).await;
        let (src, _, verified) = self.open_restorable(source.into()).await?;
        let want = wanted_size(&src.meta, &src.name, size)?;
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
        let OpenState {
            dir: src_dir,
            name: src_name,
            meta,
            ..
        } = src;
        let new_meta = StateMeta {
            sandbox: Some(id.to_string()),
            hostname: Some(id.to_string()),
            first_start: Some(want),
            written_at: Utc::now(),
            ..meta
        };
        let pool = self.pool.clone();
        let signer = self.cfg.signing.clone();
        let name = snap.to_string();
        let device_state_bytes = blocking(move || {
            pool.snapshot(&src_dir, &dst, false).map_err(storage_err)?;
            let made = new_meta
                .write(&dst)
                .map_err(|e| io_err("write meta.json", e))
                .and_then(|()| {
                    super::signatures::sign_into(signer.as_deref(), &dst, &name, verified.as_ref())
                })
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
            phases: Default::default(),
        })
    }

    /// Grows a started sandbox's disk to `bytes`: the block device, then
    /// the file system from inside the guest.
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
}

/// The start's steps as ms since `t0` (`steps`: state opened, subvolume
/// cloned, driver called).
fn timeline(
    t0: Instant,
    [opened, cloned, vm_called]: [Instant; 3],
    vm: &dyn strata_vmm::Vm,
    synced: &super::agent::Synced,
) -> StartTimeline {
    let at = |t: Instant| t.saturating_duration_since(t0).as_secs_f64() * 1000.0;
    let vt = vm.start_timings();
    let hs = &synced.handshake;
    StartTimeline {
        opened_ms: at(opened),
        cloned_ms: at(cloned),
        vm_called_ms: at(vm_called),
        spawned_ms: vt.map(|v| at(v.spawned)).unwrap_or_default(),
        qmp_ms: vt.map(|v| at(v.qmp_ready)).unwrap_or_default(),
        assembled_ms: vt.map(|v| at(v.assembled)).unwrap_or_default(),
        incoming_ms: vt.and_then(|v| v.incoming_done).map(at),
        running_ms: vt.and_then(|v| v.running).map(at),
        port_open_ms: vm.agent_port_opened_at().map(at),
        connected_ms: at(hs.connected),
        last_hello_ms: at(hs.last_hello),
        hello_ok_ms: at(hs.hello_ok),
        hellos: hs.hellos,
        hellos_cued: hs.triggered,
        session_ms: at(synced.session),
        synced_ms: at(synced.synced),
        ready_ms: at(Instant::now()),
    }
}

/// The size a sandbox made from state `meta` (named `src_name`) runs with:
/// `asked` when given (same vCPUs and memory as the state, a disk at least as
/// large), else the state's own. A disk-only state cold-boots, so it may
/// run with any vCPUs and memory (its disk still only grows).
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
    if !meta.disk_only && (s.vcpus != meta.size.vcpus || s.memory_mib != meta.size.memory_mib) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::tests::meta;

    #[test]
    fn a_sandbox_keeps_its_sources_cpus_and_memory_and_may_grow_its_disk() {
        let m = meta();
        assert_eq!(wanted_size(&m, "snap", None).unwrap(), m.size);
        let bigger = SandboxSize {
            disk_gib: m.size.disk_gib + 1,
            ..m.size
        };
        assert_eq!(wanted_size(&m, "snap", Some(bigger)).unwrap(), bigger);
        let more_cpus = SandboxSize {
            vcpus: m.size.vcpus + 1,
            ..m.size
        };
        let e = wanted_size(&m, "snap", Some(more_cpus)).unwrap_err();
        assert!(
            matches!(e, RuntimeError::Invalid(ref s) if s.contains("keeps them")),
            "{e}"
        );
        let mut m2 = meta();
        m2.size.disk_gib = 4;
        let smaller = SandboxSize {
            disk_gib: 3,
            ..m2.size
        };
        let e = wanted_size(&m2, "snap", Some(smaller)).unwrap_err();
        assert!(
            matches!(e, RuntimeError::Invalid(ref s) if s.contains("only grow")),
            "{e}"
        );
    }

    #[test]
    fn a_disk_only_state_boots_at_any_cpus_and_memory_but_its_disk_only_grows() {
        let mut m = meta();
        m.disk_only = true;
        let other = SandboxSize {
            vcpus: m.size.vcpus + 1,
            memory_mib: m.size.memory_mib * 2,
            ..m.size
        };
        assert_eq!(wanted_size(&m, "snap", Some(other)).unwrap(), other);
        m.size.disk_gib = 4;
        let smaller = SandboxSize {
            disk_gib: 3,
            ..other
        };
        assert!(wanted_size(&m, "snap", Some(smaller)).is_err());
    }
}
