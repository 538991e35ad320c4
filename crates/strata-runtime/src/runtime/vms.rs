//! The live VMs of this host: the table, the death watcher, and what is
//! asked of a live VM (pause, resume, raw QMP, figures, teardown).
//!
//! Contract:
//! - A VM is in the table from [`Runtime::register`] until the runtime
//!   stops it ([`Runtime::stop_vm`], [`Runtime::kill_all`],
//!   [`Runtime::detach_all`]) or it dies. `stopping` is set before the
//!   runtime itself ends a VM, so only a death nobody asked for is reported,
//!   once, on [`Runtime::take_died_events`] (and the VM leaves the table).
//! - An operation on a sandbox without a live VM is
//!   [`RuntimeError::NotRunning`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use strata_core::text::Escaped;
use strata_core::{SandboxId, SandboxSize};
use strata_proto::AgentClient;
use strata_vmm::Vm;
use tokio::sync::mpsc;

use super::{Result, Runtime};
use crate::error::vmm_err;

/// A VM that died without being asked to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmDied {
    /// Its sandbox.
    pub id: SandboxId,
    /// What is known about the death.
    pub reason: String,
}

/// A live VM of this host.
pub(super) struct Live {
    pub(super) vm: Box<dyn Vm>,
    pub(super) agent: tokio::sync::Mutex<Option<AgentClient>>,
    pub(super) size: SandboxSize,
    /// Set before the runtime itself stops the VM, so the watcher stays quiet.
    pub(super) stopping: AtomicBool,
    /// Whether the vCPUs run: the agent connection's liveness watchdog
    /// counts silence only while they do ([`Live::pause_vm`]).
    pub(super) running: Arc<AtomicBool>,
    /// The sandbox dir's `device.state` is the state of the VM as it is
    /// now stopped: set by a completed save, cleared when the vCPUs run
    /// again. After a migration (a VM's first save) QEMU leaves the VM
    /// `postmigrate` and refuses a second one until `cont`; a direct save
    /// leaves it `paused` and could be repeated, but there is no need: a
    /// second snapshot of a VM that has not run since reuses the saved
    /// state either way (a stopped VM's devices do not change).
    pub(super) state_saved: AtomicBool,
    /// Where this VM's start went ([`Runtime::start_timeline`]).
    pub(super) timeline: std::sync::Mutex<Option<crate::api::StartTimeline>>,
    /// Calls in flight and whether their CPU weight is set ([`super::boost`]).
    pub(super) calls: std::sync::Mutex<super::boost::CallCount>,
}

impl Live {
    /// Stops the vCPUs; the agent's silence stops counting first.
    pub(super) async fn pause_vm(&self) -> std::result::Result<(), strata_vmm::VmmError> {
        self.running.store(false, Ordering::SeqCst);
        self.vm.pause().await
    }

    /// Continues the vCPUs; the agent's silence counts again once they run.
    pub(super) async fn resume_vm(&self) -> std::result::Result<(), strata_vmm::VmmError> {
        let r = self.vm.resume().await;
        if r.is_ok() {
            self.state_saved.store(false, Ordering::SeqCst);
            self.running.store(true, Ordering::SeqCst);
        }
        r
    }

    /// A started VM, its agent not connected yet.
    pub(super) fn new(vm: Box<dyn Vm>, size: SandboxSize) -> Live {
        Live {
            vm,
            agent: tokio::sync::Mutex::new(None),
            size,
            running: Arc::new(AtomicBool::new(true)),
            stopping: AtomicBool::new(false),
            state_saved: AtomicBool::new(false),
            timeline: std::sync::Mutex::new(None),
            calls: std::sync::Mutex::new(Default::default()),
        }
    }
}

impl Runtime {
    /// VMs that die unexpectedly; can be taken once.
    pub fn take_died_events(&self) -> Option<mpsc::UnboundedReceiver<VmDied>> {
        self.died_rx.lock().ok().and_then(|mut g| g.take())
    }

    pub(super) fn live(&self, id: &SandboxId) -> Result<Arc<Live>> {
        let vms = self.vms.lock().unwrap_or_else(|p| p.into_inner());
        vms.get(id)
            .cloned()
            .ok_or_else(|| crate::RuntimeError::NotRunning { id: id.to_string() })
    }

    pub(super) fn take_live(&self, id: &SandboxId) -> Option<Arc<Live>> {
        let mut vms = self.vms.lock().unwrap_or_else(|p| p.into_inner());
        vms.remove(id)
    }

    /// Where the start of sandbox `id`'s running VM went (a fork, create,
    /// wake, rewind or restore), when it was started by this runtime.
    pub fn start_timeline(&self, id: &SandboxId) -> Option<crate::api::StartTimeline> {
        let live = self.live(id).ok()?;
        let t = *live.timeline.lock().unwrap_or_else(|p| p.into_inner());
        t
    }

