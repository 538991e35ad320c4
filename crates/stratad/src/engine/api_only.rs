//! The engine of an API-only process (`[cluster] role = "api"`,
//! docs/cluster.md "API processes"): no pool, no QEMU, no VM.
//!
//! The API process forwards every VM operation to the sandbox's owner
//! before it reaches the service (`api::forward`), so this engine is what
//! answers only when nothing could be forwarded: every operation that needs
//! a VM, a snapshot or a template build fails with a message that says so.
//! What holds nothing answers so: no VMs, no subvolumes, no templates
//! (deleting a template's copy is a no-op: the holders remove theirs).

use async_trait::async_trait;
use strata_core::{SandboxId, SandboxSize, SnapshotId, TemplateId};

use super::*;

/// See the module documentation.
#[derive(Debug, Default)]
pub struct ApiOnlyEngine;

fn no<T>() -> EngineResult<T> {
    Err(RuntimeError::Unavailable(
        "this stratad is an API-only process ([cluster] role = \"api\"): it runs no VMs and holds no snapshots or templates; VM operations go to the sandbox's host".into(),
    ))
}

super::unavailable::refusing_engine!(ApiOnlyEngine, no, {
    async fn delete_template(&self, _: &TemplateId) -> EngineResult<()> {
        // No copy is here; the holders remove theirs (their renewal round
        // sees the record deleted).
        Ok(())
    }
    async fn has_template(&self, _: &TemplateId) -> EngineResult<bool> {
        Ok(false)
    }
    async fn live_vms(&self) -> EngineResult<Vec<LiveVm>> {
        Ok(Vec::new())
    }
    async fn subvolumes(&self) -> EngineResult<Subvolumes> {
        Ok(Subvolumes::default())
    }
});
