//! The boundary between the daemon and the sandbox runtime.
//!
//! The daemon owns the records (which state a sandbox is in, which snapshots
//! exist, who may see them); an [`Engine`] owns the machines (QEMU processes,
//! btrfs subvolumes, guest agents) of this host and acts when told. The
//! production engine is `strata-runtime`; the trait keeps the daemon testable
//! and lets a second runtime (Firecracker) slot in.
//!
//! Contract every implementation keeps:
//! - an operation that fails leaves the sandbox as it was (running if it was
//!   running), and says why through [`EngineError`];
//! - `pause`, `resume`, `delete`, `delete_snapshot` and `delete_template` are
//!   idempotent (the daemon repeats them during crash recovery);
//! - ids are chosen by the daemon and are path-safe (`strata-core` ids);
//! - [`Engine::exit_events`] reports VMs that died *unexpectedly* only, not
//!   the stops the daemon asked for (hibernate, delete, rewind).

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};
use strata_core::{ErrorCode, SandboxId, SandboxSize, SnapshotId, TemplateId};

pub mod runtime;
pub mod unavailable;

/// What a new sandbox starts from (mirrors `strata_runtime::Source`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A template (a snapshot of a freshly booted guest).
    Template(TemplateId),
    /// Any ready snapshot (a fork).
    Snapshot(SnapshotId),
}

/// Facts about a live sandbox VM (mirrors `strata_runtime::VmInfo`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmInfo {
    /// VM process id.
    pub pid: u32,
    /// Resolved accelerator (`tcg`, `kvm`).
    pub accel: String,
    /// Size the VM runs with.
    pub size: SandboxSize,
    /// Milliseconds from request to agent answering.
    pub ready_ms: f64,
}

/// What a snapshot cost (mirrors `strata_runtime::SnapshotInfo`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    /// Snapshot id.
    pub id: SnapshotId,
    /// How long the guest's vCPUs were stopped, in ms.
    pub pause_ms: f64,
    /// Bytes of device state written.
    pub device_state_bytes: u64,
    /// When it was taken.
    pub created_at: DateTime<Utc>,
}

/// Space used by a snapshot (mirrors `strata_runtime::SpaceUsage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpaceUsage {
    /// Bytes only this snapshot holds.
    pub exclusive_bytes: u64,
    /// Bytes it references in all (shared = referenced - exclusive).
    pub referenced_bytes: u64,
}

/// A VM process found alive on this host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveVm {
    /// The sandbox it belongs to.
    pub id: SandboxId,
    /// Its process id.
    pub pid: u32,
    /// Whether its vCPUs are stopped.
    pub paused: bool,
}

/// The subvolumes found in the pool.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Subvolumes {
    /// `<pool>/sandboxes/<id>`.
    pub sandboxes: Vec<SandboxId>,
    /// `<pool>/snapshots/<id>`.
    pub snapshots: Vec<SnapshotId>,
    /// `<pool>/templates/<id>`.
    pub templates: Vec<TemplateId>,
}

/// A VM that ended without being asked to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitEvent {
    /// The sandbox whose VM died.
    pub id: SandboxId,
    /// What the engine knows (exit status, signal, last console lines).
    pub reason: String,
}

/// A command to run in the guest.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecRequest {
    /// Program and arguments (`argv`).
    pub cmd: Vec<String>,
    /// Extra environment variables.
    pub env: BTreeMap<String, String>,
    /// Working directory in the guest.
    pub cwd: Option<String>,
    /// Bytes fed to the command's standard input, then closed.
    pub stdin: Option<Vec<u8>>,
    /// Kill the command after this many seconds.
    pub timeout_s: Option<u64>,
}

/// One piece of a running command's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    /// Bytes the command wrote to stdout.
    Stdout(Bytes),
    /// Bytes the command wrote to stderr.
    Stderr(Bytes),
    /// The command ended; always the last event.
    Exit {
        /// Exit code, if it exited.
        code: Option<i32>,
        /// Signal number, if it was killed.
        signal: Option<i32>,
    },
}

/// A stream of output events, ending with [`ExecEvent::Exit`].
pub type ExecStream = BoxStream<'static, Result<ExecEvent, EngineError>>;

/// A stream of file bytes.
pub type ByteStream = BoxStream<'static, Result<Bytes, EngineError>>;

/// Kind of a guest file system entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FileKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Anything else (device, fifo, socket).
    Other,
}

/// Metadata of a guest file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    /// Entry name (last path component) or full path for `stat`.
    pub name: String,
    /// Kind of entry.
    pub kind: FileKind,
    /// Size in bytes.
    pub size: u64,
    /// Unix permission bits.
    pub mode: u32,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
}

/// A template the engine built.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateInfo {
    /// Template id.
    pub id: TemplateId,
    /// Size the template guest was booted with.
    pub size: SandboxSize,
    /// Accelerator it was made under (restores need the same).
    pub accel: String,
    /// Milliseconds the build took.
    pub build_ms: f64,
}

/// Progress callback of long builds: `(step, fraction done if known)`.
pub type ProgressSink = Arc<dyn Fn(&str, Option<f32>) + Send + Sync>;