    /// Sandboxes with a live VM in this runtime.
    pub fn running(&self) -> Vec<(SandboxId, u32)> {
        let vms = self.vms.lock().unwrap_or_else(|p| p.into_inner());
        vms.iter().map(|(k, v)| (k.clone(), v.vm.pid())).collect()
    }

    /// Registers a started VM and watches for its death (its agent is
    /// connected on first use).
    pub(super) async fn register(
        self: &Arc<Self>,
        id: &SandboxId,
        vm: Box<dyn Vm>,
        size: SandboxSize,
    ) -> Result<Arc<Live>> {
        let spec_path = vm.spec().run_dir.join("spec.json");
        if let Ok(json) = serde_json::to_vec_pretty(vm.spec()) {
            let _ = std::fs::write(&spec_path, json);
        }
        let live = Arc::new(Live::new(vm, size));
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
                // The reason ends with the guest console's last lines: escaped.
                tracing::warn!(sandbox = %wid, reason = %Escaped(&exit.reason), "VM died");
                let _ = rt.died_tx.send(VmDied {
                    id: wid,
                    reason: exit.reason,
                });
            }
        });
        Ok(live)
    }

    /// Ends the sandbox's VM: the one this runtime holds, or else one that
    /// survived a restart of the controlling process and was never adopted
    /// (found by its pid file), so no QEMU runs on with its subvolume gone.
    pub(super) async fn stop_vm(&self, id: &SandboxId) {
        if let Some(live) = self.take_live(id) {
            live.stopping.store(true, Ordering::SeqCst);
            let _ = live.vm.kill().await;
            return;
        }
        kill_qemu_of(
            &self.run_dir(id.as_str()),
            "killing a VM that was never adopted",
        )
        .await;
    }

    /// Stops the vCPUs (RAM kept). Idempotent.
    pub async fn pause(&self, id: &SandboxId) -> Result<()> {
        let live = self.live(id)?;
        live.pause_vm().await.map_err(|e| vmm_err(id.as_str(), e))
    }

    /// Continues the vCPUs. Idempotent.
    pub async fn resume(&self, id: &SandboxId) -> Result<()> {
        let live = self.live(id)?;
        live.resume_vm().await.map_err(|e| vmm_err(id.as_str(), e))
    }

    /// Ends the VM (if any) and removes the sandbox's subvolume. Idempotent.
    pub async fn delete(&self, id: &SandboxId) -> Result<()> {
        let _g = self.op_lock(id.as_str()).await;
        self.stop_vm(id).await;
        let _ = std::fs::remove_dir_all(self.run_dir(id.as_str()));
        self.trash_if_exists(self.sandbox_dir(id)).await
    }

    /// Runs a raw QMP command on a sandbox's VM (benchmarks and diagnostics).
    /// A raw `stop` / `cont` counts as [`Runtime::pause`] / [`Runtime::resume`]
    /// for the agent's liveness watchdog: a guest stopped this way is not
    /// taken for a silent one.
    pub async fn qmp(
        &self,
        id: &SandboxId,
        command: &str,
        arguments: Option<serde_json::Value>,
    ) -> Result<serde_json::Value> {
        let live = self.live(id)?;
        if command == "stop" {
            live.running.store(false, Ordering::SeqCst);
        }
        let r = live
            .vm
            .qmp(command, arguments)
            .await
            .map_err(|e| vmm_err(id.as_str(), e));
        if command == "cont" && r.is_ok() {
            live.state_saved.store(false, Ordering::SeqCst);
            live.running.store(true, Ordering::SeqCst);
        }
        r
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
        let stray = strata_vmm::qemus_under(&self.cfg.run_dir)
            .into_iter()
            .map(|(_, pid)| pid);
        let mut extra = 0;
        for pid in stray {
            // SAFETY: kill(2) on a QEMU whose command line names a directory
            // of this runtime's run dir: one this runtime started.
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

/// SIGKILLs the QEMU of `run_dir` (found by its pid file or its command
/// line), if one runs, and waits up to 5 s for it to go.
pub(super) async fn kill_qemu_of(run_dir: &std::path::Path, why: &str) {
    let Some(pid) = strata_vmm::qemu_in_run_dir(run_dir) else {
        return;
    };
    tracing::warn!(run_dir = %run_dir.display(), pid, "{why}");
    // SAFETY: kill(2) on a QEMU whose command line names `run_dir`, a
    // directory of this runtime's run dir: one this runtime's daemon started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    for _ in 0..100 {
        if strata_vmm::qemu_in_run_dir(run_dir).is_none() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
