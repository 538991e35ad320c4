//! Moving snapshots between two deployments (docs/move.md): the runtime's
//! side of `btrfs send` / `receive` ([`strata_storage::send`]).
//!
//! Contract:
//! - [`Runtime::send_snapshot`] streams a snapshot subvolume, incremental
//!   against a parent snapshot the receiver holds.
//! - [`Runtime::receive_snapshot`] applies a hostile stream in the pool's
//!   import directory (checked and bounded by the storage layer), then
//!   bounds it by the caller's limit and the pool's free space less the
//!   room kept for snapshots ([`super::snapshot::MIN_FREE_BYTES`]), and
//!   publishes it as `snapshots/<id>`: a writable copy of the received
//!   subvolume whose `meta.json` must parse and be restorable on this host
//!   (QEMU series, accelerator, files present), the sender's signature
//!   removed and this deployment's written in its place (a received state
//!   is trusted as much as the credentials that pushed it: the signature
//!   says "this deployment accepted it", not "this deployment made it"),
//!   then one read-only snapshot. The received subvolume stays in the
//!   import directory untouched: it is the parent the next incremental
//!   stream names. A state refused at publication is removed with its
//!   received subvolume.
//! - Receiving a snapshot whose stream was already received whole (an
//!   interrupted move resumed after the receive) publishes it without a
//!   second transfer; a published one is refused as already present.
//! - Templates travel the same way between the hosts of one cluster
//!   ([`Runtime::send_template`], [`Runtime::receive_template`]; docs/cluster.md
//!   "Templates across hosts"): the received subvolume stays in the import
//!   directory (the parent of later incremental streams) and a read-only
//!   snapshot of it becomes `templates/<id>`, kept only if it is
//!   restorable here and its signature verifies with this host's key (the
//!   hosts of a cluster share the master key, so the sender's signature
//!   is this host's): the template is the very state the sender signed.

use std::io::Read;
use std::path::PathBuf;

use strata_core::{SnapshotId, TemplateId};
use strata_storage::{ReceiveSpec, SendStream, TransferError, Uuid};

use super::{blocking, Result, Runtime};
use crate::error::{io_err, storage_err, RuntimeError};
use crate::meta::{files, StateMeta};

/// Why a send or receive of a snapshot failed.
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    /// The stream or the storage refused (hostile or broken stream, bound,
    /// a `btrfs` program failed).
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// The runtime refused (state not restorable here, exists, signing).
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

/// A snapshot received and published.
#[derive(Debug, Clone)]
pub struct ReceivedSnapshot {
    /// Its metadata (as sent: size, accel, sandbox).
    pub meta: StateMeta,
    /// The sender's identity of it (the received UUID).
    pub identity: Uuid,
    /// Stream bytes applied (0 when it had been received before).
    pub bytes: u64,
}

/// A template received from another host and published.
#[derive(Debug, Clone)]
pub struct ReceivedTemplate {
    /// Its metadata.
    pub meta: StateMeta,
    /// The sender's identity of it (the received UUID).
    pub identity: Uuid,
    /// Stream bytes applied (0 when it had been received whole before).
    pub bytes: u64,
}

impl Runtime {
    /// Whether template `tpl`'s subvolume is in this pool.
    pub fn has_template(&self, tpl: &TemplateId) -> bool {
        self.template_dir(tpl).join(files::META).exists()
    }

    /// The identity of template `tpl`'s received copy in the import
    /// directory (the sender's identity of it), if this pool received it:
    /// the only kind of parent `btrfs receive` finds inside the import
    /// directory it is confined to.
    pub fn received_template_identity(&self, tpl: &TemplateId) -> Option<Uuid> {
        strata_storage::subvol_info(&self.pool.import_dir().join(tpl.as_str()))
            .ok()
            .filter(|i| i.readonly)
            .and_then(|i| i.received_uuid)
    }

