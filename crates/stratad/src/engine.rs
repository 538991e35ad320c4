//! The boundary between the daemon and the sandbox runtime.
//!
//! The daemon owns the records (which state a sandbox is in, which snapshots
//! exist, who may see them); an [`Engine`] owns the machines (QEMU processes,
//! btrfs subvolumes, guest agents) of this host and acts when told. The
//! production engine is `strata-runtime`; the trait keeps the daemon testable
//! and lets a second runtime (Firecracker) slot in.
//!
//! The trait speaks the runtime's and the agent protocol's types (one
//! vocabulary across the boundary, re-exported here for the daemon's front
//! doors and test doubles): [`Source`], [`VmInfo`], [`SnapshotInfo`],
//! [`SpaceUsage`], [`LiveVm`], [`Subvolumes`], [`VmDied`], [`TemplateBuilt`]
//! and [`RuntimeError`] from `strata-runtime`; [`ExecRequest`],
//! [`ExecEvent`] and [`DirEntry`] from `strata-proto`.
//!
//! Contract every implementation keeps:
//! - an operation that fails leaves the sandbox as it was (running if it was
//!   running), and says why through a [`RuntimeError`] (its
//!   [`RuntimeError::code`] is the API code, once);
//! - `pause`, `resume`, `delete`, `delete_snapshot` and `delete_template` are
//!   idempotent (the daemon repeats them during crash recovery);
//! - ids are chosen by the daemon and are path-safe (`strata-core` ids);
//! - [`Engine::exit_events`] reports VMs that died *unexpectedly* only, not
//!   the stops the daemon asked for (hibernate, delete, rewind).

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use strata_core::{SandboxId, SandboxSize, SnapshotId, TemplateId};

pub mod api_only;
pub mod runtime;
pub mod unavailable;

pub use strata_proto::client::{DirWatch, WatchBatch};
pub use strata_proto::{
    AgentError, Command, DirEntry, ExecEvent, ExecInput, ExecRequest, ExitStatus, FileKind,
    PtySize, Stdin,
};
pub use strata_proto::{WatchEvent, WatchKind};
pub use strata_runtime::{
    Adoption, CpuSource, DiskWrites, GuestErrorKind, LiveVm, RuntimeError, SnapshotInfo, Source,
    SpaceUsage, Subvolumes, TemplateBuilt, VmDied, VmInfo, VmUsage,
};
pub use strata_runtime::{PortCounters, PortError, PortOpenError, PortStream};

/// A command's events as the agent sends them: `Started` (from the
/// runtime; a double may leave it out), output, and [`ExecEvent::Exit`] last.
pub type ExecStream = BoxStream<'static, Result<ExecEvent, RuntimeError>>;

/// Where a running command's input goes ([`Engine::exec_interactive`]);
/// dropping it closes the command's stdin.
pub type ExecInputs = tokio::sync::mpsc::Sender<ExecInput>;

/// A stream of file bytes.
pub type ByteStream = BoxStream<'static, Result<Bytes, RuntimeError>>;

/// Progress callback of template builds: the step being done.
pub type ProgressSink = Arc<dyn Fn(&str) + Send + Sync>;

/// Result of engine operations.
pub type EngineResult<T> = Result<T, RuntimeError>;

/// The machines of one host, as the daemon drives them. Dyn-compatible:
/// the daemon holds an `Arc<dyn Engine>`.
/// A template's recipe hash and what its guest had started
/// ([`Engine::template_starts`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TemplateStarts {
    /// The recipe hash, for templates built from a recipe.
    pub recipe: Option<String>,
    /// Start commands and ready checks, base first; `None` on image-booted
    /// templates and on recipe templates published before they were kept.
    pub starts: Option<Vec<strata_runtime::StartCommand>>,
}

