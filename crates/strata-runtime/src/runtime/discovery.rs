//! What survived a restart of the controlling process, and taking it over.
//!
//! Contract:
//! - [`Runtime::find_vms`] and [`Runtime::list_state_dirs`] (typed:
//!   [`Runtime::live_vms`], [`Runtime::subvolumes`]) only look: the daemon
//!   compares them with its records and decides.
//! - [`Runtime::adopt`] takes a surviving VM into the live table as it is,
//!   after making sure its vCPUs run (a process killed in the middle of a
//!   snapshot leaves its VM stopped); the caller pauses it again when its
//!   record says paused. The daemon never talks QMP itself.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use strata_core::SandboxId;
use strata_proto::AgentError;
use strata_vmm::{VmSpec, VmmDriver};

use super::{ms, Result, Runtime, StateRef};
use crate::api::{LiveVm, Subvolumes, VmInfo};
use crate::error::{agent_err, vmm_err, RuntimeError};

/// How long [`Runtime::unstick`] may take to connect to a VM's QMP socket.
const UNSTICK_QMP_TIMEOUT: Duration = Duration::from_secs(10);

impl Runtime {
    /// QEMU processes of this run dir (alive and really that sandbox's QEMU),
    /// by sandbox id: found by their command line, so a VM whose pid file
    /// was never written (its starter killed right after the spawn) or whose
    /// run dir was removed under it counts too.
    pub fn find_vms(&self) -> Vec<(SandboxId, u32)> {
        self.qemus()
            .into_iter()
            .filter_map(|(name, pid)| Some((name.parse::<SandboxId>().ok()?, pid)))
            .collect()
    }

    /// QEMU processes of this run dir whose directory names no sandbox (a
    /// template build's builder VM, or anything else started there): never
    /// acknowledged state, so a restarted daemon ends them.
    pub fn stray_vms(&self) -> Vec<(String, u32)> {
        self.qemus()
            .into_iter()
            .filter(|(name, _)| name.parse::<SandboxId>().is_err())
            .collect()
    }

    /// Every QEMU of this run dir, by directory name, one per name (a pid
    /// file's process first, then the process table).
    fn qemus(&self) -> Vec<(String, u32)> {
        let mut by_name: std::collections::BTreeMap<String, u32> = Default::default();
        for (dir, pid) in strata_vmm::qemus_under(&self.cfg.run_dir) {
            let Some(name) = dir.file_name().map(|n| n.to_string_lossy().into_owned()) else {
                continue;
            };
            // The scan already checked the command line; a second process
            // naming the same directory loses to the one its pid file names.
            let recorded = std::fs::read_to_string(dir.join("qemu.pid"))
                .ok()
                .and_then(|t| t.trim().parse::<u32>().ok());
            let slot = by_name.entry(name).or_insert(pid);
            if recorded == Some(pid) {
                *slot = pid;
            }
        }
        by_name.into_iter().collect()
    }