/// Why an engine operation failed. Mirrors `strata_runtime::RuntimeError`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// No live VM / subvolume for this sandbox.
    #[error("sandbox {0} not found on this host")]
    SandboxNotFound(String),
    /// No such snapshot or template.
    #[error("snapshot {0} not found on this host")]
    SnapshotNotFound(String),
    /// The operation needs a running VM.
    #[error("sandbox {0} is not running")]
    NotRunning(String),
    /// A snapshot is missing a part or incompatible with this host.
    #[error("snapshot {id} is unusable: {reason}")]
    SnapshotUnusable {
        /// Snapshot or template id.
        id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The storage pool is full.
    #[error("storage pool is full")]
    PoolFull,
    /// The VM failed or died.
    #[error("vm of {id} failed: {reason}")]
    VmFailed {
        /// Sandbox id.
        id: String,
        /// Why.
        reason: String,
    },
    /// The guest agent did not answer in time.
    #[error("agent of {id} did not answer within {timeout_ms} ms")]
    AgentTimeout {
        /// Sandbox id.
        id: String,
        /// Timeout that expired.
        timeout_ms: u64,
    },
    /// The guest agent reported an error (no such file, permission denied...).
    #[error("guest: {0}")]
    Agent(String),
    /// The request cannot be satisfied as asked (size the snapshot cannot give,
    /// snapshot of another sandbox, invalid guest path).
    #[error("{0}")]
    Invalid(String),
    /// A guest path does not exist.
    #[error("{0}")]
    GuestNotFound(String),
    /// The engine is busy with this resource.
    #[error("another operation is in progress on {0}")]
    Busy(String),
    /// No runtime is linked into this daemon (see [`unavailable`]).
    #[error("{0}")]
    Unavailable(String),
    /// Anything else.
    #[error("{0}")]
    Other(String),
}

impl EngineError {
    /// The stable API code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            EngineError::SandboxNotFound(_) | EngineError::SnapshotNotFound(_) => {
                ErrorCode::NotFound
            }
            EngineError::NotRunning(_) => ErrorCode::InvalidState,
            EngineError::SnapshotUnusable { .. } => ErrorCode::SnapshotUnusable,
            EngineError::PoolFull => ErrorCode::PoolFull,
            EngineError::VmFailed { .. } => ErrorCode::VmFailed,
            EngineError::AgentTimeout { .. } => ErrorCode::AgentTimeout,
            EngineError::Agent(_) => ErrorCode::AgentError,
            EngineError::Busy(_) => ErrorCode::Conflict,
            EngineError::Invalid(_) => ErrorCode::InvalidRequest,
            EngineError::GuestNotFound(_) => ErrorCode::NotFound,
            EngineError::Unavailable(_) | EngineError::Other(_) => ErrorCode::Internal,
        }
    }
}

/// Result of engine operations.
pub type EngineResult<T> = Result<T, EngineError>;

/// The machines of one host, as the daemon drives them. Dyn-compatible:
/// the daemon holds an `Arc<dyn Engine>`.
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

    /// Restarts a hibernated sandbox from its hibernation snapshot `snap`.
    async fn wake(&self, id: &SandboxId, snap: &SnapshotId) -> EngineResult<VmInfo>;

    /// Ends the VM (if any) and removes the sandbox's subvolume. Idempotent.
    async fn delete(&self, id: &SandboxId) -> EngineResult<()>;

    /// Removes a snapshot subvolume. Idempotent.
    async fn delete_snapshot(&self, snap: &SnapshotId) -> EngineResult<()>;

    /// Exclusive and referenced bytes of a snapshot.
    async fn snapshot_usage(&self, snap: &SnapshotId) -> EngineResult<SpaceUsage>;

    /// Runs a command in the guest; output streams as it comes.
    async fn exec(&self, id: &SandboxId, req: ExecRequest) -> EngineResult<ExecStream>;

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
    async fn list_dir(&self, id: &SandboxId, path: &str) -> EngineResult<Vec<FileStat>>;

    /// Metadata of one guest path.
    async fn stat(&self, id: &SandboxId, path: &str) -> EngineResult<FileStat>;

    /// Creates a guest directory (and its parents when `parents`).
    async fn mkdir(&self, id: &SandboxId, path: &str, parents: bool) -> EngineResult<()>;

    /// Removes a guest file or directory (a non-empty one only when `recursive`).
    async fn remove(&self, id: &SandboxId, path: &str, recursive: bool) -> EngineResult<()>;

    /// Boots the image once, waits for the agent, snapshots it as template `tpl`.
    async fn build_template(
        &self,
        tpl: &TemplateId,
        size: SandboxSize,
        progress: ProgressSink,
    ) -> EngineResult<TemplateInfo>;

    /// Removes a template's subvolume. Idempotent.
    async fn delete_template(&self, tpl: &TemplateId) -> EngineResult<()>;

    /// VM processes of this host (adopted or not).
    async fn live_vms(&self) -> EngineResult<Vec<LiveVm>>;

    /// Subvolumes in the pool.
    async fn subvolumes(&self) -> EngineResult<Subvolumes>;

    /// Takes over a VM that survived a daemon restart (reconnects QMP and agent).
    async fn adopt(&self, id: &SandboxId) -> EngineResult<VmInfo>;

    /// VMs that died unexpectedly. Called once, at start.
    fn exit_events(&self) -> tokio::sync::mpsc::UnboundedReceiver<ExitEvent>;
}