impl TemplateStarts {
    /// What the template's guest had started, base first: nothing for an
    /// image-booted template, `None` for a recipe template published
    /// before they were kept.
    pub fn effective(&self) -> Option<Vec<strata_runtime::StartCommand>> {
        match (&self.recipe, &self.starts) {
            (_, Some(s)) => Some(s.clone()),
            (None, None) => Some(Vec::new()),
            (Some(_), None) => None,
        }
    }
}

#[async_trait]
pub trait Engine: Send + Sync + 'static {
    /// Starts a new sandbox VM from a template or a snapshot (never a cold boot).
    async fn create(
        &self,
        id: &SandboxId,
        source: &Source,
        size: SandboxSize,
    ) -> EngineResult<VmInfo>;

    /// Creates a sandbox hibernated, without starting a VM: `snap` becomes
    /// its wake snapshot (a copy-on-write snapshot of `source`, no guest RAM
    /// or CPU used). The first [`Engine::wake`] from `snap` starts the guest
    /// as [`Engine::create`] would have (new identity, `size`).
    async fn create_hibernated(
        &self,
        id: &SandboxId,
        source: &Source,
        snap: &SnapshotId,
        size: SandboxSize,
    ) -> EngineResult<SnapshotInfo>;

    /// Starts `id` from `source` as a warm-pool guest: as [`Engine::create`]
    /// would, then paused, its egress unbound until [`Engine::claim`].
    /// Engines without warm pools answer `invalid_state` (the daemon then
    /// keeps no pool).
    async fn prewarm(
        &self,
        id: &SandboxId,
        source: &Source,
        size: SandboxSize,
    ) -> EngineResult<VmInfo> {
        let _ = (source, size);
        Err(RuntimeError::Invalid(format!(
            "sandbox {id}: this engine keeps no warm guests"
        )))
    }

    /// Hands warm guest `id` to the owner its record names now: vCPUs
    /// continue, egress bound as that record's policy says, fresh entropy
    /// and clock. On an error the guest is left (the daemon deletes it).
    async fn claim(&self, id: &SandboxId) -> EngineResult<()> {
        Err(RuntimeError::Invalid(format!(
            "sandbox {id}: this engine keeps no warm guests"
        )))
    }

    /// Snapshots a running or paused sandbox; it stays in its state.
    async fn snapshot(&self, id: &SandboxId, snap: &SnapshotId) -> EngineResult<SnapshotInfo>;

    /// Snapshots `src` (as `snap`) and starts `new_id` from that snapshot.
    async fn fork_live(
        &self,
        src: &SandboxId,
        snap: &SnapshotId,
        new_id: &SandboxId,
        size: SandboxSize,
    ) -> EngineResult<(SnapshotInfo, VmInfo)>;

    /// Returns `id` to its snapshot `to`, in place. When `pre_rewind` is given
    /// (the sandbox has a live VM), the present state is first snapshotted
    /// under that id so the rewind can be undone. The sandbox runs afterwards.
    async fn rewind(
        &self,
        id: &SandboxId,
        to: &SnapshotId,
        pre_rewind: Option<&SnapshotId>,
    ) -> EngineResult<(Option<SnapshotInfo>, VmInfo)>;

    /// Restores `id` in place from `from` without a pre-rewind snapshot
    /// (recovery of a sandbox whose VM died).
    async fn restore(&self, id: &SandboxId, from: &SnapshotId) -> EngineResult<VmInfo>;

    /// Stops the vCPUs (RAM kept). Idempotent.
    async fn pause(&self, id: &SandboxId) -> EngineResult<()>;

    /// Continues the vCPUs of a paused VM. Idempotent.
    async fn resume(&self, id: &SandboxId) -> EngineResult<()>;

    /// Snapshots (as `snap`) and ends the VM process.
    async fn hibernate(&self, id: &SandboxId, snap: &SnapshotId) -> EngineResult<SnapshotInfo>;

    /// Hibernates without memory: the guest's file systems synced and
    /// frozen, `snap` taken of the disk alone, the VM ended. A
    /// [`Engine::wake`] from `snap` cold-boots the guest from its disk.
    /// Engines that cannot answer `invalid_state`.
    async fn hibernate_disk(
        &self,
        id: &SandboxId,
        snap: &SnapshotId,
    ) -> EngineResult<SnapshotInfo> {
        let _ = snap;
        Err(RuntimeError::Invalid(format!(
            "sandbox {id}: this engine cannot hibernate without memory"
        )))
    }

    /// Restarts a hibernated sandbox from its hibernation snapshot `snap`
    /// (a disk-only one cold-boots).
    async fn wake(&self, id: &SandboxId, snap: &SnapshotId) -> EngineResult<VmInfo>;

    /// Ends the VM (if any) and removes the sandbox's subvolume. Idempotent.
    async fn delete(&self, id: &SandboxId) -> EngineResult<()>;

    /// Removes a snapshot subvolume. Idempotent.
    async fn delete_snapshot(&self, snap: &SnapshotId) -> EngineResult<()>;

    /// Exclusive and referenced bytes of a snapshot.
    async fn snapshot_usage(&self, snap: &SnapshotId) -> EngineResult<SpaceUsage>;

    /// Bytes `snap` holds that `base` (the snapshot or template it descends
    /// from; `None`: nothing) does not: its charge for pool-bytes quotas
    /// (`service::admission`). Read-only snapshots never change, so the
    /// daemon caches the answer. Engines without a pool answer nothing held.
    async fn snapshot_charge(&self, snap: &SnapshotId, base: Option<&Source>) -> EngineResult<u64> {
        let _ = (snap, base);
        Ok(0)
    }

    /// Runs a command in the guest; output streams as it comes. Its stdin
    /// is `Null` or `Bytes` ([`Stdin::Stream`] has no writer here).
    async fn exec(&self, id: &SandboxId, req: ExecRequest) -> EngineResult<ExecStream>;

    /// Runs a command the caller keeps talking to: stdin bytes, PTY window
    /// sizes ([`ExecRequest::pty`]), signals go into the returned sender.
    /// Engines without it refuse (`Unavailable`).
    async fn exec_interactive(
        &self,
        id: &SandboxId,
        req: ExecRequest,
    ) -> EngineResult<(ExecStream, ExecInputs)> {
        let _ = (id, req);
        Err(RuntimeError::Unavailable(
            "this engine does not run interactive commands".into(),
        ))
    }

    /// Streams a guest file's content.
    async fn read_file(&self, id: &SandboxId, path: &str) -> EngineResult<ByteStream>;

    /// Writes `body` to a guest file (created or truncated, `mode` bits); returns bytes written.
    async fn write_file(
        &self,
        id: &SandboxId,
        path: &str,
        mode: u32,
        body: ByteStream,
    ) -> EngineResult<u64>;

    /// Lists a guest directory.
    async fn list_dir(&self, id: &SandboxId, path: &str) -> EngineResult<Vec<DirEntry>>;

    /// Metadata of one guest path, as its directory's listing shows it
    /// (`name` = the last path component). A missing path is a
    /// [`RuntimeError::Guest`] of kind [`GuestErrorKind::NotFound`].
    async fn stat(&self, id: &SandboxId, path: &str) -> EngineResult<DirEntry>;

    /// Creates a guest directory (and its parents when `parents`).
    async fn mkdir(&self, id: &SandboxId, path: &str, parents: bool) -> EngineResult<()>;

    /// Removes a guest file or directory (a non-empty one only when `recursive`).
    async fn remove(&self, id: &SandboxId, path: &str, recursive: bool) -> EngineResult<()>;

    /// Replaces the `user.` extended attributes of a guest path named
    /// `prefix…` by `set` (full names). Engines without it refuse
    /// (`Unavailable`).
    async fn set_xattrs(
        &self,
        id: &SandboxId,
        path: &str,
        prefix: &str,
        set: std::collections::BTreeMap<String, String>,
    ) -> EngineResult<()> {
        let _ = (id, path, prefix, set);
        Err(RuntimeError::Unavailable(
            "this engine does not set extended attributes".into(),
        ))
    }

    /// Boots the image once, waits for the agent, snapshots it as template `tpl`.
    async fn build_template(
        &self,
        tpl: &TemplateId,
        size: SandboxSize,
        progress: ProgressSink,
    ) -> EngineResult<TemplateBuilt>;

    /// [`Engine::build_template`], the booted guest's system CA bundle
    /// trusting the PEM certificates of `trust` before the snapshot (the
    /// deployment's TLS interception CA). Engines that cannot refuse a
    /// `trust` they would drop.
    async fn build_template_trusting(
        &self,
        tpl: &TemplateId,
        size: SandboxSize,
        progress: ProgressSink,
        trust: Option<String>,
    ) -> EngineResult<TemplateBuilt> {
        match trust {
            None => self.build_template(tpl, size, progress).await,
            Some(_) => Err(RuntimeError::Unavailable(
                "this engine does not build templates trusting a CA".into(),
            )),
        }
    }

    /// Removes a template's subvolume. Idempotent.
    async fn delete_template(&self, tpl: &TemplateId) -> EngineResult<()>;

    /// Publishes snapshot `snap` of a (builder) sandbox as template `tpl`,
    /// carrying `recipe` (its recipe hash) and `starts` (what its guest had
    /// started, run again by a size variant); the snapshot stays. Engines
    /// without recipe builds refuse.
    async fn template_from_snapshot(
        &self,
        snap: &SnapshotId,
        tpl: &TemplateId,
        recipe: Option<String>,
        starts: Option<Vec<strata_runtime::StartCommand>>,
    ) -> EngineResult<()> {
        let _ = (snap, tpl, recipe, starts);
        Err(RuntimeError::Invalid(
            "this engine does not build templates from recipes".into(),
        ))
    }

    /// Copies template `tpl` into the new directory `dest` (a host-level
    /// cache entry by recipe hash). Engines without files refuse.
    async fn export_template(&self, tpl: &TemplateId, dest: &std::path::Path) -> EngineResult<()> {
        let _ = (tpl, dest);
        Err(RuntimeError::Invalid(
            "this engine does not export templates".into(),
        ))
    }

    /// Makes template `tpl` from a directory [`Engine::export_template`]
    /// wrote, checked restorable on this host first.
    async fn import_template(&self, src: &std::path::Path, tpl: &TemplateId) -> EngineResult<()> {
        let _ = (src, tpl);
        Err(RuntimeError::Invalid(
            "this engine does not import templates".into(),
        ))
    }

    /// What a template's content is, as a string a recipe's step hashes
    /// chain on: its recipe hash, or the image, accelerator, layout and size
    /// it was booted with. The default: its id.
    async fn template_identity(&self, tpl: &TemplateId) -> EngineResult<String> {
        Ok(tpl.to_string())
    }

    /// A template's recipe hash and what its guest had started when it was
    /// published ([`strata_runtime::StateMeta::starts`]). The default: an
    /// image-booted template (no recipe, nothing started).
    async fn template_starts(&self, tpl: &TemplateId) -> EngineResult<TemplateStarts> {
        let _ = tpl;
        Ok(TemplateStarts::default())
    }

    /// VM processes of this host (adopted or not).
    async fn live_vms(&self) -> EngineResult<Vec<LiveVm>>;

    /// Subvolumes in the pool.
    async fn subvolumes(&self) -> EngineResult<Subvolumes>;

    /// Ends every VM process of this host that belongs to no sandbox (a
    /// template build's builder VM a restart interrupted) and returns their
    /// names. Recovery calls it at start; engines without such processes
    /// keep the default.
    async fn end_strays(&self) -> EngineResult<Vec<String>> {
        Ok(Vec::new())
    }

    /// Takes over a VM that survived a daemon restart (reconnects QMP and agent).
    async fn adopt(&self, id: &SandboxId) -> EngineResult<VmInfo>;

    /// Whether a running sandbox's agent answers within `within` (recovery
    /// checks every VM it adopted and continued). Engines without an agent
    /// channel keep the default.
    async fn probe_agent(&self, _id: &SandboxId, _within: std::time::Duration) -> EngineResult<()> {
        Ok(())
    }

    /// What every live VM of this host uses now (cumulative CPU time,
    /// resident guest RAM, disk allocation): the counters the daemon's
    /// sampler (`service::sampler`) turns into per-sandbox series. Cheap
    /// (a few `/proc` and `stat` reads per VM); engines without VMs answer
    /// nothing.
    async fn usage(&self) -> EngineResult<Vec<VmUsage>> {
        Ok(Vec::new())
    }

    /// The storage pool's space now (`statvfs` on its root, a few
    /// microseconds): read by the sampler on its tick for the host's
    /// figures. `None`: this engine has no pool.
    async fn pool_space(&self) -> EngineResult<Option<crate::host::PoolSpace>> {
        Ok(None)
    }

    /// Calls in flight on sandbox `id`'s agent connection now (exec, files,
    /// egress and port tunnels); `None`: no live VM, or an engine that
    /// cannot tell (then nothing counts it as idle).
    fn open_calls(&self, id: &SandboxId) -> Option<u32> {
        let _ = id;
        None
    }

    /// The root disk's write counters of running sandbox `id`'s VM since
    /// its process started (QMP `query-blockstats`), with that process's
    /// pid: what `service::unchanged` compares to decide that a guest wrote
    /// nothing since its last snapshot. `None`: this engine cannot tell
    /// (the daemon then never skips a snapshot).
    async fn disk_writes(&self, id: &SandboxId) -> EngineResult<Option<DiskWrites>> {
        let _ = id;
        Ok(None)
    }

    /// Opens a byte stream to `127.0.0.1:<port>` inside the running
    /// sandbox `id`, over its agent channel. Engines without one refuse
    /// ([`PortError::Unsupported`]).
    async fn connect_port(&self, id: &SandboxId, port: u16) -> Result<PortStream, PortOpenError> {
        let _ = (id, port);
        Err(PortOpenError::Port(PortError::Unsupported))
    }

    /// Starts an inotify watch of guest directory `path` of the running
    /// sandbox `id` (with `recursive`, of the tree below it), polled through
    /// the returned [`DirWatch`]; dropping it ends the watch. Engines
    /// without it refuse (`Unavailable`), and so does an agent older than
    /// watches (`Agent` with [`AgentError::Unsupported`]): callers fall
    /// back to listing.
    async fn watch_dir(
        &self,
        id: &SandboxId,
        path: &str,
        recursive: bool,
    ) -> EngineResult<DirWatch> {
        let _ = (id, path, recursive);
        Err(RuntimeError::Unavailable(
            "this engine does not watch directories".into(),
        ))
    }

    /// Whether this engine signs its snapshots and templates and refuses
    /// unsigned ones on restore (`strata_runtime::signing`). Engines
    /// without files keep the default.
    fn signs_states(&self) -> bool {
        false
    }

    /// Signs a snapshot or template made before signing so it keeps
    /// restoring ([`strata_runtime::Runtime::adopt_unsigned`]); the daemon
    /// asks once per state it has a record of. Engines that do not sign
    /// refuse.
    async fn adopt_unsigned(&self, state: &Source) -> EngineResult<Adoption> {
        let _ = state;
        Err(RuntimeError::Unavailable(
            "this engine does not sign states".into(),
        ))
    }

    /// The identity `btrfs send` gives snapshot `snap` in a stream
    /// (hyphenated hex; docs/move.md). Engines without subvolumes refuse.
    async fn snapshot_identity(&self, snap: &SnapshotId) -> EngineResult<String> {
        let _ = snap;
        Err(RuntimeError::Unavailable(
            "this engine does not move snapshots".into(),
        ))
    }

    /// Makes this host's own snapshot `snap` a parent a stream can be
    /// received against (a sandbox coming back: docs/move.md "A return
    /// move"); answers its identity (hyphenated hex). Engines without
    /// subvolumes refuse.
    async fn anchor_snapshot(&self, snap: &SnapshotId) -> EngineResult<String> {
        let _ = snap;
        Err(RuntimeError::Unavailable(
            "this engine does not move snapshots".into(),
        ))
    }

    /// The snapshots received whole into this host's import directory:
    /// (snapshot id, the sender's identity, hyphenated hex).
    async fn received_snapshots(&self) -> EngineResult<Vec<(String, String)>> {
        Err(RuntimeError::Unavailable(
            "this engine does not move snapshots".into(),
        ))
    }

    /// Streams snapshot `snap` (a `btrfs send` stream, incremental against
    /// `parent`); a failed send ends the stream with an error.
    async fn send_snapshot(
        &self,
        snap: &SnapshotId,
        parent: Option<&SnapshotId>,
    ) -> EngineResult<ByteStream> {
        let _ = (snap, parent);
        Err(RuntimeError::Unavailable(
            "this engine does not move snapshots".into(),
        ))
    }

    /// Receives snapshot `snap` from the hostile stream `input` (at most
    /// `max_bytes`, incremental against the received subvolume whose
    /// identity is `parent`) and publishes it signed by this host; returns
    /// the stream bytes applied (0: it had been received whole before).
    async fn receive_snapshot(
        &self,
        snap: &SnapshotId,
        parent: Option<String>,
        max_bytes: u64,
        input: ByteStream,
    ) -> EngineResult<u64> {
        let _ = (snap, parent, max_bytes, input);
        Err(RuntimeError::Unavailable(
            "this engine does not move snapshots".into(),
        ))
    }

    /// Removes the import anchor of received snapshot `snap` (the parent of
    /// later incremental streams), if any; its published copy stays.
    async fn delete_received_snapshot(&self, snap: &SnapshotId) -> EngineResult<()> {
        let _ = snap;
        Ok(())
    }

    /// Whether template `tpl`'s subvolume is on this host. Engines without
    /// subvolumes hold every template they know.
    async fn has_template(&self, tpl: &TemplateId) -> EngineResult<bool> {
        let _ = tpl;
        Ok(true)
    }

    /// The identity under which this host holds template `tpl` as the
    /// parent of an incremental stream (its received copy first), if any.
    async fn received_template_identity(&self, tpl: &TemplateId) -> EngineResult<Option<String>> {
        let _ = tpl;
        Ok(None)
    }

    /// Streams template `tpl` (a `btrfs send` stream), incremental against
    /// template `parent` when this host holds it under the identity given,
    /// else in full; returns the stream and the parent identity it uses.
    async fn send_template(
        &self,
        tpl: &TemplateId,
        parent: Option<(TemplateId, String)>,
    ) -> EngineResult<(ByteStream, Option<String>)> {
        let _ = (tpl, parent);
        Err(RuntimeError::Unavailable(
            "this engine does not move templates".into(),
        ))
    }

    /// Receives template `tpl` from the hostile stream `input` (at most
    /// `max_bytes`, incremental against the received subvolume `parent`)
    /// and publishes it once restorable here with a signature that
    /// verifies; returns the stream bytes applied.
    async fn receive_template(
        &self,
        tpl: &TemplateId,
        parent: Option<String>,
        max_bytes: u64,
        input: ByteStream,
    ) -> EngineResult<u64> {
        let _ = (tpl, parent, max_bytes, input);
        Err(RuntimeError::Unavailable(
            "this engine does not move templates".into(),
        ))
    }

    /// VMs that died unexpectedly. Called once, at start.
    fn exit_events(&self) -> tokio::sync::mpsc::UnboundedReceiver<VmDied>;
}