    /// SIGKILLs a QEMU found by [`Runtime::stray_vms`] and waits (≤ 5 s) for
    /// it to go; removes its run dir.
    pub async fn end_stray(&self, name: &str) {
        let dir = self.run_dir(name);
        super::vms::kill_qemu_of(&dir, "ending a QEMU no record owns").await;
        let _ = std::fs::remove_dir_all(dir);
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

    /// [`Runtime::find_vms`] as [`LiveVm`]s.
    pub fn live_vms(&self) -> Vec<LiveVm> {
        self.find_vms()
            .into_iter()
            .map(|(id, pid)| LiveVm { id, pid })
            .collect()
    }

    /// [`Runtime::list_state_dirs`] as ids (other names left out).
    pub fn subvolumes(&self) -> Subvolumes {
        let (sb, snaps, tpls) = self.list_state_dirs();
        Subvolumes {
            sandboxes: sb.iter().filter_map(|s| s.parse().ok()).collect(),
            snapshots: snaps.iter().filter_map(|s| s.parse().ok()).collect(),
            templates: tpls.iter().filter_map(|s| s.parse().ok()).collect(),
        }
    }

    /// Takes over a VM that survived a restart of the controlling process.
    /// A VM this runtime already holds is answered as it is. Otherwise the
    /// VM is first made to run ([`Runtime::unstick`]): the caller re-asserts
    /// a paused record with [`Runtime::pause`].
    pub async fn adopt(self: &Arc<Self>, id: &SandboxId) -> Result<VmInfo> {
        let _g = self.op_lock(id.as_str()).await;
        if let Ok(live) = self.live(id) {
            return Ok(VmInfo {
                pid: live.vm.pid(),
                accel: live.vm.spec().accel.qemu_name().to_owned(),
                size: live.size,
                ready_ms: 0.0,
            });
        }
        self.unstick(id).await;
        // A process that died in a snapshot's pause by copies left them.
        super::snapshot::remove_copies(&self.sandbox_dir(id));
        let t0 = Instant::now();
        let run = self.run_dir(id.as_str());
        let spec: VmSpec = std::fs::read(run.join("spec.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| RuntimeError::SandboxNotFound(id.to_string()))?;
        let meta = self.open_state(StateRef::Sandbox(id))?.meta;
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

    /// Whether a live sandbox's agent answers (a handshake if the channel is
    /// new, then a ping) within `within`. Recovery asks it of every VM it
    /// adopted: a guest whose agent stays silent is restored from its last
    /// snapshot instead of answering its next call with `agent_timeout`.
    ///
    /// A connection that goes silent after its handshake is closed by the
    /// liveness check within 5 s; the probe then connects again (a new
    /// session: QEMU drops what the dead daemon left queued on the channel,
    /// the agent resynchronises on the new Hello) until `within` runs out.
    /// One silent session is not a silent agent: the channel the previous
    /// process died on can hold a half-written frame or a full queue.
    pub async fn probe_agent(&self, id: &SandboxId, within: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + within;
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let probe = async {
                let agent = self.agent(id).await?;
                agent
                    .ping()
                    .await
                    .map(|_| ())
                    .map_err(|e| agent_err(id.as_str(), e, within))
            };
            let err = match tokio::time::timeout_at(deadline, probe).await {
                Ok(Ok(())) => {
                    if attempt > 1 {
                        tracing::info!(sandbox = %id, attempt, "agent answered on a new connection");
                    }
                    return Ok(());
                }
                Ok(Err(e)) => e,
                Err(_) => {
                    return Err(RuntimeError::AgentTimeout {
                        id: id.to_string(),
                        timeout_ms: within.as_millis() as u64,
                    })
                }
            };
            // A VM that is gone, or an agent that refused us, will not
            // answer a second connection either.
            let retry = match &err {
                RuntimeError::Agent { source, .. } => {
                    !matches!(source, AgentError::VersionMismatch { .. })
                }
                RuntimeError::AgentTimeout { .. } => true,
                _ => false,
            } && self.live(id).is_ok();
            if !retry || tokio::time::Instant::now() + Duration::from_millis(200) >= deadline {
                return Err(err);
            }
            tracing::warn!(sandbox = %id, attempt, error = %err, "agent session went silent; connecting again");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Makes a surviving, not yet adopted VM's vCPUs run.
    ///
    /// A process killed in the middle of a snapshot leaves its VM stopped
    /// (or `postmigrate`); a paused guest never answers the agent handshake
    /// (its writes block once it stops draining virtio-serial). So: one short
    /// QMP session of our own: wait for an outgoing device-state save to
    /// finish, `cont` if not running, disconnect (the VM's QMP socket takes
    /// one client; the adopted handle connects next). Best effort: what
    /// fails is logged, and the adopt goes on.
    async fn unstick(&self, id: &SandboxId) {
        let sock = self.run_dir(id.as_str()).join("qmp.sock");
        if !sock.exists() {
            return;
        }
        let qmp = match strata_vmm::QmpClient::connect(&sock, UNSTICK_QMP_TIMEOUT).await {
            Ok(q) => q,
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "cannot check the VM's run state before adopting it");
                return;
            }
        };
        let status_of = |v: serde_json::Value| v["status"].as_str().map(str::to_owned);
        for _ in 0..100 {
            let active = qmp
                .execute("query-migrate", None)
                .await
                .ok()
                .and_then(status_of)
                .is_some_and(|s| {
                    matches!(s.as_str(), "setup" | "active" | "device" | "pre-switchover")
                });
            if !active {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let status = qmp
            .execute("query-status", None)
            .await
            .ok()
            .and_then(status_of)
            .unwrap_or_default();
        if status != "running" {
            tracing::warn!(sandbox = %id, %status, "VM found stopped after a restart; continuing it");
            if let Err(e) = qmp.execute("cont", None).await {
                tracing::warn!(sandbox = %id, error = %e, "cont failed");
            }
        }
    }
}