    /// Starts streaming template `tpl`, incremental against template
    /// `parent` when this pool holds a subvolume of it with the identity the
    /// receiver named (its received copy or its own), else in full. Returns
    /// the stream and the parent identity it is relative to. Blocking.
    pub fn send_template(
        &self,
        tpl: &TemplateId,
        parent: Option<(&TemplateId, Uuid)>,
    ) -> std::result::Result<(SendStream, Option<Uuid>), MoveError> {
        let dir = self.template_dir(tpl);
        if !dir.join(files::META).exists() {
            return Err(RuntimeError::SnapshotNotFound(tpl.to_string()).into());
        }
        let base = parent.and_then(|(p, want)| {
            [
                self.pool.import_dir().join(p.as_str()),
                self.template_dir(p),
            ]
            .into_iter()
            .find(|d| {
                strata_storage::subvol_info(d).is_ok_and(|i| i.readonly && i.identity() == want)
            })
            .map(|d| (d, want))
        });
        let stream = self.pool.send(&dir, base.as_ref().map(|b| b.0.as_path()))?;
        Ok((stream, base.map(|b| b.1)))
    }

    /// Receives template `tpl` from the hostile stream `input` (at most
    /// `max_bytes`, incremental against the received subvolume whose
    /// identity is `parent`) and publishes it as `templates/<tpl>` once it
    /// is restorable here and its signature verifies; see the module docs.
    /// A refused template leaves nothing behind. Blocking.
    pub fn receive_template(
        &self,
        tpl: &TemplateId,
        parent: Option<Uuid>,
        max_bytes: u64,
        input: impl Read,
        accel_name: &str,
    ) -> std::result::Result<ReceivedTemplate, MoveError> {
        let dst = self.template_dir(tpl);
        if dst.exists() {
            return Err(RuntimeError::Invalid(format!("template {tpl} already exists")).into());
        }
        let (path, identity, bytes) =
            self.receive_import(tpl.as_str(), parent, max_bytes, input)?;
        self.pool.snapshot(&path, &dst, true).map_err(storage_err)?;
        let checked = (|| {
            let st = self.open_state(super::StateRef::Template(tpl))?;
            let bad = |e: crate::meta::Incompatible| RuntimeError::SnapshotUnusable {
                id: tpl.to_string(),
                reason: format!("received template: {}", e.0),
            };
            st.meta
                .check_restorable(&st.dir, &self.qemu_version, accel_name)
                .map_err(bad)?;
            self.check_signature(&st, &st.dir)?;
            Ok::<_, RuntimeError>(st.meta)
        })();
        match checked {
            Ok(meta) => Ok(ReceivedTemplate {
                meta,
                identity,
                bytes,
            }),
            Err(e) => {
                if let Err(t) = self.pool.trash(&dst) {
                    tracing::warn!(path = %dst.display(), error = %t, "cannot remove a refused template");
                }
                let _ = self.pool.delete_received(tpl.as_str());
                Err(e.into())
            }
        }
    }

    /// [`Runtime::receive_template`] on a blocking thread, under the
    /// template's operation lock.
    pub async fn receive_template_async(
        self: &std::sync::Arc<Self>,
        tpl: TemplateId,
        parent: Option<Uuid>,
        max_bytes: u64,
        input: impl Read + Send + 'static,
    ) -> std::result::Result<ReceivedTemplate, MoveError> {
        let accel = self.accel_name().await?;
        let _g = self.op_lock(tpl.as_str()).await;
        let rt = self.clone();
        blocking(move || {
            Ok::<_, RuntimeError>(rt.receive_template(&tpl, parent, max_bytes, input, accel))
        })
        .await?
    }

