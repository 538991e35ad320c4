//! A sandbox back to one of its own states, in place: rewind (optionally
//! snapshotting the present first), restore after its VM died, and wake
//! from hibernation.
//!
//! Contract:
//! - The sandbox keeps its id, hostname and machine-id; its subvolume is
//!   replaced by a writable snapshot of the state ([`Start::InPlace`]).
//! - A rewind checks everything it can before touching the VM (the state is
//!   this sandbox's, restorable here), so a refused rewind leaves the VM
//!   running; the pre-rewind snapshot, when asked for, is taken before the
//!   VM stops.

use std::sync::Arc;
use std::time::Instant;

use strata_core::{SandboxId, SnapshotId};

use super::start::Start;
use super::{blocking, Result, Runtime, StateRef};
use crate::api::{SnapshotInfo, VmInfo};
use crate::error::{storage_err, RuntimeError};

impl Runtime {
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
        let _g = self.op_lock(id.as_str()).await;
        let state = self.open_state(StateRef::Snapshot(to))?;
        if state.meta.sandbox.as_deref() != Some(id.as_str()) {
            return Err(RuntimeError::Invalid(format!(
                "snapshot {to} belongs to {}, not to {id}",
                state.meta.sandbox.as_deref().unwrap_or("a template")
            )));
        }
        let accel = self.accel().await?;
        state.check_restorable(&self.qemu_version, accel)?;
        // Checked before the VM is touched (and again on the copy QEMU reads).
        self.check_signature(&state, &state.dir)?;
        let pre = match pre_rewind {
            Some(p) if self.live(id).is_ok() => Some(self.snapshot_locked(id, p).await?),
            _ => None,
        };
        self.stop_vm(id).await;
        let vm = match self
            .start_opened(id, state, accel, None, Start::InPlace, Instant::now())
            .await
        {
            Ok(vm) => vm,
            Err(e) => {
                // A failed rewind lists no pre-rewind snapshot: its subvolume
                // goes too (it stayed in the pool with no record).
                if let Some(p) = pre_rewind.filter(|_| pre.is_some()) {
                    let (pool, d) = (self.pool.clone(), self.snapshot_dir(p));
                    if let Err(t) = blocking(move || pool.trash(&d).map_err(storage_err)).await {
                        tracing::warn!(sandbox = %id, snapshot = %p, error = %t, "removing the pre-rewind snapshot of a failed rewind failed");
                    }
                }
                return Err(e);
            }
        };
        Ok((pre, vm))
    }

    /// Restores `id` in place from `from` without a pre-rewind snapshot (recovery of
    /// a sandbox whose VM died, wake from hibernation).
    pub async fn restore(self: &Arc<Self>, id: &SandboxId, from: &SnapshotId) -> Result<VmInfo> {
        let _g = self.op_lock(id.as_str()).await;
        self.stop_vm(id).await;
        self.start_from(id, StateRef::Snapshot(from), None, Start::InPlace)
            .await
    }

    /// Starts a hibernated sandbox again from its hibernation snapshot.
    pub async fn wake(self: &Arc<Self>, id: &SandboxId, snap: &SnapshotId) -> Result<VmInfo> {
        self.restore(id, snap).await
    }
}
