//! Warm-pool guests: a sandbox started ahead of a create and handed to its
//! owner when one comes ([`Runtime::prewarm`], [`Runtime::claim`]).
//!
//! Contract:
//! - A warm guest is started as [`Runtime::create`] starts one (a writable
//!   snapshot of the source, QEMU restores, the agent gets entropy, the
//!   clock and the identity of the id it was started under), runs two
//!   commands (`sh -c true`, `true`: the first command's one-time costs
//!   are paid before anyone waits on them), then is paused:
//!   it uses memory, no CPU. Until it is claimed its cgroup (where there is
//!   one) has [`WARM_CPU_WEIGHT`] from its first instruction, so its start
//!   yields to sandboxes in use.
//! - Its agent connection has no egress bound (nobody owns it, so no policy
//!   applies to it): [`Runtime::claim`] asks the egress resolver again, now
//!   that the daemon has its record, and binds the connection to the
//!   answer. A guest's egress is bound once and never rebound.
//! - A claim continues the vCPUs at the default weight and gives the guest
//!   fresh entropy and the clock again (it may have waited for hours): two
//!   guests claimed from one pool share nothing but the template.
//! - A warm guest that is never claimed is ended with [`Runtime::delete`],
//!   like any sandbox.

use std::sync::Arc;

use strata_core::{SandboxId, SandboxSize};
use strata_proto::ExecRequest;
use strata_vmm::cgroup::DEFAULT_CPU_WEIGHT;

use super::agent::Identity;
use super::start::Start;
use super::{Result, Runtime};
use crate::api::{Source, VmInfo};
use crate::error::{agent_err, vmm_err};

/// CPU weight of a warm guest's cgroup until it is claimed (the default is
/// [`DEFAULT_CPU_WEIGHT`]): its start competes little with guests in use.
pub const WARM_CPU_WEIGHT: u32 = 10;

impl Runtime {
    /// Starts `id` from `source` as a warm-pool guest: as [`Runtime::create`]
    /// would, then paused, its egress unbound (see the module documentation).
    /// A guest that cannot be paused is ended and its subvolume removed.
    pub async fn prewarm(
        self: &Arc<Self>,
        id: &SandboxId,
        source: &Source,
        size: Option<SandboxSize>,
    ) -> Result<VmInfo> {
        let _g = self.op_lock(id.as_str()).await;
        let vm = self
            .start_from(id, source.into(), size, Start::Warm)
            .await?;
        let live = self.live(id)?;
        // Two commands (a shell's and a plain one) before the pause: what
        // the first command after the claim would pay once (TCG translating
        // the guest's exec path, the page cache of a shell) is paid here,
        // by nobody.
        if let Ok(agent) = self.agent_of(id, &live).await {
            for req in [ExecRequest::shell("true"), ExecRequest::argv(["true"])] {
                if let Err(e) = agent.exec_collect(req).await {
                    tracing::debug!(sandbox = %id, error = %e, "a warm guest's first command failed");
                }
            }
        }
        if let Err(e) = live.pause_vm().await {
            drop(live);
            drop(_g);
            let _ = self.delete(id).await;
            return Err(vmm_err(id.as_str(), e));
        }
        Ok(vm)
    }

    /// Hands warm guest `id` to the owner its record now names: the vCPUs
    /// continue at the default CPU weight, the agent connection is bound to
    /// the egress the resolver gives now, and the guest gets fresh entropy
    /// and the clock. On an error the guest is left as it is (the caller
    /// deletes it).
    pub async fn claim(&self, id: &SandboxId) -> Result<()> {
        let _g = self.op_lock(id.as_str()).await;
        let live = self.live(id)?;
        if let Err(e) = live.vm.set_cpu_weight(DEFAULT_CPU_WEIGHT) {
            tracing::warn!(sandbox = %id, error = %e, "cannot restore a claimed guest's CPU weight");
        }
        live.resume_vm()
            .await
            .map_err(|e| vmm_err(id.as_str(), e))?;
        let agent = self.agent_of(id, &live).await?;
        let bind = async {
            if agent.egress_bound() {
                return Ok(());
            }
            let Some(h) = self.egress_target(id).await else {
                return Ok(());
            };
            agent
                .bind_egress(h)
                .await
                .map(|_| ())
                .map_err(|e| agent_err(id.as_str(), e, self.agent_timeout()))
        };
        let (bound, synced) = tokio::join!(bind, self.sync_guest(id, &live, Identity::Keep));
        bound?;
        synced.map(|_| ())
    }
}