    /// The subvolume that is sent for snapshot `snap` (and named as a
    /// parent for it): its copy in the import directory when there is a
    /// whole one (received from another deployment, or a parent anchor of
    /// this pool's own snapshot), else `snapshots/<snap>`. The received
    /// copy holds the bytes the snapshot's maker sent and carries the
    /// maker's identity, so every pool that holds the snapshot names it
    /// by the same identity with the same content: a sandbox that comes
    /// back (or moves on) is sent incremental against what the receiver
    /// holds. (`snapshots/<snap>` of a received snapshot is a new
    /// subvolume, re-signed here: another identity.)
    pub(super) fn sent_form(&self, snap: &SnapshotId) -> Result<(PathBuf, Uuid)> {
        let published = self.snapshot_dir(snap);
        let info = strata_storage::subvol_info(&published).map_err(|e| match e {
            strata_storage::StorageError::NotFound { .. }
            | strata_storage::StorageError::NotASubvolume { .. } => {
                RuntimeError::SnapshotNotFound(snap.to_string())
            }
            e => storage_err(e),
        })?;
        let received = self.pool.import_dir().join(snap.as_str());
        match strata_storage::subvol_info(&received) {
            Ok(i) if i.readonly && i.received_uuid.is_some() => Ok((received, i.identity())),
            _ => Ok((published, info.identity())),
        }
    }

    /// The identity `btrfs send` gives snapshot `snap` in a stream (what a
    /// receiver compares with what it holds): its maker's (see
    /// `sent_form`). The snapshot must be published in this pool.
    pub fn snapshot_identity(&self, snap: &SnapshotId) -> Result<Uuid> {
        self.sent_form(snap).map(|(_, u)| u)
    }

    /// Starts streaming snapshot `snap`, incremental against `parent`
    /// (each as `sent_form` picks it, so the stream names the parent by
    /// the identity [`Runtime::snapshot_identity`] answers). Blocking
    /// (spawns `btrfs send`); read the stream off the async threads.
    pub fn send_snapshot(
        &self,
        snap: &SnapshotId,
        parent: Option<&SnapshotId>,
    ) -> std::result::Result<SendStream, MoveError> {
        let (dir, _) = self.sent_form(snap)?;
        let parent = parent.map(|p| self.sent_form(p)).transpose()?;
        // Sealed already when the caller awaited `seal_snapshot` (which
        // keeps the flag's commit out of pauses); else here.
        for d in std::iter::once(&dir).chain(parent.as_ref().map(|(p, _)| p)) {
            super::snapshot::seal_dir(&self.pool, d)?;
        }
        Ok(self
            .pool
            .send(&dir, parent.as_ref().map(|(p, _)| p.as_path()))?)
    }

    /// Makes this pool's own snapshot `snap` a parent a stream can be
    /// received against (a sandbox coming back, incremental against a
    /// snapshot made here: docs/move.md "A return move"): a read-only
    /// anchor `import/<snap>` of the same data carrying its identity
    /// ([`strata_storage::Pool::anchor_received`]). A snapshot that has a
    /// whole received copy already is answered as it is. Answers its
    /// identity. Blocking.
    pub fn anchor_snapshot(&self, snap: &SnapshotId) -> std::result::Result<Uuid, MoveError> {
        let (path, identity) = self.sent_form(snap)?;
        if path.starts_with(self.pool.import_dir()) {
            return Ok(identity);
        }
        super::snapshot::seal_dir(&self.pool, &path)?;
        let info = self.pool.anchor_received(&path, snap.as_str())?;
        Ok(info.identity())
    }

    /// The snapshots received whole into this pool's import directory:
    /// (snapshot id, the sender's identity).
    pub fn received_snapshots(&self) -> Result<Vec<(String, Uuid)>> {
        Ok(self
            .pool
            .list_received()
            .map_err(storage_err)?
            .into_iter()
            .filter_map(|(n, i)| i.received_uuid.map(|u| (n, u)))
            .collect())
    }

    /// Receives snapshot `snap` from the hostile stream `input` (at most
    /// `max_bytes`, incremental against the received `parent`) and
    /// publishes it signed; see the module docs. Blocking.
    pub fn receive_snapshot(
        &self,
        snap: &SnapshotId,
        parent: Option<Uuid>,
        max_bytes: u64,
        input: impl Read,
        accel_name: &str,
    ) -> std::result::Result<ReceivedSnapshot, MoveError> {
        let dst = self.snapshot_dir(snap);
        if dst.exists() {
            return Err(RuntimeError::Invalid(format!("snapshot {snap} already exists")).into());
        }
        let (path, identity, bytes) =
            self.receive_import(snap.as_str(), parent, max_bytes, input)?;
        let published = self.publish_received(snap, &path, &dst, accel_name);
        match published {
            Ok(meta) => Ok(ReceivedSnapshot {
                meta,
                identity,
                bytes,
            }),
            Err(e) => {
                if matches!(e, RuntimeError::SnapshotUnusable { .. }) {
                    let _ = self.pool.delete_received(snap.as_str());
                }
                Err(e.into())
            }
        }
    }

