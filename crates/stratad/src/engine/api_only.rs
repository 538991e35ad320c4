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

#[async_trait]
impl Engine for ApiOnlyEngine {
    async fn create(&self, _: &SandboxId, _: &Source, _: SandboxSize) -> EngineResult<VmInfo> {
        no()
    }
    async fn create_hibernated(
        &self,
        _: &SandboxId,
        _: &Source,
        _: &SnapshotId,
        _: SandboxSize,
    ) -> EngineResult<SnapshotInfo> {
        no()
    }
    async fn snapshot(&self, _: &SandboxId, _: &SnapshotId) -> EngineResult<SnapshotInfo> {
        no()
    }
    async fn fork_live(
        &self,
        _: &SandboxId,
        _: &SnapshotId,
        _: &SandboxId,
        _: SandboxSize,
    ) -> EngineResult<(SnapshotInfo, VmInfo)> {
        no()
    }
    async fn rewind(
        &self,
        _: &SandboxId,
        _: &SnapshotId,
        _: Option<&SnapshotId>,
    ) -> EngineResult<(Option<SnapshotInfo>, VmInfo)> {
        no()
    }
    async fn restore(&self, _: &SandboxId, _: &SnapshotId) -> EngineResult<VmInfo> {
        no()
    }
    async fn pause(&self, _: &SandboxId) -> EngineResult<()> {
        no()
    }
    async fn resume(&self, _: &SandboxId) -> EngineResult<()> {
        no()
    }
    async fn hibernate(&self, _: &SandboxId, _: &SnapshotId) -> EngineResult<SnapshotInfo> {
        no()
    }
    async fn wake(&self, _: &SandboxId, _: &SnapshotId) -> EngineResult<VmInfo> {
        no()
    }
    async fn delete(&self, _: &SandboxId) -> EngineResult<()> {
        no()
    }
    async fn delete_snapshot(&self, _: &SnapshotId) -> EngineResult<()> {
        no()
    }
    async fn snapshot_usage(&self, _: &SnapshotId) -> EngineResult<SpaceUsage> {
        no()
    }
    async fn exec(&self, _: &SandboxId, _: ExecRequest) -> EngineResult<ExecStream> {
        no()
    }
    async fn read_file(&self, _: &SandboxId, _: &str) -> EngineResult<ByteStream> {
        no()
    }
    async fn write_file(&self, _: &SandboxId, _: &str, _: u32, _: ByteStream) -> EngineResult<u64> {
        no()
    }
    async fn list_dir(&self, _: &SandboxId, _: &str) -> EngineResult<Vec<DirEntry>> {
        no()
    }
    async fn stat(&self, _: &SandboxId, _: &str) -> EngineResult<DirEntry> {
        no()
    }
    async fn mkdir(&self, _: &SandboxId, _: &str, _: bool) -> EngineResult<()> {
        no()
    }
    async fn remove(&self, _: &SandboxId, _: &str, _: bool) -> EngineResult<()> {
        no()
    }
    async fn build_template(
        &self,
        _: &TemplateId,
        _: SandboxSize,
        _: ProgressSink,
    ) -> EngineResult<TemplateBuilt> {
        no()
    }
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
    async fn adopt(&self, _: &SandboxId) -> EngineResult<VmInfo> {
        no()
    }
    fn exit_events(&self) -> tokio::sync::mpsc::UnboundedReceiver<VmDied> {
        // The sender is dropped at once: the stream is empty and ends.
        tokio::sync::mpsc::unbounded_channel().1
    }
}
