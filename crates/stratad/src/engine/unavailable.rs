//! An engine with no runtime behind it.
//!
//! Until `strata-runtime` is linked in, the `stratad` binary runs with this
//! engine: the API, the store, listings and templates records work, and every
//! operation that needs a VM fails with a clear `internal` error. Its
//! `live_vms`/`subvolumes` fail too, so recovery leaves records untouched
//! instead of taking "no VMs found" for "all VMs died".

use async_trait::async_trait;
use strata_core::{SandboxId, SandboxSize, SnapshotId, TemplateId};

use super::*;

/// See the module documentation.
#[derive(Debug, Default)]
pub struct UnavailableEngine;

fn no<T>() -> EngineResult<T> {
    Err(RuntimeError::Unavailable(
        "no sandbox runtime is linked into this stratad build".into(),
    ))
}

/// Implements [`Engine`] for `$ty`, an engine with no VMs: every operation
/// answers `$no()`, except what the engine holds (`delete_template`,
/// `live_vms`, `subvolumes`, and `has_template` when given), which the block
/// answers. One list of methods for [`UnavailableEngine`] and
/// [`super::api_only::ApiOnlyEngine`].
macro_rules! refusing_engine {
    ($ty:ty, $no:ident, { $($holdings:tt)* }) => {
        #[async_trait]
        impl Engine for $ty {
            async fn create(&self, _: &SandboxId, _: &Source, _: SandboxSize) -> EngineResult<VmInfo> {
                $no()
            }
            async fn create_hibernated(
                &self,
                _: &SandboxId,
                _: &Source,
                _: &SnapshotId,
                _: SandboxSize,
            ) -> EngineResult<SnapshotInfo> {
                $no()
            }
            async fn snapshot(&self, _: &SandboxId, _: &SnapshotId) -> EngineResult<SnapshotInfo> {
                $no()
            }
            async fn fork_live(
                &self,
                _: &SandboxId,
                _: &SnapshotId,
                _: &SandboxId,
                _: SandboxSize,
            ) -> EngineResult<(SnapshotInfo, VmInfo)> {
                $no()
            }
            async fn rewind(
                &self,
                _: &SandboxId,
                _: &SnapshotId,
                _: Option<&SnapshotId>,
            ) -> EngineResult<(Option<SnapshotInfo>, VmInfo)> {
                $no()
            }
            async fn restore(&self, _: &SandboxId, _: &SnapshotId) -> EngineResult<VmInfo> {
                $no()
            }
            async fn pause(&self, _: &SandboxId) -> EngineResult<()> {
                $no()
            }
            async fn resume(&self, _: &SandboxId) -> EngineResult<()> {
                $no()
            }
            async fn hibernate(&self, _: &SandboxId, _: &SnapshotId) -> EngineResult<SnapshotInfo> {
                $no()
            }
            async fn wake(&self, _: &SandboxId, _: &SnapshotId) -> EngineResult<VmInfo> {
                $no()
            }
            async fn delete(&self, _: &SandboxId) -> EngineResult<()> {
                $no()
            }
            async fn delete_snapshot(&self, _: &SnapshotId) -> EngineResult<()> {
                $no()
            }
            async fn snapshot_usage(&self, _: &SnapshotId) -> EngineResult<SpaceUsage> {
                $no()
            }
            async fn exec(&self, _: &SandboxId, _: ExecRequest) -> EngineResult<ExecStream> {
                $no()
            }
            async fn read_file(&self, _: &SandboxId, _: &str) -> EngineResult<ByteStream> {
                $no()
            }
            async fn write_file(&self, _: &SandboxId, _: &str, _: u32, _: ByteStream) -> EngineResult<u64> {
                $no()
            }
            async fn list_dir(&self, _: &SandboxId, _: &str) -> EngineResult<Vec<DirEntry>> {
                $no()
            }
            async fn stat(&self, _: &SandboxId, _: &str) -> EngineResult<DirEntry> {
                $no()
            }
            async fn mkdir(&self, _: &SandboxId, _: &str, _: bool) -> EngineResult<()> {
                $no()
            }
            async fn remove(&self, _: &SandboxId, _: &str, _: bool) -> EngineResult<()> {
                $no()
            }
            async fn build_template(
                &self,
                _: &TemplateId,
                _: SandboxSize,
                _: ProgressSink,
            ) -> EngineResult<TemplateBuilt> {
                $no()
            }
            $($holdings)*
            async fn adopt(&self, _: &SandboxId) -> EngineResult<VmInfo> {
                $no()
            }
            fn exit_events(&self) -> tokio::sync::mpsc::UnboundedReceiver<VmDied> {
                // The sender is dropped at once: the stream is empty and ends.
                tokio::sync::mpsc::unbounded_channel().1
            }
        }
    };
}
pub(super) use refusing_engine;

refusing_engine!(UnavailableEngine, no, {
    async fn delete_template(&self, _: &TemplateId) -> EngineResult<()> {
        no()
    }
    async fn live_vms(&self) -> EngineResult<Vec<LiveVm>> {
        no()
    }
    async fn subvolumes(&self) -> EngineResult<Subvolumes> {
        no()
    }
});