    /// Applies the hostile stream `input` as `import/<name>` (at most
    /// `max_bytes`, and never into the room snapshots and running guests
    /// need: the pool's free space less its reserve bounds it too),
    /// incremental against the received `parent`; answers the received
    /// subvolume's path, its identity and the stream bytes applied (0: it
    /// had been received whole before). Shared by snapshots and templates.
    fn receive_import(
        &self,
        name: &str,
        parent: Option<Uuid>,
        max_bytes: u64,
        input: impl Read,
    ) -> std::result::Result<(PathBuf, Uuid, u64), MoveError> {
        let free = self.pool.usage().map_err(storage_err)?.free_bytes;
        let spec = ReceiveSpec {
            name: name.to_owned(),
            parent,
            max_bytes: max_bytes.min(free.saturating_sub(super::snapshot::MIN_FREE_BYTES)),
        };
        match self.pool.receive(&spec, input) {
            Ok(r) => {
                let id = r.info.identity();
                Ok((r.path, id, r.bytes))
            }
            Err(TransferError::AlreadyReceived(_)) => {
                let path = self.pool.import_dir().join(name);
                let info = strata_storage::subvol_info(&path).map_err(storage_err)?;
                Ok((path, info.identity(), 0))
            }
            Err(e) => Err(e.into()),
        }
    }

    fn publish_received(
        &self,
        snap: &SnapshotId,
        received: &std::path::Path,
        dst: &std::path::Path,
        accel_name: &str,
    ) -> Result<StateMeta> {
        let scratch: PathBuf = self
            .pool
            .sandboxes_dir()
            .join(format!("rcv-{}", snap.as_str()));
        if self.pool.is_subvolume(&scratch).unwrap_or(false) {
            self.pool.delete_subvolume(&scratch).map_err(storage_err)?;
        }
        self.pool
            .snapshot(received, &scratch, false)
            .map_err(storage_err)?;
        let done = (|| {
            let bad = |e: crate::meta::Incompatible| RuntimeError::SnapshotUnusable {
                id: snap.to_string(),
                reason: format!("received state: {}", e.0),
            };
            let (meta, _) = StateMeta::read_with_bytes(&scratch).map_err(bad)?;
            meta.check_restorable(&scratch, &self.qemu_version, accel_name)
                .map_err(bad)?;
            match std::fs::remove_file(scratch.join(files::SIGNATURE)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(io_err("remove the sender's signature", e))
                }
                _ => {}
            }
            super::signatures::sign_into(
                self.cfg.signing.as_deref(),
                &scratch,
                snap.as_str(),
                None,
            )?;
            self.pool
                .snapshot(&scratch, dst, true)
                .map_err(storage_err)?;
            Ok(meta)
        })();
        if let Err(e) = self.pool.trash(&scratch) {
            tracing::warn!(path = %scratch.display(), error = %e, "cannot remove a receive scratch");
        }
        done
    }

    /// The accelerator name states must match to be restored here.
    pub async fn accel_name(&self) -> Result<&'static str> {
        Ok(self.accel().await?.qemu_name())
    }

    /// [`Runtime::receive_snapshot`] on a blocking thread.
    pub async fn receive_snapshot_async(
        self: &std::sync::Arc<Self>,
        snap: SnapshotId,
        parent: Option<Uuid>,
        max_bytes: u64,
        input: impl Read + Send + 'static,
    ) -> std::result::Result<ReceivedSnapshot, MoveError> {
        let accel = self.accel_name().await?;
        let rt = self.clone();
        blocking(move || {
            Ok::<_, RuntimeError>(rt.receive_snapshot(&snap, parent, max_bytes, input, accel))
        })
        .await?
    }
}
